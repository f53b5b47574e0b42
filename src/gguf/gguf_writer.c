/* GGUF v3 writer (layout: shared/docs/gguf-facts.md §1). Tensors are packed
 * the way llama.cpp's strict reader wants them: in add order, each starting
 * at the previous one's end padded to the alignment (§1.3, §1.4). The
 * alignment is 32 unless a valid UINT32 `general.alignment` KV is set (or
 * copied), in which case that value is used for the layout. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "gguf/gguf.h"
#include "gguf/gguf_impl.h"

struct wkv {
    char *key;
    uint8_t *raw; /* key length + key + type + value, as stored in the file */
    size_t raw_len;
};

struct wtensor {
    char name[KVS_GGUF_MAX_NAME];
    enum kvs_type type;
    uint32_t n_dims;
    int64_t ne[KVS_GGUF_MAX_DIMS];
    const void *data;
    uint64_t bytes;
    uint64_t offset; /* relative to the data section */
};

struct kvs_gguf_writer {
    struct wkv *kvs;
    size_t n_kv, cap_kv;
    struct wtensor *t;
    size_t n_t, cap_t;
    uint32_t alignment;
};

struct kvs_gguf_writer *kvs_gguf_writer_create(void)
{
    struct kvs_gguf_writer *w = calloc(1, sizeof *w);
    if (w)
        w->alignment = KVS_GGUF_DEFAULT_ALIGNMENT;
    return w;
}

void kvs_gguf_writer_free(struct kvs_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kvs[i].key);
        free(w->kvs[i].raw);
    }
    free(w->kvs);
    free(w->t);
    free(w);
}

static bool wgrow(void **p, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap)
        return true;
    size_t nc = *cap ? *cap * 2 : 16;
    if (nc > SIZE_MAX / elem)
        return false;
    void *q = realloc(*p, nc * elem);
    if (!q)
        return false;
    *p = q;
    *cap = nc;
    return true;
}

static void relayout(struct kvs_gguf_writer *w)
{
    uint64_t off = 0;
    for (size_t i = 0; i < w->n_t; i++) {
        w->t[i].offset = off;
        off += kvs_gguf_pad(w->t[i].bytes, w->alignment);
    }
}

/* Takes ownership of raw (freed on failure). */
static kvs_err put_kv(struct kvs_gguf_writer *w, const char *key, uint8_t *raw, size_t raw_len)
{
    /* general.alignment drives the layout: validate it here. */
    if (strcmp(key, "general.alignment") == 0) {
        size_t klen = strlen(key);
        uint32_t type = kvs_gguf_ld32(raw + 8 + klen);
        uint32_t a = type == KVS_GGUF_TYPE_UINT32 ? kvs_gguf_ld32(raw + 12 + klen) : 0;
        if (a == 0 || (a & (a - 1)) != 0) {
            free(raw);
            return KVS_ERR_ARG;
        }
        w->alignment = a;
        relayout(w);
    }
    for (size_t i = 0; i < w->n_kv; i++)
        if (strcmp(w->kvs[i].key, key) == 0) {
            free(w->kvs[i].raw);
            w->kvs[i].raw = raw;
            w->kvs[i].raw_len = raw_len;
            return KVS_OK;
        }
    char *k = strdup(key);
    if (!k || !wgrow((void **)&w->kvs, &w->cap_kv, w->n_kv, sizeof *w->kvs)) {
        free(k);
        free(raw);
        return KVS_ERR_NOMEM;
    }
    w->kvs[w->n_kv++] = (struct wkv){ k, raw, raw_len };
    return KVS_OK;
}

/* Builds key + type + `vlen` value bytes; returns the buffer with the value
 * area at *val (to be filled by the caller). */
static uint8_t *raw_new(const char *key, enum kvs_gguf_type type, size_t vlen, size_t *raw_len, uint8_t **val)
{
    size_t klen = strlen(key);
    if (klen == 0 || vlen > SIZE_MAX - 12 - klen)
        return NULL;
    size_t n = 12 + klen + vlen;
    uint8_t *p = malloc(n);
    if (!p)
        return NULL;
    kvs_gguf_st64(p, klen);
    memcpy(p + 8, key, klen);
    kvs_gguf_st32(p + 8 + klen, (uint32_t)type);
    *val = p + 12 + klen;
    *raw_len = n;
    return p;
}

static kvs_err set_scalar(struct kvs_gguf_writer *w, const char *key, enum kvs_gguf_type type, const void *v,
                          size_t sz)
{
    if (!w || !key || !*key)
        return KVS_ERR_ARG;
    size_t n;
    uint8_t *val;
    uint8_t *raw = raw_new(key, type, sz, &n, &val);
    if (!raw)
        return KVS_ERR_NOMEM;
    /* Host values to little-endian bytes. */
    uint64_t u = 0;
    memcpy(&u, v, sz);
    for (size_t i = 0; i < sz; i++)
        val[i] = (uint8_t)(u >> (8 * i));
    return put_kv(w, key, raw, n);
}

kvs_err kvs_gguf_writer_set_u32(struct kvs_gguf_writer *w, const char *key, uint32_t v)
{
    return set_scalar(w, key, KVS_GGUF_TYPE_UINT32, &v, 4);
}
kvs_err kvs_gguf_writer_set_i32(struct kvs_gguf_writer *w, const char *key, int32_t v)
{
    return set_scalar(w, key, KVS_GGUF_TYPE_INT32, &v, 4);
}
kvs_err kvs_gguf_writer_set_u64(struct kvs_gguf_writer *w, const char *key, uint64_t v)
{
    return set_scalar(w, key, KVS_GGUF_TYPE_UINT64, &v, 8);
}
kvs_err kvs_gguf_writer_set_f32(struct kvs_gguf_writer *w, const char *key, float v)
{
    return set_scalar(w, key, KVS_GGUF_TYPE_FLOAT32, &v, 4);
}
kvs_err kvs_gguf_writer_set_bool(struct kvs_gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    return set_scalar(w, key, KVS_GGUF_TYPE_BOOL, &b, 1);
}

kvs_err kvs_gguf_writer_set_str(struct kvs_gguf_writer *w, const char *key, const char *s)
{
    if (!w || !key || !*key || !s)
        return KVS_ERR_ARG;
    size_t sl = strlen(s), n;
    uint8_t *val;
    if (sl > SIZE_MAX - 8)
        return KVS_ERR_NOMEM;
    uint8_t *raw = raw_new(key, KVS_GGUF_TYPE_STRING, 8 + sl, &n, &val);
    if (!raw)
        return KVS_ERR_NOMEM;
    kvs_gguf_st64(val, sl);
    memcpy(val + 8, s, sl);
    return put_kv(w, key, raw, n);
}

kvs_err kvs_gguf_writer_set_arr(struct kvs_gguf_writer *w, const char *key, enum kvs_gguf_type elem_type,
                                const void *data, uint64_t n)
{
    if (!w || !key || !*key || (n && !data))
        return KVS_ERR_ARG;
    size_t sz = kvs_gguf_scalar_size(elem_type);
    if (sz == 0)
        return KVS_ERR_ARG; /* STRING (use set_arr_str), ARRAY, invalid */
    if (n > (SIZE_MAX - 64) / sz)
        return KVS_ERR_NOMEM;
    size_t rl;
    uint8_t *val;
    uint8_t *raw = raw_new(key, KVS_GGUF_TYPE_ARRAY, 12 + (size_t)n * sz, &rl, &val);
    if (!raw)
        return KVS_ERR_NOMEM;
    kvs_gguf_st32(val, (uint32_t)elem_type);
    kvs_gguf_st64(val + 4, n);
    if (n)
        memcpy(val + 12, data, (size_t)n * sz); /* callers pass LE data (all our hosts are LE) */
    return put_kv(w, key, raw, rl);
}

kvs_err kvs_gguf_writer_set_arr_str(struct kvs_gguf_writer *w, const char *key, const char *const *strs,
                                    uint64_t n)
{
    if (!w || !key || !*key || (n && !strs))
        return KVS_ERR_ARG;
    size_t total = 12;
    for (uint64_t j = 0; j < n; j++) {
        if (!strs[j])
            return KVS_ERR_ARG;
        size_t sl = strlen(strs[j]);
        if (sl > SIZE_MAX - 8 - total - 64)
            return KVS_ERR_NOMEM;
        total += 8 + sl;
    }
    size_t rl;
    uint8_t *val;
    uint8_t *raw = raw_new(key, KVS_GGUF_TYPE_ARRAY, total, &rl, &val);
    if (!raw)
        return KVS_ERR_NOMEM;
    kvs_gguf_st32(val, KVS_GGUF_TYPE_STRING);
    kvs_gguf_st64(val + 4, n);
    uint8_t *p = val + 12;
    for (uint64_t j = 0; j < n; j++) {
        size_t sl = strlen(strs[j]);
        kvs_gguf_st64(p, sl);
        memcpy(p + 8, strs[j], sl);
        p += 8 + sl;
    }
    return put_kv(w, key, raw, rl);
}

kvs_err kvs_gguf_writer_copy_kv(struct kvs_gguf_writer *w, const struct kvs_gguf *src, size_t i)
{
    if (!w || !src || i >= kvs_gguf_n_kv(src))
        return KVS_ERR_ARG;
    const uint8_t *p;
    size_t n;
    kvs_err e = kvs_gguf_kv_raw(src, i, &p, &n);
    if (e)
        return e;
    uint8_t *raw = malloc(n);
    if (!raw)
        return KVS_ERR_NOMEM;
    memcpy(raw, p, n); /* v2 and v3 KV encodings are identical */
    return put_kv(w, kvs_gguf_key(src, i), raw, n);
}

kvs_err kvs_gguf_writer_add_tensor(struct kvs_gguf_writer *w, const char *name, enum kvs_type type,
                                   uint32_t n_dims, const int64_t *ne, const void *data, uint64_t bytes)
{
    if (!w || !name || !ne)
        return KVS_ERR_ARG;
    size_t nl = strlen(name);
    if (nl == 0 || nl >= KVS_GGUF_MAX_NAME || n_dims == 0 || n_dims > KVS_GGUF_MAX_DIMS)
        return KVS_ERR_ARG;
    uint32_t be, bb;
    if (!kvs_type_block(type, &be, &bb))
        return KVS_ERR_ARG;
    int64_t nel = 1;
    for (uint32_t d = 0; d < n_dims; d++)
        if (ne[d] <= 0 || __builtin_mul_overflow(nel, ne[d], &nel))
            return KVS_ERR_ARG;
    uint64_t want;
    if (ne[0] % be != 0 || __builtin_mul_overflow((uint64_t)nel / be, (uint64_t)bb, &want) || want != bytes)
        return KVS_ERR_ARG;
    for (size_t i = 0; i < w->n_t; i++)
        if (strcmp(w->t[i].name, name) == 0)
            return KVS_ERR_ARG;
    if (!wgrow((void **)&w->t, &w->cap_t, w->n_t, sizeof *w->t))
        return KVS_ERR_NOMEM;
    struct wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    memcpy(t->name, name, nl + 1);
    t->type = type;
    t->n_dims = n_dims;
    for (int d = 0; d < KVS_GGUF_MAX_DIMS; d++)
        t->ne[d] = d < (int)n_dims ? ne[d] : 1;
    t->data = data;
    t->bytes = bytes;
    t->offset = w->n_t ? w->t[w->n_t - 1].offset + kvs_gguf_pad(w->t[w->n_t - 1].bytes, w->alignment) : 0;
    w->n_t++;
    return KVS_OK;
}

static uint64_t unpadded_header(const struct kvs_gguf_writer *w)
{
    uint64_t n = 24;
    for (size_t i = 0; i < w->n_kv; i++)
        n += w->kvs[i].raw_len;
    for (size_t i = 0; i < w->n_t; i++)
        n += 8 + strlen(w->t[i].name) + 4 + 8ull * w->t[i].n_dims + 4 + 8;
    return n;
}

uint64_t kvs_gguf_writer_header_bytes(const struct kvs_gguf_writer *w)
{
    return kvs_gguf_pad(unpadded_header(w), w->alignment);
}

uint64_t kvs_gguf_writer_tensor_offset(const struct kvs_gguf_writer *w, size_t i)
{
    if (i >= w->n_t)
        return 0;
    return kvs_gguf_writer_header_bytes(w) + w->t[i].offset;
}

uint64_t kvs_gguf_writer_total_bytes(const struct kvs_gguf_writer *w)
{
    uint64_t n = kvs_gguf_writer_header_bytes(w);
    if (w->n_t) {
        const struct wtensor *t = &w->t[w->n_t - 1];
        n += t->offset + kvs_gguf_pad(t->bytes, w->alignment);
    }
    return n;
}

kvs_err kvs_gguf_writer_header(const struct kvs_gguf_writer *w, uint8_t **buf, size_t *len)
{
    if (!w || !buf || !len)
        return KVS_ERR_ARG;
    uint64_t total = kvs_gguf_writer_header_bytes(w);
    if (total > SIZE_MAX)
        return KVS_ERR_NOMEM;
    uint8_t *b = calloc(1, (size_t)total);
    if (!b)
        return KVS_ERR_NOMEM;
    uint8_t *p = b;
    kvs_gguf_st32(p, KVS_GGUF_MAGIC);
    kvs_gguf_st32(p + 4, 3);
    kvs_gguf_st64(p + 8, w->n_t);
    kvs_gguf_st64(p + 16, w->n_kv);
    p += 24;
    for (size_t i = 0; i < w->n_kv; i++) {
        memcpy(p, w->kvs[i].raw, w->kvs[i].raw_len);
        p += w->kvs[i].raw_len;
    }
    for (size_t i = 0; i < w->n_t; i++) {
        const struct wtensor *t = &w->t[i];
        size_t nl = strlen(t->name);
        kvs_gguf_st64(p, nl);
        memcpy(p + 8, t->name, nl);
        p += 8 + nl;
        kvs_gguf_st32(p, t->n_dims);
        p += 4;
        for (uint32_t d = 0; d < t->n_dims; d++, p += 8)
            kvs_gguf_st64(p, (uint64_t)t->ne[d]);
        kvs_gguf_st32(p, (uint32_t)t->type);
        kvs_gguf_st64(p + 4, t->offset);
        p += 12;
    }
    /* The rest of b is the zero padding (calloc). */
    *buf = b;
    *len = (size_t)total;
    return KVS_OK;
}

static bool pwrite_all(int fd, const void *data, uint64_t n, uint64_t off)
{
    const uint8_t *p = data;
    while (n > 0) {
        size_t chunk = n > (1u << 30) ? (1u << 30) : (size_t)n;
        ssize_t k = pwrite(fd, p, chunk, (off_t)off);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0)
            return false;
        p += k;
        n -= (uint64_t)k;
        off += (uint64_t)k;
    }
    return true;
}

kvs_err kvs_gguf_writer_write_file(const struct kvs_gguf_writer *w, const char *path)
{
    if (!w || !path)
        return KVS_ERR_ARG;
    char tmp[4096];
    int tl = snprintf(tmp, sizeof tmp, "%s.tmp", path);
    if (tl < 0 || (size_t)tl >= sizeof tmp)
        return KVS_ERR_ARG;
    uint8_t *hdr;
    size_t hlen;
    kvs_err e = kvs_gguf_writer_header(w, &hdr, &hlen);
    if (e)
        return e;
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        KVS_LOGE("gguf writer: %s: %s", tmp, strerror(errno));
        free(hdr);
        return KVS_ERR_IO;
    }
    bool ok = pwrite_all(fd, hdr, hlen, 0);
    free(hdr);
    for (size_t i = 0; ok && i < w->n_t; i++)
        if (w->t[i].data)
            ok = pwrite_all(fd, w->t[i].data, w->t[i].bytes, hlen + w->t[i].offset);
    ok = ok && ftruncate(fd, (off_t)kvs_gguf_writer_total_bytes(w)) == 0;
    ok = ok && fdatasync(fd) == 0;
    int en = errno;
    ok = (close(fd) == 0) && ok;
    if (ok && rename(tmp, path) != 0) {
        en = errno;
        ok = false;
    }
    if (!ok) {
        KVS_LOGE("gguf writer: writing %s: %s", path, strerror(en));
        unlink(tmp);
        return KVS_ERR_IO;
    }
    return KVS_OK;
}

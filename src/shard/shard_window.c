/* Shard windows: which tensors a window needs, whether a file can serve a
 * window, and the writer layout shared by extract and fetch. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "shard/shard_impl.h"
#include "common/hex.h"

kvs_err kvs_shard__err(kvs_err err, char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (errbuf && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(errbuf, errlen, fmt, ap);
        va_end(ap);
    }
    return err;
}

kvs_err kvs_shard_sha256(const void *data, size_t n, uint8_t out[32])
{
    unsigned int len = 0;
    if (!EVP_Digest(data, n, out, &len, EVP_sha256(), NULL) || len != 32)
        return KVS_ERR_INTERNAL;
    return KVS_OK;
}

kvs_err kvs_shard__digest_of_digests(const uint8_t (*sha)[32], size_t n, uint8_t out[32])
{
    static const uint8_t empty = 0;
    return kvs_shard_sha256(n ? (const void *)sha : (const void *)&empty, n * 32, out);
}

void kvs_shard_hex(const uint8_t d[32], char hex[65])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < 32; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[64] = '\0';
}


bool kvs_shard_unhex(const char *hex, size_t len, uint8_t d[32])
{
    if (!hex || len != 64)
        return false;
    for (int i = 0; i < 32; i++) {
        int hi = kvs_hex_value(hex[2 * i]), lo = kvs_hex_value(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return false;
        d[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

kvs_err kvs_shard_parse_window(const char *s, uint32_t *begin, uint32_t *end)
{
    if (!s)
        return KVS_ERR_ARG;
    char *colon = NULL;
    errno = 0;
    if (*s < '0' || *s > '9')
        return KVS_ERR_ARG;
    unsigned long b = strtoul(s, &colon, 10);
    if (errno || *colon != ':' || colon[1] < '0' || colon[1] > '9' || b > UINT32_MAX)
        return KVS_ERR_ARG;
    char *rest = NULL;
    unsigned long e = strtoul(colon + 1, &rest, 10);
    if (errno || *rest != '\0' || e > UINT32_MAX || b >= e)
        return KVS_ERR_ARG;
    *begin = (uint32_t)b;
    *end = (uint32_t)e;
    return KVS_OK;
}

kvs_err kvs_shard_block_count(const struct kvs_gguf *g, uint32_t *n_block)
{
    const char *arch = NULL;
    size_t alen = 0;
    kvs_err err = kvs_gguf_get_str(g, "general.architecture", &arch, &alen);
    if (err)
        return err;
    char key[128];
    if (alen == 0 || alen > 100)
        return KVS_ERR_FORMAT;
    snprintf(key, sizeof key, "%.*s.block_count", (int)alen, arch);
    uint32_t n = 0, nextn = 0;
    if ((err = kvs_gguf_get_u32(g, key, &n)))
        return err;
    snprintf(key, sizeof key, "%.*s.nextn_predict_layers", (int)alen, arch);
    err = kvs_gguf_get_u32(g, key, &nextn);
    if (err && err != KVS_ERR_NOT_FOUND)
        return err;
    if (err == KVS_ERR_NOT_FOUND)
        nextn = 0;
    if (nextn >= n)
        return KVS_ERR_FORMAT;
    *n_block = n - nextn;
    return KVS_OK;
}

/* If name is "blk.N.<rest>", stores N and returns true. */
static bool block_of(const char *name, uint32_t *n)
{
    if (strncmp(name, "blk.", 4) != 0)
        return false;
    const char *p = name + 4;
    uint64_t v = 0;
    if (*p < '0' || *p > '9')
        return false;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t)(*p - '0');
        if (v > UINT32_MAX)
            return false;
        p++;
    }
    if (*p != '.')
        return false;
    *n = (uint32_t)v;
    return true;
}

static bool has_prefix(const char *name, const char *stem)
{
    size_t k = strlen(stem);
    return strncmp(name, stem, k) == 0 && name[k] == '.';
}

kvs_err kvs_shard_window_tensors(const struct kvs_gguf *g, uint32_t begin, uint32_t end, size_t **idx,
                                 size_t *n, char *errbuf, size_t errlen)
{
    *idx = NULL;
    *n = 0;
    uint32_t n_block = 0;
    kvs_err err = kvs_shard_block_count(g, &n_block);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "no <arch>.block_count in the model: %s",
                              kvs_strerror(err));
    if (begin >= end || end > n_block)
        return kvs_shard__err(KVS_ERR_RANGE, errbuf, errlen,
                              "window [%u,%u) is not inside the model's %u blocks", begin, end, n_block);
    bool head = begin == 0, tail = end == n_block;
    bool tied = kvs_gguf_find_tensor(g, "output.weight") == NULL;
    size_t nt = kvs_gguf_n_tensors(g);
    size_t *out = malloc((nt ? nt : 1) * sizeof *out);
    if (!out)
        return KVS_ERR_NOMEM;
    size_t k = 0;
    for (size_t i = 0; i < nt; i++) {
        const char *name = kvs_gguf_tensor(g, i)->name;
        uint32_t blk;
        bool need;
        if (block_of(name, &blk))
            need = blk >= begin && blk < end;
        else if (has_prefix(name, "token_embd"))
            need = head || (tail && tied && !strcmp(name, "token_embd.weight"));
        else if (has_prefix(name, "output") || has_prefix(name, "output_norm"))
            need = tail;
        else
            need = true; /* rope_freqs.weight and other global tensors */
        if (need)
            out[k++] = i;
    }
    if (k == 0) {
        free(out);
        out = NULL;
    }
    *idx = out;
    *n = k;
    return KVS_OK;
}

static bool get_u32_key(const struct kvs_gguf *g, const char *key, uint32_t *v)
{
    return kvs_gguf_get_u32(g, key, v) == KVS_OK;
}

bool kvs_shard_window(const struct kvs_gguf *g, uint32_t *begin, uint32_t *end)
{
    uint32_t b, e;
    if (!get_u32_key(g, KVS_SHARD_KEY_WINDOW_BEGIN, &b) || !get_u32_key(g, KVS_SHARD_KEY_WINDOW_END, &e) ||
        b >= e)
        return false;
    *begin = b;
    *end = e;
    return true;
}

kvs_err kvs_shard_describe(const struct kvs_gguf *g, char *buf, size_t cap)
{
    if (cap)
        buf[0] = '\0';
    if (kvs_gguf_find_key(g, KVS_SHARD_KEY_WINDOW_BEGIN) < 0 && kvs_gguf_find_key(g, KVS_SHARD_KEY_WINDOW_END) < 0)
        return KVS_ERR_NOT_FOUND;
    uint32_t b, e, src = 0, n_block = 0;
    if (!kvs_shard_window(g, &b, &e))
        return kvs_shard__err(KVS_ERR_FORMAT, buf, cap, "invalid %s/%s keys", KVS_SHARD_KEY_WINDOW_BEGIN,
                              KVS_SHARD_KEY_WINDOW_END);
    bool have_src = get_u32_key(g, KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, &src);
    bool have_n = kvs_shard_block_count(g, &n_block) == KVS_OK;
    if (!have_src && !have_n)
        return kvs_shard__err(KVS_ERR_FORMAT, buf, cap, "window [%u,%u) of a source whose block count is not given",
                              b, e);
    if (have_src && have_n && src != n_block)
        return kvs_shard__err(KVS_ERR_FORMAT, buf, cap,
                              "window [%u,%u), but %s is %u and block_count %u", b, e,
                              KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, src, n_block);
    if (!have_src)
        src = n_block;
    if (e > src)
        return kvs_shard__err(KVS_ERR_FORMAT, buf, cap, "window [%u,%u) exceeds the source's %u blocks", b, e, src);
    bool head = b == 0, tail = e == src;
    snprintf(buf, cap, "window [%u,%u) of %u source blocks%s", b, e, src,
             head && tail ? " (whole model: head and tail)"
             : head       ? " (head: token embedding)"
             : tail       ? " (tail: output norm + LM head)"
                          : "");
    return KVS_OK;
}

kvs_err kvs_shard_check(const struct kvs_gguf *g, uint32_t begin, uint32_t end, char *errbuf, size_t errlen)
{
    uint32_t n_block = 0;
    kvs_err err = kvs_shard_block_count(g, &n_block);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "no <arch>.block_count in the model: %s",
                              kvs_strerror(err));
    if (begin >= end || end > n_block)
        return kvs_shard__err(KVS_ERR_RANGE, errbuf, errlen,
                              "window [%u,%u) is not inside the model's %u blocks", begin, end, n_block);
    bool is_shard = kvs_gguf_find_key(g, KVS_SHARD_KEY_WINDOW_BEGIN) >= 0 ||
                    kvs_gguf_find_key(g, KVS_SHARD_KEY_WINDOW_END) >= 0;
    if (is_shard) {
        uint32_t b, e, src_blocks;
        if (!kvs_shard_window(g, &b, &e) || e > n_block)
            return kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen, "shard has invalid %s/%s keys",
                                  KVS_SHARD_KEY_WINDOW_BEGIN, KVS_SHARD_KEY_WINDOW_END);
        if (get_u32_key(g, KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, &src_blocks) && src_blocks != n_block)
            return kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen,
                                  "shard says its source has %u blocks but block_count is %u", src_blocks,
                                  n_block);
        if (begin < b || end > e)
            return kvs_shard__err(KVS_ERR_MISMATCH, errbuf, errlen,
                                  "shard holds blocks [%u,%u) but the stage needs [%u,%u)", b, e, begin, end);
    }
    /* Every needed tensor group must be present. */
    size_t nt = kvs_gguf_n_tensors(g);
    for (uint32_t blk = begin; blk < end; blk++) {
        char pre[32];
        int pl = snprintf(pre, sizeof pre, "blk.%u.", blk);
        bool found = false;
        for (size_t i = 0; i < nt && !found; i++)
            found = strncmp(kvs_gguf_tensor(g, i)->name, pre, (size_t)pl) == 0;
        if (!found)
            return kvs_shard__err(KVS_ERR_NOT_FOUND, errbuf, errlen, "no tensors of block %u in the file", blk);
    }
    if (begin == 0 && !kvs_gguf_find_tensor(g, "token_embd.weight"))
        return kvs_shard__err(KVS_ERR_NOT_FOUND, errbuf, errlen, "window [%u,%u) needs token_embd.weight",
                              begin, end);
    if (end == n_block) {
        if (!kvs_gguf_find_tensor(g, "output_norm.weight"))
            return kvs_shard__err(KVS_ERR_NOT_FOUND, errbuf, errlen,
                                  "window [%u,%u) needs output_norm.weight", begin, end);
        if (!kvs_gguf_find_tensor(g, "output.weight") && !kvs_gguf_find_tensor(g, "token_embd.weight"))
            return kvs_shard__err(KVS_ERR_NOT_FOUND, errbuf, errlen,
                                  "window [%u,%u) needs output.weight (or a tied token_embd.weight)", begin,
                                  end);
    }
    return KVS_OK;
}

kvs_err kvs_shard__writer(const struct kvs_gguf *src, uint32_t begin, uint32_t end, const size_t *idx, size_t n,
                          const uint8_t (*sha)[32], const uint8_t *content_id, bool with_data,
                          struct kvs_gguf_writer **out,
                          char *errbuf, size_t errlen)
{
    *out = NULL;
    uint32_t n_block = 0;
    kvs_err err = kvs_shard_block_count(src, &n_block);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "no <arch>.block_count in the model");
    uint8_t fp[32];
    char fphex[65], shahex[65];
    err = kvs_gguf_fingerprint(src, fp);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "cannot fingerprint the source: %s", kvs_strerror(err));
    kvs_gguf_fingerprint_hex(fp, fphex);
    if (sha) {
        uint8_t d[32];
        err = kvs_shard__digest_of_digests(sha, n, d);
        if (err)
            return err;
        kvs_shard_hex(d, shahex);
    } else {
        memset(shahex, '0', 64);
        shahex[64] = '\0';
    }
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    if (!w)
        return KVS_ERR_NOMEM;
    size_t nkv = kvs_gguf_n_kv(src);
    for (size_t i = 0; i < nkv && !err; i++)
        if (strcmp(kvs_gguf_key(src, i), KVS_SHARD_KEY_SOURCE_CONTENT_ID) != 0)
            err = kvs_gguf_writer_copy_kv(w, src, i);
    if (!err)
        err = kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_WINDOW_BEGIN, begin);
    if (!err)
        err = kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_WINDOW_END, end);
    if (!err)
        err = kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, n_block);
    if (!err)
        err = kvs_gguf_writer_set_str(w, KVS_SHARD_KEY_SOURCE_FINGERPRINT, fphex);
    if (!err)
        err = kvs_gguf_writer_set_str(w, KVS_SHARD_KEY_TENSORS_SHA256, shahex);
    if (!err && content_id) {
        char cid[65];
        kvs_shard_hex(content_id, cid);
        err = kvs_gguf_writer_set_str(w, KVS_SHARD_KEY_SOURCE_CONTENT_ID, cid);
    }
    if (err) {
        kvs_gguf_writer_free(w);
        return kvs_shard__err(err, errbuf, errlen, "cannot build the shard's metadata: %s", kvs_strerror(err));
    }
    for (size_t i = 0; i < n; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(src, idx[i]);
        err = kvs_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, with_data ? t->data : NULL,
                                         t->bytes);
        if (err) {
            kvs_gguf_writer_free(w);
            return kvs_shard__err(err, errbuf, errlen, "cannot add tensor '%s': %s", t->name,
                                  kvs_strerror(err));
        }
    }
    *out = w;
    return KVS_OK;
}

/* GGUF v2/v3 reader (layout: shared/docs/gguf-facts.md §1; type table §2.1).
 *
 * The parser works on a byte prefix of a file and never reads past it; every
 * count and length read from the file is checked against the bytes that the
 * whole file can still hold before anything is allocated, and tables grow
 * geometrically with the bytes actually consumed, so a hostile header costs
 * at most a small multiple of its own size in memory. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gguf/gguf.h"
#include "gguf/gguf_impl.h"

/* ---- type tables ------------------------------------------------------- */

struct type_info {
    const char *name;
    uint32_t blck_elems;
    uint32_t blck_bytes;
};

/* gguf-facts §2.1. Entries with blck_elems 0 are invalid in files. */
static const struct type_info k_types[KVS_TYPE_COUNT] = {
    [KVS_TYPE_F32] = { "F32", 1, 4 },          [KVS_TYPE_F16] = { "F16", 1, 2 },
    [KVS_TYPE_Q4_0] = { "Q4_0", 32, 18 },      [KVS_TYPE_Q4_1] = { "Q4_1", 32, 20 },
    [KVS_TYPE_Q5_0] = { "Q5_0", 32, 22 },      [KVS_TYPE_Q5_1] = { "Q5_1", 32, 24 },
    [KVS_TYPE_Q8_0] = { "Q8_0", 32, 34 },      [KVS_TYPE_Q8_1] = { "Q8_1", 32, 36 },
    [KVS_TYPE_Q2_K] = { "Q2_K", 256, 84 },     [KVS_TYPE_Q3_K] = { "Q3_K", 256, 110 },
    [KVS_TYPE_Q4_K] = { "Q4_K", 256, 144 },    [KVS_TYPE_Q5_K] = { "Q5_K", 256, 176 },
    [KVS_TYPE_Q6_K] = { "Q6_K", 256, 210 },    [KVS_TYPE_Q8_K] = { "Q8_K", 256, 292 },
    [KVS_TYPE_IQ2_XXS] = { "IQ2_XXS", 256, 66 }, [KVS_TYPE_IQ2_XS] = { "IQ2_XS", 256, 74 },
    [KVS_TYPE_IQ3_XXS] = { "IQ3_XXS", 256, 98 }, [KVS_TYPE_IQ1_S] = { "IQ1_S", 256, 50 },
    [KVS_TYPE_IQ4_NL] = { "IQ4_NL", 32, 18 },  [KVS_TYPE_IQ3_S] = { "IQ3_S", 256, 110 },
    [KVS_TYPE_IQ2_S] = { "IQ2_S", 256, 82 },   [KVS_TYPE_IQ4_XS] = { "IQ4_XS", 256, 136 },
    [KVS_TYPE_I8] = { "I8", 1, 1 },            [KVS_TYPE_I16] = { "I16", 1, 2 },
    [KVS_TYPE_I32] = { "I32", 1, 4 },          [KVS_TYPE_I64] = { "I64", 1, 8 },
    [KVS_TYPE_F64] = { "F64", 1, 8 },          [KVS_TYPE_IQ1_M] = { "IQ1_M", 256, 56 },
    [KVS_TYPE_BF16] = { "BF16", 1, 2 },        [KVS_TYPE_TQ1_0] = { "TQ1_0", 256, 54 },
    [KVS_TYPE_TQ2_0] = { "TQ2_0", 256, 66 },
};

bool kvs_type_block(enum kvs_type type, uint32_t *blck_elems, uint32_t *blck_bytes)
{
    if ((unsigned)type >= KVS_TYPE_COUNT || k_types[type].blck_elems == 0)
        return false;
    if (blck_elems)
        *blck_elems = k_types[type].blck_elems;
    if (blck_bytes)
        *blck_bytes = k_types[type].blck_bytes;
    return true;
}

const char *kvs_type_name(enum kvs_type type)
{
    if ((unsigned)type >= KVS_TYPE_COUNT || k_types[type].blck_elems == 0)
        return "?";
    return k_types[type].name;
}

size_t kvs_type_row_bytes(enum kvs_type type, int64_t ne0)
{
    uint32_t be, bb;
    if (!kvs_type_block(type, &be, &bb) || ne0 < 0 || ne0 % be != 0)
        return 0;
    uint64_t blocks = (uint64_t)ne0 / be;
    if (blocks > SIZE_MAX / bb)
        return 0;
    return (size_t)(blocks * bb);
}

size_t kvs_gguf_scalar_size(enum kvs_gguf_type t)
{
    switch (t) {
    case KVS_GGUF_TYPE_UINT8: case KVS_GGUF_TYPE_INT8: case KVS_GGUF_TYPE_BOOL: return 1;
    case KVS_GGUF_TYPE_UINT16: case KVS_GGUF_TYPE_INT16: return 2;
    case KVS_GGUF_TYPE_UINT32: case KVS_GGUF_TYPE_INT32: case KVS_GGUF_TYPE_FLOAT32: return 4;
    case KVS_GGUF_TYPE_UINT64: case KVS_GGUF_TYPE_INT64: case KVS_GGUF_TYPE_FLOAT64: return 8;
    default: return 0;
    }
}

const char *kvs_gguf_type_name(enum kvs_gguf_type t)
{
    static const char *const names[KVS_GGUF_TYPE_COUNT_] = {
        "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
        "BOOL", "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64",
    };
    if ((unsigned)t >= KVS_GGUF_TYPE_COUNT_)
        return "?";
    return names[t];
}

/* ---- the parsed object ------------------------------------------------- */

struct kv {
    char *key;                 /* NUL-terminated copy (keys hold no NUL) */
    enum kvs_gguf_type type;
    enum kvs_gguf_type arr_type; /* ARRAY only */
    uint64_t arr_n;            /* ARRAY only */
    size_t raw_off, raw_len;   /* key length field .. end of value */
    size_t val_off;            /* first byte of the value (after the type) */
    size_t arr_data;           /* ARRAY: first element */
    uint64_t *str_off;         /* ARRAY of STRING: file offset of each element's length */
};

struct tensor {
    struct kvs_gguf_tensor pub;
    char name[KVS_GGUF_MAX_NAME];
};

struct name_ix {
    const char *s;
    size_t i;
};

struct kvs_gguf {
    const uint8_t *base;
    size_t len;            /* bytes available at base */
    uint64_t file_size;
    void *map;             /* mmap'd region (open only) */
    size_t map_len;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_offset;
    struct kv *kvs;
    size_t n_kv, cap_kv;
    struct name_ix *kv_sorted;
    struct tensor *tensors;
    size_t n_tensors, cap_tensors;
    struct name_ix *t_sorted;
};

/* ---- the cursor -------------------------------------------------------- */

struct rd {
    const uint8_t *buf;
    size_t len;
    uint64_t file_size;
    size_t pos;
    size_t *need;
    char *err;
    size_t errlen;
};

__attribute__((format(printf, 3, 4)))
static kvs_err fail(struct rd *r, kvs_err e, const char *fmt, ...)
{
    if (r->err && r->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err, r->errlen, fmt, ap);
        va_end(ap);
    }
    return e;
}

/* Bytes the file can still hold after the cursor. */
static uint64_t file_left(const struct rd *r)
{
    return r->file_size > r->pos ? r->file_size - r->pos : 0;
}

/* Ensures n bytes are readable at the cursor: TRUNCATED if the file is too
 * short, NEED_MORE (with *need) if only the buffer is. */
static kvs_err want(struct rd *r, uint64_t n, const char *what)
{
    if (n <= r->len - r->pos)
        return KVS_OK;
    if (n > file_left(r))
        return fail(r, KVS_ERR_TRUNCATED,
                    "truncated: %s needs %llu bytes at offset %zu but the file ends at %llu", what,
                    (unsigned long long)n, r->pos, (unsigned long long)r->file_size);
    uint64_t end = r->pos + n;
    uint64_t twice = (uint64_t)r->len * 2;
    if (twice > r->file_size)
        twice = r->file_size;
    if (r->need)
        *r->need = (size_t)(end > twice ? end : twice);
    return fail(r, KVS_ERR_NEED_MORE, "header continues past the %zu bytes available (%s at offset %zu)",
                r->len, what, r->pos);
}

static kvs_err rd_u32(struct rd *r, uint32_t *v, const char *what)
{
    kvs_err e = want(r, 4, what);
    if (e)
        return e;
    *v = kvs_gguf_ld32(r->buf + r->pos);
    r->pos += 4;
    return KVS_OK;
}

static kvs_err rd_u64(struct rd *r, uint64_t *v, const char *what)
{
    kvs_err e = want(r, 8, what);
    if (e)
        return e;
    *v = kvs_gguf_ld64(r->buf + r->pos);
    r->pos += 8;
    return KVS_OK;
}

/* Reads a GGUF string (u64 length + bytes); *s points into the buffer. */
static kvs_err rd_str(struct rd *r, const uint8_t **s, uint64_t *n, const char *what)
{
    kvs_err e = rd_u64(r, n, what);
    if (e)
        return e;
    if (*n > file_left(r))
        return fail(r, KVS_ERR_TRUNCATED,
                    "%s: string length %llu at offset %zu is past the end of the file (%llu bytes left)",
                    what, (unsigned long long)*n, r->pos - 8, (unsigned long long)file_left(r));
    e = want(r, *n, what);
    if (e)
        return e;
    *s = r->buf + r->pos;
    r->pos += (size_t)*n;
    return KVS_OK;
}

static bool grow(void **p, size_t *cap, size_t n, size_t elem)
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

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const struct name_ix *)a)->s, ((const struct name_ix *)b)->s);
}

struct off_ix {
    uint64_t off, bytes;
    size_t i;
};

static int cmp_off(const void *a, const void *b)
{
    const struct off_ix *x = a, *y = b;
    return x->off < y->off ? -1 : x->off > y->off ? 1 : 0;
}

/* ---- KV parsing ---------------------------------------------------------- */

static kvs_err parse_value(struct rd *r, struct kv *kv, const char *key)
{
    kvs_err e;
    if (kv->type == KVS_GGUF_TYPE_STRING) {
        const uint8_t *s;
        uint64_t n;
        return rd_str(r, &s, &n, key);
    }
    if (kv->type != KVS_GGUF_TYPE_ARRAY) {
        size_t sz = kvs_gguf_scalar_size(kv->type);
        e = want(r, sz, key);
        if (e)
            return e;
        r->pos += sz;
        return KVS_OK;
    }
    uint32_t at;
    if ((e = rd_u32(r, &at, key)))
        return e;
    if (at == KVS_GGUF_TYPE_ARRAY)
        return fail(r, KVS_ERR_FORMAT, "key '%s': nested arrays are not supported", key);
    if (at >= KVS_GGUF_TYPE_COUNT_)
        return fail(r, KVS_ERR_FORMAT, "key '%s': unknown array element type %u", key, at);
    kv->arr_type = (enum kvs_gguf_type)at;
    if ((e = rd_u64(r, &kv->arr_n, key)))
        return e;
    kv->arr_data = r->pos;
    if (at != KVS_GGUF_TYPE_STRING) {
        size_t sz = kvs_gguf_scalar_size(kv->arr_type);
        if (kv->arr_n > file_left(r) / sz)
            return fail(r, KVS_ERR_TRUNCATED,
                        "key '%s': array of %llu %s elements is past the end of the file (%llu bytes left)",
                        key, (unsigned long long)kv->arr_n, kvs_gguf_type_name(kv->arr_type),
                        (unsigned long long)file_left(r));
        if ((e = want(r, kv->arr_n * sz, key)))
            return e;
        r->pos += (size_t)(kv->arr_n * sz);
        return KVS_OK;
    }
    /* Strings: at least 8 bytes each. */
    if (kv->arr_n > file_left(r) / 8)
        return fail(r, KVS_ERR_TRUNCATED,
                    "key '%s': array of %llu strings is past the end of the file (%llu bytes left)", key,
                    (unsigned long long)kv->arr_n, (unsigned long long)file_left(r));
    size_t cap = 0;
    for (uint64_t j = 0; j < kv->arr_n; j++) {
        if (!grow((void **)&kv->str_off, &cap, (size_t)j, sizeof(uint64_t)))
            return fail(r, KVS_ERR_NOMEM, "key '%s': out of memory for %llu strings", key,
                        (unsigned long long)kv->arr_n);
        kv->str_off[j] = r->pos;
        const uint8_t *s;
        uint64_t n;
        if ((e = rd_str(r, &s, &n, key)))
            return e;
    }
    return KVS_OK;
}

static kvs_err parse_kvs(struct rd *r, struct kvs_gguf *g, uint64_t n_kv)
{
    kvs_err e;
    for (uint64_t i = 0; i < n_kv; i++) {
        if (!grow((void **)&g->kvs, &g->cap_kv, g->n_kv, sizeof *g->kvs))
            return fail(r, KVS_ERR_NOMEM, "out of memory for %llu KV pairs", (unsigned long long)n_kv);
        struct kv *kv = &g->kvs[g->n_kv];
        memset(kv, 0, sizeof *kv);
        g->n_kv++;
        kv->raw_off = r->pos;
        const uint8_t *ks;
        uint64_t kn;
        char what[48];
        snprintf(what, sizeof what, "key of KV %llu", (unsigned long long)i);
        if ((e = rd_str(r, &ks, &kn, what)))
            return e;
        if (kn == 0)
            return fail(r, KVS_ERR_FORMAT, "KV %llu at offset %zu has an empty key", (unsigned long long)i,
                        kv->raw_off);
        if (memchr(ks, 0, (size_t)kn))
            return fail(r, KVS_ERR_FORMAT, "KV %llu: key contains a NUL byte", (unsigned long long)i);
        kv->key = malloc((size_t)kn + 1);
        if (!kv->key)
            return fail(r, KVS_ERR_NOMEM, "out of memory for a key of %llu bytes", (unsigned long long)kn);
        memcpy(kv->key, ks, (size_t)kn);
        kv->key[kn] = 0;
        uint32_t t;
        if ((e = rd_u32(r, &t, kv->key)))
            return e;
        if (t >= KVS_GGUF_TYPE_COUNT_)
            return fail(r, KVS_ERR_FORMAT, "key '%s': unknown value type %u", kv->key, t);
        kv->type = (enum kvs_gguf_type)t;
        kv->val_off = r->pos;
        if ((e = parse_value(r, kv, kv->key)))
            return e;
        kv->raw_len = r->pos - kv->raw_off;
    }
    return KVS_OK;
}

/* ---- tensor infos ------------------------------------------------------ */

static kvs_err parse_tensor_info(struct rd *r, struct kvs_gguf *g, uint64_t i)
{
    kvs_err e;
    if (!grow((void **)&g->tensors, &g->cap_tensors, g->n_tensors, sizeof *g->tensors))
        return fail(r, KVS_ERR_NOMEM, "out of memory for tensor infos");
    struct tensor *t = &g->tensors[g->n_tensors];
    memset(t, 0, sizeof *t);
    g->n_tensors++;
    const uint8_t *ns;
    uint64_t nn;
    char what[48];
    snprintf(what, sizeof what, "name of tensor %llu", (unsigned long long)i);
    if ((e = rd_str(r, &ns, &nn, what)))
        return e;
    if (nn == 0)
        return fail(r, KVS_ERR_FORMAT, "tensor %llu has an empty name", (unsigned long long)i);
    if (nn >= KVS_GGUF_MAX_NAME)
        return fail(r, KVS_ERR_FORMAT, "tensor %llu: name too long (%llu bytes, limit %u)",
                    (unsigned long long)i, (unsigned long long)nn, KVS_GGUF_MAX_NAME - 1);
    if (memchr(ns, 0, (size_t)nn))
        return fail(r, KVS_ERR_FORMAT, "tensor %llu: name contains a NUL byte", (unsigned long long)i);
    memcpy(t->name, ns, (size_t)nn);
    t->name[nn] = 0;

    uint32_t nd;
    if ((e = rd_u32(r, &nd, t->name)))
        return e;
    if (nd == 0 || nd > KVS_GGUF_MAX_DIMS)
        return fail(r, KVS_ERR_FORMAT, "tensor '%s': n_dims %u is not in 1..%d", t->name, nd,
                    KVS_GGUF_MAX_DIMS);
    t->pub.n_dims = nd;
    for (int d = 0; d < KVS_GGUF_MAX_DIMS; d++)
        t->pub.ne[d] = 1;
    for (uint32_t d = 0; d < nd; d++) {
        uint64_t v;
        if ((e = rd_u64(r, &v, t->name)))
            return e;
        if (v == 0 || v > INT64_MAX)
            return fail(r, KVS_ERR_FORMAT, "tensor '%s': dimension %u is %lld (must be > 0)", t->name, d,
                        (long long)v);
        t->pub.ne[d] = (int64_t)v;
    }
    uint32_t ty;
    if ((e = rd_u32(r, &ty, t->name)))
        return e;
    uint32_t be, bb;
    if (!kvs_type_block((enum kvs_type)ty, &be, &bb))
        return fail(r, KVS_ERR_FORMAT, "tensor '%s': invalid tensor type %u", t->name, ty);
    t->pub.type = (enum kvs_type)ty;
    if ((e = rd_u64(r, &t->pub.offset, t->name)))
        return e;

    int64_t nel = 1;
    for (uint32_t d = 0; d < nd; d++)
        if (__builtin_mul_overflow(nel, t->pub.ne[d], &nel))
            return fail(r, KVS_ERR_RANGE, "tensor '%s': element count overflows 64 bits", t->name);
    if (t->pub.ne[0] % be != 0)
        return fail(r, KVS_ERR_FORMAT, "tensor '%s': ne[0] = %lld is not a multiple of the %s block size %u",
                    t->name, (long long)t->pub.ne[0], kvs_type_name(t->pub.type), be);
    uint64_t bytes;
    if (__builtin_mul_overflow((uint64_t)nel / be, (uint64_t)bb, &bytes) || bytes > INT64_MAX)
        return fail(r, KVS_ERR_RANGE, "tensor '%s': byte size overflows 64 bits", t->name);
    t->pub.bytes = bytes;
    if (t->pub.offset % g->alignment != 0)
        return fail(r, KVS_ERR_FORMAT, "tensor '%s': offset %llu is not a multiple of the alignment %u",
                    t->name, (unsigned long long)t->pub.offset, g->alignment);
    return KVS_OK;
}

static kvs_err check_tensors(struct rd *r, struct kvs_gguf *g)
{
    uint64_t data_size = g->file_size > g->data_offset ? g->file_size - g->data_offset : 0;
    if (g->n_tensors > 0 && g->data_offset > g->file_size)
        return fail(r, KVS_ERR_TRUNCATED, "truncated: data section starts at %llu past the end of the file (%llu bytes)",
                    (unsigned long long)g->data_offset, (unsigned long long)g->file_size);
    for (size_t i = 0; i < g->n_tensors; i++) {
        struct kvs_gguf_tensor *t = &g->tensors[i].pub;
        t->name = g->tensors[i].name; /* the table no longer moves */
        if (t->offset > data_size || t->bytes > data_size - t->offset)
            return fail(r, KVS_ERR_TRUNCATED,
                        "tensor '%s': offset %llu + %llu bytes is past the end of the data section (%llu bytes)",
                        t->name, (unsigned long long)t->offset, (unsigned long long)t->bytes,
                        (unsigned long long)data_size);
        uint64_t abs = g->data_offset + t->offset;
        t->data = (abs + t->bytes <= g->len) ? g->base + abs : NULL;
    }
    if (g->n_tensors == 0)
        return KVS_OK;
    g->t_sorted = malloc(g->n_tensors * sizeof *g->t_sorted);
    struct off_ix *o = malloc(g->n_tensors * sizeof *o);
    if (!g->t_sorted || !o) {
        free(o);
        return fail(r, KVS_ERR_NOMEM, "out of memory sorting %zu tensors", g->n_tensors);
    }
    for (size_t i = 0; i < g->n_tensors; i++) {
        g->t_sorted[i] = (struct name_ix){ g->tensors[i].name, i };
        o[i] = (struct off_ix){ g->tensors[i].pub.offset, g->tensors[i].pub.bytes, i };
    }
    qsort(g->t_sorted, g->n_tensors, sizeof *g->t_sorted, cmp_name);
    for (size_t i = 1; i < g->n_tensors; i++)
        if (strcmp(g->t_sorted[i - 1].s, g->t_sorted[i].s) == 0) {
            free(o);
            return fail(r, KVS_ERR_FORMAT, "duplicate tensor name '%s'", g->t_sorted[i].s);
        }
    qsort(o, g->n_tensors, sizeof *o, cmp_off);
    for (size_t i = 1; i < g->n_tensors; i++)
        if (o[i - 1].off + o[i - 1].bytes > o[i].off) {
            kvs_err e = fail(r, KVS_ERR_FORMAT, "tensors '%s' (offset %llu, %llu bytes) and '%s' (offset %llu) overlap",
                             g->tensors[o[i - 1].i].name, (unsigned long long)o[i - 1].off,
                             (unsigned long long)o[i - 1].bytes, g->tensors[o[i].i].name,
                             (unsigned long long)o[i].off);
            free(o);
            return e;
        }
    free(o);
    return KVS_OK;
}

/* ---- entry points -------------------------------------------------------- */

void kvs_gguf_close(struct kvs_gguf *g)
{
    if (!g)
        return;
    for (size_t i = 0; i < g->n_kv; i++) {
        free(g->kvs[i].key);
        free(g->kvs[i].str_off);
    }
    free(g->kvs);
    free(g->kv_sorted);
    free(g->tensors);
    free(g->t_sorted);
    if (g->map)
        munmap(g->map, g->map_len);
    free(g);
}

static kvs_err parse_all(struct rd *r, struct kvs_gguf *g)
{
    kvs_err e;
    /* Magic: check whatever bytes are present first, so a non-GGUF prefix is
     * refused at once rather than asked for more. */
    static const uint8_t magic[4] = { 'G', 'G', 'U', 'F' };
    size_t avail = r->len < 4 ? r->len : 4;
    if (memcmp(r->buf, magic, avail) != 0)
        return fail(r, KVS_ERR_FORMAT, "bad magic: not a GGUF file (expected \"GGUF\")");
    uint32_t m, version;
    if ((e = rd_u32(r, &m, "magic")))
        return e;
    if ((e = rd_u32(r, &version, "version")))
        return e;
    if ((version & 0xFFFFu) == 0 && version != 0)
        return fail(r, KVS_ERR_UNSUPPORTED, "bad version 0x%08x: big-endian GGUF files are not supported", version);
    if (version == 1)
        return fail(r, KVS_ERR_UNSUPPORTED, "bad version 1: GGUF v1 (32-bit counts) is not supported");
    if (version < 2 || version > 3)
        return fail(r, KVS_ERR_UNSUPPORTED, "bad version %u: only GGUF versions 2 and 3 are supported", version);
    g->version = version;
    uint64_t n_tensors, n_kv;
    if ((e = rd_u64(r, &n_tensors, "tensor count")) || (e = rd_u64(r, &n_kv, "KV count")))
        return e;
    /* Each KV takes at least 14 bytes (8 key length + 1 key + 4 type + 1
     * value); each tensor info at least 33 (8 + 1 + 4 + 8 + 4 + 8). */
    if (n_kv > file_left(r) / 14)
        return fail(r, KVS_ERR_TRUNCATED, "KV count %llu is past the end of the file (%llu bytes left)",
                    (unsigned long long)n_kv, (unsigned long long)file_left(r));
    if (n_tensors > file_left(r) / 33)
        return fail(r, KVS_ERR_TRUNCATED, "tensor count %llu is past the end of the file (%llu bytes left)",
                    (unsigned long long)n_tensors, (unsigned long long)file_left(r));
    if ((e = parse_kvs(r, g, n_kv)))
        return e;

    if (g->n_kv) {
        g->kv_sorted = malloc(g->n_kv * sizeof *g->kv_sorted);
        if (!g->kv_sorted)
            return fail(r, KVS_ERR_NOMEM, "out of memory sorting %zu keys", g->n_kv);
        for (size_t i = 0; i < g->n_kv; i++)
            g->kv_sorted[i] = (struct name_ix){ g->kvs[i].key, i };
        qsort(g->kv_sorted, g->n_kv, sizeof *g->kv_sorted, cmp_name);
        for (size_t i = 1; i < g->n_kv; i++)
            if (strcmp(g->kv_sorted[i - 1].s, g->kv_sorted[i].s) == 0)
                return fail(r, KVS_ERR_FORMAT, "duplicate key '%s'", g->kv_sorted[i].s);
    }

    g->alignment = KVS_GGUF_DEFAULT_ALIGNMENT;
    int64_t ai = kvs_gguf_find_key(g, "general.alignment");
    if (ai >= 0) {
        const struct kv *kv = &g->kvs[ai];
        if (kv->type != KVS_GGUF_TYPE_UINT32)
            return fail(r, KVS_ERR_FORMAT, "bad alignment: general.alignment has type %s, must be UINT32",
                        kvs_gguf_type_name(kv->type));
        uint32_t a = kvs_gguf_ld32(g->base + kv->val_off);
        if (a == 0 || (a & (a - 1)) != 0)
            return fail(r, KVS_ERR_FORMAT, "bad alignment: general.alignment %u is not a nonzero power of two", a);
        g->alignment = a;
    }

    for (uint64_t i = 0; i < n_tensors; i++)
        if ((e = parse_tensor_info(r, g, i)))
            return e;
    g->data_offset = kvs_gguf_pad(r->pos, g->alignment);
    return check_tensors(r, g);
}

kvs_err kvs_gguf_parse(const void *buf, size_t len, uint64_t file_size, struct kvs_gguf **out, size_t *need,
                       char *errbuf, size_t errlen)
{
    struct rd r = { buf, len, file_size, 0, need, errbuf, errlen };
    if (errbuf && errlen)
        errbuf[0] = 0;
    if (!out || (!buf && len) || file_size < len)
        return fail(&r, KVS_ERR_ARG, "kvs_gguf_parse: bad arguments");
    *out = NULL;
    static const uint8_t empty[1] = { 0 };
    if (!buf)
        r.buf = empty;
    struct kvs_gguf *g = calloc(1, sizeof *g);
    if (!g)
        return fail(&r, KVS_ERR_NOMEM, "out of memory");
    g->base = r.buf;
    g->len = len;
    g->file_size = file_size;
    kvs_err e = parse_all(&r, g);
    if (e) {
        kvs_gguf_close(g);
        return e;
    }
    *out = g;
    return KVS_OK;
}

kvs_err kvs_gguf_open(const char *path, struct kvs_gguf **out, char *errbuf, size_t errlen)
{
    if (errbuf && errlen)
        errbuf[0] = 0;
    if (!path || !out) {
        if (errbuf && errlen)
            snprintf(errbuf, errlen, "kvs_gguf_open: bad arguments");
        return KVS_ERR_ARG;
    }
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errbuf && errlen)
            snprintf(errbuf, errlen, "%s: open: %s", path, strerror(errno));
        return errno == ENOENT ? KVS_ERR_NOT_FOUND : KVS_ERR_IO;
    }
    struct stat st;
    int st_rc = fstat(fd, &st);
    if (st_rc != 0 || !S_ISREG(st.st_mode)) {
        /* errno is meaningful only when fstat failed: otherwise it is a
         * leftover from an earlier call ("No such file or directory"). */
        int en = st_rc != 0 ? errno : 0;
        const char *what = st_rc == 0 && S_ISDIR(st.st_mode) ? "is a directory, not a GGUF file"
                                                              : "not a regular file";
        close(fd);
        if (errbuf && errlen)
            snprintf(errbuf, errlen, "%s: %s", path, en ? strerror(en) : what);
        return KVS_ERR_IO;
    }
    size_t size = (size_t)st.st_size;
    void *map = size ? mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0) : NULL;
    int en = errno;
    close(fd);
    if (map == MAP_FAILED) {
        if (errbuf && errlen)
            snprintf(errbuf, errlen, "%s: mmap: %s", path, strerror(en));
        return KVS_ERR_IO;
    }
    /* No read-around: a window reads only the tensors it asks for (see
     * kvs_gguf_willneed); the kernel's default readahead (often MiBs) would
     * otherwise pull in neighbouring tensors while the header is parsed.
     * Advisory: failure is harmless. */
    if (map)
        (void)madvise(map, size, MADV_RANDOM);
    char detail[256];
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_parse(map, size, size, &g, NULL, detail, sizeof detail);
    if (e) {
        if (map)
            munmap(map, size);
        if (e == KVS_ERR_NEED_MORE)
            e = KVS_ERR_INTERNAL;
        if (errbuf && errlen)
            snprintf(errbuf, errlen, "%s: %s", path, detail);
        return e;
    }
    g->map = map;
    g->map_len = size;
    *out = g;
    return KVS_OK;
}

/* ---- accessors ----------------------------------------------------------- */

uint32_t kvs_gguf_version(const struct kvs_gguf *g) { return g->version; }
uint32_t kvs_gguf_alignment(const struct kvs_gguf *g) { return g->alignment; }
uint64_t kvs_gguf_data_offset(const struct kvs_gguf *g) { return g->data_offset; }
uint64_t kvs_gguf_file_size(const struct kvs_gguf *g) { return g->file_size; }
const uint8_t *kvs_gguf_base(const struct kvs_gguf *g) { return g->base; }
size_t kvs_gguf_n_kv(const struct kvs_gguf *g) { return g->n_kv; }

int64_t kvs_gguf_find_key(const struct kvs_gguf *g, const char *key)
{
    if (!g || !key || !g->kv_sorted)
        return -1;
    size_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, g->kv_sorted[mid].s);
        if (c == 0)
            return (int64_t)g->kv_sorted[mid].i;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return -1;
}

const char *kvs_gguf_key(const struct kvs_gguf *g, size_t i) { return i < g->n_kv ? g->kvs[i].key : NULL; }

enum kvs_gguf_type kvs_gguf_kv_type(const struct kvs_gguf *g, size_t i)
{
    return i < g->n_kv ? g->kvs[i].type : KVS_GGUF_TYPE_COUNT_;
}

enum kvs_gguf_type kvs_gguf_arr_type(const struct kvs_gguf *g, size_t i)
{
    return i < g->n_kv && g->kvs[i].type == KVS_GGUF_TYPE_ARRAY ? g->kvs[i].arr_type : KVS_GGUF_TYPE_COUNT_;
}

uint64_t kvs_gguf_arr_n(const struct kvs_gguf *g, size_t i)
{
    return i < g->n_kv && g->kvs[i].type == KVS_GGUF_TYPE_ARRAY ? g->kvs[i].arr_n : 0;
}

size_t kvs_gguf_kv_sorted(const struct kvs_gguf *g, size_t i) { return g->kv_sorted[i].i; }
size_t kvs_gguf_tensor_sorted(const struct kvs_gguf *g, size_t i) { return g->t_sorted[i].i; }

static const struct kv *lookup(const struct kvs_gguf *g, const char *key)
{
    int64_t i = kvs_gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kvs[i];
}

kvs_err kvs_gguf_get_u32(const struct kvs_gguf *g, const char *key, uint32_t *out)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    const uint8_t *p = g->base + kv->val_off;
    switch (kv->type) {
    case KVS_GGUF_TYPE_UINT32: *out = kvs_gguf_ld32(p); return KVS_OK;
    case KVS_GGUF_TYPE_UINT16: *out = kvs_gguf_ld16(p); return KVS_OK;
    case KVS_GGUF_TYPE_UINT8: *out = p[0]; return KVS_OK;
    case KVS_GGUF_TYPE_INT32: {
        int32_t v = (int32_t)kvs_gguf_ld32(p);
        if (v < 0)
            return KVS_ERR_FORMAT;
        *out = (uint32_t)v;
        return KVS_OK;
    }
    default: return KVS_ERR_FORMAT;
    }
}

kvs_err kvs_gguf_get_i32(const struct kvs_gguf *g, const char *key, int32_t *out)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_TYPE_INT32)
        return KVS_ERR_FORMAT;
    *out = (int32_t)kvs_gguf_ld32(g->base + kv->val_off);
    return KVS_OK;
}

kvs_err kvs_gguf_get_u64(const struct kvs_gguf *g, const char *key, uint64_t *out)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_TYPE_UINT64)
        return KVS_ERR_FORMAT;
    *out = kvs_gguf_ld64(g->base + kv->val_off);
    return KVS_OK;
}

kvs_err kvs_gguf_get_f32(const struct kvs_gguf *g, const char *key, float *out)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    const uint8_t *p = g->base + kv->val_off;
    if (kv->type == KVS_GGUF_TYPE_FLOAT32) {
        uint32_t b = kvs_gguf_ld32(p);
        memcpy(out, &b, 4);
        return KVS_OK;
    }
    if (kv->type == KVS_GGUF_TYPE_FLOAT64) {
        uint64_t b = kvs_gguf_ld64(p);
        double d;
        memcpy(&d, &b, 8);
        *out = (float)d;
        return KVS_OK;
    }
    return KVS_ERR_FORMAT;
}

kvs_err kvs_gguf_get_bool(const struct kvs_gguf *g, const char *key, bool *out)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_TYPE_BOOL)
        return KVS_ERR_FORMAT;
    *out = g->base[kv->val_off] != 0;
    return KVS_OK;
}

kvs_err kvs_gguf_get_str(const struct kvs_gguf *g, const char *key, const char **s, size_t *len)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_TYPE_STRING)
        return KVS_ERR_FORMAT;
    *len = (size_t)kvs_gguf_ld64(g->base + kv->val_off);
    *s = (const char *)g->base + kv->val_off + 8;
    return KVS_OK;
}

kvs_err kvs_gguf_get_arr(const struct kvs_gguf *g, const char *key, enum kvs_gguf_type *elem_type, uint64_t *n,
                         const void **data)
{
    const struct kv *kv = lookup(g, key);
    if (!kv)
        return KVS_ERR_NOT_FOUND;
    if (kv->type != KVS_GGUF_TYPE_ARRAY || kv->arr_type == KVS_GGUF_TYPE_STRING)
        return KVS_ERR_FORMAT;
    if (elem_type)
        *elem_type = kv->arr_type;
    if (n)
        *n = kv->arr_n;
    if (data)
        *data = g->base + kv->arr_data;
    return KVS_OK;
}

kvs_err kvs_gguf_arr_str(const struct kvs_gguf *g, size_t i, uint64_t j, const char **s, size_t *len)
{
    if (i >= g->n_kv)
        return KVS_ERR_RANGE;
    const struct kv *kv = &g->kvs[i];
    if (kv->type != KVS_GGUF_TYPE_ARRAY || kv->arr_type != KVS_GGUF_TYPE_STRING)
        return KVS_ERR_FORMAT;
    if (j >= kv->arr_n)
        return KVS_ERR_RANGE;
    const uint8_t *p = g->base + kv->str_off[j];
    *len = (size_t)kvs_gguf_ld64(p);
    *s = (const char *)p + 8;
    return KVS_OK;
}

kvs_err kvs_gguf_kv_raw(const struct kvs_gguf *g, size_t i, const uint8_t **p, size_t *len)
{
    if (i >= g->n_kv)
        return KVS_ERR_RANGE;
    *p = g->base + g->kvs[i].raw_off;
    *len = g->kvs[i].raw_len;
    return KVS_OK;
}

size_t kvs_gguf_n_tensors(const struct kvs_gguf *g) { return g->n_tensors; }

const struct kvs_gguf_tensor *kvs_gguf_tensor(const struct kvs_gguf *g, size_t i)
{
    return i < g->n_tensors ? &g->tensors[i].pub : NULL;
}

const struct kvs_gguf_tensor *kvs_gguf_find_tensor(const struct kvs_gguf *g, const char *name)
{
    if (!g || !name || !g->t_sorted)
        return NULL;
    size_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, g->t_sorted[mid].s);
        if (c == 0)
            return &g->tensors[g->t_sorted[mid].i].pub;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

void kvs_gguf_willneed(const struct kvs_gguf *g, const struct kvs_gguf_tensor *t)
{
    if (!g || !t || !g->map || !t->data || !t->bytes)
        return;
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t base = (uintptr_t)g->map;
    uintptr_t a = (uintptr_t)t->data, z = a + (uintptr_t)t->bytes;
    a &= ~(pg - 1);
    z = (z + pg - 1) & ~(pg - 1);
    if (a < base)
        a = base;
    (void)madvise((void *)a, z - a, MADV_WILLNEED);
}

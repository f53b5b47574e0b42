/* Writer tests: hand-computed layouts, a round trip of every KV type, a copy
 * of a shared model through the writer, and a truncation sweep. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <openssl/sha.h>

#include "gguf/gguf.h"

static void tmp_path(char *buf, size_t n, const char *tag)
{
    snprintf(buf, n, "/tmp/kvs_gguf_test_%ld_%s.gguf", (long)getpid(), tag);
}

static uint8_t *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* 24-byte header + KV "a" (u32) + tensor "t" F32 {3}:
 *   KV: 8 (key len) + 1 + 4 (type) + 4 (value) = 17
 *   info: 8 + 1 + 4 (n_dims) + 8 (ne0) + 4 (type) + 8 (offset) = 33
 *   24 + 17 + 33 = 74 -> padded to 96; tensor 12 bytes -> padded 32. */
static void test_layout_by_hand(void **state)
{
    (void)state;
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_non_null(w);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "a", 7), KVS_OK);
    const float v[3] = { 1.0f, -2.0f, 0.5f };
    const int64_t ne[1] = { 3 };
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "t", KVS_TYPE_F32, 1, ne, v, 12), KVS_OK);
    assert_int_equal(kvs_gguf_writer_header_bytes(w), 96);
    assert_int_equal(kvs_gguf_writer_tensor_offset(w, 0), 96);
    assert_int_equal(kvs_gguf_writer_total_bytes(w), 128);
    uint8_t *h;
    size_t hl;
    assert_int_equal(kvs_gguf_writer_header(w, &h, &hl), KVS_OK);
    assert_int_equal(hl, 96);
    static const uint8_t want[24 + 17] = {
        'G', 'G', 'U', 'F', 3, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        1, 0, 0, 0, 0, 0, 0, 0, 'a', 4, 0, 0, 0, 7, 0, 0, 0,
    };
    assert_memory_equal(h, want, sizeof want);
    for (size_t i = 74; i < 96; i++)
        assert_int_equal(h[i], 0);
    free(h);

    /* Wrong byte count, duplicate name, bad shapes are refused. */
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "u", KVS_TYPE_F32, 1, ne, v, 11), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "t", KVS_TYPE_F32, 1, ne, v, 12), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "u", KVS_TYPE_Q8_0, 1, ne, v, 12), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "u", (enum kvs_type)4, 1, ne, v, 12), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "u", KVS_TYPE_F32, 0, ne, v, 12), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "general.alignment", 48), KVS_ERR_ARG);

    /* A second tensor after 12 bytes starts at the next multiple of 32;
     * with alignment 64 it moves to 64. */
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "u", KVS_TYPE_F32, 1, ne, v, 12), KVS_OK);
    assert_int_equal(kvs_gguf_writer_tensor_offset(w, 1) - kvs_gguf_writer_header_bytes(w), 32);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "general.alignment", 64), KVS_OK);
    assert_int_equal(kvs_gguf_writer_header_bytes(w) % 64, 0);
    assert_int_equal(kvs_gguf_writer_tensor_offset(w, 1) - kvs_gguf_writer_header_bytes(w), 64);
    kvs_gguf_writer_free(w);
}

static uint8_t *fill(size_t n, uint32_t seed)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        p[i] = (uint8_t)(seed >> 16);
    }
    return p;
}

static void test_round_trip(void **state)
{
    (void)state;
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_int_equal(kvs_gguf_writer_set_str(w, "general.architecture", "toy"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "toy.u32", 4000000000u), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_i32(w, "toy.i32", -123456), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u64(w, "toy.u64", 0x0123456789abcdefull), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_f32(w, "toy.f32", 1e-5f), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_bool(w, "toy.bool", true), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_str(w, "toy.empty", ""), KVS_OK);
    const uint8_t u8[3] = { 1, 2, 255 };
    const int8_t i8[2] = { -1, 127 };
    const uint16_t u16[2] = { 65535, 7 };
    const int16_t i16[2] = { -32768, 5 };
    const uint32_t u32[2] = { 1, 4294967295u };
    const int32_t i32[3] = { -1, 0, 2147483647 };
    const float f32[2] = { 3.5f, -0.25f };
    const uint8_t bools[2] = { 0, 1 };
    const uint64_t u64[1] = { 18446744073709551615ull };
    const int64_t i64[2] = { INT64_MIN, 42 };
    const double f64[2] = { 1e300, -2.5 };
    struct {
        const char *key;
        enum kvs_gguf_type t;
        const void *d;
        uint64_t n;
        size_t sz;
    } arrs[] = {
        { "arr.u8", KVS_GGUF_TYPE_UINT8, u8, 3, 1 },     { "arr.i8", KVS_GGUF_TYPE_INT8, i8, 2, 1 },
        { "arr.u16", KVS_GGUF_TYPE_UINT16, u16, 2, 2 },  { "arr.i16", KVS_GGUF_TYPE_INT16, i16, 2, 2 },
        { "arr.u32", KVS_GGUF_TYPE_UINT32, u32, 2, 4 },  { "arr.i32", KVS_GGUF_TYPE_INT32, i32, 3, 4 },
        { "arr.f32", KVS_GGUF_TYPE_FLOAT32, f32, 2, 4 }, { "arr.bool", KVS_GGUF_TYPE_BOOL, bools, 2, 1 },
        { "arr.u64", KVS_GGUF_TYPE_UINT64, u64, 1, 8 },  { "arr.i64", KVS_GGUF_TYPE_INT64, i64, 2, 8 },
        { "arr.f64", KVS_GGUF_TYPE_FLOAT64, f64, 2, 8 }, { "arr.none", KVS_GGUF_TYPE_UINT32, NULL, 0, 4 },
    };
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++)
        assert_int_equal(kvs_gguf_writer_set_arr(w, arrs[i].key, arrs[i].t, arrs[i].d, arrs[i].n), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_arr(w, "bad", KVS_GGUF_TYPE_STRING, u8, 1), KVS_ERR_ARG);
    assert_int_equal(kvs_gguf_writer_set_arr(w, "bad", KVS_GGUF_TYPE_ARRAY, u8, 1), KVS_ERR_ARG);
    const char *strs[] = { "alpha", "", "\xe2\x96\x81the", "a b" };
    assert_int_equal(kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", strs, 4), KVS_OK);
    /* Replacing a key keeps its place and count. */
    assert_int_equal(kvs_gguf_writer_set_u32(w, "toy.replaced", 1), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "toy.replaced", 2), KVS_OK);

    /* Tensors of several types. */
    struct {
        const char *name;
        enum kvs_type t;
        uint32_t nd;
        int64_t ne[4];
        uint64_t bytes; /* by hand from gguf-facts §2.1 */
    } ts[] = {
        { "a.f32", KVS_TYPE_F32, 2, { 5, 3, 1, 1 }, 60 },
        { "b.f16", KVS_TYPE_F16, 1, { 7, 1, 1, 1 }, 14 },
        { "c.q4_0", KVS_TYPE_Q4_0, 2, { 64, 2, 1, 1 }, 4 * 18 },
        { "d.q8_0", KVS_TYPE_Q8_0, 3, { 32, 2, 3, 1 }, 6 * 34 },
        { "e.q4_k", KVS_TYPE_Q4_K, 2, { 256, 3, 1, 1 }, 3 * 144 },
        { "f.q6_k", KVS_TYPE_Q6_K, 4, { 256, 1, 2, 2 }, 4 * 210 },
        { "g.i8", KVS_TYPE_I8, 1, { 33, 1, 1, 1 }, 33 },
    };
    size_t nt = sizeof ts / sizeof ts[0];
    uint8_t *data[sizeof ts / sizeof ts[0]];
    for (size_t i = 0; i < nt; i++) {
        data[i] = fill(ts[i].bytes, (uint32_t)i + 1);
        assert_int_equal(kvs_gguf_writer_add_tensor(w, ts[i].name, ts[i].t, ts[i].nd, ts[i].ne, data[i],
                                                    ts[i].bytes), KVS_OK);
    }
    char path[256];
    tmp_path(path, sizeof path, "rt");
    assert_int_equal(kvs_gguf_writer_write_file(w, path), KVS_OK);

    struct kvs_gguf *g = NULL;
    char err[256];
    assert_int_equal(kvs_gguf_open(path, &g, err, sizeof err), KVS_OK);
    assert_int_equal(kvs_gguf_file_size(g), kvs_gguf_writer_total_bytes(w));
    assert_int_equal(kvs_gguf_data_offset(g), kvs_gguf_writer_header_bytes(w));
    assert_int_equal(kvs_gguf_n_kv(g), 7 + 12 + 1 + 1);
    /* KVs come back in insertion order. */
    assert_string_equal(kvs_gguf_key(g, 0), "general.architecture");
    assert_string_equal(kvs_gguf_key(g, 19), "tokenizer.ggml.tokens");
    assert_string_equal(kvs_gguf_key(g, 20), "toy.replaced");
    uint32_t vu32;
    int32_t vi32;
    uint64_t vu64;
    float vf;
    bool vb;
    const char *s;
    size_t sl;
    assert_int_equal(kvs_gguf_get_u32(g, "toy.u32", &vu32), KVS_OK);
    assert_int_equal(vu32, 4000000000u);
    assert_int_equal(kvs_gguf_get_i32(g, "toy.i32", &vi32), KVS_OK);
    assert_int_equal(vi32, -123456);
    assert_int_equal(kvs_gguf_get_u32(g, "toy.i32", &vu32), KVS_ERR_FORMAT); /* negative */
    assert_int_equal(kvs_gguf_get_u64(g, "toy.u64", &vu64), KVS_OK);
    assert_true(vu64 == 0x0123456789abcdefull);
    assert_int_equal(kvs_gguf_get_f32(g, "toy.f32", &vf), KVS_OK);
    assert_true(vf == 1e-5f);
    assert_int_equal(kvs_gguf_get_bool(g, "toy.bool", &vb), KVS_OK);
    assert_true(vb);
    assert_int_equal(kvs_gguf_get_str(g, "toy.empty", &s, &sl), KVS_OK);
    assert_int_equal(sl, 0);
    assert_int_equal(kvs_gguf_get_u32(g, "toy.replaced", &vu32), KVS_OK);
    assert_int_equal(vu32, 2);
    assert_int_equal(kvs_gguf_get_i32(g, "toy.u32", &vi32), KVS_ERR_FORMAT);
    assert_int_equal(kvs_gguf_get_u64(g, "toy.u32", &vu64), KVS_ERR_FORMAT);
    for (size_t i = 0; i < sizeof arrs / sizeof arrs[0]; i++) {
        enum kvs_gguf_type et;
        uint64_t n;
        const void *d;
        assert_int_equal(kvs_gguf_get_arr(g, arrs[i].key, &et, &n, &d), KVS_OK);
        assert_int_equal(et, arrs[i].t);
        assert_int_equal(n, arrs[i].n);
        if (n)
            assert_memory_equal(d, arrs[i].d, n * arrs[i].sz);
    }
    int64_t ti = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    assert_int_equal(ti, 19);
    assert_int_equal(kvs_gguf_arr_n(g, 19), 4);
    for (uint64_t j = 0; j < 4; j++) {
        assert_int_equal(kvs_gguf_arr_str(g, 19, j, &s, &sl), KVS_OK);
        assert_int_equal(sl, strlen(strs[j]));
        assert_memory_equal(s, strs[j], sl);
    }
    assert_int_equal(kvs_gguf_n_tensors(g), nt);
    uint64_t expect_off = 0;
    for (size_t i = 0; i < nt; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        assert_string_equal(t->name, ts[i].name);
        assert_int_equal(t->type, ts[i].t);
        assert_int_equal(t->n_dims, ts[i].nd);
        for (int d = 0; d < 4; d++)
            assert_int_equal(t->ne[d], ts[i].ne[d]);
        assert_int_equal(t->bytes, ts[i].bytes);
        assert_int_equal(t->offset, expect_off); /* llama.cpp packing */
        expect_off += (ts[i].bytes + 31) / 32 * 32;
        assert_memory_equal(t->data, data[i], ts[i].bytes);
    }
    assert_int_equal(kvs_gguf_data_offset(g) + expect_off, kvs_gguf_file_size(g));

    /* The whole header serialization equals the file's first bytes. */
    uint8_t *h;
    size_t hl;
    assert_int_equal(kvs_gguf_writer_header(w, &h, &hl), KVS_OK);
    assert_memory_equal(h, kvs_gguf_base(g), hl);
    free(h);

    kvs_gguf_close(g);
    unlink(path);
    kvs_gguf_writer_free(w);
    for (size_t i = 0; i < nt; i++)
        free(data[i]);
}

static void test_copy_model(void **state)
{
    (void)state;
    const char *sh = getenv("KVASIR_SHARED");
    char src[1024], dst[256], err[512];
    snprintf(src, sizeof src, "%s/models/aidreams260K.gguf", sh && *sh ? sh : "../shared");
    tmp_path(dst, sizeof dst, "copy");
    struct kvs_gguf *a = NULL, *b = NULL;
    assert_int_equal(kvs_gguf_open(src, &a, err, sizeof err), KVS_OK);
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    for (size_t i = 0; i < kvs_gguf_n_kv(a); i++)
        assert_int_equal(kvs_gguf_writer_copy_kv(w, a, i), KVS_OK);
    for (size_t i = 0; i < kvs_gguf_n_tensors(a); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(a, i);
        assert_int_equal(kvs_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->bytes),
                         KVS_OK);
    }
    assert_int_equal(kvs_gguf_writer_write_file(w, dst), KVS_OK);
    assert_int_equal(kvs_gguf_open(dst, &b, err, sizeof err), KVS_OK);
    assert_int_equal(kvs_gguf_n_kv(a), kvs_gguf_n_kv(b));
    for (size_t i = 0; i < kvs_gguf_n_kv(a); i++) {
        const uint8_t *pa, *pb;
        size_t la, lb;
        assert_int_equal(kvs_gguf_kv_raw(a, i, &pa, &la), KVS_OK);
        assert_int_equal(kvs_gguf_kv_raw(b, i, &pb, &lb), KVS_OK);
        assert_int_equal(la, lb);
        assert_memory_equal(pa, pb, la);
    }
    assert_int_equal(kvs_gguf_n_tensors(a), kvs_gguf_n_tensors(b));
    for (size_t i = 0; i < kvs_gguf_n_tensors(a); i++) {
        const struct kvs_gguf_tensor *ta = kvs_gguf_tensor(a, i), *tb = kvs_gguf_tensor(b, i);
        assert_string_equal(ta->name, tb->name);
        assert_int_equal(ta->type, tb->type);
        assert_int_equal(ta->bytes, tb->bytes);
        assert_memory_equal(ta->data, tb->data, ta->bytes);
    }
    /* The source is llama.cpp-packed, so the copy is byte-identical. */
    assert_int_equal(kvs_gguf_file_size(a), kvs_gguf_file_size(b));
    assert_memory_equal(kvs_gguf_base(a), kvs_gguf_base(b), kvs_gguf_file_size(a));
    uint8_t fa[32], fb[32];
    assert_int_equal(kvs_gguf_fingerprint(a, fa), KVS_OK);
    assert_int_equal(kvs_gguf_fingerprint(b, fb), KVS_OK);
    assert_memory_equal(fa, fb, 32);
    kvs_gguf_close(a);
    kvs_gguf_close(b);
    kvs_gguf_writer_free(w);
    unlink(dst);
}

/* Every prefix of a small valid file fails cleanly: parse says NEED_MORE
 * while the header is cut and succeeds once it is whole (data ranges are
 * checked against the full size); open of a truncated copy says TRUNCATED. */
static void test_truncation_sweep(void **state)
{
    (void)state;
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_int_equal(kvs_gguf_writer_set_str(w, "general.architecture", "toy"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "toy.block_count", 1), KVS_OK);
    const char *strs[] = { "x", "yz" };
    assert_int_equal(kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", strs, 2), KVS_OK);
    const float f[2][8] = { { 1, 2, 3, 4, 5, 6, 7, 8 }, { 0 } };
    const int64_t ne[1] = { 8 };
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "t0", KVS_TYPE_F32, 1, ne, f[0], 32), KVS_OK);
    assert_int_equal(kvs_gguf_writer_add_tensor(w, "t1", KVS_TYPE_F32, 1, ne, f[1], 32), KVS_OK);
    char path[256], cut[256], err[512];
    tmp_path(path, sizeof path, "full");
    tmp_path(cut, sizeof cut, "cut");
    assert_int_equal(kvs_gguf_writer_write_file(w, path), KVS_OK);
    size_t n;
    uint8_t *b = read_all(path, &n);
    size_t hdr = (size_t)kvs_gguf_writer_header_bytes(w);
    assert_int_equal(n, hdr + 64);
    size_t unpadded_hdr = 24 + (8 + 20 + 4 + 8 + 3) + (8 + 15 + 4 + 4) + (8 + 21 + 4 + 4 + 8 + 9 + 10) +
                          2 * (8 + 2 + 4 + 8 + 4 + 8);
    for (size_t len = 0; len <= n; len++) {
        struct kvs_gguf *g = NULL;
        size_t need = 0;
        kvs_err e = kvs_gguf_parse(b, len, n, &g, &need, err, sizeof err);
        if (len < unpadded_hdr) {
            assert_int_equal(e, KVS_ERR_NEED_MORE);
            assert_true(need >= len + 1 && need <= n);
            assert_null(g);
        } else {
            assert_int_equal(e, KVS_OK);
            /* t1 has data only when it is wholly inside the prefix. */
            assert_true((kvs_gguf_tensor(g, 1)->data != NULL) == (len >= hdr + 64));
            kvs_gguf_close(g);
        }
        /* The same prefix as a whole file. */
        e = kvs_gguf_parse(b, len, len, &g, &need, err, sizeof err);
        if (len < n)
            assert_int_equal(e, KVS_ERR_TRUNCATED);
        else
            assert_int_equal(e, KVS_OK);
        kvs_gguf_close(g);
        { /* open() of a truncated copy */
            FILE *fo = fopen(cut, "wb");
            assert_non_null(fo);
            assert_int_equal(fwrite(b, 1, len, fo), len);
            fclose(fo);
            g = NULL;
            e = kvs_gguf_open(cut, &g, err, sizeof err);
            assert_int_equal(e, len < n ? KVS_ERR_TRUNCATED : KVS_OK);
            if (len < n)
                assert_non_null(strstr(err, "truncated") ? strstr(err, "truncated") : strstr(err, "past the end"));
            kvs_gguf_close(g);
        }
    }
    free(b);
    unlink(path);
    unlink(cut);
    kvs_gguf_writer_free(w);
}

/* Byte builder for the fingerprint recipe (docs/FORMATS.md), written out
 * field by field here, independently of the implementation. */
struct rb {
    uint8_t b[1024];
    size_t n;
};
static void rb_put(struct rb *r, const void *p, size_t n)
{
    assert_true(r->n + n <= sizeof r->b);
    memcpy(r->b + r->n, p, n);
    r->n += n;
}
static void rb_u64(struct rb *r, uint64_t v)
{
    for (int i = 0; i < 8; i++) {
        uint8_t c = (uint8_t)(v >> (8 * i));
        rb_put(r, &c, 1);
    }
}
static void rb_u32(struct rb *r, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        uint8_t c = (uint8_t)(v >> (8 * i));
        rb_put(r, &c, 1);
    }
}
static void rb_str(struct rb *r, const char *s)
{
    rb_u64(r, strlen(s));
    rb_put(r, s, strlen(s));
}

static struct kvs_gguf *write_and_open(struct kvs_gguf_writer *w, const char *tag)
{
    char path[256], err[256];
    tmp_path(path, sizeof path, tag);
    assert_int_equal(kvs_gguf_writer_write_file(w, path), KVS_OK);
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g, err, sizeof err), KVS_OK);
    unlink(path); /* the mapping stays valid */
    return g;
}

static void test_fingerprint(void **state)
{
    (void)state;
    const float z[32] = { 0 };
    const int64_t ne_b[2] = { 4, 2 }, ne_a[1] = { 32 };
    const char *toks[] = { "a", "b", "c" };

    /* File 1: KVs and tensors in one order. */
    struct kvs_gguf_writer *w1 = kvs_gguf_writer_create();
    assert_int_equal(kvs_gguf_writer_set_str(w1, "general.architecture", "toy"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w1, "toy.n", 5), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_f32(w1, "toy.eps", 0.5f), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_str(w1, "general.name", "one"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w1, "toyx.ignored", 1), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_arr_str(w1, "tokenizer.ggml.tokens", toks, 3), KVS_OK);
    assert_int_equal(kvs_gguf_writer_add_tensor(w1, "b", KVS_TYPE_F32, 2, ne_b, z, 32), KVS_OK);
    assert_int_equal(kvs_gguf_writer_add_tensor(w1, "a", KVS_TYPE_Q8_0, 1, ne_a, z, 34), KVS_OK);
    struct kvs_gguf *g1 = write_and_open(w1, "fp1");

    /* File 2: other order, other general.* and non-arch keys, alignment 64. */
    struct kvs_gguf_writer *w2 = kvs_gguf_writer_create();
    assert_int_equal(kvs_gguf_writer_set_u32(w2, "general.alignment", 64), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_arr_str(w2, "tokenizer.ggml.tokens", toks, 3), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_f32(w2, "toy.eps", 0.5f), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_str(w2, "general.name", "two"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w2, "toy.n", 5), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_str(w2, "general.architecture", "toy"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_add_tensor(w2, "a", KVS_TYPE_Q8_0, 1, ne_a, z, 34), KVS_OK);
    assert_int_equal(kvs_gguf_writer_add_tensor(w2, "b", KVS_TYPE_F32, 2, ne_b, z, 32), KVS_OK);
    struct kvs_gguf *g2 = write_and_open(w2, "fp2");

    struct rb r = { .n = 0 };
    rb_put(&r, "kvasir-fingerprint-v1", 21);
    rb_str(&r, "toy");
    rb_u64(&r, 2);
    rb_str(&r, "toy.eps"); /* sorted: toy.eps < toy.n */
    rb_u32(&r, 6);
    uint32_t half;
    float h = 0.5f;
    memcpy(&half, &h, 4);
    rb_u32(&r, half);
    rb_str(&r, "toy.n");
    rb_u32(&r, 4);
    rb_u32(&r, 5);
    rb_u64(&r, 3);         /* vocab */
    rb_u64(&r, 2);         /* tensors */
    rb_str(&r, "a");
    rb_u32(&r, 8);         /* Q8_0 */
    rb_u32(&r, 1);
    rb_u64(&r, 32);
    rb_str(&r, "b");
    rb_u32(&r, 0);
    rb_u32(&r, 2);
    rb_u64(&r, 4);
    rb_u64(&r, 2);
    uint8_t want[32], f1[32], f2[32];
    SHA256(r.b, r.n, want);
    assert_int_equal(kvs_gguf_fingerprint(g1, f1), KVS_OK);
    assert_int_equal(kvs_gguf_fingerprint(g2, f2), KVS_OK);
    assert_memory_equal(f1, want, 32);
    assert_memory_equal(f2, want, 32);

    /* A shard carrying its source's fingerprint returns it. */
    char hex[65];
    kvs_gguf_fingerprint_hex(want, hex);
    assert_int_equal(strlen(hex), 64);
    for (int i = 0; i < 64; i++)
        assert_true((hex[i] >= '0' && hex[i] <= '9') || (hex[i] >= 'a' && hex[i] <= 'f'));
    struct kvs_gguf_writer *w3 = kvs_gguf_writer_create();
    assert_int_equal(kvs_gguf_writer_set_str(w3, "general.architecture", "other"), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_str(w3, "kvasir.shard.source_fingerprint", hex), KVS_OK);
    struct kvs_gguf *g3 = write_and_open(w3, "fp3");
    uint8_t f3[32];
    assert_int_equal(kvs_gguf_fingerprint(g3, f3), KVS_OK);
    assert_memory_equal(f3, want, 32);
    kvs_gguf_close(g3);
    assert_int_equal(kvs_gguf_writer_set_str(w3, "kvasir.shard.source_fingerprint", "abc"), KVS_OK);
    g3 = write_and_open(w3, "fp3");
    assert_int_equal(kvs_gguf_fingerprint(g3, f3), KVS_ERR_FORMAT);
    kvs_gguf_close(g3);

    /* A changed hyperparameter changes it. */
    assert_int_equal(kvs_gguf_writer_set_u32(w1, "toy.n", 6), KVS_OK);
    kvs_gguf_close(g1);
    g1 = write_and_open(w1, "fp1");
    assert_int_equal(kvs_gguf_fingerprint(g1, f1), KVS_OK);
    assert_memory_not_equal(f1, want, 32);

    kvs_gguf_close(g1);
    kvs_gguf_close(g2);
    kvs_gguf_writer_free(w1);
    kvs_gguf_writer_free(w2);
    kvs_gguf_writer_free(w3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_by_hand),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_copy_model),
        cmocka_unit_test(test_truncation_sweep),
        cmocka_unit_test(test_fingerprint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* A table of handcrafted bad GGUF files, built byte by byte, each asserting
 * the specific error and a piece of the message. Every case is run through
 * kvs_gguf_parse (whole buffer) and kvs_gguf_open (a temp file). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "gguf/gguf.h"

/* ---- byte builder ---------------------------------------------------- */

struct bb {
    uint8_t b[4096];
    size_t n;
};

static void put(struct bb *b, const void *p, size_t n)
{
    assert_true(b->n + n <= sizeof b->b);
    memcpy(b->b + b->n, p, n);
    b->n += n;
}
static void u8(struct bb *b, uint8_t v) { put(b, &v, 1); }
static void u32(struct bb *b, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        u8(b, (uint8_t)(v >> (8 * i)));
}
static void u64(struct bb *b, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        u8(b, (uint8_t)(v >> (8 * i)));
}
static void str(struct bb *b, const char *s)
{
    u64(b, strlen(s));
    put(b, s, strlen(s));
}
static void hdr(struct bb *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    put(b, "GGUF", 4);
    u32(b, version);
    u64(b, n_tensors);
    u64(b, n_kv);
}
static void kv_u32(struct bb *b, const char *key, uint32_t v)
{
    str(b, key);
    u32(b, 4); /* UINT32 */
    u32(b, v);
}
/* Tensor info with up to 4 dims. */
static void tinfo(struct bb *b, const char *name, uint32_t n_dims, const int64_t *ne, uint32_t type, uint64_t off)
{
    str(b, name);
    u32(b, n_dims);
    for (uint32_t d = 0; d < n_dims; d++)
        u64(b, (uint64_t)ne[d]);
    u32(b, type);
    u64(b, off);
}
/* Zero padding to 32, then `bytes` bytes of tensor data. */
static void data(struct bb *b, size_t bytes)
{
    while (b->n % 32)
        u8(b, 0);
    for (size_t i = 0; i < bytes; i++)
        u8(b, (uint8_t)i);
}

static const int64_t NE8[1] = { 8 };

/* ---- the cases --------------------------------------------------------- */

static void c_valid_v2(struct bb *b)
{
    hdr(b, 2, 1, 1);
    kv_u32(b, "a", 1);
    tinfo(b, "t", 1, NE8, 0, 0);
    data(b, 32);
}
/* Tensors out of order with a gap: allowed (only alignment is required). */
static void c_valid_gap(struct bb *b)
{
    hdr(b, 3, 2, 1);
    kv_u32(b, "general.alignment", 64);
    tinfo(b, "late", 1, NE8, 0, 128);
    tinfo(b, "early", 1, NE8, 0, 0);
    while (b->n % 64)
        u8(b, 0);
    data(b, 160);
}
static void c_bad_magic(struct bb *b)
{
    put(b, "GGUG", 4);
    u32(b, 3);
    u64(b, 0);
    u64(b, 0);
}
static void c_version1(struct bb *b) { hdr(b, 1, 0, 0); }
static void c_version4(struct bb *b) { hdr(b, 4, 0, 0); }
static void c_version_be(struct bb *b) { hdr(b, 0x03000000u, 0, 0); }
static void c_short_header(struct bb *b)
{
    put(b, "GGUF", 4);
    u32(b, 3);
    u32(b, 0);
}
static void c_kv_count(struct bb *b) { hdr(b, 3, 0, 1000000); }
static void c_tensor_count(struct bb *b) { hdr(b, 3, UINT64_MAX, 0); }
static void c_key_len(struct bb *b)
{
    hdr(b, 3, 0, 1);
    u64(b, 1ull << 40);
    put(b, "abcdefghijklmnop", 16);
}
static void c_empty_key(struct bb *b)
{
    hdr(b, 3, 0, 1);
    kv_u32(b, "", 1);
}
static void c_nul_key(struct bb *b)
{
    hdr(b, 3, 0, 1);
    u64(b, 3);
    put(b, "a\0b", 3);
    u32(b, 4);
    u32(b, 1);
}
static void c_kv_type(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "a");
    u32(b, 13);
    u32(b, 0);
}
static void c_nested(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "arr");
    u32(b, 9);
    u32(b, 9);
    u64(b, 1);
    u32(b, 4);
    u64(b, 0);
}
static void c_arr_elem_type(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "arr");
    u32(b, 9);
    u32(b, 77);
    u64(b, 0);
}
static void c_arr_count(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "arr");
    u32(b, 9);
    u32(b, 4); /* UINT32 */
    u64(b, 1ull << 61);
    u32(b, 0);
}
static void c_str_arr_count(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "toks");
    u32(b, 9);
    u32(b, 8); /* STRING */
    u64(b, 100);
    str(b, "a");
}
static void c_str_len(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "s");
    u32(b, 8);
    u64(b, 999);
    put(b, "abc", 3);
}
static void c_dup_key(struct bb *b)
{
    hdr(b, 3, 0, 3);
    kv_u32(b, "a", 1);
    kv_u32(b, "b", 2);
    kv_u32(b, "a", 3);
}
static void c_align_type(struct bb *b)
{
    hdr(b, 3, 0, 1);
    str(b, "general.alignment");
    u32(b, 5); /* INT32 */
    u32(b, 32);
}
static void c_align_npot(struct bb *b)
{
    hdr(b, 3, 0, 1);
    kv_u32(b, "general.alignment", 48);
}
static void c_align_zero(struct bb *b)
{
    hdr(b, 3, 0, 1);
    kv_u32(b, "general.alignment", 0);
}
static void c_name_long(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "a234567890123456789012345678901234567890123456789012345678901234", 1, NE8, 0, 0);
    data(b, 32);
}
static void c_name_empty(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "", 1, NE8, 0, 0);
    data(b, 32);
}
static void c_ndims0(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 0, NE8, 0, 0);
    data(b, 32);
}
static void c_ndims5(struct bb *b)
{
    static const int64_t ne[5] = { 1, 1, 1, 1, 1 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 5, ne, 0, 0);
    data(b, 32);
}
static void c_dim_zero(struct bb *b)
{
    static const int64_t ne[2] = { 8, 0 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 2, ne, 0, 0);
    data(b, 32);
}
static void c_dim_negative(struct bb *b)
{
    static const int64_t ne[2] = { 8, -2 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 2, ne, 0, 0);
    data(b, 32);
}
static void c_type_removed(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, NE8, 4, 0);
    data(b, 32);
}
static void c_type_unknown(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, NE8, 39, 0);
    data(b, 32);
}
static void c_nel_overflow(struct bb *b)
{
    static const int64_t ne[3] = { 1ll << 31, 1ll << 31, 1ll << 2 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 3, ne, 0, 0);
    data(b, 32);
}
static void c_bytes_overflow(struct bb *b)
{
    static const int64_t ne[1] = { 1ll << 62 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, ne, 0, 0); /* 2^62 F32 = 2^64 bytes */
    data(b, 32);
}
static void c_block_multiple(struct bb *b)
{
    static const int64_t ne[1] = { 48 };
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, ne, 2 /* Q4_0 */, 0);
    data(b, 64);
}
static void c_unaligned(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, NE8, 0, 16);
    data(b, 64);
}
static void c_past_eof(struct bb *b)
{
    hdr(b, 3, 2, 0);
    tinfo(b, "t0", 1, NE8, 0, 0);
    tinfo(b, "t1", 1, NE8, 0, 32);
    data(b, 40); /* t1 needs bytes 32..63 */
}
static void c_overlap(struct bb *b)
{
    static const int64_t ne[1] = { 16 };
    hdr(b, 3, 2, 0);
    tinfo(b, "t0", 1, ne, 0, 0); /* 64 bytes */
    tinfo(b, "t1", 1, NE8, 0, 32);
    data(b, 96);
}
static void c_dup_tensor(struct bb *b)
{
    hdr(b, 3, 2, 0);
    tinfo(b, "t", 1, NE8, 0, 0);
    tinfo(b, "t", 1, NE8, 0, 32);
    data(b, 64);
}
static void c_data_start_past_eof(struct bb *b)
{
    hdr(b, 3, 1, 0);
    tinfo(b, "t", 1, NE8, 0, 0);
    /* no padding, no data */
}

struct bad_case {
    const char *name;
    void (*build)(struct bb *);
    kvs_err err;
    const char *msg;
};

static const struct bad_case k_cases[] = {
    { "valid v2 file", c_valid_v2, KVS_OK, "" },
    { "valid: gap and reversed order", c_valid_gap, KVS_OK, "" },
    { "bad magic", c_bad_magic, KVS_ERR_FORMAT, "bad magic" },
    { "version 1", c_version1, KVS_ERR_UNSUPPORTED, "bad version 1" },
    { "version 4", c_version4, KVS_ERR_UNSUPPORTED, "bad version 4" },
    { "big-endian version", c_version_be, KVS_ERR_UNSUPPORTED, "big-endian" },
    { "truncated header", c_short_header, KVS_ERR_TRUNCATED, "tensor count" },
    { "KV count past EOF", c_kv_count, KVS_ERR_TRUNCATED, "KV count 1000000 is past the end" },
    { "tensor count past EOF", c_tensor_count, KVS_ERR_TRUNCATED, "tensor count" },
    { "key length past EOF", c_key_len, KVS_ERR_TRUNCATED, "string length 1099511627776" },
    { "empty key", c_empty_key, KVS_ERR_FORMAT, "empty key" },
    { "NUL in key", c_nul_key, KVS_ERR_FORMAT, "NUL byte" },
    { "unknown KV type", c_kv_type, KVS_ERR_FORMAT, "unknown value type 13" },
    { "nested array", c_nested, KVS_ERR_FORMAT, "nested arrays" },
    { "unknown array element type", c_arr_elem_type, KVS_ERR_FORMAT, "unknown array element type 77" },
    { "array count past EOF", c_arr_count, KVS_ERR_TRUNCATED, "array of 2305843009213693952 UINT32" },
    { "string array count past EOF", c_str_arr_count, KVS_ERR_TRUNCATED, "array of 100 strings" },
    { "string length past EOF", c_str_len, KVS_ERR_TRUNCATED, "string length 999" },
    { "duplicate key", c_dup_key, KVS_ERR_FORMAT, "duplicate key 'a'" },
    { "alignment type", c_align_type, KVS_ERR_FORMAT, "general.alignment has type INT32" },
    { "alignment not power of two", c_align_npot, KVS_ERR_FORMAT, "alignment 48 is not a nonzero power" },
    { "alignment zero", c_align_zero, KVS_ERR_FORMAT, "alignment 0 is not a nonzero power" },
    { "tensor name too long", c_name_long, KVS_ERR_FORMAT, "name too long (64 bytes" },
    { "tensor name empty", c_name_empty, KVS_ERR_FORMAT, "empty name" },
    { "n_dims 0", c_ndims0, KVS_ERR_FORMAT, "n_dims 0 is not in 1..4" },
    { "n_dims 5", c_ndims5, KVS_ERR_FORMAT, "n_dims 5 is not in 1..4" },
    { "dimension 0", c_dim_zero, KVS_ERR_FORMAT, "dimension 1 is 0" },
    { "negative dimension", c_dim_negative, KVS_ERR_FORMAT, "dimension 1 is -2" },
    { "removed tensor type", c_type_removed, KVS_ERR_FORMAT, "invalid tensor type 4" },
    { "unknown tensor type", c_type_unknown, KVS_ERR_FORMAT, "invalid tensor type 39" },
    { "element count overflow", c_nel_overflow, KVS_ERR_RANGE, "element count overflows" },
    { "byte size overflow", c_bytes_overflow, KVS_ERR_RANGE, "byte size overflows" },
    { "ne0 not a block multiple", c_block_multiple, KVS_ERR_FORMAT, "ne[0] = 48 is not a multiple of the Q4_0 block size 32" },
    { "offset not aligned", c_unaligned, KVS_ERR_FORMAT, "offset 16 is not a multiple of the alignment 32" },
    { "tensor past EOF", c_past_eof, KVS_ERR_TRUNCATED, "tensor 't1': offset 32 + 32 bytes is past the end of the data section (40 bytes)" },
    { "overlapping tensors", c_overlap, KVS_ERR_FORMAT, "'t0' (offset 0, 64 bytes) and 't1' (offset 32) overlap" },
    { "duplicate tensor name", c_dup_tensor, KVS_ERR_FORMAT, "duplicate tensor name 't'" },
    { "data section past EOF", c_data_start_past_eof, KVS_ERR_TRUNCATED, "data section starts at" },
};

static void test_bad_table(void **state)
{
    (void)state;
    char path[256];
    snprintf(path, sizeof path, "/tmp/kvs_gguf_bad_%ld.gguf", (long)getpid());
    for (size_t i = 0; i < sizeof k_cases / sizeof k_cases[0]; i++) {
        const struct bad_case *c = &k_cases[i];
        struct bb *b = calloc(1, sizeof *b);
        assert_non_null(b);
        c->build(b);
        char err[512] = "";
        struct kvs_gguf *g = NULL;
        kvs_err e = kvs_gguf_parse(b->b, b->n, b->n, &g, NULL, err, sizeof err);
        if (e != c->err || !strstr(err, c->msg))
            print_error("case '%s': got %s \"%s\", want %s \"%s\"\n", c->name, kvs_strerror(e), err,
                        kvs_strerror(c->err), c->msg);
        assert_int_equal(e, c->err);
        assert_non_null(strstr(err, c->msg));
        assert_true((g != NULL) == (c->err == KVS_OK));
        if (c->build == c_valid_gap) {
            assert_int_equal(kvs_gguf_alignment(g), 64);
            assert_int_equal(kvs_gguf_data_offset(g) % 64, 0);
            const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(g, "late");
            assert_non_null(t);
            assert_ptr_equal(t->data, b->b + kvs_gguf_data_offset(g) + 128);
        }
        kvs_gguf_close(g);

        /* The same bytes as a file. */
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(b->b, 1, b->n, f), b->n);
        fclose(f);
        g = NULL;
        e = kvs_gguf_open(path, &g, err, sizeof err);
        assert_int_equal(e, c->err);
        assert_non_null(strstr(err, c->msg));
        kvs_gguf_close(g);
        free(b);
    }
    unlink(path);
}

/* A header cut short in a buffer of a longer file asks for more bytes. */
static void test_need_more(void **state)
{
    (void)state;
    struct bb b = { .n = 0 };
    c_valid_v2(&b);
    for (size_t len = 0; len < 24 + 17 + 33; len++) {
        size_t need = 0;
        struct kvs_gguf *g = NULL;
        char err[256];
        assert_int_equal(kvs_gguf_parse(b.b, len, b.n, &g, &need, err, sizeof err), KVS_ERR_NEED_MORE);
        assert_true(need > len && need <= b.n);
        assert_null(g);
    }
    /* A wrong magic is refused from its first byte, not asked for more. */
    size_t need = 0;
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_parse("GX", 2, 1000, &g, &need, NULL, 0), KVS_ERR_FORMAT);
    /* The whole valid file with a huge stated size: still parses (ranges are
     * only checked against file_size), data pointers set. */
    assert_int_equal(kvs_gguf_parse(b.b, b.n, 1u << 20, &g, &need, NULL, 0), KVS_OK);
    assert_non_null(kvs_gguf_tensor(g, 0)->data);
    kvs_gguf_close(g);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_table),
        cmocka_unit_test(test_need_more),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Stage shards: window tensor sets, extraction, check, index, and (in
 * process, on loopback) the seed server's range handling and fetch. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <curl/curl.h>
#include <openssl/evp.h>

#include "gguf/gguf.h"
#include "shard/shard.h"

static char g_tmp[256];

static const char *models_dir(void)
{
    static char buf[1024];
    const char *s = getenv("KVASIR_SHARED");
    snprintf(buf, sizeof buf, "%s/models", s ? s : "../shared");
    return buf;
}

static struct kvs_gguf *open_model(const char *name)
{
    char path[1200], msg[256] = "";
    snprintf(path, sizeof path, "%s/%s", models_dir(), name);
    struct kvs_gguf *g = NULL;
    kvs_err err = kvs_gguf_open(path, &g, msg, sizeof msg);
    if (err)
        fprintf(stderr, "open %s: %s\n", path, msg);
    assert_int_equal(err, KVS_OK);
    return g;
}

static void tmp_path(char *out, size_t n, const char *name) { snprintf(out, n, "%s/%s", g_tmp, name); }

static bool file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

/* The test's own statement of which tensors a window needs (independent of
 * kvs_shard_window_tensors). */
static bool needed(const struct kvs_gguf *g, const char *name, uint32_t b, uint32_t e, uint32_t n_block)
{
    unsigned blk;
    int used = 0;
    if (sscanf(name, "blk.%u.%n", &blk, &used) == 1 && used > 0)
        return blk >= b && blk < e;
    bool tied = kvs_gguf_find_tensor(g, "output.weight") == NULL;
    if (!strcmp(name, "token_embd.weight"))
        return b == 0 || (e == n_block && tied);
    if (!strcmp(name, "output_norm.weight") || !strcmp(name, "output.weight"))
        return e == n_block;
    return true;
}

static const char *const k_models[] = { "aidreams260K.gguf", "llama-f32.gguf",   "llama-mixed.gguf",
                                        "llama-q2_k.gguf",   "llama-q4_k_m.gguf", "llama-q5_k_m.gguf",
                                        "qwen2-mixed.gguf",  "qwen3-q8_0.gguf",   "qwen3moe-mixed.gguf" };

static void check_shard(const struct kvs_gguf *src, const char *path, uint32_t b, uint32_t e, uint32_t n_block)
{
    char msg[256] = "";
    struct kvs_gguf *s = NULL;
    assert_int_equal(kvs_gguf_open(path, &s, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_gguf_version(s), 3);
    /* exactly the expected tensor set, in source order, bytes identical */
    size_t k = 0;
    for (size_t i = 0; i < kvs_gguf_n_tensors(src); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(src, i);
        const struct kvs_gguf_tensor *u = kvs_gguf_find_tensor(s, t->name);
        if (!needed(src, t->name, b, e, n_block)) {
            assert_null(u);
            continue;
        }
        assert_non_null(u);
        assert_ptr_equal(u, kvs_gguf_tensor(s, k));
        k++;
        assert_int_equal(u->type, t->type);
        assert_memory_equal(u->ne, t->ne, sizeof t->ne);
        assert_int_equal(u->bytes, t->bytes);
        assert_int_equal(u->offset % kvs_gguf_alignment(s), 0);
        assert_memory_equal(u->data, t->data, t->bytes);
    }
    assert_int_equal(k, kvs_gguf_n_tensors(s));
    /* every source KV verbatim */
    for (size_t i = 0; i < kvs_gguf_n_kv(src); i++) {
        const uint8_t *p1, *p2;
        size_t l1, l2;
        int64_t j = kvs_gguf_find_key(s, kvs_gguf_key(src, i));
        assert_true(j >= 0);
        if (!strncmp(kvs_gguf_key(src, i), "kvasir.shard.", 13))
            continue;
        assert_int_equal(kvs_gguf_kv_raw(src, i, &p1, &l1), KVS_OK);
        assert_int_equal(kvs_gguf_kv_raw(s, (size_t)j, &p2, &l2), KVS_OK);
        assert_int_equal(l1, l2);
        assert_memory_equal(p1, p2, l1);
    }
    /* shard keys */
    uint32_t v;
    assert_int_equal(kvs_gguf_get_u32(s, KVS_SHARD_KEY_WINDOW_BEGIN, &v), KVS_OK);
    assert_int_equal(v, b);
    assert_int_equal(kvs_gguf_get_u32(s, KVS_SHARD_KEY_WINDOW_END, &v), KVS_OK);
    assert_int_equal(v, e);
    assert_int_equal(kvs_gguf_get_u32(s, KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, &v), KVS_OK);
    assert_int_equal(v, n_block);
    uint8_t fa[32], fb[32];
    assert_int_equal(kvs_gguf_fingerprint(src, fa), KVS_OK);
    assert_int_equal(kvs_gguf_fingerprint(s, fb), KVS_OK);
    assert_memory_equal(fa, fb, 32);
    /* tensors_sha256 = SHA-256 of the concatenated per-tensor digests */
    size_t n = kvs_gguf_n_tensors(s);
    uint8_t *cat = malloc(32 * (n ? n : 1)), d[32];
    for (size_t i = 0; i < n; i++)
        assert_int_equal(kvs_shard_sha256(kvs_gguf_tensor(s, i)->data, kvs_gguf_tensor(s, i)->bytes, cat + 32 * i),
                         KVS_OK);
    assert_int_equal(kvs_shard_sha256(cat, 32 * n, d), KVS_OK);
    free(cat);
    char hex[65];
    kvs_shard_hex(d, hex);
    const char *str;
    size_t len;
    assert_int_equal(kvs_gguf_get_str(s, KVS_SHARD_KEY_TENSORS_SHA256, &str, &len), KVS_OK);
    assert_int_equal(len, 64);
    assert_memory_equal(str, hex, 64);
    assert_int_equal(kvs_shard_check(s, b, e, msg, sizeof msg), KVS_OK);
    kvs_gguf_close(s);
}

static void test_extract_all_models(void **state)
{
    (void)state;
    for (size_t m = 0; m < sizeof k_models / sizeof k_models[0]; m++) {
        struct kvs_gguf *g = open_model(k_models[m]);
        uint32_t n = 0;
        assert_int_equal(kvs_shard_block_count(g, &n), KVS_OK);
        assert_true(n >= 3);
        const uint32_t win[][2] = { { 0, n }, { 0, 1 }, { 1, 2 }, { n - 1, n }, { 1, n - 1 } };
        for (size_t w = 0; w < 5; w++) {
            char path[512], msg[256] = "";
            tmp_path(path, sizeof path, "x.gguf");
            assert_int_equal(kvs_shard_extract(g, win[w][0], win[w][1], path, msg, sizeof msg), KVS_OK);
            check_shard(g, path, win[w][0], win[w][1], n);
            remove(path);
        }
        kvs_gguf_close(g);
    }
}

/* Hand-counted tensor sets: a llama block has 9 tensors (attn_norm, q, k, v,
 * output, ffn_norm, gate, up, down); a qwen3 block 11 (+ q_norm, k_norm). */
static void test_window_counts(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("llama-q4_k_m.gguf"); /* 3 blocks, untied */
    size_t *idx = NULL, n = 0;
    assert_int_equal(kvs_shard_window_tensors(g, 1, 2, &idx, &n, NULL, 0), KVS_OK);
    assert_int_equal(n, 9);
    free(idx);
    assert_int_equal(kvs_shard_window_tensors(g, 0, 1, &idx, &n, NULL, 0), KVS_OK);
    assert_int_equal(n, 10); /* + token_embd */
    free(idx);
    assert_int_equal(kvs_shard_window_tensors(g, 2, 3, &idx, &n, NULL, 0), KVS_OK);
    assert_int_equal(n, 11); /* + output_norm, output */
    free(idx);
    assert_int_equal(kvs_shard_window_tensors(g, 0, 3, &idx, &n, NULL, 0), KVS_OK);
    assert_int_equal(n, kvs_gguf_n_tensors(g));
    assert_int_equal(n, 3 * 9 + 3);
    free(idx);
    assert_int_equal(kvs_shard_window_tensors(g, 2, 2, &idx, &n, NULL, 0), KVS_ERR_RANGE);
    assert_int_equal(kvs_shard_window_tensors(g, 2, 4, &idx, &n, NULL, 0), KVS_ERR_RANGE);
    kvs_gguf_close(g);

    g = open_model("qwen3-q8_0.gguf"); /* 4 blocks, tied output */
    assert_null(kvs_gguf_find_tensor(g, "output.weight"));
    assert_int_equal(kvs_shard_window_tensors(g, 3, 4, &idx, &n, NULL, 0), KVS_OK);
    assert_int_equal(n, 11 + 2); /* + output_norm + token_embd (tied head) */
    bool has_embd = false;
    for (size_t i = 0; i < n; i++)
        has_embd |= !strcmp(kvs_gguf_tensor(g, idx[i])->name, "token_embd.weight");
    assert_true(has_embd);
    free(idx);
    kvs_gguf_close(g);
}

static void test_check(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("llama-q4_k_m.gguf");
    char path[512], msg[256] = "";
    assert_int_equal(kvs_shard_check(g, 0, 3, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_check(g, 1, 2, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_check(g, 1, 4, msg, sizeof msg), KVS_ERR_RANGE);
    tmp_path(path, sizeof path, "c12.gguf");
    assert_int_equal(kvs_shard_extract(g, 1, 3, path, msg, sizeof msg), KVS_OK);
    struct kvs_gguf *s = NULL;
    assert_int_equal(kvs_gguf_open(path, &s, msg, sizeof msg), KVS_OK);
    uint32_t b = 0, e = 0;
    assert_true(kvs_shard_window(s, &b, &e));
    assert_int_equal(b, 1);
    assert_int_equal(e, 3);
    assert_false(kvs_shard_window(g, &b, &e));
    assert_int_equal(kvs_shard_check(s, 1, 3, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_check(s, 2, 3, msg, sizeof msg), KVS_OK); /* covered */
    assert_int_equal(kvs_shard_check(s, 0, 2, msg, sizeof msg), KVS_ERR_MISMATCH);
    assert_non_null(strstr(msg, "[1,3)"));
    assert_non_null(strstr(msg, "[0,2)"));
    assert_int_equal(kvs_shard_check(s, 0, 3, msg, sizeof msg), KVS_ERR_MISMATCH);
    /* extracting from a shard needs coverage too */
    char p2[512];
    tmp_path(p2, sizeof p2, "c01.gguf");
    assert_int_equal(kvs_shard_extract(s, 0, 1, p2, msg, sizeof msg), KVS_ERR_MISMATCH);
    assert_false(file_exists(p2));
    /* a shard of a shard is byte-identical to the shard of the full file */
    char p3[512];
    tmp_path(p3, sizeof p3, "c22a.gguf");
    assert_int_equal(kvs_shard_extract(s, 2, 3, p2, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_extract(g, 2, 3, p3, msg, sizeof msg), KVS_OK);
    struct kvs_gguf *x = NULL, *y = NULL;
    assert_int_equal(kvs_gguf_open(p2, &x, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_gguf_open(p3, &y, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_gguf_file_size(x), kvs_gguf_file_size(y));
    assert_memory_equal(kvs_gguf_base(x), kvs_gguf_base(y), kvs_gguf_file_size(x));
    kvs_gguf_close(x);
    kvs_gguf_close(y);
    remove(p2);
    remove(p3);
    kvs_gguf_close(s);
    remove(path);
    kvs_gguf_close(g);
}

/* A header-only GGUF with the given keys (llama, block_count n; begin/end/src
 * written when >= 0), described by kvs_shard_describe. */
static kvs_err describe_keys(long n, long begin, long end, long src, char *buf, size_t cap)
{
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_non_null(w);
    assert_int_equal(kvs_gguf_writer_set_str(w, "general.architecture", "llama"), KVS_OK);
    if (n >= 0)
        assert_int_equal(kvs_gguf_writer_set_u32(w, "llama.block_count", (uint32_t)n), KVS_OK);
    if (begin >= 0)
        assert_int_equal(kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_WINDOW_BEGIN, (uint32_t)begin), KVS_OK);
    if (end >= 0)
        assert_int_equal(kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_WINDOW_END, (uint32_t)end), KVS_OK);
    if (src >= 0)
        assert_int_equal(kvs_gguf_writer_set_u32(w, KVS_SHARD_KEY_SOURCE_BLOCK_COUNT, (uint32_t)src), KVS_OK);
    uint8_t *hdr = NULL;
    size_t len = 0;
    assert_int_equal(kvs_gguf_writer_header(w, &hdr, &len), KVS_OK);
    struct kvs_gguf *g = NULL;
    char msg[256];
    assert_int_equal(kvs_gguf_parse(hdr, len, len, &g, NULL, msg, sizeof msg), KVS_OK);
    kvs_err e = kvs_shard_describe(g, buf, cap);
    kvs_gguf_close(g);
    free(hdr);
    kvs_gguf_writer_free(w);
    return e;
}

/* `kvasir gguf info` on a shard says which window it holds (it showed only
 * the source's block_count). llama-q4_k_m has 3 blocks. */
static void test_shard_describe(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("llama-q4_k_m.gguf");
    char buf[256] = "x", msg[256] = "";
    assert_int_equal(kvs_shard_describe(g, buf, sizeof buf), KVS_ERR_NOT_FOUND); /* a full model */
    assert_string_equal(buf, "");
    static const struct {
        uint32_t b, e;
        const char *want;
    } win[] = {
        { 1, 3, "window [1,3) of 3 source blocks (tail: output norm + LM head)" },
        { 0, 1, "window [0,1) of 3 source blocks (head: token embedding)" },
        { 1, 2, "window [1,2) of 3 source blocks" },
        { 0, 3, "window [0,3) of 3 source blocks (whole model: head and tail)" },
    };
    for (size_t i = 0; i < sizeof win / sizeof win[0]; i++) {
        char path[512];
        tmp_path(path, sizeof path, "describe.gguf");
        assert_int_equal(kvs_shard_extract(g, win[i].b, win[i].e, path, msg, sizeof msg), KVS_OK);
        struct kvs_gguf *s = NULL;
        assert_int_equal(kvs_gguf_open(path, &s, msg, sizeof msg), KVS_OK);
        assert_int_equal(kvs_shard_describe(s, buf, sizeof buf), KVS_OK);
        assert_string_equal(buf, win[i].want);
        kvs_gguf_close(s);
        remove(path);
    }
    kvs_gguf_close(g);
    /* Hand-made keys. */
    assert_int_equal(describe_keys(8, 2, 4, 8, buf, sizeof buf), KVS_OK);
    assert_string_equal(buf, "window [2,4) of 8 source blocks");
    assert_int_equal(describe_keys(8, 6, 8, -1, buf, sizeof buf), KVS_OK); /* source count from block_count */
    assert_string_equal(buf, "window [6,8) of 8 source blocks (tail: output norm + LM head)");
    assert_int_equal(describe_keys(-1, 0, 2, 4, buf, sizeof buf), KVS_OK);
    assert_string_equal(buf, "window [0,2) of 4 source blocks (head: token embedding)");
    assert_int_equal(describe_keys(8, -1, -1, -1, buf, sizeof buf), KVS_ERR_NOT_FOUND);
    assert_int_equal(describe_keys(8, 4, 2, 8, buf, sizeof buf), KVS_ERR_FORMAT); /* begin >= end */
    assert_non_null(strstr(buf, "invalid"));
    assert_int_equal(describe_keys(8, 2, -1, 8, buf, sizeof buf), KVS_ERR_FORMAT); /* end missing */
    assert_int_equal(describe_keys(8, 2, 4, 6, buf, sizeof buf), KVS_ERR_FORMAT); /* counts disagree */
    assert_non_null(strstr(buf, "is 6 and block_count 8"));
    assert_int_equal(describe_keys(4, 2, 6, 4, buf, sizeof buf), KVS_ERR_FORMAT); /* past the end */
    assert_non_null(strstr(buf, "exceeds the source's 4 blocks"));
    assert_int_equal(describe_keys(-1, 2, 4, -1, buf, sizeof buf), KVS_ERR_FORMAT);
}

static void test_helpers(void **state)
{
    (void)state;
    uint8_t d[32];
    char hex[65];
    /* FIPS 180-2 test vector */
    assert_int_equal(kvs_shard_sha256("abc", 3, d), KVS_OK);
    kvs_shard_hex(d, hex);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    uint8_t back[32];
    assert_true(kvs_shard_unhex(hex, 64, back));
    assert_memory_equal(back, d, 32);
    assert_false(kvs_shard_unhex(hex, 63, back));
    assert_false(kvs_shard_unhex("zz16bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad", 64, back));
    uint32_t b, e;
    assert_int_equal(kvs_shard_parse_window("0:4", &b, &e), KVS_OK);
    assert_int_equal(b, 0);
    assert_int_equal(e, 4);
    assert_int_equal(kvs_shard_parse_window("12:48", &b, &e), KVS_OK);
    assert_int_equal(b, 12);
    assert_int_equal(e, 48);
    const char *bad[] = { "4:4", "5:4", "a:b", "1:", ":2", "-1:2", "1:2x", "", "1-2", "99999999999:1" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvs_shard_parse_window(bad[i], &b, &e), KVS_ERR_ARG);
}

static void test_index_roundtrip(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("qwen2-mixed.gguf");
    struct kvs_shard_index ix, iy;
    char path[512], msg[256] = "";
    assert_int_equal(kvs_shard_index_build(g, &ix, msg, sizeof msg), KVS_OK);
    assert_int_equal(ix.n_tensors, kvs_gguf_n_tensors(g));
    assert_int_equal(ix.file_size, 16037152); /* ls -l of the shared file */
    tmp_path(path, sizeof path, "ix.json");
    assert_int_equal(kvs_shard_index_save(&ix, path, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_index_load(path, &iy, msg, sizeof msg), KVS_OK);
    assert_string_equal(ix.fingerprint, iy.fingerprint);
    assert_int_equal(iy.file_size, ix.file_size);
    assert_int_equal(iy.data_offset, kvs_gguf_data_offset(g));
    assert_int_equal(iy.n_tensors, ix.n_tensors);
    for (size_t i = 0; i < iy.n_tensors; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        const struct kvs_shard_index_entry *e = kvs_shard_index_find(&iy, t->name);
        assert_non_null(e);
        assert_int_equal(e->offset, kvs_gguf_data_offset(g) + t->offset);
        assert_int_equal(e->size, t->bytes);
        assert_int_equal(e->type, t->type);
        assert_memory_equal(e->ne, t->ne, sizeof t->ne);
        /* the bytes at the absolute offset hash to the entry */
        uint8_t d[32];
        assert_int_equal(kvs_shard_sha256(kvs_gguf_base(g) + e->offset, e->size, d), KVS_OK);
        assert_memory_equal(d, e->sha256, 32);
    }
    kvs_shard_index_free(&iy);
    kvs_shard_index_free(&ix);
    remove(path);
    const char *bad[] = { "", "[]", "{\"fingerprint\":\"ab\"}", "{\"fingerprint\":1}",
                          "{\"fingerprint\":\"0000000000000000000000000000000000000000000000000000000000000000\","
                          "\"file_size\":10,\"data_offset\":0,\"alignment\":32,\"tensors\":[{\"name\":\"a\","
                          "\"type_id\":0,\"shape\":[4],\"offset\":8,\"size\":16,\"sha256\":\"00\"}]}" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(kvs_shard_index_parse(bad[i], strlen(bad[i]), &iy, msg, sizeof msg), KVS_ERR_FORMAT);
    kvs_gguf_close(g);
}

/* The content id (docs/FORMATS.md "Content id") recomputed here from its
 * recipe, by hand: tag, fingerprint, u64le count, SHA-256 of each tensor's
 * bytes in name order. */
static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void test_content_id(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("llama-q4_k_m.gguf");
    size_t n = kvs_gguf_n_tensors(g);
    const char **names = calloc(n, sizeof *names);
    for (size_t i = 0; i < n; i++)
        names[i] = kvs_gguf_tensor(g, i)->name;
    qsort(names, n, sizeof *names, cmp_names);
    uint8_t fp[32], want[32], got[32];
    assert_int_equal(kvs_gguf_fingerprint(g, fp), KVS_OK);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    /* metadata digest: the raw KV pairs (none is kvasir.* here) in key order */
    size_t nkv = kvs_gguf_n_kv(g);
    const char **keys = calloc(nkv, sizeof *keys);
    for (size_t i = 0; i < nkv; i++)
        keys[i] = kvs_gguf_key(g, i);
    qsort(keys, nkv, sizeof *keys, cmp_names);
    uint8_t meta[32];
    EVP_MD_CTX *mctx = EVP_MD_CTX_new();
    EVP_DigestInit_ex(mctx, EVP_sha256(), NULL);
    for (size_t i = 0; i < nkv; i++) {
        const uint8_t *raw;
        size_t rl;
        assert_int_equal(kvs_gguf_kv_raw(g, (size_t)kvs_gguf_find_key(g, keys[i]), &raw, &rl), KVS_OK);
        EVP_DigestUpdate(mctx, raw, rl);
    }
    unsigned int mlen = 0;
    EVP_DigestFinal_ex(mctx, meta, &mlen);
    EVP_MD_CTX_free(mctx);
    free(keys);
    uint8_t got_meta[32];
    assert_int_equal(kvs_shard_metadata_digest(g, got_meta), KVS_OK);
    assert_memory_equal(got_meta, meta, 32);
    EVP_DigestUpdate(ctx, "kvasir-content-v2", 17);
    EVP_DigestUpdate(ctx, fp, 32);
    EVP_DigestUpdate(ctx, meta, 32);
    uint8_t nb[8] = { (uint8_t)n, (uint8_t)(n >> 8) }; /* 30 tensors: little-endian u64 */
    EVP_DigestUpdate(ctx, nb, 8);
    for (size_t i = 0; i < n; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(g, names[i]);
        uint8_t d[32];
        unsigned int len = 0;
        EVP_Digest(t->data, t->bytes, d, &len, EVP_sha256(), NULL);
        EVP_DigestUpdate(ctx, d, 32);
    }
    unsigned int len = 0;
    EVP_DigestFinal_ex(ctx, want, &len);
    EVP_MD_CTX_free(ctx);
    free(names);
    char msg[256] = "";
    assert_int_equal(kvs_shard_content_id(g, got, msg, sizeof msg), KVS_OK);
    assert_memory_equal(got, want, 32);
    /* the index gives the same id without reading the file, in any entry order */
    struct kvs_shard_index ix;
    assert_int_equal(kvs_shard_index_build(g, &ix, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_index_content_id(&ix, got), KVS_OK);
    assert_memory_equal(got, want, 32);
    struct kvs_shard_index_entry tmp = ix.tensors[0];
    ix.tensors[0] = ix.tensors[n - 1];
    ix.tensors[n - 1] = tmp;
    assert_int_equal(kvs_shard_index_content_id(&ix, got), KVS_OK);
    assert_memory_equal(got, want, 32);
    /* one weight's digest changed (the fingerprint would not see it): another id */
    ix.tensors[3].sha256[7] ^= 1;
    assert_int_equal(kvs_shard_index_content_id(&ix, got), KVS_OK);
    assert_memory_not_equal(got, want, 32);
    ix.tensors[3].sha256[7] ^= 1;
    /* another metadata digest (a token string changed): another id */
    ix.metadata_sha256[0] ^= 1;
    assert_int_equal(kvs_shard_index_content_id(&ix, got), KVS_OK);
    assert_memory_not_equal(got, want, 32);
    ix.metadata_sha256[0] ^= 1;
    /* two entries of one name: no single content */
    snprintf(ix.tensors[1].name, sizeof ix.tensors[1].name, "%s", ix.tensors[2].name);
    assert_int_equal(kvs_shard_index_content_id(&ix, got), KVS_ERR_FORMAT);
    kvs_shard_index_free(&ix);

    /* a saved index carries it; a wrong, short or non-string content_id is refused */
    assert_int_equal(kvs_shard_index_build(g, &ix, msg, sizeof msg), KVS_OK);
    char path[512];
    tmp_path(path, sizeof path, "cid.json");
    assert_int_equal(kvs_shard_index_save(&ix, path, msg, sizeof msg), KVS_OK);
    kvs_shard_index_free(&ix);
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char text[1 << 16];
    size_t tl = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[tl] = 0;
    char hex[65];
    kvs_shard_hex(want, hex);
    char *at = strstr(text, hex);
    assert_non_null(at); /* "content_id": "<want>" */
    assert_int_equal(kvs_shard_index_parse(text, tl, &ix, msg, sizeof msg), KVS_OK);
    kvs_shard_index_free(&ix);
    const char *subst[] = { "0000000000000000000000000000000000000000000000000000000000000000",
                            "zz7c6b273193a9fceb570071aaf7a161cf0d258f62cb9b13cf151dcd8c5c112f" };
    for (size_t i = 0; i < 2; i++) {
        char saved[64];
        memcpy(saved, at, 64);
        memcpy(at, subst[i], 64);
        assert_int_equal(kvs_shard_index_parse(text, tl, &ix, msg, sizeof msg), KVS_ERR_FORMAT);
        assert_non_null(strstr(msg, "content_id"));
        memcpy(at, saved, 64);
    }
    at[-1] = ' '; /* "content_id": <64 hex digits>" : not a string */
    assert_int_equal(kvs_shard_index_parse(text, tl, &ix, msg, sizeof msg), KVS_ERR_FORMAT);
    at[-1] = '"';
    /* an index without metadata_sha256 (made before index version 2) names no content: refused, saying so */
    char *mk = strstr(text, "\"metadata_sha256\"");
    assert_non_null(mk);
    memcpy(mk + 1, "metadata_shaXXX", 15);
    assert_int_equal(kvs_shard_index_parse(text, tl, &ix, msg, sizeof msg), KVS_ERR_FORMAT);
    assert_non_null(strstr(msg, "metadata_sha256"));
    assert_non_null(strstr(msg, "rebuild it"));
    remove(path);

    /* extract records the source's id in the shard; the shard reports it */
    tmp_path(path, sizeof path, "cid.gguf");
    assert_int_equal(kvs_shard_extract(g, 1, 2, path, msg, sizeof msg), KVS_OK);
    struct kvs_gguf *sh = NULL;
    assert_int_equal(kvs_gguf_open(path, &sh, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_content_id(sh, got, msg, sizeof msg), KVS_OK);
    assert_memory_equal(got, want, 32);
    kvs_gguf_close(sh);
    remove(path);
    kvs_gguf_close(g);
}

/* Rewrites g to path with one metadata edit (and optionally the KVs or the
 * tensors in reverse order), the tensors' bytes unchanged. */
enum md_edit { MD_NONE, MD_TOKEN, MD_TEMPLATE, MD_BOS, MD_ROPE, MD_KVASIR_KEY };

static void rewrite_model(const struct kvs_gguf *g, const char *path, enum md_edit edit, bool rev_kv, bool rev_t)
{
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_non_null(w);
    size_t nkv = kvs_gguf_n_kv(g), nt = kvs_gguf_n_tensors(g);
    for (size_t j = 0; j < nkv; j++)
        assert_int_equal(kvs_gguf_writer_copy_kv(w, g, rev_kv ? nkv - 1 - j : j), KVS_OK);
    char **toks = NULL;
    uint64_t ntok = 0;
    switch (edit) {
    case MD_NONE:
        break;
    case MD_TOKEN: { /* one byte of token 100's string */
        int64_t ki = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
        assert_true(ki >= 0);
        ntok = kvs_gguf_arr_n(g, (size_t)ki);
        assert_true(ntok > 100);
        toks = calloc(ntok, sizeof *toks);
        for (uint64_t k = 0; k < ntok; k++) {
            const char *s;
            size_t len;
            assert_int_equal(kvs_gguf_arr_str(g, (size_t)ki, k, &s, &len), KVS_OK);
            toks[k] = calloc(len + 2, 1);
            memcpy(toks[k], s, len);
            if (k == 100)
                toks[k][0] = toks[k][0] == 'x' ? 'y' : 'x';
        }
        assert_int_equal(kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)toks, ntok),
                         KVS_OK);
        break;
    }
    case MD_TEMPLATE:
        assert_int_equal(kvs_gguf_writer_set_str(w, "tokenizer.chat_template", "{{ messages[0].content }}"), KVS_OK);
        break;
    case MD_BOS: {
        uint32_t bos = 0;
        assert_int_equal(kvs_gguf_get_u32(g, "tokenizer.ggml.bos_token_id", &bos), KVS_OK);
        assert_int_equal(kvs_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", bos + 1), KVS_OK);
        break;
    }
    case MD_ROPE:
        assert_int_equal(kvs_gguf_writer_set_f32(w, "llama.rope.freq_base", 12345.0f), KVS_OK);
        break;
    case MD_KVASIR_KEY:
        assert_int_equal(kvs_gguf_writer_set_str(w, "kvasir.note", "kvasir.* keys are not content"), KVS_OK);
        break;
    }
    for (size_t j = 0; j < nt; j++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, rev_t ? nt - 1 - j : j);
        assert_int_equal(kvs_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data, t->bytes), KVS_OK);
    }
    assert_int_equal(kvs_gguf_writer_write_file(w, path), KVS_OK);
    kvs_gguf_writer_free(w);
    for (uint64_t k = 0; k < ntok; k++)
        free(toks[k]);
    free(toks);
}

/* The content id covers the metadata: the tokenizer (token strings, special
 * token ids), the chat template and the hyperparameters change it; KV order,
 * tensor layout and kvasir.* keys do not. The index's id agrees with the
 * file's in each case. */
static void test_content_id_metadata(void **state)
{
    (void)state;
    struct kvs_gguf *g = open_model("llama-q4_k_m.gguf");
    char msg[256] = "";
    uint8_t base[32];
    assert_int_equal(kvs_shard_content_id(g, base, msg, sizeof msg), KVS_OK);
    static const struct {
        enum md_edit edit;
        bool rev_kv, rev_t, same;
        const char *what;
    } cases[] = {
        { MD_NONE, false, false, true, "rewritten unchanged" },
        { MD_NONE, true, false, true, "KVs in reverse order" },
        { MD_NONE, false, true, true, "tensors in reverse order (another layout)" },
        { MD_KVASIR_KEY, false, false, true, "a kvasir.* key added" },
        { MD_TOKEN, false, false, false, "one byte of one token string" },
        { MD_TEMPLATE, false, false, false, "a chat template added" },
        { MD_BOS, false, false, false, "the BOS token id" },
        { MD_ROPE, false, false, false, "rope.freq_base" },
    };
    char path[512];
    tmp_path(path, sizeof path, "cidmeta.gguf");
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        rewrite_model(g, path, cases[c].edit, cases[c].rev_kv, cases[c].rev_t);
        struct kvs_gguf *h = NULL;
        assert_int_equal(kvs_gguf_open(path, &h, msg, sizeof msg), KVS_OK);
        uint8_t got[32], gix[32];
        assert_int_equal(kvs_shard_content_id(h, got, msg, sizeof msg), KVS_OK);
        struct kvs_shard_index ix;
        assert_int_equal(kvs_shard_index_build(h, &ix, msg, sizeof msg), KVS_OK);
        assert_int_equal(kvs_shard_index_content_id(&ix, gix), KVS_OK);
        kvs_shard_index_free(&ix);
        if (cases[c].same != (memcmp(got, base, 32) == 0) || memcmp(got, gix, 32) != 0)
            fail_msg("content id, %s: %s", cases[c].what, cases[c].same ? "changed" : "unchanged");
        kvs_gguf_close(h);
    }
    remove(path);
    kvs_gguf_close(g);
}

/* --- seed + fetch, in process on loopback -------------------------------------- */

static size_t count_body(char *d, size_t s, size_t n, void *ud)
{
    (void)d;
    *(size_t *)ud += s * n;
    return s * n;
}

static long http_get(uint16_t port, const char *path, const char *range, size_t *body)
{
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", port, path);
    CURL *c = curl_easy_init();
    struct curl_slist *h = NULL;
    char hdr[256];
    if (range) {
        snprintf(hdr, sizeof hdr, "Range: %s", range);
        h = curl_slist_append(h, hdr);
    }
    *body = 0;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, count_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, body);
    long code = 0;
    if (curl_easy_perform(c) == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    return code;
}

static void test_seed_ranges(void **state)
{
    (void)state;
    struct kvs_seed_params p = kvs_seed_default_params();
    p.dir = models_dir();
    struct kvs_seed *s = NULL;
    char msg[256] = "";
    assert_int_equal(kvs_seed_start(&p, &s, msg, sizeof msg), KVS_OK);
    uint16_t port = kvs_seed_port(s);
    assert_true(port > 0);
    const uint64_t size = 1068640; /* aidreams260K.gguf, ls -l */
    struct {
        const char *range;
        long code;
        size_t body;
    } table[] = {
        { NULL, 200, size },
        { "bytes=0-99", 206, 100 },
        { "bytes=0-", 206, size },
        { "bytes=-5", 206, 5 },
        { "bytes=1068630-2000000", 206, 10 },
        { "Bytes=10-19", 206, 10 },           /* the unit is case-insensitive */
        { "bytes=-2000000", 206, size },        /* suffix longer than the file: all of it */
        { "bytes=0-99999999999999999999999", 206, size }, /* last-pos past the end: clamped */
        { "bytes=0-1,", 206, 2 },               /* empty list elements are skipped */
        /* unsatisfiable byte ranges: 416 */
        { "bytes=1068640-", 416, 0 },
        { "bytes=1068640-1068700", 416, 0 },
        { "bytes=99999999999999999999999-", 416, 0 },
        { "bytes=-0", 416, 0 },
        { "bytes=2000000-,3000000-4000000", 416, 0 },
        /* several ranges: refused with 416 (docs/FORMATS.md "Seed server") */
        { "bytes=0-1,5-6", 416, 0 },
        { "bytes=0-1, 1068639-", 416, 0 },
        /* RFC 9110 §14.2: an unknown unit MUST be ignored, and an invalid
         * ranges-specifier is ignored too: 200 with the whole file (these were 416) */
        { "items=0-3", 200, size },
        { "items=0-5", 200, size },
        { "none", 200, size },
        { "bytes=abc", 200, size },
        { "bytes=5-2", 200, size },
        { "bytes=-", 200, size },
        { "bytes=", 200, size },
        { "bytes=--5", 200, size },
        { "bytes=0-1,abc", 200, size },
        { "bytes=0-1;2-3", 200, size },
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        size_t body = 0;
        long code = http_get(port, "/aidreams260K.gguf", table[i].range, &body);
        if (code != table[i].code || body != table[i].body)
            fprintf(stderr, "range %s: got %ld / %zu bytes\n", table[i].range, code, body);
        assert_int_equal(code, table[i].code);
        assert_int_equal(body, table[i].body);
    }
    /* HEAD: the length of the (partial) body, no body bytes served */
    uint64_t served_before = kvs_seed_bytes_served(s);
    for (int ranged = 0; ranged < 2; ranged++) {
        char url[128];
        snprintf(url, sizeof url, "http://127.0.0.1:%u/aidreams260K.gguf", port);
        CURL *c = curl_easy_init();
        curl_easy_setopt(c, CURLOPT_URL, url);
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
        if (ranged)
            curl_easy_setopt(c, CURLOPT_RANGE, "10-19");
        assert_int_equal(curl_easy_perform(c), CURLE_OK);
        long code = 0;
        curl_off_t len = -1;
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
        curl_easy_getinfo(c, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &len);
        curl_easy_cleanup(c);
        assert_int_equal(code, ranged ? 206 : 200);
        assert_int_equal(len, ranged ? 10 : (curl_off_t)size);
    }
    assert_int_equal(kvs_seed_bytes_served(s), served_before);
    size_t body = 0;
    assert_int_equal(http_get(port, "/../etc/passwd", NULL, &body), 404);
    assert_int_equal(http_get(port, "/nope.gguf", NULL, &body), 404);
    assert_int_equal(http_get(port, "/models", NULL, &body), 200);
    assert_true(body > 100);
    /* served bytes: 4 full bodies (no Range, 0-, the long suffix, the clamped
     * last-pos) + 10 ignored Range headers (full bodies) + 100 + 5 + 10 + 10 + 2;
     * not the 416s, HEAD or /models (only file bodies count) */
    assert_int_equal(kvs_seed_bytes_served(s), 14 * size + 127);
    kvs_seed_stop(s);
}

/* GET path with the body kept (NUL-terminated, at most cap - 1 bytes); raw:
 * the path is sent as written (no "/../" squashing by curl). */
struct body_buf {
    char *p;
    size_t n, cap;
};

static size_t keep_body(char *d, size_t s, size_t n, void *ud)
{
    struct body_buf *b = ud;
    size_t k = s * n;
    size_t room = b->cap - 1 - b->n;
    memcpy(b->p + b->n, d, k < room ? k : room);
    b->n += k < room ? k : room;
    b->p[b->n] = '\0';
    return k;
}

static long http_get_text(uint16_t port, const char *path, char *out, size_t cap)
{
    char url[512];
    snprintf(url, sizeof url, "http://127.0.0.1:%u%s", port, path);
    struct body_buf b = { out, 0, cap };
    out[0] = '\0';
    CURL *c = curl_easy_init();
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_PATH_AS_IS, 1L);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, keep_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &b);
    long code = 0;
    if (curl_easy_perform(c) == CURLE_OK)
        curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(c);
    return code;
}

static void write_text(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_true(fputs(text, f) >= 0);
    assert_int_equal(fclose(f), 0);
}

/* Regression: the seed followed symlinks out of DIR (evil.gguf -> /etc/passwd
 * was served and listed), opened non-regular files, and served
 * "/aidreams260K.gguf%00.json" as the .gguf (the decoded NUL cut the name). */
static void test_seed_names(void **state)
{
    (void)state;
    char dir[300], sub[300], path[400], target[1200];
    snprintf(dir, sizeof dir, "%s/seed", g_tmp);
    snprintf(sub, sizeof sub, "%s/seed/d.gguf", g_tmp);
    assert_int_equal(mkdir(dir, 0700), 0);
    assert_int_equal(mkdir(sub, 0700), 0); /* a folder named like a model */
    snprintf(path, sizeof path, "%s/ok.json", dir);
    write_text(path, "{\"a\": 1}\n"); /* 9 bytes */
    snprintf(path, sizeof path, "%s/alias.json", dir); /* a link inside DIR: served */
    assert_int_equal(symlink("ok.json", path), 0);
    snprintf(path, sizeof path, "%s/evil.gguf", dir);
    assert_int_equal(symlink("/etc/passwd", path), 0);
    snprintf(path, sizeof path, "%s/up.json", dir); /* relative, out of DIR */
    assert_int_equal(symlink("../../../../../../../../etc/passwd", path), 0);
    snprintf(path, sizeof path, "%s/model.gguf", dir); /* a real model, but outside DIR */
    snprintf(target, sizeof target, "%s/aidreams260K.gguf", models_dir());
    assert_int_equal(symlink(target, path), 0);
    snprintf(path, sizeof path, "%s/fifo.gguf", dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    snprintf(path, sizeof path, "%s/dangling.gguf", dir);
    assert_int_equal(symlink("nowhere.gguf", path), 0);

    struct kvs_seed_params p = kvs_seed_default_params();
    p.dir = dir;
    struct kvs_seed *s = NULL;
    char msg[256] = "";
    assert_int_equal(kvs_seed_start(&p, &s, msg, sizeof msg), KVS_OK);
    uint16_t port = kvs_seed_port(s);
    static char text[1 << 16];
    assert_int_equal(http_get_text(port, "/ok.json", text, sizeof text), 200);
    assert_string_equal(text, "{\"a\": 1}\n");
    assert_int_equal(http_get_text(port, "/alias.json", text, sizeof text), 200);
    assert_string_equal(text, "{\"a\": 1}\n");
    static const char *const refused[] = { "/evil.gguf", "/up.json", "/model.gguf", "/fifo.gguf", "/d.gguf",
                                           "/dangling.gguf", "/../seed/ok.json" };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        long code = http_get_text(port, refused[i], text, sizeof text);
        if (code != 404)
            fail_msg("%s: %ld, wanted 404 (%s)", refused[i], code, text);
        assert_null(strstr(text, "root:"));
    }
    /* Decoded NUL or '/': 400, whatever follows. */
    static const char *const bad[] = { "/ok.json%00.json", "/ok.json%00", "/evil.gguf%00.json",
                                       "/seed%2Fok.json", "/%2e%2e%2Fseed%2Fok.json", "/%2Fetc%2Fpasswd%00.json" };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        long code = http_get_text(port, bad[i], text, sizeof text);
        if (code != 400)
            fail_msg("%s: %ld, wanted 400 (%s)", bad[i], code, text);
        assert_non_null(strstr(text, "NUL"));
    }
    /* Other %-escapes still decode: %6F is 'o'. */
    assert_int_equal(http_get_text(port, "/%6Fk.json", text, sizeof text), 200);
    assert_string_equal(text, "{\"a\": 1}\n");
    /* /models lists none of the refused .gguf names (ok.json is no model). */
    assert_int_equal(http_get_text(port, "/models", text, sizeof text), 200);
    assert_string_equal(text, "[]");
    kvs_seed_stop(s);

    static const char *const names[] = { "ok.json", "alias.json", "evil.gguf", "up.json", "model.gguf",
                                         "fifo.gguf", "dangling.gguf" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        assert_int_equal(unlink(path), 0);
    }
    assert_int_equal(rmdir(sub), 0);
    assert_int_equal(rmdir(dir), 0);
}

static void test_fetch_loopback(void **state)
{
    (void)state;
    struct kvs_seed_params sp = kvs_seed_default_params();
    sp.dir = models_dir();
    struct kvs_seed *s = NULL, *s_norange = NULL;
    char msg[512] = "", url[256], out[512], ext[512], ixpath[512];
    assert_int_equal(kvs_seed_start(&sp, &s, msg, sizeof msg), KVS_OK);
    snprintf(url, sizeof url, "http://127.0.0.1:%u/qwen3moe-mixed.gguf", kvs_seed_port(s));
    tmp_path(out, sizeof out, "f.gguf");
    tmp_path(ext, sizeof ext, "e.gguf");
    tmp_path(ixpath, sizeof ixpath, "q.json");
    struct kvs_gguf *g = open_model("qwen3moe-mixed.gguf");
    assert_int_equal(kvs_shard_extract(g, 1, 3, ext, msg, sizeof msg), KVS_OK);
    struct kvs_shard_index ix;
    assert_int_equal(kvs_shard_index_build(g, &ix, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_shard_index_save(&ix, ixpath, msg, sizeof msg), KVS_OK);

    struct kvs_shard_fetch_params p = kvs_shard_fetch_default_params();
    p.url = url;
    p.begin = 1;
    p.end = 3;
    p.out_path = out;
    p.index = ixpath;
    p.progress = 0;
    p.initial_header = 4096; /* force the geometric growth path */
    struct kvs_shard_fetch_stats st;
    uint64_t served0 = kvs_seed_bytes_served(s);
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_OK);
    assert_true(st.verified);
    assert_true(st.n_requests > 2);
    /* identical to the extracted shard */
    struct kvs_gguf *a = NULL, *b = NULL;
    assert_int_equal(kvs_gguf_open(out, &a, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_gguf_open(ext, &b, msg, sizeof msg), KVS_OK);
    assert_int_equal(kvs_gguf_file_size(a), kvs_gguf_file_size(b));
    assert_memory_equal(kvs_gguf_base(a), kvs_gguf_base(b), kvs_gguf_file_size(a));
    kvs_gguf_close(a);
    kvs_gguf_close(b);
    /* only the window's bytes and the header crossed the wire */
    uint64_t served = kvs_seed_bytes_served(s) - served0;
    assert_int_equal(served, st.header_bytes + st.data_bytes);
    assert_true(st.data_bytes <= st.window_bytes + st.window_bytes / 100);
    assert_true(st.data_bytes + st.header_reused_bytes >= st.window_bytes);
    char part[600];
    snprintf(part, sizeof part, "%s.part", out);
    assert_false(file_exists(part));
    snprintf(part, sizeof part, "%s.part.state", out);
    assert_false(file_exists(part));
    remove(out);

    /* the index by URL (a seed over the temp folder serves *.json) */
    struct kvs_seed *s_ix = NULL;
    struct kvs_seed_params ip = kvs_seed_default_params();
    ip.dir = g_tmp;
    assert_int_equal(kvs_seed_start(&ip, &s_ix, msg, sizeof msg), KVS_OK);
    char ixurl[256];
    snprintf(ixurl, sizeof ixurl, "http://127.0.0.1:%u/q.json", kvs_seed_port(s_ix));
    p.index = ixurl;
    p.initial_header = 0;
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_OK);
    assert_true(st.verified);
    assert_true(file_exists(out));
    remove(out);
    snprintf(ixurl, sizeof ixurl, "http://127.0.0.1:%u/none.json", kvs_seed_port(s_ix));
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_ERR_NOT_FOUND); /* 404 */
    assert_false(file_exists(out));
    p.index_optional = true; /* --index auto: a 404 is "no index" */
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_OK);
    assert_false(st.verified);
    assert_true(file_exists(out));
    remove(out);
    p.index_optional = false;
    kvs_seed_stop(s_ix);
    p.index = ixpath;

    /* a corrupted index entry: hash error, no output file */
    ix.tensors[kvs_gguf_n_tensors(g) / 2].sha256[0] ^= 1;
    const char *bad_name = ix.tensors[kvs_gguf_n_tensors(g) / 2].name;
    assert_int_equal(kvs_shard_index_save(&ix, ixpath, msg, sizeof msg), KVS_OK);
    size_t *idx, n;
    assert_int_equal(kvs_shard_window_tensors(g, 0, 3, &idx, &n, NULL, 0), KVS_OK);
    free(idx);
    p.begin = 0;
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_ERR_HASH);
    assert_non_null(strstr(msg, bad_name));
    assert_false(file_exists(out));
    p.index = NULL;
    /* a server that ignores Range */
    sp.no_ranges = true;
    assert_int_equal(kvs_seed_start(&sp, &s_norange, msg, sizeof msg), KVS_OK);
    snprintf(url, sizeof url, "http://127.0.0.1:%u/qwen3moe-mixed.gguf", kvs_seed_port(s_norange));
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_ERR_NET);
    assert_non_null(strstr(msg, "206"));
    assert_false(file_exists(out));
    /* a missing file */
    snprintf(url, sizeof url, "http://127.0.0.1:%u/missing.gguf", kvs_seed_port(s));
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_ERR_NET);
    assert_false(file_exists(out));
    /* not a GGUF (a reference JSON served as the model) -> corrupt header */
    snprintf(url, sizeof url, "http://127.0.0.1:%u/qwen3moe-mixed.ref.json", kvs_seed_port(s));
    assert_int_equal(kvs_shard_fetch(&p, &st, msg, sizeof msg), KVS_ERR_FORMAT);
    assert_non_null(strstr(msg, "corrupt GGUF header"));
    assert_false(file_exists(out));
    kvs_seed_stop(s_norange);
    kvs_shard_index_free(&ix);
    kvs_gguf_close(g);
    kvs_seed_stop(s);
    snprintf(part, sizeof part, "%s.part", out);
    remove(part);
    snprintf(part, sizeof part, "%s.part.state", out);
    remove(part);
    remove(ext);
    remove(ixpath);
}

static int setup(void **state)
{
    (void)state;
    snprintf(g_tmp, sizeof g_tmp, "/tmp/kvs_test_shard_XXXXXX");
    return mkdtemp(g_tmp) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    return rmdir(g_tmp);
}

int main(void)
{
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_helpers),
        cmocka_unit_test(test_window_counts),
        cmocka_unit_test(test_extract_all_models),
        cmocka_unit_test(test_check),
        cmocka_unit_test(test_shard_describe),
        cmocka_unit_test(test_index_roundtrip),
        cmocka_unit_test(test_content_id),
        cmocka_unit_test(test_content_id_metadata),
        cmocka_unit_test(test_seed_ranges),
        cmocka_unit_test(test_seed_names),
        cmocka_unit_test(test_fetch_loopback),
    };
    int rc = cmocka_run_group_tests(tests, setup, teardown);
    curl_global_cleanup();
    return rc;
}

/* Reader tests against the shared models (shared/models/README.md gives the
 * hyperparameters checked here; file sizes come from the files themselves). */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "gguf/gguf.h"

static const char *shared_dir(void)
{
    const char *s = getenv("KVASIR_SHARED");
    return s && *s ? s : "../shared";
}

static struct kvs_gguf *open_shared(const char *rel)
{
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/%s", shared_dir(), rel);
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(path, &g, err, sizeof err);
    if (e != KVS_OK)
        print_error("open %s: %s (%s)\n", path, kvs_strerror(e), err);
    assert_int_equal(e, KVS_OK);
    assert_non_null(g);
    return g;
}

static uint64_t file_size_of(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", shared_dir(), rel);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    return (uint64_t)st.st_size;
}

static uint32_t get_u32(const struct kvs_gguf *g, const char *key)
{
    uint32_t v = 0;
    assert_int_equal(kvs_gguf_get_u32(g, key, &v), KVS_OK);
    return v;
}

static void assert_str(const struct kvs_gguf *g, const char *key, const char *want)
{
    const char *s;
    size_t n;
    assert_int_equal(kvs_gguf_get_str(g, key, &s, &n), KVS_OK);
    assert_int_equal(n, strlen(want));
    assert_memory_equal(s, want, n);
}

static uint64_t vocab_size(const struct kvs_gguf *g)
{
    int64_t i = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    assert_true(i >= 0);
    assert_int_equal(kvs_gguf_kv_type(g, (size_t)i), KVS_GGUF_TYPE_ARRAY);
    assert_int_equal(kvs_gguf_arr_type(g, (size_t)i), KVS_GGUF_TYPE_STRING);
    return kvs_gguf_arr_n(g, (size_t)i);
}

/* Structural invariants every valid file must satisfy: data pointers set and
 * inside the file, sizes consistent with the type table, data offset
 * aligned. Returns the sum of tensor sizes padded to the alignment. */
static uint64_t check_layout(const struct kvs_gguf *g)
{
    uint32_t al = kvs_gguf_alignment(g);
    uint64_t off = kvs_gguf_data_offset(g), sum = 0;
    assert_int_equal(off % al, 0);
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        assert_non_null(t->data);
        assert_ptr_equal(t->data, kvs_gguf_base(g) + off + t->offset);
        assert_ptr_equal(kvs_gguf_find_tensor(g, t->name), t);
        uint64_t rows = 1;
        for (int d = 1; d < KVS_GGUF_MAX_DIMS; d++)
            rows *= (uint64_t)t->ne[d];
        assert_int_equal(t->bytes, rows * kvs_type_row_bytes(t->type, t->ne[0]));
        assert_int_equal(t->offset % al, 0);
        sum += (t->bytes + al - 1) / al * al;
    }
    return sum;
}

static void test_type_table(void **state)
{
    (void)state;
    uint32_t be, bb;
    /* gguf-facts §2.1 */
    assert_true(kvs_type_block(KVS_TYPE_Q4_K, &be, &bb));
    assert_int_equal(be, 256);
    assert_int_equal(bb, 144);
    assert_true(kvs_type_block(KVS_TYPE_Q8_0, &be, &bb));
    assert_int_equal(be, 32);
    assert_int_equal(bb, 34);
    assert_true(kvs_type_block(KVS_TYPE_TQ2_0, &be, &bb));
    assert_int_equal(bb, 66);
    assert_false(kvs_type_block((enum kvs_type)4, &be, &bb));
    assert_false(kvs_type_block((enum kvs_type)5, &be, &bb));
    assert_false(kvs_type_block((enum kvs_type)31, &be, &bb));
    assert_false(kvs_type_block((enum kvs_type)36, &be, &bb));
    assert_false(kvs_type_block((enum kvs_type)39, &be, &bb));
    assert_string_equal(kvs_type_name(KVS_TYPE_Q6_K), "Q6_K");
    assert_string_equal(kvs_type_name(KVS_TYPE_BF16), "BF16");
    assert_string_equal(kvs_type_name((enum kvs_type)33), "?");
    assert_int_equal(kvs_type_row_bytes(KVS_TYPE_Q6_K, 512), 420);
    assert_int_equal(kvs_type_row_bytes(KVS_TYPE_F16, 7), 14);
    assert_int_equal(kvs_type_row_bytes(KVS_TYPE_Q4_0, 33), 0);
    assert_int_equal(kvs_type_row_bytes((enum kvs_type)4, 32), 0);
}

static void test_aidreams(void **state)
{
    (void)state;
    const char *rel = "models/aidreams260K.gguf";
    struct kvs_gguf *g = open_shared(rel);
    assert_int_equal(kvs_gguf_version(g), 3);
    assert_int_equal(kvs_gguf_file_size(g), file_size_of(rel));
    assert_int_equal(file_size_of(rel), 1068640);
    assert_str(g, "general.architecture", "llama");
    assert_int_equal(get_u32(g, "llama.block_count"), 4);
    assert_int_equal(get_u32(g, "llama.embedding_length"), 64);
    assert_int_equal(get_u32(g, "llama.attention.head_count"), 4);
    assert_int_equal(get_u32(g, "llama.attention.head_count_kv"), 4);
    assert_int_equal(get_u32(g, "llama.feed_forward_length"), 172);
    assert_int_equal(get_u32(g, "llama.context_length"), 128);
    assert_int_equal(vocab_size(g), 512);
    assert_str(g, "tokenizer.ggml.model", "llama");

    /* Strict typing: a u32 key read as a string is a type error. */
    const char *s;
    size_t n;
    assert_int_equal(kvs_gguf_get_str(g, "llama.block_count", &s, &n), KVS_ERR_FORMAT);
    assert_int_equal(kvs_gguf_get_str(g, "no.such.key", &s, &n), KVS_ERR_NOT_FOUND);
    assert_int_equal(kvs_gguf_find_key(g, "no.such.key"), -1);

    /* Every tensor F32; token_embd is {n_embd, vocab}. */
    const struct kvs_gguf_tensor *te = kvs_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(te);
    assert_int_equal(te->type, KVS_TYPE_F32);
    assert_int_equal(te->n_dims, 2);
    assert_int_equal(te->ne[0], 64);
    assert_int_equal(te->ne[1], 512);
    assert_int_equal(te->bytes, 64 * 512 * 4);
    const struct kvs_gguf_tensor *q = kvs_gguf_find_tensor(g, "blk.3.attn_q.weight");
    assert_non_null(q);
    assert_int_equal(q->ne[0], 64);
    assert_int_equal(q->ne[1], 64);
    const struct kvs_gguf_tensor *up = kvs_gguf_find_tensor(g, "blk.0.ffn_up.weight");
    assert_non_null(up);
    assert_int_equal(up->ne[0], 64);
    assert_int_equal(up->ne[1], 172);
    assert_null(kvs_gguf_find_tensor(g, "blk.4.attn_q.weight"));
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++)
        assert_int_equal(kvs_gguf_tensor(g, i)->type, KVS_TYPE_F32);

    /* The data section plus the padded tensors fills the file exactly. */
    uint64_t sum = check_layout(g);
    assert_int_equal(kvs_gguf_data_offset(g) + sum, file_size_of(rel));

    /* Token strings: SPM vocab with byte tokens, <unk> <s> </s> first. */
    int64_t ti = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    assert_int_equal(kvs_gguf_arr_str(g, (size_t)ti, 1, &s, &n), KVS_OK);
    assert_int_equal(n, 3);
    assert_memory_equal(s, "<s>", 3);
    assert_int_equal(kvs_gguf_arr_str(g, (size_t)ti, 512, &s, &n), KVS_ERR_RANGE);
    kvs_gguf_close(g);
}

struct model_fact {
    const char *rel;
    const char *arch;
    uint32_t n_block, n_embd, n_head, n_head_kv, n_ff;
    uint64_t vocab;
};

/* shared/models/README.md */
static const struct model_fact k_models[] = {
    { "models/llama-f32.gguf", "llama", 4, 128, 4, 2, 512, 32000 },
    { "models/llama-mixed.gguf", "llama", 4, 128, 4, 2, 512, 32000 },
    { "models/llama-q4_k_m.gguf", "llama", 3, 256, 4, 2, 768, 0 },
    { "models/llama-q5_k_m.gguf", "llama", 3, 256, 4, 2, 768, 0 },
    { "models/llama-q2_k.gguf", "llama", 3, 256, 4, 2, 768, 0 },
    { "models/qwen2-mixed.gguf", "qwen2", 3, 128, 0, 0, 0, 50257 },
    { "models/qwen3-q8_0.gguf", "qwen3", 4, 128, 4, 2, 384, 151669 },
    { "models/qwen3moe-mixed.gguf", "qwen3moe", 3, 128, 0, 0, 0, 0 },
};

static void test_models(void **state)
{
    (void)state;
    for (size_t m = 0; m < sizeof k_models / sizeof k_models[0]; m++) {
        const struct model_fact *f = &k_models[m];
        struct kvs_gguf *g = open_shared(f->rel);
        char key[128];
        assert_int_equal(kvs_gguf_version(g), 3);
        assert_str(g, "general.architecture", f->arch);
        snprintf(key, sizeof key, "%s.block_count", f->arch);
        assert_int_equal(get_u32(g, key), f->n_block);
        snprintf(key, sizeof key, "%s.embedding_length", f->arch);
        assert_int_equal(get_u32(g, key), f->n_embd);
        if (f->n_head) {
            snprintf(key, sizeof key, "%s.attention.head_count", f->arch);
            assert_int_equal(get_u32(g, key), f->n_head);
            snprintf(key, sizeof key, "%s.attention.head_count_kv", f->arch);
            assert_int_equal(get_u32(g, key), f->n_head_kv);
            snprintf(key, sizeof key, "%s.feed_forward_length", f->arch);
            assert_int_equal(get_u32(g, key), f->n_ff);
        }
        uint64_t nv = vocab_size(g);
        if (f->vocab)
            assert_int_equal(nv, f->vocab);
        const struct kvs_gguf_tensor *te = kvs_gguf_find_tensor(g, "token_embd.weight");
        assert_non_null(te);
        assert_int_equal(te->ne[0], f->n_embd);
        assert_int_equal((uint64_t)te->ne[1], nv);
        snprintf(key, sizeof key, "blk.%u.attn_norm.weight", f->n_block - 1);
        assert_non_null(kvs_gguf_find_tensor(g, key));
        snprintf(key, sizeof key, "blk.%u.attn_norm.weight", f->n_block);
        assert_null(kvs_gguf_find_tensor(g, key));
        uint64_t sum = check_layout(g);
        assert_int_equal(kvs_gguf_data_offset(g) + sum, file_size_of(f->rel));
        uint8_t fp[32];
        assert_int_equal(kvs_gguf_fingerprint(g, fp), KVS_OK);
        kvs_gguf_close(g);
    }
}

static void test_tokenizer_vocabs(void **state)
{
    (void)state;
    static const struct {
        const char *rel, *model;
    } files[] = {
        { "tokenizer-tests/vocab-gpt-2.gguf", "gpt2" },
        { "tokenizer-tests/vocab-llama-spm.gguf", "llama" },
        { "tokenizer-tests/vocab-llama3.gguf", "gpt2" },
        { "tokenizer-tests/vocab-qwen3.gguf", "gpt2" },
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        struct kvs_gguf *g = open_shared(files[i].rel);
        assert_str(g, "tokenizer.ggml.model", files[i].model);
        assert_true(vocab_size(g) > 1000);
        kvs_gguf_close(g);
    }
}

static void test_open_missing(void **state)
{
    (void)state;
    struct kvs_gguf *g = (struct kvs_gguf *)1;
    char err[256];
    assert_int_equal(kvs_gguf_open("/nonexistent/x.gguf", &g, err, sizeof err), KVS_ERR_NOT_FOUND);
    assert_null(g);
    assert_non_null(strstr(err, "/nonexistent/x.gguf"));
}

/* A directory is not a GGUF file: the message must say so, not repeat a stale
 * errno such as "No such file or directory". */
static void test_open_directory(void **state)
{
    (void)state;
    struct kvs_gguf *g = (struct kvs_gguf *)1;
    char err[256];
    errno = ENOENT; /* a leftover from an earlier call */
    assert_int_equal(kvs_gguf_open("/tmp", &g, err, sizeof err), KVS_ERR_IO);
    assert_null(g);
    assert_non_null(strstr(err, "/tmp"));
    assert_non_null(strstr(err, "directory"));
    assert_null(strstr(err, "No such file"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_table),
        cmocka_unit_test(test_aidreams),
        cmocka_unit_test(test_models),
        cmocka_unit_test(test_tokenizer_vocabs),
        cmocka_unit_test(test_open_missing),
        cmocka_unit_test(test_open_directory),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

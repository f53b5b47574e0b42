/* Tokenizer against llama.cpp's test vectors (../shared/tokenizer-tests:
 * NAME.gguf.inp holds strings each followed by "\n__ggml_vocab_test__\n",
 * NAME.gguf.out the expected ids per string, one line each) and against the
 * reference outputs of the shared models (prompt ids, detokenized text). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tokenizer/tokenizer.h"

static const char *shared_dir(void)
{
    const char *s = getenv("KVASIR_SHARED");
    return s && *s ? s : "../shared";
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s: %s\n", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        if (!r)
            break;
        n += r;
    }
    fclose(f);
    buf[n] = 0;
    *len = n;
    return buf;
}

static struct kvs_tokenizer *load_tok(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", shared_dir(), rel);
    struct kvs_gguf *g = NULL;
    char err[256] = "";
    kvs_err e = kvs_gguf_open(path, &g, err, sizeof err);
    if (e != KVS_OK)
        fprintf(stderr, "%s: %s (%s)\n", path, kvs_strerror(e), err);
    assert_int_equal(e, KVS_OK);
    struct kvs_tokenizer *t = NULL;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    e = kvs_tokenizer_load(g, &t, err, sizeof err);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    if (e != KVS_OK)
        fprintf(stderr, "%s: tokenizer: %s (%s)\n", path, kvs_strerror(e), err);
    assert_int_equal(e, KVS_OK);
    fprintf(stderr, "# %s: %d tokens loaded in %.3f s\n", rel, kvs_tokenizer_n_vocab(t),
            (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec));
    kvs_gguf_close(g);
    return t;
}

static void print_ids(const char *what, const int32_t *ids, int64_t n)
{
    fprintf(stderr, "  %s:", what);
    for (int64_t i = 0; i < n; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, "\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ids must detokenize back to text[0..len) (SPM: minus the space prefix). */
static bool round_trip(const struct kvs_tokenizer *t, bool spm, const int32_t *ids, int64_t n, const char *text,
                       size_t len)
{
    size_t cap = len + 64;
    char *buf = malloc(cap);
    size_t o = 0;
    struct kvs_detok d;
    kvs_detok_init(&d, t, spm);
    for (int64_t i = 0; i < n; i++) {
        int64_t k = kvs_detok_push(&d, ids[i], buf + o, cap - o);
        assert_true(k >= 0);
        o += (size_t)k;
    }
    int64_t k = kvs_detok_flush(&d, buf + o, cap - o);
    assert_true(k >= 0);
    o += (size_t)k;
    bool ok = o == len && !memcmp(buf, text, len);
    if (!ok)
        fprintf(stderr, "round trip: want \"%.*s\"\n            got  \"%.*s\"\n", (int)len, text, (int)o, buf);
    free(buf);
    return ok;
}

static void run_vectors(const char *name)
{
    char rel[256], path[1024];
    snprintf(rel, sizeof rel, "tokenizer-tests/%s", name);
    struct kvs_tokenizer *t = load_tok(rel);

    size_t inlen, outlen;
    snprintf(path, sizeof path, "%s/tokenizer-tests/%s.inp", shared_dir(), name);
    char *inp = read_all(path, &inlen);
    snprintf(path, sizeof path, "%s/tokenizer-tests/%s.out", shared_dir(), name);
    char *outp = read_all(path, &outlen);
    assert_non_null(inp);
    assert_non_null(outp);

    static const char sep[] = "\n__ggml_vocab_test__\n";
    const size_t seplen = sizeof sep - 1;
    char *p = inp, *end = inp + inlen;
    char *line = outp;
    int n_cases = 0, n_fail = 0;
    bool spm = strstr(name, "spm") != NULL;
    int32_t ids[4096], want[4096];
    while (p < end) {
        char *s = memmem(p, (size_t)(end - p), sep, seplen);
        assert_non_null(s);
        size_t slen = (size_t)(s - p);
        /* expected ids: one line of the .out file */
        char *nl = strchr(line, '\n');
        assert_non_null(nl);
        *nl = 0;
        int64_t nw = 0;
        char *q = line;
        for (;;) {
            while (*q == ' ')
                q++;
            if (!*q)
                break;
            char *e2;
            errno = 0;
            long v = strtol(q, &e2, 10);
            assert_true(e2 != q && errno == 0 && v >= 0 && v <= INT32_MAX);
            assert_true(nw < 4096);
            want[nw++] = (int32_t)v;
            q = e2;
        }
        line = nl + 1;

        int64_t n = kvs_tokenize(t, p, slen, false, false, ids, 4096);
        assert_true(n >= 0 && n <= 4096);
        n_cases++;
        if (n != nw || memcmp(ids, want, (size_t)n * sizeof ids[0])) {
            n_fail++;
            fprintf(stderr, "%s: case %d mismatch for \"%.*s\"\n", name, n_cases, (int)slen, p);
            print_ids("want", want, nw);
            print_ids("got ", ids, n);
        }
        if (!round_trip(t, spm, ids, n, p, slen))
            n_fail++;
        p = s + seplen;
    }
    fprintf(stderr, "# %s: %d/%d cases match and round-trip\n", name, n_cases - n_fail, n_cases);
    assert_int_equal(n_cases, 46);
    assert_int_equal(n_fail, 0);

    /* Long text: the whole .inp file 100 times (about 190 KiB) must
     * tokenize quickly (priority-queue merges, no quadratic rescans) and
     * round-trip. */
    size_t blen = 100 * inlen;
    char *big = malloc(blen);
    for (int r = 0; r < 100; r++)
        memcpy(big + (size_t)r * inlen, inp, inlen);
    int32_t *bids = malloc((blen + 8) * sizeof *bids); /* <= one id per byte (+ SPM prefix) */
    double t0 = now_s();
    int64_t nb = kvs_tokenize(t, big, blen, false, false, bids, (int64_t)blen + 8);
    double dt = now_s() - t0;
    assert_true(nb > 0 && nb <= (int64_t)blen + 8);
    fprintf(stderr, "# %s: %zu bytes -> %lld tokens in %.3f s\n", name, blen, (long long)nb, dt);
    assert_true(round_trip(t, spm, bids, nb, big, blen));
    free(bids);
    free(big);
    free(inp);
    free(outp);
    kvs_tokenizer_free(t);
}

static void test_llama_spm(void **state) { (void)state; run_vectors("vocab-llama-spm.gguf"); }
static void test_llama3(void **state) { (void)state; run_vectors("vocab-llama3.gguf"); }
static void test_qwen3(void **state) { (void)state; run_vectors("vocab-qwen3.gguf"); }
static void test_gpt2(void **state) { (void)state; run_vectors("vocab-gpt-2.gguf"); }

static json_t *load_ref(const char *rel)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", shared_dir(), rel);
    json_error_t je;
    json_t *j = json_load_file(path, 0, &je);
    if (!j)
        fprintf(stderr, "%s: %s\n", path, je.text);
    assert_non_null(j);
    return j;
}

/* Concatenated pieces of the ids in array arr must equal text; the
 * streaming detokenizer must give the same. */
static void check_detok(const struct kvs_tokenizer *t, json_t *arr, const char *text)
{
    size_t tl = strlen(text);
    char *buf = malloc(tl + 4096), *buf2 = malloc(tl + 4096);
    size_t n = 0, n2 = 0;
    struct kvs_detok d;
    kvs_detok_init(&d, t, false);
    size_t i;
    json_t *v;
    json_array_foreach(arr, i, v) {
        int32_t id = (int32_t)json_integer_value(v);
        int64_t k = kvs_token_to_piece(t, id, false, buf + n, tl + 4096 - n);
        assert_true(k >= 0 && n + (size_t)k <= tl + 4096);
        n += (size_t)k;
        k = kvs_detok_push(&d, id, buf2 + n2, tl + 4096 - n2);
        assert_true(k >= 0);
        n2 += (size_t)k;
    }
    int64_t k = kvs_detok_flush(&d, buf2 + n2, tl + 4096 - n2);
    assert_true(k >= 0);
    n2 += (size_t)k;
    if (n != tl || memcmp(buf, text, tl))
        fprintf(stderr, "detok: want \"%s\"\n        got  \"%.*s\"\n", text, (int)n, buf);
    assert_int_equal(n, tl);
    assert_memory_equal(buf, text, tl);
    assert_int_equal(n2, tl);
    assert_memory_equal(buf2, text, tl);
    free(buf);
    free(buf2);
}

static void test_aidreams(void **state)
{
    (void)state;
    struct kvs_tokenizer *t = load_tok("models/aidreams260K.gguf");
    json_t *ref = load_ref("models/aidreams260K.ref.json");
    json_t *prompt = json_object_get(ref, "prompt");
    assert_true(json_is_array(prompt));
    assert_true(kvs_tokenizer_add_bos(t));
    assert_int_equal(kvs_tokenizer_bos(t), 1);
    const char *text = "Once upon a time";
    int32_t ids[64];
    int64_t n = kvs_tokenize(t, text, strlen(text), true, false, ids, 64);
    assert_int_equal(n, (int64_t)json_array_size(prompt));
    for (int64_t i = 0; i < n; i++)
        assert_int_equal(ids[i], json_integer_value(json_array_get(prompt, (size_t)i)));
    /* A too-small buffer still reports the full count. */
    assert_int_equal(kvs_tokenize(t, text, strlen(text), true, false, ids, 2), n);
    check_detok(t, json_object_get(ref, "generated"), json_string_value(json_object_get(ref, "text")));
    assert_true(kvs_tokenizer_is_eog(t, 2));
    assert_false(kvs_tokenizer_is_eog(t, 1));
    json_decref(ref);
    kvs_tokenizer_free(t);
}

static void test_qwen3_model(void **state)
{
    (void)state;
    struct kvs_tokenizer *t = load_tok("models/qwen3-q8_0.gguf");
    json_t *ref = load_ref("models/qwen3-q8_0.ref.json");
    check_detok(t, json_object_get(ref, "generated"), json_string_value(json_object_get(ref, "text")));
    assert_false(kvs_tokenizer_add_bos(t));
    /* Qwen specials (gguf-facts §5.4): <|im_start|> 151644, <|im_end|> 151645 */
    const char *chat = "<|im_start|>user\nHi<|im_end|>";
    int32_t ids[32];
    int64_t n = kvs_tokenize(t, chat, strlen(chat), false, true, ids, 32);
    assert_true(n >= 4 && n <= 32);
    assert_int_equal(ids[0], 151644);
    assert_int_equal(ids[n - 1], 151645);
    assert_true(kvs_tokenizer_is_eog(t, 151645));
    assert_true(kvs_tokenizer_is_eog(t, 151643)); /* <|endoftext|> */
    assert_false(kvs_tokenizer_is_eog(t, 151644));
    /* Without special parsing the same text is ordinary text. */
    n = kvs_tokenize(t, chat, strlen(chat), false, false, ids, 32);
    assert_true(n > 4 && n <= 32);
    assert_int_not_equal(ids[0], 151644);
    json_decref(ref);
    kvs_tokenizer_free(t);
}

/* A Llama 3 chat (format of src/chat, written out by hand) with special
 * parsing: <|begin_of_text|> 128000, <|eot_id|> 128009 (gguf-facts §5.4),
 * the header tokens, and ordinary text between them tokenized as it is on
 * its own. */
static void test_llama3_chat(void **state)
{
    (void)state;
    struct kvs_tokenizer *t = load_tok("tokenizer-tests/vocab-llama3.gguf");
    assert_int_equal(kvs_tokenizer_bos(t), 128000);
    assert_true(kvs_tokenizer_add_bos(t));
    const char *chat = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n";
    int32_t ids[64], hdr[2], user[8], nl[8], hi[8], asst[8];
    int64_t n = kvs_tokenize(t, chat, strlen(chat), false, true, ids, 64);
    assert_int_equal(kvs_tokenize(t, "<|start_header_id|><|end_header_id|>", 36, false, true, hdr, 2), 2);
    int64_t nu = kvs_tokenize(t, "user", 4, false, false, user, 8);
    int64_t nn = kvs_tokenize(t, "\n\n", 2, false, false, nl, 8);
    int64_t nh = kvs_tokenize(t, "Hi", 2, false, false, hi, 8);
    int64_t na = kvs_tokenize(t, "assistant", 9, false, false, asst, 8);
    assert_true(nu == 1 && nn == 1 && nh == 1 && na == 1);
    const int32_t want[] = { 128000, hdr[0], user[0], hdr[1], nl[0], hi[0], 128009, hdr[0], asst[0], hdr[1], nl[0] };
    assert_int_equal(n, 11);
    assert_memory_equal(ids, want, sizeof want);
    assert_true(kvs_tokenizer_is_eog(t, 128009));
    assert_true(kvs_tokenizer_is_eog(t, kvs_tokenizer_eos(t)));
    assert_false(kvs_tokenizer_is_eog(t, 128000));
    /* With special=true the control token's text comes back. */
    char buf[32];
    assert_int_equal(kvs_token_to_piece(t, 128009, true, buf, sizeof buf), 10);
    assert_memory_equal(buf, "<|eot_id|>", 10);
    kvs_tokenizer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama_spm), cmocka_unit_test(test_llama3),   cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_gpt2),      cmocka_unit_test(test_aidreams), cmocka_unit_test(test_qwen3_model),
        cmocka_unit_test(test_llama3_chat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The OpenCL backend of a window (model_ocl.c, on PoCL in CI) against
 * llama.cpp's reference outputs with the bar of ../shared/models/README.md,
 * on every shared model whose types have OpenCL kernels; its batching and
 * window invariants; mixed CPU/OpenCL windows; and its start-up errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/model.h"

struct ref {
    int32_t *tok;     /* prompt + generated */
    int32_t n_prompt, n_tok;
    int32_t (*top_id)[8];
    double (*top_p)[8];
};

static const char *shared_dir(void)
{
    const char *s = getenv("KVASIR_SHARED");
    return s && *s ? s : "../shared";
}

static void ref_load(const char *name, struct ref *r)
{
    char path[1024];
    snprintf(path, sizeof path, "%s/models/%s.ref.json", shared_dir(), name);
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) fail_msg("cannot read %s: %s", path, jerr.text);
    json_t *pr = json_object_get(root, "prompt"), *ge = json_object_get(root, "generated");
    json_t *po = json_object_get(root, "positions");
    assert_true(json_is_array(pr) && json_is_array(ge) && json_is_array(po));
    r->n_prompt = (int32_t)json_array_size(pr);
    r->n_tok = r->n_prompt + (int32_t)json_array_size(ge);
    assert_int_equal(json_array_size(po), (size_t)r->n_tok);
    r->tok = calloc((size_t)r->n_tok, sizeof *r->tok);
    r->top_id = calloc((size_t)r->n_tok, sizeof *r->top_id);
    r->top_p = calloc((size_t)r->n_tok, sizeof *r->top_p);
    assert_non_null(r->tok);
    for (int32_t i = 0; i < r->n_tok; i++) {
        json_t *v = i < r->n_prompt ? json_array_get(pr, (size_t)i) : json_array_get(ge, (size_t)(i - r->n_prompt));
        r->tok[i] = (int32_t)json_integer_value(v);
        json_t *p = json_array_get(po, (size_t)i);
        assert_int_equal(json_integer_value(json_object_get(p, "pos")), i);
        json_t *top = json_object_get(p, "top");
        assert_int_equal(json_array_size(top), 8);
        for (int j = 0; j < 8; j++) {
            json_t *pair = json_array_get(top, (size_t)j);
            r->top_id[i][j] = (int32_t)json_integer_value(json_array_get(pair, 0));
            r->top_p[i][j] = json_number_value(json_array_get(pair, 1));
        }
    }
    json_decref(root);
}

static void ref_free(struct ref *r)
{
    free(r->tok);
    free(r->top_id);
    free(r->top_p);
}

static struct kvs_gguf *open_model(const char *name)
{
    char path[1024], err[256] = "";
    snprintf(path, sizeof path, "%s/models/%s.gguf", shared_dir(), name);
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(path, &g, err, sizeof err);
    if (e) fail_msg("open %s: %s (%s)", path, kvs_strerror(e), err);
    return g;
}


static struct kvs_model *load_be(const struct kvs_gguf *g, enum kvs_backend be, int32_t begin, int32_t end,
                                 int32_t n_seq, int32_t n_batch)
{
    struct kvs_model_params p = kvs_model_default_params();
    p.block_begin = begin;
    p.block_end = end;
    p.n_ctx = 128;
    p.n_seq = n_seq;
    p.n_batch = n_batch;
    p.n_threads = 2;
    p.backend = be;
    struct kvs_model *m = NULL;
    char err[4096] = "";
    kvs_err e = kvs_model_load(g, &p, &m, err, sizeof err);
    if (e) fail_msg("load: %s (%s)", kvs_strerror(e), err);
    return m;
}

static void softmax(const float *l, int32_t n, double *p)
{
    double mx = -INFINITY, sum = 0.0;
    for (int32_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
    for (int32_t i = 0; i < n; i++) sum += p[i] = exp((double)l[i] - mx);
    for (int32_t i = 0; i < n; i++) p[i] /= sum;
}

/* Teacher-forced evaluation of the reference tokens in one batch on OpenCL. */
static void check_ref(const char *name, bool f32)
{
    struct ref r;
    ref_load(name, &r);
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = load_be(g, KVS_BACKEND_OPENCL, 0, -1, 1, r.n_tok);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)r.n_tok * (size_t)V * sizeof(float));
    double *p = malloc((size_t)V * sizeof(double));
    int32_t *seq = calloc((size_t)r.n_tok, sizeof(int32_t)), *pos = malloc((size_t)r.n_tok * sizeof(int32_t));
    int8_t *want = malloc((size_t)r.n_tok);
    assert_true(logits && p && seq && pos && want);
    for (int32_t i = 0; i < r.n_tok; i++) pos[i] = i, want[i] = 1;
    struct kvs_batch b = { .n_tokens = r.n_tok, .token = r.tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(m, &b, logits), KVS_OK);
    int32_t agree = 0;
    double maxd = 0.0;
    for (int32_t i = 0; i < r.n_tok; i++) {
        const float *l = logits + (size_t)i * (size_t)V;
        softmax(l, V, p);
        int32_t arg = 0;
        for (int32_t v = 1; v < V; v++)
            if (l[v] > l[arg]) arg = v;
        if (arg == r.top_id[i][0])
            agree++;
        else
            fprintf(stderr, "  %s pos %d: top-1 %d (p %.4f), reference %d (p %.4f)\n", name, (int)i, (int)arg,
                    p[arg], (int)r.top_id[i][0], r.top_p[i][0]);
        for (int j = 0; j < 8; j++) maxd = fmax(maxd, fabs(p[r.top_id[i][j]] - r.top_p[i][j]));
    }
    printf("opencl %-16s positions %3d  top-1 agreement %3d/%3d (%.1f%%)  max |dp| %.3g\n", name, (int)r.n_tok,
           (int)agree, (int)r.n_tok, 100.0 * agree / r.n_tok, maxd);
    fflush(stdout);
    if (f32) {
        assert_int_equal(agree, r.n_tok);
        assert_true(maxd <= 5e-3);
    } else {
        assert_true(agree * 10 >= r.n_tok * 9);
        assert_true(maxd <= 0.05);
    }
    free(logits);
    free(p);
    free(seq);
    free(pos);
    free(want);
    kvs_model_free(m);
    kvs_gguf_close(g);
    ref_free(&r);
}

static void test_ref_aidreams260K(void **st) { (void)st; check_ref("aidreams260K", true); }
static void test_ref_llama_f32(void **st) { (void)st; check_ref("llama-f32", true); }
static void test_ref_llama_q4_k_m(void **st) { (void)st; check_ref("llama-q4_k_m", false); }
static void test_ref_qwen3_q8_0(void **st) { (void)st; check_ref("qwen3-q8_0", false); }
static void test_ref_qwen3moe_mixed(void **st) { (void)st; check_ref("qwen3moe-mixed", false); }
static void test_ref_llama_mixed(void **st) { (void)st; check_ref("llama-mixed", false); }
static void test_ref_llama_q5_k_m(void **st) { (void)st; check_ref("llama-q5_k_m", false); }
static void test_ref_llama_q2_k(void **st) { (void)st; check_ref("llama-q2_k", false); }
static void test_ref_qwen2_mixed(void **st) { (void)st; check_ref("qwen2-mixed", false); }
static void test_ref_qwen35_mixed(void **st) { (void)st; check_ref("qwen35-mixed", false); }
static void test_ref_qwen35moe_q4_k(void **st) { (void)st; check_ref("qwen35moe-q4_k", false); }

/* Greedy decoding (prefill, then one token per call) reproduces the
 * reference continuation of aidreams260K exactly. */
static void test_greedy_aidreams(void **st)
{
    (void)st;
    struct ref r;
    ref_load("aidreams260K", &r);
    struct kvs_gguf *g = open_model("aidreams260K");
    struct kvs_model *m = load_be(g, KVS_BACKEND_OPENCL, 0, -1, 1, 64);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t seq[64] = { 0 }, pos[64];
    for (int32_t i = 0; i < 64; i++) pos[i] = i;
    struct kvs_batch b = { .n_tokens = r.n_prompt, .token = r.tok, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &b, logits), KVS_OK);
    for (int32_t i = 0; i < r.n_tok - r.n_prompt; i++) {
        int32_t arg = 0;
        for (int32_t v = 1; v < V; v++)
            if (logits[v] > logits[arg]) arg = v;
        assert_int_equal(arg, r.tok[r.n_prompt + i]);
        int32_t p = r.n_prompt + i;
        int8_t one = 1;
        struct kvs_batch d = { .n_tokens = 1, .token = &arg, .seq = seq, .pos = &p, .logits = &one };
        assert_int_equal(kvs_model_forward(m, &d, logits), KVS_OK);
    }
    assert_int_equal(kvs_model_seq_len(m, 0), r.n_tok);
    free(logits);
    kvs_model_free(m);
    kvs_gguf_close(g);
    ref_free(&r);
}

static double max_rel_diff(const float *a, const float *b, size_t n)
{
    double scale = 1e-6, d = 0.0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)a[i]));
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d / scale;
}

/* One prefill batch, one token per call, and two interleaved sequences
 * (with a rewind of the first) give the same logits on the device. */
static void check_batching(const char *name)
{
    struct ref r;
    ref_load(name, &r);
    enum { N = 8 };
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = load_be(g, KVS_BACKEND_OPENCL, 0, -1, 2, 2 * N);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *full = malloc((size_t)N * V * sizeof(float)), *one = malloc((size_t)N * V * sizeof(float));
    float *mix = malloc((size_t)2 * N * V * sizeof(float)), *ref1 = malloc((size_t)N * V * sizeof(float));
    assert_true(full && one && mix && ref1);
    int32_t seq[2 * N], pos[2 * N], tok[2 * N];
    int8_t want[2 * N];
    const int32_t *t0 = r.tok, *t1 = r.tok + N;
    for (int32_t i = 0; i < N; i++) seq[i] = 0, pos[i] = i, want[i] = 1;
    struct kvs_batch b = { .n_tokens = N, .token = t0, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(m, &b, full), KVS_OK);
    for (int32_t i = 0; i < N; i++) seq[i] = 1;
    b.token = t1;
    assert_int_equal(kvs_model_forward(m, &b, ref1), KVS_OK);
    /* sequence 0 again from position 0: a rewind overwrites its cache */
    for (int32_t i = 0; i < N; i++) {
        int32_t s = 0, p = i;
        int8_t w = 1;
        struct kvs_batch d = { .n_tokens = 1, .token = &t0[i], .seq = &s, .pos = &p, .logits = &w };
        assert_int_equal(kvs_model_forward(m, &d, one + (size_t)i * V), KVS_OK);
    }
    const double d1 = max_rel_diff(full, one, (size_t)N * V);
    kvs_model_seq_clear(m, 0);
    kvs_model_seq_clear(m, 1);
    int32_t n = 0;
    for (int32_t i = 0; i < N; i++) {
        tok[n] = t1[i], seq[n] = 1, pos[n] = i, want[n++] = 1;
        tok[n] = t0[i], seq[n] = 0, pos[n] = i, want[n++] = 1;
    }
    b = (struct kvs_batch){ .n_tokens = n, .token = tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(m, &b, mix), KVS_OK);
    double d2 = 0.0;
    for (int32_t i = 0; i < N; i++) {
        d2 = fmax(d2, max_rel_diff(full + (size_t)i * V, mix + (size_t)(2 * i + 1) * V, (size_t)V));
        d2 = fmax(d2, max_rel_diff(ref1 + (size_t)i * V, mix + (size_t)(2 * i) * V, (size_t)V));
    }
    printf("opencl %-16s batch vs single: max rel diff %.3g; interleaved 2 seqs: %.3g\n", name, d1, d2);
    assert_true(d1 <= 1e-4);
    assert_true(d2 <= 1e-4);
    free(full);
    free(one);
    free(mix);
    free(ref1);
    kvs_model_free(m);
    kvs_gguf_close(g);
    ref_free(&r);
}

static void test_batching_aidreams(void **st) { (void)st; check_batching("aidreams260K"); }
static void test_batching_qwen3moe(void **st) { (void)st; check_batching("qwen3moe-mixed"); }
/* qwen35: the GDN conv and delta states per sequence, zeroed on a rewind to 0 and by kvs_model_seq_clear */
static void test_batching_qwen35(void **st) { (void)st; check_batching("qwen35-mixed"); }
static void test_batching_qwen35moe(void **st) { (void)st; check_batching("qwen35moe-q4_k"); }

/* Windows [0, a) and [a, n) over an F32 boundary: both on OpenCL equal the
 * whole window on OpenCL bit for bit; a CPU head with an OpenCL tail stays
 * within rounding of the CPU's whole window (F32 weights: 1e-4 of the
 * largest logit; quantized: activation quantization amplifies the float
 * summation-order differences, 2e-2). */
static void check_window(const char *name, int32_t a, double mixed_bar)
{
    struct ref r;
    ref_load(name, &r);
    struct kvs_gguf *g = open_model(name);
    const int32_t n = r.n_tok < 16 ? r.n_tok : 16;
    struct kvs_model *full = load_be(g, KVS_BACKEND_OPENCL, 0, -1, 1, n);
    struct kvs_model *cpu = load_be(g, KVS_BACKEND_CPU, 0, -1, 1, n);
    const struct kvs_hparams *hp = kvs_model_hparams(full);
    const int32_t V = (int32_t)hp->n_vocab, E = (int32_t)hp->n_embd;
    float *l_full = malloc((size_t)n * V * sizeof(float)), *l_cpu = malloc((size_t)n * V * sizeof(float));
    float *l_split = malloc((size_t)n * V * sizeof(float)), *bnd = malloc((size_t)n * E * sizeof(float));
    int32_t seq[16] = { 0 }, pos[16];
    int8_t want[16];
    for (int32_t i = 0; i < n; i++) pos[i] = i, want[i] = 1;
    struct kvs_batch b = { .n_tokens = n, .token = r.tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(full, &b, l_full), KVS_OK);
    assert_int_equal(kvs_model_forward(cpu, &b, l_cpu), KVS_OK);
    for (int mixed = 0; mixed < 2; mixed++) {
        struct kvs_model *h = load_be(g, mixed ? KVS_BACKEND_CPU : KVS_BACKEND_OPENCL, 0, a, 1, n);
        struct kvs_model *t = load_be(g, KVS_BACKEND_OPENCL, a, -1, 1, n);
        assert_int_equal(kvs_model_forward(h, &b, bnd), KVS_OK);
        struct kvs_batch bt = { .n_tokens = n, .embd = bnd, .seq = seq, .pos = pos, .logits = want };
        assert_int_equal(kvs_model_forward(t, &bt, l_split), KVS_OK);
        const double d = max_rel_diff(mixed ? l_cpu : l_full, l_split, (size_t)n * V);
        printf("%s [0,%d) %s + [%d,n) opencl vs whole %s: max rel diff %.3g\n", name, (int)a,
               mixed ? "cpu" : "opencl", (int)a, mixed ? "cpu" : "opencl", d);
        if (mixed)
            assert_true(d <= mixed_bar);
        else
            assert_true(d == 0.0);
        kvs_model_free(h);
        kvs_model_free(t);
    }
    free(l_full);
    free(l_cpu);
    free(l_split);
    free(bnd);
    kvs_model_free(full);
    kvs_model_free(cpu);
    kvs_gguf_close(g);
    ref_free(&r);
}

static void test_window_aidreams(void **st) { (void)st; check_window("aidreams260K", 2, 1e-4); }
static void test_window_qwen3moe(void **st) { (void)st; check_window("qwen3moe-mixed", 1, 2e-2); } /* Q8_0 activations */
static void test_window_qwen35(void **st) { (void)st; check_window("qwen35-mixed", 2, 2e-2); } /* Q8_0/Q8_K activations */
static void test_window_qwen35moe(void **st) { (void)st; check_window("qwen35moe-q4_k", 3, 2e-2); }

static void expect_load_error(const char *name, struct kvs_model_params *p, kvs_err want, const char *msg)
{
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = NULL;
    char err[4096] = "";
    assert_int_equal(kvs_model_load(g, p, &m, err, sizeof err), want);
    assert_null(m);
    if (!strstr(err, msg)) fail_msg("%s: message [%s] lacks [%s]", name, err, msg);
    kvs_gguf_close(g);
}

static void test_errors(void **st)
{
    (void)st;
    struct kvs_model_params p = kvs_model_default_params();
    p.backend = KVS_BACKEND_OPENCL;
    p.n_ctx = 64;
    /* a device index past the last */
    p.device = 63;
    expect_load_error("aidreams260K", &p, KVS_ERR_NOT_FOUND, "OpenCL device 63 does not exist");
    /* a window whose KV cache cannot fit the device: 4 blocks x 64 seqs x 2^24 positions x 64 x F16 x 2 */
    p.device = 0;
    p.n_ctx = 1 << 24;
    p.n_seq = 64;
    p.n_batch = 8;
    expect_load_error("llama-f32", &p, KVS_ERR_NOMEM, "this window needs");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ref_aidreams260K), cmocka_unit_test(test_ref_llama_f32),
        cmocka_unit_test(test_ref_llama_q4_k_m), cmocka_unit_test(test_ref_qwen3_q8_0),
        cmocka_unit_test(test_ref_qwen3moe_mixed), cmocka_unit_test(test_ref_llama_mixed),
        cmocka_unit_test(test_ref_llama_q5_k_m), cmocka_unit_test(test_ref_llama_q2_k),
        cmocka_unit_test(test_ref_qwen2_mixed), cmocka_unit_test(test_ref_qwen35_mixed),
        cmocka_unit_test(test_ref_qwen35moe_q4_k), cmocka_unit_test(test_greedy_aidreams),
        cmocka_unit_test(test_batching_aidreams), cmocka_unit_test(test_batching_qwen3moe), cmocka_unit_test(test_batching_qwen35),
        cmocka_unit_test(test_batching_qwen35moe),
        cmocka_unit_test(test_window_aidreams), cmocka_unit_test(test_window_qwen3moe), cmocka_unit_test(test_window_qwen35),
        cmocka_unit_test(test_window_qwen35moe),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

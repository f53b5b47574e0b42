/* Model forward pass against llama.cpp's reference outputs
 * (the .ref.json files in ../shared/models, bar from ../shared/models/README.md), plus
 * the batching and window invariants the ring relies on. */
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

static struct kvs_model *load(const struct kvs_gguf *g, int32_t begin, int32_t end, int32_t n_seq, int32_t n_batch)
{
    struct kvs_model_params p = kvs_model_default_params();
    p.block_begin = begin;
    p.block_end = end;
    p.n_ctx = 128;
    p.n_seq = n_seq;
    p.n_batch = n_batch;
    p.n_threads = 2;
    struct kvs_model *m = NULL;
    char err[256] = "";
    kvs_err e = kvs_model_load(g, &p, &m, err, sizeof err);
    if (e) fail_msg("load: %s (%s)", kvs_strerror(e), err);
    return m;
}

/* Full softmax in double: p[v] for one logits row. */
static void softmax(const float *l, int32_t n, double *p)
{
    double mx = -INFINITY, sum = 0.0;
    for (int32_t i = 0; i < n; i++) mx = l[i] > mx ? l[i] : mx;
    for (int32_t i = 0; i < n; i++) sum += p[i] = exp((double)l[i] - mx);
    for (int32_t i = 0; i < n; i++) p[i] /= sum;
}

/* Teacher-forced evaluation of the reference tokens in one batch. */
static void check_ref(const char *name, bool f32)
{
    struct ref r;
    ref_load(name, &r);
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = load(g, 0, -1, 1, r.n_tok);
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
        double pd = 0.0;
        for (int j = 0; j < 8; j++) {
            double d = fabs(p[r.top_id[i][j]] - r.top_p[i][j]);
            if (d > pd) pd = d;
        }
        if (pd > maxd) maxd = pd;
        if (getenv("KVS_TEST_VERBOSE")) fprintf(stderr, "  %s pos %d: max |dp| %.4g\n", name, (int)i, pd);
    }
    printf("%-16s positions %3d  top-1 agreement %3d/%3d (%.1f%%)  max |dp| %.3g\n", name, (int)r.n_tok, (int)agree,
           (int)r.n_tok, 100.0 * agree / r.n_tok, maxd);
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
static void test_ref_llama_mixed(void **st) { (void)st; check_ref("llama-mixed", false); }
static void test_ref_llama_q2_k(void **st) { (void)st; check_ref("llama-q2_k", false); }
static void test_ref_llama_q4_k_m(void **st) { (void)st; check_ref("llama-q4_k_m", false); }
static void test_ref_llama_q5_k_m(void **st) { (void)st; check_ref("llama-q5_k_m", false); }
static void test_ref_qwen2_mixed(void **st) { (void)st; check_ref("qwen2-mixed", false); }
static void test_ref_qwen3_q8_0(void **st) { (void)st; check_ref("qwen3-q8_0", false); }
static void test_ref_qwen3moe_mixed(void **st) { (void)st; check_ref("qwen3moe-mixed", false); }
/* qwen35-mixed rounds activations to F16/BF16 before half of its matrices,
 * so a one-ulp difference anywhere upstream flips some roundings and moves
 * probabilities by ~1e-2: llama.cpp itself (node-llama-cpp 3.22.1's libllama
 * on this machine) gives max |dp| 5e-7 against this reference when it
 * evaluates the 40 tokens in one batch, as the reference was made, but
 * 0.023 when it evaluates them one at a time (its decode kernels sum in
 * another order). The F16/BF16 dots follow llama.cpp's orders bit for bit
 * (prompt GEMM and vec_dot, kvs_kernels dot_gemm), which settles the
 * near-tie at position 13 (0.1681 vs 0.1602) its way; Q4_K/Q6_K/Q8_0 still
 * sum in other orders (max |dp| 0.046 with AVX-512, 0.048 with AVX2). */
static void test_ref_qwen35_mixed(void **st) { (void)st; check_ref("qwen35-mixed", false); }
static void test_ref_qwen35moe_q4_k(void **st) { (void)st; check_ref("qwen35moe-q4_k", false); }

/* Greedy generation: prefill the prompt, then one token per forward; must
 * reproduce the reference continuation (n_gen tokens). */
static void check_greedy(const char *name, int32_t n_gen, int32_t n_vocab)
{
    struct ref r;
    ref_load(name, &r);
    assert_int_equal(r.n_tok - r.n_prompt, n_gen);
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = load(g, 0, -1, 1, 64);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    assert_int_equal(V, n_vocab);
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t seq[64] = { 0 }, pos[64];
    for (int32_t i = 0; i < 64; i++) pos[i] = i;
    /* logits NULL: only the last row. */
    struct kvs_batch b = { .n_tokens = r.n_prompt, .token = r.tok, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &b, logits), KVS_OK);
    for (int32_t i = 0; i < n_gen; i++) {
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

static void test_greedy_aidreams(void **st) { (void)st; check_greedy("aidreams260K", 60, 512); }
static void test_greedy_qwen35moe(void **st) { (void)st; check_greedy("qwen35moe-q4_k", 32, 151669); }
/* Prefill (8 tokens: llama.cpp's prompt GEMM for the F16/BF16 matrices)
 * then decode (its vec_dot): step 6 is the near-tie of position 13. */
static void test_greedy_qwen35(void **st) { (void)st; check_greedy("qwen35-mixed", 32, 151669); }

static double max_rel_diff(const float *a, const float *b, size_t n)
{
    double scale = 1e-6, d = 0.0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)a[i]));
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d / scale;
}

/* The same tokens as one prefill batch, one token at a time, and interleaved
 * with a second sequence in one batch give the same logits: within 1e-4
 * (relative to the largest logit) for batches of 2+ tokens, within
 * single_bound for one token at a time. */
static void check_batching(const char *name, double single_bound)
{
    struct ref r;
    ref_load(name, &r);
    enum { N = 8 };
    assert_true(r.n_tok >= 2 * N);
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *m = load(g, 0, -1, 2, 2 * N);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *full = malloc((size_t)N * (size_t)V * sizeof(float));
    float *one = malloc((size_t)N * (size_t)V * sizeof(float));
    float *mix = malloc((size_t)2 * N * (size_t)V * sizeof(float));
    float *ref1 = malloc((size_t)N * (size_t)V * sizeof(float));
    assert_true(full && one && mix && ref1);
    int32_t seq[2 * N], pos[2 * N], tok[2 * N];
    int8_t want[2 * N];
    const int32_t *t0 = r.tok, *t1 = r.tok + N; /* two different token streams */

    for (int32_t i = 0; i < N; i++) seq[i] = 0, pos[i] = i, want[i] = 1;
    struct kvs_batch b = { .n_tokens = N, .token = t0, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(m, &b, full), KVS_OK);
    /* Sequence 1 alone, as reference for the interleaved run. */
    for (int32_t i = 0; i < N; i++) seq[i] = 1;
    b.token = t1;
    assert_int_equal(kvs_model_forward(m, &b, ref1), KVS_OK);

    kvs_model_seq_clear(m, 0);
    for (int32_t i = 0; i < N; i++) {
        int32_t s = 0, p = i;
        int8_t w = 1;
        struct kvs_batch d = { .n_tokens = 1, .token = &t0[i], .seq = &s, .pos = &p, .logits = &w };
        assert_int_equal(kvs_model_forward(m, &d, one + (size_t)i * (size_t)V), KVS_OK);
    }
    double d1 = max_rel_diff(full, one, (size_t)N * (size_t)V);

    /* Interleaved: the first 4 tokens of each sequence as a batch, then the
     * rest of both sequences alternating in one batch. */
    kvs_model_seq_clear(m, 0);
    kvs_model_seq_clear(m, 1);
    int32_t n = 0;
    for (int32_t i = 0; i < 4; i++) tok[n] = t0[i], seq[n] = 0, pos[n] = i, want[n++] = 1;
    for (int32_t i = 0; i < 4; i++) tok[n] = t1[i], seq[n] = 1, pos[n] = i, want[n++] = 1;
    b = (struct kvs_batch){ .n_tokens = n, .token = tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(m, &b, mix), KVS_OK);
    int32_t n2 = 0;
    for (int32_t i = 4; i < N; i++) {
        tok[n2] = t1[i], seq[n2] = 1, pos[n2] = i, want[n2++] = 1;
        tok[n2] = t0[i], seq[n2] = 0, pos[n2] = i, want[n2++] = 1;
    }
    b.n_tokens = n2;
    assert_int_equal(kvs_model_forward(m, &b, mix + (size_t)n * (size_t)V), KVS_OK);
    double d2 = 0.0;
    for (int32_t i = 0; i < N; i++) {
        /* Row of seq 0 / seq 1 token i in mix. */
        size_t r0 = i < 4 ? (size_t)i : (size_t)(n + 2 * (i - 4) + 1);
        size_t r1 = i < 4 ? (size_t)(4 + i) : (size_t)(n + 2 * (i - 4));
        d2 = fmax(d2, max_rel_diff(full + (size_t)i * V, mix + r0 * V, (size_t)V));
        d2 = fmax(d2, max_rel_diff(ref1 + (size_t)i * V, mix + r1 * V, (size_t)V));
    }
    printf("%-16s batch vs single: max rel diff %.3g; interleaved 2 seqs: %.3g\n", name, d1, d2);
    assert_true(d1 <= single_bound);
    assert_true(d2 <= 1e-4);
    free(full);
    free(one);
    free(mix);
    free(ref1);
    kvs_model_free(m);
    kvs_gguf_close(g);
    ref_free(&r);
}

static void test_batching_aidreams(void **st) { (void)st; check_batching("aidreams260K", 1e-4); }
static void test_batching_qwen3moe(void **st) { (void)st; check_batching("qwen3moe-mixed", 1e-4); }
/* Its F16/BF16 matrices sum a decode as llama.cpp's vec_dot and a prompt as
 * its tinyBLAS (kvs_kernels dot_gemm), two orders, and the F16/BF16
 * activation roundings after them amplify the ulps, as in llama.cpp itself
 * (0.023 in probabilities between its one-batch and one-at-a-time runs of
 * the reference tokens). Measured: 6.4e-7 with AVX-512, 0.013 with AVX2. */
static void test_batching_qwen35(void **st) { (void)st; check_batching("qwen35-mixed", 0.03); }
static void test_batching_qwen35moe(void **st) { (void)st; check_batching("qwen35moe-q4_k", 1e-4); }

/* Windows [0, a) then [a, n) over the boundary equal the full window. */
static void check_window(const char *name, int32_t a)
{
    struct ref r;
    ref_load(name, &r);
    const int32_t N = r.n_tok < 20 ? r.n_tok : 20;
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *full = load(g, 0, -1, 1, N);
    struct kvs_model *w0 = load(g, 0, a, 1, N);
    struct kvs_model *w1 = load(g, a, -1, 1, N);
    const struct kvs_hparams *hp = kvs_model_hparams(full);
    assert_true(kvs_model_has_embd(w0) && !kvs_model_has_head(w0));
    assert_true(!kvs_model_has_embd(w1) && kvs_model_has_head(w1));
    assert_int_equal(kvs_model_block_end(w0), a);
    assert_int_equal(kvs_model_block_begin(w1), a);
    const int32_t V = (int32_t)hp->n_vocab, E = (int32_t)hp->n_embd;
    float *lf = malloc((size_t)N * (size_t)V * sizeof(float)), *lw = malloc((size_t)N * (size_t)V * sizeof(float));
    float *bd = malloc((size_t)N * (size_t)E * sizeof(float));
    int32_t seq[64] = { 0 }, pos[64];
    int8_t want[64];
    /* Prefill of P = N-4 tokens (logits of its last row), then 4 decode
     * steps; rows P-1 .. N-1 of the logits are compared. */
    const int32_t P = N - 4;
    for (int32_t i = 0; i < N; i++) pos[i] = i, want[i] = i == P - 1;
    struct kvs_batch b = { .n_tokens = P, .token = r.tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(full, &b, lf + (size_t)(P - 1) * V), KVS_OK);
    assert_int_equal(kvs_model_forward(w0, &b, bd), KVS_OK);
    struct kvs_batch b1 = { .n_tokens = P, .embd = bd, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(w1, &b1, lw + (size_t)(P - 1) * V), KVS_OK);
    want[0] = 1;
    for (int32_t i = P; i < N; i++) {
        struct kvs_batch d = { .n_tokens = 1, .token = &r.tok[i], .seq = seq, .pos = &pos[i], .logits = want };
        assert_int_equal(kvs_model_forward(full, &d, lf + (size_t)i * V), KVS_OK);
        assert_int_equal(kvs_model_forward(w0, &d, bd), KVS_OK);
        struct kvs_batch d1 = { .n_tokens = 1, .embd = bd, .seq = seq, .pos = &pos[i], .logits = want };
        assert_int_equal(kvs_model_forward(w1, &d1, lw + (size_t)i * V), KVS_OK);
    }
    double d = max_rel_diff(lf + (size_t)(P - 1) * V, lw + (size_t)(P - 1) * V, (size_t)(N - P + 1) * (size_t)V);
    printf("%-16s window [0,%d)+[%d,n) vs [0,n): max rel diff %.3g\n", name, (int)a, (int)a, d);
    assert_true(d <= 1e-5);
    free(lf);
    free(lw);
    free(bd);
    kvs_model_free(full);
    kvs_model_free(w0);
    kvs_model_free(w1);
    kvs_gguf_close(g);
    ref_free(&r);
}

/* A sequence's state handed to another model instance (a planned leave,
 * PROTOCOL.md §5.2): after a prefill of P tokens in slot 1 of model a, its
 * state set into slot 0 of a fresh model b; 4 decode steps on both give the
 * same logits bit for bit (KV rows and, for qwen35, the GDN states). */
static void check_handover(const char *name)
{
    struct ref r;
    ref_load(name, &r);
    enum { P = 12, D = 4 };
    assert_true(r.n_tok >= P + D);
    struct kvs_gguf *g = open_model(name);
    struct kvs_model *a = load(g, 0, -1, 2, P), *b = load(g, 0, -1, 2, P);
    const int32_t V = (int32_t)kvs_model_hparams(a)->n_vocab;
    float *la = malloc((size_t)V * sizeof(float)), *lb = malloc((size_t)V * sizeof(float));
    assert_true(la && lb);
    int32_t seq[P], pos[P];
    int8_t want[P] = { 0 };
    for (int32_t i = 0; i < P; i++) seq[i] = 1, pos[i] = i;
    want[P - 1] = 1;
    struct kvs_batch pb = { .n_tokens = P, .token = r.tok, .seq = seq, .pos = pos, .logits = want };
    assert_int_equal(kvs_model_forward(a, &pb, la), KVS_OK);
    size_t n = kvs_model_seq_state_bytes(a, 1);
    assert_true(n > 0);
    assert_int_equal(kvs_model_seq_state_bytes(a, 2), 0);
    uint8_t *st = malloc(n + 1);
    assert_non_null(st);
    assert_int_equal(kvs_model_seq_state_get(a, 1, st, n - 1), KVS_ERR_RANGE);
    assert_int_equal(kvs_model_seq_state_get(a, 1, st, n), KVS_OK);
    /* a wrong size or position count changes nothing */
    assert_int_equal(kvs_model_seq_state_set(b, 0, P, st, n + 1), KVS_ERR_RANGE);
    assert_int_equal(kvs_model_seq_state_set(b, 0, P - 1, st, n), KVS_ERR_RANGE);
    assert_int_equal(kvs_model_seq_len(b, 0), 0);
    assert_int_equal(kvs_model_seq_state_set(b, 0, P, st, n), KVS_OK);
    assert_int_equal(kvs_model_seq_len(b, 0), P);
    for (int32_t i = P; i < P + D; i++) {
        int32_t s1 = 1, s0 = 0, p = i;
        int8_t w = 1;
        struct kvs_batch da = { .n_tokens = 1, .token = &r.tok[i], .seq = &s1, .pos = &p, .logits = &w };
        struct kvs_batch db = { .n_tokens = 1, .token = &r.tok[i], .seq = &s0, .pos = &p, .logits = &w };
        assert_int_equal(kvs_model_forward(a, &da, la), KVS_OK);
        assert_int_equal(kvs_model_forward(b, &db, lb), KVS_OK);
        assert_memory_equal(la, lb, (size_t)V * sizeof(float));
    }
    printf("%-16s handover of a %d-position sequence: %zu bytes, %d decode steps bit-identical\n", name, P, n, D);
    free(st);
    free(la);
    free(lb);
    kvs_model_free(a);
    kvs_model_free(b);
    kvs_gguf_close(g);
    ref_free(&r);
}

static void test_handover_aidreams(void **st) { (void)st; check_handover("aidreams260K"); }
static void test_handover_qwen35(void **st) { (void)st; check_handover("qwen35-mixed"); }

static void test_window_aidreams(void **st) { (void)st; check_window("aidreams260K", 2); }
static void test_window_qwen3moe(void **st) { (void)st; check_window("qwen3moe-mixed", 1); }
/* Windows that end on a GDN block (1, 2), and that start on the attention block (3). */
static void test_window_qwen35(void **st)
{
    (void)st;
    for (int32_t a = 1; a < 4; a++) check_window("qwen35-mixed", a);
}
static void test_window_qwen35moe(void **st)
{
    (void)st;
    for (int32_t a = 1; a < 4; a++) check_window("qwen35moe-q4_k", a);
}

/* Hyperparameters of the test models (values from ../shared/models/README.md). */
static void test_hparams(void **st)
{
    (void)st;
    struct kvs_hparams hp;
    char err[256];
    struct kvs_gguf *g = open_model("qwen3-q8_0");
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.arch, KVS_ARCH_QWEN3);
    assert_int_equal(hp.n_block, 4);
    assert_int_equal(hp.n_embd, 128);
    assert_int_equal(hp.n_head, 4);
    assert_int_equal(hp.n_head_kv, 2);
    assert_int_equal(hp.head_dim, 64);
    assert_int_equal(hp.n_ff, 384);
    assert_true(hp.tied_output);
    assert_true(hp.rope_neox);
    kvs_gguf_close(g);
    g = open_model("aidreams260K");
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.arch, KVS_ARCH_LLAMA);
    assert_int_equal(hp.n_block, 4);
    assert_int_equal(hp.n_embd, 64);
    assert_int_equal(hp.head_dim, 16);
    assert_int_equal(hp.n_ff, 172);
    assert_int_equal(hp.n_vocab, 512);
    assert_int_equal(hp.n_ctx_train, 128);
    assert_false(hp.rope_neox);
    assert_false(hp.tied_output);
    kvs_gguf_close(g);
    g = open_model("qwen3moe-mixed");
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.arch, KVS_ARCH_QWEN3MOE);
    assert_int_equal(hp.n_expert, 8);
    assert_int_equal(hp.n_expert_used, 2);
    assert_int_equal(hp.n_ff_exp, 128);
    assert_int_equal(hp.n_vocab, 50257);
    kvs_gguf_close(g);
}

/* A header-only copy of model `name` (every KV, every tensor info; no
 * tensor data) with one KV changed by `edit`, parsed as a GGUF. *hdr is the
 * buffer it borrows: free it after closing the result. */
static struct kvs_gguf *edited_header_drop(const char *name, const char *drop, void (*edit)(struct kvs_gguf_writer *w),
                                           uint8_t **hdr_out)
{
    struct kvs_gguf *src = open_model(name);
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_non_null(w);
    for (size_t i = 0; i < kvs_gguf_n_kv(src); i++) {
        const char *key = kvs_gguf_key(src, i);
        if (drop && key && !strcmp(key, drop)) continue;
        assert_int_equal(kvs_gguf_writer_copy_kv(w, src, i), KVS_OK);
    }
    for (size_t i = 0; i < kvs_gguf_n_tensors(src); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(src, i);
        assert_int_equal(kvs_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, NULL, t->bytes), KVS_OK);
    }
    if (edit) edit(w);
    uint8_t *hdr = NULL;
    size_t len = 0;
    assert_int_equal(kvs_gguf_writer_header(w, &hdr, &len), KVS_OK);
    struct kvs_gguf *g = NULL;
    char err[256];
    kvs_err e = kvs_gguf_parse(hdr, len, kvs_gguf_writer_total_bytes(w), &g, NULL, err, sizeof err);
    if (e) fail_msg("parse edited %s: %s (%s)", name, kvs_strerror(e), err);
    *hdr_out = hdr;
    kvs_gguf_writer_free(w);
    kvs_gguf_close(src);
    return g;
}

static struct kvs_gguf *edited_header(const char *name, void (*edit)(struct kvs_gguf_writer *w), uint8_t **hdr_out)
{
    return edited_header_drop(name, NULL, edit, hdr_out);
}

static void ed_moe_ff_huge(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen3moe.feed_forward_length", 0x7FFFFFFFu); }
static void ed_moe_no_experts(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen3moe.expert_count", 0); }
static void ed_heads_3(struct kvs_gguf_writer *w)
{
    kvs_gguf_writer_set_u32(w, "llama.attention.head_count", 3); /* 64 / 3 */
    kvs_gguf_writer_set_u32(w, "llama.attention.head_count_kv", 3);
}
static void ed_tokens_520(struct kvs_gguf_writer *w)
{
    static char names[520][16]; /* room for any int: gcc -O1 + sanitizers checks the full range */
    const char *strs[520];
    for (int i = 0; i < 520; i++) {
        snprintf(names[i], sizeof names[i], "t%d", i);
        strs[i] = names[i];
    }
    kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", strs, 520);
}

static void ed_q35_inner(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.ssm.inner_size", 300); }
static void ed_q35_rank3(struct kvs_gguf_writer *w)
{
    kvs_gguf_writer_set_u32(w, "qwen35.ssm.time_step_rank", 3); /* not a multiple of group_count 2 */
    kvs_gguf_writer_set_u32(w, "qwen35.ssm.inner_size", 192);
}
static void ed_q35_groups(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.ssm.group_count", 8); }
static void ed_q35_conv1(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.ssm.conv_kernel", 1); }
static void ed_q35_interval0(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.full_attention_interval", 0); }
static void ed_q35_nextn(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.nextn_predict_layers", 4); }
static void ed_q35_experts(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35.expert_count", 8); }
static void ed_q35_recr_len(struct kvs_gguf_writer *w)
{
    const uint32_t v[3] = { 1, 1, 1 };
    kvs_gguf_writer_set_arr(w, "qwen35.attention.recurrent_layers", KVS_GGUF_TYPE_UINT32, v, 3);
}
static void ed_q35_sections_f32(struct kvs_gguf_writer *w)
{
    const float v[4] = { 3, 3, 2, 0 };
    kvs_gguf_writer_set_arr(w, "qwen35.rope.dimension_sections", KVS_GGUF_TYPE_FLOAT32, v, 4);
}
static void ed_q35moe_experts0(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35moe.expert_count", 0); }
static void ed_q35moe_nextn0(struct kvs_gguf_writer *w) { kvs_gguf_writer_set_u32(w, "qwen35moe.nextn_predict_layers", 0); }

/* qwen35 / qwen35moe: each required key removed, or set inconsistent, is
 * refused with the code and the words that name it (qwen35-facts §1). */
static void test_hparams_bad_qwen35(void **st)
{
    (void)st;
    static const struct {
        const char *model, *drop;
        void (*edit)(struct kvs_gguf_writer *w);
        kvs_err want;
        const char *words;
    } cases[] = {
        { "qwen35-mixed", "qwen35.ssm.conv_kernel", NULL, KVS_ERR_NOT_FOUND, "'qwen35.ssm.conv_kernel': required but absent" },
        { "qwen35-mixed", "qwen35.ssm.state_size", NULL, KVS_ERR_NOT_FOUND, "'qwen35.ssm.state_size': required but absent" },
        { "qwen35-mixed", "qwen35.ssm.time_step_rank", NULL, KVS_ERR_NOT_FOUND, "'qwen35.ssm.time_step_rank': required" },
        { "qwen35-mixed", "qwen35.ssm.group_count", NULL, KVS_ERR_NOT_FOUND, "'qwen35.ssm.group_count': required" },
        { "qwen35-mixed", "qwen35.ssm.inner_size", NULL, KVS_ERR_NOT_FOUND, "'qwen35.ssm.inner_size': required" },
        { "qwen35-mixed", "qwen35.rope.dimension_sections", NULL, KVS_ERR_NOT_FOUND,
          "'qwen35.rope.dimension_sections': required but absent" },
        { "qwen35-mixed", "qwen35.feed_forward_length", NULL, KVS_ERR_NOT_FOUND, "'qwen35.feed_forward_length': required" },
        { "qwen35-mixed", "qwen35.attention.layer_norm_rms_epsilon", NULL, KVS_ERR_NOT_FOUND, "layer_norm_rms_epsilon" },
        { "qwen35-mixed", NULL, ed_q35_inner, KVS_ERR_FORMAT, "ssm.inner_size 300 != ssm.time_step_rank 4 x ssm.state_size 64" },
        { "qwen35-mixed", NULL, ed_q35_rank3, KVS_ERR_FORMAT, "ssm.time_step_rank 3 is not a multiple of ssm.group_count 2" },
        { "qwen35-mixed", NULL, ed_q35_groups, KVS_ERR_RANGE, "ssm.group_count = 8 is out of range [1, 4]" },
        { "qwen35-mixed", NULL, ed_q35_conv1, KVS_ERR_RANGE, "ssm.conv_kernel = 1 is out of range" },
        { "qwen35-mixed", NULL, ed_q35_interval0, KVS_ERR_RANGE, "full_attention_interval = 0 is out of range" },
        { "qwen35-mixed", NULL, ed_q35_nextn, KVS_ERR_FORMAT, "nextn_predict_layers 4 leaves no main block of block_count 4" },
        { "qwen35-mixed", NULL, ed_q35_experts, KVS_ERR_UNSUPPORTED, "mixture-of-experts qwen35 models are not supported" },
        { "qwen35-mixed", NULL, ed_q35_recr_len, KVS_ERR_FORMAT, "expected 4 BOOL/INT32/UINT32 (block_count), got 3" },
        { "qwen35-mixed", NULL, ed_q35_sections_f32, KVS_ERR_FORMAT, "expected 3 or 4 INT32 (M-RoPE sections)" },
        { "qwen35moe-q4_k", "qwen35moe.expert_shared_feed_forward_length", NULL, KVS_ERR_NOT_FOUND,
          "'qwen35moe.expert_shared_feed_forward_length': required but absent" },
        { "qwen35moe-q4_k", "qwen35moe.expert_used_count", NULL, KVS_ERR_NOT_FOUND, "'qwen35moe.expert_used_count': required" },
        { "qwen35moe-q4_k", NULL, ed_q35moe_experts0, KVS_ERR_FORMAT, "qwen35moe needs qwen35moe.expert_count >= 1" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t *hdr = NULL;
        struct kvs_gguf *g = edited_header_drop(cases[i].model, cases[i].drop, cases[i].edit, &hdr);
        struct kvs_hparams hp;
        char err[256] = "";
        kvs_err e = kvs_hparams_read(g, &hp, err, sizeof err);
        if (e != cases[i].want || !strstr(err, cases[i].words))
            fail_msg("case %zu: %s (%s), expected %s with '%s'", i, kvs_strerror(e), err, kvs_strerror(cases[i].want),
                     cases[i].words);
        kvs_gguf_close(g);
        free(hdr);
    }
    /* Without nextn_predict_layers the MoE file's MTP block 4 counts as a
     * main (GDN, by the interval) block, as in llama.cpp, whose loader then
     * fails on its missing tensors. */
    uint8_t *hdr = NULL;
    struct kvs_gguf *g = edited_header("qwen35moe-q4_k", ed_q35moe_nextn0, &hdr);
    struct kvs_hparams hp;
    char err[256] = "";
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.n_block, 5);
    assert_true(kvs_hparams_recurrent(&hp, 4));
    kvs_gguf_close(g);
    free(hdr);
}

/* Hyperparameters of the qwen35 test models (../shared/models/README.md). */
static void test_hparams_qwen35(void **st)
{
    (void)st;
    struct kvs_hparams hp;
    char err[256];
    struct kvs_gguf *g = open_model("qwen35-mixed");
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.arch, KVS_ARCH_QWEN35);
    assert_true(kvs_hparams_hybrid(&hp));
    assert_int_equal(hp.n_block, 4);
    assert_int_equal(hp.n_nextn, 0);
    assert_int_equal(hp.n_embd, 256);
    assert_int_equal(hp.n_head, 4);
    assert_int_equal(hp.n_head_kv, 2);
    assert_int_equal(hp.head_dim, 64);
    assert_int_equal(hp.n_rot, 16);
    assert_int_equal(hp.n_ff, 256);
    assert_int_equal(hp.ssm_conv, 4);
    assert_int_equal(hp.ssm_d, 64);
    assert_int_equal(hp.ssm_h_v, 4);
    assert_int_equal(hp.ssm_h_k, 2);
    assert_int_equal(kvs_hparams_conv_channels(&hp), 512);
    /* (K-1)·C + H_v·d·d floats: 3·512 + 4·64·64 */
    assert_int_equal(kvs_hparams_recurrent_bytes(&hp), (3 * 512 + 4 * 64 * 64) * 4);
    assert_true(kvs_hparams_recurrent(&hp, 0) && kvs_hparams_recurrent(&hp, 2) && !kvs_hparams_recurrent(&hp, 3));
    assert_true(hp.tied_output);
    assert_true(hp.rope_neox);
    kvs_gguf_close(g);
    g = open_model("qwen35moe-q4_k");
    assert_int_equal(kvs_hparams_read(g, &hp, err, sizeof err), KVS_OK);
    assert_int_equal(hp.arch, KVS_ARCH_QWEN35MOE);
    assert_int_equal(hp.n_block, 4); /* block_count 5 minus the MTP block */
    assert_int_equal(hp.n_nextn, 1);
    assert_int_equal(hp.n_expert, 8);
    assert_int_equal(hp.n_expert_used, 3);
    assert_int_equal(hp.n_ff_exp, 256);
    assert_int_equal(hp.n_ff_shexp, 256);
    assert_int_equal(hp.ssm_h_v, 8);
    assert_int_equal(hp.ssm_d, 32);
    assert_int_equal(kvs_hparams_conv_channels(&hp), 384);
    assert_false(kvs_hparams_recurrent(&hp, 3));
    assert_false(kvs_hparams_recurrent(&hp, 4)); /* not a main block */
    kvs_gguf_close(g);
}

/* Hyperparameters that once got through (or gave a misleading error): each
 * is refused at load with the code and the words that name the problem. */
static void test_hparams_bad(void **st)
{
    (void)st;
    static const struct {
        const char *model;
        void (*edit)(struct kvs_gguf_writer *w);
        kvs_err want;
        const char *words;
    } cases[] = {
        { "qwen3moe-mixed", ed_moe_ff_huge, KVS_ERR_RANGE, "feed_forward_length = 2147483647 is out of range" },
        { "qwen3moe-mixed", ed_moe_no_experts, KVS_ERR_FORMAT, "expert_count >= 1" },
        { "aidreams260K", ed_heads_3, KVS_ERR_FORMAT, "embedding_length 64 is not a multiple of head_count 3" },
        { "aidreams260K", ed_tokens_520, KVS_ERR_FORMAT, "520 tokens (vocabulary 520) but token_embd.weight has 512 rows" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint8_t *hdr = NULL;
        struct kvs_gguf *g = edited_header(cases[i].model, cases[i].edit, &hdr);
        struct kvs_hparams hp;
        char err[256] = "";
        kvs_err e = kvs_hparams_read(g, &hp, err, sizeof err);
        if (e != cases[i].want || !strstr(err, cases[i].words))
            fail_msg("case %zu: %s (%s), expected %s with '%s'", i, kvs_strerror(e), err, kvs_strerror(cases[i].want),
                     cases[i].words);
        kvs_gguf_close(g);
        free(hdr);
    }
}

/* Bad windows and bad batches are errors that change nothing. */
static void test_errors(void **st)
{
    (void)st;
    struct kvs_gguf *g = open_model("aidreams260K");
    struct kvs_model_params p = kvs_model_default_params();
    struct kvs_model *m = NULL;
    char err[256];
    p.block_begin = 3, p.block_end = 2;
    assert_int_equal(kvs_model_load(g, &p, &m, err, sizeof err), KVS_ERR_RANGE);
    p.block_begin = 0, p.block_end = 5;
    assert_int_equal(kvs_model_load(g, &p, &m, err, sizeof err), KVS_ERR_RANGE);
    assert_null(m);
    m = load(g, 0, -1, 2, 8);
    assert_int_equal(kvs_model_n_ctx(m), 128);
    assert_int_equal(kvs_model_n_seq(m), 2);
    float *out = malloc(8 * 512 * sizeof(float));
    int32_t tok[3] = { 1, 429, 491 }, seq[3] = { 0, 0, 0 }, pos[3] = { 0, 1, 2 };
    struct kvs_batch b = { .n_tokens = 3, .token = tok, .seq = seq, .pos = pos };
    pos[1] = 2; /* gap */
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_RANGE);
    pos[1] = 1;
    seq[2] = 2; /* no such slot */
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_RANGE);
    seq[2] = 0;
    tok[2] = 512; /* out of vocabulary */
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_RANGE);
    tok[2] = 491;
    pos[0] = 1, pos[1] = 2, pos[2] = 3; /* does not start at the cached length */
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_RANGE);
    assert_int_equal(kvs_model_seq_len(m, 0), 0);
    pos[0] = 0, pos[1] = 1, pos[2] = 2;
    b.n_tokens = 9; /* > n_batch */
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_RANGE);
    b.n_tokens = 3;
    b.token = NULL;
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_ERR_ARG);
    b.token = tok;
    assert_int_equal(kvs_model_forward(m, &b, out), KVS_OK);
    assert_int_equal(kvs_model_seq_len(m, 0), 3);
    assert_int_equal(kvs_model_seq_len(m, 1), 0);
    int32_t p127 = 127, s1 = 1;
    struct kvs_batch far = { .n_tokens = 1, .token = tok, .seq = &s1, .pos = &p127 };
    assert_int_equal(kvs_model_forward(m, &far, out), KVS_ERR_RANGE);
    free(out);
    kvs_model_free(m);
    kvs_gguf_close(g);
}

/* A sequence restarted at pos <= its length forgets the later positions:
 * the logits equal those of a fresh evaluation of the new tokens. */
static void test_rewind(void **st)
{
    (void)st;
    struct kvs_gguf *g = open_model("aidreams260K");
    struct kvs_model *m = load(g, 0, -1, 1, 8);
    float a[512], b2[512];
    int32_t tok[4] = { 1, 429, 491, 433 }, alt[4] = { 1, 429, 300, 301 }, seq[4] = { 0 }, pos[4] = { 0, 1, 2, 3 };
    struct kvs_batch b = { .n_tokens = 4, .token = tok, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &b, a), KVS_OK);
    /* Rewind to pos 2 with other tokens. */
    struct kvs_batch r = { .n_tokens = 2, .token = alt + 2, .seq = seq, .pos = pos + 2 };
    assert_int_equal(kvs_model_forward(m, &r, a), KVS_OK);
    assert_int_equal(kvs_model_seq_len(m, 0), 4);
    kvs_model_seq_clear(m, 0);
    assert_int_equal(kvs_model_seq_len(m, 0), 0);
    struct kvs_batch f = { .n_tokens = 4, .token = alt, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &f, b2), KVS_OK);
    assert_true(max_rel_diff(a, b2, 512) <= 1e-5);
    kvs_model_free(m);
    kvs_gguf_close(g);
}

/* Hybrid models: a recurrent state cannot be rewound, so a sequence
 * continues or restarts at 0 (which starts from zero state, as does a
 * cleared sequence): both restarts equal a fresh model's logits, and the
 * state carried across chunks equals one batch. */
static void test_recurrent_state(void **st)
{
    (void)st;
    struct kvs_gguf *g = open_model("qwen35moe-q4_k");
    struct kvs_model *m = load(g, 0, -1, 2, 8);
    struct kvs_model *fresh = load(g, 0, -1, 1, 8);
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *a = malloc((size_t)V * sizeof(float)), *b2 = malloc((size_t)V * sizeof(float));
    assert_true(a && b2);
    int32_t tok[6] = { 785, 6722, 315, 9625, 374, 264 }, alt[6] = { 40, 1079, 5911, 311, 279, 3283 };
    int32_t seq[6] = { 0 }, pos[6] = { 0, 1, 2, 3, 4, 5 };
    struct kvs_batch b = { .n_tokens = 6, .token = tok, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &b, a), KVS_OK);
    /* Rewinding into the middle is refused and changes nothing. */
    struct kvs_batch rw = { .n_tokens = 2, .token = alt + 2, .seq = seq, .pos = pos + 2 };
    assert_int_equal(kvs_model_forward(m, &rw, a), KVS_ERR_RANGE);
    assert_int_equal(kvs_model_seq_len(m, 0), 6);
    /* Restart at 0 without a clear: fresh state. */
    struct kvs_batch f = { .n_tokens = 6, .token = alt, .seq = seq, .pos = pos };
    assert_int_equal(kvs_model_forward(m, &f, a), KVS_OK);
    assert_int_equal(kvs_model_forward(fresh, &f, b2), KVS_OK);
    assert_true(max_rel_diff(a, b2, (size_t)V) == 0.0);
    /* Clear, then the same prompt in chunks of 4 + 2 on slot 1 and 0. */
    kvs_model_seq_clear(m, 0);
    assert_int_equal(kvs_model_seq_len(m, 0), 0);
    int32_t seq1[6] = { 1, 1, 1, 1, 1, 1 };
    struct kvs_batch c1 = { .n_tokens = 4, .token = alt, .seq = seq1, .pos = pos };
    struct kvs_batch c2 = { .n_tokens = 2, .token = alt + 4, .seq = seq1, .pos = pos + 4 };
    assert_int_equal(kvs_model_forward(m, &c1, a), KVS_OK);
    assert_int_equal(kvs_model_forward(m, &c2, a), KVS_OK);
    assert_true(max_rel_diff(a, b2, (size_t)V) == 0.0);
    b.token = alt;
    assert_int_equal(kvs_model_forward(m, &b, a), KVS_OK); /* slot 0 after the clear */
    assert_true(max_rel_diff(a, b2, (size_t)V) == 0.0);
    free(a);
    free(b2);
    kvs_model_free(m);
    kvs_model_free(fresh);
    kvs_gguf_close(g);
}

int main(void)
{
    /* KVS_TEST_FILTER=pattern runs a subset (cmocka glob). */
    if (getenv("KVS_TEST_FILTER")) cmocka_set_test_filter(getenv("KVS_TEST_FILTER"));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hparams),
        cmocka_unit_test(test_hparams_bad),
        cmocka_unit_test(test_hparams_qwen35),
        cmocka_unit_test(test_hparams_bad_qwen35),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_rewind),
        cmocka_unit_test(test_recurrent_state),
        cmocka_unit_test(test_ref_aidreams260K),
        cmocka_unit_test(test_greedy_aidreams),
        cmocka_unit_test(test_batching_aidreams),
        cmocka_unit_test(test_window_aidreams),
        cmocka_unit_test(test_handover_aidreams),
        cmocka_unit_test(test_handover_qwen35),
        cmocka_unit_test(test_ref_llama_f32),
        cmocka_unit_test(test_ref_llama_mixed),
        cmocka_unit_test(test_ref_llama_q2_k),
        cmocka_unit_test(test_ref_llama_q4_k_m),
        cmocka_unit_test(test_ref_llama_q5_k_m),
        cmocka_unit_test(test_ref_qwen2_mixed),
        cmocka_unit_test(test_ref_qwen3_q8_0),
        cmocka_unit_test(test_ref_qwen3moe_mixed),
        cmocka_unit_test(test_batching_qwen3moe),
        cmocka_unit_test(test_window_qwen3moe),
        cmocka_unit_test(test_ref_qwen35_mixed),
        cmocka_unit_test(test_ref_qwen35moe_q4_k),
        cmocka_unit_test(test_greedy_qwen35moe),
        cmocka_unit_test(test_greedy_qwen35),
        cmocka_unit_test(test_batching_qwen35),
        cmocka_unit_test(test_batching_qwen35moe),
        cmocka_unit_test(test_window_qwen35),
        cmocka_unit_test(test_window_qwen35moe),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

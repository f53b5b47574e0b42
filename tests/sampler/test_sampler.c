/* Sampler tests: hand-computed distributions, filter cut-offs, penalty math,
 * reproducibility and empirical frequencies. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sampler/sampler.h"

/* Filters all off, temperature 1: the plain softmax. */
static struct kvs_sampler_params plain(void)
{
    struct kvs_sampler_params p = kvs_sampler_default_params();
    p.temp = 1.0f;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.repeat_penalty = 1.0f;
    return p;
}

static struct kvs_sampler *make(const struct kvs_sampler_params *p, int32_t n_vocab)
{
    struct kvs_sampler *s = NULL;
    assert_int_equal(kvs_sampler_create(p, n_vocab, &s), KVS_OK);
    assert_non_null(s);
    return s;
}

/* Deterministic test logits (a local LCG, independent of the sampler's RNG). */
static void fill_logits(float *l, int32_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1u;
    for (int32_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        l[i] = (float)((double)(x >> 8) / 16777216.0 * 20.0 - 10.0);
    }
}

static const float L3[3] = { 0.0f, 0.69314718f, 1.38629436f }; /* 0, ln2, ln4 */

static void test_defaults(void **st)
{
    (void)st;
    struct kvs_sampler_params p = kvs_sampler_default_params();
    assert_true(p.temp == 0.8f);
    assert_int_equal(p.top_k, 40);
    assert_true(p.top_p == 0.95f);
    assert_true(p.min_p == 0.05f);
    assert_true(p.repeat_penalty == 1.0f);
    assert_int_equal(p.repeat_last_n, 64);
}

static void test_create_errors(void **st)
{
    (void)st;
    struct kvs_sampler *s = (struct kvs_sampler *)1;
    struct kvs_sampler_params p = plain();
    assert_int_equal(kvs_sampler_create(&p, 0, &s), KVS_ERR_RANGE);
    assert_null(s);
    assert_int_equal(kvs_sampler_create(&p, -5, &s), KVS_ERR_RANGE);
    assert_int_equal(kvs_sampler_create(NULL, 10, &s), KVS_ERR_ARG);
    assert_int_equal(kvs_sampler_create(&p, 10, NULL), KVS_ERR_ARG);
    p.temp = NAN;
    assert_int_equal(kvs_sampler_create(&p, 10, &s), KVS_ERR_ARG);
    p = plain();
    p.repeat_penalty = 0.0f;
    assert_int_equal(kvs_sampler_create(&p, 10, &s), KVS_ERR_ARG);
    p = plain();
    p.repeat_last_n = KVS_SAMPLER_MAX_LAST_N + 1;
    assert_int_equal(kvs_sampler_create(&p, 10, &s), KVS_ERR_RANGE);
    kvs_sampler_free(NULL);
}

static void test_greedy(void **st)
{
    (void)st;
    struct kvs_sampler_params p = plain();
    p.temp = 0.0f;
    float l[6] = { 1.0f, 3.0f, -2.0f, 5.5f, 5.4f, 0.0f };
    struct kvs_sampler *s = make(&p, 6);
    assert_int_equal(kvs_sampler_sample(s, l), 3);
    /* ties: the lowest id */
    float t[5] = { 1.0f, 7.0f, 2.0f, 7.0f, 7.0f };
    struct kvs_sampler *s5 = make(&p, 5);
    assert_int_equal(kvs_sampler_sample(s5, t), 1);
    /* NaN counts as -inf; +inf wins */
    float n[5] = { NAN, 2.0f, NAN, 1.0f, 3.0f };
    assert_int_equal(kvs_sampler_sample(s5, n), 4);
    float i5[5] = { 1.0f, INFINITY, 2.0f, NAN, 3.0f };
    assert_int_equal(kvs_sampler_sample(s5, i5), 1);
    /* all -inf / NaN: still a valid id */
    float bad[5] = { NAN, -INFINITY, NAN, -INFINITY, NAN };
    int32_t id = kvs_sampler_sample(s5, bad);
    assert_true(id >= 0 && id < 5);
    /* dist of greedy: one candidate with probability 1 */
    const int32_t *ids;
    const float *pr;
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 1);
    assert_int_equal(ids[0], 3);
    assert_true(pr[0] == 1.0f);
    kvs_sampler_free(s);
    kvs_sampler_free(s5);
}

static void test_softmax_hand(void **st)
{
    (void)st;
    struct kvs_sampler_params p = plain();
    struct kvs_sampler *s = make(&p, 3);
    const int32_t *ids;
    const float *pr;
    /* {0, ln2, ln4} -> {1,2,4}/7, sorted descending */
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 3);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 1);
    assert_int_equal(ids[2], 0);
    assert_float_equal(pr[0], 4.0 / 7.0, 1e-6);
    assert_float_equal(pr[1], 2.0 / 7.0, 1e-6);
    assert_float_equal(pr[2], 1.0 / 7.0, 1e-6);
    kvs_sampler_free(s);

    /* temperature 0.5 doubles the logits: {1,4,16}/21 */
    p.temp = 0.5f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 3);
    assert_float_equal(pr[0], 16.0 / 21.0, 1e-6);
    assert_float_equal(pr[1], 4.0 / 21.0, 1e-6);
    assert_float_equal(pr[2], 1.0 / 21.0, 1e-6);
    kvs_sampler_free(s);

    /* temperature 2 halves them: {1, sqrt2, 2}/(3+sqrt2) */
    p.temp = 2.0f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 3);
    double z = 3.0 + sqrt(2.0);
    assert_float_equal(pr[0], 2.0 / z, 1e-6);
    assert_float_equal(pr[1], sqrt(2.0) / z, 1e-6);
    assert_float_equal(pr[2], 1.0 / z, 1e-6);
    kvs_sampler_free(s);
}

static void test_top_k(void **st)
{
    (void)st;
    struct kvs_sampler_params p = plain();
    p.top_k = 2;
    struct kvs_sampler *s = make(&p, 3);
    const int32_t *ids;
    const float *pr;
    /* keeps {ln4, ln2}: {4,2}/6 */
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 2);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 1);
    assert_float_equal(pr[0], 2.0 / 3.0, 1e-6);
    assert_float_equal(pr[1], 1.0 / 3.0, 1e-6);
    kvs_sampler_free(s);

    /* top-k = 1 equals greedy, on a large vocabulary */
    enum { NV = 151936 };
    float *l = malloc(NV * sizeof *l);
    assert_non_null(l);
    struct kvs_sampler_params g = plain();
    g.temp = 0.0f;
    p.top_k = 1;
    p.temp = 1.5f;
    struct kvs_sampler *sk = make(&p, NV), *sg = make(&g, NV);
    for (uint32_t t = 0; t < 5; t++) {
        fill_logits(l, NV, t);
        int32_t a = kvs_sampler_sample(sg, l);
        int32_t b = kvs_sampler_sample(sk, l);
        assert_int_equal(a, b);
        for (int32_t i = 0; i < NV; i++)
            assert_true(l[i] <= l[a]);
    }
    kvs_sampler_free(sk);

    /* top-k = 40 on 151936: the 40 largest, in order (checked by counting) */
    p.top_k = 40;
    p.temp = 1.0f;
    sk = make(&p, NV);
    fill_logits(l, NV, 99);
    assert_int_equal(kvs_sampler_dist(sk, l, &ids, &pr), 40);
    for (int32_t j = 0; j < 40; j++) {
        int32_t greater = 0;
        for (int32_t i = 0; i < NV; i++)
            greater += l[i] > l[ids[j]];
        assert_int_equal(greater, j);
        if (j > 0)
            assert_true(pr[j] <= pr[j - 1]);
    }
    kvs_sampler_free(sk);
    kvs_sampler_free(sg);
    free(l);
}

static void test_top_k_ties(void **st)
{
    (void)st;
    struct kvs_sampler_params p = plain();
    p.top_k = 3;
    float l[8] = { 1.0f, 5.0f, 5.0f, 0.0f, 5.0f, 5.0f, 2.0f, 5.0f };
    struct kvs_sampler *s = make(&p, 8);
    const int32_t *ids;
    const float *pr;
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 3);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 2);
    assert_int_equal(ids[2], 4);
    assert_float_equal(pr[0], 1.0 / 3.0, 1e-6);
    kvs_sampler_free(s);
}

static void test_top_p(void **st)
{
    (void)st;
    const int32_t *ids;
    const float *pr;
    struct kvs_sampler_params p = plain();
    /* 4/7 = 0.571 >= 0.5: only the top token */
    p.top_p = 0.5f;
    struct kvs_sampler *s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 1);
    assert_int_equal(ids[0], 2);
    assert_float_equal(pr[0], 1.0, 1e-6);
    for (int i = 0; i < 100; i++)
        assert_int_equal(kvs_sampler_sample(s, L3), 2);
    kvs_sampler_free(s);
    /* 0.6 needs the second (6/7): {4,2}/6 */
    p.top_p = 0.6f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 2);
    assert_float_equal(pr[0], 2.0 / 3.0, 1e-6);
    assert_float_equal(pr[1], 1.0 / 3.0, 1e-6);
    kvs_sampler_free(s);
    /* 0.9 needs all three (6/7 = 0.857 < 0.9) */
    p.top_p = 0.9f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 3);
    kvs_sampler_free(s);
    /* 0: still keeps one */
    p.top_p = 0.0f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 1);
    kvs_sampler_free(s);
}

static void test_min_p(void **st)
{
    (void)st;
    const int32_t *ids;
    const float *pr;
    struct kvs_sampler_params p = plain();
    /* relative probs {1/4, 1/2, 1}: 0.3 drops id 0, keeps {4,2}/6 */
    p.min_p = 0.3f;
    struct kvs_sampler *s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 2);
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 1);
    assert_float_equal(pr[0], 2.0 / 3.0, 1e-6);
    for (int i = 0; i < 200; i++)
        assert_int_not_equal(kvs_sampler_sample_at(s, L3, (uint64_t)i), 0);
    kvs_sampler_free(s);
    /* 0.2 keeps all; 0.6 keeps only the top */
    p.min_p = 0.2f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 3);
    kvs_sampler_free(s);
    p.min_p = 0.6f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 1);
    assert_int_equal(ids[0], 2);
    kvs_sampler_free(s);
    /* > 1 still keeps the max */
    p.min_p = 5.0f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 1);
    assert_int_equal(kvs_sampler_sample(s, L3), 2);
    kvs_sampler_free(s);
    /* with temperature 0.5, relative {1/16, 1/4, 1}: 0.2 drops id 0 */
    p.min_p = 0.2f;
    p.temp = 0.5f;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_dist(s, L3, &ids, &pr), 2);
    assert_float_equal(pr[0], 0.8, 1e-6);
    assert_float_equal(pr[1], 0.2, 1e-6);
    kvs_sampler_free(s);
}

/* top-p measures mass against the full distribution, then min-p cuts:
 * logits ln{8,4,2,1,1}: probs {8,4,2,1,1}/16. top_p 0.9 keeps 8,4,2 (14/16 =
 * 0.875 < 0.9, so 15/16: also the first 1, id 3); min_p 0.2 (thr 1.6) then
 * drops the 1 -> {8,4,2}/14. */
static void test_top_p_then_min_p(void **st)
{
    (void)st;
    const int32_t *ids;
    const float *pr;
    float l[5] = { logf(8.0f), logf(4.0f), logf(2.0f), 0.0f, 0.0f };
    struct kvs_sampler_params p = plain();
    p.top_p = 0.9f;
    struct kvs_sampler *s = make(&p, 5);
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 4);
    assert_int_equal(ids[3], 3);
    assert_float_equal(pr[3], 1.0 / 15.0, 1e-6);
    kvs_sampler_free(s);
    p.min_p = 0.2f;
    s = make(&p, 5);
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 3);
    assert_float_equal(pr[0], 8.0 / 14.0, 1e-6);
    assert_float_equal(pr[1], 4.0 / 14.0, 1e-6);
    assert_float_equal(pr[2], 2.0 / 14.0, 1e-6);
    kvs_sampler_free(s);
    /* top_p 0.8 with min_p 0.2: top-p counts mass against all five (cum
     * 0.5, 0.75, 0.875 -> 3 kept), min-p then keeps those 3. Applying min-p
     * first would renormalize to {8,4,2}/14 and stop at 2 (12/14 >= 0.8). */
    p.top_p = 0.8f;
    p.min_p = 0.2f;
    s = make(&p, 5);
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 3);
    assert_float_equal(pr[2], 2.0 / 14.0, 1e-6);
    kvs_sampler_free(s);
}

/* The remembered ids (a tail's handover, PROTOCOL.md §5.2): the last
 * repeat_last_n in range, oldest first; a new sampler fed them penalizes the same. */
static void test_recent(void **st)
{
    (void)st;
    const int32_t *ids, *ids2;
    const float *pr, *pr2;
    struct kvs_sampler_params p = plain();
    p.repeat_penalty = 2.0f;
    p.repeat_last_n = 3;
    float l[4] = { 2.0f, -2.0f, 1.0f, 0.5f };
    struct kvs_sampler *s = make(&p, 4), *t = make(&p, 4);
    int32_t got[8];
    assert_int_equal(kvs_sampler_recent(s, got, 8), 0);
    const int32_t acc[] = { 3, 0, 99, 1, 2, 0 };
    for (size_t i = 0; i < sizeof acc / sizeof acc[0]; i++) kvs_sampler_accept(s, acc[i]);
    assert_int_equal(kvs_sampler_recent(s, got, 8), 3);
    assert_true(got[0] == 1 && got[1] == 2 && got[2] == 0);
    assert_int_equal(kvs_sampler_recent(s, got, 2), 3); /* count, only cap written */
    for (int32_t i = 0; i < 3; i++) kvs_sampler_accept(t, (const int32_t[]){ 1, 2, 0 }[i]);
    int32_t n = kvs_sampler_dist(s, l, &ids, &pr);
    float ps[4];
    int32_t is[4];
    for (int32_t i = 0; i < n; i++) ps[i] = pr[i], is[i] = ids[i];
    assert_int_equal(kvs_sampler_dist(t, l, &ids2, &pr2), n);
    for (int32_t i = 0; i < n; i++) assert_true(is[i] == ids2[i] && ps[i] == pr2[i]);
    p.repeat_penalty = 1.0f; /* penalty off: nothing remembered */
    struct kvs_sampler *u = make(&p, 4);
    kvs_sampler_accept(u, 1);
    assert_int_equal(kvs_sampler_recent(u, got, 8), 0);
    kvs_sampler_free(s);
    kvs_sampler_free(t);
    kvs_sampler_free(u);
}

static void test_penalty(void **st)
{
    (void)st;
    const int32_t *ids;
    const float *pr;
    struct kvs_sampler_params p = plain();
    p.repeat_penalty = 2.0f;
    p.repeat_last_n = 3;
    float l[4] = { 2.0f, -2.0f, 1.0f, 0.5f };
    struct kvs_sampler *s = make(&p, 4);
    /* no history: plain softmax of l, top is id 0 */
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 4);
    assert_int_equal(ids[0], 0);
    kvs_sampler_accept(s, 0);
    kvs_sampler_accept(s, 1);
    kvs_sampler_accept(s, 0); /* a repeat is penalized once: 2/2 = 1, not 0.5 */
    kvs_sampler_accept(s, 99); /* out of range: ignored */
    kvs_sampler_accept(s, -1);
    /* penalized logits {1, -4, 1, 0.5}: ties 0 and 2, then 3, then 1 */
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 4);
    double z = 2.0 * exp(1.0) + exp(0.5) + exp(-4.0);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 2);
    assert_int_equal(ids[2], 3);
    assert_int_equal(ids[3], 1);
    assert_float_equal(pr[0], exp(1.0) / z, 1e-6);
    assert_float_equal(pr[1], exp(1.0) / z, 1e-6);
    assert_float_equal(pr[2], exp(0.5) / z, 1e-6);
    assert_float_equal(pr[3], exp(-4.0) / z, 1e-6);
    /* the logits themselves are not modified */
    assert_true(l[0] == 2.0f && l[1] == -2.0f);
    /* window of 3: after 3 and 3, history is {0,3,3}: id 1 is free again */
    kvs_sampler_accept(s, 3);
    kvs_sampler_accept(s, 3);
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 4);
    /* logits {1, -2, 1, 0.25} */
    z = 2.0 * exp(1.0) + exp(0.25) + exp(-2.0);
    assert_int_equal(ids[2], 3);
    assert_float_equal(pr[2], exp(0.25) / z, 1e-6);
    assert_float_equal(pr[3], exp(-2.0) / z, 1e-6);
    /* greedy sees the penalty too: id 0 (2 -> 1) loses to... nobody above 1;
     * penalize 2 as well via reset + accept */
    kvs_sampler_reset(s);
    assert_int_equal(kvs_sampler_dist(s, l, &ids, &pr), 4);
    assert_float_equal(pr[0], exp(2.0) / (exp(2.0) + exp(-2.0) + exp(1.0) + exp(0.5)), 1e-6);
    kvs_sampler_free(s);

    p.temp = 0.0f;
    s = make(&p, 4);
    kvs_sampler_accept(s, 0);
    /* {1, -2, 1, 0.5}: tie -> lowest id 0 */
    assert_int_equal(kvs_sampler_sample(s, l), 0);
    kvs_sampler_accept(s, 2);
    /* {1, -2, 0.5, 0.5} */
    assert_int_equal(kvs_sampler_sample(s, l), 0);
    float l2[4] = { 3.0f, 2.0f, 1.0f, 0.0f };
    kvs_sampler_reset(s);
    kvs_sampler_accept(s, 0);
    /* {1.5, 2, 1, 0} */
    assert_int_equal(kvs_sampler_sample(s, l2), 1);
    kvs_sampler_free(s);

    /* a penalty < 1 boosts: {1, 2, -1} with 0.5 on id 0 -> {2, 2, -1}, a
     * tie won by the lower id (greedy and top-k 1); on id 2 -> -0.5 */
    float l3[3] = { 1.0f, 2.0f, -1.0f };
    p = plain();
    p.temp = 0.0f;
    p.repeat_penalty = 0.5f;
    p.repeat_last_n = 4;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_sample(s, l3), 1);
    kvs_sampler_accept(s, 0);
    assert_int_equal(kvs_sampler_sample(s, l3), 0);
    kvs_sampler_free(s);
    p.temp = 1.0f;
    p.top_k = 2;
    s = make(&p, 3);
    kvs_sampler_accept(s, 0);
    kvs_sampler_accept(s, 2);
    assert_int_equal(kvs_sampler_dist(s, l3, &ids, &pr), 2);
    assert_int_equal(ids[0], 0);
    assert_int_equal(ids[1], 1);
    assert_float_equal(pr[0], 0.5, 1e-6);
    p.top_k = 0;
    kvs_sampler_free(s);
    s = make(&p, 3);
    kvs_sampler_accept(s, 2);
    /* {1, 2, -0.5} */
    assert_int_equal(kvs_sampler_dist(s, l3, &ids, &pr), 3);
    assert_int_equal(ids[2], 2);
    assert_float_equal(pr[2], exp(-0.5) / (exp(1.0) + exp(2.0) + exp(-0.5)), 1e-6);
    kvs_sampler_free(s);
}

static void draws(struct kvs_sampler *s, const float *l, int32_t *out, int n)
{
    for (int i = 0; i < n; i++) {
        out[i] = kvs_sampler_sample(s, l);
        kvs_sampler_accept(s, out[i]);
    }
}

static void test_seeds(void **st)
{
    (void)st;
    enum { N = 2000, NV = 64 };
    float l[NV];
    fill_logits(l, NV, 7);
    for (int i = 0; i < NV; i++)
        l[i] *= 0.3f; /* a flat-ish distribution: lots of entropy */
    struct kvs_sampler_params p = plain();
    p.seed = 1234;
    struct kvs_sampler *a = make(&p, NV), *b = make(&p, NV);
    p.seed = 1235;
    struct kvs_sampler *c = make(&p, NV);
    static int32_t ra[N], rb[N], rc[N];
    draws(a, l, ra, N);
    draws(b, l, rb, N);
    draws(c, l, rc, N);
    assert_memory_equal(ra, rb, sizeof ra);
    int differ = 0;
    for (int i = 0; i < N; i++)
        differ += ra[i] != rc[i];
    assert_true(differ > N / 2);
    /* reset repeats the sequence */
    kvs_sampler_reset(a);
    draws(a, l, rb, N);
    assert_memory_equal(ra, rb, sizeof ra);
    /* the sequence is not constant */
    int changes = 0;
    for (int i = 1; i < N; i++)
        changes += ra[i] != ra[i - 1];
    assert_true(changes > N / 2);
    kvs_sampler_free(a);
    kvs_sampler_free(b);
    kvs_sampler_free(c);
}

/* kvs_sampler_uniform against values computed by a separate Python
 * transcription of the formula in sampler.h (not by this code):
 * (seed, pos) -> bits: (0,0) 0xa706dd2f4d197e6f, (0,1) 0xb382a305f4414f5e,
 * (42,0) 0x57e1faba65107204, (42,7) 0xbc16a3d4cc48678e,
 * (12345678901234567,1000) 0x66602892aae9c424, (2^63-1, 2^32) 0xe741e7c69966a681. */
static void test_uniform_vectors(void **st)
{
    (void)st;
    static const struct { uint64_t seed, pos, bits; } v[] = {
        { 0, 0, 0xa706dd2f4d197e6fULL },           { 0, 1, 0xb382a305f4414f5eULL },
        { 42, 0, 0x57e1faba65107204ULL },          { 42, 7, 0xbc16a3d4cc48678eULL },
        { 12345678901234567ULL, 1000, 0x66602892aae9c424ULL },
        { 0x7fffffffffffffffULL, 1ULL << 32, 0xe741e7c69966a681ULL },
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        double want = (double)(v[i].bits >> 11) * 0x1.0p-53;
        assert_true(kvs_sampler_uniform(v[i].seed, v[i].pos) == want);
    }
    assert_true(kvs_sampler_uniform(0, 0) == 0.6524484863740322);
    assert_true(kvs_sampler_uniform(42, 7) == 0.7347204584623639);
}

/* The draws over {1,2,4}/7 are pinned: the candidates walk the rank order
 * (ids 2, 1, 0 with cumulative 4/7, 6/7, 1 = 0.571, 0.857, 1). Seed 0 gives
 * u = 0.65245 (pos 0) -> id 1, 0.70121 (pos 1) -> id 1; seed 42 pos 0 gives
 * 0.34329 -> id 2; seed 42 pos 7 gives 0.73472 -> id 1. */
static void test_rng_pinned(void **st)
{
    (void)st;
    struct kvs_sampler_params p = plain();
    p.seed = 0;
    struct kvs_sampler *s = make(&p, 3);
    assert_int_equal(kvs_sampler_sample(s, L3), 1);
    assert_int_equal(kvs_sampler_sample(s, L3), 1); /* nothing accepted: still position 0 */
    kvs_sampler_accept(s, 1);
    assert_int_equal(kvs_sampler_sample_at(s, L3, 1), 1);
    kvs_sampler_free(s);
    p.seed = 42;
    s = make(&p, 3);
    assert_int_equal(kvs_sampler_sample(s, L3), 2);
    assert_int_equal(kvs_sampler_sample_at(s, L3, 7), 1);
    kvs_sampler_free(s);
}

/* Same seed + same position -> same draw, whatever came before: a sampler
 * that accepted k tokens draws what a fresh one draws at position k (a
 * replay on another tail), and a reset one starts over. */
static void test_position_draws(void **st)
{
    (void)st;
    enum { N = 500, NV = 64 };
    float l[NV];
    fill_logits(l, NV, 7);
    for (int i = 0; i < NV; i++)
        l[i] *= 0.3f;
    struct kvs_sampler_params p = plain();
    p.seed = 99;
    struct kvs_sampler *a = make(&p, NV), *b = make(&p, NV);
    static int32_t ra[N];
    for (int i = 0; i < N; i++) {
        ra[i] = kvs_sampler_sample(a, l);
        kvs_sampler_accept(a, ra[i]);
    }
    int changes = 0;
    for (int i = N - 1; i >= 0; i--) /* b draws the positions in another order */
        assert_int_equal(kvs_sampler_sample_at(b, l, (uint64_t)i), ra[i]);
    for (int i = 1; i < N; i++)
        changes += ra[i] != ra[i - 1];
    assert_true(changes > N / 2);
    kvs_sampler_reset(a);
    for (int i = 0; i < 10; i++) {
        assert_int_equal(kvs_sampler_sample(a, l), ra[i]);
        kvs_sampler_accept(a, ra[i]);
    }
    kvs_sampler_free(a);
    kvs_sampler_free(b);
}

static void test_frequencies(void **st)
{
    (void)st;
    enum { N = 20000 };
    struct kvs_sampler_params p = plain();
    p.seed = 42;
    struct kvs_sampler *s = make(&p, 3);
    int cnt[3] = { 0 };
    for (int i = 0; i < N; i++) {
        int32_t id = kvs_sampler_sample_at(s, L3, (uint64_t)i);
        assert_true(id >= 0 && id < 3);
        cnt[id]++;
    }
    assert_float_equal(cnt[0] / (double)N, 1.0 / 7.0, 0.02);
    assert_float_equal(cnt[1] / (double)N, 2.0 / 7.0, 0.02);
    assert_float_equal(cnt[2] / (double)N, 4.0 / 7.0, 0.02);
    kvs_sampler_free(s);

    /* with top-k 2 and temperature 0.5: {16, 4}/20 */
    p.top_k = 2;
    p.temp = 0.5f;
    s = make(&p, 3);
    memset(cnt, 0, sizeof cnt);
    for (int i = 0; i < N; i++)
        cnt[kvs_sampler_sample_at(s, L3, (uint64_t)i)]++;
    assert_int_equal(cnt[0], 0);
    assert_float_equal(cnt[1] / (double)N, 0.2, 0.02);
    assert_float_equal(cnt[2] / (double)N, 0.8, 0.02);
    kvs_sampler_free(s);
}

/* Full-vocabulary path (top-k off) with top-p and min-p: the kept set must
 * be a prefix of the ranked order whose mass just reaches top_p (checked
 * against the definition in double precision). */
static void test_full_vocab_filters(void **st)
{
    (void)st;
    enum { NV = 151936 };
    float *l = malloc(NV * sizeof *l);
    assert_non_null(l);
    fill_logits(l, NV, 3);
    for (int32_t i = 0; i < NV; i++)
        l[i] *= 1.2f; /* range [-12, 12] */
    struct kvs_sampler_params p = plain();
    p.top_p = 0.9f;
    p.min_p = 0.0f;
    struct kvs_sampler *s = make(&p, NV);
    const int32_t *ids;
    const float *pr;
    int32_t n = kvs_sampler_dist(s, l, &ids, &pr);
    /* reference: mass in double */
    float mx = l[0];
    for (int32_t i = 1; i < NV; i++)
        if (l[i] > mx)
            mx = l[i];
    double total = 0.0;
    for (int32_t i = 0; i < NV; i++)
        total += exp((double)l[i] - mx);
    double kept = 0.0;
    for (int32_t j = 0; j < n; j++) {
        kept += exp((double)l[ids[j]] - mx);
        if (j > 0)
            assert_true(l[ids[j]] <= l[ids[j - 1]]);
    }
    double last = exp((double)l[ids[n - 1]] - mx);
    assert_true(kept / total >= 0.9 - 1e-4);
    assert_true((kept - last) / total < 0.9 + 1e-4);
    double sum = 0.0;
    for (int32_t j = 0; j < n; j++)
        sum += pr[j];
    assert_float_equal(sum, 1.0, 1e-4);
    /* every draw lands inside the kept set */
    for (int k = 0; k < 20; k++) {
        int32_t id = kvs_sampler_sample_at(s, l, (uint64_t)k);
        assert_true(exp((double)l[id] - mx) >= last * (1 - 1e-5));
    }
    kvs_sampler_free(s);

    /* min-p 0.01 (logit within ln 100 = 4.605 of the max) */
    p.top_p = 1.0f;
    p.min_p = 0.01f;
    s = make(&p, NV);
    n = kvs_sampler_dist(s, l, &ids, &pr);
    int32_t want = 0;
    for (int32_t i = 0; i < NV; i++)
        want += exp((double)l[i] - mx) >= 0.01 * (1 + 1e-6);
    assert_true(n >= want && n <= want + 2);
    for (int32_t j = 0; j < n; j++)
        assert_true((double)l[ids[j]] - mx >= log(0.01) - 1e-4);
    for (int k = 0; k < 20; k++) {
        int32_t id = kvs_sampler_sample_at(s, l, (uint64_t)k);
        assert_true((double)l[id] - mx >= log(0.01) - 1e-4);
    }
    kvs_sampler_free(s);
    free(l);
}

/* sample() keeps candidates in id order when nothing needs sorting, dist()
 * sorts them: both must describe the same distribution. 20000 draws with
 * min-p 0.05 over 1000 logits, each candidate's frequency within 0.02 of
 * its dist() probability (one standard deviation is at most 0.0035). */
static void test_sample_matches_dist(void **st)
{
    (void)st;
    enum { NV = 1000, N = 20000 };
    static float l[NV];
    static int cnt[NV];
    fill_logits(l, NV, 11);
    for (int i = 0; i < NV; i++)
        l[i] *= 0.5f; /* [-5, 5]: min-p 0.05 keeps logits within ln 20 = 3.0 of the max */
    struct kvs_sampler_params p = plain();
    p.min_p = 0.05f;
    p.seed = 77;
    struct kvs_sampler *s = make(&p, NV);
    for (int i = 0; i < N; i++)
        cnt[kvs_sampler_sample_at(s, l, (uint64_t)i)]++;
    const int32_t *ids;
    const float *pr;
    int32_t n = kvs_sampler_dist(s, l, &ids, &pr);
    assert_true(n > 20 && n < NV);
    int seen = 0;
    for (int32_t j = 0; j < n; j++) {
        assert_float_equal(cnt[ids[j]] / (double)N, pr[j], 0.02);
        seen += cnt[ids[j]];
    }
    assert_int_equal(seen, N); /* nothing outside the kept set was drawn */
    kvs_sampler_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_create_errors),
        cmocka_unit_test(test_greedy),
        cmocka_unit_test(test_softmax_hand),
        cmocka_unit_test(test_top_k),
        cmocka_unit_test(test_top_k_ties),
        cmocka_unit_test(test_top_p),
        cmocka_unit_test(test_min_p),
        cmocka_unit_test(test_top_p_then_min_p),
        cmocka_unit_test(test_penalty),
        cmocka_unit_test(test_recent),
        cmocka_unit_test(test_seeds),
        cmocka_unit_test(test_uniform_vectors),
        cmocka_unit_test(test_rng_pinned),
        cmocka_unit_test(test_position_draws),
        cmocka_unit_test(test_frequencies),
        cmocka_unit_test(test_full_vocab_filters),
        cmocka_unit_test(test_sample_matches_dist),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

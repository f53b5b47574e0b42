/* Gated DeltaNet kernels: every ISA path against the scalar reference, and
 * the reference against the equations of ../shared/docs/qwen35-facts.md
 * §3.2 (computed here in double). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/rng.h"
#include "kernels/kernels.h"

static double kvs_rng_uniform(struct kvs_rng *r) { return (double)(kvs_rng_next(r) >> 11) * 0x1.0p-53; }

static void fill(struct kvs_rng *r, float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++) x[i] = lo + (hi - lo) * (float)kvs_rng_uniform(r);
}

static double max_rel(const float *a, const float *b, size_t n)
{
    double scale = 1e-6, d = 0.0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs((double)b[i]));
    for (size_t i = 0; i < n; i++) d = fmax(d, fabs((double)a[i] - (double)b[i]));
    return d / scale;
}

static void l2(float *x, int64_t n)
{
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    for (int64_t i = 0; i < n; i++) x[i] = (float)(x[i] / sqrt(s));
}

/* The reference delta rule against the recurrence in double over 20
 * tokens, and every ISA against the reference (state and outputs). */
static void test_delta_rule(void **st)
{
    (void)st;
    static const int64_t dims[] = { 8, 32, 48, 64, 128 };
    struct kvs_rng r;
    kvs_rng_seed(&r, 15);
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int64_t d = dims[di];
        float *S = calloc((size_t)(d * d), sizeof(float)), *Sr = calloc((size_t)(d * d), sizeof(float));
        double *Sd = calloc((size_t)(d * d), sizeof(double));
        float q[128], k[128], v[128], o[128], o_ref[128];
        assert_true(S && Sr && Sd);
        const float scale = 1.0f / sqrtf((float)d);
        double worst_exact = 0.0;
        for (int t = 0; t < 20; t++) {
            fill(&r, q, (size_t)d, -1, 1);
            fill(&r, k, (size_t)d, -1, 1);
            fill(&r, v, (size_t)d, -2, 2);
            l2(q, d);
            l2(k, d);
            const float g = -0.5f * (float)kvs_rng_uniform(&r), beta = (float)kvs_rng_uniform(&r);
            kvs_ref_ssm_delta_step(Sr, q, k, v, expf(g), beta, scale, o_ref, d);
            /* the equations in double */
            double od[128];
            for (int64_t j = 0; j < d; j++) {
                double kv = 0.0;
                for (int64_t i = 0; i < d; i++) {
                    Sd[j * d + i] *= exp((double)g);
                    kv += Sd[j * d + i] * k[i];
                }
                const double delta = beta * (v[j] - kv);
                double acc = 0.0;
                for (int64_t i = 0; i < d; i++) {
                    Sd[j * d + i] += k[i] * delta;
                    acc += Sd[j * d + i] * q[i];
                }
                od[j] = acc * scale;
            }
            double mo = 1e-6, e = 0.0;
            for (int64_t j = 0; j < d; j++) mo = fmax(mo, fabs(od[j]));
            for (int64_t j = 0; j < d; j++) e = fmax(e, fabs(od[j] - o_ref[j]) / mo);
            worst_exact = fmax(worst_exact, e);
        }
        assert_true(worst_exact < 1e-5);
        for (int isa = KVS_ISA_AVX2; isa <= KVS_ISA_NEON; isa++) {
            const struct kvs_kernels *kk = kvs_kernels_get((enum kvs_isa)isa);
            if (!kk) continue;
            memset(S, 0, (size_t)(d * d) * sizeof(float));
            memset(Sr, 0, (size_t)(d * d) * sizeof(float));
            double worst = 0.0;
            for (int t = 0; t < 20; t++) {
                fill(&r, q, (size_t)d, -1, 1);
                fill(&r, k, (size_t)d, -1, 1);
                fill(&r, v, (size_t)d, -2, 2);
                l2(q, d);
                l2(k, d);
                const float decay = expf(-0.5f * (float)kvs_rng_uniform(&r)), beta = (float)kvs_rng_uniform(&r);
                kvs_ref_ssm_delta_step(Sr, q, k, v, decay, beta, scale, o_ref, d);
                kvs_ssm_delta_step(kk, S, q, k, v, decay, beta, scale, o, d);
                worst = fmax(worst, max_rel(o, o_ref, (size_t)d));
                worst = fmax(worst, max_rel(S, Sr, (size_t)(d * d)));
            }
            printf("delta rule d=%-3lld %-7s max rel diff vs scalar %.3g (scalar vs double %.3g)\n", (long long)d,
                   kvs_isa_name((enum kvs_isa)isa), worst, worst_exact);
            assert_true(worst < 1e-5);
        }
        free(S);
        free(Sr);
        free(Sd);
    }
}

/* Conv: the reference against the formula (state = the last K-1 inputs),
 * and every ISA over channel ranges with a ragged tail. */
static void test_conv(void **st)
{
    (void)st;
    enum { C = 389, T = 7 };
    struct kvs_rng r;
    kvs_rng_seed(&r, 16);
    for (int K = 2; K <= 5; K++) {
        float wt[5 * C], x[T][C], y[C], y_ref[C];
        float *state = calloc((size_t)(K - 1) * C, sizeof(float)), *state_ref = calloc((size_t)(K - 1) * C, sizeof(float));
        assert_true(state && state_ref);
        fill(&r, wt, (size_t)K * C, -1, 1);
        for (int t = 0; t < T; t++) fill(&r, x[t], C, -2, 2);
        for (int t = 0; t < T; t++) {
            kvs_ref_ssm_conv_step(state_ref, wt, x[t], y_ref, 0, C, C, K);
            for (int c = 0; c < C; c += 61) { /* u = sum_i w[i] x[t-(K-1)+i], then silu */
                double u = 0.0;
                for (int i = 0; i < K; i++) {
                    const int s = t - (K - 1) + i;
                    if (s >= 0) u += (double)wt[i * C + c] * x[s][c];
                }
                const double want = u / (1.0 + exp(-u));
                assert_true(fabs(want - y_ref[c]) <= 1e-5 * (1.0 + fabs(want)));
            }
        }
        for (int isa = KVS_ISA_AVX2; isa <= KVS_ISA_NEON; isa++) {
            const struct kvs_kernels *kk = kvs_kernels_get((enum kvs_isa)isa);
            if (!kk) continue;
            memset(state, 0, (size_t)(K - 1) * C * sizeof(float));
            memset(state_ref, 0, (size_t)(K - 1) * C * sizeof(float));
            double worst = 0.0;
            for (int t = 0; t < T; t++) {
                kvs_ref_ssm_conv_step(state_ref, wt, x[t], y_ref, 0, C, C, K);
                kvs_ssm_conv_step(kk, state, wt, x[t], y, 0, 160, C, K); /* two ranges, as threads split */
                kvs_ssm_conv_step(kk, state, wt, x[t], y, 160, C, C, K);
                worst = fmax(worst, max_rel(y, y_ref, C));
                assert_memory_equal(state, state_ref, (size_t)(K - 1) * C * sizeof(float)); /* inputs only */
            }
            printf("conv K=%d C=%d %-7s max rel diff vs scalar %.3g\n", K, C, kvs_isa_name((enum kvs_isa)isa), worst);
            assert_true(worst < 1e-5);
        }
        free(state);
        free(state_ref);
    }
}

/* Gated RMSNorm: the reference against the formula, every ISA against it. */
static void test_gated_norm(void **st)
{
    (void)st;
    static const int64_t dims[] = { 16, 32, 40, 64, 128 };
    struct kvs_rng r;
    kvs_rng_seed(&r, 17);
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int64_t d = dims[di];
        float o[128] = { 0 }, o2[128] = { 0 }, z[128] = { 0 }, w[128] = { 0 };
        fill(&r, o, (size_t)d, -3, 3);
        fill(&r, z, (size_t)d, -4, 4);
        fill(&r, w, (size_t)d, 0.5f, 1.5f);
        memcpy(o2, o, sizeof o);
        kvs_ref_ssm_gated_norm(o2, z, w, d, 1e-6f);
        double ss = 0.0;
        for (int64_t i = 0; i < d; i++) ss += (double)o[i] * o[i];
        for (int64_t i = 0; i < d; i++) {
            const double want = o[i] / sqrt(ss / (double)d + 1e-6) * w[i] * (z[i] / (1.0 + exp(-(double)z[i])));
            assert_true(fabs(want - o2[i]) <= 1e-5 * (1.0 + fabs(want)));
        }
        for (int isa = KVS_ISA_AVX2; isa <= KVS_ISA_NEON; isa++) {
            const struct kvs_kernels *kk = kvs_kernels_get((enum kvs_isa)isa);
            if (!kk) continue;
            float o3[128];
            memcpy(o3, o, sizeof o);
            kvs_ssm_gated_norm(kk, o3, z, w, d, 1e-6f);
            const double dd = max_rel(o3, o2, (size_t)d);
            printf("gated norm d=%-3lld %-7s max rel diff vs scalar %.3g\n", (long long)d, kvs_isa_name((enum kvs_isa)isa), dd);
            assert_true(dd < 1e-5);
        }
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_delta_rule),
        cmocka_unit_test(test_conv),
        cmocka_unit_test(test_gated_norm),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

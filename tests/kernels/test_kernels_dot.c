/* Dot products and matmul: every weight type's vec_dot equals the float dot
 * of the dequantized weights with the dequantized activations; every SIMD
 * table agrees with the scalar reference (activation quantization bit for
 * bit, dot products within a float-reordering tolerance); matmul over pools
 * of 1, 2 and 3 threads equals row-by-row scalar dots. Random data from a
 * fixed-seed generator. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kernels.h"
#include "kernels/kernels_impl.h" /* white box: the ISA tables (test_simd_coverage) */

/* Float combination order differs between ISAs (SIMD lanes, FMA); relative to
 * sum |w_i * a_i| the difference stays far below this. */
#define TOL_REORDER 2e-5
/* vec_dot vs a double-precision float dot of dequantized values: the only
 * differences are f32 rounding of per-block scale products. */
#define TOL_FLOAT_DOT 1e-5

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;

static uint32_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)(rng_state >> 16);
}

static float rndf(float lo, float hi)
{
    return lo + (hi - lo) * (float)(rnd() & 0xFFFFFF) / (float)0x1000000;
}

static const enum kvs_type weight_types[] = {
    KVS_TYPE_F32,  KVS_TYPE_F16,  KVS_TYPE_BF16, KVS_TYPE_Q4_0, KVS_TYPE_Q4_1,
    KVS_TYPE_Q5_0, KVS_TYPE_Q5_1, KVS_TYPE_Q8_0, KVS_TYPE_Q2_K, KVS_TYPE_Q3_K,
    KVS_TYPE_Q4_K, KVS_TYPE_Q5_K, KVS_TYPE_Q6_K,
};
#define N_WTYPES (sizeof weight_types / sizeof weight_types[0])

static void set16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

/* Random weights of type t, n elements: random bytes with sane f16 scales
 * (block layouts: gguf-facts §2.3/§2.4). */
static void random_weights(enum kvs_type t, uint8_t *dst, int64_t n)
{
    size_t bytes = kvs_type_row_bytes(t, n);
    uint32_t e, bb;
    kvs_type_block(t, &e, &bb);
    if (t == KVS_TYPE_F32) {
        float *f = (float *)dst;
        for (int64_t i = 0; i < n; i++)
            f[i] = rndf(-1.0f, 1.0f);
        return;
    }
    if (t == KVS_TYPE_F16 || t == KVS_TYPE_BF16) {
        for (int64_t i = 0; i < n; i++) {
            float v = rndf(-1.0f, 1.0f);
            set16(dst + 2 * i, t == KVS_TYPE_F16 ? kvs_f32_to_f16(v) : kvs_f32_to_bf16(v));
        }
        return;
    }
    for (size_t i = 0; i < bytes; i++)
        dst[i] = (uint8_t)rnd();
    int d_off[2] = {-1, -1};
    switch (t) {
    case KVS_TYPE_Q4_0: case KVS_TYPE_Q5_0: case KVS_TYPE_Q8_0: d_off[0] = 0; break;
    case KVS_TYPE_Q4_1: case KVS_TYPE_Q5_1: case KVS_TYPE_Q4_K: case KVS_TYPE_Q5_K:
        d_off[0] = 0, d_off[1] = 2; break;
    case KVS_TYPE_Q2_K: d_off[0] = 80, d_off[1] = 82; break;
    case KVS_TYPE_Q3_K: d_off[0] = 108; break;
    case KVS_TYPE_Q6_K: d_off[0] = 208; break;
    default: fail();
    }
    for (int64_t b = 0; b < n / e; b++)
        for (int k = 0; k < 2; k++)
            if (d_off[k] >= 0)
                set16(dst + b * bb + d_off[k], kvs_f32_to_f16(rndf(0.001f, 0.05f) * (rnd() & 1 ? 1 : -1)));
}

static void random_acts(float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        x[i] = rndf(-2.0f, 2.0f);
    x[rnd() % n] = 0.0f;
    if (n >= 64) {
        for (int i = 0; i < 32; i++) /* one all-zero block */
            x[i] = 0.0f;
        x[40] = 3.5f; /* ties of the x86 rule when this is the block max... */
        x[41] = -3.5f;
    }
}

/* 32 and 288 (odd block counts) apply to 32-element block types only. */
static const int64_t lengths[] = {32, 288, 256, 512, 1280, 4096};

static void test_vec_dot_vs_float(void **state)
{
    (void)state;
    const struct kvs_kernels *k = kvs_kernels_get(KVS_ISA_SCALAR);
    for (size_t ti = 0; ti < N_WTYPES; ti++) {
        enum kvs_type t = weight_types[ti], vt = kvs_vec_dot_type(t);
        for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
            int64_t n = lengths[li];
            if (kvs_type_row_bytes(t, n) == 0)
                continue;
            uint8_t *w = malloc(kvs_type_row_bytes(t, n));
            uint8_t *a = malloc(kvs_type_row_bytes(vt, n));
            float *x = malloc((size_t)n * 4), *wf = malloc((size_t)n * 4), *af = malloc((size_t)n * 4);
            random_weights(t, w, n);
            random_acts(x, n);
            kvs_quantize_act(k, vt, x, a, n);
            kvs_dequantize_row(k, t, w, wf, n);
            kvs_dequantize_row(k, vt, a, af, n);
            double ref = 0.0, mag = 0.0;
            for (int64_t i = 0; i < n; i++) {
                ref += (double)wf[i] * af[i];
                mag += fabs((double)wf[i] * af[i]);
            }
            double tol = TOL_FLOAT_DOT * mag + 1e-30;
            if (vt == KVS_TYPE_Q8_1) {
                /* The m*s term uses s = f16(d * sum q) (gguf-facts §2.5): allow its f16
                 * rounding, half an ulp (2^-11 relative) of |m * s| per block. */
                uint32_t be, bb;
                kvs_type_block(t, &be, &bb);
                for (int64_t b = 0; b < n / 32; b++) {
                    double sa = 0.0;
                    for (int j = 0; j < 32; j++)
                        sa += af[32 * b + j];
                    uint16_t m = (uint16_t)(w[b * bb + 2] | w[b * bb + 3] << 8);
                    tol += fabs(kvs_f16_to_f32(m) * sa) * 0x1p-11;
                }
            }
            float got = kvs_vec_dot(k, t, n, w, a);
            if (fabs(got - ref) > tol) {
                print_error("%s n=%lld: vec_dot %.9g float dot %.9g (mag %.3g)\n", kvs_type_name(t),
                            (long long)n, got, ref, mag);
                fail();
            }
            /* activation dequantized is close to the input (quantization error bound) */
            for (int64_t i = 0; i < n; i++)
                assert_true(fabsf(af[i] - x[i]) <= 2.0f / 127.0f * 2.0f + 1e-6f);
            free(w), free(a), free(x), free(wf), free(af);
        }
    }
}

static void test_simd_vs_scalar(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    static const enum kvs_isa isas[] = {KVS_ISA_AVX2, KVS_ISA_AVX512, KVS_ISA_NEON};
    for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
        const struct kvs_kernels *k = kvs_kernels_get(isas[ii]);
        if (!k)
            continue;
        print_message("comparing %s with scalar\n", kvs_isa_name(isas[ii]));
        for (size_t ti = 0; ti < N_WTYPES; ti++) {
            enum kvs_type t = weight_types[ti], vt = kvs_vec_dot_type(t);
            for (size_t li = 0; li < sizeof lengths / sizeof lengths[0]; li++) {
                int64_t n = lengths[li];
                if (kvs_type_row_bytes(t, n) == 0)
                    continue;
                size_t wb = kvs_type_row_bytes(t, n), ab = kvs_type_row_bytes(vt, n);
                uint8_t *w = malloc(wb), *a = malloc(ab), *a2 = malloc(ab);
                float *x = malloc((size_t)n * 4), *d1 = malloc((size_t)n * 4), *d2 = malloc((size_t)n * 4);
                random_weights(t, w, n);
                random_acts(x, n);
                /* activation quantization: identical bytes */
                kvs_quantize_act(ref, vt, x, a, n);
                kvs_quantize_act(k, vt, x, a2, n);
                if (memcmp(a, a2, ab) != 0) {
                    print_error("%s: quantize %s differs from scalar (n=%lld)\n", kvs_isa_name(isas[ii]),
                                kvs_type_name(vt), (long long)n);
                    fail();
                }
                /* dequantization: same values up to FMA contraction */
                kvs_dequantize_row(ref, t, w, d1, n);
                kvs_dequantize_row(k, t, w, d2, n);
                for (int64_t i = 0; i < n; i++) {
                    if (fabsf(d1[i] - d2[i]) > 1e-6f * fabsf(d1[i]) + 1e-30f) {
                        print_error("%s dequant %s [%lld]: %.9g vs %.9g\n", kvs_isa_name(isas[ii]),
                                    kvs_type_name(t), (long long)i, d2[i], d1[i]);
                        fail();
                    }
                }
                double mag = 0.0;
                float *af = malloc((size_t)n * 4);
                kvs_dequantize_row(ref, vt, a, af, n);
                for (int64_t i = 0; i < n; i++)
                    mag += fabs((double)d1[i] * af[i]);
                free(af);
                float r = kvs_vec_dot(ref, t, n, w, a), s = kvs_vec_dot(k, t, n, w, a);
                if (fabs((double)r - s) > TOL_REORDER * mag + 1e-30) {
                    print_error("%s vec_dot %s n=%lld: %.9g vs scalar %.9g (mag %.3g)\n",
                                kvs_isa_name(isas[ii]), kvs_type_name(t), (long long)n, s, r, mag);
                    fail();
                }
                free(w), free(a), free(a2), free(x), free(d1), free(d2);
            }
        }
    }
}

/* Activation quantizers on adversarial inputs: exact ties at mult = 1. */
static void test_simd_quant_ties(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    float x[512];
    for (int i = 0; i < 512; i++)
        x[i] = (float)((i % 254) - 127) + ((i & 1) ? 0.5f : 0.0f);
    x[0] = 127.0f;
    x[256] = -127.0f;
    static const enum kvs_isa isas[] = {KVS_ISA_AVX2, KVS_ISA_AVX512, KVS_ISA_NEON};
    static const enum kvs_type acts[] = {KVS_TYPE_Q8_0, KVS_TYPE_Q8_1, KVS_TYPE_Q8_K, KVS_TYPE_F16,
                                         KVS_TYPE_BF16};
    for (size_t ii = 0; ii < 3; ii++) {
        const struct kvs_kernels *k = kvs_kernels_get(isas[ii]);
        if (!k)
            continue;
        for (size_t ai = 0; ai < sizeof acts / sizeof acts[0]; ai++) {
            uint8_t q1[1024], q2[1024];
            size_t nb = kvs_type_row_bytes(acts[ai], 512);
            kvs_quantize_act(ref, acts[ai], x, q1, 512);
            kvs_quantize_act(k, acts[ai], x, q2, 512);
            assert_memory_equal(q1, q2, nb);
        }
    }
}

/* F16 / BF16 conversion of activations on the bit patterns where rounding
 * rules differ: exact ties with an even and an odd kept bit, just past a
 * tie, NaNs (signaling and quiet, both signs), infinities, -0, subnormals
 * of F32 and of F16, the largest finite values and the overflow to
 * infinity. Each pattern sits in every lane position of a vector and of the
 * scalar tail (n = 48 + 5); SIMD must give the reference's bytes. */
static void test_simd_f16_bf16_special(void **state)
{
    (void)state;
    static const uint32_t pat[] = {
        0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F817FFFu, 0xBF808000u, 0xBF818000u, /* BF16 ties */
        0x3F801000u, 0x3F803000u, 0x3F801001u, 0xBF803000u,                           /* F16 ties (13 bits) */
        0x7F800001u, 0x7FC00000u, 0xFF800001u, 0xFFC00001u, 0x7FFFFFFFu,               /* NaNs */
        0x7F800000u, 0xFF800000u, 0x80000000u, 0x00000000u,                           /* inf, -0, 0 */
        0x00008000u, 0x00018000u, 0x807FFFFFu, 0x00000001u,                           /* F32 subnormals */
        0x33800000u, 0x33000000u, 0x33C00000u, 0x387FC000u, 0xB3800001u,               /* F16 subnormal edge */
        0x7F7FFFFFu, 0x7F7F8000u, 0x477FE000u, 0x477FF000u, 0x477FEFFFu, 0xC77FF000u,   /* max / overflow */
    };
    const int64_t n = 53;
    static const enum kvs_isa isas[] = {KVS_ISA_AVX2, KVS_ISA_AVX512, KVS_ISA_NEON};
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    static const enum kvs_type acts[] = {KVS_TYPE_F16, KVS_TYPE_BF16};
    for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
        const struct kvs_kernels *k = kvs_kernels_get(isas[ii]);
        if (!k)
            continue;
        for (size_t ai = 0; ai < 2; ai++) {
            for (size_t pi = 0; pi < sizeof pat / sizeof pat[0]; pi++) {
                float x[53];
                uint16_t q1[53], q2[53];
                for (int64_t i = 0; i < n; i++) {
                    uint32_t u = pat[(pi + (size_t)i) % (sizeof pat / sizeof pat[0])];
                    memcpy(&x[i], &u, 4);
                }
                kvs_quantize_act(ref, acts[ai], x, q1, n);
                kvs_quantize_act(k, acts[ai], x, q2, n);
                for (int64_t i = 0; i < n; i++) {
                    if (q1[i] != q2[i]) {
                        uint32_t u;
                        memcpy(&u, &x[i], 4);
                        print_error("%s %s of 0x%08x [%lld]: 0x%04x vs scalar 0x%04x\n", kvs_isa_name(isas[ii]),
                                    kvs_type_name(acts[ai]), u, (long long)i, q2[i], q1[i]);
                        fail();
                    }
                }
            }
        }
    }
}

/* The SIMD tables (AVX2, AVX-512, NEON) have a kernel of their own for every
 * weight type's dot (test_simd_vs_scalar would otherwise compare the
 * reference with itself). */
static void test_simd_coverage(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    static const enum kvs_isa isas[] = {KVS_ISA_AVX2, KVS_ISA_AVX512, KVS_ISA_NEON};
    for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
        const struct kvs_kernels *k = kvs_kernels_get(isas[ii]);
        if (!k)
            continue;
        for (size_t ti = 0; ti < N_WTYPES; ti++) {
            enum kvs_type t = weight_types[ti];
            if (k->dot[t] == ref->dot[t]) {
                print_error("%s has no vec_dot of its own for %s\n", kvs_isa_name(isas[ii]), kvs_type_name(t));
                fail();
            }
        }
        /* activation formats: all of them on x86; NEON has its own Q8_0 only */
        static const enum kvs_type acts[] = {KVS_TYPE_Q8_0, KVS_TYPE_Q8_1, KVS_TYPE_Q8_K, KVS_TYPE_F16,
                                             KVS_TYPE_BF16};
        for (size_t ai = 0; ai < (isas[ii] == KVS_ISA_NEON ? 1 : sizeof acts / sizeof acts[0]); ai++)
            assert_true(k->quant_act[acts[ai]] != ref->quant_act[acts[ai]]);
    }
}

static void test_matmul_threads(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    const struct kvs_kernels *best = kvs_kernels_best();
    static const enum kvs_type types[] = {KVS_TYPE_Q8_0, KVS_TYPE_Q4_0, KVS_TYPE_Q4_K, KVS_TYPE_Q6_K,
                                          KVS_TYPE_Q5_K, KVS_TYPE_F16, KVS_TYPE_F32, KVS_TYPE_Q4_1};
    const int64_t N = 37;
    for (int nt = 1; nt <= 3; nt++) {
        struct kvs_pool *pool = NULL;
        assert_int_equal(kvs_pool_create(nt, &pool), KVS_OK);
        assert_int_equal(kvs_pool_n_threads(pool), nt);
        for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
            enum kvs_type t = types[ti], vt = kvs_vec_dot_type(t);
            const int64_t K = kvs_type_row_bytes(t, 352) ? 352 : 512; /* 11 blocks of 32 */
            size_t rb = kvs_type_row_bytes(t, K);
            uint8_t *w = malloc(rb * N);
            for (int64_t r = 0; r < N; r++)
                random_weights(t, w + r * rb, K);
            struct kvs_matrix W = {.type = t, .ne0 = K, .ne1 = N, .row_bytes = rb, .data = w};
            static const int64_t toks[] = {1, 3, 8, 13};
            for (size_t k = 0; k < 4; k++) {
                int64_t T = toks[k];
                float *x = malloc((size_t)(T * K) * 4), *y = malloc((size_t)(T * N) * 4);
                void *scratch = malloc(kvs_matmul_scratch_bytes(t, K, T) + 1);
                uint8_t *a = malloc(kvs_type_row_bytes(vt, K));
                random_acts(x, T * K);
                kvs_matmul(best, pool, &W, x, T, y, scratch);
                for (int64_t tt = 0; tt < T; tt++) {
                    kvs_quantize_act(ref, vt, x + tt * K, a, K);
                    for (int64_t r = 0; r < N; r++) {
                        float want = kvs_vec_dot(ref, t, K, w + r * rb, a);
                        float got = y[tt * N + r];
                        if (fabsf(got - want) > 1e-4f * (fabsf(want) + 1.0f)) {
                            print_error("matmul %s threads=%d T=%lld row %lld tok %lld: %.9g vs %.9g\n",
                                        kvs_type_name(t), nt, (long long)T, (long long)r, (long long)tt,
                                        got, want);
                            fail();
                        }
                    }
                }
                /* a row subset: rows [5, 20) */
                kvs_matmul_rows(best, pool, &W, 5, 20, x, T, y, scratch);
                kvs_quantize_act(ref, vt, x + (T - 1) * K, a, K);
                for (int64_t r = 5; r < 20; r++) {
                    float want = kvs_vec_dot(ref, t, K, w + r * rb, a);
                    assert_true(fabsf(y[(T - 1) * 15 + (r - 5)] - want) <= 1e-4f * (fabsf(want) + 1.0f));
                }
                free(x), free(y), free(scratch), free(a);
            }
            free(w);
        }
        kvs_pool_destroy(pool);
    }
}

/* The register-blocked GEMM path (packed activations; Q8_0 and Q4_0 on
 * AVX-512, Q4_K, Q5_K, Q6_K on AVX2 and AVX-512, Q2_K, Q3_K on AVX-512; the
 * K-quants' decode tiles on AVX-512 are the VNNI GEMVs) against scalar dots
 * (and the table's own vec_dot bit for bit for K-quants) for
 * every tile shape: rows 1..9 and tokens 1..TMAX cover full and partial
 * tiles (decode tiles of 4 rows, prefill tiles of 4 or 8 tokens: TMAX 10
 * for K-quants), K from one block to 11 (full quads of blocks and every
 * short quad; 1 and 5 K-quant super-blocks), and pools of 1..3 threads (1..2
 * for K-quants) split the rows. */
static void test_matmul_tiles(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    static const enum kvs_type types[] = {KVS_TYPE_Q8_0, KVS_TYPE_Q4_0, KVS_TYPE_Q2_K, KVS_TYPE_Q3_K,
                                         KVS_TYPE_Q4_K, KVS_TYPE_Q5_K, KVS_TYPE_Q6_K};
    static const int64_t Ks[] = {32, 64, 96, 128, 160, 352, 256, 1280};
    for (int isa = KVS_ISA_AVX2; isa <= KVS_ISA_NEON; isa++) {
        const struct kvs_kernels *k = kvs_kernels_get((enum kvs_isa)isa);
        if (!k)
            continue;
        for (int nt = 1; nt <= 3; nt++) {
            struct kvs_pool *pool = NULL;
            assert_int_equal(kvs_pool_create(nt, &pool), KVS_OK);
            for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
                for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
                    enum kvs_type t = types[ti], vt = kvs_vec_dot_type(t);
                    if (kvs_type_row_bytes(t, Ks[ki]) == 0)
                        continue;
                    const bool kq = kvs_vec_dot_type(t) == KVS_TYPE_Q8_K;
                    if (kq && nt == 3) /* the row split is the same code as for Q8_0 */
                        continue;
                    const int64_t K = Ks[ki], NMAX = 9, TMAX = kq ? 10 : 7;
                    size_t rb = kvs_type_row_bytes(t, K);
                    uint8_t *w = malloc(rb * NMAX), *a = malloc(kvs_type_row_bytes(vt, K) * TMAX);
                    float *x = malloc((size_t)(TMAX * K) * 4), *y = malloc((size_t)(TMAX * NMAX) * 4);
                    void *scratch = malloc(kvs_matmul_scratch_bytes(t, K, TMAX));
                    for (int64_t r = 0; r < NMAX; r++)
                        random_weights(t, w + r * rb, K);
                    random_acts(x, TMAX * K);
                    for (int64_t tt = 0; tt < TMAX; tt++)
                        kvs_quantize_act(ref, vt, x + tt * K, a + tt * kvs_type_row_bytes(vt, K), K);
                    float want_all[10 * 9], same_all[10 * 9];
                    for (int64_t tt = 0; tt < TMAX; tt++)
                        for (int64_t r = 0; r < NMAX; r++) {
                            want_all[tt * NMAX + r] = kvs_vec_dot(ref, t, K, w + r * rb, a + tt * kvs_type_row_bytes(vt, K));
                            same_all[tt * NMAX + r] = kvs_vec_dot(k, t, K, w + r * rb, a + tt * kvs_type_row_bytes(vt, K));
                        }
                    /* K-quants: the GEMM equals the table's own vec_dot bit for bit */
                    const bool exact = kvs_vec_dot_type(t) == KVS_TYPE_Q8_K;
                    for (int64_t N = 1; N <= NMAX; N++) {
                        if (kq && nt > 1 && N != NMAX) /* tile shapes: one thread covers them */
                            continue;
                        for (int64_t T = 1; T <= TMAX; T++) {
                            struct kvs_matrix W = {.type = t, .ne0 = K, .ne1 = N, .row_bytes = rb, .data = w};
                            kvs_matmul(k, pool, &W, x, T, y, scratch);
                            for (int64_t tt = 0; tt < T; tt++) {
                                for (int64_t r = 0; r < N; r++) {
                                    float want = want_all[tt * NMAX + r];
                                    float got = y[tt * N + r];
                                    if (fabsf(got - want) > 1e-4f * (fabsf(want) + 1.0f) ||
                                        (exact && memcmp(&got, &same_all[tt * NMAX + r], 4) != 0)) {
                                        print_error("%s %s K=%lld N=%lld T=%lld threads=%d row %lld tok %lld: "
                                                    "%.9g vs %.9g\n",
                                                    kvs_isa_name((enum kvs_isa)isa), kvs_type_name(t),
                                                    (long long)K, (long long)N, (long long)T, nt, (long long)r,
                                                    (long long)tt, got, want);
                                        fail();
                                    }
                                }
                            }
                        }
                    }
                    free(w), free(a), free(x), free(y), free(scratch);
                }
            }
            kvs_pool_destroy(pool);
        }
    }
}

/* Packed weights (kvs_matrix_pack): on every table, kvs_matmul with
 * W.packed set equals kvs_matmul on the file layout bit for bit, for rows
 * 1..13 (short last groups), K of 1..11 blocks and 32 blocks (odd and even
 * quad counts, short quads), tokens 1..9, pools of 1..3 threads, packing
 * done in pieces (as threads do), and kvs_matmul_rows from aligned and
 * unaligned first rows; kvs_matmul_multi over packed matrices equals
 * separate products. */
static void test_matmul_packed(void **state)
{
    (void)state;
    static const int64_t Ks[] = {32, 64, 96, 128, 160, 256, 352, 1024};
    const enum kvs_type t = KVS_TYPE_Q8_0;
    for (int isa = KVS_ISA_SCALAR; isa <= KVS_ISA_NEON; isa++) {
        const struct kvs_kernels *k = kvs_kernels_get((enum kvs_isa)isa);
        if (!k)
            continue;
        for (int nth = 1; nth <= 3; nth++) {
            struct kvs_pool *pool = NULL;
            assert_int_equal(kvs_pool_create(nth, &pool), KVS_OK);
            for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++) {
                const int64_t K = Ks[ki], NMAX = 13, TMAX = 9;
                const size_t rb = kvs_type_row_bytes(t, K);
                uint8_t *w = malloc(rb * NMAX);
                float *x = malloc((size_t)(TMAX * K) * 4), *y0 = malloc((size_t)(TMAX * NMAX) * 4),
                      *y1 = malloc((size_t)(TMAX * NMAX) * 4);
                void *scratch = malloc(kvs_matmul_scratch_bytes(t, K, TMAX));
                for (int64_t r = 0; r < NMAX; r++)
                    random_weights(t, w + r * rb, K);
                random_acts(x, TMAX * K);
                for (int64_t N = 1; N <= NMAX; N++) {
                    struct kvs_matrix W = {.type = t, .ne0 = K, .ne1 = N, .row_bytes = rb, .data = w};
                    const size_t pb = kvs_matrix_packed_bytes(&W);
                    assert_true(pb > 0 && pb % 64 == 0);
                    void *pk = aligned_alloc(64, pb);
                    assert_non_null(pk);
                    /* in two pieces, split at a group boundary */
                    const int64_t mid = N > 4 ? 4 : N;
                    kvs_matrix_pack(&W, 0, mid, pk);
                    kvs_matrix_pack(&W, mid, N, pk);
                    struct kvs_matrix P = W;
                    P.packed = pk;
                    for (int64_t T = 1; T <= TMAX; T++) {
                        kvs_matmul(k, pool, &W, x, T, y0, scratch);
                        kvs_matmul(k, pool, &P, x, T, y1, scratch);
                        assert_memory_equal(y0, y1, (size_t)(T * N) * 4);
                        for (int64_t rb0 = 3; rb0 <= 4 && rb0 < N; rb0++) {
                            kvs_matmul_rows(k, pool, &W, rb0, N, x, T, y0, scratch);
                            kvs_matmul_rows(k, pool, &P, rb0, N, x, T, y1, scratch);
                            assert_memory_equal(y0, y1, (size_t)(T * (N - rb0)) * 4);
                        }
                    }
                    if (N >= 5) {
                        const struct kvs_matrix *ms[2] = {&P, &P};
                        float *ys[2] = {y1, y1 + 2 * N};
                        kvs_matmul_multi(k, pool, 2, ms, x, 2, ys, scratch);
                        kvs_matmul(k, pool, &W, x, 2, y0, scratch);
                        assert_memory_equal(y0, y1, (size_t)(2 * N) * 4);
                        assert_memory_equal(y0, y1 + 2 * N, (size_t)(2 * N) * 4);
                    }
                    free(pk);
                }
                free(w), free(x), free(y0), free(y1), free(scratch);
            }
            kvs_pool_destroy(pool);
        }
    }
}

/* kvs_matmul_multi equals one kvs_matmul per matrix, bit for bit: shared
 * type and K (one packed GEMM dispatch over 3 matrices of 36, 8 and 20 rows,
 * chunks crossing matrix boundaries), K-quant types sharing the packed Q8_K
 * activations (one dispatch with a GEMM per matrix where the ISA has them)
 * and mixed vec_dot types (the fallback). */
static void test_matmul_multi(void **state)
{
    (void)state;
    const struct kvs_kernels *k = kvs_kernels_best();
    const int64_t rows[3] = {36, 8, 20}, TMAX = 69; /* > one 64-token block */
    static const enum kvs_type sets[][3] = {
        {KVS_TYPE_Q8_0, KVS_TYPE_Q8_0, KVS_TYPE_Q8_0},
        {KVS_TYPE_Q4_0, KVS_TYPE_Q4_0, KVS_TYPE_Q4_0},
        {KVS_TYPE_Q8_0, KVS_TYPE_Q4_0, KVS_TYPE_F16},
        /* K-quant mixes sharing the packed Q8_K layout (one dispatch on x86) */
        {KVS_TYPE_Q4_K, KVS_TYPE_Q4_K, KVS_TYPE_Q6_K},
        {KVS_TYPE_Q6_K, KVS_TYPE_Q5_K, KVS_TYPE_Q4_K},
        {KVS_TYPE_Q4_K, KVS_TYPE_Q8_0, KVS_TYPE_Q4_K},
    };
    for (int nt = 1; nt <= 3; nt++) {
        struct kvs_pool *pool = NULL;
        assert_int_equal(kvs_pool_create(nt, &pool), KVS_OK);
        for (size_t si = 0; si < sizeof sets / sizeof sets[0]; si++) {
            const int64_t K = kvs_vec_dot_type(sets[si][0]) == KVS_TYPE_Q8_K ? 512 : 352;
            uint8_t *w[3];
            struct kvs_matrix W[3];
            const struct kvs_matrix *Wp[3];
            float *y1[3], *y2[3];
            size_t scratch_bytes = 0;
            for (int i = 0; i < 3; i++) {
                enum kvs_type t = sets[si][i];
                size_t rb = kvs_type_row_bytes(t, K);
                w[i] = malloc(rb * (size_t)rows[i]);
                for (int64_t r = 0; r < rows[i]; r++)
                    random_weights(t, w[i] + (size_t)r * rb, K);
                W[i] = (struct kvs_matrix){.type = t, .ne0 = K, .ne1 = rows[i], .row_bytes = rb, .data = w[i]};
                Wp[i] = &W[i];
                y1[i] = malloc((size_t)(rows[i] * TMAX) * 4);
                y2[i] = malloc((size_t)(rows[i] * TMAX) * 4);
                size_t sb = kvs_matmul_scratch_bytes(t, K, TMAX);
                scratch_bytes = sb > scratch_bytes ? sb : scratch_bytes;
            }
            float *x = malloc((size_t)(K * TMAX) * 4);
            void *scratch = malloc(scratch_bytes);
            random_acts(x, K * TMAX);
            static const int64_t toks[] = {1, 5, 69};
            for (size_t ti = 0; ti < sizeof toks / sizeof toks[0]; ti++) {
                const int64_t T = toks[ti];
                kvs_matmul_multi(k, pool, 3, Wp, x, T, y1, scratch);
                for (int i = 0; i < 3; i++) {
                    kvs_matmul(k, pool, &W[i], x, T, y2[i], scratch);
                    assert_memory_equal(y1[i], y2[i], (size_t)(rows[i] * T) * 4);
                }
            }
            /* and against the scalar reference, every token of the long batch */
            const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
            enum kvs_type vt = kvs_vec_dot_type(sets[si][0]);
            uint8_t *a = malloc(kvs_type_row_bytes(vt, K));
            for (int64_t tt = 0; tt < TMAX; tt++) {
                kvs_quantize_act(ref, vt, x + tt * K, a, K);
                for (int64_t r = 0; r < rows[0]; r++) {
                    float want = kvs_vec_dot(ref, sets[si][0], K, w[0] + (size_t)r * W[0].row_bytes, a);
                    assert_true(fabsf(y1[0][tt * rows[0] + r] - want) <= 1e-4f * (fabsf(want) + 1.0f));
                }
            }
            free(a);
            for (int i = 0; i < 3; i++)
                free(w[i]), free(y1[i]), free(y2[i]);
            free(x), free(scratch);
        }
        kvs_pool_destroy(pool);
    }
}

/* F16 accumulator updates: every ISA equals the scalar reference bit for bit
 * (FMA in the 64-element body, one F32 rounding per operation in the tail,
 * round-to-nearest-even to F16), including
 * lengths that leave a tail. */
static void test_f16_vec(void **state)
{
    (void)state;
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    enum { N = 203 };
    uint16_t x[N], y0[N], y1[N], y2[N];
    for (int i = 0; i < N; i++) {
        x[i] = kvs_f32_to_f16(rndf(-4.0f, 4.0f));
        y0[i] = kvs_f32_to_f16(rndf(-60000.0f, 60000.0f) * (i % 3 == 0 ? 1e-8f : 1.0f));
    }
    for (int isa = KVS_ISA_SCALAR; isa <= KVS_ISA_NEON; isa++) {
        const struct kvs_kernels *k = kvs_kernels_get((enum kvs_isa)isa);
        if (!k)
            continue;
        static const float scales[] = {0.0f, 1.0f, 0.3728f, 1e-5f, 17.5f};
        for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
            for (int n = 0; n <= N; n += 29) {
                memcpy(y1, y0, sizeof y0), memcpy(y2, y0, sizeof y0);
                kvs_vec_f16_mad(ref, y1, x, scales[si], n);
                kvs_vec_f16_mad(k, y2, x, scales[si], n);
                assert_memory_equal(y1, y2, sizeof y1);
                kvs_vec_f16_scale(ref, y1, scales[si], n);
                kvs_vec_f16_scale(k, y2, scales[si], n);
                assert_memory_equal(y1, y2, sizeof y1);
            }
        }
    }
}

static void count_task(void *ctx, int ith, int nth)
{
    int *slots = ctx;
    slots[ith] += 1 + nth;
}

static void test_pool(void **state)
{
    (void)state;
    struct kvs_pool *p = NULL;
    assert_int_equal(kvs_pool_create(0, &p), KVS_ERR_ARG);
    assert_int_equal(kvs_pool_create(3, &p), KVS_OK);
    int slots[3] = {0};
    for (int i = 0; i < 1000; i++)
        kvs_pool_run(p, count_task, slots);
    for (int i = 0; i < 3; i++)
        assert_int_equal(slots[i], 4000);
    kvs_pool_destroy(p);
    kvs_pool_destroy(NULL);
}

/* --- F16 / BF16 weights: llama.cpp's summation orders ------------------------
 * Scalar models of how ggml's CPU backend sums these dots (its vec_dot for
 * decode and flash attention, tinyBLAS for a prompt GEMM), written out lane
 * by lane; every SIMD table must equal them bit for bit, since F16/BF16
 * activation roundings downstream turn one-ulp differences into visible
 * ones (qwen35-mixed). Values are drawn so that no product or partial sum
 * is denormal (VDPBF16PS flushes those). */

static float emu_w(enum kvs_type t, uint16_t v)
{
    return t == KVS_TYPE_F16 ? kvs_f16_to_f32(v) : kvs_bf16_to_f32(v);
}

/* Lanes v[0..L) summed as _mm512_reduce_add_ps (L 16) or the 256-bit
 * horizontal add kvs_x86_hsum_ps / tinyBLAS's (L 8): halves folded, then
 * quarters, then pairs. */
static float emu_tree(const float *v, int L)
{
    float t[16];
    memcpy(t, v, (size_t)L * sizeof(float));
    for (int h = L / 2; h >= 1; h /= 2)
        for (int j = 0; j < h; j++)
            t[j] = t[j] + t[j + h];
    return t[0];
}

/* G accumulators of L lanes over steps of G * L elements (FMA), folded
 * (0+2) + (1+3) for G 4, or summed one by one in double for G 2
 * (ggml's BF16 vec_dot); the tail in double. hadd: ggml's AVX2 F16
 * reduction (pairwise adds within the 4 lanes after the halves). */
static float emu_vec_dot(enum kvs_type t, const uint16_t *x, const uint16_t *y, int64_t n, int G, int L, bool hadd)
{
    float acc[4][16] = {{0}};
    const int64_t step = (int64_t)G * L, np = n / step * step;
    for (int64_t i = 0; i < np; i += step)
        for (int g = 0; g < G; g++)
            for (int l = 0; l < L; l++)
                acc[g][l] = fmaf(emu_w(t, x[i + g * L + l]), emu_w(t, y[i + g * L + l]), acc[g][l]);
    double s = 0.0;
    if (G == 4) {
        float v[16];
        for (int l = 0; l < L; l++) v[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
        if (hadd) {
            float q[4];
            for (int j = 0; j < 4; j++) q[j] = v[j] + v[j + 4];
            s = (double)((q[0] + q[1]) + (q[2] + q[3]));
        } else if (np) {
            s = (double)emu_tree(v, L);
        }
    } else {
        for (int g = 0; g < G; g++) s += (double)emu_tree(acc[g], L);
    }
    for (int64_t i = np; i < n; i++) s += (double)(emu_w(t, x[i]) * emu_w(t, y[i]));
    return (float)s;
}

/* VDPBF16PS lane: acc + x[1] y[1], then + x[0] y[0] (exact products, two
 * F32 roundings). */
static float emu_dp2(float acc, const uint16_t *x, const uint16_t *y)
{
    acc = acc + kvs_bf16_to_f32(x[1]) * kvs_bf16_to_f32(y[1]);
    return acc + kvs_bf16_to_f32(x[0]) * kvs_bf16_to_f32(y[0]);
}

/* ggml's BF16 vec_dot with AVX512-BF16: two accumulators over 64-element
 * steps; tinyBLAS (gemm): one over 32-element steps, reduced in F32. */
static float emu_bf16_dp(const uint16_t *x, const uint16_t *y, int64_t n, bool gemm)
{
    float c[2][16] = {{0}};
    const int64_t step = gemm ? 32 : 64, np = n / step * step;
    for (int64_t i = 0; i < np; i += step)
        for (int g = 0; g < (gemm ? 1 : 2); g++)
            for (int j = 0; j < 16; j++)
                c[g][j] = emu_dp2(c[g][j], x + i + 32 * g + 2 * j, y + i + 32 * g + 2 * j);
    if (gemm)
        return emu_tree(c[0], 16);
    double s = (double)emu_tree(c[0], 16);
    s += (double)emu_tree(c[1], 16);
    for (int64_t i = np; i < n; i++) s += (double)(kvs_bf16_to_f32(x[i]) * kvs_bf16_to_f32(y[i]));
    return (float)s;
}

/* tinyBLAS: one L-lane FMA accumulator, reduced in F32. */
static float emu_gemm(enum kvs_type t, const uint16_t *x, const uint16_t *y, int64_t n, int L)
{
    float acc[16] = {0};
    for (int64_t i = 0; i < n; i += L)
        for (int l = 0; l < L; l++) acc[l] = fmaf(emu_w(t, x[i + l]), emu_w(t, y[i + l]), acc[l]);
    return emu_tree(acc, L);
}

static void test_float_dot_orders(void **state)
{
    (void)state;
    struct isa_case { const struct kvs_kernels *k; const char *name; int L; bool bf16dp; } isas[3];
    int ni = 0;
#if defined(__x86_64__) || defined(_M_X64)
    if (kvs_kernels_get(KVS_ISA_AVX2))
        isas[ni++] = (struct isa_case){ &kvs_kernels_avx2, "avx2", 8, false };
    if (kvs_kernels_get(KVS_ISA_AVX512)) {
        isas[ni++] = (struct isa_case){ &kvs_kernels_avx512, "avx512", 16, false };
        /* the VDPBF16PS table only where the CPU has the instruction */
        if (kvs_kernels_get(KVS_ISA_AVX512) == &kvs_kernels_avx512_bf16)
            isas[ni++] = (struct isa_case){ &kvs_kernels_avx512_bf16, "avx512-bf16", 16, true };
    }
#endif
    if (!ni)
        skip(); /* no x86 SIMD table on this machine: nothing to compare */
    static const int64_t ns[] = {8, 24, 32, 48, 64, 96, 256, 288, 1000, 1280};
    static const enum kvs_type ts[] = {KVS_TYPE_F16, KVS_TYPE_BF16};
    uint16_t x[1280], y[1280];
    for (int rep = 0; rep < 4; rep++)
        for (int ii = 0; ii < ni; ii++)
            for (size_t ti = 0; ti < 2; ti++)
                for (size_t nn = 0; nn < sizeof ns / sizeof ns[0]; nn++) {
                    const enum kvs_type t = ts[ti];
                    const int64_t n = ns[nn];
                    for (int64_t i = 0; i < n; i++) {
                        /* magnitudes 2^-4..2^4 of both signs: no denormals */
                        float a = rndf(0.0625f, 16.0f) * (rnd() & 1 ? 1.0f : -1.0f);
                        float b = rndf(0.0625f, 16.0f) * (rnd() & 1 ? 1.0f : -1.0f);
                        x[i] = t == KVS_TYPE_F16 ? kvs_f32_to_f16(a) : kvs_f32_to_bf16(a);
                        y[i] = t == KVS_TYPE_F16 ? kvs_f32_to_f16(b) : kvs_f32_to_bf16(b);
                    }
                    const struct kvs_kernels *k = isas[ii].k;
                    const int L = isas[ii].L;
                    float want_dot, want_gemm;
                    if (t == KVS_TYPE_F16) {
                        want_dot = emu_vec_dot(t, x, y, n, 4, L, L == 8);
                    } else if (isas[ii].bf16dp) {
                        want_dot = emu_bf16_dp(x, y, n, false);
                    } else {
                        want_dot = emu_vec_dot(t, x, y, n, L == 8 ? 4 : 2, L, false);
                    }
                    const int gl = isas[ii].bf16dp && t == KVS_TYPE_BF16 ? 32 : L;
                    if (n % gl)
                        want_gemm = want_dot;
                    else if (isas[ii].bf16dp && t == KVS_TYPE_BF16)
                        want_gemm = emu_bf16_dp(x, y, n, true);
                    else
                        want_gemm = emu_gemm(t, x, y, n, L);
                    const float got_dot = k->dot[t](n, x, y), got_gemm = k->dot_gemm[t](n, x, y);
                    if (memcmp(&got_dot, &want_dot, 4) || memcmp(&got_gemm, &want_gemm, 4)) {
                        print_error("%s %s n=%lld: dot %.9g (want %.9g), gemm dot %.9g (want %.9g)\n",
                                    isas[ii].name, kvs_type_name(t), (long long)n, got_dot, want_dot,
                                    got_gemm, want_gemm);
                        fail();
                    }
                }
}

/* kvs_matmul uses the prompt GEMM's dot only where ggml's mul_mat runs its
 * tinyBLAS: 2+ tokens, a multiple of 4 rows, not an expert slice. */
static void test_matmul_float_gemm_choice(void **state)
{
    (void)state;
    const struct kvs_kernels *k = kvs_kernels_best();
    if (!k->dot_gemm[KVS_TYPE_BF16])
        skip(); /* this ISA sums prompts as decodes: nothing to choose */
    enum { K = 256, T = 3 };
    struct kvs_pool *pool;
    assert_int_equal(kvs_pool_create(2, &pool), KVS_OK);
    uint16_t w[8 * K];
    float x[T * K], y[T * 8];
    for (int i = 0; i < 8 * K; i++) w[i] = kvs_f32_to_bf16(rndf(-1.0f, 1.0f));
    for (int i = 0; i < T * K; i++) x[i] = rndf(-1.0f, 1.0f);
    uint16_t xa[T * K];
    kvs_quantize_act(k, KVS_TYPE_BF16, x, xa, T * K);
    void *scratch = malloc(kvs_matmul_scratch_bytes(KVS_TYPE_BF16, K, T));
    static const struct { int64_t rows; int64_t toks; bool expert; bool gemm; } cases[] = {
        {8, 3, false, true}, {8, 1, false, false}, {6, 3, false, false}, {8, 3, true, false}, {4, 2, false, true},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct kvs_matrix W = { .type = KVS_TYPE_BF16, .ne0 = K, .ne1 = cases[c].rows,
                                .row_bytes = kvs_type_row_bytes(KVS_TYPE_BF16, K), .data = w,
                                .expert = cases[c].expert };
        kvs_matmul(k, pool, &W, x, cases[c].toks, y, scratch);
        kvs_dot_fn f = cases[c].gemm ? k->dot_gemm[KVS_TYPE_BF16] : k->dot[KVS_TYPE_BF16];
        for (int64_t t = 0; t < cases[c].toks; t++)
            for (int64_t r = 0; r < cases[c].rows; r++) {
                float want = f(K, w + r * K, xa + t * K);
                assert_memory_equal(&y[t * cases[c].rows + r], &want, 4);
            }
    }
    free(scratch);
    kvs_pool_destroy(pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vec_dot_vs_float),
        cmocka_unit_test(test_simd_vs_scalar),
        cmocka_unit_test(test_simd_quant_ties),
        cmocka_unit_test(test_simd_f16_bf16_special),
        cmocka_unit_test(test_simd_coverage),
        cmocka_unit_test(test_pool),
        cmocka_unit_test(test_matmul_threads),
        cmocka_unit_test(test_matmul_tiles),
        cmocka_unit_test(test_f16_vec),
        cmocka_unit_test(test_matmul_multi),
        cmocka_unit_test(test_matmul_packed),
        cmocka_unit_test(test_float_dot_orders),
        cmocka_unit_test(test_matmul_float_gemm_choice),
    };
    /* KVS_TEST_FILTER=test_simd* runs a subset (scripts/neon-check.sh under
     * emulation, where the matmul tests take long). */
    const char *filter = getenv("KVS_TEST_FILTER");
    if (filter && *filter)
        cmocka_set_test_filter(filter);
    return cmocka_run_group_tests(tests, NULL, NULL);
}

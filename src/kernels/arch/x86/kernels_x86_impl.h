/* x86 kernels written once with 256-bit intrinsics and compiled twice: in
 * kernels_avx2.c (-mavx2 -mfma -mf16c) and in kernels_avx512.c (plus
 * AVX-512 F/BW/VL/DQ/VNNI), where the u8 x s8 dot step becomes one VNNI
 * instruction. Every function reproduces the scalar reference's integer sums
 * exactly (no int16 saturation is possible for these value ranges, checked
 * per kernel below) and combines them with the same per-block float scales;
 * only the float summation order differs (gguf-facts §2.5).
 *
 * Vectorized here: activation quantization Q8_0, Q8_1, Q8_K and conversion
 * to F16 / BF16; vec_dot for every weight type (F32, F16, BF16, Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K); dot4 (one weight row,
 * four activation rows) for Q4_0, Q8_0, Q4_K, Q6_K. Dequantization (one
 * embedding row per token, off the hot path) uses the scalar reference.
 * Include only from a file compiled with AVX2 flags. */
#ifndef KVS_KERNELS_X86_IMPL_H
#define KVS_KERNELS_X86_IMPL_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kernels/kernels_impl.h"

#define KVS_F16(h) _cvtsh_ss(h)

static inline float kvs_x86_hsum_ps(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline int kvs_x86_hsum_epi32(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

/* acc + sum of 4 adjacent u8*s8 products per int32 lane. Callers guarantee
 * that pairs of products fit int16 (|u*s| * 2 <= 32767), so the AVX2 form
 * (maddubs saturating at int16) and VNNI give identical results. */
static inline __m256i kvs_x86_dpbusd(__m256i acc, __m256i u, __m256i s)
{
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* Signed s8 x s8 sums of 4 per int32 lane: |w| (<= 128) times a with w's sign
 * (|a| <= 127 after the sign flip as the activation has no -128 for Q8_0 and
 * at most |-128*1| pairs sum 32512 < 32767). */
static inline __m256i kvs_x86_dot_s8(__m256i w, __m256i a)
{
    return kvs_x86_dpbusd(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
}

/* --- activation quantization -------------------------------------------- */

/* Round-half-even 32 values * mult into int8 (x86 rule, gguf-facts §2.5);
 * returns the lane sums of q for Q8_1. */
static inline __m256i kvs_x86_q8_block(const float *x, float mult, int8_t *qs)
{
    __m256 m = _mm256_set1_ps(mult);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x), m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8), m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 16), m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 24), m), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)qs, p);
    return sum;
}

static inline float kvs_x86_absmax32(const float *x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8)));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 16)));
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 24)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

static void kvs_x86_quant_q8_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float amax = kvs_x86_absmax32(x);
        kvs_x86_q8_block(x, amax != 0.0f ? 127.0f / amax : 0.0f, b[i].qs);
        b[i].d = _cvtss_sh(amax / 127.0f, 0);
    }
}

static void kvs_x86_quant_q8_1(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float amax = kvs_x86_absmax32(x);
        int s = kvs_x86_hsum_epi32(kvs_x86_q8_block(x, amax != 0.0f ? 127.0f / amax : 0.0f, b[i].qs));
        float d = amax / 127.0f;
        b[i].d = _cvtss_sh(d, 0);
        b[i].s = _cvtss_sh(d * (float)s, 0);
    }
}

/* Q8_K as llama.cpp's reference quantizer (gguf-facts §2.5): the signed value
 * of largest magnitude (the first such) sets iscale = -127/max. */
static void kvs_x86_quant_q8_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        const float *x = src + i * KVS_QK_K;
        float amax = 0.0f;
        for (int j = 0; j < KVS_QK_K; j += 32)
            amax = fmaxf(amax, kvs_x86_absmax32(x + j));
        if (amax == 0.0f) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float max = 0.0f;
        for (int j = 0; j < KVS_QK_K; j++) {
            if (fabsf(x[j]) == amax) {
                max = x[j];
                break;
            }
        }
        float iscale = -127.0f / max;
        const __m256 m = _mm256_set1_ps(iscale);
        const __m256i lim = _mm256_set1_epi32(127);
        for (int j = 0; j < KVS_QK_K; j += 32) {
            __m256i v[4];
            for (int k = 0; k < 4; k++) {
                __m256 p = _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), m);
                v[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), lim);
            }
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(b[i].qs + j), p);
        }
        /* bsums: 16 sums of 16 int8 */
        const __m256i ones8 = _mm256_set1_epi8(1);
        for (int k = 0; k < 16; k += 2) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(b[i].qs + 16 * k));
            __m256i s16 = _mm256_maddubs_epi16(ones8, q);           /* 16 pair sums */
            __m256i s32 = _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); /* 8 quad sums */
            __m128i lo = _mm256_castsi256_si128(s32), hi = _mm256_extracti128_si256(s32, 1);
            lo = _mm_hadd_epi32(lo, lo);
            hi = _mm_hadd_epi32(hi, hi);
            b[i].bsums[k] = (int16_t)(_mm_cvtsi128_si32(lo) + _mm_extract_epi32(lo, 1));
            b[i].bsums[k + 1] = (int16_t)(_mm_cvtsi128_si32(hi) + _mm_extract_epi32(hi, 1));
        }
        b[i].d = 1.0f / iscale;
    }
}

/* --- Q8_0 / Q4_0 against Q8_0 --------------------------------------------- */

/* Q4_0 block unpacked to signed bytes -8..7 in element order. */
static inline __m256i kvs_x86_unpack_q4_0(const uint8_t *qs)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_sub_epi8(_mm256_and_si256(v, _mm256_set1_epi8(0x0F)), _mm256_set1_epi8(8));
}

/* One 8-lane accumulator, one FMA per block with the F32 product of the two
 * scales, then kvs_x86_hsum_ps: ggml's Q8_0 vec_dot on AVX2 and its tinyBLAS
 * (prompt) sum the same way, so decode and prefill agree with each other
 * and with llama.cpp bit for bit (kvs_x86_dot4_q8_0 too). */
static float kvs_x86_dot_q8_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q8_0 *x = w, *y = a;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        __m256i p = kvs_x86_dot_s8(_mm256_loadu_si256((const __m256i *)x[i].qs), _mm256_loadu_si256((const __m256i *)y[i].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)), _mm256_cvtepi32_ps(p), acc);
    }
    return kvs_x86_hsum_ps(acc);
}

static float kvs_x86_dot_q4_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_0 *x = w;
    const kvs_block_q8_0 *y = a;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        __m256i p = kvs_x86_dot_s8(kvs_x86_unpack_q4_0(x[i].qs), _mm256_loadu_si256((const __m256i *)y[i].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)), _mm256_cvtepi32_ps(p), acc);
    }
    return kvs_x86_hsum_ps(acc);
}

/* One weight row against 4 activation rows: the weight block is loaded and
 * unpacked once per 4 tokens. */
#define KVS_X86_DOT4_LEGACY(NAME, WBLOCK, UNPACK)                                                    \
    static void NAME(int64_t n, const void *w, const void *a, size_t a_stride, float out[4])       \
    {                                                                                               \
        const WBLOCK *x = w;                                                                        \
        const kvs_block_q8_0 *y[4];                                                                 \
        for (int t = 0; t < 4; t++)                                                                 \
            y[t] = (const kvs_block_q8_0 *)((const char *)a + (size_t)t * a_stride);                \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),            \
                         _mm256_setzero_ps()};                                                      \
        for (int64_t i = 0; i < n / KVS_QK; i++) {                                                  \
            __m256i qw = UNPACK;                                                                    \
            __m256i aw = _mm256_sign_epi8(qw, qw);                                                  \
            float dw = KVS_F16(x[i].d);                                                             \
            for (int t = 0; t < 4; t++) {                                                           \
                __m256i qa = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y[t][i].qs), qw); \
                __m256i p = kvs_x86_dpbusd(_mm256_setzero_si256(), aw, qa);                         \
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * KVS_F16(y[t][i].d)),                   \
                                         _mm256_cvtepi32_ps(p), acc[t]);                            \
            }                                                                                       \
        }                                                                                           \
        for (int t = 0; t < 4; t++)                                                                 \
            out[t] = kvs_x86_hsum_ps(acc[t]);                                                       \
    }

KVS_X86_DOT4_LEGACY(kvs_x86_dot4_q8_0, kvs_block_q8_0, _mm256_loadu_si256((const __m256i *)x[i].qs))
KVS_X86_DOT4_LEGACY(kvs_x86_dot4_q4_0, kvs_block_q4_0, kvs_x86_unpack_q4_0(x[i].qs))

/* --- K-quants against Q8_K ------------------------------------------------ */

/* Q4_K/Q5_K: sub-block j's quants times activations, weighted by sc[j]
 * (0..63), summed over the super-block. q <= 31 so q*a pairs fit int16. */
static inline void kvs_x86_q4k_scales(const uint8_t *b, uint8_t sc[8], uint8_t mn[8])
{
    for (int j = 0; j < 8; j++)
        kvs_q4k_scale_min(j, b, &sc[j], &mn[j]);
}

static inline int kvs_x86_kmins(const uint8_t mn[8], const int16_t *bsums)
{
    int m = 0;
    for (int j = 0; j < 8; j++)
        m += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return m;
}

/* Integer A of one Q4_K (hbits == NULL) or Q5_K super-block. */
static inline int kvs_x86_qk45_sum(const uint8_t *qs, const uint8_t *qh, const uint8_t sc[8], const int8_t *aq)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i acc = _mm256_setzero_si256();
    __m256i hb = qh ? _mm256_loadu_si256((const __m256i *)qh) : _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (qh) {
            __m256i b0 = _mm256_set1_epi8((char)(1 << (2 * c))), b1 = _mm256_set1_epi8((char)(1 << (2 * c + 1)));
            lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, b0), b0), _mm256_set1_epi8(16)));
            hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, b1), b1), _mm256_set1_epi8(16)));
        }
        __m256i p0 = kvs_x86_dpbusd(_mm256_setzero_si256(), lo, _mm256_loadu_si256((const __m256i *)(aq + 64 * c)));
        __m256i p1 = kvs_x86_dpbusd(_mm256_setzero_si256(), hi, _mm256_loadu_si256((const __m256i *)(aq + 64 * c + 32)));
        acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p0, _mm256_set1_epi32(sc[2 * c])));
        acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p1, _mm256_set1_epi32(sc[2 * c + 1])));
    }
    return kvs_x86_hsum_epi32(acc);
}

static float kvs_x86_dot_q4_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        uint8_t sc[8], mn[8];
        kvs_x86_q4k_scales(x[i].scales, sc, mn);
        int sa = kvs_x86_qk45_sum(x[i].qs, NULL, sc, y[i].qs);
        int sm = kvs_x86_kmins(mn, y[i].bsums);
        sum += KVS_F16(x[i].d) * y[i].d * (float)sa - KVS_F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

static void kvs_x86_dot4_q4_K(int64_t n, const void *w, const void *a, size_t a_stride, float out[4])
{
    const kvs_block_q4_K *x = w;
    float sum[4] = {0};
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        uint8_t sc[8], mn[8];
        kvs_x86_q4k_scales(x[i].scales, sc, mn);
        float d = KVS_F16(x[i].d), dmin = KVS_F16(x[i].dmin);
        for (int t = 0; t < 4; t++) {
            const kvs_block_q8_K *y = (const kvs_block_q8_K *)((const char *)a + (size_t)t * a_stride) + i;
            int sa = kvs_x86_qk45_sum(x[i].qs, NULL, sc, y->qs);
            int sm = kvs_x86_kmins(mn, y->bsums);
            sum[t] += d * y->d * (float)sa - dmin * y->d * (float)sm;
        }
    }
    memcpy(out, sum, sizeof sum);
}

static float kvs_x86_dot_q5_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        uint8_t sc[8], mn[8];
        kvs_x86_q4k_scales(x[i].scales, sc, mn);
        int sa = kvs_x86_qk45_sum(x[i].qs, x[i].qh, sc, y[i].qs);
        int sm = kvs_x86_kmins(mn, y[i].bsums);
        sum += KVS_F16(x[i].d) * y[i].d * (float)sa - KVS_F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

/* Q6_K: v = q + 32 in 0..63 (v*a pairs <= 16128 fit int16); the offset is
 * taken back out as 32 * sum_s scale_s * bsums_s. */
static inline int kvs_x86_q6k_sum(const kvs_block_q6_K *x, const int8_t *aq, const int16_t *bsums)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256i acc = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        __m256i l0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
        __m256i l1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
        __m256i v[4];
        v[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
        v[1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
        for (int g = 0; g < 4; g++) {
            int s = 8 * h + 2 * g;
            __m256i p = kvs_x86_dpbusd(_mm256_setzero_si256(), v[g], _mm256_loadu_si256((const __m256i *)(aq + 128 * h + 32 * g)));
            __m256i scv = _mm256_set_m128i(_mm_set1_epi32(x->scales[s + 1]), _mm_set1_epi32(x->scales[s]));
            acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, scv));
        }
    }
    int off = 0;
    for (int s = 0; s < 16; s++)
        off += x->scales[s] * bsums[s];
    return kvs_x86_hsum_epi32(acc) - 32 * off;
}

static float kvs_x86_dot_q6_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q6_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++)
        sum += KVS_F16(x[i].d) * y[i].d * (float)kvs_x86_q6k_sum(&x[i], y[i].qs, y[i].bsums);
    return sum;
}

static void kvs_x86_dot4_q6_K(int64_t n, const void *w, const void *a, size_t a_stride, float out[4])
{
    const kvs_block_q6_K *x = w;
    float sum[4] = {0};
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        float d = KVS_F16(x[i].d);
        for (int t = 0; t < 4; t++) {
            const kvs_block_q8_K *y = (const kvs_block_q8_K *)((const char *)a + (size_t)t * a_stride) + i;
            sum[t] += d * y->d * (float)kvs_x86_q6k_sum(&x[i], y->qs, y->bsums);
        }
    }
    memcpy(out, sum, sizeof sum);
}

/* --- F16, BF16, F32 --------------------------------------------------------- */

/* 8 values widened to F32 (exact for all three types); one value: KVS_F16,
 * kvs_bf16_to_f32, kvs_x86_f32. */
static inline __m256 kvs_x86_f16x8(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 kvs_x86_bf16x8(const uint16_t *p)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline float kvs_x86_f32(float v) { return v; }

/* Float dots (weights and activations of one type): four accumulators of 8,
 * then 8 at a time, then a scalar tail. */
#define KVS_X86_DOT_FLOAT(NAME, T, LOAD8, ONE)                                                      \
    static float NAME(int64_t n, const void *w, const void *a)                                    \
    {                                                                                             \
        const T *x = w, *y = a;                                                                   \
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),          \
                         _mm256_setzero_ps()};                                                    \
        int64_t i = 0;                                                                            \
        for (; i + 32 <= n; i += 32)                                                              \
            for (int k = 0; k < 4; k++)                                                           \
                acc[k] = _mm256_fmadd_ps(LOAD8(x + i + 8 * k), LOAD8(y + i + 8 * k), acc[k]);     \
        for (; i + 8 <= n; i += 8)                                                                \
            acc[0] = _mm256_fmadd_ps(LOAD8(x + i), LOAD8(y + i), acc[0]);                         \
        float s = kvs_x86_hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]),                    \
                                                _mm256_add_ps(acc[2], acc[3])));                  \
        for (; i < n; i++)                                                                        \
            s += ONE(x[i]) * ONE(y[i]);                                                           \
        return s;                                                                                 \
    }

KVS_X86_DOT_FLOAT(kvs_x86_dot_f32, float, _mm256_loadu_ps, kvs_x86_f32)

/* F16 and BF16 weights, summed as llama.cpp's CPU backend built for AVX2
 * does (ggml's vec_dot for decode and flash attention, tinyBLAS for
 * prompts: kvs_kernels dot_gemm), so that logits follow its roundings.
 *
 * F16 dot (ggml's F16 vec_dot on AVX2): four 8-lane FMA accumulators over
 * 32-element steps, folded 0+2 and 1+3, then 0+1; the 8 lanes as low half +
 * high half, then two pairwise (hadd) steps; the n mod 32 tail in double. */
static float kvs_x86_dot_f16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    const int64_t np = n & ~(int64_t)31;
    double s = 0.0;
    if (np) {
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t i = 0; i < np; i += 32)
            for (int k = 0; k < 4; k++)
                acc[k] = _mm256_fmadd_ps(kvs_x86_f16x8(x + i + 8 * k), kvs_x86_f16x8(y + i + 8 * k), acc[k]);
        __m256 v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        t = _mm_hadd_ps(t, t);
        s = (double)_mm_cvtss_f32(_mm_hadd_ps(t, t));
    }
    for (int64_t i = np; i < n; i++)
        s += (double)(KVS_F16(x[i]) * KVS_F16(y[i]));
    return (float)s;
}

/* BF16 dot (ggml's BF16 vec_dot on AVX2): four 8-lane accumulators over
 * 32-element steps, each step's product added with one rounding (the
 * multiply-add a GCC build of ggml contracts to FMA), folded (0+2) + (1+3),
 * the 8 lanes as kvs_x86_hsum_ps; the n mod 32 tail in double. */
static float kvs_x86_dot_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int k = 0; k < 4; k++)
            acc[k] = _mm256_fmadd_ps(kvs_x86_bf16x8(x + i + 8 * k), kvs_x86_bf16x8(y + i + 8 * k), acc[k]);
    double s = (double)kvs_x86_hsum_ps(_mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3])));
    for (; i < n; i++)
        s += (double)(kvs_bf16_to_f32(x[i]) * kvs_bf16_to_f32(y[i]));
    return (float)s;
}

/* Prompt GEMM dots (tinyBLAS on AVX2): one 8-lane FMA accumulator over the
 * row, lanes summed as kvs_x86_hsum_ps; n not a multiple of 8: the vec_dot. */
#define KVS_X86_DOT_GEMM8(NAME, LOAD8, FALLBACK)                                                    \
    static float NAME(int64_t n, const void *w, const void *a)                                    \
    {                                                                                             \
        const uint16_t *x = w, *y = a;                                                            \
        if (n % 8)                                                                                \
            return FALLBACK(n, w, a);                                                             \
        __m256 acc = _mm256_setzero_ps();                                                         \
        for (int64_t i = 0; i < n; i += 8)                                                        \
            acc = _mm256_fmadd_ps(LOAD8(x + i), LOAD8(y + i), acc);                               \
        return kvs_x86_hsum_ps(acc);                                                              \
    }
KVS_X86_DOT_GEMM8(kvs_x86_dot_gemm_f16, kvs_x86_f16x8, kvs_x86_dot_f16)
KVS_X86_DOT_GEMM8(kvs_x86_dot_gemm_bf16, kvs_x86_bf16x8, kvs_x86_dot_bf16)

/* F32 -> BF16 rows as kvs_f32_to_bf16: round to nearest even on the upper
 * 16 bits, NaN kept quiet (| 0x40). */
static void kvs_x86_quant_bf16(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i bias = _mm256_set1_epi32(0x7FFF), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(64);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i r[2];
        for (int k = 0; k < 2; k++) {
            __m256i x = _mm256_castps_si256(_mm256_loadu_ps(src + i + 8 * k));
            __m256i rounded = _mm256_srli_epi32(
                _mm256_add_epi32(x, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(x, 16), one))), 16);
            __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
            __m256i qn = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
            r[k] = _mm256_blendv_epi8(rounded, qn, nan);
        }
        /* 32 -> 16 bits: values are < 2^16, so unsigned saturation is exact */
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(d + i), p);
    }
    if (i < n)
        kvs_ref_quant_bf16(src + i, d + i, n - i);
}

/* F32 -> F16 rows (round to nearest even: F16C's conversion, as
 * kvs_ref_quant_f16). */
static void kvs_x86_quant_f16(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n)
        kvs_ref_quant_f16(src + i, d + i, n - i);
}

/* --- Q4_1, Q5_0, Q5_1 (32-element blocks) ------------------------------------ */

/* Q4_1 / Q5_x block quants unpacked to unsigned bytes 0..15 in element
 * order: low nibbles are elements 0..15, high nibbles 16..31. */
static inline __m256i kvs_x86_unpack_nibbles(const uint8_t *qs)
{
    __m128i t = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0F));
}

/* The Q5 fifth bits: byte j is 0x10 where bit j of the little-endian qh is
 * set, else 0. */
static inline __m256i kvs_x86_q5_high(const uint8_t qh[4])
{
    uint32_t h;
    memcpy(&h, qh, 4); /* x86 is little-endian, as the format */
    const __m256i shuf = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)h), shuf), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(0x10));
}

/* Q4_1 / Q5_1 x Q8_1: unsigned quants u (Q4_1 0..15, Q5_1 0..31 with the
 * fifth bit: u * a pairs <= 7874 fit int16) times d * d_y, plus the min term
 * m * s_y per block (s_y = d_y * sum of the Q8_1 quants). */
#define KVS_X86_DOT_MIN(NAME, BLOCK, UNPACK)                                                         \
    static float NAME(int64_t n, const void *w, const void *a)                                     \
    {                                                                                              \
        const BLOCK *x = w;                                                                        \
        const kvs_block_q8_1 *y = a;                                                               \
        __m256 acc = _mm256_setzero_ps();                                                          \
        float mins = 0.0f;                                                                         \
        for (int64_t i = 0; i < n / KVS_QK; i++) {                                                 \
            __m256i p = kvs_x86_dpbusd(_mm256_setzero_si256(), UNPACK,                              \
                                       _mm256_loadu_si256((const __m256i *)y[i].qs));              \
            acc = _mm256_fmadd_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)),              \
                                  _mm256_cvtepi32_ps(p), acc);                                     \
            mins += KVS_F16(x[i].m) * KVS_F16(y[i].s);                                             \
        }                                                                                          \
        return kvs_x86_hsum_ps(acc) + mins;                                                        \
    }

KVS_X86_DOT_MIN(kvs_x86_dot_q4_1, kvs_block_q4_1, kvs_x86_unpack_nibbles(x[i].qs))
KVS_X86_DOT_MIN(kvs_x86_dot_q5_1, kvs_block_q5_1,
                _mm256_or_si256(kvs_x86_unpack_nibbles(x[i].qs), kvs_x86_q5_high(x[i].qh)))

/* Q5_0 x Q8_0: q = (nibble | fifth bit << 4) - 16 in -16..15. */
static float kvs_x86_dot_q5_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_0 *x = w;
    const kvs_block_q8_0 *y = a;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        __m256i q = _mm256_sub_epi8(_mm256_or_si256(kvs_x86_unpack_nibbles(x[i].qs), kvs_x86_q5_high(x[i].qh)),
                                    _mm256_set1_epi8(16));
        __m256i p = kvs_x86_dot_s8(q, _mm256_loadu_si256((const __m256i *)y[i].qs));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)), _mm256_cvtepi32_ps(p), acc);
    }
    return kvs_x86_hsum_ps(acc);
}

/* --- Q2_K, Q3_K against Q8_K --------------------------------------------------- */

/* Both keep 2-bit quants in 64 bytes: elements 128h + 32j + l (h 0..1,
 * j 0..3, l 0..31) are bits 2j..2j+1 of qs[32h + l], so one 32-byte load
 * shifted by 2j gives 32 consecutive elements, i.e. the 16-element
 * sub-blocks s = 8h + 2j (lanes 0..3 of a dpbusd) and s + 1 (lanes 4..7). */
static inline __m256i kvs_x86_sub_scales(int lo, int hi)
{
    return _mm256_set_m128i(_mm_set1_epi32(hi), _mm_set1_epi32(lo));
}

/* Q2_K: sa = sum_s (scales[s] & 15) * (q . a)_s with q 0..3 (pairs <= 762);
 * sm = sum_s (scales[s] >> 4) * bsums[s]. Integer sums equal the reference's. */
static float kvs_x86_dot_q2_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q2_K *x = w;
    const kvs_block_q8_K *y = a;
    const __m256i m3 = _mm256_set1_epi8(3);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        __m256i acc = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int s = 8 * h + 2 * j;
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                __m256i p = kvs_x86_dpbusd(_mm256_setzero_si256(), v,
                                           _mm256_loadu_si256((const __m256i *)(y[i].qs + 128 * h + 32 * j)));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, kvs_x86_sub_scales(x[i].scales[s] & 0xF,
                                                                                       x[i].scales[s + 1] & 0xF)));
            }
        }
        /* mins: 16 x (4-bit min * int16 bsum) via madd */
        __m128i sc = _mm_loadu_si128((const __m128i *)x[i].scales);
        __m256i mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0F)));
        __m256i pm = _mm256_madd_epi16(mn, _mm256_loadu_si256((const __m256i *)y[i].bsums));
        int sa = kvs_x86_hsum_epi32(acc), sm = kvs_x86_hsum_epi32(pm);
        sum += KVS_F16(x[i].d) * y[i].d * (float)sa - KVS_F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

/* Q3_K: value = q2 - 4 where the hmask bit is clear, i.e. u - 4 with
 * u = q2 + 4 * bit in 0..7 (pairs <= 1778 fit int16); the -4 comes back as
 * -4 * sum_s scale_s * bsums[s]. Element 128h + 32j + l has its hmask bit
 * at bit 4h + j of hmask[l]; scales are the signed 6-bit ones of the
 * reference (kvs_q3k_scale, gguf-facts §2.4). */
static float kvs_x86_dot_q3_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q3_K *x = w;
    const kvs_block_q8_K *y = a;
    const __m256i m3 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sc[16];
        for (int s = 0; s < 16; s++)
            sc[s] = kvs_q3k_scale(x[i].scales, s);
        __m256i hm = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        __m256i acc = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
            for (int j = 0; j < 4; j++) {
                const int s = 8 * h + 2 * j;
                __m256i v = _mm256_and_si256(_mm256_srli_epi16(q, 2 * j), m3);
                __m256i hb = _mm256_and_si256(_mm256_srli_epi16(hm, 4 * h + j), one);
                v = _mm256_add_epi8(v, _mm256_slli_epi16(hb, 2)); /* hb <= 1: no carry across bytes */
                __m256i p = kvs_x86_dpbusd(_mm256_setzero_si256(), v,
                                           _mm256_loadu_si256((const __m256i *)(y[i].qs + 128 * h + 32 * j)));
                acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, kvs_x86_sub_scales(sc[s], sc[s + 1])));
            }
        }
        int off = 0;
        for (int s = 0; s < 16; s++)
            off += sc[s] * y[i].bsums[s];
        sum += KVS_F16(x[i].d) * y[i].d * (float)(kvs_x86_hsum_epi32(acc) - 4 * off);
    }
    return sum;
}

/* --- K-quant GEMM (Q4_K, Q5_K, Q6_K) over a packed Q8_K activation layout ---
 *
 * Activations (kvs_kernels_pack_row_bytes): per super-block KVS_PACKK_BYTES
 * = 320 bytes: the Q8_K block's 256 quants, its 16 bsums (int16), the 8 sums
 * of bsum pairs (one per 32-element sub-block, for the Q4_K/Q5_K mins) and
 * the float d; quantized exactly as kvs_x86_quant_q8_K.
 *
 * Weights are read in the file's layout. A tile is R weight rows x T
 * activation rows; for each (row, super-block) the quants are unpacked once
 * to unsigned bytes in element order (32 elements = one Q4_K/Q5_K sub-block
 * or two Q6_K sub-blocks per register) together with a register of the
 * sub-block scales (int16 lanes), and every token of the tile then costs per
 * 32 elements one maddubs (u8 x s8 pairs -> int16; |pair| <= 2 * 63 * 127
 * fits) and one madd / vpdpwssd (x scale -> int32). The integer super-block
 * sums are exactly the reference's; the Q6_K offset (q - 32) comes back as
 * 32 * sum scale_s * bsums_s, the Q4_K/Q5_K mins as sum mn_j * pair sum_j.
 * Per super-block and token the integer sums are reduced and combined in
 * float exactly as the reference and the single-row dot do (sum += d * d_y
 * * sa - dmin * d_y * sm, super-blocks in order), so that results equal the
 * vec_dot path bit for bit: a model's outputs do not move with the path
 * (MoE routing near ties would amplify any difference). Decode (T = 1) uses tiles of 4 rows, prefill 1 row x
 * KVS_X86_KQ_T tokens. */

#define KVS_PACKK_QS 0
#define KVS_PACKK_BSUMS 256
#define KVS_PACKK_PSUMS 288
#define KVS_PACKK_D 304

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define KVS_X86_KQ_T 8 /* 32 vector registers */
#else
#define KVS_X86_KQ_T 4
#endif
#ifndef KVS_X86_KQ_PREFETCH
#define KVS_X86_KQ_PREFETCH 512 /* bytes ahead in each weight row into L1; 0: none */
#endif
#ifndef KVS_X86_KQ_PREFETCH_L2
#define KVS_X86_KQ_PREFETCH_L2 16384 /* bytes ahead into L2 (rows are contiguous: the next tiles); 0: none */
#endif

static void kvs_x86_pack_q8_Kx(const float *src, void *dst, int64_t n)
{
    char *out = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, out += KVS_PACKK_BYTES) {
        kvs_block_q8_K b;
        kvs_x86_quant_q8_K(src + i * KVS_QK_K, &b, KVS_QK_K);
        int16_t ps[8];
        for (int j = 0; j < 8; j++)
            ps[j] = (int16_t)(b.bsums[2 * j] + b.bsums[2 * j + 1]); /* |.| <= 32 * 127 */
        memcpy(out + KVS_PACKK_QS, b.qs, sizeof b.qs);
        memcpy(out + KVS_PACKK_BSUMS, b.bsums, sizeof b.bsums);
        memcpy(out + KVS_PACKK_PSUMS, ps, sizeof ps);
        memcpy(out + KVS_PACKK_D, &b.d, sizeof b.d);
        memset(out + KVS_PACKK_D + 4, 0, KVS_PACKK_BYTES - KVS_PACKK_D - 4);
    }
}

/* acc + sum over pairs of (u * s) * sc: u unsigned, s signed bytes, sc int16
 * (callers bound |u * s| pairs by 32767 and the products by int32). */
static inline __m256i kvs_x86_mad_sc(__m256i acc, __m256i u, __m256i s, __m256i sc)
{
    __m256i p = _mm256_maddubs_epi16(u, s);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(acc, p, sc);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
}

/* Q4_K/Q5_K 12-byte scales as 8 scales and 8 mins in bytes (kvs_q4k_scale_min
 * for all j at once: j < 4 the low 6 bits of bytes j / j + 4, j >= 4 the
 * nibbles of bytes j + 4 with the top 2 bits of bytes j - 4 / j). */
static inline void kvs_x86_q4k_scales8(const uint8_t *b, uint64_t *sc, uint64_t *mn)
{
    uint32_t w0, w1, w2;
    memcpy(&w0, b, 4);
    memcpy(&w1, b + 4, 4);
    memcpy(&w2, b + 8, 4);
    *sc = (uint64_t)(w0 & 0x3F3F3F3Fu) | (uint64_t)((w2 & 0x0F0F0F0Fu) | ((w0 >> 6) & 0x03030303u) << 4) << 32;
    *mn = (uint64_t)(w1 & 0x3F3F3F3Fu) | (uint64_t)(((w2 >> 4) & 0x0F0F0F0Fu) | ((w1 >> 6) & 0x03030303u) << 4) << 32;
}

/* int16 word k of both 128-bit lanes (lane 0: word lo, lane 1: word hi) in
 * every word of the lane: a pshufb index. */
static inline __m256i kvs_x86_word_idx(int lo, int hi)
{
    return _mm256_set_m128i(_mm_set1_epi16((short)((2 * hi) | (2 * hi + 1) << 8)),
                            _mm_set1_epi16((short)((2 * lo) | (2 * lo + 1) << 8)));
}

static inline __attribute__((always_inline)) void kvs_x86_kq_tile(const int type, const int R, const int T, int64_t nb,
                                                                  const char *w, size_t w_stride, const char *a,
                                                                  size_t a_stride, float *y, size_t y_stride)
{
    const size_t bb = type == KVS_TYPE_Q4_K ? sizeof(kvs_block_q4_K)
                      : type == KVS_TYPE_Q5_K ? sizeof(kvs_block_q5_K)
                                              : sizeof(kvs_block_q6_K);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    float accf[4][KVS_X86_KQ_T];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < T; t++)
            accf[r][t] = 0.0f;
    for (int64_t i = 0; i < nb; i++) {
        const char *ab = a + (size_t)i * KVS_PACKK_BYTES;
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const char *wb = w + (size_t)r * w_stride + (size_t)i * bb;
#if KVS_X86_KQ_PREFETCH > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 128, _MM_HINT_T0);
            if (type == KVS_TYPE_Q6_K)
                _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 192, _MM_HINT_T0);
#endif
#if KVS_X86_KQ_PREFETCH_L2 > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2, _MM_HINT_T1);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 64, _MM_HINT_T1);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 128, _MM_HINT_T1);
            if (type == KVS_TYPE_Q6_K)
                _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 192, _MM_HINT_T1);
#endif
            /* decode: a second accumulator per row halves the vpdpwssd
             * dependency chain (prefill has T independent chains) */
            __m256i acci[KVS_X86_KQ_T], acc2 = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int t = 0; t < T; t++)
                acci[t] = _mm256_setzero_si256();
            if (type == KVS_TYPE_Q6_K) {
                const kvs_block_q6_K *x = (const kvs_block_q6_K *)wb;
                const __m256i S = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
                const __m256i m2 = _mm256_set1_epi8(3);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m256i Sh = h ? _mm256_permute2x128_si256(S, S, 0x11) : _mm256_permute2x128_si256(S, S, 0x00);
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(x->ql + 64 * h + 32));
                    const __m256i qh = _mm256_loadu_si256((const __m256i *)(x->qh + 32 * h));
#pragma GCC unroll 4
                    for (int g = 0; g < 4; g++) {
                        const __m256i lo = (g & 1) ? l1 : l0;
                        __m256i v = g < 2 ? _mm256_and_si256(lo, m4) : _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4);
                        __m256i hb = _mm256_and_si256(g ? _mm256_srli_epi16(qh, 2 * g) : qh, m2);
                        v = _mm256_or_si256(v, _mm256_slli_epi16(hb, 4));
                        const __m256i sv = _mm256_shuffle_epi8(Sh, kvs_x86_word_idx(2 * g, 2 * g + 1));
                        if (T == 1 && (g & 1)) {
                            acc2 = kvs_x86_mad_sc(acc2, v, _mm256_loadu_si256((const __m256i *)(ab + 128 * h + 32 * g)), sv);
                            continue;
                        }
#pragma GCC unroll 8
                        for (int t = 0; t < T; t++)
                            acci[t] = kvs_x86_mad_sc(acci[t], v,
                                                     _mm256_loadu_si256((const __m256i *)(ab + (size_t)t * a_stride +
                                                                                          128 * h + 32 * g)),
                                                     sv);
                    }
                }
                const float d = KVS_F16(x->d);
                if (T == 1)
                    acci[0] = _mm256_add_epi32(acci[0], acc2);
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const char *at = ab + (size_t)t * a_stride;
                    const __m256i off = _mm256_madd_epi16(S, _mm256_loadu_si256((const __m256i *)(at + KVS_PACKK_BSUMS)));
                    const int sa = kvs_x86_hsum_epi32(_mm256_sub_epi32(acci[t], _mm256_slli_epi32(off, 5)));
                    float dy;
                    memcpy(&dy, at + KVS_PACKK_D, 4);
                    accf[r][t] += d * dy * (float)sa;
                }
            } else {
                const kvs_block_q4_K *x4 = (const kvs_block_q4_K *)wb;
                const kvs_block_q5_K *x5 = (const kvs_block_q5_K *)wb;
                const uint8_t *scales = type == KVS_TYPE_Q4_K ? x4->scales : x5->scales;
                const uint8_t *qs = type == KVS_TYPE_Q4_K ? x4->qs : x5->qs;
                uint64_t sc8, mn8;
                kvs_x86_q4k_scales8(scales, &sc8, &mn8);
                const __m256i scv = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
                const __m128i mn16 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8));
                __m256i qh = _mm256_setzero_si256();
                if (type == KVS_TYPE_Q5_K)
                    qh = _mm256_loadu_si256((const __m256i *)x5->qh);
                const __m256i b4 = _mm256_set1_epi8(0x10);
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
                    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (type == KVS_TYPE_Q5_K) {
                        /* bit 2c (lo) / 2c + 1 (hi) of qh[l] moved to bit 4 of each byte */
                        const __m256i hl = 2 * c <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4);
                        const __m256i hh = 2 * c + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 3);
                        lo = _mm256_or_si256(lo, _mm256_and_si256(hl, b4));
                        hi = _mm256_or_si256(hi, _mm256_and_si256(hh, b4));
                    }
                    const __m256i slo = _mm256_shuffle_epi8(scv, kvs_x86_word_idx(2 * c, 2 * c));
                    const __m256i shi = _mm256_shuffle_epi8(scv, kvs_x86_word_idx(2 * c + 1, 2 * c + 1));
                    if (T == 1) {
                        acci[0] = kvs_x86_mad_sc(acci[0], lo, _mm256_loadu_si256((const __m256i *)(ab + 64 * c)), slo);
                        acc2 = kvs_x86_mad_sc(acc2, hi, _mm256_loadu_si256((const __m256i *)(ab + 64 * c + 32)), shi);
                        continue;
                    }
#pragma GCC unroll 8
                    for (int t = 0; t < T; t++) {
                        const char *aq = ab + (size_t)t * a_stride + 64 * c;
                        acci[t] = kvs_x86_mad_sc(acci[t], lo, _mm256_loadu_si256((const __m256i *)aq), slo);
                        acci[t] = kvs_x86_mad_sc(acci[t], hi, _mm256_loadu_si256((const __m256i *)(aq + 32)), shi);
                    }
                }
                if (T == 1)
                    acci[0] = _mm256_add_epi32(acci[0], acc2);
                const float d = KVS_F16(type == KVS_TYPE_Q4_K ? x4->d : x5->d);
                const float dmin = KVS_F16(type == KVS_TYPE_Q4_K ? x4->dmin : x5->dmin);
#pragma GCC unroll 8
                for (int t = 0; t < T; t++) {
                    const char *at = ab + (size_t)t * a_stride;
                    const __m128i m = _mm_madd_epi16(mn16, _mm_loadu_si128((const __m128i *)(at + KVS_PACKK_PSUMS)));
                    /* [sa, sm, sa, sm] from the 8 + 4 lanes */
                    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acci[t]), _mm256_extracti128_si256(acci[t], 1));
                    h = _mm_hadd_epi32(h, m);
                    h = _mm_hadd_epi32(h, h);
                    const int sa = _mm_cvtsi128_si32(h), sm = _mm_extract_epi32(h, 1);
                    float dy;
                    memcpy(&dy, at + KVS_PACKK_D, 4);
                    accf[r][t] += d * dy * (float)sa - dmin * dy * (float)sm;
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            y[(size_t)t * y_stride + (size_t)r] = accf[r][t];
}

#define KVS_X86_KQ_TCASE(N)                                                                          \
    case N:                                                                                          \
        if (N < KVS_X86_KQ_T)                                                                        \
            kvs_x86_kq_tile(type, 1, N < KVS_X86_KQ_T ? N : 1, nb, wr, w_stride, at, a_stride, yt, y_stride); \
        break;

static inline __attribute__((always_inline)) void kvs_x86_kq_gemm(const int type, int64_t n, const void *w,
                                                                  size_t w_stride, int64_t nr, const void *a,
                                                                  size_t a_stride, int64_t nt, float *y,
                                                                  size_t y_stride)
{
    const int64_t nb = n / KVS_QK_K;
    const char *W = w, *A = a;
    if (nt == 1) {
        int64_t r = 0;
        for (; r + 4 <= nr; r += 4)
            kvs_x86_kq_tile(type, 4, 1, nb, W + (size_t)r * w_stride, w_stride, A, a_stride, y + r, y_stride);
        const char *wr = W + (size_t)r * w_stride;
        switch (nr - r) {
        case 1: kvs_x86_kq_tile(type, 1, 1, nb, wr, w_stride, A, a_stride, y + r, y_stride); break;
        case 2: kvs_x86_kq_tile(type, 2, 1, nb, wr, w_stride, A, a_stride, y + r, y_stride); break;
        case 3: kvs_x86_kq_tile(type, 3, 1, nb, wr, w_stride, A, a_stride, y + r, y_stride); break;
        default: break;
        }
        return;
    }
    for (int64_t r = 0; r < nr; r++) {
        const char *wr = W + (size_t)r * w_stride;
        int64_t t = 0;
        for (; t + KVS_X86_KQ_T <= nt; t += KVS_X86_KQ_T)
            kvs_x86_kq_tile(type, 1, KVS_X86_KQ_T, nb, wr, w_stride, A + (size_t)t * a_stride, a_stride,
                            y + (size_t)t * y_stride + r, y_stride);
        const char *at = A + (size_t)t * a_stride;
        float *yt = y + (size_t)t * y_stride + r;
        switch (nt - t) {
            KVS_X86_KQ_TCASE(1)
            KVS_X86_KQ_TCASE(2)
            KVS_X86_KQ_TCASE(3)
            KVS_X86_KQ_TCASE(4)
            KVS_X86_KQ_TCASE(5)
            KVS_X86_KQ_TCASE(6)
            KVS_X86_KQ_TCASE(7)
        default: break;
        }
    }
}

static void kvs_x86_gemm_q4_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                              int64_t nt, float *y, size_t y_stride)
{
    kvs_x86_kq_gemm(KVS_TYPE_Q4_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_x86_gemm_q5_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                              int64_t nt, float *y, size_t y_stride)
{
    kvs_x86_kq_gemm(KVS_TYPE_Q5_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_x86_gemm_q6_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                              int64_t nt, float *y, size_t y_stride)
{
    kvs_x86_kq_gemm(KVS_TYPE_Q6_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

/* Table entries shared by the AVX2 and AVX-512 tables. */
#define KVS_X86_ENTRIES                                                                              \
    .quant_act[KVS_TYPE_Q8_0] = kvs_x86_quant_q8_0, .quant_act[KVS_TYPE_Q8_1] = kvs_x86_quant_q8_1, \
    .quant_act[KVS_TYPE_Q8_K] = kvs_x86_quant_q8_K, .dot[KVS_TYPE_Q8_0] = kvs_x86_dot_q8_0,          \
    .dot[KVS_TYPE_Q4_0] = kvs_x86_dot_q4_0, .dot[KVS_TYPE_Q4_K] = kvs_x86_dot_q4_K,                 \
    .dot[KVS_TYPE_Q5_K] = kvs_x86_dot_q5_K, .dot[KVS_TYPE_Q6_K] = kvs_x86_dot_q6_K,                 \
    .dot[KVS_TYPE_F16] = kvs_x86_dot_f16, .dot4[KVS_TYPE_Q8_0] = kvs_x86_dot4_q8_0,                 \
    .dot4[KVS_TYPE_Q4_0] = kvs_x86_dot4_q4_0, .dot4[KVS_TYPE_Q4_K] = kvs_x86_dot4_q4_K,             \
    .dot4[KVS_TYPE_Q6_K] = kvs_x86_dot4_q6_K, .dot[KVS_TYPE_F32] = kvs_x86_dot_f32,                 \
    .dot[KVS_TYPE_BF16] = kvs_x86_dot_bf16, .dot[KVS_TYPE_Q4_1] = kvs_x86_dot_q4_1,                 \
    .dot[KVS_TYPE_Q5_0] = kvs_x86_dot_q5_0, .dot[KVS_TYPE_Q5_1] = kvs_x86_dot_q5_1,                 \
    .dot[KVS_TYPE_Q2_K] = kvs_x86_dot_q2_K, .dot[KVS_TYPE_Q3_K] = kvs_x86_dot_q3_K,                 \
    .quant_act[KVS_TYPE_BF16] = kvs_x86_quant_bf16, .quant_act[KVS_TYPE_F16] = kvs_x86_quant_f16,   \
    .pack_act[KVS_TYPE_Q4_K] = kvs_x86_pack_q8_Kx, .pack_act[KVS_TYPE_Q5_K] = kvs_x86_pack_q8_Kx,   \
    .pack_act[KVS_TYPE_Q6_K] = kvs_x86_pack_q8_Kx, .gemm[KVS_TYPE_Q4_K] = kvs_x86_gemm_q4_K,         \
    .gemm[KVS_TYPE_Q5_K] = kvs_x86_gemm_q5_K, .gemm[KVS_TYPE_Q6_K] = kvs_x86_gemm_q6_K,            \
    .dot_gemm[KVS_TYPE_F16] = kvs_x86_dot_gemm_f16, .dot_gemm[KVS_TYPE_BF16] = kvs_x86_dot_gemm_bf16

#endif

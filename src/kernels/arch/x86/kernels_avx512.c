/* AVX-512 (F, BW, VL, DQ, VNNI) table (this file is compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx2 -mfma
 * -mf16c; kvs_kernels_get hands it out only when the CPU has all of them).
 *
 * The shared x86 kernels (kernels_x86_impl.h) compile here with VNNI for
 * their u8 x s8 dot step. Q8_0 and Q4_0 -- the decode-critical types -- get
 * 512-bit versions below that handle two 32-element blocks per register. */
#include "kernels/arch/x86/kernels_x86_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

/* Two consecutive Q8_0-layout blocks' 32 quants each as one register
 * (block i in the low 256 bits). */
static inline __m512i kvs_avx512_load2(const int8_t *q0, const int8_t *q1)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q0)),
                              _mm256_loadu_si256((const __m256i *)q1), 1);
}

static inline __m512i kvs_avx512_unpack2_q4_0(const uint8_t *q0, const uint8_t *q1)
{
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(kvs_x86_unpack_q4_0(q0)), kvs_x86_unpack_q4_0(q1), 1);
    return v;
}

/* Signed s8 x s8 dot of 4-byte groups (see kvs_x86_dot_s8 for the bounds). */
static inline __m512i kvs_avx512_dot_s8(__m512i w, __m512i a)
{
    __mmask64 neg = _mm512_movepi8_mask(w);
    __m512i aw = _mm512_abs_epi8(w);
    __m512i sa = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sa);
}

static inline __m512 kvs_avx512_scale2(float d0, float d1)
{
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1), 1);
}

#define KVS_AVX512_DOT_LEGACY(NAME, WBLOCK, UNPACK2, UNPACK1)                                        \
    static float NAME(int64_t n, const void *w, const void *a)                                       \
    {                                                                                                \
        const WBLOCK *x = w;                                                                         \
        const kvs_block_q8_0 *y = a;                                                                 \
        __m512 acc = _mm512_setzero_ps();                                                            \
        int64_t nb = n / KVS_QK, i = 0;                                                              \
        for (; i + 1 < nb; i += 2) {                                                                 \
            __m512i p = kvs_avx512_dot_s8(UNPACK2, kvs_avx512_load2(y[i].qs, y[i + 1].qs));          \
            __m512 d = kvs_avx512_scale2(KVS_F16(x[i].d) * KVS_F16(y[i].d),                          \
                                         KVS_F16(x[i + 1].d) * KVS_F16(y[i + 1].d));                 \
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc);                                    \
        }                                                                                            \
        float s = _mm512_reduce_add_ps(acc);                                                         \
        for (; i < nb; i++) {                                                                        \
            __m256i p = kvs_x86_dot_s8(UNPACK1, _mm256_loadu_si256((const __m256i *)y[i].qs));       \
            s += kvs_x86_hsum_ps(_mm256_mul_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)),   \
                                               _mm256_cvtepi32_ps(p)));                              \
        }                                                                                            \
        return s;                                                                                    \
    }

KVS_AVX512_DOT_LEGACY(kvs_avx512_dot_q8_0, kvs_block_q8_0, kvs_avx512_load2(x[i].qs, x[i + 1].qs),
                      _mm256_loadu_si256((const __m256i *)x[i].qs))
KVS_AVX512_DOT_LEGACY(kvs_avx512_dot_q4_0, kvs_block_q4_0, kvs_avx512_unpack2_q4_0(x[i].qs, x[i + 1].qs),
                      kvs_x86_unpack_q4_0(x[i].qs))

/* One weight row against 4 activation rows, two blocks per register: the
 * weight pair is loaded, unpacked and sign-split once for 4 tokens. */
#define KVS_AVX512_DOT4_LEGACY(NAME, WBLOCK, UNPACK2, SINGLE)                                        \
    static void NAME(int64_t n, const void *w, const void *a, size_t a_stride, float out[4])        \
    {                                                                                                \
        const WBLOCK *x = w;                                                                         \
        const kvs_block_q8_0 *y[4];                                                                  \
        for (int t = 0; t < 4; t++)                                                                  \
            y[t] = (const kvs_block_q8_0 *)((const char *)a + (size_t)t * a_stride);                 \
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),             \
                         _mm512_setzero_ps()};                                                       \
        int64_t nb = n / KVS_QK, i = 0;                                                              \
        for (; i + 1 < nb; i += 2) {                                                                 \
            __m512i qw = UNPACK2;                                                                    \
            __mmask64 neg = _mm512_movepi8_mask(qw);                                                 \
            __m512i aw = _mm512_abs_epi8(qw);                                                        \
            float d0 = KVS_F16(x[i].d), d1 = KVS_F16(x[i + 1].d);                                    \
            for (int t = 0; t < 4; t++) {                                                            \
                __m512i qa = kvs_avx512_load2(y[t][i].qs, y[t][i + 1].qs);                           \
                qa = _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa);                      \
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, qa);                     \
                __m512 d = kvs_avx512_scale2(d0 * KVS_F16(y[t][i].d), d1 * KVS_F16(y[t][i + 1].d));  \
                acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc[t]);                          \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < 4; t++)                                                                  \
            out[t] = _mm512_reduce_add_ps(acc[t]);                                                   \
        if (i < nb) {                                                                                \
            for (int t = 0; t < 4; t++)                                                              \
                out[t] += SINGLE(KVS_QK, x + i, y[t] + i);                                           \
        }                                                                                            \
    }

KVS_AVX512_DOT4_LEGACY(kvs_avx512_dot4_q8_0, kvs_block_q8_0, kvs_avx512_load2(x[i].qs, x[i + 1].qs),
                       kvs_x86_dot_q8_0)
KVS_AVX512_DOT4_LEGACY(kvs_avx512_dot4_q4_0, kvs_block_q4_0, kvs_avx512_unpack2_q4_0(x[i].qs, x[i + 1].qs),
                       kvs_x86_dot_q4_0)

const struct kvs_kernels kvs_kernels_avx512 = {
    .isa = KVS_ISA_AVX512,
    KVS_KERNELS_REF_ENTRIES,
    KVS_X86_ENTRIES,
    .dot[KVS_TYPE_Q8_0] = kvs_avx512_dot_q8_0,
    .dot[KVS_TYPE_Q4_0] = kvs_avx512_dot_q4_0,
    .dot4[KVS_TYPE_Q8_0] = kvs_avx512_dot4_q8_0,
    .dot4[KVS_TYPE_Q4_0] = kvs_avx512_dot4_q4_0,
};

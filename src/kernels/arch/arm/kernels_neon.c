/* AArch64 NEON table (compiled only on ARM; CMake adds src/kernels/arch/arm
 * there). Vectorized: Q8_0 activation quantization; vec_dot for every weight
 * type (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K; SDOT when the compiler targets the dot-product extension, widening
 * multiplies otherwise). Dequantization and the other activation formats use
 * the scalar reference. scripts/neon-check.sh runs the SIMD-vs-scalar tests
 * of tests/kernels/test_kernels_dot.c on this table under qemu-user.
 *
 * Exactness as on x86 (gguf-facts §2.5): the Q8_0 quantizer rounds half to
 * even (FCVTNS), as llama.cpp's NEON path and our scalar reference do; the
 * integer block sums equal the reference's; only float summation order
 * differs. */
#if defined(__ARM_NEON) && defined(__aarch64__)

#include <arm_neon.h>

#include "kernels/kernels_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

/* acc + sums of 4 adjacent s8*s8 products per lane. Without SDOT: products
 * fit int16 (|-128 * -128| = 16384), pairwise-widened to int32. */
static inline int32x4_t kvs_neon_dot_s8(int32x4_t acc, int8x16_t a, int8x16_t b)
{
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    int16x8_t hi = vmull_high_s8(a, b);
    return vaddq_s32(acc, vaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}

static void kvs_neon_quant_q8_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float32x4_t v[8];
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int k = 0; k < 8; k++) {
            v[k] = vld1q_f32(x + 4 * k);
            m = vmaxq_f32(m, vabsq_f32(v[k]));
        }
        float amax = vmaxvq_f32(m);
        float mult = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int k = 0; k < 8; k += 2) {
            int32x4_t q0 = vcvtnq_s32_f32(vmulq_n_f32(v[k], mult));
            int32x4_t q1 = vcvtnq_s32_f32(vmulq_n_f32(v[k + 1], mult));
            int16x8_t h = vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1));
            vst1_s8(b[i].qs + 4 * k, vqmovn_s16(h));
        }
        b[i].d = kvs_f32_to_f16(amax / 127.0f);
    }
}

static float kvs_neon_dot_q8_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q8_0 *x = w, *y = a;
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        int32x4_t s = vdupq_n_s32(0);
        s = kvs_neon_dot_s8(s, vld1q_s8(x[i].qs), vld1q_s8(y[i].qs));
        s = kvs_neon_dot_s8(s, vld1q_s8(x[i].qs + 16), vld1q_s8(y[i].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(s), kvs_f16_to_f32(x[i].d) * kvs_f16_to_f32(y[i].d));
    }
    return vaddvq_f32(acc);
}

static float kvs_neon_dot_q4_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_0 *x = w;
    const kvs_block_q8_0 *y = a;
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    const int8x16_t off = vdupq_n_s8(8);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        uint8x16_t q = vld1q_u8(x[i].qs);
        int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, m4)), off); /* elements 0..15 */
        int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), off); /* elements 16..31 */
        int32x4_t s = vdupq_n_s32(0);
        s = kvs_neon_dot_s8(s, lo, vld1q_s8(y[i].qs));
        s = kvs_neon_dot_s8(s, hi, vld1q_s8(y[i].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(s), kvs_f16_to_f32(x[i].d) * kvs_f16_to_f32(y[i].d));
    }
    return vaddvq_f32(acc);
}

/* --- float types ---------------------------------------------------------- */

/* 4 values widened to F32 (exact for all three types), and one value. */
static inline float32x4_t kvs_neon_f16x4(const uint16_t *p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
static inline float32x4_t kvs_neon_bf16x4(const uint16_t *p)
{
    return vreinterpretq_f32_u32(vshlq_n_u32(vmovl_u16(vld1_u16(p)), 16));
}
static inline float kvs_neon_f32(float v) { return v; }

/* Float dots (weights and activations of one type): four accumulators of 4,
 * then a scalar tail. */
#define KVS_NEON_DOT_FLOAT(NAME, T, LOAD4, ONE)                                                    \
    static float NAME(int64_t n, const void *w, const void *a)                                   \
    {                                                                                            \
        const T *x = w, *y = a;                                                                  \
        float32x4_t acc[4] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f), vdupq_n_f32(0.0f),           \
                              vdupq_n_f32(0.0f)};                                                \
        int64_t i = 0;                                                                           \
        for (; i + 16 <= n; i += 16)                                                             \
            for (int k = 0; k < 4; k++)                                                          \
                acc[k] = vfmaq_f32(acc[k], LOAD4(x + i + 4 * k), LOAD4(y + i + 4 * k));          \
        float s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));  \
        for (; i < n; i++)                                                                       \
            s += ONE(x[i]) * ONE(y[i]);                                                          \
        return s;                                                                                \
    }

KVS_NEON_DOT_FLOAT(kvs_neon_dot_f32, float, vld1q_f32, kvs_neon_f32)
KVS_NEON_DOT_FLOAT(kvs_neon_dot_f16, uint16_t, kvs_neon_f16x4, kvs_f16_to_f32)
KVS_NEON_DOT_FLOAT(kvs_neon_dot_bf16, uint16_t, kvs_neon_bf16x4, kvs_bf16_to_f32)

/* --- Q4_1, Q5_0, Q5_1 ---------------------------------------------------------- */

/* Low nibbles (elements 0..15) and high nibbles (16..31) of a 16-byte block. */
static inline void kvs_neon_nibbles(const uint8_t *qs, int8x16_t *lo, int8x16_t *hi)
{
    uint8x16_t q = vld1q_u8(qs);
    *lo = vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0F)));
    *hi = vreinterpretq_s8_u8(vshrq_n_u8(q, 4));
}

/* 0x10 in byte j where bit j (j = 0..15, or 16..31 for the second vector) of
 * the little-endian qh is set. */
static inline void kvs_neon_q5_high(const uint8_t qh[4], int8x16_t *h0, int8x16_t *h1)
{
    static const uint8_t bits[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vld1q_u8(bits), v16 = vdupq_n_u8(0x10);
    uint8x16_t x0 = vcombine_u8(vdup_n_u8(qh[0]), vdup_n_u8(qh[1]));
    uint8x16_t x1 = vcombine_u8(vdup_n_u8(qh[2]), vdup_n_u8(qh[3]));
    *h0 = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(x0, b), v16));
    *h1 = vreinterpretq_s8_u8(vandq_u8(vtstq_u8(x1, b), v16));
}

static inline int32x4_t kvs_neon_dot32(int8x16_t w0, int8x16_t w1, const int8_t *a)
{
    return kvs_neon_dot_s8(kvs_neon_dot_s8(vdupq_n_s32(0), w0, vld1q_s8(a)), w1, vld1q_s8(a + 16));
}

/* Q5_0 / Q5_1 quants 0..31 of one block: nibble | fifth bit << 4. */
static inline void kvs_neon_q5_quants(const uint8_t *qs, const uint8_t qh[4], int8x16_t *lo, int8x16_t *hi)
{
    int8x16_t h0, h1;
    kvs_neon_nibbles(qs, lo, hi);
    kvs_neon_q5_high(qh, &h0, &h1);
    *lo = vorrq_s8(*lo, h0);
    *hi = vorrq_s8(*hi, h1);
}

/* Q4_1 / Q5_1 x Q8_1: unsigned quants times d * d_y, plus m * s_y per block. */
#define KVS_NEON_DOT_MIN(NAME, BLOCK, UNPACK)                                                      \
    static float NAME(int64_t n, const void *w, const void *a)                                   \
    {                                                                                            \
        const BLOCK *x = w;                                                                      \
        const kvs_block_q8_1 *y = a;                                                             \
        float32x4_t acc = vdupq_n_f32(0.0f);                                                     \
        float mins = 0.0f;                                                                       \
        for (int64_t i = 0; i < n / KVS_QK; i++) {                                               \
            int8x16_t lo, hi;                                                                    \
            UNPACK;                                                                              \
            acc = vmlaq_n_f32(acc, vcvtq_f32_s32(kvs_neon_dot32(lo, hi, y[i].qs)),               \
                              kvs_f16_to_f32(x[i].d) * kvs_f16_to_f32(y[i].d));                  \
            mins += kvs_f16_to_f32(x[i].m) * kvs_f16_to_f32(y[i].s);                             \
        }                                                                                        \
        return vaddvq_f32(acc) + mins;                                                           \
    }

KVS_NEON_DOT_MIN(kvs_neon_dot_q4_1, kvs_block_q4_1, kvs_neon_nibbles(x[i].qs, &lo, &hi))
KVS_NEON_DOT_MIN(kvs_neon_dot_q5_1, kvs_block_q5_1, kvs_neon_q5_quants(x[i].qs, x[i].qh, &lo, &hi))

static float kvs_neon_dot_q5_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_0 *x = w;
    const kvs_block_q8_0 *y = a;
    const int8x16_t off = vdupq_n_s8(16);
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        int8x16_t lo, hi;
        kvs_neon_q5_quants(x[i].qs, x[i].qh, &lo, &hi);
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(kvs_neon_dot32(vsubq_s8(lo, off), vsubq_s8(hi, off), y[i].qs)),
                          kvs_f16_to_f32(x[i].d) * kvs_f16_to_f32(y[i].d));
    }
    return vaddvq_f32(acc);
}

/* --- K-quants against Q8_K ---------------------------------------------------- */

/* Sum of 16 products of int8 weights and activations. */
static inline int32_t kvs_neon_sum16(int8x16_t w, const int8_t *a)
{
    return vaddvq_s32(kvs_neon_dot_s8(vdupq_n_s32(0), w, vld1q_s8(a)));
}

/* Q4_K (qh NULL) / Q5_K integer sum A = sum_j sc[j] * (q . a)_j over the
 * eight 32-element sub-blocks: chunk c holds sub-blocks 2c (low nibbles of
 * qs[32c..]) and 2c + 1 (high nibbles); Q5_K's fifth bit of element e is
 * bit e / 32 of qh[e % 32]. Values <= 31: products fit int16. */
static int32_t kvs_neon_qk45_sum(const uint8_t *qs, const uint8_t *qh, const uint8_t sc[8], const int8_t *aq)
{
    const uint8x16_t m4 = vdupq_n_u8(0x0F), one = vdupq_n_u8(1);
    uint8x16_t hb0 = qh ? vld1q_u8(qh) : vdupq_n_u8(0), hb1 = qh ? vld1q_u8(qh + 16) : vdupq_n_u8(0);
    int32_t sum = 0;
    for (int c = 0; c < 4; c++) {
        uint8x16_t q0 = vld1q_u8(qs + 32 * c), q1 = vld1q_u8(qs + 32 * c + 16);
        uint8x16_t l0 = vandq_u8(q0, m4), l1 = vandq_u8(q1, m4), h0 = vshrq_n_u8(q0, 4), h1 = vshrq_n_u8(q1, 4);
        if (qh) {
            const int8x16_t sl = vdupq_n_s8((int8_t)-(2 * c)), sh = vdupq_n_s8((int8_t)-(2 * c + 1));
            l0 = vorrq_u8(l0, vshlq_n_u8(vandq_u8(vshlq_u8(hb0, sl), one), 4));
            l1 = vorrq_u8(l1, vshlq_n_u8(vandq_u8(vshlq_u8(hb1, sl), one), 4));
            h0 = vorrq_u8(h0, vshlq_n_u8(vandq_u8(vshlq_u8(hb0, sh), one), 4));
            h1 = vorrq_u8(h1, vshlq_n_u8(vandq_u8(vshlq_u8(hb1, sh), one), 4));
        }
        int32_t s_lo = kvs_neon_sum16(vreinterpretq_s8_u8(l0), aq + 64 * c) +
                       kvs_neon_sum16(vreinterpretq_s8_u8(l1), aq + 64 * c + 16);
        int32_t s_hi = kvs_neon_sum16(vreinterpretq_s8_u8(h0), aq + 64 * c + 32) +
                       kvs_neon_sum16(vreinterpretq_s8_u8(h1), aq + 64 * c + 48);
        sum += sc[2 * c] * s_lo + sc[2 * c + 1] * s_hi;
    }
    return sum;
}

static inline int32_t kvs_neon_kmins(const uint8_t mn[8], const int16_t *bsums)
{
    int32_t m = 0;
    for (int j = 0; j < 8; j++)
        m += mn[j] * (bsums[2 * j] + bsums[2 * j + 1]);
    return m;
}

/* Q4_K and Q5_K share scales, mins and the nibble layout; Q5_K adds qh. */
#define KVS_NEON_DOT_QK45(NAME, BLOCK, QH)                                                               \
    static float NAME(int64_t n, const void *w, const void *a)                                           \
    {                                                                                                  \
        const BLOCK *x = w;                                                                            \
        const kvs_block_q8_K *y = a;                                                                   \
        float sum = 0.0f;                                                                              \
        for (int64_t i = 0; i < n / KVS_QK_K; i++) {                                                   \
            uint8_t sc[8], mn[8];                                                                      \
            for (int j = 0; j < 8; j++)                                                                \
                kvs_q4k_scale_min(j, x[i].scales, &sc[j], &mn[j]);                                     \
            int32_t sa = kvs_neon_qk45_sum(x[i].qs, QH, sc, y[i].qs), sm = kvs_neon_kmins(mn, y[i].bsums); \
            sum += kvs_f16_to_f32(x[i].d) * y[i].d * (float)sa -                                       \
                   kvs_f16_to_f32(x[i].dmin) * y[i].d * (float)sm;                                     \
        }                                                                                              \
        return sum;                                                                                    \
    }

KVS_NEON_DOT_QK45(kvs_neon_dot_q4_K, kvs_block_q4_K, NULL)
KVS_NEON_DOT_QK45(kvs_neon_dot_q5_K, kvs_block_q5_K, x[i].qh)

/* Q6_K: elements 128nn + 32g + l take the low (g < 2) or high nibble of
 * ql[64nn + 32(g & 1) + l] and bits 2g..2g+1 of qh[32nn + l], minus 32
 * (-32..31); sub-blocks of 16 with signed int8 scales. */
static float kvs_neon_dot_q6_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q6_K *x = w;
    const kvs_block_q8_K *y = a;
    const uint8x16_t m4 = vdupq_n_u8(0x0F), m3 = vdupq_n_u8(3);
    const int8x16_t off = vdupq_n_s8(32);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int32_t sa = 0;
        for (int nn = 0; nn < 2; nn++) {
            for (int g = 0; g < 4; g++) {
                for (int half = 0; half < 2; half++) {
                    const int l0 = 16 * half;
                    uint8x16_t lb = vld1q_u8(x[i].ql + 64 * nn + 32 * (g & 1) + l0);
                    uint8x16_t lo4 = g < 2 ? vandq_u8(lb, m4) : vshrq_n_u8(lb, 4);
                    uint8x16_t hb = vld1q_u8(x[i].qh + 32 * nn + l0);
                    uint8x16_t hi2 = vandq_u8(vshlq_u8(hb, vdupq_n_s8((int8_t)-(2 * g))), m3);
                    int8x16_t v = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(lo4, vshlq_n_u8(hi2, 4))), off);
                    const int e = 128 * nn + 32 * g + l0;
                    sa += x[i].scales[e / 16] * kvs_neon_sum16(v, y[i].qs + e);
                }
            }
        }
        sum += kvs_f16_to_f32(x[i].d) * y[i].d * (float)sa;
    }
    return sum;
}

/* Q2_K / Q3_K: elements 128h + 32j + l are bits 2j..2j+1 of qs[32h + l];
 * sub-blocks of 16. Q2_K: q 0..3 with 4-bit scale and min per sub-block;
 * Q3_K: q - 4 unless bit 4h + j of hmask[l] is set (-4..3), signed 6-bit
 * scales (kvs_q3k_scale). */
static float kvs_neon_dot_q2_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q2_K *x = w;
    const kvs_block_q8_K *y = a;
    const uint8x16_t m3 = vdupq_n_u8(3);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int32_t sa = 0, sm = 0;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * h + 2 * j + half;
                    uint8x16_t q = vld1q_u8(x[i].qs + 32 * h + 16 * half);
                    uint8x16_t v = vandq_u8(vshlq_u8(q, vdupq_n_s8((int8_t)-(2 * j))), m3);
                    sa += (x[i].scales[s] & 0xF) * kvs_neon_sum16(vreinterpretq_s8_u8(v), y[i].qs + 16 * s);
                }
        for (int s = 0; s < 16; s++)
            sm += (x[i].scales[s] >> 4) * y[i].bsums[s];
        sum += kvs_f16_to_f32(x[i].d) * y[i].d * (float)sa - kvs_f16_to_f32(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

static float kvs_neon_dot_q3_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q3_K *x = w;
    const kvs_block_q8_K *y = a;
    const uint8x16_t m3 = vdupq_n_u8(3), one = vdupq_n_u8(1);
    const int8x16_t four = vdupq_n_s8(4);
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sc[16];
        for (int s = 0; s < 16; s++)
            sc[s] = kvs_q3k_scale(x[i].scales, s);
        int32_t sa = 0;
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 4; j++)
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * h + 2 * j + half;
                    uint8x16_t q = vld1q_u8(x[i].qs + 32 * h + 16 * half);
                    uint8x16_t hm = vld1q_u8(x[i].hmask + 16 * half);
                    uint8x16_t v = vandq_u8(vshlq_u8(q, vdupq_n_s8((int8_t)-(2 * j))), m3);
                    uint8x16_t hb = vandq_u8(vshlq_u8(hm, vdupq_n_s8((int8_t)-(4 * h + j))), one);
                    int8x16_t val = vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(v, vshlq_n_u8(hb, 2))), four);
                    sa += sc[s] * kvs_neon_sum16(val, y[i].qs + 16 * s);
                }
        sum += kvs_f16_to_f32(x[i].d) * y[i].d * (float)sa;
    }
    return sum;
}

const struct kvs_kernels kvs_kernels_neon = {
    .isa = KVS_ISA_NEON,
    KVS_KERNELS_REF_ENTRIES,
    .quant_act[KVS_TYPE_Q8_0] = kvs_neon_quant_q8_0,
    .dot[KVS_TYPE_Q8_0] = kvs_neon_dot_q8_0,
    .dot[KVS_TYPE_Q4_0] = kvs_neon_dot_q4_0,
    .dot[KVS_TYPE_F32] = kvs_neon_dot_f32,
    .dot[KVS_TYPE_F16] = kvs_neon_dot_f16,
    .dot[KVS_TYPE_BF16] = kvs_neon_dot_bf16,
    .dot[KVS_TYPE_Q4_1] = kvs_neon_dot_q4_1,
    .dot[KVS_TYPE_Q5_0] = kvs_neon_dot_q5_0,
    .dot[KVS_TYPE_Q5_1] = kvs_neon_dot_q5_1,
    .dot[KVS_TYPE_Q2_K] = kvs_neon_dot_q2_K,
    .dot[KVS_TYPE_Q3_K] = kvs_neon_dot_q3_K,
    .dot[KVS_TYPE_Q4_K] = kvs_neon_dot_q4_K,
    .dot[KVS_TYPE_Q5_K] = kvs_neon_dot_q5_K,
    .dot[KVS_TYPE_Q6_K] = kvs_neon_dot_q6_K,
};

#endif

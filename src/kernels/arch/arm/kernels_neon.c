/* AArch64 NEON table (compiled only on ARM; CMake adds src/kernels/arch/arm
 * there). Vectorized: Q8_0 activation quantization, vec_dot for Q8_0 and
 * Q4_0 (SDOT when the compiler targets the dot-product extension, widening
 * multiplies otherwise). Everything else uses the scalar reference.
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

const struct kvs_kernels kvs_kernels_neon = {
    .isa = KVS_ISA_NEON,
    KVS_KERNELS_REF_ENTRIES,
    .quant_act[KVS_TYPE_Q8_0] = kvs_neon_quant_q8_0,
    .dot[KVS_TYPE_Q8_0] = kvs_neon_dot_q8_0,
    .dot[KVS_TYPE_Q4_0] = kvs_neon_dot_q4_0,
};

#endif

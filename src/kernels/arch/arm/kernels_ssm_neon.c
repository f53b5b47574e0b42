/* NEON Gated DeltaNet kernels (contracts: kvs_ssm_* in kernels.h; AArch64,
 * where NEON and the fused multiply-add are always there).
 *
 * The delta rule's two dot products per state row are summed in the order
 * of ggml's F32 dot on NEON (what llama.cpp's fused Gated DeltaNet op calls
 * on an ARM CPU): four 4-lane FMA accumulators over 16-element steps, folded
 * 0+2, 1+3, then 0+1, then the pairwise horizontal add; the d mod 16 tail one
 * product at a time (fused). */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <stddef.h>

#include "kernels/kernels_ssm_impl.h"

static inline float silu(float z) { return z / (1.0f + expf(-z)); }

void kvs_neon_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                            int64_t C, int K)
{
    const size_t sC = (size_t)C;
    int64_t c = c0;
    for (; c + 4 <= c1; c += 4) {
        const float32x4_t xv = vld1q_f32(x + c);
        float32x4_t s = vdupq_n_f32(0.0f);
        for (int i = 0; i < K - 1; i++)
            s = vfmaq_f32(s, vld1q_f32(wt + (size_t)i * sC + (size_t)c), vld1q_f32(state + (size_t)i * sC + (size_t)c));
        s = vfmaq_f32(s, vld1q_f32(wt + (size_t)(K - 1) * sC + (size_t)c), xv);
        vst1q_f32(y + c, s);
        for (int i = 0; i + 1 < K - 1; i++)
            vst1q_f32(state + (size_t)i * sC + (size_t)c, vld1q_f32(state + (size_t)(i + 1) * sC + (size_t)c));
        vst1q_f32(state + (size_t)(K - 2) * sC + (size_t)c, xv);
        for (int j = 0; j < 4; j++) y[c + j] = silu(y[c + j]);
    }
    for (; c < c1; c++) {
        float s = 0.0f;
        for (int i = 0; i < K - 1; i++) s = fmaf(wt[(size_t)i * sC + (size_t)c], state[(size_t)i * sC + (size_t)c], s);
        s = fmaf(wt[(size_t)(K - 1) * sC + (size_t)c], x[c], s);
        y[c] = silu(s);
        for (int i = 0; i + 1 < K - 1; i++) state[(size_t)i * sC + (size_t)c] = state[(size_t)(i + 1) * sC + (size_t)c];
        state[(size_t)(K - 2) * sC + (size_t)c] = x[c];
    }
}

static inline float dot_ggml_order(const float *x, const float *y, int64_t d)
{
    const int64_t np = d & ~(int64_t)15;
    float sum = 0.0f;
    if (np) {
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < np; i += 16) {
            a0 = vfmaq_f32(a0, vld1q_f32(x + i), vld1q_f32(y + i));
            a1 = vfmaq_f32(a1, vld1q_f32(x + i + 4), vld1q_f32(y + i + 4));
            a2 = vfmaq_f32(a2, vld1q_f32(x + i + 8), vld1q_f32(y + i + 8));
            a3 = vfmaq_f32(a3, vld1q_f32(x + i + 12), vld1q_f32(y + i + 12));
        }
        sum = vaddvq_f32(vaddq_f32(vaddq_f32(a0, a2), vaddq_f32(a1, a3)));
    }
    for (int64_t i = np; i < d; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
}

void kvs_neon_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                             float scale, float *o, int64_t d)
{
    const float32x4_t dv = vdupq_n_f32(decay);
    for (int64_t j = 0; j < d; j++) {
        float *row = S + (size_t)j * (size_t)d;
        for (int64_t i = 0; i < d; i += 4) vst1q_f32(row + i, vmulq_f32(vld1q_f32(row + i), dv));
        const float32x4_t dl = vdupq_n_f32((v[j] - dot_ggml_order(row, kk, d)) * beta);
        for (int64_t i = 0; i < d; i += 4) vst1q_f32(row + i, vfmaq_f32(vld1q_f32(row + i), vld1q_f32(kk + i), dl));
        o[j] = dot_ggml_order(row, q, d) * scale;
    }
}

void kvs_neon_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps)
{
    double ss = 0.0; /* as ggml's RMSNorm: float squares summed in double */
    for (int64_t i = 0; i < d; i++) ss += (double)(o[i] * o[i]);
    const float32x4_t sc = vdupq_n_f32(1.0f / sqrtf((float)(ss / (double)d) + eps));
    for (int64_t i = 0; i < d; i += 4) vst1q_f32(o + i, vmulq_f32(vmulq_f32(vld1q_f32(o + i), sc), vld1q_f32(w + i)));
    for (int64_t i = 0; i < d; i++) o[i] *= silu(z[i]);
}
#endif

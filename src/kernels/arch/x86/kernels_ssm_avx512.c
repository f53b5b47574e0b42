/* AVX-512 gated delta rule (contract: kvs_ssm_delta_step in kernels.h);
 * the conv and the gated norm use the AVX2 paths.
 *
 * The two dot products per state row are summed in the order ggml's CPU
 * backend uses on AVX-512 for an F32 dot (what llama.cpp's fused Gated
 * DeltaNet op calls, qwen35-facts §4.1): four 16-lane FMA accumulators over
 * 64-element steps, folded 0+2, 1+3, then 0+1, then a horizontal add; the
 * d mod 64 tail is added one product at a time (fused multiply-add). On
 * models whose activations are rounded to F16/BF16 before a matmul a
 * different summation order flips some roundings and moves the logits. */
#include <immintrin.h>
#include <math.h>

#include "kernels/kernels_ssm_impl.h"

static inline float dot_ggml_order(const float *x, const float *y, int64_t d)
{
    const int64_t np = d & ~(int64_t)63;
    float sum = 0.0f;
    if (np) {
        __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
        for (int64_t i = 0; i < np; i += 64) {
            a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i), a0);
            a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(y + i + 16), a1);
            a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 32), _mm512_loadu_ps(y + i + 32), a2);
            a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + i + 48), _mm512_loadu_ps(y + i + 48), a3);
        }
        a0 = _mm512_add_ps(a0, a2);
        a1 = _mm512_add_ps(a1, a3);
        sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    }
    for (int64_t i = np; i < d; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
}

void kvs_avx512_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                               float scale, float *o, int64_t d)
{
    const __m512 dv = _mm512_set1_ps(decay);
    for (int64_t j = 0; j < d; j++) {
        float *row = S + (size_t)j * (size_t)d;
        for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), dv));
        const float delta = (v[j] - dot_ggml_order(row, kk, d)) * beta;
        const __m512 dl = _mm512_set1_ps(delta);
        for (int64_t i = 0; i < d; i += 16)
            _mm512_storeu_ps(row + i, _mm512_fmadd_ps(_mm512_loadu_ps(kk + i), dl, _mm512_loadu_ps(row + i)));
        o[j] = dot_ggml_order(row, q, d) * scale;
    }
}

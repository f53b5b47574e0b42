/* AVX2 + FMA Gated DeltaNet kernels (contracts: kvs_ssm_* in kernels.h). */
#include <immintrin.h>
#include <math.h>

#include "kernels/kernels_ssm_impl.h"

static inline float silu(float z) { return z / (1.0f + expf(-z)); }

void kvs_avx2_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                            int64_t C, int K)
{
    const size_t sC = (size_t)C;
    int64_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        __m256 xv = _mm256_loadu_ps(x + c);
        __m256 s = _mm256_setzero_ps();
        for (int i = 0; i < K - 1; i++)
            s = _mm256_fmadd_ps(_mm256_loadu_ps(wt + (size_t)i * sC + (size_t)c),
                                _mm256_loadu_ps(state + (size_t)i * sC + (size_t)c), s);
        s = _mm256_fmadd_ps(_mm256_loadu_ps(wt + (size_t)(K - 1) * sC + (size_t)c), xv, s);
        _mm256_storeu_ps(y + c, s);
        for (int i = 0; i + 1 < K - 1; i++)
            _mm256_storeu_ps(state + (size_t)i * sC + (size_t)c, _mm256_loadu_ps(state + (size_t)(i + 1) * sC + (size_t)c));
        _mm256_storeu_ps(state + (size_t)(K - 2) * sC + (size_t)c, xv);
        for (int j = 0; j < 8; j++) y[c + j] = silu(y[c + j]);
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

/* An F32 dot in the order of ggml's on AVX2 (llama.cpp's fused Gated
 * DeltaNet op): four 8-lane FMA accumulators over 32-element steps, folded
 * 0+2, 1+3, then 0+1; the two 128-bit halves added, then two horizontal
 * adds; the d mod 32 tail one fused product at a time. */
static inline float dot_ggml_order(const float *x, const float *y, int64_t d)
{
    const int64_t np = d & ~(int64_t)31;
    float sum = 0.0f;
    if (np) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t i = 0; i < np; i += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), _mm256_loadu_ps(y + i + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), _mm256_loadu_ps(y + i + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), _mm256_loadu_ps(y + i + 24), a3);
        }
        const __m256 t = _mm256_add_ps(_mm256_add_ps(a0, a2), _mm256_add_ps(a1, a3));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        h = _mm_hadd_ps(h, h);
        sum = _mm_cvtss_f32(_mm_hadd_ps(h, h));
    }
    for (int64_t i = np; i < d; i++) sum = fmaf(x[i], y[i], sum);
    return sum;
}

void kvs_avx2_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                             float scale, float *o, int64_t d)
{
    const __m256 dv = _mm256_set1_ps(decay);
    for (int64_t j = 0; j < d; j++) {
        float *row = S + (size_t)j * (size_t)d;
        for (int64_t i = 0; i < d; i += 8) _mm256_storeu_ps(row + i, _mm256_mul_ps(_mm256_loadu_ps(row + i), dv));
        const __m256 dl = _mm256_set1_ps((v[j] - dot_ggml_order(row, kk, d)) * beta);
        for (int64_t i = 0; i < d; i += 8)
            _mm256_storeu_ps(row + i, _mm256_fmadd_ps(_mm256_loadu_ps(kk + i), dl, _mm256_loadu_ps(row + i)));
        o[j] = dot_ggml_order(row, q, d) * scale;
    }
}

void kvs_avx2_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps)
{
    double ss = 0.0; /* as ggml's RMSNorm: float squares summed in double */
    for (int64_t i = 0; i < d; i++) ss += (double)(o[i] * o[i]);
    const __m256 sc = _mm256_set1_ps(1.0f / sqrtf((float)(ss / (double)d) + eps));
    for (int64_t i = 0; i < d; i += 8)
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(o + i), sc), _mm256_loadu_ps(w + i)));
    for (int64_t i = 0; i < d; i++) o[i] *= silu(z[i]);
}

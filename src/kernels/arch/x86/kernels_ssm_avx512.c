/* AVX-512 gated delta rule (contract: kvs_ssm_delta_step in kernels.h);
 * the conv and the gated norm use the AVX2 paths. */
#include <immintrin.h>

#include "kernels/kernels_ssm_impl.h"

void kvs_avx512_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                               float scale, float *o, int64_t d)
{
    const __m512 dv = _mm512_set1_ps(decay);
    for (int64_t j = 0; j < d; j++) {
        float *row = S + (size_t)j * (size_t)d;
        __m512 kv = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 r = _mm512_mul_ps(_mm512_loadu_ps(row + i), dv);
            _mm512_storeu_ps(row + i, r);
            kv = _mm512_fmadd_ps(r, _mm512_loadu_ps(kk + i), kv);
        }
        const __m512 delta = _mm512_set1_ps(beta * (v[j] - _mm512_reduce_add_ps(kv)));
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 16) {
            __m512 r = _mm512_fmadd_ps(_mm512_loadu_ps(kk + i), delta, _mm512_loadu_ps(row + i));
            _mm512_storeu_ps(row + i, r);
            acc = _mm512_fmadd_ps(r, _mm512_loadu_ps(q + i), acc);
        }
        o[j] = _mm512_reduce_add_ps(acc) * scale;
    }
}

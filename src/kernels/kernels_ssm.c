/* Gated DeltaNet kernels (../shared/docs/qwen35-facts.md §3.2 steps 3, 7, 8):
 * scalar references and the dispatch to the ISA paths (AVX2, AVX-512, NEON). */
#include <math.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/kernels_ssm_impl.h"

static inline float silu(float z) { return z / (1.0f + expf(-z)); }

void kvs_ref_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                           int64_t C, int K)
{
    for (int64_t c = c0; c < c1; c++) {
        float s = 0.0f;
        for (int i = 0; i < K - 1; i++) s += wt[(size_t)i * (size_t)C + (size_t)c] * state[(size_t)i * (size_t)C + (size_t)c];
        s += wt[(size_t)(K - 1) * (size_t)C + (size_t)c] * x[c];
        y[c] = silu(s);
        for (int i = 0; i + 1 < K - 1; i++)
            state[(size_t)i * (size_t)C + (size_t)c] = state[(size_t)(i + 1) * (size_t)C + (size_t)c];
        state[(size_t)(K - 2) * (size_t)C + (size_t)c] = x[c];
    }
}

void kvs_ref_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                            float scale, float *o, int64_t d)
{
    for (int64_t j = 0; j < d; j++) {
        float *row = S + (size_t)j * (size_t)d;
        float kv = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            row[i] *= decay;
            kv += row[i] * kk[i];
        }
        const float delta = beta * (v[j] - kv);
        float acc = 0.0f;
        for (int64_t i = 0; i < d; i++) {
            row[i] += kk[i] * delta;
            acc += row[i] * q[i];
        }
        o[j] = acc * scale;
    }
}

void kvs_ref_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps)
{
    double sum = 0.0;
    for (int64_t i = 0; i < d; i++) sum += (double)(o[i] * o[i]);
    const float scale = 1.0f / sqrtf((float)(sum / (double)d) + eps);
    for (int64_t i = 0; i < d; i++) o[i] = (o[i] * scale) * w[i] * silu(z[i]);
}

void kvs_ssm_conv_step(const struct kvs_kernels *k, float *state, const float *wt, const float *x, float *y,
                       int64_t c0, int64_t c1, int64_t C, int K)
{
#if defined(__x86_64__) || defined(_M_X64)
    enum kvs_isa isa = kvs_kernels_isa(k);
    if (isa == KVS_ISA_AVX2 || isa == KVS_ISA_AVX512) {
        kvs_avx2_ssm_conv_step(state, wt, x, y, c0, c1, C, K);
        return;
    }
#elif defined(__aarch64__)
    if (kvs_kernels_isa(k) == KVS_ISA_NEON) {
        kvs_neon_ssm_conv_step(state, wt, x, y, c0, c1, C, K);
        return;
    }
#endif
    (void)k;
    kvs_ref_ssm_conv_step(state, wt, x, y, c0, c1, C, K);
}

void kvs_ssm_delta_step(const struct kvs_kernels *k, float *S, const float *q, const float *kk, const float *v,
                        float decay, float beta, float scale, float *o, int64_t d)
{
#if defined(__x86_64__) || defined(_M_X64)
    enum kvs_isa isa = kvs_kernels_isa(k);
    if (isa == KVS_ISA_AVX512 && d % 16 == 0) {
        kvs_avx512_ssm_delta_step(S, q, kk, v, decay, beta, scale, o, d);
        return;
    }
    if ((isa == KVS_ISA_AVX2 || isa == KVS_ISA_AVX512) && d % 8 == 0) {
        kvs_avx2_ssm_delta_step(S, q, kk, v, decay, beta, scale, o, d);
        return;
    }
#elif defined(__aarch64__)
    if (kvs_kernels_isa(k) == KVS_ISA_NEON && d % 4 == 0) {
        kvs_neon_ssm_delta_step(S, q, kk, v, decay, beta, scale, o, d);
        return;
    }
#endif
    (void)k;
    kvs_ref_ssm_delta_step(S, q, kk, v, decay, beta, scale, o, d);
}

void kvs_ssm_gated_norm(const struct kvs_kernels *k, float *o, const float *z, const float *w, int64_t d,
                        float eps)
{
#if defined(__x86_64__) || defined(_M_X64)
    enum kvs_isa isa = kvs_kernels_isa(k);
    if ((isa == KVS_ISA_AVX2 || isa == KVS_ISA_AVX512) && d % 8 == 0) {
        kvs_avx2_ssm_gated_norm(o, z, w, d, eps);
        return;
    }
#elif defined(__aarch64__)
    if (kvs_kernels_isa(k) == KVS_ISA_NEON && d % 4 == 0) {
        kvs_neon_ssm_gated_norm(o, z, w, d, eps);
        return;
    }
#endif
    (void)k;
    kvs_ref_ssm_gated_norm(o, z, w, d, eps);
}

/* Private to the kernels module: the per-ISA Gated DeltaNet kernels that
 * kernels_ssm.c dispatches to (same contracts as kvs_ssm_* in kernels.h). */
#ifndef KVS_KERNELS_SSM_IMPL_H
#define KVS_KERNELS_SSM_IMPL_H

#include <stdint.h>

#if defined(__x86_64__) || defined(_M_X64)
void kvs_avx2_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                            int64_t C, int K);
void kvs_avx2_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                             float scale, float *o, int64_t d);
void kvs_avx2_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps);
void kvs_avx512_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                               float scale, float *o, int64_t d);
#endif

#if defined(__aarch64__)
void kvs_neon_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                            int64_t C, int K);
/* d a multiple of 4 */
void kvs_neon_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                             float scale, float *o, int64_t d);
/* d a multiple of 4 */
void kvs_neon_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps);
#endif

#endif

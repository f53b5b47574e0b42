/* Quantized CPU kernels: block formats, activation quantization, dot
 * products, and threaded matrix-vector / matrix-matrix products.
 *
 * Formats and the multiply recipe follow ../shared/docs/gguf-facts.md §2:
 * every weight type has a "vec_dot type" the F32 activations are converted to
 * (Q8_0, Q8_1, Q8_K, F16, BF16 or F32), and the dot product runs on the
 * integer (or half) values, so results track llama.cpp closely.
 *
 * Every kernel has a scalar reference (kvs_ref_*) and SIMD paths (AVX2,
 * AVX-512 on x86; NEON on ARM) chosen once at kvs_kernels_init time by CPU
 * feature detection. Tests compare SIMD against scalar per type.
 */
#ifndef KVS_KERNELS_H
#define KVS_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "gguf/gguf.h" /* enum kvs_type and kvs_type_block */

/* --- scalar conversions (gguf-facts §2.2) ---------------------------------- */
float kvs_f16_to_f32(uint16_t h);
uint16_t kvs_f32_to_f16(float f);  /* round to nearest even */
float kvs_bf16_to_f32(uint16_t h);
uint16_t kvs_f32_to_bf16(float f); /* round to nearest even, NaN quieted */

/* Which SIMD level the dispatcher picked. */
enum kvs_isa { KVS_ISA_SCALAR = 0, KVS_ISA_AVX2, KVS_ISA_AVX512, KVS_ISA_NEON };

/* The function table for one ISA. All pointers are non-NULL (falling back to
 * scalar where an ISA has no special path). */
struct kvs_kernels;

/* The table for the best ISA this CPU supports, or for `isa` if forced (tests
 * compare tables). Returns NULL if isa is not supported on this CPU. The
 * tables are static, immutable data: no init call, thread-safe. */
const struct kvs_kernels *kvs_kernels_get(enum kvs_isa isa);
const struct kvs_kernels *kvs_kernels_best(void);
enum kvs_isa kvs_kernels_isa(const struct kvs_kernels *k);
const char *kvs_isa_name(enum kvs_isa isa);

/* True if matmul/dequant support weights of this type. */
bool kvs_type_supported(enum kvs_type type);
/* The activation type used for dot products with weights of `type`. */
enum kvs_type kvs_vec_dot_type(enum kvs_type type);

/* Dequantize n elements (n a multiple of the block size) from src to dst. */
void kvs_dequantize_row(const struct kvs_kernels *k, enum kvs_type type, const void *src, float *dst,
                        int64_t n);
/* Quantize n F32 values into the activation format `act_type` (Q8_0, Q8_1,
 * Q8_K, F16, BF16; F32 copies), exactly as llama.cpp's run-time quantizers do
 * (gguf-facts §2.5 rounding rules). dst holds kvs_type_row_bytes(act_type, n). */
void kvs_quantize_act(const struct kvs_kernels *k, enum kvs_type act_type, const float *src, void *dst,
                      int64_t n);
/* Dot product of one weight row (n elements of type) with one activation row
 * already quantized to kvs_vec_dot_type(type). */
float kvs_vec_dot(const struct kvs_kernels *k, enum kvs_type type, int64_t n, const void *w_row,
                  const void *act);

/* F16 vector updates with round-to-nearest-even results (attention's F16
 * V accumulator): y[i] = f16(y[i] * s), and y[i] = f16(y[i] + x[i] * s)
 * with, as llama.cpp's CPU flash attention on AVX-512 (ggml's F16 mad:
 * 64-element vector body, scalar tail), one F32 rounding (FMA) for
 * i < n - n mod 64 and the product rounded to F32 before the sum for the
 * last n mod 64. Every ISA gives the same bits. */
void kvs_vec_f16_scale(const struct kvs_kernels *k, uint16_t *y, float s, int64_t n);
void kvs_vec_f16_mad(const struct kvs_kernels *k, uint16_t *y, const uint16_t *x, float s, int64_t n);

/* True when x[0..n) holds no NaN and no infinity (one pass, no allocation;
 * a logits row of 151936 values takes a few microseconds). */
bool kvs_vec_all_finite(const float *x, size_t n);

/* Reference weight quantizer (to create files: synth, tests): F32 -> type
 * for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32 (gguf-facts §2.3
 * reference quantizers) and Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (a plain
 * range-mapping recipe of our own, kernels_wquant_k.c; layouts §2.4).
 * Returns KVS_ERR_UNSUPPORTED for other types. */
kvs_err kvs_quantize_weights(enum kvs_type type, const float *src, void *dst, int64_t n);

/* --- thread pool -------------------------------------------------------- */
struct kvs_pool; /* opaque: n persistent worker threads (caller is one of them) */

/* n_threads >= 1 threads in total (n_threads - 1 are spawned). */
kvs_err kvs_pool_create(int n_threads, struct kvs_pool **out);
void kvs_pool_destroy(struct kvs_pool *p);
int kvs_pool_n_threads(const struct kvs_pool *p);
/* Runs fn(ctx, ith, nth) on every thread (ith = 0 on the caller) and returns
 * when all are done. Not reentrant; one caller at a time. Allocates nothing. */
void kvs_pool_run(struct kvs_pool *p, void (*fn)(void *ctx, int ith, int nth), void *ctx);

/* --- matrix products ---------------------------------------------------- */
/* A weight matrix view: ne0 = K (input features, contiguous), ne1 = N rows
 * (output features). Borrowed pointer into the GGUF mapping. */
struct kvs_matrix {
    enum kvs_type type;
    int64_t ne0, ne1;
    size_t row_bytes; /* kvs_type_row_bytes(type, ne0) */
    const void *data;
    /* Optional: the same weights in the kernels' packed layout
     * (kvs_matrix_pack), or NULL. kvs_matmul uses it where the ISA has a
     * GEMM for it (same results bit for bit); data stays the reference and
     * must remain readable (it serves other ISAs and unaligned row ranges). */
    const void *packed;
    /* True for an expert's slice of a 3-D expert tensor: llama.cpp's
     * mul_mat_id sums every token with its decode dot, so kvs_matmul never
     * uses the prompt GEMM's summation (kvs_kernels dot_gemm) for it. */
    bool expert;
};

/* Bytes of W's packed layout (0: the type has none, or W's shape does not
 * fit). Q8_0: rows in groups of 4 (the last padded with zero rows), per
 * group pairs of 4-block quads: 2 x (4 rows x 128 unsigned quants, w ^ 0x80,
 * bytes 0-15 of the quad's 4 blocks then bytes 16-31) and 2 x (4 rows x 4
 * F16 scales), 1088 bytes, so every quad's quants are 64-byte aligned and a
 * group is one contiguous stream. */
size_t kvs_matrix_packed_bytes(const struct kvs_matrix *W);
/* True if kvs_matmul on this table has a GEMM that reads W->packed. */
bool kvs_kernels_use_packed(const struct kvs_kernels *k, enum kvs_type type);
/* Writes W's packed layout (kvs_matrix_packed_bytes) to dst (64-byte
 * aligned). Rows [row_begin, row_end) only, row_begin and row_end multiples
 * of 4 or row_end == ne1, so that threads can share the work. Scalar; the
 * layout is the same for every ISA. */
void kvs_matrix_pack(const struct kvs_matrix *W, int64_t row_begin, int64_t row_end, void *dst);

/* Scratch bytes kvs_matmul needs for n_tok activation rows of K features
 * with weights of `type`. */
size_t kvs_matmul_scratch_bytes(enum kvs_type type, int64_t K, int64_t n_tok);

/* y[t][n] = sum_k W[n][k] * x[t][k] for t < n_tok, n < N.
 * x: n_tok rows of K floats (row stride K); y: n_tok rows of N floats (row
 * stride N). Quantizes x into `scratch` (kvs_matmul_scratch_bytes) and splits
 * the work over the pool. n_tok == 1 is the decode (matrix-vector) path;
 * n_tok > 1 reuses each weight block for all tokens (prefill). Allocates
 * nothing. */
void kvs_matmul(const struct kvs_kernels *k, struct kvs_pool *pool, const struct kvs_matrix *W,
                const float *x, int64_t n_tok, float *y, void *scratch);

/* Same, for a subset of rows of a 3-D expert tensor etc.: computes only the
 * rows [row_begin, row_end) of W into y (stride N = row_end - row_begin). */
void kvs_matmul_rows(const struct kvs_kernels *k, struct kvs_pool *pool, const struct kvs_matrix *W,
                     int64_t row_begin, int64_t row_end, const float *x, int64_t n_tok, float *y,
                     void *scratch);

/* Products of one input with n <= 4 matrices: y[i] = W[i] x, as n
 * kvs_matmul calls (same results bit for bit); when the matrices share K and
 * the ISA has GEMMs for their types over one packed activation layout (one
 * type, or e.g. Q4_K, Q5_K and Q6_K on x86), x is quantized once and all
 * their rows are split over the pool in one dispatch (q/k/v, gate/up, also
 * Q4_K_M's Q4_K q/k with a Q6_K v). scratch as for kvs_matmul of one of
 * them. */
void kvs_matmul_multi(const struct kvs_kernels *k, struct kvs_pool *pool, int n, const struct kvs_matrix *const W[],
                      const float *x, int64_t n_tok, float *const y[], void *scratch);

/* --- Gated DeltaNet (qwen35, qwen35moe): ../shared/docs/qwen35-facts.md §3.2 ---
 * Scalar references kvs_ref_ssm_* (kernels_ssm.c) beside SIMD paths (AVX2,
 * AVX-512, NEON; other ISAs use the reference); tests compare them. The delta
 * rule sums its dot products in the order of ggml's F32 dot on that ISA (what
 * llama.cpp's fused op calls), the gated norm its squares in double as
 * ggml's RMSNorm; the scalar reference sums in order. F32 throughout,
 * nothing allocates. */

/* Causal depthwise conv of one token over channels [c0, c1) of C, kernel K
 * (2..64), then SiLU: y[c] = silu(sum_{i<K-1} wt[i][c]·state[i][c] + wt[K-1][c]·x[c]);
 * then state's K-1 time rows shift by one (oldest dropped) and row K-2 takes
 * x. state: [K-1][C] time-major, oldest first (pre-conv inputs); wt: [K][C]
 * (the GGUF's {K, C} ssm_conv1d transposed: wt[i][c] = conv1d[c·K + i]);
 * x, y: [C] (only [c0, c1) read/written). */
void kvs_ssm_conv_step(const struct kvs_kernels *k, float *state, const float *wt, const float *x, float *y,
                       int64_t c0, int64_t c1, int64_t C, int K);
void kvs_ref_ssm_conv_step(float *state, const float *wt, const float *x, float *y, int64_t c0, int64_t c1,
                           int64_t C, int K);

/* One token of the gated delta rule for one value head with state
 * S [d][d] (row j = value dim j, column i = key dim i: S[j·d + i]):
 *   S ← decay·S;  δ_j = beta·(v_j − Σ_i S[j][i]·kk_i);  S[j][i] += kk_i·δ_j;
 *   o_j = scale·Σ_i S[j][i]·q_i.
 * q, kk (L2-normed), v, o: [d]. decay = exp(g) in (0, 1]. */
void kvs_ssm_delta_step(const struct kvs_kernels *k, float *S, const float *q, const float *kk, const float *v,
                        float decay, float beta, float scale, float *o, int64_t d);
void kvs_ref_ssm_delta_step(float *S, const float *q, const float *kk, const float *v, float decay, float beta,
                            float scale, float *o, int64_t d);

/* Gated RMSNorm of one head: o[i] ← o[i]/sqrt(mean(o²) + eps)·w[i]·silu(z[i]),
 * i < d. */
void kvs_ssm_gated_norm(const struct kvs_kernels *k, float *o, const float *z, const float *w, int64_t d,
                        float eps);
void kvs_ref_ssm_gated_norm(float *o, const float *z, const float *w, int64_t d, float eps);

#endif

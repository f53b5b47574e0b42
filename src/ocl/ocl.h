/* OpenCL compute for a stage: devices, buffers, and the operations a
 * transformer block needs, as kernels over GGUF weight blocks in their file
 * layout (no re-quantization).
 *
 * OpenCL is reached through the ICD loader (libOpenCL.so.1, Debian
 * ocl-icd), so a machine without any OpenCL platform still runs the CPU
 * backend; kvs_ocl_open then fails with a clear message. The kernels
 * (ocl_kernels.cl) are embedded in the binary and built at open by the
 * device's compiler; a build failure returns the compiler's log.
 *
 * Every operation is enqueued on one in-order queue and returns at once;
 * kvs_ocl_read waits for everything before it. Operations allocate nothing
 * (buffers come from kvs_ocl_alloc at load time). Numerics follow the CPU
 * scalar reference (src/kernels/kernels_ref.c: same activation quantizers,
 * same integer sums per block), except for float summation order. Shapes
 * use GGUF ne order: a weight {K, N} is N rows of K contiguous values. */
#ifndef KVS_OCL_H
#define KVS_OCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "gguf/gguf.h"

struct kvs_ocl;     /* opaque: a device, its context, queue and built kernels */
struct kvs_ocl_buf; /* opaque: one device buffer */

/* One OpenCL device as listed by kvs_ocl_devices (index = --device N). */
struct kvs_ocl_device_info {
    char platform[128];
    char name[128];
    char version[64];      /* CL_DEVICE_VERSION */
    uint64_t global_mem;   /* bytes */
    uint64_t max_alloc;    /* bytes: largest single buffer */
    uint32_t compute_units;
    bool gpu;              /* CL_DEVICE_TYPE_GPU */
};

/* Lists every device of every platform, in platform then device order, into
 * out[0..cap) and sets *n to the total found. KVS_ERR_NOT_FOUND with a
 * message in errbuf when there is no platform or no device. */
kvs_err kvs_ocl_devices(struct kvs_ocl_device_info *out, int cap, int *n, char *errbuf, size_t errlen);

/* Opens device `index` (kvs_ocl_devices order) and builds the kernels.
 * Errors: KVS_ERR_NOT_FOUND (no platform, no device, index past the last),
 * KVS_ERR_UNSUPPORTED (kernel build failure: the compiler's log in errbuf),
 * KVS_ERR_NOMEM, KVS_ERR_INTERNAL (other OpenCL errors, with the code). */
kvs_err kvs_ocl_open(int index, struct kvs_ocl **out, char *errbuf, size_t errlen);
void kvs_ocl_close(struct kvs_ocl *c);
const struct kvs_ocl_device_info *kvs_ocl_info(const struct kvs_ocl *c);

/* Builds `src` as the kernel source instead of the embedded one (tests of
 * the build-failure path). Same errors as kvs_ocl_open. */
kvs_err kvs_ocl_open_source(int index, const char *src, struct kvs_ocl **out, char *errbuf, size_t errlen);

/* True if matmuls over weights of this type have a kernel: F32, F16, BF16,
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (the IQ types,
 * TQ types and the integer types have none). */
bool kvs_ocl_type_supported(enum kvs_type type);
/* Bytes of one activation row of K values in the vec_dot format of weight
 * type `type` (F32: K·4, F16/BF16: K·2, Q8_0 blocks for Q8_0/Q4_0/Q5_0, Q8_1
 * for Q4_1/Q5_1, Q8_K for the K-quants); 0 if unsupported or K is not a whole
 * number of blocks. */
size_t kvs_ocl_act_row_bytes(enum kvs_type type, int64_t K);

/* Device buffer of `bytes` (> 0), uninitialized. KVS_ERR_NOMEM (with the
 * size and the device's limits in errbuf) when the device cannot hold it. */
kvs_err kvs_ocl_alloc(struct kvs_ocl *c, size_t bytes, struct kvs_ocl_buf **out, char *errbuf, size_t errlen);
void kvs_ocl_free(struct kvs_ocl_buf *b);
size_t kvs_ocl_buf_bytes(const struct kvs_ocl_buf *b);
/* Blocking host -> device / device -> host copies of bytes at offset.
 * read waits for every operation enqueued before it. KVS_ERR_RANGE past the
 * buffer's end; KVS_ERR_INTERNAL (OpenCL error, e.g. lazy allocation
 * failure: message in the context, kvs_ocl_last_error). */
kvs_err kvs_ocl_write(struct kvs_ocl *c, struct kvs_ocl_buf *b, size_t offset, const void *src, size_t bytes);
kvs_err kvs_ocl_read(struct kvs_ocl *c, struct kvs_ocl_buf *b, size_t offset, void *dst, size_t bytes);
/* Fills bytes at offset with zeros (enqueued). */
kvs_err kvs_ocl_zero(struct kvs_ocl *c, struct kvs_ocl_buf *b, size_t offset, size_t bytes);
/* Waits for everything enqueued; returns the first error an enqueue hit
 * since the last call (then kvs_ocl_last_error says which). */
kvs_err kvs_ocl_finish(struct kvs_ocl *c);
const char *kvs_ocl_last_error(const struct kvs_ocl *c);

/* Measures the device: read bandwidth (GB/s, a bytes-sized buffer, capped at
 * the largest allocation, summed by every compute unit; best of 3 after a
 * warm-up) and multiply-add throughput (GFLOP/s, 2 FLOPs per multiply-add;
 * an upper bound, no matmul). Errors: KVS_ERR_NOMEM, KVS_ERR_INTERNAL. */
kvs_err kvs_ocl_measure(struct kvs_ocl *c, size_t bytes, double *read_gbps, double *gflops, char *errbuf,
                        size_t errlen);

/* --- operations (enqueued; the first failure is kept for kvs_ocl_finish) --- */

/* A weight on the device: N rows of K values of `type`, row_bytes apart
 * (kvs_type_row_bytes), in buf at byte 0; experts (3-D tensors) follow each
 * other expert_stride bytes apart. */
struct kvs_ocl_weight {
    struct kvs_ocl_buf *buf;
    enum kvs_type type;
    int64_t K, N;
    size_t row_bytes;
    size_t expert_stride;
};

/* y[r][n] = W[n] · x[r] for r < R rows (x: [R][K] F32, y: [R][N] F32).
 * Quantizes x into act (at least R · kvs_ocl_act_row_bytes(W.type, K)
 * bytes; unused for F32 weights) and runs the type's kernel. */
void kvs_ocl_matmul(struct kvs_ocl *c, const struct kvs_ocl_weight *W, struct kvs_ocl_buf *x, int64_t R,
                    struct kvs_ocl_buf *y, struct kvs_ocl_buf *act);
/* MoE: y[r][n] = W_{ids[r]}[n] · x[r / x_div] for r < R (ids: [R] int32
 * expert indices on the device; x: [R / x_div][K]). */
void kvs_ocl_matmul_id(struct kvs_ocl *c, const struct kvs_ocl_weight *W, struct kvs_ocl_buf *ids,
                       struct kvs_ocl_buf *x, int64_t x_div, int64_t R, struct kvs_ocl_buf *y,
                       struct kvs_ocl_buf *act);

/* y[r] = rmsnorm(x[rows ? rows[r] : r]) · w for r < R rows of n floats. */
void kvs_ocl_rmsnorm(struct kvs_ocl *c, struct kvs_ocl_buf *x, struct kvs_ocl_buf *w, struct kvs_ocl_buf *y,
                     int64_t R, int64_t n, float eps, struct kvs_ocl_buf *rows);
/* In-place RoPE of x [n_tok][n_head][D] over the first n_rot dims with
 * cs [n_tok][n_rot] (cos, sin) pairs; neox: pairs (i, i + n_rot/2), else (2i, 2i+1). */
void kvs_ocl_rope(struct kvs_ocl *c, struct kvs_ocl_buf *x, struct kvs_ocl_buf *cs, int64_t n_tok, int64_t n_head,
                  int64_t D, int64_t n_rot, bool neox);

/* KV cache geometry: kc, vc are F16 [n_slot][n_seq][n_ctx][kv_dim]. */
struct kvs_ocl_kv {
    struct kvs_ocl_buf *k, *v;
    int64_t n_seq, n_ctx, kv_dim;
};
/* Stores k, v [n_tok][kv_dim] at (slot, seq[t], pos[t]) rounded to F16. */
void kvs_ocl_kv_store(struct kvs_ocl *c, const struct kvs_ocl_kv *kv, int64_t slot, struct kvs_ocl_buf *k,
                      struct kvs_ocl_buf *v, struct kvs_ocl_buf *seq, struct kvs_ocl_buf *pos, int64_t n_tok);
/* o [n_tok][H·D] = attention of q [n_tok][H·D] over positions 0..pos[t] of
 * sequence seq[t] in cache slot `slot` (H/Hkv query heads per KV head),
 * scaled by 1/sqrt(D); the CPU path's F16 online softmax. */
void kvs_ocl_attention(struct kvs_ocl *c, const struct kvs_ocl_kv *kv, int64_t slot, struct kvs_ocl_buf *q,
                       struct kvs_ocl_buf *o, struct kvs_ocl_buf *seq, struct kvs_ocl_buf *pos, int64_t n_tok,
                       int64_t H, int64_t Hkv, int64_t D);

/* y[i] += x[i] (n floats). */
void kvs_ocl_add(struct kvs_ocl *c, struct kvs_ocl_buf *y, struct kvs_ocl_buf *x, int64_t n);
/* y[t][i] += b[i] for rows of n_cols, n_rows rows. */
void kvs_ocl_add_bias(struct kvs_ocl *c, struct kvs_ocl_buf *y, struct kvs_ocl_buf *b, int64_t n_rows,
                      int64_t n_cols);
/* a[i] = silu(a[i]) · b[i] (n floats). */
void kvs_ocl_swiglu(struct kvs_ocl *c, struct kvs_ocl_buf *a, struct kvs_ocl_buf *b, int64_t n);
/* Routing of n_tok rows of X logits (softmaxed in place) to sel/selw
 * [n_tok][K] (int32 experts, F32 weights renormalized over the K). */
void kvs_ocl_moe_route(struct kvs_ocl *c, struct kvs_ocl_buf *logits, struct kvs_ocl_buf *sel,
                       struct kvs_ocl_buf *selw, int64_t n_tok, int64_t X, int64_t K, bool clamp);
/* o[t] = Σ_s ys[t][s] · w[t][s] (ys: [n_tok][K][E]). */
void kvs_ocl_moe_sum(struct kvs_ocl *c, struct kvs_ocl_buf *ys, struct kvs_ocl_buf *w, struct kvs_ocl_buf *o,
                     int64_t n_tok, int64_t K, int64_t E);

/* --- qwen35 (../shared/docs/qwen35-facts.md §3.2, §3.3, §3.5) --- */

/* GDN causal depthwise conv + SiLU (§3.2 step 3): for t < n_tok in order,
 * y[t][c] = silu(Σ_{i<K-1} wt[i][c]·st_s[i][c] + wt[K-1][c]·x[t][c]) with
 * s = seq[t], then st_s shifts one step and keeps x[t]. st: F32
 * [n_seq][K-1][C] (one block's conv state), wt: [K][C] (time-major),
 * x, y: [n_tok][C]. */
void kvs_ocl_gdn_conv(struct kvs_ocl *c, struct kvs_ocl_buf *st, struct kvs_ocl_buf *wt, struct kvs_ocl_buf *x,
                      struct kvs_ocl_buf *y, struct kvs_ocl_buf *seq, int64_t n_tok, int64_t C, int64_t K);
/* In-place L2 norm x / max(||x||, eps) of n_head heads of d floats in each
 * of n_rows rows `stride` floats apart (sums in F32; the CPU sums in double). */
void kvs_ocl_l2norm(struct kvs_ocl *c, struct kvs_ocl_buf *x, int64_t n_rows, int64_t n_head, int64_t d,
                    int64_t stride, float eps);
/* GDN gates of [n_tok][Hv] in place (§3.2 step 4): b = sigmoid(b),
 * a = softplus(a + dt[j])·ssm_a[j] (the decay's log). */
void kvs_ocl_gdn_gates(struct kvs_ocl *c, struct kvs_ocl_buf *b, struct kvs_ocl_buf *a, struct kvs_ocl_buf *dt,
                       struct kvs_ocl_buf *ssm_a, int64_t n_tok, int64_t Hv);
/* Gated delta rule (§3.2 step 7, kvs_ref_ssm_delta_step per value head j):
 * for t < n_tok in order on S_{seq[t], j} (S: F32 [n_seq][Hv][d][d]) with
 * q, k = u[t]'s key head j mod Hk and v = u[t]'s value head j (u:
 * [n_tok][2·Hk·d + Hv·d]: q heads, k heads, v heads), decay exp(g[t][j]),
 * beta[t][j]: o[t][j·d..] = (S·q)·scale after the update. */
void kvs_ocl_gdn_delta(struct kvs_ocl *c, struct kvs_ocl_buf *S, struct kvs_ocl_buf *u, struct kvs_ocl_buf *g,
                       struct kvs_ocl_buf *beta, struct kvs_ocl_buf *o, struct kvs_ocl_buf *seq, int64_t n_tok,
                       int64_t d, int64_t Hk, int64_t Hv, float scale);
/* a[i] *= silu(z[i]) if silu, else sigmoid(z[i]) (n floats). */
void kvs_ocl_gate_mul(struct kvs_ocl *c, struct kvs_ocl_buf *a, struct kvs_ocl_buf *z, bool silu, int64_t n);
/* Gated attention's query projection qg [n_tok][H][2·D] (per head D query
 * then D gate values, §3.3 step 1) into q and gate [n_tok][H·D]. */
void kvs_ocl_split_qg(struct kvs_ocl *c, struct kvs_ocl_buf *qg, struct kvs_ocl_buf *q, struct kvs_ocl_buf *gate,
                      int64_t n_tok, int64_t H, int64_t D);
/* y[t][i] += sigmoid(g[t])·s[t][i] for n_tok rows of E (shared expert, §3.5). */
void kvs_ocl_add_gated(struct kvs_ocl *c, struct kvs_ocl_buf *y, struct kvs_ocl_buf *s, struct kvs_ocl_buf *g,
                       int64_t n_tok, int64_t E);

#endif

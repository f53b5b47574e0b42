/* Private to the model module: the window's weights, caches and work
 * buffers, and the block kinds each file implements:
 *   model.c       loading, the caches, the forward loop (embedding, blocks, head)
 *   model_attn.c  attention: llama/qwen2/qwen3 and the qwen35 gated variant
 *   model_gdn.c   Gated DeltaNet (qwen35, qwen35moe)
 *   model_ffn.c   dense SwiGLU FFN
 *   model_moe.c   mixture of experts (+ the qwen35moe shared expert)
 * Each block-kind file loads its own tensors (kvs_model__load_*) and runs
 * them on a batch (the block functions below). */
#ifndef KVS_MODEL_IMPL_H
#define KVS_MODEL_IMPL_H

#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "model/model.h"

/* Weights of one block. Pointers borrow the GGUF mapping. */
struct block_w {
    bool recurrent;                      /* Gated DeltaNet block (hybrid models) */
    int32_t kv_slot;                     /* attention: index of its KV cache in the window, else -1 */
    int32_t rs_slot;                     /* GDN: index of its recurrent state in the window, else -1 */
    const float *attn_norm;              /* [E] */
    /* attention */
    struct kvs_matrix wq, wk, wv, wo;    /* {E, H·D} (gated: {E, 2·H·D}), {E, Hkv·D}, {E, Hkv·D}, {H·D, E} */
    const float *bq, *bk, *bv, *bo;      /* [H·D], [Hkv·D], [Hkv·D], [E]; NULL if absent */
    const float *q_norm, *k_norm;        /* [D] (qwen3, qwen3moe, qwen35*), else NULL */
    /* Gated DeltaNet (qwen35-facts §2.2) */
    struct kvs_matrix ssm_qkv;           /* attn_qkv {E, C} */
    struct kvs_matrix ssm_z;             /* attn_gate {E, H_v·d} */
    struct kvs_matrix ssm_beta, ssm_alpha; /* {E, H_v} */
    struct kvs_matrix ssm_out;           /* {H_v·d, E} */
    const float *conv_w;                 /* ssm_conv1d {K, C}: conv_w[c·K + i] */
    const float *ssm_dt, *ssm_a;         /* [H_v] */
    const float *ssm_norm;               /* [d] */
    /* FFN */
    const float *ffn_norm;               /* [E] (ffn_norm, or post_attention_norm for qwen35*) */
    struct kvs_matrix gate, up, down;    /* dense: {E, F}, {E, F}, {F, E} */
    struct kvs_matrix router;            /* MoE: {E, X} F32 */
    struct kvs_matrix gate_x, up_x, down_x; /* MoE: expert 0's slice {E, Fe}, {E, Fe}, {Fe, E} */
    size_t gate_x_stride, up_x_stride, down_x_stride; /* bytes between experts' slices */
    struct kvs_matrix gate_sh, up_sh, down_sh; /* qwen35moe shared expert {E, Fs}, {E, Fs}, {Fs, E} */
    struct kvs_matrix gate_inp_sh;       /* qwen35moe shared-expert gate {E, 1} F32 */
};

struct kvs_model;
struct kvs_model_ocl;

/* A window's compute backend: the block operations the forward loop
 * (kvs_model_forward, model.c) composes, chosen once at load. The CPU table
 * (model.c) runs the block-kind files on host buffers; the OpenCL one
 * (model_ocl.c) enqueues the same steps on the device. n is the batch's
 * token count; il a block's index within the window. */
struct kvs_model_ops {
    const char *name;
    /* The batch's rows into the residual stream: embedding rows (head) or
     * the boundary b->embd; RoPE angles of the batch's positions. */
    kvs_err (*input)(struct kvs_model *m, const struct kvs_batch *b);
    /* Normed input xn = rmsnorm(x) with block il's attn_norm (!ffn) or ffn_norm. */
    void (*norm)(struct kvs_model *m, int32_t il, bool ffn, int32_t n);
    /* x += the block's mixer on xn: attention, or Gated DeltaNet (recurrent blocks). */
    void (*attention)(struct kvs_model *m, const struct kvs_batch *b, int32_t il);
    void (*gdn)(struct kvs_model *m, const struct kvs_batch *b, int32_t il);
    /* x += the block's FFN (dense or MoE) on xn. */
    void (*ffn)(struct kvs_model *m, int32_t il, int32_t n);
    /* The window's output to out (kvs_model_forward's contract). */
    kvs_err (*output)(struct kvs_model *m, const struct kvs_batch *b, float *out);
};

struct kvs_model {
    struct kvs_hparams hp;
    const struct kvs_model_ops *ops;
    struct kvs_model_ocl *ocl; /* OpenCL backend state, else NULL */
    int32_t begin, end, n_blk;
    int32_t n_ctx, n_seq, n_batch, n_threads;
    int32_t q_dim, kv_dim; /* H·D, Hkv·D */
    int32_t ff_max;        /* max(n_ff, n_ff_exp, n_ff_shexp) */
    int32_t n_kv_blk;      /* attention blocks in the window (KV caches) */
    int32_t n_rs_blk;      /* GDN blocks in the window (recurrent states) */
    const struct kvs_kernels *k;
    struct kvs_pool *pool;

    const struct kvs_gguf_tensor *tok_embd; /* {E, V} or NULL */
    const float *out_norm;                  /* [E] or NULL */
    struct kvs_matrix out_w;                /* {E, V} (output or tied embedding) */
    const float *rope_freqs;                /* [n_rot/2] or NULL */
    struct block_w *blk;                    /* [n_blk] */

    uint16_t *kcache, *vcache; /* [n_kv_blk][n_seq][n_ctx][kv_dim] F16 */
    int32_t *n_past;           /* [n_seq] cached positions per sequence */
    int32_t *expect;           /* [n_seq] work: next position while validating */
    int32_t *first;            /* [n_seq] work: position of the sequence's first token in the batch */
    float *f16tab;             /* [65536] F16 -> F32 */

    /* Recurrent state (GDN blocks), per block and sequence, F32: */
    float *conv_st;  /* [n_rs_blk][n_seq][K-1][C]: the last K-1 pre-conv inputs, oldest first */
    float *ssm_st;   /* [n_rs_blk][n_seq][H_v][d][d]: S_j[value][key] */
    float *conv_wt;  /* [n_rs_blk][K][C]: conv weights transposed to time-major */
    uint8_t *rs_dirty; /* [n_seq] the sequence's state holds values (cleared before pos 0) */

    /* Work buffers, [n_batch][...] each. */
    float *x;        /* [n_batch][E] residual stream */
    float *xn;       /* [n_batch][E] normed input */
    float *q;        /* [n_batch][H·D] */
    float *kv_k;     /* [n_batch][Hkv·D] */
    float *kv_v;     /* [n_batch][Hkv·D] */
    float *att;      /* [n_batch][H·D] attention output */
    float *tmp;      /* [n_batch][E] */
    float *ffa;      /* [n_batch][ff_max] */
    float *ffb;      /* [n_batch][ff_max] */
    float *rope_cs;  /* [n_batch][n_rot] (cos, sin) pairs */
    uint16_t *att_ws16; /* [n_threads][2·D] F16 q and V accumulator */
    void *mm_scratch;
    void *packw;        /* anonymous mapping: the window's matrices in the kernels' packed layout */
    size_t packw_bytes;
    /* gated attention (hybrid) */
    float *qg;       /* [n_batch][2·H·D] query | gate per head */
    float *gate;     /* [n_batch][H·D] */
    /* GDN (hybrid) */
    float *g_mix;    /* [n_batch][C] projections m (pre-conv) */
    float *g_u;      /* [n_batch][C] conv + SiLU output: q | k | v */
    float *g_z;      /* [n_batch][H_v·d] */
    float *g_b;      /* [n_batch][H_v] beta logits, then beta */
    float *g_a;      /* [n_batch][H_v] alpha logits, then the log-decay g */
    float *g_o;      /* [n_batch][H_v·d] delta-rule output, then gated-normed */
    /* MoE */
    float *router;     /* [n_batch][X] */
    int32_t *sel;      /* [n_batch][k] chosen experts */
    float *selw;       /* [n_batch][k] their weights */
    int32_t *rows;     /* [n_batch·k] (token·k + slot) of the gathered rows */
    float *moe_in;     /* [n_batch][E] gathered rows */
    float *moe_y;      /* [n_batch][k][E] weighted expert outputs */
    float *sh_gate;    /* [n_batch] shared-expert gate logits */
};

/* --- loading helpers (model.c) -------------------------------------------- */
struct kvs_model_loader {
    const struct kvs_gguf *g;
    const struct kvs_model *m;
    char *errbuf;
    size_t errlen;
};

void kvs_model__err(struct kvs_model_loader *L, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* An F32 vector (norm weight, bias) of n values; absent and !required: *out = NULL. */
kvs_err kvs_model__vec(struct kvs_model_loader *L, const char *name, int64_t n, bool required, const float **out);
/* A 2-D weight {ne0, ne1}. */
kvs_err kvs_model__mat(struct kvs_model_loader *L, const char *name, int64_t ne0, int64_t ne1,
                       struct kvs_matrix *out);
/* A 3-D expert weight {ne0, ne1, nx}: expert 0's matrix and the stride in bytes. */
kvs_err kvs_model__exps(struct kvs_model_loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t nx,
                        struct kvs_matrix *out, size_t *stride);

/* Per-kind tensor loading for block il (GGUF index) into b. */
kvs_err kvs_model__load_attn(struct kvs_model_loader *L, int32_t il, struct block_w *b);
kvs_err kvs_model__load_gdn(struct kvs_model_loader *L, int32_t il, struct block_w *b);
kvs_err kvs_model__load_ffn(struct kvs_model_loader *L, int32_t il, struct block_w *b);
kvs_err kvs_model__load_moe(struct kvs_model_loader *L, int32_t il, struct block_w *b);

/* --- OpenCL backend (model_ocl.c) ---------------------------------------- */
/* Uploads the loaded window (m->blk views) to OpenCL device `device`,
 * allocates the device KV cache and work buffers, sets m->ops and m->ocl.
 * Errors as kvs_model_load's for the OpenCL backend. */
kvs_err kvs_model__ocl_load(struct kvs_model *m, int32_t device, char *errbuf, size_t errlen);
void kvs_model__ocl_free(struct kvs_model *m);
extern const struct kvs_model_ops kvs_model__ocl_ops;
/* Zeroes sequence seq's GDN states on the device (no-op without OpenCL). */
void kvs_model__ocl_seq_clear(struct kvs_model *m, int32_t seq);

/* --- block kinds ------------------------------------------------------------ */
/* Each adds its output to the residual stream m->x for the batch's n tokens;
 * il is the block's index within the window. Attention and GDN read the
 * normed input m->xn, the FFNs too (the forward loop norms before each). */
void kvs_model__attention(struct kvs_model *m, const struct kvs_batch *b, int32_t il);
void kvs_model__gdn(struct kvs_model *m, const struct kvs_batch *b, int32_t il);
/* FFNs write their output to m->tmp (the loop adds it). */
void kvs_model__ffn_dense(struct kvs_model *m, const struct block_w *w, int32_t n);
void kvs_model__ffn_moe(struct kvs_model *m, const struct block_w *w, int32_t n);
/* RoPE cos/sin table of one position: [n_rot] (cos, sin) pairs. */
void kvs_model__rope_table(const struct kvs_model *m, int32_t pos, float *cs);

/* SwiGLU on n values: a = silu(a) * b, split over the pool when large. */
void kvs_model__swiglu(struct kvs_model *m, float *a, const float *b, size_t n);

/* --- shared numerics ------------------------------------------------------- */

/* RMSNorm (gguf-facts §4.2): squares in float summed in double, mean rounded
 * to float, scale = 1/sqrtf(mean + eps); then the weight multiply. */
static inline void kvs_model__rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps)
{
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

static inline float kvs_model__silu(float z) { return z / (1.0f + expf(-z)); }
static inline float kvs_model__sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

/* The pool for a product of rows x K weights with n_tok tokens, or NULL
 * (the caller's thread alone) when the product is too small to repay a pool
 * round trip: tiny models then run at one thread's speed whatever else the
 * machine is doing, instead of waiting for a descheduled worker per matmul. */
#define KVS_MM_PARALLEL_MIN_MACS ((int64_t)1 << 18)
static inline struct kvs_pool *kvs_model__mm_pool(const struct kvs_model *m, int64_t rows, int64_t K, int64_t n_tok)
{
    return rows * K * n_tok >= KVS_MM_PARALLEL_MIN_MACS ? m->pool : NULL;
}

#endif

/* A window of a transformer's blocks: the unit of computation of a stage.
 *
 * A kvs_model holds blocks [block_begin, block_end) of a GGUF model, plus the
 * token embedding if block_begin == 0 (the head) and the output norm + output
 * head (or the tied embedding) if block_end == n_block (the tail). A single
 * process runs the window [0, n_block) with both. Only the window's tensors
 * are touched, so only their pages of the mapped file are read.
 *
 * Architectures: llama, qwen2, qwen3, qwen3moe; forward pass as in
 * ../shared/docs/gguf-facts.md §4. KV cache in F16, one slot per sequence.
 * qwen35 / qwen35moe (../shared/docs/qwen35-facts.md §3): hybrids of Gated
 * DeltaNet blocks (a fixed-size F32 conv + delta state per sequence and
 * block) and gated attention blocks (the only ones with a KV cache); their
 * nextn/MTP blocks (after block_count - nextn_predict_layers) are never
 * loaded: n_block counts the main blocks only.
 * Attention follows llama.cpp's default CPU path (flash attention: q and K
 * in F16, online softmax with an F16 V accumulator), which tracks the
 * reference outputs in ../shared/models best.
 */
#ifndef KVS_MODEL_H
#define KVS_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "gguf/gguf.h"

enum kvs_arch {
    KVS_ARCH_LLAMA = 0,
    KVS_ARCH_QWEN2,
    KVS_ARCH_QWEN3,
    KVS_ARCH_QWEN3MOE,
    KVS_ARCH_QWEN35,    /* hybrid: Gated DeltaNet + gated attention, dense FFN */
    KVS_ARCH_QWEN35MOE, /* the same with MoE + shared expert */
    KVS_ARCH_COUNT_
};

#define KVS_HP_MAX_BLOCKS 4096u

/* Hyperparameters read from `<arch>.*` metadata (gguf-facts §3.2;
 * qwen35/qwen35moe keys: ../shared/docs/qwen35-facts.md §1). */
struct kvs_hparams {
    enum kvs_arch arch;
    char arch_name[32];
    uint32_t n_block;        /* main blocks: block_count - nextn_predict_layers (the ring's block count) */
    uint32_t n_nextn;        /* nextn_predict_layers: MTP blocks stored after the main ones (never run) */
    uint32_t n_embd;         /* embedding_length */
    uint32_t n_head;         /* attention.head_count */
    uint32_t n_head_kv;      /* attention.head_count_kv */
    uint32_t head_dim;       /* attention.key_length (default n_embd / n_head) */
    uint32_t n_rot;          /* rope.dimension_count (default head_dim) */
    uint32_t n_ff;           /* feed_forward_length (dense) */
    uint32_t n_expert;       /* 0 for dense */
    uint32_t n_expert_used;
    uint32_t n_ff_exp;       /* expert_feed_forward_length */
    uint32_t n_vocab;
    uint32_t n_ctx_train;    /* context_length */
    float rms_eps;
    float rope_freq_base;
    float rope_freq_scale;   /* 1 / rope.scaling.factor, 1 if absent */
    bool rope_neox;          /* NEOX pairing (i, i + n_rot/2) vs adjacent */
    bool tied_output;        /* no output.weight: the embedding is the head */
    /* qwen35 / qwen35moe (0 elsewhere) */
    uint32_t n_ff_shexp;     /* expert_shared_feed_forward_length (qwen35moe) */
    uint32_t ssm_conv;       /* ssm.conv_kernel K */
    uint32_t ssm_d;          /* ssm.state_size d: GDN key and value head dim */
    uint32_t ssm_h_v;        /* ssm.time_step_rank: GDN value heads */
    uint32_t ssm_h_k;        /* ssm.group_count: GDN key heads (value head j uses key head j % h_k) */
    uint8_t recurrent[KVS_HP_MAX_BLOCKS / 8]; /* bit il set: main block il is Gated DeltaNet */
};

/* True if the architecture is a hybrid (qwen35, qwen35moe): Gated DeltaNet
 * and gated attention blocks, per-sequence recurrent state. */
bool kvs_hparams_hybrid(const struct kvs_hparams *hp);
/* True if main block il is a Gated DeltaNet block (hybrid models only). */
bool kvs_hparams_recurrent(const struct kvs_hparams *hp, uint32_t il);
/* GDN conv channels C = 2·h_k·d + h_v·d (qwen35-facts §2.2); 0 if not hybrid. */
uint32_t kvs_hparams_conv_channels(const struct kvs_hparams *hp);
/* F32 bytes of one sequence's recurrent state for one GDN block: conv state
 * (K-1)·C plus delta state h_v·d·d, times 4 (qwen35-facts §4.2). */
size_t kvs_hparams_recurrent_bytes(const struct kvs_hparams *hp);

/* Reads and checks hyperparameters. Errors: KVS_ERR_UNSUPPORTED (unknown
 * architecture), KVS_ERR_FORMAT/NOT_FOUND (missing or mistyped keys). */
kvs_err kvs_hparams_read(const struct kvs_gguf *g, struct kvs_hparams *hp, char *errbuf, size_t errlen);

/* The compute backend of a window (chosen once at load). */
enum kvs_backend {
    KVS_BACKEND_CPU = 0, /* the kernels module (SIMD) on the host */
    KVS_BACKEND_OPENCL,  /* an OpenCL device (src/ocl): weights, KV cache and blocks on the device */
};
/* "cpu" / "opencl". */
const char *kvs_backend_name(enum kvs_backend b);
/* Parses "cpu" or "opencl"; -1 for anything else. */
int kvs_backend_parse(const char *s, enum kvs_backend *out);

struct kvs_model_params {
    int32_t block_begin;   /* first block, default 0 */
    int32_t block_end;     /* one past the last block; -1 = n_block (default) */
    int32_t n_ctx;         /* KV positions per sequence; 0 = min(n_ctx_train, 4096) */
    int32_t n_seq;         /* sequence slots (KV caches); default 1 */
    int32_t n_batch;       /* most tokens per forward call; default 512 */
    int32_t n_threads;     /* compute threads; default 2 */
    enum kvs_backend backend; /* default KVS_BACKEND_CPU */
    int32_t device;        /* OpenCL device index (kvs_ocl_devices order); default 0 */
};
struct kvs_model_params kvs_model_default_params(void);

struct kvs_model; /* opaque */

/* Builds the window over g (borrowed: g must outlive the model). Allocates
 * the KV cache (F16) and every work buffer up front: forward allocates
 * nothing. Errors: KVS_ERR_RANGE (bad window), KVS_ERR_NOT_FOUND (a tensor the
 * window needs is absent), KVS_ERR_FORMAT (a tensor of the wrong shape),
 * KVS_ERR_UNSUPPORTED (tensor type), KVS_ERR_NOMEM.
 * With KVS_BACKEND_OPENCL the window's weights are uploaded to the device
 * once (their GGUF block formats), the KV cache and work buffers live
 * there, and forward copies only the boundary or logits back; extra
 * errors: KVS_ERR_NOT_FOUND (no OpenCL platform or device), KVS_ERR_NOMEM
 * (the device cannot hold the window), KVS_ERR_UNSUPPORTED (a tensor type
 * without an OpenCL kernel, qwen35 blocks, kernel build failure with the
 * compiler's log), each with a message in errbuf. */
kvs_err kvs_model_load(const struct kvs_gguf *g, const struct kvs_model_params *p, struct kvs_model **out,
                       char *errbuf, size_t errlen);
void kvs_model_free(struct kvs_model *m);

const struct kvs_hparams *kvs_model_hparams(const struct kvs_model *m);
bool kvs_model_has_embd(const struct kvs_model *m);  /* block_begin == 0 */
bool kvs_model_has_head(const struct kvs_model *m);  /* block_end == n_block */
int32_t kvs_model_block_begin(const struct kvs_model *m);
int32_t kvs_model_block_end(const struct kvs_model *m);
int32_t kvs_model_n_ctx(const struct kvs_model *m);
int32_t kvs_model_n_seq(const struct kvs_model *m);

/* A batch of tokens, possibly from several sequences. Within one sequence
 * positions must be consecutive and continue that sequence's cache (the
 * first token of a sequence in the batch has pos == tokens already cached). */
struct kvs_batch {
    int32_t n_tokens;
    const int32_t *token;   /* [n_tokens] ids; required iff the window has the embedding */
    const float *embd;      /* [n_tokens][n_embd] boundary input; required iff no embedding */
    const int32_t *seq;     /* [n_tokens] sequence slot, 0..n_seq-1 */
    const int32_t *pos;     /* [n_tokens] position within the sequence */
    const int8_t *logits;   /* [n_tokens] nonzero: output logits for this row (tail only);
                             * NULL: only the last row */
};

/* Runs the window on a batch. Output:
 *  - window with the head: out = [n_out][n_vocab] F32 logits, one row per
 *    batch row with logits[i] != 0, in batch order;
 *  - otherwise: out = [n_tokens][n_embd] F32 boundary (hidden state after
 *    the window's last block).
 * Errors: KVS_ERR_RANGE (position past n_ctx, seq out of range, token id out
 * of vocabulary, n_tokens > n_batch, positions that do not continue the
 * sequence), KVS_ERR_ARG (missing inputs): then nothing has changed; and
 * KVS_ERR_NUMERIC (a NaN or infinity in out: corrupt weights or boundary),
 * after the KV cache took the batch's positions (rewind or clear them).
 * Not thread-safe: one forward at a time per model (it owns the pool). */
kvs_err kvs_model_forward(struct kvs_model *m, const struct kvs_batch *b, float *out);

/* Forget sequence `seq`'s cache (positions restart at 0) and zero its
 * recurrent state (hybrid models). */
void kvs_model_seq_clear(struct kvs_model *m, int32_t seq);

/* Positions cached for `seq` (the pos its next token must have), or -1 if
 * seq is out of range. A batch may also restart a sequence at any pos <= this
 * value: the cache is then truncated to pos. Hybrid models cannot rewind a
 * recurrent state: there a sequence continues at this value or restarts at
 * 0 (from zero state); another pos is KVS_ERR_RANGE. */
int32_t kvs_model_seq_len(const struct kvs_model *m, int32_t seq);

/* A sequence's state in this window, for handing it to another process that
 * loaded the same model and window with the same n_ctx (docs/PROTOCOL.md §5.2,
 * a planned leave): K then V rows [0, n_past) of every attention block's F16
 * cache, then every GDN block's F32 conv and delta state, in host byte order
 * (the same machine only). CPU backend only (the OpenCL one keeps its state on
 * the device).
 * kvs_model_seq_state_bytes: the bytes kvs_model_seq_state_get writes for seq
 * (its kvs_model_seq_len positions); 0 if seq is out of range or the backend
 * is OpenCL (an empty sequence of a model without GDN blocks is 0 too).
 * kvs_model_seq_state_get: writes them to out[cap]; KVS_ERR_ARG (seq out of
 * range, out NULL), KVS_ERR_RANGE (cap too small), KVS_ERR_UNSUPPORTED (OpenCL).
 * kvs_model_seq_state_set: replaces seq's state by in[len], as written by
 * kvs_model_seq_state_get for n_past positions; KVS_ERR_RANGE if len is not
 * that size or n_past is outside [0, n_ctx], then nothing has changed. */
size_t kvs_model_seq_state_bytes(const struct kvs_model *m, int32_t seq);
kvs_err kvs_model_seq_state_get(const struct kvs_model *m, int32_t seq, uint8_t *out, size_t cap);
kvs_err kvs_model_seq_state_set(struct kvs_model *m, int32_t seq, int32_t n_past, const uint8_t *in, size_t len);

#endif

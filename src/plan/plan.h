/* The planner: places a model's blocks on a set of heterogeneous devices as a
 * ring of contiguous windows, and writes the rank manifest that
 * `kvasir stage --manifest ring.json --rank R` reads.
 *
 * Inputs
 *   - a model profile (struct kvs_plan_model): per block the weight bytes it
 *     occupies, the bytes a decode step streams, and KV-cache bytes per token;
 *     extras on the head (embedding) and tail (output norm + output, or the
 *     tied embedding); built from a GGUF header by kvs_plan_model_from_gguf or
 *     filled in by hand;
 *   - a device inventory (docs/PLAN.md "Device inventory");
 *   - serving targets (ctx, seqs, boundary precision).
 *
 * Cost model (docs/PLAN.md "Cost model"), all times in milliseconds:
 *   compute(d, [a,b)) = stream_bytes([a,b) + head/tail extras) / (decode_gbps*1e6)
 *                       + (b-a) * block_overhead_ms
 *   hop(x -> y, n)    = rtt(x,y)/2 + n*8 / (min(bw_x, bw_y)*1e3)      [n bytes, bw in Mbit/s]
 *   rtt(x,y)          = max(rtt_x, rtt_y) + (either relay-only ? relay_rtt_ms : 0)
 *   token_ms          = sum of compute over ranks + sum of hops around the ring,
 *                       boundary hops carry n_embd*boundary_bytes, the tail->head
 *                       hop a 4-byte token id; a one-rank ring has no hops.
 *   memory(d, [a,b))  = weights([a,b)) + common + head/tail extras
 *                       + kv_per_token([a,b)) * ctx * seqs + buffer (+ logits on the tail)
 * The solver minimises token_ms subject to memory(d) <= mem_bytes(d).
 * Exactness: for a fixed ring order the dynamic programme is exact; when the
 * number of orders is small enough every order is tried (the result is then
 * the global optimum of the cost model); otherwise a few heuristic orders plus
 * local swaps are tried (see plan_solve.c).
 */
#ifndef KVS_PLAN_H
#define KVS_PLAN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

struct kvs_gguf;

#define KVS_PLAN_MAX_BLOCKS 1024   /* runnable blocks of a model */
#define KVS_PLAN_MAX_DEVICES 64    /* devices in an inventory */
#define KVS_PLAN_NAME_MAX 64       /* device name, bytes incl. NUL */
#define KVS_PLAN_ADDR_MAX 384      /* "host:port" or a relay URL with its token, bytes incl. NUL */
#define KVS_PLAN_MANIFEST_VERSION 1
#define KVS_PLAN_KEY_MAX 65        /* a node public key in hex (Ed25519: 64 digits), bytes incl. NUL */

/* --- model profile ---------------------------------------------------------- */

/* Everything the planner needs to know about a model. Plain data: tests fill
 * it by hand. All byte counts are exact tensor bytes (unpadded). */
struct kvs_plan_model {
    uint32_t n_block;                                /* runnable blocks (excludes MTP/nextn blocks) */
    uint64_t block_weight_bytes[KVS_PLAN_MAX_BLOCKS]; /* bytes held in memory per block */
    uint64_t block_stream_bytes[KVS_PLAN_MAX_BLOCKS]; /* bytes read per decode token per block:
                                                        dense tensors fully, expert tensors
                                                        (ffn_*_exps) scaled by used/total */
    uint64_t block_kv_bytes[KVS_PLAN_MAX_BLOCKS];    /* KV-cache bytes per token per block:
                                                        2 (K,V) * n_head_kv * head_dim * 2 (F16);
                                                        0 for a Gated DeltaNet block */
    uint64_t block_state_bytes[KVS_PLAN_MAX_BLOCKS]; /* recurrent state bytes per sequence per
                                                        block (fixed, whatever the context):
                                                        Gated DeltaNet ((K-1)·C + H_v·d²) · 4
                                                        (F32); 0 for attention blocks */
    uint64_t common_bytes;      /* non-block tensors every stage holds (e.g. rope_freqs) */
    uint64_t head_bytes;        /* held by rank 0 only: token_embd */
    uint64_t head_stream_bytes; /* streamed per token on the head (one embedding row) */
    uint64_t tail_bytes;        /* held by the tail only: output_norm + output (or the tied
                                   token_embd) + MTP/nextn blocks */
    uint64_t tail_stream_bytes; /* streamed per token on the tail: output_norm + output */
    uint64_t tied_bytes;        /* part of tail_bytes that is the head's token_embd (tied
                                   output); held once when head and tail are one device */
    uint32_t n_embd;            /* boundary width */
    uint32_t n_vocab;           /* logits width (tail buffer) */
    char fingerprint[65];       /* lower-case hex, or "" if unknown */
    char content_id[65];        /* content id (docs/FORMATS.md), lower-case hex, or "" if unknown:
                                   set by the caller (the header alone cannot give it) */
    uint32_t ctx_train;         /* `{arch}.context_length`, 0 if absent */
};

/* Builds a profile from a parsed GGUF (header only is enough: no tensor data
 * is read). Blocks are `blk.N.*`; `{arch}.nextn_predict_layers` trailing blocks
 * (MTP) are not runnable and count as tail bytes. head_dim is
 * `{arch}.attention.key_length` (value_length for V), default n_embd/n_head;
 * `{arch}.attention.head_count_kv` may be a per-layer array (gguf-facts §3.2).
 * Expert tensors (`*_exps`, 3-D {.., .., n_expert}) stream
 * bytes * expert_used_count / n_expert per token. Hybrid models (qwen35,
 * qwen35moe, qwen3next: `{arch}.ssm.*` keys, ../shared/docs/qwen35-facts.md
 * §1, §4.2): a block is Gated DeltaNet per `{arch}.attention.recurrent_layers`
 * or else unless (il + 1) % `{arch}.full_attention_interval` (default 4) == 0;
 * it has no KV cache but block_state_bytes per sequence.
 * *out is malloc'd (free with free()). Errors: KVS_ERR_FORMAT / NOT_FOUND
 * (missing or bad hyperparameters), KVS_ERR_RANGE (more than
 * KVS_PLAN_MAX_BLOCKS blocks, block index out of range), KVS_ERR_NOMEM. */
kvs_err kvs_plan_model_from_gguf(const struct kvs_gguf *g, struct kvs_plan_model **out, char *errbuf,
                                 size_t errlen);

/* --- devices ------------------------------------------------------------------ */

enum kvs_plan_backend {
    KVS_PLAN_BACKEND_CPU = 0,
    KVS_PLAN_BACKEND_CUDA,
    KVS_PLAN_BACKEND_METAL,
    KVS_PLAN_BACKEND_VULKAN,
    KVS_PLAN_BACKEND_OPENCL,
    KVS_PLAN_BACKEND_NPU,
    KVS_PLAN_BACKEND_COUNT_
};

/* "cpu", "cuda", ... (static string; "?" if out of range). */
const char *kvs_plan_backend_name(enum kvs_plan_backend b);

struct kvs_plan_device {
    char name[KVS_PLAN_NAME_MAX];
    enum kvs_plan_backend backend;
    uint64_t mem_bytes;        /* usable memory, bytes */
    double decode_gbps;        /* effective weight-streaming rate, GB/s (1e9 B/s), > 0 */
    double prefill_gflops;     /* informational, GFLOP/s (not in the decode model) */
    double rtt_ms;             /* round trip to the others (or to the relay), ms */
    double bandwidth_mbps;     /* link bandwidth, Mbit/s (1e6 bit/s), > 0 */
    bool accepts_inbound;      /* false: relay-only (its hops add relay_rtt_ms) */
    uint32_t threads;          /* threads the stage should use (>= 1) */
    char addr[KVS_PLAN_ADDR_MAX]; /* "host:port" or "" (then 127.0.0.1:(7001+rank)) */
    char key[KVS_PLAN_KEY_MAX];   /* node public key: 64 lowercase hex digits (`kvasir key show`), or "" */
};

/* A parsed inventory. */
struct kvs_plan_inventory {
    size_t n_devices;
    struct kvs_plan_device devices[KVS_PLAN_MAX_DEVICES];
    double relay_rtt_ms;       /* extra RTT of a relayed hop; "relay": {"rtt_ms": x}, default 40 */
    char relay_url[KVS_PLAN_ADDR_MAX]; /* "relay": {"url": "wss://HOST[:PORT]"}: where relayed edges go, or "" */
    uint8_t relay_secret[256]; /* not from the JSON: the relay's secret, set by the caller to mint the */
    size_t relay_secret_len;   /* edge tokens of relayed edges (docs/RELAY.md §4); 0 = none */
};

struct kvs_plan_result;
/* True when the edge from ranks[r] to ranks[(r+1) % n] of res goes through the
 * relay: either end's device has accepts_inbound false (a one-rank ring has none). */
bool kvs_plan_edge_relayed(const struct kvs_plan_inventory *inv, const struct kvs_plan_result *res, size_t r);

/* Parses an inventory JSON document (docs/PLAN.md): either
 * {"devices": [...], "relay": {"rtt_ms": 40}} or a bare array of devices.
 * text need not be NUL-terminated. Errors: KVS_ERR_FORMAT (the message names
 * the device and field), KVS_ERR_RANGE (too many devices, value out of range). */
kvs_err kvs_plan_inventory_parse(const char *text, size_t len, struct kvs_plan_inventory *inv, char *errbuf,
                                 size_t errlen);
/* Reads and parses a file (at most 16 MiB). Errors as above plus KVS_ERR_IO. Like the
 * parse errors, errbuf does not name the path: the caller does. */
kvs_err kvs_plan_inventory_load(const char *path, struct kvs_plan_inventory *inv, char *errbuf, size_t errlen);

/* --- solving ---------------------------------------------------------------------- */

struct kvs_plan_targets {
    uint32_t ctx;               /* tokens of context per sequence */
    uint32_t seqs;              /* concurrent sequences (KV is ctx * seqs tokens) */
    uint32_t boundary_bytes;    /* bytes per boundary value on every edge: 4 (f32) or 2 (f16);
                                   0 = auto: f32 except on edges too slow for it
                                   (kvs_plan_edge_boundary_bytes) */
    double f16_above_ms;        /* auto: an edge whose f32 decode boundary takes longer than this
                                   to transmit (n_embd * 4 * 8 / bandwidth, ms) goes f16 */
    uint32_t ubatch;            /* tokens per prefill micro-batch (sizes work buffers) */
    double block_overhead_ms;   /* fixed cost per block per token */
    uint32_t token_bytes;       /* bytes of the tail->head hop (a token id): 4 */
    uint64_t exhaustive_limit;  /* work units (orders x (n+1)^2 x k^2) below which every
                                   ring order is tried */
};
/* ctx 4096, seqs 1, auto boundary (f16 above 5 ms), ubatch 512, 0.02 ms per
 * block, token 4 bytes, exhaustive_limit 2e8. */
struct kvs_plan_targets kvs_plan_default_targets(void);

/* The default context of a plan, as for `kvasir run` / `serve` / `stage`:
 * min(m->ctx_train, 4096), or 4096 when the model does not say (ctx_train 0). */
uint32_t kvs_plan_default_ctx(const struct kvs_plan_model *m);

/* Bytes per boundary value on the edge x -> y: t->boundary_bytes when it is 4
 * or 2; auto (0): 2 when n_embd * 4 bytes take longer than t->f16_above_ms to
 * transmit at min(bandwidth of x, y), else 4 (F16 rounds the hidden state, so
 * a ring with an f16 edge may differ from one process: docs/PLAN.md). */
uint32_t kvs_plan_edge_boundary_bytes(const struct kvs_plan_model *m, const struct kvs_plan_targets *t,
                                      const struct kvs_plan_device *x, const struct kvs_plan_device *y);

/* Work-buffer bytes a stage needs besides weights and KV (per device):
 * ubatch * n_embd * 4 bytes * 8 (activations, F32), plus on the tail
 * seqs * n_vocab * 4 (logits). */
uint64_t kvs_plan_buffer_bytes(const struct kvs_plan_model *m, const struct kvs_plan_targets *t, bool tail);

/* One rank of a plan. */
struct kvs_plan_rank {
    size_t device;              /* index into the inventory */
    uint32_t begin, end;        /* window [begin, end) */
    uint64_t weights_bytes;     /* blocks + common + head/tail extras */
    uint64_t kv_bytes;          /* KV cache for ctx * seqs tokens + recurrent state for seqs */
    uint64_t buffer_bytes;      /* work buffers (kvs_plan_buffer_bytes) */
    double compute_ms;          /* per decode token */
    double hop_ms;              /* to the next rank (tail: token id to rank 0); 0 if alone */
    uint32_t boundary_bytes;    /* of the boundaries this rank sends to the next: 4 (f32) or 2 (f16);
                                   the tail (it sends token ids) and a lone rank: 4 */
};

struct kvs_plan_result {
    size_t n_ranks;
    struct kvs_plan_rank ranks[KVS_PLAN_MAX_DEVICES];
    double token_ms;            /* predicted per-token decode latency of one sequence */
    double max_stage_ms;        /* max over ranks of compute_ms */
    double decode_tps_1;        /* 1000 / token_ms */
    double decode_tps_seqs;     /* 1000 * S / max(token_ms, S * max_stage_ms) */
    uint32_t seqs;
    bool exhaustive;            /* every ring order was tried (global optimum of the model) */
    uint64_t shortfall_bytes;   /* on KVS_ERR_INFEASIBLE: bytes missing (0 if the shortfall
                                   is fragmentation, not total capacity) */
};

/* Solves the placement. Devices not in the result are "excluded" (unused).
 * On KVS_ERR_INFEASIBLE res->shortfall_bytes and errbuf name the shortfall:
 *   - a block (its weights + KV + common + buffer) larger than every device:
 *     shortfall = that need - the largest mem_bytes (the worst block);
 *   - total: need = sum of block weights + KV + head + tail extras + tail logits
 *     (- tied bytes if only one device can hold anything), capacity = sum over
 *     devices of max(0, mem - common - buffer); shortfall = need - capacity.
 * Errors: KVS_ERR_ARG (n_block 0, no devices, bad targets or device figures),
 * KVS_ERR_INFEASIBLE, KVS_ERR_NOMEM. */
kvs_err kvs_plan_solve(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                       const struct kvs_plan_targets *t, struct kvs_plan_result *res, char *errbuf,
                       size_t errlen);

/* The cost of a given placement under the same model (no memory check):
 * ranks[i] = device index and window; windows must be contiguous from 0 to
 * n_block. Returns token_ms, or a negative value if the placement is invalid.
 * Fills compute/hop/bytes of each rank and the predictions in res if res is
 * not NULL (res->ranks copied from ranks). */
double kvs_plan_evaluate(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                         const struct kvs_plan_targets *t, const struct kvs_plan_rank *ranks, size_t n_ranks,
                         struct kvs_plan_result *res);

/* Memory a device needs for window [begin, end) as head/tail per the window. */
uint64_t kvs_plan_window_mem(const struct kvs_plan_model *m, const struct kvs_plan_targets *t, uint32_t begin,
                             uint32_t end);

/* --- manifest ------------------------------------------------------------------------ */

/* Writes the rank manifest (docs/MANIFEST.md) as a malloc'd NUL-terminated
 * JSON string (*json, caller frees). model_path / model_url may be NULL
 * (written as null). listen = the device's addr, or 127.0.0.1:(7001 + rank);
 * next = the next rank's listen (the tail's next is rank 0's). Excluded
 * devices are listed with a reason. Errors: KVS_ERR_NOMEM. */
/* Writes the manifest (docs/MANIFEST.md) as a JSON string (*json, free()).
 * A relayed edge (kvs_plan_edge_relayed) is written as the relay URL
 * inv->relay_url/edge/EDGE_ID?token=HEX in the receiving rank's listen and
 * the sending rank's next: EDGE_ID = "e" + the first 24 hex digits of
 * SHA-256(fingerprint "/" sending device "/" receiving device), the token
 * minted with inv->relay_secret. Errors: KVS_ERR_ARG (a relayed edge but no
 * relay_url or no secret), KVS_ERR_NOMEM. */
kvs_err kvs_plan_manifest_json(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                               const struct kvs_plan_targets *t, const struct kvs_plan_result *res,
                               const char *model_path, const char *model_url, char **json);

/* A manifest as read back (for `kvasir stage --manifest`). */
struct kvs_manifest_rank {
    uint32_t rank;
    char device[KVS_PLAN_NAME_MAX];
    uint32_t begin, end;
    char listen[KVS_PLAN_ADDR_MAX];
    char next[KVS_PLAN_ADDR_MAX];
    uint32_t threads;
    enum kvs_plan_backend backend; /* "backend" (cpu if absent): the stage's compute backend */
    char key[KVS_PLAN_KEY_MAX]; /* the rank's node public key (64 lowercase hex digits), "" if absent */
    uint32_t boundary_bytes;    /* ranks[i].boundary (its out link): 2 ("f16") or 4 ("f32"), 0 if absent */
};
struct kvs_manifest {
    char model_path[1024];      /* "" if null */
    char model_url[1024];       /* "" if null */
    char fingerprint[65];       /* "" if absent */
    char content_id[65];        /* model.content_id: 64 lower-case hex, "" if absent */
    uint32_t n_block;
    uint32_t ctx;               /* targets.ctx (1..16777216), 0 if "targets" is absent */
    uint32_t seqs;              /* targets.seqs (1..4096), 0 if absent */
    uint32_t boundary_bytes;    /* targets.boundary: 2 ("f16"), 4 ("f32"), 0 if "auto" or absent */
    size_t n_ranks;
    struct kvs_manifest_rank ranks[KVS_PLAN_MAX_DEVICES];
};

/* Parses and validates a manifest: version 1, ranks numbered 0..n-1 in
 * order, windows contiguous and covering [0, n_block), each rank's next equal
 * to the following rank's listen (the last rank's to rank 0's), and, when
 * "targets" is present, ctx in 1..16777216, seqs in 1..4096 and boundary
 * "f16", "f32" or "auto"; ranks[i].boundary, when present, "f16" or "f32". Errors: KVS_ERR_FORMAT (message names the field),
 * KVS_ERR_UNSUPPORTED (other version), KVS_ERR_RANGE (windows, targets out of
 * range). */
kvs_err kvs_manifest_parse(const char *text, size_t len, struct kvs_manifest *mf, char *errbuf, size_t errlen);
kvs_err kvs_manifest_load(const char *path, struct kvs_manifest *mf, char *errbuf, size_t errlen);

/* --- header over HTTP ------------------------------------------------------------------ */

/* Fetches a GGUF header from url with HTTP range requests, growing the read
 * geometrically (1 MiB first) while kvs_gguf_parse answers NEED_MORE, at most
 * 1 GiB. On success *buf (malloc'd; caller frees AFTER kvs_gguf_close) holds the
 * bytes and *out the parsed header (file_size from Content-Range).
 * Errors: KVS_ERR_NET, KVS_ERR_FORMAT, KVS_ERR_NOMEM, KVS_ERR_RANGE. */
kvs_err kvs_plan_fetch_header(const char *url, uint8_t **buf, struct kvs_gguf **out, char *errbuf,
                              size_t errlen);

#endif

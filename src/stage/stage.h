/* A ring stage: one process's part of a model served over a ring of links.
 *
 * A stage holds blocks [begin, end) of a model (kvs_model), accepts a link
 * from its predecessor and dials its successor (the tail's successor is the
 * head), and runs the loop of docs/PROTOCOL.md: frames in -> forward -> frames
 * out. The head (begin 0) also admits requests through the request API below
 * (used by `kvasir run --ring`, and by the HTTP API): it owns the prompt, feeds
 * sampled tokens back in, and reports every token to the request's callback.
 * The tail (end == n_block) samples with the parameters that travel with each
 * request. Several sequences in flight are batched into one forward call on
 * every stage (one DECODE frame per step of the batch).
 *
 * Faults (PROTOCOL.md §5): the stage stays up, re-dials / re-accepts, and
 * serves again once the ring is whole. On the head, a lost or silent link
 * anywhere in the ring holds every request in flight (its events pause, and
 * new requests wait in the queue) until a probe gets round again; then each is
 * re-prefilled with its prompt and the ids generated so far on every stage and
 * continues, so its events are those of a run without the fault, none twice
 * (§5.1). If the ring is not whole within replay_deadline_ms (default 30 s)
 * they fail with an error event (KVS_ERR_PEER) and their slots are freed.
 *
 * Threads: kvs_stage_run runs the loop on the calling thread. kvs_stage_submit,
 * kvs_stage_cancel, kvs_stage_stop, kvs_stage_metrics and kvs_stage_ring_ready
 * may be called from any thread while it runs. Request callbacks are invoked on
 * the loop thread and must not block (copy the data and return).
 */
#ifndef KVS_STAGE_H
#define KVS_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "sampler/sampler.h"
#include "tokenizer/tokenizer.h"
#include "trust/trust.h"

struct kvs_stage_params {
    const char *model_path;   /* GGUF file (full model or a shard of it) */
    int32_t block_begin;      /* window [begin, end); end -1 = n_block */
    int32_t block_end;
    const char *listen;       /* "HOST:PORT" to accept the predecessor on (port 0: any free port), or a
                               * relay URL ws[s]://RELAY/edge/ID[?token=HEX] (docs/RELAY.md §2): the in
                               * link then dials out to the relay as the edge's downstream end */
    const char *next;         /* "HOST:PORT" of the successor, or a relay URL (dialed as the upstream
                               * end); NULL allowed for a whole-model window */
    const char *relay_ca;     /* wss:// links: PEM file of the CA(s) (or the relay's self-signed
                               * certificate) to trust; NULL: the system's store. Copied at create */
    const char *relay_pin;    /* wss:// links: SHA-256 (hex) of the relay certificate's DER, trusted
                               * instead of relay_ca; NULL: none. Copied at create */
    int32_t n_threads;        /* compute threads (default 2) */
    int32_t backend;          /* enum kvs_backend (model.h): 0 cpu (default), 1 opencl */
    int32_t device;           /* OpenCL device index (default 0) */
    int32_t n_ctx;            /* positions per sequence, 0 = model default; all stages must agree */
    int32_t n_seq;            /* sequence slots (default 4) */
    int32_t n_batch;          /* most tokens per forward and per PREFILL frame (default 512); all stages must agree */
    bool boundary_f32;        /* send boundaries as F32 (the default) instead of F16 */
    int32_t timeout_ms;       /* in-link silence / ring probe timeout (default 4000) */
    int32_t keepalive_ms;     /* keepalive and probe period (default 1000) */
    int32_t step_delay_ms;    /* test hook: sleep before every forward (default 0) */
    const char *fingerprint;  /* expected model fingerprint (hex) or NULL: checked at create */
    const char *content_id;   /* expected content id (hex, docs/FORMATS.md) or NULL: checked at create
                               * when the file's is known (a full model: hashed at create; a shard:
                               * the one it records) */
    int stop_fd;              /* extra fd: readable -> kvs_stage_run returns (e.g. a signalfd); -1 none */
    int32_t decode_groups;    /* head: decode batches kept in the ring at once (default 1: all sequences
                               * step together in one batch, best when stages share cores; G > 1
                               * pipelines G batches, for stages on separate machines) */
    int32_t pool_spin;        /* relax iterations the compute pool's threads spin before sleeping after
                               * a parallel step: 0 = KVS_STAGE_POOL_SPIN (short: stages that share
                               * cores give them up as soon as their forward ends), -1 = the pool's
                               * long default (a stage with cores of its own), N > 0 = N. The
                               * KVASIR_SPIN environment variable overrides it (src/kernels/pool.c) */
    /* Trust (docs/PROTOCOL.md §4, src/trust/trust.h). With a key, every link is TLS 1.3 and the
     * neighbours must prove the keys named here (both required); a keyed stage never makes or
     * accepts a plaintext link. Without a key a stage with links needs insecure. */
    const struct kvs_key *key;      /* this node's key (borrowed during kvs_stage_create only) or NULL */
    bool has_prev_key, has_next_key;
    uint8_t prev_key[KVS_KEY_PUB_BYTES]; /* the predecessor's public key */
    uint8_t next_key[KVS_KEY_PUB_BYTES]; /* the successor's public key */
    bool insecure;                  /* plaintext, unauthenticated links: for debugging on one machine */
    /* Head: when the ring breaks, requests in flight are held (their streams pause) until the
     * ring is whole again, then replayed by token ids (docs/PROTOCOL.md §5.1); they fail only if
     * it is not whole within this many ms. 0 = KVS_STAGE_REPLAY_DEADLINE_MS; < 0 = no hold:
     * they fail at once (the behaviour before replay). */
    int32_t replay_deadline_ms;
    /* A planned leave (docs/PROTOCOL.md §5.2), for a stage under a local supervisor
     * (src/cli/cli_local_ring.c). control_fd: a stream socket to the supervisor, -1 none (the
     * default); the stage writes "leave\n" on it when stop_fd fires instead of stopping (any
     * stage but the head, on the CPU backend, with both links up; else it stops as before),
     * keeps serving until it reads "go\n" (its replacement is ready), then drains through the
     * ring (LEAVE frames), writes its sequences' state to handover_path and stops. "no\n", an
     * EOF, a second stop_fd event or no "go" within KVS_STAGE_LEAVE_GO_MS stops it at once.
     * takeover_path: this stage replaces one that is leaving: kvs_stage_create writes
     * "ready\n" on control_fd once the model is loaded, waits (at most
     * KVS_STAGE_LEAVE_GO_MS) for that file, takes the sequences in it, removes it, and only
     * then listens; without a usable file it starts empty and its first link to its successor
     * counts as a re-join (the head replays, §5.1). Paths are copied at create; NULL none. */
    int control_fd;
    const char *handover_path;
    const char *takeover_path;
};
#define KVS_STAGE_LEAVE_GO_MS 15000
#define KVS_STAGE_REPLAY_DEADLINE_MS 30000
#define KVS_STAGE_POOL_SPIN 200
struct kvs_stage_params kvs_stage_default_params(void);

struct kvs_stage; /* opaque */

/* Loads the window, opens the listening socket and prepares every buffer
 * (the loop allocates only when a request starts). Errors: those of
 * kvs_gguf_open / kvs_model_load / kvs_tcp_listen, KVS_ERR_MISMATCH (the file's
 * fingerprint is not params->fingerprint, or its content id not
 * params->content_id), KVS_ERR_ARG (no next address for a
 * stage that is not the whole model). A window of the whole model is a
 * one-stage ring: the head samples locally, dials nothing, refuses
 * predecessors (next is ignored). errbuf gets a message. */
kvs_err kvs_stage_create(const struct kvs_stage_params *p, struct kvs_stage **out, char *errbuf, size_t errlen);
/* Stops (if running: call kvs_stage_stop and join first), closes links, frees. NULL allowed. */
void kvs_stage_free(struct kvs_stage *s);

/* Runs the loop until kvs_stage_stop is called or stop_fd becomes readable.
 * Returns KVS_OK then; an error only if polling itself fails. */
kvs_err kvs_stage_run(struct kvs_stage *s);
/* Asks the loop to return (thread-safe; also async-signal-safe). */
void kvs_stage_stop(struct kvs_stage *s);

/* Re-points the stage at another successor ("HOST:PORT" or a relay URL), e.g. when the
 * market's map names a new node for the following window. Thread-safe: the
 * loop closes the link to the old successor (requests in flight through it
 * fail as on a lost link, PROTOCOL.md §5) and dials the new one at once.
 * Errors: KVS_ERR_ARG (malformed address, or a whole-model stage, which has
 * no successor); errbuf says why. */
kvs_err kvs_stage_set_next(struct kvs_stage *s, const char *next, char *errbuf, size_t errlen);
/* kvs_stage_set_next with the neighbours' keys, for a keyed stage whose neighbours change at run
 * time (kvasir join: the market's map names them and their public keys). next: the successor's
 * address, or NULL to keep it; next_key: the key the successor must prove, or NULL to keep it (a
 * new key with the same address also re-dials); prev_key: the key a predecessor must prove from
 * now on, or NULL to keep it (a new one closes the in link and the pending links made under the
 * old key, so the new predecessor's dial is checked against it). Thread-safe; applied by the loop
 * at its next wake. Errors: KVS_ERR_ARG (as kvs_stage_set_next; a key given to a stage without a
 * node key). */
kvs_err kvs_stage_set_neighbours(struct kvs_stage *s, const char *next, const uint8_t next_key[KVS_KEY_PUB_BYTES],
                                 const uint8_t prev_key[KVS_KEY_PUB_BYTES], char *errbuf, size_t errlen);

/* The port actually listened on (useful with port 0). */
uint16_t kvs_stage_listen_port(const struct kvs_stage *s);
bool kvs_stage_is_head(const struct kvs_stage *s);
/* Positions per sequence (n_ctx): a prompt of n_ctx tokens or more does not fit. */
int32_t kvs_stage_n_ctx(const struct kvs_stage *s);
/* Head only: the model's tokenizer (borrowed, lives as long as s); NULL on other stages. */
const struct kvs_tokenizer *kvs_stage_tokenizer(const struct kvs_stage *s);

/* --- request API (head only) --------------------------------------------- */

enum kvs_stage_event_kind {
    KVS_STAGE_EVENT_TOKEN = 1, /* a generated token (not sent for a stop id) */
    KVS_STAGE_EVENT_DONE,      /* finished normally: `finish` says why; last event */
    KVS_STAGE_EVENT_ERROR,     /* failed or cancelled: `err` + `message`; last event */
};

struct kvs_stage_event {
    enum kvs_stage_event_kind kind;
    uint32_t req;          /* request id from kvs_stage_submit */
    int32_t token;         /* TOKEN: the id */
    int32_t pos;           /* TOKEN: its position in the sequence */
    uint32_t finish;       /* DONE: enum kvs_finish (proto.h): 1 stop id, 2 length */
    int32_t n_generated;   /* tokens reported so far */
    kvs_err err;           /* ERROR: KVS_ERR_CANCELLED, KVS_ERR_PEER (ring broken), KVS_ERR_TIMEOUT, ... */
    const char *message;   /* ERROR: text (borrowed for the call) */
};

typedef void (*kvs_stage_event_fn)(void *user, const struct kvs_stage_event *ev);

struct kvs_stage_request {
    const int32_t *prompt;   /* [n_prompt] ids (copied by submit) */
    int32_t n_prompt;        /* 1 .. n_ctx - 1 */
    struct kvs_sampler_params sampling;
    int32_t max_tokens;      /* >= 1 */
    bool ignore_eos;         /* do not stop at stop ids */
    const int32_t *stop_ids; /* [n_stop_ids]; NULL/0: the tokenizer's end-of-generation ids */
    int32_t n_stop_ids;      /* <= KVS_PROTO_MAX_STOP (16) */
    kvs_stage_event_fn on_event; /* required */
    void *user;
};

/* Queues a request (copies it); returns its id in *req. It starts when a
 * slot is free on the head. Events arrive through on_event; exactly one DONE
 * or ERROR ends it. If the ring is not whole when the loop picks it up it
 * fails at once (ERROR, KVS_ERR_PEER). Text stop strings are the caller's
 * job: match them on the decoded text and cancel. Errors: KVS_ERR_ARG (not
 * the head, bad fields), KVS_ERR_RANGE (prompt does not fit n_ctx),
 * KVS_ERR_FULL (1024 requests already queued). */
kvs_err kvs_stage_submit(struct kvs_stage *s, const struct kvs_stage_request *r, uint32_t *req);
/* Cancels a request: it ends with ERROR KVS_ERR_CANCELLED (if it has not
 * ended already) and its slots are freed on every stage. Unknown ids are
 * ignored. Errors: KVS_ERR_FULL (too many cancels pending). */
kvs_err kvs_stage_cancel(struct kvs_stage *s, uint32_t req);

/* True when both links are up and a ring probe returned within the timeout
 * (head); for other stages, when both links are up. */
bool kvs_stage_ring_ready(struct kvs_stage *s);
/* Head: true while the ring is broken but the head holds its requests for a
 * replay (within replay_deadline_ms of the fault, PROTOCOL.md §5.1): a request
 * submitted now waits in the queue and is served once the ring is whole, or
 * fails when the deadline passes. Thread-safe. */
bool kvs_stage_ring_holding(struct kvs_stage *s);
/* Blocks until ring_ready (KVS_OK) or timeout_ms passes (KVS_ERR_TIMEOUT).
 * Returns early when the ring cannot close: a neighbour's handshake was
 * refused (its code, usually KVS_ERR_MISMATCH; kvs_stage_ring_error says
 * why), or the loop stopped (KVS_ERR_CANCELLED). */
kvs_err kvs_stage_wait_ready(struct kvs_stage *s, int timeout_ms);
/* Why the ring cannot close, if this stage knows: the loop stopped
 * (KVS_ERR_CANCELLED, first), the successor refused this stage or does not
 * fit it, or this stage refused its predecessor (a configuration error:
 * model, window, n_ctx or version). buf gets the message, "" and KVS_OK when none. A
 * refusal is kept until the link comes up, or the refusing successor can no
 * longer be reached. Thread-safe. */
kvs_err kvs_stage_ring_error(struct kvs_stage *s, char *buf, size_t cap);
/* Why the successor cannot be reached, from the last failed dial ("cannot
 * reach the successor HOST:PORT: connection refused"): true and buf set;
 * false and "" once a dial succeeds (or before the first). Thread-safe. */
bool kvs_stage_link_error(struct kvs_stage *s, char *buf, size_t cap);

struct kvs_stage_metrics {
    bool ring_ready;
    bool in_up, out_up;         /* predecessor / successor links */
    int32_t n_active;           /* sequences holding a slot here */
    int32_t n_queued;           /* head: submitted, waiting for a slot */
    uint64_t requests_started;  /* head: requests sent round */
    uint64_t requests_done;     /* head: ended with DONE */
    uint64_t requests_failed;   /* head: ended with ERROR (incl. cancelled) */
    uint64_t requests_replayed; /* head: replays of held requests after a fault (§5.1; one per request and fault) */
    int32_t n_held;             /* head: requests held now, waiting for the ring to be whole again */
    bool ring_holding;          /* head: the ring broke and is not whole again yet, within the replay deadline:
                                 * requests submitted now wait in the queue (§5.1) */
    uint64_t tokens_generated;  /* head: TOKEN events; tail: tokens sampled */
    uint64_t prefill_tokens;    /* tokens run through this window as prompt */
    uint64_t decode_rows;       /* decode rows run through this window */
    uint64_t forward_calls;     /* kvs_model_forward calls */
    double forward_ms;          /* time spent in them */
    uint64_t bytes_in, bytes_out;
    uint64_t links_lost;        /* in or out link failures */
    uint64_t frames_rejected;   /* bad frames / refused handshakes */
};
/* Snapshot of the counters (thread-safe). */
void kvs_stage_metrics(struct kvs_stage *s, struct kvs_stage_metrics *m);

/* Per-stage figures from the ring probe trail (docs/PROTOCOL.md §3.8.1):
 * the head sends a probe every keepalive period (1 s); every stage appends
 * its counters and timestamps; the head keeps the last trail that came back.
 * Entry 0 is the head, then the stages in ring order. Counters are
 * cumulative since each stage started (take differences for rates). */
struct kvs_stage_hop {
    int32_t block_begin, block_end; /* the stage's window */
    uint64_t forward_calls;         /* kvs_model_forward calls on that stage */
    double forward_ms;              /* compute time of its window, ms (sum over the calls) */
    uint64_t rows;                  /* prefill + decode rows it ran */
    uint64_t bytes_out;             /* bytes it wrote to its successor (frames incl. headers) */
    double residence_ms;            /* probe read -> probe written on that stage (0 on the head) */
    double hop_ms;                  /* its send -> the successor's read (the tail's: -> the head), ms, from the
                                     * stages' wall clocks: exact on one host, clock-sync accurate across
                                     * hosts; includes time the probe queued behind frames being computed */
};
/* Head only: copies up to cap entries of the last trail into out and
 * returns the number of stages it holds (0: not the head, or no trail came
 * back yet). *rtt_ms (may be NULL) gets that probe's round trip on the
 * head's clock. Thread-safe. */
int kvs_stage_ring_stats(struct kvs_stage *s, struct kvs_stage_hop *out, int cap, double *rtt_ms);

/* --- manifest (docs/MANIFEST.md; reader: kvs_manifest_load in src/plan/plan.h) --- */

struct kvs_manifest;
/* Fills the model/window/link/threads fields of p from rank `rank` of a
 * manifest read by kvs_manifest_load, and n_ctx / n_seq / boundary_f32 from
 * its targets when present (strings borrowed from mf, which must outlive p's
 * use), and the neighbours' keys (prev_key, next_key) when the manifest has keys. Errors: KVS_ERR_NOT_FOUND (no such rank), KVS_ERR_ARG (the
 * manifest names no local model path). */
kvs_err kvs_stage_params_from_manifest(const struct kvs_manifest *mf, int32_t rank, struct kvs_stage_params *p);

#endif

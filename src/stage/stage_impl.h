/* Internal header of the stage module: the stage object and the functions
 * its files share. Not part of the public interface (stage.h).
 *
 * Files by responsibility:
 *   create / free and the public API (stage.c)
 *   the loop, timers, forward and metrics (stage_loop.c)
 *   links: sending, handshakes (HELLO), the pending table, dial, link loss (stage_link.c)
 *   the sequence table and the data path of a window: REQUEST_START, PREFILL, DECODE, END, ERROR (stage_seq.c)
 *   the head: requests, admission, prompt, batched decode, returned tokens (stage_head.c)
 *   the tail: sampling (stage_tail.c)
 *   ring probes and their trails (stage_probe.c)
 *   a planned leave: LEAVE frames, the drain, the state handover (stage_leave.c)
 *   kvs_stage_params_from_manifest (stage_manifest.c)
 * Every function here runs on the loop thread unless it says otherwise;
 * fields under `mu` are shared with other threads. */
#ifndef KVS_STAGE_IMPL_H
#define KVS_STAGE_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "link/link.h"
#include "model/model.h"
#include "proto/proto.h"
#include "sampler/sampler.h"
#include "stage/stage.h"
#include "trust/trust.h"
#include "tokenizer/tokenizer.h"

#define MAX_PENDING_LINKS 16 /* accepted connections waiting for their HELLO */
#define PEND_MIN_AGE_MS 250  /* a new connection evicts a pending one only if that one is older than this */
#define MAX_PENDING_PER_ADDR 4 /* pending links one source address may hold: a flood from one address
                                  rotates its own entries and never fills the table */
#define REFUSAL_LOG_BURST 10 /* refused / closed pending links logged per REFUSAL_LOG_MS, then counted */
#define REFUSAL_LOG_MS 10000
#define HANDSHAKE_MS 3000    /* a HELLO must arrive within this */
#define PROBE_UNREADY_MS 20  /* head: probe interval until a probe has come round (then keepalive_ms) */
#define PROBE_ACCEPT 1024u   /* head: a returning probe counts if it is one of the last this many */
#define MAX_QUEUE 1024       /* submitted requests waiting */
#define MAX_CANCELS 1024
#define READ_CHUNK 65536
#define REFUSED_BACKOFF_MAX_MS 16000 /* re-dial a refusing successor after 1, 2, 4 .. 16 s */
#define BYE_WRITE_MS 200     /* a goodbye ERROR is best effort: never hold a stopping stage longer */
#define LEAVE_DRAIN_MS 5000  /* a planned leave (§5.2): the drain must be done within this, else a fault */
#define LEAVE_PROBE_MS 5     /* head: probe interval while a leave drains */
#define LEAVE_REDIAL_MS 5    /* re-dial interval to a successor that left on purpose (its replacement) */
#define LEAVE_REDIAL_FOR_MS 5000

struct seq {
    bool used;
    bool finished;            /* tail: the last token was sampled */
    uint32_t req;
    /* tail */
    struct kvs_sampler *smp;
    uint32_t max_tokens, generated; /* max_tokens: the head's copy too */
    bool ignore_eos;
    uint32_t n_stop;
    int32_t stop[KVS_PROTO_MAX_STOP];
    /* head */
    kvs_stage_event_fn cb;
    void *user;
    int32_t n_reported;
    bool has_next;            /* a token is waiting to be fed */
    bool decoding;            /* its first token came back: it takes part in decode batches */
    int32_t next_tok, next_pos;
    /* head, for a replay (§5.1): the request's parameters; its ids (prompt, then every token
     * that came back) lie in s->hist[slot] */
    struct kvs_req_params rp;
    int32_t n_prompt, n_hist;
    bool held;                /* the ring broke: waiting for it to be whole, then replayed */
};

/* Head: one slot's token ids (prompt + generated), kept for a replay; grown
 * when a request starts, never in the decode loop. */
struct hist {
    int32_t *ids;
    int32_t cap;
};

struct queued {
    uint32_t req;
    struct kvs_stage_request r; /* prompt/stop_ids point into owned copies */
    int32_t *prompt;
    int32_t stop[KVS_PROTO_MAX_STOP];
};

struct pending_link {
    struct kvs_link *l;
    struct kvs_proto_decoder *dec;
    int64_t since;
    bool relay; /* the in link this stage dialed out to the relay: it waits for its partner
                 * (the relay times that out, RELAY.md §5), not HANDSHAKE_MS */
};

enum out_state { OUT_DOWN = 0, OUT_HANDSHAKE, OUT_UP };

struct kvs_stage {
    struct kvs_stage_params p;
    char listen_addr[256], next_addr[256];
    struct kvs_gguf *g;
    struct kvs_model *m;
    struct kvs_tokenizer *tok; /* head only */
    struct kvs_hparams hp;
    uint8_t fp[32];
    char fp_hex[65];
    uint8_t cid[32];  /* the model's content id (kvs_shard_content_id), all zero if unknown */
    char cid_hex[65]; /* its hex, "" if unknown */
    int32_t begin, end, n_ctx, n_seq, n_batch;
    uint32_t n_embd, n_vocab;
    bool is_head, is_tail;
    int32_t eog[KVS_PROTO_MAX_STOP];
    uint32_t n_eog;

    struct kvs_listener *lst;
    struct kvs_tls *tls;          /* NULL: --insecure (plaintext links) or a one-stage ring */
    struct pending_link pend[MAX_PENDING_LINKS];
    struct kvs_link *in;
    struct kvs_proto_decoder *in_dec;
    int64_t in_last_read;
    struct kvs_link *out;
    struct kvs_proto_decoder *out_dec;
    enum out_state out_state;
    bool out_hello_sent;          /* OUT_HANDSHAKE: HELLO written (over TLS: once the TLS handshake is done) */
    int64_t out_next_dial, out_since, out_last_write;
    int out_attempt;
    bool out_warned;
    int64_t out_unreach_since;    /* first failed dial of the current run of failures, 0 = none */
    char out_dial_err[KVS_PROTO_MAX_ERRMSG]; /* under mu: why the successor cannot be reached, "" when it can */
    bool solo;                    /* the whole model: head and tail at once, no links (a one-stage ring) */
    bool in_bye, out_bye;         /* the neighbour said goodbye (orderly shutdown): its EOF is not a fault */
    int out_refused;              /* consecutive refusals by the successor (backoff, logged as errors) */
    /* links through a relay (docs/RELAY.md §2) */
    bool in_relay;                /* listen_addr is a relay URL: the in link dials out, no listener */
    int64_t in_next_dial;         /* in_relay: next dial of the in link (backoff) */
    int in_attempt;
    bool in_warned;
    char relay_ca[512], relay_pin[65]; /* kvs_stage_params.relay_ca / relay_pin ("" = none) */
    /* the edge tokens of relay URLs, cut out of listen_addr / next_addr so that
     * logs, /health and metrics never show them ("" = none) */
    char in_token[KVS_RELAY_TOKEN_HEX + 1], next_token[KVS_RELAY_TOKEN_HEX + 1];

    /* pending-link refusals: at most REFUSAL_LOG_BURST log lines per REFUSAL_LOG_MS */
    int64_t refusal_log_t0;
    int refusal_log_n;
    uint64_t refusal_log_dropped;

    /* head: ring probes */
    uint32_t probe_no;
    uint32_t probe_min;           /* head: only a probe numbered >= this (sent after the last fault) counts */
    int64_t live_sent;            /* head: last periodic LIVE keepalive (one per keepalive_ms, §3.8.2) */
    int64_t probe_sent, probe_back;
    int64_t progress;             /* head: last TOKEN from the tail (work got round the ring) */
    bool admit_more;              /* head: more queued requests can start: do not wait in poll */
    uint64_t fwd_us;              /* loop thread: time in kvs_model_forward, microseconds */
    bool out_ever_up;             /* the out link was up before (a later HELLO is a re-join) */
    uint64_t out_dropped;         /* frames dropped while the out link was down */

    struct seq *seqs;
    struct hist *hist;            /* head (not solo): [n_seq] */
    /* head: hold and replay (§5.1) */
    int32_t replay_deadline_ms;   /* < 0: no hold */
    int64_t hold_since;           /* the ring broke at this time (kvs_link_now_ms) and is not known whole; 0 none */
    uint32_t hold_probe;          /* probe_no at the latest fault: a later probe back = whole again */
    char hold_why[KVS_PROTO_MAX_ERRMSG + 64];
    /* work buffers, sized at create */
    uint8_t *sbuf;
    size_t sbuf_cap;
    uint8_t *rbuf;
    float *x;      /* [n_batch][n_embd] boundary in */
    float *y;      /* [max(n_batch*n_embd, n_seq*n_vocab)] forward out */
    int32_t *b_tok, *b_seq, *b_pos;
    int8_t *b_logits;
    uint32_t *b_req;

    int wake[2];
    /* shared with other threads, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stopped;
    bool next_changed;            /* kvs_stage_set_next: new_next waits for the loop (apply_next) */
    char new_next[256];
    bool next_key_changed, prev_key_changed; /* kvs_stage_set_neighbours: keys waiting for apply_next */
    uint8_t new_next_key[KVS_KEY_PUB_BYTES], new_prev_key[KVS_KEY_PUB_BYTES];
    struct queued *queue[MAX_QUEUE];
    int n_queue;
    uint32_t cancels[MAX_CANCELS];
    int n_cancels;
    uint32_t next_req;
    struct kvs_stage_metrics met;
    struct kvs_stage_hop hops[KVS_PROTO_MAX_TRAIL]; /* head: the last trail that came back */
    /* why the ring cannot close: the successor refused this stage (or does not
     * fit it), or this stage refused its predecessor; code 0 / "" when none */
    kvs_err out_refusal_code, in_refusal_code;
    char out_refusal[KVS_PROTO_MAX_ERRMSG + 512], in_refusal[KVS_PROTO_MAX_ERRMSG + 512];
    int n_hops;
    double probe_rtt_ms;

    /* a planned leave (§5.2) */
    enum { LEAVE_NONE = 0, LEAVE_WAIT_GO, LEAVE_WAIT_DRAIN, LEAVE_DONE } leave_state; /* this stage leaving */
    int64_t leave_since;
    bool leave_stop;              /* the leave cannot go on: stop as before (goodbye, replay) */
    bool ctl_eof;                 /* control_fd: the supervisor closed it */
    char handover_path[512], takeover_path[512];
    bool in_leaving;              /* the predecessor announced its leave: losing the in link is no fault */
    bool out_leaving;             /* the successor drains to leave: losing the out link is no fault */
    bool out_planned;             /* the out link went down by a planned leave: its return is no re-join */
    int64_t out_quick_until;      /* re-dial every LEAVE_REDIAL_MS until then */
    int32_t n_taken;              /* sequences taken over at create */
    /* head: a drain in progress (0: none) */
    int64_t drain_since;
    uint32_t drain_probe, drain_begin, drain_end;
};

/* --- small helpers ---------------------------------------------------------- */

/* --- the loop, timers, forward and metrics (stage_loop.c) --- */

void kvs_st_met_add(struct kvs_stage *s, uint64_t *field, uint64_t v);
void kvs_st_met_update(struct kvs_stage *s);
uint64_t kvs_st_wall_us(void);
kvs_err kvs_st_forward(struct kvs_stage *s, const struct kvs_batch *b, float *out);

/* --- links: sending, handshakes (HELLO), the pending table, dial, link loss (stage_link.c) --- */

bool kvs_st_send_built(struct kvs_stage *s, struct kvs_frame_header *h);
bool kvs_st_send_simple(struct kvs_stage *s, uint8_t kind, uint8_t flags, uint32_t req, uint32_t pos);
bool kvs_st_send_error(struct kvs_stage *s, uint32_t req, kvs_err code, const char *msg);
void kvs_st_refuse(struct kvs_link *l, kvs_err code, const char *msg);
/* true if a warning about a pending (not yet introduced) link may be logged
 * now; counts the ones that may not (REFUSAL_LOG_BURST per REFUSAL_LOG_MS). */
bool kvs_st_refusal_log_ok(struct kvs_stage *s);
void kvs_st_drop_all(struct kvs_stage *s, kvs_err err, const char *msg);
void kvs_st_in_lost(struct kvs_stage *s, const char *why);
void kvs_st_out_lost(struct kvs_stage *s, const char *why);
void kvs_st_pend_close(struct pending_link *pl);
void kvs_st_accept_new(struct kvs_stage *s);
void kvs_st_pend_read(struct kvs_stage *s, struct pending_link *pl);
void kvs_st_dial_next(struct kvs_stage *s);
/* in_relay: dials the in link out to the relay as the edge's downstream end
 * (backoff like the out link) when there is none; it becomes a pending link. */
void kvs_st_dial_in(struct kvs_stage *s);
/* Checks a link address: "HOST:PORT" (dialable unless `listen`) or a relay
 * URL with its token. KVS_ERR_ARG with the reason in why. */
kvs_err kvs_st_check_addr(const char *addr, bool listen, char *why, size_t cap);
/* A relay URL in addr: moves its ?token=HEX into tok (addr keeps the URL
 * without it). Anything else: nothing changes. */
void kvs_st_cut_token(char *addr, char tok[KVS_RELAY_TOKEN_HEX + 1]);
void kvs_st_out_read(struct kvs_stage *s);
/* Reads what the in link holds (stage_loop.c), dispatching each frame. */
void kvs_st_in_read(struct kvs_stage *s);

/* --- a planned leave (stage_leave.c, PROTOCOL.md §5.2) --- */

/* stop_fd fired: true if the stage began a planned leave (keeps running), false if it must stop. */
bool kvs_st_leave_begin(struct kvs_stage *s);
/* control_fd is readable: reads the supervisor's word ("go", "no") and acts on it. */
void kvs_st_leave_control(struct kvs_stage *s);
/* A LEAVE frame from the predecessor. */
void kvs_st_on_leave(struct kvs_stage *s, const struct kvs_frame *f);
/* Timers of a leave: the wait for "go", the drain; the head's drain deadline. */
void kvs_st_leave_timers(struct kvs_stage *s);
/* The drain is done (LEAVE_DONE): closes the listener and writes every sequence's state to
 * handover_path (a temporary file renamed into place). Returns false on failure (logged). */
bool kvs_st_leave_write(struct kvs_stage *s);
/* kvs_stage_create with takeover_path: says "ready", waits for the file, takes its sequences.
 * On any failure the stage starts empty and its first out link counts as a re-join. */
void kvs_st_takeover(struct kvs_stage *s);
/* Head: probe probe_no came back: ends a drain sent before it. */
void kvs_st_head_drain_back(struct kvs_stage *s, uint32_t probe_no);

/* --- the sequence table and the data path of a window: REQUEST_START, PREFILL, DECODE, END, ERROR (stage_seq.c) --- */

int32_t kvs_st_n_active(const struct kvs_stage *s);
struct seq *kvs_st_seq_find(struct kvs_stage *s, uint32_t req);
int32_t kvs_st_seq_slot(const struct kvs_stage *s, const struct seq *q);
struct seq *kvs_st_seq_alloc(struct kvs_stage *s, uint32_t req);
void kvs_st_seq_free(struct kvs_stage *s, struct seq *q);
/* A non-head stage fails request req (slot q freed when not NULL): logged, and an ERROR for it goes on. */
void kvs_st_fail_req(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg);
void kvs_st_on_request_start(struct kvs_stage *s, const struct kvs_frame *f);
void kvs_st_on_prefill(struct kvs_stage *s, const struct kvs_frame *f);
void kvs_st_decode_rows_done(struct kvs_stage *s, int32_t n, bool sample_here);
int32_t kvs_st_keep_finite_rows(struct kvs_stage *s, int32_t n, bool logits, const char *what);
void kvs_st_on_decode(struct kvs_stage *s, const struct kvs_frame *f);
void kvs_st_on_end(struct kvs_stage *s, const struct kvs_frame *f);
void kvs_st_on_error(struct kvs_stage *s, const struct kvs_frame *f);
/* A LIVE keepalive from the head (PROTOCOL.md §3.8.2): frees every slot whose
 * request is not in it, and forwards it (not on the tail). */
void kvs_st_on_live(struct kvs_stage *s, const struct kvs_frame *f);

/* --- the head: requests, admission, prompt, batched decode, returned tokens (stage_head.c) --- */

void kvs_st_head_end(struct kvs_stage *s, struct seq *q, kvs_err err, uint32_t finish, const char *msg);
void kvs_st_head_abort(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg);
void kvs_st_head_token(struct kvs_stage *s, uint32_t req_id, uint32_t pos, struct kvs_token_msg tm);
void kvs_st_on_token(struct kvs_stage *s, const struct kvs_frame *f);
void kvs_st_free_queued(struct queued *w);
void kvs_st_head_admit(struct kvs_stage *s);
void kvs_st_head_decode(struct kvs_stage *s);
/* Head: the ring broke (a lost link, an ERROR for req 0, a stall): holds every request in flight
 * for a replay, or (no hold: replay_deadline_ms < 0, or the stage is stopping) ends each with
 * err / msg. */
void kvs_st_head_fault(struct kvs_stage *s, kvs_err err, const char *msg);
/* Head: probe probe_no came back round the ring. */
void kvs_st_head_probe_back(struct kvs_stage *s, uint32_t probe_no);
/* Head: requests in flight that are not held. */
int32_t kvs_st_head_n_live(const struct kvs_stage *s);
/* Head: sends the LIVE keepalive (§3.8.2): the ids of the requests in flight
 * (held ones excluded: a replay starts them afresh on every stage). */
void kvs_st_head_send_live(struct kvs_stage *s);
/* Head: a fault: the ring counts as ready again (admission, /health) only
 * once a probe sent after now came back (§3.8), held requests or not. */
void kvs_st_head_unready(struct kvs_stage *s);

/* --- the tail: sampling (stage_tail.c) --- */

void kvs_st_tail_begin(struct kvs_stage *s, struct seq *q, const struct kvs_req_params *rp, uint32_t n,
                       const uint8_t *prompt);
void kvs_st_tail_sample(struct kvs_stage *s, struct seq *q, const float *logits, int32_t pos);

/* --- ring probes and their trails (stage_probe.c) --- */

void kvs_st_send_probe(struct kvs_stage *s, uint32_t probe_no, uint32_t n, uint64_t t_recv);
void kvs_st_on_keepalive(struct kvs_stage *s, const struct kvs_frame *f);
/* Head: is the trail of TRAIL probe f (its header already checked by the
 * decoder) fit for arithmetic (§3.8.1)? Every record: begin < end <= n_block,
 * t_recv <= t_send, both within a day of t_back (the head's wall clock when
 * it came back, us); the first record is the head's window [begin, end) with
 * t_send <= t_back. On false, *bad (if not NULL) is the first failing
 * record's index and *bad_rec (if not NULL) that record. No state. */
bool kvs_st_trail_valid(const struct kvs_frame *f, uint64_t t_back, uint32_t n_block, int32_t begin, int32_t end,
                        uint32_t *bad, struct kvs_trail_rec *bad_rec);
/* Head: per-stage figures of trail f into out[KVS_PROTO_MAX_TRAIL] and the
 * probe's round trip (ms) into *rtt_ms; differences of wire timestamps
 * without signed overflow (any values). Returns the records written. */
int kvs_st_trail_hops(const struct kvs_frame *f, uint64_t t_back, struct kvs_stage_hop *out, double *rtt_ms);

#endif

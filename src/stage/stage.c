/* The stage loop (docs/PROTOCOL.md §3-§5): links, handshake, sequences,
 * batching, head request API, faults. */
#include "stage/stage.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "kernels/pool.h"
#include "link/link.h"
#include "model/model.h"
#include "plan/plan.h"
#include "proto/proto.h"
#include "shard/shard.h"

#define MAX_PENDING_LINKS 4  /* accepted connections waiting for their HELLO */
#define HANDSHAKE_MS 3000    /* a HELLO must arrive within this */
#define PROBE_UNREADY_MS 20  /* head: probe interval until a probe has come round (then keepalive_ms) */
#define PROBE_ACCEPT 1024u   /* head: a returning probe counts if it is one of the last this many */
#define MAX_QUEUE 1024       /* submitted requests waiting */
#define MAX_CANCELS 1024
#define READ_CHUNK 65536
#define REFUSED_BACKOFF_MAX_MS 16000 /* re-dial a refusing successor after 1, 2, 4 .. 16 s */
#define BYE_WRITE_MS 200     /* a goodbye ERROR is best effort: never hold a stopping stage longer */

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
    int32_t begin, end, n_ctx, n_seq, n_batch;
    uint32_t n_embd, n_vocab;
    bool is_head, is_tail;
    int32_t eog[KVS_PROTO_MAX_STOP];
    uint32_t n_eog;

    struct kvs_listener *lst;
    struct pending_link pend[MAX_PENDING_LINKS];
    struct kvs_link *in;
    struct kvs_proto_decoder *in_dec;
    int64_t in_last_read;
    struct kvs_link *out;
    struct kvs_proto_decoder *out_dec;
    enum out_state out_state;
    int64_t out_next_dial, out_since, out_last_write;
    int out_attempt;
    bool out_warned;
    bool solo;                    /* the whole model: head and tail at once, no links (a one-stage ring) */
    bool in_bye, out_bye;         /* the neighbour said goodbye (orderly shutdown): its EOF is not a fault */
    int out_refused;              /* consecutive refusals by the successor (backoff, logged as errors) */

    /* head: ring probes */
    uint32_t probe_no;
    int64_t probe_sent, probe_back;
    int64_t progress;             /* head: last TOKEN from the tail (work got round the ring) */
    bool admit_more;              /* head: more queued requests can start: do not wait in poll */
    uint64_t fwd_us;              /* loop thread: time in kvs_model_forward, microseconds */
    bool out_ever_up;             /* the out link was up before (a later HELLO is a re-join) */
    uint64_t out_dropped;         /* frames dropped while the out link was down */

    struct seq *seqs;
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
};

/* --- small helpers ---------------------------------------------------------- */

struct kvs_stage_params kvs_stage_default_params(void)
{
    return (struct kvs_stage_params){ .block_begin = 0, .block_end = -1, .n_threads = 2, .n_seq = 4,
                                      .n_batch = 512, .timeout_ms = 4000, .keepalive_ms = 1000,
                                      .stop_fd = -1 };
}

static void wake(struct kvs_stage *s)
{
    char c = 1;
    ssize_t r = write(s->wake[1], &c, 1);
    (void)r; /* a full pipe already wakes the loop */
}

static void met_add(struct kvs_stage *s, uint64_t *field, uint64_t v)
{
    pthread_mutex_lock(&s->mu);
    *field += v;
    pthread_mutex_unlock(&s->mu);
}

static int32_t n_active(const struct kvs_stage *s)
{
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_seq; i++) n += s->seqs[i].used;
    return n;
}

static void met_update(struct kvs_stage *s)
{
    pthread_mutex_lock(&s->mu);
    s->met.n_active = n_active(s);
    s->met.n_queued = s->n_queue;
    s->met.in_up = s->in != NULL;
    s->met.out_up = s->out_state == OUT_UP;
    int64_t now = kvs_link_now_ms();
    s->met.ring_ready = s->solo ||
                        (s->met.in_up && s->met.out_up &&
                        (!s->is_head || (s->probe_back && (now - s->probe_back < s->p.timeout_ms ||
                                                           now - s->progress < s->p.timeout_ms))));
    pthread_mutex_unlock(&s->mu);
    pthread_cond_broadcast(&s->cv);
}

static struct seq *seq_find(struct kvs_stage *s, uint32_t req)
{
    for (int32_t i = 0; i < s->n_seq; i++)
        if (s->seqs[i].used && s->seqs[i].req == req) return &s->seqs[i];
    return NULL;
}

static int32_t seq_slot(const struct kvs_stage *s, const struct seq *q)
{
    return (int32_t)(q - s->seqs);
}

static struct seq *seq_alloc(struct kvs_stage *s, uint32_t req)
{
    for (int32_t i = 0; i < s->n_seq; i++)
        if (!s->seqs[i].used) {
            struct seq *q = &s->seqs[i];
            memset(q, 0, sizeof *q);
            q->used = true;
            q->req = req;
            kvs_model_seq_clear(s->m, i);
            return q;
        }
    return NULL;
}

static void seq_free(struct kvs_stage *s, struct seq *q)
{
    kvs_sampler_free(q->smp);
    kvs_model_seq_clear(s->m, seq_slot(s, q));
    memset(q, 0, sizeof *q);
}

/* Head: deliver the final event of a request and free its slot. */
static void head_end(struct kvs_stage *s, struct seq *q, kvs_err err, uint32_t finish, const char *msg)
{
    struct kvs_stage_event ev = { .kind = err ? KVS_STAGE_EVENT_ERROR : KVS_STAGE_EVENT_DONE, .req = q->req,
                                  .finish = finish, .n_generated = q->n_reported, .err = err,
                                  .message = msg ? msg : "" };
    kvs_stage_event_fn cb = q->cb;
    void *user = q->user;
    met_add(s, err ? &s->met.requests_failed : &s->met.requests_done, 1);
    seq_free(s, q);
    if (cb) cb(user, &ev);
}

/* --- sending ---------------------------------------------------------------- */

static void out_lost(struct kvs_stage *s, const char *why);

/* Sends header h with payload already at sbuf + 24. Returns false if the out
 * link is down or failed (the frame is dropped). */
static bool send_built(struct kvs_stage *s, struct kvs_frame_header *h)
{
    if (s->solo) return false; /* a one-stage ring has no links */
    if (s->out_state != OUT_UP) {
        if (h->kind != KVS_FRAME_KEEPALIVE) s->out_dropped++;
        return false;
    }
    kvs_proto_put_header(s->sbuf, h);
    size_t n = KVS_PROTO_HEADER_BYTES + h->payload_len;
    kvs_err e = kvs_link_write(s->out, s->sbuf, n, s->p.timeout_ms);
    if (e) {
        char why[128];
        snprintf(why, sizeof why, "writing %s: %s", kvs_frame_kind_name(h->kind), kvs_strerror(e));
        out_lost(s, why);
        return false;
    }
    s->out_last_write = kvs_link_now_ms();
    met_add(s, &s->met.bytes_out, n);
    return true;
}

static bool send_simple(struct kvs_stage *s, uint8_t kind, uint8_t flags, uint32_t req, uint32_t pos)
{
    struct kvs_frame_header h = { .kind = kind, .flags = flags, .req = req, .pos = pos };
    return send_built(s, &h);
}

/* Head: request req fails with e (its final event, if its slot q is still
 * held) and a CANCEL goes round so that every stage frees its slot. */
static void head_abort(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg)
{
    if (q) head_end(s, q, e, 0, msg);
    send_simple(s, KVS_FRAME_CANCEL, 0, req, 0);
}

static bool send_error(struct kvs_stage *s, uint32_t req, kvs_err code, const char *msg)
{
    size_t n = kvs_proto_put_error(s->sbuf + KVS_PROTO_HEADER_BYTES, (uint32_t)code, msg);
    struct kvs_frame_header h = { .kind = KVS_FRAME_ERROR, .req = req, .payload_len = (uint32_t)n };
    return send_built(s, &h);
}

/* Writes one ERROR directly on a link being refused (best effort). */
static void refuse(struct kvs_link *l, kvs_err code, const char *msg)
{
    uint8_t buf[KVS_PROTO_HEADER_BYTES + 4 + KVS_PROTO_MAX_ERRMSG];
    size_t n = kvs_proto_put_error(buf + KVS_PROTO_HEADER_BYTES, (uint32_t)code, msg);
    struct kvs_frame_header h = { .kind = KVS_FRAME_ERROR, .payload_len = (uint32_t)n };
    kvs_proto_put_header(buf, &h);
    (void)kvs_link_write(l, buf, KVS_PROTO_HEADER_BYTES + n, 500);
}

static void make_hello(const struct kvs_stage *s, struct kvs_hello *m, uint32_t role)
{
    memcpy(m->fingerprint, s->fp, 32);
    m->n_block = s->hp.n_block;
    m->block_begin = (uint32_t)s->begin;
    m->block_end = (uint32_t)s->end;
    m->n_embd = s->n_embd;
    m->role = role;
    m->n_ctx = (uint32_t)s->n_ctx;
    m->n_seq = (uint32_t)s->n_seq;
}

static void write_hello(const struct kvs_stage *s, uint8_t *buf, uint32_t role)
{
    struct kvs_hello m;
    make_hello(s, &m, role);
    struct kvs_frame_header h = { .kind = KVS_FRAME_HELLO, .payload_len = KVS_PROTO_HELLO_BYTES };
    kvs_proto_put_header(buf, &h);
    kvs_proto_put_hello(buf + KVS_PROTO_HEADER_BYTES, &m);
}

/* PROTOCOL.md §4: is `o` (the far end, acting as `role`) a valid neighbour?
 * On a mismatch, `local` gets the reason as this stage reads it ("it" = the
 * far end) and `remote` the same reason as the far end reads it ("it" = this
 * stage), for the ERROR sent back to it. */
static kvs_err check_hello(const struct kvs_stage *s, const struct kvs_hello *o, uint32_t role, char *local,
                           size_t lcap, char *remote, size_t rcap)
{
    if (o->role != role) {
        snprintf(local, lcap, "it sent HELLO role %u, expected %u", o->role, role);
        snprintf(remote, rcap, "it expected HELLO role %u, this stage sent %u", role, o->role);
        return KVS_ERR_FORMAT;
    }
    if (memcmp(o->fingerprint, s->fp, 32)) {
        char hx[65];
        kvs_gguf_fingerprint_hex(o->fingerprint, hx);
        snprintf(local, lcap, "it serves model %.16s..., this stage serves %.16s...", hx, s->fp_hex);
        snprintf(remote, rcap, "it serves model %.16s..., this stage serves %.16s...", s->fp_hex, hx);
        return KVS_ERR_MISMATCH;
    }
    if (o->n_block != s->hp.n_block || o->n_embd != s->n_embd) {
        snprintf(local, lcap, "it has n_block %u n_embd %u, this stage %u %u", o->n_block, o->n_embd,
                 s->hp.n_block, s->n_embd);
        snprintf(remote, rcap, "it has n_block %u n_embd %u, this stage %u %u", s->hp.n_block, s->n_embd,
                 o->n_block, o->n_embd);
        return KVS_ERR_MISMATCH;
    }
    if (o->n_ctx != (uint32_t)s->n_ctx) {
        snprintf(local, lcap, "it has n_ctx %u, this stage %d (all stages need the same --ctx)", o->n_ctx,
                 (int)s->n_ctx);
        snprintf(remote, rcap, "it has n_ctx %d, this stage %u (all stages need the same --ctx)", (int)s->n_ctx,
                 o->n_ctx);
        return KVS_ERR_MISMATCH;
    }
    /* pred = the stage before; succ = the stage after */
    uint32_t pb, pe, sb, se;
    if (role == KVS_HELLO_ROLE_PRED) {
        pb = o->block_begin, pe = o->block_end, sb = (uint32_t)s->begin, se = (uint32_t)s->end;
    } else {
        pb = (uint32_t)s->begin, pe = (uint32_t)s->end, sb = o->block_begin, se = o->block_end;
    }
    bool ok = pb < pe && sb < se && (pe == sb || (pe == s->hp.n_block && sb == 0));
    if (!ok) {
        /* the predecessor's window must end where the successor's begins */
        if (role == KVS_HELLO_ROLE_PRED) { /* this stage is the successor */
            snprintf(local, lcap, "its window [%u,%u) does not end where this stage's [%u,%u) begins", pb, pe, sb,
                     se);
            snprintf(remote, rcap, "its window [%u,%u) does not begin where this stage's [%u,%u) ends", sb, se, pb,
                     pe);
        } else {
            snprintf(local, lcap, "its window [%u,%u) does not begin where this stage's [%u,%u) ends", sb, se, pb,
                     pe);
            snprintf(remote, rcap, "its window [%u,%u) does not end where this stage's [%u,%u) begins", pb, pe, sb,
                     se);
        }
        return KVS_ERR_MISMATCH;
    }
    return KVS_OK;
}

/* --- link loss ---------------------------------------------------------------- */

/* Every sequence is dead once a link on the data path broke. */
static void drop_all(struct kvs_stage *s, kvs_err err, const char *msg)
{
    for (int32_t i = 0; i < s->n_seq; i++) {
        if (!s->seqs[i].used) continue;
        if (s->is_head) head_end(s, &s->seqs[i], err, 0, msg);
        else seq_free(s, &s->seqs[i]);
    }
}

static void in_lost(struct kvs_stage *s, const char *why)
{
    char msg[300];
    snprintf(msg, sizeof msg, "stage [%d,%d) lost its predecessor %s: %s%s", (int)s->begin, (int)s->end,
             s->in ? s->in->peer : "?", why, s->in_bye ? " (it shut down)" : "");
    if (s->in_bye) KVS_LOGI("%s", msg); /* orderly: it said goodbye */
    else KVS_LOGW("%s", msg);
    s->in_bye = false;
    kvs_link_close(s->in);
    s->in = NULL;
    kvs_proto_decoder_reset(s->in_dec);
    met_add(s, &s->met.links_lost, 1);
    drop_all(s, KVS_ERR_PEER, msg);
    if (!s->is_head) send_error(s, 0, KVS_ERR_PEER, msg);
    met_update(s);
}

static void out_lost(struct kvs_stage *s, const char *why)
{
    char msg[KVS_PROTO_MAX_ERRMSG + 1024];
    snprintf(msg, sizeof msg, "stage [%d,%d) lost its successor %s: %s%s", (int)s->begin, (int)s->end,
             s->next_addr, why, s->out_bye ? " (it shut down)" : "");
    if (s->out_state == OUT_UP && !s->out_bye) KVS_LOGW("%s", msg);
    else if (s->out_state == OUT_UP) KVS_LOGI("%s", msg); /* orderly: it said goodbye */
    else KVS_LOGD("%s", msg);
    s->out_bye = false;
    bool was_up = s->out_state == OUT_UP;
    kvs_link_close(s->out);
    s->out = NULL;
    s->out_state = OUT_DOWN;
    kvs_proto_decoder_reset(s->out_dec);
    s->out_next_dial = kvs_link_now_ms() + kvs_link_backoff_ms(s->out_attempt++);
    if (was_up) {
        met_add(s, &s->met.links_lost, 1);
        drop_all(s, KVS_ERR_PEER, msg);
    }
    met_update(s);
}

/* --- forward ------------------------------------------------------------------ */

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Wall clock (trail timestamps, §3.8.1), microseconds since the epoch. */
static uint64_t wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static kvs_err forward(struct kvs_stage *s, const struct kvs_batch *b, float *out)
{
    if (s->p.step_delay_ms > 0) poll(NULL, 0, s->p.step_delay_ms);
    uint64_t t0 = mono_us();
    kvs_err e = kvs_model_forward(s->m, b, out);
    uint64_t dt = mono_us() - t0;
    s->fwd_us += dt;
    pthread_mutex_lock(&s->mu);
    s->met.forward_calls++;
    s->met.forward_ms += (double)dt / 1000.0;
    pthread_mutex_unlock(&s->mu);
    return e;
}

/* Tail: sample from logits for request q whose token will sit at pos; send TOKEN. */
static void head_token(struct kvs_stage *s, uint32_t req_id, uint32_t pos, struct kvs_token_msg tm);

static void tail_sample(struct kvs_stage *s, struct seq *q, const float *logits, int32_t pos)
{
    int32_t id = kvs_sampler_sample(q->smp, logits);
    uint32_t finish = KVS_FINISH_NONE;
    bool is_stop = false;
    for (uint32_t i = 0; i < q->n_stop; i++) is_stop |= q->stop[i] == id;
    q->generated++;
    if (is_stop && !q->ignore_eos) {
        finish = KVS_FINISH_STOP;
    } else {
        kvs_sampler_accept(q->smp, id);
        if (q->generated >= q->max_tokens || pos >= s->n_ctx) finish = KVS_FINISH_LENGTH;
    }
    if (!s->solo) met_add(s, &s->met.tokens_generated, 1); /* solo: counted once, by head_token */
    struct kvs_token_msg tm = { .token = id, .finish = finish };
    if (s->solo) { /* a one-stage ring: the head is this stage */
        if (finish) q->finished = true;
        head_token(s, q->req, (uint32_t)pos, tm);
        return;
    }
    kvs_proto_put_token(s->sbuf + KVS_PROTO_HEADER_BYTES, &tm);
    struct kvs_frame_header h = { .kind = KVS_FRAME_TOKEN, .flags = finish ? KVS_FRAME_FLAG_FINISHED : 0,
                                  .req = q->req, .pos = (uint32_t)pos, .n_tokens = 1,
                                  .payload_len = KVS_PROTO_TOKEN_BYTES };
    if (finish) q->finished = true;
    send_built(s, &h);
}

/* Fails request q on a non-head stage: free the slot, tell the head. */
static void stage_fail_req(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg)
{
    KVS_LOGW("request %u failed on stage [%d,%d): %s", req, (int)s->begin, (int)s->end, msg);
    if (q) seq_free(s, q);
    send_error(s, req, e, msg);
}

/* --- frame handlers ------------------------------------------------------------ */

static void on_request_start(struct kvs_stage *s, const struct kvs_frame *f)
{
    uint32_t req = f->h.req;
    struct kvs_req_params rp;
    const uint8_t *prompt;
    kvs_proto_get_req(f, &rp, &prompt);
    if (seq_find(s, req)) {
        stage_fail_req(s, NULL, req, KVS_ERR_FORMAT, "duplicate request id");
        return;
    }
    char msg[160];
    if (f->h.n_tokens >= (uint32_t)s->n_ctx) {
        snprintf(msg, sizeof msg, "prompt of %u tokens does not fit n_ctx %d", f->h.n_tokens, (int)s->n_ctx);
        stage_fail_req(s, NULL, req, KVS_ERR_RANGE, msg);
        return;
    }
    struct seq *q = seq_alloc(s, req);
    if (!q) {
        snprintf(msg, sizeof msg, "no free sequence slot on stage [%d,%d) (%d slots)", (int)s->begin,
                 (int)s->end, (int)s->n_seq);
        stage_fail_req(s, NULL, req, KVS_ERR_FULL, msg);
        return;
    }
    if (s->is_tail) {
        struct kvs_sampler_params sp = { .temp = rp.temp, .top_k = rp.top_k, .top_p = rp.top_p, .min_p = rp.min_p,
                                         .repeat_penalty = rp.repeat_penalty, .repeat_last_n = rp.repeat_last_n,
                                         .seed = rp.seed };
        kvs_err se = kvs_sampler_create(&sp, (int32_t)s->n_vocab, &q->smp);
        if (se) {
            char smsg[256];
            snprintf(smsg, sizeof smsg,
                     "sampling parameters refused (temp %g, top_p %g, min_p %g, repeat_penalty %g, "
                     "repeat_last_n %d): %s",
                     (double)sp.temp, (double)sp.top_p, (double)sp.min_p, (double)sp.repeat_penalty,
                     (int)sp.repeat_last_n, kvs_strerror(se));
            stage_fail_req(s, q, req, se, smsg);
            return;
        }
        for (uint32_t i = 0; i < f->h.n_tokens; i++) kvs_sampler_accept(q->smp, kvs_proto_get_i32(prompt + 4 * i));
        q->max_tokens = rp.max_tokens ? rp.max_tokens : 1;
        q->ignore_eos = rp.ignore_eos;
        q->n_stop = rp.n_stop;
        memcpy(q->stop, rp.stop, sizeof q->stop);
        return; /* the tail's successor is the head: nothing to forward */
    }
    /* forward unchanged */
    memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    struct kvs_frame_header h = f->h;
    send_built(s, &h);
}

static void on_prefill(struct kvs_stage *s, const struct kvs_frame *f)
{
    uint32_t req = f->h.req, n = f->h.n_tokens;
    struct seq *q = seq_find(s, req);
    if (!q || q->finished) return; /* ended or failed here: drop */
    char msg[160];
    if (n > (uint32_t)s->n_batch) {
        snprintf(msg, sizeof msg, "PREFILL of %u rows exceeds n_batch %d", n, (int)s->n_batch);
        stage_fail_req(s, q, req, KVS_ERR_RANGE, msg);
        return;
    }
    int32_t slot = seq_slot(s, q);
    if ((int32_t)f->h.pos != kvs_model_seq_len(s->m, slot) || f->h.pos + n > (uint32_t)s->n_ctx) {
        snprintf(msg, sizeof msg, "PREFILL at position %u does not continue the sequence (%d cached)", f->h.pos,
                 (int)kvs_model_seq_len(s->m, slot));
        stage_fail_req(s, q, req, KVS_ERR_RANGE, msg);
        return;
    }
    bool f32 = f->h.flags & KVS_FRAME_FLAG_F32, last = f->h.flags & KVS_FRAME_FLAG_LAST;
    kvs_proto_get_boundary(s->x, kvs_proto_boundary(f), (size_t)n * s->n_embd, f32);
    for (uint32_t i = 0; i < n; i++) {
        s->b_seq[i] = slot;
        s->b_pos[i] = (int32_t)(f->h.pos + i);
        s->b_logits[i] = (int8_t)(last && i + 1 == n);
    }
    struct kvs_batch b = { .n_tokens = (int32_t)n, .embd = s->x, .seq = s->b_seq, .pos = s->b_pos,
                           .logits = s->b_logits };
    kvs_err e = forward(s, &b, s->y);
    if (e) {
        snprintf(msg, sizeof msg, "forward on PREFILL failed: %s", kvs_strerror(e));
        stage_fail_req(s, q, req, e, msg);
        return;
    }
    met_add(s, &s->met.prefill_tokens, n);
    if (s->is_tail) {
        if (last) tail_sample(s, q, s->y, (int32_t)(f->h.pos + n));
        return;
    }
    size_t bytes = kvs_proto_put_boundary(s->sbuf + KVS_PROTO_HEADER_BYTES, s->y, (size_t)n * s->n_embd,
                                          s->p.boundary_f32);
    struct kvs_frame_header h = { .kind = KVS_FRAME_PREFILL,
                                  .flags = (uint8_t)((last ? KVS_FRAME_FLAG_LAST : 0) |
                                                     (s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0)),
                                  .req = req, .pos = f->h.pos, .n_tokens = n, .payload_len = (uint32_t)bytes };
    send_built(s, &h);
}

/* The n decode rows in s->b_req / s->b_pos went through this stage's window
 * and their outputs lie in s->y: sample them here (the tail, or a one-stage
 * ring: s->y holds n rows of logits) or send them onward as one DECODE frame
 * (docs/PROTOCOL.md §3.4: per row req u32, pos u32, then the boundary rows). */
static void decode_rows_done(struct kvs_stage *s, int32_t n, bool sample_here)
{
    met_add(s, &s->met.decode_rows, (uint64_t)n);
    if (sample_here) {
        for (int32_t k = 0; k < n; k++) {
            struct seq *q = seq_find(s, s->b_req[k]);
            if (q) tail_sample(s, q, s->y + (size_t)k * s->n_vocab, s->b_pos[k] + 1);
        }
        return;
    }
    uint8_t *p = s->sbuf + KVS_PROTO_HEADER_BYTES;
    for (int32_t k = 0; k < n; k++) {
        kvs_proto_put_u32(p + 8 * k, s->b_req[k]);
        kvs_proto_put_u32(p + 8 * k + 4, (uint32_t)s->b_pos[k]);
    }
    size_t bytes = 8 * (size_t)n + kvs_proto_put_boundary(p + 8 * (size_t)n, s->y, (size_t)n * s->n_embd,
                                                          s->p.boundary_f32);
    struct kvs_frame_header h = { .kind = KVS_FRAME_DECODE, .flags = s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0,
                                  .n_tokens = (uint32_t)n, .payload_len = (uint32_t)bytes };
    send_built(s, &h);
}

/* After a batched forward that reported KVS_ERR_NUMERIC: fails only the rows
 * whose output (n_vocab logits when `logits`, else n_embd boundary values)
 * has a NaN or infinity, and packs the other rows (b_req, b_pos, b_seq and
 * their rows of y) to the front. One sequence pushed out of range must not
 * fail the requests batched with it. Returns the rows left. */
static int32_t keep_finite_rows(struct kvs_stage *s, int32_t n, bool logits, const char *what)
{
    const size_t w = logits ? (size_t)s->n_vocab : (size_t)s->n_embd;
    int32_t kept = 0;
    for (int32_t k = 0; k < n; k++) {
        const float *row = s->y + (size_t)k * w;
        if (!kvs_vec_all_finite(row, w)) {
            char msg[160];
            snprintf(msg, sizeof msg, "%s: %s", what, kvs_strerror(KVS_ERR_NUMERIC));
            struct seq *q = seq_find(s, s->b_req[k]);
            if (s->is_head) {
                head_abort(s, q, s->b_req[k], KVS_ERR_NUMERIC, msg);
            } else {
                stage_fail_req(s, q, s->b_req[k], KVS_ERR_NUMERIC, msg);
            }
            continue;
        }
        if (kept != k) {
            s->b_req[kept] = s->b_req[k];
            s->b_pos[kept] = s->b_pos[k];
            s->b_seq[kept] = s->b_seq[k];
            memmove(s->y + (size_t)kept * w, row, w * sizeof *row);
        }
        kept++;
    }
    return kept;
}

static void on_decode(struct kvs_stage *s, const struct kvs_frame *f)
{
    bool f32 = f->h.flags & KVS_FRAME_FLAG_F32;
    const uint8_t *bnd = kvs_proto_boundary(f);
    size_t row_bytes = (size_t)s->n_embd * (f32 ? 4 : 2);
    int32_t n = 0;
    for (uint32_t i = 0; i < f->h.n_tokens; i++) {
        uint32_t req, pos;
        kvs_proto_get_decode_row(f, i, &req, &pos);
        struct seq *q = seq_find(s, req);
        if (!q || q->finished) continue;
        int32_t slot = seq_slot(s, q);
        bool dup = false;
        for (int32_t k = 0; k < n; k++) dup |= s->b_seq[k] == slot;
        if (dup || n >= s->n_seq || (int32_t)pos != kvs_model_seq_len(s->m, slot) || pos >= (uint32_t)s->n_ctx) {
            char msg[160];
            snprintf(msg, sizeof msg, "DECODE row at position %u does not continue the sequence (%d cached)", pos,
                     (int)kvs_model_seq_len(s->m, slot));
            stage_fail_req(s, q, req, KVS_ERR_RANGE, msg);
            continue;
        }
        kvs_proto_get_boundary(s->x + (size_t)n * s->n_embd, bnd + i * row_bytes, s->n_embd, f32);
        s->b_req[n] = req;
        s->b_seq[n] = slot;
        s->b_pos[n] = (int32_t)pos;
        s->b_logits[n] = 1;
        n++;
    }
    if (n == 0) return;
    struct kvs_batch b = { .n_tokens = n, .embd = s->x, .seq = s->b_seq, .pos = s->b_pos, .logits = s->b_logits };
    kvs_err e = forward(s, &b, s->y);
    if (e == KVS_ERR_NUMERIC) {
        if ((n = keep_finite_rows(s, n, s->is_tail, "forward on DECODE")) == 0) return;
    } else if (e) {
        char msg[160];
        snprintf(msg, sizeof msg, "forward on DECODE failed: %s", kvs_strerror(e));
        for (int32_t k = 0; k < n; k++) stage_fail_req(s, seq_find(s, s->b_req[k]), s->b_req[k], e, msg);
        return;
    }
    decode_rows_done(s, n, s->is_tail);
}

/* Head: token tm of request req, to sit at pos, came back from the tail (or
 * was sampled here on a one-stage ring). */
static void head_token(struct kvs_stage *s, uint32_t req_id, uint32_t pos, struct kvs_token_msg tm)
{
    s->progress = kvs_link_now_ms();
    struct seq *q = seq_find(s, req_id);
    if (!q) return; /* cancelled or failed meanwhile */
    if (tm.token < 0 || (uint32_t)tm.token >= s->n_vocab) {
        head_abort(s, q, q->req, KVS_ERR_FORMAT, "the tail sent a token id outside the vocabulary");
        return;
    }
    /* One token per forward, at the position after the head's KV cache: a
     * duplicate, a stray or a token while one is still waiting to be fed is
     * a broken (or hostile) tail, not output. */
    const int32_t want_pos = kvs_model_seq_len(s->m, seq_slot(s, q));
    if (!tm.finish && pos >= (uint32_t)s->n_ctx) {
        head_abort(s, q, q->req, KVS_ERR_RANGE, "the tail sent a token at an unexpected position");
        return;
    }
    if (q->has_next || (int64_t)pos != (int64_t)want_pos) {
        char msg[160];
        if (q->has_next)
            snprintf(msg, sizeof msg, "the tail sent another token (position %u) before the last one was fed", pos);
        else
            snprintf(msg, sizeof msg, "the tail sent a token for position %u, expected %d", pos, (int)want_pos);
        KVS_LOGW("request %u: %s", q->req, msg);
        head_abort(s, q, q->req, KVS_ERR_PEER, msg);
        return;
    }
    met_add(s, &s->met.tokens_generated, 1);
    /* The tail ends a request at max_tokens; the head holds it to that too. */
    if (!tm.finish && q->max_tokens && (uint32_t)q->n_reported + 1 >= q->max_tokens) tm.finish = KVS_FINISH_LENGTH;
    if (tm.finish != KVS_FINISH_STOP) { /* a stop id is not part of the output */
        q->n_reported++;
        struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_TOKEN, .req = q->req, .token = tm.token,
                                      .pos = (int32_t)pos, .n_generated = q->n_reported };
        q->cb(q->user, &ev);
        q = seq_find(s, req_id); /* the callback may not free it, but be safe */
        if (!q) return;
    }
    if (tm.finish) {
        uint32_t req = q->req;
        head_end(s, q, KVS_OK, tm.finish, NULL);
        send_simple(s, KVS_FRAME_END, 0, req, 0);
        return;
    }
    q->has_next = true;
    q->decoding = true;
    q->next_tok = tm.token;
    q->next_pos = (int32_t)pos;
}

/* Head: a TOKEN came back from the tail. */
static void on_token(struct kvs_stage *s, const struct kvs_frame *f)
{
    struct kvs_token_msg tm;
    kvs_proto_get_token(f, &tm);
    head_token(s, f->h.req, f->h.pos, tm);
}

static void on_end(struct kvs_stage *s, const struct kvs_frame *f)
{
    struct seq *q = seq_find(s, f->h.req);
    if (s->is_head) { /* came back round: every stage has freed it */
        if (q) head_end(s, q, KVS_ERR_CANCELLED, 0, "request ended by the ring");
        return;
    }
    if (q) seq_free(s, q);
    struct kvs_frame_header h = f->h;
    send_built(s, &h);
}

static void on_error(struct kvs_stage *s, const struct kvs_frame *f)
{
    uint32_t code;
    char msg[KVS_PROTO_MAX_ERRMSG + 1];
    kvs_proto_get_error(f, &code, msg, sizeof msg);
    kvs_err e = code > 0 && code < KVS_ERR_COUNT_ ? (kvs_err)code : KVS_ERR_PEER;
    if (f->h.req == 0 && e == KVS_ERR_CANCELLED) {
        /* goodbye (§5): the predecessor is shutting down; its EOF follows
         * and in_lost tells the stages downstream, as for any lost link */
        KVS_LOGI("predecessor %s says goodbye: %s", s->in ? s->in->peer : "?", msg);
        s->in_bye = true;
        return;
    }
    if (s->is_head) {
        if (f->h.req == 0) {
            /* a fault somewhere in the ring: a warning if it failed requests */
            if (n_active(s) > 0) KVS_LOGW("ring error: %s", msg);
            else KVS_LOGI("ring error (no request in flight): %s", msg);
            drop_all(s, e, msg);
        } else {
            struct seq *q = seq_find(s, f->h.req);
            if (q) head_abort(s, q, f->h.req, e, msg);
        }
        return;
    }
    if (f->h.req == 0) drop_all(s, e, msg);
    else if (seq_find(s, f->h.req)) seq_free(s, seq_find(s, f->h.req));
    memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    struct kvs_frame_header h = f->h;
    send_built(s, &h);
}

/* This stage's trail record (§3.8.1), t_send_us left 0. */
static void trail_rec(struct kvs_stage *s, struct kvs_trail_rec *r, uint64_t t_recv)
{
    pthread_mutex_lock(&s->mu);
    *r = (struct kvs_trail_rec){ .block_begin = (uint32_t)s->begin, .block_end = (uint32_t)s->end,
                                 .forward_calls = s->met.forward_calls, .forward_us = s->fwd_us,
                                 .rows = s->met.prefill_tokens + s->met.decode_rows,
                                 .bytes_out = s->met.bytes_out, .t_recv_us = t_recv };
    pthread_mutex_unlock(&s->mu);
}

/* Sends a ring probe whose trail is the n records already at sbuf + 24 plus
 * this stage's own (appended unless the trail is full). */
static void send_probe(struct kvs_stage *s, uint32_t probe_no, uint32_t n, uint64_t t_recv)
{
    uint8_t *p = s->sbuf + KVS_PROTO_HEADER_BYTES;
    if (n < KVS_PROTO_MAX_TRAIL) {
        struct kvs_trail_rec r;
        trail_rec(s, &r, t_recv);
        /* the record counts the probe itself in bytes_out: every stage alike */
        r.bytes_out += KVS_PROTO_HEADER_BYTES + (uint64_t)(n + 1) * KVS_PROTO_TRAIL_REC_BYTES;
        r.t_send_us = wall_us();
        if (!t_recv) r.t_recv_us = r.t_send_us;
        kvs_proto_put_trail_rec(p + (size_t)n * KVS_PROTO_TRAIL_REC_BYTES, &r);
        n++;
    }
    struct kvs_frame_header h = { .kind = KVS_FRAME_KEEPALIVE, .flags = KVS_FRAME_FLAG_PROBE | KVS_FRAME_FLAG_TRAIL,
                                  .pos = probe_no, .n_tokens = n,
                                  .payload_len = n * KVS_PROTO_TRAIL_REC_BYTES };
    send_built(s, &h);
}

/* Head: a TRAIL probe came back: keep its per-stage figures. */
static void head_take_trail(struct kvs_stage *s, const struct kvs_frame *f, uint64_t t_back)
{
    uint32_t n = f->h.n_tokens;
    struct kvs_trail_rec r, nx;
    pthread_mutex_lock(&s->mu);
    s->n_hops = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvs_proto_get_trail_rec(f, i, &r);
        struct kvs_stage_hop *o = &s->hops[s->n_hops++];
        uint64_t next_recv = t_back;
        if (i + 1 < n) {
            kvs_proto_get_trail_rec(f, i + 1, &nx);
            next_recv = nx.t_recv_us;
        }
        *o = (struct kvs_stage_hop){ .block_begin = (int32_t)r.block_begin, .block_end = (int32_t)r.block_end,
                                     .forward_calls = r.forward_calls, .forward_ms = (double)r.forward_us / 1000.0,
                                     .rows = r.rows, .bytes_out = r.bytes_out,
                                     .residence_ms = r.t_send_us >= r.t_recv_us
                                                         ? (double)(r.t_send_us - r.t_recv_us) / 1000.0 : 0.0,
                                     .hop_ms = (double)((int64_t)next_recv - (int64_t)r.t_send_us) / 1000.0 };
        if (i == 0) s->probe_rtt_ms = (double)((int64_t)t_back - (int64_t)r.t_send_us) / 1000.0;
    }
    pthread_mutex_unlock(&s->mu);
}

static void on_keepalive(struct kvs_stage *s, const struct kvs_frame *f)
{
    if (!(f->h.flags & KVS_FRAME_FLAG_PROBE)) return;
    uint64_t now = wall_us();
    if (s->is_head) {
        /* Any of the last PROBE_ACCEPT probes counts: while the ring is not
         * known closed they go out every PROBE_UNREADY_MS, faster than a ring
         * with a longer round trip (a relay, a busy stage) brings one back. */
        if ((uint32_t)(s->probe_no - f->h.pos) < PROBE_ACCEPT) {
            s->probe_back = kvs_link_now_ms();
            if (f->h.flags & KVS_FRAME_FLAG_TRAIL) head_take_trail(s, f, now);
        }
        met_update(s);
        return;
    }
    if (!(f->h.flags & KVS_FRAME_FLAG_TRAIL)) {
        send_simple(s, KVS_FRAME_KEEPALIVE, KVS_FRAME_FLAG_PROBE, 0, f->h.pos);
        return;
    }
    memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    send_probe(s, f->h.pos, f->h.n_tokens, now);
}

/* A frame from the predecessor. Returns false if the link must close. */
static bool dispatch(struct kvs_stage *s, const struct kvs_frame *f, char *why, size_t cap)
{
    switch ((enum kvs_frame_kind)f->h.kind) {
    case KVS_FRAME_REQUEST_START:
        if (s->is_head) break;
        on_request_start(s, f);
        return true;
    case KVS_FRAME_PREFILL:
        if (s->is_head) break;
        on_prefill(s, f);
        return true;
    case KVS_FRAME_DECODE:
        if (s->is_head) break;
        on_decode(s, f);
        return true;
    case KVS_FRAME_TOKEN:
        if (!s->is_head) break;
        on_token(s, f);
        return true;
    case KVS_FRAME_END:
    case KVS_FRAME_CANCEL:
        on_end(s, f);
        return true;
    case KVS_FRAME_ERROR:
        on_error(s, f);
        return true;
    case KVS_FRAME_KEEPALIVE:
        on_keepalive(s, f);
        return true;
    case KVS_FRAME_HELLO:
    case KVS_FRAME_KIND_COUNT_:
        break;
    }
    snprintf(why, cap, "unexpected %s frame on the %s", kvs_frame_kind_name(f->h.kind),
             s->is_head ? "head" : "stage");
    return false;
}

/* --- links: accept, handshake, dial, read --------------------------------------- */

static void pend_close(struct pending_link *pl)
{
    kvs_link_close(pl->l);
    kvs_proto_decoder_free(pl->dec);
    memset(pl, 0, sizeof *pl);
}

static void accept_new(struct kvs_stage *s)
{
    for (;;) {
        struct kvs_link *l;
        kvs_err e = kvs_tcp_accept(s->lst, &l);
        if (e) return;
        int slot = -1;
        for (int i = 0; i < MAX_PENDING_LINKS; i++)
            if (!s->pend[i].l) slot = i;
        if (slot < 0) { /* evict the oldest */
            slot = 0;
            for (int i = 1; i < MAX_PENDING_LINKS; i++)
                if (s->pend[i].since < s->pend[slot].since) slot = i;
            KVS_LOGW("closing link from %s: no HELLO yet and too many pending links", s->pend[slot].l->peer);
            pend_close(&s->pend[slot]);
        }
        s->pend[slot].dec = kvs_proto_decoder_create(KVS_PROTO_HELLO_BYTES + 64, s->n_embd);
        if (!s->pend[slot].dec) {
            kvs_link_close(l);
            return;
        }
        s->pend[slot].l = l;
        s->pend[slot].since = kvs_link_now_ms();
        KVS_LOGD("accepted a link from %s", l->peer);
    }
}

/* Reads from a pending (not yet introduced) link; installs it as the in link
 * on a valid HELLO. */
static void pend_read(struct kvs_stage *s, struct pending_link *pl)
{
    uint8_t buf[256];
    size_t got;
    kvs_err e = kvs_link_read(pl->l, buf, sizeof buf, &got);
    if (e == KVS_ERR_NEED_MORE) return;
    if (e) {
        KVS_LOGD("pending link from %s closed before its HELLO", pl->l->peer);
        pend_close(pl);
        return;
    }
    size_t off = 0;
    while (off < got) {
        size_t used;
        e = kvs_proto_decoder_feed(pl->dec, buf + off, got - off, &used);
        off += used;
        if (e == KVS_ERR_NEED_MORE) return;
        char msg[256];
        if (e) {
            KVS_LOGW("closing link from %s: bad frame: %s", pl->l->peer, kvs_proto_decoder_error(pl->dec));
            met_add(s, &s->met.frames_rejected, 1);
            snprintf(msg, sizeof msg, "bad frame: %s", kvs_proto_decoder_error(pl->dec));
            refuse(pl->l, e, msg);
            pend_close(pl);
            return;
        }
        const struct kvs_frame *f = kvs_proto_decoder_frame(pl->dec);
        struct kvs_hello o;
        kvs_err ce = KVS_ERR_FORMAT;
        char rmsg[256];
        bool hello = f->h.kind == KVS_FRAME_HELLO;
        if (s->solo) {
            snprintf(msg, sizeof msg, "this stage serves the whole model alone (a one-stage ring)");
            snprintf(rmsg, sizeof rmsg, "it serves the whole model alone (a one-stage ring): no predecessor");
            ce = KVS_ERR_MISMATCH;
        } else if (hello) {
            kvs_proto_get_hello(f, &o);
            ce = check_hello(s, &o, KVS_HELLO_ROLE_PRED, msg, sizeof msg, rmsg, sizeof rmsg);
        } else {
            snprintf(msg, sizeof msg, "first frame is %s, expected HELLO", kvs_frame_kind_name(f->h.kind));
            snprintf(rmsg, sizeof rmsg, "it expected HELLO as the first frame, not %s",
                     kvs_frame_kind_name(f->h.kind));
        }
        if (ce) {
            char full[sizeof s->in_refusal];
            snprintf(full, sizeof full, "refusing predecessor %s: %s", pl->l->peer, msg);
            KVS_LOGW("%s", full);
            met_add(s, &s->met.frames_rejected, 1);
            refuse(pl->l, ce, rmsg);
            if (hello) { /* a stage that does not fit: the ring cannot close with it */
                pthread_mutex_lock(&s->mu);
                s->in_refusal_code = ce;
                snprintf(s->in_refusal, sizeof s->in_refusal, "%s", full);
                pthread_mutex_unlock(&s->mu);
                pthread_cond_broadcast(&s->cv);
            }
            pend_close(pl);
            return;
        }
        uint8_t hb[KVS_PROTO_HEADER_BYTES + KVS_PROTO_HELLO_BYTES];
        write_hello(s, hb, KVS_HELLO_ROLE_SUCC);
        if (kvs_link_write(pl->l, hb, sizeof hb, 1000)) {
            pend_close(pl);
            return;
        }
        if (s->in) in_lost(s, "replaced by a new link");
        pthread_mutex_lock(&s->mu);
        s->in_refusal_code = KVS_OK;
        s->in_refusal[0] = '\0';
        pthread_mutex_unlock(&s->mu);
        s->in = pl->l;
        pl->l = NULL;
        kvs_proto_decoder_reset(s->in_dec);
        s->in_last_read = kvs_link_now_ms();
        KVS_LOGI("predecessor [%u,%u) connected from %s", o.block_begin, o.block_end, s->in->peer);
        if (off < got) /* bytes after the HELLO belong to the in link */
            KVS_LOGD("dropping %zu early bytes from %s", got - off, s->in->peer);
        pend_close(pl);
        met_update(s);
        return;
    }
}

/* The successor refused this stage (or its HELLO does not fit): a
 * configuration error that re-dialing will not fix until someone restarts a
 * stage. Logged as an error at every attempt, re-dialed with a growing
 * backoff (1, 2, 4 .. 16 s), and kept as the reason the ring cannot close
 * (requests fail with it, kvs_stage_wait_ready returns it). */
static void out_refused(struct kvs_stage *s, kvs_err code, const char *msg)
{
    int shift = s->out_refused < 4 ? s->out_refused : 4;
    int64_t backoff = (int64_t)1000 << shift;
    if (backoff > REFUSED_BACKOFF_MAX_MS) backoff = REFUSED_BACKOFF_MAX_MS;
    s->out_refused++;
    KVS_LOGE("%s (attempt %d, retrying in %d s)", msg, s->out_refused, (int)(backoff / 1000));
    met_add(s, &s->met.frames_rejected, 1);
    pthread_mutex_lock(&s->mu);
    s->out_refusal_code = code ? code : KVS_ERR_MISMATCH;
    snprintf(s->out_refusal, sizeof s->out_refusal, "%s", msg);
    pthread_mutex_unlock(&s->mu);
    out_lost(s, msg);
    s->out_next_dial = kvs_link_now_ms() + backoff;
    pthread_cond_broadcast(&s->cv);
}

static void dial_next(struct kvs_stage *s)
{
    char err[256];
    struct kvs_link *l;
    kvs_err e = kvs_tcp_dial(s->next_addr, 500, &l, err, sizeof err);
    if (e) {
        pthread_mutex_lock(&s->mu);
        s->out_refusal_code = KVS_OK;
        s->out_refusal[0] = '\0';
        pthread_mutex_unlock(&s->mu);
        s->out_refused = 0;
        if (!s->out_warned && s->out_attempt >= 20) {
            KVS_LOGW("still cannot reach the successor: %s (retrying)", err);
            s->out_warned = true;
        }
        s->out_next_dial = kvs_link_now_ms() + kvs_link_backoff_ms(s->out_attempt++);
        return;
    }
    uint8_t hb[KVS_PROTO_HEADER_BYTES + KVS_PROTO_HELLO_BYTES];
    write_hello(s, hb, KVS_HELLO_ROLE_PRED);
    if (kvs_link_write(l, hb, sizeof hb, 1000)) {
        kvs_link_close(l);
        s->out_next_dial = kvs_link_now_ms() + kvs_link_backoff_ms(s->out_attempt++);
        return;
    }
    s->out = l;
    s->out_state = OUT_HANDSHAKE;
    s->out_since = kvs_link_now_ms();
    kvs_proto_decoder_reset(s->out_dec);
}

/* Reads on the out link: the HELLO reply, an ERROR refusal, or EOF. */
static void out_read(struct kvs_stage *s)
{
    uint8_t buf[512];
    size_t got;
    kvs_err e = kvs_link_read(s->out, buf, sizeof buf, &got);
    if (e == KVS_ERR_NEED_MORE) return;
    if (e) {
        out_lost(s, e == KVS_ERR_PEER ? "closed by the far end" : "read error");
        return;
    }
    size_t off = 0;
    while (off < got && s->out) {
        size_t used;
        e = kvs_proto_decoder_feed(s->out_dec, buf + off, got - off, &used);
        off += used;
        if (e == KVS_ERR_NEED_MORE) return;
        char msg[KVS_PROTO_MAX_ERRMSG + 400];
        if (e) {
            snprintf(msg, sizeof msg, "bad frame from the successor: %s", kvs_proto_decoder_error(s->out_dec));
            KVS_LOGW("%s", msg);
            out_lost(s, msg);
            return;
        }
        const struct kvs_frame *f = kvs_proto_decoder_frame(s->out_dec);
        if (f->h.kind == KVS_FRAME_ERROR) {
            uint32_t code;
            char m2[KVS_PROTO_MAX_ERRMSG + 1];
            kvs_proto_get_error(f, &code, m2, sizeof m2);
            kvs_err ce = code > 0 && code < KVS_ERR_COUNT_ ? (kvs_err)code : KVS_ERR_PEER;
            if (s->out_state == OUT_HANDSHAKE) {
                snprintf(msg, sizeof msg, "successor %s refused this stage: %s", s->next_addr, m2);
                out_refused(s, ce, msg);
            } else if (f->h.req == 0 && ce == KVS_ERR_CANCELLED) {
                KVS_LOGI("successor %s says goodbye: %s", s->next_addr, m2);
                s->out_bye = true;
                out_lost(s, "it said goodbye");
            } else {
                snprintf(msg, sizeof msg, "the successor closed the link: %s", m2);
                KVS_LOGW("%s", msg);
                out_lost(s, msg);
            }
            return;
        }
        if (s->out_state == OUT_HANDSHAKE && f->h.kind == KVS_FRAME_HELLO) {
            struct kvs_hello o;
            kvs_proto_get_hello(f, &o);
            char rmsg[256], m3[256];
            kvs_err ce = check_hello(s, &o, KVS_HELLO_ROLE_SUCC, m3, sizeof m3, rmsg, sizeof rmsg);
            if (ce) {
                snprintf(msg, sizeof msg, "successor %s does not fit this stage: %s", s->next_addr, m3);
                out_refused(s, ce, msg);
                return;
            }
            s->out_state = OUT_UP;
            s->out_attempt = 0;
            s->out_refused = 0;
            pthread_mutex_lock(&s->mu);
            s->out_refusal_code = KVS_OK;
            s->out_refusal[0] = '\0';
            pthread_mutex_unlock(&s->mu);
            s->out_warned = false;
            s->out_last_write = kvs_link_now_ms();
            KVS_LOGI("successor [%u,%u) connected at %s", o.block_begin, o.block_end, s->next_addr);
            bool rejoin = s->out_ever_up || s->out_dropped > 0;
            s->out_ever_up = true;
            s->out_dropped = 0;
            if (!s->is_head && rejoin) {
                /* Frames sent while this link was down are lost: requests in
                 * flight cannot finish. Tell every stage and the head (§5). */
                snprintf(msg, sizeof msg, "stage [%d,%d) re-joined its successor: requests in flight are lost",
                         (int)s->begin, (int)s->end);
                drop_all(s, KVS_ERR_PEER, msg);
                send_error(s, 0, KVS_ERR_PEER, msg);
            }
            met_update(s);
            continue;
        }
        snprintf(msg, sizeof msg, "unexpected %s frame from the successor", kvs_frame_kind_name(f->h.kind));
        out_lost(s, msg);
        return;
    }
}

static void in_read(struct kvs_stage *s)
{
    size_t got;
    for (int rounds = 0; rounds < 64 && s->in; rounds++) {
        kvs_err e = kvs_link_read(s->in, s->rbuf, READ_CHUNK, &got);
        if (e == KVS_ERR_NEED_MORE) return;
        if (e) {
            in_lost(s, e == KVS_ERR_PEER ? "closed by the far end" : "read error");
            return;
        }
        s->in_last_read = kvs_link_now_ms();
        met_add(s, &s->met.bytes_in, got);
        size_t off = 0;
        while (off < got && s->in) {
            size_t used;
            e = kvs_proto_decoder_feed(s->in_dec, s->rbuf + off, got - off, &used);
            off += used;
            if (e == KVS_ERR_NEED_MORE) break;
            char why[300];
            if (e) {
                snprintf(why, sizeof why, "bad frame: %s", kvs_proto_decoder_error(s->in_dec));
                met_add(s, &s->met.frames_rejected, 1);
                refuse(s->in, e, why);
                in_lost(s, why);
                return;
            }
            if (!dispatch(s, kvs_proto_decoder_frame(s->in_dec), why, sizeof why)) {
                met_add(s, &s->met.frames_rejected, 1);
                in_lost(s, why);
                return;
            }
        }
        if (got < READ_CHUNK) return;
    }
}

/* --- head: admission, prefill, batched decode ------------------------------------ */

/* One-stage ring: the whole model here; prompt forward, sample locally. */
static void solo_start(struct kvs_stage *s, struct queued *w, struct seq *q)
{
    const struct kvs_sampler_params *sp = &w->r.sampling;
    kvs_err se = kvs_sampler_create(sp, (int32_t)s->n_vocab, &q->smp);
    if (se) {
        head_end(s, q, se, 0, se == KVS_ERR_NOMEM ? "cannot create a sampler" : "sampling parameters refused");
        return;
    }
    uint32_t n = (uint32_t)w->r.n_prompt;
    for (uint32_t i = 0; i < n; i++) kvs_sampler_accept(q->smp, w->prompt[i]);
    q->max_tokens = (uint32_t)w->r.max_tokens;
    q->ignore_eos = w->r.ignore_eos;
    q->n_stop = (uint32_t)w->r.n_stop_ids;
    memcpy(q->stop, w->stop, sizeof q->stop);
    met_add(s, &s->met.requests_started, 1);
    int32_t slot = seq_slot(s, q);
    for (uint32_t c = 0; c < n; c += (uint32_t)s->n_batch) {
        uint32_t cnt = n - c < (uint32_t)s->n_batch ? n - c : (uint32_t)s->n_batch;
        for (uint32_t i = 0; i < cnt; i++) {
            s->b_seq[i] = slot;
            s->b_pos[i] = (int32_t)(c + i);
        }
        /* logits NULL: the chunk's last row only (used after the last chunk) */
        struct kvs_batch b = { .n_tokens = (int32_t)cnt, .token = w->prompt + c, .seq = s->b_seq,
                               .pos = s->b_pos };
        kvs_err e = forward(s, &b, s->y);
        if (e) {
            char msg[128];
            snprintf(msg, sizeof msg, "forward on the prompt failed: %s", kvs_strerror(e));
            head_end(s, q, e, 0, msg);
            return;
        }
        met_add(s, &s->met.prefill_tokens, cnt);
    }
    tail_sample(s, q, s->y, (int32_t)n);
}

static void head_start(struct kvs_stage *s, struct queued *w)
{
    struct seq *q = seq_alloc(s, w->req);
    q->cb = w->r.on_event;
    q->user = w->r.user;
    q->max_tokens = (uint32_t)w->r.max_tokens; /* the head holds the tail to it (head_token) */
    if (s->solo) {
        solo_start(s, w, q);
        return;
    }
    struct kvs_req_params rp = { .temp = w->r.sampling.temp, .top_k = w->r.sampling.top_k,
                                 .top_p = w->r.sampling.top_p, .min_p = w->r.sampling.min_p,
                                 .repeat_penalty = w->r.sampling.repeat_penalty,
                                 .repeat_last_n = w->r.sampling.repeat_last_n, .seed = w->r.sampling.seed,
                                 .max_tokens = (uint32_t)w->r.max_tokens, .ignore_eos = w->r.ignore_eos,
                                 .n_stop = (uint32_t)w->r.n_stop_ids };
    memcpy(rp.stop, w->stop, sizeof rp.stop);
    uint32_t n = (uint32_t)w->r.n_prompt;
    kvs_proto_put_req(s->sbuf + KVS_PROTO_HEADER_BYTES, &rp, w->prompt, n);
    struct kvs_frame_header h = { .kind = KVS_FRAME_REQUEST_START,
                                  .flags = rp.ignore_eos ? KVS_FRAME_FLAG_IGNORE_EOS : 0, .req = w->req,
                                  .n_tokens = n, .payload_len = (uint32_t)kvs_proto_req_bytes(rp.n_stop, n) };
    met_add(s, &s->met.requests_started, 1);
    if (!send_built(s, &h)) {
        head_end(s, q, KVS_ERR_PEER, 0, "the ring is not complete (successor link down)");
        return;
    }
    int32_t slot = seq_slot(s, q);
    for (uint32_t c = 0; c < n; c += (uint32_t)s->n_batch) {
        uint32_t cnt = n - c < (uint32_t)s->n_batch ? n - c : (uint32_t)s->n_batch;
        for (uint32_t i = 0; i < cnt; i++) {
            s->b_seq[i] = slot;
            s->b_pos[i] = (int32_t)(c + i);
        }
        struct kvs_batch b = { .n_tokens = (int32_t)cnt, .token = w->prompt + c, .seq = s->b_seq,
                               .pos = s->b_pos };
        kvs_err e = forward(s, &b, s->y);
        if (e) {
            char msg[128];
            snprintf(msg, sizeof msg, "forward on the prompt failed: %s", kvs_strerror(e));
            head_abort(s, q, w->req, e, msg);
            return;
        }
        met_add(s, &s->met.prefill_tokens, cnt);
        bool last = c + cnt == n;
        size_t bytes = kvs_proto_put_boundary(s->sbuf + KVS_PROTO_HEADER_BYTES, s->y, (size_t)cnt * s->n_embd,
                                              s->p.boundary_f32);
        struct kvs_frame_header ph = { .kind = KVS_FRAME_PREFILL,
                                       .flags = (uint8_t)((last ? KVS_FRAME_FLAG_LAST : 0) |
                                                          (s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0)),
                                       .req = w->req, .pos = c, .n_tokens = cnt, .payload_len = (uint32_t)bytes };
        if (!send_built(s, &ph)) return; /* out_lost failed every request */
    }
}

static void head_decode_group(struct kvs_stage *s, int32_t g, int32_t G);

static void free_queued(struct queued *w)
{
    if (!w) return;
    free(w->prompt);
    free(w);
}

static void head_admit(struct kvs_stage *s)
{
    for (;;) {
        struct queued *w = NULL;
        uint32_t cancel = 0;
        pthread_mutex_lock(&s->mu);
        if (s->n_cancels) {
            cancel = s->cancels[--s->n_cancels];
        } else if (s->n_queue && n_active(s) < s->n_seq) {
            w = s->queue[0];
            memmove(s->queue, s->queue + 1, (size_t)(s->n_queue - 1) * sizeof s->queue[0]);
            s->n_queue--;
        }
        pthread_mutex_unlock(&s->mu);
        if (cancel) {
            struct seq *q = seq_find(s, cancel);
            if (q) {
                head_abort(s, q, cancel, KVS_ERR_CANCELLED, "cancelled");
            } else { /* maybe still queued */
                pthread_mutex_lock(&s->mu);
                for (int i = 0; i < s->n_queue; i++)
                    if (s->queue[i]->req == cancel) {
                        w = s->queue[i];
                        memmove(s->queue + i, s->queue + i + 1, (size_t)(s->n_queue - i - 1) * sizeof s->queue[0]);
                        s->n_queue--;
                        break;
                    }
                pthread_mutex_unlock(&s->mu);
                if (w) {
                    struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_ERROR, .req = w->req,
                                                  .err = KVS_ERR_CANCELLED, .message = "cancelled" };
                    met_add(s, &s->met.requests_failed, 1);
                    w->r.on_event(w->r.user, &ev);
                    free_queued(w);
                }
            }
            continue;
        }
        if (!w) break;
        met_update(s);
        bool ready;
        pthread_mutex_lock(&s->mu);
        ready = s->met.ring_ready;
        pthread_mutex_unlock(&s->mu);
        if (!ready) {
            char reason[sizeof s->out_refusal], why[sizeof reason + 32];
            kvs_err re = kvs_stage_ring_error(s, reason, sizeof reason);
            snprintf(why, sizeof why, "the ring is not complete%s%s", re ? ": " : "", re ? reason : "");
            struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_ERROR, .req = w->req,
                                          .err = re ? re : KVS_ERR_PEER, .message = why };
            met_add(s, &s->met.requests_failed, 1);
            w->r.on_event(w->r.user, &ev);
            free_queued(w);
            continue;
        }
        /* One start per loop turn: its prompt forward keeps this loop busy,
         * and frames (probes, tokens) must be read between two starts. */
        head_start(s, w);
        free_queued(w);
        pthread_mutex_lock(&s->mu);
        s->admit_more = s->n_queue > 0 && n_active(s) < s->n_seq;
        pthread_mutex_unlock(&s->mu);
        break;
    }
    met_update(s);
}

/* Decode groups: sequence slot i belongs to group i % decode_groups. A group
 * is fed as one batch once none of its decoding sequences is still in
 * flight, so its sequences stay together in one DECODE frame per step (one
 * forward per stage and step) instead of drifting into single-row batches.
 * With G groups, G batches circulate at once (pipelining across stages on
 * separate machines); G = 1 keeps one batch, best when the stages share cores. */
static bool group_ready(const struct kvs_stage *s, int32_t g, int32_t G)
{
    for (int32_t i = g; i < s->n_seq; i += G) {
        const struct seq *q = &s->seqs[i];
        if (q->used && q->decoding && !q->has_next) return false;
    }
    return true;
}

static void head_decode(struct kvs_stage *s)
{
    int32_t G = s->p.decode_groups > 0 ? s->p.decode_groups : 1;
    if (G > s->n_seq) G = s->n_seq;
    for (int32_t g = 0; g < G; g++)
        if (group_ready(s, g, G)) head_decode_group(s, g, G);
}

static void head_decode_group(struct kvs_stage *s, int32_t g, int32_t G)
{
    int32_t n = 0;
    for (int32_t i = g; i < s->n_seq; i += G) {
        struct seq *q = &s->seqs[i];
        if (!q->used || !q->has_next) continue; /* head_token checked next_pos */
        s->b_tok[n] = q->next_tok;
        s->b_seq[n] = i;
        s->b_pos[n] = q->next_pos;
        s->b_req[n] = q->req;
        q->has_next = false;
        n++;
    }
    if (n == 0) return;
    for (int32_t k = 0; k < n; k++) s->b_logits[k] = 1; /* used on a one-stage ring (the tail's rows) */
    struct kvs_batch b = { .n_tokens = n, .token = s->b_tok, .seq = s->b_seq, .pos = s->b_pos,
                           .logits = s->solo ? s->b_logits : NULL };
    kvs_err e = forward(s, &b, s->y);
    if (e == KVS_ERR_NUMERIC) {
        if ((n = keep_finite_rows(s, n, s->solo, "decode forward")) == 0) return;
    } else if (e) {
        char msg[128];
        snprintf(msg, sizeof msg, "decode forward failed: %s", kvs_strerror(e));
        for (int32_t k = 0; k < n; k++) head_abort(s, seq_find(s, s->b_req[k]), s->b_req[k], e, msg);
        return;
    }
    decode_rows_done(s, n, s->solo);
}

/* --- timers ----------------------------------------------------------------------- */

/* Bytes are waiting on the in link: whatever kept this loop busy (a long
 * forward on an oversubscribed machine), the predecessor is not silent. */
static bool in_pending(struct kvs_stage *s)
{
    if (!s->in) return false;
    struct pollfd pf = { .fd = kvs_link_fd(s->in), .events = POLLIN };
    return poll(&pf, 1, 0) > 0;
}

static void timers(struct kvs_stage *s)
{
    int64_t now = kvs_link_now_ms();
    for (int i = 0; i < MAX_PENDING_LINKS; i++)
        if (s->pend[i].l && now - s->pend[i].since > HANDSHAKE_MS) {
            KVS_LOGW("closing link from %s: no HELLO within %d ms", s->pend[i].l->peer, HANDSHAKE_MS);
            pend_close(&s->pend[i]);
        }
    if (s->in && now - s->in_last_read > s->p.timeout_ms && !in_pending(s)) {
        char why[64];
        snprintf(why, sizeof why, "silent for %d ms", (int)(now - s->in_last_read));
        in_lost(s, why);
    }
    if (s->out_state == OUT_DOWN && now >= s->out_next_dial && !s->solo) dial_next(s);
    if (s->out_state == OUT_HANDSHAKE && now - s->out_since > HANDSHAKE_MS) out_lost(s, "no HELLO reply");
    if (s->out_state == OUT_UP) {
        /* Until the ring is known closed, a probe sent while a later link was
         * still down is lost: probe again soon instead of after keepalive_ms
         * (that wait was up to a second before the first request could go). */
        const int64_t every = s->met.ring_ready ? s->p.keepalive_ms : PROBE_UNREADY_MS;
        if (s->is_head && now - s->probe_sent >= every) {
            s->probe_no++;
            s->probe_sent = now;
            send_probe(s, s->probe_no, 0, 0);
        } else if (now - s->out_last_write >= s->p.keepalive_ms) {
            send_simple(s, KVS_FRAME_KEEPALIVE, 0, 0, 0);
        }
    }
    /* Probes queue behind the frames every stage is computing: a busy ring
     * (long prefills, an oversubscribed machine) delays them without being
     * stalled. Stalled = neither a probe nor a token came back. */
    if (s->is_head && n_active(s) > 0 && s->probe_back && now - s->probe_back > s->p.timeout_ms &&
        now - s->progress > s->p.timeout_ms && !in_pending(s)) {
        char msg[128];
        snprintf(msg, sizeof msg, "ring stalled: no probe came back for %d ms", (int)(now - s->probe_back));
        KVS_LOGW("%s", msg);
        drop_all(s, KVS_ERR_TIMEOUT, msg);
    }
    met_update(s);
}

/* Goodbye (PROTOCOL.md §5): ERROR (req 0, CANCELLED) on both links, so the
 * neighbours take the EOF that follows as an orderly shutdown. Best effort,
 * bounded by BYE_WRITE_MS per link. */
static void say_goodbye(struct kvs_stage *s)
{
    uint8_t buf[KVS_PROTO_HEADER_BYTES + 4 + KVS_PROTO_MAX_ERRMSG];
    char msg[96];
    snprintf(msg, sizeof msg, "stage [%d,%d) is shutting down", (int)s->begin, (int)s->end);
    size_t n = kvs_proto_put_error(buf + KVS_PROTO_HEADER_BYTES, (uint32_t)KVS_ERR_CANCELLED, msg);
    struct kvs_frame_header h = { .kind = KVS_FRAME_ERROR, .payload_len = (uint32_t)n };
    kvs_proto_put_header(buf, &h);
    if (s->out && s->out_state == OUT_UP) (void)kvs_link_write(s->out, buf, KVS_PROTO_HEADER_BYTES + n, BYE_WRITE_MS);
    if (s->in) (void)kvs_link_write(s->in, buf, KVS_PROTO_HEADER_BYTES + n, BYE_WRITE_MS);
}

/* --- public ------------------------------------------------------------------------ */

kvs_err kvs_stage_run(struct kvs_stage *s)
{
    KVS_LOGI("stage [%d,%d) of %u blocks (ctx %d, %d seqs, %s boundaries) listening on %s (port %u), next %s%s%s",
             (int)s->begin, (int)s->end, s->hp.n_block, (int)s->n_ctx, (int)s->n_seq,
             s->p.boundary_f32 ? "f32" : "f16", s->listen_addr, kvs_stage_listen_port(s),
             s->solo ? "(none)" : s->next_addr, s->is_head ? ", head" : "", s->is_tail ? ", tail" : "");
    if (s->solo) KVS_LOGI("stage [%d,%d) holds the whole model: a one-stage ring, no links", (int)s->begin, (int)s->end);
    for (;;) {
        bool stop = false;
        struct pollfd pf[5 + MAX_PENDING_LINKS];
        int np = 0, i_in = -1, i_out = -1, i_stop = -1, i_pend[MAX_PENDING_LINKS];
        pf[np++] = (struct pollfd){ .fd = s->wake[0], .events = POLLIN };
        pf[np++] = (struct pollfd){ .fd = kvs_listener_fd(s->lst), .events = POLLIN };
        if (s->p.stop_fd >= 0) {
            i_stop = np;
            pf[np++] = (struct pollfd){ .fd = s->p.stop_fd, .events = POLLIN };
        }
        if (s->in) {
            i_in = np;
            pf[np++] = (struct pollfd){ .fd = kvs_link_fd(s->in), .events = POLLIN };
        }
        if (s->out) {
            i_out = np;
            pf[np++] = (struct pollfd){ .fd = kvs_link_fd(s->out), .events = POLLIN };
        }
        for (int i = 0; i < MAX_PENDING_LINKS; i++) {
            i_pend[i] = -1;
            if (s->pend[i].l) {
                i_pend[i] = np;
                pf[np++] = (struct pollfd){ .fd = kvs_link_fd(s->pend[i].l), .events = POLLIN };
            }
        }
        bool busy = s->admit_more;
        if (s->solo) /* one-stage ring: sampled tokens wait to be fed, no frame will wake the loop */
            for (int32_t i = 0; i < s->n_seq && !busy; i++) busy = s->seqs[i].used && s->seqs[i].has_next;
        int r = poll(pf, (nfds_t)np, busy ? 0 : s->is_head && !s->met.ring_ready ? PROBE_UNREADY_MS : 100);
        s->admit_more = false;
        if (r < 0 && errno != EINTR) return KVS_ERR_IO;
        if (r > 0) {
            if (pf[0].revents) {
                char buf[64];
                ssize_t n;
                while ((n = read(s->wake[0], buf, sizeof buf)) > 0)
                    for (ssize_t k = 0; k < n; k++)
                        if (buf[k] == 's') stop = true;
                if (stop) break;
            }
            if (i_stop >= 0 && pf[i_stop].revents) break;
            if (pf[1].revents) accept_new(s);
            for (int i = 0; i < MAX_PENDING_LINKS; i++)
                if (i_pend[i] >= 0 && pf[i_pend[i]].revents && s->pend[i].l) pend_read(s, &s->pend[i]);
            if (i_out >= 0 && pf[i_out].revents && s->out) out_read(s);
            if (i_in >= 0 && pf[i_in].revents && s->in) in_read(s);
        }
        if (s->is_head) {
            head_admit(s);
            head_decode(s);
        }
        timers(s);
    }
    KVS_LOGI("stage [%d,%d) stopping", (int)s->begin, (int)s->end);
    say_goodbye(s);
    /* Nothing is served any more: end every request the head holds. */
    pthread_mutex_lock(&s->mu);
    s->stopped = true;
    pthread_mutex_unlock(&s->mu);
    pthread_cond_broadcast(&s->cv); /* kvs_stage_wait_ready returns */
    if (s->is_head) {
        drop_all(s, KVS_ERR_CANCELLED, "the head stage stopped");
        for (;;) {
            struct queued *w = NULL;
            pthread_mutex_lock(&s->mu);
            if (s->n_queue) w = s->queue[--s->n_queue];
            pthread_mutex_unlock(&s->mu);
            if (!w) break;
            struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_ERROR, .req = w->req, .err = KVS_ERR_CANCELLED,
                                          .message = "the head stage stopped" };
            w->r.on_event(w->r.user, &ev);
            free_queued(w);
        }
    }
    return KVS_OK;
}

void kvs_stage_stop(struct kvs_stage *s)
{
    char c = 's'; /* only a pipe write: async-signal-safe */
    ssize_t r = write(s->wake[1], &c, 1);
    (void)r;
}

kvs_err kvs_stage_create(const struct kvs_stage_params *p, struct kvs_stage **out, char *errbuf, size_t errlen)
{
    char err[512] = "";
    kvs_err e = KVS_OK;
    struct kvs_stage *s = calloc(1, sizeof *s);
    if (!s) return KVS_ERR_NOMEM;
    s->wake[0] = s->wake[1] = -1;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->p = *p;
    if (s->p.n_threads <= 0) s->p.n_threads = 2;
    if (s->p.n_seq <= 0) s->p.n_seq = 4;
    if (s->p.n_batch <= 0) s->p.n_batch = 512;
    if (s->p.timeout_ms <= 0) s->p.timeout_ms = 4000;
    if (s->p.keepalive_ms <= 0) s->p.keepalive_ms = 1000;
    s->next_req = 1;
    if (!p->model_path || !p->listen) {
        snprintf(err, sizeof err, "a stage needs a model and a listen address");
        e = KVS_ERR_ARG;
        goto fail;
    }
    snprintf(s->listen_addr, sizeof s->listen_addr, "%s", p->listen);
    snprintf(s->next_addr, sizeof s->next_addr, "%s", p->next ? p->next : "");
    s->p.listen = s->listen_addr;
    s->p.next = s->next_addr;
    s->p.model_path = NULL;
    s->p.fingerprint = NULL;

    if ((e = kvs_gguf_open(p->model_path, &s->g, err, sizeof err))) goto fail;
    if ((e = kvs_gguf_fingerprint(s->g, s->fp))) {
        snprintf(err, sizeof err, "cannot fingerprint %s", p->model_path);
        goto fail;
    }
    kvs_gguf_fingerprint_hex(s->fp, s->fp_hex);
    if (p->fingerprint && p->fingerprint[0] && strcmp(p->fingerprint, s->fp_hex)) {
        snprintf(err, sizeof err, "%s has fingerprint %s, the manifest expects %s", p->model_path, s->fp_hex,
                 p->fingerprint);
        e = KVS_ERR_MISMATCH;
        goto fail;
    }
    {
        /* A stage shard (kvasir.shard.* keys) must cover the assigned window:
         * say so plainly instead of failing on the first missing tensor. */
        uint32_t sb, se;
        if (kvs_shard_window(s->g, &sb, &se)) {
            struct kvs_hparams hp0;
            if ((e = kvs_hparams_read(s->g, &hp0, err, sizeof err))) goto fail;
            uint32_t want_end = p->block_end < 0 ? hp0.n_block : (uint32_t)p->block_end;
            if ((e = kvs_shard_check(s->g, (uint32_t)p->block_begin, want_end, err, sizeof err))) goto fail;
        }
    }
    struct kvs_model_params mp = kvs_model_default_params();
    mp.block_begin = p->block_begin;
    mp.block_end = p->block_end;
    mp.n_ctx = p->n_ctx;
    mp.n_seq = s->p.n_seq;
    mp.n_batch = s->p.n_batch;
    mp.n_threads = s->p.n_threads;
    /* The pool is created by kvs_model_load, on this thread. */
    int spin_prev = kvs_pool_set_thread_spin(p->pool_spin == 0 ? KVS_STAGE_POOL_SPIN : p->pool_spin);
    e = kvs_model_load(s->g, &mp, &s->m, err, sizeof err);
    kvs_pool_set_thread_spin(spin_prev);
    if (e) goto fail;
    s->hp = *kvs_model_hparams(s->m);
    s->begin = kvs_model_block_begin(s->m);
    s->end = kvs_model_block_end(s->m);
    s->n_ctx = kvs_model_n_ctx(s->m);
    s->n_seq = kvs_model_n_seq(s->m);
    s->n_batch = s->p.n_batch;
    s->n_embd = s->hp.n_embd;
    s->n_vocab = s->hp.n_vocab;
    s->is_head = kvs_model_has_embd(s->m);
    s->is_tail = kvs_model_has_head(s->m);
    /* The whole model: a one-stage ring. The head is its own tail and
     * samples locally; no link is dialed and predecessors are refused. */
    s->solo = s->is_head && s->is_tail;
    if (!s->solo && !s->next_addr[0]) {
        snprintf(err, sizeof err, "stage [%d,%d) of %u blocks needs a next address (its successor)", (int)s->begin,
                 (int)s->end, s->hp.n_block);
        e = KVS_ERR_ARG;
        goto fail;
    }
    if (!s->solo) { /* a malformed next is a start-up error, not 20 silent retries */
        char host[256] = "", why[200] = "";
        uint16_t port = 0;
        if (kvs_addr_parse(s->next_addr, host, sizeof host, &port, why, sizeof why) == KVS_OK)
            snprintf(why, sizeof why, "%s", !host[0] ? "a HOST is needed" : !port ? "port 0 cannot be dialed" : "");
        if (why[0]) {
            snprintf(err, sizeof err, "next address '%.200s': %s", s->next_addr, why);
            e = KVS_ERR_ARG;
            goto fail;
        }
    }
    if (s->is_head) {
        if ((e = kvs_tokenizer_load(s->g, &s->tok, err, sizeof err))) goto fail;
        int32_t nv = kvs_tokenizer_n_vocab(s->tok);
        for (int32_t id = 0; id < nv && s->n_eog < KVS_PROTO_MAX_STOP; id++)
            if (kvs_tokenizer_is_eog(s->tok, id)) s->eog[s->n_eog++] = id;
    }
    size_t rows_out = (size_t)s->n_batch * s->n_embd;
    if (s->is_tail && (size_t)s->n_seq * s->n_vocab > rows_out) rows_out = (size_t)s->n_seq * s->n_vocab;
    uint64_t max_payload = kvs_proto_decode_bytes((uint32_t)s->n_batch, s->n_embd, true) + 4096;
    uint64_t req_max = kvs_proto_req_bytes(KVS_PROTO_MAX_STOP, (uint32_t)s->n_ctx);
    if (req_max + 4096 > max_payload) max_payload = req_max + 4096;
    if (max_payload > KVS_PROTO_MAX_PAYLOAD) {
        snprintf(err, sizeof err, "n_batch %d x n_embd %u exceeds the frame cap", (int)s->n_batch, s->n_embd);
        e = KVS_ERR_RANGE;
        goto fail;
    }
    s->sbuf_cap = KVS_PROTO_HEADER_BYTES + (size_t)max_payload;
    s->sbuf = malloc(s->sbuf_cap);
    s->rbuf = malloc(READ_CHUNK);
    s->x = malloc((size_t)s->n_batch * s->n_embd * sizeof(float));
    s->y = malloc(rows_out * sizeof(float));
    s->b_tok = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_seq = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_pos = malloc((size_t)s->n_batch * sizeof(int32_t));
    s->b_req = malloc((size_t)s->n_batch * sizeof(uint32_t));
    s->b_logits = malloc((size_t)s->n_batch);
    s->seqs = calloc((size_t)s->n_seq, sizeof *s->seqs);
    s->in_dec = kvs_proto_decoder_create((uint32_t)max_payload, s->n_embd);
    s->out_dec = kvs_proto_decoder_create(KVS_PROTO_HELLO_BYTES + 4 + KVS_PROTO_MAX_ERRMSG, s->n_embd);
    if (!s->sbuf || !s->rbuf || !s->x || !s->y || !s->b_tok || !s->b_seq || !s->b_pos || !s->b_req ||
        !s->b_logits || !s->seqs || !s->in_dec || !s->out_dec) {
        snprintf(err, sizeof err, "out of memory for stage buffers");
        e = KVS_ERR_NOMEM;
        goto fail;
    }
    if (pipe2(s->wake, O_NONBLOCK | O_CLOEXEC)) {
        snprintf(err, sizeof err, "pipe: %s", strerror(errno));
        e = KVS_ERR_IO;
        goto fail;
    }
    if ((e = kvs_tcp_listen(s->listen_addr, &s->lst, err, sizeof err))) goto fail;
    met_update(s);
    *out = s;
    return KVS_OK;
fail:
    if (errbuf && errlen) snprintf(errbuf, errlen, "%s", err[0] ? err : kvs_strerror(e));
    kvs_stage_free(s);
    return e ? e : KVS_ERR_INTERNAL;
}

void kvs_stage_free(struct kvs_stage *s)
{
    if (!s) return;
    if (s->seqs)
        for (int32_t i = 0; i < s->n_seq; i++)
            if (s->seqs[i].used) {
                if (s->is_head) head_end(s, &s->seqs[i], KVS_ERR_CANCELLED, 0, "stage shut down");
                else seq_free(s, &s->seqs[i]);
            }
    for (int i = 0; i < s->n_queue; i++) free_queued(s->queue[i]);
    for (int i = 0; i < MAX_PENDING_LINKS; i++) pend_close(&s->pend[i]);
    kvs_link_close(s->in);
    kvs_link_close(s->out);
    kvs_listener_close(s->lst);
    kvs_proto_decoder_free(s->in_dec);
    kvs_proto_decoder_free(s->out_dec);
    if (s->wake[0] >= 0) close(s->wake[0]);
    if (s->wake[1] >= 0) close(s->wake[1]);
    free(s->sbuf);
    free(s->rbuf);
    free(s->x);
    free(s->y);
    free(s->b_tok);
    free(s->b_seq);
    free(s->b_pos);
    free(s->b_req);
    free(s->b_logits);
    free(s->seqs);
    kvs_tokenizer_free(s->tok);
    kvs_model_free(s->m);
    kvs_gguf_close(s->g);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}

uint16_t kvs_stage_listen_port(const struct kvs_stage *s)
{
    return kvs_listener_port(s->lst);
}

bool kvs_stage_is_head(const struct kvs_stage *s)
{
    return s->is_head;
}

const struct kvs_tokenizer *kvs_stage_tokenizer(const struct kvs_stage *s)
{
    return s->tok;
}

kvs_err kvs_stage_submit(struct kvs_stage *s, const struct kvs_stage_request *r, uint32_t *req)
{
    if (!s->is_head || !r || !r->on_event || !r->prompt || r->n_prompt < 1 || r->max_tokens < 1 ||
        r->n_stop_ids < 0 || r->n_stop_ids > (int32_t)KVS_PROTO_MAX_STOP)
        return KVS_ERR_ARG;
    if (r->n_prompt >= s->n_ctx) return KVS_ERR_RANGE;
    for (int32_t i = 0; i < r->n_prompt; i++)
        if (r->prompt[i] < 0 || (uint32_t)r->prompt[i] >= s->n_vocab) return KVS_ERR_RANGE;
    struct queued *w = calloc(1, sizeof *w);
    if (!w) return KVS_ERR_NOMEM;
    w->prompt = malloc((size_t)r->n_prompt * sizeof(int32_t));
    if (!w->prompt) {
        free(w);
        return KVS_ERR_NOMEM;
    }
    memcpy(w->prompt, r->prompt, (size_t)r->n_prompt * sizeof(int32_t));
    w->r = *r;
    w->r.prompt = w->prompt;
    if (r->stop_ids && r->n_stop_ids > 0) {
        memcpy(w->stop, r->stop_ids, (size_t)r->n_stop_ids * sizeof(int32_t));
    } else {
        memcpy(w->stop, s->eog, sizeof w->stop);
        w->r.n_stop_ids = (int32_t)s->n_eog;
    }
    w->r.stop_ids = w->stop;
    pthread_mutex_lock(&s->mu);
    if (s->n_queue >= MAX_QUEUE || s->stopped) {
        kvs_err e = s->stopped ? KVS_ERR_CANCELLED : KVS_ERR_FULL;
        pthread_mutex_unlock(&s->mu);
        free_queued(w);
        return e;
    }
    w->req = s->next_req++;
    if (s->next_req == 0) s->next_req = 1;
    s->queue[s->n_queue++] = w;
    if (req) *req = w->req;
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return KVS_OK;
}

kvs_err kvs_stage_cancel(struct kvs_stage *s, uint32_t req)
{
    pthread_mutex_lock(&s->mu);
    if (s->n_cancels >= MAX_CANCELS) {
        pthread_mutex_unlock(&s->mu);
        return KVS_ERR_FULL;
    }
    s->cancels[s->n_cancels++] = req;
    pthread_mutex_unlock(&s->mu);
    wake(s);
    return KVS_OK;
}

bool kvs_stage_ring_ready(struct kvs_stage *s)
{
    pthread_mutex_lock(&s->mu);
    bool r = s->met.ring_ready;
    pthread_mutex_unlock(&s->mu);
    return r;
}

kvs_err kvs_stage_wait_ready(struct kvs_stage *s, int timeout_ms)
{
    int64_t deadline = kvs_link_now_ms() + timeout_ms;
    pthread_mutex_lock(&s->mu);
    while (!s->met.ring_ready) {
        if (s->stopped || s->out_refusal_code || s->in_refusal_code) {
            kvs_err e = s->stopped ? KVS_ERR_CANCELLED : s->out_refusal_code ? s->out_refusal_code
                                                                              : s->in_refusal_code;
            pthread_mutex_unlock(&s->mu);
            return e;
        }
        int64_t left = deadline - kvs_link_now_ms();
        if (left <= 0) {
            pthread_mutex_unlock(&s->mu);
            return KVS_ERR_TIMEOUT;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t step = left < 100 ? left : 100;
        ts.tv_nsec += (long)(step * 1000000);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&s->cv, &s->mu, &ts);
    }
    pthread_mutex_unlock(&s->mu);
    return KVS_OK;
}

kvs_err kvs_stage_ring_error(struct kvs_stage *s, char *buf, size_t cap)
{
    pthread_mutex_lock(&s->mu);
    kvs_err e = KVS_OK;
    const char *m = "";
    if (s->stopped) {
        e = KVS_ERR_CANCELLED;
        m = "the stage stopped";
    } else if (s->out_refusal_code) {
        e = s->out_refusal_code;
        m = s->out_refusal;
    } else if (s->in_refusal_code) {
        e = s->in_refusal_code;
        m = s->in_refusal;
    }
    if (buf && cap) snprintf(buf, cap, "%s", m);
    pthread_mutex_unlock(&s->mu);
    return e;
}

void kvs_stage_metrics(struct kvs_stage *s, struct kvs_stage_metrics *m)
{
    pthread_mutex_lock(&s->mu);
    *m = s->met;
    pthread_mutex_unlock(&s->mu);
}

int kvs_stage_ring_stats(struct kvs_stage *s, struct kvs_stage_hop *out, int cap, double *rtt_ms)
{
    pthread_mutex_lock(&s->mu);
    int n = s->is_head ? s->n_hops : 0;
    for (int i = 0; i < n && i < cap; i++) out[i] = s->hops[i];
    if (rtt_ms) *rtt_ms = n ? s->probe_rtt_ms : 0.0;
    pthread_mutex_unlock(&s->mu);
    return n;
}

kvs_err kvs_stage_params_from_manifest(const struct kvs_manifest *mf, int32_t rank, struct kvs_stage_params *p)
{
    if (rank < 0 || (size_t)rank >= mf->n_ranks) return KVS_ERR_NOT_FOUND;
    if (!mf->model_path[0]) return KVS_ERR_ARG;
    const struct kvs_manifest_rank *k = &mf->ranks[rank];
    p->model_path = mf->model_path;
    p->fingerprint = mf->fingerprint[0] ? mf->fingerprint : NULL;
    p->block_begin = (int32_t)k->begin;
    p->block_end = (int32_t)k->end;
    p->listen = k->listen;
    p->next = k->next;
    if (k->threads > 0) p->n_threads = (int32_t)k->threads;
    /* the serving targets the plan was made for (docs/MANIFEST.md) */
    if (mf->ctx > 0) p->n_ctx = (int32_t)mf->ctx;
    if (mf->seqs > 0) p->n_seq = (int32_t)mf->seqs;
    if (mf->boundary_bytes) p->boundary_f32 = mf->boundary_bytes == 4;
    return KVS_OK;
}

/* The head (docs/PROTOCOL.md §3): admission of submitted requests, the
 * prompt forward and its PREFILL frames, batched decode in groups, and the
 * tokens that come back from the tail. */
#include "stage/stage_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

/* Head: deliver the final event of a request and free its slot. */
void kvs_st_head_end(struct kvs_stage *s, struct seq *q, kvs_err err, uint32_t finish, const char *msg)
{
    struct kvs_stage_event ev = { .kind = err ? KVS_STAGE_EVENT_ERROR : KVS_STAGE_EVENT_DONE, .req = q->req,
                                  .finish = finish, .n_generated = q->n_reported, .err = err,
                                  .message = msg ? msg : "" };
    kvs_stage_event_fn cb = q->cb;
    void *user = q->user;
    kvs_st_met_add(s, err ? &s->met.requests_failed : &s->met.requests_done, 1);
    kvs_st_seq_free(s, q);
    if (cb) cb(user, &ev);
}

/* Head: request req fails with e (its final event, if its slot q is still
 * held) and a CANCEL goes round so that every stage frees its slot. */
void kvs_st_head_abort(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg)
{
    if (q) kvs_st_head_end(s, q, e, 0, msg);
    kvs_st_send_simple(s, KVS_FRAME_CANCEL, 0, req, 0);
}

/* Head: token tm of request req, to sit at pos, came back from the tail (or
 * was sampled here on a one-stage ring). */
void kvs_st_head_token(struct kvs_stage *s, uint32_t req_id, uint32_t pos, struct kvs_token_msg tm)
{
    /* only a token the head takes counts as progress (s->progress, §3.8): a
     * stray one for a request it does not hold proves nothing about the ring */
    struct seq *q = kvs_st_seq_find(s, req_id);
    if (!q) return; /* cancelled or failed meanwhile */
    if (q->held) return; /* computed before the fault: the replay draws it again (§5.1) */
    if (tm.token < 0 || (uint32_t)tm.token >= s->n_vocab) {
        kvs_st_head_abort(s, q, q->req, KVS_ERR_FORMAT, "the tail sent a token id outside the vocabulary");
        return;
    }
    /* One token per forward, at the position after the head's KV cache: a
     * duplicate, a stray or a token while one is still waiting to be fed is
     * a broken (or hostile) tail, not output. */
    const int32_t want_pos = kvs_model_seq_len(s->m, kvs_st_seq_slot(s, q));
    if (!tm.finish && pos >= (uint32_t)s->n_ctx) {
        kvs_st_head_abort(s, q, q->req, KVS_ERR_RANGE, "the tail sent a token at an unexpected position");
        return;
    }
    if (q->has_next || (int64_t)pos != (int64_t)want_pos) {
        char msg[160];
        if (q->has_next)
            snprintf(msg, sizeof msg, "the tail sent another token (position %u) before the last one was fed", pos);
        else
            snprintf(msg, sizeof msg, "the tail sent a token for position %u, expected %d", pos, (int)want_pos);
        KVS_LOGW("request %u: %s", q->req, msg);
        kvs_st_head_abort(s, q, q->req, KVS_ERR_PEER, msg);
        return;
    }
    s->progress = kvs_link_now_ms();
    kvs_st_met_add(s, &s->met.tokens_generated, 1);
    /* The tail ends a request at max_tokens; the head holds it to that too. */
    if (!tm.finish && q->max_tokens && (uint32_t)q->n_reported + 1 >= q->max_tokens) tm.finish = KVS_FINISH_LENGTH;
    if (tm.finish != KVS_FINISH_STOP) { /* a stop id is not part of the output */
        q->n_reported++;
        struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_TOKEN, .req = q->req, .token = tm.token,
                                      .pos = (int32_t)pos, .n_generated = q->n_reported };
        q->cb(q->user, &ev);
        q = kvs_st_seq_find(s, req_id); /* the callback may not free it, but be safe */
        if (!q) return;
    }
    if (tm.finish) {
        uint32_t req = q->req;
        kvs_st_head_end(s, q, KVS_OK, tm.finish, NULL);
        kvs_st_send_simple(s, KVS_FRAME_END, 0, req, 0);
        return;
    }
    if (s->hist && q->n_hist < s->hist[kvs_st_seq_slot(s, q)].cap)
        s->hist[kvs_st_seq_slot(s, q)].ids[q->n_hist++] = tm.token;
    q->has_next = true;
    q->decoding = true;
    q->next_tok = tm.token;
    q->next_pos = (int32_t)pos;
}

/* Head: a TOKEN came back from the tail. */
void kvs_st_on_token(struct kvs_stage *s, const struct kvs_frame *f)
{
    struct kvs_token_msg tm;
    kvs_proto_get_token(f, &tm);
    kvs_st_head_token(s, f->h.req, f->h.pos, tm);
}

/* One-stage ring: the whole model here; prompt forward, sample locally. */
static void solo_start(struct kvs_stage *s, struct queued *w, struct seq *q)
{
    const struct kvs_sampler_params *sp = &w->r.sampling;
    kvs_err se = kvs_sampler_create(sp, (int32_t)s->n_vocab, &q->smp);
    if (se) {
        kvs_st_head_end(s, q, se, 0, se == KVS_ERR_NOMEM ? "cannot create a sampler" : "sampling parameters refused");
        return;
    }
    uint32_t n = (uint32_t)w->r.n_prompt;
    for (uint32_t i = 0; i < n; i++) kvs_sampler_accept(q->smp, w->prompt[i]);
    q->max_tokens = (uint32_t)w->r.max_tokens;
    q->ignore_eos = w->r.ignore_eos;
    q->n_stop = (uint32_t)w->r.n_stop_ids;
    memcpy(q->stop, w->stop, sizeof q->stop);
    kvs_st_met_add(s, &s->met.requests_started, 1);
    int32_t slot = kvs_st_seq_slot(s, q);
    for (uint32_t c = 0; c < n; c += (uint32_t)s->n_batch) {
        uint32_t cnt = n - c < (uint32_t)s->n_batch ? n - c : (uint32_t)s->n_batch;
        for (uint32_t i = 0; i < cnt; i++) {
            s->b_seq[i] = slot;
            s->b_pos[i] = (int32_t)(c + i);
        }
        /* logits NULL: the chunk's last row only (used after the last chunk) */
        struct kvs_batch b = { .n_tokens = (int32_t)cnt, .token = w->prompt + c, .seq = s->b_seq,
                               .pos = s->b_pos };
        kvs_err e = kvs_st_forward(s, &b, s->y);
        if (e) {
            char msg[128];
            snprintf(msg, sizeof msg, "forward on the prompt failed: %s", kvs_strerror(e));
            kvs_st_head_end(s, q, e, 0, msg);
            return;
        }
        kvs_st_met_add(s, &s->met.prefill_tokens, cnt);
    }
    kvs_st_tail_sample(s, q, s->y, (int32_t)n);
}

/* Head: sends request q round the ring: REQUEST_START with its parameters and
 * ids[0..n) (the prompt; on a replay, prompt + generated, flag REPLAY), then
 * the head's forward over those ids in n_batch chunks, each chunk's boundary
 * as a PREFILL frame. max_tokens: the tokens still to generate. Returns
 * false if the request ended or was held (a lost link) on the way. */
static bool head_send(struct kvs_stage *s, struct seq *q, const int32_t *ids, uint32_t n, uint32_t max_tokens,
                      bool replay)
{
    const uint32_t req = q->req;
    struct kvs_req_params rp = q->rp;
    rp.max_tokens = max_tokens;
    kvs_proto_put_req(s->sbuf + KVS_PROTO_HEADER_BYTES, &rp, ids, n);
    struct kvs_frame_header h = { .kind = KVS_FRAME_REQUEST_START,
                                  .flags = (uint8_t)((rp.ignore_eos ? KVS_FRAME_FLAG_IGNORE_EOS : 0) |
                                                     (replay ? KVS_FRAME_FLAG_REPLAY : 0)),
                                  .req = req, .n_tokens = n,
                                  .payload_len = (uint32_t)kvs_proto_req_bytes(rp.n_stop, n) };
    if (!kvs_st_send_built(s, &h)) {
        /* a write error held it (kvs_st_head_fault); a link already down did not */
        if (q->used && q->req == req && !q->held)
            kvs_st_head_fault(s, KVS_ERR_PEER, "the ring is not complete (successor link down)");
        return false;
    }
    int32_t slot = kvs_st_seq_slot(s, q);
    for (uint32_t c = 0; c < n; c += (uint32_t)s->n_batch) {
        uint32_t cnt = n - c < (uint32_t)s->n_batch ? n - c : (uint32_t)s->n_batch;
        for (uint32_t i = 0; i < cnt; i++) {
            s->b_seq[i] = slot;
            s->b_pos[i] = (int32_t)(c + i);
        }
        struct kvs_batch b = { .n_tokens = (int32_t)cnt, .token = ids + c, .seq = s->b_seq, .pos = s->b_pos };
        kvs_err e = kvs_st_forward(s, &b, s->y);
        if (e) {
            char msg[128];
            snprintf(msg, sizeof msg, "forward on the prompt failed: %s", kvs_strerror(e));
            kvs_st_head_abort(s, q, req, e, msg);
            return false;
        }
        kvs_st_met_add(s, &s->met.prefill_tokens, cnt);
        bool last = c + cnt == n;
        size_t bytes = kvs_proto_put_boundary(s->sbuf + KVS_PROTO_HEADER_BYTES, s->y, (size_t)cnt * s->n_embd,
                                              s->p.boundary_f32);
        struct kvs_frame_header ph = { .kind = KVS_FRAME_PREFILL,
                                       .flags = (uint8_t)((last ? KVS_FRAME_FLAG_LAST : 0) |
                                                          (s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0)),
                                       .req = req, .pos = c, .n_tokens = cnt, .payload_len = (uint32_t)bytes };
        if (!kvs_st_send_built(s, &ph)) return false; /* out_lost held (or failed) every request */
    }
    return true;
}

static void head_start(struct kvs_stage *s, struct queued *w)
{
    struct seq *q = kvs_st_seq_alloc(s, w->req);
    q->cb = w->r.on_event;
    q->user = w->r.user;
    q->max_tokens = (uint32_t)w->r.max_tokens; /* the head holds the tail to it (head_token) */
    if (s->solo) {
        solo_start(s, w, q);
        return;
    }
    q->rp = (struct kvs_req_params){ .temp = w->r.sampling.temp, .top_k = w->r.sampling.top_k,
                                     .top_p = w->r.sampling.top_p, .min_p = w->r.sampling.min_p,
                                     .repeat_penalty = w->r.sampling.repeat_penalty,
                                     .repeat_last_n = w->r.sampling.repeat_last_n, .seed = w->r.sampling.seed,
                                     .max_tokens = (uint32_t)w->r.max_tokens, .ignore_eos = w->r.ignore_eos,
                                     .n_stop = (uint32_t)w->r.n_stop_ids };
    memcpy(q->rp.stop, w->stop, sizeof q->rp.stop);
    uint32_t n = (uint32_t)w->r.n_prompt;
    /* the ids a replay needs: the prompt and every token that can come back (at most n_ctx in all) */
    struct hist *hs = &s->hist[kvs_st_seq_slot(s, q)];
    int64_t want = (int64_t)n + w->r.max_tokens + 1;
    if (want > s->n_ctx + 1) want = s->n_ctx + 1;
    if (hs->cap < want) {
        int32_t *ids = realloc(hs->ids, (size_t)want * sizeof *ids);
        if (!ids) {
            kvs_st_met_add(s, &s->met.requests_started, 1);
            kvs_st_head_end(s, q, KVS_ERR_NOMEM, 0, "out of memory for the request's ids");
            return;
        }
        hs->ids = ids;
        hs->cap = (int32_t)want;
    }
    memcpy(hs->ids, w->prompt, (size_t)n * sizeof *hs->ids);
    q->n_prompt = q->n_hist = (int32_t)n;
    kvs_st_met_add(s, &s->met.requests_started, 1);
    head_send(s, q, w->prompt, n, (uint32_t)w->r.max_tokens, false);
}

/* --- hold and replay (docs/PROTOCOL.md §5.1) ------------------------------- */

int32_t kvs_st_head_n_live(const struct kvs_stage *s)
{
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_seq; i++) n += s->seqs[i].used && !s->seqs[i].held;
    return n;
}

void kvs_st_head_fault(struct kvs_stage *s, kvs_err err, const char *msg)
{
    s->drain_since = 0; /* a fault during a planned leave: the hold and replay take over */
    pthread_mutex_lock(&s->mu);
    bool stopping = s->stopped;
    pthread_mutex_unlock(&s->mu);
    if (s->solo || stopping || s->replay_deadline_ms < 0 || err == KVS_ERR_CANCELLED) {
        for (int32_t i = 0; i < s->n_seq; i++)
            if (s->seqs[i].used) kvs_st_head_end(s, &s->seqs[i], err, 0, msg);
        return;
    }
    int64_t now = kvs_link_now_ms();
    int32_t n_new = 0, n_held = 0;
    for (int32_t i = 0; i < s->n_seq; i++) {
        struct seq *q = &s->seqs[i];
        if (!q->used) continue;
        n_new += !q->held;
        q->held = true;
        q->has_next = false; /* the replay feeds it again */
        q->decoding = false;
        n_held++;
    }
    if (!s->hold_since) {
        s->hold_since = now;
        snprintf(s->hold_why, sizeof s->hold_why, "%s", msg);
    }
    s->hold_probe = s->probe_no; /* whole again = a probe sent after this fault comes back */
    if (n_new)
        KVS_LOGW("ring broken (%s): holding %d request%s until it is whole again (at most %d ms)", msg, (int)n_held,
                 n_held == 1 ? "" : "s", (int)(s->replay_deadline_ms - (now - s->hold_since)));
    kvs_st_met_update(s);
}

void kvs_st_head_probe_back(struct kvs_stage *s, uint32_t probe_no)
{
    kvs_st_head_drain_back(s, probe_no);
    if (!s->hold_since || (int32_t)(probe_no - s->hold_probe) <= 0) return;
    int64_t dt = kvs_link_now_ms() - s->hold_since;
    s->hold_since = 0;
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_seq; i++) n += s->seqs[i].used && s->seqs[i].held;
    KVS_LOGI("ring whole again after %lld ms: replaying %d held request%s", (long long)dt, (int)n, n == 1 ? "" : "s");
    if (n) s->admit_more = true;
}

/* Replays one held request (the ring is whole): its slot on this stage is
 * cleared, and prompt + generated ids go round as a REPLAY request, so every
 * stage rebuilds its KV cache (and recurrent state) from the ids and the tail
 * samples the next position. Returns false if none was held. */
static bool head_replay_one(struct kvs_stage *s)
{
    for (int32_t i = 0; i < s->n_seq; i++) {
        struct seq *q = &s->seqs[i];
        if (!q->used || !q->held) continue;
        kvs_model_seq_clear(s->m, i);
        q->held = false;
        q->has_next = q->decoding = false;
        uint32_t n_gen = (uint32_t)(q->n_hist - q->n_prompt);
        KVS_LOGD("request %u: replay of %d ids (%u generated)", q->req, (int)q->n_hist, n_gen);
        kvs_st_met_add(s, &s->met.requests_replayed, 1);
        head_send(s, q, s->hist[i].ids, (uint32_t)q->n_hist, q->max_tokens > n_gen ? q->max_tokens - n_gen : 1,
                  true);
        return true;
    }
    return false;
}

/* Held requests whose ring did not come back within the deadline fail. */
static void head_hold_expired(struct kvs_stage *s)
{
    if (!s->hold_since || kvs_link_now_ms() - s->hold_since < s->replay_deadline_ms) return;
    char msg[sizeof s->hold_why + 128];
    snprintf(msg, sizeof msg, "the ring broke and was not whole again within %d ms: %s", (int)s->replay_deadline_ms,
             s->hold_why);
    s->hold_since = 0;
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_seq; i++) {
        struct seq *q = &s->seqs[i];
        if (!q->used || !q->held) continue;
        n++;
        kvs_st_head_abort(s, q, q->req, KVS_ERR_PEER, msg); /* CANCEL: live stages free the slot */
    }
    KVS_LOGW("%s (%d held request%s failed)", msg, (int)n, n == 1 ? "" : "s");
}

void kvs_st_free_queued(struct queued *w)
{
    if (!w) return;
    free(w->prompt);
    free(w);
}

void kvs_st_head_admit(struct kvs_stage *s)
{
    head_hold_expired(s);
    if (s->drain_since) return; /* a planned leave drains (§5.2): nothing new goes into the ring */
    if (!s->hold_since && head_replay_one(s)) {
        s->admit_more = true; /* one replay per loop turn: frames are read between two */
        kvs_st_met_update(s);
        return;
    }
    for (;;) {
        struct queued *w = NULL;
        uint32_t cancel = 0;
        pthread_mutex_lock(&s->mu);
        if (s->n_cancels) {
            cancel = s->cancels[--s->n_cancels];
        } else if (s->n_queue && kvs_st_n_active(s) < s->n_seq && !s->hold_since) { /* a hold: they wait */
            w = s->queue[0];
            memmove(s->queue, s->queue + 1, (size_t)(s->n_queue - 1) * sizeof s->queue[0]);
            s->n_queue--;
        }
        pthread_mutex_unlock(&s->mu);
        if (cancel) {
            struct seq *q = kvs_st_seq_find(s, cancel);
            if (q) {
                kvs_st_head_abort(s, q, cancel, KVS_ERR_CANCELLED, "cancelled");
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
                    kvs_st_met_add(s, &s->met.requests_failed, 1);
                    w->r.on_event(w->r.user, &ev);
                    kvs_st_free_queued(w);
                }
            }
            continue;
        }
        if (!w) break;
        kvs_st_met_update(s);
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
            kvs_st_met_add(s, &s->met.requests_failed, 1);
            w->r.on_event(w->r.user, &ev);
            kvs_st_free_queued(w);
            continue;
        }
        /* One start per loop turn: its prompt forward keeps this loop busy,
         * and frames (probes, tokens) must be read between two starts. */
        head_start(s, w);
        kvs_st_free_queued(w);
        pthread_mutex_lock(&s->mu);
        s->admit_more = s->n_queue > 0 && kvs_st_n_active(s) < s->n_seq;
        pthread_mutex_unlock(&s->mu);
        break;
    }
    kvs_st_met_update(s);
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

/* One forward of the n rows gathered in b_tok/b_seq/b_pos/b_req (n <= n_batch). */
static void head_decode_rows(struct kvs_stage *s, int32_t n)
{
    for (int32_t k = 0; k < n; k++) s->b_logits[k] = 1; /* used on a one-stage ring (the tail's rows) */
    struct kvs_batch b = { .n_tokens = n, .token = s->b_tok, .seq = s->b_seq, .pos = s->b_pos,
                           .logits = s->solo ? s->b_logits : NULL };
    kvs_err e = kvs_st_forward(s, &b, s->y);
    if (e == KVS_ERR_NUMERIC) {
        if ((n = kvs_st_keep_finite_rows(s, n, s->solo, "decode forward")) == 0) return;
    } else if (e) {
        char msg[128];
        snprintf(msg, sizeof msg, "decode forward failed: %s", kvs_strerror(e));
        for (int32_t k = 0; k < n; k++) kvs_st_head_abort(s, kvs_st_seq_find(s, s->b_req[k]), s->b_req[k], e, msg);
        return;
    }
    kvs_st_decode_rows_done(s, n, s->solo);
}

/* A group's rows go as batches of at most n_batch rows (the work buffers,
 * the model's batch and the successor's frame cap are sized by n_batch;
 * --seqs may exceed --batch). */
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
        if (++n == s->n_batch) {
            head_decode_rows(s, n);
            n = 0;
        }
    }
    if (n > 0) head_decode_rows(s, n);
}

void kvs_st_head_send_live(struct kvs_stage *s)
{
    uint8_t *p = s->sbuf + KVS_PROTO_HEADER_BYTES;
    uint32_t n = 0;
    for (int32_t i = 0; i < s->n_seq && n < KVS_PROTO_MAX_LIVE; i++)
        if (s->seqs[i].used && !s->seqs[i].held) kvs_proto_put_u32(p + 4 * (size_t)n++, s->seqs[i].req);
    struct kvs_frame_header h = { .kind = KVS_FRAME_KEEPALIVE, .flags = KVS_FRAME_FLAG_LIVE, .n_tokens = n,
                                  .payload_len = 4 * n };
    kvs_st_send_built(s, &h);
}

void kvs_st_head_unready(struct kvs_stage *s)
{
    s->probe_min = s->probe_no + 1;
    s->probe_back = 0;
    s->progress = 0;
    kvs_st_met_update(s);
}

void kvs_st_head_decode(struct kvs_stage *s)
{
    if (s->drain_since) return; /* a planned leave drains (§5.2): tokens that come back wait */
    int32_t G = s->p.decode_groups > 0 ? s->p.decode_groups : 1;
    if (G > s->n_seq) G = s->n_seq;
    for (int32_t g = 0; g < G; g++)
        if (group_ready(s, g, G)) head_decode_group(s, g, G);
}

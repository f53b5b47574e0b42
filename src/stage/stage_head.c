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
    s->progress = kvs_link_now_ms();
    struct seq *q = kvs_st_seq_find(s, req_id);
    if (!q) return; /* cancelled or failed meanwhile */
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
    kvs_st_met_add(s, &s->met.requests_started, 1);
    if (!kvs_st_send_built(s, &h)) {
        kvs_st_head_end(s, q, KVS_ERR_PEER, 0, "the ring is not complete (successor link down)");
        return;
    }
    int32_t slot = kvs_st_seq_slot(s, q);
    for (uint32_t c = 0; c < n; c += (uint32_t)s->n_batch) {
        uint32_t cnt = n - c < (uint32_t)s->n_batch ? n - c : (uint32_t)s->n_batch;
        for (uint32_t i = 0; i < cnt; i++) {
            s->b_seq[i] = slot;
            s->b_pos[i] = (int32_t)(c + i);
        }
        struct kvs_batch b = { .n_tokens = (int32_t)cnt, .token = w->prompt + c, .seq = s->b_seq,
                               .pos = s->b_pos };
        kvs_err e = kvs_st_forward(s, &b, s->y);
        if (e) {
            char msg[128];
            snprintf(msg, sizeof msg, "forward on the prompt failed: %s", kvs_strerror(e));
            kvs_st_head_abort(s, q, w->req, e, msg);
            return;
        }
        kvs_st_met_add(s, &s->met.prefill_tokens, cnt);
        bool last = c + cnt == n;
        size_t bytes = kvs_proto_put_boundary(s->sbuf + KVS_PROTO_HEADER_BYTES, s->y, (size_t)cnt * s->n_embd,
                                              s->p.boundary_f32);
        struct kvs_frame_header ph = { .kind = KVS_FRAME_PREFILL,
                                       .flags = (uint8_t)((last ? KVS_FRAME_FLAG_LAST : 0) |
                                                          (s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0)),
                                       .req = w->req, .pos = c, .n_tokens = cnt, .payload_len = (uint32_t)bytes };
        if (!kvs_st_send_built(s, &ph)) return; /* out_lost failed every request */
    }
}

void kvs_st_free_queued(struct queued *w)
{
    if (!w) return;
    free(w->prompt);
    free(w);
}

void kvs_st_head_admit(struct kvs_stage *s)
{
    for (;;) {
        struct queued *w = NULL;
        uint32_t cancel = 0;
        pthread_mutex_lock(&s->mu);
        if (s->n_cancels) {
            cancel = s->cancels[--s->n_cancels];
        } else if (s->n_queue && kvs_st_n_active(s) < s->n_seq) {
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

void kvs_st_head_decode(struct kvs_stage *s)
{
    int32_t G = s->p.decode_groups > 0 ? s->p.decode_groups : 1;
    if (G > s->n_seq) G = s->n_seq;
    for (int32_t g = 0; g < G; g++)
        if (group_ready(s, g, G)) head_decode_group(s, g, G);
}

/* The tail (docs/PROTOCOL.md §3.5): sampling a token from the logits and
 * sending it to the head as a TOKEN frame. */
#include "stage/stage_impl.h"

#include <stdio.h>
#include <string.h>

/* Tail: REQUEST_START for q (its slot already taken): the sampler with the
 * request's parameters, fed the prompt's n ids (at `prompt`, i32 LE), and the
 * request's limits. A refused parameter fails the request. */
void kvs_st_tail_begin(struct kvs_stage *s, struct seq *q, const struct kvs_req_params *rp, uint32_t n,
                       const uint8_t *prompt)
{
    struct kvs_sampler_params sp = { .temp = rp->temp, .top_k = rp->top_k, .top_p = rp->top_p, .min_p = rp->min_p,
                                     .repeat_penalty = rp->repeat_penalty, .repeat_last_n = rp->repeat_last_n,
                                     .seed = rp->seed };
    kvs_err se = kvs_sampler_create(&sp, (int32_t)s->n_vocab, &q->smp);
    if (se) {
        char smsg[256];
        snprintf(smsg, sizeof smsg,
                 "sampling parameters refused (temp %g, top_p %g, min_p %g, repeat_penalty %g, "
                 "repeat_last_n %d): %s",
                 (double)sp.temp, (double)sp.top_p, (double)sp.min_p, (double)sp.repeat_penalty,
                 (int)sp.repeat_last_n, kvs_strerror(se));
        kvs_st_fail_req(s, q, q->req, se, smsg);
        return;
    }
    for (uint32_t i = 0; i < n; i++) kvs_sampler_accept(q->smp, kvs_proto_get_i32(prompt + 4 * i));
    q->rp = *rp; /* kept for a handover (§5.2): a replacement makes the same sampler */
    q->max_tokens = rp->max_tokens ? rp->max_tokens : 1;
    q->ignore_eos = rp->ignore_eos;
    q->n_stop = rp->n_stop;
    memcpy(q->stop, rp->stop, sizeof q->stop);
}

/* Tail: sample from logits for request q whose token will sit at pos; send TOKEN. */
void kvs_st_tail_sample(struct kvs_stage *s, struct seq *q, const float *logits, int32_t pos)
{
    /* The draw is U(seed, pos) (docs/PROTOCOL.md §3.5.1): the frame's position, not a count of
     * what this tail has seen, so a replayed request draws the same token here. */
    int32_t id = kvs_sampler_sample_at(q->smp, logits, pos >= 0 ? (uint64_t)pos : 0);
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
    if (!s->solo) kvs_st_met_add(s, &s->met.tokens_generated, 1); /* solo: counted once, by head_token */
    struct kvs_token_msg tm = { .token = id, .finish = finish };
    if (s->solo) { /* a one-stage ring: the head is this stage */
        if (finish) q->finished = true;
        kvs_st_head_token(s, q->req, (uint32_t)pos, tm);
        return;
    }
    kvs_proto_put_token(s->sbuf + KVS_PROTO_HEADER_BYTES, &tm);
    struct kvs_frame_header h = { .kind = KVS_FRAME_TOKEN, .flags = finish ? KVS_FRAME_FLAG_FINISHED : 0,
                                  .req = q->req, .pos = (uint32_t)pos, .n_tokens = 1,
                                  .payload_len = KVS_PROTO_TOKEN_BYTES };
    if (finish) q->finished = true;
    kvs_st_send_built(s, &h);
}

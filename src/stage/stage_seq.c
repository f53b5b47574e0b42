/* The sequence table and the data path of a window (docs/PROTOCOL.md §3):
 * REQUEST_START, PREFILL and DECODE through this stage's blocks, END /
 * CANCEL and ERROR frames on a stage that is not the head. */
#include "stage/stage_impl.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels.h"

int32_t kvs_st_n_active(const struct kvs_stage *s)
{
    int32_t n = 0;
    for (int32_t i = 0; i < s->n_seq; i++) n += s->seqs[i].used;
    return n;
}

struct seq *kvs_st_seq_find(struct kvs_stage *s, uint32_t req)
{
    for (int32_t i = 0; i < s->n_seq; i++)
        if (s->seqs[i].used && s->seqs[i].req == req) return &s->seqs[i];
    return NULL;
}

int32_t kvs_st_seq_slot(const struct kvs_stage *s, const struct seq *q)
{
    return (int32_t)(q - s->seqs);
}

struct seq *kvs_st_seq_alloc(struct kvs_stage *s, uint32_t req)
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

void kvs_st_seq_free(struct kvs_stage *s, struct seq *q)
{
    kvs_sampler_free(q->smp);
    kvs_model_seq_clear(s->m, kvs_st_seq_slot(s, q));
    memset(q, 0, sizeof *q);
}

/* Fails request q on a non-head stage: free the slot, tell the head. */
void kvs_st_fail_req(struct kvs_stage *s, struct seq *q, uint32_t req, kvs_err e, const char *msg)
{
    KVS_LOGW("request %u failed on stage [%d,%d): %s", req, (int)s->begin, (int)s->end, msg);
    if (q) kvs_st_seq_free(s, q);
    kvs_st_send_error(s, req, e, msg);
}

void kvs_st_on_request_start(struct kvs_stage *s, const struct kvs_frame *f)
{
    uint32_t req = f->h.req;
    struct kvs_req_params rp;
    const uint8_t *prompt;
    kvs_proto_get_req(f, &rp, &prompt);
    if ((f->h.flags & KVS_FRAME_FLAG_REPLAY) && kvs_st_seq_find(s, req))
        kvs_st_seq_free(s, kvs_st_seq_find(s, req)); /* a replay (§5.1): the old slot is stale */
    if (kvs_st_seq_find(s, req)) {
        kvs_st_fail_req(s, NULL, req, KVS_ERR_FORMAT, "duplicate request id");
        return;
    }
    char msg[160];
    if (f->h.n_tokens >= (uint32_t)s->n_ctx) {
        snprintf(msg, sizeof msg, "prompt of %u tokens does not fit n_ctx %d", f->h.n_tokens, (int)s->n_ctx);
        kvs_st_fail_req(s, NULL, req, KVS_ERR_RANGE, msg);
        return;
    }
    struct seq *q = kvs_st_seq_alloc(s, req);
    if (!q) {
        snprintf(msg, sizeof msg, "no free sequence slot on stage [%d,%d) (%d slots)", (int)s->begin,
                 (int)s->end, (int)s->n_seq);
        kvs_st_fail_req(s, NULL, req, KVS_ERR_FULL, msg);
        return;
    }
    if (s->is_tail) {
        kvs_st_tail_begin(s, q, &rp, f->h.n_tokens, prompt);
        return; /* the tail's successor is the head: nothing to forward */
    }
    /* forward unchanged */
    memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    struct kvs_frame_header h = f->h;
    kvs_st_send_built(s, &h);
}

void kvs_st_on_prefill(struct kvs_stage *s, const struct kvs_frame *f)
{
    uint32_t req = f->h.req, n = f->h.n_tokens;
    struct seq *q = kvs_st_seq_find(s, req);
    if (!q || q->finished) return; /* ended or failed here: drop */
    char msg[160];
    if (n > (uint32_t)s->n_batch) {
        snprintf(msg, sizeof msg, "PREFILL of %u rows exceeds n_batch %d", n, (int)s->n_batch);
        kvs_st_fail_req(s, q, req, KVS_ERR_RANGE, msg);
        return;
    }
    int32_t slot = kvs_st_seq_slot(s, q);
    if ((int32_t)f->h.pos != kvs_model_seq_len(s->m, slot) || f->h.pos + n > (uint32_t)s->n_ctx) {
        snprintf(msg, sizeof msg, "PREFILL at position %u does not continue the sequence (%d cached)", f->h.pos,
                 (int)kvs_model_seq_len(s->m, slot));
        kvs_st_fail_req(s, q, req, KVS_ERR_RANGE, msg);
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
    kvs_err e = kvs_st_forward(s, &b, s->y);
    if (e) {
        snprintf(msg, sizeof msg, "forward on PREFILL failed: %s", kvs_strerror(e));
        kvs_st_fail_req(s, q, req, e, msg);
        return;
    }
    kvs_st_met_add(s, &s->met.prefill_tokens, n);
    if (s->is_tail) {
        if (last) kvs_st_tail_sample(s, q, s->y, (int32_t)(f->h.pos + n));
        return;
    }
    size_t bytes = kvs_proto_put_boundary(s->sbuf + KVS_PROTO_HEADER_BYTES, s->y, (size_t)n * s->n_embd,
                                          s->p.boundary_f32);
    struct kvs_frame_header h = { .kind = KVS_FRAME_PREFILL,
                                  .flags = (uint8_t)((last ? KVS_FRAME_FLAG_LAST : 0) |
                                                     (s->p.boundary_f32 ? KVS_FRAME_FLAG_F32 : 0)),
                                  .req = req, .pos = f->h.pos, .n_tokens = n, .payload_len = (uint32_t)bytes };
    kvs_st_send_built(s, &h);
}

/* The n decode rows in s->b_req / s->b_pos went through this stage's window
 * and their outputs lie in s->y: sample them here (the tail, or a one-stage
 * ring: s->y holds n rows of logits) or send them onward as one DECODE frame
 * (docs/PROTOCOL.md §3.4: per row req u32, pos u32, then the boundary rows). */
void kvs_st_decode_rows_done(struct kvs_stage *s, int32_t n, bool sample_here)
{
    kvs_st_met_add(s, &s->met.decode_rows, (uint64_t)n);
    if (sample_here) {
        for (int32_t k = 0; k < n; k++) {
            struct seq *q = kvs_st_seq_find(s, s->b_req[k]);
            if (q) kvs_st_tail_sample(s, q, s->y + (size_t)k * s->n_vocab, s->b_pos[k] + 1);
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
    kvs_st_send_built(s, &h);
}

/* After a batched forward that reported KVS_ERR_NUMERIC: fails only the rows
 * whose output (n_vocab logits when `logits`, else n_embd boundary values)
 * has a NaN or infinity, and packs the other rows (b_req, b_pos, b_seq and
 * their rows of y) to the front. One sequence pushed out of range must not
 * fail the requests batched with it. Returns the rows left. */
int32_t kvs_st_keep_finite_rows(struct kvs_stage *s, int32_t n, bool logits, const char *what)
{
    const size_t w = logits ? (size_t)s->n_vocab : (size_t)s->n_embd;
    int32_t kept = 0;
    for (int32_t k = 0; k < n; k++) {
        const float *row = s->y + (size_t)k * w;
        if (!kvs_vec_all_finite(row, w)) {
            char msg[160];
            snprintf(msg, sizeof msg, "%s: %s", what, kvs_strerror(KVS_ERR_NUMERIC));
            struct seq *q = kvs_st_seq_find(s, s->b_req[k]);
            if (s->is_head) {
                kvs_st_head_abort(s, q, s->b_req[k], KVS_ERR_NUMERIC, msg);
            } else {
                kvs_st_fail_req(s, q, s->b_req[k], KVS_ERR_NUMERIC, msg);
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

void kvs_st_on_decode(struct kvs_stage *s, const struct kvs_frame *f)
{
    bool f32 = f->h.flags & KVS_FRAME_FLAG_F32;
    const uint8_t *bnd = kvs_proto_boundary(f);
    size_t row_bytes = (size_t)s->n_embd * (f32 ? 4 : 2);
    int32_t n = 0;
    for (uint32_t i = 0; i < f->h.n_tokens; i++) {
        uint32_t req, pos;
        kvs_proto_get_decode_row(f, i, &req, &pos);
        struct seq *q = kvs_st_seq_find(s, req);
        if (!q || q->finished) continue;
        int32_t slot = kvs_st_seq_slot(s, q);
        bool dup = false;
        for (int32_t k = 0; k < n; k++) dup |= s->b_seq[k] == slot;
        if (n >= s->n_batch) { /* the work buffers and the model's batch hold n_batch rows */
            char msg[160];
            snprintf(msg, sizeof msg, "DECODE of %u rows exceeds n_batch %d of stage [%d,%d)", f->h.n_tokens,
                     (int)s->n_batch, (int)s->begin, (int)s->end);
            kvs_st_fail_req(s, q, req, KVS_ERR_RANGE, msg);
            continue;
        }
        if (dup || n >= s->n_seq || (int32_t)pos != kvs_model_seq_len(s->m, slot) || pos >= (uint32_t)s->n_ctx) {
            char msg[160];
            snprintf(msg, sizeof msg, "DECODE row at position %u does not continue the sequence (%d cached)", pos,
                     (int)kvs_model_seq_len(s->m, slot));
            kvs_st_fail_req(s, q, req, KVS_ERR_RANGE, msg);
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
    kvs_err e = kvs_st_forward(s, &b, s->y);
    if (e == KVS_ERR_NUMERIC) {
        if ((n = kvs_st_keep_finite_rows(s, n, s->is_tail, "forward on DECODE")) == 0) return;
    } else if (e) {
        char msg[160];
        snprintf(msg, sizeof msg, "forward on DECODE failed: %s", kvs_strerror(e));
        for (int32_t k = 0; k < n; k++) kvs_st_fail_req(s, kvs_st_seq_find(s, s->b_req[k]), s->b_req[k], e, msg);
        return;
    }
    kvs_st_decode_rows_done(s, n, s->is_tail);
}

void kvs_st_on_end(struct kvs_stage *s, const struct kvs_frame *f)
{
    struct seq *q = kvs_st_seq_find(s, f->h.req);
    if (s->is_head) { /* came back round: every stage has freed it */
        if (q) kvs_st_head_end(s, q, KVS_ERR_CANCELLED, 0, "request ended by the ring");
        return;
    }
    if (q) kvs_st_seq_free(s, q);
    struct kvs_frame_header h = f->h;
    kvs_st_send_built(s, &h);
}

void kvs_st_on_error(struct kvs_stage *s, const struct kvs_frame *f)
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
            if (kvs_st_n_active(s) > 0) KVS_LOGW("ring error: %s", msg);
            else KVS_LOGI("ring error (no request in flight): %s", msg);
            kvs_st_drop_all(s, e, msg);
        } else {
            struct seq *q = kvs_st_seq_find(s, f->h.req);
            if (q) kvs_st_head_abort(s, q, f->h.req, e, msg);
        }
        return;
    }
    if (f->h.req == 0) kvs_st_drop_all(s, e, msg);
    else if (kvs_st_seq_find(s, f->h.req)) kvs_st_seq_free(s, kvs_st_seq_find(s, f->h.req));
    memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    struct kvs_frame_header h = f->h;
    kvs_st_send_built(s, &h);
}

void kvs_st_on_live(struct kvs_stage *s, const struct kvs_frame *f)
{
    if (s->is_head) return; /* the head's own set: the tail does not forward it */
    int32_t freed = 0;
    for (int32_t i = 0; i < s->n_seq; i++) {
        struct seq *q = &s->seqs[i];
        if (!q->used) continue;
        bool live = false;
        for (uint32_t k = 0; k < f->h.n_tokens && !live; k++) live = kvs_proto_get_u32(f->payload + 4 * k) == q->req;
        if (!live) {
            KVS_LOGD("stage [%d,%d): request %u is not live on the head: slot %d freed", (int)s->begin, (int)s->end,
                     q->req, (int)i);
            kvs_st_seq_free(s, q);
            freed++;
        }
    }
    if (freed) {
        KVS_LOGI("stage [%d,%d): freed %d sequence slot%s of requests the head no longer holds", (int)s->begin,
                 (int)s->end, (int)freed, freed == 1 ? "" : "s");
        kvs_st_met_update(s);
    }
    if (s->is_tail) return;
    if (f->h.payload_len) memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    struct kvs_frame_header h = f->h;
    kvs_st_send_built(s, &h);
}

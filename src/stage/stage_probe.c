/* Ring probes (docs/PROTOCOL.md §3.8, §3.8.1): keepalive probes, the trail
 * every stage appends to, and the head's copy of the last trail. */
#include "stage/stage_impl.h"

#include <pthread.h>
#include <string.h>

#include "common/log.h"

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
void kvs_st_send_probe(struct kvs_stage *s, uint32_t probe_no, uint32_t n, uint64_t t_recv)
{
    uint8_t *p = s->sbuf + KVS_PROTO_HEADER_BYTES;
    if (n < KVS_PROTO_MAX_TRAIL) {
        struct kvs_trail_rec r;
        trail_rec(s, &r, t_recv);
        /* the record counts the probe itself in bytes_out: every stage alike */
        r.bytes_out += KVS_PROTO_HEADER_BYTES + (uint64_t)(n + 1) * KVS_PROTO_TRAIL_REC_BYTES;
        r.t_send_us = kvs_st_wall_us();
        if (!t_recv) r.t_recv_us = r.t_send_us;
        kvs_proto_put_trail_rec(p + (size_t)n * KVS_PROTO_TRAIL_REC_BYTES, &r);
        n++;
    }
    struct kvs_frame_header h = { .kind = KVS_FRAME_KEEPALIVE, .flags = KVS_FRAME_FLAG_PROBE | KVS_FRAME_FLAG_TRAIL,
                                  .pos = probe_no, .n_tokens = n,
                                  .payload_len = n * KVS_PROTO_TRAIL_REC_BYTES };
    kvs_st_send_built(s, &h);
}

/* a - b in milliseconds for two wire timestamps (µs), without the signed
 * overflow a cast and a subtraction would have */
static double diff_ms(uint64_t a, uint64_t b)
{
    return a >= b ? (double)(a - b) / 1000.0 : -(double)(b - a) / 1000.0;
}

#define TRAIL_SKEW_US (86400ull * 1000000ull) /* a record's clock may differ from the head's by a day */


bool kvs_st_trail_valid(const struct kvs_frame *f, uint64_t t_back, uint32_t n_block, int32_t begin, int32_t end,
                        uint32_t *bad, struct kvs_trail_rec *bad_rec)
{
    struct kvs_trail_rec r;
    for (uint32_t i = 0; i < f->h.n_tokens; i++) {
        kvs_proto_get_trail_rec(f, i, &r);
        bool ok = r.block_begin < r.block_end && r.block_end <= n_block && r.t_recv_us <= r.t_send_us &&
                  r.t_send_us <= t_back + TRAIL_SKEW_US && t_back <= r.t_recv_us + TRAIL_SKEW_US &&
                  (i > 0 || (r.block_begin == (uint32_t)begin && r.block_end == (uint32_t)end &&
                             r.t_send_us <= t_back));
        if (!ok) {
            if (bad) *bad = i;
            if (bad_rec) *bad_rec = r;
            return false;
        }
    }
    return true;
}

int kvs_st_trail_hops(const struct kvs_frame *f, uint64_t t_back, struct kvs_stage_hop *out, double *rtt_ms)
{
    uint32_t n = f->h.n_tokens;
    struct kvs_trail_rec r, nx;
    for (uint32_t i = 0; i < n && i < KVS_PROTO_MAX_TRAIL; i++) {
        kvs_proto_get_trail_rec(f, i, &r);
        uint64_t next_recv = t_back;
        if (i + 1 < n) {
            kvs_proto_get_trail_rec(f, i + 1, &nx);
            next_recv = nx.t_recv_us;
        }
        out[i] = (struct kvs_stage_hop){ .block_begin = (int32_t)r.block_begin, .block_end = (int32_t)r.block_end,
                                         .forward_calls = r.forward_calls,
                                         .forward_ms = (double)r.forward_us / 1000.0, .rows = r.rows,
                                         .bytes_out = r.bytes_out, .residence_ms = diff_ms(r.t_send_us, r.t_recv_us),
                                         .hop_ms = diff_ms(next_recv, r.t_send_us) };
        if (i == 0 && rtt_ms) *rtt_ms = diff_ms(t_back, r.t_send_us);
    }
    return n < KVS_PROTO_MAX_TRAIL ? (int)n : (int)KVS_PROTO_MAX_TRAIL;
}

/* Head: a TRAIL probe came back: keep its per-stage figures, if it passes
 * kvs_st_trail_valid (a trail that fails is dropped whole). */
static void head_take_trail(struct kvs_stage *s, const struct kvs_frame *f, uint64_t t_back)
{
    uint32_t bad = 0;
    struct kvs_trail_rec r;
    if (!kvs_st_trail_valid(f, t_back, s->hp.n_block, s->begin, s->end, &bad, &r)) {
        kvs_st_met_add(s, &s->met.frames_rejected, 1);
        if (kvs_st_refusal_log_ok(s))
            KVS_LOGW("dropping a probe trail: record %u ([%u,%u), t_recv %llu, t_send %llu us) is not valid", bad,
                     r.block_begin, r.block_end, (unsigned long long)r.t_recv_us, (unsigned long long)r.t_send_us);
        return;
    }
    pthread_mutex_lock(&s->mu);
    s->n_hops = kvs_st_trail_hops(f, t_back, s->hops, &s->probe_rtt_ms);
    pthread_mutex_unlock(&s->mu);
}

void kvs_st_on_keepalive(struct kvs_stage *s, const struct kvs_frame *f)
{
    if (f->h.flags & KVS_FRAME_FLAG_LIVE) {
        kvs_st_on_live(s, f);
        return;
    }
    if (!(f->h.flags & KVS_FRAME_FLAG_PROBE)) return;
    uint64_t now = kvs_st_wall_us();
    if (s->is_head) {
        /* Any of the last PROBE_ACCEPT probes counts: while the ring is not
         * known closed they go out every PROBE_UNREADY_MS, faster than a ring
         * with a longer round trip (a relay, a busy stage) brings one back. */
        /* ... and only one sent after the last fault (probe_min, kvs_st_head_unready):
         * an older one may have passed the ring before it broke */
        if ((uint32_t)(s->probe_no - f->h.pos) < PROBE_ACCEPT && (int32_t)(f->h.pos - s->probe_min) >= 0) {
            s->probe_min = f->h.pos;
            s->probe_back = kvs_link_now_ms();
            if (f->h.flags & KVS_FRAME_FLAG_TRAIL) head_take_trail(s, f, now);
            kvs_st_head_probe_back(s, f->h.pos);
        }
        kvs_st_met_update(s);
        return;
    }
    if (!(f->h.flags & KVS_FRAME_FLAG_TRAIL)) {
        kvs_st_send_simple(s, KVS_FRAME_KEEPALIVE, KVS_FRAME_FLAG_PROBE, 0, f->h.pos);
        return;
    }
    if (f->h.payload_len) memcpy(s->sbuf + KVS_PROTO_HEADER_BYTES, f->payload, f->h.payload_len);
    kvs_st_send_probe(s, f->h.pos, f->h.n_tokens, now);
}

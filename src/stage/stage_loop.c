/* The stage loop (docs/PROTOCOL.md §3-§5): poll, dispatch of frames from the
 * predecessor, timers (handshake, silence, keepalive, probes, stall), the
 * goodbye, and the forward call with its metrics. */
#include "stage/stage_impl.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

void kvs_st_met_add(struct kvs_stage *s, uint64_t *field, uint64_t v)
{
    pthread_mutex_lock(&s->mu);
    *field += v;
    pthread_mutex_unlock(&s->mu);
}

void kvs_st_met_update(struct kvs_stage *s)
{
    pthread_mutex_lock(&s->mu);
    s->met.n_active = kvs_st_n_active(s);
    s->met.n_queued = s->n_queue;
    s->met.ring_holding = s->is_head && s->hold_since != 0;
    s->met.n_held = 0;
    for (int32_t i = 0; i < s->n_seq; i++) s->met.n_held += s->seqs[i].used && s->seqs[i].held;
    s->met.in_up = s->in != NULL;
    s->met.out_up = s->out_state == OUT_UP;
    int64_t now = kvs_link_now_ms();
    s->met.ring_ready = s->solo ||
                        (s->met.in_up && s->met.out_up &&
                        (!s->is_head || (!s->hold_since && s->probe_back && (now - s->probe_back < s->p.timeout_ms ||
                                                           now - s->progress < s->p.timeout_ms))));
    pthread_mutex_unlock(&s->mu);
    pthread_cond_broadcast(&s->cv);
}

static uint64_t mono_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* Wall clock (trail timestamps, §3.8.1), microseconds since the epoch. */
uint64_t kvs_st_wall_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

kvs_err kvs_st_forward(struct kvs_stage *s, const struct kvs_batch *b, float *out)
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

/* A frame from the predecessor. Returns false if the link must close. */
static bool dispatch(struct kvs_stage *s, const struct kvs_frame *f, char *why, size_t cap)
{
    switch ((enum kvs_frame_kind)f->h.kind) {
    case KVS_FRAME_REQUEST_START:
        if (s->is_head) break;
        kvs_st_on_request_start(s, f);
        return true;
    case KVS_FRAME_PREFILL:
        if (s->is_head) break;
        kvs_st_on_prefill(s, f);
        return true;
    case KVS_FRAME_DECODE:
        if (s->is_head) break;
        kvs_st_on_decode(s, f);
        return true;
    case KVS_FRAME_TOKEN:
        if (!s->is_head) break;
        kvs_st_on_token(s, f);
        return true;
    case KVS_FRAME_END:
    case KVS_FRAME_CANCEL:
        kvs_st_on_end(s, f);
        return true;
    case KVS_FRAME_ERROR:
        kvs_st_on_error(s, f);
        return true;
    case KVS_FRAME_KEEPALIVE:
        kvs_st_on_keepalive(s, f);
        return true;
    case KVS_FRAME_LEAVE:
        kvs_st_on_leave(s, f);
        return true;
    case KVS_FRAME_HELLO:
    case KVS_FRAME_KIND_COUNT_:
        break;
    }
    snprintf(why, cap, "unexpected %s frame on the %s", kvs_frame_kind_name(f->h.kind),
             s->is_head ? "head" : "stage");
    return false;
}

void kvs_st_in_read(struct kvs_stage *s)
{
    size_t got;
    /* after the drain mark of a planned leave (§5.2) nothing more is read: it is the replacement's */
    for (int rounds = 0; rounds < 64 && s->in && s->leave_state != LEAVE_DONE; rounds++) {
        kvs_err e = kvs_link_read(s->in, s->rbuf, READ_CHUNK, &got);
        if (e == KVS_ERR_NEED_MORE) return;
        if (e) {
            kvs_st_in_lost(s, e == KVS_ERR_PEER ? "closed by the far end" : "read error");
            return;
        }
        s->in_last_read = kvs_link_now_ms();
        kvs_st_met_add(s, &s->met.bytes_in, got);
        size_t off = 0;
        while (off < got && s->in && s->leave_state != LEAVE_DONE) {
            size_t used;
            e = kvs_proto_decoder_feed(s->in_dec, s->rbuf + off, got - off, &used);
            off += used;
            if (e == KVS_ERR_NEED_MORE) break;
            char why[300];
            if (e) {
                snprintf(why, sizeof why, "bad frame: %s", kvs_proto_decoder_error(s->in_dec));
                kvs_st_met_add(s, &s->met.frames_rejected, 1);
                kvs_st_refuse(s->in, e, why);
                kvs_st_in_lost(s, why);
                return;
            }
            if (!dispatch(s, kvs_proto_decoder_frame(s->in_dec), why, sizeof why)) {
                kvs_st_met_add(s, &s->met.frames_rejected, 1);
                kvs_st_in_lost(s, why);
                return;
            }
        }
        if (got < READ_CHUNK) return;
    }
}

/* Bytes are waiting on the in link: whatever kept this loop busy (a long
 * forward on an oversubscribed machine), the predecessor is not silent. */
static bool in_pending(struct kvs_stage *s)
{
    if (!s->in) return false;
    struct pollfd pf = { .fd = kvs_link_fd(s->in), .events = POLLIN };
    return poll(&pf, 1, 0) > 0;
}

/* Takes a successor address set by kvs_stage_set_next: the link to the old
 * successor is closed (requests in flight through it fail as on a lost link)
 * and the new one is dialled at once. */
static void apply_next(struct kvs_stage *s)
{
    char nx[sizeof s->new_next];
    uint8_t nk[KVS_KEY_PUB_BYTES], pk[KVS_KEY_PUB_BYTES];
    pthread_mutex_lock(&s->mu);
    bool changed = s->next_changed, nk_changed = s->next_key_changed, pk_changed = s->prev_key_changed;
    if (changed) memcpy(nx, s->new_next, sizeof nx);
    if (nk_changed) memcpy(nk, s->new_next_key, sizeof nk);
    if (pk_changed) memcpy(pk, s->new_prev_key, sizeof pk);
    if (changed || nk_changed) {
        s->out_refusal_code = KVS_OK;
        s->out_refusal[0] = '\0';
    }
    s->next_changed = s->next_key_changed = s->prev_key_changed = false;
    pthread_mutex_unlock(&s->mu);
    if (pk_changed && memcmp(pk, s->p.prev_key, sizeof pk)) {
        char f0[KVS_KEY_FP_HEX + 1], f1[KVS_KEY_FP_HEX + 1];
        kvs_key_fingerprint(s->p.prev_key, f0);
        kvs_key_fingerprint(pk, f1);
        KVS_LOGI("stage [%d,%d): the predecessor's key is now %s (was %s)", (int)s->begin, (int)s->end, f1, f0);
        memcpy(s->p.prev_key, pk, sizeof pk);
        s->p.has_prev_key = true;
        uint8_t peer[KVS_KEY_PUB_BYTES];
        if (s->in && (!kvs_tls_peer_key(s->in, peer) || memcmp(peer, pk, sizeof pk)))
            kvs_st_in_lost(s, "the predecessor changed");
        for (int i = 0; i < MAX_PENDING_LINKS; i++) /* wrapped expecting the old key */
            if (s->pend[i].l) kvs_st_pend_close(&s->pend[i]);
    }
    bool key_moved = nk_changed && memcmp(nk, s->p.next_key, sizeof nk);
    if (key_moved) {
        memcpy(s->p.next_key, nk, sizeof nk);
        s->p.has_next_key = true;
    }
    char tok[KVS_RELAY_TOKEN_HEX + 1] = "";
    if (changed) kvs_st_cut_token(nx, tok); /* compared and logged without its edge token */
    bool addr_moved = changed && (strcmp(nx, s->next_addr) || strcmp(tok, s->next_token));
    if (!addr_moved && !key_moved) return;
    if (addr_moved) {
        KVS_LOGI("stage [%d,%d): successor moves from %s to %s", (int)s->begin, (int)s->end, s->next_addr, nx);
    } else {
        char f1[KVS_KEY_FP_HEX + 1];
        kvs_key_fingerprint(nk, f1);
        KVS_LOGI("stage [%d,%d): the successor's key is now %s", (int)s->begin, (int)s->end, f1);
    }
    if (s->out) kvs_st_out_lost(s, "the successor moved");
    if (addr_moved) {
        snprintf(s->next_addr, sizeof s->next_addr, "%s", nx);
        memcpy(s->next_token, tok, sizeof tok);
        s->p.next = s->next_addr;
    }
    s->out_attempt = 0;
    s->out_refused = 0;
    s->out_warned = false;
    s->out_next_dial = kvs_link_now_ms();
}

static void timers(struct kvs_stage *s)
{
    apply_next(s);
    int64_t now = kvs_link_now_ms();
    for (int i = 0; i < MAX_PENDING_LINKS; i++)
        if (s->pend[i].l && !s->pend[i].relay && now - s->pend[i].since > HANDSHAKE_MS) {
            if (kvs_st_refusal_log_ok(s))
                KVS_LOGW("closing link from %s: no HELLO within %d ms", s->pend[i].l->peer, HANDSHAKE_MS);
            kvs_st_pend_close(&s->pend[i]);
        }
    if (s->in && now - s->in_last_read > s->p.timeout_ms && !in_pending(s)) {
        char why[64];
        snprintf(why, sizeof why, "silent for %d ms", (int)(now - s->in_last_read));
        kvs_st_in_lost(s, why);
    }
    if (s->out_state == OUT_DOWN && now >= s->out_next_dial && !s->solo) kvs_st_dial_next(s);
    if (s->in_relay && !s->solo) kvs_st_dial_in(s);
    if (s->out_state == OUT_HANDSHAKE && now - s->out_since > HANDSHAKE_MS) kvs_st_out_lost(s, "no HELLO reply");
    if (s->out_state == OUT_UP) {
        /* Until the ring is known closed, a probe sent while a later link was
         * still down is lost: probe again soon instead of after keepalive_ms
         * (that wait was up to a second before the first request could go). */
        const int64_t every = s->drain_since                         ? LEAVE_PROBE_MS
                              : s->met.ring_ready && !s->hold_since ? s->p.keepalive_ms
                                                                    : PROBE_UNREADY_MS;
        if (s->is_head && now - s->probe_sent >= every) {
            s->probe_no++;
            s->probe_sent = now;
            if (now - s->live_sent >= s->p.keepalive_ms) { /* stages free slots of requests ended here (§3.8.2) */
                s->live_sent = now;
                kvs_st_head_send_live(s);
            }
            if (s->out_state == OUT_UP) kvs_st_send_probe(s, s->probe_no, 0, 0);
        } else if (now - s->out_last_write >= s->p.keepalive_ms) {
            kvs_st_send_simple(s, KVS_FRAME_KEEPALIVE, 0, 0, 0);
        }
    }
    /* Probes queue behind the frames every stage is computing: a busy ring
     * (long prefills, an oversubscribed machine) delays them without being
     * stalled. Stalled = neither a probe nor a token came back. */
    if (s->is_head && kvs_st_head_n_live(s) > 0 && s->probe_back && now - s->probe_back > s->p.timeout_ms &&
        now - s->progress > s->p.timeout_ms && !in_pending(s)) {
        char msg[128];
        snprintf(msg, sizeof msg, "ring stalled: no probe came back for %d ms", (int)(now - s->probe_back));
        KVS_LOGW("%s", msg);
        kvs_st_drop_all(s, KVS_ERR_TIMEOUT, msg);
    }
    kvs_st_leave_timers(s);
    kvs_st_met_update(s);
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

kvs_err kvs_stage_run(struct kvs_stage *s)
{
    KVS_LOGI("stage [%d,%d) of %u blocks (ctx %d, %d seqs, %s boundaries) listening on %s (port %u), next %s%s%s",
             (int)s->begin, (int)s->end, s->hp.n_block, (int)s->n_ctx, (int)s->n_seq,
             s->p.boundary_f32 ? "f32" : "f16", s->listen_addr, kvs_stage_listen_port(s),
             s->solo ? "(none)" : s->next_addr, s->is_head ? ", head" : "", s->is_tail ? ", tail" : "");
    if (s->solo) KVS_LOGI("stage [%d,%d) holds the whole model: a one-stage ring, no links", (int)s->begin, (int)s->end);
    for (;;) {
        bool stop = false;
        struct pollfd pf[6 + MAX_PENDING_LINKS];
        int np = 0, i_in = -1, i_out = -1, i_stop = -1, i_ctl = -1, i_pend[MAX_PENDING_LINKS];
        pf[np++] = (struct pollfd){ .fd = s->wake[0], .events = POLLIN };
        pf[np++] = (struct pollfd){ .fd = s->lst ? kvs_listener_fd(s->lst) : -1, .events = POLLIN };
        if (s->p.stop_fd >= 0) {
            i_stop = np;
            pf[np++] = (struct pollfd){ .fd = s->p.stop_fd, .events = POLLIN };
        }
        if (s->p.control_fd >= 0 && !s->ctl_eof) {
            i_ctl = np;
            pf[np++] = (struct pollfd){ .fd = s->p.control_fd, .events = POLLIN };
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
        int r = poll(pf, (nfds_t)np,
                     busy                                                 ? 0
                     : s->is_head && s->drain_since                       ? LEAVE_PROBE_MS
                     : s->is_head && (!s->met.ring_ready || s->hold_since) ? PROBE_UNREADY_MS
                                                                          : 100);
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
            if (i_stop >= 0 && pf[i_stop].revents && !kvs_st_leave_begin(s)) break;
            if (pf[1].revents) kvs_st_accept_new(s);
            for (int i = 0; i < MAX_PENDING_LINKS; i++)
                if (i_pend[i] >= 0 && pf[i_pend[i]].revents && s->pend[i].l) kvs_st_pend_read(s, &s->pend[i]);
            if (i_out >= 0 && pf[i_out].revents && s->out) kvs_st_out_read(s);
            if (i_in >= 0 && pf[i_in].revents && s->in) kvs_st_in_read(s);
            if (i_ctl >= 0 && pf[i_ctl].revents) kvs_st_leave_control(s);
        }
        if (s->leave_state == LEAVE_DONE || s->leave_stop) break;
        if (s->is_head) {
            kvs_st_head_admit(s);
            kvs_st_head_decode(s);
        }
        timers(s);
        if (s->leave_stop) break;
    }
    /* a drained planned leave (§5.2): the state goes to the replacement, then the goodbye */
    if (s->leave_state == LEAVE_DONE && kvs_st_leave_write(s)) {
        KVS_LOGI("stage [%d,%d) leaving: its replacement takes over", (int)s->begin, (int)s->end);
    } else {
        KVS_LOGI("stage [%d,%d) stopping", (int)s->begin, (int)s->end);
        if (s->leave_state >= LEAVE_WAIT_DRAIN) { /* the ring expects a handover: say it is a fault */
            char msg[128];
            snprintf(msg, sizeof msg, "stage [%d,%d) left without handing its sequences over", (int)s->begin,
                     (int)s->end);
            kvs_st_send_error(s, 0, KVS_ERR_PEER, msg);
        }
    }
    say_goodbye(s);
    /* Nothing is served any more: end every request the head holds. */
    pthread_mutex_lock(&s->mu);
    s->stopped = true;
    pthread_mutex_unlock(&s->mu);
    pthread_cond_broadcast(&s->cv); /* kvs_stage_wait_ready returns */
    if (s->is_head) {
        kvs_st_drop_all(s, KVS_ERR_CANCELLED, "the head stage stopped");
        for (;;) {
            struct queued *w = NULL;
            pthread_mutex_lock(&s->mu);
            if (s->n_queue) w = s->queue[--s->n_queue];
            pthread_mutex_unlock(&s->mu);
            if (!w) break;
            struct kvs_stage_event ev = { .kind = KVS_STAGE_EVENT_ERROR, .req = w->req, .err = KVS_ERR_CANCELLED,
                                          .message = "the head stage stopped" };
            w->r.on_event(w->r.user, &ev);
            kvs_st_free_queued(w);
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

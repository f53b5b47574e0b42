/* Links (docs/PROTOCOL.md §4-§5): sending on the out link, the HELLO
 * handshake both ways, the table of pending (not yet introduced) links,
 * dialing the successor, and what a lost link does to the sequences. */
#include "stage/stage_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "common/log.h"
#include "gguf/gguf.h"
#include "shard/shard.h"

/* Sends header h with payload already at sbuf + 24. Returns false if the out
 * link is down or failed (the frame is dropped). */
bool kvs_st_send_built(struct kvs_stage *s, struct kvs_frame_header *h)
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
        kvs_st_out_lost(s, why);
        return false;
    }
    s->out_last_write = kvs_link_now_ms();
    kvs_st_met_add(s, &s->met.bytes_out, n);
    return true;
}

bool kvs_st_send_simple(struct kvs_stage *s, uint8_t kind, uint8_t flags, uint32_t req, uint32_t pos)
{
    struct kvs_frame_header h = { .kind = kind, .flags = flags, .req = req, .pos = pos };
    return kvs_st_send_built(s, &h);
}

bool kvs_st_send_error(struct kvs_stage *s, uint32_t req, kvs_err code, const char *msg)
{
    size_t n = kvs_proto_put_error(s->sbuf + KVS_PROTO_HEADER_BYTES, (uint32_t)code, msg);
    struct kvs_frame_header h = { .kind = KVS_FRAME_ERROR, .req = req, .payload_len = (uint32_t)n };
    return kvs_st_send_built(s, &h);
}

/* Writes one ERROR directly on a link being refused (best effort). */
void kvs_st_refuse(struct kvs_link *l, kvs_err code, const char *msg)
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
    m->n_batch = (uint32_t)s->n_batch;
    memcpy(m->content_id, s->cid, 32);
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
    /* Same shapes, other weights (a fine-tune, a tampered seed): refused when both ends know
     * their content id; an unknown one (all zero) is let through (its shard said UNVERIFIED). */
    static const uint8_t zero[32];
    if (s->cid_hex[0] && memcmp(o->content_id, zero, 32) && memcmp(o->content_id, s->cid, 32)) {
        char hx[65];
        kvs_shard_hex(o->content_id, hx);
        snprintf(local, lcap, "it serves other weights of this model (content id %.16s..., this stage %.16s...)", hx,
                 s->cid_hex);
        snprintf(remote, rcap, "it serves other weights of this model (content id %.16s..., this stage %.16s...)",
                 s->cid_hex, hx);
        return KVS_ERR_MISMATCH;
    }
    if (o->n_ctx != (uint32_t)s->n_ctx) {
        snprintf(local, lcap, "it has n_ctx %u, this stage %d (all stages need the same --ctx)", o->n_ctx,
                 (int)s->n_ctx);
        snprintf(remote, rcap, "it has n_ctx %d, this stage %u (all stages need the same --ctx)", (int)s->n_ctx,
                 o->n_ctx);
        return KVS_ERR_MISMATCH;
    }
    if (o->n_batch != (uint32_t)s->n_batch) {
        snprintf(local, lcap, "it has n_batch %u, this stage %d (all stages need the same --batch)", o->n_batch,
                 (int)s->n_batch);
        snprintf(remote, rcap, "it has n_batch %d, this stage %u (all stages need the same --batch)",
                 (int)s->n_batch, o->n_batch);
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

/* Every sequence is dead once a link on the data path broke. On the head
 * this is the CANCEL round of §5: its requests are held for a replay (§5.1)
 * or end, the ring counts as not ready until a probe sent after now comes
 * back, and one LIVE keepalive (§3.8.2, without these requests) makes every
 * stage it reaches free their slots, whichever frame about them was lost. */
void kvs_st_drop_all(struct kvs_stage *s, kvs_err err, const char *msg)
{
    if (s->is_head) {
        if (!s->solo) kvs_st_head_unready(s);
        kvs_st_head_fault(s, err, msg);
        if (!s->solo) kvs_st_head_send_live(s); /* dropped if the out link is down: the stages there lost a link too */
        return;
    }
    for (int32_t i = 0; i < s->n_seq; i++)
        if (s->seqs[i].used) kvs_st_seq_free(s, &s->seqs[i]);
}

bool kvs_st_refusal_log_ok(struct kvs_stage *s)
{
    int64_t now = kvs_link_now_ms();
    if (now - s->refusal_log_t0 >= REFUSAL_LOG_MS) {
        if (s->refusal_log_dropped)
            KVS_LOGW("%llu more refused or closed incoming links were not logged (at most %d lines per %d s)",
                     (unsigned long long)s->refusal_log_dropped, REFUSAL_LOG_BURST, REFUSAL_LOG_MS / 1000);
        s->refusal_log_t0 = now;
        s->refusal_log_n = 0;
        s->refusal_log_dropped = 0;
    }
    if (s->refusal_log_n < REFUSAL_LOG_BURST) {
        s->refusal_log_n++;
        return true;
    }
    s->refusal_log_dropped++;
    return false;
}

void kvs_st_in_lost(struct kvs_stage *s, const char *why)
{
    char msg[300];
    if (s->in_leaving) { /* the predecessor left on purpose (§5.2): its replacement connects with its state */
        KVS_LOGI("stage [%d,%d): predecessor %s left on purpose (%s): waiting for its replacement", (int)s->begin,
                 (int)s->end, s->in ? s->in->peer : "?", why);
        s->in_leaving = s->in_bye = false;
        kvs_link_close(s->in);
        s->in = NULL;
        kvs_proto_decoder_reset(s->in_dec);
        kvs_st_met_update(s);
        return;
    }
    snprintf(msg, sizeof msg, "stage [%d,%d) lost its predecessor %s: %s%s", (int)s->begin, (int)s->end,
             s->in ? s->in->peer : "?", why, s->in_bye ? " (it shut down)" : "");
    if (s->in_bye) KVS_LOGI("%s", msg); /* orderly: it said goodbye */
    else KVS_LOGW("%s", msg);
    s->in_bye = false;
    kvs_link_close(s->in);
    s->in = NULL;
    kvs_proto_decoder_reset(s->in_dec);
    kvs_st_met_add(s, &s->met.links_lost, 1);
    kvs_st_drop_all(s, KVS_ERR_PEER, msg);
    if (!s->is_head) kvs_st_send_error(s, 0, KVS_ERR_PEER, msg);
    kvs_st_met_update(s);
}

void kvs_st_out_lost(struct kvs_stage *s, const char *why)
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
    if (was_up && s->out_leaving) { /* the successor left on purpose (§5.2): re-dial its replacement at once */
        KVS_LOGI("stage [%d,%d): successor %s left on purpose: dialing its replacement", (int)s->begin, (int)s->end,
                 s->next_addr);
        s->out_leaving = false;
        s->out_planned = true;
        s->out_quick_until = kvs_link_now_ms() + LEAVE_REDIAL_FOR_MS;
        s->out_next_dial = kvs_link_now_ms();
        s->out_attempt = 0;
        kvs_st_met_update(s);
        return;
    }
    s->out_planned = false;
    if (was_up) {
        kvs_st_met_add(s, &s->met.links_lost, 1);
        kvs_st_drop_all(s, KVS_ERR_PEER, msg);
    }
    kvs_st_met_update(s);
}

void kvs_st_pend_close(struct pending_link *pl)
{
    kvs_link_close(pl->l);
    kvs_proto_decoder_free(pl->dec);
    memset(pl, 0, sizeof *pl);
}

/* Whether two "host:port" peer strings name the same host (the part before
 * the last ':'; IPv6 hosts keep their inner colons). */
static bool same_host(const char *a, const char *b)
{
    const char *ca = strrchr(a, ':'), *cb = strrchr(b, ':');
    size_t la = ca ? (size_t)(ca - a) : strlen(a), lb = cb ? (size_t)(cb - b) : strlen(b);
    return la == lb && memcmp(a, b, la) == 0;
}

void kvs_st_accept_new(struct kvs_stage *s)
{
    for (;;) {
        struct kvs_link *l;
        kvs_err e = kvs_tcp_accept(s->lst, &l);
        if (e) return;
        /* TLS first (PROTOCOL.md §4): nothing of the peer's is read as a frame
         * before it proved the predecessor's key */
        if (s->tls && kvs_tls_wrap(s->tls, l, KVS_TLS_ACCEPTOR, s->p.prev_key, &l)) return;
        int slot = -1, n_same = 0, oldest_same = -1;
        for (int i = 0; i < MAX_PENDING_LINKS; i++) {
            if (!s->pend[i].l) {
                slot = i;
                continue;
            }
            if (!same_host(s->pend[i].l->peer, l->peer)) continue;
            n_same++;
            if (oldest_same < 0 || s->pend[i].since < s->pend[oldest_same].since) oldest_same = i;
        }
        if (n_same >= MAX_PENDING_PER_ADDR) {
            /* One address already holds its share of the table: its own
             * oldest entry makes room, whatever its age, so that a flood from
             * one address cannot crowd out a neighbour re-dialling from
             * another (issue 9) */
            if (kvs_st_refusal_log_ok(s))
                KVS_LOGW("closing link from %s: no HELLO yet and %d links from that address are pending",
                         s->pend[oldest_same].l->peer, n_same);
            kvs_st_pend_close(&s->pend[oldest_same]);
            slot = oldest_same;
        } else if (slot < 0) {
            /* The table is full: the oldest entry makes room only if it had
             * PEND_MIN_AGE_MS for its HELLO (a neighbour's re-dial needs a
             * few round trips); else the newcomer is the one turned away. A
             * pending link never touches the established in link. */
            slot = 0;
            for (int i = 1; i < MAX_PENDING_LINKS; i++)
                if (s->pend[i].since < s->pend[slot].since) slot = i;
            if (kvs_link_now_ms() - s->pend[slot].since < PEND_MIN_AGE_MS) {
                if (kvs_st_refusal_log_ok(s))
                    KVS_LOGW("closing new link from %s: %d links are still waiting for their HELLO", l->peer,
                             MAX_PENDING_LINKS);
                kvs_link_close(l);
                continue;
            }
            if (kvs_st_refusal_log_ok(s))
                KVS_LOGW("closing link from %s: no HELLO yet and too many pending links", s->pend[slot].l->peer);
            kvs_st_pend_close(&s->pend[slot]);
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
void kvs_st_pend_read(struct kvs_stage *s, struct pending_link *pl)
{
    uint8_t buf[256];
    size_t got;
    kvs_err e = kvs_link_read(pl->l, buf, sizeof buf, &got);
    if (e == KVS_ERR_NEED_MORE) return;
    if (e) {
        const char *why = kvs_tls_error(pl->l);
        /* A peer with another key is a configuration error or a stranger:
         * logged, but not kept as the ring's refusal (anyone can dial) */
        if (why && e == KVS_ERR_MISMATCH) {
            if (kvs_st_refusal_log_ok(s)) KVS_LOGW("refusing predecessor: %s", why);
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
        } else if (why) {
            if (kvs_st_refusal_log_ok(s)) KVS_LOGW("closing link from %s: %s", pl->l->peer, why);
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
        } else {
            KVS_LOGD("pending link from %s closed before its HELLO", pl->l->peer);
        }
        kvs_st_pend_close(pl);
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
            if (kvs_st_refusal_log_ok(s))
                KVS_LOGW("closing link from %s: bad frame: %s", pl->l->peer, kvs_proto_decoder_error(pl->dec));
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
            snprintf(msg, sizeof msg, "bad frame: %s", kvs_proto_decoder_error(pl->dec));
            kvs_st_refuse(pl->l, e, msg);
            kvs_st_pend_close(pl);
            return;
        }
        const struct kvs_frame *f = kvs_proto_decoder_frame(pl->dec);
        struct kvs_hello o;
        kvs_err ce = KVS_ERR_FORMAT;
        char rmsg[256];
        bool hello = f->h.kind == KVS_FRAME_HELLO;
        if (f->h.kind == KVS_FRAME_ERROR && kvs_tls_is_tls(pl->l)) { /* the predecessor refused this stage's key */
            uint32_t code;
            char m2[KVS_PROTO_MAX_ERRMSG + 1];
            kvs_proto_get_error(f, &code, m2, sizeof m2);
            KVS_LOGE("predecessor %s refused this stage: %s", pl->l->peer, m2);
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
            kvs_st_pend_close(pl);
            return;
        }
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
            if (kvs_st_refusal_log_ok(s)) KVS_LOGW("%s", full);
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
            kvs_st_refuse(pl->l, ce, rmsg);
            /* A stage that does not fit: the ring cannot close with it. Only a
             * peer that proved the predecessor's key (TLS) is that stage: over
             * a plaintext (--insecure) link anyone can dial, and a stranger's
             * HELLO is logged, not made the ring's error. */
            if (hello && kvs_tls_is_tls(pl->l)) {
                pthread_mutex_lock(&s->mu);
                s->in_refusal_code = ce;
                snprintf(s->in_refusal, sizeof s->in_refusal, "%s", full);
                pthread_mutex_unlock(&s->mu);
                pthread_cond_broadcast(&s->cv);
            }
            kvs_st_pend_close(pl);
            return;
        }
        /* An established predecessor is replaced only by a peer that proved
         * its key (TLS: the same stage re-dialing), or once it went quiet
         * (2 keepalive periods: a live predecessor writes at least one
         * keepalive per period). Over --insecure anyone can send a fitting
         * HELLO; it must not cut a live ring. */
        if (s->in && !kvs_tls_is_tls(pl->l) && kvs_link_now_ms() - s->in_last_read < 2 * (int64_t)s->p.keepalive_ms) {
            if (kvs_st_refusal_log_ok(s))
                KVS_LOGW("closing link from %s: this stage's predecessor %s is alive", pl->l->peer, s->in->peer);
            kvs_st_met_add(s, &s->met.frames_rejected, 1);
            kvs_st_pend_close(pl);
            return;
        }
        uint8_t hb[KVS_PROTO_HEADER_BYTES + KVS_PROTO_HELLO_BYTES];
        write_hello(s, hb, KVS_HELLO_ROLE_SUCC);
        if (kvs_link_write(pl->l, hb, sizeof hb, 1000)) {
            kvs_st_pend_close(pl);
            return;
        }
        /* a predecessor that left on purpose (§5.2) closed after its last frames: read them first */
        for (int k = 0; k < 64 && s->in && s->in_leaving; k++) kvs_st_in_read(s);
        if (s->in) kvs_st_in_lost(s, "replaced by a new link");
        pthread_mutex_lock(&s->mu);
        s->in_refusal_code = KVS_OK;
        s->in_refusal[0] = '\0';
        pthread_mutex_unlock(&s->mu);
        s->in = pl->l;
        pl->l = NULL;
        s->in_attempt = 0;
        s->in_warned = false;
        kvs_proto_decoder_reset(s->in_dec);
        s->in_last_read = kvs_link_now_ms();
        KVS_LOGI("predecessor [%u,%u) connected from %s", o.block_begin, o.block_end, s->in->peer);
        if (off < got) /* bytes after the HELLO belong to the in link */
            KVS_LOGD("dropping %zu early bytes from %s", got - off, s->in->peer);
        kvs_st_pend_close(pl);
        kvs_st_met_update(s);
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
    kvs_st_met_add(s, &s->met.frames_rejected, 1);
    pthread_mutex_lock(&s->mu);
    s->out_refusal_code = code ? code : KVS_ERR_MISMATCH;
    snprintf(s->out_refusal, sizeof s->out_refusal, "%s", msg);
    pthread_mutex_unlock(&s->mu);
    kvs_st_out_lost(s, msg);
    s->out_next_dial = kvs_link_now_ms() + backoff;
    pthread_cond_broadcast(&s->cv);
}

static void out_hello(struct kvs_stage *s);

kvs_err kvs_st_check_addr(const char *addr, bool listen, char *why, size_t cap)
{
    why[0] = '\0';
    if (kvs_ws_is_url(addr)) {
        struct kvs_ws_url u;
        if (kvs_ws_url_parse(addr, &u, why, cap)) return KVS_ERR_ARG;
        if (!u.token[0]) {
            snprintf(why, cap, "a relay URL needs its edge token (?token=HEX, kvasir relay token)");
            return KVS_ERR_ARG;
        }
        return KVS_OK;
    }
    char host[256] = "";
    uint16_t port = 0;
    if (kvs_addr_parse(addr, host, sizeof host, &port, why, cap)) return KVS_ERR_ARG;
    if (listen) return KVS_OK;
    if (!host[0]) snprintf(why, cap, "a HOST is needed");
    else if (!port) snprintf(why, cap, "port 0 cannot be dialed");
    return why[0] ? KVS_ERR_ARG : KVS_OK;
}

void kvs_st_cut_token(char *addr, char tok[KVS_RELAY_TOKEN_HEX + 1])
{
    if (!kvs_ws_is_url(addr)) return;
    char *q = strstr(addr, "?token=");
    if (!q) return;
    snprintf(tok, KVS_RELAY_TOKEN_HEX + 1, "%s", q + 7);
    *q = '\0';
}

/* Dials addr: direct TCP for HOST:PORT, else through the relay as `role`'s
 * end of the URL's edge (RELAY.md §2), trusting the relay by s->relay_ca or
 * s->relay_pin. The set-up (TCP, TLS to the relay, upgrade) blocks the loop
 * for at most timeout_ms. */
static kvs_err dial_link(struct kvs_stage *s, const char *addr, const char *token, uint8_t role, int timeout_ms,
                         struct kvs_link **l, char *err, size_t errlen)
{
    if (!kvs_ws_is_url(addr)) return kvs_tcp_dial(addr, timeout_ms, l, err, errlen);
    struct kvs_ws_opts o = { .role = role,
                             .token = token[0] ? token : NULL,
                             .ca_file = s->relay_ca[0] ? s->relay_ca : NULL,
                             .pin_sha256 = s->relay_pin[0] ? s->relay_pin : NULL };
    return kvs_ws_dial(addr, &o, timeout_ms, l, err, errlen);
}

#define RELAY_DIAL_MS 1500 /* set-up of a link through the relay: TCP + TLS + upgrade */
#define UNREACH_WARN_MS 3000 /* an unreachable successor: info at once, a warning after this */

void kvs_st_dial_in(struct kvs_stage *s)
{
    if (!s->in_relay || s->in) return;
    for (int i = 0; i < MAX_PENDING_LINKS; i++)
        if (s->pend[i].l && s->pend[i].relay) return; /* dialed: waits for its partner or its HELLO */
    int64_t now = kvs_link_now_ms();
    if (now < s->in_next_dial) return;
    s->in_next_dial = now + kvs_link_backoff_ms(s->in_attempt++);
    char err[300];
    struct kvs_link *l;
    kvs_err e = dial_link(s, s->listen_addr, s->in_token, KVS_RELAY_ROLE_DOWN, RELAY_DIAL_MS, &l, err, sizeof err);
    if (e) {
        if (!s->in_warned && s->in_attempt >= 20) {
            KVS_LOGW("still cannot reach the relay for the in link: %s (retrying)", err);
            s->in_warned = true;
        } else {
            KVS_LOGD("in link through the relay: %s", err);
        }
        return;
    }
    /* The downstream end of the edge is the ring link's acceptor: TLS server
     * (PROTOCOL.md §4), whichever end dialed the relay */
    if (s->tls && kvs_tls_wrap(s->tls, l, KVS_TLS_ACCEPTOR, s->p.prev_key, &l)) return;
    int slot = 0;
    for (int i = 0; i < MAX_PENDING_LINKS; i++)
        if (!s->pend[i].l) slot = i;
    kvs_st_pend_close(&s->pend[slot]); /* no listener: the table holds nothing else */
    s->pend[slot].dec = kvs_proto_decoder_create(KVS_PROTO_HELLO_BYTES + 64, s->n_embd);
    if (!s->pend[slot].dec) {
        kvs_link_close(l);
        return;
    }
    s->pend[slot].l = l;
    s->pend[slot].since = now;
    s->pend[slot].relay = true;
    KVS_LOGD("in link dialed out to %s, waiting for the predecessor", l->peer);
}

void kvs_st_dial_next(struct kvs_stage *s)
{
    char err[300];
    struct kvs_link *l;
    bool relay = kvs_ws_is_url(s->next_addr);
    kvs_err e = dial_link(s, s->next_addr, s->next_token, KVS_RELAY_ROLE_UP, relay ? RELAY_DIAL_MS : 500, &l, err, sizeof err);
    if (!e && s->tls) {
        e = kvs_tls_wrap(s->tls, l, KVS_TLS_DIALER, s->p.next_key, &l);
        if (e) snprintf(err, sizeof err, "%s", kvs_strerror(e));
    }
    if (e) {
        pthread_mutex_lock(&s->mu);
        s->out_refusal_code = KVS_OK;
        s->out_refusal[0] = '\0';
        pthread_mutex_unlock(&s->mu);
        s->out_refused = 0;
        /* Said at the first failure (info: in a starting ring the successor may
         * not listen yet), as a warning once it lasts UNREACH_WARN_MS. */
        int64_t now = kvs_link_now_ms();
        pthread_mutex_lock(&s->mu);
        if (strstr(err, s->next_addr)) /* the dial error names the address already */
            snprintf(s->out_dial_err, sizeof s->out_dial_err, "cannot reach the successor: %s", err);
        else
            snprintf(s->out_dial_err, sizeof s->out_dial_err, "cannot reach the successor %s: %s", s->next_addr, err);
        char why[sizeof s->out_dial_err];
        snprintf(why, sizeof why, "%s", s->out_dial_err);
        pthread_mutex_unlock(&s->mu);
        if (!s->out_unreach_since) {
            s->out_unreach_since = now;
            KVS_LOGI("%s (retrying with backoff)", why);
        } else if (!s->out_warned && now - s->out_unreach_since >= UNREACH_WARN_MS) {
            KVS_LOGW("%s, for %d s now (retrying)", why, (int)((now - s->out_unreach_since) / 1000));
            s->out_warned = true;
        }
        s->out_next_dial = kvs_link_now_ms() + kvs_link_backoff_ms(s->out_attempt++);
        if (now < s->out_quick_until) s->out_next_dial = now + LEAVE_REDIAL_MS; /* a replacement binds soon */
        return;
    }
    s->out = l;
    s->out_unreach_since = 0;
    pthread_mutex_lock(&s->mu);
    s->out_dial_err[0] = '\0';
    pthread_mutex_unlock(&s->mu);
    s->out_state = OUT_HANDSHAKE;
    s->out_hello_sent = false;
    s->out_since = kvs_link_now_ms();
    kvs_proto_decoder_reset(s->out_dec);
    out_hello(s);
}

/* OUT_HANDSHAKE: writes HELLO, over TLS once the handshake is done and the
 * successor proved its key (driven from here and out_read without waiting:
 * every stage of a starting ring dials at once, and a stage blocked on its
 * successor's TLS reply could not answer its own predecessor's). */
static void out_hello(struct kvs_stage *s)
{
    if (s->out_hello_sent) return;
    if (kvs_tls_is_tls(s->out)) {
        kvs_err e = kvs_tls_handshake(s->out, 0);
        if (e == KVS_ERR_TIMEOUT) return; /* not done yet: more when the out link is readable */
        if (e) {
            const char *why = kvs_tls_error(s->out);
            char msg[sizeof s->out_refusal];
            snprintf(msg, sizeof msg, "refusing successor %s: %s", s->next_addr, why ? why : kvs_strerror(e));
            if (e == KVS_ERR_MISMATCH || e == KVS_ERR_FORMAT) out_refused(s, e, msg);
            else kvs_st_out_lost(s, msg);
            return;
        }
    }
    uint8_t hb[KVS_PROTO_HEADER_BYTES + KVS_PROTO_HELLO_BYTES];
    write_hello(s, hb, KVS_HELLO_ROLE_PRED);
    if (kvs_link_write(s->out, hb, sizeof hb, 1000)) {
        kvs_st_out_lost(s, "cannot write HELLO");
        return;
    }
    s->out_hello_sent = true;
}

/* Reads on the out link: the HELLO reply, an ERROR refusal, or EOF. */
void kvs_st_out_read(struct kvs_stage *s)
{
    uint8_t buf[512];
    size_t got;
    if (s->out_state == OUT_HANDSHAKE && !s->out_hello_sent) {
        out_hello(s);
        if (!s->out || !s->out_hello_sent) return;
    }
    kvs_err e = kvs_link_read(s->out, buf, sizeof buf, &got);
    if (e == KVS_ERR_NEED_MORE) return;
    if (e) {
        kvs_st_out_lost(s, e == KVS_ERR_PEER ? "closed by the far end" : "read error");
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
            kvs_st_out_lost(s, msg);
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
                kvs_st_out_lost(s, "it said goodbye");
            } else {
                snprintf(msg, sizeof msg, "the successor closed the link: %s", m2);
                KVS_LOGW("%s", msg);
                kvs_st_out_lost(s, msg);
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
            /* after a planned leave (§5.2) only a lost frame makes it one: the replacement holds the state */
            bool rejoin = (s->out_ever_up && !s->out_planned) || s->out_dropped > 0;
            s->out_planned = false;
            s->out_quick_until = 0;
            s->out_ever_up = true;
            s->out_dropped = 0;
            if (!s->is_head && rejoin) {
                /* Frames sent while this link was down are lost: requests in
                 * flight cannot finish here. Tell every stage and the head
                 * (§5), which holds and replays them (§5.1) or, with replay
                 * off, fails them. */
                snprintf(msg, sizeof msg,
                         "stage [%d,%d) re-joined its successor: frames in flight were lost (the head replays its requests)",
                         (int)s->begin, (int)s->end);
                kvs_st_drop_all(s, KVS_ERR_PEER, msg);
                kvs_st_send_error(s, 0, KVS_ERR_PEER, msg);
            }
            kvs_st_met_update(s);
            continue;
        }
        snprintf(msg, sizeof msg, "unexpected %s frame from the successor", kvs_frame_kind_name(f->h.kind));
        kvs_st_out_lost(s, msg);
        return;
    }
}

/* The relay server on libwebsockets (docs/RELAY.md). One event loop thread:
 * every callback below runs on it; only the stats (mutex) and the stop flag
 * are touched from other threads. */
#include "relay/relay.h"

#include <libwebsockets.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/log.h"
#include "link/link.h"

#define SEND_CHUNK 65536u
#define RX_BUFFER 65536u

enum conn_state { S_WAIT_ROLE = 1, S_TAKEOVER, S_UNPAIRED, S_PAIRED, S_CLOSING };

struct buf {
    uint8_t *p;
    size_t off, len, cap;
};

struct edge;

struct conn {
    struct lws *wsi;
    struct kvs_relay *r;
    struct edge *edge;      /* set from S_UNPAIRED on (and for a challenger in S_TAKEOVER) */
    enum conn_state state;
    uint8_t role;           /* index 0 = up, 1 = down */
    char addr[64];
    char edge_id[KVS_RELAY_EDGE_MAX + 1];
    enum kvs_relay_refusal refuse; /* pending close with this reason */
    bool counted_unpaired;
    bool flow_off;          /* rx paused (its direction's buffer is full) */
    bool ping_pending;      /* takeover probe: send a ping */
    bool probed;            /* a challenger waits on this holder's pong */
    bool close_after_flush; /* the partner left: flush what is buffered, then close 4001 */
    bool replaced;          /* a dead holder replaced by a takeover: close 4000 */
    bool msg_done;          /* the last fragment received ended a message */
    uint64_t msg_bytes;     /* bytes of the message being received */
    uint8_t *hold;          /* challenger: stream bytes of its first message */
    size_t hold_len;
    struct buf tail;         /* close_after_flush: what the partner sent and c has not taken */
    struct conn *challenger; /* holder: who waits for the probe */
    struct conn *holder;     /* challenger: whom it probes */
};

struct edge {
    char id[KVS_RELAY_EDGE_MAX + 1];
    struct conn *end[2];    /* [0] up, [1] down */
    struct buf q[2];        /* q[d]: bytes from end[d] to end[1 - d] */
    struct edge *next;
};

struct addr_count {
    char addr[64];
    int n;
};

struct kvs_relay {
    struct kvs_relay_params p;
    uint8_t secret[256];
    struct lws_context *ctx;
    struct lws_vhost *vh;
    struct lws_protocols protocols[2];
    lws_retry_bo_t retry;
    uint16_t port;
    volatile int stop;
    struct edge *edges;
    struct addr_count *addrs;
    int n_addrs, cap_addrs;
    uint8_t *scratch; /* LWS_PRE + SEND_CHUNK */
    pthread_mutex_t mu;
    struct kvs_relay_stats st;
};

struct pss {
    struct conn *c;
    char *body; /* HTTP: response body */
    size_t body_len;
};

/* --- helpers ------------------------------------------------------------------- */

static void stat_add(struct kvs_relay *r, uint64_t *f, int64_t d)
{
    pthread_mutex_lock(&r->mu);
    *f = (uint64_t)((int64_t)*f + d);
    pthread_mutex_unlock(&r->mu);
}

static struct addr_count *addr_find(struct kvs_relay *r, const char *a, bool create)
{
    for (int i = 0; i < r->n_addrs; i++)
        if (!strcmp(r->addrs[i].addr, a)) return &r->addrs[i];
    if (!create) return NULL;
    if (r->n_addrs == r->cap_addrs) {
        int cap = r->cap_addrs ? 2 * r->cap_addrs : 16;
        struct addr_count *p = realloc(r->addrs, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        r->addrs = p;
        r->cap_addrs = cap;
    }
    struct addr_count *ac = &r->addrs[r->n_addrs++];
    snprintf(ac->addr, sizeof ac->addr, "%s", a);
    ac->n = 0;
    return ac;
}

static void addr_release(struct kvs_relay *r, const char *a)
{
    struct addr_count *ac = addr_find(r, a, false);
    if (!ac) return;
    if (--ac->n <= 0) *ac = r->addrs[--r->n_addrs];
}

static int buf_put(struct buf *b, const uint8_t *d, size_t n)
{
    if (b->off == b->len) b->off = b->len = 0;
    if (b->len + n > b->cap) {
        if (b->off) {
            memmove(b->p, b->p + b->off, b->len - b->off);
            b->len -= b->off;
            b->off = 0;
        }
        if (b->len + n > b->cap) {
            size_t cap = b->cap ? b->cap : 65536;
            while (cap < b->len + n) cap *= 2;
            uint8_t *p = realloc(b->p, cap);
            if (!p) return -1;
            b->p = p;
            b->cap = cap;
        }
    }
    memcpy(b->p + b->len, d, n);
    b->len += n;
    return 0;
}

static size_t buf_pending(const struct buf *b)
{
    return b->len - b->off;
}

static struct edge *edge_find(struct kvs_relay *r, const char *id, bool create)
{
    for (struct edge *e = r->edges; e; e = e->next)
        if (!strcmp(e->id, id)) return e;
    if (!create) return NULL;
    struct edge *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    snprintf(e->id, sizeof e->id, "%s", id);
    e->next = r->edges;
    r->edges = e;
    return e;
}

static void edge_free_if_empty(struct kvs_relay *r, struct edge *e)
{
    if (e->end[0] || e->end[1]) return;
    for (struct edge **pp = &r->edges; *pp; pp = &(*pp)->next)
        if (*pp == e) {
            *pp = e->next;
            break;
        }
    free(e->q[0].p);
    free(e->q[1].p);
    free(e);
}

static void set_unpaired(struct conn *c, bool on)
{
    if (c->counted_unpaired == on) return;
    c->counted_unpaired = on;
    stat_add(c->r, &c->r->st.unpaired, on ? 1 : -1);
}

static void leave_edge(struct conn *c);

/* Schedules a close of c with reason why (sent from its WRITEABLE callback). */
static void refuse(struct conn *c, enum kvs_relay_refusal why)
{
    if (c->state == S_CLOSING) return;
    if (why != KVS_RELAY_OK) {
        KVS_LOGW("relay: closing %s (edge %s): %s", c->addr, c->edge_id[0] ? c->edge_id : "?",
                 kvs_relay_refusal_reason(why));
        pthread_mutex_lock(&c->r->mu);
        c->r->st.refusals[why]++;
        pthread_mutex_unlock(&c->r->mu);
    }
    leave_edge(c); /* the partner flushes what c sent, then closes */
    c->refuse = why;
    c->state = S_CLOSING;
    lws_set_timer_usecs(c->wsi, -1);
    lws_callback_on_writable(c->wsi);
}

static void rx_pause(struct conn *c, bool pause)
{
    if (c->flow_off == pause) return;
    c->flow_off = pause;
    lws_rx_flow_control(c->wsi, pause ? 0 : 1);
}

/* c (S_UNPAIRED or a challenger that won) takes its end of its edge. */
static void take_end(struct conn *c, struct edge *e)
{
    struct kvs_relay *r = c->r;
    c->edge = e;
    e->end[c->role] = c;
    if (c->hold_len) {
        buf_put(&e->q[c->role], c->hold, c->hold_len);
        c->hold_len = 0;
    }
    free(c->hold);
    c->hold = NULL;
    struct conn *o = e->end[1 - c->role];
    if (o && o->state != S_CLOSING) {
        c->state = o->state = S_PAIRED;
        set_unpaired(c, false);
        set_unpaired(o, false);
        lws_set_timer_usecs(c->wsi, -1);
        lws_set_timer_usecs(o->wsi, -1);
        pthread_mutex_lock(&r->mu);
        r->st.edges_paired++;
        r->st.pairings++;
        pthread_mutex_unlock(&r->mu);
        KVS_LOGI("relay: edge %s paired (%s up, %s down)", e->id, e->end[0]->addr, e->end[1]->addr);
        lws_callback_on_writable(c->wsi);
        lws_callback_on_writable(o->wsi);
    } else {
        c->state = S_UNPAIRED;
        lws_set_timer_usecs(c->wsi, (lws_usec_t)r->p.partner_ms * 1000);
    }
    if (buf_pending(&e->q[c->role]) >= r->p.edge_buffer) rx_pause(c, true);
}

/* c leaves its edge (closing or closed). The partner leaves it too: it keeps
 * what c sent and has not been delivered, flushes it, then closes (4001),
 * as a TCP peer would read the rest and then EOF. The edge is freed. */
static void leave_edge(struct conn *c)
{
    struct kvs_relay *r = c->r;
    struct edge *e = c->edge;
    if (!e || e->end[c->role] != c) return;
    struct conn *o = e->end[1 - c->role];
    if (o && c->state == S_PAIRED) stat_add(r, &r->st.edges_paired, -1);
    e->end[c->role] = NULL;
    c->edge = NULL;
    if (o) {
        e->end[o->role] = NULL;
        o->edge = NULL;
        struct buf t = o->tail;
        o->tail = e->q[c->role]; /* bytes from c to o */
        e->q[c->role] = t;
        set_unpaired(o, false);
        if (o->state != S_CLOSING) {
            o->state = S_CLOSING;
            o->close_after_flush = true;
            lws_set_timer_usecs(o->wsi, -1);
            lws_callback_on_writable(o->wsi);
        }
    }
    edge_free_if_empty(r, e);
}

/* The takeover probe ended: the holder answered (alive: the challenger is
 * refused) or not (dead: replaced). */
static void takeover_end(struct conn *ch, bool holder_alive)
{
    struct kvs_relay *r = ch->r;
    struct conn *h = ch->holder;
    ch->holder = NULL;
    if (h) {
        h->challenger = NULL;
        h->probed = false;
    }
    lws_set_timer_usecs(ch->wsi, -1);
    if (holder_alive || !h) {
        if (h) {
            refuse(ch, KVS_RELAY_ROLE_TAKEN);
            return;
        }
    } else {
        KVS_LOGI("relay: edge %s: the %s end at %s did not answer: replaced by %s", ch->edge_id,
                 ch->role ? "down" : "up", h->addr, ch->addr);
        stat_add(r, &r->st.takeovers, 1);
        h->replaced = true;
        refuse(h, KVS_RELAY_OK);
    }
    struct edge *e = edge_find(r, ch->edge_id, true);
    if (!e) {
        refuse(ch, KVS_RELAY_FULL);
        return;
    }
    if (e->end[ch->role]) { /* taken again meanwhile */
        refuse(ch, KVS_RELAY_ROLE_TAKEN);
        return;
    }
    rx_pause(ch, false);
    take_end(ch, e);
}

/* The role preamble arrived (data: the rest of the first message). */
static void on_role(struct conn *c, uint8_t role_byte, const uint8_t *data, size_t n)
{
    struct kvs_relay *r = c->r;
    c->role = role_byte == KVS_RELAY_ROLE_UP ? 0 : 1;
    lws_set_timer_usecs(c->wsi, -1);
    struct edge *e = edge_find(r, c->edge_id, true);
    if (!e) {
        refuse(c, KVS_RELAY_FULL);
        return;
    }
    struct conn *h = e->end[c->role];
    if (h) {
        if (h->challenger) { /* one probe at a time */
            refuse(c, KVS_RELAY_ROLE_TAKEN);
            return;
        }
        c->hold = n ? malloc(n) : NULL;
        if (n && !c->hold) {
            refuse(c, KVS_RELAY_FULL);
            return;
        }
        if (n) memcpy(c->hold, data, n);
        c->hold_len = n;
        c->state = S_TAKEOVER;
        c->holder = h;
        h->challenger = c;
        h->probed = true;
        h->ping_pending = true;
        rx_pause(c, true);
        lws_callback_on_writable(h->wsi);
        lws_set_timer_usecs(c->wsi, (lws_usec_t)r->p.takeover_ms * 1000);
        return;
    }
    if (n) buf_put(&e->q[c->role], data, n);
    take_end(c, e);
}

/* --- HTTP: /health and /metrics ---------------------------------------------------- */

static int http_reply(struct lws *wsi, struct pss *ps, unsigned status, const char *type, char *body, size_t len)
{
    uint8_t hb[LWS_PRE + 1024], *start = hb + LWS_PRE, *p = start, *end = hb + sizeof hb - 1;
    ps->body = body;
    ps->body_len = len;
    if (lws_add_http_common_headers(wsi, status, type, (lws_filepos_t)len, &p, end)) return 1;
    if (lws_finalize_write_http_header(wsi, start, &p, end)) return 1;
    lws_callback_on_writable(wsi);
    return 0;
}

/* --- the callback ------------------------------------------------------------------ */

static int cb(struct lws *wsi, enum lws_callback_reasons reason, void *user, void *in, size_t len)
{
    struct kvs_relay *r = lws_context_user(lws_get_context(wsi));
    struct pss *ps = user;
    struct conn *c = ps ? ps->c : NULL;
    switch (reason) {
    case LWS_CALLBACK_HTTP: {
        const char *uri = in ? in : "";
        if (!strcmp(uri, "/health")) {
            char *b = strdup("ok\n");
            return b ? http_reply(wsi, ps, HTTP_STATUS_OK, "text/plain", b, 3) : 1;
        }
        if (!strcmp(uri, "/metrics")) {
            struct kvs_relay_stats st;
            kvs_relay_get_stats(r, &st);
            char *b = malloc(8192);
            if (!b) return 1;
            size_t n = kvs_relay_metrics_text(&st, b, 8192);
            return http_reply(wsi, ps, HTTP_STATUS_OK, "text/plain; version=0.0.4", b, n);
        }
        char *b = strdup("not found: WebSocket edges are at /edge/EDGE_ID; also /health, /metrics\n");
        return b ? http_reply(wsi, ps, HTTP_STATUS_NOT_FOUND, "text/plain", b, strlen(b)) : 1;
    }
    case LWS_CALLBACK_HTTP_WRITEABLE: {
        if (!ps || !ps->body) return -1;
        size_t n = ps->body_len;
        uint8_t *b = malloc(LWS_PRE + n + 1);
        if (!b) return -1;
        memcpy(b + LWS_PRE, ps->body, n);
        int w = lws_write(wsi, b + LWS_PRE, n, LWS_WRITE_HTTP_FINAL);
        free(b);
        free(ps->body);
        ps->body = NULL;
        if (w < (int)n) return -1;
        if (lws_http_transaction_completed(wsi)) return -1;
        return 0;
    }
    case LWS_CALLBACK_CLOSED_HTTP:
    case LWS_CALLBACK_HTTP_DROP_PROTOCOL:
        if (ps && ps->body) {
            free(ps->body);
            ps->body = NULL;
        }
        return 0;
    case LWS_CALLBACK_ESTABLISHED: {
        c = calloc(1, sizeof *c);
        if (!c) return -1;
        ps->c = c;
        c->wsi = wsi;
        c->r = r;
        c->state = S_WAIT_ROLE;
        c->msg_done = true;
        lws_get_peer_simple(wsi, c->addr, sizeof c->addr);
        stat_add(r, &r->st.connections, 1);
        char uri[256] = "", auth[256] = "";
        int ul = lws_hdr_copy(wsi, uri, sizeof uri, WSI_TOKEN_GET_URI);
        int al = lws_hdr_copy(wsi, auth, sizeof auth, WSI_TOKEN_HTTP_AUTHORIZATION);
        struct addr_count *ac = addr_find(r, c->addr, true);
        if (ac) ac->n++;
        enum kvs_relay_refusal v =
            ul < 0 ? KVS_RELAY_BAD_PATH
                   : kvs_relay_check_request(uri, al > 0 ? auth : NULL, r->secret, r->p.secret_len, c->edge_id);
        if (!ac || ac->n > r->p.max_per_addr) v = KVS_RELAY_PER_ADDR;
        else if (v == KVS_RELAY_OK && (int64_t)r->st.unpaired >= r->p.max_unpaired) v = KVS_RELAY_FULL;
        if (v != KVS_RELAY_OK) {
            refuse(c, v);
            return 0;
        }
        set_unpaired(c, true);
        lws_set_timer_usecs(wsi, (lws_usec_t)r->p.handshake_ms * 1000);
        return 0;
    }
    case LWS_CALLBACK_RECEIVE: {
        if (!c || c->state == S_CLOSING) return 0;
        if (c->msg_done) c->msg_bytes = 0;
        c->msg_bytes += len;
        c->msg_done = lws_is_final_fragment(wsi);
        if (c->msg_bytes > r->p.max_message) {
            refuse(c, KVS_RELAY_TOO_BIG);
            return 0;
        }
        if (!lws_frame_is_binary(wsi)) {
            refuse(c, KVS_RELAY_PROTOCOL);
            return 0;
        }
        const uint8_t *d = in;
        if (c->state == S_WAIT_ROLE) {
            uint8_t role;
            enum kvs_relay_refusal v = kvs_relay_check_preamble(d, len, &role);
            if (v) {
                refuse(c, v);
                return 0;
            }
            on_role(c, role, d + 1, len - 1);
            return 0;
        }
        if (c->state == S_TAKEOVER) { /* paused, but bytes already read still come */
            uint8_t *h = realloc(c->hold, c->hold_len + len);
            if (!h) {
                refuse(c, KVS_RELAY_FULL);
                return 0;
            }
            c->hold = h;
            memcpy(c->hold + c->hold_len, d, len);
            c->hold_len += len;
            return 0;
        }
        if (c->probed && c->challenger) takeover_end(c->challenger, true); /* data: the holder is alive */
        struct edge *e = c->edge;
        if (!e) return 0;
        if (buf_put(&e->q[c->role], d, len)) {
            refuse(c, KVS_RELAY_FULL);
            return 0;
        }
        size_t pend = buf_pending(&e->q[c->role]);
        if (pend > r->st.buffered_max) stat_add(r, &r->st.buffered_max, (int64_t)(pend - r->st.buffered_max));
        if (pend >= r->p.edge_buffer) rx_pause(c, true);
        struct conn *o = e->end[1 - c->role];
        if (o && c->state == S_PAIRED) lws_callback_on_writable(o->wsi);
        return 0;
    }
    case LWS_CALLBACK_RECEIVE_PONG:
        if (c && c->probed && c->challenger) takeover_end(c->challenger, true);
        return 0;
    case LWS_CALLBACK_SERVER_WRITEABLE: {
        if (!c) return 0;
        if (c->state == S_CLOSING && c->close_after_flush) {
            size_t n = buf_pending(&c->tail);
            if (n) {
                if (n > SEND_CHUNK) n = SEND_CHUNK;
                memcpy(r->scratch + LWS_PRE, c->tail.p + c->tail.off, n);
                if (lws_write(wsi, r->scratch + LWS_PRE, n, LWS_WRITE_BINARY) < (int)n) return -1;
                c->tail.off += n;
                stat_add(r, c->role == 1 ? &r->st.bytes_up : &r->st.bytes_down, (int64_t)n);
                lws_callback_on_writable(wsi);
                return 0;
            }
            const char *why = "the other end of the edge closed";
            lws_close_reason(wsi, (enum lws_close_status)4001, (unsigned char *)why, strlen(why));
            return -1;
        }
        if (c->state == S_CLOSING) {
            const char *why = c->replaced ? "replaced by a new connection for this end" : kvs_relay_refusal_reason(c->refuse);
            uint16_t code = c->replaced ? 4000 : kvs_relay_refusal_code(c->refuse);
            if (c->refuse == KVS_RELAY_OK && !c->replaced) {
                why = "relay shutting down";
                code = 1001;
            }
            lws_close_reason(wsi, (enum lws_close_status)code, (unsigned char *)why, strlen(why));
            return -1;
        }
        if (c->ping_pending) {
            c->ping_pending = false;
            uint8_t pb[LWS_PRE + 8];
            memcpy(pb + LWS_PRE, "takeover", 8);
            if (lws_write(wsi, pb + LWS_PRE, 8, LWS_WRITE_PING) < 0) return -1;
            lws_callback_on_writable(wsi);
            return 0;
        }
        struct edge *e = c->edge;
        if (!e || c->state != S_PAIRED) return 0;
        struct buf *q = &e->q[1 - c->role];
        size_t n = buf_pending(q);
        if (n) {
            if (n > SEND_CHUNK) n = SEND_CHUNK;
            memcpy(r->scratch + LWS_PRE, q->p + q->off, n);
            if (lws_write(wsi, r->scratch + LWS_PRE, n, LWS_WRITE_BINARY) < (int)n) return -1;
            q->off += n;
            stat_add(r, c->role == 1 ? &r->st.bytes_up : &r->st.bytes_down, (int64_t)n);
            struct conn *src = e->end[1 - c->role];
            if (src && src->flow_off && buf_pending(q) < r->p.edge_buffer / 2) rx_pause(src, false);
            if (buf_pending(q)) {
                lws_callback_on_writable(wsi);
                return 0;
            }
        }
        return 0;
    }
    case LWS_CALLBACK_TIMER:
        if (!c) return 0;
        if (c->state == S_WAIT_ROLE) refuse(c, KVS_RELAY_HANDSHAKE);
        else if (c->state == S_UNPAIRED) refuse(c, KVS_RELAY_NO_PARTNER);
        else if (c->state == S_TAKEOVER) takeover_end(c, false);
        return 0;
    case LWS_CALLBACK_CLOSED: {
        if (!c) return 0;
        ps->c = NULL;
        if (c->holder) { /* a challenger goes away during its probe */
            c->holder->challenger = NULL;
            c->holder->probed = false;
        }
        if (c->challenger) { /* the probed holder is gone: the challenger takes over */
            struct conn *ch = c->challenger;
            c->challenger = NULL;
            leave_edge(c);
            ch->holder = NULL;
            takeover_end(ch, false);
        }
        leave_edge(c);
        set_unpaired(c, false);
        stat_add(r, &r->st.connections, -1);
        addr_release(r, c->addr);
        free(c->hold);
        free(c->tail.p);
        free(c);
        return 0;
    }
    default:
        return 0;
    }
}

/* --- public ------------------------------------------------------------------------ */

struct kvs_relay_params kvs_relay_default_params(void)
{
    return (struct kvs_relay_params){
        .max_per_addr = 64, .max_unpaired = 4096, .max_message = KVS_RELAY_MAX_MESSAGE, .handshake_ms = 5000,
        .partner_ms = 30000, .ping_s = 10, .takeover_ms = 1000, .edge_buffer = 1u << 20,
    };
}

static void lws_log_to_kvs(int level, const char *line)
{
    size_t n = strlen(line);
    while (n && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
    KVS_LOGD("lws %d: %.*s", level, (int)n, line);
}

kvs_err kvs_relay_create(const struct kvs_relay_params *p, struct kvs_relay **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    char host[256];
    uint16_t port;
    kvs_err e = kvs_addr_parse(p->listen, host, sizeof host, &port, errbuf, errlen);
    if (e) return e;
    if (!p->secret || p->secret_len < 16 || p->secret_len > 256) {
        snprintf(errbuf, errlen, "the relay secret must be 16..256 bytes");
        return KVS_ERR_ARG;
    }
    if (!p->cert_file != !p->key_file) {
        snprintf(errbuf, errlen, "--cert and --key go together");
        return KVS_ERR_ARG;
    }
    struct kvs_relay *r = calloc(1, sizeof *r);
    if (!r) return KVS_ERR_NOMEM;
    r->p = *p;
    struct kvs_relay_params d = kvs_relay_default_params();
    if (r->p.max_per_addr <= 0) r->p.max_per_addr = d.max_per_addr;
    if (r->p.max_unpaired <= 0) r->p.max_unpaired = d.max_unpaired;
    if (!r->p.max_message) r->p.max_message = d.max_message;
    if (r->p.handshake_ms <= 0) r->p.handshake_ms = d.handshake_ms;
    if (r->p.partner_ms <= 0) r->p.partner_ms = d.partner_ms;
    if (r->p.ping_s <= 0) r->p.ping_s = d.ping_s;
    if (r->p.takeover_ms <= 0) r->p.takeover_ms = d.takeover_ms;
    if (!r->p.edge_buffer) r->p.edge_buffer = d.edge_buffer;
    memcpy(r->secret, p->secret, p->secret_len);
    r->p.secret = NULL;
    r->p.listen = NULL;
    r->p.cert_file = r->p.key_file = NULL;
    pthread_mutex_init(&r->mu, NULL);
    r->scratch = malloc(LWS_PRE + SEND_CHUNK);
    if (!r->scratch) {
        kvs_relay_free(r);
        return KVS_ERR_NOMEM;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max > 1048576 ? 1048576 : rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    lws_set_log_level(LLL_ERR | LLL_WARN, lws_log_to_kvs);
    r->protocols[0] = (struct lws_protocols){
        .name = KVS_RELAY_SUBPROTOCOL, .callback = cb, .per_session_data_size = sizeof(struct pss),
        .rx_buffer_size = RX_BUFFER,
    };
    r->retry = (lws_retry_bo_t){ .secs_since_valid_ping = (uint16_t)r->p.ping_s,
                                 .secs_since_valid_hangup = (uint16_t)(r->p.ping_s * 5 / 2 + 1) };
    struct lws_context_creation_info info;
    memset(&info, 0, sizeof info);
    info.port = port ? port : 0;
    info.iface = host[0] && strcmp(host, "0.0.0.0") ? host : NULL;
    info.protocols = r->protocols;
    info.user = r;
    info.timeout_secs = (unsigned)((r->p.handshake_ms + 999) / 1000);
    info.timeout_secs_ah_idle = info.timeout_secs; /* a connection that sends no request */
    info.keepalive_timeout = (int)info.timeout_secs;
    info.retry_and_idle_policy = &r->retry;
    info.options = LWS_SERVER_OPTION_VALIDATE_UTF8 | LWS_SERVER_OPTION_DISABLE_IPV6;
    if (strchr(host, ':')) info.options &= ~(uint64_t)LWS_SERVER_OPTION_DISABLE_IPV6;
    if (p->cert_file) {
        info.options |= LWS_SERVER_OPTION_DO_SSL_GLOBAL_INIT;
        info.ssl_cert_filepath = p->cert_file;
        info.ssl_private_key_filepath = p->key_file;
    }
    r->ctx = lws_create_context(&info);
    if (!r->ctx) {
        snprintf(errbuf, errlen, "cannot start the relay on %s (port busy, or the certificate/key cannot be loaded)",
                 p->listen);
        kvs_relay_free(r);
        return KVS_ERR_NET;
    }
    r->vh = lws_get_vhost_by_name(r->ctx, "default");
    int lp = r->vh ? lws_get_vhost_listen_port(r->vh) : -1;
    if (lp <= 0) {
        snprintf(errbuf, errlen, "cannot listen on %s", p->listen);
        kvs_relay_free(r);
        return KVS_ERR_NET;
    }
    r->port = (uint16_t)lp;
    *out = r;
    return KVS_OK;
}

uint16_t kvs_relay_port(const struct kvs_relay *r)
{
    return r->port;
}

kvs_err kvs_relay_run(struct kvs_relay *r)
{
    while (!r->stop)
        if (lws_service(r->ctx, 0) < 0) return KVS_ERR_IO;
    return KVS_OK;
}

void kvs_relay_stop(struct kvs_relay *r)
{
    r->stop = 1;
    if (r->ctx) lws_cancel_service(r->ctx);
}

void kvs_relay_free(struct kvs_relay *r)
{
    if (!r) return;
    if (r->ctx) lws_context_destroy(r->ctx);
    while (r->edges) {
        struct edge *e = r->edges;
        r->edges = e->next;
        free(e->q[0].p);
        free(e->q[1].p);
        free(e);
    }
    free(r->addrs);
    free(r->scratch);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

void kvs_relay_get_stats(struct kvs_relay *r, struct kvs_relay_stats *st)
{
    pthread_mutex_lock(&r->mu);
    *st = r->st;
    pthread_mutex_unlock(&r->mu);
}

/* WebSocket client transport through a relay (docs/RELAY.md; WebSocket
 * framing: RFC 6455 §5, upgrade: §4.1).
 *
 * kvs_ws_dial does the blocking set-up (TCP, TLS, upgrade, role preamble)
 * and then hands the connection to a pump thread. The stage gets one end of
 * an AF_UNIX socketpair: reading, writing and polling it is exactly like a
 * TCP link. The pump moves bytes between the pair and the WebSocket:
 * app -> binary messages of at most 64 KiB (masked, as a client must),
 * binary/continuation payload -> app, pings answered, its own pings sent.
 * Backpressure both ways: the pump stops reading one side while the other
 * side's queue is above PUMP_HIGH. */
#include "link/link.h"
#include "link/link_impl.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <openssl/sha.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/log.h"

#define ERR(code, ...)                                                                                     \
    do {                                                                                                   \
        if (errbuf && errlen) snprintf(errbuf, errlen, __VA_ARGS__);                                       \
        return code;                                                                                       \
    } while (0)

#define PUMP_CHUNK 65536         /* most app bytes per WebSocket message */
#define PUMP_HIGH (256u * 1024u) /* queue level above which the feeding side is not read */
#define PUMP_LINGER_MS 500       /* after the app closed: flush for at most this long */
#define WS_MAX_FRAME (16u << 20) /* a larger frame from the relay is a protocol error */
#define WS_GUID "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

/* --- URLs, edge ids, tokens -------------------------------------------------- */

bool kvs_ws_is_url(const char *s)
{
    return s && (!strncmp(s, "ws://", 5) || !strncmp(s, "wss://", 6));
}

bool kvs_relay_edge_valid(const char *id, size_t len)
{
    if (!id || len < 1 || len > KVS_RELAY_EDGE_MAX) return false;
    for (size_t i = 0; i < len; i++) {
        char c = id[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

static bool is_hex_token(const char *t, size_t len)
{
    if (len != KVS_RELAY_TOKEN_HEX) return false;
    for (size_t i = 0; i < len; i++)
        if (!((t[i] >= '0' && t[i] <= '9') || (t[i] >= 'a' && t[i] <= 'f'))) return false;
    return true;
}

kvs_err kvs_ws_url_parse(const char *url, struct kvs_ws_url *u, char *errbuf, size_t errlen)
{
    memset(u, 0, sizeof *u);
    if (!url) ERR(KVS_ERR_ARG, "no relay URL given");
    const char *p;
    if (!strncmp(url, "wss://", 6)) {
        u->tls = true;
        p = url + 6;
    } else if (!strncmp(url, "ws://", 5)) {
        p = url + 5;
    } else {
        ERR(KVS_ERR_ARG, "relay URL '%.200s' does not begin with ws:// or wss://", url);
    }
    const char *slash = strchr(p, '/');
    if (!slash) ERR(KVS_ERR_ARG, "relay URL '%.200s' has no path (expected /edge/EDGE_ID)", url);
    const char *hend = slash, *colon = NULL;
    const char *h = p;
    size_t hl;
    if (*p == '[') {
        const char *rb = memchr(p, ']', (size_t)(slash - p));
        if (!rb) ERR(KVS_ERR_ARG, "relay URL '%.200s': unclosed [ in the host", url);
        h = p + 1;
        hl = (size_t)(rb - h);
        if (rb + 1 < slash) {
            if (rb[1] != ':') ERR(KVS_ERR_ARG, "relay URL '%.200s': junk after the host", url);
            colon = rb + 1;
        }
    } else {
        colon = memchr(p, ':', (size_t)(slash - p));
        hl = (size_t)((colon ? colon : hend) - p);
    }
    if (hl == 0) ERR(KVS_ERR_ARG, "relay URL '%.200s' has no host", url);
    if (hl >= sizeof u->host) ERR(KVS_ERR_ARG, "relay URL '%.200s': host too long", url);
    memcpy(u->host, h, hl);
    u->port = u->tls ? 443 : 80;
    if (colon) {
        long v = 0;
        const char *q = colon + 1;
        if (q == slash) ERR(KVS_ERR_ARG, "relay URL '%.200s': empty port", url);
        for (; q < slash; q++) {
            if (*q < '0' || *q > '9' || v > 65535) ERR(KVS_ERR_ARG, "relay URL '%.200s': port is not a number in 1..65535", url);
            v = v * 10 + (*q - '0');
        }
        if (v < 1 || v > 65535) ERR(KVS_ERR_ARG, "relay URL '%.200s': port is not a number in 1..65535", url);
        u->port = (uint16_t)v;
    }
    if (strncmp(slash, "/edge/", 6)) ERR(KVS_ERR_ARG, "relay URL '%.200s': path must be /edge/EDGE_ID", url);
    const char *id = slash + 6;
    const char *q = strchr(id, '?');
    size_t il = q ? (size_t)(q - id) : strlen(id);
    if (!kvs_relay_edge_valid(id, il))
        ERR(KVS_ERR_ARG, "relay URL '%.200s': edge id must be 1..64 characters of A-Z a-z 0-9 . _ -", url);
    memcpy(u->edge, id, il);
    if (q) {
        if (strncmp(q, "?token=", 7)) ERR(KVS_ERR_ARG, "relay URL '%.200s': the only query is ?token=HEX", url);
        const char *t = q + 7;
        if (!is_hex_token(t, strlen(t)))
            ERR(KVS_ERR_ARG, "relay URL '%.200s': token must be 64 lowercase hex digits", url);
        memcpy(u->token, t, KVS_RELAY_TOKEN_HEX);
    }
    return KVS_OK;
}

kvs_err kvs_relay_token(const void *secret, size_t secret_len, const char *edge, char out[KVS_RELAY_TOKEN_HEX + 1])
{
    out[0] = '\0';
    if (!secret || !secret_len || !edge || !kvs_relay_edge_valid(edge, strlen(edge))) return KVS_ERR_ARG;
    char msg[32 + KVS_RELAY_EDGE_MAX];
    int n = snprintf(msg, sizeof msg, "kvasir-relay-edge:%s", edge);
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int ml = 0;
    if (!HMAC(EVP_sha256(), secret, (int)secret_len, (const unsigned char *)msg, (size_t)n, mac, &ml) || ml != 32)
        return KVS_ERR_INTERNAL;
    static const char hx[] = "0123456789abcdef";
    for (unsigned i = 0; i < 32; i++) {
        out[2 * i] = hx[mac[i] >> 4];
        out[2 * i + 1] = hx[mac[i] & 15];
    }
    out[64] = '\0';
    return KVS_OK;
}

bool kvs_relay_hex64(const char *s)
{
    return s && is_hex_token(s, strlen(s));
}

bool kvs_relay_token_equal(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    if (la != lb) return false;
    return CRYPTO_memcmp(a, b, la) == 0;
}

/* --- connection: plain or TLS ------------------------------------------------- */

struct ws_conn {
    int net;        /* TCP socket (non-blocking) */
    SSL_CTX *ctx;   /* wss only */
    SSL *ssl;
    bool ssl_want_write; /* the last SSL call needs POLLOUT */
    int app;        /* pump's end of the socketpair */
    int app_user;   /* the link's end */
    pthread_t th;
    bool th_started;
    char name[400]; /* "relay HOST:PORT edge ID" for logs */
    int ping_ms;
    /* queue to the relay: framed, masked bytes */
    uint8_t *nout;
    size_t nout_len, nout_off, nout_cap;
    /* queue to the app: payload bytes */
    uint8_t *aout;
    size_t aout_len, aout_off;
    /* frame parser (server -> client) */
    uint8_t hdr[14];
    size_t hdr_have;
    uint64_t left;   /* payload bytes of the current frame still to come */
    uint8_t opcode;  /* of the current frame */
    bool fin, in_frame;
    uint8_t ctl[125];
    size_t ctl_len;
    uint64_t rng;
    /* bytes that came after the upgrade response */
    uint8_t early[4096];
    size_t early_len;
};

/* Returns n > 0 bytes, 0 when it would block, -1 on EOF or error. */
static ssize_t net_read(struct ws_conn *c, void *buf, size_t cap)
{
    if (c->ssl) {
        ERR_clear_error();
        int n = SSL_read(c->ssl, buf, cap > INT32_MAX ? INT32_MAX : (int)cap);
        if (n > 0) return n;
        int e = SSL_get_error(c->ssl, n);
        if (e == SSL_ERROR_WANT_READ) return 0;
        if (e == SSL_ERROR_WANT_WRITE) {
            c->ssl_want_write = true;
            return 0;
        }
        return -1;
    }
    for (;;) {
        ssize_t n = recv(c->net, buf, cap, 0);
        if (n > 0) return n;
        if (n == 0) return -1;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -1;
    }
}

static ssize_t net_write(struct ws_conn *c, const void *buf, size_t len)
{
    if (c->ssl) {
        ERR_clear_error();
        c->ssl_want_write = false;
        int n = SSL_write(c->ssl, buf, len > INT32_MAX ? INT32_MAX : (int)len);
        if (n > 0) return n;
        int e = SSL_get_error(c->ssl, n);
        if (e == SSL_ERROR_WANT_WRITE) {
            c->ssl_want_write = true;
            return 0;
        }
        if (e == SSL_ERROR_WANT_READ) return 0;
        return -1;
    }
    for (;;) {
        ssize_t n = send(c->net, buf, len, MSG_NOSIGNAL);
        if (n >= 0) return n;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        return -1;
    }
}

static int wait_net(struct ws_conn *c, short ev, int64_t deadline)
{
    int64_t left = deadline - kvs_link_now_ms();
    if (left <= 0) return -1;
    struct pollfd p = { .fd = c->net, .events = ev };
    int r = poll(&p, 1, (int)left);
    return r > 0 ? 0 : -1;
}

static int write_all(struct ws_conn *c, const void *buf, size_t len, int64_t deadline)
{
    const uint8_t *p = buf;
    while (len) {
        ssize_t n = net_write(c, p, len);
        if (n < 0) return -1;
        if (n == 0) {
            if (wait_net(c, c->ssl && !c->ssl_want_write ? POLLIN | POLLOUT : POLLOUT, deadline)) return -2;
            continue;
        }
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

static void conn_free(struct ws_conn *c)
{
    if (!c) return;
    if (c->ssl) SSL_free(c->ssl);
    if (c->ctx) SSL_CTX_free(c->ctx);
    if (c->net >= 0) close(c->net);
    if (c->app >= 0) close(c->app);
    free(c->nout);
    free(c->aout);
    free(c);
}

static uint32_t rng_next(struct ws_conn *c)
{
    c->rng ^= c->rng << 13;
    c->rng ^= c->rng >> 7;
    c->rng ^= c->rng << 17;
    return (uint32_t)(c->rng >> 16);
}

/* Appends one masked client frame (RFC 6455 §5.2) to the relay queue. */
static int queue_frame(struct ws_conn *c, uint8_t opcode, const uint8_t *data, size_t len)
{
    size_t need = (c->nout_len - c->nout_off) + 14 + len;
    if (c->nout_off && c->nout_off == c->nout_len) c->nout_off = c->nout_len = 0;
    if (c->nout_len + 14 + len > c->nout_cap) {
        if (c->nout_off) { /* compact */
            memmove(c->nout, c->nout + c->nout_off, c->nout_len - c->nout_off);
            c->nout_len -= c->nout_off;
            c->nout_off = 0;
        }
        if (need > c->nout_cap) {
            size_t cap = c->nout_cap ? c->nout_cap : 4096;
            while (cap < need) cap *= 2;
            uint8_t *p = realloc(c->nout, cap);
            if (!p) return -1;
            c->nout = p;
            c->nout_cap = cap;
        }
    }
    uint8_t *h = c->nout + c->nout_len;
    size_t hl = 2;
    h[0] = (uint8_t)(0x80 | opcode);
    if (len < 126) {
        h[1] = (uint8_t)(0x80 | len);
    } else if (len < 65536) {
        h[1] = 0x80 | 126;
        h[2] = (uint8_t)(len >> 8);
        h[3] = (uint8_t)len;
        hl = 4;
    } else {
        h[1] = 0x80 | 127;
        for (int i = 0; i < 8; i++) h[2 + i] = (uint8_t)((uint64_t)len >> (56 - 8 * i));
        hl = 10;
    }
    uint32_t m = rng_next(c);
    uint8_t mk[4] = { (uint8_t)m, (uint8_t)(m >> 8), (uint8_t)(m >> 16), (uint8_t)(m >> 24) };
    memcpy(h + hl, mk, 4);
    hl += 4;
    uint8_t *d = h + hl;
    for (size_t i = 0; i < len; i++) d[i] = data[i] ^ mk[i & 3];
    c->nout_len += hl + len;
    return 0;
}

static size_t nout_pending(const struct ws_conn *c)
{
    return c->nout_len - c->nout_off;
}

static size_t aout_pending(const struct ws_conn *c)
{
    return c->aout_len - c->aout_off;
}

/* Parses relay bytes. Returns 0, 1 when the relay closed (close frame), -1 on
 * a protocol error (logged). Payload goes to aout (the caller keeps room). */
static int parse_net(struct ws_conn *c, const uint8_t *p, size_t n)
{
    while (n) {
        if (!c->in_frame) {
            c->hdr[c->hdr_have++] = *p++;
            n--;
            size_t need = 2;
            if (c->hdr_have >= 2) {
                uint8_t l7 = c->hdr[1] & 0x7f;
                need = 2 + (l7 == 126 ? 2 : l7 == 127 ? 8 : 0);
                if (c->hdr[1] & 0x80) {
                    KVS_LOGW("%s: the relay sent a masked frame (protocol error)", c->name);
                    return -1;
                }
            }
            if (c->hdr_have < need) continue;
            uint8_t l7 = c->hdr[1] & 0x7f;
            uint64_t len = l7;
            if (l7 == 126) len = ((uint64_t)c->hdr[2] << 8) | c->hdr[3];
            if (l7 == 127) {
                len = 0;
                for (int i = 0; i < 8; i++) len = (len << 8) | c->hdr[2 + i];
            }
            c->fin = c->hdr[0] & 0x80;
            uint8_t op = c->hdr[0] & 0x0f;
            c->hdr_have = 0;
            if (c->hdr[0] & 0x70) {
                KVS_LOGW("%s: the relay sent reserved frame bits (protocol error)", c->name);
                return -1;
            }
            if (op >= 8) {
                if (len > 125 || !c->fin) {
                    KVS_LOGW("%s: bad control frame from the relay", c->name);
                    return -1;
                }
                c->ctl_len = 0;
            } else if (op == 1) {
                KVS_LOGW("%s: the relay sent a text message (protocol error)", c->name);
                return -1;
            } else if (op != 0 && op != 2) {
                KVS_LOGW("%s: unknown opcode %u from the relay", c->name, op);
                return -1;
            } else if (len > WS_MAX_FRAME) {
                KVS_LOGW("%s: frame of %llu bytes from the relay (limit %u)", c->name, (unsigned long long)len,
                         WS_MAX_FRAME);
                return -1;
            }
            c->opcode = op;
            c->left = len;
            c->in_frame = true;
        }
        size_t take = c->left < n ? (size_t)c->left : n;
        if (c->opcode >= 8) {
            memcpy(c->ctl + c->ctl_len, p, take);
            c->ctl_len += take;
        } else if (take) {
            if (c->aout_off == c->aout_len) c->aout_off = c->aout_len = 0;
            if (c->aout_len + take > PUMP_HIGH + 65536u) { /* compact; room is kept by the caller */
                memmove(c->aout, c->aout + c->aout_off, c->aout_len - c->aout_off);
                c->aout_len -= c->aout_off;
                c->aout_off = 0;
            }
            memcpy(c->aout + c->aout_len, p, take);
            c->aout_len += take;
        }
        p += take;
        n -= take;
        c->left -= take;
        if (c->left == 0) {
            c->in_frame = false;
            if (c->opcode == 9) { /* ping -> pong with the same data */
                if (queue_frame(c, 0xA, c->ctl, c->ctl_len)) return -1;
            } else if (c->opcode == 8) {
                unsigned code = c->ctl_len >= 2 ? ((unsigned)c->ctl[0] << 8) | c->ctl[1] : 1005;
                int rl = c->ctl_len > 2 ? (int)c->ctl_len - 2 : 0;
                if (code == 1000 || code == 4001) KVS_LOGI("%s: closed by the relay: %u %.*s", c->name, code, rl, c->ctl + 2);
                else KVS_LOGW("%s: closed by the relay: %u %.*s", c->name, code, rl, c->ctl + 2);
                uint8_t cb[2] = { (uint8_t)(code >> 8), (uint8_t)code };
                (void)queue_frame(c, 0x8, cb, code == 1005 ? 0 : 2);
                return 1;
            }
        }
    }
    return 0;
}

/* The pump (see the top of this file). Ends when the relay is gone (then the
 * app end reads EOF) or when the app closed its end (then a close frame goes
 * to the relay, flushed for at most PUMP_LINGER_MS). */
static void *pump(void *arg)
{
    struct ws_conn *c = arg;
    uint8_t *buf = malloc(PUMP_CHUNK);
    bool app_eof = false, net_dead = false;
    int64_t linger_until = 0, last_rx = kvs_link_now_ms(), last_ping = last_rx;
    if (!buf) goto out;
    if (c->early_len) {
        int r = parse_net(c, c->early, c->early_len);
        if (r) net_dead = true;
    }
    for (;;) {
        bool progress = false;
        int64_t now = kvs_link_now_ms();
        /* app -> relay */
        if (!app_eof && !net_dead && nout_pending(c) < PUMP_HIGH) {
            ssize_t n = recv(c->app, buf, PUMP_CHUNK, 0);
            if (n > 0) {
                if (queue_frame(c, 0x2, buf, (size_t)n)) break;
                progress = true;
            } else if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                app_eof = true;
                uint8_t cb[2] = { 1000 >> 8, 1000 & 0xff };
                (void)queue_frame(c, 0x8, cb, 2);
                linger_until = now + PUMP_LINGER_MS;
                progress = true;
            }
        }
        if (!net_dead && now - last_ping >= c->ping_ms) {
            (void)queue_frame(c, 0x9, (const uint8_t *)"kvs", 3);
            last_ping = now;
        }
        /* flush to the relay */
        if (!net_dead && nout_pending(c)) {
            ssize_t n = net_write(c, c->nout + c->nout_off, nout_pending(c));
            if (n < 0) {
                net_dead = true;
            } else if (n > 0) {
                c->nout_off += (size_t)n;
                progress = true;
            }
        }
        if (app_eof && (net_dead || !nout_pending(c))) break;
        if (app_eof && now >= linger_until) break;
        /* relay -> app */
        if (!net_dead && !app_eof && aout_pending(c) < PUMP_HIGH) {
            ssize_t n = net_read(c, buf, 65536);
            if (n < 0) {
                KVS_LOGW("%s: connection to the relay lost", c->name);
                net_dead = true;
            } else if (n > 0) {
                last_rx = now;
                progress = true;
                if (parse_net(c, buf, (size_t)n)) {
                    /* flush the close reply briefly, then end */
                    int64_t dl = kvs_link_now_ms() + 200;
                    while (nout_pending(c) && kvs_link_now_ms() < dl) {
                        ssize_t w = net_write(c, c->nout + c->nout_off, nout_pending(c));
                        if (w < 0) break;
                        if (w == 0) (void)wait_net(c, POLLOUT, dl);
                        c->nout_off += (size_t)(w > 0 ? w : 0);
                    }
                    net_dead = true;
                }
            }
        }
        if (!net_dead && now - last_rx > 3 * (int64_t)c->ping_ms) {
            KVS_LOGW("%s: nothing from the relay for %d ms: connection lost", c->name, (int)(now - last_rx));
            net_dead = true;
        }
        /* flush to the app */
        if (aout_pending(c) && !app_eof) {
            ssize_t n = send(c->app, c->aout + c->aout_off, aout_pending(c), MSG_NOSIGNAL);
            if (n > 0) {
                c->aout_off += (size_t)n;
                progress = true;
            } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                app_eof = true;
            }
        }
        if (net_dead && !aout_pending(c)) break; /* the app reads what came, then EOF */
        if (net_dead && app_eof) break;
        if (progress) continue;
        struct pollfd pf[2];
        int np = 0;
        pf[np++] = (struct pollfd){ .fd = c->app,
                                    .events = (short)((!app_eof && nout_pending(c) < PUMP_HIGH ? POLLIN : 0) |
                                                      (aout_pending(c) ? POLLOUT : 0)) };
        if (!net_dead) {
            short ev = 0;
            if (aout_pending(c) < PUMP_HIGH) ev |= POLLIN;
            if (nout_pending(c) || c->ssl_want_write) ev |= POLLOUT;
            pf[np++] = (struct pollfd){ .fd = c->net, .events = ev };
        }
        int wait = c->ping_ms;
        if (app_eof) wait = (int)(linger_until - now > 0 ? linger_until - now : 0);
        if (poll(pf, (nfds_t)np, wait) < 0 && errno != EINTR) break;
    }
out:
    free(buf);
    /* EOF for the app: shut our end (the link's fd reads 0 once drained). */
    shutdown(c->app, SHUT_RDWR);
    return NULL;
}

/* --- the link ---------------------------------------------------------------- */

static kvs_err ws_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    struct ws_conn *c = l->impl;
    return kvs_link_fd_read(c->app_user, buf, cap, got);
}

static kvs_err ws_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    struct ws_conn *c = l->impl;
    return kvs_link_fd_write(c->app_user, buf, len, timeout_ms);
}

static int ws_fd(const struct kvs_link *l)
{
    const struct ws_conn *c = l->impl;
    return c->app_user;
}

static void ws_close(struct kvs_link *l)
{
    struct ws_conn *c = l->impl;
    if (c) {
        if (c->app_user >= 0) close(c->app_user); /* the pump reads EOF, says goodbye, ends */
        c->app_user = -1;
        if (c->th_started) pthread_join(c->th, NULL);
        conn_free(c);
    }
    free(l);
}

static const struct kvs_link_ops ws_ops = {
    .name = "ws", .read = ws_read, .write = ws_write, .fd = ws_fd, .close = ws_close,
};

static void b64(const uint8_t *in, size_t n, char *out)
{
    EVP_EncodeBlock((unsigned char *)out, in, (int)n);
}

/* Finds header `name` (case-insensitive) in the response head; copies its
 * trimmed value. Returns false when absent. */
static bool header_value(const char *head, const char *name, char *val, size_t cap)
{
    size_t nl = strlen(name);
    for (const char *line = strstr(head, "\r\n"); line; line = strstr(line, "\r\n")) {
        line += 2;
        if (!strncasecmp(line, name, nl) && line[nl] == ':') {
            const char *v = line + nl + 1;
            while (*v == ' ' || *v == '\t') v++;
            const char *e = strstr(v, "\r\n");
            size_t len = e ? (size_t)(e - v) : strlen(v);
            while (len && (v[len - 1] == ' ' || v[len - 1] == '\t')) len--;
            if (len >= cap) len = cap - 1;
            memcpy(val, v, len);
            val[len] = '\0';
            return true;
        }
    }
    return false;
}

/* The pinned certificate (kvs_ws_opts.pin_sha256): SHA-256 of the relay's leaf certificate (DER). */
static kvs_err check_pin(struct ws_conn *c, const struct kvs_ws_url *u, const char *pin, char *errbuf, size_t errlen)
{
    X509 *cert = SSL_get1_peer_certificate(c->ssl);
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int ml = 0;
    bool ok = cert && X509_digest(cert, EVP_sha256(), md, &ml) == 1 && ml == 32;
    X509_free(cert);
    if (!ok) ERR(KVS_ERR_NET, "relay %s:%u: no certificate to check against the pin", u->host, u->port);
    static const char hx[] = "0123456789abcdef";
    char got[65];
    for (unsigned i = 0; i < 32; i++) {
        got[2 * i] = hx[md[i] >> 4];
        got[2 * i + 1] = hx[md[i] & 15];
    }
    got[64] = '\0';
    if (!kvs_relay_token_equal(got, pin))
        ERR(KVS_ERR_NET, "relay %s:%u: certificate sha256 %.16s... is not the pinned %.16s...", u->host, u->port,
            got, pin);
    return KVS_OK;
}

static kvs_err tls_start(struct ws_conn *c, const struct kvs_ws_url *u, const char *ca_file, const char *pin,
                         int64_t deadline, char *errbuf, size_t errlen)
{
    c->ctx = SSL_CTX_new(TLS_client_method());
    if (!c->ctx) ERR(KVS_ERR_NOMEM, "cannot create a TLS context");
    SSL_CTX_set_min_proto_version(c->ctx, TLS1_2_VERSION);
    if (pin) {
        /* the pin replaces the chain and host checks (checked after the handshake) */
    } else if (ca_file) {
        if (SSL_CTX_load_verify_locations(c->ctx, ca_file, NULL) != 1)
            ERR(KVS_ERR_ARG, "cannot load the relay CA file '%.200s'", ca_file);
    } else if (SSL_CTX_set_default_verify_paths(c->ctx) != 1) {
        ERR(KVS_ERR_NET, "cannot load the system's CA store");
    }
    SSL_CTX_set_verify(c->ctx, pin ? SSL_VERIFY_NONE : SSL_VERIFY_PEER, NULL);
    c->ssl = SSL_new(c->ctx);
    if (!c->ssl || SSL_set_fd(c->ssl, c->net) != 1) ERR(KVS_ERR_NOMEM, "cannot create a TLS session");
    SSL_set_mode(c->ssl, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    X509_VERIFY_PARAM *vp = SSL_get0_param(c->ssl);
    if (X509_VERIFY_PARAM_set1_ip_asc(vp, u->host) != 1) { /* not an IP address: a name */
        SSL_set_tlsext_host_name(c->ssl, u->host);
        if (!pin && X509_VERIFY_PARAM_set1_host(vp, u->host, 0) != 1) ERR(KVS_ERR_ARG, "bad relay host name");
    }
    for (;;) {
        ERR_clear_error();
        int r = SSL_connect(c->ssl);
        if (r == 1) return pin ? check_pin(c, u, pin, errbuf, errlen) : KVS_OK;
        int e = SSL_get_error(c->ssl, r);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
            if (wait_net(c, e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT, deadline))
                ERR(KVS_ERR_TIMEOUT, "TLS handshake with relay %s:%u timed out", u->host, u->port);
            continue;
        }
        long vr = SSL_get_verify_result(c->ssl);
        if (vr != X509_V_OK)
            ERR(KVS_ERR_NET, "relay %s:%u: certificate not trusted: %s", u->host, u->port,
                X509_verify_cert_error_string(vr));
        char es[160] = "";
        ERR_error_string_n(ERR_get_error(), es, sizeof es);
        ERR(KVS_ERR_NET, "TLS handshake with relay %s:%u failed: %s", u->host, u->port, es[0] ? es : "connection closed");
    }
}

static kvs_err upgrade(struct ws_conn *c, const struct kvs_ws_url *u, const char *token, int64_t deadline,
                       char *errbuf, size_t errlen)
{
    uint8_t key[16];
    if (RAND_bytes(key, sizeof key) != 1) ERR(KVS_ERR_INTERNAL, "no random bytes");
    char key64[32], req[1024];
    b64(key, sizeof key, key64);
    bool v6 = strchr(u->host, ':') != NULL;
    int n = snprintf(req, sizeof req,
                     "GET /edge/%s HTTP/1.1\r\nHost: %s%s%s:%u\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     "Sec-WebSocket-Key: %s\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: %s\r\n"
                     "Authorization: Bearer %s\r\n\r\n",
                     u->edge, v6 ? "[" : "", u->host, v6 ? "]" : "", u->port, key64, KVS_RELAY_SUBPROTOCOL, token);
    int w = write_all(c, req, (size_t)n, deadline);
    if (w) ERR(w == -2 ? KVS_ERR_TIMEOUT : KVS_ERR_NET, "relay %s:%u: cannot send the upgrade request", u->host, u->port);
    char head[4096 + 1];
    size_t have = 0;
    char *end = NULL;
    while (!end) {
        if (have >= sizeof head - 1) ERR(KVS_ERR_NET, "relay %s:%u: response head too long", u->host, u->port);
        ssize_t r = net_read(c, head + have, sizeof head - 1 - have);
        if (r < 0) ERR(KVS_ERR_NET, "relay %s:%u closed the connection during the upgrade", u->host, u->port);
        if (r == 0) {
            if (wait_net(c, c->ssl_want_write ? POLLOUT : POLLIN, deadline))
                ERR(KVS_ERR_TIMEOUT, "relay %s:%u: no upgrade response in time", u->host, u->port);
            continue;
        }
        have += (size_t)r;
        head[have] = '\0';
        end = strstr(head, "\r\n\r\n");
    }
    size_t hl = (size_t)(end + 4 - head);
    if (strncmp(head, "HTTP/1.1 101", 12)) {
        char *eol = strstr(head, "\r\n");
        int sl = (int)(eol ? eol - head : 80);
        ERR(KVS_ERR_NET, "relay %s:%u refused the WebSocket upgrade: %.*s", u->host, u->port, sl > 120 ? 120 : sl, head);
    }
    char acc[128], want[64], up[64];
    char cat[128];
    snprintf(cat, sizeof cat, "%s%s", key64, WS_GUID);
    uint8_t sha[SHA_DIGEST_LENGTH];
    SHA1((const unsigned char *)cat, strlen(cat), sha);
    b64(sha, sizeof sha, want);
    if (!header_value(head, "Sec-WebSocket-Accept", acc, sizeof acc) || strcmp(acc, want))
        ERR(KVS_ERR_NET, "relay %s:%u: bad Sec-WebSocket-Accept in the upgrade response", u->host, u->port);
    if (!header_value(head, "Upgrade", up, sizeof up) || strcasecmp(up, "websocket"))
        ERR(KVS_ERR_NET, "relay %s:%u: the upgrade response is not a WebSocket upgrade", u->host, u->port);
    c->early_len = have - hl;
    memcpy(c->early, head + hl, c->early_len);
    return KVS_OK;
}

static kvs_err ws_dial(const char *url, const struct kvs_ws_opts *o, int timeout_ms, struct kvs_link **out,
                       char *errbuf, size_t errlen)
{
    *out = NULL;
    struct kvs_ws_url u;
    kvs_err e = kvs_ws_url_parse(url, &u, errbuf, errlen);
    if (e) return e;
    if (!o || (o->role != KVS_RELAY_ROLE_UP && o->role != KVS_RELAY_ROLE_DOWN)) ERR(KVS_ERR_ARG, "bad relay role");
    const char *token = o->token ? o->token : u.token;
    if (!token[0]) ERR(KVS_ERR_ARG, "relay URL '%.200s' carries no ?token= and none was given", url);
    if (!is_hex_token(token, strlen(token))) ERR(KVS_ERR_ARG, "relay token must be 64 lowercase hex digits");
    if (o->pin_sha256 && !kvs_relay_hex64(o->pin_sha256))
        ERR(KVS_ERR_ARG, "relay certificate pin must be 64 lowercase hex digits (SHA-256 of the DER)");
    int64_t deadline = kvs_link_now_ms() + (timeout_ms > 0 ? timeout_ms : 5000);
    char addr[300];
    bool v6 = strchr(u.host, ':') != NULL;
    snprintf(addr, sizeof addr, "%s%s%s:%u", v6 ? "[" : "", u.host, v6 ? "]" : "", u.port);
    struct kvs_link *tl;
    if ((e = kvs_tcp_dial(addr, timeout_ms > 0 ? timeout_ms : 5000, &tl, errbuf, errlen))) return e;
    struct ws_conn *c = calloc(1, sizeof *c);
    if (!c) {
        kvs_link_close(tl);
        return KVS_ERR_NOMEM;
    }
    c->net = dup(kvs_link_fd(tl));
    kvs_link_close(tl);
    c->app = c->app_user = -1;
    c->ping_ms = o->ping_ms > 0 ? o->ping_ms : 10000;
    snprintf(c->name, sizeof c->name, "relay %s edge %s (%s)", addr, u.edge, o->role == KVS_RELAY_ROLE_UP ? "up" : "down");
    if (RAND_bytes((unsigned char *)&c->rng, sizeof c->rng) != 1 || !c->rng) c->rng = 0x9e3779b97f4a7c15ull;
    c->aout = malloc(PUMP_HIGH + 2 * 65536u);
    if (c->net < 0 || !c->aout) {
        conn_free(c);
        ERR(KVS_ERR_NOMEM, "out of memory for a relay link");
    }
    if (u.tls && (e = tls_start(c, &u, o->ca_file, o->pin_sha256, deadline, errbuf, errlen))) goto fail;
    if ((e = upgrade(c, &u, token, deadline, errbuf, errlen))) goto fail;
    uint8_t role = o->role;
    if (queue_frame(c, 0x2, &role, 1)) {
        e = KVS_ERR_NOMEM;
        goto fail;
    }
    int w = write_all(c, c->nout + c->nout_off, nout_pending(c), deadline);
    c->nout_off = c->nout_len = 0;
    if (w) {
        e = w == -2 ? KVS_ERR_TIMEOUT : KVS_ERR_NET;
        snprintf(errbuf, errlen, "relay %s: cannot send the role preamble", addr);
        goto fail;
    }
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sp)) {
        e = KVS_ERR_IO;
        snprintf(errbuf, errlen, "socketpair: %s", strerror(errno));
        goto fail;
    }
    c->app_user = sp[0];
    c->app = sp[1];
    struct kvs_link *l = calloc(1, sizeof *l);
    if (!l) {
        close(c->app_user);
        e = KVS_ERR_NOMEM;
        goto fail;
    }
    if (pthread_create(&c->th, NULL, pump, c)) {
        free(l);
        close(c->app_user);
        e = KVS_ERR_NOMEM;
        snprintf(errbuf, errlen, "cannot start the relay pump thread");
        goto fail;
    }
    c->th_started = true;
    l->ops = &ws_ops;
    l->impl = c;
    snprintf(l->peer, sizeof l->peer, "%.36s/edge/%.16s", addr, u.edge);
    *out = l;
    return KVS_OK;
fail:
    conn_free(c);
    return e;
}

/* OpenSSL writes to the socket with write(): a relay that is gone would raise
 * SIGPIPE, which kills a process that did not ignore it (a stage does not).
 * SIGPIPE is blocked on this thread while it sets the connection up, and the
 * pump thread is created then, so it inherits the blocked signal for its
 * life: such a write fails with EPIPE instead (the link then reads EOF). A
 * SIGPIPE raised here is taken off before the caller's mask returns. */
kvs_err kvs_ws_dial(const char *url, const struct kvs_ws_opts *o, int timeout_ms, struct kvs_link **out,
                    char *errbuf, size_t errlen)
{
    sigset_t pipe_set, old;
    sigemptyset(&pipe_set);
    sigaddset(&pipe_set, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &pipe_set, &old);
    kvs_err e = ws_dial(url, o, timeout_ms, out, errbuf, errlen);
    if (!sigismember(&old, SIGPIPE)) {
        sigset_t pend;
        const struct timespec zero = { 0, 0 };
        while (sigpending(&pend) == 0 && sigismember(&pend, SIGPIPE) && sigtimedwait(&pipe_set, NULL, &zero) > 0) {
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return e;
}

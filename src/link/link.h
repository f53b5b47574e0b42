/* Links: byte-stream transports between neighbouring stages.
 *
 * A kvs_link is a small vtable (read / write / fd / close) so the stage loop
 * does not care what carries its frames: TCP today (kvs_tcp_*), a
 * WebSocket-through-relay transport later. Links are non-blocking: reads
 * return what is there; writes wait (bounded) until everything is written.
 * Frame parsing is src/proto's job; links move bytes only.
 *
 * Threads: one link is used by one thread at a time.
 */
#ifndef KVS_LINK_H
#define KVS_LINK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

struct kvs_link;

/* Transport operations. Implementations keep their state behind `impl`. */
struct kvs_link_ops {
    const char *name; /* "tcp", ... */
    /* Reads up to cap bytes into buf: KVS_OK with *got > 0; KVS_ERR_NEED_MORE
     * if nothing is available now; KVS_ERR_PEER on orderly close (EOF);
     * KVS_ERR_IO on error. */
    kvs_err (*read)(struct kvs_link *l, void *buf, size_t cap, size_t *got);
    /* Writes all len bytes, waiting at most timeout_ms in total (< 0: no
     * limit). KVS_ERR_TIMEOUT if the peer does not drain in time (the link
     * is then unusable: part of a frame may be written); KVS_ERR_PEER if the
     * peer closed; KVS_ERR_IO otherwise. */
    kvs_err (*write)(struct kvs_link *l, const void *buf, size_t len, int timeout_ms);
    /* Descriptor to poll for POLLIN (readable or closed). */
    int (*fd)(const struct kvs_link *l);
    /* Closes and frees the link. */
    void (*close)(struct kvs_link *l);
};

struct kvs_link {
    const struct kvs_link_ops *ops;
    void *impl;
    char peer[64]; /* "host:port" of the far end, for logs */
};

/* Dispatch helpers (l must not be NULL except for close). */
kvs_err kvs_link_read(struct kvs_link *l, void *buf, size_t cap, size_t *got);
kvs_err kvs_link_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms);
int kvs_link_fd(const struct kvs_link *l);
void kvs_link_close(struct kvs_link *l); /* NULL allowed */

/* --- addresses ------------------------------------------------------------- */

/* Splits "HOST:PORT" (HOST may be a name, an IPv4 address or [IPv6]) into
 * host[hostcap] and *port (1..65535). Errors: KVS_ERR_ARG with a message in
 * errbuf. */
kvs_err kvs_addr_parse(const char *addr, char *host, size_t hostcap, uint16_t *port, char *errbuf, size_t errlen);

/* --- TCP --------------------------------------------------------------------- */

struct kvs_listener; /* opaque: a listening TCP socket */

/* Listens on "HOST:PORT" (port 0 picks a free port: see kvs_listener_port).
 * SO_REUSEADDR is set so a restarted stage can bind again at once. Errors:
 * KVS_ERR_ARG (bad address), KVS_ERR_NET (bind/listen failed: message in
 * errbuf). Free with kvs_listener_close. */
kvs_err kvs_tcp_listen(const char *addr, struct kvs_listener **out, char *errbuf, size_t errlen);
uint16_t kvs_listener_port(const struct kvs_listener *s); /* 0 for NULL */
int kvs_listener_fd(const struct kvs_listener *s); /* poll for POLLIN: a connection waits; -1 for NULL */
void kvs_listener_close(struct kvs_listener *s);   /* NULL allowed */

/* Accepts one pending connection (non-blocking): KVS_OK with *out set,
 * KVS_ERR_NEED_MORE if none is pending, KVS_ERR_NET on failure. The link is
 * non-blocking with TCP_NODELAY. */
kvs_err kvs_tcp_accept(struct kvs_listener *s, struct kvs_link **out);

/* Connects to "HOST:PORT", waiting at most timeout_ms for this one attempt.
 * Errors: KVS_ERR_ARG (bad address), KVS_ERR_NET (refused, unreachable),
 * KVS_ERR_TIMEOUT. The link is non-blocking with TCP_NODELAY. */
kvs_err kvs_tcp_dial(const char *addr, int timeout_ms, struct kvs_link **out, char *errbuf, size_t errlen);

/* Dials with retry: attempts every backoff step (50 ms doubling up to 1 s)
 * until connected or total_ms has passed (KVS_ERR_TIMEOUT, last error in
 * errbuf). Blocks the caller: for start-up, not for the stage loop, which
 * keeps its own backoff schedule with kvs_link_backoff_ms. */
kvs_err kvs_tcp_dial_retry(const char *addr, int total_ms, struct kvs_link **out, char *errbuf, size_t errlen);

/* Backoff delay before retry number `attempt` (0-based): 50 ms doubling,
 * capped at 1000 ms. */
int kvs_link_backoff_ms(int attempt);

/* Monotonic clock in milliseconds (CLOCK_MONOTONIC). */
int64_t kvs_link_now_ms(void);

/* --- WebSocket through a relay (docs/RELAY.md) ------------------------------ */

/* Role preamble values (RELAY.md §3): the first byte a client sends on the stream. */
#define KVS_RELAY_ROLE_UP 0x01   /* upstream end: the predecessor (dials, writes boundaries) */
#define KVS_RELAY_ROLE_DOWN 0x02 /* downstream end: the successor (its in link) */
#define KVS_RELAY_EDGE_MAX 64    /* edge id: 1..64 bytes of [A-Za-z0-9._-] */
#define KVS_RELAY_TOKEN_HEX 64   /* edge token: hex of a 32-byte HMAC-SHA-256 */
#define KVS_RELAY_SUBPROTOCOL "kvasir-relay.1"
#define KVS_RELAY_MAX_MESSAGE (256u * 1024u) /* most payload bytes in one WebSocket message */

/* A parsed relay URL: ws[s]://HOST[:PORT]/edge/EDGE_ID[?token=HEX]. */
struct kvs_ws_url {
    bool tls;                              /* wss:// */
    char host[256];                        /* name, IPv4 or IPv6 (without brackets) */
    uint16_t port;                         /* default 443 (wss) / 80 (ws) */
    char edge[KVS_RELAY_EDGE_MAX + 1];     /* edge id */
    char token[KVS_RELAY_TOKEN_HEX + 1];   /* "" when the URL carries none */
};

/* True when s begins with "ws://" or "wss://" (a relay URL rather than HOST:PORT). */
bool kvs_ws_is_url(const char *s);
/* Parses a relay URL into *u. Errors: KVS_ERR_ARG with a message naming the part
 * (scheme, host, port, path, edge id, token: 64 hex digits). */
kvs_err kvs_ws_url_parse(const char *url, struct kvs_ws_url *u, char *errbuf, size_t errlen);
/* True when id[0..len) is a valid edge id (1..64 bytes of [A-Za-z0-9._-]). */
bool kvs_relay_edge_valid(const char *id, size_t len);
/* The edge token (RELAY.md §4): lowercase hex of HMAC-SHA-256(key = secret,
 * message = "kvasir-relay-edge:" || edge id), 64 digits + NUL into out.
 * Errors: KVS_ERR_ARG (bad edge id, empty secret), KVS_ERR_INTERNAL (OpenSSL). */
kvs_err kvs_relay_token(const void *secret, size_t secret_len, const char *edge, char out[KVS_RELAY_TOKEN_HEX + 1]);
/* True when s is 64 lowercase hex digits (an edge token, a certificate pin). */
bool kvs_relay_hex64(const char *s);
/* Constant-time comparison of two NUL-terminated tokens (false if lengths differ). */
bool kvs_relay_token_equal(const char *a, const char *b);

struct kvs_ws_opts {
    uint8_t role;        /* KVS_RELAY_ROLE_UP or KVS_RELAY_ROLE_DOWN */
    const char *ca_file; /* wss: PEM file of the CA(s) to trust (a self-signed relay
                          * certificate itself works); NULL: the system's store */
    const char *pin_sha256; /* wss: 64 lowercase hex digits, SHA-256 of the relay certificate's DER
                             * (openssl x509 -outform DER | sha256sum): trusted instead of ca_file
                             * and the host check; NULL: none */
    const char *token;   /* edge token; NULL: the URL's ?token= */
    int ping_ms;         /* client ping period (0: 10000); the link is declared dead
                          * after 3 periods without a byte from the relay */
};

/* Dials a relay (RELAY.md): TCP, TLS for wss:// (certificate checked against
 * ca_file and the URL's host), the WebSocket upgrade on /edge/EDGE_ID with
 * the token, then the role preamble — all within timeout_ms (with pin_sha256 the
 * certificate must have that hash instead). The link is a
 * byte stream like a TCP link (same kvs_link_ops contract; its fd is a local
 * socket fed by a pump thread, so poll on it is exact): bytes written go to
 * the far end of the edge once the relay pairs it, in order. The relay's
 * refusals (close codes of RELAY.md §6) and a lost relay are logged and end
 * the link with EOF (KVS_ERR_PEER on read). Errors: KVS_ERR_ARG (bad URL,
 * role, missing token), KVS_ERR_NET (connect, TLS or upgrade failed: the
 * reason in errbuf, e.g. the certificate check or the HTTP status),
 * KVS_ERR_TIMEOUT, KVS_ERR_NOMEM. */
kvs_err kvs_ws_dial(const char *url, const struct kvs_ws_opts *o, int timeout_ms, struct kvs_link **out,
                    char *errbuf, size_t errlen);

#endif

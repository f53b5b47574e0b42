/* The relay: a WebSocket bridge that splices the two ends of a ring edge
 * (docs/RELAY.md, normative).
 *
 * Both ends of an edge dial out to the relay (/edge/EDGE_ID, edge token in
 * `Authorization: Bearer`), say which end they are with a 1-byte role
 * preamble, and once both are there the relay forwards the bytes of binary
 * messages both ways, in order, with backpressure and a bounded buffer per
 * edge. The relay holds no model and parses nothing of the ring protocol.
 * Built on libwebsockets (TLS through OpenSSL when a certificate is given);
 * /metrics (Prometheus text) and /health are served on the same port.
 *
 * Threads: kvs_relay_run runs the event loop on the calling thread;
 * kvs_relay_stop and kvs_relay_get_stats may be called from any thread.
 */
#ifndef KVS_RELAY_H
#define KVS_RELAY_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

/* Why a connection was refused or closed (RELAY.md §6). Each has a close
 * code, a metric label and a reason text. */
enum kvs_relay_refusal {
    KVS_RELAY_OK = 0,
    KVS_RELAY_BAD_PATH,      /* 4400: the request path is not /edge/EDGE_ID */
    KVS_RELAY_NO_TOKEN,      /* 4401: no Authorization: Bearer token */
    KVS_RELAY_BAD_TOKEN,     /* 4403: the token is not this edge's */
    KVS_RELAY_BAD_ROLE,      /* 4406: first byte is not a role, or the first message is empty */
    KVS_RELAY_ROLE_TAKEN,    /* 4409: the role is held by a live connection */
    KVS_RELAY_TOO_BIG,       /* 1009: a message larger than the bound */
    KVS_RELAY_HANDSHAKE,     /* 4408: no role preamble within the handshake time */
    KVS_RELAY_NO_PARTNER,    /* 4410: the other end did not come within the partner timeout */
    KVS_RELAY_PER_ADDR,      /* 4429: too many connections from this address */
    KVS_RELAY_FULL,          /* 4503: too many unpaired connections */
    KVS_RELAY_PROTOCOL,      /* 1003: a text message */
    KVS_RELAY_REFUSAL_COUNT_
};

/* Close code (RELAY.md §6), metric label ("no_token", ...) and reason text of r. */
uint16_t kvs_relay_refusal_code(enum kvs_relay_refusal r);
const char *kvs_relay_refusal_name(enum kvs_relay_refusal r);
const char *kvs_relay_refusal_reason(enum kvs_relay_refusal r);

/* --- pure checks (fuzzed: fuzz/fuzz_relay.c) ------------------------------- */

/* Checks an upgrade request: uri is the request path ("/edge/ID", no query),
 * auth the Authorization header value or NULL. On KVS_RELAY_OK the edge id
 * is in edge[]. Verdicts: BAD_PATH, NO_TOKEN ("Bearer " + 64 hex missing or
 * malformed), BAD_TOKEN (not kvs_relay_token(secret, edge): compared in
 * constant time). Never reads past the NUL of uri / auth. */
enum kvs_relay_refusal kvs_relay_check_request(const char *uri, const char *auth, const uint8_t *secret,
                                               size_t secret_len, char edge[65]);
/* Checks the first message of a connection: its first byte is the role
 * (KVS_RELAY_ROLE_UP / DOWN, link.h). On OK *role is set and the rest of the
 * message (len - 1 bytes from msg + 1) is stream data. BAD_ROLE otherwise. */
enum kvs_relay_refusal kvs_relay_check_preamble(const uint8_t *msg, size_t len, uint8_t *role);

/* --- the server ---------------------------------------------------------------- */

struct kvs_relay_params {
    const char *listen;       /* "HOST:PORT" (port 0: any free port, see kvs_relay_port) */
    const char *cert_file;    /* PEM certificate (chain) for wss://; NULL: plain ws:// */
    const char *key_file;     /* PEM private key; with cert_file */
    const uint8_t *secret;    /* edge token key (copied), >= 16 bytes */
    size_t secret_len;
    int max_per_addr;         /* open WebSocket connections per client address (default 64) */
    int max_unpaired;         /* connections without a partner, relay-wide (default 4096) */
    uint32_t max_message;     /* bytes per message (default KVS_RELAY_MAX_MESSAGE) */
    int handshake_ms;         /* TCP accept -> role preamble (default 5000) */
    int partner_ms;           /* an end waits this long for its partner (default 30000) */
    int ping_s;               /* idle ping period, s (default 10; no pong in 2.5 periods: closed) */
    int takeover_ms;          /* a held role's holder must answer a ping within this (default 1000) */
    uint32_t edge_buffer;     /* bytes buffered per edge and direction before the writer is paused (default 1 MiB) */
};
struct kvs_relay_params kvs_relay_default_params(void);

struct kvs_relay; /* opaque */

/* Creates the relay and binds its port. Raises the soft open-file limit to
 * the hard one (the relay holds two descriptors per edge). Errors: KVS_ERR_ARG
 * (bad address, secret shorter than 16 bytes, cert without key), KVS_ERR_NET
 * (cannot listen, cannot load the certificate). */
kvs_err kvs_relay_create(const struct kvs_relay_params *p, struct kvs_relay **out, char *errbuf, size_t errlen);
uint16_t kvs_relay_port(const struct kvs_relay *r);
/* Runs the event loop until kvs_relay_stop. */
kvs_err kvs_relay_run(struct kvs_relay *r);
void kvs_relay_stop(struct kvs_relay *r); /* thread-safe */
void kvs_relay_free(struct kvs_relay *r); /* after run returned; NULL allowed */

struct kvs_relay_stats {
    uint64_t connections;     /* open WebSocket connections */
    uint64_t unpaired;        /* of which without a partner */
    uint64_t edges_paired;    /* edges with both ends */
    uint64_t pairings;        /* times an edge became paired (counter) */
    uint64_t bytes_up;        /* bytes forwarded upstream end -> downstream end */
    uint64_t bytes_down;      /* downstream -> upstream */
    uint64_t takeovers;       /* dead holders replaced */
    uint64_t buffered_max;    /* most bytes one edge direction held at once (bounded by
                               * edge_buffer + one read of at most 64 KiB) */
    uint64_t refusals[KVS_RELAY_REFUSAL_COUNT_]; /* by reason ([0] unused) */
};
void kvs_relay_get_stats(struct kvs_relay *r, struct kvs_relay_stats *st); /* thread-safe */
/* Prometheus text of st into buf (NUL-terminated, truncated at cap); returns its length. */
size_t kvs_relay_metrics_text(const struct kvs_relay_stats *st, char *buf, size_t cap);

#endif

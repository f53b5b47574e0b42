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
uint16_t kvs_listener_port(const struct kvs_listener *s);
int kvs_listener_fd(const struct kvs_listener *s); /* poll for POLLIN: a connection waits */
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

#endif

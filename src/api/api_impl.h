/* Private helpers shared by the API's files: a growable byte buffer and the
 * metrics registry rendered at /metrics. */
#ifndef KVS_API_IMPL_H
#define KVS_API_IMPL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "common/error.h"
#include "stage/stage.h"

/* Growable byte buffer with a hard cap (appends past it fail). Start from
 * { .limit = L } (all else zero); p is NUL-terminated once anything was added;
 * the buffer owns p: release it with kvs_api_buf_free. */
struct kvs_api_buf {
    char *p;
    size_t len, cap, limit; /* len, limit: bytes of text, not counting the NUL */
};
/* Appends n bytes of s. Returns false, leaving b unchanged, when len + n
 * would pass limit or memory runs out. */
bool kvs_api_buf_add(struct kvs_api_buf *b, const char *s, size_t n);
/* Appends the formatted text, of any length; false as kvs_api_buf_add. */
bool kvs_api_buf_printf(struct kvs_api_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Frees p and empties b (limit kept: b can be reused). */
void kvs_api_buf_free(struct kvs_api_buf *b);

#define KVS_API_HIST_MAX 16
struct kvs_api_hist {
    const double *bounds; /* upper bounds (seconds), ascending */
    int n;                /* number of bounds (<= KVS_API_HIST_MAX) */
    uint64_t counts[KVS_API_HIST_MAX + 1]; /* per bucket, not cumulative; last = +Inf */
    double sum;
    uint64_t count;
};

enum kvs_api_status {
    KVS_API_STATUS_OK = 0,    /* finished: stop or length */
    KVS_API_STATUS_CANCELLED, /* the client went away */
    KVS_API_STATUS_ERROR,     /* ring or server error */
    KVS_API_STATUS_INVALID,   /* rejected: 4xx */
    KVS_API_STATUS_UNAVAILABLE, /* 503: ring not ready / queue full */
    KVS_API_STATUS_COUNT_
};

/* Connections at the API's door (api_gate.c), counted in /metrics. */
enum kvs_api_conn {
    KVS_API_CONN_ACCEPTED = 0,
    KVS_API_CONN_REFUSED_FULL, /* 503: every connection slot busy with whole requests */
    KVS_API_CONN_REFUSED_ADDR, /* 503: over the per-address limit */
    KVS_API_CONN_TIMED_OUT,    /* closed: no whole request within the request deadline */
    KVS_API_CONN_EVICTED,      /* closed: an incomplete request made room for a new connection */
    KVS_API_CONN_COUNT_
};

struct kvs_api_metrics {
    pthread_mutex_t mu;
    uint64_t connections[KVS_API_CONN_COUNT_];
    uint64_t requests[KVS_API_STATUS_COUNT_];
    uint64_t tokens_generated;  /* tokens returned to clients */
    uint64_t prompt_tokens;
    int64_t in_flight;          /* HTTP requests being generated */
    struct kvs_api_hist request_seconds;
    struct kvs_api_hist token_roundtrip;
};

/* Zeroes m and sets its histograms' bucket bounds; pair with
 * kvs_api_metrics_destroy. Callers hold m->mu while updating fields. */
void kvs_api_metrics_init(struct kvs_api_metrics *m);
void kvs_api_metrics_destroy(struct kvs_api_metrics *m);
/* Counts one observation v (seconds) in h; not locked (hold the owner's mutex). */
void kvs_api_hist_add(struct kvs_api_hist *h, double v);
/* Appends the Prometheus text exposition (format 0.0.4) of m and of the
 * stage counters st to b. stage_index labels the per-stage series. */
bool kvs_api_metrics_render(struct kvs_api_metrics *m, const struct kvs_stage_metrics *st, int32_t stage_index,
                            struct kvs_api_buf *b);
/* Appends the ring-wide series from the head's last probe trail (n stages in
 * ring order, entry 0 = the head; see kvs_stage_ring_stats): per-stage compute
 * time, calls, rows and bytes out, per-hop latency (seconds) and the probe's
 * round trip. n == 0 appends nothing. */
bool kvs_api_metrics_render_ring(const struct kvs_stage_hop *hops, int n, double rtt_ms, struct kvs_api_buf *b);

/* --- the door (api_gate.c) -------------------------------------------------
 * The API's listening socket and accept thread in front of libmicrohttpd
 * (see api_gate.c for the policy). Use: open (binds and listens), start MHD
 * with MHD_USE_NO_LISTEN_SOCKET and MHD_OPTION_NOTIFY_CONNECTION =
 * kvs_api_gate_notify with the gate as closure, run, ...; to end: stop (no
 * more accepts), MHD_stop_daemon, free. */
struct kvs_api_gate;
/* Listens on bind_addr:port (IPv4; port 0: any). max_conn: connections that
 * may be open at once; per_addr: of those, from one client address;
 * request_timeout_s: time from a connection's accept (or the end of its
 * previous request) to the whole next request being in. met: where refusals
 * are counted (borrowed; may be NULL). Errors: KVS_ERR_ARG (limits, address),
 * KVS_ERR_NET (errbuf says why), KVS_ERR_NOMEM. */
kvs_err kvs_api_gate_open(const char *bind_addr, uint16_t port, int32_t max_conn, int32_t per_addr,
                          int32_t request_timeout_s, struct kvs_api_metrics *met, struct kvs_api_gate **out,
                          char *errbuf, size_t errlen);
uint16_t kvs_api_gate_port(const struct kvs_api_gate *g);
/* Starts the accept thread, handing admitted sockets to d. */
kvs_err kvs_api_gate_run(struct kvs_api_gate *g, struct MHD_Daemon *d);
/* Stops accepting (joins the thread, closes the listening socket). */
void kvs_api_gate_stop(struct kvs_api_gate *g);
/* After MHD_stop_daemon: frees g. NULL allowed. */
void kvs_api_gate_free(struct kvs_api_gate *g);
/* MHD_OPTION_NOTIFY_CONNECTION callback (cls = the gate). */
void kvs_api_gate_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                         enum MHD_ConnectionNotificationCode code);
/* on_access has the whole request of c: its deadline stops. */
void kvs_api_gate_received(struct kvs_api_gate *g, struct MHD_Connection *c);
/* The request on c ended (MHD_OPTION_NOTIFY_COMPLETED): a kept-alive
 * connection's next request starts its deadline now. */
void kvs_api_gate_request_done(struct kvs_api_gate *g, struct MHD_Connection *c);

#endif

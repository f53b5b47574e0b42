/* The API's front door: its own listening socket and accept thread in front
 * of libmicrohttpd (started with MHD_USE_NO_LISTEN_SOCKET; each admitted
 * socket goes in with MHD_add_connection). It keeps what MHD alone cannot:
 *   - a whole-request deadline (MHD's connection timeout is an idle timeout,
 *     which a client sending one header byte every few seconds never trips);
 *   - a per-address connection limit;
 *   - overflow answered with an HTTP 503 (MHD at its limit closes the socket,
 *     which the client sees as a reset);
 *   - eviction: when every slot is taken, a connection that has not yet sent
 *     a whole request, and has had EVICT_MIN_MS to send it (a client that
 *     sends at once is never evicted), makes room for the new one: one from
 *     the address that holds the most connections (the oldest of those),
 *     provided that address holds at least two more than the newcomer's.
 *     Slow senders (even more of them than there are slots, coming back as
 *     soon as they are closed) then settle at even shares and get 503s,
 *     instead of evicting each other in a loop, while a client from an
 *     address with fewer connections still gets in.
 * A connection is "receiving" from its accept (or from the end of its
 * previous request on a kept-alive connection) until on_access has the whole
 * request (kvs_api_gate_received); the deadline and eviction apply only then,
 * never while a response is being generated or streamed. Sockets are shut
 * down (shutdown(2) on a dup of the socket, so the descriptor can never be
 * one MHD already closed and the kernel reused), and MHD's thread for the
 * connection ends it. */
#include "api/api_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

#define TICK_MS 200          /* accept thread: deadline check period */
#define EVICT_MIN_MS 1000    /* a connection receiving for less than this is not evicted */
#define LINGER_MAX 64        /* refused sockets being drained at once */
#define LINGER_MS 2000       /* drain a refused socket at most this long */
#define LOG_EVERY_NS 10000000000LL /* refusal summaries: at most one per 10 s */

struct gate_slot {
    bool used, started, receiving, shut;
    int fd;        /* the socket MHD owns (a key only; never used after MHD_add_connection) */
    int dupfd;     /* our own descriptor of the same socket: shutdown(2) only */
    uint32_t addr; /* client IPv4 address, network order */
    int64_t t0;    /* start of the current request's receive phase (ns) */
};

struct refused {
    int fd;
    int64_t t0;
};

struct kvs_api_gate {
    int lfd;
    uint16_t port;
    int32_t max_conn, per_addr;
    int64_t deadline_ns;
    struct MHD_Daemon *d;
    struct kvs_api_metrics *met;
    pthread_t thr;
    bool running;
    int wake[2]; /* pipe: stop */
    pthread_mutex_t mu;
    struct gate_slot *slots; /* [n_slots] = 2 * max_conn: room for evicted ones still closing */
    int32_t n_slots;
    struct refused lg[LINGER_MAX];
    int n_lg;
    /* refusals since the last log line */
    uint64_t n_refused_full, n_refused_addr, n_timed_out, n_evicted;
    int64_t last_log;
};

static int64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

kvs_err kvs_api_gate_open(const char *bind_addr, uint16_t port, int32_t max_conn, int32_t per_addr,
                          int32_t request_timeout_s, struct kvs_api_metrics *met, struct kvs_api_gate **out,
                          char *errbuf, size_t errlen)
{
    *out = NULL;
    if (max_conn < 1 || per_addr < 1 || request_timeout_s < 1 || max_conn > (1 << 20)) {
        snprintf(errbuf, errlen, "bad connection limits");
        return KVS_ERR_ARG;
    }
    struct sockaddr_in sa = { 0 };
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    if (inet_pton(AF_INET, bind_addr, &sa.sin_addr) != 1) {
        snprintf(errbuf, errlen, "bad bind address '%s' (want an IPv4 address)", bind_addr);
        return KVS_ERR_ARG;
    }
    struct kvs_api_gate *g = calloc(1, sizeof *g);
    if (!g) return KVS_ERR_NOMEM;
    g->n_slots = 2 * max_conn;
    g->slots = calloc((size_t)g->n_slots, sizeof *g->slots);
    g->wake[0] = g->wake[1] = -1;
    g->lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (!g->slots || g->lfd < 0 || pipe2(g->wake, O_CLOEXEC | O_NONBLOCK)) {
        snprintf(errbuf, errlen, "cannot create the API socket: %s", strerror(errno));
        goto fail;
    }
    int one = 1;
    setsockopt(g->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(g->lfd, (struct sockaddr *)&sa, sizeof sa) || listen(g->lfd, 256)) {
        snprintf(errbuf, errlen, "cannot listen on %s:%u: %s", bind_addr, (unsigned)port, strerror(errno));
        goto fail;
    }
    socklen_t sl = sizeof sa;
    getsockname(g->lfd, (struct sockaddr *)&sa, &sl);
    g->port = ntohs(sa.sin_port);
    g->max_conn = max_conn;
    g->per_addr = per_addr;
    g->deadline_ns = (int64_t)request_timeout_s * 1000000000;
    g->met = met;
    pthread_mutex_init(&g->mu, NULL);
    *out = g;
    return KVS_OK;
fail:
    if (g->lfd >= 0) close(g->lfd);
    if (g->wake[0] >= 0) close(g->wake[0]);
    if (g->wake[1] >= 0) close(g->wake[1]);
    free(g->slots);
    free(g);
    return KVS_ERR_NET;
}

uint16_t kvs_api_gate_port(const struct kvs_api_gate *g)
{
    return g->port;
}

/* Called with g->mu held. */
static void shut_slot(struct gate_slot *s)
{
    if (!s->shut) {
        shutdown(s->dupfd, SHUT_RDWR);
        s->shut = true;
    }
}

static void release_slot(struct gate_slot *s)
{
    if (s->dupfd >= 0) close(s->dupfd);
    memset(s, 0, sizeof *s);
    s->dupfd = -1;
}

static void log_refusals(struct kvs_api_gate *g, int64_t now, bool force)
{
    uint64_t total = g->n_refused_full + g->n_refused_addr + g->n_timed_out + g->n_evicted;
    if (!total || (!force && now - g->last_log < LOG_EVERY_NS)) return;
    KVS_LOGW("api: connections refused (all %d slots busy: %llu, over %d per address: %llu), "
             "closed (no whole request within %lld s: %llu, evicted for a new client: %llu)",
             (int)g->max_conn, (unsigned long long)g->n_refused_full, (int)g->per_addr,
             (unsigned long long)g->n_refused_addr, (long long)(g->deadline_ns / 1000000000),
             (unsigned long long)g->n_timed_out, (unsigned long long)g->n_evicted);
    g->n_refused_full = g->n_refused_addr = g->n_timed_out = g->n_evicted = 0;
    g->last_log = now;
}

static void count(struct kvs_api_gate *g, int what)
{
    if (!g->met) return;
    pthread_mutex_lock(&g->met->mu);
    g->met->connections[what]++;
    pthread_mutex_unlock(&g->met->mu);
}

/* Answers 503 on a socket MHD never saw and drains it until the client closes
 * (closing with unread request bytes would send a reset instead of the
 * answer). */
static void refuse(struct kvs_api_gate *g, int fd, const char *why)
{
    char body[256], msg[512];
    int bl = snprintf(body, sizeof body,
                      "{\"error\":{\"message\":\"%s: try again later\",\"type\":\"server_error\","
                      "\"param\":null,\"code\":\"too_many_connections\"}}",
                      why);
    int ml = snprintf(msg, sizeof msg,
                      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                      "Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%s",
                      bl, body);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    ssize_t w = send(fd, msg, (size_t)ml, MSG_NOSIGNAL);
    (void)w; /* a full socket buffer on a fresh connection: nothing better to do */
    shutdown(fd, SHUT_WR);
    if (g->n_lg == LINGER_MAX) {
        close(fd);
        return;
    }
    g->lg[g->n_lg].fd = fd;
    g->lg[g->n_lg].t0 = mono_ns();
    g->n_lg++;
}

static void drain_lingering(struct kvs_api_gate *g, const struct pollfd *pf, int64_t now)
{
    for (int i = 0; i < g->n_lg;) {
        bool done = now - g->lg[i].t0 > (int64_t)LINGER_MS * 1000000;
        if (!done && pf && (pf[i].revents & (POLLIN | POLLERR | POLLHUP))) {
            char buf[4096];
            ssize_t r;
            do r = recv(g->lg[i].fd, buf, sizeof buf, 0);
            while (r > 0);
            done = r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
        }
        if (done) {
            close(g->lg[i].fd);
            g->lg[i] = g->lg[--g->n_lg];
            pf = NULL; /* indices moved: read the rest next round */
        } else {
            i++;
        }
    }
}

/* Deadline: receiving connections past it are shut down. */
static void reap(struct kvs_api_gate *g, int64_t now)
{
    pthread_mutex_lock(&g->mu);
    for (int32_t i = 0; i < g->n_slots; i++) {
        struct gate_slot *s = &g->slots[i];
        if (s->used && s->receiving && !s->shut && now - s->t0 > g->deadline_ns) {
            shut_slot(s);
            g->n_timed_out++;
            count(g, KVS_API_CONN_TIMED_OUT);
        }
    }
    log_refusals(g, now, false);
    pthread_mutex_unlock(&g->mu);
}

static void admit(struct kvs_api_gate *g, int fd, const struct sockaddr_in *ca)
{
    int64_t now = mono_ns();
    uint32_t addr = ca->sin_addr.s_addr;
    pthread_mutex_lock(&g->mu);
    int32_t live = 0, same = 0, free_i = -1, victim = -1, victim_n = 0;
    for (int32_t i = 0; i < g->n_slots; i++) {
        struct gate_slot *s = &g->slots[i];
        if (!s->used) {
            if (free_i < 0) free_i = i;
            continue;
        }
        if (s->shut) continue;
        live++;
        if (s->addr == addr) same++;
    }
    if (live >= g->max_conn && same < g->per_addr) {
        /* the victim: a receiving connection of the address with the most
         * live connections, oldest first (n_slots is small: O(n^2) is fine) */
        for (int32_t i = 0; i < g->n_slots; i++) {
            struct gate_slot *s = &g->slots[i];
            if (!s->used || s->shut || !s->receiving || now - s->t0 < (int64_t)EVICT_MIN_MS * 1000000) continue;
            int32_t n_addr = 0;
            for (int32_t k = 0; k < g->n_slots; k++)
                n_addr += g->slots[k].used && !g->slots[k].shut && g->slots[k].addr == s->addr;
            if (victim < 0 || n_addr > victim_n || (n_addr == victim_n && s->t0 < g->slots[victim].t0)) {
                victim = i;
                victim_n = n_addr;
            }
        }
    }
    const char *why = NULL;
    int what = KVS_API_CONN_ACCEPTED;
    if (same >= g->per_addr) {
        why = "too many connections from this address";
        g->n_refused_addr++;
        what = KVS_API_CONN_REFUSED_ADDR;
    } else if (live >= g->max_conn && victim >= 0 && victim_n > same + 1 && free_i >= 0) {
        shut_slot(&g->slots[victim]);
        g->n_evicted++;
        count(g, KVS_API_CONN_EVICTED);
    } else if (live >= g->max_conn || free_i < 0) {
        why = "the server is at its connection limit";
        g->n_refused_full++;
        what = KVS_API_CONN_REFUSED_FULL;
    }
    int dupfd = why ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (!why && dupfd < 0) {
        why = "the server is out of descriptors";
        g->n_refused_full++;
        what = KVS_API_CONN_REFUSED_FULL;
    }
    if (why) {
        log_refusals(g, now, false);
        pthread_mutex_unlock(&g->mu);
        count(g, what);
        refuse(g, fd, why);
        return;
    }
    struct gate_slot *s = &g->slots[free_i];
    *s = (struct gate_slot){ .used = true, .receiving = true, .fd = fd, .dupfd = dupfd, .addr = addr, .t0 = now };
    pthread_mutex_unlock(&g->mu);
    count(g, what);
    if (MHD_add_connection(g->d, fd, (const struct sockaddr *)ca, sizeof *ca) != MHD_YES) {
        /* MHD closed fd; it never became a connection unless STARTED came */
        pthread_mutex_lock(&g->mu);
        if (s->used && s->fd == fd && !s->started) release_slot(s);
        pthread_mutex_unlock(&g->mu);
    }
}

static void *gate_main(void *arg)
{
    struct kvs_api_gate *g = arg;
    struct pollfd pf[2 + LINGER_MAX];
    for (;;) {
        pf[0] = (struct pollfd){ .fd = g->wake[0], .events = POLLIN };
        pf[1] = (struct pollfd){ .fd = g->lfd, .events = POLLIN };
        int n_lg = g->n_lg;
        for (int i = 0; i < n_lg; i++) pf[2 + i] = (struct pollfd){ .fd = g->lg[i].fd, .events = POLLIN };
        int r = poll(pf, (nfds_t)(2 + n_lg), TICK_MS);
        if (r < 0 && errno != EINTR) break;
        if (pf[0].revents) break;
        int64_t now = mono_ns();
        drain_lingering(g, r > 0 ? pf + 2 : NULL, now);
        if (r > 0 && (pf[1].revents & POLLIN)) {
            for (int k = 0; k < 64; k++) { /* a burst, then back to the deadlines */
                struct sockaddr_in ca;
                socklen_t cl = sizeof ca;
                int fd = accept4(g->lfd, (struct sockaddr *)&ca, &cl, SOCK_CLOEXEC);
                if (fd < 0) break;
                admit(g, fd, &ca);
            }
        }
        reap(g, now);
    }
    return NULL;
}

kvs_err kvs_api_gate_run(struct kvs_api_gate *g, struct MHD_Daemon *d)
{
    g->d = d;
    if (pthread_create(&g->thr, NULL, gate_main, g)) return KVS_ERR_NOMEM;
    g->running = true;
    return KVS_OK;
}

void kvs_api_gate_stop(struct kvs_api_gate *g)
{
    if (!g || !g->running) return;
    ssize_t w = write(g->wake[1], "x", 1);
    (void)w;
    pthread_join(g->thr, NULL);
    g->running = false;
    close(g->lfd);
    g->lfd = -1;
    for (int i = 0; i < g->n_lg; i++) close(g->lg[i].fd);
    g->n_lg = 0;
}

void kvs_api_gate_free(struct kvs_api_gate *g)
{
    if (!g) return;
    kvs_api_gate_stop(g);
    if (g->lfd >= 0) close(g->lfd);
    pthread_mutex_lock(&g->mu);
    log_refusals(g, mono_ns(), true);
    for (int32_t i = 0; i < g->n_slots; i++)
        if (g->slots[i].used) release_slot(&g->slots[i]);
    pthread_mutex_unlock(&g->mu);
    close(g->wake[0]);
    close(g->wake[1]);
    pthread_mutex_destroy(&g->mu);
    free(g->slots);
    free(g);
}

void kvs_api_gate_notify(void *cls, struct MHD_Connection *c, void **socket_context,
                         enum MHD_ConnectionNotificationCode code)
{
    struct kvs_api_gate *g = cls;
    pthread_mutex_lock(&g->mu);
    if (code == MHD_CONNECTION_NOTIFY_STARTED) {
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
        *socket_context = NULL;
        for (int32_t i = 0; ci && i < g->n_slots; i++) {
            struct gate_slot *s = &g->slots[i];
            if (s->used && !s->started && s->fd == ci->connect_fd) {
                s->started = true;
                *socket_context = s;
                break;
            }
        }
    } else if (code == MHD_CONNECTION_NOTIFY_CLOSED && *socket_context) {
        release_slot(*socket_context);
        *socket_context = NULL;
    }
    pthread_mutex_unlock(&g->mu);
}

static struct gate_slot *slot_of(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

void kvs_api_gate_received(struct kvs_api_gate *g, struct MHD_Connection *c)
{
    struct gate_slot *s = slot_of(c);
    if (!s) return;
    pthread_mutex_lock(&g->mu);
    s->receiving = false;
    pthread_mutex_unlock(&g->mu);
}

void kvs_api_gate_request_done(struct kvs_api_gate *g, struct MHD_Connection *c)
{
    struct gate_slot *s = slot_of(c);
    if (!s) return;
    pthread_mutex_lock(&g->mu);
    s->receiving = true; /* a kept-alive connection: the next request's deadline starts now */
    s->t0 = mono_ns();
    pthread_mutex_unlock(&g->mu);
}

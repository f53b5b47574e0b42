/* TCP transport: non-blocking sockets with TCP_NODELAY. */
#include "link/link.h"
#include "link/link_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define ERR(code, ...)                                                                                     \
    do {                                                                                                   \
        if (errbuf && errlen) snprintf(errbuf, errlen, __VA_ARGS__);                                       \
        return code;                                                                                       \
    } while (0)

struct tcp_impl {
    int fd;
};

struct kvs_listener {
    int fd;
    uint16_t port;
};

kvs_err kvs_addr_parse(const char *addr, char *host, size_t hostcap, uint16_t *port, char *errbuf, size_t errlen)
{
    if (!addr) ERR(KVS_ERR_ARG, "no address given");
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr) ERR(KVS_ERR_ARG, "address '%s' is not HOST:PORT", addr);
    const char *h = addr;
    size_t hl = (size_t)(colon - addr);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') { /* [IPv6]:port */
        h++;
        hl -= 2;
    }
    if (hl + 1 > hostcap) ERR(KVS_ERR_ARG, "host of '%s' is too long", addr);
    char *end;
    errno = 0;
    long p = strtol(colon + 1, &end, 10);
    if (errno || end == colon + 1 || *end != '\0' || p < 0 || p > 65535)
        ERR(KVS_ERR_ARG, "port of '%s' is not a number in 0..65535", addr);
    memcpy(host, h, hl);
    host[hl] = '\0';
    *port = (uint16_t)p;
    return KVS_OK;
}

static int set_nonblock(int fd)
{
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

kvs_err kvs_link_fd_read(int fd, void *buf, size_t cap, size_t *got)
{
    for (;;) {
        ssize_t n = recv(fd, buf, cap, 0);
        if (n > 0) {
            *got = (size_t)n;
            return KVS_OK;
        }
        if (n == 0) return KVS_ERR_PEER;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return KVS_ERR_NEED_MORE;
        if (errno == ECONNRESET) return KVS_ERR_PEER;
        return KVS_ERR_IO;
    }
}

kvs_err kvs_link_fd_write(int fd, const void *buf, size_t len, int timeout_ms)
{
    const uint8_t *p = buf;
    int64_t deadline = timeout_ms < 0 ? -1 : kvs_link_now_ms() + timeout_ms;
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int wait = -1;
            if (deadline >= 0) {
                int64_t left = deadline - kvs_link_now_ms();
                if (left <= 0) return KVS_ERR_TIMEOUT;
                wait = (int)left;
            }
            struct pollfd pfd = { .fd = fd, .events = POLLOUT };
            int r = poll(&pfd, 1, wait);
            if (r < 0 && errno != EINTR) return KVS_ERR_IO;
            if (r == 0) return KVS_ERR_TIMEOUT;
            continue;
        }
        if (n < 0 && (errno == EPIPE || errno == ECONNRESET)) return KVS_ERR_PEER;
        return KVS_ERR_IO;
    }
    return KVS_OK;
}

static kvs_err tcp_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    return kvs_link_fd_read(((struct tcp_impl *)l->impl)->fd, buf, cap, got);
}

static kvs_err tcp_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    return kvs_link_fd_write(((struct tcp_impl *)l->impl)->fd, buf, len, timeout_ms);
}

static int tcp_fd(const struct kvs_link *l)
{
    const struct tcp_impl *t = l->impl;
    return t->fd;
}

static void tcp_close(struct kvs_link *l)
{
    struct tcp_impl *t = l->impl;
    if (t && t->fd >= 0) close(t->fd);
    free(t);
    free(l);
}

static const struct kvs_link_ops tcp_ops = {
    .name = "tcp", .read = tcp_read, .write = tcp_write, .fd = tcp_fd, .close = tcp_close,
};

/* Wraps a connected socket (takes ownership of fd; closes it on failure). */
static kvs_err wrap_fd(int fd, const char *peer, struct kvs_link **out)
{
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct kvs_link *l = calloc(1, sizeof *l);
    struct tcp_impl *t = calloc(1, sizeof *t);
    if (!l || !t || set_nonblock(fd) < 0) {
        free(l);
        free(t);
        close(fd);
        return KVS_ERR_NOMEM;
    }
    t->fd = fd;
    l->ops = &tcp_ops;
    l->impl = t;
    snprintf(l->peer, sizeof l->peer, "%s", peer);
    *out = l;
    return KVS_OK;
}

static kvs_err resolve(const char *addr, int passive, struct addrinfo **res, char *errbuf, size_t errlen)
{
    char host[256], port_s[8];
    uint16_t port;
    kvs_err e = kvs_addr_parse(addr, host, sizeof host, &port, errbuf, errlen);
    if (e) return e;
    snprintf(port_s, sizeof port_s, "%u", port);
    struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                              .ai_flags = passive ? AI_PASSIVE : 0 };
    int r = getaddrinfo(host[0] ? host : NULL, port_s, &hints, res);
    if (r) ERR(KVS_ERR_NET, "cannot resolve '%s': %s", addr, gai_strerror(r));
    return KVS_OK;
}

kvs_err kvs_tcp_listen(const char *addr, struct kvs_listener **out, char *errbuf, size_t errlen)
{
    struct addrinfo *res;
    kvs_err e = resolve(addr, 1, &res, errbuf, errlen);
    if (e) return e;
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 16) == 0 && set_nonblock(fd) == 0) break;
        err = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) ERR(KVS_ERR_NET, "cannot listen on %s: %s", addr, strerror(err));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    uint16_t port = 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6) port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    struct kvs_listener *s = calloc(1, sizeof *s);
    if (!s) {
        close(fd);
        return KVS_ERR_NOMEM;
    }
    s->fd = fd;
    s->port = port;
    *out = s;
    return KVS_OK;
}

uint16_t kvs_listener_port(const struct kvs_listener *s)
{
    return s ? s->port : 0;
}

int kvs_listener_fd(const struct kvs_listener *s)
{
    return s ? s->fd : -1;
}

void kvs_listener_close(struct kvs_listener *s)
{
    if (!s) return;
    close(s->fd);
    free(s);
}

kvs_err kvs_tcp_accept(struct kvs_listener *s, struct kvs_link **out)
{
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd;
    do {
        fd = accept4(s->fd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ECONNABORTED) return KVS_ERR_NEED_MORE;
        return KVS_ERR_NET;
    }
    char host[48] = "?", serv[8] = "?", peer[64];
    getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    snprintf(peer, sizeof peer, "%s:%s", host, serv);
    return wrap_fd(fd, peer, out);
}

kvs_err kvs_tcp_dial(const char *addr, int timeout_ms, struct kvs_link **out, char *errbuf, size_t errlen)
{
    struct addrinfo *res;
    kvs_err e = resolve(addr, 0, &res, errbuf, errlen);
    if (e) return e;
    int fd = -1, err = ECONNREFUSED;
    kvs_err code = KVS_ERR_NET;
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
        if (fd < 0) {
            err = errno;
            continue;
        }
        int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
        if (r < 0 && errno == EINPROGRESS) {
            struct pollfd pfd = { .fd = fd, .events = POLLOUT };
            do {
                r = poll(&pfd, 1, timeout_ms);
            } while (r < 0 && errno == EINTR);
            if (r == 0) {
                err = ETIMEDOUT;
                code = KVS_ERR_TIMEOUT;
                r = -1;
            } else if (r > 0) {
                int soerr = 0;
                socklen_t sl = sizeof soerr;
                getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
                if (soerr) {
                    err = soerr;
                    code = KVS_ERR_NET;
                    r = -1;
                } else {
                    r = 0;
                }
            } else {
                err = errno;
            }
        } else if (r < 0) {
            err = errno;
        }
        if (r == 0) break;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) ERR(code, "cannot connect to %s: %s", addr, strerror(err));
    return wrap_fd(fd, addr, out);
}

kvs_err kvs_tcp_dial_retry(const char *addr, int total_ms, struct kvs_link **out, char *errbuf, size_t errlen)
{
    int64_t deadline = kvs_link_now_ms() + total_ms;
    for (int attempt = 0;; attempt++) {
        kvs_err e = kvs_tcp_dial(addr, 1000, out, errbuf, errlen);
        if (e == KVS_OK || e == KVS_ERR_ARG) return e;
        int64_t left = deadline - kvs_link_now_ms();
        if (left <= 0) return KVS_ERR_TIMEOUT;
        int wait = kvs_link_backoff_ms(attempt);
        if (wait > left) wait = (int)left;
        poll(NULL, 0, wait);
    }
}

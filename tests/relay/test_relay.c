/* Relay tests over loopback (docs/RELAY.md): the pure checks, pairing and
 * bytes both ways through kvs_ws_dial links, the refusal table (each row's
 * close code and counter), takeover of a dead holder vs. a live one,
 * backpressure with a bounded edge buffer, 1000 idle unpaired connections
 * not stopping a new edge from pairing, /health and /metrics. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "link/link.h"
#include "relay/relay.h"

static const uint8_t SECRET[] = "test-relay-secret-0123456789";
#define SECRET_LEN (sizeof SECRET - 1)

struct running {
    struct kvs_relay *r;
    pthread_t th;
    uint16_t port;
};

static void *run_thread(void *arg)
{
    kvs_relay_run(arg);
    return NULL;
}

static void start(struct running *rr, struct kvs_relay_params *p)
{
    p->listen = "127.0.0.1:0";
    p->secret = SECRET;
    p->secret_len = SECRET_LEN;
    char err[256] = "";
    kvs_err e = kvs_relay_create(p, &rr->r, err, sizeof err);
    if (e) fprintf(stderr, "relay: %s\n", err);
    assert_int_equal(e, KVS_OK);
    rr->port = kvs_relay_port(rr->r);
    assert_true(rr->port > 0);
    assert_int_equal(pthread_create(&rr->th, NULL, run_thread, rr->r), 0);
}

static void stop(struct running *rr)
{
    kvs_relay_stop(rr->r);
    pthread_join(rr->th, NULL);
    kvs_relay_free(rr->r);
}

static void url_of(char *buf, size_t cap, uint16_t port, const char *edge, bool with_token)
{
    char tok[65];
    assert_int_equal(kvs_relay_token(SECRET, SECRET_LEN, edge, tok), KVS_OK);
    snprintf(buf, cap, "ws://127.0.0.1:%u/edge/%s%s%s", port, edge, with_token ? "?token=" : "", with_token ? tok : "");
}

static struct kvs_link *dial(uint16_t port, const char *edge, uint8_t role)
{
    char url[256], err[256] = "";
    url_of(url, sizeof url, port, edge, true);
    struct kvs_ws_opts o = { .role = role };
    struct kvs_link *l = NULL;
    kvs_err e = kvs_ws_dial(url, &o, 2000, &l, err, sizeof err);
    if (e) fprintf(stderr, "dial: %s\n", err);
    assert_int_equal(e, KVS_OK);
    return l;
}

/* Reads exactly n bytes within timeout_ms; returns bytes read. */
static size_t read_n(struct kvs_link *l, uint8_t *buf, size_t n, int timeout_ms)
{
    size_t have = 0;
    int64_t dl = kvs_link_now_ms() + timeout_ms;
    while (have < n && kvs_link_now_ms() < dl) {
        struct pollfd p = { .fd = kvs_link_fd(l), .events = POLLIN };
        poll(&p, 1, 50);
        size_t got;
        kvs_err e = kvs_link_read(l, buf + have, n - have, &got);
        if (e == KVS_ERR_NEED_MORE) continue;
        if (e) break;
        have += got;
    }
    return have;
}

static void get_stats(struct running *rr, struct kvs_relay_stats *st)
{
    kvs_relay_get_stats(rr->r, st);
}

static bool wait_stat(struct running *rr, size_t off, uint64_t want, int ms)
{
    int64_t dl = kvs_link_now_ms() + ms;
    struct kvs_relay_stats st;
    for (;;) {
        get_stats(rr, &st);
        uint64_t v;
        memcpy(&v, (const uint8_t *)&st + off, sizeof v);
        if (v == want) return true;
        if (kvs_link_now_ms() > dl) {
            fprintf(stderr, "stat at %zu is %llu, want %llu\n", off, (unsigned long long)v, (unsigned long long)want);
            return false;
        }
        poll(NULL, 0, 10);
    }
}
#define WAIT_STAT(rr, field, want, ms) wait_stat(rr, offsetof(struct kvs_relay_stats, field), want, ms)

/* --- a raw WebSocket client, to send what a correct client never would ------ */

static int tcp_connect(uint16_t port)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* Upgrade on path with an Authorization value (NULL: none). Returns the fd, or
 * -1 if the server did not answer 101. */
static int raw_open(uint16_t port, const char *path, const char *auth)
{
    int fd = tcp_connect(port);
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
                     "Sec-WebSocket-Protocol: kvasir-relay.1\r\n%s%s%s\r\n",
                     path, auth ? "Authorization: " : "", auth ? auth : "", auth ? "\r\n" : "");
    assert_int_equal(write(fd, req, (size_t)n), n);
    char buf[2048];
    size_t have = 0;
    struct timeval tv = { .tv_sec = 3 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    while (have < sizeof buf - 1) { /* byte by byte: nothing after the head is consumed */
        ssize_t r = read(fd, buf + have, 1);
        if (r <= 0) break;
        have++;
        buf[have] = '\0';
        if (have >= 4 && !memcmp(buf + have - 4, "\r\n\r\n", 4)) break;
    }
    buf[have] = '\0';
    if (strncmp(buf, "HTTP/1.1 101", 12)) {
        close(fd);
        return -1;
    }
    return fd;
}

static void raw_send(int fd, uint8_t opcode, const void *data, size_t len)
{
    uint8_t *f = malloc(len + 14);
    size_t h = 2;
    f[0] = (uint8_t)(0x80 | opcode);
    if (len < 126) {
        f[1] = (uint8_t)(0x80 | len);
    } else if (len < 65536) {
        f[1] = 0x80 | 126;
        f[2] = (uint8_t)(len >> 8);
        f[3] = (uint8_t)len;
        h = 4;
    } else {
        f[1] = 0x80 | 127;
        for (int i = 0; i < 8; i++) f[2 + i] = (uint8_t)((uint64_t)len >> (56 - 8 * i));
        h = 10;
    }
    memset(f + h, 0, 4); /* mask key 0: payload unchanged */
    memcpy(f + h + 4, data, len);
    size_t n = h + 4 + len, off = 0;
    while (off < n) {
        ssize_t w = send(fd, f + off, n - off, MSG_NOSIGNAL);
        if (w <= 0) break; /* the relay may close mid-way (oversized) */
        off += (size_t)w;
    }
    free(f);
}

/* Reads frames until a close frame; returns its code, 0 for EOF without one,
 * -1 on timeout. Pings are not answered (a raw client looks dead). */
static int raw_close_code(int fd, int timeout_ms)
{
    struct timeval tv = { .tv_sec = timeout_ms / 1000, .tv_usec = (timeout_ms % 1000) * 1000 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    uint8_t h[10];
    for (;;) {
        if (read(fd, h, 2) != 2) return 0;
        uint64_t len = h[1] & 0x7f;
        if (len == 126) {
            if (read(fd, h + 2, 2) != 2) return 0;
            len = ((uint64_t)h[2] << 8) | h[3];
        } else if (len == 127) {
            uint8_t b[8];
            if (read(fd, b, 8) != 8) return 0;
            len = 0;
            for (int i = 0; i < 8; i++) len = (len << 8) | b[i];
        }
        uint8_t *p = malloc(len + 1);
        size_t have = 0;
        while (have < len) {
            ssize_t r = read(fd, p + have, len - have);
            if (r <= 0) {
                free(p);
                return errno == EAGAIN ? -1 : 0;
            }
            have += (size_t)r;
        }
        int op = h[0] & 0x0f;
        int code = len >= 2 ? (p[0] << 8) | p[1] : 1005;
        free(p);
        if (op == 8) return code;
    }
}

static int raw_edge(uint16_t port, const char *edge)
{
    char tok[65], path[128], auth[128];
    kvs_relay_token(SECRET, SECRET_LEN, edge, tok);
    snprintf(path, sizeof path, "/edge/%s", edge);
    snprintf(auth, sizeof auth, "Bearer %s", tok);
    return raw_open(port, path, auth);
}

/* --- tests ------------------------------------------------------------------- */

static void test_checks(void **state)
{
    (void)state;
    char edge[65], tok[65], auth[80];
    assert_int_equal(kvs_relay_token(SECRET, SECRET_LEN, "e1", tok), KVS_OK);
    assert_int_equal(strlen(tok), 64);
    /* the token is HMAC-SHA-256("test-relay-secret-0123456789", "kvasir-relay-edge:e1")
     * (computed independently: openssl dgst -sha256 -hmac ...) */
    assert_string_equal(tok, "ae2779854a095e2c4e483411e3bf36bfed3440dc85251898e829f784d089eeee");
    snprintf(auth, sizeof auth, "Bearer %s", tok);
    assert_int_equal(kvs_relay_check_request("/edge/e1", auth, SECRET, SECRET_LEN, edge), KVS_RELAY_OK);
    assert_string_equal(edge, "e1");
    assert_int_equal(kvs_relay_check_request("/edge/e2", auth, SECRET, SECRET_LEN, edge), KVS_RELAY_BAD_TOKEN);
    assert_int_equal(kvs_relay_check_request("/edge/e1", NULL, SECRET, SECRET_LEN, edge), KVS_RELAY_NO_TOKEN);
    assert_int_equal(kvs_relay_check_request("/edge/e1", "Basic abc", SECRET, SECRET_LEN, edge), KVS_RELAY_NO_TOKEN);
    assert_int_equal(kvs_relay_check_request("/edge/e1", "Bearer 12", SECRET, SECRET_LEN, edge), KVS_RELAY_NO_TOKEN);
    assert_int_equal(kvs_relay_check_request("/edges/e1", auth, SECRET, SECRET_LEN, edge), KVS_RELAY_BAD_PATH);
    assert_int_equal(kvs_relay_check_request("/edge/", auth, SECRET, SECRET_LEN, edge), KVS_RELAY_BAD_PATH);
    assert_int_equal(kvs_relay_check_request("/edge/a/b", auth, SECRET, SECRET_LEN, edge), KVS_RELAY_BAD_PATH);
    char longid[80];
    memset(longid, 'a', sizeof longid);
    memcpy(longid, "/edge/", 6);
    longid[6 + 65] = '\0';
    assert_int_equal(kvs_relay_check_request(longid, auth, SECRET, SECRET_LEN, edge), KVS_RELAY_BAD_PATH);
    uint8_t role = 0;
    const uint8_t up[] = { 1, 9, 9 }, down[] = { 2 }, bad[] = { 3 }, zero[] = { 0 };
    assert_int_equal(kvs_relay_check_preamble(up, 3, &role), KVS_RELAY_OK);
    assert_int_equal(role, KVS_RELAY_ROLE_UP);
    assert_int_equal(kvs_relay_check_preamble(down, 1, &role), KVS_RELAY_OK);
    assert_int_equal(role, KVS_RELAY_ROLE_DOWN);
    assert_int_equal(kvs_relay_check_preamble(bad, 1, &role), KVS_RELAY_BAD_ROLE);
    assert_int_equal(kvs_relay_check_preamble(zero, 1, &role), KVS_RELAY_BAD_ROLE);
    assert_int_equal(kvs_relay_check_preamble(up, 0, &role), KVS_RELAY_BAD_ROLE);
    /* URLs */
    struct kvs_ws_url u;
    char err[256];
    assert_int_equal(kvs_ws_url_parse("wss://relay.example/edge/r1-0", &u, err, sizeof err), KVS_OK);
    assert_true(u.tls);
    assert_string_equal(u.host, "relay.example");
    assert_int_equal(u.port, 443);
    assert_string_equal(u.edge, "r1-0");
    assert_string_equal(u.token, "");
    char url[200];
    snprintf(url, sizeof url, "ws://[::1]:8080/edge/x?token=%s", tok);
    assert_int_equal(kvs_ws_url_parse(url, &u, err, sizeof err), KVS_OK);
    assert_false(u.tls);
    assert_string_equal(u.host, "::1");
    assert_int_equal(u.port, 8080);
    assert_string_equal(u.token, tok);
    assert_int_equal(kvs_ws_url_parse("http://h/edge/x", &u, err, sizeof err), KVS_ERR_ARG);
    assert_int_equal(kvs_ws_url_parse("ws://h:0/edge/x", &u, err, sizeof err), KVS_ERR_ARG);
    assert_int_equal(kvs_ws_url_parse("ws://h/other/x", &u, err, sizeof err), KVS_ERR_ARG);
    assert_int_equal(kvs_ws_url_parse("ws://h/edge/x?token=zz", &u, err, sizeof err), KVS_ERR_ARG);
    assert_int_equal(kvs_ws_url_parse("ws:///edge/x", &u, err, sizeof err), KVS_ERR_ARG);
    assert_true(kvs_ws_is_url("wss://a/edge/b"));
    assert_false(kvs_ws_is_url("127.0.0.1:7001"));
}

struct writer {
    struct kvs_link *l;
    const uint8_t *p;
    size_t n;
    kvs_err e;
};

static void *write_thread(void *arg)
{
    struct writer *w = arg;
    w->e = kvs_link_write(w->l, w->p, w->n, 10000);
    return NULL;
}

static void test_pair_both_ways(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    start(&rr, &p);
    struct kvs_link *up = dial(rr.port, "pair", KVS_RELAY_ROLE_UP);
    /* bytes written before the partner comes are held and delivered */
    assert_int_equal(kvs_link_write(up, "early", 5, 1000), KVS_OK);
    struct kvs_link *down = dial(rr.port, "pair", KVS_RELAY_ROLE_DOWN);
    uint8_t got[8];
    assert_int_equal(read_n(down, got, 5, 3000), 5);
    assert_memory_equal(got, "early", 5);
    const size_t n = 3u << 20;
    uint8_t *big = malloc(n), *back = malloc(n);
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)(i * 2654435761u >> 13);
    struct writer w = { up, big, n, KVS_ERR_INTERNAL };
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, write_thread, &w), 0);
    size_t recvd = read_n(down, back, n, 10000);
    pthread_join(th, NULL);
    assert_int_equal(w.e, KVS_OK);
    assert_int_equal(recvd, n);
    assert_memory_equal(back, big, n);
    assert_int_equal(kvs_link_write(down, "reply", 5, 1000), KVS_OK);
    assert_int_equal(read_n(up, got, 5, 3000), 5);
    assert_memory_equal(got, "reply", 5);
    assert_true(WAIT_STAT(&rr, bytes_up, n + 5, 2000)); /* counted after the write the reader saw */
    assert_true(WAIT_STAT(&rr, bytes_down, 5, 2000));
    struct kvs_relay_stats st;
    get_stats(&rr, &st);
    assert_int_equal(st.edges_paired, 1);
    assert_int_equal(st.pairings, 1);
    assert_int_equal(st.connections, 2);
    /* one end closes: the other reads EOF (after everything sent) */
    assert_int_equal(kvs_link_write(up, "bye", 3, 1000), KVS_OK);
    kvs_link_close(up);
    assert_int_equal(read_n(down, got, 3, 3000), 3);
    assert_memory_equal(got, "bye", 3);
    size_t g;
    kvs_err e = KVS_ERR_NEED_MORE;
    int64_t dl = kvs_link_now_ms() + 3000;
    while (e == KVS_ERR_NEED_MORE && kvs_link_now_ms() < dl) {
        poll(NULL, 0, 10);
        e = kvs_link_read(down, got, sizeof got, &g);
    }
    assert_int_equal(e, KVS_ERR_PEER);
    kvs_link_close(down);
    assert_true(WAIT_STAT(&rr, connections, 0, 3000));
    assert_true(WAIT_STAT(&rr, edges_paired, 0, 1000));
    free(big);
    free(back);
    stop(&rr);
}

/* The refusal table: each row is refused with its close code and counted. */
static void test_refusals(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.handshake_ms = 600;
    p.max_message = 4096;
    start(&rr, &p);
    char tok[65], auth[100], wrong[100];
    kvs_relay_token(SECRET, SECRET_LEN, "t1", tok);
    snprintf(auth, sizeof auth, "Bearer %s", tok);
    kvs_relay_token(SECRET, SECRET_LEN, "t2", tok); /* a valid token of another edge */
    snprintf(wrong, sizeof wrong, "Bearer %s", tok);
    struct {
        const char *what, *path, *auth;
        int first; /* first message: role byte, -1 none, -2 oversized, -3 text */
        int code;
        enum kvs_relay_refusal why;
    } rows[] = {
        { "no token", "/edge/t1", NULL, 1, 4401, KVS_RELAY_NO_TOKEN },
        { "malformed token", "/edge/t1", "Bearer 1234", 1, 4401, KVS_RELAY_NO_TOKEN },
        { "wrong token", "/edge/t1", wrong, 1, 4403, KVS_RELAY_BAD_TOKEN },
        { "bad path", "/edges/t1", auth, 1, 4400, KVS_RELAY_BAD_PATH },
        { "bad role", "/edge/t1", auth, 7, 4406, KVS_RELAY_BAD_ROLE },
        { "oversized message", "/edge/t1", auth, -2, 1009, KVS_RELAY_TOO_BIG },
        { "text message", "/edge/t1", auth, -3, 1003, KVS_RELAY_PROTOCOL },
        { "slow handshake (no preamble)", "/edge/t1", auth, -1, 4408, KVS_RELAY_HANDSHAKE },
    };
    uint64_t want[KVS_RELAY_REFUSAL_COUNT_] = { 0 };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        int fd = raw_open(rr.port, rows[i].path, rows[i].auth);
        assert_true(fd >= 0);
        if (rows[i].first >= 0) {
            uint8_t b = (uint8_t)rows[i].first;
            raw_send(fd, 2, &b, 1);
        } else if (rows[i].first == -2) {
            uint8_t *big = calloc(1, 5000);
            big[0] = 1;
            raw_send(fd, 2, big, 5000);
            free(big);
        } else if (rows[i].first == -3) {
            raw_send(fd, 1, "\x01hello", 6);
        }
        int code = raw_close_code(fd, 3000);
        if (code != rows[i].code) fprintf(stderr, "row '%s': close code %d\n", rows[i].what, code);
        assert_int_equal(code, rows[i].code);
        close(fd);
        want[rows[i].why]++;
    }
    /* third connection: both ends held by live clients */
    struct kvs_link *up = dial(rr.port, "t1", KVS_RELAY_ROLE_UP);
    struct kvs_link *down = dial(rr.port, "t1", KVS_RELAY_ROLE_DOWN);
    assert_true(WAIT_STAT(&rr, edges_paired, 1, 2000));
    int fd = raw_edge(rr.port, "t1");
    uint8_t b = KVS_RELAY_ROLE_UP;
    raw_send(fd, 2, &b, 1);
    assert_int_equal(raw_close_code(fd, 3000), 4409);
    close(fd);
    want[KVS_RELAY_ROLE_TAKEN]++;
    /* the live edge still works */
    assert_int_equal(kvs_link_write(up, "still", 5, 1000), KVS_OK);
    uint8_t got[5];
    assert_int_equal(read_n(down, got, 5, 3000), 5);
    assert_memory_equal(got, "still", 5);
    /* slow handshake before the upgrade: a TCP connection that says nothing is closed */
    int tfd = tcp_connect(rr.port);
    struct pollfd pf = { .fd = tfd, .events = POLLIN };
    int64_t t0 = kvs_link_now_ms();
    assert_int_equal(poll(&pf, 1, 4000), 1);
    char c;
    assert_true(read(tfd, &c, 1) <= 0);
    assert_true(kvs_link_now_ms() - t0 < 3000);
    close(tfd);
    struct kvs_relay_stats st;
    get_stats(&rr, &st);
    for (int i = 1; i < KVS_RELAY_REFUSAL_COUNT_; i++) {
        if (st.refusals[i] != want[i])
            fprintf(stderr, "refusals[%s] = %llu, want %llu\n", kvs_relay_refusal_name((enum kvs_relay_refusal)i),
                    (unsigned long long)st.refusals[i], (unsigned long long)want[i]);
        assert_int_equal(st.refusals[i], want[i]);
    }
    char text[8192];
    kvs_relay_metrics_text(&st, text, sizeof text);
    assert_non_null(strstr(text, "kvasir_relay_refusals_total{reason=\"no_token\"} 2\n"));
    assert_non_null(strstr(text, "kvasir_relay_refusals_total{reason=\"role_taken\"} 1\n"));
    assert_non_null(strstr(text, "kvasir_relay_edges_paired 1\n"));
    kvs_link_close(up);
    kvs_link_close(down);
    stop(&rr);
}

static void test_limits(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.max_per_addr = 3;
    p.partner_ms = 400;
    start(&rr, &p);
    int fds[3];
    for (int i = 0; i < 3; i++) {
        char e[16];
        snprintf(e, sizeof e, "lim%d", i);
        fds[i] = raw_edge(rr.port, e);
        assert_true(fds[i] >= 0);
    }
    int fd = raw_edge(rr.port, "lim9");
    assert_int_equal(raw_close_code(fd, 3000), 4429);
    close(fd);
    for (int i = 0; i < 3; i++) close(fds[i]);
    assert_true(WAIT_STAT(&rr, connections, 0, 3000));
    /* partner timeout */
    fd = raw_edge(rr.port, "lonely");
    uint8_t b = KVS_RELAY_ROLE_UP;
    raw_send(fd, 2, &b, 1);
    int64_t t0 = kvs_link_now_ms();
    assert_int_equal(raw_close_code(fd, 3000), 4410);
    int64_t dt = kvs_link_now_ms() - t0;
    assert_true(dt >= 300 && dt < 2000);
    close(fd);
    struct kvs_relay_stats st;
    get_stats(&rr, &st);
    assert_int_equal(st.refusals[KVS_RELAY_PER_ADDR], 1);
    assert_int_equal(st.refusals[KVS_RELAY_NO_PARTNER], 1);
    stop(&rr);

    /* relay-wide bound on unpaired connections */
    p = kvs_relay_default_params();
    p.max_unpaired = 2;
    start(&rr, &p);
    fds[0] = raw_edge(rr.port, "u0");
    fds[1] = raw_edge(rr.port, "u1");
    fd = raw_edge(rr.port, "u2");
    assert_int_equal(raw_close_code(fd, 3000), 4503);
    close(fd);
    close(fds[0]);
    close(fds[1]);
    stop(&rr);
}

/* A restarted stage wins over its own dead connection; a stranger (even
 * with the token) does not steal a live edge. */
static void test_takeover(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.takeover_ms = 300;
    start(&rr, &p);
    /* dead holder: a raw client that never answers pings */
    int dead = raw_edge(rr.port, "tk");
    uint8_t b = KVS_RELAY_ROLE_UP;
    raw_send(dead, 2, &b, 1);
    struct kvs_link *down = dial(rr.port, "tk", KVS_RELAY_ROLE_DOWN);
    assert_true(WAIT_STAT(&rr, edges_paired, 1, 2000));
    struct kvs_link *up = dial(rr.port, "tk", KVS_RELAY_ROLE_UP); /* the restarted stage */
    assert_true(WAIT_STAT(&rr, takeovers, 1, 3000));
    assert_int_equal(raw_close_code(dead, 3000), 4000);
    close(dead);
    /* the old partner was closed with the dead end (like a TCP peer) and redials */
    uint8_t got[8];
    size_t g;
    kvs_err e = KVS_ERR_NEED_MORE;
    int64_t dl = kvs_link_now_ms() + 3000;
    while (e == KVS_ERR_NEED_MORE && kvs_link_now_ms() < dl) {
        poll(NULL, 0, 10);
        e = kvs_link_read(down, got, sizeof got, &g);
    }
    assert_int_equal(e, KVS_ERR_PEER);
    kvs_link_close(down);
    down = dial(rr.port, "tk", KVS_RELAY_ROLE_DOWN);
    assert_int_equal(kvs_link_write(up, "new", 3, 1000), KVS_OK);
    assert_int_equal(read_n(down, got, 3, 3000), 3);
    assert_memory_equal(got, "new", 3);
    /* live holder: the stranger is refused, the edge keeps working */
    int stranger = raw_edge(rr.port, "tk");
    raw_send(stranger, 2, &b, 1);
    assert_int_equal(raw_close_code(stranger, 3000), 4409);
    close(stranger);
    assert_int_equal(kvs_link_write(up, "same", 4, 1000), KVS_OK);
    assert_int_equal(read_n(down, got, 4, 3000), 4);
    assert_memory_equal(got, "same", 4);
    struct kvs_relay_stats st;
    get_stats(&rr, &st);
    assert_int_equal(st.takeovers, 1);
    assert_int_equal(st.refusals[KVS_RELAY_ROLE_TAKEN], 1);
    kvs_link_close(up);
    kvs_link_close(down);
    stop(&rr);
}

/* A reader that does not read slows its writer: the writer's write times
 * out, the relay holds at most edge_buffer + one read, and every byte then
 * arrives in order. */
static void test_backpressure(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.edge_buffer = 256u << 10;
    start(&rr, &p);
    struct kvs_link *up = dial(rr.port, "bp", KVS_RELAY_ROLE_UP);
    struct kvs_link *down = dial(rr.port, "bp", KVS_RELAY_ROLE_DOWN);
    assert_true(WAIT_STAT(&rr, edges_paired, 1, 2000));
    const size_t cap = 64u << 20, piece = 65536;
    uint8_t *big = malloc(cap);
    for (size_t i = 0; i < cap; i++) big[i] = (uint8_t)(i ^ (i >> 9));
    size_t sent = 0;
    while (sent < cap && kvs_link_write(up, big + sent, piece, 300) == KVS_OK) sent += piece;
    fprintf(stderr, "backpressure: %zu bytes accepted before the writer blocked\n", sent);
    assert_true(sent < cap); /* the writer was stopped */
    struct kvs_relay_stats st;
    get_stats(&rr, &st);
    assert_true(st.buffered_max <= p.edge_buffer + 65536 + 16);
    uint8_t *back = malloc(sent + piece);
    size_t got = read_n(down, back, sent, 20000);
    assert_int_equal(got, sent);
    assert_memory_equal(back, big, sent);
    free(back);
    free(big);
    kvs_link_close(up);
    kvs_link_close(down);
    stop(&rr);
}

/* 1000 idle unpaired connections (and 100 silent TCP connections) held
 * open do not stop a new edge from pairing. */
static void test_idle_flood(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.max_per_addr = 5000;
    start(&rr, &p);
    enum { N = 1000, T = 100 };
    static int fds[N + T];
    for (int i = 0; i < N; i++) {
        char e[16];
        snprintf(e, sizeof e, "idle%d", i);
        fds[i] = raw_edge(rr.port, e);
        assert_true(fds[i] >= 0);
        uint8_t b = (uint8_t)(i & 1 ? KVS_RELAY_ROLE_UP : KVS_RELAY_ROLE_DOWN);
        raw_send(fds[i], 2, &b, 1);
    }
    for (int i = 0; i < T; i++) fds[N + i] = tcp_connect(rr.port);
    assert_true(WAIT_STAT(&rr, unpaired, N, 5000));
    int64_t t0 = kvs_link_now_ms();
    struct kvs_link *up = dial(rr.port, "fresh", KVS_RELAY_ROLE_UP);
    struct kvs_link *down = dial(rr.port, "fresh", KVS_RELAY_ROLE_DOWN);
    assert_int_equal(kvs_link_write(up, "hello", 5, 1000), KVS_OK);
    uint8_t got[5];
    assert_int_equal(read_n(down, got, 5, 3000), 5);
    assert_memory_equal(got, "hello", 5);
    fprintf(stderr, "idle flood: new edge paired and carried bytes in %lld ms with %d idle unpaired\n",
            (long long)(kvs_link_now_ms() - t0), N);
    assert_true(kvs_link_now_ms() - t0 < 2000);
    kvs_link_close(up);
    kvs_link_close(down);
    for (int i = 0; i < N + T; i++) close(fds[i]);
    stop(&rr);
}

/* wss://: TLS with a self-signed certificate the test makes; the client
 * trusts it as its CA file; another certificate, or a host the certificate
 * does not name, is refused with the reason. */
static void test_tls(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvs-relay-tls-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char cmd[1024];
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd,
                 "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout %s/k%d.pem "
                 "-out %s/c%d.pem -days 2 -subj /CN=relay -addext subjectAltName=IP:127.0.0.1 2>/dev/null",
                 dir, i, dir, i);
        assert_int_equal(system(cmd), 0);
    }
    char cert[128], key[128], other[128];
    snprintf(cert, sizeof cert, "%s/c0.pem", dir);
    snprintf(key, sizeof key, "%s/k0.pem", dir);
    snprintf(other, sizeof other, "%s/c1.pem", dir);
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.cert_file = cert;
    p.key_file = key;
    start(&rr, &p);
    char tok[65], url[256], err[256];
    kvs_relay_token(SECRET, SECRET_LEN, "tls", tok);
    snprintf(url, sizeof url, "wss://127.0.0.1:%u/edge/tls?token=%s", rr.port, tok);
    struct kvs_ws_opts o = { .role = KVS_RELAY_ROLE_UP, .ca_file = cert };
    struct kvs_link *up = NULL, *down = NULL;
    assert_int_equal(kvs_ws_dial(url, &o, 3000, &up, err, sizeof err), KVS_OK);
    o.role = KVS_RELAY_ROLE_DOWN;
    assert_int_equal(kvs_ws_dial(url, &o, 3000, &down, err, sizeof err), KVS_OK);
    uint8_t buf[100000], got[100000];
    for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(i * 7);
    assert_int_equal(kvs_link_write(up, buf, sizeof buf, 3000), KVS_OK);
    assert_int_equal(read_n(down, got, sizeof got, 5000), sizeof got);
    assert_memory_equal(got, buf, sizeof buf);
    assert_int_equal(kvs_link_write(down, "back", 4, 1000), KVS_OK);
    assert_int_equal(read_n(up, got, 4, 3000), 4);
    assert_memory_equal(got, "back", 4);
    kvs_link_close(up);
    kvs_link_close(down);
    /* an untrusted certificate */
    struct kvs_link *l = NULL;
    o.ca_file = other;
    err[0] = '\0';
    assert_int_equal(kvs_ws_dial(url, &o, 3000, &l, err, sizeof err), KVS_ERR_NET);
    assert_null(l);
    assert_non_null(strstr(err, "certificate not trusted"));
    /* the right certificate, but not for this host name */
    snprintf(url, sizeof url, "wss://localhost:%u/edge/tls?token=%s", rr.port, tok);
    o.ca_file = cert;
    err[0] = '\0';
    assert_int_equal(kvs_ws_dial(url, &o, 3000, &l, err, sizeof err), KVS_ERR_NET);
    assert_non_null(strstr(err, "certificate not trusted"));
    /* a pinned certificate hash (SHA-256 of the DER) instead of a CA: it needs
     * neither a trusted chain nor the host name; another hash is refused */
    char pins[2][65];
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "openssl x509 -in %s/c%d.pem -outform DER | sha256sum | cut -c1-64", dir, i);
        FILE *pf = popen(cmd, "r");
        assert_non_null(pf);
        assert_non_null(fgets(pins[i], sizeof pins[i], pf));
        pclose(pf);
        assert_true(kvs_relay_hex64(pins[i]));
    }
    struct kvs_ws_opts po = { .role = KVS_RELAY_ROLE_UP, .pin_sha256 = pins[0] };
    assert_int_equal(kvs_ws_dial(url, &po, 3000, &l, err, sizeof err), KVS_OK); /* url: localhost */
    kvs_link_close(l);
    l = NULL;
    po.pin_sha256 = pins[1];
    err[0] = '\0';
    assert_int_equal(kvs_ws_dial(url, &po, 3000, &l, err, sizeof err), KVS_ERR_NET);
    assert_null(l);
    assert_non_null(strstr(err, "is not the pinned"));
    po.pin_sha256 = "abc";
    assert_int_equal(kvs_ws_dial(url, &po, 3000, &l, err, sizeof err), KVS_ERR_ARG);
        /* plain ws:// to a TLS relay fails the upgrade, with a clear error */
    snprintf(url, sizeof url, "ws://127.0.0.1:%u/edge/tls?token=%s", rr.port, tok);
    assert_int_not_equal(kvs_ws_dial(url, &o, 3000, &l, err, sizeof err), KVS_OK);
    stop(&rr);
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
}

static void test_http(void **state)
{
    (void)state;
    struct running rr;
    struct kvs_relay_params p = kvs_relay_default_params();
    start(&rr, &p);
    const char *paths[] = { "/health", "/metrics", "/nothing" };
    const char *want[] = { "HTTP/1.1 200", "HTTP/1.1 200", "HTTP/1.1 404" };
    const char *body[] = { "ok\n", "kvasir_relay_connections 0\n", "not found" };
    for (int i = 0; i < 3; i++) {
        int fd = tcp_connect(rr.port);
        char req[256], buf[8192];
        int n = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", paths[i]);
        assert_int_equal(write(fd, req, (size_t)n), n);
        struct timeval tv = { .tv_sec = 3 };
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        size_t have = 0;
        ssize_t r;
        while (have < sizeof buf - 1 && (r = read(fd, buf + have, sizeof buf - 1 - have)) > 0) {
            have += (size_t)r;
            buf[have] = '\0';
            if (strstr(buf, body[i])) break;
        }
        buf[have] = '\0';
        assert_int_equal(strncmp(buf, want[i], strlen(want[i])), 0);
        assert_non_null(strstr(buf, body[i]));
        close(fd);
    }
    stop(&rr);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_checks),      cmocka_unit_test(test_pair_both_ways), cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_limits),      cmocka_unit_test(test_takeover),       cmocka_unit_test(test_backpressure),
        cmocka_unit_test(test_idle_flood),  cmocka_unit_test(test_tls),            cmocka_unit_test(test_http),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* TLS links through the relay (src/relay, docs/RELAY.md): a ring edge's two
 * ends dial a relay on loopback as upstream and downstream WebSocket ends; a
 * HELLO and a PREFILL with a recognisable boundary go up, a HELLO comes back.
 * A capture of every byte the relay forwarded (what the downstream end read
 * from its WebSocket, and what it wrote) holds no plaintext frame: no frame
 * magic "KVSR", no run of the boundary's bytes, no HELLO fingerprint; the
 * frames arrive intact on the other side. The same exchange with plaintext
 * links shows both in the capture, so the check can fail. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>

#include "link/link.h"
#include "proto/proto.h"
#include "relay/relay.h"
#include "trust/trust.h"

static const uint8_t SECRET[] = "test-trust-relay-secret-0123456789";
#define SECRET_LEN (sizeof SECRET - 1)
#define CAP_MAX (1u << 20)

/* --- a link that records what passes through it (both directions) --- */
struct tap {
    struct kvs_link *inner;
    uint8_t *cap;
    size_t n;
};

static void tap_add(struct tap *t, const void *p, size_t n)
{
    if (t->n + n <= CAP_MAX) {
        memcpy(t->cap + t->n, p, n);
        t->n += n;
    }
}

static kvs_err tap_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    struct tap *t = l->impl;
    kvs_err e = kvs_link_read(t->inner, buf, cap, got);
    if (e == KVS_OK) tap_add(t, buf, *got);
    return e;
}

static kvs_err tap_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    struct tap *t = l->impl;
    tap_add(t, buf, len);
    return kvs_link_write(t->inner, buf, len, timeout_ms);
}

static int tap_fd(const struct kvs_link *l)
{
    const struct tap *t = l->impl;
    return kvs_link_fd(t->inner);
}

static void tap_close(struct kvs_link *l)
{
    struct tap *t = l->impl;
    kvs_link_close(t->inner);
    free(l);
}

static const struct kvs_link_ops tap_ops = { "tap", tap_read, tap_write, tap_fd, tap_close };

static struct kvs_link *tap_wrap(struct kvs_link *inner, struct tap *t)
{
    struct kvs_link *l = calloc(1, sizeof *l);
    assert_non_null(l);
    t->inner = inner;
    t->n = 0;
    l->ops = &tap_ops;
    l->impl = t;
    snprintf(l->peer, sizeof l->peer, "%s", inner->peer);
    return l;
}

/* --- relay --- */
struct running {
    struct kvs_relay *r;
    pthread_t th;
};

static void *relay_thread(void *arg)
{
    kvs_relay_run(arg);
    return NULL;
}

static struct kvs_link *dial(uint16_t port, const char *edge, uint8_t role)
{
    char tok[KVS_RELAY_TOKEN_HEX + 1], url[256], err[256] = "";
    assert_int_equal(kvs_relay_token(SECRET, SECRET_LEN, edge, tok), KVS_OK);
    snprintf(url, sizeof url, "ws://127.0.0.1:%u/edge/%s?token=%s", port, edge, tok);
    struct kvs_ws_opts o = { .role = role };
    struct kvs_link *l = NULL;
    kvs_err e = kvs_ws_dial(url, &o, 3000, &l, err, sizeof err);
    if (e) fprintf(stderr, "dial: %s\n", err);
    assert_int_equal(e, KVS_OK);
    return l;
}

struct writer {
    struct kvs_link *l;
    const uint8_t *buf;
    size_t n;
    kvs_err e;
};

static void *writer_main(void *arg)
{
    struct writer *w = arg;
    w->e = kvs_link_write(w->l, w->buf, w->n, 5000);
    return NULL;
}

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

/* HELLO (fingerprint 0xa5 repeated) then a PREFILL of 8 rows x 64 F16
 * values whose bytes count up (a run an observer could not miss). */
static size_t make_frames(uint8_t *out, const uint8_t fp_byte, uint32_t role)
{
    struct kvs_hello m = { .n_block = 4, .block_begin = 0, .block_end = 2, .n_embd = 64, .role = role, .n_ctx = 128,
                           .n_seq = 4 };
    memset(m.fingerprint, fp_byte, sizeof m.fingerprint);
    struct kvs_frame_header h = { .kind = KVS_FRAME_HELLO, .payload_len = KVS_PROTO_HELLO_BYTES };
    kvs_proto_put_header(out, &h);
    kvs_proto_put_hello(out + KVS_PROTO_HEADER_BYTES, &m);
    size_t n = KVS_PROTO_HEADER_BYTES + KVS_PROTO_HELLO_BYTES;
    if (role != KVS_HELLO_ROLE_PRED) return n;
    uint32_t rows = 8, plen = rows * 64 * 2;
    struct kvs_frame_header p = { .kind = KVS_FRAME_PREFILL, .flags = 2, .req = 7, .n_tokens = rows,
                                  .payload_len = plen };
    kvs_proto_put_header(out + n, &p);
    n += KVS_PROTO_HEADER_BYTES;
    for (uint32_t i = 0; i < plen; i++) out[n + i] = (uint8_t)(i * 3 + 1);
    return n + plen;
}

static bool has(const uint8_t *hay, size_t n, const void *needle, size_t m)
{
    return memmem(hay, n, needle, m) != NULL;
}

static void edge(uint16_t port, const char *id, bool tls)
{
    struct tap up_tap = { .cap = malloc(CAP_MAX) }, down_tap = { .cap = malloc(CAP_MAX) };
    assert_non_null(up_tap.cap);
    assert_non_null(down_tap.cap);
    struct kvs_link *up = tap_wrap(dial(port, id, KVS_RELAY_ROLE_UP), &up_tap);
    struct kvs_link *down = tap_wrap(dial(port, id, KVS_RELAY_ROLE_DOWN), &down_tap);
    struct kvs_key *ku = NULL, *kd = NULL;
    struct kvs_tls *tu = NULL, *td = NULL;
    if (tls) {
        char err[128];
        uint8_t pu[32], pd[32];
        assert_int_equal(kvs_key_generate(&ku), KVS_OK);
        assert_int_equal(kvs_key_generate(&kd), KVS_OK);
        kvs_key_public(ku, pu);
        kvs_key_public(kd, pd);
        assert_int_equal(kvs_tls_create(ku, &tu, err, sizeof err), KVS_OK);
        assert_int_equal(kvs_tls_create(kd, &td, err, sizeof err), KVS_OK);
        assert_int_equal(kvs_tls_wrap(tu, up, KVS_TLS_DIALER, pd, &up), KVS_OK);
        assert_int_equal(kvs_tls_wrap(td, down, KVS_TLS_ACCEPTOR, pu, &down), KVS_OK);
    }
    static uint8_t sent[4096], got[4096], reply[256], back[256];
    size_t n = make_frames(sent, 0xa5, KVS_HELLO_ROLE_PRED);
    struct writer w = { up, sent, n, KVS_ERR_INTERNAL };
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    size_t have = read_n(down, got, n, 5000); /* the downstream end drives its side of the handshake */
    pthread_join(th, NULL);
    assert_int_equal(w.e, KVS_OK);
    assert_int_equal(have, n);
    assert_memory_equal(got, sent, n);
    size_t rn = make_frames(reply, 0x5a, KVS_HELLO_ROLE_SUCC);
    assert_int_equal(kvs_link_write(down, reply, rn, 2000), KVS_OK);
    assert_int_equal(read_n(up, back, rn, 3000), rn);
    assert_memory_equal(back, reply, rn);

    /* the capture: what the relay forwarded up->down (down_tap's reads) and
     * down->up (down_tap's writes), plus what the upstream end handed it */
    uint8_t run[16], fp[16];
    memcpy(run, sent + KVS_PROTO_HEADER_BYTES * 2 + KVS_PROTO_HELLO_BYTES + 200, sizeof run);
    memset(fp, 0xa5, sizeof fp);
    fprintf(stderr, "%s edge: %zu bytes captured at the downstream end, %zu at the upstream end (%zu of frames)\n",
            tls ? "TLS" : "plaintext", down_tap.n, up_tap.n, n + rn);
    assert_true(down_tap.n >= n + rn);
    if (tls) {
        assert_false(has(down_tap.cap, down_tap.n, "KVSR", 4));
        assert_false(has(up_tap.cap, up_tap.n, "KVSR", 4));
        assert_false(has(down_tap.cap, down_tap.n, run, sizeof run));
        assert_false(has(down_tap.cap, down_tap.n, fp, sizeof fp));
        assert_int_equal(down_tap.cap[0], 0x16); /* a TLS handshake record */
    } else {
        assert_true(has(down_tap.cap, down_tap.n, "KVSR", 4));
        assert_true(has(down_tap.cap, down_tap.n, run, sizeof run));
        assert_true(has(down_tap.cap, down_tap.n, fp, sizeof fp));
    }
    kvs_link_close(up);
    kvs_link_close(down);
    kvs_tls_free(tu);
    kvs_tls_free(td);
    kvs_key_free(ku);
    kvs_key_free(kd);
    free(up_tap.cap);
    free(down_tap.cap);
}

static void test_relay_capture(void **state)
{
    (void)state;
    struct kvs_relay_params p = kvs_relay_default_params();
    p.listen = "127.0.0.1:0";
    p.secret = SECRET;
    p.secret_len = SECRET_LEN;
    struct running rr;
    char err[256] = "";
    assert_int_equal(kvs_relay_create(&p, &rr.r, err, sizeof err), KVS_OK);
    uint16_t port = kvs_relay_port(rr.r);
    assert_int_equal(pthread_create(&rr.th, NULL, relay_thread, rr.r), 0);
    edge(port, "ring-e1", true);
    edge(port, "ring-e2", false);
    kvs_relay_stop(rr.r);
    pthread_join(rr.th, NULL);
    kvs_relay_free(rr.r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_relay_capture),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* TCP link tests over loopback: address parsing, listen on a free port,
 * dial, bytes both ways, EOF on close, refused dial, write timeout. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <poll.h>

#include "link/link.h"

static void test_addr_parse(void **state)
{
    (void)state;
    char host[64], err[128];
    uint16_t port;
    assert_int_equal(kvs_addr_parse("127.0.0.1:7001", host, sizeof host, &port, err, sizeof err), KVS_OK);
    assert_string_equal(host, "127.0.0.1");
    assert_int_equal(port, 7001);
    assert_int_equal(kvs_addr_parse("[::1]:80", host, sizeof host, &port, err, sizeof err), KVS_OK);
    assert_string_equal(host, "::1");
    assert_int_equal(port, 80);
    assert_int_equal(kvs_addr_parse("localhost", host, sizeof host, &port, err, sizeof err), KVS_ERR_ARG);
    assert_string_equal(err, "address 'localhost' is not HOST:PORT");
    assert_int_equal(kvs_addr_parse("h:70000", host, sizeof host, &port, err, sizeof err), KVS_ERR_ARG);
    assert_string_equal(err, "port of 'h:70000' is not a number in 0..65535");
    assert_int_equal(kvs_addr_parse("h:12x", host, sizeof host, &port, err, sizeof err), KVS_ERR_ARG);
}

static void test_backoff(void **state)
{
    (void)state;
    assert_int_equal(kvs_link_backoff_ms(0), 50);
    assert_int_equal(kvs_link_backoff_ms(1), 100);
    assert_int_equal(kvs_link_backoff_ms(4), 800);
    assert_int_equal(kvs_link_backoff_ms(5), 1000);
    assert_int_equal(kvs_link_backoff_ms(100), 1000);
}

static kvs_err accept_wait(struct kvs_listener *s, struct kvs_link **out)
{
    struct pollfd p = { .fd = kvs_listener_fd(s), .events = POLLIN };
    if (poll(&p, 1, 2000) != 1) return KVS_ERR_TIMEOUT;
    return kvs_tcp_accept(s, out);
}

static void read_exact(struct kvs_link *l, uint8_t *buf, size_t n)
{
    size_t have = 0;
    while (have < n) {
        struct pollfd p = { .fd = kvs_link_fd(l), .events = POLLIN };
        assert_int_equal(poll(&p, 1, 2000), 1);
        size_t got;
        kvs_err e = kvs_link_read(l, buf + have, n - have, &got);
        if (e == KVS_ERR_NEED_MORE) continue;
        assert_int_equal(e, KVS_OK);
        have += got;
    }
}

static void test_tcp_roundtrip(void **state)
{
    (void)state;
    char err[256], addr[64];
    struct kvs_listener *s;
    assert_int_equal(kvs_tcp_listen("127.0.0.1:0", &s, err, sizeof err), KVS_OK);
    uint16_t port = kvs_listener_port(s);
    assert_true(port > 0);
    struct kvs_link *a = NULL, *b = NULL;
    assert_int_equal(kvs_tcp_accept(s, &b), KVS_ERR_NEED_MORE); /* nobody yet */
    snprintf(addr, sizeof addr, "127.0.0.1:%u", port);
    assert_int_equal(kvs_tcp_dial(addr, 1000, &a, err, sizeof err), KVS_OK);
    assert_int_equal(accept_wait(s, &b), KVS_OK);
    assert_string_equal(a->ops->name, "tcp");
    assert_string_equal(a->peer, addr);
    assert_memory_equal(b->peer, "127.0.0.1:", 10);

    /* 1 MiB each way: larger than socket buffers, so write waits for reads */
    static uint8_t big[1 << 20], got[1 << 20];
    for (size_t i = 0; i < sizeof big; i++) big[i] = (uint8_t)(i * 131 + 7);
    size_t got_n = 0;
    assert_int_equal(kvs_link_read(b, got, 16, &got_n), KVS_ERR_NEED_MORE);
    /* write 4 KiB, read it, both directions */
    assert_int_equal(kvs_link_write(a, big, 4096, 1000), KVS_OK);
    read_exact(b, got, 4096);
    assert_memory_equal(got, big, 4096);
    assert_int_equal(kvs_link_write(b, big + 5, 3000, 1000), KVS_OK);
    read_exact(a, got, 3000);
    assert_memory_equal(got, big + 5, 3000);

    /* Nobody reads b: once the socket buffers are full, writes time out */
    kvs_err e = KVS_OK;
    int64_t t0 = 0, dt = 0;
    for (int i = 0; i < 256 && e == KVS_OK; i++) {
        t0 = kvs_link_now_ms();
        e = kvs_link_write(a, big, sizeof big, 200);
        dt = kvs_link_now_ms() - t0;
    }
    assert_int_equal(e, KVS_ERR_TIMEOUT);
    assert_true(dt >= 190 && dt < 1500);

    /* close -> EOF (after the buffered bytes) on the other side */
    kvs_link_close(a);
    for (;;) {
        struct pollfd p = { .fd = kvs_link_fd(b), .events = POLLIN };
        assert_int_equal(poll(&p, 1, 2000), 1);
        e = kvs_link_read(b, got, sizeof got, &got_n);
        if (e == KVS_OK) continue;
        assert_true(e == KVS_ERR_PEER);
        break;
    }
    kvs_link_close(b);
    kvs_listener_close(s);

    /* the port is free now: dialing it is refused */
    e = kvs_tcp_dial(addr, 500, &a, err, sizeof err);
    assert_int_equal(e, KVS_ERR_NET);
    assert_non_null(strstr(err, "Connection refused"));
    t0 = kvs_link_now_ms();
    e = kvs_tcp_dial_retry(addr, 300, &a, err, sizeof err);
    assert_int_equal(e, KVS_ERR_TIMEOUT);
    assert_true(kvs_link_now_ms() - t0 >= 290);
    kvs_link_close(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_addr_parse),
        cmocka_unit_test(test_backoff),
        cmocka_unit_test(test_tcp_roundtrip),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

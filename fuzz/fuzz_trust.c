/* libFuzzer target for what a stranger can send to a keyed stage's port
 * (src/trust): the bytes go, in chunks sized by the second byte, into the
 * TLS server side of a link that expects a key (as a stage's acceptor does),
 * and whatever it hands up goes into a frame decoder. The first byte picks
 * the other target: bit 0 set -> the bytes are a peer certificate (DER) for
 * kvs_tls_check_cert. Must never crash, leak, hang or hand up a byte before
 * a handshake with the expected key. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/proto.h"
#include "trust/trust.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

struct feed {
    const uint8_t *p;
    size_t n, off, chunk;
};

static kvs_err mem_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    struct feed *f = l->impl;
    if (f->off >= f->n) return KVS_ERR_PEER;
    size_t k = f->n - f->off < f->chunk ? f->n - f->off : f->chunk;
    if (k > cap) k = cap;
    memcpy(buf, f->p + f->off, k);
    f->off += k;
    *got = k;
    return KVS_OK;
}

static kvs_err mem_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    (void)l, (void)buf, (void)len, (void)timeout_ms;
    return KVS_OK; /* what the stage answers goes nowhere */
}

static int mem_fd(const struct kvs_link *l)
{
    (void)l;
    return -1;
}

static void mem_close(struct kvs_link *l)
{
    free(l);
}

static const struct kvs_link_ops mem_ops = { "fuzz", mem_read, mem_write, mem_fd, mem_close };

static struct kvs_tls *tls_of_stage(void)
{
    static struct kvs_tls *t; /* one node identity for every run (key generation is slow) */
    if (!t) {
        struct kvs_key *k;
        char err[128];
        if (kvs_key_generate(&k)) abort();
        if (kvs_tls_create(k, &t, err, sizeof err)) abort();
        kvs_key_free(k);
    }
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    uint8_t sel = data[0];
    struct feed f = { .p = data + 2, .n = size - 2, .chunk = (size_t)data[1] * 37 + 1 };
    if (sel & 1) {
        uint8_t pub[KVS_KEY_PUB_BYTES];
        char why[256];
        (void)kvs_tls_check_cert(f.p, f.n, 1800000000, pub, why, sizeof why);
        return 0;
    }
    struct kvs_link *inner = calloc(1, sizeof *inner);
    if (!inner) return 0;
    inner->ops = &mem_ops;
    inner->impl = &f;
    uint8_t expect[KVS_KEY_PUB_BYTES];
    memset(expect, 0x5a, sizeof expect); /* the predecessor's key: nobody's */
    struct kvs_link *l;
    if (kvs_tls_wrap(tls_of_stage(), inner, KVS_TLS_ACCEPTOR, expect, &l)) return 0;
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(1u << 16, 64);
    uint8_t buf[4096];
    for (int i = 0; i < 10000; i++) {
        size_t got = 0, used;
        kvs_err e = kvs_link_read(l, buf, sizeof buf, &got);
        if (e == KVS_OK) {
            /* nobody holds the expected key: nothing may be handed up */
            if (!kvs_tls_ready(l)) abort();
            if (d) (void)kvs_proto_decoder_feed(d, buf, got, &used);
            continue;
        }
        if (e != KVS_ERR_NEED_MORE || f.off >= f.n) break;
    }
    kvs_proto_decoder_free(d);
    kvs_link_close(l);
    return 0;
}

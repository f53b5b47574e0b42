/* Node keys and TLS links: RFC 8032 key vector, key files (mode, no
 * overwrite, wrong algorithm), TLS 1.3 over a socketpair (bytes both ways,
 * ciphertext only on the wire, buffered bytes keep the fd readable), wrong
 * key refused both ways with the message, a table of bad certificates, a
 * replayed session and garbage refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/bn.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "proto/proto.h"
#include "trust/trust.h"

/* --- a test link over one end of a socketpair, recording what it writes --- */

struct sp_impl {
    int fd;
    uint8_t *cap; /* bytes written (NULL: not recorded) */
    size_t n_cap, cap_max;
};

static kvs_err sp_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    struct sp_impl *t = l->impl;
    ssize_t n = recv(t->fd, buf, cap, MSG_DONTWAIT);
    if (n > 0) {
        *got = (size_t)n;
        return KVS_OK;
    }
    if (n == 0) return KVS_ERR_PEER;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return KVS_ERR_NEED_MORE;
    return errno == ECONNRESET ? KVS_ERR_PEER : KVS_ERR_IO;
}

static kvs_err sp_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    struct sp_impl *t = l->impl;
    const uint8_t *p = buf;
    if (t->cap && t->n_cap + len <= t->cap_max) {
        memcpy(t->cap + t->n_cap, buf, len);
        t->n_cap += len;
    }
    while (len) {
        ssize_t n = send(t->fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            p += n;
            len -= (size_t)n;
            continue;
        }
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            struct pollfd pf = { .fd = t->fd, .events = POLLOUT };
            if (poll(&pf, 1, timeout_ms) == 0) return KVS_ERR_TIMEOUT;
            continue;
        }
        return KVS_ERR_PEER;
    }
    return KVS_OK;
}

static int sp_fd(const struct kvs_link *l)
{
    return ((const struct sp_impl *)l->impl)->fd;
}

static void sp_close(struct kvs_link *l)
{
    struct sp_impl *t = l->impl;
    close(t->fd);
    free(t->cap);
    free(t);
    free(l);
}

static const struct kvs_link_ops sp_ops = { "socketpair", sp_read, sp_write, sp_fd, sp_close };

static struct kvs_link *sp_link(int fd, const char *peer, size_t record)
{
    struct kvs_link *l = calloc(1, sizeof *l);
    struct sp_impl *t = calloc(1, sizeof *t);
    assert_non_null(l);
    assert_non_null(t);
    t->fd = fd;
    if (record) {
        t->cap = malloc(record);
        t->cap_max = record;
    }
    l->ops = &sp_ops;
    l->impl = t;
    snprintf(l->peer, sizeof l->peer, "%s", peer);
    return l;
}

static struct kvs_key *new_key(void)
{
    struct kvs_key *k;
    assert_int_equal(kvs_key_generate(&k), KVS_OK);
    return k;
}

static struct kvs_tls *new_tls(const struct kvs_key *k)
{
    struct kvs_tls *t;
    char err[128];
    assert_int_equal(kvs_tls_create(k, &t, err, sizeof err), KVS_OK);
    return t;
}

struct pair {
    struct kvs_link *d, *a; /* dialer (client), acceptor (server) */
    struct sp_impl *d_in, *a_in;
};

/* A dialer with identity td expecting key ea, and an acceptor with identity
 * ta expecting ed (NULL: any), over a fresh socketpair. */
static struct pair make_pair(struct kvs_tls *td, const uint8_t *ea, struct kvs_tls *ta, const uint8_t *ed,
                             size_t record)
{
    int sv[2];
    assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    struct pair p;
    struct kvs_link *di = sp_link(sv[0], "acceptor", record), *ai = sp_link(sv[1], "dialer", record);
    p.d_in = di->impl;
    p.a_in = ai->impl;
    assert_int_equal(kvs_tls_wrap(td, di, KVS_TLS_DIALER, ea, &p.d), KVS_OK);
    assert_int_equal(kvs_tls_wrap(ta, ai, KVS_TLS_ACCEPTOR, ed, &p.a), KVS_OK);
    return p;
}

/* Pumps both ends (non-blocking reads drive the handshake) until each is up
 * or failed; returns the acceptor's last read result, *de the dialer's. */
static kvs_err pump(struct pair *p, kvs_err *de, uint8_t *abuf, size_t *agot, uint8_t *dbuf, size_t *dgot)
{
    kvs_err ae = KVS_ERR_NEED_MORE, e2 = KVS_ERR_NEED_MORE;
    uint8_t tmp[4096];
    *agot = *dgot = 0;
    for (int i = 0; i < 400; i++) {
        struct pollfd pf[2] = { { kvs_link_fd(p->a), POLLIN, 0 }, { kvs_link_fd(p->d), POLLIN, 0 } };
        poll(pf, 2, 10);
        size_t got;
        if (ae == KVS_ERR_NEED_MORE || ae == KVS_OK) {
            ae = kvs_link_read(p->a, tmp, sizeof tmp, &got);
            if (ae == KVS_OK && abuf) {
                memcpy(abuf + *agot, tmp, got);
                *agot += got;
            }
        }
        if (e2 == KVS_ERR_NEED_MORE || e2 == KVS_OK) {
            e2 = kvs_link_read(p->d, tmp, sizeof tmp, &got);
            if (e2 == KVS_OK && dbuf) {
                memcpy(dbuf + *dgot, tmp, got);
                *dgot += got;
            }
        }
        bool a_done = ae != KVS_ERR_NEED_MORE && ae != KVS_OK;
        bool d_done = e2 != KVS_ERR_NEED_MORE && e2 != KVS_OK;
        if ((a_done || kvs_tls_ready(p->a)) && (d_done || kvs_tls_ready(p->d)) && i > 20) break;
    }
    *de = e2;
    return ae;
}

/* --- keys --------------------------------------------------------------------- */

static void test_rfc8032_vector(void **state)
{
    (void)state;
    /* RFC 8032 §7.1 TEST 1: secret key 9d61b19d..., public key d75a9801... */
    static const uint8_t sk[32] = { 0x9d, 0x61, 0xb1, 0x9d, 0xef, 0xfd, 0x5a, 0x60, 0xba, 0x84, 0x4a,
                                    0xf4, 0x92, 0xec, 0x2c, 0xc4, 0x44, 0x49, 0xc5, 0x69, 0x7b, 0x32,
                                    0x69, 0x19, 0x70, 0x3b, 0xac, 0x03, 0x1c, 0xae, 0x7f, 0x60 };
    EVP_PKEY *pk = EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, NULL, sk, sizeof sk);
    assert_non_null(pk);
    char path[] = "/tmp/kvs_test_keyXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_int_equal(PEM_write_PrivateKey(f, pk, NULL, NULL, 0, NULL, NULL), 1);
    fclose(f);
    EVP_PKEY_free(pk);
    struct kvs_key *k;
    char err[256];
    assert_int_equal(kvs_key_load(path, &k, err, sizeof err), KVS_OK);
    uint8_t pub[32];
    char hex[KVS_KEY_PUB_HEX + 1], fp[KVS_KEY_FP_HEX + 1];
    kvs_key_public(k, pub);
    kvs_key_public_hex(pub, hex);
    assert_string_equal(hex, "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a");
    /* sha256sum of those 32 bytes: 21fe31dfa154a261626b... */
    kvs_key_fingerprint(pub, fp);
    assert_string_equal(fp, "21fe31dfa154a261");
    uint8_t back[32];
    assert_int_equal(kvs_key_parse_public(hex, back), KVS_OK);
    assert_memory_equal(back, pub, 32);
    assert_int_equal(kvs_key_parse_public("ed25519:D75A980182B10AB7D54BFED3C964073A0EE172F3DAA62325AF021A68F707511A",
                                          back),
                     KVS_OK);
    assert_memory_equal(back, pub, 32);
    assert_int_equal(kvs_key_parse_public("d75a98", back), KVS_ERR_FORMAT);
    assert_int_equal(kvs_key_parse_public("x75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", back),
                     KVS_ERR_FORMAT);
    assert_int_equal(kvs_key_parse_public(NULL, back), KVS_ERR_FORMAT);
    kvs_key_free(k);
    unlink(path);
}

static void test_key_files(void **state)
{
    (void)state;
    char dir[] = "/tmp/kvs_test_keysXXXXXX", path[128], err[256];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/node.key", dir);
    struct kvs_key *k = new_key(), *k2;
    mode_t old = umask(0);
    assert_int_equal(kvs_key_save(k, path, err, sizeof err), KVS_OK);
    umask(old);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    /* never overwritten */
    assert_int_equal(kvs_key_save(k, path, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "exists"));
    assert_int_equal(kvs_key_load(path, &k2, err, sizeof err), KVS_OK);
    uint8_t a[32], b[32];
    kvs_key_public(k, a);
    kvs_key_public(k2, b);
    assert_memory_equal(a, b, 32);
    kvs_key_free(k2);
    /* a readable key file is refused */
    chmod(path, 0644);
    assert_int_equal(kvs_key_load(path, &k2, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "chmod 600"));
    unlink(path);
    /* garbage, another algorithm, missing */
    FILE *f = fopen(path, "w");
    fputs("not a key\n", f);
    fclose(f);
    chmod(path, 0600);
    assert_int_equal(kvs_key_load(path, &k2, err, sizeof err), KVS_ERR_FORMAT);
    EVP_PKEY *ec = EVP_EC_gen("P-256");
    f = fopen(path, "w");
    PEM_write_PrivateKey(f, ec, NULL, NULL, 0, NULL, NULL);
    fclose(f);
    EVP_PKEY_free(ec);
    assert_int_equal(kvs_key_load(path, &k2, err, sizeof err), KVS_ERR_UNSUPPORTED);
    unlink(path);
    assert_int_equal(kvs_key_load(path, &k2, err, sizeof err), KVS_ERR_IO);
    rmdir(dir);
    kvs_key_free(k);
}

/* --- TLS ------------------------------------------------------------------------ */

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

static bool has_bytes(const uint8_t *hay, size_t n, const void *needle, size_t m)
{
    return memmem(hay, n, needle, m) != NULL;
}

static void test_tls_roundtrip(void **state)
{
    (void)state;
    struct kvs_key *kd = new_key(), *ka = new_key();
    struct kvs_tls *td = new_tls(kd), *ta = new_tls(ka);
    uint8_t pd[32], pa[32];
    kvs_key_public(kd, pd);
    kvs_key_public(ka, pa);
    struct pair p = make_pair(td, pa, ta, pd, 8u << 20);
    /* a HELLO-like frame first: the dialer's write drives its handshake */
    uint8_t frame[KVS_PROTO_HEADER_BYTES];
    struct kvs_frame_header h = { .kind = KVS_FRAME_KEEPALIVE };
    kvs_proto_put_header(frame, &h);
    size_t n = 1u << 20;
    uint8_t *big = malloc(n), *got = malloc(n + 64);
    for (size_t i = 0; i < n; i++) big[i] = (uint8_t)(i * 7 + (i >> 9));
    memcpy(big, frame, sizeof frame);
    struct writer w = { p.d, big, n, KVS_ERR_INTERNAL };
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    size_t have = 0;
    for (int i = 0; i < 2000 && have < n; i++) {
        struct pollfd pf = { kvs_link_fd(p.a), POLLIN, 0 };
        poll(&pf, 1, 20);
        size_t g;
        kvs_err e = kvs_link_read(p.a, got + have, 65536, &g);
        if (e == KVS_OK) have += g;
        else assert_int_equal(e, KVS_ERR_NEED_MORE);
    }
    pthread_join(th, NULL);
    assert_int_equal(w.e, KVS_OK);
    assert_int_equal(have, n);
    assert_memory_equal(got, big, n);
    /* each side has the other's key */
    uint8_t k[32];
    assert_true(kvs_tls_peer_key(p.a, k));
    assert_memory_equal(k, pd, 32);
    assert_true(kvs_tls_peer_key(p.d, k));
    assert_memory_equal(k, pa, 32);
    /* the wire held only ciphertext: no frame magic, no run of the plaintext */
    assert_true(p.d_in->n_cap > n);
    assert_false(has_bytes(p.d_in->cap, p.d_in->n_cap, "KVSR", 4));
    assert_false(has_bytes(p.d_in->cap, p.d_in->n_cap, big + 4096, 16));
    /* the other way */
    assert_int_equal(kvs_link_write(p.a, "pong", 4, 1000), KVS_OK);
    size_t g = 0;
    for (int i = 0; i < 100 && g == 0; i++) {
        struct pollfd pf = { kvs_link_fd(p.d), POLLIN, 0 };
        poll(&pf, 1, 20);
        if (kvs_link_read(p.d, got, 64, &g) != KVS_OK) g = 0;
    }
    assert_int_equal(g, 4);
    assert_memory_equal(got, "pong", 4);
    /* orderly close: close_notify reads as PEER */
    kvs_link_close(p.d);
    kvs_err e = KVS_ERR_NEED_MORE;
    for (int i = 0; i < 100 && e == KVS_ERR_NEED_MORE; i++) {
        struct pollfd pf = { kvs_link_fd(p.a), POLLIN, 0 };
        poll(&pf, 1, 20);
        e = kvs_link_read(p.a, got, 64, &g);
    }
    assert_int_equal(e, KVS_ERR_PEER);
    kvs_link_close(p.a);
    free(big);
    free(got);
    kvs_tls_free(td);
    kvs_tls_free(ta);
    kvs_key_free(kd);
    kvs_key_free(ka);
}

/* Bytes left inside the TLS layer (a reader that took less than is there)
 * keep the link's fd readable although the socket is drained. */
static void test_tls_pending_fd(void **state)
{
    (void)state;
    struct kvs_key *kd = new_key(), *ka = new_key();
    struct kvs_tls *td = new_tls(kd), *ta = new_tls(ka);
    struct pair p = make_pair(td, NULL, ta, NULL, 0);
    uint8_t buf[40000];
    memset(buf, 0x5a, sizeof buf);
    struct writer w = { p.d, buf, sizeof buf, KVS_ERR_INTERNAL };
    pthread_t th;
    pthread_create(&th, NULL, writer_main, &w);
    uint8_t got[40000];
    size_t have = 0, g;
    for (int i = 0; i < 200 && have == 0; i++) {
        struct pollfd pf = { kvs_link_fd(p.a), POLLIN, 0 };
        poll(&pf, 1, 20);
        if (kvs_link_read(p.a, got, 1000, &g) == KVS_OK) have = g;
    }
    pthread_join(th, NULL);
    assert_int_equal(have, 1000);
    /* let the rest arrive, read a little: what remains sits in TLS */
    usleep(50000);
    assert_int_equal(kvs_link_read(p.a, got + have, 1000, &g), KVS_OK);
    have += g;
    struct pollfd pf = { kvs_link_fd(p.a), POLLIN, 0 };
    assert_int_equal(poll(&pf, 1, 0), 1);
    while (have < sizeof buf) {
        kvs_err e = kvs_link_read(p.a, got + have, sizeof got - have, &g);
        assert_int_equal(e, KVS_OK);
        have += g;
    }
    assert_memory_equal(got, buf, sizeof buf);
    pf.revents = 0;
    assert_int_equal(poll(&pf, 1, 0), 0); /* nothing left: not readable */
    assert_int_equal(kvs_link_read(p.a, got, 100, &g), KVS_ERR_NEED_MORE);
    kvs_link_close(p.d);
    kvs_link_close(p.a);
    kvs_tls_free(td);
    kvs_tls_free(ta);
    kvs_key_free(kd);
    kvs_key_free(ka);
}

/* Reads one ERROR frame out of bytes a refused side received. */
static void expect_error_frame(const uint8_t *buf, size_t n, const char *want)
{
    struct kvs_proto_decoder *dec = kvs_proto_decoder_create(2048, 0);
    size_t used;
    assert_int_equal(kvs_proto_decoder_feed(dec, buf, n, &used), KVS_OK);
    const struct kvs_frame *f = kvs_proto_decoder_frame(dec);
    assert_int_equal(f->h.kind, KVS_FRAME_ERROR);
    uint32_t code;
    char msg[1100];
    kvs_proto_get_error(f, &code, msg, sizeof msg);
    assert_int_equal(code, KVS_ERR_MISMATCH);
    assert_string_equal(msg, want);
    kvs_proto_decoder_free(dec);
}

static void test_tls_wrong_key(void **state)
{
    (void)state;
    struct kvs_key *kd = new_key(), *ka = new_key(), *kx = new_key();
    struct kvs_tls *td = new_tls(kd), *ta = new_tls(ka);
    uint8_t pd[32], pa[32], px[32];
    kvs_key_public(kd, pd);
    kvs_key_public(ka, pa);
    kvs_key_public(kx, px);
    char fd_[17], fa[17], fx[17], want[256];
    kvs_key_fingerprint(pd, fd_);
    kvs_key_fingerprint(pa, fa);
    kvs_key_fingerprint(px, fx);
    uint8_t abuf[65536], dbuf[65536];
    size_t ag, dg;
    kvs_err de;

    /* 1. the dialer expects X, the acceptor presents A: the dialer refuses */
    struct pair p = make_pair(td, px, ta, pd, 0);
    kvs_err ae = pump(&p, &de, abuf, &ag, dbuf, &dg);
    assert_int_equal(de, KVS_ERR_MISMATCH);
    snprintf(want, sizeof want, "acceptor presented key %s, this stage expects key %s", fa, fx);
    assert_string_equal(kvs_tls_error(p.d), want);
    assert_false(kvs_tls_ready(p.d));
    /* the acceptor got the refusal, phrased for it, then the close */
    snprintf(want, sizeof want, "it expects key %s, this stage presented key %s", fx, fa);
    expect_error_frame(abuf, ag, want);
    assert_int_equal(ae, KVS_ERR_PEER);
    kvs_link_close(p.d);
    kvs_link_close(p.a);

    /* 2. the acceptor expects X, the dialer presents D: the acceptor refuses */
    p = make_pair(td, pa, ta, px, 0);
    ae = pump(&p, &de, abuf, &ag, dbuf, &dg);
    assert_int_equal(ae, KVS_ERR_MISMATCH);
    snprintf(want, sizeof want, "dialer presented key %s, this stage expects key %s", fd_, fx);
    assert_string_equal(kvs_tls_error(p.a), want);
    assert_int_equal(ag, 0); /* nothing of the dialer's reached the acceptor's reader */
    snprintf(want, sizeof want, "it expects key %s, this stage presented key %s", fx, fd_);
    expect_error_frame(dbuf, dg, want);
    assert_int_equal(de, KVS_ERR_PEER);
    kvs_link_close(p.d);
    kvs_link_close(p.a);

    /* 3. right keys both ways: both up */
    p = make_pair(td, pa, ta, pd, 0);
    ae = pump(&p, &de, abuf, &ag, dbuf, &dg);
    assert_int_equal(ae, KVS_ERR_NEED_MORE);
    assert_int_equal(de, KVS_ERR_NEED_MORE);
    assert_true(kvs_tls_ready(p.a));
    assert_true(kvs_tls_ready(p.d));
    kvs_link_close(p.d);
    kvs_link_close(p.a);
    kvs_tls_free(td);
    kvs_tls_free(ta);
    kvs_key_free(kd);
    kvs_key_free(ka);
    kvs_key_free(kx);
}

/* A PEM certificate for key, signed by signer, valid from now+nb to now+na seconds. */
static char *cert_pem(EVP_PKEY *key, EVP_PKEY *signer, long nb, long na)
{
    X509 *x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 7);
    X509_gmtime_adj(X509_getm_notBefore(x), nb);
    X509_gmtime_adj(X509_getm_notAfter(x), na);
    X509_set_pubkey(x, key);
    X509_NAME *n = X509_get_subject_name(x);
    X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, (const unsigned char *)"test", -1, -1, 0);
    X509_set_issuer_name(x, n);
    int id = EVP_PKEY_id(signer);
    assert_true(X509_sign(x, signer, id == EVP_PKEY_ED25519 ? NULL : EVP_sha256()) > 0);
    BIO *b = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(b, x);
    char *p;
    long len = BIO_get_mem_data(b, &p);
    char *s = strndup(p, (size_t)len);
    BIO_free(b);
    X509_free(x);
    return s;
}

static char *key_pem(EVP_PKEY *key)
{
    BIO *b = BIO_new(BIO_s_mem());
    PEM_write_bio_PrivateKey(b, key, NULL, NULL, 0, NULL, NULL);
    char *p;
    long len = BIO_get_mem_data(b, &p);
    char *s = strndup(p, (size_t)len);
    BIO_free(b);
    return s;
}

static EVP_PKEY *ed_key(void)
{
    EVP_PKEY *k = NULL;
    EVP_PKEY_CTX *c = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    EVP_PKEY_keygen_init(c);
    EVP_PKEY_keygen(c, &k);
    EVP_PKEY_CTX_free(c);
    return k;
}

static uint8_t *der_of(const char *pem, size_t *n)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    X509 *x = PEM_read_bio_X509(b, NULL, NULL, NULL);
    BIO_free(b);
    unsigned char *der = NULL;
    int len = i2d_X509(x, &der);
    X509_free(x);
    *n = (size_t)len;
    uint8_t *out = malloc((size_t)len + 8);
    memcpy(out, der, (size_t)len);
    OPENSSL_free(der);
    return out;
}

/* The table of bad certificates: each presented by the dialer (and by the
 * acceptor) to a peer that accepts any key: refused by the certificate
 * check, with the reason, before any application byte. */
static void test_tls_bad_certs(void **state)
{
    (void)state;
    EVP_PKEY *ed = ed_key(), *other = ed_key(), *ec = EVP_EC_gen("P-256"), *rsa = EVP_RSA_gen(2048);
    struct {
        const char *name;
        EVP_PKEY *key, *signer;
        long nb, na;
        kvs_err check;
        const char *why;
    } cases[] = {
        { "good", ed, ed, -3600, 3600, KVS_OK, NULL },
        { "expired", ed, ed, -7200, -3600, KVS_ERR_RANGE, "has expired" },
        { "not yet valid", ed, ed, 3600, 7200, KVS_ERR_RANGE, "not valid yet" },
        { "ECDSA P-256", ec, ec, -3600, 3600, KVS_ERR_UNSUPPORTED, "key is EC, not Ed25519" },
        { "RSA", rsa, rsa, -3600, 3600, KVS_ERR_UNSUPPORTED, "key is RSA, not Ed25519" },
        { "signed by another key", ed, other, -3600, 3600, KVS_ERR_FORMAT, "self-signature does not verify" },
    };
    struct kvs_key *kg = new_key();
    struct kvs_tls *good = new_tls(kg);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        char *cp = cert_pem(cases[c].key, cases[c].signer, cases[c].nb, cases[c].na), *kp = key_pem(cases[c].key);
        /* the check alone, on the DER */
        size_t n;
        uint8_t *der = der_of(cp, &n), pub[32];
        char why[256];
        assert_int_equal(kvs_tls_check_cert(der, n, time(NULL), pub, why, sizeof why), cases[c].check);
        if (cases[c].why) assert_non_null(strstr(why, cases[c].why));
        free(der);
        struct kvs_tls *bad;
        char err[256];
        assert_int_equal(kvs_tls_create_pem(cp, kp, &bad, err, sizeof err), KVS_OK);
        for (int side = 0; side < 2; side++) { /* 0: the bad one dials, 1: it accepts */
            uint8_t abuf[65536], dbuf[65536];
            size_t ag, dg;
            kvs_err de, ae;
            struct pair p = side == 0 ? make_pair(bad, NULL, good, NULL, 0) : make_pair(good, NULL, bad, NULL, 0);
            ae = pump(&p, &de, abuf, &ag, dbuf, &dg);
            struct kvs_link *checker = side == 0 ? p.a : p.d;
            kvs_err ce = side == 0 ? ae : de;
            if (cases[c].check == KVS_OK) {
                assert_true(kvs_tls_ready(checker));
            } else {
                if (ce != KVS_ERR_FORMAT) fprintf(stderr, "case %s side %d: %s\n", cases[c].name, side,
                                                  kvs_tls_error(checker) ? kvs_tls_error(checker) : "(none)");
                assert_int_equal(ce, KVS_ERR_FORMAT);
                assert_false(kvs_tls_ready(checker));
                assert_non_null(strstr(kvs_tls_error(checker), cases[c].why));
                assert_int_equal(side == 0 ? ag : dg, 0);
            }
            kvs_link_close(p.d);
            kvs_link_close(p.a);
        }
        kvs_tls_free(bad);
        free(cp);
        free(kp);
    }
    /* garbage DER */
    uint8_t pub[32], junk[300];
    char why[256];
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(i * 31 + 5);
    assert_int_equal(kvs_tls_check_cert(junk, sizeof junk, time(NULL), pub, why, sizeof why), KVS_ERR_FORMAT);
    assert_string_equal(why, "the certificate is not DER X.509");
    assert_int_equal(kvs_tls_check_cert(junk, 0, time(NULL), pub, why, sizeof why), KVS_ERR_FORMAT);
    char *cp = cert_pem(ed, ed, -10, 3600);
    size_t n;
    uint8_t *der = der_of(cp, &n);
    assert_int_equal(kvs_tls_check_cert(der, n - 1, time(NULL), pub, why, sizeof why), KVS_ERR_FORMAT);
    der[n] = 0;
    assert_int_equal(kvs_tls_check_cert(der, n + 1, time(NULL), pub, why, sizeof why), KVS_ERR_FORMAT);
    assert_int_equal(kvs_tls_check_cert(der, n, time(NULL), pub, why, sizeof why), KVS_OK);
    /* the same certificate a year later: expired */
    assert_int_equal(kvs_tls_check_cert(der, n, time(NULL) + 366 * 86400, pub, why, sizeof why), KVS_ERR_RANGE);
    free(der);
    free(cp);
    char err[128];
    struct kvs_tls *t;
    assert_int_equal(kvs_tls_create_pem("garbage", "garbage", &t, err, sizeof err), KVS_ERR_FORMAT);
    kvs_tls_free(good);
    kvs_key_free(kg);
    EVP_PKEY_free(ed);
    EVP_PKEY_free(other);
    EVP_PKEY_free(ec);
    EVP_PKEY_free(rsa);
}

/* A recorded session's dialer bytes, replayed to a fresh acceptor with the
 * same keys, fail the handshake; plaintext and garbage too. */
static void test_tls_replay_and_garbage(void **state)
{
    (void)state;
    struct kvs_key *kd = new_key(), *ka = new_key();
    struct kvs_tls *td = new_tls(kd), *ta = new_tls(ka);
    uint8_t pd[32], pa[32];
    kvs_key_public(kd, pd);
    kvs_key_public(ka, pa);
    struct pair p = make_pair(td, pa, ta, pd, 1u << 20);
    uint8_t abuf[65536], dbuf[65536];
    size_t ag, dg;
    kvs_err de;
    pump(&p, &de, abuf, &ag, dbuf, &dg);
    assert_true(kvs_tls_ready(p.a));
    assert_int_equal(kvs_link_write(p.d, "secret boundary", 15, 1000), KVS_OK);
    pump(&p, &de, abuf, &ag, dbuf, &dg);
    assert_int_equal(ag, 15);
    size_t rec_n = p.d_in->n_cap;
    uint8_t *rec = malloc(rec_n);
    memcpy(rec, p.d_in->cap, rec_n);
    kvs_link_close(p.d);
    kvs_link_close(p.a);

    const char *plain = "KVSR\x02\x00\x01\x00 plaintext HELLO";
    uint8_t junk[512];
    for (size_t i = 0; i < sizeof junk; i++) junk[i] = (uint8_t)(i * 131 + 17);
    struct { const uint8_t *b; size_t n; const char *why; } feeds[] = {
        { rec, rec_n, "TLS handshake with" },
        { (const uint8_t *)plain, strlen(plain), "TLS handshake with" },
        { junk, sizeof junk, "TLS handshake with" },
    };
    for (size_t c = 0; c < 3; c++) {
        int sv[2];
        assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
        struct kvs_link *a;
        assert_int_equal(kvs_tls_wrap(ta, sp_link(sv[1], "attacker", 0), KVS_TLS_ACCEPTOR, pd, &a), KVS_OK);
        assert_int_equal(write(sv[0], feeds[c].b, feeds[c].n), (ssize_t)feeds[c].n);
        kvs_err e = KVS_ERR_NEED_MORE;
        size_t g = 0;
        for (int i = 0; i < 100 && (e == KVS_ERR_NEED_MORE); i++) {
            struct pollfd pf = { kvs_link_fd(a), POLLIN, 0 };
            poll(&pf, 1, 10);
            e = kvs_link_read(a, abuf, sizeof abuf, &g);
        }
        assert_int_equal(e, KVS_ERR_FORMAT);
        assert_non_null(strstr(kvs_tls_error(a), feeds[c].why));
        assert_false(kvs_tls_ready(a));
        kvs_link_close(a);
        close(sv[0]);
    }
    free(rec);
    kvs_tls_free(td);
    kvs_tls_free(ta);
    kvs_key_free(kd);
    kvs_key_free(ka);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rfc8032_vector),
        cmocka_unit_test(test_key_files),
        cmocka_unit_test(test_tls_roundtrip),
        cmocka_unit_test(test_tls_pending_fd),
        cmocka_unit_test(test_tls_wrong_key),
        cmocka_unit_test(test_tls_bad_certs),
        cmocka_unit_test(test_tls_replay_and_garbage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

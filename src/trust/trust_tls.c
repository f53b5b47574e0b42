/* TLS 1.3 over any kvs_link (OpenSSL, memory BIOs); self-signed Ed25519
 * certificates checked against an expected key (trust.h). */
#include "trust/trust_impl.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <openssl/bn.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "proto/proto.h"

#define CERT_DAYS 30               /* validity of a node's self-made certificate */
#define CERT_REMAKE_S (24 * 3600)  /* a certificate older than this is made anew for the next link */
#define WRITE_CHUNK 16384          /* plaintext per SSL_write: one TLS record */
#define FLUSH_AT 65536             /* ciphertext gathered before it is written to the inner link */
#define IN_CHUNK 65536             /* inner-link read size */
#define HANDSHAKE_WRITE_MS 1000    /* handshake messages are small: the inner link takes them at once */

#define ERR(code, ...)                                                                                     \
    do {                                                                                                   \
        if (errbuf && errlen) snprintf(errbuf, errlen, __VA_ARGS__);                                       \
        return code;                                                                                       \
    } while (0)

struct kvs_tls {
    pthread_mutex_t mu; /* guards cert / made */
    SSL_CTX *ctx;
    EVP_PKEY *pk;
    X509 *cert;
    bool fixed; /* test hook: the given certificate, never remade */
    time_t made;
};

enum tls_state { ST_HANDSHAKE = 0, ST_UP, ST_FAILED };

struct tls_link {
    struct kvs_link *inner;
    SSL *ssl;
    BIO *rbio, *wbio; /* owned by ssl */
    int epfd, evfd, inner_fd;
    bool ev_set;
    enum tls_state state;
    kvs_err fail_code;
    bool has_expect, has_peer;
    uint8_t expect[KVS_KEY_PUB_BYTES], peer[KVS_KEY_PUB_BYTES];
    char cert_why[200]; /* why the verify callback refused the peer's certificate */
    char err[512];
    uint8_t *ibuf;
};

/* --- certificates ----------------------------------------------------------------- */

static X509 *make_cert(EVP_PKEY *pk, time_t now)
{
    uint8_t pub[KVS_KEY_PUB_BYTES];
    size_t pl = sizeof pub;
    char fp[KVS_KEY_FP_HEX + 1], cn[64];
    if (EVP_PKEY_get_raw_public_key(pk, pub, &pl) != 1) return NULL;
    kvs_key_fingerprint(pub, fp);
    snprintf(cn, sizeof cn, "kvasir node %s", fp);
    X509 *x = X509_new();
    BIGNUM *bn = BN_new();
    bool ok = x && bn && X509_set_version(x, 2) == 1 && BN_rand(bn, 127, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) == 1 &&
              BN_to_ASN1_INTEGER(bn, X509_get_serialNumber(x)) &&
              X509_time_adj_ex(X509_getm_notBefore(x), 0, -3600, &now) &&
              X509_time_adj_ex(X509_getm_notAfter(x), CERT_DAYS, 0, &now) && X509_set_pubkey(x, pk) == 1;
    BN_free(bn);
    if (ok) {
        X509_NAME *n = X509_get_subject_name(x);
        ok = X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC, (const unsigned char *)cn, -1, -1, 0) == 1 &&
             X509_set_issuer_name(x, n) == 1 && X509_sign(x, pk, NULL) > 0; /* Ed25519: no digest */
    }
    if (!ok) {
        X509_free(x);
        return NULL;
    }
    return x;
}

static kvs_err check_x509(X509 *x, time_t now, uint8_t pub[KVS_KEY_PUB_BYTES], char *why, size_t whylen)
{
    EVP_PKEY *pk = X509_get0_pubkey(x);
    if (!pk) {
        snprintf(why, whylen, "the certificate holds no readable public key");
        return KVS_ERR_FORMAT;
    }
    if (EVP_PKEY_id(pk) != EVP_PKEY_ED25519) {
        const char *name = EVP_PKEY_get0_type_name(pk);
        snprintf(why, whylen, "the certificate's key is %s, not Ed25519", name ? name : "of an unknown type");
        return KVS_ERR_UNSUPPORTED;
    }
    if (X509_verify(x, pk) != 1) {
        ERR_clear_error();
        snprintf(why, whylen, "the certificate's self-signature does not verify");
        return KVS_ERR_FORMAT;
    }
    const ASN1_TIME *nb = X509_get0_notBefore(x), *na = X509_get0_notAfter(x);
    int cb = nb ? X509_cmp_time(nb, &now) : 0, ca = na ? X509_cmp_time(na, &now) : 0;
    if (cb == 0 || ca == 0) {
        snprintf(why, whylen, "the certificate's validity dates are unreadable");
        return KVS_ERR_FORMAT;
    }
    if (cb > 0) {
        snprintf(why, whylen, "the certificate is not valid yet");
        return KVS_ERR_RANGE;
    }
    if (ca < 0) {
        snprintf(why, whylen, "the certificate has expired");
        return KVS_ERR_RANGE;
    }
    size_t pl = KVS_KEY_PUB_BYTES;
    if (EVP_PKEY_get_raw_public_key(pk, pub, &pl) != 1 || pl != KVS_KEY_PUB_BYTES) {
        ERR_clear_error();
        snprintf(why, whylen, "the certificate's Ed25519 key is unreadable");
        return KVS_ERR_FORMAT;
    }
    return KVS_OK;
}

kvs_err kvs_tls_check_cert(const uint8_t *der, size_t len, time_t now, uint8_t pub[KVS_KEY_PUB_BYTES], char *why,
                           size_t whylen)
{
    const unsigned char *p = der;
    if (!der || len == 0 || len > INT_MAX) {
        snprintf(why, whylen, "no certificate");
        return KVS_ERR_FORMAT;
    }
    X509 *x = d2i_X509(NULL, &p, (long)len);
    ERR_clear_error();
    if (!x || p != der + len) {
        X509_free(x);
        snprintf(why, whylen, "the certificate is not DER X.509");
        return KVS_ERR_FORMAT;
    }
    kvs_err e = check_x509(x, now, pub, why, whylen);
    X509_free(x);
    return e;
}

/* Replaces OpenSSL's chain building (there is no CA): the one certificate
 * must pass check_x509; its key is kept for the check after the handshake. */
static int verify_cb(X509_STORE_CTX *sc, void *arg)
{
    (void)arg;
    SSL *ssl = X509_STORE_CTX_get_ex_data(sc, SSL_get_ex_data_X509_STORE_CTX_idx());
    struct tls_link *t = ssl ? SSL_get_app_data(ssl) : NULL;
    X509 *x = X509_STORE_CTX_get0_cert(sc);
    if (!t || !x) return 0;
    uint8_t pub[KVS_KEY_PUB_BYTES];
    if (check_x509(x, time(NULL), pub, t->cert_why, sizeof t->cert_why)) {
        X509_STORE_CTX_set_error(sc, X509_V_ERR_APPLICATION_VERIFICATION);
        return 0;
    }
    memcpy(t->peer, pub, sizeof pub);
    t->has_peer = true;
    return 1;
}

static kvs_err ctx_new(struct kvs_tls *t, char *errbuf, size_t errlen)
{
    t->ctx = SSL_CTX_new(TLS_method());
    if (!t->ctx || SSL_CTX_set_min_proto_version(t->ctx, TLS1_3_VERSION) != 1 ||
        SSL_CTX_set_max_proto_version(t->ctx, TLS1_3_VERSION) != 1)
        ERR(KVS_ERR_INTERNAL, "cannot make a TLS 1.3 context");
    /* no resumption: every link is a full handshake with both certificates */
    SSL_CTX_set_num_tickets(t->ctx, 0);
    SSL_CTX_set_session_cache_mode(t->ctx, SSL_SESS_CACHE_OFF);
    SSL_CTX_set_options(t->ctx, SSL_OP_NO_TICKET);
    SSL_CTX_set_cert_verify_callback(t->ctx, verify_cb, NULL);
    return KVS_OK;
}

kvs_err kvs_tls_create(const struct kvs_key *k, struct kvs_tls **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    struct kvs_tls *t = calloc(1, sizeof *t);
    if (!t) return KVS_ERR_NOMEM;
    pthread_mutex_init(&t->mu, NULL);
    kvs_err e = ctx_new(t, errbuf, errlen);
    if (!e) {
        t->pk = k->pk;
        EVP_PKEY_up_ref(t->pk);
        t->made = time(NULL);
        t->cert = make_cert(t->pk, t->made);
        if (!t->cert) {
            if (errbuf && errlen) snprintf(errbuf, errlen, "cannot make the node's certificate");
            e = KVS_ERR_INTERNAL;
        }
    }
    if (e) {
        kvs_tls_free(t);
        ERR_clear_error();
        return e;
    }
    *out = t;
    return KVS_OK;
}

kvs_err kvs_tls_create_pem(const char *cert_pem, const char *key_pem, struct kvs_tls **out, char *errbuf,
                           size_t errlen)
{
    *out = NULL;
    struct kvs_tls *t = calloc(1, sizeof *t);
    if (!t) return KVS_ERR_NOMEM;
    pthread_mutex_init(&t->mu, NULL);
    t->fixed = true;
    kvs_err e = ctx_new(t, errbuf, errlen);
    if (!e) {
        BIO *cb = BIO_new_mem_buf(cert_pem, -1), *kb = BIO_new_mem_buf(key_pem, -1);
        t->cert = cb ? PEM_read_bio_X509(cb, NULL, NULL, NULL) : NULL;
        t->pk = kb ? PEM_read_bio_PrivateKey(kb, NULL, NULL, NULL) : NULL;
        BIO_free(cb);
        BIO_free(kb);
        if (!t->cert || !t->pk || X509_check_private_key(t->cert, t->pk) != 1) {
            if (errbuf && errlen) snprintf(errbuf, errlen, "not a PEM certificate with its private key");
            e = KVS_ERR_FORMAT;
        }
    }
    ERR_clear_error();
    if (e) {
        kvs_tls_free(t);
        return e;
    }
    *out = t;
    return KVS_OK;
}

void kvs_tls_free(struct kvs_tls *t)
{
    if (!t) return;
    SSL_CTX_free(t->ctx);
    X509_free(t->cert);
    EVP_PKEY_free(t->pk);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* --- the link ---------------------------------------------------------------------- */

static const struct kvs_link_ops tls_ops;

static kvs_err fail(struct tls_link *t, kvs_err code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvs_err fail(struct tls_link *t, kvs_err code, const char *fmt, ...)
{
    if (t->state != ST_FAILED) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->err, sizeof t->err, fmt, ap);
        va_end(ap);
        t->state = ST_FAILED;
        t->fail_code = code;
    }
    return t->fail_code;
}

/* Writes the ciphertext gathered in wbio to the inner link. */
static kvs_err flush_out(struct tls_link *t, int timeout_ms)
{
    char *p;
    long n = BIO_get_mem_data(t->wbio, &p);
    if (n <= 0) return KVS_OK;
    kvs_err e = kvs_link_write(t->inner, p, (size_t)n, timeout_ms);
    (void)BIO_reset(t->wbio);
    return e;
}

/* Moves what the inner link has into rbio: KVS_OK, NEED_MORE, PEER, IO. */
static kvs_err feed_in(struct tls_link *t)
{
    size_t got = 0;
    kvs_err e = kvs_link_read(t->inner, t->ibuf, IN_CHUNK, &got);
    if (e) return e;
    if (BIO_write(t->rbio, t->ibuf, (int)got) != (int)got) return KVS_ERR_NOMEM;
    return KVS_OK;
}

static void ssl_reason(char *buf, size_t cap)
{
    unsigned long ec = ERR_get_error();
    const char *r = ec ? ERR_reason_error_string(ec) : NULL;
    snprintf(buf, cap, "%s", r ? r : "unknown TLS error");
    ERR_clear_error();
}

static void write_error_frame(struct tls_link *t, kvs_err code, const char *msg)
{
    uint8_t buf[KVS_PROTO_HEADER_BYTES + 4 + KVS_PROTO_MAX_ERRMSG];
    size_t n = kvs_proto_put_error(buf + KVS_PROTO_HEADER_BYTES, (uint32_t)code, msg);
    struct kvs_frame_header h = { .kind = KVS_FRAME_ERROR, .payload_len = (uint32_t)n };
    kvs_proto_put_header(buf, &h);
    if (SSL_write(t->ssl, buf, (int)(KVS_PROTO_HEADER_BYTES + n)) > 0) (void)SSL_shutdown(t->ssl);
    ERR_clear_error();
    (void)flush_out(t, 500);
}

/* The handshake is done: the peer's key must be the expected one. */
static kvs_err after_handshake(struct tls_link *t)
{
    if (!t->has_peer) return fail(t, KVS_ERR_FORMAT, "%s presented no certificate", t->inner->peer);
    if (t->has_expect && memcmp(t->peer, t->expect, KVS_KEY_PUB_BYTES) != 0) {
        char fe[KVS_KEY_FP_HEX + 1], fp[KVS_KEY_FP_HEX + 1], msg[256];
        kvs_key_fingerprint(t->expect, fe);
        kvs_key_fingerprint(t->peer, fp);
        /* phrased for the reader (PROTOCOL.md §4): "it" is this side */
        snprintf(msg, sizeof msg, "it expects key %s, this stage presented key %s", fe, fp);
        write_error_frame(t, KVS_ERR_MISMATCH, msg);
        return fail(t, KVS_ERR_MISMATCH, "%s presented key %s, this stage expects key %s", t->inner->peer, fp, fe);
    }
    t->state = ST_UP;
    return KVS_OK;
}

/* One non-blocking step of the handshake: KVS_OK when done (key checked),
 * NEED_MORE, or the failure. */
static kvs_err handshake_step(struct tls_link *t)
{
    for (;;) {
        ERR_clear_error();
        int r = SSL_do_handshake(t->ssl);
        int se = r == 1 ? SSL_ERROR_NONE : SSL_get_error(t->ssl, r);
        char reason[160] = "";
        if (se == SSL_ERROR_SSL) ssl_reason(reason, sizeof reason);
        kvs_err fe = flush_out(t, HANDSHAKE_WRITE_MS); /* our flight, or the alert of a failure */
        if (r == 1) {
            if (fe) return fail(t, fe, "cannot write to %s: %s", t->inner->peer, kvs_strerror(fe));
            return after_handshake(t);
        }
        if (se == SSL_ERROR_WANT_READ) {
            if (fe) return fail(t, fe, "cannot write to %s: %s", t->inner->peer, kvs_strerror(fe));
            kvs_err e = feed_in(t);
            if (e == KVS_OK) continue;
            if (e == KVS_ERR_NEED_MORE) return e;
            return fail(t, KVS_ERR_PEER, "%s closed the link during the TLS handshake", t->inner->peer);
        }
        if (t->cert_why[0])
            return fail(t, KVS_ERR_FORMAT, "refusing %s: %s", t->inner->peer, t->cert_why);
        return fail(t, KVS_ERR_FORMAT, "TLS handshake with %s failed: %s", t->inner->peer,
                    reason[0] ? reason : "protocol error");
    }
}

/* The epoll descriptor must be readable when bytes wait inside the TLS
 * layer: a whole record in rbio, or decrypted bytes in the SSL object. */
static void update_pending(struct tls_link *t)
{
    bool pending = SSL_pending(t->ssl) > 0;
    if (!pending) {
        char *p;
        long n = BIO_get_mem_data(t->rbio, &p);
        if (n >= 5) {
            long rec = 5 + ((long)(uint8_t)p[3] << 8 | (uint8_t)p[4]);
            pending = n >= rec;
        }
    }
    if (pending && !t->ev_set) {
        (void)eventfd_write(t->evfd, 1);
        t->ev_set = true;
    } else if (!pending && t->ev_set) {
        eventfd_t v;
        (void)eventfd_read(t->evfd, &v);
        t->ev_set = false;
    }
}

static kvs_err tls_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    struct tls_link *t = l->impl;
    if (t->state == ST_FAILED) return t->fail_code;
    if (t->state == ST_HANDSHAKE) {
        kvs_err e = handshake_step(t);
        if (e) return e;
    }
    size_t have = 0;
    kvs_err end = KVS_OK;
    while (have < cap) {
        size_t want = cap - have < INT_MAX ? cap - have : INT_MAX;
        ERR_clear_error();
        int r = SSL_read(t->ssl, (uint8_t *)buf + have, (int)want);
        if (r > 0) {
            have += (size_t)r;
            /* nothing left inside TLS: stop without another read of the inner
             * link (it stays readable if more came; one syscall per record saved) */
            if (SSL_pending(t->ssl) == 0 && BIO_ctrl_pending(t->rbio) == 0) break;
            continue;
        }
        int se = SSL_get_error(t->ssl, r);
        if (se == SSL_ERROR_WANT_READ) {
            kvs_err e = feed_in(t);
            if (e == KVS_OK) continue;
            if (e != KVS_ERR_NEED_MORE) end = e == KVS_ERR_IO ? KVS_ERR_IO : KVS_ERR_PEER;
            break;
        }
        if (se == SSL_ERROR_ZERO_RETURN) { /* close_notify */
            end = KVS_ERR_PEER;
            break;
        }
        char reason[160];
        ssl_reason(reason, sizeof reason);
        (void)flush_out(t, 200); /* the alert */
        end = fail(t, KVS_ERR_FORMAT, "bad TLS record from %s: %s", t->inner->peer, reason);
        break;
    }
    update_pending(t);
    if (have) {
        *got = have;
        return KVS_OK;
    }
    return end ? end : KVS_ERR_NEED_MORE;
}

kvs_err kvs_tls_handshake(struct kvs_link *l, int timeout_ms)
{
    if (!kvs_tls_is_tls(l)) return KVS_ERR_ARG;
    struct tls_link *t = l->impl;
    int64_t deadline = timeout_ms < 0 ? -1 : kvs_link_now_ms() + timeout_ms;
    for (;;) {
        if (t->state == ST_FAILED) return t->fail_code;
        if (t->state == ST_UP) return KVS_OK;
        kvs_err e = handshake_step(t);
        if (e != KVS_ERR_NEED_MORE) return e;
        int wait = -1;
        if (deadline >= 0) {
            int64_t left = deadline - kvs_link_now_ms();
            if (left <= 0) return KVS_ERR_TIMEOUT;
            wait = (int)left;
        }
        struct pollfd p = { .fd = kvs_link_fd(t->inner), .events = POLLIN };
        int r = poll(&p, 1, wait);
        if (r < 0 && errno != EINTR) return KVS_ERR_IO;
    }
}

static kvs_err tls_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    struct tls_link *t = l->impl;
    int64_t deadline = timeout_ms < 0 ? -1 : kvs_link_now_ms() + timeout_ms;
    if (t->state == ST_HANDSHAKE) {
        kvs_err e = kvs_tls_handshake(l, timeout_ms);
        if (e) return e;
    }
    if (t->state == ST_FAILED) return t->fail_code;
    const uint8_t *p = buf;
    while (len) {
        int chunk = len < WRITE_CHUNK ? (int)len : WRITE_CHUNK;
        ERR_clear_error();
        int r = SSL_write(t->ssl, p, chunk);
        if (r <= 0) {
            char reason[160];
            ssl_reason(reason, sizeof reason);
            return fail(t, KVS_ERR_IO, "TLS write to %s failed: %s", t->inner->peer, reason);
        }
        p += r;
        len -= (size_t)r;
        if (len == 0 || BIO_ctrl_pending(t->wbio) >= FLUSH_AT) {
            int left = -1;
            if (deadline >= 0) {
                int64_t d = deadline - kvs_link_now_ms();
                left = d > 0 ? (int)d : 0;
            }
            kvs_err e = flush_out(t, left);
            if (e) return fail(t, e, "cannot write to %s: %s", t->inner->peer, kvs_strerror(e));
        }
    }
    return KVS_OK;
}

static int tls_fd(const struct kvs_link *l)
{
    struct tls_link *t = l->impl;
    int fd = kvs_link_fd(t->inner);
    if (fd != t->inner_fd) { /* an inner transport that changed its descriptor */
        if (t->inner_fd >= 0) (void)epoll_ctl(t->epfd, EPOLL_CTL_DEL, t->inner_fd, NULL);
        struct epoll_event ev = { .events = EPOLLIN };
        ev.data.fd = fd;
        if (fd >= 0) (void)epoll_ctl(t->epfd, EPOLL_CTL_ADD, fd, &ev);
        t->inner_fd = fd;
    }
    return t->epfd;
}

static void tls_close(struct kvs_link *l)
{
    struct tls_link *t = l->impl;
    if (t) {
        if (t->ssl && t->state == ST_UP) { /* close_notify, best effort */
            ERR_clear_error();
            if (SSL_shutdown(t->ssl) >= 0) (void)flush_out(t, 100);
            ERR_clear_error();
        }
        SSL_free(t->ssl);
        kvs_link_close(t->inner);
        if (t->epfd >= 0) close(t->epfd);
        if (t->evfd >= 0) close(t->evfd);
        free(t->ibuf);
        free(t);
    }
    free(l);
}

static const struct kvs_link_ops tls_ops = {
    .name = "tls", .read = tls_read, .write = tls_write, .fd = tls_fd, .close = tls_close,
};

kvs_err kvs_tls_wrap(struct kvs_tls *tls, struct kvs_link *inner, enum kvs_tls_side side,
                     const uint8_t expect[KVS_KEY_PUB_BYTES], struct kvs_link **out)
{
    *out = NULL;
    struct kvs_link *l = calloc(1, sizeof *l);
    struct tls_link *t = calloc(1, sizeof *t);
    if (!l || !t) goto nomem;
    t->epfd = t->evfd = t->inner_fd = -1;
    t->inner = inner;
    l->ops = &tls_ops;
    l->impl = t;
    snprintf(l->peer, sizeof l->peer, "%s", inner->peer);
    t->ibuf = malloc(IN_CHUNK);
    t->epfd = epoll_create1(EPOLL_CLOEXEC);
    t->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (!t->ibuf || t->epfd < 0 || t->evfd < 0) goto nomem;
    struct epoll_event ev = { .events = EPOLLIN };
    ev.data.fd = t->evfd;
    if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->evfd, &ev) != 0) goto nomem;
    (void)tls_fd(l);
    if (expect) {
        memcpy(t->expect, expect, KVS_KEY_PUB_BYTES);
        t->has_expect = true;
    }

    X509 *cert;
    pthread_mutex_lock(&tls->mu);
    time_t now = time(NULL);
    if (!tls->fixed && now - tls->made > CERT_REMAKE_S) {
        X509 *fresh = make_cert(tls->pk, now);
        if (fresh) {
            X509_free(tls->cert);
            tls->cert = fresh;
            tls->made = now;
        }
    }
    cert = tls->cert;
    X509_up_ref(cert);
    pthread_mutex_unlock(&tls->mu);

    t->ssl = SSL_new(tls->ctx);
    t->rbio = BIO_new(BIO_s_mem());
    t->wbio = BIO_new(BIO_s_mem());
    bool ok = t->ssl && t->rbio && t->wbio;
    if (ok) {
        SSL_set_bio(t->ssl, t->rbio, t->wbio); /* ssl owns both now */
        SSL_set_app_data(t->ssl, t);
        ok = SSL_use_certificate(t->ssl, cert) == 1 && SSL_use_PrivateKey(t->ssl, tls->pk) == 1;
        int mode = SSL_VERIFY_PEER | (side == KVS_TLS_ACCEPTOR ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0);
        SSL_set_verify(t->ssl, mode, NULL);
        if (side == KVS_TLS_DIALER) SSL_set_connect_state(t->ssl);
        else SSL_set_accept_state(t->ssl);
    } else {
        BIO_free(t->rbio);
        BIO_free(t->wbio);
    }
    X509_free(cert);
    ERR_clear_error();
    if (!ok) goto nomem;
    *out = l;
    return KVS_OK;
nomem:
    if (t && t->inner) {
        tls_close(l); /* closes inner too */
    } else {
        kvs_link_close(inner);
        free(t);
        free(l);
    }
    return KVS_ERR_NOMEM;
}

bool kvs_tls_is_tls(const struct kvs_link *l)
{
    return l && l->ops == &tls_ops;
}

bool kvs_tls_ready(const struct kvs_link *l)
{
    return kvs_tls_is_tls(l) && ((const struct tls_link *)l->impl)->state == ST_UP;
}

bool kvs_tls_peer_key(const struct kvs_link *l, uint8_t pub[KVS_KEY_PUB_BYTES])
{
    if (!kvs_tls_is_tls(l)) return false;
    const struct tls_link *t = l->impl;
    if (t->state != ST_UP || !t->has_peer) return false;
    memcpy(pub, t->peer, KVS_KEY_PUB_BYTES);
    return true;
}

const char *kvs_tls_error(const struct kvs_link *l)
{
    if (!kvs_tls_is_tls(l)) return NULL;
    const struct tls_link *t = l->impl;
    return t->state == ST_FAILED ? t->err : NULL;
}

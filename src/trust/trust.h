/* Trust between stages: node identity keys and TLS 1.3 ring links.
 *
 * Node keys. Every node has a long-lived Ed25519 key pair (RFC 8032, through
 * OpenSSL). Its public key is 32 bytes, written as 64 lowercase hex digits
 * (the form manifests, inventories and --next-key / --prev-key use); its
 * fingerprint, for logs and messages, is the first 8 bytes of the SHA-256 of
 * those 32 bytes as 16 hex digits. The private key is stored as a PKCS#8 PEM
 * file ("-----BEGIN PRIVATE KEY-----", RFC 5958/7468), mode 0600.
 *
 * TLS links. kvs_tls_wrap puts TLS 1.3 (RFC 8446) over any kvs_link (TCP,
 * the relay's WebSocket, a test socketpair): the TLS records travel as the
 * inner link's bytes through memory BIOs, so whatever carries them forwards
 * only ciphertext. There is no CA: each side presents a self-signed X.509
 * certificate made from its node key (Ed25519 signature, RFC 8410) and checks
 * (1) the certificate itself: parseable, Ed25519, self-signature valid,
 * within its validity dates; (2) after the handshake, that the peer's key is
 * the one expected for that neighbour. The handshake's CertificateVerify
 * proves the peer holds the private key. A peer with another key is refused
 * before any application byte is handed up: this side writes one ERROR frame
 * (docs/PROTOCOL.md §3.7, code MISMATCH) inside TLS naming the expected and
 * the presented fingerprints, phrased for the reader ("it expects key X, this
 * stage presented Y"), then closes. See docs/PROTOCOL.md §4.
 *
 * The wrapped link is non-blocking like the others: read returns what is
 * there (driving the handshake as bytes arrive); write waits, bounded, and
 * drives the handshake to its end first. Its fd (an epoll descriptor) is
 * readable when the inner link is, or when decrypted bytes wait in the TLS
 * layer, so a poll loop that reads less than is there never stalls.
 *
 * Threads: a kvs_tls may be used by several threads to wrap links; one
 * wrapped link by one thread at a time (like every link).
 */
#ifndef KVS_TRUST_H
#define KVS_TRUST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "common/error.h"
#include "link/link.h"

#define KVS_KEY_PUB_BYTES 32
#define KVS_KEY_PUB_HEX 64 /* characters of a public key in hex (no NUL) */
#define KVS_KEY_FP_HEX 16  /* characters of a fingerprint (no NUL) */

/* --- node keys ---------------------------------------------------------------- */

struct kvs_key; /* opaque: an Ed25519 key pair */

/* Makes a fresh key pair (OpenSSL's CSPRNG). Errors: KVS_ERR_INTERNAL. */
kvs_err kvs_key_generate(struct kvs_key **out);
/* Writes the private key as PKCS#8 PEM to path, created with mode 0600; an
 * existing file is never overwritten (KVS_ERR_ARG, "exists"). Errors:
 * KVS_ERR_IO (cannot create or write: errbuf says why). */
kvs_err kvs_key_save(const struct kvs_key *k, const char *path, char *errbuf, size_t errlen);
/* Reads a private key file written by kvs_key_save (or `openssl genpkey
 * -algorithm ed25519`). Errors: KVS_ERR_IO (cannot read), KVS_ERR_FORMAT (not
 * a PEM private key), KVS_ERR_UNSUPPORTED (a key of another algorithm),
 * KVS_ERR_ARG (the file is readable by group or others: chmod 600 it). */
kvs_err kvs_key_load(const char *path, struct kvs_key **out, char *errbuf, size_t errlen);
void kvs_key_free(struct kvs_key *k); /* NULL allowed */
/* The 32-byte public key. */
void kvs_key_public(const struct kvs_key *k, uint8_t pub[KVS_KEY_PUB_BYTES]);

/* Parses a public key written as 64 hex digits (either case; an "ed25519:"
 * prefix is allowed). Errors: KVS_ERR_FORMAT. */
kvs_err kvs_key_parse_public(const char *text, uint8_t pub[KVS_KEY_PUB_BYTES]);
/* out[KVS_KEY_PUB_HEX + 1]: the 64 lowercase hex digits. */
void kvs_key_public_hex(const uint8_t pub[KVS_KEY_PUB_BYTES], char *out);
/* out[KVS_KEY_FP_HEX + 1]: the fingerprint (first 8 bytes of SHA-256(pub), hex). */
void kvs_key_fingerprint(const uint8_t pub[KVS_KEY_PUB_BYTES], char *out);

#define KVS_KEY_SIG_BYTES 64 /* an Ed25519 signature (RFC 8032 §5.1.6) */
/* Signs len bytes of msg (pure Ed25519, no pre-hash). Errors: KVS_ERR_INTERNAL. */
kvs_err kvs_key_sign(const struct kvs_key *k, const void *msg, size_t len, uint8_t sig[KVS_KEY_SIG_BYTES]);
/* True if sig is pub's Ed25519 signature of msg (false also for a pub that is not a point). */
bool kvs_key_verify(const uint8_t pub[KVS_KEY_PUB_BYTES], const void *msg, size_t len,
                    const uint8_t sig[KVS_KEY_SIG_BYTES]);

/* --- TLS identity -------------------------------------------------------------- */

struct kvs_tls; /* opaque: a node's key, its self-signed certificate, the TLS contexts */

/* Makes a TLS identity from a node key (copied). The certificate is
 * self-signed with the key: subject/issuer CN "kvasir node FINGERPRINT",
 * valid from one hour before now for 30 days, and made anew when a link is
 * wrapped more than a day after it was made. Errors: KVS_ERR_INTERNAL. */
kvs_err kvs_tls_create(const struct kvs_key *k, struct kvs_tls **out, char *errbuf, size_t errlen);
/* Test hook: an identity presenting the given PEM certificate and private
 * key as they are (any algorithm, any dates): to show that peers refuse bad
 * certificates. Errors: KVS_ERR_FORMAT (not PEM / key does not match). */
kvs_err kvs_tls_create_pem(const char *cert_pem, const char *key_pem, struct kvs_tls **out, char *errbuf,
                           size_t errlen);
void kvs_tls_free(struct kvs_tls *t); /* NULL allowed; links wrapped with it must be closed first */

/* Checks a peer certificate (DER, RFC 5280) the way a link does before its
 * key is compared: parseable, an Ed25519 key, a valid self-signature, `now`
 * (seconds since 1970) within notBefore..notAfter. On success pub gets the
 * key. Errors: KVS_ERR_FORMAT (garbage, bad signature), KVS_ERR_UNSUPPORTED
 * (another algorithm), KVS_ERR_RANGE (expired or not yet valid); why says
 * which. */
kvs_err kvs_tls_check_cert(const uint8_t *der, size_t len, time_t now, uint8_t pub[KVS_KEY_PUB_BYTES], char *why,
                           size_t whylen);

enum kvs_tls_side {
    KVS_TLS_DIALER = 1, /* TLS client: the predecessor, which dialed */
    KVS_TLS_ACCEPTOR,   /* TLS server: the successor, which accepted */
};

/* Wraps inner (ownership passes to the new link, also on failure) in TLS
 * 1.3. expect: the peer's required public key; NULL accepts any peer whose
 * certificate passes kvs_tls_check_cert (for tools; a ring link always names
 * its key). The link's peer string is inner's. Reads and writes fail
 * (KVS_ERR_MISMATCH: wrong key; KVS_ERR_FORMAT: bad certificate or TLS
 * bytes; KVS_ERR_PEER: closed) once the handshake failed: kvs_tls_error
 * says why. Errors here: KVS_ERR_NOMEM. */
kvs_err kvs_tls_wrap(struct kvs_tls *t, struct kvs_link *inner, enum kvs_tls_side side,
                     const uint8_t expect[KVS_KEY_PUB_BYTES], struct kvs_link **out);
/* True for a link made by kvs_tls_wrap. */
bool kvs_tls_is_tls(const struct kvs_link *l);
/* Drives the handshake of a wrapped link to its end, waiting at most
 * timeout_ms: KVS_OK (done, the key checked), KVS_ERR_TIMEOUT, or the
 * link's failure (see kvs_tls_wrap). Reads/writes call it as needed. */
kvs_err kvs_tls_handshake(struct kvs_link *l, int timeout_ms);
/* True once the handshake finished and the peer's key was accepted. */
bool kvs_tls_ready(const struct kvs_link *l);
/* After the handshake: the peer's public key. False before (or not TLS). */
bool kvs_tls_peer_key(const struct kvs_link *l, uint8_t pub[KVS_KEY_PUB_BYTES]);
/* Why the link failed (refused key, bad certificate, TLS alert), or NULL.
 * Borrowed from the link. */
const char *kvs_tls_error(const struct kvs_link *l);

#endif

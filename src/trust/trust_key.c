/* Node keys: Ed25519 through OpenSSL's EVP API; PKCS#8 PEM files. */
#include "trust/trust_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>

#include "common/hex.h"

#define ERR(code, ...)                                                                                     \
    do {                                                                                                   \
        if (errbuf && errlen) snprintf(errbuf, errlen, __VA_ARGS__);                                       \
        return code;                                                                                       \
    } while (0)

kvs_err kvs_key_generate(struct kvs_key **out)
{
    *out = NULL;
    EVP_PKEY *pk = NULL;
    EVP_PKEY_CTX *c = EVP_PKEY_CTX_new_id(EVP_PKEY_ED25519, NULL);
    if (!c || EVP_PKEY_keygen_init(c) <= 0 || EVP_PKEY_keygen(c, &pk) <= 0) {
        EVP_PKEY_CTX_free(c);
        return KVS_ERR_INTERNAL;
    }
    EVP_PKEY_CTX_free(c);
    struct kvs_key *k = calloc(1, sizeof *k);
    if (!k) {
        EVP_PKEY_free(pk);
        return KVS_ERR_NOMEM;
    }
    k->pk = pk;
    *out = k;
    return KVS_OK;
}

kvs_err kvs_key_save(const struct kvs_key *k, const char *path, char *errbuf, size_t errlen)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        if (errno == EEXIST) ERR(KVS_ERR_ARG, "%s exists: a key file is never overwritten", path);
        ERR(KVS_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    }
    /* O_CREAT's mode is filtered by the umask: make it exactly 0600 */
    if (fchmod(fd, 0600) != 0) {
        int en = errno;
        close(fd);
        unlink(path);
        ERR(KVS_ERR_IO, "cannot chmod %s: %s", path, strerror(en));
    }
    FILE *f = fdopen(fd, "w");
    if (!f) {
        close(fd);
        unlink(path);
        ERR(KVS_ERR_IO, "cannot write %s", path);
    }
    int ok = PEM_write_PrivateKey(f, k->pk, NULL, NULL, 0, NULL, NULL) == 1;
    ok &= fflush(f) == 0;
    ok &= fclose(f) == 0;
    if (!ok) {
        unlink(path);
        ERR(KVS_ERR_IO, "cannot write %s", path);
    }
    return KVS_OK;
}

kvs_err kvs_key_load(const char *path, struct kvs_key **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    FILE *f = fopen(path, "re");
    if (!f) ERR(KVS_ERR_IO, "cannot open key file %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && (st.st_mode & 077)) {
        fclose(f);
        ERR(KVS_ERR_ARG, "key file %s is readable by others (mode %03o): chmod 600 it", path,
            (unsigned)(st.st_mode & 0777));
    }
    EVP_PKEY *pk = PEM_read_PrivateKey(f, NULL, NULL, NULL);
    fclose(f);
    if (!pk) ERR(KVS_ERR_FORMAT, "%s is not a PEM private key file", path);
    if (EVP_PKEY_id(pk) != EVP_PKEY_ED25519) {
        EVP_PKEY_free(pk);
        ERR(KVS_ERR_UNSUPPORTED, "%s holds a key of another algorithm (a node key is Ed25519)", path);
    }
    struct kvs_key *k = calloc(1, sizeof *k);
    if (!k) {
        EVP_PKEY_free(pk);
        return KVS_ERR_NOMEM;
    }
    k->pk = pk;
    *out = k;
    return KVS_OK;
}

void kvs_key_free(struct kvs_key *k)
{
    if (!k) return;
    EVP_PKEY_free(k->pk);
    free(k);
}

void kvs_key_public(const struct kvs_key *k, uint8_t pub[KVS_KEY_PUB_BYTES])
{
    size_t n = KVS_KEY_PUB_BYTES;
    if (EVP_PKEY_get_raw_public_key(k->pk, pub, &n) != 1 || n != KVS_KEY_PUB_BYTES)
        memset(pub, 0, KVS_KEY_PUB_BYTES);
}

kvs_err kvs_key_parse_public(const char *text, uint8_t pub[KVS_KEY_PUB_BYTES])
{
    if (!text) return KVS_ERR_FORMAT;
    if (strncmp(text, "ed25519:", 8) == 0) text += 8;
    if (strlen(text) != KVS_KEY_PUB_HEX) return KVS_ERR_FORMAT;
    for (int i = 0; i < KVS_KEY_PUB_BYTES; i++) {
        int hi = kvs_hex_value(text[2 * i]), lo = kvs_hex_value(text[2 * i + 1]);
        if (hi < 0 || lo < 0) return KVS_ERR_FORMAT;
        pub[i] = (uint8_t)(hi << 4 | lo);
    }
    return KVS_OK;
}

void kvs_key_public_hex(const uint8_t pub[KVS_KEY_PUB_BYTES], char *out)
{
    static const char d[] = "0123456789abcdef";
    for (int i = 0; i < KVS_KEY_PUB_BYTES; i++) {
        out[2 * i] = d[pub[i] >> 4];
        out[2 * i + 1] = d[pub[i] & 15];
    }
    out[KVS_KEY_PUB_HEX] = '\0';
}

void kvs_key_fingerprint(const uint8_t pub[KVS_KEY_PUB_BYTES], char *out)
{
    static const char d[] = "0123456789abcdef";
    uint8_t h[SHA256_DIGEST_LENGTH];
    SHA256(pub, KVS_KEY_PUB_BYTES, h);
    for (int i = 0; i < KVS_KEY_FP_HEX / 2; i++) {
        out[2 * i] = d[h[i] >> 4];
        out[2 * i + 1] = d[h[i] & 15];
    }
    out[KVS_KEY_FP_HEX] = '\0';
}

kvs_err kvs_key_sign(const struct kvs_key *k, const void *msg, size_t len, uint8_t sig[KVS_KEY_SIG_BYTES])
{
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    size_t n = KVS_KEY_SIG_BYTES;
    int ok = c && EVP_DigestSignInit(c, NULL, NULL, NULL, k->pk) > 0 &&
             EVP_DigestSign(c, sig, &n, msg, len) > 0 && n == KVS_KEY_SIG_BYTES;
    EVP_MD_CTX_free(c);
    return ok ? KVS_OK : KVS_ERR_INTERNAL;
}

bool kvs_key_verify(const uint8_t pub[KVS_KEY_PUB_BYTES], const void *msg, size_t len,
                    const uint8_t sig[KVS_KEY_SIG_BYTES])
{
    EVP_PKEY *pk = EVP_PKEY_new_raw_public_key(EVP_PKEY_ED25519, NULL, pub, KVS_KEY_PUB_BYTES);
    EVP_MD_CTX *c = pk ? EVP_MD_CTX_new() : NULL;
    bool ok = c && EVP_DigestVerifyInit(c, NULL, NULL, NULL, pk) > 0 &&
              EVP_DigestVerify(c, sig, KVS_KEY_SIG_BYTES, msg, len) == 1;
    EVP_MD_CTX_free(c);
    EVP_PKEY_free(pk);
    return ok;
}

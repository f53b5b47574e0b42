/* The content identity of a model: one SHA-256 over its fingerprint, the
 * digest of its metadata and the SHA-256 of every tensor's data
 * (docs/FORMATS.md, "Content id"). The fingerprint says which shapes a model
 * has; the content id says which weights, tokenizer and hyperparameters. */
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "common/hex.h"
#include "shard/shard_impl.h"

#define CONTENT_TAG "kvasir-content-v2"
#define META_PREFIX "kvasir."

/* SHA-256(tag || fp || meta || u64le n || d[0] || ... || d[n-1]). */
static kvs_err content_hash(const uint8_t fp[32], const uint8_t meta[32], const uint8_t *const *d, size_t n,
                            uint8_t out[32])
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx)
        return KVS_ERR_NOMEM;
    uint8_t nb[8];
    for (int i = 0; i < 8; i++)
        nb[i] = (uint8_t)((uint64_t)n >> (8 * i));
    unsigned int len = 0;
    int ok = EVP_DigestInit_ex(ctx, EVP_sha256(), NULL) && EVP_DigestUpdate(ctx, CONTENT_TAG, strlen(CONTENT_TAG)) &&
             EVP_DigestUpdate(ctx, fp, 32) && EVP_DigestUpdate(ctx, meta, 32) && EVP_DigestUpdate(ctx, nb, 8);
    for (size_t i = 0; ok && i < n; i++)
        ok = EVP_DigestUpdate(ctx, d[i], 32);
    ok = ok && EVP_DigestFinal_ex(ctx, out, &len) && len == 32;
    EVP_MD_CTX_free(ctx);
    return ok ? KVS_OK : KVS_ERR_INTERNAL;
}

struct kv_ref {
    const char *key;
    size_t i;
};

static int cmp_kv(const void *a, const void *b)
{
    return strcmp(((const struct kv_ref *)a)->key, ((const struct kv_ref *)b)->key);
}

kvs_err kvs_shard_metadata_digest(const struct kvs_gguf *g, uint8_t out[32])
{
    if (!g || !out)
        return KVS_ERR_ARG;
    size_t n = kvs_gguf_n_kv(g), m = 0;
    struct kv_ref *r = malloc((n ? n : 1) * sizeof *r);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    kvs_err err = r && ctx ? KVS_OK : KVS_ERR_NOMEM;
    for (size_t i = 0; !err && i < n; i++) {
        const char *k = kvs_gguf_key(g, i);
        if (strncmp(k, META_PREFIX, strlen(META_PREFIX)) != 0)
            r[m++] = (struct kv_ref){ k, i };
    }
    if (!err && m > 1)
        qsort(r, m, sizeof *r, cmp_kv); /* keys are unique: kvs_gguf_open checks */
    unsigned int len = 0;
    int ok = !err && EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    for (size_t j = 0; ok && j < m; j++) {
        const uint8_t *p;
        size_t plen;
        ok = kvs_gguf_kv_raw(g, r[j].i, &p, &plen) == KVS_OK && EVP_DigestUpdate(ctx, p, plen);
    }
    ok = ok && EVP_DigestFinal_ex(ctx, out, &len) && len == 32;
    if (!err && !ok)
        err = KVS_ERR_INTERNAL;
    EVP_MD_CTX_free(ctx);
    free(r);
    return err;
}

static int cmp_entry(const void *a, const void *b)
{
    return strcmp((*(const struct kvs_shard_index_entry *const *)a)->name,
                  (*(const struct kvs_shard_index_entry *const *)b)->name);
}

static int cmp_tensor(const void *a, const void *b)
{
    return strcmp((*(const struct kvs_gguf_tensor *const *)a)->name, (*(const struct kvs_gguf_tensor *const *)b)->name);
}

kvs_err kvs_shard_index_content_id(const struct kvs_shard_index *ix, uint8_t out[32])
{
    uint8_t fp[32];
    if (!ix || !kvs_shard_unhex(ix->fingerprint, strlen(ix->fingerprint), fp))
        return KVS_ERR_FORMAT;
    size_t n = ix->n_tensors;
    const struct kvs_shard_index_entry **e = malloc((n ? n : 1) * sizeof *e);
    const uint8_t **d = malloc((n ? n : 1) * sizeof *d);
    kvs_err err = e && d ? KVS_OK : KVS_ERR_NOMEM;
    if (!err) {
        for (size_t i = 0; i < n; i++)
            e[i] = &ix->tensors[i];
        if (n > 1)
            qsort(e, n, sizeof *e, cmp_entry);
        for (size_t i = 0; i < n && !err; i++) {
            if (i && strcmp(e[i - 1]->name, e[i]->name) == 0)
                err = KVS_ERR_FORMAT; /* two entries for one tensor: no single content */
            d[i] = e[i]->sha256;
        }
    }
    if (!err)
        err = content_hash(fp, ix->metadata_sha256, d, n, out);
    free(e);
    free(d);
    return err;
}

kvs_err kvs_shard_content_id(const struct kvs_gguf *g, uint8_t out[32], char *errbuf, size_t errlen)
{
    const char *s;
    size_t len;
    kvs_err err = kvs_gguf_get_str(g, KVS_SHARD_KEY_SOURCE_CONTENT_ID, &s, &len);
    if (err == KVS_OK)
        return kvs_shard_unhex(s, len, out) ? KVS_OK
                                            : kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen,
                                                             "%s is not 64 hex digits",
                                                             KVS_SHARD_KEY_SOURCE_CONTENT_ID);
    if (err != KVS_ERR_NOT_FOUND)
        return kvs_shard__err(KVS_ERR_FORMAT, errbuf, errlen, "%s is not a string", KVS_SHARD_KEY_SOURCE_CONTENT_ID);
    uint32_t b, e;
    if (kvs_shard_window(g, &b, &e))
        return kvs_shard__err(KVS_ERR_NOT_FOUND, errbuf, errlen,
                              "the shard of [%u,%u) records no content id (fetched without an index)", b, e);
    uint8_t fp[32];
    err = kvs_gguf_fingerprint(g, fp);
    if (err)
        return kvs_shard__err(err, errbuf, errlen, "cannot fingerprint the model: %s", kvs_strerror(err));
    size_t n = kvs_gguf_n_tensors(g);
    uint8_t(*sha)[32] = malloc((n ? n : 1) * 32);
    const uint8_t **d = malloc((n ? n : 1) * sizeof *d);
    const struct kvs_gguf_tensor **ts = malloc((n ? n : 1) * sizeof *ts);
    err = sha && d && ts ? KVS_OK : KVS_ERR_NOMEM;
    if (!err) {
        for (size_t k = 0; k < n; k++)
            ts[k] = kvs_gguf_tensor(g, k);
        if (n > 1)
            qsort(ts, n, sizeof *ts, cmp_tensor); /* names are unique: kvs_gguf_open checks */
    }
    for (size_t k = 0; k < n && !err; k++) {
        const struct kvs_gguf_tensor *t = ts[k];
        if (!t->data && t->bytes)
            err = kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "tensor '%s' has no data", t->name);
        else
            err = kvs_shard_sha256(t->bytes ? t->data : "", t->bytes, sha[k]);
        d[k] = sha[k];
    }
    uint8_t meta[32];
    if (!err)
        err = kvs_shard_metadata_digest(g, meta);
    if (!err)
        err = content_hash(fp, meta, d, n, out);
    free(ts);
    free(sha);
    free(d);
    return err;
}

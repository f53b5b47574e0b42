/* Model fingerprint: SHA-256 over the model's identity, not its bytes. The
 * byte recipe is normative in docs/FORMATS.md, section "Model fingerprint";
 * this file implements exactly that list. */
#include <openssl/evp.h>
#include <string.h>

#include "gguf/gguf.h"
#include "common/hex.h"
#include "gguf/gguf_impl.h"

#define FP_TAG "kvasir-fingerprint-v1"
#define FP_SOURCE_KEY "kvasir.shard.source_fingerprint"


static int put_u64(EVP_MD_CTX *ctx, uint64_t v)
{
    uint8_t b[8];
    kvs_gguf_st64(b, v);
    return EVP_DigestUpdate(ctx, b, 8);
}

static int put_u32(EVP_MD_CTX *ctx, uint32_t v)
{
    uint8_t b[4];
    kvs_gguf_st32(b, v);
    return EVP_DigestUpdate(ctx, b, 4);
}

static int put_str(EVP_MD_CTX *ctx, const char *s, size_t n)
{
    return put_u64(ctx, n) && (n == 0 || EVP_DigestUpdate(ctx, s, n));
}

/* Whether key starts with arch followed by '.'. */
static bool is_arch_key(const char *key, const char *arch, size_t alen)
{
    return alen > 0 && strncmp(key, arch, alen) == 0 && key[alen] == '.';
}

kvs_err kvs_gguf_fingerprint(const struct kvs_gguf *g, uint8_t out[32])
{
    if (!g || !out)
        return KVS_ERR_ARG;
    const char *s;
    size_t n;
    kvs_err e = kvs_gguf_get_str(g, FP_SOURCE_KEY, &s, &n);
    if (e == KVS_OK) {
        if (n != 64)
            return KVS_ERR_FORMAT;
        for (size_t i = 0; i < 32; i++) {
            int hi = kvs_hex_value(s[2 * i]), lo = kvs_hex_value(s[2 * i + 1]);
            if (hi < 0 || lo < 0)
                return KVS_ERR_FORMAT;
            out[i] = (uint8_t)(hi << 4 | lo);
        }
        return KVS_OK;
    }
    if (e != KVS_ERR_NOT_FOUND)
        return KVS_ERR_FORMAT;

    /* The architecture: a copy bounded to what a key prefix can use. */
    char arch[256];
    size_t alen = 0;
    if (kvs_gguf_get_str(g, "general.architecture", &s, &n) == KVS_OK) {
        if (n >= sizeof arch || memchr(s, 0, n))
            return KVS_ERR_FORMAT;
        memcpy(arch, s, n);
        alen = n;
    }
    arch[alen] = 0;

    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    if (!ctx)
        return KVS_ERR_NOMEM;
    int ok = EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    ok = ok && EVP_DigestUpdate(ctx, FP_TAG, strlen(FP_TAG));
    ok = ok && put_str(ctx, arch, alen);

    size_t nkv = kvs_gguf_n_kv(g), n_arch = 0;
    for (size_t i = 0; i < nkv; i++)
        if (is_arch_key(kvs_gguf_key(g, i), arch, alen))
            n_arch++;
    ok = ok && put_u64(ctx, n_arch);
    for (size_t k = 0; ok && k < nkv; k++) {
        size_t i = kvs_gguf_kv_sorted(g, k);
        if (!is_arch_key(kvs_gguf_key(g, i), arch, alen))
            continue;
        const uint8_t *raw;
        size_t rlen;
        ok = kvs_gguf_kv_raw(g, i, &raw, &rlen) == KVS_OK && EVP_DigestUpdate(ctx, raw, rlen);
    }

    uint64_t vocab = 0;
    int64_t ti = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    if (ti >= 0)
        vocab = kvs_gguf_arr_n(g, (size_t)ti);
    ok = ok && put_u64(ctx, vocab);

    size_t nt = kvs_gguf_n_tensors(g);
    ok = ok && put_u64(ctx, nt);
    for (size_t k = 0; ok && k < nt; k++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, kvs_gguf_tensor_sorted(g, k));
        ok = put_str(ctx, t->name, strlen(t->name)) && put_u32(ctx, (uint32_t)t->type) &&
             put_u32(ctx, t->n_dims);
        for (uint32_t d = 0; ok && d < t->n_dims; d++)
            ok = put_u64(ctx, (uint64_t)t->ne[d]);
    }
    unsigned int mdlen = 0;
    ok = ok && EVP_DigestFinal_ex(ctx, out, &mdlen) && mdlen == 32;
    EVP_MD_CTX_free(ctx);
    return ok ? KVS_OK : KVS_ERR_INTERNAL;
}

void kvs_gguf_fingerprint_hex(const uint8_t fp[32], char hex[65])
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < 32; i++) {
        hex[2 * i] = digits[fp[i] >> 4];
        hex[2 * i + 1] = digits[fp[i] & 15];
    }
    hex[64] = 0;
}

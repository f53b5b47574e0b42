/* Model profile from a GGUF header: per-block weight, stream and KV bytes,
 * head/tail extras (keys: gguf-facts §3.2; tensor names: §3.3). */
#include "plan/plan.h"
#include "plan/plan_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gguf/gguf.h"

/* `{arch}.suffix` into key; false if it does not fit. */
static bool arch_key(char *key, size_t n, const char *arch, size_t arch_len, const char *suffix)
{
    int r = snprintf(key, n, "%.*s.%s", (int)arch_len, arch, suffix);
    return r > 0 && (size_t)r < n;
}

static kvs_err get_u32_arch(const struct kvs_gguf *g, const char *arch, size_t alen, const char *suffix,
                            uint32_t *out, bool required, char *errbuf, size_t errlen)
{
    char key[160];
    if (!arch_key(key, sizeof key, arch, alen, suffix)) {
        kvs_plan_seterr(errbuf, errlen, "architecture name too long");
        return KVS_ERR_FORMAT;
    }
    kvs_err e = kvs_gguf_get_u32(g, key, out);
    if (e == KVS_ERR_NOT_FOUND && !required)
        return KVS_ERR_NOT_FOUND;
    if (e)
        kvs_plan_seterr(errbuf, errlen, "%s: %s", key, kvs_strerror(e));
    return e;
}

/* Parses "blk.N." at the start of name: N, or -1 if name is not a block tensor. */
static long block_index(const char *name)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    const char *p = name + 4;
    long v = 0;
    if (*p < '0' || *p > '9')
        return -1;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (*p - '0');
        if (v > 1000000)
            return -1;
        p++;
    }
    return *p == '.' ? v : -1;
}

/* head_count_kv of layer il: a scalar or a per-layer array (u32/i32). */
static kvs_err head_count_kv(const struct kvs_gguf *g, const char *key, uint32_t il, uint32_t dflt, uint32_t *out)
{
    uint32_t v;
    kvs_err e = kvs_gguf_get_u32(g, key, &v);
    if (e == KVS_OK) {
        *out = v;
        return KVS_OK;
    }
    if (e == KVS_ERR_NOT_FOUND) {
        *out = dflt;
        return KVS_OK;
    }
    enum kvs_gguf_type et;
    uint64_t n;
    const void *data;
    e = kvs_gguf_get_arr(g, key, &et, &n, &data);
    if (e)
        return e;
    if ((et != KVS_GGUF_TYPE_UINT32 && et != KVS_GGUF_TYPE_INT32) || il >= n)
        return KVS_ERR_FORMAT;
    int32_t x;
    memcpy(&x, (const uint8_t *)data + (size_t)il * 4, 4);
    if (x < 0)
        return KVS_ERR_FORMAT;
    *out = (uint32_t)x;
    return KVS_OK;
}

/* Hybrid (Gated DeltaNet) models: which blocks are recurrent and their
 * per-sequence state (qwen35-facts §1 keys, §4.2 state sizes). Leaves m
 * untouched (all attention) when the file has no `{arch}.ssm.state_size`. */
static kvs_err hybrid_state(const struct kvs_gguf *g, const char *arch, size_t alen, uint32_t n_layer,
                            struct kvs_plan_model *m, char *errbuf, size_t errlen)
{
    static const char *const hybrids[] = { "qwen35", "qwen35moe", "qwen3next" };
    bool hybrid = false;
    for (size_t i = 0; i < sizeof hybrids / sizeof hybrids[0]; i++)
        hybrid |= strlen(hybrids[i]) == alen && !memcmp(hybrids[i], arch, alen);
    uint32_t d = 0, K = 0, hv = 0, hk = 0, interval = 4;
    kvs_err e;
    if (!hybrid || get_u32_arch(g, arch, alen, "ssm.state_size", &d, false, errbuf, errlen) == KVS_ERR_NOT_FOUND)
        return KVS_OK;
    if ((e = get_u32_arch(g, arch, alen, "ssm.state_size", &d, true, errbuf, errlen)) ||
        (e = get_u32_arch(g, arch, alen, "ssm.conv_kernel", &K, true, errbuf, errlen)) ||
        (e = get_u32_arch(g, arch, alen, "ssm.time_step_rank", &hv, true, errbuf, errlen)) ||
        (e = get_u32_arch(g, arch, alen, "ssm.group_count", &hk, true, errbuf, errlen)))
        return e;
    e = get_u32_arch(g, arch, alen, "full_attention_interval", &interval, false, errbuf, errlen);
    if (e && e != KVS_ERR_NOT_FOUND)
        return e;
    if (d == 0 || d > 4096 || K < 2 || K > 64 || hv == 0 || hv > 4096 || hk == 0 || hk > hv || interval == 0) {
        kvs_plan_seterr(errbuf, errlen, "bad ssm hyperparameters: state_size %u, conv_kernel %u, time_step_rank %u, "
                        "group_count %u, full_attention_interval %u", d, K, hv, hk, interval);
        return KVS_ERR_FORMAT;
    }
    const uint64_t C = (2ull * hk + hv) * d;
    const uint64_t state = ((uint64_t)(K - 1) * C + (uint64_t)hv * d * d) * 4;
    char key[160];
    enum kvs_gguf_type et = KVS_GGUF_TYPE_UINT32;
    uint64_t n = 0;
    const void *data = NULL;
    const bool have_arr = arch_key(key, sizeof key, arch, alen, "attention.recurrent_layers") &&
                          kvs_gguf_get_arr(g, key, &et, &n, &data) == KVS_OK;
    const size_t esz = et == KVS_GGUF_TYPE_BOOL || et == KVS_GGUF_TYPE_UINT8 || et == KVS_GGUF_TYPE_INT8 ? 1
                       : et == KVS_GGUF_TYPE_UINT32 || et == KVS_GGUF_TYPE_INT32                        ? 4
                                                                                                       : 0;
    if (have_arr && (!esz || n != n_layer)) {
        kvs_plan_seterr(errbuf, errlen, "%s: expected %u BOOL/INT32/UINT32", key, n_layer);
        return KVS_ERR_FORMAT;
    }
    for (uint32_t il = 0; il < m->n_block; il++) {
        bool recr = (il + 1) % interval != 0;
        if (have_arr) {
            const uint8_t *p = (const uint8_t *)data + (size_t)il * esz;
            recr = esz == 1 ? p[0] != 0 : (p[0] | p[1] | p[2] | p[3]) != 0;
        }
        if (recr) {
            m->block_kv_bytes[il] = 0;
            m->block_state_bytes[il] = state;
        }
    }
    return KVS_OK;
}

kvs_err kvs_plan_model_from_gguf(const struct kvs_gguf *g, struct kvs_plan_model **out, char *errbuf,
                                 size_t errlen)
{
    *out = NULL;
    const char *arch;
    size_t alen;
    kvs_err e = kvs_gguf_get_str(g, "general.architecture", &arch, &alen);
    if (e) {
        kvs_plan_seterr(errbuf, errlen, "general.architecture: %s", kvs_strerror(e));
        return e;
    }
    uint32_t n_layer, n_embd, n_head, nextn = 0, n_expert = 0, n_expert_used = 0, kl, vl;
    if ((e = get_u32_arch(g, arch, alen, "block_count", &n_layer, true, errbuf, errlen)) ||
        (e = get_u32_arch(g, arch, alen, "embedding_length", &n_embd, true, errbuf, errlen)))
        return e;
    e = get_u32_arch(g, arch, alen, "attention.head_count", &n_head, true, errbuf, errlen);
    if (e == KVS_ERR_FORMAT) /* per-layer array: use the default head_dim only if key_length is given */
        n_head = 0;
    else if (e)
        return e;
    e = get_u32_arch(g, arch, alen, "nextn_predict_layers", &nextn, false, errbuf, errlen);
    if (e && e != KVS_ERR_NOT_FOUND)
        return e;
    e = get_u32_arch(g, arch, alen, "expert_count", &n_expert, false, errbuf, errlen);
    if (e && e != KVS_ERR_NOT_FOUND)
        return e;
    e = get_u32_arch(g, arch, alen, "expert_used_count", &n_expert_used, false, errbuf, errlen);
    if (e && e != KVS_ERR_NOT_FOUND)
        return e;
    uint32_t ctx_train = 0;
    e = get_u32_arch(g, arch, alen, "context_length", &ctx_train, false, errbuf, errlen);
    if (e && e != KVS_ERR_NOT_FOUND)
        return e;
    uint32_t dflt_hd = n_head ? n_embd / n_head : 0;
    e = get_u32_arch(g, arch, alen, "attention.key_length", &kl, false, errbuf, errlen);
    if (e == KVS_ERR_NOT_FOUND)
        kl = dflt_hd;
    else if (e)
        return e;
    e = get_u32_arch(g, arch, alen, "attention.value_length", &vl, false, errbuf, errlen);
    if (e == KVS_ERR_NOT_FOUND)
        vl = kl;
    else if (e)
        return e;
    if (n_layer == 0 || nextn >= n_layer || n_layer - nextn > KVS_PLAN_MAX_BLOCKS || n_embd == 0 ||
        kl == 0 || n_expert_used > n_expert) {
        kvs_plan_seterr(errbuf, errlen,
                        "bad hyperparameters: block_count %u, nextn_predict_layers %u (at most %d runnable "
                        "blocks), embedding_length %u, head_dim %u, experts %u used of %u",
                        n_layer, nextn, KVS_PLAN_MAX_BLOCKS, n_embd, kl, n_expert_used, n_expert);
        return KVS_ERR_FORMAT;
    }

    struct kvs_plan_model *m = calloc(1, sizeof *m);
    if (!m)
        return KVS_ERR_NOMEM;
    m->n_block = n_layer - nextn;
    m->n_embd = n_embd;
    m->ctx_train = ctx_train;

    char kvkey[160];
    if (!arch_key(kvkey, sizeof kvkey, arch, alen, "attention.head_count_kv")) {
        free(m);
        return KVS_ERR_FORMAT;
    }
    for (uint32_t il = 0; il < m->n_block; il++) {
        uint32_t hkv;
        e = head_count_kv(g, kvkey, il, n_head, &hkv);
        if (e) {
            kvs_plan_seterr(errbuf, errlen, "%s: bad value for layer %u", kvkey, il);
            free(m);
            return e;
        }
        /* K and V, F16 (2 bytes) each: gguf-facts §3.2 / models/README (F16 KV). */
        m->block_kv_bytes[il] = (uint64_t)hkv * ((uint64_t)kl + vl) * 2;
    }
    if ((e = hybrid_state(g, arch, alen, n_layer, m, errbuf, errlen))) {
        free(m);
        return e;
    }

    const struct kvs_gguf_tensor *embd = NULL;
    bool has_output = false;
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *tn = kvs_gguf_tensor(g, i);
        long b = block_index(tn->name);
        if (b >= 0) {
            if ((uint64_t)b >= n_layer) {
                kvs_plan_seterr(errbuf, errlen, "tensor '%s': block %ld >= block_count %u", tn->name, b, n_layer);
                free(m);
                return KVS_ERR_RANGE;
            }
            if ((uint32_t)b >= m->n_block) { /* MTP / nextn: held by the tail, not run per token */
                m->tail_bytes += tn->bytes;
                continue;
            }
            uint64_t stream = tn->bytes;
            /* Expert tensors {.., .., n_expert}: a token reads only the used experts. */
            if (strstr(tn->name, "_exps.") && tn->n_dims == 3 && n_expert > 0 && (uint64_t)tn->ne[2] == n_expert)
                stream = tn->bytes / n_expert * n_expert_used;
            m->block_weight_bytes[b] += tn->bytes;
            m->block_stream_bytes[b] += stream;
        } else if (!strcmp(tn->name, "token_embd.weight")) {
            embd = tn;
            m->head_bytes += tn->bytes;
        } else if (!strncmp(tn->name, "token_embd.", 11)) {
            m->head_bytes += tn->bytes;
        } else if (!strncmp(tn->name, "output.", 7) || !strncmp(tn->name, "output_norm.", 12)) {
            if (!strcmp(tn->name, "output.weight"))
                has_output = true;
            m->tail_bytes += tn->bytes;
            m->tail_stream_bytes += tn->bytes;
        } else {
            m->common_bytes += tn->bytes;
        }
    }
    if (!embd) { /* every stage ring needs a head: kvasir run/stage refuse such a model too */
        kvs_plan_seterr(errbuf, errlen, "tensor 'token_embd.weight' is missing: not a runnable model");
        free(m);
        return KVS_ERR_NOT_FOUND;
    }
    m->n_vocab = (uint32_t)embd->ne[1];
    /* One embedding row per token on the head. */
    m->head_stream_bytes = embd->ne[1] > 0 ? embd->bytes / (uint64_t)embd->ne[1] : 0;
    if (!has_output) { /* tied: the tail reads token_embd as its LM head */
        m->tail_bytes += embd->bytes;
        m->tail_stream_bytes += embd->bytes;
        m->tied_bytes = embd->bytes;
    }
    uint8_t fp[32];
    if (kvs_gguf_fingerprint(g, fp) == KVS_OK)
        kvs_gguf_fingerprint_hex(fp, m->fingerprint);
    *out = m;
    return KVS_OK;
}

/* Hyperparameters of the supported architectures from `<arch>.*` metadata
 * (keys, types and defaults: ../shared/docs/gguf-facts.md §3.2). */
#include "model/model.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Upper bounds on dimensions read from an untrusted file: far above any real
 * model, low enough that products of them fit comfortably in size_t. */
#define HP_MAX_DIM (1u << 20)     /* n_embd, n_ff, head_dim */
#define HP_MAX_HEADS 4096u
#define HP_MAX_BLOCKS KVS_HP_MAX_BLOCKS
#define HP_MAX_EXPERTS 4096u
#define HP_MAX_VOCAB (1u << 24)

static const char *const arch_names[KVS_ARCH_COUNT_] = { "llama", "qwen2", "qwen3", "qwen3moe", "qwen35", "qwen35moe" };

static void set_err(char *errbuf, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (!errbuf || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
}

/* Reads `<arch>.<suffix>` as u32. Missing keys give def when optional. */
static kvs_err get_u32(const struct kvs_gguf *g, const char *arch, const char *suffix, bool required,
                       uint32_t def, uint32_t *out, char *errbuf, size_t errlen)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvs_err e = kvs_gguf_get_u32(g, key, out);
    if (e == KVS_ERR_NOT_FOUND && !required) {
        *out = def;
        return KVS_OK;
    }
    if (e != KVS_OK)
        set_err(errbuf, errlen, "key '%s': %s", key,
                e == KVS_ERR_NOT_FOUND ? "required but absent" : "wrong type (expected UINT32)");
    return e;
}

static kvs_err get_f32(const struct kvs_gguf *g, const char *arch, const char *suffix, bool required, float def,
                       float *out, char *errbuf, size_t errlen)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    kvs_err e = kvs_gguf_get_f32(g, key, out);
    if (e == KVS_ERR_NOT_FOUND && !required) {
        *out = def;
        return KVS_OK;
    }
    if (e != KVS_OK)
        set_err(errbuf, errlen, "key '%s': %s", key,
                e == KVS_ERR_NOT_FOUND ? "required but absent" : "wrong type (expected FLOAT32)");
    return e;
}

static kvs_err check_range(const char *what, uint32_t v, uint32_t lo, uint32_t hi, char *errbuf, size_t errlen)
{
    if (v < lo || v > hi) {
        set_err(errbuf, errlen, "%s = %u is out of range [%u, %u]", what, v, lo, hi);
        return KVS_ERR_RANGE;
    }
    return KVS_OK;
}

bool kvs_hparams_hybrid(const struct kvs_hparams *hp)
{
    return hp->arch == KVS_ARCH_QWEN35 || hp->arch == KVS_ARCH_QWEN35MOE;
}

bool kvs_hparams_recurrent(const struct kvs_hparams *hp, uint32_t il)
{
    return kvs_hparams_hybrid(hp) && il < hp->n_block && il < HP_MAX_BLOCKS &&
           (hp->recurrent[il / 8] >> (il % 8) & 1u);
}

uint32_t kvs_hparams_conv_channels(const struct kvs_hparams *hp)
{
    return kvs_hparams_hybrid(hp) ? (2u * hp->ssm_h_k + hp->ssm_h_v) * hp->ssm_d : 0;
}

size_t kvs_hparams_recurrent_bytes(const struct kvs_hparams *hp)
{
    if (!kvs_hparams_hybrid(hp)) return 0;
    return ((size_t)(hp->ssm_conv - 1) * kvs_hparams_conv_channels(hp) +
            (size_t)hp->ssm_h_v * hp->ssm_d * hp->ssm_d) * sizeof(float);
}

/* The qwen35 / qwen35moe keys (qwen35-facts §1): the GDN dimensions, which
 * blocks are recurrent, and the M-RoPE sections llama.cpp requires (for
 * text they reduce to NeoX RoPE over rope.dimension_count dims, §3.3). */
static kvs_err read_hybrid(const struct kvs_gguf *g, struct kvs_hparams *hp, char *errbuf, size_t errlen)
{
    const char *a = hp->arch_name;
    kvs_err e;
    uint32_t inner = 0, interval = 0;
    if ((e = get_u32(g, a, "ssm.conv_kernel", true, 0, &hp->ssm_conv, errbuf, errlen)) ||
        (e = get_u32(g, a, "ssm.state_size", true, 0, &hp->ssm_d, errbuf, errlen)) ||
        (e = get_u32(g, a, "ssm.time_step_rank", true, 0, &hp->ssm_h_v, errbuf, errlen)) ||
        (e = get_u32(g, a, "ssm.group_count", true, 0, &hp->ssm_h_k, errbuf, errlen)) ||
        (e = get_u32(g, a, "ssm.inner_size", true, 0, &inner, errbuf, errlen)) ||
        (e = get_u32(g, a, "full_attention_interval", false, 4, &interval, errbuf, errlen)))
        return e;
    if ((e = check_range("ssm.conv_kernel", hp->ssm_conv, 2, 64, errbuf, errlen)) ||
        (e = check_range("ssm.state_size", hp->ssm_d, 1, 4096, errbuf, errlen)) ||
        (e = check_range("ssm.time_step_rank", hp->ssm_h_v, 1, HP_MAX_HEADS, errbuf, errlen)) ||
        (e = check_range("ssm.group_count", hp->ssm_h_k, 1, hp->ssm_h_v, errbuf, errlen)) ||
        (e = check_range("full_attention_interval", interval, 1, HP_MAX_BLOCKS, errbuf, errlen)))
        return e;
    if (hp->ssm_h_v % hp->ssm_h_k) {
        set_err(errbuf, errlen, "ssm.time_step_rank %u is not a multiple of ssm.group_count %u", hp->ssm_h_v,
                hp->ssm_h_k);
        return KVS_ERR_FORMAT;
    }
    if ((uint64_t)hp->ssm_h_v * hp->ssm_d != inner) {
        set_err(errbuf, errlen, "ssm.inner_size %u != ssm.time_step_rank %u x ssm.state_size %u", inner, hp->ssm_h_v,
                hp->ssm_d);
        return KVS_ERR_FORMAT;
    }
    char key[128];
    enum kvs_gguf_type et;
    const void *data;
    uint64_t n;
    snprintf(key, sizeof key, "%s.rope.dimension_sections", a);
    e = kvs_gguf_get_arr(g, key, &et, &n, &data);
    if (e) {
        set_err(errbuf, errlen, "key '%s': %s", key,
                e == KVS_ERR_NOT_FOUND ? "required but absent" : "not a numeric array");
        return e;
    }
    if ((et != KVS_GGUF_TYPE_INT32 && et != KVS_GGUF_TYPE_UINT32) || n < 3 || n > 4) {
        set_err(errbuf, errlen, "key '%s': expected 3 or 4 INT32 (M-RoPE sections)", key);
        return KVS_ERR_FORMAT;
    }
    /* Which blocks are recurrent: the per-block array overrides the interval. */
    snprintf(key, sizeof key, "%s.attention.recurrent_layers", a);
    const uint32_t n_all = hp->n_block + hp->n_nextn;
    memset(hp->recurrent, 0, sizeof hp->recurrent);
    e = kvs_gguf_get_arr(g, key, &et, &n, &data);
    if (e == KVS_OK) {
        const size_t esz = et == KVS_GGUF_TYPE_BOOL || et == KVS_GGUF_TYPE_UINT8 || et == KVS_GGUF_TYPE_INT8 ? 1
                           : et == KVS_GGUF_TYPE_UINT32 || et == KVS_GGUF_TYPE_INT32                        ? 4
                                                                                                           : 0;
        if (!esz || n != n_all) {
            set_err(errbuf, errlen, "key '%s': expected %u BOOL/INT32/UINT32 (block_count), got %llu", key, n_all,
                    (unsigned long long)n);
            return KVS_ERR_FORMAT;
        }
        const uint8_t *p = data;
        for (uint32_t il = 0; il < hp->n_block; il++) {
            uint32_t v = esz == 1 ? p[il] : (uint32_t)p[4 * il] | (uint32_t)p[4 * il + 1] << 8 |
                                                 (uint32_t)p[4 * il + 2] << 16 | (uint32_t)p[4 * il + 3] << 24;
            if (v) hp->recurrent[il / 8] |= (uint8_t)(1u << (il % 8));
        }
    } else if (e == KVS_ERR_NOT_FOUND) {
        for (uint32_t il = 0; il < hp->n_block; il++)
            if ((il + 1) % interval) hp->recurrent[il / 8] |= (uint8_t)(1u << (il % 8));
    } else {
        set_err(errbuf, errlen, "key '%s': not a numeric array", key);
        return e;
    }
    return KVS_OK;
}

kvs_err kvs_hparams_read(const struct kvs_gguf *g, struct kvs_hparams *hp, char *errbuf, size_t errlen)
{
    if (!g || !hp) return KVS_ERR_ARG;
    memset(hp, 0, sizeof *hp);
    const char *s;
    size_t len;
    kvs_err e = kvs_gguf_get_str(g, "general.architecture", &s, &len);
    if (e != KVS_OK) {
        set_err(errbuf, errlen, "key 'general.architecture': %s", e == KVS_ERR_NOT_FOUND ? "absent" : "not a string");
        return e;
    }
    int arch = -1;
    for (int i = 0; i < KVS_ARCH_COUNT_; i++)
        if (strlen(arch_names[i]) == len && !memcmp(arch_names[i], s, len)) arch = i;
    if (arch < 0) {
        set_err(errbuf, errlen, "architecture '%.*s' is not supported (llama, qwen2, qwen3, qwen3moe, qwen35, qwen35moe)",
                (int)(len > 64 ? 64 : len), s);
        return KVS_ERR_UNSUPPORTED;
    }
    hp->arch = (enum kvs_arch)arch;
    snprintf(hp->arch_name, sizeof hp->arch_name, "%s", arch_names[arch]);
    const char *a = hp->arch_name;

#define U32(suffix, req, def, dst)                                                                                    \
    do {                                                                                                               \
        if ((e = get_u32(g, a, suffix, req, def, dst, errbuf, errlen)) != KVS_OK) return e;                            \
    } while (0)
    U32("block_count", true, 0, &hp->n_block);
    U32("embedding_length", true, 0, &hp->n_embd);
    U32("attention.head_count", true, 0, &hp->n_head);
    U32("context_length", true, 0, &hp->n_ctx_train);
    if ((e = check_range("block_count", hp->n_block, 1, HP_MAX_BLOCKS, errbuf, errlen))) return e;
    if ((e = check_range("embedding_length", hp->n_embd, 1, HP_MAX_DIM, errbuf, errlen))) return e;
    if ((e = check_range("attention.head_count", hp->n_head, 1, HP_MAX_HEADS, errbuf, errlen))) return e;
    if ((e = check_range("context_length", hp->n_ctx_train, 1, UINT32_MAX, errbuf, errlen))) return e;
    U32("nextn_predict_layers", false, 0, &hp->n_nextn);
    if (hp->n_nextn >= hp->n_block) {
        set_err(errbuf, errlen, "nextn_predict_layers %u leaves no main block of block_count %u", hp->n_nextn,
                hp->n_block);
        return KVS_ERR_FORMAT;
    }
    hp->n_block -= hp->n_nextn;
    U32("attention.head_count_kv", false, hp->n_head, &hp->n_head_kv);
    if ((e = check_range("attention.head_count_kv", hp->n_head_kv, 1, hp->n_head, errbuf, errlen))) return e;
    if (hp->n_head % hp->n_head_kv) {
        set_err(errbuf, errlen, "head_count %u is not a multiple of head_count_kv %u", hp->n_head, hp->n_head_kv);
        return KVS_ERR_FORMAT;
    }
    {
        char kl[96];
        snprintf(kl, sizeof kl, "%s.attention.key_length", a);
        if (kvs_gguf_find_key(g, kl) < 0 && hp->n_embd % hp->n_head) {
            set_err(errbuf, errlen, "embedding_length %u is not a multiple of head_count %u (and no key_length)",
                    hp->n_embd, hp->n_head);
            return KVS_ERR_FORMAT;
        }
    }
    U32("attention.key_length", false, hp->n_embd / hp->n_head, &hp->head_dim);
    if ((e = check_range("attention.key_length", hp->head_dim, 2, HP_MAX_DIM, errbuf, errlen))) return e;
    uint32_t vlen;
    U32("attention.value_length", false, hp->head_dim, &vlen);
    if (vlen != hp->head_dim) {
        set_err(errbuf, errlen, "value_length %u != key_length %u is not supported", vlen, hp->head_dim);
        return KVS_ERR_UNSUPPORTED;
    }
    U32("rope.dimension_count", false, hp->head_dim, &hp->n_rot);
    if ((e = check_range("rope.dimension_count", hp->n_rot, 2, hp->head_dim, errbuf, errlen))) return e;
    if (hp->n_rot % 2 || hp->head_dim % 2) {
        set_err(errbuf, errlen, "rope.dimension_count %u / key_length %u must be even", hp->n_rot, hp->head_dim);
        return KVS_ERR_FORMAT;
    }
    const bool moe_arch = hp->arch == KVS_ARCH_QWEN3MOE || hp->arch == KVS_ARCH_QWEN35MOE;
    U32("expert_count", false, 0, &hp->n_expert);
    if (moe_arch && hp->n_expert == 0) {
        set_err(errbuf, errlen, "%s needs %s.expert_count >= 1 (missing or 0)", a, a);
        return KVS_ERR_FORMAT;
    }
    if (!moe_arch && hp->n_expert != 0) {
        set_err(errbuf, errlen, "mixture-of-experts %s models are not supported", a);
        return KVS_ERR_UNSUPPORTED;
    }
    U32("feed_forward_length", hp->n_expert == 0, 0, &hp->n_ff);
    if (hp->n_expert == 0) {
        if ((e = check_range("feed_forward_length", hp->n_ff, 1, HP_MAX_DIM, errbuf, errlen))) return e;
    } else {
        if ((e = check_range("expert_count", hp->n_expert, 1, HP_MAX_EXPERTS, errbuf, errlen))) return e;
        /* optional for MoE (the dense FFN size), but bounded: it sizes buffers */
        if ((e = check_range("feed_forward_length", hp->n_ff, 0, HP_MAX_DIM, errbuf, errlen))) return e;
        U32("expert_used_count", true, 0, &hp->n_expert_used);
        if ((e = check_range("expert_used_count", hp->n_expert_used, 1, hp->n_expert, errbuf, errlen))) return e;
        U32("expert_feed_forward_length", false, hp->n_ff / hp->n_expert_used, &hp->n_ff_exp);
        if ((e = check_range("expert_feed_forward_length", hp->n_ff_exp, 1, HP_MAX_DIM, errbuf, errlen))) return e;
        if (hp->arch == KVS_ARCH_QWEN35MOE) {
            U32("expert_shared_feed_forward_length", true, 0, &hp->n_ff_shexp);
            if ((e = check_range("expert_shared_feed_forward_length", hp->n_ff_shexp, 1, HP_MAX_DIM, errbuf, errlen)))
                return e;
        }
    }
    if (kvs_hparams_hybrid(hp) && (e = read_hybrid(g, hp, errbuf, errlen))) return e;
#undef U32
    if ((e = get_f32(g, a, "attention.layer_norm_rms_epsilon", true, 0, &hp->rms_eps, errbuf, errlen))) return e;
    if (!(hp->rms_eps >= 0.0f && hp->rms_eps < 1.0f)) {
        set_err(errbuf, errlen, "layer_norm_rms_epsilon %g is out of range", (double)hp->rms_eps);
        return KVS_ERR_RANGE;
    }
    if ((e = get_f32(g, a, "rope.freq_base", false, 10000.0f, &hp->rope_freq_base, errbuf, errlen))) return e;
    if (!(hp->rope_freq_base > 0.0f)) {
        set_err(errbuf, errlen, "rope.freq_base %g must be positive", (double)hp->rope_freq_base);
        return KVS_ERR_RANGE;
    }
    float factor;
    if ((e = get_f32(g, a, "rope.scaling.factor", false, 0.0f, &factor, errbuf, errlen))) return e;
    if (factor == 0.0f && (e = get_f32(g, a, "rope.scale_linear", false, 0.0f, &factor, errbuf, errlen))) return e;
    hp->rope_freq_scale = factor > 0.0f ? 1.0f / factor : 1.0f;

    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    if (kvs_gguf_get_str(g, key, &s, &len) == KVS_OK) {
        bool ok = (len == 4 && !memcmp(s, "none", 4)) || (len == 6 && !memcmp(s, "linear", 6));
        if (!ok) {
            set_err(errbuf, errlen, "rope scaling '%.*s' is not supported (none, linear)", (int)(len > 32 ? 32 : len),
                    s);
            return KVS_ERR_UNSUPPORTED;
        }
        if (len == 4) hp->rope_freq_scale = 1.0f;
    }
    hp->rope_neox = hp->arch != KVS_ARCH_LLAMA;

    /* Vocabulary: the explicit key, else the token list, else the shape of
     * the embedding (tensor infos only: no data is touched). */
    snprintf(key, sizeof key, "%s.vocab_size", a);
    const int64_t tok_ki = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    const bool have_tokens = tok_ki >= 0 && kvs_gguf_kv_type(g, (size_t)tok_ki) == KVS_GGUF_TYPE_ARRAY;
    const uint64_t n_tok = have_tokens ? kvs_gguf_arr_n(g, (size_t)tok_ki) : 0;
    uint32_t nv = 0;
    e = kvs_gguf_get_u32(g, key, &nv);
    if (e == KVS_ERR_NOT_FOUND) {
        if (have_tokens) {
            nv = n_tok > UINT32_MAX ? UINT32_MAX : (uint32_t)n_tok;
        } else {
            const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(g, "token_embd.weight");
            if (!t) t = kvs_gguf_find_tensor(g, "output.weight");
            if (t && t->ne[1] > 0 && t->ne[1] <= UINT32_MAX) nv = (uint32_t)t->ne[1];
        }
    } else if (e != KVS_OK) {
        set_err(errbuf, errlen, "key '%s': wrong type (expected UINT32)", key);
        return e;
    }
    if ((e = check_range("vocabulary size", nv, 1, HP_MAX_VOCAB, errbuf, errlen))) return e;
    /* Every token id must have an embedding row and an output row. */
    {
        static const char *const rows_of[] = { "token_embd.weight", "output.weight" };
        for (int i = 0; i < 2; i++) {
            const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(g, rows_of[i]);
            if (t && t->n_dims >= 2 && (n_tok > (uint64_t)t->ne[1] || nv > (uint64_t)t->ne[1])) {
                set_err(errbuf, errlen, "the tokenizer has %llu tokens (vocabulary %u) but %s has %lld rows",
                        (unsigned long long)n_tok, nv, rows_of[i], (long long)t->ne[1]);
                return KVS_ERR_FORMAT;
            }
        }
    }
    hp->n_vocab = nv;
    hp->tied_output = kvs_gguf_find_tensor(g, "output.weight") == NULL;
    return KVS_OK;
}

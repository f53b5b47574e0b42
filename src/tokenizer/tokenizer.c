/* Tokenizer: vocabulary loading from GGUF (gguf-facts §5.1), special-token
 * partitioning (§5.2), dispatch to the SPM (§5.3) / BPE (§5.4) sessions,
 * end-of-generation set, token -> piece and the streaming detokenizer. */
#include "tokenizer/tokenizer_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"

static void seterr(char *errbuf, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void seterr(char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (!errbuf || !errlen)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
}

/* --- hash maps ------------------------------------------------------------ */

static kvs_err map_init(struct kvs_tok_map *m, uint64_t n)
{
    uint64_t cap = 16;
    while (cap < 2 * n)
        cap <<= 1;
    m->slots = malloc(cap * sizeof *m->slots);
    if (!m->slots)
        return KVS_ERR_NOMEM;
    memset(m->slots, 0xff, cap * sizeof *m->slots);
    m->mask = cap - 1;
    return KVS_OK;
}

static const char *tok_key(const struct kvs_tokenizer *t, int32_t id, size_t *len)
{
    return kvs_tok_text(t, id, len);
}

int32_t kvs_tok_lookup(const struct kvs_tokenizer *t, const char *s, size_t n)
{
    uint64_t i = kvs_tok_hash_step(KVS_TOK_HASH_INIT, s, n) & t->vocab.mask;
    for (;;) {
        int32_t id = t->vocab.slots[i];
        if (id < 0)
            return -1;
        size_t kl;
        const char *k = tok_key(t, id, &kl);
        if (kl == n && !memcmp(k, s, n))
            return id;
        i = (i + 1) & t->vocab.mask;
    }
}

/* Inserts id (text s) into the vocab map; a later id replaces an earlier
 * one with the same text (llama.cpp assigns token_to_id[text] = i in order). */
static void vocab_insert(struct kvs_tokenizer *t, int32_t id)
{
    size_t n;
    const char *s = tok_key(t, id, &n);
    uint64_t i = kvs_tok_hash_step(KVS_TOK_HASH_INIT, s, n) & t->vocab.mask;
    for (;;) {
        int32_t cur = t->vocab.slots[i];
        if (cur < 0) {
            t->vocab.slots[i] = id;
            return;
        }
        size_t kl;
        const char *k = tok_key(t, cur, &kl);
        if (kl == n && !memcmp(k, s, n)) {
            t->vocab.slots[i] = id;
            return;
        }
        i = (i + 1) & t->vocab.mask;
    }
}

/* Inserts merge rank r; an existing equal text keeps its (lower) rank. */
static void merge_insert(struct kvs_tokenizer *t, int32_t r)
{
    const char *s = t->mtext + t->mtext_off[r];
    size_t n = (size_t)(t->mtext_off[r + 1] - t->mtext_off[r]);
    uint64_t i = kvs_tok_hash_step(KVS_TOK_HASH_INIT, s, n) & t->merges.mask;
    for (;;) {
        int32_t cur = t->merges.slots[i];
        if (cur < 0) {
            t->merges.slots[i] = r;
            return;
        }
        const char *k = t->mtext + t->mtext_off[cur];
        size_t kl = (size_t)(t->mtext_off[cur + 1] - t->mtext_off[cur]);
        if (kl == n && !memcmp(k, s, n))
            return;
        i = (i + 1) & t->merges.mask;
    }
}

int32_t kvs_tok_merge_rank(const struct kvs_tokenizer *t, const char *l, size_t ln, const char *r, size_t rn)
{
    if (!t->n_merges)
        return -1;
    uint64_t h = kvs_tok_hash_step(KVS_TOK_HASH_INIT, l, ln);
    h = kvs_tok_hash_step(h, " ", 1);
    h = kvs_tok_hash_step(h, r, rn);
    uint64_t i = h & t->merges.mask;
    for (;;) {
        int32_t cur = t->merges.slots[i];
        if (cur < 0)
            return -1;
        const char *k = t->mtext + t->mtext_off[cur];
        size_t kl = (size_t)(t->mtext_off[cur + 1] - t->mtext_off[cur]);
        if (kl == ln + 1 + rn && !memcmp(k, l, ln) && k[ln] == ' ' && !memcmp(k + ln + 1, r, rn))
            return cur;
        i = (i + 1) & t->merges.mask;
    }
}

/* --- build ---------------------------------------------------------------- */

void kvs_tokenizer_free(struct kvs_tokenizer *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->text_off);
    free(t->scores);
    free(t->types);
    free(t->eog);
    free(t->vocab.slots);
    free(t->mtext);
    free(t->mtext_off);
    free(t->merges.slots);
    free(t->specials);
    if (t->re)
        pcre2_code_free(t->re);
    free(t);
}

/* Copies n strings fetched by get into one blob + offsets. */
static kvs_err copy_strings(uint64_t n, void *ctx, kvs_err (*get)(void *, uint64_t, const char **, size_t *),
                            char **blob_out, uint64_t **off_out, const char *what, char *errbuf, size_t errlen)
{
    uint64_t *off = malloc((n + 1) * sizeof *off);
    if (!off)
        return KVS_ERR_NOMEM;
    uint64_t total = 0;
    off[0] = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        kvs_err e = get(ctx, i, &s, &len);
        if (e != KVS_OK) {
            seterr(errbuf, errlen, "%s %llu: cannot read (%s)", what, (unsigned long long)i, kvs_strerror(e));
            free(off);
            return e;
        }
        if (len > KVS_TOK_MAX_TEXT) {
            seterr(errbuf, errlen, "%s %llu: text of %zu bytes exceeds the limit of %u", what,
                   (unsigned long long)i, len, KVS_TOK_MAX_TEXT);
            free(off);
            return KVS_ERR_RANGE;
        }
        total += len;
        off[i + 1] = total;
    }
    char *blob = malloc(total ? total : 1);
    if (!blob) {
        free(off);
        return KVS_ERR_NOMEM;
    }
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        kvs_err e = get(ctx, i, &s, &len);
        if (e != KVS_OK || len != off[i + 1] - off[i]) {
            free(off);
            free(blob);
            return e != KVS_OK ? e : KVS_ERR_INTERNAL;
        }
        if (len)
            memcpy(blob + off[i], s, len);
    }
    *blob_out = blob;
    *off_out = off;
    return KVS_OK;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const struct kvs_tokenizer *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    uint64_t lx = t->text_off[x + 1] - t->text_off[x], ly = t->text_off[y + 1] - t->text_off[y];
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int32_t valid_id(const struct kvs_tokenizer *t, int64_t id, const char *what)
{
    if (id < 0)
        return -1;
    if (id >= t->n_vocab) {
        KVS_LOGW("tokenizer: %s id %lld is out of range (vocab %d): ignored", what, (long long)id, t->n_vocab);
        return -1;
    }
    return (int32_t)id;
}

kvs_err kvs_tokenizer_build(const struct kvs_tok_desc *d, struct kvs_tokenizer **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    if (!d->n_tokens || !d->token) {
        seterr(errbuf, errlen, "empty vocabulary");
        return KVS_ERR_NOT_FOUND;
    }
    if (d->n_tokens > KVS_TOK_MAX_VOCAB) {
        seterr(errbuf, errlen, "vocabulary of %llu tokens exceeds the limit of %u", (unsigned long long)d->n_tokens,
               KVS_TOK_MAX_VOCAB);
        return KVS_ERR_RANGE;
    }
    if (d->kind == KVS_TOK_KIND_BPE && d->n_merges > KVS_TOK_MAX_MERGES) {
        seterr(errbuf, errlen, "%llu merges exceed the limit of %u", (unsigned long long)d->n_merges,
               KVS_TOK_MAX_MERGES);
        return KVS_ERR_RANGE;
    }
    struct kvs_tokenizer *t = calloc(1, sizeof *t);
    if (!t)
        return KVS_ERR_NOMEM;
    kvs_err e = KVS_ERR_NOMEM;
    t->kind = d->kind;
    t->pre = d->kind == KVS_TOK_KIND_BPE ? d->pre : KVS_TOK_PRE_NONE;
    t->n_vocab = (int32_t)d->n_tokens;
    uint64_t n = d->n_tokens;

    e = copy_strings(n, d->ctx, d->token, &t->text, &t->text_off, "token", errbuf, errlen);
    if (e != KVS_OK)
        goto fail;
    e = KVS_ERR_NOMEM;
    t->scores = malloc(n * sizeof *t->scores);
    t->types = malloc(n);
    t->eog = calloc(n, 1);
    if (!t->scores || !t->types || !t->eog)
        goto fail;
    for (uint64_t i = 0; i < n; i++) {
        float s = 0.0f;
        int32_t ty = KVS_TOK_TYPE_NORMAL;
        if (d->scores)
            memcpy(&s, (const uint8_t *)d->scores + 4 * i, 4);
        if (d->types)
            memcpy(&ty, (const uint8_t *)d->types + 4 * i, 4);
        if (ty < 0 || ty > KVS_TOK_TYPE_BYTE) {
            seterr(errbuf, errlen, "token %llu has invalid type %d", (unsigned long long)i, (int)ty);
            e = KVS_ERR_FORMAT;
            goto fail;
        }
        t->scores[i] = s;
        t->types[i] = (uint8_t)ty;
    }
    if (map_init(&t->vocab, n) != KVS_OK)
        goto fail;
    for (uint64_t i = 0; i < n; i++)
        if (t->text_off[i + 1] > t->text_off[i])
            vocab_insert(t, (int32_t)i);

    if (d->kind == KVS_TOK_KIND_BPE && d->n_merges) {
        if (!d->merge) {
            e = KVS_ERR_ARG;
            goto fail;
        }
        e = copy_strings(d->n_merges, d->ctx, d->merge, &t->mtext, &t->mtext_off, "merge", errbuf, errlen);
        if (e != KVS_OK)
            goto fail;
        e = KVS_ERR_NOMEM;
        t->n_merges = (uint32_t)d->n_merges;
        if (map_init(&t->merges, t->n_merges) != KVS_OK)
            goto fail;
        for (uint32_t r = 0; r < t->n_merges; r++)
            merge_insert(t, (int32_t)r);
    }

    /* Special tokens (§5.2): CONTROL, USER_DEFINED, UNKNOWN with a text,
     * longest first (ties: lower id first). */
    t->specials = malloc(n * sizeof *t->specials);
    if (!t->specials)
        goto fail;
    for (uint64_t i = 0; i < n; i++) {
        uint8_t ty = t->types[i];
        if ((ty == KVS_TOK_TYPE_CONTROL || ty == KVS_TOK_TYPE_USER_DEFINED || ty == KVS_TOK_TYPE_UNKNOWN) &&
            t->text_off[i + 1] > t->text_off[i])
            t->specials[t->n_specials++] = (int32_t)i;
    }
    qsort_r(t->specials, t->n_specials, sizeof *t->specials, cmp_special, t);

    /* Special ids and defaults (§5.1). For BPE we use -1 (none) rather than
     * llama.cpp's placeholder 11 when the keys are absent. */
    bool spm = d->kind == KVS_TOK_KIND_SPM;
    t->bos = valid_id(t, d->bos >= 0 ? d->bos : (spm ? 1 : -1), "bos");
    t->eos = valid_id(t, d->eos >= 0 ? d->eos : (spm ? 2 : -1), "eos");
    t->unk = valid_id(t, d->unk >= 0 ? d->unk : (spm ? 0 : -1), "unknown");
    t->eot = valid_id(t, d->eot, "eot");
    t->eom = valid_id(t, d->eom, "eom");
    bool llama3 = d->kind == KVS_TOK_KIND_BPE && d->pre == KVS_TOK_PRE_LLAMA3;
    t->add_bos = d->add_bos >= 0 ? d->add_bos != 0 : (spm || llama3);
    t->add_space_prefix = spm && (d->add_space_prefix >= 0 ? d->add_space_prefix != 0 : true);
    t->ignore_merges = llama3;

    /* End of generation: eos, eot, eom, and CONTROL tokens with the usual
     * end-of-turn texts. */
    if (t->eos >= 0)
        t->eog[t->eos] = 1;
    if (t->eot >= 0)
        t->eog[t->eot] = 1;
    if (t->eom >= 0)
        t->eog[t->eom] = 1;
    static const char *const eog_texts[] = { "<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end_of_text|>",
                                             "<|eom_id|>" };
    for (size_t k = 0; k < sizeof eog_texts / sizeof eog_texts[0]; k++) {
        int32_t id = kvs_tok_lookup(t, eog_texts[k], strlen(eog_texts[k]));
        if (id >= 0 && t->types[id] == KVS_TOK_TYPE_CONTROL)
            t->eog[id] = 1;
    }

    /* SPM byte fallback table: "<0xNN>" (upper-case hex), else the raw byte. */
    for (int b = 0; b < 256; b++) {
        char buf[8];
        snprintf(buf, sizeof buf, "<0x%02X>", b);
        int32_t id = kvs_tok_lookup(t, buf, 6);
        if (id < 0) {
            char c = (char)b;
            id = kvs_tok_lookup(t, &c, 1);
        }
        t->byte_tok[b] = id;
    }

    if (d->kind == KVS_TOK_KIND_BPE) {
        const char *pat = kvs_tok_bpe_pattern(t->pre);
        if (!pat) {
            seterr(errbuf, errlen, "unsupported BPE pre-tokenizer");
            e = KVS_ERR_UNSUPPORTED;
            goto fail;
        }
        int errcode;
        PCRE2_SIZE erroff;
        t->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, PCRE2_UTF | PCRE2_UCP, &errcode, &erroff,
                              NULL);
        if (!t->re) {
            PCRE2_UCHAR msg[128];
            pcre2_get_error_message(errcode, msg, sizeof msg);
            seterr(errbuf, errlen, "PCRE2 cannot compile the split pattern at %zu: %s", (size_t)erroff,
                   (const char *)msg);
            e = KVS_ERR_INTERNAL;
            goto fail;
        }
        /* JIT is optional: without it pcre2_match interprets. */
        (void)pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);
    }
    *out = t;
    return KVS_OK;
fail:
    kvs_tokenizer_free(t);
    return e;
}

/* --- load from GGUF ------------------------------------------------------- */

struct gguf_ctx {
    const struct kvs_gguf *g;
    size_t tok_kv, merge_kv;
};

static kvs_err gg_token(void *ctx, uint64_t i, const char **s, size_t *len)
{
    const struct gguf_ctx *c = ctx;
    return kvs_gguf_arr_str(c->g, c->tok_kv, i, s, len);
}

static kvs_err gg_merge(void *ctx, uint64_t i, const char **s, size_t *len)
{
    const struct gguf_ctx *c = ctx;
    return kvs_gguf_arr_str(c->g, c->merge_kv, i, s, len);
}

static bool str_eq(const char *s, size_t n, const char *lit)
{
    return n == strlen(lit) && !memcmp(s, lit, n);
}

/* Optional u32 id key: -1 if absent or malformed (logged). */
static int64_t opt_id(const struct kvs_gguf *g, const char *key)
{
    uint32_t v;
    kvs_err e = kvs_gguf_get_u32(g, key, &v);
    if (e == KVS_ERR_NOT_FOUND)
        return -1;
    if (e != KVS_OK) {
        KVS_LOGW("tokenizer: key %s: %s: ignored", key, kvs_strerror(e));
        return -1;
    }
    return v == UINT32_MAX ? -1 : (int64_t)v;
}

static int opt_bool(const struct kvs_gguf *g, const char *key)
{
    bool v;
    kvs_err e = kvs_gguf_get_bool(g, key, &v);
    if (e != KVS_OK) {
        if (e != KVS_ERR_NOT_FOUND)
            KVS_LOGW("tokenizer: key %s: %s: ignored", key, kvs_strerror(e));
        return -1;
    }
    return v ? 1 : 0;
}

kvs_err kvs_tokenizer_load(const struct kvs_gguf *g, struct kvs_tokenizer **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    struct kvs_tok_desc d;
    memset(&d, 0, sizeof d);
    struct gguf_ctx c = { .g = g };

    const char *model;
    size_t model_len;
    kvs_err e = kvs_gguf_get_str(g, "tokenizer.ggml.model", &model, &model_len);
    if (e != KVS_OK) {
        seterr(errbuf, errlen, "tokenizer.ggml.model: %s", kvs_strerror(e));
        return e == KVS_ERR_NOT_FOUND ? KVS_ERR_NOT_FOUND : KVS_ERR_FORMAT;
    }
    if (str_eq(model, model_len, "llama")) {
        d.kind = KVS_TOK_KIND_SPM;
    } else if (str_eq(model, model_len, "gpt2")) {
        d.kind = KVS_TOK_KIND_BPE;
    } else {
        seterr(errbuf, errlen, "tokenizer model '%.*s' is not supported (only llama and gpt2)",
               (int)(model_len > 64 ? 64 : model_len), model);
        return KVS_ERR_UNSUPPORTED;
    }

    int64_t ti = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    if (ti < 0) {
        seterr(errbuf, errlen, "no tokenizer.ggml.tokens");
        return KVS_ERR_NOT_FOUND;
    }
    if (kvs_gguf_kv_type(g, (size_t)ti) != KVS_GGUF_TYPE_ARRAY ||
        kvs_gguf_arr_type(g, (size_t)ti) != KVS_GGUF_TYPE_STRING) {
        seterr(errbuf, errlen, "tokenizer.ggml.tokens is not an array of strings");
        return KVS_ERR_FORMAT;
    }
    c.tok_kv = (size_t)ti;
    d.n_tokens = kvs_gguf_arr_n(g, c.tok_kv);
    d.token = gg_token;
    d.ctx = &c;

    enum kvs_gguf_type et;
    uint64_t an;
    const void *data;
    e = kvs_gguf_get_arr(g, "tokenizer.ggml.scores", &et, &an, &data);
    if (e == KVS_OK) {
        if (et != KVS_GGUF_TYPE_FLOAT32 || an != d.n_tokens) {
            seterr(errbuf, errlen, "tokenizer.ggml.scores must be %llu FLOAT32 values",
                   (unsigned long long)d.n_tokens);
            return KVS_ERR_FORMAT;
        }
        d.scores = data;
    } else if (e != KVS_ERR_NOT_FOUND) {
        seterr(errbuf, errlen, "tokenizer.ggml.scores: %s", kvs_strerror(e));
        return KVS_ERR_FORMAT;
    }
    e = kvs_gguf_get_arr(g, "tokenizer.ggml.token_type", &et, &an, &data);
    if (e == KVS_OK) {
        if (et != KVS_GGUF_TYPE_INT32 || an != d.n_tokens) {
            seterr(errbuf, errlen, "tokenizer.ggml.token_type must be %llu INT32 values",
                   (unsigned long long)d.n_tokens);
            return KVS_ERR_FORMAT;
        }
        d.types = data;
    } else if (e != KVS_ERR_NOT_FOUND) {
        seterr(errbuf, errlen, "tokenizer.ggml.token_type: %s", kvs_strerror(e));
        return KVS_ERR_FORMAT;
    }

    if (d.kind == KVS_TOK_KIND_BPE) {
        const char *pre;
        size_t pre_len;
        e = kvs_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &pre_len);
        if (e == KVS_ERR_NOT_FOUND) {
            KVS_LOGW("tokenizer: no tokenizer.ggml.pre: using the gpt-2 split pattern");
            d.pre = KVS_TOK_PRE_GPT2;
        } else if (e != KVS_OK) {
            seterr(errbuf, errlen, "tokenizer.ggml.pre: %s", kvs_strerror(e));
            return KVS_ERR_FORMAT;
        } else if (str_eq(pre, pre_len, "llama3") || str_eq(pre, pre_len, "llama-v3") ||
                   str_eq(pre, pre_len, "llama-bpe") || str_eq(pre, pre_len, "falcon3")) {
            d.pre = KVS_TOK_PRE_LLAMA3;
        } else if (str_eq(pre, pre_len, "qwen2") || str_eq(pre, pre_len, "deepseek-r1-qwen") ||
                   str_eq(pre, pre_len, "megrez")) {
            d.pre = KVS_TOK_PRE_QWEN2;
        } else if (str_eq(pre, pre_len, "qwen35")) {
            d.pre = KVS_TOK_PRE_QWEN35;
        } else if (str_eq(pre, pre_len, "gpt-2") || str_eq(pre, pre_len, "default") ||
                   str_eq(pre, pre_len, "phi-2") || str_eq(pre, pre_len, "roberta-bpe")) {
            d.pre = KVS_TOK_PRE_GPT2;
        } else {
            seterr(errbuf, errlen, "BPE pre-tokenizer '%.*s' is not supported", (int)(pre_len > 64 ? 64 : pre_len),
                   pre);
            return KVS_ERR_UNSUPPORTED;
        }
        int64_t mi = kvs_gguf_find_key(g, "tokenizer.ggml.merges");
        if (mi < 0) {
            seterr(errbuf, errlen, "BPE vocabulary without tokenizer.ggml.merges");
            return KVS_ERR_FORMAT;
        }
        if (kvs_gguf_kv_type(g, (size_t)mi) != KVS_GGUF_TYPE_ARRAY ||
            kvs_gguf_arr_type(g, (size_t)mi) != KVS_GGUF_TYPE_STRING) {
            seterr(errbuf, errlen, "tokenizer.ggml.merges is not an array of strings");
            return KVS_ERR_FORMAT;
        }
        c.merge_kv = (size_t)mi;
        d.n_merges = kvs_gguf_arr_n(g, c.merge_kv);
        d.merge = gg_merge;
    }
    d.bos = opt_id(g, "tokenizer.ggml.bos_token_id");
    d.eos = opt_id(g, "tokenizer.ggml.eos_token_id");
    d.unk = opt_id(g, "tokenizer.ggml.unknown_token_id");
    d.eot = opt_id(g, "tokenizer.ggml.eot_token_id");
    d.eom = opt_id(g, "tokenizer.ggml.eom_token_id");
    d.add_bos = opt_bool(g, "tokenizer.ggml.add_bos_token");
    d.add_space_prefix = opt_bool(g, "tokenizer.ggml.add_space_prefix");
    return kvs_tokenizer_build(&d, out, errbuf, errlen);
}

/* --- accessors ------------------------------------------------------------ */

int32_t kvs_tokenizer_n_vocab(const struct kvs_tokenizer *t) { return t->n_vocab; }
int32_t kvs_tokenizer_bos(const struct kvs_tokenizer *t) { return t->bos; }
int32_t kvs_tokenizer_eos(const struct kvs_tokenizer *t) { return t->eos; }
bool kvs_tokenizer_add_bos(const struct kvs_tokenizer *t) { return t->add_bos; }

bool kvs_tokenizer_is_eog(const struct kvs_tokenizer *t, int32_t id)
{
    return id >= 0 && id < t->n_vocab && t->eog[id];
}

/* --- tokenize ------------------------------------------------------------- */

/* A piece of the input: raw text [off, off+len) or a special token id. */
struct frag {
    int32_t id; /* -1 for raw text */
    size_t off, len;
};

struct frags {
    struct frag *v;
    size_t n, cap;
};

static kvs_err frags_push(struct frags *f, int32_t id, size_t off, size_t len)
{
    if (f->n == f->cap) {
        size_t nc = f->cap ? 2 * f->cap : 16;
        struct frag *nv = realloc(f->v, nc * sizeof *nv);
        if (!nv)
            return KVS_ERR_NOMEM;
        f->v = nv;
        f->cap = nc;
    }
    f->v[f->n++] = (struct frag){ id, off, len };
    return KVS_OK;
}

/* Splits raw fragments at occurrences of special token texts (§5.2): each
 * special token in turn (longest first) over every raw fragment, leftmost
 * occurrences first. */
static kvs_err partition(const struct kvs_tokenizer *t, const char *text, size_t len, bool parse_special,
                         struct frags *cur, struct frags *tmp)
{
    cur->n = 0;
    if (frags_push(cur, -1, 0, len) != KVS_OK)
        return KVS_ERR_NOMEM;
    for (uint32_t k = 0; k < t->n_specials; k++) {
        int32_t id = t->specials[k];
        uint8_t ty = t->types[id];
        if (!parse_special && (ty == KVS_TOK_TYPE_CONTROL || ty == KVS_TOK_TYPE_UNKNOWN))
            continue;
        size_t sl;
        const char *s = kvs_tok_text(t, id, &sl);
        tmp->n = 0;
        bool changed = false;
        for (size_t i = 0; i < cur->n; i++) {
            struct frag f = cur->v[i];
            if (f.id >= 0 || f.len < sl) {
                if (frags_push(tmp, f.id, f.off, f.len) != KVS_OK)
                    return KVS_ERR_NOMEM;
                continue;
            }
            size_t pos = f.off, end = f.off + f.len;
            for (;;) {
                const char *hit = memmem(text + pos, end - pos, s, sl);
                if (!hit)
                    break;
                size_t h = (size_t)(hit - text);
                if (h > pos && frags_push(tmp, -1, pos, h - pos) != KVS_OK)
                    return KVS_ERR_NOMEM;
                if (frags_push(tmp, id, h, sl) != KVS_OK)
                    return KVS_ERR_NOMEM;
                pos = h + sl;
                changed = true;
            }
            if (pos < end && frags_push(tmp, -1, pos, end - pos) != KVS_OK)
                return KVS_ERR_NOMEM;
        }
        if (changed) {
            struct frags sw = *cur;
            *cur = *tmp;
            *tmp = sw;
        }
    }
    return KVS_OK;
}

int64_t kvs_tokenize(const struct kvs_tokenizer *t, const char *text, size_t len, bool add_bos, bool parse_special,
                     int32_t *out, int64_t cap)
{
    if (!t || (!text && len) || cap < 0 || (!out && cap))
        return -(int64_t)KVS_ERR_ARG;
    if (len > KVS_TOK_MAX_INPUT)
        return -(int64_t)KVS_ERR_RANGE;
    struct kvs_tok_sink sink = { out, cap, 0 };
    if (add_bos && t->bos >= 0)
        kvs_tok_sink_put(&sink, t->bos);
    if (!len)
        return sink.n;

    struct frags cur = { 0 }, tmp = { 0 };
    pcre2_match_data *md = NULL;
    kvs_err e = partition(t, text, len, parse_special, &cur, &tmp);
    if (e != KVS_OK)
        goto done;
    if (t->kind == KVS_TOK_KIND_BPE) {
        md = pcre2_match_data_create_from_pattern(t->re, NULL);
        if (!md) {
            e = KVS_ERR_NOMEM;
            goto done;
        }
    }
    bool prev_special = true; /* SPM: prefix a space to the first fragment */
    for (size_t i = 0; i < cur.n && e == KVS_OK; i++) {
        const struct frag *f = &cur.v[i];
        if (f->id >= 0) {
            kvs_tok_sink_put(&sink, f->id);
            prev_special = true;
            continue;
        }
        if (t->kind == KVS_TOK_KIND_SPM) {
            e = kvs_tok_spm_fragment(t, text + f->off, f->len, t->add_space_prefix && prev_special, &sink);
            prev_special = false;
        } else {
            e = kvs_tok_bpe_fragment(t, md, text + f->off, f->len, &sink);
        }
    }
done:
    if (md)
        pcre2_match_data_free(md);
    free(cur.v);
    free(tmp.v);
    return e == KVS_OK ? sink.n : -(int64_t)e;
}

/* --- detokenize ----------------------------------------------------------- */

struct bsink {
    char *out;
    size_t cap, n;
};

static void bput(struct bsink *b, const char *s, size_t n)
{
    if (b->n < b->cap) {
        size_t room = b->cap - b->n;
        memcpy(b->out + b->n, s, n < room ? n : room);
    }
    b->n += n;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

int64_t kvs_token_to_piece(const struct kvs_tokenizer *t, int32_t id, bool special, char *out, size_t cap)
{
    if (!t || (!out && cap))
        return -(int64_t)KVS_ERR_ARG;
    if (id < 0 || id >= t->n_vocab)
        return -(int64_t)KVS_ERR_RANGE;
    struct bsink b = { out, cap, 0 };
    uint8_t ty = t->types[id];
    size_t n;
    const char *s = kvs_tok_text(t, id, &n);
    if (ty == KVS_TOK_TYPE_CONTROL || ty == KVS_TOK_TYPE_UNKNOWN) {
        if (special)
            bput(&b, s, n);
        return (int64_t)b.n;
    }
    if (ty == KVS_TOK_TYPE_USER_DEFINED) {
        bput(&b, s, n);
        return (int64_t)b.n;
    }
    if (ty == KVS_TOK_TYPE_UNDEFINED || ty == KVS_TOK_TYPE_UNUSED)
        return 0;
    if (t->kind == KVS_TOK_KIND_SPM) {
        if (ty == KVS_TOK_TYPE_BYTE) {
            /* "<0xNN>" */
            if (n == 6 && s[0] == '<' && s[1] == '0' && s[2] == 'x' && s[5] == '>' && hexval(s[3]) >= 0 &&
                hexval(s[4]) >= 0) {
                char c = (char)(hexval(s[3]) * 16 + hexval(s[4]));
                bput(&b, &c, 1);
            } else {
                bput(&b, s, n);
            }
            return (int64_t)b.n;
        }
        /* NORMAL: "▁" (E2 96 81) -> ' ' */
        size_t i = 0, start = 0;
        while (i < n) {
            if (i + 2 < n && (uint8_t)s[i] == 0xE2 && (uint8_t)s[i + 1] == 0x96 && (uint8_t)s[i + 2] == 0x81) {
                bput(&b, s + start, i - start);
                bput(&b, " ", 1);
                i += 3;
                start = i;
            } else {
                i++;
            }
        }
        bput(&b, s + start, n - start);
        return (int64_t)b.n;
    }
    /* BPE: map each code point of the byte alphabet back to its byte; code
     * points outside the alphabet are copied as they are. */
    size_t i = 0;
    while (i < n) {
        uint8_t c = (uint8_t)s[i];
        uint32_t cp = 0;
        size_t l = 1;
        if (c < 0x80) {
            cp = c;
        } else if ((c & 0xE0) == 0xC0 && i + 1 < n) {
            cp = ((uint32_t)(c & 0x1F) << 6) | ((uint8_t)s[i + 1] & 0x3F);
            l = 2;
        } else {
            l = kvs_tok_utf8_len(c);
            if (i + l > n)
                l = n - i;
            bput(&b, s + i, l);
            i += l;
            continue;
        }
        int byte = kvs_tok_cp_to_byte(cp);
        if (byte >= 0) {
            char ch = (char)byte;
            bput(&b, &ch, 1);
        } else {
            bput(&b, s + i, l);
        }
        i += l;
    }
    return (int64_t)b.n;
}

int kvs_tok_utf8_valid(const uint8_t *s, size_t n)
{
    if (!n)
        return 0;
    uint8_t c = s[0];
    if (c < 0x80)
        return 1;
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* bounds of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        need = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else {
        return -1;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= n)
            return 0;
        uint8_t x = s[i];
        if (i == 1 ? (x < lo || x > hi) : (x & 0xC0) != 0x80)
            return -1;
    }
    return (int)need;
}

void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, bool strip_leading_space)
{
    memset(d, 0, sizeof *d);
    d->tok = t;
    d->strip_leading_space = strip_leading_space;
}

static const char k_replacement[3] = { (char)0xEF, (char)0xBF, (char)0xBD };

int64_t kvs_detok_push(struct kvs_detok *d, int32_t id, char *out, size_t cap)
{
    if (!d || !d->tok || (!out && cap))
        return -(int64_t)KVS_ERR_ARG;
    char stackbuf[1024];
    int64_t pn = kvs_token_to_piece(d->tok, id, false, NULL, 0);
    if (pn < 0)
        return pn;
    size_t total = d->n_pending + (size_t)pn;
    char *buf = stackbuf;
    if (total > sizeof stackbuf) {
        buf = malloc(total); /* only for tokens longer than 1 KiB */
        if (!buf)
            return -(int64_t)KVS_ERR_NOMEM;
    }
    memcpy(buf, d->pending, d->n_pending);
    kvs_token_to_piece(d->tok, id, false, buf + d->n_pending, (size_t)pn);
    size_t start = 0;
    bool started = d->started;
    if (pn > 0 && !started) {
        started = true;
        if (d->strip_leading_space && buf[d->n_pending] == ' ') {
            /* drop the first byte of the piece */
            memmove(buf + d->n_pending, buf + d->n_pending + 1, (size_t)pn - 1);
            total--;
        }
    }
    struct bsink b = { out, cap, 0 };
    size_t i = start;
    char newpend[8];
    size_t n_newpend = 0;
    while (i < total) {
        int l = kvs_tok_utf8_valid((const uint8_t *)buf + i, total - i);
        if (l > 0) {
            bput(&b, buf + i, (size_t)l);
            i += (size_t)l;
        } else if (l == 0) {
            n_newpend = total - i; /* < 4: an incomplete sequence */
            memcpy(newpend, buf + i, n_newpend);
            break;
        } else {
            bput(&b, k_replacement, 3);
            i++;
        }
    }
    if (buf != stackbuf)
        free(buf);
    if (b.n > cap)
        return -(int64_t)KVS_ERR_RANGE; /* state unchanged: retry with more room */
    d->started = started;
    memcpy(d->pending, newpend, n_newpend);
    d->n_pending = n_newpend;
    return (int64_t)b.n;
}

int64_t kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap)
{
    if (!d || (!out && cap))
        return -(int64_t)KVS_ERR_ARG;
    if (!d->n_pending)
        return 0;
    /* A pending tail is always an incomplete sequence: one U+FFFD for it. */
    if (cap < 3)
        return -(int64_t)KVS_ERR_RANGE;
    memcpy(out, k_replacement, 3);
    d->n_pending = 0;
    return 3;
}

/* Byte-level BPE ("gpt2") tokenization as llama.cpp does it (gguf-facts
 * §5.4): split the text with the pre-tokenizer's pattern (PCRE2, UTF + UCP:
 * \p{L}, \p{N} and \s come from PCRE2's Unicode tables), map every byte of a
 * piece to the GPT-2 byte alphabet, then merge adjacent symbols by lowest
 * merge rank (ties: leftmost) with a priority queue. */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_impl.h"

/* Split patterns: the tokenizer.json patterns of the original models. */
static const char k_pat_gpt2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
static const char k_pat_llama3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char k_pat_qwen2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen3.5: Qwen2's pattern with combining marks (\p{M}) kept inside words. */
static const char k_pat_qwen35[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char *kvs_tok_bpe_pattern(enum kvs_tok_pre pre)
{
    switch (pre) {
    case KVS_TOK_PRE_GPT2: return k_pat_gpt2;
    case KVS_TOK_PRE_LLAMA3: return k_pat_llama3;
    case KVS_TOK_PRE_QWEN2: return k_pat_qwen2;
    case KVS_TOK_PRE_QWEN35: return k_pat_qwen35;
    case KVS_TOK_PRE_NONE: break;
    }
    return NULL;
}

/* The 68 bytes outside the printable ranges 0x21-0x7E, 0xA1-0xAC,
 * 0xAE-0xFF map, in increasing order, to U+0100...: 0x00-0x20 -> 0-32,
 * 0x7F-0xA0 -> 33-66, 0xAD -> 67. */
uint32_t kvs_tok_byte_to_cp(uint8_t b)
{
    if (b <= 0x20)
        return 0x100u + b;
    if (b >= 0x7F && b <= 0xA0)
        return 0x100u + 33 + (uint32_t)(b - 0x7F);
    if (b == 0xAD)
        return 0x100u + 67;
    return b;
}

int kvs_tok_cp_to_byte(uint32_t cp)
{
    if (cp < 0x100) {
        if ((cp >= 0x21 && cp <= 0x7E) || (cp >= 0xA1 && cp <= 0xAC) || cp >= 0xAE)
            return (int)cp;
        return -1;
    }
    if (cp <= 0x100 + 32)
        return (int)(cp - 0x100);
    if (cp <= 0x100 + 66)
        return (int)(cp - 0x100 - 33 + 0x7F);
    if (cp == 0x100 + 67)
        return 0xAD;
    return -1;
}

struct bpe_scratch {
    char *w;                   /* mapped word, <= 2 bytes per input byte */
    struct kvs_tok_sym *sym;   /* <= 1 per input byte */
    struct kvs_tok_cand *heap; /* <= 3 per input byte */
};

static void try_pair(const struct kvs_tokenizer *t, const char *w, const struct kvs_tok_sym *sym, int32_t l,
                     int32_t r, struct kvs_tok_cand *heap, size_t *nh)
{
    if (l < 0 || r < 0)
        return;
    int32_t rank = kvs_tok_merge_rank(t, w + sym[l].start, sym[l].n, w + sym[r].start, sym[r].n);
    if (rank < 0)
        return;
    kvs_tok_heap_push(heap, nh, (struct kvs_tok_cand){ -(float)rank, l, r, sym[l].n + sym[r].n });
}

static void emit(const struct kvs_tokenizer *t, const char *s, size_t n, struct kvs_tok_sink *sink)
{
    int32_t id = kvs_tok_lookup(t, s, n);
    if (id >= 0) {
        kvs_tok_sink_put(sink, id);
        return;
    }
    /* llama.cpp's fallback: each byte of the symbol's text on its own. */
    for (size_t i = 0; i < n; i++) {
        int32_t b = kvs_tok_lookup(t, s + i, 1);
        if (b >= 0)
            kvs_tok_sink_put(sink, b);
    }
}

/* One pre-tokenized piece p[0..n) (valid UTF-8). */
static void bpe_word(const struct kvs_tokenizer *t, const char *p, size_t n, struct bpe_scratch *sc,
                     struct kvs_tok_sink *sink)
{
    char *w = sc->w;
    size_t wn = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t cp = kvs_tok_byte_to_cp((uint8_t)p[i]);
        if (cp < 0x80) {
            w[wn++] = (char)cp;
        } else {
            w[wn++] = (char)(0xC0 | (cp >> 6));
            w[wn++] = (char)(0x80 | (cp & 0x3F));
        }
    }
    if (t->ignore_merges) {
        int32_t id = kvs_tok_lookup(t, w, wn);
        if (id >= 0) {
            kvs_tok_sink_put(sink, id);
            return;
        }
    }
    struct kvs_tok_sym *sym = sc->sym;
    int32_t ns = kvs_tok_sym_split(sym, w, wn);
    size_t nh = 0;
    for (int32_t i = 1; i < ns; i++)
        try_pair(t, w, sym, i - 1, i, sc->heap, &nh);
    while (nh) {
        struct kvs_tok_cand c = kvs_tok_heap_pop(sc->heap, &nh);
        if (!kvs_tok_sym_join(sym, c))
            continue; /* stale */
        try_pair(t, w, sym, sym[c.left].prev, c.left, sc->heap, &nh);
        try_pair(t, w, sym, c.left, sym[c.left].next, sc->heap, &nh);
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = sym[i].next)
        emit(t, w + sym[i].start, sym[i].n, sink);
}

/* Copies text to out replacing each byte that does not start a valid UTF-8
 * sequence by U+FFFD (llama.cpp turns invalid bytes into U+FFFD before
 * splitting); out needs 3 * len bytes. Returns the length written. */
static size_t sanitize_utf8(const char *text, size_t len, char *out)
{
    size_t o = 0;
    for (size_t i = 0; i < len;) {
        int l = kvs_tok_utf8_valid((const uint8_t *)text + i, len - i);
        if (l > 0) {
            memcpy(out + o, text + i, (size_t)l);
            o += (size_t)l;
            i += (size_t)l;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
            i++;
        }
    }
    return o;
}

kvs_err kvs_tok_bpe_fragment(const struct kvs_tokenizer *t, pcre2_match_data *md, const char *text, size_t len,
                             struct kvs_tok_sink *sink)
{
    size_t ucap = 3 * len + 1;
    char *u = malloc(ucap);
    struct bpe_scratch sc = { malloc(2 * ucap), malloc(ucap * sizeof *sc.sym), malloc(3 * ucap * sizeof *sc.heap) };
    kvs_err e = KVS_OK;
    if (!u || !sc.w || !sc.sym || !sc.heap) {
        e = KVS_ERR_NOMEM;
        goto done;
    }
    size_t un = sanitize_utf8(text, len, u);
    size_t start = 0;
    while (start < un) {
        int rc = pcre2_match(t->re, (PCRE2_SPTR)u, un, start, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT)
            rc = pcre2_match(t->re, (PCRE2_SPTR)u, un, start, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) {
            bpe_word(t, u + start, un - start, &sc, sink);
            break;
        }
        if (rc < 0) {
            e = rc == PCRE2_ERROR_NOMEMORY ? KVS_ERR_NOMEM : KVS_ERR_INTERNAL;
            goto done;
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        size_t ms = ov[0], me = ov[1];
        if (ms > start) /* text between matches is a piece of its own */
            bpe_word(t, u + start, ms - start, &sc, sink);
        if (me == ms) { /* the patterns cannot match empty; be safe anyway */
            size_t l = kvs_tok_utf8_len((uint8_t)u[ms]);
            me = ms + (l > un - ms ? un - ms : l);
        }
        bpe_word(t, u + ms, me - ms, &sc, sink);
        start = me;
    }
done:
    free(u);
    free(sc.w);
    free(sc.sym);
    free(sc.heap);
    return e;
}

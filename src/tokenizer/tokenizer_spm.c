/* SentencePiece-style ("llama") tokenization as llama.cpp does it
 * (gguf-facts §5.3): escape spaces as U+2581, split into UTF-8 characters,
 * repeatedly merge the adjacent pair whose concatenation is the token with
 * the highest score (ties: leftmost), then emit each final symbol's token or
 * its bytes as byte tokens. A priority queue keeps this O(n log n). */
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_impl.h"

static void try_pair(const struct kvs_tokenizer *t, const char *s, const struct kvs_tok_sym *sym, int32_t l,
                     int32_t r, struct kvs_tok_cand *heap, size_t *nh)
{
    if (l < 0 || r < 0)
        return;
    uint32_t size = sym[l].n + sym[r].n;
    int32_t id = kvs_tok_lookup(t, s + sym[l].start, size);
    if (id < 0)
        return;
    kvs_tok_heap_push(heap, nh, (struct kvs_tok_cand){ t->scores[id], l, r, size });
}

/* Emits the ids for one final symbol: its token, or one byte token per byte.
 * (llama.cpp also keeps a map from merged texts to their halves for
 * re-segmenting symbols that are not tokens, but every merged symbol is a
 * token by construction and single characters have no halves, so that path
 * never yields anything different.) */
static void emit(const struct kvs_tokenizer *t, const char *s, size_t n, struct kvs_tok_sink *sink)
{
    int32_t id = kvs_tok_lookup(t, s, n);
    if (id >= 0) {
        kvs_tok_sink_put(sink, id);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        int32_t b = t->byte_tok[(uint8_t)s[i]];
        if (b < 0)
            b = t->unk;
        if (b >= 0)
            kvs_tok_sink_put(sink, b);
    }
}

kvs_err kvs_tok_spm_fragment(const struct kvs_tokenizer *t, const char *text, size_t len, bool prefix_space,
                             struct kvs_tok_sink *sink)
{
    /* Escaped text: every ' ' (and the optional prefix) becomes E2 96 81. */
    size_t cap = 3 * (len + 1);
    char *s = malloc(cap);
    struct kvs_tok_sym *sym = malloc(cap * sizeof *sym);
    struct kvs_tok_cand *heap = malloc(3 * cap * sizeof *heap);
    if (!s || !sym || !heap) {
        free(s);
        free(sym);
        free(heap);
        return KVS_ERR_NOMEM;
    }
    size_t n = 0;
    if (prefix_space) {
        memcpy(s, "\xE2\x96\x81", 3);
        n = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(s + n, "\xE2\x96\x81", 3);
            n += 3;
        } else {
            s[n++] = text[i];
        }
    }

    /* Initial symbols: UTF-8 characters by lead-byte length, clipped. */
    int32_t ns = kvs_tok_sym_split(sym, s, n);

    size_t nh = 0;
    for (int32_t i = 1; i < ns; i++)
        try_pair(t, s, sym, i - 1, i, heap, &nh);
    while (nh) {
        struct kvs_tok_cand c = kvs_tok_heap_pop(heap, &nh);
        if (!kvs_tok_sym_join(sym, c))
            continue; /* stale */
        try_pair(t, s, sym, sym[c.left].prev, c.left, heap, &nh);
        try_pair(t, s, sym, c.left, sym[c.left].next, heap, &nh);
    }
    for (int32_t i = ns ? 0 : -1; i >= 0; i = sym[i].next)
        emit(t, s + sym[i].start, sym[i].n, sink);
    free(s);
    free(sym);
    free(heap);
    return KVS_OK;
}

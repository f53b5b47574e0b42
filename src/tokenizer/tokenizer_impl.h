/* Private parts of the tokenizer module shared by tokenizer.c (vocabulary,
 * special tokens, detokenizer), tokenizer_spm.c and tokenizer_bpe.c. Tests and
 * fuzz targets may include this header to build a tokenizer from an
 * in-memory vocabulary (kvs_tokenizer_build). Not a public contract. */
#ifndef KVS_TOKENIZER_IMPL_H
#define KVS_TOKENIZER_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include "tokenizer/tokenizer.h"

/* Token types as stored in tokenizer.ggml.token_type (gguf-facts §5.1). */
enum kvs_tok_type {
    KVS_TOK_TYPE_UNDEFINED = 0,
    KVS_TOK_TYPE_NORMAL = 1,
    KVS_TOK_TYPE_UNKNOWN = 2,
    KVS_TOK_TYPE_CONTROL = 3,
    KVS_TOK_TYPE_USER_DEFINED = 4,
    KVS_TOK_TYPE_UNUSED = 5,
    KVS_TOK_TYPE_BYTE = 6,
};

enum kvs_tok_kind { KVS_TOK_KIND_SPM = 0, KVS_TOK_KIND_BPE };

/* BPE pre-tokenizers (gguf-facts §5.4). */
enum kvs_tok_pre { KVS_TOK_PRE_NONE = 0, KVS_TOK_PRE_GPT2, KVS_TOK_PRE_LLAMA3, KVS_TOK_PRE_QWEN2, KVS_TOK_PRE_QWEN35 };

/* Limits on untrusted vocabularies. */
#define KVS_TOK_MAX_VOCAB (1u << 24)      /* tokens */
#define KVS_TOK_MAX_MERGES (1u << 24)     /* merge rules */
#define KVS_TOK_MAX_TEXT 65536u           /* bytes of one token or merge text */
#define KVS_TOK_MAX_INPUT (256u << 20)    /* bytes of text one kvs_tokenize call takes */

/* Everything needed to build a tokenizer, independent of GGUF. Strings are
 * fetched through the callbacks (borrowed for the duration of the build;
 * the tokenizer copies them). scores / types point at n_tokens packed
 * little-endian float32 / int32 values (possibly unaligned) or are NULL
 * (scores 0, all NORMAL). Special ids are -1 when absent; add_bos and
 * add_space_prefix are -1 for "model default". */
struct kvs_tok_desc {
    enum kvs_tok_kind kind;
    enum kvs_tok_pre pre;          /* BPE only */
    uint64_t n_tokens;
    uint64_t n_merges;             /* BPE only */
    void *ctx;
    kvs_err (*token)(void *ctx, uint64_t i, const char **s, size_t *len);
    kvs_err (*merge)(void *ctx, uint64_t i, const char **s, size_t *len);
    const void *scores;
    const void *types;
    int64_t bos, eos, unk, eot, eom;
    int add_bos;
    int add_space_prefix;
};

/* Builds a tokenizer from d. Errors: KVS_ERR_RANGE / KVS_ERR_FORMAT for bad
 * sizes or texts, KVS_ERR_NOMEM, KVS_ERR_INTERNAL (PCRE2 compile). */
kvs_err kvs_tokenizer_build(const struct kvs_tok_desc *d, struct kvs_tokenizer **out, char *errbuf,
                            size_t errlen);

/* Open-addressing hash table of int32 values whose keys are byte strings
 * kept elsewhere (the table stores only the value; the key text of a value
 * comes from the owner). Capacity is a power of two, at most half full. */
struct kvs_tok_map {
    int32_t *slots; /* -1 = empty */
    uint64_t mask;
};

static inline uint64_t kvs_tok_hash_step(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 0x100000001b3ull; /* FNV-1a 64 */
    }
    return h;
}
#define KVS_TOK_HASH_INIT 0xcbf29ce484222325ull

struct kvs_tokenizer {
    enum kvs_tok_kind kind;
    enum kvs_tok_pre pre;
    int32_t n_vocab;
    char *text;           /* all token texts, concatenated */
    uint64_t *text_off;   /* [n_vocab + 1] offsets into text */
    float *scores;        /* [n_vocab] */
    uint8_t *types;       /* [n_vocab] enum kvs_tok_type */
    uint8_t *eog;         /* [n_vocab] 1 = end of generation */
    struct kvs_tok_map vocab;  /* text -> id (last id wins, as llama.cpp) */

    uint32_t n_merges;
    char *mtext;          /* merge texts "left right", concatenated */
    uint64_t *mtext_off;  /* [n_merges + 1] */
    struct kvs_tok_map merges; /* "left right" -> rank (first wins) */

    int32_t *specials;    /* ids matched by special-token partitioning, longest first */
    uint32_t n_specials;

    int32_t bos, eos, unk, eot, eom;
    bool add_bos, add_space_prefix, ignore_merges;
    int32_t byte_tok[256]; /* SPM byte fallback: id of "<0xNN>" (or raw byte), -1 */

    pcre2_code *re;       /* BPE split pattern (UTF + UCP), NULL for SPM */
};

static inline const char *kvs_tok_text(const struct kvs_tokenizer *t, int32_t id, size_t *len)
{
    *len = (size_t)(t->text_off[id + 1] - t->text_off[id]);
    return t->text + t->text_off[id];
}

/* Id of the token whose text is s[0..n), or -1. */
int32_t kvs_tok_lookup(const struct kvs_tokenizer *t, const char *s, size_t n);

/* Rank of the merge "l r" (l[0..ln) + ' ' + r[0..rn)), or -1. */
int32_t kvs_tok_merge_rank(const struct kvs_tokenizer *t, const char *l, size_t ln, const char *r, size_t rn);

/* Output sink for ids: writes while there is room, always counts. */
struct kvs_tok_sink {
    int32_t *out;
    int64_t cap;
    int64_t n;
};
static inline void kvs_tok_sink_put(struct kvs_tok_sink *s, int32_t id)
{
    if (s->n < s->cap)
        s->out[s->n] = id;
    s->n++;
}

/* Merge work shared by SPM and BPE: a symbol is a byte range of the
 * fragment in a doubly linked list; a candidate is an adjacent pair with a
 * priority (SPM: the merged token's score; BPE: minus the merge rank, exact
 * in float since ranks < 2^24). The heap pops the highest priority, ties to
 * the smaller left index (llama.cpp's comparators). */
struct kvs_tok_sym {
    int32_t prev, next;
    uint32_t start, n; /* bytes; n == 0 once merged into its left neighbour */
};
struct kvs_tok_cand {
    float prio;
    int32_t left, right;
    uint32_t size; /* bytes of the merged text when pushed */
};
static inline bool kvs_tok_cand_before(const struct kvs_tok_cand *a, const struct kvs_tok_cand *b)
{
    return a->prio > b->prio || (a->prio == b->prio && a->left < b->left);
}
/* Push into a heap with room for it (the caller sizes the array: at most
 * 3 * symbols pushes happen per word: n - 1 seeds and two per merge). */
static inline void kvs_tok_heap_push(struct kvs_tok_cand *h, size_t *n, struct kvs_tok_cand c)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!kvs_tok_cand_before(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}
static inline struct kvs_tok_cand kvs_tok_heap_pop(struct kvs_tok_cand *h, size_t *n)
{
    struct kvs_tok_cand top = h[0];
    struct kvs_tok_cand last = h[--(*n)];
    size_t i = 0, m = *n;
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, best = i;
        const struct kvs_tok_cand *bc = &last;
        if (l < m && kvs_tok_cand_before(&h[l], bc)) {
            best = l;
            bc = &h[l];
        }
        if (r < m && kvs_tok_cand_before(&h[r], bc))
            best = r;
        if (best == i)
            break;
        h[i] = h[best];
        i = best;
    }
    if (m)
        h[i] = last;
    return top;
}

/* Tokenize one raw-text fragment (no special tokens inside).
 * SPM: `text` is already space-prefixed as required; spaces are escaped
 * inside. Both return KVS_OK or KVS_ERR_NOMEM. */
kvs_err kvs_tok_spm_fragment(const struct kvs_tokenizer *t, const char *text, size_t len, bool prefix_space,
                             struct kvs_tok_sink *sink);
kvs_err kvs_tok_bpe_fragment(const struct kvs_tokenizer *t, pcre2_match_data *md, const char *text, size_t len,
                             struct kvs_tok_sink *sink);

/* BPE pattern source for a pre-tokenizer (NULL for NONE). */
const char *kvs_tok_bpe_pattern(enum kvs_tok_pre pre);

/* GPT-2 byte alphabet (gguf-facts §5.4 step 2): the code point of byte b. */
uint32_t kvs_tok_byte_to_cp(uint8_t b);
/* Inverse: byte for code point cp, or -1 if cp is not in the alphabet. */
int kvs_tok_cp_to_byte(uint32_t cp);

/* Length of the UTF-8 sequence led by byte c as llama.cpp counts it
 * (by the high nibble: 0x0-0xB -> 1, 0xC-0xD -> 2, 0xE -> 3, 0xF -> 4). */
static inline size_t kvs_tok_utf8_len(uint8_t c)
{
    static const uint8_t lens[16] = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4 };
    return lens[c >> 4];
}

/* Splits s[0..n) into initial symbols, one per UTF-8 character by lead-byte
 * length (clipped at n), linked in order; sym needs room for n entries.
 * Returns the number of symbols. */
static inline int32_t kvs_tok_sym_split(struct kvs_tok_sym *sym, const char *s, size_t n)
{
    int32_t ns = 0;
    for (size_t off = 0; off < n;) {
        size_t l = kvs_tok_utf8_len((uint8_t)s[off]);
        if (l > n - off)
            l = n - off;
        sym[ns] = (struct kvs_tok_sym){ ns - 1, off + l == n ? -1 : ns + 1, (uint32_t)off, (uint32_t)l };
        ns++;
        off += l;
    }
    return ns;
}

/* Applies the popped candidate c: merges its right symbol into its left one
 * and relinks. Returns false, changing nothing, when c is stale (either side
 * already merged away or grown since c was pushed). */
static inline bool kvs_tok_sym_join(struct kvs_tok_sym *sym, struct kvs_tok_cand c)
{
    struct kvs_tok_sym *L = &sym[c.left], *R = &sym[c.right];
    if (L->n == 0 || R->n == 0 || L->n + R->n != c.size)
        return false;
    L->n += R->n;
    R->n = 0;
    L->next = R->next;
    if (R->next >= 0)
        sym[R->next].prev = c.left;
    return true;
}

/* Length of the valid (RFC 3629: no overlongs, no surrogates, <= U+10FFFF)
 * UTF-8 sequence at s[0..n): > 0 valid; 0 an incomplete but so far valid
 * prefix (only when it runs to the end of s); -1 invalid lead or
 * continuation. */
int kvs_tok_utf8_valid(const uint8_t *s, size_t n);

#endif

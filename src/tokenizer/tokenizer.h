/* Tokenizers built from GGUF metadata (gguf-facts §5): SentencePiece-style
 * ("llama") and byte-level BPE ("gpt2") with the pre-tokenizers llama-bpe
 * (llama3), qwen2 and gpt-2 (split patterns run with PCRE2, UTF mode). */
#ifndef KVS_TOKENIZER_H
#define KVS_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "gguf/gguf.h"

struct kvs_tokenizer; /* opaque, immutable after creation: thread-safe to share */

/* Builds the tokenizer from `tokenizer.ggml.*` keys of g. The tokenizer
 * copies what it needs: g may be closed afterwards. Errors: KVS_ERR_NOT_FOUND
 * (no vocabulary), KVS_ERR_UNSUPPORTED (unknown model or pre-tokenizer),
 * KVS_ERR_FORMAT. */
kvs_err kvs_tokenizer_load(const struct kvs_gguf *g, struct kvs_tokenizer **out, char *errbuf, size_t errlen);
void kvs_tokenizer_free(struct kvs_tokenizer *t);

int32_t kvs_tokenizer_n_vocab(const struct kvs_tokenizer *t);
int32_t kvs_tokenizer_bos(const struct kvs_tokenizer *t);  /* -1 if none */
int32_t kvs_tokenizer_eos(const struct kvs_tokenizer *t);  /* -1 if none */
bool kvs_tokenizer_add_bos(const struct kvs_tokenizer *t); /* model's default */
/* True for end-of-generation tokens (eos, eot, <|im_end|>, <|eot_id|> ...). */
bool kvs_tokenizer_is_eog(const struct kvs_tokenizer *t, int32_t id);

/* Tokenizes text[0..len). add_bos: prepend BOS (if the vocab has one).
 * parse_special: match CONTROL token texts (e.g. "<|im_start|>") as tokens.
 * Writes at most cap ids to out and returns the total number of ids the text
 * needs (so a return value > cap means "retry with a bigger buffer"), or a
 * negative kvs_err on failure. */
int64_t kvs_tokenize(const struct kvs_tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t *out, int64_t cap);

/* The bytes a token stands for (byte tokens -> that byte; SPM "▁" -> ' ';
 * BPE byte alphabet decoded; CONTROL tokens -> empty unless special).
 * Writes at most cap bytes and returns the full length, or < 0 on error. */
int64_t kvs_token_to_piece(const struct kvs_tokenizer *t, int32_t id, bool special, char *out, size_t cap);

/* Streaming detokenizer: feeds ids one at a time and emits only complete,
 * valid UTF-8 (a multi-byte character split over tokens is held back until it
 * is complete). Strips the leading space SPM adds to the first piece when
 * created with strip_leading_space. */
struct kvs_detok {
    const struct kvs_tokenizer *tok;
    bool strip_leading_space;
    bool started;
    char pending[8];
    size_t n_pending;
};
void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, bool strip_leading_space);
/* Appends the printable bytes for `id` to out (cap bytes) and returns how
 * many were written (out is not NUL-terminated); < 0 on error. */
int64_t kvs_detok_push(struct kvs_detok *d, int32_t id, char *out, size_t cap);
/* Flushes what is pending (invalid UTF-8 becomes U+FFFD). */
int64_t kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap);

#endif

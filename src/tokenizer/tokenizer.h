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

/* Error convention: functions returning int64_t give a negative kvs_err
 * (-(int64_t)KVS_ERR_...) on failure. */

/* Builds the tokenizer from `tokenizer.ggml.*` keys of g. The tokenizer
 * copies what it needs: g may be closed afterwards; free *out with
 * kvs_tokenizer_free (NULL allowed). Models: "llama" (SPM) and "gpt2" (BPE)
 * with pre "llama-bpe"/"llama3"/"llama-v3"/"falcon3", "qwen2"/
 * "deepseek-r1-qwen"/"megrez", "gpt-2"/"default"/"phi-2"/"roberta-bpe" (a
 * missing pre means gpt-2, with a warning). Defaults when keys are absent
 * (gguf-facts §5.1): SPM bos 1, eos 2, unk 0, add_bos true, add_space_prefix
 * true; BPE bos/eos none (-1), add_bos true only for the llama3 family.
 * Ids >= n_vocab (e.g. 0xFFFFFFFF) are ignored: the default stays. Limits:
 * 2^24 tokens and merges, 64 KiB per token text. errbuf (may be NULL) gets
 * a message. Errors: KVS_ERR_NOT_FOUND (no vocabulary), KVS_ERR_UNSUPPORTED
 * (unknown model or pre-tokenizer), KVS_ERR_FORMAT (wrong key types or
 * array lengths), KVS_ERR_RANGE (limits), KVS_ERR_NOMEM. Takes about 0.05 s
 * for a 151669-token vocabulary. */
kvs_err kvs_tokenizer_load(const struct kvs_gguf *g, struct kvs_tokenizer **out, char *errbuf, size_t errlen);
void kvs_tokenizer_free(struct kvs_tokenizer *t);

int32_t kvs_tokenizer_n_vocab(const struct kvs_tokenizer *t);
int32_t kvs_tokenizer_bos(const struct kvs_tokenizer *t);  /* -1 if none */
int32_t kvs_tokenizer_eos(const struct kvs_tokenizer *t);  /* -1 if none */
bool kvs_tokenizer_add_bos(const struct kvs_tokenizer *t); /* model's default */
/* True for end-of-generation tokens: eos, tokenizer.ggml.eot_token_id,
 * eom_token_id, and CONTROL tokens whose text is <|im_end|>, <|eot_id|>,
 * <|eom_id|>, <|endoftext|> or <|end_of_text|>. False for ids out of range. */
bool kvs_tokenizer_is_eog(const struct kvs_tokenizer *t, int32_t id);

/* Tokenizes text[0..len) (any bytes; invalid UTF-8 is handled as llama.cpp
 * does: SPM byte tokens, BPE U+FFFD). add_bos: prepend BOS (if the vocab has
 * one). parse_special: match CONTROL/UNKNOWN token texts (e.g.
 * "<|im_start|>") as tokens; USER_DEFINED texts always match (§5.2).
 * Writes at most cap ids to out (out may be NULL when cap is 0) and returns
 * the total number of ids the text needs (so a return value > cap means
 * "retry with a bigger buffer"; at most 6 * len + 2), or a negative
 * kvs_err: KVS_ERR_ARG, KVS_ERR_RANGE (len > 256 MiB), KVS_ERR_NOMEM.
 * Allocates scratch per call (O(len)); merges are O(n log n). */
int64_t kvs_tokenize(const struct kvs_tokenizer *t, const char *text, size_t len, bool add_bos,
                     bool parse_special, int32_t *out, int64_t cap);

/* The bytes a token stands for (byte tokens -> that byte; SPM "▁" -> ' ';
 * BPE byte alphabet decoded; CONTROL and UNKNOWN tokens -> empty unless
 * special, then their text; USER_DEFINED -> their text; UNUSED -> empty).
 * Writes at most cap bytes (not NUL-terminated) and returns the full length,
 * or -KVS_ERR_RANGE for an id outside [0, n_vocab). */
int64_t kvs_token_to_piece(const struct kvs_tokenizer *t, int32_t id, bool special, char *out, size_t cap);

/* Streaming detokenizer: feeds ids one at a time and emits only complete,
 * valid UTF-8 (a multi-byte character split over tokens is held back until it
 * is complete; bytes that cannot start or continue a valid sequence become
 * U+FFFD at once). Special tokens give nothing. With strip_leading_space it
 * drops one ' ' from the first non-empty piece (the space SPM adds to the
 * start of a text): use it to decode a whole SPM text, not a continuation
 * of a prompt. A plain struct: no allocation, init again to reuse. */
struct kvs_detok {
    const struct kvs_tokenizer *tok;
    bool strip_leading_space;
    bool started;
    char pending[8];
    size_t n_pending;
};
void kvs_detok_init(struct kvs_detok *d, const struct kvs_tokenizer *t, bool strip_leading_space);
/* Appends the printable bytes for `id` to out (cap bytes) and returns how
 * many were written (out is not NUL-terminated; a push never writes more
 * than 3 * (piece length + 3) bytes). Errors: -KVS_ERR_RANGE when cap is
 * too small (the state is unchanged: push the same id again with more room)
 * or the id is out of range. */
int64_t kvs_detok_push(struct kvs_detok *d, int32_t id, char *out, size_t cap);
/* Flushes what is pending: an incomplete sequence becomes one U+FFFD (3
 * bytes; needs cap >= 3, else -KVS_ERR_RANGE). Returns bytes written. */
int64_t kvs_detok_flush(struct kvs_detok *d, char *out, size_t cap);

#endif

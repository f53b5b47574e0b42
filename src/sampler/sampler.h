/* Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition
 * penalty; seeded and reproducible (same seed + same logits -> same tokens,
 * on every platform: the RNG is our own xoshiro256** generator seeded through
 * splitmix64, not rand()).
 *
 * Conventions follow llama.cpp's samplers (facts only): the repetition
 * penalty divides a positive logit by the penalty and multiplies a
 * non-positive one, once per distinct token among the last repeat_last_n
 * accepted tokens; top-p keeps the smallest prefix of the probability-sorted
 * candidates whose mass reaches top_p (at least one); min-p keeps candidates
 * with p >= min_p * p_max (at least one). Ties in a logit are broken by the
 * lower token id, everywhere (greedy, top-k, ordering). NaN logits are treated
 * as -inf. A sampler is not thread-safe: one per sequence. */
#ifndef KVS_SAMPLER_H
#define KVS_SAMPLER_H

#include <stdint.h>

#include "common/error.h"

struct kvs_sampler_params {
    float temp;            /* <= 0: greedy (argmax); default 0.8 */
    int32_t top_k;         /* <= 0 or >= n_vocab: off; default 40 */
    float top_p;           /* >= 1: off; default 0.95 */
    float min_p;           /* <= 0: off; default 0.05 */
    float repeat_penalty;  /* 1: off; must be > 0; default 1.0 */
    int32_t repeat_last_n; /* tokens considered by the penalty (<= 0: off,
                            * at most KVS_SAMPLER_MAX_LAST_N); default 64 */
    uint64_t seed;         /* default 0 */
};
#define KVS_SAMPLER_MAX_LAST_N (1 << 20)
#define KVS_SAMPLER_MAX_VOCAB (1 << 24)

struct kvs_sampler_params kvs_sampler_default_params(void);

struct kvs_sampler; /* opaque: params + RNG state + recent tokens */

/* n_vocab: length of the logits rows it will get (1..KVS_SAMPLER_MAX_VOCAB).
 * Allocates its work arrays once (about 13 bytes per vocab entry); sampling
 * allocates nothing. Errors: KVS_ERR_ARG (NULL, NaN or out-of-domain params:
 * temp NaN or inf, top_p/min_p NaN, repeat_penalty <= 0 or NaN), KVS_ERR_RANGE
 * (n_vocab or repeat_last_n too large), KVS_ERR_NOMEM. *out is owned by the
 * caller: free with kvs_sampler_free (accepts NULL). */
kvs_err kvs_sampler_create(const struct kvs_sampler_params *p, int32_t n_vocab, struct kvs_sampler **out);
void kvs_sampler_free(struct kvs_sampler *s);
/* Chooses a token from logits[n_vocab] (not modified). Order: repetition
 * penalty, greedy if temp <= 0, else top-k, temperature, softmax, top-p,
 * min-p, draw. Does not record the token: call accept. Returns an id in
 * [0, n_vocab). */
int32_t kvs_sampler_sample(struct kvs_sampler *s, const float *logits);
/* The distribution sample would draw from, without drawing (no RNG use):
 * *ids and *probs receive borrowed arrays (valid until the next call on s)
 * of the returned count n >= 1 of candidates, sorted by probability
 * descending (ties: lower id first), probs renormalized to sum to 1. With
 * temp <= 0 it is the argmax with probability 1. */
int32_t kvs_sampler_dist(struct kvs_sampler *s, const float *logits, const int32_t **ids, const float **probs);
/* Records a token (prompt or generated) for the repetition penalty; ids
 * outside [0, n_vocab) are ignored. */
void kvs_sampler_accept(struct kvs_sampler *s, int32_t id);
/* Forgets the recorded tokens and reseeds the RNG with params.seed, so a
 * reset sampler repeats its sequence. */
void kvs_sampler_reset(struct kvs_sampler *s);

#endif

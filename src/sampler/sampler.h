/* Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition
 * penalty; seeded and reproducible on every platform. The random number of a
 * draw is a pure function of the request's seed and the position of the token
 * being drawn (kvs_sampler_uniform: counter-based, splitmix64), not a stream
 * state: a replay of a request after a fault, on any tail, draws the same
 * numbers (docs/PROTOCOL.md, "Sampling").
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

struct kvs_sampler; /* opaque: params + position + recent tokens */

/* The uniform number in [0, 1) drawn for the token at position pos (0-based,
 * counting the prompt) of a request sampled with seed:
 *   mix(z)  = z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27;
 *             z *= 0x94d049bb133111eb; z ^= z >> 31        (all mod 2^64)
 *   key     = mix(seed + G)                 G = 0x9e3779b97f4a7c15
 *   bits    = mix(key + (pos + 1) * G)      (output pos+1 of splitmix64 seeded with key)
 *   u       = (bits >> 11) * 2^-53
 * (splitmix64: Steele, Lea, Flood 2014.) E.g. seed 0, pos 0: bits
 * 0xa706dd2f4d197e6f, u 0.6524484863740322. */
double kvs_sampler_uniform(uint64_t seed, uint64_t pos);

/* n_vocab: length of the logits rows it will get (1..KVS_SAMPLER_MAX_VOCAB).
 * Allocates its work arrays once (about 13 bytes per vocab entry); sampling
 * allocates nothing. Errors: KVS_ERR_ARG (NULL, NaN or out-of-domain params:
 * temp NaN or inf, top_p/min_p NaN, repeat_penalty <= 0 or NaN), KVS_ERR_RANGE
 * (n_vocab or repeat_last_n too large), KVS_ERR_NOMEM. *out is owned by the
 * caller: free with kvs_sampler_free (accepts NULL). */
kvs_err kvs_sampler_create(const struct kvs_sampler_params *p, int32_t n_vocab, struct kvs_sampler **out);
void kvs_sampler_free(struct kvs_sampler *s);
/* Chooses a token from logits[n_vocab] (not modified) for position pos.
 * Order: repetition penalty, greedy if temp <= 0, else top-k, temperature,
 * softmax (in double), top-p, min-p, then the draw: with u =
 * kvs_sampler_uniform(seed, pos), the first kept candidate (sorted by
 * probability descending, ties by lower id) whose cumulative probability
 * exceeds u (the last one if rounding leaves u above the sum). Does not
 * record the token: call accept. Returns an id in [0, n_vocab). */
int32_t kvs_sampler_sample_at(struct kvs_sampler *s, const float *logits, uint64_t pos);
/* kvs_sampler_sample_at at the position = the number of tokens accepted since
 * create/reset: the token's position when the caller accepts the prompt and
 * every generated token, as `run` and the tail do. */
int32_t kvs_sampler_sample(struct kvs_sampler *s, const float *logits);
/* The distribution sample would draw from, without drawing (no RNG use):
 * *ids and *probs receive borrowed arrays (valid until the next call on s)
 * of the returned count n >= 1 of candidates, sorted by probability
 * descending (ties: lower id first), probs renormalized to sum to 1. With
 * temp <= 0 it is the argmax with probability 1. */
int32_t kvs_sampler_dist(struct kvs_sampler *s, const float *logits, const int32_t **ids, const float **probs);
/* Records a token (prompt or generated): advances the position by one, and
 * remembers the id for the repetition penalty (ids outside [0, n_vocab) are
 * not remembered). */
void kvs_sampler_accept(struct kvs_sampler *s, int32_t id);
/* The ids the repetition penalty remembers (the last repeat_last_n accepted
 * in [0, n_vocab)), oldest first, into out[cap]; returns how many there are
 * (0 when the penalty is off; more than cap: only cap written; out may be
 * NULL when cap is 0). Accepting
 * them in this order into a new sampler with the same parameters gives it the
 * same penalty (a tail handing its sequences over, docs/PROTOCOL.md §5.2). */
int32_t kvs_sampler_recent(const struct kvs_sampler *s, int32_t *out, int32_t cap);
/* Forgets the recorded tokens and sets the position back to 0, so a reset
 * sampler repeats its sequence. */
void kvs_sampler_reset(struct kvs_sampler *s);

#endif

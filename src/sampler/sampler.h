/* Next-token sampling: greedy, temperature, top-k, top-p, min-p, repetition
 * penalty; seeded and reproducible (same seed + same logits -> same tokens,
 * on every platform: the RNG is our own xoshiro-style generator, not rand()). */
#ifndef KVS_SAMPLER_H
#define KVS_SAMPLER_H

#include <stdint.h>

#include "common/error.h"

struct kvs_sampler_params {
    float temp;            /* <= 0: greedy (argmax); default 0.8 */
    int32_t top_k;         /* <= 0: off; default 40 */
    float top_p;           /* >= 1: off; default 0.95 */
    float min_p;           /* <= 0: off; default 0.05 */
    float repeat_penalty;  /* 1: off; default 1.0 */
    int32_t repeat_last_n; /* tokens considered by the penalty; default 64 */
    uint64_t seed;         /* default 0 */
};
struct kvs_sampler_params kvs_sampler_default_params(void);

struct kvs_sampler; /* opaque: params + RNG state + recent tokens */

/* n_vocab: length of the logits rows it will get. Allocates its work arrays
 * once; sampling allocates nothing. */
kvs_err kvs_sampler_create(const struct kvs_sampler_params *p, int32_t n_vocab, struct kvs_sampler **out);
void kvs_sampler_free(struct kvs_sampler *s);
/* Chooses a token from logits[n_vocab] (not modified). Order: repetition
 * penalty, greedy if temp <= 0, else top-k, temperature, softmax, top-p,
 * min-p, draw. Does not record the token: call accept. */
int32_t kvs_sampler_sample(struct kvs_sampler *s, const float *logits);
/* Records a token (prompt or generated) for the repetition penalty. */
void kvs_sampler_accept(struct kvs_sampler *s, int32_t id);
void kvs_sampler_reset(struct kvs_sampler *s);

#endif

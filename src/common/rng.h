/* A small, seeded, platform-independent PRNG: xoshiro256** 1.0 (Blackman,
 * Vigna 2018), its state expanded from a 64-bit seed by splitmix64 (Steele,
 * Lea, Flood 2014), as the xoshiro authors recommend. Used wherever runs must
 * be reproducible: synthetic weights, test data. (Sampling draws from a
 * counter-based function of seed and position instead: sampler.h.) Not for
 * cryptography. */
#ifndef KVS_COMMON_RNG_H
#define KVS_COMMON_RNG_H

#include <stdint.h>

struct kvs_rng {
    uint64_t s[4];
};

/* splitmix64 step: advances *x and returns the next output. */
static inline uint64_t kvs_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Seeds the generator: four splitmix64 outputs of `seed`. */
static inline void kvs_rng_seed(struct kvs_rng *r, uint64_t seed)
{
    uint64_t x = seed;
    for (int i = 0; i < 4; i++)
        r->s[i] = kvs_splitmix64(&x);
}

static inline uint64_t kvs_rng_rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

/* Next 64 random bits (xoshiro256**). */
static inline uint64_t kvs_rng_next(struct kvs_rng *r)
{
    uint64_t *s = r->s;
    const uint64_t result = kvs_rng_rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = kvs_rng_rotl(s[3], 45);
    return result;
}

#endif

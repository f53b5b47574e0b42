/* Private helpers shared by the gguf module's files (reader, writer,
 * fingerprint). Not part of the public contract. */
#ifndef KVS_GGUF_IMPL_H
#define KVS_GGUF_IMPL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf/gguf.h"

/* Little-endian loads/stores from/to unaligned bytes. */
static inline uint16_t kvs_gguf_ld16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t kvs_gguf_ld32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t kvs_gguf_ld64(const uint8_t *p)
{
    return (uint64_t)kvs_gguf_ld32(p) | ((uint64_t)kvs_gguf_ld32(p + 4) << 32);
}
static inline void kvs_gguf_st32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static inline void kvs_gguf_st64(uint8_t *p, uint64_t v)
{
    kvs_gguf_st32(p, (uint32_t)v);
    kvs_gguf_st32(p + 4, (uint32_t)(v >> 32));
}

/* Byte size of one scalar metadata value of type t (gguf-facts §1.2); 0 for
 * STRING, ARRAY and invalid ids. */
size_t kvs_gguf_scalar_size(enum kvs_gguf_type t);

/* Name of a metadata type ("UINT32"); "?" for invalid ids. */
const char *kvs_gguf_type_name(enum kvs_gguf_type t);

/* Index of the i-th KV in key order (byte-wise), for the fingerprint. */
size_t kvs_gguf_kv_sorted(const struct kvs_gguf *g, size_t i);
/* Index of the i-th tensor in name order (byte-wise). */
size_t kvs_gguf_tensor_sorted(const struct kvs_gguf *g, size_t i);

/* pad(x, n): x rounded up to a multiple of n (n a power of two). */
static inline uint64_t kvs_gguf_pad(uint64_t x, uint64_t n) { return (x + n - 1) & ~(n - 1); }

#endif

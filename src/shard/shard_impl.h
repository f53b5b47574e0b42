/* Private helpers shared by the shard module's files. */
#ifndef KVS_SHARD_IMPL_H
#define KVS_SHARD_IMPL_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "shard/shard.h"

/* printf into errbuf (NULL/0 allowed); returns err for `return seterr(...)`. */
kvs_err kvs_shard__err(kvs_err err, char *errbuf, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Builds the writer of the shard of [begin, end) of src: every KV of src
 * verbatim, then the kvasir.shard.* keys, then the tensors idx[0..n) in that
 * order. sha[i] is tensor idx[i]'s digest; if sha is NULL the tensors_sha256
 * key holds 64 '0' placeholders (same header size). content_id (32 bytes or
 * NULL) becomes KVS_SHARD_KEY_SOURCE_CONTENT_ID; src's own key of that name is
 * never copied. Tensor data pointers are taken from src when with_data, else
 * NULL. *out: free with kvs_gguf_writer_free. */
kvs_err kvs_shard__writer(const struct kvs_gguf *src, uint32_t begin, uint32_t end, const size_t *idx, size_t n,
                          const uint8_t (*sha)[32], const uint8_t *content_id, bool with_data,
                          struct kvs_gguf_writer **out,
                          char *errbuf, size_t errlen);

/* SHA-256 over the concatenated digests sha[0..n). */
kvs_err kvs_shard__digest_of_digests(const uint8_t (*sha)[32], size_t n, uint8_t out[32]);

#endif

/* GGUF v2/v3 reader and v3 writer (format: ../shared/docs/gguf-facts.md §1,
 * the GGUF specification in ggml's docs/gguf.md).
 *
 * The reader validates the whole header before handing anything out: a
 * kvs_gguf that opened successfully has every string, array, tensor info and
 * tensor byte range inside the file. All accessors are then safe and cheap.
 * Tensor data is used in place from a read-only mmap of the file; pages are
 * read only when touched, so a window that uses few tensors reads few bytes.
 */
#ifndef KVS_GGUF_H
#define KVS_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

#define KVS_GGUF_MAGIC 0x46554747u  /* "GGUF" as a little-endian u32 */
#define KVS_GGUF_DEFAULT_ALIGNMENT 32u
#define KVS_GGUF_MAX_DIMS 4
#define KVS_GGUF_MAX_NAME 64        /* tensor name length limit, bytes incl. NUL */

/* Metadata value types (GGUF v3, gguf-facts §1.2). */
enum kvs_gguf_type {
    KVS_GGUF_TYPE_UINT8 = 0,
    KVS_GGUF_TYPE_INT8 = 1,
    KVS_GGUF_TYPE_UINT16 = 2,
    KVS_GGUF_TYPE_INT16 = 3,
    KVS_GGUF_TYPE_UINT32 = 4,
    KVS_GGUF_TYPE_INT32 = 5,
    KVS_GGUF_TYPE_FLOAT32 = 6,
    KVS_GGUF_TYPE_BOOL = 7,
    KVS_GGUF_TYPE_STRING = 8,
    KVS_GGUF_TYPE_ARRAY = 9,
    KVS_GGUF_TYPE_UINT64 = 10,
    KVS_GGUF_TYPE_INT64 = 11,
    KVS_GGUF_TYPE_FLOAT64 = 12,
    KVS_GGUF_TYPE_COUNT_
};

/* Tensor element types: ggml type ids (gguf-facts §2.1). Values are the ids
 * stored in files. */
enum kvs_type {
    KVS_TYPE_F32 = 0,
    KVS_TYPE_F16 = 1,
    KVS_TYPE_Q4_0 = 2,
    KVS_TYPE_Q4_1 = 3,
    KVS_TYPE_Q5_0 = 6,
    KVS_TYPE_Q5_1 = 7,
    KVS_TYPE_Q8_0 = 8,
    KVS_TYPE_Q8_1 = 9,
    KVS_TYPE_Q2_K = 10,
    KVS_TYPE_Q3_K = 11,
    KVS_TYPE_Q4_K = 12,
    KVS_TYPE_Q5_K = 13,
    KVS_TYPE_Q6_K = 14,
    KVS_TYPE_Q8_K = 15,
    KVS_TYPE_IQ2_XXS = 16,
    KVS_TYPE_IQ2_XS = 17,
    KVS_TYPE_IQ3_XXS = 18,
    KVS_TYPE_IQ1_S = 19,
    KVS_TYPE_IQ4_NL = 20,
    KVS_TYPE_IQ3_S = 21,
    KVS_TYPE_IQ2_S = 22,
    KVS_TYPE_IQ4_XS = 23,
    KVS_TYPE_I8 = 24,
    KVS_TYPE_I16 = 25,
    KVS_TYPE_I32 = 26,
    KVS_TYPE_I64 = 27,
    KVS_TYPE_F64 = 28,
    KVS_TYPE_IQ1_M = 29,
    KVS_TYPE_BF16 = 30,
    KVS_TYPE_TQ1_0 = 34,
    KVS_TYPE_TQ2_0 = 35,
    KVS_TYPE_COUNT = 39
};

/* Block geometry of a tensor type (gguf-facts §2.1). Returns false for ids
 * that are not valid in files (4, 5, 31-33, 36-38, >= KVS_TYPE_COUNT). */
bool kvs_type_block(enum kvs_type type, uint32_t *blck_elems, uint32_t *blck_bytes);

/* Short upper-case name ("Q4_K", "F32"); "?" for invalid ids. Static string. */
const char *kvs_type_name(enum kvs_type type);

/* Bytes of a row of ne0 elements of type, or 0 if ne0 is not a multiple of
 * the block size or the type is invalid. */
size_t kvs_type_row_bytes(enum kvs_type type, int64_t ne0);

/* One tensor's info. Shapes in GGUF ne order: ne[0] is contiguous; unused
 * dims are 1. `offset` is relative to the start of the data section; `bytes`
 * is the unpadded size. `data` points into the mapping (NULL for a header
 * parsed from a buffer without its data section). */
struct kvs_gguf_tensor {
    const char *name;        /* NUL-terminated, < KVS_GGUF_MAX_NAME bytes */
    uint32_t n_dims;         /* 1..4 as stored */
    int64_t ne[KVS_GGUF_MAX_DIMS];
    enum kvs_type type;
    uint64_t offset;         /* bytes from the data section start */
    uint64_t bytes;          /* n_elements / blck_elems * blck_bytes */
    const void *data;        /* borrowed; valid until kvs_gguf_close */
};

struct kvs_gguf; /* opaque: a parsed (and possibly mapped) GGUF file */

/* Opens and validates path, mapping it read-only. On failure returns an
 * error and, if errbuf is not NULL, a message naming the problem (e.g.
 * "tensor 'blk.0.attn_q.weight': offset 4096 + 8192 bytes is past the end of
 * the data section (10000 bytes)"). *out is owned by the caller: free with
 * kvs_gguf_close. Errors: KVS_ERR_NOT_FOUND (no such file), KVS_ERR_IO,
 * KVS_ERR_FORMAT, KVS_ERR_TRUNCATED, KVS_ERR_RANGE, KVS_ERR_UNSUPPORTED,
 * KVS_ERR_NOMEM. Which problem gives which error (open and parse alike):
 *   TRUNCATED    the file ends inside the header; a count (KVs, tensors,
 *                array elements) or a string length needs more bytes than
 *                the file has left; the data section or a tensor's bytes
 *                extend past the end of the file.
 *   UNSUPPORTED  version 1, version > 3, or a byte-swapped (big-endian) file.
 *   FORMAT       bad magic; empty key or key with a NUL byte; duplicate key;
 *                unknown value type; nested array or unknown element type;
 *                general.alignment not a UINT32 nonzero power of two; tensor
 *                name empty, >= KVS_GGUF_MAX_NAME bytes or with a NUL;
 *                duplicate tensor name; n_dims 0 or > 4; a dimension <= 0;
 *                invalid tensor type id; ne[0] not a multiple of the block
 *                size; offset not a multiple of the alignment; two tensors'
 *                byte ranges overlap (gaps are allowed: only alignment is
 *                required, not llama.cpp's strict packing).
 *   RANGE        element count or byte size overflows 64 bits.
 * A data section starting past the end of the file is accepted when the file
 * has no tensors (vocab-only files are not padded). */
kvs_err kvs_gguf_open(const char *path, struct kvs_gguf **out, char *errbuf, size_t errlen);

/* Parses a GGUF header from memory: buf holds the first len bytes of a file
 * whose total size is file_size bytes (file_size >= len). Used for header-only
 * reads over HTTP and for fuzzing. If the header (KVs + tensor infos) extends
 * past len, returns KVS_ERR_NEED_MORE and sets *need (if not NULL) to a byte
 * count that is worth fetching (at least len + 1). Tensor ranges are checked
 * against file_size; tensor `data` pointers are set only where the tensor
 * lies inside buf. buf must outlive the returned object (it is borrowed, not
 * copied). With len == file_size a cut header gives KVS_ERR_TRUNCATED. A
 * prefix that does not start with "GGUF" fails at once (KVS_ERR_FORMAT).
 * Memory use is bounded by a small multiple of the bytes parsed. */
kvs_err kvs_gguf_parse(const void *buf, size_t len, uint64_t file_size, struct kvs_gguf **out,
                       size_t *need, char *errbuf, size_t errlen);

/* Frees g (NULL is allowed) and unmaps the file. */
void kvs_gguf_close(struct kvs_gguf *g);

/* GGUF version of the file (2 or 3) and its data alignment in bytes
 * (general.alignment, default 32). */
uint32_t kvs_gguf_version(const struct kvs_gguf *g);
uint32_t kvs_gguf_alignment(const struct kvs_gguf *g);
/* Absolute file offset of the data section (a multiple of the alignment). */
uint64_t kvs_gguf_data_offset(const struct kvs_gguf *g);
uint64_t kvs_gguf_file_size(const struct kvs_gguf *g);
/* The start of the mapping (or the parse buffer): byte 0 of the file. */
const uint8_t *kvs_gguf_base(const struct kvs_gguf *g);

/* --- metadata ----------------------------------------------------------- */
size_t kvs_gguf_n_kv(const struct kvs_gguf *g);
/* Index of key, or -1. */
int64_t kvs_gguf_find_key(const struct kvs_gguf *g, const char *key);
const char *kvs_gguf_key(const struct kvs_gguf *g, size_t i);         /* NUL-terminated */
enum kvs_gguf_type kvs_gguf_kv_type(const struct kvs_gguf *g, size_t i);
/* For ARRAY values: the element type and count. */
enum kvs_gguf_type kvs_gguf_arr_type(const struct kvs_gguf *g, size_t i);
uint64_t kvs_gguf_arr_n(const struct kvs_gguf *g, size_t i);

/* Typed getters by key. They return KVS_ERR_NOT_FOUND if the key is absent
 * and KVS_ERR_FORMAT if it has another type (strict, as llama.cpp is), except
 * get_u32 which also accepts a non-negative INT32/UINT16/UINT8 value, and
 * get_f32 which also accepts FLOAT64. */
kvs_err kvs_gguf_get_u32(const struct kvs_gguf *g, const char *key, uint32_t *out);
kvs_err kvs_gguf_get_i32(const struct kvs_gguf *g, const char *key, int32_t *out);
kvs_err kvs_gguf_get_u64(const struct kvs_gguf *g, const char *key, uint64_t *out);
kvs_err kvs_gguf_get_f32(const struct kvs_gguf *g, const char *key, float *out);
kvs_err kvs_gguf_get_bool(const struct kvs_gguf *g, const char *key, bool *out);
/* String value: *s is borrowed (valid until close), NOT NUL-terminated in
 * general; *len is its byte length. */
kvs_err kvs_gguf_get_str(const struct kvs_gguf *g, const char *key, const char **s, size_t *len);
/* Numeric array: *data points at n little-endian elements of elem_type,
 * packed (possibly unaligned: read with memcpy). */
kvs_err kvs_gguf_get_arr(const struct kvs_gguf *g, const char *key, enum kvs_gguf_type *elem_type,
                         uint64_t *n, const void **data);
/* Element j of a string array at KV index i: borrowed pointer + length. */
kvs_err kvs_gguf_arr_str(const struct kvs_gguf *g, size_t i, uint64_t j, const char **s, size_t *len);
/* Raw bytes of KV pair i as stored (key + type + value), for copying a pair
 * verbatim into a writer. Borrowed. */
kvs_err kvs_gguf_kv_raw(const struct kvs_gguf *g, size_t i, const uint8_t **p, size_t *len);

/* --- tensors ------------------------------------------------------------ */
size_t kvs_gguf_n_tensors(const struct kvs_gguf *g);
const struct kvs_gguf_tensor *kvs_gguf_tensor(const struct kvs_gguf *g, size_t i);
/* NULL if absent. */
const struct kvs_gguf_tensor *kvs_gguf_find_tensor(const struct kvs_gguf *g, const char *name);
/* Asks the kernel to read tensor t's pages (those of its byte range, rounded
 * out to whole pages) ahead of use. Files opened with kvs_gguf_open are
 * mapped with read-around disabled, so a window that calls this for its own
 * tensors reads those and nothing else. Advisory; no-op for parsed buffers. */
void kvs_gguf_willneed(const struct kvs_gguf *g, const struct kvs_gguf_tensor *t);

/* Model fingerprint: SHA-256 over the architecture string, every
 * `<arch>.*` hyperparameter KV, the vocabulary size, and the tensor index
 * (name, type, dims of every tensor, in name order) — not over tensor data.
 * Files that hold the same model (the full file and each of its stage shards)
 * share it: a file with the key `kvasir.shard.source_fingerprint` returns
 * that value instead. The exact byte recipe is in docs/FORMATS.md. */
kvs_err kvs_gguf_fingerprint(const struct kvs_gguf *g, uint8_t out[32]);
/* Lower-case hex of the fingerprint into hex[65] (NUL-terminated). */
void kvs_gguf_fingerprint_hex(const uint8_t fp[32], char hex[65]);

/* --- writer (GGUF v3) ----------------------------------------------------- */
struct kvs_gguf_writer; /* opaque */

/* New empty writer with alignment 32. Free with kvs_gguf_writer_free.
 * Setting (or copying) `general.alignment` changes the layout alignment; it
 * must be a UINT32 nonzero power of two, else the set returns KVS_ERR_ARG.
 * Setters return KVS_ERR_ARG for an empty key and KVS_ERR_NOMEM on
 * allocation failure. add_tensor returns KVS_ERR_ARG for a bad or duplicate
 * name, bad shape or type, or a byte count that does not match. */
struct kvs_gguf_writer *kvs_gguf_writer_create(void);
void kvs_gguf_writer_free(struct kvs_gguf_writer *w);

/* Set a KV (replacing any previous value of that key, keeping its place). */
kvs_err kvs_gguf_writer_set_u32(struct kvs_gguf_writer *w, const char *key, uint32_t v);
kvs_err kvs_gguf_writer_set_i32(struct kvs_gguf_writer *w, const char *key, int32_t v);
kvs_err kvs_gguf_writer_set_u64(struct kvs_gguf_writer *w, const char *key, uint64_t v);
kvs_err kvs_gguf_writer_set_f32(struct kvs_gguf_writer *w, const char *key, float v);
kvs_err kvs_gguf_writer_set_bool(struct kvs_gguf_writer *w, const char *key, bool v);
kvs_err kvs_gguf_writer_set_str(struct kvs_gguf_writer *w, const char *key, const char *s);
/* Numeric array of n elements of elem_type copied from data (LE packed). */
kvs_err kvs_gguf_writer_set_arr(struct kvs_gguf_writer *w, const char *key, enum kvs_gguf_type elem_type,
                                const void *data, uint64_t n);
/* String array: n NUL-terminated strings. */
kvs_err kvs_gguf_writer_set_arr_str(struct kvs_gguf_writer *w, const char *key, const char *const *strs,
                                    uint64_t n);
/* Copy KV pair i of src verbatim (any type, including string arrays). */
kvs_err kvs_gguf_writer_copy_kv(struct kvs_gguf_writer *w, const struct kvs_gguf *src, size_t i);

/* Add a tensor. Shapes in ne order; n_dims 1..4. `data` (bytes long, which
 * must equal the type's size for ne) is borrowed until the file is written;
 * it may be NULL when the caller writes tensor bytes itself (see layout).
 * Tensors are laid out in the order added, each aligned. */
kvs_err kvs_gguf_writer_add_tensor(struct kvs_gguf_writer *w, const char *name, enum kvs_type type,
                                   uint32_t n_dims, const int64_t *ne, const void *data, uint64_t bytes);

/* Header size in bytes (through the padding before the data section) and the
 * absolute file offset of tensor i (in add order). Valid after all KVs and
 * tensors are added. */
uint64_t kvs_gguf_writer_header_bytes(const struct kvs_gguf_writer *w);
uint64_t kvs_gguf_writer_tensor_offset(const struct kvs_gguf_writer *w, size_t i);
uint64_t kvs_gguf_writer_total_bytes(const struct kvs_gguf_writer *w);

/* Serialize the header (magic .. padding) into a malloc'd buffer the caller
 * frees. */
kvs_err kvs_gguf_writer_header(const struct kvs_gguf_writer *w, uint8_t **buf, size_t *len);

/* Write the whole file (header + every tensor with non-NULL data; tensors
 * with NULL data are left as zero bytes / holes). Writes to path.tmp and
 * renames on success. */
kvs_err kvs_gguf_writer_write_file(const struct kvs_gguf_writer *w, const char *path);

#endif

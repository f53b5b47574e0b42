/* Stage shards: a stage's mini-GGUF, its extraction from a full model, the
 * shard index, window-only download over HTTP range requests, and the seed
 * server that serves model files with ranges.
 *
 * A shard for the window [begin, end) of a model with n_block blocks is a
 * valid GGUF v3 file holding
 *   - every metadata KV of the source, copied verbatim (so `<arch>.block_count`
 *     stays the SOURCE's n_block), plus the kvasir.shard.* keys below;
 *   - only the tensors the window needs (kvs_shard_window_tensors), with their
 *     ORIGINAL names (blk.N keeps the source's N) and bytes copied unchanged,
 *     in source order, each aligned to the source's alignment.
 * The model loader therefore loads a window of a shard exactly like the same
 * window of the full file. A shard's fingerprint (kvs_gguf_fingerprint) is the
 * source's, read from kvasir.shard.source_fingerprint.
 *
 * Formats (shard keys, index JSON, fetch state file): docs/FORMATS.md,
 * section "Shard index" and "Stage shards".
 */
#ifndef KVS_SHARD_H
#define KVS_SHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "gguf/gguf.h"

/* Metadata keys a shard carries (types in parentheses). */
#define KVS_SHARD_KEY_WINDOW_BEGIN "kvasir.shard.window_begin"             /* u32 */
#define KVS_SHARD_KEY_WINDOW_END "kvasir.shard.window_end"                 /* u32, exclusive */
#define KVS_SHARD_KEY_SOURCE_BLOCK_COUNT "kvasir.shard.source_block_count" /* u32 */
#define KVS_SHARD_KEY_SOURCE_FINGERPRINT "kvasir.shard.source_fingerprint" /* string, 64 hex */
/* string, 64 lower-case hex: SHA-256 over the concatenated 32-byte SHA-256
 * digests of the shard's tensors' data (unpadded bytes), in the shard's tensor
 * order (= source order). */
#define KVS_SHARD_KEY_TENSORS_SHA256 "kvasir.shard.tensors_sha256"
/* string, 64 lower-case hex: the source's content id (kvs_shard_content_id),
 * present only when the shard's maker knew it (extract: always; fetch: when
 * the tensors were verified against an index). Never copied from a source
 * file's metadata. */
#define KVS_SHARD_KEY_SOURCE_CONTENT_ID "kvasir.shard.source_content_id"

/* Upper bound on a GGUF header fetched over HTTP (KVs + tensor infos): the
 * largest real headers (262k-token vocabularies with merges) are ~20 MiB. */
#define KVS_SHARD_MAX_HEADER (64ull * 1024 * 1024)
/* Upper bound on a shard index fetched over HTTP for a model of n tensors: an
 * entry is < 400 bytes of JSON (name < 64, 4 dims, two offsets, 64 hex). */
#define KVS_SHARD_INDEX_MAX_BYTES(n) (65536ull + 1024ull * (uint64_t)(n))

/* --- windows ------------------------------------------------------------- */

/* The model's main block count, the ring's: `<arch>.block_count` minus
 * `<arch>.nextn_predict_layers` (MTP blocks stored after the main ones,
 * absent = 0; they belong to no window) where arch is general.architecture.
 * Errors: KVS_ERR_NOT_FOUND / KVS_ERR_FORMAT (also: nextn >= block_count). */
kvs_err kvs_shard_block_count(const struct kvs_gguf *g, uint32_t *n_block);

/* Which tensors of g the window [begin, end) needs, as indices into g
 * (kvs_gguf_tensor), ascending (file order). A tensor is needed if it is
 *   - blk.N.<anything> with begin <= N < end (so never an MTP block N >= n_block);
 *   - named token_embd.* and begin == 0 (head);
 *   - named output.* / output_norm.* and end == n_block (tail);
 *   - token_embd.weight when end == n_block and g has no output.weight (tied);
 *   - any other tensor that is not blk.N.* (e.g. rope_freqs.weight): every stage.
 * n_block is kvs_shard_block_count(g) (a shard keeps the source's). Requires
 * begin < end <= n_block. *idx is malloc'd (caller frees; NULL when *n == 0).
 * Errors: KVS_ERR_RANGE (bad window), KVS_ERR_NOT_FOUND/FORMAT (no block
 * count), KVS_ERR_NOMEM. errbuf (may be NULL) gets a message. */
kvs_err kvs_shard_window_tensors(const struct kvs_gguf *g, uint32_t begin, uint32_t end, size_t **idx,
                                 size_t *n, char *errbuf, size_t errlen);

/* Whether g can serve the window [begin, end): KVS_OK if g is a full model
 * (no kvasir.shard.* keys) with begin < end <= n_block, or a shard whose window
 * [b, e) covers [begin, end) (b <= begin, end <= e) and which holds every
 * tensor the window needs. Errors: KVS_ERR_MISMATCH (the shard holds another
 * window; the message names both, e.g. "shard holds blocks [0,2) but the
 * stage needs [1,3)"), KVS_ERR_RANGE (window outside the model),
 * KVS_ERR_NOT_FOUND (a needed tensor is missing), KVS_ERR_FORMAT (bad shard
 * keys). */
kvs_err kvs_shard_check(const struct kvs_gguf *g, uint32_t begin, uint32_t end, char *errbuf, size_t errlen);

/* Reads a shard's window. Returns false (and leaves the outputs alone) if g is
 * not a shard (no/invalid kvasir.shard.window_* keys). */
bool kvs_shard_window(const struct kvs_gguf *g, uint32_t *begin, uint32_t *end);

/* One line saying which window a shard holds, for `kvasir gguf info`:
 * "window [2,4) of 4 source blocks (tail: output norm + LM head)" (head:
 * "token embedding"; a shard of the whole model is both). KVS_ERR_NOT_FOUND if
 * g has no kvasir.shard.window_* key (not a shard; buf ""), KVS_ERR_FORMAT if
 * the keys are invalid or disagree with each other (buf says how). */
kvs_err kvs_shard_describe(const struct kvs_gguf *g, char *buf, size_t cap);

/* Parses "BEGIN:END" (decimal, BEGIN < END) into a window. KVS_ERR_ARG if bad. */
kvs_err kvs_shard_parse_window(const char *s, uint32_t *begin, uint32_t *end);

/* --- extract --------------------------------------------------------------- */

/* Writes the shard of window [begin, end) of src (full model or a covering
 * shard) to out_path (written to out_path.tmp, then renamed: no partial file
 * is left under out_path on failure). Tensor bytes are copied from src's
 * mapping. Errors: as kvs_shard_check, KVS_ERR_IO, KVS_ERR_NOMEM. */
kvs_err kvs_shard_extract(const struct kvs_gguf *src, uint32_t begin, uint32_t end, const char *out_path,
                          char *errbuf, size_t errlen);

/* --- index ----------------------------------------------------------------- */

/* One tensor of an index: absolute file offset, unpadded size, SHA-256. */
struct kvs_shard_index_entry {
    char name[KVS_GGUF_MAX_NAME];
    enum kvs_type type;
    uint32_t n_dims;
    int64_t ne[KVS_GGUF_MAX_DIMS];
    uint64_t offset; /* absolute byte offset in the file */
    uint64_t size;   /* bytes */
    uint8_t sha256[32];
};

struct kvs_shard_index {
    char fingerprint[65];   /* hex, NUL-terminated */
    uint64_t file_size;
    uint64_t data_offset;
    uint32_t alignment;
    uint8_t metadata_sha256[32]; /* kvs_shard_metadata_digest of the file's header */
    size_t n_tensors;
    struct kvs_shard_index_entry *tensors; /* [n_tensors], owned */
};

/* Builds the index of g (hashes every tensor's bytes from the mapping).
 * Free with kvs_shard_index_free. Errors: KVS_ERR_NOMEM, KVS_ERR_ARG (g has no
 * tensor data, e.g. a header parsed from a buffer). */
kvs_err kvs_shard_index_build(const struct kvs_gguf *g, struct kvs_shard_index *ix, char *errbuf, size_t errlen);
/* Writes ix as JSON (format: docs/FORMATS.md "Shard index") to path. */
kvs_err kvs_shard_index_save(const struct kvs_shard_index *ix, const char *path, char *errbuf, size_t errlen);
/* Parses an index from JSON text (len bytes, need not be NUL-terminated).
 * Errors: KVS_ERR_FORMAT (malformed; message names the field), KVS_ERR_RANGE,
 * KVS_ERR_NOMEM. At most KVS_SHARD_INDEX_MAX_TENSORS tensors. */
#define KVS_SHARD_INDEX_MAX_TENSORS 1000000u
kvs_err kvs_shard_index_parse(const char *text, size_t len, struct kvs_shard_index *ix, char *errbuf,
                              size_t errlen);
/* Reads the file at path (at most KVS_SHARD_INDEX_MAX_TENSORS * 512 bytes,
 * else KVS_ERR_RANGE) and parses it as kvs_shard_index_parse does. Free ix
 * with kvs_shard_index_free. Errors: those of the parser, KVS_ERR_IO. */
kvs_err kvs_shard_index_load(const char *path, struct kvs_shard_index *ix, char *errbuf, size_t errlen);
/* Entry named name, or NULL. */
const struct kvs_shard_index_entry *kvs_shard_index_find(const struct kvs_shard_index *ix, const char *name);
/* Frees the tensors array and zeroes ix. NULL allowed. */
void kvs_shard_index_free(struct kvs_shard_index *ix);

/* --- content id ------------------------------------------------------------- */

/* The content id of a model (docs/FORMATS.md "Content id"): SHA-256 of
 *   "kvasir-content-v2" || fingerprint (32 bytes) || metadata digest (32) ||
 *   u64le n_tensors || SHA-256(data of tensor) for every tensor in byte-wise
 *   name order
 * (data = the tensor's unpadded bytes). Unlike the fingerprint (shapes) it
 * changes with any weight, any token string or score, the chat template, or
 * any hyperparameter. */

/* The metadata digest: SHA-256 over the concatenated raw bytes of every
 * metadata KV pair as the GGUF stores it (u64 key length, key, u32 type,
 * value; kvs_gguf_kv_raw) whose key does not start with "kvasir.", the pairs
 * in byte-wise key order. A shard (which copies its source's KVs verbatim and
 * adds kvasir.shard.*) has its source's digest. Works on a header parsed from
 * a buffer. Errors: KVS_ERR_ARG (NULL), KVS_ERR_NOMEM, KVS_ERR_INTERNAL. */
kvs_err kvs_shard_metadata_digest(const struct kvs_gguf *g, uint8_t out[32]);

/* From an index (its fingerprint and per-tensor digests; no file is read).
 * Errors: KVS_ERR_FORMAT (bad fingerprint hex, two entries of one name),
 * KVS_ERR_NOMEM. */
kvs_err kvs_shard_index_content_id(const struct kvs_shard_index *ix, uint8_t out[32]);
/* Of a model file: a shard's recorded KVS_SHARD_KEY_SOURCE_CONTENT_ID, or for
 * a full model the hash of every tensor's mapped bytes (reads the whole data
 * section: ~1.5 GB/s with SHA extensions). Errors: KVS_ERR_NOT_FOUND (a shard
 * that records none), KVS_ERR_FORMAT (bad key), KVS_ERR_ARG (no tensor data:
 * a header parsed from a buffer), KVS_ERR_NOMEM. */
kvs_err kvs_shard_content_id(const struct kvs_gguf *g, uint8_t out[32], char *errbuf, size_t errlen);

/* --- fetch ----------------------------------------------------------------- */

struct kvs_shard_fetch_params {
    const char *url;         /* the full model's URL (http[s]://...); redirects are followed */
    uint32_t begin, end;     /* window; begin == end == 0: every block (n_block from the header) */
    const char *out_path;    /* STAGE.gguf; work files: out_path.part, out_path.part.state */
    const char *index;       /* optional: index URL or file path; NULL = no hash check */
    const char *content_id;  /* optional: the trusted content id (64 hex, from a manifest or a market
                              * listing): the index must have it, and an index is then required */
    bool index_optional;     /* an index URL answering 404 means "no index" (logged), not an error */
    uint64_t limit_rate;     /* bytes/s, 0 = unlimited (tests use it to kill mid-way) */
    uint64_t initial_header; /* first header read, bytes; 0 = 1 MiB */
    int progress;            /* -1 auto (bar on a TTY), 0 none, 1 lines */
    const char *const *headers; /* n_headers extra request headers ("Name: value", e.g. an
                                 * Authorization token), sent with every request (model and index);
                                 * never logged. curl does not resend them to another host or port
                                 * after a redirect (a CDN gets the signed URL only). */
    size_t n_headers;
    uint64_t low_speed_limit; /* bytes/s; a transfer below it for low_speed_time fails (0 = 1024) */
    uint32_t low_speed_time;  /* seconds (0 = 15); header and index requests also have a 120 s deadline */
};
struct kvs_shard_fetch_params kvs_shard_fetch_default_params(void);

/* What a fetch did (all byte counts are response-body bytes received). */
struct kvs_shard_fetch_stats {
    uint64_t header_bytes;   /* bytes read for the source header */
    uint64_t data_bytes;     /* bytes of tensor ranges received in this run (incl. padding) */
    uint64_t header_reused_bytes; /* tensor bytes taken from the header read */
    uint64_t window_bytes;   /* sum of the window's tensor sizes */
    uint64_t skipped_bytes;  /* tensor bytes already done by an earlier run */
    uint32_t n_requests;     /* HTTP requests made */
    uint32_t n_tensors;      /* tensors in the shard */
    uint32_t n_resumed;      /* tensors skipped as already done */
    bool verified;           /* every tensor matched the index */
    bool trusted;            /* ... and the index matched params.content_id */
    char content_id[65];     /* the index's content id (hex), "" without an index */
};

/* Downloads the shard of [begin, end) of the model at url: reads the header
 * with range requests (growing geometrically while kvs_gguf_parse says
 * NEED_MORE), then only the window's tensor ranges (adjacent ones coalesced
 * when the gap is at most the alignment), and writes the same file as
 * kvs_shard_extract would. Resumable: a rerun after an interruption skips the
 * tensors the state file marks done (if the source's size and ETag are
 * unchanged). On success out_path exists and the work files are gone; on
 * failure out_path is not created. A finished out_path (same window and
 * model, header bytes and tensor digests intact) is kept without a download.
 * stats may be NULL.
 * Errors: KVS_ERR_NET (connection/HTTP status; server ignores Range),
 * KVS_ERR_NOT_FOUND (the index URL answers 404, unless index_optional),
 * KVS_ERR_MISMATCH (ETag/size changed mid-fetch, index of another model or of
 * other weights than params.content_id), KVS_ERR_NOT_FOUND also when a
 * content id is given but there is no index, KVS_ERR_RANGE (a header over
 * KVS_SHARD_MAX_HEADER, an index over KVS_SHARD_INDEX_MAX_BYTES of the
 * source's tensor count), KVS_ERR_NET also for a transfer below the low-speed
 * limit or past a deadline,
 * KVS_ERR_HASH (tensor hash differs from the index), KVS_ERR_TRUNCATED (short
 * response), KVS_ERR_FORMAT (corrupt header), KVS_ERR_IO, KVS_ERR_NOMEM. */
kvs_err kvs_shard_fetch(const struct kvs_shard_fetch_params *p, struct kvs_shard_fetch_stats *stats,
                        char *errbuf, size_t errlen);

/* --- seed server ------------------------------------------------------------- */

struct kvs_seed_params {
    const char *dir;      /* folder whose *.gguf files are served (borrowed until stop) */
    const char *bind;     /* IPv4 address, default "127.0.0.1" */
    uint16_t port;        /* 0 = any free port (see kvs_seed_port) */
    bool no_ranges;       /* test mode: ignore Range and always answer 200 */
};
struct kvs_seed_params kvs_seed_default_params(void);

struct kvs_seed; /* opaque: a running server (own threads) */

/* Starts serving: GET/HEAD /<name>.gguf (single byte range: 206 with
 * Content-Range; unsatisfiable, malformed or multi-range -> 416), ETag
 * "<size hex>-<mtime ns hex>", GET /models (JSON list of
 * {name, size, fingerprint, etag}), GET /stats ({bytes_served, requests}).
 * Errors: KVS_ERR_ARG, KVS_ERR_NET (bind failed), KVS_ERR_NOMEM. */
kvs_err kvs_seed_start(const struct kvs_seed_params *p, struct kvs_seed **out, char *errbuf, size_t errlen);
/* The bound TCP port. */
uint16_t kvs_seed_port(const struct kvs_seed *s);
/* Response-body bytes handed to the network so far. Thread-safe. */
uint64_t kvs_seed_bytes_served(const struct kvs_seed *s);
/* Stops the server, joins its threads, frees s (NULL allowed). */
void kvs_seed_stop(struct kvs_seed *s);

/* --- helpers ------------------------------------------------------------------ */

/* SHA-256 of n bytes (OpenSSL EVP). */
kvs_err kvs_shard_sha256(const void *data, size_t n, uint8_t out[32]);
/* Lower-case hex of a 32-byte digest into hex[65]; and back (false if bad). */
void kvs_shard_hex(const uint8_t d[32], char hex[65]);
bool kvs_shard_unhex(const char *hex, size_t len, uint8_t d[32]);

#endif

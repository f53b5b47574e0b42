/* Kvasir's one error vocabulary. Every fallible function in every module
 * returns a kvs_err (or NULL/-1 with a kvs_err out-parameter); detail text is
 * kept on the object that failed (e.g. kvs_gguf_last_error), never in globals. */
#ifndef KVS_COMMON_ERROR_H
#define KVS_COMMON_ERROR_H

typedef enum kvs_err {
    KVS_OK = 0,
    KVS_ERR_ARG,          /* invalid argument (programmer or user input) */
    KVS_ERR_NOMEM,        /* allocation failed or a size cap was exceeded */
    KVS_ERR_IO,           /* read/write/open/mmap failed (errno kept in detail) */
    KVS_ERR_FORMAT,       /* malformed input: file, frame, JSON, manifest */
    KVS_ERR_TRUNCATED,    /* input ended early */
    KVS_ERR_NEED_MORE,    /* incremental parser: feed more bytes (not a failure) */
    KVS_ERR_RANGE,        /* a count, length, offset or index is out of bounds */
    KVS_ERR_UNSUPPORTED,  /* valid but not implemented: tensor type, arch, version */
    KVS_ERR_NOT_FOUND,    /* key, tensor, file or sequence not present */
    KVS_ERR_MISMATCH,     /* wrong model / window / version at the other end */
    KVS_ERR_HASH,         /* checksum or SHA-256 mismatch */
    KVS_ERR_NET,          /* connect/accept/HTTP failure */
    KVS_ERR_PEER,         /* the peer closed, died or sent an error frame */
    KVS_ERR_TIMEOUT,      /* a bounded wait ran out */
    KVS_ERR_CANCELLED,    /* the request was cancelled */
    KVS_ERR_FULL,         /* no free slot (KV cache, sequences, context) */
    KVS_ERR_INFEASIBLE,   /* planner: no placement satisfies the constraints */
    KVS_ERR_INTERNAL,     /* invariant broken: a bug */
    KVS_ERR_NUMERIC,      /* NaN or infinity in a computed result (corrupt weights or input) */
    KVS_ERR_COUNT_
} kvs_err;

/* Returns a static, human-readable description of err ("ok" for KVS_OK).
 * Never NULL; unknown values give "unknown error". */
const char *kvs_strerror(kvs_err err);

#endif

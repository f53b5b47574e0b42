#include "common/error.h"

const char *kvs_strerror(kvs_err err)
{
    switch (err) {
    case KVS_OK: return "ok";
    case KVS_ERR_ARG: return "invalid argument";
    case KVS_ERR_NOMEM: return "out of memory or size limit exceeded";
    case KVS_ERR_IO: return "I/O error";
    case KVS_ERR_FORMAT: return "malformed input";
    case KVS_ERR_TRUNCATED: return "input truncated";
    case KVS_ERR_NEED_MORE: return "more input needed";
    case KVS_ERR_RANGE: return "value out of range";
    case KVS_ERR_UNSUPPORTED: return "unsupported";
    case KVS_ERR_NOT_FOUND: return "not found";
    case KVS_ERR_MISMATCH: return "mismatch (model, window or version)";
    case KVS_ERR_HASH: return "hash mismatch";
    case KVS_ERR_NET: return "network error";
    case KVS_ERR_PEER: return "peer failed or closed the link";
    case KVS_ERR_TIMEOUT: return "timed out";
    case KVS_ERR_CANCELLED: return "cancelled";
    case KVS_ERR_FULL: return "no free slot";
    case KVS_ERR_INFEASIBLE: return "infeasible";
    case KVS_ERR_INTERNAL: return "internal error";
    case KVS_ERR_NUMERIC: return "non-finite values (NaN or infinity) in the result";
    case KVS_ERR_COUNT_: break;
    }
    return "unknown error";
}

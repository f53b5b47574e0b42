/* The ring protocol: frame encoding and an incremental decoder. No I/O.
 *
 * Normative description: docs/PROTOCOL.md (section numbers below refer to
 * it). Every frame is a fixed 24-byte little-endian header (§2) followed by
 * payload_len bytes whose layout depends on the kind (§3). The decoder takes
 * any chunk of bytes and answers OK (a whole frame is ready) / NEED_MORE /
 * an error; it bounds every length before it buffers anything, so a peer can
 * never make it allocate more than the cap given at creation.
 */
#ifndef KVS_PROTO_H
#define KVS_PROTO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

#define KVS_PROTO_MAGIC 0x5253564Bu        /* bytes "KVSR" read as a little-endian u32 */
#define KVS_PROTO_VERSION 3u
#define KVS_PROTO_HEADER_BYTES 24u
#define KVS_PROTO_MAX_PAYLOAD (256u << 20) /* global cap on payload_len, bytes (§2) */
#define KVS_PROTO_MAX_TOKENS 65536u        /* cap on n_tokens of any frame (§2) */
#define KVS_PROTO_MAX_STOP 16u             /* stop (end-of-generation) ids per request */
#define KVS_PROTO_MAX_ERRMSG 1024u         /* bytes of an ERROR message */
#define KVS_PROTO_HELLO_BYTES 96u          /* HELLO payload (§3.1) */
#define KVS_PROTO_REQ_FIXED_BYTES 40u      /* REQUEST_START fixed part (§3.2) */
#define KVS_PROTO_TOKEN_BYTES 8u           /* TOKEN payload (§3.5) */
#define KVS_PROTO_TRAIL_REC_BYTES 56u      /* one record of a probe trail (§3.8.1, revision 1.1) */
#define KVS_PROTO_MAX_TRAIL 64u            /* records in a probe trail (n_tokens of a TRAIL probe) */
#define KVS_PROTO_MAX_LIVE 65536u          /* request ids in a LIVE keepalive (§3.8.2, rev 3.2) */
#define KVS_PROTO_LEAVE_BYTES 12u          /* LEAVE payload (§3.9, rev 3.3) */

enum kvs_frame_kind {
    KVS_FRAME_HELLO = 1,
    KVS_FRAME_REQUEST_START = 2,
    KVS_FRAME_PREFILL = 3,
    KVS_FRAME_DECODE = 4,
    KVS_FRAME_TOKEN = 5,
    KVS_FRAME_END = 6,
    KVS_FRAME_CANCEL = 7,
    KVS_FRAME_ERROR = 8,
    KVS_FRAME_KEEPALIVE = 9,
    KVS_FRAME_LEAVE = 10, /* rev 3.3: a planned leave (§5.2) */
    KVS_FRAME_KIND_COUNT_
};

/* Header flag bits (§2.2). Each kind allows only some of them. */
enum kvs_frame_flag {
    KVS_FRAME_FLAG_F32 = 1u << 0,        /* PREFILL/DECODE: boundary is F32 (else F16) */
    KVS_FRAME_FLAG_LAST = 1u << 1,       /* PREFILL: last chunk of the prompt */
    KVS_FRAME_FLAG_PROBE = 1u << 2,      /* KEEPALIVE: ring probe (forwarded around) */
    KVS_FRAME_FLAG_IGNORE_EOS = 1u << 3, /* REQUEST_START: do not stop on stop ids */
    KVS_FRAME_FLAG_FINISHED = 1u << 4,   /* TOKEN: the request is complete */
    KVS_FRAME_FLAG_TRAIL = 1u << 5,      /* KEEPALIVE with PROBE: carries a trail of stage records (rev 1.1) */
    KVS_FRAME_FLAG_REPLAY = 1u << 6,     /* REQUEST_START: a replay after a fault (rev 3.1): a stage that still
                                          * holds the request id frees that slot and starts it afresh */
    KVS_FRAME_FLAG_LIVE = 1u << 7,       /* KEEPALIVE, not with PROBE: the head's live request ids (rev 3.2) */
};

/* Roles in a HELLO (§3.1). */
enum kvs_hello_role {
    KVS_HELLO_ROLE_PRED = 1, /* sent by the dialing side: "I am your predecessor" */
    KVS_HELLO_ROLE_SUCC = 2, /* sent back by the accepting side */
};

/* Why a request finished (TOKEN payload, §3.5). */
enum kvs_finish {
    KVS_FINISH_NONE = 0,   /* not finished */
    KVS_FINISH_STOP = 1,   /* a stop id (end of generation) was sampled */
    KVS_FINISH_LENGTH = 2, /* max_tokens generated or context full */
};

/* The fixed header, decoded (§2). */
struct kvs_frame_header {
    uint16_t version;     /* KVS_PROTO_VERSION */
    uint8_t kind;         /* enum kvs_frame_kind */
    uint8_t flags;        /* enum kvs_frame_flag bits */
    uint32_t req;         /* request id; 0 = the link itself */
    uint32_t pos;         /* position of the first token (PREFILL/TOKEN), probe number (KEEPALIVE) */
    uint32_t n_tokens;    /* token (row) count */
    uint32_t payload_len; /* bytes after the header */
};

/* A decoded frame: the header and its payload, borrowed from the decoder
 * (valid until the next feed/reset on that decoder). */
struct kvs_frame {
    struct kvs_frame_header h;
    const uint8_t *payload;
};

/* HELLO payload (§3.1). */
struct kvs_hello {
    uint8_t fingerprint[32]; /* kvs_gguf_fingerprint of the model served */
    uint32_t n_block;        /* blocks of the whole model */
    uint32_t block_begin;    /* sender's window [begin, end) */
    uint32_t block_end;
    uint32_t n_embd;         /* boundary width */
    uint32_t role;           /* enum kvs_hello_role */
    uint32_t n_ctx;          /* sender's positions per sequence */
    uint32_t n_seq;          /* sender's sequence slots */
    uint32_t n_batch;        /* sender's most rows per forward / PREFILL frame (version 3) */
    uint8_t content_id[32];  /* the model's content id (docs/FORMATS.md "Content id"); all zero =
                              * unknown (a shard fetched without an index) (version 3) */
};

/* REQUEST_START fixed fields (§3.2); prompt ids and stop ids follow. */
struct kvs_req_params {
    float temp;
    int32_t top_k;
    float top_p;
    float min_p;
    float repeat_penalty;
    int32_t repeat_last_n;
    uint64_t seed;
    uint32_t max_tokens;          /* tokens to generate, >= 1 */
    bool ignore_eos;              /* carried in the header flag */
    uint32_t n_stop;              /* <= KVS_PROTO_MAX_STOP */
    int32_t stop[KVS_PROTO_MAX_STOP];
};

/* LEAVE phases (§3.9). */
enum kvs_leave_phase {
    KVS_LEAVE_ASK = 1,   /* from the leaving stage, downstream to the head: its replacement is ready, drain it */
    KVS_LEAVE_DRAIN = 2, /* the head's answer, downstream to the leaving stage: the head sent nothing after it */
};

/* LEAVE payload (§3.9): the leaving stage's window and the phase. */
struct kvs_leave {
    uint32_t block_begin, block_end; /* begin < end */
    uint32_t phase;                  /* enum kvs_leave_phase */
};

/* TOKEN payload (§3.5). */
struct kvs_token_msg {
    int32_t token;
    uint32_t finish; /* enum kvs_finish */
};

/* One record of a probe trail (§3.8.1): what one stage adds to a TRAIL
 * probe as it passes. Counters are cumulative since the stage started; the
 * timestamps are the stage's wall clock (CLOCK_REALTIME) in microseconds
 * since the Unix epoch, so hop latencies between two hosts are only as good
 * as their clock sync (exact on one host). */
struct kvs_trail_rec {
    uint32_t block_begin, block_end; /* the stage's window */
    uint64_t forward_calls;          /* kvs_model_forward calls */
    uint64_t forward_us;             /* microseconds spent in them */
    uint64_t rows;                   /* prefill + decode rows run through the window */
    uint64_t bytes_out;              /* bytes written on its out link (frames incl. headers) */
    uint64_t t_recv_us;              /* when the stage read the probe (the head: when it sent it) */
    uint64_t t_send_us;              /* when it wrote the probe on */
};

/* --- encoding ------------------------------------------------------------ */

/* Writes the 24-byte header for h into out (h->version is ignored: the
 * current version is written). */
void kvs_proto_put_header(uint8_t out[KVS_PROTO_HEADER_BYTES], const struct kvs_frame_header *h);

/* Payload writers. Each writes exactly the documented number of bytes. */
void kvs_proto_put_hello(uint8_t out[KVS_PROTO_HELLO_BYTES], const struct kvs_hello *m);
/* Writes the REQUEST_START payload: fixed part, n_stop stop ids, then n_prompt
 * prompt ids. out must hold kvs_proto_req_bytes(p->n_stop, n_prompt). */
size_t kvs_proto_req_bytes(uint32_t n_stop, uint32_t n_prompt);
void kvs_proto_put_req(uint8_t *out, const struct kvs_req_params *p, const int32_t *prompt, uint32_t n_prompt);
void kvs_proto_put_token(uint8_t out[KVS_PROTO_TOKEN_BYTES], const struct kvs_token_msg *m);
void kvs_proto_put_leave(uint8_t out[KVS_PROTO_LEAVE_BYTES], const struct kvs_leave *m);
/* ERROR payload: code (u32) then the message bytes (truncated to
 * KVS_PROTO_MAX_ERRMSG). out must hold 4 + KVS_PROTO_MAX_ERRMSG bytes.
 * Returns the payload length. */
size_t kvs_proto_put_error(uint8_t *out, uint32_t code, const char *msg);

/* Boundary rows: n values of x written as F16 (round to nearest even) or F32
 * little-endian. Returns bytes written (2n or 4n). */
size_t kvs_proto_put_boundary(uint8_t *out, const float *x, size_t n, bool f32);
/* Reads n boundary values (F16 or F32) into x. */
void kvs_proto_get_boundary(float *x, const uint8_t *in, size_t n, bool f32);

/* Payload byte count of a PREFILL (n_tokens rows) or DECODE (n_tokens rows
 * with a 8-byte (req, pos) prefix each) frame for width n_embd. 0 on
 * overflow. */
uint64_t kvs_proto_prefill_bytes(uint32_t n_tokens, uint32_t n_embd, bool f32);
uint64_t kvs_proto_decode_bytes(uint32_t n_tokens, uint32_t n_embd, bool f32);

/* F16 <-> F32 (IEEE 754 binary16; f32->f16 rounds to nearest even). */
uint16_t kvs_proto_f32_to_f16(float f);
float kvs_proto_f16_to_f32(uint16_t h);

/* Writes one trail record (KVS_PROTO_TRAIL_REC_BYTES bytes). */
void kvs_proto_put_trail_rec(uint8_t out[KVS_PROTO_TRAIL_REC_BYTES], const struct kvs_trail_rec *r);
/* Reads record i (< n_tokens) of a TRAIL probe frame. */
void kvs_proto_get_trail_rec(const struct kvs_frame *f, uint32_t i, struct kvs_trail_rec *r);

/* --- decoding payloads (of a frame the decoder accepted) ------------------- */

/* Each getter reads a frame of its kind that the decoder accepted. */
void kvs_proto_get_hello(const struct kvs_frame *f, struct kvs_hello *m);
/* Fills p; *prompt points at n_tokens little-endian i32 prompt ids inside the
 * payload (possibly unaligned: read them with kvs_proto_get_i32). */
void kvs_proto_get_req(const struct kvs_frame *f, struct kvs_req_params *p, const uint8_t **prompt);
void kvs_proto_get_token(const struct kvs_frame *f, struct kvs_token_msg *m);
void kvs_proto_get_leave(const struct kvs_frame *f, struct kvs_leave *m);
/* *code and a NUL-terminated copy of the message in msg[cap]. */
void kvs_proto_get_error(const struct kvs_frame *f, uint32_t *code, char *msg, size_t cap);
/* DECODE row i: request id and position. */
void kvs_proto_get_decode_row(const struct kvs_frame *f, uint32_t i, uint32_t *req, uint32_t *pos);
/* Start of the boundary values of a PREFILL/DECODE frame. */
const uint8_t *kvs_proto_boundary(const struct kvs_frame *f);

/* Little-endian 4-byte fields at p (any alignment). */
uint32_t kvs_proto_get_u32(const uint8_t *p);
int32_t kvs_proto_get_i32(const uint8_t *p);
void kvs_proto_put_u32(uint8_t *p, uint32_t v);

/* --- incremental decoder -------------------------------------------------- */

struct kvs_proto_decoder; /* opaque */

/* max_payload: largest payload accepted (clamped to KVS_PROTO_MAX_PAYLOAD);
 * the decoder allocates it lazily, at most once per growth. n_embd: boundary
 * width used to check PREFILL/DECODE lengths exactly; 0 = not known yet (then
 * only divisibility by the row count is checked). Free with
 * kvs_proto_decoder_free (NULL allowed). Returns NULL on allocation failure. */
struct kvs_proto_decoder *kvs_proto_decoder_create(uint32_t max_payload, uint32_t n_embd);
void kvs_proto_decoder_free(struct kvs_proto_decoder *d);
void kvs_proto_decoder_set_n_embd(struct kvs_proto_decoder *d, uint32_t n_embd);
/* Forget any partial frame (e.g. after the link was replaced). */
void kvs_proto_decoder_reset(struct kvs_proto_decoder *d);

/* Feeds up to len bytes. Sets *used to the bytes consumed (always all of them
 * unless a frame completed or an error occurred). Returns:
 *  KVS_OK: a frame is complete: read it with kvs_proto_decoder_frame, then
 *          feed the rest (data + *used); the next feed starts a new frame;
 *  KVS_ERR_NEED_MORE: all bytes consumed, no frame complete yet;
 *  KVS_ERR_FORMAT: bad magic, unknown kind, flags not allowed for the kind,
 *          or a payload whose content is inconsistent (e.g. n_stop);
 *  KVS_ERR_UNSUPPORTED: another protocol version;
 *  KVS_ERR_RANGE: payload_len or n_tokens over the caps, or a payload length
 *          that does not match the kind and token count.
 * After an error the decoder stays failed (every feed returns the same
 * error) until reset; kvs_proto_decoder_error says what was wrong. */
kvs_err kvs_proto_decoder_feed(struct kvs_proto_decoder *d, const uint8_t *data, size_t len, size_t *used);
/* The frame completed by the last KVS_OK feed. */
const struct kvs_frame *kvs_proto_decoder_frame(const struct kvs_proto_decoder *d);
/* Message for the last error ("" if none). Static until the next call. */
const char *kvs_proto_decoder_error(const struct kvs_proto_decoder *d);

/* Checks a header alone (as the decoder does once 24 bytes are in), with the
 * same errors; n_embd 0 = unknown. errbuf may be NULL. */
kvs_err kvs_proto_check_header(const struct kvs_frame_header *h, uint32_t max_payload, uint32_t n_embd,
                               char *errbuf, size_t errlen);

/* Name of a kind ("HELLO", ...; "?" for unknown). */
const char *kvs_frame_kind_name(uint32_t kind);

#endif

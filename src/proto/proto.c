/* Frame encoding and the incremental decoder. Layouts: docs/PROTOCOL.md. */
#include "proto/proto.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static_assert(KVS_PROTO_HEADER_BYTES == 24, "PROTOCOL.md §2: the header is 24 bytes");
static_assert(KVS_PROTO_HELLO_BYTES == 32 + 8 * 4 + 32, "PROTOCOL.md §3.1");
static_assert(KVS_PROTO_REQ_FIXED_BYTES == 10 * 4, "PROTOCOL.md §3.2");
static_assert(KVS_FRAME_KIND_COUNT_ == 11, "PROTOCOL.md §3: kinds 1..10");

/* --- little-endian helpers ------------------------------------------------ */

uint32_t kvs_proto_get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int32_t kvs_proto_get_i32(const uint8_t *p)
{
    uint32_t u = kvs_proto_get_u32(p);
    int32_t v;
    memcpy(&v, &u, 4);
    return v;
}

void kvs_proto_put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

static void put_i32(uint8_t *p, int32_t v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    kvs_proto_put_u32(p, u);
}

static void put_f32(uint8_t *p, float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    kvs_proto_put_u32(p, u);
}

static float get_f32(const uint8_t *p)
{
    uint32_t u = kvs_proto_get_u32(p);
    float v;
    memcpy(&v, &u, 4);
    return v;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    kvs_proto_put_u32(p, (uint32_t)v);
    kvs_proto_put_u32(p + 4, (uint32_t)(v >> 32));
}

static uint64_t get_u64(const uint8_t *p)
{
    return (uint64_t)kvs_proto_get_u32(p) | (uint64_t)kvs_proto_get_u32(p + 4) << 32;
}

/* --- F16 ------------------------------------------------------------------ */

uint16_t kvs_proto_f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t exp = (x >> 23) & 0xffu;
    uint32_t man = x & 0x7fffffu;
    if (exp == 0xff) /* inf / NaN (NaN stays NaN: keep a mantissa bit) */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | (man >> 13) : 0));
    int32_t e = (int32_t)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u); /* overflow -> inf */
    if (e <= 0) {                                   /* subnormal or zero */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        uint32_t shift = (uint32_t)(14 - e);
        uint32_t h = man >> shift;
        uint32_t rem = man & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = (uint32_t)e << 10 | man >> 13;
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++; /* may carry into exp: correct */
    return (uint16_t)(sign | h);
}

float kvs_proto_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t x;
    if (exp == 0) {
        if (man == 0) {
            x = sign;
        } else { /* subnormal: normalize */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            x = sign | (uint32_t)(127 - 15 - e) << 23 | (man & 0x3ffu) << 13;
        }
    } else if (exp == 31) {
        x = sign | 0x7f800000u | man << 13;
    } else {
        x = sign | (exp + 127 - 15) << 23 | man << 13;
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

/* --- encoding --------------------------------------------------------------- */

void kvs_proto_put_header(uint8_t out[KVS_PROTO_HEADER_BYTES], const struct kvs_frame_header *h)
{
    kvs_proto_put_u32(out, KVS_PROTO_MAGIC);
    put_u16(out + 4, KVS_PROTO_VERSION);
    out[6] = h->kind;
    out[7] = h->flags;
    kvs_proto_put_u32(out + 8, h->req);
    kvs_proto_put_u32(out + 12, h->pos);
    kvs_proto_put_u32(out + 16, h->n_tokens);
    kvs_proto_put_u32(out + 20, h->payload_len);
}

void kvs_proto_put_hello(uint8_t out[KVS_PROTO_HELLO_BYTES], const struct kvs_hello *m)
{
    memcpy(out, m->fingerprint, 32);
    kvs_proto_put_u32(out + 32, m->n_block);
    kvs_proto_put_u32(out + 36, m->block_begin);
    kvs_proto_put_u32(out + 40, m->block_end);
    kvs_proto_put_u32(out + 44, m->n_embd);
    kvs_proto_put_u32(out + 48, m->role);
    kvs_proto_put_u32(out + 52, m->n_ctx);
    kvs_proto_put_u32(out + 56, m->n_seq);
    kvs_proto_put_u32(out + 60, m->n_batch);
    memcpy(out + 64, m->content_id, 32);
}

void kvs_proto_get_hello(const struct kvs_frame *f, struct kvs_hello *m)
{
    const uint8_t *p = f->payload;
    memcpy(m->fingerprint, p, 32);
    m->n_block = kvs_proto_get_u32(p + 32);
    m->block_begin = kvs_proto_get_u32(p + 36);
    m->block_end = kvs_proto_get_u32(p + 40);
    m->n_embd = kvs_proto_get_u32(p + 44);
    m->role = kvs_proto_get_u32(p + 48);
    m->n_ctx = kvs_proto_get_u32(p + 52);
    m->n_seq = kvs_proto_get_u32(p + 56);
    m->n_batch = kvs_proto_get_u32(p + 60);
    memcpy(m->content_id, p + 64, 32);
}

size_t kvs_proto_req_bytes(uint32_t n_stop, uint32_t n_prompt)
{
    return KVS_PROTO_REQ_FIXED_BYTES + 4 * (size_t)n_stop + 4 * (size_t)n_prompt;
}

void kvs_proto_put_req(uint8_t *out, const struct kvs_req_params *p, const int32_t *prompt, uint32_t n_prompt)
{
    put_f32(out + 0, p->temp);
    put_i32(out + 4, p->top_k);
    put_f32(out + 8, p->top_p);
    put_f32(out + 12, p->min_p);
    put_f32(out + 16, p->repeat_penalty);
    put_i32(out + 20, p->repeat_last_n);
    put_u64(out + 24, p->seed);
    kvs_proto_put_u32(out + 32, p->max_tokens);
    uint32_t n_stop = p->n_stop > KVS_PROTO_MAX_STOP ? KVS_PROTO_MAX_STOP : p->n_stop;
    kvs_proto_put_u32(out + 36, n_stop);
    uint8_t *q = out + KVS_PROTO_REQ_FIXED_BYTES;
    for (uint32_t i = 0; i < n_stop; i++, q += 4) put_i32(q, p->stop[i]);
    for (uint32_t i = 0; i < n_prompt; i++, q += 4) put_i32(q, prompt[i]);
}

void kvs_proto_get_req(const struct kvs_frame *f, struct kvs_req_params *p, const uint8_t **prompt)
{
    const uint8_t *in = f->payload;
    memset(p, 0, sizeof *p);
    p->temp = get_f32(in + 0);
    p->top_k = kvs_proto_get_i32(in + 4);
    p->top_p = get_f32(in + 8);
    p->min_p = get_f32(in + 12);
    p->repeat_penalty = get_f32(in + 16);
    p->repeat_last_n = kvs_proto_get_i32(in + 20);
    p->seed = get_u64(in + 24);
    p->max_tokens = kvs_proto_get_u32(in + 32);
    p->n_stop = kvs_proto_get_u32(in + 36); /* checked by the decoder */
    if (p->n_stop > KVS_PROTO_MAX_STOP) p->n_stop = KVS_PROTO_MAX_STOP;
    p->ignore_eos = (f->h.flags & KVS_FRAME_FLAG_IGNORE_EOS) != 0;
    const uint8_t *q = in + KVS_PROTO_REQ_FIXED_BYTES;
    for (uint32_t i = 0; i < p->n_stop; i++, q += 4) p->stop[i] = kvs_proto_get_i32(q);
    *prompt = q;
}

void kvs_proto_put_token(uint8_t out[KVS_PROTO_TOKEN_BYTES], const struct kvs_token_msg *m)
{
    put_i32(out, m->token);
    kvs_proto_put_u32(out + 4, m->finish);
}

void kvs_proto_get_token(const struct kvs_frame *f, struct kvs_token_msg *m)
{
    m->token = kvs_proto_get_i32(f->payload);
    m->finish = kvs_proto_get_u32(f->payload + 4);
}

void kvs_proto_put_leave(uint8_t out[KVS_PROTO_LEAVE_BYTES], const struct kvs_leave *m)
{
    kvs_proto_put_u32(out, m->block_begin);
    kvs_proto_put_u32(out + 4, m->block_end);
    kvs_proto_put_u32(out + 8, m->phase);
}

void kvs_proto_get_leave(const struct kvs_frame *f, struct kvs_leave *m)
{
    m->block_begin = kvs_proto_get_u32(f->payload);
    m->block_end = kvs_proto_get_u32(f->payload + 4);
    m->phase = kvs_proto_get_u32(f->payload + 8);
}

size_t kvs_proto_put_error(uint8_t *out, uint32_t code, const char *msg)
{
    size_t n = msg ? strlen(msg) : 0;
    if (n > KVS_PROTO_MAX_ERRMSG) n = KVS_PROTO_MAX_ERRMSG;
    kvs_proto_put_u32(out, code);
    if (n) memcpy(out + 4, msg, n);
    return 4 + n;
}

void kvs_proto_get_error(const struct kvs_frame *f, uint32_t *code, char *msg, size_t cap)
{
    *code = kvs_proto_get_u32(f->payload);
    size_t n = f->h.payload_len - 4;
    if (cap == 0) return;
    if (n > cap - 1) n = cap - 1;
    memcpy(msg, f->payload + 4, n);
    msg[n] = '\0';
}

size_t kvs_proto_put_boundary(uint8_t *out, const float *x, size_t n, bool f32)
{
    if (f32) {
        for (size_t i = 0; i < n; i++) put_f32(out + 4 * i, x[i]);
        return 4 * n;
    }
    for (size_t i = 0; i < n; i++) put_u16(out + 2 * i, kvs_proto_f32_to_f16(x[i]));
    return 2 * n;
}

void kvs_proto_get_boundary(float *x, const uint8_t *in, size_t n, bool f32)
{
    if (f32)
        for (size_t i = 0; i < n; i++) x[i] = get_f32(in + 4 * i);
    else
        for (size_t i = 0; i < n; i++) x[i] = kvs_proto_f16_to_f32(get_u16(in + 2 * i));
}

uint64_t kvs_proto_prefill_bytes(uint32_t n_tokens, uint32_t n_embd, bool f32)
{
    uint64_t cells = (uint64_t)n_tokens * n_embd; /* < 2^64 */
    if (cells > UINT64_MAX / 8) return 0;
    return cells * (f32 ? 4u : 2u);
}

uint64_t kvs_proto_decode_bytes(uint32_t n_tokens, uint32_t n_embd, bool f32)
{
    uint64_t rows = kvs_proto_prefill_bytes(n_tokens, n_embd, f32);
    if (rows == 0 && n_tokens && n_embd) return 0;
    return (uint64_t)n_tokens * 8u + rows;
}

void kvs_proto_get_decode_row(const struct kvs_frame *f, uint32_t i, uint32_t *req, uint32_t *pos)
{
    *req = kvs_proto_get_u32(f->payload + 8 * (size_t)i);
    *pos = kvs_proto_get_u32(f->payload + 8 * (size_t)i + 4);
}

const uint8_t *kvs_proto_boundary(const struct kvs_frame *f)
{
    if (f->h.kind == KVS_FRAME_DECODE) return f->payload + 8 * (size_t)f->h.n_tokens;
    return f->payload;
}

void kvs_proto_put_trail_rec(uint8_t out[KVS_PROTO_TRAIL_REC_BYTES], const struct kvs_trail_rec *r)
{
    kvs_proto_put_u32(out, r->block_begin);
    kvs_proto_put_u32(out + 4, r->block_end);
    put_u64(out + 8, r->forward_calls);
    put_u64(out + 16, r->forward_us);
    put_u64(out + 24, r->rows);
    put_u64(out + 32, r->bytes_out);
    put_u64(out + 40, r->t_recv_us);
    put_u64(out + 48, r->t_send_us);
}

void kvs_proto_get_trail_rec(const struct kvs_frame *f, uint32_t i, struct kvs_trail_rec *r)
{
    const uint8_t *p = f->payload + (size_t)i * KVS_PROTO_TRAIL_REC_BYTES;
    r->block_begin = kvs_proto_get_u32(p);
    r->block_end = kvs_proto_get_u32(p + 4);
    r->forward_calls = get_u64(p + 8);
    r->forward_us = get_u64(p + 16);
    r->rows = get_u64(p + 24);
    r->bytes_out = get_u64(p + 32);
    r->t_recv_us = get_u64(p + 40);
    r->t_send_us = get_u64(p + 48);
}

const char *kvs_frame_kind_name(uint32_t kind)
{
    static const char *const names[] = { "?",      "HELLO", "REQUEST_START", "PREFILL", "DECODE",
                                         "TOKEN",  "END",   "CANCEL",        "ERROR",   "KEEPALIVE", "LEAVE" };
    return kind < KVS_FRAME_KIND_COUNT_ ? names[kind] : "?";
}

/* --- header checks (PROTOCOL.md §2.3) --------------------------------------- */

#define FAIL(code, ...)                                                                                    \
    do {                                                                                                   \
        if (errbuf && errlen) snprintf(errbuf, errlen, __VA_ARGS__);                                       \
        return code;                                                                                       \
    } while (0)

kvs_err kvs_proto_check_header(const struct kvs_frame_header *h, uint32_t max_payload, uint32_t n_embd,
                               char *errbuf, size_t errlen)
{
    static const uint8_t allowed_flags[KVS_FRAME_KIND_COUNT_] = {
        [KVS_FRAME_HELLO] = 0,
        [KVS_FRAME_REQUEST_START] = KVS_FRAME_FLAG_IGNORE_EOS | KVS_FRAME_FLAG_REPLAY,
        [KVS_FRAME_PREFILL] = KVS_FRAME_FLAG_F32 | KVS_FRAME_FLAG_LAST,
        [KVS_FRAME_DECODE] = KVS_FRAME_FLAG_F32,
        [KVS_FRAME_TOKEN] = KVS_FRAME_FLAG_FINISHED,
        [KVS_FRAME_END] = 0,
        [KVS_FRAME_CANCEL] = 0,
        [KVS_FRAME_ERROR] = 0,
        [KVS_FRAME_KEEPALIVE] = KVS_FRAME_FLAG_PROBE | KVS_FRAME_FLAG_TRAIL | KVS_FRAME_FLAG_LIVE,
        [KVS_FRAME_LEAVE] = 0,
    };
    if (max_payload == 0 || max_payload > KVS_PROTO_MAX_PAYLOAD) max_payload = KVS_PROTO_MAX_PAYLOAD;
    if (h->version != KVS_PROTO_VERSION)
        FAIL(KVS_ERR_UNSUPPORTED, "protocol version %u, this build speaks %u", h->version, KVS_PROTO_VERSION);
    if (h->kind == 0 || h->kind >= KVS_FRAME_KIND_COUNT_) FAIL(KVS_ERR_FORMAT, "unknown frame kind %u", h->kind);
    const char *kn = kvs_frame_kind_name(h->kind);
    if (h->flags & ~allowed_flags[h->kind])
        FAIL(KVS_ERR_FORMAT, "%s frame with flags 0x%02x not allowed (allowed 0x%02x)", kn, h->flags,
             allowed_flags[h->kind]);
    if (h->payload_len > max_payload)
        FAIL(KVS_ERR_RANGE, "%s payload of %u bytes exceeds the cap of %u", kn, h->payload_len, max_payload);
    if (h->n_tokens > KVS_PROTO_MAX_TOKENS)
        FAIL(KVS_ERR_RANGE, "%s token count %u exceeds the cap of %u", kn, h->n_tokens, KVS_PROTO_MAX_TOKENS);
    bool f32 = (h->flags & KVS_FRAME_FLAG_F32) != 0;
    uint32_t n = h->n_tokens, len = h->payload_len;
    uint64_t want = 0;
    switch ((enum kvs_frame_kind)h->kind) {
    case KVS_FRAME_KEEPALIVE:
        if (h->flags & KVS_FRAME_FLAG_TRAIL) { /* §3.8.1 */
            if (!(h->flags & KVS_FRAME_FLAG_PROBE)) FAIL(KVS_ERR_FORMAT, "KEEPALIVE with TRAIL but without PROBE");
            if (n > KVS_PROTO_MAX_TRAIL)
                FAIL(KVS_ERR_RANGE, "probe trail of %u records exceeds the cap of %u", n, KVS_PROTO_MAX_TRAIL);
            want = (uint64_t)n * KVS_PROTO_TRAIL_REC_BYTES;
            break;
        }
        if (h->flags & KVS_FRAME_FLAG_LIVE) { /* §3.8.2 */
            if (h->flags & KVS_FRAME_FLAG_PROBE) FAIL(KVS_ERR_FORMAT, "KEEPALIVE with both LIVE and PROBE");
            if (n > KVS_PROTO_MAX_LIVE)
                FAIL(KVS_ERR_RANGE, "live set of %u request ids exceeds the cap of %u", n, KVS_PROTO_MAX_LIVE);
            want = 4ull * n;
            break;
        }
        if (n != 0) FAIL(KVS_ERR_RANGE, "%s frame with token count %u (must be 0)", kn, n);
        break;
    case KVS_FRAME_HELLO:
    case KVS_FRAME_END:
    case KVS_FRAME_CANCEL:
        want = h->kind == KVS_FRAME_HELLO ? KVS_PROTO_HELLO_BYTES : 0;
        if (n != 0) FAIL(KVS_ERR_RANGE, "%s frame with token count %u (must be 0)", kn, n);
        break;
    case KVS_FRAME_LEAVE: /* §3.9 */
        if (n != 0) FAIL(KVS_ERR_RANGE, "%s frame with token count %u (must be 0)", kn, n);
        want = KVS_PROTO_LEAVE_BYTES;
        break;
    case KVS_FRAME_TOKEN:
        if (n != 1) FAIL(KVS_ERR_RANGE, "TOKEN frame with token count %u (must be 1)", n);
        want = KVS_PROTO_TOKEN_BYTES;
        break;
    case KVS_FRAME_ERROR:
        if (n != 0) FAIL(KVS_ERR_RANGE, "ERROR frame with token count %u (must be 0)", n);
        if (len < 4 || len > 4 + KVS_PROTO_MAX_ERRMSG)
            FAIL(KVS_ERR_RANGE, "ERROR payload of %u bytes (must be 4..%u)", len, 4 + KVS_PROTO_MAX_ERRMSG);
        want = len;
        break;
    case KVS_FRAME_REQUEST_START: {
        if (n == 0) FAIL(KVS_ERR_RANGE, "REQUEST_START with an empty prompt");
        uint64_t base = KVS_PROTO_REQ_FIXED_BYTES + 4ull * n;
        if (len < base || (len - base) % 4 != 0 || (len - base) / 4 > KVS_PROTO_MAX_STOP)
            FAIL(KVS_ERR_RANGE, "REQUEST_START payload of %u bytes does not fit %u prompt ids (%llu + 4 x n_stop)",
                 len, n, (unsigned long long)base);
        want = len;
        break;
    }
    case KVS_FRAME_PREFILL:
    case KVS_FRAME_DECODE: {
        if (n == 0) FAIL(KVS_ERR_RANGE, "%s frame with no rows", kn);
        bool dec = h->kind == KVS_FRAME_DECODE;
        if (n_embd) {
            want = dec ? kvs_proto_decode_bytes(n, n_embd, f32) : kvs_proto_prefill_bytes(n, n_embd, f32);
        } else {
            uint64_t pre = dec ? 8ull * n : 0, row = (uint64_t)n * (f32 ? 4 : 2);
            if (len <= pre || (len - pre) % row != 0)
                FAIL(KVS_ERR_RANGE, "%s payload of %u bytes is not %u whole rows", kn, len, n);
            want = len;
        }
        break;
    }
    case KVS_FRAME_KIND_COUNT_:
        break;
    }
    if (want != len)
        FAIL(KVS_ERR_RANGE, "%s payload of %u bytes, expected %llu for %u tokens", kn, len, (unsigned long long)want, n);
    bool needs_req = h->kind == KVS_FRAME_REQUEST_START || h->kind == KVS_FRAME_PREFILL ||
                     h->kind == KVS_FRAME_TOKEN || h->kind == KVS_FRAME_END || h->kind == KVS_FRAME_CANCEL;
    bool no_req = h->kind == KVS_FRAME_HELLO || h->kind == KVS_FRAME_KEEPALIVE || h->kind == KVS_FRAME_DECODE ||
                  h->kind == KVS_FRAME_LEAVE;
    if (needs_req && h->req == 0) FAIL(KVS_ERR_FORMAT, "%s frame without a request id", kn);
    if (no_req && h->req != 0) FAIL(KVS_ERR_FORMAT, "%s frame with request id %u (must be 0)", kn, h->req);
    if (errbuf && errlen) errbuf[0] = '\0';
    return KVS_OK;
}

/* --- decoder ---------------------------------------------------------------- */

struct kvs_proto_decoder {
    uint32_t max_payload;
    uint32_t n_embd;
    uint8_t hdr[KVS_PROTO_HEADER_BYTES];
    size_t n_hdr;         /* header bytes held */
    size_t n_payload;     /* payload bytes held */
    uint8_t *buf;         /* payload buffer */
    size_t cap;           /* its size */
    bool ready;           /* a frame is complete and not yet consumed */
    kvs_err failed;       /* sticky error */
    struct kvs_frame frame;
    char err[256];
};

struct kvs_proto_decoder *kvs_proto_decoder_create(uint32_t max_payload, uint32_t n_embd)
{
    struct kvs_proto_decoder *d = calloc(1, sizeof *d);
    if (!d) return NULL;
    d->max_payload = (max_payload == 0 || max_payload > KVS_PROTO_MAX_PAYLOAD) ? KVS_PROTO_MAX_PAYLOAD : max_payload;
    d->n_embd = n_embd;
    return d;
}

void kvs_proto_decoder_free(struct kvs_proto_decoder *d)
{
    if (!d) return;
    free(d->buf);
    free(d);
}

void kvs_proto_decoder_set_n_embd(struct kvs_proto_decoder *d, uint32_t n_embd)
{
    d->n_embd = n_embd;
}

void kvs_proto_decoder_reset(struct kvs_proto_decoder *d)
{
    d->n_hdr = 0;
    d->n_payload = 0;
    d->ready = false;
    d->failed = KVS_OK;
    d->err[0] = '\0';
}

static kvs_err dec_fail(struct kvs_proto_decoder *d, kvs_err e)
{
    d->failed = e;
    return e;
}

/* Content checks that need the payload (PROTOCOL.md §3). */
static kvs_err check_payload(struct kvs_proto_decoder *d)
{
    const struct kvs_frame_header *h = &d->frame.h;
    if (h->kind == KVS_FRAME_REQUEST_START) {
        uint32_t n_stop = kvs_proto_get_u32(d->buf + 36);
        if (n_stop > KVS_PROTO_MAX_STOP || kvs_proto_req_bytes(n_stop, h->n_tokens) != h->payload_len) {
            snprintf(d->err, sizeof d->err, "REQUEST_START n_stop %u does not match its payload of %u bytes", n_stop,
                     h->payload_len);
            return KVS_ERR_FORMAT;
        }
    } else if (h->kind == KVS_FRAME_LEAVE) { /* §3.9 */
        uint32_t b = kvs_proto_get_u32(d->buf), e = kvs_proto_get_u32(d->buf + 4), ph = kvs_proto_get_u32(d->buf + 8);
        if (b >= e || (ph != KVS_LEAVE_ASK && ph != KVS_LEAVE_DRAIN)) {
            snprintf(d->err, sizeof d->err, "LEAVE with window [%u,%u) and phase %u (need begin < end, phase 1 or 2)",
                     b, e, ph);
            return KVS_ERR_FORMAT;
        }
    } else if (h->kind == KVS_FRAME_HELLO) {
        uint32_t role = kvs_proto_get_u32(d->buf + 48);
        if (role != KVS_HELLO_ROLE_PRED && role != KVS_HELLO_ROLE_SUCC) {
            snprintf(d->err, sizeof d->err, "HELLO with unknown role %u", role);
            return KVS_ERR_FORMAT;
        }
    }
    return KVS_OK;
}

kvs_err kvs_proto_decoder_feed(struct kvs_proto_decoder *d, const uint8_t *data, size_t len, size_t *used)
{
    size_t off = 0;
    *used = 0;
    if (d->failed) return d->failed;
    if (d->ready) { /* the previous frame was read: start a new one */
        d->ready = false;
        d->n_hdr = 0;
        d->n_payload = 0;
    }
    while (off < len) {
        if (d->n_hdr < KVS_PROTO_HEADER_BYTES) {
            size_t take = KVS_PROTO_HEADER_BYTES - d->n_hdr;
            if (take > len - off) take = len - off;
            memcpy(d->hdr + d->n_hdr, data + off, take);
            /* Check the magic as soon as its bytes are in: garbage fails fast. */
            for (size_t i = d->n_hdr; i < d->n_hdr + take && i < 4; i++)
                if (d->hdr[i] != (uint8_t)(KVS_PROTO_MAGIC >> (8 * i))) {
                    *used = off + (i - d->n_hdr) + 1;
                    snprintf(d->err, sizeof d->err, "bad magic byte 0x%02x at offset %zu (expected \"KVSR\")",
                             d->hdr[i], i);
                    return dec_fail(d, KVS_ERR_FORMAT);
                }
            d->n_hdr += take;
            off += take;
            if (d->n_hdr < KVS_PROTO_HEADER_BYTES) break;
            struct kvs_frame_header *h = &d->frame.h;
            h->version = get_u16(d->hdr + 4);
            h->kind = d->hdr[6];
            h->flags = d->hdr[7];
            h->req = kvs_proto_get_u32(d->hdr + 8);
            h->pos = kvs_proto_get_u32(d->hdr + 12);
            h->n_tokens = kvs_proto_get_u32(d->hdr + 16);
            h->payload_len = kvs_proto_get_u32(d->hdr + 20);
            kvs_err e = kvs_proto_check_header(h, d->max_payload, d->n_embd, d->err, sizeof d->err);
            if (e) {
                *used = off;
                return dec_fail(d, e);
            }
            if (h->payload_len > d->cap) { /* bounded by max_payload above */
                uint8_t *nb = realloc(d->buf, h->payload_len);
                if (!nb) {
                    *used = off;
                    snprintf(d->err, sizeof d->err, "cannot allocate a payload of %u bytes", h->payload_len);
                    return dec_fail(d, KVS_ERR_NOMEM);
                }
                d->buf = nb;
                d->cap = h->payload_len;
            }
            d->n_payload = 0;
        }
        size_t want = d->frame.h.payload_len - d->n_payload;
        size_t take = want < len - off ? want : len - off;
        if (take) memcpy(d->buf + d->n_payload, data + off, take);
        d->n_payload += take;
        off += take;
        if (d->n_payload == d->frame.h.payload_len) {
            d->frame.payload = d->buf;
            *used = off;
            kvs_err e = check_payload(d);
            if (e) return dec_fail(d, e);
            d->ready = true;
            return KVS_OK;
        }
    }
    *used = off;
    return KVS_ERR_NEED_MORE;
}

const struct kvs_frame *kvs_proto_decoder_frame(const struct kvs_proto_decoder *d)
{
    return d->ready ? &d->frame : NULL;
}

const char *kvs_proto_decoder_error(const struct kvs_proto_decoder *d)
{
    return d->err;
}

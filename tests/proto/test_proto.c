/* Frame codec tests: round trips, byte-by-byte feeding, bad frames, and the
 * worked examples of docs/PROTOCOL.md §6 (read from the document). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/error.h"
#include "proto/proto.h"

/* Builds header + payload into out; returns total length. */
static size_t build(uint8_t *out, uint8_t kind, uint8_t flags, uint32_t req, uint32_t pos, uint32_t n_tokens,
                    const uint8_t *payload, uint32_t len)
{
    struct kvs_frame_header h = { .kind = kind, .flags = flags, .req = req, .pos = pos, .n_tokens = n_tokens,
                                  .payload_len = len };
    kvs_proto_put_header(out, &h);
    if (len) memcpy(out + KVS_PROTO_HEADER_BYTES, payload, len);
    return KVS_PROTO_HEADER_BYTES + len;
}

/* Feeds buf whole; expects exactly one frame using all bytes. */
static const struct kvs_frame *decode_whole(struct kvs_proto_decoder *d, const uint8_t *buf, size_t n)
{
    size_t used = 0;
    assert_int_equal(kvs_proto_decoder_feed(d, buf, n, &used), KVS_OK);
    assert_int_equal(used, n);
    return kvs_proto_decoder_frame(d);
}

/* Feeds one byte at a time: NEED_MORE until the last byte. */
static const struct kvs_frame *decode_bytewise(struct kvs_proto_decoder *d, const uint8_t *buf, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        size_t used = 0;
        kvs_err e = kvs_proto_decoder_feed(d, buf + i, 1, &used);
        assert_int_equal(used, 1);
        if (i + 1 < n) {
            assert_int_equal(e, KVS_ERR_NEED_MORE);
            assert_null(kvs_proto_decoder_frame(d));
        } else {
            assert_int_equal(e, KVS_OK);
        }
    }
    return kvs_proto_decoder_frame(d);
}

static void test_f16(void **state)
{
    (void)state;
    /* IEEE binary16 values by hand. */
    assert_int_equal(kvs_proto_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(kvs_proto_f32_to_f16(-2.0f), 0xc000);
    assert_int_equal(kvs_proto_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(kvs_proto_f32_to_f16(65520.0f), 0x7c00);     /* rounds up to inf */
    assert_int_equal(kvs_proto_f32_to_f16(5.9604645e-8f), 0x0001); /* smallest subnormal 2^-24 */
    assert_int_equal(kvs_proto_f32_to_f16(1.0f + 1.0f / 2048), 0x3c00); /* tie -> even */
    assert_int_equal(kvs_proto_f32_to_f16(1.0f + 3.0f / 2048), 0x3c02); /* tie -> even (up) */
    assert_true(kvs_proto_f16_to_f32(0x0001) == 5.9604645e-8f);
    assert_true(kvs_proto_f16_to_f32(0x3555) == 0.333251953125f);
    assert_true(kvs_proto_f16_to_f32(0xfc00) < -1e30f);
    /* Every finite F16 survives F16 -> F32 -> F16. */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        assert_int_equal(kvs_proto_f32_to_f16(kvs_proto_f16_to_f32((uint16_t)h)), h);
    }
}

static void test_roundtrip_all_kinds(void **state)
{
    (void)state;
    enum { N_EMBD = 6 };
    uint8_t buf[4096], pay[2048];
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(4096, N_EMBD);
    struct kvs_proto_decoder *b = kvs_proto_decoder_create(4096, N_EMBD);
    assert_non_null(d);

    /* HELLO */
    struct kvs_hello he = { .n_block = 12, .block_begin = 4, .block_end = 8, .n_embd = N_EMBD,
                            .role = KVS_HELLO_ROLE_SUCC, .n_ctx = 2048, .n_seq = 3, .n_batch = 256 };
    for (int i = 0; i < 32; i++) he.fingerprint[i] = (uint8_t)(0xa0 + i);
    for (int i = 0; i < 32; i++) he.content_id[i] = (uint8_t)(0x40 + i);
    kvs_proto_put_hello(pay, &he);
    size_t n = build(buf, KVS_FRAME_HELLO, 0, 0, 0, 0, pay, KVS_PROTO_HELLO_BYTES);
    assert_int_equal(n, 120);
    assert_int_equal(pay[64], 0x40); /* content id at offset 64 (§3.1) */
    const struct kvs_frame *f = decode_whole(d, buf, n);
    const struct kvs_frame *g = decode_bytewise(b, buf, n);
    struct kvs_hello h2, h3;
    kvs_proto_get_hello(f, &h2);
    kvs_proto_get_hello(g, &h3);
    assert_memory_equal(&h2, &he, sizeof he);
    assert_memory_equal(&h3, &he, sizeof he);

    /* REQUEST_START with two stop ids and a 5-token prompt, IGNORE_EOS */
    struct kvs_req_params rp = { .temp = 0.7f, .top_k = 20, .top_p = 0.9f, .min_p = 0.1f, .repeat_penalty = 1.1f,
                                 .repeat_last_n = 32, .seed = 0x1122334455667788ull, .max_tokens = 99,
                                 .n_stop = 2, .stop = { 2, 151645 } };
    int32_t prompt[5] = { 1, -1, 31999, 0, 77 };
    size_t rl = kvs_proto_req_bytes(2, 5);
    assert_int_equal(rl, 40 + 8 + 20);
    kvs_proto_put_req(pay, &rp, prompt, 5);
    n = build(buf, KVS_FRAME_REQUEST_START, KVS_FRAME_FLAG_IGNORE_EOS, 42, 0, 5, pay, (uint32_t)rl);
    f = decode_whole(d, buf, n);
    g = decode_bytewise(b, buf, n);
    assert_int_equal(f->h.req, 42);
    struct kvs_req_params r2;
    const uint8_t *pp;
    kvs_proto_get_req(g, &r2, &pp);
    assert_true(r2.ignore_eos);
    assert_true(r2.temp == 0.7f && r2.top_p == 0.9f && r2.min_p == 0.1f && r2.repeat_penalty == 1.1f);
    assert_int_equal(r2.top_k, 20);
    assert_int_equal(r2.repeat_last_n, 32);
    assert_true(r2.seed == 0x1122334455667788ull);
    assert_int_equal(r2.max_tokens, 99);
    assert_int_equal(r2.n_stop, 2);
    assert_int_equal(r2.stop[1], 151645);
    for (int i = 0; i < 5; i++) assert_int_equal(kvs_proto_get_i32(pp + 4 * i), prompt[i]);

    /* PREFILL F16 and F32: 3 rows of N_EMBD values exactly representable in F16 */
    float x[3 * N_EMBD], y[3 * N_EMBD];
    for (int i = 0; i < 3 * N_EMBD; i++) x[i] = (float)(i - 9) * 0.25f;
    for (int f32 = 0; f32 < 2; f32++) {
        size_t bl = kvs_proto_put_boundary(pay, x, 3 * N_EMBD, f32);
        assert_int_equal(bl, 3 * N_EMBD * (f32 ? 4 : 2));
        assert_int_equal(bl, kvs_proto_prefill_bytes(3, N_EMBD, f32));
        uint8_t fl = (uint8_t)(KVS_FRAME_FLAG_LAST | (f32 ? KVS_FRAME_FLAG_F32 : 0));
        n = build(buf, KVS_FRAME_PREFILL, fl, 5, 17, 3, pay, (uint32_t)bl);
        f = decode_whole(d, buf, n);
        g = decode_bytewise(b, buf, n);
        assert_int_equal(g->h.pos, 17);
        assert_int_equal(g->h.flags, fl);
        kvs_proto_get_boundary(y, kvs_proto_boundary(g), 3 * N_EMBD, f32);
        assert_memory_equal(x, y, sizeof x);
    }

    /* DECODE: 2 rows of different requests */
    kvs_proto_put_u32(pay, 5);
    kvs_proto_put_u32(pay + 4, 20);
    kvs_proto_put_u32(pay + 8, 6);
    kvs_proto_put_u32(pay + 12, 3);
    size_t bl = kvs_proto_put_boundary(pay + 16, x, 2 * N_EMBD, false);
    assert_int_equal(16 + bl, kvs_proto_decode_bytes(2, N_EMBD, false));
    n = build(buf, KVS_FRAME_DECODE, 0, 0, 0, 2, pay, (uint32_t)(16 + bl));
    f = decode_whole(d, buf, n);
    g = decode_bytewise(b, buf, n);
    uint32_t rq, ps;
    kvs_proto_get_decode_row(g, 1, &rq, &ps);
    assert_int_equal(rq, 6);
    assert_int_equal(ps, 3);
    kvs_proto_get_boundary(y, kvs_proto_boundary(g), 2 * N_EMBD, false);
    assert_memory_equal(x, y, 2 * N_EMBD * sizeof(float));

    /* TOKEN */
    struct kvs_token_msg tm = { .token = 151643, .finish = KVS_FINISH_LENGTH }, t2;
    kvs_proto_put_token(pay, &tm);
    n = build(buf, KVS_FRAME_TOKEN, KVS_FRAME_FLAG_FINISHED, 9, 33, 1, pay, 8);
    g = decode_bytewise(b, buf, n);
    kvs_proto_get_token(g, &t2);
    assert_int_equal(t2.token, 151643);
    assert_int_equal(t2.finish, KVS_FINISH_LENGTH);

    /* END, CANCEL, KEEPALIVE: header only */
    n = build(buf, KVS_FRAME_END, 0, 9, 0, 0, NULL, 0);
    assert_int_equal(n, 24);
    assert_int_equal(decode_bytewise(b, buf, n)->h.kind, KVS_FRAME_END);
    n = build(buf, KVS_FRAME_CANCEL, 0, 9, 0, 0, NULL, 0);
    assert_int_equal(decode_whole(d, buf, n)->h.kind, KVS_FRAME_CANCEL);
    n = build(buf, KVS_FRAME_KEEPALIVE, KVS_FRAME_FLAG_PROBE, 0, 77, 0, NULL, 0);
    g = decode_bytewise(b, buf, n);
    assert_int_equal(g->h.pos, 77);

    /* LEAVE (§3.9) */
    struct kvs_leave lv = { .block_begin = 2, .block_end = 3, .phase = KVS_LEAVE_DRAIN }, lv2;
    kvs_proto_put_leave(pay, &lv);
    n = build(buf, KVS_FRAME_LEAVE, 0, 0, 0, 0, pay, KVS_PROTO_LEAVE_BYTES);
    assert_int_equal(n, 36);
    g = decode_bytewise(b, buf, n);
    assert_int_equal(g->h.kind, KVS_FRAME_LEAVE);
    kvs_proto_get_leave(g, &lv2);
    assert_true(lv2.block_begin == 2 && lv2.block_end == 3 && lv2.phase == KVS_LEAVE_DRAIN);
    assert_string_equal(kvs_frame_kind_name(KVS_FRAME_LEAVE), "LEAVE");

    /* ERROR */
    size_t el = kvs_proto_put_error(pay, KVS_ERR_MISMATCH, "window [0,2) is not adjacent to [3,4)");
    assert_int_equal(el, 4 + 37);
    n = build(buf, KVS_FRAME_ERROR, 0, 0, 0, 0, pay, (uint32_t)el);
    g = decode_bytewise(b, buf, n);
    uint32_t code;
    char msg[64];
    kvs_proto_get_error(g, &code, msg, sizeof msg);
    assert_int_equal(code, KVS_ERR_MISMATCH);
    assert_string_equal(msg, "window [0,2) is not adjacent to [3,4)");

    kvs_proto_decoder_free(d);
    kvs_proto_decoder_free(b);
}

/* Several frames in one chunk: each feed stops after one frame. */
static void test_stream_of_frames(void **state)
{
    (void)state;
    uint8_t buf[256], pay[16];
    size_t n = build(buf, KVS_FRAME_END, 0, 1, 0, 0, NULL, 0);
    struct kvs_token_msg tm = { .token = 3, .finish = 0 };
    kvs_proto_put_token(pay, &tm);
    n += build(buf + n, KVS_FRAME_TOKEN, 0, 2, 4, 1, pay, 8);
    n += build(buf + n, KVS_FRAME_KEEPALIVE, 0, 0, 0, 0, NULL, 0);
    assert_int_equal(n, 24 + 32 + 24);
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(0, 0);
    size_t off = 0, used;
    uint8_t kinds[3];
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvs_proto_decoder_feed(d, buf + off, n - off, &used), KVS_OK);
        kinds[i] = kvs_proto_decoder_frame(d)->h.kind;
        off += used;
    }
    assert_int_equal(off, n);
    assert_int_equal(kinds[0], KVS_FRAME_END);
    assert_int_equal(kinds[1], KVS_FRAME_TOKEN);
    assert_int_equal(kinds[2], KVS_FRAME_KEEPALIVE);
    assert_int_equal(kvs_proto_decoder_feed(d, buf, 0, &used), KVS_ERR_NEED_MORE);
    kvs_proto_decoder_free(d);
}

struct bad_case {
    const char *name;
    uint8_t bytes[72]; /* the longest case is a 24-byte header + 44-byte payload */
    size_t len;       /* bytes fed */
    uint32_t max;     /* decoder cap */
    uint32_t n_embd;
    kvs_err want;     /* NEED_MORE for truncated frames */
    const char *msg;  /* expected decoder error text */
};

#define HDR(kind, flags, req, pos, ntok, plen)                                                                \
    0x4b, 0x56, 0x53, 0x52, 0x03, 0x00, kind, flags, (req) & 0xff, 0, 0, 0, (pos) & 0xff, 0, 0, 0, (ntok) & 0xff, \
        ((ntok) >> 8) & 0xff, ((ntok) >> 16) & 0xff, ((ntok) >> 24) & 0xff, (plen) & 0xff, ((plen) >> 8) & 0xff, \
        ((plen) >> 16) & 0xff, ((plen) >> 24) & 0xff

static void test_bad_frames(void **state)
{
    (void)state;
    static const struct bad_case cases[] = {
        { "bad magic", { 0x4b, 0x56, 0x53, 0x53 }, 4, 0, 0, KVS_ERR_FORMAT,
          "bad magic byte 0x53 at offset 3 (expected \"KVSR\")" },
        { "http garbage", { 'G', 'E', 'T', ' ' }, 4, 0, 0, KVS_ERR_FORMAT,
          "bad magic byte 0x47 at offset 0 (expected \"KVSR\")" },
        { "version 4", { 0x4b, 0x56, 0x53, 0x52, 0x04, 0x00, 6, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 },
          24, 0, 0, KVS_ERR_UNSUPPORTED, "protocol version 4, this build speaks 3" },
        { "version 2 (HELLO without n_batch)",
          { 0x4b, 0x56, 0x53, 0x52, 0x02, 0x00, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 60, 0, 0, 0 },
          24, 0, 0, KVS_ERR_UNSUPPORTED, "protocol version 2, this build speaks 3" },
        { "version 1 (plaintext links before TLS)",
          { 0x4b, 0x56, 0x53, 0x52, 0x01, 0x00, 6, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 },
          24, 0, 0, KVS_ERR_UNSUPPORTED, "protocol version 1, this build speaks 3" },
        { "kind 0", { HDR(0, 0, 0, 0, 0, 0) }, 24, 0, 0, KVS_ERR_FORMAT, "unknown frame kind 0" },
        { "kind 11", { HDR(11, 0, 0, 0, 0, 0) }, 24, 0, 0, KVS_ERR_FORMAT, "unknown frame kind 11" },
        { "leave with req", { HDR(KVS_FRAME_LEAVE, 0, 4, 0, 0, 12) }, 24, 0, 0, KVS_ERR_FORMAT,
          "LEAVE frame with request id 4 (must be 0)" },
        { "leave short", { HDR(KVS_FRAME_LEAVE, 0, 0, 0, 0, 8) }, 24, 0, 0, KVS_ERR_RANGE,
          "LEAVE payload of 8 bytes, expected 12 for 0 tokens" },
        { "leave with tokens", { HDR(KVS_FRAME_LEAVE, 0, 0, 0, 1, 12) }, 24, 0, 0, KVS_ERR_RANGE,
          "LEAVE frame with token count 1 (must be 0)" },
        { "leave with flags", { HDR(KVS_FRAME_LEAVE, 0x40, 0, 0, 0, 12) }, 24, 0, 0, KVS_ERR_FORMAT,
          "LEAVE frame with flags 0x40 not allowed (allowed 0x00)" },
        { "leave empty window", { HDR(KVS_FRAME_LEAVE, 0, 0, 0, 0, 12), 2, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0 }, 36, 0,
          0, KVS_ERR_FORMAT, "LEAVE with window [2,2) and phase 1 (need begin < end, phase 1 or 2)" },
        { "leave phase 3", { HDR(KVS_FRAME_LEAVE, 0, 0, 0, 0, 12), 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0 }, 36, 0, 0,
          KVS_ERR_FORMAT, "LEAVE with window [1,2) and phase 3 (need begin < end, phase 1 or 2)" },
        { "flags on END", { HDR(KVS_FRAME_END, 0x01, 1, 0, 0, 0) }, 24, 0, 0, KVS_ERR_FORMAT,
          "END frame with flags 0x01 not allowed (allowed 0x00)" },
        { "oversized payload", { HDR(KVS_FRAME_ERROR, 0, 0, 0, 0, 0x1001) }, 24, 4096, 0, KVS_ERR_RANGE,
          "ERROR payload of 4097 bytes exceeds the cap of 4096" },
        { "over global cap", { HDR(KVS_FRAME_PREFILL, 0, 1, 0, 1, 0xffffffffu) }, 24, 0, 0, KVS_ERR_RANGE,
          "PREFILL payload of 4294967295 bytes exceeds the cap of 268435456" },
        { "too many tokens", { HDR(KVS_FRAME_PREFILL, 0, 1, 0, 65537, 0) }, 24, 0, 0, KVS_ERR_RANGE,
          "PREFILL token count 65537 exceeds the cap of 65536" },
        { "prefill count mismatch", { HDR(KVS_FRAME_PREFILL, 0, 1, 0, 2, 16) }, 24, 0, 8, KVS_ERR_RANGE,
          "PREFILL payload of 16 bytes, expected 32 for 2 tokens" },
        { "prefill not whole rows", { HDR(KVS_FRAME_PREFILL, 0, 1, 0, 3, 16) }, 24, 0, 0, KVS_ERR_RANGE,
          "PREFILL payload of 16 bytes is not 3 whole rows" },
        { "decode count mismatch", { HDR(KVS_FRAME_DECODE, 1, 0, 0, 1, 16) }, 24, 0, 4, KVS_ERR_RANGE,
          "DECODE payload of 16 bytes, expected 24 for 1 tokens" },
        { "decode with req", { HDR(KVS_FRAME_DECODE, 1, 3, 0, 1, 24) }, 24, 0, 4, KVS_ERR_FORMAT,
          "DECODE frame with request id 3 (must be 0)" },
        { "token count 2", { HDR(KVS_FRAME_TOKEN, 0, 1, 0, 2, 8) }, 24, 0, 0, KVS_ERR_RANGE,
          "TOKEN frame with token count 2 (must be 1)" },
        { "token short payload", { HDR(KVS_FRAME_TOKEN, 0, 1, 0, 1, 4) }, 24, 0, 0, KVS_ERR_RANGE,
          "TOKEN payload of 4 bytes, expected 8 for 1 tokens" },
        { "end without req", { HDR(KVS_FRAME_END, 0, 0, 0, 0, 0) }, 24, 0, 0, KVS_ERR_FORMAT,
          "END frame without a request id" },
        { "hello short", { HDR(KVS_FRAME_HELLO, 0, 0, 0, 0, 63) }, 24, 0, 0, KVS_ERR_RANGE,
          "HELLO payload of 63 bytes, expected 96 for 0 tokens" },
        { "hello without content id", { HDR(KVS_FRAME_HELLO, 0, 0, 0, 0, 64) }, 24, 0, 0, KVS_ERR_RANGE,
          "HELLO payload of 64 bytes, expected 96 for 0 tokens" },
        { "request empty prompt", { HDR(KVS_FRAME_REQUEST_START, 0, 1, 0, 0, 40) }, 24, 0, 0, KVS_ERR_RANGE,
          "REQUEST_START with an empty prompt" },
        { "request bad length", { HDR(KVS_FRAME_REQUEST_START, 0, 1, 0, 2, 46) }, 24, 0, 0, KVS_ERR_RANGE,
          "REQUEST_START payload of 46 bytes does not fit 2 prompt ids (48 + 4 x n_stop)" },
        { "request n_stop mismatch",
          { HDR(KVS_FRAME_REQUEST_START, 0, 1, 0, 1, 44), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 1, 0, 0, 0 },
          68, 0, 0, KVS_ERR_FORMAT, "REQUEST_START n_stop 1 does not match its payload of 44 bytes" },
        { "error empty", { HDR(KVS_FRAME_ERROR, 0, 0, 0, 0, 2) }, 24, 0, 0, KVS_ERR_RANGE,
          "ERROR payload of 2 bytes (must be 4..1028)" },
        { "truncated header", { HDR(KVS_FRAME_END, 0, 1, 0, 0, 0) }, 23, 0, 0, KVS_ERR_NEED_MORE, "" },
        { "truncated payload", { HDR(KVS_FRAME_TOKEN, 0, 1, 0, 1, 8), 1, 0, 0 }, 27, 0, 0, KVS_ERR_NEED_MORE, "" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const struct bad_case *c = &cases[i];
        struct kvs_proto_decoder *d = kvs_proto_decoder_create(c->max, c->n_embd);
        /* whole and byte by byte give the same verdict */
        for (int mode = 0; mode < 2; mode++) {
            kvs_proto_decoder_reset(d);
            kvs_err e = KVS_ERR_NEED_MORE;
            size_t used;
            if (mode == 0) {
                e = kvs_proto_decoder_feed(d, c->bytes, c->len, &used);
            } else {
                for (size_t k = 0; k < c->len && e == KVS_ERR_NEED_MORE; k++)
                    e = kvs_proto_decoder_feed(d, c->bytes + k, 1, &used);
            }
            if (e != c->want || strcmp(kvs_proto_decoder_error(d), c->msg) != 0)
                fail_msg("case '%s' mode %d: got %d '%s', want %d '%s'", c->name, mode, e,
                         kvs_proto_decoder_error(d), c->want, c->msg);
            assert_null(kvs_proto_decoder_frame(d));
            if (c->want != KVS_ERR_NEED_MORE) /* sticky */
                assert_int_equal(kvs_proto_decoder_feed(d, c->bytes, 1, &used), c->want);
        }
        kvs_proto_decoder_free(d);
    }
}

/* --- PROTOCOL.md §6 ------------------------------------------------------- */

/* Finds the ```hex NAME block and parses its bytes. Returns the count. */
static size_t doc_example(const char *doc, const char *name, uint8_t *out, size_t cap)
{
    char tag[64];
    snprintf(tag, sizeof tag, "```hex %s\n", name);
    const char *p = strstr(doc, tag);
    if (!p) fail_msg("PROTOCOL.md has no example %s", name);
    p += strlen(tag);
    const char *end = strstr(p, "```");
    assert_non_null(end);
    size_t n = 0;
    while (p < end) {
        if (*p == ' ' || *p == '\n') {
            p++;
            continue;
        }
        char *q;
        unsigned long v = strtoul(p, &q, 16);
        assert_true(q == p + 2 && v <= 0xff && n < cap);
        out[n++] = (uint8_t)v;
        p = q;
    }
    return n;
}

static void test_protocol_md_examples(void **state)
{
    (void)state;
    const char *src = getenv("KVASIR_SRC");
    char path[4096];
    snprintf(path, sizeof path, "%s/docs/PROTOCOL.md", src ? src : ".");
    FILE *fp = fopen(path, "rb");
    if (!fp) fail_msg("cannot open %s (set KVASIR_SRC)", path);
    static char doc[1 << 16];
    size_t dl = fread(doc, 1, sizeof doc - 1, fp);
    fclose(fp);
    doc[dl] = '\0';

    uint8_t b[256];
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(0, 4);
    const struct kvs_frame *f;

    size_t n = doc_example(doc, "HELLO", b, sizeof b);
    assert_int_equal(n, 120);
    f = decode_bytewise(d, b, n);
    struct kvs_hello he;
    kvs_proto_get_hello(f, &he);
    for (int i = 0; i < 32; i++) assert_int_equal(he.fingerprint[i], i);
    assert_int_equal(he.n_block, 4);
    assert_int_equal(he.block_begin, 0);
    assert_int_equal(he.block_end, 2);
    assert_int_equal(he.n_embd, 64);
    assert_int_equal(he.role, KVS_HELLO_ROLE_PRED);
    assert_int_equal(he.n_ctx, 128);
    assert_int_equal(he.n_seq, 4);
    assert_int_equal(he.n_batch, 512);
    for (int i = 0; i < 32; i++) assert_int_equal(he.content_id[i], 0x20 + i);

    n = doc_example(doc, "REQUEST_START", b, sizeof b);
    assert_int_equal(n, 80);
    f = decode_bytewise(d, b, n);
    struct kvs_req_params rp;
    const uint8_t *pp;
    kvs_proto_get_req(f, &rp, &pp);
    assert_int_equal(f->h.req, 7);
    assert_int_equal(f->h.n_tokens, 3);
    assert_true(rp.temp == 0.8f && rp.top_p == 0.95f && rp.min_p == 0.05f && rp.repeat_penalty == 1.0f);
    assert_int_equal(rp.top_k, 40);
    assert_int_equal(rp.repeat_last_n, 64);
    assert_int_equal(rp.seed, 42);
    assert_int_equal(rp.max_tokens, 60);
    assert_int_equal(rp.n_stop, 1);
    assert_int_equal(rp.stop[0], 2);
    assert_false(rp.ignore_eos);
    assert_int_equal(kvs_proto_get_i32(pp), 1);
    assert_int_equal(kvs_proto_get_i32(pp + 4), 403);
    assert_int_equal(kvs_proto_get_i32(pp + 8), 407);

    n = doc_example(doc, "PREFILL", b, sizeof b);
    f = decode_bytewise(d, b, n);
    assert_int_equal(f->h.flags, KVS_FRAME_FLAG_LAST);
    float x[8];
    kvs_proto_get_boundary(x, kvs_proto_boundary(f), 8, false);
    const float want_p[8] = { 1, -2, 0.5f, 0, 0.25f, 65504, -0.125f, 3 };
    assert_memory_equal(x, want_p, sizeof x);

    n = doc_example(doc, "DECODE", b, sizeof b);
    f = decode_bytewise(d, b, n);
    uint32_t rq, ps;
    kvs_proto_get_decode_row(f, 0, &rq, &ps);
    assert_true(rq == 7 && ps == 3);
    kvs_proto_get_decode_row(f, 1, &rq, &ps);
    assert_true(rq == 9 && ps == 5);
    kvs_proto_get_boundary(x, kvs_proto_boundary(f), 8, true);
    const float want_d[8] = { 1, 2, 3, 4, -1, -2, -3, -4 };
    assert_memory_equal(x, want_d, sizeof x);

    struct kvs_token_msg tm;
    n = doc_example(doc, "TOKEN", b, sizeof b);
    f = decode_bytewise(d, b, n);
    kvs_proto_get_token(f, &tm);
    assert_true(f->h.req == 7 && f->h.pos == 3 && tm.token == 1058 && tm.finish == 0 && f->h.flags == 0);
    n = doc_example(doc, "TOKEN_FINISHED", b, sizeof b);
    f = decode_bytewise(d, b, n);
    kvs_proto_get_token(f, &tm);
    assert_true(f->h.pos == 9 && tm.token == 2 && tm.finish == KVS_FINISH_STOP &&
                f->h.flags == KVS_FRAME_FLAG_FINISHED);

    n = doc_example(doc, "END", b, sizeof b);
    f = decode_bytewise(d, b, n);
    assert_true(f->h.kind == KVS_FRAME_END && f->h.req == 7);
    n = doc_example(doc, "CANCEL", b, sizeof b);
    f = decode_bytewise(d, b, n);
    assert_true(f->h.kind == KVS_FRAME_CANCEL && f->h.req == 7);

    n = doc_example(doc, "ERROR", b, sizeof b);
    f = decode_bytewise(d, b, n);
    uint32_t code;
    char msg[32];
    kvs_proto_get_error(f, &code, msg, sizeof msg);
    assert_int_equal(code, KVS_ERR_PEER);
    assert_string_equal(msg, "ring broken");

    n = doc_example(doc, "KEEPALIVE", b, sizeof b);
    f = decode_bytewise(d, b, n);
    assert_true(f->h.kind == KVS_FRAME_KEEPALIVE && f->h.flags == KVS_FRAME_FLAG_PROBE && f->h.pos == 5);

    n = doc_example(doc, "LEAVE", b, sizeof b);
    assert_int_equal(n, 36);
    f = decode_bytewise(d, b, n);
    struct kvs_leave lv;
    kvs_proto_get_leave(f, &lv);
    assert_true(f->h.kind == KVS_FRAME_LEAVE && f->h.req == 0 && lv.block_begin == 2 && lv.block_end == 3 &&
                lv.phase == KVS_LEAVE_ASK);

    n = doc_example(doc, "KEEPALIVE_TRAIL", b, sizeof b);
    assert_int_equal(n, 80);
    f = decode_bytewise(d, b, n);
    assert_true(f->h.kind == KVS_FRAME_KEEPALIVE && f->h.pos == 5 && f->h.n_tokens == 1);
    assert_int_equal(f->h.flags, KVS_FRAME_FLAG_PROBE | KVS_FRAME_FLAG_TRAIL);
    struct kvs_trail_rec tr;
    kvs_proto_get_trail_rec(f, 0, &tr);
    assert_true(tr.block_begin == 0 && tr.block_end == 7);
    assert_int_equal(tr.forward_calls, 100);
    assert_int_equal(tr.forward_us, 2500000);
    assert_int_equal(tr.rows, 108);
    assert_int_equal(tr.bytes_out, 210000);
    assert_int_equal(tr.t_recv_us, 1700000000000000ull);
    assert_int_equal(tr.t_send_us, 1700000000000250ull);
    kvs_proto_decoder_free(d);
}

/* Revision 1.1 trail probes: round trip of two records; header rules. */
static void test_trail(void **state)
{
    (void)state;
    uint8_t b[24 + 2 * KVS_PROTO_TRAIL_REC_BYTES];
    struct kvs_frame_header h = { .version = KVS_PROTO_VERSION, .kind = KVS_FRAME_KEEPALIVE,
                                  .flags = KVS_FRAME_FLAG_PROBE | KVS_FRAME_FLAG_TRAIL,
                                  .pos = 9, .n_tokens = 2, .payload_len = 2 * KVS_PROTO_TRAIL_REC_BYTES };
    kvs_proto_put_header(b, &h);
    struct kvs_trail_rec r0 = { 0, 14, 3, 4000000000ull, 5, 6, 7, 8 };
    struct kvs_trail_rec r1 = { 14, 28, 0xffffffffffull, 1, 2, 3, UINT64_MAX, 0 };
    kvs_proto_put_trail_rec(b + 24, &r0);
    kvs_proto_put_trail_rec(b + 24 + KVS_PROTO_TRAIL_REC_BYTES, &r1);
    assert_int_equal(b[24 + 4], 14); /* block_end, little-endian */
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(0, 8);
    const struct kvs_frame *f = decode_bytewise(d, b, sizeof b);
    struct kvs_trail_rec g;
    kvs_proto_get_trail_rec(f, 0, &g);
    assert_memory_equal(&g, &r0, sizeof g);
    kvs_proto_get_trail_rec(f, 1, &g);
    assert_memory_equal(&g, &r1, sizeof g);
    kvs_proto_decoder_free(d);

    char e[256];
    struct kvs_frame_header k = h;
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_OK);
    k.flags = KVS_FRAME_FLAG_TRAIL; /* TRAIL without PROBE */
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_ERR_FORMAT);
    k = h;
    k.payload_len = 2 * KVS_PROTO_TRAIL_REC_BYTES + 1;
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_ERR_RANGE);
    k = h;
    k.n_tokens = KVS_PROTO_MAX_TRAIL + 1;
    k.payload_len = k.n_tokens * KVS_PROTO_TRAIL_REC_BYTES;
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_ERR_RANGE);
    k = h;
    k.n_tokens = 0; /* an empty trail is well-formed */
    k.payload_len = 0;
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_OK);
    k.flags = KVS_FRAME_FLAG_PROBE; /* a plain probe still has no payload */
    k.n_tokens = 1;
    k.payload_len = KVS_PROTO_TRAIL_REC_BYTES;
    assert_int_equal(kvs_proto_check_header(&k, 0, 8, e, sizeof e), KVS_ERR_RANGE);
}

/* The ERROR codes on the wire are kvs_err values: the numbers docs/PROTOCOL.md
 * §3.7 lists must stay what src/common/error.h gives them. */
static void test_error_codes(void **st)
{
    (void)st;
    static const struct { kvs_err e; unsigned code; } v[] = {
        { KVS_ERR_ARG, 1 },        { KVS_ERR_NOMEM, 2 },     { KVS_ERR_IO, 3 },        { KVS_ERR_FORMAT, 4 },
        { KVS_ERR_TRUNCATED, 5 },  { KVS_ERR_RANGE, 7 },     { KVS_ERR_UNSUPPORTED, 8 }, { KVS_ERR_NOT_FOUND, 9 },
        { KVS_ERR_MISMATCH, 10 },  { KVS_ERR_HASH, 11 },     { KVS_ERR_NET, 12 },      { KVS_ERR_PEER, 13 },
        { KVS_ERR_TIMEOUT, 14 },   { KVS_ERR_CANCELLED, 15 }, { KVS_ERR_FULL, 16 },    { KVS_ERR_INFEASIBLE, 17 },
        { KVS_ERR_INTERNAL, 18 },  { KVS_ERR_NUMERIC, 19 },
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++)
        assert_int_equal((unsigned)v[i].e, v[i].code);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_error_codes),
        cmocka_unit_test(test_trail),
        cmocka_unit_test(test_roundtrip_all_kinds),
        cmocka_unit_test(test_stream_of_frames),
        cmocka_unit_test(test_bad_frames),
        cmocka_unit_test(test_protocol_md_examples),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

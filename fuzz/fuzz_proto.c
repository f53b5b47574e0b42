/* libFuzzer target for the frame decoder (src/proto): feeds the input in
 * chunks whose sizes come from the first byte, decodes every frame it
 * completes and reads its payload through the typed getters. Must never
 * crash, leak or read out of bounds, whatever the bytes. */
#include <stddef.h>
#include <stdint.h>

#include "proto/proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    size_t chunk = (size_t)(data[0] % 17) + 1;
    uint32_t n_embd = (data[0] & 0x80) ? 4 : 0;
    data++;
    size--;
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(1u << 16, n_embd);
    if (!d) return 0;
    size_t off = 0;
    while (off < size) {
        size_t len = size - off < chunk ? size - off : chunk, used = 0;
        kvs_err e = kvs_proto_decoder_feed(d, data + off, len, &used);
        off += used;
        if (e == KVS_OK) {
            const struct kvs_frame *f = kvs_proto_decoder_frame(d);
            float x[64];
            switch (f->h.kind) {
            case KVS_FRAME_HELLO: {
                struct kvs_hello h;
                kvs_proto_get_hello(f, &h);
                break;
            }
            case KVS_FRAME_REQUEST_START: {
                struct kvs_req_params p;
                const uint8_t *pr;
                kvs_proto_get_req(f, &p, &pr);
                for (uint32_t i = 0; i < f->h.n_tokens; i++) (void)kvs_proto_get_i32(pr + 4 * i);
                break;
            }
            case KVS_FRAME_PREFILL:
            case KVS_FRAME_DECODE: {
                bool f32 = f->h.flags & KVS_FRAME_FLAG_F32;
                const uint8_t *b = kvs_proto_boundary(f);
                size_t vals = (f->h.payload_len - (size_t)(b - f->payload)) / (f32 ? 4 : 2);
                for (size_t i = 0; i < vals; i += 64)
                    kvs_proto_get_boundary(x, b + i * (f32 ? 4 : 2), vals - i < 64 ? vals - i : 64, f32);
                if (f->h.kind == KVS_FRAME_DECODE)
                    for (uint32_t i = 0; i < f->h.n_tokens; i++) {
                        uint32_t r, p;
                        kvs_proto_get_decode_row(f, i, &r, &p);
                    }
                break;
            }
            case KVS_FRAME_TOKEN: {
                struct kvs_token_msg t;
                kvs_proto_get_token(f, &t);
                break;
            }
            case KVS_FRAME_LEAVE: {
                struct kvs_leave l;
                kvs_proto_get_leave(f, &l);
                if (l.block_begin >= l.block_end) __builtin_trap(); /* the decoder refuses an empty window */
                break;
            }
            case KVS_FRAME_ERROR: {
                uint32_t code;
                char msg[64];
                kvs_proto_get_error(f, &code, msg, sizeof msg);
                break;
            }
            default:
                break;
            }
        } else if (e != KVS_ERR_NEED_MORE) {
            break;
        }
    }
    kvs_proto_decoder_free(d);
    return 0;
}

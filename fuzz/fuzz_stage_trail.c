/* libFuzzer target for the head's reading of a returning probe trail
 * (src/stage/stage_probe.c, docs/PROTOCOL.md §3.8.1): any stage forwards
 * trails, so their bytes are the stage port's input. The first 16 bytes give
 * the head's clock (t_back, u64), n_block and its window; the rest goes through
 * the frame decoder, and every TRAIL probe it completes is checked
 * (kvs_st_trail_valid) and its figures computed (kvs_st_trail_hops, which must
 * be free of overflow for any values, valid or not). Built with UBSan and
 * -fno-sanitize-recover: a signed overflow aborts. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "stage/stage_impl.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 16) return 0;
    uint64_t t_back;
    memcpy(&t_back, data, 8);
    uint32_t n_block = (uint32_t)data[8] + 1;
    int32_t begin = data[9] % n_block, end = begin + 1 + data[10] % (n_block - (uint32_t)begin);
    data += 16;
    size -= 16;
    struct kvs_proto_decoder *d = kvs_proto_decoder_create(1u << 16, 0);
    if (!d) return 0;
    size_t off = 0;
    while (off < size) {
        size_t used = 0;
        kvs_err e = kvs_proto_decoder_feed(d, data + off, size - off, &used);
        off += used;
        if (e == KVS_OK) {
            const struct kvs_frame *f = kvs_proto_decoder_frame(d);
            if (f->h.kind == KVS_FRAME_KEEPALIVE && (f->h.flags & KVS_FRAME_FLAG_TRAIL)) {
                struct kvs_stage_hop hops[KVS_PROTO_MAX_TRAIL];
                double rtt = 0;
                uint32_t bad = 0;
                struct kvs_trail_rec r;
                bool ok = kvs_st_trail_valid(f, t_back, n_block, begin, end, &bad, &r);
                int n = kvs_st_trail_hops(f, t_back, hops, &rtt);
                if (ok && n > 0 && (rtt != rtt || hops[0].block_begin != begin)) __builtin_trap();
                if (!ok && bad >= f->h.n_tokens) __builtin_trap();
            }
        } else if (e != KVS_ERR_NEED_MORE || used == 0) {
            break; /* a bad frame ends a link */
        }
    }
    kvs_proto_decoder_free(d);
    return 0;
}

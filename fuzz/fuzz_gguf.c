/* libFuzzer target: kvs_gguf_parse on arbitrary bytes (file_size = size),
 * then every accessor on success. Seeds: fuzz/seeds/gguf/ (written with the
 * gguf writer). Also exercises the header-only path with a shorter prefix. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "gguf/gguf.h"

static volatile uint64_t sink;

static void walk(const struct kvs_gguf *g)
{
    sink += kvs_gguf_version(g) + kvs_gguf_alignment(g) + kvs_gguf_data_offset(g) + kvs_gguf_file_size(g);
    sink += (uintptr_t)kvs_gguf_base(g);
    for (size_t i = 0; i < kvs_gguf_n_kv(g); i++) {
        const char *key = kvs_gguf_key(g, i);
        sink += strlen(key) + (uint64_t)kvs_gguf_find_key(g, key);
        sink += kvs_gguf_kv_type(g, i) + kvs_gguf_arr_type(g, i) + kvs_gguf_arr_n(g, i);
        uint32_t u32;
        int32_t i32;
        uint64_t u64;
        float f;
        bool b;
        const char *s;
        size_t n;
        enum kvs_gguf_type et;
        const void *d;
        if (kvs_gguf_get_u32(g, key, &u32) == KVS_OK) sink += u32;
        if (kvs_gguf_get_i32(g, key, &i32) == KVS_OK) sink += (uint64_t)i32;
        if (kvs_gguf_get_u64(g, key, &u64) == KVS_OK) sink += u64;
        if (kvs_gguf_get_f32(g, key, &f) == KVS_OK) sink += (uint64_t)(f == f);
        if (kvs_gguf_get_bool(g, key, &b) == KVS_OK) sink += b;
        if (kvs_gguf_get_str(g, key, &s, &n) == KVS_OK && n) sink += (uint8_t)s[0] + (uint8_t)s[n - 1];
        if (kvs_gguf_get_arr(g, key, &et, &u64, &d) == KVS_OK && u64) sink += *(const uint8_t *)d;
        uint64_t an = kvs_gguf_arr_n(g, i);
        for (uint64_t j = 0; j < an && j < 64; j++)
            if (kvs_gguf_arr_str(g, i, j, &s, &n) == KVS_OK && n)
                sink += (uint8_t)s[0] + (uint8_t)s[n - 1];
        const uint8_t *raw;
        if (kvs_gguf_kv_raw(g, i, &raw, &n) == KVS_OK && n)
            sink += raw[0] + raw[n - 1];
    }
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        sink += strlen(t->name) + t->n_dims + (uint64_t)t->ne[0] + t->type + t->offset + t->bytes;
        sink += (uintptr_t)kvs_gguf_find_tensor(g, t->name);
        sink += kvs_type_row_bytes(t->type, t->ne[0]);
        sink += strlen(kvs_type_name(t->type));
        if (t->data && t->bytes)
            sink += ((const uint8_t *)t->data)[0] + ((const uint8_t *)t->data)[t->bytes - 1];
    }
    uint8_t fp[32];
    char hex[65];
    if (kvs_gguf_fingerprint(g, fp) == KVS_OK) {
        kvs_gguf_fingerprint_hex(fp, hex);
        sink += (uint8_t)hex[0];
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvs_gguf *g = NULL;
    char err[256];
    size_t need = 0;
    kvs_err e = kvs_gguf_parse(data, size, size, &g, &need, err, sizeof err);
    if (e == KVS_OK) {
        walk(g);
        kvs_gguf_close(g);
    }
    /* Header-only: half the bytes of a file stated to be twice as long. */
    g = NULL;
    e = kvs_gguf_parse(data, size / 2, (uint64_t)size * 2, &g, &need, err, sizeof err);
    if (e == KVS_OK) {
        walk(g);
        kvs_gguf_close(g);
    } else if (e == KVS_ERR_NEED_MORE && need <= size / 2) {
        __builtin_trap(); /* need must promise progress */
    }
    return 0;
}

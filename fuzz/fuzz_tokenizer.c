/* libFuzzer target: arbitrary bytes through the SPM and BPE tokenizers
 * (small vocabularies built in memory) and back through the streaming
 * detokenizer. Byte 0 selects add_bos / parse_special / the tokenizer. Must
 * never crash, hang or leak. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_impl.h"

#define N_SPM (3 + 256 + 8)

struct fz_vocab {
    char text[N_SPM][16];
    float scores[N_SPM];
    int32_t types[N_SPM];
    size_t n;
};

static const char *const k_merges[] = { "h e", "l l", "he ll", "hell o", "\xC4\xA0 w", "\xC4\xA0 \xC4\xA0" };

static kvs_err get_tok(void *ctx, uint64_t i, const char **s, size_t *len)
{
    struct fz_vocab *v = ctx;
    *s = v->text[i];
    *len = strlen(v->text[i]);
    return KVS_OK;
}

static kvs_err get_merge(void *ctx, uint64_t i, const char **s, size_t *len)
{
    (void)ctx;
    *s = k_merges[i];
    *len = strlen(k_merges[i]);
    return KVS_OK;
}

static struct kvs_tokenizer *make(int which)
{
    static struct fz_vocab v; /* rebuilt identically each call; read only during build */
    memset(&v, 0, sizeof v);
    struct kvs_tok_desc d = { .ctx = &v, .token = get_tok, .bos = -1, .eos = -1, .unk = -1, .eot = -1,
                              .eom = -1, .add_bos = -1, .add_space_prefix = -1 };
    if (which == 0) {
        static const char *const pieces[] = { "\xE2\x96\x81", "a", "b", "ab", "\xE2\x96\x81\x61", "<s>a", "é", "\xE2\x96\x81\xE2\x96\x81" };
        snprintf(v.text[0], 16, "<unk>");
        v.types[0] = KVS_TOK_TYPE_UNKNOWN;
        snprintf(v.text[1], 16, "<s>");
        v.types[1] = KVS_TOK_TYPE_CONTROL;
        snprintf(v.text[2], 16, "</s>");
        v.types[2] = KVS_TOK_TYPE_CONTROL;
        for (int b = 0; b < 256; b++) {
            snprintf(v.text[3 + b], 16, "<0x%02X>", b);
            v.types[3 + b] = KVS_TOK_TYPE_BYTE;
        }
        for (int i = 0; i < 8; i++) {
            snprintf(v.text[259 + i], 16, "%s", pieces[i]);
            v.types[259 + i] = KVS_TOK_TYPE_NORMAL;
            v.scores[259 + i] = (float)-i;
        }
        d.kind = KVS_TOK_KIND_SPM;
        d.n_tokens = N_SPM;
        d.scores = v.scores;
        d.types = v.types;
    } else {
        /* BPE: the 256 single-byte symbols of the byte alphabet + a few merges */
        for (int b = 0; b < 256; b++) {
            uint32_t cp = kvs_tok_byte_to_cp((uint8_t)b);
            if (cp < 0x80)
                snprintf(v.text[b], 16, "%c", (char)cp);
            else
                snprintf(v.text[b], 16, "%c%c", (char)(0xC0 | (cp >> 6)), (char)(0x80 | (cp & 0x3F)));
            v.types[b] = KVS_TOK_TYPE_NORMAL;
        }
        static const char *const extra[] = { "he", "ll", "hell", "hello", "\xC4\xA0w", "\xC4\xA0\xC4\xA0", "<|end|>" };
        for (int i = 0; i < 7; i++)
            snprintf(v.text[256 + i], 16, "%s", extra[i]);
        v.types[262] = KVS_TOK_TYPE_CONTROL;
        d.kind = KVS_TOK_KIND_BPE;
        d.pre = which == 1 ? KVS_TOK_PRE_GPT2 : which == 2 ? KVS_TOK_PRE_LLAMA3 : KVS_TOK_PRE_QWEN2;
        d.n_tokens = 263;
        d.n_merges = sizeof k_merges / sizeof k_merges[0];
        d.merge = get_merge;
        d.types = v.types;
    }
    struct kvs_tokenizer *t = NULL;
    if (kvs_tokenizer_build(&d, &t, NULL, 0) != KVS_OK)
        abort();
    return t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static struct kvs_tokenizer *toks[4];
    if (!size)
        return 0;
    int which = data[0] & 3;
    bool bos = data[0] & 4, special = data[0] & 8;
    if (!toks[which])
        toks[which] = make(which); /* kept for the process lifetime */
    const struct kvs_tokenizer *t = toks[which];
    const char *text = (const char *)data + 1;
    size_t len = size - 1;
    int32_t ids[256];
    int64_t n = kvs_tokenize(t, text, len, bos, special, ids, 256);
    if (n < 0)
        return 0;
    int32_t *all = ids;
    if (n > 256) {
        all = malloc((size_t)n * sizeof *all);
        if (!all || kvs_tokenize(t, text, len, bos, special, all, n) != n)
            abort();
    }
    struct kvs_detok d;
    kvs_detok_init(&d, t, which == 0);
    char out[128];
    for (int64_t i = 0; i < n; i++) {
        if (all[i] < 0 || all[i] >= kvs_tokenizer_n_vocab(t))
            abort();
        if (kvs_detok_push(&d, all[i], out, sizeof out) < 0)
            abort();
    }
    if (kvs_detok_flush(&d, out, sizeof out) < 0)
        abort();
    if (all != ids)
        free(all);
    return 0;
}

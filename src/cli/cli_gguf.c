/* kvasir gguf info | synth: inspect a GGUF file (the gguf module; the shard
 * module says which window a stage shard holds). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "shard/shard.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir gguf info FILE       summarize a GGUF file\n"
               "       kvasir gguf synth [...]     create a synthetic model (kvasir gguf synth --help)\n");
}

static void usage_info(FILE *f)
{
    fprintf(f,
            "usage: kvasir gguf info FILE\n"
            "\n"
            "Validates FILE and prints: GGUF version, alignment, architecture, every <arch>.* key,\n"
            "vocabulary size and tokenizer model, tensor count and bytes, bytes by tensor type,\n"
            "bytes per block (blk.N.*; nextn/MTP blocks marked) and outside blocks, the main block\n"
            "count (block_count - nextn_predict_layers) and the model fingerprint.\n"
            "Exit status: 0 ok, 1 the file is unreadable or invalid, 2 usage error.\n");
}

static const char *gtype_name(enum kvs_gguf_type t)
{
    static const char *const names[] = { "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "FLOAT32",
                                         "BOOL", "STRING", "ARRAY", "UINT64", "INT64", "FLOAT64" };
    return (unsigned)t < sizeof names / sizeof names[0] ? names[t] : "?";
}

/* Prints s (n bytes) quoted, escaping control bytes, at most max bytes. */
static void print_quoted(const char *s, size_t n, size_t max)
{
    putchar('"');
    for (size_t i = 0; i < n && i < max; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c == '\n')
            fputs("\\n", stdout);
        else if (c < 0x20 || c == 0x7f)
            printf("\\x%02x", c);
        else
            putchar(c);
    }
    putchar('"');
    if (n > max)
        printf("... (%zu bytes)", n);
}

/* One scalar element of type t at p (little-endian, possibly unaligned). */
static void print_scalar(enum kvs_gguf_type t, const uint8_t *p)
{
    uint64_t u = 0;
    size_t sz = t == KVS_GGUF_TYPE_UINT8 || t == KVS_GGUF_TYPE_INT8 || t == KVS_GGUF_TYPE_BOOL ? 1
                : t == KVS_GGUF_TYPE_UINT16 || t == KVS_GGUF_TYPE_INT16                     ? 2
                : t == KVS_GGUF_TYPE_UINT32 || t == KVS_GGUF_TYPE_INT32 || t == KVS_GGUF_TYPE_FLOAT32 ? 4
                                                                                              : 8;
    for (size_t i = 0; i < sz; i++)
        u |= (uint64_t)p[i] << (8 * i);
    switch (t) {
    case KVS_GGUF_TYPE_UINT8: case KVS_GGUF_TYPE_UINT16: case KVS_GGUF_TYPE_UINT32: case KVS_GGUF_TYPE_UINT64:
        printf("%" PRIu64, u);
        break;
    case KVS_GGUF_TYPE_INT8: printf("%d", (int)(int8_t)u); break;
    case KVS_GGUF_TYPE_INT16: printf("%d", (int)(int16_t)u); break;
    case KVS_GGUF_TYPE_INT32: printf("%" PRId32, (int32_t)u); break;
    case KVS_GGUF_TYPE_INT64: printf("%" PRId64, (int64_t)u); break;
    case KVS_GGUF_TYPE_BOOL: fputs(u ? "true" : "false", stdout); break;
    case KVS_GGUF_TYPE_FLOAT32: {
        uint32_t b = (uint32_t)u;
        float f;
        memcpy(&f, &b, 4);
        printf("%.9g", (double)f);
        break;
    }
    case KVS_GGUF_TYPE_FLOAT64: {
        double d;
        memcpy(&d, &u, 8);
        printf("%.17g", d);
        break;
    }
    default: fputs("?", stdout); break;
    }
}

static void print_value(const struct kvs_gguf *g, size_t i)
{
    const char *key = kvs_gguf_key(g, i);
    enum kvs_gguf_type t = kvs_gguf_kv_type(g, i);
    if (t == KVS_GGUF_TYPE_STRING) {
        const char *s;
        size_t n;
        if (kvs_gguf_get_str(g, key, &s, &n) == KVS_OK)
            print_quoted(s, n, 200);
        return;
    }
    if (t != KVS_GGUF_TYPE_ARRAY) {
        /* Raw bytes: the value is the tail of the stored pair. */
        const uint8_t *p;
        size_t n;
        if (kvs_gguf_kv_raw(g, i, &p, &n) == KVS_OK)
            print_scalar(t, p + 8 + strlen(key) + 4);
        return;
    }
    enum kvs_gguf_type et = kvs_gguf_arr_type(g, i);
    uint64_t n = kvs_gguf_arr_n(g, i);
    printf("[%" PRIu64 " x %s]", n, gtype_name(et));
    const uint64_t show = 8;
    if (n == 0)
        return;
    fputs(" ", stdout);
    if (et == KVS_GGUF_TYPE_STRING) {
        for (uint64_t j = 0; j < n && j < show; j++) {
            const char *s;
            size_t sl;
            if (kvs_gguf_arr_str(g, i, j, &s, &sl) != KVS_OK)
                break;
            if (j)
                fputs(", ", stdout);
            print_quoted(s, sl, 40);
        }
    } else {
        enum kvs_gguf_type et2;
        uint64_t n2;
        const void *d;
        if (kvs_gguf_get_arr(g, key, &et2, &n2, &d) != KVS_OK)
            return;
        size_t sz = et == KVS_GGUF_TYPE_UINT8 || et == KVS_GGUF_TYPE_INT8 || et == KVS_GGUF_TYPE_BOOL ? 1
                    : et == KVS_GGUF_TYPE_UINT16 || et == KVS_GGUF_TYPE_INT16                        ? 2
                    : et == KVS_GGUF_TYPE_UINT64 || et == KVS_GGUF_TYPE_INT64 ||
                            et == KVS_GGUF_TYPE_FLOAT64
                        ? 8
                        : 4;
        for (uint64_t j = 0; j < n && j < show; j++) {
            if (j)
                fputs(", ", stdout);
            print_scalar(et, (const uint8_t *)d + j * sz);
        }
    }
    if (n > show)
        fputs(", ...", stdout);
}

/* "blk.N.<rest>" -> N (true), else false. N must fit in 32 bits. */
static bool block_of(const char *name, uint32_t *blk)
{
    if (strncmp(name, "blk.", 4) != 0)
        return false;
    const char *p = name + 4;
    uint64_t v = 0;
    size_t digits = 0;
    while (*p >= '0' && *p <= '9') {
        v = v * 10 + (uint64_t)(*p - '0');
        if (v > UINT32_MAX)
            return false;
        p++;
        digits++;
    }
    if (digits == 0 || *p != '.')
        return false;
    *blk = (uint32_t)v;
    return true;
}

struct block_sum {
    uint32_t blk;
    uint64_t count, bytes;
};

static int cmp_block(const void *a, const void *b)
{
    uint32_t x = ((const struct block_sum *)a)->blk, y = ((const struct block_sum *)b)->blk;
    return x < y ? -1 : x > y;
}

static int cmd_info(int argc, char **argv)
{
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage_info(stdout);
            return 0;
        }
        if (argv[i][0] == '-' || path) {
            usage_info(stderr);
            return 2;
        }
        path = argv[i];
    }
    if (!path) {
        usage_info(stderr);
        return 2;
    }
    struct kvs_gguf *g = NULL;
    char err[512];
    kvs_err e = kvs_gguf_open(path, &g, err, sizeof err);
    if (e) {
        fprintf(stderr, "kvasir gguf info: %s (%s)\n", err[0] ? err : path, kvs_strerror(e));
        return 1;
    }
    printf("file: %s\n", path);
    printf("version: %" PRIu32 "\n", kvs_gguf_version(g));
    printf("alignment: %" PRIu32 "\n", kvs_gguf_alignment(g));
    printf("file size: %" PRIu64 " bytes\n", kvs_gguf_file_size(g));
    printf("data offset: %" PRIu64 "\n", kvs_gguf_data_offset(g));
    printf("metadata keys: %zu\n", kvs_gguf_n_kv(g));
    char shard[256];
    kvs_err se = kvs_shard_describe(g, shard, sizeof shard);
    if (se == KVS_OK) /* block_count below is the source's; the fingerprint too */
        printf("shard: %s\n", shard);
    else if (se != KVS_ERR_NOT_FOUND)
        printf("shard: (bad kvasir.shard.* keys: %s)\n", shard);

    const char *arch = "";
    size_t alen = 0;
    if (kvs_gguf_get_str(g, "general.architecture", &arch, &alen) != KVS_OK) {
        arch = "";
        alen = 0;
    }
    printf("architecture: ");
    print_quoted(arch, alen, 200);
    printf("\nhyperparameters:\n");
    for (size_t i = 0; alen && i < kvs_gguf_n_kv(g); i++) {
        const char *k = kvs_gguf_key(g, i);
        if (strlen(k) > alen && !memcmp(k, arch, alen) && k[alen] == '.') {
            printf("  %s = ", k);
            print_value(g, i);
            printf(" (%s)\n", gtype_name(kvs_gguf_kv_type(g, i)));
        }
    }

    int64_t ti = kvs_gguf_find_key(g, "tokenizer.ggml.tokens");
    uint64_t vocab = ti >= 0 ? kvs_gguf_arr_n(g, (size_t)ti) : 0;
    const char *tm = "";
    size_t tml = 0;
    printf("vocabulary: %" PRIu64 " tokens, tokenizer model ", vocab);
    if (kvs_gguf_get_str(g, "tokenizer.ggml.model", &tm, &tml) == KVS_OK)
        print_quoted(tm, tml, 60);
    else
        fputs("(none)", stdout);
    const char *pre;
    size_t prel;
    if (kvs_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &prel) == KVS_OK) {
        fputs(", pre-tokenizer ", stdout);
        print_quoted(pre, prel, 60);
    }
    putchar('\n');

    size_t nt = kvs_gguf_n_tensors(g);
    uint64_t total = 0;
    uint64_t type_count[KVS_TYPE_COUNT] = { 0 }, type_bytes[KVS_TYPE_COUNT] = { 0 };
    uint64_t other_count = 0, other_bytes = 0;
    struct block_sum *blocks = nt ? calloc(nt, sizeof *blocks) : NULL;
    size_t nb = 0;
    if (nt && !blocks) {
        fprintf(stderr, "kvasir gguf info: out of memory\n");
        kvs_gguf_close(g);
        return 1;
    }
    for (size_t i = 0; i < nt; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        total += t->bytes;
        type_count[t->type]++;
        type_bytes[t->type] += t->bytes;
        uint32_t b;
        if (block_of(t->name, &b)) {
            size_t j = 0;
            while (j < nb && blocks[j].blk != b)
                j++;
            if (j == nb)
                blocks[nb++].blk = b;
            blocks[j].count++;
            blocks[j].bytes += t->bytes;
        } else {
            other_count++;
            other_bytes += t->bytes;
        }
    }
    printf("tensors: %zu, %" PRIu64 " bytes\n", nt, total);
    printf("bytes by type:\n");
    for (int ty = 0; ty < KVS_TYPE_COUNT; ty++)
        if (type_count[ty])
            printf("  %-8s %6" PRIu64 " tensors %14" PRIu64 " bytes\n", kvs_type_name((enum kvs_type)ty),
                   type_count[ty], type_bytes[ty]);
    if (nb > 1) qsort(blocks, nb, sizeof *blocks, cmp_block); /* blocks is NULL for 0 tensors */
    uint32_t n_main = 0; /* block_count - nextn_predict_layers: the ring's blocks */
    const bool have_main = kvs_shard_block_count(g, &n_main) == KVS_OK;
    printf("bytes by block: %zu blocks\n", nb);
    for (size_t j = 0; j < nb; j++)
        printf("  blk.%-6" PRIu32 " %6" PRIu64 " tensors %14" PRIu64 " bytes%s\n", blocks[j].blk, blocks[j].count,
               blocks[j].bytes, have_main && blocks[j].blk >= n_main ? "  (nextn/MTP: in no window)" : "");
    printf("  %-10s %6" PRIu64 " tensors %14" PRIu64 " bytes\n", "non-block", other_count, other_bytes);
    if (have_main)
        printf("main blocks: %" PRIu32 " (windows, shards and the planner count these)\n", n_main);
    free(blocks);

    uint8_t fp[32];
    char hex[65];
    e = kvs_gguf_fingerprint(g, fp);
    if (e == KVS_OK) {
        kvs_gguf_fingerprint_hex(fp, hex);
        printf("fingerprint: %s\n", hex);
    } else {
        printf("fingerprint: (error: %s)\n", kvs_strerror(e));
    }
    kvs_gguf_close(g);
    return e == KVS_OK ? 0 : 1;
}

int kvs_cli_gguf(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *sub = argv[1];
    if (!strcmp(sub, "--help") || !strcmp(sub, "-h") || !strcmp(sub, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(sub, "info"))
        return cmd_info(argc - 1, argv + 1);
    if (!strcmp(sub, "synth"))
        return kvs_cli_gguf_synth(argc - 1, argv + 1);
    fprintf(stderr, "kvasir gguf: unknown subcommand '%s'\n", sub);
    usage(stderr);
    return 2;
}

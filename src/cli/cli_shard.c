/* kvasir shard extract | index | fetch | synth-sparse */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "shard/shard.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir shard extract -m FULL.gguf --window BEGIN:END -o STAGE.gguf\n"
            "       kvasir shard index FULL.gguf -o FULL.gguf.kvindex.json   (prints content_id=HEX)\n"
            "       kvasir shard fetch --url URL --window BEGIN:END -o STAGE.gguf [--index URL_OR_FILE|auto|none]\n"
            "                          [--content-id HEX] [--limit-rate BYTES_PER_S] [--header-bytes N]\n"
            "                          [--low-speed BYTES_PER_S] [--low-speed-time S] [--progress auto|lines|none]\n"
            "\n"
            "A shard of the window [BEGIN,END) holds the source's metadata plus the tensors of blocks\n"
            "BEGIN..END-1 (the embedding if BEGIN is 0, the output head if END is the block count).\n"
            "fetch downloads only those bytes with HTTP range requests; a rerun resumes an\n"
            "interrupted fetch per tensor, and finds a finished output (same window, same model,\n"
            "tensor digests intact) complete without downloading it again.\n"
            "--index auto (the default) uses URL.kvindex.json when the server has it (kvasir seed serves\n"
            "the index files beside the models) and fetches UNVERIFIED, saying so on stderr, when it\n"
            "answers 404; --index none never looks for one.\n"
            "--content-id HEX: the model's trusted content id (from the manifest or the market listing,\n"
            "see docs/FORMATS.md): the index must have it, so a server cannot vouch for its own bytes.\n"
            "A transfer slower than --low-speed bytes/s (default 1024) for --low-speed-time seconds\n"
            "(default 15) fails; header and index requests also have a 120 s deadline.\n"
            "On success fetch prints one line: 'fetched header_bytes=.. data_bytes=.. window_bytes=..\n"
            "skipped_bytes=.. header_reused_bytes=.. requests=.. tensors=.. resumed=.. verified=yes|no\n"
            "trusted=yes|no content_id=HEX|none'.\n");
}

static bool parse_u64_arg(const char *s, uint64_t *v)
{
    if (!s || *s < '0' || *s > '9')
        return false;
    errno = 0;
    char *end = NULL;
    unsigned long long x = strtoull(s, &end, 10);
    if (errno || *end != '\0')
        return false;
    *v = x;
    return true;
}

/* True when out names the same file as in (also through another path or a
 * link): writing it would replace the model being read. */
static bool same_file(const char *in, const char *out)
{
    struct stat a, b;
    return stat(in, &a) == 0 && stat(out, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

static int cmd_extract(int argc, char **argv)
{
    const char *in = NULL, *out = NULL, *win = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-m") && i + 1 < argc)
            in = argv[++i];
        else if (!strcmp(argv[i], "--window") && i + 1 < argc)
            win = argv[++i];
        else if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out = argv[++i];
        else {
            usage(stderr);
            return 2;
        }
    }
    uint32_t b, e;
    if (!in || !out || !win || kvs_shard_parse_window(win, &b, &e) != KVS_OK) {
        fprintf(stderr, "kvasir shard extract: need -m FILE, --window BEGIN:END (BEGIN < END) and -o FILE\n");
        return 2;
    }
    if (same_file(in, out)) {
        fprintf(stderr, "kvasir shard extract: -o %s is the input model itself: refusing to overwrite it\n", out);
        return 2;
    }
    char msg[512] = "";
    struct kvs_gguf *g = NULL;
    kvs_err err = kvs_gguf_open(in, &g, msg, sizeof msg);
    if (!err)
        err = kvs_shard_extract(g, b, e, out, msg, sizeof msg);
    kvs_gguf_close(g);
    if (err) {
        fprintf(stderr, "kvasir shard extract: %s: %s\n", kvs_strerror(err), msg);
        return 1;
    }
    return 0;
}

static int cmd_index(int argc, char **argv)
{
    const char *in = NULL, *out = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-o") && i + 1 < argc)
            out = argv[++i];
        else if (argv[i][0] != '-' && !in)
            in = argv[i];
        else {
            usage(stderr);
            return 2;
        }
    }
    if (!in || !out) {
        fprintf(stderr, "kvasir shard index: need FILE and -o OUT.json\n");
        return 2;
    }
    if (same_file(in, out)) {
        fprintf(stderr, "kvasir shard index: -o %s is the input model itself: refusing to overwrite it\n", out);
        return 2;
    }
    char msg[512] = "";
    struct kvs_gguf *g = NULL;
    struct kvs_shard_index ix = { 0 };
    kvs_err err = kvs_gguf_open(in, &g, msg, sizeof msg);
    if (!err)
        err = kvs_shard_index_build(g, &ix, msg, sizeof msg);
    if (!err)
        err = kvs_shard_index_save(&ix, out, msg, sizeof msg);
    uint8_t cid[32];
    char cidhex[65];
    if (!err && kvs_shard_index_content_id(&ix, cid) == KVS_OK) {
        kvs_shard_hex(cid, cidhex);
        printf("content_id=%s\n", cidhex); /* what a manifest or a market listing should carry */
    }
    kvs_shard_index_free(&ix);
    kvs_gguf_close(g);
    if (err) {
        fprintf(stderr, "kvasir shard index: %s: %s\n", kvs_strerror(err), msg);
        return 1;
    }
    return 0;
}

static int cmd_fetch(int argc, char **argv)
{
    struct kvs_shard_fetch_params p = kvs_shard_fetch_default_params();
    const char *win = NULL;
    p.index = "auto";
    p.index_optional = true;
    uint64_t ls_time = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--url") && v)
            p.url = argv[++i];
        else if (!strcmp(a, "--window") && v)
            win = argv[++i];
        else if (!strcmp(a, "-o") && v)
            p.out_path = argv[++i];
        else if (!strcmp(a, "--index") && v) {
            p.index = argv[++i];
            p.index_optional = !strcmp(p.index, "auto");
            if (!strcmp(p.index, "none"))
                p.index = NULL;
        }
        else if (!strcmp(a, "--content-id") && v)
            p.content_id = argv[++i];
        else if (!strcmp(a, "--low-speed") && v && parse_u64_arg(v, &p.low_speed_limit) && p.low_speed_limit)
            i++;
        else if (!strcmp(a, "--low-speed-time") && v && parse_u64_arg(v, &ls_time) && ls_time && ls_time < 86400) {
            p.low_speed_time = (uint32_t)ls_time;
            i++;
        }
        else if (!strcmp(a, "--limit-rate") && v && parse_u64_arg(v, &p.limit_rate))
            i++;
        else if (!strcmp(a, "--header-bytes") && v && parse_u64_arg(v, &p.initial_header) && p.initial_header)
            i++;
        else if (!strcmp(a, "--progress") && v) {
            i++;
            if (!strcmp(v, "auto"))
                p.progress = -1;
            else if (!strcmp(v, "lines"))
                p.progress = 1;
            else if (!strcmp(v, "none"))
                p.progress = 0;
            else {
                usage(stderr);
                return 2;
            }
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (!p.url || !p.out_path || !win || kvs_shard_parse_window(win, &p.begin, &p.end) != KVS_OK) {
        fprintf(stderr, "kvasir shard fetch: need --url URL, --window BEGIN:END (BEGIN < END) and -o FILE\n");
        return 2;
    }
    /* --index auto: the index `kvasir shard index` names FULL.gguf.kvindex.json, beside the model on
     * the same server (kvasir seed serves it); a server without one gives an unverified fetch. */
    char auto_ix[4096];
    if (p.index_optional) {
        if (snprintf(auto_ix, sizeof auto_ix, "%s.kvindex.json", p.url) >= (int)sizeof auto_ix) {
            fprintf(stderr, "kvasir shard fetch: --url too long\n");
            return 2;
        }
        p.index = auto_ix;
    }
    char msg[1024] = "";
    struct kvs_shard_fetch_stats st;
    kvs_err err = kvs_shard_fetch(&p, &st, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvasir shard fetch: %s: %s\n", kvs_strerror(err), msg);
        return 1;
    }
    if (!st.verified) /* on the terminal whatever the log level: nothing checked these bytes */
        fprintf(stderr,
                "kvasir shard fetch: WARNING: %s is UNVERIFIED: %s, so nothing checked that the server sent the "
                "right bytes for each range (make one with `kvasir shard index` and serve it as %s.kvindex.json)\n",
                p.out_path, p.index ? "the server has no shard index" : "--index none", p.url);
    else if (!st.trusted)
        fprintf(stderr,
                "kvasir shard fetch: note: verified against the server's own index (content id %.16s...); "
                "give --content-id from a trusted manifest or listing to check the index itself\n",
                st.content_id);
    printf("fetched header_bytes=%" PRIu64 " data_bytes=%" PRIu64 " window_bytes=%" PRIu64 " skipped_bytes=%" PRIu64
           " header_reused_bytes=%" PRIu64 " requests=%u tensors=%u resumed=%u verified=%s trusted=%s content_id=%s\n",
           st.header_bytes, st.data_bytes, st.window_bytes, st.skipped_bytes, st.header_reused_bytes, st.n_requests, st.n_tensors,
           st.n_resumed, st.verified ? "yes" : "no", st.trusted ? "yes" : "no", st.content_id[0] ? st.content_id : "none");
    return 0;
}

/* A model shaped like Qwen3.5-122B-A10B at Q4_K-class sizes whose data
 * section is a hole: a test subject for window-only downloads. */
static int cmd_synth_sparse(int argc, char **argv)
{
    const char *out = NULL;
    uint64_t n_block = 49, n_embd = 3072, n_expert = 256, n_ff_exp = 1024, n_vocab = 248320;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-o") && v)
            out = argv[++i];
        else if (!strcmp(a, "--blocks") && v && parse_u64_arg(v, &n_block) && n_block > 0 && n_block < 10000)
            i++;
        else if (!strcmp(a, "--experts") && v && parse_u64_arg(v, &n_expert) && n_expert > 0 && n_expert <= 1024)
            i++;
        else {
            fprintf(stderr, "usage: kvasir shard synth-sparse -o FILE [--blocks N] [--experts N]\n");
            return 2;
        }
    }
    if (!out) {
        fprintf(stderr, "usage: kvasir shard synth-sparse -o FILE [--blocks N] [--experts N]\n");
        return 2;
    }
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    if (!w)
        return 1;
    kvs_err err = KVS_OK;
#define SET(call)                                                                                             \
    do {                                                                                                      \
        if (!err)                                                                                             \
            err = (call);                                                                                     \
    } while (0)
    SET(kvs_gguf_writer_set_str(w, "general.architecture", "qwen35moe"));
    SET(kvs_gguf_writer_set_str(w, "general.name", "synthetic sparse Qwen3.5-122B-A10B-like"));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.block_count", (uint32_t)n_block));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.embedding_length", (uint32_t)n_embd));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.expert_count", (uint32_t)n_expert));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.expert_used_count", 8));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.expert_feed_forward_length", (uint32_t)n_ff_exp));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.attention.head_count", 32));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.attention.head_count_kv", 2));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.nextn_predict_layers", 1));
    SET(kvs_gguf_writer_set_u32(w, "qwen35moe.vocab_size", (uint32_t)n_vocab));
    int64_t ne[4];
#define TENSOR(type, d0, d1, d2, nd, fmt, ...)                                                                  \
    do {                                                                                                      \
        char name_[64];                                                                                       \
        snprintf(name_, sizeof name_, fmt, __VA_ARGS__);                                                      \
        ne[0] = (d0), ne[1] = (d1), ne[2] = (d2), ne[3] = 1;                                                  \
        SET(kvs_gguf_writer_add_tensor(w, name_, type, nd, ne, NULL,                                          \
                                       kvs_type_row_bytes(type, ne[0]) * (uint64_t)ne[1] * (uint64_t)ne[2]));  \
    } while (0)
    TENSOR(KVS_TYPE_Q4_K, n_embd, n_vocab, 1, 2, "%s", "token_embd.weight");
    for (uint64_t b = 0; b < n_block; b++) {
        TENSOR(KVS_TYPE_F32, n_embd, 1, 1, 1, "blk.%" PRIu64 ".attn_norm.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, 8192, 1, 2, "blk.%" PRIu64 ".attn_q.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, 512, 1, 2, "blk.%" PRIu64 ".attn_k.weight", b);
        TENSOR(KVS_TYPE_Q6_K, n_embd, 512, 1, 2, "blk.%" PRIu64 ".attn_v.weight", b);
        TENSOR(KVS_TYPE_Q4_K, 8192, n_embd, 1, 2, "blk.%" PRIu64 ".attn_output.weight", b);
        TENSOR(KVS_TYPE_F32, n_embd, 1, 1, 1, "blk.%" PRIu64 ".ffn_norm.weight", b);
        TENSOR(KVS_TYPE_F32, n_embd, n_expert, 1, 2, "blk.%" PRIu64 ".ffn_gate_inp.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, n_ff_exp, n_expert, 3, "blk.%" PRIu64 ".ffn_gate_exps.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, n_ff_exp, n_expert, 3, "blk.%" PRIu64 ".ffn_up_exps.weight", b);
        /* Q4_K_M-style mix: down_exps in Q6_K on even blocks, Q5_K on odd. */
        TENSOR(b % 2 ? KVS_TYPE_Q5_K : KVS_TYPE_Q6_K, n_ff_exp, n_embd, n_expert, 3,
               "blk.%" PRIu64 ".ffn_down_exps.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, n_ff_exp, 1, 2, "blk.%" PRIu64 ".ffn_gate_shexp.weight", b);
        TENSOR(KVS_TYPE_Q4_K, n_embd, n_ff_exp, 1, 2, "blk.%" PRIu64 ".ffn_up_shexp.weight", b);
        TENSOR(KVS_TYPE_Q6_K, n_ff_exp, n_embd, 1, 2, "blk.%" PRIu64 ".ffn_down_shexp.weight", b);
    }
    TENSOR(KVS_TYPE_F32, n_embd, 1, 1, 1, "%s", "output_norm.weight");
    TENSOR(KVS_TYPE_Q6_K, n_embd, n_vocab, 1, 2, "%s", "output.weight");
#undef TENSOR
#undef SET
    if (!err)
        err = kvs_gguf_writer_write_file(w, out);
    uint64_t total = kvs_gguf_writer_total_bytes(w);
    kvs_gguf_writer_free(w);
    if (err) {
        fprintf(stderr, "kvasir shard synth-sparse: %s\n", kvs_strerror(err));
        return 1;
    }
    printf("%s: %" PRIu64 " bytes\n", out, total);
    return 0;
}

int kvs_cli_shard(int argc, char **argv)
{
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    for (int i = 2; i < argc; i++) /* `kvasir shard extract --help`: the usage, exit 0 */
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        }
    if (!strcmp(argv[1], "extract"))
        return cmd_extract(argc - 1, argv + 1);
    if (!strcmp(argv[1], "index"))
        return cmd_index(argc - 1, argv + 1);
    if (!strcmp(argv[1], "fetch"))
        return cmd_fetch(argc - 1, argv + 1);
    if (!strcmp(argv[1], "synth-sparse"))
        return cmd_synth_sparse(argc - 1, argv + 1);
    fprintf(stderr, "kvasir shard: unknown subcommand '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

/* kvasir run: generate text from a prompt in one process (the whole model as
 * one window). Only the generated text goes to stdout, streamed token by
 * token; logs and the speed summary go to stderr. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_ring.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "sampler/sampler.h"
#include "tokenizer/tokenizer.h"

struct run_opts {
    const char *model;
    const char *prompt;
    long n_predict;
    long threads;
    long n_ctx;
    long ring;     /* 0: single process; N: a local ring of N stages */
    int backend, device; /* --backend (0 cpu, 1 opencl), --device */
    bool ignore_eos;
    struct kvs_sampler_params sp;
};

static void run_usage(FILE *f)
{
    fprintf(f, "usage: kvasir run -m MODEL -p TEXT [options]\n"
               "  -m, --model PATH     GGUF model\n"
               "  -p, --prompt TEXT    prompt (special-token text such as <|im_start|> is parsed;\n"
               "                       BOS is added where the model asks for it)\n"
               "  -n, --n-predict N    tokens to generate (default 128)\n"
               "  --temp T             temperature, <= 0 greedy (default 0.8)\n"
               "  --top-k K            (default 40, <= 0 off)\n"
               "  --top-p P            (default 0.95, >= 1 off)\n"
               "  --min-p P            (default 0.05, <= 0 off)\n"
               "  --repeat-penalty R   (default 1.0 = off)\n"
               "  --seed S             sampling seed, -1 random (default random; the seed used is logged)\n"
               "  -t, --threads T      compute threads (default: the cores this process may use; with --ring N\n"
               "                       those cores / N per stage)\n"
               "  -c, --ctx N          context length (default min(model's, 4096))\n"
               "  --ignore-eos         do not stop at end-of-generation tokens\n"
               "  --ring N             run as a local ring of N stage processes on loopback; with\n"
               "                       --ring, also --prompts FILE, --parallel P, --seqs S and\n"
               "                       --boundary f32|f16 (`kvasir run --ring 2 --help` explains them)\n");
    fputs(KVS_CLI_BACKEND_HELP, f);
    fputs(KVS_CLI_MODEL_URL_HELP, f);
}

/* Returns 0 on success, 2 on a usage error, 1 if --help was printed. */
static int run_parse(int argc, char **argv, struct run_opts *o)
{
    memset(o, 0, sizeof *o);
    o->n_predict = 128;
    o->threads = kvs_cli_default_threads();
    o->sp = kvs_sampler_default_params();
    o->sp.seed = kvs_cli_random_seed(); /* --seed S or -1 overrides */
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            run_usage(stdout);
            return 1;
        }
        if (!strcmp(a, "--ignore-eos")) {
            o->ignore_eos = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvasir run: unknown option or missing value: %s\n", a);
            return 2;
        }
        long lv = 0;
        int bad = 0;
        if (kvs_cli_backend_opt(a, v, &o->backend, &o->device, &bad))
            ;
        else if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt"))
            o->prompt = v;
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict"))
            bad = kvs_cli_parse_long(v, 0, 1 << 24, &o->n_predict);
        else if (!strcmp(a, "--temp"))
            bad = kvs_cli_parse_float(v, &o->sp.temp);
        else if (!strcmp(a, "--top-k")) {
            bad = kvs_cli_parse_long(v, -1, 1 << 30, &lv);
            o->sp.top_k = (int32_t)lv;
        } else if (!strcmp(a, "--top-p"))
            bad = kvs_cli_parse_float(v, &o->sp.top_p);
        else if (!strcmp(a, "--min-p"))
            bad = kvs_cli_parse_float(v, &o->sp.min_p);
        else if (!strcmp(a, "--repeat-penalty"))
            bad = kvs_cli_parse_float(v, &o->sp.repeat_penalty) || !(o->sp.repeat_penalty > 0.0f);
        else if (!strcmp(a, "--seed")) {
            bad = kvs_cli_parse_seed(v, &o->sp.seed);
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t"))
            bad = kvs_cli_parse_long(v, 1, 512, &o->threads);
        else if (!strcmp(a, "--ctx") || !strcmp(a, "-c"))
            bad = kvs_cli_parse_long(v, 1, 1 << 24, &o->n_ctx);
        else if (!strcmp(a, "--ring"))
            bad = kvs_cli_parse_long(v, 1, 1024, &o->ring);
        else {
            if (!strcmp(a, "--boundary") || !strcmp(a, "--prompts") || !strcmp(a, "--parallel") ||
                !strcmp(a, "--seqs"))
                fprintf(stderr, "kvasir run: %s is an option of a ring: add --ring N\n", a);
            else
                fprintf(stderr, "kvasir run: unknown option: %s\n", a);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir run: bad value for %s: %s\n", a, v);
            return 2;
        }
        i++;
    }
    if (!o->model || !o->prompt) {
        fprintf(stderr, "kvasir run: -m MODEL and -p TEXT are required\n");
        return 2;
    }
    return 0;
}

static double run_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int run_single(const struct run_opts *o)
{
    int rc = 1;
    char err[512] = "";
    struct kvs_gguf *g = NULL;
    struct kvs_tokenizer *tok = NULL;
    struct kvs_model *m = NULL;
    struct kvs_sampler *smp = NULL;
    int32_t *ids = NULL, *pos = NULL, *seq = NULL;
    float *logits = NULL;

    const double t_load = kvs_cli_now_ms();
    kvs_err e = kvs_gguf_open(o->model, &g, err, sizeof err);
    if (e) {
        KVS_LOGE("run: %s: %s (%s)", o->model, kvs_strerror(e), err);
        goto done;
    }
    if (kvs_cli_need_whole_model(g, "run", o->model)) goto done;
    if ((e = kvs_tokenizer_load(g, &tok, err, sizeof err))) {
        KVS_LOGE("run: tokenizer: %s (%s)", kvs_strerror(e), err);
        goto done;
    }
    const size_t plen = strlen(o->prompt);
    const bool add_bos = kvs_tokenizer_add_bos(tok);
    int64_t n_prompt = kvs_tokenize(tok, o->prompt, plen, add_bos, true, NULL, 0);
    if (n_prompt < 0) {
        KVS_LOGE("run: tokenize: %s", kvs_strerror((kvs_err)-n_prompt));
        goto done;
    }
    if (n_prompt == 0 || n_prompt > (1 << 24)) {
        KVS_LOGE("run: the prompt gives %lld tokens", (long long)n_prompt);
        goto done;
    }
    ids = malloc((size_t)n_prompt * sizeof *ids);
    if (!ids || kvs_tokenize(tok, o->prompt, plen, add_bos, true, ids, n_prompt) != n_prompt) {
        KVS_LOGE("run: tokenize failed");
        goto done;
    }

    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_ctx = (int32_t)o->n_ctx;
    mp.n_threads = (int32_t)o->threads;
    mp.backend = o->backend ? KVS_BACKEND_OPENCL : KVS_BACKEND_CPU;
    mp.device = o->device;
    if ((e = kvs_model_load(g, &mp, &m, err, sizeof err))) {
        KVS_LOGE("run: model: %s (%s)", kvs_strerror(e), err);
        goto done;
    }
    const int32_t n_ctx = kvs_model_n_ctx(m), n_batch = mp.n_batch;
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    if (n_prompt >= n_ctx) {
        KVS_LOGE("run: the prompt (%lld tokens) does not fit the context (%d)", (long long)n_prompt, (int)n_ctx);
        goto done;
    }
    if ((e = kvs_sampler_create(&o->sp, V, &smp))) {
        KVS_LOGE("run: sampler: %s", kvs_strerror(e));
        goto done;
    }
    logits = malloc((size_t)V * sizeof(float));
    pos = malloc((size_t)n_batch * sizeof(int32_t));
    seq = calloc((size_t)n_batch, sizeof(int32_t));
    if (!logits || !pos || !seq) {
        KVS_LOGE("run: out of memory");
        goto done;
    }
    KVS_LOGI("run: %s, %lld prompt tokens, n_ctx %d, %ld threads", kvs_model_hparams(m)->arch_name,
             (long long)n_prompt, (int)n_ctx, o->threads);
    if (o->sp.temp > 0.0f)
        KVS_LOGI("run: sampling seed %llu (--seed %llu repeats this output)", (unsigned long long)o->sp.seed,
                 (unsigned long long)o->sp.seed);

    /* Prefill in chunks of n_batch; logits of the last row only. */
    const double t0 = run_now(), load_ms = kvs_cli_now_ms() - t_load;
    double t_first = -1.0;
    for (int64_t c = 0; c < n_prompt; c += n_batch) {
        const int32_t cnt = (int32_t)(n_prompt - c < n_batch ? n_prompt - c : n_batch);
        for (int32_t i = 0; i < cnt; i++) pos[i] = (int32_t)(c + i);
        struct kvs_batch b = { .n_tokens = cnt, .token = ids + c, .seq = seq, .pos = pos };
        if ((e = kvs_model_forward(m, &b, logits))) {
            KVS_LOGE("run: prefill: %s", kvs_strerror(e));
            goto done;
        }
    }
    for (int64_t i = 0; i < n_prompt; i++) kvs_sampler_accept(smp, ids[i]);

    struct kvs_detok dt;
    kvs_detok_init(&dt, tok, false);
    char piece[256];
    long n_gen = 0, n_decode = 0;
    int32_t cur = (int32_t)n_prompt;
    while (n_gen < o->n_predict) {
        int32_t id = kvs_sampler_sample(smp, logits);
        if (id < 0 || id >= V) {
            KVS_LOGE("run: sampler returned %d", (int)id);
            goto done;
        }
        if (t_first < 0) t_first = run_now();
        if (!o->ignore_eos && kvs_tokenizer_is_eog(tok, id)) break;
        kvs_sampler_accept(smp, id);
        n_gen++;
        int64_t w = kvs_detok_push(&dt, id, piece, sizeof piece);
        if (w > 0) {
            fwrite(piece, 1, (size_t)(w < (int64_t)sizeof piece ? w : (int64_t)sizeof piece), stdout);
            fflush(stdout);
        }
        if (n_gen >= o->n_predict) break;
        if (cur >= n_ctx) {
            KVS_LOGW("run: context full (%d tokens)", (int)n_ctx);
            break;
        }
        int8_t one = 1;
        struct kvs_batch b = { .n_tokens = 1, .token = &id, .seq = seq, .pos = &cur, .logits = &one };
        if ((e = kvs_model_forward(m, &b, logits))) {
            KVS_LOGE("run: decode at position %d: %s", (int)cur, kvs_strerror(e));
            goto done;
        }
        cur++;
        n_decode++;
    }
    int64_t w = kvs_detok_flush(&dt, piece, sizeof piece);
    if (w > 0) fwrite(piece, 1, (size_t)(w < (int64_t)sizeof piece ? w : (int64_t)sizeof piece), stdout);
    if (isatty(STDOUT_FILENO)) fputc('\n', stdout);
    fflush(stdout);
    const double t2 = run_now();
    if (t_first < 0) t_first = t2;
    /* prompt: the prefill and the first sample; decode: every step after the first token */
    struct kvs_cli_summary sum = { .load_ms = load_ms, .n_requests = 1, .n_prompt = n_prompt,
                                   .prompt_ms = (t_first - t0) * 1e3, .n_gen = n_gen, .n_decode = n_decode,
                                   .decode_ms = (t2 - t_first) * 1e3, .ttft_ms = (t_first - t0) * 1e3 };
    kvs_cli_print_summary(&sum);
    rc = 0;
done:
    free(ids);
    free(pos);
    free(seq);
    free(logits);
    kvs_sampler_free(smp);
    kvs_model_free(m);
    kvs_tokenizer_free(tok);
    kvs_gguf_close(g);
    return rc;
}

int kvs_cli_run(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) /* a local ring: src/cli/cli_ring.c parses its options */
        if (!strcmp(argv[i], "--ring")) return kvs_cli_run_ring(argc, argv);
    struct run_opts o;
    int r = run_parse(argc, argv, &o);
    if (r == 1) return 0;
    if (r) {
        run_usage(stderr);
        return 2;
    }
    return run_single(&o);
}

/* kvasir eval: teacher-forced evaluation of token ids; one JSON line per
 * position with the top-K next-token probabilities (full softmax at
 * temperature 1), the format of ../shared/models/README.md's `positions`. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "model/model.h"

#define EVAL_MAX_TOKENS 1000000
#define EVAL_MAX_TOP 1000

static void eval_usage(FILE *f)
{
    fprintf(f, "usage: kvasir eval -m MODEL --tokens ID,ID,... [--top K] [--threads T] [--batch N]\n"
               "                  [--backend cpu|opencl] [--device N]\n"
               "  Evaluates the ids teacher-forced and prints one JSON line per position:\n"
               "  {\"pos\": i, \"top\": [[id, prob], ...]} (K entries, default 8).\n");
    fputs(KVS_CLI_BACKEND_HELP, f);
    fputs(KVS_CLI_MODEL_URL_HELP, f);
}

/* Parses "1,2,3" into a malloc'd array. Returns the count or -1. */
static int64_t eval_parse_tokens(const char *s, int32_t **out)
{
    size_t cap = 1;
    for (const char *p = s; *p; p++) cap += *p == ',';
    if (cap > EVAL_MAX_TOKENS) return -1;
    int32_t *ids = malloc(cap * sizeof *ids);
    if (!ids) return -1;
    int64_t n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (errno || end == p || v < 0 || v > INT32_MAX || (*end && *end != ',')) {
            free(ids);
            return -1;
        }
        ids[n++] = (int32_t)v;
        p = *end ? end + 1 : end;
    }
    *out = ids;
    return n;
}

int kvs_cli_eval(int argc, char **argv)
{
    const char *model_path = NULL, *tokens = NULL;
    long top = 8, threads = kvs_cli_default_threads(), batch = 512;
    int backend = 0, device = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            eval_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir eval: unknown option or missing value: %s\n", a);
            eval_usage(stderr);
            return 2;
        }
        i++; /* v is this option's value */
        int bad = 0;
        if (kvs_cli_backend_opt(a, v, &backend, &device, &bad))
            ;
        else if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            model_path = v;
        else if (!strcmp(a, "--tokens"))
            tokens = v;
        else if (!strcmp(a, "--top"))
            bad = kvs_cli_parse_long(v, 1, EVAL_MAX_TOP, &top);
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t"))
            bad = kvs_cli_parse_long(v, 1, 512, &threads);
        else if (!strcmp(a, "--batch") || !strcmp(a, "-b"))
            bad = kvs_cli_parse_long(v, 1, 65536, &batch);
        else {
            fprintf(stderr, "kvasir eval: unknown option: %s\n", a);
            eval_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir eval: bad value for %s: %s\n", a, v);
            return 2;
        }
    }
    if (!model_path || !tokens) {
        eval_usage(stderr);
        return 2;
    }
    int32_t *ids = NULL;
    int64_t n = eval_parse_tokens(tokens, &ids);
    if (n <= 0) {
        fprintf(stderr, "kvasir eval: --tokens wants a comma-separated list of non-negative ids\n");
        free(ids);
        return 2;
    }

    int rc = 1;
    char err[4096] = "";
    struct kvs_gguf *g = NULL;
    struct kvs_model *m = NULL;
    float *logits = NULL;
    double *p = NULL;
    int32_t *seq = NULL, *pos = NULL, *best = NULL;
    int8_t *want = NULL;
    kvs_err e = kvs_gguf_open(model_path, &g, err, sizeof err);
    if (e) {
        KVS_LOGE("eval: %s: %s (%s)", model_path, kvs_strerror(e), err);
        goto done;
    }
    if (kvs_cli_need_whole_model(g, "eval", model_path)) goto done;
    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_ctx = (int32_t)n;
    mp.n_batch = (int32_t)(n < batch ? n : batch);
    mp.n_threads = (int32_t)threads;
    mp.backend = backend ? KVS_BACKEND_OPENCL : KVS_BACKEND_CPU;
    mp.device = device;
    if ((e = kvs_model_load(g, &mp, &m, err, sizeof err))) {
        KVS_LOGE("eval: %s: %s (%s)", model_path, kvs_strerror(e), err);
        goto done;
    }
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] >= V) {
            KVS_LOGE("eval: token id %d at index %lld is outside the vocabulary (%d)", (int)ids[i], (long long)i,
                     (int)V);
            goto done;
        }
    if (top > V) top = V;
    const int32_t nb = mp.n_batch;
    logits = malloc((size_t)nb * (size_t)V * sizeof(float));
    p = malloc((size_t)V * sizeof(double));
    seq = calloc((size_t)nb, sizeof(int32_t));
    pos = malloc((size_t)nb * sizeof(int32_t));
    want = malloc((size_t)nb);
    best = malloc((size_t)top * sizeof(int32_t));
    if (!logits || !p || !seq || !pos || !want || !best) {
        KVS_LOGE("eval: out of memory");
        goto done;
    }
    memset(want, 1, (size_t)nb);
    for (int64_t c = 0; c < n; c += nb) {
        const int32_t cnt = (int32_t)(n - c < nb ? n - c : nb);
        for (int32_t i = 0; i < cnt; i++) pos[i] = (int32_t)(c + i);
        struct kvs_batch b = { .n_tokens = cnt, .token = ids + c, .seq = seq, .pos = pos, .logits = want };
        if ((e = kvs_model_forward(m, &b, logits))) {
            KVS_LOGE("eval: forward at position %lld: %s", (long long)c, kvs_strerror(e));
            goto done;
        }
        for (int32_t i = 0; i < cnt; i++) {
            const float *l = logits + (size_t)i * (size_t)V;
            double mx = -INFINITY, sum = 0.0;
            for (int32_t v = 0; v < V; v++) mx = l[v] > mx ? l[v] : mx;
            for (int32_t v = 0; v < V; v++) sum += p[v] = exp((double)l[v] - mx);
            /* Top-K by repeated selection (K is small); ties: lower id. */
            for (long k = 0; k < top; k++) {
                int32_t bi = -1;
                for (int32_t v = 0; v < V; v++) {
                    if (bi >= 0 && !(p[v] > p[bi])) continue;
                    bool taken = false;
                    for (long u = 0; u < k && !taken; u++) taken = best[u] == v;
                    if (!taken) bi = v;
                }
                best[k] = bi;
            }
            printf("{\"pos\": %lld, \"top\": [", (long long)(c + i));
            for (long k = 0; k < top; k++)
                printf("%s[%d, %.9g]", k ? ", " : "", (int)best[k], p[best[k]] / sum);
            printf("]}\n");
        }
    }
    fflush(stdout);
    rc = 0;
done:
    free(ids);
    free(logits);
    free(p);
    free(seq);
    free(pos);
    free(want);
    free(best);
    kvs_model_free(m);
    kvs_gguf_close(g);
    return rc;
}

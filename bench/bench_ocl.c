/* bench_ocl: decode and prefill speed of the OpenCL backend (one window of
 * the whole model on OpenCL device N), beside the CPU backend measured in
 * the same run as the baseline, with the weight bandwidth the OpenCL decode
 * reaches against the device's read bandwidth (kvs_ocl_measure, same run).
 * On PoCL (an OpenCL implementation on the CPU) the figures are a smoke
 * test of the path, not a GPU's speed.
 *
 * Model: --model PATH (default /tmp/kvasir-bench-qwen3-0.6b-q8_0.gguf, the
 * Qwen3-0.6B-shaped Q8_0 model of bench_engine, made with `kvasir gguf
 * synth` if absent). Decode: --decode N greedy steps (default 16) after an
 * 8-token prompt, best of 2; prefill: one --prefill N token batch (default
 * 32), best of 2. Prints the figures and a line
 *   RESULT backend=opencl decode_tps=.. prefill_tps=.. weight_gbps=.. device_gbps=.. cpu_decode_tps=.. cpu_prefill_tps=..
 *
 * usage: bench_ocl [--model PATH] [--device N] [--threads T] [--decode N] [--prefill N] [--kvasir PATH] [--no-cpu]
 * Exit status: 0, or 2 on error (no targets: figures only). */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "lib/bench_ring4.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "ocl/ocl.h"

extern char **environ;

#define DEFAULT_MODEL KVS_BENCH_QWEN3_Q8_0
#define N_PROMPT 8
#define N_REPS 2

/* Bytes of weights one decode token reads (as bench_engine counts them). */
static uint64_t decode_weight_bytes(const struct kvs_gguf *g)
{
    uint64_t sum = 0;
    const struct kvs_gguf_tensor *embd = kvs_gguf_find_tensor(g, "token_embd.weight");
    const bool tied = kvs_gguf_find_tensor(g, "output.weight") == NULL;
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        sum += t == embd && !tied ? kvs_type_row_bytes(t->type, t->ne[0]) : t->bytes;
    }
    return sum;
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

struct figures {
    double decode_s, prefill_s; /* best seconds for n_decode steps / one prefill batch */
    double load_s;
};

static int run_backend(const struct kvs_gguf *g, enum kvs_backend be, int device, int threads, int n_decode,
                       int n_prefill, struct figures *f)
{
    struct kvs_model_params p = kvs_model_default_params();
    p.n_ctx = N_PROMPT + n_decode + n_prefill + 8;
    p.n_batch = n_prefill > N_PROMPT ? n_prefill : N_PROMPT;
    p.n_threads = threads;
    p.backend = be;
    p.device = device;
    struct kvs_model *m = NULL;
    char err[4096] = "";
    double t0 = kvs_bench_now();
    kvs_err e = kvs_model_load(g, &p, &m, err, sizeof err);
    if (e) {
        fprintf(stderr, "bench_ocl: %s: load: %s (%s)\n", kvs_backend_name(be), kvs_strerror(e), err);
        return -1;
    }
    f->load_s = kvs_bench_now() - t0;
    const int32_t V = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)V * sizeof(float));
    int32_t *tok = malloc((size_t)p.n_batch * sizeof(int32_t)), *pos = malloc((size_t)p.n_batch * sizeof(int32_t));
    int32_t *seq = calloc((size_t)p.n_batch, sizeof(int32_t));
    if (!logits || !tok || !pos || !seq) {
        fprintf(stderr, "bench_ocl: out of memory\n");
        return -1;
    }
    for (int32_t i = 0; i < p.n_batch; i++) tok[i] = (i * 7919 + 13) % V, pos[i] = i;
    f->decode_s = f->prefill_s = 1e30;
    for (int r = 0; r < N_REPS && !e; r++) {
        kvs_model_seq_clear(m, 0);
        struct kvs_batch b = { .n_tokens = n_prefill, .token = tok, .seq = seq, .pos = pos };
        t0 = kvs_bench_now();
        if ((e = kvs_model_forward(m, &b, logits))) break;
        const double dp = kvs_bench_now() - t0;
        f->prefill_s = dp < f->prefill_s ? dp : f->prefill_s;
        kvs_model_seq_clear(m, 0);
        b.n_tokens = N_PROMPT;
        if ((e = kvs_model_forward(m, &b, logits))) break;
        t0 = kvs_bench_now();
        for (int i = 0; i < n_decode && !e; i++) {
            int32_t t = argmax(logits, V), ps = N_PROMPT + i;
            struct kvs_batch d = { .n_tokens = 1, .token = &t, .seq = seq, .pos = &ps };
            e = kvs_model_forward(m, &d, logits);
        }
        const double dd = kvs_bench_now() - t0;
        f->decode_s = dd < f->decode_s ? dd : f->decode_s;
    }
    if (e) fprintf(stderr, "bench_ocl: %s: forward: %s\n", kvs_backend_name(be), kvs_strerror(e));
    free(logits);
    free(tok);
    free(pos);
    free(seq);
    kvs_model_free(m);
    return e ? -1 : 0;
}

int main(int argc, char **argv)
{
    const char *model_path = DEFAULT_MODEL, *kvasir = getenv("KVASIR_BIN");
    long device = 0, threads = 2, n_decode = 16, n_prefill = 32;
    bool cpu = true;
    char self_kvasir[PATH_MAX];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long *num = !strcmp(a, "--device") ? &device : !strcmp(a, "--threads") ? &threads
                  : !strcmp(a, "--decode") ? &n_decode : !strcmp(a, "--prefill") ? &n_prefill : NULL;
        if (!strcmp(a, "--no-cpu")) {
            cpu = false;
        } else if (num && v) {
            char *end;
            *num = strtol(v, &end, 10);
            if (*end || *num < (num == &device ? 0 : 1) || *num > 4096) {
                fprintf(stderr, "bench_ocl: bad value for %s\n", a);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--model") && v) {
            model_path = argv[++i];
        } else if (!strcmp(a, "--kvasir") && v) {
            kvasir = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_ocl [--model PATH] [--device N] [--threads T] [--decode N] [--prefill N] "
                            "[--kvasir PATH] [--no-cpu]\n");
            return 2;
        }
    }
    struct stat st;
    if (stat(model_path, &st) != 0 && (!(kvasir = kvs_bench_kvasir(kvasir, self_kvasir, sizeof self_kvasir)) ||
                                       kvs_bench_model("bench_ocl", kvasir, model_path, "q8_0")))
        return 2;
    char err[4096] = "";
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(model_path, &g, err, sizeof err);
    if (e) {
        fprintf(stderr, "bench_ocl: %s: %s (%s)\n", model_path, kvs_strerror(e), err);
        return 2;
    }
    struct kvs_ocl *c = NULL;
    if ((e = kvs_ocl_open((int)device, &c, err, sizeof err))) {
        fprintf(stderr, "bench_ocl: %s\n", err);
        return 2;
    }
    double dev_gbps = 0, dev_gflops = 0;
    const struct kvs_ocl_device_info di = *kvs_ocl_info(c);
    if ((e = kvs_ocl_measure(c, (size_t)512 << 20, &dev_gbps, &dev_gflops, err, sizeof err))) {
        fprintf(stderr, "bench_ocl: measuring the device: %s\n", err);
        return 2;
    }
    kvs_ocl_close(c);
    const uint64_t wbytes = decode_weight_bytes(g);
    const struct kvs_gguf_tensor *t0 = kvs_gguf_find_tensor(g, "blk.0.attn_q.weight");
    printf("model: %s (%.1f MB of weights per decode token, blk.0.attn_q %s)\n", model_path, (double)wbytes / 1e6,
           t0 ? kvs_type_name(t0->type) : "?");
    printf("device %ld: %s (%s), %.0f MiB, %u compute units: read %.2f GB/s, %.1f GFLOP/s (measured now)\n", device,
           di.name, di.platform, (double)di.global_mem / 1048576.0, di.compute_units, dev_gbps, dev_gflops);
    struct figures fo, fc = { 0 };
    if (run_backend(g, KVS_BACKEND_OPENCL, (int)device, (int)threads, (int)n_decode, (int)n_prefill, &fo)) return 2;
    if (cpu && run_backend(g, KVS_BACKEND_CPU, 0, (int)threads, (int)n_decode, (int)n_prefill, &fc)) return 2;
    const double o_dec = (double)n_decode / fo.decode_s, o_pre = (double)n_prefill / fo.prefill_s;
    const double wgbps = (double)wbytes * o_dec / 1e9;
    printf("opencl: load %.2f s (upload), decode %.2f tok/s (%ld steps, best of %d), prefill %.2f tok/s "
           "(%ld tokens, best of %d)\n", fo.load_s, o_dec, n_decode, N_REPS, o_pre, n_prefill, N_REPS);
    printf("opencl: decode reads weights at %.2f GB/s = %.0f%% of the device's measured %.2f GB/s\n", wgbps,
           100.0 * wgbps / dev_gbps, dev_gbps);
    double c_dec = 0, c_pre = 0;
    if (cpu) {
        c_dec = (double)n_decode / fc.decode_s;
        c_pre = (double)n_prefill / fc.prefill_s;
        printf("cpu (%ld threads, baseline, same run): decode %.2f tok/s, prefill %.2f tok/s; opencl/cpu: decode "
               "%.2fx, prefill %.2fx\n", threads, c_dec, c_pre, o_dec / c_dec, o_pre / c_pre);
    }
    printf("RESULT backend=opencl decode_tps=%.3f prefill_tps=%.3f weight_gbps=%.3f device_gbps=%.3f "
           "cpu_decode_tps=%.3f cpu_prefill_tps=%.3f\n", o_dec, o_pre, wgbps, dev_gbps, c_dec, c_pre);
    kvs_gguf_close(g);
    return 0;
}

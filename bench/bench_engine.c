/* bench_engine: single-process decode and prefill speed on a Qwen3-0.6B-shaped
 * model (arch qwen3, n_embd 1024, 28 blocks, 16 heads / 8 KV heads, head_dim
 * 128, FFN 3072, vocab 151936, tied embedding, Q8_0) with random weights made
 * by `kvasir gguf synth` (reused from /tmp if present); with --shape qwen35 a
 * Qwen3.5-shaped hybrid (arch qwen35, n_embd 1024, 24 blocks: 18 Gated
 * DeltaNet with 8 key / 16 value heads of 128 and 6 gated attention with 8
 * heads of 256 / 2 KV heads, RoPE on 64 dims, FFN 3584, vocab 151936, tied,
 * Q8_0: 0.66 GB), whose figures add the recurrent state the decode reads
 * and writes per token; it has no targets (figures only, exit 0).
 *
 * Prints decode tok/s (64 greedy decode steps after an 8-token prompt, best of
 * 3), prefill tok/s (one 32-token batch, best of 3), the weight bandwidth the
 * decode achieves (bytes of weights read per decode token / time per token)
 * beside this machine's read bandwidth measured in the same run (2 threads
 * summing a 512 MiB buffer, before and after the model runs, the better of
 * the two), the CPU time decode used per wall second (below n_threads: the
 * machine was shared), PASS/FAIL against the targets (decode >= 35 tok/s,
 * prefill >= 150 tok/s), and a final machine-readable line
 *   RESULT decode_tps=.. prefill_tps=.. weight_gbps=.. read_gbps=..
 *
 * usage: bench_engine [--shape qwen3|qwen35] [--model PATH] [--kvasir PATH] [--threads N]
 *   --shape   the model shape (default qwen3)
 *   --model   GGUF to use (default /tmp/kvasir-bench-qwen3-0.6b-q8_0.gguf,
 *             created if absent)
 *   --kvasir  the kvasir binary used to create it (default: next to this
 *             program, or $KVASIR_BIN)
 *   --threads compute threads (default 2)
 * Exit status: 0 when both targets pass, 1 when one fails, 2 on error. */
#include <errno.h>
#include <stdbool.h>
#include <libgen.h>
#include <limits.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "lib/bench_ring4.h"
#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "model/model.h"
#include "sampler/sampler.h"

extern char **environ;

#define DEFAULT_MODEL KVS_BENCH_QWEN3_Q8_0
#define DEFAULT_MODEL_35 "/tmp/kvasir-bench-qwen35-0.6b-q8_0.gguf"
#define N_PROMPT_DECODE 8
#define N_DECODE 64
#define N_PREFILL 32
#define N_REPS 3
#define TARGET_DECODE_TPS 35.0
#define TARGET_PREFILL_TPS 150.0
#define READ_BUF_BYTES ((size_t)512 << 20)

static int make_model(const char *kvasir, const char *path, bool qwen35)
{
    char *const argv3[] = {
        (char *)kvasir, "gguf", "synth", "--arch", "qwen3", "--n-embd", "1024", "--n-block", "28",
        "--n-head", "16", "--n-head-kv", "8", "--head-dim", "128", "--n-ff", "3072", "--n-vocab", "151936",
        "--tied", "--ctx", "4096", "--type", "q8_0", "--seed", "1", "-o", (char *)path, NULL,
    };
    char *const argv35[] = {
        (char *)kvasir, "gguf", "synth", "--arch", "qwen35", "--n-embd", "1024", "--n-block", "24",
        "--n-head", "8", "--n-head-kv", "2", "--head-dim", "256", "--n-rot", "64", "--ssm-state", "128",
        "--ssm-groups", "8", "--ssm-heads", "16", "--n-ff", "3584", "--n-vocab", "151936",
        "--tied", "--ctx", "4096", "--type", "q8_0", "--seed", "1", "-o", (char *)path, NULL,
    };
    char *const *argv = qwen35 ? argv35 : argv3;
    fprintf(stderr, "bench_engine: creating %s with %s gguf synth ...\n", path, kvasir);
    double t0 = kvs_bench_now();
    if (kvs_bench_spawn_wait("bench_engine", argv))
        return -1;
    fprintf(stderr, "bench_engine: created in %.1f s\n", kvs_bench_now() - t0);
    return 0;
}

/* Bytes of weights a single-token decode reads: every tensor of every block,
 * the output norm and the LM head (output.weight, or the tied embedding read
 * whole), plus one embedding row when the head is a separate tensor. */
static uint64_t decode_weight_bytes(const struct kvs_gguf *g)
{
    uint64_t sum = 0;
    const struct kvs_gguf_tensor *embd = kvs_gguf_find_tensor(g, "token_embd.weight");
    bool tied = kvs_gguf_find_tensor(g, "output.weight") == NULL;
    for (size_t i = 0; i < kvs_gguf_n_tensors(g); i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, i);
        if (t == embd && !tied)
            sum += kvs_type_row_bytes(t->type, t->ne[0]);
        else
            sum += t->bytes;
    }
    return sum;
}

/* CPU seconds used by this process (all threads). */
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL;
    const char *kvasir = getenv("KVASIR_BIN");
    bool qwen35 = false;
    int n_threads = 2;
    char kvasir_buf[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model_path = argv[++i];
        else if (!strcmp(argv[i], "--kvasir") && i + 1 < argc)
            kvasir = argv[++i];
        else if (!strcmp(argv[i], "--shape") && i + 1 < argc && (!strcmp(argv[i + 1], "qwen3") || !strcmp(argv[i + 1], "qwen35")))
            qwen35 = !strcmp(argv[++i], "qwen35");
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 256) {
                fprintf(stderr, "bench_engine: --threads: expected 1..256\n");
                return 2;
            }
            n_threads = (int)v;
        } else {
            fprintf(stderr, "usage: bench_engine [--shape qwen3|qwen35] [--model PATH] [--kvasir PATH] [--threads N]\n");
            return 2;
        }
    }
    if (!model_path)
        model_path = qwen35 ? DEFAULT_MODEL_35 : DEFAULT_MODEL;
    if (!(kvasir = kvs_bench_kvasir(kvasir, kvasir_buf, sizeof kvasir_buf))) {
        fprintf(stderr, "bench_engine: cannot locate myself; give --kvasir\n");
        return 2;
    }

    struct stat st;
    if (stat(model_path, &st) != 0 && make_model(kvasir, model_path, qwen35) != 0)
        return 2;

    char eb[512];
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(model_path, &g, eb, sizeof eb);
    if (e) {
        fprintf(stderr, "bench_engine: %s: %s (%s)\n", model_path, kvs_strerror(e), eb);
        return 2;
    }
    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_threads = n_threads;
    mp.n_ctx = 256;
    mp.n_batch = 64;
    struct kvs_model *m = NULL;
    if ((e = kvs_model_load(g, &mp, &m, eb, sizeof eb))) {
        fprintf(stderr, "bench_engine: loading the model: %s (%s)\n", kvs_strerror(e), eb);
        kvs_gguf_close(g);
        return 2;
    }
    const struct kvs_hparams *hp = kvs_model_hparams(m);
    const int32_t n_vocab = (int32_t)hp->n_vocab;
    float *logits = malloc((size_t)n_vocab * N_PREFILL * sizeof *logits);
    int32_t tok[N_PREFILL], pos[N_PREFILL], seq[N_PREFILL];
    if (!logits) {
        fprintf(stderr, "bench_engine: out of memory\n");
        return 2;
    }
    for (int i = 0; i < N_PREFILL; i++) {
        tok[i] = (int32_t)((i * 7919 + 13) % n_vocab);
        pos[i] = i;
        seq[i] = 0;
    }
    const uint64_t wbytes = decode_weight_bytes(g);
    printf("model: %s (%s, %u blocks, n_embd %u, vocab %u), %d threads, kernels %s\n", model_path,
           hp->arch_name, hp->n_block, hp->n_embd, hp->n_vocab, n_threads, kvs_isa_name(kvs_kernels_isa(kvs_kernels_best())));

    /* The machine's read bandwidth, before and after the model runs (the
     * better of the two: the machine may be shared). */
    double read_gbps = kvs_bench_read_gbps(READ_BUF_BYTES, n_threads, 3);

    /* Warm-up: one prefill pass faults the mapping in. */
    struct kvs_batch b = { .n_tokens = N_PREFILL, .token = tok, .seq = seq, .pos = pos };
    if ((e = kvs_model_forward(m, &b, logits))) {
        fprintf(stderr, "bench_engine: forward: %s\n", kvs_strerror(e));
        return 2;
    }

    /* Prefill: one batch of N_PREFILL tokens, logits for the last only. */
    double best_prefill = 1e30;
    for (int r = 0; r < N_REPS; r++) {
        kvs_model_seq_clear(m, 0);
        double t0 = kvs_bench_now();
        e = kvs_model_forward(m, &b, logits);
        double dt = kvs_bench_now() - t0;
        if (e) {
            fprintf(stderr, "bench_engine: prefill: %s\n", kvs_strerror(e));
            return 2;
        }
        if (dt < best_prefill)
            best_prefill = dt;
    }

    /* Decode: an N_PROMPT_DECODE-token prompt, then N_DECODE greedy steps. */
    double best_decode = 1e30, best_decode_cpu = 0.0;
    int32_t last = -1;
    for (int r = 0; r < N_REPS; r++) {
        kvs_model_seq_clear(m, 0);
        struct kvs_batch pb = { .n_tokens = N_PROMPT_DECODE, .token = tok, .seq = seq, .pos = pos };
        if ((e = kvs_model_forward(m, &pb, logits))) {
            fprintf(stderr, "bench_engine: prompt: %s\n", kvs_strerror(e));
            return 2;
        }
        int32_t t = argmax(logits, n_vocab);
        double t0 = kvs_bench_now(), c0 = cpu_now();
        for (int s = 0; s < N_DECODE; s++) {
            int32_t p = N_PROMPT_DECODE + s, z = 0;
            struct kvs_batch db = { .n_tokens = 1, .token = &t, .seq = &z, .pos = &p };
            if ((e = kvs_model_forward(m, &db, logits))) {
                fprintf(stderr, "bench_engine: decode step %d: %s\n", s, kvs_strerror(e));
                return 2;
            }
            t = argmax(logits, n_vocab);
        }
        double dt = kvs_bench_now() - t0, dc = cpu_now() - c0;
        if (dt < best_decode) {
            best_decode = dt;
            best_decode_cpu = dc;
        }
        if (r > 0 && t != last)
            fprintf(stderr, "bench_engine: warning: greedy decode is not deterministic (%d vs %d)\n", t, last);
        last = t;
    }

    /* Sampler cost per token with the default chain (top-k 40, temp 0.8,
     * top-p 0.95, min-p 0.05) over the last logits row. */
    double sampler_us = -1.0;
    struct kvs_sampler_params sp = kvs_sampler_default_params();
    struct kvs_sampler *smp = NULL;
    if (kvs_sampler_create(&sp, n_vocab, &smp) == KVS_OK) {
        const int n_samp = 200;
        int64_t acc = 0;
        double t0 = kvs_bench_now();
        for (int i = 0; i < n_samp; i++)
            acc += kvs_sampler_sample(smp, logits);
        sampler_us = (kvs_bench_now() - t0) / n_samp * 1e6;
        if (acc < 0)
            printf("impossible\n");
        kvs_sampler_free(smp);
    }

    double read_after = kvs_bench_read_gbps(READ_BUF_BYTES, n_threads, 3);
    if (read_after > read_gbps)
        read_gbps = read_after;
    double decode_tps = N_DECODE / best_decode;
    double prefill_tps = N_PREFILL / best_prefill;
    double weight_gbps = (double)wbytes * decode_tps * 1e-9;
    bool ok_d = decode_tps >= TARGET_DECODE_TPS, ok_p = prefill_tps >= TARGET_PREFILL_TPS;
    /* Hybrid: the delta states each decode token reads and writes back. */
    uint64_t state_bytes = 0;
    for (uint32_t il = 0; il < hp->n_block; il++)
        if (kvs_hparams_recurrent(hp, il))
            state_bytes += kvs_hparams_recurrent_bytes(hp);
    const bool has_targets = !kvs_hparams_hybrid(hp);

    if (has_targets) {
        printf("decode:  %8.2f tok/s  (%d steps after a %d-token prompt, best of %d; %.2f ms/token)  %s (target >= %.0f)\n",
               decode_tps, N_DECODE, N_PROMPT_DECODE, N_REPS, 1e3 * best_decode / N_DECODE, ok_d ? "PASS" : "FAIL",
               TARGET_DECODE_TPS);
        printf("prefill: %8.2f tok/s  (%d-token prompt, best of %d; %.1f ms)  %s (target >= %.0f)\n", prefill_tps,
               N_PREFILL, N_REPS, 1e3 * best_prefill, ok_p ? "PASS" : "FAIL", TARGET_PREFILL_TPS);
    } else {
        printf("decode:  %8.2f tok/s  (%d steps after a %d-token prompt, best of %d; %.2f ms/token)  (no target)\n",
               decode_tps, N_DECODE, N_PROMPT_DECODE, N_REPS, 1e3 * best_decode / N_DECODE);
        printf("prefill: %8.2f tok/s  (%d-token prompt, best of %d; %.1f ms)  (no target)\n", prefill_tps, N_PREFILL,
               N_REPS, 1e3 * best_prefill);
    }
    printf("weights: %.1f MB read per decode token -> %.2f GB/s achieved\n", (double)wbytes * 1e-6, weight_gbps);
    if (state_bytes)
        printf("state:   %.1f MB recurrent state per sequence (Gated DeltaNet), read and written per decode token ->"
               " %.2f GB/s more (weights + 2 x state: %.0f%% of the machine's read bandwidth)\n",
               (double)state_bytes * 1e-6, 2.0 * (double)state_bytes * decode_tps * 1e-9,
               read_gbps > 0 ? 100.0 * (weight_gbps + 2.0 * (double)state_bytes * decode_tps * 1e-9) / read_gbps : 0.0);
    printf("machine: %.2f GB/s read bandwidth (%d threads summing %zu MiB, best before/after the model runs); decode reaches %.0f%% of it\n",
           read_gbps, n_threads, READ_BUF_BYTES >> 20, read_gbps > 0 ? 100.0 * weight_gbps / read_gbps : 0.0);
    printf("cpu:     decode used %.2f CPU-s per wall-s (%d threads: %.0f would be all threads busy; less means\n"
           "         the machine was shared)\n", best_decode_cpu / best_decode, n_threads, (double)n_threads);
    printf("sampler: %.1f us/token (default chain over %d logits)\n", sampler_us, n_vocab);
    printf("RESULT decode_tps=%.2f prefill_tps=%.2f weight_gbps=%.2f read_gbps=%.2f\n", decode_tps, prefill_tps,
           weight_gbps, read_gbps);

    free(logits);
    kvs_model_free(m);
    kvs_gguf_close(g);
    return !has_targets || (ok_d && ok_p) ? 0 : 1;
}

/* bench_kquant: decode and prefill speed of the same Qwen3-0.6B-shaped model
 * (arch qwen3, n_embd 1024, 28 blocks, 16 heads / 8 KV heads, head_dim 128,
 * FFN 3072, vocab 151936, tied embedding; random weights from `kvasir gguf
 * synth`, kept in /tmp and reused) at the types people download: Q4_K_M,
 * Q5_K_M, Q6_K and Q8_0.
 *
 * Per type: decode tok/s (64 greedy steps after an 8-token prompt, best of
 * 3), prefill tok/s (one 128-token prompt, logits of the last token, best of
 * 3), the weight bandwidth the decode reaches (bytes of weights a decode
 * token reads / time per token) and its ratio to this machine's read
 * bandwidth, measured in the same run right before and after that type's
 * runs (2 threads summing a 512 MiB buffer; the better of the two, as the
 * machine may be shared), the CPU time decode used per wall second, and the
 * model's load time and resident memory. The load average (/proc/loadavg) is
 * printed with the figures. Targets (issue 17): Q4_K_M decode >= 75% of the
 * read bandwidth and prefill >= 140 tok/s; Q5_K_M and Q6_K decode >= 70%.
 * The last lines are machine-readable:
 *   RESULT type=.. decode_tps=.. prefill_tps=.. weight_gbps=.. read_gbps=.. ratio=..
 *
 * usage: bench_kquant [--types q4_k_m,q5_k_m,q6_k,q8_0] [--kvasir PATH] [--threads N] [--dir DIR]
 *   --types   which of the four to run (comma-separated; default all)
 *   --kvasir  the kvasir binary that creates the models (default: next to
 *             this program, or $KVASIR_BIN)
 *   --threads compute threads (default 2)
 *   --dir     where the models are kept (default /tmp)
 * Exit status: 0 when every target of the types run passes, 1 when one
 * fails, 2 on error. */
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
#include "gguf/gguf.h"
#include "kernels/kernels.h"
#include "model/model.h"

extern char **environ;

#define N_PROMPT_DECODE 8
#define N_DECODE 64
#define N_PREFILL 128
#define N_REPS 3
#define READ_BUF_BYTES ((size_t)512 << 20)

struct kq_type {
    const char *name;      /* --type of kvasir gguf synth */
    double target_ratio;   /* decode weight GB/s / read GB/s, 0: none */
    double target_prefill; /* tok/s, 0: none */
};

static const struct kq_type TYPES[] = {
    {"q4_k_m", 0.75, 140.0},
    {"q5_k_m", 0.70, 0.0},
    {"q6_k", 0.70, 0.0},
    {"q8_0", 0.0, 0.0},
};
#define N_TYPES (sizeof TYPES / sizeof TYPES[0])

static int make_model(const char *kvasir, const char *path, const char *type)
{
    char *const argv[] = {
        (char *)kvasir, "gguf", "synth", "--arch", "qwen3", "--n-embd", "1024", "--n-block", "28",
        "--n-head", "16", "--n-head-kv", "8", "--head-dim", "128", "--n-ff", "3072", "--n-vocab", "151936",
        "--tied", "--ctx", "4096", "--type", (char *)type, "--seed", "1", "-o", (char *)path, NULL,
    };
    fprintf(stderr, "bench_kquant: creating %s with %s gguf synth ...\n", path, kvasir);
    pid_t pid;
    int rc = posix_spawn(&pid, kvasir, NULL, NULL, argv, environ);
    if (rc) {
        fprintf(stderr, "bench_kquant: cannot run %s: %s\n", kvasir, strerror(rc));
        return -1;
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "bench_kquant: %s gguf synth failed (status %d)\n", kvasir, st);
        return -1;
    }
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

static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Resident set size of this process in MB (/proc/self/statm), 0 if unknown. */
static double rss_mb(void)
{
    FILE *f = fopen("/proc/self/statm", "r");
    long pages = 0, res = 0;
    if (!f)
        return 0.0;
    if (fscanf(f, "%ld %ld", &pages, &res) != 2)
        res = 0;
    fclose(f);
    return (double)res * (double)sysconf(_SC_PAGESIZE) * 1e-6;
}

static void load_avg(char *buf, size_t n)
{
    FILE *f = fopen("/proc/loadavg", "r");
    buf[0] = 0;
    if (f) {
        if (!fgets(buf, (int)n, f))
            buf[0] = 0;
        fclose(f);
    }
    buf[strcspn(buf, "\n")] = 0;
}

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

struct kq_result {
    double decode_tps, prefill_tps, weight_gbps, read_gbps, cpu_per_wall, load_s, rss_mb, wbytes;
};

/* Loads `path` and measures it; returns 0 or 2 on error. */
static int run_type(const char *path, int n_threads, struct kq_result *res)
{
    char eb[512];
    struct kvs_gguf *g = NULL;
    kvs_err e = kvs_gguf_open(path, &g, eb, sizeof eb);
    if (e) {
        fprintf(stderr, "bench_kquant: %s: %s (%s)\n", path, kvs_strerror(e), eb);
        return 2;
    }
    double read_gbps = kvs_bench_read_gbps(READ_BUF_BYTES, n_threads, 3);
    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_threads = n_threads;
    mp.n_ctx = 256;
    mp.n_batch = N_PREFILL;
    struct kvs_model *m = NULL;
    double rss0 = rss_mb(), t0 = kvs_bench_now();
    if ((e = kvs_model_load(g, &mp, &m, eb, sizeof eb))) {
        fprintf(stderr, "bench_kquant: loading %s: %s (%s)\n", path, kvs_strerror(e), eb);
        kvs_gguf_close(g);
        return 2;
    }
    res->load_s = kvs_bench_now() - t0;
    const int32_t n_vocab = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)n_vocab * N_PREFILL * sizeof *logits);
    int32_t tok[N_PREFILL], pos[N_PREFILL], seq[N_PREFILL];
    if (!logits) {
        fprintf(stderr, "bench_kquant: out of memory\n");
        return 2;
    }
    for (int i = 0; i < N_PREFILL; i++) {
        tok[i] = (int32_t)((i * 7919 + 13) % n_vocab);
        pos[i] = i;
        seq[i] = 0;
    }
    /* warm-up: faults the mapping in */
    struct kvs_batch b = {.n_tokens = N_PREFILL, .token = tok, .seq = seq, .pos = pos};
    if ((e = kvs_model_forward(m, &b, logits))) {
        fprintf(stderr, "bench_kquant: forward: %s\n", kvs_strerror(e));
        return 2;
    }
    res->rss_mb = rss_mb() - rss0;
    double best_prefill = 1e30;
    for (int r = 0; r < N_REPS; r++) {
        kvs_model_seq_clear(m, 0);
        double p0 = kvs_bench_now();
        e = kvs_model_forward(m, &b, logits);
        double dt = kvs_bench_now() - p0;
        if (e) {
            fprintf(stderr, "bench_kquant: prefill: %s\n", kvs_strerror(e));
            return 2;
        }
        best_prefill = dt < best_prefill ? dt : best_prefill;
    }
    double best_decode = 1e30, best_cpu = 0.0;
    for (int r = 0; r < N_REPS; r++) {
        kvs_model_seq_clear(m, 0);
        struct kvs_batch pb = {.n_tokens = N_PROMPT_DECODE, .token = tok, .seq = seq, .pos = pos};
        if ((e = kvs_model_forward(m, &pb, logits))) {
            fprintf(stderr, "bench_kquant: prompt: %s\n", kvs_strerror(e));
            return 2;
        }
        int32_t t = argmax(logits, n_vocab);
        double d0 = kvs_bench_now(), c0 = cpu_now();
        for (int s = 0; s < N_DECODE; s++) {
            int32_t p = N_PROMPT_DECODE + s, z = 0;
            struct kvs_batch db = {.n_tokens = 1, .token = &t, .seq = &z, .pos = &p};
            if ((e = kvs_model_forward(m, &db, logits))) {
                fprintf(stderr, "bench_kquant: decode step %d: %s\n", s, kvs_strerror(e));
                return 2;
            }
            t = argmax(logits, n_vocab);
        }
        double dt = kvs_bench_now() - d0, dc = cpu_now() - c0;
        if (dt < best_decode) {
            best_decode = dt;
            best_cpu = dc;
        }
    }
    double after = kvs_bench_read_gbps(READ_BUF_BYTES, n_threads, 3);
    res->read_gbps = after > read_gbps ? after : read_gbps;
    res->wbytes = (double)decode_weight_bytes(g);
    res->decode_tps = N_DECODE / best_decode;
    res->prefill_tps = N_PREFILL / best_prefill;
    res->weight_gbps = res->wbytes * res->decode_tps * 1e-9;
    res->cpu_per_wall = best_cpu / best_decode;
    free(logits);
    kvs_model_free(m);
    kvs_gguf_close(g);
    return 0;
}

int main(int argc, char **argv)
{
    const char *kvasir = getenv("KVASIR_BIN"), *dir = "/tmp", *types = "q4_k_m,q5_k_m,q6_k,q8_0";
    int n_threads = 2;
    char self_dir[PATH_MAX], kvasir_buf[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kvasir") && i + 1 < argc)
            kvasir = argv[++i];
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--types") && i + 1 < argc)
            types = argv[++i];
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) {
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > 256) {
                fprintf(stderr, "bench_kquant: --threads: expected 1..256\n");
                return 2;
            }
            n_threads = (int)v;
        } else {
            fprintf(stderr, "usage: bench_kquant [--types q4_k_m,q5_k_m,q6_k,q8_0] [--kvasir PATH] [--threads N] "
                            "[--dir DIR]\n");
            return 2;
        }
    }
    if (!kvasir) {
        ssize_t k = readlink("/proc/self/exe", self_dir, sizeof self_dir - 1);
        if (k <= 0) {
            fprintf(stderr, "bench_kquant: cannot locate myself; give --kvasir\n");
            return 2;
        }
        self_dir[k] = 0;
        snprintf(kvasir_buf, sizeof kvasir_buf, "%s/kvasir", dirname(self_dir));
        kvasir = kvasir_buf;
    }
    bool want[N_TYPES] = {false};
    for (const char *p = types; *p;) {
        size_t len = strcspn(p, ",");
        bool found = false;
        for (size_t i = 0; i < N_TYPES; i++)
            if (strlen(TYPES[i].name) == len && !strncmp(p, TYPES[i].name, len))
                want[i] = found = true;
        if (!found) {
            fprintf(stderr, "bench_kquant: --types: unknown type '%.*s'\n", (int)len, p);
            return 2;
        }
        p += len + (p[len] == ',');
    }
    char la[128];
    load_avg(la, sizeof la);
    printf("bench_kquant: Qwen3-0.6B shape, %d threads, kernels %s, load average before: %s\n", n_threads,
           kvs_isa_name(kvs_kernels_isa(kvs_kernels_best())), la);
    printf("%-7s %8s %9s %10s %9s %9s %7s %8s %7s %7s  %s\n", "type", "MB/tok", "decode", "weights", "read",
           "ratio", "cpu/s", "prefill", "load s", "RSS MB", "targets");
    struct kq_result res[N_TYPES];
    bool all_ok = true;
    for (size_t i = 0; i < N_TYPES; i++) {
        if (!want[i])
            continue;
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/kvasir-bench-qwen3-0.6b-%s.gguf", dir, TYPES[i].name);
        struct stat st;
        if (stat(path, &st) != 0 && make_model(kvasir, path, TYPES[i].name) != 0)
            return 2;
        if (run_type(path, n_threads, &res[i]) != 0)
            return 2;
        const struct kq_result *r = &res[i];
        double ratio = r->read_gbps > 0 ? r->weight_gbps / r->read_gbps : 0.0;
        char tg[128] = "";
        size_t o = 0;
        if (TYPES[i].target_ratio > 0) {
            bool ok = ratio >= TYPES[i].target_ratio;
            all_ok &= ok;
            o += (size_t)snprintf(tg + o, sizeof tg - o, "decode >= %.0f%%: %s", 100 * TYPES[i].target_ratio,
                                  ok ? "PASS" : "FAIL");
        }
        if (TYPES[i].target_prefill > 0) {
            bool ok = r->prefill_tps >= TYPES[i].target_prefill;
            all_ok &= ok;
            snprintf(tg + o, sizeof tg - o, "; prefill >= %.0f: %s", TYPES[i].target_prefill, ok ? "PASS" : "FAIL");
        }
        printf("%-7s %8.1f %5.1f t/s %5.2f GB/s %5.2f GB/s %8.0f%% %7.2f %4.0f t/s %7.2f %7.0f  %s\n", TYPES[i].name,
               r->wbytes * 1e-6, r->decode_tps, r->weight_gbps, r->read_gbps, 100 * ratio, r->cpu_per_wall,
               r->prefill_tps, r->load_s, r->rss_mb, tg[0] ? tg : "(baseline, no target)");
        fflush(stdout);
    }
    load_avg(la, sizeof la);
    printf("load average after: %s\n", la);
    printf("(decode: %d steps after a %d-token prompt, best of %d; prefill: one %d-token prompt, best of %d;\n"
           " weights = MB/tok x decode tok/s; read = the machine's read bandwidth measured before and after\n"
           " each type's runs; ratio = weights / read; cpu/s = CPU-s per wall-s in decode (< threads: shared\n"
           " machine); RSS = resident growth from load through the first prefill)\n",
           N_DECODE, N_PROMPT_DECODE, N_REPS, N_PREFILL, N_REPS);
    for (size_t i = 0; i < N_TYPES; i++)
        if (want[i])
            printf("RESULT type=%s decode_tps=%.2f prefill_tps=%.2f weight_gbps=%.2f read_gbps=%.2f ratio=%.3f\n",
                   TYPES[i].name, res[i].decode_tps, res[i].prefill_tps, res[i].weight_gbps, res[i].read_gbps,
                   res[i].read_gbps > 0 ? res[i].weight_gbps / res[i].read_gbps : 0.0);
    return all_ok ? 0 : 1;
}

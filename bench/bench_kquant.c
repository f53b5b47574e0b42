/* bench_kquant: decode and prefill speed of the same Qwen3-0.6B-shaped model
 * (arch qwen3, n_embd 1024, 28 blocks, 16 heads / 8 KV heads, head_dim 128,
 * FFN 3072, vocab 151936, tied embedding; random weights from `kvasir gguf
 * synth`, kept in /tmp and reused) at the types people download: Q4_K_M,
 * Q5_K_M, Q6_K and Q8_0.
 *
 * All types are loaded first; then every round runs each type in turn: a
 * decode (64 greedy steps after an 8-token prompt) with one pass of a
 * read-bandwidth probe before every 8 steps and after the last, then a
 * prefill (one 128-token prompt, logits of the last token). The probe is
 * this machine's multi-threaded read bandwidth as a decode meets it: the
 * same number of threads summing their shares of one 512 MiB buffer (16x the
 * last-level cache here, like a decode's ~400-630 MB of weights), allocated
 * once. Per round the decode's weight bandwidth (bytes of weights a decode
 * token reads / time per token, decode steps only) is divided by the
 * probe's GB/s over the passes interleaved with it: on a shared machine
 * whose bandwidth swings within a run, only such paired ratios are
 * comparable. Printed per type: medians over rounds of decode tok/s, weight
 * GB/s, probe GB/s, ratio (and its min-max), the CPU time decode used per
 * wall second, prefill tok/s; and the model's load time and resident
 * memory. The load average (/proc/loadavg) is printed with the figures.
 * Targets (issue 17, on the median ratio / prefill): Q4_K_M decode >= 75%
 * of the read bandwidth and prefill >= 140 tok/s; Q5_K_M and Q6_K decode
 * >= 70%.
 * The last lines are machine-readable:
 *   RESULT type=.. decode_tps=.. prefill_tps=.. weight_gbps=.. read_gbps=.. ratio=..
 *
 * usage: bench_kquant [--types q4_k_m,q5_k_m,q6_k,q8_0] [--kvasir PATH] [--threads N] [--rounds N] [--dir DIR]
 *   --types   which of the four to run (comma-separated; default all)
 *   --rounds  interleaved rounds (1..32, default 5)
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
#define MAX_ROUNDS 32
#define DECODE_CHUNK 8 /* decode steps between two probe passes */
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

/* One loaded model and its per-round figures. */
struct kq_model {
    struct kvs_gguf *g;
    struct kvs_model *m;
    float *logits;
    int32_t n_vocab;
    double wbytes, load_s, rss_mb;
    double decode_tps[MAX_ROUNDS], prefill_tps[MAX_ROUNDS], weight_gbps[MAX_ROUNDS], read_gbps[MAX_ROUNDS],
        ratio[MAX_ROUNDS], cpu_per_wall[MAX_ROUNDS];
};

static int32_t tok_buf[N_PREFILL], pos_buf[N_PREFILL], seq_buf[N_PREFILL];

/* Opens and loads `path` and faults its weights in with one prefill;
 * returns 0 or 2 on error. */
static int load_type(const char *path, int n_threads, struct kq_model *q)
{
    char eb[512];
    kvs_err e = kvs_gguf_open(path, &q->g, eb, sizeof eb);
    if (e) {
        fprintf(stderr, "bench_kquant: %s: %s (%s)\n", path, kvs_strerror(e), eb);
        return 2;
    }
    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_threads = n_threads;
    mp.n_ctx = 256;
    mp.n_batch = N_PREFILL;
    double rss0 = rss_mb(), t0 = kvs_bench_now();
    if ((e = kvs_model_load(q->g, &mp, &q->m, eb, sizeof eb))) {
        fprintf(stderr, "bench_kquant: loading %s: %s (%s)\n", path, kvs_strerror(e), eb);
        return 2;
    }
    q->load_s = kvs_bench_now() - t0;
    q->n_vocab = (int32_t)kvs_model_hparams(q->m)->n_vocab;
    if (!(q->logits = malloc((size_t)q->n_vocab * N_PREFILL * sizeof *q->logits))) {
        fprintf(stderr, "bench_kquant: out of memory\n");
        return 2;
    }
    struct kvs_batch b = {.n_tokens = N_PREFILL, .token = tok_buf, .seq = seq_buf, .pos = pos_buf};
    if ((e = kvs_model_forward(q->m, &b, q->logits))) {
        fprintf(stderr, "bench_kquant: forward: %s\n", kvs_strerror(e));
        return 2;
    }
    q->rss_mb = rss_mb() - rss0;
    q->wbytes = (double)decode_weight_bytes(q->g);
    return 0;
}

/* Decode of N_DECODE tokens after an N_PROMPT_DECODE-token prompt, in
 * chunks of DECODE_CHUNK steps with one probe pass before each chunk and
 * one after the last, so that the probe samples the machine's bandwidth
 * across the same stretch of time as the decode: wall and CPU seconds of the
 * decode steps alone and the probe's GB/s (bytes of all passes / their
 * time); 0 or 2 on error. */
static int run_decode(struct kq_model *q, const struct kvs_bench_probe *probe, double *wall, double *cpu,
                      double *probe_gbps)
{
    kvs_err e;
    kvs_model_seq_clear(q->m, 0);
    struct kvs_batch pb = {.n_tokens = N_PROMPT_DECODE, .token = tok_buf, .seq = seq_buf, .pos = pos_buf};
    if ((e = kvs_model_forward(q->m, &pb, q->logits))) {
        fprintf(stderr, "bench_kquant: prompt: %s\n", kvs_strerror(e));
        return 2;
    }
    int32_t t = argmax(q->logits, q->n_vocab);
    double dw = 0.0, dc = 0.0, pt = 0.0;
    int passes = 0;
    for (int s = 0; s <= N_DECODE; s++) {
        if (s % DECODE_CHUNK == 0) {
            double p0 = kvs_bench_now();
            kvs_bench_probe_pass(probe);
            pt += kvs_bench_now() - p0;
            passes++;
        }
        if (s == N_DECODE)
            break;
        int32_t p = N_PROMPT_DECODE + s, z = 0;
        struct kvs_batch db = {.n_tokens = 1, .token = &t, .seq = &z, .pos = &p};
        double d0 = kvs_bench_now(), c0 = cpu_now();
        if ((e = kvs_model_forward(q->m, &db, q->logits))) {
            fprintf(stderr, "bench_kquant: decode step %d: %s\n", s, kvs_strerror(e));
            return 2;
        }
        t = argmax(q->logits, q->n_vocab);
        dw += kvs_bench_now() - d0;
        dc += cpu_now() - c0;
    }
    *wall = dw;
    *cpu = dc;
    *probe_gbps = (double)passes * (double)(probe->words * 8) / pt * 1e-9;
    return 0;
}

/* One N_PREFILL-token prompt: wall seconds; 0 or 2 on error. */
static int run_prefill(struct kq_model *q, double *wall)
{
    kvs_model_seq_clear(q->m, 0);
    struct kvs_batch b = {.n_tokens = N_PREFILL, .token = tok_buf, .seq = seq_buf, .pos = pos_buf};
    double p0 = kvs_bench_now();
    kvs_err e = kvs_model_forward(q->m, &b, q->logits);
    *wall = kvs_bench_now() - p0;
    if (e) {
        fprintf(stderr, "bench_kquant: prefill: %s\n", kvs_strerror(e));
        return 2;
    }
    return 0;
}

/* Round r of type q: decode interleaved with probe passes, then prefill.
 * The decode's ratio is its weight GB/s over the probe's of the same
 * stretch. */
static int run_round(struct kq_model *q, const struct kvs_bench_probe *probe, int r)
{
    double dw, dc, pw, bw;
    if (run_decode(q, probe, &dw, &dc, &bw) || run_prefill(q, &pw))
        return 2;
    q->decode_tps[r] = N_DECODE / dw;
    q->weight_gbps[r] = q->wbytes * q->decode_tps[r] * 1e-9;
    q->read_gbps[r] = bw;
    q->ratio[r] = bw > 0 ? q->weight_gbps[r] / bw : 0.0;
    q->cpu_per_wall[r] = dc / dw;
    q->prefill_tps[r] = N_PREFILL / pw;
    return 0;
}

static double median_of(const double *v, int n)
{
    double c[MAX_ROUNDS];
    memcpy(c, v, (size_t)n * sizeof *c);
    return kvs_bench_median(c, n);
}

static double min_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] < m ? v[i] : m;
    return m;
}

static double max_of(const double *v, int n)
{
    double m = v[0];
    for (int i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

int main(int argc, char **argv)
{
    const char *kvasir = getenv("KVASIR_BIN"), *dir = "/tmp", *types = "q4_k_m,q5_k_m,q6_k,q8_0";
    int n_threads = 2, n_rounds = 5;
    char self_dir[PATH_MAX], kvasir_buf[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--kvasir") && i + 1 < argc)
            kvasir = argv[++i];
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--types") && i + 1 < argc)
            types = argv[++i];
        else if ((!strcmp(argv[i], "--threads") || !strcmp(argv[i], "--rounds")) && i + 1 < argc) {
            const bool thr = !strcmp(argv[i], "--threads");
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < 1 || v > (thr ? 64 : MAX_ROUNDS)) {
                fprintf(stderr, "bench_kquant: %s: expected 1..%d\n", argv[i - 1], thr ? 64 : MAX_ROUNDS);
                return 2;
            }
            *(thr ? &n_threads : &n_rounds) = (int)v;
        } else {
            fprintf(stderr, "usage: bench_kquant [--types q4_k_m,q5_k_m,q6_k,q8_0] [--kvasir PATH] [--threads N] "
                            "[--rounds N] [--dir DIR]\n");
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
    static struct kq_model mods[N_TYPES];
    for (int i = 0; i < N_PREFILL; i++) {
        tok_buf[i] = (int32_t)((i * 7919 + 13) % 151936);
        pos_buf[i] = i;
        seq_buf[i] = 0;
    }
    for (size_t i = 0; i < N_TYPES; i++) {
        if (!want[i])
            continue;
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/kvasir-bench-qwen3-0.6b-%s.gguf", dir, TYPES[i].name);
        struct stat st;
        if (stat(path, &st) != 0 && make_model(kvasir, path, TYPES[i].name) != 0)
            return 2;
        if (load_type(path, n_threads, &mods[i]) != 0)
            return 2;
    }
    struct kvs_bench_probe probe;
    if (kvs_bench_probe_init(&probe, READ_BUF_BYTES, n_threads) != 0) {
        fprintf(stderr, "bench_kquant: cannot allocate the %zu MiB probe buffer\n", READ_BUF_BYTES >> 20);
        return 2;
    }
    char la[128];
    load_avg(la, sizeof la);
    printf("bench_kquant: Qwen3-0.6B shape, %d threads, kernels %s, %d rounds, load average before: %s\n", n_threads,
           kvs_isa_name(kvs_kernels_isa(kvs_kernels_best())), n_rounds, la);
    fflush(stdout);
    for (int r = 0; r < n_rounds; r++)
        for (size_t i = 0; i < N_TYPES; i++)
            if (want[i] && run_round(&mods[i], &probe, r) != 0)
                return 2;
    kvs_bench_probe_free(&probe);
    load_avg(la, sizeof la);
    printf("%-7s %7s %9s %10s %10s %6s %11s %6s %8s %6s %6s  %s\n", "type", "MB/tok", "decode", "weights", "probe",
           "ratio", "ratio range", "cpu/s", "prefill", "load s", "RSS MB", "targets");
    bool all_ok = true;
    for (size_t i = 0; i < N_TYPES; i++) {
        if (!want[i])
            continue;
        const struct kq_model *q = &mods[i];
        const double ratio = median_of(q->ratio, n_rounds), prefill = median_of(q->prefill_tps, n_rounds);
        char tg[128] = "";
        size_t o = 0;
        if (TYPES[i].target_ratio > 0) {
            bool ok = ratio >= TYPES[i].target_ratio;
            all_ok &= ok;
            o += (size_t)snprintf(tg + o, sizeof tg - o, "decode >= %.0f%%: %s", 100 * TYPES[i].target_ratio,
                                  ok ? "PASS" : "FAIL");
        }
        if (TYPES[i].target_prefill > 0) {
            bool ok = prefill >= TYPES[i].target_prefill;
            all_ok &= ok;
            snprintf(tg + o, sizeof tg - o, "; prefill >= %.0f: %s", TYPES[i].target_prefill, ok ? "PASS" : "FAIL");
        }
        printf("%-7s %7.1f %5.1f t/s %5.2f GB/s %5.2f GB/s %5.0f%% %4.0f-%3.0f%% %6.2f %4.0f t/s %6.2f %6.0f  %s\n",
               TYPES[i].name, q->wbytes * 1e-6, median_of(q->decode_tps, n_rounds), median_of(q->weight_gbps, n_rounds),
               median_of(q->read_gbps, n_rounds), 100 * ratio, 100 * min_of(q->ratio, n_rounds),
               100 * max_of(q->ratio, n_rounds), median_of(q->cpu_per_wall, n_rounds), prefill, q->load_s, q->rss_mb,
               tg[0] ? tg : "(baseline, no target)");
    }
    printf("load average after: %s\n", la);
    printf("(%d rounds; each round runs every type in turn: decode, then prefill. decode: %d steps after\n"
           " a %d-token prompt, one probe pass before every %d steps and after the last; prefill: one\n"
           " %d-token prompt; weights = MB/tok x decode tok/s (decode steps' time only); probe = %d threads\n"
           " summing a %zu MiB buffer, bytes / time of that decode's passes; ratio = weights / probe of the\n"
           " same decode; every column is the median over rounds, ratio range its min-max; cpu/s = CPU-s\n"
           " per wall-s in decode (< threads: shared machine); RSS = resident growth from load through the\n"
           " first prefill)\n",
           n_rounds, N_DECODE, N_PROMPT_DECODE, DECODE_CHUNK, N_PREFILL, n_threads, READ_BUF_BYTES >> 20);
    for (size_t i = 0; i < N_TYPES; i++) {
        if (!want[i])
            continue;
        const struct kq_model *q = &mods[i];
        printf("RESULT type=%s decode_tps=%.2f prefill_tps=%.2f weight_gbps=%.2f read_gbps=%.2f ratio=%.3f\n",
               TYPES[i].name, median_of(q->decode_tps, n_rounds), median_of(q->prefill_tps, n_rounds),
               median_of(q->weight_gbps, n_rounds), median_of(q->read_gbps, n_rounds), median_of(q->ratio, n_rounds));
    }
    for (size_t i = 0; i < N_TYPES; i++) {
        if (!want[i])
            continue;
        free(mods[i].logits);
        kvs_model_free(mods[i].m);
        kvs_gguf_close(mods[i].g);
    }
    return all_ok ? 0 : 1;
}

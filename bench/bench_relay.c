/* bench_relay: what the relay costs a ring. A 4-stage ring on loopback (the
 * head in this process, ranks 1..3 as `kvasir stage` processes, 2 compute
 * threads each), TLS 1.3 between node keys on every link in both modes, is
 * started alternately with direct TCP links and with every one of its 4 edges
 * through a `kvasir relay` process (wss:// with a self-signed certificate the
 * bench makes; the ring's TLS runs inside the WebSocket, docs/RELAY.md), on
 * the Qwen3-0.6B-shaped Q8_0 model of bench_ring (made by `kvasir gguf synth`
 * if absent; --model picks another).
 *
 * Per round and mode, after a warm-up request: decode tok/s of one greedy
 * sequence (time between its first and last TOKEN event, --tokens tokens).
 * For the relay mode the relay process's CPU time (all its threads, from
 * /proc/PID/task/TID/schedstat) over the timed request is summed over the
 * rounds and printed per token. Rounds alternate which mode goes first.
 * Prints per-round figures, the medians, the median of the rounds' ratios
 * relay / direct (target >= 0.9), and
 *   RESULT relay_ratio=.. relay_tps=.. direct_tps=.. relay_cpu_ms_per_token=..
 *
 * usage: bench_relay [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] [--rounds R]
 * Needs the openssl command (the certificate). Exit status: 0 when the target
 * passes, 1 when it fails, 2 on error. */
#include <dirent.h>
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
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
#include "lib/bench_ring4.h"
#include "relay/relay.h"
#include "model/model.h"
#include "stage/stage.h"
#include "trust/trust.h"

extern char **environ;

#define N_STAGES KVS_BENCH_RING4_STAGES
#define N_PROMPT 8
#define N_CTX 256
#define MAX_ROUNDS 15
#define TARGET_RATIO 0.9

/* The relay process: its port, certificate and edge URLs. */
struct relay {
    pid_t pid;
    char dir[64], cert[96], key[96], secret[96], portf[96];
    int port;
    uint8_t sec[32];
};

static int relay_start(struct relay *rl, const char *kvasir)
{
    memset(rl, 0, sizeof *rl);
    snprintf(rl->dir, sizeof rl->dir, "/tmp/kvasir-bench-relay-XXXXXX");
    if (!mkdtemp(rl->dir)) return -1;
    snprintf(rl->cert, sizeof rl->cert, "%s/relay.pem", rl->dir);
    snprintf(rl->key, sizeof rl->key, "%s/relay.key", rl->dir);
    snprintf(rl->secret, sizeof rl->secret, "%s/secret", rl->dir);
    snprintf(rl->portf, sizeof rl->portf, "%s/port", rl->dir);
    char cmd[600];
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout %s -out %s -days 2 "
             "-subj /CN=bench-relay -addext subjectAltName=IP:127.0.0.1 2>/dev/null",
             rl->key, rl->cert);
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_relay: openssl could not make the relay certificate\n");
        return -1;
    }
    for (int i = 0; i < 32; i++) rl->sec[i] = (uint8_t)('a' + (i * 7 + 3) % 26);
    FILE *f = fopen(rl->secret, "w");
    if (!f || fwrite(rl->sec, 1, sizeof rl->sec, f) != sizeof rl->sec) {
        if (f) fclose(f);
        return -1;
    }
    fclose(f);
    char *args[] = { (char *)kvasir, "relay", "--listen", "127.0.0.1:0", "--secret", rl->secret, "--cert", rl->cert,
                     "--key", rl->key, "--port-file", rl->portf, NULL };
    if (posix_spawn(&rl->pid, kvasir, NULL, NULL, args, environ)) {
        rl->pid = 0;
        return -1;
    }
    for (int i = 0; i < 200 && rl->port <= 0; i++) {
        poll(NULL, 0, 50);
        f = fopen(rl->portf, "r");
        if (f) {
            if (fscanf(f, "%d", &rl->port) != 1) rl->port = 0;
            fclose(f);
        }
    }
    if (rl->port <= 0) fprintf(stderr, "bench_relay: the relay did not start\n");
    return rl->port > 0 ? 0 : -1;
}

static void relay_stop(struct relay *rl)
{
    if (rl->pid > 0) {
        kill(rl->pid, SIGTERM);
        waitpid(rl->pid, NULL, 0);
    }
    unlink(rl->cert), unlink(rl->key), unlink(rl->secret), unlink(rl->portf);
    rmdir(rl->dir);
}

/* CPU time of process pid, seconds: the sum over its threads of the time on
 * a CPU from /proc/PID/task/TID/schedstat (nanoseconds; first field), else
 * utime + stime of /proc/PID/stat (clock ticks). */
static double proc_cpu_s(pid_t pid)
{
    char path[96], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
    DIR *d = opendir(path);
    if (d) {
        double sum = 0;
        bool any = false;
        struct dirent *de;
        while ((de = readdir(d))) {
            if (de->d_name[0] == '.') continue;
            snprintf(path, sizeof path, "/proc/%d/task/%.16s/schedstat", (int)pid, de->d_name);
            FILE *f = fopen(path, "r");
            unsigned long long ns = 0;
            if (f && fscanf(f, "%llu", &ns) == 1) {
                sum += (double)ns * 1e-9;
                any = true;
            }
            if (f) fclose(f);
        }
        closedir(d);
        if (any) return sum;
    }
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* fields after the command name: state is field 3, utime 14, stime 15 */
    unsigned long ut = 0, st = 0;
    if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2) return -1;
    return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* The URL of the edge into rank r (from rank r-1), with its token. */
static void edge_url(const void *ctx, int r, char *out, size_t cap)
{
    const struct relay *rl = ctx;
    char id[16], tok[KVS_RELAY_TOKEN_HEX + 1];
    snprintf(id, sizeof id, "bench-e%d", r);
    kvs_relay_token(rl->sec, sizeof rl->sec, id, tok);
    snprintf(out, cap, "wss://127.0.0.1:%d/edge/%s?token=%s", rl->port, id, tok);
}

int main(int argc, char **argv)
{
    const char *model_path = KVS_BENCH_QWEN3_Q8_0, *kvasir = getenv("KVASIR_BIN");
    int n_threads = 2, n_tok = 32, rounds = 5;
    setenv("KVASIR_LOG", "warn", 0); /* the stages' start-up lines would drown the figures */
    char kvasir_buf[PATH_MAX + 16];
    if (kvs_bench_ring_args(argc, argv, "bench_relay", &model_path, &kvasir, &n_threads, &n_tok,
                            N_CTX - N_PROMPT - 1, &rounds, MAX_ROUNDS))
        return 2;
    if (!(kvasir = kvs_bench_kvasir(kvasir, kvasir_buf, sizeof kvasir_buf)) ||
        kvs_bench_model("bench_relay", kvasir, model_path, "q8_0"))
        return 2;
    char eb[512];
    struct kvs_gguf *gg = NULL;
    struct kvs_hparams hp;
    if (kvs_gguf_open(model_path, &gg, eb, sizeof eb) || kvs_hparams_read(gg, &hp, eb, sizeof eb)) {
        fprintf(stderr, "bench_relay: %s: %s\n", model_path, eb);
        return 2;
    }
    kvs_gguf_close(gg);
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)((i * 7919 + 13) % (int32_t)hp.n_vocab);
    printf("model: %s (%s, %u blocks, n_embd %u), %d-stage loopback ring, %d threads per stage, %d decode tokens, "
           "%d rounds\n", model_path, hp.arch_name, hp.n_block, hp.n_embd, N_STAGES, n_threads, n_tok, rounds);
    fflush(stdout);

    struct relay rl;
    if (relay_start(&rl, kvasir)) {
        relay_stop(&rl);
        return 2;
    }
    double tps[2][MAX_ROUNDS]; /* [0] direct, [1] relay */
    double relay_cpu = 0;
    int relay_tokens = 0;
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 2; k++) {
            int relayed = (r + k) % 2; /* alternate which mode goes first */
            struct kvs_bench_ring4 g;
            /* TLS between node keys on every link in both modes */
            struct kvs_bench_ring4_opts o = { .who = "bench_relay", .kvasir = kvasir, .model = model_path,
                                              .n_block = hp.n_block, .n_threads = n_threads, .n_ctx = N_CTX,
                                              .keyed = true, .edge_url = relayed ? edge_url : NULL,
                                              .edge_ctx = &rl, .relay_ca = rl.cert };
            if (kvs_bench_ring4_start(&g, &o) ||
                kvs_bench_decode_tps(g.head, prompt, N_PROMPT, 4, "bench_relay") < 0 /* warm-up: faults the weights in */) {
                kvs_bench_ring4_stop(&g);
                relay_stop(&rl);
                return 2;
            }
            double c0 = proc_cpu_s(rl.pid);
            double t = kvs_bench_decode_tps(g.head, prompt, N_PROMPT, n_tok + 1, "bench_relay");
            double c1 = proc_cpu_s(rl.pid);
            kvs_bench_ring4_stop(&g);
            if (t < 0) {
                relay_stop(&rl);
                return 2;
            }
            tps[relayed][r] = t;
            if (relayed) {
                relay_cpu += c1 - c0;
                relay_tokens += n_tok;
            }
            printf("round %d %-6s decode %8.2f tok/s%s", r + 1, relayed ? "relay" : "direct", t,
                   relayed ? "" : "\n");
            if (relayed) printf("   relay CPU %.1f ms\n", (c1 - c0) * 1e3);
            fflush(stdout);
        }
    }
    relay_stop(&rl);
    double pair[MAX_ROUNDS]; /* each round's relay / direct: the two rings ran back to back */
    for (int r = 0; r < rounds; r++) pair[r] = tps[1][r] / tps[0][r];
    double ratio = kvs_bench_median(pair, rounds);
    double td = kvs_bench_median(tps[0], rounds), tr = kvs_bench_median(tps[1], rounds);
    double cpu_tok = relay_tokens ? relay_cpu * 1e3 / relay_tokens : -1;
    printf("median decode: relay %.2f tok/s, direct %.2f tok/s; median of the rounds' relay / direct: %.3f\n", tr, td,
           ratio);
    printf("relay CPU time: %.3f ms per token (%d tokens, all %d edges through it)\n", cpu_tok, relay_tokens,
           N_STAGES);
    bool pass = ratio >= TARGET_RATIO;
    printf("%s relay / direct decode %.3f (target >= %.2f)\n", pass ? "PASS" : "FAIL", ratio, TARGET_RATIO);
    printf("RESULT relay_ratio=%.3f relay_tps=%.2f direct_tps=%.2f relay_cpu_ms_per_token=%.3f\n", ratio, tr, td,
           cpu_tok);
    return pass ? 0 : 1;
}

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
#include "link/link.h"
#include "model/model.h"
#include "stage/stage.h"
#include "trust/trust.h"

extern char **environ;

#define MODEL_A "/tmp/kvasir-qwen3-0.6b-q8_0.gguf"
#define MODEL_B "/tmp/kvasir-bench-qwen3-0.6b-q8_0.gguf"
#define N_STAGES 4
#define N_PROMPT 8
#define N_CTX 256
#define MAX_ROUNDS 15
#define TARGET_RATIO 0.9
#define N_EDGE_URL 384

struct ring {
    pid_t pids[N_STAGES];
    struct kvs_stage *head;
    pthread_t th;
    bool running;
    bool keyed;
    char key_dir[64], key_path[N_STAGES][96], key_hex[N_STAGES][KVS_KEY_PUB_HEX + 1];
    struct kvs_key *keys[N_STAGES];
};

struct waiter {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    double t_first, t_last;
    int n;
    bool done;
    kvs_err err;
};

static void on_event(void *user, const struct kvs_stage_event *ev)
{
    struct waiter *w = user;
    double now = kvs_bench_now();
    pthread_mutex_lock(&w->mu);
    if (ev->kind == KVS_STAGE_EVENT_TOKEN) {
        if (w->n++ == 0) w->t_first = now;
        w->t_last = now;
    } else {
        w->done = true;
        w->err = ev->kind == KVS_STAGE_EVENT_ERROR ? ev->err : KVS_OK;
    }
    pthread_mutex_unlock(&w->mu);
    pthread_cond_broadcast(&w->cv);
}

/* One greedy request of max_tokens; returns decode tok/s (first -> last token) or < 0. */
static double decode_tps(struct kvs_stage *head, const int32_t *prompt, int max_tokens)
{
    struct waiter w = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };
    struct kvs_stage_request q = { .prompt = prompt, .n_prompt = N_PROMPT, .max_tokens = max_tokens,
                                   .ignore_eos = true, .on_event = on_event, .user = &w };
    q.sampling = kvs_sampler_default_params();
    q.sampling.temp = 0;
    uint32_t id;
    if (kvs_stage_submit(head, &q, &id)) return -1;
    pthread_mutex_lock(&w.mu);
    while (!w.done) pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    if (w.err || w.n < 2) {
        fprintf(stderr, "bench_relay: request failed: %s\n", kvs_strerror(w.err));
        return -1;
    }
    return (w.n - 1) / (w.t_last - w.t_first);
}

static void *loop_thread(void *arg)
{
    kvs_stage_run(arg);
    return NULL;
}

static int free_port(void)
{
    struct kvs_listener *l;
    char err[128];
    if (kvs_tcp_listen("127.0.0.1:0", &l, err, sizeof err)) return -1;
    int p = kvs_listener_port(l);
    kvs_listener_close(l);
    return p;
}

static void ring_stop(struct ring *g)
{
    if (g->running) {
        kvs_stage_stop(g->head);
        pthread_join(g->th, NULL);
    }
    for (int r = 1; r < N_STAGES; r++)
        if (g->pids[r] > 0) kill(g->pids[r], SIGTERM);
    for (int r = 1; r < N_STAGES; r++)
        if (g->pids[r] > 0) waitpid(g->pids[r], NULL, 0);
    kvs_stage_free(g->head);
    for (int r = 0; r < N_STAGES; r++) {
        kvs_key_free(g->keys[r]);
        if (g->keyed) unlink(g->key_path[r]);
    }
    if (g->keyed) rmdir(g->key_dir);
    memset(g, 0, sizeof *g);
}

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
static void edge_url(const struct relay *rl, int r, char *out, size_t cap)
{
    char id[16], tok[KVS_RELAY_TOKEN_HEX + 1];
    snprintf(id, sizeof id, "bench-e%d", r);
    kvs_relay_token(rl->sec, sizeof rl->sec, id, tok);
    snprintf(out, cap, "wss://127.0.0.1:%d/edge/%s?token=%s", rl->port, id, tok);
}

/* Starts the ring: direct TCP links (rl NULL) or every edge through rl. */
static int ring_start(struct ring *g, const struct relay *rl, const char *kvasir, const char *model, uint32_t n_block,
                      int n_threads)
{
    memset(g, 0, sizeof *g);
    const bool keyed = true; /* TLS between node keys on every link, in both modes */
    g->keyed = keyed;
    char eb[512];
    if (keyed) {
        snprintf(g->key_dir, sizeof g->key_dir, "/tmp/kvasir-bench-relay-XXXXXX");
        if (!mkdtemp(g->key_dir)) return -1;
        for (int r = 0; r < N_STAGES; r++) {
            uint8_t pub[KVS_KEY_PUB_BYTES];
            snprintf(g->key_path[r], sizeof g->key_path[r], "%s/k%d.key", g->key_dir, r);
            if (kvs_key_generate(&g->keys[r]) || kvs_key_save(g->keys[r], g->key_path[r], eb, sizeof eb)) return -1;
            kvs_key_public(g->keys[r], pub);
            kvs_key_public_hex(pub, g->key_hex[r]);
        }
    }
    int port[N_STAGES];
    for (int r = 0; r < N_STAGES; r++)
        if ((port[r] = free_port()) <= 0) return -1;
    char a_thr[16], a_ctx[16];
    snprintf(a_thr, sizeof a_thr, "%d", n_threads);
    snprintf(a_ctx, sizeof a_ctx, "%d", N_CTX);
    for (int r = 1; r < N_STAGES; r++) {
        char a_win[32], a_listen[N_EDGE_URL], a_next[N_EDGE_URL];
        snprintf(a_win, sizeof a_win, "%u:%u", r * n_block / N_STAGES, (r + 1) * n_block / N_STAGES);
        if (rl) {
            edge_url(rl, r, a_listen, sizeof a_listen);
            edge_url(rl, (r + 1) % N_STAGES, a_next, sizeof a_next);
        } else {
            snprintf(a_listen, sizeof a_listen, "127.0.0.1:%d", port[r]);
            snprintf(a_next, sizeof a_next, "127.0.0.1:%d", port[(r + 1) % N_STAGES]);
        }
        char *args[24] = { (char *)kvasir, "stage", "-m", (char *)model, "--window", a_win, "--listen", a_listen,
                           "--next", a_next, "--threads", a_thr, "--seqs", "1", "--ctx", a_ctx };
        int na = 16;
        if (rl) {
            args[na++] = "--relay-ca";
            args[na++] = (char *)rl->cert;
        }
        if (keyed) {
            args[na++] = "--key";
            args[na++] = g->key_path[r];
            args[na++] = "--prev-key";
            args[na++] = g->key_hex[r - 1];
            args[na++] = "--next-key";
            args[na++] = g->key_hex[(r + 1) % N_STAGES];
        } else {
            args[na++] = "--insecure";
        }
        args[na] = NULL;
        int e = posix_spawn(&g->pids[r], kvasir, NULL, NULL, args, environ);
        if (e) {
            fprintf(stderr, "bench_relay: cannot start %s stage: %s\n", kvasir, strerror(e));
            g->pids[r] = 0;
            return -1;
        }
    }
    char h_listen[N_EDGE_URL], h_next[N_EDGE_URL];
    if (rl) {
        edge_url(rl, 0, h_listen, sizeof h_listen);
        edge_url(rl, 1, h_next, sizeof h_next);
    } else {
        snprintf(h_listen, sizeof h_listen, "127.0.0.1:%d", port[0]);
        snprintf(h_next, sizeof h_next, "127.0.0.1:%d", port[1]);
    }
    struct kvs_stage_params sp = kvs_stage_default_params();
    sp.model_path = model;
    sp.block_begin = 0;
    sp.block_end = (int32_t)(n_block / N_STAGES);
    sp.listen = h_listen;
    sp.next = h_next;
    sp.n_threads = n_threads;
    sp.n_ctx = N_CTX;
    sp.n_seq = 1;
    sp.insecure = !keyed;
    sp.relay_ca = rl ? rl->cert : NULL;
    if (keyed) {
        sp.key = g->keys[0];
        sp.has_prev_key = sp.has_next_key = true;
        kvs_key_public(g->keys[N_STAGES - 1], sp.prev_key);
        kvs_key_public(g->keys[1], sp.next_key);
    }
    if (kvs_stage_create(&sp, &g->head, eb, sizeof eb)) {
        fprintf(stderr, "bench_relay: head stage: %s\n", eb);
        return -1;
    }
    if (pthread_create(&g->th, NULL, loop_thread, g->head)) return -1;
    g->running = true;
    if (kvs_stage_wait_ready(g->head, 120000)) {
        fprintf(stderr, "bench_relay: the ring did not close\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL, *kvasir = getenv("KVASIR_BIN");
    int n_threads = 2, n_tok = 32, rounds = 5;
    setenv("KVASIR_LOG", "warn", 0); /* the stages' start-up lines would drown the figures */
    char self_dir[PATH_MAX], kvasir_buf[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        long v = 0;
        char *end = NULL;
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model_path = argv[++i];
        else if (!strcmp(argv[i], "--kvasir") && i + 1 < argc) kvasir = argv[++i];
        else if ((!strcmp(argv[i], "--threads") || !strcmp(argv[i], "--tokens") || !strcmp(argv[i], "--rounds")) &&
                 i + 1 < argc && (v = strtol(argv[i + 1], &end, 10)) > 0 && !*end) {
            if (!strcmp(argv[i], "--threads") && v <= 256) n_threads = (int)v;
            else if (!strcmp(argv[i], "--tokens") && v >= 4 && v <= N_CTX - N_PROMPT - 1) n_tok = (int)v;
            else if (!strcmp(argv[i], "--rounds") && v <= MAX_ROUNDS) rounds = (int)v;
            else {
                fprintf(stderr, "bench_relay: %s: out of range\n", argv[i]);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, "usage: bench_relay [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] "
                            "[--rounds R]\n");
            return 2;
        }
    }
    if (!kvasir) {
        ssize_t k = readlink("/proc/self/exe", self_dir, sizeof self_dir - 1);
        if (k <= 0) return 2;
        self_dir[k] = 0;
        snprintf(kvasir_buf, sizeof kvasir_buf, "%s/kvasir", dirname(self_dir));
        kvasir = kvasir_buf;
    }
    struct stat st;
    if (!model_path) model_path = stat(MODEL_A, &st) != 0 && stat(MODEL_B, &st) == 0 ? MODEL_B : MODEL_A;
    if (stat(model_path, &st) != 0) {
        char *const args[] = { (char *)kvasir, "gguf", "synth", "--arch", "qwen3", "--n-embd", "1024", "--n-block",
                               "28", "--n-head", "16", "--n-head-kv", "8", "--head-dim", "128", "--n-ff", "3072",
                               "--n-vocab", "151936", "--tied", "--type", "q8_0", "--seed", "1", "-o",
                               (char *)model_path, NULL };
        pid_t pid;
        int stt = 0;
        fprintf(stderr, "bench_relay: creating %s ...\n", model_path);
        if (posix_spawn(&pid, kvasir, NULL, NULL, args, environ) || waitpid(pid, &stt, 0) < 0 || !WIFEXITED(stt) ||
            WEXITSTATUS(stt)) {
            fprintf(stderr, "bench_relay: gguf synth failed\n");
            return 2;
        }
    }
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
            struct ring g;
            if (ring_start(&g, relayed ? &rl : NULL, kvasir, model_path, hp.n_block, n_threads) ||
                decode_tps(g.head, prompt, 4) < 0 /* warm-up: faults the weights in */) {
                ring_stop(&g);
                relay_stop(&rl);
                return 2;
            }
            double c0 = proc_cpu_s(rl.pid);
            double t = decode_tps(g.head, prompt, n_tok + 1);
            double c1 = proc_cpu_s(rl.pid);
            ring_stop(&g);
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

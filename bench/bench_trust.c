/* bench_trust: what TLS on every link costs a ring. A 4-stage ring on
 * loopback (the head in this process, ranks 1..3 as `kvasir stage`
 * processes, 2 compute threads each) is started alternately with
 * throw-away node keys (TLS 1.3 on every link, the default) and with
 * --insecure (plaintext), on the Qwen3-0.6B-shaped Q8_0 model of bench_ring
 * (made by `kvasir gguf synth` if absent; --model picks another).
 *
 * Per round and mode it measures, after a warm-up request:
 *  - decode tok/s of one greedy sequence (time between its first and last
 *    TOKEN event, --tokens tokens);
 *  - the idle ring's probe hop latencies (kvs_stage_ring_stats: send on one
 *    stage -> read on the next, from two fresh probe trails), averaged over the
 *    4 hops.
 * Rounds alternate which mode goes first, so drift in the machine's load
 * falls on both. Prints per-round figures, the medians, the median of the
 * rounds' ratios TLS / insecure (target >= 0.97), the added latency per hop (from the probe
 * hops, and from the decode time per token spread over the 4 hops), and
 *   RESULT tls_ratio=.. tls_tps=.. insecure_tps=.. added_hop_ms_probe=.. added_hop_ms_decode=..
 *
 * usage: bench_trust [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] [--rounds R]
 * Exit status: 0 when the target passes, 1 when it fails, 2 on error. */
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
#define TARGET_RATIO 0.97

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
        fprintf(stderr, "bench_trust: request failed: %s\n", kvs_strerror(w.err));
        return -1;
    }
    return (w.n - 1) / (w.t_last - w.t_first);
}

/* Mean hop latency (ms) of the idle ring over two fresh probe trails. */
static double probe_hop_ms(struct kvs_stage *head)
{
    double sum = 0;
    int n = 0;
    for (int k = 0; k < 2; k++) {
        poll(NULL, 0, 1200); /* probes go every second */
        struct kvs_stage_hop h[N_STAGES + 1];
        int m = kvs_stage_ring_stats(head, h, N_STAGES + 1, NULL);
        for (int i = 0; i < m && m == N_STAGES; i++) {
            sum += h[i].hop_ms;
            n++;
        }
    }
    return n ? sum / n : -1;
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

static int ring_start(struct ring *g, bool keyed, const char *kvasir, const char *model, uint32_t n_block,
                      int n_threads)
{
    memset(g, 0, sizeof *g);
    g->keyed = keyed;
    char eb[512];
    if (keyed) {
        snprintf(g->key_dir, sizeof g->key_dir, "/tmp/kvasir-bench-trust-XXXXXX");
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
        char a_win[32], a_listen[64], a_next[64];
        snprintf(a_win, sizeof a_win, "%u:%u", r * n_block / N_STAGES, (r + 1) * n_block / N_STAGES);
        snprintf(a_listen, sizeof a_listen, "127.0.0.1:%d", port[r]);
        snprintf(a_next, sizeof a_next, "127.0.0.1:%d", port[(r + 1) % N_STAGES]);
        char *args[24] = { (char *)kvasir, "stage", "-m", (char *)model, "--window", a_win, "--listen", a_listen,
                           "--next", a_next, "--threads", a_thr, "--seqs", "1", "--ctx", a_ctx };
        int na = 16;
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
            fprintf(stderr, "bench_trust: cannot start %s stage: %s\n", kvasir, strerror(e));
            g->pids[r] = 0;
            return -1;
        }
    }
    char h_listen[64], h_next[64];
    snprintf(h_listen, sizeof h_listen, "127.0.0.1:%d", port[0]);
    snprintf(h_next, sizeof h_next, "127.0.0.1:%d", port[1]);
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
    if (keyed) {
        sp.key = g->keys[0];
        sp.has_prev_key = sp.has_next_key = true;
        kvs_key_public(g->keys[N_STAGES - 1], sp.prev_key);
        kvs_key_public(g->keys[1], sp.next_key);
    }
    if (kvs_stage_create(&sp, &g->head, eb, sizeof eb)) {
        fprintf(stderr, "bench_trust: head stage: %s\n", eb);
        return -1;
    }
    if (pthread_create(&g->th, NULL, loop_thread, g->head)) return -1;
    g->running = true;
    if (kvs_stage_wait_ready(g->head, 120000)) {
        fprintf(stderr, "bench_trust: the ring did not close\n");
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
                fprintf(stderr, "bench_trust: %s: out of range\n", argv[i]);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, "usage: bench_trust [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] "
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
        fprintf(stderr, "bench_trust: creating %s ...\n", model_path);
        if (posix_spawn(&pid, kvasir, NULL, NULL, args, environ) || waitpid(pid, &stt, 0) < 0 || !WIFEXITED(stt) ||
            WEXITSTATUS(stt)) {
            fprintf(stderr, "bench_trust: gguf synth failed\n");
            return 2;
        }
    }
    char eb[512];
    struct kvs_gguf *gg = NULL;
    struct kvs_hparams hp;
    if (kvs_gguf_open(model_path, &gg, eb, sizeof eb) || kvs_hparams_read(gg, &hp, eb, sizeof eb)) {
        fprintf(stderr, "bench_trust: %s: %s\n", model_path, eb);
        return 2;
    }
    kvs_gguf_close(gg);
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)((i * 7919 + 13) % (int32_t)hp.n_vocab);
    printf("model: %s (%s, %u blocks, n_embd %u), %d-stage loopback ring, %d threads per stage, %d decode tokens, "
           "%d rounds\n", model_path, hp.arch_name, hp.n_block, hp.n_embd, N_STAGES, n_threads, n_tok, rounds);
    fflush(stdout);

    double tps[2][MAX_ROUNDS], hop[2][MAX_ROUNDS]; /* [0] insecure, [1] TLS */
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 2; k++) {
            int keyed = (r + k) % 2; /* alternate which mode goes first */
            struct ring g;
            if (ring_start(&g, keyed, kvasir, model_path, hp.n_block, n_threads) ||
                decode_tps(g.head, prompt, 4) < 0 /* warm-up: faults the weights in */) {
                ring_stop(&g);
                return 2;
            }
            double t = decode_tps(g.head, prompt, n_tok + 1);
            double h = probe_hop_ms(g.head);
            ring_stop(&g);
            if (t < 0) return 2;
            tps[keyed][r] = t;
            hop[keyed][r] = h;
            printf("round %d %-8s decode %8.2f tok/s   idle probe hop %.3f ms\n", r + 1, keyed ? "TLS" : "insecure",
                   t, h);
            fflush(stdout);
        }
    }
    double pair[MAX_ROUNDS]; /* each round's TLS / insecure: the two rings ran back to back */
    for (int r = 0; r < rounds; r++) pair[r] = tps[1][r] / tps[0][r];
    double ratio = kvs_bench_median(pair, rounds);
    double ti = kvs_bench_median(tps[0], rounds), tt = kvs_bench_median(tps[1], rounds);
    double hi = kvs_bench_median(hop[0], rounds), ht = kvs_bench_median(hop[1], rounds);
    double added_decode = (1.0 / tt - 1.0 / ti) * 1e3 / N_STAGES;
    printf("median decode: TLS %.2f tok/s, insecure %.2f tok/s; median of the rounds' TLS / insecure: %.3f\n", tt, ti,
           ratio);
    printf("added latency per hop: %.3f ms from the idle probes (TLS %.3f, insecure %.3f ms); %.3f ms from the decode "
           "time per token over %d hops\n", ht - hi, ht, hi, added_decode, N_STAGES);
    bool pass = ratio >= TARGET_RATIO;
    printf("%s TLS / insecure decode %.3f (target >= %.2f)\n", pass ? "PASS" : "FAIL", ratio, TARGET_RATIO);
    printf("RESULT tls_ratio=%.3f tls_tps=%.2f insecure_tps=%.2f added_hop_ms_probe=%.3f added_hop_ms_decode=%.3f\n",
           ratio, tt, ti, ht - hi, added_decode);
    return pass ? 0 : 1;
}

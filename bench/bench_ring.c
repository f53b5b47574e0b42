/* bench_ring: decode speed of a 4-stage ring on loopback against a single
 * process, on a Qwen3-0.6B-shaped Q8_0 model (arch qwen3, n_embd 1024, 28
 * blocks, 16 heads / 8 KV heads, head_dim 128, FFN 3072, vocab 151936, tied)
 * with random weights made by `kvasir gguf synth` (reused from /tmp if
 * present), 2 compute threads per stage.
 *
 * Measures, in one run:
 *  (a) single-process decode tok/s (in-process kvs_model, greedy, after an
 *      8-token prompt);
 *  (b) decode tok/s of one sequence through a 4-stage ring: the head runs in
 *      this process (kvs_stage), ranks 1..3 are `kvasir stage` processes on
 *      127.0.0.1; time between the first and the last TOKEN event; and the
 *      ratio ring / single (target >= 0.9);
 *  (c) aggregate decode tok/s of 8 concurrent sequences through the same
 *      ring (tokens between the moment all 8 produced their first token and
 *      the moment the first one finished) over (b) (target >= 2.5);
 *  (d) bytes on the wire per token per hop during (b), from the probe trail
 *      (kvs_stage_ring_stats: bytes_out / rows of every activation hop) beside
 *      the theoretical DECODE frame: 24 header + 8 row header + 2 n_embd (F16);
 *  and, from the trail, each stage's compute ms per forward call and the hop
 *  latencies of the last probe.
 * Prints the figures, PASS/FAIL per target and a final line
 *   RESULT ring_ratio=.. concurrency_ratio=.. bytes_per_token_hop=..
 *
 * usage: bench_ring [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] [--stage-spin N] [--groups G]
 *   --model   GGUF (default /tmp/kvasir-qwen3-0.6b-q8_0.gguf; if absent the
 *             same-shaped /tmp/kvasir-bench-qwen3-0.6b-q8_0.gguf of
 *             bench_engine is used when present, else the first is created)
 *   --kvasir  the kvasir binary (default: next to this program, or $KVASIR_BIN)
 *   --threads compute threads per stage (default 2)
 *   --tokens  decode tokens per sequence (default 40)
 *   --stage-spin  the ring stages' pool spin (kvs_stage_params.pool_spin, kvasir
 *             stage --spin; head and processes): 0 = the stage default
 *             (KVS_STAGE_POOL_SPIN, short), -1 = the pool's long default, as
 *             the single-process run uses; KVASIR_SPIN in the environment
 *             overrides both (see src/kernels/pool.c)
 *   --groups  the head's decode groups (kvs_stage_params.decode_groups,
 *             default 1: the 8 sequences step as one batch)
 *   --insecure  plaintext links (default: throw-away node keys, TLS 1.3 on
 *             every link, as `kvasir run --ring`; bench_trust compares both)
 * Exit status: 0 when every target passes, 1 when one
 * fails, 2 on error. */
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_util.h"
#include "lib/bench_ring4.h"
#include "gguf/gguf.h"
#include "link/link.h"
#include "model/model.h"
#include "proto/proto.h"
#include "stage/stage.h"
#include "trust/trust.h"

extern char **environ;

#define N_STAGES 4
#define N_CONC 8
#define N_PROMPT 8
#define N_CTX 256
#define TARGET_RING_RATIO 0.9
#define TARGET_CONC_RATIO 2.5

static int32_t argmax(const float *x, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

/* (a): greedy decode of n_decode tokens after the prompt; returns tok/s or < 0. */
static double single_decode_tps(struct kvs_gguf *g, int n_threads, const int32_t *prompt, int n_decode)
{
    char eb[512];
    struct kvs_model_params mp = kvs_model_default_params();
    mp.n_threads = n_threads;
    mp.n_ctx = N_CTX;
    mp.n_batch = 64;
    struct kvs_model *m = NULL;
    if (kvs_model_load(g, &mp, &m, eb, sizeof eb)) {
        fprintf(stderr, "bench_ring: loading the model: %s\n", eb);
        return -1;
    }
    int32_t n_vocab = (int32_t)kvs_model_hparams(m)->n_vocab;
    float *logits = malloc((size_t)n_vocab * sizeof *logits);
    int32_t seq[N_PROMPT], pos[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) {
        seq[i] = 0;
        pos[i] = i;
    }
    double best = -1;
    for (int rep = 0; rep < 2 && logits; rep++) { /* rep 0 also faults the weights in */
        kvs_model_seq_clear(m, 0);
        struct kvs_batch b = { .n_tokens = N_PROMPT, .token = prompt, .seq = seq, .pos = pos };
        if (kvs_model_forward(m, &b, logits)) break;
        int32_t tok = argmax(logits, n_vocab), p = N_PROMPT, s0 = 0;
        double t0 = kvs_bench_now();
        for (int i = 0; i < n_decode; i++, p++) {
            struct kvs_batch d = { .n_tokens = 1, .token = &tok, .seq = &s0, .pos = &p };
            if (kvs_model_forward(m, &d, logits)) break;
            tok = argmax(logits, n_vocab);
        }
        double tps = n_decode / (kvs_bench_now() - t0);
        if (tps > best) best = tps;
    }
    free(logits);
    kvs_model_free(m);
    return best;
}

/* --- ring client ------------------------------------------------------------ */

struct rq {
    double *t;   /* [cap] time of each TOKEN event */
    int n, cap;
    bool done;
    double t_done;
    kvs_err err;
    char msg[256];
};

struct client {
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

struct cbx {
    struct client *c;
    struct rq *r;
};

static void on_event(void *user, const struct kvs_stage_event *ev)
{
    struct cbx *x = user;
    double now = kvs_bench_now();
    pthread_mutex_lock(&x->c->mu);
    if (ev->kind == KVS_STAGE_EVENT_TOKEN) {
        if (x->r->n < x->r->cap) x->r->t[x->r->n++] = now;
    } else {
        x->r->done = true;
        x->r->t_done = now;
        x->r->err = ev->kind == KVS_STAGE_EVENT_ERROR ? ev->err : KVS_OK;
        if (x->r->err) snprintf(x->r->msg, sizeof x->r->msg, "%s", ev->message ? ev->message : "");
    }
    pthread_mutex_unlock(&x->c->mu);
    pthread_cond_broadcast(&x->c->cv);
}

/* Runs n requests of max_tokens each at once; fills rs. Returns 0 or -1. */
static int run_requests(struct kvs_stage *head, struct client *c, struct rq *rs, int n, const int32_t *prompt,
                        int max_tokens)
{
    struct cbx x[N_CONC];
    for (int i = 0; i < n; i++) {
        memset(&rs[i], 0, sizeof rs[i]);
        rs[i].cap = max_tokens;
        rs[i].t = calloc((size_t)max_tokens, sizeof(double));
        if (!rs[i].t) return -1;
        x[i] = (struct cbx){ c, &rs[i] };
    }
    for (int i = 0; i < n; i++) {
        int32_t pr[N_PROMPT];
        memcpy(pr, prompt, sizeof pr);
        pr[N_PROMPT - 1] = prompt[N_PROMPT - 1] + i; /* distinct sequences */
        struct kvs_stage_request q = { .prompt = pr, .n_prompt = N_PROMPT, .max_tokens = max_tokens,
                                       .ignore_eos = true, .on_event = on_event, .user = &x[i] };
        q.sampling = kvs_sampler_default_params();
        q.sampling.temp = 0;
        uint32_t id;
        if (kvs_stage_submit(head, &q, &id)) {
            fprintf(stderr, "bench_ring: submit failed\n");
            return -1;
        }
    }
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < n; i++) {
        while (!rs[i].done) pthread_cond_wait(&c->cv, &c->mu);
        if (rs[i].err) {
            fprintf(stderr, "bench_ring: request %d failed: %s (%s)\n", i, rs[i].msg, kvs_strerror(rs[i].err));
            rc = -1;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
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

/* CPU seconds (user + system) used so far by this process and the stage
 * processes: what the ring burns, busy or idle, whatever else runs on the machine. */
static double ring_cpu_s(const pid_t *pids, int n)
{
    struct rusage ru;
    double t = 0;
    if (getrusage(RUSAGE_SELF, &ru) == 0)
        t += ru.ru_utime.tv_sec + ru.ru_stime.tv_sec + 1e-6 * (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
    long hz = sysconf(_SC_CLK_TCK);
    for (int i = 0; i < n; i++) {
        if (pids[i] <= 0) continue;
        char path[64], buf[1024];
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pids[i]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t k = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[k] = 0;
        const char *q = strrchr(buf, ')'); /* fields after the command name: state is field 3 */
        unsigned long ut = 0, st = 0;
        if (q && sscanf(q + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) == 2 && hz > 0)
            t += (double)(ut + st) / (double)hz;
    }
    return t;
}

/* Waits for a trail taken after now (probes go every second). */
static int fresh_trail(struct kvs_stage *head, struct kvs_stage_hop *h, int cap)
{
    struct kvs_stage_metrics m;
    kvs_stage_metrics(head, &m);
    poll(NULL, 0, 2200);
    int n = kvs_stage_ring_stats(head, h, cap, NULL);
    if (n > 0 && h[0].forward_calls != m.forward_calls) fprintf(stderr, "bench_ring: warning: trail is stale\n");
    return n;
}

int main(int argc, char **argv)
{
    const char *model_path = NULL;
    long stage_spin = 0, groups = 1;
    bool insecure = false;
    const char *kvasir = getenv("KVASIR_BIN");
    int n_threads = 2, n_tok = 40;
    char kvasir_buf[PATH_MAX + 16];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--insecure")) insecure = true;
        else if (!strcmp(argv[i], "--model") && i + 1 < argc) model_path = argv[++i];
        else if (!strcmp(argv[i], "--kvasir") && i + 1 < argc) kvasir = argv[++i];
        else if (!strcmp(argv[i], "--groups") && i + 1 < argc) {
            char *end;
            groups = strtol(argv[++i], &end, 10);
            if (*end || groups < 1 || groups > N_CONC) {
                fprintf(stderr, "bench_ring: --groups: out of range (1..%d)\n", N_CONC);
                return 2;
            }
        } else if (!strcmp(argv[i], "--stage-spin") && i + 1 < argc) {
            char *end;
            stage_spin = strtol(argv[++i], &end, 10);
            if (*end || stage_spin < -1 || stage_spin > 10000000) {
                fprintf(stderr, "bench_ring: --stage-spin: out of range (-1..10000000)\n");
                return 2;
            }
        }
        else if ((!strcmp(argv[i], "--threads") || !strcmp(argv[i], "--tokens")) && i + 1 < argc) {
            bool thr = !strcmp(argv[i], "--threads");
            char *end;
            long v = strtol(argv[++i], &end, 10);
            if (*end || v < (thr ? 1 : 4) || v > (thr ? 256 : N_CTX - N_PROMPT - 1)) {
                fprintf(stderr, "bench_ring: %s: out of range\n", thr ? "--threads" : "--tokens");
                return 2;
            }
            *(thr ? &n_threads : &n_tok) = (int)v;
        } else {
            fprintf(stderr, "usage: bench_ring [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] "
                            "[--stage-spin N] [--groups G] [--insecure]\n");
            return 2;
        }
    }
    if (!(kvasir = kvs_bench_kvasir(kvasir, kvasir_buf, sizeof kvasir_buf))) {
        fprintf(stderr, "bench_ring: cannot locate myself; give --kvasir\n");
        return 2;
    }
    if (!model_path) model_path = KVS_BENCH_QWEN3_Q8_0;
    if (kvs_bench_model("bench_ring", kvasir, model_path, "q8_0")) return 2;

    char eb[512];
    struct kvs_gguf *g = NULL;
    if (kvs_gguf_open(model_path, &g, eb, sizeof eb)) {
        fprintf(stderr, "bench_ring: %s: %s\n", model_path, eb);
        return 2;
    }
    struct kvs_hparams hp;
    if (kvs_hparams_read(g, &hp, eb, sizeof eb)) {
        fprintf(stderr, "bench_ring: %s: %s\n", model_path, eb);
        return 2;
    }
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)((i * 7919 + 13) % (int32_t)hp.n_vocab);
    printf("model: %s (%s, %u blocks, n_embd %u, vocab %u), %d threads per stage, %d decode tokens\n", model_path,
           hp.arch_name, hp.n_block, hp.n_embd, hp.n_vocab, n_threads, n_tok);
    fflush(stdout);

    /* (a) */
    double single = single_decode_tps(g, n_threads, prompt, n_tok);
    kvs_gguf_close(g);
    if (single <= 0) return 2;
    printf("(a) single process decode: %.2f tok/s\n", single);
    fflush(stdout);

    /* the ring: ranks 1..3 as processes */
    if (getenv("KVASIR_SPIN")) printf("stages and single process: KVASIR_SPIN=%s\n", getenv("KVASIR_SPIN"));
    else if (stage_spin == 0) printf("stages: pool spin %d (stage default)\n", KVS_STAGE_POOL_SPIN);
    else printf("stages: pool spin %ld%s\n", stage_spin, stage_spin < 0 ? " (the pool's long default)" : "");
    int port[N_STAGES];
    pid_t pids[N_STAGES] = { 0 };
    for (int r = 0; r < N_STAGES; r++)
        if ((port[r] = free_port()) <= 0) {
            fprintf(stderr, "bench_ring: no free port\n");
            return 2;
        }
    char a_thr[16], a_seq[16], a_ctx[16], a_spin[24];
    snprintf(a_spin, sizeof a_spin, "%ld", stage_spin);
    snprintf(a_thr, sizeof a_thr, "%d", n_threads);
    snprintf(a_seq, sizeof a_seq, "%d", N_CONC);
    snprintf(a_ctx, sizeof a_ctx, "%d", N_CTX);
    int rc = 2;
    struct kvs_stage *head = NULL;
    pthread_t th;
    bool running = false;
    /* throw-away node keys: rank r's in key_dir/kR.key, public keys in hex for the flags */
    char key_dir[] = "/tmp/kvasir-bench-keys-XXXXXX", key_path[N_STAGES][64], key_hex[N_STAGES][KVS_KEY_PUB_HEX + 1];
    struct kvs_key *keys[N_STAGES] = { 0 };
    if (!insecure) {
        if (!mkdtemp(key_dir)) {
            fprintf(stderr, "bench_ring: cannot make a key folder\n");
            return 2;
        }
        for (int r = 0; r < N_STAGES; r++) {
            uint8_t pub[KVS_KEY_PUB_BYTES];
            snprintf(key_path[r], sizeof key_path[r], "%s/k%d.key", key_dir, r);
            if (kvs_key_generate(&keys[r]) || kvs_key_save(keys[r], key_path[r], eb, sizeof eb)) {
                fprintf(stderr, "bench_ring: cannot make node keys\n");
                return 2;
            }
            kvs_key_public(keys[r], pub);
            kvs_key_public_hex(pub, key_hex[r]);
        }
    }
    printf("links: %s\n", insecure ? "plaintext (--insecure)" : "TLS 1.3 between throw-away node keys");
    for (int r = 1; r < N_STAGES; r++) {
        char a_win[32], a_listen[64], a_next[64];
        snprintf(a_win, sizeof a_win, "%u:%u", r * hp.n_block / N_STAGES, (r + 1) * hp.n_block / N_STAGES);
        snprintf(a_listen, sizeof a_listen, "127.0.0.1:%d", port[r]);
        snprintf(a_next, sizeof a_next, "127.0.0.1:%d", port[(r + 1) % N_STAGES]);
        char *const args[] = { (char *)kvasir, "stage", "-m", (char *)model_path, "--window", a_win, "--listen",
                               a_listen, "--next", a_next, "--threads", a_thr, "--seqs", a_seq, "--ctx", a_ctx,
                               "--spin", a_spin, insecure ? "--insecure" : "--key", key_path[r],
                               "--prev-key", key_hex[r - 1], "--next-key", key_hex[(r + 1) % N_STAGES], NULL };
        char *const args_insecure[] = { (char *)kvasir, "stage", "-m", (char *)model_path, "--window", a_win,
                                        "--listen", a_listen, "--next", a_next, "--threads", a_thr, "--seqs", a_seq,
                                        "--ctx", a_ctx, "--spin", a_spin, "--insecure", NULL };
        int e = posix_spawn(&pids[r], kvasir, NULL, NULL, insecure ? args_insecure : args, environ);
        if (e) {
            fprintf(stderr, "bench_ring: cannot start %s stage: %s\n", kvasir, strerror(e));
            pids[r] = 0;
            goto done;
        }
    }
    char h_listen[64], h_next[64];
    snprintf(h_listen, sizeof h_listen, "127.0.0.1:%d", port[0]);
    snprintf(h_next, sizeof h_next, "127.0.0.1:%d", port[1]);
    struct kvs_stage_params sp = kvs_stage_default_params();
    sp.model_path = model_path;
    sp.block_begin = 0;
    sp.block_end = (int32_t)(hp.n_block / N_STAGES);
    sp.listen = h_listen;
    sp.next = h_next;
    sp.n_threads = n_threads;
    sp.n_ctx = N_CTX;
    sp.n_seq = N_CONC;
    sp.pool_spin = (int32_t)stage_spin;
    sp.decode_groups = (int32_t)groups;
    sp.insecure = insecure;
    if (!insecure) {
        sp.key = keys[0];
        sp.has_prev_key = sp.has_next_key = true;
        kvs_key_public(keys[N_STAGES - 1], sp.prev_key);
        kvs_key_public(keys[1], sp.next_key);
    }
    if (kvs_stage_create(&sp, &head, eb, sizeof eb)) {
        fprintf(stderr, "bench_ring: head stage: %s\n", eb);
        goto done;
    }
    if (pthread_create(&th, NULL, loop_thread, head)) goto done;
    running = true;
    if (kvs_stage_wait_ready(head, 120000)) {
        fprintf(stderr, "bench_ring: the ring did not close\n");
        goto done;
    }
    struct client c;
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    struct rq rs[N_CONC];
    memset(rs, 0, sizeof rs);

    /* warm-up: faults every stage's weights in */
    if (run_requests(head, &c, rs, 1, prompt, 4)) goto done;
    free(rs[0].t);
    rs[0].t = NULL;

    /* (b) */
    struct kvs_stage_hop h0[N_STAGES + 1], h1[N_STAGES + 1];
    int n0 = fresh_trail(head, h0, N_STAGES + 1);
    double cpu0 = ring_cpu_s(pids, N_STAGES), w0 = kvs_bench_now();
    if (run_requests(head, &c, rs, 1, prompt, n_tok + 1)) goto done;
    double cpu_b = ring_cpu_s(pids, N_STAGES) - cpu0, wall_b = kvs_bench_now() - w0;
    int tok_b = rs[0].n;
    double ring1 = (rs[0].n - 1) / (rs[0].t[rs[0].n - 1] - rs[0].t[0]);
    free(rs[0].t);
    rs[0].t = NULL;
    double rtt = 0;
    int n1 = fresh_trail(head, h1, N_STAGES + 1);
    kvs_stage_ring_stats(head, h1, N_STAGES + 1, &rtt);
    printf("(b) %d-stage ring decode, 1 sequence: %.2f tok/s  ratio to single %.3f\n", N_STAGES, ring1,
           ring1 / single);
    printf("    ring CPU %.1f ms per token (%.2f cores busy on average over %.2f s)\n", 1e3 * cpu_b / tok_b,
           cpu_b / wall_b, wall_b);

    /* (d) and per-stage figures of the (b) run */
    double bpt = 0;
    int n_hops = 0;
    if (n0 == N_STAGES && n1 == N_STAGES) {
        for (int i = 0; i < N_STAGES; i++) {
            double calls = (double)(h1[i].forward_calls - h0[i].forward_calls);
            double rows = (double)(h1[i].rows - h0[i].rows);
            double bytes = (double)(h1[i].bytes_out - h0[i].bytes_out);
            printf("    stage [%2d,%2d): %4.0f forward calls, %7.2f ms per call, %8.0f bytes out = %7.1f per row; "
                   "probe residence %.3f ms, hop to next %.3f ms\n",
                   h1[i].block_begin, h1[i].block_end, calls, calls > 0 ? (h1[i].forward_ms - h0[i].forward_ms) / calls : 0,
                   bytes, rows > 0 ? bytes / rows : 0, h1[i].residence_ms, h1[i].hop_ms);
            if (i < N_STAGES - 1 && rows > 0) {
                bpt += bytes / rows;
                n_hops++;
            }
        }
        if (n_hops) bpt /= n_hops;
        printf("    probe round trip %.3f ms\n", rtt);
    } else {
        fprintf(stderr, "bench_ring: no probe trail (%d / %d stages)\n", n0, n1);
    }
    double theo = KVS_PROTO_HEADER_BYTES + 8.0 + 2.0 * hp.n_embd;
    printf("(d) bytes per token per activation hop: %.1f measured (incl. prefill rows and probes), %.0f theoretical "
           "(24 header + 8 row header + 2 x %u F16)\n", bpt, theo, hp.n_embd);

    /* (c) */
    n0 = fresh_trail(head, h0, N_STAGES + 1);
    cpu0 = ring_cpu_s(pids, N_STAGES);
    w0 = kvs_bench_now();
    if (run_requests(head, &c, rs, N_CONC, prompt, n_tok + 1)) goto done;
    double cpu_c = ring_cpu_s(pids, N_STAGES) - cpu0, wall_c = kvs_bench_now() - w0;
    int tok_c = 0;
    for (int i = 0; i < N_CONC; i++) tok_c += rs[i].n;
    n1 = fresh_trail(head, h1, N_STAGES + 1);
    for (int i = 0; i < N_STAGES && n0 == N_STAGES && n1 == N_STAGES; i++) {
        double calls = (double)(h1[i].forward_calls - h0[i].forward_calls);
        double rows = (double)(h1[i].rows - h0[i].rows);
        printf("    stage [%2d,%2d): %4.0f forward calls, %5.2f rows per call, %7.2f ms per call\n", h1[i].block_begin,
               h1[i].block_end, calls, calls > 0 ? rows / calls : 0,
               calls > 0 ? (h1[i].forward_ms - h0[i].forward_ms) / calls : 0);
    }
    double t_start = 0, t_end = 1e300;
    for (int i = 0; i < N_CONC; i++) {
        if (rs[i].t[0] > t_start) t_start = rs[i].t[0];
        double te = rs[i].t[rs[i].n - 1];
        if (te < t_end) t_end = te;
    }
    int cnt = 0;
    for (int i = 0; i < N_CONC; i++)
        for (int k = 0; k < rs[i].n; k++) cnt += rs[i].t[k] > t_start && rs[i].t[k] <= t_end;
    double conc = t_end > t_start ? cnt / (t_end - t_start) : 0;
    for (int i = 0; i < N_CONC; i++) {
        free(rs[i].t);
        rs[i].t = NULL;
    }
    printf("    decode groups %ld\n", groups);
    printf("(c) %d concurrent sequences: %.2f tok/s aggregate (%d tokens in %.2f s)  ratio to 1 sequence %.3f\n",
           N_CONC, conc, cnt, t_end - t_start, conc / ring1);
    printf("    ring CPU %.1f ms per token (%.2f cores busy on average over %.2f s)\n", 1e3 * cpu_c / tok_c,
           cpu_c / wall_c, wall_c);

    bool p1 = ring1 / single >= TARGET_RING_RATIO, p2 = conc / ring1 >= TARGET_CONC_RATIO;
    printf("%s ring/single %.3f (target >= %.1f)\n", p1 ? "PASS" : "FAIL", ring1 / single, TARGET_RING_RATIO);
    printf("%s concurrency %.3f (target >= %.1f)\n", p2 ? "PASS" : "FAIL", conc / ring1, TARGET_CONC_RATIO);
    printf("RESULT ring_ratio=%.3f concurrency_ratio=%.3f bytes_per_token_hop=%.1f single_tps=%.2f ring_tps=%.2f "
           "conc_tps=%.2f cpu_ms_per_tok_1=%.1f cpu_ms_per_tok_8=%.1f\n", ring1 / single, conc / ring1, bpt, single, ring1,
           conc, 1e3 * cpu_b / tok_b, 1e3 * cpu_c / tok_c);
    rc = p1 && p2 ? 0 : 1;
done:
    if (running) {
        kvs_stage_stop(head);
        pthread_join(th, NULL);
    }
    for (int r = 1; r < N_STAGES; r++)
        if (pids[r] > 0) kill(pids[r], SIGTERM);
    for (int r = 1; r < N_STAGES; r++)
        if (pids[r] > 0) waitpid(pids[r], NULL, 0);
    kvs_stage_free(head);
    for (int r = 0; r < N_STAGES && !insecure; r++) {
        kvs_key_free(keys[r]);
        unlink(key_path[r]);
    }
    if (!insecure) rmdir(key_dir);
    fflush(stdout);
    return rc;
}

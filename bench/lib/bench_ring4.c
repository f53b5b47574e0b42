/* The benchmarks' loopback ring and shared helpers (bench_ring4.h). */
#include "bench_ring4.h"

#include <errno.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../bench_util.h"
#include "link/link.h"

extern char **environ;

const char *kvs_bench_kvasir(const char *given, char *buf, size_t cap)
{
    if (given)
        return given;
    char self[PATH_MAX];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    if (k <= 0)
        return NULL;
    self[k] = 0;
    if (snprintf(buf, cap, "%s/kvasir", dirname(self)) >= (int)cap)
        return NULL;
    return buf;
}

int kvs_bench_spawn_wait(const char *who, char *const argv[])
{
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], NULL, NULL, argv, environ);
    if (rc) {
        fprintf(stderr, "%s: cannot run %s: %s\n", who, argv[0], strerror(rc));
        return -1;
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0)
        if (errno != EINTR)
            return -1;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
        fprintf(stderr, "%s: %s %s failed (status %d)\n", who, argv[0], argv[1] ? argv[1] : "", st);
        return -1;
    }
    return 0;
}

int kvs_bench_model(const char *who, const char *kvasir, const char *path, const char *type)
{
    struct stat st;
    if (stat(path, &st) == 0)
        return 0;
    char *const argv[] = {
        (char *)kvasir, "gguf", "synth", "--arch", "qwen3", "--n-embd", "1024", "--n-block", "28",
        "--n-head", "16", "--n-head-kv", "8", "--head-dim", "128", "--n-ff", "3072", "--n-vocab", "151936",
        "--tied", "--ctx", "4096", "--type", (char *)type, "--seed", "1", "-o", (char *)path, NULL,
    };
    fprintf(stderr, "%s: creating %s with %s gguf synth ...\n", who, path, kvasir);
    double t0 = kvs_bench_now();
    if (kvs_bench_spawn_wait(who, argv))
        return -1;
    fprintf(stderr, "%s: created in %.1f s\n", who, kvs_bench_now() - t0);
    return 0;
}

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
        if (w->n++ == 0)
            w->t_first = now;
        w->t_last = now;
    } else {
        w->done = true;
        w->err = ev->kind == KVS_STAGE_EVENT_ERROR ? ev->err : KVS_OK;
    }
    pthread_mutex_unlock(&w->mu);
    pthread_cond_broadcast(&w->cv);
}

double kvs_bench_decode_tps(struct kvs_stage *head, const int32_t *prompt, int n_prompt, int max_tokens,
                            const char *who)
{
    struct waiter w = { .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER };
    struct kvs_stage_request q = { .prompt = prompt, .n_prompt = n_prompt, .max_tokens = max_tokens,
                                   .ignore_eos = true, .on_event = on_event, .user = &w };
    q.sampling = kvs_sampler_default_params();
    q.sampling.temp = 0;
    uint32_t id;
    if (kvs_stage_submit(head, &q, &id))
        return -1;
    pthread_mutex_lock(&w.mu);
    while (!w.done)
        pthread_cond_wait(&w.cv, &w.mu);
    pthread_mutex_unlock(&w.mu);
    if (w.err || w.n < 2) {
        fprintf(stderr, "%s: request failed: %s\n", who, kvs_strerror(w.err));
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
    if (kvs_tcp_listen("127.0.0.1:0", &l, err, sizeof err))
        return -1;
    int p = kvs_listener_port(l);
    kvs_listener_close(l);
    return p;
}

void kvs_bench_ring4_stop(struct kvs_bench_ring4 *g)
{
    if (g->running) {
        kvs_stage_stop(g->head);
        pthread_join(g->th, NULL);
    }
    for (int r = 1; r < KVS_BENCH_RING4_STAGES; r++)
        if (g->pids[r] > 0)
            kill(g->pids[r], SIGTERM);
    for (int r = 1; r < KVS_BENCH_RING4_STAGES; r++)
        if (g->pids[r] > 0)
            waitpid(g->pids[r], NULL, 0);
    kvs_stage_free(g->head);
    for (int r = 0; r < KVS_BENCH_RING4_STAGES; r++) {
        kvs_key_free(g->keys[r]);
        if (g->keyed && g->key_path[r][0])
            unlink(g->key_path[r]);
    }
    if (g->keyed && g->key_dir[0])
        rmdir(g->key_dir);
    memset(g, 0, sizeof *g);
}

/* The address rank r listens on and the one it dials (its successor's). */
static void link_addrs(const struct kvs_bench_ring4_opts *o, const int *port, int r, char *listen, char *next,
                       size_t cap)
{
    int s = (r + 1) % KVS_BENCH_RING4_STAGES;
    if (o->edge_url) {
        o->edge_url(o->edge_ctx, r, listen, cap);
        o->edge_url(o->edge_ctx, s, next, cap);
    } else {
        snprintf(listen, cap, "127.0.0.1:%d", port[r]);
        snprintf(next, cap, "127.0.0.1:%d", port[s]);
    }
}

int kvs_bench_ring4_start(struct kvs_bench_ring4 *g, const struct kvs_bench_ring4_opts *o)
{
    enum { N = KVS_BENCH_RING4_STAGES, URL = 384 };
    memset(g, 0, sizeof *g);
    g->keyed = o->keyed;
    char eb[512];
    if (o->keyed) {
        snprintf(g->key_dir, sizeof g->key_dir, "/tmp/kvasir-bench-keys-XXXXXX");
        if (!mkdtemp(g->key_dir)) {
            g->key_dir[0] = 0;
            return -1;
        }
        for (int r = 0; r < N; r++) {
            uint8_t pub[KVS_KEY_PUB_BYTES];
            snprintf(g->key_path[r], sizeof g->key_path[r], "%s/k%d.key", g->key_dir, r);
            if (kvs_key_generate(&g->keys[r]) || kvs_key_save(g->keys[r], g->key_path[r], eb, sizeof eb))
                return -1;
            kvs_key_public(g->keys[r], pub);
            kvs_key_public_hex(pub, g->key_hex[r]);
        }
    }
    int port[N] = { 0 };
    for (int r = 0; r < N && !o->edge_url; r++)
        if ((port[r] = free_port()) <= 0)
            return -1;
    char a_thr[16], a_ctx[16];
    snprintf(a_thr, sizeof a_thr, "%d", o->n_threads);
    snprintf(a_ctx, sizeof a_ctx, "%d", o->n_ctx);
    for (int r = 1; r < N; r++) {
        char a_win[32], a_listen[URL], a_next[URL];
        snprintf(a_win, sizeof a_win, "%u:%u", r * o->n_block / N, (r + 1) * o->n_block / N);
        link_addrs(o, port, r, a_listen, a_next, URL);
        char *args[24] = { (char *)o->kvasir, "stage", "-m", (char *)o->model, "--window", a_win, "--listen", a_listen,
                           "--next", a_next, "--threads", a_thr, "--seqs", "1", "--ctx", a_ctx };
        int na = 16;
        if (o->edge_url && o->relay_ca) {
            args[na++] = "--relay-ca";
            args[na++] = (char *)o->relay_ca;
        }
        if (o->keyed) {
            args[na++] = "--key";
            args[na++] = g->key_path[r];
            args[na++] = "--prev-key";
            args[na++] = g->key_hex[r - 1];
            args[na++] = "--next-key";
            args[na++] = g->key_hex[(r + 1) % N];
        } else {
            args[na++] = "--insecure";
        }
        args[na] = NULL;
        int e = posix_spawn(&g->pids[r], o->kvasir, NULL, NULL, args, environ);
        if (e) {
            fprintf(stderr, "%s: cannot start %s stage: %s\n", o->who, o->kvasir, strerror(e));
            g->pids[r] = 0;
            return -1;
        }
    }
    char h_listen[URL], h_next[URL];
    link_addrs(o, port, 0, h_listen, h_next, URL);
    struct kvs_stage_params sp = kvs_stage_default_params();
    sp.model_path = o->model;
    sp.block_begin = 0;
    sp.block_end = (int32_t)(o->n_block / N);
    sp.listen = h_listen;
    sp.next = h_next;
    sp.n_threads = o->n_threads;
    sp.n_ctx = o->n_ctx;
    sp.n_seq = 1;
    sp.insecure = !o->keyed;
    sp.relay_ca = o->edge_url ? o->relay_ca : NULL;
    if (o->keyed) {
        sp.key = g->keys[0];
        sp.has_prev_key = sp.has_next_key = true;
        kvs_key_public(g->keys[N - 1], sp.prev_key);
        kvs_key_public(g->keys[1], sp.next_key);
    }
    if (kvs_stage_create(&sp, &g->head, eb, sizeof eb)) {
        fprintf(stderr, "%s: head stage: %s\n", o->who, eb);
        return -1;
    }
    if (pthread_create(&g->th, NULL, loop_thread, g->head))
        return -1;
    g->running = true;
    if (kvs_stage_wait_ready(g->head, 120000)) {
        fprintf(stderr, "%s: the ring did not close\n", o->who);
        return -1;
    }
    return 0;
}

int kvs_bench_ring_args(int argc, char **argv, const char *who, const char **model, const char **kvasir,
                        int *n_threads, int *n_tok, int max_tokens, int *rounds, int max_rounds)
{
    for (int i = 1; i < argc; i++) {
        long v = 0;
        char *end = NULL;
        const char *a = argv[i];
        if (!strcmp(a, "--model") && i + 1 < argc) {
            *model = argv[++i];
        } else if (!strcmp(a, "--kvasir") && i + 1 < argc) {
            *kvasir = argv[++i];
        } else if ((!strcmp(a, "--threads") || !strcmp(a, "--tokens") || !strcmp(a, "--rounds")) && i + 1 < argc &&
                   (v = strtol(argv[i + 1], &end, 10)) > 0 && !*end) {
            if (!strcmp(a, "--threads") && v <= 256)
                *n_threads = (int)v;
            else if (!strcmp(a, "--tokens") && v >= 4 && v <= max_tokens)
                *n_tok = (int)v;
            else if (!strcmp(a, "--rounds") && v <= max_rounds)
                *rounds = (int)v;
            else {
                fprintf(stderr, "%s: %s: out of range\n", who, a);
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, "usage: %s [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] [--rounds R]\n", who);
            return 2;
        }
    }
    return 0;
}

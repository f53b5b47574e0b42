/* kvasir serve: a local ring of N stages and the OpenAI-compatible API on
 * its head. Ranks 1..N-1 are `kvasir stage` children on loopback ports (an
 * even split of the blocks); rank 0 runs in this process, its loop on a
 * thread, the HTTP server beside it. SIGINT/SIGTERM/SIGHUP stop the API, the
 * head and every child (children also get SIGTERM if this process dies). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "api/api.h"
#include "cli/cli.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "link/link.h"
#include "model/model.h"
#include "stage/stage.h"

static void serve_usage(FILE *f)
{
    fprintf(f, "usage: kvasir serve --ring N -m MODEL [options]\n"
               "  --ring N             stages in the local ring (>= 2, <= the model's blocks)\n"
               "  --port P             HTTP port (default 8080; 0 = any free port, logged)\n"
               "  --host ADDR          IPv4 address to listen on (default 127.0.0.1)\n"
               "  --model-name NAME    model id in the API (default: the file name)\n"
               "  --threads T          compute threads per stage (default 2)\n"
               "  --ctx N              context length (default min(model's, 4096))\n"
               "  --seqs S             sequence slots per stage (default 4)\n"
               "  --boundary f16|f32   boundary precision on the links (default f16)\n"
               "  --max-body BYTES     request body cap (default 1048576)\n"
               "  --step-delay MS      test hook: sleep before every forward on every stage\n");
}

static int serve_num(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int serve_free_port(void)
{
    struct kvs_listener *l;
    char err[128];
    if (kvs_tcp_listen("127.0.0.1:0", &l, err, sizeof err)) return -1;
    int p = kvs_listener_port(l);
    kvs_listener_close(l);
    return p;
}

static void serve_reap(pid_t *pids, int n)
{
    for (int i = 0; i < n; i++)
        if (pids[i] > 0) kill(pids[i], SIGTERM);
    int64_t deadline = kvs_link_now_ms() + 3000;
    for (int i = 0; i < n; i++) {
        if (pids[i] <= 0) continue;
        for (;;) {
            pid_t r = waitpid(pids[i], NULL, WNOHANG);
            if (r == pids[i] || (r < 0 && errno != EINTR)) break;
            if (kvs_link_now_ms() > deadline) {
                kill(pids[i], SIGKILL);
                waitpid(pids[i], NULL, 0);
                break;
            }
            poll(NULL, 0, 20);
        }
        pids[i] = 0;
    }
}

static void *serve_loop(void *arg)
{
    kvs_err e = kvs_stage_run(arg);
    if (e) KVS_LOGE("serve: head loop: %s", kvs_strerror(e));
    return NULL;
}

int kvs_cli_serve(int argc, char **argv)
{
    const char *model = NULL, *host = "127.0.0.1", *name = NULL;
    long ring = 0, port = 8080, threads = 2, n_ctx = 0, seqs = 4, max_body = 1 << 20, delay = 0;
    bool f32 = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            serve_usage(stdout);
            return 0;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvasir serve: unknown option or missing value: %s\n", a);
            serve_usage(stderr);
            return 2;
        }
        int bad = 0;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--ring")) bad = serve_num(v, 2, 1024, &ring);
        else if (!strcmp(a, "--port")) bad = serve_num(v, 0, 65535, &port);
        else if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--model-name")) name = v;
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) bad = serve_num(v, 1, 512, &threads);
        else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) bad = serve_num(v, 1, 1 << 24, &n_ctx);
        else if (!strcmp(a, "--seqs")) bad = serve_num(v, 1, 1024, &seqs);
        else if (!strcmp(a, "--max-body")) bad = serve_num(v, 1024, 1L << 30, &max_body);
        else if (!strcmp(a, "--step-delay")) bad = serve_num(v, 0, 10000, &delay);
        else if (!strcmp(a, "--boundary")) {
            bad = strcmp(v, "f16") && strcmp(v, "f32");
            f32 = !strcmp(v, "f32");
        } else {
            fprintf(stderr, "kvasir serve: unknown option: %s\n", a);
            serve_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir serve: bad value for %s: %s\n", a, v);
            return 2;
        }
        i++;
    }
    if (!model || ring < 2) {
        fprintf(stderr, "kvasir serve: --ring N (N >= 2) and -m MODEL are required\n");
        serve_usage(stderr);
        return 2;
    }

    char err[512];
    struct kvs_gguf *g;
    struct kvs_hparams hp;
    kvs_err e = kvs_gguf_open(model, &g, err, sizeof err);
    if (!e) {
        e = kvs_hparams_read(g, &hp, err, sizeof err);
        kvs_gguf_close(g);
    }
    if (e) {
        fprintf(stderr, "kvasir serve: %s: %s (%s)\n", model, kvs_strerror(e), err);
        return 1;
    }
    if (ring > (long)hp.n_block) {
        fprintf(stderr, "kvasir serve: --ring %ld is more than the model's %u blocks\n", ring, hp.n_block);
        return 2;
    }
    int n = (int)ring;
    int *ports = calloc((size_t)n, sizeof *ports);
    pid_t *pids = calloc((size_t)n, sizeof *pids);
    if (!ports || !pids) {
        free(ports);
        free(pids);
        return 1;
    }
    int rc = 1;
    for (int r = 0; r < n; r++)
        if ((ports[r] = serve_free_port()) <= 0) {
            fprintf(stderr, "kvasir serve: no free loopback port\n");
            free(ports);
            free(pids);
            return 1;
        }

    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old); /* inherited by every thread started below */
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);

    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    struct kvs_stage *head = NULL;
    struct kvs_api *api = NULL;
    pthread_t loop;
    bool loop_started = false;
    if (sl <= 0 || sfd < 0) {
        fprintf(stderr, "kvasir serve: cannot find this binary or set up signals\n");
        goto done;
    }
    self[sl] = '\0';

    char a_listen[64], a_next[64], a_win[64], a_thr[16], a_ctx[16], a_seq[16], a_delay[16];
    for (int r = 1; r < n; r++) {
        int b = (int)((long)r * hp.n_block / n), en = (int)((long)(r + 1) * hp.n_block / n);
        snprintf(a_listen, sizeof a_listen, "127.0.0.1:%d", ports[r]);
        snprintf(a_next, sizeof a_next, "127.0.0.1:%d", ports[(r + 1) % n]);
        snprintf(a_win, sizeof a_win, "%d:%d", b, en);
        snprintf(a_thr, sizeof a_thr, "%ld", threads);
        snprintf(a_ctx, sizeof a_ctx, "%ld", n_ctx);
        snprintf(a_seq, sizeof a_seq, "%ld", seqs);
        snprintf(a_delay, sizeof a_delay, "%ld", delay);
        char *args[] = { self, "stage", "-m", (char *)model, "--window", a_win, "--listen", a_listen,
                         "--next", a_next, "--threads", a_thr, "--ctx", a_ctx, "--seqs", a_seq,
                         "--boundary", f32 ? "f32" : "f16", delay ? "--step-delay" : NULL, a_delay, NULL };
        fflush(NULL);
        pid_t pid = fork();
        if (pid < 0) {
            fprintf(stderr, "kvasir serve: fork: %s\n", strerror(errno));
            goto done;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGTERM);
            pthread_sigmask(SIG_SETMASK, &old, NULL);
            execv(self, args);
            _exit(127);
        }
        pids[r] = pid;
        KVS_LOGI("serve: rank %d (pid %d) blocks [%d,%d) on %s", r, (int)pid, b, en, a_listen);
    }

    struct kvs_stage_params sp = kvs_stage_default_params();
    snprintf(a_listen, sizeof a_listen, "127.0.0.1:%d", ports[0]);
    snprintf(a_next, sizeof a_next, "127.0.0.1:%d", ports[1 % n]);
    sp.model_path = model;
    sp.block_begin = 0;
    sp.block_end = (int32_t)(hp.n_block / (uint32_t)n);
    sp.listen = a_listen;
    sp.next = a_next;
    sp.n_threads = (int32_t)threads;
    sp.n_ctx = (int32_t)n_ctx;
    sp.n_seq = (int32_t)seqs;
    sp.boundary_f32 = f32;
    sp.step_delay_ms = (int32_t)delay;
    if ((e = kvs_stage_create(&sp, &head, err, sizeof err))) {
        fprintf(stderr, "kvasir serve: head stage: %s (%s)\n", kvs_strerror(e), err);
        goto done;
    }
    if (pthread_create(&loop, NULL, serve_loop, head)) {
        fprintf(stderr, "kvasir serve: cannot start the head loop\n");
        goto done;
    }
    loop_started = true;

    struct kvs_api_params ap = kvs_api_default_params();
    ap.bind_addr = host;
    ap.port = (uint16_t)port;
    ap.model_path = model;
    ap.model_name = name;
    ap.max_body = (size_t)max_body;
    if ((e = kvs_api_start(head, &ap, &api, err, sizeof err))) {
        fprintf(stderr, "kvasir serve: API: %s (%s)\n", kvs_strerror(e), err);
        goto done;
    }
    KVS_LOGI("serve: ring of %d stages, API on http://%s:%u", n, host, (unsigned)kvs_api_port(api));

    /* Wait for a signal; note children that die (the ring then reports not ready). */
    for (;;) {
        struct pollfd pf = { .fd = sfd, .events = POLLIN };
        int pr = poll(&pf, 1, 500);
        if (pr > 0) {
            struct signalfd_siginfo si;
            if (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
                KVS_LOGI("serve: signal %u, shutting down", si.ssi_signo);
                break;
            }
        } else if (pr < 0 && errno != EINTR) {
            break;
        }
        for (int r = 1; r < n; r++) {
            int st;
            if (pids[r] > 0 && waitpid(pids[r], &st, WNOHANG) == pids[r]) {
                KVS_LOGE("serve: rank %d (pid %d) exited (status %d)", r, (int)pids[r], st);
                pids[r] = 0;
            }
        }
    }
    rc = 0;
done:
    kvs_api_stop(api);
    if (loop_started) {
        kvs_stage_stop(head);
        pthread_join(loop, NULL);
    }
    kvs_stage_free(head);
    serve_reap(pids, n);
    if (sfd >= 0) close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    free(ports);
    free(pids);
    return rc;
}

/* A ring of local stage processes on loopback, for `kvasir run --ring N` and
 * `kvasir serve --ring N`: ranks 1..N-1 are child `kvasir stage` processes
 * (this same binary), rank 0 (the head) runs in the caller. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_ring.h"
#include "common/log.h"
#include "common/rng.h"
#include "gguf/gguf.h"
#include "link/link.h"
#include "model/model.h"
#include "trust/trust.h"

/* A free loopback port (bound then released: another process could take it
 * before the stage binds it, which then fails loudly and ends the run). Drawn
 * from 20000..32767, below Linux's ephemeral range (32768..60999): a port the
 * kernel picked for us there can meanwhile become the source port of any
 * outgoing connection on the machine. Port 0 (the kernel's pick) if none of
 * 64 draws binds. */
static int free_port(struct kvs_rng *draw)
{
    struct kvs_listener *l;
    char err[128], addr[32];
    for (int attempt = 0; attempt <= 64; attempt++) { /* the last attempt: port 0 */
        int want = attempt < 64 ? 20000 + (int)(kvs_rng_next(draw) % 12768u) : 0;
        snprintf(addr, sizeof addr, "127.0.0.1:%d", want);
        if (kvs_tcp_listen(addr, &l, err, sizeof err) == KVS_OK) {
            int p = kvs_listener_port(l);
            kvs_listener_close(l);
            return p;
        }
    }
    return -1;
}

#define CTL_FD 3 /* a child's end of its control socket (--control-fd) */

/* Forks and execs child k (its argument vector is ready: nothing is
 * allocated between fork and exec), with its control socket as fd CTL_FD;
 * takeover: a replacement for a planned leave (--takeover its state file).
 * Returns the pid and the supervisor's end of the socket in *ctl, or -1
 * (errno). */
static pid_t spawn(struct kvs_local_ring *lr, struct kvs_local_child *k, bool takeover, int *ctl)
{
    int sv[2];
    *ctl = -1;
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv)) return -1;
    k->args[k->n_args] = takeover ? "--takeover" : NULL;
    k->args[k->n_args + 1] = takeover ? k->a_hand : NULL;
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        int en = errno;
        close(sv[0]);
        close(sv[1]);
        errno = en;
        return -1;
    }
    if (pid == 0) {
        /* SIGTERM when the thread that forked ends: the caller's thread, or the supervisor's,
         * which ends only in kvs_local_ring_stop (which then stops every child anyway) */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (lr->has_child_mask) pthread_sigmask(SIG_SETMASK, &lr->child_mask, NULL);
        if (sv[1] == CTL_FD) fcntl(CTL_FD, F_SETFD, 0);
        else if (dup2(sv[1], CTL_FD) < 0) _exit(127);
        execv(k->self, k->args);
        _exit(127);
    }
    close(sv[1]);
    *ctl = sv[0];
    k->started_ms = kvs_link_now_ms();
    return pid;
}

static void ctl_close(int *fd)
{
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

static void ctl_say(int fd, const char *word)
{
    if (fd >= 0) (void)!send(fd, word, strlen(word), MSG_NOSIGNAL | MSG_DONTWAIT);
}

/* Reads a control socket without waiting: 1 and the words in buf, 0 nothing
 * yet, -1 closed (*fd closed). */
static int ctl_read(int *fd, char *buf, size_t cap)
{
    if (*fd < 0) return 0;
    ssize_t n = recv(*fd, buf, cap - 1, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return 0;
    if (n <= 0) {
        ctl_close(fd);
        return -1;
    }
    buf[n] = '\0';
    return 1;
}

int kvs_local_ring_start(const struct kvs_local_ring_opts *o, struct kvs_local_ring *lr,
                         struct kvs_stage_params *head)
{
    memset(lr, 0, sizeof *lr);
    char err[512];
    struct kvs_gguf *g;
    struct kvs_hparams hp;
    kvs_err e = kvs_gguf_open(o->model, &g, err, sizeof err);
    if (!e) {
        e = kvs_hparams_read(g, &hp, err, sizeof err);
        int shard = !e && kvs_cli_need_whole_model(g, o->who, o->model);
        kvs_gguf_close(g);
        if (shard) return 1;
    }
    if (e) {
        fprintf(stderr, "kvasir %s: %s: %s (%s)\n", o->who, o->model, kvs_strerror(e), err);
        return 1;
    }
    const int n_min = o->allow_solo ? 1 : 2;
    if (o->n < n_min || o->n > (int)hp.n_block) {
        fprintf(stderr, "kvasir %s: --ring %d: a ring needs %d to %u stages for this model's %u blocks\n", o->who,
                o->n, n_min, hp.n_block, hp.n_block);
        return 2;
    }
    const int n = o->n;
    /* --threads default: this process's cores shared by the stages on this machine */
    long threads = o->threads > 0 ? o->threads : kvs_cli_default_threads() / n;
    if (threads < 1) threads = 1;
    lr->n = n;
    lr->n_block = hp.n_block;
    lr->ports = calloc((size_t)n, sizeof *lr->ports);
    lr->pids = calloc((size_t)n, sizeof *lr->pids);
    if (!lr->ports || !lr->pids) goto fail;
    struct kvs_rng draw;
    kvs_rng_seed(&draw, ((uint64_t)getpid() << 32) ^ (uint64_t)kvs_link_now_ms());
    for (int r = 0; r < n; r++) {
        bool dup = true;
        for (int tries = 0; dup && tries < 16; tries++) { /* released ports can be drawn again */
            lr->ports[r] = free_port(&draw);
            dup = false;
            for (int q = 0; q < r; q++) dup |= lr->ports[q] == lr->ports[r];
        }
        if (lr->ports[r] <= 0 || dup) {
            fprintf(stderr, "kvasir %s: no free loopback port\n", o->who);
            goto fail;
        }
    }
    char self[4096];
    ssize_t sl = readlink("/proc/self/exe", self, sizeof self - 1);
    if (sl <= 0) {
        fprintf(stderr, "kvasir %s: cannot find this binary\n", o->who);
        goto fail;
    }
    self[sl] = '\0';

    /* throw-away keys: rank r's file for the children, every public key for the neighbours */
    uint8_t(*pub)[KVS_KEY_PUB_BYTES] = NULL;
    char(*pub_hex)[KVS_KEY_PUB_HEX + 1] = NULL;
    bool keyed = !o->insecure && n > 1;
    if (keyed) {
        pub = calloc((size_t)n, sizeof *pub);
        pub_hex = calloc((size_t)n, sizeof *pub_hex);
        snprintf(lr->key_dir, sizeof lr->key_dir, "/tmp/kvasir-ring-keys-XXXXXX");
        if (!pub || !pub_hex || !mkdtemp(lr->key_dir)) {
            lr->key_dir[0] = '\0';
            fprintf(stderr, "kvasir %s: cannot make a folder for the ring's keys\n", o->who);
            goto fail_keys;
        }
        for (int r = 0; r < n; r++) {
            struct kvs_key *k;
            char path[128];
            snprintf(path, sizeof path, "%s/rank%d.key", lr->key_dir, r);
            if (kvs_key_generate(&k) || (r > 0 && kvs_key_save(k, path, err, sizeof err))) {
                if (k) kvs_key_free(k);
                fprintf(stderr, "kvasir %s: cannot make the ring's keys\n", o->who);
                goto fail_keys;
            }
            kvs_key_public(k, pub[r]);
            kvs_key_public_hex(pub[r], pub_hex[r]);
            if (r == 0) lr->head_key = k;
            else kvs_key_free(k);
        }
    }
    lr->kids = calloc((size_t)n, sizeof *lr->kids);
    if (!lr->kids) goto fail_keys;
    for (int r = 0; r < n; r++) lr->kids[r].ctl = lr->kids[r].repl_ctl = -1;
    snprintf(lr->state_dir, sizeof lr->state_dir, "/tmp/kvasir-ring-state-XXXXXX");
    if (n == 1) lr->state_dir[0] = '\0';
    else if (!mkdtemp(lr->state_dir)) {
        lr->state_dir[0] = '\0';
        fprintf(stderr, "kvasir %s: cannot make a folder for the ring's handover files\n", o->who);
        goto fail_keys;
    }
    if (o->child_mask) {
        lr->child_mask = *o->child_mask;
        lr->has_child_mask = true;
    }
    snprintf(lr->who, sizeof lr->who, "%s", o->who);
    pthread_mutex_init(&lr->mu, NULL);
    lr->mu_init = true;
    for (int r = 1; r < n; r++) {
        struct kvs_local_child *k = &lr->kids[r];
        int b = (int)((long)r * hp.n_block / n), en = (int)((long)(r + 1) * hp.n_block / n);
        k->block_begin = b;
        k->block_end = en;
        snprintf(k->self, sizeof k->self, "%s", self);
        snprintf(k->model, sizeof k->model, "%s", o->model);
        snprintf(k->a_listen, sizeof k->a_listen, "127.0.0.1:%d", lr->ports[r]);
        snprintf(k->a_next, sizeof k->a_next, "127.0.0.1:%d", lr->ports[(r + 1) % n]);
        snprintf(k->a_win, sizeof k->a_win, "%d:%d", b, en);
        snprintf(k->a_thr, sizeof k->a_thr, "%ld", threads);
        snprintf(k->a_ctx, sizeof k->a_ctx, "%ld", o->n_ctx);
        snprintf(k->a_seq, sizeof k->a_seq, "%ld", o->seqs);
        snprintf(k->a_delay, sizeof k->a_delay, "%ld", o->step_delay_ms);
        /* run --ring: the stage processes log warnings and errors only, unless the user chose a
         * level (KVASIR_LOG, -v, --log-level: inherited through the environment). */
        const bool quiet = !strcmp(o->who, "run") && !getenv("KVASIR_LOG");
        snprintf(k->a_key, sizeof k->a_key, "%s/rank%d.key", lr->key_dir, r);
        snprintf(k->a_hand, sizeof k->a_hand, "%s/rank%d.state", lr->state_dir, r);
        k->ctl = k->repl_ctl = -1;
        if (keyed) {
            snprintf(k->a_prev_key, sizeof k->a_prev_key, "%s", pub_hex[r - 1]);
            snprintf(k->a_next_key, sizeof k->a_next_key, "%s", pub_hex[(r + 1) % n]);
        }
        char **args = k->args;
        int na = 0;
        const char *fixed[] = { k->self, "stage", "-m", k->model, "--window", k->a_win, "--listen", k->a_listen,
                                "--next", k->a_next, "--threads", k->a_thr, "--ctx", k->a_ctx, "--seqs", k->a_seq,
                                "--boundary", o->boundary_f32 ? "f32" : "f16" };
        for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) args[na++] = (char *)fixed[i];
        if (quiet) { /* else no --log-level: the environment's level */
            args[na++] = "--log-level";
            args[na++] = "warn";
        }
        if (keyed) {
            args[na++] = "--key";
            args[na++] = k->a_key;
            args[na++] = "--prev-key";
            args[na++] = k->a_prev_key;
            args[na++] = "--next-key";
            args[na++] = k->a_next_key;
        } else {
            args[na++] = "--insecure";
        }
        if (o->step_delay_ms) {
            args[na++] = "--step-delay";
            args[na++] = k->a_delay;
        }
        if (o->backend) {
            snprintf(k->a_dev, sizeof k->a_dev, "%d", o->device);
            args[na++] = "--backend";
            args[na++] = "opencl";
            args[na++] = "--device";
            args[na++] = k->a_dev;
        }
        args[na++] = "--control-fd";
        args[na++] = CTL_FD == 3 ? "3" : "?";
        args[na++] = "--handover";
        args[na++] = k->a_hand;
        k->n_args = na; /* then "--takeover" FILE for a replacement, NULL */
        args[na] = NULL;
        pid_t pid = spawn(lr, k, false, &k->ctl);
        if (pid < 0) {
            fprintf(stderr, "kvasir %s: fork: %s\n", o->who, strerror(errno));
            goto fail_keys;
        }
        lr->pids[r] = pid;
        KVS_LOGI("%s: rank %d (pid %d) blocks [%d,%d) on %s", o->who, r, (int)pid, b, en, k->a_listen);
    }
    snprintf(lr->head_listen, sizeof lr->head_listen, "127.0.0.1:%d", lr->ports[0]);
    snprintf(lr->head_next, sizeof lr->head_next, "127.0.0.1:%d", lr->ports[1 % n]);
    head->model_path = o->model;
    head->block_begin = 0;
    head->block_end = (int32_t)(hp.n_block / (uint32_t)n);
    head->listen = lr->head_listen;
    head->next = n > 1 ? lr->head_next : NULL; /* one stage: the whole model, no links (solo) */
    head->n_threads = (int32_t)threads;
    head->n_ctx = (int32_t)o->n_ctx;
    head->n_seq = (int32_t)o->seqs;
    head->boundary_f32 = o->boundary_f32;
    head->backend = o->backend;
    head->device = o->device;
    head->step_delay_ms = (int32_t)o->step_delay_ms;
    head->insecure = !keyed;
    if (keyed) {
        head->key = lr->head_key;
        head->has_prev_key = head->has_next_key = true;
        memcpy(head->prev_key, pub[n - 1], KVS_KEY_PUB_BYTES);
        memcpy(head->next_key, pub[1], KVS_KEY_PUB_BYTES);
    }
    free(pub);
    free(pub_hex);
    return 0;
fail_keys:
    free(pub);
    free(pub_hex);
fail:
    kvs_local_ring_stop(lr);
    return 1;
}

/* Restart delay after `quick` consecutive short lives (the child ran less
 * than SUPERVISE_STABLE_MS, this exit included): at once for the first, then
 * 250 ms doubling to 8 s (a child that cannot start does not spin). */
#define SUPERVISE_STABLE_MS 10000
static int restart_delay_ms(int quick)
{
    if (quick <= 1) return 0;
    int ms = 250;
    for (int i = 2; i < quick && ms < 8000; i++) ms *= 2;
    return ms > 8000 ? 8000 : ms;
}

static void describe_status(int st, char *buf, size_t cap)
{
    if (WIFSIGNALED(st)) snprintf(buf, cap, "killed by signal %d", WTERMSIG(st));
    else if (WIFEXITED(st)) snprintf(buf, cap, "exit status %d", WEXITSTATUS(st));
    else snprintf(buf, cap, "status %d", st);
}

/* The control sockets of rank r (docs/PROTOCOL.md §5.2), under lr->mu. */
static void serve_control(struct kvs_local_ring *lr, int r)
{
    struct kvs_local_child *k = &lr->kids[r];
    char buf[64];
    int got = ctl_read(&k->ctl, buf, sizeof buf);
    if (got > 0 && strstr(buf, "leave")) {
        if (!lr->supervise || k->repl_pid > 0) {
            ctl_say(k->ctl, "no\n"); /* not supervised (or already being replaced): it stops as before */
        } else {
            unlink(k->a_hand); /* a stale file of an earlier leave */
            pid_t pid = spawn(lr, k, true, &k->repl_ctl);
            if (pid < 0) {
                KVS_LOGE("%s: rank %d: fork: %s (it stops instead of handing over)", lr->who, r, strerror(errno));
                ctl_say(k->ctl, "no\n");
            } else {
                k->repl_pid = pid;
                k->restarts++;
                lr->restarts++;
                KVS_LOGW("%s: rank %d restarted (pid %d, blocks [%d,%d) on %s, restart %d): pid %d leaves on "
                         "purpose and hands its sequences over", lr->who, r, (int)pid, k->block_begin, k->block_end,
                         k->a_listen, k->restarts, (int)lr->pids[r]);
            }
        }
    }
    got = ctl_read(&k->repl_ctl, buf, sizeof buf);
    if (got > 0 && strstr(buf, "ready")) ctl_say(k->ctl, "go\n");
}

int kvs_local_ring_poll_children(struct kvs_local_ring *lr)
{
    int died = 0;
    if (!lr->pids || !lr->kids) return 0;
    pthread_mutex_lock(&lr->mu);
    int64_t now = kvs_link_now_ms();
    for (int r = 1; r < lr->n; r++) {
        struct kvs_local_child *k = &lr->kids[r];
        int st;
        serve_control(lr, r);
        if (k->repl_pid > 0 && waitpid(k->repl_pid, &st, WNOHANG) == k->repl_pid) {
            char how[48];
            describe_status(st, how, sizeof how);
            KVS_LOGE("%s: rank %d: the replacement (pid %d) exited (%s) before it took over", lr->who, r,
                     (int)k->repl_pid, how);
            k->repl_pid = 0;
            ctl_close(&k->repl_ctl);
            ctl_say(k->ctl, "no\n"); /* the leaving stage stops as before: restarted, the head replays */
        }
        if (lr->pids[r] > 0 && waitpid(lr->pids[r], &st, WNOHANG) == lr->pids[r]) {
            char how[48];
            describe_status(st, how, sizeof how);
            died++;
            ctl_close(&k->ctl);
            if (k->repl_pid > 0) { /* a planned leave: the replacement has the rank now */
                if (access(k->a_hand, F_OK) != 0) /* it left without its state: the replacement starts empty */
                    ctl_say(k->repl_ctl, "no\n");
                KVS_LOGI("%s: rank %d (pid %d) left (%s); pid %d serves blocks [%d,%d)", lr->who, r,
                         (int)lr->pids[r], how, (int)k->repl_pid, k->block_begin, k->block_end);
                lr->pids[r] = k->repl_pid;
                k->ctl = k->repl_ctl;
                k->repl_pid = 0;
                k->repl_ctl = -1;
                k->quick = 0;
                continue;
            }
            if (!lr->supervise) {
                KVS_LOGE("rank %d (pid %d) exited (%s)", r, (int)lr->pids[r], how);
                lr->pids[r] = 0;
                continue;
            }
            /* a planned leave (SIGTERM: the stage finished its step and said goodbye, or exit 0) is
             * replaced at once; a crash soon after a start counts toward the backoff */
            bool planned = (WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM) || (WIFEXITED(st) && WEXITSTATUS(st) == 0);
            k->quick = planned || now - k->started_ms >= SUPERVISE_STABLE_MS ? 0 : k->quick + 1;
            int delay = restart_delay_ms(k->quick);
            k->restart_at_ms = now + delay;
            k->waiting = true;
            KVS_LOGW("%s: rank %d (pid %d, blocks [%d,%d)) exited (%s): restarting it in %d ms", lr->who, r,
                     (int)lr->pids[r], k->block_begin, k->block_end, how, delay);
            lr->pids[r] = 0;
        }
        if (lr->supervise && k->waiting && now >= k->restart_at_ms) {
            pid_t pid = spawn(lr, k, false, &k->ctl);
            if (pid < 0) {
                k->quick++;
                k->restart_at_ms = now + restart_delay_ms(k->quick);
                KVS_LOGE("%s: rank %d: fork: %s (next try in %d ms)", lr->who, r, strerror(errno),
                         restart_delay_ms(k->quick));
                continue;
            }
            k->waiting = false;
            k->restarts++;
            lr->pids[r] = pid;
            lr->restarts++;
            KVS_LOGW("%s: rank %d restarted (pid %d, blocks [%d,%d) on %s, restart %d)", lr->who, r, (int)pid,
                     k->block_begin, k->block_end, k->a_listen, k->restarts);
        }
    }
    pthread_mutex_unlock(&lr->mu);
    return died;
}

static void *supervise_main(void *arg)
{
    struct kvs_local_ring *lr = arg;
    for (;;) {
        struct pollfd pf[64];
        nfds_t np = 0;
        pthread_mutex_lock(&lr->mu);
        bool stop = lr->sup_stop;
        for (int r = 1; r < lr->n && np + 2 <= sizeof pf / sizeof pf[0]; r++) { /* a leave's words wake it */
            if (lr->kids[r].ctl >= 0) pf[np++] = (struct pollfd){ .fd = lr->kids[r].ctl, .events = POLLIN };
            if (lr->kids[r].repl_ctl >= 0) pf[np++] = (struct pollfd){ .fd = lr->kids[r].repl_ctl, .events = POLLIN };
        }
        pthread_mutex_unlock(&lr->mu);
        if (stop) break;
        kvs_local_ring_poll_children(lr);
        poll(pf, np, 50);
    }
    return NULL;
}

int kvs_local_ring_supervise(struct kvs_local_ring *lr)
{
    if (!lr->kids || lr->n < 2 || lr->sup_running) return 0;
    pthread_mutex_lock(&lr->mu);
    lr->supervise = true;
    lr->sup_stop = false;
    pthread_mutex_unlock(&lr->mu);
    if (pthread_create(&lr->sup, NULL, supervise_main, lr)) {
        pthread_mutex_lock(&lr->mu);
        lr->supervise = false;
        pthread_mutex_unlock(&lr->mu);
        fprintf(stderr, "kvasir %s: cannot start the stage supervisor\n", lr->who);
        return 1;
    }
    lr->sup_running = true;
    return 0;
}

void kvs_local_ring_stop(struct kvs_local_ring *lr)
{
    if (lr->sup_running) {
        pthread_mutex_lock(&lr->mu);
        lr->sup_stop = true;
        lr->supervise = false;
        pthread_mutex_unlock(&lr->mu);
        pthread_join(lr->sup, NULL);
        lr->sup_running = false;
    }
    if (lr->kids) /* closed first: a child told to stop now stops (no leave, no replacement) */
        for (int r = 1; r < lr->n; r++) {
            ctl_close(&lr->kids[r].ctl);
            ctl_close(&lr->kids[r].repl_ctl);
            pid_t rp = lr->kids[r].repl_pid;
            if (rp > 0) { /* a replacement still waiting for its state: its control socket's EOF ends the wait */
                kill(rp, SIGTERM);
                int64_t until = kvs_link_now_ms() + 3000;
                while (waitpid(rp, NULL, WNOHANG) == 0) {
                    if (kvs_link_now_ms() > until) {
                        kill(rp, SIGKILL);
                        waitpid(rp, NULL, 0);
                        break;
                    }
                    poll(NULL, 0, 20);
                }
                lr->kids[r].repl_pid = 0;
            }
        }
    if (lr->pids) {
        for (int i = 0; i < lr->n; i++)
            if (lr->pids[i] > 0) kill(lr->pids[i], SIGTERM);
        int64_t deadline = kvs_link_now_ms() + 3000;
        for (int i = 0; i < lr->n; i++) {
            if (lr->pids[i] <= 0) continue;
            for (;;) {
                pid_t r = waitpid(lr->pids[i], NULL, WNOHANG);
                if (r == lr->pids[i] || (r < 0 && errno != EINTR)) break;
                if (kvs_link_now_ms() > deadline) {
                    kill(lr->pids[i], SIGKILL);
                    waitpid(lr->pids[i], NULL, 0);
                    break;
                }
                poll(NULL, 0, 20);
            }
            lr->pids[i] = 0;
        }
    }
    if (lr->key_dir[0]) {
        for (int r = 1; r < lr->n; r++) {
            char path[128];
            snprintf(path, sizeof path, "%s/rank%d.key", lr->key_dir, r);
            unlink(path);
        }
        rmdir(lr->key_dir);
        lr->key_dir[0] = '\0';
    }
    if (lr->state_dir[0]) {
        for (int r = 1; r < lr->n; r++) {
            char path[128];
            snprintf(path, sizeof path, "%s/rank%d.state", lr->state_dir, r);
            unlink(path);
            snprintf(path, sizeof path, "%s/rank%d.state.part", lr->state_dir, r);
            unlink(path);
        }
        rmdir(lr->state_dir);
        lr->state_dir[0] = '\0';
    }
    kvs_key_free(lr->head_key);
    lr->head_key = NULL;
    free(lr->ports);
    free(lr->pids);
    free(lr->kids);
    lr->ports = NULL;
    lr->pids = NULL;
    lr->kids = NULL;
    if (lr->mu_init) pthread_mutex_destroy(&lr->mu);
    lr->mu_init = false;
    lr->n = 0;
}

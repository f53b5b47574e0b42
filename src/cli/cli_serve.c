/* kvasir serve: a local ring of N stages and the OpenAI-compatible API on
 * its head. Ranks 1..N-1 are `kvasir stage` children on loopback ports (an
 * even split of the blocks); rank 0 runs in this process, its loop on a
 * thread, the HTTP server beside it. SIGINT/SIGTERM/SIGHUP stop the API, the
 * head and every child (children also get SIGTERM if this process dies).
 * With N = 1 (the default) there is no child: the head holds every block. */
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
#include "cli/cli_ring.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "link/link.h"
#include "model/model.h"
#include "stage/stage.h"

static void serve_usage(FILE *f)
{
    fprintf(f, "usage: kvasir serve -m MODEL [--ring N] [options]\n"
               "  --ring N             stages in a local ring of processes (1..the model's blocks;\n"
               "                       default 1: this process holds the whole model, like llama-server)\n"
               "  --port P             HTTP port (default 8080; 0 = any free port, logged)\n"
               "  --host ADDR          IPv4 address to listen on (default 127.0.0.1)\n"
               "  --model-name NAME    model id in the API (default: the file name)\n"
               "  --chat-template NAME chatml | llama3 for /v1/chat/completions (default: the GGUF's; ChatML,\n"
               "                       logged, when it has none, as llama-server does)\n"
               "  --threads T          compute threads per stage (default: the cores this process may use / N)\n"
               "  --ctx N              context length (default min(model's, 4096))\n"
               "  --seqs S             sequence slots per stage (default 4)\n"
               "  --boundary f32|f16   boundary precision on the links (default f32; f16 halves the traffic)\n"
               "  --replay-deadline S  when the ring breaks (a stage that died is restarted), hold\n"
               "                       requests in flight (streams pause) and replay them once it is whole again; fail them after S seconds (default 30;\n"
               "                       0: fail at once; docs/PROTOCOL.md 5.1)\n"
               "  --max-body BYTES     request body cap (default 1048576)\n"
               "  --max-connections N  concurrent HTTP connections (default 64; more get 503)\n"
               "  --max-per-addr N     concurrent HTTP connections per client address (default 16; more get 503)\n"
               "  --request-timeout S  seconds a client has to send a whole request (default 30)\n"
               "  --chat-parse-special parse special-token texts (<|im_end|>, ...) inside chat message\n"
               "                       content as special tokens (unsafe: lets a user forge turns)\n"
               "  --insecure           plaintext ring links (default: throw-away node keys, TLS on every link)\n"
               "  --api-key KEY        require \"Authorization: Bearer KEY\" on /v1/* (401 otherwise);\n"
               "                       /health and /metrics stay open unless --auth-all\n"
               "  --api-key-file FILE  the same, KEY read from FILE's first line (keeps it out of ps)\n"
               "  --auth-all           with an API key: /health and /metrics need it too\n");
    /* --step-delay MS (sleep before every forward on every stage) is a test hook: not listed */
    fputs(KVS_CLI_BACKEND_HELP, f); /* every stage of --ring N */
    fputs(KVS_CLI_MODEL_URL_HELP, f);
}

static void *serve_loop(void *arg)
{
    kvs_err e = kvs_stage_run(arg);
    if (e) KVS_LOGE("serve: head loop: %s", kvs_strerror(e));
    return NULL;
}

int kvs_cli_serve(int argc, char **argv)
{
    const char *model = NULL, *host = "127.0.0.1", *name = NULL, *chat_template = NULL;
    long ring = 1, port = 8080, threads = 0, n_ctx = 0, seqs = 4, max_body = 1 << 20, delay = 0, max_conn = 64;
    bool f32 = true, insecure = false, auth_all = false, chat_special = false;
    const char *api_key = NULL, *api_key_file = NULL;
    long per_addr = 16, req_timeout = 30;
    float replay_s = KVS_STAGE_REPLAY_DEADLINE_MS / 1000.0f;
    int backend = 0, device = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            serve_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--insecure") || !strcmp(a, "--auth-all") || !strcmp(a, "--chat-parse-special")) {
            *(!strcmp(a, "--insecure") ? &insecure : !strcmp(a, "--auth-all") ? &auth_all : &chat_special) = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvasir serve: unknown option or missing value: %s\n", a);
            serve_usage(stderr);
            return 2;
        }
        i++; /* v is this option's value */
        int bad = 0;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (kvs_cli_backend_opt(a, v, &backend, &device, &bad)) {
        } else if (!strcmp(a, "--ring")) bad = kvs_cli_parse_long(v, 1, 1024, &ring);
        else if (!strcmp(a, "--port")) bad = kvs_cli_parse_long(v, 0, 65535, &port);
        else if (!strcmp(a, "--host")) host = v;
        else if (!strcmp(a, "--model-name")) name = v;
        else if (!strcmp(a, "--chat-template")) chat_template = v;
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) bad = kvs_cli_parse_long(v, 1, 512, &threads);
        else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) bad = kvs_cli_parse_long(v, 1, 1 << 24, &n_ctx);
        else if (!strcmp(a, "--seqs")) bad = kvs_cli_parse_long(v, 1, 1024, &seqs);
        else if (!strcmp(a, "--max-body")) bad = kvs_cli_parse_long(v, 1024, 1L << 30, &max_body);
        else if (!strcmp(a, "--max-connections")) bad = kvs_cli_parse_long(v, 1, 65536, &max_conn);
        else if (!strcmp(a, "--max-per-addr")) bad = kvs_cli_parse_long(v, 1, 65536, &per_addr);
        else if (!strcmp(a, "--request-timeout")) bad = kvs_cli_parse_long(v, 1, 3600, &req_timeout);
        else if (!strcmp(a, "--step-delay")) bad = kvs_cli_parse_long(v, 0, 10000, &delay);
        else if (!strcmp(a, "--replay-deadline"))
            bad = kvs_cli_parse_float(v, &replay_s) || !(replay_s >= 0.0f && replay_s <= 86400.0f);
        else if (!strcmp(a, "--api-key")) api_key = v;
        else if (!strcmp(a, "--api-key-file")) api_key_file = v;
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
    }
    if (!model) {
        fprintf(stderr, "kvasir serve: -m MODEL is required\n");
        serve_usage(stderr);
        return 2;
    }
    char key_buf[512];
    if (kvs_cli_api_key(api_key, api_key_file, key_buf, sizeof key_buf, "serve")) return 2;
    if (auth_all && !key_buf[0]) {
        fprintf(stderr, "kvasir serve: --auth-all needs --api-key or --api-key-file\n");
        return 2;
    }

    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old); /* inherited by every thread started below */
    signal(SIGPIPE, SIG_IGN);
    int sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);

    char err[512];
    kvs_err e;
    struct kvs_stage *head = NULL;
    struct kvs_api *api = NULL;
    pthread_t loop;
    bool loop_started = false;
    struct kvs_local_ring lr;
    struct kvs_stage_params sp = kvs_stage_default_params();
    struct kvs_local_ring_opts lo = { .who = "serve", .model = model, .n = (int)ring, .threads = threads,
                                      .n_ctx = n_ctx, .seqs = seqs, .step_delay_ms = delay,
                                      .boundary_f32 = f32, .insecure = insecure, .child_mask = &old, .allow_solo = true,
                                      .backend = backend, .device = device };
    int rc = sfd < 0 ? 1 : kvs_local_ring_start(&lo, &lr, &sp);
    if (rc) {
        if (sfd < 0) fprintf(stderr, "kvasir serve: cannot set up signals\n");
        memset(&lr, 0, sizeof lr);
        goto done;
    }
    rc = 1;
    sp.replay_deadline_ms = replay_s > 0.0f ? (int32_t)(replay_s * 1000.0f + 0.5f) : -1;
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
    ap.chat_template = chat_template;
    ap.max_body = (size_t)max_body;
    ap.max_connections = (int32_t)max_conn;
    ap.api_key = key_buf[0] ? key_buf : NULL;
    ap.auth_all = auth_all;
    ap.max_per_addr = (int32_t)per_addr;
    ap.request_timeout_s = (int32_t)req_timeout;
    ap.chat_parse_special = chat_special;
    if ((e = kvs_api_start(head, &ap, &api, err, sizeof err))) {
        fprintf(stderr, "kvasir serve: API: %s (%s)\n", kvs_strerror(e), err);
        goto done;
    }
    if (lr.n > 1)
        KVS_LOGI("serve: ring of %d stages, API on http://%s:%u", lr.n, host, (unsigned)kvs_api_port(api));
    else
        KVS_LOGI("serve: one process (the whole model), API on http://%s:%u", host, (unsigned)kvs_api_port(api));

    /* Wait for a signal; the supervisor restarts children that die (the ring
     * reports not ready meanwhile, and the head holds its requests). */
    if (kvs_local_ring_supervise(&lr)) goto done;
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
    }
    rc = 0;
done:
    kvs_api_stop(api);
    if (loop_started) {
        kvs_stage_stop(head);
        pthread_join(loop, NULL);
    }
    kvs_stage_free(head);
    kvs_local_ring_stop(&lr);
    if (sfd >= 0) close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

/* kvasir stage: run one stage of a ring (docs/PROTOCOL.md, docs/MANIFEST.md).
 * The head stage can also serve prompts itself (--prompts / -p), which is how
 * the end-to-end tests drive a ring of separately started stages. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "model/model.h"
#include "cli/cli_ring.h"
#include "common/log.h"
#include "plan/plan.h"
#include "api/api.h"
#include "stage/stage.h"
#include "trust/trust.h"

static void stage_usage(FILE *f)
{
    fprintf(f, "usage: kvasir stage -m MODEL --window BEGIN:END --listen HOST:PORT --next HOST:PORT [options]\n"
               "       kvasir stage --manifest ring.json --rank R [-m PATH|URL] [options]\n"
               "  (-m beside --manifest: this machine's copy of the model; default the manifest's path)\n"
               "  a window of the whole model is a one-stage ring: it samples itself, no --next needed\n"
               "  --listen/--next may be relay URLs ws[s]://RELAY[:PORT]/edge/ID?token=HEX (docs/RELAY.md): --next\n"
               "                       dials the relay as the edge's upstream end, --listen makes the in link dial\n"
               "                       out as its downstream end (no listening socket: a stage behind NAT)\n"
               "  --relay-ca PEM       wss://: the CA (or the relay's self-signed certificate) to trust\n"
               "  --relay-pin HEX      wss://: trust the relay certificate with this SHA-256 of its DER instead\n"
               "  --threads T          compute threads (default: the cores this process may use)\n"
               "  --ctx N              positions per sequence (default model's, <= 4096; all stages equal)\n"
               "  --seqs S             sequence slots (default 4)\n"
               "                       (--manifest: ctx and seqs default to its targets, boundary to its rank; flags override)\n"
               "  --batch B            tokens per forward / PREFILL frame (default 512; all stages equal)\n"
               "  --boundary f32|f16   precision of the boundaries this stage sends on (default f32: bit-identical\n"
               "                       to a single process; f16 halves the bytes but can change greedy output:\n"
               "                       docs/PROTOCOL.md 5; --manifest: the rank's \"boundary\")\n"
               "  --timeout MS         neighbour silence / ring probe timeout (default 4000)\n"
               "  --replay-deadline S  when the ring breaks, hold requests in flight (streams pause) and replay\n"
               "                       them once it is whole again; fail them after S seconds (default 30;\n"
               "                       0: fail at once; docs/PROTOCOL.md 5.1)\n"
               "  --spin N             pool spin before idle compute threads sleep (0: default, %d, short, for\n"
               "                       stages sharing cores; -1: the long single-process spin; KVASIR_SPIN wins)\n"
               /* --step-delay MS (sleep before every forward) is a test hook: not listed */
               "  --control-fd N --handover FILE [--takeover FILE]   used by a local ring's supervisor\n"
               "                       (serve/run --ring): SIGTERM is a planned leave that hands this stage's\n"
               "                       sequences to its replacement (docs/PROTOCOL.md 5.2)\n"
               "  --api PORT           OpenAI-compatible HTTP API on the head (as `kvasir serve`)\n"
               "  --api-host ADDR      IPv4 address the API listens on (default 127.0.0.1; 0.0.0.0 = all)\n"
               "  --chat-template NAME chatml | llama3 (default: the GGUF's, else ChatML)\n"
               "  --api-key KEY | --api-key-file FILE   the API needs \"Authorization: Bearer KEY\" on /v1/*\n"
               "  --auth-all           with an API key: /health and /metrics need it too\n"
               "trust (docs/PROTOCOL.md 4): every link is TLS 1.3 between node keys (kvasir key gen)\n"
               "  --key FILE           this node's key\n"
               "  --prev-key HEX       the predecessor's public key (kvasir key show --public)\n"
               "  --next-key HEX       the successor's public key (--manifest: both from its ranks[].key)\n"
               "  --insecure           plaintext, unauthenticated links: only for debugging on one machine\n"
               "head only, as a client of its own ring:\n"
               "  -p TEXT | --prompts FILE ('-' = stdin)   -n N  --temp T  --top-k K  --top-p P  --min-p P\n"
               "  --repeat-penalty R  --seed S  --ignore-eos  --parallel P\n", KVS_STAGE_POOL_SPIN);
    fputs(KVS_CLI_BACKEND_HELP, f);
    fputs(KVS_CLI_MODEL_URL_HELP, f);
}

static void *stage_loop_thread(void *arg)
{
    kvs_stage_run(arg);
    return NULL;
}

/* The head with the OpenAI-compatible API: the stage loop runs on its own
 * thread, the API on libmicrohttpd's threads; the calling thread waits for
 * SIGINT/SIGTERM/SIGHUP on sfd, then stops the API before the stage (the API
 * needs the loop to finish its requests). */
static int stage_serve_api(struct kvs_stage *s, const struct kvs_stage_params *p, const char *host, uint16_t port,
                           const char *chat_template, const char *api_key, bool auth_all, int sfd)
{
    pthread_t th;
    if (pthread_create(&th, NULL, stage_loop_thread, s) != 0) {
        fprintf(stderr, "kvasir stage: cannot start the stage loop thread\n");
        return 1;
    }
    struct kvs_api_params ap = kvs_api_default_params();
    ap.bind_addr = host;
    ap.port = port;
    ap.model_path = p->model_path;
    ap.chat_template = chat_template;
    ap.api_key = api_key[0] ? api_key : NULL;
    ap.auth_all = auth_all;
    struct kvs_api *a = NULL;
    char err[256];
    kvs_err e = kvs_api_start(s, &ap, &a, err, sizeof err);
    int rc = 0;
    if (e) {
        fprintf(stderr, "kvasir stage: API on port %u: %s (%s)\n", (unsigned)port, err, kvs_strerror(e));
        rc = 1;
    } else {
        KVS_LOGI("stage: API on http://%s:%u", host, (unsigned)kvs_api_port(a));
        struct pollfd pfd = { .fd = sfd, .events = POLLIN };
        while (poll(&pfd, 1, -1) < 0 && errno == EINTR) {
        }
    }
    kvs_api_stop(a);
    kvs_stage_stop(s);
    pthread_join(th, NULL);
    return rc;
}

int kvs_cli_stage(int argc, char **argv)
{
    struct kvs_stage_params p = kvs_stage_default_params();
    p.n_threads = (int32_t)kvs_cli_default_threads();
    struct kvs_ring_client_opts co = { .parallel = 1, .n_predict = 128, .ready_timeout_ms = 30000,
                                       .t_start_ms = kvs_cli_now_ms() };
    co.sp = kvs_sampler_default_params();
    co.sp.seed = kvs_cli_random_seed(); /* --seed S or -1 overrides */
    const char *manifest = NULL, *window = NULL, *api_host = "127.0.0.1", *chat_template = NULL, *key_path = NULL;
    const char *api_key = NULL, *api_key_file = NULL;
    bool prev_set = false, next_set = false, auth_all = false;
    long rank = -1, lv = 0, api = 0;
    /* flags given on the command line override the manifest's targets */
    bool ctx_set = false, seqs_set = false, boundary_set = false, backend_set = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            stage_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--ignore-eos")) {
            co.ignore_eos = true;
            continue;
        }
        if (!strcmp(a, "--insecure")) {
            p.insecure = true;
            continue;
        }
        if (!strcmp(a, "--auth-all")) {
            auth_all = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvasir stage: unknown option or missing value: %s\n", a);
            stage_usage(stderr);
            return 2;
        }
        int bad = 0, be = p.backend, dev = p.device;
        if (kvs_cli_backend_opt(a, v, &be, &dev, &bad)) p.backend = be, p.device = dev, backend_set = true;
        else if (!strcmp(a, "-m") || !strcmp(a, "--model")) p.model_path = v;
        else if (!strcmp(a, "--window")) window = v;
        else if (!strcmp(a, "--listen")) p.listen = v;
        else if (!strcmp(a, "--next")) p.next = v;
        else if (!strcmp(a, "--relay-ca")) p.relay_ca = v;
        else if (!strcmp(a, "--handover")) p.handover_path = v;
        else if (!strcmp(a, "--takeover")) p.takeover_path = v;
        else if (!strcmp(a, "--control-fd")) {
            bad = kvs_cli_parse_long(v, 3, 1 << 20, &lv) || fcntl((int)lv, F_GETFD) < 0;
            p.control_fd = (int32_t)lv;
        }
        else if (!strcmp(a, "--relay-pin")) p.relay_pin = v;
        else if (!strcmp(a, "--manifest")) manifest = v;
        else if (!strcmp(a, "--key")) key_path = v;
        else if (!strcmp(a, "--api-key")) api_key = v;
        else if (!strcmp(a, "--api-key-file")) api_key_file = v;
        else if (!strcmp(a, "--prev-key")) {
            bad = kvs_key_parse_public(v, p.prev_key) != KVS_OK;
            p.has_prev_key = prev_set = !bad;
        } else if (!strcmp(a, "--next-key")) {
            bad = kvs_key_parse_public(v, p.next_key) != KVS_OK;
            p.has_next_key = next_set = !bad;
        }
        else if (!strcmp(a, "--rank")) bad = kvs_cli_parse_long(v, 0, 1 << 20, &rank);
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            bad = kvs_cli_parse_long(v, 1, 512, &lv);
            p.n_threads = (int32_t)lv;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            bad = kvs_cli_parse_long(v, 0, 1 << 24, &lv);
            p.n_ctx = (int32_t)lv;
            ctx_set = true;
        } else if (!strcmp(a, "--seqs")) {
            bad = kvs_cli_parse_long(v, 1, 1024, &lv);
            p.n_seq = (int32_t)lv;
            seqs_set = true;
        } else if (!strcmp(a, "--batch")) {
            bad = kvs_cli_parse_long(v, 1, 65536, &lv);
            p.n_batch = (int32_t)lv;
        } else if (!strcmp(a, "--boundary")) {
            bad = strcmp(v, "f16") && strcmp(v, "f32");
            p.boundary_f32 = !strcmp(v, "f32");
            boundary_set = true;
        } else if (!strcmp(a, "--timeout")) {
            bad = kvs_cli_parse_long(v, 100, 3600000, &lv);
            p.timeout_ms = (int32_t)lv;
        } else if (!strcmp(a, "--replay-deadline")) {
            float sec = 0.0f;
            bad = kvs_cli_parse_float(v, &sec) || !(sec >= 0.0f && sec <= 86400.0f);
            p.replay_deadline_ms = sec > 0.0f ? (int32_t)(sec * 1000.0f + 0.5f) : -1;
        } else if (!strcmp(a, "--spin")) {
            bad = kvs_cli_parse_long(v, -1, 10000000, &lv);
            p.pool_spin = (int32_t)lv;
        } else if (!strcmp(a, "--step-delay")) {
            bad = kvs_cli_parse_long(v, 0, 60000, &lv);
            p.step_delay_ms = (int32_t)lv;
        } else if (!strcmp(a, "--api")) bad = kvs_cli_parse_long(v, 1, 65535, &api);
        else if (!strcmp(a, "--api-host")) api_host = v;
        else if (!strcmp(a, "--chat-template")) chat_template = v;
        else if (kvs_ring_client_opt(a, v, &co, &bad)) {
        } else {
            fprintf(stderr, "kvasir stage: unknown option: %s\n", a);
            stage_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir stage: bad value for %s: %s\n", a, v);
            return 2;
        }
        i++;
    }
    char err[1024], key_buf[512];
    if (kvs_cli_api_key(api_key, api_key_file, key_buf, sizeof key_buf, "stage")) return 2;
    struct kvs_manifest *man = NULL;
    if (manifest) {
        if (rank < 0) {
            fprintf(stderr, "kvasir stage: --manifest needs --rank R\n");
            return 2;
        }
        man = calloc(1, sizeof *man);
        kvs_err e = man ? kvs_manifest_load(manifest, man, err, sizeof err) : KVS_ERR_NOMEM;
        if (e) {
            fprintf(stderr, "kvasir stage: %s: %s (%s)\n", manifest, man ? err : "", kvs_strerror(e));
            free(man);
            return 1;
        }
        struct kvs_stage_params cli = p;
        /* -m PATH: the model file on this machine; the manifest's path (the planning machine's) is
         * only the default. */
        if (cli.model_path) snprintf(man->model_path, sizeof man->model_path, "%s", cli.model_path);
        e = kvs_stage_params_from_manifest(man, (int32_t)rank, &p);
        if (prev_set) memcpy(p.prev_key, cli.prev_key, sizeof p.prev_key), p.has_prev_key = true;
        if (next_set) memcpy(p.next_key, cli.next_key, sizeof p.next_key), p.has_next_key = true;
        if (ctx_set) p.n_ctx = cli.n_ctx;
        if (seqs_set) p.n_seq = cli.n_seq;
        if (boundary_set) p.boundary_f32 = cli.boundary_f32;
        if (backend_set) p.backend = cli.backend, p.device = cli.device;
        if (e) {
            if (e == KVS_ERR_NOT_FOUND)
                fprintf(stderr, "kvasir stage: rank %ld is not in %s (%zu ranks)\n", rank, manifest, man->n_ranks);
            else
                fprintf(stderr, "kvasir stage: %s names no local model path%s%s: give -m PATH (or -m URL)\n",
                        manifest, man->model_url[0] ? ", only the URL " : "", man->model_url);
            free(man);
            return 2;
        }
        /* The manifest was planned for a model of n_block blocks: a file with
         * another count is the wrong model (or a stale manifest). */
        struct kvs_gguf *g = NULL;
        struct kvs_hparams hp;
        if (kvs_gguf_open(p.model_path, &g, err, sizeof err) == KVS_OK && kvs_hparams_read(g, &hp, err, sizeof err) == KVS_OK &&
            hp.n_block != man->n_block) {
            fprintf(stderr, "kvasir stage: %s plans %u blocks but %s has %u: a manifest of another model?\n", manifest,
                    man->n_block, p.model_path, hp.n_block);
            kvs_gguf_close(g);
            free(man);
            return 2;
        }
        kvs_gguf_close(g);
    } else {
        if (!p.model_path || !window || !p.listen) {
            fprintf(stderr, "kvasir stage: -m, --window, --listen and --next are required (or --manifest/--rank; "
                            "--next may be left out for a window of the whole model)\n");
            stage_usage(stderr);
            return 2;
        }
        char *end;
        errno = 0;
        long b = strtol(window, &end, 10), en = -1;
        if (errno || end == window || *end != ':' || b < 0) b = -1;
        else {
            const char *e2 = end + 1;
            en = strtol(e2, &end, 10);
            if (errno || end == e2 || *end || en <= b) b = -1;
        }
        if (b < 0 || en > (1 << 20)) {
            fprintf(stderr, "kvasir stage: --window must be BEGIN:END with 0 <= BEGIN < END: %s\n", window);
            return 2;
        }
        p.block_begin = (int32_t)b;
        p.block_end = (int32_t)en;
    }

    struct kvs_key *key = NULL;
    if (key_path) {
        kvs_err ke = kvs_key_load(key_path, &key, err, sizeof err);
        if (ke) {
            fprintf(stderr, "kvasir stage: %s (%s)\n", err, kvs_strerror(ke));
            free(man);
            return 1;
        }
        p.key = key;
    }
    /* A keyed manifest names this rank's key: the node's own key must be it. */
    const char *want = man ? man->ranks[rank].key : "";
    if (key && want[0]) {
        uint8_t pub[KVS_KEY_PUB_BYTES];
        char hex[KVS_KEY_PUB_HEX + 1];
        kvs_key_public(key, pub);
        kvs_key_public_hex(pub, hex);
        if (strcmp(hex, want)) {
            uint8_t w[KVS_KEY_PUB_BYTES];
            char fh[KVS_KEY_FP_HEX + 1], fw[KVS_KEY_FP_HEX + 1];
            kvs_key_fingerprint(pub, fh);
            kvs_key_parse_public(want, w);
            kvs_key_fingerprint(w, fw);
            fprintf(stderr, "kvasir stage: %s is key %s but %s gives rank %ld key %s\n", key_path, fh, manifest,
                    rank, fw);
            free(man);
            kvs_key_free(key);
            return 2;
        }
    }
    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old);
    int sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);
    p.stop_fd = sfd;

    struct kvs_stage *s = NULL;
    kvs_err e = kvs_stage_create(&p, &s, err, sizeof err);
    int rc = 1;
    if (e) {
        fprintf(stderr, "kvasir stage: %s (%s)\n", err, kvs_strerror(e));
    } else if (co.prompt || co.prompts_path) {
        if (!kvs_stage_is_head(s)) {
            fprintf(stderr, "kvasir stage: -p/--prompts need the head (window starting at 0)\n");
            rc = 2;
        } else {
            rc = kvs_ring_client(s, &co);
        }
    } else if (api) {
        if (!kvs_stage_is_head(s)) {
            fprintf(stderr, "kvasir stage: --api needs the head (window starting at 0)\n");
            rc = 2;
        } else {
            rc = stage_serve_api(s, &p, api_host, (uint16_t)api, chat_template, key_buf, auth_all, sfd);
        }
    } else {
        rc = kvs_stage_run(s) == KVS_OK ? 0 : 1;
    }
    kvs_stage_free(s);
    free(man);
    kvs_key_free(key);
    if (sfd >= 0) close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

/* kvasir market: the self-enrollment market service (docs/MARKET.md), and
 * `kvasir market add` to list a model on a running market. */
#include <errno.h>
#include <jansson.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "cli/cli.h"
#include "common/log.h"
#include "market/market.h"

static void market_usage(FILE *f)
{
    fprintf(f, "usage: kvasir market --listen HOST:PORT --db market.sqlite [--lease-ms MS] [--max-body BYTES]\n"
               "                     [--relay-secret FILE [--relay-pin HEX]]\n"
               "       kvasir market add --market URL --url MODEL_URL [--name NAME] [--index INDEX_URL] [--rings N]\n"
               "                         [--content-id HEX]  (`kvasir shard index` prints it: nodes fetch against it)\n"
               "                         [--ctx N] [--seqs S] [--boundary f32|f16]\n"
               "  the service: listings, claims with leases, GET /map (JSON), GET / (the map page), GET /v1/rings\n"
               "  --lease-ms MS    lease of a claim and of each renewal (default %d; tests use short ones)\n"
               "  --max-body BYTES request body cap (default %u; larger bodies get 413)\n"
               "  --relay-secret FILE  the relay's secret (kvasir relay --secret): nodes that claim with a relay\n"
               "                   (kvasir join --relay URL) get their edge's token from the market, and their\n"
               "                   predecessors the token to dial it (docs/MARKET.md \"Relay claims\")\n"
               "  --relay-pin HEX  SHA-256 of the relay certificate's DER, handed to every claimant to trust it\n"
               "  add: the market reads the model's GGUF header from MODEL_URL (HTTP ranges, as plan --url)\n",
            KVS_MARKET_LEASE_DEFAULT_MS, KVS_MARKET_MAX_BODY_DEFAULT);
}

static int market_add(int argc, char **argv)
{
    const char *market = NULL;
    json_t *o = json_object();
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            market_usage(stdout);
            json_decref(o);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir market add: missing value for %s\n", a);
            json_decref(o);
            return 2;
        }
        long n = 0;
        if (!strcmp(a, "--market")) market = v;
        else if (!strcmp(a, "--url")) json_object_set_new(o, "url", json_string(v));
        else if (!strcmp(a, "--name")) json_object_set_new(o, "name", json_string(v));
        else if (!strcmp(a, "--index")) json_object_set_new(o, "index", json_string(v));
        else if (!strcmp(a, "--content-id")) json_object_set_new(o, "content_id", json_string(v));
        else if (!strcmp(a, "--boundary")) json_object_set_new(o, "boundary", json_string(v));
        else if (!strcmp(a, "--rings") || !strcmp(a, "--ctx") || !strcmp(a, "--seqs")) {
            if (kvs_cli_parse_long(v, 0, 1 << 24, &n)) {
                fprintf(stderr, "kvasir market add: bad value for %s: %s\n", a, v);
                json_decref(o);
                return 2;
            }
            json_object_set_new(o, a + 2, json_integer(n));
        } else {
            fprintf(stderr, "kvasir market add: unknown option: %s\n", a);
            market_usage(stderr);
            json_decref(o);
            return 2;
        }
    }
    if (!market || !json_object_get(o, "url")) {
        fprintf(stderr, "kvasir market add: --market URL and --url MODEL_URL are required\n");
        json_decref(o);
        return 2;
    }
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    int status = 0;
    char *reply = NULL, err[512];
    kvs_err e = body ? kvs_market_call(market, "POST", "/v1/listings", body, 60000, &status, &reply, err, sizeof err)
                     : KVS_ERR_NOMEM;
    free(body);
    if (e) {
        fprintf(stderr, "kvasir market add: %s (%s)\n", err, kvs_strerror(e));
        return 1;
    }
    int rc = status == 201 ? 0 : 1;
    fprintf(rc ? stderr : stdout, "%s%s\n", rc ? "kvasir market add: refused: " : "", reply);
    free(reply);
    return rc;
}

int kvs_cli_market(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "add")) return market_add(argc - 1, argv + 1);
    struct kvs_market_params p = kvs_market_default_params();
    const char *listen = NULL;
    static uint8_t secret[256];
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            market_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir market: unknown option or missing value: %s\n", a);
            market_usage(stderr);
            return 2;
        }
        long n = 0;
        int bad = 0;
        if (!strcmp(a, "--listen")) listen = v;
        else if (!strcmp(a, "--db")) p.db_path = v;
        else if (!strcmp(a, "--relay-secret")) {
            if (kvs_cli_read_secret(v, secret, sizeof secret, &p.relay_secret_len)) return 2;
            p.relay_secret = secret;
        } else if (!strcmp(a, "--relay-pin")) p.relay_pin = v;
        else if (!strcmp(a, "--lease-ms")) {
            bad = kvs_cli_parse_long(v, 100, 86400000, &n);
            p.lease_ms = n;
        } else if (!strcmp(a, "--max-body")) {
            bad = kvs_cli_parse_long(v, 256, 1 << 30, &n);
            p.max_body = (size_t)n;
        } else {
            fprintf(stderr, "kvasir market: unknown option: %s\n", a);
            market_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir market: bad value for %s: %s\n", a, v);
            return 2;
        }
    }
    if (!listen || !p.db_path) {
        fprintf(stderr, "kvasir market: --listen HOST:PORT and --db FILE are required\n");
        market_usage(stderr);
        return 2;
    }
    char host[64];
    const char *colon = strrchr(listen, ':');
    long port = -1;
    if (!colon || colon == listen || (size_t)(colon - listen) >= sizeof host ||
        kvs_cli_parse_long(colon + 1, 0, 65535, &port)) {
        fprintf(stderr, "kvasir market: --listen must be HOST:PORT (IPv4, port 0 = any): %s\n", listen);
        return 2;
    }
    memcpy(host, listen, (size_t)(colon - listen));
    host[colon - listen] = '\0';

    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old);
    int sfd = signalfd(-1, &sigs, SFD_CLOEXEC);

    char err[512];
    struct kvs_market *m = NULL;
    kvs_err e = kvs_market_open(&p, &m, err, sizeof err);
    if (!e) e = kvs_market_start(m, host, (uint16_t)port, err, sizeof err);
    if (e) {
        fprintf(stderr, "kvasir market: %s (%s)\n", err, kvs_strerror(e));
        kvs_market_close(m);
        close(sfd);
        return 1;
    }
    KVS_LOGI("market: listening on http://%s:%u (db %s, lease %lld ms)", host, (unsigned)kvs_market_port(m), p.db_path,
             (long long)p.lease_ms);
    struct pollfd pfd = { .fd = sfd, .events = POLLIN };
    while (poll(&pfd, 1, -1) < 0 && errno == EINTR) {
    }
    KVS_LOGI("market: shutting down");
    kvs_market_close(m);
    close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return 0;
}

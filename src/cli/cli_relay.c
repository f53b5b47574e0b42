/* kvasir relay --listen HOST:PORT --secret FILE [--cert PEM --key PEM] ...
 * kvasir relay token --secret FILE EDGE_ID   (prints the edge's token)
 * docs/RELAY.md. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "link/link.h"
#include "relay/relay.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir relay --listen HOST:PORT --secret FILE [--cert PEM --key PEM] [--port-file FILE]\n"
            "                    [--max-per-addr 64] [--max-unpaired 4096] [--max-message 262144]\n"
            "                    [--handshake-ms 5000] [--partner-ms 30000] [--ping 10] [--takeover-ms 1000]\n"
            "                    [--edge-buffer 1048576]\n"
            "       kvasir relay token --secret FILE EDGE_ID\n"
            "A WebSocket bridge for ring edges (docs/RELAY.md): both ends of an edge dial out to\n"
            "ws[s]://HOST:PORT/edge/EDGE_ID with the edge's token; the relay splices their bytes.\n"
            "With --cert/--key it speaks TLS (wss://), else plain ws://. /metrics and /health on the\n"
            "same port. FILE holds the secret (16..256 bytes; trailing newlines are dropped).\n"
            "`relay token` prints the token of an edge (give it to both stages: ?token=HEX).\n"
            "Stops on SIGINT/SIGTERM.\n");
}

int kvs_cli_read_secret(const char *path, uint8_t *buf, size_t cap, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kvasir: cannot open the relay secret file %s\n", path);
        return -1;
    }
    size_t n = fread(buf, 1, cap, f);
    int more = fgetc(f) != EOF;
    fclose(f);
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) n--;
    if (more || n < 16) {
        fprintf(stderr, "kvasir: the relay secret in %s must be 16..256 bytes\n", path);
        return -1;
    }
    *len = n;
    return 0;
}

static void *sig_thread(void *arg)
{
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    int sig;
    sigwait(&set, &sig);
    kvs_relay_stop(arg);
    return NULL;
}

int kvs_cli_relay(int argc, char **argv)
{
    struct kvs_relay_params p = kvs_relay_default_params();
    const char *secret_file = NULL, *port_file = NULL, *edge = NULL;
    bool token_mode = argc > 1 && !strcmp(argv[1], "token");
    for (int i = token_mode ? 2 : 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--listen") && v) {
            p.listen = argv[++i];
        } else if (!strcmp(a, "--secret") && v) {
            secret_file = argv[++i];
        } else if (!strcmp(a, "--cert") && v) {
            p.cert_file = argv[++i];
        } else if (!strcmp(a, "--key") && v) {
            p.key_file = argv[++i];
        } else if (!strcmp(a, "--port-file") && v) {
            port_file = argv[++i];
#define NUM(flag, lo, hi, field)                                                                           \
    }                                                                                                      \
    else if (!strcmp(a, flag) && v)                                                                        \
    {                                                                                                      \
        if (kvs_cli_parse_long(v, lo, hi, &x)) {                                                           \
            fprintf(stderr, "kvasir relay: %s must be an integer in %ld..%ld\n", flag, (long)(lo), (long)(hi)); \
            return 2;                                                                                      \
        }                                                                                                  \
        p.field = (__typeof__(p.field))x;                                                                  \
        i++;
        NUM("--max-per-addr", 1, 1000000, max_per_addr)
        NUM("--max-unpaired", 1, 1000000, max_unpaired)
        NUM("--max-message", 1024, 16 << 20, max_message)
        NUM("--handshake-ms", 100, 600000, handshake_ms)
        NUM("--partner-ms", 100, 86400000, partner_ms)
        NUM("--ping", 1, 3600, ping_s)
        NUM("--takeover-ms", 10, 60000, takeover_ms)
        NUM("--edge-buffer", 65536, 256 << 20, edge_buffer)
#undef NUM
        } else if (token_mode && a[0] != '-' && !edge) {
            edge = a;
        } else {
            usage(stderr);
            return 2;
        }
    }
    uint8_t secret[257];
    size_t slen = 0;
    if (!secret_file || (!token_mode && !p.listen) || (token_mode && !edge)) {
        usage(stderr);
        return 2;
    }
    if (kvs_cli_read_secret(secret_file, secret, 256, &slen)) return 2;
    if (token_mode) {
        char tok[KVS_RELAY_TOKEN_HEX + 1];
        if (kvs_relay_token(secret, slen, edge, tok)) {
            fprintf(stderr, "kvasir relay token: bad edge id '%s' (1..64 of A-Z a-z 0-9 . _ -)\n", edge);
            return 2;
        }
        printf("%s\n", tok);
        return 0;
    }
    p.secret = secret;
    p.secret_len = slen;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);
    char msg[512] = "";
    struct kvs_relay *r = NULL;
    kvs_err e = kvs_relay_create(&p, &r, msg, sizeof msg);
    if (e) {
        fprintf(stderr, "kvasir relay: %s: %s\n", kvs_strerror(e), msg);
        return 1;
    }
    if (port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%u\n", kvs_relay_port(r)) < 0 || fclose(f) != 0 || rename(tmp, port_file) != 0) {
            fprintf(stderr, "kvasir relay: cannot write %s\n", port_file);
            kvs_relay_free(r);
            return 1;
        }
    }
    KVS_LOGI("relay listening on %s (port %u, %s)", p.listen, kvs_relay_port(r), p.cert_file ? "wss" : "ws");
    pthread_t th;
    if (pthread_create(&th, NULL, sig_thread, r)) {
        kvs_relay_free(r);
        return 1;
    }
    pthread_detach(th);
    e = kvs_relay_run(r);
    KVS_LOGI("relay stopping");
    kvs_relay_free(r);
    return e ? 1 : 0;
}

/* kvasir seed DIR --port P [--bind ADDR] [--port-file F] [--no-ranges] */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "common/log.h"
#include "shard/shard.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir seed DIR --port P [--bind 127.0.0.1] [--port-file FILE] [--no-ranges]\n"
               "Serves DIR's .gguf (and .json index) files over HTTP with single byte ranges.\n"
               "Only regular files that resolve inside DIR are served (a symlink out of DIR is not).\n"
               "GET /models lists {name, size, fingerprint, etag}; GET /stats gives bytes_served.\n"
               "--port 0 picks a free port; --port-file writes the bound port there.\n"
               "--no-ranges (tests) ignores Range headers. Stops on SIGINT/SIGTERM.\n");
}

int kvs_cli_seed(int argc, char **argv)
{
    struct kvs_seed_params p = kvs_seed_default_params();
    const char *dir = NULL, *port_file = NULL;
    bool have_port = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--port") && v) {
            char *end = NULL;
            errno = 0;
            long x = strtol(v, &end, 10);
            if (errno || *end || end == v || x < 0 || x > 65535) {
                fprintf(stderr, "kvasir seed: bad port '%s'\n", v);
                return 2;
            }
            p.port = (uint16_t)x;
            have_port = true;
            i++;
        } else if (!strcmp(a, "--bind") && v) {
            p.bind = argv[++i];
        } else if (!strcmp(a, "--port-file") && v) {
            port_file = argv[++i];
        } else if (!strcmp(a, "--no-ranges")) {
            p.no_ranges = true;
        } else if (a[0] != '-' && !dir) {
            dir = a;
        } else {
            usage(stderr);
            return 2;
        }
    }
    if (!dir || !have_port) {
        usage(stderr);
        return 2;
    }
    p.dir = dir;
    /* Block the stop signals before the server's threads start so that only
     * sigwait below receives them. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    char msg[512] = "";
    struct kvs_seed *s = NULL;
    kvs_err err = kvs_seed_start(&p, &s, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "kvasir seed: %s: %s\n", kvs_strerror(err), msg);
        return 1;
    }
    if (port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%u\n", kvs_seed_port(s)) < 0 || fclose(f) != 0 || rename(tmp, port_file) != 0) {
            fprintf(stderr, "kvasir seed: cannot write %s\n", port_file);
            kvs_seed_stop(s);
            return 1;
        }
    }
    KVS_LOGI("seed: serving %s on http://%s:%u/%s", dir, p.bind, kvs_seed_port(s),
             p.no_ranges ? " (ranges disabled)" : "");
    int sig = 0;
    sigwait(&set, &sig);
    KVS_LOGI("seed: stopping on signal %d; %llu bytes served", sig,
             (unsigned long long)kvs_seed_bytes_served(s));
    kvs_seed_stop(s);
    return 0;
}

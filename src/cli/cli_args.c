/* Number arguments shared by the subcommands (see cli.h). */
#include <errno.h>
#include <math.h>
#include <string.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "shard/shard.h"
#include <stdio.h>

int kvs_cli_parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int kvs_cli_parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

uint64_t kvs_cli_random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) != (ssize_t)sizeof s) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    }
    return s >> 1; /* printable and re-enterable as a non-negative decimal */
}

int kvs_cli_parse_seed(const char *s, uint64_t *out)
{
    if (!strcmp(s, "-1")) {
        *out = kvs_cli_random_seed();
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] < '0' || s[0] > '9') return -1; /* strtoull takes " -5" */
    *out = (uint64_t)v;
    return 0;
}

int kvs_cli_need_whole_model(const struct kvs_gguf *g, const char *who, const char *path)
{
    uint32_t b, e, n = 0;
    if (!kvs_shard_window(g, &b, &e)) return 0;
    if (kvs_shard_block_count(g, &n) == KVS_OK && b == 0 && e == n) return 0;
    char d[256];
    if (kvs_shard_describe(g, d, sizeof d) != KVS_OK) snprintf(d, sizeof d, "window [%u,%u)", b, e);
    fprintf(stderr,
            "kvasir %s: %s is a stage shard (%s), not a whole model; %s needs every block. Serve the shard "
            "as one stage of a ring: kvasir stage -m %s --window %u:%u --listen HOST:PORT --next HOST:PORT\n",
            who, path, d, who, path, b, e);
    return 1;
}

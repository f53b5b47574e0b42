/* Number arguments shared by the subcommands (see cli.h). */
#include <errno.h>
#include <string.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"

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
    if (errno || end == s || *end || v != v) return -1;
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
    if (errno || end == s || *end || s[0] == '-') return -1;
    *out = (uint64_t)v;
    return 0;
}

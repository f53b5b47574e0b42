/* Number arguments shared by the subcommands (see cli.h). */
#include <errno.h>
#include <stdlib.h>

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

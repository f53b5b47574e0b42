#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static enum kvs_log_level log_threshold(void)
{
    /* Read the environment each call: cheap, and keeps the module free of
     * mutable globals. */
    const char *s = getenv("KVASIR_LOG");
    if (!s) return KVS_LOG_INFO;
    if (!strcmp(s, "error")) return KVS_LOG_ERROR;
    if (!strcmp(s, "warn")) return KVS_LOG_WARN;
    if (!strcmp(s, "debug")) return KVS_LOG_DEBUG;
    return KVS_LOG_INFO;
}

void kvs_log(enum kvs_log_level level, const char *fmt, ...)
{
    static const char *const names[] = { "error", "warn", "info", "debug" };
    if (level > log_threshold()) return;
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    struct timespec ts;
    struct tm tm;
    char when[64] = "";
    if (clock_gettime(CLOCK_REALTIME, &ts) == 0 && gmtime_r(&ts.tv_sec, &tm))
        snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ ", tm.tm_year + 1900, tm.tm_mon + 1,
                 tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000);
    fprintf(stderr, "%skvasir[%d] %s: %s\n", when, (int)getpid(), names[level], msg);
}

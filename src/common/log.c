#include "common/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
    fprintf(stderr, "kvasir[%d] %s: %s\n", (int)getpid(), names[level], msg);
}

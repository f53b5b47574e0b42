/* Small helpers of the plan module: error text and whole-file reads. */
#include "plan/plan_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void kvs_plan_seterr(char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (!errbuf || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
}

kvs_err kvs_plan_read_file(const char *path, size_t max, char **buf, size_t *len, char *errbuf, size_t errlen)
{
    *buf = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        kvs_plan_seterr(errbuf, errlen, "%s", strerror(errno));
        return KVS_ERR_IO;
    }
    kvs_err err = KVS_OK;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap + 1);
    if (!b) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }
    for (;;) {
        if (n == cap) {
            if (cap >= max) {
                kvs_plan_seterr(errbuf, errlen, "larger than %zu bytes", max);
                err = KVS_ERR_RANGE;
                goto fail;
            }
            size_t ncap = cap * 2 > max ? max : cap * 2;
            char *nb = realloc(b, ncap + 1);
            if (!nb) {
                err = KVS_ERR_NOMEM;
                goto fail;
            }
            b = nb;
            cap = ncap;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) {
                kvs_plan_seterr(errbuf, errlen, "read error: %s", strerror(errno));
                err = KVS_ERR_IO;
                goto fail;
            }
            break;
        }
    }
    b[n] = '\0';
    fclose(f);
    *buf = b;
    *len = n;
    return KVS_OK;
fail:
    free(b);
    fclose(f);
    return err;
}

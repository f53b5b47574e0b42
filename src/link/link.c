/* Transport-independent link dispatch and helpers. */
#include "link/link.h"

#include <time.h>

kvs_err kvs_link_read(struct kvs_link *l, void *buf, size_t cap, size_t *got)
{
    *got = 0;
    return l->ops->read(l, buf, cap, got);
}

kvs_err kvs_link_write(struct kvs_link *l, const void *buf, size_t len, int timeout_ms)
{
    return l->ops->write(l, buf, len, timeout_ms);
}

int kvs_link_fd(const struct kvs_link *l)
{
    return l->ops->fd(l);
}

void kvs_link_close(struct kvs_link *l)
{
    if (l) l->ops->close(l);
}

int kvs_link_backoff_ms(int attempt)
{
    int ms = 50;
    for (int i = 0; i < attempt && ms < 1000; i++) ms *= 2;
    return ms > 1000 ? 1000 : ms;
}

int64_t kvs_link_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Private helpers shared by the plan module's files. */
#ifndef KVS_PLAN_IMPL_H
#define KVS_PLAN_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "plan/plan.h"

/* snprintf into errbuf (if not NULL and errlen > 0). */
void kvs_plan_seterr(char *errbuf, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* One-way time of a hop from x to y carrying bytes (plan.h cost model), ms. */
double kvs_plan_hop_ms(const struct kvs_plan_inventory *inv, const struct kvs_plan_device *x,
                       const struct kvs_plan_device *y, uint64_t bytes);

/* Reads a whole file of at most max bytes into a malloc'd buffer (NUL
 * appended; *len excludes it). KVS_ERR_IO, KVS_ERR_RANGE (too big), NOMEM. */
kvs_err kvs_plan_read_file(const char *path, size_t max, char **buf, size_t *len, char *errbuf, size_t errlen);

#endif

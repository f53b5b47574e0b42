/* libFuzzer target for the planner's JSON parsers (src/plan): the first byte
 * picks the device inventory (docs/PLAN.md) or the rank manifest
 * (docs/MANIFEST.md), the rest is the document. Both fill plain structs (no
 * allocation kept). Must never crash, leak or read out of bounds. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "plan/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    const char *text = (const char *)data + 1;
    char err[256];
    if (data[0] & 1) {
        struct kvs_manifest *mf = malloc(sizeof *mf);
        if (mf) (void)kvs_manifest_parse(text, size - 1, mf, err, sizeof err);
        free(mf);
    } else {
        struct kvs_plan_inventory *inv = malloc(sizeof *inv);
        if (inv) (void)kvs_plan_inventory_parse(text, size - 1, inv, err, sizeof err);
        free(inv);
    }
    return 0;
}

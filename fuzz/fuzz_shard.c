/* libFuzzer target for the shard index parser (src/shard, docs/FORMATS.md
 * "Shard index"): parses the bytes, looks up the first entry's name and frees.
 * Must never crash, leak or read out of bounds, whatever the bytes. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "shard/shard.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    struct kvs_shard_index ix;
    char err[256];
    if (kvs_shard_index_parse((const char *)data, size, &ix, err, sizeof err) == KVS_OK) {
        if (ix.n_tensors && kvs_shard_index_find(&ix, ix.tensors[0].name) != &ix.tensors[0]) abort();
        kvs_shard_index_free(&ix);
    }
    return 0;
}

/* libFuzzer target for the market's request parsing (src/market): the first
 * byte picks a parser (listing, claim, renew, release, the /map reader, the
 * profile, or a receipt when the second byte is odd) or, for values 6..7, a whole request through kvs_market_handle on
 * an in-memory market (claim, renew or release of claim 1; the route is
 * picked by the second byte). Must never crash, leak, hang or read out of
 * bounds; a refused request must leave the map unchanged. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "market/market.h"
#include "plan/plan.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static struct kvs_market *g_market; /* fuzzer-only: one in-memory market for every input */

static struct kvs_market *market(void)
{
    if (g_market) return g_market;
    struct kvs_market_params p = kvs_market_default_params();
    p.db_path = ":memory:";
    char err[256];
    if (kvs_market_open(&p, &g_market, err, sizeof err)) abort();
    struct kvs_market_listing_req q = { .rings = 2, .seqs = 1 };
    strcpy(q.name, "m");
    strcpy(q.url, "http://127.0.0.1:1/m.gguf");
    struct kvs_plan_model *pm = calloc(1, sizeof *pm);
    pm->n_block = 8;
    pm->n_embd = 4;
    pm->n_vocab = 4;
    for (int i = 0; i < 8; i++) pm->block_weight_bytes[i] = 100;
    if (kvs_market_add_listing(g_market, &q, pm, err, sizeof err)) abort();
    free(pm);
    return g_market;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2) return 0;
    const char *text = (const char *)data + 2;
    size_t len = size - 2;
    char err[256];
    switch (data[0] % 8) {
    case 0: {
        struct kvs_market_listing_req r;
        (void)kvs_market_parse_listing(text, len, &r, err, sizeof err);
        break;
    }
    case 1: {
        struct kvs_market_claim_req r;
        (void)kvs_market_parse_claim(text, len, &r, err, sizeof err);
        break;
    }
    case 2: {
        struct kvs_market_renew_req r;
        (void)kvs_market_parse_renew(text, len, &r, err, sizeof err);
        break;
    }
    case 3: {
        struct kvs_market_release_req r;
        (void)kvs_market_parse_release(text, len, &r, err, sizeof err);
        break;
    }
    case 4: {
        struct kvs_market_map map;
        if (kvs_market_map_parse(text, len, &map, err, sizeof err) == KVS_OK) {
            struct kvs_market_choice c;
            (void)kvs_market_choose(&map, (uint64_t)data[1] << 20, &c);
            kvs_market_map_free(&map);
        }
        break;
    }
    case 5: {
        if (data[1] & 1) { /* a receipt (parse and signature check) */
            struct kvs_market_receipt *rc = malloc(sizeof *rc);
            uint8_t d[32];
            if (rc) (void)kvs_market_receipt_parse(text, len, rc, d, err, sizeof err);
            free(rc);
            break;
        }
        struct kvs_plan_model *pm = malloc(sizeof *pm);
        if (pm) (void)kvs_market_profile_parse(text, len, pm, err, sizeof err);
        free(pm);
        break;
    }
    default: {
        static const char *const paths[] = { "/v1/claims", "/v1/claims/1/renew", "/v1/claims/1/release", "/map",
                                             "/v1/rings", "/v1/claims/x/renew", "/v1/receipts" };
        struct kvs_market *m = market();
        struct kvs_market_reply r;
        int64_t now = 1800000000000ll + data[1];
        struct kvs_market_reply before;
        if (kvs_market_handle(m, "GET", "/map", NULL, 0, now, &before) != KVS_OK) abort();
        if (kvs_market_handle(m, "POST", paths[data[1] % 7], text, len, now, &r) == KVS_OK) {
            if (r.status >= 400) { /* a refusal changes nothing */
                struct kvs_market_reply after;
                if (kvs_market_handle(m, "GET", "/map", NULL, 0, now, &after) != KVS_OK) abort();
                if (strcmp(before.body, after.body)) abort();
                free(after.body);
            }
            free(r.body);
        }
        free(before.body);
        break;
    }
    }
    return 0;
}

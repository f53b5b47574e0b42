/* The market (docs/MARKET.md): request parsers, the bad-input table (each a
 * clear error, none changes the state), leases, the reward formula, a node's
 * choice of window, persistence across a restart, and claim races over HTTP
 * (100 rounds of 8 concurrent claimers: exactly one winner each). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <pthread.h>

#include <cmocka.h>
#include <jansson.h>

#include "link/link.h"
#include "market/market.h"
#include "plan/plan.h"

#define T0 1800000000000ll /* a fixed wall clock for the handle() tests, ms */

/* A 4-block model with round numbers: block weights 1000 B, no KV, n_embd 1
 * (work buffers 512 * 1 * 4 * 8 = 16384 B), head 100 B, tail 200 B, vocab 1
 * (logits seqs * 1 * 4 B). */
static struct kvs_plan_model *toy_profile(void)
{
    struct kvs_plan_model *m = calloc(1, sizeof *m);
    m->n_block = 4;
    for (int i = 0; i < 4; i++) m->block_weight_bytes[i] = m->block_stream_bytes[i] = 1000;
    m->head_bytes = 100;
    m->tail_bytes = 200;
    m->n_embd = 1;
    m->n_vocab = 1;
    m->ctx_train = 64;
    snprintf(m->fingerprint, sizeof m->fingerprint, "%064d", 7);
    return m;
}

/* A market opened with p, listing "toy" (2 rings). */
static struct kvs_market *open_toy_with(const struct kvs_market_params *p)
{
    struct kvs_market *m = NULL;
    char err[256];
    assert_int_equal(kvs_market_open(p, &m, err, sizeof err), KVS_OK);
    struct kvs_market_listing_req q = { .rings = 2, .seqs = 1 };
    snprintf(q.name, sizeof q.name, "toy");
    snprintf(q.url, sizeof q.url, "http://127.0.0.1:1/toy.gguf");
    struct kvs_plan_model *pm = toy_profile();
    assert_int_equal(kvs_market_add_listing(m, &q, pm, err, sizeof err), KVS_OK);
    free(pm);
    return m;
}

static struct kvs_market *open_toy(const char *path, int64_t lease_ms)
{
    struct kvs_market_params p = kvs_market_default_params();
    p.db_path = path;
    p.lease_ms = lease_ms;
    p.max_body = 4096;
    return open_toy_with(&p);
}

/* handle() -> status; body kept in *body if asked. */
static int req(struct kvs_market *m, const char *method, const char *path, const char *body, int64_t now, char **out)
{
    struct kvs_market_reply r;
    assert_int_equal(kvs_market_handle(m, method, path, body, body ? strlen(body) : 0, now, &r), KVS_OK);
    assert_non_null(r.body);
    if (out) *out = r.body;
    else free(r.body);
    return r.status;
}

static char *map_at(struct kvs_market *m, int64_t now)
{
    char *b = NULL;
    assert_int_equal(req(m, "GET", "/map", NULL, now, &b), 200);
    return b;
}

/* Claims [b,e) of ring 0 for node; returns the id and copies the token. */
static int64_t claim_ok(struct kvs_market *m, const char *node, int b, int e, int64_t now, char token[33])
{
    char body[256], *out;
    snprintf(body, sizeof body, "{\"model\":\"toy\",\"begin\":%d,\"end\":%d,\"node\":\"%s\",\"endpoint\":\"127.0.0.1:7001\"}",
             b, e, node);
    assert_int_equal(req(m, "POST", "/v1/claims", body, now, &out), 201);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    assert_non_null(j);
    int64_t id = json_integer_value(json_object_get(j, "id"));
    snprintf(token, 33, "%s", json_string_value(json_object_get(j, "token")));
    assert_int_equal(strlen(token), 32);
    json_decref(j);
    return id;
}

static void test_parsers(void **state)
{
    (void)state;
    char err[256];
    struct kvs_market_claim_req c;
    const char *ok = "{\"model\":\"m\",\"ring\":1,\"begin\":2,\"end\":4,\"node\":\"n-1\",\"endpoint\":\"10.0.0.2:7001\","
                     "\"pubkey\":\"placeholder\"}";
    assert_int_equal(kvs_market_parse_claim(ok, strlen(ok), &c, err, sizeof err), KVS_OK);
    assert_int_equal(c.ring, 1);
    assert_int_equal(c.begin, 2);
    assert_int_equal(c.end, 4);
    assert_string_equal(c.endpoint, "10.0.0.2:7001");
    struct {
        const char *body;
        kvs_err want;
        const char *says;
    } bad[] = {
        { "", KVS_ERR_FORMAT, "malformed JSON" },
        { "{\"model\":", KVS_ERR_FORMAT, "malformed JSON" },
        { "[1,2]", KVS_ERR_FORMAT, "JSON object" },
        { "{\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_FORMAT, "'model'" },
        { "{\"model\":\"m\",\"begin\":\"0\",\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_FORMAT, "'begin'" },
        { "{\"model\":\"m\",\"begin\":2,\"end\":2,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_RANGE, "empty" },
        { "{\"model\":\"m\",\"begin\":-1,\"end\":2,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_RANGE, "'begin'" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":5000,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_RANGE, "'end'" },
        { "{\"model\":\"m\",\"ring\":64,\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_RANGE, "'ring'" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"a b\",\"endpoint\":\"h:1\"}", KVS_ERR_FORMAT, "'node'" },
        { "{\"model\":\"m/x\",\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_FORMAT, "'model'" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"n\"}", KVS_ERR_FORMAT, "endpoint" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:0\"}", KVS_ERR_FORMAT, "host:port" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:99999\"}", KVS_ERR_FORMAT, "host:port" },
        { "{\"model\":\"m\",\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\"}", KVS_ERR_FORMAT, "malformed" },
        { "{\"model\":\"m\",\"begin\":0,\"end\":1,\"node\":\"n\",\"endpoint\":\"h:1\",\"api\":\"javascript:x\"}",
          KVS_ERR_FORMAT, "'api'" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        kvs_err e = kvs_market_parse_claim(bad[i].body, strlen(bad[i].body), &c, err, sizeof err);
        if (e != bad[i].want || !strstr(err, bad[i].says))
            fail_msg("claim body %zu '%s': got %d '%s', want %d containing '%s'", i, bad[i].body, e, err, bad[i].want,
                     bad[i].says);
    }
    struct kvs_market_renew_req rn;
    const char *rok = "{\"token\":\"0123456789abcdef0123456789abcdef\",\"ready\":true,\"tps\":12.5,\"queued\":3}";
    assert_int_equal(kvs_market_parse_renew(rok, strlen(rok), &rn, err, sizeof err), KVS_OK);
    assert_true(rn.has_ready && rn.ready && rn.has_tps && rn.tps == 12.5 && rn.queued == 3);
    const char *rbad[] = { "{}", "{\"token\":\"xyz\"}", "{\"token\":\"0123456789ABCDEF0123456789abcdef\"}",
                           "{\"token\":\"0123456789abcdef0123456789abcdef\",\"tps\":-1}",
                           "{\"token\":\"0123456789abcdef0123456789abcdef\",\"ready\":1}",
                           "{\"token\":\"0123456789abcdef0123456789abcdef\",\"queued\":2000000}" };
    for (size_t i = 0; i < sizeof rbad / sizeof rbad[0]; i++)
        if (kvs_market_parse_renew(rbad[i], strlen(rbad[i]), &rn, err, sizeof err) == KVS_OK)
            fail_msg("renew body '%s' accepted", rbad[i]);
    struct kvs_market_listing_req l;
    const char *lok = "{\"url\":\"http://h:8000/dir/aidreams260K.gguf\",\"rings\":2,\"boundary\":\"f32\"}";
    assert_int_equal(kvs_market_parse_listing(lok, strlen(lok), &l, err, sizeof err), KVS_OK);
    assert_string_equal(l.name, "aidreams260K");
    assert_int_equal(l.rings, 2);
    assert_true(l.boundary_f32);
    assert_int_equal(l.seqs, 4);
    assert_string_equal(l.content_id, "");
    const char *lcid = "{\"url\":\"http://h/x.gguf\",\"content_id\":"
                       "\"657c6b273193a9fceb570071aaf7a161cf0d258f62cb9b13cf151dcd8c5c112f\"}";
    assert_int_equal(kvs_market_parse_listing(lcid, strlen(lcid), &l, err, sizeof err), KVS_OK);
    assert_string_equal(l.content_id, "657c6b273193a9fceb570071aaf7a161cf0d258f62cb9b13cf151dcd8c5c112f");
    const char *lbad[] = { "{}", "{\"url\":\"ftp://h/x.gguf\"}", "{\"url\":\"http://h/x.gguf\",\"rings\":0}",
                           "{\"url\":\"http://h/x.gguf\",\"boundary\":\"f8\"}", "{\"url\":\"http://h/x.gguf\",\"name\":\"a b\"}",
                           "{\"url\":\"http://h/x y.gguf\"}",
                           "{\"url\":\"http://h/x.gguf\",\"content_id\":\"abc\"}",
                           "{\"url\":\"http://h/x.gguf\",\"content_id\":\"657C6B273193A9FCEB570071AAF7A161CF0D258F62CB9B13CF151DCD8C5C112F\"}",
                           "{\"url\":\"http://h/x.gguf\",\"content_id\":7}" };
    for (size_t i = 0; i < sizeof lbad / sizeof lbad[0]; i++)
        if (kvs_market_parse_listing(lbad[i], strlen(lbad[i]), &l, err, sizeof err) == KVS_OK)
            fail_msg("listing body '%s' accepted", lbad[i]);
}

static void test_profile_roundtrip(void **state)
{
    (void)state;
    struct kvs_plan_model *m = toy_profile(), *back = calloc(1, sizeof *back);
    m->block_kv_bytes[3] = 512;
    m->block_state_bytes[1] = 70000; /* a Gated DeltaNet block: fixed state per sequence */
    m->tied_bytes = 9;
    snprintf(m->content_id, sizeof m->content_id, "%s", "657c6b273193a9fceb570071aaf7a161cf0d258f62cb9b13cf151dcd8c5c112f");
    char *j = kvs_market_profile_json(m), err[256];
    assert_non_null(j);
    assert_int_equal(kvs_market_profile_parse(j, strlen(j), back, err, sizeof err), KVS_OK);
    assert_int_equal(back->n_block, 4);
    assert_int_equal(back->block_state_bytes[1], 70000);
    assert_int_equal(back->block_kv_bytes[3], 512);
    assert_int_equal(back->tied_bytes, 9);
    assert_int_equal(back->head_bytes, 100);
    assert_string_equal(back->content_id, m->content_id);
    free(j);
    const char *bad = "{\"n_block\":1,\"n_embd\":1,\"n_vocab\":1,\"ctx_train\":0,\"common\":0,\"head\":0,"
                      "\"head_stream\":0,\"tail\":0,\"tail_stream\":0,\"tied\":0,\"blocks\":[[1,1,1]]}";
    assert_int_equal(kvs_market_profile_parse(bad, strlen(bad), back, err, sizeof err), KVS_ERR_FORMAT);
    free(m);
    free(back);
}

static void test_bad_input_changes_nothing(void **state)
{
    (void)state;
    struct kvs_market *m = open_toy(":memory:", 5000);
    char tok[33], other[33];
    int64_t id = claim_ok(m, "a", 0, 2, T0, tok);
    snprintf(other, sizeof other, "%s", tok);
    other[0] = other[0] == '0' ? '1' : '0'; /* a token that is not the holder's */
    char *before = map_at(m, T0);
    char renew_other[128], release_other[128], renew_path[64], release_path[64];
    snprintf(renew_other, sizeof renew_other, "{\"token\":\"%s\",\"ready\":true}", other);
    snprintf(release_other, sizeof release_other, "{\"token\":\"%s\"}", other);
    snprintf(renew_path, sizeof renew_path, "/v1/claims/%lld/renew", (long long)id);
    snprintf(release_path, sizeof release_path, "/v1/claims/%lld/release", (long long)id);
    char big[5000];
    memset(big, ' ', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    big[0] = '{';
    big[sizeof big - 2] = '}';
    struct {
        const char *method, *path, *body;
        int status;
        const char *code;
    } bad[] = {
        { "POST", "/v1/claims", "{\"model\":\"toy\",", 400, "bad_request" },
        { "POST", "/v1/claims", "\"just a string\"", 400, "bad_request" },
        { "POST", "/v1/claims", "{\"model\":\"toy\",\"begin\":2,\"end\":5,\"node\":\"b\",\"endpoint\":\"h:1\"}", 400,
          "out_of_range" },
        { "POST", "/v1/claims", "{\"model\":\"toy\",\"begin\":3,\"end\":1,\"node\":\"b\",\"endpoint\":\"h:1\"}", 400,
          "out_of_range" },
        { "POST", "/v1/claims",
          "{\"model\":\"toy\",\"ring\":2,\"begin\":0,\"end\":1,\"node\":\"b\",\"endpoint\":\"h:1\"}", 400, "out_of_range" },
        { "POST", "/v1/claims", "{\"model\":\"toy\",\"begin\":1,\"end\":3,\"node\":\"b\",\"endpoint\":\"h:1\"}", 409,
          "overlap" },
        { "POST", "/v1/claims", "{\"model\":\"toy\",\"begin\":0,\"end\":4,\"node\":\"b\",\"endpoint\":\"h:1\"}", 409,
          "overlap" },
        { "POST", "/v1/claims", "{\"model\":\"nope\",\"begin\":0,\"end\":1,\"node\":\"b\",\"endpoint\":\"h:1\"}", 404,
          "unknown_model" },
        { "POST", renew_path, renew_other, 403, "not_holder" },
        { "POST", release_path, release_other, 403, "not_holder" },
        { "POST", "/v1/claims/999/renew", renew_other, 404, "unknown_claim" },
        { "POST", "/v1/claims/999/release", release_other, 404, "unknown_claim" },
        { "POST", renew_path, "{\"token\":5}", 400, "bad_request" },
        { "POST", "/v1/claims", big, 413, "too_large" },
        { "POST", "/v1/listings", "{\"url\":\"http://127.0.0.1:1/toy.gguf\",\"name\":\"toy\"}", 409, "exists" },
        { "POST", "/v1/listings", "{\"url\":42}", 400, "bad_request" },
        { "GET", "/v1/nothing", NULL, 404, "unknown_route" },
        { "DELETE", "/map", NULL, 405, "method_not_allowed" },
        { "GET", "/v1/claims", NULL, 405, "method_not_allowed" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *out = NULL;
        int st = req(m, bad[i].method, bad[i].path, bad[i].body, T0, &out);
        json_t *j = json_loads(out, 0, NULL);
        const char *code = json_string_value(json_object_get(json_object_get(j, "error"), "code"));
        const char *msg = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
        if (st != bad[i].status || !code || strcmp(code, bad[i].code) || !msg || !msg[0])
            fail_msg("case %zu %s %s: got %d %s, want %d %s", i, bad[i].method, bad[i].path, st, out, bad[i].status,
                     bad[i].code);
        json_decref(j);
        free(out);
        char *after = map_at(m, T0);
        if (strcmp(before, after)) fail_msg("case %zu changed the map:\n%s\n%s", i, before, after);
        free(after);
    }
    /* the holder can renew and release */
    char body[128];
    snprintf(body, sizeof body, "{\"token\":\"%s\",\"ready\":true,\"tps\":50,\"queued\":2}", tok);
    assert_int_equal(req(m, "POST", renew_path, body, T0 + 10, NULL), 200);
    snprintf(body, sizeof body, "{\"token\":\"%s\"}", tok);
    assert_int_equal(req(m, "POST", release_path, body, T0 + 20, NULL), 200);
    assert_int_equal(req(m, "POST", release_path, body, T0 + 30, NULL), 404);
    free(before);
    kvs_market_close(m);
}

/* The map at `now` parsed. */
static void parsed_map(struct kvs_market *m, int64_t now, struct kvs_market_map *map)
{
    char *b = map_at(m, now), err[256];
    assert_int_equal(kvs_market_map_parse(b, strlen(b), map, err, sizeof err), KVS_OK);
    free(b);
}

static void test_leases_and_reward(void **state)
{
    (void)state;
    assert_true(kvs_market_reward(1, 2, 0, 4) == 0.5);
    assert_true(kvs_market_reward(1, 1, 3, 4) == 0.8125);      /* 1/4 * (1 + 3 * 3/4) */
    assert_true(kvs_market_reward(3.5, 4, 0, 4) == 3.5);
    assert_true(kvs_market_demand(2, 50) == 3.5);              /* 1 + 2 + 50/100 */
    struct kvs_market *m = open_toy(":memory:", 1000);
    struct kvs_market_map map;
    parsed_map(m, T0, &map);
    assert_int_equal(map.n_listings, 1);
    assert_int_equal(map.listings[0].n_gaps, 2); /* two rings, each one gap [0,4) */
    assert_true(map.listings[0].gaps[0].reward == 1.0);
    kvs_market_map_free(&map);
    char tok[33];
    int64_t id = claim_ok(m, "a", 0, 3, T0, tok);
    char path[64], body[128];
    snprintf(path, sizeof path, "/v1/claims/%lld/renew", (long long)id);
    snprintf(body, sizeof body, "{\"token\":\"%s\",\"tps\":100,\"queued\":1}", tok);
    parsed_map(m, T0 + 999, &map);
    assert_int_equal(map.listings[0].n_claims, 1);
    /* ring 0: gap [3,4) with 3 of 4 covered, demand 1 */
    assert_int_equal(map.listings[0].gaps[0].begin, 3);
    assert_true(map.listings[0].gaps[0].reward == 0.8125);
    kvs_market_map_free(&map);
    /* renewed at T0 + 500: lives to T0 + 1500; the report raises the demand to 1 + 1 + 1 = 3 */
    assert_int_equal(req(m, "POST", path, body, T0 + 500, NULL), 200);
    parsed_map(m, T0 + 1499, &map);
    assert_int_equal(map.listings[0].n_claims, 1);
    assert_true(map.listings[0].demand == 3.0);
    assert_true(map.listings[0].gaps[0].reward == 3 * 0.8125);
    kvs_market_map_free(&map);
    parsed_map(m, T0 + 1500, &map); /* expired: gone, the ring is one gap again */
    assert_int_equal(map.listings[0].n_claims, 0);
    assert_int_equal(map.listings[0].gaps[0].begin, 0);
    assert_int_equal(map.listings[0].gaps[0].end, 4);
    kvs_market_map_free(&map);
    assert_int_equal(req(m, "POST", path, body, T0 + 1600, NULL), 404); /* renewing an expired claim */
    /* the expired blocks can be claimed by another node */
    claim_ok(m, "b", 1, 2, T0 + 1600, tok);
    kvs_market_close(m);
}

static void test_choose(void **state)
{
    (void)state;
    struct kvs_market *m = open_toy(":memory:", 5000);
    struct kvs_market_map map;
    struct kvs_market_choice c;
    parsed_map(m, T0, &map);
    /* [0,b): 1000 b + head 100 + buffers 16384; the tail adds 200 + logits 4 */
    assert_int_equal(kvs_market_choose(&map, 17483, &c), KVS_ERR_NOT_FOUND);
    assert_int_equal(c.mem_bytes, 17484);
    assert_int_equal(kvs_market_choose(&map, 18484, &c), KVS_OK);
    assert_int_equal(c.ring, 0);
    assert_int_equal(c.begin, 0);
    assert_int_equal(c.end, 2);
    assert_int_equal(c.mem_bytes, 18484);
    assert_true(c.reward == 0.5);
    assert_int_equal(kvs_market_choose(&map, 1u << 30, &c), KVS_OK);
    assert_int_equal(c.end, 4);
    assert_int_equal(c.mem_bytes, 4000 + 100 + 200 + 16384 + 4);
    kvs_market_map_free(&map);
    /* ring 0 holds [0,3): its gap [3,4) (reward 0.8125) beats ring 1's [0,1) (0.25) */
    char tok[33];
    claim_ok(m, "a", 0, 3, T0, tok);
    parsed_map(m, T0, &map);
    assert_int_equal(kvs_market_choose(&map, 17588, &c), KVS_OK);
    assert_int_equal(c.ring, 0);
    assert_int_equal(c.begin, 3);
    assert_int_equal(c.end, 4);
    assert_true(c.reward == 0.8125);
    const struct kvs_market_claim *succ = kvs_market_claim_at(&map.listings[0], 0, 0);
    assert_non_null(succ);
    assert_string_equal(succ->node, "a");
    assert_null(kvs_market_claim_at(&map.listings[0], 0, 3));
    kvs_market_map_free(&map);
    kvs_market_close(m);
}

static void test_restart_keeps_claims(void **state)
{
    (void)state;
    char path[] = "/tmp/kvs_market_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    unlink(path);
    struct kvs_market *m = open_toy(path, 400);
    char tok[33];
    int64_t now = kvs_market_now_ms();
    int64_t id = claim_ok(m, "a", 0, 2, now, tok);
    claim_ok(m, "b", 2, 4, now - 1000, tok); /* expired before the market stops: not resurrected */
    kvs_market_close(m);
    usleep(600 * 1000); /* down for longer than the lease */
    struct kvs_market_params p = kvs_market_default_params();
    p.db_path = path;
    p.lease_ms = 400;
    char err[256];
    assert_int_equal(kvs_market_open(&p, &m, err, sizeof err), KVS_OK);
    struct kvs_market_map map;
    parsed_map(m, kvs_market_now_ms(), &map);
    assert_int_equal(map.n_listings, 1);
    assert_string_equal(map.listings[0].name, "toy");
    assert_int_equal(map.listings[0].n_claims, 1);
    assert_int_equal(map.listings[0].claims[0].id, id);
    assert_string_equal(map.listings[0].claims[0].node, "a");
    assert_int_equal(map.listings[0].claims[0].end, 2);
    kvs_market_map_free(&map);
    kvs_market_close(m);
    unlink(path);
    char side[64];
    snprintf(side, sizeof side, "%s-wal", path);
    unlink(side);
    snprintf(side, sizeof side, "%s-shm", path);
    unlink(side);
}

/* --- races over HTTP ------------------------------------------------------------- */

#define RACERS 8
#define ROUNDS 100

struct racer {
    char base[64];
    int idx, round;
    pthread_barrier_t *bar;
    int status;
    char token[33];
    int64_t id;
};

static void *race(void *arg)
{
    struct racer *r = arg;
    char body[256], err[256], *reply = NULL;
    /* everyone wants blocks overlapping [1,3) */
    int b = r->idx % 3 == 0 ? 0 : 1, e = r->idx % 2 ? 3 : 2;
    snprintf(body, sizeof body,
             "{\"model\":\"toy\",\"begin\":%d,\"end\":%d,\"node\":\"r%d-%d\",\"endpoint\":\"127.0.0.1:%d\"}", b, e,
             r->round, r->idx, 7000 + r->idx);
    pthread_barrier_wait(r->bar);
    r->status = 0;
    if (kvs_market_call(r->base, "POST", "/v1/claims", body, 10000, &r->status, &reply, err, sizeof err) == KVS_OK &&
        r->status == 201) {
        json_t *j = json_loads(reply, 0, NULL);
        snprintf(r->token, sizeof r->token, "%s", json_string_value(json_object_get(j, "token")));
        r->id = json_integer_value(json_object_get(j, "id"));
        json_decref(j);
    }
    free(reply);
    return NULL;
}

static void test_races(void **state)
{
    (void)state;
    struct kvs_market *m = open_toy(":memory:", 60000);
    char err[256];
    assert_int_equal(kvs_market_start(m, "127.0.0.1", 0, err, sizeof err), KVS_OK);
    struct racer rs[RACERS];
    pthread_barrier_t bar;
    int winners_total = 0;
    for (int round = 0; round < ROUNDS; round++) {
        pthread_barrier_init(&bar, NULL, RACERS);
        pthread_t th[RACERS];
        for (int i = 0; i < RACERS; i++) {
            memset(&rs[i], 0, sizeof rs[i]);
            snprintf(rs[i].base, sizeof rs[i].base, "http://127.0.0.1:%u", (unsigned)kvs_market_port(m));
            rs[i].idx = i;
            rs[i].round = round;
            rs[i].bar = &bar;
            assert_int_equal(pthread_create(&th[i], NULL, race, &rs[i]), 0);
        }
        int wins = 0, lost = 0, win = -1;
        for (int i = 0; i < RACERS; i++) {
            pthread_join(th[i], NULL);
            if (rs[i].status == 201) wins++, win = i;
            else if (rs[i].status == 409) lost++;
        }
        pthread_barrier_destroy(&bar);
        if (wins != 1 || lost != RACERS - 1) fail_msg("round %d: %d winners, %d refused (want 1 and 7)", round, wins, lost);
        winners_total += wins;
        /* the map holds exactly the winner's claim; release it for the next round */
        struct kvs_market_map map;
        parsed_map(m, kvs_market_now_ms(), &map);
        assert_int_equal(map.listings[0].n_claims, 1);
        assert_int_equal(map.listings[0].claims[0].id, rs[win].id);
        kvs_market_map_free(&map);
        char body[64], path[64], *reply = NULL;
        int st = 0;
        snprintf(body, sizeof body, "{\"token\":\"%s\"}", rs[win].token);
        snprintf(path, sizeof path, "/v1/claims/%lld/release", (long long)rs[win].id);
        assert_int_equal(kvs_market_call(rs[0].base, "POST", path, body, 5000, &st, &reply, err, sizeof err), KVS_OK);
        assert_int_equal(st, 200);
        free(reply);
    }
    assert_int_equal(winners_total, ROUNDS);
    /* an oversized body over HTTP: 413, and a map without the claim */
    char *big = malloc(200000), *reply = NULL;
    memset(big, ' ', 199999);
    big[199999] = '\0';
    big[0] = '{';
    int st = 0;
    assert_int_equal(kvs_market_call(rs[0].base, "POST", "/v1/claims", big, 5000, &st, &reply, err, sizeof err), KVS_OK);
    assert_int_equal(st, 413);
    assert_non_null(strstr(reply, "too_large"));
    free(reply);
    free(big);
    kvs_market_close(m);
}

/* Relay claims (docs/MARKET.md "Relay claims"): a market without a relay secret refuses them and
 * its edge route; with one, the claim's in link is the edge MODEL-rR-bB under the relay's URL, the
 * claimant gets its token, the holder of the window before it gets the same token from
 * /v1/claims/ID/edge (the tail: the edge into block 0), a stranger's token gets 403. */
static void test_relay_claims(void **state)
{
    (void)state;
    static const char secret[] = "test-relay-secret-0123456789";
    char *out = NULL, body[512], tok[KVS_RELAY_TOKEN_HEX + 1];
    /* no secret: refused, nothing changes */
    struct kvs_market *m = open_toy(":memory:", 10000);
    char *before = map_at(m, T0);
    const char *rc = "{\"model\":\"toy\",\"begin\":2,\"end\":3,\"node\":\"ph\",\"relay\":\"wss://10.0.0.1\",\"pubkey\":\"\"}";
    assert_int_equal(req(m, "POST", "/v1/claims", rc, T0, &out), 400);
    assert_non_null(strstr(out, "no_relay"));
    free(out);
    char a_tok[33];
    int64_t a = claim_ok(m, "a", 0, 2, T0, a_tok);
    snprintf(body, sizeof body, "{\"token\":\"%s\"}", a_tok);
    char path[64];
    snprintf(path, sizeof path, "/v1/claims/%lld/edge", (long long)a);
    assert_int_equal(req(m, "POST", path, body, T0, NULL), 404);
    free(before);
    kvs_market_close(m);

    /* with the secret and a pin */
    struct kvs_market_params p = kvs_market_default_params();
    p.db_path = ":memory:";
    p.relay_secret = (const uint8_t *)secret;
    p.relay_secret_len = strlen(secret);
    p.relay_pin = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
    m = open_toy_with(&p);
    /* a relay URL with a path, or another scheme: refused */
    const char *bad[] = { "wss://10.0.0.1/edge/x", "http://10.0.0.1", "wss://", "wss://a b" };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        snprintf(body, sizeof body, "{\"model\":\"toy\",\"begin\":2,\"end\":3,\"node\":\"ph\",\"relay\":\"%s\"}", bad[i]);
        assert_int_equal(req(m, "POST", "/v1/claims", body, T0, NULL), 400);
    }
    assert_int_equal(req(m, "POST", "/v1/claims", rc, T0, &out), 201);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    assert_string_equal(json_string_value(json_object_get(j, "relay")), "wss://10.0.0.1/edge/toy-r0-b2");
    assert_string_equal(json_string_value(json_object_get(j, "edge")), "toy-r0-b2");
    assert_int_equal(kvs_relay_token(secret, strlen(secret), "toy-r0-b2", tok), KVS_OK);
    assert_string_equal(json_string_value(json_object_get(j, "edge_token")), tok);
    assert_string_equal(json_string_value(json_object_get(j, "relay_pin")), p.relay_pin);
    int64_t ph = json_integer_value(json_object_get(j, "id"));
    json_decref(j);
    /* the map names the edge, never its token */
    struct kvs_market_map map;
    parsed_map(m, T0, &map);
    const struct kvs_market_claim *c = kvs_market_claim_at(&map.listings[0], 0, 2);
    assert_non_null(c);
    assert_int_equal(c->id, ph);
    assert_string_equal(c->relay, "wss://10.0.0.1/edge/toy-r0-b2");
    assert_string_equal(c->endpoint, "");
    kvs_market_map_free(&map);
    char *mp = map_at(m, T0);
    assert_null(strstr(mp, tok));
    free(mp);
    /* the predecessor [0,2) gets the token of the edge into block 2; the tail [3,4) that of block 0 */
    a = claim_ok(m, "a", 0, 2, T0, a_tok);
    char c_tok[33];
    int64_t ct = claim_ok(m, "c", 3, 4, T0, c_tok);
    snprintf(path, sizeof path, "/v1/claims/%lld/edge", (long long)a);
    snprintf(body, sizeof body, "{\"token\":\"%s\"}", a_tok);
    assert_int_equal(req(m, "POST", path, body, T0, &out), 200);
    j = json_loads(out, 0, NULL);
    free(out);
    assert_string_equal(json_string_value(json_object_get(j, "edge")), "toy-r0-b2");
    assert_string_equal(json_string_value(json_object_get(j, "edge_token")), tok);
    json_decref(j);
    snprintf(body, sizeof body, "{\"token\":\"%s\"}", c_tok); /* c's token on a's claim */
    assert_int_equal(req(m, "POST", path, body, T0, NULL), 403);
    snprintf(path, sizeof path, "/v1/claims/%lld/edge", (long long)ct);
    assert_int_equal(req(m, "POST", path, body, T0, &out), 200);
    j = json_loads(out, 0, NULL);
    free(out);
    assert_string_equal(json_string_value(json_object_get(j, "edge")), "toy-r0-b0");
    assert_int_equal(kvs_relay_token(secret, strlen(secret), "toy-r0-b0", tok), KVS_OK);
    assert_string_equal(json_string_value(json_object_get(j, "edge_token")), tok);
    json_decref(j);
    /* an expired claim gets nothing */
    assert_int_equal(req(m, "POST", path, body, T0 + 10 * KVS_MARKET_LEASE_DEFAULT_MS, NULL), 404);
    kvs_market_close(m);

    /* edge ids: readable when they fit 64 bytes, else hashed; always a valid edge id */
    char id[65];
    kvs_market_edge_id("aidreams260K", 0, 2, id);
    assert_string_equal(id, "aidreams260K-r0-b2");
    char lng[64];
    memset(lng, 'x', 63);
    lng[63] = '\0';
    kvs_market_edge_id(lng, 63, 4000000000u, id);
    assert_true(strlen(id) <= 64 && id[0] == 'h');
    assert_non_null(strstr(id, "-r63-b4000000000"));
    assert_int_equal(kvs_relay_token(secret, strlen(secret), id, tok), KVS_OK);
    /* bad params */
    char err[256];
    p.relay_secret_len = 8;
    assert_int_equal(kvs_market_open(&p, &m, err, sizeof err), KVS_ERR_ARG);
    p.relay_secret_len = strlen(secret);
    p.relay_pin = "xyz";
    assert_int_equal(kvs_market_open(&p, &m, err, sizeof err), KVS_ERR_ARG);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parsers),          cmocka_unit_test(test_profile_roundtrip),
        cmocka_unit_test(test_bad_input_changes_nothing),
        cmocka_unit_test(test_leases_and_reward), cmocka_unit_test(test_choose),
        cmocka_unit_test(test_restart_keeps_claims), cmocka_unit_test(test_races),
        cmocka_unit_test(test_relay_claims),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

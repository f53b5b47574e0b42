/* Inventory and manifest JSON (docs/PLAN.md, docs/MANIFEST.md), the model
 * profile of a real file, and the header-only read over HTTP ranges. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gguf/gguf.h"
#include "plan/plan.h"
#include "link/link.h"
#include "shard/shard.h"

static char g_err[512];

static kvs_err inv_parse(const char *s, struct kvs_plan_inventory *inv)
{
    g_err[0] = '\0';
    return kvs_plan_inventory_parse(s, strlen(s), inv, g_err, sizeof g_err);
}

static void test_inventory_ok(void **state)
{
    (void)state;
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    assert_non_null(inv);
    const char *doc = "{\"relay\": {\"rtt_ms\": 25.5}, \"devices\": ["
                      "{\"name\": \"g\", \"backend\": \"cuda\", \"mem_bytes\": 24000000000, \"decode_gbps\": 900,"
                      " \"prefill_gflops\": 5000, \"rtt_ms\": 0.5, \"bandwidth_mbps\": 10000, \"threads\": 4,"
                      " \"addr\": \"10.0.0.5:7001\"},"
                      "{\"name\": \"p\", \"mem_bytes\": 1000, \"decode_gbps\": 2.5, \"accepts_inbound\": false}]}";
    assert_int_equal(inv_parse(doc, inv), KVS_OK);
    assert_int_equal(inv->n_devices, 2);
    assert_true(inv->relay_rtt_ms == 25.5);
    assert_string_equal(inv->devices[0].name, "g");
    assert_int_equal(inv->devices[0].backend, KVS_PLAN_BACKEND_CUDA);
    assert_int_equal(inv->devices[0].mem_bytes, 24000000000ull);
    assert_true(inv->devices[0].decode_gbps == 900);
    assert_true(inv->devices[0].rtt_ms == 0.5);
    assert_int_equal(inv->devices[0].threads, 4);
    assert_string_equal(inv->devices[0].addr, "10.0.0.5:7001");
    assert_true(inv->devices[0].accepts_inbound);
    /* Defaults: cpu, 1 ms, 1000 Mbit/s, 1 thread, no addr. */
    assert_int_equal(inv->devices[1].backend, KVS_PLAN_BACKEND_CPU);
    assert_true(inv->devices[1].rtt_ms == 1.0);
    assert_true(inv->devices[1].bandwidth_mbps == 1000.0);
    assert_int_equal(inv->devices[1].threads, 1);
    assert_string_equal(inv->devices[1].addr, "");
    assert_false(inv->devices[1].accepts_inbound);
    /* A bare array; relay default 40 ms. */
    assert_int_equal(inv_parse("[{\"name\": \"x\", \"mem_bytes\": 5, \"decode_gbps\": 1}]", inv), KVS_OK);
    assert_true(inv->relay_rtt_ms == 40.0);
    free(inv);
}

static void test_inventory_errors(void **state)
{
    (void)state;
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    assert_non_null(inv);
    static const struct {
        const char *doc;
        const char *needle;
    } bad[] = {
        { "", "JSON error" },
        { "{\"devices\": []}", "non-empty" },
        { "{\"devices\": [{\"mem_bytes\": 5, \"decode_gbps\": 1}]}", "\"name\"" },
        { "[{\"name\": \"a\", \"mem_bytes\": 0, \"decode_gbps\": 1}]", "mem_bytes" },
        { "[{\"name\": \"a\", \"mem_bytes\": 1.5, \"decode_gbps\": 1}]", "mem_bytes" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 0}]", "decode_gbps" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"backend\": \"tpu\"}]", "backend" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"rtt_ms\": -1}]", "rtt_ms" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"bandwidth_mbps\": 0}]", "bandwidth_mbps" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"accepts_inbound\": 1}]", "accepts_inbound" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"threads\": 0}]", "threads" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"addr\": \"nohost\"}]", "addr" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"addr\": \"h:70000\"}]", "addr" },
        { "[{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1}, {\"name\": \"a\", \"mem_bytes\": 5, "
          "\"decode_gbps\": 1}]",
          "twice" },
        { "{\"relay\": {\"rtt_ms\": \"x\"}, \"devices\": [{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1}]}",
          "relay" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvs_err e = inv_parse(bad[i].doc, inv);
        if (e != KVS_ERR_FORMAT || !strstr(g_err, bad[i].needle))
            fail_msg("case %zu: %s / '%s' (wanted FORMAT naming %s)", i, kvs_strerror(e), g_err, bad[i].needle);
        assert_int_equal(inv->n_devices, 0);
    }
    /* 65 devices: too many. */
    size_t cap = 65 * 80 + 16;
    char *doc = malloc(cap);
    assert_non_null(doc);
    size_t n = (size_t)snprintf(doc, cap, "[");
    for (int i = 0; i < 65; i++)
        n += (size_t)snprintf(doc + n, cap - n, "%s{\"name\": \"d%d\", \"mem_bytes\": 5, \"decode_gbps\": 1}",
                              i ? "," : "", i);
    snprintf(doc + n, cap - n, "]");
    assert_int_equal(inv_parse(doc, inv), KVS_ERR_RANGE);
    free(doc);
    free(inv);
}

static void test_manifest_parse(void **state)
{
    (void)state;
    struct kvs_manifest *mf = malloc(sizeof *mf);
    assert_non_null(mf);
    const char *ok = "{\"kvasir_manifest\": 1, \"model\": {\"path\": \"m.gguf\", \"url\": null, \"fingerprint\": "
                     "\"ab\", \"n_block\": 4}, \"ranks\": ["
                     "{\"rank\": 0, \"device\": \"a\", \"window\": [0, 3], \"listen\": \"127.0.0.1:7001\", "
                     "\"next\": \"127.0.0.1:7002\", \"threads\": 2},"
                     "{\"rank\": 1, \"window\": [3, 4], \"listen\": \"127.0.0.1:7002\", \"next\": "
                     "\"127.0.0.1:7001\"}]}";
    assert_int_equal(kvs_manifest_parse(ok, strlen(ok), mf, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(mf->n_ranks, 2);
    assert_int_equal(mf->n_block, 4);
    assert_string_equal(mf->model_path, "m.gguf");
    assert_string_equal(mf->model_url, "");
    assert_int_equal(mf->ranks[0].end, 3);
    assert_int_equal(mf->ranks[0].threads, 2);
    assert_int_equal(mf->ranks[1].threads, 1);
    assert_string_equal(mf->ranks[1].next, "127.0.0.1:7001");
    static const struct {
        const char *doc;
        kvs_err err;
    } bad[] = {
        { "{\"kvasir_manifest\": 2, \"model\": {\"n_block\": 1}, \"ranks\": []}", KVS_ERR_UNSUPPORTED },
        { "{\"model\": {\"n_block\": 1}}", KVS_ERR_FORMAT },
        { "{\"kvasir_manifest\": 1, \"model\": {\"n_block\": 0}, \"ranks\": []}", KVS_ERR_FORMAT },
        /* gap: [0,1) then [2,4) */
        { "{\"kvasir_manifest\": 1, \"model\": {\"n_block\": 4}, \"ranks\": [{\"rank\": 0, \"window\": [0, 1], "
          "\"listen\": \"h:1\", \"next\": \"h:2\"}, {\"rank\": 1, \"window\": [2, 4], \"listen\": \"h:2\", "
          "\"next\": \"h:1\"}]}",
          KVS_ERR_RANGE },
        /* does not cover the last block */
        { "{\"kvasir_manifest\": 1, \"model\": {\"n_block\": 4}, \"ranks\": [{\"rank\": 0, \"window\": [0, 3], "
          "\"listen\": \"h:1\", \"next\": \"h:1\"}]}",
          KVS_ERR_RANGE },
        /* wrong rank number */
        { "{\"kvasir_manifest\": 1, \"model\": {\"n_block\": 4}, \"ranks\": [{\"rank\": 1, \"window\": [0, 4], "
          "\"listen\": \"h:1\", \"next\": \"h:1\"}]}",
          KVS_ERR_FORMAT },
        /* bad address */
        { "{\"kvasir_manifest\": 1, \"model\": {\"n_block\": 4}, \"ranks\": [{\"rank\": 0, \"window\": [0, 4], "
          "\"listen\": \"h\", \"next\": \"h:1\"}]}",
          KVS_ERR_FORMAT },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvs_err e = kvs_manifest_parse(bad[i].doc, strlen(bad[i].doc), mf, g_err, sizeof g_err);
        if (e != bad[i].err)
            fail_msg("case %zu: %s (%s), wanted %s", i, kvs_strerror(e), g_err, kvs_strerror(bad[i].err));
        assert_int_equal(mf->n_ranks, 0);
    }
    free(mf);
}

/* Regression: the reader accepted targets.ctx 0 or 1e9, boundary "f8", and a
 * ring that does not close (a rank's next not the following rank's listen,
 * the last rank's next not rank 0's listen). Each case names the field. */
#define MF_HEAD "{\"kvasir_manifest\": 1, \"model\": {\"path\": \"m.gguf\", \"n_block\": 4}, "
#define MF_TARGETS(ctx, seqs, bnd) "\"targets\": {\"ctx\": " ctx ", \"seqs\": " seqs ", \"boundary\": " bnd "}, "
#define MF_RANKS(n0, n1, n2) \
    "\"ranks\": [" \
    "{\"rank\": 0, \"window\": [0, 1], \"listen\": \"127.0.0.1:7001\", \"next\": \"" n0 "\"}," \
    "{\"rank\": 1, \"window\": [1, 3], \"listen\": \"127.0.0.1:7002\", \"next\": \"" n1 "\"}," \
    "{\"rank\": 2, \"window\": [3, 4], \"listen\": \"127.0.0.1:7003\", \"next\": \"" n2 "\"}]}"
#define MF_RING MF_RANKS("127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7001")

static void test_manifest_strict(void **state)
{
    (void)state;
    struct kvs_manifest *mf = malloc(sizeof *mf);
    assert_non_null(mf);
    /* The good 3-rank ring, with and without targets. */
    const char *ok = MF_HEAD MF_TARGETS("128", "2", "\"f32\"") MF_RING;
    assert_int_equal(kvs_manifest_parse(ok, strlen(ok), mf, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(mf->n_ranks, 3);
    assert_int_equal(mf->ctx, 128);
    assert_int_equal(mf->seqs, 2);
    assert_int_equal(mf->boundary_bytes, 4);
    assert_string_equal(mf->ranks[2].next, "127.0.0.1:7001");
    const char *edges = MF_HEAD MF_TARGETS("16777216", "4096", "\"f16\"") MF_RING;
    assert_int_equal(kvs_manifest_parse(edges, strlen(edges), mf, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(mf->ctx, 16777216);
    assert_int_equal(mf->seqs, 4096);
    assert_int_equal(mf->boundary_bytes, 2);
    const char *bare = MF_HEAD MF_RING;
    assert_int_equal(kvs_manifest_parse(bare, strlen(bare), mf, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(mf->ctx, 0);
    assert_int_equal(mf->boundary_bytes, 0);
    /* One rank: its next is its own listen. */
    const char *one = MF_HEAD "\"ranks\": [{\"rank\": 0, \"window\": [0, 4], \"listen\": \"h:1\", \"next\": \"h:1\"}]}";
    assert_int_equal(kvs_manifest_parse(one, strlen(one), mf, g_err, sizeof g_err), KVS_OK);

    static const struct {
        const char *doc;
        kvs_err err;
        const char *needle;
    } bad[] = {
        { MF_HEAD MF_TARGETS("0", "1", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.ctx" },
        { MF_HEAD MF_TARGETS("1e9", "1", "\"f16\"") MF_RING, KVS_ERR_FORMAT, "targets.ctx" },
        { MF_HEAD MF_TARGETS("1000000000", "1", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.ctx" },
        { MF_HEAD MF_TARGETS("16777217", "1", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.ctx" },
        { MF_HEAD MF_TARGETS("-5", "1", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.ctx" },
        { MF_HEAD MF_TARGETS("\"128\"", "1", "\"f16\"") MF_RING, KVS_ERR_FORMAT, "targets.ctx" },
        { MF_HEAD "\"targets\": {\"seqs\": 1, \"boundary\": \"f16\"}, " MF_RING, KVS_ERR_FORMAT, "targets.ctx" },
        { MF_HEAD MF_TARGETS("128", "0", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.seqs" },
        { MF_HEAD MF_TARGETS("128", "4097", "\"f16\"") MF_RING, KVS_ERR_RANGE, "targets.seqs" },
        { MF_HEAD MF_TARGETS("128", "1", "\"f8\"") MF_RING, KVS_ERR_FORMAT, "targets.boundary" },
        { MF_HEAD MF_TARGETS("128", "1", "\"F16\"") MF_RING, KVS_ERR_FORMAT, "targets.boundary" },
        { MF_HEAD MF_TARGETS("128", "1", "2") MF_RING, KVS_ERR_FORMAT, "targets.boundary" },
        { MF_HEAD "\"targets\": [128], " MF_RING, KVS_ERR_FORMAT, "\"targets\"" },
        /* the last rank's next is not rank 0's listen */
        { MF_HEAD MF_RANKS("127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7009"), KVS_ERR_FORMAT,
          "ranks[2].next is \"127.0.0.1:7009\" but ranks[0].listen is \"127.0.0.1:7001\"" },
        /* the tail points at itself */
        { MF_HEAD MF_RANKS("127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:7003"), KVS_ERR_FORMAT,
          "rank 0's listen" },
        /* a middle rank skips its successor (the ring 0 -> 1 -> 0 leaves rank 2 out) */
        { MF_HEAD MF_RANKS("127.0.0.1:7002", "127.0.0.1:7001", "127.0.0.1:7001"), KVS_ERR_FORMAT,
          "ranks[1].next is \"127.0.0.1:7001\" but ranks[2].listen is \"127.0.0.1:7003\"" },
        /* rank 0 points at rank 2 */
        { MF_HEAD MF_RANKS("127.0.0.1:7003", "127.0.0.1:7003", "127.0.0.1:7001"), KVS_ERR_FORMAT,
          "following rank's listen" },
        /* one rank whose next is elsewhere */
        { MF_HEAD "\"ranks\": [{\"rank\": 0, \"window\": [0, 4], \"listen\": \"h:1\", \"next\": \"h:2\"}]}",
          KVS_ERR_FORMAT, "ranks[0].next" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        g_err[0] = '\0';
        kvs_err e = kvs_manifest_parse(bad[i].doc, strlen(bad[i].doc), mf, g_err, sizeof g_err);
        if (e != bad[i].err || !strstr(g_err, bad[i].needle))
            fail_msg("case %zu: %s (%s), wanted %s naming '%s'", i, kvs_strerror(e), g_err,
                     kvs_strerror(bad[i].err), bad[i].needle);
        assert_int_equal(mf->n_ranks, 0);
    }
    free(mf);
}

/* Regression: `kvasir plan` planned ctx 4096 for aidreams260K whose
 * context_length is 128. By hand (tests/e2e/plan_ring.sh): a middle block
 * needs 198144 weights + 256 B/token KV * ctx + 1048576 buffers: 1279488 at
 * ctx 128, 198144 + 1048576 + 1048576 = 2295296 at ctx 4096. Four devices of
 * 1450000 bytes fit at 128 (one block each), not at 4096. */
static void test_default_ctx_from_model(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/aidreams260K.gguf", shared ? shared : "../shared");
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_model *m = NULL;
    assert_int_equal(kvs_plan_model_from_gguf(g, &m, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(m->ctx_train, 128);
    assert_int_equal(kvs_plan_default_ctx(m), 128);

    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *res = malloc(sizeof *res);
    assert_non_null(inv);
    assert_non_null(res);
    const char *doc = "[{\"name\": \"a\", \"mem_bytes\": 1450000, \"decode_gbps\": 20},"
                      " {\"name\": \"b\", \"mem_bytes\": 1450000, \"decode_gbps\": 10},"
                      " {\"name\": \"c\", \"mem_bytes\": 1450000, \"decode_gbps\": 5},"
                      " {\"name\": \"d\", \"mem_bytes\": 1450000, \"decode_gbps\": 2}]";
    assert_int_equal(inv_parse(doc, inv), KVS_OK);
    struct kvs_plan_targets t = kvs_plan_default_targets();
    t.ctx = kvs_plan_default_ctx(m);
    assert_int_equal(kvs_plan_window_mem(m, &t, 1, 2), 1279488);
    kvs_err e = kvs_plan_solve(m, inv, &t, res, g_err, sizeof g_err);
    if (e)
        fail_msg("default ctx: %s (%s)", kvs_strerror(e), g_err);
    assert_int_equal(res->n_ranks, 4);
    for (size_t r = 0; r < 4; r++) {
        assert_int_equal(res->ranks[r].begin, r);
        assert_int_equal(res->ranks[r].end, r + 1);
        assert_int_equal(res->ranks[r].kv_bytes, 256 * 128);
    }
    /* --ctx 4096 (the old default) does not fit. */
    t.ctx = 4096;
    assert_int_equal(kvs_plan_window_mem(m, &t, 1, 2), 2295296);
    assert_int_equal(kvs_plan_solve(m, inv, &t, res, g_err, sizeof g_err), KVS_ERR_INFEASIBLE);

    /* Caps: a long-context model gets 4096, a model that does not say gets 4096. */
    m->ctx_train = 32768;
    assert_int_equal(kvs_plan_default_ctx(m), 4096);
    m->ctx_train = 4096;
    assert_int_equal(kvs_plan_default_ctx(m), 4096);
    m->ctx_train = 4095;
    assert_int_equal(kvs_plan_default_ctx(m), 4095);
    m->ctx_train = 0;
    assert_int_equal(kvs_plan_default_ctx(m), 4096);
    free(inv);
    free(res);
    free(m);
    kvs_gguf_close(g);
}

/* A device with "accepts_inbound": false: both of its edges are written as
 * relay URLs with the edge's token (the receiving rank's listen = the
 * sending rank's next); the manifest reads back; no secret or no relay URL
 * is refused. */
/* Per-edge boundary precision (docs/MANIFEST.md ranks[i].boundary): auto makes
 * an edge f16 only where one f32 row (aidreams: n_embd 64, 2048 bits) takes
 * longer than f16_above_ms to send: at 0.2 Mbit/s 10.24 ms > 5 ms; at 1000
 * Mbit/s 0.002 ms. The tail sends token ids: "f32". The reader takes the
 * field back; a bad value names it. */
static void test_manifest_edge_boundary(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/aidreams260K.gguf", shared ? shared : "../shared");
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_model *m = NULL;
    assert_int_equal(kvs_plan_model_from_gguf(g, &m, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(m->n_embd, 64);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *res = malloc(sizeof *res);
    struct kvs_manifest *mf = malloc(sizeof *mf);
    assert_true(inv && res && mf);
    const char *doc = "[{\"name\": \"a\", \"mem_bytes\": 9000000, \"decode_gbps\": 20, \"bandwidth_mbps\": 1000},"
                      " {\"name\": \"b\", \"mem_bytes\": 9000000, \"decode_gbps\": 20, \"bandwidth_mbps\": 1000},"
                      " {\"name\": \"slow\", \"mem_bytes\": 9000000, \"decode_gbps\": 20, \"bandwidth_mbps\": 0.2}]";
    assert_int_equal(inv_parse(doc, inv), KVS_OK);
    /* a [0,1) -> b [1,2) -> slow [2,4) -> a */
    const struct kvs_plan_rank ranks[3] = { { .device = 0, .begin = 0, .end = 1 },
                                            { .device = 1, .begin = 1, .end = 2 },
                                            { .device = 2, .begin = 2, .end = 4 } };
    static const struct {
        uint32_t boundary_bytes;
        double above_ms;
        const char *targets;
        uint32_t want[3];
    } cases[] = {
        { 0, 5.0, "auto", { 4, 2, 4 } },  /* only the edge into the slow device */
        { 0, 11.0, "auto", { 4, 4, 4 } }, /* 10.24 ms is not above 11 */
        { 4, 5.0, "f32", { 4, 4, 4 } },
        { 2, 5.0, "f16", { 2, 2, 4 } },
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        struct kvs_plan_targets t = kvs_plan_default_targets();
        assert_int_equal(t.boundary_bytes, 0); /* auto by default */
        t.ctx = 64;
        t.boundary_bytes = cases[c].boundary_bytes;
        t.f16_above_ms = cases[c].above_ms;
        assert_true(kvs_plan_evaluate(m, inv, &t, ranks, 3, res) > 0);
        char *json = NULL;
        assert_int_equal(kvs_plan_manifest_json(m, inv, &t, res, "x.gguf", NULL, &json), KVS_OK);
        assert_int_equal(kvs_manifest_parse(json, strlen(json), mf, g_err, sizeof g_err), KVS_OK);
        assert_non_null(strstr(json, cases[c].targets));
        free(json);
        assert_int_equal(mf->boundary_bytes, cases[c].boundary_bytes);
        for (size_t r = 0; r < 3; r++) {
            if (res->ranks[r].boundary_bytes != cases[c].want[r] || mf->ranks[r].boundary_bytes != cases[c].want[r])
                fail_msg("case %zu rank %zu: plan %u, manifest %u bytes, want %u", c, r, res->ranks[r].boundary_bytes,
                         mf->ranks[r].boundary_bytes, cases[c].want[r]);
        }
    }
    /* the f16 hop costs rtt 1 ms (the default) / 2 + 64 * 2 bytes at 0.2 Mbit/s = 0.5 + 5.12 ms */
    struct kvs_plan_targets t = kvs_plan_default_targets();
    t.ctx = 64;
    assert_true(kvs_plan_evaluate(m, inv, &t, ranks, 3, res) > 0);
    assert_true(res->ranks[1].hop_ms > 5.62 - 1e-9 && res->ranks[1].hop_ms < 5.62 + 1e-9);
    /* the reader: a rank's field, absent = 0, bad values named */
    const char *own = MF_HEAD MF_TARGETS("128", "1", "\"auto\"")
        "\"ranks\": [{\"rank\": 0, \"window\": [0, 2], \"listen\": \"h:1\", \"next\": \"h:2\", \"boundary\": \"f16\"},"
        "{\"rank\": 1, \"window\": [2, 4], \"listen\": \"h:2\", \"next\": \"h:1\"}]}";
    assert_int_equal(kvs_manifest_parse(own, strlen(own), mf, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(mf->boundary_bytes, 0);
    assert_int_equal(mf->ranks[0].boundary_bytes, 2);
    assert_int_equal(mf->ranks[1].boundary_bytes, 0);
    const char *bad = MF_HEAD
        "\"ranks\": [{\"rank\": 0, \"window\": [0, 2], \"listen\": \"h:1\", \"next\": \"h:2\"},"
        "{\"rank\": 1, \"window\": [2, 4], \"listen\": \"h:2\", \"next\": \"h:1\", \"boundary\": \"auto\"}]}";
    assert_int_equal(kvs_manifest_parse(bad, strlen(bad), mf, g_err, sizeof g_err), KVS_ERR_FORMAT);
    assert_non_null(strstr(g_err, "ranks[1].boundary"));
    free(mf);
    free(res);
    free(inv);
    free(m);
    kvs_gguf_close(g);
}

static void test_manifest_relay(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/aidreams260K.gguf", shared ? shared : "../shared");
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_model *m = NULL;
    assert_int_equal(kvs_plan_model_from_gguf(g, &m, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *res = malloc(sizeof *res);
    struct kvs_manifest *mf = malloc(sizeof *mf);
    const char *doc = "{\"relay\": {\"rtt_ms\": 1, \"url\": \"wss://10.0.0.9:443\"}, \"devices\": ["
                      " {\"name\": \"a\", \"mem_bytes\": 1450000, \"decode_gbps\": 20, \"addr\": \"10.0.0.1:7001\"},"
                      " {\"name\": \"b\", \"mem_bytes\": 1450000, \"decode_gbps\": 10, \"addr\": \"10.0.0.2:7001\"},"
                      " {\"name\": \"phone\", \"mem_bytes\": 1450000, \"decode_gbps\": 5, \"accepts_inbound\": false},"
                      " {\"name\": \"d\", \"mem_bytes\": 1450000, \"decode_gbps\": 2, \"addr\": \"10.0.0.4:7001\"}]}";
    assert_int_equal(inv_parse(doc, inv), KVS_OK);
    assert_string_equal(inv->relay_url, "wss://10.0.0.9:443");
    struct kvs_plan_targets t = kvs_plan_default_targets();
    t.ctx = 128;
    assert_int_equal(kvs_plan_solve(m, inv, &t, res, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(res->n_ranks, 4);
    char *json = NULL;
    assert_int_equal(kvs_plan_manifest_json(m, inv, &t, res, "x.gguf", NULL, &json), KVS_ERR_ARG); /* no secret */
    const char secret[] = "planner-test-secret-0123";
    memcpy(inv->relay_secret, secret, sizeof secret - 1);
    inv->relay_secret_len = sizeof secret - 1;
    assert_int_equal(kvs_plan_manifest_json(m, inv, &t, res, "x.gguf", NULL, &json), KVS_OK);
    assert_int_equal(kvs_manifest_parse(json, strlen(json), mf, g_err, sizeof g_err), KVS_OK);
    free(json);
    size_t phone = 4;
    for (size_t r = 0; r < 4; r++)
        if (!strcmp(mf->ranks[r].device, "phone")) phone = r;
    assert_true(phone < 4);
    size_t prev = (phone + 3) % 4, next = (phone + 1) % 4;
    int relayed = 0;
    for (size_t r = 0; r < 4; r++) {
        bool url = kvs_ws_is_url(mf->ranks[r].listen);
        assert_int_equal(url, r == phone || r == next); /* the edges into and out of the phone */
        if (!url) continue;
        relayed++;
        struct kvs_ws_url u;
        assert_int_equal(kvs_ws_url_parse(mf->ranks[r].listen, &u, g_err, sizeof g_err), KVS_OK);
        assert_true(u.tls);
        assert_string_equal(u.host, "10.0.0.9");
        assert_int_equal(u.port, 443);
        assert_int_equal(strlen(u.edge), 25);
        char tok[65];
        assert_int_equal(kvs_relay_token(secret, sizeof secret - 1, u.edge, tok), KVS_OK);
        assert_string_equal(u.token, tok);
    }
    assert_int_equal(relayed, 2);
    assert_string_equal(mf->ranks[prev].next, mf->ranks[phone].listen);
    assert_string_equal(mf->ranks[phone].next, mf->ranks[next].listen);
    assert_string_not_equal(mf->ranks[phone].listen, mf->ranks[next].listen); /* two edges, two ids */
    /* no relay URL in the inventory */
    inv->relay_url[0] = '\0';
    assert_int_equal(kvs_plan_manifest_json(m, inv, &t, res, "x.gguf", NULL, &json), KVS_ERR_ARG);
    /* the reader refuses a relay URL without its token, and a bad relay url in the inventory */
    const char *bad = "{\"relay\": {\"url\": \"wss://h/edge/x\"}, \"devices\": [{\"name\": \"a\", \"mem_bytes\": 5, \"decode_gbps\": 1}]}";
    assert_int_equal(inv_parse(bad, inv), KVS_ERR_FORMAT);
    free(inv);
    free(res);
    free(mf);
    free(m);
    kvs_gguf_close(g);
}

/* Profile of a real file: qwen3-q8_0.gguf (models/README.md: 4 blocks,
 * n_embd 128, 4 heads of 64, 2 KV heads, FFN 384, tied output, Q8_0). */
static void test_profile_qwen3_tied(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/qwen3-q8_0.gguf", shared ? shared : "../shared");
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_open(path, &g, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_model *m = NULL;
    assert_int_equal(kvs_plan_model_from_gguf(g, &m, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(m->n_block, 4);
    assert_int_equal(m->n_embd, 128);
    /* 2 (K, V) * 2 KV heads * 64 * 2 bytes */
    assert_int_equal(m->block_kv_bytes[0], 512);
    const struct kvs_gguf_tensor *embd = kvs_gguf_find_tensor(g, "token_embd.weight");
    assert_non_null(embd);
    assert_null(kvs_gguf_find_tensor(g, "output.weight"));
    assert_int_equal(m->head_bytes, embd->bytes);
    assert_int_equal(m->tied_bytes, embd->bytes);
    /* tail: output_norm (128 F32) + the tied embedding */
    assert_int_equal(m->tail_bytes, 512 + embd->bytes);
    assert_int_equal(m->n_vocab, embd->ne[1]);
    /* Block 0 by hand: q {128,256}, k/v {128,128}, o {256,128}, gate/up {128,384},
     * down {384,128} in Q8_0 (34 bytes / 32); norms attn/ffn 128 F32, q/k norm 64 F32. */
    uint64_t q8 = (128 * 256 + 2 * 128 * 128 + 256 * 128 + 3 * 128 * 384) / 32 * 34;
    uint64_t f = (2 * 128 + 2 * 64) * 4;
    assert_int_equal(m->block_weight_bytes[0], q8 + f);
    assert_int_equal(m->block_stream_bytes[0], q8 + f);
    /* Single device: the tied embedding is held once. */
    uint64_t whole = kvs_plan_window_mem(m, &(struct kvs_plan_targets){ .ctx = 1, .seqs = 1, .ubatch = 1 }, 0, 4);
    uint64_t blocks = 0;
    for (int b = 0; b < 4; b++)
        blocks += m->block_weight_bytes[b] + 512;
    assert_int_equal(whole, blocks + m->common_bytes + embd->bytes + 512 + 128 * 4 * 8 + m->n_vocab * 4);
    free(m);
    kvs_gguf_close(g);
}

/* Header over HTTP ranges from the shard module's seed server: the profile
 * equals the one from the file. */
static void test_fetch_header(void **state)
{
    (void)state;
    const char *shared = getenv("KVASIR_SHARED");
    char dir[1024], path[1100];
    snprintf(dir, sizeof dir, "%s/models", shared ? shared : "../shared");
    snprintf(path, sizeof path, "%s/llama-q4_k_m.gguf", dir);
    struct kvs_seed_params sp = kvs_seed_default_params();
    sp.dir = dir;
    sp.port = 0;
    struct kvs_seed *seed = NULL;
    assert_int_equal(kvs_seed_start(&sp, &seed, g_err, sizeof g_err), KVS_OK);
    char url[256];
    snprintf(url, sizeof url, "http://127.0.0.1:%u/llama-q4_k_m.gguf", kvs_seed_port(seed));
    uint8_t *buf = NULL;
    struct kvs_gguf *hg = NULL, *fg = NULL;
    kvs_err e = kvs_plan_fetch_header(url, &buf, &hg, g_err, sizeof g_err);
    if (e)
        fail_msg("fetch: %s (%s)", kvs_strerror(e), g_err);
    assert_int_equal(kvs_gguf_open(path, &fg, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(kvs_gguf_file_size(hg), kvs_gguf_file_size(fg));
    struct kvs_plan_model *a = NULL, *b = NULL;
    assert_int_equal(kvs_plan_model_from_gguf(hg, &a, g_err, sizeof g_err), KVS_OK);
    assert_int_equal(kvs_plan_model_from_gguf(fg, &b, g_err, sizeof g_err), KVS_OK);
    assert_memory_equal(a, b, sizeof *a);
    assert_int_equal(a->n_block, 3);
    assert_int_equal(strlen(a->fingerprint), 64);
    /* A missing file is a network error, not a crash. */
    snprintf(url, sizeof url, "http://127.0.0.1:%u/nope.gguf", kvs_seed_port(seed));
    uint8_t *buf2 = NULL;
    struct kvs_gguf *g2 = NULL;
    assert_int_equal(kvs_plan_fetch_header(url, &buf2, &g2, g_err, sizeof g_err), KVS_ERR_NET);
    assert_null(g2);
    free(a);
    free(b);
    kvs_gguf_close(hg);
    kvs_gguf_close(fg);
    free(buf);
    kvs_seed_stop(seed);
}

/* File errors name no path (the CLI prefixes it once: no "x.json: x.json: ..."),
 * and a model without tensors is refused rather than planned as 0 bytes. */
static void test_load_errors_and_empty_model(void **state)
{
    (void)state;
    struct kvs_manifest *mf = calloc(1, sizeof *mf);
    assert_non_null(mf);
    g_err[0] = '\0';
    assert_int_equal(kvs_manifest_load("/nonexistent/ring.json", mf, g_err, sizeof g_err), KVS_ERR_IO);
    assert_null(strstr(g_err, "/nonexistent"));
    assert_non_null(strstr(g_err, "No such file"));
    free(mf);
    struct kvs_plan_inventory *inv = calloc(1, sizeof *inv);
    assert_non_null(inv);
    assert_int_equal(kvs_plan_inventory_load("/nonexistent/dev.json", inv, g_err, sizeof g_err), KVS_ERR_IO);
    assert_null(strstr(g_err, "/nonexistent"));
    free(inv);

    const char *shared = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/aidreams260K.gguf", shared ? shared : "../shared");
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static uint8_t buf[1 << 21];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    assert_true(n > 24);
    memset(buf + 8, 0, 8); /* tensor count 0 */
    struct kvs_gguf *g = NULL;
    assert_int_equal(kvs_gguf_parse(buf, n, n, &g, NULL, g_err, sizeof g_err), KVS_OK);
    struct kvs_plan_model *m = (struct kvs_plan_model *)1;
    assert_int_equal(kvs_plan_model_from_gguf(g, &m, g_err, sizeof g_err), KVS_ERR_NOT_FOUND);
    assert_null(m);
    assert_non_null(strstr(g_err, "token_embd.weight"));
    kvs_gguf_close(g);
}


/* Node keys: an inventory's "key" (64 hex digits, stored lower-case), the
 * manifest's ranks[].key; malformed keys and a ring keyed only in part are
 * refused, naming the field. */
static void test_keys(void **state)
{
    (void)state;
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_manifest *mf = malloc(sizeof *mf);
    assert_non_null(inv);
    assert_non_null(mf);
    const char *k0 = "92E10D91E849E8261755D344C11779E6883221768F5FAC079CD0B47051FE049A";
    char doc[1024];
    snprintf(doc, sizeof doc, "[{\"name\": \"x\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"key\": \"%s\"},"
             "{\"name\": \"y\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"key\": null}]", k0);
    assert_int_equal(inv_parse(doc, inv), KVS_OK);
    assert_string_equal(inv->devices[0].key, "92e10d91e849e8261755d344c11779e6883221768f5fac079cd0b47051fe049a");
    assert_string_equal(inv->devices[1].key, "");
    assert_int_equal(inv_parse("[{\"name\": \"x\", \"mem_bytes\": 5, \"decode_gbps\": 1, \"key\": \"abc\"}]", inv),
                     KVS_ERR_FORMAT);
    assert_non_null(strstr(g_err, "\"key\""));
#define KR(r, a, b, l, n, key) \
    "{\"rank\": " #r ", \"window\": [" #a ", " #b "], \"listen\": \"h:" #l "\", \"next\": \"h:" #n "\"" key "}"
#define K1 ", \"key\": \"1111111111111111111111111111111111111111111111111111111111111111\""
#define K2 ", \"key\": \"2222222222222222222222222222222222222222222222222222222222222222\""
    const char *both = "{\"kvasir_manifest\": 1, \"model\": {\"path\": \"m\", \"n_block\": 4}, \"ranks\": ["
                       KR(0, 0, 2, 7, 8, K1) "," KR(1, 2, 4, 8, 7, K2) "]}";
    assert_int_equal(kvs_manifest_parse(both, strlen(both), mf, g_err, sizeof g_err), KVS_OK);
    assert_string_equal(mf->ranks[0].key, "1111111111111111111111111111111111111111111111111111111111111111");
    assert_string_equal(mf->ranks[1].key, "2222222222222222222222222222222222222222222222222222222222222222");
    const char *part = "{\"kvasir_manifest\": 1, \"model\": {\"path\": \"m\", \"n_block\": 4}, \"ranks\": ["
                       KR(0, 0, 2, 7, 8, K1) "," KR(1, 2, 4, 8, 7, "") "]}";
    assert_int_equal(kvs_manifest_parse(part, strlen(part), mf, g_err, sizeof g_err), KVS_ERR_FORMAT);
    assert_string_equal(g_err, "manifest: 1 of 2 ranks have a \"key\": a keyed ring needs every rank's key");
    const char *bad = "{\"kvasir_manifest\": 1, \"model\": {\"path\": \"m\", \"n_block\": 4}, \"ranks\": ["
                      KR(0, 0, 2, 7, 8, ", \"key\": \"zz\"") "," KR(1, 2, 4, 8, 7, K2) "]}";
    assert_int_equal(kvs_manifest_parse(bad, strlen(bad), mf, g_err, sizeof g_err), KVS_ERR_FORMAT);
    assert_string_equal(g_err, "manifest: ranks[0].key must be a node public key: 64 hex digits");
#undef KR
#undef K1
#undef K2
    free(inv);
    free(mf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_inventory_ok),       cmocka_unit_test(test_inventory_errors),
        cmocka_unit_test(test_manifest_parse),     cmocka_unit_test(test_profile_qwen3_tied),
        cmocka_unit_test(test_fetch_header),       cmocka_unit_test(test_load_errors_and_empty_model),
        cmocka_unit_test(test_manifest_strict),    cmocka_unit_test(test_default_ctx_from_model),
        cmocka_unit_test(test_manifest_relay),     cmocka_unit_test(test_manifest_edge_boundary),
        cmocka_unit_test(test_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

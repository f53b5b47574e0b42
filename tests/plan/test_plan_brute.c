/* The planner's DP against brute force: on random small instances the
 * solver's token_ms equals the minimum over every ordered subset of devices
 * and every split of the blocks into contiguous windows, with the cost and
 * memory model written out again here (docs/PLAN.md "Cost model"),
 * independently of plan_solve.c. Plus infeasible inventories with
 * hand-computed shortfalls. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "plan/plan.h"

/* xorshift64*: deterministic instances. */
static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }
/* No libm: the test links only kvs_plan. */
static double dmax(double a, double b) { return a > b ? a : b; }
static double dmin(double a, double b) { return a < b ? a : b; }
static double dabs(double a) { return a < 0 ? -a : a; }
static uint64_t rng_range(uint64_t *s, uint64_t lo, uint64_t hi) { return lo + rng_next(s) % (hi - lo + 1); }

/* --- the cost model, written out independently ------------------------------ */

static uint64_t bf_mem(const struct kvs_plan_model *m, const struct kvs_plan_targets *t, uint32_t a, uint32_t b)
{
    uint64_t w = m->common_bytes, kv = 0;
    for (uint32_t i = a; i < b; i++) {
        w += m->block_weight_bytes[i];
        kv += m->block_kv_bytes[i];
    }
    if (a == 0)
        w += m->head_bytes;
    if (b == m->n_block)
        w += m->tail_bytes;
    if (a == 0 && b == m->n_block)
        w -= m->tied_bytes;
    uint64_t buf = (uint64_t)t->ubatch * m->n_embd * 4 * 8;
    if (b == m->n_block)
        buf += (uint64_t)t->seqs * m->n_vocab * 4;
    return w + kv * t->ctx * t->seqs + buf;
}

static double bf_compute(const struct kvs_plan_model *m, const struct kvs_plan_targets *t,
                         const struct kvs_plan_device *d, uint32_t a, uint32_t b)
{
    double bytes = 0;
    for (uint32_t i = a; i < b; i++)
        bytes += (double)m->block_stream_bytes[i];
    if (a == 0)
        bytes += (double)m->head_stream_bytes;
    if (b == m->n_block)
        bytes += (double)m->tail_stream_bytes;
    /* GB/s = 1e9 bytes per 1000 ms. */
    return bytes / (d->decode_gbps * 1e9) * 1000.0 + (b - a) * t->block_overhead_ms;
}

static double bf_hop(const struct kvs_plan_inventory *inv, const struct kvs_plan_device *x,
                     const struct kvs_plan_device *y, double bytes)
{
    double rtt = dmax(x->rtt_ms, y->rtt_ms);
    if (!x->accepts_inbound || !y->accepts_inbound)
        rtt += inv->relay_rtt_ms;
    double bits_per_ms = dmin(x->bandwidth_mbps, y->bandwidth_mbps) * 1e6 / 1000.0;
    return rtt / 2 + bytes * 8 / bits_per_ms;
}

/* Boundary bytes of the edge x -> y (docs/PLAN.md): the targets' precision,
 * or auto: f16 where an f32 row takes longer than f16_above_ms to send. */
static double bf_edge_bytes(const struct kvs_plan_model *m, const struct kvs_plan_targets *t,
                            const struct kvs_plan_device *x, const struct kvs_plan_device *y)
{
    if (t->boundary_bytes)
        return (double)m->n_embd * t->boundary_bytes;
    double bits_per_ms = dmin(x->bandwidth_mbps, y->bandwidth_mbps) * 1e6 / 1000.0;
    return (double)m->n_embd * ((double)m->n_embd * 32 / bits_per_ms > t->f16_above_ms ? 2 : 4);
}

/* Minimum over arrangements (ordered subsets) and compositions. */
static double brute(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                    const struct kvs_plan_targets *t)
{
    const uint32_t n = m->n_block;
    const size_t k = inv->n_devices;
    double best = INFINITY;
    size_t seq[8];
    /* Enumerate sequences of distinct devices as k-ary counters of length len. */
    for (size_t len = 1; len <= k && len <= n; len++) {
        size_t total = 1;
        for (size_t i = 0; i < len; i++)
            total *= k;
        for (size_t code = 0; code < total; code++) {
            size_t c = code;
            bool ok = true;
            for (size_t i = 0; i < len; i++) {
                seq[i] = c % k;
                c /= k;
                for (size_t j = 0; j < i; j++)
                    if (seq[j] == seq[i])
                        ok = false;
            }
            if (!ok)
                continue;
            /* Cut sets: masks over the n-1 inner boundaries with len-1 bits. */
            for (uint32_t mask = 0; mask < (1u << (n - 1)); mask++) {
                if ((size_t)__builtin_popcount(mask) != len - 1)
                    continue;
                uint32_t cuts[9], nc = 0;
                cuts[nc++] = 0;
                for (uint32_t bpos = 1; bpos < n; bpos++)
                    if (mask & (1u << (bpos - 1)))
                        cuts[nc++] = bpos;
                cuts[nc++] = n;
                double cost = 0;
                bool fits = true;
                for (size_t r = 0; r < len; r++) {
                    const struct kvs_plan_device *d = &inv->devices[seq[r]];
                    if (bf_mem(m, t, cuts[r], cuts[r + 1]) > d->mem_bytes) {
                        fits = false;
                        break;
                    }
                    cost += bf_compute(m, t, d, cuts[r], cuts[r + 1]);
                    if (len > 1) {
                        if (r + 1 < len)
                            cost += bf_hop(inv, d, &inv->devices[seq[r + 1]],
                                           bf_edge_bytes(m, t, d, &inv->devices[seq[r + 1]]));
                        else
                            cost += bf_hop(inv, d, &inv->devices[seq[0]], 4.0);
                    }
                }
                if (fits && cost < best)
                    best = cost;
            }
        }
    }
    return best;
}

static void random_instance(uint64_t *s, struct kvs_plan_model *m, struct kvs_plan_inventory *inv,
                            struct kvs_plan_targets *t)
{
    memset(m, 0, sizeof *m);
    memset(inv, 0, sizeof *inv);
    *t = kvs_plan_default_targets();
    m->n_block = (uint32_t)rng_range(s, 6, 10);
    for (uint32_t i = 0; i < m->n_block; i++) {
        m->block_weight_bytes[i] = rng_range(s, 1000000, 10000000);
        m->block_stream_bytes[i] = m->block_weight_bytes[i] / rng_range(s, 1, 4);
        m->block_kv_bytes[i] = rng_range(s, 0, 2048);
    }
    m->n_embd = (uint32_t)rng_range(s, 64, 4096);
    m->n_vocab = (uint32_t)rng_range(s, 100, 50000);
    m->common_bytes = rng_range(s, 0, 1000);
    m->head_bytes = rng_range(s, 0, 5000000);
    m->head_stream_bytes = m->n_embd * 2;
    m->tail_bytes = rng_range(s, 0, 5000000);
    m->tail_stream_bytes = m->tail_bytes;
    if (rng_next(s) % 3 == 0)
        m->tied_bytes = m->tail_bytes < m->head_bytes ? m->tail_bytes : m->head_bytes;
    t->ctx = (uint32_t)rng_range(s, 1, 2048);
    t->seqs = (uint32_t)rng_range(s, 1, 4);
    t->boundary_bytes = (uint32_t)(rng_next(s) % 3) * 2; /* auto, f16, f32 */
    t->f16_above_ms = rng_unit(s) * 2;
    t->ubatch = (uint32_t)rng_range(s, 1, 64);
    t->block_overhead_ms = rng_unit(s) * 0.1;
    inv->relay_rtt_ms = rng_unit(s) * 50;
    inv->n_devices = (size_t)rng_range(s, 2, 4);
    for (size_t d = 0; d < inv->n_devices; d++) {
        struct kvs_plan_device *dv = &inv->devices[d];
        snprintf(dv->name, sizeof dv->name, "dev%zu", d);
        dv->mem_bytes = rng_range(s, 5000000, 60000000);
        dv->decode_gbps = 0.5 + rng_unit(s) * 100;
        dv->rtt_ms = rng_unit(s) * 5;
        dv->bandwidth_mbps = 10 + rng_unit(s) * 10000;
        dv->accepts_inbound = rng_next(s) % 4 != 0;
        dv->threads = 1;
    }
}

static void test_dp_equals_brute_force(void **state)
{
    (void)state;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    struct kvs_plan_model *m = malloc(sizeof *m);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *res = malloc(sizeof *res);
    assert_non_null(m);
    assert_non_null(inv);
    assert_non_null(res);
    int feasible = 0, infeasible = 0, multi = 0, excluded = 0, f16_edges = 0, f32_edges = 0;
    for (int it = 0; it < 200; it++) {
        struct kvs_plan_targets t;
        random_instance(&s, m, inv, &t);
        double want = brute(m, inv, &t);
        char err[256] = "";
        kvs_err e = kvs_plan_solve(m, inv, &t, res, err, sizeof err);
        if (want == INFINITY) {
            assert_int_equal(e, KVS_ERR_INFEASIBLE);
            infeasible++;
            continue;
        }
        if (e != KVS_OK)
            fail_msg("instance %d: solver says %s (%s) but brute force found %.9f ms", it, kvs_strerror(e), err,
                     want);
        assert_true(res->exhaustive);
        if (dabs(res->token_ms - want) > 1e-9 * dmax(1.0, want))
            fail_msg("instance %d: solver %.12f ms, brute force %.12f ms", it, res->token_ms, want);
        /* The reported placement itself: contiguous, in memory, and its cost
         * recomputed here equals token_ms. */
        double cost = 0;
        uint32_t at = 0;
        for (size_t r = 0; r < res->n_ranks; r++) {
            const struct kvs_plan_rank *rk = &res->ranks[r];
            const struct kvs_plan_device *d = &inv->devices[rk->device];
            assert_int_equal(rk->begin, at);
            assert_true(rk->end > rk->begin);
            at = rk->end;
            assert_true(bf_mem(m, &t, rk->begin, rk->end) <= d->mem_bytes);
            assert_int_equal(rk->weights_bytes + rk->kv_bytes + rk->buffer_bytes, bf_mem(m, &t, rk->begin, rk->end));
            cost += bf_compute(m, &t, d, rk->begin, rk->end);
            const struct kvs_plan_device *dn = &inv->devices[res->ranks[(r + 1) % res->n_ranks].device];
            if (res->n_ranks > 1)
                cost += bf_hop(inv, d, dn, r + 1 < res->n_ranks ? bf_edge_bytes(m, &t, d, dn) : 4.0);
            if (r + 1 < res->n_ranks) {
                assert_true(rk->boundary_bytes == 2 || rk->boundary_bytes == 4);
                assert_true((double)m->n_embd * rk->boundary_bytes == bf_edge_bytes(m, &t, d, dn));
                f16_edges += rk->boundary_bytes == 2;
                f32_edges += rk->boundary_bytes == 4;
            } else {
                assert_int_equal(rk->boundary_bytes, 4);
            }
        }
        assert_int_equal(at, m->n_block);
        assert_true(dabs(cost - res->token_ms) <= 1e-9 * dmax(1.0, cost));
        feasible++;
        multi += res->n_ranks > 1;
        excluded += res->n_ranks < inv->n_devices;
    }
    /* The generator must exercise every case. */
    printf("brute force: %d feasible (%d multi-rank, %d with exclusions), %d infeasible; %d f16 / %d f32 edges\n",
           feasible, multi, excluded, infeasible, f16_edges, f32_edges);
    assert_true(f16_edges >= 10 && f32_edges >= 10);
    assert_true(feasible >= 100);
    assert_true(multi >= 50);
    assert_true(excluded >= 10);
    assert_true(infeasible >= 5);
    free(m);
    free(inv);
    free(res);
}

/* A tiny model: 4 blocks of 1000 bytes, head 100, tail 200, untied,
 * n_embd 4, n_vocab 8; targets ubatch 1, ctx 1, seqs 1 -> buffer
 * 1 * 4 * 4 * 8 = 128 bytes on every rank, logits 1 * 8 * 4 = 32 on the tail. */
static void tiny(struct kvs_plan_model *m, struct kvs_plan_inventory *inv, struct kvs_plan_targets *t)
{
    memset(m, 0, sizeof *m);
    memset(inv, 0, sizeof *inv);
    *t = kvs_plan_default_targets();
    t->ubatch = 1;
    t->ctx = 1;
    t->seqs = 1;
    m->n_block = 4;
    for (int i = 0; i < 4; i++) {
        m->block_weight_bytes[i] = 1000;
        m->block_stream_bytes[i] = 1000;
    }
    m->head_bytes = 100;
    m->tail_bytes = 200;
    m->n_embd = 4;
    m->n_vocab = 8;
    for (int d = 0; d < 2; d++) {
        snprintf(inv->devices[d].name, sizeof inv->devices[d].name, "d%d", d);
        inv->devices[d].mem_bytes = 1500;
        inv->devices[d].decode_gbps = 1;
        inv->devices[d].bandwidth_mbps = 100;
        inv->devices[d].accepts_inbound = true;
    }
    inv->n_devices = 2;
}

static void test_infeasible_total(void **state)
{
    (void)state;
    struct kvs_plan_model *m = malloc(sizeof *m);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result res;
    struct kvs_plan_targets t;
    tiny(m, inv, &t);
    char err[256];
    /* need = 4*1000 + 100 + 200 + 32 = 4332; capacity = 2 * (1500 - 128) = 2744. */
    assert_int_equal(kvs_plan_solve(m, inv, &t, &res, err, sizeof err), KVS_ERR_INFEASIBLE);
    assert_int_equal(res.shortfall_bytes, 1588);
    assert_non_null(strstr(err, "short by 1588 bytes"));
    /* KV: 3 bytes/token/block, ctx 10, seqs 2 -> 4 * 3 * 20 = 240 more. */
    for (int i = 0; i < 4; i++)
        m->block_kv_bytes[i] = 3;
    t.ctx = 10;
    t.seqs = 2;
    /* logits now 2 * 8 * 4 = 64: need = 4000 + 240 + 300 + 64 = 4604. */
    assert_int_equal(kvs_plan_solve(m, inv, &t, &res, err, sizeof err), KVS_ERR_INFEASIBLE);
    assert_int_equal(res.shortfall_bytes, 4604 - 2744);
    free(m);
    free(inv);
}

static void test_infeasible_block(void **state)
{
    (void)state;
    struct kvs_plan_model *m = malloc(sizeof *m);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result res;
    struct kvs_plan_targets t;
    tiny(m, inv, &t);
    /* Block 2: 5000 bytes + KV 10 * ctx 8 * seqs 2 = 160 + buffer 128 = 5288
     * needed; the largest device has 5000. */
    m->block_weight_bytes[2] = 5000;
    m->block_kv_bytes[2] = 10;
    t.ctx = 8;
    t.seqs = 2;
    inv->devices[1].mem_bytes = 5000;
    char err[256];
    assert_int_equal(kvs_plan_solve(m, inv, &t, &res, err, sizeof err), KVS_ERR_INFEASIBLE);
    assert_int_equal(res.shortfall_bytes, 288);
    assert_non_null(strstr(err, "block 2"));
    free(m);
    free(inv);
}

static void test_feasible_tiny_exact_cost(void **state)
{
    (void)state;
    struct kvs_plan_model *m = malloc(sizeof *m);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result res;
    struct kvs_plan_targets t;
    tiny(m, inv, &t);
    t.block_overhead_ms = 0.5;
    inv->devices[0].mem_bytes = 2500;
    inv->devices[1].mem_bytes = 2500;
    inv->devices[0].rtt_ms = 2;
    inv->devices[1].rtt_ms = 4;
    /* Each device holds 2 blocks at most (2 * 1000 + 100 + 128 = 2228 on the
     * head, 2000 + 200 + 128 + 32 = 2360 on the tail; 3 blocks > 2500).
     * Hence [0,2) + [2,4): compute = (2100 + 2200 stream bytes) / 1e6 ms
     * (1 GB/s) + 4 * 0.5 = 2.0043 ms; hops: max rtt 4 / 2 = 2 ms each plus
     * 16 bytes (4 values in f32: 0.00128 ms at 100 Mbit/s is far below the
     * 5 ms of auto) * 8 / 1e5 = 0.00128 ms and 4 * 8 / 1e5 = 0.00032 ms. */
    m->head_stream_bytes = 100;
    m->tail_stream_bytes = 200;
    char err[256];
    assert_int_equal(kvs_plan_solve(m, inv, &t, &res, err, sizeof err), KVS_OK);
    assert_int_equal(res.n_ranks, 2);
    assert_int_equal(res.ranks[0].end, 2);
    double want = 0.0043 + 2.0 + 2.0 + 2.0 + 0.00128 + 0.00032;
    assert_int_equal(res.ranks[0].boundary_bytes, 4);
    assert_true(dabs(res.token_ms - want) < 1e-12);
    assert_true(dabs(res.decode_tps_1 - 1000.0 / want) < 1e-9);
    free(m);
    free(inv);
}

/* Above the exhaustive limit the heuristic orders give a valid placement
 * that is never better than the exhaustive optimum (same instance, limit
 * raised) and, on these instances, close to it. */
static void test_heuristic_valid(void **state)
{
    (void)state;
    uint64_t s = 12345;
    struct kvs_plan_model *m = malloc(sizeof *m);
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *h = malloc(sizeof *h), *x = malloc(sizeof *x);
    assert_non_null(m);
    assert_non_null(inv);
    assert_non_null(h);
    assert_non_null(x);
    int solved = 0;
    double worst = 1.0;
    for (int it = 0; it < 12; it++) {
        struct kvs_plan_targets t;
        random_instance(&s, m, inv, &t);
        m->n_block = 6;
        inv->n_devices = 7;
        for (size_t d = 0; d < inv->n_devices; d++) {
            struct kvs_plan_device *dv = &inv->devices[d];
            snprintf(dv->name, sizeof dv->name, "dev%zu", d);
            dv->mem_bytes = rng_range(&s, 15000000, 60000000);
            dv->decode_gbps = 0.5 + rng_unit(&s) * 100;
            dv->rtt_ms = rng_unit(&s) * 5;
            dv->bandwidth_mbps = 10 + rng_unit(&s) * 10000;
            dv->accepts_inbound = rng_next(&s) % 4 != 0;
        }
        char err[256];
        t.exhaustive_limit = 1000; /* force the heuristic */
        kvs_err e1 = kvs_plan_solve(m, inv, &t, h, err, sizeof err);
        t.exhaustive_limit = UINT64_MAX;
        kvs_err e2 = kvs_plan_solve(m, inv, &t, x, err, sizeof err);
        assert_int_equal(e1, e2);
        if (e1)
            continue;
        assert_false(h->exhaustive);
        assert_true(x->exhaustive);
        assert_true(h->token_ms >= x->token_ms * (1 - 1e-12));
        double got = kvs_plan_evaluate(m, inv, &t, h->ranks, h->n_ranks, NULL);
        assert_true(dabs(got - h->token_ms) <= 1e-9 * h->token_ms);
        for (size_t r = 0; r < h->n_ranks; r++)
            assert_true(bf_mem(m, &t, h->ranks[r].begin, h->ranks[r].end) <=
                        inv->devices[h->ranks[r].device].mem_bytes);
        if (h->token_ms / x->token_ms > worst)
            worst = h->token_ms / x->token_ms;
        solved++;
    }
    printf("heuristic: %d instances, worst ratio to the optimum %.4f\n", solved, worst);
    assert_true(solved >= 6);
    assert_true(worst < 1.05);
    free(m);
    free(inv);
    free(h);
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dp_equals_brute_force),
        cmocka_unit_test(test_infeasible_total),
        cmocka_unit_test(test_infeasible_block),
        cmocka_unit_test(test_feasible_tiny_exact_cost),
        cmocka_unit_test(test_heuristic_valid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

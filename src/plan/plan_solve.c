/* The placement solver (cost model: plan.h and docs/PLAN.md "Cost model").
 *
 * What is exact and what is heuristic:
 *   - For one ring ORDER o[0..k-1] (o[0] is the head; any other device may be
 *     skipped), dp_order() is exact: it finds the minimum token_ms over every
 *     subsequence of the order that starts at o[0] and every partition of the
 *     blocks into non-empty contiguous windows, subject to memory. State:
 *     g[j][b] = least sum of compute + boundary hops with blocks [0,b) placed
 *     and o[j] the last used device (its window ends at b). O(k^2 n^2).
 *   - Every arrangement (ordered subset) of devices is a subsequence of some
 *     permutation starting with its head, so trying all k! permutations gives
 *     the global optimum of the cost model. That is done when
 *     k! * (n+1)^2 * k^2 <= targets.exhaustive_limit (about k <= 6 for 48
 *     blocks), and res->exhaustive says so.
 *   - Otherwise (heuristic): orders sorted by decode speed (fast first), by
 *     memory, and the reverse of speed, each with relay-only devices grouped
 *     at the end (adjacent, so fewer hops touch the relay), then pairwise
 *     swaps of the best order while they improve (bounded passes).
 */
#include "plan/plan.h"
#include "plan/plan_impl.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kvs_plan_targets kvs_plan_default_targets(void)
{
    struct kvs_plan_targets t = {
        .ctx = 4096,
        .seqs = 1,
        .boundary_bytes = 0,
        .f16_above_ms = 5.0,
        .ubatch = 512,
        .block_overhead_ms = 0.02,
        .token_bytes = 4,
        .exhaustive_limit = 200000000ull,
    };
    return t;
}

uint32_t kvs_plan_default_ctx(const struct kvs_plan_model *m)
{
    const uint32_t cap = kvs_plan_default_targets().ctx;
    return m->ctx_train && m->ctx_train < cap ? m->ctx_train : cap;
}

const char *kvs_plan_backend_name(enum kvs_plan_backend b)
{
    static const char *const names[KVS_PLAN_BACKEND_COUNT_] = { "cpu", "cuda", "metal", "vulkan", "opencl",
                                                                "npu" };
    if ((int)b < 0 || b >= KVS_PLAN_BACKEND_COUNT_)
        return "?";
    return names[b];
}

/* a * b, saturating at UINT64_MAX. */
static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    if (a != 0 && b > UINT64_MAX / a)
        return UINT64_MAX;
    return a * b;
}

static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return a > UINT64_MAX - b ? UINT64_MAX : a + b;
}

uint64_t kvs_plan_buffer_bytes(const struct kvs_plan_model *m, const struct kvs_plan_targets *t, bool tail)
{
    uint64_t b = mul_sat(mul_sat((uint64_t)t->ubatch, m->n_embd), 4 * 8);
    if (tail)
        b = add_sat(b, mul_sat(mul_sat(t->seqs, m->n_vocab), 4));
    return b;
}

/* Prefix sums over blocks: W (weights), S (stream), K (kv per token). */
struct prefix {
    uint32_t n;
    uint64_t *w, *s, *k, *r; /* weights, stream, KV per token, recurrent state per sequence */
};

static kvs_err prefix_init(struct prefix *p, const struct kvs_plan_model *m)
{
    p->n = m->n_block;
    p->w = calloc((size_t)m->n_block + 1, sizeof *p->w);
    p->s = calloc((size_t)m->n_block + 1, sizeof *p->s);
    p->k = calloc((size_t)m->n_block + 1, sizeof *p->k);
    p->r = calloc((size_t)m->n_block + 1, sizeof *p->r);
    if (!p->w || !p->s || !p->k || !p->r)
        return KVS_ERR_NOMEM;
    for (uint32_t i = 0; i < m->n_block; i++) {
        p->w[i + 1] = add_sat(p->w[i], m->block_weight_bytes[i]);
        p->s[i + 1] = add_sat(p->s[i], m->block_stream_bytes[i]);
        p->k[i + 1] = add_sat(p->k[i], m->block_kv_bytes[i]);
        p->r[i + 1] = add_sat(p->r[i], m->block_state_bytes[i]);
    }
    return KVS_OK;
}

static void prefix_free(struct prefix *p)
{
    free(p->w);
    free(p->s);
    free(p->k);
    free(p->r);
}

/* Bytes of window [a,b): weights (with extras), kv, buffers. */
static uint64_t win_weights(const struct kvs_plan_model *m, const struct prefix *p, uint32_t a, uint32_t b)
{
    uint64_t w = add_sat(p->w[b] - p->w[a], m->common_bytes);
    if (a == 0)
        w = add_sat(w, m->head_bytes);
    if (b == m->n_block)
        w = add_sat(w, a == 0 ? m->tail_bytes - m->tied_bytes : m->tail_bytes);
    return w;
}

static uint64_t win_kv(const struct kvs_plan_model *m, const struct prefix *p, const struct kvs_plan_targets *t,
                       uint32_t a, uint32_t b)
{
    (void)m;
    return mul_sat(add_sat(mul_sat(p->k[b] - p->k[a], t->ctx), p->r[b] - p->r[a]), t->seqs);
}

static uint64_t win_mem(const struct kvs_plan_model *m, const struct prefix *p, const struct kvs_plan_targets *t,
                        uint32_t a, uint32_t b)
{
    return add_sat(add_sat(win_weights(m, p, a, b), win_kv(m, p, t, a, b)),
                   kvs_plan_buffer_bytes(m, t, b == m->n_block));
}

uint64_t kvs_plan_window_mem(const struct kvs_plan_model *m, const struct kvs_plan_targets *t, uint32_t begin,
                             uint32_t end)
{
    struct prefix p = { 0 };
    uint64_t r = UINT64_MAX;
    if (end <= m->n_block && begin < end && prefix_init(&p, m) == KVS_OK)
        r = win_mem(m, &p, t, begin, end);
    prefix_free(&p);
    return r;
}

static double win_compute(const struct kvs_plan_model *m, const struct prefix *p,
                          const struct kvs_plan_targets *t, const struct kvs_plan_device *d, uint32_t a,
                          uint32_t b)
{
    double bytes = (double)(p->s[b] - p->s[a]);
    if (a == 0)
        bytes += (double)m->head_stream_bytes;
    if (b == m->n_block)
        bytes += (double)m->tail_stream_bytes;
    return bytes / (d->decode_gbps * 1e6) + (double)(b - a) * t->block_overhead_ms;
}

double kvs_plan_hop_ms(const struct kvs_plan_inventory *inv, const struct kvs_plan_device *x,
                       const struct kvs_plan_device *y, uint64_t bytes)
{
    double rtt = x->rtt_ms > y->rtt_ms ? x->rtt_ms : y->rtt_ms;
    if (!x->accepts_inbound || !y->accepts_inbound)
        rtt += inv->relay_rtt_ms;
    double bw = x->bandwidth_mbps < y->bandwidth_mbps ? x->bandwidth_mbps : y->bandwidth_mbps;
    return rtt / 2.0 + (double)bytes * 8.0 / (bw * 1e3);
}

uint32_t kvs_plan_edge_boundary_bytes(const struct kvs_plan_model *m, const struct kvs_plan_targets *t,
                                      const struct kvs_plan_device *x, const struct kvs_plan_device *y)
{
    if (t->boundary_bytes)
        return t->boundary_bytes;
    double bw = x->bandwidth_mbps < y->bandwidth_mbps ? x->bandwidth_mbps : y->bandwidth_mbps;
    double f32_ms = (double)m->n_embd * 4.0 * 8.0 / (bw * 1e3);
    return f32_ms > t->f16_above_ms ? 2 : 4;
}

static kvs_err check_args(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                          const struct kvs_plan_targets *t, char *errbuf, size_t errlen)
{
    if (m->n_block == 0 || m->n_block > KVS_PLAN_MAX_BLOCKS) {
        kvs_plan_seterr(errbuf, errlen, "model has %u blocks (1..%d allowed)", m->n_block, KVS_PLAN_MAX_BLOCKS);
        return KVS_ERR_ARG;
    }
    if (inv->n_devices == 0 || inv->n_devices > KVS_PLAN_MAX_DEVICES) {
        kvs_plan_seterr(errbuf, errlen, "inventory has %zu devices (1..%d allowed)", inv->n_devices,
                        KVS_PLAN_MAX_DEVICES);
        return KVS_ERR_ARG;
    }
    if (t->ctx == 0 || t->seqs == 0 || (t->boundary_bytes != 0 && t->boundary_bytes != 2 && t->boundary_bytes != 4) ||
        (t->boundary_bytes == 0 && !(t->f16_above_ms >= 0)) ||
        !(t->block_overhead_ms >= 0) || !(inv->relay_rtt_ms >= 0)) {
        kvs_plan_seterr(errbuf, errlen, "bad targets (ctx %u, seqs %u, boundary %u bytes)", t->ctx, t->seqs,
                        t->boundary_bytes);
        return KVS_ERR_ARG;
    }
    for (size_t i = 0; i < inv->n_devices; i++) {
        const struct kvs_plan_device *d = &inv->devices[i];
        if (!(d->decode_gbps > 0) || !(d->bandwidth_mbps > 0) || !(d->rtt_ms >= 0) || !isfinite(d->decode_gbps) ||
            !isfinite(d->bandwidth_mbps) || !isfinite(d->rtt_ms)) {
            kvs_plan_seterr(errbuf, errlen,
                            "device '%s': decode_gbps and bandwidth_mbps must be > 0 and rtt_ms >= 0", d->name);
            return KVS_ERR_ARG;
        }
    }
    return KVS_OK;
}

double kvs_plan_evaluate(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                         const struct kvs_plan_targets *t, const struct kvs_plan_rank *ranks, size_t n_ranks,
                         struct kvs_plan_result *res)
{
    if (n_ranks == 0 || n_ranks > KVS_PLAN_MAX_DEVICES || m->n_block == 0 || m->n_block > KVS_PLAN_MAX_BLOCKS)
        return -1.0;
    uint32_t at = 0;
    for (size_t i = 0; i < n_ranks; i++) {
        if (ranks[i].begin != at || ranks[i].end <= ranks[i].begin || ranks[i].end > m->n_block ||
            ranks[i].device >= inv->n_devices)
            return -1.0;
        for (size_t j = 0; j < i; j++)
            if (ranks[j].device == ranks[i].device)
                return -1.0;
        at = ranks[i].end;
    }
    if (at != m->n_block)
        return -1.0;
    struct prefix p = { 0 };
    if (prefix_init(&p, m) != KVS_OK) {
        prefix_free(&p);
        return -1.0;
    }
    double total = 0, max_stage = 0;
    struct kvs_plan_result tmp;
    struct kvs_plan_result *r = res ? res : &tmp;
    memset(r, 0, sizeof *r);
    r->n_ranks = n_ranks;
    for (size_t i = 0; i < n_ranks; i++) {
        struct kvs_plan_rank *rk = &r->ranks[i];
        *rk = ranks[i];
        const struct kvs_plan_device *d = &inv->devices[rk->device];
        rk->weights_bytes = win_weights(m, &p, rk->begin, rk->end);
        rk->kv_bytes = win_kv(m, &p, t, rk->begin, rk->end);
        rk->buffer_bytes = kvs_plan_buffer_bytes(m, t, rk->end == m->n_block);
        rk->compute_ms = win_compute(m, &p, t, d, rk->begin, rk->end);
        rk->boundary_bytes = 4;
        if (n_ranks == 1)
            rk->hop_ms = 0;
        else if (i + 1 < n_ranks) {
            const struct kvs_plan_device *dn = &inv->devices[ranks[i + 1].device];
            rk->boundary_bytes = kvs_plan_edge_boundary_bytes(m, t, d, dn);
            rk->hop_ms = kvs_plan_hop_ms(inv, d, dn, (uint64_t)m->n_embd * rk->boundary_bytes);
        } else
            rk->hop_ms = kvs_plan_hop_ms(inv, d, &inv->devices[ranks[0].device], t->token_bytes);
        total += rk->compute_ms + rk->hop_ms;
        if (rk->compute_ms > max_stage)
            max_stage = rk->compute_ms;
    }
    prefix_free(&p);
    r->token_ms = total;
    r->max_stage_ms = max_stage;
    r->seqs = t->seqs;
    r->decode_tps_1 = total > 0 ? 1000.0 / total : 0;
    double per = (double)t->seqs * max_stage;
    double denom = total > per ? total : per;
    r->decode_tps_seqs = denom > 0 ? 1000.0 * t->seqs / denom : 0;
    return total;
}

/* Working memory of the DP, allocated once per solve. */
struct dp {
    size_t k;
    uint32_t n;
    double *g;        /* [k][n+1] */
    int32_t *pj;      /* parent device position */
    uint32_t *pb;     /* parent block boundary */
};

#define G(dp, j, b) ((dp)->g[(size_t)(j) * ((dp)->n + 1) + (b)])
#define PJ(dp, j, b) ((dp)->pj[(size_t)(j) * ((dp)->n + 1) + (b)])
#define PB(dp, j, b) ((dp)->pb[(size_t)(j) * ((dp)->n + 1) + (b)])

/* Exact DP for one order (see the top of this file). Writes the best
 * placement into ranks/n_ranks and returns its token_ms, or INFINITY if no
 * placement with head order[0] fits. */
static double dp_order(struct dp *dp, const struct kvs_plan_model *m, const struct prefix *p,
                       const struct kvs_plan_inventory *inv, const struct kvs_plan_targets *t,
                       const size_t *order, struct kvs_plan_rank *ranks, size_t *n_ranks)
{
    const size_t k = dp->k;
    const uint32_t n = dp->n;
    for (size_t i = 0; i < k * ((size_t)n + 1); i++)
        dp->g[i] = INFINITY;
    const struct kvs_plan_device *d0 = &inv->devices[order[0]];
    for (uint32_t b = 1; b <= n; b++) {
        if (win_mem(m, p, t, 0, b) > d0->mem_bytes)
            break; /* memory grows with b */
        G(dp, 0, b) = win_compute(m, p, t, d0, 0, b);
        PJ(dp, 0, b) = -1;
        PB(dp, 0, b) = 0;
    }
    for (size_t jn = 1; jn < k; jn++) {
        const struct kvs_plan_device *dn = &inv->devices[order[jn]];
        for (size_t j = 0; j < jn; j++) {
            const struct kvs_plan_device *dj = &inv->devices[order[j]];
            double hop = kvs_plan_hop_ms(inv, dj, dn, (uint64_t)m->n_embd * kvs_plan_edge_boundary_bytes(m, t, dj, dn));
            for (uint32_t b = 1; b < n; b++) {
                double base = G(dp, j, b);
                if (base == INFINITY)
                    continue;
                base += hop;
                for (uint32_t bn = b + 1; bn <= n; bn++) {
                    if (win_mem(m, p, t, b, bn) > dn->mem_bytes)
                        break;
                    double c = base + win_compute(m, p, t, dn, b, bn);
                    if (c < G(dp, jn, bn)) {
                        G(dp, jn, bn) = c;
                        PJ(dp, jn, bn) = (int32_t)j;
                        PB(dp, jn, bn) = b;
                    }
                }
            }
        }
    }
    double best = INFINITY;
    size_t best_j = 0;
    for (size_t j = 0; j < k; j++) {
        double c = G(dp, j, n);
        if (c == INFINITY)
            continue;
        if (j > 0)
            c += kvs_plan_hop_ms(inv, &inv->devices[order[j]], d0, t->token_bytes);
        if (c < best) {
            best = c;
            best_j = j;
        }
    }
    if (best == INFINITY)
        return best;
    /* Walk the parents back from (best_j, n). */
    size_t cnt = 0;
    struct kvs_plan_rank rev[KVS_PLAN_MAX_DEVICES];
    int32_t j = (int32_t)best_j;
    uint32_t b = n;
    while (j >= 0 && cnt < KVS_PLAN_MAX_DEVICES) {
        uint32_t a = PB(dp, j, b);
        memset(&rev[cnt], 0, sizeof rev[cnt]);
        rev[cnt].device = order[j];
        rev[cnt].begin = a;
        rev[cnt].end = b;
        cnt++;
        int32_t pj = PJ(dp, j, b);
        j = pj;
        b = a;
    }
    for (size_t i = 0; i < cnt; i++)
        ranks[i] = rev[cnt - 1 - i];
    *n_ranks = cnt;
    return best;
}

/* Runs the DP on order, keeping the best result. */
static void try_order(struct dp *dp, const struct kvs_plan_model *m, const struct prefix *p,
                      const struct kvs_plan_inventory *inv, const struct kvs_plan_targets *t, const size_t *order,
                      double *best, struct kvs_plan_rank *best_ranks, size_t *best_n)
{
    struct kvs_plan_rank ranks[KVS_PLAN_MAX_DEVICES];
    size_t nr = 0;
    double c = dp_order(dp, m, p, inv, t, order, ranks, &nr);
    if (c < *best) {
        *best = c;
        memcpy(best_ranks, ranks, nr * sizeof ranks[0]);
        *best_n = nr;
    }
}

/* Next lexicographic permutation of a[0..k); false after the last. */
static bool next_perm(size_t *a, size_t k)
{
    if (k < 2)
        return false;
    size_t i = k - 1;
    while (i > 0 && a[i - 1] >= a[i])
        i--;
    if (i == 0)
        return false;
    size_t j = k - 1;
    while (a[j] <= a[i - 1])
        j--;
    size_t tmp = a[i - 1];
    a[i - 1] = a[j];
    a[j] = tmp;
    for (size_t l = i, r = k - 1; l < r; l++, r--) {
        tmp = a[l];
        a[l] = a[r];
        a[r] = tmp;
    }
    return true;
}

/* Sort keys for the heuristic orders. */
enum order_key { ORDER_SPEED_DESC, ORDER_MEM_DESC, ORDER_SPEED_ASC };

static void make_order(const struct kvs_plan_inventory *inv, enum order_key key, size_t *o)
{
    size_t k = inv->n_devices;
    for (size_t i = 0; i < k; i++)
        o[i] = i;
    /* Insertion sort (stable); relay-only devices after the others. */
    for (size_t i = 1; i < k; i++) {
        size_t v = o[i];
        size_t j = i;
        while (j > 0) {
            const struct kvs_plan_device *a = &inv->devices[o[j - 1]], *b = &inv->devices[v];
            bool before; /* should b go before a? */
            if (a->accepts_inbound != b->accepts_inbound)
                before = b->accepts_inbound;
            else if (key == ORDER_SPEED_DESC)
                before = b->decode_gbps > a->decode_gbps;
            else if (key == ORDER_SPEED_ASC)
                before = b->decode_gbps < a->decode_gbps;
            else
                before = b->mem_bytes > a->mem_bytes;
            if (!before)
                break;
            o[j] = o[j - 1];
            j--;
        }
        o[j] = v;
    }
}

/* Lower bounds that make the problem infeasible regardless of placement. */
static kvs_err check_capacity(const struct kvs_plan_model *m, const struct prefix *p,
                              const struct kvs_plan_inventory *inv, const struct kvs_plan_targets *t,
                              struct kvs_plan_result *res, char *errbuf, size_t errlen)
{
    uint64_t max_mem = 0;
    for (size_t i = 0; i < inv->n_devices; i++)
        if (inv->devices[i].mem_bytes > max_mem)
            max_mem = inv->devices[i].mem_bytes;
    /* The block whose bare need (weights + KV + common + buffer) is largest. */
    uint64_t worst = 0;
    uint32_t worst_b = 0;
    for (uint32_t b = 0; b < m->n_block; b++) {
        uint64_t need = add_sat(add_sat(m->block_weight_bytes[b], m->common_bytes),
                                add_sat(mul_sat(add_sat(mul_sat(m->block_kv_bytes[b], t->ctx),
                                                        m->block_state_bytes[b]), t->seqs),
                                        kvs_plan_buffer_bytes(m, t, false)));
        if (need > worst) {
            worst = need;
            worst_b = b;
        }
    }
    if (worst > max_mem) {
        res->shortfall_bytes = worst - max_mem;
        kvs_plan_seterr(errbuf, errlen,
                        "block %u needs %llu bytes (weights + KV + buffers) but the largest device has %llu: "
                        "short by %llu bytes",
                        worst_b, (unsigned long long)worst, (unsigned long long)max_mem,
                        (unsigned long long)res->shortfall_bytes);
        return KVS_ERR_INFEASIBLE;
    }
    uint64_t fixed = add_sat(m->common_bytes, kvs_plan_buffer_bytes(m, t, false));
    uint64_t cap = 0;
    size_t n_useful = 0;
    for (size_t i = 0; i < inv->n_devices; i++)
        if (inv->devices[i].mem_bytes > fixed) {
            cap = add_sat(cap, inv->devices[i].mem_bytes - fixed);
            n_useful++;
        }
    uint64_t need = add_sat(p->w[m->n_block], win_kv(m, p, t, 0, m->n_block));
    need = add_sat(need, add_sat(m->head_bytes, m->tail_bytes));
    need = add_sat(need, kvs_plan_buffer_bytes(m, t, true) - kvs_plan_buffer_bytes(m, t, false));
    if (n_useful <= 1)
        need -= m->tied_bytes;
    if (need > cap) {
        res->shortfall_bytes = need - cap;
        kvs_plan_seterr(errbuf, errlen,
                        "the model needs %llu bytes (weights + KV for ctx %u x seqs %u + extras) but the devices "
                        "offer %llu after per-device buffers: short by %llu bytes",
                        (unsigned long long)need, t->ctx, t->seqs, (unsigned long long)cap,
                        (unsigned long long)res->shortfall_bytes);
        return KVS_ERR_INFEASIBLE;
    }
    return KVS_OK;
}

kvs_err kvs_plan_solve(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                       const struct kvs_plan_targets *t, struct kvs_plan_result *res, char *errbuf,
                       size_t errlen)
{
    memset(res, 0, sizeof *res);
    kvs_err err = check_args(m, inv, t, errbuf, errlen);
    if (err)
        return err;
    struct prefix p = { 0 };
    struct dp dp = { .k = inv->n_devices, .n = m->n_block };
    err = prefix_init(&p, m);
    if (err)
        goto fail;
    err = check_capacity(m, &p, inv, t, res, errbuf, errlen);
    if (err)
        goto fail;
    size_t cells = dp.k * ((size_t)dp.n + 1);
    dp.g = malloc(cells * sizeof *dp.g);
    dp.pj = malloc(cells * sizeof *dp.pj);
    dp.pb = malloc(cells * sizeof *dp.pb);
    if (!dp.g || !dp.pj || !dp.pb) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }

    const size_t k = inv->n_devices;
    /* Work estimate of the exhaustive search: k! * (n+1)^2 * k^2. */
    double per = (double)(dp.n + 1) * (dp.n + 1) * (double)k * (double)k;
    double work = per;
    for (size_t i = 2; i <= k && work <= (double)t->exhaustive_limit; i++)
        work *= (double)i;
    bool exhaustive = work <= (double)t->exhaustive_limit;

    double best = INFINITY;
    struct kvs_plan_rank best_ranks[KVS_PLAN_MAX_DEVICES];
    size_t best_n = 0;
    size_t order[KVS_PLAN_MAX_DEVICES];
    if (exhaustive) {
        for (size_t i = 0; i < k; i++)
            order[i] = i;
        do
            try_order(&dp, m, &p, inv, t, order, &best, best_ranks, &best_n);
        while (next_perm(order, k));
    } else {
        static const enum order_key keys[] = { ORDER_SPEED_DESC, ORDER_MEM_DESC, ORDER_SPEED_ASC };
        size_t best_order[KVS_PLAN_MAX_DEVICES];
        for (size_t q = 0; q < sizeof keys / sizeof keys[0]; q++) {
            make_order(inv, keys[q], order);
            double before = best;
            try_order(&dp, m, &p, inv, t, order, &best, best_ranks, &best_n);
            if (best < before || q == 0)
                memcpy(best_order, order, k * sizeof order[0]);
        }
        /* Pairwise swaps of the best order while they improve; at most 3
         * passes of k(k-1)/2 DPs each bound the time. */
        for (int pass = 0; pass < 3; pass++) {
            bool improved = false;
            for (size_t a = 0; a < k; a++)
                for (size_t b = a + 1; b < k; b++) {
                    memcpy(order, best_order, k * sizeof order[0]);
                    size_t tmp = order[a];
                    order[a] = order[b];
                    order[b] = tmp;
                    double before = best;
                    try_order(&dp, m, &p, inv, t, order, &best, best_ranks, &best_n);
                    if (best < before) {
                        memcpy(best_order, order, k * sizeof order[0]);
                        improved = true;
                    }
                }
            if (!improved)
                break;
        }
    }
    if (best == INFINITY) {
        res->shortfall_bytes = 0;
        kvs_plan_seterr(errbuf, errlen,
                        "total memory suffices but no split into contiguous windows fits the devices "
                        "(blocks do not pack); add memory or lower ctx/seqs");
        err = KVS_ERR_INFEASIBLE;
        goto fail;
    }
    double c = kvs_plan_evaluate(m, inv, t, best_ranks, best_n, res);
    if (c < 0) {
        kvs_plan_seterr(errbuf, errlen, "internal: the solver produced an invalid placement");
        err = KVS_ERR_INTERNAL;
        goto fail;
    }
    res->exhaustive = exhaustive;
fail:
    free(dp.g);
    free(dp.pj);
    free(dp.pb);
    prefix_free(&p);
    return err;
}

/* Next-token sampler: see sampler.h for the contract and conventions. */
#include "sampler/sampler.h"


#include <float.h>
#include <stdbool.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* One candidate: its (penalized) logit and its token id. */
struct cand {
    float l;
    int32_t id;
};

struct kvs_sampler {
    struct kvs_sampler_params p;
    int32_t n_vocab;
    uint64_t n_accepted; /* tokens accepted since create/reset: the next position */
    int32_t *recent;     /* ring buffer [cap] of accepted ids */
    int32_t cap;         /* 0 when the penalty is off */
    int32_t n_recent;    /* filled entries, <= cap */
    int32_t head;        /* next write position */
    struct cand *cand;   /* [n_vocab] work array */
    float *prob;         /* [n_vocab] unnormalized then normalized probs */
    int32_t *ids;        /* [n_vocab] ids handed out by kvs_sampler_dist */
    uint8_t *mark;       /* [n_vocab] penalty de-duplication flags, all 0 at rest */
};

struct kvs_sampler_params kvs_sampler_default_params(void)
{
    struct kvs_sampler_params p = {
        .temp = 0.8f,
        .top_k = 40,
        .top_p = 0.95f,
        .min_p = 0.05f,
        .repeat_penalty = 1.0f,
        .repeat_last_n = 64,
        .seed = 0,
    };
    return p;
}

/* splitmix64's output function (see sampler.h). */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double kvs_sampler_uniform(uint64_t seed, uint64_t pos)
{
    const uint64_t g = 0x9e3779b97f4a7c15ULL;
    const uint64_t key = mix64(seed + g);
    return (double)(mix64(key + (pos + 1) * g) >> 11) * 0x1.0p-53;
}

kvs_err kvs_sampler_create(const struct kvs_sampler_params *p, int32_t n_vocab, struct kvs_sampler **out)
{
    if (!out)
        return KVS_ERR_ARG;
    *out = NULL;
    if (!p || isnan(p->temp) || isinf(p->temp) || isnan(p->top_p) || isnan(p->min_p) || isnan(p->repeat_penalty) ||
        !(p->repeat_penalty > 0.0f) || isinf(p->repeat_penalty))
        return KVS_ERR_ARG;
    if (n_vocab <= 0 || n_vocab > KVS_SAMPLER_MAX_VOCAB || p->repeat_last_n > KVS_SAMPLER_MAX_LAST_N)
        return KVS_ERR_RANGE;

    struct kvs_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return KVS_ERR_NOMEM;
    s->p = *p;
    s->n_vocab = n_vocab;
    s->cap = (p->repeat_penalty != 1.0f && p->repeat_last_n > 0) ? p->repeat_last_n : 0;
    size_t n = (size_t)n_vocab;
    s->cand = malloc(n * sizeof *s->cand);
    s->prob = malloc(n * sizeof *s->prob);
    s->ids = malloc(n * sizeof *s->ids);
    s->mark = calloc(n, 1);
    s->recent = s->cap ? malloc((size_t)s->cap * sizeof *s->recent) : NULL;
    if (!s->cand || !s->prob || !s->ids || !s->mark || (s->cap && !s->recent)) {
        kvs_sampler_free(s);
        return KVS_ERR_NOMEM;
    }
    *out = s;
    return KVS_OK;
}

void kvs_sampler_free(struct kvs_sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s->prob);
    free(s->ids);
    free(s->mark);
    free(s->recent);
    free(s);
}

void kvs_sampler_accept(struct kvs_sampler *s, int32_t id)
{
    if (!s)
        return;
    s->n_accepted++;
    if (s->cap == 0 || id < 0 || id >= s->n_vocab)
        return;
    s->recent[s->head] = id;
    s->head = (s->head + 1) % s->cap;
    if (s->n_recent < s->cap)
        s->n_recent++;
}

int32_t kvs_sampler_recent(const struct kvs_sampler *s, int32_t *out, int32_t cap)
{
    if (!s)
        return 0;
    const int32_t first = (s->head - s->n_recent + s->cap) % (s->cap ? s->cap : 1);
    for (int32_t i = 0; i < s->n_recent && i < cap; i++)
        out[i] = s->recent[(first + i) % s->cap];
    return s->n_recent;
}

void kvs_sampler_reset(struct kvs_sampler *s)
{
    if (!s)
        return;
    s->n_recent = 0;
    s->head = 0;
    s->n_accepted = 0;
}

/* Finite-izes one logit: NaN -> -inf, +inf -> FLT_MAX, so that orderings are
 * total and (l - max) never computes inf - inf. */
static float sanitize(float v)
{
    if (isnan(v))
        return -INFINITY;
    if (v > FLT_MAX)
        return FLT_MAX;
    return v;
}

/* a ranks before b: higher logit, then lower id. */
static int cand_before(const struct cand *a, const struct cand *b)
{
    return a->l > b->l || (a->l == b->l && a->id < b->id);
}

static int cand_cmp(const void *va, const void *vb)
{
    const struct cand *a = va, *b = vb;
    if (cand_before(a, b))
        return -1;
    if (cand_before(b, a))
        return 1;
    return 0;
}

/* Min-heap on rank (the worst-ranked candidate at the root) of h[0..k). */
static void heap_sift_down(struct cand *h, int32_t k, int32_t i)
{
    for (;;) {
        int32_t w = i, l = 2 * i + 1, r = l + 1;
        if (l < k && cand_before(&h[w], &h[l]))
            w = l;
        if (r < k && cand_before(&h[w], &h[r]))
            w = r;
        if (w == i)
            return;
        struct cand t = h[i];
        h[i] = h[w];
        h[w] = t;
        i = w;
    }
}

/* Flags the distinct recent tokens in mark[] (cleared by marks_clear). */
static void marks_set(struct kvs_sampler *s)
{
    for (int32_t j = 0; j < s->n_recent; j++)
        s->mark[s->recent[j]] = 1;
}

static void marks_clear(struct kvs_sampler *s)
{
    for (int32_t j = 0; j < s->n_recent; j++)
        s->mark[s->recent[j]] = 0;
}

/* Logit i after sanitizing and the repetition penalty (once per distinct
 * recent token: mark[i] is a flag, not a count). */
static inline float value_at(const struct kvs_sampler *s, const float *logits, int32_t i)
{
    float v = sanitize(logits[i]);
    if (s->mark[i]) {
        float pen = s->p.repeat_penalty;
        v = sanitize(v > 0.0f ? v / pen : v * pen);
    }
    return v;
}

/* Greedy: the best-ranked id (lowest id on ties) into cand[0], one pass.
 * A penalty >= 1 never raises a logit, so the raw value exceeding the best
 * is a necessary condition and the penalty is only looked up then. */
static void select_argmax(struct kvs_sampler *s, const float *logits)
{
    float best = value_at(s, logits, 0);
    int32_t bi = 0;
    const bool lowers = s->p.repeat_penalty >= 1.0f;
    for (int32_t i = 1; i < s->n_vocab; i++) {
        if (lowers && !(logits[i] > best))
            continue; /* NaN fails the test too */
        float v = value_at(s, logits, i);
        if (v > best) {
            best = v;
            bi = i;
        }
    }
    s->cand[0].l = best;
    s->cand[0].id = bi;
}

/* The k best-ranked ids into cand[0..k), sorted, in one pass over logits
 * with a k-heap: O(n log k) worst case, ~n comparisons typical (most logits
 * lose against the root). Ids arrive in increasing order, so an equal logit
 * never displaces the root (the lower id wins ties). */
static void select_top_k(struct kvs_sampler *s, const float *logits, int32_t k)
{
    struct cand *c = s->cand;
    for (int32_t i = 0; i < k; i++) {
        c[i].l = value_at(s, logits, i);
        c[i].id = i;
    }
    for (int32_t i = k / 2 - 1; i >= 0; i--)
        heap_sift_down(c, k, i);
    const bool lowers = s->p.repeat_penalty >= 1.0f; /* as in select_argmax */
    for (int32_t i = k; i < s->n_vocab; i++) {
        if (lowers && !(logits[i] > c[0].l))
            continue;
        float v = value_at(s, logits, i);
        if (v > c[0].l) {
            c[0].l = v;
            c[0].id = i;
            heap_sift_down(c, k, 0);
        }
    }
    qsort(c, (size_t)k, sizeof *c, cand_cmp);
}

/* Every id into cand[] (index == id). */
static void select_all(struct kvs_sampler *s, const float *logits)
{
    for (int32_t i = 0; i < s->n_vocab; i++) {
        s->cand[i].l = value_at(s, logits, i);
        s->cand[i].id = i;
    }
}

/* Index of the best-ranked of c[0..n) (lowest id on ties when c is in id order). */
static int32_t argmax(const struct cand *c, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (cand_before(&c[i], &c[b]))
            b = i;
    return b;
}

/* Runs the pipeline up to (not including) the draw. Leaves n candidates in
 * cand[0..n) with normalized prob[0..n); sorted by rank when need_sorted or
 * when top-p was applied, otherwise possibly in id order. Returns n >= 1. */
static int32_t build(struct kvs_sampler *s, const float *logits, int need_sorted)
{
    struct cand *c = s->cand;
    float *pr = s->prob;
    const struct kvs_sampler_params *p = &s->p;
    int32_t n = s->n_vocab;
    int sorted = 0;
    marks_set(s);
    if (p->temp <= 0.0f) {
        select_argmax(s, logits);
        marks_clear(s);
        pr[0] = 1.0f;
        return 1;
    }
    if (p->top_k > 0 && p->top_k < n) {
        select_top_k(s, logits, p->top_k);
        n = p->top_k;
        sorted = 1;
    } else {
        select_all(s, logits);
    }
    marks_clear(s);
    float m = sorted ? c[0].l : c[argmax(c, n)].l;
    if (m == -INFINITY) { /* nothing is possible: fall back to the argmax */
        c[0] = c[sorted ? 0 : argmax(c, n)];
        pr[0] = 1.0f;
        return 1;
    }
    /* Temperature and softmax numerators: e_i = exp((l_i - max) / T), so
     * the best candidate has exactly 1. */
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) {
        pr[i] = expf((c[i].l - m) / p->temp);
        total += pr[i];
    }
    int use_top_p = p->top_p < 1.0f;
    int use_min_p = p->min_p > 0.0f;
    /* The max numerator is exactly 1 and always survives min-p. */
    float min_p = p->min_p < 1.0f ? p->min_p : 1.0f;
    if (!sorted && (need_sorted || use_top_p)) {
        /* min-p and top-p both keep a prefix of the ranked order, so the
         * min-p survivors are the only ones that can remain: sort only
         * those, while top-p still measures mass against the full total. */
        if (use_min_p) {
            int32_t w = 0;
            for (int32_t i = 0; i < n; i++)
                if (pr[i] >= min_p) {
                    c[w] = c[i];
                    pr[w] = pr[i];
                    w++;
                }
            n = w;
        }
        qsort(c, (size_t)n, sizeof *c, cand_cmp);
        for (int32_t i = 0; i < n; i++)
            pr[i] = expf((c[i].l - m) / p->temp);
        sorted = 1;
    }
    if (use_top_p) {
        double want = (double)p->top_p * total, cum = 0.0;
        for (int32_t i = 0; i < n; i++) {
            cum += pr[i];
            if (cum >= want) {
                n = i + 1;
                break;
            }
        }
    }
    if (use_min_p) {
        /* p_i >= min_p * p_max is e_i >= min_p, as the max numerator is 1. */
        int32_t w = 0;
        for (int32_t i = 0; i < n; i++)
            if (pr[i] >= min_p) {
                c[w] = c[i];
                pr[w] = pr[i];
                w++;
            }
        n = w;
    }
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++)
        sum += pr[i];
    for (int32_t i = 0; i < n; i++)
        pr[i] = (float)(pr[i] / sum);
    return n;
}

int32_t kvs_sampler_dist(struct kvs_sampler *s, const float *logits, const int32_t **ids, const float **probs)
{
    int32_t n = build(s, logits, 1);
    for (int32_t i = 0; i < n; i++)
        s->ids[i] = s->cand[i].id;
    if (ids)
        *ids = s->ids;
    if (probs)
        *probs = s->prob;
    return n;
}

int32_t kvs_sampler_sample(struct kvs_sampler *s, const float *logits)
{
    return kvs_sampler_sample_at(s, logits, s->n_accepted);
}

int32_t kvs_sampler_sample_at(struct kvs_sampler *s, const float *logits, uint64_t pos)
{
    int32_t n = build(s, logits, 1); /* the draw walks the rank order (sampler.h) */
    if (n == 1)
        return s->cand[0].id;
    double u = kvs_sampler_uniform(s->p.seed, pos), cum = 0.0;
    for (int32_t i = 0; i < n; i++) {
        cum += s->prob[i];
        if (u < cum)
            return s->cand[i].id;
    }
    return s->cand[n - 1].id;
}

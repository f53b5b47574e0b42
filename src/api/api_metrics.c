/* /metrics: counters and histograms in the Prometheus text exposition format
 * 0.0.4 (prometheus.io/docs/instrumenting/exposition_formats): histograms as
 * cumulative _bucket{le=...} series ending with le="+Inf", then _sum and
 * _count. */
#include "api/api_impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool kvs_api_buf_add(struct kvs_api_buf *b, const char *s, size_t n)
{
    if (n > b->limit - b->len || b->len + n + 1 < b->len) return false;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->len + n + 1) nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) return false;
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
    return true;
}

bool kvs_api_buf_printf(struct kvs_api_buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap, aq;
    va_start(ap, fmt);
    va_copy(aq, ap);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    bool ok = false;
    if (n >= 0 && (size_t)n < sizeof tmp) {
        ok = kvs_api_buf_add(b, tmp, (size_t)n);
    } else if (n >= 0 && (size_t)n <= b->limit - b->len) { /* longer than tmp: format once more, on the heap */
        char *big = malloc((size_t)n + 1);
        ok = big && vsnprintf(big, (size_t)n + 1, fmt, aq) == n && kvs_api_buf_add(b, big, (size_t)n);
        free(big);
    }
    va_end(aq);
    return ok;
}

void kvs_api_buf_free(struct kvs_api_buf *b)
{
    free(b->p);
    b->p = NULL;
    b->len = b->cap = 0;
}

static const double request_bounds[] = { 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120 };
static const double token_bounds[] = { 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5 };

void kvs_api_metrics_init(struct kvs_api_metrics *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
    m->request_seconds.bounds = request_bounds;
    m->request_seconds.n = (int)(sizeof request_bounds / sizeof request_bounds[0]);
    m->token_roundtrip.bounds = token_bounds;
    m->token_roundtrip.n = (int)(sizeof token_bounds / sizeof token_bounds[0]);
}

void kvs_api_metrics_destroy(struct kvs_api_metrics *m)
{
    pthread_mutex_destroy(&m->mu);
}

void kvs_api_hist_add(struct kvs_api_hist *h, double v)
{
    int i = 0;
    while (i < h->n && v > h->bounds[i]) i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

static bool hist_render(const struct kvs_api_hist *h, const char *name, const char *help, struct kvs_api_buf *b)
{
    bool ok = kvs_api_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    uint64_t cum = 0;
    for (int i = 0; i < h->n; i++) {
        cum += h->counts[i];
        ok = ok && kvs_api_buf_printf(b, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], (unsigned long long)cum);
    }
    cum += h->counts[h->n];
    ok = ok && kvs_api_buf_printf(b, "%s_bucket{le=\"+Inf\"} %llu\n%s_sum %.9g\n%s_count %llu\n", name,
                                  (unsigned long long)cum, name, h->sum, name, (unsigned long long)h->count);
    return ok;
}

static const char *const status_names[KVS_API_STATUS_COUNT_] = { "ok", "cancelled", "error", "invalid",
                                                                 "unavailable" };

bool kvs_api_metrics_render(struct kvs_api_metrics *m, const struct kvs_stage_metrics *st, int32_t stage_index,
                            struct kvs_api_buf *b)
{
    pthread_mutex_lock(&m->mu);
    bool ok = kvs_api_buf_printf(b, "# HELP kvasir_requests_total HTTP generation requests by outcome.\n"
                                    "# TYPE kvasir_requests_total counter\n");
    for (int i = 0; i < KVS_API_STATUS_COUNT_; i++)
        ok = ok && kvs_api_buf_printf(b, "kvasir_requests_total{status=\"%s\"} %llu\n", status_names[i],
                                      (unsigned long long)m->requests[i]);
    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_tokens_generated_total Completion tokens returned to clients.\n"
                                  "# TYPE kvasir_tokens_generated_total counter\n"
                                  "kvasir_tokens_generated_total %llu\n"
                                  "# HELP kvasir_prompt_tokens_total Prompt tokens of admitted requests.\n"
                                  "# TYPE kvasir_prompt_tokens_total counter\n"
                                  "kvasir_prompt_tokens_total %llu\n"
                                  "# HELP kvasir_http_requests_in_flight Generation requests being served.\n"
                                  "# TYPE kvasir_http_requests_in_flight gauge\n"
                                  "kvasir_http_requests_in_flight %lld\n",
                                  (unsigned long long)m->tokens_generated, (unsigned long long)m->prompt_tokens,
                                  (long long)m->in_flight);
    static const char *const conn_names[KVS_API_CONN_COUNT_] = { "accepted", "refused_full", "refused_address",
                                                                 "timed_out", "evicted" };
    ok = ok && kvs_api_buf_printf(b, "# HELP kvasir_http_connections_total HTTP connections at the API's door by "
                                     "outcome (refused: answered 503; timed_out/evicted: closed before a whole "
                                     "request came).\n"
                                     "# TYPE kvasir_http_connections_total counter\n");
    for (int i = 0; i < KVS_API_CONN_COUNT_; i++)
        ok = ok && kvs_api_buf_printf(b, "kvasir_http_connections_total{outcome=\"%s\"} %llu\n", conn_names[i],
                                      (unsigned long long)m->connections[i]);
    ok = ok && hist_render(&m->request_seconds, "kvasir_request_seconds",
                           "Time from admission to the last byte of a generation request.", b);
    ok = ok && hist_render(&m->token_roundtrip, "kvasir_token_roundtrip_seconds",
                           "Time between consecutive tokens of one request: one trip around the ring.", b);
    pthread_mutex_unlock(&m->mu);

    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_active_sequences Sequences holding a slot on this stage.\n"
                                  "# TYPE kvasir_active_sequences gauge\n"
                                  "kvasir_active_sequences %d\n"
                                  "# HELP kvasir_queued_requests Requests waiting for a slot on the head.\n"
                                  "# TYPE kvasir_queued_requests gauge\n"
                                  "kvasir_queued_requests %d\n"
                                  "# HELP kvasir_ring_ready 1 when the ring is whole.\n"
                                  "# TYPE kvasir_ring_ready gauge\n"
                                  "kvasir_ring_ready %d\n",
                                  (int)st->n_active, (int)st->n_queued, st->ring_ready ? 1 : 0);
    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_forward_seconds_total Compute time of forward calls on a stage.\n"
                                  "# TYPE kvasir_forward_seconds_total counter\n"
                                  "kvasir_forward_seconds_total{stage=\"%d\"} %.6f\n"
                                  "# HELP kvasir_forward_calls_total Forward calls on a stage.\n"
                                  "# TYPE kvasir_forward_calls_total counter\n"
                                  "kvasir_forward_calls_total{stage=\"%d\"} %llu\n",
                                  (int)stage_index, st->forward_ms / 1000.0, (int)stage_index,
                                  (unsigned long long)st->forward_calls);
    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_stage_requests_total Requests ended on the head stage, by outcome.\n"
                                  "# TYPE kvasir_stage_requests_total counter\n"
                                  "kvasir_stage_requests_total{status=\"started\"} %llu\n"
                                  "kvasir_stage_requests_total{status=\"done\"} %llu\n"
                                  "kvasir_stage_requests_total{status=\"failed\"} %llu\n"
                                  "# HELP kvasir_stage_tokens_total Tokens reported by the ring to the head.\n"
                                  "# TYPE kvasir_stage_tokens_total counter\n"
                                  "kvasir_stage_tokens_total %llu\n",
                                  (unsigned long long)st->requests_started, (unsigned long long)st->requests_done,
                                  (unsigned long long)st->requests_failed, (unsigned long long)st->tokens_generated);
    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_link_bytes_total Bytes over this stage's ring links.\n"
                                  "# TYPE kvasir_link_bytes_total counter\n"
                                  "kvasir_link_bytes_total{dir=\"in\"} %llu\n"
                                  "kvasir_link_bytes_total{dir=\"out\"} %llu\n"
                                  "# HELP kvasir_links_lost_total Link failures on this stage.\n"
                                  "# TYPE kvasir_links_lost_total counter\n"
                                  "kvasir_links_lost_total %llu\n",
                                  (unsigned long long)st->bytes_in, (unsigned long long)st->bytes_out,
                                  (unsigned long long)st->links_lost);
    return ok;
}

bool kvs_api_metrics_render_ring(const struct kvs_stage_hop *hops, int n, double rtt_ms, struct kvs_api_buf *b)
{
    if (n <= 0) return true;
    static const struct {
        const char *name, *type, *help;
    } series[] = {
        { "kvasir_ring_stage_forward_seconds_total", "counter", "Compute time of each stage's window (ring probe)." },
        { "kvasir_ring_stage_forward_calls_total", "counter", "Forward calls on each stage (ring probe)." },
        { "kvasir_ring_stage_rows_total", "counter", "Token rows (prefill + decode) each stage ran (ring probe)." },
        { "kvasir_ring_stage_bytes_out_total", "counter", "Bytes each stage sent to its successor (ring probe)." },
        { "kvasir_ring_hop_latency_seconds", "gauge",
          "Last probe's latency from a stage's send to its successor's read." },
    };
    bool ok = true;
    for (size_t k = 0; k < sizeof series / sizeof series[0]; k++) {
        ok = ok && kvs_api_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", series[k].name, series[k].help,
                                      series[k].name, series[k].type);
        for (int i = 0; i < n && ok; i++) {
            const struct kvs_stage_hop *h = &hops[i];
            char lbl[96];
            if (k == 4)
                snprintf(lbl, sizeof lbl, "from=\"%d\",to=\"%d\"", i, (i + 1) % n);
            else
                snprintf(lbl, sizeof lbl, "rank=\"%d\",window=\"%d:%d\"", i, (int)h->block_begin,
                         (int)h->block_end);
            switch (k) {
            case 0: ok = kvs_api_buf_printf(b, "%s{%s} %.6f\n", series[k].name, lbl, h->forward_ms / 1000.0); break;
            case 1:
                ok = kvs_api_buf_printf(b, "%s{%s} %llu\n", series[k].name, lbl, (unsigned long long)h->forward_calls);
                break;
            case 2: ok = kvs_api_buf_printf(b, "%s{%s} %llu\n", series[k].name, lbl, (unsigned long long)h->rows); break;
            case 3:
                ok = kvs_api_buf_printf(b, "%s{%s} %llu\n", series[k].name, lbl, (unsigned long long)h->bytes_out);
                break;
            default: ok = kvs_api_buf_printf(b, "%s{%s} %.6f\n", series[k].name, lbl, h->hop_ms / 1000.0); break;
            }
        }
    }
    ok = ok && kvs_api_buf_printf(b,
                                  "# HELP kvasir_ring_probe_rtt_seconds Round trip of the last ring probe.\n"
                                  "# TYPE kvasir_ring_probe_rtt_seconds gauge\n"
                                  "kvasir_ring_probe_rtt_seconds %.6f\n",
                                  rtt_ms / 1000.0);
    return ok;
}

/* Small helpers shared by the benchmarks (header-only, static inline). */
#ifndef KVS_BENCH_UTIL_H
#define KVS_BENCH_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static inline int kvs_bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Median of v[0..n) (n >= 1); sorts v in place. */
static inline double kvs_bench_median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, kvs_bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* Monotonic wall clock in seconds. */
static inline double kvs_bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct kvs_bench_bw_part {
    const uint64_t *p;
    size_t n;        /* u64 words */
    uint64_t sum;    /* result, keeps the loads alive */
};

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* AVX-512 reduction with the same software prefetch distances as the matmul
 * kernels (512 B into L1, 8 KiB into L2): the read bandwidth a streaming
 * kernel can get from this machine. */
__attribute__((target("avx512f"))) static inline uint64_t kvs_bench_bw_avx512(const uint64_t *p, size_t n)
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        _mm_prefetch((const char *)(p + i) + 512, _MM_HINT_T0);
        _mm_prefetch((const char *)(p + i) + 8192, _MM_HINT_T1);
        _mm_prefetch((const char *)(p + i) + 8192 + 128, _MM_HINT_T1);
        a0 = _mm512_add_epi64(a0, _mm512_loadu_si512((const void *)(p + i)));
        a1 = _mm512_add_epi64(a1, _mm512_loadu_si512((const void *)(p + i + 8)));
        a2 = _mm512_add_epi64(a2, _mm512_loadu_si512((const void *)(p + i + 16)));
        a3 = _mm512_add_epi64(a3, _mm512_loadu_si512((const void *)(p + i + 24)));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
    for (; i < n; i++)
        s += p[i];
    return s;
}
#endif

static inline void *kvs_bench_bw_worker(void *arg)
{
    struct kvs_bench_bw_part *part = arg;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) {
        part->sum = kvs_bench_bw_avx512(part->p, part->n);
        return NULL;
    }
#endif
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= part->n; i += 4) {
        s0 += part->p[i];
        s1 += part->p[i + 1];
        s2 += part->p[i + 2];
        s3 += part->p[i + 3];
    }
    for (; i < part->n; i++)
        s0 += part->p[i];
    part->sum = s0 + s1 + s2 + s3;
    return NULL;
}

/* A read-bandwidth probe with its buffer allocated and written once, so that
 * it can be run many times between other measurements (interleaved rounds)
 * at the cost of the passes alone. */
struct kvs_bench_probe {
    uint64_t *buf;
    size_t words;
    int n_threads;
};

/* Allocates and fills a `bytes` buffer (choose it far above the last-level
 * cache, e.g. 512 MiB) for n_threads threads (1..64). Returns 0, or -1 on bad
 * arguments or allocation failure (then p->buf is NULL). Free with
 * kvs_bench_probe_free. */
static inline int kvs_bench_probe_init(struct kvs_bench_probe *p, size_t bytes, int n_threads)
{
    p->buf = NULL;
    p->words = bytes / 8;
    p->n_threads = n_threads;
    if (n_threads < 1 || n_threads > 64 || bytes < 64 * (size_t)n_threads)
        return -1;
    if (!(p->buf = malloc(p->words * 8)))
        return -1;
    for (size_t i = 0; i < p->words; i++)
        p->buf[i] = i;
    return 0;
}

static inline void kvs_bench_probe_free(struct kvs_bench_probe *p)
{
    free(p->buf);
    p->buf = NULL;
}

/* One pass: n_threads threads at once (the caller is thread 0) each sum
 * their contiguous share of the buffer; returns GB/s (1e9 bytes/s) of the
 * whole buffer over the pass's wall time, thread start and join included. */
static inline double kvs_bench_probe_pass(const struct kvs_bench_probe *p)
{
    struct kvs_bench_bw_part parts[64];
    pthread_t th[64];
    uint64_t sum = 0;
    const size_t words = p->words, nt = (size_t)p->n_threads;
    double t0 = kvs_bench_now();
    for (size_t t = 0; t < nt; t++) {
        size_t a = words * t / nt, b = words * (t + 1) / nt;
        parts[t] = (struct kvs_bench_bw_part){.p = p->buf + a, .n = b - a};
        if (t > 0)
            pthread_create(&th[t], NULL, kvs_bench_bw_worker, &parts[t]);
    }
    kvs_bench_bw_worker(&parts[0]);
    for (size_t t = 1; t < nt; t++)
        pthread_join(th[t], NULL);
    double dt = kvs_bench_now() - t0;
    for (size_t t = 0; t < nt; t++)
        sum += parts[t].sum;
    /* The sum is an input of an empty asm statement, so the compiler must
     * compute it: the reads cannot be optimised away. */
    __asm__ __volatile__("" : : "r"(sum));
    return (double)(words * 8) / dt / 1e9;
}

/* Median GB/s of `passes` (1..64) passes. */
static inline double kvs_bench_probe_median(const struct kvs_bench_probe *p, int passes)
{
    double v[64];
    if (passes < 1 || passes > 64)
        return 0.0;
    for (int i = 0; i < passes; i++)
        v[i] = kvs_bench_probe_pass(p);
    return kvs_bench_median(v, passes);
}

/* Memory read bandwidth in GB/s (1e9 bytes/s): n_threads threads (1..64)
 * each sum their contiguous share of a `bytes` buffer (e.g. 1 GiB, well above
 * the last-level cache); best of `reps` passes after one warm-up pass.
 * Returns 0 on allocation failure. */
static inline double kvs_bench_read_gbps(size_t bytes, int n_threads, int reps)
{
    struct kvs_bench_probe p;
    if (kvs_bench_probe_init(&p, bytes, n_threads) != 0)
        return 0.0;
    double best = 0.0;
    for (int r = 0; r <= reps; r++) {
        double gbs = kvs_bench_probe_pass(&p);
        if (r > 0 && gbs > best)
            best = gbs;
    }
    kvs_bench_probe_free(&p);
    return best;
}

#endif

/* Persistent thread pool: workers spin briefly on a generation counter and
 * then sleep on it with a futex, so back-to-back kvs_pool_run calls (one per
 * matmul, hundreds per token) cost well under a microsecond of wake-up each
 * while an idle pool uses no CPU. kvs_pool_run allocates nothing. */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/kernels_impl.h"
#include "kernels/pool.h"

#define KVS_POOL_MAX_THREADS 256
#define KVS_POOL_SPIN 20000 /* default relax iterations before a worker sleeps (~0.1-1 ms) */
#define KVS_POOL_SPIN_MAX 10000000

struct kvs_pool_worker {
    struct kvs_pool *pool;
    int ith;
};

struct kvs_pool {
    int n;
    pthread_t *threads;             /* n - 1 workers */
    struct kvs_pool_worker *workers; /* n - 1 */
    void (*fn)(void *ctx, int ith, int nth);
    void *ctx;
    _Atomic uint32_t gen;   /* futex word: bumped once per run (and on stop) */
    _Atomic int done;       /* workers finished with the current run */
    _Atomic int sleepers;   /* workers in (or entering) futex wait */
    _Atomic int stop;
    int spin;               /* relax iterations before sleeping / yielding (KVASIR_SPIN) */
};

/* Spin for pools created on this thread (kvs_pool_set_thread_spin); -1: none. */
static _Thread_local int kvs_pool_tls_spin = -1;

int kvs_pool_set_thread_spin(int spin)
{
    int prev = kvs_pool_tls_spin;
    kvs_pool_tls_spin = spin < 0 ? -1 : spin > KVS_POOL_SPIN_MAX ? KVS_POOL_SPIN_MAX : spin;
    return prev;
}

static inline void kvs_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void kvs_futex_wait(_Atomic uint32_t *addr, uint32_t expected)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void kvs_futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void *kvs_pool_main(void *arg)
{
    struct kvs_pool_worker *w = arg;
    struct kvs_pool *p = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen) {
            if (spins < p->spin) {
                spins++;
                kvs_cpu_relax();
            } else {
                atomic_fetch_add(&p->sleepers, 1);
                kvs_futex_wait(&p->gen, seen);
                atomic_fetch_sub(&p->sleepers, 1);
            }
        }
        seen = g;
        if (atomic_load_explicit(&p->stop, memory_order_acquire))
            break;
        p->fn(p->ctx, w->ith, p->n);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
    return NULL;
}

kvs_err kvs_pool_create(int n_threads, struct kvs_pool **out)
{
    if (!out || n_threads < 1 || n_threads > KVS_POOL_MAX_THREADS)
        return KVS_ERR_ARG;
    *out = NULL;
    struct kvs_pool *p = calloc(1, sizeof *p);
    if (!p)
        return KVS_ERR_NOMEM;
    p->n = 1;
    /* KVASIR_SPIN=N: relax iterations before a waiting thread sleeps (worker)
     * or yields (caller). Short spins suit processes that share cores, e.g.
     * ring stages on one machine: an idle stage then gives its cores up at once.
     * Precedence: KVASIR_SPIN, then kvs_pool_set_thread_spin, then the default. */
    p->spin = kvs_pool_tls_spin >= 0 ? kvs_pool_tls_spin : KVS_POOL_SPIN;
    const char *env = getenv("KVASIR_SPIN");
    if (env && *env) {
        char *end;
        long v = strtol(env, &end, 10);
        if (*end || v < 0 || v > KVS_POOL_SPIN_MAX)
            KVS_LOGW("pool: ignoring KVASIR_SPIN=%s (expected 0..%d)", env, KVS_POOL_SPIN_MAX);
        else
            p->spin = (int)v;
    }
    if (n_threads > 1) {
        p->threads = calloc((size_t)n_threads - 1, sizeof *p->threads);
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->threads || !p->workers) {
            kvs_pool_destroy(p);
            return KVS_ERR_NOMEM;
        }
    }
    for (int i = 1; i < n_threads; i++) {
        p->workers[i - 1] = (struct kvs_pool_worker){.pool = p, .ith = i};
        int rc = pthread_create(&p->threads[i - 1], NULL, kvs_pool_main, &p->workers[i - 1]);
        if (rc != 0) {
            KVS_LOGE("pool: pthread_create failed (%d) after %d threads", rc, p->n);
            kvs_pool_destroy(p);
            return KVS_ERR_NOMEM;
        }
        p->n++;
    }
    *out = p;
    return KVS_OK;
}

void kvs_pool_destroy(struct kvs_pool *p)
{
    if (!p)
        return;
    if (p->n > 1) {
        atomic_store(&p->stop, 1);
        atomic_fetch_add(&p->gen, 1);
        kvs_futex_wake_all(&p->gen);
        for (int i = 0; i < p->n - 1; i++)
            pthread_join(p->threads[i], NULL);
    }
    free(p->threads);
    free(p->workers);
    free(p);
}

int kvs_pool_n_threads(const struct kvs_pool *p)
{
    return p ? p->n : 1;
}

void kvs_pool_run(struct kvs_pool *p, void (*fn)(void *ctx, int ith, int nth), void *ctx)
{
    if (!p || p->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); /* seq_cst: pairs with the sleepers check below */
    if (atomic_load(&p->sleepers) > 0)
        kvs_futex_wake_all(&p->gen);
    fn(ctx, 0, p->n);
    int spins = 0;
    while (atomic_load_explicit(&p->done, memory_order_acquire) < p->n - 1) {
        if (++spins < p->spin) {
            kvs_cpu_relax();
        } else {
            sched_yield();
        }
    }
}

/* Kernel benchmark: weight-streaming GB/s of matrix-vector products (decode)
 * per type with 1 and 2 threads, prefill GFLOP/s (n_tok = 32), beside the
 * machine's read bandwidth measured in the same run, and the scalar
 * reference's 1-thread decode figure on the same matrix (the baseline of the
 * last column: SIMD / scalar, both per CPU-second of the thread).
 *
 * usage: bench_kernels [weight MiB per type (default 256)] [bandwidth MiB (default 1024)]
 * KVASIR_ISA=scalar|avx2|avx512 picks the kernel table. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_util.h"
#include "kernels/kernels.h"

/* CPU seconds used by the calling thread: with 1 thread this gives a figure
 * that a loaded machine (time-sliced cores) does not distort. */
static double thread_cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static long arg_mib(int argc, char **argv, int i, long def)
{
    if (argc <= i)
        return def;
    char *end;
    long v = strtol(argv[i], &end, 10);
    if (*end || v < 1 || v > 65536) {
        fprintf(stderr, "bad size '%s' (MiB, 1..65536)\n", argv[i]);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv)
{
    long w_mib = arg_mib(argc, argv, 1, 256), bw_mib = arg_mib(argc, argv, 2, 1024);
    const struct kvs_kernels *k = kvs_kernels_best();
    printf("kernels: %s\n", kvs_isa_name(kvs_kernels_isa(k)));
    for (int nt = 1; nt <= 2; nt++)
        printf("read bandwidth (%ld MiB, %d thread%s): %.1f GB/s\n", bw_mib, nt, nt > 1 ? "s" : "",
               kvs_bench_read_gbps((size_t)bw_mib << 20, nt, 3));

    static const enum kvs_type types[] = {KVS_TYPE_Q8_0, KVS_TYPE_Q4_0, KVS_TYPE_Q4_1, KVS_TYPE_Q5_0,
                                          KVS_TYPE_Q5_1, KVS_TYPE_Q2_K, KVS_TYPE_Q3_K, KVS_TYPE_Q4_K,
                                          KVS_TYPE_Q5_K, KVS_TYPE_Q6_K, KVS_TYPE_F16, KVS_TYPE_BF16,
                                          KVS_TYPE_F32};
    const struct kvs_kernels *ref = kvs_kernels_get(KVS_ISA_SCALAR);
    const int64_t K = 4096, T = 32;
    struct kvs_pool *pools[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (kvs_pool_create(i + 1, &pools[i]) != KVS_OK) {
            fprintf(stderr, "pool create failed\n");
            return 1;
        }
    }
    float *x = malloc(sizeof(float) * (size_t)(K * T));
    float *y = NULL;
    for (int64_t i = 0; i < K * T; i++)
        x[i] = (float)((i * 7919) % 2001 - 1000) / 1000.0f;
    printf("(cpu: 1-thread figures per CPU-second of the thread, robust to a loaded machine)\n");
    printf("%-6s %8s %9s %9s %9s %10s %10s %10s %10s %7s\n", "type", "rows", "1t GB/s", "2t GB/s", "1t cpu",
           "pf 1t GF/s", "pf 2t GF/s", "pf 1t cpu", "scalar cpu", "x ref");
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        enum kvs_type t = types[ti];
        size_t rb = kvs_type_row_bytes(t, K);
        int64_t N = (int64_t)(((size_t)w_mib << 20) / rb);
        uint8_t *w = malloc(rb * (size_t)N);
        y = realloc(y, sizeof(float) * (size_t)(N > 4096 ? N : 4096) * (size_t)T);
        void *scratch = malloc(kvs_matmul_scratch_bytes(t, K, T) + 64);
        if (!w || !y || !scratch) {
            fprintf(stderr, "out of memory\n");
            return 1;
        }
        memset(w, 0x11, rb * (size_t)N); /* f16 scales 0x1111: small normal numbers */
        struct kvs_matrix W = {.type = t, .ne0 = K, .ne1 = N, .row_bytes = rb, .data = w};
        double gbs[2], gfs[2], cpu_gbs = 0.0, cpu_gfs = 0.0;
        for (int p = 0; p < 2; p++) {
            kvs_matmul(k, pools[p], &W, x, 1, y, scratch); /* warm-up (page faults) */
            double best = 1e30, cbest = 1e30;
            for (int r = 0; r < 5; r++) {
                double t0 = kvs_bench_now(), c0 = thread_cpu_now();
                kvs_matmul(k, pools[p], &W, x, 1, y, scratch);
                double dt = kvs_bench_now() - t0, dc = thread_cpu_now() - c0;
                best = dt < best ? dt : best;
                cbest = dc < cbest ? dc : cbest;
            }
            gbs[p] = (double)rb * (double)N / best / 1e9;
            if (p == 0)
                cpu_gbs = (double)rb * (double)N / cbest / 1e9;
            /* prefill: a 4096 x 4096 slice, 32 tokens */
            struct kvs_matrix Wp = W;
            Wp.ne1 = N < 4096 ? N : 4096;
            kvs_matmul(k, pools[p], &Wp, x, T, y, scratch);
            best = 1e30, cbest = 1e30;
            for (int r = 0; r < 3; r++) {
                double t0 = kvs_bench_now(), c0 = thread_cpu_now();
                kvs_matmul(k, pools[p], &Wp, x, T, y, scratch);
                double dt = kvs_bench_now() - t0, dc = thread_cpu_now() - c0;
                best = dt < best ? dt : best;
                cbest = dc < cbest ? dc : cbest;
            }
            double flop = 2.0 * (double)K * (double)Wp.ne1 * (double)T;
            gfs[p] = flop / best / 1e9;
            if (p == 0)
                cpu_gfs = flop / cbest / 1e9;
        }
        /* baseline: the scalar reference, 1 thread, decode, best of 3 */
        double cref = 1e30;
        kvs_matmul(ref, pools[0], &W, x, 1, y, scratch);
        for (int r = 0; r < 3; r++) {
            double c0 = thread_cpu_now();
            kvs_matmul(ref, pools[0], &W, x, 1, y, scratch);
            double dc = thread_cpu_now() - c0;
            cref = dc < cref ? dc : cref;
        }
        const double ref_gbs = (double)rb * (double)N / cref / 1e9;
        printf("%-6s %8lld %9.1f %9.1f %9.1f %10.1f %10.1f %10.1f %10.2f %7.1f\n", kvs_type_name(t), (long long)N,
               gbs[0], gbs[1], cpu_gbs, gfs[0], gfs[1], cpu_gfs, ref_gbs, cpu_gbs / ref_gbs);
        free(w);
        free(scratch);
    }
    free(x);
    free(y);
    for (int i = 0; i < 2; i++)
        kvs_pool_destroy(pools[i]);
    return 0;
}

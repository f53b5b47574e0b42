/* kvasir bench --probe: measure this machine and print a device object in the
 * planner's inventory format (docs/PLAN.md "Device inventory").
 *
 * decode_gbps: the read rate of a buffer (default 512 MiB) streamed by
 * `threads` threads, best of a few passes (decode is bound by streaming the
 * weights once per token, so this is the figure the planner divides by).
 * prefill_gflops: a register-resident multiply-add loop, 2 FLOPs per FMA, over
 * all threads (an upper-bound estimate; no matmul). mem_bytes: MemAvailable
 * from /proc/meminfo. */
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "ocl/ocl.h"
#include "trust/trust.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct probe_job {
    const uint64_t *p; /* this thread's slice */
    size_t n;          /* u64 words */
    uint64_t sum;      /* keeps the reads alive */
    double flops;      /* FLOP loop iterations (prefill) */
    float acc;
    int mode;          /* 0 stream, 1 flops */
};

static void *probe_worker(void *arg)
{
    struct probe_job *j = arg;
    if (j->mode == 0) {
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        size_t i = 0;
        for (; i + 4 <= j->n; i += 4) {
            s0 += j->p[i];
            s1 += j->p[i + 1];
            s2 += j->p[i + 2];
            s3 += j->p[i + 3];
        }
        for (; i < j->n; i++)
            s0 += j->p[i];
        j->sum = s0 ^ s1 ^ s2 ^ s3;
    } else {
        /* 16 independent multiply-add chains: the compiler vectorises them. */
        float a[16], b = 0.999999f, c = 1e-7f;
        for (int k = 0; k < 16; k++)
            a[k] = (float)k * 0.001f;
        long iters = (long)j->flops;
        for (long it = 0; it < iters; it++)
            for (int k = 0; k < 16; k++)
                a[k] = a[k] * b + c;
        float s = 0;
        for (int k = 0; k < 16; k++)
            s += a[k];
        j->acc = s;
    }
    return NULL;
}

/* Runs nt workers over jobs; returns elapsed seconds or < 0 on failure. */
static double run_jobs(struct probe_job *jobs, int nt)
{
    pthread_t th[256];
    double t0 = now_s();
    int started = 0;
    for (int i = 1; i < nt; i++) {
        if (pthread_create(&th[i], NULL, probe_worker, &jobs[i]))
            break;
        started = i;
    }
    probe_worker(&jobs[0]);
    for (int i = 1; i <= started; i++)
        pthread_join(th[i], NULL);
    if (started != nt - 1)
        return -1;
    return now_s() - t0;
}

static uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f)
        return 0;
    char line[256];
    uint64_t kb = 0;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "MemAvailable:", 13)) {
            char *end;
            unsigned long long v = strtoull(line + 13, &end, 10);
            if (end != line + 13)
                kb = v;
            break;
        }
    fclose(f);
    return kb * 1024;
}

static void bench_usage(FILE *f)
{
    fprintf(f, "usage: kvasir bench --probe [--name NAME] [--threads N] [--mib M] [--addr HOST:PORT] [--key FILE]\n"
               "                          [--backend cpu|opencl] [--device N]\n"
               "  prints a device object for the planner's inventory (docs/PLAN.md); lists the OpenCL\n"
               "  devices found on stderr (their index is --device N of stage, run, serve, eval)\n"
               "  --backend opencl  measure OpenCL device N (--device, default 0) instead of the CPU:\n"
               "               backend \"opencl\", mem_bytes its memory, decode_gbps its read bandwidth,\n"
               "               prefill_gflops its multiply-add rate\n"
               "  --threads N  threads to stream and compute with (default: online CPUs)\n"
               "  --mib M      buffer to stream, MiB (default 512)\n"
               "  --addr HOST:PORT  where this device's stage will listen (the manifest's listen/next)\n"
               "  --name NAME  the device's name in the inventory (default: the host name)\n"
               "  --key FILE   this node's key (kvasir key gen): its public key goes into the entry as \"key\"\n"
               "Measured: mem_bytes (available memory), decode_gbps (read bandwidth), prefill_gflops.\n"
               "Not measured: rtt_ms 1.0, bandwidth_mbps 1000 and accepts_inbound true are defaults\n"
               "for a LAN; edit them for this device's network (a phone behind NAT: accepts_inbound\n"
               "false, its relay RTT; docs/PLAN.md).\n");
}

/* Writes s as a JSON string body (escapes quotes, backslashes, controls). */
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

/* The OpenCL devices, one line each on stderr (or why there are none). */
static void list_opencl(void)
{
    struct kvs_ocl_device_info d[16];
    int n = 0;
    char err[512] = "";
    if (kvs_ocl_devices(d, 16, &n, err, sizeof err)) {
        fprintf(stderr, "kvasir bench: OpenCL: %s\n", err);
        return;
    }
    for (int i = 0; i < n && i < 16; i++)
        fprintf(stderr, "kvasir bench: OpenCL device %d: %s (%s, %s), %s, %.0f MiB, largest buffer %.0f MiB, %u compute units\n",
                i, d[i].name, d[i].platform, d[i].version, d[i].gpu ? "GPU" : "not a GPU",
                (double)d[i].global_mem / 1048576.0, (double)d[i].max_alloc / 1048576.0, d[i].compute_units);
}

/* bench --probe --backend opencl: the device entry measured on OpenCL device `device`. */
static int probe_opencl(int device, size_t bytes, const char *name, const char *addr, const char *key_hex)
{
    char err[4096] = "";
    struct kvs_ocl *c = NULL;
    kvs_err e = kvs_ocl_open(device, &c, err, sizeof err);
    if (e) {
        fprintf(stderr, "kvasir bench: --backend opencl: %s\n", err);
        return 1;
    }
    double gbps = 0, gflops = 0;
    if ((e = kvs_ocl_measure(c, bytes, &gbps, &gflops, err, sizeof err))) {
        fprintf(stderr, "kvasir bench: measuring OpenCL device %d: %s\n", device, err);
        kvs_ocl_close(c);
        return 1;
    }
    const struct kvs_ocl_device_info *di = kvs_ocl_info(c);
    printf("{\"name\": ");
    json_str(stdout, name);
    printf(", \"backend\": \"opencl\", \"device\": %d, \"device_name\": ", device);
    json_str(stdout, di->name);
    printf(", \"mem_bytes\": %llu, \"decode_gbps\": %.3f, \"prefill_gflops\": %.3f, \"rtt_ms\": 1.0, "
           "\"bandwidth_mbps\": 1000, \"accepts_inbound\": true",
           (unsigned long long)di->global_mem, gbps, gflops);
    if (addr) {
        printf(", \"addr\": ");
        json_str(stdout, addr);
    }
    if (key_hex[0]) printf(", \"key\": \"%s\"", key_hex);
    printf("}\n");
    fprintf(stderr, "kvasir bench: rtt_ms, bandwidth_mbps and accepts_inbound are LAN defaults, not measured: "
                    "edit them for this device's network (docs/PLAN.md)\n");
    kvs_ocl_close(c);
    return 0;
}

int kvs_cli_bench(int argc, char **argv)
{
    bool probe = false;
    const char *addr = NULL, *key_path = NULL;
    char name[64];
    if (gethostname(name, sizeof name) != 0)
        snprintf(name, sizeof name, "this-machine");
    name[sizeof name - 1] = '\0';
    long nproc = sysconf(_SC_NPROCESSORS_ONLN);
    long threads = nproc > 0 ? (nproc > 256 ? 256 : nproc) : 1, mib = 512;
    int backend = 0, device = 0, bad = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            bench_usage(stdout);
            return 0;
        } else if (v && kvs_cli_backend_opt(a, v, &backend, &device, &bad)) {
            if (bad) {
                fprintf(stderr, "kvasir bench: bad value for %s: %s\n", a, v);
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--probe")) {
            probe = true;
        } else if (!strcmp(a, "--name") && v) {
            if (strlen(v) == 0 || strlen(v) >= sizeof name) {
                fprintf(stderr, "kvasir bench: --name must be 1..63 bytes\n");
                return 2;
            }
            snprintf(name, sizeof name, "%s", v);
            i++;
        } else if (!strcmp(a, "--threads") && v) {
            if (kvs_cli_parse_long(v, 1, 256, &threads)) {
                fprintf(stderr, "kvasir bench: --threads must be 1..256\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--mib") && v) {
            if (kvs_cli_parse_long(v, 1, 65536, &mib)) {
                fprintf(stderr, "kvasir bench: --mib must be 1..65536\n");
                return 2;
            }
            i++;
        } else if (!strcmp(a, "--addr") && v) {
            addr = v;
            i++;
        } else if (!strcmp(a, "--key") && v) {
            key_path = v;
            i++;
        } else {
            fprintf(stderr, "kvasir bench: unknown option %s\n", a);
            bench_usage(stderr);
            return 2;
        }
    }
    if (!probe) {
        bench_usage(stderr);
        return 2;
    }
    char key_hex[KVS_KEY_PUB_HEX + 1] = "";
    if (key_path) { /* read first: a bad key file should not cost a measurement */
        struct kvs_key *k;
        char err[512];
        kvs_err e = kvs_key_load(key_path, &k, err, sizeof err);
        if (e) {
            fprintf(stderr, "kvasir bench: %s (%s)\n", err, kvs_strerror(e));
            return 1;
        }
        uint8_t pub[KVS_KEY_PUB_BYTES];
        kvs_key_public(k, pub);
        kvs_key_public_hex(pub, key_hex);
        kvs_key_free(k);
    }
    list_opencl();
    if (backend) return probe_opencl(device, (size_t)mib << 20, name, addr, key_hex);
    size_t bytes = (size_t)mib << 20;
    size_t words = bytes / sizeof(uint64_t);
    uint64_t *buf = malloc(bytes);
    struct probe_job *jobs = calloc((size_t)threads, sizeof *jobs);
    if (!buf || !jobs) {
        fprintf(stderr, "kvasir bench: cannot allocate %ld MiB\n", mib);
        free(buf);
        free(jobs);
        return 1;
    }
    for (size_t i = 0; i < words; i++) /* touch every page; not constant, so not a zero page */
        buf[i] = i * 0x9E3779B97F4A7C15ull;
    double best = 1e30;
    uint64_t sink = 0;
    for (int pass = 0; pass < 3; pass++) {
        size_t per = words / (size_t)threads;
        for (long t = 0; t < threads; t++) {
            jobs[t].mode = 0;
            jobs[t].p = buf + (size_t)t * per;
            jobs[t].n = t == threads - 1 ? words - (size_t)t * per : per;
        }
        double s = run_jobs(jobs, (int)threads);
        if (s < 0) {
            fprintf(stderr, "kvasir bench: cannot start threads\n");
            free(buf);
            free(jobs);
            return 1;
        }
        for (long t = 0; t < threads; t++)
            sink ^= jobs[t].sum;
        if (s < best)
            best = s;
    }
    double gbps = (double)bytes / best / 1e9;
    const double iters = 2e7; /* per thread: 16 FMAs each = 6.4e8 FLOPs */
    for (long t = 0; t < threads; t++) {
        jobs[t].mode = 1;
        jobs[t].flops = iters;
    }
    double fs = run_jobs(jobs, (int)threads);
    double gflops = fs > 0 ? iters * 16 * 2 * (double)threads / fs / 1e9 : 0;
    float acc = 0;
    for (long t = 0; t < threads; t++)
        acc += jobs[t].acc;
    free(buf);
    free(jobs);

    printf("{\"name\": ");
    json_str(stdout, name);
    printf(", \"backend\": \"cpu\", \"mem_bytes\": %llu, \"decode_gbps\": %.3f, \"prefill_gflops\": %.3f, "
           "\"threads\": %ld, \"rtt_ms\": 1.0, \"bandwidth_mbps\": 1000, \"accepts_inbound\": true",
           (unsigned long long)mem_available(), gbps, gflops, threads);
    if (addr) {
        printf(", \"addr\": ");
        json_str(stdout, addr);
    }
    if (key_hex[0]) printf(", \"key\": \"%s\"", key_hex);
    printf("}\n");
    fprintf(stderr, "kvasir bench: rtt_ms, bandwidth_mbps and accepts_inbound are LAN defaults, not measured: "
                    "edit them for this device's network (docs/PLAN.md)\n");
    /* Keep the measured loops from being optimised away. */
    if (sink == 42 && acc == 42.0f)
        fprintf(stderr, " ");
    return 0;
}

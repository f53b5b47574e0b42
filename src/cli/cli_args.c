/* Number arguments shared by the subcommands (see cli.h). */
#include <errno.h>
#include <sched.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>
#include <stdlib.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "shard/shard.h"
#include <stdio.h>

int kvs_cli_parse_long(const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

int kvs_cli_parse_float(const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return -1;
    *out = v;
    return 0;
}

uint64_t kvs_cli_random_seed(void)
{
    uint64_t s = 0;
    if (getrandom(&s, sizeof s, GRND_NONBLOCK) != (ssize_t)sizeof s) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        s = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    }
    return s >> 1; /* printable and re-enterable as a non-negative decimal */
}

int kvs_cli_parse_seed(const char *s, uint64_t *out)
{
    if (!strcmp(s, "-1")) {
        *out = kvs_cli_random_seed();
        return 0;
    }
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] < '0' || s[0] > '9') return -1; /* strtoull takes " -5" */
    *out = (uint64_t)v;
    return 0;
}

int kvs_cli_need_whole_model(const struct kvs_gguf *g, const char *who, const char *path)
{
    uint32_t b, e, n = 0;
    if (!kvs_shard_window(g, &b, &e)) return 0;
    if (kvs_shard_block_count(g, &n) == KVS_OK && b == 0 && e == n) return 0;
    char d[256];
    if (kvs_shard_describe(g, d, sizeof d) != KVS_OK) snprintf(d, sizeof d, "window [%u,%u)", b, e);
    fprintf(stderr,
            "kvasir %s: %s is a stage shard (%s), not a whole model; %s needs every block. Serve the shard "
            "as one stage of a ring: kvasir stage -m %s --window %u:%u --listen HOST:PORT --next HOST:PORT\n",
            who, path, d, who, path, b, e);
    return 1;
}

double kvs_cli_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

long kvs_cli_default_threads(void)
{
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        int n = CPU_COUNT(&set);
        if (n > 0) return n > 512 ? 512 : n;
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (n > 512 ? 512 : n) : 1;
}

void kvs_cli_print_summary(const struct kvs_cli_summary *s)
{
    char line[768];
    size_t k = 0;
#define ADD(...) k += (size_t)snprintf(line + k, k < sizeof line ? sizeof line - k : 0, __VA_ARGS__)
    ADD("summary:");
    if (s->load_ms >= 0) ADD(" load %.1f ms |", s->load_ms);
    if (s->n_requests > 1 || s->n_failed)
        ADD(" %lld requests (%lld failed) |", (long long)s->n_requests, (long long)s->n_failed);
    ADD(" prompt %lld tokens in %.1f ms (%.1f tok/s) |", (long long)s->n_prompt, s->prompt_ms,
        s->prompt_ms > 0 ? (double)s->n_prompt * 1e3 / s->prompt_ms : 0.0);
    ADD(" generated %lld tokens, %lld decode steps in %.1f ms (%.1f tok/s)", (long long)s->n_gen,
        (long long)s->n_decode, s->decode_ms, s->decode_ms > 0 ? (double)s->n_decode * 1e3 / s->decode_ms : 0.0);
    if (s->wall_ms > 0)
        ADD(", %.1f tok/s overall", (double)s->n_gen * 1e3 / s->wall_ms);
    ADD(" | time to first token %.1f ms%s\n", s->ttft_ms, s->n_requests > 1 ? " (median)" : "");
#undef ADD
    if (k >= sizeof line) {
        line[sizeof line - 2] = '\n';
        line[sizeof line - 1] = '\0';
    }
    fputs(line, stderr);
}

int kvs_cli_api_key(const char *key, const char *file, char *buf, size_t cap, const char *who)
{
    buf[0] = '\0';
    if (key && file) {
        fprintf(stderr, "kvasir %s: give --api-key or --api-key-file, not both\n", who);
        return -1;
    }
    if (!key && !file) return 0;
    if (file) {
        FILE *f = fopen(file, "re");
        if (!f) {
            fprintf(stderr, "kvasir %s: cannot read --api-key-file %s: %s\n", who, file, strerror(errno));
            return -1;
        }
        if (!fgets(buf, (int)cap, f)) buf[0] = '\0';
        fclose(f);
        size_t n = strlen(buf);
        while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r')) buf[--n] = '\0';
    } else {
        snprintf(buf, cap, "%s", key);
    }
    size_t n = strlen(buf);
    bool ok = n >= 1 && n <= 255;
    for (size_t i = 0; ok && i < n; i++) ok = buf[i] > ' ' && buf[i] < 127;
    if (!ok) {
        fprintf(stderr, "kvasir %s: an API key must be 1..255 bytes of visible ASCII (no spaces)\n", who);
        buf[0] = '\0';
        return -1;
    }
    return 0;
}

int kvs_cli_backend_opt(const char *a, const char *v, int *backend, int *device, int *bad)
{
    if (!strcmp(a, "--backend")) {
        *bad = 0;
        if (!strcmp(v, "cpu")) *backend = 0;
        else if (!strcmp(v, "opencl")) *backend = 1;
        else *bad = 1;
        return 1;
    }
    if (!strcmp(a, "--device")) {
        long d = 0;
        *bad = kvs_cli_parse_long(v, 0, 63, &d) != 0;
        if (!*bad) *device = (int)d;
        return 1;
    }
    return 0;
}

/* bench_trust: what TLS on every link costs a ring. A 4-stage ring on
 * loopback (the head in this process, ranks 1..3 as `kvasir stage`
 * processes, 2 compute threads each) is started alternately with
 * throw-away node keys (TLS 1.3 on every link, the default) and with
 * --insecure (plaintext), on the Qwen3-0.6B-shaped Q8_0 model of bench_ring
 * (made by `kvasir gguf synth` if absent; --model picks another).
 *
 * Per round and mode it measures, after a warm-up request:
 *  - decode tok/s of one greedy sequence (time between its first and last
 *    TOKEN event, --tokens tokens);
 *  - the idle ring's probe hop latencies (kvs_stage_ring_stats: send on one
 *    stage -> read on the next, from two fresh probe trails), averaged over the
 *    4 hops.
 * Rounds alternate which mode goes first, so drift in the machine's load
 * falls on both. Prints per-round figures, the medians, the median of the
 * rounds' ratios TLS / insecure (target >= 0.97), the added latency per hop (from the probe
 * hops, and from the decode time per token spread over the 4 hops), and
 *   RESULT tls_ratio=.. tls_tps=.. insecure_tps=.. added_hop_ms_probe=.. added_hop_ms_decode=..
 *
 * usage: bench_trust [--model PATH] [--kvasir PATH] [--threads N] [--tokens N] [--rounds R]
 * Exit status: 0 when the target passes, 1 when it fails, 2 on error. */
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench_util.h"
#include "gguf/gguf.h"
#include "lib/bench_ring4.h"
#include "model/model.h"
#include "stage/stage.h"

#define N_STAGES KVS_BENCH_RING4_STAGES
#define N_PROMPT 8
#define N_CTX 256
#define MAX_ROUNDS 15
#define TARGET_RATIO 0.97

/* Mean hop latency (ms) of the idle ring over two fresh probe trails. */
static double probe_hop_ms(struct kvs_stage *head)
{
    double sum = 0;
    int n = 0;
    for (int k = 0; k < 2; k++) {
        poll(NULL, 0, 1200); /* probes go every second */
        struct kvs_stage_hop h[N_STAGES + 1];
        int m = kvs_stage_ring_stats(head, h, N_STAGES + 1, NULL);
        for (int i = 0; i < m && m == N_STAGES; i++) {
            sum += h[i].hop_ms;
            n++;
        }
    }
    return n ? sum / n : -1;
}

int main(int argc, char **argv)
{
    const char *model_path = KVS_BENCH_QWEN3_Q8_0, *kvasir = getenv("KVASIR_BIN");
    int n_threads = 2, n_tok = 32, rounds = 5;
    setenv("KVASIR_LOG", "warn", 0); /* the stages' start-up lines would drown the figures */
    char kvasir_buf[PATH_MAX + 16];
    if (kvs_bench_ring_args(argc, argv, "bench_trust", &model_path, &kvasir, &n_threads, &n_tok,
                            N_CTX - N_PROMPT - 1, &rounds, MAX_ROUNDS))
        return 2;
    if (!(kvasir = kvs_bench_kvasir(kvasir, kvasir_buf, sizeof kvasir_buf)) ||
        kvs_bench_model("bench_trust", kvasir, model_path, "q8_0"))
        return 2;
    char eb[512];
    struct kvs_gguf *gg = NULL;
    struct kvs_hparams hp;
    if (kvs_gguf_open(model_path, &gg, eb, sizeof eb) || kvs_hparams_read(gg, &hp, eb, sizeof eb)) {
        fprintf(stderr, "bench_trust: %s: %s\n", model_path, eb);
        return 2;
    }
    kvs_gguf_close(gg);
    int32_t prompt[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) prompt[i] = (int32_t)((i * 7919 + 13) % (int32_t)hp.n_vocab);
    printf("model: %s (%s, %u blocks, n_embd %u), %d-stage loopback ring, %d threads per stage, %d decode tokens, "
           "%d rounds\n", model_path, hp.arch_name, hp.n_block, hp.n_embd, N_STAGES, n_threads, n_tok, rounds);
    fflush(stdout);

    double tps[2][MAX_ROUNDS], hop[2][MAX_ROUNDS]; /* [0] insecure, [1] TLS */
    for (int r = 0; r < rounds; r++) {
        for (int k = 0; k < 2; k++) {
            int keyed = (r + k) % 2; /* alternate which mode goes first */
            struct kvs_bench_ring4 g;
            struct kvs_bench_ring4_opts o = { .who = "bench_trust", .kvasir = kvasir, .model = model_path,
                                              .n_block = hp.n_block, .n_threads = n_threads, .n_ctx = N_CTX,
                                              .keyed = keyed };
            if (kvs_bench_ring4_start(&g, &o) ||
                kvs_bench_decode_tps(g.head, prompt, N_PROMPT, 4, "bench_trust") < 0 /* warm-up: faults the weights in */) {
                kvs_bench_ring4_stop(&g);
                return 2;
            }
            double t = kvs_bench_decode_tps(g.head, prompt, N_PROMPT, n_tok + 1, "bench_trust");
            double h = probe_hop_ms(g.head);
            kvs_bench_ring4_stop(&g);
            if (t < 0) return 2;
            tps[keyed][r] = t;
            hop[keyed][r] = h;
            printf("round %d %-8s decode %8.2f tok/s   idle probe hop %.3f ms\n", r + 1, keyed ? "TLS" : "insecure",
                   t, h);
            fflush(stdout);
        }
    }
    double pair[MAX_ROUNDS]; /* each round's TLS / insecure: the two rings ran back to back */
    for (int r = 0; r < rounds; r++) pair[r] = tps[1][r] / tps[0][r];
    double ratio = kvs_bench_median(pair, rounds);
    double ti = kvs_bench_median(tps[0], rounds), tt = kvs_bench_median(tps[1], rounds);
    double hi = kvs_bench_median(hop[0], rounds), ht = kvs_bench_median(hop[1], rounds);
    double added_decode = (1.0 / tt - 1.0 / ti) * 1e3 / N_STAGES;
    printf("median decode: TLS %.2f tok/s, insecure %.2f tok/s; median of the rounds' TLS / insecure: %.3f\n", tt, ti,
           ratio);
    printf("added latency per hop: %.3f ms from the idle probes (TLS %.3f, insecure %.3f ms); %.3f ms from the decode "
           "time per token over %d hops\n", ht - hi, ht, hi, added_decode, N_STAGES);
    bool pass = ratio >= TARGET_RATIO;
    printf("%s TLS / insecure decode %.3f (target >= %.2f)\n", pass ? "PASS" : "FAIL", ratio, TARGET_RATIO);
    printf("RESULT tls_ratio=%.3f tls_tps=%.2f insecure_tps=%.2f added_hop_ms_probe=%.3f added_hop_ms_decode=%.3f\n",
           ratio, tt, ti, ht - hi, added_decode);
    return pass ? 0 : 1;
}

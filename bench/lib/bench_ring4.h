/* The 4-stage loopback ring that bench_trust and bench_relay compare two ways
 * of running: the head stage in the calling process (a thread runs its loop),
 * ranks 1..3 as `kvasir stage` processes, each with n_threads compute threads,
 * one sequence slot and a small context; windows split the blocks evenly.
 * Also the pieces every benchmark repeats: finding the kvasir binary,
 * synthesizing the benchmarks' Qwen3-0.6B-shaped model, and timing one greedy
 * request through a head. */
#ifndef KVS_BENCH_RING4_H
#define KVS_BENCH_RING4_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "model/model.h"
#include "stage/stage.h"
#include "trust/trust.h"

#define KVS_BENCH_RING4_STAGES 4
/* The Qwen3-0.6B-shaped Q8_0 model the ring benchmarks share (kvs_bench_model). */
#define KVS_BENCH_QWEN3_Q8_0 "/tmp/kvasir-bench-qwen3-0.6b-q8_0.gguf"

/* The kvasir binary: `given` when non-NULL, else the file "kvasir" in the
 * directory of this program (/proc/self/exe), written into buf. NULL if that
 * cannot be read. */
const char *kvs_bench_kvasir(const char *given, char *buf, size_t cap);

/* Runs argv (argv[0] is the program's path) and waits: 0 if it exited 0, -1
 * otherwise (a message naming `who` on stderr). */
int kvs_bench_spawn_wait(const char *who, char *const argv[]);

/* Creates, with `kvasir gguf synth` unless path exists, the benchmarks'
 * Qwen3-0.6B-shaped model: qwen3, n_embd 1024, 28 blocks, 16 query / 8 KV
 * heads of 128, FFN 3072, vocabulary 151,936, tied output, context 4096,
 * seed 1, weights of `type` (a synth --type name, e.g. "q8_0"). 0 or -1. */
int kvs_bench_model(const char *who, const char *kvasir, const char *path, const char *type);

/* Submits one greedy request (prompt of n_prompt ids, max_tokens, EOS
 * ignored) to head and waits for it: decode tok/s between its first and last
 * TOKEN event, or < 0 if it failed (message naming `who`). */
double kvs_bench_decode_tps(struct kvs_stage *head, const int32_t *prompt, int n_prompt, int max_tokens,
                            const char *who);

/* A running ring; zero it (or let start do so) before use. */
struct kvs_bench_ring4 {
    pid_t pids[KVS_BENCH_RING4_STAGES]; /* [0] unused: the head runs here */
    struct kvs_stage *head;
    pthread_t th;
    bool running, keyed;
    char key_dir[64], key_path[KVS_BENCH_RING4_STAGES][96], key_hex[KVS_BENCH_RING4_STAGES][KVS_KEY_PUB_HEX + 1];
    struct kvs_key *keys[KVS_BENCH_RING4_STAGES];
};

struct kvs_bench_ring4_opts {
    const char *who;     /* program name for messages */
    const char *kvasir;  /* the kvasir binary (stages) */
    const char *model;   /* GGUF path */
    uint32_t n_block;
    int n_threads, n_ctx;
    bool keyed;          /* fresh node keys, TLS between them on every link; else --insecure */
    /* NULL: direct TCP links on free loopback ports. Else the URL of the edge
     * into rank r (from rank r-1, r = 0 meaning from the tail), for both ends. */
    void (*edge_url)(const void *ctx, int r, char *out, size_t cap);
    const void *edge_ctx;
    const char *relay_ca; /* with edge_url: the relay's certificate (PEM path) */
};

/* Starts the ring and waits (up to 120 s) until it is closed. 0, or -1 with
 * what it had started left for kvs_bench_ring4_stop to clean up. */
int kvs_bench_ring4_start(struct kvs_bench_ring4 *g, const struct kvs_bench_ring4_opts *o);
/* Stops the head, SIGTERMs and reaps the stage processes, removes the keys. */
void kvs_bench_ring4_stop(struct kvs_bench_ring4 *g);

/* The ring benchmarks' shared command line: [--model PATH] [--kvasir PATH]
 * [--threads N (1..256)] [--tokens N (4..max_tokens)] [--rounds R (1..max_rounds)].
 * Fills the pointers it is given with what was passed; 0, or 2 after
 * printing "usage: WHO ..." / "WHO: ARG: out of range". */
int kvs_bench_ring_args(int argc, char **argv, const char *who, const char **model, const char **kvasir,
                        int *n_threads, int *n_tok, int max_tokens, int *rounds, int max_rounds);

#endif

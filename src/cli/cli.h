/* Subcommands of the kvasir binary. Each is a thin wrapper over the modules:
 * it parses its arguments, calls the library and maps errors to exit codes
 * (0 ok, 1 runtime error, 2 usage error). Each prints its usage on --help. */
#ifndef KVS_CLI_H
#define KVS_CLI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvs_cli_command {
    const char *name;     /* first word, e.g. "run" or "gguf" */
    const char *summary;  /* one line for `kvasir --help` */
    int (*main)(int argc, char **argv); /* argv[0] is the subcommand name */
};

/* Register new subcommands in the table in src/cli/main.c. */
int kvs_cli_gguf(int argc, char **argv);     /* gguf info | gguf synth */
int kvs_cli_run(int argc, char **argv);      /* run a prompt (single process or --ring N) */
int kvs_cli_eval(int argc, char **argv);     /* teacher-forced top-k probabilities */
int kvs_cli_tokenize(int argc, char **argv); /* text -> token ids */
int kvs_cli_gguf_synth(int argc, char **argv); /* gguf synth (called by kvs_cli_gguf) */
int kvs_cli_stage(int argc, char **argv);    /* run one ring stage */
int kvs_cli_serve(int argc, char **argv);    /* local ring + OpenAI API */
int kvs_cli_shard(int argc, char **argv);    /* shard extract | index | fetch */
int kvs_cli_seed(int argc, char **argv);     /* HTTP file server with ranges */
int kvs_cli_plan(int argc, char **argv);     /* rank manifest from devices */
int kvs_cli_bench(int argc, char **argv);    /* bench --probe */
int kvs_cli_relay(int argc, char **argv);    /* WebSocket relay for ring edges */
int kvs_cli_key(int argc, char **argv);      /* key gen | key show */
int kvs_cli_market(int argc, char **argv);   /* the market service | market add */
int kvs_cli_join(int argc, char **argv);     /* enroll through a market and serve a window */

/* Option values. kvs_cli_parse_long reads a whole decimal integer in [lo, hi];
 * kvs_cli_parse_float a whole finite float (not NaN, not infinity). Both return 0 and set *out,
 * or return -1 (empty, trailing characters, out of range) and leave *out as it was. */
int kvs_cli_parse_long(const char *s, long lo, long hi, long *out);
/* Reads a relay secret file (docs/RELAY.md §4: 16..256 bytes, trailing newlines dropped) into
 * buf[cap]; *len its length. Returns 0, or -1 after printing why to stderr. */
int kvs_cli_read_secret(const char *path, uint8_t *buf, size_t cap, size_t *len);
int kvs_cli_parse_float(const char *s, float *out);

/* Sampling seeds. kvs_cli_random_seed: 63 random bits (getrandom, else the
 * clock and pid), the default when no --seed is given, as in llama.cpp.
 * kvs_cli_parse_seed reads a whole unsigned decimal, or -1 for a random seed;
 * returns 0 and sets *out, or -1 and leaves *out as it was. */
uint64_t kvs_cli_random_seed(void);
int kvs_cli_parse_seed(const char *s, uint64_t *out);

/* --- compute backend (run, serve, stage, eval, bench) --- */

/* If option a is `--backend cpu|opencl` or `--device N` (an OpenCL device
 * index, kvasir bench --probe lists them), parses v into *backend (0 cpu,
 * 1 opencl: enum kvs_backend) or *device and returns 1, setting *bad when v
 * is not valid; else returns 0. */
int kvs_cli_backend_opt(const char *a, const char *v, int *backend, int *device, int *bad);
#define KVS_CLI_BACKEND_HELP                                                                                   \
    "  --backend cpu|opencl  compute backend of the window (default cpu); opencl runs every block on an\n"     \
    "                        OpenCL device (weights uploaded once, KV cache on the device)\n"                  \
    "  --device N            OpenCL device index (default 0; kvasir bench --probe lists them)\n"

/* --- the summary after the text (run, run --ring, stage -p) --- */

/* Milliseconds on the monotonic clock. */
double kvs_cli_now_ms(void);
/* Cores this process may run on (sched_getaffinity), at least 1: the default
 * of --threads (a local ring of N stages gives each max(1, cores / N)). */
long kvs_cli_default_threads(void);

struct kvs_cli_summary {
    double load_ms;       /* process start (or ring start) to ready to compute; < 0 unknown */
    int64_t n_requests;   /* 1 for run; the prompts of --prompts */
    int64_t n_failed;
    int64_t n_prompt;     /* prompt tokens (all requests) */
    double prompt_ms;     /* submit to first token (prefill + one sample / ring trip), summed */
    int64_t n_gen;        /* generated tokens (all requests) */
    int64_t n_decode;     /* decode steps: generated tokens after each request's first */
    double decode_ms;     /* first token to last, summed over requests */
    double ttft_ms;       /* time to first token (one request), or the median over requests */
    double wall_ms;       /* several requests: first submit to last end (for tokens/s overall); else 0 */
};
/* Writes the summary to stderr in one write, llama.cpp-like, e.g.
 *   summary: load 12.3 ms | prompt 5 tokens in 3.2 ms (1562.5 tok/s) | generated 60 tokens,
 *   59 decode steps in 120.0 ms (491.7 tok/s) | time to first token 3.5 ms
 * (one line; several requests add "N requests (F failed)" and the overall tok/s). */
void kvs_cli_print_summary(const struct kvs_cli_summary *s);

/* --- models from a URL (src/cli/cli_model.c) --- */

/* True if s starts with http:// or https://. */
bool kvs_cli_is_url(const char *s);
/* The cache folder: given (--cache DIR) if not NULL/empty, else
 * $XDG_CACHE_HOME/kvasir (when absolute), else $HOME/.cache/kvasir. 0, or -1
 * when none can be named or it does not fit cap. Not created here. */
int kvs_cli_cache_dir(const char *given, char *out, size_t cap);
/* The cache file of url's window [begin, end) (0,0: the whole model) in
 * folder cache: CACHE/<first 16 hex of SHA-256(url)>-<file name of the URL's
 * path without .gguf>[.blkB-E].gguf. 0, or -1 if it does not fit. */
int kvs_cli_model_cache_path(const char *cache, const char *url, uint32_t begin, uint32_t end, char *out,
                             size_t cap);

/* Storage for kvs_cli_model_args: the cached path that replaces the URL in
 * argv (so it lives as long as argv is used) and the token header. */
struct kvs_cli_model_store {
    char path[4096];
    char auth[1024];
};
/* Pre-pass of run, serve, stage and eval over argv[1..*argc): removes
 * `--cache DIR`, `--header 'Name: value'` (repeatable) and `--hf-token TOKEN`
 * (default: $HF_TOKEN; sent as "Authorization: Bearer TOKEN"), and when
 * `-m/--model` is an http(s) URL, replaces it with the local file: the cached
 * copy if there is one (no request at all), else a download through
 * kvs_shard_fetch into the cache (progress on a terminal, resumable from
 * the .part files, verified against URL.kvindex.json when the server has it).
 * `stage` downloads only its window (--window, or its rank's in --manifest).
 * With --help nothing is downloaded. Header values are never logged.
 * Returns 0 (argv rewritten, *argc updated, argv[*argc] = NULL), 2 on a usage
 * error, 1 if the download failed (messages on stderr). */
int kvs_cli_model_args(const char *who, int *argc, char **argv, struct kvs_cli_model_store *st);
/* The usage lines of the options above, for each subcommand's --help. */
#define KVS_CLI_MODEL_URL_HELP                                                                              \
    "  -m URL               an http(s) GGUF URL (a Hugging Face resolve/... link, a `kvasir seed` server):\n" \
    "                       downloaded once into the cache (resumable; verified when URL.kvindex.json\n"    \
    "                       exists), reused after without any request\n"                                     \
    "  --cache DIR          model cache (default $XDG_CACHE_HOME/kvasir, else ~/.cache/kvasir)\n"            \
    "  --header 'N: V'      extra HTTP header for the download (repeatable; never logged)\n"                 \
    "  --hf-token TOKEN     sends 'Authorization: Bearer TOKEN' (default $HF_TOKEN; never logged)\n"

/* 0 when g holds the whole model (a full GGUF, or a shard of every block);
 * else prints to stderr that PATH is a stage shard, which window it holds
 * and how to serve it, and returns 1. who names the subcommand. */
/* The head's API key from --api-key KEY or --api-key-file FILE (its first
 * line, the newline stripped; one of the two at most) into buf[cap] ("" when
 * neither). Returns 0, or -1 after printing why (both given, unreadable
 * file, empty key, spaces or control bytes in it, over 255 bytes). */
int kvs_cli_api_key(const char *key, const char *file, char *buf, size_t cap, const char *who);

struct kvs_gguf;
int kvs_cli_need_whole_model(const struct kvs_gguf *g, const char *who, const char *path);

#endif

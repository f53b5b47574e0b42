/* Subcommands of the kvasir binary. Each is a thin wrapper over the modules:
 * it parses its arguments, calls the library and maps errors to exit codes
 * (0 ok, 1 runtime error, 2 usage error). Each prints its usage on --help. */
#ifndef KVS_CLI_H
#define KVS_CLI_H

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

/* Option values. kvs_cli_parse_long reads a whole decimal integer in [lo, hi];
 * kvs_cli_parse_float a whole finite float (not NaN, not infinity). Both return 0 and set *out,
 * or return -1 (empty, trailing characters, out of range) and leave *out as it was. */
int kvs_cli_parse_long(const char *s, long lo, long hi, long *out);
int kvs_cli_parse_float(const char *s, float *out);

/* Sampling seeds. kvs_cli_random_seed: 63 random bits (getrandom, else the
 * clock and pid), the default when no --seed is given, as in llama.cpp.
 * kvs_cli_parse_seed reads a whole unsigned decimal, or -1 for a random seed;
 * returns 0 and sets *out, or -1 and leaves *out as it was. */
uint64_t kvs_cli_random_seed(void);
int kvs_cli_parse_seed(const char *s, uint64_t *out);

/* 0 when g holds the whole model (a full GGUF, or a shard of every block);
 * else prints to stderr that PATH is a stage shard, which window it holds
 * and how to serve it, and returns 1. who names the subcommand. */
struct kvs_gguf;
int kvs_cli_need_whole_model(const struct kvs_gguf *g, const char *who, const char *path);

#endif

/* kvasir: entry point and subcommand dispatch. */
#include "cli/cli.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "proto/proto.h"

#ifndef KVS_VERSION
#define KVS_VERSION "unknown"
#endif

static const struct kvs_cli_command commands[] = {
    /* Keep sorted by name. Add one line per subcommand. */
    { "bench", "measure this machine (--probe) for the planner", kvs_cli_bench },
    { "eval", "evaluate token ids teacher-forced; JSON top-k per position", kvs_cli_eval },
    { "gguf", "inspect (info) or create (synth) GGUF files", kvs_cli_gguf },
    { "key", "make (gen) or print (show) a node's identity key", kvs_cli_key },
    { "join", "enroll this machine through a market: claim, fetch and serve a window", kvs_cli_join },
    { "market", "the self-enrollment market: listings, claims, leases, the map", kvs_cli_market },
    { "plan", "place a model's blocks on devices: write a rank manifest", kvs_cli_plan },
    { "relay", "WebSocket bridge for ring edges of stages behind NAT", kvs_cli_relay },
    { "run", "generate text from a prompt (one process, or a local ring)", kvs_cli_run },
    { "seed", "serve model files over HTTP with range requests", kvs_cli_seed },
    { "serve", "start a local ring and the OpenAI-compatible API", kvs_cli_serve },
    { "shard", "extract, index or fetch a stage's mini-GGUF", kvs_cli_shard },
    { "stage", "run one stage of a ring", kvs_cli_stage },
    { "tokenize", "print the token ids of a text", kvs_cli_tokenize },
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir <command> [options]   (kvasir <command> --help; kvasir --version)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
    fprintf(f, "\nlogs (stderr, one line each, UTC timestamps), with every command:\n"
               "  -v, --verbose        debug logs (KVASIR_LOG=debug), the stages of run --ring included\n"
               "  --log-level L        error | warn | info | debug (default info; run --ring's stage\n"
               "                       processes default to warn). KVASIR_LOG=L does the same.\n");
}

/* Flags without a value, so that `-v` after one of them is still an option. */
static bool is_flag(const char *a)
{
    static const char *const flags[] = { "--ignore-eos", "--help", "-h", "--no-ranges", "-v", "--verbose" };
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++)
        if (!strcmp(a, flags[i])) return true;
    return false;
}

/* Takes -v/--verbose and --log-level L out of argv[2..] (where they are
 * options, not the value of the option before them) and sets KVASIR_LOG,
 * which the stage processes of a local ring inherit. 0, or 2 on a bad level. */
static int log_args(int *argc, char **argv)
{
    int w = 2;
    for (int i = 2; i < *argc; i++) {
        const char *a = argv[i];
        bool opt_pos = argv[i - 1][0] != '-' || is_flag(argv[i - 1]) || i == 2;
        if (opt_pos && (!strcmp(a, "-v") || !strcmp(a, "--verbose"))) {
            setenv("KVASIR_LOG", "debug", 1);
            continue;
        }
        if (opt_pos && !strcmp(a, "--log-level")) {
            const char *v = i + 1 < *argc ? argv[i + 1] : "";
            if (strcmp(v, "error") && strcmp(v, "warn") && strcmp(v, "info") && strcmp(v, "debug")) {
                fprintf(stderr, "kvasir: --log-level wants error, warn, info or debug\n");
                return 2;
            }
            setenv("KVASIR_LOG", v, 1);
            i++;
            continue;
        }
        argv[w++] = argv[i];
    }
    argv[w] = NULL;
    *argc = w;
    return 0;
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "version")) {
        printf("kvasir %s (ring protocol %u, kernels %s)\n", KVS_VERSION, (unsigned)KVS_PROTO_VERSION,
               kvs_isa_name(kvs_kernels_isa(kvs_kernels_best())));
        return 0;
    }
    if (log_args(&argc, argv)) return 2;
    struct kvs_cli_model_store store; /* a downloaded model's path, in argv until the command returns */
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
        if (strcmp(argv[1], commands[i].name)) continue;
        int sub_argc = argc - 1;
        char **sub_argv = argv + 1;
        if (!strcmp(argv[1], "run") || !strcmp(argv[1], "serve") || !strcmp(argv[1], "stage") ||
            !strcmp(argv[1], "eval")) { /* -m URL, --cache, --header, --hf-token */
            int rc = kvs_cli_model_args(argv[1], &sub_argc, sub_argv, &store);
            if (rc) return rc;
        }
        return commands[i].main(sub_argc, sub_argv);
    }
    fprintf(stderr, "kvasir: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}

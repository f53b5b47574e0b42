/* Ring client helpers shared by `kvasir stage` (head with --prompts) and
 * `kvasir run --ring N` (src/cli/cli_ring.c). */
#ifndef KVS_CLI_RING_H
#define KVS_CLI_RING_H

#include <stdbool.h>
#include <stdint.h>

#include "sampler/sampler.h"
#include "stage/stage.h"

struct kvs_ring_client_opts {
    const char *prompt;       /* one prompt, streamed like `kvasir run`; or NULL */
    const char *prompts_path; /* one prompt per line ("-" = stdin); results as "#i ok TEXT" / "#i error MSG" */
    int32_t parallel;         /* requests in flight at once (prompts mode) */
    int32_t n_predict;
    bool ignore_eos;
    struct kvs_sampler_params sp;
    int ready_timeout_ms;     /* wait this long for the ring to close */
};

/* Runs the head's loop on a thread, waits for the ring, serves the prompts
 * through the request API, stops the loop. Returns a process exit code. */
int kvs_ring_client(struct kvs_stage *head, const struct kvs_ring_client_opts *o);

/* `kvasir run --ring N ...` (called from kvs_cli_run). */
int kvs_cli_run_ring(int argc, char **argv);

#endif

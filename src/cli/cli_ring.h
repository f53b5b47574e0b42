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
    double t_start_ms;        /* kvs_cli_now_ms at the start (the summary's load time: start to
                               * ring closed); 0: not shown */
    struct kvs_local_ring *children; /* a local ring's child stages: one that exits while the ring
                                      * closes ends the wait at once (NULL: none to watch) */
};

/* Parses one client option of a head (-p, --prompts, -n, --temp, --top-k,
 * --top-p, --min-p, --repeat-penalty, --seed, --parallel) with value v into co.
 * Returns false if `a` is not one of them; otherwise true, with *bad nonzero
 * when v is not a valid value. Shared by `kvasir run --ring` and `kvasir stage`. */
bool kvs_ring_client_opt(const char *a, const char *v, struct kvs_ring_client_opts *co, int *bad);

/* Runs the head's loop on a thread, waits for the ring, serves the prompts
 * through the request API, stops the loop. Returns a process exit code. */
int kvs_ring_client(struct kvs_stage *head, const struct kvs_ring_client_opts *o);

/* --- a local ring (run --ring N, serve --ring N) ---------------------------- */
#include <pthread.h>
#include <signal.h>
#include <sys/types.h>

struct kvs_local_ring_opts {
    const char *who;          /* "run" or "serve", for messages */
    const char *model;        /* GGUF path every stage opens */
    int n;                    /* stages, 2..n_block (1..n_block with allow_solo): an even split */
    bool allow_solo;          /* n = 1: the head holds every block, no child, no link (serve) */
    long threads, n_ctx, seqs, step_delay_ms;
    bool boundary_f32;
    int backend, device;      /* every stage's --backend (0 cpu, 1 opencl) and --device */
    bool insecure;            /* plaintext links (--insecure); otherwise throw-away keys, TLS on every link */
    const sigset_t *child_mask; /* signal mask the children start with (NULL: inherited) */
};

/* One child stage: its argument vector (kept for restarts) and supervision state. */
struct kvs_local_child {
    char *args[48];
    char self[4096], model[1024];
    char a_listen[64], a_next[64], a_win[64], a_thr[24], a_ctx[24], a_seq[24], a_delay[24], a_key[128];
    char a_dev[24];
    char a_prev_key[80], a_next_key[80];
    int block_begin, block_end;
    int64_t started_ms, restart_at_ms; /* kvs_link_now_ms */
    bool waiting;             /* exited: restart at restart_at_ms */
    int quick;                /* consecutive lives shorter than 10 s (backoff) */
    int restarts;
    /* a planned leave (docs/PROTOCOL.md §5.2): each child has a control socket (its fd 3) */
    char a_hand[128];         /* the rank's state file for --handover / --takeover */
    int n_args;               /* args[n_args]: "--takeover" for a replacement, else NULL */
    int ctl;                  /* the supervisor's end of the running child's control socket, -1 none */
    pid_t repl_pid;           /* a replacement started on its leave, 0 none */
    int repl_ctl;             /* its control socket, -1 none */
};

struct kvs_local_ring {
    int n;
    uint32_t n_block;
    int *ports;               /* [n] loopback ports, rank order */
    pid_t *pids;              /* [n] child pids; [0] (the head, in this process) is 0 */
    char head_listen[64], head_next[64];
    struct kvs_key *head_key; /* rank 0's throw-away key (NULL: insecure or one stage) */
    char key_dir[64];         /* mode-0700 folder of the children's throw-away key files, "" if none */
    char state_dir[64];       /* mode-0700 folder of the handover state files (a planned leave), "" if none */
    struct kvs_local_child *kids; /* [n]; [0] unused */
    char who[16];
    sigset_t child_mask;
    bool has_child_mask;
    pthread_mutex_t mu;       /* pids, kids and the flags below, between the caller and the supervisor */
    bool mu_init, supervise, sup_stop, sup_running;
    pthread_t sup;
    int restarts;             /* children restarted so far */
};

/* Starts ranks 1..n-1 as child `kvasir stage` processes (this binary) with
 * an even split of the model's blocks on free loopback ports, and fills the
 * head's (rank 0) window, addresses and settings into *head (strings point
 * into lr and o). Unless o->insecure, every rank gets a throw-away node key
 * (the children's in files under lr->key_dir) and the neighbours' public
 * keys, so every link is TLS between known keys. Returns 0, or an exit code (1 runtime, 2 usage) after
 * printing the error and stopping what it started. */
int kvs_local_ring_start(const struct kvs_local_ring_opts *o, struct kvs_local_ring *lr,
                         struct kvs_stage_params *head);
/* Reaps children that exited (logging each); returns how many did. Under
 * supervision (kvs_local_ring_supervise) it also restarts them: the same
 * command line (window, port, key), at once, or after 250 ms doubling to 8 s
 * when it keeps crashing within 10 s of its start (a SIGTERM or exit 0 is a
 * planned leave: replaced at once); a log line for each exit and each
 * restart. It also answers the children's control sockets (docs/PROTOCOL.md
 * §5.2): a child that says "leave" (SIGTERM) gets a replacement started at
 * once with --takeover (under supervision; else "no": it stops as before),
 * and "go" once that replacement says "ready"; the leaving child's exit then
 * hands its rank to the replacement instead of a restart. Thread-safe. */
int kvs_local_ring_poll_children(struct kvs_local_ring *lr);
/* Starts the supervisor: a thread that polls the children every 50 ms and
 * restarts those that die, until kvs_local_ring_stop. Returns 0, or 1 (after
 * a message) if the thread cannot start. A no-op for a one-stage ring. */
int kvs_local_ring_supervise(struct kvs_local_ring *lr);
/* Stops the supervisor, then SIGTERM to every child, reaped within 3 s (then SIGKILL); frees lr's
 * arrays, key and key files. */
void kvs_local_ring_stop(struct kvs_local_ring *lr);

/* `kvasir run --ring N ...` (called from kvs_cli_run). */
int kvs_cli_run_ring(int argc, char **argv);

#endif

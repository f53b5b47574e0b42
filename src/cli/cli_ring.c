/* `kvasir run --ring N`: a local ring of N stages (this process is the head,
 * ranks 1..N-1 are child processes of the same binary), and the ring client
 * used by it and by `kvasir stage --prompts`. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/cli_ring.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "link/link.h"
#include "model/model.h"
#include "tokenizer/tokenizer.h"

/* --- client --------------------------------------------------------------------- */

struct creq {
    int idx;
    uint32_t id;
    int32_t *toks; /* [cap] generated ids (cap = n_predict) */
    int32_t n_toks, cap;
    bool done;
    kvs_err err;
    char msg[512];
    int32_t n_prompt;
    double t_submit, t_first, t_end; /* kvs_cli_now_ms; t_first < 0 until the first token */
};

struct client {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_done_unseen;
};

struct cb_ctx {
    struct client *c;
    struct creq *r;
};

static void on_event(void *user, const struct kvs_stage_event *ev)
{
    struct cb_ctx *x = user;
    pthread_mutex_lock(&x->c->mu);
    if (ev->kind == KVS_STAGE_EVENT_TOKEN) {
        if (x->r->t_first < 0) x->r->t_first = kvs_cli_now_ms();
        if (x->r->n_toks < x->r->cap) x->r->toks[x->r->n_toks++] = ev->token;
    } else {
        x->r->t_end = kvs_cli_now_ms();
        x->r->done = true;
        x->r->err = ev->kind == KVS_STAGE_EVENT_ERROR ? ev->err : KVS_OK;
        if (x->r->err) snprintf(x->r->msg, sizeof x->r->msg, "%s", ev->message ? ev->message : "");
        x->c->n_done_unseen++;
    }
    pthread_mutex_unlock(&x->c->mu);
    pthread_cond_broadcast(&x->c->cv);
}

static void *loop_thread(void *arg)
{
    kvs_stage_run(arg);
    return NULL;
}

static int32_t *tokenize(const struct kvs_tokenizer *tok, const char *text, int32_t *n)
{
    size_t len = strlen(text);
    bool bos = kvs_tokenizer_add_bos(tok);
    int64_t k = kvs_tokenize(tok, text, len, bos, true, NULL, 0);
    if (k <= 0 || k > (1 << 20)) return NULL;
    int32_t *ids = malloc((size_t)k * sizeof *ids);
    if (!ids || kvs_tokenize(tok, text, len, bos, true, ids, k) != k) {
        free(ids);
        return NULL;
    }
    *n = (int32_t)k;
    return ids;
}

/* Submits text as request r. Returns false (r done with an error) on failure. */
static bool submit(struct kvs_stage *head, const struct kvs_ring_client_opts *o, const char *text, struct cb_ctx *cx)
{
    struct creq *r = cx->r;
    r->t_submit = kvs_cli_now_ms();
    r->t_first = -1.0;
    r->cap = o->n_predict > 0 ? o->n_predict : 1;
    r->toks = calloc((size_t)r->cap, sizeof(int32_t));
    int32_t n = 0;
    int32_t *ids = tokenize(kvs_stage_tokenizer(head), text, &n);
    r->n_prompt = n;
    kvs_err e = (!ids || !r->toks) ? KVS_ERR_ARG : KVS_OK;
    if (!e) {
        struct kvs_stage_request q = { .prompt = ids, .n_prompt = n, .sampling = o->sp,
                                       .max_tokens = o->n_predict > 0 ? o->n_predict : 1,
                                       .ignore_eos = o->ignore_eos, .on_event = on_event, .user = cx };
        e = kvs_stage_submit(head, &q, &r->id);
    }
    free(ids);
    if (e) {
        pthread_mutex_lock(&cx->c->mu);
        r->done = true;
        r->err = e;
        if (e == KVS_ERR_RANGE && n >= kvs_stage_n_ctx(head)) /* the words of `kvasir run` */
            snprintf(r->msg, sizeof r->msg, "the prompt (%d tokens) does not fit the context (%d)", (int)n,
                     (int)kvs_stage_n_ctx(head));
        else
            snprintf(r->msg, sizeof r->msg, "cannot submit: %s", kvs_strerror(e));
        cx->c->n_done_unseen++;
        pthread_mutex_unlock(&cx->c->mu);
        return false;
    }
    return true;
}

/* Adds a finished request to the summary (under the client's mutex or after the loop). */
static void sum_add(struct kvs_cli_summary *s, const struct creq *r)
{
    s->n_requests++;
    if (r->err) s->n_failed++;
    s->n_gen += r->n_toks;
    if (r->t_first >= 0) { /* its prompt was run (a refused one is only counted as failed) */
        s->n_prompt += r->n_prompt;
        s->prompt_ms += r->t_first - r->t_submit;
        if (r->n_toks > 1) {
            s->n_decode += r->n_toks - 1;
            s->decode_ms += r->t_end - r->t_first;
        }
    }
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void print_text_escaped(const struct kvs_tokenizer *tok, const struct creq *r)
{
    struct kvs_detok dt;
    kvs_detok_init(&dt, tok, false);
    char piece[256];
    for (int32_t i = 0; i <= r->n_toks; i++) {
        int64_t w = i < r->n_toks ? kvs_detok_push(&dt, r->toks[i], piece, sizeof piece)
                                  : kvs_detok_flush(&dt, piece, sizeof piece);
        if (w > (int64_t)sizeof piece) w = sizeof piece;
        for (int64_t k = 0; k < w; k++) {
            char ch = piece[k];
            if (ch == '\n') fputs("\\n", stdout);
            else if (ch == '\\') fputs("\\\\", stdout);
            else fputc(ch, stdout);
        }
    }
}

static int client_one(struct kvs_stage *head, const struct kvs_ring_client_opts *o, struct client *c,
                      struct kvs_cli_summary *sum)
{
    struct creq r = { 0 };
    struct cb_ctx cx = { c, &r };
    const struct kvs_tokenizer *tok = kvs_stage_tokenizer(head);
    submit(head, o, o->prompt, &cx);
    struct kvs_detok dt;
    kvs_detok_init(&dt, tok, false);
    char piece[256];
    int32_t shown = 0;
    bool done = false;
    while (!done) {
        pthread_mutex_lock(&c->mu);
        while (!r.done && r.n_toks == shown) pthread_cond_wait(&c->cv, &c->mu);
        int32_t upto = r.n_toks;
        done = r.done;
        pthread_mutex_unlock(&c->mu);
        for (; shown < upto; shown++) {
            int64_t w = kvs_detok_push(&dt, r.toks[shown], piece, sizeof piece);
            if (w > 0) fwrite(piece, 1, (size_t)(w < (int64_t)sizeof piece ? w : (int64_t)sizeof piece), stdout);
        }
        fflush(stdout);
    }
    int64_t w = kvs_detok_flush(&dt, piece, sizeof piece);
    if (w > 0) fwrite(piece, 1, (size_t)(w < (int64_t)sizeof piece ? w : (int64_t)sizeof piece), stdout);
    if (isatty(STDOUT_FILENO)) fputc('\n', stdout);
    fflush(stdout);
    int rc = 0;
    if (r.err) {
        fprintf(stderr, "kvasir: request failed: %s (%s)\n", r.msg, kvs_strerror(r.err));
        rc = 1;
    }
    sum_add(sum, &r);
    sum->ttft_ms = r.t_first >= 0 ? r.t_first - r.t_submit : 0.0;
    free(r.toks);
    return rc;
}

/* Prompt lines read with read(2) and poll(2), not stdio: waiting for a line
 * (stdin from a pipe) must not keep a stopped head (SIGTERM) alive. */
struct line_reader {
    int fd;
    char buf[65536];
    size_t len;
    bool eof;
};

/* Next line (without "\r\n") into out: 1 got one, 0 end of input (or the
 * loop stopped), -1 read error. Lines longer than the buffer are split. */
static int read_line(struct line_reader *lr, struct kvs_stage *head, char *out, size_t cap)
{
    for (;;) {
        char *nl = memchr(lr->buf, '\n', lr->len);
        if (nl || (lr->eof && lr->len) || lr->len == sizeof lr->buf) {
            size_t n = nl ? (size_t)(nl - lr->buf) : lr->len;
            size_t take = n < cap - 1 ? n : cap - 1;
            memcpy(out, lr->buf, take);
            out[take] = '\0';
            out[strcspn(out, "\r")] = '\0';
            size_t used = nl ? n + 1 : n;
            memmove(lr->buf, lr->buf + used, lr->len - used);
            lr->len -= used;
            return 1;
        }
        if (lr->eof) return 0;
        struct pollfd pf = { .fd = lr->fd, .events = POLLIN };
        int r = poll(&pf, 1, 100);
        if (r < 0 && errno != EINTR) return -1;
        if (r <= 0) {
            if (kvs_stage_ring_error(head, NULL, 0) == KVS_ERR_CANCELLED) return 0; /* stopped */
            continue;
        }
        ssize_t got = read(lr->fd, lr->buf + lr->len, sizeof lr->buf - lr->len);
        if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (got < 0) return -1;
        if (got == 0) lr->eof = true;
        lr->len += (size_t)got;
    }
}

static int client_many(struct kvs_stage *head, const struct kvs_ring_client_opts *o, struct client *c,
                       struct kvs_cli_summary *sum)
{
    size_t ttft_cap = 1024, n_ttft = 0;
    double *ttft = malloc(ttft_cap * sizeof *ttft), t_begin = kvs_cli_now_ms();
    FILE *in = strcmp(o->prompts_path, "-") ? fopen(o->prompts_path, "r") : stdin;
    if (!in) {
        fprintf(stderr, "kvasir: cannot open %s\n", o->prompts_path);
        return 1;
    }
    struct line_reader *lr = calloc(1, sizeof *lr);
    if (!lr) {
        if (in != stdin) fclose(in);
        return 1;
    }
    lr->fd = fileno(in);
    int P = o->parallel > 0 ? o->parallel : 1;
    struct creq *rs = calloc((size_t)P, sizeof *rs);
    struct cb_ctx *cx = calloc((size_t)P, sizeof *cx);
    bool *busy = calloc((size_t)P, sizeof *busy);
    int rc = 0, next_idx = 0, in_flight = 0;
    bool eof = false;
    char line[65536];
    while (rs && cx && busy && (!eof || in_flight > 0)) {
        /* fill free slots from the input */
        while (!eof && in_flight < P) {
            int lrc = read_line(lr, head, line, sizeof line);
            if (lrc <= 0) {
                if (lrc < 0) {
                    fprintf(stderr, "kvasir: reading %s: %s\n", o->prompts_path, strerror(errno));
                    rc = 1;
                }
                eof = true;
                break;
            }
            if (!line[0]) continue;
            int k = 0;
            while (busy[k]) k++;
            memset(&rs[k], 0, sizeof rs[k]);
            rs[k].idx = next_idx++;
            cx[k] = (struct cb_ctx){ c, &rs[k] };
            busy[k] = true;
            in_flight++;
            submit(head, o, line, &cx[k]);
        }
        if (in_flight == 0) continue;
        /* wait for any completion and print it */
        pthread_mutex_lock(&c->mu);
        while (c->n_done_unseen == 0) pthread_cond_wait(&c->cv, &c->mu);
        for (int k = 0; k < P; k++) {
            if (!busy[k] || !rs[k].done) continue;
            c->n_done_unseen--;
            busy[k] = false;
            in_flight--;
            sum_add(sum, &rs[k]);
            if (rs[k].t_first >= 0 && ttft) {
                if (n_ttft == ttft_cap) {
                    double *nt = realloc(ttft, 2 * ttft_cap * sizeof *ttft);
                    if (nt) {
                        ttft = nt;
                        ttft_cap *= 2;
                    }
                }
                if (n_ttft < ttft_cap) ttft[n_ttft++] = rs[k].t_first - rs[k].t_submit;
            }
            if (rs[k].err) {
                printf("#%d error %s (%s)\n", rs[k].idx, rs[k].msg, kvs_strerror(rs[k].err));
                rc = 1;
            } else {
                printf("#%d ok ", rs[k].idx);
                print_text_escaped(kvs_stage_tokenizer(head), &rs[k]);
                fputc('\n', stdout);
            }
            fflush(stdout);
            free(rs[k].toks);
            rs[k].toks = NULL;
        }
        pthread_mutex_unlock(&c->mu);
    }
    if (in != stdin) fclose(in);
    sum->wall_ms = kvs_cli_now_ms() - t_begin;
    if (n_ttft) {
        qsort(ttft, n_ttft, sizeof *ttft, cmp_double);
        sum->ttft_ms = n_ttft % 2 ? ttft[n_ttft / 2] : 0.5 * (ttft[n_ttft / 2 - 1] + ttft[n_ttft / 2]);
    }
    free(ttft);
    free(lr);
    free(rs);
    free(cx);
    free(busy);
    return rc;
}

int kvs_ring_client(struct kvs_stage *head, const struct kvs_ring_client_opts *o)
{
    struct client c = { .n_done_unseen = 0 };
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    if (o->sp.temp > 0.0f)
        KVS_LOGI("sampling seed %llu (--seed %llu repeats this output)", (unsigned long long)o->sp.seed,
                 (unsigned long long)o->sp.seed);
    pthread_t th;
    if (pthread_create(&th, NULL, loop_thread, head)) {
        fprintf(stderr, "kvasir: cannot start the stage thread\n");
        return 1;
    }
    int rc;
    struct kvs_cli_summary sum = { .load_ms = -1.0 };
    bool served = false;
    /* In slices, so that a child stage that died (a port taken, a bad file)
     * ends the wait at once instead of after ready_timeout_ms. */
    kvs_err we = KVS_ERR_TIMEOUT;
    bool child_died = false;
    for (int waited = 0; waited < o->ready_timeout_ms && we == KVS_ERR_TIMEOUT && !child_died;) {
        int slice = o->ready_timeout_ms - waited < 200 ? o->ready_timeout_ms - waited : 200;
        we = kvs_stage_wait_ready(head, slice);
        waited += slice;
        if (we == KVS_ERR_TIMEOUT && o->children) child_died = kvs_local_ring_poll_children(o->children) > 0;
    }
    if (child_died) {
        fprintf(stderr, "kvasir: a stage process exited before the ring closed (its log is above)\n");
        rc = 1;
    } else if (we == KVS_ERR_CANCELLED) {
        fprintf(stderr, "kvasir: stopped before the ring closed\n");
        rc = 1;
    } else if (we == KVS_ERR_TIMEOUT) {
        char why[1024];
        if (kvs_stage_link_error(head, why, sizeof why))
            fprintf(stderr, "kvasir: the ring did not close within %d ms: %s\n", o->ready_timeout_ms, why);
        else
            fprintf(stderr, "kvasir: the ring did not close within %d ms\n", o->ready_timeout_ms);
        rc = 1;
    } else if (we) {
        char why[2048];
        kvs_stage_ring_error(head, why, sizeof why);
        fprintf(stderr, "kvasir: the ring cannot close: %s (%s)\n", why, kvs_strerror(we));
        rc = 1;
    } else if (o->children && kvs_local_ring_supervise(o->children)) {
        rc = 1;
    } else {
        if (o->t_start_ms > 0) sum.load_ms = kvs_cli_now_ms() - o->t_start_ms;
        rc = o->prompts_path ? client_many(head, o, &c, &sum) : client_one(head, o, &c, &sum);
        served = true;
    }
    kvs_stage_stop(head);
    pthread_join(th, NULL);
    struct kvs_stage_metrics m;
    kvs_stage_metrics(head, &m);
    /* one write each: the stage children log on the same stderr */
    if (served) kvs_cli_print_summary(&sum);
    char line[512];
    snprintf(line, sizeof line,
             "ring: %llu requests done, %llu failed, %llu tokens; the head's own blocks: %llu forward calls in "
             "%.1f ms; %llu replays after faults\n",
             (unsigned long long)m.requests_done, (unsigned long long)m.requests_failed,
             (unsigned long long)m.tokens_generated, (unsigned long long)m.forward_calls, m.forward_ms,
             (unsigned long long)m.requests_replayed);
    fputs(line, stderr);
    pthread_mutex_destroy(&c.mu);
    pthread_cond_destroy(&c.cv);
    return rc;
}

/* --- kvasir run --ring N ------------------------------------------------------------ */

static void ring_usage(FILE *f)
{
    fprintf(f, "usage: kvasir run --ring N -m MODEL (-p TEXT | --prompts FILE) [options]\n"
               "  the options of `kvasir run`, and:\n"
               "  --prompts FILE       one prompt per line ('-' = stdin); prints \"#i ok TEXT\" per prompt\n"
               "                       (newlines in TEXT as \\n) or \"#i error MESSAGE\"\n"
               "  --parallel P         prompts in flight at once (default 1)\n"
               "  --seqs S             sequence slots per stage (default max(4, P))\n"
               "  --boundary f32|f16   boundary precision on the links (default f32: the ring's output is\n"
               "                       bit-identical to a single process). f16 halves the traffic but\n"
               "                       rounds the hidden state at every hop, so greedy output can differ\n"
               "                       where the top logits are close (docs/PROTOCOL.md section 5)\n"
               "  --insecure           plaintext links (default: throw-away node keys, TLS on every link)\n"
               "  --replay-deadline S  a stage that dies is restarted; meanwhile requests in flight are held\n"
               "                       and replayed once the ring is whole again; they fail after S seconds\n"
               "                       (default 30; 0: fail at once; docs/PROTOCOL.md 5.1)\n"
               "  --backend, --device  apply to every stage of the ring\n");
    /* --step-delay MS (sleep before every forward on every stage) is a test hook: not listed */
}

bool kvs_ring_client_opt(const char *a, const char *v, struct kvs_ring_client_opts *co, int *bad)
{
    long lv = 0;
    *bad = 0;
    if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) co->prompt = v;
    else if (!strcmp(a, "--prompts")) co->prompts_path = v;
    else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
        *bad = kvs_cli_parse_long(v, 1, 1 << 24, &lv);
        co->n_predict = (int32_t)lv;
    } else if (!strcmp(a, "--temp")) *bad = kvs_cli_parse_float(v, &co->sp.temp);
    else if (!strcmp(a, "--top-k")) {
        *bad = kvs_cli_parse_long(v, -1, 1 << 30, &lv);
        co->sp.top_k = (int32_t)lv;
    } else if (!strcmp(a, "--top-p")) *bad = kvs_cli_parse_float(v, &co->sp.top_p);
    else if (!strcmp(a, "--min-p")) *bad = kvs_cli_parse_float(v, &co->sp.min_p);
    else if (!strcmp(a, "--repeat-penalty")) *bad = kvs_cli_parse_float(v, &co->sp.repeat_penalty) || !(co->sp.repeat_penalty > 0.0f);
    else if (!strcmp(a, "--seed")) {
        *bad = kvs_cli_parse_seed(v, &co->sp.seed);
    } else if (!strcmp(a, "--parallel")) {
        *bad = kvs_cli_parse_long(v, 1, 1024, &lv);
        co->parallel = (int32_t)lv;
    } else
        return false;
    return true;
}

int kvs_cli_run_ring(int argc, char **argv)
{
    struct kvs_ring_client_opts co = { .parallel = 1, .n_predict = 128, .ready_timeout_ms = 30000,
                                       .t_start_ms = kvs_cli_now_ms() };
    co.sp = kvs_sampler_default_params();
    co.sp.seed = kvs_cli_random_seed(); /* --seed S or -1 overrides */
    const char *model = NULL;
    long ring = 0, threads = 0, n_ctx = 0, seqs = 0, delay = 0; /* threads 0: the cores shared by the stages */
    float replay_s = KVS_STAGE_REPLAY_DEADLINE_MS / 1000.0f;
    bool f32 = true, insecure = false;
    int backend = 0, device = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            ring_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--ignore-eos")) {
            co.ignore_eos = true;
            continue;
        }
        if (!strcmp(a, "--insecure")) {
            insecure = true;
            continue;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "kvasir run: unknown option or missing value: %s\n", a);
            return 2;
        }
        int bad = 0;
        if (!strcmp(a, "-m") || !strcmp(a, "--model")) model = v;
        else if (kvs_cli_backend_opt(a, v, &backend, &device, &bad)) {
        } else if (kvs_ring_client_opt(a, v, &co, &bad)) {
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) bad = kvs_cli_parse_long(v, 1, 512, &threads);
        else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) bad = kvs_cli_parse_long(v, 1, 1 << 24, &n_ctx);
        else if (!strcmp(a, "--ring")) bad = kvs_cli_parse_long(v, 1, 1024, &ring);
        else if (!strcmp(a, "--seqs")) bad = kvs_cli_parse_long(v, 1, 1024, &seqs);
        else if (!strcmp(a, "--step-delay")) bad = kvs_cli_parse_long(v, 0, 10000, &delay);
        else if (!strcmp(a, "--replay-deadline"))
            bad = kvs_cli_parse_float(v, &replay_s) || !(replay_s >= 0.0f && replay_s <= 86400.0f);
        else if (!strcmp(a, "--boundary")) {
            bad = strcmp(v, "f16") && strcmp(v, "f32");
            f32 = !strcmp(v, "f32");
        } else {
            fprintf(stderr, "kvasir run: unknown option: %s\n", a);
            ring_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir run: bad value for %s: %s\n", a, v);
            return 2;
        }
        i++;
    }
    if (!model || (!co.prompt == !co.prompts_path) || ring < 1) {
        fprintf(stderr, "kvasir run: --ring N (N >= 1), -m MODEL and one of -p TEXT / --prompts FILE are required\n");
        ring_usage(stderr);
        return 2;
    }
    if (seqs == 0) seqs = co.parallel > 4 ? co.parallel : 4;

    /* SIGINT/SIGTERM: handled through a signalfd (the head's stop_fd). */
    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old);
    int sfd = signalfd(-1, &sigs, SFD_CLOEXEC | SFD_NONBLOCK);

    struct kvs_local_ring lr;
    struct kvs_stage_params sp = kvs_stage_default_params();
    struct kvs_local_ring_opts lo = { .who = "run", .model = model, .n = (int)ring, .threads = threads,
                                      .n_ctx = n_ctx, .seqs = seqs, .boundary_f32 = f32, .insecure = insecure,
                                      .child_mask = &old, .step_delay_ms = delay, .backend = backend,
                                      .device = device, .allow_solo = true }; /* --ring 1: as serve --ring 1 */
    struct kvs_stage *head = NULL;
    int rc = kvs_local_ring_start(&lo, &lr, &sp);
    if (rc) goto done;
    rc = 1;
    sp.stop_fd = sfd;
    sp.replay_deadline_ms = replay_s > 0.0f ? (int32_t)(replay_s * 1000.0f + 0.5f) : -1;
    char err[512];
    kvs_err e = kvs_stage_create(&sp, &head, err, sizeof err);
    if (e) {
        fprintf(stderr, "kvasir run: head stage: %s (%s)\n", kvs_strerror(e), err);
        goto done;
    }
    co.children = &lr;
    rc = kvs_ring_client(head, &co);
done:
    kvs_stage_free(head);
    kvs_local_ring_stop(&lr);
    if (sfd >= 0) close(sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

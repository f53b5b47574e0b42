/* The HTTP server (libmicrohttpd, one thread per connection), routing, and
 * the per-request job that carries stage events from the loop thread to the
 * connection thread. */
#include "api/api.h"

#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include <jansson.h>
#include <microhttpd.h>

#include "api/api_impl.h"
#include "chat/chat.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "stage/stage.h"
#include "tokenizer/tokenizer.h"

#define WAIT_STEP_MS 100          /* condvar wait slice: checks liveness and stop */
#define SSE_PING_MS 5000          /* SSE comment when no event came for this long */
#define MAX_OUTPUT (64u << 20)    /* cap of one response's text */
#define MAX_TEMPLATE (1u << 20)

struct kvs_api {
    struct kvs_stage *head;
    const struct kvs_tokenizer *tok;
    struct kvs_api_params p;
    char model[256];
    enum kvs_chat_template chat;
    bool chat_fallback; /* ChatML chosen for a model without a template: BOS as its tokenizer says */
    struct MHD_Daemon *d;
    struct kvs_api_gate *gate; /* listening socket, limits, request deadline (api_gate.c) */
    uint16_t port;
    volatile int stopping; /* read by connection threads; set once by kvs_api_stop */
    pthread_mutex_t mu;    /* ids */
    uint64_t next_id;
    uint64_t id_salt;
    struct kvs_api_metrics met;
    char api_key[256]; /* "" = no key */
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static bool is_stopping(const struct kvs_api *a)
{
    return __atomic_load_n(&a->stopping, __ATOMIC_ACQUIRE) != 0;
}

/* --- job: one generation request ---------------------------------------------- */

struct ev {
    uint8_t kind;
    int32_t token;
    uint32_t finish;
    kvs_err err;
    int64_t t_ns;
};

struct job {
    /* shared with the loop thread, under mu */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int refs;              /* connection side + loop side (until the last event) */
    struct ev *evs;        /* ring buffer [cap] */
    size_t cap, rd, n;
    bool ended;            /* the last event (DONE/ERROR) was queued */
    bool overflow;
    char errmsg[200];

    /* connection thread only */
    struct kvs_api *api;
    struct MHD_Connection *conn;
    struct kvs_api_request rq;
    uint32_t req;
    bool submitted;
    char id[64];
    int64_t created;
    int32_t n_prompt, n_gen;
    struct kvs_detok dt;
    struct kvs_api_buf echo; /* prompt text when echo */
    struct kvs_api_buf text; /* generated text */
    size_t safe;             /* text[0..safe) is final */
    size_t sent;             /* stream: bytes of text already sent */
    const char *finish;      /* "stop" / "length" once finished normally */
    bool finished, failed, gone, stop_hit;
    struct kvs_api_error error;
    int64_t t_start, t_last_tok, t_last_out;
    /* stream output */
    struct kvs_api_buf out;
    size_t out_off;
    bool started_stream, stream_over;
    bool counted;
};

static void job_free(struct job *j)
{
    kvs_api_request_free(&j->rq);
    kvs_api_buf_free(&j->echo);
    kvs_api_buf_free(&j->text);
    kvs_api_buf_free(&j->out);
    free(j->evs);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->cv);
    free(j);
}

static void job_unref(struct job *j)
{
    pthread_mutex_lock(&j->mu);
    bool last = --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (last) job_free(j);
}

/* Loop thread: copy the event and return at once. */
static void on_stage_event(void *user, const struct kvs_stage_event *e)
{
    struct job *j = user;
    pthread_mutex_lock(&j->mu);
    if (j->n == j->cap) {
        size_t nc = j->cap * 2;
        struct ev *ne = malloc(nc * sizeof *ne);
        if (ne) {
            for (size_t i = 0; i < j->n; i++) ne[i] = j->evs[(j->rd + i) % j->cap];
            free(j->evs);
            j->evs = ne;
            j->cap = nc;
            j->rd = 0;
        }
    }
    bool last = e->kind != KVS_STAGE_EVENT_TOKEN;
    if (j->n < j->cap) {
        struct ev *v = &j->evs[(j->rd + j->n) % j->cap];
        v->kind = (uint8_t)e->kind;
        v->token = e->token;
        v->finish = e->finish;
        v->err = e->err;
        v->t_ns = now_ns();
        j->n++;
    } else if (!last) {
        j->overflow = true;
    }
    if (last) {
        j->ended = true;
        snprintf(j->errmsg, sizeof j->errmsg, "%s", e->message ? e->message : kvs_strerror(e->err));
        kvs_api_utf8_fix(j->errmsg); /* a ring peer's text, cut to the buffer */
        if (j->n == j->cap) j->overflow = true; /* could not queue the end: treated as an error */
    }
    pthread_cond_broadcast(&j->cv);
    bool free_now = last && --j->refs == 0;
    pthread_mutex_unlock(&j->mu);
    if (free_now) job_free(j);
}

/* True when the client closed its end (or the socket failed). */
static bool client_gone(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd pf = { .fd = ci->connect_fd, .events = POLLIN | POLLRDHUP };
    if (poll(&pf, 1, 0) <= 0) return false;
    if (pf.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    if (pf.revents & POLLIN) {
        char b;
        ssize_t r = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r == 0) return true;
    }
    return false;
}

static void set_error_from_event(struct job *j, kvs_err e, const char *msg)
{
    j->failed = true;
    if (e == KVS_ERR_PEER || e == KVS_ERR_TIMEOUT)
        kvs_api_error_set(&j->error, 502, "server_error", NULL, "ring_error", "the ring failed: %s", msg);
    else if (e == KVS_ERR_CANCELLED)
        kvs_api_error_set(&j->error, 503, "server_error", NULL, "cancelled", "the request was cancelled: %s", msg);
    else
        kvs_api_error_set(&j->error, 500, "server_error", NULL, NULL, "generation failed: %s", msg);
}

static void job_finish_text(struct job *j)
{
    if (j->rq.n_stop) {
        bool hit;
        size_t s = kvs_api_stop_scan(j->text.p ? j->text.p : "", j->text.len, j->safe, j->rq.stop, j->rq.n_stop, &hit);
        if (hit) {
            j->text.len = s;
            j->stop_hit = true;
        }
    }
    j->safe = j->text.len;
}

/* Applies one event on the connection thread. */
static void job_apply(struct job *j, const struct ev *v)
{
    struct kvs_api *a = j->api;
    if (j->finished) return; /* e.g. tokens still in flight after a stop sequence */
    if (v->kind == KVS_STAGE_EVENT_TOKEN) {
        j->n_gen++;
        if (j->t_last_tok) {
            pthread_mutex_lock(&a->met.mu);
            kvs_api_hist_add(&a->met.token_roundtrip, (double)(v->t_ns - j->t_last_tok) / 1e9);
            pthread_mutex_unlock(&a->met.mu);
        }
        j->t_last_tok = v->t_ns;
        char piece[2048];
        int64_t n = kvs_detok_push(&j->dt, v->token, piece, sizeof piece);
        if (n > 0 && !kvs_api_buf_add(&j->text, piece, (size_t)(n > (int64_t)sizeof piece ? (int64_t)sizeof piece : n))) {
            j->failed = j->finished = true;
            kvs_api_error_set(&j->error, 500, "server_error", NULL, NULL, "response too large");
            kvs_stage_cancel(a->head, j->req);
            return;
        }
        if (j->rq.n_stop) {
            bool hit;
            size_t s = kvs_api_stop_scan(j->text.p, j->text.len, j->safe, j->rq.stop, j->rq.n_stop, &hit);
            j->safe = s;
            if (hit) {
                j->text.len = s;
                j->stop_hit = true;
                j->finished = true;
                j->finish = "stop";
                kvs_stage_cancel(a->head, j->req);
            }
        } else {
            j->safe = j->text.len;
        }
    } else if (v->kind == KVS_STAGE_EVENT_DONE) {
        char piece[64];
        int64_t n = kvs_detok_flush(&j->dt, piece, sizeof piece);
        if (n > 0) kvs_api_buf_add(&j->text, piece, (size_t)(n > (int64_t)sizeof piece ? (int64_t)sizeof piece : n));
        job_finish_text(j);
        j->finished = true;
        j->finish = (v->finish == 2 && !j->stop_hit) ? "length" : "stop";
    } else {
        j->finished = true;
        pthread_mutex_lock(&j->mu);
        char msg[200];
        snprintf(msg, sizeof msg, "%s", j->errmsg);
        pthread_mutex_unlock(&j->mu);
        set_error_from_event(j, v->err, msg);
    }
}

/* Waits up to WAIT_STEP_MS for events and applies them. Marks the job gone
 * (and cancels it) when the client closed the connection or the API stops. */
static void job_pump(struct job *j)
{
    struct ev batch[64];
    size_t nb = 0;
    bool overflow, ended;
    pthread_mutex_lock(&j->mu);
    if (j->n == 0 && !j->ended) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += WAIT_STEP_MS * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&j->cv, &j->mu, &ts);
    }
    while (j->n > 0 && nb < sizeof batch / sizeof batch[0]) {
        batch[nb++] = j->evs[j->rd];
        j->rd = (j->rd + 1) % j->cap;
        j->n--;
    }
    overflow = j->overflow;
    ended = j->ended && j->n == 0;
    pthread_mutex_unlock(&j->mu);
    for (size_t i = 0; i < nb; i++) job_apply(j, &batch[i]);
    if (!j->finished && (overflow || (ended && nb == 0))) {
        /* the last event could not be queued, or the loop ended it without one we saw */
        j->finished = j->failed = true;
        kvs_api_error_set(&j->error, 500, "server_error", NULL, NULL, "internal event queue overflow");
    }
    if (!j->finished && (is_stopping(j->api) || (j->conn && client_gone(j->conn)))) {
        j->finished = j->failed = true;
        j->gone = true;
        kvs_api_error_set(&j->error, 503, "server_error", NULL, "cancelled", "the request was cancelled");
        kvs_stage_cancel(j->api->head, j->req);
    }
}

static void count_status(struct kvs_api *a, enum kvs_api_status s)
{
    pthread_mutex_lock(&a->met.mu);
    a->met.requests[s]++;
    pthread_mutex_unlock(&a->met.mu);
}

/* Records the job's outcome once. */
static void job_account(struct job *j)
{
    if (j->counted || !j->submitted) return;
    j->counted = true;
    struct kvs_api *a = j->api;
    enum kvs_api_status s = !j->failed ? KVS_API_STATUS_OK : j->gone ? KVS_API_STATUS_CANCELLED : KVS_API_STATUS_ERROR;
    pthread_mutex_lock(&a->met.mu);
    a->met.requests[s]++;
    a->met.tokens_generated += (uint64_t)j->n_gen;
    a->met.in_flight--;
    kvs_api_hist_add(&a->met.request_seconds, (double)(now_ns() - j->t_start) / 1e9);
    pthread_mutex_unlock(&a->met.mu);
    /* One line per request: outcome (HTTP status), tokens, milliseconds. */
    const char *route = j->rq.kind == KVS_API_CHAT ? "/v1/chat/completions" : "/v1/completions";
    const char *how = j->rq.stream ? " stream" : "";
    const double ms = (double)(now_ns() - j->t_start) / 1e6;
    if (s == KVS_API_STATUS_OK)
        KVS_LOGI("api: %s %s%s 200 %s: %d prompt + %d generated tokens, %.1f ms", j->id, route, how,
                 j->finish ? j->finish : "stop", (int)j->n_prompt, (int)j->n_gen, ms);
    else if (s == KVS_API_STATUS_CANCELLED)
        KVS_LOGI("api: %s %s%s cancelled: %d prompt + %d generated tokens, %.1f ms", j->id, route, how,
                 (int)j->n_prompt, (int)j->n_gen, ms);
    else
        KVS_LOGI("api: %s %s%s %d failed: %s; %d prompt + %d generated tokens, %.1f ms", j->id, route, how,
                 j->started_stream ? 200 : j->error.status, j->error.message, (int)j->n_prompt, (int)j->n_gen, ms);
}

/* --- responses ---------------------------------------------------------------- */

static enum MHD_Result send_text(struct MHD_Connection *c, unsigned status, const char *ctype, char *body, size_t len)
{
    if (!body) {
        static const char oom[] = "{\"error\":{\"message\":\"the response could not be built (out of memory)\","
                                  "\"type\":\"server_error\",\"param\":null,\"code\":null}}";
        struct MHD_Response *r = MHD_create_response_from_buffer(sizeof oom - 1, (void *)oom, MHD_RESPMEM_PERSISTENT);
        if (!r) return MHD_NO;
        MHD_add_response_header(r, "Content-Type", "application/json");
        enum MHD_Result ret = MHD_queue_response(c, 500, r);
        MHD_destroy_response(r);
        return ret;
    }
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", ctype);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result send_json(struct MHD_Connection *c, unsigned status, char *json)
{
    return send_text(c, status, "application/json", json, json ? strlen(json) : 0);
}

static enum MHD_Result send_error(struct MHD_Connection *c, const struct kvs_api_error *e)
{
    return send_json(c, (unsigned)e->status, kvs_api_error_json(e));
}

static enum MHD_Result send_error_simple(struct MHD_Connection *c, int status, const char *type, const char *code,
                                         const char *msg)
{
    struct kvs_api_error e;
    kvs_api_error_set(&e, status, type, NULL, code, "%s", msg);
    return send_error(c, &e);
}

static void job_result(const struct job *j, struct kvs_api_result *r, const char *text, size_t len,
                       const char *finish)
{
    r->id = j->id;
    r->created = j->created;
    r->model = j->api->model;
    r->text = text;
    r->text_len = len;
    r->finish_reason = finish;
    r->prompt_tokens = j->n_prompt;
    r->completion_tokens = j->n_gen;
}

static bool sse_add(struct job *j, char *json)
{
    if (!json) return false;
    bool ok = kvs_api_buf_add(&j->out, "data: ", 6) && kvs_api_buf_add(&j->out, json, strlen(json)) &&
              kvs_api_buf_add(&j->out, "\n\n", 2);
    free(json);
    return ok;
}

/* Turns the job's new state into SSE events in j->out. */
static void stream_emit(struct job *j)
{
    struct kvs_api_result r;
    enum kvs_api_kind k = j->rq.kind;
    if (!j->started_stream) {
        j->started_stream = true;
        if (k == KVS_API_CHAT) {
            job_result(j, &r, NULL, 0, NULL);
            sse_add(j, kvs_api_chunk_json(k, &r, true, false));
        } else if (j->echo.len) {
            job_result(j, &r, j->echo.p, j->echo.len, NULL);
            sse_add(j, kvs_api_chunk_json(k, &r, false, false));
        }
    }
    if (j->failed && !j->gone) {
        sse_add(j, kvs_api_error_json(&j->error));
        j->stream_over = true;
        return;
    }
    if (j->failed) {
        j->stream_over = true;
        return;
    }
    if (j->safe > j->sent) {
        job_result(j, &r, j->text.p + j->sent, j->safe - j->sent, NULL);
        sse_add(j, kvs_api_chunk_json(k, &r, false, false));
        j->sent = j->safe;
    }
    if (j->finished) {
        job_result(j, &r, "", 0, j->finish);
        sse_add(j, kvs_api_chunk_json(k, &r, false, false));
        if (j->rq.include_usage) {
            job_result(j, &r, "", 0, NULL);
            sse_add(j, kvs_api_chunk_json(k, &r, false, true));
        }
        kvs_api_buf_add(&j->out, "data: [DONE]\n\n", 14);
        j->stream_over = true;
    }
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct job *j = cls;
    for (;;) {
        if (j->out_off < j->out.len) {
            size_t n = j->out.len - j->out_off;
            if (n > max) n = max;
            memcpy(buf, j->out.p + j->out_off, n);
            j->out_off += n;
            if (j->out_off == j->out.len) j->out_off = j->out.len = 0;
            j->t_last_out = now_ns();
            return (ssize_t)n;
        }
        if (j->stream_over) {
            job_account(j);
            return j->failed && j->gone ? MHD_CONTENT_READER_END_WITH_ERROR : MHD_CONTENT_READER_END_OF_STREAM;
        }
        job_pump(j);
        stream_emit(j);
        if (j->out.len == 0 && !j->stream_over && now_ns() - j->t_last_out > (int64_t)SSE_PING_MS * 1000000) {
            kvs_api_buf_add(&j->out, ": ping\n\n", 8); /* an SSE comment: keeps proxies and liveness checks honest */
        }
    }
}

static void stream_free(void *cls)
{
    struct job *j = cls;
    if (!j->finished) {
        /* the connection ended before the request did: the client went away */
        j->finished = j->failed = j->gone = true;
        kvs_stage_cancel(j->api->head, j->req);
    }
    job_account(j);
    job_unref(j);
}

/* --- generation requests ------------------------------------------------------- */

static kvs_err tokenize_text(const struct kvs_tokenizer *tok, const char *text, size_t len, bool add_bos,
                             int32_t **ids, int32_t *n)
{
    int64_t cap = (int64_t)len + 8;
    for (int attempt = 0; attempt < 2; attempt++) {
        int32_t *buf = malloc((size_t)cap * sizeof *buf);
        if (!buf) return KVS_ERR_NOMEM;
        int64_t r = kvs_tokenize(tok, text, len, add_bos, true, buf, cap);
        if (r < 0) {
            free(buf);
            return (kvs_err)-r;
        }
        if (r <= cap) {
            if (r > INT32_MAX) {
                free(buf);
                return KVS_ERR_RANGE;
            }
            *ids = buf;
            *n = (int32_t)r;
            return KVS_OK;
        }
        free(buf);
        cap = r;
    }
    return KVS_ERR_INTERNAL;
}

/* The chat's ids: template markup as special tokens, the messages' text as
 * plain text unless the server was started with chat_parse_special
 * (kvs_chat_tokenize). */
static kvs_err tokenize_chat(struct kvs_api *a, const struct kvs_api_request *rq, int32_t **ids, int32_t *n)
{
    int32_t bos = (a->chat_fallback || kvs_chat_wants_bos(a->chat)) && kvs_tokenizer_add_bos(a->tok)
                      ? kvs_tokenizer_bos(a->tok)
                      : -1;
    int64_t need = kvs_chat_tokenize(a->chat, a->tok, rq->messages, rq->n_messages, true, a->p.chat_parse_special,
                                     NULL, 0);
    if (need < 0) return (kvs_err)-need;
    if (need > INT32_MAX - 1) return KVS_ERR_RANGE;
    int32_t off = bos >= 0;
    int32_t *buf = malloc((size_t)(need + off ? need + off : 1) * sizeof *buf);
    if (!buf) return KVS_ERR_NOMEM;
    if (off) buf[0] = bos;
    int64_t r = kvs_chat_tokenize(a->chat, a->tok, rq->messages, rq->n_messages, true, a->p.chat_parse_special,
                                  buf + off, need);
    if (r != need) {
        free(buf);
        return r < 0 ? (kvs_err)-r : KVS_ERR_INTERNAL;
    }
    *ids = buf;
    *n = (int32_t)r + off;
    return KVS_OK;
}

/* Builds the prompt ids of a parsed request. On failure fills *err. */
static kvs_err build_prompt(struct kvs_api *a, struct job *j, int32_t **ids, int32_t *n, struct kvs_api_error *err)
{
    struct kvs_api_request *rq = &j->rq;
    kvs_err e;
    if (rq->kind == KVS_API_CHAT) {
        if (a->chat == KVS_CHAT_NONE) {
            kvs_api_error_set(err, 400, "invalid_request_error", "messages", "no_chat_template",
                              "model '%s' has no supported chat template: use /v1/completions", a->model);
            return KVS_ERR_UNSUPPORTED;
        }
        e = tokenize_chat(a, rq, ids, n);
    } else if (rq->prompt) {
        e = tokenize_text(a->tok, rq->prompt, rq->prompt_len, kvs_tokenizer_add_bos(a->tok), ids, n);
        if (!e && rq->echo && !kvs_api_buf_add(&j->echo, rq->prompt, rq->prompt_len)) e = KVS_ERR_NOMEM;
    } else {
        int32_t nv = kvs_tokenizer_n_vocab(a->tok);
        for (int32_t i = 0; i < rq->n_prompt_ids; i++)
            if (rq->prompt_ids[i] >= nv) {
                kvs_api_error_set(err, 400, "invalid_request_error", "prompt", NULL,
                                  "token id %d at prompt[%d] is outside the vocabulary (%d tokens)",
                                  (int)rq->prompt_ids[i], (int)i, (int)nv);
                return KVS_ERR_RANGE;
            }
        *ids = malloc((size_t)rq->n_prompt_ids * sizeof **ids);
        if (!*ids) goto nomem;
        memcpy(*ids, rq->prompt_ids, (size_t)rq->n_prompt_ids * sizeof **ids);
        *n = rq->n_prompt_ids;
        e = KVS_OK;
        if (rq->echo) {
            struct kvs_detok d;
            kvs_detok_init(&d, a->tok, false);
            char piece[2048];
            for (int32_t i = 0; i < *n && !e; i++) {
                int64_t k = kvs_detok_push(&d, (*ids)[i], piece, sizeof piece);
                if (k > 0 && !kvs_api_buf_add(&j->echo, piece, (size_t)(k > 2048 ? 2048 : k))) e = KVS_ERR_NOMEM;
            }
            int64_t k = kvs_detok_flush(&d, piece, sizeof piece);
            if (!e && k > 0 && !kvs_api_buf_add(&j->echo, piece, (size_t)(k > 2048 ? 2048 : k))) e = KVS_ERR_NOMEM;
        }
    }
    if (e == KVS_ERR_NOMEM) goto nomem;
    if (e) {
        kvs_api_error_set(err, 400, "invalid_request_error", "prompt", NULL, "cannot tokenize the prompt: %s",
                          kvs_strerror(e));
        return e;
    }
    if (*n == 0) {
        free(*ids);
        *ids = NULL;
        kvs_api_error_set(err, 400, "invalid_request_error", rq->kind == KVS_API_CHAT ? "messages" : "prompt", NULL,
                          "the prompt is empty");
        return KVS_ERR_ARG;
    }
    return KVS_OK;
nomem:
    kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return KVS_ERR_NOMEM;
}

static enum MHD_Result handle_generate(struct kvs_api *a, struct MHD_Connection *c, enum kvs_api_kind kind,
                                       const char *body, size_t len)
{
    struct kvs_api_error err;
    struct job *j = calloc(1, sizeof *j);
    if (!j) return send_error_simple(c, 500, "server_error", NULL, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    j->refs = 1;
    j->api = a;
    j->conn = c;
    j->text.limit = MAX_OUTPUT;
    j->echo.limit = MAX_OUTPUT;
    j->out.limit = MAX_OUTPUT;
    int32_t *ids = NULL, n_ids = 0;

    if (kvs_api_parse_request(kind, body, len, &j->rq, &err)) goto reject;
    if (build_prompt(a, j, &ids, &n_ids, &err)) goto reject;
    if (!kvs_stage_ring_ready(a->head) && !kvs_stage_ring_holding(a->head)) { /* holding: it waits (§5.1) */
        char why[256], msg[400];
        if (kvs_stage_ring_error(a->head, why, sizeof why) != KVS_OK && why[0])
            snprintf(msg, sizeof msg, "the ring cannot close: %s", why);
        else
            snprintf(msg, sizeof msg, "the ring is not ready: a stage is down or still connecting; retry later");
        kvs_api_error_set(&err, 503, "server_error", NULL, "ring_unavailable", "%s", msg);
        goto reject;
    }

    struct kvs_stage_request sr = { 0 };
    sr.prompt = ids;
    sr.n_prompt = n_ids;
    sr.sampling = j->rq.sampling;
    if (!j->rq.seed_given) {
        pthread_mutex_lock(&a->mu);
        sr.sampling.seed = a->id_salt ^ (a->next_id * 0x9E3779B97F4A7C15ull);
        pthread_mutex_unlock(&a->mu);
    }
    int32_t max_tokens = j->rq.max_tokens;
    if (max_tokens < 0) max_tokens = kind == KVS_API_CHAT ? KVS_API_MAX_TOKENS_CAP : 16;
    sr.max_tokens = max_tokens;
    sr.on_event = on_stage_event;
    sr.user = j;

    j->cap = (size_t)(max_tokens < 256 ? max_tokens : 256) + 4;
    j->evs = malloc(j->cap * sizeof *j->evs);
    if (!j->evs) {
        kvs_api_error_set(&err, 500, "server_error", NULL, NULL, "out of memory");
        goto reject;
    }
    kvs_detok_init(&j->dt, a->tok, false);
    pthread_mutex_lock(&a->mu);
    uint64_t seq = a->next_id++;
    pthread_mutex_unlock(&a->mu);
    snprintf(j->id, sizeof j->id, "%s-%016llx%08llx", kind == KVS_API_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)a->id_salt, (unsigned long long)seq);
    j->created = (int64_t)time(NULL);
    j->n_prompt = n_ids;
    j->t_start = now_ns();
    j->t_last_out = j->t_start;

    j->refs = 2; /* the loop's reference, dropped by the last event */
    kvs_err e = kvs_stage_submit(a->head, &sr, &j->req);
    free(ids);
    ids = NULL;
    if (e) {
        j->refs = 1;
        if (e == KVS_ERR_RANGE)
            kvs_api_error_set(&err, 400, "invalid_request_error", kind == KVS_API_CHAT ? "messages" : "prompt",
                              "context_length_exceeded", "the prompt (%d tokens) does not fit the context",
                              (int)n_ids);
        else if (e == KVS_ERR_FULL)
            kvs_api_error_set(&err, 503, "server_error", NULL, "overloaded", "too many requests queued; retry later");
        else
            kvs_api_error_set(&err, 500, "server_error", NULL, NULL, "cannot submit: %s", kvs_strerror(e));
        goto reject;
    }
    j->submitted = true;
    pthread_mutex_lock(&a->met.mu);
    a->met.prompt_tokens += (uint64_t)n_ids;
    a->met.in_flight++;
    pthread_mutex_unlock(&a->met.mu);

    if (j->rq.stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, j, stream_free);
        if (!r) {
            stream_free(j);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        MHD_add_response_header(r, "Cache-Control", "no-cache");
        MHD_add_response_header(r, "X-Accel-Buffering", "no");
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r); /* stream_free runs when MHD is done with it */
        return ret;
    }

    while (!j->finished) job_pump(j);
    job_account(j);
    enum MHD_Result ret;
    if (j->failed) {
        ret = j->gone ? MHD_NO : send_error(c, &j->error);
    } else {
        struct kvs_api_result r;
        struct kvs_api_buf all = { .limit = 2 * (size_t)MAX_OUTPUT };
        const char *t = j->text.p ? j->text.p : "";
        size_t tl = j->text.len;
        if (j->echo.len) {
            if (!kvs_api_buf_add(&all, j->echo.p, j->echo.len) || !kvs_api_buf_add(&all, t, tl)) {
                kvs_api_buf_free(&all);
                job_unref(j);
                return send_error_simple(c, 500, "server_error", NULL, "out of memory");
            }
            t = all.p;
            tl = all.len;
        }
        job_result(j, &r, t, tl, j->finish);
        ret = send_json(c, 200, kvs_api_response_json(kind, &r));
        kvs_api_buf_free(&all);
    }
    job_unref(j);
    return ret;

reject:
    free(ids);
    KVS_LOGI("api: %s %d: %s", kind == KVS_API_CHAT ? "/v1/chat/completions" : "/v1/completions", err.status,
             err.message);
    count_status(a, err.status == 503 ? KVS_API_STATUS_UNAVAILABLE
                    : err.status >= 500 ? KVS_API_STATUS_ERROR
                                        : KVS_API_STATUS_INVALID);
    job_unref(j);
    return send_error(c, &err);
}

/* --- other routes ----------------------------------------------------------------- */

static enum MHD_Result handle_models(struct kvs_api *a, struct MHD_Connection *c)
{
    json_t *o = json_pack("{s:s, s:[{s:s, s:s, s:I, s:s}]}", "object", "list", "data", "id", a->model, "object",
                          "model", "created", (json_int_t)0, "owned_by", "kvasir");
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return send_json(c, 200, s);
}

static enum MHD_Result handle_health(struct kvs_api *a, struct MHD_Connection *c)
{
    struct kvs_stage_metrics m;
    kvs_stage_metrics(a->head, &m);
    bool ok = kvs_stage_ring_ready(a->head);
    char why[256] = "";
    if (!ok && (kvs_stage_ring_error(a->head, why, sizeof why) == KVS_OK || !why[0]))
        snprintf(why, sizeof why, "the ring is not whole");
    kvs_api_utf8_fix(why); /* may quote a peer's refusal, cut to the buffer */
    json_t *o = ok ? json_pack("{s:s}", "status", "ok")
                   : json_pack("{s:s, s:b, s:b, s:s}", "status", "unavailable", "in_link", m.in_up, "out_link",
                               m.out_up, "reason", why);
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return send_json(c, ok ? 200 : 503, s);
}

static enum MHD_Result handle_metrics(struct kvs_api *a, struct MHD_Connection *c)
{
    struct kvs_stage_metrics m;
    kvs_stage_metrics(a->head, &m);
    struct kvs_api_buf b = { .limit = 1u << 20 };
    struct kvs_stage_hop hops[64];
    double rtt_ms = 0;
    int n_hops = kvs_stage_ring_stats(a->head, hops, 64, &rtt_ms);
    if (n_hops > 64) n_hops = 64;
    if (!kvs_api_metrics_render(&a->met, &m, a->p.stage_index, &b) ||
        !kvs_api_metrics_render_ring(hops, n_hops, rtt_ms, &b)) {
        kvs_api_buf_free(&b);
        return send_error_simple(c, 500, "server_error", NULL, "cannot render metrics");
    }
    return send_text(c, 200, "text/plain; version=0.0.4; charset=utf-8", b.p, b.len);
}

/* --- MHD glue ------------------------------------------------------------------------ */

#define DRAIN_FACTOR 16 /* bodies up to 16 x max_body are drained before the 413 */

struct conn_ctx {
    char *body;
    size_t len, cap;
    size_t dropped;
    bool too_big;
    bool unauthorized; /* no or a wrong API key: the body is dropped, the answer is 401 */
};

/* True when the request carries "Authorization: Bearer KEY" (RFC 6750 §2.1)
 * with the API key. Compared in time independent of where they differ. */
static bool authorized(const struct kvs_api *a, struct MHD_Connection *c)
{
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!h || strncasecmp(h, "Bearer ", 7)) return false;
    h += 7;
    while (*h == ' ') h++;
    size_t n = strlen(h), k = strlen(a->api_key);
    unsigned diff = n != k;
    for (size_t i = 0; i < k; i++) diff |= (unsigned char)a->api_key[i] ^ (unsigned char)(i < n ? h[i] : 0);
    return diff == 0;
}

static enum MHD_Result send_unauthorized(struct kvs_api *a, struct MHD_Connection *c)
{
    const char *h = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    struct kvs_api_error e;
    if (!h)
        kvs_api_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key",
                          "You didn't provide an API key: send it as \"Authorization: Bearer KEY\"");
    else
        kvs_api_error_set(&e, 401, "invalid_request_error", NULL, "invalid_api_key", "Incorrect API key provided");
    count_status(a, KVS_API_STATUS_INVALID);
    char *s = kvs_api_error_json(&e);
    if (!s) return MHD_NO;
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
    if (!r) {
        free(s);
        return MHD_NO;
    }
    MHD_add_response_header(r, "Content-Type", "application/json");
    MHD_add_response_header(r, "WWW-Authenticate", "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, 401, r);
    MHD_destroy_response(r);
    return ret;
}

enum route { ROUTE_NONE, ROUTE_COMPLETIONS, ROUTE_CHAT, ROUTE_MODELS, ROUTE_HEALTH, ROUTE_METRICS };

static enum route find_route(const char *url, bool *post)
{
    static const struct {
        const char *path;
        enum route r;
        bool post;
    } routes[] = {
        { "/v1/completions", ROUTE_COMPLETIONS, true },
        { "/v1/chat/completions", ROUTE_CHAT, true },
        { "/v1/models", ROUTE_MODELS, false },
        { "/health", ROUTE_HEALTH, false },
        { "/metrics", ROUTE_METRICS, false },
    };
    size_t ul = strlen(url);
    if (ul > 1 && url[ul - 1] == '/') ul--; /* tolerate one trailing slash */
    for (size_t i = 0; i < sizeof routes / sizeof routes[0]; i++)
        if (strlen(routes[i].path) == ul && !strncmp(url, routes[i].path, ul)) {
            *post = routes[i].post;
            return routes[i].r;
        }
    return ROUTE_NONE;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct kvs_api *a = cls;
    bool post = false;
    enum route rt = find_route(url, &post);
    struct conn_ctx *cc = *con_cls;
    if (!cc) {
        cc = calloc(1, sizeof *cc);
        if (!cc) return MHD_NO;
        *con_cls = cc;
        bool open = rt == ROUTE_HEALTH || rt == ROUTE_METRICS;
        if (a->api_key[0] && (!open || a->p.auth_all) && !authorized(a, c)) {
            cc->unauthorized = true;
            return MHD_YES; /* answered once the body is in (dropped, not kept) */
        }
        if (rt == ROUTE_NONE || (post && strcmp(method, "POST")) || (!post && strcmp(method, "GET") && strcmp(method, "HEAD")))
            return MHD_YES; /* answered once the body (if any) is read */
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        bool huge = false;
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            cc->too_big = errno || end == cl || v > a->p.max_body;
            huge = cc->too_big && (errno || end == cl || v / DRAIN_FACTOR > a->p.max_body);
        }
        /* A body a little over the cap is read and dropped, so that the client
         * (still writing) gets the 413 instead of a broken pipe. */
        if (huge) {
            kvs_api_gate_received(a->gate, c);
            char msg[128];
            snprintf(msg, sizeof msg, "request body exceeds %zu bytes", a->p.max_body);
            count_status(a, KVS_API_STATUS_INVALID);
            return send_error_simple(c, 413, "invalid_request_error", "request_too_large", msg);
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (cc->unauthorized) {
            cc->dropped += *upload_size;
            *upload_size = 0;
            return cc->dropped / DRAIN_FACTOR > a->p.max_body ? MHD_NO : MHD_YES;
        }
        if (cc->too_big) {
            cc->dropped += *upload_size;
            if (cc->dropped / DRAIN_FACTOR > a->p.max_body) return MHD_NO; /* stop reading: close */
        } else {
            if (*upload_size > a->p.max_body - cc->len) {
                cc->too_big = true;
                cc->dropped = cc->len + *upload_size;
            } else {
                if (cc->len + *upload_size + 1 > cc->cap) {
                    size_t nc = cc->cap ? cc->cap : 4096;
                    while (nc < cc->len + *upload_size + 1) nc *= 2;
                    char *nb = realloc(cc->body, nc);
                    if (!nb) return MHD_NO;
                    cc->body = nb;
                    cc->cap = nc;
                }
                memcpy(cc->body + cc->len, upload, *upload_size);
                cc->len += *upload_size;
            }
        }
        *upload_size = 0;
        return MHD_YES;
    }
    /* the whole request is in */
    kvs_api_gate_received(a->gate, c);
    if (cc->unauthorized) return send_unauthorized(a, c);
    if (rt == ROUTE_NONE) {
        char msg[200];
        snprintf(msg, sizeof msg, "unknown route %.100s %.60s", method, url);
        return send_error_simple(c, 404, "invalid_request_error", "unknown_url", msg);
    }
    if ((post && strcmp(method, "POST")) || (!post && strcmp(method, "GET") && strcmp(method, "HEAD"))) {
        char msg[200];
        snprintf(msg, sizeof msg, "method %.20s is not allowed on %.100s (use %s)", method, url, post ? "POST" : "GET");
        struct kvs_api_error e;
        kvs_api_error_set(&e, 405, "invalid_request_error", NULL, "method_not_allowed", "%s", msg);
        char *s = kvs_api_error_json(&e);
        if (!s) return MHD_NO;
        struct MHD_Response *r = MHD_create_response_from_buffer(strlen(s), s, MHD_RESPMEM_MUST_FREE);
        if (!r) {
            free(s);
            return MHD_NO;
        }
        MHD_add_response_header(r, "Content-Type", "application/json");
        MHD_add_response_header(r, "Allow", post ? "POST" : "GET, HEAD");
        enum MHD_Result ret = MHD_queue_response(c, 405, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (cc->too_big) {
        char msg[128];
        snprintf(msg, sizeof msg, "request body exceeds %zu bytes", a->p.max_body);
        count_status(a, KVS_API_STATUS_INVALID);
        return send_error_simple(c, 413, "invalid_request_error", "request_too_large", msg);
    }
    switch (rt) {
    case ROUTE_COMPLETIONS: return handle_generate(a, c, KVS_API_COMPLETION, cc->body, cc->len);
    case ROUTE_CHAT: return handle_generate(a, c, KVS_API_CHAT, cc->body, cc->len);
    case ROUTE_MODELS: return handle_models(a, c);
    case ROUTE_HEALTH: return handle_health(a, c);
    case ROUTE_METRICS: return handle_metrics(a, c);
    default: return MHD_NO;
    }
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    struct kvs_api *a = cls;
    kvs_api_gate_request_done(a->gate, c);
    struct conn_ctx *cc = *con_cls;
    if (cc) {
        free(cc->body);
        free(cc);
        *con_cls = NULL;
    }
}

/* microhttpd's log callback: fmt is its printf format (format attribute: the
 * compiler checks the use of ap, and -Wformat-nonliteral knows fmt is one). */
static void on_mhd_log(void *cls, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && msg[n - 1] == '\n') msg[--n] = 0;
    KVS_LOGD("api: microhttpd: %s", msg);
}

/* --- start / stop ------------------------------------------------------------------------- */

struct kvs_api_params kvs_api_default_params(void)
{
    struct kvs_api_params p = { 0 };
    p.bind_addr = "127.0.0.1";
    p.max_body = 1u << 20;
    p.max_connections = 64;
    p.max_per_addr = 16;
    p.request_timeout_s = 30;
    return p;
}

static void model_id_from_path(const char *path, char *out, size_t cap)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    if (n > 5 && !strcmp(b + n - 5, ".gguf")) n -= 5;
    if (n >= cap) n = cap - 1;
    memcpy(out, b, n);
    out[n] = 0;
}

kvs_err kvs_api_start(struct kvs_stage *head, const struct kvs_api_params *p, struct kvs_api **out, char *errbuf,
                      size_t errlen)
{
    *out = NULL;
    if (!head || !p || !kvs_stage_is_head(head) || !kvs_stage_tokenizer(head) || p->max_body == 0 ||
        p->max_connections < 1 || p->max_connections > (1 << 16) || p->max_per_addr < 1 ||
        p->request_timeout_s < 1) {
        snprintf(errbuf, errlen, "kvs_api_start needs a head stage and valid params");
        return KVS_ERR_ARG;
    }
    if (p->chat_template && kvs_chat_from_name(p->chat_template) == KVS_CHAT_NONE) {
        snprintf(errbuf, errlen, "unknown chat template '%s' (chatml or llama3)", p->chat_template);
        return KVS_ERR_ARG;
    }
    struct kvs_api *a = calloc(1, sizeof *a);
    if (!a) return KVS_ERR_NOMEM;
    a->head = head;
    a->tok = kvs_stage_tokenizer(head);
    a->p = *p;
    if (p->api_key) {
        size_t kl = strlen(p->api_key);
        bool ok = kl >= 1 && kl < sizeof a->api_key;
        for (size_t i = 0; ok && i < kl; i++) ok = p->api_key[i] > ' ' && p->api_key[i] < 127;
        if (!ok) {
            free(a);
            if (errbuf && errlen) snprintf(errbuf, errlen, "an API key must be 1..255 bytes of visible ASCII");
            return KVS_ERR_ARG;
        }
        memcpy(a->api_key, p->api_key, kl + 1);
    }
    a->p.api_key = NULL; /* the copy above is the one used */
    if (!a->p.bind_addr) a->p.bind_addr = "127.0.0.1";
    pthread_mutex_init(&a->mu, NULL);
    kvs_api_metrics_init(&a->met);
    a->id_salt = ((uint64_t)time(NULL) << 20) ^ (uint64_t)now_ns();
    if (p->model_name)
        snprintf(a->model, sizeof a->model, "%s", p->model_name);
    else if (p->model_path)
        model_id_from_path(p->model_path, a->model, sizeof a->model);
    else
        snprintf(a->model, sizeof a->model, "kvasir");
    kvs_api_utf8_fix(a->model); /* the name appears in every response */

    kvs_err e = KVS_OK;
    if (p->model_path) {
        struct kvs_gguf *g = NULL;
        char gerr[256] = "";
        e = kvs_gguf_open(p->model_path, &g, gerr, sizeof gerr);
        if (e) {
            snprintf(errbuf, errlen, "cannot read %s: %s", p->model_path, gerr);
            goto fail;
        }
        const char *tpl;
        size_t tl;
        bool has_tpl = !kvs_gguf_get_str(g, "tokenizer.chat_template", &tpl, &tl);
        if (has_tpl && tl <= MAX_TEMPLATE)
            a->chat = kvs_chat_detect(tpl, tl);
        kvs_gguf_close(g);
        if (p->chat_template) {
            a->chat = kvs_chat_from_name(p->chat_template);
            KVS_LOGI("api: model '%s', chat template %s (--chat-template)", a->model, kvs_chat_name(a->chat));
        } else if (a->chat == KVS_CHAT_NONE) {
            a->chat = KVS_CHAT_CHATML;
            a->chat_fallback = true;
            KVS_LOGI("api: model '%s' has %s: /v1/chat/completions falls back to ChatML "
                     "(--chat-template chatml|llama3 chooses one)",
                     a->model, has_tpl ? "a chat template of no supported family" : "no chat template");
        } else {
            KVS_LOGI("api: model '%s', chat template %s", a->model, kvs_chat_name(a->chat));
        }
    }

    e = kvs_api_gate_open(a->p.bind_addr, p->port, p->max_connections, a->p.max_per_addr, a->p.request_timeout_s,
                          &a->met, &a->gate, errbuf, errlen);
    if (e) goto fail;
    /* MHD's own limit never binds (the gate admits at most 2 * max_connections,
     * evicted ones included); its timeout is the idle one. */
    a->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                                MHD_USE_ITC | MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ERROR_LOG,
                            0, NULL, NULL, on_access, a, MHD_OPTION_NOTIFY_COMPLETED, on_completed, a,
                            MHD_OPTION_NOTIFY_CONNECTION, kvs_api_gate_notify, a->gate,
                            MHD_OPTION_CONNECTION_LIMIT, (unsigned int)(4 * p->max_connections + 16),
                            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)120, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log,
                            a, MHD_OPTION_END);
    if (!a->d) {
        snprintf(errbuf, errlen, "cannot start the HTTP server");
        e = KVS_ERR_NET;
        goto fail;
    }
    e = kvs_api_gate_run(a->gate, a->d);
    if (e) {
        snprintf(errbuf, errlen, "cannot start the API's accept thread");
        goto fail;
    }
    a->port = kvs_api_gate_port(a->gate);
    KVS_LOGI("api: listening on http://%s:%u", a->p.bind_addr, (unsigned)a->port);
    *out = a;
    return KVS_OK;
fail:
    kvs_api_gate_stop(a->gate);
    if (a->d) MHD_stop_daemon(a->d);
    kvs_api_gate_free(a->gate);
    kvs_api_metrics_destroy(&a->met);
    pthread_mutex_destroy(&a->mu);
    free(a);
    return e;
}

uint16_t kvs_api_port(const struct kvs_api *a)
{
    return a->port;
}

void kvs_api_stop(struct kvs_api *a)
{
    if (!a) return;
    __atomic_store_n(&a->stopping, 1, __ATOMIC_RELEASE);
    kvs_api_gate_stop(a->gate);      /* no new connections */
    if (a->d) MHD_stop_daemon(a->d); /* joins the connection threads; their jobs cancel themselves */
    kvs_api_gate_free(a->gate);
    kvs_api_metrics_destroy(&a->met);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

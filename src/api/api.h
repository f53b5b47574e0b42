/* OpenAI-compatible HTTP API served by the head stage of a ring.
 *
 * Routes (JSON bodies, UTF-8):
 *   POST /v1/completions       prompt -> text (stream: SSE text_completion chunks)
 *   POST /v1/chat/completions  messages -> chat template -> text (stream: SSE chunks)
 *   GET  /v1/models            the one model
 *   GET  /health               200 {"status":"ok"} when the ring is whole, else 503
 *   GET  /metrics              Prometheus text format 0.0.4
 * Errors use OpenAI's shape {"error":{"message","type","param","code"}} with
 * 400 (bad JSON or fields), 404 (route), 405 (method), 413 (body over
 * max_body), 503 (ring not ready), 502 (ring failed mid-request), 500. In a
 * stream that already started, an error is one SSE data event holding the
 * error object, and the stream ends (no [DONE]).
 * Shapes follow the OpenAI API reference (completions, chat completions,
 * streaming chunks); SSE framing follows the WHATWG server-sent events spec.
 *
 * Threads: libmicrohttpd runs one thread per connection. Each request is
 * submitted with kvs_stage_submit; its events arrive on the stage's loop
 * thread and are handed to the connection through a per-request queue
 * (mutex + condvar), so the loop never blocks. A client that disconnects
 * before its request ended gets the request cancelled on every stage
 * (kvs_stage_cancel).
 *
 * The lower half of this header is the JSON layer (parsing, validation and
 * builders, no I/O), public so that tests and fuzzers can drive it. */
#ifndef KVS_API_H
#define KVS_API_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chat/chat.h"
#include "common/error.h"
#include "sampler/sampler.h"

struct kvs_stage;

struct kvs_api_params {
    const char *bind_addr;   /* IPv4 address to listen on (default "127.0.0.1"); "0.0.0.0" = all */
    uint16_t port;           /* 0: any free port (see kvs_api_port) */
    const char *model_name;  /* id reported in responses and /v1/models; NULL: file name of model_path */
    const char *model_path;  /* GGUF read once at start for tokenizer.chat_template; NULL: no chat */
    const char *chat_template; /* "chatml" | "llama3": used for /v1/chat/completions whatever the
                                * GGUF says; NULL: the GGUF's family, and ChatML (logged) when it
                                * has no template or one of another family, as llama-server does
                                * (then with BOS when the tokenizer adds one, as for a completion) */
    size_t max_body;         /* request body cap in bytes (default 1 MiB) -> 413 above it */
    int32_t max_connections; /* concurrent connections (default 64); a connection past it evicts the oldest
                                one still sending its request, or, when all are being served, is
                                answered 503 */
    int32_t max_per_addr;    /* of those, from one client IPv4 address (default 16); more: 503 */
    int32_t request_timeout_s; /* a connection must send a whole request (headers and body) within this
                                  many seconds of its accept or of the end of its previous request
                                  (default 30), else it is closed: slow senders cannot hold slots */
    int32_t stage_index;     /* label of this stage in /metrics (default 0) */
    const char *api_key;     /* NULL: open. Else (copied; 1..255 bytes of visible ASCII) every /v1/ route
                              * (and unknown routes) needs "Authorization: Bearer API_KEY": without it
                              * 401 with OpenAI's error shape, code "invalid_api_key" */
    bool auth_all;           /* with api_key: /health and /metrics need it too (default: they stay
                              * open, for load balancers and Prometheus on a private network) */
    bool chat_parse_special; /* chat: parse special-token texts inside message content too (the old,
                                injectable way; default false: content is plain text, kvs_chat_tokenize) */
};
struct kvs_api_params kvs_api_default_params(void);

struct kvs_api; /* opaque */

/* Starts the HTTP server for head (a head stage: kvs_stage_is_head; borrowed,
 * must outlive the API). The stage loop (kvs_stage_run) is expected to run on
 * its own thread; requests that arrive before the ring is whole get 503.
 * Errors: KVS_ERR_ARG (not a head, bad params, an unknown chat_template), KVS_ERR_IO (model_path
 * unreadable), KVS_ERR_NET (cannot listen: errbuf says why). *out: free with
 * kvs_api_stop. */
kvs_err kvs_api_start(struct kvs_stage *head, const struct kvs_api_params *p, struct kvs_api **out,
                      char *errbuf, size_t errlen);
/* The TCP port listened on. */
uint16_t kvs_api_port(const struct kvs_api *a);
/* Stops the server: requests in flight are cancelled and their connections
 * closed; waits for the connection threads. Call it BEFORE stopping the stage
 * loop. NULL allowed. */
void kvs_api_stop(struct kvs_api *a);

/* --- JSON layer ------------------------------------------------------------ */

enum kvs_api_kind { KVS_API_COMPLETION = 0, KVS_API_CHAT };

#define KVS_API_MAX_STOP 4          /* OpenAI allows up to 4 stop sequences */
#define KVS_API_MAX_STOP_LEN 256    /* bytes per stop sequence */
#define KVS_API_MAX_MESSAGES 1024
#define KVS_API_MAX_PROMPT_IDS 1000000
#define KVS_API_MAX_TOKENS_CAP 1000000

/* A validated request. Strings and arrays are owned (kvs_api_request_free). */
struct kvs_api_request {
    enum kvs_api_kind kind;
    /* completion: exactly one of prompt (text) / prompt_ids is set */
    char *prompt;                     /* NUL-terminated; prompt_len bytes (may hold NULs) */
    size_t prompt_len;
    int32_t *prompt_ids;              /* [n_prompt_ids], each >= 0 (vocab range is checked later) */
    int32_t n_prompt_ids;
    /* chat */
    struct kvs_chat_message *messages; /* [n_messages]; role/content owned */
    size_t n_messages;
    /* common */
    int32_t max_tokens;               /* -1: not given (completion default 16; chat: up to the context) */
    struct kvs_sampler_params sampling; /* OpenAI defaults: temp 1, top_p 1, top_k off, min_p off */
    bool seed_given;
    bool stream;
    bool include_usage;               /* stream_options.include_usage */
    bool echo;                        /* completion: prepend the prompt text */
    char *stop[KVS_API_MAX_STOP];     /* stop sequences (non-empty, NUL-terminated) */
    size_t n_stop;
};

/* An error to send: HTTP status and the OpenAI error fields (static strings
 * or NULL for param/code). */
struct kvs_api_error {
    int status;          /* 400, 404, 405, 413, 500, 502, 503 */
    const char *type;    /* "invalid_request_error", "server_error", ... */
    const char *param;   /* offending field or NULL */
    const char *code;    /* machine code or NULL */
    char message[256];
};

/* Parses and validates a request body of the given kind. Fields and checks:
 *   completion: prompt (string | array of ints | array of one string;
 *     more than one prompt -> 400 "param":"prompt"), echo (bool);
 *   chat: messages (non-empty array of {role: system|developer|user|assistant,
 *     content: string | null | array of {type:"text", text}}; developer maps
 *     to system);
 *   both: max_tokens / max_completion_tokens (int >= 1, default: see
 *   struct), temperature [0, 2], top_p (0, 1], top_k (int >= 0, extension),
 *   min_p [0, 1], repeat_penalty (> 0, extension), frequency_penalty and
 *   presence_penalty [-2, 2] (mapped: repeat_penalty = 1 + max(0, f + p)
 *   when repeat_penalty is absent), seed (int), n (only 1), stream (bool),
 *   stream_options.include_usage (bool), stop (string | array of <= 4
 *   non-empty strings), logprobs (null/false/0 only); unknown fields are
 *   ignored (model, user, ...). Wrong JSON types, out-of-range values and
 *   missing required fields give KVS_ERR_ARG (bad JSON: KVS_ERR_FORMAT) with
 *   *err filled (status 400, param names the field). On success *out owns its
 *   strings. */
kvs_err kvs_api_parse_request(enum kvs_api_kind kind, const char *body, size_t len,
                              struct kvs_api_request *out, struct kvs_api_error *err);
/* Frees what a parsed request owns and zeroes it. NULL allowed. */
void kvs_api_request_free(struct kvs_api_request *r);

/* Replaces, in place, every byte of s that does not start a valid UTF-8
 * sequence (RFC 3629; a sequence cut by a fixed-size buffer included) with
 * '?', so that any text can go into a JSON string. */
void kvs_api_utf8_fix(char *s);

/* Fills *e (message formatted printf-style, then made valid UTF-8 with
 * kvs_api_utf8_fix: it may quote client input or be cut at 512 bytes). */
void kvs_api_error_set(struct kvs_api_error *e, int status, const char *type, const char *param,
                       const char *code, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* {"error":{"message":...,"type":...,"param":...,"code":...}} (compact,
 * that key order; param/code null when NULL). malloc'd, caller frees; NULL
 * on allocation failure. */
char *kvs_api_error_json(const struct kvs_api_error *e);

/* What a finished (or streaming) request has produced. text is UTF-8. */
struct kvs_api_result {
    const char *id;            /* "cmpl-..." / "chatcmpl-..." */
    int64_t created;           /* Unix seconds */
    const char *model;
    const char *text;
    size_t text_len;
    const char *finish_reason; /* "stop" | "length" | NULL (chunk: null) */
    int32_t prompt_tokens, completion_tokens;
};

/* Non-stream response (compact JSON, malloc'd; NULL on failure):
 *   completion: {"id","object":"text_completion","created","model",
 *     "choices":[{"text","index":0,"logprobs":null,"finish_reason"}],
 *     "usage":{"prompt_tokens","completion_tokens","total_tokens"}}
 *   chat: {"id","object":"chat.completion","created","model",
 *     "choices":[{"index":0,"message":{"role":"assistant","content"},
 *     "logprobs":null,"finish_reason"}],"usage":{...}} */
char *kvs_api_response_json(enum kvs_api_kind kind, const struct kvs_api_result *r);

/* One stream chunk (the JSON after "data: "), compact, malloc'd:
 *   completion: {"id","object":"text_completion","created","model",
 *     "choices":[{"text","index":0,"logprobs":null,"finish_reason"}]}
 *   chat: {"id","object":"chat.completion.chunk","created","model",
 *     "choices":[{"index":0,"delta":{...},"logprobs":null,"finish_reason"}]}
 *     where delta is {"role":"assistant","content":""} when role_delta, else
 *     {"content":text} when text_len > 0 or finish_reason is NULL, else {}.
 * finish_reason NULL -> null. With usage_only: "choices":[] and a "usage"
 * object (the include_usage chunk). */
char *kvs_api_chunk_json(enum kvs_api_kind kind, const struct kvs_api_result *r, bool role_delta,
                         bool usage_only);

/* Stop-sequence scan over generated text. text[0..len) is all text so far;
 * positions before `from` are known not to start a match (pass the previous
 * return value). Returns the number of bytes that are final: if a stop
 * sequence occurs (earliest start at or after from), *hit is set and the
 * return value is where it starts (cut there); otherwise it is len minus the
 * longest suffix that is a proper prefix of some stop sequence (held back
 * until more text decides). Never cuts inside a UTF-8 character when text
 * and stops are valid UTF-8. */
size_t kvs_api_stop_scan(const char *text, size_t len, size_t from, char *const *stops, size_t n_stop,
                         bool *hit);

#endif

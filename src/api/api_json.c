/* JSON layer of the API: request parsing/validation, response and chunk
 * builders, error bodies, stop-sequence scan. No I/O. Field semantics follow
 * the OpenAI API reference (completions and chat completions). */
#include "api/api.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

/* Length of the valid UTF-8 sequence at s (RFC 3629: no overlongs, no
 * surrogates, <= U+10FFFF), or 0 if it is not one (a cut sequence included). */
static size_t utf8_seq_len(const unsigned char *s)
{
    unsigned c = s[0];
    if (c < 0x80) return 1;
    size_t n = c >= 0xC2 && c <= 0xDF ? 2 : c >= 0xE0 && c <= 0xEF ? 3 : c >= 0xF0 && c <= 0xF4 ? 4 : 0;
    if (!n) return 0;
    for (size_t i = 1; i < n; i++)
        if ((s[i] & 0xC0) != 0x80) return 0; /* also stops at the NUL of a cut sequence */
    if (c == 0xE0 && s[1] < 0xA0) return 0; /* overlong */
    if (c == 0xED && s[1] >= 0xA0) return 0; /* surrogate */
    if (c == 0xF0 && s[1] < 0x90) return 0; /* overlong */
    if (c == 0xF4 && s[1] >= 0x90) return 0; /* > U+10FFFF */
    return n;
}

void kvs_api_utf8_fix(char *s)
{
    unsigned char *p = (unsigned char *)s;
    while (*p) {
        size_t n = utf8_seq_len(p);
        if (n) {
            p += n;
        } else {
            *p++ = '?';
        }
    }
}

void kvs_api_error_set(struct kvs_api_error *e, int status, const char *type, const char *param,
                       const char *code, const char *fmt, ...)
{
    e->status = status;
    e->type = type;
    e->param = param;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    kvs_api_utf8_fix(e->message); /* a cut (or client-sent) byte sequence must not break the JSON */
}

static json_t *str_or_null(const char *s)
{
    return s ? json_string(s) : json_null();
}

static char *dump(json_t *o)
{
    if (!o) return NULL;
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

char *kvs_api_error_json(const struct kvs_api_error *e)
{
    json_t *inner = json_pack("{s:s, s:s, s:o, s:o}", "message", e->message, "type",
                              e->type ? e->type : "server_error", "param", str_or_null(e->param), "code",
                              str_or_null(e->code));
    if (!inner) return NULL;
    return dump(json_pack("{s:o}", "error", inner));
}

/* --- parsing ----------------------------------------------------------------- */

#define BAD(param, ...)                                                                          \
    do {                                                                                         \
        kvs_api_error_set(err, 400, "invalid_request_error", param, NULL, __VA_ARGS__);          \
        goto fail;                                                                               \
    } while (0)

static bool is_int(const json_t *v)
{
    if (json_is_integer(v)) return true;
    /* 16.0 is an integer too (some clients send floats) */
    if (json_is_real(v)) {
        double d = json_real_value(v);
        return isfinite(d) && d == floor(d) && fabs(d) < 9.0e15;
    }
    return false;
}

static int64_t int_val(const json_t *v)
{
    return json_is_integer(v) ? (int64_t)json_integer_value(v) : (int64_t)json_real_value(v);
}

/* Reads an optional number field; returns 0 absent/null, 1 set, -1 wrong type. */
static int get_num(const json_t *o, const char *key, double *out)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) return -1;
    *out = json_number_value(v);
    return 1;
}

static char *dup_n(const char *s, size_t n)
{
    char *d = malloc(n + 1);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

static kvs_err parse_common(const json_t *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    double d;
    int g;
    json_t *v;

    /* max_tokens, or its chat successor max_completion_tokens */
    const char *mt_key = "max_tokens";
    v = json_object_get(root, "max_tokens");
    if ((!v || json_is_null(v)) && r->kind == KVS_API_CHAT) {
        mt_key = "max_completion_tokens";
        v = json_object_get(root, mt_key);
    }
    if (v && !json_is_null(v)) {
        if (!is_int(v)) BAD(mt_key, "'%s' must be an integer", mt_key);
        int64_t n = int_val(v);
        if (n < 1 || n > KVS_API_MAX_TOKENS_CAP)
            BAD(mt_key, "'%s' must be between 1 and %d", mt_key, KVS_API_MAX_TOKENS_CAP);
        r->max_tokens = (int32_t)n;
    }

    g = get_num(root, "temperature", &d);
    if (g < 0) BAD("temperature", "'temperature' must be a number");
    if (g > 0) {
        if (!(d >= 0 && d <= 2)) BAD("temperature", "'temperature' must be between 0 and 2");
        r->sampling.temp = (float)d;
    }
    g = get_num(root, "top_p", &d);
    if (g < 0) BAD("top_p", "'top_p' must be a number");
    if (g > 0) {
        if (!(d > 0 && d <= 1)) BAD("top_p", "'top_p' must be in (0, 1]");
        r->sampling.top_p = (float)d;
    }
    g = get_num(root, "min_p", &d);
    if (g < 0) BAD("min_p", "'min_p' must be a number");
    if (g > 0) {
        if (!(d >= 0 && d <= 1)) BAD("min_p", "'min_p' must be in [0, 1]");
        r->sampling.min_p = (float)d;
    }
    v = json_object_get(root, "top_k");
    if (v && !json_is_null(v)) {
        if (!is_int(v) || int_val(v) < 0 || int_val(v) > INT32_MAX)
            BAD("top_k", "'top_k' must be a non-negative integer");
        r->sampling.top_k = (int32_t)int_val(v);
    }
    double fp = 0, pp = 0;
    g = get_num(root, "frequency_penalty", &fp);
    if (g < 0 || (g > 0 && !(fp >= -2 && fp <= 2)))
        BAD("frequency_penalty", "'frequency_penalty' must be a number between -2 and 2");
    g = get_num(root, "presence_penalty", &pp);
    if (g < 0 || (g > 0 && !(pp >= -2 && pp <= 2)))
        BAD("presence_penalty", "'presence_penalty' must be a number between -2 and 2");
    g = get_num(root, "repeat_penalty", &d);
    if (g < 0) BAD("repeat_penalty", "'repeat_penalty' must be a number");
    if (g > 0) {
        if (!(d > 0 && d <= 10)) BAD("repeat_penalty", "'repeat_penalty' must be in (0, 10]");
        r->sampling.repeat_penalty = (float)d;
    } else if (fp + pp > 0) {
        r->sampling.repeat_penalty = (float)(1.0 + fp + pp);
    }
    v = json_object_get(root, "seed");
    if (v && !json_is_null(v)) {
        if (!is_int(v)) BAD("seed", "'seed' must be an integer");
        r->sampling.seed = (uint64_t)int_val(v);
        r->seed_given = true;
    }
    v = json_object_get(root, "n");
    if (v && !json_is_null(v)) {
        if (!is_int(v)) BAD("n", "'n' must be an integer");
        if (int_val(v) != 1) BAD("n", "only n = 1 is supported");
    }
    v = json_object_get(root, "logprobs");
    if (v && !json_is_null(v) && !json_is_false(v) && !(is_int(v) && int_val(v) == 0))
        BAD("logprobs", "logprobs are not supported");
    v = json_object_get(root, "stream");
    if (v && !json_is_null(v)) {
        if (!json_is_boolean(v)) BAD("stream", "'stream' must be a boolean");
        r->stream = json_is_true(v);
    }
    v = json_object_get(root, "stream_options");
    if (v && !json_is_null(v)) {
        if (!json_is_object(v)) BAD("stream_options", "'stream_options' must be an object");
        json_t *u = json_object_get(v, "include_usage");
        if (u && !json_is_null(u)) {
            if (!json_is_boolean(u)) BAD("stream_options", "'include_usage' must be a boolean");
            r->include_usage = json_is_true(u);
        }
    }
    v = json_object_get(root, "stop");
    if (v && !json_is_null(v)) {
        json_t *one[1] = { v };
        json_t **items = one;
        size_t n = 1;
        if (json_is_array(v)) {
            n = json_array_size(v);
            if (n > KVS_API_MAX_STOP) BAD("stop", "at most %d stop sequences", KVS_API_MAX_STOP);
            items = NULL;
        } else if (!json_is_string(v)) {
            BAD("stop", "'stop' must be a string or an array of strings");
        }
        for (size_t i = 0; i < n; i++) {
            json_t *s = items ? items[i] : json_array_get(v, i);
            if (!json_is_string(s)) BAD("stop", "'stop' must be a string or an array of strings");
            size_t len = json_string_length(s);
            if (len == 0) BAD("stop", "stop sequences must not be empty");
            if (len > KVS_API_MAX_STOP_LEN) BAD("stop", "stop sequences are at most %d bytes", KVS_API_MAX_STOP_LEN);
            if (memchr(json_string_value(s), 0, len)) BAD("stop", "stop sequences must not contain NUL");
            r->stop[r->n_stop] = dup_n(json_string_value(s), len);
            if (!r->stop[r->n_stop]) goto nomem;
            r->n_stop++;
        }
    }
    return KVS_OK;
nomem:
    kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return KVS_ERR_NOMEM;
fail:
    return KVS_ERR_ARG;
}

static kvs_err parse_prompt(const json_t *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    json_t *v = json_object_get(root, "prompt");
    if (!v || json_is_null(v)) BAD("prompt", "'prompt' is required");
    if (json_is_array(v) && json_array_size(v) == 1 && json_is_string(json_array_get(v, 0)))
        v = json_array_get(v, 0); /* ["text"]: one prompt */
    if (json_is_string(v)) {
        r->prompt_len = json_string_length(v);
        r->prompt = dup_n(json_string_value(v), r->prompt_len);
        if (!r->prompt) goto nomem;
        return KVS_OK;
    }
    if (!json_is_array(v)) BAD("prompt", "'prompt' must be a string or an array of token ids");
    size_t n = json_array_size(v);
    if (n == 0) BAD("prompt", "'prompt' must not be empty");
    if (n > KVS_API_MAX_PROMPT_IDS) BAD("prompt", "'prompt' has more than %d token ids", KVS_API_MAX_PROMPT_IDS);
    json_t *first = json_array_get(v, 0);
    if (json_is_string(first) || json_is_array(first))
        BAD("prompt", "a list of prompts is not supported: send one prompt per request");
    r->prompt_ids = malloc(n * sizeof *r->prompt_ids);
    if (!r->prompt_ids) goto nomem;
    for (size_t i = 0; i < n; i++) {
        json_t *t = json_array_get(v, i);
        if (!is_int(t) || int_val(t) < 0 || int_val(t) > INT32_MAX)
            BAD("prompt", "'prompt' token ids must be non-negative integers (item %zu)", i);
        r->prompt_ids[i] = (int32_t)int_val(t);
    }
    r->n_prompt_ids = (int32_t)n;
    return KVS_OK;
nomem:
    kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return KVS_ERR_NOMEM;
fail:
    return KVS_ERR_ARG;
}

/* Message content: a string, null, or an array of {type:"text", text} parts
 * joined. Returns a malloc'd string or NULL with *err set. */
static char *message_content(const json_t *c, size_t idx, struct kvs_api_error *err)
{
    if (!c || json_is_null(c)) return dup_n("", 0);
    if (json_is_string(c)) {
        if (memchr(json_string_value(c), 0, json_string_length(c))) {
            kvs_api_error_set(err, 400, "invalid_request_error", "messages", NULL,
                              "messages[%zu].content must not contain NUL", idx);
            return NULL;
        }
        return dup_n(json_string_value(c), json_string_length(c));
    }
    if (!json_is_array(c)) {
        kvs_api_error_set(err, 400, "invalid_request_error", "messages", NULL,
                          "messages[%zu].content must be a string or an array of text parts", idx);
        return NULL;
    }
    size_t total = 0;
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *p = json_array_get(c, i);
        json_t *t = json_object_get(p, "text");
        const char *ty = json_string_value(json_object_get(p, "type"));
        if (!json_is_object(p) || !ty || strcmp(ty, "text") || !json_is_string(t) ||
            memchr(json_string_value(t), 0, json_string_length(t))) {
            kvs_api_error_set(err, 400, "invalid_request_error", "messages", NULL,
                              "messages[%zu].content[%zu] must be {\"type\":\"text\",\"text\":string}", idx, i);
            return NULL;
        }
        total += json_string_length(t);
    }
    char *s = malloc(total + 1);
    if (!s) {
        kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        return NULL;
    }
    size_t at = 0;
    for (size_t i = 0; i < json_array_size(c); i++) {
        json_t *t = json_object_get(json_array_get(c, i), "text");
        memcpy(s + at, json_string_value(t), json_string_length(t));
        at += json_string_length(t);
    }
    s[at] = 0;
    return s;
}

static kvs_err parse_messages(const json_t *root, struct kvs_api_request *r, struct kvs_api_error *err)
{
    json_t *v = json_object_get(root, "messages");
    if (!v || json_is_null(v)) BAD("messages", "'messages' is required");
    if (!json_is_array(v)) BAD("messages", "'messages' must be an array");
    size_t n = json_array_size(v);
    if (n == 0) BAD("messages", "'messages' must not be empty");
    if (n > KVS_API_MAX_MESSAGES) BAD("messages", "at most %d messages", KVS_API_MAX_MESSAGES);
    r->messages = calloc(n, sizeof *r->messages);
    if (!r->messages) {
        kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
        return KVS_ERR_NOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *m = json_array_get(v, i);
        if (!json_is_object(m)) BAD("messages", "messages[%zu] must be an object", i);
        const char *role = json_string_value(json_object_get(m, "role"));
        if (!role) BAD("messages", "messages[%zu].role must be a string", i);
        if (!strcmp(role, "developer")) role = "system";
        if (strcmp(role, "system") && strcmp(role, "user") && strcmp(role, "assistant"))
            BAD("messages", "messages[%zu].role '%.40s' is not one of system, developer, user, assistant", i, role);
        char *content = message_content(json_object_get(m, "content"), i, err);
        if (!content) return err->status == 500 ? KVS_ERR_NOMEM : KVS_ERR_ARG;
        char *rd = dup_n(role, strlen(role));
        if (!rd) {
            free(content);
            kvs_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            return KVS_ERR_NOMEM;
        }
        r->messages[i].role = rd;
        r->messages[i].content = content;
        r->n_messages = i + 1;
    }
    return KVS_OK;
fail:
    return KVS_ERR_ARG;
}

kvs_err kvs_api_parse_request(enum kvs_api_kind kind, const char *body, size_t len,
                              struct kvs_api_request *out, struct kvs_api_error *err)
{
    memset(out, 0, sizeof *out);
    out->kind = kind;
    out->max_tokens = -1;
    out->sampling = kvs_sampler_default_params();
    out->sampling.temp = 1.0f;
    out->sampling.top_k = 0;
    out->sampling.top_p = 1.0f;
    out->sampling.min_p = 0.0f;
    out->sampling.repeat_penalty = 1.0f;
    out->sampling.seed = 0;

    json_error_t je;
    json_t *root = body ? json_loadb(body, len, JSON_REJECT_DUPLICATES, &je) : NULL;
    if (!root) {
        kvs_api_error_set(err, 400, "invalid_request_error", NULL, "invalid_json",
                          "request body is not valid JSON: %s (line %d, column %d)", body ? je.text : "empty",
                          body ? je.line : 0, body ? je.column : 0);
        return KVS_ERR_FORMAT;
    }
    kvs_err e = KVS_OK;
    if (!json_is_object(root)) {
        kvs_api_error_set(err, 400, "invalid_request_error", NULL, NULL, "request body must be a JSON object");
        e = KVS_ERR_ARG;
        goto done;
    }
    e = kind == KVS_API_CHAT ? parse_messages(root, out, err) : parse_prompt(root, out, err);
    if (e) goto done;
    if (kind == KVS_API_COMPLETION) {
        json_t *v = json_object_get(root, "echo");
        if (v && !json_is_null(v)) {
            if (!json_is_boolean(v)) {
                kvs_api_error_set(err, 400, "invalid_request_error", "echo", NULL, "'echo' must be a boolean");
                e = KVS_ERR_ARG;
                goto done;
            }
            out->echo = json_is_true(v);
        }
        v = json_object_get(root, "suffix");
        if (v && !json_is_null(v)) {
            kvs_api_error_set(err, 400, "invalid_request_error", "suffix", NULL, "'suffix' is not supported");
            e = KVS_ERR_ARG;
            goto done;
        }
    }
    e = parse_common(root, out, err);
done:
    json_decref(root);
    if (e) kvs_api_request_free(out);
    return e;
}

void kvs_api_request_free(struct kvs_api_request *r)
{
    if (!r) return;
    free(r->prompt);
    free(r->prompt_ids);
    for (size_t i = 0; i < r->n_messages; i++) {
        free((char *)r->messages[i].role);
        free((char *)r->messages[i].content);
    }
    free(r->messages);
    for (size_t i = 0; i < r->n_stop; i++) free(r->stop[i]);
    enum kvs_api_kind k = r->kind;
    memset(r, 0, sizeof *r);
    r->kind = k;
}

/* --- builders ------------------------------------------------------------------- */

static json_t *text_json(const struct kvs_api_result *r)
{
    return json_stringn(r->text ? r->text : "", r->text ? r->text_len : 0);
}

static json_t *usage_json(const struct kvs_api_result *r)
{
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)r->prompt_tokens, "completion_tokens",
                     (json_int_t)r->completion_tokens, "total_tokens",
                     (json_int_t)r->prompt_tokens + r->completion_tokens);
}

static json_t *head_json(const struct kvs_api_result *r, const char *object)
{
    return json_pack("{s:s, s:s, s:I, s:s}", "id", r->id ? r->id : "", "object", object, "created",
                     (json_int_t)r->created, "model", r->model ? r->model : "");
}

char *kvs_api_response_json(enum kvs_api_kind kind, const struct kvs_api_result *r)
{
    json_t *o = head_json(r, kind == KVS_API_CHAT ? "chat.completion" : "text_completion");
    if (!o) return NULL;
    json_t *choice;
    if (kind == KVS_API_CHAT)
        choice = json_pack("{s:i, s:{s:s, s:o}, s:n, s:o}", "index", 0, "message", "role", "assistant", "content",
                           text_json(r), "logprobs", "finish_reason", str_or_null(r->finish_reason));
    else
        choice = json_pack("{s:o, s:i, s:n, s:o}", "text", text_json(r), "index", 0, "logprobs", "finish_reason",
                           str_or_null(r->finish_reason));
    if (!choice || json_object_set_new(o, "choices", json_pack("[o]", choice)) ||
        json_object_set_new(o, "usage", usage_json(r))) {
        json_decref(o);
        return NULL;
    }
    return dump(o);
}

char *kvs_api_chunk_json(enum kvs_api_kind kind, const struct kvs_api_result *r, bool role_delta,
                         bool usage_only)
{
    json_t *o = head_json(r, kind == KVS_API_CHAT ? "chat.completion.chunk" : "text_completion");
    if (!o) return NULL;
    json_t *choices;
    if (usage_only) {
        choices = json_array();
    } else if (kind == KVS_API_CHAT) {
        json_t *delta;
        if (role_delta)
            delta = json_pack("{s:s, s:s}", "role", "assistant", "content", "");
        else if ((r->text && r->text_len > 0) || !r->finish_reason)
            delta = json_pack("{s:o}", "content", text_json(r));
        else
            delta = json_object();
        choices = json_pack("[{s:i, s:o, s:n, s:o}]", "index", 0, "delta", delta, "logprobs", "finish_reason",
                            str_or_null(r->finish_reason));
    } else {
        choices = json_pack("[{s:o, s:i, s:n, s:o}]", "text", text_json(r), "index", 0, "logprobs",
                            "finish_reason", str_or_null(r->finish_reason));
    }
    if (!choices || json_object_set_new(o, "choices", choices) ||
        (usage_only && json_object_set_new(o, "usage", usage_json(r)))) {
        json_decref(o);
        return NULL;
    }
    return dump(o);
}

/* --- stop sequences ---------------------------------------------------------------- */

size_t kvs_api_stop_scan(const char *text, size_t len, size_t from, char *const *stops, size_t n_stop,
                         bool *hit)
{
    *hit = false;
    if (from > len) from = len;
    size_t best = len;
    for (size_t k = 0; k < n_stop; k++) {
        size_t sl = strlen(stops[k]);
        if (sl == 0 || sl > len - from) continue;
        const char *p = memmem(text + from, len - from, stops[k], sl);
        if (p && (size_t)(p - text) < best) {
            best = (size_t)(p - text);
            *hit = true;
        }
    }
    if (*hit) return best;
    /* hold back the longest suffix that could still grow into a stop */
    size_t safe = len;
    for (size_t k = 0; k < n_stop; k++) {
        size_t sl = strlen(stops[k]);
        if (sl == 0) continue;
        size_t maxl = sl - 1 < len - from ? sl - 1 : len - from;
        for (size_t l = maxl; l > 0; l--) {
            if (!memcmp(text + len - l, stops[k], l)) {
                if (len - l < safe) safe = len - l;
                break;
            }
        }
    }
    return safe;
}

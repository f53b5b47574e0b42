/* The API's JSON layer: request validation (table of bad bodies with the
 * status and param each must give), parsed fields of good bodies, exact
 * response/chunk/error JSON (written by hand from the OpenAI shapes), the
 * stop-sequence scan (hand-computed cut points) and the Prometheus
 * histogram rendering (hand-counted buckets). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"
#include "api/api_impl.h"

struct bad_case {
    enum kvs_api_kind kind;
    const char *body;
    kvs_err err;
    const char *param; /* NULL: null */
};

#define C KVS_API_COMPLETION
#define H KVS_API_CHAT

static const struct bad_case k_bad[] = {
    { C, "", KVS_ERR_FORMAT, NULL },
    { C, "{", KVS_ERR_FORMAT, NULL },
    { C, "{\"prompt\":\"a\",}", KVS_ERR_FORMAT, NULL },
    { C, "{\"prompt\":\"a\",\"prompt\":\"b\"}", KVS_ERR_FORMAT, NULL },
    { C, "[1,2]", KVS_ERR_ARG, NULL },
    { C, "\"text\"", KVS_ERR_FORMAT, NULL }, /* jansson: top level must be an object or array */
    { C, "{}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":null}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":5}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[\"a\",\"b\"]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[[1,2],[3]]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[1,-2]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[1,2.5]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":[1,\"x\"]}", KVS_ERR_ARG, "prompt" },
    { C, "{\"prompt\":\"a\",\"max_tokens\":0}", KVS_ERR_ARG, "max_tokens" },
    { C, "{\"prompt\":\"a\",\"max_tokens\":\"16\"}", KVS_ERR_ARG, "max_tokens" },
    { C, "{\"prompt\":\"a\",\"max_tokens\":1.5}", KVS_ERR_ARG, "max_tokens" },
    { C, "{\"prompt\":\"a\",\"max_tokens\":1000001}", KVS_ERR_ARG, "max_tokens" },
    { C, "{\"prompt\":\"a\",\"temperature\":2.5}", KVS_ERR_ARG, "temperature" },
    { C, "{\"prompt\":\"a\",\"temperature\":-0.1}", KVS_ERR_ARG, "temperature" },
    { C, "{\"prompt\":\"a\",\"temperature\":\"hot\"}", KVS_ERR_ARG, "temperature" },
    { C, "{\"prompt\":\"a\",\"top_p\":0}", KVS_ERR_ARG, "top_p" },
    { C, "{\"prompt\":\"a\",\"top_p\":1.01}", KVS_ERR_ARG, "top_p" },
    { C, "{\"prompt\":\"a\",\"top_k\":-1}", KVS_ERR_ARG, "top_k" },
    { C, "{\"prompt\":\"a\",\"min_p\":2}", KVS_ERR_ARG, "min_p" },
    { C, "{\"prompt\":\"a\",\"repeat_penalty\":0}", KVS_ERR_ARG, "repeat_penalty" },
    { C, "{\"prompt\":\"a\",\"frequency_penalty\":3}", KVS_ERR_ARG, "frequency_penalty" },
    { C, "{\"prompt\":\"a\",\"presence_penalty\":true}", KVS_ERR_ARG, "presence_penalty" },
    { C, "{\"prompt\":\"a\",\"seed\":\"x\"}", KVS_ERR_ARG, "seed" },
    { C, "{\"prompt\":\"a\",\"n\":2}", KVS_ERR_ARG, "n" },
    { C, "{\"prompt\":\"a\",\"logprobs\":5}", KVS_ERR_ARG, "logprobs" },
    { C, "{\"prompt\":\"a\",\"stream\":1}", KVS_ERR_ARG, "stream" },
    { C, "{\"prompt\":\"a\",\"stream_options\":[]}", KVS_ERR_ARG, "stream_options" },
    { C, "{\"prompt\":\"a\",\"stream_options\":{\"include_usage\":\"yes\"}}", KVS_ERR_ARG, "stream_options" },
    { C, "{\"prompt\":\"a\",\"stop\":7}", KVS_ERR_ARG, "stop" },
    { C, "{\"prompt\":\"a\",\"stop\":\"\"}", KVS_ERR_ARG, "stop" },
    { C, "{\"prompt\":\"a\",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\"]}", KVS_ERR_ARG, "stop" },
    { C, "{\"prompt\":\"a\",\"stop\":[\"a\",3]}", KVS_ERR_ARG, "stop" },
    { C, "{\"prompt\":\"a\",\"echo\":\"no\"}", KVS_ERR_ARG, "echo" },
    { C, "{\"prompt\":\"a\",\"suffix\":\"z\"}", KVS_ERR_ARG, "suffix" },
    { H, "{}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":{}}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[]}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[\"hi\"]}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[{\"content\":\"hi\"}]}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[{\"role\":\"robot\",\"content\":\"hi\"}]}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", KVS_ERR_ARG, "messages" },
    { H, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\"}]}]}", KVS_ERR_ARG, "messages" },
    /* jansson refuses \u0000 unless asked: NUL never reaches the tokenizer */
    { H, "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}]}", KVS_ERR_FORMAT, NULL },
    { H, "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_completion_tokens\":0}", KVS_ERR_ARG,
      "max_completion_tokens" },
};

static void test_bad_requests(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
        const struct bad_case *c = &k_bad[i];
        struct kvs_api_request r;
        struct kvs_api_error e;
        memset(&e, 0, sizeof e);
        kvs_err got = kvs_api_parse_request(c->kind, c->body, strlen(c->body), &r, &e);
        if (got != c->err || e.status != 400 || (c->param == NULL) != (e.param == NULL) ||
            (c->param && strcmp(c->param, e.param)))
            fail_msg("case %zu %s: err %d status %d param %s (%s)", i, c->body, got, e.status,
                     e.param ? e.param : "null", e.message);
        assert_string_equal(e.type, "invalid_request_error");
        assert_true(strlen(e.message) > 0);
        /* a failed parse owns nothing */
        assert_null(r.prompt);
        assert_null(r.messages);
        assert_int_equal(r.n_stop, 0);
    }
}

static void test_null_body(void **state)
{
    (void)state;
    struct kvs_api_request r;
    struct kvs_api_error e;
    assert_int_equal(kvs_api_parse_request(C, NULL, 0, &r, &e), KVS_ERR_FORMAT);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.code, "invalid_json");
}

static void test_completion_defaults(void **state)
{
    (void)state;
    const char *b = "{\"model\":\"x\",\"prompt\":\"Once upon a time\"}";
    struct kvs_api_request r;
    struct kvs_api_error e;
    assert_int_equal(kvs_api_parse_request(C, b, strlen(b), &r, &e), KVS_OK);
    assert_string_equal(r.prompt, "Once upon a time");
    assert_int_equal(r.prompt_len, 16);
    assert_null(r.prompt_ids);
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.sampling.temp == 1.0f);
    assert_true(r.sampling.top_p == 1.0f);
    assert_int_equal(r.sampling.top_k, 0);
    assert_true(r.sampling.min_p == 0.0f);
    assert_true(r.sampling.repeat_penalty == 1.0f);
    assert_false(r.seed_given);
    assert_false(r.stream);
    assert_false(r.echo);
    assert_int_equal(r.n_stop, 0);
    kvs_api_request_free(&r);
    assert_null(r.prompt);
}

static void test_completion_fields(void **state)
{
    (void)state;
    const char *b = "{\"prompt\":[[1, 15, 400]][0],\"max_tokens\":60}";
    struct kvs_api_request r;
    struct kvs_api_error e;
    assert_int_equal(kvs_api_parse_request(C, b, strlen(b), &r, &e), KVS_ERR_FORMAT);

    b = "{\"prompt\":[1,15,400.0],\"max_tokens\":60,\"temperature\":0,\"top_p\":0.5,\"top_k\":40,"
        "\"min_p\":0.05,\"seed\":42,\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"stop\":[\"\\n\",\"The End\"],\"echo\":true,\"n\":1,\"logprobs\":null,\"frequency_penalty\":0.25,"
        "\"presence_penalty\":0.5}";
    assert_int_equal(kvs_api_parse_request(C, b, strlen(b), &r, &e), KVS_OK);
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_ids, 3);
    assert_int_equal(r.prompt_ids[0], 1);
    assert_int_equal(r.prompt_ids[1], 15);
    assert_int_equal(r.prompt_ids[2], 400);
    assert_int_equal(r.max_tokens, 60);
    assert_true(r.sampling.temp == 0.0f);
    assert_true(r.sampling.top_p == 0.5f);
    assert_int_equal(r.sampling.top_k, 40);
    assert_true(r.sampling.min_p == 0.05f);
    /* 1 + 0.25 + 0.5 */
    assert_true(r.sampling.repeat_penalty == 1.75f);
    assert_int_equal(r.sampling.seed, 42);
    assert_true(r.seed_given);
    assert_true(r.stream);
    assert_true(r.include_usage);
    assert_true(r.echo);
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n");
    assert_string_equal(r.stop[1], "The End");
    kvs_api_request_free(&r);

    /* one prompt in a list; a single stop string; explicit repeat_penalty wins */
    b = "{\"prompt\":[\"hi\"],\"stop\":\"x\",\"repeat_penalty\":1.1,\"frequency_penalty\":1}";
    assert_int_equal(kvs_api_parse_request(C, b, strlen(b), &r, &e), KVS_OK);
    assert_string_equal(r.prompt, "hi");
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "x");
    assert_true(r.sampling.repeat_penalty == 1.1f);
    kvs_api_request_free(&r);
}

static void test_chat_fields(void **state)
{
    (void)state;
    const char *b = "{\"messages\":[{\"role\":\"developer\",\"content\":\"Be terse.\"},"
                    "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"Hello, \"},"
                    "{\"type\":\"text\",\"text\":\"world\"}]},{\"role\":\"assistant\",\"content\":null}],"
                    "\"max_completion_tokens\":7}";
    struct kvs_api_request r;
    struct kvs_api_error e;
    assert_int_equal(kvs_api_parse_request(H, b, strlen(b), &r, &e), KVS_OK);
    assert_int_equal(r.kind, KVS_API_CHAT);
    assert_int_equal(r.n_messages, 3);
    assert_string_equal(r.messages[0].role, "system");
    assert_string_equal(r.messages[0].content, "Be terse.");
    assert_string_equal(r.messages[1].role, "user");
    assert_string_equal(r.messages[1].content, "Hello, world");
    assert_string_equal(r.messages[2].role, "assistant");
    assert_string_equal(r.messages[2].content, "");
    assert_int_equal(r.max_tokens, 7);
    kvs_api_request_free(&r);
}

static void test_error_json(void **state)
{
    (void)state;
    struct kvs_api_error e;
    kvs_api_error_set(&e, 400, "invalid_request_error", "max_tokens", NULL, "'%s' must be an integer", "max_tokens");
    char *s = kvs_api_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"'max_tokens' must be an integer\","
                           "\"type\":\"invalid_request_error\",\"param\":\"max_tokens\",\"code\":null}}");
    free(s);
    kvs_api_error_set(&e, 503, "server_error", NULL, "ring_unavailable", "ring \"down\"");
    s = kvs_api_error_json(&e);
    assert_string_equal(s, "{\"error\":{\"message\":\"ring \\\"down\\\"\",\"type\":\"server_error\","
                           "\"param\":null,\"code\":\"ring_unavailable\"}}");
    free(s);
}

/* kvs_api_utf8_fix: valid text is untouched, every byte that does not start
 * a valid sequence becomes '?' (cut sequences, stray continuation bytes,
 * overlongs, surrogates, > U+10FFFF, 0xFE/0xFF). */
static void test_utf8_fix(void **state)
{
    (void)state;
    static const struct { const char *in, *out; } cases[] = {
        { "plain ascii", "plain ascii" },
        { "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80" },
        { "cut \xc3", "cut ?" },                 /* a 2-byte sequence cut by a buffer */
        { "cut \xe2\x82", "cut ??" },
        { "cut \xf0\x9f\x98", "cut ???" },
        { "\xff\xfe", "??" },
        { "\x80x", "?x" },                       /* a stray continuation byte */
        { "\xc0\xaf", "??" },                   /* overlong '/' */
        { "\xe0\x80\xaf", "???" },             /* overlong */
        { "\xed\xa0\x80", "???" },             /* surrogate U+D800 */
        { "\xf4\x90\x80\x80", "????" },       /* U+110000 */
        { "\xc3\xa9\xc3", "\xc3\xa9?" },
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char buf[64];
        snprintf(buf, sizeof buf, "%s", cases[i].in);
        kvs_api_utf8_fix(buf);
        if (strcmp(buf, cases[i].out)) fail_msg("case %zu: got '%s', expected '%s'", i, buf, cases[i].out);
    }
    /* An error message cut inside a character still gives JSON (was NULL: a 500). */
    char big[2048];
    size_t n = 0;
    while (n + 2 < sizeof big - 1) { big[n++] = (char)0xC3; big[n++] = (char)0xA9; }
    big[n] = '\0';
    struct kvs_api_error e;
    kvs_api_error_set(&e, 400, "invalid_request_error", NULL, NULL, "%s", big); /* 255 bytes: cut in a character */
    char *js = kvs_api_error_json(&e);
    assert_non_null(js);
    assert_non_null(strstr(js, "\xc3\xa9?\""));
    free(js);
}

static void test_response_json(void **state)
{
    (void)state;
    struct kvs_api_result r = { .id = "cmpl-1", .created = 1700000000, .model = "aidreams260K",
                                .text = ", pixels", .text_len = 8, .finish_reason = "length",
                                .prompt_tokens = 5, .completion_tokens = 3 };
    char *s = kvs_api_response_json(KVS_API_COMPLETION, &r);
    assert_string_equal(s, "{\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1700000000,"
                           "\"model\":\"aidreams260K\",\"choices\":[{\"text\":\", pixels\",\"index\":0,"
                           "\"logprobs\":null,\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":5,"
                           "\"completion_tokens\":3,\"total_tokens\":8}}");
    free(s);
    r.id = "chatcmpl-2";
    r.text = "h\xc3\xa9\n\"";
    r.text_len = 5;
    r.finish_reason = "stop";
    s = kvs_api_response_json(KVS_API_CHAT, &r);
    assert_string_equal(s, "{\"id\":\"chatcmpl-2\",\"object\":\"chat.completion\",\"created\":1700000000,"
                           "\"model\":\"aidreams260K\",\"choices\":[{\"index\":0,\"message\":{\"role\":"
                           "\"assistant\",\"content\":\"h\xc3\xa9\\n\\\"\"},\"logprobs\":null,\"finish_reason\":"
                           "\"stop\"}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,\"total_tokens\":8}}");
    free(s);
    /* text with an embedded NUL is kept (as \u0000) */
    r.text = "a\0b";
    r.text_len = 3;
    s = kvs_api_response_json(KVS_API_COMPLETION, &r);
    assert_non_null(strstr(s, "\"text\":\"a\\u0000b\""));
    free(s);
}

static void test_chunk_json(void **state)
{
    (void)state;
    struct kvs_api_result r = { .id = "c", .created = 7, .model = "m", .text = "Hi", .text_len = 2,
                                .prompt_tokens = 4, .completion_tokens = 2 };
    char *s = kvs_api_chunk_json(KVS_API_COMPLETION, &r, false, false);
    assert_string_equal(s, "{\"id\":\"c\",\"object\":\"text_completion\",\"created\":7,\"model\":\"m\","
                           "\"choices\":[{\"text\":\"Hi\",\"index\":0,\"logprobs\":null,\"finish_reason\":null}]}");
    free(s);
    s = kvs_api_chunk_json(KVS_API_CHAT, &r, true, false);
    assert_string_equal(s, "{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\","
                           "\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},"
                           "\"logprobs\":null,\"finish_reason\":null}]}");
    free(s);
    s = kvs_api_chunk_json(KVS_API_CHAT, &r, false, false);
    assert_string_equal(s, "{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\","
                           "\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"},"
                           "\"logprobs\":null,\"finish_reason\":null}]}");
    free(s);
    r.text = "";
    r.text_len = 0;
    r.finish_reason = "length";
    s = kvs_api_chunk_json(KVS_API_CHAT, &r, false, false);
    assert_string_equal(s, "{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":7,\"model\":\"m\","
                           "\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"length\"}]}");
    free(s);
    s = kvs_api_chunk_json(KVS_API_COMPLETION, &r, false, true);
    assert_string_equal(s, "{\"id\":\"c\",\"object\":\"text_completion\",\"created\":7,\"model\":\"m\","
                           "\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"total_tokens\":6}}");
    free(s);
}

struct stop_case {
    const char *text;
    size_t from;
    const char *stops[3];
    size_t want;
    bool hit;
};

static void test_stop_scan(void **state)
{
    (void)state;
    static const struct stop_case k[] = {
        { "hello world", 0, { "world" }, 6, true },
        { "hello wor", 0, { "world" }, 6, false },   /* "wor" held back */
        { "hello w", 0, { "world" }, 6, false },
        { "hello", 0, { "world" }, 5, false },
        { "abcab", 0, { "abd" }, 3, false },         /* "ab" could still become "abd" */
        { "aXbY", 0, { "bY", "X" }, 1, true },      /* earliest start wins */
        { "aaa", 0, { "aab" }, 1, false },          /* suffix "aa" */
        { "done.\n\nnext", 0, { "\n\n" }, 5, true },
        { "caf\xc3\xa9!", 0, { "\xc3\xa9!" }, 3, true },
        { "caf\xc3", 0, { "\xc3\xa9" }, 3, false },
        { "xyz", 3, { "z" }, 3, false },             /* before from: not searched */
        { "plain", 0, { NULL }, 5, false },
    };
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        size_t ns = 0;
        while (ns < 3 && k[i].stops[ns]) ns++;
        bool hit = !k[i].hit;
        size_t got = kvs_api_stop_scan(k[i].text, strlen(k[i].text), k[i].from, (char *const *)k[i].stops, ns, &hit);
        if (got != k[i].want || hit != k[i].hit)
            fail_msg("case %zu '%s': got %zu hit %d, want %zu hit %d", i, k[i].text, got, hit, k[i].want, k[i].hit);
    }
}

static void test_metrics_render(void **state)
{
    (void)state;
    struct kvs_api_metrics m;
    kvs_api_metrics_init(&m);
    /* request buckets 0.01, 0.025, 0.05, 0.1, ...: 0.02 -> le 0.025, 0.1 -> le 0.1 (inclusive), 500 -> +Inf */
    kvs_api_hist_add(&m.request_seconds, 0.02);
    kvs_api_hist_add(&m.request_seconds, 0.1);
    kvs_api_hist_add(&m.request_seconds, 500);
    m.requests[KVS_API_STATUS_OK] = 3;
    m.requests[KVS_API_STATUS_CANCELLED] = 1;
    m.tokens_generated = 120;
    m.prompt_tokens = 26;
    struct kvs_stage_metrics st = { 0 };
    st.ring_ready = true;
    st.n_active = 2;
    st.forward_ms = 1500;
    st.bytes_in = 1000;
    st.bytes_out = 2000;
    struct kvs_api_buf b = { .limit = 1 << 20 };
    assert_true(kvs_api_metrics_render(&m, &st, 0, &b));
    const char *want[] = {
        "kvasir_requests_total{status=\"ok\"} 3\n",
        "kvasir_requests_total{status=\"cancelled\"} 1\n",
        "kvasir_requests_total{status=\"error\"} 0\n",
        "kvasir_tokens_generated_total 120\n",
        "kvasir_prompt_tokens_total 26\n",
        "# TYPE kvasir_request_seconds histogram\n",
        "kvasir_request_seconds_bucket{le=\"0.01\"} 0\n",
        "kvasir_request_seconds_bucket{le=\"0.025\"} 1\n",
        "kvasir_request_seconds_bucket{le=\"0.05\"} 1\n",
        "kvasir_request_seconds_bucket{le=\"0.1\"} 2\n",
        "kvasir_request_seconds_bucket{le=\"120\"} 2\n",
        "kvasir_request_seconds_bucket{le=\"+Inf\"} 3\n",
        "kvasir_request_seconds_sum 500.12\n",
        "kvasir_request_seconds_count 3\n",
        "kvasir_token_roundtrip_seconds_bucket{le=\"+Inf\"} 0\n",
        "kvasir_token_roundtrip_seconds_count 0\n",
        "kvasir_active_sequences 2\n",
        "kvasir_ring_ready 1\n",
        "kvasir_forward_seconds_total{stage=\"0\"} 1.500000\n",
        "kvasir_link_bytes_total{dir=\"in\"} 1000\n",
        "kvasir_link_bytes_total{dir=\"out\"} 2000\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(b.p, want[i])) fail_msg("missing line: %s\n--- got:\n%s", want[i], b.p);
    /* every sample line is "name{labels} value" or a # comment */
    for (const char *l = b.p; *l; l = strchr(l, '\n') + 1) {
        assert_true(*l == '#' || !strncmp(l, "kvasir_", 7));
        assert_non_null(strchr(l, '\n'));
    }
    kvs_api_buf_free(&b);
    kvs_api_metrics_destroy(&m);
}

static void test_buf_limit(void **state)
{
    (void)state;
    struct kvs_api_buf b = { .limit = 10 };
    assert_true(kvs_api_buf_add(&b, "0123456789", 10));
    assert_false(kvs_api_buf_add(&b, "x", 1));
    assert_int_equal(b.len, 10);
    assert_string_equal(b.p, "0123456789");
    kvs_api_buf_free(&b);
}

/* kvs_api_buf_printf once failed on any text of 512 bytes or more (a fixed
 * stack buffer): /metrics would break as soon as a block of series grew. */
static void test_buf_printf_long(void **state)
{
    (void)state;
    char word[700];
    memset(word, 'a', sizeof word - 1);
    word[sizeof word - 1] = 0;
    struct kvs_api_buf b = { .limit = 2000 };
    assert_true(kvs_api_buf_printf(&b, "<%s>", word));
    assert_int_equal(b.len, 701);
    assert_int_equal(b.p[0], '<');
    assert_int_equal(b.p[700], '>');
    assert_int_equal(b.p[701], 0);
    assert_true(kvs_api_buf_printf(&b, "%s", word));
    assert_false(kvs_api_buf_printf(&b, "%s", word)); /* would pass the limit */
    assert_int_equal(b.len, 701 + 699);
    kvs_api_buf_free(&b);
}


/* Ring-wide series from a probe trail: two stages, values chosen by hand. */
static void test_metrics_render_ring(void **state)
{
    (void)state;
    struct kvs_stage_hop hops[2] = {
        { .block_begin = 0, .block_end = 2, .forward_calls = 5, .forward_ms = 1500.0, .rows = 12,
          .bytes_out = 4096, .hop_ms = 0.25 },
        { .block_begin = 2, .block_end = 4, .forward_calls = 5, .forward_ms = 250.0, .rows = 12,
          .bytes_out = 64, .hop_ms = 0.5 },
    };
    struct kvs_api_buf b = { .limit = 1u << 16 };
    assert_true(kvs_api_metrics_render_ring(hops, 0, 1.0, &b));
    assert_int_equal(b.len, 0);
    assert_true(kvs_api_metrics_render_ring(hops, 2, 0.75, &b));
    const char *want[] = {
        "kvasir_ring_stage_forward_seconds_total{rank=\"0\",window=\"0:2\"} 1.500000\n",
        "kvasir_ring_stage_forward_seconds_total{rank=\"1\",window=\"2:4\"} 0.250000\n",
        "kvasir_ring_stage_forward_calls_total{rank=\"1\",window=\"2:4\"} 5\n",
        "kvasir_ring_stage_rows_total{rank=\"0\",window=\"0:2\"} 12\n",
        "kvasir_ring_stage_bytes_out_total{rank=\"0\",window=\"0:2\"} 4096\n",
        "kvasir_ring_hop_latency_seconds{from=\"0\",to=\"1\"} 0.000250\n",
        "kvasir_ring_hop_latency_seconds{from=\"1\",to=\"0\"} 0.000500\n",
        "kvasir_ring_probe_rtt_seconds 0.000750\n",
        "# TYPE kvasir_ring_hop_latency_seconds gauge\n",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        if (!strstr(b.p, want[i])) fail_msg("missing: %s\nin:\n%s", want[i], b.p);
    }
    kvs_api_buf_free(&b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_requests),   cmocka_unit_test(test_null_body),
        cmocka_unit_test(test_completion_defaults), cmocka_unit_test(test_completion_fields),
        cmocka_unit_test(test_chat_fields),    cmocka_unit_test(test_error_json), cmocka_unit_test(test_utf8_fix),
        cmocka_unit_test(test_response_json),  cmocka_unit_test(test_chunk_json),
        cmocka_unit_test(test_stop_scan),      cmocka_unit_test(test_metrics_render),
        cmocka_unit_test(test_buf_limit),   cmocka_unit_test(test_buf_printf_long),   cmocka_unit_test(test_metrics_render_ring),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The HTTP layer over a real socket, on a head stage whose ring never
 * closes (its loop is not run): routes, status codes, exact bodies of
 * /v1/models and /health, 503 for generation, 400/404/405/413 before it,
 * and the counters /metrics shows for them. Uses
 * ../shared/models/aidreams260K.gguf (KVASIR_SHARED). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "api/api.h"
#include "stage/stage.h"

struct fixture {
    struct kvs_stage *head;
    struct kvs_api *api;
    uint16_t port;
};

struct reply {
    int status;
    char *all;        /* whole response, NUL-terminated */
    const char *body; /* into all */
};

/* One request over a fresh connection ("Connection: close"); reads to EOF. */
static void http(uint16_t port, const char *method, const char *path, const char *body, size_t body_len,
                 struct reply *r)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = { .tv_sec = 10 };
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    char head[512];
    int hn = snprintf(head, sizeof head,
                      "%s %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\n\r\n",
                      method, path, body_len);
    assert_true(hn > 0 && (size_t)hn < sizeof head);
    assert_int_equal(send(fd, head, (size_t)hn, MSG_NOSIGNAL), hn);
    size_t off = 0;
    while (off < body_len) {
        ssize_t w = send(fd, body + off, body_len - off, MSG_NOSIGNAL);
        if (w <= 0) break; /* the server may answer (413) and stop reading */
        off += (size_t)w;
    }
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 1 == cap) buf = realloc(buf, cap *= 2);
        ssize_t n = recv(fd, buf + len, cap - len - 1, 0);
        if (n <= 0) break;
        len += (size_t)n;
    }
    buf[len] = 0;
    close(fd);
    r->all = buf;
    r->status = 0;
    sscanf(buf, "HTTP/1.%*d %d", &r->status);
    const char *b = strstr(buf, "\r\n\r\n");
    r->body = b ? b + 4 : buf + len;
}

static int setup(void **state)
{
    const char *shared = getenv("KVASIR_SHARED");
    if (!shared) shared = "../shared";
    static char model[4096];
    snprintf(model, sizeof model, "%s/models/aidreams260K.gguf", shared);
    struct fixture *f = calloc(1, sizeof *f);
    struct kvs_stage_params p = kvs_stage_default_params();
    p.model_path = model;
    p.block_begin = 0;
    p.block_end = 2;
    p.listen = "127.0.0.1:0";
    p.next = "127.0.0.1:1"; /* never dialled: the loop does not run */
    p.insecure = true;
    char err[256];
    kvs_err e = kvs_stage_create(&p, &f->head, err, sizeof err);
    if (e) {
        fprintf(stderr, "stage: %s (%s)\n", kvs_strerror(e), err);
        free(f);
        return -1;
    }
    struct kvs_api_params ap = kvs_api_default_params();
    ap.model_path = model;
    ap.max_body = 4096;
    e = kvs_api_start(f->head, &ap, &f->api, err, sizeof err);
    if (e) {
        fprintf(stderr, "api: %s (%s)\n", kvs_strerror(e), err);
        kvs_stage_free(f->head);
        free(f);
        return -1;
    }
    f->port = kvs_api_port(f->api);
    *state = f;
    return 0;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    kvs_api_stop(f->api);
    kvs_stage_free(f->head);
    free(f);
    return 0;
}

static void test_start_args(void **state)
{
    struct fixture *f = *state;
    struct kvs_api *a = NULL;
    char err[128];
    struct kvs_api_params ap = kvs_api_default_params();
    assert_int_equal(kvs_api_start(NULL, &ap, &a, err, sizeof err), KVS_ERR_ARG);
    ap.bind_addr = "not-an-address";
    assert_int_equal(kvs_api_start(f->head, &ap, &a, err, sizeof err), KVS_ERR_ARG);
    ap = kvs_api_default_params();
    ap.chat_template = "vicuna"; /* not a family this API renders */
    assert_int_equal(kvs_api_start(f->head, &ap, &a, err, sizeof err), KVS_ERR_ARG);
    assert_non_null(strstr(err, "unknown chat template 'vicuna'"));
    ap = kvs_api_default_params();
    ap.port = f->port; /* taken */
    assert_int_equal(kvs_api_start(f->head, &ap, &a, err, sizeof err), KVS_ERR_NET);
    assert_null(a);
    kvs_api_stop(NULL);
}

static void test_routes(void **state)
{
    struct fixture *f = *state;
    struct reply r;

    http(f->port, "GET", "/v1/models", "", 0, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.all, "Content-Type: application/json"));
    assert_string_equal(r.body, "{\"object\":\"list\",\"data\":[{\"id\":\"aidreams260K\",\"object\":\"model\","
                                "\"created\":0,\"owned_by\":\"kvasir\"}]}");
    free(r.all);

    http(f->port, "GET", "/health", "", 0, &r);
    assert_int_equal(r.status, 503);
    assert_string_equal(r.body, "{\"status\":\"unavailable\",\"in_link\":false,\"out_link\":false,"
                                "\"reason\":\"the ring is not whole\"}");
    free(r.all);

    http(f->port, "GET", "/v1/nothing", "", 0, &r);
    assert_int_equal(r.status, 404);
    assert_string_equal(r.body, "{\"error\":{\"message\":\"unknown route GET /v1/nothing\",\"type\":"
                                "\"invalid_request_error\",\"param\":null,\"code\":\"unknown_url\"}}");
    free(r.all);

    http(f->port, "GET", "/v1/completions", "", 0, &r);
    assert_int_equal(r.status, 405);
    assert_non_null(strstr(r.all, "Allow: POST"));
    free(r.all);

    http(f->port, "DELETE", "/health", "", 0, &r);
    assert_int_equal(r.status, 405);
    free(r.all);

    /* validation comes before the ring check */
    const char *bad = "{\"prompt\":\"a\",\"max_tokens\":-1}";
    http(f->port, "POST", "/v1/completions", bad, strlen(bad), &r);
    assert_int_equal(r.status, 400);
    assert_string_equal(r.body, "{\"error\":{\"message\":\"'max_tokens' must be between 1 and 1000000\",\"type\":"
                                "\"invalid_request_error\",\"param\":\"max_tokens\",\"code\":null}}");
    free(r.all);

    http(f->port, "POST", "/v1/completions", "{", 1, &r);
    assert_int_equal(r.status, 400);
    assert_non_null(strstr(r.body, "\"code\":\"invalid_json\""));
    free(r.all);

    const char *chat = "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}";
    http(f->port, "POST", "/v1/chat/completions", chat, strlen(chat), &r);
    assert_int_equal(r.status, 503); /* no chat template in aidreams260K: ChatML, then the ring check */
    assert_non_null(strstr(r.body, "\"code\":\"ring_unavailable\""));
    free(r.all);

    const char *ok = "{\"prompt\":\"Once upon a time\"}";
    http(f->port, "POST", "/v1/completions", ok, strlen(ok), &r);
    assert_int_equal(r.status, 503);
    assert_non_null(strstr(r.body, "\"type\":\"server_error\""));
    assert_non_null(strstr(r.body, "\"code\":\"ring_unavailable\""));
    free(r.all);

    /* max_body is 4096: 5000 bytes are drained then refused, 100000 refused at once */
    for (size_t n = 5000; n <= 100000; n += 95000) {
        char *big = malloc(n);
        memset(big, ' ', n);
        http(f->port, "POST", "/v1/completions", big, n, &r);
        free(big);
        assert_int_equal(r.status, 413);
        assert_string_equal(r.body, "{\"error\":{\"message\":\"request body exceeds 4096 bytes\",\"type\":"
                                    "\"invalid_request_error\",\"param\":null,\"code\":\"request_too_large\"}}");
        free(r.all);
    }

    http(f->port, "GET", "/metrics", "", 0, &r);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr(r.all, "Content-Type: text/plain; version=0.0.4"));
    /* 400 x2 (max_tokens, bad JSON) + 413 x2 = 4 invalid; 2 unavailable (the chat, a completion) */
    assert_non_null(strstr(r.body, "\nkvasir_requests_total{status=\"invalid\"} 4\n"));
    assert_non_null(strstr(r.body, "\nkvasir_requests_total{status=\"unavailable\"} 2\n"));
    assert_non_null(strstr(r.body, "\nkvasir_requests_total{status=\"ok\"} 0\n"));
    assert_non_null(strstr(r.body, "\nkvasir_ring_ready 0\n"));
    assert_non_null(strstr(r.body, "\nkvasir_prompt_tokens_total 0\n"));
    free(r.all);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_start_args),
        cmocka_unit_test(test_routes),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

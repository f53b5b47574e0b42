/* The ledger: receipts signed by a ring's head, checked against the claims,
 * credited tokens x blocks once (docs/MARKET.md "Ledger"). A table of bad
 * receipts: each refused with its code, none changes the ledger. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>

#include "market/market.h"
#include "plan/plan.h"
#include "trust/trust.h"

#define T0 1700000000000ll
#define CID "657c6b273193a9fceb570071aaf7a161cf0d258f62cb9b13cf151dcd8c5c112f"

static struct kvs_market *open_db(const char *path)
{
    struct kvs_market_params p = kvs_market_default_params();
    p.db_path = path;
    p.lease_ms = 60000;
    p.max_body = 65536;
    struct kvs_market *m = NULL;
    char err[256];
    assert_int_equal(kvs_market_open(&p, &m, err, sizeof err), KVS_OK);
    return m;
}

static struct kvs_market *open_toy(const char *path)
{
    struct kvs_market *m = open_db(path);
    char err[256];
    const char *names[] = { "toy", "other" };
    for (int i = 0; i < 2; i++) {
        struct kvs_plan_model *pm = calloc(1, sizeof *pm);
        pm->n_block = 4;
        for (int b = 0; b < 4; b++) pm->block_weight_bytes[b] = pm->block_stream_bytes[b] = 1000;
        pm->n_embd = pm->n_vocab = 1;
        pm->ctx_train = 64;
        snprintf(pm->fingerprint, sizeof pm->fingerprint, "%064d", 7);
        if (i == 0) snprintf(pm->content_id, sizeof pm->content_id, "%s", CID);
        struct kvs_market_listing_req q = { .rings = 1, .seqs = 1 };
        snprintf(q.name, sizeof q.name, "%s", names[i]);
        snprintf(q.url, sizeof q.url, "http://127.0.0.1:1/%s.gguf", names[i]);
        assert_int_equal(kvs_market_add_listing(m, &q, pm, err, sizeof err), KVS_OK);
        free(pm);
    }
    return m;
}

static int req(struct kvs_market *m, const char *method, const char *path, const char *body, char **out)
{
    struct kvs_market_reply r;
    assert_int_equal(kvs_market_handle(m, method, path, body, body ? strlen(body) : 0, T0 + 1000, &r), KVS_OK);
    assert_non_null(r.body);
    if (out) *out = r.body;
    else free(r.body);
    return r.status;
}

static int64_t claim(struct kvs_market *m, const char *model, const char *node, int b, int e, const struct kvs_key *k)
{
    char body[512], hex[KVS_KEY_PUB_HEX + 1] = "", *out;
    if (k) {
        uint8_t pub[32];
        kvs_key_public(k, pub);
        kvs_key_public_hex(pub, hex);
    }
    snprintf(body, sizeof body,
             "{\"model\":\"%s\",\"begin\":%d,\"end\":%d,\"node\":\"%s\",\"endpoint\":\"127.0.0.1:%d\",\"pubkey\":\"%s\"}",
             model, b, e, node, 7000 + b, hex);
    assert_int_equal(req(m, "POST", "/v1/claims", body, &out), 201);
    json_t *j = json_loads(out, 0, NULL);
    free(out);
    int64_t id = json_integer_value(json_object_get(j, "id"));
    json_decref(j);
    return id;
}

static char *ledger(struct kvs_market *m)
{
    char *out;
    assert_int_equal(req(m, "GET", "/ledger", NULL, &out), 200);
    return out;
}

/* status and error code of POST /v1/receipts */
static int post(struct kvs_market *m, const char *body, char code[64])
{
    char *out;
    int st = req(m, "POST", "/v1/receipts", body, &out);
    json_t *j = json_loads(out, 0, NULL);
    const char *c = json_string_value(json_object_get(json_object_get(j, "error"), "code"));
    snprintf(code, 64, "%s", c ? c : (json_is_true(json_object_get(j, "duplicate")) ? "duplicate" : ""));
    json_decref(j);
    free(out);
    return st;
}

__attribute__((noinline)) static char *sign(const struct kvs_market_receipt *r, const struct kvs_key *k)
{
    char *body = NULL;
    assert_int_equal(kvs_market_receipt_sign(r, k, &body), KVS_OK);
    return body;
}

static void test_ledger(void **state)
{
    (void)state;
    struct kvs_key *head, *mid, *tail, *stranger;
    assert_int_equal(kvs_key_generate(&head), KVS_OK);
    assert_int_equal(kvs_key_generate(&mid), KVS_OK);
    assert_int_equal(kvs_key_generate(&tail), KVS_OK);
    assert_int_equal(kvs_key_generate(&stranger), KVS_OK);
    char path[] = "/tmp/kvs-test-ledger-XXXXXX"; /* a file: the ledger must survive a restart */
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    struct kvs_market *m = open_toy(path);
    int64_t c0 = claim(m, "toy", "a", 0, 1, head), c1 = claim(m, "toy", "b", 1, 3, mid), c2 = claim(m, "toy", "c", 3, 4, tail);
    int64_t o0 = claim(m, "other", "d", 0, 4, stranger);
    char *empty = ledger(m);

    struct kvs_market_receipt good = { .ring = 0, .seq = 1, .tokens = 100, .n_ranks = 3 };
    snprintf(good.model, sizeof good.model, "toy");
    snprintf(good.content_id, sizeof good.content_id, "%s", CID);
    kvs_key_public(head, good.head);
    good.ranks[0] = (struct kvs_market_receipt_rank){ c0, 0, 1 };
    good.ranks[1] = (struct kvs_market_receipt_rank){ c1, 1, 3 };
    good.ranks[2] = (struct kvs_market_receipt_rank){ c2, 3, 4 };

    /* the table: each refused, the ledger unchanged */
    struct kvs_market_receipt r;
    char *body, code[64];
    struct {
        const char *what;
        int status;
        const char *code;
    } want[] = {
        { "bad signature", 400, "bad_signature" },       { "signed by a stranger", 403, "unknown_head" },
        { "a rank not holding its claim", 422, "not_held" }, { "a claim of another model", 422, "not_held" },
        { "wrong model", 422, "wrong_model" },           { "wrong content id", 422, "wrong_model" },
        { "windows with a gap", 422, "bad_ranks" },      { "windows short of n_block", 422, "bad_ranks" },
        { "oversized token count", 400, "bad_request" }, { "zero tokens", 400, "bad_request" },
        { "ring out of range", 422, "wrong_model" },
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        r = good;
        const struct kvs_key *k = head;
        switch (i) {
        case 1: kvs_key_public(stranger, r.head); k = stranger; break;
        case 2: r.ranks[1].claim = c2; break;                            /* c2 holds [3,4), not [1,3) */
        case 3: r.ranks[2] = (struct kvs_market_receipt_rank){ o0, 3, 4 }; break;
        case 4: snprintf(r.model, sizeof r.model, "nope"); break;
        case 5: r.content_id[0] = r.content_id[0] == '0' ? '1' : '0'; break;
        case 6: r.ranks[1].begin = 2; break;
        case 7: r.n_ranks = 2; break;
        case 8: r.tokens = KVS_MARKET_MAX_RECEIPT_TOKENS + 1; break;
        case 9: r.tokens = 0; break;
        case 10: r.ring = 1; break;
        }
        char *rb = sign(&r, k);
        if (i == 0) { /* one digit of the signature flipped */
            char *sg = strstr(rb, "\"sig\":\"");
            assert_non_null(sg);
            sg[7] = sg[7] == '0' ? '1' : '0';
        }
        int st = post(m, rb, code);
        if (st != want[i].status || strcmp(code, want[i].code))
            fail_msg("%s: %d %s, expected %d %s", want[i].what, st, code, want[i].status, want[i].code);
        free(rb);
        char *l = ledger(m);
        assert_string_equal(l, empty);
        free(l);
    }
    /* garbage bodies */
    const char *junk[] = { "", "{}", "{\"receipt\":\"{}\",\"sig\":\"00\"}", "[1]", "{\"receipt\":5,\"sig\":\"\"}" };
    for (size_t i = 0; i < sizeof junk / sizeof junk[0]; i++) {
        assert_int_equal(post(m, junk[i], code), 400);
    }

    /* the good one: 100 tokens x blocks to each window's node */
    body = sign(&good, head);
    assert_int_equal(post(m, body, code), 201);
    char *l = ledger(m);
    json_t *j = json_loads(l, 0, NULL);
    assert_int_equal(json_integer_value(json_object_get(j, "receipts")), 1);
    json_t *nodes = json_object_get(j, "nodes");
    assert_int_equal(json_array_size(nodes), 3);
    /* ordered by credit: b held 2 blocks */
    const char *node_want[] = { "b", "a", "c" };
    const long credit_want[] = { 200, 100, 100 };
    for (size_t i = 0; i < 3; i++) {
        json_t *n = json_array_get(nodes, i);
        assert_string_equal(json_string_value(json_object_get(n, "node")), node_want[i]);
        assert_int_equal(json_integer_value(json_object_get(n, "credit")), credit_want[i]);
        assert_int_equal(json_integer_value(json_object_get(n, "tokens")), 100);
    }
    json_decref(j);
    /* idempotent: the same receipt again credits nothing */
    assert_int_equal(post(m, body, code), 200);
    assert_string_equal(code, "duplicate");
    char *l2 = ledger(m);
    assert_string_equal(l2, l);
    free(l2);
    /* replay: another receipt under a used seq */
    r = good;
    r.tokens = 5000;
    char *b2 = sign(&r, head);
    assert_int_equal(post(m, b2, code), 409);
    assert_string_equal(code, "replay");
    free(b2);
    l2 = ledger(m);
    assert_string_equal(l2, l);
    free(l2);
    /* the next seq is credited on top */
    r = good;
    r.seq = 2;
    r.tokens = 7;
    b2 = sign(&r, head);
    assert_int_equal(post(m, b2, code), 201);
    free(b2);
    l2 = ledger(m);
    j = json_loads(l2, 0, NULL);
    assert_int_equal(json_integer_value(json_object_get(j, "receipts")), 2);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(json_object_get(j, "nodes"), 0), "credit")), 214);
    json_decref(j);
    /* a restart: the market reopened from its SQLite file shows the same ledger, and the counted
     * receipt is still counted (a duplicate, nothing credited) */
    kvs_market_close(m);
    m = open_db(path);
    char *l3 = ledger(m);
    assert_string_equal(l3, l2);
    free(l3);
    assert_int_equal(post(m, body, code), 200);
    assert_string_equal(code, "duplicate");
    l3 = ledger(m);
    assert_string_equal(l3, l2);
    free(l3);
    free(l2);
    free(l);
    free(body);
    free(empty);
    /* signing with a key that is not the receipt's head is refused before anything is sent */
    char *none = NULL;
    assert_int_equal(kvs_market_receipt_sign(&good, mid, &none), KVS_ERR_ARG);
    assert_null(none);
    kvs_market_close(m);
    unlink(path);
    kvs_key_free(head);
    kvs_key_free(mid);
    kvs_key_free(tail);
    kvs_key_free(stranger);
}

int main(void)
{
    const struct CMUnitTest tests[] = { cmocka_unit_test(test_ledger) };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The ledger: receipts signed by a ring's head (Ed25519 node key), checked
 * against the claims that held the ring's windows, credited tokens x blocks
 * to each window's node once per (head, seq). docs/MARKET.md "Ledger". */
#include <inttypes.h>
#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hex.h"
#include "market/market_impl.h"
#include "plan/plan.h"
#include "trust/trust.h"

#define RECEIPT_TAG "kvasir-receipt-v1\n"
#define MAX_SEQ (1ull << 53) /* a JSON integer every reader keeps exactly */

static kvs_err lfail(kvs_err e, char *errbuf, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static kvs_err lfail(kvs_err e, char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (errbuf && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(errbuf, errlen, fmt, ap);
        va_end(ap);
    }
    return e;
}

static void hex_of(const uint8_t *b, size_t n, char *out)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = '\0';
}

static bool unhex(const char *s, size_t len, uint8_t *out, size_t n)
{
    if (!s || len != 2 * n) return false;
    for (size_t i = 0; i < n; i++) {
        int hi = kvs_hex_value(s[2 * i]), lo = kvs_hex_value(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return true;
}

static kvs_err signed_bytes(const char *payload, size_t n, uint8_t **out, size_t *len)
{
    size_t t = strlen(RECEIPT_TAG);
    *out = malloc(t + n + 1);
    if (!*out) return KVS_ERR_NOMEM;
    memcpy(*out, RECEIPT_TAG, t);
    memcpy(*out + t, payload, n);
    *len = t + n;
    return KVS_OK;
}

kvs_err kvs_market_receipt_sign(const struct kvs_market_receipt *r, const struct kvs_key *k, char **body)
{
    *body = NULL;
    uint8_t pub[KVS_KEY_PUB_BYTES];
    kvs_key_public(k, pub);
    if (memcmp(pub, r->head, 32)) return KVS_ERR_ARG;
    char head[65];
    hex_of(r->head, 32, head);
    json_t *ranks = json_array();
    for (size_t i = 0; ranks && i < r->n_ranks; i++)
        json_array_append_new(ranks, json_pack("{sI sI sI}", "claim", (json_int_t)r->ranks[i].claim, "begin",
                                               (json_int_t)r->ranks[i].begin, "end", (json_int_t)r->ranks[i].end));
    json_t *p = json_pack("{sI ss ss sI sI sI ss so}", "v", (json_int_t)1, "model", r->model, "content_id",
                          r->content_id, "ring", (json_int_t)r->ring, "seq", (json_int_t)r->seq, "tokens",
                          (json_int_t)r->tokens, "head", head, "ranks", ranks);
    char *payload = p ? json_dumps(p, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(p);
    if (!payload) return KVS_ERR_NOMEM;
    uint8_t *msg = NULL, sig[KVS_KEY_SIG_BYTES];
    size_t mlen = 0;
    kvs_err e = signed_bytes(payload, strlen(payload), &msg, &mlen);
    if (!e) e = kvs_key_sign(k, msg, mlen, sig);
    free(msg);
    if (!e) {
        char sh[2 * KVS_KEY_SIG_BYTES + 1];
        hex_of(sig, KVS_KEY_SIG_BYTES, sh);
        json_t *o = json_pack("{ss ss}", "receipt", payload, "sig", sh);
        *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
        if (!*body) e = KVS_ERR_NOMEM;
    }
    free(payload);
    return e;
}

static bool get_int(json_t *o, const char *key, uint64_t lo, uint64_t hi, uint64_t *v)
{
    json_t *x = json_object_get(o, key);
    if (!json_is_integer(x) || json_integer_value(x) < 0) return false;
    uint64_t u = (uint64_t)json_integer_value(x);
    if (u < lo || u > hi) return false;
    *v = u;
    return true;
}

kvs_err kvs_market_receipt_parse(const char *text, size_t len, struct kvs_market_receipt *r, uint8_t digest[32],
                                 char *errbuf, size_t errlen)
{
    memset(r, 0, sizeof *r);
    json_error_t je;
    json_t *o = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je), *p = NULL;
    kvs_err e = KVS_ERR_FORMAT;
    const char *payload = json_string_value(json_object_get(o, "receipt"));
    const char *sigh = json_string_value(json_object_get(o, "sig"));
    uint8_t sig[KVS_KEY_SIG_BYTES];
    if (!json_is_object(o) || !payload || !sigh) {
        e = lfail(e, errbuf, errlen, "a receipt is {\"receipt\": \"<payload JSON>\", \"sig\": \"<hex>\"}");
        goto out;
    }
    size_t plen = json_string_length(json_object_get(o, "receipt"));
    if (!unhex(sigh, strlen(sigh), sig, sizeof sig)) {
        e = lfail(e, errbuf, errlen, "field 'sig' must be %d hex digits", 2 * KVS_KEY_SIG_BYTES);
        goto out;
    }
    p = json_loadb(payload, plen, JSON_REJECT_DUPLICATES, &je);
    const char *model = json_string_value(json_object_get(p, "model"));
    const char *cid = json_string_value(json_object_get(p, "content_id"));
    const char *head = json_string_value(json_object_get(p, "head"));
    json_t *ranks = json_object_get(p, "ranks");
    uint64_t v = 0, ring = 0;
    if (!json_is_object(p) || !get_int(p, "v", 1, 1, &v) || !model || strlen(model) >= sizeof r->model ||
        !kvs_market_valid_name(model) || !cid || (cid[0] && strlen(cid) != 64) || !head ||
        !unhex(head, strlen(head), r->head, 32) || !get_int(p, "ring", 0, KVS_MARKET_MAX_RINGS - 1, &ring) ||
        !json_is_array(ranks)) {
        e = lfail(e, errbuf, errlen, "receipt payload: v 1, model, content_id, head (64 hex), ring and ranks are needed");
        goto out;
    }
    snprintf(r->model, sizeof r->model, "%s", model);
    snprintf(r->content_id, sizeof r->content_id, "%s", cid);
    r->ring = (uint32_t)ring;
    if (!get_int(p, "seq", 1, MAX_SEQ, &r->seq)) {
        e = lfail(KVS_ERR_RANGE, errbuf, errlen, "receipt: 'seq' must be 1..2^53");
        goto out;
    }
    if (!get_int(p, "tokens", 1, KVS_MARKET_MAX_RECEIPT_TOKENS, &r->tokens)) {
        e = lfail(KVS_ERR_RANGE, errbuf, errlen, "receipt: 'tokens' must be 1..%u", KVS_MARKET_MAX_RECEIPT_TOKENS);
        goto out;
    }
    size_t n = json_array_size(ranks);
    if (n < 1 || n > KVS_MARKET_MAX_RECEIPT_RANKS) {
        e = lfail(KVS_ERR_RANGE, errbuf, errlen, "receipt: 1..%d ranks", KVS_MARKET_MAX_RECEIPT_RANKS);
        goto out;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *k = json_array_get(ranks, i);
        uint64_t id, b, en;
        if (!get_int(k, "claim", 1, MAX_SEQ, &id) || !get_int(k, "begin", 0, KVS_PLAN_MAX_BLOCKS, &b) ||
            !get_int(k, "end", 1, KVS_PLAN_MAX_BLOCKS, &en) || b >= en) {
            e = lfail(e, errbuf, errlen, "receipt: ranks[%zu] needs claim >= 1 and begin < end", i);
            goto out;
        }
        r->ranks[i] = (struct kvs_market_receipt_rank){ (int64_t)id, (uint32_t)b, (uint32_t)en };
    }
    r->n_ranks = n;
    uint8_t *msg = NULL;
    size_t mlen = 0;
    if ((e = signed_bytes(payload, plen, &msg, &mlen))) goto out;
    bool ok = kvs_key_verify(r->head, msg, mlen, sig);
    free(msg);
    if (!ok) {
        e = lfail(KVS_ERR_FORMAT, errbuf, errlen, "receipt: the signature is not the head key's");
        goto out;
    }
    unsigned int dl = 0;
    e = EVP_Digest(payload, plen, digest, &dl, EVP_sha256(), NULL) && dl == 32 ? KVS_OK : KVS_ERR_INTERNAL;
out:
    json_decref(p);
    json_decref(o);
    return e;
}

/* --- the market's side ---------------------------------------------------------- */

/* A claim as the ledger needs it; false if no live claim has that id. */
struct lclaim {
    char model[KVS_MARKET_NAME_MAX], node[KVS_MARKET_NAME_MAX], pubkey[KVS_MARKET_KEY_MAX];
    uint32_t ring, begin, end;
};
static bool live_claim(struct kvs_market *m, int64_t id, int64_t now, struct lclaim *c)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT model, node, pubkey, ring, b, e FROM claims WHERE id=? AND expires_ms > ?",
                           -1, &st, NULL) != SQLITE_OK)
        return false;
    sqlite3_bind_int64(st, 1, id);
    sqlite3_bind_int64(st, 2, now);
    bool ok = sqlite3_step(st) == SQLITE_ROW;
    if (ok) {
        snprintf(c->model, sizeof c->model, "%s", (const char *)sqlite3_column_text(st, 0));
        snprintf(c->node, sizeof c->node, "%s", (const char *)sqlite3_column_text(st, 1));
        snprintf(c->pubkey, sizeof c->pubkey, "%s", (const char *)sqlite3_column_text(st, 2));
        c->ring = (uint32_t)sqlite3_column_int(st, 3);
        c->begin = (uint32_t)sqlite3_column_int(st, 4);
        c->end = (uint32_t)sqlite3_column_int(st, 5);
    }
    sqlite3_finalize(st);
    return ok;
}

/* The listing's block count, rings and content id; false if not listed. */
static bool listing_of(struct kvs_market *m, const char *name, uint32_t *n_block, uint32_t *rings, char cid[65])
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT n_block, rings, profile FROM listings WHERE name=?", -1, &st, NULL) !=
        SQLITE_OK)
        return false;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    bool ok = sqlite3_step(st) == SQLITE_ROW;
    cid[0] = '\0';
    if (ok) {
        *n_block = (uint32_t)sqlite3_column_int(st, 0);
        *rings = (uint32_t)sqlite3_column_int(st, 1);
        json_error_t je;
        json_t *pr = json_loads((const char *)sqlite3_column_text(st, 2), 0, &je);
        const char *c = json_string_value(json_object_get(pr, "content_id"));
        snprintf(cid, 65, "%s", c ? c : "");
        json_decref(pr);
    }
    sqlite3_finalize(st);
    return ok;
}

/* 1: (head, seq) recorded with the same digest; -1: with another; 0: new; -2: error. */
static int seen(struct kvs_market *m, const char *head, uint64_t seq, const char *dhex)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT digest FROM receipts WHERE head=? AND seq=?", -1, &st, NULL) != SQLITE_OK)
        return -2;
    sqlite3_bind_text(st, 1, head, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, (sqlite3_int64)seq);
    int rc = sqlite3_step(st), r = 0;
    if (rc == SQLITE_ROW) r = strcmp((const char *)sqlite3_column_text(st, 0), dhex) ? -1 : 1;
    else if (rc != SQLITE_DONE) r = -2;
    sqlite3_finalize(st);
    return r;
}

static bool exec_bind(struct kvs_market *m, const char *sql, const char *a, const char *b, int64_t x, int64_t y,
                      int64_t z)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, sql, -1, &st, NULL) != SQLITE_OK) return false;
    sqlite3_bind_text(st, 1, a, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, b, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 3, x);
    sqlite3_bind_int64(st, 4, y);
    sqlite3_bind_int64(st, 5, z);
    bool ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    return ok;
}

kvs_err kvs_market__handle_receipt(struct kvs_market *m, const char *body, size_t len, int64_t now,
                                   struct kvs_market_reply *rep)
{
    struct kvs_market_receipt *r = malloc(sizeof *r);
    if (!r) return KVS_ERR_NOMEM;
    uint8_t digest[32];
    char err[512], dhex[65], head[65];
    kvs_err e = kvs_market_receipt_parse(body, len, r, digest, err, sizeof err);
    if (e) {
        free(r);
        return kvs_market__reply_error(rep, 400, strstr(err, "signature") ? "bad_signature" : "bad_request", "%s", err);
    }
    hex_of(digest, 32, dhex);
    hex_of(r->head, 32, head);
    pthread_mutex_lock(&m->mu);
    if (!kvs_market__begin(m) || !kvs_market__purge(m, now)) {
        kvs_market__rollback(m);
        pthread_mutex_unlock(&m->mu);
        free(r);
        return kvs_market__reply_error(rep, 500, "database", "database error: %s", sqlite3_errmsg(m->db));
    }
    int status = 0;
    const char *code = NULL;
    char msg[512] = "";
    json_t *credited = json_array();
    uint32_t n_block = 0, rings = 0;
    char cid[65];
    int s = seen(m, head, r->seq, dhex);
    if (s == 1) {
        status = 200, code = "duplicate"; /* idempotent: credited once already */
    } else if (s == -1) {
        status = 409, code = "replay";
        snprintf(msg, sizeof msg, "head %.16s... already sent another receipt with seq %" PRIu64, head, r->seq);
    } else if (s == -2) {
        status = 500, code = "database";
    } else if (!listing_of(m, r->model, &n_block, &rings, cid) || r->ring >= rings ||
               (cid[0] && strcmp(cid, r->content_id))) {
        status = 422, code = "wrong_model";
        snprintf(msg, sizeof msg, "model '%s' ring %u content id '%.16s' is not a listed ring of those weights", r->model,
                 r->ring, r->content_id);
    } else {
        /* the ranks tile [0, n_block), each window a live claim of this ring, block 0 the head's */
        uint32_t at = 0;
        for (size_t i = 0; i < r->n_ranks && !status; i++) {
            struct lclaim c;
            const struct kvs_market_receipt_rank *k = &r->ranks[i];
            if (k->begin != at) {
                status = 422, code = "bad_ranks";
                snprintf(msg, sizeof msg, "ranks[%zu] begins at %u, the windows so far end at %u", i, k->begin, at);
            } else if (!live_claim(m, k->claim, now, &c) || strcmp(c.model, r->model) || c.ring != r->ring ||
                       c.begin != k->begin || c.end != k->end) {
                status = 422, code = "not_held";
                snprintf(msg, sizeof msg, "claim %" PRId64 " does not hold [%u,%u) of %s ring %u", k->claim, k->begin,
                         k->end, r->model, r->ring);
            } else if (i == 0) {
                uint8_t pk[32];
                if (kvs_key_parse_public(c.pubkey, pk) != KVS_OK || memcmp(pk, r->head, 32)) {
                    status = 403, code = "unknown_head";
                    snprintf(msg, sizeof msg, "key %.16s... is not the key of the head's claim %" PRId64, head,
                             k->claim);
                }
            }
            at = k->end;
        }
        if (!status && at != n_block) {
            status = 422, code = "bad_ranks";
            snprintf(msg, sizeof msg, "the windows end at %u, the model has %u blocks", at, n_block);
        }
        if (!status &&
            !exec_bind(m, "INSERT INTO receipts(head, digest, seq, tokens, created_ms) VALUES(?,?,?,?,?)", head, dhex,
                       (int64_t)r->seq, (int64_t)r->tokens, now))
            status = 500, code = "database";
        for (size_t i = 0; i < r->n_ranks && !status; i++) {
            struct lclaim c;
            live_claim(m, r->ranks[i].claim, now, &c);
            int64_t blocks = r->ranks[i].end - r->ranks[i].begin, credit = (int64_t)r->tokens * blocks;
            if (!exec_bind(m,
                           "INSERT INTO credits(node, model, credit, tokens, receipts) VALUES(?,?,?,?,?)"
                           " ON CONFLICT(node, model) DO UPDATE SET credit=credit+excluded.credit,"
                           " tokens=tokens+excluded.tokens, receipts=receipts+1",
                           c.node, r->model, credit, (int64_t)r->tokens, 1))
                status = 500, code = "database";
            else
                json_array_append_new(credited, json_pack("{ss sI sI}", "node", c.node, "blocks", (json_int_t)blocks,
                                                          "credit", (json_int_t)credit));
        }
    }
    if (!status) {
        if (!kvs_market__commit(m)) status = 500, code = "database";
    } else {
        kvs_market__rollback(m);
    }
    if (code && !strcmp(code, "database")) snprintf(msg, sizeof msg, "database error: %s", sqlite3_errmsg(m->db));
    pthread_mutex_unlock(&m->mu);
    uint64_t seq = r->seq;
    free(r);
    if (!status) return kvs_market__reply_json(rep, 201, json_pack("{sI so}", "seq", (json_int_t)seq, "credited", credited));
    json_decref(credited);
    if (status == 200) return kvs_market__reply_json(rep, 200, json_pack("{sI sb}", "seq", (json_int_t)seq, "duplicate", 1));
    return kvs_market__reply_error(rep, status, code, "%s", msg);
}

kvs_err kvs_market__handle_ledger(struct kvs_market *m, struct kvs_market_reply *rep)
{
    pthread_mutex_lock(&m->mu);
    json_t *nodes = json_array();
    sqlite3_stmt *st = NULL;
    json_int_t n_receipts = 0;
    bool ok = nodes &&
              sqlite3_prepare_v2(m->db, "SELECT COUNT(*) FROM receipts", -1, &st, NULL) == SQLITE_OK &&
              sqlite3_step(st) == SQLITE_ROW;
    if (ok) n_receipts = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    st = NULL;
    ok = ok && sqlite3_prepare_v2(m->db,
                                  "SELECT node, model, credit, tokens, receipts FROM credits ORDER BY credit DESC, node",
                                  -1, &st, NULL) == SQLITE_OK;
    while (ok && sqlite3_step(st) == SQLITE_ROW)
        json_array_append_new(nodes, json_pack("{ss ss sI sI sI}", "node", (const char *)sqlite3_column_text(st, 0),
                                               "model", (const char *)sqlite3_column_text(st, 1), "credit",
                                               (json_int_t)sqlite3_column_int64(st, 2), "tokens",
                                               (json_int_t)sqlite3_column_int64(st, 3), "receipts",
                                               (json_int_t)sqlite3_column_int64(st, 4)));
    sqlite3_finalize(st);
    pthread_mutex_unlock(&m->mu);
    if (!ok) {
        json_decref(nodes);
        return kvs_market__reply_error(rep, 500, "database", "database error");
    }
    return kvs_market__reply_json(rep, 200, json_pack("{sI sI so}", "kvasir_ledger", (json_int_t)1, "receipts",
                                                       n_receipts, "nodes", nodes));
}

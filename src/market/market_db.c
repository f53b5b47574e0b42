/* The market's state in SQLite and its request dispatch (kvs_market_handle).
 * Every change is one IMMEDIATE transaction (SQLite's write lock is taken at
 * BEGIN), so "no overlapping live claim, then insert" is atomic: of racing
 * claims for overlapping blocks exactly one commits. */
#include "market/market.h"
#include "market/market_impl.h"

#include <inttypes.h>
#include <jansson.h>
#include <openssl/sha.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "gguf/gguf.h"
#include "link/link.h"
#include "plan/plan.h"

static const char SCHEMA[] =
    "CREATE TABLE IF NOT EXISTS meta(key TEXT PRIMARY KEY, value INTEGER);"
    "CREATE TABLE IF NOT EXISTS listings(name TEXT PRIMARY KEY, seq INTEGER NOT NULL, fingerprint TEXT NOT NULL,"
    " n_block INTEGER NOT NULL, url TEXT NOT NULL, idx TEXT NOT NULL, rings INTEGER NOT NULL, ctx INTEGER NOT NULL,"
    " seqs INTEGER NOT NULL, boundary TEXT NOT NULL, profile TEXT NOT NULL, created_ms INTEGER NOT NULL);"
    "CREATE TABLE IF NOT EXISTS claims(id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL,"
    " ring INTEGER NOT NULL, b INTEGER NOT NULL, e INTEGER NOT NULL, node TEXT NOT NULL, endpoint TEXT NOT NULL,"
    " relay TEXT NOT NULL, pubkey TEXT NOT NULL, api TEXT NOT NULL, token TEXT NOT NULL,"
    " expires_ms INTEGER NOT NULL, ready INTEGER NOT NULL DEFAULT 0, tps REAL NOT NULL DEFAULT 0,"
    " queued INTEGER NOT NULL DEFAULT 0, created_ms INTEGER NOT NULL, renewed_ms INTEGER NOT NULL);"
    "CREATE INDEX IF NOT EXISTS claims_ring ON claims(model, ring, b);"
    "CREATE TABLE IF NOT EXISTS receipts(head TEXT NOT NULL, seq INTEGER NOT NULL, digest TEXT NOT NULL,"
    " tokens INTEGER NOT NULL, created_ms INTEGER NOT NULL, PRIMARY KEY(head, seq));"
    "CREATE TABLE IF NOT EXISTS credits(node TEXT NOT NULL, model TEXT NOT NULL, credit INTEGER NOT NULL,"
    " tokens INTEGER NOT NULL, receipts INTEGER NOT NULL, PRIMARY KEY(node, model));";

int64_t kvs_market_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct kvs_market_params kvs_market_default_params(void)
{
    return (struct kvs_market_params){ .db_path = NULL, .lease_ms = KVS_MARKET_LEASE_DEFAULT_MS,
                                       .max_body = KVS_MARKET_MAX_BODY_DEFAULT };
}

__attribute__((format(printf, 4, 5))) static kvs_err fail(kvs_err e, char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (errbuf && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(errbuf, errlen, fmt, ap);
        va_end(ap);
    }
    return e;
}

static int64_t meta_get(sqlite3 *db, const char *key, int64_t dflt)
{
    sqlite3_stmt *st;
    int64_t v = dflt;
    if (sqlite3_prepare_v2(db, "SELECT value FROM meta WHERE key=?", -1, &st, NULL) != SQLITE_OK) return dflt;
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    if (sqlite3_step(st) == SQLITE_ROW) v = sqlite3_column_int64(st, 0);
    sqlite3_finalize(st);
    return v;
}

static bool meta_set(sqlite3 *db, const char *key, int64_t v)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(db, "INSERT INTO meta(key,value) VALUES(?,?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                           -1, &st, NULL) != SQLITE_OK)
        return false;
    sqlite3_bind_text(st, 1, key, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 2, v);
    bool ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    return ok;
}

kvs_err kvs_market_open(const struct kvs_market_params *p, struct kvs_market **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    if (!p || !p->db_path || !p->db_path[0] || p->lease_ms < 100 || p->lease_ms > 86400000 || p->max_body < 256)
        return fail(KVS_ERR_ARG, errbuf, errlen, "market: a database path, a lease of 100 ms..1 day and a body cap >= 256 "
                                                 "bytes are needed");
    struct kvs_market *m = calloc(1, sizeof *m);
    if (!m) return KVS_ERR_NOMEM;
    m->p = *p;
    if (p->relay_secret_len && (p->relay_secret_len < 16 || p->relay_secret_len > sizeof m->relay_secret || !p->relay_secret)) {
        free(m);
        return fail(KVS_ERR_ARG, errbuf, errlen, "market: the relay secret must be 16..256 bytes");
    }
    if (p->relay_pin && p->relay_pin[0] &&
        (strlen(p->relay_pin) != 64 || strspn(p->relay_pin, "0123456789abcdef") != 64)) {
        free(m);
        return fail(KVS_ERR_ARG, errbuf, errlen, "market: the relay pin must be 64 lower-case hex digits");
    }
    if (p->relay_secret_len) memcpy(m->relay_secret, p->relay_secret, p->relay_secret_len);
    m->relay_secret_len = p->relay_secret_len;
    snprintf(m->relay_pin, sizeof m->relay_pin, "%s", p->relay_pin ? p->relay_pin : "");
    m->p.relay_secret = NULL;
    m->p.relay_pin = NULL;
    pthread_mutex_init(&m->mu, NULL);
    if (sqlite3_open_v2(p->db_path, &m->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX, NULL) !=
        SQLITE_OK) {
        fail(KVS_ERR_IO, errbuf, errlen, "market: cannot open %s: %s", p->db_path,
             m->db ? sqlite3_errmsg(m->db) : "out of memory");
        kvs_market_close(m);
        return KVS_ERR_IO;
    }
    sqlite3_busy_timeout(m->db, 5000);
    char *msg = NULL;
    if (sqlite3_exec(m->db, "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;", NULL, NULL, NULL) != SQLITE_OK ||
        sqlite3_exec(m->db, SCHEMA, NULL, NULL, &msg) != SQLITE_OK) {
        fail(KVS_ERR_IO, errbuf, errlen, "market: %s is not a market database: %s", p->db_path,
             msg ? msg : sqlite3_errmsg(m->db));
        sqlite3_free(msg);
        kvs_market_close(m);
        return KVS_ERR_IO;
    }
    /* Grace: claims live when the market last ran get one lease from now
     * (their holders could not renew while it was down). */
    int64_t now = kvs_market_now_ms(), alive = meta_get(m->db, "alive_ms", 0);
    sqlite3_stmt *st;
    if (alive > 0 &&
        sqlite3_prepare_v2(m->db, "UPDATE claims SET expires_ms=MAX(expires_ms, ?) WHERE expires_ms > ?", -1, &st,
                           NULL) == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, now + p->lease_ms);
        sqlite3_bind_int64(st, 2, alive);
        sqlite3_step(st);
        sqlite3_finalize(st);
    }
    meta_set(m->db, "alive_ms", now);
    m->last_alive_ms = now;
    *out = m;
    return KVS_OK;
}

/* kvs_market_close is in market_http.c (it stops the server first). */

void kvs_market_db_close(struct kvs_market *m)
{
    if (m->db) {
        meta_set(m->db, "alive_ms", kvs_market_now_ms());
        sqlite3_close(m->db);
    }
    m->db = NULL;
    pthread_mutex_destroy(&m->mu);
}

/* --- replies ------------------------------------------------------------------ */

static kvs_err reply_json(struct kvs_market_reply *r, int status, json_t *j)
{
    r->status = status;
    r->type = "application/json";
    r->body = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!r->body) {
        r->status = 500;
        r->type = "text/plain";
        r->body = strdup("out of memory\n");
        return r->body ? KVS_OK : KVS_ERR_NOMEM;
    }
    return KVS_OK;
}

__attribute__((format(printf, 4, 5))) static kvs_err reply_error(struct kvs_market_reply *r, int status, const char *code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return reply_json(r, status, json_pack("{s{ssss}}", "error", "code", code, "message", msg));
}

kvs_err kvs_market__reply_json(struct kvs_market_reply *r, int status, json_t *j) { return reply_json(r, status, j); }
kvs_err kvs_market__reply_error(struct kvs_market_reply *r, int status, const char *code, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return reply_error(r, status, code, "%s", msg);
}

static kvs_err reply_db(struct kvs_market *m, struct kvs_market_reply *r)
{
    return reply_error(r, 500, "database", "database error: %s", sqlite3_errmsg(m->db));
}

/* --- transactions ----------------------------------------------------------------- */

static bool begin(struct kvs_market *m)
{
    return sqlite3_exec(m->db, "BEGIN IMMEDIATE", NULL, NULL, NULL) == SQLITE_OK;
}
static bool commit(struct kvs_market *m)
{
    if (sqlite3_exec(m->db, "COMMIT", NULL, NULL, NULL) == SQLITE_OK) return true;
    sqlite3_exec(m->db, "ROLLBACK", NULL, NULL, NULL);
    return false;
}
static void rollback(struct kvs_market *m)
{
    sqlite3_exec(m->db, "ROLLBACK", NULL, NULL, NULL);
}

/* Deletes expired claims; stamps "alive" at most once a second. Inside a
 * transaction. */
static bool purge(struct kvs_market *m, int64_t now)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "DELETE FROM claims WHERE expires_ms <= ?", -1, &st, NULL) != SQLITE_OK) return false;
    sqlite3_bind_int64(st, 1, now);
    bool ok = sqlite3_step(st) == SQLITE_DONE;
    sqlite3_finalize(st);
    if (ok && now - m->last_alive_ms >= 1000) {
        ok = meta_set(m->db, "alive_ms", now);
        if (ok) m->last_alive_ms = now;
    }
    return ok;
}

bool kvs_market__begin(struct kvs_market *m) { return begin(m); }
bool kvs_market__commit(struct kvs_market *m) { return commit(m); }
void kvs_market__rollback(struct kvs_market *m) { rollback(m); }
bool kvs_market__purge(struct kvs_market *m, int64_t now) { return purge(m, now); }

/* --- listings ------------------------------------------------------------------ */

struct listing_row {
    char name[KVS_MARKET_NAME_MAX];
    uint32_t n_block, rings;
};

static int find_listing(struct kvs_market *m, const char *name, struct listing_row *row)
{
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT n_block, rings FROM listings WHERE name=?", -1, &st, NULL) != SQLITE_OK)
        return -1;
    sqlite3_bind_text(st, 1, name, -1, SQLITE_STATIC);
    int rc = sqlite3_step(st);
    int found = rc == SQLITE_ROW ? 1 : rc == SQLITE_DONE ? 0 : -1;
    if (found == 1) {
        snprintf(row->name, sizeof row->name, "%s", name);
        row->n_block = (uint32_t)sqlite3_column_int(st, 0);
        row->rings = (uint32_t)sqlite3_column_int(st, 1);
    }
    sqlite3_finalize(st);
    return found;
}

kvs_err kvs_market_add_listing(struct kvs_market *m, const struct kvs_market_listing_req *r,
                               const struct kvs_plan_model *profile, char *errbuf, size_t errlen)
{
    if (!kvs_market_valid_name(r->name) || !profile->n_block || profile->n_block > KVS_PLAN_MAX_BLOCKS)
        return fail(KVS_ERR_ARG, errbuf, errlen, "listing: bad name or profile");
    char *pj = kvs_market_profile_json(profile);
    if (!pj) return KVS_ERR_NOMEM;
    kvs_err e = KVS_OK;
    pthread_mutex_lock(&m->mu);
    if (!begin(m)) {
        e = fail(KVS_ERR_IO, errbuf, errlen, "database: %s", sqlite3_errmsg(m->db));
        goto out;
    }
    struct listing_row row;
    int f = find_listing(m, r->name, &row);
    if (f != 0) {
        rollback(m);
        e = f > 0 ? fail(KVS_ERR_MISMATCH, errbuf, errlen, "model '%s' is already listed", r->name)
                  : fail(KVS_ERR_IO, errbuf, errlen, "database: %s", sqlite3_errmsg(m->db));
        goto out;
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db,
                           "INSERT INTO listings(name, seq, fingerprint, n_block, url, idx, rings, ctx, seqs, boundary,"
                           " profile, created_ms) VALUES(?, (SELECT COALESCE(MAX(seq),0)+1 FROM listings), ?,?,?,?,?,?,?,?,?,?)",
                           -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        e = fail(KVS_ERR_IO, errbuf, errlen, "database: %s", sqlite3_errmsg(m->db));
        goto out;
    }
    sqlite3_bind_text(st, 1, r->name, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 2, profile->fingerprint, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 3, (int)profile->n_block);
    sqlite3_bind_text(st, 4, r->url, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 5, r->index, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 6, (int)r->rings);
    sqlite3_bind_int(st, 7, (int)(r->ctx ? r->ctx : kvs_plan_default_ctx(profile)));
    sqlite3_bind_int(st, 8, (int)r->seqs);
    sqlite3_bind_text(st, 9, r->boundary_f32 ? "f32" : "f16", -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 10, pj, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 11, kvs_market_now_ms());
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE || !commit(m)) {
        if (rc != SQLITE_DONE) rollback(m);
        e = fail(KVS_ERR_IO, errbuf, errlen, "database: %s", sqlite3_errmsg(m->db));
    }
out:
    pthread_mutex_unlock(&m->mu);
    free(pj);
    return e;
}

static kvs_err handle_add_listing(struct kvs_market *m, const char *body, size_t len, struct kvs_market_reply *r)
{
    struct kvs_market_listing_req q;
    char err[512];
    kvs_err e = kvs_market_parse_listing(body, len, &q, err, sizeof err);
    if (e) return reply_error(r, 400, "bad_request", "%s", err);
    pthread_mutex_lock(&m->mu);
    struct listing_row row;
    int f = find_listing(m, q.name, &row);
    pthread_mutex_unlock(&m->mu);
    if (f > 0) return reply_error(r, 409, "exists", "model '%s' is already listed", q.name);
    /* the header, without holding the database */
    uint8_t *buf = NULL;
    struct kvs_gguf *g = NULL;
    e = kvs_plan_fetch_header(q.url, &buf, &g, err, sizeof err);
    if (e) {
        free(buf);
        return reply_error(r, 502, "header", "cannot read the GGUF header of %s: %s (%s)", q.url, err, kvs_strerror(e));
    }
    struct kvs_plan_model *pm = NULL;
    e = kvs_plan_model_from_gguf(g, &pm, err, sizeof err);
    kvs_gguf_close(g);
    free(buf);
    if (e) return reply_error(r, 502, "header", "%s: not a model the planner can profile: %s", q.url, err);
    snprintf(pm->content_id, sizeof pm->content_id, "%s", q.content_id); /* kept in the profile */
    e = kvs_market_add_listing(m, &q, pm, err, sizeof err);
    json_t *j = NULL;
    if (!e)
        j = json_pack("{ss ss sI ss ss sI sI sI ss ss*}", "name", q.name, "fingerprint", pm->fingerprint, "n_block",
                      (json_int_t)pm->n_block, "url", q.url, "index", q.index, "rings", (json_int_t)q.rings, "ctx",
                      (json_int_t)(q.ctx ? q.ctx : kvs_plan_default_ctx(pm)), "seqs", (json_int_t)q.seqs, "boundary",
                      q.boundary_f32 ? "f32" : "f16", "content_id", q.content_id[0] ? q.content_id : NULL);
    free(pm);
    if (e == KVS_ERR_MISMATCH) return reply_error(r, 409, "exists", "%s", err);
    if (e) return reply_error(r, 500, "database", "%s", err);
    return reply_json(r, 201, j);
}

/* --- claims -------------------------------------------------------------------- */

static void new_token(char out[KVS_MARKET_TOKEN_LEN + 1])
{
    uint8_t b[KVS_MARKET_TOKEN_LEN / 2];
    if (getrandom(b, sizeof b, 0) != (ssize_t)sizeof b) { /* fall back to the clock (never expected) */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)(uintptr_t)out;
        for (size_t i = 0; i < sizeof b; i++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            b[i] = (uint8_t)(x >> 56);
        }
    }
    for (size_t i = 0; i < sizeof b; i++) snprintf(out + 2 * i, 3, "%02x", b[i]);
}

/* A relay base URL in a claim: ws[s]://HOST[:PORT] with nothing after it but '/'; NULL when it is
 * one, else why not. */
static const char *relay_base_problem(const char *u)
{
    const char *h = !strncmp(u, "wss://", 6) ? u + 6 : !strncmp(u, "ws://", 5) ? u + 5 : NULL;
    if (!h) return "must begin with ws:// or wss://";
    if (!*h || *h == '/' || *h == ':') return "needs a host";
    const char *sl = strchr(h, '/');
    if (sl && strspn(sl, "/") != strlen(sl)) return "must be the relay's base URL (ws[s]://HOST[:PORT]): the market names the edge";
    for (const char *p = h; *p; p++)
        if (*p <= ' ' || *p > '~' || strchr("?#@\"'<>\\", *p)) return "has a character a URL host cannot have";
    return NULL;
}

void kvs_market_edge_id(const char *model, uint32_t ring, uint32_t begin, char out[65])
{
    char tail[32];
    snprintf(tail, sizeof tail, "-r%u-b%u", ring, begin);
    size_t ml = strlen(model), tl = strlen(tail);
    if (ml + tl <= 64) {
        memcpy(out, model, ml);
        memcpy(out + ml, tail, tl + 1);
        return;
    }
    uint8_t d[32];
    SHA256((const unsigned char *)model, strlen(model), d);
    out[0] = 'h';
    for (int i = 0; i < 16; i++) snprintf(out + 1 + 2 * i, 3, "%02x", d[i]);
    memcpy(out + 33, tail, tl + 1); /* tl <= 23 */
}

static kvs_err handle_claim(struct kvs_market *m, const char *body, size_t len, int64_t now, struct kvs_market_reply *r)
{
    struct kvs_market_claim_req q;
    char err[512];
    kvs_err e = kvs_market_parse_claim(body, len, &q, err, sizeof err);
    if (e == KVS_ERR_RANGE) return reply_error(r, 400, "out_of_range", "%s", err);
    if (e) return reply_error(r, 400, "bad_request", "%s", err);
    pthread_mutex_lock(&m->mu);
    if (!begin(m)) {
        e = reply_db(m, r);
        goto out;
    }
    if (!purge(m, now)) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    struct listing_row row;
    int f = find_listing(m, q.model, &row);
    if (f <= 0) {
        rollback(m);
        e = f < 0 ? reply_db(m, r) : reply_error(r, 404, "unknown_model", "no model '%s' is listed", q.model);
        goto out;
    }
    if (q.end > row.n_block || q.ring >= row.rings) {
        rollback(m);
        e = reply_error(r, 400, "out_of_range", "claim of ring %u blocks [%u,%u) is outside model '%s' (%u blocks, %u rings)",
                        q.ring, q.begin, q.end, q.model, row.n_block, row.rings);
        goto out;
    }
    char edge[65] = "", edge_token[KVS_RELAY_TOKEN_HEX + 1] = "";
    if (q.relay[0]) { /* the in link through the relay: the market names the edge and hands out its token */
        const char *why = relay_base_problem(q.relay);
        if (!m->relay_secret_len || why) {
            rollback(m);
            e = m->relay_secret_len ? reply_error(r, 400, "bad_request", "field 'relay': %s", why)
                                    : reply_error(r, 400, "no_relay", "this market hands out no relay edges (no --relay-secret)");
            goto out;
        }
        kvs_market_edge_id(q.model, q.ring, q.begin, edge);
        if (kvs_relay_token(m->relay_secret, m->relay_secret_len, edge, edge_token)) {
            rollback(m);
            e = reply_error(r, 500, "internal", "cannot make the edge token");
            goto out;
        }
        size_t bl = strlen(q.relay);
        while (bl && q.relay[bl - 1] == '/') bl--;
        char full[KVS_MARKET_URL_MAX];
        if (snprintf(full, sizeof full, "%.*s/edge/%s", (int)bl, q.relay, edge) >= (int)sizeof full) {
            rollback(m);
            e = reply_error(r, 400, "bad_request", "field 'relay' is too long");
            goto out;
        }
        snprintf(q.relay, sizeof q.relay, "%s", full);
        q.endpoint[0] = '\0'; /* nobody dials the node itself */
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT id, b, e, node FROM claims WHERE model=? AND ring=? AND b < ? AND e > ? LIMIT 1",
                           -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    sqlite3_bind_text(st, 1, q.model, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, (int)q.ring);
    sqlite3_bind_int(st, 3, (int)q.end);
    sqlite3_bind_int(st, 4, (int)q.begin);
    int rc = sqlite3_step(st);
    if (rc == SQLITE_ROW) {
        int64_t id = sqlite3_column_int64(st, 0);
        int b = sqlite3_column_int(st, 1), en = sqlite3_column_int(st, 2);
        char holder[KVS_MARKET_NAME_MAX];
        snprintf(holder, sizeof holder, "%s", (const char *)sqlite3_column_text(st, 3));
        sqlite3_finalize(st);
        rollback(m);
        e = reply_error(r, 409, "overlap", "blocks [%u,%u) of ring %u of '%s' overlap claim %" PRId64 " [%d,%d) held by %s",
                        q.begin, q.end, q.ring, q.model, id, b, en, holder);
        goto out;
    }
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    char token[KVS_MARKET_TOKEN_LEN + 1];
    new_token(token);
    int64_t exp = now + m->p.lease_ms;
    if (sqlite3_prepare_v2(m->db,
                           "INSERT INTO claims(model, ring, b, e, node, endpoint, relay, pubkey, api, token, expires_ms,"
                           " created_ms, renewed_ms) VALUES(?,?,?,?,?,?,?,?,?,?,?,?,?)",
                           -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    sqlite3_bind_text(st, 1, q.model, -1, SQLITE_STATIC);
    sqlite3_bind_int(st, 2, (int)q.ring);
    sqlite3_bind_int(st, 3, (int)q.begin);
    sqlite3_bind_int(st, 4, (int)q.end);
    sqlite3_bind_text(st, 5, q.node, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 6, q.endpoint, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 7, q.relay, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 8, q.pubkey, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 9, q.api, -1, SQLITE_STATIC);
    sqlite3_bind_text(st, 10, token, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 11, exp);
    sqlite3_bind_int64(st, 12, now);
    sqlite3_bind_int64(st, 13, now);
    rc = sqlite3_step(st);
    sqlite3_finalize(st);
    int64_t id = sqlite3_last_insert_rowid(m->db);
    if (rc != SQLITE_DONE) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    if (!commit(m)) {
        e = reply_db(m, r);
        goto out;
    }
    json_t *rep = json_pack("{sI ss ss sI sI sI sI sI}", "id", (json_int_t)id, "token", token, "model", q.model, "ring",
                            (json_int_t)q.ring, "begin", (json_int_t)q.begin, "end", (json_int_t)q.end, "lease_ms",
                            (json_int_t)m->p.lease_ms, "expires_ms", (json_int_t)exp);
    if (rep && edge[0]) {
        json_object_set_new(rep, "relay", json_string(q.relay));
        json_object_set_new(rep, "edge", json_string(edge));
        json_object_set_new(rep, "edge_token", json_string(edge_token));
    }
    if (rep && m->relay_pin[0]) json_object_set_new(rep, "relay_pin", json_string(m->relay_pin));
    e = reply_json(r, 201, rep);
out:
    pthread_mutex_unlock(&m->mu);
    return e;
}

/* Under m->mu: begins a transaction, purges the claims expired at `now`,
 * looks up claim id and checks the token. 0: the caller holds the claim and
 * the transaction is open; else a reply was written (*e) and nothing is
 * open. */
static int begin_as_holder(struct kvs_market *m, int64_t id, const char *token, int64_t now,
                           struct kvs_market_reply *r, kvs_err *e)
{
    if (!begin(m)) {
        *e = reply_db(m, r);
        return -1;
    }
    if (!purge(m, now)) {
        rollback(m);
        *e = reply_db(m, r);
        return -1;
    }
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db, "SELECT token FROM claims WHERE id=?", -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        *e = reply_db(m, r);
        return -1;
    }
    sqlite3_bind_int64(st, 1, id);
    int rc = sqlite3_step(st);
    if (rc != SQLITE_ROW) {
        sqlite3_finalize(st);
        rollback(m);
        *e = rc == SQLITE_DONE ? reply_error(r, 404, "unknown_claim", "no live claim %" PRId64 " (released or its lease expired)", id)
                               : reply_db(m, r);
        return -1;
    }
    const char *t = (const char *)sqlite3_column_text(st, 0);
    unsigned diff = t && strlen(t) == KVS_MARKET_TOKEN_LEN ? 0 : 1;
    for (size_t i = 0; t && !diff && i < KVS_MARKET_TOKEN_LEN; i++) diff |= (unsigned)(t[i] ^ token[i]);
    sqlite3_finalize(st);
    if (diff) {
        rollback(m);
        *e = reply_error(r, 403, "not_holder", "claim %" PRId64 " is held by another node (wrong token)", id);
        return -1;
    }
    return 0;
}

static kvs_err handle_renew(struct kvs_market *m, int64_t id, const char *body, size_t len, int64_t now,
                            struct kvs_market_reply *r)
{
    struct kvs_market_renew_req q;
    char err[512];
    kvs_err e = kvs_market_parse_renew(body, len, &q, err, sizeof err);
    if (e) return reply_error(r, 400, "bad_request", "%s", err);
    pthread_mutex_lock(&m->mu);
    if (begin_as_holder(m, id, q.token, now, r, &e)) goto out;
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db,
                           "UPDATE claims SET expires_ms=?, renewed_ms=?, ready=CASE WHEN ? THEN ? ELSE ready END,"
                           " tps=CASE WHEN ? THEN ? ELSE tps END, queued=CASE WHEN ? THEN ? ELSE queued END,"
                           " api=CASE WHEN ? THEN ? ELSE api END WHERE id=?",
                           -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    int64_t exp = now + m->p.lease_ms;
    sqlite3_bind_int64(st, 1, exp);
    sqlite3_bind_int64(st, 2, now);
    sqlite3_bind_int(st, 3, q.has_ready);
    sqlite3_bind_int(st, 4, q.ready);
    sqlite3_bind_int(st, 5, q.has_tps);
    sqlite3_bind_double(st, 6, q.tps);
    sqlite3_bind_int(st, 7, q.has_queued);
    sqlite3_bind_int64(st, 8, q.queued);
    sqlite3_bind_int(st, 9, q.has_api);
    sqlite3_bind_text(st, 10, q.api, -1, SQLITE_STATIC);
    sqlite3_bind_int64(st, 11, id);
    int rc = sqlite3_step(st);
    sqlite3_finalize(st);
    if (rc != SQLITE_DONE) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    if (!commit(m)) {
        e = reply_db(m, r);
        goto out;
    }
    e = reply_json(r, 200, json_pack("{sI sI sI}", "id", (json_int_t)id, "lease_ms", (json_int_t)m->p.lease_ms,
                                     "expires_ms", (json_int_t)exp));
out:
    pthread_mutex_unlock(&m->mu);
    return e;
}

/* POST /v1/claims/ID/edge: the holder of a claim gets the token of the relay edge into the block
 * after its window (its successor's in link; the tail's: the head's), whoever holds that window. */
static kvs_err handle_edge(struct kvs_market *m, int64_t id, const char *body, size_t len, int64_t now,
                           struct kvs_market_reply *r)
{
    struct kvs_market_release_req q; /* {token}: the same shape */
    char err[512];
    kvs_err e = kvs_market_parse_release(body, len, &q, err, sizeof err);
    if (e) return reply_error(r, 400, "bad_request", "%s", err);
    if (!m->relay_secret_len) return reply_error(r, 404, "no_relay", "this market hands out no relay edges (no --relay-secret)");
    pthread_mutex_lock(&m->mu);
    if (begin_as_holder(m, id, q.token, now, r, &e)) goto out;
    sqlite3_stmt *st;
    if (sqlite3_prepare_v2(m->db,
                           "SELECT c.model, c.ring, c.e, l.n_block FROM claims c JOIN listings l ON l.name = c.model"
                           " WHERE c.id=?",
                           -1, &st, NULL) != SQLITE_OK) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    sqlite3_bind_int64(st, 1, id);
    if (sqlite3_step(st) != SQLITE_ROW) {
        sqlite3_finalize(st);
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    char model[KVS_MARKET_NAME_MAX], edge[65], tok[KVS_RELAY_TOKEN_HEX + 1];
    snprintf(model, sizeof model, "%s", (const char *)sqlite3_column_text(st, 0));
    uint32_t ring = (uint32_t)sqlite3_column_int(st, 1), en = (uint32_t)sqlite3_column_int(st, 2),
             nb = (uint32_t)sqlite3_column_int(st, 3);
    sqlite3_finalize(st);
    rollback(m); /* read only */
    kvs_market_edge_id(model, ring, en >= nb ? 0 : en, edge);
    if (kvs_relay_token(m->relay_secret, m->relay_secret_len, edge, tok)) {
        e = reply_error(r, 500, "internal", "cannot make the edge token");
        goto out;
    }
    json_t *rep = json_pack("{sI ss ss}", "id", (json_int_t)id, "edge", edge, "edge_token", tok);
    if (rep && m->relay_pin[0]) json_object_set_new(rep, "relay_pin", json_string(m->relay_pin));
    e = reply_json(r, 200, rep);
out:
    pthread_mutex_unlock(&m->mu);
    return e;
}

static kvs_err handle_release(struct kvs_market *m, int64_t id, const char *body, size_t len, int64_t now,
                              struct kvs_market_reply *r)
{
    struct kvs_market_release_req q;
    char err[512];
    kvs_err e = kvs_market_parse_release(body, len, &q, err, sizeof err);
    if (e) return reply_error(r, 400, "bad_request", "%s", err);
    pthread_mutex_lock(&m->mu);
    if (begin_as_holder(m, id, q.token, now, r, &e)) goto out;
    sqlite3_stmt *st;
    int rc = SQLITE_ERROR;
    if (sqlite3_prepare_v2(m->db, "DELETE FROM claims WHERE id=?", -1, &st, NULL) == SQLITE_OK) {
        sqlite3_bind_int64(st, 1, id);
        rc = sqlite3_step(st);
        sqlite3_finalize(st);
    }
    if (rc != SQLITE_DONE) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    if (!commit(m)) {
        e = reply_db(m, r);
        goto out;
    }
    e = reply_json(r, 200, json_pack("{sI sb}", "id", (json_int_t)id, "released", 1));
out:
    pthread_mutex_unlock(&m->mu);
    return e;
}

/* --- the map ------------------------------------------------------------------------ */

static const char *col_text(sqlite3_stmt *st, int i)
{
    const char *s = (const char *)sqlite3_column_text(st, i);
    return s ? s : "";
}

static json_t *gap_json(double demand, uint32_t b, uint32_t e, uint32_t covered, uint32_t n_block)
{
    double rw = kvs_market_reward(demand, e - b, covered, n_block);
    return json_pack("{sI sI sf sf}", "begin", (json_int_t)b, "end", (json_int_t)e, "reward", rw, "reward_per_block",
                     rw / (e - b));
}

/* Builds the whole map (caller holds mu, inside a transaction). */
static json_t *build_map(struct kvs_market *m, int64_t now)
{
    json_t *models = json_array();
    sqlite3_stmt *ls = NULL, *cs = NULL;
    if (!models ||
        sqlite3_prepare_v2(m->db,
                           "SELECT name, fingerprint, n_block, url, idx, rings, ctx, seqs, boundary, profile FROM listings"
                           " ORDER BY seq",
                           -1, &ls, NULL) != SQLITE_OK ||
        sqlite3_prepare_v2(m->db,
                           "SELECT id, ring, b, e, node, endpoint, relay, pubkey, api, expires_ms, ready, tps, queued"
                           " FROM claims WHERE model=? ORDER BY ring, b",
                           -1, &cs, NULL) != SQLITE_OK) {
        sqlite3_finalize(ls);
        json_decref(models);
        return NULL;
    }
    while (sqlite3_step(ls) == SQLITE_ROW) {
        const char *name = col_text(ls, 0);
        uint32_t n_block = (uint32_t)sqlite3_column_int(ls, 2), rings = (uint32_t)sqlite3_column_int(ls, 5);
        if (rings > KVS_MARKET_MAX_RINGS) rings = KVS_MARKET_MAX_RINGS;
        json_error_t je;
        json_t *profile = json_loads(col_text(ls, 9), 0, &je);
        json_t *cov = json_array();
        json_t *per_ring_claims[KVS_MARKET_MAX_RINGS];
        uint32_t covered[KVS_MARKET_MAX_RINGS] = { 0 };
        json_t *head[KVS_MARKET_MAX_RINGS] = { 0 };
        for (uint32_t i = 0; i < rings; i++) per_ring_claims[i] = json_array();
        uint64_t queued = 0;
        double tps = 0;
        sqlite3_reset(cs);
        sqlite3_bind_text(cs, 1, name, -1, SQLITE_TRANSIENT);
        while (sqlite3_step(cs) == SQLITE_ROW) {
            uint32_t ring = (uint32_t)sqlite3_column_int(cs, 1);
            if (ring >= rings) continue;
            uint32_t b = (uint32_t)sqlite3_column_int(cs, 2), e = (uint32_t)sqlite3_column_int(cs, 3);
            json_t *c = json_pack("{sI sI sI ss ss ss ss ss sI sb sf sI}", "id", (json_int_t)sqlite3_column_int64(cs, 0),
                                  "begin", (json_int_t)b, "end", (json_int_t)e, "node", col_text(cs, 4), "endpoint",
                                  col_text(cs, 5), "relay", col_text(cs, 6), "pubkey", col_text(cs, 7), "api",
                                  col_text(cs, 8), "expires_ms", (json_int_t)sqlite3_column_int64(cs, 9), "ready",
                                  sqlite3_column_int(cs, 10) != 0, "tps", sqlite3_column_double(cs, 11), "queued",
                                  (json_int_t)sqlite3_column_int64(cs, 12));
            json_array_append_new(per_ring_claims[ring], c);
            covered[ring] += e > b ? e - b : 0;
            if (b == 0) head[ring] = c;
            queued += (uint64_t)sqlite3_column_int64(cs, 12);
            tps += sqlite3_column_double(cs, 11);
        }
        double demand = kvs_market_demand(queued, tps);
        for (uint32_t ri = 0; ri < rings; ri++) {
            json_t *gaps = json_array();
            uint32_t at = 0;
            size_t i;
            json_t *c;
            json_array_foreach(per_ring_claims[ri], i, c) {
                uint32_t b = (uint32_t)json_integer_value(json_object_get(c, "begin"));
                uint32_t e = (uint32_t)json_integer_value(json_object_get(c, "end"));
                if (b > at) json_array_append_new(gaps, gap_json(demand, at, b, covered[ri], n_block));
                if (e > at) at = e;
            }
            if (at < n_block) json_array_append_new(gaps, gap_json(demand, at, n_block, covered[ri], n_block));
            bool complete = covered[ri] == n_block;
            const char *api = head[ri] ? json_string_value(json_object_get(head[ri], "api")) : NULL;
            bool ready = complete && head[ri] && json_is_true(json_object_get(head[ri], "ready")) && api && api[0];
            json_array_append_new(cov, json_pack("{sI sI sb sb ss* so so}", "ring", (json_int_t)ri, "covered",
                                                 (json_int_t)covered[ri], "complete", complete, "ready", ready, "api",
                                                 ready ? api : NULL, "claims", per_ring_claims[ri], "gaps", gaps));
        }
        json_array_append_new(
            models, json_pack("{ss ss sO* sI ss ss sI sI sI ss s{sI sf sf} so* so}", "name", name, "fingerprint",
                              col_text(ls, 1), "content_id", json_object_get(profile, "content_id"),
                              "n_block", (json_int_t)n_block, "url", col_text(ls, 3), "index",
                              col_text(ls, 4), "rings", (json_int_t)rings, "ctx", (json_int_t)sqlite3_column_int(ls, 6),
                              "seqs", (json_int_t)sqlite3_column_int(ls, 7), "boundary", col_text(ls, 8), "demand",
                              "queued", (json_int_t)queued, "tps", tps, "value", demand, "profile", profile, "coverage",
                              cov));
    }
    sqlite3_finalize(ls);
    sqlite3_finalize(cs);
    return json_pack("{sI sI sI so s{ss}}", "kvasir_market", (json_int_t)1, "now_ms", (json_int_t)now, "lease_ms",
                     (json_int_t)m->p.lease_ms, "models", models, "reward",
                     "formula", "demand * blocks / n_block * (1 + 3 * covered / n_block); demand = 1 + queued + tps / 100");
}

/* GET /map or /v1/rings: a read after purging expired claims. */
static kvs_err handle_read(struct kvs_market *m, bool rings_only, int64_t now, struct kvs_market_reply *r)
{
    kvs_err e;
    pthread_mutex_lock(&m->mu);
    if (!begin(m)) {
        e = reply_db(m, r);
        goto out;
    }
    if (!purge(m, now)) {
        rollback(m);
        e = reply_db(m, r);
        goto out;
    }
    json_t *map = build_map(m, now);
    commit(m);
    if (!map) {
        e = reply_db(m, r);
        goto out;
    }
    if (!rings_only) {
        e = reply_json(r, 200, map);
        goto out;
    }
    json_t *out = json_array();
    size_t i, k;
    json_t *mo, *ring;
    json_array_foreach(json_object_get(map, "models"), i, mo) {
        json_array_foreach(json_object_get(mo, "coverage"), k, ring) {
            if (!json_is_true(json_object_get(ring, "ready"))) continue;
            json_t *windows = json_array();
            size_t ci;
            json_t *c;
            json_array_foreach(json_object_get(ring, "claims"), ci, c)
                json_array_append_new(windows, json_pack("{sO sO sO sO sO}", "node", json_object_get(c, "node"), "begin",
                                                         json_object_get(c, "begin"), "end", json_object_get(c, "end"),
                                                         "endpoint", json_object_get(c, "endpoint"), "relay",
                                                         json_object_get(c, "relay")));
            json_array_append_new(out, json_pack("{sO sO sO sO so}", "model", json_object_get(mo, "name"),
                                                 "fingerprint", json_object_get(mo, "fingerprint"), "ring",
                                                 json_object_get(ring, "ring"), "api", json_object_get(ring, "api"),
                                                 "windows", windows));
        }
    }
    json_decref(map);
    e = reply_json(r, 200, json_pack("{so}", "rings", out));
out:
    pthread_mutex_unlock(&m->mu);
    return e;
}

static kvs_err handle_listings(struct kvs_market *m, int64_t now, struct kvs_market_reply *r)
{
    kvs_err e = handle_read(m, false, now, r);
    if (e || r->status != 200) return e;
    json_t *map = json_loads(r->body, 0, NULL);
    free(r->body);
    r->body = NULL;
    json_t *out = json_array();
    size_t i;
    json_t *mo;
    json_array_foreach(json_object_get(map, "models"), i, mo) {
        json_t *l = json_deep_copy(mo);
        json_object_del(l, "coverage");
        json_object_del(l, "profile");
        json_array_append_new(out, l);
    }
    json_decref(map);
    return reply_json(r, 200, json_pack("{so}", "listings", out));
}

/* --- dispatch ----------------------------------------------------------------------- */

/* "/v1/claims/<id>/<verb>": 1 and *id, *verb set; 0 if not that shape. */
static int claim_path(const char *path, int64_t *id, const char **verb)
{
    static const char pre[] = "/v1/claims/";
    if (strncmp(path, pre, sizeof pre - 1)) return 0;
    const char *p = path + sizeof pre - 1;
    int64_t v = 0;
    int nd = 0;
    while (*p >= '0' && *p <= '9' && nd < 18) {
        v = v * 10 + (*p++ - '0');
        nd++;
    }
    if (!nd || *p != '/') return 0;
    *id = v;
    *verb = p + 1;
    return 1;
}

kvs_err kvs_market_handle(struct kvs_market *m, const char *method, const char *path, const char *body, size_t len,
                          int64_t now_ms, struct kvs_market_reply *r)
{
    memset(r, 0, sizeof *r);
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD"), post = !strcmp(method, "POST");
    if (len > m->p.max_body) return reply_error(r, 413, "too_large", "request body exceeds %zu bytes", m->p.max_body);
    int64_t id = 0;
    const char *verb = NULL;
    bool is_claim = claim_path(path, &id, &verb) &&
                    (!strcmp(verb, "renew") || !strcmp(verb, "release") || !strcmp(verb, "edge"));
    const char *allow = NULL;
    if (!strcmp(path, "/") || !strcmp(path, "/index.html")) {
        if (get) {
            r->status = 200;
            r->type = "text/html; charset=utf-8";
            r->body = strdup(kvs_market_page_html);
            return r->body ? KVS_OK : KVS_ERR_NOMEM;
        }
        allow = "GET";
    } else if (!strcmp(path, "/map")) {
        if (get) return handle_read(m, false, now_ms, r);
        allow = "GET";
    } else if (!strcmp(path, "/v1/rings")) {
        if (get) return handle_read(m, true, now_ms, r);
        allow = "GET";
    } else if (!strcmp(path, "/v1/listings")) {
        if (get) return handle_listings(m, now_ms, r);
        if (post) return handle_add_listing(m, body, len, r);
        allow = "GET or POST";
    } else if (!strcmp(path, "/ledger")) {
        if (get) return kvs_market__handle_ledger(m, r);
        allow = "GET";
    } else if (!strcmp(path, "/v1/receipts")) {
        if (post) return kvs_market__handle_receipt(m, body, len, now_ms, r);
        allow = "POST";
    } else if (!strcmp(path, "/v1/claims")) {
        if (post) return handle_claim(m, body, len, now_ms, r);
        allow = "POST";
    } else if (is_claim) {
        if (post && !strcmp(verb, "renew")) return handle_renew(m, id, body, len, now_ms, r);
        if (post && !strcmp(verb, "edge")) return handle_edge(m, id, body, len, now_ms, r);
        if (post) return handle_release(m, id, body, len, now_ms, r);
        allow = "POST";
    } else {
        return reply_error(r, 404, "unknown_route", "no route %.16s %.200s", method, path);
    }
    return reply_error(r, 405, "method_not_allowed", "%.16s is not allowed on %.200s (use %s)", method, path, allow);
}

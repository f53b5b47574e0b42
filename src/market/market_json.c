/* The market's JSON layer: request parsers, the reward formula, the model
 * profile, the /map reader and a node's choice of window. No I/O. */
#include "market/market.h"
#include "market/market_impl.h"

#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "plan/plan.h"

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

bool kvs_market_valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n >= KVS_MARKET_NAME_MAX) return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
              c == '-'))
            return false;
    }
    return true;
}

bool kvs_market_valid_url(const char *s)
{
    if (strncmp(s, "http://", 7) && strncmp(s, "https://", 8)) return false;
    size_t n = strlen(s);
    if (n >= KVS_MARKET_URL_MAX || n < 9) return false;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] <= ' ' || (unsigned char)s[i] >= 0x7f || s[i] == '"' || s[i] == '<' || s[i] == '>')
            return false;
    return true;
}

bool kvs_market_valid_addr(const char *s)
{
    size_t n = strlen(s);
    if (n < 3 || n >= KVS_MARKET_ADDR_MAX) return false;
    const char *colon = strrchr(s, ':');
    if (!colon || colon == s || !colon[1]) return false;
    for (const char *p = s; p < colon; p++) {
        char c = *p;
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' ||
              c == '[' || c == ']' || c == ':'))
            return false;
    }
    long port = 0;
    for (const char *p = colon + 1; *p; p++) {
        if (*p < '0' || *p > '9' || p - colon > 5) return false;
        port = port * 10 + (*p - '0');
    }
    return port >= 1 && port <= 65535;
}

static bool valid_token(const char *s)
{
    if (strlen(s) != KVS_MARKET_TOKEN_LEN) return false;
    for (const char *p = s; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return false;
    return true;
}

static kvs_err load_object(const char *text, size_t len, json_t **out, char *errbuf, size_t errlen)
{
    json_error_t je;
    json_t *j = json_loadb(text ? text : "", text ? len : 0, JSON_REJECT_DUPLICATES, &je);
    if (!j) return fail(KVS_ERR_FORMAT, errbuf, errlen, "malformed JSON: %s (line %d)", je.text, je.line);
    if (!json_is_object(j)) {
        json_decref(j);
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "the body must be a JSON object");
    }
    *out = j;
    return KVS_OK;
}

/* String field: required or not; copied into dst[cap]. */
static kvs_err get_str(json_t *o, const char *key, bool required, char *dst, size_t cap, char *errbuf, size_t errlen)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return fail(KVS_ERR_FORMAT, errbuf, errlen, "missing field '%s'", key);
        return KVS_OK;
    }
    if (!json_is_string(v)) return fail(KVS_ERR_FORMAT, errbuf, errlen, "field '%s' must be a string", key);
    size_t n = json_string_length(v);
    const char *s = json_string_value(v);
    if (n >= cap) return fail(KVS_ERR_RANGE, errbuf, errlen, "field '%s' is longer than %zu bytes", key, cap - 1);
    if (memchr(s, '\0', n)) return fail(KVS_ERR_FORMAT, errbuf, errlen, "field '%s' holds a NUL byte", key);
    memcpy(dst, s, n + 1);
    return KVS_OK;
}

/* Integer field in [lo, hi]. */
static kvs_err get_uint(json_t *o, const char *key, bool required, long long lo, long long hi, uint32_t *dst,
                        char *errbuf, size_t errlen)
{
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (required) return fail(KVS_ERR_FORMAT, errbuf, errlen, "missing field '%s'", key);
        return KVS_OK;
    }
    if (!json_is_integer(v)) return fail(KVS_ERR_FORMAT, errbuf, errlen, "field '%s' must be an integer", key);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return fail(KVS_ERR_RANGE, errbuf, errlen, "field '%s' = %lld is outside %lld..%lld", key, (long long)x, lo,
                    hi);
    *dst = (uint32_t)x;
    return KVS_OK;
}

/* 64 lower-case hex digits (a content id, docs/FORMATS.md). */
static bool valid_cid(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!((s[n] >= '0' && s[n] <= '9') || (s[n] >= 'a' && s[n] <= 'f'))) return false;
    return n == 64;
}

kvs_err kvs_market_parse_listing(const char *text, size_t len, struct kvs_market_listing_req *r, char *errbuf,
                                 size_t errlen)
{
    memset(r, 0, sizeof *r);
    r->rings = 1;
    r->seqs = 4;
    json_t *o;
    kvs_err e = load_object(text, len, &o, errbuf, errlen);
    if (e) return e;
    char boundary[8] = "f32";
    if ((e = get_str(o, "url", true, r->url, sizeof r->url, errbuf, errlen)) ||
        (e = get_str(o, "name", false, r->name, sizeof r->name, errbuf, errlen)) ||
        (e = get_str(o, "index", false, r->index, sizeof r->index, errbuf, errlen)) ||
        (e = get_str(o, "content_id", false, r->content_id, sizeof r->content_id, errbuf, errlen)) ||
        (e = get_uint(o, "rings", false, 1, KVS_MARKET_MAX_RINGS, &r->rings, errbuf, errlen)) ||
        (e = get_uint(o, "ctx", false, 0, 16777216, &r->ctx, errbuf, errlen)) ||
        (e = get_uint(o, "seqs", false, 1, 4096, &r->seqs, errbuf, errlen)) ||
        (e = get_str(o, "boundary", false, boundary, sizeof boundary, errbuf, errlen)))
        goto out;
    if (!kvs_market_valid_url(r->url)) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'url' must be an http:// or https:// URL");
        goto out;
    }
    if (r->index[0] && !kvs_market_valid_url(r->index)) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'index' must be an http:// or https:// URL");
        goto out;
    }
    if (strcmp(boundary, "f16") && strcmp(boundary, "f32")) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'boundary' must be \"f16\" or \"f32\"");
        goto out;
    }
    if (r->content_id[0] && !valid_cid(r->content_id)) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'content_id' must be 64 lower-case hex digits");
        goto out;
    }
    r->boundary_f32 = !strcmp(boundary, "f32");
    if (!r->name[0]) { /* the URL's file name without .gguf */
        const char *slash = strrchr(r->url, '/');
        const char *base = slash ? slash + 1 : r->url;
        size_t n = strcspn(base, "?#");
        if (n > 5 && !strncmp(base + n - 5, ".gguf", 5)) n -= 5;
        if (n >= sizeof r->name) n = sizeof r->name - 1;
        memcpy(r->name, base, n);
        r->name[n] = '\0';
    }
    if (!kvs_market_valid_name(r->name)) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'name' must be 1..63 bytes of [A-Za-z0-9._-]");
        goto out;
    }
out:
    json_decref(o);
    return e;
}

kvs_err kvs_market_parse_claim(const char *text, size_t len, struct kvs_market_claim_req *r, char *errbuf,
                               size_t errlen)
{
    memset(r, 0, sizeof *r);
    json_t *o;
    kvs_err e = load_object(text, len, &o, errbuf, errlen);
    if (e) return e;
    if ((e = get_str(o, "model", true, r->model, sizeof r->model, errbuf, errlen)) ||
        (e = get_uint(o, "ring", false, 0, KVS_MARKET_MAX_RINGS - 1, &r->ring, errbuf, errlen)) ||
        (e = get_uint(o, "begin", true, 0, KVS_PLAN_MAX_BLOCKS, &r->begin, errbuf, errlen)) ||
        (e = get_uint(o, "end", true, 0, KVS_PLAN_MAX_BLOCKS, &r->end, errbuf, errlen)) ||
        (e = get_str(o, "node", true, r->node, sizeof r->node, errbuf, errlen)) ||
        (e = get_str(o, "endpoint", false, r->endpoint, sizeof r->endpoint, errbuf, errlen)) ||
        (e = get_str(o, "relay", false, r->relay, sizeof r->relay, errbuf, errlen)) ||
        (e = get_str(o, "pubkey", false, r->pubkey, sizeof r->pubkey, errbuf, errlen)) ||
        (e = get_str(o, "api", false, r->api, sizeof r->api, errbuf, errlen)))
        goto out;
    if (!kvs_market_valid_name(r->model)) e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'model' is not a model name");
    else if (!kvs_market_valid_name(r->node))
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'node' must be 1..63 bytes of [A-Za-z0-9._-]");
    else if (r->begin >= r->end)
        e = fail(KVS_ERR_RANGE, errbuf, errlen, "window [%u,%u) is empty: begin must be < end", r->begin, r->end);
    else if (!r->endpoint[0] && !r->relay[0])
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "a claim needs an 'endpoint' (host:port) or a 'relay' edge");
    else if (r->endpoint[0] && !kvs_market_valid_addr(r->endpoint))
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'endpoint' must be host:port");
    else if (r->relay[0] && !kvs_market_valid_url(r->relay) && strncmp(r->relay, "ws", 2))
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'relay' must be a URL");
    else if (r->api[0] && !kvs_market_valid_url(r->api))
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'api' must be an http:// URL");
    for (const char *p = r->pubkey; !e && *p; p++)
        if ((unsigned char)*p < ' ' || (unsigned char)*p >= 0x7f)
            e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'pubkey' must be printable ASCII");
out:
    json_decref(o);
    return e;
}

static kvs_err get_token(json_t *o, char *dst, char *errbuf, size_t errlen)
{
    kvs_err e = get_str(o, "token", true, dst, KVS_MARKET_TOKEN_LEN + 1, errbuf, errlen);
    if (e == KVS_ERR_RANGE || (!e && !valid_token(dst)))
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'token' must be %d lower-case hex digits",
                    KVS_MARKET_TOKEN_LEN);
    return e;
}

kvs_err kvs_market_parse_renew(const char *text, size_t len, struct kvs_market_renew_req *r, char *errbuf,
                               size_t errlen)
{
    memset(r, 0, sizeof *r);
    json_t *o;
    kvs_err e = load_object(text, len, &o, errbuf, errlen);
    if (e) return e;
    if ((e = get_token(o, r->token, errbuf, errlen))) goto out;
    json_t *v = json_object_get(o, "ready");
    if (v && !json_is_null(v)) {
        if (!json_is_boolean(v)) {
            e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'ready' must be a boolean");
            goto out;
        }
        r->has_ready = true;
        r->ready = json_is_true(v);
    }
    v = json_object_get(o, "tps");
    if (v && !json_is_null(v)) {
        if (!json_is_number(v)) {
            e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'tps' must be a number");
            goto out;
        }
        double x = json_number_value(v);
        if (!(x >= 0 && x <= 1e9)) {
            e = fail(KVS_ERR_RANGE, errbuf, errlen, "field 'tps' = %g is outside 0..1e9", x);
            goto out;
        }
        r->has_tps = true;
        r->tps = x;
    }
    if (json_object_get(o, "queued") && !json_is_null(json_object_get(o, "queued"))) {
        if ((e = get_uint(o, "queued", true, 0, 1000000, &r->queued, errbuf, errlen))) goto out;
        r->has_queued = true;
    }
    if (json_object_get(o, "api") && !json_is_null(json_object_get(o, "api"))) {
        if ((e = get_str(o, "api", true, r->api, sizeof r->api, errbuf, errlen))) goto out;
        if (r->api[0] && !kvs_market_valid_url(r->api)) {
            e = fail(KVS_ERR_FORMAT, errbuf, errlen, "field 'api' must be an http:// URL");
            goto out;
        }
        r->has_api = true;
    }
out:
    json_decref(o);
    return e;
}

kvs_err kvs_market_parse_release(const char *text, size_t len, struct kvs_market_release_req *r, char *errbuf,
                                 size_t errlen)
{
    memset(r, 0, sizeof *r);
    json_t *o;
    kvs_err e = load_object(text, len, &o, errbuf, errlen);
    if (e) return e;
    e = get_token(o, r->token, errbuf, errlen);
    json_decref(o);
    return e;
}

double kvs_market_demand(uint64_t queued, double tps)
{
    if (!(tps >= 0)) tps = 0;
    return 1.0 + (double)queued + tps / 100.0;
}

double kvs_market_reward(double demand, uint32_t blocks, uint32_t covered, uint32_t n_block)
{
    if (n_block == 0) return 0;
    if (covered > n_block) covered = n_block;
    double c = (double)covered / n_block;
    return demand * ((double)blocks / n_block) * (1.0 + 3.0 * c);
}

/* --- profile --------------------------------------------------------------- */

char *kvs_market_profile_json(const struct kvs_plan_model *m)
{
    json_t *blocks = json_array();
    for (uint32_t i = 0; blocks && i < m->n_block; i++)
        json_array_append_new(blocks, json_pack("[IIII]", (json_int_t)m->block_weight_bytes[i],
                                                (json_int_t)m->block_stream_bytes[i], (json_int_t)m->block_kv_bytes[i],
                                                (json_int_t)m->block_state_bytes[i]));
    json_t *o = json_pack("{sI sI sI sI sI sI sI sI sI sI so}", "n_block", (json_int_t)m->n_block, "n_embd",
                          (json_int_t)m->n_embd, "n_vocab", (json_int_t)m->n_vocab, "ctx_train",
                          (json_int_t)m->ctx_train, "common", (json_int_t)m->common_bytes, "head",
                          (json_int_t)m->head_bytes, "head_stream", (json_int_t)m->head_stream_bytes, "tail",
                          (json_int_t)m->tail_bytes, "tail_stream", (json_int_t)m->tail_stream_bytes, "tied",
                          (json_int_t)m->tied_bytes, "blocks", blocks);
    if (!o) return NULL;
    if (m->content_id[0]) json_object_set_new(o, "content_id", json_string(m->content_id));
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static bool get_u64(json_t *o, const char *key, uint64_t max, uint64_t *dst)
{
    json_t *v = json_object_get(o, key);
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) > max) return false;
    *dst = (uint64_t)json_integer_value(v);
    return true;
}

static kvs_err profile_from(json_t *o, struct kvs_plan_model *m, char *errbuf, size_t errlen)
{
    memset(m, 0, sizeof *m);
    const uint64_t big = 1ull << 52;
    uint64_t nb = 0, ne = 0, nv = 0, ct = 0;
    if (!json_is_object(o) || !get_u64(o, "n_block", KVS_PLAN_MAX_BLOCKS, &nb) || nb == 0 ||
        !get_u64(o, "n_embd", 1u << 24, &ne) || !get_u64(o, "n_vocab", 1u << 24, &nv) ||
        !get_u64(o, "ctx_train", UINT32_MAX, &ct) || !get_u64(o, "common", big, &m->common_bytes) ||
        !get_u64(o, "head", big, &m->head_bytes) || !get_u64(o, "head_stream", big, &m->head_stream_bytes) ||
        !get_u64(o, "tail", big, &m->tail_bytes) || !get_u64(o, "tail_stream", big, &m->tail_stream_bytes) ||
        !get_u64(o, "tied", big, &m->tied_bytes))
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "profile: a field is missing or out of range");
    m->n_block = (uint32_t)nb;
    m->n_embd = (uint32_t)ne;
    m->n_vocab = (uint32_t)nv;
    m->ctx_train = (uint32_t)ct;
    json_t *cid = json_object_get(o, "content_id");
    if (cid && (!json_is_string(cid) || json_string_length(cid) != 64 || !valid_cid(json_string_value(cid))))
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "profile: 'content_id' must be 64 lower-case hex digits");
    if (cid) memcpy(m->content_id, json_string_value(cid), 65);
    json_t *b = json_object_get(o, "blocks");
    if (!json_is_array(b) || json_array_size(b) != nb)
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "profile: 'blocks' must be an array of n_block entries");
    for (size_t i = 0; i < nb; i++) {
        json_t *e = json_array_get(b, i);
        uint64_t v[4];
        for (size_t k = 0; k < 4; k++) {
            json_t *x = json_array_get(e, k);
            if (!json_is_array(e) || json_array_size(e) != 4 || !json_is_integer(x) || json_integer_value(x) < 0 ||
                (uint64_t)json_integer_value(x) > big)
                return fail(KVS_ERR_FORMAT, errbuf, errlen, "profile: block %zu must be [weights, stream, kv, state]",
                            i);
            v[k] = (uint64_t)json_integer_value(x);
        }
        m->block_weight_bytes[i] = v[0];
        m->block_stream_bytes[i] = v[1];
        m->block_kv_bytes[i] = v[2];
        m->block_state_bytes[i] = v[3];
    }
    return KVS_OK;
}

kvs_err kvs_market_profile_parse(const char *text, size_t len, struct kvs_plan_model *m, char *errbuf, size_t errlen)
{
    json_error_t je;
    json_t *o = json_loadb(text, len, 0, &je);
    if (!o) return fail(KVS_ERR_FORMAT, errbuf, errlen, "profile: malformed JSON: %s", je.text);
    kvs_err e = profile_from(o, m, errbuf, errlen);
    json_decref(o);
    return e;
}

/* --- the map ----------------------------------------------------------------- */

static void copy_str(json_t *o, const char *key, char *dst, size_t cap)
{
    const char *s = json_string_value(json_object_get(o, key));
    snprintf(dst, cap, "%s", s ? s : "");
}

static kvs_err parse_listing(json_t *o, struct kvs_market_listing *l, char *errbuf, size_t errlen)
{
    uint64_t v;
    copy_str(o, "name", l->name, sizeof l->name);
    copy_str(o, "fingerprint", l->fingerprint, sizeof l->fingerprint);
    copy_str(o, "url", l->url, sizeof l->url);
    copy_str(o, "index", l->index, sizeof l->index);
    if (!kvs_market_valid_name(l->name)) return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: a model without a name");
    if (!get_u64(o, "n_block", KVS_PLAN_MAX_BLOCKS, &v) || v == 0)
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: bad n_block", l->name);
    l->n_block = (uint32_t)v;
    if (!get_u64(o, "rings", KVS_MARKET_MAX_RINGS, &v) || v == 0)
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: bad rings", l->name);
    l->rings = (uint32_t)v;
    l->ctx = get_u64(o, "ctx", 16777216, &v) ? (uint32_t)v : 0;
    l->seqs = get_u64(o, "seqs", 4096, &v) && v ? (uint32_t)v : 4;
    const char *b = json_string_value(json_object_get(o, "boundary"));
    l->boundary_f32 = !b || strcmp(b, "f16"); /* f32 unless the listing says f16 */
    json_t *d = json_object_get(o, "demand");
    l->demand = json_is_number(json_object_get(d, "value")) ? json_number_value(json_object_get(d, "value")) : 1.0;
    l->profile = malloc(sizeof *l->profile);
    if (!l->profile) return KVS_ERR_NOMEM;
    kvs_err e = profile_from(json_object_get(o, "profile"), l->profile, errbuf, errlen);
    if (e) return e;
    if (l->profile->n_block != l->n_block)
        return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: profile has another block count", l->name);
    snprintf(l->profile->fingerprint, sizeof l->profile->fingerprint, "%s", l->fingerprint);
    snprintf(l->content_id, sizeof l->content_id, "%s", l->profile->content_id);
    json_t *rings = json_object_get(o, "coverage");
    if (!json_is_array(rings)) return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: no coverage", l->name);
    size_t nc = 0, ng = 0, ri;
    json_t *r;
    json_array_foreach(rings, ri, r) {
        nc += json_array_size(json_object_get(r, "claims"));
        ng += json_array_size(json_object_get(r, "gaps"));
    }
    l->claims = calloc(nc ? nc : 1, sizeof *l->claims);
    l->gaps = calloc(ng ? ng : 1, sizeof *l->gaps);
    if (!l->claims || !l->gaps) return KVS_ERR_NOMEM;
    json_array_foreach(rings, ri, r) {
        uint64_t ring;
        if (!get_u64(r, "ring", KVS_MARKET_MAX_RINGS - 1, &ring))
            return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: bad ring number", l->name);
        size_t i;
        json_t *c;
        json_array_foreach(json_object_get(r, "claims"), i, c) {
            struct kvs_market_claim *k = &l->claims[l->n_claims];
            uint64_t bb, ee;
            json_t *id = json_object_get(c, "id");
            if (!get_u64(c, "begin", l->n_block, &bb) || !get_u64(c, "end", l->n_block, &ee) || bb >= ee ||
                !json_is_integer(id))
                return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: bad claim", l->name);
            k->id = json_integer_value(id);
            k->ring = (uint32_t)ring;
            k->begin = (uint32_t)bb;
            k->end = (uint32_t)ee;
            copy_str(c, "node", k->node, sizeof k->node);
            copy_str(c, "endpoint", k->endpoint, sizeof k->endpoint);
            copy_str(c, "relay", k->relay, sizeof k->relay);
            copy_str(c, "pubkey", k->pubkey, sizeof k->pubkey);
            copy_str(c, "api", k->api, sizeof k->api);
            k->ready = json_is_true(json_object_get(c, "ready"));
            json_t *x = json_object_get(c, "expires_ms");
            k->expires_ms = json_is_integer(x) ? json_integer_value(x) : 0;
            l->n_claims++;
        }
        json_array_foreach(json_object_get(r, "gaps"), i, c) {
            struct kvs_market_gap *g = &l->gaps[l->n_gaps];
            uint64_t bb, ee;
            json_t *rw = json_object_get(c, "reward");
            if (!get_u64(c, "begin", l->n_block, &bb) || !get_u64(c, "end", l->n_block, &ee) || bb >= ee ||
                !json_is_number(rw))
                return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: %s: bad gap", l->name);
            g->ring = (uint32_t)ring;
            g->begin = (uint32_t)bb;
            g->end = (uint32_t)ee;
            g->reward = json_number_value(rw);
            l->n_gaps++;
        }
    }
    return KVS_OK;
}

kvs_err kvs_market_map_parse(const char *text, size_t len, struct kvs_market_map *map, char *errbuf, size_t errlen)
{
    memset(map, 0, sizeof *map);
    json_error_t je;
    json_t *o = json_loadb(text, len, 0, &je);
    if (!o) return fail(KVS_ERR_FORMAT, errbuf, errlen, "map: malformed JSON: %s", je.text);
    kvs_err e = KVS_OK;
    json_t *models = json_object_get(o, "models");
    if (!json_is_object(o) || !json_is_array(models) || json_array_size(models) > KVS_MARKET_MAX_LISTINGS) {
        e = fail(KVS_ERR_FORMAT, errbuf, errlen, "map: not a market map (no 'models' array)");
        goto out;
    }
    json_t *x = json_object_get(o, "now_ms");
    map->now_ms = json_is_integer(x) ? json_integer_value(x) : 0;
    x = json_object_get(o, "lease_ms");
    map->lease_ms = json_is_integer(x) ? json_integer_value(x) : 0;
    map->listings = calloc(json_array_size(models) + 1, sizeof *map->listings);
    if (!map->listings) {
        e = KVS_ERR_NOMEM;
        goto out;
    }
    size_t i;
    json_t *mo;
    json_array_foreach(models, i, mo) {
        map->n_listings++;
        if ((e = parse_listing(mo, &map->listings[i], errbuf, errlen))) break;
    }
out:
    json_decref(o);
    if (e) kvs_market_map_free(map);
    return e;
}

void kvs_market_map_free(struct kvs_market_map *map)
{
    if (!map) return;
    for (size_t i = 0; i < map->n_listings; i++) {
        free(map->listings[i].profile);
        free(map->listings[i].claims);
        free(map->listings[i].gaps);
    }
    free(map->listings);
    memset(map, 0, sizeof *map);
}

kvs_err kvs_market_choose(const struct kvs_market_map *map, uint64_t mem_bytes, struct kvs_market_choice *c)
{
    memset(c, 0, sizeof *c);
    bool found = false;
    uint64_t least = 0;
    for (size_t li = 0; li < map->n_listings; li++) {
        const struct kvs_market_listing *l = &map->listings[li];
        struct kvs_plan_targets t = kvs_plan_default_targets();
        t.ctx = l->ctx ? l->ctx : kvs_plan_default_ctx(l->profile);
        t.seqs = l->seqs;
        t.boundary_bytes = l->boundary_f32 ? 4 : 2;
        for (size_t gi = 0; gi < l->n_gaps; gi++) {
            const struct kvs_market_gap *g = &l->gaps[gi];
            uint32_t covered = l->n_block;
            for (size_t k = 0; k < l->n_gaps; k++)
                if (l->gaps[k].ring == g->ring) covered -= l->gaps[k].end - l->gaps[k].begin;
            uint64_t first = kvs_plan_window_mem(l->profile, &t, g->begin, g->begin + 1);
            if (!least || first < least) least = first;
            uint32_t best_end = 0;
            uint64_t best_mem = 0;
            for (uint32_t b = g->begin + 1; b <= g->end; b++) {
                uint64_t need = kvs_plan_window_mem(l->profile, &t, g->begin, b);
                if (need > mem_bytes) break;
                best_end = b;
                best_mem = need;
            }
            if (!best_end) continue;
            double rw = kvs_market_reward(l->demand, best_end - g->begin, covered, l->n_block);
            if (!found || rw > c->reward * (1 + 1e-12)) {
                found = true;
                c->listing = li;
                c->ring = g->ring;
                c->begin = g->begin;
                c->end = best_end;
                c->mem_bytes = best_mem;
                c->reward = rw;
            }
        }
    }
    if (!found) {
        c->mem_bytes = least;
        return KVS_ERR_NOT_FOUND;
    }
    return KVS_OK;
}

const struct kvs_market_claim *kvs_market_claim_at(const struct kvs_market_listing *l, uint32_t ring, uint32_t begin)
{
    for (size_t i = 0; i < l->n_claims; i++)
        if (l->claims[i].ring == ring && l->claims[i].begin == begin) return &l->claims[i];
    return NULL;
}

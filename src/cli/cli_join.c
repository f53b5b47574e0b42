/* kvasir join: a node enrolls itself through the market (docs/MARKET.md).
 *
 *   read GET /map -> pick the uncovered window with the highest reward that
 *   fits --mem (kvs_market_choose) -> claim it (a lost race: pick again) ->
 *   fetch only that window (kvs_shard_fetch: verified, resumable, cached in
 *   --cache) -> wait until the map names a successor (the claim whose window
 *   begins where this one ends; the tail's is the head) -> run the stage in
 *   this process (the head also serves the OpenAI API) -> renew the lease
 *   every lease/3, reporting ready / tokens/s / queue -> re-point the
 *   successor when the map changes -> release the claim on SIGINT/SIGTERM.
 *
 * A renewal answered "unknown claim" (the lease ran out, e.g. while the
 * market was down) claims the same window again; if another node took it
 * meanwhile the stage stops and the node picks again. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "api/api.h"
#include "cli/cli.h"
#include "common/log.h"
#include "common/rng.h"
#include "link/link.h"
#include "market/market.h"
#include "plan/plan.h"
#include "shard/shard.h"
#include "stage/stage.h"

static void join_usage(FILE *f)
{
    fprintf(f, "usage: kvasir join --market URL [--mem BYTES] [--threads N] [--listen ADDR | --relay URL] [--cache DIR]\n"
               "                   [--name NODE] [--api PORT] [--poll-ms MS] [--key FILE] [--relay-ca PEM | --relay-pin HEX]\n"
               "  --mem BYTES     memory budget for weights + KV cache + buffers (suffix K, M or G: KiB, MiB, GiB;\n"
               "                  default MemAvailable)\n"
               "  --threads N     compute threads of the stage (default 2)\n"
               "  --listen ADDR   HOST:PORT the stage accepts its predecessor on (default 127.0.0.1:0, a free port)\n"
               "  --relay URL     accept no connection: both links dial out, the in link through this relay\n"
               "                  (ws[s]://HOST[:PORT]; the market names the edge and hands out its token)\n"
               "  --relay-ca PEM  trust this CA (or the relay's self-signed certificate) for wss:// links\n"
               "  --relay-pin HEX trust exactly the relay certificate with this SHA-256 (default: the market's pin)\n"
               "  --cache DIR     where fetched windows are kept (default $XDG_CACHE_HOME/kvasir or ~/.cache/kvasir)\n"
               "  --name NODE     node name on the map (default HOST-PID)\n"
               "  --api PORT      the head's OpenAI API port (default 0: any free port)\n"
               "  --poll-ms MS    how often the map is read (default 1000)\n"
               "  --key FILE      node key (kvasir key gen): its public key goes in the claim and the head signs\n"
               "                  its ring's receipts with it (docs/MARKET.md \"Ledger\"); default a fresh key\n"
               "                  for this run\n");
}

/* What the node keeps of its listing (copied out of a parsed map). */
struct pick {
    char model[KVS_MARKET_NAME_MAX];
    char fingerprint[65];
    char content_id[65]; /* the listing's, "" if none: the fetch and the stage check the weights against it */
    char url[KVS_MARKET_URL_MAX], index[KVS_MARKET_URL_MAX];
    uint32_t n_block, ring, begin, end, ctx, seqs;
    bool boundary_f32;
    uint64_t mem;
    double reward;
};

struct node {
    const char *market;
    char name[KVS_MARKET_NAME_MAX];
    char endpoint[KVS_MARKET_ADDR_MAX];   /* "host:port", "" with --relay */
    char host[64];
    const char *relay;                    /* --relay base URL, or NULL */
    const char *relay_ca;                 /* --relay-ca, or NULL */
    char relay_pin[65];                   /* --relay-pin, else the market's, or "" */
    bool pin_given;
    char relay_edge[KVS_MARKET_URL_MAX];  /* --relay: this claim's in-edge URL (no token) */
    char in_edge[KVS_MARKET_URL_MAX + 8 + KVS_RELAY_TOKEN_HEX]; /* ... with ?token=, the stage's listen */
    char out_edge_token[KVS_RELAY_TOKEN_HEX + 1]; /* the edge into the block after the window ("" unknown) */
    uint64_t mem;
    int threads;
    long api_port;
    int poll_ms;
    char cache[1024];
    int sfd;

    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool quit;
    bool have_claim, lost;
    int64_t claim_id, lease_ms;
    char token[KVS_MARKET_TOKEN_LEN + 1];
    struct pick pk;
    char api_url[KVS_MARKET_URL_MAX];
    struct kvs_stage *stage; /* for the renewal's report */
    uint64_t last_tokens;
    int64_t last_report_ms;
    bool market_down_logged;
    struct kvs_key *key;                 /* node key: its public half goes in the claim; the head signs receipts */
    char pub_hex[KVS_KEY_PUB_HEX + 1];
    uint64_t receipt_seq;                /* next receipt's seq (starts at the wall clock in ms: unique across restarts) */
    uint64_t receipted;                  /* tokens_generated already covered by an accepted receipt */
};

static int64_t mono_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits up to ms for a signal on sfd: true when one came (the node stops). */
static bool signalled(struct node *n, int ms)
{
    struct pollfd pfd = { .fd = n->sfd, .events = POLLIN };
    int r;
    while ((r = poll(&pfd, 1, ms)) < 0 && errno == EINTR) {
    }
    return r > 0;
}

/* POST body -> status + parsed reply (NULL on no answer). */
static json_t *call(struct node *n, const char *path, json_t *body, int *status, char *err, size_t errlen)
{
    char *b = body ? json_dumps(body, JSON_COMPACT) : NULL;
    char *reply = NULL;
    kvs_err e = kvs_market_call(n->market, body ? "POST" : "GET", path, b, 5000, status, &reply, err, errlen);
    free(b);
    if (e) return NULL;
    json_t *j = json_loads(reply, 0, NULL);
    if (!j) j = json_pack("{s{ss}}", "error", "message", reply);
    free(reply);
    return j;
}

static const char *error_message(json_t *j)
{
    const char *m = json_string_value(json_object_get(json_object_get(j, "error"), "message"));
    return m ? m : "?";
}

static kvs_err read_map(struct node *n, struct kvs_market_map *map, char *err, size_t errlen)
{
    int status = 0;
    char *reply = NULL;
    kvs_err e = kvs_market_call(n->market, "GET", "/map", NULL, 5000, &status, &reply, err, errlen);
    if (e) return e;
    if (status != 200) {
        snprintf(err, errlen, "GET /map: HTTP %d", status);
        free(reply);
        return KVS_ERR_NET;
    }
    e = kvs_market_map_parse(reply, strlen(reply), map, err, errlen);
    free(reply);
    return e;
}

static const struct kvs_market_listing *find_listing(const struct kvs_market_map *map, const char *name)
{
    for (size_t i = 0; i < map->n_listings; i++)
        if (!strcmp(map->listings[i].name, name)) return &map->listings[i];
    return NULL;
}

/* POST /v1/claims for n->pk; 201 -> claim held. Returns the status (0: no answer). */
static int claim(struct node *n, char *err, size_t errlen)
{
    json_t *b = json_pack("{ss sI sI sI ss ss ss}", "model", n->pk.model, "ring", (json_int_t)n->pk.ring, "begin",
                          (json_int_t)n->pk.begin, "end", (json_int_t)n->pk.end, "node", n->name, "pubkey", n->pub_hex,
                          "api", n->api_url);
    json_object_set_new(b, n->relay ? "relay" : "endpoint", json_string(n->relay ? n->relay : n->endpoint));
    int status = 0;
    json_t *r = call(n, "/v1/claims", b, &status, err, errlen);
    json_decref(b);
    if (!r) return 0;
    if (status == 201) {
        n->claim_id = json_integer_value(json_object_get(r, "id"));
        snprintf(n->token, sizeof n->token, "%s", json_string_value(json_object_get(r, "token")) ? json_string_value(json_object_get(r, "token")) : "");
        n->lease_ms = json_integer_value(json_object_get(r, "lease_ms"));
        if (n->lease_ms < 100) n->lease_ms = 100;
        n->have_claim = true;
        n->lost = false;
        n->out_edge_token[0] = '\0';
        const char *pin = json_string_value(json_object_get(r, "relay_pin"));
        if (pin && !n->pin_given) snprintf(n->relay_pin, sizeof n->relay_pin, "%s", pin);
        const char *ru = json_string_value(json_object_get(r, "relay"));
        const char *rt = json_string_value(json_object_get(r, "edge_token"));
        if (n->relay && (!ru || !rt)) {
            snprintf(err, errlen, "the market gave no relay edge for this claim (it needs --relay-secret)");
            n->have_claim = false;
            json_decref(r);
            return 400;
        }
        if (n->relay) {
            snprintf(n->relay_edge, sizeof n->relay_edge, "%s", ru);
            snprintf(n->in_edge, sizeof n->in_edge, "%s?token=%s", ru, rt);
        }
    } else {
        snprintf(err, errlen, "%s", error_message(r));
    }
    json_decref(r);
    return status;
}

static void release(struct node *n)
{
    pthread_mutex_lock(&n->mu);
    if (!n->have_claim) {
        pthread_mutex_unlock(&n->mu);
        return;
    }
    char path[96], err[256];
    snprintf(path, sizeof path, "/v1/claims/%" PRId64 "/release", n->claim_id);
    json_t *b = json_pack("{ss}", "token", n->token);
    n->have_claim = false;
    pthread_mutex_unlock(&n->mu);
    int status = 0;
    json_t *r = call(n, path, b, &status, err, sizeof err);
    json_decref(b);
    if (status == 200) KVS_LOGI("join: released claim %" PRId64 " (%s [%u,%u))", n->claim_id, n->pk.model, n->pk.begin, n->pk.end);
    else KVS_LOGW("join: release of claim %" PRId64 ": %s", n->claim_id, r ? error_message(r) : err);
    json_decref(r);
}

/* One renewal (caller holds mu; it is dropped around the HTTP call). */
static void renew_once(struct node *n)
{
    char path[96], err[256];
    snprintf(path, sizeof path, "/v1/claims/%" PRId64 "/renew", n->claim_id);
    json_t *b = json_pack("{ss}", "token", n->token);
    if (n->stage) {
        struct kvs_stage_metrics mt;
        kvs_stage_metrics(n->stage, &mt);
        int64_t now = mono_ms();
        double tps = 0;
        if (n->last_report_ms && now > n->last_report_ms)
            tps = (double)(mt.tokens_generated - n->last_tokens) * 1000.0 / (double)(now - n->last_report_ms);
        n->last_tokens = mt.tokens_generated;
        n->last_report_ms = now;
        json_object_set_new(b, "ready", json_boolean(mt.ring_ready));
        if (kvs_stage_is_head(n->stage)) {
            json_object_set_new(b, "tps", json_real(tps));
            json_object_set_new(b, "queued", json_integer(mt.n_queued + mt.n_active));
        }
    }
    if (n->api_url[0]) json_object_set_new(b, "api", json_string(n->api_url));
    pthread_mutex_unlock(&n->mu);
    int status = 0;
    json_t *r = call(n, path, b, &status, err, sizeof err);
    json_decref(b);
    pthread_mutex_lock(&n->mu);
    if (!r) {
        if (!n->market_down_logged) KVS_LOGW("join: cannot renew (the ring keeps serving): %s", err);
        n->market_down_logged = true;
        return;
    }
    if (n->market_down_logged) KVS_LOGI("join: the market answers again");
    n->market_down_logged = false;
    if (status == 404 && n->have_claim) {
        /* the lease ran out: take the same window again if it is still free */
        int64_t old = n->claim_id;
        int st = claim(n, err, sizeof err);
        if (st == 201) {
            KVS_LOGI("join: claim %" PRId64 " had expired; claimed [%u,%u) again as %" PRId64, old, n->pk.begin,
                     n->pk.end, n->claim_id);
        } else if (st) {
            KVS_LOGW("join: claim %" PRId64 " expired and [%u,%u) is taken: %s", old, n->pk.begin, n->pk.end, err);
            n->have_claim = false;
            n->lost = true;
        }
    } else if (status == 403) {
        KVS_LOGW("join: claim %" PRId64 " is not ours any more", n->claim_id);
        n->have_claim = false;
        n->lost = true;
    } else if (status != 200) {
        KVS_LOGW("join: renewal: HTTP %d: %s", status, error_message(r));
    }
    json_decref(r);
}

/* The head's receipt (docs/MARKET.md "Ledger"): the tokens its ring generated since the last
 * accepted receipt, with the claims the map shows holding the ring's windows, signed with the node
 * key. Refused ones (the ring not fully claimed in the map yet) are retried with the next renewal.
 * Caller holds mu; it is dropped around the HTTP calls. */
static void receipt_once(struct node *n)
{
    if (!n->stage || !kvs_stage_is_head(n->stage) || !n->key) return;
    struct kvs_stage_metrics mt;
    kvs_stage_metrics(n->stage, &mt);
    if (mt.tokens_generated <= n->receipted) return;
    uint64_t tokens = mt.tokens_generated - n->receipted;
    if (tokens > KVS_MARKET_MAX_RECEIPT_TOKENS) tokens = KVS_MARKET_MAX_RECEIPT_TOKENS;
    struct kvs_market_receipt *r = calloc(1, sizeof *r);
    if (!r) return;
    snprintf(r->model, sizeof r->model, "%s", n->pk.model);
    snprintf(r->content_id, sizeof r->content_id, "%s", n->pk.content_id);
    r->ring = n->pk.ring;
    r->seq = n->receipt_seq;
    r->tokens = tokens;
    kvs_key_public(n->key, r->head);
    pthread_mutex_unlock(&n->mu);
    char err[256];
    struct kvs_market_map map;
    char *body = NULL;
    int status = 0;
    if (read_map(n, &map, err, sizeof err) == KVS_OK) {
        const struct kvs_market_listing *l = find_listing(&map, r->model);
        for (size_t i = 0; l && i < l->n_claims && r->n_ranks < KVS_MARKET_MAX_RECEIPT_RANKS; i++)
            if (l->claims[i].ring == r->ring)
                r->ranks[r->n_ranks++] =
                    (struct kvs_market_receipt_rank){ l->claims[i].id, l->claims[i].begin, l->claims[i].end };
        kvs_market_map_free(&map);
        char *reply = NULL;
        if (r->n_ranks && kvs_market_receipt_sign(r, n->key, &body) == KVS_OK &&
            kvs_market_call(n->market, "POST", "/v1/receipts", body, 5000, &status, &reply, err, sizeof err) == KVS_OK &&
            status != 200 && status != 201)
            KVS_LOGI("join: receipt %" PRIu64 " for %" PRIu64 " tokens refused (HTTP %d): %s", r->seq, tokens, status,
                     reply ? reply : "");
        free(reply);
    }
    free(body);
    pthread_mutex_lock(&n->mu);
    if (status == 200 || status == 201) {
        n->receipted += tokens;
        n->receipt_seq++;
        KVS_LOGD("join: receipt %" PRIu64 ": %" PRIu64 " tokens over %zu windows", r->seq, tokens, r->n_ranks);
    }
    free(r);
}

static void *renew_thread(void *arg)
{
    struct node *n = arg;
    pthread_mutex_lock(&n->mu);
    while (!n->quit) {
        int64_t period = n->have_claim ? n->lease_ms / 3 : 200;
        if (period < 50) period = 50;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += period / 1000;
        ts.tv_nsec += (period % 1000) * 1000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&n->cv, &n->mu, &ts);
        if (n->quit) break;
        if (n->have_claim) renew_once(n);
        if (n->have_claim && !n->quit) receipt_once(n);
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

static void *stage_thread(void *arg)
{
    kvs_stage_run(arg);
    return NULL;
}

/* n's neighbours in the map: the successor (the claim whose window begins where n's ends; the
 * tail's is the head's) with the address its predecessor dials (its relay edge URL, or
 * host:port) and both neighbours' node keys (the predecessor: the claim whose window ends where
 * n's begins; the head's is the tail's). A neighbour whose claim publishes no valid key counts
 * as missing: every link of a market-formed ring is TLS between node keys. */
struct nbrs {
    bool have_next, have_prev;
    bool next_relay;                     /* the successor links through a relay edge */
    char next[KVS_MARKET_URL_MAX];       /* without a token */
    uint8_t next_key[KVS_KEY_PUB_BYTES], prev_key[KVS_KEY_PUB_BYTES];
    char missing[160];                   /* why one is missing, for the log */
};

static void neighbours(struct node *n, const struct kvs_market_map *map, struct nbrs *o)
{
    memset(o, 0, sizeof *o);
    const struct kvs_market_listing *l = find_listing(map, n->pk.model);
    if (!l) {
        snprintf(o->missing, sizeof o->missing, "model %s is not listed", n->pk.model);
        return;
    }
    uint32_t nb = n->pk.end == n->pk.n_block ? 0 : n->pk.end, pe = n->pk.begin == 0 ? n->pk.n_block : n->pk.begin;
    const struct kvs_market_claim *c = kvs_market_claim_at(l, n->pk.ring, nb), *pc = NULL;
    for (size_t i = 0; i < l->n_claims; i++)
        if (l->claims[i].ring == n->pk.ring && l->claims[i].end == pe) pc = &l->claims[i];
    if (c && (c->relay[0] || c->endpoint[0]) && kvs_key_parse_public(c->pubkey, o->next_key) == KVS_OK) {
        o->have_next = true;
        o->next_relay = c->relay[0] != '\0';
        snprintf(o->next, sizeof o->next, "%s", c->relay[0] ? c->relay : c->endpoint);
    }
    if (pc && kvs_key_parse_public(pc->pubkey, o->prev_key) == KVS_OK) o->have_prev = true;
    if (!c) snprintf(o->missing, sizeof o->missing, "a node to claim the blocks from %u", nb);
    else if (!o->have_next) snprintf(o->missing, sizeof o->missing, "node %s (blocks from %u) publishes no node key", c->node, nb);
    else if (!pc) snprintf(o->missing, sizeof o->missing, "a node to claim the blocks up to %u", pe);
    else if (!o->have_prev) snprintf(o->missing, sizeof o->missing, "node %s (blocks up to %u) publishes no node key", pc->node, pe);
}

/* The address the stage dials for nb's successor: host:port as it is, a relay edge URL with the
 * edge's token, which the market hands to the holder of this window (POST /v1/claims/ID/edge,
 * asked once per claim). Errors: KVS_ERR_NET / KVS_ERR_ARG (no token: logged; retried next poll). */
static kvs_err next_address(struct node *n, const struct nbrs *nb, char *out, size_t cap)
{
    if (!nb->next_relay) {
        snprintf(out, cap, "%s", nb->next);
        return KVS_OK;
    }
    pthread_mutex_lock(&n->mu);
    bool have = n->out_edge_token[0] != '\0';
    char path[96];
    snprintf(path, sizeof path, "/v1/claims/%" PRId64 "/edge", n->claim_id);
    json_t *b = json_pack("{ss}", "token", n->token);
    pthread_mutex_unlock(&n->mu);
    if (!have) {
        char err[256];
        int status = 0;
        json_t *r = call(n, path, b, &status, err, sizeof err);
        const char *t = r ? json_string_value(json_object_get(r, "edge_token")) : NULL;
        const char *pin = r ? json_string_value(json_object_get(r, "relay_pin")) : NULL;
        if (status != 200 || !t || strlen(t) != KVS_RELAY_TOKEN_HEX) {
            KVS_LOGW("join: no token for the relay edge of the successor %s: %s", nb->next,
                     r ? error_message(r) : err);
            json_decref(r);
            json_decref(b);
            return r ? KVS_ERR_ARG : KVS_ERR_NET;
        }
        pthread_mutex_lock(&n->mu);
        snprintf(n->out_edge_token, sizeof n->out_edge_token, "%s", t);
        if (pin && !n->pin_given && !n->relay_pin[0]) snprintf(n->relay_pin, sizeof n->relay_pin, "%s", pin);
        pthread_mutex_unlock(&n->mu);
        json_decref(r);
    }
    json_decref(b);
    pthread_mutex_lock(&n->mu);
    int w = snprintf(out, cap, "%s?token=%s", nb->next, n->out_edge_token);
    pthread_mutex_unlock(&n->mu);
    return w < (int)cap ? KVS_OK : KVS_ERR_RANGE;
}

enum serve_end { SERVE_SIGNAL, SERVE_LOST, SERVE_ERROR };

static bool claim_lost(struct node *n)
{
    pthread_mutex_lock(&n->mu);
    bool l = n->lost;
    pthread_mutex_unlock(&n->mu);
    return l;
}

/* Runs the stage of the fetched shard until a signal or the claim is lost. */
static enum serve_end serve(struct node *n, const char *shard)
{
    bool solo = n->pk.begin == 0 && n->pk.end == n->pk.n_block;
    char err[1024], next[KVS_MARKET_URL_MAX + 8 + KVS_RELAY_TOKEN_HEX] = "";
    struct nbrs nb = { 0 };
    bool waiting_logged = false;
    while (!solo) { /* both neighbours and their keys first */
        struct kvs_market_map map;
        if (read_map(n, &map, err, sizeof err) == KVS_OK) {
            neighbours(n, &map, &nb);
            kvs_market_map_free(&map);
            if (nb.have_next && nb.have_prev && next_address(n, &nb, next, sizeof next) == KVS_OK) break;
        }
        if (!waiting_logged) KVS_LOGI("join: [%u,%u) waits for %s", n->pk.begin, n->pk.end, nb.missing[0] ? nb.missing : err);
        waiting_logged = true;
        if (signalled(n, n->poll_ms)) return SERVE_SIGNAL;
        if (claim_lost(n)) return SERVE_LOST;
    }
    struct kvs_stage_params p = kvs_stage_default_params();
    p.model_path = shard;
    p.block_begin = (int32_t)n->pk.begin;
    p.block_end = (int32_t)n->pk.end;
    p.listen = n->in_edge[0] ? n->in_edge : n->endpoint;
    p.next = solo ? NULL : next;
    p.relay_ca = n->relay_ca;
    p.relay_pin = n->relay_pin[0] ? n->relay_pin : NULL;
    p.n_threads = n->threads;
    p.n_ctx = (int32_t)n->pk.ctx;
    p.n_seq = (int32_t)n->pk.seqs;
    p.boundary_f32 = n->pk.boundary_f32;
    p.fingerprint = n->pk.fingerprint[0] ? n->pk.fingerprint : NULL;
    p.content_id = n->pk.content_id[0] ? n->pk.content_id : NULL;
    /* TLS between node keys (PROTOCOL.md §4): this node's key, the neighbours' from their claims */
    p.key = n->key;
    p.has_prev_key = p.has_next_key = !solo;
    memcpy(p.prev_key, nb.prev_key, sizeof p.prev_key);
    memcpy(p.next_key, nb.next_key, sizeof p.next_key);
    struct kvs_stage *s = NULL;
    kvs_err e = kvs_stage_create(&p, &s, err, sizeof err);
    if (e) {
        KVS_LOGE("join: cannot start the stage of [%u,%u): %s (%s)", n->pk.begin, n->pk.end, err, kvs_strerror(e));
        return SERVE_ERROR;
    }
    pthread_t th;
    if (pthread_create(&th, NULL, stage_thread, s)) {
        kvs_stage_free(s);
        return SERVE_ERROR;
    }
    struct kvs_api *api = NULL;
    if (kvs_stage_is_head(s)) {
        struct kvs_api_params ap = kvs_api_default_params();
        ap.port = (uint16_t)n->api_port;
        ap.bind_addr = n->host;
        ap.model_path = shard;
        ap.model_name = n->pk.model;
        e = kvs_api_start(s, &ap, &api, err, sizeof err);
        if (e) {
            KVS_LOGE("join: the head's API: %s (%s)", err, kvs_strerror(e));
            kvs_stage_stop(s);
            pthread_join(th, NULL);
            kvs_stage_free(s);
            return SERVE_ERROR;
        }
        pthread_mutex_lock(&n->mu);
        snprintf(n->api_url, sizeof n->api_url, "http://%s:%u", n->host, (unsigned)kvs_api_port(api));
        pthread_mutex_unlock(&n->mu);
        KVS_LOGI("join: API on %s", n->api_url);
    }
    pthread_mutex_lock(&n->mu);
    n->stage = s;
    n->last_report_ms = 0;
    pthread_cond_broadcast(&n->cv); /* report at once */
    pthread_mutex_unlock(&n->mu);
    char cut[sizeof next];
    snprintf(cut, sizeof cut, "%s", next);
    if (strstr(cut, "?token=")) *strstr(cut, "?token=") = '\0'; /* logs never show an edge token */
    KVS_LOGI("join: serving %s ring %u [%u,%u) on %s, next %s (TLS between node keys)", n->pk.model, n->pk.ring,
             n->pk.begin, n->pk.end, n->in_edge[0] ? n->relay_edge : n->endpoint, solo ? "(none)" : cut);
    enum serve_end why;
    for (;;) {
        if (signalled(n, n->poll_ms)) {
            why = SERVE_SIGNAL;
            break;
        }
        if (claim_lost(n)) {
            why = SERVE_LOST;
            break;
        }
        if (solo) continue;
        struct kvs_market_map map;
        if (read_map(n, &map, err, sizeof err) != KVS_OK) continue; /* the market is down: keep serving */
        struct nbrs now;
        neighbours(n, &map, &now);
        kvs_market_map_free(&map);
        char now_next[sizeof next];
        bool next_moved = now.have_next && (strcmp(now.next, nb.next) || memcmp(now.next_key, nb.next_key, sizeof nb.next_key));
        bool prev_moved = now.have_prev && memcmp(now.prev_key, nb.prev_key, sizeof nb.prev_key);
        if (next_moved && next_address(n, &now, now_next, sizeof now_next) != KVS_OK) next_moved = false;
        if (!next_moved && !prev_moved) continue;
        e = kvs_stage_set_neighbours(s, next_moved ? now_next : NULL, next_moved ? now.next_key : NULL,
                                     prev_moved ? now.prev_key : NULL, err, sizeof err);
        if (e) {
            KVS_LOGW("join: cannot re-point the neighbours of [%u,%u): %s", n->pk.begin, n->pk.end, err);
            continue;
        }
        if (next_moved) {
            KVS_LOGI("join: the successor of [%u,%u) is now %s (was %s)", n->pk.begin, n->pk.end, now.next, nb.next);
            snprintf(nb.next, sizeof nb.next, "%s", now.next);
            memcpy(nb.next_key, now.next_key, sizeof nb.next_key);
        }
        if (prev_moved) {
            KVS_LOGI("join: the predecessor of [%u,%u) has a new node key", n->pk.begin, n->pk.end);
            memcpy(nb.prev_key, now.prev_key, sizeof nb.prev_key);
        }
    }
    pthread_mutex_lock(&n->mu);
    n->stage = NULL;
    n->api_url[0] = '\0';
    pthread_mutex_unlock(&n->mu);
    kvs_api_stop(api);
    kvs_stage_stop(s);
    pthread_join(th, NULL);
    kvs_stage_free(s);
    return why;
}

/* A free TCP port on host, drawn below Linux's ephemeral range (as the
 * local ring does); 0 if none binds. */
static int free_port(const char *host)
{
    struct kvs_rng r;
    kvs_rng_seed(&r, (uint64_t)getpid() * 1000003u ^ (uint64_t)mono_ms());
    char addr[128], err[128];
    for (int i = 0; i < 64; i++) {
        int want = 20000 + (int)(kvs_rng_next(&r) % 12768u);
        snprintf(addr, sizeof addr, "%s:%d", host, want);
        struct kvs_listener *l;
        if (kvs_tcp_listen(addr, &l, err, sizeof err) == KVS_OK) {
            int p = kvs_listener_port(l);
            kvs_listener_close(l);
            return p;
        }
    }
    return 0;
}

static int parse_mem(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *s == '-') return -1;
    uint64_t mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1024, end++;
    else if (*end == 'M' || *end == 'm') mul = 1024 * 1024, end++;
    else if (*end == 'G' || *end == 'g') mul = 1024ull * 1024 * 1024, end++;
    if (*end || v == 0 || v > UINT64_MAX / mul) return -1;
    *out = v * mul;
    return 0;
}

static uint64_t mem_available(void)
{
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kb = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) break;
    fclose(f);
    return (uint64_t)kb * 1024;
}

static int mkdirs(const char *path)
{
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            if (mkdir(tmp, 0755) && errno != EEXIST) return -1;
            *p = '/';
        }
    return mkdir(tmp, 0755) && errno != EEXIST ? -1 : 0;
}

/* Reads the map and picks; 1 picked, 0 nothing fits (logged once), -1 no map. */
static int choose(struct node *n, bool *waiting_logged)
{
    struct kvs_market_map map;
    char err[512];
    kvs_err e = read_map(n, &map, err, sizeof err);
    if (e) {
        if (!*waiting_logged) KVS_LOGW("join: cannot read the map: %s (%s)", err, kvs_strerror(e));
        *waiting_logged = true;
        return -1;
    }
    struct kvs_market_choice c;
    e = kvs_market_choose(&map, n->mem, &c);
    if (e) {
        if (!*waiting_logged && c.mem_bytes)
            KVS_LOGI("join: waiting: no uncovered window fits %" PRIu64 " bytes (the smallest needs %" PRIu64 ")",
                     n->mem, c.mem_bytes);
        else if (!*waiting_logged)
            KVS_LOGI("join: waiting: every window of every listed model is claimed (a spare node)");
        *waiting_logged = true;
        kvs_market_map_free(&map);
        return 0;
    }
    const struct kvs_market_listing *l = &map.listings[c.listing];
    struct pick *pk = &n->pk;
    snprintf(pk->model, sizeof pk->model, "%s", l->name);
    snprintf(pk->fingerprint, sizeof pk->fingerprint, "%s", l->fingerprint);
    snprintf(pk->content_id, sizeof pk->content_id, "%s", l->content_id);
    snprintf(pk->url, sizeof pk->url, "%s", l->url);
    snprintf(pk->index, sizeof pk->index, "%s", l->index);
    pk->n_block = l->n_block;
    pk->ring = c.ring;
    pk->begin = c.begin;
    pk->end = c.end;
    pk->ctx = l->ctx;
    pk->seqs = l->seqs;
    pk->boundary_f32 = l->boundary_f32;
    pk->mem = c.mem_bytes;
    pk->reward = c.reward;
    kvs_market_map_free(&map);
    *waiting_logged = false;
    return 1;
}

/* Fetches the window of n->pk into the cache; the path goes to out. */
static kvs_err fetch(struct node *n, char *out, size_t cap)
{
    char fp16[17];
    snprintf(fp16, sizeof fp16, "%.16s", n->pk.fingerprint[0] ? n->pk.fingerprint : "nofp");
    if (snprintf(out, cap, "%s/%s-%s-%u-%u.gguf", n->cache, n->pk.model, fp16, n->pk.begin, n->pk.end) >= (int)cap)
        return KVS_ERR_RANGE;
    struct kvs_shard_fetch_params fp = kvs_shard_fetch_default_params();
    fp.url = n->pk.url;
    fp.begin = n->pk.begin;
    fp.end = n->pk.end;
    fp.out_path = out;
    fp.progress = 0;
    fp.content_id = n->pk.content_id[0] ? n->pk.content_id : NULL; /* the listing is the trust root */
    fp.initial_header = 64 * 1024; /* grows while the header is incomplete: a small model's first read
                                      must not be the whole file */
    char ix[KVS_MARKET_URL_MAX + 32];
    if (n->pk.index[0]) {
        fp.index = n->pk.index;
    } else {
        snprintf(ix, sizeof ix, "%s.kvindex.json", n->pk.url);
        fp.index = ix;
        fp.index_optional = true;
    }
    struct kvs_shard_fetch_stats st;
    char err[1024];
    int64_t t0 = mono_ms();
    kvs_err e = kvs_shard_fetch(&fp, &st, err, sizeof err);
    if (e) {
        KVS_LOGE("join: fetch of %s [%u,%u): %s (%s)", n->pk.model, n->pk.begin, n->pk.end, err, kvs_strerror(e));
        return e;
    }
    /* one line on stdout that tests and operators can read */
    printf("join: fetched %s [%u,%u): header_bytes=%" PRIu64 " data_bytes=%" PRIu64 " window_bytes=%" PRIu64
           " header_reused_bytes=%" PRIu64 " skipped_bytes=%" PRIu64 " verified=%s trusted=%s ms=%" PRId64 " -> %s\n",
           n->pk.model, n->pk.begin, n->pk.end, st.header_bytes, st.data_bytes, st.window_bytes, st.header_reused_bytes,
           st.skipped_bytes, st.verified ? "yes" : "no", st.trusted ? "yes" : "no", mono_ms() - t0, out);
    if (!st.verified)
        KVS_LOGW("join: %s [%u,%u) is UNVERIFIED: the seed has no shard index", n->pk.model, n->pk.begin, n->pk.end);
    fflush(stdout);
    return KVS_OK;
}

int kvs_cli_join(int argc, char **argv)
{
    struct node n = { .threads = 2, .poll_ms = 1000, .sfd = -1 };
    const char *listen = "127.0.0.1:0", *relay = NULL, *cache = NULL, *name = NULL, *key_path = NULL;
    for (int i = 1; i < argc; i += 2) { /* every option takes a value */
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            join_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir join: unknown option or missing value: %s\n", a);
            join_usage(stderr);
            return 2;
        }
        long lv = 0;
        int bad = 0;
        if (!strcmp(a, "--market")) n.market = v;
        else if (!strcmp(a, "--mem")) bad = parse_mem(v, &n.mem);
        else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            bad = kvs_cli_parse_long(v, 1, 512, &lv);
            n.threads = (int)lv;
        } else if (!strcmp(a, "--listen")) listen = v;
        else if (!strcmp(a, "--relay")) relay = v;
        else if (!strcmp(a, "--relay-ca")) n.relay_ca = v;
        else if (!strcmp(a, "--relay-pin")) {
            bad = strlen(v) != 64 || strspn(v, "0123456789abcdef") != 64;
            snprintf(n.relay_pin, sizeof n.relay_pin, "%s", v);
            n.pin_given = true;
        }
        else if (!strcmp(a, "--cache")) cache = v;
        else if (!strcmp(a, "--name")) name = v;
        else if (!strcmp(a, "--key")) key_path = v;
        else if (!strcmp(a, "--api")) bad = kvs_cli_parse_long(v, 0, 65535, &n.api_port);
        else if (!strcmp(a, "--poll-ms")) {
            bad = kvs_cli_parse_long(v, 50, 60000, &lv);
            n.poll_ms = (int)lv;
        } else {
            fprintf(stderr, "kvasir join: unknown option: %s\n", a);
            join_usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "kvasir join: bad value for %s: %s\n", a, v);
            return 2;
        }
    }
    if (!n.market) {
        fprintf(stderr, "kvasir join: --market URL is required\n");
        join_usage(stderr);
        return 2;
    }
    bool listen_given = strcmp(listen, "127.0.0.1:0") != 0;
    if (relay && listen_given) {
        fprintf(stderr, "kvasir join: --relay and --listen exclude each other (a relayed node listens on nothing)\n");
        return 2;
    }
    if (relay && !kvs_ws_is_url(relay)) {
        fprintf(stderr, "kvasir join: --relay must be the relay's ws[s]://HOST[:PORT]: %s\n", relay);
        return 2;
    }
    if (n.relay_ca && n.pin_given) {
        fprintf(stderr, "kvasir join: --relay-ca and --relay-pin exclude each other\n");
        return 2;
    }
    n.relay = relay;
    long lport = -1;
    const char *colon = strrchr(listen, ':');
    size_t hl = colon ? (size_t)(colon - listen) : 0;
    if (!hl || hl >= sizeof n.host || kvs_cli_parse_long(colon + 1, 0, 65535, &lport)) {
        fprintf(stderr, "kvasir join: --listen must be HOST:PORT (port 0: a free one): %s\n", listen);
        return 2;
    }
    memcpy(n.host, listen, hl);
    n.host[hl] = '\0';
    if (!relay) {
        uint16_t port = (uint16_t)lport;
        if (!port) port = (uint16_t)free_port(n.host);
        if (!port) {
            fprintf(stderr, "kvasir join: no free port on %s\n", n.host);
            return 1;
        }
        snprintf(n.endpoint, sizeof n.endpoint, "%s:%u", n.host, (unsigned)port);
    }
    if (!n.mem) n.mem = mem_available();
    if (name) {
        snprintf(n.name, sizeof n.name, "%s", name);
    } else {
        char h[64] = "node";
        gethostname(h, sizeof h - 1);
        h[sizeof h - 1] = '\0';
        for (char *p = h; *p; p++)
            if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '-')) *p = '-';
        snprintf(n.name, sizeof n.name, "%.40s-%d", h, (int)getpid());
    }
    if (!kvs_market_valid_name(n.name)) {
        fprintf(stderr, "kvasir join: --name must be 1..63 bytes of [A-Za-z0-9._-]: %s\n", n.name);
        return 2;
    }
    if (cache) snprintf(n.cache, sizeof n.cache, "%s", cache);
    else if (getenv("XDG_CACHE_HOME")) snprintf(n.cache, sizeof n.cache, "%s/kvasir", getenv("XDG_CACHE_HOME"));
    else snprintf(n.cache, sizeof n.cache, "%s/.cache/kvasir", getenv("HOME") ? getenv("HOME") : "/tmp");
    if (mkdirs(n.cache)) {
        fprintf(stderr, "kvasir join: cannot create the cache %s: %s\n", n.cache, strerror(errno));
        return 1;
    }

    {
        char kerr[256] = "";
        kvs_err ke = key_path ? kvs_key_load(key_path, &n.key, kerr, sizeof kerr) : kvs_key_generate(&n.key);
        if (ke) {
            fprintf(stderr, "kvasir join: --key %s: %s (%s)\n", key_path ? key_path : "(new)", kerr, kvs_strerror(ke));
            return 1;
        }
        uint8_t pub[KVS_KEY_PUB_BYTES];
        kvs_key_public(n.key, pub);
        kvs_key_public_hex(pub, n.pub_hex);
        struct timespec rt0;
        clock_gettime(CLOCK_REALTIME, &rt0);
        n.receipt_seq = (uint64_t)rt0.tv_sec * 1000u + (uint64_t)rt0.tv_nsec / 1000000u;
    }

    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, &old);
    n.sfd = signalfd(-1, &sigs, SFD_CLOEXEC);
    pthread_mutex_init(&n.mu, NULL);
    pthread_cond_init(&n.cv, NULL);
    pthread_t rt;
    if (pthread_create(&rt, NULL, renew_thread, &n)) {
        fprintf(stderr, "kvasir join: cannot start the renewal thread\n");
        return 1;
    }
    KVS_LOGI("join: node %s, memory %" PRIu64 " bytes, %s %s, market %s", n.name, n.mem, relay ? "relay" : "endpoint",
             relay ? relay : n.endpoint, n.market);
    int rc = 0;
    bool waiting_logged = false;
    for (;;) {
        int c = choose(&n, &waiting_logged);
        if (c <= 0) {
            if (signalled(&n, n.poll_ms)) break;
            continue;
        }
        char err[512];
        pthread_mutex_lock(&n.mu);
        int st = claim(&n, err, sizeof err);
        pthread_cond_broadcast(&n.cv);
        pthread_mutex_unlock(&n.mu);
        if (st == 409) {
            KVS_LOGI("join: lost the race for %s ring %u [%u,%u): %s; picking again", n.pk.model, n.pk.ring,
                     n.pk.begin, n.pk.end, err);
            continue;
        }
        if (st != 201) {
            KVS_LOGW("join: claim of %s [%u,%u) refused: %s%s", n.pk.model, n.pk.begin, n.pk.end, st ? "" : "no answer: ",
                     err);
            if (signalled(&n, n.poll_ms)) break;
            continue;
        }
        KVS_LOGI("join: claimed %s ring %u [%u,%u) as claim %" PRId64 " (reward %.4f, needs %" PRIu64 " of %" PRIu64
                 " bytes, lease %" PRId64 " ms)",
                 n.pk.model, n.pk.ring, n.pk.begin, n.pk.end, n.claim_id, n.pk.reward, n.pk.mem, n.mem, n.lease_ms);
        char shard[2048];
        if (fetch(&n, shard, sizeof shard)) {
            release(&n);
            rc = 1;
            break;
        }
        enum serve_end why = serve(&n, shard);
        if (why == SERVE_LOST) {
            KVS_LOGW("join: lost the claim on %s [%u,%u); picking again", n.pk.model, n.pk.begin, n.pk.end);
            continue;
        }
        release(&n);
        if (why == SERVE_ERROR) rc = 1;
        break;
    }
    release(&n);
    pthread_mutex_lock(&n.mu);
    n.quit = true;
    pthread_cond_broadcast(&n.cv);
    pthread_mutex_unlock(&n.mu);
    pthread_join(rt, NULL);
    KVS_LOGI("join: node %s leaves", n.name);
    kvs_key_free(n.key);
    close(n.sfd);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return rc;
}

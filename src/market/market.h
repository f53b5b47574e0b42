/* The self-enrollment market (docs/MARKET.md): the control plane where
 * operators list models and nodes claim the windows they serve.
 *
 * State (SQLite, one file, every change one transaction):
 *   - listings: a model (name, fingerprint, block count, seed URL, shard
 *     index URL, rings wanted, ctx / seqs / boundary of its stages) and its
 *     profile (per-block weight and KV bytes, read from the GGUF header as
 *     `kvasir plan --url` does, so that a node can size a window without
 *     reading the header itself);
 *   - claims: per model and ring, which node holds which window [begin, end),
 *     its link endpoint (direct "host:port" or a relay edge), its public key,
 *     its lease expiry, and what it last reported (ready, tokens/s, queued).
 *
 * Invariants: within one ring of one model the live claims never overlap (a
 * claim is inserted by one IMMEDIATE transaction that first checks for an
 * overlapping live claim: of two racing claims exactly one is granted);
 * a claim whose lease expired is gone from the map; only the holder of a
 * claim (who knows the token handed out with it) can renew or release it.
 *
 * Reward of an uncovered range (docs/MARKET.md "Demand and reward"):
 *   demand(m)      = 1 + queued(m) + tps(m) / 100
 *   completeness   = covered blocks of the ring / n_block
 *   reward([a,b))  = demand(m) * (b - a) / n_block * (1 + 3 * completeness)
 * queued(m), tps(m): sums over the live claims of model m of what their
 * holders last reported (heads report their queue and decode rate).
 *
 * Threads: kvs_market_handle may be called from any thread (one mutex around
 * the database). The HTTP server (kvs_market_start) runs on
 * libmicrohttpd's threads. */
#ifndef KVS_MARKET_H
#define KVS_MARKET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

struct kvs_plan_model;

#define KVS_MARKET_NAME_MAX 64        /* model / node name, bytes incl. NUL ([A-Za-z0-9._-]) */
#define KVS_MARKET_URL_MAX 1024       /* URLs, bytes incl. NUL */
#define KVS_MARKET_ADDR_MAX 128       /* "host:port", bytes incl. NUL */
#define KVS_MARKET_KEY_MAX 256        /* public key text (placeholder until node keys land) */
#define KVS_MARKET_TOKEN_LEN 32       /* claim token: 32 lower-case hex digits */
#define KVS_MARKET_MAX_BODY_DEFAULT (64u * 1024) /* request body cap, bytes (413 above) */
#define KVS_MARKET_MAX_RINGS 64       /* rings wanted per listing */
#define KVS_MARKET_MAX_LISTINGS 256
#define KVS_MARKET_LEASE_DEFAULT_MS 30000

/* --- requests (parsing only: no I/O; fuzzed by fuzz/fuzz_market.c) --------- */

/* POST /v1/listings. Defaults: name = the URL's file name without ".gguf",
 * index "" (then the node tries URL.kvindex.json), rings 1, ctx 0 (= the
 * model's default, min(context_length, 4096)), seqs 4, boundary f16. */
struct kvs_market_listing_req {
    char name[KVS_MARKET_NAME_MAX];
    char url[KVS_MARKET_URL_MAX];     /* http:// or https:// URL of the full GGUF */
    char index[KVS_MARKET_URL_MAX];   /* shard index URL or "" */
    char content_id[65];              /* the model's content id (docs/FORMATS.md), 64 lower-case hex, or "":
                                       * nodes fetch against it (the listing, not the seed, is the trust root) */
    uint32_t rings;                   /* 1..KVS_MARKET_MAX_RINGS */
    uint32_t ctx;                     /* 0 or 1..16777216 */
    uint32_t seqs;                    /* 1..4096 */
    bool boundary_f32;
};

/* POST /v1/claims. */
struct kvs_market_claim_req {
    char model[KVS_MARKET_NAME_MAX];
    uint32_t ring;                    /* 0..rings-1 (checked against the listing) */
    uint32_t begin, end;              /* window [begin, end), begin < end <= n_block (checked) */
    char node[KVS_MARKET_NAME_MAX];
    char endpoint[KVS_MARKET_ADDR_MAX]; /* "host:port" the stage accepts its predecessor on, or "" */
    char relay[KVS_MARKET_URL_MAX];   /* relay edge URL, or "" */
    char pubkey[KVS_MARKET_KEY_MAX];  /* node public key text, or "" */
    char api[KVS_MARKET_URL_MAX];     /* head: its OpenAI API base URL, or "" */
};

/* POST /v1/claims/ID/renew. Reported figures are optional. */
struct kvs_market_renew_req {
    char token[KVS_MARKET_TOKEN_LEN + 1];
    bool has_ready, ready;            /* head: its ring probe came back */
    bool has_tps;
    double tps;                       /* decode tokens/s, 0..1e9 */
    bool has_queued;
    uint32_t queued;                  /* requests waiting or running, 0..1e6 */
    bool has_api;
    char api[KVS_MARKET_URL_MAX];
};

/* POST /v1/claims/ID/release. */
struct kvs_market_release_req {
    char token[KVS_MARKET_TOKEN_LEN + 1];
};

/* Each parser takes a JSON object of len bytes (need not be NUL-terminated).
 * Unknown fields are ignored. Errors: KVS_ERR_FORMAT (malformed JSON, wrong
 * type, missing field, bad name or address: errbuf names the field),
 * KVS_ERR_RANGE (a number out of its range). */
kvs_err kvs_market_parse_listing(const char *text, size_t len, struct kvs_market_listing_req *r, char *errbuf,
                                 size_t errlen);
kvs_err kvs_market_parse_claim(const char *text, size_t len, struct kvs_market_claim_req *r, char *errbuf,
                               size_t errlen);
kvs_err kvs_market_parse_renew(const char *text, size_t len, struct kvs_market_renew_req *r, char *errbuf,
                               size_t errlen);
kvs_err kvs_market_parse_release(const char *text, size_t len, struct kvs_market_release_req *r, char *errbuf,
                                 size_t errlen);

/* A model or node name: 1..63 bytes of [A-Za-z0-9._-]. */
bool kvs_market_valid_name(const char *s);

/* The reward formula above. covered <= n_block, blocks = b - a. Returns 0 for
 * n_block 0. */
double kvs_market_reward(double demand, uint32_t blocks, uint32_t covered, uint32_t n_block);
/* demand = 1 + queued + tps / 100. */
double kvs_market_demand(uint64_t queued, double tps);

/* Profile <-> JSON ("profile" of a listing in /map; docs/MARKET.md):
 * {"n_block","n_embd","n_vocab","ctx_train","common","head","head_stream","tail",
 *  "tail_stream","tied","blocks":[[weight_bytes, stream_bytes, kv_bytes_per_token,
 *  state_bytes_per_sequence], ...]}.
 * kvs_market_profile_json returns a malloc'd string (NULL: no memory).
 * kvs_market_profile_parse fills *m (caller's storage; fingerprint copied from
 * fingerprint or ""); errors KVS_ERR_FORMAT / KVS_ERR_RANGE. */
char *kvs_market_profile_json(const struct kvs_plan_model *m);
kvs_err kvs_market_profile_parse(const char *text, size_t len, struct kvs_plan_model *m, char *errbuf,
                                 size_t errlen);

/* --- the service ----------------------------------------------------------- */

struct kvs_market_params {
    const char *db_path;    /* SQLite file (created if missing); ":memory:" for tests */
    int64_t lease_ms;       /* lease granted by a claim and by each renewal (default 30000) */
    size_t max_body;        /* request body cap (default KVS_MARKET_MAX_BODY_DEFAULT) */
    /* Relay edges (docs/MARKET.md "Relay claims"): the secret of the relay(s) whose edges this market
     * hands out (16..256 bytes, copied; NULL/0: claims naming a relay are refused), and the SHA-256
     * (64 hex) of the relay certificate's DER, handed to every claimant to trust it (NULL: none). */
    const uint8_t *relay_secret;
    size_t relay_secret_len;
    const char *relay_pin;
};
struct kvs_market_params kvs_market_default_params(void);

struct kvs_market; /* opaque: the database and (after kvs_market_start) the HTTP server */

/* Opens (or creates) the database and its tables. Claims that were live when
 * the market last ran get one lease of grace (expiry = max(expiry, now +
 * lease)): nodes could not renew while it was down. Errors: KVS_ERR_IO (cannot
 * open / not a market database), KVS_ERR_ARG (bad params), KVS_ERR_NOMEM. */
kvs_err kvs_market_open(const struct kvs_market_params *p, struct kvs_market **out, char *errbuf, size_t errlen);
/* Stops the HTTP server if started, closes the database, frees. NULL allowed. */
void kvs_market_close(struct kvs_market *m);

/* Starts the HTTP server on bind:port (IPv4; port 0 = any free port).
 * Errors: KVS_ERR_NET (cannot listen), KVS_ERR_ARG. */
kvs_err kvs_market_start(struct kvs_market *m, const char *bind, uint16_t port, char *errbuf, size_t errlen);
uint16_t kvs_market_port(const struct kvs_market *m);

/* A reply: HTTP status, body (malloc'd, NUL-terminated; caller frees) and its
 * content type (static string). */
struct kvs_market_reply {
    int status;
    char *body;
    const char *type;
};

/* --- receipts and the ledger (docs/MARKET.md "Ledger") ----------------------- */

#define KVS_MARKET_MAX_RECEIPT_TOKENS (1u << 20) /* tokens one receipt may claim */
#define KVS_MARKET_MAX_RECEIPT_RANKS 256         /* windows of one ring in a receipt */

/* What a ring's head signs: "its ring [0, n_block) served `tokens` tokens",
 * with the claims that held each window. seq is the head's own counter (>= 1),
 * unique per head key: the market credits a (head, seq) once. */
struct kvs_market_receipt_rank {
    int64_t claim;           /* claim id from the map */
    uint32_t begin, end;     /* its window */
};
struct kvs_market_receipt {
    char model[KVS_MARKET_NAME_MAX];
    char content_id[65];     /* the listing's content id, or "" */
    uint32_t ring;
    uint64_t seq;            /* 1..2^53 */
    uint64_t tokens;         /* 1..KVS_MARKET_MAX_RECEIPT_TOKENS */
    uint8_t head[32];        /* the head's Ed25519 public key: the one in its claim of block 0 */
    size_t n_ranks;          /* 1..KVS_MARKET_MAX_RECEIPT_RANKS, by begin */
    struct kvs_market_receipt_rank ranks[KVS_MARKET_MAX_RECEIPT_RANKS];
};
struct kvs_key;
/* The body of POST /v1/receipts: {"receipt": PAYLOAD, "sig": HEX}, PAYLOAD the
 * receipt as JSON text and HEX the Ed25519 signature of "kvasir-receipt-v1\n"
 * followed by PAYLOAD's bytes, by k (whose public key must be r->head).
 * *body: malloc'd. Errors: KVS_ERR_ARG (k is not r->head), KVS_ERR_NOMEM. */
kvs_err kvs_market_receipt_sign(const struct kvs_market_receipt *r, const struct kvs_key *k, char **body);
/* Parses such a body and checks the signature against the receipt's own head
 * key and the bounds above; digest gets SHA-256 of the payload (the replay
 * identity). Errors: KVS_ERR_FORMAT (malformed, bad signature: errbuf says
 * which), KVS_ERR_RANGE (a count out of bounds). No database is read. */
kvs_err kvs_market_receipt_parse(const char *text, size_t len, struct kvs_market_receipt *r, uint8_t digest[32],
                                 char *errbuf, size_t errlen);

/* Serves one request without HTTP: method "GET"/"POST", path (no query
 * string), body of len bytes (NULL/0 for none), now_ms the wall clock (ms
 * since the epoch; tests pass their own to expire leases). Routes:
 *   GET  /  /map  /v1/rings  /v1/listings
 *   POST /v1/listings  /v1/claims  /v1/claims/ID/renew  /v1/claims/ID/release  /v1/claims/ID/edge
 * Errors are replies, never crashes: {"error":{"code","message"}} with 400
 * (bad JSON / field, code "bad_request"; claim outside the model, code
 * "out_of_range"), 403 (not the holder, "not_holder"), 404 ("unknown_model",
 * "unknown_claim", "unknown_route"), 405, 409 ("overlap", "exists"), 413
 * ("too_large"), 502 (listing: the model's header cannot be read), 500. A
 * refused request changes nothing. POST /v1/listings reads the model's GGUF
 * header over HTTP (kvs_plan_fetch_header) without holding the database.
 * Returns KVS_ERR_NOMEM only when no reply could be built. */
kvs_err kvs_market_handle(struct kvs_market *m, const char *method, const char *path, const char *body, size_t len,
                          int64_t now_ms, struct kvs_market_reply *r);

/* Adds a listing whose profile is given (no HTTP): what POST /v1/listings
 * does after reading the header. Errors: KVS_ERR_MISMATCH (name exists),
 * KVS_ERR_ARG, KVS_ERR_IO (database). */
kvs_err kvs_market_add_listing(struct kvs_market *m, const struct kvs_market_listing_req *r,
                               const struct kvs_plan_model *profile, char *errbuf, size_t errlen);

/* Wall clock in ms since the epoch (CLOCK_REALTIME: leases survive restarts). */
int64_t kvs_market_now_ms(void);

/* --- the map as a node reads it (GET /map) ---------------------------------- */

struct kvs_market_claim {
    int64_t id;
    uint32_t ring, begin, end;
    char node[KVS_MARKET_NAME_MAX];
    char endpoint[KVS_MARKET_ADDR_MAX]; /* "host:port" its predecessor dials, or "" (a relay claim) */
    char relay[KVS_MARKET_URL_MAX];     /* its in link's relay edge URL (no token), or "" */
    char pubkey[KVS_MARKET_KEY_MAX];    /* its node public key (64 hex), or "" */
    char api[KVS_MARKET_URL_MAX];
    bool ready;
    int64_t expires_ms;
};

struct kvs_market_gap {
    uint32_t ring, begin, end;
    double reward;
};

struct kvs_market_listing {
    char name[KVS_MARKET_NAME_MAX];
    char fingerprint[65];
    char url[KVS_MARKET_URL_MAX];
    char index[KVS_MARKET_URL_MAX];
    char content_id[65];              /* "" if the listing names none */
    uint32_t n_block, rings, ctx, seqs;
    bool boundary_f32;
    double demand;
    struct kvs_plan_model *profile;   /* owned */
    size_t n_claims, n_gaps;
    struct kvs_market_claim *claims;  /* owned, by ring then begin */
    struct kvs_market_gap *gaps;      /* owned, by ring then begin */
};

struct kvs_market_map {
    int64_t now_ms, lease_ms;
    size_t n_listings;
    struct kvs_market_listing *listings; /* owned */
};

/* Parses a /map document. Free with kvs_market_map_free. Errors:
 * KVS_ERR_FORMAT, KVS_ERR_RANGE, KVS_ERR_NOMEM. */
kvs_err kvs_market_map_parse(const char *text, size_t len, struct kvs_market_map *map, char *errbuf, size_t errlen);
void kvs_market_map_free(struct kvs_market_map *map);

/* The relay edge into block `begin` of ring `ring` of `model` (the in link of the window that begins
 * there): "MODEL-rRING-bBEGIN" when it fits 64 bytes, else "h" + 32 hex digits of SHA-256 of that
 * text + "-rRING-bBEGIN". out gets it (NUL-terminated). */
void kvs_market_edge_id(const char *model, uint32_t ring, uint32_t begin, char out[65]);

/* A node's pick: the uncovered window with the highest reward that fits
 * mem_bytes. For every gap the window is the longest prefix [gap.begin, b)
 * whose kvs_plan_window_mem (targets: the listing's ctx, seqs, boundary;
 * other targets the planner's defaults) is <= mem_bytes; its reward is
 * kvs_market_reward of those blocks. Ties go to the listing first in the
 * map, then the lower ring, then the lower begin. */
struct kvs_market_choice {
    size_t listing;           /* index into map->listings */
    uint32_t ring, begin, end;
    uint64_t mem_bytes;       /* predicted memory of the window */
    double reward;
};
/* Returns KVS_OK and fills *c, or KVS_ERR_NOT_FOUND when no uncovered window
 * fits (then c->mem_bytes is the smallest need of any gap's first block, 0 if
 * there is no gap). */
kvs_err kvs_market_choose(const struct kvs_market_map *map, uint64_t mem_bytes, struct kvs_market_choice *c);

/* The claim of ring `ring` whose window begins at `begin` (the successor of
 * a window ending there; the head's, 0, for the tail), or NULL. */
const struct kvs_market_claim *kvs_market_claim_at(const struct kvs_market_listing *l, uint32_t ring,
                                                   uint32_t begin);

/* --- client (libcurl): what `kvasir join` and `kvasir market add` call ---- */

/* One HTTP request to the market at base (e.g. "http://127.0.0.1:8100"):
 * method, path, JSON body (NULL for none). *status gets the HTTP status, *reply
 * the malloc'd body (NUL-terminated; caller frees). timeout_ms bounds the
 * whole request. Errors: KVS_ERR_NET (no answer), KVS_ERR_NOMEM, KVS_ERR_RANGE
 * (reply over 64 MiB). */
kvs_err kvs_market_call(const char *base, const char *method, const char *path, const char *body, long timeout_ms,
                        int *status, char **reply, char *errbuf, size_t errlen);

#endif

/* Internals shared by the market's files (not public). */
#ifndef KVS_MARKET_IMPL_H
#define KVS_MARKET_IMPL_H

#include <pthread.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "market/market.h"

struct MHD_Daemon;

struct kvs_market {
    struct kvs_market_params p;
    sqlite3 *db;
    pthread_mutex_t mu;        /* around every use of db */
    int64_t last_alive_ms;     /* last "alive" stamp written to meta */
    struct MHD_Daemon *d;      /* HTTP server, NULL until kvs_market_start */
    uint16_t port;
    uint8_t relay_secret[256]; /* p.relay_secret copied; relay_secret_len 0: no relay edges */
    size_t relay_secret_len;
    char relay_pin[65];        /* p.relay_pin copied, "" none */
};

/* http:// or https://, printable, no quotes or angle brackets, < KVS_MARKET_URL_MAX */
bool kvs_market_valid_url(const char *s);
/* host:port with port 1..65535 */
bool kvs_market_valid_addr(const char *s);

/* Closes the database (market_db.c); kvs_market_close calls it after the server stopped. */
void kvs_market_db_close(struct kvs_market *m);

/* Replies and transactions of market_db.c, for market_ledger.c. */
kvs_err kvs_market__reply_json(struct kvs_market_reply *r, int status, json_t *j);
kvs_err kvs_market__reply_error(struct kvs_market_reply *r, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
bool kvs_market__begin(struct kvs_market *m);
bool kvs_market__commit(struct kvs_market *m);
void kvs_market__rollback(struct kvs_market *m);
bool kvs_market__purge(struct kvs_market *m, int64_t now); /* inside a transaction */
/* POST /v1/receipts and GET /ledger (market_ledger.c). */
kvs_err kvs_market__handle_receipt(struct kvs_market *m, const char *body, size_t len, int64_t now,
                                   struct kvs_market_reply *r);
kvs_err kvs_market__handle_ledger(struct kvs_market *m, struct kvs_market_reply *r);

/* The map page (market_page.c): a NUL-terminated static HTML document. */
extern const char kvs_market_page_html[];

#endif

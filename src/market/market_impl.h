/* Internals shared by the market's files (not public). */
#ifndef KVS_MARKET_IMPL_H
#define KVS_MARKET_IMPL_H

#include <pthread.h>
#include <sqlite3.h>
#include <stdbool.h>
#include <stdint.h>

#include "market/market.h"

struct MHD_Daemon;

struct kvs_market {
    struct kvs_market_params p;
    sqlite3 *db;
    pthread_mutex_t mu;        /* around every use of db */
    int64_t last_alive_ms;     /* last "alive" stamp written to meta */
    struct MHD_Daemon *d;      /* HTTP server, NULL until kvs_market_start */
    uint16_t port;
};

/* http:// or https://, printable, no quotes or angle brackets, < KVS_MARKET_URL_MAX */
bool kvs_market_valid_url(const char *s);
/* host:port with port 1..65535 */
bool kvs_market_valid_addr(const char *s);

/* Closes the database (market_db.c); kvs_market_close calls it after the server stopped. */
void kvs_market_db_close(struct kvs_market *m);

/* The map page (market_page.c): a NUL-terminated static HTML document. */
extern const char kvs_market_page_html[];

#endif

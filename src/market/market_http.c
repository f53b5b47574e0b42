/* The market's HTTP server (libmicrohttpd, one thread per connection): reads
 * the body up to the cap, then hands the request to kvs_market_handle. */
#include "market/market.h"
#include "market/market_impl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct conn {
    char *body;
    size_t len, cap;
    bool too_big;
    size_t dropped;
};

static enum MHD_Result send_reply(struct MHD_Connection *c, struct kvs_market_reply *r)
{
    struct MHD_Response *resp = MHD_create_response_from_buffer(strlen(r->body), r->body, MHD_RESPMEM_MUST_FREE);
    if (!resp) {
        free(r->body);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, r->type ? r->type : "application/json");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)r->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls)
{
    struct kvs_market *m = cls;
    struct conn *cc = *con_cls;
    if (!cc) {
        cc = calloc(1, sizeof *cc);
        if (!cc) return MHD_NO;
        *con_cls = cc;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Content-Length");
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            cc->too_big = errno || end == cl || v > m->p.max_body;
            /* far too big: answer now and close instead of reading it */
            if (cc->too_big && (errno || end == cl || v / 4 > m->p.max_body)) {
                struct kvs_market_reply r;
                if (kvs_market_handle(m, method, url, NULL, m->p.max_body + 1, kvs_market_now_ms(), &r)) return MHD_NO;
                return send_reply(c, &r);
            }
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cc->too_big && *upload_size > m->p.max_body - cc->len) {
            cc->too_big = true;
            cc->dropped = cc->len;
        }
        if (cc->too_big) {
            cc->dropped += *upload_size;
            if (cc->dropped / 4 > m->p.max_body) return MHD_NO;
        } else {
            if (cc->len + *upload_size + 1 > cc->cap) {
                size_t nc = cc->cap ? cc->cap : 4096;
                while (nc < cc->len + *upload_size + 1) nc *= 2;
                char *nb = realloc(cc->body, nc);
                if (!nb) return MHD_NO;
                cc->body = nb;
                cc->cap = nc;
            }
            memcpy(cc->body + cc->len, upload, *upload_size);
            cc->len += *upload_size;
        }
        *upload_size = 0;
        return MHD_YES;
    }
    struct kvs_market_reply r;
    size_t len = cc->too_big ? m->p.max_body + 1 : cc->len;
    if (kvs_market_handle(m, method, url, cc->too_big ? NULL : cc->body, len, kvs_market_now_ms(), &r)) return MHD_NO;
    return send_reply(c, &r);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe)
{
    struct conn *cc = *con_cls;
    if (cc) {
        free(cc->body);
        free(cc);
        *con_cls = NULL;
    }
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    (void)cls;
    (void)fmt;
    (void)ap; /* connection-level noise (client went away); errors reach callers as replies */
}

kvs_err kvs_market_start(struct kvs_market *m, const char *bind, uint16_t port, char *errbuf, size_t errlen)
{
    if (m->d) return KVS_ERR_ARG;
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port) };
    if (inet_pton(AF_INET, bind ? bind : "127.0.0.1", &sa.sin_addr) != 1) {
        snprintf(errbuf, errlen, "market: bad IPv4 address '%s'", bind ? bind : "");
        return KVS_ERR_ARG;
    }
    m->d = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
                                MHD_USE_ERROR_LOG,
                            port, NULL, NULL, on_access, m, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
                            MHD_OPTION_NOTIFY_COMPLETED, on_completed, m, MHD_OPTION_CONNECTION_LIMIT, 256u,
                            MHD_OPTION_CONNECTION_TIMEOUT, 30u, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, m,
                            MHD_OPTION_END);
    if (!m->d) {
        snprintf(errbuf, errlen, "market: cannot listen on %s:%u: %s", bind ? bind : "127.0.0.1", (unsigned)port,
                 strerror(errno));
        return KVS_ERR_NET;
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(m->d, MHD_DAEMON_INFO_BIND_PORT);
    m->port = di ? di->port : port;
    return KVS_OK;
}

uint16_t kvs_market_port(const struct kvs_market *m)
{
    return m->port;
}

void kvs_market_close(struct kvs_market *m)
{
    if (!m) return;
    if (m->d) MHD_stop_daemon(m->d);
    m->d = NULL;
    kvs_market_db_close(m);
    free(m);
}

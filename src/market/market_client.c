/* The market's client side (libcurl): one JSON request, one reply. */
#include "market/market.h"

#include <curl/curl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REPLY (64u * 1024 * 1024)

struct sink {
    char *buf;
    size_t len, cap;
    bool overflow;
};

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud)
{
    struct sink *s = ud;
    size_t n = size * nmemb;
    if (s->len + n + 1 > MAX_REPLY) {
        s->overflow = true;
        return 0;
    }
    if (s->len + n + 1 > s->cap) {
        size_t nc = s->cap ? s->cap : 4096;
        while (nc < s->len + n + 1) nc *= 2;
        char *nb = realloc(s->buf, nc);
        if (!nb) return 0;
        s->buf = nb;
        s->cap = nc;
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    s->buf[s->len] = '\0';
    return n;
}

kvs_err kvs_market_call(const char *base, const char *method, const char *path, const char *body, long timeout_ms,
                        int *status, char **reply, char *errbuf, size_t errlen)
{
    *status = 0;
    *reply = NULL;
    char url[2048];
    size_t bl = strlen(base);
    while (bl && base[bl - 1] == '/') bl--;
    if (snprintf(url, sizeof url, "%.*s%s", (int)bl, base, path) >= (int)sizeof url) {
        snprintf(errbuf, errlen, "market URL too long");
        return KVS_ERR_ARG;
    }
    CURL *c = curl_easy_init();
    if (!c) return KVS_ERR_NOMEM;
    struct sink s = { 0 };
    struct curl_slist *h = NULL;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, timeout_ms);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, &s);
    curl_easy_setopt(c, CURLOPT_CUSTOMREQUEST, method);
    if (body) {
        h = curl_slist_append(h, "Content-Type: application/json");
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, h);
        curl_easy_setopt(c, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    }
    CURLcode rc = curl_easy_perform(c);
    long code = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
    curl_slist_free_all(h);
    curl_easy_cleanup(c);
    if (s.overflow) {
        free(s.buf);
        snprintf(errbuf, errlen, "%s: reply over %u bytes", url, MAX_REPLY);
        return KVS_ERR_RANGE;
    }
    if (rc != CURLE_OK) {
        free(s.buf);
        snprintf(errbuf, errlen, "%s: %s", url, curl_easy_strerror(rc));
        return KVS_ERR_NET;
    }
    if (!s.buf) s.buf = strdup("");
    if (!s.buf) return KVS_ERR_NOMEM;
    *status = (int)code;
    *reply = s.buf;
    return KVS_OK;
}

/* Header-only GGUF read over HTTP range requests (RFC 9110 §14: Range /
 * Content-Range), for `kvasir plan --url`. */
#include "plan/plan.h"
#include "plan/plan_impl.h"

#include <curl/curl.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "gguf/gguf.h"

#define FIRST_READ (1024u * 1024)
#define MAX_HEADER (1024ull * 1024 * 1024)

struct sink {
    uint8_t *buf;
    size_t len, cap;      /* cap: bytes wanted (the range length) */
    uint64_t total;       /* from Content-Range "bytes a-b/total"; 0 if unknown */
    bool overflow;
};

static size_t on_body(char *p, size_t size, size_t nmemb, void *ud)
{
    struct sink *s = ud;
    size_t n = size * nmemb;
    if (n > s->cap - s->len) {
        s->overflow = true; /* a 200 reply with the whole file: stop */
        return 0;
    }
    memcpy(s->buf + s->len, p, n);
    s->len += n;
    return n;
}

static size_t on_header(char *p, size_t size, size_t nmemb, void *ud)
{
    struct sink *s = ud;
    size_t n = size * nmemb;
    static const char key[] = "content-range:";
    if (n > sizeof key - 1 && !strncasecmp(p, key, sizeof key - 1)) {
        const char *slash = memchr(p, '/', n);
        if (slash) {
            char tmp[32];
            size_t l = (size_t)(p + n - (slash + 1));
            if (l >= sizeof tmp)
                l = sizeof tmp - 1;
            memcpy(tmp, slash + 1, l);
            tmp[l] = '\0';
            char *end;
            unsigned long long v = strtoull(tmp, &end, 10);
            if (end != tmp)
                s->total = v;
        }
    }
    return n;
}

/* GET bytes [0, want) of url into s (s->buf of want bytes). */
static kvs_err get_range(const char *url, size_t want, struct sink *s, char *errbuf, size_t errlen)
{
    CURL *c = curl_easy_init();
    if (!c)
        return KVS_ERR_NOMEM;
    char range[64];
    snprintf(range, sizeof range, "0-%zu", want - 1);
    s->len = 0;
    s->cap = want;
    s->total = 0;
    s->overflow = false;
    curl_easy_setopt(c, CURLOPT_URL, url);
    curl_easy_setopt(c, CURLOPT_RANGE, range);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, s);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_HEADERDATA, s);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, 30L);
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    CURLcode rc = curl_easy_perform(c);
    long status = 0;
    curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(c);
    if (s->overflow) {
        kvs_plan_seterr(errbuf, errlen, "%s: the server ignores Range requests (HTTP %ld)", url, status);
        return KVS_ERR_NET;
    }
    if (rc != CURLE_OK) {
        kvs_plan_seterr(errbuf, errlen, "%s: %s", url, curl_easy_strerror(rc));
        return KVS_ERR_NET;
    }
    if (status == 200) {
        s->total = s->len; /* the whole (small) file */
    } else if (status != 206 || s->total == 0) {
        kvs_plan_seterr(errbuf, errlen, "%s: HTTP %ld (expected 206 with Content-Range)", url, status);
        return KVS_ERR_NET;
    }
    return KVS_OK;
}

kvs_err kvs_plan_fetch_header(const char *url, uint8_t **buf, struct kvs_gguf **out, char *errbuf, size_t errlen)
{
    *buf = NULL;
    *out = NULL;
    size_t want = FIRST_READ;
    struct sink s = { 0 };
    for (;;) {
        uint8_t *nb = realloc(s.buf, want);
        if (!nb) {
            free(s.buf);
            return KVS_ERR_NOMEM;
        }
        s.buf = nb;
        kvs_err err = get_range(url, want, &s, errbuf, errlen);
        if (err) {
            free(s.buf);
            return err;
        }
        size_t need = 0;
        err = kvs_gguf_parse(s.buf, s.len, s.total, out, &need, errbuf, errlen);
        if (err == KVS_OK) {
            *buf = s.buf;
            return KVS_OK;
        }
        if (err != KVS_ERR_NEED_MORE || s.len >= s.total) {
            free(s.buf);
            return err == KVS_ERR_NEED_MORE ? KVS_ERR_TRUNCATED : err;
        }
        size_t next = want * 2 > need ? want * 2 : need;
        if (next > s.total)
            next = (size_t)s.total;
        if (next > MAX_HEADER) {
            kvs_plan_seterr(errbuf, errlen, "%s: GGUF header larger than %llu bytes", url,
                            (unsigned long long)MAX_HEADER);
            free(s.buf);
            return KVS_ERR_RANGE;
        }
        want = next;
    }
}

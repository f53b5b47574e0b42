/* Window-only download of a stage shard over HTTP range requests (RFC 9110
 * §14: Range, 206 Partial Content, Content-Range), with resume and optional
 * per-tensor SHA-256 verification against a shard index. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>
#include <jansson.h>
#include <openssl/evp.h>

#include "common/log.h"
#include "shard/shard_impl.h"

#define FETCH_LOW_SPEED_LIMIT 1024u  /* default: a transfer slower than this (bytes/s) ... */
#define FETCH_LOW_SPEED_TIME 15u     /* ... for this many seconds fails */
#define FETCH_SMALL_DEADLINE 120L    /* seconds: whole-transfer deadline of each header and index request */
/* Runs are cut at tensor boundaries past this span, so that a long download
 * re-checks the source's ETag now and then. */
#define FETCH_MAX_REQUEST (256ull * 1024 * 1024)
#define FETCH_STATE_EVERY_NS 500000000ll     /* state file rewritten at most twice a second */

/* One tensor of the window, in shard order. */
struct ftensor {
    const char *name;
    uint64_t src;      /* absolute offset in the source file */
    uint64_t dst;      /* absolute offset in the shard */
    uint64_t bytes;
    uint64_t got;      /* bytes received so far in this run */
    bool done;
    uint8_t sha[32];
    const struct kvs_shard_index_entry *ix; /* NULL without an index */
};

struct fetch {
    const struct kvs_shard_fetch_params *p;
    struct kvs_shard_fetch_stats *st;
    CURL *curl;
    struct curl_slist *hdrs; /* p->headers, or NULL */
    const uint8_t *cid;      /* the source's content id (from a verified index) or NULL */
    char *errbuf;
    size_t errlen;
    kvs_err err;          /* set by a callback that aborted the transfer */

    /* the source, from the first response */
    uint64_t size;
    char etag[256];

    /* the current response */
    uint64_t want_first, want_last; /* requested range, inclusive */
    bool checked;                   /* status/headers verified at the first body byte */
    uint64_t received;
    char r_etag[256];
    bool r_has_cr;
    uint64_t r_first, r_last, r_total;

    /* header / index sink: grows with what arrives, never past hmax */
    uint8_t *hbuf;
    size_t hlen, hcap, hmax;

    /* data sink */
    int fd;
    struct ftensor *t;
    size_t nt;
    size_t cur;         /* tensor the next byte belongs to */
    size_t run_end;     /* one past the last tensor of the current run */
    uint64_t pos;       /* absolute source offset of the next byte */
    EVP_MD_CTX *md;
    bool md_open;
    char *state_path;
    int64_t state_saved_ns;

    /* progress */
    int64_t t0_ns, last_print_ns;
    uint64_t total_todo, done_bytes;
    uint64_t throttled; /* bytes counted against limit_rate since t0_ns */
    bool tty;
};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000ll + ts.tv_nsec;
}

static kvs_err ferr(struct fetch *f, kvs_err err, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static kvs_err ferr(struct fetch *f, kvs_err err, const char *fmt, ...)
{
    if (f->errbuf && f->errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(f->errbuf, f->errlen, fmt, ap);
        va_end(ap);
    }
    f->err = err;
    return err;
}

struct kvs_shard_fetch_params kvs_shard_fetch_default_params(void)
{
    struct kvs_shard_fetch_params p = { 0 };
    p.progress = -1;
    return p;
}

/* --- progress ---------------------------------------------------------------- */

static void progress(struct fetch *f, bool final)
{
    if (f->p->progress == 0)
        return;
    int64_t now = now_ns();
    int64_t every = f->tty ? 100000000ll : 3000000000ll;
    if (!final && now - f->last_print_ns < every)
        return;
    f->last_print_ns = now;
    double secs = (double)(now - f->t0_ns) / 1e9;
    double rate = secs > 0 ? (double)f->done_bytes / secs : 0;
    double left = f->total_todo > f->done_bytes ? (double)(f->total_todo - f->done_bytes) : 0;
    double eta = rate > 0 ? left / rate : 0;
    double pct = f->total_todo ? 100.0 * (double)f->done_bytes / (double)f->total_todo : 100.0;
    if (f->tty) {
        char bar[31];
        int fill = (int)(pct * 30 / 100);
        for (int i = 0; i < 30; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[30] = '\0';
        fprintf(stderr, "\r[%s] %5.1f%% %.1f/%.1f MiB %.1f MiB/s ETA %.0fs ", bar, pct,
                (double)f->done_bytes / 1048576.0, (double)f->total_todo / 1048576.0, rate / 1048576.0, eta);
        if (final)
            fputc('\n', stderr);
        fflush(stderr);
    } else {
        fprintf(stderr, "fetch: %5.1f%% %" PRIu64 "/%" PRIu64 " bytes, %.1f MiB/s, ETA %.0fs\n", pct,
                f->done_bytes, f->total_todo, rate / 1048576.0, eta);
    }
}

/* --- state file ----------------------------------------------------------------- */

static kvs_err state_save(struct fetch *f)
{
    json_t *done = json_object();
    for (size_t i = 0; i < f->nt; i++)
        if (f->t[i].done) {
            char hex[65];
            kvs_shard_hex(f->t[i].sha, hex);
            json_object_set_new(done, f->t[i].name, json_string(hex));
        }
    json_t *root = json_pack("{s:s, s:i, s:s, s:I, s:s, s:I, s:I, s:o}", "format", "kvasir-shard-fetch-state",
                             "version", 1, "url", f->p->url, "size", (json_int_t)f->size, "etag", f->etag, "begin",
                             (json_int_t)f->p->begin, "end", (json_int_t)f->p->end, "done", done);
    if (!root)
        return KVS_ERR_NOMEM;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", f->state_path);
    int rc = json_dump_file(root, tmp, JSON_COMPACT);
    json_decref(root);
    if (rc != 0 || rename(tmp, f->state_path) != 0) {
        remove(tmp);
        return ferr(f, KVS_ERR_IO, "cannot write %s", f->state_path);
    }
    f->state_saved_ns = now_ns();
    return KVS_OK;
}

/* Loads the done set if the state matches this fetch; returns false if the
 * work files must be started afresh. */
static bool state_load(struct fetch *f)
{
    json_error_t je;
    json_t *root = json_load_file(f->state_path, 0, &je);
    if (!root)
        return false;
    bool ok = false;
    json_t *url = json_object_get(root, "url"), *etag = json_object_get(root, "etag");
    json_t *size = json_object_get(root, "size"), *b = json_object_get(root, "begin");
    json_t *e = json_object_get(root, "end"), *done = json_object_get(root, "done");
    if (!json_is_string(url) || strcmp(json_string_value(url), f->p->url) != 0 || !json_is_string(etag) ||
        !json_is_integer(size) || !json_is_integer(b) || !json_is_integer(e) || !json_is_object(done))
        goto out;
    if ((uint64_t)json_integer_value(size) != f->size || strcmp(json_string_value(etag), f->etag) != 0) {
        KVS_LOGW("fetch: the source changed since the interrupted fetch (size/ETag); starting over");
        goto out;
    }
    if (json_integer_value(b) != f->p->begin || json_integer_value(e) != f->p->end)
        goto out;
    for (size_t i = 0; i < f->nt; i++) {
        json_t *h = json_object_get(done, f->t[i].name);
        if (json_is_string(h) && kvs_shard_unhex(json_string_value(h), json_string_length(h), f->t[i].sha))
            f->t[i].done = true;
    }
    ok = true;
out:
    json_decref(root);
    return ok;
}

/* --- HTTP ----------------------------------------------------------------------- */

static void trim_copy(char *dst, size_t cap, const char *s, size_t n)
{
    while (n && (*s == ' ' || *s == '\t')) {
        s++;
        n--;
    }
    while (n && (s[n - 1] == '\r' || s[n - 1] == '\n' || s[n - 1] == ' '))
        n--;
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, s, n);
    dst[n] = '\0';
}

static size_t on_header(char *buf, size_t size, size_t nitems, void *ud)
{
    struct fetch *f = ud;
    size_t n = size * nitems;
    if (n >= 5 && !strncmp(buf, "HTTP/", 5)) { /* a new response (e.g. after a redirect) */
        f->r_etag[0] = '\0';
        f->r_has_cr = false;
    } else if (n > 5 && !strncasecmp(buf, "ETag:", 5)) {
        trim_copy(f->r_etag, sizeof f->r_etag, buf + 5, n - 5);
    } else if (n > 14 && !strncasecmp(buf, "Content-Range:", 14)) {
        char v[128];
        trim_copy(v, sizeof v, buf + 14, n - 14);
        uint64_t a, b, t;
        char tail;
        if (sscanf(v, "bytes %" SCNu64 "-%" SCNu64 "/%" SCNu64 "%c", &a, &b, &t, &tail) == 3 && a <= b && b < t) {
            f->r_has_cr = true;
            f->r_first = a;
            f->r_last = b;
            f->r_total = t;
        }
    }
    return n;
}

/* Called at the first body byte (or at the end of an empty body): the status
 * and headers must describe exactly the requested range of the same file. */
static bool check_response(struct fetch *f)
{
    if (f->checked)
        return true;
    f->checked = true;
    long code = 0;
    curl_easy_getinfo(f->curl, CURLINFO_RESPONSE_CODE, &code);
    if (code == 200) {
        ferr(f, KVS_ERR_NET,
             "%s: the server ignored the Range request (HTTP 200 instead of 206): it does not serve byte ranges",
             f->p->url);
        return false;
    }
    if (code != 206) {
        ferr(f, KVS_ERR_NET, "%s: HTTP %ld for bytes %" PRIu64 "-%" PRIu64, f->p->url, code, f->want_first,
             f->want_last);
        return false;
    }
    if (!f->r_has_cr) {
        ferr(f, KVS_ERR_NET, "%s: 206 response without a valid Content-Range", f->p->url);
        return false;
    }
    if (f->size == 0) { /* first response: learn the source's identity */
        f->size = f->r_total;
        snprintf(f->etag, sizeof f->etag, "%s", f->r_etag);
        if (!f->etag[0])
            KVS_LOGW("fetch: the server sends no ETag; only the size can detect a changed source");
    } else if (f->r_total != f->size || strcmp(f->r_etag, f->etag) != 0) {
        ferr(f, KVS_ERR_MISMATCH,
             "%s changed during the fetch: size %" PRIu64 " -> %" PRIu64 ", ETag %s -> %s", f->p->url, f->size,
             f->r_total, f->etag[0] ? f->etag : "(none)", f->r_etag[0] ? f->r_etag : "(none)");
        return false;
    }
    uint64_t last = f->want_last < f->r_total ? f->want_last : f->r_total - 1;
    if (f->r_first != f->want_first || f->r_last != last) {
        ferr(f, KVS_ERR_NET, "%s: asked for bytes %" PRIu64 "-%" PRIu64 ", got %" PRIu64 "-%" PRIu64, f->p->url,
             f->want_first, f->want_last, f->r_first, f->r_last);
        return false;
    }
    return true;
}

/* Rate limit (--limit-rate): sleep until this run's average is under it.
 * Sleeping in the write callback stalls the socket: TCP backpressure. */
static void throttle(struct fetch *f, size_t n)
{
    if (!f->p->limit_rate)
        return;
    f->throttled += n;
    int64_t due = f->t0_ns + (int64_t)((double)f->throttled * 1e9 / (double)f->p->limit_rate);
    int64_t now = now_ns();
    if (due > now) {
        struct timespec ts = { (time_t)((due - now) / 1000000000ll), (long)((due - now) % 1000000000ll) };
        nanosleep(&ts, NULL);
    }
}

/* Room for n more bytes in f->hbuf (n <= hmax - hlen): doubles, capped at hmax. */
static bool grow(struct fetch *f, size_t n)
{
    if (f->hlen + n <= f->hcap)
        return true;
    size_t cap = f->hcap ? f->hcap : 65536;
    while (cap < f->hlen + n)
        cap = cap > f->hmax / 2 ? f->hmax : cap * 2;
    uint8_t *nb = realloc(f->hbuf, cap);
    if (!nb) {
        ferr(f, KVS_ERR_NOMEM, "out of memory");
        return false;
    }
    f->hbuf = nb;
    f->hcap = cap;
    return true;
}

static size_t sink_header(char *data, size_t size, size_t nmemb, void *ud)
{
    struct fetch *f = ud;
    size_t n = size * nmemb;
    if (!check_response(f))
        return 0;
    if (n > f->hmax - f->hlen) {
        ferr(f, KVS_ERR_NET, "%s: response longer than the requested range", f->p->url);
        return 0;
    }
    if (!grow(f, n))
        return 0;
    memcpy(f->hbuf + f->hlen, data, n);
    f->hlen += n;
    f->received += n;
    throttle(f, n);
    return n;
}

static bool all_zero(const uint8_t *p, size_t n)
{
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);
}

static kvs_err tensor_finish(struct fetch *f, struct ftensor *t)
{
    unsigned int len = 0;
    if (!f->md_open || !EVP_DigestFinal_ex(f->md, t->sha, &len))
        return ferr(f, KVS_ERR_INTERNAL, "SHA-256 failed");
    f->md_open = false;
    if (t->ix && memcmp(t->ix->sha256, t->sha, 32) != 0) {
        char want[65], got[65];
        kvs_shard_hex(t->ix->sha256, want);
        kvs_shard_hex(t->sha, got);
        return ferr(f, KVS_ERR_HASH, "tensor '%s': SHA-256 %s does not match the index (%s)", t->name, got, want);
    }
    t->done = true;
    if (now_ns() - f->state_saved_ns >= FETCH_STATE_EVERY_NS)
        return state_save(f);
    return KVS_OK;
}

static size_t sink_data(char *data, size_t size, size_t nmemb, void *ud)
{
    struct fetch *f = ud;
    size_t n = size * nmemb;
    if (!check_response(f))
        return 0;
    const uint8_t *p = (const uint8_t *)data;
    size_t left = n;
    while (left) {
        if (f->cur >= f->run_end) {
            ferr(f, KVS_ERR_NET, "%s: response longer than the requested range", f->p->url);
            return 0;
        }
        struct ftensor *t = &f->t[f->cur];
        if (f->pos < t->src) { /* alignment padding between tensors */
            uint64_t skip = t->src - f->pos;
            size_t k = skip < left ? (size_t)skip : left;
            p += k;
            left -= k;
            f->pos += k;
            f->st->data_bytes += k;
            f->done_bytes += k;
            continue;
        }
        uint64_t in = f->pos - t->src;
        size_t k = t->bytes - in < left ? (size_t)(t->bytes - in) : left;
        if (in == 0) {
            if (!EVP_DigestInit_ex(f->md, EVP_sha256(), NULL)) {
                ferr(f, KVS_ERR_INTERNAL, "SHA-256 init failed");
                return 0;
            }
            f->md_open = true;
        }
        if (k) {
            if (!EVP_DigestUpdate(f->md, p, k)) {
                ferr(f, KVS_ERR_INTERNAL, "SHA-256 failed");
                return 0;
            }
            /* Zeros stay holes: the .part file was created with ftruncate. */
            if (!all_zero(p, k)) {
                size_t w = 0;
                while (w < k) {
                    ssize_t r = pwrite(f->fd, p + w, k - w, (off_t)(t->dst + in + w));
                    if (r < 0 && errno == EINTR)
                        continue;
                    if (r <= 0) {
                        ferr(f, KVS_ERR_IO, "write failed: %s", strerror(errno));
                        return 0;
                    }
                    w += (size_t)r;
                }
            }
        }
        p += k;
        left -= k;
        f->pos += k;
        t->got += k;
        f->st->data_bytes += k;
        f->done_bytes += k;
        if (in + k == t->bytes) {
            if (tensor_finish(f, t) != KVS_OK)
                return 0;
            f->cur++;
        }
    }
    f->received += n;
    progress(f, false);
    throttle(f, n);
    return n;
}

/* GET bytes [first, last] of the source into the given sink. */
static kvs_err get_range(struct fetch *f, uint64_t first, uint64_t last, curl_write_callback sink)
{
    char range[64];
    snprintf(range, sizeof range, "%" PRIu64 "-%" PRIu64, first, last);
    f->want_first = first;
    f->want_last = last;
    f->checked = false;
    f->received = 0;
    f->err = KVS_OK;
    f->r_etag[0] = '\0';
    f->r_has_cr = false;
    curl_easy_setopt(f->curl, CURLOPT_URL, f->p->url);
    curl_easy_setopt(f->curl, CURLOPT_RANGE, range);
    curl_easy_setopt(f->curl, CURLOPT_WRITEFUNCTION, sink);
    curl_easy_setopt(f->curl, CURLOPT_WRITEDATA, f);
    f->st->n_requests++;
    CURLcode rc = curl_easy_perform(f->curl);
    if (f->err)
        return f->err;
    if (rc == CURLE_PARTIAL_FILE)
        return ferr(f, KVS_ERR_TRUNCATED, "%s: the response for bytes %s ended early (%" PRIu64 " bytes)",
                    f->p->url, range, f->received);
    if (rc == CURLE_OPERATION_TIMEDOUT)
        return ferr(f, KVS_ERR_NET, "%s: bytes %s: the transfer is too slow or stalled (%s): given up; run again "
                    "to resume", f->p->url, range, curl_easy_strerror(rc));
    if (rc != CURLE_OK)
        return ferr(f, KVS_ERR_NET, "%s: %s", f->p->url, curl_easy_strerror(rc));
    if (!check_response(f))
        return f->err;
    uint64_t expect = (f->r_last - f->r_first) + 1;
    if (f->received != expect)
        return ferr(f, KVS_ERR_TRUNCATED, "%s: got %" PRIu64 " of %" PRIu64 " bytes for range %s", f->p->url,
                    f->received, expect, range);
    return KVS_OK;
}

/* Reads the source header, growing the read geometrically while the parser
 * asks for more. On success *g is parsed over f->hbuf. */
static kvs_err fetch_header(struct fetch *f, struct kvs_gguf **g)
{
    uint64_t want = f->p->initial_header ? f->p->initial_header : (1u << 20);
    if (want > KVS_SHARD_MAX_HEADER)
        want = KVS_SHARD_MAX_HEADER;
    f->hmax = (size_t)want;
    kvs_err err = get_range(f, 0, want - 1, sink_header);
    if (err)
        return err;
    for (;;) {
        size_t need = 0;
        char msg[256] = "";
        err = kvs_gguf_parse(f->hbuf, f->hlen, f->size, g, &need, msg, sizeof msg);
        if (err != KVS_ERR_NEED_MORE) {
            if (err)
                return ferr(f, KVS_ERR_FORMAT, "%s: corrupt GGUF header: %s (%s)", f->p->url, msg,
                            kvs_strerror(err));
            f->st->header_bytes = f->hlen;
            return KVS_OK;
        }
        if (f->hlen >= f->size)
            return ferr(f, KVS_ERR_FORMAT, "%s: corrupt GGUF header: it runs past the end of the file",
                        f->p->url);
        uint64_t next = (uint64_t)f->hlen * 2;
        if (need > next)
            next = need;
        if (next > f->size)
            next = f->size;
        if (next > KVS_SHARD_MAX_HEADER)
            return ferr(f, KVS_ERR_RANGE,
                        "%s: the GGUF header claims %llu bytes or more, over the %llu a real model's header "
                        "needs: refused before downloading it", f->p->url, (unsigned long long)next,
                        (unsigned long long)KVS_SHARD_MAX_HEADER);
        f->hmax = (size_t)next; /* the buffer grows as the bytes arrive (sink_header) */
        err = get_range(f, f->hlen, next - 1, sink_header);
        if (err)
            return err;
    }
}

static size_t sink_mem(char *data, size_t size, size_t nmemb, void *ud)
{
    struct fetch *f = ud;
    size_t n = size * nmemb;
    if (n > f->hmax - f->hlen) {
        ferr(f, KVS_ERR_RANGE,
             "the index is larger than %zu bytes, more than an index of this model's %zu tensors can be: refused",
             f->hmax, f->nt);
        return 0;
    }
    if (!grow(f, n))
        return 0;
    memcpy(f->hbuf + f->hlen, data, n);
    f->hlen += n;
    return n;
}

/* Low-speed limit of every transfer (params, defaults FETCH_LOW_SPEED_*): a
 * server trickling bytes cannot hold a fetch for longer than the window. */
static void set_low_speed(CURL *c, const struct kvs_shard_fetch_params *p)
{
    uint64_t lim = p->low_speed_limit ? p->low_speed_limit : FETCH_LOW_SPEED_LIMIT;
    long secs = p->low_speed_time ? (long)p->low_speed_time : (long)FETCH_LOW_SPEED_TIME;
    if (p->limit_rate && lim > p->limit_rate / 2) /* --limit-rate below the limit must not trip it */
        lim = p->limit_rate / 2 ? p->limit_rate / 2 : 1;
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, (long)lim);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, secs);
}

/* Reads the index named by p->index. Over HTTP the document is capped by
 * what an index of n_src_tensors tensors can be (KVS_SHARD_INDEX_MAX_BYTES),
 * the buffer grows with what arrives, and the transfer has a low-speed limit
 * and a FETCH_SMALL_DEADLINE deadline. */
static kvs_err load_index(struct fetch *f, struct kvs_shard_index *ix, size_t n_src_tensors)
{
    const char *src = f->p->index;
    if (strncmp(src, "http://", 7) != 0 && strncmp(src, "https://", 8) != 0)
        return kvs_shard_index_load(src, ix, f->errbuf, f->errlen);
    /* A separate small transfer into a temporary buffer. */
    struct fetch g = { .p = f->p, .errbuf = f->errbuf, .errlen = f->errlen, .st = f->st, .nt = n_src_tensors };
    uint64_t cap = KVS_SHARD_INDEX_MAX_BYTES(n_src_tensors);
    g.hmax = cap > SIZE_MAX / 2 ? SIZE_MAX / 2 : (size_t)cap;
    g.curl = curl_easy_init();
    if (!g.curl)
        return KVS_ERR_NOMEM;
    curl_easy_setopt(g.curl, CURLOPT_URL, src);
    if (f->hdrs)
        curl_easy_setopt(g.curl, CURLOPT_HTTPHEADER, f->hdrs);
    curl_easy_setopt(g.curl, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(g.curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(g.curl, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(g.curl, CURLOPT_WRITEFUNCTION, sink_mem);
    curl_easy_setopt(g.curl, CURLOPT_WRITEDATA, &g);
    curl_easy_setopt(g.curl, CURLOPT_MAXFILESIZE_LARGE, (curl_off_t)g.hmax); /* a Content-Length over it: refused */
    curl_easy_setopt(g.curl, CURLOPT_TIMEOUT, FETCH_SMALL_DEADLINE);
    set_low_speed(g.curl, f->p);
    CURLcode rc = curl_easy_perform(g.curl);
    long code = 0;
    curl_easy_getinfo(g.curl, CURLINFO_RESPONSE_CODE, &code);
    curl_easy_cleanup(g.curl);
    kvs_err err = g.err;
    if (!err && rc == CURLE_FILESIZE_EXCEEDED)
        err = kvs_shard__err(KVS_ERR_RANGE, f->errbuf, f->errlen,
                             "%s: the index is larger than %zu bytes, more than an index of this model's %zu "
                             "tensors can be: refused", src, g.hmax, n_src_tensors);
    if (!err && rc == CURLE_OPERATION_TIMEDOUT)
        err = kvs_shard__err(KVS_ERR_NET, f->errbuf, f->errlen,
                             "%s: the index transfer is too slow (%s): given up", src, curl_easy_strerror(rc));
    if (!err && rc != CURLE_OK)
        err = kvs_shard__err(KVS_ERR_NET, f->errbuf, f->errlen, "%s: %s", src, curl_easy_strerror(rc));
    if (!err && code != 200)
        err = kvs_shard__err(code == 404 ? KVS_ERR_NOT_FOUND : KVS_ERR_NET, f->errbuf, f->errlen, "%s: HTTP %ld",
                             src, code);
    if (!err)
        err = kvs_shard_index_parse((const char *)g.hbuf, g.hlen, ix, f->errbuf, f->errlen);
    free(g.hbuf);
    return err;
}

/* Matches the window's tensors to the index: same model, same places. */
static kvs_err bind_index(struct fetch *f, const struct kvs_gguf *g, const struct kvs_shard_index *ix)
{
    uint8_t fp[32];
    char hex[65];
    kvs_err err = kvs_gguf_fingerprint(g, fp);
    if (err)
        return ferr(f, err, "cannot fingerprint the source header");
    kvs_gguf_fingerprint_hex(fp, hex);
    if (strcmp(hex, ix->fingerprint) != 0 || ix->file_size != f->size)
        return ferr(f, KVS_ERR_MISMATCH, "the index describes another file (fingerprint %.16s..., %" PRIu64
                    " bytes) than %s (%.16s..., %" PRIu64 " bytes)", ix->fingerprint, ix->file_size, f->p->url,
                    hex, f->size);
    /* The metadata (tokenizer, chat template, hyperparameters) is part of the content id: the
     * header this server sent must be the one the index was made of. */
    uint8_t meta[32];
    err = kvs_shard_metadata_digest(g, meta);
    if (err)
        return ferr(f, err, "cannot digest the source header's metadata");
    if (memcmp(meta, ix->metadata_sha256, 32) != 0)
        return ferr(f, KVS_ERR_MISMATCH, "the metadata in %s's header (tokenizer, chat template, hyperparameters) "
                    "is not the one the index describes (a hostile or stale server)", f->p->url);
    for (size_t i = 0; i < f->nt; i++) {
        const struct kvs_shard_index_entry *e = kvs_shard_index_find(ix, f->t[i].name);
        if (!e || e->offset != f->t[i].src || e->size != f->t[i].bytes)
            return ferr(f, KVS_ERR_MISMATCH, "index entry of tensor '%s' is %s", f->t[i].name,
                        e ? "at another offset/size" : "missing");
        f->t[i].ix = e;
    }
    return KVS_OK;
}

static kvs_err write_all_at(struct fetch *f, int fd, const uint8_t *p, size_t n, uint64_t off)
{
    while (n) {
        ssize_t r = pwrite(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return ferr(f, KVS_ERR_IO, "write failed: %s", strerror(errno));
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return KVS_OK;
}

/* True if out_path already holds this window of this model, whole: it opens
 * as a shard of exactly [begin, end), its tensors are the window's (names,
 * sizes, offsets), each hashes to the index's SHA-256 (when there is an
 * index), and its header bytes equal the header this fetch writes for those
 * tensor digests (the source's metadata, the window keys and the tensors
 * digest: any change to the metadata or the data is caught). A re-run of a
 * finished fetch then moves no data. */
static bool output_complete(struct fetch *f, const struct kvs_gguf *remote, const size_t *idx, uint64_t total)
{
    struct stat sb;
    if (stat(f->p->out_path, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size != total)
        return false;
    struct kvs_gguf *o = NULL;
    char msg[256];
    if (kvs_gguf_open(f->p->out_path, &o, msg, sizeof msg) != KVS_OK)
        return false;
    bool ok = false;
    uint32_t b, e;
    uint8_t(*sha)[32] = NULL;
    struct kvs_gguf_writer *w = NULL;
    uint8_t *want = NULL, *have = NULL;
    size_t want_len = 0;
    int fd = -1;
    if (!kvs_shard_window(o, &b, &e) || b != f->p->begin || e != f->p->end || kvs_gguf_n_tensors(o) != f->nt)
        goto done;
    sha = calloc(f->nt ? f->nt : 1, 32);
    if (!sha)
        goto done;
    for (size_t i = 0; i < f->nt; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(o, i);
        if (strcmp(t->name, f->t[i].name) || t->bytes != f->t[i].bytes ||
            kvs_gguf_data_offset(o) + t->offset != f->t[i].dst ||
            kvs_shard_sha256(t->bytes ? t->data : "", t->bytes, sha[i]) != KVS_OK ||
            (f->t[i].ix && memcmp(f->t[i].ix->sha256, sha[i], 32)))
            goto done;
    }
    if (kvs_shard__writer(remote, f->p->begin, f->p->end, idx, f->nt, (const uint8_t(*)[32])sha, f->cid, false, &w, msg,
                          sizeof msg) != KVS_OK ||
        kvs_gguf_writer_header(w, &want, &want_len) != KVS_OK || want_len > total)
        goto done;
    have = malloc(want_len ? want_len : 1);
    fd = open(f->p->out_path, O_RDONLY | O_CLOEXEC);
    if (!have || fd < 0 || pread(fd, have, want_len, 0) != (ssize_t)want_len)
        goto done;
    ok = memcmp(have, want, want_len) == 0;
done:
    if (fd >= 0)
        close(fd);
    free(have);
    free(want);
    kvs_gguf_writer_free(w);
    free(sha);
    kvs_gguf_close(o);
    return ok;
}

kvs_err kvs_shard_fetch(const struct kvs_shard_fetch_params *p, struct kvs_shard_fetch_stats *stats,
                        char *errbuf, size_t errlen)
{
    struct kvs_shard_fetch_stats st_local;
    struct kvs_shard_fetch_stats *st = stats ? stats : &st_local;
    memset(st, 0, sizeof *st);
    if (!p || !p->url || !p->out_path || (p->begin >= p->end && (p->begin || p->end)))
        return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "fetch needs a URL, an output path and a window");
    /* A copy whose window is resolved from the header when it asks for every block. */
    struct kvs_shard_fetch_params pw = *p;
    const bool all_blocks = p->begin == 0 && p->end == 0;
    p = &pw;
    struct fetch f = { .p = p, .st = st, .errbuf = errbuf, .errlen = errlen, .fd = -1 };
    struct kvs_gguf *g = NULL, *check = NULL;
    struct kvs_gguf_writer *w = NULL;
    struct kvs_shard_index ix = { 0 };
    size_t *idx = NULL, nidx = 0;
    uint8_t(*sha)[32] = NULL;
    uint8_t *hdr = NULL;
    size_t hdr_len = 0;
    char part[4096];
    bool drop_work = false; /* remove .part/.state on failure: they can't be resumed */
    kvs_err err = KVS_OK;

    if (snprintf(part, sizeof part, "%s.part", p->out_path) >= (int)sizeof part - 8)
        return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "output path too long");
    f.state_path = malloc(strlen(part) + 8);
    if (!f.state_path)
        return KVS_ERR_NOMEM;
    snprintf(f.state_path, strlen(part) + 8, "%s.state", part);
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        free(f.state_path);
        return kvs_shard__err(KVS_ERR_NET, errbuf, errlen, "curl_global_init failed");
    }
    f.curl = curl_easy_init();
    f.md = EVP_MD_CTX_new();
    if (!f.curl || !f.md) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }
    for (size_t i = 0; i < p->n_headers; i++) {
        struct curl_slist *nl = curl_slist_append(f.hdrs, p->headers[i]);
        if (!nl) {
            err = KVS_ERR_NOMEM;
            goto fail;
        }
        f.hdrs = nl;
    }
    if (f.hdrs)
        curl_easy_setopt(f.curl, CURLOPT_HTTPHEADER, f.hdrs);
    curl_easy_setopt(f.curl, CURLOPT_FOLLOWLOCATION, 1L);
    curl_easy_setopt(f.curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(f.curl, CURLOPT_CONNECTTIMEOUT, 10L);
    set_low_speed(f.curl, p);
    curl_easy_setopt(f.curl, CURLOPT_BUFFERSIZE, p->limit_rate ? 64L * 1024 : 512L * 1024);
    curl_easy_setopt(f.curl, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(f.curl, CURLOPT_HEADERDATA, &f);
    f.t0_ns = f.last_print_ns = now_ns();

    curl_easy_setopt(f.curl, CURLOPT_TIMEOUT, FETCH_SMALL_DEADLINE); /* header reads: a deadline */
    err = fetch_header(&f, &g);
    curl_easy_setopt(f.curl, CURLOPT_TIMEOUT, 0L); /* data: the low-speed limit only (windows can be large) */
    if (err)
        goto fail;
    if (all_blocks) {
        err = kvs_shard_block_count(g, &pw.end);
        if (err || pw.end == 0) {
            err = ferr(&f, err ? err : KVS_ERR_FORMAT, "%s: the GGUF header gives no block count", p->url);
            goto fail;
        }
    }
    err = kvs_shard_check(g, p->begin, p->end, errbuf, errlen);
    if (!err)
        err = kvs_shard_window_tensors(g, p->begin, p->end, &idx, &nidx, errbuf, errlen);
    if (err)
        goto fail;
    f.nt = nidx;
    f.t = calloc(nidx ? nidx : 1, sizeof *f.t);
    sha = calloc(nidx ? nidx : 1, sizeof *sha);
    if (!f.t || !sha) {
        err = KVS_ERR_NOMEM;
        goto fail;
    }
    for (size_t i = 0; i < nidx; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, idx[i]);
        f.t[i].name = t->name;
        f.t[i].src = kvs_gguf_data_offset(g) + t->offset;
        f.t[i].bytes = t->bytes;
        st->window_bytes += t->bytes;
    }
    st->n_tensors = (uint32_t)nidx;
    bool use_index = p->index != NULL;
    if (use_index) {
        err = load_index(&f, &ix, kvs_gguf_n_tensors(g));
        if (err == KVS_ERR_NOT_FOUND && p->index_optional) {
            KVS_LOGI("fetch: no index at %s: the shard is fetched without SHA-256 checks", p->index);
            use_index = false;
            err = KVS_OK;
            if (errbuf && errlen) errbuf[0] = '\0';
        } else if (!err) {
            err = bind_index(&f, g, &ix);
        }
        if (err)
            goto fail;
    }
    /* The content id: the trust root is the caller's (a manifest, a market listing), not this server. */
    uint8_t cid[32], want_cid[32];
    if (p->content_id && !kvs_shard_unhex(p->content_id, strlen(p->content_id), want_cid)) {
        err = ferr(&f, KVS_ERR_ARG, "content id '%.80s' is not 64 hex digits", p->content_id);
        goto fail;
    }
    if (use_index) {
        if (kvs_shard_index_content_id(&ix, cid) != KVS_OK) {
            err = ferr(&f, KVS_ERR_FORMAT, "the index %s lists a tensor twice: it has no content id", p->index);
            goto fail;
        }
        kvs_shard_hex(cid, st->content_id);
        if (p->content_id && memcmp(cid, want_cid, 32) != 0) {
            char want_hex[65];
            kvs_shard_hex(want_cid, want_hex);
            err = ferr(&f, KVS_ERR_MISMATCH,
                       "the index %s describes other weights (content id %.16s...) than the trusted content id "
                       "%.16s... (a hostile or stale server): nothing downloaded", p->index, st->content_id,
                       want_hex);
            goto fail;
        }
        st->trusted = p->content_id != NULL;
        f.cid = cid;
    } else if (p->content_id) {
        err = ferr(&f, KVS_ERR_NOT_FOUND,
                   "a content id is expected (%.16s...) but %s has no shard index: the bytes cannot be checked "
                   "against it", p->content_id, p->url);
        goto fail;
    }
    err = kvs_shard__writer(g, p->begin, p->end, idx, nidx, NULL, f.cid, false, &w, errbuf, errlen);
    if (err)
        goto fail;
    for (size_t i = 0; i < nidx; i++)
        f.t[i].dst = kvs_gguf_writer_tensor_offset(w, i);

    /* Work files: resume if the state matches, else start afresh. */
    uint64_t total = kvs_gguf_writer_total_bytes(w);
    if (output_complete(&f, g, idx, total)) {
        KVS_LOGI("fetch: %s already holds window [%u,%u) of this model (header and tensor digests%s checked): "
                 "nothing to download", p->out_path, p->begin, p->end, use_index ? " and index" : "");
        st->n_resumed = st->n_tensors;
        st->skipped_bytes = st->window_bytes;
        st->verified = use_index;
        remove(part);
        remove(f.state_path);
        goto fail; /* err is KVS_OK: the common cleanup */
    }
    struct stat sb;
    bool resume = stat(part, &sb) == 0 && (uint64_t)sb.st_size == total && state_load(&f);
    if (!resume) {
        for (size_t i = 0; i < nidx; i++)
            f.t[i].done = false;
        remove(part);
        remove(f.state_path);
    }
    f.fd = open(part, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (f.fd < 0) {
        err = ferr(&f, KVS_ERR_IO, "cannot create %s: %s", part, strerror(errno));
        goto fail;
    }
    if (ftruncate(f.fd, (off_t)total) != 0) {
        err = ferr(&f, KVS_ERR_IO, "cannot size %s: %s", part, strerror(errno));
        goto fail;
    }
    for (size_t i = 0; i < nidx; i++) {
        if (f.t[i].done) {
            if (f.t[i].ix && memcmp(f.t[i].ix->sha256, f.t[i].sha, 32) != 0) {
                f.t[i].done = false; /* recorded hash disagrees with the index: fetch again */
                continue;
            }
            st->n_resumed++;
            st->skipped_bytes += f.t[i].bytes;
        } else {
            f.total_todo += f.t[i].bytes;
        }
    }
    if (resume)
        KVS_LOGI("fetch: resuming, %u of %u tensors already done", st->n_resumed, st->n_tensors);
    err = state_save(&f);
    if (err)
        goto fail;

    /* Tensors that came along with the header need no request. */
    for (size_t i = 0; i < nidx; i++) {
        const struct kvs_gguf_tensor *t = kvs_gguf_tensor(g, idx[i]);
        if (f.t[i].done || !t->data || f.t[i].bytes == 0)
            continue;
        if (!EVP_DigestInit_ex(f.md, EVP_sha256(), NULL) || !EVP_DigestUpdate(f.md, t->data, t->bytes)) {
            err = ferr(&f, KVS_ERR_INTERNAL, "SHA-256 failed");
            goto fail;
        }
        f.md_open = true;
        if (!all_zero(t->data, t->bytes)) {
            err = write_all_at(&f, f.fd, t->data, t->bytes, f.t[i].dst);
            if (err)
                goto fail;
        }
        err = tensor_finish(&f, &f.t[i]);
        if (err) {
            state_save(&f);
            goto fail;
        }
        f.total_todo -= f.t[i].bytes;
        st->header_reused_bytes += f.t[i].bytes;
    }

    /* Download runs of adjacent pending tensors. */
    f.tty = p->progress < 0 && isatty(2);
    if (p->progress < 0 && !f.tty)
        f.tty = false;
    uint32_t align = kvs_gguf_alignment(g);
    for (size_t i = 0; i < nidx;) {
        if (f.t[i].done || f.t[i].bytes == 0) {
            if (!f.t[i].done && kvs_shard_sha256("", 0, f.t[i].sha) == KVS_OK)
                f.t[i].done = true;
            i++;
            continue;
        }
        size_t j = i + 1;
        while (j < nidx && !f.t[j].done && f.t[j].bytes && f.t[j].src >= f.t[j - 1].src + f.t[j - 1].bytes &&
               f.t[j].src - (f.t[j - 1].src + f.t[j - 1].bytes) <= align &&
               f.t[j].src + f.t[j].bytes - f.t[i].src <= FETCH_MAX_REQUEST)
            j++;
        f.cur = i;
        f.run_end = j;
        f.pos = f.t[i].src;
        err = get_range(&f, f.t[i].src, f.t[j - 1].src + f.t[j - 1].bytes - 1, sink_data);
        if (!err && f.cur != j)
            err = ferr(&f, KVS_ERR_TRUNCATED, "%s: response ended inside tensor '%s'", p->url, f.t[f.cur].name);
        if (err) {
            drop_work = err == KVS_ERR_MISMATCH;
            state_save(&f);
            goto fail;
        }
        i = j;
    }
    progress(&f, true);

    /* The final header, with the real tensors digest, over the placeholder. */
    for (size_t i = 0; i < nidx; i++)
        memcpy(sha[i], f.t[i].sha, 32);
    kvs_gguf_writer_free(w);
    w = NULL;
    err = kvs_shard__writer(g, p->begin, p->end, idx, nidx, (const uint8_t(*)[32])sha, f.cid, false, &w, errbuf,
                            errlen);
    if (err)
        goto fail;
    err = kvs_gguf_writer_header(w, &hdr, &hdr_len);
    if (err || kvs_gguf_writer_total_bytes(w) != total) {
        err = err ? err : KVS_ERR_INTERNAL;
        goto fail;
    }
    err = write_all_at(&f, f.fd, hdr, hdr_len, 0);
    if (err)
        goto fail;
    if (fsync(f.fd) != 0) {
        err = ferr(&f, KVS_ERR_IO, "fsync %s: %s", part, strerror(errno));
        goto fail;
    }
    close(f.fd);
    f.fd = -1;
    /* The result must open and serve the window before it gets its name. */
    char msg[256] = "";
    err = kvs_gguf_open(part, &check, msg, sizeof msg);
    if (err) {
        err = ferr(&f, KVS_ERR_INTERNAL, "the fetched shard does not open: %s", msg);
        drop_work = true;
        goto fail;
    }
    err = kvs_shard_check(check, p->begin, p->end, errbuf, errlen);
    if (err) {
        drop_work = true;
        goto fail;
    }
    if (rename(part, p->out_path) != 0) {
        err = ferr(&f, KVS_ERR_IO, "cannot rename %s: %s", part, strerror(errno));
        goto fail;
    }
    remove(f.state_path);
    st->verified = use_index;
fail:
    if (err && drop_work) {
        remove(part);
        remove(f.state_path);
    }
    kvs_gguf_close(check);
    if (f.fd >= 0)
        close(f.fd);
    free(hdr);
    kvs_gguf_writer_free(w);
    kvs_shard_index_free(&ix);
    kvs_gguf_close(g);
    free(f.hbuf);
    free(f.t);
    free(sha);
    free(idx);
    EVP_MD_CTX_free(f.md);
    if (f.curl)
        curl_easy_cleanup(f.curl);
    curl_slist_free_all(f.hdrs);
    curl_global_cleanup();
    free(f.state_path);
    return err;
}

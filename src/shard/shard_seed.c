/* The seed server: model files over HTTP/1.1 with single byte ranges
 * (RFC 9110 §14), served by libmicrohttpd with one thread per connection. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>
#include <microhttpd.h>

#include "common/log.h"
#include "shard/shard_impl.h"
#include "common/hex.h"

#define SEED_BLOCK (1u << 20) /* bytes handed to MHD per read callback */
#define SEED_MAX_CONNECTIONS 64 /* one thread each */

struct kvs_seed {
    struct MHD_Daemon *daemon;
    char *dir;
    char *realdir; /* realpath(dir): served files must resolve inside it */
    bool no_ranges;
    uint16_t port;
    _Atomic uint64_t bytes_served;
    _Atomic uint64_t requests;
};

struct seed_body {
    struct kvs_seed *s;
    int fd;
    uint64_t off; /* absolute file offset of body byte 0 */
    uint64_t len;
};

struct kvs_seed_params kvs_seed_default_params(void)
{
    struct kvs_seed_params p = { .dir = ".", .bind = "127.0.0.1", .port = 0, .no_ranges = false };
    return p;
}

uint16_t kvs_seed_port(const struct kvs_seed *s) { return s->port; }

uint64_t kvs_seed_bytes_served(const struct kvs_seed *s)
{
    return atomic_load(&((struct kvs_seed *)s)->bytes_served);
}

static ssize_t body_read(void *cls, uint64_t pos, char *buf, size_t max)
{
    struct seed_body *b = cls;
    if (pos >= b->len)
        return MHD_CONTENT_READER_END_OF_STREAM;
    uint64_t want = b->len - pos;
    if (want > max)
        want = max;
    ssize_t got = pread(b->fd, buf, (size_t)want, (off_t)(b->off + pos));
    if (got <= 0)
        return MHD_CONTENT_READER_END_WITH_ERROR; /* file shrank or I/O error: cut the response */
    atomic_fetch_add(&b->s->bytes_served, (uint64_t)got);
    return got;
}

static void body_free(void *cls)
{
    struct seed_body *b = cls;
    close(b->fd);
    free(b);
}

/* Parses one decimal number at *p, advancing past all its digits; a value
 * above 2^62 saturates to UINT64_MAX (beyond any file: the caller treats it as
 * "past the end"). false if there is no digit. */
static bool parse_u64(const char **p, uint64_t *v)
{
    const char *s = *p;
    uint64_t x = 0;
    if (*s < '0' || *s > '9')
        return false;
    while (*s >= '0' && *s <= '9') {
        if (x != UINT64_MAX)
            x = x > (UINT64_C(1) << 62) / 10 ? UINT64_MAX : x * 10 + (uint64_t)(*s - '0');
        s++;
    }
    *p = s;
    *v = x;
    return true;
}

static const char *skip_ows(const char *h)
{
    while (*h == ' ' || *h == '\t')
        h++;
    return h;
}

/* What to do with a Range header (RFC 9110 §14.2). */
enum seed_range {
    SEED_RANGE_IGNORE, /* another unit than bytes, or an invalid ranges-specifier: 200 full */
    SEED_RANGE_ONE,    /* one satisfiable byte range [*a, *b]: 206 */
    SEED_RANGE_UNSAT,  /* valid but unsatisfiable (nothing overlaps the file): 416 */
    SEED_RANGE_MULTI,  /* valid, more than one range: refused with 416 (docs/FORMATS.md) */
};

/* One range-spec at *h (first-pos "-" [last-pos] / "-" suffix-length),
 * advancing. Returns false if invalid (then the whole header is ignored);
 * *sat tells if it overlaps a file of size bytes, with [*a, *b] clamped. */
static bool parse_spec(const char **hp, uint64_t size, bool *sat, uint64_t *a, uint64_t *b)
{
    const char *h = *hp;
    uint64_t first = 0, last = 0;
    *sat = false;
    if (*h == '-') { /* suffix: the last N bytes; N = 0 is unsatisfiable */
        h++;
        if (!parse_u64(&h, &last))
            return false;
        if (last > 0 && size > 0) {
            *sat = true;
            *a = last >= size ? 0 : size - last;
            *b = size - 1;
        }
    } else {
        if (!parse_u64(&h, &first) || *h != '-')
            return false;
        h++;
        if (*h >= '0' && *h <= '9') {
            if (!parse_u64(&h, &last) || last < first) /* last < first: invalid, not unsatisfiable */
                return false;
        } else {
            last = UINT64_MAX;
        }
        if (first < size) {
            *sat = true;
            *a = first;
            *b = last >= size ? size - 1 : last;
        }
    }
    *hp = h;
    return true;
}

static enum seed_range parse_range(const char *h, uint64_t size, uint64_t *a, uint64_t *b)
{
    h = skip_ows(h);
    if (strncasecmp(h, "bytes=", 6) != 0) /* unknown unit: MUST be ignored */
        return SEED_RANGE_IGNORE;
    h += 6;
    size_t n = 0, n_sat = 0;
    for (;;) {
        h = skip_ows(h);
        if (*h == ',') { /* empty list element (RFC 9110 §5.6.1.2): skipped */
            h++;
            continue;
        }
        if (*h == '\0')
            break;
        bool sat;
        uint64_t x, y;
        if (!parse_spec(&h, size, &sat, &x, &y))
            return SEED_RANGE_IGNORE;
        if (sat && n_sat++ == 0) {
            *a = x;
            *b = y;
        }
        n++;
        h = skip_ows(h);
        if (*h != ',' && *h != '\0')
            return SEED_RANGE_IGNORE;
    }
    if (n == 0)
        return SEED_RANGE_IGNORE;
    if (n_sat == 0)
        return SEED_RANGE_UNSAT;
    return n == 1 ? SEED_RANGE_ONE : SEED_RANGE_MULTI;
}

static enum MHD_Result queue_text(struct MHD_Connection *c, unsigned code, const char *type, const char *text)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(strlen(text), (void *)text, MHD_RESPMEM_MUST_COPY);
    if (!r)
        return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result queue_json(struct MHD_Connection *c, json_t *j)
{
    char *text = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    if (!text)
        return queue_text(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "text/plain", "out of memory\n");
    enum MHD_Result ret = queue_text(c, MHD_HTTP_OK, "application/json", text);
    free(text);
    return ret;
}

static void make_etag(const struct stat *st, char *etag, size_t n)
{
    uint64_t ns = (uint64_t)st->st_mtim.tv_sec * 1000000000u + (uint64_t)st->st_mtim.tv_nsec;
    snprintf(etag, n, "\"%" PRIx64 "-%" PRIx64 "\"", (uint64_t)st->st_size, ns);
}

/* A served name: no path separators, no leading dot, sane characters. */
static bool safe_name(const char *name)
{
    if (!*name || *name == '.' || strlen(name) > 255)
        return false;
    for (const char *p = name; *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '.' ||
              *p == '_' || *p == '-'))
            return false;
    return true;
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcmp(s + n - k, suffix);
}

/* Where an URL whose %-decoding gave a NUL or a '/' is rewritten to (by
 * seed_unescape): the handler answers 400. A raw control byte cannot come in
 * a request line, and safe_name refuses it anyway. */
#define SEED_BAD_NAME "\x01"


/* MHD's unescape callback (the path and query arguments), in place: %XX is
 * decoded, other bytes are kept. A decoded NUL would cut the C string the
 * handler sees ("/m.gguf%00.json" would be served as "/m.gguf") and a decoded
 * '/' is a separator in disguise: such a string becomes SEED_BAD_NAME. */
static size_t seed_unescape(void *cls, struct MHD_Connection *c, char *str)
{
    (void)cls;
    (void)c;
    char *w = str;
    for (const char *r = str; *r; r++) {
        int hi, lo;
        if (r[0] == '%' && (hi = kvs_hex_value(r[1])) >= 0 && (lo = kvs_hex_value(r[2])) >= 0) {
            char ch = (char)(hi * 16 + lo);
            if (ch == '\0' || ch == '/') {
                memcpy(str, SEED_BAD_NAME, sizeof SEED_BAD_NAME);
                return sizeof SEED_BAD_NAME - 1;
            }
            *w++ = ch;
            r += 2;
        } else {
            *w++ = *r;
        }
    }
    *w = '\0';
    return (size_t)(w - str);
}

/* DIR/name resolved (symlinks followed) if that lies inside DIR and is a
 * regular file: malloc'd path, or NULL (missing, outside DIR, not a file). */
static char *resolve_inside(const struct kvs_seed *s, const char *name, struct stat *st)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", s->dir, name) >= (int)sizeof path)
        return NULL;
    char *real = realpath(path, NULL);
    if (!real)
        return NULL;
    size_t n = strlen(s->realdir);
    bool inside = !strncmp(real, s->realdir, n) && (real[n] == '/' || (n == 1 && s->realdir[0] == '/'));
    if (!inside || stat(real, st) != 0 || !S_ISREG(st->st_mode)) {
        free(real);
        return NULL;
    }
    return real;
}

static json_t *list_models(const struct kvs_seed *s)
{
    json_t *arr = json_array();
    DIR *d = opendir(s->dir);
    if (!d || !arr) {
        if (d)
            closedir(d);
        return arr;
    }
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!safe_name(de->d_name) || !ends_with(de->d_name, ".gguf"))
            continue;
        struct stat st;
        char *path = resolve_inside(s, de->d_name, &st); /* not a link out of DIR, not a FIFO */
        if (!path)
            continue;
        char etag[64], hex[65];
        make_etag(&st, etag, sizeof etag);
        struct kvs_gguf *g = NULL;
        uint8_t fp[32];
        json_t *jfp = json_null();
        if (kvs_gguf_open(path, &g, NULL, 0) == KVS_OK && kvs_gguf_fingerprint(g, fp) == KVS_OK) {
            kvs_gguf_fingerprint_hex(fp, hex);
            json_decref(jfp);
            jfp = json_string(hex);
        }
        kvs_gguf_close(g);
        free(path);
        json_array_append_new(arr, json_pack("{s:s, s:I, s:o, s:s}", "name", de->d_name, "size",
                                             (json_int_t)st.st_size, "fingerprint", jfp, "etag", etag));
    }
    closedir(d);
    return arr;
}

static enum MHD_Result serve_file(struct kvs_seed *s, struct MHD_Connection *c, const char *name)
{
    struct stat st;
    char *path = resolve_inside(s, name, &st);
    if (!path)
        return queue_text(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found\n");
    /* The resolved path has no link left; O_NOFOLLOW refuses one swapped in
     * since, O_NONBLOCK keeps a FIFO swapped in from blocking the open. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    free(path);
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        if (fd >= 0)
            close(fd);
        return queue_text(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found\n");
    }
    uint64_t size = (uint64_t)st.st_size;
    char etag[64], cr[96];
    make_etag(&st, etag, sizeof etag);
    const char *range = s->no_ranges ? NULL : MHD_lookup_connection_value(c, MHD_HEADER_KIND, "Range");
    uint64_t a = 0, b = size ? size - 1 : 0;
    unsigned code = MHD_HTTP_OK;
    enum seed_range rk = range ? parse_range(range, size, &a, &b) : SEED_RANGE_IGNORE;
    if (rk == SEED_RANGE_IGNORE) {
        a = 0;
        b = size ? size - 1 : 0;
    } else {
        if (rk != SEED_RANGE_ONE) {
            close(fd);
            snprintf(cr, sizeof cr, "bytes */%" PRIu64, size);
            struct MHD_Response *r = MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
            if (!r)
                return MHD_NO;
            MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_RANGE, cr);
            MHD_add_response_header(r, MHD_HTTP_HEADER_ETAG, etag);
            enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_RANGE_NOT_SATISFIABLE, r);
            MHD_destroy_response(r);
            return ret;
        }
        code = MHD_HTTP_PARTIAL_CONTENT;
        snprintf(cr, sizeof cr, "bytes %" PRIu64 "-%" PRIu64 "/%" PRIu64, a, b, size);
    }
    struct seed_body *body = malloc(sizeof *body);
    if (!body) {
        close(fd);
        return MHD_NO;
    }
    body->s = s;
    body->fd = fd;
    body->off = a;
    body->len = size ? b - a + 1 : 0;
    struct MHD_Response *r = MHD_create_response_from_callback(body->len, SEED_BLOCK, body_read, body, body_free);
    if (!r) {
        body_free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_ETAG, etag);
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "application/octet-stream");
    if (!s->no_ranges)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ACCEPT_RANGES, "bytes");
    if (code == MHD_HTTP_PARTIAL_CONTENT)
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_RANGE, cr);
    enum MHD_Result ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result handler(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                               const char *version, const char *upload_data, size_t *upload_data_size,
                               void **con_cls)
{
    struct kvs_seed *s = cls;
    bool head = !strcmp(method, MHD_HTTP_METHOD_HEAD);
    if (!head && strcmp(method, MHD_HTTP_METHOD_GET) != 0)
        return queue_text(c, MHD_HTTP_METHOD_NOT_ALLOWED, "text/plain", "only GET and HEAD\n");
    if (*upload_data_size != 0)
        return MHD_NO; /* GET/HEAD carry no body */
    atomic_fetch_add(&s->requests, 1);
    if (!strcmp(url, "/models"))
        return queue_json(c, list_models(s));
    if (!strcmp(url, "/stats"))
        return queue_json(c, json_pack("{s:I, s:I}", "bytes_served", (json_int_t)atomic_load(&s->bytes_served),
                                       "requests", (json_int_t)atomic_load(&s->requests)));
    if (!strcmp(url, SEED_BAD_NAME))
        return queue_text(c, MHD_HTTP_BAD_REQUEST, "text/plain",
                          "bad request: the name decodes to a NUL byte or a '/'\n");
    if (url[0] != '/' || !safe_name(url + 1) || !(ends_with(url, ".gguf") || ends_with(url, ".json")))
        return queue_text(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found\n");
    return serve_file(s, c, url + 1);
}

kvs_err kvs_seed_start(const struct kvs_seed_params *p, struct kvs_seed **out, char *errbuf, size_t errlen)
{
    *out = NULL;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons(p->port);
    if (inet_pton(AF_INET, p->bind ? p->bind : "127.0.0.1", &sa.sin_addr) != 1)
        return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "bad bind address '%s' (IPv4 expected)", p->bind);
    struct stat st;
    if (!p->dir || stat(p->dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return kvs_shard__err(KVS_ERR_ARG, errbuf, errlen, "'%s' is not a folder", p->dir ? p->dir : "(null)");
    struct kvs_seed *s = calloc(1, sizeof *s);
    if (!s)
        return KVS_ERR_NOMEM;
    s->dir = strdup(p->dir);
    s->realdir = realpath(p->dir, NULL);
    s->no_ranges = p->no_ranges;
    if (!s->dir || !s->realdir) {
        kvs_err e = s->dir && errno != ENOMEM ? KVS_ERR_IO : KVS_ERR_NOMEM;
        free(s->dir);
        free(s->realdir);
        free(s);
        return kvs_shard__err(e, errbuf, errlen, "'%s': cannot resolve the folder", p->dir);
    }
    s->daemon = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, p->port, NULL,
                                 NULL, handler, s, MHD_OPTION_SOCK_ADDR, (const struct sockaddr *)&sa,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)120,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned int)SEED_MAX_CONNECTIONS,
                                 MHD_OPTION_UNESCAPE_CALLBACK, seed_unescape, NULL, MHD_OPTION_END);
    if (!s->daemon) {
        free(s->realdir);
        free(s->dir);
        free(s);
        return kvs_shard__err(KVS_ERR_NET, errbuf, errlen, "cannot listen on %s:%u", p->bind, p->port);
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(s->daemon, MHD_DAEMON_INFO_BIND_PORT);
    s->port = info ? info->port : p->port;
    *out = s;
    return KVS_OK;
}

void kvs_seed_stop(struct kvs_seed *s)
{
    if (!s)
        return;
    MHD_stop_daemon(s->daemon);
    free(s->realdir);
    free(s->dir);
    free(s);
}

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

#define SEED_BLOCK (1u << 20) /* bytes handed to MHD per read callback */
#define SEED_MAX_CONNECTIONS 64 /* one thread each */

struct kvs_seed {
    struct MHD_Daemon *daemon;
    char *dir;
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

/* Parses one decimal u64 (< 2^62) at *p, advancing; false on none/overflow. */
static bool parse_u64(const char **p, uint64_t *v)
{
    const char *s = *p;
    uint64_t x = 0;
    if (*s < '0' || *s > '9')
        return false;
    while (*s >= '0' && *s <= '9') {
        if (x > (UINT64_C(1) << 62) / 10)
            return false;
        x = x * 10 + (uint64_t)(*s - '0');
        s++;
    }
    *p = s;
    *v = x;
    return true;
}

/* Single-range parser. Returns 1 and [*a, *b] (inclusive) if satisfiable, 0
 * otherwise (malformed, multiple ranges, or outside the file: all 416). */
static int parse_range(const char *h, uint64_t size, uint64_t *a, uint64_t *b)
{
    while (*h == ' ')
        h++;
    if (strncasecmp(h, "bytes=", 6) != 0)
        return 0;
    h += 6;
    while (*h == ' ')
        h++;
    uint64_t first = 0, last = 0;
    if (*h == '-') { /* suffix: the last N bytes */
        h++;
        if (!parse_u64(&h, &last) || last == 0 || size == 0)
            return 0;
        first = last >= size ? 0 : size - last;
        last = size - 1;
    } else {
        if (!parse_u64(&h, &first) || *h != '-')
            return 0;
        h++;
        if (*h >= '0' && *h <= '9') {
            if (!parse_u64(&h, &last) || last < first)
                return 0;
        } else {
            last = UINT64_MAX;
        }
        if (first >= size)
            return 0;
        if (last >= size)
            last = size - 1;
    }
    while (*h == ' ')
        h++;
    if (*h != '\0') /* a second range (",") or junk */
        return 0;
    *a = first;
    *b = last;
    return 1;
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
        char path[4096];
        struct stat st;
        if (snprintf(path, sizeof path, "%s/%s", s->dir, de->d_name) >= (int)sizeof path ||
            stat(path, &st) != 0 || !S_ISREG(st.st_mode))
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
        json_array_append_new(arr, json_pack("{s:s, s:I, s:o, s:s}", "name", de->d_name, "size",
                                             (json_int_t)st.st_size, "fingerprint", jfp, "etag", etag));
    }
    closedir(d);
    return arr;
}

static enum MHD_Result serve_file(struct kvs_seed *s, struct MHD_Connection *c, const char *name)
{
    char path[4096];
    if (snprintf(path, sizeof path, "%s/%s", s->dir, name) >= (int)sizeof path)
        return queue_text(c, MHD_HTTP_NOT_FOUND, "text/plain", "not found\n");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
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
    if (range) {
        if (!parse_range(range, size, &a, &b)) {
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
    s->no_ranges = p->no_ranges;
    if (!s->dir) {
        free(s);
        return KVS_ERR_NOMEM;
    }
    s->daemon = MHD_start_daemon(MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, p->port, NULL,
                                 NULL, handler, s, MHD_OPTION_SOCK_ADDR, (const struct sockaddr *)&sa,
                                 MHD_OPTION_CONNECTION_TIMEOUT, (unsigned int)120,
                                 MHD_OPTION_CONNECTION_LIMIT, (unsigned int)SEED_MAX_CONNECTIONS, MHD_OPTION_END);
    if (!s->daemon) {
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
    free(s->dir);
    free(s);
}

/* Models given as an http(s) URL (`-m URL`): downloaded once into a cache
 * folder with the shard fetch machinery (range requests, resume per tensor,
 * SHA-256 against URL.kvindex.json when the server has one), reused after.
 * See cli.h (kvs_cli_model_args) for the contract. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli/cli.h"
#include "common/log.h"
#include "gguf/gguf.h"
#include "plan/plan.h"
#include "shard/shard.h"

#define MODEL_MAX_HEADERS 16

bool kvs_cli_is_url(const char *s)
{
    return s && (!strncmp(s, "http://", 7) || !strncmp(s, "https://", 8));
}

/* mkdir -p; 0 or -1 (errno set). */
static int mkdirs(const char *path)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(tmp, 0755) != 0 && errno != EEXIST) return -1;
    return 0;
}

int kvs_cli_cache_dir(const char *given, char *out, size_t cap)
{
    const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    int n;
    if (given && *given) n = snprintf(out, cap, "%s", given);
    else if (xdg && *xdg == '/') n = snprintf(out, cap, "%s/kvasir", xdg);
    else if (home && *home) n = snprintf(out, cap, "%s/.cache/kvasir", home);
    else return -1;
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

int kvs_cli_model_cache_path(const char *cache, const char *url, uint32_t begin, uint32_t end, char *out, size_t cap)
{
    uint8_t d[32];
    if (kvs_shard_sha256(url, strlen(url), d) != KVS_OK) return -1;
    char hex[65];
    kvs_shard_hex(d, hex);
    /* The file name of the URL's path (no query, no fragment), reduced to [A-Za-z0-9._-]. */
    const char *q = url + strcspn(url, "?#");
    const char *b = q;
    while (b > url && b[-1] != '/') b--;
    char stem[128];
    size_t k = 0;
    for (const char *p = b; p < q && k + 1 < sizeof stem; p++) {
        char c = *p;
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
                  c == '_' || c == '-';
        stem[k++] = ok ? c : '_';
    }
    stem[k] = '\0';
    if (k >= 5 && !strcmp(stem + k - 5, ".gguf")) stem[k - 5] = '\0';
    if (!stem[0] || stem[0] == '.') snprintf(stem, sizeof stem, "model");
    int n;
    if (begin == 0 && end == 0) n = snprintf(out, cap, "%s/%.16s-%s.gguf", cache, hex, stem);
    else n = snprintf(out, cap, "%s/%.16s-%s.blk%u-%u.gguf", cache, hex, stem, (unsigned)begin, (unsigned)end);
    return n > 0 && (size_t)n < cap ? 0 : -1;
}

/* A finished cache file: renamed into place only after a complete, checked
 * fetch, so existing and opening with the right window is enough. */
static bool cached_ok(const char *path, uint32_t begin, uint32_t end, const char *content_id)
{
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return false;
    struct kvs_gguf *g = NULL;
    char msg[256];
    if (kvs_gguf_open(path, &g, msg, sizeof msg) != KVS_OK) {
        KVS_LOGW("model: the cached %s does not open (%s): downloading it again", path, msg);
        return false;
    }
    uint32_t b = 0, e = 0, n = 0;
    bool ok = kvs_shard_window(g, &b, &e) && kvs_shard_block_count(g, &n) == KVS_OK &&
              (begin == 0 && end == 0 ? (b == 0 && e == n) : (b == begin && e == end));
    if (ok && content_id && content_id[0]) { /* the manifest names the weights: the cache must hold them */
        uint8_t cid[32];
        char hex[65] = "";
        if (kvs_shard_content_id(g, cid, msg, sizeof msg) == KVS_OK) kvs_shard_hex(cid, hex);
        ok = strcmp(hex, content_id) == 0;
        if (!ok) KVS_LOGI("model: the cached %s is not of content id %.16s...: fetching it again", path, content_id);
    }
    kvs_gguf_close(g);
    return ok;
}

static int fetch_model(const char *who, const char *url, const char *cache, uint32_t begin, uint32_t end,
                       const char *content_id, const char *const *headers, size_t n_headers, char *out, size_t cap)
{
    char dir[4096];
    if (kvs_cli_cache_dir(cache, dir, sizeof dir) != 0) {
        fprintf(stderr, "kvasir %s: no cache folder: set --cache DIR, XDG_CACHE_HOME or HOME\n", who);
        return 2;
    }
    if (kvs_cli_model_cache_path(dir, url, begin, end, out, cap) != 0) {
        fprintf(stderr, "kvasir %s: cache path too long under %s\n", who, dir);
        return 2;
    }
    char win[64] = "the whole model";
    if (begin || end) snprintf(win, sizeof win, "window [%u,%u)", (unsigned)begin, (unsigned)end);
    if (cached_ok(out, begin, end, content_id)) {
        KVS_LOGI("model: %s of %s is cached in %s: nothing to download", win, url, out);
        return 0;
    }
    if (mkdirs(dir) != 0) {
        fprintf(stderr, "kvasir %s: cannot create the cache folder %s: %s\n", who, dir, strerror(errno));
        return 1;
    }
    char ixurl[4200];
    if (snprintf(ixurl, sizeof ixurl, "%s.kvindex.json", url) >= (int)sizeof ixurl) {
        fprintf(stderr, "kvasir %s: URL too long\n", who);
        return 2;
    }
    KVS_LOGI("model: downloading %s of %s into %s", win, url, out);
    struct kvs_shard_fetch_params fp = kvs_shard_fetch_default_params();
    fp.url = url;
    fp.begin = begin;
    fp.end = end;
    fp.out_path = out;
    fp.index = ixurl;
    fp.index_optional = true;
    fp.content_id = content_id && content_id[0] ? content_id : NULL; /* the manifest's: the trust root */
    fp.headers = headers;
    fp.n_headers = n_headers;
    struct kvs_shard_fetch_stats st;
    char err[1024] = "";
    kvs_err e = kvs_shard_fetch(&fp, &st, err, sizeof err);
    if (e) {
        bool auth = strstr(err, "HTTP 401") || strstr(err, "HTTP 403");
        fprintf(stderr, "kvasir %s: downloading %s: %s (%s)%s\n", who, url, err, kvs_strerror(e),
                auth ? "; the server wants a token: --hf-token TOKEN (or $HF_TOKEN), or --header 'Authorization: ...'"
                     : "; run again to resume");
        return 1;
    }
    if (st.verified)
        KVS_LOGI("model: %s: %u tensors verified against %s", out, st.n_tensors, ixurl);
    else
        KVS_LOGW("model: %s: unverified (the server has no %s)", out, ixurl);
    KVS_LOGI("model: fetched %llu bytes in %u requests", (unsigned long long)(st.header_bytes + st.data_bytes),
             st.n_requests);
    return 0;
}

/* The window of `stage`: --window B:E, or --manifest FILE --rank R; 0,0 = whole.
 * cid[65] gets the manifest's content id ("" without one). */
static int stage_window(int argc, char **argv, uint32_t *begin, uint32_t *end, char cid[65])
{
    cid[0] = '\0';
    const char *window = NULL, *manifest = NULL;
    long rank = -1;
    for (int i = 1; i + 1 < argc; i++) {
        if (!strcmp(argv[i], "--window")) window = argv[i + 1];
        else if (!strcmp(argv[i], "--manifest")) manifest = argv[i + 1];
        else if (!strcmp(argv[i], "--rank")) kvs_cli_parse_long(argv[i + 1], 0, 1 << 20, &rank);
    }
    *begin = *end = 0;
    if (window) return kvs_shard_parse_window(window, begin, end) == KVS_OK ? 0 : -1;
    if (manifest && rank >= 0) {
        struct kvs_manifest *man = calloc(1, sizeof *man);
        char err[512];
        if (!man || kvs_manifest_load(manifest, man, err, sizeof err) != KVS_OK) {
            free(man);
            return 0; /* the stage reports the manifest's error */
        }
        snprintf(cid, 65, "%s", man->content_id);
        for (size_t r = 0; r < man->n_ranks; r++)
            if (man->ranks[r].rank == (uint32_t)rank) {
                *begin = man->ranks[r].begin;
                *end = man->ranks[r].end;
            }
        free(man);
    }
    return 0;
}

int kvs_cli_model_args(const char *who, int *argc, char **argv, struct kvs_cli_model_store *st)
{
    memset(st, 0, sizeof *st);
    const char *cache = NULL, *url = NULL, *token = NULL;
    const char *headers[MODEL_MAX_HEADERS + 1];
    size_t n_headers = 0;
    int url_at = -1;
    bool help = false;
    int w = 1;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i], *v = i + 1 < *argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) help = true;
        if ((!strcmp(a, "--cache") || !strcmp(a, "--header") || !strcmp(a, "--hf-token")) && !v) {
            fprintf(stderr, "kvasir %s: %s needs a value\n", who, a);
            return 2;
        }
        if (!strcmp(a, "--cache")) {
            cache = v;
            i++;
            continue;
        }
        if (!strcmp(a, "--header")) {
            if (n_headers == MODEL_MAX_HEADERS || !strchr(v, ':')) {
                fprintf(stderr, "kvasir %s: --header wants 'Name: value' (at most %d)\n", who, MODEL_MAX_HEADERS);
                return 2;
            }
            headers[n_headers++] = v;
            i++;
            continue;
        }
        if (!strcmp(a, "--hf-token")) {
            token = v;
            i++;
            continue;
        }
        argv[w++] = argv[i];
        if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && v) {
            if (kvs_cli_is_url(v)) {
                url = v;
                url_at = w;
            }
            argv[w++] = argv[++i];
        }
    }
    argv[w] = NULL;
    *argc = w;
    if (!url || help) return 0;
    if (!token) token = getenv("HF_TOKEN");
    if (token && *token) {
        int n = snprintf(st->auth, sizeof st->auth, "Authorization: Bearer %s", token);
        if (n < 0 || (size_t)n >= sizeof st->auth) {
            fprintf(stderr, "kvasir %s: --hf-token too long\n", who);
            return 2;
        }
        headers[n_headers++] = st->auth;
    }
    uint32_t begin = 0, end = 0;
    char cid[65] = "";
    if (!strcmp(who, "stage") && stage_window(*argc, argv, &begin, &end, cid) != 0) return 0; /* stage reports it */
    int rc = fetch_model(who, url, cache, begin, end, cid, headers, n_headers, st->path, sizeof st->path);
    if (rc) return rc;
    argv[url_at] = st->path;
    return 0;
}

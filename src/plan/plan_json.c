/* JSON of the plan module: the device inventory (docs/PLAN.md) and the rank
 * manifest (docs/MANIFEST.md), both through jansson. */
#include "plan/plan.h"
#include "plan/plan_impl.h"
#include "link/link.h"

#include <jansson.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hex.h"

#define KVS_PLAN_MAX_JSON (16u * 1024 * 1024)

static const char *const backend_names[KVS_PLAN_BACKEND_COUNT_] = { "cpu", "cuda", "metal", "vulkan", "opencl",
                                                                    "npu" };

/* Optional number field: *out unchanged if absent; false if present but not a number. */
static bool opt_number(json_t *o, const char *key, double *out)
{
    json_t *v = json_object_get(o, key);
    if (!v)
        return true;
    if (!json_is_number(v))
        return false;
    *out = json_number_value(v);
    return true;
}

static bool copy_str(char *dst, size_t cap, json_t *v)
{
    if (!json_is_string(v))
        return false;
    size_t n = json_string_length(v);
    if (n == 0 || n >= cap || memchr(json_string_value(v), '\0', n))
        return false;
    memcpy(dst, json_string_value(v), n);
    dst[n] = '\0';
    return true;
}

/* Reads an optional node public key: absent or null -> "", else exactly 64
 * hex digits (stored lower-case). False if malformed. */
static bool opt_key(json_t *v, char out[KVS_PLAN_KEY_MAX])
{
    out[0] = '\0';
    if (!v || json_is_null(v)) return true;
    if (!json_is_string(v) || json_string_length(v) != KVS_PLAN_KEY_MAX - 1) return false;
    const char *s = json_string_value(v);
    for (size_t i = 0; i < KVS_PLAN_KEY_MAX - 1; i++) {
        if (kvs_hex_value(s[i]) < 0) return false;
        out[i] = (char)(s[i] >= 'A' && s[i] <= 'F' ? s[i] - 'A' + 'a' : s[i]);
    }
    out[KVS_PLAN_KEY_MAX - 1] = '\0';
    return true;
}

/* Checks "host:port" with a port in 1..65535. */
static bool valid_addr(const char *s)
{
    const char *c = strrchr(s, ':');
    if (!c || c == s || c[1] == '\0')
        return false;
    char *end;
    long port = strtol(c + 1, &end, 10);
    return *end == '\0' && port >= 1 && port <= 65535;
}

/* A manifest link: "host:port", or a relay URL with its token (docs/RELAY.md §2). */
static bool valid_link(const char *s)
{
    if (!kvs_ws_is_url(s)) return valid_addr(s);
    struct kvs_ws_url u;
    return kvs_ws_url_parse(s, &u, NULL, 0) == KVS_OK && u.token[0];
}

static kvs_err parse_device(json_t *o, size_t idx, struct kvs_plan_device *d, char *errbuf, size_t errlen)
{
    memset(d, 0, sizeof *d);
    if (!json_is_object(o)) {
        kvs_plan_seterr(errbuf, errlen, "device %zu: not an object", idx);
        return KVS_ERR_FORMAT;
    }
    if (!copy_str(d->name, sizeof d->name, json_object_get(o, "name"))) {
        kvs_plan_seterr(errbuf, errlen, "device %zu: \"name\" must be a string of 1..%d bytes", idx,
                        KVS_PLAN_NAME_MAX - 1);
        return KVS_ERR_FORMAT;
    }
    const char *nm = d->name;
    json_t *v = json_object_get(o, "backend");
    d->backend = KVS_PLAN_BACKEND_CPU;
    if (v) {
        bool found = false;
        for (int b = 0; b < KVS_PLAN_BACKEND_COUNT_ && json_is_string(v); b++)
            if (!strcmp(json_string_value(v), backend_names[b])) {
                d->backend = (enum kvs_plan_backend)b;
                found = true;
            }
        if (!found) {
            kvs_plan_seterr(errbuf, errlen,
                            "device '%s': \"backend\" must be one of cpu, cuda, metal, vulkan, opencl, npu", nm);
            return KVS_ERR_FORMAT;
        }
    }
    v = json_object_get(o, "mem_bytes");
    if (!json_is_integer(v) || json_integer_value(v) <= 0) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"mem_bytes\" must be a positive integer", nm);
        return KVS_ERR_FORMAT;
    }
    d->mem_bytes = (uint64_t)json_integer_value(v);
    v = json_object_get(o, "decode_gbps");
    if (!json_is_number(v) || !(json_number_value(v) > 0) || json_number_value(v) > 1e6) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"decode_gbps\" must be a number in (0, 1e6]", nm);
        return KVS_ERR_FORMAT;
    }
    d->decode_gbps = json_number_value(v);
    d->prefill_gflops = 0;
    d->rtt_ms = 1.0;
    d->bandwidth_mbps = 1000.0;
    if (!opt_number(o, "prefill_gflops", &d->prefill_gflops) || !(d->prefill_gflops >= 0) ||
        d->prefill_gflops > 1e9) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"prefill_gflops\" must be a number >= 0", nm);
        return KVS_ERR_FORMAT;
    }
    if (!opt_number(o, "rtt_ms", &d->rtt_ms) || !(d->rtt_ms >= 0) || d->rtt_ms > 1e6) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"rtt_ms\" must be a number in [0, 1e6]", nm);
        return KVS_ERR_FORMAT;
    }
    if (!opt_number(o, "bandwidth_mbps", &d->bandwidth_mbps) || !(d->bandwidth_mbps > 0) ||
        d->bandwidth_mbps > 1e9) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"bandwidth_mbps\" must be a number in (0, 1e9]", nm);
        return KVS_ERR_FORMAT;
    }
    d->accepts_inbound = true;
    v = json_object_get(o, "accepts_inbound");
    if (v) {
        if (!json_is_boolean(v)) {
            kvs_plan_seterr(errbuf, errlen, "device '%s': \"accepts_inbound\" must be true or false", nm);
            return KVS_ERR_FORMAT;
        }
        d->accepts_inbound = json_is_true(v);
    }
    d->threads = 1;
    v = json_object_get(o, "threads");
    if (v) {
        if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > 4096) {
            kvs_plan_seterr(errbuf, errlen, "device '%s': \"threads\" must be an integer in 1..4096", nm);
            return KVS_ERR_FORMAT;
        }
        d->threads = (uint32_t)json_integer_value(v);
    }
    v = json_object_get(o, "addr");
    if (v && !json_is_null(v)) {
        if (!copy_str(d->addr, sizeof d->addr, v) || !valid_addr(d->addr)) {
            kvs_plan_seterr(errbuf, errlen, "device '%s': \"addr\" must be \"host:port\" (port 1..65535)", nm);
            return KVS_ERR_FORMAT;
        }
    }
    if (!opt_key(json_object_get(o, "key"), d->key)) {
        kvs_plan_seterr(errbuf, errlen, "device '%s': \"key\" must be a node public key: 64 hex digits", nm);
        return KVS_ERR_FORMAT;
    }
    return KVS_OK;
}

kvs_err kvs_plan_inventory_parse(const char *text, size_t len, struct kvs_plan_inventory *inv, char *errbuf,
                                 size_t errlen)
{
    memset(inv, 0, sizeof *inv);
    inv->relay_rtt_ms = 40.0;
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        kvs_plan_seterr(errbuf, errlen, "inventory: JSON error at line %d: %s", jerr.line, jerr.text);
        return KVS_ERR_FORMAT;
    }
    kvs_err err = KVS_OK;
    json_t *devs = root;
    if (json_is_object(root)) {
        devs = json_object_get(root, "devices");
        json_t *relay = json_object_get(root, "relay");
        if (relay) {
            if (!json_is_object(relay) || !opt_number(relay, "rtt_ms", &inv->relay_rtt_ms) ||
                !(inv->relay_rtt_ms >= 0) || inv->relay_rtt_ms > 1e6) {
                kvs_plan_seterr(errbuf, errlen, "inventory: \"relay\" must be {\"rtt_ms\": number >= 0}");
                err = KVS_ERR_FORMAT;
                goto out;
            }
            json_t *u = json_object_get(relay, "url");
            if (u) {
                char probe[KVS_PLAN_ADDR_MAX + 16];
                struct kvs_ws_url wu;
                if (!copy_str(inv->relay_url, 281, u) ||
                    (snprintf(probe, sizeof probe, "%s/edge/x", inv->relay_url),
                     kvs_ws_url_parse(probe, &wu, NULL, 0) != KVS_OK)) {
                    kvs_plan_seterr(errbuf, errlen,
                                    "inventory: \"relay\".url must be \"ws[s]://HOST[:PORT]\" (no path)");
                    err = KVS_ERR_FORMAT;
                    goto out;
                }
            }
        }
    }
    if (!json_is_array(devs) || json_array_size(devs) == 0) {
        kvs_plan_seterr(errbuf, errlen, "inventory: expected a non-empty \"devices\" array");
        err = KVS_ERR_FORMAT;
        goto out;
    }
    if (json_array_size(devs) > KVS_PLAN_MAX_DEVICES) {
        kvs_plan_seterr(errbuf, errlen, "inventory: %zu devices, at most %d", json_array_size(devs),
                        KVS_PLAN_MAX_DEVICES);
        err = KVS_ERR_RANGE;
        goto out;
    }
    for (size_t i = 0; i < json_array_size(devs); i++) {
        err = parse_device(json_array_get(devs, i), i, &inv->devices[i], errbuf, errlen);
        if (err)
            goto out;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(inv->devices[j].name, inv->devices[i].name)) {
                kvs_plan_seterr(errbuf, errlen, "inventory: device name '%s' appears twice", inv->devices[i].name);
                err = KVS_ERR_FORMAT;
                goto out;
            }
        inv->n_devices = i + 1;
    }
out:
    if (err)
        inv->n_devices = 0;
    json_decref(root);
    return err;
}

kvs_err kvs_plan_inventory_load(const char *path, struct kvs_plan_inventory *inv, char *errbuf, size_t errlen)
{
    char *buf;
    size_t len;
    kvs_err err = kvs_plan_read_file(path, KVS_PLAN_MAX_JSON, &buf, &len, errbuf, errlen);
    if (err)
        return err;
    err = kvs_plan_inventory_parse(buf, len, inv, errbuf, errlen);
    free(buf);
    return err;
}

/* --- manifest --------------------------------------------------------------- */

bool kvs_plan_edge_relayed(const struct kvs_plan_inventory *inv, const struct kvs_plan_result *res, size_t r)
{
    if (res->n_ranks < 2) return false;
    const struct kvs_plan_device *a = &inv->devices[res->ranks[r].device];
    const struct kvs_plan_device *b = &inv->devices[res->ranks[(r + 1) % res->n_ranks].device];
    return !a->accepts_inbound || !b->accepts_inbound;
}

/* The address rank r listens on: its device's, or the relay URL of the edge into it. */
static kvs_err rank_listen(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                           const struct kvs_plan_result *res, size_t r, char *out, size_t cap)
{
    const struct kvs_plan_device *d = &inv->devices[res->ranks[r].device];
    size_t from = (r + res->n_ranks - 1) % res->n_ranks;
    if (kvs_plan_edge_relayed(inv, res, from)) {
        if (!inv->relay_url[0] || !inv->relay_secret_len) return KVS_ERR_ARG;
        const struct kvs_plan_device *f = &inv->devices[res->ranks[from].device];
        char msg[512];
        int n = snprintf(msg, sizeof msg, "%s/%s/%s", m->fingerprint, f->name, d->name);
        unsigned char h[EVP_MAX_MD_SIZE];
        unsigned int hl = 0;
        if (n < 0 || !EVP_Digest(msg, (size_t)n, h, &hl, EVP_sha256(), NULL)) return KVS_ERR_INTERNAL;
        char edge[32] = "e";
        for (int i = 0; i < 12; i++) snprintf(edge + 1 + 2 * i, 3, "%02x", h[i]);
        char tok[KVS_RELAY_TOKEN_HEX + 1];
        if (kvs_relay_token(inv->relay_secret, inv->relay_secret_len, edge, tok)) return KVS_ERR_INTERNAL;
        snprintf(out, cap, "%.280s/edge/%.25s?token=%.64s", inv->relay_url, edge, tok);
        return KVS_OK;
    }
    if (d->addr[0])
        snprintf(out, cap, "%s", d->addr);
    else
        snprintf(out, cap, "127.0.0.1:%zu", 7001 + r);
    return KVS_OK;
}

/* Why an unused device is left out. */
static void exclusion_reason(const struct kvs_plan_model *m, const struct kvs_plan_targets *t,
                             const struct kvs_plan_device *d, char *out, size_t cap)
{
    uint64_t least = UINT64_MAX;
    for (uint32_t b = 0; b < m->n_block; b++) {
        uint64_t need = kvs_plan_window_mem(m, t, b, b + 1);
        if (need < least)
            least = need;
    }
    if (least > d->mem_bytes)
        snprintf(out, cap, "too little memory: one block needs at least %llu bytes, the device has %llu",
                 (unsigned long long)least, (unsigned long long)d->mem_bytes);
    else
        snprintf(out, cap, "not needed: the fastest placement found does not use it (it would not lower the "
                           "token time)");
}

kvs_err kvs_plan_manifest_json(const struct kvs_plan_model *m, const struct kvs_plan_inventory *inv,
                               const struct kvs_plan_targets *t, const struct kvs_plan_result *res,
                               const char *model_path, const char *model_url, char **json)
{
    *json = NULL;
    kvs_err err = KVS_ERR_NOMEM;
    json_t *root = json_object();
    json_t *model = json_object();
    json_t *ranks = json_array();
    json_t *pred = json_object();
    json_t *excl = json_array();
    json_t *targ = json_object();
    if (!root || !model || !ranks || !pred || !excl || !targ)
        goto fail;
    json_object_set_new(root, "kvasir_manifest", json_integer(KVS_PLAN_MANIFEST_VERSION));
    json_object_set_new(model, "path", model_path ? json_string(model_path) : json_null());
    json_object_set_new(model, "url", model_url ? json_string(model_url) : json_null());
    json_object_set_new(model, "fingerprint", json_string(m->fingerprint));
    if (m->content_id[0])
        json_object_set_new(model, "content_id", json_string(m->content_id));
    json_object_set_new(model, "n_block", json_integer(m->n_block));
    json_object_set_new(root, "model", model);
    model = NULL;
    json_object_set_new(targ, "ctx", json_integer(t->ctx));
    json_object_set_new(targ, "seqs", json_integer(t->seqs));
    json_object_set_new(targ, "boundary",
                        json_string(t->boundary_bytes == 4 ? "f32" : t->boundary_bytes == 2 ? "f16" : "auto"));
    json_object_set_new(root, "targets", targ);
    targ = NULL;
    for (size_t r = 0; r < res->n_ranks; r++) {
        const struct kvs_plan_rank *rk = &res->ranks[r];
        const struct kvs_plan_device *d = &inv->devices[rk->device];
        char listen[KVS_PLAN_ADDR_MAX], next[KVS_PLAN_ADDR_MAX];
        if ((err = rank_listen(m, inv, res, r, listen, sizeof listen)) ||
            (err = rank_listen(m, inv, res, (r + 1) % res->n_ranks, next, sizeof next)))
            goto fail;
        err = KVS_ERR_NOMEM;
        json_t *o = json_object();
        json_t *win = json_array();
        if (!o || !win) {
            json_decref(o);
            json_decref(win);
            goto fail;
        }
        json_array_append_new(win, json_integer(rk->begin));
        json_array_append_new(win, json_integer(rk->end));
        json_object_set_new(o, "rank", json_integer((json_int_t)r));
        json_object_set_new(o, "device", json_string(d->name));
        json_object_set_new(o, "backend", json_string(kvs_plan_backend_name(d->backend)));
        json_object_set_new(o, "window", win);
        json_object_set_new(o, "listen", json_string(listen));
        json_object_set_new(o, "next", json_string(next));
        json_object_set_new(o, "threads", json_integer(d->threads ? d->threads : 1));
        json_object_set_new(o, "key", d->key[0] ? json_string(d->key) : json_null());
        json_object_set_new(o, "boundary", json_string(rk->boundary_bytes == 2 ? "f16" : "f32"));
        json_object_set_new(o, "weights_bytes", json_integer((json_int_t)rk->weights_bytes));
        json_object_set_new(o, "kv_bytes", json_integer((json_int_t)rk->kv_bytes));
        json_object_set_new(o, "buffer_bytes", json_integer((json_int_t)rk->buffer_bytes));
        json_object_set_new(o, "compute_ms", json_real(rk->compute_ms));
        json_object_set_new(o, "hop_ms", json_real(rk->hop_ms));
        json_array_append_new(ranks, o);
    }
    json_object_set_new(root, "ranks", ranks);
    ranks = NULL;
    json_object_set_new(pred, "token_ms", json_real(res->token_ms));
    json_object_set_new(pred, "decode_tps_1", json_real(res->decode_tps_1));
    json_object_set_new(pred, "decode_tps_seqs", json_real(res->decode_tps_seqs));
    json_object_set_new(pred, "seqs", json_integer(res->seqs));
    json_object_set_new(pred, "max_stage_ms", json_real(res->max_stage_ms));
    json_object_set_new(pred, "exhaustive", json_boolean(res->exhaustive));
    json_object_set_new(root, "predicted", pred);
    pred = NULL;
    for (size_t i = 0; i < inv->n_devices; i++) {
        bool used = false;
        for (size_t r = 0; r < res->n_ranks; r++)
            used |= res->ranks[r].device == i;
        if (used)
            continue;
        char reason[256];
        exclusion_reason(m, t, &inv->devices[i], reason, sizeof reason);
        json_t *o = json_object();
        if (!o)
            goto fail;
        json_object_set_new(o, "device", json_string(inv->devices[i].name));
        json_object_set_new(o, "reason", json_string(reason));
        json_array_append_new(excl, o);
    }
    json_object_set_new(root, "excluded", excl);
    excl = NULL;
    *json = json_dumps(root, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(10));
    err = *json ? KVS_OK : KVS_ERR_NOMEM;
fail:
    json_decref(root);
    json_decref(model);
    json_decref(ranks);
    json_decref(pred);
    json_decref(excl);
    json_decref(targ);
    return err;
}

/* Copies an optional string-or-null field. */
static bool opt_str(json_t *o, const char *key, char *dst, size_t cap)
{
    json_t *v = json_object_get(o, key);
    dst[0] = '\0';
    if (!v || json_is_null(v))
        return true;
    if (!json_is_string(v) || json_string_length(v) >= cap)
        return false;
    memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    return true;
}

kvs_err kvs_manifest_parse(const char *text, size_t len, struct kvs_manifest *mf, char *errbuf, size_t errlen)
{
    memset(mf, 0, sizeof *mf);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root) {
        kvs_plan_seterr(errbuf, errlen, "manifest: JSON error at line %d: %s", jerr.line, jerr.text);
        return KVS_ERR_FORMAT;
    }
    kvs_err err = KVS_ERR_FORMAT;
    json_t *ver = json_object_get(root, "kvasir_manifest");
    if (!json_is_integer(ver)) {
        kvs_plan_seterr(errbuf, errlen, "manifest: \"kvasir_manifest\" (version) missing");
        goto out;
    }
    if (json_integer_value(ver) != KVS_PLAN_MANIFEST_VERSION) {
        kvs_plan_seterr(errbuf, errlen, "manifest: version %lld, this build reads %d",
                        (long long)json_integer_value(ver), KVS_PLAN_MANIFEST_VERSION);
        err = KVS_ERR_UNSUPPORTED;
        goto out;
    }
    json_t *model = json_object_get(root, "model");
    json_t *nb = json_object_get(model, "n_block");
    if (!json_is_object(model) || !json_is_integer(nb) || json_integer_value(nb) < 1 ||
        json_integer_value(nb) > KVS_PLAN_MAX_BLOCKS) {
        kvs_plan_seterr(errbuf, errlen, "manifest: \"model\".\"n_block\" must be an integer in 1..%d",
                        KVS_PLAN_MAX_BLOCKS);
        goto out;
    }
    mf->n_block = (uint32_t)json_integer_value(nb);
    if (!opt_str(model, "path", mf->model_path, sizeof mf->model_path) ||
        !opt_str(model, "url", mf->model_url, sizeof mf->model_url) ||
        !opt_str(model, "fingerprint", mf->fingerprint, sizeof mf->fingerprint)) {
        kvs_plan_seterr(errbuf, errlen, "manifest: \"model\" path/url/fingerprint must be strings or null");
        goto out;
    }
    bool cid_ok = opt_str(model, "content_id", mf->content_id, sizeof mf->content_id) &&
                  (!mf->content_id[0] || strlen(mf->content_id) == 64);
    for (size_t i = 0; cid_ok && mf->content_id[i]; i++)
        cid_ok = (mf->content_id[i] >= '0' && mf->content_id[i] <= '9') ||
                 (mf->content_id[i] >= 'a' && mf->content_id[i] <= 'f');
    if (!cid_ok) {
        kvs_plan_seterr(errbuf, errlen, "manifest: \"model\".\"content_id\" must be 64 lower-case hex digits or null");
        goto out;
    }
    json_t *targ = json_object_get(root, "targets");
    if (targ && !json_is_null(targ)) {
        json_t *ctx = json_object_get(targ, "ctx"), *seqs = json_object_get(targ, "seqs");
        json_t *bnd = json_object_get(targ, "boundary");
        if (!json_is_object(targ)) {
            kvs_plan_seterr(errbuf, errlen, "manifest: \"targets\" must be an object");
            goto out;
        }
        /* The bounds of `kvasir plan --ctx / --seqs`. */
        if (!json_is_integer(ctx) || json_integer_value(ctx) < 1 || json_integer_value(ctx) > (1 << 24)) {
            kvs_plan_seterr(errbuf, errlen, "manifest: targets.ctx must be an integer in 1..%d", 1 << 24);
            err = json_is_integer(ctx) ? KVS_ERR_RANGE : KVS_ERR_FORMAT;
            goto out;
        }
        if (!json_is_integer(seqs) || json_integer_value(seqs) < 1 || json_integer_value(seqs) > 4096) {
            kvs_plan_seterr(errbuf, errlen, "manifest: targets.seqs must be an integer in 1..4096");
            err = json_is_integer(seqs) ? KVS_ERR_RANGE : KVS_ERR_FORMAT;
            goto out;
        }
        if (!json_is_string(bnd) || (strcmp(json_string_value(bnd), "f16") && strcmp(json_string_value(bnd), "f32") &&
                                     strcmp(json_string_value(bnd), "auto"))) {
            kvs_plan_seterr(errbuf, errlen, "manifest: targets.boundary must be \"f16\", \"f32\" or \"auto\"");
            goto out;
        }
        mf->ctx = (uint32_t)json_integer_value(ctx);
        mf->seqs = (uint32_t)json_integer_value(seqs);
        mf->boundary_bytes = !strcmp(json_string_value(bnd), "f32") ? 4 : !strcmp(json_string_value(bnd), "f16") ? 2 : 0;
    }
    json_t *ranks = json_object_get(root, "ranks");
    if (!json_is_array(ranks) || json_array_size(ranks) == 0 || json_array_size(ranks) > KVS_PLAN_MAX_DEVICES) {
        kvs_plan_seterr(errbuf, errlen, "manifest: \"ranks\" must be an array of 1..%d ranks", KVS_PLAN_MAX_DEVICES);
        goto out;
    }
    uint32_t at = 0;
    for (size_t i = 0; i < json_array_size(ranks); i++) {
        json_t *o = json_array_get(ranks, i);
        struct kvs_manifest_rank *r = &mf->ranks[i];
        json_t *rank = json_object_get(o, "rank"), *win = json_object_get(o, "window");
        json_t *thr = json_object_get(o, "threads");
        if (!json_is_object(o) || !json_is_integer(rank) || json_integer_value(rank) != (json_int_t)i) {
            kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].rank must be %zu", i, i);
            goto out;
        }
        r->rank = (uint32_t)i;
        if (!json_is_array(win) || json_array_size(win) != 2 || !json_is_integer(json_array_get(win, 0)) ||
            !json_is_integer(json_array_get(win, 1))) {
            kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].window must be [begin, end]", i);
            goto out;
        }
        json_int_t b = json_integer_value(json_array_get(win, 0)), e = json_integer_value(json_array_get(win, 1));
        if (b != (json_int_t)at || e <= b || e > (json_int_t)mf->n_block) {
            kvs_plan_seterr(errbuf, errlen,
                            "manifest: ranks[%zu].window [%lld, %lld] is not contiguous (expected to begin at %u, "
                            "end after it, at most %u)",
                            i, (long long)b, (long long)e, at, mf->n_block);
            err = KVS_ERR_RANGE;
            goto out;
        }
        r->begin = (uint32_t)b;
        r->end = (uint32_t)e;
        at = r->end;
        if (!copy_str(r->listen, sizeof r->listen, json_object_get(o, "listen")) || !valid_link(r->listen) ||
            !copy_str(r->next, sizeof r->next, json_object_get(o, "next")) || !valid_link(r->next)) {
            kvs_plan_seterr(errbuf, errlen,
                            "manifest: ranks[%zu].listen/next must be \"host:port\" or a relay URL "
                            "ws[s]://HOST[:PORT]/edge/ID?token=HEX",
                            i);
            goto out;
        }
        if (!opt_str(o, "device", r->device, sizeof r->device)) {
            kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].device must be a string", i);
            goto out;
        }
        char be[16];
        r->backend = KVS_PLAN_BACKEND_CPU;
        if (!opt_str(o, "backend", be, sizeof be)) be[0] = '?';
        for (int bi = 0; be[0] && bi < KVS_PLAN_BACKEND_COUNT_; bi++)
            if (!strcmp(be, backend_names[bi])) r->backend = (enum kvs_plan_backend)bi, be[0] = '\0';
        if (be[0]) {
            kvs_plan_seterr(errbuf, errlen,
                            "manifest: ranks[%zu].backend must be one of cpu, cuda, metal, vulkan, opencl, npu", i);
            goto out;
        }
        r->threads = 1;
        if (thr) {
            if (!json_is_integer(thr) || json_integer_value(thr) < 1 || json_integer_value(thr) > 4096) {
                kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].threads must be in 1..4096", i);
                goto out;
            }
            r->threads = (uint32_t)json_integer_value(thr);
        }
        if (!opt_key(json_object_get(o, "key"), r->key)) {
            kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].key must be a node public key: 64 hex digits", i);
            goto out;
        }
        json_t *rb = json_object_get(o, "boundary");
        if (rb && !json_is_null(rb)) {
            if (!json_is_string(rb) || (strcmp(json_string_value(rb), "f16") && strcmp(json_string_value(rb), "f32"))) {
                kvs_plan_seterr(errbuf, errlen, "manifest: ranks[%zu].boundary must be \"f16\" or \"f32\"", i);
                goto out;
            }
            r->boundary_bytes = strcmp(json_string_value(rb), "f32") ? 2 : 4;
        }
        mf->n_ranks = i + 1;
    }
    size_t n_keys = 0;
    for (size_t i = 0; i < mf->n_ranks; i++) n_keys += mf->ranks[i].key[0] != '\0';
    if (n_keys && n_keys != mf->n_ranks) {
        kvs_plan_seterr(errbuf, errlen,
                        "manifest: %zu of %zu ranks have a \"key\": a keyed ring needs every rank's key", n_keys,
                        mf->n_ranks);
        goto out;
    }
    if (at != mf->n_block) {
        kvs_plan_seterr(errbuf, errlen, "manifest: windows cover [0, %u) but the model has %u blocks", at,
                        mf->n_block);
        err = KVS_ERR_RANGE;
        goto out;
    }
    /* The ring must close: each rank connects to the listen of the one after
     * it, the last to rank 0 (compared as written, like the planner writes them). */
    for (size_t i = 0; i < mf->n_ranks; i++) {
        size_t j = (i + 1) % mf->n_ranks;
        if (strcmp(mf->ranks[i].next, mf->ranks[j].listen)) {
            kvs_plan_seterr(errbuf, errlen,
                            "manifest: ranks[%zu].next is \"%s\" but ranks[%zu].listen is \"%s\" (%s): the ring "
                            "does not close",
                            i, mf->ranks[i].next, j, mf->ranks[j].listen,
                            j ? "each rank's next must be the following rank's listen"
                              : "the last rank's next must be rank 0's listen");
            goto out;
        }
    }
    err = KVS_OK;
out:
    if (err)
        mf->n_ranks = 0;
    json_decref(root);
    return err;
}

kvs_err kvs_manifest_load(const char *path, struct kvs_manifest *mf, char *errbuf, size_t errlen)
{
    char *buf;
    size_t len;
    kvs_err err = kvs_plan_read_file(path, KVS_PLAN_MAX_JSON, &buf, &len, errbuf, errlen);
    if (err)
        return err;
    err = kvs_manifest_parse(buf, len, mf, errbuf, errlen);
    free(buf);
    return err;
}

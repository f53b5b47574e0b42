/* kvasir plan: place a model's blocks on an inventory of devices and write
 * the rank manifest (docs/PLAN.md, docs/MANIFEST.md). */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "gguf/gguf.h"
#include "plan/plan.h"
#include "shard/shard.h"

static void plan_usage(FILE *f)
{
    fprintf(f, "usage: kvasir plan (-m MODEL.gguf | --url URL) --devices devices.json [options] -o ring.json\n"
               "\n"
               "Places the model's blocks on the devices as a ring of contiguous windows (fastest predicted\n"
               "decode that fits in memory) and writes the rank manifest for `kvasir stage --manifest`.\n"
               "\n"
               "  -m, --model PATH     GGUF model (its header; its data is hashed once for the content id)\n"
               "  -m URL, --url URL    GGUF over HTTP (header only, range requests: nothing else is downloaded)\n"
               "  --content-id HEX     the model's content id for the manifest (`kvasir shard index` prints it):\n"
               "                       stages and fetches check the weights against it (docs/FORMATS.md);\n"
               "                       with -m PATH it is computed (and a given one checked)\n"
               "  --devices PATH       device inventory JSON (docs/PLAN.md)\n"
               "  --ctx N              context tokens per sequence (default min(model's, 4096))\n"
               "  --seqs S             concurrent sequences (default 1)\n"
               "  --boundary auto|f32|f16  boundary precision between stages (default auto: f32, the ring's\n"
               "                       output bit-identical to one process, except f16 on a link too slow for\n"
               "                       f32: one decode boundary in f32 takes > --f16-above-ms to send)\n"
               "  --f16-above-ms X     auto: the link time of an f32 decode boundary above which an edge goes\n"
               "                       f16 (default 5)\n"
               "  --block-overhead-ms X  fixed cost per block per token (default 0.02)\n"
               "  -o, --out PATH       manifest to write (default: print it to stdout, the table to stderr)\n"
               "  --relay-secret FILE  the relay's secret (docs/RELAY.md): mints the edge tokens of the edges of\n"
               "                       devices with \"accepts_inbound\": false, which go through the inventory's\n"
               "                       \"relay\": {\"url\": \"wss://HOST[:PORT]\"}\n"
               "\n"
               "A device entry of the inventory: run `kvasir bench --probe --name NAME` on the device; it\n"
               "prints one JSON object (measured decode_gbps, mem_bytes). Collect them in an array:\n"
               "  [{\"name\": \"a\", \"mem_bytes\": 8000000000, \"decode_gbps\": 20, \"addr\": \"10.0.0.5:7001\"}, ...]\n"
               "Formats and the cost model: docs/PLAN.md (inventory), docs/MANIFEST.md (manifest).\n");
}

static int parse_u32(const char *s, uint32_t lo, uint32_t hi, uint32_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

int kvs_cli_plan(int argc, char **argv)
{
    const char *model = NULL, *url = NULL, *devices = NULL, *outp = NULL, *relay_secret = NULL, *cid = NULL;
    struct kvs_plan_targets t = kvs_plan_default_targets();
    bool ctx_given = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            plan_usage(stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "kvasir plan: %s: missing value or unknown option\n", a);
            plan_usage(stderr);
            return 2;
        }
        i++;
        if ((!strcmp(a, "-m") || !strcmp(a, "--model")) && kvs_cli_is_url(v))
            url = v; /* the planner reads only the header: no download */
        else if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            model = v;
        else if (!strcmp(a, "--url"))
            url = v;
        else if (!strcmp(a, "--devices"))
            devices = v;
        else if (!strcmp(a, "--content-id"))
            cid = v;
        else if (!strcmp(a, "--relay-secret"))
            relay_secret = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--out"))
            outp = v;
        else if (!strcmp(a, "--ctx")) {
            if (parse_u32(v, 1, 1u << 24, &t.ctx)) {
                fprintf(stderr, "kvasir plan: --ctx must be 1..16777216\n");
                return 2;
            }
            ctx_given = true;
        } else if (!strcmp(a, "--seqs")) {
            if (parse_u32(v, 1, 4096, &t.seqs)) {
                fprintf(stderr, "kvasir plan: --seqs must be 1..4096\n");
                return 2;
            }
        } else if (!strcmp(a, "--boundary")) {
            if (!strcmp(v, "f16"))
                t.boundary_bytes = 2;
            else if (!strcmp(v, "f32"))
                t.boundary_bytes = 4;
            else if (!strcmp(v, "auto"))
                t.boundary_bytes = 0;
            else {
                fprintf(stderr, "kvasir plan: --boundary must be auto, f32 or f16\n");
                return 2;
            }
        } else if (!strcmp(a, "--f16-above-ms")) {
            char *end;
            double x = strtod(v, &end);
            if (end == v || *end || !(x >= 0) || x > 1e9) {
                fprintf(stderr, "kvasir plan: --f16-above-ms must be a number >= 0\n");
                return 2;
            }
            t.f16_above_ms = x;
        } else if (!strcmp(a, "--block-overhead-ms")) {
            char *end;
            double x = strtod(v, &end);
            if (end == v || *end || !(x >= 0) || x > 1e6) {
                fprintf(stderr, "kvasir plan: --block-overhead-ms must be a number >= 0\n");
                return 2;
            }
            t.block_overhead_ms = x;
        } else {
            fprintf(stderr, "kvasir plan: unknown option %s\n", a);
            plan_usage(stderr);
            return 2;
        }
    }
    if ((!model) == (!url) || !devices) {
        fprintf(stderr, "kvasir plan: give exactly one of -m/--url, and --devices\n");
        plan_usage(stderr);
        return 2;
    }

    int rc = 1;
    char err[512] = "";
    struct kvs_gguf *g = NULL;
    uint8_t *hdr = NULL;
    struct kvs_plan_model *m = NULL;
    struct kvs_plan_inventory *inv = malloc(sizeof *inv);
    struct kvs_plan_result *res = malloc(sizeof *res);
    char *json = NULL;
    kvs_err e;
    if (!inv || !res) {
        fprintf(stderr, "kvasir plan: out of memory\n");
        goto done;
    }
    e = model ? kvs_gguf_open(model, &g, err, sizeof err) : kvs_plan_fetch_header(url, &hdr, &g, err, sizeof err);
    if (e) {
        /* kvs_gguf_open's message names the file already; the header fetch's may not. */
        if (model)
            fprintf(stderr, "kvasir plan: %s (%s)\n", err, kvs_strerror(e));
        else
            fprintf(stderr, "kvasir plan: %s: %s (%s)\n", url, err, kvs_strerror(e));
        goto done;
    }
    if ((e = kvs_plan_model_from_gguf(g, &m, err, sizeof err))) {
        fprintf(stderr, "kvasir plan: model: %s (%s)\n", err, kvs_strerror(e));
        goto done;
    }
    /* The content id for the manifest: given, or hashed from a local file (one read of its data). */
    uint8_t cidb[32];
    if (cid) {
        if (!kvs_shard_unhex(cid, strlen(cid), cidb)) {
            fprintf(stderr, "kvasir plan: --content-id must be 64 hex digits\n");
            rc = 2;
            goto done;
        }
        kvs_shard_hex(cidb, m->content_id);
        if (model && kvs_shard_content_id(g, cidb, err, sizeof err) == KVS_OK) {
            char have[65];
            kvs_shard_hex(cidb, have);
            if (strcmp(have, m->content_id)) {
                fprintf(stderr, "kvasir plan: %s holds other weights (content id %.16s...) than --content-id\n",
                        model, have);
                rc = 1;
                goto done;
            }
        }
    } else if (model) {
        if (kvs_shard_content_id(g, cidb, err, sizeof err) == KVS_OK)
            kvs_shard_hex(cidb, m->content_id);
        err[0] = '\0';
    }
    if (!ctx_given) /* like run/serve/stage: never plan KV for more than the model's context */
        t.ctx = kvs_plan_default_ctx(m);
    if ((e = kvs_plan_inventory_load(devices, inv, err, sizeof err))) {
        fprintf(stderr, "kvasir plan: %s: %s (%s)\n", devices, err, kvs_strerror(e));
        rc = e == KVS_ERR_IO ? 1 : 2;
        goto done;
    }
    if (relay_secret) {
        FILE *f = fopen(relay_secret, "rb");
        size_t n = f ? fread(inv->relay_secret, 1, sizeof inv->relay_secret, f) : 0;
        bool more = f && fgetc(f) != EOF;
        if (f) fclose(f);
        while (n && (inv->relay_secret[n - 1] == '\n' || inv->relay_secret[n - 1] == '\r')) n--;
        if (!f || more || n < 16) {
            fprintf(stderr, "kvasir plan: --relay-secret %s: cannot read a secret of 16..256 bytes\n", relay_secret);
            rc = 2;
            goto done;
        }
        inv->relay_secret_len = n;
    }
    { /* A device without "addr" gets 127.0.0.1:(7001 + rank): fine when every stage runs on one
       * machine, wrong as soon as another device has a real address. */
        size_t with = 0, direct = 0; /* relay-only devices (accepts_inbound false) need no addr */
        char without[512] = "";
        for (size_t i = 0; i < inv->n_devices; i++) {
            if (!inv->devices[i].accepts_inbound) continue;
            direct++;
            if (inv->devices[i].addr[0]) {
                with++;
            } else {
                size_t k = strlen(without);
                snprintf(without + k, sizeof without - k, "%s'%s'", k ? ", " : "", inv->devices[i].name);
            }
        }
        if (with > 0 && with < direct)
            fprintf(stderr,
                    "kvasir plan: warning: %zu of %zu devices have an \"addr\" but %s %s none: their ranks will "
                    "listen on 127.0.0.1 and the others will dial 127.0.0.1 to reach them. Give every device its "
                    "\"addr\" (host:port that the others can reach: docs/DEPLOY.md)\n",
                    with, direct, without, direct - with == 1 ? "has" : "have");
    }
    if ((e = kvs_plan_solve(m, inv, &t, res, err, sizeof err))) {
        fprintf(stderr, "kvasir plan: %s: %s\n", kvs_strerror(e), err);
        goto done;
    }
    for (size_t r = 0; r < res->n_ranks; r++)
        if (kvs_plan_edge_relayed(inv, res, r) && (!inv->relay_url[0] || !inv->relay_secret_len)) {
            fprintf(stderr,
                    "kvasir plan: the edge from %s to %s goes through the relay (a device with \"accepts_inbound\": "
                    "false): the inventory needs \"relay\": {\"url\": \"wss://HOST[:PORT]\"} and the plan "
                    "--relay-secret FILE\n",
                    inv->devices[res->ranks[r].device].name,
                    inv->devices[res->ranks[(r + 1) % res->n_ranks].device].name);
            rc = 2;
            goto done;
        }
    /* The manifest is read by stages started elsewhere (another directory or
     * machine layout): a relative -m path would resolve against their cwd. */
    char *abs_model = model ? realpath(model, NULL) : NULL;
    e = kvs_plan_manifest_json(m, inv, &t, res, abs_model ? abs_model : model, url, &json);
    free(abs_model);
    if (e) {
        fprintf(stderr, "kvasir plan: manifest: %s\n", kvs_strerror(e));
        goto done;
    }

    /* The table is for people: on stdout beside a written manifest, on
     * stderr when the manifest itself goes to stdout (so it stays valid JSON). */
    FILE *tf = outp ? stdout : stderr;
    fprintf(tf, "model: %s  blocks %u  ctx %u  seqs %u  boundary %s\n", model ? model : url, m->n_block, t.ctx, t.seqs,
           t.boundary_bytes == 4 ? "f32" : t.boundary_bytes == 2 ? "f16" : "auto");
    fprintf(tf, "%-4s %-20s %-9s %6s %10s %9s %10s %8s %s\n", "rank", "device", "window", "blocks", "weights GB",
           "KV GB", "ms/token", "hop ms", "out");
    for (size_t r = 0; r < res->n_ranks; r++) {
        const struct kvs_plan_rank *rk = &res->ranks[r];
        char win[32];
        snprintf(win, sizeof win, "[%u,%u)", rk->begin, rk->end);
        fprintf(tf, "%-4zu %-20s %-9s %6u %10.3f %9.3f %10.3f %8.3f %s\n", r, inv->devices[rk->device].name, win,
               rk->end - rk->begin, (double)rk->weights_bytes / 1e9, (double)rk->kv_bytes / 1e9, rk->compute_ms,
               rk->hop_ms, r + 1 == res->n_ranks ? "token" : rk->boundary_bytes == 2 ? "f16" : "f32");
    }
    for (size_t i = 0; i < inv->n_devices; i++) {
        bool used = false;
        for (size_t r = 0; r < res->n_ranks; r++)
            used |= res->ranks[r].device == i;
        if (!used)
            fprintf(tf, "excluded: %s\n", inv->devices[i].name);
    }
    fprintf(tf, "predicted: %.3f ms/token, %.2f tokens/s (1 sequence)", res->token_ms, res->decode_tps_1);
    if (res->seqs > 1) /* with one sequence the pipelined figure is the same line again */
        fprintf(tf, ", %.2f tokens/s (%u sequences)", res->decode_tps_seqs, res->seqs);
    fprintf(tf, "%s\n", res->exhaustive ? "" : " [heuristic order]");
    if (outp) {
        FILE *f = fopen(outp, "w");
        if (!f || fputs(json, f) == EOF || fputc('\n', f) == EOF) {
            fprintf(stderr, "kvasir plan: %s: %s\n", outp, strerror(errno));
            if (f)
                fclose(f);
            goto done;
        }
        if (fclose(f)) {
            fprintf(stderr, "kvasir plan: %s: %s\n", outp, strerror(errno));
            goto done;
        }
        printf("manifest: %s\n", outp);
    } else {
        printf("%s\n", json);
    }
    rc = 0;
done:
    free(json);
    free(m);
    kvs_gguf_close(g);
    free(hdr);
    free(inv);
    free(res);
    return rc;
}

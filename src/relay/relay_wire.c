/* The relay's pure checks and tables (docs/RELAY.md §3, §4, §6, §7). */
#include "relay/relay.h"

#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "link/link.h"

static const struct {
    uint16_t code;
    const char *name, *reason;
} refusals[KVS_RELAY_REFUSAL_COUNT_] = {
    [KVS_RELAY_OK] = { 1000, "ok", "ok" },
    [KVS_RELAY_BAD_PATH] = { 4400, "bad_path", "path must be /edge/EDGE_ID" },
    [KVS_RELAY_NO_TOKEN] = { 4401, "no_token", "no edge token (Authorization: Bearer HEX)" },
    [KVS_RELAY_BAD_TOKEN] = { 4403, "bad_token", "wrong token for this edge" },
    [KVS_RELAY_BAD_ROLE] = { 4406, "bad_role", "first byte must be role 1 (up) or 2 (down)" },
    [KVS_RELAY_ROLE_TAKEN] = { 4409, "role_taken", "this end of the edge is held by a live connection" },
    [KVS_RELAY_TOO_BIG] = { 1009, "too_big", "message too big" },
    [KVS_RELAY_HANDSHAKE] = { 4408, "handshake_timeout", "no role preamble in time" },
    [KVS_RELAY_NO_PARTNER] = { 4410, "no_partner", "the other end did not come in time" },
    [KVS_RELAY_PER_ADDR] = { 4429, "per_address", "too many connections from this address" },
    [KVS_RELAY_FULL] = { 4503, "full", "too many unpaired connections" },
    [KVS_RELAY_PROTOCOL] = { 1003, "text_message", "only binary messages are relayed" },
};

uint16_t kvs_relay_refusal_code(enum kvs_relay_refusal r)
{
    return (unsigned)r < KVS_RELAY_REFUSAL_COUNT_ ? refusals[r].code : 1011;
}

const char *kvs_relay_refusal_name(enum kvs_relay_refusal r)
{
    return (unsigned)r < KVS_RELAY_REFUSAL_COUNT_ ? refusals[r].name : "unknown";
}

const char *kvs_relay_refusal_reason(enum kvs_relay_refusal r)
{
    return (unsigned)r < KVS_RELAY_REFUSAL_COUNT_ ? refusals[r].reason : "unknown";
}

enum kvs_relay_refusal kvs_relay_check_request(const char *uri, const char *auth, const uint8_t *secret,
                                               size_t secret_len, char edge[65])
{
    edge[0] = '\0';
    if (!uri || strncmp(uri, "/edge/", 6)) return KVS_RELAY_BAD_PATH;
    const char *id = uri + 6;
    size_t il = strlen(id);
    if (!kvs_relay_edge_valid(id, il)) return KVS_RELAY_BAD_PATH;
    if (!auth) return KVS_RELAY_NO_TOKEN;
    while (*auth == ' ') auth++;
    if (strncmp(auth, "Bearer ", 7)) return KVS_RELAY_NO_TOKEN;
    const char *t = auth + 7;
    while (*t == ' ') t++;
    size_t tl = strlen(t);
    while (tl && (t[tl - 1] == ' ' || t[tl - 1] == '\t')) tl--;
    if (tl != KVS_RELAY_TOKEN_HEX) return KVS_RELAY_NO_TOKEN;
    char got[KVS_RELAY_TOKEN_HEX + 1];
    for (size_t i = 0; i < tl; i++) {
        char c = t[i];
        if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return KVS_RELAY_NO_TOKEN;
        got[i] = c;
    }
    got[tl] = '\0';
    memcpy(edge, id, il);
    edge[il] = '\0';
    char want[KVS_RELAY_TOKEN_HEX + 1];
    if (kvs_relay_token(secret, secret_len, edge, want) != KVS_OK || !kvs_relay_token_equal(got, want))
        return KVS_RELAY_BAD_TOKEN;
    return KVS_RELAY_OK;
}

enum kvs_relay_refusal kvs_relay_check_preamble(const uint8_t *msg, size_t len, uint8_t *role)
{
    if (!msg || len < 1) return KVS_RELAY_BAD_ROLE;
    if (msg[0] != KVS_RELAY_ROLE_UP && msg[0] != KVS_RELAY_ROLE_DOWN) return KVS_RELAY_BAD_ROLE;
    *role = msg[0];
    return KVS_RELAY_OK;
}

size_t kvs_relay_metrics_text(const struct kvs_relay_stats *st, char *buf, size_t cap)
{
    size_t n = 0;
#define PUT(...)                                                                                           \
    do {                                                                                                   \
        if (n < cap) {                                                                                     \
            int w = snprintf(buf + n, cap - n, __VA_ARGS__);                                               \
            if (w > 0) n += (size_t)w;                                                                     \
        }                                                                                                  \
    } while (0)
    PUT("# HELP kvasir_relay_connections Open WebSocket connections.\n# TYPE kvasir_relay_connections gauge\n");
    PUT("kvasir_relay_connections %llu\n", (unsigned long long)st->connections);
    PUT("# HELP kvasir_relay_unpaired Connections waiting for their partner.\n# TYPE kvasir_relay_unpaired gauge\n");
    PUT("kvasir_relay_unpaired %llu\n", (unsigned long long)st->unpaired);
    PUT("# HELP kvasir_relay_edges_paired Edges with both ends connected.\n# TYPE kvasir_relay_edges_paired gauge\n");
    PUT("kvasir_relay_edges_paired %llu\n", (unsigned long long)st->edges_paired);
    PUT("# HELP kvasir_relay_pairings_total Times an edge became paired.\n# TYPE kvasir_relay_pairings_total counter\n");
    PUT("kvasir_relay_pairings_total %llu\n", (unsigned long long)st->pairings);
    PUT("# HELP kvasir_relay_takeovers_total Dead holders of a role replaced by a new connection.\n"
        "# TYPE kvasir_relay_takeovers_total counter\n");
    PUT("kvasir_relay_takeovers_total %llu\n", (unsigned long long)st->takeovers);
    PUT("# HELP kvasir_relay_buffered_max_bytes Most bytes one edge direction held at once.\n"
        "# TYPE kvasir_relay_buffered_max_bytes gauge\n");
    PUT("kvasir_relay_buffered_max_bytes %llu\n", (unsigned long long)st->buffered_max);
    PUT("# HELP kvasir_relay_bytes_total Bytes forwarded, by direction.\n# TYPE kvasir_relay_bytes_total counter\n");
    PUT("kvasir_relay_bytes_total{direction=\"up_to_down\"} %llu\n", (unsigned long long)st->bytes_up);
    PUT("kvasir_relay_bytes_total{direction=\"down_to_up\"} %llu\n", (unsigned long long)st->bytes_down);
    PUT("# HELP kvasir_relay_refusals_total Connections refused or closed, by reason.\n"
        "# TYPE kvasir_relay_refusals_total counter\n");
    for (int i = 1; i < KVS_RELAY_REFUSAL_COUNT_; i++)
        PUT("kvasir_relay_refusals_total{reason=\"%s\"} %llu\n", kvs_relay_refusal_name((enum kvs_relay_refusal)i),
            (unsigned long long)st->refusals[i]);
#undef PUT
    if (n >= cap) n = cap ? cap - 1 : 0;
    return n;
}

/* libFuzzer target for the relay's handshake and preamble parsing
 * (src/relay/relay_wire.c, docs/RELAY.md §3-§4): the input is split into a
 * request path, an Authorization value and a first message; each goes
 * through kvs_relay_check_request / kvs_relay_check_preamble, and the path
 * also as a relay URL through kvs_ws_url_parse. Must never crash or read
 * out of bounds. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "link/link.h"
#include "relay/relay.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static char *take(const uint8_t **p, size_t *n)
{
    const uint8_t *nl = memchr(*p, '\n', *n);
    size_t len = nl ? (size_t)(nl - *p) : *n;
    char *s = malloc(len + 1);
    if (!s) return NULL;
    memcpy(s, *p, len);
    s[len] = '\0';
    *p += nl ? len + 1 : len;
    *n -= nl ? len + 1 : len;
    return s;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const uint8_t secret[] = "fuzz-relay-secret-0123456789";
    const uint8_t *p = data;
    size_t n = size;
    char *uri = take(&p, &n);
    char *auth = take(&p, &n);
    if (uri && auth) {
        char edge[65];
        enum kvs_relay_refusal v = kvs_relay_check_request(uri, auth[0] ? auth : NULL, secret, sizeof secret - 1, edge);
        if (v == KVS_RELAY_OK && strlen(edge) > 64) abort();
        (void)kvs_relay_refusal_code(v);
        uint8_t role = 0;
        if (kvs_relay_check_preamble(p, n, &role) == KVS_RELAY_OK && role != 1 && role != 2) abort();
        struct kvs_ws_url u;
        char err[256];
        if (kvs_ws_url_parse(uri, &u, err, sizeof err) == KVS_OK && (!u.port || !u.edge[0])) abort();
    }
    free(uri);
    free(auth);
    return 0;
}

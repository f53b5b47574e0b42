/* libFuzzer target for the API's request parser (src/api): the first byte
 * picks completion or chat, the rest is the body. A parsed request is then
 * run through the response builder and the stop scan over its own prompt.
 * Must never crash, leak or read out of bounds, whatever the bytes. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    enum kvs_api_kind kind = (data[0] & 1) ? KVS_API_CHAT : KVS_API_COMPLETION;
    struct kvs_api_request r;
    struct kvs_api_error e;
    if (kvs_api_parse_request(kind, (const char *)data + 1, size - 1, &r, &e)) {
        free(kvs_api_error_json(&e));
        return 0;
    }
    const char *text = r.prompt ? r.prompt : (r.n_messages ? r.messages[0].content : "");
    size_t len = r.prompt ? r.prompt_len : strlen(text);
    bool hit;
    size_t cut = kvs_api_stop_scan(text, len, 0, r.stop, r.n_stop, &hit);
    if (cut > len) abort();
    struct kvs_api_result res = { .id = "x", .model = "m", .text = text, .text_len = cut,
                                  .finish_reason = hit ? "stop" : NULL, .prompt_tokens = r.n_prompt_ids };
    free(kvs_api_response_json(kind, &res));
    free(kvs_api_chunk_json(kind, &res, false, false));
    kvs_api_request_free(&r);
    return 0;
}

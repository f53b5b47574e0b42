/* Chat templates chosen from `tokenizer.chat_template`: ChatML (Qwen,
 * detected by "<|im_start|>") and Llama 3 (detected by "<|start_header_id|>"). */
#ifndef KVS_CHAT_H
#define KVS_CHAT_H

#include <stdbool.h>
#include <stddef.h>

#include "common/error.h"

enum kvs_chat_template { KVS_CHAT_NONE = 0, KVS_CHAT_CHATML, KVS_CHAT_LLAMA3 };

struct kvs_chat_message {
    const char *role;    /* "system", "user", "assistant" */
    const char *content;
};

/* Detects the template family from the Jinja source (NULL -> NONE). */
enum kvs_chat_template kvs_chat_detect(const char *jinja, size_t len);

/* Renders messages with the template; add_generation_prompt appends the
 * assistant header. Writes a NUL-terminated string to out (cap bytes) and
 * returns the length it needs (excluding NUL); < 0 (a negative kvs_err) on
 * error: KVS_ERR_UNSUPPORTED for KVS_CHAT_NONE. */
long kvs_chat_render(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n,
                     bool add_generation_prompt, char *out, size_t cap);

#endif

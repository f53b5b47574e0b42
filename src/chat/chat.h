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
 * error: KVS_ERR_UNSUPPORTED for KVS_CHAT_NONE, KVS_ERR_ARG for a NULL
 * role/content (or msgs NULL with n > 0). When the return value is >= cap
 * the output was cut (still NUL-terminated if cap > 0): retry with more room.
 *
 * Formats (llama.cpp's built-in formatter, gguf-facts §5.4):
 *   CHATML  per message "<|im_start|>{role}\n{content}<|im_end|>\n";
 *           generation prompt "<|im_start|>assistant\n". No BOS.
 *   LLAMA3  "<|begin_of_text|>" once, then per message
 *           "<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>";
 *           generation prompt "<|start_header_id|>assistant<|end_header_id|>\n\n".
 * The rendered text contains the special-token texts (and, for LLAMA3, the
 * BOS text itself): tokenize it with parse_special = true and
 * add_bos = kvs_chat_wants_bos(t) (false for both families). */
long kvs_chat_render(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n,
                     bool add_generation_prompt, char *out, size_t cap);

/* Whether the caller should still add BOS when tokenizing a rendered chat:
 * false for CHATML (Qwen adds none) and LLAMA3 (its BOS is in the text). */
bool kvs_chat_wants_bos(enum kvs_chat_template t);

/* Name of the template family ("none", "chatml", "llama3"). Static string. */
const char *kvs_chat_name(enum kvs_chat_template t);
/* The family named name ("chatml" or "llama3", as kvs_chat_name spells them);
 * KVS_CHAT_NONE for NULL or any other name. */
enum kvs_chat_template kvs_chat_from_name(const char *name);

#endif

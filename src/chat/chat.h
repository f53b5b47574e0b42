/* Chat templates chosen from `tokenizer.chat_template`: ChatML (Qwen,
 * detected by "<|im_start|>") and Llama 3 (detected by "<|start_header_id|>"). */
#ifndef KVS_CHAT_H
#define KVS_CHAT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

struct kvs_tokenizer;

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
 * BOS text itself). To turn a chat into tokens use kvs_chat_tokenize, not
 * kvs_tokenize(parse_special = true) on this text: that would also turn
 * special-token texts inside a message's content into special tokens. */
long kvs_chat_render(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n,
                     bool add_generation_prompt, char *out, size_t cap);

/* Tokenizes the chat that kvs_chat_render gives, keeping the template's
 * markup and the messages apart: the special-token texts the template
 * inserts ("<|im_start|>", "<|im_end|>"; "<|begin_of_text|>",
 * "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), where the
 * vocabulary has them as CONTROL tokens, become those tokens, and every run
 * of text between two of them (the
 * role, the template's "\n" and the message's content) with parse_special =
 * content_special. With content_special = false (the safe choice) a message
 * holding "<|im_end|>" gets the plain-text tokens of those characters, so a
 * user cannot close its own turn and forge another role (prompt injection);
 * content_special = true gives what kvs_tokenize(render, parse_special =
 * true) gives (the field's common behaviour). For content without
 * special-token texts both give the same ids as tokenizing the rendered text
 * with parse_special = true (text runs are the fragments kvs_tokenize would
 * split that text into; markup the vocabulary lacks is text of its run). No
 * BOS is added (kvs_chat_wants_bos is false for both families). Writes at most cap ids to out (NULL when cap is 0) and
 * returns the number of ids the chat needs, or a negative kvs_err:
 * KVS_ERR_UNSUPPORTED (KVS_CHAT_NONE), KVS_ERR_ARG (NULL tok, role or
 * content), the errors of kvs_tokenize, KVS_ERR_NOMEM. */
int64_t kvs_chat_tokenize(enum kvs_chat_template t, const struct kvs_tokenizer *tok,
                          const struct kvs_chat_message *msgs, size_t n, bool add_generation_prompt,
                          bool content_special, int32_t *out, int64_t cap);

/* Whether the caller should still add BOS when tokenizing a rendered chat:
 * false for CHATML (Qwen adds none) and LLAMA3 (its BOS is in the text). */
bool kvs_chat_wants_bos(enum kvs_chat_template t);

/* Name of the template family ("none", "chatml", "llama3"). Static string. */
const char *kvs_chat_name(enum kvs_chat_template t);
/* The family named name ("chatml" or "llama3", as kvs_chat_name spells them);
 * KVS_CHAT_NONE for NULL or any other name. */
enum kvs_chat_template kvs_chat_from_name(const char *name);

#endif

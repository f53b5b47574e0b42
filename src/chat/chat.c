/* Chat templates: family detection by substring (as llama.cpp's built-in
 * formatter does) and rendering of the two supported families. */
#include "chat/chat.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

static bool contains(const char *s, size_t n, const char *lit)
{
    return memmem(s, n, lit, strlen(lit)) != NULL;
}

enum kvs_chat_template kvs_chat_detect(const char *jinja, size_t len)
{
    if (!jinja)
        return KVS_CHAT_NONE;
    if (contains(jinja, len, "<|im_start|>"))
        return KVS_CHAT_CHATML;
    if (contains(jinja, len, "<|start_header_id|>"))
        return KVS_CHAT_LLAMA3;
    return KVS_CHAT_NONE;
}

bool kvs_chat_wants_bos(enum kvs_chat_template t)
{
    (void)t;
    return false;
}

const char *kvs_chat_name(enum kvs_chat_template t)
{
    switch (t) {
    case KVS_CHAT_CHATML: return "chatml";
    case KVS_CHAT_LLAMA3: return "llama3";
    case KVS_CHAT_NONE: break;
    }
    return "none";
}

enum kvs_chat_template kvs_chat_from_name(const char *name)
{
    if (name && !strcmp(name, "chatml"))
        return KVS_CHAT_CHATML;
    if (name && !strcmp(name, "llama3"))
        return KVS_CHAT_LLAMA3;
    return KVS_CHAT_NONE;
}

/* Appends to out while there is room (keeping one byte for the NUL) and
 * counts everything; flags overflow of the count. */
struct strbuf {
    char *out;
    size_t cap, n;
    bool overflow;
};

static void put(struct strbuf *b, const char *s)
{
    size_t l = strlen(s);
    if (l > SIZE_MAX - b->n) {
        b->overflow = true;
        return;
    }
    if (b->cap && b->n < b->cap - 1) {
        size_t room = b->cap - 1 - b->n;
        memcpy(b->out + b->n, s, l < room ? l : room);
    }
    b->n += l;
}

long kvs_chat_render(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n,
                     bool add_generation_prompt, char *out, size_t cap)
{
    if (t != KVS_CHAT_CHATML && t != KVS_CHAT_LLAMA3)
        return -(long)KVS_ERR_UNSUPPORTED;
    if ((!msgs && n) || (!out && cap))
        return -(long)KVS_ERR_ARG;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return -(long)KVS_ERR_ARG;
    struct strbuf b = { out, cap, 0, false };
    if (t == KVS_CHAT_CHATML) {
        for (size_t i = 0; i < n; i++) {
            put(&b, "<|im_start|>");
            put(&b, msgs[i].role);
            put(&b, "\n");
            put(&b, msgs[i].content);
            put(&b, "<|im_end|>\n");
        }
        if (add_generation_prompt)
            put(&b, "<|im_start|>assistant\n");
    } else {
        put(&b, "<|begin_of_text|>");
        for (size_t i = 0; i < n; i++) {
            put(&b, "<|start_header_id|>");
            put(&b, msgs[i].role);
            put(&b, "<|end_header_id|>\n\n");
            put(&b, msgs[i].content);
            put(&b, "<|eot_id|>");
        }
        if (add_generation_prompt)
            put(&b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
    }
    if (b.overflow || b.n > (size_t)LONG_MAX)
        return -(long)KVS_ERR_RANGE;
    if (cap)
        out[b.n < cap ? b.n : cap - 1] = 0;
    return (long)b.n;
}

/* Chat templates: family detection by substring (as llama.cpp's built-in
 * formatter does) and rendering of the two supported families. */
#include "chat/chat.h"

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer.h"

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

/* The rendering as a sequence of pieces: markup pieces that are special-token
 * texts (special = true) and text pieces (the template's plain markup such as
 * "\n", the role, the content). emit gets each piece in order. */
typedef void (*piece_fn)(void *ctx, const char *s, bool special);

static void walk(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n,
                 bool add_generation_prompt, piece_fn emit, void *ctx)
{
    if (t == KVS_CHAT_CHATML) {
        for (size_t i = 0; i < n; i++) {
            emit(ctx, "<|im_start|>", true);
            emit(ctx, msgs[i].role, false);
            emit(ctx, "\n", false);
            emit(ctx, msgs[i].content, false);
            emit(ctx, "<|im_end|>", true);
            emit(ctx, "\n", false);
        }
        if (add_generation_prompt) {
            emit(ctx, "<|im_start|>", true);
            emit(ctx, "assistant\n", false);
        }
    } else {
        emit(ctx, "<|begin_of_text|>", true);
        for (size_t i = 0; i < n; i++) {
            emit(ctx, "<|start_header_id|>", true);
            emit(ctx, msgs[i].role, false);
            emit(ctx, "<|end_header_id|>", true);
            emit(ctx, "\n\n", false);
            emit(ctx, msgs[i].content, false);
            emit(ctx, "<|eot_id|>", true);
        }
        if (add_generation_prompt) {
            emit(ctx, "<|start_header_id|>", true);
            emit(ctx, "assistant", false);
            emit(ctx, "<|end_header_id|>", true);
            emit(ctx, "\n\n", false);
        }
    }
}

static kvs_err check_args(enum kvs_chat_template t, const struct kvs_chat_message *msgs, size_t n)
{
    if (t != KVS_CHAT_CHATML && t != KVS_CHAT_LLAMA3)
        return KVS_ERR_UNSUPPORTED;
    if (!msgs && n)
        return KVS_ERR_ARG;
    for (size_t i = 0; i < n; i++)
        if (!msgs[i].role || !msgs[i].content)
            return KVS_ERR_ARG;
    return KVS_OK;
}

/* Appends to out while there is room (keeping one byte for the NUL) and
 * counts everything; flags overflow of the count. */
struct strbuf {
    char *out;
    size_t cap, n;
    bool overflow;
};

static void put(void *ctx, const char *s, bool special)
{
    (void)special;
    struct strbuf *b = ctx;
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
    kvs_err e = check_args(t, msgs, n);
    if (e)
        return -(long)e;
    if (!out && cap)
        return -(long)KVS_ERR_ARG;
    struct strbuf b = { out, cap, 0, false };
    walk(t, msgs, n, add_generation_prompt, put, &b);
    if (b.overflow || b.n > (size_t)LONG_MAX)
        return -(long)KVS_ERR_RANGE;
    if (cap)
        out[b.n < cap ? b.n : cap - 1] = 0;
    return (long)b.n;
}

/* Tokenizing sink: text pieces gather into one run (so that a role, its
 * "\n" and the content are one fragment, as in the rendered string) and
 * are tokenized when the next special piece (or the end) comes. */
struct toksink {
    const struct kvs_tokenizer *tok;
    bool content_special;
    char *run;
    size_t len, cap;
    int32_t *out;
    int64_t cap_out, n;
    kvs_err err;
};

static void tok_add(struct toksink *s, const char *text, size_t len, bool special)
{
    if (s->err || !len)
        return;
    int64_t room = s->n < s->cap_out ? s->cap_out - s->n : 0;
    int64_t r = kvs_tokenize(s->tok, text, len, false, special, room ? s->out + s->n : NULL, room);
    if (r < 0) {
        s->err = (kvs_err)-r;
        return;
    }
    if (r > INT64_MAX - s->n) {
        s->err = KVS_ERR_RANGE;
        return;
    }
    s->n += r;
}

static void tok_flush(struct toksink *s)
{
    tok_add(s, s->run, s->len, s->content_special);
    s->len = 0;
}

static void tok_piece(void *ctx, const char *text, bool special)
{
    struct toksink *s = ctx;
    if (s->err)
        return;
    size_t l = strlen(text);
    if (special) {
        /* markup that is one CONTROL token of this vocabulary (its plain
         * piece is empty); otherwise (a ChatML fallback on a vocabulary
         * without <|im_start|>, say) it is text of the run, as it would be
         * in the rendered string */
        int32_t id[2];
        if (kvs_tokenize(s->tok, text, l, false, true, id, 2) == 1 && kvs_token_to_piece(s->tok, id[0], false, NULL, 0) == 0) {
            tok_flush(s);
            tok_add(s, text, l, true);
            return;
        }
    }
    if (l > SIZE_MAX / 2 - s->len) {
        s->err = KVS_ERR_RANGE;
        return;
    }
    if (s->len + l > s->cap) {
        size_t nc = s->cap ? s->cap : 256;
        while (nc < s->len + l)
            nc *= 2;
        char *p = realloc(s->run, nc);
        if (!p) {
            s->err = KVS_ERR_NOMEM;
            return;
        }
        s->run = p;
        s->cap = nc;
    }
    memcpy(s->run + s->len, text, l);
    s->len += l;
}

int64_t kvs_chat_tokenize(enum kvs_chat_template t, const struct kvs_tokenizer *tok,
                          const struct kvs_chat_message *msgs, size_t n, bool add_generation_prompt,
                          bool content_special, int32_t *out, int64_t cap)
{
    kvs_err e = check_args(t, msgs, n);
    if (e)
        return -(int64_t)e;
    if (!tok || cap < 0 || (!out && cap))
        return -(int64_t)KVS_ERR_ARG;
    struct toksink s = { .tok = tok, .content_special = content_special, .out = out, .cap_out = cap };
    walk(t, msgs, n, add_generation_prompt, tok_piece, &s);
    tok_flush(&s);
    free(s.run);
    return s.err ? -(int64_t)s.err : s.n;
}

/* Tokenizer algorithms on small in-memory vocabularies (built through
 * tokenizer_impl.h's kvs_tokenizer_build). Every expected id list below is
 * worked out by hand in the comments from gguf-facts §5.3 / §5.4. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tokenizer_impl.h"

/* ---- SPM vocabulary ------------------------------------------------------
 * 0 <unk> UNKNOWN, 1 <s> CONTROL, 2 </s> CONTROL, 3..258 <0x00>..<0xFF> BYTE,
 * then NORMAL pieces with scores, and one USER_DEFINED token. */
enum { SP_SPACE = 259, SP_A, SP_B, SP_C, SP_AB, SP_BC, SP_SA, SP_ABC, SP_USER, SP_N };

struct vocab {
    char text[SP_N][16];
    float scores[SP_N];
    int32_t types[SP_N];
    const char *const *merges;
    size_t n_tokens;
};

static void set_text(char dst[16], const char *s)
{
    snprintf(dst, 16, "%s", s);
}

static kvs_err get_tok(void *ctx, uint64_t i, const char **s, size_t *len)
{
    struct vocab *v = ctx;
    *s = v->text[i];
    *len = strlen(v->text[i]);
    return KVS_OK;
}

static kvs_err get_merge(void *ctx, uint64_t i, const char **s, size_t *len)
{
    struct vocab *v = ctx;
    *s = v->merges[i];
    *len = strlen(v->merges[i]);
    return KVS_OK;
}

static struct kvs_tokenizer *spm_vocab(struct vocab *v, int64_t eot)
{
    memset(v, 0, sizeof *v);
    set_text(v->text[0], "<unk>");
    v->types[0] = KVS_TOK_TYPE_UNKNOWN;
    set_text(v->text[1], "<s>");
    v->types[1] = KVS_TOK_TYPE_CONTROL;
    set_text(v->text[2], "</s>");
    v->types[2] = KVS_TOK_TYPE_CONTROL;
    for (int b = 0; b < 256; b++) {
        snprintf(v->text[3 + b], 16, "<0x%02X>", b);
        v->types[3 + b] = KVS_TOK_TYPE_BYTE;
    }
    static const struct { const char *s; float score; } pieces[] = {
        { "\xE2\x96\x81", -1.0f }, /* "▁" */
        { "a", -2.0f },
        { "b", -2.0f },
        { "c", -2.0f },
        { "ab", -3.0f },
        { "bc", -1.0f },
        { "\xE2\x96\x81" "a", -4.0f },
        { "abc", -5.0f },
    };
    for (int i = 0; i < 8; i++) {
        set_text(v->text[SP_SPACE + i], pieces[i].s);
        v->scores[SP_SPACE + i] = pieces[i].score;
        v->types[SP_SPACE + i] = KVS_TOK_TYPE_NORMAL;
    }
    set_text(v->text[SP_USER], "<|user|>");
    v->types[SP_USER] = KVS_TOK_TYPE_USER_DEFINED;
    struct kvs_tok_desc d = {
        .kind = KVS_TOK_KIND_SPM, .n_tokens = SP_N, .ctx = v, .token = get_tok, .scores = v->scores,
        .types = v->types, .bos = -1, .eos = -1, .unk = -1, .eot = eot, .eom = -1, .add_bos = -1,
        .add_space_prefix = -1,
    };
    struct kvs_tokenizer *t = NULL;
    char err[128];
    assert_int_equal(kvs_tokenizer_build(&d, &t, err, sizeof err), KVS_OK);
    return t;
}

static void expect(const struct kvs_tokenizer *t, const char *text, bool bos, bool special, const int32_t *want,
                   int64_t nw)
{
    int32_t ids[64];
    int64_t n = kvs_tokenize(t, text, strlen(text), bos, special, ids, 64);
    if (n != nw || (nw && memcmp(ids, want, (size_t)nw * sizeof *ids))) {
        fprintf(stderr, "text \"%s\": got", text);
        for (int64_t i = 0; i < n && i < 64; i++)
            fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n");
    }
    assert_int_equal(n, nw);
    if (nw)
        assert_memory_equal(ids, want, (size_t)nw * sizeof *ids);
}

static void test_spm_merges(void **state)
{
    (void)state;
    struct vocab v;
    struct kvs_tokenizer *t = spm_vocab(&v, -1);
    /* SPM defaults (§5.1): bos 1, eos 2, add_bos true. */
    assert_int_equal(kvs_tokenizer_bos(t), 1);
    assert_int_equal(kvs_tokenizer_eos(t), 2);
    assert_true(kvs_tokenizer_add_bos(t));
    /* "abc" -> "▁abc": pairs ▁a(-4) ab(-3) bc(-1); bc wins; then a+bc="abc"
     * (-5) is queued; ab is stale; ▁a(-4) merges; ▁a+bc is no token; abc is
     * stale. Result ▁a, bc. */
    expect(t, "abc", false, false, (const int32_t[]){ SP_SA, SP_BC }, 2);
    expect(t, "abc", true, false, (const int32_t[]){ 1, SP_SA, SP_BC }, 3);
    /* "é" (C3 A9): "▁é" is no token; é falls back to <0xC3> <0xA9>. */
    expect(t, "\xC3\xA9", false, false, (const int32_t[]){ SP_SPACE, 3 + 0xC3, 3 + 0xA9 }, 3);
    /* spaces: " a" -> "▁▁a" -> ▁, ▁a */
    expect(t, " a", false, false, (const int32_t[]){ SP_SPACE, SP_SA }, 2);
    /* empty text gives nothing, not even the space prefix */
    expect(t, "", false, false, NULL, 0);
    expect(t, "", true, false, (const int32_t[]){ 1 }, 1);
    /* A too-small buffer: the count is still the full one. */
    int32_t one[1];
    assert_int_equal(kvs_tokenize(t, "abc", 3, true, false, one, 1), 3);
    assert_int_equal(one[0], 1);
    assert_int_equal(kvs_tokenize(t, "abc", 3, true, false, NULL, 0), 3);
    kvs_tokenizer_free(t);
}

static void test_spm_special(void **state)
{
    (void)state;
    struct vocab v;
    struct kvs_tokenizer *t = spm_vocab(&v, -1);
    /* parse_special: "a", <s>, "b"; the fragment after a special token gets
     * the space prefix again: "▁b" -> ▁, b. */
    expect(t, "a<s>b", false, true, (const int32_t[]){ SP_SA, 1, SP_SPACE, SP_B }, 4);
    /* Without it "<s>" is text: '<' 0x3C, 's' 0x73, '>' 0x3E as byte tokens. */
    expect(t, "a<s>b", false, false, (const int32_t[]){ SP_SA, 3 + 0x3C, 3 + 0x73, 3 + 0x3E, SP_B }, 5);
    /* USER_DEFINED tokens always match. */
    expect(t, "<|user|>a", false, false, (const int32_t[]){ SP_USER, SP_SA }, 2);
    /* <unk> is UNKNOWN: matched only with parse_special. */
    expect(t, "<unk>", false, true, (const int32_t[]){ 0 }, 1);
    kvs_tokenizer_free(t);
}

static void test_spm_detok(void **state)
{
    (void)state;
    struct vocab v;
    struct kvs_tokenizer *t = spm_vocab(&v, 259 + 1 /* "a" as eot, for the eog test */);
    char buf[32];
    assert_int_equal(kvs_token_to_piece(t, SP_SA, false, buf, sizeof buf), 2);
    assert_memory_equal(buf, " a", 2);
    assert_int_equal(kvs_token_to_piece(t, 1, false, buf, sizeof buf), 0);
    assert_int_equal(kvs_token_to_piece(t, 1, true, buf, sizeof buf), 3);
    assert_memory_equal(buf, "<s>", 3);
    assert_int_equal(kvs_token_to_piece(t, 3 + 0xC3, false, buf, sizeof buf), 1);
    assert_int_equal((uint8_t)buf[0], 0xC3);
    assert_int_equal(kvs_token_to_piece(t, SP_USER, false, buf, sizeof buf), 8);
    /* short buffer: full length returned, only cap bytes written */
    buf[1] = 'x';
    assert_int_equal(kvs_token_to_piece(t, SP_SA, false, buf, 1), 2);
    assert_int_equal(buf[1], 'x');
    assert_true(kvs_token_to_piece(t, SP_N, false, buf, sizeof buf) < 0);
    assert_true(kvs_token_to_piece(t, -1, false, buf, sizeof buf) < 0);

    /* Streaming: "é" split over two byte tokens is held back until whole. */
    struct kvs_detok d;
    kvs_detok_init(&d, t, true);
    assert_int_equal(kvs_detok_push(&d, SP_SA, buf, sizeof buf), 1); /* " a" minus the leading space */
    assert_int_equal(buf[0], 'a');
    assert_int_equal(kvs_detok_push(&d, SP_SPACE, buf, sizeof buf), 1); /* later spaces stay */
    assert_int_equal(buf[0], ' ');
    assert_int_equal(kvs_detok_push(&d, 3 + 0xC3, buf, sizeof buf), 0);
    assert_int_equal(kvs_detok_push(&d, 1, buf, sizeof buf), 0); /* control: nothing, still pending */
    assert_int_equal(kvs_detok_push(&d, 3 + 0xA9, buf, sizeof buf), 2);
    assert_memory_equal(buf, "\xC3\xA9", 2);
    /* A 3-byte character over three tokens: € = E2 82 AC. */
    assert_int_equal(kvs_detok_push(&d, 3 + 0xE2, buf, sizeof buf), 0);
    assert_int_equal(kvs_detok_push(&d, 3 + 0x82, buf, sizeof buf), 0);
    /* no room: error, state kept */
    assert_int_equal(kvs_detok_push(&d, 3 + 0xAC, buf, 2), -(int64_t)KVS_ERR_RANGE);
    assert_int_equal(kvs_detok_push(&d, 3 + 0xAC, buf, sizeof buf), 3);
    assert_memory_equal(buf, "\xE2\x82\xAC", 3);
    /* An invalid byte becomes U+FFFD at once; a dangling lead at flush. */
    assert_int_equal(kvs_detok_push(&d, 3 + 0xFF, buf, sizeof buf), 3);
    assert_memory_equal(buf, "\xEF\xBF\xBD", 3);
    assert_int_equal(kvs_detok_push(&d, 3 + 0xE2, buf, sizeof buf), 0);
    assert_int_equal(kvs_detok_flush(&d, buf, sizeof buf), 3);
    assert_memory_equal(buf, "\xEF\xBF\xBD", 3);
    assert_int_equal(kvs_detok_flush(&d, buf, sizeof buf), 0);
    /* A lead byte followed by a non-continuation: FFFD then the ASCII. */
    assert_int_equal(kvs_detok_push(&d, 3 + 0xC3, buf, sizeof buf), 0);
    assert_int_equal(kvs_detok_push(&d, SP_B, buf, sizeof buf), 4);
    assert_memory_equal(buf, "\xEF\xBF\xBD" "b", 4);

    /* is_eog: eos (default 2) and the eot key. */
    assert_true(kvs_tokenizer_is_eog(t, 2));
    assert_true(kvs_tokenizer_is_eog(t, SP_A));
    assert_false(kvs_tokenizer_is_eog(t, 1));
    assert_false(kvs_tokenizer_is_eog(t, -5));
    assert_false(kvs_tokenizer_is_eog(t, SP_N));
    kvs_tokenizer_free(t);
}

/* ---- BPE vocabulary ------------------------------------------------------
 * Byte alphabet (§5.4): ' ' -> U+0120 "Ġ" (C4 A0), '\n' -> U+010A "Ċ" (C4 8A). */
static const char *const k_bpe_tokens[] = {
    "h", "e", "l", "o", "\xC4\xA0", "w", "r", "d", "he", "ll", "hell", "hello", "\xC4\xA0w", "\xC4\x8A",
    "<|end|>",
};
static const char *const k_bpe_merges[] = { "h e", "l l", "he ll", "hell o", "\xC4\xA0 w" };

static struct kvs_tokenizer *bpe_vocab(struct vocab *v, enum kvs_tok_pre pre, size_t n_merges)
{
    memset(v, 0, sizeof *v);
    size_t n = sizeof k_bpe_tokens / sizeof k_bpe_tokens[0];
    for (size_t i = 0; i < n; i++) {
        set_text(v->text[i], k_bpe_tokens[i]);
        v->types[i] = KVS_TOK_TYPE_NORMAL;
    }
    v->types[14] = KVS_TOK_TYPE_CONTROL;
    v->merges = k_bpe_merges;
    struct kvs_tok_desc d = {
        .kind = KVS_TOK_KIND_BPE, .pre = pre, .n_tokens = n, .n_merges = n_merges, .ctx = v, .token = get_tok,
        .merge = get_merge, .types = v->types, .bos = -1, .eos = 14, .unk = -1, .eot = -1, .eom = -1,
        .add_bos = -1, .add_space_prefix = -1,
    };
    struct kvs_tokenizer *t = NULL;
    char err[128];
    assert_int_equal(kvs_tokenizer_build(&d, &t, err, sizeof err), KVS_OK);
    return t;
}

static void test_bpe(void **state)
{
    (void)state;
    struct vocab v;
    struct kvs_tokenizer *t = bpe_vocab(&v, KVS_TOK_PRE_GPT2, 5);
    assert_false(kvs_tokenizer_add_bos(t)); /* BPE default */
    assert_int_equal(kvs_tokenizer_bos(t), -1);
    /* "hello world" splits into "hello", " world".
     * hello: h e l l o -> he(0) -> ll(1) -> hell(2) -> hello(3).
     * " world": Ġ w o r l d -> Ġw(4); nothing else merges. */
    expect(t, "hello world", false, false, (const int32_t[]){ 11, 12, 3, 6, 2, 7 }, 6);
    /* add_bos without a BOS id adds nothing */
    expect(t, "hello", true, false, (const int32_t[]){ 11 }, 1);
    /* "\n" -> "Ċ" */
    expect(t, "\n", false, false, (const int32_t[]){ 13 }, 1);
    /* special token texts */
    expect(t, "he<|end|>", false, true, (const int32_t[]){ 8, 14 }, 2);
    /* CONTROL eos is end of generation; its piece is empty unless special */
    assert_true(kvs_tokenizer_is_eog(t, 14));
    char buf[16];
    assert_int_equal(kvs_token_to_piece(t, 14, false, buf, sizeof buf), 0);
    assert_int_equal(kvs_token_to_piece(t, 12, false, buf, sizeof buf), 2);
    assert_memory_equal(buf, " w", 2);
    assert_int_equal(kvs_token_to_piece(t, 13, false, buf, sizeof buf), 1);
    assert_int_equal(buf[0], '\n');
    kvs_tokenizer_free(t);

    /* Without merges: single characters ("ll" is never formed). */
    t = bpe_vocab(&v, KVS_TOK_PRE_GPT2, 0);
    expect(t, "hello", false, false, (const int32_t[]){ 0, 1, 2, 2, 3 }, 5);
    kvs_tokenizer_free(t);
    /* llama3 ignore_merges: a word that is a token is taken whole. */
    t = bpe_vocab(&v, KVS_TOK_PRE_LLAMA3, 0);
    assert_true(kvs_tokenizer_add_bos(t)); /* llama3 family default */
    expect(t, "hello", false, false, (const int32_t[]){ 11 }, 1);
    kvs_tokenizer_free(t);
}

static void test_byte_alphabet(void **state)
{
    (void)state;
    /* gguf-facts §5.4: 0x00-0x20 -> U+0100..U+0120, 0x7F-0xA0 -> U+0121..
     * U+0142, 0xAD -> U+0143; printable bytes map to themselves. */
    assert_int_equal(kvs_tok_byte_to_cp(' '), 0x120);
    assert_int_equal(kvs_tok_byte_to_cp('\n'), 0x10A);
    assert_int_equal(kvs_tok_byte_to_cp(0x00), 0x100);
    assert_int_equal(kvs_tok_byte_to_cp(0x7F), 0x121);
    assert_int_equal(kvs_tok_byte_to_cp(0xA0), 0x142);
    assert_int_equal(kvs_tok_byte_to_cp(0xAD), 0x143);
    assert_int_equal(kvs_tok_byte_to_cp('A'), 'A');
    assert_int_equal(kvs_tok_byte_to_cp(0xFF), 0xFF);
    for (int b = 0; b < 256; b++)
        assert_int_equal(kvs_tok_cp_to_byte(kvs_tok_byte_to_cp((uint8_t)b)), b);
    assert_int_equal(kvs_tok_cp_to_byte(0x144), -1);
    assert_int_equal(kvs_tok_cp_to_byte(' '), -1);
}

static void test_utf8_valid(void **state)
{
    (void)state;
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"a", 1), 1);
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xC3\xA9", 2), 2);
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xC3", 1), 0);
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xE2\x82\xAC", 3), 3);
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xF0\x9F\xA6\x99", 4), 4);
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xC0\x80", 2), -1);  /* overlong */
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xED\xA0\x80", 3), -1); /* surrogate */
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\xF4\x90\x80\x80", 4), -1); /* > U+10FFFF */
    assert_int_equal(kvs_tok_utf8_valid((const uint8_t *)"\x80", 1), -1);
}

/* Bad input never crashes: invalid UTF-8 through BPE (becomes U+FFFD, whose
 * bytes are no tokens here: dropped) and SPM (byte tokens). */
static void test_invalid_input(void **state)
{
    (void)state;
    struct vocab v;
    struct kvs_tokenizer *t = bpe_vocab(&v, KVS_TOK_PRE_QWEN2, 5);
    int32_t ids[16];
    assert_true(kvs_tokenize(t, "\xFF\xC3h", 3, false, false, ids, 16) >= 1);
    assert_true(kvs_tokenize(t, "x", 1, false, false, ids, -1) < 0);
    kvs_tokenizer_free(t);
    t = spm_vocab(&v, -1);
    expect(t, "\xFF", false, false, (const int32_t[]){ SP_SPACE, 3 + 0xFF }, 2);
    kvs_tokenizer_free(t);
}

/* ---- kvs_tokenizer_load on small GGUF headers made with the writer ---- */

static const char *const k_gg_tokens[] = { "<unk>", "<s>", "</s>", "\xE2\x96\x81", "a", "\xE2\x96\x81\x61" };

/* Writes a vocab-only GGUF header to memory and loads a tokenizer from it.
 * model/pre may be NULL (key omitted); n_scores < 0 omits the scores. */
static kvs_err load_gguf(const char *model, const char *pre, int n_scores, int add_space_prefix,
                         struct kvs_tokenizer **out)
{
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    assert_non_null(w);
    if (model)
        assert_int_equal(kvs_gguf_writer_set_str(w, "tokenizer.ggml.model", model), KVS_OK);
    if (pre)
        assert_int_equal(kvs_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre), KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", k_gg_tokens, 6), KVS_OK);
    const float scores[6] = { 0, 0, 0, -1, -2, -0.5f };
    if (n_scores >= 0)
        assert_int_equal(kvs_gguf_writer_set_arr(w, "tokenizer.ggml.scores", KVS_GGUF_TYPE_FLOAT32, scores,
                                                 (uint64_t)n_scores),
                         KVS_OK);
    const int32_t types[6] = { 2, 3, 3, 1, 1, 1 };
    assert_int_equal(kvs_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", KVS_GGUF_TYPE_INT32, types, 6), KVS_OK);
    if (model && !strcmp(model, "gpt2")) {
        const char *const merges[] = { "a a" };
        assert_int_equal(kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1), KVS_OK);
    }
    if (add_space_prefix >= 0)
        assert_int_equal(kvs_gguf_writer_set_bool(w, "tokenizer.ggml.add_space_prefix", add_space_prefix != 0),
                         KVS_OK);
    assert_int_equal(kvs_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 0xFFFFFFFFu), KVS_OK);
    uint8_t *buf = NULL;
    size_t len = 0;
    assert_int_equal(kvs_gguf_writer_header(w, &buf, &len), KVS_OK);
    kvs_gguf_writer_free(w);
    struct kvs_gguf *g = NULL;
    char err[256] = "";
    assert_int_equal(kvs_gguf_parse(buf, len, len, &g, NULL, err, sizeof err), KVS_OK);
    kvs_err e = kvs_tokenizer_load(g, out, err, sizeof err);
    if (e != KVS_OK)
        fprintf(stderr, "# load: %s: %s\n", kvs_strerror(e), err);
    kvs_gguf_close(g);
    free(buf);
    return e;
}

static void test_load_gguf(void **state)
{
    (void)state;
    struct kvs_tokenizer *t = NULL;
    assert_int_equal(load_gguf("llama", NULL, 6, -1, &t), KVS_OK);
    assert_int_equal(kvs_tokenizer_n_vocab(t), 6);
    assert_int_equal(kvs_tokenizer_eos(t), 2); /* 0xFFFFFFFF is ignored: the SPM default stays */
    /* "a" -> "▁a" (id 5); "a a" -> "▁a▁a" -> 5 5 */
    expect(t, "a a", false, false, (const int32_t[]){ 5, 5 }, 2);
    kvs_tokenizer_free(t);
    /* add_space_prefix false: "a" stays "a" (id 4) */
    assert_int_equal(load_gguf("llama", NULL, 6, 0, &t), KVS_OK);
    expect(t, "a", false, false, (const int32_t[]){ 4 }, 1);
    kvs_tokenizer_free(t);
    /* no scores: all 0, still works */
    assert_int_equal(load_gguf("llama", NULL, -1, -1, &t), KVS_OK);
    kvs_tokenizer_free(t);

    assert_int_equal(load_gguf("llama", NULL, 5, -1, &t), KVS_ERR_FORMAT); /* 5 scores for 6 tokens */
    assert_null(t);
    assert_int_equal(load_gguf("bert", NULL, 6, -1, &t), KVS_ERR_UNSUPPORTED);
    assert_int_equal(load_gguf("gpt2", "no-such-pre", 6, -1, &t), KVS_ERR_UNSUPPORTED);
    assert_int_equal(load_gguf(NULL, NULL, 6, -1, &t), KVS_ERR_NOT_FOUND);
    assert_int_equal(load_gguf("gpt2", "qwen2", 6, -1, &t), KVS_OK);
    assert_false(kvs_tokenizer_add_bos(t));
    kvs_tokenizer_free(t);
    assert_int_equal(load_gguf("gpt2", "llama-bpe", 6, -1, &t), KVS_OK);
    assert_true(kvs_tokenizer_add_bos(t));
    kvs_tokenizer_free(t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_spm_merges),    cmocka_unit_test(test_spm_special), cmocka_unit_test(test_spm_detok),
        cmocka_unit_test(test_bpe),           cmocka_unit_test(test_byte_alphabet),
        cmocka_unit_test(test_utf8_valid),    cmocka_unit_test(test_invalid_input), cmocka_unit_test(test_load_gguf),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

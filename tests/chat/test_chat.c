/* Chat template detection and rendering: expected strings written by hand
 * from the ChatML and Llama 3 formats; detection on the real template of
 * ../shared/models/qwen3-q8_0.gguf. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat/chat.h"

static const struct kvs_chat_message k_msgs[] = {
    { "system", "You are terse." },
    { "user", "Hi!" },
    { "assistant", "Hello." },
    { "user", "2+2?" },
};

static void test_detect(void **state)
{
    (void)state;
    assert_int_equal(kvs_chat_detect(NULL, 0), KVS_CHAT_NONE);
    const char *a = "{% for m in messages %}<|im_start|>{{ m.role }}";
    assert_int_equal(kvs_chat_detect(a, strlen(a)), KVS_CHAT_CHATML);
    const char *b = "{{ '<|start_header_id|>' + message['role'] }}";
    assert_int_equal(kvs_chat_detect(b, strlen(b)), KVS_CHAT_LLAMA3);
    const char *c = "[INST] {{ content }} [/INST]";
    assert_int_equal(kvs_chat_detect(c, strlen(c)), KVS_CHAT_NONE);
    /* Only the first len bytes count. */
    assert_int_equal(kvs_chat_detect(a, 20), KVS_CHAT_NONE);
    assert_string_equal(kvs_chat_name(KVS_CHAT_CHATML), "chatml");
    assert_string_equal(kvs_chat_name(KVS_CHAT_LLAMA3), "llama3");
    assert_false(kvs_chat_wants_bos(KVS_CHAT_LLAMA3));
}

static void test_chatml(void **state)
{
    (void)state;
    const char *want = "<|im_start|>system\nYou are terse.<|im_end|>\n"
                       "<|im_start|>user\nHi!<|im_end|>\n"
                       "<|im_start|>assistant\nHello.<|im_end|>\n"
                       "<|im_start|>user\n2+2?<|im_end|>\n"
                       "<|im_start|>assistant\n";
    char buf[512];
    long n = kvs_chat_render(KVS_CHAT_CHATML, k_msgs, 4, true, buf, sizeof buf);
    assert_int_equal(n, (long)strlen(want));
    assert_string_equal(buf, want);
    /* Without the generation prompt: 22 bytes fewer ("<|im_start|>assistant\n"). */
    n = kvs_chat_render(KVS_CHAT_CHATML, k_msgs, 4, false, buf, sizeof buf);
    assert_int_equal(n, (long)strlen(want) - 22);
    /* Too small: cut, NUL-terminated, full length reported. */
    char small[10];
    n = kvs_chat_render(KVS_CHAT_CHATML, k_msgs, 1, false, small, sizeof small);
    assert_int_equal(n, (long)strlen("<|im_start|>system\nYou are terse.<|im_end|>\n"));
    assert_string_equal(small, "<|im_star"); /* 9 bytes + NUL */
    /* Length query with no buffer. */
    assert_int_equal(kvs_chat_render(KVS_CHAT_CHATML, k_msgs, 4, true, NULL, 0), (long)strlen(want));
}

static void test_llama3(void **state)
{
    (void)state;
    const char *want = "<|begin_of_text|>"
                       "<|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
                       "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
                       "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n";
    char buf[512];
    long n = kvs_chat_render(KVS_CHAT_LLAMA3, k_msgs, 4, true, buf, sizeof buf);
    assert_int_equal(n, (long)strlen(want));
    assert_string_equal(buf, want);
    n = kvs_chat_render(KVS_CHAT_LLAMA3, NULL, 0, false, buf, sizeof buf);
    assert_int_equal(n, 17);
    assert_string_equal(buf, "<|begin_of_text|>");
}

static void test_errors(void **state)
{
    (void)state;
    char buf[64];
    assert_int_equal(kvs_chat_render(KVS_CHAT_NONE, k_msgs, 1, true, buf, sizeof buf), -(long)KVS_ERR_UNSUPPORTED);
    struct kvs_chat_message bad = { "user", NULL };
    assert_int_equal(kvs_chat_render(KVS_CHAT_CHATML, &bad, 1, true, buf, sizeof buf), -(long)KVS_ERR_ARG);
    assert_int_equal(kvs_chat_render(KVS_CHAT_CHATML, NULL, 2, true, buf, sizeof buf), -(long)KVS_ERR_ARG);
}

/* The chat module does not depend on the GGUF reader, so this test finds
 * the string value of tokenizer.chat_template by hand: key bytes, then
 * u32 type 8 (STRING), u64 length, bytes (gguf-facts §1.2, little-endian). */
static char *read_template(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    size_t cap = 64u << 20; /* metadata (tokens, merges, template) precede the tensors */
    unsigned char *buf = malloc(cap);
    size_t n = fread(buf, 1, cap, f);
    fclose(f);
    static const char key[] = "tokenizer.chat_template";
    unsigned char *k = memmem(buf, n, key, sizeof key - 1);
    char *out = NULL;
    if (k && (size_t)(k - buf) + sizeof key - 1 + 12 <= n) {
        unsigned char *p = k + sizeof key - 1;
        uint32_t type = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
        uint64_t l = 0;
        for (int i = 7; i >= 0; i--)
            l = (l << 8) | p[4 + i];
        if (type == 8 && l <= n - (size_t)(p + 12 - buf)) {
            out = malloc(l + 1);
            memcpy(out, p + 12, l);
            out[l] = 0;
            *len = l;
        }
    }
    free(buf);
    return out;
}

static void test_qwen3_template(void **state)
{
    (void)state;
    const char *sh = getenv("KVASIR_SHARED");
    char path[1024];
    snprintf(path, sizeof path, "%s/models/qwen3-q8_0.gguf", sh && *sh ? sh : "../shared");
    size_t len = 0;
    char *tpl = read_template(path, &len);
    assert_non_null(tpl);
    assert_true(len > 1000); /* Qwen3's template is several KiB */
    assert_int_equal(kvs_chat_detect(tpl, len), KVS_CHAT_CHATML);
    free(tpl);
}

static void test_from_name(void **st)
{
    (void)st;
    assert_int_equal(kvs_chat_from_name("chatml"), KVS_CHAT_CHATML);
    assert_int_equal(kvs_chat_from_name("llama3"), KVS_CHAT_LLAMA3);
    assert_int_equal(kvs_chat_from_name("ChatML"), KVS_CHAT_NONE);
    assert_int_equal(kvs_chat_from_name("none"), KVS_CHAT_NONE);
    assert_int_equal(kvs_chat_from_name(NULL), KVS_CHAT_NONE);
    for (int t = KVS_CHAT_CHATML; t <= KVS_CHAT_LLAMA3; t++)
        assert_int_equal(kvs_chat_from_name(kvs_chat_name((enum kvs_chat_template)t)), t);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_from_name),
        cmocka_unit_test(test_detect), cmocka_unit_test(test_chatml),         cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_errors), cmocka_unit_test(test_qwen3_template),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

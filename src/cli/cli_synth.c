/* kvasir gguf synth: writes a random-weight GGUF v3 file of a real
 * architecture (llama, qwen2, qwen3, qwen3moe), for tests and benchmarks.
 *
 * Metadata keys and their types follow ../shared/docs/gguf-facts.md §3.1/§3.2
 * (every hyperparameter UINT32, eps and rope base FLOAT32); tensor names and
 * GGUF shapes follow §3.3; the tokenizer keys follow §5.1. The vocabulary is
 * a byte-level BPE ("gpt2", pre "qwen2"): ids 0..255 are the 256 bytes in the
 * GPT-2 byte alphabet (id b = byte b), then a few merges (SYNTH_MERGES), then
 * NORMAL filler tokens "<tok_N>", and the last three ids are the CONTROL
 * tokens <|endoftext|> (bos, pad), <|im_start|>, <|im_end|> (eos).
 *
 * Values: every tensor has its own xoshiro256** stream seeded (through
 * splitmix64) from (seed, tensor index), so the file is a pure function of
 * the arguments. 2-D weights are uniform in ±sqrt(3/ne0) (standard deviation
 * 1/sqrt(fan_in), so activations stay O(1)); norm weights 1 ± 0.1; biases
 * ±0.02. The file is streamed tensor by tensor in row chunks (memory: a few
 * MiB whatever the model size). */
#include "cli/cli.h"

#include <errno.h>
#include <sys/statvfs.h>
#include <stdarg.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/error.h"
#include "common/rng.h"
#include "gguf/gguf.h"
#include "kernels/kernels.h"

#define SYNTH_MAX_TENSORS_PER_BLOCK 24
#define SYNTH_CHUNK_ELEMS (1 << 20) /* floats generated per chunk */
#define SYNTH_N_SPECIAL 3

/* Merges over the byte alphabet ("Ġ" is the space byte 0x20); each result is
 * a token (ids 256..). Listed in rank order; later ones may build on earlier. */
static const char *const SYNTH_MERGES[] = {
    "\xC4\xA0 t", "h e", "i n", "\xC4\xA0 a", "e r", "\xC4\xA0t he", "o n", "r e", "\xC4\xA0 s", "e n",
};
#define SYNTH_N_MERGES (sizeof SYNTH_MERGES / sizeof SYNTH_MERGES[0])
#define SYNTH_MIN_VOCAB (256 + SYNTH_N_MERGES + SYNTH_N_SPECIAL)

static const char SYNTH_CHAT_TEMPLATE[] =
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

enum synth_kind { SYNTH_WEIGHT, SYNTH_NORM, SYNTH_BIAS, SYNTH_DECAY /* ssm_a: -(0.5..1.5) */ };

struct synth_tensor {
    char name[KVS_GGUF_MAX_NAME];
    enum kvs_type type;
    uint32_t n_dims;
    int64_t ne[3];
    enum synth_kind kind;
};

struct synth_cfg {
    const char *arch;
    const char *out;
    int64_t n_embd, n_block, n_head, n_head_kv, head_dim, n_ff, n_vocab;
    int64_t n_expert, n_expert_used, n_ff_exp, ctx;
    int64_t n_rot, ssm_d, ssm_h_k, ssm_h_v, ssm_conv, attn_interval, n_ff_shexp; /* qwen35* */
    bool hybrid;
    bool tied;
    enum kvs_type type;
    bool k_mix; /* --type q4_k_m / q5_k_m: Q6_K for the LM head and some attn_v / ffn_down */
    uint64_t seed;
};

/* Fills dst[n] with center + uniform(-scale, scale), two values per draw. */
static void fill_uniform(struct kvs_rng *s, float *dst, int64_t n, float center, float scale)
{
    const float k = scale * 0x1.0p-31f;
    int64_t i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t r = kvs_rng_next(s);
        dst[i] = center + (float)(int32_t)(uint32_t)(r >> 32) * k;
        dst[i + 1] = center + (float)(int32_t)(uint32_t)r * k;
    }
    if (i < n)
        dst[i] = center + (float)(int32_t)(uint32_t)(kvs_rng_next(s) >> 32) * k;
}

/* --- argument parsing ------------------------------------------------------- */
static void usage(FILE *f)
{
    fprintf(f,
            "usage: kvasir gguf synth --arch llama|qwen2|qwen3|qwen3moe|qwen35|qwen35moe --n-embd E\n"
            "         --n-block L [--n-head H] [--n-head-kv HKV] [--head-dim D] [--n-ff F] [--n-vocab V]\n"
            "         [--n-expert X --n-expert-used K --n-ff-exp FE] [--tied] [--ctx N]\n"
            "         [--n-rot R] [--ssm-state d] [--ssm-groups HK] [--ssm-heads HV] [--ssm-conv C]\n"
            "         [--attn-interval I] [--n-ff-shexp FS]            (qwen35, qwen35moe)\n"
            "         --type q8_0|q4_0|q2_k|q3_k|q4_k|q5_k|q6_k|q4_k_m|q5_k_m|f16|f32 --seed S -o FILE\n"
            "Writes a GGUF v3 model with random weights (deterministic in the arguments).\n"
            "q4_k_m / q5_k_m: Q4_K / Q5_K weights with Q6_K for the LM head (output, or the tied\n"
            "token_embd) and for attn_v and ffn_down of the first and last eighth of the blocks and\n"
            "every third block between (llama-quantize's Q4_K_M / Q5_K_M mix).\n"
            "Defaults: H = E/64 (at least 1), HKV = H, D = E/H, F = 3E, V = 512 (min %zu),\n"
            "K = 2, FE = F/K, ctx 2048; qwen35*: R = D/4, d = 128, HK = 16, HV = 2·HK, C = 4, I = 4,\n"
            "FS = FE.\n",
            (size_t)SYNTH_MIN_VOCAB);
}

static bool parse_i64(const char *opt, const char *s, int64_t lo, int64_t hi, int64_t *out)
{
    char *end = NULL;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "kvasir gguf synth: %s: expected an integer in [%" PRId64 ", %" PRId64 "], got '%s'\n",
                opt, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

static bool parse_type(const char *s, enum kvs_type *t, bool *k_mix)
{
    static const struct {
        const char *name;
        enum kvs_type type;
        bool mix;
    } types[] = { { "q8_0", KVS_TYPE_Q8_0, false }, { "q4_0", KVS_TYPE_Q4_0, false }, { "f16", KVS_TYPE_F16, false },
                  { "f32", KVS_TYPE_F32, false },   { "q2_k", KVS_TYPE_Q2_K, false }, { "q3_k", KVS_TYPE_Q3_K, false },
                  { "q4_k", KVS_TYPE_Q4_K, false }, { "q5_k", KVS_TYPE_Q5_K, false }, { "q6_k", KVS_TYPE_Q6_K, false },
                  { "q4_k_m", KVS_TYPE_Q4_K, true }, { "q5_k_m", KVS_TYPE_Q5_K, true } };
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(s, types[i].name)) {
            *t = types[i].type;
            *k_mix = types[i].mix;
            return true;
        }
    return false;
}

/* llama_ftype of the file (gguf-facts §3.1): a uniform type, or the K-quant
 * mixes Q4_K_M (15) / Q5_K_M (17); uniform Q3_K, Q4_K, Q5_K files are the
 * "_S" ftypes. */
static uint32_t file_type_of(enum kvs_type t, bool k_mix)
{
    switch (t) {
    case KVS_TYPE_F16: return 1;
    case KVS_TYPE_Q4_0: return 2;
    case KVS_TYPE_Q8_0: return 7;
    case KVS_TYPE_Q2_K: return 10;
    case KVS_TYPE_Q3_K: return 11;
    case KVS_TYPE_Q4_K: return k_mix ? 15 : 14;
    case KVS_TYPE_Q5_K: return k_mix ? 17 : 16;
    case KVS_TYPE_Q6_K: return 18;
    default: return 0;
    }
}

/* Returns 0 ok, 2 usage error (message printed), -1 for --help. */
static int parse_args(int argc, char **argv, struct synth_cfg *c)
{
    memset(c, 0, sizeof *c);
    c->n_vocab = 512;
    c->ctx = 2048;
    c->type = KVS_TYPE_COUNT;
    bool have_seed = false;
    const int64_t big = INT64_C(1) << 20;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h"))
            return -1;
        if (!strcmp(a, "--tied")) {
            c->tied = true;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "kvasir gguf synth: %s needs a value (or is unknown)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        bool ok = true;
        if (!strcmp(a, "--arch"))
            c->arch = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--output"))
            c->out = v;
        else if (!strcmp(a, "--type")) {
            if (!parse_type(v, &c->type, &c->k_mix)) {
                fprintf(stderr, "kvasir gguf synth: --type: expected q8_0, q4_0, q2_k, q3_k, q4_k, q5_k, q6_k, q4_k_m, "
                                "q5_k_m, f16 or f32, got '%s'\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--seed")) {
            char *end = NULL;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 0);
            if (errno || end == v || *end || v[0] == '-') {
                fprintf(stderr, "kvasir gguf synth: --seed: expected an unsigned integer, got '%s'\n", v);
                return 2;
            }
            c->seed = s;
            have_seed = true;
        } else if (!strcmp(a, "--n-embd"))
            ok = parse_i64(a, v, 1, 65536, &c->n_embd);
        else if (!strcmp(a, "--n-block"))
            ok = parse_i64(a, v, 1, 1024, &c->n_block);
        else if (!strcmp(a, "--n-head"))
            ok = parse_i64(a, v, 1, 4096, &c->n_head);
        else if (!strcmp(a, "--n-head-kv"))
            ok = parse_i64(a, v, 1, 4096, &c->n_head_kv);
        else if (!strcmp(a, "--head-dim"))
            ok = parse_i64(a, v, 1, 4096, &c->head_dim);
        else if (!strcmp(a, "--n-ff"))
            ok = parse_i64(a, v, 1, big, &c->n_ff);
        else if (!strcmp(a, "--n-vocab"))
            ok = parse_i64(a, v, (int64_t)SYNTH_MIN_VOCAB, INT64_C(1) << 22, &c->n_vocab);
        else if (!strcmp(a, "--n-expert"))
            ok = parse_i64(a, v, 1, 1024, &c->n_expert);
        else if (!strcmp(a, "--n-expert-used"))
            ok = parse_i64(a, v, 1, 1024, &c->n_expert_used);
        else if (!strcmp(a, "--n-ff-exp"))
            ok = parse_i64(a, v, 1, big, &c->n_ff_exp);
        else if (!strcmp(a, "--ctx"))
            ok = parse_i64(a, v, 1, INT64_C(1) << 24, &c->ctx);
        else if (!strcmp(a, "--n-rot"))
            ok = parse_i64(a, v, 2, 4096, &c->n_rot);
        else if (!strcmp(a, "--ssm-state"))
            ok = parse_i64(a, v, 1, 4096, &c->ssm_d);
        else if (!strcmp(a, "--ssm-groups"))
            ok = parse_i64(a, v, 1, 4096, &c->ssm_h_k);
        else if (!strcmp(a, "--ssm-heads"))
            ok = parse_i64(a, v, 1, 4096, &c->ssm_h_v);
        else if (!strcmp(a, "--ssm-conv"))
            ok = parse_i64(a, v, 2, 64, &c->ssm_conv);
        else if (!strcmp(a, "--attn-interval"))
            ok = parse_i64(a, v, 1, 1024, &c->attn_interval);
        else if (!strcmp(a, "--n-ff-shexp"))
            ok = parse_i64(a, v, 1, big, &c->n_ff_shexp);
        else {
            fprintf(stderr, "kvasir gguf synth: unknown option '%s'\n", a);
            return 2;
        }
        if (!ok)
            return 2;
    }
    if (!c->arch || !c->out || !c->n_embd || !c->n_block || c->type == KVS_TYPE_COUNT || !have_seed) {
        fprintf(stderr, "kvasir gguf synth: --arch, --n-embd, --n-block, --type, --seed and -o are required\n");
        return 2;
    }
    bool moe_arch = !strcmp(c->arch, "qwen3moe") || !strcmp(c->arch, "qwen35moe");
    c->hybrid = !strcmp(c->arch, "qwen35") || !strcmp(c->arch, "qwen35moe");
    if (strcmp(c->arch, "llama") && strcmp(c->arch, "qwen2") && strcmp(c->arch, "qwen3") && !moe_arch && !c->hybrid) {
        fprintf(stderr, "kvasir gguf synth: --arch: expected llama, qwen2, qwen3, qwen3moe, qwen35 or qwen35moe, got '%s'\n",
                c->arch);
        return 2;
    }
    if (!c->hybrid && (c->n_rot || c->ssm_d || c->ssm_h_k || c->ssm_h_v || c->ssm_conv || c->attn_interval ||
                       c->n_ff_shexp)) {
        fprintf(stderr, "kvasir gguf synth: --n-rot/--ssm-*/--attn-interval/--n-ff-shexp need --arch qwen35 or qwen35moe\n");
        return 2;
    }
    if (!c->n_head)
        c->n_head = c->n_embd >= 64 ? c->n_embd / 64 : 1;
    if (!c->n_head_kv)
        c->n_head_kv = c->n_head;
    if (!c->head_dim) {
        if (c->n_embd % c->n_head) {
            fprintf(stderr, "kvasir gguf synth: n_embd %" PRId64 " is not a multiple of n_head %" PRId64
                            ": give --head-dim\n", c->n_embd, c->n_head);
            return 2;
        }
        c->head_dim = c->n_embd / c->n_head;
    }
    if (c->n_head % c->n_head_kv) {
        fprintf(stderr, "kvasir gguf synth: n_head %" PRId64 " is not a multiple of n_head_kv %" PRId64 "\n",
                c->n_head, c->n_head_kv);
        return 2;
    }
    if (c->head_dim % 2) {
        fprintf(stderr, "kvasir gguf synth: head_dim must be even (RoPE pairs)\n");
        return 2;
    }
    if (!c->n_ff)
        c->n_ff = 3 * c->n_embd;
    if (moe_arch && !c->n_expert) {
        fprintf(stderr, "kvasir gguf synth: %s needs --n-expert\n", c->arch);
        return 2;
    }
    if (c->n_expert) {
        if (!strcmp(c->arch, "qwen2") || !strcmp(c->arch, "qwen3") || !strcmp(c->arch, "qwen35")) {
            fprintf(stderr, "kvasir gguf synth: --n-expert needs --arch qwen3moe, qwen35moe or llama\n");
            return 2;
        }
        if (!c->n_expert_used)
            c->n_expert_used = c->n_expert < 2 ? c->n_expert : 2;
        if (c->n_expert_used > c->n_expert) {
            fprintf(stderr, "kvasir gguf synth: n_expert_used %" PRId64 " > n_expert %" PRId64 "\n",
                    c->n_expert_used, c->n_expert);
            return 2;
        }
        if (!c->n_ff_exp)
            c->n_ff_exp = c->n_ff / c->n_expert_used;
    } else if (c->n_expert_used || c->n_ff_exp) {
        fprintf(stderr, "kvasir gguf synth: --n-expert-used/--n-ff-exp need --n-expert\n");
        return 2;
    }
    if (c->hybrid) {
        if (!c->n_rot) c->n_rot = c->head_dim / 4 >= 2 ? c->head_dim / 4 : 2;
        if (!c->ssm_d) c->ssm_d = 128;
        if (!c->ssm_h_k) c->ssm_h_k = 16;
        if (!c->ssm_h_v) c->ssm_h_v = 2 * c->ssm_h_k;
        if (!c->ssm_conv) c->ssm_conv = 4;
        if (!c->attn_interval) c->attn_interval = 4;
        if (!c->n_ff_shexp) c->n_ff_shexp = c->n_ff_exp;
        if (c->n_rot > c->head_dim || c->n_rot % 2 || c->ssm_h_v % c->ssm_h_k) {
            fprintf(stderr, "kvasir gguf synth: need an even n_rot <= head_dim and ssm-heads a multiple of ssm-groups\n");
            return 2;
        }
    }
    /* ne0 of every 2-D weight must be a multiple of the block size. */
    uint32_t be = 1, bb = 0;
    kvs_type_block(c->type, &be, &bb);
    int64_t ne0s[6] = { c->n_embd, c->n_head * c->head_dim, c->n_expert ? c->n_ff_exp : c->n_ff, c->n_embd,
                        c->hybrid ? c->ssm_h_v * c->ssm_d : c->n_embd, c->hybrid && c->n_expert ? c->n_ff_shexp : c->n_embd };
    for (int i = 0; i < 6; i++)
        if (ne0s[i] % be) {
            fprintf(stderr, "kvasir gguf synth: row length %" PRId64 " is not a multiple of %s's block size %u\n",
                    ne0s[i], kvs_type_name(c->type), be);
            return 2;
        }
    return 0;
}

/* --- model description ------------------------------------------------------ */
static int add_t(struct synth_tensor *t, size_t *n, const char *name, enum kvs_type type, enum synth_kind kind,
                 uint32_t n_dims, int64_t ne0, int64_t ne1, int64_t ne2)
{
    struct synth_tensor *x = &t[(*n)++];
    int w = snprintf(x->name, sizeof x->name, "%s", name);
    if (w < 0 || (size_t)w >= sizeof x->name)
        return -1;
    x->type = type;
    x->kind = kind;
    x->n_dims = n_dims;
    x->ne[0] = ne0;
    x->ne[1] = ne1;
    x->ne[2] = ne2;
    return 0;
}

/* Fills t (capacity 3 + n_block * SYNTH_MAX_TENSORS_PER_BLOCK) in file
 * order: token_embd, blk.0.* .. blk.{L-1}.*, output_norm, output. */
static size_t describe(const struct synth_cfg *c, struct synth_tensor *t)
{
    size_t n = 0;
    const enum kvs_type w = c->type, f = KVS_TYPE_F32;
    const int64_t E = c->n_embd, q = c->n_head * c->head_dim, kv = c->n_head_kv * c->head_dim;
    const bool qwen2 = !strcmp(c->arch, "qwen2");
    const bool qk_norm = !strcmp(c->arch, "qwen3") || !strcmp(c->arch, "qwen3moe");
    char name[KVS_GGUF_MAX_NAME];
    /* Q4_K_M / Q5_K_M: the LM head in Q6_K; attn_v and ffn_down in Q6_K on the
     * "more bits" blocks (the first and last eighth, every third between) */
    const enum kvs_type head = c->k_mix ? KVS_TYPE_Q6_K : w;
    add_t(t, &n, "token_embd.weight", c->tied ? head : w, SYNTH_WEIGHT, 2, E, c->n_vocab, 1);
    for (int64_t b = 0; b < c->n_block; b++) {
        const int64_t L = c->n_block;
        const bool more = c->k_mix && (b < L / 8 || b >= 7 * L / 8 || (b - L / 8) % 3 == 2);
        const enum kvs_type wv = more ? KVS_TYPE_Q6_K : w;
#define BLK(suffix, type, kind, nd, a0, a1, a2)                                                         \
    do {                                                                                              \
        snprintf(name, sizeof name, "blk.%" PRId64 ".%s", b, suffix);                                 \
        add_t(t, &n, name, type, kind, nd, a0, a1, a2);                                               \
    } while (0)
        BLK("attn_norm.weight", f, SYNTH_NORM, 1, E, 1, 1);
        if (c->hybrid && (b + 1) % c->attn_interval) { /* Gated DeltaNet block */
            const int64_t d = c->ssm_d, hv = c->ssm_h_v, C = (2 * c->ssm_h_k + hv) * d;
            BLK("attn_qkv.weight", w, SYNTH_WEIGHT, 2, E, C, 1);
            BLK("attn_gate.weight", w, SYNTH_WEIGHT, 2, E, hv * d, 1);
            BLK("ssm_conv1d.weight", f, SYNTH_WEIGHT, 2, c->ssm_conv, C, 1);
            BLK("ssm_dt.bias", f, SYNTH_BIAS, 1, hv, 1, 1);
            BLK("ssm_a", f, SYNTH_DECAY, 1, hv, 1, 1);
            BLK("ssm_beta.weight", w, SYNTH_WEIGHT, 2, E, hv, 1);
            BLK("ssm_alpha.weight", w, SYNTH_WEIGHT, 2, E, hv, 1);
            BLK("ssm_norm.weight", f, SYNTH_NORM, 1, d, 1, 1);
            BLK("ssm_out.weight", w, SYNTH_WEIGHT, 2, hv * d, E, 1);
        } else if (c->hybrid) { /* gated attention: per head D query rows, then D gate rows */
            BLK("attn_q.weight", w, SYNTH_WEIGHT, 2, E, 2 * q, 1);
            BLK("attn_k.weight", w, SYNTH_WEIGHT, 2, E, kv, 1);
            BLK("attn_v.weight", w, SYNTH_WEIGHT, 2, E, kv, 1);
            BLK("attn_q_norm.weight", f, SYNTH_NORM, 1, c->head_dim, 1, 1);
            BLK("attn_k_norm.weight", f, SYNTH_NORM, 1, c->head_dim, 1, 1);
            BLK("attn_output.weight", w, SYNTH_WEIGHT, 2, q, E, 1);
        }
        if (c->hybrid) {
            BLK("post_attention_norm.weight", f, SYNTH_NORM, 1, E, 1, 1);
        } else {
        BLK("attn_q.weight", w, SYNTH_WEIGHT, 2, E, q, 1);
        BLK("attn_k.weight", w, SYNTH_WEIGHT, 2, E, kv, 1);
        BLK("attn_v.weight", wv, SYNTH_WEIGHT, 2, E, kv, 1);
        if (qwen2) {
            BLK("attn_q.bias", f, SYNTH_BIAS, 1, q, 1, 1);
            BLK("attn_k.bias", f, SYNTH_BIAS, 1, kv, 1, 1);
            BLK("attn_v.bias", f, SYNTH_BIAS, 1, kv, 1, 1);
        }
        if (qk_norm) {
            BLK("attn_q_norm.weight", f, SYNTH_NORM, 1, c->head_dim, 1, 1);
            BLK("attn_k_norm.weight", f, SYNTH_NORM, 1, c->head_dim, 1, 1);
        }
        BLK("attn_output.weight", w, SYNTH_WEIGHT, 2, q, E, 1);
        BLK("ffn_norm.weight", f, SYNTH_NORM, 1, E, 1, 1);
        }
        if (c->n_expert) {
            const int64_t X = c->n_expert, Fe = c->n_ff_exp;
            BLK("ffn_gate_inp.weight", f, SYNTH_WEIGHT, 2, E, X, 1);
            BLK("ffn_gate_exps.weight", w, SYNTH_WEIGHT, 3, E, Fe, X);
            BLK("ffn_up_exps.weight", w, SYNTH_WEIGHT, 3, E, Fe, X);
            BLK("ffn_down_exps.weight", w, SYNTH_WEIGHT, 3, Fe, E, X);
            if (c->hybrid) { /* qwen35moe shared expert and its sigmoid gate */
                BLK("ffn_gate_inp_shexp.weight", f, SYNTH_WEIGHT, 1, E, 1, 1);
                BLK("ffn_gate_shexp.weight", w, SYNTH_WEIGHT, 2, E, c->n_ff_shexp, 1);
                BLK("ffn_up_shexp.weight", w, SYNTH_WEIGHT, 2, E, c->n_ff_shexp, 1);
                BLK("ffn_down_shexp.weight", w, SYNTH_WEIGHT, 2, c->n_ff_shexp, E, 1);
            }
        } else {
            BLK("ffn_gate.weight", w, SYNTH_WEIGHT, 2, E, c->n_ff, 1);
            BLK("ffn_up.weight", w, SYNTH_WEIGHT, 2, E, c->n_ff, 1);
            BLK("ffn_down.weight", wv, SYNTH_WEIGHT, 2, c->n_ff, E, 1);
        }
#undef BLK
    }
    add_t(t, &n, "output_norm.weight", f, SYNTH_NORM, 1, E, 1, 1);
    if (!c->tied)
        add_t(t, &n, "output.weight", head, SYNTH_WEIGHT, 2, E, c->n_vocab, 1);
    return n;
}

/* --- tokenizer ---------------------------------------------------------------- */
/* GPT-2 byte alphabet (gguf-facts §5.4 step 2): the code point byte b maps to. */
static uint32_t byte_to_cp(uint32_t b)
{
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF))
        return b;
    uint32_t k = 0; /* rank of b among the 68 remapped bytes */
    for (uint32_t x = 0; x < b; x++)
        if (!((x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF)))
            k++;
    return 0x100 + k;
}

/* UTF-8 of a code point < 0x800 into out (NUL-terminated). */
static void cp_utf8(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = 0;
    }
}

/* Sets every tokenizer.* key. */
static kvs_err set_tokenizer(struct kvs_gguf_writer *w, const struct synth_cfg *c)
{
    const size_t V = (size_t)c->n_vocab, slot = 24;
    char *pool = calloc(V, slot);
    const char **toks = calloc(V, sizeof *toks);
    int32_t *types = calloc(V, sizeof *types);
    kvs_err e = KVS_ERR_NOMEM;
    if (!pool || !toks || !types)
        goto done;
    for (size_t i = 0; i < V; i++) {
        char *s = pool + i * slot;
        toks[i] = s;
        types[i] = 1; /* NORMAL */
        if (i < 256) {
            cp_utf8(byte_to_cp((uint32_t)i), s);
        } else if (i < 256 + SYNTH_N_MERGES) {
            /* the merge "left right" without its space */
            const char *m = SYNTH_MERGES[i - 256];
            size_t k = 0;
            for (; *m && k + 1 < slot; m++)
                if (*m != ' ')
                    s[k++] = *m;
            s[k] = 0;
        } else if (i >= V - SYNTH_N_SPECIAL) {
            static const char *const special[SYNTH_N_SPECIAL] = { "<|endoftext|>", "<|im_start|>", "<|im_end|>" };
            snprintf(s, slot, "%s", special[i - (V - SYNTH_N_SPECIAL)]);
            types[i] = 3; /* CONTROL */
        } else {
            snprintf(s, slot, "<tok_%u>", (unsigned)i);
        }
    }
    const uint32_t eot = (uint32_t)(V - 3), im_end = (uint32_t)(V - 1);
    if ((e = kvs_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2")) ||
        (e = kvs_gguf_writer_set_str(w, "tokenizer.ggml.pre", c->hybrid ? "qwen35" : "qwen2")) ||
        (e = kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", toks, V)) ||
        (e = kvs_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", KVS_GGUF_TYPE_INT32, types, V)) ||
        (e = kvs_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", SYNTH_MERGES, SYNTH_N_MERGES)) ||
        (e = kvs_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", eot)) ||
        (e = kvs_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", im_end)) ||
        (e = kvs_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", eot)) ||
        (e = kvs_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false)) ||
        (e = kvs_gguf_writer_set_str(w, "tokenizer.chat_template", SYNTH_CHAT_TEMPLATE)))
        goto done;
    e = KVS_OK;
done:
    free(pool);
    free(toks);
    free(types);
    return e;
}

static kvs_err set_metadata(struct kvs_gguf_writer *w, const struct synth_cfg *c)
{
    char key[128];
    kvs_err e;
#define U32(suffix, val)                                                                                 \
    do {                                                                                               \
        snprintf(key, sizeof key, "%s.%s", c->arch, suffix);                                           \
        if ((e = kvs_gguf_writer_set_u32(w, key, (uint32_t)(val))))                                    \
            return e;                                                                                  \
    } while (0)
#define F32(suffix, val)                                                                                 \
    do {                                                                                               \
        snprintf(key, sizeof key, "%s.%s", c->arch, suffix);                                           \
        if ((e = kvs_gguf_writer_set_f32(w, key, (float)(val))))                                       \
            return e;                                                                                  \
    } while (0)
    if ((e = kvs_gguf_writer_set_str(w, "general.architecture", c->arch)) ||
        (e = kvs_gguf_writer_set_str(w, "general.name", "kvasir-synth")) ||
        (e = kvs_gguf_writer_set_u32(w, "general.file_type", file_type_of(c->type, c->k_mix))) ||
        (e = kvs_gguf_writer_set_u32(w, "general.quantization_version", 2)))
        return e;
    const bool llama = !strcmp(c->arch, "llama");
    U32("context_length", c->ctx);
    U32("embedding_length", c->n_embd);
    U32("block_count", c->n_block);
    U32("feed_forward_length", c->n_ff);
    U32("attention.head_count", c->n_head);
    U32("attention.head_count_kv", c->n_head_kv);
    F32("attention.layer_norm_rms_epsilon", llama ? 1e-5 : 1e-6);
    U32("attention.key_length", c->head_dim);
    U32("attention.value_length", c->head_dim);
    U32("rope.dimension_count", c->hybrid ? c->n_rot : c->head_dim);
    F32("rope.freq_base", llama ? 10000.0 : 1000000.0);
    U32("vocab_size", c->n_vocab);
    if (c->n_expert) {
        U32("expert_count", c->n_expert);
        U32("expert_used_count", c->n_expert_used);
        U32("expert_feed_forward_length", c->n_ff_exp);
        if (c->hybrid)
            U32("expert_shared_feed_forward_length", c->n_ff_shexp);
    }
    if (c->hybrid) {
        U32("ssm.conv_kernel", c->ssm_conv);
        U32("ssm.state_size", c->ssm_d);
        U32("ssm.group_count", c->ssm_h_k);
        U32("ssm.time_step_rank", c->ssm_h_v);
        U32("ssm.inner_size", c->ssm_h_v * c->ssm_d);
        U32("full_attention_interval", c->attn_interval);
        /* M-RoPE sections (text: plain NeoX over n_rot dims), e.g. 11,11,10,0 for 64 */
        const int32_t half = (int32_t)(c->n_rot / 2), s0 = (half + 2) / 3;
        const int32_t sec[4] = { s0, s0, half - 2 * s0 > 0 ? half - 2 * s0 : 0, 0 };
        snprintf(key, sizeof key, "%s.rope.dimension_sections", c->arch);
        if ((e = kvs_gguf_writer_set_arr(w, key, KVS_GGUF_TYPE_INT32, sec, 4)))
            return e;
    }
#undef U32
#undef F32
    return set_tokenizer(w, c);
}

/* --- streaming the data section -------------------------------------------- */
static bool write_zeros(FILE *f, uint64_t n)
{
    static const uint8_t zeros[256];
    while (n) {
        size_t k = n < sizeof zeros ? (size_t)n : sizeof zeros;
        if (fwrite(zeros, 1, k, f) != k)
            return false;
        n -= k;
    }
    return true;
}

/* Generates and writes tensor t (index ti) in row chunks. fbuf holds
 * SYNTH_CHUNK_ELEMS floats, qbuf their encoding in any supported type. */
static kvs_err write_tensor(FILE *f, const struct synth_cfg *c, const struct synth_tensor *t, size_t ti,
                            float *fbuf, uint8_t *qbuf)
{
    uint64_t x = c->seed ^ (0xA0761D6478BD642FULL * (uint64_t)(ti + 1));
    struct kvs_rng s;
    for (int i = 0; i < 4; i++)
        s.s[i] = kvs_splitmix64(&x);
    const int64_t ne0 = t->ne[0], rows = t->ne[1] * t->ne[2];
    float center = 0.0f, scale;
    switch (t->kind) {
    case SYNTH_NORM: center = 1.0f; scale = 0.1f; break;
    case SYNTH_BIAS: scale = 0.02f; break;
    case SYNTH_DECAY: center = -1.0f; scale = 0.5f; break;
    default: scale = sqrtf(3.0f / (float)ne0); break;
    }
    int64_t rows_per = SYNTH_CHUNK_ELEMS / ne0;
    if (rows_per < 1)
        rows_per = 1;
    const size_t row_bytes = kvs_type_row_bytes(t->type, ne0);
    for (int64_t r = 0; r < rows; r += rows_per) {
        int64_t nr = rows - r < rows_per ? rows - r : rows_per;
        int64_t n = nr * ne0;
        fill_uniform(&s, fbuf, n, center, scale);
        kvs_err e = kvs_quantize_weights(t->type, fbuf, qbuf, n);
        if (e)
            return e;
        size_t nb = (size_t)nr * row_bytes;
        if (fwrite(qbuf, 1, nb, f) != nb)
            return KVS_ERR_IO;
    }
    return KVS_OK;
}

/* printf into the error buffer (truncation is acceptable for messages). */
static void set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t errlen, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

static kvs_err synth_write(const struct synth_cfg *c, char *err, size_t errlen)
{
    size_t cap = 3 + (size_t)c->n_block * SYNTH_MAX_TENSORS_PER_BLOCK;
    struct synth_tensor *t = calloc(cap, sizeof *t);
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    float *fbuf = malloc((size_t)SYNTH_CHUNK_ELEMS * sizeof *fbuf);
    uint8_t *qbuf = malloc((size_t)SYNTH_CHUNK_ELEMS * sizeof(float));
    uint8_t *hdr = NULL;
    size_t hdr_len = 0;
    FILE *f = NULL;
    char tmp[4096];
    kvs_err e = KVS_ERR_NOMEM;
    bool tmp_made = false;
    err[0] = 0;
    if (!t || !w || !fbuf || !qbuf)
        goto fail;
    size_t n = describe(c, t);
    for (size_t i = 0; i < n; i++)
        if (t[i].ne[0] > SYNTH_CHUNK_ELEMS) { /* a single row must fit a chunk */
            e = KVS_ERR_RANGE;
            set_err(err, errlen, "tensor '%s': a row of %" PRId64 " elements is longer than %d", t[i].name,
                     t[i].ne[0], SYNTH_CHUNK_ELEMS);
            goto fail;
        }
    if ((e = set_metadata(w, c))) {
        set_err(err, errlen, "setting metadata: %s", kvs_strerror(e));
        goto fail;
    }
    for (size_t i = 0; i < n; i++) {
        uint64_t bytes = (uint64_t)kvs_type_row_bytes(t[i].type, t[i].ne[0]) * (uint64_t)t[i].ne[1] *
                         (uint64_t)t[i].ne[2];
        if ((e = kvs_gguf_writer_add_tensor(w, t[i].name, t[i].type, t[i].n_dims, t[i].ne, NULL, bytes))) {
            set_err(err, errlen, "adding tensor '%s': %s", t[i].name, kvs_strerror(e));
            goto fail;
        }
    }
    if ((e = kvs_gguf_writer_header(w, &hdr, &hdr_len))) {
        set_err(err, errlen, "serializing the header: %s", kvs_strerror(e));
        goto fail;
    }
    int k = snprintf(tmp, sizeof tmp, "%s.tmp", c->out);
    if (k < 0 || (size_t)k >= sizeof tmp) {
        e = KVS_ERR_ARG;
        set_err(err, errlen, "output path too long");
        goto fail;
    }
    {
        /* Refuse before writing what the output's filesystem cannot hold
         * (shapes in range can still multiply to terabytes). */
        const uint64_t need = kvs_gguf_writer_total_bytes(w);
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", c->out);
        char *slash = strrchr(dir, '/');
        if (!slash) snprintf(dir, sizeof dir, ".");
        else if (slash == dir) dir[1] = '\0';
        else *slash = '\0';
        struct statvfs vf;
        if (statvfs(dir, &vf) == 0 && need > (uint64_t)vf.f_bavail * (uint64_t)vf.f_frsize) {
            e = KVS_ERR_NOMEM;
            set_err(err, errlen, "the model would be %" PRIu64 " bytes but %s has %" PRIu64 " bytes free", need, dir,
                    (uint64_t)vf.f_bavail * (uint64_t)vf.f_frsize);
            goto fail;
        }
    }
    f = fopen(tmp, "wb");
    if (!f) {
        e = KVS_ERR_IO;
        set_err(err, errlen, "%s: %s", tmp, strerror(errno));
        goto fail;
    }
    tmp_made = true;
    setvbuf(f, NULL, _IOFBF, 1 << 20);
    e = KVS_ERR_IO;
    if (fwrite(hdr, 1, hdr_len, f) != hdr_len)
        goto io_fail;
    uint64_t pos = hdr_len;
    for (size_t i = 0; i < n; i++) {
        uint64_t off = kvs_gguf_writer_tensor_offset(w, i);
        if (off < pos) {
            e = KVS_ERR_INTERNAL;
            set_err(err, errlen, "tensor '%s' at offset %" PRIu64 " overlaps the previous data (at %" PRIu64 ")",
                     t[i].name, off, pos);
            goto fail;
        }
        if (!write_zeros(f, off - pos))
            goto io_fail;
        if ((e = write_tensor(f, c, &t[i], i, fbuf, qbuf))) {
            if (e == KVS_ERR_IO)
                goto io_fail;
            set_err(err, errlen, "quantizing '%s' to %s: %s", t[i].name, kvs_type_name(t[i].type), kvs_strerror(e));
            goto fail;
        }
        pos = off + (uint64_t)kvs_type_row_bytes(t[i].type, t[i].ne[0]) * (uint64_t)t[i].ne[1] * (uint64_t)t[i].ne[2];
    }
    e = KVS_ERR_IO;
    uint64_t total = kvs_gguf_writer_total_bytes(w);
    if (total < pos || !write_zeros(f, total - pos))
        goto io_fail;
    if (fclose(f)) {
        f = NULL;
        goto io_fail;
    }
    f = NULL;
    if (rename(tmp, c->out)) {
        set_err(err, errlen, "renaming %s to %s: %s", tmp, c->out, strerror(errno));
        goto fail;
    }
    tmp_made = false;
    e = KVS_OK;
    goto done;
io_fail:
    set_err(err, errlen, "writing %s: %s", tmp, strerror(errno));
fail:
    if (!err[0])
        set_err(err, errlen, "%s", kvs_strerror(e));
done:
    if (f)
        fclose(f);
    if (tmp_made)
        remove(tmp);
    free(hdr);
    free(qbuf);
    free(fbuf);
    kvs_gguf_writer_free(w);
    free(t);
    return e;
}

int kvs_cli_gguf_synth(int argc, char **argv)
{
    struct synth_cfg c;
    int r = parse_args(argc, argv, &c);
    if (r < 0) {
        usage(stdout);
        return 0;
    }
    if (r) {
        usage(stderr);
        return r;
    }
    char err[512];
    kvs_err e = synth_write(&c, err, sizeof err);
    if (e) {
        fprintf(stderr, "kvasir gguf synth: %s\n", err);
        return 1;
    }
    return 0;
}

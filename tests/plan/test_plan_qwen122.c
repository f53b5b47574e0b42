/* The planner on a Qwen3.5-122B-A10B model over a mixed inventory.
 *
 * Fixture (built as a GGUF header in memory, no tensor data, parsed with the
 * file's apparent size): the real configuration of
 * ../shared/docs/qwen35-facts.md §7 — 48 main blocks + 1 MTP (nextn) block,
 * n_embd 3072; every fourth block (3, 7, ..., 47) gated attention with 32
 * query heads of 256 (gated Q: 2 * 32 * 256 = 16384 rows) and 2 KV heads, the
 * others Gated DeltaNet with 16 key / 64 value heads of 128 (conv channels
 * 12288, kernel 4); every block MoE with 256 experts of width 1024, 8 used,
 * plus a shared expert of 1024; vocabulary 248320. Types: stock
 * llama-quantize Q4_K_M (facts §7): q4_K everywhere, q6_K for attn_qkv /
 * attn_v and ffn_down_exps / ffn_down_shexp in layers i < 49/8, i >= 7*49/8
 * or (i - 49/8) % 3 == 2 (integer division), output q6_K, token_embd q4_K;
 * norms, conv, ssm_a / ssm_dt and routers F32. Per-block bytes and the
 * total (75 832 911 872) are the facts document's table.
 *
 * Per-block byte counts are recomputed here from the shapes with the block
 * sizes of gguf-facts §2.1 (Q4_K 144 B / 256, Q6_K 210 B / 256, F32 4 B),
 * KV only for attention blocks (2 x 2 heads x 256 x 2 B per token) and a
 * fixed F32 state per sequence for DeltaNet blocks ((4-1) x 12288 conv +
 * 64 x 128 x 128 delta = 4 341 760 B, facts §4.2); the predicted token time
 * is recomputed from them and the device figures with the cost model of
 * docs/PLAN.md, independently of the planner's code. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "gguf/gguf.h"
#include "plan/plan.h"

#define E 3072ll
#define V 248320ll
#define X 256ll
#define FE 1024ll
#define QROWS 16384ll
#define KVW 512ll   /* 2 KV heads * 256 */
#define OIN 8192ll  /* 32 heads * 256 */
#define CONV 12288ll /* (2 * 16 + 64) * 128 */
#define VD 8192ll   /* 64 value heads * 128 */
#define HV 64ll
#define N_LAYER 49  /* 48 + 1 MTP */
#define N_RUN 48
#define STATE_SEQ 4341760ull /* ((4 - 1) * 12288 + 64 * 128 * 128) * 4 */
#define KV_TOK 2048ull       /* 2 (K, V) * 2 heads * 256 * 2 bytes (F16) */

/* Bytes of n elements: gguf-facts §2.1. */
static uint64_t q4k(uint64_t n) { return n / 256 * 144; }
static uint64_t q6k(uint64_t n) { return n / 256 * 210; }
static uint64_t f32(uint64_t n) { return n * 4; }

static bool attn_block(int b) { return (b + 1) % 4 == 0 || b == N_RUN; /* the MTP block is attention */ }
/* llama-quantize's Q4_K_M "more bits" layers (facts §7), n = block_count 49. */
static bool q6_layer(int i) { return i < N_LAYER / 8 || i >= 7 * N_LAYER / 8 || (i - N_LAYER / 8) % 3 == 2; }
static uint64_t q46(int b, uint64_t n) { return q6_layer(b) ? q6k(n) : q4k(n); }

/* Hand-computed bytes of block b's tensors (held), and streamed per token
 * (8 of 256 experts). */
static uint64_t hand_ffn(int b, bool stream)
{
    uint64_t exps = 2 * q4k(E * FE * X) + q46(b, FE * E * X);
    return 2 * f32(E) /* attn_norm, post_attention_norm */ + f32(E * X) /* router */ +
           (stream ? exps / 256 * 8 : exps) + f32(E) /* shared gate */ + 2 * q4k(E * FE) + q46(b, FE * E);
}

static uint64_t hand_mixer(int b)
{
    if (attn_block(b))
        return q4k(E * QROWS) + q4k(E * KVW) + q46(b, E * KVW) + 2 * f32(256) + q4k(OIN * E);
    return q46(b, E * CONV) + q4k(E * VD) + f32(4 * CONV) + 2 * f32(HV) + 2 * q4k(E * HV) + f32(128) + q4k(VD * E);
}

static uint64_t hand_block_weights(int b) { return hand_mixer(b) + hand_ffn(b, false); }
static uint64_t hand_block_stream(int b) { return hand_mixer(b) + hand_ffn(b, true); }
static uint64_t hand_kv(int b) { return attn_block(b) ? KV_TOK : 0; }
static uint64_t hand_state(int b) { return attn_block(b) ? 0 : STATE_SEQ; }
/* The MTP block 48: an attention block + eh_proj {2E, E} q4_K + 3 norms. */
static uint64_t hand_mtp(void) { return hand_block_weights(N_RUN) + q4k(2 * E * E) + 3 * f32(E); }

static kvs_err add(struct kvs_gguf_writer *w, const char *name, enum kvs_type type, uint32_t nd, int64_t a,
                   int64_t b, int64_t c, uint64_t bytes)
{
    int64_t ne[4] = { a, b, c, 1 };
    return kvs_gguf_writer_add_tensor(w, name, type, nd, ne, NULL, bytes);
}

static uint8_t *g_hdr;
static struct kvs_gguf *g_gguf;

static int setup(void **state)
{
    (void)state;
    struct kvs_gguf_writer *w = kvs_gguf_writer_create();
    if (!w)
        return -1;
    kvs_err e = kvs_gguf_writer_set_str(w, "general.architecture", "qwen35moe");
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.block_count", N_LAYER);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.nextn_predict_layers", 1);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.context_length", 262144);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.embedding_length", (uint32_t)E);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.attention.head_count", 32);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.attention.head_count_kv", 2);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.attention.key_length", 256);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.attention.value_length", 256);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.expert_count", (uint32_t)X);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.expert_used_count", 8);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.expert_feed_forward_length", (uint32_t)FE);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.expert_shared_feed_forward_length", (uint32_t)FE);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.ssm.conv_kernel", 4);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.ssm.state_size", 128);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.ssm.group_count", 16);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.ssm.time_step_rank", (uint32_t)HV);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.ssm.inner_size", (uint32_t)VD);
    e = e ? e : kvs_gguf_writer_set_u32(w, "qwen35moe.full_attention_interval", 4);
    e = e ? e : add(w, "token_embd.weight", KVS_TYPE_Q4_K, 2, E, V, 1, q4k(E * V));
    char name[64];
    for (int b = 0; b < N_LAYER && !e; b++) {
#define T(suffix, type, nd, a, bb, c, bytes)                                                                    \
    do {                                                                                                       \
        snprintf(name, sizeof name, "blk.%d.%s", b, suffix);                                                   \
        if (!e)                                                                                                \
            e = add(w, name, type, nd, a, bb, c, bytes);                                                       \
    } while (0)
        const enum kvs_type t46 = q6_layer(b) ? KVS_TYPE_Q6_K : KVS_TYPE_Q4_K;
        T("attn_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        if (attn_block(b)) {
            T("attn_q.weight", KVS_TYPE_Q4_K, 2, E, QROWS, 1, q4k(E * QROWS));
            T("attn_k.weight", KVS_TYPE_Q4_K, 2, E, KVW, 1, q4k(E * KVW));
            T("attn_v.weight", t46, 2, E, KVW, 1, q46(b, E * KVW));
            T("attn_q_norm.weight", KVS_TYPE_F32, 1, 256, 1, 1, f32(256));
            T("attn_k_norm.weight", KVS_TYPE_F32, 1, 256, 1, 1, f32(256));
            T("attn_output.weight", KVS_TYPE_Q4_K, 2, OIN, E, 1, q4k(OIN * E));
        } else {
            T("attn_qkv.weight", t46, 2, E, CONV, 1, q46(b, E * CONV));
            T("attn_gate.weight", KVS_TYPE_Q4_K, 2, E, VD, 1, q4k(E * VD));
            T("ssm_conv1d.weight", KVS_TYPE_F32, 2, 4, CONV, 1, f32(4 * CONV));
            T("ssm_dt.bias", KVS_TYPE_F32, 1, HV, 1, 1, f32(HV));
            T("ssm_a", KVS_TYPE_F32, 1, HV, 1, 1, f32(HV));
            T("ssm_beta.weight", KVS_TYPE_Q4_K, 2, E, HV, 1, q4k(E * HV));
            T("ssm_alpha.weight", KVS_TYPE_Q4_K, 2, E, HV, 1, q4k(E * HV));
            T("ssm_norm.weight", KVS_TYPE_F32, 1, 128, 1, 1, f32(128));
            T("ssm_out.weight", KVS_TYPE_Q4_K, 2, VD, E, 1, q4k(VD * E));
        }
        T("post_attention_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        T("ffn_gate_inp.weight", KVS_TYPE_F32, 2, E, X, 1, f32(E * X));
        T("ffn_gate_exps.weight", KVS_TYPE_Q4_K, 3, E, FE, X, q4k(E * FE * X));
        T("ffn_up_exps.weight", KVS_TYPE_Q4_K, 3, E, FE, X, q4k(E * FE * X));
        T("ffn_down_exps.weight", t46, 3, FE, E, X, q46(b, FE * E * X));
        T("ffn_gate_inp_shexp.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        T("ffn_gate_shexp.weight", KVS_TYPE_Q4_K, 2, E, FE, 1, q4k(E * FE));
        T("ffn_up_shexp.weight", KVS_TYPE_Q4_K, 2, E, FE, 1, q4k(E * FE));
        T("ffn_down_shexp.weight", t46, 2, FE, E, 1, q46(b, FE * E));
        if (b == N_RUN) { /* the MTP block: projection of [embedding; hidden] and its norms */
            T("nextn.eh_proj.weight", KVS_TYPE_Q4_K, 2, 2 * E, E, 1, q4k(2 * E * E));
            T("nextn.enorm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
            T("nextn.hnorm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
            T("nextn.shared_head_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        }
#undef T
    }
    e = e ? e : add(w, "output_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
    e = e ? e : add(w, "output.weight", KVS_TYPE_Q6_K, 2, E, V, 1, q6k(E * V));
    uint8_t *hdr = NULL;
    size_t len = 0;
    e = e ? e : kvs_gguf_writer_header(w, &hdr, &len);
    uint64_t total = kvs_gguf_writer_total_bytes(w);
    kvs_gguf_writer_free(w);
    if (e)
        return -1;
    char err[256];
    size_t need = 0;
    e = kvs_gguf_parse(hdr, len, total, &g_gguf, &need, err, sizeof err);
    if (e) {
        fprintf(stderr, "parse: %s (%s)\n", kvs_strerror(e), err);
        free(hdr);
        return -1;
    }
    g_hdr = hdr;
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    kvs_gguf_close(g_gguf);
    free(g_hdr);
    return 0;
}

static void test_profile(void **state)
{
    (void)state;
    struct kvs_plan_model *m = NULL;
    char err[256];
    assert_int_equal(kvs_plan_model_from_gguf(g_gguf, &m, err, sizeof err), KVS_OK);
    assert_int_equal(m->n_block, N_RUN);
    uint64_t total = 0;
    int n_attn = 0;
    for (int b = 0; b < N_RUN; b++) {
        assert_int_equal(m->block_weight_bytes[b], hand_block_weights(b));
        assert_int_equal(m->block_stream_bytes[b], hand_block_stream(b));
        assert_int_equal(m->block_kv_bytes[b], hand_kv(b));
        assert_int_equal(m->block_state_bytes[b], hand_state(b));
        n_attn += attn_block(b);
        total += m->block_weight_bytes[b];
    }
    assert_int_equal(n_attn, 12);
    /* The facts document's per-block bytes (§7 table, Q4_K_M). */
    assert_int_equal(m->block_weight_bytes[0], 1635570688ull);  /* GDN, q6_K variant */
    assert_int_equal(m->block_weight_bytes[6], 1417409536ull);  /* GDN, q4_K variant */
    assert_int_equal(m->block_weight_bytes[3], 1620518912ull);  /* attention, q6_K variant */
    assert_int_equal(m->block_weight_bytes[7], 1411684352ull);  /* attention, q4_K variant */
    assert_int_equal(hand_mtp(), 1631172608ull);                /* MTP block 48 */
    assert_int_equal(m->head_bytes, 429096960ull);              /* token_embd q4_K */
    assert_int_equal(m->head_stream_bytes, q4k(E));             /* one row */
    assert_int_equal(m->tail_bytes, f32(E) + 625766400ull + hand_mtp()); /* output q6_K */
    assert_int_equal(m->tail_stream_bytes, f32(E) + q6k(E * V));
    assert_int_equal(m->tied_bytes, 0);
    assert_int_equal(m->n_vocab, V);
    assert_int_equal(m->n_embd, E);
    total += m->head_bytes + m->tail_bytes;
    printf("fixture: %.3f GB total; blocks: GDN %.4f / %.4f GB, attention %.4f / %.4f GB (q6_K / q4_K variant); "
           "state %.2f MiB per sequence per GDN block, KV %llu B per token per attention block\n",
           total / 1e9, hand_block_weights(0) / 1e9, hand_block_weights(6) / 1e9, hand_block_weights(3) / 1e9,
           hand_block_weights(7) / 1e9, STATE_SEQ / 1048576.0, (unsigned long long)KV_TOK);
    assert_int_equal(total, 75832911872ull); /* facts §7: total tensor data */
    /* The data section holds every tensor (plus alignment padding). */
    assert_true(total <= kvs_gguf_file_size(g_gguf) - kvs_gguf_data_offset(g_gguf));
    assert_true(total + 32ull * 1000 >= kvs_gguf_file_size(g_gguf) - kvs_gguf_data_offset(g_gguf));
    free(m);
}

static void set_dev(struct kvs_plan_device *d, const char *name, enum kvs_plan_backend be, double mem_gb,
                    double gbps, double rtt, double mbps, bool inbound)
{
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name);
    d->backend = be;
    d->mem_bytes = (uint64_t)(mem_gb * 1e9);
    d->decode_gbps = gbps;
    d->rtt_ms = rtt;
    d->bandwidth_mbps = mbps;
    d->accepts_inbound = inbound;
    d->threads = 1;
}

enum { GPU24, GPU16, CPU64, NPU8, PHONE_A, PHONE_B, N_DEV };

/* The mixed inventory: a 24 GB and a 16 GB GPU, a CPU box of cpu_gb GB,
 * an 8 GB NPU and two 12 GB phones that only dial out (40 ms relay). */
static void mixed_inventory(struct kvs_plan_inventory *inv, const char *cpu_name, double cpu_gb)
{
    inv->n_devices = N_DEV;
    inv->relay_rtt_ms = 40;
    set_dev(&inv->devices[GPU24], "gpu-24g", KVS_PLAN_BACKEND_CUDA, 24, 900, 0.2, 10000, true);
    set_dev(&inv->devices[GPU16], "gpu-16g", KVS_PLAN_BACKEND_VULKAN, 16, 450, 0.2, 10000, true);
    set_dev(&inv->devices[CPU64], cpu_name, KVS_PLAN_BACKEND_CPU, cpu_gb, 60, 0.2, 10000, true);
    set_dev(&inv->devices[NPU8], "npu-8g", KVS_PLAN_BACKEND_NPU, 8, 30, 1.0, 1000, true);
    set_dev(&inv->devices[PHONE_A], "phone-a", KVS_PLAN_BACKEND_OPENCL, 12, 25, 30, 100, false);
    set_dev(&inv->devices[PHONE_B], "phone-b", KVS_PLAN_BACKEND_OPENCL, 12, 25, 30, 100, false);
}

/* Checks a plan for ctx 32768 x 2 seqs: windows contiguous, non-empty and
 * covering every block, one per device; each rank's weights, KV and buffers
 * recomputed by hand and within its device's memory; the predicted token time
 * equal to the sum of stage and hop times computed here from the device
 * figures. Fills blocks[] (per device) and returns that hand-computed time. */
static double check_plan(const struct kvs_plan_inventory *inv, const struct kvs_plan_result *res, int blocks[N_DEV])
{
    uint32_t at = 0;
    const uint64_t buf = 512ull * E * 4 * 8;       /* ubatch * n_embd * 4 bytes * 8 */
    const uint64_t logits = 2ull * V * 4;          /* seqs * n_vocab * 4 */
    const uint64_t mtp = hand_mtp();
    double hand_ms = 0;
    for (size_t r = 0; r < res->n_ranks; r++) {
        const struct kvs_plan_rank *rk = &res->ranks[r];
        const struct kvs_plan_device *d = &inv->devices[rk->device];
        /* Contiguous, non-empty, one window per device. */
        assert_int_equal(rk->begin, at);
        assert_true(rk->end > rk->begin);
        assert_int_equal(blocks[rk->device], 0);
        blocks[rk->device] = (int)(rk->end - rk->begin);
        at = rk->end;
        /* Memory, recomputed by hand. */
        uint32_t nb = rk->end - rk->begin;
        uint64_t w = 0, kv = 0;
        double stream = 0;
        for (uint32_t b = rk->begin; b < rk->end; b++) {
            w += hand_block_weights((int)b);
            stream += (double)hand_block_stream((int)b);
            kv += (hand_kv((int)b) * 32768 + hand_state((int)b)) * 2; /* ctx 32768, 2 seqs */
        }
        if (rk->begin == 0) {
            w += q4k(E * V);
            stream += q4k(E);
        }
        if (rk->end == N_RUN) {
            w += f32(E) + q6k(E * V) + mtp;
            stream += f32(E) + q6k(E * V);
        }
        uint64_t bb = buf + (rk->end == N_RUN ? logits : 0);
        assert_int_equal(rk->weights_bytes, w);
        assert_int_equal(rk->kv_bytes, kv);
        assert_int_equal(rk->buffer_bytes, bb);
        assert_true(w + kv + bb <= d->mem_bytes);
        /* Time: bytes / (GB/s * 1e9) s, + 0.02 ms per block; hops: max RTT / 2
         * (+ 40 ms relay RTT if relay-only) + bytes * 8 bits / min bandwidth. */
        hand_ms += stream / (d->decode_gbps * 1e9) * 1e3 + nb * 0.02;
        if (res->n_ranks > 1) {
            const struct kvs_plan_device *nx = &inv->devices[res->ranks[(r + 1) % res->n_ranks].device];
            double rtt = d->rtt_ms > nx->rtt_ms ? d->rtt_ms : nx->rtt_ms;
            if (!d->accepts_inbound || !nx->accepts_inbound)
                rtt += 40;
            double bw = d->bandwidth_mbps < nx->bandwidth_mbps ? d->bandwidth_mbps : nx->bandwidth_mbps;
            /* auto boundary: f32 (4 bytes) unless one f32 row (E * 32 bits) takes > 5 ms */
            double row_bytes = E * 32 / (bw * 1e3) > 5.0 ? 2 : 4;
            double bytes = r + 1 < res->n_ranks ? E * row_bytes : 4;
            if (r + 1 < res->n_ranks) assert_int_equal(rk->boundary_bytes, (uint32_t)row_bytes);
            hand_ms += rtt / 2 + bytes * 8 / (bw * 1e6) * 1e3;
        }
        printf("rank %zu %-8s [%2u,%2u) %2u blocks  %.2f GB  compute %.3f ms  hop %.3f ms\n", r, d->name, rk->begin,
               rk->end, nb, (double)(w + kv + bb) / 1e9, rk->compute_ms, rk->hop_ms);
    }
    assert_int_equal(at, N_RUN);
    printf("predicted %.4f ms/token (hand %.4f), %.2f tok/s, %.2f tok/s at 2 seqs\n", res->token_ms, hand_ms,
           res->decode_tps_1, res->decode_tps_seqs);
    double diff = res->token_ms - hand_ms;
    assert_true(diff < 1e-9 * hand_ms && -diff < 1e-9 * hand_ms);
    return hand_ms;
}

static void test_mixed_inventory(void **state)
{
    (void)state;
    struct kvs_plan_model *m = NULL;
    char err[256];
    assert_int_equal(kvs_plan_model_from_gguf(g_gguf, &m, err, sizeof err), KVS_OK);
    struct kvs_plan_inventory *inv = calloc(1, sizeof *inv);
    struct kvs_plan_result *res = calloc(1, sizeof *res);
    assert_non_null(inv);
    assert_non_null(res);
    mixed_inventory(inv, "cpu-64g", 64);
    struct kvs_plan_targets t = kvs_plan_default_targets();
    t.ctx = 32768;
    t.seqs = 2;
    assert_int_equal(kvs_plan_solve(m, inv, &t, res, err, sizeof err), KVS_OK);
    assert_true(res->exhaustive); /* 6 devices: every ring order tried */

    int blocks[N_DEV] = { 0 };
    double hand_ms = check_plan(inv, res, blocks);
    /* Pipeline model: S / max(token_ms, S * max stage) tokens per ms. */
    double maxst = 0;
    for (size_t r = 0; r < res->n_ranks; r++)
        if (res->ranks[r].compute_ms > maxst)
            maxst = res->ranks[r].compute_ms;
    double den = hand_ms > 2 * maxst ? hand_ms : 2 * maxst;
    double tps = 2000.0 / den;
    assert_true(res->decode_tps_seqs > tps * (1 - 1e-9) && res->decode_tps_seqs < tps * (1 + 1e-9));

    /* Fast devices carry the model; slow and relay-only ones get small (or no)
     * windows: the phones sit behind a 40 ms relay and stream at 25 GB/s, the
     * NPU streams at half the CPU's rate. */
    assert_true(blocks[GPU24] >= 10);
    assert_true(blocks[GPU24] >= blocks[GPU16]);
    assert_true(blocks[GPU16] >= 5);
    assert_true(blocks[PHONE_A] <= 2 && blocks[PHONE_B] <= 2);
    assert_true(blocks[NPU8] <= blocks[CPU64]);
    /* The output matrix (626 MB streamed per token) goes on a GPU tail. */
    enum kvs_plan_backend tail_be = inv->devices[res->ranks[res->n_ranks - 1].device].backend;
    assert_true(tail_be == KVS_PLAN_BACKEND_CUDA || tail_be == KVS_PLAN_BACKEND_VULKAN);

    /* Manifest: parses back with the same windows. */
    char *json = NULL;
    assert_int_equal(kvs_plan_manifest_json(m, inv, &t, res, "qwen.gguf", NULL, &json), KVS_OK);
    struct kvs_manifest *mf = calloc(1, sizeof *mf);
    assert_non_null(mf);
    assert_int_equal(kvs_manifest_parse(json, strlen(json), mf, err, sizeof err), KVS_OK);
    assert_int_equal(mf->n_ranks, res->n_ranks);
    assert_int_equal(mf->n_block, N_RUN);
    for (size_t r = 0; r < mf->n_ranks; r++) {
        assert_int_equal(mf->ranks[r].begin, res->ranks[r].begin);
        assert_int_equal(mf->ranks[r].end, res->ranks[r].end);
        assert_string_equal(mf->ranks[r].next, mf->ranks[(r + 1) % mf->n_ranks].listen);
    }
    free(mf);
    free(json);

    /* Without the CPU box the rest cannot hold the model: the shortfall is
     * need - capacity by hand (docs/PLAN.md "Infeasible"). */
    inv->devices[CPU64] = inv->devices[N_DEV - 1];
    inv->n_devices = N_DEV - 1;
    const uint64_t buf = 512ull * E * 4 * 8, logits = 2ull * V * 4;
    uint64_t need = q4k(E * V) + f32(E) + q6k(E * V) + hand_mtp() + logits;
    for (int b = 0; b < N_RUN; b++) need += hand_block_weights(b) + (hand_kv(b) * 32768 + hand_state(b)) * 2;
    uint64_t cap = (24000000000ull - buf) + (16000000000ull - buf) + (8000000000ull - buf) +
                   2 * (12000000000ull - buf);
    assert_int_equal(kvs_plan_solve(m, inv, &t, res, err, sizeof err), KVS_ERR_INFEASIBLE);
    assert_int_equal(res->shortfall_bytes, need - cap);
    printf("without cpu-64g: %s\n", err);
    free(inv);
    free(res);
    free(m);
}


/* The same devices with a 30 GB CPU box: the fast devices alone (24 + 16 +
 * 30 GB) cannot hold the 77.5 GB model and its KV cache, so the NPU and a
 * phone behind the relay must serve blocks too: they get the smallest
 * windows, and the plan still meets every invariant and the hand-computed
 * token time. */
static void test_tight_inventory(void **state)
{
    (void)state;
    struct kvs_plan_model *m = NULL;
    char err[256];
    assert_int_equal(kvs_plan_model_from_gguf(g_gguf, &m, err, sizeof err), KVS_OK);
    struct kvs_plan_inventory *inv = calloc(1, sizeof *inv);
    struct kvs_plan_result *res = calloc(1, sizeof *res);
    assert_non_null(inv);
    assert_non_null(res);
    mixed_inventory(inv, "cpu-30g", 30);
    struct kvs_plan_targets t = kvs_plan_default_targets();
    t.ctx = 32768;
    t.seqs = 2;
    assert_int_equal(kvs_plan_solve(m, inv, &t, res, err, sizeof err), KVS_OK);
    int blocks[N_DEV] = { 0 };
    double hand_ms = check_plan(inv, res, blocks);
    printf("tight: predicted %.4f ms/token (hand %.4f), %.2f tok/s\n", res->token_ms, hand_ms, res->decode_tps_1);
    /* Slow and relay-only devices are needed, and get the small windows. */
    assert_true(blocks[NPU8] > 0);
    assert_true(blocks[PHONE_A] + blocks[PHONE_B] > 0);
    int min_fast = blocks[GPU24];
    if (blocks[GPU16] < min_fast) min_fast = blocks[GPU16];
    if (blocks[CPU64] < min_fast) min_fast = blocks[CPU64];
    assert_true(blocks[NPU8] < min_fast);
    assert_true(blocks[PHONE_A] < min_fast && blocks[PHONE_B] < min_fast);
    assert_true(blocks[PHONE_A] + blocks[PHONE_B] <= blocks[NPU8] + 4);
    free(inv);
    free(res);
    free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_profile),
        cmocka_unit_test(test_mixed_inventory), cmocka_unit_test(test_tight_inventory),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

/* The planner on a Qwen3.5-122B-A10B-shaped model over a mixed inventory.
 *
 * Fixture (built as a GGUF header in memory, no tensor data, parsed with the
 * file's apparent size): 48 blocks + 1 MTP (nextn) block, n_embd 3072, 32
 * heads (gated Q: 2 * 32 * 256 = 16384 rows), 2 KV heads of 256, 256 experts
 * of width 1024 with 8 used plus a shared expert, vocabulary 248320.
 * Types: attention and shared expert Q8_0, gate/up experts Q4_K, down experts
 * Q5_K, embedding and output Q6_K, norms and router F32 -> about 77.5 GB, a
 * Q4_K-class mix. (Simplification: every block is given full-attention KV;
 * the real model's Gated DeltaNet layers keep a fixed state instead.)
 *
 * Per-block byte counts are recomputed here from the shapes with the block
 * sizes of gguf-facts §2.1 (Q4_K 144 B / 256, Q5_K 176 B / 256,
 * Q6_K 210 B / 256, Q8_0 34 B / 32, F32 4 B), and the predicted token time is
 * recomputed from them and the device figures with the cost model of
 * docs/PLAN.md, independently of the planner's code. */
#include <setjmp.h>
#include <stdarg.h>
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
#define N_LAYER 49  /* 48 + 1 MTP */
#define N_RUN 48

/* Bytes of n elements: gguf-facts §2.1. */
static uint64_t q4k(uint64_t n) { return n / 256 * 144; }
static uint64_t q5k(uint64_t n) { return n / 256 * 176; }
static uint64_t q6k(uint64_t n) { return n / 256 * 210; }
static uint64_t q80(uint64_t n) { return n / 32 * 34; }
static uint64_t f32(uint64_t n) { return n * 4; }

/* Hand-computed profile of one block. */
static uint64_t hand_block_weights(void)
{
    return 2 * f32(E)                                                  /* attn_norm, ffn_norm */
           + q80(E * QROWS) + 2 * q80(E * KVW) + q80(OIN * E)          /* q, k, v, o */
           + f32(E * X)                                                /* router */
           + 2 * q4k(E * FE * X) + q5k(FE * E * X)                     /* gate/up/down experts */
           + 2 * q80(E * FE) + q80(FE * E);                            /* shared expert */
}

static uint64_t hand_block_stream(void)
{
    return 2 * f32(E) + q80(E * QROWS) + 2 * q80(E * KVW) + q80(OIN * E) + f32(E * X) +
           (2 * q4k(E * FE * X) + q5k(FE * E * X)) / 256 * 8 /* 8 of 256 experts */
           + 2 * q80(E * FE) + q80(FE * E);
}

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
    e = e ? e : add(w, "token_embd.weight", KVS_TYPE_Q6_K, 2, E, V, 1, q6k(E * V));
    char name[64];
    for (int b = 0; b < N_LAYER && !e; b++) {
#define T(suffix, type, nd, a, bb, c, bytes)                                                                    \
    do {                                                                                                       \
        snprintf(name, sizeof name, "blk.%d.%s", b, suffix);                                                   \
        if (!e)                                                                                                \
            e = add(w, name, type, nd, a, bb, c, bytes);                                                       \
    } while (0)
        T("attn_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        T("attn_q.weight", KVS_TYPE_Q8_0, 2, E, QROWS, 1, q80(E * QROWS));
        T("attn_k.weight", KVS_TYPE_Q8_0, 2, E, KVW, 1, q80(E * KVW));
        T("attn_v.weight", KVS_TYPE_Q8_0, 2, E, KVW, 1, q80(E * KVW));
        T("attn_output.weight", KVS_TYPE_Q8_0, 2, OIN, E, 1, q80(OIN * E));
        T("ffn_norm.weight", KVS_TYPE_F32, 1, E, 1, 1, f32(E));
        T("ffn_gate_inp.weight", KVS_TYPE_F32, 2, E, X, 1, f32(E * X));
        T("ffn_gate_exps.weight", KVS_TYPE_Q4_K, 3, E, FE, X, q4k(E * FE * X));
        T("ffn_up_exps.weight", KVS_TYPE_Q4_K, 3, E, FE, X, q4k(E * FE * X));
        T("ffn_down_exps.weight", KVS_TYPE_Q5_K, 3, FE, E, X, q5k(FE * E * X));
        T("ffn_gate_shexp.weight", KVS_TYPE_Q8_0, 2, E, FE, 1, q80(E * FE));
        T("ffn_up_shexp.weight", KVS_TYPE_Q8_0, 2, E, FE, 1, q80(E * FE));
        T("ffn_down_shexp.weight", KVS_TYPE_Q8_0, 2, FE, E, 1, q80(FE * E));
        if (b == N_LAYER - 1) /* the MTP block's projection of [embedding; hidden] */
            T("nextn.eh_proj.weight", KVS_TYPE_Q8_0, 2, 2 * E, E, 1, q80(2 * E * E));
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
    for (int b = 0; b < N_RUN; b++) {
        assert_int_equal(m->block_weight_bytes[b], hand_block_weights());
        assert_int_equal(m->block_stream_bytes[b], hand_block_stream());
        /* 2 (K, V) * 2 heads * 256 * 2 bytes (F16) */
        assert_int_equal(m->block_kv_bytes[b], 2048);
        total += m->block_weight_bytes[b];
    }
    assert_int_equal(m->head_bytes, q6k(E * V));
    assert_int_equal(m->head_stream_bytes, q6k(E)); /* one row */
    uint64_t mtp = hand_block_weights() + q80(2 * E * E);
    assert_int_equal(m->tail_bytes, f32(E) + q6k(E * V) + mtp);
    assert_int_equal(m->tail_stream_bytes, f32(E) + q6k(E * V));
    assert_int_equal(m->tied_bytes, 0);
    assert_int_equal(m->n_vocab, V);
    assert_int_equal(m->n_embd, E);
    total += m->head_bytes + m->tail_bytes;
    /* ~77.5 GB: the Q4_K-class mix of a 122B-parameter model. */
    printf("fixture: %.3f GB total, %.4f GB per block, %.4f GB streamed per block per token\n", total / 1e9,
           hand_block_weights() / 1e9, hand_block_stream() / 1e9);
    assert_true(total > 77000000000ull && total < 78200000000ull);
    /* The data section holds every tensor (plus alignment padding). */
    assert_true(total <= kvs_gguf_file_size(g_gguf) - kvs_gguf_data_offset(g_gguf));
    assert_true(total + 32ull * 700 >= kvs_gguf_file_size(g_gguf) - kvs_gguf_data_offset(g_gguf));
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
    const uint64_t kv_tok = 2048;                  /* per block per token */
    const uint64_t mtp = hand_block_weights() + q80(2 * E * E);
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
        uint64_t w = nb * hand_block_weights();
        double stream = (double)nb * hand_block_stream();
        if (rk->begin == 0) {
            w += q6k(E * V);
            stream += q6k(E);
        }
        if (rk->end == N_RUN) {
            w += f32(E) + q6k(E * V) + mtp;
            stream += f32(E) + q6k(E * V);
        }
        uint64_t kv = nb * kv_tok * 32768 * 2;
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
            double bytes = r + 1 < res->n_ranks ? E * 2 : 4;
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
    const uint64_t buf = 512ull * E * 4 * 8, logits = 2ull * V * 4, kv_tok = 2048;
    const uint64_t mtp = hand_block_weights() + q80(2 * E * E);
    uint64_t need = N_RUN * (hand_block_weights() + kv_tok * 32768 * 2) + q6k(E * V) + f32(E) + q6k(E * V) + mtp +
                    logits;
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

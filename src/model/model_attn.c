/* Attention blocks: llama / qwen2 / qwen3 (gguf-facts §4.4) and the qwen35
 * gated variant (../shared/docs/qwen35-facts.md §3.3: query and gate from one
 * projection, q/k RMSNorm, partial NeoX RoPE, sigmoid gate on the output).
 * K and V go to the window's F16 KV cache of the block. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_impl.h"

kvs_err kvs_model__load_attn(struct kvs_model_loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd, D = hp->head_dim, QD = (int64_t)hp->n_head * D, KD = (int64_t)hp->n_head_kv * D;
    const bool hybrid = kvs_hparams_hybrid(hp);
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, (int)il), n)
    /* qwen35: per head D query rows then D gate rows */
    if ((e = kvs_model__mat(L, NAME("attn_q.weight"), E, hybrid ? 2 * QD : QD, &b->wq))) return e;
    if ((e = kvs_model__mat(L, NAME("attn_k.weight"), E, KD, &b->wk))) return e;
    if ((e = kvs_model__mat(L, NAME("attn_v.weight"), E, KD, &b->wv))) return e;
    if ((e = kvs_model__mat(L, NAME("attn_output.weight"), QD, E, &b->wo))) return e;
    bool need_bias = hp->arch == KVS_ARCH_QWEN2;
    bool may_bias = hp->arch == KVS_ARCH_QWEN2 || hp->arch == KVS_ARCH_LLAMA;
    if (may_bias) {
        if ((e = kvs_model__vec(L, NAME("attn_q.bias"), QD, need_bias, &b->bq))) return e;
        if ((e = kvs_model__vec(L, NAME("attn_k.bias"), KD, need_bias, &b->bk))) return e;
        if ((e = kvs_model__vec(L, NAME("attn_v.bias"), KD, need_bias, &b->bv))) return e;
    }
    if (hp->arch == KVS_ARCH_LLAMA && (e = kvs_model__vec(L, NAME("attn_output.bias"), E, false, &b->bo))) return e;
    if (hp->arch == KVS_ARCH_QWEN3 || hp->arch == KVS_ARCH_QWEN3MOE || hybrid) {
        if ((e = kvs_model__vec(L, NAME("attn_q_norm.weight"), D, true, &b->q_norm))) return e;
        if ((e = kvs_model__vec(L, NAME("attn_k_norm.weight"), D, true, &b->k_norm))) return e;
    }
#undef NAME
    return KVS_OK;
}

/* cos/sin per rotated pair at position pos (gguf-facts §4.3): theta starts
 * at pos and is multiplied by base^(-2/n_rot) once per pair. For qwen35's
 * M-RoPE with text positions (all rows = pos) this is plain NeoX RoPE over
 * the first n_rot dims (qwen35-facts §3.3 step 3). */
void kvs_model__rope_table(const struct kvs_model *m, int32_t pos, float *cs)
{
    const struct kvs_hparams *hp = &m->hp;
    const float theta_scale = powf(hp->rope_freq_base, -2.0f / (float)hp->n_rot);
    float theta = (float)pos;
    for (uint32_t i = 0; i < hp->n_rot / 2; i++) {
        const float ff = m->rope_freqs ? m->rope_freqs[i] : 1.0f;
        const float th = (theta / ff) * hp->rope_freq_scale;
        cs[2 * i] = cosf(th);
        cs[2 * i + 1] = sinf(th);
        theta *= theta_scale;
    }
}

/* Rotates the first n_rot dims of one head; dims n_rot..D-1 are untouched. */
static void rope_apply(const struct kvs_model *m, float *x, const float *cs)
{
    const uint32_t n_rot = m->hp.n_rot;
    if (m->hp.rope_neox) {
        const uint32_t half = n_rot / 2;
        for (uint32_t i = 0; i < half; i++) {
            const float x0 = x[i], x1 = x[i + half], c = cs[2 * i], s = cs[2 * i + 1];
            x[i] = x0 * c - x1 * s;
            x[i + half] = x0 * s + x1 * c;
        }
    } else {
        for (uint32_t i = 0; i < n_rot; i += 2) {
            const float x0 = x[i], x1 = x[i + 1], c = cs[i], s = cs[i + 1];
            x[i] = x0 * c - x1 * s;
            x[i + 1] = x0 * s + x1 * c;
        }
    }
}

#define ATT_PARALLEL_MIN_MACS ((int64_t)1 << 16)

struct att_ctx {
    struct kvs_model *m;
    const struct kvs_batch *b;
    int32_t slot; /* the block's KV cache index in the window */
};

/* Attention for (token, head) work items ith, ith + nth, ... as llama.cpp's
 * CPU flash-attention kernel computes it (its default; gguf-facts §4.4 gives
 * the roundings): q rounded to F16, scores q·k against the F16 K cache
 * (F32 sum) times 1/sqrt(D), then one pass of online softmax whose V
 * accumulator is kept in F16 (rescaled by exp(M_old - M) when the running
 * max M grows, else v is added with weight exp(s - M)), divided by the F32
 * sum of the weights at the end. Measured against the reference files this
 * tracks llama.cpp better than the two-pass softmax (README figures). */
static void attention_worker(void *vctx, int ith, int nth)
{
    struct att_ctx *c = vctx;
    struct kvs_model *m = c->m;
    const struct kvs_batch *b = c->b;
    const int32_t H = (int32_t)m->hp.n_head, D = (int32_t)m->hp.head_dim;
    const int32_t group = (int32_t)(m->hp.n_head / m->hp.n_head_kv);
    const float scale = 1.0f / sqrtf((float)D);
    const float *tab = m->f16tab;
    uint16_t *q16 = m->att_ws16 + (size_t)ith * 2 * (size_t)D;
    uint16_t *acc = q16 + D;
    const int64_t n_items = (int64_t)b->n_tokens * H;
    for (int64_t it = ith; it < n_items; it += nth) {
        const int32_t t = (int32_t)(it / H), h = (int32_t)(it % H);
        const int32_t seq = b->seq[t], pos = b->pos[t];
        const int32_t hk = h / group;
        const size_t base = ((size_t)c->slot * (size_t)m->n_seq + (size_t)seq) * (size_t)m->n_ctx * (size_t)m->kv_dim;
        const uint16_t *kc = m->kcache + base + (size_t)hk * (size_t)D;
        const uint16_t *vc = m->vcache + base + (size_t)hk * (size_t)D;
        const float *q = m->q + (size_t)t * (size_t)m->q_dim + (size_t)h * (size_t)D;
        kvs_quantize_act(m->k, KVS_TYPE_F16, q, q16, D);
        memset(acc, 0, (size_t)D * sizeof *acc);
        float M = -INFINITY, S = 0.0f;
        for (int32_t j = 0; j <= pos; j++) {
            const uint16_t *kr = kc + (size_t)j * (size_t)m->kv_dim;
            const uint16_t *vr = vc + (size_t)j * (size_t)m->kv_dim;
            const float s = kvs_vec_dot(m->k, KVS_TYPE_F16, D, q16, kr) * scale;
            float ms = 1.0f, vs = 1.0f;
            if (s > M) {
                const float m_old = M;
                M = s;
                ms = expf(m_old - M);
                kvs_vec_f16_scale(m->k, acc, ms, D);
            } else {
                vs = expf(s - M);
            }
            kvs_vec_f16_mad(m->k, acc, vr, vs, D);
            S = S * ms + vs;
        }
        float *o = m->att + (size_t)t * (size_t)m->q_dim + (size_t)h * (size_t)D;
        const float inv = S > 0.0f ? 1.0f / S : 0.0f;
        for (int32_t d = 0; d < D; d++) o[d] = tab[acc[d]] * inv;
    }
}

static void add_bias(float *y, const float *bias, int32_t n_tok, int64_t n)
{
    if (!bias) return;
    for (int32_t t = 0; t < n_tok; t++)
        for (int64_t i = 0; i < n; i++) y[(size_t)t * (size_t)n + (size_t)i] += bias[i];
}

void kvs_model__attention(struct kvs_model *m, const struct kvs_batch *b, int32_t il)
{
    const struct kvs_hparams *hp = &m->hp;
    const struct block_w *w = &m->blk[il];
    const int32_t n = b->n_tokens;
    const int64_t E = hp->n_embd, D = hp->head_dim;
    const bool gated = kvs_hparams_hybrid(hp);
    const struct kvs_matrix *qkv[3] = { &w->wq, &w->wk, &w->wv };
    float *const qkv_out[3] = { gated ? m->qg : m->q, m->kv_k, m->kv_v };
    kvs_matmul_multi(m->k, kvs_model__mm_pool(m, w->wq.ne1 + 2 * m->kv_dim, E, n), 3, qkv, m->xn, n, qkv_out,
                     m->mm_scratch);
    add_bias(m->q, w->bq, n, m->q_dim);
    add_bias(m->kv_k, w->bk, n, m->kv_dim);
    add_bias(m->kv_v, w->bv, n, m->kv_dim);
    if (gated) /* per head: D query values, then D gate values */
        for (int32_t t = 0; t < n; t++)
            for (uint32_t h = 0; h < hp->n_head; h++) {
                const float *src = m->qg + ((size_t)t * hp->n_head + h) * 2 * (size_t)D;
                const size_t dst = (size_t)t * (size_t)m->q_dim + (size_t)h * (size_t)D;
                memcpy(m->q + dst, src, (size_t)D * sizeof(float));
                memcpy(m->gate + dst, src + D, (size_t)D * sizeof(float));
            }
    for (int32_t t = 0; t < n; t++) {
        const float *cs = m->rope_cs + (size_t)t * hp->n_rot;
        float *q = m->q + (size_t)t * (size_t)m->q_dim;
        float *k = m->kv_k + (size_t)t * (size_t)m->kv_dim;
        for (uint32_t h = 0; h < hp->n_head; h++) {
            float *qh = q + (size_t)h * (size_t)D;
            if (w->q_norm) kvs_model__rmsnorm(qh, qh, w->q_norm, D, hp->rms_eps);
            rope_apply(m, qh, cs);
        }
        for (uint32_t h = 0; h < hp->n_head_kv; h++) {
            float *kh = k + (size_t)h * (size_t)D;
            if (w->k_norm) kvs_model__rmsnorm(kh, kh, w->k_norm, D, hp->rms_eps);
            rope_apply(m, kh, cs);
        }
        /* Store K and V (rounded to F16) before any token attends. */
        const size_t off = (((size_t)w->kv_slot * (size_t)m->n_seq + (size_t)b->seq[t]) * (size_t)m->n_ctx +
                            (size_t)b->pos[t]) * (size_t)m->kv_dim;
        const float *v = m->kv_v + (size_t)t * (size_t)m->kv_dim;
        kvs_quantize_act(m->k, KVS_TYPE_F16, k, m->kcache + off, m->kv_dim);
        kvs_quantize_act(m->k, KVS_TYPE_F16, v, m->vcache + off, m->kv_dim);
    }
    struct att_ctx ac = { m, b, w->kv_slot };
    int64_t att_macs = 0; /* q·k and v products: (pos + 1) keys per token and head */
    for (int32_t t = 0; t < n; t++) att_macs += (int64_t)b->pos[t] + 1;
    att_macs *= (int64_t)hp->n_head * D * 2;
    if (m->n_threads > 1 && (int64_t)n * hp->n_head > 1 && att_macs >= ATT_PARALLEL_MIN_MACS)
        kvs_pool_run(m->pool, attention_worker, &ac);
    else
        attention_worker(&ac, 0, 1);
    if (gated)
        for (size_t i = 0; i < (size_t)n * (size_t)m->q_dim; i++) m->att[i] *= kvs_model__sigmoid(m->gate[i]);
    kvs_matmul(m->k, kvs_model__mm_pool(m, E, m->q_dim, n), &w->wo, m->att, n, m->tmp, m->mm_scratch);
    add_bias(m->tmp, w->bo, n, E);
    for (size_t i = 0; i < (size_t)n * (size_t)E; i++) m->x[i] += m->tmp[i];
}

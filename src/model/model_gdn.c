/* Gated DeltaNet blocks (qwen35, qwen35moe), as llama.cpp computes them by
 * default: the token-by-token recurrence for prefill and decode alike
 * (../shared/docs/qwen35-facts.md §3.2 and §4.1). Per token t of the batch,
 * in batch order (tokens of one sequence are in order; each sequence has
 * its own conv and delta state):
 *   m = attn_qkv·h, z = attn_gate·h, b = ssm_beta·h, a = ssm_alpha·h
 *   u = silu(causal depthwise conv_K(m))            (conv state: last K-1 m)
 *   q_g, k_g = L2norm(u's key heads), v_j = u's value heads
 *   beta_j = sigmoid(b_j), g_j = softplus(a_j + dt_j)·ssm_a_j
 *   delta rule on S_j with q, k of key head j mod H_k (tiled pairing)
 *   o_j = RMSNorm(o_j; ssm_norm)·silu(z_j);  y = ssm_out·o
 * The conv and the delta rule run on the pool: channels resp. value heads
 * are split over threads, each thread walking the batch's tokens in order. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_impl.h"

kvs_err kvs_model__load_gdn(struct kvs_model_loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd, d = hp->ssm_d, Hv = hp->ssm_h_v, K = hp->ssm_conv;
    const int64_t C = kvs_hparams_conv_channels(hp);
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, (int)il), n)
    if ((e = kvs_model__mat(L, NAME("attn_qkv.weight"), E, C, &b->ssm_qkv))) return e;
    if ((e = kvs_model__mat(L, NAME("attn_gate.weight"), E, Hv * d, &b->ssm_z))) return e;
    if ((e = kvs_model__mat(L, NAME("ssm_beta.weight"), E, Hv, &b->ssm_beta))) return e;
    if ((e = kvs_model__mat(L, NAME("ssm_alpha.weight"), E, Hv, &b->ssm_alpha))) return e;
    if ((e = kvs_model__mat(L, NAME("ssm_out.weight"), Hv * d, E, &b->ssm_out))) return e;
    struct kvs_matrix cw;
    if ((e = kvs_model__mat(L, NAME("ssm_conv1d.weight"), K, C, &cw))) return e;
    if (cw.type != KVS_TYPE_F32) { /* as llama.cpp's CPU op requires (qwen35-facts §2.2) */
        kvs_model__err(L, "tensor '%s' is %s; the conv kernel must be F32", n, kvs_type_name(cw.type));
        return KVS_ERR_UNSUPPORTED;
    }
    b->conv_w = cw.data;
    if ((e = kvs_model__vec(L, NAME("ssm_dt.bias"), Hv, true, &b->ssm_dt))) return e;
    if ((e = kvs_model__vec(L, NAME("ssm_a"), Hv, true, &b->ssm_a))) return e;
    if ((e = kvs_model__vec(L, NAME("ssm_norm.weight"), d, true, &b->ssm_norm))) return e;
#undef NAME
    return KVS_OK;
}

struct gdn_ctx {
    struct kvs_model *m;
    const struct kvs_batch *b;
    const struct block_w *w;
};

static size_t conv_state_floats(const struct kvs_model *m)
{
    return (size_t)(m->hp.ssm_conv - 1) * kvs_hparams_conv_channels(&m->hp);
}

static size_t delta_state_floats(const struct kvs_model *m)
{
    return (size_t)m->hp.ssm_h_v * m->hp.ssm_d * m->hp.ssm_d;
}

/* Conv + SiLU of channel range ith/nth (multiples of 16) for every token. */
static void conv_worker(void *vctx, int ith, int nth)
{
    const struct gdn_ctx *c = vctx;
    struct kvs_model *m = c->m;
    const int64_t C = kvs_hparams_conv_channels(&m->hp);
    const int K = (int)m->hp.ssm_conv;
    const int64_t per = ((C + nth - 1) / nth + 15) & ~(int64_t)15;
    const int64_t c0 = per * ith, c1 = c0 + per < C ? c0 + per : C;
    if (c0 >= c1) return;
    const float *wt = m->conv_wt + (size_t)c->w->rs_slot * (size_t)K * (size_t)C;
    for (int32_t t = 0; t < c->b->n_tokens; t++) {
        float *st = m->conv_st + ((size_t)c->w->rs_slot * (size_t)m->n_seq + (size_t)c->b->seq[t]) * conv_state_floats(m);
        kvs_ssm_conv_step(m->k, st, wt, m->g_mix + (size_t)t * (size_t)C, m->g_u + (size_t)t * (size_t)C, c0, c1, C, K);
    }
}

/* Delta rule + gated norm for value heads ith, ith + nth, ... */
static void delta_worker(void *vctx, int ith, int nth)
{
    const struct gdn_ctx *c = vctx;
    struct kvs_model *m = c->m;
    const struct kvs_hparams *hp = &m->hp;
    const int64_t d = hp->ssm_d, Hv = hp->ssm_h_v, Hk = hp->ssm_h_k, C = kvs_hparams_conv_channels(hp);
    const float scale = 1.0f / sqrtf((float)d);
    for (int64_t j = ith; j < Hv; j += nth) {
        const int64_t g = j % Hk; /* tiled pairing, qwen35-facts §3.2 step 6 */
        for (int32_t t = 0; t < c->b->n_tokens; t++) {
            const float *u = m->g_u + (size_t)t * (size_t)C;
            float *S = m->ssm_st + ((size_t)c->w->rs_slot * (size_t)m->n_seq + (size_t)c->b->seq[t]) * delta_state_floats(m) +
                       (size_t)j * (size_t)d * (size_t)d;
            float *o = m->g_o + (size_t)t * (size_t)(Hv * d) + (size_t)(j * d);
            const float decay = expf(m->g_a[(size_t)t * (size_t)Hv + (size_t)j]);
            const float beta = m->g_b[(size_t)t * (size_t)Hv + (size_t)j];
            kvs_ssm_delta_step(m->k, S, u + g * d, u + (Hk + g) * d, u + 2 * Hk * d + j * d, decay, beta, scale, o, d);
            kvs_ssm_gated_norm(m->k, o, m->g_z + (size_t)t * (size_t)(Hv * d) + (size_t)(j * d), c->w->ssm_norm, d,
                               hp->rms_eps);
        }
    }
}

/* L2 norm as ggml's: x / max(||x||, eps), the squares summed in double. */
static void l2norm(float *x, int64_t n, float eps)
{
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float nrm = sqrtf((float)sum);
    const float inv = 1.0f / (nrm > eps ? nrm : eps);
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

#define GDN_PARALLEL_MIN_MACS ((int64_t)1 << 16)

void kvs_model__gdn(struct kvs_model *m, const struct kvs_batch *b, int32_t il)
{
    const struct kvs_hparams *hp = &m->hp;
    const struct block_w *w = &m->blk[il];
    const int32_t n = b->n_tokens;
    const int64_t E = hp->n_embd, d = hp->ssm_d, Hv = hp->ssm_h_v, Hk = hp->ssm_h_k;
    const int64_t C = kvs_hparams_conv_channels(hp);
    const struct kvs_matrix *pr[4] = { &w->ssm_qkv, &w->ssm_z, &w->ssm_beta, &w->ssm_alpha };
    float *const pr_out[4] = { m->g_mix, m->g_z, m->g_b, m->g_a };
    kvs_matmul_multi(m->k, kvs_model__mm_pool(m, C + Hv * d + 2 * Hv, E, n), 4, pr, m->xn, n, pr_out, m->mm_scratch);

    struct gdn_ctx gc = { m, b, w };
    const bool par_conv = m->n_threads > 1 && (int64_t)n * C * hp->ssm_conv >= GDN_PARALLEL_MIN_MACS;
    if (par_conv)
        kvs_pool_run(m->pool, conv_worker, &gc);
    else
        conv_worker(&gc, 0, 1);

    for (int32_t t = 0; t < n; t++) {
        float *u = m->g_u + (size_t)t * (size_t)C;
        for (int64_t g = 0; g < 2 * Hk; g++) l2norm(u + g * d, d, hp->rms_eps); /* q heads, then k heads */
        float *bt = m->g_b + (size_t)t * (size_t)Hv, *at = m->g_a + (size_t)t * (size_t)Hv;
        for (int64_t j = 0; j < Hv; j++) {
            bt[j] = kvs_model__sigmoid(bt[j]);
            const float x = at[j] + w->ssm_dt[j];
            const float sp = x > 20.0f ? x : logf(1.0f + expf(x));
            at[j] = sp * w->ssm_a[j];
        }
    }

    const bool par_delta = m->n_threads > 1 && Hv > 1 && (int64_t)n * Hv * d * d * 4 >= GDN_PARALLEL_MIN_MACS;
    if (par_delta)
        kvs_pool_run(m->pool, delta_worker, &gc);
    else
        delta_worker(&gc, 0, 1);

    kvs_matmul(m->k, kvs_model__mm_pool(m, E, Hv * d, n), &w->ssm_out, m->g_o, n, m->tmp, m->mm_scratch);
    for (size_t i = 0; i < (size_t)n * (size_t)E; i++) m->x[i] += m->tmp[i];
}

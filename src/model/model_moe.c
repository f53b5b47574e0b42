/* Mixture of experts (gguf-facts §4.6; qwen35-facts §3.5): softmax router,
 * top-k, renormalized weights; tokens routed to one expert go through that
 * expert's matrices as one batch. qwen35moe adds a shared expert scaled per
 * token by sigmoid(ffn_gate_inp_shexp · h). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/model_impl.h"

kvs_err kvs_model__load_moe(struct kvs_model_loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd, X = hp->n_expert, Fe = hp->n_ff_exp;
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, (int)il), n)
    if ((e = kvs_model__mat(L, NAME("ffn_gate_inp.weight"), E, X, &b->router))) return e;
    if (b->router.type != KVS_TYPE_F32) {
        kvs_model__err(L, "tensor '%s' is %s; the router must be F32", n, kvs_type_name(b->router.type));
        return KVS_ERR_UNSUPPORTED;
    }
    if ((e = kvs_model__exps(L, NAME("ffn_gate_exps.weight"), E, Fe, X, &b->gate_x, &b->gate_x_stride))) return e;
    if ((e = kvs_model__exps(L, NAME("ffn_up_exps.weight"), E, Fe, X, &b->up_x, &b->up_x_stride))) return e;
    if ((e = kvs_model__exps(L, NAME("ffn_down_exps.weight"), Fe, E, X, &b->down_x, &b->down_x_stride))) return e;
    if (hp->arch == KVS_ARCH_QWEN35MOE) {
        const int64_t Fs = hp->n_ff_shexp;
        const float *gi;
        /* {E} in converter output ({E, 1} passes llama.cpp's check too) */
        if ((e = kvs_model__vec(L, NAME("ffn_gate_inp_shexp.weight"), E, true, &gi))) return e;
        b->gate_inp_sh = (struct kvs_matrix){ .type = KVS_TYPE_F32, .ne0 = E, .ne1 = 1,
                                              .row_bytes = (size_t)E * sizeof(float), .data = gi };
        if ((e = kvs_model__mat(L, NAME("ffn_gate_shexp.weight"), E, Fs, &b->gate_sh))) return e;
        if ((e = kvs_model__mat(L, NAME("ffn_up_shexp.weight"), E, Fs, &b->up_sh))) return e;
        if ((e = kvs_model__mat(L, NAME("ffn_down_shexp.weight"), Fs, E, &b->down_sh))) return e;
    }
#undef NAME
    return KVS_OK;
}

void kvs_model__ffn_moe(struct kvs_model *m, const struct block_w *w, int32_t n)
{
    const struct kvs_hparams *hp = &m->hp;
    const int32_t X = (int32_t)hp->n_expert, K = (int32_t)hp->n_expert_used;
    const int64_t E = hp->n_embd, Fe = hp->n_ff_exp;
    kvs_matmul(m->k, kvs_model__mm_pool(m, X, E, n), &w->router, m->xn, n, m->router, m->mm_scratch);
    for (int32_t t = 0; t < n; t++) {
        float *r = m->router + (size_t)t * (size_t)X;
        float mx = -INFINITY;
        for (int32_t e = 0; e < X; e++) mx = r[e] > mx ? r[e] : mx;
        double sum = 0.0;
        for (int32_t e = 0; e < X; e++) {
            r[e] = expf(r[e] - mx);
            sum += (double)r[e];
        }
        const float inv = (float)(1.0 / sum);
        for (int32_t e = 0; e < X; e++) r[e] *= inv;
        int32_t *sel = m->sel + (size_t)t * (size_t)K;
        float *sw = m->selw + (size_t)t * (size_t)K;
        /* Top-k by descending probability (ties: lower index first). */
        for (int32_t s = 0; s < K; s++) {
            int32_t best = -1;
            for (int32_t e = 0; e < X; e++) {
                bool taken = false;
                for (int32_t u = 0; u < s; u++) taken |= sel[u] == e;
                if (!taken && (best < 0 || r[e] > r[best])) best = e;
            }
            sel[s] = best;
            sw[s] = r[best];
        }
        float wsum = 0.0f;
        for (int32_t s = 0; s < K; s++) wsum += sw[s];
        if (hp->arch == KVS_ARCH_QWEN35MOE && wsum < 6.1035e-5f) wsum = 6.1035e-5f; /* qwen35-facts §3.5 */
        for (int32_t s = 0; s < K; s++) sw[s] /= wsum;
    }
    for (int32_t e = 0; e < X; e++) {
        int32_t cnt = 0;
        for (int32_t t = 0; t < n; t++)
            for (int32_t s = 0; s < K; s++)
                if (m->sel[(size_t)t * (size_t)K + (size_t)s] == e) {
                    m->rows[cnt] = t * K + s;
                    memcpy(m->moe_in + (size_t)cnt * (size_t)E, m->xn + (size_t)t * (size_t)E,
                           (size_t)E * sizeof(float));
                    cnt++;
                }
        if (!cnt) continue;
        struct kvs_matrix g = w->gate_x, u = w->up_x, d = w->down_x;
        g.data = (const uint8_t *)g.data + (size_t)e * w->gate_x_stride;
        u.data = (const uint8_t *)u.data + (size_t)e * w->up_x_stride;
        d.data = (const uint8_t *)d.data + (size_t)e * w->down_x_stride;
        const struct kvs_matrix *gu[2] = { &g, &u };
        float *const gu_out[2] = { m->ffa, m->ffb };
        kvs_matmul_multi(m->k, kvs_model__mm_pool(m, 2 * Fe, E, cnt), 2, gu, m->moe_in, cnt, gu_out, m->mm_scratch);
        kvs_model__swiglu(m, m->ffa, m->ffb, (size_t)cnt * (size_t)Fe);
        kvs_matmul(m->k, kvs_model__mm_pool(m, E, Fe, cnt), &d, m->ffa, cnt, m->tmp, m->mm_scratch);
        for (int32_t r = 0; r < cnt; r++) {
            const float wt = m->selw[m->rows[r]];
            float *y = m->moe_y + (size_t)m->rows[r] * (size_t)E;
            const float *src = m->tmp + (size_t)r * (size_t)E;
            for (int64_t i = 0; i < E; i++) y[i] = src[i] * wt;
        }
    }
    /* Sum the experts' outputs in selection order. */
    for (int32_t t = 0; t < n; t++) {
        float *o = m->tmp + (size_t)t * (size_t)E;
        const float *y = m->moe_y + (size_t)t * (size_t)K * (size_t)E;
        memcpy(o, y, (size_t)E * sizeof(float));
        for (int32_t s = 1; s < K; s++)
            for (int64_t i = 0; i < E; i++) o[i] += y[(size_t)s * (size_t)E + (size_t)i];
    }
    if (!w->gate_sh.data)
        return;
    /* Shared expert: tmp += sigmoid(gate_inp_sh · h) · down(silu(gate·h) ⊙ up·h).
     * moe_in holds its output (n rows of E; n <= n_batch). */
    const int64_t Fs = hp->n_ff_shexp;
    kvs_matmul(m->k, NULL, &w->gate_inp_sh, m->xn, n, m->sh_gate, m->mm_scratch);
    const struct kvs_matrix *gu[2] = { &w->gate_sh, &w->up_sh };
    float *const gu_out[2] = { m->ffa, m->ffb };
    kvs_matmul_multi(m->k, kvs_model__mm_pool(m, 2 * Fs, E, n), 2, gu, m->xn, n, gu_out, m->mm_scratch);
    kvs_model__swiglu(m, m->ffa, m->ffb, (size_t)n * (size_t)Fs);
    kvs_matmul(m->k, kvs_model__mm_pool(m, E, Fs, n), &w->down_sh, m->ffa, n, m->moe_in, m->mm_scratch);
    for (int32_t t = 0; t < n; t++) {
        const float gt = kvs_model__sigmoid(m->sh_gate[t]);
        float *o = m->tmp + (size_t)t * (size_t)E;
        const float *sh = m->moe_in + (size_t)t * (size_t)E;
        for (int64_t i = 0; i < E; i++) o[i] += gt * sh[i];
    }
}

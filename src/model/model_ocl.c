/* The OpenCL backend of a window (struct kvs_model_ops): the window's
 * weights are uploaded once in their GGUF block formats, the F16 KV cache
 * and every work buffer live on the device, and a forward call enqueues
 * every block's steps (norms, projections, RoPE, attention, FFN or MoE
 * routing and experts) on the device's queue; only the batch's inputs
 * (embedding rows or boundary, positions, RoPE angles) go up and only the
 * boundary or the logits come back. Nothing is allocated per call.
 *
 * The steps and their numerics mirror the CPU block-kind files
 * (model_attn.c, model_ffn.c, model_moe.c); the kernels are src/ocl's.
 * qwen35/qwen35moe windows run too (model_gdn.c's Gated DeltaNet with each
 * block's conv and delta state per sequence on the device, zeroed when a
 * sequence starts or is cleared; gated attention; the shared expert). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "model/model_impl.h"
#include "ocl/ocl.h"

#define OCL_TYPES "OpenCL kernels: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K"

/* Logits rows computed per round at the tail (bounds the device buffer). */
#define OCL_LOGIT_ROWS 16

struct ocl_blk {
    struct kvs_ocl_buf *attn_norm, *ffn_norm, *bq, *bk, *bv, *bo, *q_norm, *k_norm;
    struct kvs_ocl_weight wq, wk, wv, wo, gate, up, down, router, gate_x, up_x, down_x;
    /* qwen35: Gated DeltaNet (recurrent blocks) and the qwen35moe shared expert */
    struct kvs_ocl_buf *conv_wt, *ssm_dt, *ssm_a, *ssm_norm; /* conv_wt: [K][C] time-major */
    struct kvs_ocl_buf *conv_st, *ssm_st; /* F32 [n_seq][K-1][C], [n_seq][H_v][d][d] */
    struct kvs_ocl_weight ssm_qkv, ssm_z, ssm_beta, ssm_alpha, ssm_out, gate_sh, up_sh, down_sh, gate_inp_sh;
};

struct kvs_model_ocl {
    struct kvs_ocl *c;
    struct ocl_blk *blk;
    struct kvs_ocl_buf *out_norm;
    struct kvs_ocl_weight out_w;
    struct kvs_ocl_kv kv;
    struct kvs_ocl_buf *x, *xn, *q, *k, *v, *att, *tmp, *ffa, *ffb, *act, *cs, *seq, *pos, *rows, *logits;
    struct kvs_ocl_buf *router, *sel, *selw, *moe_y;
    struct kvs_ocl_buf *qg, *gate, *g_mix, *g_u, *g_z, *g_b, *g_a, *g_o, *sh_gate; /* qwen35 work buffers */
    int32_t *rows_host; /* [n_batch] */
    size_t weight_bytes, kv_bytes, work_bytes;
};

/* --- loading ---------------------------------------------------------------- */

struct up {
    struct kvs_model *m;
    struct kvs_model_ocl *o;
    char *errbuf;
    size_t errlen;
    bool count_only; /* pass 1: sum the bytes; pass 2: allocate and upload */
};

static kvs_err buf_new(struct up *u, size_t bytes, struct kvs_ocl_buf **out, size_t *tally)
{
    *tally += bytes;
    if (u->count_only) return KVS_OK;
    return kvs_ocl_alloc(u->o->c, bytes, out, u->errbuf, u->errlen);
}

static kvs_err vec_up(struct up *u, const float *v, int64_t n, struct kvs_ocl_buf **out)
{
    if (!v) return KVS_OK;
    const size_t bytes = (size_t)n * sizeof(float);
    kvs_err e = buf_new(u, bytes, out, &u->o->weight_bytes);
    if (e || u->count_only) return e;
    return kvs_ocl_write(u->o->c, *out, 0, v, bytes);
}

/* W (n_exp experts stride bytes apart, 1 for a 2-D weight) onto the device. */
static kvs_err mat_up(struct up *u, const struct kvs_matrix *W, size_t stride, int64_t n_exp, const char *what,
                      int32_t il, struct kvs_ocl_weight *out)
{
    if (!W->data) return KVS_OK;
    if (!kvs_ocl_type_supported(W->type)) {
        if (il >= 0)
            snprintf(u->errbuf, u->errlen, "tensor blk.%d.%s has type %s, which has no OpenCL kernel (" OCL_TYPES
                     "); use --backend cpu", (int)il, what, kvs_type_name(W->type));
        else
            snprintf(u->errbuf, u->errlen, "tensor %s has type %s, which has no OpenCL kernel (" OCL_TYPES
                     "); use --backend cpu", what, kvs_type_name(W->type));
        return KVS_ERR_UNSUPPORTED;
    }
    const size_t bytes = n_exp > 1 ? stride * (size_t)n_exp : W->row_bytes * (size_t)W->ne1;
    *out = (struct kvs_ocl_weight){ .type = W->type, .K = W->ne0, .N = W->ne1, .row_bytes = W->row_bytes,
                                    .expert_stride = n_exp > 1 ? stride : 0 };
    kvs_err e = buf_new(u, bytes, &out->buf, &u->o->weight_bytes);
    if (e || u->count_only) return e;
    return kvs_ocl_write(u->o->c, out->buf, 0, W->data, bytes);
}

static size_t act_need(const struct kvs_ocl_weight *W, int64_t rows)
{
    return W->N ? kvs_ocl_act_row_bytes(W->type, W->K) * (size_t)rows : 0;
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

static kvs_err upload(struct up *u)
{
    struct kvs_model *m = u->m;
    struct kvs_model_ocl *o = u->o;
    const struct kvs_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd, NB = m->n_batch, X = hp->n_expert, KX = hp->n_expert_used;
    kvs_err e;
    o->weight_bytes = o->kv_bytes = o->work_bytes = 0;
    size_t act = 0;
    for (int32_t i = 0; i < m->n_blk; i++) {
        const struct block_w *w = &m->blk[i];
        struct ocl_blk *d = &o->blk[i];
        const int32_t il = m->begin + i;
        if ((e = vec_up(u, w->attn_norm, E, &d->attn_norm)) || (e = vec_up(u, w->ffn_norm, E, &d->ffn_norm)) ||
            (e = vec_up(u, w->bq, m->q_dim, &d->bq)) || (e = vec_up(u, w->bk, m->kv_dim, &d->bk)) ||
            (e = vec_up(u, w->bv, m->kv_dim, &d->bv)) || (e = vec_up(u, w->bo, E, &d->bo)) ||
            (e = vec_up(u, w->q_norm, hp->head_dim, &d->q_norm)) ||
            (e = vec_up(u, w->k_norm, hp->head_dim, &d->k_norm)))
            return e;
        if ((e = mat_up(u, &w->wq, 0, 1, "attn_q.weight", il, &d->wq)) ||
            (e = mat_up(u, &w->wk, 0, 1, "attn_k.weight", il, &d->wk)) ||
            (e = mat_up(u, &w->wv, 0, 1, "attn_v.weight", il, &d->wv)) ||
            (e = mat_up(u, &w->wo, 0, 1, "attn_output.weight", il, &d->wo)) ||
            (e = mat_up(u, &w->gate, 0, 1, "ffn_gate.weight", il, &d->gate)) ||
            (e = mat_up(u, &w->up, 0, 1, "ffn_up.weight", il, &d->up)) ||
            (e = mat_up(u, &w->down, 0, 1, "ffn_down.weight", il, &d->down)) ||
            (e = mat_up(u, &w->router, 0, 1, "ffn_gate_inp.weight", il, &d->router)) ||
            (e = mat_up(u, &w->gate_x, w->gate_x_stride, X, "ffn_gate_exps.weight", il, &d->gate_x)) ||
            (e = mat_up(u, &w->up_x, w->up_x_stride, X, "ffn_up_exps.weight", il, &d->up_x)) ||
            (e = mat_up(u, &w->down_x, w->down_x_stride, X, "ffn_down_exps.weight", il, &d->down_x)))
            return e;
        if (w->recurrent) {
            const int64_t C = kvs_hparams_conv_channels(hp), K = hp->ssm_conv, Hv = hp->ssm_h_v, dd = hp->ssm_d;
            const size_t cst = (size_t)m->n_seq * (size_t)(K - 1) * (size_t)C * sizeof(float);
            const size_t sst = (size_t)m->n_seq * (size_t)Hv * (size_t)dd * (size_t)dd * sizeof(float);
            if ((e = vec_up(u, m->conv_wt + (size_t)w->rs_slot * (size_t)K * (size_t)C, K * C, &d->conv_wt)) ||
                (e = vec_up(u, w->ssm_dt, Hv, &d->ssm_dt)) || (e = vec_up(u, w->ssm_a, Hv, &d->ssm_a)) ||
                (e = vec_up(u, w->ssm_norm, dd, &d->ssm_norm)) ||
                (e = buf_new(u, cst, &d->conv_st, &o->kv_bytes)) || (e = buf_new(u, sst, &d->ssm_st, &o->kv_bytes)))
                return e;
            if ((e = mat_up(u, &w->ssm_qkv, 0, 1, "attn_qkv.weight", il, &d->ssm_qkv)) ||
                (e = mat_up(u, &w->ssm_z, 0, 1, "attn_gate.weight", il, &d->ssm_z)) ||
                (e = mat_up(u, &w->ssm_beta, 0, 1, "ssm_beta.weight", il, &d->ssm_beta)) ||
                (e = mat_up(u, &w->ssm_alpha, 0, 1, "ssm_alpha.weight", il, &d->ssm_alpha)) ||
                (e = mat_up(u, &w->ssm_out, 0, 1, "ssm_out.weight", il, &d->ssm_out)))
                return e;
        }
        if ((e = mat_up(u, &w->gate_sh, 0, 1, "ffn_gate_shexp.weight", il, &d->gate_sh)) ||
            (e = mat_up(u, &w->up_sh, 0, 1, "ffn_up_shexp.weight", il, &d->up_sh)) ||
            (e = mat_up(u, &w->down_sh, 0, 1, "ffn_down_shexp.weight", il, &d->down_sh)) ||
            (e = mat_up(u, &w->gate_inp_sh, 0, 1, "ffn_gate_inp_shexp.weight", il, &d->gate_inp_sh)))
            return e;
        const struct kvs_ocl_weight *dense[] = { &d->wq,      &d->wk,        &d->wv,        &d->wo,       &d->gate,
                                                 &d->up,      &d->down,      &d->router,    &d->gate_x,   &d->up_x,
                                                 &d->ssm_qkv, &d->ssm_z,     &d->ssm_beta,  &d->ssm_alpha,
                                                 &d->ssm_out, &d->gate_sh,   &d->up_sh,     &d->down_sh,
                                                 &d->gate_inp_sh };
        for (size_t j = 0; j < sizeof dense / sizeof dense[0]; j++) act = max_sz(act, act_need(dense[j], NB));
        act = max_sz(act, act_need(&d->down_x, NB * (KX ? KX : 1)));
    }
    if (kvs_model_has_head(m)) {
        if ((e = vec_up(u, m->out_norm, E, &o->out_norm))) return e;
        if ((e = mat_up(u, &m->out_w, 0, 1, hp->tied_output ? "token_embd.weight (tied output)" : "output.weight",
                        -1, &o->out_w)))
            return e;
        act = max_sz(act, act_need(&o->out_w, OCL_LOGIT_ROWS));
    }
    /* KV cache: F16 [n_kv_blk][n_seq][n_ctx][kv_dim]. */
    const size_t kv = (size_t)m->n_kv_blk * (size_t)m->n_seq * (size_t)m->n_ctx * (size_t)m->kv_dim * 2;
    o->kv = (struct kvs_ocl_kv){ .n_seq = m->n_seq, .n_ctx = m->n_ctx, .kv_dim = m->kv_dim };
    if ((e = buf_new(u, kv ? kv : 16, &o->kv.k, &o->kv_bytes)) || (e = buf_new(u, kv ? kv : 16, &o->kv.v, &o->kv_bytes)))
        return e;
    const size_t F4 = sizeof(float), nb = (size_t)NB;
    const bool hyb = kvs_hparams_hybrid(hp);
    const size_t C = kvs_hparams_conv_channels(hp), VD = (size_t)hp->ssm_h_v * hp->ssm_d;
    const size_t ff = max_sz((size_t)m->ff_max * nb, (size_t)hp->n_ff_exp * nb * (size_t)(KX ? KX : 1)) * F4;
    struct {
        struct kvs_ocl_buf **b;
        size_t bytes;
    } work[] = {
        { &o->x, nb * (size_t)E * F4 },
        { &o->xn, max_sz(nb, OCL_LOGIT_ROWS) * (size_t)E * F4 },
        { &o->q, nb * (size_t)m->q_dim * F4 },
        { &o->k, nb * (size_t)m->kv_dim * F4 },
        { &o->v, nb * (size_t)m->kv_dim * F4 },
        { &o->att, nb * (size_t)m->q_dim * F4 },
        { &o->tmp, nb * (size_t)E * F4 },
        { &o->ffa, ff },
        { &o->ffb, ff },
        { &o->act, act ? act : 16 },
        { &o->cs, nb * hp->n_rot * F4 },
        { &o->seq, nb * 4 },
        { &o->pos, nb * 4 },
        { &o->rows, OCL_LOGIT_ROWS * 4 },
        { &o->logits, kvs_model_has_head(m) ? (size_t)OCL_LOGIT_ROWS * hp->n_vocab * F4 : 16 },
        { &o->router, X ? nb * (size_t)X * F4 : 16 },
        { &o->sel, X ? nb * (size_t)KX * 4 : 16 },
        { &o->selw, X ? nb * (size_t)KX * F4 : 16 },
        { &o->moe_y, X ? nb * (size_t)(KX > 1 ? KX : 1) * (size_t)E * F4 : 16 },
        { &o->qg, hyb ? nb * 2 * (size_t)m->q_dim * F4 : 16 },
        { &o->gate, hyb ? nb * (size_t)m->q_dim * F4 : 16 },
        { &o->g_mix, hyb ? nb * (size_t)C * F4 : 16 },
        { &o->g_u, hyb ? nb * (size_t)C * F4 : 16 },
        { &o->g_z, hyb ? nb * (size_t)VD * F4 : 16 },
        { &o->g_o, hyb ? nb * (size_t)VD * F4 : 16 },
        { &o->g_b, hyb ? nb * (size_t)hp->ssm_h_v * F4 : 16 },
        { &o->g_a, hyb ? nb * (size_t)hp->ssm_h_v * F4 : 16 },
        { &o->sh_gate, nb * F4 },
    };
    for (size_t j = 0; j < sizeof work / sizeof work[0]; j++)
        if ((e = buf_new(u, work[j].bytes, work[j].b, &o->work_bytes))) return e;
    return KVS_OK;
}

/* Zeroes the GDN states of sequence seq (every sequence if seq < 0). */
static kvs_err zero_states(struct kvs_model *m, int32_t seq)
{
    struct kvs_model_ocl *o = m->ocl;
    kvs_err e = KVS_OK;
    for (int32_t i = 0; i < m->n_blk && !e; i++) {
        struct ocl_blk *d = &o->blk[i];
        if (!d->conv_st) continue;
        const size_t cb = kvs_ocl_buf_bytes(d->conv_st) / (size_t)m->n_seq;
        const size_t sb = kvs_ocl_buf_bytes(d->ssm_st) / (size_t)m->n_seq;
        if (seq < 0) {
            if (!(e = kvs_ocl_zero(o->c, d->conv_st, 0, cb * (size_t)m->n_seq)))
                e = kvs_ocl_zero(o->c, d->ssm_st, 0, sb * (size_t)m->n_seq);
        } else if (!(e = kvs_ocl_zero(o->c, d->conv_st, cb * (size_t)seq, cb))) {
            e = kvs_ocl_zero(o->c, d->ssm_st, sb * (size_t)seq, sb);
        }
    }
    return e;
}

void kvs_model__ocl_seq_clear(struct kvs_model *m, int32_t seq)
{
    if (!m->ocl || !m->ocl->c) return;
    if (zero_states(m, seq)) KVS_LOGE("model: OpenCL: zeroing sequence %d's state failed: %s", (int)seq,
                                      kvs_ocl_last_error(m->ocl->c));
}

kvs_err kvs_model__ocl_load(struct kvs_model *m, int32_t device, char *errbuf, size_t errlen)
{
    struct kvs_model_ocl *o = calloc(1, sizeof *o);
    if (!o) return KVS_ERR_NOMEM;
    m->ocl = o;
    o->blk = calloc((size_t)m->n_blk, sizeof *o->blk);
    o->rows_host = calloc((size_t)m->n_batch, sizeof *o->rows_host);
    if (!o->blk || !o->rows_host) return KVS_ERR_NOMEM;
    struct up u = { m, o, errbuf, errlen, true };
    kvs_err e = upload(&u); /* type checks and the byte count, before any device is touched */
    if (e) return e;
    char derr[4096];
    if ((e = kvs_ocl_open(device, &o->c, derr, sizeof derr))) {
        snprintf(errbuf, errlen, "--backend opencl: %s", derr);
        return e;
    }
    const struct kvs_ocl_device_info *di = kvs_ocl_info(o->c);
    const size_t total = o->weight_bytes + o->kv_bytes + o->work_bytes;
    if (total > di->global_mem) {
        snprintf(errbuf, errlen,
                 "OpenCL device %d (%s) has %.1f MiB of memory; this window needs %.1f MiB (weights %.1f, KV cache "
                 "%.1f, work buffers %.1f): choose a smaller window, --ctx or --batch",
                 (int)device, di->name, (double)di->global_mem / 1048576.0, (double)total / 1048576.0,
                 (double)o->weight_bytes / 1048576.0, (double)o->kv_bytes / 1048576.0,
                 (double)o->work_bytes / 1048576.0);
        return KVS_ERR_NOMEM;
    }
    u.count_only = false;
    if ((e = upload(&u))) return e;
    if ((e = kvs_ocl_zero(o->c, o->kv.k, 0, kvs_ocl_buf_bytes(o->kv.k))) ||
        (e = kvs_ocl_zero(o->c, o->kv.v, 0, kvs_ocl_buf_bytes(o->kv.v))) || (e = zero_states(m, -1)) ||
        (e = kvs_ocl_finish(o->c))) {
        snprintf(errbuf, errlen, "OpenCL device %d (%s): uploading the window failed: %s", (int)device, di->name,
                 kvs_ocl_last_error(o->c));
        return e == KVS_ERR_INTERNAL ? KVS_ERR_NOMEM : e;
    }
    m->ops = &kvs_model__ocl_ops;
    KVS_LOGI("model: OpenCL device %d (%s, %s): %.1f MiB of weights, %.1f MiB KV cache, %.1f MiB work buffers",
             (int)device, di->name, di->platform, (double)o->weight_bytes / 1048576.0,
             (double)o->kv_bytes / 1048576.0, (double)o->work_bytes / 1048576.0);
    return KVS_OK;
}

static void weight_free(struct kvs_ocl_weight *w) { kvs_ocl_free(w->buf); }

void kvs_model__ocl_free(struct kvs_model *m)
{
    struct kvs_model_ocl *o = m->ocl;
    if (!o) return;
    if (o->c) kvs_ocl_finish(o->c);
    for (int32_t i = 0; o->blk && i < m->n_blk; i++) {
        struct ocl_blk *d = &o->blk[i];
        struct kvs_ocl_buf *v[] = { d->attn_norm, d->ffn_norm, d->bq,       d->bk,      d->bv,      d->bo,
                                    d->q_norm,    d->k_norm,   d->conv_wt,  d->ssm_dt,  d->ssm_a,   d->ssm_norm,
                                    d->conv_st,   d->ssm_st };
        for (size_t j = 0; j < sizeof v / sizeof v[0]; j++) kvs_ocl_free(v[j]);
        struct kvs_ocl_weight *w[] = { &d->wq,       &d->wk,       &d->wv,       &d->wo,       &d->gate,
                                       &d->up,       &d->down,     &d->router,   &d->gate_x,   &d->up_x,
                                       &d->down_x,   &d->ssm_qkv,  &d->ssm_z,    &d->ssm_beta, &d->ssm_alpha,
                                       &d->ssm_out,  &d->gate_sh,  &d->up_sh,    &d->down_sh,  &d->gate_inp_sh };
        for (size_t j = 0; j < sizeof w / sizeof w[0]; j++) weight_free(w[j]);
    }
    kvs_ocl_free(o->out_norm);
    weight_free(&o->out_w);
    struct kvs_ocl_buf *b[] = { o->kv.k, o->kv.v, o->x,   o->xn,  o->q,    o->k,      o->v,      o->att,
                                o->tmp,  o->ffa,  o->ffb, o->act, o->cs,   o->seq,    o->pos,    o->rows,
                                o->logits, o->router, o->sel, o->selw, o->moe_y, o->qg, o->gate, o->g_mix,
                                o->g_u,  o->g_z,  o->g_b, o->g_a, o->g_o, o->sh_gate };
    for (size_t j = 0; j < sizeof b / sizeof b[0]; j++) kvs_ocl_free(b[j]);
    kvs_ocl_close(o->c);
    free(o->blk);
    free(o->rows_host);
    free(o);
    m->ocl = NULL;
}

/* --- the block operations ------------------------------------------------------ */

static kvs_err ocl_input(struct kvs_model *m, const struct kvs_batch *b)
{
    struct kvs_model_ocl *o = m->ocl;
    const int32_t n = b->n_tokens;
    const int64_t E = m->hp.n_embd;
    const float *x = b->embd;
    if (kvs_model_has_embd(m)) { /* a lookup: rows dequantized on the host, then uploaded */
        const struct kvs_gguf_tensor *te = m->tok_embd;
        const size_t rb = kvs_type_row_bytes(te->type, E);
        for (int32_t t = 0; t < n; t++)
            kvs_dequantize_row(m->k, te->type, (const uint8_t *)te->data + (size_t)b->token[t] * rb,
                               m->x + (size_t)t * (size_t)E, E);
        x = m->x;
    }
    for (int32_t t = 0; t < n; t++) kvs_model__rope_table(m, b->pos[t], m->rope_cs + (size_t)t * m->hp.n_rot);
    kvs_err e;
    if ((e = kvs_ocl_write(o->c, o->x, 0, x, (size_t)n * (size_t)E * sizeof(float))) ||
        (e = kvs_ocl_write(o->c, o->cs, 0, m->rope_cs, (size_t)n * m->hp.n_rot * sizeof(float))) ||
        (e = kvs_ocl_write(o->c, o->seq, 0, b->seq, (size_t)n * sizeof(int32_t))) ||
        (e = kvs_ocl_write(o->c, o->pos, 0, b->pos, (size_t)n * sizeof(int32_t)))) {
        KVS_LOGE("model: %s", kvs_ocl_last_error(o->c));
        kvs_ocl_finish(o->c);
        return KVS_ERR_INTERNAL;
    }
    return KVS_OK;
}

static void ocl_norm(struct kvs_model *m, int32_t il, bool ffn, int32_t n)
{
    struct kvs_model_ocl *o = m->ocl;
    const struct ocl_blk *d = &o->blk[il];
    kvs_ocl_rmsnorm(o->c, o->x, ffn ? d->ffn_norm : d->attn_norm, o->xn, n, m->hp.n_embd, m->hp.rms_eps, NULL);
}

static void ocl_attention(struct kvs_model *m, const struct kvs_batch *b, int32_t il)
{
    struct kvs_model_ocl *o = m->ocl;
    const struct kvs_hparams *hp = &m->hp;
    const struct ocl_blk *d = &o->blk[il];
    const int32_t n = b->n_tokens;
    const int64_t D = hp->head_dim;
    const bool gated = kvs_hparams_hybrid(hp);
    kvs_ocl_matmul(o->c, &d->wq, o->xn, n, gated ? o->qg : o->q, o->act);
    if (gated) kvs_ocl_split_qg(o->c, o->qg, o->q, o->gate, n, hp->n_head, D);
    kvs_ocl_matmul(o->c, &d->wk, o->xn, n, o->k, o->act);
    kvs_ocl_matmul(o->c, &d->wv, o->xn, n, o->v, o->act);
    if (d->bq) kvs_ocl_add_bias(o->c, o->q, d->bq, n, m->q_dim);
    if (d->bk) kvs_ocl_add_bias(o->c, o->k, d->bk, n, m->kv_dim);
    if (d->bv) kvs_ocl_add_bias(o->c, o->v, d->bv, n, m->kv_dim);
    if (d->q_norm) kvs_ocl_rmsnorm(o->c, o->q, d->q_norm, o->q, (int64_t)n * hp->n_head, D, hp->rms_eps, NULL);
    if (d->k_norm) kvs_ocl_rmsnorm(o->c, o->k, d->k_norm, o->k, (int64_t)n * hp->n_head_kv, D, hp->rms_eps, NULL);
    kvs_ocl_rope(o->c, o->q, o->cs, n, hp->n_head, D, hp->n_rot, hp->rope_neox);
    kvs_ocl_rope(o->c, o->k, o->cs, n, hp->n_head_kv, D, hp->n_rot, hp->rope_neox);
    const int32_t slot = m->blk[il].kv_slot;
    kvs_ocl_kv_store(o->c, &o->kv, slot, o->k, o->v, o->seq, o->pos, n);
    kvs_ocl_attention(o->c, &o->kv, slot, o->q, o->att, o->seq, o->pos, n, hp->n_head, hp->n_head_kv, D);
    if (gated) kvs_ocl_gate_mul(o->c, o->att, o->gate, false, (int64_t)n * m->q_dim);
    kvs_ocl_matmul(o->c, &d->wo, o->att, n, o->tmp, o->act);
    if (d->bo) kvs_ocl_add_bias(o->c, o->tmp, d->bo, n, hp->n_embd);
    kvs_ocl_add(o->c, o->x, o->tmp, (int64_t)n * hp->n_embd);
}

/* model_gdn.c's steps on the device: the four projections, conv + SiLU,
 * L2 norm of the q and k heads, the gates, the delta rule per state row,
 * the gated RMSNorm (RMSNorm by ssm_norm, times silu(z)), ssm_out. */
static void ocl_gdn(struct kvs_model *m, const struct kvs_batch *b, int32_t il)
{
    struct kvs_model_ocl *o = m->ocl;
    const struct kvs_hparams *hp = &m->hp;
    const struct ocl_blk *d = &o->blk[il];
    const int32_t n = b->n_tokens;
    const int64_t dd = hp->ssm_d, Hv = hp->ssm_h_v, Hk = hp->ssm_h_k, C = kvs_hparams_conv_channels(hp);
    kvs_ocl_matmul(o->c, &d->ssm_qkv, o->xn, n, o->g_mix, o->act);
    kvs_ocl_matmul(o->c, &d->ssm_z, o->xn, n, o->g_z, o->act);
    kvs_ocl_matmul(o->c, &d->ssm_beta, o->xn, n, o->g_b, o->act);
    kvs_ocl_matmul(o->c, &d->ssm_alpha, o->xn, n, o->g_a, o->act);
    kvs_ocl_gdn_conv(o->c, d->conv_st, d->conv_wt, o->g_mix, o->g_u, o->seq, n, C, hp->ssm_conv);
    kvs_ocl_l2norm(o->c, o->g_u, n, 2 * Hk, dd, C, hp->rms_eps);
    kvs_ocl_gdn_gates(o->c, o->g_b, o->g_a, d->ssm_dt, d->ssm_a, n, Hv);
    kvs_ocl_gdn_delta(o->c, d->ssm_st, o->g_u, o->g_a, o->g_b, o->g_o, o->seq, n, dd, Hk, Hv,
                      1.0f / sqrtf((float)dd));
    kvs_ocl_rmsnorm(o->c, o->g_o, d->ssm_norm, o->g_o, (int64_t)n * Hv, dd, hp->rms_eps, NULL);
    kvs_ocl_gate_mul(o->c, o->g_o, o->g_z, true, (int64_t)n * Hv * dd);
    kvs_ocl_matmul(o->c, &d->ssm_out, o->g_o, n, o->tmp, o->act);
    kvs_ocl_add(o->c, o->x, o->tmp, (int64_t)n * hp->n_embd);
}

static void ocl_ffn(struct kvs_model *m, int32_t il, int32_t n)
{
    struct kvs_model_ocl *o = m->ocl;
    const struct kvs_hparams *hp = &m->hp;
    const struct ocl_blk *d = &o->blk[il];
    const int64_t E = hp->n_embd;
    if (!hp->n_expert) {
        kvs_ocl_matmul(o->c, &d->gate, o->xn, n, o->ffa, o->act);
        kvs_ocl_matmul(o->c, &d->up, o->xn, n, o->ffb, o->act);
        kvs_ocl_swiglu(o->c, o->ffa, o->ffb, (int64_t)n * hp->n_ff);
        kvs_ocl_matmul(o->c, &d->down, o->ffa, n, o->tmp, o->act);
    } else {
        /* rows r = t·K + s: expert sel[r] on token t (model_moe.c's routing) */
        const int64_t K = hp->n_expert_used, R = (int64_t)n * K;
        kvs_ocl_matmul(o->c, &d->router, o->xn, n, o->router, o->act);
        kvs_ocl_moe_route(o->c, o->router, o->sel, o->selw, n, hp->n_expert, K, hp->arch == KVS_ARCH_QWEN35MOE);
        kvs_ocl_matmul_id(o->c, &d->gate_x, o->sel, o->xn, K, R, o->ffa, o->act);
        kvs_ocl_matmul_id(o->c, &d->up_x, o->sel, o->xn, K, R, o->ffb, o->act);
        kvs_ocl_swiglu(o->c, o->ffa, o->ffb, R * hp->n_ff_exp);
        kvs_ocl_matmul_id(o->c, &d->down_x, o->sel, o->ffa, 1, R, o->moe_y, o->act);
        kvs_ocl_moe_sum(o->c, o->moe_y, o->selw, o->tmp, n, K, E);
        if (d->gate_sh.buf) { /* qwen35moe shared expert, sigmoid-gated (model_moe.c) */
            kvs_ocl_matmul(o->c, &d->gate_inp_sh, o->xn, n, o->sh_gate, o->act);
            kvs_ocl_matmul(o->c, &d->gate_sh, o->xn, n, o->ffa, o->act);
            kvs_ocl_matmul(o->c, &d->up_sh, o->xn, n, o->ffb, o->act);
            kvs_ocl_swiglu(o->c, o->ffa, o->ffb, (int64_t)n * hp->n_ff_shexp);
            kvs_ocl_matmul(o->c, &d->down_sh, o->ffa, n, o->moe_y, o->act);
            kvs_ocl_add_gated(o->c, o->tmp, o->moe_y, o->sh_gate, n, E);
        }
    }
    kvs_ocl_add(o->c, o->x, o->tmp, (int64_t)n * E);
}

static kvs_err ocl_output(struct kvs_model *m, const struct kvs_batch *b, float *out)
{
    struct kvs_model_ocl *o = m->ocl;
    const int32_t n = b->n_tokens;
    const int64_t E = m->hp.n_embd, V = m->hp.n_vocab;
    kvs_err e = KVS_OK;
    size_t n_vals;
    if (!kvs_model_has_head(m)) {
        n_vals = (size_t)n * (size_t)E;
        e = kvs_ocl_read(o->c, o->x, 0, out, n_vals * sizeof(float));
    } else {
        int32_t n_out = 0;
        for (int32_t t = 0; t < n; t++)
            if (b->logits ? b->logits[t] != 0 : t == n - 1) o->rows_host[n_out++] = t;
        n_vals = (size_t)n_out * (size_t)V;
        for (int32_t r0 = 0; r0 < n_out && !e; r0 += OCL_LOGIT_ROWS) {
            const int32_t nr = n_out - r0 < OCL_LOGIT_ROWS ? n_out - r0 : OCL_LOGIT_ROWS;
            if ((e = kvs_ocl_write(o->c, o->rows, 0, o->rows_host + r0, (size_t)nr * sizeof(int32_t)))) break;
            kvs_ocl_rmsnorm(o->c, o->x, o->out_norm, o->xn, nr, E, m->hp.rms_eps, o->rows);
            kvs_ocl_matmul(o->c, &o->out_w, o->xn, nr, o->logits, o->act);
            e = kvs_ocl_read(o->c, o->logits, 0, out + (size_t)r0 * (size_t)V, (size_t)nr * (size_t)V * sizeof(float));
        }
    }
    if (e || (e = kvs_ocl_finish(o->c))) {
        KVS_LOGE("model: OpenCL forward failed: %s", kvs_ocl_last_error(o->c));
        kvs_ocl_finish(o->c);
        return KVS_ERR_INTERNAL;
    }
    /* corrupt weights or a broken boundary must not become token 0 */
    return kvs_vec_all_finite(out, n_vals) ? KVS_OK : KVS_ERR_NUMERIC;
}

const struct kvs_model_ops kvs_model__ocl_ops = {
    .name = "opencl",
    .input = ocl_input,
    .norm = ocl_norm,
    .attention = ocl_attention,
    .gdn = ocl_gdn,
    .ffn = ocl_ffn,
    .output = ocl_output,
};

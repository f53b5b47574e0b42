/* Dense SwiGLU FFN (gguf-facts §4.5; qwen35-facts §3.4):
 * down(silu(gate·h) ⊙ up·h). */
#include <stdio.h>

#include "model/model_impl.h"

kvs_err kvs_model__load_ffn(struct kvs_model_loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd, F = hp->n_ff;
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, (int)il), n)
    if ((e = kvs_model__mat(L, NAME("ffn_gate.weight"), E, F, &b->gate))) return e;
    if ((e = kvs_model__mat(L, NAME("ffn_up.weight"), E, F, &b->up))) return e;
    if ((e = kvs_model__mat(L, NAME("ffn_down.weight"), F, E, &b->down))) return e;
#undef NAME
    return KVS_OK;
}

/* SwiGLU on rows: a = silu(a) * b, split over the pool in 64-byte aligned
 * ranges (expf per element is worth the round trip at prefill sizes). */
struct swiglu_ctx {
    float *a;
    const float *b;
    size_t n;
};

static void swiglu_worker(void *vctx, int ith, int nth)
{
    const struct swiglu_ctx *c = vctx;
    size_t per = ((c->n + (size_t)nth - 1) / (size_t)nth + 15) & ~(size_t)15;
    size_t i0 = (size_t)ith * per, i1 = i0 + per < c->n ? i0 + per : c->n;
    for (size_t i = i0; i < i1; i++) c->a[i] = kvs_model__silu(c->a[i]) * c->b[i];
}

void kvs_model__swiglu(struct kvs_model *m, float *a, const float *bb, size_t n)
{
    struct swiglu_ctx c = { a, bb, n };
    if (m->n_threads > 1 && n >= 8192)
        kvs_pool_run(m->pool, swiglu_worker, &c);
    else
        swiglu_worker(&c, 0, 1);
}

void kvs_model__ffn_dense(struct kvs_model *m, const struct block_w *w, int32_t n)
{
    const int64_t F = m->hp.n_ff;
    const struct kvs_matrix *gu[2] = { &w->gate, &w->up };
    float *const gu_out[2] = { m->ffa, m->ffb };
    kvs_matmul_multi(m->k, kvs_model__mm_pool(m, 2 * F, m->hp.n_embd, n), 2, gu, m->xn, n, gu_out, m->mm_scratch);
    kvs_model__swiglu(m, m->ffa, m->ffb, (size_t)n * (size_t)F);
    kvs_matmul(m->k, kvs_model__mm_pool(m, m->hp.n_embd, F, n), &w->down, m->ffa, n, m->tmp, m->mm_scratch);
}

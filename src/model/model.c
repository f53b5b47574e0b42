/* A window of transformer blocks: weights (views into the GGUF mapping), the
 * F16 KV cache and the forward pass of ../shared/docs/gguf-facts.md §4. */
#include "model/model.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/kernels.h"

#define MODEL_MAX_THREADS 512
#define MODEL_MAX_SEQ 65536
#define MODEL_MAX_BATCH 65536

/* Weights of one block. Pointers borrow the GGUF mapping. */
struct block_w {
    const float *attn_norm;              /* [E] */
    struct kvs_matrix wq, wk, wv, wo;    /* {E, H·D}, {E, Hkv·D}, {E, Hkv·D}, {H·D, E} */
    const float *bq, *bk, *bv, *bo;      /* [H·D], [Hkv·D], [Hkv·D], [E]; NULL if absent */
    const float *q_norm, *k_norm;        /* [D] (qwen3, qwen3moe), else NULL */
    const float *ffn_norm;               /* [E] */
    struct kvs_matrix gate, up, down;    /* dense: {E, F}, {E, F}, {F, E} */
    struct kvs_matrix router;            /* MoE: {E, X} F32 */
    struct kvs_matrix gate_x, up_x, down_x; /* MoE: expert 0's slice {E, Fe}, {E, Fe}, {Fe, E} */
    size_t gate_x_stride, up_x_stride, down_x_stride; /* bytes between experts' slices */
};

struct kvs_model {
    struct kvs_hparams hp;
    int32_t begin, end, n_blk;
    int32_t n_ctx, n_seq, n_batch, n_threads;
    int32_t q_dim, kv_dim; /* H·D, Hkv·D */
    int32_t ff_max;        /* max(n_ff, n_ff_exp) */
    const struct kvs_kernels *k;
    struct kvs_pool *pool;

    const struct kvs_gguf_tensor *tok_embd; /* {E, V} or NULL */
    const float *out_norm;                  /* [E] or NULL */
    struct kvs_matrix out_w;                /* {E, V} (output or tied embedding) */
    const float *rope_freqs;                /* [n_rot/2] or NULL */
    struct block_w *blk;                    /* [n_blk] */

    uint16_t *kcache, *vcache; /* [n_blk][n_seq][n_ctx][kv_dim] F16 */
    int32_t *n_past;           /* [n_seq] cached positions per sequence */
    int32_t *expect;           /* [n_seq] work: next position while validating */
    float *f16tab;             /* [65536] F16 -> F32 */

    /* Work buffers, [n_batch][...] each. */
    float *x;        /* [n_batch][E] residual stream */
    float *xn;       /* [n_batch][E] normed input */
    float *q;        /* [n_batch][H·D] */
    float *kv_k;     /* [n_batch][Hkv·D] */
    float *kv_v;     /* [n_batch][Hkv·D] */
    float *att;      /* [n_batch][H·D] attention output */
    float *tmp;      /* [n_batch][E] */
    float *ffa;      /* [n_batch][ff_max] */
    float *ffb;      /* [n_batch][ff_max] */
    float *rope_cs;  /* [n_batch][n_rot] (cos, sin) pairs */
    uint16_t *att_ws16; /* [n_threads][2·D] F16 q and V accumulator */
    void *mm_scratch;
    void *packw;        /* anonymous mapping: the window's matrices in the kernels' packed layout */
    size_t packw_bytes;
    /* MoE */
    float *router;     /* [n_batch][X] */
    int32_t *sel;      /* [n_batch][k] chosen experts */
    float *selw;       /* [n_batch][k] their weights */
    int32_t *rows;     /* [n_batch·k] (token·k + slot) of the gathered rows */
    float *moe_in;     /* [n_batch][E] gathered rows */
    float *moe_y;      /* [n_batch][k][E] weighted expert outputs */
};

static void set_err(char *errbuf, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *errbuf, size_t errlen, const char *fmt, ...)
{
    if (!errbuf || !errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, errlen, fmt, ap);
    va_end(ap);
}

struct kvs_model_params kvs_model_default_params(void)
{
    struct kvs_model_params p = {
        .block_begin = 0, .block_end = -1, .n_ctx = 0, .n_seq = 1, .n_batch = 512, .n_threads = 2,
    };
    return p;
}

/* --- loading --------------------------------------------------------------- */

struct loader {
    const struct kvs_gguf *g;
    const struct kvs_model *m;
    char *errbuf;
    size_t errlen;
};

/* Finds `name` and checks its shape (ne0, ne1, ne2; unused dims 1). */
static kvs_err find_tensor(struct loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t ne2, bool required,
                           const struct kvs_gguf_tensor **out)
{
    *out = NULL;
    const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(L->g, name);
    if (!t) {
        if (!required) return KVS_OK;
        set_err(L->errbuf, L->errlen, "tensor '%s' is missing", name);
        return KVS_ERR_NOT_FOUND;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        set_err(L->errbuf, L->errlen,
                "tensor '%s' has shape {%lld, %lld, %lld, %lld}, expected {%lld, %lld, %lld}", name,
                (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3], (long long)ne0,
                (long long)ne1, (long long)ne2);
        return KVS_ERR_FORMAT;
    }
    if (!t->data) {
        set_err(L->errbuf, L->errlen, "tensor '%s' has no data in this file", name);
        return KVS_ERR_NOT_FOUND;
    }
    kvs_gguf_willneed(L->g, t);
    *out = t;
    return KVS_OK;
}

/* An F32 vector (norm weight, bias) of n values. */
static kvs_err load_vec(struct loader *L, const char *name, int64_t n, bool required, const float **out)
{
    const struct kvs_gguf_tensor *t;
    *out = NULL;
    kvs_err e = find_tensor(L, name, n, 1, 1, required, &t);
    if (e || !t) return e;
    if (t->type != KVS_TYPE_F32) {
        set_err(L->errbuf, L->errlen, "tensor '%s' is %s; only F32 is supported for vectors", name,
                kvs_type_name(t->type));
        return KVS_ERR_UNSUPPORTED;
    }
    *out = (const float *)t->data;
    return KVS_OK;
}

static kvs_err make_matrix(struct loader *L, const struct kvs_gguf_tensor *t, int64_t ne0, int64_t ne1,
                           struct kvs_matrix *out)
{
    if (!kvs_type_supported(t->type)) {
        set_err(L->errbuf, L->errlen, "tensor '%s' has type %s, which the kernels do not support", t->name,
                kvs_type_name(t->type));
        return KVS_ERR_UNSUPPORTED;
    }
    size_t rb = kvs_type_row_bytes(t->type, ne0);
    if (rb == 0) {
        set_err(L->errbuf, L->errlen, "tensor '%s': row of %lld is not a whole number of %s blocks", t->name,
                (long long)ne0, kvs_type_name(t->type));
        return KVS_ERR_FORMAT;
    }
    out->type = t->type;
    out->ne0 = ne0;
    out->ne1 = ne1;
    out->row_bytes = rb;
    out->data = t->data;
    return KVS_OK;
}

/* A 2-D weight {ne0, ne1}. */
static kvs_err load_mat(struct loader *L, const char *name, int64_t ne0, int64_t ne1, struct kvs_matrix *out)
{
    const struct kvs_gguf_tensor *t;
    kvs_err e = find_tensor(L, name, ne0, ne1, 1, true, &t);
    if (e) return e;
    return make_matrix(L, t, ne0, ne1, out);
}

/* A 3-D expert weight {ne0, ne1, X}: the matrix of expert 0 and the stride. */
static kvs_err load_exps(struct loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t nx,
                         struct kvs_matrix *out, size_t *stride)
{
    const struct kvs_gguf_tensor *t;
    kvs_err e = find_tensor(L, name, ne0, ne1, nx, true, &t);
    if (e) return e;
    if ((e = make_matrix(L, t, ne0, ne1, out))) return e;
    *stride = out->row_bytes * (size_t)ne1;
    return KVS_OK;
}

static kvs_err load_block(struct loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd, D = hp->head_dim, QD = (int64_t)hp->n_head * D, KD = (int64_t)hp->n_head_kv * D;
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
#define NAME(s) (snprintf(n, sizeof n, "blk.%d." s, (int)il), n)
    if ((e = load_vec(L, NAME("attn_norm.weight"), E, true, &b->attn_norm))) return e;
    if ((e = load_mat(L, NAME("attn_q.weight"), E, QD, &b->wq))) return e;
    if ((e = load_mat(L, NAME("attn_k.weight"), E, KD, &b->wk))) return e;
    if ((e = load_mat(L, NAME("attn_v.weight"), E, KD, &b->wv))) return e;
    if ((e = load_mat(L, NAME("attn_output.weight"), QD, E, &b->wo))) return e;
    bool need_bias = hp->arch == KVS_ARCH_QWEN2;
    bool may_bias = hp->arch == KVS_ARCH_QWEN2 || hp->arch == KVS_ARCH_LLAMA;
    if (may_bias) {
        if ((e = load_vec(L, NAME("attn_q.bias"), QD, need_bias, &b->bq))) return e;
        if ((e = load_vec(L, NAME("attn_k.bias"), KD, need_bias, &b->bk))) return e;
        if ((e = load_vec(L, NAME("attn_v.bias"), KD, need_bias, &b->bv))) return e;
    }
    if (hp->arch == KVS_ARCH_LLAMA && (e = load_vec(L, NAME("attn_output.bias"), E, false, &b->bo))) return e;
    if (hp->arch == KVS_ARCH_QWEN3 || hp->arch == KVS_ARCH_QWEN3MOE) {
        if ((e = load_vec(L, NAME("attn_q_norm.weight"), D, true, &b->q_norm))) return e;
        if ((e = load_vec(L, NAME("attn_k_norm.weight"), D, true, &b->k_norm))) return e;
    }
    if ((e = load_vec(L, NAME("ffn_norm.weight"), E, true, &b->ffn_norm))) return e;
    if (hp->n_expert == 0) {
        const int64_t F = hp->n_ff;
        if ((e = load_mat(L, NAME("ffn_gate.weight"), E, F, &b->gate))) return e;
        if ((e = load_mat(L, NAME("ffn_up.weight"), E, F, &b->up))) return e;
        if ((e = load_mat(L, NAME("ffn_down.weight"), F, E, &b->down))) return e;
    } else {
        const int64_t X = hp->n_expert, Fe = hp->n_ff_exp;
        if ((e = load_mat(L, NAME("ffn_gate_inp.weight"), E, X, &b->router))) return e;
        if (b->router.type != KVS_TYPE_F32) {
            set_err(L->errbuf, L->errlen, "tensor '%s' is %s; the router must be F32", n,
                    kvs_type_name(b->router.type));
            return KVS_ERR_UNSUPPORTED;
        }
        if ((e = load_exps(L, NAME("ffn_gate_exps.weight"), E, Fe, X, &b->gate_x, &b->gate_x_stride))) return e;
        if ((e = load_exps(L, NAME("ffn_up_exps.weight"), E, Fe, X, &b->up_x, &b->up_x_stride))) return e;
        if ((e = load_exps(L, NAME("ffn_down_exps.weight"), Fe, E, X, &b->down_x, &b->down_x_stride))) return e;
    }
#undef NAME
    return KVS_OK;
}

/* calloc of a*b*c elements of size sz with overflow checks. */
static void *alloc3(size_t a, size_t b, size_t c, size_t sz)
{
    if (a == 0 || b == 0 || c == 0 || sz == 0) return calloc(1, 16);
    if (b > SIZE_MAX / a || c > SIZE_MAX / (a * b) || sz > SIZE_MAX / (a * b * c)) return NULL;
    return calloc(a * b * c, sz);
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

/* Packing the window's matrices (pack_weights), split over the pool. */
#define PACK_MAX 16
struct pack_job {
    struct kvs_matrix *mats[PACK_MAX];
    char *dst[PACK_MAX];
    int n;
};

static void pack_task(void *ctx, int ith, int nth)
{
    const struct pack_job *j = ctx;
    for (int i = 0; i < j->n; i++) {
        const int64_t groups = (j->mats[i]->ne1 + 3) / 4;
        const int64_t g0 = groups * ith / nth, g1 = groups * (ith + 1) / nth;
        const int64_t r1 = 4 * g1 < j->mats[i]->ne1 ? 4 * g1 : j->mats[i]->ne1;
        if (g0 < g1)
            kvs_matrix_pack(j->mats[i], 4 * g0, r1, j->dst[i]);
    }
}

/* Repacks the window's 2-D matrices once, when the kernels have a GEMM over
 * packed weights for their type (AVX-512 Q8_0: 64-byte aligned quads in one
 * stream per 4 rows, which decode reads near the machine's bandwidth), into
 * one anonymous mapping (transparent huge pages where the kernel offers
 * them). Only the window's own tensors; the mapping's pages of the packed
 * tensors are then handed back (MADV_PAGEOUT: they stay readable, so
 * kvs_matrix.data remains the reference, and the tied embedding's rows still
 * serve lookups). KVASIR_PACK=0 turns packing off (comparisons). Failure to
 * map is not an error: the unpacked path runs. */
static void pack_weights(struct kvs_model *m)
{
    const char *env = getenv("KVASIR_PACK");
    if (env && strcmp(env, "0") == 0)
        return;
    struct kvs_matrix *cand[1] = { NULL };
    int nc = 0;
    if (m->out_w.data)
        cand[nc++] = &m->out_w;
    size_t total = 0;
    const size_t A = 4096;
    for (int pass = 0; pass < 2; pass++) {
        char *at = m->packw;
        for (int32_t i = 0; i < m->n_blk; i++) {
            struct block_w *b = &m->blk[i];
            struct kvs_matrix *mats[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->gate, &b->up, &b->down };
            struct pack_job j = { .n = 0 };
            for (int c = 0; c < (int)(sizeof mats / sizeof mats[0]) + (i == 0 ? nc : 0); c++) {
                struct kvs_matrix *W = c < 7 ? mats[c] : cand[c - 7];
                size_t bytes = W->data ? kvs_matrix_packed_bytes(W) : 0;
                if (!bytes || !kvs_kernels_use_packed(m->k, W->type))
                    continue;
                bytes = (bytes + A - 1) & ~(A - 1);
                if (pass == 0) {
                    total += bytes;
                    continue;
                }
                j.mats[j.n] = W;
                j.dst[j.n++] = at;
                at += bytes;
            }
            if (pass == 1 && j.n) {
                kvs_pool_run(m->pool, pack_task, &j);
                for (int c = 0; c < j.n; c++)
                    j.mats[c]->packed = j.dst[c];
            }
        }
        if (pass == 0) {
            if (!total)
                return;
            void *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (p == MAP_FAILED) {
                KVS_LOGW("model: cannot map %zu bytes for packed weights; using the file's layout", total);
                return;
            }
#ifdef MADV_HUGEPAGE
            (void)madvise(p, total, MADV_HUGEPAGE);
#endif
            m->packw = p;
            m->packw_bytes = total;
        }
    }
#ifdef MADV_PAGEOUT
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int32_t i = 0; i <= m->n_blk; i++) {
        struct kvs_matrix *mats[7] = { &m->out_w };
        int n = 1;
        if (i < m->n_blk) {
            struct block_w *b = &m->blk[i];
            struct kvs_matrix *bm[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->gate, &b->up, &b->down };
            memcpy(mats, bm, sizeof bm);
            n = 7;
        }
        for (int c = 0; c < n; c++) {
            if (!mats[c]->packed)
                continue;
            uintptr_t a = ((uintptr_t)mats[c]->data + pg - 1) & ~(pg - 1);
            uintptr_t z = ((uintptr_t)mats[c]->data + mats[c]->row_bytes * (size_t)mats[c]->ne1) & ~(pg - 1);
            if (a < z)
                (void)madvise((void *)a, z - a, MADV_PAGEOUT);
        }
    }
#endif
}

kvs_err kvs_model_load(const struct kvs_gguf *g, const struct kvs_model_params *p, struct kvs_model **out,
                       char *errbuf, size_t errlen)
{
    if (!g || !out) return KVS_ERR_ARG;
    *out = NULL;
    struct kvs_model_params dp = kvs_model_default_params();
    if (!p) p = &dp;
    struct kvs_model *m = calloc(1, sizeof *m);
    if (!m) return KVS_ERR_NOMEM;
    kvs_err e = kvs_hparams_read(g, &m->hp, errbuf, errlen);
    if (e) goto fail;
    const struct kvs_hparams *hp = &m->hp;
    m->begin = p->block_begin;
    m->end = p->block_end < 0 ? (int32_t)hp->n_block : p->block_end;
    if (m->begin < 0 || m->end > (int32_t)hp->n_block || m->begin >= m->end) {
        set_err(errbuf, errlen, "window [%d, %d) is not inside [0, %u) or is empty", (int)p->block_begin,
                (int)p->block_end, hp->n_block);
        e = KVS_ERR_RANGE;
        goto fail;
    }
    m->n_blk = m->end - m->begin;
    m->n_ctx = p->n_ctx > 0 ? p->n_ctx : (int32_t)(hp->n_ctx_train < 4096 ? hp->n_ctx_train : 4096);
    if (hp->n_ctx_train > 0 && m->n_ctx > (int32_t)hp->n_ctx_train && m->n_ctx <= (1 << 24))
        KVS_LOGW("model: n_ctx %d is beyond the %u positions the model was trained on: text past them "
                 "may degrade", (int)m->n_ctx, hp->n_ctx_train);
    m->n_seq = p->n_seq > 0 ? p->n_seq : 1;
    m->n_batch = p->n_batch > 0 ? p->n_batch : 512;
    m->n_threads = p->n_threads > 0 ? p->n_threads : 2;
    if (m->n_seq > MODEL_MAX_SEQ || m->n_batch > MODEL_MAX_BATCH || m->n_threads > MODEL_MAX_THREADS ||
        m->n_ctx > (1 << 24)) {
        set_err(errbuf, errlen, "n_seq %d, n_batch %d, n_threads %d or n_ctx %d is too large", (int)m->n_seq,
                (int)m->n_batch, (int)m->n_threads, (int)m->n_ctx);
        e = KVS_ERR_RANGE;
        goto fail;
    }
    m->q_dim = (int32_t)(hp->n_head * hp->head_dim);
    m->kv_dim = (int32_t)(hp->n_head_kv * hp->head_dim);
    m->ff_max = (int32_t)(hp->n_ff > hp->n_ff_exp ? hp->n_ff : hp->n_ff_exp);
    if ((int64_t)hp->n_head * hp->head_dim > (1 << 24)) {
        set_err(errbuf, errlen, "head_count x key_length is too large");
        e = KVS_ERR_RANGE;
        goto fail;
    }
    m->k = kvs_kernels_best();

    struct loader L = { g, m, errbuf, errlen };
    const int64_t E = hp->n_embd, V = hp->n_vocab;
    size_t scratch = 0;
    const size_t NB = (size_t)m->n_batch;
    if (m->begin == 0) {
        if ((e = find_tensor(&L, "token_embd.weight", E, V, 1, true, &m->tok_embd))) goto fail;
        if (!kvs_type_supported(m->tok_embd->type)) {
            set_err(errbuf, errlen, "token_embd.weight has unsupported type %s", kvs_type_name(m->tok_embd->type));
            e = KVS_ERR_UNSUPPORTED;
            goto fail;
        }
    }
    if (m->end == (int32_t)hp->n_block) {
        if ((e = load_vec(&L, "output_norm.weight", E, true, &m->out_norm))) goto fail;
        if ((e = load_mat(&L, hp->tied_output ? "token_embd.weight" : "output.weight", E, V, &m->out_w))) goto fail;
        scratch = max_sz(scratch, kvs_matmul_scratch_bytes(m->out_w.type, E, m->n_batch));
    }
    if (hp->arch == KVS_ARCH_LLAMA && (e = load_vec(&L, "rope_freqs.weight", hp->n_rot / 2, false, &m->rope_freqs)))
        goto fail;

    m->blk = calloc((size_t)m->n_blk, sizeof *m->blk);
    if (!m->blk) goto nomem;
    for (int32_t i = 0; i < m->n_blk; i++) {
        struct block_w *b = &m->blk[i];
        if ((e = load_block(&L, m->begin + i, b))) goto fail;
        const struct kvs_matrix *mats[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->gate, &b->up, &b->down,
                                            &b->router, &b->gate_x, &b->up_x, &b->down_x };
        for (size_t j = 0; j < sizeof mats / sizeof mats[0]; j++)
            if (mats[j]->data) scratch = max_sz(scratch, kvs_matmul_scratch_bytes(mats[j]->type, mats[j]->ne0, m->n_batch));
    }

    /* KV cache and work buffers. */
    size_t cache_rows = (size_t)m->n_blk * (size_t)m->n_seq;
    m->kcache = alloc3(cache_rows, (size_t)m->n_ctx, (size_t)m->kv_dim, sizeof(uint16_t));
    m->vcache = alloc3(cache_rows, (size_t)m->n_ctx, (size_t)m->kv_dim, sizeof(uint16_t));
    m->n_past = calloc((size_t)m->n_seq, sizeof(int32_t));
    m->expect = calloc((size_t)m->n_seq, sizeof(int32_t));
    m->f16tab = malloc(65536 * sizeof(float));
    m->x = alloc3(NB, (size_t)E, 1, sizeof(float));
    m->xn = alloc3(NB, (size_t)E, 1, sizeof(float));
    m->q = alloc3(NB, (size_t)m->q_dim, 1, sizeof(float));
    m->kv_k = alloc3(NB, (size_t)m->kv_dim, 1, sizeof(float));
    m->kv_v = alloc3(NB, (size_t)m->kv_dim, 1, sizeof(float));
    m->att = alloc3(NB, (size_t)m->q_dim, 1, sizeof(float));
    m->tmp = alloc3(NB, (size_t)E, 1, sizeof(float));
    m->ffa = alloc3(NB, (size_t)m->ff_max, 1, sizeof(float));
    m->ffb = alloc3(NB, (size_t)m->ff_max, 1, sizeof(float));
    m->rope_cs = alloc3(NB, hp->n_rot, 1, sizeof(float));
    m->att_ws16 = alloc3((size_t)m->n_threads, 2, hp->head_dim, sizeof(uint16_t));
    m->mm_scratch = malloc(scratch + 64);
    if (!m->kcache || !m->vcache || !m->n_past || !m->expect || !m->f16tab || !m->x || !m->xn || !m->q ||
        !m->kv_k || !m->kv_v || !m->att || !m->tmp || !m->ffa || !m->ffb || !m->rope_cs ||
        !m->att_ws16 || !m->mm_scratch)
        goto nomem;
    if (hp->n_expert) {
        const size_t X = hp->n_expert, K = hp->n_expert_used;
        m->router = alloc3(NB, X, 1, sizeof(float));
        m->sel = alloc3(NB, K, 1, sizeof(int32_t));
        m->selw = alloc3(NB, K, 1, sizeof(float));
        m->rows = alloc3(NB, K, 1, sizeof(int32_t));
        m->moe_in = alloc3(NB, (size_t)E, 1, sizeof(float));
        m->moe_y = alloc3(NB, K, (size_t)E, sizeof(float));
        if (!m->router || !m->sel || !m->selw || !m->rows || !m->moe_in || !m->moe_y) goto nomem;
    }
    for (uint32_t i = 0; i < 65536; i++) m->f16tab[i] = kvs_f16_to_f32((uint16_t)i);
    if ((e = kvs_pool_create(m->n_threads, &m->pool))) {
        set_err(errbuf, errlen, "cannot create a pool of %d threads", (int)m->n_threads);
        goto fail;
    }
    pack_weights(m);
    KVS_LOGD("model: %s window [%d, %d) of %u blocks, n_ctx %d, n_seq %d, n_batch %d, %d threads", hp->arch_name,
             (int)m->begin, (int)m->end, hp->n_block, (int)m->n_ctx, (int)m->n_seq, (int)m->n_batch,
             (int)m->n_threads);
    *out = m;
    return KVS_OK;
nomem:
    set_err(errbuf, errlen, "out of memory allocating the KV cache or work buffers");
    e = KVS_ERR_NOMEM;
fail:
    kvs_model_free(m);
    return e;
}

void kvs_model_free(struct kvs_model *m)
{
    if (!m) return;
    kvs_pool_destroy(m->pool);
    if (m->packw)
        munmap(m->packw, m->packw_bytes);
    free(m->blk);
    free(m->kcache);
    free(m->vcache);
    free(m->n_past);
    free(m->expect);
    free(m->f16tab);
    free(m->x);
    free(m->xn);
    free(m->q);
    free(m->kv_k);
    free(m->kv_v);
    free(m->att);
    free(m->tmp);
    free(m->ffa);
    free(m->ffb);
    free(m->rope_cs);
    free(m->att_ws16);
    free(m->mm_scratch);
    free(m->router);
    free(m->sel);
    free(m->selw);
    free(m->rows);
    free(m->moe_in);
    free(m->moe_y);
    free(m);
}

const struct kvs_hparams *kvs_model_hparams(const struct kvs_model *m) { return &m->hp; }
bool kvs_model_has_embd(const struct kvs_model *m) { return m->begin == 0; }
bool kvs_model_has_head(const struct kvs_model *m) { return m->end == (int32_t)m->hp.n_block; }
int32_t kvs_model_block_begin(const struct kvs_model *m) { return m->begin; }
int32_t kvs_model_block_end(const struct kvs_model *m) { return m->end; }
int32_t kvs_model_n_ctx(const struct kvs_model *m) { return m->n_ctx; }
int32_t kvs_model_n_seq(const struct kvs_model *m) { return m->n_seq; }

int32_t kvs_model_seq_len(const struct kvs_model *m, int32_t seq)
{
    if (seq < 0 || seq >= m->n_seq) return -1;
    return m->n_past[seq];
}

void kvs_model_seq_clear(struct kvs_model *m, int32_t seq)
{
    if (m && seq >= 0 && seq < m->n_seq) m->n_past[seq] = 0;
}

/* --- forward pass ------------------------------------------------------------ */

/* RMSNorm (gguf-facts §4.2): squares in float summed in double, mean rounded
 * to float, scale = 1/sqrtf(mean + eps); then the weight multiply. */
static void rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps)
{
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) sum += (double)(x[i] * x[i]);
    const float mean = (float)(sum / (double)n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] * scale) * w[i];
}

/* cos/sin per rotated pair at position pos (gguf-facts §4.3): theta starts
 * at pos and is multiplied by base^(-2/n_rot) once per pair. */
static void rope_table(const struct kvs_model *m, int32_t pos, float *cs)
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

/* The pool for a product of rows x K weights with n_tok tokens, or NULL
 * (the caller's thread alone) when the product is too small to repay a pool
 * round trip: tiny models then run at one thread's speed whatever else the
 * machine is doing, instead of waiting for a descheduled worker per matmul. */
#define MM_PARALLEL_MIN_MACS ((int64_t)1 << 18)
#define ATT_PARALLEL_MIN_MACS ((int64_t)1 << 16)
static struct kvs_pool *mm_pool(const struct kvs_model *m, int64_t rows, int64_t K, int64_t n_tok)
{
    return rows * K * n_tok >= MM_PARALLEL_MIN_MACS ? m->pool : NULL;
}

static inline float silu(float z) { return z / (1.0f + expf(-z)); }

struct att_ctx {
    struct kvs_model *m;
    const struct kvs_batch *b;
    int32_t il; /* block index within the window */
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
        const size_t base = ((size_t)c->il * (size_t)m->n_seq + (size_t)seq) * (size_t)m->n_ctx * (size_t)m->kv_dim;
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

static void attention_block(struct kvs_model *m, const struct kvs_batch *b, int32_t il)
{
    const struct kvs_hparams *hp = &m->hp;
    const struct block_w *w = &m->blk[il];
    const int32_t n = b->n_tokens;
    const int64_t E = hp->n_embd, D = hp->head_dim;
    for (int32_t t = 0; t < n; t++)
        rmsnorm(m->xn + (size_t)t * (size_t)E, m->x + (size_t)t * (size_t)E, w->attn_norm, E, hp->rms_eps);
    const struct kvs_matrix *qkv[3] = { &w->wq, &w->wk, &w->wv };
    float *const qkv_out[3] = { m->q, m->kv_k, m->kv_v };
    kvs_matmul_multi(m->k, mm_pool(m, m->q_dim + 2 * m->kv_dim, E, n), 3, qkv, m->xn, n, qkv_out, m->mm_scratch);
    add_bias(m->q, w->bq, n, m->q_dim);
    add_bias(m->kv_k, w->bk, n, m->kv_dim);
    add_bias(m->kv_v, w->bv, n, m->kv_dim);
    for (int32_t t = 0; t < n; t++) {
        const float *cs = m->rope_cs + (size_t)t * hp->n_rot;
        float *q = m->q + (size_t)t * (size_t)m->q_dim;
        float *k = m->kv_k + (size_t)t * (size_t)m->kv_dim;
        for (uint32_t h = 0; h < hp->n_head; h++) {
            float *qh = q + (size_t)h * (size_t)D;
            if (w->q_norm) rmsnorm(qh, qh, w->q_norm, D, hp->rms_eps);
            rope_apply(m, qh, cs);
        }
        for (uint32_t h = 0; h < hp->n_head_kv; h++) {
            float *kh = k + (size_t)h * (size_t)D;
            if (w->k_norm) rmsnorm(kh, kh, w->k_norm, D, hp->rms_eps);
            rope_apply(m, kh, cs);
        }
        /* Store K and V (rounded to F16) before any token attends. */
        const size_t off = (((size_t)il * (size_t)m->n_seq + (size_t)b->seq[t]) * (size_t)m->n_ctx +
                            (size_t)b->pos[t]) * (size_t)m->kv_dim;
        const float *v = m->kv_v + (size_t)t * (size_t)m->kv_dim;
        kvs_quantize_act(m->k, KVS_TYPE_F16, k, m->kcache + off, m->kv_dim);
        kvs_quantize_act(m->k, KVS_TYPE_F16, v, m->vcache + off, m->kv_dim);
    }
    struct att_ctx ac = { m, b, il };
    int64_t att_macs = 0; /* q·k and v products: (pos + 1) keys per token and head */
    for (int32_t t = 0; t < n; t++) att_macs += (int64_t)b->pos[t] + 1;
    att_macs *= (int64_t)hp->n_head * D * 2;
    if (m->n_threads > 1 && (int64_t)n * hp->n_head > 1 && att_macs >= ATT_PARALLEL_MIN_MACS)
        kvs_pool_run(m->pool, attention_worker, &ac);
    else
        attention_worker(&ac, 0, 1);
    kvs_matmul(m->k, mm_pool(m, E, m->q_dim, n), &w->wo, m->att, n, m->tmp, m->mm_scratch);
    add_bias(m->tmp, w->bo, n, E);
    for (size_t i = 0; i < (size_t)n * (size_t)E; i++) m->x[i] += m->tmp[i];
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
    for (size_t i = i0; i < i1; i++) c->a[i] = silu(c->a[i]) * c->b[i];
}

static void swiglu(struct kvs_model *m, float *a, const float *bb, size_t n)
{
    struct swiglu_ctx c = { a, bb, n };
    if (m->n_threads > 1 && n >= 8192)
        kvs_pool_run(m->pool, swiglu_worker, &c);
    else
        swiglu_worker(&c, 0, 1);
}

static void ffn_dense(struct kvs_model *m, const struct block_w *w, int32_t n)
{
    const int64_t F = m->hp.n_ff;
    const struct kvs_matrix *gu[2] = { &w->gate, &w->up };
    float *const gu_out[2] = { m->ffa, m->ffb };
    kvs_matmul_multi(m->k, mm_pool(m, 2 * F, m->hp.n_embd, n), 2, gu, m->xn, n, gu_out, m->mm_scratch);
    swiglu(m, m->ffa, m->ffb, (size_t)n * (size_t)F);
    kvs_matmul(m->k, mm_pool(m, m->hp.n_embd, F, n), &w->down, m->ffa, n, m->tmp, m->mm_scratch);
}

/* MoE (gguf-facts §4.6): softmax router, top-k, renormalized weights; tokens
 * routed to one expert go through that expert's matrices as one batch. */
static void ffn_moe(struct kvs_model *m, const struct block_w *w, int32_t n)
{
    const struct kvs_hparams *hp = &m->hp;
    const int32_t X = (int32_t)hp->n_expert, K = (int32_t)hp->n_expert_used;
    const int64_t E = hp->n_embd, Fe = hp->n_ff_exp;
    kvs_matmul(m->k, mm_pool(m, X, E, n), &w->router, m->xn, n, m->router, m->mm_scratch);
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
        kvs_matmul_multi(m->k, mm_pool(m, 2 * Fe, E, cnt), 2, gu, m->moe_in, cnt, gu_out, m->mm_scratch);
        swiglu(m, m->ffa, m->ffb, (size_t)cnt * (size_t)Fe);
        kvs_matmul(m->k, mm_pool(m, E, Fe, cnt), &d, m->ffa, cnt, m->tmp, m->mm_scratch);
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
}

static void ffn_block(struct kvs_model *m, int32_t n, int32_t il)
{
    const struct kvs_hparams *hp = &m->hp;
    const struct block_w *w = &m->blk[il];
    const int64_t E = hp->n_embd;
    for (int32_t t = 0; t < n; t++)
        rmsnorm(m->xn + (size_t)t * (size_t)E, m->x + (size_t)t * (size_t)E, w->ffn_norm, E, hp->rms_eps);
    if (hp->n_expert)
        ffn_moe(m, w, n);
    else
        ffn_dense(m, w, n);
    for (size_t i = 0; i < (size_t)n * (size_t)E; i++) m->x[i] += m->tmp[i];
}

/* Checks the batch against the caches without changing anything. */
static kvs_err check_batch(struct kvs_model *m, const struct kvs_batch *b)
{
    if (b->n_tokens < 0 || b->n_tokens > m->n_batch) return KVS_ERR_RANGE;
    if (!b->seq || !b->pos) return KVS_ERR_ARG;
    if (kvs_model_has_embd(m) ? !b->token : !b->embd) return KVS_ERR_ARG;
    for (int32_t s = 0; s < m->n_seq; s++) m->expect[s] = -1;
    for (int32_t t = 0; t < b->n_tokens; t++) {
        const int32_t s = b->seq[t], p = b->pos[t];
        if (s < 0 || s >= m->n_seq) return KVS_ERR_RANGE;
        if (p < 0 || p >= m->n_ctx) return KVS_ERR_RANGE;
        if (m->expect[s] < 0) {
            /* The first token of a sequence continues its cache, or rewinds
             * it (pos < cached: later positions are forgotten). */
            if (p > m->n_past[s]) return KVS_ERR_RANGE;
        } else if (p != m->expect[s]) {
            return KVS_ERR_RANGE;
        }
        m->expect[s] = p + 1;
        if (b->token && kvs_model_has_embd(m) && (b->token[t] < 0 || (uint32_t)b->token[t] >= m->hp.n_vocab))
            return KVS_ERR_RANGE;
    }
    return KVS_OK;
}

kvs_err kvs_model_forward(struct kvs_model *m, const struct kvs_batch *b, float *out)
{
    if (!m || !b || !out) return KVS_ERR_ARG;
    kvs_err e = check_batch(m, b);
    if (e) return e;
    const int32_t n = b->n_tokens;
    if (n == 0) return KVS_OK;
    const struct kvs_hparams *hp = &m->hp;
    const int64_t E = hp->n_embd;
    for (int32_t s = 0; s < m->n_seq; s++)
        if (m->expect[s] >= 0) m->n_past[s] = m->expect[s];

    if (kvs_model_has_embd(m)) {
        const struct kvs_gguf_tensor *te = m->tok_embd;
        const size_t rb = kvs_type_row_bytes(te->type, E);
        for (int32_t t = 0; t < n; t++)
            kvs_dequantize_row(m->k, te->type, (const uint8_t *)te->data + (size_t)b->token[t] * rb,
                               m->x + (size_t)t * (size_t)E, E);
    } else {
        memcpy(m->x, b->embd, (size_t)n * (size_t)E * sizeof(float));
    }
    for (int32_t t = 0; t < n; t++) rope_table(m, b->pos[t], m->rope_cs + (size_t)t * hp->n_rot);

    for (int32_t il = 0; il < m->n_blk; il++) {
        attention_block(m, b, il);
        ffn_block(m, n, il);
    }

    if (!kvs_model_has_head(m)) {
        memcpy(out, m->x, (size_t)n * (size_t)E * sizeof(float));
        return kvs_vec_all_finite(out, (size_t)n * (size_t)E) ? KVS_OK : KVS_ERR_NUMERIC;
    }
    int32_t n_out = 0;
    for (int32_t t = 0; t < n; t++) {
        const bool want = b->logits ? b->logits[t] != 0 : t == n - 1;
        if (!want) continue;
        rmsnorm(m->xn + (size_t)n_out * (size_t)E, m->x + (size_t)t * (size_t)E, m->out_norm, E, hp->rms_eps);
        n_out++;
    }
    if (n_out) kvs_matmul(m->k, mm_pool(m, m->out_w.ne1, E, n_out), &m->out_w, m->xn, n_out, out, m->mm_scratch);
    /* corrupt weights or a broken boundary must not become token 0 */
    return kvs_vec_all_finite(out, (size_t)n_out * (size_t)hp->n_vocab) ? KVS_OK : KVS_ERR_NUMERIC;
}

/* A window of transformer blocks: loading (weights are views into the GGUF
 * mapping), the F16 KV cache, the recurrent state of hybrid models and the
 * forward loop of ../shared/docs/gguf-facts.md §4 and
 * ../shared/docs/qwen35-facts.md §3.1. The block kinds are in model_attn.c,
 * model_gdn.c, model_ffn.c and model_moe.c (model_impl.h). */
#include "model/model_impl.h"

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
        .backend = KVS_BACKEND_CPU, .device = 0,
    };
    return p;
}

const char *kvs_backend_name(enum kvs_backend b) { return b == KVS_BACKEND_OPENCL ? "opencl" : "cpu"; }

int kvs_backend_parse(const char *s, enum kvs_backend *out)
{
    if (!s) return -1;
    if (!strcmp(s, "cpu")) *out = KVS_BACKEND_CPU;
    else if (!strcmp(s, "opencl")) *out = KVS_BACKEND_OPENCL;
    else return -1;
    return 0;
}

/* --- loading --------------------------------------------------------------- */

void kvs_model__err(struct kvs_model_loader *L, const char *fmt, ...)
{
    if (!L->errbuf || !L->errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(L->errbuf, L->errlen, fmt, ap);
    va_end(ap);
}

/* Finds `name` and checks its shape (ne0, ne1, ne2; unused dims 1). */
static kvs_err find_tensor(struct kvs_model_loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t ne2,
                           bool required, const struct kvs_gguf_tensor **out)
{
    *out = NULL;
    const struct kvs_gguf_tensor *t = kvs_gguf_find_tensor(L->g, name);
    if (!t) {
        if (!required) return KVS_OK;
        kvs_model__err(L, "tensor '%s' is missing", name);
        return KVS_ERR_NOT_FOUND;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != ne2 || t->ne[3] != 1) {
        kvs_model__err(L, "tensor '%s' has shape {%lld, %lld, %lld, %lld}, expected {%lld, %lld, %lld}", name,
                       (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                       (long long)ne0, (long long)ne1, (long long)ne2);
        return KVS_ERR_FORMAT;
    }
    if (!t->data) {
        kvs_model__err(L, "tensor '%s' has no data in this file", name);
        return KVS_ERR_NOT_FOUND;
    }
    kvs_gguf_willneed(L->g, t);
    *out = t;
    return KVS_OK;
}

kvs_err kvs_model__vec(struct kvs_model_loader *L, const char *name, int64_t n, bool required, const float **out)
{
    const struct kvs_gguf_tensor *t;
    *out = NULL;
    kvs_err e = find_tensor(L, name, n, 1, 1, required, &t);
    if (e || !t) return e;
    if (t->type != KVS_TYPE_F32) {
        kvs_model__err(L, "tensor '%s' is %s; only F32 is supported for vectors", name, kvs_type_name(t->type));
        return KVS_ERR_UNSUPPORTED;
    }
    *out = (const float *)t->data;
    return KVS_OK;
}

static kvs_err make_matrix(struct kvs_model_loader *L, const struct kvs_gguf_tensor *t, int64_t ne0, int64_t ne1,
                           struct kvs_matrix *out)
{
    if (!kvs_type_supported(t->type)) {
        kvs_model__err(L, "tensor '%s' has type %s, which the kernels do not support", t->name,
                       kvs_type_name(t->type));
        return KVS_ERR_UNSUPPORTED;
    }
    size_t rb = kvs_type_row_bytes(t->type, ne0);
    if (rb == 0) {
        kvs_model__err(L, "tensor '%s': row of %lld is not a whole number of %s blocks", t->name, (long long)ne0,
                       kvs_type_name(t->type));
        return KVS_ERR_FORMAT;
    }
    out->type = t->type;
    out->ne0 = ne0;
    out->ne1 = ne1;
    out->row_bytes = rb;
    out->data = t->data;
    out->expert = false;
    return KVS_OK;
}

kvs_err kvs_model__mat(struct kvs_model_loader *L, const char *name, int64_t ne0, int64_t ne1, struct kvs_matrix *out)
{
    const struct kvs_gguf_tensor *t;
    kvs_err e = find_tensor(L, name, ne0, ne1, 1, true, &t);
    if (e) return e;
    return make_matrix(L, t, ne0, ne1, out);
}

kvs_err kvs_model__exps(struct kvs_model_loader *L, const char *name, int64_t ne0, int64_t ne1, int64_t nx,
                        struct kvs_matrix *out, size_t *stride)
{
    const struct kvs_gguf_tensor *t;
    kvs_err e = find_tensor(L, name, ne0, ne1, nx, true, &t);
    if (e) return e;
    if ((e = make_matrix(L, t, ne0, ne1, out))) return e;
    out->expert = true; /* summed as llama.cpp's mul_mat_id does (kvs_matrix) */
    *stride = out->row_bytes * (size_t)ne1;
    return KVS_OK;
}

/* Block il (GGUF index): its norms, its mixer (attention or GDN) and FFN. */
static kvs_err load_block(struct kvs_model_loader *L, int32_t il, struct block_w *b)
{
    const struct kvs_hparams *hp = &L->m->hp;
    const int64_t E = hp->n_embd;
    const bool hybrid = kvs_hparams_hybrid(hp);
    char n[KVS_GGUF_MAX_NAME + 16];
    kvs_err e;
    b->recurrent = kvs_hparams_recurrent(hp, (uint32_t)il);
    snprintf(n, sizeof n, "blk.%d.attn_norm.weight", (int)il);
    if ((e = kvs_model__vec(L, n, E, true, &b->attn_norm))) return e;
    if ((e = b->recurrent ? kvs_model__load_gdn(L, il, b) : kvs_model__load_attn(L, il, b))) return e;
    /* qwen35: the pre-FFN norm is named post_attention_norm (qwen35-facts §2.2) */
    snprintf(n, sizeof n, "blk.%d.%s", (int)il, hybrid ? "post_attention_norm.weight" : "ffn_norm.weight");
    if ((e = kvs_model__vec(L, n, E, true, &b->ffn_norm))) return e;
    return hp->n_expert ? kvs_model__load_moe(L, il, b) : kvs_model__load_ffn(L, il, b);
}

/* calloc of a*b*c elements of size sz with overflow checks. */
static void *alloc3(size_t a, size_t b, size_t c, size_t sz)
{
    if (a == 0 || b == 0 || c == 0 || sz == 0) return calloc(1, 16);
    if (b > SIZE_MAX / a || c > SIZE_MAX / (a * b) || sz > SIZE_MAX / (a * b * c)) return NULL;
    return calloc(a * b * c, sz);
}

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

static const struct kvs_model_ops cpu_ops; /* the CPU backend, below */

/* Packing the window's matrices (pack_weights), split over the pool. */
#define PACK_MAX 16
/* The 2-D matrices of a block that packing considers (absent ones have no data). */
#define BLOCK_PACK_MATS(b)                                                                                    \
    { &(b)->wq, &(b)->wk, &(b)->wv, &(b)->wo, &(b)->gate, &(b)->up, &(b)->down, &(b)->ssm_qkv, &(b)->ssm_z,     \
      &(b)->ssm_out, &(b)->gate_sh, &(b)->up_sh, &(b)->down_sh }
#define BLOCK_PACK_N 13
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
            struct kvs_matrix *mats[] = BLOCK_PACK_MATS(b);
            struct pack_job j = { .n = 0 };
            for (int c = 0; c < BLOCK_PACK_N + (i == 0 ? nc : 0); c++) {
                struct kvs_matrix *W = c < BLOCK_PACK_N ? mats[c] : cand[c - BLOCK_PACK_N];
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
        struct kvs_matrix *mats[BLOCK_PACK_N] = { &m->out_w };
        int n = 1;
        if (i < m->n_blk) {
            struct block_w *b = &m->blk[i];
            struct kvs_matrix *bm[] = BLOCK_PACK_MATS(b);
            memcpy(mats, bm, sizeof bm);
            n = BLOCK_PACK_N;
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
    if ((int32_t)hp->n_ff_shexp > m->ff_max) m->ff_max = (int32_t)hp->n_ff_shexp;
    if ((int64_t)hp->n_head * hp->head_dim > (1 << 24)) {
        set_err(errbuf, errlen, "head_count x key_length is too large");
        e = KVS_ERR_RANGE;
        goto fail;
    }
    m->k = kvs_kernels_best();

    struct kvs_model_loader L = { g, m, errbuf, errlen };
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
        if ((e = kvs_model__vec(&L, "output_norm.weight", E, true, &m->out_norm))) goto fail;
        if ((e = kvs_model__mat(&L, hp->tied_output ? "token_embd.weight" : "output.weight", E, V, &m->out_w))) goto fail;
        scratch = max_sz(scratch, kvs_matmul_scratch_bytes(m->out_w.type, E, m->n_batch));
    }
    if (hp->arch == KVS_ARCH_LLAMA && (e = kvs_model__vec(&L, "rope_freqs.weight", hp->n_rot / 2, false, &m->rope_freqs)))
        goto fail;

    m->blk = calloc((size_t)m->n_blk, sizeof *m->blk);
    if (!m->blk) goto nomem;
    for (int32_t i = 0; i < m->n_blk; i++) {
        struct block_w *b = &m->blk[i];
        if ((e = load_block(&L, m->begin + i, b))) goto fail;
        b->kv_slot = b->recurrent ? -1 : m->n_kv_blk++;
        b->rs_slot = b->recurrent ? m->n_rs_blk++ : -1;
        const struct kvs_matrix *mats[] = { &b->wq, &b->wk, &b->wv, &b->wo, &b->gate, &b->up, &b->down,
                                            &b->router, &b->gate_x, &b->up_x, &b->down_x, &b->ssm_qkv,
                                            &b->ssm_z, &b->ssm_beta, &b->ssm_alpha, &b->ssm_out,
                                            &b->gate_sh, &b->up_sh, &b->down_sh, &b->gate_inp_sh };
        for (size_t j = 0; j < sizeof mats / sizeof mats[0]; j++)
            if (mats[j]->data) scratch = max_sz(scratch, kvs_matmul_scratch_bytes(mats[j]->type, mats[j]->ne0, m->n_batch));
    }

    /* KV cache (attention blocks only) and work buffers. */
    const bool on_host = p->backend == KVS_BACKEND_CPU; /* the OpenCL backend keeps its cache on the device */
    size_t cache_rows = on_host ? (size_t)m->n_kv_blk * (size_t)m->n_seq : 0;
    m->kcache = alloc3(cache_rows, (size_t)m->n_ctx, (size_t)m->kv_dim, sizeof(uint16_t));
    m->vcache = alloc3(cache_rows, (size_t)m->n_ctx, (size_t)m->kv_dim, sizeof(uint16_t));
    m->n_past = calloc((size_t)m->n_seq, sizeof(int32_t));
    m->expect = calloc((size_t)m->n_seq, sizeof(int32_t));
    m->first = calloc((size_t)m->n_seq, sizeof(int32_t));
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
    if (!m->kcache || !m->vcache || !m->n_past || !m->expect || !m->first || !m->f16tab || !m->x || !m->xn || !m->q ||
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
    if (kvs_hparams_hybrid(hp)) {
        const size_t C = kvs_hparams_conv_channels(hp), K = hp->ssm_conv, dv = (size_t)hp->ssm_h_v * hp->ssm_d;
        const size_t rs = (size_t)m->n_rs_blk * (size_t)m->n_seq;
        m->conv_st = alloc3(rs, K - 1, C, sizeof(float));
        m->ssm_st = alloc3(rs, dv, hp->ssm_d, sizeof(float));
        m->conv_wt = alloc3((size_t)m->n_rs_blk, K, C, sizeof(float));
        m->rs_dirty = calloc((size_t)m->n_seq, 1);
        m->qg = alloc3(NB, 2, (size_t)m->q_dim, sizeof(float));
        m->gate = alloc3(NB, (size_t)m->q_dim, 1, sizeof(float));
        m->g_mix = alloc3(NB, C, 1, sizeof(float));
        m->g_u = alloc3(NB, C, 1, sizeof(float));
        m->g_z = alloc3(NB, dv, 1, sizeof(float));
        m->g_b = alloc3(NB, hp->ssm_h_v, 1, sizeof(float));
        m->g_a = alloc3(NB, hp->ssm_h_v, 1, sizeof(float));
        m->g_o = alloc3(NB, dv, 1, sizeof(float));
        m->sh_gate = alloc3(NB, 1, 1, sizeof(float));
        if (!m->conv_st || !m->ssm_st || !m->conv_wt || !m->rs_dirty || !m->qg || !m->gate || !m->g_mix || !m->g_u ||
            !m->g_z || !m->g_b || !m->g_a || !m->g_o || !m->sh_gate)
            goto nomem;
        for (int32_t i = 0; i < m->n_blk; i++) {
            const struct block_w *b = &m->blk[i];
            if (!b->recurrent) continue;
            float *wt = m->conv_wt + (size_t)b->rs_slot * K * C;
            for (size_t c = 0; c < C; c++)
                for (size_t j = 0; j < K; j++) wt[j * C + c] = b->conv_w[c * K + j];
        }
    }
    for (uint32_t i = 0; i < 65536; i++) m->f16tab[i] = kvs_f16_to_f32((uint16_t)i);
    if ((e = kvs_pool_create(m->n_threads, &m->pool))) {
        set_err(errbuf, errlen, "cannot create a pool of %d threads", (int)m->n_threads);
        goto fail;
    }
    m->ops = &cpu_ops;
    if (p->backend == KVS_BACKEND_OPENCL) {
        if ((e = kvs_model__ocl_load(m, p->device, errbuf, errlen))) goto fail;
    } else {
        pack_weights(m);
    }
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
    kvs_model__ocl_free(m);
    kvs_pool_destroy(m->pool);
    if (m->packw)
        munmap(m->packw, m->packw_bytes);
    free(m->blk);
    free(m->kcache);
    free(m->vcache);
    free(m->n_past);
    free(m->expect);
    free(m->first);
    free(m->f16tab);
    free(m->conv_st);
    free(m->ssm_st);
    free(m->conv_wt);
    free(m->rs_dirty);
    free(m->qg);
    free(m->gate);
    free(m->g_mix);
    free(m->g_u);
    free(m->g_z);
    free(m->g_b);
    free(m->g_a);
    free(m->g_o);
    free(m->sh_gate);
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

/* Zeroes sequence seq's conv and delta states in every GDN block of the
 * window (qwen35-facts §4.2: a sequence starts from all-zero state). */
static void clear_recurrent(struct kvs_model *m, int32_t seq)
{
    if (!m->n_rs_blk || !m->rs_dirty[seq]) return;
    const size_t nc = (size_t)(m->hp.ssm_conv - 1) * kvs_hparams_conv_channels(&m->hp);
    const size_t ns = (size_t)m->hp.ssm_h_v * m->hp.ssm_d * m->hp.ssm_d;
    for (int32_t r = 0; r < m->n_rs_blk; r++) {
        const size_t i = (size_t)r * (size_t)m->n_seq + (size_t)seq;
        memset(m->conv_st + i * nc, 0, nc * sizeof(float));
        memset(m->ssm_st + i * ns, 0, ns * sizeof(float));
    }
    if (m->ocl) kvs_model__ocl_seq_clear(m, seq);
    m->rs_dirty[seq] = 0;
}

void kvs_model_seq_clear(struct kvs_model *m, int32_t seq)
{
    if (!m || seq < 0 || seq >= m->n_seq) return;
    m->n_past[seq] = 0;
    clear_recurrent(m, seq);
}

/* Sequence state for a handover (model.h): K then V rows [0, n_past) of each
 * attention block's cache, then each GDN block's conv and delta state. */
static size_t seq_state_bytes(const struct kvs_model *m, int32_t n_past)
{
    const size_t nc = m->n_rs_blk ? (size_t)(m->hp.ssm_conv - 1) * kvs_hparams_conv_channels(&m->hp) : 0;
    const size_t ns = m->n_rs_blk ? (size_t)m->hp.ssm_h_v * m->hp.ssm_d * m->hp.ssm_d : 0;
    return (size_t)m->n_kv_blk * 2u * (size_t)n_past * (size_t)m->kv_dim * sizeof(uint16_t) +
           (size_t)m->n_rs_blk * (nc + ns) * sizeof(float);
}

size_t kvs_model_seq_state_bytes(const struct kvs_model *m, int32_t seq)
{
    if (!m || seq < 0 || seq >= m->n_seq || m->ocl) return 0;
    return seq_state_bytes(m, m->n_past[seq]);
}

kvs_err kvs_model_seq_state_get(const struct kvs_model *m, int32_t seq, uint8_t *out, size_t cap)
{
    if (!m || seq < 0 || seq >= m->n_seq || !out) return KVS_ERR_ARG;
    if (m->ocl) return KVS_ERR_UNSUPPORTED;
    const int32_t np = m->n_past[seq];
    if (cap < seq_state_bytes(m, np)) return KVS_ERR_RANGE;
    const size_t row = (size_t)m->kv_dim, rows = (size_t)np * row;
    for (int32_t b = 0; b < m->n_kv_blk; b++) {
        const size_t at = ((size_t)b * (size_t)m->n_seq + (size_t)seq) * (size_t)m->n_ctx * row;
        memcpy(out, m->kcache + at, rows * sizeof(uint16_t));
        out += rows * sizeof(uint16_t);
        memcpy(out, m->vcache + at, rows * sizeof(uint16_t));
        out += rows * sizeof(uint16_t);
    }
    if (m->n_rs_blk) {
        const size_t nc = (size_t)(m->hp.ssm_conv - 1) * kvs_hparams_conv_channels(&m->hp);
        const size_t ns = (size_t)m->hp.ssm_h_v * m->hp.ssm_d * m->hp.ssm_d;
        for (int32_t r = 0; r < m->n_rs_blk; r++) {
            const size_t i = (size_t)r * (size_t)m->n_seq + (size_t)seq;
            memcpy(out, m->conv_st + i * nc, nc * sizeof(float));
            out += nc * sizeof(float);
            memcpy(out, m->ssm_st + i * ns, ns * sizeof(float));
            out += ns * sizeof(float);
        }
    }
    return KVS_OK;
}

kvs_err kvs_model_seq_state_set(struct kvs_model *m, int32_t seq, int32_t n_past, const uint8_t *in, size_t len)
{
    if (!m || seq < 0 || seq >= m->n_seq || (!in && len)) return KVS_ERR_ARG;
    if (m->ocl) return KVS_ERR_UNSUPPORTED;
    if (n_past < 0 || n_past > m->n_ctx || len != seq_state_bytes(m, n_past)) return KVS_ERR_RANGE;
    const size_t row = (size_t)m->kv_dim, rows = (size_t)n_past * row;
    for (int32_t b = 0; b < m->n_kv_blk; b++) {
        const size_t at = ((size_t)b * (size_t)m->n_seq + (size_t)seq) * (size_t)m->n_ctx * row;
        memcpy(m->kcache + at, in, rows * sizeof(uint16_t));
        in += rows * sizeof(uint16_t);
        memcpy(m->vcache + at, in, rows * sizeof(uint16_t));
        in += rows * sizeof(uint16_t);
    }
    if (m->n_rs_blk) {
        const size_t nc = (size_t)(m->hp.ssm_conv - 1) * kvs_hparams_conv_channels(&m->hp);
        const size_t ns = (size_t)m->hp.ssm_h_v * m->hp.ssm_d * m->hp.ssm_d;
        for (int32_t r = 0; r < m->n_rs_blk; r++) {
            const size_t i = (size_t)r * (size_t)m->n_seq + (size_t)seq;
            memcpy(m->conv_st + i * nc, in, nc * sizeof(float));
            in += nc * sizeof(float);
            memcpy(m->ssm_st + i * ns, in, ns * sizeof(float));
            in += ns * sizeof(float);
        }
        m->rs_dirty[seq] = 1;
    }
    m->n_past[seq] = n_past;
    return KVS_OK;
}

/* --- forward pass ------------------------------------------------------------ */

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
            /* A recurrent state cannot be rewound: a hybrid sequence
             * continues or restarts from 0. */
            if (m->n_rs_blk && p != m->n_past[s] && p != 0) return KVS_ERR_RANGE;
            m->first[s] = p;
        } else if (p != m->expect[s]) {
            return KVS_ERR_RANGE;
        }
        m->expect[s] = p + 1;
        if (b->token && kvs_model_has_embd(m) && (b->token[t] < 0 || (uint32_t)b->token[t] >= m->hp.n_vocab))
            return KVS_ERR_RANGE;
    }
    return KVS_OK;
}

/* --- the CPU backend ------------------------------------------------------- */

static kvs_err cpu_input(struct kvs_model *m, const struct kvs_batch *b)
{
    const int32_t n = b->n_tokens;
    const int64_t E = m->hp.n_embd;
    if (kvs_model_has_embd(m)) {
        const struct kvs_gguf_tensor *te = m->tok_embd;
        const size_t rb = kvs_type_row_bytes(te->type, E);
        for (int32_t t = 0; t < n; t++)
            kvs_dequantize_row(m->k, te->type, (const uint8_t *)te->data + (size_t)b->token[t] * rb,
                               m->x + (size_t)t * (size_t)E, E);
    } else {
        memcpy(m->x, b->embd, (size_t)n * (size_t)E * sizeof(float));
    }
    for (int32_t t = 0; t < n; t++) kvs_model__rope_table(m, b->pos[t], m->rope_cs + (size_t)t * m->hp.n_rot);
    return KVS_OK;
}

static void cpu_norm(struct kvs_model *m, int32_t il, bool ffn, int32_t n)
{
    const int64_t E = m->hp.n_embd;
    const float *w = ffn ? m->blk[il].ffn_norm : m->blk[il].attn_norm;
    for (int32_t t = 0; t < n; t++)
        kvs_model__rmsnorm(m->xn + (size_t)t * (size_t)E, m->x + (size_t)t * (size_t)E, w, E, m->hp.rms_eps);
}

static void cpu_ffn(struct kvs_model *m, int32_t il, int32_t n)
{
    const struct block_w *w = &m->blk[il];
    if (m->hp.n_expert)
        kvs_model__ffn_moe(m, w, n);
    else
        kvs_model__ffn_dense(m, w, n);
    for (size_t i = 0; i < (size_t)n * (size_t)m->hp.n_embd; i++) m->x[i] += m->tmp[i];
}

static kvs_err cpu_output(struct kvs_model *m, const struct kvs_batch *b, float *out)
{
    const int32_t n = b->n_tokens;
    const int64_t E = m->hp.n_embd;
    if (!kvs_model_has_head(m)) {
        memcpy(out, m->x, (size_t)n * (size_t)E * sizeof(float));
        return kvs_vec_all_finite(out, (size_t)n * (size_t)E) ? KVS_OK : KVS_ERR_NUMERIC;
    }
    int32_t n_out = 0;
    for (int32_t t = 0; t < n; t++) {
        const bool want = b->logits ? b->logits[t] != 0 : t == n - 1;
        if (!want) continue;
        kvs_model__rmsnorm(m->xn + (size_t)n_out * (size_t)E, m->x + (size_t)t * (size_t)E, m->out_norm, E,
                           m->hp.rms_eps);
        n_out++;
    }
    if (n_out) kvs_matmul(m->k, kvs_model__mm_pool(m, m->out_w.ne1, E, n_out), &m->out_w, m->xn, n_out, out, m->mm_scratch);
    /* corrupt weights or a broken boundary must not become token 0 */
    return kvs_vec_all_finite(out, (size_t)n_out * (size_t)m->hp.n_vocab) ? KVS_OK : KVS_ERR_NUMERIC;
}

static const struct kvs_model_ops cpu_ops = {
    .name = "cpu",
    .input = cpu_input,
    .norm = cpu_norm,
    .attention = kvs_model__attention,
    .gdn = kvs_model__gdn,
    .ffn = cpu_ffn,
    .output = cpu_output,
};

kvs_err kvs_model_forward(struct kvs_model *m, const struct kvs_batch *b, float *out)
{
    if (!m || !b || !out) return KVS_ERR_ARG;
    kvs_err e = check_batch(m, b);
    if (e) return e;
    const int32_t n = b->n_tokens;
    if (n == 0) return KVS_OK;
    for (int32_t s = 0; s < m->n_seq; s++)
        if (m->expect[s] >= 0) {
            m->n_past[s] = m->expect[s];
            if (m->n_rs_blk) {
                if (m->first[s] == 0) clear_recurrent(m, s); /* a new sequence starts from zero state */
                m->rs_dirty[s] = 1;
            }
        }

    const struct kvs_model_ops *ops = m->ops;
    if ((e = ops->input(m, b))) return e;
    for (int32_t il = 0; il < m->n_blk; il++) {
        ops->norm(m, il, false, n);
        if (m->blk[il].recurrent)
            ops->gdn(m, b, il);
        else
            ops->attention(m, b, il);
        ops->norm(m, il, true, n);
        ops->ffn(m, il, n);
    }
    return ops->output(m, b, out);
}

/* Threaded matrix-vector / matrix-matrix products over quantized weights.
 *
 * Recipe (gguf-facts §2.5): each activation row is converted once to the
 * weight type's vec_dot type, then every output is one vec_dot of a weight
 * row with an activation row. Rows of W are split into one contiguous chunk
 * per thread. For n_tok > 1 each weight row is loaded once and used for all
 * tokens (4 at a time through the ISA's dot4 kernel when it has one), so a
 * prefill streams the weights once instead of n_tok times. */
#include <stdatomic.h>

#include "kernels/kernels_impl.h"

size_t kvs_matmul_scratch_bytes(enum kvs_type type, int64_t K, int64_t n_tok)
{
    enum kvs_type vt = kvs_vec_dot_type(type);
    if (vt == KVS_TYPE_COUNT || vt == KVS_TYPE_F32 || n_tok < 0)
        return 0;
    size_t plain = kvs_kernels_row_bytes(vt, K), packed = kvs_kernels_pack_row_bytes(type, K);
    /* the packed GEMM layout (any ISA) is 64-byte aligned inside the scratch */
    return (plain > packed ? plain : packed) * (size_t)n_tok + (packed ? 64 : 0);
}

struct kvs_mm_job {
    const struct kvs_kernels *k;
    const struct kvs_matrix *W;
    int64_t row_begin, row_end;
    const float *x;
    int64_t n_tok;
    float *y;
    const void *act;   /* quantized activations: n_tok rows of act_row bytes */
    void *act_w;       /* the same, writable (scratch) */
    size_t act_row;
    enum kvs_type vt;
    kvs_gemm_fn gemm;  /* non-NULL: act is in the ISA's packed layout */
    int64_t chunk;     /* gemm: rows per claimed chunk (a multiple of 4) */
    _Atomic int64_t next; /* gemm: first row not yet claimed */
};

static void kvs_mm_quant_task(void *ctx, int ith, int nth)
{
    struct kvs_mm_job *j = ctx;
    int64_t K = j->W->ne0;
    kvs_quant_act_fn q = j->gemm ? j->k->pack_act[j->W->type] : j->k->quant_act[j->vt];
    for (int64_t t = ith; t < j->n_tok; t += nth)
        q(j->x + t * K, (char *)j->act_w + (size_t)t * j->act_row, K);
}

static void kvs_mm_dot_task(void *ctx, int ith, int nth)
{
    const struct kvs_mm_job *j = ctx;
    const struct kvs_matrix *W = j->W;
    int64_t rows = j->row_end - j->row_begin;
    int64_t K = W->ne0, N = rows, T = j->n_tok;
    if (j->gemm) {
        /* Chunks of rows claimed from a shared counter: on a shared machine
         * a thread that loses its core does not hold the others up. */
        _Atomic int64_t *next = &((struct kvs_mm_job *)ctx)->next;
        const char *wbase = (const char *)W->data + (size_t)j->row_begin * W->row_bytes;
        for (;;) {
            int64_t c0 = atomic_fetch_add_explicit(next, j->chunk, memory_order_relaxed);
            if (c0 >= rows)
                break;
            int64_t c1 = c0 + j->chunk < rows ? c0 + j->chunk : rows;
            j->gemm(K, wbase + (size_t)c0 * W->row_bytes, W->row_bytes, c1 - c0, j->act, j->act_row, T,
                    j->y + c0, (size_t)N);
        }
        return;
    }
    int64_t per = (rows + nth - 1) / nth;
    int64_t r0 = (int64_t)ith * per, r1 = r0 + per;
    if (r1 > rows)
        r1 = rows;
    if (r0 >= r1)
        return;
    kvs_dot_fn dot = j->k->dot[W->type];
    kvs_dot4_fn dot4 = j->k->dot4[W->type];
    const char *wbase = (const char *)W->data + (size_t)j->row_begin * W->row_bytes;
    const char *act = j->act;
    if (T == 1) {
        for (int64_t r = r0; r < r1; r++)
            j->y[r] = dot(K, wbase + (size_t)r * W->row_bytes, act);
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const char *w = wbase + (size_t)r * W->row_bytes;
        int64_t t = 0;
        if (dot4) {
            for (; t + 4 <= T; t += 4) {
                float out[4];
                dot4(K, w, act + (size_t)t * j->act_row, j->act_row, out);
                for (int u = 0; u < 4; u++)
                    j->y[(t + u) * N + r] = out[u];
            }
        }
        for (; t < T; t++)
            j->y[t * N + r] = dot(K, w, act + (size_t)t * j->act_row);
    }
}

void kvs_matmul_rows(const struct kvs_kernels *k, struct kvs_pool *pool, const struct kvs_matrix *W,
                     int64_t row_begin, int64_t row_end, const float *x, int64_t n_tok, float *y,
                     void *scratch)
{
    assert(k && W && x && y && n_tok >= 0);
    assert(row_begin >= 0 && row_begin <= row_end && row_end <= W->ne1);
    assert(W->type >= 0 && W->type < KVS_TYPE_COUNT && k->dot[W->type]);
    if (n_tok == 0 || row_end == row_begin)
        return;
    struct kvs_mm_job j = {
        .k = k, .W = W, .row_begin = row_begin, .row_end = row_end,
        .x = x, .n_tok = n_tok, .y = y, .vt = kvs_vec_dot_type(W->type),
    };
    if (j.vt == KVS_TYPE_F32) {
        j.act = x;
        j.act_row = (size_t)W->ne0 * sizeof(float);
    } else {
        assert(scratch);
        j.act = j.act_w = scratch;
        j.act_row = kvs_kernels_row_bytes(j.vt, W->ne0);
        size_t packed = kvs_kernels_pack_row_bytes(W->type, W->ne0);
        if (packed && k->gemm[W->type] && k->pack_act[W->type]) {
            j.gemm = k->gemm[W->type];
            j.act = j.act_w = (void *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
            j.act_row = packed;
            int nth = kvs_pool_n_threads(pool);
            int64_t rows = row_end - row_begin;
            j.chunk = nth > 1 ? (rows / (8 * (int64_t)nth) + 3) & ~(int64_t)3 : rows;
            if (j.chunk < 4)
                j.chunk = 4;
            atomic_init(&j.next, 0);
        }
        if (n_tok == 1)
            kvs_mm_quant_task(&j, 0, 1); /* one short row: cheaper than a pool round trip */
        else
            kvs_pool_run(pool, kvs_mm_quant_task, &j);
    }
    kvs_pool_run(pool, kvs_mm_dot_task, &j);
}

void kvs_matmul(const struct kvs_kernels *k, struct kvs_pool *pool, const struct kvs_matrix *W,
                const float *x, int64_t n_tok, float *y, void *scratch)
{
    kvs_matmul_rows(k, pool, W, 0, W->ne1, x, n_tok, y, scratch);
}

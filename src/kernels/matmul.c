/* Threaded matrix-vector / matrix-matrix products over quantized weights.
 *
 * Recipe (gguf-facts §2.5): each activation row is converted once to the
 * weight type's vec_dot type, then every output is one vec_dot of a weight
 * row with an activation row.
 *
 * Two paths. When the ISA has a register-blocked GEMM for the weight type
 * (AVX-512: Q8_0, Q4_0), the activations are quantized into the GEMM's packed
 * layout and the kernel computes tiles of rows x tokens, for decode (one
 * token) and prefill alike; the rows are split into per-thread home ranges
 * with stealing (below). Otherwise rows are split into one contiguous chunk
 * per thread and each weight row is loaded once for all tokens (4 at a time
 * through the ISA's dot4 kernel when it has one), so a prefill streams the
 * weights once instead of n_tok times. */
#include <stdatomic.h>
#include <string.h>

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

/* --- packed weights --------------------------------------------------------- */

size_t kvs_kernels_packw_group_bytes(enum kvs_type type, int64_t n)
{
    if (type != KVS_TYPE_Q8_0 || n <= 0 || n % KVS_QK != 0)
        return 0;
    const int64_t nq = (n / KVS_QK + 3) / 4;
    return (size_t)((nq + 1) / 2) * KVS_PACKW_PAIR_BYTES;
}

size_t kvs_matrix_packed_bytes(const struct kvs_matrix *W)
{
    if (!W || W->ne1 <= 0 || W->ne1 >= ((int64_t)1 << 31) || W->row_bytes != kvs_kernels_row_bytes(W->type, W->ne0))
        return 0;
    return kvs_kernels_packw_group_bytes(W->type, W->ne0) * (size_t)((W->ne1 + KVS_PACKW_ROWS - 1) / KVS_PACKW_ROWS);
}

bool kvs_kernels_use_packed(const struct kvs_kernels *k, enum kvs_type type)
{
    return k && type >= 0 && type < KVS_TYPE_COUNT && k->gemm_packed[type] && k->pack_act[type];
}

void kvs_matrix_pack(const struct kvs_matrix *W, int64_t row_begin, int64_t row_end, void *dst)
{
    const size_t gb = kvs_matrix_packed_bytes(W) ? kvs_kernels_packw_group_bytes(W->type, W->ne0) : 0;
    assert(gb && dst && row_begin >= 0 && (row_begin % KVS_PACKW_ROWS == 0 || row_begin == row_end) && row_begin <= row_end &&
           row_end <= W->ne1 && (row_end % KVS_PACKW_ROWS == 0 || row_end == W->ne1));
    const int64_t nb = W->ne0 / KVS_QK, nq = (nb + 3) / 4;
    for (int64_t g = row_begin / KVS_PACKW_ROWS; g * KVS_PACKW_ROWS < row_end; g++) {
        uint8_t *out = (uint8_t *)dst + (size_t)g * gb;
        memset(out, 0x80, gb); /* zero quants (w ^ 0x80) in padding rows and blocks */
        for (int64_t q = 0; q < nq; q++) {
            uint8_t *pair = out + (size_t)(q / 2) * KVS_PACKW_PAIR_BYTES;
            uint8_t *qq = pair + (size_t)(q % 2) * KVS_PACKW_QUAD_QBYTES;
            uint16_t d[KVS_PACKW_ROWS * 4] = {0};
            for (int r = 0; r < KVS_PACKW_ROWS; r++) {
                const int64_t row = g * KVS_PACKW_ROWS + r;
                if (row >= W->ne1)
                    continue;
                const kvs_block_q8_0 *x = (const kvs_block_q8_0 *)((const char *)W->data + (size_t)row * W->row_bytes);
                for (int b = 0; b < 4 && 4 * q + b < nb; b++) {
                    const kvs_block_q8_0 *blk = &x[4 * q + b];
                    for (int i = 0; i < 16; i++) {
                        qq[r * 128 + b * 16 + i] = (uint8_t)blk->qs[i] ^ 0x80;
                        qq[r * 128 + 64 + b * 16 + i] = (uint8_t)blk->qs[16 + i] ^ 0x80;
                    }
                    d[r * 4 + b] = blk->d;
                }
            }
            memcpy(pair + 2 * KVS_PACKW_QUAD_QBYTES + (size_t)(q % 2) * 32, d, sizeof d);
        }
        /* an odd last quad's partner: zero scales */
        if (nq % 2)
            memset(out + (size_t)(nq / 2) * KVS_PACKW_PAIR_BYTES + 2 * KVS_PACKW_QUAD_QBYTES + 32, 0, 32);
    }
}

/* GEMM work split: thread i owns the rows [front, back) of range i (a
 * static, contiguous share, so its weight stream and prefetches run on
 * without a break) and takes chunks from the front; a thread whose range is
 * empty steals chunks from the back of the others', so on a shared machine a
 * thread that loses its core does not hold the matmul up. front and back are
 * packed in one word (row offsets < 2^31) and claimed with compare-exchange. */
#define KVS_MM_MAX_RANGES 64
#define KVS_MM_MAX_MATS 4
#define KVS_MM_TOKEN_BLOCK 64
struct kvs_mm_range {
    _Alignas(64) _Atomic uint64_t fb; /* front << 32 | back */
};

static inline bool kvs_mm_claim(struct kvs_mm_range *rg, int64_t chunk, bool from_back, int64_t *c0,
                                int64_t *c1)
{
    uint64_t v = atomic_load_explicit(&rg->fb, memory_order_relaxed);
    for (;;) {
        int64_t f = (int64_t)(v >> 32), b = (int64_t)(v & 0xFFFFFFFFu);
        if (f >= b)
            return false;
        uint64_t nv;
        if (from_back) {
            *c1 = b;
            *c0 = b - chunk > f ? b - chunk : f;
            nv = ((uint64_t)f << 32) | (uint64_t)*c0;
        } else {
            *c0 = f;
            *c1 = f + chunk < b ? f + chunk : b;
            nv = ((uint64_t)*c1 << 32) | (uint64_t)b;
        }
        if (atomic_compare_exchange_weak_explicit(&rg->fb, &v, nv, memory_order_relaxed, memory_order_relaxed))
            return true;
    }
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
    int n_ranges;      /* gemm: home ranges, one per thread (at most KVS_MM_MAX_RANGES) */
    struct kvs_mm_range *ranges;
    /* gemm: the rows of n_mats matrices of one K whose types share one packed
     * activation layout (kvs_matmul_multi) as one row space: matrix m has
     * rows [off[m], off[m + 1]) of it, writes ys[m] (stride its row count)
     * through gemms[m] / gemms_packed[m]; W, y, row_begin are matrix 0's. */
    int n_mats;
    const struct kvs_matrix *mats[KVS_MM_MAX_MATS];
    float *ys[KVS_MM_MAX_MATS];
    int64_t off[KVS_MM_MAX_MATS + 1];
    kvs_gemm_fn gemms[KVS_MM_MAX_MATS], gemms_packed[KVS_MM_MAX_MATS];
};

/* The GEMM over rows [c0, c1) of the job's row space. */
static void kvs_mm_gemm_span(const struct kvs_mm_job *j, int64_t c0, int64_t c1)
{
    int m = 0;
    while (c0 < c1) {
        while (c0 >= j->off[m + 1])
            m++;
        const int64_t e = c1 < j->off[m + 1] ? c1 : j->off[m + 1];
        const struct kvs_matrix *W = j->mats[m];
        const int64_t r = c0 - j->off[m] + (m == 0 ? j->row_begin : 0);
        const size_t ny = (size_t)(j->off[m + 1] - j->off[m]);
        if (W->packed && j->gemms_packed[m] && r % KVS_PACKW_ROWS == 0) {
            const size_t gb = kvs_kernels_packw_group_bytes(W->type, W->ne0);
            for (int64_t t = 0; t < j->n_tok; t += KVS_MM_TOKEN_BLOCK) {
                const int64_t nt = j->n_tok - t < KVS_MM_TOKEN_BLOCK ? j->n_tok - t : KVS_MM_TOKEN_BLOCK;
                j->gemms_packed[m](W->ne0, (const char *)W->packed + (size_t)(r / KVS_PACKW_ROWS) * gb, gb, e - c0,
                               (const char *)j->act + (size_t)t * j->act_row, j->act_row, nt,
                               j->ys[m] + (size_t)t * ny + (size_t)(c0 - j->off[m]), ny);
            }
            c0 = e;
            continue;
        }
        /* Long prompts: blocks of tokens, so that the chunk's weights and one
         * block's activations stay in L2 while every row tile of the chunk
         * passes over the block. */
        for (int64_t t = 0; t < j->n_tok; t += KVS_MM_TOKEN_BLOCK) {
            const int64_t nt = j->n_tok - t < KVS_MM_TOKEN_BLOCK ? j->n_tok - t : KVS_MM_TOKEN_BLOCK;
            j->gemms[m](W->ne0, (const char *)W->data + (size_t)r * W->row_bytes, W->row_bytes, e - c0,
                    (const char *)j->act + (size_t)t * j->act_row, j->act_row, nt,
                    j->ys[m] + (size_t)t * ny + (size_t)(c0 - j->off[m]), ny);
        }
        c0 = e;
    }
}

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
        for (int k = 0; k < j->n_ranges; k++) {
            int own = (ith + k) % j->n_ranges;
            int64_t c0, c1;
            while (kvs_mm_claim(&j->ranges[own], j->chunk, own != ith, &c0, &c1))
                kvs_mm_gemm_span(j, c0, c1);
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
    /* ggml's prompt GEMM (n_tok >= 2, a multiple of 4 weight rows) sums
     * float weights in its own order; the decode and expert matmuls use
     * its vec_dot (kvs_kernels dot_gemm). */
    if (T > 1 && j->k->dot_gemm[W->type] && !W->expert && W->ne1 % 4 == 0) {
        dot = j->k->dot_gemm[W->type];
        dot4 = NULL;
    }
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

/* Switches j (mats, ys, off, n_mats set) to the packed GEMM path if the
 * ISA has one for the type and the row space fits the range words. */
static void kvs_mm_gemm_setup(struct kvs_mm_job *j, struct kvs_pool *pool, void *scratch,
                              struct kvs_mm_range *ranges)
{
    const struct kvs_matrix *W = j->W;
    const int64_t rows = j->off[j->n_mats];
    size_t packed = kvs_kernels_pack_row_bytes(W->type, W->ne0);
    if (!packed || !j->k->gemm[W->type] || !j->k->pack_act[W->type] || rows >= ((int64_t)1 << 31))
        return;
    for (int m = 0; m < j->n_mats; m++) {
        const enum kvs_type t = j->mats[m]->type;
        if (j->mats[m]->ne0 != W->ne0 || !j->k->gemm[t] || j->k->pack_act[t] != j->k->pack_act[W->type] ||
            kvs_kernels_pack_row_bytes(t, W->ne0) != packed)
            return;
    }
    for (int m = 0; m < j->n_mats; m++) {
        j->gemms[m] = j->k->gemm[j->mats[m]->type];
        j->gemms_packed[m] = j->k->gemm_packed[j->mats[m]->type];
    }
    j->gemm = j->k->gemm[W->type];
    j->act = j->act_w = (void *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    j->act_row = packed;
    int nr = kvs_pool_n_threads(pool);
    if (nr > KVS_MM_MAX_RANGES)
        nr = KVS_MM_MAX_RANGES;
    j->n_ranges = nr;
    j->ranges = ranges;
    j->chunk = nr > 1 ? (rows / (8 * (int64_t)nr) + 3) & ~(int64_t)3 : rows;
    if (j->chunk < 4)
        j->chunk = 4;
    int64_t per = ((rows + nr - 1) / nr + 3) & ~(int64_t)3;
    for (int i = 0; i < nr; i++) {
        int64_t f = (int64_t)i * per < rows ? (int64_t)i * per : rows;
        int64_t b = f + per < rows ? f + per : rows;
        atomic_init(&ranges[i].fb, ((uint64_t)f << 32) | (uint64_t)b);
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
    struct kvs_mm_range ranges[KVS_MM_MAX_RANGES];
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
        j.n_mats = 1;
        j.mats[0] = W;
        j.ys[0] = y;
        j.off[0] = 0;
        j.off[1] = row_end - row_begin;
        kvs_mm_gemm_setup(&j, pool, scratch, ranges);
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

void kvs_matmul_multi(const struct kvs_kernels *k, struct kvs_pool *pool, int n, const struct kvs_matrix *const W[],
                      const float *x, int64_t n_tok, float *const y[], void *scratch)
{
    assert(k && n >= 1 && W && y);
    /* one dispatch when the matrices share K and a packed activation layout
     * (kvs_mm_gemm_setup checks; e.g. Q4_K q/k with a Q6_K v in Q4_K_M files) */
    bool same = n <= KVS_MM_MAX_MATS && n_tok > 0;
    for (int i = 1; i < n && same; i++)
        same = W[i]->ne0 == W[0]->ne0 && kvs_vec_dot_type(W[i]->type) == kvs_vec_dot_type(W[0]->type);
    if (same) {
        struct kvs_mm_range ranges[KVS_MM_MAX_RANGES];
        struct kvs_mm_job j = {
            .k = k, .W = W[0], .row_begin = 0, .row_end = W[0]->ne1,
            .x = x, .n_tok = n_tok, .y = y[0], .vt = kvs_vec_dot_type(W[0]->type), .n_mats = n,
        };
        for (int i = 0; i < n; i++) {
            j.mats[i] = W[i];
            j.ys[i] = y[i];
            j.off[i + 1] = j.off[i] + W[i]->ne1;
        }
        if (j.vt != KVS_TYPE_F32 && j.vt != KVS_TYPE_COUNT) {
            assert(scratch);
            kvs_mm_gemm_setup(&j, pool, scratch, ranges);
        }
        if (j.gemm) {
            if (n_tok == 1)
                kvs_mm_quant_task(&j, 0, 1);
            else
                kvs_pool_run(pool, kvs_mm_quant_task, &j);
            kvs_pool_run(pool, kvs_mm_dot_task, &j);
            return;
        }
    }
    for (int i = 0; i < n; i++)
        kvs_matmul(k, pool, W[i], x, n_tok, y[i], scratch);
}

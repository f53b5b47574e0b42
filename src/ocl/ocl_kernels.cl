/* Kvasir's OpenCL C kernels (OpenCL C 1.2, no extensions): activation
 * quantization, matrix products over GGUF weight blocks as stored in the
 * file, RMSNorm, RoPE, the F16 KV cache, attention, SwiGLU and MoE routing.
 *
 * Block layouts: ../shared/docs/gguf-facts.md §2.3/§2.4 (byte offsets below);
 * activation quantizers and dot-product structure: §2.5, as the CPU scalar
 * reference (src/kernels/kernels_ref.c) computes them, so results differ
 * from the CPU only in float summation order. Contraction into FMA is off so
 * that products round as on the CPU. Embedded in the binary at build time
 * (scripts/embed.cmake) and built by the device's compiler at load. */
#pragma OPENCL FP_CONTRACT OFF

/* --- helpers ------------------------------------------------------------- */

inline float ld_f16(const __global uchar *p) { return vload_half(0, (const __global half *)p); }

inline float rd_f32(const __global uchar *p) { return *(const __global float *)p; }

inline short rd_i16(const __global uchar *p) { return *(const __global short *)p; }

/* Sums red[0..n) (n a power of two) into red[0]; all items of the group call it. */
inline float group_sum(__local float *red, float v)
{
    const int lid = (int)get_local_id(0), n = (int)get_local_size(0);
    red[lid] = v;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int s = n / 2; s > 0; s >>= 1) {
        if (lid < s) red[lid] += red[lid + s];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    const float r = red[0];
    barrier(CLK_LOCAL_MEM_FENCE);
    return r;
}

/* --- activation quantization (gguf-facts §2.5) ---------------------------- */

/* Q8_0, one block of 32 per work-item: d = amax/127 (F16), q = rne(x·127/amax). */
__kernel void quant_q8_0(const __global float *x, __global uchar *y, const int n_blocks)
{
    const int i = (int)get_global_id(0);
    if (i >= n_blocks) return;
    const __global float *xb = x + (size_t)i * 32;
    __global uchar *yb = y + (size_t)i * 34;
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmax(amax, fabs(xb[j]));
    const float mult = amax != 0.0f ? 127.0f / amax : 0.0f;
    vstore_half_rte(amax / 127.0f, 0, (__global half *)yb);
    for (int j = 0; j < 32; j++) ((__global char *)(yb + 2))[j] = (char)(int)rint(xb[j] * mult);
}

/* Q8_K, one block of 256 per work-item: iscale = -127/max (max: the signed
 * value of largest magnitude), q = min(rne(iscale·x), 127), 16 sums of 16,
 * d = 1/iscale. Layout: float d, int8 qs[256], int16 bsums[16] (292 bytes). */
__kernel void quant_q8_K(const __global float *x, __global uchar *y, const int n_blocks)
{
    const int i = (int)get_global_id(0);
    if (i >= n_blocks) return;
    const __global float *xb = x + (size_t)i * 256;
    __global uchar *yb = y + (size_t)i * 292;
    __global char *qs = (__global char *)(yb + 4);
    __global short *bs = (__global short *)(yb + 260);
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float ax = fabs(xb[j]);
        if (ax > amax) {
            amax = ax;
            mx = xb[j];
        }
    }
    if (amax == 0.0f) {
        *(__global float *)yb = 0.0f;
        for (int j = 0; j < 256; j++) qs[j] = 0;
        for (int k = 0; k < 16; k++) bs[k] = 0;
        return;
    }
    const float iscale = -127.0f / mx;
    for (int k = 0; k < 16; k++) {
        int s = 0;
        for (int j = 16 * k; j < 16 * k + 16; j++) {
            int v = (int)rint(iscale * xb[j]);
            v = v < 127 ? v : 127;
            qs[j] = (char)v;
            s += v;
        }
        bs[k] = (short)s;
    }
    *(__global float *)yb = 1.0f / iscale;
}

/* F16, one value per work-item (round to nearest even). */
__kernel void quant_f16(const __global float *x, __global half *y, const int n)
{
    const int i = (int)get_global_id(0);
    if (i < n) vstore_half_rte(x[i], i, y);
}

/* --- matrix products -----------------------------------------------------
 * y[r·N + n] = dot(weight row n, activation row r / act_div) for r < R, n < N.
 * Global size (N·L, ceil(R / tile)), local (L, 1): one group per output
 * value of `tile` consecutive rows r, done one after the other so that the
 * weight row is read from memory once and from cache for the others
 * (prefill); its items stride over the row's blocks, then a tree sum (the
 * same order for every tile, so results do not depend on it). With ids
 * (use_ids != 0) the weight is expert ids[r]'s slice, expert_stride bytes
 * apart (MoE). Activation rows are already in the weight type's vec_dot
 * format. */
#define MM_HEAD                                                                                               \
    const int n = (int)get_group_id(0), r0 = (int)get_global_id(1) * tile, lid = (int)get_local_id(0);       \
    const int L = (int)get_local_size(0);                                                                     \
    for (int tt = 0; tt < tile; tt++) {                                                                       \
    const int r = min(r0 + tt, R - 1); /* past the end: recomputes row R-1, writes nothing */                \
    const __global uchar *wr = w + (use_ids ? (size_t)ids[r] * expert_stride : (size_t)0) + (size_t)n * row_bytes; \
    const __global uchar *ar = a + (size_t)(r / act_div) * act_row_bytes;                                     \
    float acc = 0.0f;
#define MM_ARGS                                                                                               \
    const __global uchar *w, const ulong row_bytes, const ulong expert_stride, const __global int *ids,       \
        const int use_ids, const __global uchar *a, const ulong act_row_bytes, const int act_div,            \
        __global float *y, const int N, const int nb, __local float *red, const int R, const int tile
#define MM_TAIL                                                                                               \
    acc = group_sum(red, acc);                                                                                \
    if (lid == 0 && r0 + tt < R) y[(size_t)(r0 + tt) * N + n] = acc;                                          \
    }

/* F32 weights, F32 activations; nb = K values. */
__kernel void mm_f32(MM_ARGS)
{
    MM_HEAD
    const __global float *wf = (const __global float *)wr, *af = (const __global float *)ar;
    for (int i = lid; i < nb; i += L) acc += wf[i] * af[i];
    MM_TAIL
}

/* F16 weights, F16 activations; nb = K values. */
__kernel void mm_f16(MM_ARGS)
{
    MM_HEAD
    const __global half *wh = (const __global half *)wr, *ah = (const __global half *)ar;
    for (int i = lid; i < nb; i += L) acc += vload_half(i, wh) * vload_half(i, ah);
    MM_TAIL
}

/* Q8_0 (34 bytes: f16 d, int8 qs[32]) · Q8_0; nb = K/32 blocks. */
__kernel void mm_q8_0(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 34, *q = ar + (size_t)b * 34;
        const __global char *xq = (const __global char *)(x + 2), *qq = (const __global char *)(q + 2);
        int s = 0;
        for (int j = 0; j < 32; j++) s += xq[j] * qq[j];
        acc += (float)s * (ld_f16(x) * ld_f16(q));
    }
    MM_TAIL
}

/* Q4_0 (18 bytes: f16 d, qs[16]: low nibbles elements 0-15, high 16-31, minus 8) · Q8_0. */
__kernel void mm_q4_0(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 18, *q = ar + (size_t)b * 34;
        const __global char *qq = (const __global char *)(q + 2);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            const int v = x[2 + j];
            s += ((v & 0xF) - 8) * qq[j];
            s += ((v >> 4) - 8) * qq[j + 16];
        }
        acc += (float)s * (ld_f16(x) * ld_f16(q));
    }
    MM_TAIL
}

/* Q4_K scale and min of sub-block j (6 bits each, packed in 12 bytes). */
inline void q4k_scale_min(const int j, const __global uchar *b, int *sc, int *mn)
{
    if (j < 4) {
        *sc = b[j] & 63;
        *mn = b[j + 4] & 63;
    } else {
        *sc = (b[j + 4] & 0xF) | ((b[j - 4] >> 6) << 4);
        *mn = (b[j + 4] >> 4) | ((b[j] >> 6) << 4);
    }
}

/* Q4_K (144 bytes: f16 d, f16 dmin, scales[12], qs[128]) · Q8_K; nb = K/256. */
__kernel void mm_q4_K(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 144, *q = ar + (size_t)b * 292;
        const __global uchar *xs = x + 16;
        const __global char *qq = (const __global char *)(q + 4);
        int sa = 0, sm = 0;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            q4k_scale_min(j, x + 4, &sc, &mn);
            /* elements 32j..32j+31: chunk j/2 of 32 bytes, low nibbles for even j */
            const __global uchar *c = xs + 32 * (j / 2);
            const int shift = (j & 1) * 4;
            int t = 0;
            for (int l = 0; l < 32; l++) t += ((c[l] >> shift) & 0xF) * qq[32 * j + l];
            sa += sc * t;
            sm += mn * (rd_i16(q + 260 + 4 * j) + rd_i16(q + 262 + 4 * j));
        }
        const float d8 = rd_f32(q);
        acc += ld_f16(x) * d8 * (float)sa - ld_f16(x + 2) * d8 * (float)sm;
    }
    MM_TAIL
}

/* Q6_K (210 bytes: ql[128], qh[64], int8 scales[16], f16 d) · Q8_K; nb = K/256. */
__kernel void mm_q6_K(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 210, *q = ar + (size_t)b * 292;
        const __global uchar *ql = x, *qh = x + 128;
        const __global char *sc = (const __global char *)(x + 192);
        const __global char *qq = (const __global char *)(q + 4);
        int sa = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++) {
                const int nn = e / 128, rr = e % 128, l = rr % 32, g = rr / 32;
                const int lb = ql[64 * nn + l + 32 * (g & 1)];
                const int low4 = g < 2 ? (lb & 0xF) : (lb >> 4);
                const int high2 = (qh[32 * nn + l] >> (2 * g)) & 3;
                t += ((low4 | high2 << 4) - 32) * qq[e];
            }
            sa += sc[s] * t;
        }
        acc += ld_f16(x + 208) * rd_f32(q) * (float)sa;
    }
    MM_TAIL
}

/* --- the other GGUF types -------------------------------------------------- */

inline uint rd_u32(const __global uchar *p) { return (uint)p[0] | (uint)p[1] << 8 | (uint)p[2] << 16 | (uint)p[3] << 24; }

inline float bf16_f32(ushort h) { return as_float((uint)h << 16); }

/* Q8_1 (36 bytes: f16 d, f16 s = d·Σq, int8 qs[32]), one block per work-item. */
__kernel void quant_q8_1(const __global float *x, __global uchar *y, const int n_blocks)
{
    const int i = (int)get_global_id(0);
    if (i >= n_blocks) return;
    const __global float *xb = x + (size_t)i * 32;
    __global uchar *yb = y + (size_t)i * 36;
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmax(amax, fabs(xb[j]));
    const float mult = amax != 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        const int q = (int)rint(xb[j] * mult);
        ((__global char *)(yb + 4))[j] = (char)q;
        sum += q;
    }
    vstore_half_rte(d, 0, (__global half *)yb);
    vstore_half_rte(d * (float)sum, 1, (__global half *)yb);
}

/* BF16 (round to nearest even, NaN quieted), one value per work-item. */
__kernel void quant_bf16(const __global float *x, __global ushort *y, const int n)
{
    const int i = (int)get_global_id(0);
    if (i >= n) return;
    const uint u = as_uint(x[i]);
    y[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? (ushort)((u >> 16) | 64u) : (ushort)((u + (0x7FFFu + ((u >> 16) & 1u))) >> 16);
}

/* BF16 weights, BF16 activations; nb = K values. */
__kernel void mm_bf16(MM_ARGS)
{
    MM_HEAD
    const __global ushort *wh = (const __global ushort *)wr, *ah = (const __global ushort *)ar;
    for (int i = lid; i < nb; i += L) acc += bf16_f32(wh[i]) * bf16_f32(ah[i]);
    MM_TAIL
}

/* Q4_1 (20 bytes: f16 d, f16 m, qs[16]) · Q8_1. */
__kernel void mm_q4_1(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 20, *q = ar + (size_t)b * 36;
        const __global char *qq = (const __global char *)(q + 4);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            const int v = x[4 + j];
            s += (v & 0xF) * qq[j] + (v >> 4) * qq[j + 16];
        }
        acc += (ld_f16(x) * ld_f16(q)) * (float)s + ld_f16(x + 2) * ld_f16(q + 2);
    }
    MM_TAIL
}

/* Q5_0 (22 bytes: f16 d, qh[4], qs[16]; fifth bits in qh, minus 16) · Q8_0. */
__kernel void mm_q5_0(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 22, *q = ar + (size_t)b * 34;
        const __global char *qq = (const __global char *)(q + 2);
        const uint h = rd_u32(x + 2);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            const int v = x[6 + j];
            const int q0 = ((v & 0xF) | (int)((h >> j) & 1u) << 4) - 16;
            const int q1 = ((v >> 4) | (int)((h >> (j + 16)) & 1u) << 4) - 16;
            s += q0 * qq[j] + q1 * qq[j + 16];
        }
        acc += (float)s * (ld_f16(x) * ld_f16(q));
    }
    MM_TAIL
}

/* Q5_1 (24 bytes: f16 d, f16 m, qh[4], qs[16]) · Q8_1. */
__kernel void mm_q5_1(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 24, *q = ar + (size_t)b * 36;
        const __global char *qq = (const __global char *)(q + 4);
        const uint h = rd_u32(x + 4);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            const int v = x[8 + j];
            const int q0 = (v & 0xF) | (int)((h >> j) & 1u) << 4;
            const int q1 = (v >> 4) | (int)((h >> (j + 16)) & 1u) << 4;
            s += q0 * qq[j] + q1 * qq[j + 16];
        }
        acc += (ld_f16(x) * ld_f16(q)) * (float)s + ld_f16(x + 2) * ld_f16(q + 2);
    }
    MM_TAIL
}

/* 2-bit field of element e of a Q2_K/Q3_K qs[64]. */
inline int q2_bits(const __global uchar *qs, const int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3; }

/* Q2_K (84 bytes: scales[16] (low: scale, high: min), qs[64], f16 d, f16 dmin) · Q8_K. */
__kernel void mm_q2_K(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 84, *q = ar + (size_t)b * 292;
        const __global char *qq = (const __global char *)(q + 4);
        int sa = 0, sm = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++) t += q2_bits(x + 16, e) * qq[e];
            sa += (x[s] & 0xF) * t;
            sm += (x[s] >> 4) * rd_i16(q + 260 + 2 * s);
        }
        const float d8 = rd_f32(q);
        acc += ld_f16(x + 80) * d8 * (float)sa - ld_f16(x + 82) * d8 * (float)sm;
    }
    MM_TAIL
}

/* Q3_K (110 bytes: hmask[32], qs[64], scales[12] (6-bit signed), f16 d) · Q8_K. */
__kernel void mm_q3_K(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 110, *q = ar + (size_t)b * 292;
        const __global uchar *hm = x, *qs = x + 32, *sc = x + 96;
        const __global char *qq = (const __global char *)(q + 4);
        int sa = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++) {
                const int v = q2_bits(qs, e) - (((hm[e % 32] >> (e / 32)) & 1) ? 0 : 4);
                t += v * qq[e];
            }
            const int low4 = s < 8 ? (sc[s] & 0xF) : (sc[s - 8] >> 4);
            const int high2 = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            sa += ((low4 | high2 << 4) - 32) * t;
        }
        acc += ld_f16(x + 108) * rd_f32(q) * (float)sa;
    }
    MM_TAIL
}

/* Q5_K (176 bytes: f16 d, f16 dmin, scales[12], qh[32], qs[128]) · Q8_K. */
__kernel void mm_q5_K(MM_ARGS)
{
    MM_HEAD
    for (int b = lid; b < nb; b += L) {
        const __global uchar *x = wr + (size_t)b * 176, *q = ar + (size_t)b * 292;
        const __global uchar *qh = x + 16, *xs = x + 48;
        const __global char *qq = (const __global char *)(q + 4);
        int sa = 0, sm = 0;
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            q4k_scale_min(j, x + 4, &sc, &mn);
            const __global uchar *c = xs + 32 * (j / 2);
            const int shift = (j & 1) * 4;
            int t = 0;
            for (int l = 0; l < 32; l++) {
                const int e = 32 * j + l;
                t += (((c[l] >> shift) & 0xF) + (((qh[l] >> (e / 32)) & 1) << 4)) * qq[e];
            }
            sa += sc * t;
            sm += mn * (rd_i16(q + 260 + 4 * j) + rd_i16(q + 262 + 4 * j));
        }
        const float d8 = rd_f32(q);
        acc += ld_f16(x) * d8 * (float)sa - ld_f16(x + 2) * d8 * (float)sm;
    }
    MM_TAIL
}

/* --- norms, RoPE, elementwise ----------------------------------------------- */

/* RMSNorm of rows (gguf-facts §4.2): y[r] = x[row]·(1/sqrt(mean(x²) + eps))·w,
 * row = rows ? rows[r] : r; n values per row. Global (R·L), local L. */
__kernel void rmsnorm(const __global float *x, const __global float *w, __global float *y, const int n,
                      const float eps, const __global int *rows, const int use_rows, __local float *red)
{
    const int r = (int)get_group_id(0), lid = (int)get_local_id(0), L = (int)get_local_size(0);
    const int row = use_rows ? rows[r] : r;
    const __global float *xr = x + (size_t)row * n;
    __global float *yr = y + (size_t)r * n;
    float s = 0.0f;
    for (int i = lid; i < n; i += L) s += xr[i] * xr[i];
    s = group_sum(red, s);
    const float mean = s / (float)n;
    const float scale = 1.0f / sqrt(mean + eps);
    for (int i = lid; i < n; i += L) yr[i] = (xr[i] * scale) * w[i];
}

/* RoPE on the first n_rot dims of each head (gguf-facts §4.3) with the
 * host's (cos, sin) table cs[t][n_rot] of the batch's positions. x:
 * [n_tok][n_head][D]; one work-item per (token, head, pair). */
__kernel void rope(__global float *x, const __global float *cs, const int n_head, const int D, const int n_rot,
                   const int neox, const int n_items)
{
    const int it = (int)get_global_id(0);
    if (it >= n_items) return;
    const int half_rot = n_rot / 2;
    const int i = it % half_rot, th = it / half_rot, t = th / n_head;
    __global float *xh = x + (size_t)th * D;
    const float c = cs[(size_t)t * n_rot + 2 * i], s = cs[(size_t)t * n_rot + 2 * i + 1];
    const int i0 = neox ? i : 2 * i, i1 = neox ? i + half_rot : 2 * i + 1;
    const float x0 = xh[i0], x1 = xh[i1];
    xh[i0] = x0 * c - x1 * s;
    xh[i1] = x0 * s + x1 * c;
}

/* Stores the batch's K and V rows (F16, nearest even) at their (seq, pos)
 * in cache slot `slot`: cache [slot][n_seq][n_ctx][kv_dim]. */
__kernel void kv_store(const __global float *k, const __global float *v, __global half *kc, __global half *vc,
                       const __global int *seq, const __global int *pos, const int kv_dim, const int n_ctx,
                       const int n_seq, const int slot, const int n_items)
{
    const int it = (int)get_global_id(0);
    if (it >= n_items) return;
    const int t = it / kv_dim, i = it % kv_dim;
    const size_t off = (((size_t)slot * n_seq + seq[t]) * n_ctx + pos[t]) * kv_dim + i;
    vstore_half_rte(k[it], off, kc);
    vstore_half_rte(v[it], off, vc);
}

/* Attention as the CPU path computes it (src/model/model_attn.c): q rounded
 * to F16, scores q·k (F32) · scale over keys 0..pos, one pass of online
 * softmax with the V accumulator rounded to F16 after every update, divided
 * by the sum of weights. One group of L items per (token, head); item lid
 * owns dims lid, lid + L, ... Local: red[L], acc[D] (half), qh[D] (half). */
__kernel void attention(const __global float *q, const __global half *kc, const __global half *vc,
                        __global float *o, const __global int *seq, const __global int *pos, const int H,
                        const int group, const int D, const int q_dim, const int kv_dim, const int n_ctx,
                        const int n_seq, const int slot, const float scale, __local float *red,
                        __local half *acc, __local half *qh)
{
    const int g = (int)get_group_id(0), lid = (int)get_local_id(0), L = (int)get_local_size(0);
    const int t = g / H, h = g % H, hk = h / group;
    const size_t base = ((size_t)slot * n_seq + seq[t]) * n_ctx * kv_dim + (size_t)hk * D;
    const __global float *qr = q + (size_t)t * q_dim + (size_t)h * D;
    for (int d = lid; d < D; d += L) {
        vstore_half_rte(qr[d], d, qh);
        vstore_half(0.0f, d, acc);
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    float M = -INFINITY, S = 0.0f;
    const int np = pos[t];
    for (int j = 0; j <= np; j++) {
        const __global half *kr = kc + base + (size_t)j * kv_dim;
        const __global half *vr = vc + base + (size_t)j * kv_dim;
        float p = 0.0f;
        for (int d = lid; d < D; d += L) p += vload_half(d, qh) * vload_half(d, kr);
        const float s = group_sum(red, p) * scale;
        float ms = 1.0f, vs = 1.0f;
        if (s > M) {
            const float m_old = M;
            M = s;
            ms = exp(m_old - M);
            for (int d = lid; d < D; d += L) vstore_half_rte(vload_half(d, acc) * ms, d, acc);
        } else {
            vs = exp(s - M);
        }
        for (int d = lid; d < D; d += L) vstore_half_rte(vload_half(d, acc) + vload_half(d, vr) * vs, d, acc);
        S = S * ms + vs;
    }
    const float inv = S > 0.0f ? 1.0f / S : 0.0f;
    __global float *orow = o + (size_t)t * q_dim + (size_t)h * D;
    for (int d = lid; d < D; d += L) orow[d] = vload_half(d, acc) * inv;
}

/* y[i] += x[i], i < n. */
__kernel void add(__global float *y, const __global float *x, const int n)
{
    const int i = (int)get_global_id(0);
    if (i < n) y[i] += x[i];
}

/* y[t][i] += b[i] for rows of n_cols; n = rows·n_cols. */
__kernel void add_bias(__global float *y, const __global float *b, const int n_cols, const int n)
{
    const int i = (int)get_global_id(0);
    if (i < n) y[i] += b[i % n_cols];
}

/* SwiGLU: a[i] = silu(a[i])·b[i], silu(z) = z/(1 + exp(-z)). */
__kernel void swiglu(__global float *a, const __global float *b, const int n)
{
    const int i = (int)get_global_id(0);
    if (i < n) {
        const float z = a[i];
        a[i] = (z / (1.0f + exp(-z))) * b[i];
    }
}

/* MoE routing (gguf-facts §4.6), one work-item per token: softmax over X
 * router logits, top-K by probability (ties: lower index), weights
 * renormalized over the K (clamped below at 6.1035e-5 when clamp != 0). */
__kernel void moe_route(__global float *logits, __global int *sel, __global float *selw, const int X, const int K,
                        const int clamp, const int n_tok)
{
    const int t = (int)get_global_id(0);
    if (t >= n_tok) return;
    __global float *r = logits + (size_t)t * X;
    float mx = -INFINITY;
    for (int e = 0; e < X; e++) mx = r[e] > mx ? r[e] : mx;
    float sum = 0.0f;
    for (int e = 0; e < X; e++) {
        r[e] = exp(r[e] - mx);
        sum += r[e];
    }
    const float inv = 1.0f / sum;
    for (int e = 0; e < X; e++) r[e] *= inv;
    __global int *st = sel + (size_t)t * K;
    __global float *sw = selw + (size_t)t * K;
    for (int s = 0; s < K; s++) {
        int best = -1;
        for (int e = 0; e < X; e++) {
            bool taken = false;
            for (int u = 0; u < s; u++) taken |= st[u] == e;
            if (!taken && (best < 0 || r[e] > r[best])) best = e;
        }
        st[s] = best;
        sw[s] = r[best];
    }
    float wsum = 0.0f;
    for (int s = 0; s < K; s++) wsum += sw[s];
    if (clamp && wsum < 6.1035e-5f) wsum = 6.1035e-5f;
    for (int s = 0; s < K; s++) sw[s] /= wsum;
}

/* o[t][i] = Σ_s ys[t][s][i]·w[t][s] in selection order (each product rounded
 * to float first); one work-item per (t, i). */
__kernel void moe_sum(const __global float *ys, const __global float *w, __global float *o, const int K,
                      const int E, const int n)
{
    const int it = (int)get_global_id(0);
    if (it >= n) return;
    const int t = it / E, i = it % E;
    const __global float *yt = ys + (size_t)t * K * E;
    float acc = yt[i] * w[t * K];
    for (int s = 1; s < K; s++) {
        const float p = yt[(size_t)s * E + i] * w[t * K + s];
        acc += p;
    }
    o[it] = acc;
}

/* --- device measurement (kvasir bench --probe, bench_ocl) ------------------- */

/* Reads n float4 values: each group a contiguous share, its items
 * interleaved within it (coalesced on GPUs, streaming on CPUs); one sum per item. */
__kernel void bw_read(const __global float4 *x, __global float *out, const int n)
{
    const int grp = (int)get_group_id(0), ng = (int)get_num_groups(0);
    const int lid = (int)get_local_id(0), L = (int)get_local_size(0);
    const int per = (n + ng - 1) / ng, i0 = grp * per, i1 = min(n, i0 + per);
    float4 s = (float4)(0.0f);
    for (int i = i0 + lid; i < i1; i += L) s += x[i];
    out[get_global_id(0)] = s.x + s.y + s.z + s.w;
}

/* iters x 8 independent multiply-adds per item (16 FLOPs each). */
__kernel void flops(__global float *out, const int iters)
{
    const int g = (int)get_global_id(0);
    float a0 = g * 1e-7f, a1 = a0 + 1e-7f, a2 = a0 + 2e-7f, a3 = a0 + 3e-7f;
    float a4 = a0 + 4e-7f, a5 = a0 + 5e-7f, a6 = a0 + 6e-7f, a7 = a0 + 7e-7f;
    const float b = 0.999999f, c = 1e-7f;
    for (int it = 0; it < iters; it++) {
        a0 = a0 * b + c; a1 = a1 * b + c; a2 = a2 * b + c; a3 = a3 * b + c;
        a4 = a4 * b + c; a5 = a5 * b + c; a6 = a6 * b + c; a7 = a7 * b + c;
    }
    out[g] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
}

/* --- qwen35 (../shared/docs/qwen35-facts.md §3.2, §3.3, §3.5) ------------- */

/* Causal depthwise conv + SiLU of the GDN mix (§3.2 step 3), one work-item
 * per channel c walking the batch's tokens in order: y = silu(Σ_i wt[i][c]·
 * st[i][c] + wt[K-1][c]·x[c]), then the state shifts by one and keeps x.
 * st: [n_seq][K-1][C] (this block's), wt: [K][C] time-major, x, y: [n_tok][C]. */
__kernel void gdn_conv(__global float *st, const __global float *wt, const __global float *x, __global float *y,
                       const __global int *seq, const int C, const int K, const int n_tok)
{
    const int c = (int)get_global_id(0);
    if (c >= C) return;
    for (int t = 0; t < n_tok; t++) {
        __global float *s = st + (size_t)seq[t] * (size_t)(K - 1) * C;
        const float xc = x[(size_t)t * C + c];
        float acc = 0.0f;
        for (int i = 0; i < K - 1; i++) acc += wt[(size_t)i * C + c] * s[(size_t)i * C + c];
        acc += wt[(size_t)(K - 1) * C + c] * xc;
        y[(size_t)t * C + c] = acc / (1.0f + exp(-acc));
        for (int i = 0; i + 1 < K - 1; i++) s[(size_t)i * C + c] = s[(size_t)(i + 1) * C + c];
        s[(size_t)(K - 2) * C + c] = xc;
    }
}

/* L2 norm of n_items heads of d floats, rows `stride` floats apart, each
 * row holding n_head heads: x / max(||x||, eps) (§3.2 step 5). One
 * work-item per head. */
__kernel void l2norm(__global float *x, const int d, const int n_head, const int stride, const float eps,
                     const int n_items)
{
    const int it = (int)get_global_id(0);
    if (it >= n_items) return;
    __global float *h = x + (size_t)(it / n_head) * stride + (size_t)(it % n_head) * d;
    float s = 0.0f;
    for (int i = 0; i < d; i++) s += h[i] * h[i];
    const float nrm = sqrt(s);
    const float inv = 1.0f / (nrm > eps ? nrm : eps);
    for (int i = 0; i < d; i++) h[i] *= inv;
}

/* GDN gates per (token, value head) (§3.2 step 4): b = sigmoid(b),
 * a = softplus(a + dt)·ssm_a (softplus(x) = x past 20). */
__kernel void gdn_gates(__global float *b, __global float *a, const __global float *dt, const __global float *sa,
                        const int Hv, const int n_items)
{
    const int it = (int)get_global_id(0);
    if (it >= n_items) return;
    const int j = it % Hv;
    b[it] = 1.0f / (1.0f + exp(-b[it]));
    const float x = a[it] + dt[j];
    const float sp = x > 20.0f ? x : log(1.0f + exp(x));
    a[it] = sp * sa[j];
}

/* Gated delta rule (§3.2 step 7), one work-item per state row (value head
 * j, value index r) walking the batch's tokens in order on sequence
 * seq[t]'s state S: [n_seq][Hv][d][d] (S_j[r][i]). Per token, with q, k of
 * key head j mod Hk in u ([n_tok][C]: q heads, k heads, v heads):
 * S_r *= exp(g); delta = beta·(v_r - S_r·k); S_r += k·delta;
 * o[t][j][r] = (S_r·q)·scale. g, beta: [n_tok][Hv]; o: [n_tok][Hv·d]. */
__kernel void gdn_delta(__global float *S, const __global float *u, const __global float *g,
                        const __global float *beta, __global float *o, const __global int *seq, const int d,
                        const int Hk, const int Hv, const float scale, const int n_tok)
{
    const int it = (int)get_global_id(0);
    if (it >= Hv * d) return;
    const int j = it / d, r = it % d, gk = j % Hk;
    const int C = 2 * Hk * d + Hv * d;
    for (int t = 0; t < n_tok; t++) {
        __global float *row = S + ((size_t)seq[t] * Hv + j) * (size_t)d * d + (size_t)r * d;
        const __global float *ut = u + (size_t)t * C;
        const __global float *q = ut + (size_t)gk * d, *k = ut + (size_t)(Hk + gk) * d;
        const float decay = exp(g[(size_t)t * Hv + j]);
        float kv = 0.0f;
        for (int i = 0; i < d; i++) {
            row[i] *= decay;
            kv += row[i] * k[i];
        }
        const float delta = beta[(size_t)t * Hv + j] * (ut[(size_t)(2 * Hk + j) * d + r] - kv);
        float acc = 0.0f;
        for (int i = 0; i < d; i++) {
            row[i] += k[i] * delta;
            acc += row[i] * q[i];
        }
        o[(size_t)t * Hv * d + it] = acc * scale;
    }
}

/* a[i] *= silu(z[i]) (silu != 0) or sigmoid(z[i]) (n floats). */
__kernel void gate_mul(__global float *a, const __global float *z, const int silu, const int n)
{
    const int i = (int)get_global_id(0);
    if (i >= n) return;
    const float s = 1.0f / (1.0f + exp(-z[i]));
    a[i] = silu ? a[i] * (z[i] / (1.0f + exp(-z[i]))) : a[i] * s;
}

/* qwen35 gated attention's query projection [n_tok][H][2·D] (per head D
 * query values, then D gate values) into q and gate [n_tok][H·D]. */
__kernel void split_qg(const __global float *qg, __global float *q, __global float *gate, const int D,
                       const int n)
{
    const int i = (int)get_global_id(0);
    if (i >= n) return;
    const int th = i / D, e = i % D;
    q[i] = qg[(size_t)th * 2 * D + e];
    gate[i] = qg[(size_t)th * 2 * D + D + e];
}

/* Shared expert (§3.5): y[t][i] += sigmoid(g[t])·s[t][i], rows of E. */
__kernel void add_gated(__global float *y, const __global float *s, const __global float *g, const int E,
                        const int n)
{
    const int i = (int)get_global_id(0);
    if (i >= n) return;
    const float gt = 1.0f / (1.0f + exp(-g[i / E]));
    y[i] += gt * s[i];
}

/* AVX-512 (F, BW, VL, DQ, VNNI) table (this file is compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx2 -mfma
 * -mf16c; kvs_kernels_get hands it out only when the CPU has all of them).
 *
 * The shared x86 kernels (kernels_x86_impl.h) compile here with VNNI for
 * their u8 x s8 dot step. Q8_0 and Q4_0 -- the decode-critical types -- get
 * 512-bit versions below that handle two 32-element blocks per register, and
 * a register-blocked GEMM (tiles of 4 rows x 4 tokens over a packed
 * activation layout) that matmul uses for both decode and prefill. */
#include "kernels/arch/x86/kernels_x86_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

/* Two consecutive Q8_0-layout blocks' 32 quants each as one register
 * (block i in the low 256 bits). */
static inline __m512i kvs_avx512_load2(const int8_t *q0, const int8_t *q1)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)q0)),
                              _mm256_loadu_si256((const __m256i *)q1), 1);
}

static inline __m512i kvs_avx512_unpack2_q4_0(const uint8_t *q0, const uint8_t *q1)
{
    __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(kvs_x86_unpack_q4_0(q0)), kvs_x86_unpack_q4_0(q1), 1);
    return v;
}

/* Signed s8 x s8 dot of 4-byte groups (see kvs_x86_dot_s8 for the bounds). */
static inline __m512i kvs_avx512_dot_s8(__m512i w, __m512i a)
{
    __mmask64 neg = _mm512_movepi8_mask(w);
    __m512i aw = _mm512_abs_epi8(w);
    __m512i sa = _mm512_mask_sub_epi8(a, neg, _mm512_setzero_si512(), a);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sa);
}

static inline __m512 kvs_avx512_scale2(float d0, float d1)
{
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1), 1);
}

#define KVS_AVX512_DOT_LEGACY(NAME, WBLOCK, UNPACK2, UNPACK1)                                        \
    static float NAME(int64_t n, const void *w, const void *a)                                       \
    {                                                                                                \
        const WBLOCK *x = w;                                                                         \
        const kvs_block_q8_0 *y = a;                                                                 \
        __m512 acc = _mm512_setzero_ps();                                                            \
        int64_t nb = n / KVS_QK, i = 0;                                                              \
        for (; i + 1 < nb; i += 2) {                                                                 \
            __m512i p = kvs_avx512_dot_s8(UNPACK2, kvs_avx512_load2(y[i].qs, y[i + 1].qs));          \
            __m512 d = kvs_avx512_scale2(KVS_F16(x[i].d) * KVS_F16(y[i].d),                          \
                                         KVS_F16(x[i + 1].d) * KVS_F16(y[i + 1].d));                 \
            acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc);                                    \
        }                                                                                            \
        float s = _mm512_reduce_add_ps(acc);                                                         \
        for (; i < nb; i++) {                                                                        \
            __m256i p = kvs_x86_dot_s8(UNPACK1, _mm256_loadu_si256((const __m256i *)y[i].qs));       \
            s += kvs_x86_hsum_ps(_mm256_mul_ps(_mm256_set1_ps(KVS_F16(x[i].d) * KVS_F16(y[i].d)),   \
                                               _mm256_cvtepi32_ps(p)));                              \
        }                                                                                            \
        return s;                                                                                    \
    }

KVS_AVX512_DOT_LEGACY(kvs_avx512_dot_q8_0, kvs_block_q8_0, kvs_avx512_load2(x[i].qs, x[i + 1].qs),
                      _mm256_loadu_si256((const __m256i *)x[i].qs))
KVS_AVX512_DOT_LEGACY(kvs_avx512_dot_q4_0, kvs_block_q4_0, kvs_avx512_unpack2_q4_0(x[i].qs, x[i + 1].qs),
                      kvs_x86_unpack_q4_0(x[i].qs))

/* One weight row against 4 activation rows, two blocks per register: the
 * weight pair is loaded, unpacked and sign-split once for 4 tokens. */
#define KVS_AVX512_DOT4_LEGACY(NAME, WBLOCK, UNPACK2, SINGLE)                                        \
    static void NAME(int64_t n, const void *w, const void *a, size_t a_stride, float out[4])        \
    {                                                                                                \
        const WBLOCK *x = w;                                                                         \
        const kvs_block_q8_0 *y[4];                                                                  \
        for (int t = 0; t < 4; t++)                                                                  \
            y[t] = (const kvs_block_q8_0 *)((const char *)a + (size_t)t * a_stride);                 \
        __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),             \
                         _mm512_setzero_ps()};                                                       \
        int64_t nb = n / KVS_QK, i = 0;                                                              \
        for (; i + 1 < nb; i += 2) {                                                                 \
            __m512i qw = UNPACK2;                                                                    \
            __mmask64 neg = _mm512_movepi8_mask(qw);                                                 \
            __m512i aw = _mm512_abs_epi8(qw);                                                        \
            float d0 = KVS_F16(x[i].d), d1 = KVS_F16(x[i + 1].d);                                    \
            for (int t = 0; t < 4; t++) {                                                            \
                __m512i qa = kvs_avx512_load2(y[t][i].qs, y[t][i + 1].qs);                           \
                qa = _mm512_mask_sub_epi8(qa, neg, _mm512_setzero_si512(), qa);                      \
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, qa);                     \
                __m512 d = kvs_avx512_scale2(d0 * KVS_F16(y[t][i].d), d1 * KVS_F16(y[t][i + 1].d));  \
                acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(p), acc[t]);                          \
            }                                                                                        \
        }                                                                                            \
        for (int t = 0; t < 4; t++)                                                                  \
            out[t] = _mm512_reduce_add_ps(acc[t]);                                                   \
        if (i < nb) {                                                                                \
            for (int t = 0; t < 4; t++)                                                              \
                out[t] += SINGLE(KVS_QK, x + i, y[t] + i);                                           \
        }                                                                                            \
    }

KVS_AVX512_DOT4_LEGACY(kvs_avx512_dot4_q8_0, kvs_block_q8_0, kvs_avx512_load2(x[i].qs, x[i + 1].qs),
                       kvs_x86_dot_q8_0)
KVS_AVX512_DOT4_LEGACY(kvs_avx512_dot4_q4_0, kvs_block_q4_0, kvs_avx512_unpack2_q4_0(x[i].qs, x[i + 1].qs),
                       kvs_x86_dot_q4_0)

/* --- register-blocked GEMM for Q8_0 / Q4_0 weights ------------------------
 *
 * Packed activation layout (kvs_kernels_pack_row_bytes): per quad of four
 * 32-element Q8_0 blocks, KVS_PACK_QUAD_BYTES = 256 bytes:
 *   qa[64]   quants 0-15 of blocks 0..3 (128-bit lane k = block k),
 *   qb[64]   quants 16-31 of blocks 0..3,
 *   nc[16]   int32 corrections, lane l belongs to block l / 4,
 *   d[16]    float scales, d[l] = the f16 scale of block l / 4.
 * A quad short of blocks (the row end) has zero quants, corrections and
 * scales in the missing blocks' lanes.
 *
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are made
 * unsigned: Q8_0 w + 128 (w ^ 0x80), Q4_0 the raw nibble q = w + 8. Then
 * sum (w + c) a = sum w a + c sum a; the correction -c * (sum of the 8
 * activation quants lane l sees in qa and qb) is precomputed at packing time
 * and is the accumulator the two vpdpbusd (qa, qb) start from. The weights
 * are loaded in the same order (Q8_0: bytes 0-15 / 16-31 of each block; Q4_0:
 * low / high nibbles), so each lane sums 8 products of one block, and a
 * (row, token, quad) of 128 products costs 2 vpdpbusd, one conversion, one
 * multiply and one FMA; each weight quad is loaded and unpacked once per
 * tile of tokens. */

#ifndef KVS_GEMM_PREFETCH
#define KVS_GEMM_PREFETCH 512 /* bytes ahead in each weight row; 0: none */
#endif
#ifndef KVS_GEMM_PREFETCH_L2
#define KVS_GEMM_PREFETCH_L2 8192 /* a second, farther prefetch into L2; 0: none */
#endif
#ifndef KVS_GEMM_MAX_R
#define KVS_GEMM_MAX_R 4
#endif
#ifndef KVS_GEMM_MAX_T
#define KVS_GEMM_MAX_T 4
#endif

/* Two 64-byte vectors of 4 blocks' 32 quants each, X = blocks 0-1, Y = 2-3,
 * regrouped into bytes 0-15 (lo) and 16-31 (hi) of each block. */
static inline void kvs_avx512_split_quad(__m512i X, __m512i Y, __m512i *lo, __m512i *hi)
{
    const __m512i ilo = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13);
    const __m512i ihi = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    *lo = _mm512_permutex2var_epi64(X, ilo, Y);
    *hi = _mm512_permutex2var_epi64(X, ihi, Y);
}

static inline void kvs_avx512_pack_q8(const float *src, void *dst, int64_t n, int shift)
{
    char *out = dst;
    const int64_t nb = n / KVS_QK;
    const __m512i ones = _mm512_set1_epi8(1);
    for (int64_t q = 0; q < (nb + 3) / 4; q++, out += KVS_PACK_QUAD_BYTES) {
        kvs_block_q8_0 b[4];
        const int64_t nbq = nb - 4 * q < 4 ? nb - 4 * q : 4;
        kvs_x86_quant_q8_0(src + 4 * KVS_QK * q, b, KVS_QK * nbq);
        for (int64_t i = nbq; i < 4; i++)
            memset(&b[i], 0, sizeof b[i]);
        __m512i lo, hi;
        kvs_avx512_split_quad(kvs_avx512_load2(b[0].qs, b[1].qs), kvs_avx512_load2(b[2].qs, b[3].qs), &lo, &hi);
        __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, lo), ones, hi);
        __m512i nc = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sll_epi32(s, _mm_cvtsi32_si128(shift)));
        float d[16];
        for (int l = 0; l < 16; l++)
            d[l] = KVS_F16(b[l / 4].d);
        _mm512_storeu_si512(out, lo);
        _mm512_storeu_si512(out + 64, hi);
        _mm512_storeu_si512(out + 128, nc);
        _mm512_storeu_ps(out + 192, _mm512_loadu_ps(d));
    }
}

static void kvs_avx512_pack_q8_0(const float *src, void *dst, int64_t n)
{
    kvs_avx512_pack_q8(src, dst, n, 7); /* c = 128 */
}

static void kvs_avx512_pack_q4_0(const float *src, void *dst, int64_t n)
{
    kvs_avx512_pack_q8(src, dst, n, 3); /* c = 8 */
}

/* One weight quad at b (nblk of its 4 blocks present, compile-time) as
 * unsigned quants in the packed order and per-lane float scales. */
static inline __attribute__((always_inline)) void kvs_avx512_wquad(int q4, int nblk, const char *b, __m512i *wlo,
                                                                   __m512i *whi, __m512 *wd)
{
    if (q4) {
        const kvs_block_q4_0 *x = (const kvs_block_q4_0 *)b;
        __m128i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = i < nblk ? _mm_loadu_si128((const __m128i *)x[i].qs) : _mm_setzero_si128();
        __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_castsi128_si256(q[0]), q[1], 1)),
            _mm256_inserti128_si256(_mm256_castsi128_si256(q[2]), q[3], 1), 1);
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        *wlo = _mm512_and_si512(v, m4);
        *whi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (nblk == 4) {
            /* the scales are words 0, 9, 18 and 27 of the quad's first 64 bytes */
            const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 27, 27, 27, 27,
                                                 18, 18, 18, 18, 9, 9, 9, 9, 0, 0, 0, 0);
            *wd = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, _mm512_loadu_si512(b))));
            return;
        }
    } else {
        const kvs_block_q8_0 *x = (const kvs_block_q8_0 *)b;
        __m256i q[4];
        for (int i = 0; i < 4; i++)
            q[i] = i < nblk ? _mm256_loadu_si256((const __m256i *)x[i].qs) : _mm256_setzero_si256();
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        __m512i lo, hi;
        kvs_avx512_split_quad(_mm512_inserti64x4(_mm512_castsi256_si512(q[0]), q[1], 1),
                              _mm512_inserti64x4(_mm512_castsi256_si512(q[2]), q[3], 1), &lo, &hi);
        *wlo = _mm512_xor_si512(lo, x80);
        *whi = _mm512_xor_si512(hi, x80);
        if (nblk == 4) {
            /* the scales are words 0 and 17 of blocks 0 and 2's first 64 bytes */
            const __m512i idx = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 49, 49, 49, 49,
                                                 32, 32, 32, 32, 17, 17, 17, 17, 0, 0, 0, 0);
            __m512i dd = _mm512_permutex2var_epi16(_mm512_loadu_si512(b), idx, _mm512_loadu_si512(x + 2));
            *wd = _mm512_cvtph_ps(_mm512_castsi512_si256(dd));
            return;
        }
    }
    /* a short quad (row end): scales one by one, zero for missing blocks
     * (their activation lanes are zero too) */
    float d[16];
    for (int l = 0; l < 16; l++)
        d[l] = l / 4 < nblk ? (q4 ? KVS_F16(((const kvs_block_q4_0 *)b)[l / 4].d)
                                  : KVS_F16(((const kvs_block_q8_0 *)b)[l / 4].d))
                            : 0.0f;
    *wd = _mm512_loadu_ps(d);
}

/* acc[r][t] += quad of weight row r times packed activation row t. */
static inline __attribute__((always_inline)) void kvs_avx512_gemm_quad(int q4, int nblk, int R, int T,
                                                                       const char *w, size_t w_stride,
                                                                       const char *aq, size_t a_stride,
                                                                       __m512 acc[KVS_GEMM_MAX_R][KVS_GEMM_MAX_T])
{
    __m512i wlo[KVS_GEMM_MAX_R], whi[KVS_GEMM_MAX_R];
    __m512 wd[KVS_GEMM_MAX_R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const char *wr = w + (size_t)r * w_stride;
#if KVS_GEMM_PREFETCH > 0
        /* weights stream from memory once (decode: bandwidth-bound) */
        _mm_prefetch(wr + KVS_GEMM_PREFETCH, _MM_HINT_T0);
        _mm_prefetch(wr + KVS_GEMM_PREFETCH + 64, _MM_HINT_T0);
#endif
#if KVS_GEMM_PREFETCH_L2 > 0
        _mm_prefetch(wr + KVS_GEMM_PREFETCH_L2, _MM_HINT_T1);
        _mm_prefetch(wr + KVS_GEMM_PREFETCH_L2 + 64, _MM_HINT_T1);
#endif
        kvs_avx512_wquad(q4, nblk, wr, &wlo[r], &whi[r], &wd[r]);
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) {
        const char *at = aq + (size_t)t * a_stride;
        const __m512i alo = _mm512_loadu_si512(at), ahi = _mm512_loadu_si512(at + 64);
        const __m512 ad = _mm512_loadu_ps((const float *)(at + 192));
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(at + 128), wlo[r], alo);
            s = _mm512_dpbusd_epi32(s, whi[r], ahi);
            acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), ad), wd[r], acc[r][t]);
        }
    }
}

/* R weight rows x T packed activation rows (R, T compile-time after
 * inlining). */
static inline __attribute__((always_inline)) void kvs_avx512_gemm_tile(int q4, int R, int T, int64_t nb,
                                                                       const char *w, size_t w_stride,
                                                                       const char *a, size_t a_stride,
                                                                       float *y, size_t y_stride)
{
    const size_t quad = q4 ? 4 * sizeof(kvs_block_q4_0) : 4 * sizeof(kvs_block_q8_0);
    __m512 acc[KVS_GEMM_MAX_R][KVS_GEMM_MAX_T];
#pragma GCC unroll 8
    for (int r = 0; r < KVS_GEMM_MAX_R; r++)
#pragma GCC unroll 8
        for (int t = 0; t < KVS_GEMM_MAX_T; t++)
            acc[r][t] = _mm512_setzero_ps();
    const int64_t nq = nb / 4;
    for (int64_t q = 0; q < nq; q++)
        kvs_avx512_gemm_quad(q4, 4, R, T, w + (size_t)q * quad, w_stride, a + (size_t)q * KVS_PACK_QUAD_BYTES,
                             a_stride, acc);
    const char *wt = w + (size_t)nq * quad, *at = a + (size_t)nq * KVS_PACK_QUAD_BYTES;
    switch (nb & 3) {
    case 1: kvs_avx512_gemm_quad(q4, 1, R, T, wt, w_stride, at, a_stride, acc); break;
    case 2: kvs_avx512_gemm_quad(q4, 2, R, T, wt, w_stride, at, a_stride, acc); break;
    case 3: kvs_avx512_gemm_quad(q4, 3, R, T, wt, w_stride, at, a_stride, acc); break;
    default: break;
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
            y[(size_t)t * y_stride + (size_t)r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* All tokens for R weight rows: full tiles of KVS_GEMM_MAX_T tokens, then
 * one partial tile. */
#define KVS_GEMM_T_CASE(T)                                                                           \
    case T:                                                                                          \
        if (T < KVS_GEMM_MAX_T)                                                                      \
            kvs_avx512_gemm_tile(q4, R, T < KVS_GEMM_MAX_T ? T : 1, nb, w, w_stride, at, a_stride, yt, \
                                 y_stride);                                                          \
        break;
static inline __attribute__((always_inline)) void kvs_avx512_gemm_rows(int q4, int R, int64_t nb, const char *w,
                                                                       size_t w_stride, const char *a,
                                                                       size_t a_stride, int64_t nt, float *y,
                                                                       size_t y_stride)
{
    int64_t t = 0;
    for (; t + KVS_GEMM_MAX_T <= nt; t += KVS_GEMM_MAX_T)
        kvs_avx512_gemm_tile(q4, R, KVS_GEMM_MAX_T, nb, w, w_stride, a + (size_t)t * a_stride, a_stride,
                             y + (size_t)t * y_stride, y_stride);
    const char *at = a + (size_t)t * a_stride;
    float *yt = y + (size_t)t * y_stride;
    switch (nt - t) {
        KVS_GEMM_T_CASE(1)
        KVS_GEMM_T_CASE(2)
        KVS_GEMM_T_CASE(3)
        KVS_GEMM_T_CASE(4)
        KVS_GEMM_T_CASE(5)
        KVS_GEMM_T_CASE(6)
        KVS_GEMM_T_CASE(7)
    default: break;
    }
}

#define KVS_GEMM_R_CASE(R)                                                                           \
    case R:                                                                                          \
        if (R < KVS_GEMM_MAX_R)                                                                      \
            kvs_avx512_gemm_rows(q4, R < KVS_GEMM_MAX_R ? R : 1, nb, wr, w_stride, a, a_stride, nt,   \
                                 y + r, y_stride);                                                   \
        break;
static inline __attribute__((always_inline)) void kvs_avx512_gemm(int q4, int64_t n, const void *w,
                                                                  size_t w_stride, int64_t nr, const void *a,
                                                                  size_t a_stride, int64_t nt, float *y,
                                                                  size_t y_stride)
{
    const int64_t nb = n / KVS_QK;
    int64_t r = 0;
    for (; r + KVS_GEMM_MAX_R <= nr; r += KVS_GEMM_MAX_R)
        kvs_avx512_gemm_rows(q4, KVS_GEMM_MAX_R, nb, (const char *)w + (size_t)r * w_stride, w_stride, a,
                             a_stride, nt, y + r, y_stride);
    const char *wr = (const char *)w + (size_t)r * w_stride;
    switch (nr - r) {
        KVS_GEMM_R_CASE(1)
        KVS_GEMM_R_CASE(2)
        KVS_GEMM_R_CASE(3)
        KVS_GEMM_R_CASE(4)
        KVS_GEMM_R_CASE(5)
        KVS_GEMM_R_CASE(6)
        KVS_GEMM_R_CASE(7)
    default: break;
    }
}

static void kvs_avx512_gemm_q8_0(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a,
                                 size_t a_stride, int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_gemm(0, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_avx512_gemm_q4_0(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a,
                                 size_t a_stride, int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_gemm(1, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

/* --- GEMM over packed Q8_0 weights (kvs_matrix_pack) ----------------------
 *
 * A group of 4 rows is one contiguous, 64-byte aligned stream: each quad's
 * quants are already unsigned and in the activation layout's lo/hi order
 * (two aligned loads per row, no permutes), its 16 scales (4 rows x 4
 * blocks) one 32-byte load and one conversion. Same integer sums and float
 * operations, in the same order, as kvs_avx512_gemm: results are equal bit
 * for bit. */

#ifndef KVS_GEMMP_PREFETCH
#define KVS_GEMMP_PREFETCH 2048 /* bytes ahead in the group's stream; 0: none */
#endif
#ifndef KVS_GEMMP_PREFETCH_L2
#define KVS_GEMMP_PREFETCH_L2 8192 /* bytes ahead into L2; 0: none */
#endif
#ifndef KVS_GEMMP_PREFETCH_L2_STEP
#define KVS_GEMMP_PREFETCH_L2_STEP 1 /* lines per L2 prefetch */
#endif

static inline __attribute__((always_inline)) void kvs_avx512_gemmp_tile(int T, int64_t nq, const char *g,
                                                                        const char *a, size_t a_stride,
                                                                        float *y, size_t y_stride, int nrv)
{
    __m512 acc[KVS_PACKW_ROWS][KVS_GEMM_MAX_T];
#pragma GCC unroll 8
    for (int r = 0; r < KVS_PACKW_ROWS; r++)
#pragma GCC unroll 8
        for (int t = 0; t < KVS_GEMM_MAX_T; t++)
            acc[r][t] = _mm512_setzero_ps();
    const __m512i sidx0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (int64_t q = 0; q < nq; q++) {
        const char *pair = g + (size_t)(q >> 1) * KVS_PACKW_PAIR_BYTES;
        const char *qq = pair + (size_t)(q & 1) * KVS_PACKW_QUAD_QBYTES;
#if KVS_GEMMP_PREFETCH > 0
        {
            const char *pf = pair + (size_t)(q & 1) * (KVS_PACKW_PAIR_BYTES / 2) + KVS_GEMMP_PREFETCH;
#pragma GCC unroll 9
            for (int i = 0; i < 9; i++)
                _mm_prefetch(pf + 64 * i, _MM_HINT_T0);
        }
#endif
#if KVS_GEMMP_PREFETCH_L2 > 0
        {
            const char *pf = pair + (size_t)(q & 1) * (KVS_PACKW_PAIR_BYTES / 2) + KVS_GEMMP_PREFETCH_L2;
#pragma GCC unroll 9
            for (int i = 0; i < 9; i += KVS_GEMMP_PREFETCH_L2_STEP)
                _mm_prefetch(pf + 64 * i, _MM_HINT_T1);
        }
#endif
        const __m512 sc = _mm512_cvtph_ps(
            _mm256_load_si256((const __m256i *)(pair + 2 * KVS_PACKW_QUAD_QBYTES + (size_t)(q & 1) * 32)));
        __m512i wlo[KVS_PACKW_ROWS], whi[KVS_PACKW_ROWS];
        __m512 wd[KVS_PACKW_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < KVS_PACKW_ROWS; r++) {
            wlo[r] = _mm512_load_si512(qq + 128 * r);
            whi[r] = _mm512_load_si512(qq + 128 * r + 64);
            wd[r] = _mm512_permutexvar_ps(_mm512_add_epi32(sidx0, _mm512_set1_epi32(4 * r)), sc);
        }
        const char *aq = a + (size_t)q * KVS_PACK_QUAD_BYTES;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const char *at = aq + (size_t)t * a_stride;
            const __m512i alo = _mm512_loadu_si512(at), ahi = _mm512_loadu_si512(at + 64);
            const __m512 ad = _mm512_loadu_ps((const float *)(at + 192));
#pragma GCC unroll 8
            for (int r = 0; r < KVS_PACKW_ROWS; r++) {
                __m512i s = _mm512_dpbusd_epi32(_mm512_loadu_si512(at + 128), wlo[r], alo);
                s = _mm512_dpbusd_epi32(s, whi[r], ahi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), ad), wd[r], acc[r][t]);
            }
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++)
        for (int r = 0; r < nrv; r++)
            y[(size_t)t * y_stride + (size_t)r] = _mm512_reduce_add_ps(acc[r][t]);
}

static void kvs_avx512_gemm_packed_q8_0(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a,
                                        size_t a_stride, int64_t nt, float *y, size_t y_stride)
{
    const int64_t nq = (n / KVS_QK + 3) / 4;
    for (int64_t r = 0; r < nr; r += KVS_PACKW_ROWS) {
        const char *g = (const char *)w + (size_t)(r / KVS_PACKW_ROWS) * w_stride;
        const int nrv = nr - r < KVS_PACKW_ROWS ? (int)(nr - r) : KVS_PACKW_ROWS;
        int64_t t = 0;
        for (; t + KVS_GEMM_MAX_T <= nt; t += KVS_GEMM_MAX_T)
            kvs_avx512_gemmp_tile(KVS_GEMM_MAX_T, nq, g, (const char *)a + (size_t)t * a_stride, a_stride,
                                  y + (size_t)t * y_stride + r, y_stride, nrv);
        const char *at = (const char *)a + (size_t)t * a_stride;
        float *yt = y + (size_t)t * y_stride + r;
        switch (nt - t) {
        case 1: kvs_avx512_gemmp_tile(1, nq, g, at, a_stride, yt, y_stride, nrv); break;
        case 2: kvs_avx512_gemmp_tile(2, nq, g, at, a_stride, yt, y_stride, nrv); break;
        case 3: kvs_avx512_gemmp_tile(3, nq, g, at, a_stride, yt, y_stride, nrv); break;
        default: break;
        }
    }
}

/* --- F16 vector updates ------------------------------------------------------ */

/* F16 x F16 dot (attention scores against the F16 K cache) summed as
 * llama.cpp's CPU flash attention does on AVX-512 (ggml's F16 dot): four
 * 16-lane FMA accumulators over 64-element steps, folded 0+2, 1+3, 0+1,
 * then a horizontal add; the n mod 64 tail in double. */
static float kvs_avx512_dot_f16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    const int64_t np = n & ~(int64_t)63;
    double s = 0.0;
    if (np) {
        __m512 acc[4] = { _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps() };
        for (int64_t i = 0; i < np; i += 64)
            for (int j = 0; j < 4; j++)
                acc[j] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i + 16 * j))),
                                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(y + i + 16 * j))), acc[j]);
        s = (double)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3])));
    }
    for (int64_t i = np; i < n; i++)
        s += (double)(KVS_F16(x[i]) * KVS_F16(y[i]));
    return (float)s;
}

/* Prompt GEMM dot for F16 weights (llama.cpp's tinyBLAS on AVX-512): one
 * 16-lane FMA accumulator over the row, then a horizontal add (the same
 * _mm512_reduce_add_ps), in F32; n not a multiple of 16: the vec_dot. */
static float kvs_avx512_dot_gemm_f16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    if (n % 16)
        return kvs_avx512_dot_f16(n, w, a);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
        acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))),
                              _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(y + i))), acc);
    return _mm512_reduce_add_ps(acc);
}

/* 16 BF16 values widened to F32 (exact). */
static inline __m512 kvs_avx512_bf16x16(const uint16_t *p)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* BF16 dot as ggml's BF16 vec_dot on AVX-512 without AVX512-BF16: two
 * 16-lane accumulators over 32-element steps (each product added with one
 * rounding: the multiply-add a GCC build contracts to FMA), each reduced
 * (_mm512_reduce_add_ps) and the two added in double, then the n mod 32
 * tail in double. */
static float kvs_avx512_dot_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    __m512 c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        c1 = _mm512_fmadd_ps(kvs_avx512_bf16x16(x + i), kvs_avx512_bf16x16(y + i), c1);
        c2 = _mm512_fmadd_ps(kvs_avx512_bf16x16(x + i + 16), kvs_avx512_bf16x16(y + i + 16), c2);
    }
    double s = (double)_mm512_reduce_add_ps(c1);
    s += (double)_mm512_reduce_add_ps(c2);
    for (; i < n; i++)
        s += (double)(kvs_bf16_to_f32(x[i]) * kvs_bf16_to_f32(y[i]));
    return (float)s;
}

/* Prompt GEMM dot for BF16 weights without AVX512-BF16 (tinyBLAS): one
 * 16-lane FMA accumulator, then _mm512_reduce_add_ps; n % 16: the vec_dot. */
static float kvs_avx512_dot_gemm_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    if (n % 16)
        return kvs_avx512_dot_bf16(n, w, a);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16)
        acc = _mm512_fmadd_ps(kvs_avx512_bf16x16(x + i), kvs_avx512_bf16x16(y + i), acc);
    return _mm512_reduce_add_ps(acc);
}

/* With AVX512-BF16 (CPUs that have it get the table below), ggml sums BF16
 * with its dot-product instruction VDPBF16PS: per F32 lane j, acc + x[2j+1]
 * y[2j+1] then + x[2j] y[2j], each product exact, each addition rounded to
 * nearest even, denormal inputs and results flushed to zero. vec_dot: two
 * accumulators over 64-element steps, each reduced and the two added in
 * double, the n mod 64 tail in double; the prompt GEMM (tinyBLAS): one
 * accumulator over 32-element steps, reduced in F32 (n % 32: the vec_dot).
 * The functions carry the target attribute so that the file needs no
 * -mavx512bf16. */
#define KVS_AVX512BF16 __attribute__((target("avx512bf16,avx512f")))

KVS_AVX512BF16 static inline __m512 kvs_avx512_dpbf16(__m512 acc, const uint16_t *x, const uint16_t *y)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)x), (__m512bh)_mm512_loadu_si512((const void *)y));
}

KVS_AVX512BF16 static float kvs_avx512bf16_dot_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    __m512 c1 = _mm512_setzero_ps(), c2 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
        c1 = kvs_avx512_dpbf16(c1, x + i, y + i);
        c2 = kvs_avx512_dpbf16(c2, x + i + 32, y + i + 32);
    }
    double s = (double)_mm512_reduce_add_ps(c1);
    s += (double)_mm512_reduce_add_ps(c2);
    for (; i < n; i++)
        s += (double)(kvs_bf16_to_f32(x[i]) * kvs_bf16_to_f32(y[i]));
    return (float)s;
}

KVS_AVX512BF16 static float kvs_avx512bf16_dot_gemm_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    if (n % 32)
        return kvs_avx512bf16_dot_bf16(n, w, a);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32)
        acc = kvs_avx512_dpbf16(acc, x + i, y + i);
    return _mm512_reduce_add_ps(acc);
}

/* F32 -> F16 rows (round to nearest even), as kvs_ref_quant_f16. */
static void kvs_avx512_quant_f16(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(d + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n)
        kvs_ref_quant_f16(src + i, d + i, n - i);
}

static void kvs_avx512_f16_scale(uint16_t *y, float s, int64_t n)
{
    const __m512 vs = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(y + i))), vs);
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    if (i < n)
        kvs_ref_f16_scale(y + i, s, n - i);
}

/* y + x * s: in 64-element steps with one rounding (FMA), the n mod 64
 * tail with one rounding for the product and one for the sum, as ggml's
 * F16 mad on AVX-512 (llama.cpp's flash-attention V accumulator). */
static void kvs_avx512_f16_mad(uint16_t *y, const uint16_t *x, float s, int64_t n)
{
    const __m512 vs = _mm512_set1_ps(s);
    const int64_t np = n & ~(int64_t)63;
    for (int64_t i = 0; i < np; i += 16) {
        __m512 v = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + i))), vs,
                                   _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(y + i))));
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    if (np < n)
        kvs_ref_f16_mad(y + np, x + np, s, n - np);
}

/* One token's outputs y[0, nr) of rows W (stride w_stride) through a 4-row
 * decode GEMV(type, R, nb, rows, w_stride, act, y): tiles of 4 rows, then the
 * 1-3 rows left, each with R a constant (its own specialisation of the
 * always-inline GEMV). */
#define KVS_AVX512_ROW_TILES(GEMV, type, nb, W, w_stride, act, y, nr)                                         \
    do {                                                                                                       \
        int64_t r_ = 0;                                                                                        \
        for (; r_ + 4 <= (nr); r_ += 4)                                                                        \
            GEMV(type, 4, nb, (W) + (size_t)r_ * (w_stride), w_stride, act, (y) + r_);                         \
        const char *wr_ = (W) + (size_t)r_ * (w_stride);                                                       \
        switch ((nr) - r_) {                                                                                   \
        case 1: GEMV(type, 1, nb, wr_, w_stride, act, (y) + r_); break;                                        \
        case 2: GEMV(type, 2, nb, wr_, w_stride, act, (y) + r_); break;                                        \
        case 3: GEMV(type, 3, nb, wr_, w_stride, act, (y) + r_); break;                                        \
        default: break;                                                                                        \
        }                                                                                                      \
    } while (0)

/* --- Q4_K / Q5_K / Q6_K decode (one token) -------------------------------
 *
 * A tile of R <= 4 weight rows against the one packed activation row
 * (KVS_PACKK layout): per super-block the activation's 256 quants are loaded
 * once for all R rows as 4 registers of 64 (chunk c: elements 64c..64c+63).
 * Per row and chunk one register of 64 unsigned quants is unpacked:
 * - Q4_K/Q5_K: chunk c is the low then the high nibbles of the row's 32
 *   quant bytes c (sub-blocks 2c and 2c + 1); the bytes are broadcast to
 *   both halves and shifted by 0 / 4 (one variable shift and one AND), the
 *   Q5_K fifth bits come from one byte test of qh;
 * - Q6_K: chunk 2h + p is the low (p = 0) or high (p = 1) nibbles of the
 *   64 bytes ql[64h..64h+63] with bits 4-5 from qh[32h..32h+31] (both
 *   halves), bits 0-1 / 2-3 (p = 0) or 4-5 / 6-7 (p = 1) as the scalar
 *   unpacks them: v = q + 32 in 0..63.
 * Then one maddubs (u8 x s8 pairs -> int16, |pair| <= 2 * 63 * 128) and one
 * vpdpwssd with the sub-block scales (Q4_K/Q5_K: one in-lane shuffle of the
 * row's 8 scales; Q6_K: one word permute of its 16) accumulate into int32.
 * The per-row reductions, the mins (sum mn_j * pair sum_j) or the Q6_K
 * offset (32 * sum scale_s * bsums_s) and the float combine run once per
 * super-block for the R rows together in 128-bit lanes; each lane computes
 * exactly sum += d * d_y * sa - dmin * d_y * sm (Q6_K: sum += d * d_y * sa)
 * in the scalar order, so results equal kvs_x86_dot_q4_K / _q5_K / _q6_K
 * bit for bit (as the prefill GEMM does). */
static inline __attribute__((always_inline)) void kvs_avx512_kq_gemv(const int type, const int R, int64_t nb,
                                                                     const char *w, size_t w_stride,
                                                                     const char *a, float *y)
{
    const size_t bb = type == KVS_TYPE_Q4_K   ? sizeof(kvs_block_q4_K)
                      : type == KVS_TYPE_Q5_K ? sizeof(kvs_block_q5_K)
                                              : sizeof(kvs_block_q6_K);
    const size_t qs_off = type == KVS_TYPE_Q4_K ? offsetof(kvs_block_q4_K, qs) : offsetof(kvs_block_q5_K, qs);
    const __m512i m4 = _mm512_set1_epi8(0x0F), b4 = _mm512_set1_epi8(0x10), m30 = _mm512_set1_epi8(0x30);
    const __m512i shv = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    /* Q6_K: qh bits to bits 4-5 of each byte: << 4 / << 2 (p = 0), >> 0 / >> 2 (p = 1) */
    const __m512i sh6l = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i sh6r = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m128 accf = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const char *ab = a + (size_t)i * KVS_PACKK_BYTES;
        __m512i A[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            A[c] = _mm512_loadu_si512((const void *)(ab + 64 * c));
        const __m128i ps = _mm_loadu_si128((const __m128i *)(ab + KVS_PACKK_PSUMS));
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)(ab + KVS_PACKK_BSUMS));
        __m512i sa[4];
        __m256i off[4];
        __m128i sm[4];
        uint32_t dpair[4] = {0, 0, 0, 0}; /* per row: d, dmin (two F16; Q6_K: d, 0) */
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            off[r] = _mm256_setzero_si256();
            sm[r] = _mm_setzero_si128();
            if (r >= R) {
                sa[r] = _mm512_setzero_si512();
                continue;
            }
            const char *wb = w + (size_t)r * w_stride + (size_t)i * bb;
#if KVS_X86_KQ_PREFETCH > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 64, _MM_HINT_T0);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 128, _MM_HINT_T0);
            if (type == KVS_TYPE_Q6_K)
                _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 192, _MM_HINT_T0);
#endif
#if KVS_X86_KQ_PREFETCH_L2 > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2, _MM_HINT_T1);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 64, _MM_HINT_T1);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 128, _MM_HINT_T1);
            if (type == KVS_TYPE_Q6_K)
                _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 192, _MM_HINT_T1);
#endif
            __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
            if (type == KVS_TYPE_Q6_K) {
                const kvs_block_q6_K *x = (const kvs_block_q6_K *)wb;
                uint16_t d16;
                memcpy(&d16, &x->d, 2);
                dpair[r] = d16;
                const __m256i S16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x->scales));
                const __m512i S = _mm512_castsi256_si512(S16);
                off[r] = _mm256_slli_epi32(_mm256_madd_epi16(S16, bsums), 5);
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const __m512i L = _mm512_loadu_si512((const void *)(x->ql + 64 * h));
                    const __m512i Q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(x->qh + 32 * h)));
                    const __m512i v0 = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_and_si512(_mm512_sllv_epi16(Q, sh6l), m30));
                    const __m512i v1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                                       _mm512_and_si512(_mm512_srlv_epi16(Q, sh6r), m30));
                    /* word k of chunk c = 2h + p: scale 4c + k / 8 (one per 128-bit lane) */
                    const __m512i i0 = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_set1_epi16((short)(8 * h)),
                                                                       _mm_set1_epi16((short)(8 * h + 1)), 1)),
                        _mm256_inserti128_si256(_mm256_set1_epi16((short)(8 * h + 2)), _mm_set1_epi16((short)(8 * h + 3)), 1), 1);
                    const __m512i i1 = _mm512_add_epi16(i0, _mm512_set1_epi16(4));
                    acc0 = _mm512_dpwssd_epi32(acc0, _mm512_maddubs_epi16(v0, A[2 * h]), _mm512_permutexvar_epi16(i0, S));
                    acc1 = _mm512_dpwssd_epi32(acc1, _mm512_maddubs_epi16(v1, A[2 * h + 1]), _mm512_permutexvar_epi16(i1, S));
                }
            } else {
                memcpy(&dpair[r], wb, 4); /* d, dmin */
                uint64_t sc8, mn8;
                kvs_x86_q4k_scales8((const uint8_t *)wb + 4, &sc8, &mn8);
                const __m512i S = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
                sm[r] = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8)), ps);
                __m512i H = _mm512_setzero_si512();
                if (type == KVS_TYPE_Q5_K)
                    H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + offsetof(kvs_block_q5_K, qh))));
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) {
                    const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + qs_off + 32 * c)));
                    __m512i u = _mm512_and_si512(_mm512_srlv_epi16(q, shv), m4);
                    if (type == KVS_TYPE_Q5_K) {
                        /* bit 2c of qh[l] for the low half, bit 2c + 1 for the high half */
                        const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                               _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
                        u = _mm512_mask_add_epi8(u, _mm512_test_epi8_mask(H, bit), u, b4);
                    }
                    /* words of lanes 0-1: scale 2c, lanes 2-3: scale 2c + 1 */
                    const __m512i si = _mm512_inserti64x4(
                        _mm512_set1_epi16((short)((4 * c) | (4 * c + 1) << 8)),
                        _mm256_set1_epi16((short)((4 * c + 2) | (4 * c + 3) << 8)), 1);
                    const __m512i p = _mm512_maddubs_epi16(u, A[c]);
                    if (c & 1)
                        acc1 = _mm512_dpwssd_epi32(acc1, p, _mm512_shuffle_epi8(S, si));
                    else
                        acc0 = _mm512_dpwssd_epi32(acc0, p, _mm512_shuffle_epi8(S, si));
                }
            }
            sa[r] = _mm512_add_epi32(acc0, acc1);
        }
        /* [sa_0..sa_3] and [sm_0..sm_3] (Q6_K: the offset taken out of sa) */
        __m256i f[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            f[r] = _mm256_add_epi32(_mm512_castsi512_si256(sa[r]), _mm512_extracti64x4_epi64(sa[r], 1));
            if (type == KVS_TYPE_Q6_K)
                f[r] = _mm256_sub_epi32(f[r], off[r]);
        }
        const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(f[0], f[1]), _mm256_hadd_epi32(f[2], f[3]));
        const __m128i sa4 = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        /* d of the rows in lanes 0-3, dmin in 4-7 */
        const __m128i dd = _mm_loadu_si128((const __m128i *)dpair);
        const __m256 dm = _mm256_cvtph_ps(_mm_packus_epi32(_mm_and_si128(dd, _mm_set1_epi32(0xFFFF)), _mm_srli_epi32(dd, 16)));
        float dyf;
        memcpy(&dyf, ab + KVS_PACKK_D, 4);
        const __m128 dy = _mm_set1_ps(dyf);
        const __m128 t1 = _mm_mul_ps(_mm_mul_ps(_mm256_castps256_ps128(dm), dy), _mm_cvtepi32_ps(sa4));
        if (type == KVS_TYPE_Q6_K) {
            accf = _mm_add_ps(accf, t1);
        } else {
            const __m128i sm4 = _mm_hadd_epi32(_mm_hadd_epi32(sm[0], sm[1]), _mm_hadd_epi32(sm[2], sm[3]));
            const __m128 t2 = _mm_mul_ps(_mm_mul_ps(_mm256_extractf128_ps(dm, 1), dy), _mm_cvtepi32_ps(sm4));
            accf = _mm_add_ps(accf, _mm_sub_ps(t1, t2));
        }
    }
    float out[4];
    _mm_storeu_ps(out, accf);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        y[r] = out[r];
}

/* Q4_K/Q5_K/Q6_K GEMM: decode (one token) with kvs_avx512_kq_gemv, prompts
 * with the shared x86 tiles (kvs_x86_kq_gemm). */
static inline __attribute__((always_inline)) void kvs_avx512_kq_gemm(const int type, int64_t n, const void *w,
                                                                     size_t w_stride, int64_t nr, const void *a,
                                                                     size_t a_stride, int64_t nt, float *y,
                                                                     size_t y_stride)
{
    if (nt != 1) {
        kvs_x86_kq_gemm(type, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
        return;
    }
    KVS_AVX512_ROW_TILES(kvs_avx512_kq_gemv, type, n / KVS_QK_K, (const char *)w, w_stride, a, y, nr);
}

/* --- Q2_K / Q3_K decode (one token) -------------------------------------
 *
 * The same tiling as kvs_avx512_kq_gemv: R <= 4 weight rows against one
 * packed activation row (KVS_PACKK layout, 4 registers of 64 quants loaded
 * once per super-block for all rows). Element 128h + 32j + l is bits 2j,
 * 2j + 1 of qs[32h + l], so register c = 2h + p (elements 64c..64c+63) is
 * qs[32h..32h+31] broadcast to both halves, one variable 16-bit shift (4p /
 * 4p + 2) and an AND with 3; Q3_K adds 4 where bit 4h + 2p (low half) / 4h +
 * 2p + 1 (high half) of hmask[l] is set (one byte test): u = q + 4 in 0..7,
 * the value u - 4. The words k of register c carry 16-element sub-block 4c
 * + k / 8, whose scale (Q2_K: the 4-bit one; Q3_K: the signed 6-bit one of
 * kvs_q3k_scale, all 16 built at once from the 12 bytes) one word permute
 * puts there; one maddubs (|pair| <= 2 * 7 * 128) and one vpdpwssd per 64
 * elements. Q2_K's mins (sum (scales[s] >> 4) * bsums[s]) or Q3_K's offset
 * (4 * sum scale_s * bsums[s]) by one madd; the 4 rows are reduced and
 * combined together lane by lane exactly as kvs_x86_dot_q2_K / _q3_K do:
 * sum += d * d_y * sa - dmin * d_y * sm (Q3_K: sum += d * d_y * sa),
 * super-blocks in order (the same results bit for bit). */
static inline __attribute__((always_inline)) void kvs_avx512_q23k_gemv(const int type, const int R, int64_t nb,
                                                                       const char *w, size_t w_stride,
                                                                       const char *a, float *y)
{
    const size_t bb = type == KVS_TYPE_Q2_K ? sizeof(kvs_block_q2_K) : sizeof(kvs_block_q3_K);
    const size_t qs_off = type == KVS_TYPE_Q2_K ? offsetof(kvs_block_q2_K, qs) : offsetof(kvs_block_q3_K, qs);
    const __m512i m3 = _mm512_set1_epi8(3), b4 = _mm512_set1_epi8(4);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    /* shifts of register 2h + p: 4p (low half), 4p + 2 (high half) */
    const __m512i sh0 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh1 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    __m128 accf = _mm_setzero_ps();
    for (int64_t i = 0; i < nb; i++) {
        const char *ab = a + (size_t)i * KVS_PACKK_BYTES;
        __m512i A[4];
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++)
            A[c] = _mm512_loadu_si512((const void *)(ab + 64 * c));
        const __m256i bsums = _mm256_loadu_si256((const __m256i *)(ab + KVS_PACKK_BSUMS));
        __m256i f[4], g[4];
        uint32_t dpair[4] = {0, 0, 0, 0}; /* per row: d, dmin (two F16; Q3_K: d, 0) */
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            if (r >= R) {
                f[r] = g[r] = _mm256_setzero_si256();
                continue;
            }
            const char *wb = w + (size_t)r * w_stride + (size_t)i * bb;
#if KVS_X86_KQ_PREFETCH > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH, _MM_HINT_T0);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH + 64, _MM_HINT_T0);
#endif
#if KVS_X86_KQ_PREFETCH_L2 > 0
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2, _MM_HINT_T1);
            _mm_prefetch(wb + KVS_X86_KQ_PREFETCH_L2 + 64, _MM_HINT_T1);
#endif
            __m256i S16;
            __m512i H = _mm512_setzero_si512();
            if (type == KVS_TYPE_Q2_K) {
                const kvs_block_q2_K *x = (const kvs_block_q2_K *)wb;
                memcpy(&dpair[r], &x->d, 4); /* d, dmin */
                const __m128i sc = _mm_loadu_si128((const __m128i *)x->scales);
                S16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc, m4));
                g[r] = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), m4)), bsums);
            } else {
                const kvs_block_q3_K *x = (const kvs_block_q3_K *)wb;
                uint16_t d16;
                memcpy(&d16, &x->d, 2);
                dpair[r] = d16;
                /* kvs_q3k_scale for s = 0..15: low 4 bits from the nibbles of
                 * bytes 0-7 (s < 8 low, s >= 8 high), bits 4-5 = bits 2(s / 4)
                 * of byte 8 + s % 4, minus 32 */
                uint64_t b0;
                uint32_t b8;
                memcpy(&b0, x->scales, 8);
                memcpy(&b8, x->scales + 8, 4);
                const uint64_t h_lo = (uint64_t)(b8 & 0x03030303u) | (uint64_t)((b8 >> 2) & 0x03030303u) << 32;
                const uint64_t h_hi = (uint64_t)((b8 >> 4) & 0x03030303u) | (uint64_t)((b8 >> 6) & 0x03030303u) << 32;
                const uint64_t s_lo = (b0 & 0x0F0F0F0F0F0F0F0FULL) | h_lo << 4;
                const uint64_t s_hi = ((b0 >> 4) & 0x0F0F0F0F0F0F0F0FULL) | h_hi << 4;
                const __m128i sc8 = _mm_sub_epi8(_mm_set_epi64x((long long)s_hi, (long long)s_lo), _mm_set1_epi8(32));
                S16 = _mm256_cvtepi8_epi16(sc8);
                g[r] = _mm256_slli_epi32(_mm256_madd_epi16(S16, bsums), 2);
                H = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->hmask));
            }
            const __m512i S = _mm512_castsi256_si512(S16);
            __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i Q = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + qs_off + 32 * h)));
                /* word k of register c = 2h + p: scale 4c + k / 8 (one per 128-bit lane) */
                const __m512i i0 = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_set1_epi16((short)(8 * h)),
                                                                   _mm_set1_epi16((short)(8 * h + 1)), 1)),
                    _mm256_inserti128_si256(_mm256_set1_epi16((short)(8 * h + 2)), _mm_set1_epi16((short)(8 * h + 3)), 1), 1);
                const __m512i i1 = _mm512_add_epi16(i0, _mm512_set1_epi16(4));
                __m512i v0 = _mm512_and_si512(_mm512_srlv_epi16(Q, sh0), m3);
                __m512i v1 = _mm512_and_si512(_mm512_srlv_epi16(Q, sh1), m3);
                if (type == KVS_TYPE_Q3_K) {
                    const __m512i t0 = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h))),
                                                          _mm256_set1_epi8((char)(1 << (4 * h + 1))), 1);
                    const __m512i t1 = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (4 * h + 2))),
                                                          _mm256_set1_epi8((char)(1 << (4 * h + 3))), 1);
                    v0 = _mm512_mask_add_epi8(v0, _mm512_test_epi8_mask(H, t0), v0, b4);
                    v1 = _mm512_mask_add_epi8(v1, _mm512_test_epi8_mask(H, t1), v1, b4);
                }
                acc0 = _mm512_dpwssd_epi32(acc0, _mm512_maddubs_epi16(v0, A[2 * h]), _mm512_permutexvar_epi16(i0, S));
                acc1 = _mm512_dpwssd_epi32(acc1, _mm512_maddubs_epi16(v1, A[2 * h + 1]), _mm512_permutexvar_epi16(i1, S));
            }
            const __m512i acc = _mm512_add_epi32(acc0, acc1);
            f[r] = _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
            if (type == KVS_TYPE_Q3_K) {
                f[r] = _mm256_sub_epi32(f[r], g[r]);
                g[r] = _mm256_setzero_si256();
            }
        }
        /* [sa_0..sa_3], [sm_0..sm_3] */
        const __m256i hs = _mm256_hadd_epi32(_mm256_hadd_epi32(f[0], f[1]), _mm256_hadd_epi32(f[2], f[3]));
        const __m128i sa4 = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
        /* d of the rows in lanes 0-3, dmin in 4-7 */
        const __m128i dd = _mm_loadu_si128((const __m128i *)dpair);
        const __m256 dm = _mm256_cvtph_ps(_mm_packus_epi32(_mm_and_si128(dd, _mm_set1_epi32(0xFFFF)), _mm_srli_epi32(dd, 16)));
        float dyf;
        memcpy(&dyf, ab + KVS_PACKK_D, 4);
        const __m128 dy = _mm_set1_ps(dyf);
        const __m128 t1 = _mm_mul_ps(_mm_mul_ps(_mm256_castps256_ps128(dm), dy), _mm_cvtepi32_ps(sa4));
        if (type == KVS_TYPE_Q3_K) {
            accf = _mm_add_ps(accf, t1);
        } else {
            const __m256i hm = _mm256_hadd_epi32(_mm256_hadd_epi32(g[0], g[1]), _mm256_hadd_epi32(g[2], g[3]));
            const __m128i sm4 = _mm_add_epi32(_mm256_castsi256_si128(hm), _mm256_extracti128_si256(hm, 1));
            const __m128 t2 = _mm_mul_ps(_mm_mul_ps(_mm256_extractf128_ps(dm, 1), dy), _mm_cvtepi32_ps(sm4));
            accf = _mm_add_ps(accf, _mm_sub_ps(t1, t2));
        }
    }
    float out[4];
    _mm_storeu_ps(out, accf);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
        y[r] = out[r];
}

/* Q2_K / Q3_K GEMM: every token as a decode (the rows of a chunk stay in L2
 * over the token block; these types have no prompt tile of their own). */
static inline __attribute__((always_inline)) void kvs_avx512_q23k_gemm(const int type, int64_t n, const void *w,
                                                                       size_t w_stride, int64_t nr, const void *a,
                                                                       size_t a_stride, int64_t nt, float *y,
                                                                       size_t y_stride)
{
    for (int64_t t = 0; t < nt; t++)
        KVS_AVX512_ROW_TILES(kvs_avx512_q23k_gemv, type, n / KVS_QK_K, (const char *)w, w_stride,
                             (const char *)a + (size_t)t * a_stride, y + (size_t)t * y_stride, nr);
}

static void kvs_avx512_gemm_q2_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                                 int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_q23k_gemm(KVS_TYPE_Q2_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_avx512_gemm_q3_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                                 int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_q23k_gemm(KVS_TYPE_Q3_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_avx512_gemm_q4_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                                 int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_kq_gemm(KVS_TYPE_Q4_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_avx512_gemm_q5_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                                 int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_kq_gemm(KVS_TYPE_Q5_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

static void kvs_avx512_gemm_q6_K(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a, size_t a_stride,
                                 int64_t nt, float *y, size_t y_stride)
{
    kvs_avx512_kq_gemm(KVS_TYPE_Q6_K, n, w, w_stride, nr, a, a_stride, nt, y, y_stride);
}

#define KVS_AVX512_ENTRIES                                                                           \
    .isa = KVS_ISA_AVX512, KVS_KERNELS_REF_ENTRIES, KVS_X86_ENTRIES,                                 \
    .dot[KVS_TYPE_Q8_0] = kvs_avx512_dot_q8_0, .dot[KVS_TYPE_Q4_0] = kvs_avx512_dot_q4_0,           \
    .dot4[KVS_TYPE_Q8_0] = kvs_avx512_dot4_q8_0, .dot4[KVS_TYPE_Q4_0] = kvs_avx512_dot4_q4_0,       \
    .pack_act[KVS_TYPE_Q8_0] = kvs_avx512_pack_q8_0, .pack_act[KVS_TYPE_Q4_0] = kvs_avx512_pack_q4_0, \
    .gemm[KVS_TYPE_Q8_0] = kvs_avx512_gemm_q8_0, .gemm[KVS_TYPE_Q4_0] = kvs_avx512_gemm_q4_0,       \
    .gemm[KVS_TYPE_Q4_K] = kvs_avx512_gemm_q4_K, .gemm[KVS_TYPE_Q5_K] = kvs_avx512_gemm_q5_K,       \
    .gemm[KVS_TYPE_Q6_K] = kvs_avx512_gemm_q6_K, .gemm[KVS_TYPE_Q2_K] = kvs_avx512_gemm_q2_K,       \
    .gemm[KVS_TYPE_Q3_K] = kvs_avx512_gemm_q3_K, .pack_act[KVS_TYPE_Q2_K] = kvs_x86_pack_q8_Kx,     \
    .pack_act[KVS_TYPE_Q3_K] = kvs_x86_pack_q8_Kx,                                                  \
    .gemm_packed[KVS_TYPE_Q8_0] = kvs_avx512_gemm_packed_q8_0,                                      \
    .quant_act[KVS_TYPE_F16] = kvs_avx512_quant_f16, .dot[KVS_TYPE_F16] = kvs_avx512_dot_f16,       \
    .dot_gemm[KVS_TYPE_F16] = kvs_avx512_dot_gemm_f16, .f16_scale = kvs_avx512_f16_scale,           \
    .f16_mad = kvs_avx512_f16_mad

const struct kvs_kernels kvs_kernels_avx512 = {
    KVS_AVX512_ENTRIES,
    .dot[KVS_TYPE_BF16] = kvs_avx512_dot_bf16,
    .dot_gemm[KVS_TYPE_BF16] = kvs_avx512_dot_gemm_bf16,
};

/* The same on CPUs with AVX512-BF16 (kvs_kernels_get picks it): BF16 with
 * VDPBF16PS, as ggml built for such a CPU sums it. */
const struct kvs_kernels kvs_kernels_avx512_bf16 = {
    KVS_AVX512_ENTRIES,
    .dot[KVS_TYPE_BF16] = kvs_avx512bf16_dot_bf16,
    .dot_gemm[KVS_TYPE_BF16] = kvs_avx512bf16_dot_gemm_bf16,
};

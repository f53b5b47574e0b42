/* Scalar reference kernels: conversions, dequantization, activation
 * quantization, dot products and the reference weight quantizers.
 *
 * Formats and formulas: ../shared/docs/gguf-facts.md §2.2-§2.5. The dot
 * products keep llama.cpp's structure: integer sums inside a block, scales
 * combined in float per block, so SIMD paths (which must produce the same
 * integer sums) differ from these only in float summation order. */
#include <math.h>
#include <string.h>

#include "kernels/kernels_impl.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

/* --- scalar conversions (gguf-facts §2.2) -------------------------------- */

float kvs_f16_to_f32(uint16_t h)
{
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    float f;
    if (e == 0) {
        f = (float)m * 0x1p-24f; /* zero or subnormal: exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (e == 31) {
        bits = sign | 0x7F800000u | (m << 13);
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

uint16_t kvs_f32_to_f16(float f)
{
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) /* NaN: keep the top payload bits, force quiet */
        return (uint16_t)(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
    if (ax >= 0x47800000u) /* |f| >= 2^16 (or inf): overflow to inf */
        return (uint16_t)(sign | 0x7C00u);
    if (ax >= 0x38800000u) { /* normal in f16: rebias exponent by 127-15 */
        uint32_t v = ax - 0x38000000u;
        v += 0xFFFu + ((v >> 13) & 1u); /* round to nearest even on 13 dropped bits */
        return (uint16_t)(sign | (v >> 13)); /* a carry into exponent 31 is inf: correct */
    }
    if (ax <= 0x33000000u) /* |f| <= 2^-25: rounds to zero (2^-25 ties to even 0) */
        return sign;
    /* Subnormal result: value = m * 2^(e-150); in units of 2^-24 shift by 126-e. */
    uint32_t e = ax >> 23, m = (ax & 0x7FFFFFu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14..24 */
    uint32_t q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return (uint16_t)(sign | q);
#endif
}

float kvs_bf16_to_f32(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t kvs_f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u)
        return (uint16_t)((x >> 16) | 64u); /* NaN: force quiet */
    return (uint16_t)((x + (0x7FFFu + ((x >> 16) & 1u))) >> 16);
}

#define F16(h) kvs_f16_to_f32(h)

/* Round half to even for |v| < 2^22 (the nearest_int trick of gguf-facts
 * §2.5: adding 1.5*2^23 leaves the integer in the low mantissa bits). */
static inline int kvs_nearest_int(float v)
{
    float t = v + 12582912.0f;
    int32_t i;
    memcpy(&i, &t, 4);
    return (i & 0x007FFFFF) - 0x00400000;
}

/* --- dequantization ----------------------------------------------------- */

void kvs_ref_dequant_f32(const void *src, float *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

void kvs_ref_dequant_f16(const void *src, float *dst, int64_t n)
{
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = F16(s[i]);
}

void kvs_ref_dequant_bf16(const void *src, float *dst, int64_t n)
{
    const uint16_t *s = src;
    for (int64_t i = 0; i < n; i++)
        dst[i] = kvs_bf16_to_f32(s[i]);
}

void kvs_ref_dequant_q4_0(const void *src, float *dst, int64_t n)
{
    const kvs_block_q4_0 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)((b[i].qs[j] & 0xF) - 8);
            dst[j + 16] = d * (float)((b[i].qs[j] >> 4) - 8);
        }
    }
}

void kvs_ref_dequant_q4_1(const void *src, float *dst, int64_t n)
{
    const kvs_block_q4_1 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)(b[i].qs[j] & 0xF) + m;
            dst[j + 16] = d * (float)(b[i].qs[j] >> 4) + m;
        }
    }
}

static inline uint32_t kvs_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

void kvs_ref_dequant_q5_0(const void *src, float *dst, int64_t n)
{
    const kvs_block_q5_0 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d);
        uint32_t h = kvs_le32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int q0 = (b[i].qs[j] & 0xF) | (int)((h >> j) & 1u) << 4;
            int q1 = (b[i].qs[j] >> 4) | (int)((h >> (j + 16)) & 1u) << 4;
            dst[j] = d * (float)(q0 - 16);
            dst[j + 16] = d * (float)(q1 - 16);
        }
    }
}

void kvs_ref_dequant_q5_1(const void *src, float *dst, int64_t n)
{
    const kvs_block_q5_1 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d), m = F16(b[i].m);
        uint32_t h = kvs_le32(b[i].qh);
        for (int j = 0; j < 16; j++) {
            int q0 = (b[i].qs[j] & 0xF) | (int)((h >> j) & 1u) << 4;
            int q1 = (b[i].qs[j] >> 4) | (int)((h >> (j + 16)) & 1u) << 4;
            dst[j] = d * (float)q0 + m;
            dst[j + 16] = d * (float)q1 + m;
        }
    }
}

void kvs_ref_dequant_q8_0(const void *src, float *dst, int64_t n)
{
    const kvs_block_q8_0 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++)
            dst[j] = d * (float)b[i].qs[j];
    }
}

void kvs_ref_dequant_q8_1(const void *src, float *dst, int64_t n)
{
    const kvs_block_q8_1 *b = src;
    for (int64_t i = 0; i < n / KVS_QK; i++, dst += KVS_QK) {
        float d = F16(b[i].d);
        for (int j = 0; j < 32; j++)
            dst[j] = d * (float)b[i].qs[j];
    }
}

/* Q2_K/Q3_K 2-bit field of element e (gguf-facts §2.4). */
static inline int kvs_q2_bits(const uint8_t *qs, int e)
{
    return (qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
}

void kvs_ref_dequant_q2_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q2_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int e = 0; e < KVS_QK_K; e++) {
            uint8_t sc = b[i].scales[e / 16];
            dst[e] = d * (float)(sc & 0xF) * (float)kvs_q2_bits(b[i].qs, e) - dmin * (float)(sc >> 4);
        }
    }
}

static inline int kvs_q3_value(const kvs_block_q3_K *b, int e)
{
    int q = kvs_q2_bits(b->qs, e);
    return (b->hmask[e % 32] >> (e / 32)) & 1 ? q : q - 4;
}

void kvs_ref_dequant_q3_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q3_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K) {
        float d = F16(b[i].d);
        for (int e = 0; e < KVS_QK_K; e++)
            dst[e] = d * (float)kvs_q3k_scale(b[i].scales, e / 16) * (float)kvs_q3_value(&b[i], e);
    }
}

static inline int kvs_q4k_value(const uint8_t *qs, int e)
{
    int c = e / 64, r = e % 64;
    uint8_t byte = qs[32 * c + r % 32];
    return r < 32 ? (byte & 0xF) : (byte >> 4);
}

void kvs_ref_dequant_q4_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q4_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvs_q4k_scale_min(j, b[i].scales, &sc, &mn);
            float d1 = d * (float)sc, m1 = dmin * (float)mn;
            for (int e = 32 * j; e < 32 * j + 32; e++)
                dst[e] = d1 * (float)kvs_q4k_value(b[i].qs, e) - m1;
        }
    }
}

static inline int kvs_q5k_value(const kvs_block_q5_K *b, int e)
{
    return kvs_q4k_value(b->qs, e) + (((b->qh[e % 32] >> (e / 32)) & 1) << 4);
}

void kvs_ref_dequant_q5_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q5_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K) {
        float d = F16(b[i].d), dmin = F16(b[i].dmin);
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvs_q4k_scale_min(j, b[i].scales, &sc, &mn);
            float d1 = d * (float)sc, m1 = dmin * (float)mn;
            for (int e = 32 * j; e < 32 * j + 32; e++)
                dst[e] = d1 * (float)kvs_q5k_value(&b[i], e) - m1;
        }
    }
}

static inline int kvs_q6k_value(const kvs_block_q6_K *b, int e)
{
    int nn = e / 128, r = e % 128, l = r % 32, g = r / 32;
    uint8_t lb = b->ql[64 * nn + l + 32 * (g & 1)];
    int low4 = g < 2 ? (lb & 0xF) : (lb >> 4);
    int high2 = (b->qh[32 * nn + l] >> (2 * g)) & 3;
    return (low4 | high2 << 4) - 32;
}

void kvs_ref_dequant_q6_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q6_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K) {
        float d = F16(b[i].d);
        for (int e = 0; e < KVS_QK_K; e++)
            dst[e] = d * (float)b[i].scales[e / 16] * (float)kvs_q6k_value(&b[i], e);
    }
}

void kvs_ref_dequant_q8_K(const void *src, float *dst, int64_t n)
{
    const kvs_block_q8_K *b = src;
    for (int64_t i = 0; i < n / KVS_QK_K; i++, dst += KVS_QK_K)
        for (int e = 0; e < KVS_QK_K; e++)
            dst[e] = b[i].d * (float)b[i].qs[e];
}

/* --- activation quantization (gguf-facts §2.5) -------------------------- */

void kvs_ref_quant_f32(const float *src, void *dst, int64_t n)
{
    memcpy(dst, src, (size_t)n * sizeof(float));
}

void kvs_ref_quant_f16(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++)
        d[i] = kvs_f32_to_f16(src[i]);
}

void kvs_ref_quant_bf16(const float *src, void *dst, int64_t n)
{
    uint16_t *d = dst;
    for (int64_t i = 0; i < n; i++)
        d[i] = kvs_f32_to_bf16(src[i]);
}

/* Q8_0 as llama.cpp's x86 AVX path does it: d = amax/127 (stored f16),
 * q = round-half-to-even(x * (127/amax)). Returns the sum of the q. */
static int kvs_quant_q8_block(const float *x, int8_t *qs, float *d_out)
{
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(x[j]));
    float mult = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < 32; j++) {
        int q = kvs_nearest_int(x[j] * mult);
        qs[j] = (int8_t)q;
        sum += q;
    }
    *d_out = amax / 127.0f;
    return sum;
}

void kvs_ref_quant_q8_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        float d;
        kvs_quant_q8_block(src + i * KVS_QK, b[i].qs, &d);
        b[i].d = kvs_f32_to_f16(d);
    }
}

void kvs_ref_quant_q8_1(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_1 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        float d;
        int sum = kvs_quant_q8_block(src + i * KVS_QK, b[i].qs, &d);
        b[i].d = kvs_f32_to_f16(d);
        b[i].s = kvs_f32_to_f16(d * (float)sum);
    }
}

void kvs_ref_quant_q8_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        const float *x = src + i * KVS_QK_K;
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < KVS_QK_K; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            memset(&b[i], 0, sizeof b[i]);
            continue;
        }
        float iscale = -127.0f / max;
        for (int j = 0; j < KVS_QK_K; j++) {
            int v = kvs_nearest_int(iscale * x[j]);
            b[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int k = 0; k < 16; k++) {
            int s = 0;
            for (int j = 0; j < 16; j++)
                s += b[i].qs[16 * k + j];
            b[i].bsums[k] = (int16_t)s;
        }
        b[i].d = 1.0f / iscale;
    }
}

/* --- dot products ------------------------------------------------------- */

float kvs_ref_dot_f32(int64_t n, const void *w, const void *a)
{
    const float *x = w, *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)x[i] * (double)y[i];
    return (float)s;
}

float kvs_ref_dot_f16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)(F16(x[i]) * F16(y[i]));
    return (float)s;
}

float kvs_ref_dot_bf16(int64_t n, const void *w, const void *a)
{
    const uint16_t *x = w, *y = a;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++)
        s += (double)(kvs_bf16_to_f32(x[i]) * kvs_bf16_to_f32(y[i]));
    return (float)s;
}

float kvs_ref_dot_q4_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_0 *x = w;
    const kvs_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        int s = 0;
        for (int j = 0; j < 16; j++) {
            s += ((x[i].qs[j] & 0xF) - 8) * y[i].qs[j];
            s += ((x[i].qs[j] >> 4) - 8) * y[i].qs[j + 16];
        }
        sum += (float)s * (F16(x[i].d) * F16(y[i].d));
    }
    return sum;
}

float kvs_ref_dot_q4_1(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_1 *x = w;
    const kvs_block_q8_1 *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        int s = 0;
        for (int j = 0; j < 16; j++) {
            s += (x[i].qs[j] & 0xF) * y[i].qs[j];
            s += (x[i].qs[j] >> 4) * y[i].qs[j + 16];
        }
        sum += (F16(x[i].d) * F16(y[i].d)) * (float)s + F16(x[i].m) * F16(y[i].s);
    }
    return sum;
}

float kvs_ref_dot_q5_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_0 *x = w;
    const kvs_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        uint32_t h = kvs_le32(x[i].qh);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            int q0 = ((x[i].qs[j] & 0xF) | (int)((h >> j) & 1u) << 4) - 16;
            int q1 = ((x[i].qs[j] >> 4) | (int)((h >> (j + 16)) & 1u) << 4) - 16;
            s += q0 * y[i].qs[j] + q1 * y[i].qs[j + 16];
        }
        sum += (float)s * (F16(x[i].d) * F16(y[i].d));
    }
    return sum;
}

float kvs_ref_dot_q5_1(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_1 *x = w;
    const kvs_block_q8_1 *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        uint32_t h = kvs_le32(x[i].qh);
        int s = 0;
        for (int j = 0; j < 16; j++) {
            int q0 = (x[i].qs[j] & 0xF) | (int)((h >> j) & 1u) << 4;
            int q1 = (x[i].qs[j] >> 4) | (int)((h >> (j + 16)) & 1u) << 4;
            s += q0 * y[i].qs[j] + q1 * y[i].qs[j + 16];
        }
        sum += (F16(x[i].d) * F16(y[i].d)) * (float)s + F16(x[i].m) * F16(y[i].s);
    }
    return sum;
}

float kvs_ref_dot_q8_0(int64_t n, const void *w, const void *a)
{
    const kvs_block_q8_0 *x = w;
    const kvs_block_q8_0 *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        int s = 0;
        for (int j = 0; j < 32; j++)
            s += x[i].qs[j] * y[i].qs[j];
        sum += (float)s * (F16(x[i].d) * F16(y[i].d));
    }
    return sum;
}

float kvs_ref_dot_q2_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q2_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sa = 0, sm = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++)
                t += kvs_q2_bits(x[i].qs, e) * y[i].qs[e];
            sa += (x[i].scales[s] & 0xF) * t;
            sm += (x[i].scales[s] >> 4) * y[i].bsums[s];
        }
        sum += F16(x[i].d) * y[i].d * (float)sa - F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

float kvs_ref_dot_q3_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q3_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sa = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++)
                t += kvs_q3_value(&x[i], e) * y[i].qs[e];
            sa += kvs_q3k_scale(x[i].scales, s) * t;
        }
        sum += F16(x[i].d) * y[i].d * (float)sa;
    }
    return sum;
}

float kvs_ref_dot_q4_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q4_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sa = 0, sm = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvs_q4k_scale_min(j, x[i].scales, &sc, &mn);
            int t = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++)
                t += kvs_q4k_value(x[i].qs, e) * y[i].qs[e];
            sa += sc * t;
            sm += mn * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        }
        sum += F16(x[i].d) * y[i].d * (float)sa - F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

float kvs_ref_dot_q5_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q5_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sa = 0, sm = 0;
        for (int j = 0; j < 8; j++) {
            uint8_t sc, mn;
            kvs_q4k_scale_min(j, x[i].scales, &sc, &mn);
            int t = 0;
            for (int e = 32 * j; e < 32 * j + 32; e++)
                t += kvs_q5k_value(&x[i], e) * y[i].qs[e];
            sa += sc * t;
            sm += mn * (y[i].bsums[2 * j] + y[i].bsums[2 * j + 1]);
        }
        sum += F16(x[i].d) * y[i].d * (float)sa - F16(x[i].dmin) * y[i].d * (float)sm;
    }
    return sum;
}

float kvs_ref_dot_q6_K(int64_t n, const void *w, const void *a)
{
    const kvs_block_q6_K *x = w;
    const kvs_block_q8_K *y = a;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        int sa = 0;
        for (int s = 0; s < 16; s++) {
            int t = 0;
            for (int e = 16 * s; e < 16 * s + 16; e++)
                t += kvs_q6k_value(&x[i], e) * y[i].qs[e];
            sa += x[i].scales[s] * t;
        }
        sum += F16(x[i].d) * y[i].d * (float)sa;
    }
    return sum;
}

/* --- reference weight quantizers (gguf-facts §2.3) ---------------------- */

/* The value with the largest magnitude (first one on ties), signed. */
static float kvs_signed_absmax(const float *x, int n)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++) {
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    }
    return max;
}

static void kvs_min_max(const float *x, int n, float *mn, float *mx)
{
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < n; j++) {
        lo = fminf(lo, x[j]);
        hi = fmaxf(hi, x[j]);
    }
    *mn = lo;
    *mx = hi;
}

static void kvs_wquant_q4_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q4_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float d = kvs_signed_absmax(x, KVS_QK) / -8.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvs_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(int8_t)(x[j] * id + 8.5f), q1 = (int)(int8_t)(x[j + 16] * id + 8.5f);
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            b[i].qs[j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

static void kvs_wquant_q4_1(const float *src, void *dst, int64_t n)
{
    kvs_block_q4_1 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float mn, mx;
        kvs_min_max(x, KVS_QK, &mn, &mx);
        float d = (mx - mn) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvs_f32_to_f16(d);
        b[i].m = kvs_f32_to_f16(mn);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(int8_t)((x[j] - mn) * id + 0.5f), q1 = (int)(int8_t)((x[j + 16] - mn) * id + 0.5f);
            q0 = q0 < 15 ? q0 : 15;
            q1 = q1 < 15 ? q1 : 15;
            b[i].qs[j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

static void kvs_put_le32(uint8_t *p, uint32_t v)
{
    for (int k = 0; k < 4; k++)
        p[k] = (uint8_t)(v >> (8 * k));
}

static void kvs_wquant_q5_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q5_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float d = kvs_signed_absmax(x, KVS_QK) / -16.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        b[i].d = kvs_f32_to_f16(d);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(int8_t)(x[j] * id + 16.5f), q1 = (int)(int8_t)(x[j + 16] * id + 16.5f);
            q0 = q0 < 31 ? q0 : 31;
            q1 = q1 < 31 ? q1 : 31;
            b[i].qs[j] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
            qh |= (uint32_t)((q0 >> 4) & 1) << j | (uint32_t)((q1 >> 4) & 1) << (j + 16);
        }
        kvs_put_le32(b[i].qh, qh);
    }
}

static void kvs_wquant_q5_1(const float *src, void *dst, int64_t n)
{
    kvs_block_q5_1 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float mn, mx;
        kvs_min_max(x, KVS_QK, &mn, &mx);
        float d = (mx - mn) / 31.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        b[i].d = kvs_f32_to_f16(d);
        b[i].m = kvs_f32_to_f16(mn);
        for (int j = 0; j < 16; j++) {
            int q0 = (int)(uint8_t)((x[j] - mn) * id + 0.5f), q1 = (int)(uint8_t)((x[j + 16] - mn) * id + 0.5f);
            q0 = q0 < 31 ? q0 : 31;
            q1 = q1 < 31 ? q1 : 31;
            b[i].qs[j] = (uint8_t)((q0 & 0xF) | (q1 & 0xF) << 4);
            qh |= (uint32_t)((q0 >> 4) & 1) << j | (uint32_t)((q1 >> 4) & 1) << (j + 16);
        }
        kvs_put_le32(b[i].qh, qh);
    }
}

static void kvs_wquant_q8_0(const float *src, void *dst, int64_t n)
{
    kvs_block_q8_0 *b = dst;
    for (int64_t i = 0; i < n / KVS_QK; i++) {
        const float *x = src + i * KVS_QK;
        float amax = 0.0f;
        for (int j = 0; j < KVS_QK; j++)
            amax = fmaxf(amax, fabsf(x[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        b[i].d = kvs_f32_to_f16(d);
        for (int j = 0; j < KVS_QK; j++)
            b[i].qs[j] = (int8_t)roundf(x[j] * id);
    }
}

kvs_err kvs_quantize_weights(enum kvs_type type, const float *src, void *dst, int64_t n)
{
    uint32_t be, bb;
    if (!src || !dst || n < 0 || !kvs_kernels_block(type, &be, &bb) || n % be != 0)
        return KVS_ERR_ARG;
    switch (type) {
    case KVS_TYPE_F32: kvs_ref_quant_f32(src, dst, n); return KVS_OK;
    case KVS_TYPE_F16: kvs_ref_quant_f16(src, dst, n); return KVS_OK;
    case KVS_TYPE_BF16: kvs_ref_quant_bf16(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q4_0: kvs_wquant_q4_0(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q4_1: kvs_wquant_q4_1(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q5_0: kvs_wquant_q5_0(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q5_1: kvs_wquant_q5_1(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q8_0: kvs_wquant_q8_0(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q2_K: kvs_wquant_q2_K(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q3_K: kvs_wquant_q3_K(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q4_K: kvs_wquant_q4_K(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q5_K: kvs_wquant_q5_K(src, dst, n); return KVS_OK;
    case KVS_TYPE_Q6_K: kvs_wquant_q6_K(src, dst, n); return KVS_OK;
    default: return KVS_ERR_UNSUPPORTED;
    }
}

/* --- F16 vector updates (attention's V accumulator) ------------------------ */

void kvs_ref_f16_scale(uint16_t *y, float s, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = kvs_f32_to_f16(kvs_f16_to_f32(y[i]) * s);
}

void kvs_ref_f16_mad(uint16_t *y, const uint16_t *x, float s, int64_t n)
{
    const int64_t np = n & ~(int64_t)63; /* ggml's AVX-512 body: fused */
    for (int64_t i = 0; i < np; i++)
        y[i] = kvs_f32_to_f16(fmaf(kvs_f16_to_f32(x[i]), s, kvs_f16_to_f32(y[i])));
    for (int64_t i = np; i < n; i++)
        y[i] = kvs_f32_to_f16(kvs_f16_to_f32(y[i]) + kvs_f16_to_f32(x[i]) * s);
}

/* Reference weight quantizers for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K,
 * Q6_K): F32 -> super-blocks of 256, to create files (`kvasir gguf synth`)
 * and test data. Block layouts are gguf-facts §2.4 (the inverse of the
 * kvs_ref_dequant_* functions in kernels_ref.c).
 *
 * The recipe is a plain one of our own, not llama.cpp's search for the best
 * scales: per sub-block, the scale (and for Q2_K/Q4_K/Q5_K the min) that
 * maps the sub-block's range onto the quant range; the super-block's d
 * (and dmin) then quantizes those sub-block scales to 4, 6 or 8 bits;
 * quants round to nearest with the quantized scale. Files made this way
 * are valid K-quant files of ordinary accuracy; nothing here claims equal
 * bytes with llama-quantize. */
#include <math.h>
#include <string.h>

#include "kernels/kernels_impl.h"

static int kvs_wq_clamp(int v, int lo, int hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static int kvs_wq_round(float v)
{
    return (int)lrintf(v);
}

/* Asymmetric sub-blocks (Q2_K, Q4_K, Q5_K): for each of ns sub-blocks of
 * len values, scale = (max - min) / qmax and mins = -min (the value range
 * always includes 0, so mins >= 0); then d = max scale / smax and dmin =
 * max mins / smax and the integer scales sc/mn (0..smax). */
static void kvs_wq_asym(const float *x, int ns, int len, int qmax, int smax, uint8_t *sc, uint8_t *mn, float *d,
                        float *dmin)
{
    float scale[16], mins[16], ms = 0.0f, mm = 0.0f;
    for (int s = 0; s < ns; s++) {
        float lo = 0.0f, hi = 0.0f;
        for (int i = 0; i < len; i++) {
            lo = fminf(lo, x[s * len + i]);
            hi = fmaxf(hi, x[s * len + i]);
        }
        scale[s] = (hi - lo) / (float)qmax;
        mins[s] = -lo;
        ms = fmaxf(ms, scale[s]);
        mm = fmaxf(mm, mins[s]);
    }
    /* round d and dmin to F16 first: the file stores them so */
    *d = kvs_f16_to_f32(kvs_f32_to_f16(ms / (float)smax));
    *dmin = kvs_f16_to_f32(kvs_f32_to_f16(mm / (float)smax));
    for (int s = 0; s < ns; s++) {
        sc[s] = (uint8_t)(*d > 0.0f ? kvs_wq_clamp(kvs_wq_round(scale[s] / *d), 0, smax) : 0);
        mn[s] = (uint8_t)(*dmin > 0.0f ? kvs_wq_clamp(kvs_wq_round(mins[s] / *dmin), 0, smax) : 0);
    }
}

/* Quant of x for value = d * sc * q - dmin * mn, q in 0..qmax. */
static int kvs_wq_q_asym(float x, float d, int sc, float dmin, int mn, int qmax)
{
    float step = d * (float)sc;
    if (step <= 0.0f)
        return 0;
    return kvs_wq_clamp(kvs_wq_round((x + dmin * (float)mn) / step), 0, qmax);
}

/* Q4_K / Q5_K shared part: 8 sub-blocks of 32, 6-bit scales and mins packed
 * into 12 bytes (the inverse of kvs_q4k_scale_min), quants 0..qmax in q. */
static void kvs_wq_q45(const float *x, int qmax, uint16_t *dd, uint16_t *dm, uint8_t scales[12], uint8_t q[256])
{
    uint8_t sc[8], mn[8];
    float d, dmin;
    kvs_wq_asym(x, 8, 32, qmax, 63, sc, mn, &d, &dmin);
    *dd = kvs_f32_to_f16(d);
    *dm = kvs_f32_to_f16(dmin);
    for (int j = 0; j < 4; j++) {
        scales[j] = (uint8_t)(sc[j] | (sc[j + 4] >> 4) << 6);
        scales[j + 4] = (uint8_t)(mn[j] | (mn[j + 4] >> 4) << 6);
        scales[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | (mn[j + 4] & 0xF) << 4);
    }
    for (int e = 0; e < 256; e++)
        q[e] = (uint8_t)kvs_wq_q_asym(x[e], d, sc[e / 32], dmin, mn[e / 32], qmax);
}

/* Element e's Q4_K nibble position: byte 32 * (e / 64) + e % 32, high
 * nibble when e % 64 >= 32. */
static void kvs_wq_put_q4(uint8_t *qs, const uint8_t q[256])
{
    memset(qs, 0, 128);
    for (int e = 0; e < 256; e++)
        qs[32 * (e / 64) + e % 32] |= (uint8_t)((q[e] & 0xF) << (e % 64 >= 32 ? 4 : 0));
}

void kvs_wquant_q4_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q4_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        uint8_t q[256];
        kvs_wq_q45(src + i * KVS_QK_K, 15, &b[i].d, &b[i].dmin, b[i].scales, q);
        kvs_wq_put_q4(b[i].qs, q);
    }
}

void kvs_wquant_q5_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q5_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        uint8_t q[256];
        kvs_wq_q45(src + i * KVS_QK_K, 31, &b[i].d, &b[i].dmin, b[i].scales, q);
        kvs_wq_put_q4(b[i].qs, q);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int e = 0; e < 256; e++)
            b[i].qh[e % 32] |= (uint8_t)((q[e] >> 4) << (e / 32));
    }
}

/* Symmetric sub-blocks of 16 (Q3_K, Q6_K): scale = signed absmax / -qneg
 * (so the largest magnitude lands on -qneg), then d = max |scale| / smax and
 * signed integer scales in -smax..smax; quants round(x / (d sc)) in
 * -qneg..qneg-1. */
static float kvs_wq_sym(const float *x, int qneg, int smax, int sc[16])
{
    float scale[16], ms = 0.0f;
    for (int s = 0; s < 16; s++) {
        float amax = 0.0f, max = 0.0f;
        for (int i = 0; i < 16; i++) {
            if (fabsf(x[16 * s + i]) > amax) {
                amax = fabsf(x[16 * s + i]);
                max = x[16 * s + i];
            }
        }
        scale[s] = max / (float)-qneg;
        ms = fmaxf(ms, fabsf(scale[s]));
    }
    float d = kvs_f16_to_f32(kvs_f32_to_f16(ms / (float)smax));
    for (int s = 0; s < 16; s++)
        sc[s] = d > 0.0f ? kvs_wq_clamp(kvs_wq_round(scale[s] / d), -smax, smax) : 0;
    return d;
}

static int kvs_wq_q_sym(float x, float d, int sc, int qneg)
{
    float step = d * (float)sc;
    if (step == 0.0f)
        return 0;
    return kvs_wq_clamp(kvs_wq_round(x / step), -qneg, qneg - 1);
}

void kvs_wquant_q6_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q6_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        const float *x = src + i * KVS_QK_K;
        int sc[16];
        float d = kvs_wq_sym(x, 32, 127, sc);
        b[i].d = kvs_f32_to_f16(d);
        memset(b[i].ql, 0, sizeof b[i].ql);
        memset(b[i].qh, 0, sizeof b[i].qh);
        for (int s = 0; s < 16; s++)
            b[i].scales[s] = (int8_t)sc[s];
        for (int e = 0; e < 256; e++) {
            int u = kvs_wq_q_sym(x[e], d, sc[e / 16], 32) + 32; /* 0..63 */
            int nn = e / 128, r = e % 128, l = r % 32, g = r / 32;
            b[i].ql[64 * nn + l + 32 * (g & 1)] |= (uint8_t)((u & 0xF) << (g < 2 ? 0 : 4));
            b[i].qh[32 * nn + l] |= (uint8_t)((u >> 4) << (2 * g));
        }
    }
}

/* Q2_K/Q3_K 2-bit field of element e: bits 2 * ((e % 128) / 32) of
 * qs[32 * (e / 128) + e % 32]. */
static void kvs_wq_put_q2(uint8_t *qs, int e, int v)
{
    qs[32 * (e / 128) + e % 32] |= (uint8_t)((v & 3) << (2 * ((e % 128) / 32)));
}

void kvs_wquant_q2_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q2_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        const float *x = src + i * KVS_QK_K;
        uint8_t sc[16], mn[16];
        float d, dmin;
        kvs_wq_asym(x, 16, 16, 3, 15, sc, mn, &d, &dmin);
        b[i].d = kvs_f32_to_f16(d);
        b[i].dmin = kvs_f32_to_f16(dmin);
        memset(b[i].qs, 0, sizeof b[i].qs);
        for (int s = 0; s < 16; s++)
            b[i].scales[s] = (uint8_t)(sc[s] | mn[s] << 4);
        for (int e = 0; e < 256; e++)
            kvs_wq_put_q2(b[i].qs, e, kvs_wq_q_asym(x[e], d, sc[e / 16], dmin, mn[e / 16], 3));
    }
}

void kvs_wquant_q3_K(const float *src, void *dst, int64_t n)
{
    kvs_block_q3_K *b = dst;
    for (int64_t i = 0; i < n / KVS_QK_K; i++) {
        const float *x = src + i * KVS_QK_K;
        int sc[16];
        float d = kvs_wq_sym(x, 4, 31, sc);
        b[i].d = kvs_f32_to_f16(d);
        memset(b[i].qs, 0, sizeof b[i].qs);
        memset(b[i].hmask, 0, sizeof b[i].hmask);
        memset(b[i].scales, 0, sizeof b[i].scales);
        /* 6-bit scales + 32: low 4 bits in bytes 0..7 (s >= 8: high halves),
         * high 2 bits in byte 8 + s % 4 at bit 2 * (s / 4) (kvs_q3k_scale) */
        for (int s = 0; s < 16; s++) {
            int v = sc[s] + 32;
            b[i].scales[s % 8] |= (uint8_t)((v & 0xF) << (s < 8 ? 0 : 4));
            b[i].scales[8 + s % 4] |= (uint8_t)((v >> 4) << (2 * (s / 4)));
        }
        /* value = q2 - 4 with the hmask bit clear, q2 with it set */
        for (int e = 0; e < 256; e++) {
            int u = kvs_wq_q_sym(x[e], d, sc[e / 16], 4) + 4; /* 0..7 */
            if (u >= 4)
                b[i].hmask[e % 32] |= (uint8_t)(1 << (e / 32));
            kvs_wq_put_q2(b[i].qs, e, u >= 4 ? u - 4 : u);
        }
    }
}

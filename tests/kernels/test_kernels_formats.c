/* Format tests: conversions, hand-built blocks of every type dequantized to
 * values computed by hand from gguf-facts §2.2-§2.4, activation quantizer
 * rounding (§2.5) and the reference weight quantizers (§2.3). */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kernels.h"

static const struct kvs_kernels *scalar(void)
{
    return kvs_kernels_get(KVS_ISA_SCALAR);
}

static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static float bits_f32(uint32_t b)
{
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static void test_f16(void **state)
{
    (void)state;
    assert_int_equal(kvs_f32_to_f16(1.0f), 0x3C00);
    assert_int_equal(kvs_f32_to_f16(-2.0f), 0xC000);
    assert_int_equal(kvs_f32_to_f16(65504.0f), 0x7BFF);
    assert_int_equal(kvs_f32_to_f16(65519.0f), 0x7BFF);
    assert_int_equal(kvs_f32_to_f16(65520.0f), 0x7C00); /* tie rounds to even = inf */
    assert_int_equal(kvs_f32_to_f16(INFINITY), 0x7C00);
    assert_int_equal(kvs_f32_to_f16(0x1p-24f), 0x0001);
    assert_int_equal(kvs_f32_to_f16(0x1p-25f), 0x0000);       /* tie to even 0 */
    assert_int_equal(kvs_f32_to_f16(0x1.8p-25f), 0x0001);
    assert_int_equal(kvs_f32_to_f16(0x1.8p-24f), 0x0002);     /* 1.5 ulp: tie to even 2 */
    assert_int_equal(kvs_f32_to_f16(0x1p-14f), 0x0400);
    assert_int_equal(kvs_f32_to_f16(0x1.ff8p-15f), 0x03FF);   /* largest subnormal */
    assert_int_equal(kvs_f32_to_f16(0x1.ffcp-15f), 0x0400);   /* tie: up to even (normal) */
    assert_int_equal(kvs_f32_to_f16(1.0f + 0x1p-11f), 0x3C00); /* tie: keep even */
    assert_int_equal(kvs_f32_to_f16(1.0f + 0x3p-11f), 0x3C02); /* tie: round up to even */
    assert_int_equal(kvs_f32_to_f16(1.0f + 0x1.2p-11f), 0x3C01);
    assert_int_equal(kvs_f32_to_f16(-0.0f), 0x8000);
    assert_true((kvs_f32_to_f16(NAN) & 0x7E00) == 0x7E00);
    assert_true(kvs_f16_to_f32(0x3C00) == 1.0f);
    assert_true(kvs_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(kvs_f16_to_f32(0x03FF) == 0x1.ff8p-15f);
    assert_true(kvs_f16_to_f32(0x7BFF) == 65504.0f);
    assert_true(kvs_f16_to_f32(0xFC00) == -INFINITY);
    assert_true(isnan(kvs_f16_to_f32(0x7E00)));
    assert_true(kvs_f16_to_f32(0x3555) == 0x1.554p-2f);
    /* round trip of every finite f16 */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7C00) == 0x7C00)
            continue;
        assert_int_equal(kvs_f32_to_f16(kvs_f16_to_f32((uint16_t)h)), h);
    }
}

static void test_bf16(void **state)
{
    (void)state;
    assert_int_equal(kvs_f32_to_bf16(1.0f), 0x3F80);
    assert_int_equal(kvs_f32_to_bf16(bits_f32(0x3F808000u)), 0x3F80); /* tie: even */
    assert_int_equal(kvs_f32_to_bf16(bits_f32(0x3F818000u)), 0x3F82); /* tie: up to even */
    assert_int_equal(kvs_f32_to_bf16(bits_f32(0x3F808001u)), 0x3F81);
    assert_int_equal(kvs_f32_to_bf16(bits_f32(0x7F800001u)), 0x7FC0); /* NaN quieted */
    assert_true(kvs_bf16_to_f32(0xC040) == -3.0f);
}

/* Legacy 32-element blocks, values from the §2.3 table. */
static void test_dequant_legacy(void **state)
{
    (void)state;
    float out[32];
    uint8_t b[36];

    memset(b, 0, sizeof b); /* Q4_0: d = 0.5 */
    put16(b, 0x3800);
    b[2] = 0x1F;
    b[3] = 0x80;
    kvs_dequantize_row(scalar(), KVS_TYPE_Q4_0, b, out, 32);
    assert_true(out[0] == 3.5f);   /* (15-8)*0.5 */
    assert_true(out[16] == -3.5f); /* (1-8)*0.5 */
    assert_true(out[1] == -4.0f);  /* (0-8)*0.5 */
    assert_true(out[17] == 0.0f);  /* (8-8)*0.5 */

    memset(b, 0, sizeof b); /* Q4_1: d = 2, m = 1 */
    put16(b, 0x4000);
    put16(b + 2, 0x3C00);
    b[4] = 0xA3;
    kvs_dequantize_row(scalar(), KVS_TYPE_Q4_1, b, out, 32);
    assert_true(out[0] == 7.0f);
    assert_true(out[16] == 21.0f);
    assert_true(out[1] == 1.0f);

    memset(b, 0, sizeof b); /* Q5_0: d = 1, qh bits 0 and 17 */
    put16(b, 0x3C00);
    b[2] = 0x01;
    b[4] = 0x02;
    b[6] = 0x03;
    b[7] = 0xF0;
    kvs_dequantize_row(scalar(), KVS_TYPE_Q5_0, b, out, 32);
    assert_true(out[0] == 3.0f);    /* (3 | 16) - 16 */
    assert_true(out[16] == -16.0f); /* 0 - 16 */
    assert_true(out[17] == 15.0f);  /* (15 | 16) - 16 */
    assert_true(out[1] == -16.0f);

    memset(b, 0, sizeof b); /* Q5_1: d = 0.5, m = -1 */
    put16(b, 0x3800);
    put16(b + 2, 0xBC00);
    b[4] = 0x01;
    b[8] = 0x03;
    kvs_dequantize_row(scalar(), KVS_TYPE_Q5_1, b, out, 32);
    assert_true(out[0] == 8.5f); /* 0.5*19 - 1 */
    assert_true(out[1] == -1.0f);

    memset(b, 0, sizeof b); /* Q8_0: d = 0.5 */
    put16(b, 0x3800);
    b[2 + 3] = (uint8_t)-7;
    b[2 + 31] = 127;
    kvs_dequantize_row(scalar(), KVS_TYPE_Q8_0, b, out, 32);
    assert_true(out[3] == -3.5f);
    assert_true(out[31] == 63.5f);
    assert_true(out[0] == 0.0f);
}

static void test_dequant_q2_k(void **state)
{
    (void)state;
    uint8_t b[84];
    float out[256];
    memset(b, 0, sizeof b);
    put16(b + 80, 0x3800); /* d = 0.5 */
    put16(b + 82, 0x3400); /* dmin = 0.25 */
    b[0] = 0x23;           /* sub-block 0: scale 3, min 2 */
    b[4] = 0x51;           /* sub-block 4: scale 1, min 5 */
    b[16 + 0] = 0x02;      /* e=0: bits 0-1 of qs[0] = 2 */
    b[16 + 5] = 0x30;      /* e=69: qs[5], bits 4-5 = 3 */
    kvs_dequantize_row(scalar(), KVS_TYPE_Q2_K, b, out, 256);
    assert_true(out[0] == 2.5f);  /* 0.5*3*2 - 0.25*2 */
    assert_true(out[1] == -0.5f); /* 0 - 0.25*2 */
    assert_true(out[69] == 0.25f); /* 0.5*1*3 - 0.25*5 */
    assert_true(out[255] == 0.0f);
}

static void test_dequant_q3_k(void **state)
{
    (void)state;
    uint8_t b[110];
    float out[256];
    memset(b, 0, sizeof b);
    put16(b + 108, 0x4000); /* d = 2 */
    b[96 + 0] = 0x01;       /* scale 0 low4 = 1 */
    b[96 + 8] = 0x02;       /* scale 0 high2 = 2 -> (1|32)-32 = 1; scale 9 high2 = 0 */
    b[0] = 0x01;            /* hmask[0] bit 0: e=0 high bit set */
    b[32 + 0] = 0x03;       /* e=0 low2 = 3 */
    b[32 + 54] = 0x01;      /* e=150: qs[32+22], bits 0-1 = 1; hmask[22] bit 4 clear */
    kvs_dequantize_row(scalar(), KVS_TYPE_Q3_K, b, out, 256);
    assert_true(out[0] == 6.0f);    /* 2*1*3 */
    assert_true(out[1] == -8.0f);   /* 2*1*(0-4) */
    assert_true(out[150] == 192.0f); /* 2*(-32)*(1-4) */
}

static void test_dequant_q4_k(void **state)
{
    (void)state;
    uint8_t b[144];
    float out[256];
    memset(b, 0, sizeof b);
    put16(b, 0x3C00);     /* d = 1 */
    put16(b + 2, 0x3800); /* dmin = 0.5 */
    uint8_t *s = b + 4;
    s[0] = 3;             /* sc[0] = 3 */
    s[4] = 2;             /* mn[0] = 2 */
    s[9] = 0x5A;          /* sc[5] low = 0xA, mn[5] low = 5 */
    s[1] |= 2 << 6;       /* sc[5] high2 = 2 -> 42 */
    s[5] |= 1 << 6;       /* mn[5] high2 = 1 -> 21 */
    uint8_t *qs = b + 16;
    qs[0] = 0x07;         /* e=0 low nibble 7 */
    qs[65] = 0x90;        /* e=161: c=2, r=33 -> qs[65] high nibble 9 */
    kvs_dequantize_row(scalar(), KVS_TYPE_Q4_K, b, out, 256);
    assert_true(out[0] == 20.0f);   /* 1*3*7 - 0.5*2 */
    assert_true(out[1] == -1.0f);   /* 0 - 0.5*2 */
    assert_true(out[161] == 367.5f); /* 42*9 - 0.5*21 */
    assert_true(out[160] == -10.5f);
}

static void test_dequant_q5_k(void **state)
{
    (void)state;
    uint8_t b[176];
    float out[256];
    memset(b, 0, sizeof b);
    put16(b, 0x3C00);     /* d = 1 */
    put16(b + 2, 0x3C00); /* dmin = 1 */
    b[4 + 0] = 1;         /* sc[0] = 1, mn[0] = 0 */
    b[4 + 1] = 2;         /* sc[1] = 2 */
    b[4 + 5] = 1;         /* mn[1] = 1 */
    b[16 + 3] = 0x03;     /* qh[3]: bit 0 (e=3) and bit 1 (e=35) */
    b[48 + 3] = 0x42;     /* e=3 low nibble 2, e=35 high nibble 4 */
    kvs_dequantize_row(scalar(), KVS_TYPE_Q5_K, b, out, 256);
    assert_true(out[3] == 18.0f); /* 1*(2+16) */
    assert_true(out[35] == 39.0f); /* 2*(4+16) - 1 */
    assert_true(out[36] == -1.0f);
}

static void test_dequant_q6_k(void **state)
{
    (void)state;
    uint8_t b[210];
    float out[256];
    memset(b, 0, sizeof b);
    put16(b + 208, 0x3400); /* d = 0.25 */
    int8_t *sc = (int8_t *)(b + 192);
    sc[0] = 2;
    sc[9] = -3;
    sc[13] = 1;
    b[0] = 0x05;        /* ql[0] low nibble 5 (e=0) */
    b[128 + 0] = 0x02;  /* qh[0] bits 0-1 = 2 -> q = 5|32 - 32 = 5 */
    b[86] = 0x30;       /* ql[64+22]: e=150 low nibble 0, e=214 high nibble 3 */
    kvs_dequantize_row(scalar(), KVS_TYPE_Q6_K, b, out, 256);
    assert_true(out[0] == 2.5f);    /* 0.25*2*5 */
    assert_true(out[150] == 24.0f); /* 0.25*(-3)*(-32) */
    assert_true(out[214] == -7.25f); /* 0.25*1*(3-32) */
}

/* Q8_0 activations: mult = 127/amax = 1 exactly when amax = 127, so the
 * products are the inputs and ties must round half to even. */
static void test_quant_q8_0_ties(void **state)
{
    (void)state;
    float x[32] = {127.0f, 2.5f, 3.5f, -2.5f, 0.5f, 1.5f, -0.5f, -1.5f, 126.5f, 2.4f};
    uint8_t q[34];
    kvs_quantize_act(scalar(), KVS_TYPE_Q8_0, x, q, 32);
    assert_int_equal(q[0] | q[1] << 8, 0x3C00); /* d = 1 */
    const int8_t *qs = (const int8_t *)(q + 2);
    static const int want[10] = {127, 2, 4, -2, 0, 2, 0, -2, 126, 2};
    for (int j = 0; j < 10; j++)
        assert_int_equal(qs[j], want[j]);

    uint8_t q1[36]; /* Q8_1: s = f16(d * sum q) = 127+2+4-2+0+2+0-2+126+2 = 259 */
    kvs_quantize_act(scalar(), KVS_TYPE_Q8_1, x, q1, 32);
    assert_int_equal(q1[0] | q1[1] << 8, 0x3C00);
    assert_true(kvs_f16_to_f32((uint16_t)(q1[2] | q1[3] << 8)) == 259.0f);

    float z[32] = {0};
    kvs_quantize_act(scalar(), KVS_TYPE_Q8_0, z, q, 32);
    for (int j = 0; j < 34; j++)
        assert_int_equal(q[j], 0);
}

/* Q8_K: the signed max 127 gives iscale = -1, so q = -x (ties to even) and
 * d = -1. */
static void test_quant_q8_k(void **state)
{
    (void)state;
    float x[256] = {0};
    x[0] = 127.0f;
    x[1] = 2.5f;
    x[2] = 3.5f;
    x[3] = -0.5f;
    x[17] = -126.5f;
    uint8_t q[292];
    kvs_quantize_act(scalar(), KVS_TYPE_Q8_K, x, q, 256);
    float d;
    memcpy(&d, q, 4);
    assert_true(d == -1.0f);
    const int8_t *qs = (const int8_t *)(q + 4);
    assert_int_equal(qs[0], -127);
    assert_int_equal(qs[1], -2);
    assert_int_equal(qs[2], -4);
    assert_int_equal(qs[3], 0);
    assert_int_equal(qs[17], 126);
    int16_t bs[16];
    memcpy(bs, q + 260, sizeof bs);
    assert_int_equal(bs[0], -127 - 2 - 4);
    assert_int_equal(bs[1], 126);
    assert_int_equal(bs[2], 0);

    /* a negative extreme: max = -63.5 -> iscale = 2 exactly, d = 0.5 */
    memset(x, 0, sizeof x);
    x[5] = -63.5f;
    x[6] = 1.25f; /* 2.5 -> 2 */
    kvs_quantize_act(scalar(), KVS_TYPE_Q8_K, x, q, 256);
    memcpy(&d, q, 4);
    assert_true(d == 0.5f);
    assert_int_equal(qs[5], -127);
    assert_int_equal(qs[6], 2);
}

static void test_quant_weights(void **state)
{
    (void)state;
    float x[32];
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j - 16); /* -16..15 */
    uint8_t b[34];
    /* Q8_0: amax 16, d = 16/127, q = round(x * 127/16) */
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q8_0, x, b, 32), KVS_OK);
    assert_int_equal(b[0] | b[1] << 8, kvs_f32_to_f16(16.0f / 127.0f));
    assert_int_equal((int8_t)b[2], -127);      /* x = -16 */
    assert_int_equal((int8_t)b[2 + 17], 8);    /* x = 1: 7.9375 -> 8 */
    assert_int_equal((int8_t)b[2 + 31], 119);  /* x = 15: 119.06 -> 119 */
    /* Q4_0: max = -16 -> d = 2, q = trunc(x/2 + 8.5) capped at 15 */
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q4_0, x, b, 32), KVS_OK);
    assert_int_equal(b[0] | b[1] << 8, 0x4000);
    assert_int_equal(b[2] & 0xF, 0);        /* x=-16: -8+8.5 = 0.5 -> 0 */
    assert_int_equal(b[2] >> 4, 8);         /* x=0: 8.5 -> 8 */
    assert_int_equal(b[2 + 15] >> 4, 15);   /* x=15: 16 -> min(15) */
    assert_int_equal(b[2 + 1] & 0xF, 1);    /* x=-15: 1.0 -> 1 */
    /* Q4_1: min -16, max 15, d = 31/15 */
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q4_1, x, b, 32), KVS_OK);
    assert_int_equal(b[2] | b[3] << 8, 0xCC00); /* m = -16 */
    assert_int_equal(b[4 + 15] >> 4, 15);
    assert_int_equal(b[4] & 0xF, 0);
    /* Q5_0: max -16 -> d = 1, q = trunc(x + 16.5): x=-16 -> 0, x=15 -> 31 */
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q5_0, x, b, 32), KVS_OK);
    assert_int_equal(b[0] | b[1] << 8, 0x3C00);
    float out[32];
    kvs_dequantize_row(scalar(), KVS_TYPE_Q5_0, b, out, 32);
    for (int j = 0; j < 32; j++)
        assert_true(out[j] == x[j]); /* integers in range are exact */
    /* Q5_1: d = 31/31 = 1, m = -16: exact as well */
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q5_1, x, b, 32), KVS_OK);
    kvs_dequantize_row(scalar(), KVS_TYPE_Q5_1, b, out, 32);
    for (int j = 0; j < 32; j++)
        assert_true(out[j] == x[j]);
    float y[256] = {0};
    uint8_t big[144];
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q8_1, y, big, 256), KVS_ERR_UNSUPPORTED);
    assert_int_equal(kvs_quantize_weights(KVS_TYPE_Q8_0, x, b, 31), KVS_ERR_ARG);
}

/* K-quant weight quantizers: integers on the quant grid come back (up to
 * the F16 rounding of d: relative 1e-3), and smooth data comes back within
 * each type's expected error (RMS error / RMS value, two super-blocks of a
 * sine with an offset, sub-blocks of different ranges). */
static void test_quant_weights_k(void **state)
{
    (void)state;
    static const struct {
        enum kvs_type t;
        int qlo, qhi; /* an exactly representable integer range */
        double rel;   /* RMS error bound on the smooth data */
    } cases[] = {
        {KVS_TYPE_Q2_K, 0, 3, 0.30},  {KVS_TYPE_Q3_K, -4, 3, 0.20}, {KVS_TYPE_Q4_K, 0, 15, 0.06},
        {KVS_TYPE_Q5_K, 0, 31, 0.03}, {KVS_TYPE_Q6_K, -32, 31, 0.015},
    };
    float x[512], out[512];
    uint8_t b[2 * 210];
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int span = cases[c].qhi - cases[c].qlo + 1;
        for (int e = 0; e < 512; e++)
            x[e] = (float)(cases[c].qlo + (e * 7) % span);
        for (int e = 0; e < 512; e += 16) /* every sub-block spans the whole grid */
            x[e] = (float)cases[c].qlo, x[e + 1] = (float)cases[c].qhi;
        assert_int_equal(kvs_quantize_weights(cases[c].t, x, b, 512), KVS_OK);
        kvs_dequantize_row(scalar(), cases[c].t, b, out, 512);
        for (int e = 0; e < 512; e++)
            if (fabsf(out[e] - x[e]) > 1e-3f * fabsf(x[e]) + 1e-3f) {
                print_error("%s [%d]: %g -> %g\n", kvs_type_name(cases[c].t), e, x[e], out[e]);
                fail();
            }
        double se = 0.0, sx = 0.0;
        for (int e = 0; e < 512; e++)
            x[e] = 0.3f + sinf((float)e * 0.37f) * (1.0f + (float)(e / 32) * 0.2f);
        assert_int_equal(kvs_quantize_weights(cases[c].t, x, b, 512), KVS_OK);
        kvs_dequantize_row(scalar(), cases[c].t, b, out, 512);
        for (int e = 0; e < 512; e++) {
            se += (double)(out[e] - x[e]) * (out[e] - x[e]);
            sx += (double)x[e] * x[e];
        }
        double rel = sqrt(se / sx);
        print_message("%s: RMS error %.4f of RMS value\n", kvs_type_name(cases[c].t), rel);
        assert_true(rel < cases[c].rel);
        assert_int_equal(kvs_quantize_weights(cases[c].t, x, b, 100), KVS_ERR_ARG);
    }
}

static void test_types(void **state)
{
    (void)state;
    assert_int_equal(kvs_vec_dot_type(KVS_TYPE_Q4_0), KVS_TYPE_Q8_0);
    assert_int_equal(kvs_vec_dot_type(KVS_TYPE_Q5_1), KVS_TYPE_Q8_1);
    assert_int_equal(kvs_vec_dot_type(KVS_TYPE_Q3_K), KVS_TYPE_Q8_K);
    assert_int_equal(kvs_vec_dot_type(KVS_TYPE_F16), KVS_TYPE_F16);
    assert_true(kvs_type_supported(KVS_TYPE_Q6_K));
    assert_false(kvs_type_supported(KVS_TYPE_IQ2_XXS));
    assert_false(kvs_type_supported(KVS_TYPE_Q8_K));
    /* Q4_0 for 1024 features and 3 tokens: the packed GEMM layout (8 quads
     * of blocks * 256 bytes * 3, + 64 for alignment) is larger than Q8_0's
     * 32 blocks * 34 bytes * 3 */
    assert_int_equal(kvs_matmul_scratch_bytes(KVS_TYPE_Q4_0, 1024, 3), 6208);
    /* Q6_K for 512 features and 2 tokens: the K-quant GEMM layout (2
     * super-blocks * 320 bytes * 2, + 64) is larger than Q8_K's 2 * 292 * 2 */
    assert_int_equal(kvs_matmul_scratch_bytes(KVS_TYPE_Q6_K, 512, 2), 1344);
    assert_non_null(kvs_kernels_get(KVS_ISA_SCALAR));
    assert_non_null(kvs_kernels_best());
    assert_string_equal(kvs_isa_name(KVS_ISA_AVX512), "avx512");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_dequant_legacy),
        cmocka_unit_test(test_dequant_q2_k),
        cmocka_unit_test(test_dequant_q3_k),
        cmocka_unit_test(test_dequant_q4_k),
        cmocka_unit_test(test_dequant_q5_k),
        cmocka_unit_test(test_dequant_q6_k),
        cmocka_unit_test(test_quant_q8_0_ties),
        cmocka_unit_test(test_quant_q8_k),
        cmocka_unit_test(test_quant_weights),
        cmocka_unit_test(test_quant_weights_k),
        cmocka_unit_test(test_types),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Private to the kernels module: block layouts, the per-ISA function table
 * and the scalar reference kernels shared by every ISA file.
 *
 * Block layouts follow ../shared/docs/gguf-facts.md §2.3/§2.4 (ggml's
 * ggml-common.h). They are plain C structs of byte/uint16 fields whose
 * offsets equal the file layout on every ABI we target (little-endian x86-64
 * and AArch64; the sizes are pinned by static_assert below). All f16 fields
 * are raw binary16 bit patterns. */
#ifndef KVS_KERNELS_IMPL_H
#define KVS_KERNELS_IMPL_H

#include <assert.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

#define KVS_QK 32   /* legacy block size */
#define KVS_QK_K 256 /* K-quant super-block size */

typedef struct { uint16_t d; uint8_t qs[16]; } kvs_block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[16]; } kvs_block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } kvs_block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } kvs_block_q5_1;
typedef struct { uint16_t d; int8_t qs[32]; } kvs_block_q8_0;
typedef struct { uint16_t d, s; int8_t qs[32]; } kvs_block_q8_1;
typedef struct { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; } kvs_block_q2_K;
typedef struct { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; } kvs_block_q3_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } kvs_block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } kvs_block_q5_K;
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } kvs_block_q6_K;
typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } kvs_block_q8_K;

static_assert(sizeof(kvs_block_q4_0) == 18, "Q4_0 block is 18 bytes");
static_assert(sizeof(kvs_block_q4_1) == 20, "Q4_1 block is 20 bytes");
static_assert(sizeof(kvs_block_q5_0) == 22, "Q5_0 block is 22 bytes");
static_assert(sizeof(kvs_block_q5_1) == 24, "Q5_1 block is 24 bytes");
static_assert(sizeof(kvs_block_q8_0) == 34, "Q8_0 block is 34 bytes");
static_assert(sizeof(kvs_block_q8_1) == 36, "Q8_1 block is 36 bytes");
static_assert(sizeof(kvs_block_q2_K) == 84, "Q2_K block is 84 bytes");
static_assert(sizeof(kvs_block_q3_K) == 110, "Q3_K block is 110 bytes");
static_assert(sizeof(kvs_block_q4_K) == 144, "Q4_K block is 144 bytes");
static_assert(sizeof(kvs_block_q5_K) == 176, "Q5_K block is 176 bytes");
static_assert(sizeof(kvs_block_q6_K) == 210, "Q6_K block is 210 bytes");
static_assert(sizeof(kvs_block_q8_K) == 292, "Q8_K block is 292 bytes");

/* Dequantize n elements (multiple of the block size). */
typedef void (*kvs_dequant_fn)(const void *src, float *dst, int64_t n);
/* Quantize n activations (multiple of the block size). */
typedef void (*kvs_quant_act_fn)(const float *src, void *dst, int64_t n);
/* Dot of one weight row with one activation row (vec_dot type), n elements. */
typedef float (*kvs_dot_fn)(int64_t n, const void *w, const void *a);
/* Dot of one weight row with 4 activation rows a + t*a_stride bytes, t<4. */
typedef void (*kvs_dot4_fn)(int64_t n, const void *w, const void *a, size_t a_stride, float out[4]);

/* Register-blocked GEMM over a packed activation layout (an ISA's own; see
 * kvs_kernels_pack_row_bytes for its size): pack_act quantizes one F32 row of
 * n activations exactly as quant_act does for the weight type's vec_dot type
 * and stores it in the kernel's layout; gemm computes
 *   y[t * y_stride + r] = dot(weight row r, activation row t)
 * for r < nr (rows w + r * w_stride bytes) and t < nt (packed rows a + t *
 * a_stride bytes), with the same integer sums and per-block scales as dot. */
typedef void (*kvs_pack_act_fn)(const float *src, void *dst, int64_t n);
typedef void (*kvs_gemm_fn)(int64_t n, const void *w, size_t w_stride, int64_t nr, const void *a,
                            size_t a_stride, int64_t nt, float *y, size_t y_stride);

/* One ISA's table, indexed by enum kvs_type. dequant/quant_act/dot entries
 * are non-NULL for every supported type (scalar where the ISA has no special
 * path); dot4 may be NULL (matmul then calls dot four times); pack_act and
 * gemm are both set or both NULL (matmul then uses dot/dot4). */
struct kvs_kernels {
    enum kvs_isa isa;
    kvs_dequant_fn dequant[KVS_TYPE_COUNT];
    kvs_quant_act_fn quant_act[KVS_TYPE_COUNT];
    kvs_dot_fn dot[KVS_TYPE_COUNT];
    kvs_dot4_fn dot4[KVS_TYPE_COUNT];
    /* Float weights (F16, BF16): the dot as llama.cpp's prompt GEMM (its
     * tinyBLAS, which ggml runs for a matmul of 2+ tokens whose weight has a
     * multiple of 4 rows) sums it: one vector accumulator per output over
     * the whole row, then a horizontal add, in F32; each falls back to dot
     * where n is not a multiple of its vector width (as tinyBLAS declines
     * then). NULL: prompts sum as dot does (matmul then uses dot). */
    kvs_dot_fn dot_gemm[KVS_TYPE_COUNT];
    kvs_pack_act_fn pack_act[KVS_TYPE_COUNT];
    kvs_gemm_fn gemm[KVS_TYPE_COUNT];
    /* The same GEMM over packed weights (kvs_matrix_pack): w is the packed
     * group of the first row (rows start at a multiple of 4), w_stride the
     * group size (kvs_kernels_packw_group_bytes); may be NULL. */
    kvs_gemm_fn gemm_packed[KVS_TYPE_COUNT];
    /* y[i] = f16(f16(y[i]) * s) and y[i] = f16(f16(y[i]) + f16(x[i]) * s)
     * over n F16 values (attention's F16 V accumulator), round to nearest
     * even. */
    void (*f16_scale)(uint16_t *y, float s, int64_t n);
    void (*f16_mad)(uint16_t *y, const uint16_t *x, float s, int64_t n);
};

/* Bytes of one packed GEMM activation row of n elements for weights of
 * `type` (0 if the type has no packed layout): Q8_0/Q4_0 quads of 32-element
 * blocks, each quad 128 quants, 16 int32 offset corrections and 16 float
 * scales; Q4_K/Q5_K/Q6_K KVS_PACKK_BYTES per 256-element super-block. */
#define KVS_PACK_QUAD_BYTES 256
/* K-quant weights (Q4_K, Q5_K, Q6_K): per 256-element super-block the Q8_K
 * quants, bsums, pair sums of bsums and d (kernels_x86_impl.h). */
#define KVS_PACKK_BYTES 320
size_t kvs_kernels_pack_row_bytes(enum kvs_type type, int64_t n);

/* Packed weights (kvs_matrix_pack): a group of KVS_PACKW_ROWS rows is
 * ceil(quads / 2) pairs of KVS_PACKW_PAIR_BYTES: quants of quad 2p (4 rows x
 * 128 bytes), of quad 2p + 1, then their scales (4 rows x 4 F16 each). */
#define KVS_PACKW_ROWS 4
#define KVS_PACKW_QUAD_QBYTES 512 /* 4 rows x 128 quants */
#define KVS_PACKW_PAIR_BYTES (2 * KVS_PACKW_QUAD_QBYTES + 2 * 32)
size_t kvs_kernels_packw_group_bytes(enum kvs_type type, int64_t n);

/* Bytes per block and elements per block for the types this module handles;
 * false otherwise. (Private so that kernels does not depend on the gguf
 * reader being linked first; values are gguf-facts §2.1.) */
bool kvs_kernels_block(enum kvs_type type, uint32_t *elems, uint32_t *bytes);
size_t kvs_kernels_row_bytes(enum kvs_type type, int64_t n);

/* --- scalar reference kernels (kernels_ref.c) --------------------------- */
void kvs_ref_dequant_f32(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_f16(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_bf16(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q4_0(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q4_1(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q5_0(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q5_1(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q8_0(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q8_1(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q2_K(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q3_K(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q4_K(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q5_K(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q6_K(const void *src, float *dst, int64_t n);
void kvs_ref_dequant_q8_K(const void *src, float *dst, int64_t n);

void kvs_ref_quant_f32(const float *src, void *dst, int64_t n);
void kvs_ref_quant_f16(const float *src, void *dst, int64_t n);
void kvs_ref_quant_bf16(const float *src, void *dst, int64_t n);
void kvs_ref_quant_q8_0(const float *src, void *dst, int64_t n);
void kvs_ref_quant_q8_1(const float *src, void *dst, int64_t n);
void kvs_ref_quant_q8_K(const float *src, void *dst, int64_t n);

float kvs_ref_dot_f32(int64_t n, const void *w, const void *a);
float kvs_ref_dot_f16(int64_t n, const void *w, const void *a);
float kvs_ref_dot_bf16(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q4_0(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q4_1(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q5_0(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q5_1(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q8_0(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q2_K(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q3_K(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q4_K(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q5_K(int64_t n, const void *w, const void *a);
float kvs_ref_dot_q6_K(int64_t n, const void *w, const void *a);
void kvs_ref_f16_scale(uint16_t *y, float s, int64_t n);
/* K-quant weight quantizers (kernels_wquant_k.c; kvs_quantize_weights). */
void kvs_wquant_q2_K(const float *src, void *dst, int64_t n);
void kvs_wquant_q3_K(const float *src, void *dst, int64_t n);
void kvs_wquant_q4_K(const float *src, void *dst, int64_t n);
void kvs_wquant_q5_K(const float *src, void *dst, int64_t n);
void kvs_wquant_q6_K(const float *src, void *dst, int64_t n);
void kvs_ref_f16_mad(uint16_t *y, const uint16_t *x, float s, int64_t n);

/* Q4_K/Q5_K packed 6-bit scale and min of sub-block j (gguf-facts §2.4). */
static inline void kvs_q4k_scale_min(int j, const uint8_t *b, uint8_t *sc, uint8_t *mn)
{
    if (j < 4) {
        *sc = b[j] & 63;
        *mn = b[j + 4] & 63;
    } else {
        *sc = (uint8_t)((b[j + 4] & 0xF) | ((b[j - 4] >> 6) << 4));
        *mn = (uint8_t)((b[j + 4] >> 4) | ((b[j] >> 6) << 4));
    }
}

/* Q3_K signed 6-bit scale of 16-element sub-block s (0..15) from the 12
 * packed bytes b: low 4 bits in b[0..7] (s < 8) or their high halves, high
 * 2 bits in b[8 + s % 4] at bit 2 * (s / 4); minus 32 (gguf-facts §2.4). */
static inline int kvs_q3k_scale(const uint8_t *b, int s)
{
    int low4 = s < 8 ? (b[s] & 0xF) : (b[s - 8] >> 4);
    int high2 = (b[8 + s % 4] >> (2 * (s / 4))) & 3;
    return (low4 | high2 << 4) - 32;
}

/* Table entries shared by all ISAs; an ISA table lists these first and then
 * overrides the entries it accelerates (hence -Woverride-init is silenced
 * around those initializers). */
#define KVS_KERNELS_REF_ENTRIES                                                                      \
    .dequant =                                                                                       \
        {                                                                                            \
            [KVS_TYPE_F32] = kvs_ref_dequant_f32,   [KVS_TYPE_F16] = kvs_ref_dequant_f16,           \
            [KVS_TYPE_BF16] = kvs_ref_dequant_bf16, [KVS_TYPE_Q4_0] = kvs_ref_dequant_q4_0,         \
            [KVS_TYPE_Q4_1] = kvs_ref_dequant_q4_1, [KVS_TYPE_Q5_0] = kvs_ref_dequant_q5_0,         \
            [KVS_TYPE_Q5_1] = kvs_ref_dequant_q5_1, [KVS_TYPE_Q8_0] = kvs_ref_dequant_q8_0,         \
            [KVS_TYPE_Q8_1] = kvs_ref_dequant_q8_1, [KVS_TYPE_Q2_K] = kvs_ref_dequant_q2_K,         \
            [KVS_TYPE_Q3_K] = kvs_ref_dequant_q3_K, [KVS_TYPE_Q4_K] = kvs_ref_dequant_q4_K,         \
            [KVS_TYPE_Q5_K] = kvs_ref_dequant_q5_K, [KVS_TYPE_Q6_K] = kvs_ref_dequant_q6_K,         \
            [KVS_TYPE_Q8_K] = kvs_ref_dequant_q8_K,                                                 \
        },                                                                                           \
    .quant_act =                                                                                     \
        {                                                                                            \
            [KVS_TYPE_F32] = kvs_ref_quant_f32,   [KVS_TYPE_F16] = kvs_ref_quant_f16,               \
            [KVS_TYPE_BF16] = kvs_ref_quant_bf16, [KVS_TYPE_Q8_0] = kvs_ref_quant_q8_0,             \
            [KVS_TYPE_Q8_1] = kvs_ref_quant_q8_1, [KVS_TYPE_Q8_K] = kvs_ref_quant_q8_K,             \
        },                                                                                           \
    .dot = {                                                                                         \
        [KVS_TYPE_F32] = kvs_ref_dot_f32,   [KVS_TYPE_F16] = kvs_ref_dot_f16,                       \
        [KVS_TYPE_BF16] = kvs_ref_dot_bf16, [KVS_TYPE_Q4_0] = kvs_ref_dot_q4_0,                     \
        [KVS_TYPE_Q4_1] = kvs_ref_dot_q4_1, [KVS_TYPE_Q5_0] = kvs_ref_dot_q5_0,                     \
        [KVS_TYPE_Q5_1] = kvs_ref_dot_q5_1, [KVS_TYPE_Q8_0] = kvs_ref_dot_q8_0,                     \
        [KVS_TYPE_Q2_K] = kvs_ref_dot_q2_K, [KVS_TYPE_Q3_K] = kvs_ref_dot_q3_K,                     \
        [KVS_TYPE_Q4_K] = kvs_ref_dot_q4_K, [KVS_TYPE_Q5_K] = kvs_ref_dot_q5_K,                     \
        [KVS_TYPE_Q6_K] = kvs_ref_dot_q6_K,                                                         \
    },                                                                                               \
    .f16_scale = kvs_ref_f16_scale, .f16_mad = kvs_ref_f16_mad

/* The scalar table (kernels.c) and the SIMD tables (arch/ files). */
extern const struct kvs_kernels kvs_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
extern const struct kvs_kernels kvs_kernels_avx2;
extern const struct kvs_kernels kvs_kernels_avx512;
extern const struct kvs_kernels kvs_kernels_avx512_bf16; /* the same + AVX512-BF16 */
#endif
#if defined(__aarch64__) || defined(__ARM_NEON)
extern const struct kvs_kernels kvs_kernels_neon;
#endif

#endif

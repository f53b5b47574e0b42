/* Kernel dispatch, the public per-type entry points and the scalar table.
 * ISA selection: gguf-facts §2.5 fixes what each ISA must compute; which
 * table runs is picked from CPU features (and KVASIR_ISA for testing). */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "kernels/kernels_impl.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

/* F16C via CPUID leaf 1 (ECX bit 29): clang's __builtin_cpu_supports does
 * not know "f16c". */
static bool kvs_cpu_has_f16c(void)
{
    unsigned a, b, c, d;
    return __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) != 0;
}
#endif

const struct kvs_kernels kvs_kernels_scalar = {
    .isa = KVS_ISA_SCALAR,
    KVS_KERNELS_REF_ENTRIES,
};

bool kvs_kernels_block(enum kvs_type type, uint32_t *elems, uint32_t *bytes)
{
    uint32_t e, b;
    switch (type) {
    case KVS_TYPE_F32: e = 1, b = 4; break;
    case KVS_TYPE_F16: e = 1, b = 2; break;
    case KVS_TYPE_BF16: e = 1, b = 2; break;
    case KVS_TYPE_Q4_0: e = 32, b = 18; break;
    case KVS_TYPE_Q4_1: e = 32, b = 20; break;
    case KVS_TYPE_Q5_0: e = 32, b = 22; break;
    case KVS_TYPE_Q5_1: e = 32, b = 24; break;
    case KVS_TYPE_Q8_0: e = 32, b = 34; break;
    case KVS_TYPE_Q8_1: e = 32, b = 36; break;
    case KVS_TYPE_Q2_K: e = 256, b = 84; break;
    case KVS_TYPE_Q3_K: e = 256, b = 110; break;
    case KVS_TYPE_Q4_K: e = 256, b = 144; break;
    case KVS_TYPE_Q5_K: e = 256, b = 176; break;
    case KVS_TYPE_Q6_K: e = 256, b = 210; break;
    case KVS_TYPE_Q8_K: e = 256, b = 292; break;
    default: return false;
    }
    if (elems)
        *elems = e;
    if (bytes)
        *bytes = b;
    return true;
}

size_t kvs_kernels_row_bytes(enum kvs_type type, int64_t n)
{
    uint32_t e, b;
    if (n < 0 || !kvs_kernels_block(type, &e, &b) || n % e != 0)
        return 0;
    return (size_t)(n / e) * b;
}

size_t kvs_kernels_pack_row_bytes(enum kvs_type type, int64_t n)
{
    switch (type) {
    case KVS_TYPE_Q8_0: case KVS_TYPE_Q4_0:
        if (n <= 0 || n % 32 != 0)
            return 0;
        return (size_t)((n + 127) / 128) * KVS_PACK_QUAD_BYTES;
    case KVS_TYPE_Q2_K: case KVS_TYPE_Q3_K: case KVS_TYPE_Q4_K: case KVS_TYPE_Q5_K: case KVS_TYPE_Q6_K:
        if (n <= 0 || n % KVS_QK_K != 0)
            return 0;
        return (size_t)(n / KVS_QK_K) * KVS_PACKK_BYTES;
    default:
        return 0;
    }
}

bool kvs_type_supported(enum kvs_type type)
{
    switch (type) {
    case KVS_TYPE_F32: case KVS_TYPE_F16: case KVS_TYPE_BF16:
    case KVS_TYPE_Q4_0: case KVS_TYPE_Q4_1: case KVS_TYPE_Q5_0: case KVS_TYPE_Q5_1:
    case KVS_TYPE_Q8_0: case KVS_TYPE_Q2_K: case KVS_TYPE_Q3_K: case KVS_TYPE_Q4_K:
    case KVS_TYPE_Q5_K: case KVS_TYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

enum kvs_type kvs_vec_dot_type(enum kvs_type type)
{
    switch (type) {
    case KVS_TYPE_F32: return KVS_TYPE_F32;
    case KVS_TYPE_F16: return KVS_TYPE_F16;
    case KVS_TYPE_BF16: return KVS_TYPE_BF16;
    case KVS_TYPE_Q4_0: case KVS_TYPE_Q5_0: case KVS_TYPE_Q8_0: return KVS_TYPE_Q8_0;
    case KVS_TYPE_Q4_1: case KVS_TYPE_Q5_1: return KVS_TYPE_Q8_1;
    case KVS_TYPE_Q2_K: case KVS_TYPE_Q3_K: case KVS_TYPE_Q4_K: case KVS_TYPE_Q5_K:
    case KVS_TYPE_Q6_K: return KVS_TYPE_Q8_K;
    default: return KVS_TYPE_COUNT;
    }
}

static bool kvs_isa_available(enum kvs_isa isa)
{
    switch (isa) {
    case KVS_ISA_SCALAR: return true;
#if defined(__x86_64__) || defined(_M_X64)
    case KVS_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               kvs_cpu_has_f16c();
    case KVS_ISA_AVX512:
        __builtin_cpu_init();
        return kvs_isa_available(KVS_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
    case KVS_ISA_NEON: return true;
#endif
    default: return false;
    }
}

const struct kvs_kernels *kvs_kernels_get(enum kvs_isa isa)
{
    if (!kvs_isa_available(isa))
        return NULL;
    switch (isa) {
    case KVS_ISA_SCALAR: return &kvs_kernels_scalar;
#if defined(__x86_64__) || defined(_M_X64)
    case KVS_ISA_AVX2: return &kvs_kernels_avx2;
    case KVS_ISA_AVX512:
        /* BF16 dots as ggml built for this CPU: VDPBF16PS where it exists */
        return __builtin_cpu_supports("avx512bf16") ? &kvs_kernels_avx512_bf16 : &kvs_kernels_avx512;
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
    case KVS_ISA_NEON: return &kvs_kernels_neon;
#endif
    default: return NULL;
    }
}

/* The best table, unless the environment variable KVASIR_ISA (scalar, avx2,
 * avx512, neon) names another one this CPU supports. */
const struct kvs_kernels *kvs_kernels_best(void)
{
    const char *env = getenv("KVASIR_ISA");
    if (env && *env) {
        for (int i = KVS_ISA_SCALAR; i <= KVS_ISA_NEON; i++) {
            if (strcmp(env, kvs_isa_name((enum kvs_isa)i)) == 0) {
                const struct kvs_kernels *k = kvs_kernels_get((enum kvs_isa)i);
                if (k)
                    return k;
                KVS_LOGW("KVASIR_ISA=%s is not supported on this CPU; using the best ISA", env);
                break;
            }
        }
    }
    static const enum kvs_isa order[] = {KVS_ISA_AVX512, KVS_ISA_AVX2, KVS_ISA_NEON, KVS_ISA_SCALAR};
    for (size_t i = 0; i < sizeof order / sizeof order[0]; i++) {
        const struct kvs_kernels *k = kvs_kernels_get(order[i]);
        if (k)
            return k;
    }
    return &kvs_kernels_scalar;
}

enum kvs_isa kvs_kernels_isa(const struct kvs_kernels *k)
{
    return k ? k->isa : KVS_ISA_SCALAR;
}

const char *kvs_isa_name(enum kvs_isa isa)
{
    switch (isa) {
    case KVS_ISA_SCALAR: return "scalar";
    case KVS_ISA_AVX2: return "avx2";
    case KVS_ISA_AVX512: return "avx512";
    case KVS_ISA_NEON: return "neon";
    default: return "?";
    }
}

void kvs_dequantize_row(const struct kvs_kernels *k, enum kvs_type type, const void *src, float *dst,
                        int64_t n)
{
    assert(type >= 0 && type < KVS_TYPE_COUNT && k->dequant[type]);
    k->dequant[type](src, dst, n);
}

void kvs_quantize_act(const struct kvs_kernels *k, enum kvs_type act_type, const float *src, void *dst,
                      int64_t n)
{
    assert(act_type >= 0 && act_type < KVS_TYPE_COUNT && k->quant_act[act_type]);
    k->quant_act[act_type](src, dst, n);
}

float kvs_vec_dot(const struct kvs_kernels *k, enum kvs_type type, int64_t n, const void *w_row,
                  const void *act)
{
    assert(type >= 0 && type < KVS_TYPE_COUNT && k->dot[type]);
    return k->dot[type](n, w_row, act);
}

void kvs_vec_f16_scale(const struct kvs_kernels *k, uint16_t *y, float s, int64_t n)
{
    k->f16_scale(y, s, n);
}

void kvs_vec_f16_mad(const struct kvs_kernels *k, uint16_t *y, const uint16_t *x, float s, int64_t n)
{
    k->f16_mad(y, x, s, n);
}

bool kvs_vec_all_finite(const float *x, size_t n)
{
    float acc = 0.0f;
    for (size_t i = 0; i < n; i++) acc += x[i] * 0.0f; /* NaN for a NaN or an infinity */
    return acc == 0.0f;
}

/* AVX2 + FMA + F16C kernels (compiled with -mavx2 -mfma -mf16c; selected at
 * run time only when the CPU has them). */
#include <immintrin.h>

#include "kernels/kernels_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

const struct kvs_kernels kvs_kernels_avx2 = {
    .isa = KVS_ISA_AVX2,
    KVS_KERNELS_REF_ENTRIES,
};

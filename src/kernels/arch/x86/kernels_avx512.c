/* AVX-512 (F, BW, VL, DQ, VNNI) kernels (compiled with -mavx512*; selected at
 * run time only when the CPU has them). */
#include <immintrin.h>

#include "kernels/kernels_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

const struct kvs_kernels kvs_kernels_avx512 = {
    .isa = KVS_ISA_AVX512,
    KVS_KERNELS_REF_ENTRIES,
};

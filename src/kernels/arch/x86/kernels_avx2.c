/* AVX2 + FMA + F16C table (this file is compiled with -mavx2 -mfma -mf16c;
 * kvs_kernels_get hands it out only when the CPU has those features). The
 * kernels themselves are in kernels_x86_impl.h; see there which types are
 * vectorized and which fall back to the scalar reference. */
#include "kernels/arch/x86/kernels_x86_impl.h"

#pragma GCC diagnostic ignored "-Woverride-init"

const struct kvs_kernels kvs_kernels_avx2 = {
    .isa = KVS_ISA_AVX2,
    KVS_KERNELS_REF_ENTRIES,
    KVS_X86_ENTRIES,
};

#!/usr/bin/env bash
# Cross-builds the kernel unit tests (tests/kernels/test_kernels_dot.c, which
# compares every SIMD table with the scalar reference, and
# tests/kernels/test_kernels_ssm.c, the Gated DeltaNet kernels against theirs)
# for AArch64 and runs them under qemu-user: the NEON kernels are checked on
# this x86 machine.
# Installs Debian's cross compiler, qemu-user and cmocka for arm64 (multiarch).
#   bash scripts/neon-check.sh [-march=armv8.2-a+dotprod]   (extra CFLAGS, e.g. SDOT)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! command -v qemu-aarch64 >/dev/null ||
   [ ! -e /usr/lib/aarch64-linux-gnu/libcmocka.so ]; then
  dpkg --print-foreign-architectures | grep -qx arm64 || $SUDO dpkg --add-architecture arm64
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross \
    qemu-user libcmocka-dev:arm64 >/dev/null
fi
out=build-neon
mkdir -p "$out"
srcs="src/kernels/kernels.c src/kernels/kernels_ref.c src/kernels/kernels_wquant_k.c src/kernels/kernels_ssm.c src/kernels/matmul.c
      src/kernels/pool.c src/kernels/arch/arm/kernels_neon.c src/kernels/arch/arm/kernels_ssm_neon.c
      src/common/log.c src/common/error.c src/gguf/gguf.c"
# shellcheck disable=SC2086
for t in test_kernels_dot test_kernels_ssm; do
  # shellcheck disable=SC2086
  aarch64-linux-gnu-gcc -std=c17 -O2 -Wall -Wextra -Werror -D_GNU_SOURCE "$@" -Isrc $srcs "tests/kernels/$t.c" \
    -I/usr/include -L/usr/lib/aarch64-linux-gnu -lcmocka -lpthread -lm -o "$out/$t"
done
KVS_TEST_FILTER="${KVS_TEST_FILTER:-test_simd*}" qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/test_kernels_dot"
qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/test_kernels_ssm"

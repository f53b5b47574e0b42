#!/usr/bin/env bash
# Installs the Debian packages Kvasir builds and tests with (as root, or via
# sudo). Safe to rerun: only missing packages are installed.
set -euo pipefail
PKGS="build-essential cmake pkg-config python3 clang libclang-rt-14-dev libcurl4-openssl-dev \
libmicrohttpd-dev libssl-dev libjansson-dev libpcre2-dev libcmocka-dev libwebsockets-dev libsqlite3-dev \
iproute2 nftables openssl lighttpd curl chromium \
ocl-icd-opencl-dev opencl-headers pocl-opencl-icd"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO="sudo"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi
# Node.js is for the OpenAI-client compatibility test (tests/e2e/api_openai.sh), which fails
# without it.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nodejs npm
fi

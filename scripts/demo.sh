#!/usr/bin/env bash
# The main job on one machine: install dependencies, build, start a ring of
# 4 stage processes on loopback and generate text from a real model.
#   bash scripts/demo.sh [MODEL.gguf] [PROMPT]
# MODEL defaults to ../shared/models/aidreams260K.gguf (a small trained
# model); any llama/qwen2/qwen3/qwen3moe/qwen35/qwen35moe GGUF works.
set -euo pipefail
# A MODEL given on the command line is relative to the caller's directory.
if [ -n "${1:-}" ] && [ -f "$1" ]; then MODEL=$(realpath "$1"); else MODEL=${1:-}; fi
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/models/aidreams260K.gguf}
PROMPT=${2:-Once upon a time}
if [ ! -f "$MODEL" ]; then
  echo "model not found: $MODEL (pass a GGUF path as the first argument)" >&2
  exit 2
fi
bash scripts/install-deps.sh >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
# build logs on stderr: stdout carries only the generated text
cmake --build build -j"$(nproc)" --target kvasir >&2
NBLOCK=$(./build/kvasir gguf info "$MODEL" | sed -n 's/^ *[a-z0-9_]*\.block_count = \([0-9]*\).*/\1/p' | head -1)
RING=4
if [ -n "$NBLOCK" ] && [ "$NBLOCK" -lt "$RING" ]; then RING=$NBLOCK; fi
echo "== a ring of $RING stage processes on loopback, model $MODEL" >&2
./build/kvasir run --ring "$RING" -m "$MODEL" -p "$PROMPT" -n 60 --temp 0
echo

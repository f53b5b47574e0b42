#!/usr/bin/env bash
# 8 prompts in flight at once through the head's request API (batched decode
# on every stage) give, each, the text that prompt gives alone in one process.
set -euo pipefail
BIN=${KVASIR_BIN:?}
SH=${KVASIR_SHARED:?}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
check() { # model, ring size, extra args
  local M=$1 n=$2; shift 2
  printf '%s\n' "Once upon a time" "The sky" "In the garden of" "A robot" "Deep in the forest" \
    "She said" "Numbers are" "The last light" > "$tmp/prompts"
  timeout 120 "$BIN" run --ring "$n" -m "$M" --prompts "$tmp/prompts" --parallel 8 -n 20 --temp 0 --ignore-eos "$@" \
    > "$tmp/out" 2>"$tmp/err" || { echo "FAIL: ring run failed"; cat "$tmp/err"; exit 1; }
  [[ $(grep -c '^#[0-9]* ok ' "$tmp/out") == 8 ]] || { echo "FAIL: not 8 results"; cat "$tmp/out"; exit 1; }
  i=0
  while IFS= read -r p; do
    want=$(timeout 60 "$BIN" run -m "$M" -p "$p" -n 20 --temp 0 --ignore-eos 2>/dev/null | sed -z 's/\\/\\\\/g; s/\n/\\n/g')
    got=$(grep "^#$i ok " "$tmp/out" | sed "s/^#$i ok //")
    [[ "$got" == "$want" ]] || { echo "FAIL: $(basename "$M") prompt $i [$p]: [$got] != [$want]"; exit 1; }
    i=$((i + 1))
  done < "$tmp/prompts"
  # the head really batched: fewer forward calls than tokens
  calls=$(sed -n 's/^ring: .* \([0-9]*\) forward calls .*/\1/p' "$tmp/err")
  [[ -n "$calls" && "$calls" -lt 160 ]] || { echo "FAIL: head made $calls forward calls for 8 x 20 tokens"; exit 1; }
  echo "ok: $(basename "$M") ring $n, 8 parallel, head forward calls $calls"
}
check "$SH/models/aidreams260K.gguf" 4
check "$SH/models/llama-q4_k_m.gguf" 3 --boundary f32
# hybrid: per-sequence Gated DeltaNet state on every stage (windows [0,1) [1,2) [2,4))
check "$SH/models/qwen35moe-q4_k.gguf" 3 --boundary f32
check "$SH/models/qwen35-mixed.gguf" 3 --boundary f32
echo PASS

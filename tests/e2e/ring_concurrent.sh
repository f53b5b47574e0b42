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

# --seqs above --batch (issue 9: the decode rows of 16 sequences were written into
# buffers of n_batch rows: heap overflow under ASan, 7 of 16 requests hung in
# Release): 16 prompts in flight on a 2-stage ring with --batch 1 --seqs 16, each
# gives the reference continuation (decode goes in batches of n_batch rows).
M=$SH/models/aidreams260K.gguf
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
b=$((20000 + ($$ % 500) * 20 + 11))
for _ in $(seq 16); do echo "Once upon a time"; done >"$tmp/p16"
"$BIN" stage -m "$M" --window 2:4 --listen 127.0.0.1:$((b + 1)) --next 127.0.0.1:$b --insecure --batch 1 --seqs 16 \
  2>"$tmp/s1.err" &
s1=$!
trap 'kill $s1 2>/dev/null; rm -rf "$tmp"' EXIT
timeout 60 "$BIN" stage -m "$M" --window 0:2 --listen 127.0.0.1:$b --next 127.0.0.1:$((b + 1)) --insecure --batch 1 \
  --seqs 16 --prompts "$tmp/p16" --parallel 16 -n 60 --temp 0 >"$tmp/o16" 2>"$tmp/h16.err" ||
  { echo "FAIL: --batch 1 --seqs 16 ring exited $?"; tail -5 "$tmp/h16.err" "$tmp/s1.err"; cat "$tmp/o16"; exit 1; }
n=$(grep -cxF -- "$(printf '%s' "ok $want")" <(sed 's/^#[0-9]* //' "$tmp/o16") || true)
[[ $n == 16 ]] || { echo "FAIL: --batch 1 --seqs 16: $n of 16 reference results"; cat "$tmp/o16"; tail -5 "$tmp/h16.err"; exit 1; }
echo "ok: --batch 1 --seqs 16, 16 parallel: 16 reference results"
echo PASS

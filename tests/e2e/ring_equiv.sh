#!/usr/bin/env bash
# For every shared model and every ring size 1..n_block (--ring 1: a one-stage
# ring, the head holding every block, as serve --ring 1): greedy output of the
# ring (-n 16 --temp 0 --ignore-eos) with default flags (F32 boundaries by
# default, docs/PROTOCOL.md section 5) is identical to the single-process run.
set -euo pipefail
BIN=${KVASIR_BIN:?}
D=${KVASIR_SHARED:?}/models
fails=0
for M in "$D"/*.gguf; do
  nb=$("$BIN" gguf info "$M" | sed -n 's/^main blocks: \([0-9]*\) .*/\1/p')
  [[ -n "$nb" ]] || { echo "FAIL: no block_count for $M"; exit 1; }
  ref=$(timeout 60 "$BIN" run -m "$M" -p "Once upon a time" -n 16 --temp 0 --ignore-eos 2>/dev/null)
  for ((n = 1; n <= nb; n++)); do
    got=$(timeout 60 "$BIN" run --ring "$n" -m "$M" -p "Once upon a time" -n 16 --temp 0 --ignore-eos 2>/dev/null) || true
    if [[ "$got" != "$ref" ]]; then
      echo "FAIL: $(basename "$M") ring $n: [$got] != single [$ref]"; fails=$((fails + 1))
    else
      echo "ok: $(basename "$M") ring $n"
    fi
  done
done
[[ $fails == 0 ]] || exit 1
echo PASS

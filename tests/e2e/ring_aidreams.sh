#!/usr/bin/env bash
# A local ring of 4 stages reproduces llama.cpp's greedy continuation of
# aidreams260K (shared/models/README.md), byte for byte.
set -euo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
got=$(timeout 60 "$BIN" run --ring 4 -m "$M" -p "Once upon a time" -n 60 --temp 0 2>/dev/null)
if [[ "$got" != "$want" ]]; then
  echo "FAIL: ring output differs"; echo "got:  [$got]"; echo "want: [$want]"; exit 1
fi
# --ring 1 (a one-stage ring, as serve --ring 1) gives the same text
got=$(timeout 60 "$BIN" run --ring 1 -m "$M" -p "Once upon a time" -n 60 --temp 0 2>/dev/null)
[[ "$got" == "$want" ]] || { echo "FAIL: --ring 1 output differs: [$got]"; exit 1; }
# a prompt longer than the context: the words of one process, counted as a failed request
long=$(printf 'Once upon a time there was a cat. %.0s' $(seq 40))
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
set +e
timeout 60 "$BIN" run -m "$M" -p "$long" -n 4 --temp 0 >/dev/null 2>"$tmp/one.err"; rc1=$?
timeout 60 "$BIN" run --ring 2 -m "$M" -p "$long" -n 4 --temp 0 >/dev/null 2>"$tmp/ring.err"; rc2=$?
set -e
why=$(sed -n 's/.*error: run: \(the prompt ([0-9]* tokens) does not fit the context (128)\)$/\1/p' "$tmp/one.err")
[[ $rc1 == 1 && -n $why ]] || { echo "FAIL: one process: rc $rc1: $(cat "$tmp/one.err")"; exit 1; }
[[ $rc2 == 1 ]] || { echo "FAIL: ring: rc $rc2, want 1"; exit 1; }
grep -qF "kvasir: request failed: $why" "$tmp/ring.err" || { echo "FAIL: ring says: $(cat "$tmp/ring.err")"; exit 1; }
grep -qF "summary: load " "$tmp/ring.err" && grep -q "| 1 requests (1 failed) | prompt 0 tokens" "$tmp/ring.err" ||
  { echo "FAIL: the summary does not count it as failed: $(grep summary: "$tmp/ring.err")"; exit 1; }
echo "ok: too long a prompt: $why"
# usage errors
set +e
"$BIN" run --ring 5 -m "$M" -p x 2>/dev/null; rc=$?
[[ $rc == 2 ]] || { echo "FAIL: --ring 5 on a 4-block model gave rc $rc, want 2"; exit 1; }
echo PASS

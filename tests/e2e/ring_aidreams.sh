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
# F32 boundaries give the same text
got=$(timeout 60 "$BIN" run --ring 2 -m "$M" -p "Once upon a time" -n 60 --temp 0 --boundary f32 2>/dev/null)
[[ "$got" == "$want" ]] || { echo "FAIL: f32 boundary output differs: [$got]"; exit 1; }
# usage errors
set +e
"$BIN" run --ring 5 -m "$M" -p x 2>/dev/null; rc=$?
[[ $rc == 2 ]] || { echo "FAIL: --ring 5 on a 4-block model gave rc $rc, want 2"; exit 1; }
echo PASS

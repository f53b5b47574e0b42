#!/usr/bin/env bash
# A healthy ring starts clean: no "re-joined" / "ring error" warnings before
# the first request (the re-join ERROR of PROTOCOL.md §5 is only for a link
# that was up before or that dropped frames), and the output is produced.
set -euo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
err=$(mktemp)
trap 'rm -f "$err"' EXIT
for n in 2 4; do
  out=$(timeout 60 "$BIN" run --ring "$n" -m "$M" -p "Once upon a time" -n 8 --temp 0 --ignore-eos 2>"$err")
  [[ -n "$out" ]] || { echo "FAIL: ring $n produced no text"; cat "$err"; exit 1; }
  if grep -E "re-joined|ring error|requests in flight" "$err"; then
    echo "FAIL: ring $n logged a fault at startup"; cat "$err"; exit 1
  fi
  grep -q "1 requests done, 0 failed" "$err" || { echo "FAIL: ring $n summary"; cat "$err"; exit 1; }
  echo "ok: ring $n starts clean"
done
# A malformed --next is a start-up error (exit 1 within the timeout, naming it),
# not a stage that retries it silently.
M0=${KVASIR_SHARED:?}/models/aidreams260K.gguf
for bad in ":" "127.0.0.1:0" "127.0.0.1:99999"; do
  set +e
  timeout 10 "$KVASIR_BIN" stage -m "$M0" --window 0:2 --listen 127.0.0.1:0 --next "$bad" 2>"$err"; rc=$?
  set -e
  [ "$rc" = 1 ] && grep -q "next address '$bad'" "$err" || { echo "FAIL: --next '$bad': rc $rc, $(cat "$err")"; exit 1; }
done
echo "ok: malformed --next refused at start-up"
echo PASS

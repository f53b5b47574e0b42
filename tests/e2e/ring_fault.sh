#!/usr/bin/env bash
# Faults: kill a middle stage mid-generation, no replacement -> the head holds
# the request for its --replay-deadline (2 s here), then the client gets an error
# within 5 s; restart it (same window) -> a new request succeeds. Garbage sent
# to a stage's listen port is logged and the stage survives.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
tmp=$(mktemp -d)
pids=()
cleanup() {
  exec 3>&- 2>/dev/null
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$tmp" 4 || { echo "FAIL: cannot make keys"; exit 1; }
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "== $f"; tail -20 "$f"; done; exit 1; }
base=$((20000 + ($$ % 120) * 100 + 90)) # below the ephemeral range (32768-60999)
P=($base $((base + 1)) $((base + 2)) $((base + 3)))
addr() { echo "127.0.0.1:${P[$1]}"; }
start_rank() { # rank begin end
  local r=$1
  "$BIN" stage -m "$M" --window "$2:$3" --listen "$(addr "$r")" --next "$(addr $(((r + 1) % 4)))" \
    $(key_args "$tmp" "$r" 4) --step-delay 25 >>"$tmp/rank$r.log" 2>&1 &
  pids+=($!)
  eval "pid$r=$!"
}
start_rank 1 1 2
start_rank 2 2 3
start_rank 3 3 4
mkfifo "$tmp/in"
"$BIN" stage -m "$M" --window 0:1 --listen "$(addr 0)" --next "$(addr 1)" $(key_args "$tmp" 0 4) --replay-deadline 2 --prompts - -n 60 --temp 0 \
  <"$tmp/in" >"$tmp/out" 2>"$tmp/rank0.log" &
pids+=($!)
exec 3>"$tmp/in"
wait_line() { # pattern, timeout s
  local t=0
  while ! grep -q "$1" "$tmp/out" 2>/dev/null; do
    sleep 0.1; t=$((t + 1)); if [[ $t -ge $(($2 * 10)) ]]; then return 1; fi
  done
  return 0
}
# 1. a request succeeds
echo "Once upon a time" >&3
wait_line '^#0 ' 60 || fail "first request got no answer"
grep -qxF "#0 ok $want" "$tmp/out" || fail "first request: $(grep '^#0' "$tmp/out")"
# 2. kill the middle stage mid-generation
echo "Once upon a time" >&3
sleep 1
grep -q '^#1 ' "$tmp/out" && fail "request 1 finished before the kill (too fast)"
kill -9 "$pid2"
t0=$(date +%s%N)
wait_line '^#1 ' 10 || fail "no answer 10 s after the kill"
dt=$((($(date +%s%N) - t0) / 1000000))
grep -q '^#1 error ' "$tmp/out" || fail "request 1 did not fail: $(grep '^#1' "$tmp/out")"
[[ $dt -le 5000 ]] || fail "error came after $dt ms (> 5000)"
echo "ok: error after $dt ms: $(grep '^#1' "$tmp/out")"
# 3. garbage on a stage's listen port (not TLS): logged, the stage survives
exec 4<>"/dev/tcp/127.0.0.1/${P[1]}" && printf 'GET / HTTP/1.1\r\n\r\n' >&4 && exec 4>&-
sleep 0.5
kill -0 "$pid1" || fail "rank 1 died on garbage"
grep -q 'TLS handshake with 127.0.0.1:[0-9]* failed' "$tmp/rank1.log" || fail "rank 1 did not log the bad handshake"
# 4. restart the killed stage; a new request succeeds once the ring is whole
start_rank 2 2 3
ok=0
for i in 2 3 4 5 6 7 8 9 10 11; do
  echo "Once upon a time" >&3
  wait_line "^#$i " 15 || fail "request $i got no answer"
  if grep -qxF "#$i ok $want" "$tmp/out"; then ok=1; break; fi
  sleep 1
done
[[ $ok == 1 ]] || fail "no request succeeded after the restart"
echo "ok: request $i succeeded after the restart"
kill -0 "$pid1" "$pid3" || fail "a surviving stage died"
echo PASS

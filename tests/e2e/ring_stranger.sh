#!/usr/bin/env bash
# Strangers on a stage port (issue 9), against a plaintext (--insecure) ring where
# anyone can reach the HELLO (tests/e2e/tools/stranger.py):
#  A. a stranger's HELLO that does not fit, before the ring closes, is not the
#     ring's error: `stage -p` waits for the real tail and answers (it used to exit
#     with "the ring cannot close: refusing predecessor <the stranger>");
#  B. a fitting HELLO every 150 ms while the ring serves never replaces the live
#     predecessor: every request succeeds, the stranger is never answered;
#  C. 300 garbage connections: at most 10 warning lines about them (rate-limited;
#     churned connections once wrote 735,000 lines), and the ring still serves;
#  D. a flood of silent connections from one address (127.0.0.2, 1000 per second)
#     while the tail is killed and restarted: the tail's re-dial from 127.0.0.1
#     still gets in (a per-address share of the pending table; it was locked out)
#     and the ring serves again within 8 s.
set -uo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v python3 >/dev/null && command -v curl >/dev/null || { echo "FAIL: python3/curl missing: run scripts/install-deps.sh"; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
T=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$T"/*.log; do echo "== $f"; grep -v ' debug: ' "$f" | tail -15; done; exit 1; }
base=$((20000 + ($$ % 400) * 25 + 7))
PH=$base PT=$((base + 1)) PA=$((base + 2)) QH=$((base + 3)) QT=$((base + 4))
stranger() { KVASIR_BIN="$BIN" timeout 60 python3 "$here/tools/stranger.py" "$M" "$@"; }
ask() { curl -s -m 20 "http://127.0.0.1:$PA/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}'; }

# --- A. a stranger's bad HELLO before the ring closes ---
timeout 30 "$BIN" stage -m "$M" --window 0:2 --listen 127.0.0.1:$QH --next 127.0.0.1:$QT --insecure \
  -p "Once upon a time" -n 60 --temp 0 >"$T/a.out" 2>"$T/a-head.log" &
ah=$!
pids+=($ah)
sleep 0.5
r=$(stranger "$QH" bad 2 100 4 64 128 4 512 1 3)
echo "A: stranger with window [1,3): $r"
[[ $r == *"refused=2"* ]] || fail "A: the head did not refuse the stranger's HELLO: $r"
kill -0 "$ah" 2>/dev/null || fail "A: stage -p exited on a stranger's HELLO: $(grep 'ring cannot close' "$T/a-head.log")"
"$BIN" stage -m "$M" --window 2:4 --listen 127.0.0.1:$QT --next 127.0.0.1:$QH --insecure 2>"$T/a-tail.log" &
pids+=($!)
wait "$ah"
rc=$?
[[ $rc == 0 ]] || fail "A: stage -p exited $rc: $(grep -i 'cannot close\|error' "$T/a-head.log" | tail -2)"
grep -qF "$want" "$T/a.out" || fail "A: not the reference text: $(cat "$T/a.out")"
grep -q "refusing predecessor 127.0.0.1:[0-9]*: its window \[1,3) does not end where this stage's \[0,2) begins" \
  "$T/a-head.log" || fail "A: the refusal was not logged"
echo "ok: A: a stranger's refusal did not end stage -p; it answered once the real tail came"

# --- B. fitting HELLOs while the ring serves ---
"$BIN" stage -m "$M" --window 2:4 --listen 127.0.0.1:$PT --next 127.0.0.1:$PH --insecure 2>"$T/tail.log" &
tp=$!
pids+=($tp)
"$BIN" stage -m "$M" --window 0:2 --listen 127.0.0.1:$PH --next 127.0.0.1:$PT --insecure --api $PA 2>"$T/head.log" &
hp=$!
pids+=($hp)
for _ in $(seq 200); do [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PA/health") == 200 ]] && break; sleep 0.1; done
r=$(ask); [[ $r == *"\"text\":\"$want\""* ]] || fail "B: the ring does not serve: $r"
stranger "$PH" hello 20 150 4 64 128 4 512 2 4 >"$T/b.res" &
sp=$!
pids+=($sp)
n=0
while kill -0 "$sp" 2>/dev/null; do
  r=$(ask)
  [[ $r == *"\"text\":\"$want\""* ]] || fail "B: a request failed while a stranger sent HELLOs: ${r:0:300}"
  n=$((n + 1))
  sleep 0.2
done
r=$(cat "$T/b.res")
echo "B: stranger posing as the predecessor: $r; $n requests meanwhile"
[[ $r == *"accepted=0 "* ]] || fail "B: the head took the stranger as its predecessor: $r"
[[ $n -ge 3 ]] || fail "B: only $n requests ran while the stranger was at it"
grep -q "this stage's predecessor 127.0.0.1:[0-9]* is alive" "$T/head.log" || fail "B: the head did not say why"
echo "ok: B: $n requests succeeded, the live predecessor stayed"

# --- C. 300 garbage connections: rate-limited warnings ---
before=$(grep -c ' warn: ' "$T/head.log")
r=$(stranger "$PH" garbage 300 0 4 64 128 4 512 0 0)
echo "C: $r"
sleep 0.5
after=$(grep -c ' warn: ' "$T/head.log")
[[ $((after - before)) -le 10 ]] || fail "C: $((after - before)) warning lines for 300 garbage connections"
r=$(ask); [[ $r == *"\"text\":\"$want\""* ]] || fail "C: the ring does not serve after the garbage: $r"
echo "ok: C: $((after - before)) warning lines for 300 garbage connections; the ring serves"

# --- D. a one-address flood while the tail restarts ---
timeout 30 python3 "$here/tools/flood.py" 127.0.0.2 "$PH" 1000 12 5000 >"$T/d.res" &
fp=$!
pids+=($fp)
sleep 1.5
kill -9 "$tp"; wait "$tp" 2>/dev/null
"$BIN" stage -m "$M" --window 2:4 --listen 127.0.0.1:$PT --next 127.0.0.1:$PH --insecure 2>"$T/tail2.log" &
pids+=($!)
t0=$(date +%s%N)
ok=0
while (( ($(date +%s%N) - t0) / 1000000 < 8000 )); do
  r=$(curl -s -m 8 "http://127.0.0.1:$PA/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}')
  [[ $r == *"\"text\":\"$want\""* ]] && { ok=1; break; }
  sleep 0.2
done
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
kill -0 "$fp" 2>/dev/null || fail "D: the flood ended before the check: $(cat "$T/d.res")"
[[ $ok == 1 ]] || fail "D: with a flood from 127.0.0.2 the restarted tail did not get back in: no answer ${ms} ms after its restart: ${r:0:300}"
echo "ok: D: under a flood of 1000 connections/s from 127.0.0.2, the restarted tail rejoined; first answer ${ms} ms after its restart"
wait "$fp"; echo "D: flood: $(cat "$T/d.res")"
kill -0 "$hp" || fail "the head died"
echo PASS

#!/usr/bin/env bash
# Requests survive a stage's death (issue 13, docs/PROTOCOL.md 5.1).
# serve --ring 4: 8 streaming requests (4 greedy, 4 at temperature 0.8 with
# seeds) undisturbed, then the same 8 with (B) kill -9 of a middle stage, (C)
# kill -9 and a second kill -9 of its replacement while the replay runs, (D)
# SIGTERM: a planned leave (the replacement takes the stage's state over,
# nothing is replayed: tests/e2e/ring_leave.sh checks that and its pause), all 8
# complete, each text equals the undisturbed one; the pause (longest gap in a
# stream) is printed.
# (E) Deadline: the tail stopped (SIGSTOP): every held stream ends with a clear
# error after --replay-deadline; after SIGCONT 8 new requests on the 8 slots
# complete with the undisturbed texts (no slot left behind anywhere).
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
CLIENT="$(dirname "$0")/tools/replay_client.py"
command -v python3 >/dev/null || { echo "FAIL: python3 missing"; exit 1; }
command -v curl >/dev/null || { echo "FAIL: curl missing"; exit 1; }
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "== $f"; grep -v ' info: api: ' "$f" | tail -25; done; exit 1; }
# below 32768: a port in the ephemeral range can be held in TIME_WAIT by any client on the machine
base=$((20000 + ($$ % 120) * 100 + 50))

# --- serve --ring 4 ---------------------------------------------------------
"$BIN" serve -m "$M" --ring 4 --seqs 8 --port "$base" --step-delay 8 --replay-deadline 5 >"$tmp/serve.log" 2>&1 &
spid=$!
pids+=($spid)
ok=0
for _ in $(seq 300); do
  curl -sf "http://127.0.0.1:$base/health" >/dev/null 2>&1 && { ok=1; break; }
  kill -0 $spid 2>/dev/null || break
  sleep 0.1
done
[[ $ok == 1 ]] || fail "serve did not become healthy"

run() { # name act
  timeout 120 python3 "$CLIENT" --port "$base" --log "$tmp/serve.log" --act "$2" --rank 2 >"$tmp/$1.jsonl" \
    2>"$tmp/$1.client.log" || fail "$1: client failed: $(cat "$tmp/$1.client.log")"
  [[ $(wc -l <"$tmp/$1.jsonl") == 8 ]] || fail "$1: not 8 results"
}
check() { # name: every request complete, same text as the calm run, pause figures
  python3 - "$tmp/calm.jsonl" "$tmp/$1.jsonl" "$1" <<'PY' || fail "$1 differs"
import json, sys
calm = [json.loads(l) for l in open(sys.argv[1])]
got = [json.loads(l) for l in open(sys.argv[2])]
bad = 0
for c, g in zip(calm, got):
    if g["error"] or not g["finish"]:
        print("request %d did not complete: %s" % (g["i"], g["error"])); bad += 1
    elif g["text"] != c["text"]:
        print("request %d differs:\n  calm: %r\n  got:  %r" % (g["i"], c["text"], g["text"])); bad += 1
gaps = sorted(g["gap_ms"] for g in got)
calm_gaps = sorted(c["gap_ms"] for c in calm)
print("%s: %d/8 complete and equal to the undisturbed run; pause median %.0f ms, max %.0f ms "
      "(undisturbed longest gap: median %.0f ms, max %.0f ms)" % (sys.argv[3], 8 - bad,
      (gaps[3] + gaps[4]) / 2, gaps[-1], (calm_gaps[3] + calm_gaps[4]) / 2, calm_gaps[-1]))
sys.exit(1 if bad else 0)
PY
}
run calm none
python3 - "$tmp/calm.jsonl" <<'PY' || fail "undisturbed run"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert all(r["error"] is None and r["finish"] for r in rs), rs
assert len({r["text"] for r in rs}) >= 6, "the 8 requests should mostly differ"
assert all(r["chunks"] >= 20 for r in rs), [r["chunks"] for r in rs]
PY
replays() { grep -c 'ring whole again after' "$tmp/serve.log"; }
r0=$(replays)
run kill kill
check kill
[[ $(replays) -gt $r0 ]] || fail "kill: no replay logged"
grep -q 'serve: rank 2 restarted' "$tmp/serve.log" || fail "kill: no restart logged"
sleep 0.5
r0=$(replays)
run kill2 kill2
check kill2
[[ $(replays) -ge $((r0 + 2)) ]] || fail "kill2: not two replays"
sleep 0.5
run term term
check term
grep -q 'stage \[2,3) is shutting down' "$tmp/serve.log" || fail "term: no goodbye from the stage"
restarts=$(grep -c 'serve: rank 2 restarted' "$tmp/serve.log")
[[ $restarts == 4 ]] || fail "expected 4 restarts of rank 2, saw $restarts"
kill -0 $spid || fail "serve died"

# --- deadline: a stage that never comes back within it -------------------------
# SIGSTOP the tail: the supervisor does not restart a stopped process; the head
# notices the silence (4 s), holds, and after --replay-deadline (5 s) every held
# request fails with a clear error and a CANCEL frees its slots on the stages
# it reaches. SIGCONT, and 8 new requests on the 8 slots all complete with the
# undisturbed texts: no slot was left behind on any stage.
tail_pid=$(python3 -c 'import sys,re; t=open(sys.argv[1]).read(); p=re.findall(r"rank 3 restarted \(pid (\d+)", t) or re.findall(r"rank 3 \(pid (\d+)\)", t); print(p[-1])' "$tmp/serve.log")
[[ -n $tail_pid ]] || fail "no pid for rank 3"
python3 "$CLIENT" --port "$base" --log "$tmp/serve.log" --act none >"$tmp/dead.jsonl" 2>"$tmp/dead.client.log" &
cpid=$!
pids+=($cpid)
sleep 0.6
kill -STOP "$tail_pid"
t0=$(date +%s%N)
timeout 60 tail --pid=$cpid -f /dev/null
dt=$((($(date +%s%N) - t0) / 1000000))
kill -CONT "$tail_pid"
python3 - "$tmp/dead.jsonl" "$dt" <<'PY' || fail "deadline: not 8 clear errors"
import json, sys
rs = [json.loads(l) for l in open(sys.argv[1])]
assert len(rs) == 8, rs
bad = [r for r in rs if not (r["error"] and "not whole again within 5000 ms" in r["error"])]
assert not bad, bad
print("deadline: 8 held streams ended with an error %s ms after the stage stopped: %s" % (sys.argv[2], rs[0]["error"][:200]))
PY
[[ $dt -ge 8000 && $dt -le 30000 ]] || fail "deadline: errors after $dt ms (want ~4 s silence + 5 s deadline)"
ok=0
for _ in $(seq 300); do curl -sf "http://127.0.0.1:$base/health" >/dev/null 2>&1 && { ok=1; break; }; sleep 0.1; done
[[ $ok == 1 ]] || fail "deadline: the ring did not heal after SIGCONT"
run after none
check after
kill -0 $spid || fail "serve died"
echo PASS

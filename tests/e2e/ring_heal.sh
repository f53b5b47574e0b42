#!/usr/bin/env bash
# A ring that heals (issue 9): `kvasir serve --ring 4 --seqs 8` under load, then
#  A. SIGSTOP of each stage for 10 s in turn (ranks 1, 2, 3: the head's successor,
#     a middle stage, the tail; RING_HEAL_STOP="2" picks some),
#  B. kill -9 of each stage and a restart of the same stage (the tail, the
#     head's successor, the middle one; RING_HEAL_KILL="3 1" picks some).
# Each time: /health turns 503 while the ring cannot serve; once the stage is
# back, a new request succeeds (the reference text) within 5 s, and whenever
# /health says 200 a request made then succeeds (no stale sequence slot on a
# stage whose links never broke: "no free sequence slot on stage [1,2)" was the
# bug). A killed stage is restarted by serve's supervisor, or else by this test
# from its own command line.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=$(cd "${KVASIR_SHARED:?}/models" && pwd)/aidreams260K.gguf
[[ -f $M ]] || { echo "FAIL: missing $M"; exit 1; }
command -v curl >/dev/null || { echo "FAIL: curl missing: run scripts/install-deps.sh"; exit 1; }
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
tmp=$(mktemp -d)
pids=()
cleanup() {
  rm -f "$tmp/load"
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$tmp"/*.log; do echo "== $f"; grep -v ' debug: ' "$f" | tail -25; done
  exit 1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
PA=$((20000 + ($$ % 300) * 40 + 37))
URL=http://127.0.0.1:$PA
health() { curl -s -o /dev/null -w '%{http_code}' -m 3 "$URL/health"; }
# one request: prints the body; 0 if it is the reference continuation
ask() {
  local r
  r=$(curl -s -m 15 "$URL/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}')
  echo "$r"
  [[ $r == *"\"text\":\"$want\""* ]]
}

# --replay-deadline 0: requests in flight at a fault fail at once (no hold and replay,
# tests/e2e/ring_replay.sh covers that): their slots must still be freed on every stage
"$BIN" serve -m "$M" --ring 4 --seqs 8 --port "$PA" --max-per-addr 64 --replay-deadline 0 >"$tmp/serve.out" 2>"$tmp/serve.log" &
serve=$!
pids+=($serve)
for _ in $(seq 300); do [[ $(health) == 200 ]] && break; sleep 0.1; done
[[ $(health) == 200 ]] || fail "the ring did not come up within 30 s"
r=$(ask) || fail "first request: $r"
declare -A pid cmdf port
for c in $(pgrep -P "$serve"); do
  args=$(tr '\0' '\n' <"/proc/$c/cmdline")
  win=$(grep -A1 -x -- --window <<<"$args" | tail -1)
  r=${win%%:*} # one block per stage on this 4-block model: rank = first block
  pid[$r]=$c
  tr '\0' '\n' <"/proc/$c/cmdline" >"$tmp/cmd$r"
  port[$r]=$(grep -A1 -x -- --listen <<<"$args" | tail -1 | sed 's/.*://')
done
[[ -n ${pid[1]:-} && -n ${pid[2]:-} && -n ${pid[3]:-} ]] || fail "cannot find the three stage processes of serve"

# 8 clients asking for long generations: slots are held on every stage when the fault comes
load=()
load_start() {
  touch "$tmp/load"
  load=()
  for _ in 1 2 3 4 5 6 7 8; do
    (while [[ -f $tmp/load ]]; do
      curl -s -m 20 "$URL/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":120,"temperature":0.8}' >/dev/null
      sleep 0.3 # in flight about half the time each: slots held, the machine not saturated for other tests
    done) &
    pids+=($!)
    load+=($!)
  done
  sleep 1.5
}
load_stop() { rm -f "$tmp/load"; }
# wait_503 LABEL SECONDS: /health must turn 503 within SECONDS
wait_503() {
  local t0 h
  t0=$(now_ms)
  while [[ $(($(now_ms) - t0)) -le $(($2 * 1000)) ]]; do
    h=$(health)
    [[ $h == 503 ]] && { echo "ok: $1: /health 503 after $(($(now_ms) - t0)) ms"; return 0; }
    sleep 0.1
  done
  fail "$1: /health still $h $2 s after the fault"
}
# healed LABEL T_BACK: within 5 s of T_BACK a request succeeds; every request made while /health said 200 succeeds
healed() {
  local h r dt ok=0
  while [[ $(($(now_ms) - $2)) -le 8000 ]]; do
    h=$(health)
    if [[ $h == 200 ]]; then
      r=$(ask) || fail "$1: /health said 200 but a request failed: ${r:0:300}"
      ok=1
      break
    fi
    sleep 0.05
  done
  dt=$(($(now_ms) - $2))
  [[ $ok == 1 ]] || fail "$1: no healthy ring 8 s after the stage was back (/health $h)"
  [[ $dt -le 5000 ]] || fail "$1: the first request succeeded $dt ms after the stage was back (> 5000)"
  echo "ok: $1: first request succeeded $dt ms after the stage was back"
  wait_load
  # all 8 slots on every stage are free again: 8 requests at once all succeed (a slot
  # leaked on any stage fails one with "no free sequence slot")
  [[ $(health) == 200 ]] || fail "$1: /health not 200 after a success"
  local par=()
  for i in 1 2 3 4 5 6 7 8; do
    ask >"$tmp/par$i" &
    par+=($!)
  done
  for p in "${par[@]}"; do wait "$p" 2>/dev/null; done
  for i in 1 2 3 4 5 6 7 8; do
    grep -qF "\"text\":\"$want\"" "$tmp/par$i" || fail "$1: request $i of 8 at once after the recovery: $(head -c 300 "$tmp/par$i")"
  done
}
wait_load() { # the load clients end once their last request ended
  for p in "${load[@]}"; do wait "$p" 2>/dev/null; done
}
# rank_pid RANK: serve's child process serving that rank now (empty if none)
rank_pid() {
  local c
  for c in $(pgrep -P "$serve"); do
    [[ $(tr '\0' '\n' <"/proc/$c/cmdline" 2>/dev/null | grep -A1 -x -- --window | tail -1) == "$1:"* ]] && { echo "$c"; return; }
  done
}
# restart RANK: the killed stage again, from its command line (unless serve restarted it already)
restart() {
  local r=$1
  mapfile -t cmd <"$tmp/cmd$r"
  "${cmd[@]}" >>"$tmp/rank$r.log" 2>&1 &
  pid[$r]=$!
  pids+=($!)
}

# --- A. SIGSTOP of a stage for 10 s ---
for s in ${RING_HEAL_STOP:-1 2 3}; do
  load_start
  kill -STOP "${pid[$s]}"
  t_stop=$(now_ms)
  load_stop
  wait_503 "A (SIGSTOP rank $s)" 7
  left=$((10000 - ($(now_ms) - t_stop)))
  [[ $left -gt 0 ]] && sleep "$((left / 1000)).$(printf '%03d' $((left % 1000)))"
  kill -CONT "${pid[$s]}"
  t_back=$(now_ms)
  healed "A (SIGSTOP rank $s for 10 s)" "$t_back"
done

# --- B. kill -9 of a stage; restart ---
# serve's supervisor (if any) restarts the stage at once: then it is back when its
# new process appears, and /health may be 503 too briefly to be seen; else this
# test restarts it after 1 s, and /health must have said 503 meanwhile.
for r in ${RING_HEAL_KILL:-3 1 2}; do
  load_start
  old=${pid[$r]}
  kill -9 "$old"
  t_kill=$(now_ms)
  load_stop
  saw=0
  t_back=
  while [[ $(($(now_ms) - t_kill)) -lt 1000 ]]; do
    [[ $(health) == 503 ]] && saw=1
    np=$(rank_pid "$r")
    if [[ -n $np && $np != "$old" ]]; then
      t_back=$(now_ms)
      pid[$r]=$np
      echo "note: serve restarted rank $r after $((t_back - t_kill)) ms (/health 503 seen: $saw)"
      break
    fi
    sleep 0.02
  done
  if [[ -z $t_back ]]; then
    [[ $saw == 1 ]] || fail "kill -9 rank $r: /health never said 503 in the second after the kill"
    echo "ok: kill -9 rank $r: /health 503"
    restart "$r"
    t_back=$(now_ms)
  fi
  healed "kill -9 + restart of rank $r" "$t_back"
done
kill -0 "$serve" || fail "serve died"
echo PASS

#!/usr/bin/env bash
# Replay rebuilds recurrent state (issue 13, docs/PROTOCOL.md 5.1): serve --ring 4
# over the Qwen3.5 hybrid (Gated DeltaNet blocks 0-2, attention block 3); 4
# streams (2 greedy, 2 at temperature 0.8 with seeds) undisturbed, then again
# with kill -9 of rank 1 (a GDN window) mid-stream: all complete, each text
# equal to the undisturbed one. Then a planned leave (SIGTERM) of rank 1: its
# replacement takes the GDN conv and delta states over (PROTOCOL.md 5.2), the
# texts are again the undisturbed ones and nothing is replayed.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/qwen35-mixed.gguf
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
fail() { echo "FAIL: $*"; grep -v ' info: api: ' "$tmp/serve.log" | tail -25; exit 1; }
# below 32768: a port in the ephemeral range can be held in TIME_WAIT by any client on the machine
port=$((20000 + ($$ % 120) * 100 + 70))
"$BIN" serve -m "$M" --ring 4 --seqs 4 --port "$port" --step-delay 5 >"$tmp/serve.log" 2>&1 &
spid=$!
pids+=($spid)
ok=0
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && { ok=1; break; }
  kill -0 $spid 2>/dev/null || break
  sleep 0.1
done
[[ $ok == 1 ]] || fail "serve did not become healthy"
for r in calm kill term; do
  act=none
  [[ $r != calm ]] && act=$r
  replays=$(grep -c 'ring whole again after' "$tmp/serve.log")
  timeout 200 python3 "$CLIENT" --port "$port" --log "$tmp/serve.log" --n 4 --max-tokens 20 --act $act --rank 1 \
    >"$tmp/$r.jsonl" 2>"$tmp/$r.client.log" || fail "$r: client failed: $(cat "$tmp/$r.client.log")"
  if [[ $r == kill ]]; then
    [[ $(grep -c 'ring whole again after' "$tmp/serve.log") -gt $replays ]] || fail "kill: no replay logged"
  elif [[ $r == term ]]; then
    [[ $(grep -c 'ring whole again after' "$tmp/serve.log") == "$replays" ]] || fail "term: replayed (no drain)"
    grep -q 'stage \[1,2) took over 4 sequences' "$tmp/serve.log" || fail "term: no state taken over"
  fi
  sleep 0.3
done
for r in kill term; do
python3 - "$tmp/calm.jsonl" "$tmp/$r.jsonl" "$r" <<'PY' || fail "the $r hybrid differs"
import json, sys
calm = [json.loads(l) for l in open(sys.argv[1])]
got = [json.loads(l) for l in open(sys.argv[2])]
assert len(calm) == len(got) == 4
assert all(c["error"] is None and c["finish"] and c["chunks"] >= 5 for c in calm), calm
bad = 0
for c, g in zip(calm, got):
    if g["error"] or not g["finish"] or g["text"] != c["text"]:
        print("request %d: %s\n  calm: %r\n  got:  %r" % (g["i"], g["error"], c["text"], g["text"])); bad += 1
gaps = sorted(g["gap_ms"] for g in got)
how = "a kill -9 of a GDN stage (replayed)" if sys.argv[3] == "kill" else "a planned leave of a GDN stage (drained)"
print("qwen35 hybrid: %d/4 complete and equal after %s; pause median %.0f ms, max %.0f ms"
      % (4 - bad, how, (gaps[1] + gaps[2]) / 2, gaps[-1]))
sys.exit(1 if bad else 0)
PY
done
echo PASS

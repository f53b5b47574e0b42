#!/usr/bin/env bash
# A head started with `kvasir stage ... --api PORT` serves the OpenAI API:
# a 2-stage ring of aidreams260K answers /health and a greedy completion with
# the llama.cpp reference continuation (../shared/models/README.md).
set -euo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v curl >/dev/null || { echo "FAIL: curl missing: run scripts/install-deps.sh"; exit 1; }
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])' 2>/dev/null \
  || echo $((20000 + RANDOM % 20000)); }
P0=$(free_port); P1=$(free_port); PA=$(free_port)
pids=()
T=$(mktemp -d)
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$T" 2
"$BIN" stage -m "$M" --window 2:4 $(key_args "$T" 1 2) --listen 127.0.0.1:$P1 --next 127.0.0.1:$P0 2>/dev/null & pids+=($!)
"$BIN" stage -m "$M" --window 0:2 $(key_args "$T" 0 2) --listen 127.0.0.1:$P0 --next 127.0.0.1:$P1 --api $PA 2>/dev/null & pids+=($!)
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" = 200 ] && break
  sleep 0.1
done
[ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" = 200 ] || { echo "FAIL: /health never 200"; exit 1; }
out=$(curl -s http://127.0.0.1:$PA/v1/completions \
  -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}')
want='", pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific"'
case "$out" in
  *"\"text\":$want"*) echo "stage --api: reference continuation OK" ;;
  *) echo "FAIL: unexpected response: $out"; exit 1 ;;
esac

# A stage refuses a shard whose window does not cover its assignment.
"$BIN" shard extract -m "$M" --window 2:4 -o "$T/s24.gguf" >/dev/null 2>&1
if "$BIN" stage -m "$T/s24.gguf" --window 1:3 --listen 127.0.0.1:$(free_port) --next 127.0.0.1:$P0 2>"$T/err"; then
  echo "FAIL: stage accepted a shard of [2,4) for [1,3)"; exit 1
fi
grep -q 'shard holds blocks \[2,4) but the stage needs \[1,3)' "$T/err" || { echo "FAIL: unclear error: $(cat "$T/err")"; exit 1; }
echo "stage refuses a mismatched shard: OK"

# A head whose successor serves another model: /health and requests say why.
L=${KVASIR_SHARED}/models/llama-f32.gguf
Q0=$(free_port); Q1=$(free_port); QA=$(free_port)
"$BIN" stage -m "$L" --window 2:4 $(key_args "$T" 1 2) --listen 127.0.0.1:$Q1 --next 127.0.0.1:$(free_port) 2>/dev/null & pids+=($!)
"$BIN" stage -m "$M" --window 0:2 $(key_args "$T" 0 2) --listen 127.0.0.1:$Q0 --next 127.0.0.1:$Q1 --api $QA 2>/dev/null & pids+=($!)
for _ in $(seq 200); do # up to 20 s: under ctest -j2 both stages load beside other tests
  h=$(curl -s http://127.0.0.1:$QA/health || true)
  case "$h" in *"refused this stage: it serves model"*) break ;; esac
  sleep 0.1
done
case "$h" in
  *'"status":"unavailable"'*"successor 127.0.0.1:$Q1 refused this stage: it serves model"*) ;;
  *) echo "FAIL: /health does not say why the ring cannot close: $h"; exit 1 ;;
esac
r=$(curl -s -w ' %{http_code}' http://127.0.0.1:$QA/v1/completions -d '{"prompt":"hi"}')
case "$r" in
  *"the ring cannot close: successor"*'"code":"ring_unavailable"'*" 503") echo "refusal reason reaches the API: OK" ;;
  *) echo "FAIL: completion during a refusal: $r"; exit 1 ;;
esac

# `kvasir serve` without --ring: one process holds the whole model (no child,
# no link) and answers with the reference continuation.
SA=$(free_port)
"$BIN" serve -m "$M" --port $SA 2>"$T/serve.err" & pids+=($!)
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$SA/health)" = 200 ] && break
  sleep 0.1
done
out=$(curl -s http://127.0.0.1:$SA/v1/completions -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}')
case "$out" in
  *"\"text\":$want"*) echo "serve (one process): reference continuation OK" ;;
  *) echo "FAIL: serve without --ring: $out $(cat "$T/serve.err")"; exit 1 ;;
esac
grep -q 'serve: one process (the whole model)' "$T/serve.err" || { echo "FAIL: serve log: $(cat "$T/serve.err")"; exit 1; }

# --max-connections: with its 2 slots serving requests, another connection is
# answered 503 (an HTTP answer, not a reset); an idle connection (no whole
# request yet) of an address holding 2 is evicted for a client from another
# address instead, once it has had 1 s to send its request.
SB=$(free_port)
"$BIN" serve -m "$M" --port $SB --max-connections 2 --step-delay 100 2>/dev/null & pids+=($!)
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$SB/health)" = 200 ] && break
  sleep 0.1
done
curl -s -m 20 -o /dev/null http://127.0.0.1:$SB/v1/completions -d '{"prompt":"Once upon a time","max_tokens":30}' &
busy=$!
curl -s -m 20 -o /dev/null http://127.0.0.1:$SB/v1/completions -d '{"prompt":"Once upon a time","max_tokens":30}' &
busy2=$!
sleep 0.5
code=$(curl -s -m 3 -o "$T/full.json" -w '%{http_code}' http://127.0.0.1:$SB/health || true)
[ "$code" = 503 ] || { echo "FAIL: a second connection past --max-connections 1 got $code"; exit 1; }
grep -q '"code":"too_many_connections"' "$T/full.json" || { echo "FAIL: 503 body: $(cat "$T/full.json")"; exit 1; }
wait $busy $busy2
exec 7<>/dev/tcp/127.0.0.1/$SB
exec 8<>/dev/tcp/127.0.0.1/$SB
sleep 1.2
[ "$(curl -s -m 3 --interface 127.0.0.2 -o /dev/null -w '%{http_code}' http://127.0.0.1:$SB/health)" = 200 ] || { echo "FAIL: an idle connection was not evicted for a new client"; exit 1; }
exec 7>&- 8>&-
echo "serve --max-connections: OK"

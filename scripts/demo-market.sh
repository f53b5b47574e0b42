#!/usr/bin/env bash
# The self-enrollment market on one machine: install dependencies, build,
# start a seed server and a market, list a model, and start 3 `kvasir join`
# nodes, each with a memory budget of about half the model: two of them claim
# windows, fetch only those and form a ring by themselves, the third waits as
# a spare (kill one of the others and it takes over the window). The ring,
# found through the market's GET /v1/rings, is asked for text. Open the
# printed market URL in a browser for the live map. Ctrl-C stops everything
# (the nodes release their claims).
#   bash scripts/demo-market.sh [MODEL.gguf]
set -euo pipefail
if [ -n "${1:-}" ] && [ -f "$1" ]; then MODEL=$(realpath "$1"); else MODEL=${1:-}; fi
cd "$(dirname "$0")/.."
MODEL=${MODEL:-../shared/models/aidreams260K.gguf}
[ -f "$MODEL" ] || { echo "model not found: $MODEL" >&2; exit 2; }
bash scripts/install-deps.sh >&2
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target kvasir >&2
B=./build/kvasir
W=$(mktemp -d)
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait 2>/dev/null; rm -rf "$W"' EXIT
mkdir -p "$W/seed"
cp "$MODEL" "$W/seed/"
name=$(basename "$MODEL")
# the index (per-tensor digests) and the model's content id, which the listing carries: each node
# checks what it fetched against that id, not only against the seed's own index (trusted=yes)
cid=$($B shard index "$W/seed/$name" -o "$W/seed/$name.kvindex.json" | sed -n 's/^content_id=//p')
$B seed "$W/seed" --port 0 --port-file "$W/seed.port" 2>"$W/seed.log" & pids+=($!)
$B market --listen 127.0.0.1:0 --db "$W/market.sqlite" --lease-ms 5000 2>"$W/market.log" & pids+=($!)
for _ in $(seq 100); do [ -s "$W/seed.port" ] && grep -q "listening on" "$W/market.log" && break; sleep 0.1; done
SEED=http://127.0.0.1:$(cat "$W/seed.port")
MK=$(grep -o 'http://[0-9.]*:[0-9]*' "$W/market.log" | head -1)
echo "== market on $MK (the map: open it in a browser), seed on $SEED" >&2
$B market add --market "$MK" --url "$SEED/$name" --index "$SEED/$name.kvindex.json" --content-id "$cid" >&2
# the model's whole-ring memory, from the map's profile: each node gets a budget of about a third
total=$(curl -s "$MK/map" | python3 -c "
import json,sys
m=json.load(sys.stdin)['models'][0]; p=m['profile']
print(sum(b[0] for b in p['blocks']) + p['head'] + p['tail'] + sum(b[2] for b in p['blocks'])*m['ctx']*m['seqs'])")
buf=$(curl -s "$MK/map" | python3 -c "import json,sys; print(512*json.load(sys.stdin)['models'][0]['profile']['n_embd']*32)")
for i in 1 2 3; do
  $B join --market "$MK" --mem $((total / 2 + buf + 300000)) --name "node$i" --cache "$W/cache$i" --threads 1 \
    --poll-ms 300 >"$W/node$i.out" 2>"$W/node$i.log" & pids+=($!)
  sleep 1
done
api=""
for _ in $(seq 300); do
  api=$(curl -s "$MK/v1/rings" | python3 -c "import json,sys; r=json.load(sys.stdin)['rings']; print(r[0]['api'] if r else '')")
  [ -n "$api" ] && break
  sleep 0.1
done
[ -n "$api" ] || { echo "no ring formed; logs in $W" >&2; tail -5 "$W"/node*.log >&2; exit 1; }
echo "== the nodes' claims and fetches:" >&2
cat "$W"/node*.out >&2
echo "== ring ready, head API at $api; asking it for text" >&2
curl -s "$api/v1/completions" -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}' |
  python3 -c "import json,sys; print(json.load(sys.stdin)['choices'][0]['text'])"
if [ -t 0 ]; then echo "== the map: $MK  (Ctrl-C to stop)" >&2; wait; fi

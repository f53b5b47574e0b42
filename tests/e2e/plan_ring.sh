#!/usr/bin/env bash
# kvasir plan on aidreams260K over 4 local "devices" -> a 4-rank manifest with
# hand-computed figures; then (when `kvasir stage --manifest` is built) the ring
# of 4 stages started from that manifest must reproduce llama.cpp's greedy text.
#
# Hand-computed profile of aidreams260K (4 blocks, n_embd 64, 4 heads, 4 KV
# heads, FFN 172, vocab 512, all F32; models/README.md):
#   block weights = 4*64*64*4 (q,k,v,o) + 3*64*172*4 (gate,up,down) + 2*64*4 (norms) = 198144
#   token_embd = 512*64*4 = 131072 (head); output 131072 + output_norm 256 (tail)
#   KV per block = 2 * 4 heads * 16 * 2 bytes = 256 B/token; ctx 128 -> 32768
#   buffers = 512 * 64 * 4 * 8 = 1048576 (+ logits 512*4 = 2048 on the tail)
# One block: head 1410560, middle 1279488, tail 1412864 bytes; two blocks on the
# smallest (middle) rank: 1510400. With 1450000 bytes per device every device
# holds exactly one block: 4 ranks.
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}"
model="$KVASIR_SHARED/models/aidreams260K.gguf"
ref="$KVASIR_SHARED/models/aidreams260K.ref.json"
[ -f "$model" ] && [ -f "$ref" ] || { echo "missing $model or $ref"; exit 1; }

dir=$(mktemp -d /tmp/kvs_plan_ring.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
    rm -rf "$dir"
}
trap cleanup EXIT

# Four free TCP ports on 127.0.0.1 (a port is taken if a connect succeeds).
ports=()
p=$((20000 + ($$ % 12000))) # below the ephemeral range (32768-60999)
while [ "${#ports[@]}" -lt 4 ]; do
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then ports+=("$p"); fi
    p=$((p + 1))
done

# Each device has a node key (as `kvasir bench --probe --key` reports it): the
# planner copies it into the manifest, and the stages' links are TLS between them.
for d in a b c d; do "$KVASIR_BIN" key gen -o "$dir/$d.key" >/dev/null; done
dev() { # name gbps port
    printf '{"name": "%s", "backend": "cpu", "mem_bytes": 1450000, "decode_gbps": %s, "rtt_ms": 0.05, "bandwidth_mbps": 10000, "threads": 1, "addr": "127.0.0.1:%s", "key": "%s"}' "$1" "$2" "$3" "$("$KVASIR_BIN" key show --public "$dir/$1.key")"
}
{
    echo '{"relay": {"rtt_ms": 40}, "devices": ['
    dev a 20 "${ports[0]}"; echo ','
    dev b 10 "${ports[1]}"; echo ','
    dev c 5 "${ports[2]}"; echo ','
    dev d 2 "${ports[3]}"
    echo ']}'
} >"$dir/devices.json"

# No --ctx: the default is min(context_length 128, 4096) = 128 (it was 4096, and
# these devices hold one block only at ctx 128: 1279488 bytes vs 2295296 at 4096).
out=$("$KVASIR_BIN" plan -m "$model" --devices "$dir/devices.json" -o "$dir/ring.json")
echo "$out"
echo "$out" | grep -q '^model: .* ctx 128  seqs 1 ' || { echo "default ctx is not the model's 128"; exit 1; }
case "$out" in *"sequences)"*) echo "one sequence printed as plural: $out"; exit 1 ;; esac
echo "$out" | grep -q 'tokens/s (1 sequence)' || { echo "no one-sequence figure"; exit 1; }
set +e
"$KVASIR_BIN" plan -m "$model" --devices "$dir/devices.json" --ctx 4096 -o "$dir/x.json" 2>"$dir/err"; rc=$?
set -e
[ "$rc" = 1 ] || { echo "--ctx 4096 should not fit these devices: rc $rc"; exit 1; }
"$KVASIR_BIN" plan -m "$model" --devices "$dir/devices.json" --seqs 2 -o "$dir/x2.json" | grep -q '(2 sequences)' ||
    { echo "no 2-sequence figure"; exit 1; }
help=$("$KVASIR_BIN" plan --help)
for w in 'kvasir bench --probe' 'docs/PLAN.md' "min(model's, 4096)"; do
    case "$help" in *"$w"*) ;; *) echo "plan --help does not mention $w"; exit 1 ;; esac
done
# Without -o the manifest alone is on stdout (the table on stderr): a redirect
# gives a file the stages accept, identical to the -o file.
"$KVASIR_BIN" plan -m "$model" --devices "$dir/devices.json" >"$dir/stdout.json" 2>"$dir/stdout.err"
cmp -s "$dir/stdout.json" "$dir/ring.json" || { echo "plan's stdout is not the manifest:"; head -3 "$dir/stdout.json"; exit 1; }
grep -q '^predicted: ' "$dir/stdout.err" || { echo "no table on stderr without -o"; exit 1; }
# A manifest planned for another block count is refused at once, naming both.
# (n_block 5, the last window [3,5): a consistent manifest of a 5-block model)
python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); m["model"]["n_block"]=5; m["ranks"][-1]["window"]=[3,5]; json.dump(m,open(sys.argv[2],"w"))' \
    "$dir/ring.json" "$dir/nb5.json"
set +e
timeout 10 "$KVASIR_BIN" stage --manifest "$dir/nb5.json" --rank 0 2>"$dir/err"; rc=$?
set -e
[ "$rc" = 2 ] && grep -q 'plans 5 blocks but .* has 4' "$dir/err" || { echo "n_block 5 manifest: rc $rc, $(cat "$dir/err")"; exit 1; }
m=$(tr -d ' \n' <"$dir/ring.json")
case "$m" in '{"kvasir_manifest":1,'*) ;; *) echo "manifest does not start with the version"; exit 1 ;; esac
for w in '"window":[0,1]' '"window":[1,2]' '"window":[2,3]' '"window":[3,4]' '"n_block":4' \
         '"excluded":[]' '"url":null' '"rank":3'; do
    case "$m" in *"$w"*) ;; *) echo "manifest lacks $w"; exit 1 ;; esac
done
case "$m" in *'"rank":4'*) echo "more than 4 ranks"; exit 1 ;; esac
echo "$m" | grep -Eq '"fingerprint":"[0-9a-f]{64}"' || { echo "no fingerprint"; exit 1; }
# Every next is some rank's listen; the ring closes on rank 0. Listens use the
# devices' ports, so the 4 ranks listen on the 4 ports.
for pt in "${ports[@]}"; do
    n=$(echo "$m" | grep -o "\"listen\":\"127.0.0.1:$pt\"" | wc -l)
    [ "$n" = 1 ] || { echo "port $pt listened on $n times"; exit 1; }
    n=$(echo "$m" | grep -o "\"next\":\"127.0.0.1:$pt\"" | wc -l)
    [ "$n" = 1 ] || { echo "port $pt is next $n times"; exit 1; }
done
# Memory of each rank by hand (see the top): weights + kv + buffers.
for f in '"weights_bytes":329216,"kv_bytes":32768,"buffer_bytes":1048576' \
         '"weights_bytes":198144,"kv_bytes":32768,"buffer_bytes":1048576' \
         '"weights_bytes":329472,"kv_bytes":32768,"buffer_bytes":1050624'; do
    case "$m" in *"$f"*) ;; *) echo "manifest lacks $f"; exit 1 ;; esac
done
echo "$out" | grep -Eq '^predicted: [0-9.]+ ms/token, [0-9.]+ tokens/s' || { echo "no prediction line"; exit 1; }
[ "$(echo "$out" | grep -c '^[0-3] ')" = 4 ] || { echo "table does not have 4 rank rows"; exit 1; }

# Infeasible: 1000000 bytes per device; a block needs 198144 + 32768 + 1048576
# = 1279488 bytes: short by 279488.
sed 's/"mem_bytes": 1450000/"mem_bytes": 1000000/g' "$dir/devices.json" >"$dir/small.json"
set +e
"$KVASIR_BIN" plan -m "$model" --devices "$dir/small.json" --ctx 128 -o "$dir/x.json" 2>"$dir/err"; rc=$?
set -e
[ "$rc" = 1 ] || { echo "infeasible plan: rc $rc, expected 1"; exit 1; }
grep -q 'short by 279488 bytes' "$dir/err" || { echo "no shortfall in: $(cat "$dir/err")"; exit 1; }
[ ! -e "$dir/x.json" ] || { echo "a manifest was written for an infeasible plan"; exit 1; }
# A malformed inventory is a usage error naming the field.
echo '{"devices": [{"name": "a", "mem_bytes": -1, "decode_gbps": 1}]}' >"$dir/bad.json"
set +e
"$KVASIR_BIN" plan -m "$model" --devices "$dir/bad.json" 2>"$dir/err"; rc=$?
set -e
[ "$rc" = 2 ] || { echo "bad inventory: rc $rc, expected 2"; exit 1; }
grep -q 'mem_bytes' "$dir/err" || { echo "error does not name mem_bytes: $(cat "$dir/err")"; exit 1; }

# bench --probe prints an inventory device that plan accepts; --key adds its public key.
"$KVASIR_BIN" bench --probe --name probe --mib 16 --threads 1 --key "$dir/a.key" >"$dir/probe.json"
grep -q "\"key\": \"$("$KVASIR_BIN" key show --public "$dir/a.key")\"}\$" "$dir/probe.json" ||
    { echo "bench --probe --key: no key in $(cat "$dir/probe.json")"; exit 1; }
grep -Eq '^\{"name": "probe", "backend": "cpu", "mem_bytes": [0-9]+, "decode_gbps": [0-9.]+' "$dir/probe.json" ||
    { echo "bench --probe: $(cat "$dir/probe.json")"; exit 1; }
{ echo '['; cat "$dir/probe.json"; echo ']'; } >"$dir/probe_inv.json"
"$KVASIR_BIN" plan -m "$model" --devices "$dir/probe_inv.json" --ctx 128 -o "$dir/one.json" >/dev/null

# A relative -m is written as an absolute model.path: stages read the manifest
# from other directories.
rel=$(cd "$dir" && realpath --relative-to=. "$model")
(cd "$dir" && "$KVASIR_BIN" plan -m "$rel" --devices devices.json --ctx 128 -o rel.json >/dev/null)
grep -q "\"path\": \"$(realpath "$model")\"" "$dir/rel.json" ||
    { echo "relative -m not made absolute: $(grep '"path"' "$dir/rel.json")"; exit 1; }

# --url: the header over HTTP ranges from `kvasir seed` gives the same plan
# (the manifest differs only in model.path / model.url).
{
    "$KVASIR_BIN" seed "$KVASIR_SHARED/models" --port 0 --port-file "$dir/port" 2>"$dir/seed.err" &
    pids+=("$!")
    for _ in $(seq 100); do [ -s "$dir/port" ] && break; sleep 0.05; done
    [ -s "$dir/port" ] || { echo "seed did not start"; exit 1; }
    url="http://127.0.0.1:$(cat "$dir/port")/aidreams260K.gguf"
    # (a plan over HTTP cannot hash the weights: it is given the content id, as `shard index` prints it)
    cid=$("$KVASIR_BIN" shard index "$model" -o "$dir/ix.json" | sed -n 's/^content_id=//p')
    "$KVASIR_BIN" plan --url "$url" --content-id "$cid" --devices "$dir/devices.json" --ctx 128 \
        -o "$dir/ring_url.json" >/dev/null
    a=$(tr -d ' \n' <"$dir/ring.json" | sed 's/"path":"[^"]*","url":null/X/')
    b=$(tr -d ' \n' <"$dir/ring_url.json" | sed 's/"path":null,"url":"[^"]*"/X/')
    [ "$a" = "$b" ] || { echo "plan --url differs from plan -m"; echo "$a"; echo "$b"; exit 1; }
}

# --- the ring itself ---------------------------------------------------------
# Ranks 3..1 serve; rank 0 (the head) is a client of its own ring: it waits
# for the ring to close, runs the prompt greedily and prints the text.
# every rank's key came from its device
for r in 0 1 2 3; do
    dv=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["ranks"][int(sys.argv[2])]["device"])' "$dir/ring.json" "$r")
    kk=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["ranks"][int(sys.argv[2])]["key"])' "$dir/ring.json" "$r")
    [ "$kk" = "$("$KVASIR_BIN" key show --public "$dir/$dv.key")" ] || { echo "rank $r: key $kk is not device $dv's"; exit 1; }
    eval "dev$r=$dv"
done
# a node key that is not the manifest's key for its rank is refused at start-up, naming both
set +e
timeout 10 "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank 0 --key "$dir/$dev1.key" 2>"$dir/err"; rc=$?
set -e
[ "$rc" = 2 ] && grep -q "is key [0-9a-f]\{16\} but .* gives rank 0 key [0-9a-f]\{16\}" "$dir/err" ||
    { echo "wrong node key for rank 0: rc $rc, $(cat "$dir/err")"; exit 1; }
# `-m PATH` beside --manifest is the model this machine opens (the manifest's path is only a
# default): rank 3 opens a copy under another name; a path that does not exist is named.
cp "$model" "$dir/elsewhere.gguf"
set +e
timeout 20 "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank 3 -m "$dir/missing.gguf" >/dev/null 2>"$dir/missing.err"
rc=$?
set -e
[ "$rc" != 0 ] && grep -q "missing.gguf" "$dir/missing.err" ||
    { echo "--manifest with -m MISSING: rc $rc: $(cat "$dir/missing.err")"; exit 1; }
for r in 3 2 1; do
    if [ "$r" = 3 ]; then extra=(-m "$dir/elsewhere.gguf"); else extra=(); fi
    eval "dv=\$dev$r"
    "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank "$r" --key "$dir/$dv.key" "${extra[@]}" 2>"$dir/stage$r.err" &
    pids+=("$!")
done
expected=$(grep -o '"text":"[^"]*"' "$ref" | sed -e 's/^"text":"//' -e 's/"$//')
set +e
got=$(timeout 120 "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank 0 --key "$dir/$dev0.key" -p "Once upon a time" -n 60 --temp 0 \
      2>"$dir/stage0.err")
rc=$?
set -e
if [ "$rc" != 0 ] || [ "$got" != "$expected" ]; then
    echo "ring (rc $rc) output differs:"; echo " got:      [$got]"; echo " expected: [$expected]"
    tail -n 5 "$dir"/stage*.err; exit 1
fi
echo "ring of 4 planned stages reproduces the reference"

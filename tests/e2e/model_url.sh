#!/usr/bin/env bash
# `-m URL`: a model given as an http(s) URL is downloaded into the cache once
# and reused (the second run makes no request at all), through a server that
# redirects like Hugging Face (302 from one port to a `kvasir seed` on another
# that serves the bytes with ranges), with a token header that is never logged,
# verified against the index beside the model; a stage downloads only its window.
set -euo pipefail
K=${KVASIR_BIN:?KVASIR_BIN unset}
M=${KVASIR_SHARED:?KVASIR_SHARED unset}/models
HERE=$(cd "$(dirname "$0")" && pwd)
T=$(mktemp -d /tmp/kvs_model_url.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
stat_of() { sed -n "s/.*\"$2\": *\\([0-9]*\\).*/\\1/p" "$1"; }
seed_stat() { curl -s "http://127.0.0.1:$SEED_PORT/stats" | sed -n "s/.*\"$1\":\\([0-9]*\\).*/\\1/p"; }
wait_file() { for _ in $(seq 200); do [[ -s $1 ]] && return 0; sleep 0.05; done; fail "$1 did not appear"; }

# The served folder: the model and its index (kvasir seed serves both).
mkdir -p "$T/srv"
cp "$M/aidreams260K.gguf" "$T/srv/"
"$K" shard index "$T/srv/aidreams260K.gguf" -o "$T/srv/aidreams260K.gguf.kvindex.json"
"$K" seed "$T/srv" --port 0 --port-file "$T/seed.port" 2>>"$T/seed.log" &
PIDS+=($!)
wait_file "$T/seed.port"
SEED_PORT=$(cat "$T/seed.port")
TOKEN=hf_s3cr3t_t0ken_for_the_test
python3 "$HERE/tools/redirect_server.py" "$T/redir.port" "$SEED_PORT" "$T/redir.json" "$TOKEN" &
PIDS+=($!)
wait_file "$T/redir.port"
URL=http://127.0.0.1:$(cat "$T/redir.port")/redirect/aidreams260K.gguf
REF=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["text"], end="")' "$M/aidreams260K.ref.json")
SIZE=$(stat -c %s "$M/aidreams260K.gguf")

# 1. First run: downloads (through the redirect, with the token), verifies, prints the reference.
export XDG_CACHE_HOME=$T/xdg
b0=$(seed_stat bytes_served)
out=$(timeout 60 "$K" run -m "$URL" --hf-token "$TOKEN" -p "Once upon a time" -n 60 --temp 0 2>"$T/run1.log") ||
    { cat "$T/run1.log" >&2; fail "first run"; }
[[ $out == "$REF" ]] || fail "first run printed '$out', reference '$REF'"
b1=$(seed_stat bytes_served)
(( b1 - b0 >= SIZE / 2 )) || fail "first run: the seed served only $((b1 - b0)) bytes"
(( $(stat_of "$T/redir.json" authorized) >= 2 )) || fail "the redirect server never saw the token"
grep -q "verified against" "$T/run1.log" || { cat "$T/run1.log" >&2; fail "first run: no 'verified' line"; }
! grep -q "$TOKEN" "$T/run1.log" || fail "the token shows in the log"
ls "$T"/xdg/kvasir/*-aidreams260K.gguf >/dev/null || fail "no cache file under \$XDG_CACHE_HOME/kvasir"
[[ -z $(ls "$T"/xdg/kvasir/ | grep -E '\.part') ]] || fail "work files left in the cache"
echo "ok: first run downloaded $((b1 - b0)) bytes (file $SIZE) via the 302 and printed the reference"

# 2. Second run: no request to either server, same text.
h1=$(stat_of "$T/redir.json" hits); r1=$(seed_stat requests)
out=$(timeout 60 "$K" run -m "$URL" -p "Once upon a time" -n 60 --temp 0 2>"$T/run2.log") || fail "second run"
[[ $out == "$REF" ]] || fail "second run printed '$out'"
h2=$(stat_of "$T/redir.json" hits); r2=$(seed_stat requests); b2=$(seed_stat bytes_served)
(( h2 == h1 && b2 == b1 && r2 == r1 + 1 )) ||  # +1: our own /stats request
    fail "second run: redirect hits $h1 -> $h2, seed bytes $b1 -> $b2, requests $r1 -> $r2"
grep -q "nothing to download" "$T/run2.log" || fail "second run: no cache line"
echo "ok: second run: 0 requests, 0 bytes, the reference again"

# eval and serve reuse the same cache file (no request).
"$K" eval -m "$URL" --tokens 1,2,3 --top 2 >"$T/eval.out" 2>/dev/null || fail "eval -m URL"
[[ $(wc -l <"$T/eval.out") == 3 ]] || fail "eval printed $(wc -l <"$T/eval.out") lines"
(( $(stat_of "$T/redir.json" hits) == h2 )) || fail "eval made a request"
echo "ok: eval -m URL from the cache"

# 3. Without the token: a clear error, exit 1, nothing cached.
set +e
timeout 60 "$K" run -m "$URL" --cache "$T/c2" -p "x" -n 1 --temp 0 >/dev/null 2>"$T/run3.log"; rc=$?
set -e
(( rc == 1 )) || fail "no token: exit $rc"
grep -q "401" "$T/run3.log" || { cat "$T/run3.log" >&2; fail "no token: no HTTP 401 in the message"; }
[[ -z $(ls "$T/c2" 2>/dev/null | grep -v '\.part') ]] || fail "no token: a model was cached"
echo "ok: without the token: $(grep -o 'HTTP 401[^;]*' "$T/run3.log" | head -1)"

# 4. Stages download only their windows (--cache DIR, --header), and the ring prints the reference.
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
p0=$(freeport); p1=$(freeport)
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$T" 2 || fail "cannot make keys"
"$K" stage -m "$URL" --cache "$T/c3" --header "Authorization: Bearer $TOKEN" --window 2:4 --boundary f32 \
    $(key_args "$T" 1 2) --listen "127.0.0.1:$p1" --next "127.0.0.1:$p0" 2>"$T/tail.log" &
PIDS+=($!)
for _ in $(seq 200); do ls "$T"/c3/*blk2-4.gguf >/dev/null 2>&1 && break; sleep 0.05; done
ls "$T"/c3/*blk2-4.gguf >/dev/null 2>&1 || { cat "$T/tail.log" >&2; fail "the tail's window is not cached"; }
out=$(timeout 60 "$K" stage -m "$URL" --cache "$T/c3" --header "Authorization: Bearer $TOKEN" --window 0:2 \
    --boundary f32 $(key_args "$T" 0 2) --listen "127.0.0.1:$p0" --next "127.0.0.1:$p1" -p "Once upon a time" -n 60 --temp 0 \
    2>"$T/head.log") || { cat "$T/head.log" >&2; fail "ring head"; }
[[ $out == "$REF" ]] || fail "ring of URL windows printed '$out'"
[[ $out == "$REF" ]] || fail "ring of URL windows printed '$out'"
! grep -q "$TOKEN" "$T/tail.log" "$T/head.log" || fail "the token shows in a stage log"
echo "ok: ring of two stages, each given the URL and its window: the reference text"
# Window-only bytes need a model larger than the first 1 MiB header read: llama-q4_k_m (3 blocks).
cp "$M/llama-q4_k_m.gguf" "$T/srv/"
QSIZE=$(stat -c %s "$M/llama-q4_k_m.gguf")
b6=$(seed_stat bytes_served)
"$K" stage -m "${URL%/*}/llama-q4_k_m.gguf" --hf-token "$TOKEN" --cache "$T/c4" --window 1:2 --insecure \
    --listen "127.0.0.1:$(freeport)" --next "127.0.0.1:$(freeport)" 2>"$T/mid.log" &
PIDS+=($!)
for _ in $(seq 200); do ls "$T"/c4/*-llama-q4_k_m.blk1-2.gguf >/dev/null 2>&1 && break; sleep 0.05; done
ls "$T"/c4/*-llama-q4_k_m.blk1-2.gguf >/dev/null 2>&1 || { cat "$T/mid.log" >&2; fail "window 1:2 not cached"; }
b7=$(seed_stat bytes_served)
"$K" gguf info "$T"/c4/*-llama-q4_k_m.blk1-2.gguf | grep -q "window \[1,2)" || fail "the cached file is not window [1,2)"
(( b7 - b6 < QSIZE * 2 / 5 )) || fail "stage --window 1:2 fetched $((b7 - b6)) bytes of a $QSIZE-byte model"
echo "ok: stage --window 1:2 of llama-q4_k_m fetched $((b7 - b6)) of $QSIZE bytes"

# 5. plan -m URL reads the header only.
cat >"$T/devices.json" <<'JSON'
{"devices": [{"name": "a", "mem_bytes": 8000000000, "decode_gbps": 20, "addr": "127.0.0.1:7001"},
             {"name": "b", "mem_bytes": 8000000000, "decode_gbps": 20, "addr": "127.0.0.1:7002"}]}
JSON
b8=$(seed_stat bytes_served)
"$K" plan -m "http://127.0.0.1:$SEED_PORT/aidreams260K.gguf" --devices "$T/devices.json" -o "$T/ring.json" \
    2>/dev/null || fail "plan -m URL"
b9=$(seed_stat bytes_served)
(( b9 - b8 <= SIZE )) || fail "plan read $((b9 - b8)) bytes"
grep -q '"ranks"' "$T/ring.json" || fail "plan wrote no manifest"
echo "ok: plan -m URL: $((b9 - b8)) bytes read (header only)"

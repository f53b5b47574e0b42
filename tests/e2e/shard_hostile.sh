#!/usr/bin/env bash
# A hostile model server (issue 9, supply chain): wrong bytes under a right
# Content-Range, weights changed with a matching index, trickled index and
# data, headers and indexes claiming hundreds of MB. The fetch must verify by
# default where an index exists, say UNVERIFIED where none does, check the
# index against a trusted content id, fail in bounded time and bounded memory.
set -euo pipefail
K=${KVASIR_BIN:?KVASIR_BIN unset}
M=${KVASIR_SHARED:?KVASIR_SHARED unset}/models
TOOLS=$(cd "$(dirname "$0")/tools" && pwd)
T=$(mktemp -d /tmp/kvs_shard_hostile.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in python3 curl; do command -v "$tool" >/dev/null || fail "$tool is missing: run scripts/install-deps.sh"; done
field() { sed -n "s/.*\\b$1=\\([^ ]*\\).*/\\1/p" <<<"$2"; }
# rss CMD...: runs CMD, prints "RC MAXRSS_KB ELAPSED_S" (the child's peak resident set)
rss() {
    python3 -c 'import resource, subprocess, sys, time
t = time.time(); r = subprocess.run(sys.argv[1:])
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, int(time.time() - t))' "$@"
}

MODEL=$M/llama-q4_k_m.gguf
cid=$("$K" shard index "$MODEL" -o "$T/real.kvindex.json" | sed -n 's/^content_id=//p')
[[ ${#cid} == 64 ]] || fail "shard index printed no content id"
python3 "$TOOLS/hostile_seed.py" "$MODEL" "$T/real.kvindex.json" "$T/port" 2>"$T/py.log" & PIDS+=($!)
for _ in $(seq 100); do [[ -s $T/port ]] && break; sleep 0.05; done
[[ -s $T/port ]] || fail "hostile server did not start: $(cat "$T/py.log")"
H=http://127.0.0.1:$(cat "$T/port")
fetch() { "$K" shard fetch --window 1:2 --progress none --header-bytes 65536 "$@"; }

# Slow ones first, in the background: they must fail within the low-speed window (15 s), not hang.
(rss timeout 90 "$K" shard fetch --url "$H/slowindex/m.gguf" --window 1:2 -o "$T/si.gguf" --progress none \
     >"$T/si.rss" 2>"$T/si.err") & SI=$!; PIDS+=($SI)
(rss timeout 90 "$K" shard fetch --url "$H/slowdata/m.gguf" --window 1:2 -o "$T/sd.gguf" --progress none \
     --header-bytes 65536 >"$T/sd.rss" 2>"$T/sd.err") & SD=$!; PIDS+=($SD)

# 1. right Content-Range, bytes from another offset, the index beside the model: no --index given,
#    the fetch finds the index by default and refuses.
if fetch --url "$H/offset/m.gguf" -o "$T/o1.gguf" 2>"$T/err"; then fail "wrong bytes accepted (index on the server)"; fi
grep -q "does not match the index" "$T/err" || fail "unclear error: $(cat "$T/err")"
[[ ! -e $T/o1.gguf ]] || fail "output left"
echo "ok: wrong bytes, default --index auto -> $(cat "$T/err")"

# 2. the same without an index: it completes, but says UNVERIFIED on the terminal.
out=$(fetch --url "$H/offsetnoix/m.gguf" -o "$T/o2.gguf" 2>"$T/err") || fail "fetch without an index: $(cat "$T/err")"
[[ $(field verified "$out") == no ]] || fail "verified without an index: $out"
grep -q "WARNING: .* is UNVERIFIED" "$T/err" || fail "no UNVERIFIED warning: $(cat "$T/err")"
! grep -q kvasir.shard.source_content_id "$T/o2.gguf" || fail "an unverified shard claims a content id"
echo "ok: no index -> $(grep UNVERIFIED "$T/err")"

# 3. weights changed (every F32 tensor negated: same shapes, same fingerprint) with a matching index,
#    served by kvasir seed: the trusted content id refuses it; an honest server passes it.
mkdir "$T/evil" "$T/honest"
python3 - "$MODEL" "$T/real.kvindex.json" "$T/evil/m.gguf" <<'PY'
import json, struct, sys
data = bytearray(open(sys.argv[1], 'rb').read())
for t in json.load(open(sys.argv[2]))['tensors']:
    if t['type'] == 'F32':
        o, n = t['offset'], t['size'] // 4
        v = struct.unpack_from('<%df' % n, data, o)
        struct.pack_into('<%df' % n, data, o, *[-x for x in v])
open(sys.argv[3], 'wb').write(data)
PY
"$K" shard index "$T/evil/m.gguf" -o "$T/evil/m.gguf.kvindex.json" >/dev/null
cp "$MODEL" "$T/honest/m.gguf"; cp "$T/real.kvindex.json" "$T/honest/m.gguf.kvindex.json"
[[ $("$K" gguf info "$T/evil/m.gguf" | grep fingerprint) == $("$K" gguf info "$MODEL" | grep fingerprint) ]] ||
    fail "the negated model should keep the fingerprint"
for d in evil honest; do
    "$K" seed "$T/$d" --port 0 --port-file "$T/$d.port" 2>>"$T/seed.log" & PIDS+=($!)
done
for _ in $(seq 100); do [[ -s $T/evil.port && -s $T/honest.port ]] && break; sleep 0.05; done
EV=http://127.0.0.1:$(cat "$T/evil.port"); HO=http://127.0.0.1:$(cat "$T/honest.port")
out=$(fetch --url "$EV/m.gguf" -o "$T/e0.gguf" 2>"$T/err") || fail "evil without a content id: $(cat "$T/err")"
[[ $(field verified "$out") == yes && $(field trusted "$out") == no ]] || fail "evil without a content id: $out"
grep -q "verified against the server's own index" "$T/err" || fail "no note on an untrusted index: $(cat "$T/err")"
if fetch --url "$EV/m.gguf" -o "$T/e1.gguf" --content-id "$cid" 2>"$T/err"; then fail "negated weights accepted"; fi
grep -q "describes other weights .* than the trusted content id" "$T/err" || fail "unclear error: $(cat "$T/err")"
[[ ! -e $T/e1.gguf ]] || fail "output left"
echo "ok: negated weights + matching index -> $(cat "$T/err")"
out=$(fetch --url "$HO/m.gguf" -o "$T/h1.gguf" --content-id "$cid") || fail "honest fetch with the content id"
[[ $(field trusted "$out") == yes && $(field content_id "$out") == "$cid" ]] || fail "honest: $out"
"$K" shard extract -m "$MODEL" --window 1:2 -o "$T/ext.gguf"
cmp "$T/h1.gguf" "$T/ext.gguf" || fail "trusted fetch differs from the extracted shard"
grep -q "kvasir.shard.source_content_id" "$T/h1.gguf" || fail "the shard does not record its content id"
if fetch --url "$H/offsetnoix/m.gguf" -o "$T/o3.gguf" --content-id "$cid" 2>"$T/err"; then
    fail "a content id without an index was accepted"; fi
grep -q "has no shard index" "$T/err" || fail "unclear error: $(cat "$T/err")"
echo "ok: trusted content id: honest server passes (trusted=yes, == extract), no index refused"

# 3b. every weight right and the real index, but one token string changed in the header the server
#     sends: the content id covers the metadata, so the fetch refuses it (with or without a trusted id).
for args in "" "--content-id $cid"; do
    # shellcheck disable=SC2086
    if fetch --url "$H/tokswap/m.gguf" -o "$T/ts.gguf" $args 2>"$T/err"; then
        fail "a swapped token string accepted (${args:-no content id})"; fi
    grep -q "metadata in .* header (tokenizer, chat template, hyperparameters) is not the one the index describes" \
        "$T/err" || fail "unclear error: $(cat "$T/err")"
    [[ ! -e $T/ts.gguf ]] || fail "output left"
done
echo "ok: one token string swapped, right weights and index -> $(cat "$T/err")"

# 4. a header claiming a 900 MB string: refused before the download, small RSS.
read -r rc kb secs < <(rss timeout 60 "$K" shard fetch --url "$H/hugehdr/m.gguf" --window 0:1 -o "$T/hh.gguf" \
    --progress none 2>"$T/err")
(( rc != 0 && rc != 124 )) || fail "huge header: rc $rc: $(cat "$T/err")"
(( kb < 200000 )) || fail "huge header: peak RSS $kb KiB"
grep -q "claims .* bytes or more" "$T/err" || fail "unclear error: $(cat "$T/err")"
echo "ok: 900 MB header claim -> rc $rc, peak RSS $kb KiB, ${secs}s: $(cat "$T/err")"

# 5. a 600 MB index, with and without Content-Length: capped by what this model's index can be.
for mode in hugeindex hugeindex2; do
    read -r rc kb secs < <(rss timeout 60 "$K" shard fetch --url "$H/$mode/m.gguf" --window 1:2 -o "$T/hi.gguf" \
        --progress none --header-bytes 65536 2>"$T/err")
    (( rc != 0 && rc != 124 )) || fail "$mode: rc $rc: $(cat "$T/err")"
    (( kb < 200000 )) || fail "$mode: peak RSS $kb KiB"
    grep -q "index is larger than" "$T/err" || fail "$mode: unclear error: $(cat "$T/err")"
    echo "ok: $mode (600 MB) -> rc $rc, peak RSS $kb KiB, ${secs}s: $(cat "$T/err")"
done

# 6. the trickles: failed, within 15 s + slack, with a clear error.
wait "$SI" || true; wait "$SD" || true
for x in si sd; do
    read -r rc kb secs <"$T/$x.rss"
    (( rc != 0 && rc != 124 )) || fail "$x: rc $rc (124 = hung until the test's timeout): $(cat "$T/$x.err")"
    (( secs <= 40 )) || fail "$x: took ${secs}s"
    grep -q "too slow" "$T/$x.err" || fail "$x: unclear error: $(cat "$T/$x.err")"
    echo "ok: $x (1 byte per 2 s) -> failed in ${secs}s: $(cat "$T/$x.err")"
done

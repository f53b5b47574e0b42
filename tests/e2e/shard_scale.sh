#!/usr/bin/env bash
# Window-only download at scale: a sparse GGUF shaped like Qwen3.5-122B-A10B
# at Q4_K-class sizes (49 blocks of ~1.5 GB, ~77 GB apparent, data a hole)
# served by `kvasir seed` on loopback; fetching one block moves that block's
# bytes (plus the header), not the file, and the shard is written sparse.
set -euo pipefail
K=${KVASIR_BIN:?KVASIR_BIN unset}
T=$(mktemp -d /tmp/kvs_shard_scale.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
field() { sed -n "s/.*\\b$1=\\([^ ]*\\).*/\\1/p" <<<"$2"; }

mkdir "$T/models"
"$K" shard synth-sparse -o "$T/models/big.gguf"
size=$(stat -c %s "$T/models/big.gguf")
(( size > 70000000000 && size < 85000000000 )) || fail "synthetic model is $size bytes, expected ~77 GB"
used_kb=$(du -k "$T/models/big.gguf" | cut -f1)
SPARSE=1
(( used_kb < 65536 )) || { SPARSE=0; echo "note: this filesystem does not keep holes ($used_kb KiB used)"; }
echo "synthetic model: $size bytes apparent, $used_kb KiB on disk"

"$K" seed "$T/models" --port 0 --port-file "$T/port" 2>"$T/seed.log" & PIDS+=($!)
for _ in $(seq 100); do [[ -s $T/port ]] && break; sleep 0.05; done
[[ -s $T/port ]] || fail "seed did not start"
P=$(cat "$T/port")
served() { curl -s "http://127.0.0.1:$P/stats" | sed -n 's/.*"bytes_served":\([0-9]*\).*/\1/p'; }

# the listing knows the file and its fingerprint
curl -s "http://127.0.0.1:$P/models" | grep -q '"name":"big.gguf","size":'"$size"',"fingerprint":"[0-9a-f]\{64\}"' ||
    fail "/models: $(curl -s "http://127.0.0.1:$P/models")"

before=$(served)
start=$(date +%s.%N)
out=$("$K" shard fetch --url "http://127.0.0.1:$P/big.gguf" --window 20:21 -o "$T/b20.gguf" --progress none)
end=$(date +%s.%N)
after=$(served)
echo "$out"
wb=$(field window_bytes "$out"); db=$(field data_bytes "$out"); hb=$(field header_bytes "$out")
# blk.20: Q4_K gate/up experts 2 x 453 MB, Q6_K down experts 660 MB, attention + shared expert ~40 MB
(( wb > 1400000000 && wb < 1700000000 )) || fail "block 20 is $wb bytes, expected ~1.5 GB"
(( db <= wb + wb / 100 )) || fail "downloaded $db data bytes for a $wb-byte window"
(( after - before == db + hb )) || fail "seed served $((after - before)), fetch counted $((db + hb))"
(( after - before <= wb + wb / 100 + hb )) || fail "seed served $((after - before)) bytes"
(( after - before < size / 40 )) || fail "fetched a large part of the file"
osize=$(stat -c %s "$T/b20.gguf")
(( osize > wb && osize < wb + hb + 1048576 )) || fail "shard is $osize bytes"
okb=$(du -k "$T/b20.gguf" | cut -f1)
if (( SPARSE )); then (( okb < 65536 )) || fail "the all-zero shard takes $okb KiB on disk: not written sparse"; fi
echo "ok: one block of $size bytes: served $((after - before)) bytes in $(echo "$end - $start" | bc 2>/dev/null || echo '?') s; shard $osize bytes, $okb KiB on disk"
echo "PASS"

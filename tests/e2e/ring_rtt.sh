#!/usr/bin/env bash
# A ring whose links are slow (TLS through the proxy): every chunk on the link from the head to its
# successor waits 50 ms in a proxy, so a probe takes longer to come round
# than the head's probe interval before the ring is known closed (20 ms).
# The ring must still close and serve the reference continuation: a probe
# counts when it is one of the recent ones, not only the latest (once it
# counted only the latest, and such a ring never became ready).
set -euo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v python3 >/dev/null || { echo "FAIL: python3 missing: run scripts/install-deps.sh"; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
P0=$(free_port); P1=$(free_port); PX=$(free_port)
T=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
. "$here/tools/ring_keys.sh"
ring_keys "$T" 2
timeout 60 python3 "$here/tools/delay_proxy.py" "$PX" "$P1" 0.05 & pids+=($!)
timeout 60 "$BIN" stage -m "$M" --window 2:4 $(key_args "$T" 1 2) --listen 127.0.0.1:$P1 --next 127.0.0.1:$P0 2>"$T/tail.err" & pids+=($!)
out=$(timeout 40 "$BIN" stage -m "$M" --window 0:2 $(key_args "$T" 0 2) --listen 127.0.0.1:$P0 --next 127.0.0.1:$PX \
      -p "Once upon a time" -n 20 --temp 0 2>"$T/head.err") || { echo "FAIL: head: $(tail -3 "$T/head.err")"; exit 1; }
want=", pixels unfolding like petals. Classific"
[ "$out" = "$want" ] || { echo "FAIL: got '$out', expected '$want'"; exit 1; }
grep -q '1 requests done, 0 failed, 20 tokens' "$T/head.err" || { echo "FAIL: $(tail -2 "$T/head.err")"; exit 1; }
echo "ok: a ring with a 50 ms link closes and serves the reference text"

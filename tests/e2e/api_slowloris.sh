#!/usr/bin/env bash
# The HTTP API's door under attack (issue 9): a whole-request deadline (a slow
# sender is closed --request-timeout s after accept, though it never idles),
# the per-address limit (503 past it), 80 slowloris sockets from 5 addresses
# held against 64 slots while a legitimate client's requests still complete,
# and 200 concurrent streams each answered (a whole stream or a 503, none
# reset). The checks and figures are in tests/e2e/tools/slowloris.py.
set -euo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
SRC=${KVASIR_SRC:-$(cd "$(dirname "$0")/../.." && pwd)}
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
T=$(mktemp -d /tmp/kvs_slowloris.XXXXXX)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
P=$(free_port)
"$BIN" serve -m "$M" --port "$P" --request-timeout 3 --max-connections 64 --max-per-addr 16 2>"$T/serve.log" &
pid=$!
for _ in $(seq 100); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$P/health")" = 200 ] && break
  sleep 0.1
done
timeout 90 python3 "$SRC/tests/e2e/tools/slowloris.py" "$P" 3 16 || { echo "--- serve log"; tail -20 "$T/serve.log"; exit 1; }
# the refusals are counted, and logged in summaries (not one line per socket)
m=$(curl -s "http://127.0.0.1:$P/metrics")
for o in refused_full refused_address timed_out; do
  v=$(sed -n "s/^kvasir_http_connections_total{outcome=\"$o\"} //p" <<<"$m")
  [ "${v:-0}" -gt 0 ] || { echo "FAIL: /metrics counts no $o connection"; grep http_connections <<<"$m"; exit 1; }
done
n=$(grep -c 'api: connections refused' "$T/serve.log" || true)
[ "$n" -le 10 ] || { echo "FAIL: $n refusal log lines (want rate-limited summaries)"; exit 1; }
kill -0 "$pid" || { echo "FAIL: serve died"; exit 1; }
echo ok

#!/usr/bin/env bash
# kvasir plan with a device that accepts no inbound connection ("phone") and
# a relay in the inventory writes that device's two edges as relay URLs with
# their tokens (docs/MANIFEST.md "Relayed edges"); `kvasir stage --manifest`
# runs them as written: the phone's stage dials both links out (no listening
# socket of its own), its neighbours dial the relay for the matching ends, TLS
# between node keys runs inside, and the ring of 4 reproduces the aidreams260K
# llama.cpp reference (../shared/models/README.md). Loopback only.
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}"
command -v openssl >/dev/null && command -v ss >/dev/null || { echo "FAIL: openssl/ss missing: run scripts/install-deps.sh"; exit 1; }
model="$KVASIR_SHARED/models/aidreams260K.gguf"
ref="$KVASIR_SHARED/models/aidreams260K.ref.json"
dir=$(mktemp -d /tmp/kvs_relay_manifest.XXXXXX)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$dir"/*.err; do echo "--- $f"; tail -n 8 "$f"; done; exit 1; }
ports=()
p=$((20000 + ($$ % 12000)))
while [ "${#ports[@]}" -lt 4 ]; do
  if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then ports+=("$p"); fi
  p=$((p + 1))
done
RP=${ports[3]}
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$dir/relay.key" -out "$dir/relay.pem" \
  -days 2 -subj /CN=kvasir-test-relay -addext "subjectAltName=IP:127.0.0.1" 2>/dev/null
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/secret"
"$KVASIR_BIN" relay --listen 127.0.0.1:$RP --secret "$dir/secret" --cert "$dir/relay.pem" --key "$dir/relay.key" \
  2>"$dir/relay.err" & pids+=($!)

for d in a b c phone; do "$KVASIR_BIN" key gen -o "$dir/$d.key" >/dev/null; done
dev() { # name port|"" inbound
  local addr=""
  [ -n "$2" ] && addr="\"addr\": \"127.0.0.1:$2\", "
  printf '{"name": "%s", "backend": "cpu", "mem_bytes": 1450000, "decode_gbps": 10, "rtt_ms": 0.05, "bandwidth_mbps": 10000, "threads": 1, %s"accepts_inbound": %s, "key": "%s"}' \
    "$1" "$addr" "$3" "$("$KVASIR_BIN" key show --public "$dir/$1.key")"
}
{
  echo "{\"relay\": {\"rtt_ms\": 1, \"url\": \"wss://127.0.0.1:$RP\"}, \"devices\": ["
  dev a "${ports[0]}" true; echo ','
  dev b "${ports[1]}" true; echo ','
  dev c "${ports[2]}" true; echo ','
  dev phone "" false
  echo ']}'
} >"$dir/devices.json"
"$KVASIR_BIN" plan -m "$model" --devices "$dir/devices.json" --relay-secret "$dir/secret" -o "$dir/ring.json" >/dev/null \
  2>"$dir/plan.err" || fail "plan: $(cat "$dir/plan.err")"
jq() { python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$dir/ring.json" "$1"; }
n=$(jq 'len(m["ranks"])')
[ "$n" = 4 ] || fail "plan made $n ranks, want 4"
ph=$(jq '[r["rank"] for r in m["ranks"] if r["device"]=="phone"][0]')
case "$(jq "m['ranks'][$ph]['listen']") $(jq "m['ranks'][$ph]['next']")" in
  "wss://127.0.0.1:$RP/edge/"*"?token="*" wss://127.0.0.1:$RP/edge/"*"?token="*) ;;
  *) fail "the phone's rank $ph has no relay URLs: $(jq "m['ranks'][$ph]")" ;;
esac
echo "manifest: the phone (rank $ph) has both edges through the relay"
dv() { jq "m['ranks'][$1]['device']"; }
for r in 3 2 1; do
  "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank $r --key "$dir/$(dv $r).key" --relay-ca "$dir/relay.pem" \
    2>"$dir/stage$r.err" & pids+=($!)
  [ $r = "$ph" ] && phone_pid=$!
done
expected=$(grep -o '"text":"[^"]*"' "$ref" | sed -e 's/^"text":"//' -e 's/"$//')
set +e
got=$(timeout 120 "$KVASIR_BIN" stage --manifest "$dir/ring.json" --rank 0 --key "$dir/$(dv 0).key" \
  --relay-ca "$dir/relay.pem" -p "Once upon a time" -n 60 --temp 0 2>"$dir/stage0.err")
rc=$?
set -e
[ "$rc" = 0 ] && [ "$got" = "$expected" ] || fail "ring (rc $rc) output differs: got [$got] want [$expected]"
echo "ring from the manifest, two edges through the relay: reference continuation OK"
[ -n "${phone_pid:-}" ] || fail "the phone is rank 0 (the planner should put relay-only devices last)"
kill -0 $phone_pid || fail "the phone's stage is gone"
l=$(ss -ltnpH | grep "pid=$phone_pid," || true)
[ -z "$l" ] || fail "the phone's stage listens: $l"
echo "the phone's stage has no listening socket"
# bad relay URLs and pins are start-up errors that say what is wrong
M1=(-m "$model" --window 1:2 --insecure)
set +e
"$KVASIR_BIN" stage "${M1[@]}" --listen "wss://127.0.0.1:$RP/edge/e1" --next 127.0.0.1:1 2>"$dir/e1"; r1=$?
"$KVASIR_BIN" stage "${M1[@]}" --listen 127.0.0.1:0 --next "wss://127.0.0.1:$RP/other/e1?token=00" 2>"$dir/e2"; r2=$?
"$KVASIR_BIN" stage "${M1[@]}" --listen 127.0.0.1:0 --next 127.0.0.1:1 --relay-pin 1234 2>"$dir/e3"; r3=$?
set -e
[ $r1 != 0 ] && grep -q "needs its edge token" "$dir/e1" || fail "a relay URL without a token: rc $r1 $(cat "$dir/e1")"
[ $r2 != 0 ] && grep -q "path must be /edge/EDGE_ID" "$dir/e2" || fail "a relay URL with a bad path: rc $r2 $(cat "$dir/e2")"
[ $r3 != 0 ] && grep -q "pin must be 64 lowercase hex digits" "$dir/e3" || fail "a bad --relay-pin: rc $r3 $(cat "$dir/e3")"
echo "bad relay URLs and pins: clear start-up errors"
echo PASS

#!/usr/bin/env bash
# The shipped example inventory (examples/devices.json) plans a real model, and
# `kvasir plan` warns when an inventory mixes devices with and without "addr"
# (those ranks would listen on 127.0.0.1 and be dialed there by other machines).
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}" "${KVASIR_SRC:?}"
model="$KVASIR_SHARED/models/llama-q4_k_m.gguf"
T=$(mktemp -d /tmp/kvs_plan_inv.XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

"$KVASIR_BIN" plan -m "$model" --devices "$KVASIR_SRC/examples/devices.json" -o "$T/ring.json" >"$T/out" 2>"$T/err" ||
    fail "examples/devices.json: $(cat "$T/err")"
grep -q '"listen": "192.168.1.10:7001"' "$T/ring.json" || fail "the example's addr is not rank 0's listen: $(cat "$T/ring.json")"
! grep -q "warning" "$T/err" || fail "warning on the example inventory: $(cat "$T/err")"

cat >"$T/mixed.json" <<'JSON'
{"devices": [{"name": "a", "mem_bytes": 8000000000, "decode_gbps": 20, "addr": "10.0.0.5:7001"},
             {"name": "b", "mem_bytes": 8000000000, "decode_gbps": 20},
             {"name": "c", "mem_bytes": 8000000000, "decode_gbps": 20}]}
JSON
"$KVASIR_BIN" plan -m "$model" --devices "$T/mixed.json" >/dev/null 2>"$T/err" || fail "mixed: $(cat "$T/err")"
grep -q "warning: 1 of 3 devices have an \"addr\" but 'b', 'c' have none" "$T/err" || fail "no warning: $(cat "$T/err")"

sed 's/, "addr": "10.0.0.5:7001"//' "$T/mixed.json" >"$T/local.json"
"$KVASIR_BIN" plan -m "$model" --devices "$T/local.json" >/dev/null 2>"$T/err" || fail "local: $(cat "$T/err")"
! grep -q "warning" "$T/err" || fail "warning without any addr (one machine): $(cat "$T/err")"
echo "ok: examples/devices.json plans; an inventory mixing devices with and without addr warns"

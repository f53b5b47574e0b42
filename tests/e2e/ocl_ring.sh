#!/usr/bin/env bash
# The OpenCL backend (on PoCL in CI) in rings and at start-up:
# - a ring of a CPU head, an OpenCL middle and a CPU tail (separate stage
#   processes) serves aidreams260K's reference text exactly;
# - on every other shared model (qwen35/qwen35moe included), a ring of
#   OpenCL stages (F32 boundaries) gives the single OpenCL process's greedy
#   output token for token;
# - no OpenCL platform, a device index past the last, a bad
#   --backend: clear start-up errors, and the CPU backend still runs without
#   any platform;
# - bench --probe --backend opencl -> plan -> stage --manifest, and serve, on OpenCL.
set -uo pipefail
BIN=${KVASIR_BIN:?}
D=${KVASIR_SHARED:?}/models
M=$D/aidreams260K.gguf
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "== $f"; tail -15 "$f"; }; done; exit 1; }
base=$((12000 + ($$ % 80) * 100))  # below the ephemeral range (32768+), away from the 20000+ tests
A0=127.0.0.1:$base A1=127.0.0.1:$((base + 1)) A2=127.0.0.1:$((base + 2))

# 1. CPU head [0,1), OpenCL middle [1,3), CPU tail [3,4)
"$BIN" stage -m "$M" --window 1:3 --listen "$A1" --next "$A2" --insecure --threads 1 --backend opencl \
  2>"$tmp/mid.log" &
pids+=($!)
"$BIN" stage -m "$M" --window 3:4 --listen "$A2" --next "$A0" --insecure --threads 1 2>"$tmp/tail.log" &
pids+=($!)
got=$(timeout 60 "$BIN" stage -m "$M" --window 0:1 --listen "$A0" --next "$A1" --insecure --threads 1 \
  -p "Once upon a time" -n 60 --temp 0 2>"$tmp/head.log") || fail "mixed ring failed"
[[ "$got" == "$want" ]] || fail "mixed ring: [$got], want [$want]"
grep -q "OpenCL device 0" "$tmp/mid.log" || fail "the middle stage did not run on OpenCL"
for p in "${pids[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; pids=()
echo "ok: cpu head / opencl middle / cpu tail reproduces aidreams260K"

# 2. OpenCL rings == one OpenCL process
for name in llama-f32 llama-mixed llama-q2_k llama-q4_k_m llama-q5_k_m qwen2-mixed qwen3-q8_0 qwen3moe-mixed \
  qwen35-mixed qwen35moe-q4_k; do
  one=$(timeout 60 "$BIN" run -m "$D/$name.gguf" -p "Once upon a time" -n 16 --temp 0 --ignore-eos --threads 1 \
    --backend opencl 2>"$tmp/one.log") || fail "$name: single OpenCL process failed"
  ring=$(timeout 90 "$BIN" run --ring 2 -m "$D/$name.gguf" -p "Once upon a time" -n 16 --temp 0 --ignore-eos \
    --threads 2 --boundary f32 --insecure --backend opencl 2>"$tmp/ring.log") || fail "$name: OpenCL ring failed"
  [[ -n "$one" && "$ring" == "$one" ]] || fail "$name: OpenCL ring [$ring] != single OpenCL process [$one]"
  echo "ok: $name: OpenCL ring of 2 == single OpenCL process"
done

# 3. bench --probe --backend opencl -> inventory -> plan -> stage --manifest runs on OpenCL
"$BIN" bench --probe --backend opencl --mib 16 --name gpu0 --addr "$A0" >"$tmp/entry.json" 2>"$tmp/probe.log" ||
  fail "bench --probe --backend opencl"
grep -q "OpenCL device 0: " "$tmp/probe.log" || fail "bench --probe did not list the OpenCL devices"
grep -q '"backend": "opencl"' "$tmp/entry.json" || fail "probe entry: $(cat "$tmp/entry.json")"
printf '{"devices": [%s]}\n' "$(cat "$tmp/entry.json")" >"$tmp/dev.json"
"$BIN" plan -m "$M" --devices "$tmp/dev.json" --ctx 96 --seqs 2 -o "$tmp/man.json" >/dev/null 2>"$tmp/plan.log" ||
  fail "plan over the probed OpenCL device"
grep -q '"backend": "opencl"' "$tmp/man.json" || fail "the manifest lost the backend"
got=$(timeout 30 "$BIN" stage --manifest "$tmp/man.json" --rank 0 --insecure -p "Once upon a time" -n 60 --temp 0 \
  2>"$tmp/man-stage.log") || fail "stage --manifest on OpenCL"
[[ "$got" == "$want" ]] || fail "stage --manifest (opencl): [$got]"
grep -q "OpenCL device 0" "$tmp/man-stage.log" || fail "the manifest's opencl rank ran on the CPU"
echo "ok: probe -> plan -> stage --manifest runs the rank on OpenCL"

# 4. serve --backend opencl answers the API from the device
PS=$((base + 50))
"$BIN" serve -m "$M" --port "$PS" --backend opencl 2>"$tmp/serve.log" &
spid=$!
pids+=($spid)
for ((t = 0; t < 100; t++)); do curl -sf "http://127.0.0.1:$PS/health" >/dev/null && break; sleep 0.1; done
resp=$(curl -s --max-time 30 "http://127.0.0.1:$PS/v1/completions" \
  -d '{"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}')
grep -qF '"text":", pixels unfolding like petals. Classific"' <<<"$resp" || fail "serve on OpenCL: $resp"
grep -q "OpenCL device 0" "$tmp/serve.log" || fail "serve did not run on OpenCL"
kill "$spid"; wait "$spid" 2>/dev/null
echo "ok: serve --backend opencl"

# 5. start-up errors
mkdir "$tmp/no-icd"
out=$(OCL_ICD_VENDORS=$tmp/no-icd timeout 20 "$BIN" run -m "$M" -p "Once" -n 4 --temp 0 --backend opencl 2>&1); rc=$?
[[ $rc == 1 ]] && grep -q "no OpenCL platform found" <<<"$out" || fail "no platform: rc $rc, [$out]"
out=$(OCL_ICD_VENDORS=$tmp/no-icd timeout 20 "$BIN" run -m "$M" -p "Once upon a time" -n 60 --temp 0 2>/dev/null)
[[ "$out" == "$want" ]] || fail "the CPU backend without an OpenCL platform: [$out]"
out=$(timeout 20 "$BIN" eval -m "$M" --tokens 1,2 --backend opencl --device 9 2>&1); rc=$?
[[ $rc == 1 ]] && grep -q "OpenCL device 9 does not exist" <<<"$out" || fail "--device 9: rc $rc, [$out]"
out=$(timeout 20 "$BIN" run -m "$M" -p x --backend cuda 2>&1); rc=$?
[[ $rc == 2 ]] || fail "--backend cuda: rc $rc, [$out]"
echo "ok: start-up errors"
echo PASS

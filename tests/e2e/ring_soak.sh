#!/usr/bin/env bash
# Quick soak of hold and replay (issue 13): bench/soak_replay.py with 200
# requests through serve --ring 4 (8 in flight), a random stage killed with
# SIGKILL every 50: 0 lost, 0 differing from the undisturbed texts, every RSS
# within 10%. The full soak (2,000 requests, a kill every 200) is the bench.
# KVASIR_SANITIZED=1 (CI's ASan+UBSan run): the RSS bound is not applied (ASan's
# quarantine keeps freed memory resident); CI checks it in the Release run.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v python3 >/dev/null || { echo "FAIL: python3 missing"; exit 1; }
# below 32768: a port in the ephemeral range can be held in TIME_WAIT by any client on the machine
port=$((20000 + ($$ % 120) * 100 + 80))
rss_flag=()
[[ ${KVASIR_SANITIZED:-0} == 1 ]] && rss_flag=(--no-rss-bound)
out=$(timeout 240 python3 "$(dirname "$0")/../../bench/soak_replay.py" --bin "$BIN" --model "$M" --requests 200 \
  --kill-every 50 --port "$port" "${rss_flag[@]}" 2>&1)
rc=$?
echo "$out"
log=$(echo "$out" | grep -o 'serve log [^)]*' | cut -d' ' -f3)
[[ $rc == 0 ]] || { echo "FAIL: soak (rc $rc)"; [[ -n $log ]] && grep -v ' info: api: ' "$log" | tail -30; rm -f "$log"; exit 1; }
rm -f "$log"
echo "$out" | grep -q 'soak: lost 0, differing 0' || { echo "FAIL: lost or differing requests"; exit 1; }
kills=$(echo "$out" | grep -o '[0-9]* kills' | cut -d' ' -f1)
[[ ${kills:-0} -ge 3 ]] || { echo "FAIL: only ${kills:-0} kills"; exit 1; }
echo PASS

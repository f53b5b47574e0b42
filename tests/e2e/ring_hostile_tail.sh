#!/usr/bin/env bash
# A head stage behind a tail that breaks the protocol (tests/e2e/tools/fake_tail.py):
#  - dup:  every TOKEN twice -> the request fails, naming the duplicate (it
#          once counted every copy: 51 completion tokens for max_tokens 3);
#  - pos:  a TOKEN at a position the head did not ask for -> fails, naming it;
#  - long: a tail that never finishes -> the head stops at max_tokens itself;
#  - trail: every other probe trail forged (timestamps near 2^63 us) -> dropped,
#          logged; the probe RTT in /metrics stays a real figure from the valid ones
#          (was -9.2e12 s; UBSan: signed overflow);
#  - ghost: the ring stops moving, only TOKENs for an unknown request id come back
#          -> not progress: the stall timer fails the request (it used to hang).
# The head survives each and answers /health. The head runs --insecure: the fake
# tail speaks plaintext frames (a tail that proved its key could still misbehave).
set -euo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v python3 >/dev/null && command -v curl >/dev/null || { echo "FAIL: python3/curl missing: run scripts/install-deps.sh"; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
free_port() { python3 -c 'import socket;s=socket.socket();s.bind(("127.0.0.1",0));print(s.getsockname()[1])'; }
T=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
for mode in dup pos long trail ghost; do
  PH=$(free_port); PT=$(free_port); PA=$(free_port)
  extra=""; [ "$mode" = ghost ] && extra="--replay-deadline 0" # a stall fails the request at once (no hold, §5.1)
  KVASIR_BIN="$BIN" timeout 40 python3 "$here/tools/fake_tail.py" "$M" "$PT" "$PH" "$mode" 4 64 128 4 2 & pids+=($!)
  sleep 0.3
  timeout 40 "$BIN" stage -m "$M" --window 0:2 --listen 127.0.0.1:$PH --next 127.0.0.1:$PT --api $PA --insecure $extra \
    2>"$T/$mode.log" & hp=$!; pids+=($hp)
  for _ in $(seq 200); do # up to 20 s: the fake tail and the head load beside other tests
    [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" = 200 ] && break
    sleep 0.1
  done
  t0=$(date +%s%N)
  out=$(curl -s -m 20 http://127.0.0.1:$PA/v1/completions -d '{"prompt":"Once","max_tokens":3,"temperature":0}' || true)
  dt=$((($(date +%s%N) - t0) / 1000000))
  case "$mode" in
    dup)  case "$out" in *'another token (position'*'before the last one was fed'*) ;; *) fail "dup: $out" ;; esac ;;
    pos)  case "$out" in *'the tail sent a token for position'*', expected '*) ;; *) fail "pos: $out" ;; esac ;;
    trail)
      case "$out" in *'"finish_reason":"length"'*) ;; *) fail "trail: $out" ;; esac
      sleep 2.5 # two or more trail probes come back (one per second)
      rtt=$(curl -s http://127.0.0.1:$PA/metrics | sed -n 's/^kvasir_ring_probe_rtt_seconds //p')
      awk -v r="$rtt" 'BEGIN { exit !(r != "" && r >= 0 && r < 10) }' || fail "trail: probe RTT '$rtt' s"
      grep -q 'dropping a probe trail: record 1 (\[2,4), t_recv 1, t_send 9223372036854788153 us) is not valid' "$T/$mode.log" ||
        fail "trail: the forged record was not logged: $(grep -i trail "$T/$mode.log" | tail -3)"
      out="$out rtt $rtt" ;;
    ghost)
      case "$out" in *'ring stalled'*) ;; *) fail "ghost: after $dt ms: $out" ;; esac
      [ "$dt" -le 9000 ] || fail "ghost: the stall took $dt ms" ;;
    long) case "$out" in *'"completion_tokens":3,'*'"finish_reason":"length"'*|*'"finish_reason":"length"'*'"completion_tokens":3,'*) ;;
            *) fail "long: $out" ;; esac ;;
  esac
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" != 000 ] || fail "$mode: the head died"
  kill -0 "$hp" 2>/dev/null || fail "$mode: the head process exited: $(tail -3 "$T/$mode.log")"
  echo "ok: $mode -> ${out:0:160}"
  kill "$hp" 2>/dev/null || true
done

#!/usr/bin/env bash
# A head stage behind a tail that breaks the protocol (tests/e2e/tools/fake_tail.py):
#  - dup:  every TOKEN twice -> the request fails, naming the duplicate (it
#          once counted every copy: 51 completion tokens for max_tokens 3);
#  - pos:  a TOKEN at a position the head did not ask for -> fails, naming it;
#  - long: a tail that never finishes -> the head stops at max_tokens itself.
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
for mode in dup pos long; do
  PH=$(free_port); PT=$(free_port); PA=$(free_port)
  KVASIR_BIN="$BIN" timeout 40 python3 "$here/tools/fake_tail.py" "$M" "$PT" "$PH" "$mode" 4 64 128 4 2 & pids+=($!)
  sleep 0.3
  timeout 40 "$BIN" stage -m "$M" --window 0:2 --listen 127.0.0.1:$PH --next 127.0.0.1:$PT --api $PA --insecure \
    2>"$T/$mode.log" & hp=$!; pids+=($hp)
  for _ in $(seq 100); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" = 200 ] && break
    sleep 0.1
  done
  out=$(curl -s -m 20 http://127.0.0.1:$PA/v1/completions -d '{"prompt":"Once","max_tokens":3,"temperature":0}')
  case "$mode" in
    dup)  case "$out" in *'another token (position'*'before the last one was fed'*) ;; *) fail "dup: $out" ;; esac ;;
    pos)  case "$out" in *'the tail sent a token for position'*', expected '*) ;; *) fail "pos: $out" ;; esac ;;
    long) case "$out" in *'"completion_tokens":3,'*'"finish_reason":"length"'*|*'"finish_reason":"length"'*'"completion_tokens":3,'*) ;;
            *) fail "long: $out" ;; esac ;;
  esac
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health)" != 000 ] || fail "$mode: the head died"
  kill -0 "$hp" 2>/dev/null || fail "$mode: the head process exited: $(tail -3 "$T/$mode.log")"
  echo "ok: $mode -> ${out:0:160}"
  kill "$hp" 2>/dev/null || true
done

#!/usr/bin/env bash
# An outsider attacks a 3-stage ring of aidreams260K (head [0,1) with the API,
# middle [1,2), tail [2,4)), knowing only what anyone can: the public GGUF (its
# fingerprint and shape) and the stages' addresses (tests/e2e/tools/attacker.py):
#  1. it poses as the tail: it takes the tail's address, answers the middle
#     stage's dial, dials the head as its predecessor, reads the boundary of the
#     client's prompt and answers with its own tokens (" HACKED");
#  2. it poses as the middle stage's predecessor and feeds it a request of its own;
#  3. it replays the head->middle link it recorded on the path to the middle stage.
# On a keyed ring (node keys, TLS on every link) each attack fails: no boundary
# byte reaches it, no token of its reaches the client, the middle stage never
# takes it as predecessor, and the ring then serves the reference text exactly;
# the recording holds no plaintext frame (no "KVSR" magic). Against the same ring
# with --insecure attack 1 succeeds, so the test can fail; attacks 2 and 3 fail
# there too since issue 9 (a fitting plaintext HELLO does not replace a live
# predecessor), but the replay's plaintext frames are readable.
set -uo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v python3 >/dev/null && command -v curl >/dev/null && command -v openssl >/dev/null ||
  { echo "FAIL: python3, curl and openssl are needed (scripts/install-deps.sh)"; exit 1; }
here=$(cd "$(dirname "$0")" && pwd)
. "$here/tools/ring_keys.sh"
want=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
HACKED=429,480,471,465,493,459,468 # `kvasir tokenize -p " HACKED"` on aidreams260K
T=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$T"/*.log; do echo "== $f"; tail -15 "$f"; done; exit 1; }
free_ports() { # N free loopback ports, on one line
  python3 -c 'import socket,sys
ss=[socket.socket() for _ in range(int(sys.argv[1]))]
for s in ss: s.bind(("127.0.0.1",0))
print(" ".join(str(s.getsockname()[1]) for s in ss))' "$1"
}
ring_keys "$T" 3 || fail "cannot make keys"
attacker() { timeout 25 python3 "$here/tools/attacker.py" "$@"; }
complete() { # PORT -> the completion's text (or the error body)
  curl -s -m 20 "http://127.0.0.1:$1/v1/completions" -H 'Content-Type: application/json' \
    -d '{"prompt": "Once upon a time", "max_tokens": 60, "temperature": 0}'
}
health() { curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health"; }
wait_health() { for _ in $(seq 100); do [ "$(health "$1")" = 200 ] && return 0; sleep 0.1; done; return 1; }

scenario() { # keyed | insecure
  local mode=$1 P0 P1 P2 PX PA tls k0 k1 k2
  read -r P0 P1 P2 PX PA <<<"$(free_ports 5)"
  if [ "$mode" = keyed ]; then
    tls=1; k0=$(key_args "$T" 0 3); k1=$(key_args "$T" 1 3); k2=$(key_args "$T" 2 3)
  else
    tls=0; k0=--insecure; k1=--insecure; k2=--insecure
  fi
  local L=$T/$mode
  # the on-path recorder sits on the head->middle link from the start
  attacker record "$PX" "$P1" "$L.rec" & pids+=($!)
  "$BIN" stage -m "$M" --window 1:2 $k1 --listen 127.0.0.1:$P1 --next 127.0.0.1:$P2 2>"$L.mid.log" & pids+=($!)
  "$BIN" stage -m "$M" --window 0:1 $k0 --listen 127.0.0.1:$P0 --next 127.0.0.1:$PX --api $PA 2>"$L.head.log" &
  pids+=($!)

  # 1. the attacker takes the tail's address (the tail is not up yet)
  attacker tail "$M" "$P2" "$P0" 2 4 64 128 4 "$HACKED" $tls >"$L.tail.out" 2>&1 & local ap=$!
  local text=""
  for _ in $(seq 80); do # the attacker's ring must look whole to the head first
    [ "$(health "$PA")" = 200 ] && break
    kill -0 $ap 2>/dev/null || break # refused: it gave up
    sleep 0.1
  done
  text=$(complete "$PA") # the client's request, whatever state the ring is in
  wait $ap
  local r1; r1=$(grep '^RESULT' "$L.tail.out")
  echo "[$SECONDS s] $mode 1 (poses as the tail): $r1; client got: ${text:0:160}"
  local bb; bb=$(echo "$r1" | sed -n 's/.*boundary_bytes=\([0-9]*\).*/\1/p')
  if [ "$mode" = keyed ]; then
    [ "$bb" = 0 ] || fail "keyed: the attacker read $bb boundary bytes"
    echo "$r1" | grep -q 'tokens_sent=0' || fail "keyed: the attacker sent tokens"
    case "$text" in *HACKED*) fail "keyed: an attacker token reached the client" ;; esac
    grep -q "refusing successor 127.0.0.1:$P2: .* presented key [0-9a-f]\{16\}, this stage expects key $(
      "$BIN" key show "$T/k2.key" | sed -n 's/^fingerprint: //p')" "$L.mid.log" ||
      fail "keyed: the middle stage did not refuse the attacker's key, naming both"
  else
    [ "${bb:-0}" -gt 0 ] || fail "insecure: the attacker read no boundary (the test cannot fail)"
    case "$text" in *HACKED*) ;; *) fail "insecure: the attacker's tokens did not reach the client" ;; esac
  fi

  # the real tail comes up; the ring closes
  "$BIN" stage -m "$M" --window 2:4 $k2 --listen 127.0.0.1:$P2 --next 127.0.0.1:$P0 2>"$L.tail.log" & pids+=($!)
  wait_health "$PA" || fail "$mode: the ring did not close with the real tail"

  # 2. the attacker poses as the middle stage's predecessor (plaintext, and TLS with its own key)
  local r2a r2b
  r2a=$(attacker pred "$M" "$P1" 0 1 4 64 128 4 0 | grep '^RESULT')
  r2b=$(attacker pred "$M" "$P1" 0 1 4 64 128 4 1 | grep '^RESULT')
  echo "[$SECONDS s] $mode 2 (poses as the predecessor): plaintext: $r2a; TLS: $r2b"
  if [ "$mode" = keyed ]; then
    echo "$r2a$r2b" | grep -q 'accepted=1' && fail "keyed: the middle stage took the attacker as predecessor"
    echo "$r2b" | grep -q "why=it_expects_key_$("$BIN" key show "$T/k0.key" | sed -n 's/^fingerprint: //p')" ||
      fail "keyed: the TLS attacker was not told which key the stage expects: $r2b"
  else
    echo "$r2a" | grep -q 'accepted=1' && fail "insecure: the plaintext attacker replaced a live predecessor"
    grep -q "closing link from 127.0.0.1:[0-9]*: this stage's predecessor 127.0.0.1:[0-9]* is alive" "$L.mid.log" ||
      fail "insecure: the middle stage did not say why it turned the attacker away"
  fi

  # 3. replay of the recorded head->middle link (with a request on it)
  wait_health "$PA" || fail "$mode: the ring did not come back"
  local out; out=$(complete "$PA")
  [ "$mode" = insecure ] || case "$out" in *"\"text\":\"$want\""*) ;; *) fail "keyed: after the attacks: $out" ;; esac
  local r3; r3=$(attacker replay "$P1" "$L.rec" | grep '^RESULT')
  echo "[$SECONDS s] $mode 3 (replays a recorded session): $r3"
  local n_pred; n_pred=$(grep -c 'predecessor \[0,1) connected' "$L.mid.log")
  if [ "$mode" = keyed ]; then
    echo "$r3" | grep -q 'accepted=0' || fail "keyed: the replay was accepted"
    echo "$r3" | grep -q 'plaintext_magic=0' || fail "keyed: the recorded link holds a plaintext frame"
    [ "$(stat -c %s "$L.rec")" -gt 1000 ] || fail "keyed: nothing was recorded"
    [ "$n_pred" = 1 ] || fail "keyed: the middle stage took $n_pred predecessors (only the head's link)"
    out=$(complete "$PA")
    case "$out" in *"\"text\":\"$want\""*) ;; *) fail "keyed: after the replay: $out" ;; esac
    echo "ok: keyed ring: every attack failed, the ring serves the reference text"
  else
    echo "$r3" | grep -q 'accepted=1' && fail "insecure: the replay replaced a live predecessor"
    echo "$r3" | grep -q 'plaintext_magic=1' || fail "insecure: no plaintext frame recorded"
    [ "$n_pred" = 1 ] || fail "insecure: the middle stage took $n_pred predecessors (a live one must stay)"
    echo "ok: --insecure ring: attack 1 works (as expected without keys); a live predecessor is never replaced"
  fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=()
}
scenario keyed
scenario insecure
echo PASS

#!/usr/bin/env bash
# A phone behind a carrier NAT serves the middle of a ring through the relay
# (issue 11, docs/RELAY.md). The test builds its own network in namespaces and
# removes it: "pub" (the relay on port 443 with TLS, three stages: the head
# with the API, ranks 1 and 3), "carrier" (a router doing nftables masquerade,
# dropping every new inbound flow) and "phone" behind it (rank 2, its two
# edges through the relay, it listens on nothing). Checks: the phone has no
# listening socket; public cannot connect to the phone's address even with a
# route to it; the relay sees the phone only as the carrier's address; the
# ring gives the aidreams260K llama.cpp reference continuation
# (../shared/models/README.md) through the head's API; the relay killed and
# restarted: the same stages serve the reference again within 5 s of the
# relay's return, and the request in flight then ends (replayed by the head)
# with the same text or a clear error, never hangs.
set -euo pipefail
BIN=${KVASIR_BIN:?}; M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
for c in ip nft ss curl openssl timeout; do
  command -v $c >/dev/null || { echo "FAIL: $c missing: run scripts/install-deps.sh"; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "FAIL: network namespaces need root (CI runs as root)"; exit 1; }
N=$$
PUB=kvpub$N CAR=kvcar$N PH=kvph$N
A=10.77.0 B=10.77.1 # pub <-> carrier WAN, carrier LAN <-> phone: only inside the namespaces
T=$(mktemp -d)
pids=()
relay_pid=
cleanup() {
  for p in "${pids[@]}" $relay_pid; do kill "$p" 2>/dev/null || true; done
  for n in $PUB $CAR $PH; do # anything still running in this test's namespaces is this test's
    for p in $(ip netns pids $n 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  done
  wait 2>/dev/null || true
  for n in $PUB $CAR $PH; do ip netns del $n 2>/dev/null || true; done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$T" "$KEEP_LOGS"; rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do echo "--- $f"; tail -n 15 "$f"; done
  exit 1
}
pub() { ip netns exec $PUB "$@"; }
car() { ip netns exec $CAR "$@"; }
ph() { ip netns exec $PH "$@"; }
# background processes start with `ip netns exec` itself (it execs: $! is the process, not a subshell)

# --- the network ---------------------------------------------------------------
. "$(dirname "$0")/tools/nat_net.sh"
nat_net_up $PUB $CAR $PH $A $B || fail "cannot build the namespaces"
ph timeout 5 bash -c "exec 3<>/dev/tcp/$A.1/9" 2>/dev/null && true # warm ARP; port 9 is closed anyway

# --- the relay: TLS with a self-signed certificate for its address ---------------
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$T/relay.key" -out "$T/relay.pem" \
  -days 2 -subj /CN=kvasir-test-relay -addext "subjectAltName=IP:$A.1" 2>/dev/null
PIN=$(openssl x509 -in "$T/relay.pem" -outform DER | sha256sum | cut -c1-64)
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$T/secret"
start_relay() {
  ip netns exec $PUB "$BIN" relay --listen $A.1:443 --secret "$T/secret" --cert "$T/relay.pem" --key "$T/relay.key" \
    >>"$T/relay.log" 2>&1 &
  relay_pid=$!
  for _ in $(seq 100); do
    pub curl -s --cacert "$T/relay.pem" -o /dev/null https://$A.1/health && return 0
    sleep 0.05
  done
  fail "the relay did not come up"
}
start_relay
tok() { "$BIN" relay token --secret "$T/secret" "$1"; }
U12="wss://$A.1/edge/ring-r1-r2?token=$(tok ring-r1-r2)"
U23="wss://$A.1/edge/ring-r2-r3?token=$(tok ring-r2-r3)"

# --- the ring: 0 -> 1 direct, 1 -> 2 -> 3 through the relay, 3 -> 0 direct ---------
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$T" 4
PA=8080
ip netns exec $PUB "$BIN" stage -m "$M" --window 3:4 $(key_args "$T" 3 4) --listen "$U23" --next $A.1:7000 \
  --relay-ca "$T/relay.pem" 2>"$T/s3.log" & pids+=($!)
ip netns exec $PH "$BIN" stage -m "$M" --window 2:3 $(key_args "$T" 2 4) --listen "$U12" --next "$U23" \
  --relay-pin $PIN --step-delay 25 2>"$T/s2.log" & pids+=($!)
ip netns exec $PUB "$BIN" stage -m "$M" --window 1:2 $(key_args "$T" 1 4) --listen $A.1:7001 --next "$U12" \
  --relay-ca "$T/relay.pem" 2>"$T/s1.log" & pids+=($!)
ip netns exec $PUB "$BIN" stage -m "$M" --window 0:1 $(key_args "$T" 0 4) --listen $A.1:7000 --next $A.1:7001 \
  --api $PA 2>"$T/s0.log" & pids+=($!)
health() { pub curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$PA/health || true; }
for _ in $(seq 300); do [ "$(health)" = 200 ] && break; sleep 0.1; done
[ "$(health)" = 200 ] || fail "the ring never became ready: $(pub curl -s http://127.0.0.1:$PA/health)"

# --- the phone opens nothing ------------------------------------------------------
lst=$(ph ss -ltnH)
[ -z "$lst" ] || fail "the phone's namespace has listening sockets: $lst"
echo "phone: ss -ltn lists no listening socket"
if pub timeout 3 bash -c "exec 3<>/dev/tcp/$B.2/443" 2>/dev/null; then fail "public reached the phone at $B.2:443"; fi
if pub timeout 3 bash -c "exec 3<>/dev/tcp/$B.2/7002" 2>/dev/null; then fail "public reached the phone at $B.2:7002"; fi
echo "public -> phone $B.2: connections fail (NAT)"
peers=$(pub ss -tnH state established "( sport = :443 )")
echo "$peers" | grep -q "$A.2:" || fail "the relay has no connection from the carrier's address $A.2: $peers"
if echo "$peers" | grep -q "$B.2"; then fail "the relay sees the phone's inside address: $peers"; fi
echo "relay: the phone's edges arrive from the carrier's address $A.2"

want='", pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific"'
complete() {
  pub curl -s -m 30 http://127.0.0.1:$PA/v1/completions -d '{"prompt":"Once upon a time","max_tokens":60,"temperature":0}' || true
}
out=$(complete)
case "$out" in
  *"\"text\":$want"*) echo "ring through the relay: reference continuation OK" ;;
  *) fail "unexpected response: $out" ;;
esac
pub curl -s --cacert "$T/relay.pem" https://$A.1/metrics >"$T/metrics1"
grep -q '^kvasir_relay_edges_paired 2$' "$T/metrics1" || fail "relay metrics: $(cat "$T/metrics1")"

# --- the relay restarted mid-request -----------------------------------------------
pub curl -s -m 60 -w ' HTTP %{http_code}' http://127.0.0.1:$PA/v1/completions \
  -d '{"prompt":"Once upon a time","max_tokens":110,"temperature":0}' >"$T/inflight" 2>&1 &
inflight=$!
sleep 1
kill -9 $relay_pid; wait $relay_pid 2>/dev/null || true
relay_pid=
sleep 1
start_relay
t0=$(date +%s%N)
ok=
# timed: the first request that is served (8 tokens: the reference's first 8,
# so the time is the ring's return, not a long generation on a loaded machine)
want4='", pixels unfolding like"'
for _ in $(seq 200); do
  out=$(pub curl -s -m 5 http://127.0.0.1:$PA/v1/completions \
    -d '{"prompt":"Once upon a time","max_tokens":8,"temperature":0}' || true)
  case "$out" in *"\"text\":$want4"*) ok=1; break ;; esac
  sleep 0.05
done
t1=$(date +%s%N)
ms=$(((t1 - t0) / 1000000))
[ -n "$ok" ] || fail "the ring did not serve again after the relay's restart: $out"
echo "relay restarted: the ring serves again ${ms} ms after the relay's return (8 reference tokens)"
out=$(complete)
case "$out" in
  *"\"text\":$want"*) echo "after the restart: reference continuation OK" ;;
  *) fail "after the restart: $out" ;;
esac
# the head held the request in flight and replayed it once the ring was whole
# again (PROTOCOL.md, issue 13): it ends, with the same greedy text
wait $inflight || true
r=$(cat "$T/inflight")
case "$r" in
  *"\"text\":${want%\"}"*' HTTP 200') echo "the request in flight at the relay's loss was replayed: same text" ;;
  *'"error"'*) echo "the request in flight at the relay's loss ended with an error: $r" ;;
  *) fail "the request in flight at the relay's loss: $r" ;;
esac
[ $ms -le 5000 ] || fail "serving again took ${ms} ms after the relay's return (limit 5000)"
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null || fail "stage pid $p is gone"; done
for t in $(tok ring-r1-r2) $(tok ring-r2-r3); do
  if grep -l "$t" "$T"/s*.log; then fail "an edge token is in a stage's log"; fi
done
echo "no stage restarted"
echo PASS

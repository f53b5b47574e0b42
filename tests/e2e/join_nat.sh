#!/usr/bin/env bash
# The whole loop end to end (issue 18): a phone behind a carrier NAT enrolls through the market,
# fetches only its window, serves through the relay with both links dialled out, and earns.
# The test builds its own network in namespaces and removes it:
#   "public"  (10.79.0.1): the market (relay secret and pin), a seed server holding aidreams260K,
#             the relay on 443 with TLS, and join nodes that accept inbound links;
#   "carrier" (10.79.0.2 / 10.79.1.1): a router doing nftables masquerade, dropping new inbound
#             flows;
#   "phone"   (10.79.1.2): `kvasir join --market URL --mem 1.4M --relay wss://10.79.0.1`, whose
#             budget fits one block of aidreams260K.
# Every node is a plain `kvasir join --market URL --mem BYTES` (no manifest, window, neighbour or
# key given by hand). Checks: the windows fill the map with the phone on [2,3); the phone listens
# on nothing (ss -ltn) and reaches the relay only as the carrier's address; every link is TLS
# between the node keys of the claims; the head's API (found through GET /v1/rings) serves the
# aidreams260K reference text (../shared/models/aidreams260K.ref.json); the ledger credits the
# phone exactly tokens x its blocks (and every node likewise); each node fetched its window's bytes
# (printed against the window size); kill -9 of the phone: its window shows uncovered within the
# lease, the spare claims it, the ring serves the reference again, the phone's credit stays.
# Then a second, larger model (qwen3-q8_0, 27.6 MB, real Qwen3 tokenizer) is listed: two more
# public nodes and a second phone behind the NAT fill its map the same way, its ring serves the
# reference text of qwen3-q8_0.ref.json, and the ledger credits them tokens x blocks.
# Prints the timeline. Bounded: every wait has a limit; the trap removes every process and
# namespace it made.
set -euo pipefail
BIN=${KVASIR_BIN:?}; SH=${KVASIR_SHARED:?}
for c in ip nft ss curl openssl timeout python3; do
  command -v $c >/dev/null || { echo "FAIL: $c missing: run scripts/install-deps.sh"; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "FAIL: network namespaces need root (CI runs as root)"; exit 1; }
N=$$
PUB=kjpub$N CAR=kjcar$N PH=kjph$N
A=10.79.0 B=10.79.1
T=$(mktemp -d)
LEASE=2000
MPORT=8470 SPORT=8471
cleanup() {
  for n in $PUB $CAR $PH; do # everything this test started runs in its namespaces
    for p in $(ip netns pids $n 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  done
  for _ in $(seq 30); do
    left=$(for n in $PUB $CAR $PH; do ip netns pids $n 2>/dev/null; done)
    [ -z "$left" ] && break
    sleep 0.1
  done
  for p in $left; do kill -9 "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  for n in $PUB $CAR $PH; do ip netns del $n 2>/dev/null || true; done
  [ -n "${KEEP_LOGS:-}" ] && cp -r "$T" "$KEEP_LOGS"; rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do echo "--- $f"; tail -n 12 "$f"; done
  exit 1
}
pub() { ip netns exec $PUB "$@"; }
car() { ip netns exec $CAR "$@"; }
ph() { ip netns exec $PH "$@"; }
py() { python3 -c "$@"; }
# background processes start with `ip netns exec` itself (it execs: $! is the process, not a subshell)
T0=$(date +%s.%N)
at() { py "import time; print('%6.2f s' % (time.time() - $T0))"; }
timeline=()
mark() { local l; l="$(at)  $*"; timeline+=("$l"); echo "$l"; }

# --- the network (as tests/e2e/relay_nat.sh) ----------------------------------------
. "$(dirname "$0")/tools/nat_net.sh"
nat_net_up $PUB $CAR $PH $A $B || fail "cannot build the namespaces"

# --- public: seed, relay, market ----------------------------------------------------
M=aidreams260K
mkdir -p "$T/seed"
cp "$SH/models/$M.gguf" "$T/seed/"
"$BIN" shard index "$T/seed/$M.gguf" -o "$T/seed/$M.gguf.kvindex.json" >"$T/$M.cid" || fail "shard index"
CID=$(sed -n 's/^content_id=//p' "$T/$M.cid")
ip netns exec $PUB "$BIN" seed "$T/seed" --port $SPORT --bind $A.1 >"$T/seed.log" 2>&1 &
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout "$T/relay.key" -out "$T/relay.pem" \
  -days 2 -subj /CN=kvasir-test-relay -addext "subjectAltName=IP:$A.1" 2>/dev/null
PIN=$(openssl x509 -in "$T/relay.pem" -outform DER | sha256sum | cut -c1-64)
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$T/secret"
ip netns exec $PUB "$BIN" relay --listen $A.1:443 --secret "$T/secret" --cert "$T/relay.pem" --key "$T/relay.key" >"$T/relay.log" 2>&1 &
ip netns exec $PUB "$BIN" market --listen $A.1:$MPORT --db "$T/market.sqlite" --lease-ms $LEASE --relay-secret "$T/secret" \
  --relay-pin $PIN >"$T/market.log" 2>&1 &
MK=http://$A.1:$MPORT
SEED=http://$A.1:$SPORT
up() { for _ in $(seq 100); do pub curl -sf "$@" -o /dev/null && return 0; sleep 0.05; done; return 1; }
up "$SEED/models" || fail "the seed did not come up"
up --cacert "$T/relay.pem" https://$A.1/health || fail "the relay did not come up"
up "$MK/map" || fail "the market did not come up"
pub "$BIN" market add --market "$MK" --url "$SEED/$M.gguf" --index "$SEED/$M.gguf.kvindex.json" --content-id "$CID" \
  >/dev/null || fail "market add"
mark "market, seed and relay up; $M listed"
seed0=$(pub curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])")

# --- the nodes: a [0,2) and c [3,4) public, the phone [2,3) through the relay, d a spare ---
claim_of() { # node [model, default $M] -> "begin end" of its claim on that model
  pub curl -sf "$MK/map" | py "
import json,sys
for m in json.load(sys.stdin)['models']:
  if m['name'] != '${2:-$M}': continue
  for r in m['coverage']:
    for c in r['claims']:
      if c['node']=='$1': print(c['begin'], c['end'])"
}
wait_claim() { # node [model]: its claim, once the map shows one (15 s at most)
  for _ in $(seq 300); do c=$(claim_of "$@"); [ -n "$c" ] && { echo "$c"; return 0; }; sleep 0.05; done; return 1
}
want_credits() { # "node:tokens:credit ..." what: waits 5 s at most for the ledger to say exactly that
  for _ in $(seq 100); do [ "$(credits)" = "$1" ] && return 0; sleep 0.05; done
  fail "ledger $2: '$(credits)', want '$1' (node:tokens:credit)"
}
join_pub() { # name mem poll-ms
  ip netns exec $PUB "$BIN" join --market "$MK" --mem "$2" --name "$1" --listen $A.1:0 --cache "$T/cache-$1" --threads 1 \
    --poll-ms "$3" >"$T/$1.log" 2>&1 &
}
join_pub a 1900000 200
[ "$(wait_claim a)" = "0 2" ] || fail "a claimed '$(claim_of a)', want [0,2)"
ip netns exec $PH "$BIN" join --market "$MK" --mem 1400000 --name phone --relay wss://$A.1 --cache "$T/cache-phone" --threads 1 \
  --poll-ms 200 >"$T/phone.log" 2>&1 &
phone_pid=$!
[ "$(wait_claim phone)" = "2 3" ] || fail "the phone claimed '$(claim_of phone)', want [2,3)"
join_pub c 1600000 200
[ "$(wait_claim c)" = "3 4" ] || fail "c claimed '$(claim_of c)', want [3,4)"
mark "map filled: a [0,2), phone [2,3) through the relay, c [3,4)"
pub curl -sf "$MK/map" | py "
import json,sys
cl={c['node']: c for r in json.load(sys.stdin)['models'][0]['coverage'] for c in r['claims']}
p=cl['phone']
assert p['endpoint']=='' and p['relay']=='wss://$A.1/edge/$M-r0-b2', p
assert all(len(c['pubkey'])==64 for c in cl.values()), cl
" || fail "the phone's claim does not name its relay edge: $(pub curl -s "$MK/map")"

rings=""
for _ in $(seq 300); do
  rings=$(pub curl -sf "$MK/v1/rings" || true)
  [ "$(echo "$rings" | py "import json,sys; print(len(json.load(sys.stdin)['rings']))" 2>/dev/null)" = 1 ] && break
  sleep 0.05
done
API=$(echo "$rings" | py "import json,sys; print(json.load(sys.stdin)['rings'][0]['api'])") || fail "the ring is not ready: $rings"
mark "ring ready: head API $API (from GET /v1/rings)"

# --- the phone opens nothing and is seen only as the carrier --------------------------
lst=$(ph ss -ltnH)
[ -z "$lst" ] || fail "the phone's namespace has listening sockets: $lst"
peers=$(pub ss -tnH state established "( sport = :443 )")
echo "$peers" | grep -q "$A.2:" || fail "the relay has no connection from the carrier's address $A.2: $peers"
if echo "$peers" | grep -q "$B.2"; then fail "the relay sees the phone's inside address: $peers"; fi
echo "ok: the phone listens on nothing (ss -ltn empty); the relay sees it as the carrier $A.2"
for n in a phone c; do
  grep -q 'links: TLS 1.3, this node' "$T/$n.log" || fail "node $n: its links are not TLS between node keys"
  if grep -q plaintext "$T/$n.log"; then fail "node $n: a plaintext link"; fi
done
echo "ok: every link TLS 1.3 between the node keys of the claims"

REF=$(py "import json; print(json.load(open('$SH/models/$M.ref.json'))['text'], end='')")
NREF=$(py "import json; print(len(json.load(open('$SH/models/$M.ref.json'))['generated']))")
complete() {
  pub curl -s -m 20 "$API/v1/completions" -d "{\"prompt\":\"Once upon a time\",\"max_tokens\":$NREF,\"temperature\":0}" |
    py "import json,sys; d=json.load(sys.stdin); print(d['choices'][0]['text'], end='')" 2>/dev/null || true
}
got=$(complete)
[ "$got" = "$REF" ] || fail "the ring served '$got'"
mark "first request: the $NREF-token reference text of $M"

# --- the ledger: tokens x blocks ------------------------------------------------------
credits() { pub curl -sf "$MK/ledger" | py "
import json,sys
print(' '.join('%s:%d:%d' % (n['node'], n['tokens'], n['credit']) for n in sorted(json.load(sys.stdin)['nodes'], key=lambda n: n['node'])))"; }
want1="a:$NREF:$((2 * NREF)) c:$NREF:$NREF phone:$NREF:$NREF"
want_credits "$want1" "after the first request"
mark "credited: phone $NREF tokens x 1 block = $NREF; a x 2 = $((2 * NREF)); c x 1 = $NREF"

# --- bytes: each node received its window, not the file ---------------------------------
size=$(stat -c %s "$T/seed/$M.gguf")
isz=$(stat -c %s "$T/seed/$M.gguf.kvindex.json")
bytes() { # node -> checks and prints its fetch line; adds header + data + index to $sum ($size, $isz: its model's)
  line=$(grep '^join: fetched' "$T/$1.log") || fail "node $1: no fetch line"
  read -r hb db wb ver < <(echo "$line" | py "
import re,sys
l=sys.stdin.read(); g=lambda k: re.search(k+'=([0-9a-z]+)', l).group(1)
print(g('header_bytes'), g('data_bytes'), g('window_bytes'), g('verified') + g('trusted'))")
  [ "$ver" = yesyes ] || fail "node $1: fetch not verified against the listing's content id"
  # received = the window's tensors plus the alignment padding between them (< 32 bytes a tensor)
  [ "$db" -ge "$wb" ] && [ "$db" -lt $((wb + 32 * 64)) ] || fail "node $1: received $db tensor bytes for a $wb-byte window"
  # the whole fetch under the file's size; with "embd" (a head or tail window holding the
  # embedding, 77% of qwen3-q8_0) only its tensors are (the 64 KiB-doubling header read overshoots)
  if [ "${2:-}" = embd ]; then
    [ "$db" -lt "$size" ] || fail "node $1: fetched $db tensor bytes of a $size-byte file"
  else
    [ $((hb + db)) -lt "$size" ] || fail "node $1: fetched $((hb + db)) bytes of a $size-byte file"
  fi
  echo "  $1: window $wb B, fetched $db B of tensors + $hb B of header (file $size B)"
  sum=$((sum + hb + db + isz))
}
sum=0
for n in a phone c; do bytes $n; done
seed1=$(pub curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])")
[ $((seed1 - seed0)) -eq $sum ] || fail "the seed served $((seed1 - seed0)) bytes, the nodes report $sum"
echo "ok: the seed served $sum bytes = what the three nodes report (header + window + index)"

# --- kill the phone: its lease expires, the spare takes its window ---------------------
join_pub d 1400000 1000
for _ in $(seq 100); do grep -q "join: waiting" "$T/d.log" && break; sleep 0.05; done
grep -q "join: waiting" "$T/d.log" || fail "the spare d is not waiting"
kill -9 $phone_pid
wait $phone_pid 2>/dev/null || true
mark "phone killed (-9)"
# one poller process in public (not a curl per look): the gap shows only until the spare's next
# map read (1 s)
seen=$(pub timeout 15 python3 -c "
import json, time, urllib.request
last = None
while True:
    try:
        m = json.load(urllib.request.urlopen('$MK/map', timeout=2))['models'][0]['coverage'][0]
    except Exception as e:
        last = e; time.sleep(0.02); continue
    if any(g['begin'] <= 2 and g['end'] >= 3 for g in m['gaps']) and not any(c['node'] == 'phone' for c in m['claims']):
        print('yes'); break
    time.sleep(0.02)
" || true)
[ "$seen" = yes ] || fail "the phone's window never showed uncovered"
mark "phone's window [2,3) uncovered on the map (lease $LEASE ms)"
[ "$(wait_claim d)" = "2 3" ] || fail "the spare claimed '$(claim_of d)', want [2,3)"
mark "spare d claimed [2,3)"
ok=
for _ in $(seq 200); do
  got=$(complete)
  [ "$got" = "$REF" ] && { ok=1; break; }
  sleep 0.1
done
[ -n "$ok" ] || fail "the healed ring did not serve the reference (last: '$got')"
mark "ring serves the reference again (a, d, c)"
bytes d
want2="a:$((2 * NREF)):$((4 * NREF)) c:$((2 * NREF)):$((2 * NREF)) d:$NREF:$NREF phone:$NREF:$NREF"
want_credits "$want2" "after healing"
mark "credited: phone keeps $NREF; d $NREF; a $((4 * NREF)); c $((2 * NREF))"

# --- a second, larger model: qwen3-q8_0 (27.6 MB, a 151,669-token vocabulary, tied output) --------
# Its head and tail windows each hold the 20.6 MB embedding; a second phone, whose budget fits one
# middle block only, takes [2,3) through the relay again. ctx 128 x 2 sequences keeps KV small.
M2=qwen3-q8_0
cp "$SH/models/$M2.gguf" "$T/seed/"
"$BIN" shard index "$T/seed/$M2.gguf" -o "$T/seed/$M2.gguf.kvindex.json" >"$T/$M2.cid" || fail "shard index $M2"
CID2=$(sed -n 's/^content_id=//p' "$T/$M2.cid")
pub "$BIN" market add --market "$MK" --url "$SEED/$M2.gguf" --index "$SEED/$M2.gguf.kvindex.json" --content-id "$CID2" \
  --ctx 128 --seqs 2 >/dev/null || fail "market add $M2"
seed0=$(pub curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])") # after the market's header read
mark "$M2 listed"
join_pub e 23700000 200 # [0,1) needs 23,117,864 bytes, [0,2) 23,511,592, [0,3) 23,905,320
[ "$(wait_claim e $M2)" = "0 2" ] || fail "e claimed '$(claim_of e $M2)' of $M2, want [0,2)"
ip netns exec $PH "$BIN" join --market "$MK" --mem 3000000 --name phone2 --relay wss://$A.1 --cache "$T/cache-phone2" \
  --threads 1 --poll-ms 200 >"$T/phone2.log" 2>&1 & # [2,3) needs 2,490,880 bytes
[ "$(wait_claim phone2 $M2)" = "2 3" ] || fail "phone2 claimed '$(claim_of phone2 $M2)' of $M2, want [2,3)"
join_pub f 24500000 200 # [3,4), the tail with the tied output, needs 24,331,728
[ "$(wait_claim f $M2)" = "3 4" ] || fail "f claimed '$(claim_of f $M2)' of $M2, want [3,4)"
mark "$M2 map filled: e [0,2), phone2 [2,3) through the relay, f [3,4)"
API2=
for _ in $(seq 400); do
  API2=$(pub curl -sf "$MK/v1/rings" | py "
import json,sys
for r in json.load(sys.stdin)['rings']:
  if r['model'] == '$M2': print(r['api'])" 2>/dev/null || true)
  [ -n "$API2" ] && break
  sleep 0.05
done
[ -n "$API2" ] || fail "the $M2 ring is not ready: $(pub curl -s "$MK/v1/rings")"
mark "$M2 ring ready: head API $API2"
lst=$(ph ss -ltnH)
[ -z "$lst" ] || fail "the phone's namespace has listening sockets: $lst"
for n in e phone2 f; do
  grep -q 'links: TLS 1.3, this node' "$T/$n.log" || fail "node $n: its links are not TLS between node keys"
done
REF2=$(py "import json; print(json.load(open('$SH/models/$M2.ref.json'))['text'], end='')")
PROMPT2=$(py "import json; print(json.load(open('$SH/models/$M2.ref.json'))['prompt'])")
NREF2=$(py "import json; print(len(json.load(open('$SH/models/$M2.ref.json'))['generated']))")
got2=$(pub curl -s -m 60 "$API2/v1/completions" -d "{\"prompt\":$PROMPT2,\"max_tokens\":$NREF2,\"temperature\":0}" |
  py "import json,sys; d=json.load(sys.stdin); print(d['choices'][0]['text'], end='')" 2>/dev/null || true)
[ "$got2" = "$REF2" ] || fail "the $M2 ring served '$got2', want the reference '$REF2'"
mark "$M2: the $NREF2-token reference text (the prompt's token ids from $M2.ref.json)"
want3="a:$((2 * NREF)):$((4 * NREF)) c:$((2 * NREF)):$((2 * NREF)) d:$NREF:$NREF e:$NREF2:$((2 * NREF2)) f:$NREF2:$NREF2"
want3="$want3 phone:$NREF:$NREF phone2:$NREF2:$NREF2"
want_credits "$want3" "after $M2"
mark "credited: phone2 $NREF2 tokens x 1 block = $NREF2; e x 2 = $((2 * NREF2)); f x 1 = $NREF2"
size=$(stat -c %s "$T/seed/$M2.gguf")
isz=$(stat -c %s "$T/seed/$M2.gguf.kvindex.json")
sum=0
bytes e embd; bytes phone2; bytes f embd
seed1=$(pub curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])")
[ $((seed1 - seed0)) -eq $sum ] || fail "the seed served $((seed1 - seed0)) bytes for $M2, the nodes report $sum"
echo "ok: $M2: the seed served $sum bytes = what e, phone2, f report (header + window + index)"

echo "timeline:"
for l in "${timeline[@]}"; do echo "  $l"; done
echo PASS

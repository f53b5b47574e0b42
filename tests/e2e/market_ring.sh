#!/usr/bin/env bash
# The self-enrollment market end to end on loopback (docs/MARKET.md), from
# nothing: a market, a seed server holding aidreams260K and llama-q4_k_m
# (with their shard indexes), and 5 `kvasir join` nodes with different --mem,
# no manifest and no window given by hand.
#   1. they claim distinct windows covering both models, each fetches only its
#      window (bytes received vs the window's size, and the seed's count), the
#      rings form, and the heads' APIs (found through GET /v1/rings) serve the
#      aidreams reference text and llama-q4_k_m's single-process greedy text;
#   2. healing: kill -9 one node; within the lease its window is uncovered on
#      the map with a higher reward per block; a 6th, waiting node claims it,
#      fetches it and joins; the ring serves the reference again (time printed);
#   3. the market killed (-9) while the rings serve: requests keep being
#      served; restarted from its SQLite file it shows the same claims and the
#      nodes keep renewing them;
#   4. SIGTERM releases a claim at once (no wait for the lease).
set -uo pipefail
BIN=${KVASIR_BIN:?}; SH=${KVASIR_SHARED:?}
T=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do
    for _ in $(seq 30); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null
  done
  wait 2>/dev/null
  rm -rf "$T"
}
trap cleanup EXIT
fail() {
  echo "FAIL: $*"
  for f in "$T"/*.log; do echo "--- $f"; tail -15 "$f"; done
  exit 1
}
LEASE=3000
REF=', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific'
now() { date +%s.%N; }
since() { python3 -c "import sys; print('%.2f' % (float(sys.argv[2]) - float(sys.argv[1])))" "$1" "$(now)"; }
log_port() { # file pattern -> port
  for _ in $(seq 100); do
    p=$(grep -o "$2[0-9.]*:[0-9]*" "$1" 2>/dev/null | head -1 | sed 's/.*://')
    [[ -n $p ]] && { echo "$p"; return 0; }
    sleep 0.1
  done
  return 1
}
py() { python3 -c "$@"; }

mkdir -p "$T/seed"
cp "$SH/models/aidreams260K.gguf" "$SH/models/llama-q4_k_m.gguf" "$T/seed/"
for m in aidreams260K llama-q4_k_m; do
  "$BIN" shard index "$T/seed/$m.gguf" -o "$T/seed/$m.gguf.kvindex.json" >"$T/$m.cid" || fail "shard index $m"
done
"$BIN" seed "$T/seed" --port 0 --port-file "$T/seed.port" >"$T/seed.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -s $T/seed.port ]] && break; sleep 0.1; done
SEED=http://127.0.0.1:$(cat "$T/seed.port")
"$BIN" market --listen 127.0.0.1:0 --db "$T/market.sqlite" --lease-ms $LEASE >"$T/market.log" 2>&1 &
mpid=$!
pids+=($mpid)
MPORT=$(log_port "$T/market.log" "listening on http://") || fail "no market port"
MK=http://127.0.0.1:$MPORT

# the listings name the content ids: the nodes check the seed's index against them
"$BIN" market add --market "$MK" --url "$SEED/aidreams260K.gguf" --index "$SEED/aidreams260K.gguf.kvindex.json" \
  --content-id "$(sed -n 's/^content_id=//p' "$T/aidreams260K.cid")" >/dev/null || fail "market add aidreams260K"
"$BIN" market add --market "$MK" --url "$SEED/llama-q4_k_m.gguf" --index "$SEED/llama-q4_k_m.gguf.kvindex.json" \
  --content-id "$(sed -n 's/^content_id=//p' "$T/llama-q4_k_m.cid")" --ctx 256 --boundary f32 >/dev/null || fail "market add llama-q4_k_m"
curl -sf "$MK/map" >"$T/map0.json" || fail "GET /map"
# the reward per block of aidreams's blocks while nothing is claimed
r0=$(py "import json; m=json.load(open('$T/map0.json'))['models'][0]; print(m['coverage'][0]['gaps'][0]['reward_per_block'])")
seed_before=$(curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])")

claim_of() { # node -> "model begin end" once it holds a claim
  curl -sf "$MK/map" | py "
import json,sys
d=json.load(sys.stdin)
for m in d['models']:
  for r in m['coverage']:
    for c in r['claims']:
      if c['node']=='$1': print(m['name'], c['begin'], c['end'])"
}
wait_claim() {
  for _ in $(seq 150); do
    c=$(claim_of "$1"); [[ -n $c ]] && { echo "$c"; return 0; }
    sleep 0.1
  done
  return 1
}
join() { # name mem [poll-ms]
  "$BIN" join --market "$MK" --mem "$2" --name "$1" --cache "$T/cache-$1" --threads 1 --poll-ms "${3:-200}" \
    >"$T/$1.log" 2>&1 &
  pids+=($!)
  eval "pid_$1=$!"
}

# 1. from nothing: budgets that fit 2, 1 and 1 blocks of aidreams (1.84, 1.38, 1.52 MB needed) and 2
# and 1 blocks of llama-q4_k_m (10.7 and 12.5 MB); started one after the other
t_start=$(now)
declare -A want=([a]="aidreams260K 0 2" [b]="aidreams260K 2 3" [c]="aidreams260K 3 4" \
                 [d]="llama-q4_k_m 0 2" [e]="llama-q4_k_m 2 3")
for spec in a:1900000 b:1400000 c:1600000 d:11000000 e:13000000; do
  n=${spec%%:*}; join "$n" "${spec#*:}"
  got=$(wait_claim "$n") || fail "node $n claimed nothing"
  [[ $got == "${want[$n]}" ]] || fail "node $n claimed '$got', want '${want[$n]}'"
done
rings=""
for _ in $(seq 200); do
  rings=$(curl -sf "$MK/v1/rings")
  [[ $(echo "$rings" | py "import json,sys; print(len(json.load(sys.stdin)['rings']))") == 2 ]] && break
  sleep 0.1
done
api_of() { echo "$rings" | py "import json,sys; print([r['api'] for r in json.load(sys.stdin)['rings'] if r['model']=='$1'][0])"; }
A_API=$(api_of aidreams260K) || fail "aidreams ring not ready: $rings"
L_API=$(api_of llama-q4_k_m) || fail "llama ring not ready: $rings"
echo "rings ready after $(since "$t_start") s: aidreams at $A_API, llama-q4_k_m at $L_API"
complete() { # api n_tokens -> text
  curl -s -m 10 "$1/v1/completions" -d "{\"prompt\":\"Once upon a time\",\"max_tokens\":$2,\"temperature\":0}" |
    py "import json,sys; d=json.load(sys.stdin); print(d['choices'][0]['text'], end='')" 2>/dev/null
}
got=$(complete "$A_API" 60)
[[ $got == "$REF" ]] || fail "aidreams ring served '$got'"
L_WANT=$(timeout 60 "$BIN" run -m "$T/seed/llama-q4_k_m.gguf" -p "Once upon a time" -n 16 --temp 0 --threads 1 2>/dev/null)
got=$(complete "$L_API" 16)
[[ -n $L_WANT && $got == "$L_WANT" ]] || fail "llama ring served '$got', single process '$L_WANT'"
echo "ok: both rings serve: aidreams reference text, llama-q4_k_m == single process"
# every link is TLS between the node keys the claims publish (no plaintext link, no --insecure)
for n in a b c d e; do
  grep -q 'links: TLS 1.3, this node' "$T/$n.log" || fail "node $n: its links are not TLS between node keys"
  if grep -q 'plaintext' "$T/$n.log"; then fail "node $n: a plaintext link"; fi
done
echo "ok: every node's links are TLS 1.3, keyed by the node keys in the neighbours' claims"

# the ledger: each head signs a receipt for its ring's tokens with the key in its claim; the market
# credits every window's node tokens x blocks (docs/MARKET.md "Ledger")
for _ in $(seq 100); do
  led=$(curl -sf "$MK/ledger") || fail "GET /ledger"
  # (a receipt goes with each renewal, every lease/3: the last tokens may come one renewal later)
  [[ $(echo "$led" | py "import json,sys; print(sorted((n['node'], n['tokens']) for n in json.load(sys.stdin)['nodes']))") == \
     "[('a', 60), ('b', 60), ('c', 60), ('d', 16), ('e', 16)]" ]] && break
  sleep 0.1
done
echo "$led" | py "
import json, sys
d = json.load(sys.stdin)
names = {n['node']: n for n in d['nodes']}
want = {'a': ('aidreams260K', 2, 60), 'b': ('aidreams260K', 1, 60), 'c': ('aidreams260K', 1, 60),
        'd': ('llama-q4_k_m', 2, 16), 'e': ('llama-q4_k_m', 1, 16)}
tok = {}
for k, (model, blocks, cap) in want.items():
    n = names.get(k)
    assert n, 'node %s not credited: %s' % (k, d)
    assert n['model'] == model, n
    assert n['tokens'] == cap, ('the ring generated %d tokens' % cap, n)
    assert n['credit'] == n['tokens'] * blocks, ('credit != tokens x blocks', n)
    tok.setdefault(model, set()).add(n['tokens'])
assert all(len(v) == 1 for v in tok.values()), ('one ring, one token count', tok)
assert d['receipts'] >= 2, d
print('ok: ledger: %d receipts; ' % d['receipts'] + ', '.join('%s %d tokens x %d blocks = %d' % (
    n['node'], n['tokens'], n['credit'] // n['tokens'], n['credit']) for n in d['nodes']))
" || fail "ledger: $led"

# bytes: each node received its window's tensor bytes and not much more; never the whole file
sum=0
for n in a b c d e; do
  line=$(grep '^join: fetched' "$T/$n.log") || fail "node $n: no fetch line"
  read -r hb db wb hr ver < <(echo "$line" | py "
import re,sys
l=sys.stdin.read(); g=lambda k: re.search(k+'=([0-9a-z]+)', l).group(1)
print(g('header_bytes'), g('data_bytes'), g('window_bytes'), g('header_reused_bytes'), g('verified') + g('trusted'))")
  model=$(echo "${want[$n]}" | cut -d' ' -f1); size=$(stat -c %s "$T/seed/$model.gguf")
  [[ $ver == yesyes ]] || fail "node $n: fetch not verified against the index and the listing's content id"
  ((db + hr >= wb)) || fail "node $n: received $db + $hr header-reused bytes for a $wb-byte window"
  ((db <= wb + wb / 100 + 4096)) || fail "node $n: received $db data bytes for a $wb-byte window"
  ((hb + db < size)) || fail "node $n: fetched $((hb + db)) bytes, the whole file is $size"
  echo "  node $n ${want[$n]}: window $wb B, received $db B of tensors + $hb B of header (file $size B)"
  sum=$((sum + hb + db + $(stat -c %s "$T/seed/$model.gguf.kvindex.json"))) # + the index it verified against
done
seed_after=$(curl -sf "$SEED/stats" | py "import json,sys; print(json.load(sys.stdin)['bytes_served'])")
served=$((seed_after - seed_before))
((served == sum)) || fail "the seed served $served bytes, the nodes report $sum (header + tensors + index)"
echo "ok: the seed served $served bytes in all = what the 5 nodes report receiving (header + tensors + index)"

# 2. healing: a spare node waits (reading the map every second, so that the test sees the gap
# before the spare takes it); kill -9 b ([2,3) of aidreams)
join f 1400000 1000
for _ in $(seq 100); do grep -q "join: waiting" "$T/f.log" && break; sleep 0.1; done
grep -q "join: waiting" "$T/f.log" || fail "the spare node is not waiting"
[[ -z $(claim_of f) ]] || fail "the spare claimed something while every window was held"
t_kill=$(now)
kill -9 "$pid_b"
wait "$pid_b" 2>/dev/null
# One poller process (not a curl + python per look): the gap is visible only until the
# spare's next map read (1 s), and starting a process per look is slow on a loaded machine.
seen=$(py "
import json, time, urllib.request
t_end = time.time() + 15
while time.time() < t_end:
    try:
        m = json.load(urllib.request.urlopen('$MK/map', timeout=2))['models'][0]['coverage'][0]
    except Exception:
        time.sleep(0.02); continue
    gap = [g for g in m['gaps'] if g['begin'] <= 2 and g['end'] >= 3]
    if gap and not any(c['node'] == 'b' for c in m['claims']):
        print(gap[0]['reward_per_block']); break
    time.sleep(0.02)
")
[[ -n $seen ]] || fail "b's window never showed uncovered"
t_unc=$(since "$t_kill")
py "import sys; sys.exit(0 if float('$t_unc') <= $LEASE/1000 + 1.5 else 1)" || fail "uncovered only after $t_unc s (lease $LEASE ms)"
py "import sys; sys.exit(0 if float('$seen') > float('$r0') else 1)" || fail "reward per block $seen is not above the initial $r0"
ok=""
for _ in $(seq 150); do
  got=$(complete "$A_API" 60)
  [[ $got == "$REF" ]] && { ok=1; break; }
  sleep 0.1
done
t_heal=$(since "$t_kill")
[[ -n $ok ]] || fail "the healed ring did not serve the reference text (last: '$got')"
[[ $(claim_of f) == "aidreams260K 2 3" ]] || fail "the spare holds '$(claim_of f)'"
fl=$(grep '^join: fetched' "$T/f.log") || fail "the spare fetched nothing"
echo "$fl" | grep -q 'window_bytes=198144 .*verified=yes' || fail "the spare's fetch: $fl"
echo "ok: healing: kill -9 -> uncovered after $t_unc s (lease $LEASE ms, reward/block $r0 -> $seen)," \
     "serving the reference again after $t_heal s"

# 3. the market killed while the rings serve
snap() { curl -sf "$MK/map" | py "
import json,sys
d=json.load(sys.stdin)
print(' '.join(sorted('%s:%d:%s:%d-%d' % (m['name'], c['id'], c['node'], c['begin'], c['end'])
                      for m in d['models'] for r in m['coverage'] for c in r['claims'])))"; }
exp_of() { curl -sf "$MK/map" | py "
import json,sys
d=json.load(sys.stdin)
print(' '.join('%d' % c['expires_ms'] for m in d['models'] for r in m['coverage'] for c in sorted(r['claims'], key=lambda c: c['id'])))"; }
before=$(snap)
kill -9 "$mpid"
wait "$mpid" 2>/dev/null
sleep $((LEASE / 1000 + 1)) # longer than a lease: the nodes cannot renew
got=$(complete "$A_API" 60)
[[ $got == "$REF" ]] || fail "aidreams ring stopped serving while the market was down: '$got'"
got=$(complete "$L_API" 16)
[[ $got == "$L_WANT" ]] || fail "llama ring stopped serving while the market was down: '$got'"
"$BIN" market --listen "127.0.0.1:$MPORT" --db "$T/market.sqlite" --lease-ms $LEASE >>"$T/market.log" 2>&1 &
mpid=$!
pids+=($mpid)
for _ in $(seq 50); do curl -sf "$MK/map" >/dev/null && break; sleep 0.1; done
after=$(snap)
[[ -n $before && $after == "$before" ]] || fail "claims after the restart: '$after', before: '$before'"
e1=$(exp_of)
sleep $((LEASE / 1000 + 1))
[[ $(snap) == "$before" ]] || fail "claims lost after the restart: '$(snap)'"
e2=$(exp_of)
py "
a=[int(x) for x in '$e1'.split()]; b=[int(x) for x in '$e2'.split()]
import sys; sys.exit(0 if len(a)==len(b)==5 and all(y>x for x,y in zip(a,b)) else 1)" ||
  fail "the nodes did not renew after the restart: $e1 -> $e2"
[[ $(curl -sf "$MK/v1/rings" | py "import json,sys; print(len(json.load(sys.stdin)['rings']))") == 2 ]] ||
  fail "rings not ready after the restart"
echo "ok: market killed: both rings kept serving; restarted from SQLite with the same 5 claims, renewed"

# 4. SIGTERM releases the claim at once
t_term=$(now)
kill -TERM "$pid_e"
rel=""
for _ in $(seq 50); do
  [[ -z $(claim_of e) ]] && { rel=1; break; }
  sleep 0.05
done
t_rel=$(since "$t_term")
[[ -n $rel ]] || fail "SIGTERM did not release e's claim"
py "import sys; sys.exit(0 if float('$t_rel') < $LEASE/1000 else 1)" || fail "released only after $t_rel s"
grep -q "released claim" "$T/e.log" || fail "e did not log its release"
echo "ok: SIGTERM released e's claim after $t_rel s (lease $LEASE ms)"
echo "PASS (total $(since "$t_start") s)"

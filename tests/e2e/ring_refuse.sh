#!/usr/bin/env bash
# Refusals, stopping and one-stage rings:
#  A. a successor that refuses the head (non-adjacent window): `stage -p` fails at
#     once with the reason phrased from the head's side; the daemon logs it as an
#     error at every attempt with a growing backoff (1 s, 2 s, 4 s).
#  B. a successor serving another model: "it serves model X, this stage serves Y"
#     on both sides, each from its own side.
#  C. SIGTERM stops a head waiting for the ring, a plain stage, and a head waiting
#     for prompts on stdin, each within 1.5 s; an orderly shutdown (goodbye) is
#     logged at info on the neighbour, never as a warning.
#  D. `kvasir plan` with one device -> a 1-rank manifest; `stage --manifest` runs it
#     as a one-stage ring (text equal to `kvasir run`), with the manifest's targets
#     (ctx, seqs, boundary) applied and CLI flags overriding them; the default plan is
#     "auto" with an f32 rank, and a rank's own "boundary" is what its stage sends.
#  E. a successor with another --batch, then another --ctx: refused at the handshake
#     (PROTOCOL.md §4 step 2), each side phrasing it from its own side.
#  F. same shapes, other weights (every F32 tensor negated: the fingerprint is the same):
#     refused at the handshake by content id, both sides; a manifest's content id
#     refuses the file at start.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
L=$KVASIR_SHARED/models/llama-f32.gguf
[[ -f $M && -f $L ]] || { echo "FAIL: missing $M or $L"; exit 1; }
tmp=$(mktemp -d)
pids=()
cleanup() {
  exec 3>&- 2>/dev/null
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$tmp" 2 || { echo "FAIL: cannot make keys"; exit 1; }
K0=$(key_args "$tmp" 0 2) # the heads below
K1=$(key_args "$tmp" 1 2) # their other stage
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "== $f"; tail -20 "$f"; done; exit 1; }
# free ports (a port is taken if a connect succeeds), below Linux's ephemeral
# range (32768-60999), where an outgoing connection could take one after the check
P=()
p=$((20000 + ($$ % 120) * 100))
while [[ ${#P[@]} -lt 8 ]]; do
  (exec 9<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || P+=("$p")
  p=$((p + 1))
done
a() { echo "127.0.0.1:${P[$1]}"; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# term PID LABEL: SIGTERM, the process must be gone within 1500 ms
term() {
  local t0 t
  t0=$(now_ms)
  kill -TERM "$1" || fail "$2 is not running"
  while kill -0 "$1" 2>/dev/null; do
    sleep 0.02
    t=$(($(now_ms) - t0))
    [[ $t -le 1500 ]] || fail "$2 still running $t ms after SIGTERM"
  done
  wait "$1" 2>/dev/null
  echo "ok: $2 stopped $(($(now_ms) - t0)) ms after SIGTERM"
}

# --- A. non-adjacent successor ----------------------------------------------------------
"$BIN" stage -m "$M" --window 2:4 $K1 --listen "$(a 1)" --next "$(a 0)" >"$tmp/refuser.log" 2>&1 &
refuser=$!
pids+=($refuser)
sleep 0.3
t0=$(now_ms)
timeout 15 "$BIN" stage -m "$M" --window 0:1 $K0 --listen "$(a 0)" --next "$(a 1)" -p hi >"$tmp/a.out" 2>"$tmp/a.log"
rc=$?
dt=$(($(now_ms) - t0))
[[ $rc == 1 ]] || fail "A: head -p exited $rc, expected 1"
[[ $dt -le 5000 ]] || fail "A: head -p took $dt ms to report the refusal"
why="successor $(a 1) refused this stage: its window [2,4) does not begin where this stage's [0,1) ends"
grep -qF "kvasir: the ring cannot close: $why" "$tmp/a.log" || fail "A: no refusal reason for the user"
grep -qF "error: $why (attempt 1, retrying in 1 s)" "$tmp/a.log" || fail "A: refusal not logged as an error"
grep -qF "refusing predecessor 127.0.0.1:" "$tmp/refuser.log" || fail "A: the refusing stage did not log it"
grep -qF "its window [0,1) does not end where this stage's [2,4) begins" "$tmp/refuser.log" ||
  fail "A: the refusing stage's own reason"
echo "ok: A: refused in $dt ms: $why"
# the daemon (no -p) logs every refusal as an error, with a growing backoff
"$BIN" stage -m "$M" --window 0:1 $K0 --listen "$(a 0)" --next "$(a 1)" >"$tmp/a2.log" 2>&1 &
h=$!
pids+=($h)
sleep 3.6
term "$h" "A: refused head (daemon)"
n=$(grep -c "error: successor $(a 1) refused this stage" "$tmp/a2.log")
[[ $n -ge 2 && $n -le 3 ]] || fail "A: $n refusal errors in 3.6 s (backoff 1 s, 2 s, 4 s: 3 expected)"
grep -qF "(attempt 2, retrying in 2 s)" "$tmp/a2.log" || fail "A: no growing backoff"
echo "ok: A: $n refusal errors in 3.6 s"
term "$refuser" "A: refusing stage"

# --- B. another model --------------------------------------------------------------------
# (its next leads nowhere: the head must not also refuse it as a predecessor first)
"$BIN" stage -m "$L" --window 1:2 $K1 --listen "$(a 2)" --next "$(a 7)" >"$tmp/llama.log" 2>&1 &
ll=$!
pids+=($ll)
sleep 0.3
timeout 15 "$BIN" stage -m "$M" --window 0:1 $K0 --listen "$(a 0)" --next "$(a 2)" -p hi >"$tmp/b.out" 2>"$tmp/b.log"
rc=$?
[[ $rc == 1 ]] || fail "B: head -p exited $rc, expected 1"
# the 16-hex-digit fingerprint prefixes, as `gguf info` computes them
fpm=$("$BIN" gguf info "$M" | sed -n 's/^fingerprint: \([0-9a-f]\{16\}\).*/\1/p')
fpl=$("$BIN" gguf info "$L" | sed -n 's/^fingerprint: \([0-9a-f]\{16\}\).*/\1/p')
[[ ${#fpm} == 16 && ${#fpl} == 16 && $fpm != "$fpl" ]] || fail "B: fingerprints from gguf info: '$fpm' '$fpl'"
why="successor $(a 2) refused this stage: it serves model $fpl..., this stage serves $fpm..."
grep -qF "kvasir: the ring cannot close: $why" "$tmp/b.log" || fail "B: reason not phrased from the head's side"
grep -qF "it serves model $fpm..., this stage serves $fpl..." "$tmp/llama.log" ||
  fail "B: the refusing stage's own reason"
echo "ok: B: $why"
term "$ll" "B: refusing stage"

# --- C. SIGTERM and orderly shutdown -------------------------------------------------------
# a head waiting for a successor that never comes (nothing listens on port 7)
"$BIN" stage -m "$M" --window 0:2 $K0 --listen "$(a 3)" --next "$(a 7)" -p hi >"$tmp/c1.out" 2>"$tmp/c1.log" &
h=$!
pids+=($h)
sleep 1
term "$h" "C: head waiting for the ring"
grep -qF "stopped before the ring closed" "$tmp/c1.log" || fail "C: head did not say why it stopped"
# an unreachable successor is reported at the first failed dial (then retried), not after ~17 s
grep -qF "info: cannot reach the successor: cannot connect to $(a 7): Connection refused (retrying with backoff)" \
  "$tmp/c1.log" || fail "C: the unreachable successor was not reported within 1 s"
[[ $(grep -c "cannot reach the successor" "$tmp/c1.log") == 1 ]] || fail "C: the unreachable successor reported more than once in 1 s"
# a two-stage ring: a request, then stop the tail (the head stays), then the head
"$BIN" stage -m "$M" --window 2:4 $K1 --listen "$(a 4)" --next "$(a 5)" >"$tmp/tail.log" 2>&1 &
tl=$!
pids+=($tl)
mkfifo "$tmp/in"
"$BIN" stage -m "$M" --window 0:2 $K0 --listen "$(a 5)" --next "$(a 4)" --prompts - -n 8 --temp 0 \
  <"$tmp/in" >"$tmp/c.out" 2>"$tmp/head.log" &
h=$!
pids+=($h)
exec 3>"$tmp/in"
echo "Once upon a time" >&3
for _ in $(seq 100); do grep -q '^#0 ' "$tmp/c.out" && break; sleep 0.1; done
grep -q '^#0 ok ' "$tmp/c.out" || fail "C: request: $(cat "$tmp/c.out")"
term "$tl" "C: tail"
sleep 0.3
kill -0 "$h" || fail "C: the head died with the tail"
grep -q "info: stage \[0,2) lost its predecessor .*(it shut down)" "$tmp/head.log" ||
  fail "C: the head did not log the tail's shutdown at info"
grep -q "info: stage \[0,2) lost its successor .*(it shut down)" "$tmp/head.log" ||
  fail "C: the head did not log its successor's goodbye at info"
term "$h" "C: head waiting for prompts on stdin"
grep -q "warn:" "$tmp/head.log" "$tmp/tail.log" && fail "C: an orderly shutdown logged a warning: $(grep -h warn: "$tmp"/*.log)"
echo "ok: C: orderly shutdowns logged at info only"

# --- D. a one-stage ring from a 1-rank plan, with the manifest's targets -------------------
printf '{"devices": [{"name": "a", "backend": "cpu", "mem_bytes": 100000000, "decode_gbps": 10, "threads": 1, "addr": "%s"}]}\n' \
  "$(a 6)" >"$tmp/dev.json"
"$BIN" plan -m "$M" --devices "$tmp/dev.json" --ctx 96 --seqs 2 --boundary f32 -o "$tmp/one.json" >/dev/null ||
  fail "D: plan"
[[ $(grep -c '"rank":' "$tmp/one.json") == 1 ]] || fail "D: plan did not make a 1-rank manifest"
want=$(timeout 15 "$BIN" run -m "$M" -p "Once upon a time" -n 40 --temp 0 2>/dev/null)
[[ -n $want ]] || fail "D: kvasir run printed nothing"
got=$(timeout 15 "$BIN" stage --manifest "$tmp/one.json" --rank 0 -p "Once upon a time" -n 40 --temp 0 2>"$tmp/d.log")
[[ $? == 0 ]] || fail "D: one-stage ring failed"
[[ $got == "$want" ]] || fail "D: one-stage ring says '$got', kvasir run '$want'"
grep -qF "(ctx 96, 2 seqs, f32 boundaries)" "$tmp/d.log" || fail "D: manifest targets not applied"
grep -q 'ring: 1 requests done, 0 failed, 40 tokens' "$tmp/d.log" || fail "D: metrics: $(grep ring: "$tmp/d.log")"
printf 'Once upon a time\nOnce upon a time\nOnce upon a time\n' >"$tmp/p3"
timeout 15 "$BIN" stage --manifest "$tmp/one.json" --rank 0 --prompts "$tmp/p3" --parallel 3 -n 40 --temp 0 \
  --ctx 64 --boundary f16 >"$tmp/d3.out" 2>"$tmp/d3.log" || fail "D: one-stage ring, 3 prompts"
grep -qF "(ctx 64, 2 seqs, f16 boundaries)" "$tmp/d3.log" || fail "D: CLI flags do not override the targets"
for i in 0 1 2; do
  grep -qxF "#$i ok $want" "$tmp/d3.out" || fail "D: prompt $i: $(grep "^#$i" "$tmp/d3.out")"
done
# the default plan is "auto" and its rank f32; a rank's own "boundary" is what the stage sends
"$BIN" plan -m "$M" --devices "$tmp/dev.json" --ctx 96 -o "$tmp/auto.json" >/dev/null || fail "D: plan (auto)"
python3 - "$tmp/auto.json" "$tmp/f16.json" <<'PY' || fail "D: manifest: $(cat "$tmp/auto.json")"
import json, sys
m = json.load(open(sys.argv[1]))
assert m["targets"]["boundary"] == "auto" and m["ranks"][0]["boundary"] == "f32", m
m["ranks"][0]["boundary"] = "f16"
json.dump(m, open(sys.argv[2], "w"))
PY
for mf in auto:f32 f16:f16; do
  timeout 15 "$BIN" stage --manifest "$tmp/${mf%%:*}.json" --rank 0 -p "Once upon a time" -n 4 --temp 0 >/dev/null \
    2>"$tmp/d4.log" || fail "D: ${mf%%:*} manifest"
  grep -qF "(ctx 96, 1 seqs, ${mf##*:} boundaries)" "$tmp/d4.log" || fail "D: ${mf%%:*} manifest: $(grep 'boundaries' "$tmp/d4.log")"
done
echo "ok: D: one-stage ring = kvasir run: '$want'"

# --- E. n_batch and n_ctx differ: refused at the handshake ---------------------------------
for what in "batch 64 512 n_batch" "ctx 96 128 n_ctx"; do
  read -r flag theirs ours field <<<"$what"
  "$BIN" stage -m "$M" --window 2:4 $K1 --$flag "$theirs" --listen "$(a 1)" --next "$(a 7)" >"$tmp/e.log" 2>&1 &
  e=$!
  pids+=($e)
  sleep 0.3
  timeout 15 "$BIN" stage -m "$M" --window 0:2 $K0 --$flag "$ours" --listen "$(a 0)" --next "$(a 1)" -p hi \
    >"$tmp/e.out" 2>"$tmp/e_head.log"
  rc=$?
  [[ $rc == 1 ]] || fail "E: head -p with another --$flag exited $rc, expected 1"
  why="successor $(a 1) refused this stage: it has $field $theirs, this stage $ours (all stages need the same --$flag)"
  grep -qF "kvasir: the ring cannot close: $why" "$tmp/e_head.log" || fail "E: --$flag: $(cat "$tmp/e_head.log")"
  grep -qF "it has $field $ours, this stage $theirs (all stages need the same --$flag)" "$tmp/e.log" ||
    fail "E: the refusing stage's own reason (--$flag)"
  echo "ok: E: $why"
  term "$e" "E: refusing stage (--$flag)"
done

# --- F. same shapes, other weights: refused by content id -----------------------------------
"$BIN" shard index "$M" -o "$tmp/m.kvindex.json" >"$tmp/cid" || fail "F: shard index"
python3 - "$M" "$tmp/m.kvindex.json" "$tmp/neg.gguf" <<'PY'
import json, struct, sys
data = bytearray(open(sys.argv[1], 'rb').read())
for t in json.load(open(sys.argv[2]))['tensors']:
    if t['type'] == 'F32':
        n = t['size'] // 4
        v = struct.unpack_from('<%df' % n, data, t['offset'])
        struct.pack_into('<%df' % n, data, t['offset'], *[-x for x in v])
open(sys.argv[3], 'wb').write(data)
PY
[[ $("$BIN" gguf info "$tmp/neg.gguf" | grep '^fingerprint') == $("$BIN" gguf info "$M" | grep '^fingerprint') ]] ||
  fail "F: the negated model should keep the fingerprint"
cm=$(sed -n 's/^content_id=\(.\{16\}\).*/\1/p' "$tmp/cid")
cn=$("$BIN" shard index "$tmp/neg.gguf" -o "$tmp/n.kvindex.json" | sed -n 's/^content_id=\(.\{16\}\).*/\1/p')
[[ ${#cm} == 16 && ${#cn} == 16 && $cm != "$cn" ]] || fail "F: content ids '$cm' '$cn'"
"$BIN" stage -m "$tmp/neg.gguf" --window 2:4 $K1 --listen "$(a 1)" --next "$(a 7)" >"$tmp/f.log" 2>&1 &
f=$!
pids+=($f)
sleep 0.3
timeout 15 "$BIN" stage -m "$M" --window 0:2 $K0 --listen "$(a 0)" --next "$(a 1)" -p hi >"$tmp/f.out" 2>"$tmp/f_head.log"
rc=$?
[[ $rc == 1 ]] || fail "F: head -p with a successor of other weights exited $rc, expected 1"
why="successor $(a 1) refused this stage: it serves other weights of this model (content id $cn..., this stage $cm...)"
grep -qF "kvasir: the ring cannot close: $why" "$tmp/f_head.log" || fail "F: $(cat "$tmp/f_head.log")"
grep -qF "it serves other weights of this model (content id $cm..., this stage $cn...)" "$tmp/f.log" ||
  fail "F: the refusing stage's own reason"
echo "ok: F: $why"
term "$f" "F: refusing stage"
# the 1-rank manifest of D names $M's content id: the negated file is refused at start
grep -q "\"content_id\": \"$cm" "$tmp/one.json" || fail "F: plan wrote no content id: $(head -c 400 "$tmp/one.json")"
if timeout 15 "$BIN" stage --manifest "$tmp/one.json" --rank 0 -m "$tmp/neg.gguf" -p hi >/dev/null 2>"$tmp/f2.log"; then
  fail "F: a manifest's content id did not refuse other weights"
fi
grep -qF "holds other weights (content id $cn...) than the manifest expects ($cm...)" "$tmp/f2.log" ||
  fail "F: manifest refusal: $(cat "$tmp/f2.log")"
echo "ok: F: manifest content id refuses the negated file: $(grep 'other weights' "$tmp/f2.log" | head -1)"
echo PASS

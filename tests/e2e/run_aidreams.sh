#!/usr/bin/env bash
# kvasir run / eval on aidreams260K against llama.cpp's reference
# (../shared/models/aidreams260K.ref.json): greedy text must match exactly.
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}"
model="$KVASIR_SHARED/models/aidreams260K.gguf"
ref="$KVASIR_SHARED/models/aidreams260K.ref.json"
[ -f "$model" ] && [ -f "$ref" ] || { echo "missing $model or $ref"; exit 1; }

# The reference continuation: the "text" field (plain ASCII, no escapes here).
expected=$(grep -o '"text":"[^"]*"' "$ref" | sed -e 's/^"text":"//' -e 's/"$//')
[ -n "$expected" ] || { echo "no text in $ref"; exit 1; }

got=$("$KVASIR_BIN" run -m "$model" -p "Once upon a time" -n 60 --temp 0 2>/tmp/kvs_e2e_run_$$.err)
# One llama.cpp-like summary: load time, prompt tokens + tok/s, generated tokens + decode tok/s, TTFT.
summary=$(grep -cE '^summary: load [0-9.]+ ms \| prompt 13 tokens in [0-9.]+ ms \([0-9.]+ tok/s\) \| generated 60 tokens, 59 decode steps in [0-9.]+ ms \([0-9.]+ tok/s\) \| time to first token [0-9.]+ ms$' /tmp/kvs_e2e_run_$$.err || true)
stamped=$(grep -cE '^20[0-9]{2}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}Z kvasir\[[0-9]+\] info: run: ' /tmp/kvs_e2e_run_$$.err || true)
# --threads defaults to the cores this process may use (sched_getaffinity), not a constant.
n1=$(taskset -c 0 "$KVASIR_BIN" run -m "$model" -p x -n 1 2>&1 >/dev/null | sed -n 's/.* \([0-9]*\) threads$/\1/p')
nall=$("$KVASIR_BIN" run -m "$model" -p x -n 1 2>&1 >/dev/null | sed -n 's/.* \([0-9]*\) threads$/\1/p')
[ "$n1" = 1 ] && [ "$nall" = "$(nproc)" ] || { echo "--threads default: $n1 under taskset -c 0, $nall of $(nproc) cores"; exit 1; }
rm -f /tmp/kvs_e2e_run_$$.err
if [ "$got" != "$expected" ]; then
    echo "run output differs:"; echo " got:      [$got]"; echo " expected: [$expected]"; exit 1
fi
[ "$summary" = 1 ] || { echo "no speed summary on stderr"; exit 1; }
[ "$stamped" = 1 ] || { echo "log lines carry no timestamp"; exit 1; }

# run --ring: the same summary (the ring's prompt and generation apart), and the stage
# processes quiet (warnings and errors only) unless -v / --log-level / KVASIR_LOG asks.
"$KVASIR_BIN" run --ring 2 -m "$model" -p "Once upon a time" -n 60 --temp 0 >/dev/null 2>/tmp/kvs_e2e_run_$$.err
grep -qE '^summary: load [0-9.]+ ms \| prompt 13 tokens in [0-9.]+ ms \([0-9.]+ tok/s\) \| generated 60 tokens, 59 decode steps in' /tmp/kvs_e2e_run_$$.err ||
    { echo "run --ring: no summary: $(cat /tmp/kvs_e2e_run_$$.err)"; exit 1; }
head_pid=$(grep -o 'kvasir\[[0-9]*\] info: run: rank 1' /tmp/kvs_e2e_run_$$.err | grep -o '[0-9]*' | head -1)
others=$(grep -o 'kvasir\[[0-9]*\] info' /tmp/kvs_e2e_run_$$.err | grep -vc "kvasir\[$head_pid\]" || true)
[ -n "$head_pid" ] && [ "$others" = 0 ] || { echo "run --ring: a stage process logged at info: $(cat /tmp/kvs_e2e_run_$$.err)"; exit 1; }
"$KVASIR_BIN" run --ring 2 -m "$model" -p "Once upon a time" -n 4 --temp 0 -v >/dev/null 2>/tmp/kvs_e2e_run_$$.err
[ "$(grep -o 'kvasir\[[0-9]*\] \(info\|debug\)' /tmp/kvs_e2e_run_$$.err | sort -u | sed 's/ .*//' | sort -u | wc -l)" -ge 2 ] ||
    { echo "run --ring -v: the stage processes did not log"; exit 1; }
"$KVASIR_BIN" run -m "$model" -p x -n 1 --log-level warn >/dev/null 2>/tmp/kvs_e2e_run_$$.err
! grep -q ' info: ' /tmp/kvs_e2e_run_$$.err || { echo "--log-level warn still logs info"; exit 1; }
"$KVASIR_BIN" run -m "$model" -p x -n 1 --log-level loud >/dev/null 2>&1 && { echo "--log-level loud accepted"; exit 1; }
rm -f /tmp/kvs_e2e_run_$$.err

# --ring is a recognised option (implemented by the ring); bad options are usage errors.
set +e
"$KVASIR_BIN" run -m "$model" -p x --bogus 1 >/dev/null 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || { echo "bad option: rc $rc, expected 2"; exit 1; }

# Sampling seeds: no --seed draws a random one and logs it; that seed given
# back reproduces the text; --seed -1 is random too; a bad seed is a usage error.
tmpd=$(mktemp -d)
trap 'rm -rf "$tmpd"' EXIT
"$KVASIR_BIN" run -m "$model" -p "Once upon a time" -n 40 --temp 1.5 >"$tmpd/a" 2>"$tmpd/a.err"
seed=$(sed -n 's/.*sampling seed \([0-9]*\) .*/\1/p' "$tmpd/a.err")
[ -n "$seed" ] || { echo "no sampling seed logged: $(cat "$tmpd/a.err")"; exit 1; }
"$KVASIR_BIN" run -m "$model" -p "Once upon a time" -n 40 --temp 1.5 --seed "$seed" >"$tmpd/b" 2>/dev/null
cmp -s "$tmpd/a" "$tmpd/b" || { echo "--seed $seed did not reproduce the text"; exit 1; }
"$KVASIR_BIN" run -m "$model" -p "Once upon a time" -n 40 --temp 1.5 --seed -1 >/dev/null 2>"$tmpd/c.err"
grep -q 'sampling seed [0-9]' "$tmpd/c.err" || { echo "--seed -1: no seed logged"; exit 1; }
# A draw is a function of the seed and the token's position (docs/PROTOCOL.md, Sampling):
# a ring's tail draws what one process draws.
one=$("$KVASIR_BIN" run -m "$model" -p "Once upon a time" -n 40 --temp 0.9 --seed 5 2>/dev/null)
two=$("$KVASIR_BIN" run --ring 2 --boundary f32 -m "$model" -p "Once upon a time" -n 40 --temp 0.9 --seed 5 2>/dev/null)
[ -n "$one" ] && [ "$one" = "$two" ] || { echo "--seed 5: ring [$two], one process [$one]"; exit 1; }
set +e
"$KVASIR_BIN" run -m "$model" -p x --seed -2 >/dev/null 2>&1; rc=$?
[ "$rc" = 2 ] || { echo "--seed -2: rc $rc, expected 2"; exit 1; }
"$KVASIR_BIN" run -m "$model" -p x --seed " -5" >/dev/null 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || { echo "--seed \" -5\": rc $rc, expected 2"; exit 1; }
# Ring-only options without --ring say what is missing.
set +e
"$KVASIR_BIN" run -m "$model" -p x --boundary f32 >/dev/null 2>"$tmpd/r.err"; rc=$?
set -e
[ "$rc" = 2 ] && grep -q 'add --ring N' "$tmpd/r.err" || { echo "--boundary without --ring: rc $rc, $(cat "$tmpd/r.err")"; exit 1; }

# eval: the prompt ids teacher-forced; one JSON line per position, the
# top-1 of each must be the reference's (positions 0..12 of the ref file).
prompt=$(grep -o '"prompt":\[[0-9,]*\]' "$ref" | sed -e 's/^"prompt":\[//' -e 's/\]$//')
out=$("$KVASIR_BIN" eval -m "$model" --tokens "$prompt" --top 3)
n=$(printf '%s\n' "$out" | wc -l)
[ "$n" = 13 ] || { echo "eval printed $n lines, expected 13"; exit 1; }
# Reference top-1 ids of positions 0..12, in order.
ref_top=$(grep -o '"top":\[\[[0-9]*' "$ref" | head -n 13 | sed 's/.*\[\[//' | tr '\n' ' ')
our_top=$(printf '%s\n' "$out" | sed 's/.*"top": \[\[\([0-9]*\),.*/\1/' | tr '\n' ' ')
[ "$ref_top" = "$our_top" ] || { echo "eval top-1: got [$our_top], expected [$ref_top]"; exit 1; }
first=$(printf '%s\n' "$out" | head -n 1)
case "$first" in
    '{"pos": 0, "top": [[319, 0.97'*) ;;
    *) echo "eval first line: $first"; exit 1 ;;
esac
# The same in chunks of 4 tokens (several forward calls) ranks the same ids
# (probabilities may differ in the last bits between batch shapes).
ids_only() { sed 's/, [0-9.e+-]*\]/]/g'; }
out4=$("$KVASIR_BIN" eval -m "$model" --tokens "$prompt" --top 3 --batch 4)
[ "$(printf '%s\n' "$out4" | ids_only)" = "$(printf '%s\n' "$out" | ids_only)" ] ||
    { echo "eval --batch 4 ranks differently from one batch"; exit 1; }
echo "ok: run text matches; eval top-1 matches at 13 positions"

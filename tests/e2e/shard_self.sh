#!/usr/bin/env bash
# shard extract / shard index must refuse to write over their own input model
# (same path, another spelling of it, or a hard link): it used to replace the
# full model by a shard silently. Works on a private copy, never on shared/.
set -euo pipefail
K=${KVASIR_BIN:?}
src=${KVASIR_SHARED:?}/models/aidreams260K.gguf
T=$(mktemp -d /tmp/kvs_shard_self.XXXXXX)
trap 'rm -rf "$T"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cp "$src" "$T/m.gguf"
ln "$T/m.gguf" "$T/hard.gguf"
sum=$(cksum <"$T/m.gguf")
for out in "$T/m.gguf" "$T/./m.gguf" "$T/hard.gguf"; do
    set +e
    "$K" shard extract -m "$T/m.gguf" --window 0:2 -o "$out" 2>"$T/err"; rc=$?
    set -e
    [ "$rc" = 2 ] || fail "extract -o $out: exit $rc, expected 2"
    grep -q 'input model itself' "$T/err" || fail "extract -o $out: $(cat "$T/err")"
    set +e
    "$K" shard index "$T/m.gguf" -o "$out" 2>"$T/err"; rc=$?
    set -e
    [ "$rc" = 2 ] || fail "index -o $out: exit $rc, expected 2"
done
[ "$(cksum <"$T/m.gguf")" = "$sum" ] || fail "the input model was modified"
# a different output still works
"$K" shard extract -m "$T/m.gguf" --window 0:2 -o "$T/s.gguf"
"$K" gguf info "$T/s.gguf" | grep -Eq '^  blk\.1 +9 tensors' || fail "shard 0:2 lacks blk.1"
# A partial shard is not a model for run / eval / run --ring: the error says
# which window it holds and how to serve it. A whole-model shard runs.
for cmd in "run -m $T/s.gguf -p x -n 1" "eval -m $T/s.gguf --tokens 1,2" "run --ring 2 -m $T/s.gguf -p x -n 1"; do
    set +e
    # shellcheck disable=SC2086
    "$K" $cmd >/dev/null 2>"$T/err"; rc=$?
    set -e
    [ "$rc" = 1 ] || fail "$cmd on a [0,2) shard: exit $rc, expected 1"
    grep -q 'is a stage shard (window \[0,2) of 4 source blocks' "$T/err" || fail "$cmd: $(cat "$T/err")"
    grep -q -- '--window 0:2' "$T/err" || fail "$cmd: no stage command in $(cat "$T/err")"
done
"$K" shard extract -m "$T/m.gguf" --window 0:4 -o "$T/w.gguf"
[ "$("$K" run -m "$T/w.gguf" -p "Once upon a time" -n 8 --temp 0 2>/dev/null)" = \
  "$("$K" run -m "$T/m.gguf" -p "Once upon a time" -n 8 --temp 0 2>/dev/null)" ] || fail "whole-model shard runs differently"
echo PASS

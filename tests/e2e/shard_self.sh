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
echo PASS

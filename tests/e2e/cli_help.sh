#!/usr/bin/env bash
# Every subcommand answers --help with its usage on stdout and exit 0, and no
# user help lists a test hook (--step-delay).
set -euo pipefail
K=${KVASIR_BIN:?KVASIR_BIN unset}
fail() { echo "FAIL: $*" >&2; exit 1; }
n=0
for c in "" run serve stage eval plan seed bench tokenize relay key "gguf" "gguf info" "gguf synth" "shard" \
         "shard extract" "shard index" "shard fetch" "run --ring 2" "serve --ring 2"; do
    # shellcheck disable=SC2086
    out=$("$K" $c --help 2>/dev/null) || fail "kvasir $c --help exits $?"
    grep -qi "usage" <<<"$out" || fail "kvasir $c --help prints no usage"
    ! grep -q -- "--step-delay" <<<"$out" || fail "kvasir $c --help lists the test hook --step-delay"
    n=$((n + 1))
done
"$K" run --ring 2 --help | grep -q -- "--prompts" || fail "run --ring --help"
"$K" run --help | grep -q -- "--hf-token" || fail "run --help does not list --hf-token"
echo "ok: $n help texts, exit 0, no test hooks"

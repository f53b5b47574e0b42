#!/usr/bin/env bash
# A ring whose stages each hold only their extracted shard reproduces the
# full model: for every model in ../shared/models, split it into a ring of
# min(3, n_block) stages, give each stage only `kvasir shard extract` of its
# window, and compare the greedy continuation with single-process `kvasir run`
# on the full file (F32 boundaries: bit-identical hidden states, PROTOCOL §5).
set -uo pipefail
BIN=${KVASIR_BIN:?}; SH=${KVASIR_SHARED:?}
T=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
# Below Linux's ephemeral range (32768-60999): a base up there could be taken by
# any outgoing connection (it was: "Address already in use" under ctest -j2).
port=$((20000 + (RANDOM % 1000) * 10))
PROMPT="Once upon a time"
n_models=0
. "$(dirname "$0")/tools/ring_keys.sh"
ring_keys "$T" 3 || fail "cannot make keys"
for M in "$SH"/models/*.gguf; do
  name=$(basename "$M" .gguf)
  nb=$("$BIN" gguf info "$M" | sed -n 's/^main blocks: \([0-9]*\) .*/\1/p')
  [[ -n $nb ]] || fail "$name: no block_count in gguf info"
  ns=$((nb < 3 ? nb : 3))
  # even split: stage r gets [r*nb/ns, (r+1)*nb/ns)
  addrs=(); for ((r = 0; r < ns; r++)); do addrs+=("127.0.0.1:$((port + r))"); done
  port=$((port + 10))
  for ((r = ns - 1; r >= 0; r--)); do
    b=$((r * nb / ns)); e=$(((r + 1) * nb / ns))
    "$BIN" shard extract -m "$M" --window "$b:$e" -o "$T/$name.$r.gguf" >/dev/null 2>"$T/extract.log" ||
      fail "$name: extract [$b,$e): $(cat "$T/extract.log")"
    ((r == 0)) && continue
    "$BIN" stage -m "$T/$name.$r.gguf" --window "$b:$e" $(key_args "$T" "$r" "$ns") --listen "${addrs[$r]}" \
      --next "${addrs[$(((r + 1) % ns))]}" --boundary f32 --threads 1 2>>"$T/ring.log" &
    pids+=($!)
  done
  want=$(timeout 60 "$BIN" run -m "$M" -p "$PROMPT" -n 12 --temp 0 --ignore-eos --threads 1 2>/dev/null) ||
    fail "$name: single-process run failed"
  got=$(timeout 60 "$BIN" stage -m "$T/$name.0.gguf" --window "0:$((nb / ns))" $(key_args "$T" 0 "$ns") --listen "${addrs[0]}" \
    --next "${addrs[1]}" --boundary f32 --threads 1 -p "$PROMPT" -n 12 --temp 0 --ignore-eos 2>>"$T/ring.log") ||
    fail "$name: ring over shards failed: $(tail -5 "$T/ring.log")"
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; pids=()
  [[ -n $want && $got == "$want" ]] || fail "$name: ring of $ns shards gave '$got', single process '$want'"
  size_full=$(stat -c %s "$M"); size_0=$(stat -c %s "$T/$name.0.gguf")
  ((size_0 < size_full)) || fail "$name: the head's shard is not smaller than the model"
  echo "ok: $name: ring of $ns stages over shards == single process: '$got'"
  n_models=$((n_models + 1))
done
((n_models >= 9)) || fail "only $n_models models checked"
echo "shard rings: $n_models models reproduce the full model"

#!/usr/bin/env bash
# kvasir gguf info on aidreams260K: figures computed by hand from the shapes in
# shared/models/README.md (4 blocks, n_embd 64, FFN 172, vocab 512, all F32):
#   per block: 4 x 64x64 attn + 3 x 64x172 FFN + 2 x 64 norms = 49536 floats = 198144 bytes
#   outside blocks: token_embd + output (64x512 each) + output_norm (64) = 262400 bytes
set -euo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
out=$("$BIN" gguf info "$M")
fail() { echo "FAIL: $*"; echo "$out"; exit 1; }
grep -qx 'version: 3' <<<"$out" || fail version
grep -qx 'alignment: 32' <<<"$out" || fail alignment
grep -qx 'architecture: "llama"' <<<"$out" || fail arch
grep -qx '  llama.block_count = 4 (UINT32)' <<<"$out" || fail block_count
grep -qx '  llama.embedding_length = 64 (UINT32)' <<<"$out" || fail n_embd
grep -qx '  llama.feed_forward_length = 172 (UINT32)' <<<"$out" || fail n_ff
grep -q '^vocabulary: 512 tokens, tokenizer model "llama"' <<<"$out" || fail vocab
grep -qx 'tensors: 39, 1054976 bytes' <<<"$out" || fail tensors
grep -Eq '^  F32 +39 tensors +1054976 bytes$' <<<"$out" || fail by-type
for b in 0 1 2 3; do
  grep -Eq "^  blk\.$b +9 tensors +198144 bytes$" <<<"$out" || fail "block $b"
done
grep -Eq '^  non-block +3 tensors +262400 bytes$' <<<"$out" || fail non-block
grep -Eq '^fingerprint: [0-9a-f]{64}$' <<<"$out" || fail fingerprint
# the file size as listed by ls -l
grep -qx 'file size: 1068640 bytes' <<<"$out" || fail size
# a stage shard says which window it holds (block_count stays the source's 4)
grep -q '^shard:' <<<"$out" && fail "a full model described as a shard"
tmp=$(mktemp -d /tmp/kvs_gguf_info.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
"$BIN" shard extract -m "$M" --window 2:4 -o "$tmp/s24.gguf" >/dev/null
out=$("$BIN" gguf info "$tmp/s24.gguf")
grep -qx 'shard: window \[2,4) of 4 source blocks (tail: output norm + LM head)' <<<"$out" || fail shard-window
grep -qx '  llama.block_count = 4 (UINT32)' <<<"$out" || fail shard-block_count
"$BIN" shard extract -m "$M" --window 1:2 -o "$tmp/s12.gguf" >/dev/null
out=$("$BIN" gguf info "$tmp/s12.gguf")
grep -qx 'shard: window \[1,2) of 4 source blocks' <<<"$out" || fail shard-middle
grep -Eq '^  blk\.1 +9 tensors +198144 bytes$' <<<"$out" || fail shard-block
# a GGUF with no tensors at all (issue 9: gguf info sorted a NULL block list, UBSan)
python3 - "$tmp/empty.gguf" <<'PY'
import struct, sys
def s(x): b = x.encode(); return struct.pack('<Q', len(b)) + b
d = b'GGUF' + struct.pack('<IQQ', 3, 0, 1) + s('general.architecture') + struct.pack('<I', 8) + s('llama')
open(sys.argv[1], 'wb').write(d)
PY
out=$("$BIN" gguf info "$tmp/empty.gguf" 2>&1) || fail "0-tensor GGUF rc=$?"
grep -qx 'tensors: 0, 0 bytes' <<<"$out" || fail 0-tensors
grep -qx 'bytes by block: 0 blocks' <<<"$out" || fail 0-blocks
grep -Eq '^  non-block +0 tensors +0 bytes$' <<<"$out" || fail 0-non-block
# usage and errors
"$BIN" gguf info --help | grep -q 'usage: kvasir gguf info' || fail help
"$BIN" gguf --help | grep -q 'gguf synth' || fail gguf-help
set +e
"$BIN" gguf info /nonexistent.gguf 2>/dev/null; rc=$?
[ "$rc" = 1 ] || fail "missing file rc=$rc"
"$BIN" gguf info 2>/dev/null; rc=$?
[ "$rc" = 2 ] || fail "no file rc=$rc"
"$BIN" gguf bogus 2>/dev/null; rc=$?
[ "$rc" = 2 ] || fail "bogus rc=$rc"
echo ok

#!/usr/bin/env bash
# kvasir gguf synth: determinism, exact file size (computed by hand below from
# the GGUF layout, gguf-facts §1, and the block sizes, §2.1), and the file
# reads back with `kvasir gguf info`.
set -euo pipefail
: "${KVASIR_BIN:?}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

args=(gguf synth --arch qwen3 --n-embd 64 --n-block 2 --n-head 4 --n-head-kv 2 --head-dim 16
      --n-ff 96 --n-vocab 300 --ctx 256 --type q8_0 --seed 7)
"$KVASIR_BIN" "${args[@]}" -o "$tmp/a.gguf"
"$KVASIR_BIN" "${args[@]}" -o "$tmp/b.gguf"
cmp "$tmp/a.gguf" "$tmp/b.gguf"
# another seed gives another file of the same size
"$KVASIR_BIN" gguf synth --arch qwen3 --n-embd 64 --n-block 2 --n-head 4 --n-head-kv 2 --head-dim 16 \
      --n-ff 96 --n-vocab 300 --ctx 256 --type q8_0 --seed 8 -o "$tmp/d.gguf"
if cmp -s "$tmp/a.gguf" "$tmp/d.gguf"; then echo "FAIL: seeds 7 and 8 gave the same file"; exit 1; fi

# ---- expected size, by hand ------------------------------------------------
# GGUF string: u64 length + bytes. KV: key string + i32 type + value.
hdr=$((4 + 4 + 8 + 8))               # magic, version, n_tensors, n_kv
kv() { hdr=$((hdr + 8 + ${#1} + 4 + $2)); }   # kv KEY VALUE_BYTES
str() { echo $((8 + ${#1})); }
export LC_ALL=C
kv general.architecture "$(str qwen3)"
kv general.name "$(str kvasir-synth)"
kv general.file_type 4
kv general.quantization_version 4
for k in context_length embedding_length block_count feed_forward_length attention.head_count \
         attention.head_count_kv attention.key_length attention.value_length rope.dimension_count \
         vocab_size; do kv "qwen3.$k" 4; done
kv qwen3.attention.layer_norm_rms_epsilon 4
kv qwen3.rope.freq_base 4
kv tokenizer.ggml.model "$(str gpt2)"
kv tokenizer.ggml.pre "$(str qwen2)"
# tokens: 300 strings. Bytes 0x21-0x7E are 1 UTF-8 byte (94 tokens), the other
# 162 byte tokens are code points >= 0x80: 2 bytes. Merge results: Ġt he in Ġa
# er Ġthe on re Ġs en (Ġ is 2 bytes): 3+2+2+3+2+5+2+2+3+2 = 26. Fillers
# <tok_266> .. <tok_296>: 31 x 9. Specials: <|endoftext|> 13, <|im_start|> 12,
# <|im_end|> 10.
tok_bytes=$((94 + 2 * 162 + 26 + 31 * 9 + 13 + 12 + 10))
kv tokenizer.ggml.tokens $((4 + 8 + 300 * 8 + tok_bytes))
kv tokenizer.ggml.token_type $((4 + 8 + 300 * 4))
# merges: "Ġ t" "h e" "i n" "Ġ a" "e r" "Ġt he" "o n" "r e" "Ġ s" "e n"
merge_bytes=$((4 + 3 + 3 + 4 + 3 + 6 + 3 + 3 + 4 + 3))
kv tokenizer.ggml.merges $((4 + 8 + 10 * 8 + merge_bytes))
kv tokenizer.ggml.bos_token_id 4
kv tokenizer.ggml.eos_token_id 4
kv tokenizer.ggml.padding_token_id 4
kv tokenizer.ggml.add_bos_token 1
tmpl='{% for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}'
kv tokenizer.chat_template "$(str "$tmpl")"

# Tensor infos: name string + u32 n_dims + n_dims x i64 + i32 type + u64 offset.
# Q8_0: 34 bytes per 32 elements; F32: 4 bytes. Data padded to 32 per tensor.
data=0
pad32() { echo $(( ($1 + 31) / 32 * 32 )); }
ti() { # ti NAME N_DIMS BYTES
    hdr=$((hdr + 8 + ${#1} + 4 + 8 * $2 + 4 + 8)); data=$((data + $(pad32 "$3"))); }
q8() { echo $(( $1 / 32 * 34 * $2 )); }   # q8 NE0 NE1
ti token_embd.weight 2 "$(q8 64 300)"
for b in 0 1; do
    ti blk.$b.attn_norm.weight 1 $((64 * 4))
    ti blk.$b.attn_q.weight 2 "$(q8 64 64)"
    ti blk.$b.attn_k.weight 2 "$(q8 64 32)"
    ti blk.$b.attn_v.weight 2 "$(q8 64 32)"
    ti blk.$b.attn_q_norm.weight 1 $((16 * 4))
    ti blk.$b.attn_k_norm.weight 1 $((16 * 4))
    ti blk.$b.attn_output.weight 2 "$(q8 64 64)"
    ti blk.$b.ffn_norm.weight 1 $((64 * 4))
    ti blk.$b.ffn_gate.weight 2 "$(q8 64 96)"
    ti blk.$b.ffn_up.weight 2 "$(q8 64 96)"
    ti blk.$b.ffn_down.weight 2 "$(q8 96 64)"
done
ti output_norm.weight 1 $((64 * 4))
ti output.weight 2 "$(q8 64 300)"
expect=$(( $(pad32 $hdr) + data ))
# Cross-check of the data part alone (hand sum): 20416 + 2 x 33280 + 256 + 20416.
[ "$data" -eq 107648 ] || { echo "FAIL: script arithmetic: data $data"; exit 1; }
size=$(stat -c %s "$tmp/a.gguf")
echo "synth: header $hdr bytes, data $data bytes, expected $expect, file $size"
[ "$size" -eq "$expect" ] || { echo "FAIL: size $size != expected $expect"; exit 1; }

# ---- reads back ---------------------------------------------------------------
"$KVASIR_BIN" gguf info "$tmp/a.gguf" > "$tmp/info.txt"
need() { # need FILE PATTERN: a line of `gguf info` output
    grep -qF -- "$2" "$1" || { echo "FAIL: '$2' not in gguf info:"; cat "$1"; exit 1; }; }
need "$tmp/info.txt" 'architecture: "qwen3"'
need "$tmp/info.txt" "data offset: $(pad32 $hdr)"
need "$tmp/info.txt" "tensors: 25,"
need "$tmp/info.txt" "vocabulary: 300 tokens"
need "$tmp/info.txt" "qwen3.attention.head_count_kv = 2 (UINT32)"
need "$tmp/info.txt" "qwen3.attention.layer_norm_rms_epsilon = 9.99999997e-07 (FLOAT32)"
# tensor names are in the header as plain strings
grep -aqF blk.1.attn_k_norm.weight "$tmp/a.gguf" || { echo "FAIL: no blk.1.attn_k_norm.weight"; exit 1; }

# ---- the other architectures and types write and read back ------------------
"$KVASIR_BIN" gguf synth --arch llama --n-embd 64 --n-block 1 --n-vocab 300 --type q4_0 --seed 1 --tied \
    -o "$tmp/l.gguf"
"$KVASIR_BIN" gguf synth --arch qwen2 --n-embd 64 --n-block 1 --n-head 2 --n-vocab 300 --type f16 --seed 1 \
    -o "$tmp/q2.gguf"
"$KVASIR_BIN" gguf synth --arch qwen3moe --n-embd 64 --n-block 1 --n-head 4 --n-head-kv 2 --head-dim 32 \
    --n-expert 4 --n-expert-used 2 --n-ff-exp 32 --n-vocab 300 --type f32 --seed 1 -o "$tmp/m.gguf"
for f in l q2 m; do "$KVASIR_BIN" gguf info "$tmp/$f.gguf" > "$tmp/$f.txt"; done
# llama, tied, 1 block: token_embd, attn_norm, q, k, v, output, ffn_norm, gate, up, down, output_norm
need "$tmp/l.txt" "tensors: 11,"
need "$tmp/l.txt" "Q4_0"
# qwen2: + 3 biases + output.weight
need "$tmp/q2.txt" "tensors: 15,"
need "$tmp/q2.txt" "F16"
grep -aqF blk.0.attn_v.bias "$tmp/q2.gguf" || { echo "FAIL: qwen2 lacks biases"; exit 1; }
# qwen3moe: q/k norms, router + 3 expert tensors instead of gate/up/down
need "$tmp/m.txt" "tensors: 15,"
need "$tmp/m.txt" "qwen3moe.expert_count = 4 (UINT32)"
need "$tmp/m.txt" "qwen3moe.expert_used_count = 2 (UINT32)"
need "$tmp/m.txt" "qwen3moe.expert_feed_forward_length = 32 (UINT32)"
grep -aqF blk.0.ffn_down_exps.weight "$tmp/m.gguf" || { echo "FAIL: qwen3moe lacks experts"; exit 1; }

# ---- bad input is a usage error, not a crash ----------------------------------
set +e
"$KVASIR_BIN" gguf synth --arch gpt9 --n-embd 64 --n-block 1 --type q8_0 --seed 1 -o "$tmp/x.gguf" 2>/dev/null
[ $? -eq 2 ] || { echo "FAIL: unknown arch not a usage error"; exit 1; }
"$KVASIR_BIN" gguf synth --arch llama --n-embd 48 --n-block 1 --n-head 1 --type q8_0 --seed 1 -o "$tmp/x.gguf" 2>/dev/null
[ $? -eq 2 ] || { echo "FAIL: n_embd 48 with q8_0 accepted"; exit 1; }
"$KVASIR_BIN" gguf synth --arch llama --n-embd 64x --n-block 1 --type q8_0 --seed 1 -o "$tmp/x.gguf" 2>/dev/null
[ $? -eq 2 ] || { echo "FAIL: bad number accepted"; exit 1; }
set -e
[ ! -e "$tmp/x.gguf" ] || { echo "FAIL: a file was written on error"; exit 1; }
# a model larger than the output's filesystem is refused before a byte is written
set +e
"$KVASIR_BIN" gguf synth --arch llama --n-embd 65536 --n-block 1000 --type f32 --seed 1 -o "$tmp/huge.gguf" 2>"$tmp/err"
rc=$?
set -e
[ "$rc" = 1 ] && grep -q 'bytes free' "$tmp/err" || { echo "FAIL: 220 TB synth: rc $rc, $(cat "$tmp/err")"; exit 1; }
[ ! -e "$tmp/huge.gguf" ] && [ ! -e "$tmp/huge.gguf.tmp" ] || { echo "FAIL: the huge synth left a file"; exit 1; }

# NaN weights: run, eval and a ring fail with a clear error instead of
# printing token 0 / "nan" (the last 4 KiB of a small F32 model set to NaN).
"$KVASIR_BIN" gguf synth --arch llama --n-embd 64 --n-block 2 --type f32 --seed 3 -o "$tmp/nan.gguf" 2>/dev/null
python3 -c "import os,struct,sys; p=sys.argv[1]; f=open(p,'r+b'); f.seek(os.path.getsize(p)-4096); f.write(struct.pack('<f',float('nan'))*1024)" "$tmp/nan.gguf"
for cmd in "run -m $tmp/nan.gguf -p hi -n 3 --temp 0" "eval -m $tmp/nan.gguf --tokens 1,2,3" "run --ring 2 -m $tmp/nan.gguf -p hi -n 3 --temp 0"; do
    set +e
    # shellcheck disable=SC2086
    out=$("$KVASIR_BIN" $cmd 2>"$tmp/err"); rc=$?
    set -e
    [ "$rc" != 0 ] && [ -z "$out" ] && grep -q 'NaN or infinity' "$tmp/err" ||
        { echo "FAIL: NaN model, $cmd: rc $rc, out '$out', $(tail -2 "$tmp/err")"; exit 1; }
done
# qwen35 / qwen35moe: the hybrid layout loads and runs (blocks 0-2 Gated
# DeltaNet, block 3 attention; a ring over the GDN/attention boundary equals
# one process), and the tensor set is the one of qwen35-facts §2.
for a in qwen35 qwen35moe; do
    extra=(); [ $a = qwen35moe ] && extra=(--n-expert 4 --n-expert-used 2 --n-ff-exp 64 --n-ff-shexp 96)
    "$KVASIR_BIN" gguf synth --arch $a --n-embd 64 --n-block 4 --n-head 2 --n-head-kv 1 --head-dim 32 --n-ff 96 \
        --ssm-state 16 --ssm-groups 2 --ssm-heads 4 --n-vocab 300 --type q8_0 --seed 5 "${extra[@]}" -o "$tmp/$a.gguf"
    info=$("$KVASIR_BIN" gguf info "$tmp/$a.gguf")
    grep -qx "main blocks: 4 (windows, shards and the planner count these)" <<<"$info" || { echo "FAIL: $a blocks"; exit 1; }
    n_gdn=14; n_att=11; [ $a = qwen35moe ] && n_gdn=19 && n_att=16 # per block: mixer + norms + FFN (+ shared expert)
    for b in 0 1 2; do grep -Eq "^  blk\.$b +$n_gdn tensors" <<<"$info" || { echo "FAIL: $a blk.$b: $info"; exit 1; }; done
    grep -Eq "^  blk\.3 +$n_att tensors" <<<"$info" || { echo "FAIL: $a blk.3"; exit 1; }
    one=$("$KVASIR_BIN" run -m "$tmp/$a.gguf" -p "hello" -n 6 --temp 0 --ignore-eos 2>/dev/null)
    ring=$("$KVASIR_BIN" run --ring 2 -m "$tmp/$a.gguf" -p "hello" -n 6 --temp 0 --ignore-eos --boundary f32 2>/dev/null)
    [ -n "$one" ] && [ "$one" = "$ring" ] || { echo "FAIL: $a ring [$ring] != one process [$one]"; exit 1; }
done
echo "synth: OK"

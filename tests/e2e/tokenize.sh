#!/usr/bin/env bash
# kvasir tokenize: "Once upon a time" with BOS on aidreams260K must give the
# `prompt` ids of its llama.cpp reference (models/aidreams260K.ref.json);
# special-token parsing on the Qwen3 vocab (ids from gguf-facts §5.4); usage
# errors exit 2, runtime errors 1.
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}"
m="$KVASIR_SHARED/models"

want=$(sed -n 's/.*"prompt":\[\([0-9,]*\)\].*/\1/p' "$m/aidreams260K.ref.json" | tr ',' ' ')
got=$("$KVASIR_BIN" tokenize -m "$m/aidreams260K.gguf" -p "Once upon a time" --bos)
[ -n "$want" ] || { echo "FAIL: no prompt in the reference"; exit 1; }
[ "$got" = "$want" ] || { echo "FAIL: got '$got' want '$want'"; exit 1; }
# without --bos the first id (BOS 1) is absent
got=$("$KVASIR_BIN" tokenize -m "$m/aidreams260K.gguf" -p "Once upon a time")
[ "$got" = "${want#1 }" ] || { echo "FAIL: no-bos got '$got'"; exit 1; }

got=$("$KVASIR_BIN" tokenize -m "$m/qwen3-q8_0.gguf" -p "<|im_start|>x<|im_end|>" --special)
case "$got" in "151644 "*" 151645") ;; *) echo "FAIL: qwen specials got '$got'"; exit 1 ;; esac
got=$("$KVASIR_BIN" tokenize -m "$m/qwen3-q8_0.gguf" -p "<|im_start|>")
case "$got" in *151644*) echo "FAIL: special parsed without --special: '$got'"; exit 1 ;; esac

set +e
"$KVASIR_BIN" tokenize -p x >/dev/null 2>&1; rc=$?
[ $rc -eq 2 ] || { echo "FAIL: missing -m gave rc $rc"; exit 1; }
"$KVASIR_BIN" tokenize -m /nonexistent.gguf -p x >/dev/null 2>&1; rc=$?
[ $rc -eq 1 ] || { echo "FAIL: missing file gave rc $rc"; exit 1; }
echo "ok"

#!/usr/bin/env bash
# The API's address and chat template (issue 10):
#  - serve --host 127.0.0.2 answers on 127.0.0.2 and not on 127.0.0.1 (both loopback);
#    stage --api-host the same for a head's API;
#  - --chat-template llama3 on aidreams260K (no template in its GGUF): the chat's prompt is
#    the Llama 3 markup written by hand (same token count; greedy text equal to the
#    completion of its ids), and the log says so.
set -uo pipefail
BIN=${KVASIR_BIN:?}
M=${KVASIR_SHARED:?}/models/aidreams260K.gguf
command -v curl >/dev/null && command -v python3 >/dev/null || { echo "FAIL: curl/python3 missing (scripts/install-deps.sh)"; exit 1; }
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "== $f"; tail -15 "$f"; done; exit 1; }
# free ports below the ephemeral range
P=()
p=$((21000 + ($$ % 100) * 97))
while [[ ${#P[@]} -lt 3 ]]; do
  (exec 9<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || (exec 9<>"/dev/tcp/127.0.0.2/$p") 2>/dev/null || P+=("$p")
  p=$((p + 1))
done
wait_health() { # host port log
  for _ in $(seq 150); do
    curl -sf "http://$1:$2/health" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  fail "no /health on $1:$2"
}

# --- serve --host, --chat-template -----------------------------------------------------
"$BIN" serve -m "$M" --host 127.0.0.2 --port "${P[0]}" --chat-template llama3 --ctx 128 >"$tmp/serve.log" 2>&1 &
pids+=($!)
wait_health 127.0.0.2 "${P[0]}"
curl -s -o /dev/null --max-time 2 "http://127.0.0.1:${P[0]}/health" && fail "serve --host 127.0.0.2 also answers on 127.0.0.1"
echo "ok: serve --host 127.0.0.2 listens there only"
grep -qF "api: model 'aidreams260K', chat template llama3 (--chat-template)" "$tmp/serve.log" ||
  fail "no chat template line in the log"
# the chat's prompt is the Llama 3 markup (specials absent from this vocabulary: as text,
# no BOS of its own: <|begin_of_text|> is the template's), token for token
markup=$(printf '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nOnce upon a time<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n.')
markup=${markup%.}
ids=$("$BIN" tokenize -m "$M" -p "$markup" 2>/dev/null) || fail "kvasir tokenize"
n_ids=$(wc -w <<<"$ids")
ask() { # route body -> "prompt_tokens<TAB>repr(text)"
  curl -sf --max-time 30 "http://127.0.0.2:${P[0]}$1" -H 'Content-Type: application/json' -d "$2" |
    python3 -c 'import json,sys; r=json.load(sys.stdin); c=r["choices"][0]
print(r["usage"]["prompt_tokens"], repr(c["message"]["content"] if "message" in c else c["text"]), sep="\t")'
}
chat=$(ask /v1/chat/completions '{"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 20, "temperature": 0}') ||
  fail "chat request"
hand=$(ask /v1/completions "{\"prompt\": [${ids// /, }], \"max_tokens\": 20, \"temperature\": 0}") || fail "completion request"
[[ ${chat%%$'\t'*} == "$n_ids" ]] || fail "llama3 chat prompt of ${chat%%$'\t'*} tokens, the markup by hand has $n_ids"
[[ $chat == "$hand" ]] || fail "llama3 chat [$chat] != completion of the markup's ids [$hand]"
echo "ok: --chat-template llama3: [$chat]"

# --- stage --api-host (a one-stage ring's head) ------------------------------------------
"$BIN" stage -m "$M" --window 0:4 --insecure --listen "127.0.0.1:${P[1]}" --api "${P[2]}" --api-host 127.0.0.2 \
  --ctx 128 >"$tmp/stage.log" 2>&1 &
pids+=($!)
wait_health 127.0.0.2 "${P[2]}"
curl -s -o /dev/null --max-time 2 "http://127.0.0.1:${P[2]}/health" && fail "stage --api-host 127.0.0.2 also answers on 127.0.0.1"
echo "ok: stage --api-host 127.0.0.2 listens there only"
echo PASS

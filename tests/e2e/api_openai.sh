#!/usr/bin/env bash
# kvasir serve --ring 2 driven by the official `openai` npm client
# (tests/e2e/api_openai.mjs): greedy completion equals llama.cpp's reference
# continuation (../shared/models/README.md), streamed and not; chat on
# qwen3-q8_0 (ChatML); models.list; 400 as APIError; /metrics counts; a
# client that aborts a stream gets its request cancelled; --api-key-file: the right
# key works, a wrong or missing one gets OpenAI's 401 error object (AuthenticationError),
# /health and /metrics stay open.
# node/npm missing or the client not installable: the test fails (scripts/install-deps.sh installs node).
set -euo pipefail
: "${KVASIR_BIN:?}" "${KVASIR_SHARED:?}" "${KVASIR_SRC:?}"
command -v node >/dev/null && command -v npm >/dev/null || { echo "FAIL: node/npm not found: run scripts/install-deps.sh"; exit 1; }

build=$(cd "$(dirname "$KVASIR_BIN")" && pwd)
npm_dir="$build/npm"
if [ ! -f "$npm_dir/node_modules/openai/package.json" ]; then
    mkdir -p "$npm_dir"
    if ! timeout 180 npm install --silent --no-audit --no-fund --prefix "$npm_dir" openai@4 >"$npm_dir/install.log" 2>&1; then
        echo "FAIL: npm install openai@4 failed:"; tail -5 "$npm_dir/install.log"; exit 1
    fi
fi

tmp=$(mktemp -d)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${pids[@]}"; do
        for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$p" 2>/dev/null || true
    done
    rm -rf "$tmp"
}
trap cleanup EXIT

start() { # name model extra-args...
    local name=$1 model=$2; shift 2
    "$KVASIR_BIN" serve --ring 2 -m "$KVASIR_SHARED/models/$model" --port 0 "$@" >"$tmp/$name.log" 2>&1 &
    pids+=($!)
}
port_of() {
    for _ in $(seq 300); do
        p=$(grep -o 'API on http://[0-9.]*:[0-9]*' "$tmp/$1.log" 2>/dev/null | sed 's/.*://' || true)
        [ -n "$p" ] && { echo "$p"; return 0; }
        sleep 0.1
    done
    echo "no API port for $1:" >&2; cat "$tmp/$1.log" >&2; return 1
}

# A small per-step delay keeps a 100-token stream running long enough to abort.
start tiny aidreams260K.gguf --step-delay 5
start chat qwen3-q8_0.gguf --ctx 256
api_key="sk-kvasir-$$-$RANDOM$RANDOM"
printf '%s\n' "$api_key" >"$tmp/api.key"
start keyed aidreams260K.gguf --api-key-file "$tmp/api.key"
tiny_port=$(port_of tiny)
chat_port=$(port_of chat)
keyed_port=$(port_of keyed)

tiny_child=$(grep -o 'rank 1 (pid [0-9]*)' "$tmp/tiny.log" | grep -o '[0-9]*)' | tr -d ')')

set +e
KVASIR_KEYED_PORT=$keyed_port KVASIR_API_KEY=$api_key KVASIR_TINY_CHILD=$tiny_child NODE_PATH="$npm_dir/node_modules" KVASIR_TINY_PORT=$tiny_port KVASIR_CHAT_PORT=$chat_port \
    timeout 240 node "$KVASIR_SRC/tests/e2e/api_openai.mjs" "$npm_dir/node_modules/openai/index.mjs"
rc=$?
set -e
if [ $rc != 0 ]; then
    echo "--- tiny server log"; tail -30 "$tmp/tiny.log"
    echo "--- chat server log"; tail -30 "$tmp/chat.log"
    echo "--- keyed server log"; tail -30 "$tmp/keyed.log"
    exit 1
fi
grep -q "has no chat template: /v1/chat/completions falls back to ChatML" "$tmp/tiny.log" ||
    { echo "no ChatML fallback line in the log"; exit 1; }
# one log line per request: outcome, tokens, milliseconds
grep -qE 'info: api: cmpl-[^ ]+ /v1/completions 200 length: 13 prompt \+ 60 generated tokens, [0-9.]+ ms$' "$tmp/tiny.log" ||
    { echo "no request line for a completion in the log"; grep 'api:' "$tmp/tiny.log" | head; exit 1; }
grep -qE 'info: api: cmpl-[^ ]+ /v1/completions stream 200 length: 13 prompt \+ 60 generated tokens' "$tmp/tiny.log" ||
    { echo "no request line for a stream in the log"; exit 1; }
grep -qE 'info: api: /v1/completions 400: ' "$tmp/tiny.log" || { echo "no request line for a 400"; exit 1; }
grep -qE 'info: api: cmpl-[^ ]+ /v1/completions stream cancelled: ' "$tmp/tiny.log" ||
    { echo "no request line for a cancelled stream"; exit 1; }
# SIGTERM stops the server and its stage child.
kill "${pids[0]}"
for _ in $(seq 50); do kill -0 "${pids[0]}" 2>/dev/null || break; sleep 0.1; done
if kill -0 "${pids[0]}" 2>/dev/null; then echo "serve did not stop on SIGTERM"; exit 1; fi
grep -q 'shutting down' "$tmp/tiny.log" || { echo "no shutdown message"; exit 1; }
echo "ok"

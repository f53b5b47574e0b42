#!/usr/bin/env bash
# The market's map page (GET /) in a real browser: headless Chromium loads it,
# its script fetches /map and draws every ring as a bar; the test reads the
# drawn windows back from the DOM (div.win data-* attributes) and checks them
# against /map: every claim (node, window) and every gap (window, reward),
# nothing more. A screenshot is saved as a test artifact
# (build/artifacts/market_page.png).
set -uo pipefail
BIN=${KVASIR_BIN:?}; SH=${KVASIR_SHARED:?}
CHROME=$(command -v chromium || command -v chromium-browser || true)
[[ -n $CHROME ]] || { echo "FAIL: chromium is not installed (scripts/install-deps.sh installs it)"; exit 1; }
T=$(mktemp -d)
ART=$(cd "$(dirname "$BIN")" && pwd)/artifacts
mkdir -p "$ART"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; rm -rf "$T"; }
trap cleanup EXIT
fail() { echo "FAIL: $*"; for f in "$T"/*.log; do echo "--- $f"; tail -10 "$f"; done; exit 1; }
mkdir -p "$T/seed"
cp "$SH/models/aidreams260K.gguf" "$SH/models/llama-q4_k_m.gguf" "$T/seed/"
"$BIN" seed "$T/seed" --port 0 --port-file "$T/seed.port" >"$T/seed.log" 2>&1 &
pids+=($!)
"$BIN" market --listen 127.0.0.1:0 --db "$T/m.sqlite" --lease-ms 60000 >"$T/market.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [[ -s $T/seed.port ]] && grep -q "listening on" "$T/market.log" && break; sleep 0.1; done
SEED=http://127.0.0.1:$(cat "$T/seed.port")
MK=http://127.0.0.1:$(grep -o 'listening on http://[0-9.]*:[0-9]*' "$T/market.log" | sed 's/.*://')
"$BIN" market add --market "$MK" --url "$SEED/aidreams260K.gguf" --rings 2 >/dev/null || fail "market add"
"$BIN" market add --market "$MK" --url "$SEED/llama-q4_k_m.gguf" >/dev/null || fail "market add"
claim() { curl -sf "$MK/v1/claims" -d "$1" >"$T/claim.json" || fail "claim $1"; }
claim '{"model":"aidreams260K","ring":0,"begin":0,"end":2,"node":"alpha","endpoint":"127.0.0.1:7001"}'
tok=$(python3 -c "import json; print(json.load(open('$T/claim.json'))['token'])")
id=$(python3 -c "import json; print(json.load(open('$T/claim.json'))['id'])")
curl -sf "$MK/v1/claims/$id/renew" -d "{\"token\":\"$tok\",\"tps\":42.5,\"queued\":3}" >/dev/null || fail renew
claim '{"model":"aidreams260K","ring":0,"begin":3,"end":4,"node":"gamma","endpoint":"127.0.0.1:7003"}'
claim '{"model":"aidreams260K","ring":1,"begin":1,"end":3,"node":"beta","endpoint":"127.0.0.1:7002"}'
claim '{"model":"llama-q4_k_m","ring":0,"begin":0,"end":3,"node":"delta","endpoint":"127.0.0.1:7004"}'

common=(--headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking
        --disable-component-update --disable-sync --disable-dev-shm-usage --virtual-time-budget=4000)
timeout 60 "$CHROME" "${common[@]}" --user-data-dir="$T/chrome1" --dump-dom "$MK/" >"$T/dom.html" 2>"$T/chrome.log" ||
  fail "chromium --dump-dom failed"
curl -sf "$MK/map" >"$T/map.json" || fail "GET /map"
python3 - "$T/dom.html" "$T/map.json" <<'EOF' || fail "the drawn map differs from /map"
import json, sys
from html.parser import HTMLParser
class P(HTMLParser):
    def __init__(s): super().__init__(); s.wins = []; s.drawn = None
    def handle_starttag(s, tag, attrs):
        a = dict(attrs)
        if tag == 'body' and 'data-drawn' in a: s.drawn = a['data-drawn']
        if tag == 'div' and 'win' in (a.get('class') or '').split():
            kind = 'claim' if 'claim' in a['class'].split() else 'gap'
            s.wins.append((a['data-model'], int(a['data-ring']), int(a['data-begin']), int(a['data-end']), kind,
                           a.get('data-node') if kind == 'claim' else round(float(a['data-reward']), 4)))
p = P(); p.feed(open(sys.argv[1]).read())
if not p.drawn: sys.exit('the page never drew the map (no body[data-drawn])')
m = json.load(open(sys.argv[2]))
want = []
for mo in m['models']:
    for r in mo['coverage']:
        for c in r['claims']: want.append((mo['name'], r['ring'], c['begin'], c['end'], 'claim', c['node']))
        for g in r['gaps']: want.append((mo['name'], r['ring'], g['begin'], g['end'], 'gap', round(g['reward'], 4)))
if sorted(p.wins) != sorted(want):
    sys.exit('drawn: %s\nmap:   %s' % (sorted(p.wins), sorted(want)))
# 4 claims and 3 gaps: aidreams ring 0 [2,3), ring 1 [0,1) and [3,4); llama-q4_k_m is covered
if len([w for w in p.wins if w[4] == 'claim']) != 4 or len(p.wins) != 7:
    sys.exit('expected 4 claims and 3 gaps, drew %s' % p.wins)
print('ok: the page drew %d windows, equal to /map: %s' % (len(p.wins), sorted(p.wins)))
EOF
grep -q '42.5 tok/s' "$T/dom.html" || fail "alpha's reported tokens/s is not shown"
# the ledger section is drawn from GET /ledger (empty here: receipts are in test_ledger and market_ring)
[[ $(curl -sf "$MK/ledger") == '{"kvasir_ledger":1,"receipts":0,"nodes":[]}' ]] || fail "GET /ledger: $(curl -s "$MK/ledger")"
grep -q '<div id="ledger"><div class="label">no receipts yet</div></div>' "$T/dom.html" ||
  fail "the page did not draw the ledger"
timeout 60 "$CHROME" "${common[@]}" --user-data-dir="$T/chrome2" --window-size=1100,520 \
  --screenshot="$ART/market_page.png" "$MK/" >/dev/null 2>>"$T/chrome.log" || fail "chromium --screenshot failed"
sig=$(head -c 8 "$ART/market_page.png" | od -An -tx1 | tr -d ' \n')
[[ $sig == 89504e470d0a1a0a ]] || fail "the screenshot is not a PNG"
echo "ok: screenshot $ART/market_page.png ($(stat -c %s "$ART/market_page.png") bytes)"
echo PASS

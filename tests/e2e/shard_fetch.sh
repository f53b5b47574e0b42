#!/usr/bin/env bash
# Window-only shard download over HTTP ranges from `kvasir seed` and from a
# real server (lighttpd): fetched shard == extracted shard, bytes on the wire
# bounded by the window, index verification, errors, resume.
set -euo pipefail
K=${KVASIR_BIN:?KVASIR_BIN unset}
M=${KVASIR_SHARED:?KVASIR_SHARED unset}/models
T=$(mktemp -d /tmp/kvs_shard_fetch.XXXXXX)
PIDS=()
cleanup() {
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# What this test needs is installed by scripts/install-deps.sh: missing, it fails (never skips).
for tool in python3 curl; do command -v "$tool" >/dev/null || fail "$tool is missing: run scripts/install-deps.sh"; done
command -v lighttpd >/dev/null || [[ -x /usr/sbin/lighttpd ]] || fail "lighttpd is missing: run scripts/install-deps.sh"
field() { sed -n "s/.*\\b$1=\\([^ ]*\\).*/\\1/p" <<<"$2"; }

start_seed() { # DIR [flags...] -> sets SEED_PORT, SEED_PID
    local dir=$1; shift
    rm -f "$T/port"
    "$K" seed "$dir" --port 0 --port-file "$T/port" "$@" 2>>"$T/seed.log" &
    SEED_PID=$!; PIDS+=("$SEED_PID")
    for _ in $(seq 100); do [[ -s $T/port ]] && break; sleep 0.05; done
    [[ -s $T/port ]] || fail "seed did not start"
    SEED_PORT=$(cat "$T/port")
}
served() { curl -s "http://127.0.0.1:$1/stats" | sed -n 's/.*"bytes_served":\([0-9]*\).*/\1/p'; }

# ixof MODEL: a local index of a shared model (made once). A shard fetched
# with an index records the model's content id, as an extracted one does: the
# byte comparisons with `shard extract` below fetch with one.
ixof() {
    [[ -s $T/ix-$1.json ]] || "$K" shard index "$M/$1" -o "$T/ix-$1.json" >/dev/null
    echo "$T/ix-$1.json"
}

# fetch URL WINDOW NAME [extra...]: fetch and compare with the extracted shard
check_fetch() {
    local url=$1 win=$2 model=$3; shift 3
    "$K" shard extract -m "$M/$model" --window "$win" -o "$T/ext.gguf"
    local out
    [[ " $* " == *" --index "* ]] || set -- "$@" --index "$(ixof "$model")"
    out=$("$K" shard fetch --url "$url" --window "$win" -o "$T/got.gguf" --progress none "$@") || fail "fetch $url $win"
    cmp "$T/got.gguf" "$T/ext.gguf" || fail "fetched shard of $model $win differs from the extracted one"
    [[ ! -e $T/got.gguf.part && ! -e $T/got.gguf.part.state ]] || fail "work files left behind"
    local hb db wb
    hb=$(field header_bytes "$out"); db=$(field data_bytes "$out"); wb=$(field window_bytes "$out")
    (( db <= wb + wb / 100 )) || fail "$model $win: downloaded $db data bytes for a $wb-byte window"
    LAST_FETCH=$out; LAST_TOTAL=$((hb + db)); LAST_WINDOW=$wb
    echo "ok: $model $win from ${url%%/*/*}..: $out"
}

# ---- kvasir seed ------------------------------------------------------------
start_seed "$M"
MAIN=$SEED_PORT
BASE=http://127.0.0.1:$MAIN
for spec in "llama-q4_k_m.gguf 0:1" "llama-q4_k_m.gguf 1:2" "llama-q4_k_m.gguf 2:3" \
            "qwen3-q8_0.gguf 3:4" "qwen3moe-mixed.gguf 0:3" "llama-mixed.gguf 1:3" "aidreams260K.gguf 0:4"; do
    set -- $spec
    before=$(served "$MAIN")
    check_fetch "$BASE/$1" "$2" "$1"
    after=$(served "$MAIN")
    (( after - before == LAST_TOTAL )) || fail "seed served $((after - before)) bytes, fetch counted $LAST_TOTAL"
    (( after - before <= LAST_WINDOW + LAST_WINDOW / 100 + $(field header_bytes "$LAST_FETCH") )) || fail "too many bytes"
done

# the fetched full-window shard (aidreams260K 0:4, the last one above) runs like the source
a=$("$K" run -m "$M/aidreams260K.gguf" -p "Once upon a time" --temp 0 -n 24 --threads 1 2>/dev/null)
b=$("$K" run -m "$T/got.gguf" -p "Once upon a time" --temp 0 -n 24 --threads 1 2>/dev/null)
[[ -n $a && $a == "$b" ]] || fail "shard generates '$b', source '$a'"
echo "ok: kvasir run on the fetched shard: '$b'"

# a two-stage ring whose stages hold only fetched shards generates like a ring over the full file
freeport() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
. "$(dirname "$0")/tools/ring_keys.sh"
ring() { # HEAD_MODEL TAIL_MODEL -> generated text
    local p0 p1 tp out
    ring_keys "$T" 2
    p0=$(freeport); p1=$(freeport)
    "$K" stage -m "$2" --window 1:3 $(key_args "$T" 1 2) --listen "127.0.0.1:$p1" --next "127.0.0.1:$p0" 2>>"$T/ring.log" & tp=$!
    PIDS+=("$tp")
    out=$(timeout 60 "$K" stage -m "$1" --window 0:1 $(key_args "$T" 0 2) --listen "127.0.0.1:$p0" --next "127.0.0.1:$p1" \
        -p "Hello world" -n 12 --temp 0 --threads 1 2>>"$T/ring.log") || true
    kill "$tp" 2>/dev/null || true; wait "$tp" 2>/dev/null || true
    printf '%s' "$out"
}
if true; then # (python3 and lighttpd are required: checked at the top)
    "$K" shard fetch --url "$BASE/llama-q4_k_m.gguf" --window 0:1 -o "$T/h.gguf" --progress none >/dev/null
    "$K" shard fetch --url "$BASE/llama-q4_k_m.gguf" --window 1:3 -o "$T/t.gguf" --progress none >/dev/null
    a=$(ring "$M/llama-q4_k_m.gguf" "$M/llama-q4_k_m.gguf")
    b=$(ring "$T/h.gguf" "$T/t.gguf")
    [[ -n $a && $a == "$b" ]] || fail "ring over shards generated '$b', over the full file '$a' (log: $(tail -5 "$T/ring.log"))"
    echo "ok: ring over fetched shards [0,1) + [1,3) == ring over the full file: '$b'"
fi

# index: hash verified; a corrupted entry -> hash error, no output file
"$K" shard index "$M/llama-q2_k.gguf" -o "$T/q2.kvindex.json"
check_fetch "$BASE/llama-q2_k.gguf" 1:3 llama-q2_k.gguf --index "$T/q2.kvindex.json"
[[ $(field verified "$LAST_FETCH") == yes ]] || fail "index given but not verified"
python3 - "$T/q2.kvindex.json" <<'PY' || sed -i '0,/"sha256": "\(.\)/s//"sha256": "\1x/' "$T/q2.kvindex.json"
import json, sys
p = sys.argv[1]; ix = json.load(open(p))
t = next(t for t in ix["tensors"] if t["name"] == "blk.1.ffn_up.weight")
t["sha256"] = ("0" if t["sha256"][0] != "0" else "1") + t["sha256"][1:]
ix.pop("content_id")  # (kept, it would no longer match: the parser refuses such an index outright)
json.dump(ix, open(p, "w"))
PY
rm -f "$T/got.gguf"
if "$K" shard fetch --url "$BASE/llama-q2_k.gguf" --window 1:3 -o "$T/got.gguf" --index "$T/q2.kvindex.json" \
        --progress none 2>"$T/err"; then fail "corrupted index accepted"; fi
grep -q "SHA-256" "$T/err" || fail "no hash error: $(cat "$T/err")"
[[ ! -e $T/got.gguf ]] || fail "output file left after a hash error"
echo "ok: corrupted index -> $(cat "$T/err")"
# an index of another model
if "$K" shard fetch --url "$BASE/qwen2-mixed.gguf" --window 0:1 -o "$T/got.gguf" --progress none \
        --index "$T/q2.kvindex.json" 2>"$T/err"; then fail "index of another model accepted"; fi
grep -q "another file" "$T/err" || fail "unclear error: $(cat "$T/err")"
[[ ! -e $T/got.gguf ]] || fail "output file left"
echo "ok: wrong index -> $(cat "$T/err")"
rm -f "$T"/got.gguf.part*

# server without range support -> clear error, no file
start_seed "$M" --no-ranges
NR=$SEED_PORT
if "$K" shard fetch --url "http://127.0.0.1:$NR/llama-f32.gguf" --window 0:1 -o "$T/got.gguf" --progress none \
        2>"$T/err"; then fail "no-range server accepted"; fi
grep -q "ignored the Range" "$T/err" || fail "unclear error: $(cat "$T/err")"
[[ ! -e $T/got.gguf ]] || fail "output file left"
echo "ok: no ranges -> $(cat "$T/err")"
# the fetch hangs up at the first body bytes: at most the socket buffers' worth of the 37 MB file moved
(( $(served "$NR") < 16 * 1048576 )) || fail "fetch kept downloading a 200 response"
rm -f "$T"/got.gguf.part*

# resume: kill a rate-limited fetch part-way, rerun fetches only the rest
"$K" shard extract -m "$M/llama-f32.gguf" --window 0:4 -o "$T/ext.gguf"
before=$(served "$MAIN")
IXF=$(ixof llama-f32.gguf)
"$K" shard fetch --url "$BASE/llama-f32.gguf" --window 0:4 -o "$T/got.gguf" --limit-rate 8000000 --index "$IXF" \
    --progress lines 2>"$T/first.log" &
FP=$!; PIDS+=("$FP")
# interrupt once the state file records a finished tensor (token_embd, 16 MB, ~2 s in)
for _ in $(seq 300); do grep -q '"done":{"' "$T/got.gguf.part.state" 2>/dev/null && break; sleep 0.05; done
kill "$FP" 2>/dev/null || fail "the rate-limited fetch finished before it could be interrupted"
wait "$FP" 2>/dev/null || true
[[ ! -e $T/got.gguf && -e $T/got.gguf.part.state ]] || fail "interrupted fetch left no resumable state"
mid=$(served "$MAIN")
out=$("$K" shard fetch --url "$BASE/llama-f32.gguf" --window 0:4 -o "$T/got.gguf" --progress none --index "$IXF")
cmp "$T/got.gguf" "$T/ext.gguf" || fail "resumed shard differs"
after=$(served "$MAIN")
db=$(field data_bytes "$out"); wb=$(field window_bytes "$out"); sk=$(field skipped_bytes "$out")
(( $(field resumed "$out") > 0 && sk > 0 )) || fail "rerun did not resume: $out"
hr=$(field header_reused_bytes "$out")
(( db + sk + hr >= wb && db + sk + hr <= wb + wb / 100 )) || fail "rerun: data $db + skipped $sk + reused $hr != window $wb"
(( after - mid == db + $(field header_bytes "$out") )) || fail "rerun moved $((after - mid)) bytes, expected $db + header"
(( after - before <= wb + wb / 100 + 3 * 1048576 + 8 * 1048576 )) || fail "resume moved $((after - before)) bytes in all"
echo "ok: resume: first run $((mid - before)) bytes, rerun $((after - mid)) bytes ($out)"
# a finished fetch run again moves no tensor data (only the header read);
# a damaged output is fetched anew.
out=$("$K" shard fetch --url "$BASE/llama-f32.gguf" --window 0:4 -o "$T/got.gguf" --progress none --index "$IXF")
again=$(served "$MAIN")
(( $(field data_bytes "$out") == 0 && $(field skipped_bytes "$out") == wb )) || fail "rerun of a done fetch: $out"
(( again - after == $(field header_bytes "$out") )) || fail "rerun of a done fetch moved $((again - after)) bytes"
cmp "$T/got.gguf" "$T/ext.gguf" || fail "rerun of a done fetch changed the file"
printf 'X' | dd of="$T/got.gguf" bs=1 seek=$(( $(stat -c %s "$T/got.gguf") - 100 )) conv=notrunc status=none
out=$("$K" shard fetch --url "$BASE/llama-f32.gguf" --window 0:4 -o "$T/got.gguf" --progress none --index "$IXF")
(( $(field data_bytes "$out") >= wb )) || fail "a damaged output was not fetched again: $out"
cmp "$T/got.gguf" "$T/ext.gguf" || fail "re-fetched shard differs"
# same-size damage to the metadata (rope.freq_base := 1.0) is caught too
python3 - "$T/got.gguf" <<'PY'
import struct, sys
p = sys.argv[1]; b = bytearray(open(p, 'rb').read())
k = b.find(b'rope.freq_base'); assert k > 0
off = k + len(b'rope.freq_base') + 4  # after the key: u32 type, then the f32 value
b[off:off + 4] = struct.pack('<f', 1.0); open(p, 'wb').write(b)
PY
cmp -s "$T/got.gguf" "$T/ext.gguf" && fail "the metadata edit changed nothing"
out=$("$K" shard fetch --url "$BASE/llama-f32.gguf" --window 0:4 -o "$T/got.gguf" --progress none --index "$IXF")
(( $(field data_bytes "$out") >= wb )) || fail "a shard with edited metadata was taken as complete: $out"
cmp "$T/got.gguf" "$T/ext.gguf" || fail "re-fetched shard (after a metadata edit) differs"
echo "ok: rerun of a finished fetch: data_bytes 0; a damaged output (data or metadata) is fetched again"

# source changes mid-fetch (ETag) -> error, no file
mkdir -p "$T/src"
cp "$M/llama-q4_k_m.gguf" "$T/src/m.gguf"
start_seed "$T/src"
rm -f "$T"/got.gguf*
# a small first header read: the header then takes ~9 requests at 300 kB/s, one of which sees the new ETag
"$K" shard fetch --url "http://127.0.0.1:$SEED_PORT/m.gguf" --window 0:3 -o "$T/got.gguf" --limit-rate 300000 \
    --header-bytes 4096 --progress none 2>"$T/err" &
FP=$!; PIDS+=("$FP")
# change the file once the first header bytes went out (the header needs ~2 s more)
for _ in $(seq 200); do (( $(served "$SEED_PORT") > 0 )) && break; sleep 0.02; done
touch -d '2001-01-01' "$T/src/m.gguf"
if wait "$FP"; then fail "fetch survived a changed source"; fi
grep -q "changed during the fetch" "$T/err" || fail "unclear error: $(cat "$T/err")"
[[ ! -e $T/got.gguf ]] || fail "output file left"
echo "ok: changed source -> $(cat "$T/err")"

# truncated responses (a server that closes early), if python3 is here
if true; then
    cat >"$T/short.py" <<'PY'
import http.server, os, re, sys
path = sys.argv[1]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.path.endswith(".kvindex.json"):  # no index here (the fetch looks for one by default)
            self.send_error(404)
            return
        size = os.path.getsize(path)
        a, b = map(int, re.match(r"bytes=(\d+)-(\d+)", self.headers["Range"]).groups())
        b = min(b, size - 1)
        self.send_response(206)
        self.send_header("Content-Range", "bytes %d-%d/%d" % (a, b, size))
        self.send_header("Content-Length", str(b - a + 1))
        self.send_header("ETag", '"x"')
        self.end_headers()
        with open(path, "rb") as f:
            f.seek(a)
            n = b - a + 1
            self.wfile.write(f.read(n if a == 0 else n // 2))  # data ranges: half, then close
        self.close_connection = True
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", 0), H)
open(sys.argv[2], "w").write(str(s.server_address[1]))
s.serve_forever()
PY
    rm -f "$T/pyport" "$T"/got.gguf*
    python3 "$T/short.py" "$M/llama-q4_k_m.gguf" "$T/pyport" & PY=$!; PIDS+=("$PY")
    for _ in $(seq 100); do [[ -s $T/pyport ]] && break; sleep 0.05; done
    if "$K" shard fetch --url "http://127.0.0.1:$(cat "$T/pyport")/m.gguf" --window 1:2 -o "$T/got.gguf" \
            --progress none 2>"$T/err"; then fail "truncated response accepted"; fi
    grep -qi "ended early\|truncated" "$T/err" || fail "unclear error: $(cat "$T/err")"
    [[ ! -e $T/got.gguf ]] || fail "output file left"
    echo "ok: truncated -> $(cat "$T/err")"
fi

# ---- lighttpd -------------------------------------------------------------------
LIGHTTPD=$(command -v lighttpd || echo /usr/sbin/lighttpd)
LP=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null ||
     echo $((20000 + RANDOM % 20000)))
cat >"$T/lighttpd.conf" <<CONF
server.document-root = "$M"
server.bind = "127.0.0.1"
server.port = $LP
server.errorlog = "$T/lighttpd.err"
server.modules = ( "mod_accesslog" )
accesslog.filename = "$T/access.log"
accesslog.format = "%s %b %r"
mimetype.assign = ( ".gguf" => "application/octet-stream" )
CONF
"$LIGHTTPD" -D -f "$T/lighttpd.conf" & LPID=$!; PIDS+=("$LPID")
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$LP/" && break; sleep 0.05; done
SUM_TOTAL=0; SUM_BOUND=0
for spec in "llama-q4_k_m.gguf 1:2" "qwen3-q8_0.gguf 0:2" "qwen2-mixed.gguf 2:3" "llama-q5_k_m.gguf 0:3"; do
    set -- $spec
    check_fetch "http://127.0.0.1:$LP/$1" "$2" "$1"
    SUM_TOTAL=$((SUM_TOTAL + LAST_TOTAL))
    SUM_BOUND=$((SUM_BOUND + LAST_WINDOW + LAST_WINDOW / 100 + $(field header_bytes "$LAST_FETCH")))
done
# lighttpd buffers its access log until it stops
kill "$LPID"; wait "$LPID" 2>/dev/null || true
bytes=$(awk '$1 == 206 { s += $2 } END { print s + 0 }' "$T/access.log")
(( $(awk '$1 != 206 && $4 ~ /\.gguf$/' "$T/access.log" | wc -l) == 0 )) || fail "lighttpd answered non-206: $(cat "$T/access.log")"
(( bytes == SUM_TOTAL )) || fail "lighttpd sent $bytes bytes, fetch counted $SUM_TOTAL"
(( bytes <= SUM_BOUND )) || fail "lighttpd sent $bytes bytes, more than windows + headers + 1% ($SUM_BOUND)"
echo "ok: lighttpd sent $bytes bytes for 4 windows (bound $SUM_BOUND)"
# --index auto: MODEL.gguf.kvindex.json beside the model on the seed server is
# used (verified=yes); without one the fetch goes on unverified (verified=no).
mkdir -p "$T/auto"
cp "$M/llama-q4_k_m.gguf" "$T/auto/m.gguf"
start_seed "$T/auto"
AU="http://127.0.0.1:$SEED_PORT/m.gguf"
out=$("$K" shard fetch --url "$AU" --window 1:3 -o "$T/auto1.gguf" --index auto --progress none 2>"$T/auto.err") ||
    fail "--index auto without an index: $(cat "$T/auto.err")"
[[ $(field verified "$out") == no ]] || fail "--index auto without an index: $out"
grep -q 'no index at .*m.gguf.kvindex.json' "$T/auto.err" || fail "--index auto: no log line: $(cat "$T/auto.err")"
"$K" shard index "$T/auto/m.gguf" -o "$T/auto/m.gguf.kvindex.json"
out=$("$K" shard fetch --url "$AU" --window 1:3 -o "$T/auto2.gguf" --index auto --progress none)
[[ $(field verified "$out") == yes ]] || fail "--index auto with the index served: $out"
"$K" shard extract -m "$T/auto/m.gguf" --window 1:3 -o "$T/auto-ext.gguf"
cmp "$T/auto2.gguf" "$T/auto-ext.gguf" || fail "--index auto shard differs from the extracted one"
! grep -q kvasir.shard.source_content_id "$T/auto1.gguf" || fail "an unverified shard records a content id"
grep -q kvasir.shard.source_content_id "$T/auto2.gguf" || fail "a verified shard records no content id"
echo "ok: --index auto: unverified without an index, verified with the seed's"
echo "PASS"

#!/usr/bin/env python3
"""Streaming client for tests/e2e/ring_replay.sh and bench/soak_replay.sh.

Runs N streaming /v1/completions requests at once against `kvasir serve`
(half greedy, half temperature 0.8 with a seed each), optionally disturbs a
stage of the ring once every stream is under way, and prints one JSON line
per request: {"i", "text", "chunks", "finish", "error", "gap_ms"} where
gap_ms is the longest wait between two chunks of that stream (the pause).

Disturbances (--act): none | kill (SIGKILL rank --rank) | kill2 (SIGKILL, then
SIGKILL the restarted process as soon as the head logs that the ring is whole
again, i.e. while the replay runs) | term (SIGTERM) | term2 (SIGTERM, then a
second SIGTERM as soon as the supervisor logs the replacement of the planned
leave: the stage stops at once, without handing over). The rank's pid is read
from serve's log (--log): "rank R (pid P)" at start, "rank R restarted (pid P"
after a restart.
"""
import argparse
import http.client
import json
import os
import re
import signal
import sys
import threading
import time

PROMPTS = ["Once upon a time", "The little robot", "In the garden", "A kaleidoscope of",
           "Pixels unfolding", "The sky was", "Classifications unfold", "Deep in the forest"]


def stream_one(port, i, n, max_tokens, out, started):
    body = {"model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True}
    if i < (n + 1) // 2:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        body["seed"] = 1000 + i
    r = {"i": i, "text": "", "chunks": 0, "finish": None, "error": None, "gap_ms": 0.0}
    out[i] = r
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            r["error"] = "HTTP %d: %s" % (resp.status, resp.read()[:300].decode("utf-8", "replace"))
            return
        last = None
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                r["error"] = json.dumps(ev["error"])[:300]
                break
            now = time.monotonic()
            if last is not None:
                r["gap_ms"] = max(r["gap_ms"], (now - last) * 1000.0)
            last = now
            ch = ev["choices"][0]
            if ch.get("text"):
                r["text"] += ch["text"]
                r["chunks"] += 1
                if r["chunks"] == 3:
                    started.release()
            if ch.get("finish_reason"):
                r["finish"] = ch["finish_reason"]
    except Exception as e:  # a broken connection is a lost request: reported, never hidden
        r["error"] = "client: %r" % (e,)
    finally:
        started.release()


def log_text(path):
    with open(path, "r", errors="replace") as f:
        return f.read()


def rank_pid(path, rank):
    txt = log_text(path)
    pids = re.findall(r"rank %d restarted \(pid (\d+)" % rank, txt)
    if pids:
        return int(pids[-1])
    m = re.search(r"rank %d \(pid (\d+)\)" % rank, txt)
    return int(m.group(1)) if m else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--act", default="none", choices=["none", "kill", "kill2", "term", "term2"])
    ap.add_argument("--rank", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=90.0)
    a = ap.parse_args()
    out = [None] * a.n
    started = threading.Semaphore(0)
    th = [threading.Thread(target=stream_one, args=(a.port, i, a.n, a.max_tokens, out, started), daemon=True)
          for i in range(a.n)]
    for t in th:
        t.start()
    for _ in range(a.n):  # every stream has 3 chunks (or ended)
        started.acquire(timeout=a.timeout)
    if a.act != "none":
        pid = rank_pid(a.log, a.rank)
        if pid <= 0:
            print("no pid for rank %d in %s" % (a.rank, a.log), file=sys.stderr)
            sys.exit(1)
        wholes = log_text(a.log).count("ring whole again")
        leaves = log_text(a.log).count("leaves on purpose")
        os.kill(pid, signal.SIGTERM if a.act.startswith("term") else signal.SIGKILL)
        print("act: %s rank %d pid %d" % (a.act, a.rank, pid), file=sys.stderr)
        if a.act == "kill2":
            t0 = time.monotonic()
            while log_text(a.log).count("ring whole again") == wholes and time.monotonic() - t0 < 30:
                time.sleep(0.002)
            pid2 = rank_pid(a.log, a.rank)
            if pid2 <= 0 or pid2 == pid:
                print("no restarted pid for rank %d" % a.rank, file=sys.stderr)
                sys.exit(1)
            os.kill(pid2, signal.SIGKILL)
            print("act: second kill during the replay, pid %d" % pid2, file=sys.stderr)
        if a.act == "term2":
            t0 = time.monotonic()
            while log_text(a.log).count("leaves on purpose") == leaves and time.monotonic() - t0 < 30:
                time.sleep(0.002)
            os.kill(pid, signal.SIGTERM)
            print("act: second SIGTERM while the replacement loads, pid %d" % pid, file=sys.stderr)
    for t in th:
        t.join(timeout=a.timeout)
    for r in out:
        print(json.dumps(r))


if __name__ == "__main__":
    main()

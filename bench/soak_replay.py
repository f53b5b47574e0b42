#!/usr/bin/env python3
"""Soak of hold and replay (issue 13, docs/PROTOCOL.md 5.1): N requests through
`kvasir serve --ring 4` (started here), C in flight, a random stage (rank 1..3)
killed with SIGKILL every K completed requests; the supervisor restarts it and
the head replays. Every request's text is compared with its undisturbed text
(the same request measured first, before any kill). Prints lost / differing
counts, the pauses, and the RSS of the serve process (the head) and of every
stage process over the run.

  python3 bench/soak_replay.py --bin build/kvasir --model ../shared/models/aidreams260K.gguf
      [--requests 2000] [--kill-every 200] [--parallel 8] [--max-tokens 24]

Exit status 0 only if no request was lost or differed and every RSS stayed
within 10% (the head: its RSS after the first kill interval vs the end).
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

PROMPTS = ["Once upon a time", "The little robot", "In the garden", "A kaleidoscope of",
           "Pixels unfolding", "The sky was", "Classifications unfold", "Deep in the forest"]


def variant(j):
    """Request j of the cycle of 16: 8 prompts, greedy or temperature 0.8 with a seed."""
    body = {"model": "m", "prompt": PROMPTS[j % 8], "stream": True}
    if j < 8:
        body["temperature"] = 0
    else:
        body["temperature"] = 0.8
        body["seed"] = 7000 + j
    return body


def one(port, body, timeout=120):
    r = {"text": "", "error": None, "gap_ms": 0.0, "finish": None}
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        c.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = c.getresponse()
        if resp.status != 200:
            r["error"] = "HTTP %d %s" % (resp.status, resp.read()[:200])
            return r
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
            r["text"] += ch.get("text") or ""
            if ch.get("finish_reason"):
                r["finish"] = ch["finish_reason"]
        c.close()
    except Exception as e:
        r["error"] = "client: %r" % (e,)
    return r


def rss_kb(pid):
    try:
        with open("/proc/%d/status" % pid) as f:
            for l in f:
                if l.startswith("VmRSS:"):
                    return int(l.split()[1])
    except OSError:
        pass
    return 0


def children(pid):
    """Child processes of every thread of pid (the supervisor's thread forks the restarted stages)."""
    out = []
    try:
        for t in os.listdir("/proc/%d/task" % pid):
            try:
                with open("/proc/%d/task/%s/children" % (pid, t)) as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
    except OSError:
        pass
    return sorted(set(out))


def healthy(port):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        c.request("GET", "/health")
        return c.getresponse().status == 200
    except Exception:
        return False


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--kill-every", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=20000 + os.getpid() % 12000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-rss-bound", action="store_true",
                    help="print the RSS figures but do not fail on growth (sanitized builds: ASan's "
                         "quarantine keeps freed memory resident, so RSS grows by design)")
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    logf = tempfile.NamedTemporaryFile(prefix="soak-serve-", suffix=".log", delete=False)
    serve = subprocess.Popen([a.bin, "serve", "-m", a.model, "--ring", "4", "--seqs", str(a.parallel),
                              "--port", str(a.port)], stdout=logf, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while not healthy(a.port):
            if serve.poll() is not None or time.monotonic() - t0 > 60:
                print("serve did not start (log %s)" % logf.name)
                return 1
            time.sleep(0.1)
        ref = []
        for j in range(16):
            b = variant(j)
            b["max_tokens"] = a.max_tokens
            r = one(a.port, b)
            if r["error"]:
                print("undisturbed request %d failed: %s" % (j, r["error"]))
                return 1
            ref.append(r["text"])
        lock = threading.Lock()
        state = {"next": 0, "done": 0, "lost": 0, "differ": 0, "kills": 0, "gaps": [], "examples": []}
        rss = {"head": [], "stages": {}}
        next_kill = a.kill_every

        def worker():
            while True:
                with lock:
                    i = state["next"]
                    if i >= a.requests:
                        return
                    state["next"] += 1
                j = i % 16
                b = variant(j)
                b["max_tokens"] = a.max_tokens
                r = one(a.port, b)
                with lock:
                    state["done"] += 1
                    state["gaps"].append(r["gap_ms"])
                    if r["error"] or not r["finish"]:
                        state["lost"] += 1
                        if len(state["examples"]) < 5:
                            state["examples"].append("request %d lost: %s" % (i, r["error"]))
                    elif r["text"] != ref[j]:
                        state["differ"] += 1
                        if len(state["examples"]) < 5:
                            state["examples"].append("request %d differs: %r vs %r" % (i, r["text"], ref[j]))

        t_start = time.monotonic()
        th = [threading.Thread(target=worker, daemon=True) for _ in range(a.parallel)]
        for t in th:
            t.start()
        while any(t.is_alive() for t in th):
            time.sleep(0.05)
            with lock:
                done = state["done"]
            if done >= next_kill and next_kill < a.requests:
                next_kill += a.kill_every
                kids = children(serve.pid)
                rss["head"].append(rss_kb(serve.pid))
                for k in kids:
                    rss["stages"].setdefault(k, []).append(rss_kb(k))
                if kids:
                    victim = rnd.choice(kids)
                    os.kill(victim, signal.SIGKILL)
                    state["kills"] += 1
        wall = time.monotonic() - t_start
        rss["head"].append(rss_kb(serve.pid))
        for k in children(serve.pid):
            rss["stages"].setdefault(k, []).append(rss_kb(k))
        g = sorted(state["gaps"])
        med = g[len(g) // 2] if g else 0
        p99 = g[int(len(g) * 0.99)] if g else 0
        log = open(logf.name, errors="replace").read()
        replays = len(re.findall(r"ring whole again after (\d+) ms", log))
        heals = [int(x) for x in re.findall(r"ring whole again after (\d+) ms", log)]
        print("soak: %d requests (%d in flight, %d tokens each) in %.1f s, %d kills (a random stage every %d "
              "requests), %d restarts, %d replay rounds" % (a.requests, a.parallel, a.max_tokens, wall,
              state["kills"], a.kill_every, log.count("restarted (pid"), replays))
        print("soak: lost %d, differing %d" % (state["lost"], state["differ"]))
        for e in state["examples"]:
            print("  " + e)
        if heals:
            heals.sort()
            print("soak: ring whole again after a kill: median %d ms, max %d ms" % (heals[len(heals) // 2], heals[-1]))
        print("soak: longest gap per stream: median %.0f ms, p99 %.0f ms, max %.0f ms" % (med, p99, g[-1] if g else 0))
        ok = state["lost"] == 0 and state["differ"] == 0
        h = rss["head"]
        if len(h) >= 2:
            base = h[1] if len(h) > 2 else h[0]
            growth = (h[-1] - base) / base * 100 if base else 0
            print("soak: head (serve) RSS %d kB after the first %d requests, %d kB at the end (%+.1f%%)"
                  % (base, a.kill_every, h[-1], growth))
            ok = ok and (a.no_rss_bound or abs(growth) <= 10)
        for k, v in sorted(rss["stages"].items()):
            if len(v) >= 2:
                gr = (v[-1] - v[0]) / v[0] * 100 if v[0] else 0
                print("soak: stage pid %d RSS %d kB -> %d kB over %d samples (%+.1f%%)" % (k, v[0], v[-1], len(v), gr))
                ok = ok and (a.no_rss_bound or abs(gr) <= 10)
        print("soak: %s (serve log %s)" % ("PASS" if ok else "FAIL", logf.name))
        return 0 if ok else 1
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=10)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


if __name__ == "__main__":
    sys.exit(main())

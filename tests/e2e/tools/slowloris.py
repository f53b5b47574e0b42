#!/usr/bin/env python3
"""Attacks on the HTTP API's door (issue 9), each checked against what the
server must do. Usage: slowloris.py PORT REQUEST_TIMEOUT_S MAX_PER_ADDR.
Every socket stays on loopback: clients bind source addresses in 127.0.0.0/8
(all of it is loopback on Linux) so that the per-address limit can be told
apart from the total one. Prints one line per check; exit 1 on the first
failure."""
import json
import socket
import sys
import threading
import time

PORT = int(sys.argv[1])
DEADLINE = float(sys.argv[2])
PER_ADDR = int(sys.argv[3])
PROMPT = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}


def fail(msg):
    print("FAIL: " + msg, flush=True)
    sys.exit(1)


def connect(src):
    s = socket.socket()
    s.settimeout(5)
    s.bind((src, 0))
    s.connect(("127.0.0.1", PORT))
    return s


def read_response(s, limit=10.0):
    """The whole response (the server closes or Content-Length / [DONE])."""
    s.settimeout(limit)
    buf = b""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            d = s.recv(65536)
        except socket.timeout:
            break
        if not d:
            break
        buf += d
        head, sep, body = buf.partition(b"\r\n\r\n")
        if sep:
            if b"text/event-stream" in head and b"data: [DONE]" in body:
                break
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:") and len(body) >= int(line.split(b":")[1]):
                    return buf
    return buf


def request(src, body=PROMPT, stream=False):
    b = dict(body)
    if stream:
        b["stream"] = True
    data = json.dumps(b).encode()
    s = connect(src)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    r = read_response(s, 20.0)
    s.close()
    return r


def status(resp):
    try:
        return int(resp.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0


class Loris:
    """n sockets from the given source addresses, each sending a request head
    one byte at a time every `every` seconds; a socket the server closes is
    opened again at once (an attacker that keeps coming back)."""

    def __init__(self, n, srcs, every):
        self.n, self.srcs, self.every = n, srcs, every
        self.stop = False
        self.closed = 0
        self.refused = 0
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(i,), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def run(self, i):
        src = self.srcs[i % len(self.srcs)]
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100000
        while not self.stop:
            try:
                s = connect(src)
                s.settimeout(self.every)
                for k in range(len(head)):
                    if self.stop:
                        break
                    s.sendall(head[k:k + 1])
                    try:
                        d = s.recv(4096)
                    except socket.timeout:
                        continue
                    with self.lock:
                        if d.startswith(b"HTTP/1.1 503"):
                            self.refused += 1
                        else:
                            self.closed += 1
                    break
                s.close()
            except OSError:
                with self.lock:
                    self.closed += 1
                time.sleep(0.05)

    def end(self):
        self.stop = True
        for t in self.threads:
            t.join(10)


# 1. The whole-request deadline: one header byte every 0.5 s never trips an
#    idle timeout; the server must close the socket DEADLINE s after accept.
s = connect("127.0.0.2")
s.settimeout(0.5)
t0 = time.monotonic()
closed_after = None
head = b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 1000
for k in range(int(DEADLINE * 2 + 12)):
    try:
        s.sendall(head[k:k + 1])
        d = s.recv(4096)
        if not d:
            closed_after = time.monotonic() - t0
            break
    except socket.timeout:
        continue
    except OSError:
        closed_after = time.monotonic() - t0
        break
s.close()
if closed_after is None or not (DEADLINE - 0.5 <= closed_after <= DEADLINE + 2.0):
    fail("a slow sender was not closed at the %.0f s request deadline (closed after %s s)" % (DEADLINE, closed_after))
print("deadline: a slow sender closed after %.1f s (deadline %.0f s)" % (closed_after, DEADLINE), flush=True)

# 2. The per-address limit: PER_ADDR + 4 idle connections from one address;
#    the ones past the limit are answered 503 at once.
held = [connect("127.0.0.3") for _ in range(PER_ADDR)]
time.sleep(0.3)
extra = [connect("127.0.0.3") for _ in range(4)]
for e in extra:
    r = read_response(e, 5.0)
    if status(r) != 503 or b'"too_many_connections"' not in r:
        fail("connection past the per-address limit got %r" % r[:200])
    e.close()
r = request("127.0.0.4")
if status(r) != 200:
    fail("another address was refused while one address was at its limit: %r" % r[:200])
for h in held:
    h.close()
print("per-address limit: %d held, 4 more answered 503, another address served" % PER_ADDR, flush=True)

# 3. 80 slowloris sockets from 5 addresses (16 each) held against the API
#    (more than its 64 slots): a legitimate client's requests still complete.
loris = Loris(80, ["127.0.0.%d" % i for i in range(10, 15)], 1.0)
time.sleep(2.5)
ok = 0
t0 = time.monotonic()
for k in range(5):
    r = request("127.0.0.20")
    if status(r) == 200 and b'"text"' in r:
        ok += 1
    else:
        loris.end()
        fail("a legitimate request during the slowloris got %r" % r[:300])
dt = time.monotonic() - t0
loris.end()
print("slowloris (80 sockets, 5 addresses): %d/5 legitimate requests served in %.1f s; "
      "%d loris sockets closed by the server, %d answered 503" % (ok, dt, loris.closed, loris.refused), flush=True)
time.sleep(0.5)

# 4. 200 concurrent streams (from 13 addresses): each gets a whole stream or a
#    503 answer; none is reset or left without an HTTP answer.
results = [None] * 200


def stream(i):
    try:
        results[i] = request("127.0.0.%d" % (30 + i % 13), stream=True)
    except OSError as ex:
        results[i] = ("error", str(ex))


ts = [threading.Thread(target=stream, args=(i,)) for i in range(200)]
for t in ts:
    t.start()
for t in ts:
    t.join(60)
done = refused = 0
for r in results:
    if isinstance(r, bytes) and status(r) == 200 and b"data: [DONE]" in r:
        done += 1
    elif isinstance(r, bytes) and status(r) == 503 and b'"error"' in r:
        refused += 1
    else:
        fail("a concurrent stream got neither a whole stream nor a 503: %r" % (r[:200] if isinstance(r, bytes) else r,))
print("200 concurrent streams: %d whole streams, %d answered 503, 0 reset" % (done, refused), flush=True)
if done < 1:
    fail("no stream was served")

"""Plays the rest of a ring behind a real head stage (docs/PROTOCOL.md frames):
listens where the head dials its successor, answers its HELLO as the window
after the head's, dials the head as its predecessor, echoes probes, and
answers each PREFILL / DECODE with TOKEN frames chosen by MODE:
  dup   - every TOKEN sent twice (a duplicate at the same position)
  pos   - the first TOKEN at a wrong position
  long  - never sets a finish reason (the head must stop at max_tokens)
  trail - as long, and every odd-numbered probe's trail gets a forged record
          (timestamps near 2^63 us: the head must check them before arithmetic)
  ghost - once a request started: no probe goes round any more and no token
          for it comes, only TOKENs for a request id the head never sent (the
          head must not take them as progress: its stall timer fails the request)
usage: fake_tail.py MODEL LISTEN_PORT HEAD_PORT MODE N_BLOCK N_EMBD N_CTX N_SEQ WIN_BEGIN
(runs until the head closes the link or 30 s pass)."""
import binascii, socket, struct, subprocess, sys, time

MAGIC = b'KVSR'
KVASIR = subprocess.os.environ.get('KVASIR_BIN', 'kvasir')


def frame(kind, payload=b'', flags=0, req=0, pos=0, n=0):
    return MAGIC + struct.pack('<HBBIIII', 3, kind, flags, req, pos, n, len(payload)) + payload


def parse(buf):
    out = []
    while len(buf) >= 24 and buf[:4] == MAGIC:
        _, kind, fl, req, pos, n, pl = struct.unpack_from('<HBBIIII', buf, 4)
        if len(buf) < 24 + pl:
            break
        out.append((kind, fl, req, pos, n, buf[24:24 + pl]))
        buf = buf[24 + pl:]
    return out, buf


def token(req, pos, tok, finish=0):
    return frame(5, struct.pack('<iI', tok, finish), flags=0x10 if finish else 0, req=req, pos=pos, n=1)


def main():
    model, lport, hport, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    nblock, nembd, nctx, nseq, wb = (int(x) for x in sys.argv[5:10])
    info = subprocess.run([KVASIR, 'gguf', 'info', model], capture_output=True, text=True).stdout
    fp = next(binascii.unhexlify(l.split()[1]) for l in info.splitlines() if l.startswith('fingerprint:'))
    hello = lambda role: frame(1, fp + struct.pack('<8I', nblock, wb, nblock, nembd, role, nctx, nseq, 512) + bytes(32))
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(('127.0.0.1', lport))
    ls.listen(4)
    ls.settimeout(20)
    succ, _ = ls.accept()  # the head dials its successor: us
    succ.recv(4096)
    succ.sendall(hello(2))  # role 2: we are its successor
    pred = socket.create_connection(('127.0.0.1', hport), timeout=5)
    pred.sendall(hello(1))  # role 1: we are its predecessor
    buf, sent, deadline, started = b'', 0, time.time() + 30, 0
    succ.settimeout(0.2)
    while time.time() < deadline:
        try:
            d = succ.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not d:
            break
        frames, buf = parse(buf + d)
        for kind, fl, req, pos, n, pl in frames:
            if kind == 9 and fl & 4:  # probe: send it on round the ring
                if mode == 'ghost' and started:
                    pred.sendall(token(started + 1000, 1, 66))
                    continue
                if mode == 'trail' and fl & 0x20 and pos % 2:
                    rec = struct.pack('<IIQQQQQQ', wb, nblock, 1, 2, 3, 4, 1, (1 << 63) + 12345)
                    pl, n = pl + rec, n + 1
                pred.sendall(frame(9, pl, flags=fl, pos=pos, n=n))
                continue
            if mode == 'ghost' and kind == 2:  # REQUEST_START
                started = req
            if mode == 'ghost' and started:
                continue
            rows = []
            if kind == 3 and fl & 2:  # the last PREFILL chunk: the next token sits after it
                rows = [(req, pos + n)]
            elif kind == 4:  # DECODE: n rows of (req, pos)
                rows = [struct.unpack_from('<II', pl, 8 * i) for i in range(n)]
                rows = [(r, p + 1) for r, p in rows]
            for r, p in rows:
                sent += 1
                if mode == 'dup':
                    pred.sendall(token(r, p, 66) + token(r, p, 66))
                elif mode == 'pos':
                    pred.sendall(token(r, p + 3, 66))
                else:
                    pred.sendall(token(r, p, 66))
    pred.close()
    succ.close()


main()

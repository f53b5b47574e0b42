"""An outsider attacking a ring (tests/e2e/trust_attack.sh). It knows what
anyone can know: the public GGUF (its fingerprint, via `kvasir gguf info`, and
its shape) and the stages' addresses. It holds no node key of the ring; for
TLS it makes its own (an Ed25519 certificate, as a stage would).

  attacker.py tail MODEL LISTEN_PORT HEAD_PORT WIN_BEGIN N_BLOCK N_EMBD N_CTX N_SEQ TOKENS TLS
      poses as the tail: listens on the tail's address (where the stage before
      it dials), answers its HELLO, dials the head as its predecessor, passes
      probes on, reads the boundary of every PREFILL (the user's prompt) and
      answers with TOKEN frames of its choice (TOKENS: comma-separated ids).
  attacker.py pred MODEL PORT WIN_BEGIN WIN_END N_BLOCK N_EMBD N_CTX N_SEQ TLS
      poses as a stage's predecessor: dials it, sends HELLO, then a
      REQUEST_START and a PREFILL of its own (bytes for the model).
  attacker.py record LISTEN_PORT TARGET_PORT FILE
      an on-path recorder: forwards a link both ways, writes what the dialer
      sent to FILE.
  attacker.py replay PORT FILE
      replays a recorded dialer's bytes to PORT and reports what came back.

TLS is 1 (speak TLS 1.3 with the attacker's own certificate) or 0 (plaintext
frames). Each prints RESULT lines for the test; it runs at most ~20 s."""
import binascii, os, select, socket, ssl, struct, subprocess, sys, tempfile, time

MAGIC = b'KVSR'
KVASIR = os.environ.get('KVASIR_BIN', 'kvasir')
VERSION = 3


def frame(kind, payload=b'', flags=0, req=0, pos=0, n=0):
    return MAGIC + struct.pack('<HBBIIII', VERSION, kind, flags, req, pos, n, len(payload)) + payload


def parse(buf):
    out = []
    while len(buf) >= 24 and buf[:4] == MAGIC:
        _, kind, fl, req, pos, n, pl = struct.unpack_from('<HBBIIII', buf, 4)
        if len(buf) < 24 + pl:
            break
        out.append((kind, fl, req, pos, n, buf[24:24 + pl]))
        buf = buf[24 + pl:]
    return out, buf


def result(**kv):
    print('RESULT ' + ' '.join('%s=%s' % (k, str(v).replace(' ', '_')) for k, v in kv.items()), flush=True)


def fingerprint(model):
    info = subprocess.run([KVASIR, 'gguf', 'info', model], capture_output=True, text=True).stdout
    return next(binascii.unhexlify(l.split()[1]) for l in info.splitlines() if l.startswith('fingerprint:'))


def hello(fp, role, nblock, wb, we, nembd, nctx, nseq):
    return frame(1, fp + struct.pack('<8I', nblock, wb, we, nembd, role, nctx, nseq, 512) + bytes(32))


_cert = None


def own_cert():
    """The attacker's own Ed25519 key and self-signed certificate (PEM files)."""
    global _cert
    if _cert is None:
        d = tempfile.mkdtemp()
        k, c = os.path.join(d, 'k.pem'), os.path.join(d, 'c.pem')
        subprocess.run(['openssl', 'req', '-x509', '-newkey', 'ed25519', '-nodes', '-keyout', k, '-out', c,
                        '-days', '2', '-subj', '/CN=attacker'], check=True, capture_output=True)
        _cert = (c, k)
    return _cert


def tls_ctx(server):
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_OPTIONAL if server else ssl.CERT_NONE
    if server:  # accept whatever client certificate comes (no CA to check it against)
        ctx.verify_mode = ssl.CERT_NONE
    ctx.load_cert_chain(*own_cert())
    return ctx


def recv_frames(sock, want_kind, timeout):
    """Reads until a frame of want_kind (or ERROR) arrives: (kind, payload) or (None, why)."""
    buf, end = b'', time.time() + timeout
    sock.settimeout(0.2)
    while time.time() < end:
        try:
            d = sock.recv(65536)
        except (socket.timeout, ssl.SSLWantReadError):
            continue
        except (OSError, ssl.SSLError) as e:
            return None, 'closed:' + type(e).__name__
        if not d:
            return None, 'closed'
        if not buf and d[:4] != MAGIC:
            return None, 'not-frames(first_byte_0x%02x)' % d[0]
        frames, buf = parse(buf + d)
        for kind, fl, req, pos, n, pl in frames:
            if kind == 8:
                return 8, pl[4:].decode('utf-8', 'replace')
            if kind == want_kind:
                return kind, pl
    return None, 'timeout'


def dial(port, use_tls):
    s = socket.create_connection(('127.0.0.1', port), timeout=5)
    if use_tls:
        s = tls_ctx(False).wrap_socket(s)  # raises if the stage refuses our certificate
    return s


def do_pred(a):
    model, port, wb, we, nblock, nembd, nctx, nseq, use_tls = a[0], *map(int, a[1:9])
    fp = fingerprint(model)
    try:
        s = dial(port, use_tls)
        s.sendall(hello(fp, 1, nblock, wb, we, nembd, nctx, nseq))
        kind, what = recv_frames(s, 1, 5)
    except (OSError, ssl.SSLError) as e:
        result(mode='pred', accepted=0, why='handshake:' + type(e).__name__)
        return
    if kind != 1:
        result(mode='pred', accepted=0, why=what)
        return
    # accepted as the predecessor: a request of our own, with our boundary (zeros)
    n = 3
    req = struct.pack('<fifffiQII', 0.0, 0, 1.0, 0.0, 1.0, 64, 7, 4, 0) + struct.pack('<3i', 1, 2, 3)
    s.sendall(frame(2, req, req=4242, n=n) + frame(3, b'\x00' * (2 * nembd * n), flags=2, req=4242, pos=0, n=n))
    time.sleep(1)
    result(mode='pred', accepted=1, sent_bytes=2 * nembd * n)
    s.close()


def do_tail(a):
    model, lport, hport, wb, nblock, nembd, nctx, nseq = a[0], *map(int, a[1:8])
    tokens, use_tls = [int(t) for t in a[8].split(',')], int(a[9])
    fp = fingerprint(model)
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(('127.0.0.1', lport))
    ls.listen(4)
    ls.settimeout(8)
    got_boundary, sent, why = 0, 0, ''
    try:
        succ, _ = ls.accept()  # the stage before the tail dials us
        if use_tls:
            succ = tls_ctx(True).wrap_socket(succ, server_side=True)
        kind, what = recv_frames(succ, 1, 5)
        if kind != 1:
            raise OSError('its first bytes: ' + str(what))
        succ.sendall(hello(fp, 2, nblock, wb, nblock, nembd, nctx, nseq))
        pred = dial(hport, use_tls)
        pred.sendall(hello(fp, 1, nblock, wb, nblock, nembd, nctx, nseq))
        kind, what = recv_frames(pred, 1, 5)
        if kind != 1:
            raise OSError('the head: ' + str(what))
        buf, end = b'', time.time() + 15
        succ.settimeout(0.2)
        while time.time() < end and sent < len(tokens):
            try:
                d = succ.recv(65536)
            except (socket.timeout, ssl.SSLWantReadError):
                continue
            if not d:
                break
            frames, buf = parse(buf + d)
            for kind, fl, req, pos, n, pl in frames:
                if kind == 9 and fl & 4:  # a probe: on round the ring, so the head sees it whole
                    pred.sendall(frame(9, pl, flags=fl, pos=pos, n=n))
                    continue
                rows = []
                if kind == 3:
                    got_boundary += len(pl)  # the user's prompt, as the boundary
                    if fl & 2:
                        rows = [(req, pos + n)]
                elif kind == 4:
                    got_boundary += len(pl) - 8 * n
                    rows = [(r, p + 1) for r, p in (struct.unpack_from('<II', pl, 8 * i) for i in range(n))]
                for r, p in rows:
                    if sent < len(tokens):
                        last = sent == len(tokens) - 1
                        pred.sendall(frame(5, struct.pack('<iI', tokens[sent], 2 if last else 0),
                                           flags=0x10 if last else 0, req=r, pos=p, n=1))
                        sent += 1
        time.sleep(0.5)
    except (OSError, ssl.SSLError) as e:
        why = type(e).__name__ + ':' + str(e)[:80]
    result(mode='tail', boundary_bytes=got_boundary, tokens_sent=sent, why=why or 'none')


def do_record(a):
    lport, tport, path = int(a[0]), int(a[1]), a[2]
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(('127.0.0.1', lport))
    ls.listen(4)
    end = time.time() + 20
    out = open(path, 'wb')
    conns = []
    ls.setblocking(False)
    while time.time() < end:
        socks = [ls] + [c for pair in conns for c in pair]
        r, _, _ = select.select(socks, [], [], 0.2)
        for s in r:
            if s is ls:
                c, _ = ls.accept()
                t = socket.create_connection(('127.0.0.1', tport))
                conns.append((c, t))
                continue
            for c, t in conns:
                if s is c or s is t:
                    try:
                        d = s.recv(65536)
                    except OSError:
                        d = b''
                    if not d:
                        c.close(), t.close()
                        conns.remove((c, t))
                        break
                    if s is c and len(conns) == 1:  # record the first connection's dialer bytes only
                        out.write(d)
                        out.flush()
                    (t if s is c else c).sendall(d)
                    break


def do_replay(a):
    port, path = int(a[0]), a[1]
    data = open(path, 'rb').read()
    s = socket.create_connection(('127.0.0.1', port), timeout=5)
    s.sendall(data)
    back, end = b'', time.time() + 3
    s.settimeout(0.3)
    while time.time() < end:
        try:
            d = s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if not d:
            break
        back += d
    frames, _ = parse(back)
    hello_back = any(k == 1 for k, *_ in frames)
    result(mode='replay', sent=len(data), plaintext_magic=int(MAGIC in data), accepted=int(hello_back),
           back_bytes=len(back))


{'pred': do_pred, 'tail': do_tail, 'record': do_record, 'replay': do_replay}[sys.argv[1]](sys.argv[2:])

"""A stranger on a stage's listen port (plaintext, as against an --insecure ring):
connects COUNT times, every INTERVAL_MS, and sends by MODE
  hello   - a HELLO that fits: a predecessor with window [WB,WE) of the model
  bad     - a HELLO whose window does not fit ([WB,WE) taken as given)
  garbage - an HTTP request line
then waits up to 300 ms for a reply and closes. Prints
"RESULT accepted=A refused=R closed=C": A replies were a HELLO (the stage took us as
its predecessor), R an ERROR, C the link closed without a reply.
usage: stranger.py MODEL PORT MODE COUNT INTERVAL_MS N_BLOCK N_EMBD N_CTX N_SEQ N_BATCH WB WE"""
import binascii, socket, struct, subprocess, sys, time

MAGIC = b'KVSR'
KVASIR = subprocess.os.environ.get('KVASIR_BIN', 'kvasir')


def frame(kind, payload=b'', flags=0, req=0, pos=0, n=0):
    return MAGIC + struct.pack('<HBBIIII', 3, kind, flags, req, pos, n, len(payload)) + payload


def main():
    model, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    count, interval = int(sys.argv[4]), int(sys.argv[5]) / 1000.0
    nblock, nembd, nctx, nseq, nbatch, wb, we = (int(x) for x in sys.argv[6:13])
    info = subprocess.run([KVASIR, 'gguf', 'info', model], capture_output=True, text=True).stdout
    fp = next(binascii.unhexlify(l.split()[1]) for l in info.splitlines() if l.startswith('fingerprint:'))
    # HELLO (PROTOCOL.md §3.1, version 3): ..., n_batch, content id (all zero: unknown)
    hello = frame(1, fp + struct.pack('<8I', nblock, wb, we, nembd, 1, nctx, nseq, nbatch) + bytes(32))
    msg = b'GET / HTTP/1.1\r\nHost: x\r\n\r\n' if mode == 'garbage' else hello
    acc = ref = clo = 0
    for _ in range(count):
        t0 = time.time()
        try:
            c = socket.create_connection(('127.0.0.1', port), timeout=1)
            c.sendall(msg)
            c.settimeout(0.3)
            d = c.recv(4096)
            if not d:
                clo += 1
            elif len(d) >= 8 and d[:4] == MAGIC and d[6] == 1:
                acc += 1
            else:
                ref += 1
        except socket.timeout:
            clo += 1
        except OSError:
            clo += 1
        finally:
            try:
                c.close()
            except Exception:
                pass
        time.sleep(max(0.0, interval - (time.time() - t0)))
    print('RESULT accepted=%d refused=%d closed=%d' % (acc, ref, clo), flush=True)


main()

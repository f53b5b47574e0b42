"""A connection flood on a stage's listen port from one source address: opens
RATE connections per second from SRC (e.g. 127.0.0.2, any loopback address),
sends nothing, keeps each open until the stage closes it (or HOLD_MS passes),
for SECONDS. Prints "RESULT opened=N closed_by_stage=C".
usage: flood.py SRC PORT RATE SECONDS HOLD_MS"""
import socket, sys, time


def main():
    src, port, rate, secs, hold = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]) / 1000.0
    live = []  # (socket, opened at)
    opened = closed = 0
    t_end = time.time() + secs
    step = 1.0 / rate
    nxt = time.time()
    while time.time() < t_end:
        now = time.time()
        if now >= nxt:
            nxt += step
            try:
                c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                c.bind((src, 0))
                c.setblocking(False)
                c.connect_ex(('127.0.0.1', port))
                live.append((c, now))
                opened += 1
            except OSError:
                pass
        keep = []
        for c, t in live:
            gone = False
            try:
                if c.recv(64, socket.MSG_DONTWAIT) == b'':
                    gone = True
                    closed += 1
            except BlockingIOError:
                pass
            except OSError:
                gone = True
                closed += 1
            if gone or now - t > hold:
                c.close()
            else:
                keep.append((c, t))
        live = keep
        time.sleep(min(step, 0.002))
    for c, _ in live:
        c.close()
    print('RESULT opened=%d closed_by_stage=%d' % (opened, closed), flush=True)


main()

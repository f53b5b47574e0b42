#!/usr/bin/env python3
"""A lying model server for tests/e2e/shard_hostile.sh.

usage: hostile_seed.py MODEL.gguf INDEX.json PORT_FILE

Serves MODEL.gguf with HTTP ranges under /MODE/m.gguf and its index under
/MODE/m.gguf.kvindex.json, where MODE says how it lies:
  good        honest: right bytes, the index
  offset      a range that starts in the data section gets the bytes 64 further
              on (Content-Range stays right); the index is served
  offsetnoix  the same without an index (404)
  slowindex   honest bytes; the index trickles at 1 byte per 2 s
  slowdata    header ranges honest, data ranges trickle at 1 byte per 2 s; no index
  hugehdr     a GGUF whose first key claims a 900 MB string in a 4 GiB file; any
              range gets filler as fast as the socket takes it
  hugeindex   honest bytes; the index claims Content-Length 600 MB, filler follows
  hugeindex2  the same without a Content-Length (ends when the connection closes)
  tokswap     every tensor byte right and the real index, but one byte of one
              token string in the header's tokenizer.ggml.tokens changed (the
              fingerprint and every tensor digest still match)
"""
import http.server, json, os, re, socketserver, struct, sys, time

MODEL, INDEX, PORT_FILE = sys.argv[1], sys.argv[2], sys.argv[3]
DATA = open(MODEL, 'rb').read()
IDX = open(INDEX, 'rb').read()
DATA_OFFSET = json.loads(IDX)['data_offset']
HUGE_TOTAL = 4 << 30
HUGE_HDR = (b'GGUF' + struct.pack('<IQQ', 3, 1, 1) + struct.pack('<Q', 12) + b'general.name' +
            struct.pack('<IQ', 8, 900 * 1000 * 1000))
FILL = b'\x20' * 65536


def token_swapped(data):
    """data with the first byte of token 100's string in tokenizer.ggml.tokens changed."""
    key = b'tokenizer.ggml.tokens'
    at = data.index(struct.pack('<Q', len(key)) + key) + 8 + len(key)
    typ, elem, n = struct.unpack_from('<IIQ', data, at)
    assert typ == 9 and elem == 8 and n > 100, (typ, elem, n)
    p = at + 16
    for _ in range(100):
        p += 8 + struct.unpack_from('<Q', data, p)[0]
    out = bytearray(data)
    out[p + 8] = ord('x') if out[p + 8] != ord('x') else ord('y')
    return bytes(out)


SWAPPED = token_swapped(DATA)


class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'

    def log_message(self, *a):
        pass

    def filler(self, n):
        while n > 0:
            k = min(n, len(FILL))
            self.wfile.write(FILL[:k])
            n -= k

    def do_GET(self):
        try:
            self.serve()
        except (BrokenPipeError, ConnectionResetError):
            pass

    def serve(self):
        m = re.match(r'^/([a-z0-9]+)/m\.gguf(\.kvindex\.json)?$', self.path)
        if not m:
            self.send_error(404)
            return
        mode, is_index = m.group(1), bool(m.group(2))
        if is_index:
            if mode in ('offsetnoix', 'slowdata', 'hugehdr'):
                self.send_error(404)
            elif mode == 'slowindex':
                self.send_response(200)
                self.send_header('Content-Length', str(len(IDX)))
                self.end_headers()
                for b in IDX:
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(2)
            elif mode in ('hugeindex', 'hugeindex2'):
                if mode == 'hugeindex2':
                    self.protocol_version = 'HTTP/1.0'
                    self.close_connection = True
                self.send_response(200)
                if mode == 'hugeindex':
                    self.send_header('Content-Length', str(600 * 1000 * 1000))
                self.end_headers()
                self.wfile.write(b'{"tensors": [')
                self.filler(600 * 1000 * 1000)
            else:
                self.send_response(200)
                self.send_header('Content-Length', str(len(IDX)))
                self.end_headers()
                self.wfile.write(IDX)
            return
        r = re.match(r'bytes=(\d+)-(\d+)$', self.headers.get('Range', ''))
        if not r:
            self.send_error(416)
            return
        a, b = int(r.group(1)), int(r.group(2))
        total = HUGE_TOTAL if mode == 'hugehdr' else len(DATA)
        b = min(b, total - 1)
        n = b - a + 1
        self.send_response(206)
        self.send_header('Content-Range', 'bytes %d-%d/%d' % (a, b, total))
        self.send_header('Content-Length', str(n))
        self.send_header('ETag', '"hostile"')
        self.end_headers()
        if mode == 'hugehdr':
            head = HUGE_HDR[a:a + n] if a < len(HUGE_HDR) else b''
            self.wfile.write(head)
            self.filler(n - len(head))
        elif mode in ('offset', 'offsetnoix') and a >= DATA_OFFSET:
            body = DATA[a + 64:b + 65]
            self.wfile.write(body + b'\0' * (n - len(body)))
        elif mode == 'slowdata' and a >= DATA_OFFSET:
            for i in range(a, b + 1):
                self.wfile.write(DATA[i:i + 1])
                self.wfile.flush()
                time.sleep(2)
        elif mode == 'tokswap':
            self.wfile.write(SWAPPED[a:b + 1])
        else:
            self.wfile.write(DATA[a:b + 1])


class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


s = S(('127.0.0.1', 0), H)
with open(PORT_FILE + '.tmp', 'w') as f:
    f.write(str(s.server_address[1]))
os.rename(PORT_FILE + '.tmp', PORT_FILE)
s.serve_forever()

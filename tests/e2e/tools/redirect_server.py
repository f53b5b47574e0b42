"""A loopback HTTP server that answers like Hugging Face's resolve/ links: every
GET/HEAD of /redirect/NAME gets a 302 to http://127.0.0.1:TARGET_PORT/NAME (another
port, a `kvasir seed` that serves the bytes with ranges). With TOKEN, a request
without "Authorization: Bearer TOKEN" gets 401. Counts what it sees in
STATS_FILE (JSON, rewritten after each request): hits, unauthorized, and
whether any request carried the token (authorized).
usage: redirect_server.py PORT_FILE TARGET_PORT STATS_FILE [TOKEN]"""
import http.server, json, os, sys

port_file, target, stats_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
token = sys.argv[4] if len(sys.argv) > 4 else None
stats = {"hits": 0, "unauthorized": 0, "authorized": 0}

class H(http.server.BaseHTTPRequestHandler):
    def answer(self):
        stats["hits"] += 1
        if token is not None:
            if self.headers.get("Authorization") != "Bearer " + token:
                stats["unauthorized"] += 1
                self.send_response(401); self.send_header("Content-Length", "0"); self.end_headers()
                self.save(); return
            stats["authorized"] += 1
        if not self.path.startswith("/redirect/"):
            self.send_response(404); self.send_header("Content-Length", "0"); self.end_headers()
        else:
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:%d/%s" % (target, self.path[len("/redirect/"):]))
            self.send_header("Content-Length", "0")
            self.end_headers()
        self.save()
    def save(self):
        tmp = stats_file + ".tmp"
        with open(tmp, "w") as f: json.dump(stats, f)
        os.replace(tmp, stats_file)
    do_GET = answer
    do_HEAD = answer
    def log_message(self, *a): pass

s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
with open(stats_file, "w") as f: json.dump(stats, f)
with open(port_file + ".tmp", "w") as f: f.write(str(s.server_address[1]))
os.replace(port_file + ".tmp", port_file)
s.serve_forever()

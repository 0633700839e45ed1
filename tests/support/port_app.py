"""A small app for the port proxy tests, run INSIDE a sandbox (fake guest or VM); Python stdlib only.

``python3 port_app.py PORT`` serves on 127.0.0.1:PORT:

- ``GET|HEAD /hello`` -> ``hello from the sandbox`` (plus the request's path, query and selected headers
  as JSON in ``X-Seen``);
- ``GET /bytes?n=N`` -> N bytes (``0123456789`` repeated), Content-Length, written in ~64 KiB pieces;
- ``GET /slow`` -> chunked: ``first``, then 1.5 s later ``second``;
- ``POST /duplex`` (chunked request) -> a chunked answer started at once: ``got:<chunk>`` for every request
  chunk as soon as it arrives (a client can wait for each acknowledgement before sending the next chunk);
- ``POST|PUT /echo`` -> the request body back (Content-Length or chunked request), with its SHA-256 in
  ``X-Sha256``;
- ``GET /ws`` with a WebSocket upgrade -> echo of every message (text and binary), close answered;
- ``GET /hostile`` -> headers a hostile app would use against the origin it is served on (cookies for
  other paths and domains, ``Clear-Site-Data``, ``Service-Worker-Allowed``, HSTS, NEL ...), and the
  ``Referer`` it was sent, in ``X-Referer``.

Its source is copied into the guest by the tests (``SOURCE``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

__all__ = ["HOSTILE_HEADERS", "SOURCE", "main"]

_WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


HOSTILE_HEADERS = [
    ("Set-Cookie", "own=1"),  # no Path: the request's directory, inside the port
    ("Set-Cookie", "scoped=1; Path={prefix}/app"),
    ("Set-Cookie", "root=1; Path=/"),
    ("Set-Cookie", "api=1; Path=/v1"),
    ("Set-Cookie", "domain=1; Domain=127.0.0.1; Path={prefix}/"),
    ("Set-Cookie", "capsa_port_token=cpt_attacker; Path={prefix}/"),
    ("Set-Cookie", "__Host-x=1; Path=/; Secure"),
    ("Clear-Site-Data", '"cookies", "storage"'),
    ("Service-Worker-Allowed", "/"),
    ("Strict-Transport-Security", "max-age=31536000; includeSubDomains"),
    ("NEL", '{"report_to": "x", "max_age": 86400, "include_subdomains": true}'),
    ("Report-To", '{"group": "x", "max_age": 86400, "endpoints": [{"url": "https://collect.test/"}]}'),
    ("Alt-Svc", 'h2="collect.test:443"'),
    ("Referrer-Policy", "unsafe-url"),
    ("X-Kept", "yes"),
]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        if urlsplit(self.path).path == "/hello":
            self._send(200, b"hello from the sandbox")
        else:
            self._send(404, b"no such page")

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            self._websocket()
        elif url.path == "/hello":
            seen = {"path": url.path, "query": url.query,
                    "host": self.headers.get("Host"), "authorization": self.headers.get("Authorization"),
                    "port_token": self.headers.get("X-Capsa-Port-Token"),
                    "prefix": self.headers.get("X-Forwarded-Prefix")}
            self._send(200, b"hello from the sandbox", {"X-Seen": json.dumps(seen)})
        elif url.path == "/hostile":
            self.send_response(200)
            for name, value in HOSTILE_HEADERS:
                self.send_header(name, value.replace("{prefix}", self.headers.get("X-Forwarded-Prefix", "")))
            self.send_header("X-Referer", self.headers.get("Referer", ""))
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
        elif url.path == "/bytes":
            n = int(parse_qs(url.query).get("n", ["0"])[0])
            self.send_response(200)
            self.send_header("Content-Length", str(n))
            self.end_headers()
            piece = b"0123456789" * 6553  # a whole number of periods, so the pieces join seamlessly
            left = n
            while left:
                part = piece[:left]
                self.wfile.write(part)
                left -= len(part)
        elif url.path == "/slow":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for word, pause in ((b"first", 1.5), (b"second", 0.0)):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(word), word))
                self.wfile.flush()
                time.sleep(pause)
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._send(404, b"no such page")

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length", "0")))

    def _duplex(self) -> None:
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip(), 16)
            if size == 0:
                self.rfile.readline()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                return
            data = self.rfile.read(size)
            self.rfile.readline()
            answer = b"got:" + data
            self.wfile.write(b"%x\r\n%s\r\n" % (len(answer), answer))
            self.wfile.flush()

    def do_POST(self) -> None:
        if urlsplit(self.path).path == "/duplex":
            self._duplex()
            return
        if urlsplit(self.path).path != "/echo":
            self._send(404, b"no such page")
            return
        body = self._body()
        self._send(200, body, {"X-Sha256": hashlib.sha256(body).hexdigest(),
                               "Content-Type": "application/octet-stream"})

    do_PUT = do_POST

    def _websocket(self) -> None:
        key = self.headers.get("Sec-WebSocket-Key", "")
        accept = base64.b64encode(hashlib.sha1((key + _WS_GUID).encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            opcode, length = head[0] & 0x0F, head[1] & 0x7F
            if length == 126:
                (length,) = struct.unpack("!H", self.rfile.read(2))
            elif length == 127:
                (length,) = struct.unpack("!Q", self.rfile.read(8))
            mask = self.rfile.read(4) if head[1] & 0x80 else b"\0\0\0\0"
            payload = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(length)))
            if opcode == 0x8:  # close: answer with the same code
                self._frame(0x8, payload[:2])
                return
            if opcode == 0x9:  # ping
                self._frame(0xA, payload)
            elif opcode in (0x1, 0x2):
                self._frame(opcode, payload)

    def _frame(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            head = struct.pack("!BB", 0x80 | opcode, n)
        elif n < 65536:
            head = struct.pack("!BBH", 0x80 | opcode, 126, n)
        else:
            head = struct.pack("!BBQ", 0x80 | opcode, 127, n)
        self.wfile.write(head + payload)
        self.wfile.flush()


def main(argv: list[str]) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", int(argv[1])), _Handler)
    server.daemon_threads = True
    print("listening", flush=True)
    server.serve_forever()


SOURCE = Path(__file__).read_text()

if __name__ == "__main__":
    main(sys.argv)

"""``mooncake.http_metadata_server`` served by kvmove: an HTTP metadata
server for ``TransferEngine.initialize(name, "http://host:port/metadata",
...)``, written on the standard library (no aiohttp).

It answers what Mooncake's HTTP metadata client sends: ``GET``, ``PUT``
and ``DELETE`` on ``/metadata?key=<key>`` (200 with the value, or 404 /
``metadata not found``; 400 without a key). With
``MC_METADATA_HTTP_TOKEN`` set, requests without ``Authorization: Bearer
<token>`` are refused (401). Values are kept in memory, bounded: a body
over ``MAX_VALUE`` bytes is refused (413) before it is read, and a new key
past ``MAX_KEYS`` keys is refused (507).

It listens on loopback unless ``--host`` says otherwise (Mooncake's
listens on every interface): whoever can write a record can make an
engine send its KV to another address, so expose it only with a token, as
kvmove's own channels answer only their host without a secret.

    python -m mooncake.http_metadata_server --port 8080 --host 127.0.0.1
"""

import argparse
import hmac
import logging
import os
import signal
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("mooncake.http_metadata_server")

#: The largest value (request body) kept; a larger one is refused unread.
MAX_VALUE = 16 << 20
#: The most keys kept at once.
MAX_KEYS = 1 << 16


class KVBootstrapServer:
    """The server: ``run()`` serves in a background thread, ``close()``
    stops it. ``port=0`` picks a free port (see ``port`` after ``run``)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.host = host
        self.port = port
        self.store = {}
        self.lock = threading.Lock()
        self.thread = None
        self._httpd = None

    def run(self):
        self._httpd = ThreadingHTTPServer((self.host, self.port), _handler(self))
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.thread = threading.Thread(target=self._httpd.serve_forever, name="http-metadata", daemon=True)
        self.thread.start()
        log.info("HTTP metadata server on %s:%d", self.host, self.port)
        return self.thread

    def close(self):
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def poll(self) -> bool:
        """Whether the server is serving."""
        return self.thread is not None and self.thread.is_alive()


def _handler(server):
    token = os.environ.get("MC_METADATA_HTTP_TOKEN", "")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            log.debug("%s %s", self.address_string(), fmt % args)

        def _answer(self, status, body):
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _handle(self):
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_VALUE:
                self.close_connection = True
                return self._answer(413 if length > 0 else 400, b"bad or oversized body")
            body = self.rfile.read(length) if length > 0 else b""
            if token:
                given = self.headers.get("Authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return self._answer(401, b"unauthorized")
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/metadata":
                return self._answer(404, b"not found")
            key = urllib.parse.parse_qs(url.query).get("key", [""])[0].strip()
            if not key:
                return self._answer(400, b"metadata key is required")
            with server.lock:
                if self.command == "GET":
                    value = server.store.get(key)
                    if value is None:
                        return self._answer(404, b"metadata not found")
                    return self._answer(200, value)
                if self.command == "PUT":
                    if key not in server.store and len(server.store) >= MAX_KEYS:
                        return self._answer(507, b"too many keys")
                    server.store[key] = body
                    return self._answer(200, b"metadata updated")
                if server.store.pop(key, None) is None:
                    return self._answer(404, b"metadata not found")
                return self._answer(200, b"metadata deleted")

        do_GET = do_PUT = do_DELETE = _handle

    return Handler


def main(argv=None):
    p = argparse.ArgumentParser(description="HTTP metadata server (kvmove's stand-in for Mooncake's)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = KVBootstrapServer(args.port, args.host)
    server.run()
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

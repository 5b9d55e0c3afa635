"""Mooncake's metadata-server modes on the stand-in ``TransferEngine``:
engines publish their segment name (``local_hostname``) to an HTTP
metadata server or etcd at ``initialize``, peers name them by it in
transfer calls, and ``close`` removes the record.

The HTTP server here is written for the test (GET/PUT/DELETE on
``?key=``, the protocol of Mooncake's HTTP metadata server); the etcd test
starts a real ``etcd`` when one is installed."""

import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvmove.mooncake import TransferEngine

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "mooncake-shim")

PREFIX = "kvmove/segments/"


class MetadataServer:
    """GET/PUT/DELETE on ``/metadata?key=``; counts requests per key; with
    ``token`` set, refuses requests without ``Authorization: Bearer``."""

    def __init__(self, token=None):
        self.store = {}
        self.requests = []
        self.token = token
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _key(self):
                url = urllib.parse.urlparse(self.path)
                keys = urllib.parse.parse_qs(url.query).get("key", [""])
                return url.path, keys[0]

            def _answer(self, status, body=b""):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, method):
                path, key = self._key()
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.requests.append((method, key))
                if outer.token and self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._answer(401, b"unauthorized")
                if path != "/metadata" or not key:
                    return self._answer(400, b"metadata key is required")
                if method == "GET":
                    if key not in outer.store:
                        return self._answer(404, b"metadata not found")
                    return self._answer(200, outer.store[key])
                if method == "PUT":
                    outer.store[key] = body
                    return self._answer(200, b"metadata updated")
                if outer.store.pop(key, None) is None:
                    return self._answer(404, b"metadata not found")
                return self._answer(200, b"metadata deleted")

            def do_GET(self):
                self._handle("GET")

            def do_PUT(self):
                self._handle("PUT")

            def do_DELETE(self):
                self._handle("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/metadata"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def gets(self, name):
        return sum(1 for m, k in self.requests if m == "GET" and k == PREFIX + name)

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def meta():
    s = MetadataServer()
    yield s
    s.stop()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pair_by_name(a, b, a_name, b_name, n=4096):
    """Byte-exact writes and reads both ways, each side naming the other
    by its segment name; returns the two managed buffers."""
    da = a.allocate_managed_buffer(n)
    db = b.allocate_managed_buffer(n)
    assert da and db
    payload = os.urandom(n)
    assert b.write_bytes_to_buffer(db, payload, n) == 0
    assert b.transfer_sync_write(a_name, db, da, n) == 0, b.last_error()
    assert a.read_bytes_from_buffer(da, n) == payload
    assert b.write_bytes_to_buffer(db, bytes(n), n) == 0
    assert b.transfer_sync_read(a_name, db, da, n) == 0, b.last_error()
    assert b.read_bytes_from_buffer(db, n) == payload
    # The other way, as a batch.
    back = os.urandom(64)
    assert a.write_bytes_to_buffer(da, back, 64) == 0
    assert a.batch_transfer_sync_write(b_name, [da, da + 32], [db + 100, db + 132], [32, 32]) == 0, a.last_error()
    assert b.read_bytes_from_buffer(db + 100, 64) == back
    return da, db


def test_engines_find_each_other_through_an_http_metadata_server(meta, monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    a, b = TransferEngine(), TransferEngine()
    try:
        # As Mooncake's tests name them: an address-like name whose port
        # nobody listens on, and a name that is no address at all.
        assert a.initialize("127.0.0.1:12345", meta.url, "tcp", "") == 0, a.last_error()
        assert b.initialize("decode-0", meta.url, "tcp", "") == 0, b.last_error()
        assert a.get_session_id() == "127.0.0.1:12345"
        assert b.get_session_id() == "decode-0"
        assert a.get_rpc_port() > 0
        rec = json.loads(meta.store[PREFIX + "decode-0"])
        assert rec["name"] == "decode-0" and rec["address"] == f"127.0.0.1:{b.get_rpc_port()}"
        assert PREFIX + "127.0.0.1:12345" in meta.store

        da, db = pair_by_name(a, b, "127.0.0.1:12345", "decode-0")
        # Each name was looked up once, then cached.
        for _ in range(5):
            assert b.transfer_sync_write("127.0.0.1:12345", db, da, 16) == 0
        assert meta.gets("127.0.0.1:12345") == 1
        assert meta.gets("decode-0") == 1
        # Async batches and the first registered buffer, by name; an
        # engine's own name needs no lookup.
        bid = b.batch_transfer_async_read("127.0.0.1:12345", [db], [da], [128])
        assert bid != 0 and b.get_batch_transfer_status([bid]) == 0
        assert b.get_first_buffer_address("127.0.0.1:12345") == da
        assert a.get_first_buffer_address("127.0.0.1:12345") == da
        assert meta.gets("127.0.0.1:12345") == 1
        assert b.send_probe("127.0.0.1:12345") == 0

        # A name the server does not know fails the call, and says so.
        for name in ("nobody", "unreachable_peer:9"):
            assert b.transfer_sync_write(name, db, da, 16) == -1
            err = b.last_error()
            assert err.kind == "not_found", err
            assert name in str(err) and meta.url in str(err), str(err)
            assert b.send_probe(name) != 0
            assert b.batch_transfer_async_write(name, [0], [0], [16]) == 0
            assert b.transfer_submit_write(name, 0, 0, 16) == 0

        # Closing removes the record; the name stops working.
        a.close()
        assert PREFIX + "127.0.0.1:12345" not in meta.store
        assert b.transfer_sync_write("127.0.0.1:12345", db, da, 16) == -1
        assert b.transfer_sync_write("127.0.0.1:12345", db, da, 16) == -1
        assert b.last_error().kind == "not_found", b.last_error()

        # An engine that takes the name back is found again (looked up
        # anew after the failure), at its new address.
        a2 = TransferEngine()
        try:
            assert a2.initialize("127.0.0.1:12345", meta.url, "tcp", "") == 0
            pair_by_name(a2, b, "127.0.0.1:12345", "decode-0")
        finally:
            a2.close()
    finally:
        a.close()
        b.close()
    assert meta.store == {}


def test_a_restarted_peer_is_looked_up_again(meta, monkeypatch):
    """A peer that dies without removing its record and comes back
    elsewhere under the same name: the first call fails (the cached
    address is gone), the next one looks the name up again."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    b = TransferEngine()
    a = TransferEngine()
    try:
        assert b.initialize("b", meta.url, "tcp", "") == 0
        assert a.initialize("a", meta.url, "tcp", "") == 0
        src = b.allocate_managed_buffer(4096)
        dst = a.allocate_managed_buffer(4096)
        assert b.transfer_sync_write("a", src, dst, 64) == 0
        record = meta.store[PREFIX + "a"]
        a.close()
        meta.store[PREFIX + "a"] = record  # as if it had crashed
        a = TransferEngine()
        assert a.initialize("a", meta.url, "tcp", "") == 0
        assert meta.store[PREFIX + "a"] != record
        dst = a.allocate_managed_buffer(4096)
        looked_up = meta.gets("a")
        assert b.transfer_sync_write("a", src, dst, 64) == -1
        assert b.last_error().reopens_segment
        assert b.transfer_sync_write("a", src, dst, 64) == 0, b.last_error()
        assert meta.gets("a") == looked_up + 1
    finally:
        a.close()
        b.close()


def test_a_server_gone_after_initialize(monkeypatch):
    """Names already looked up keep working; close does not hang."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    meta = MetadataServer()
    a, b = TransferEngine(), TransferEngine()
    try:
        assert a.initialize("a", meta.url, "tcp", "") == 0
        assert b.initialize("b", meta.url, "tcp", "") == 0
        da, db = pair_by_name(a, b, "a", "b")
        meta.stop()
        assert b.transfer_sync_write("a", db, da, 64) == 0
        assert b.transfer_sync_write("c", db, da, 64) == -1
        assert b.last_error().kind in ("connection_refused", "timeout"), b.last_error()
        start = time.monotonic()
        a.close()
        b.close()
        assert time.monotonic() - start < 5
    finally:
        a.close()
        b.close()


def test_bad_metadata_servers_fail_initialize_and_leave_nothing(meta):
    unused = free_port()
    e = TransferEngine()
    try:
        # Nothing answers there: -1, and the message names the server.
        for server in (f"http://127.0.0.1:{unused}/metadata", f"etcd://127.0.0.1:{unused}", f"127.0.0.1:{unused}"):
            assert e.initialize("127.0.0.1:12345", server, "tcp", "") == -1, server
            err = e.last_error()
            assert err.kind == "connection_refused", err
            assert f"127.0.0.1:{unused}" in str(err), str(err)
        for server in ("http://:80/metadata", "http://h:99999/m", "http://h:80/a b", "etcd://", "h:port"):
            assert e.initialize("n", server, "tcp", "") == -1, server
            assert e.last_error().kind == "config", (server, e.last_error())
        for server in ("redis://127.0.0.1:6379", "https://127.0.0.1/metadata"):
            assert e.initialize("n", server, "tcp", "") == -1, server
            err = e.last_error()
            assert err.kind == "unsupported" and server.split(":")[0] in err.message, err
        # A bad protocol is still refused with a metadata server.
        assert e.initialize("n", meta.url, "carrier-pigeon", "") == -1
        assert meta.store == {}
        # Nothing was left behind: the same engine starts.
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    finally:
        e.close()


def test_initialize_ext_builds_the_connection_string(meta, monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with TransferEngine() as a, TransferEngine() as b:
        # Mooncake's rule: metadata_type becomes the scheme of a server
        # string without one.
        assert a.initialize_ext("a", f"127.0.0.1:{meta.port}/metadata", "tcp", "", "http") == 0, a.last_error()
        assert b.initialize_ext("b", meta.url, "tcp", "", "etcd") == 0, b.last_error()
        pair_by_name(a, b, "a", "b")
        assert sorted(meta.store) == [PREFIX + "a", PREFIX + "b"]
    with TransferEngine() as c:
        assert c.initialize_ext("127.0.0.1", "P2PHANDSHAKE", "tcp", "", "etcd") == 0


def test_bearer_token(monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    meta = MetadataServer(token="s3cret")
    try:
        with TransferEngine() as e:
            monkeypatch.delenv("MC_METADATA_HTTP_TOKEN", raising=False)
            assert e.initialize("a", meta.url, "tcp", "") == -1
            assert e.last_error().kind == "auth_failed", e.last_error()
            monkeypatch.setenv("MC_METADATA_HTTP_TOKEN", "s3cret")
            assert e.initialize("a", meta.url, "tcp", "") == 0, e.last_error()
            assert PREFIX + "a" in meta.store
        assert meta.store == {}
    finally:
        meta.stop()


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("no etcd binary on PATH (scripts/ CI installs one: transport-etcd/install-etcd.sh)")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen(
        [
            binary,
            "--name", "kvmove-test",
            "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", url,
            "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"kvmove-test=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            etcd_range(client, "probe")
            break
        except (urllib.error.URLError, ConnectionError, OSError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("etcd did not start")
            time.sleep(0.1)
    yield client
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def etcd_range(port, key):
    """The value of ``key`` in etcd (through its JSON gateway), or None."""
    body = json.dumps({"key": base64.b64encode(key.encode()).decode()}).encode()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v3/kv/range", body, timeout=2) as r:
        kvs = json.loads(r.read()).get("kvs")
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


def test_engines_find_each_other_through_etcd(etcd, monkeypatch):
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    a, b = TransferEngine(), TransferEngine()
    try:
        # Both of Mooncake's forms: etcd://host:port and bare host:port.
        assert a.initialize("127.0.0.1:12345", f"etcd://127.0.0.1:{etcd}", "tcp", "") == 0, a.last_error()
        assert b.initialize("decode-0", f"127.0.0.1:{etcd}", "tcp", "") == 0, b.last_error()
        rec = json.loads(etcd_range(etcd, PREFIX + "127.0.0.1:12345"))
        assert rec["address"] == f"127.0.0.1:{a.get_rpc_port()}"
        pair_by_name(a, b, "127.0.0.1:12345", "decode-0")
        assert b.send_probe("127.0.0.1:12345") == 0
        assert b.send_probe("unreachable_peer:9") != 0
        assert b.transfer_sync_write("unreachable_peer:9", 0, 0, 16) == -1
        assert b.last_error().kind == "not_found", b.last_error()
        a.close()
        assert etcd_range(etcd, PREFIX + "127.0.0.1:12345") is None
        assert etcd_range(etcd, PREFIX + "decode-0") is not None
    finally:
        a.close()
        b.close()
    assert etcd_range(etcd, PREFIX + "decode-0") is None


def test_the_shims_http_metadata_server(tmp_path, monkeypatch):
    """``python -m mooncake.http_metadata_server`` with the shim on the
    path (Mooncake's CI starts its server so): engines find each other
    through it."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [SHIM, os.environ.get("PYTHONPATH", "")] if p))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mooncake.http_metadata_server", "--port", str(port), "--host", "127.0.0.1"],
        cwd=tmp_path,
        env=env,
    )
    url = f"http://127.0.0.1:{port}/metadata"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"{url}?key=probe", timeout=1)
            except urllib.error.HTTPError as e:
                assert e.code == 404
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
                time.sleep(0.1)
        with TransferEngine() as a, TransferEngine() as b:
            assert a.initialize("127.0.0.1:12345", url, "tcp", "") == 0, a.last_error()
            assert b.initialize("127.0.0.1:12347", url, "tcp", "") == 0, b.last_error()
            with urllib.request.urlopen(f"{url}?key=" + urllib.parse.quote(PREFIX + "127.0.0.1:12345", safe="")) as r:
                assert json.loads(r.read())["address"] == f"127.0.0.1:{a.get_rpc_port()}"
            pair_by_name(a, b, "127.0.0.1:12345", "127.0.0.1:12347")
            assert b.send_probe("unreachable_peer:9") != 0
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(f"{url}?key=" + urllib.parse.quote(PREFIX + "127.0.0.1:12345", safe=""))
        assert gone.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as nokey:
            urllib.request.urlopen(url)
        assert nokey.value.code == 400
        # A body announced past the bound is refused before it is read
        # (nothing is sent after the headers here).
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"PUT /metadata?key=big HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n")
            assert s.recv(64).startswith(b"HTTP/1.1 413"), "an oversized body was waited for"
        with pytest.raises(urllib.error.HTTPError) as gone:
            urllib.request.urlopen(f"{url}?key=big")
        assert gone.value.code == 404
    finally:
        proc.terminate()
        proc.wait(10)

"""NIXL's metadata exchange between kvmove agents: the listener an agent
made with ``enable_listen_thread=True`` runs, ``send_local_metadata``,
``fetch_remote_metadata``, ``invalidate_local_metadata`` and partial
metadata (``get_partial_agent_metadata``, ``send_partial_agent_metadata``)
in one process and across two, as NIXL 1.5.1 answers them; partial
metadata refusing descriptors outside it; the listener against garbage
and oversized frames from a raw socket; its threads and sockets gone
after ``close``; a fetch from a port nobody listens on."""

import gc
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

from kvmove.nixl import (
    nixl_agent,
    nixl_agent_config,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotSupportedError,
)
from kvmove.nixl import _listen

from conftest import wait_until
from nixlflows import wait_state

HOST = "127.0.0.1"


@pytest.fixture
def agents():
    made = []

    def make(listen=True, port=0, name=None):
        a = nixl_agent(name or str(uuid.uuid4()), nixl_agent_config(True, listen, port))
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


def buffers(agent, *fills, size=4096):
    """Host buffers filled with ``fills``, registered on ``agent`` one
    region each; the arrays (kept alive by the caller)."""
    bufs = [np.full(size, f, dtype=np.uint8) for f in fills]
    agent.register_memory([(b.ctypes.data, size, 0, "") for b in bufs], "DRAM")
    return bufs


def xdescs(agent, bufs):
    return agent.get_xfer_descs([(b.ctypes.data, b.nbytes, 0) for b in bufs], "DRAM")


def listener_threads():
    return [t for t in threading.enumerate() if t.name.startswith("kvmove-nixl-listen")]


def test_push_fetch_and_invalidate_in_one_process(agents):
    target, init = agents(), agents()
    src = buffers(target, 7)
    dst = buffers(init, 0)
    port = target.listen_address()[1]
    assert target.listen_address()[0] == HOST and port > 0

    t0 = time.monotonic()
    assert init.fetch_remote_metadata(target.name, HOST, port) is None
    assert init.send_local_metadata(HOST, port) is None
    assert time.monotonic() - t0 < 0.5, "NIXL's calls return at once"
    assert wait_until(lambda: init.check_remote_metadata(target.name), timeout=10), "fetched"
    assert wait_until(lambda: target.check_remote_metadata(init.name), timeout=10), "pushed"
    assert init.check_remote_metadata(target.name, xdescs(init, src))

    h = init.initialize_xfer("READ", xdescs(init, dst), xdescs(init, src), target.name, b"read")
    init.transfer(h)
    assert wait_state(init, h) == "DONE" and np.array_equal(dst[0], src[0])
    init.release_xfer_handle(h)
    assert wait_until(lambda: target.check_remote_xfer_done(init.name, b"read"), timeout=10)

    # Pushed again (memory registered since), then invalidated: in order.
    more = buffers(init, 3)
    init.send_local_metadata(HOST, port)
    init.invalidate_local_metadata(HOST, port)
    assert wait_until(lambda: not target.check_remote_metadata(init.name), timeout=10), "invalidated"
    time.sleep(0.3)
    assert not target.check_remote_metadata(init.name), "the push before the invalidation did not land after it"
    assert init.check_remote_metadata(target.name), "only the invalidated agent is forgotten"
    init.send_local_metadata(HOST, port)
    assert wait_until(lambda: target.check_remote_metadata(init.name, xdescs(target, more)), timeout=10)


def test_listener_binds_the_advertised_host_and_refuses_a_taken_port(agents, monkeypatch):
    a = agents()
    host, port = a.listen_address()
    assert host == HOST, "loopback by default, never every interface"
    with pytest.raises(RuntimeError, match="bind"):
        agents(port=port)
    assert agents(listen=False).listen_address() is None
    monkeypatch.setenv("KVMOVE_NIXL_HOST", "127.0.0.2:0")
    assert agents().listen_address()[0] == "127.0.0.2"


def test_partial_metadata_covers_only_its_regions(agents):
    target, init = agents(), agents()
    first, second = buffers(target, 1), buffers(target, 2)
    dst = buffers(init, 0, 0)
    port = init.listen_address()[1]
    regs = lambda bufs: target.get_reg_descs([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")

    with pytest.raises(nixlNotFoundError, match="not loaded"):
        init.add_remote_agent(target.get_partial_agent_metadata(regs(first), False, ["UCX"]))
    with pytest.raises(nixlNotFoundError, match="registered whole"):
        target.get_partial_agent_metadata(target.get_reg_descs([(first[0].ctypes.data, 100, 0, "")], "DRAM"))
    with pytest.raises(KeyError):
        target.get_partial_agent_metadata(regs(first), True, ["NOPE"])

    target.send_partial_agent_metadata(regs(first), True, ["UCX"], HOST, port, "label_1")
    assert wait_until(lambda: init.check_remote_metadata(target.name, xdescs(init, first)), timeout=10)
    assert not init.check_remote_metadata(target.name, xdescs(init, second))
    with pytest.raises(nixlNotFoundError):
        init.prep_xfer_dlist(target.name, xdescs(init, second))
    for local in (xdescs(init, dst[:1]), [(dst[0].ctypes.data, 4096, 0)]):  # the fast path and the other
        with pytest.raises(nixlNotFoundError, match="not inside memory"):
            init.initialize_xfer("READ", local, xdescs(init, second), target.name)
    h = init.initialize_xfer("READ", xdescs(init, dst[:1]), xdescs(init, first), target.name)
    init.transfer(h)
    assert wait_state(init, h) == "DONE" and dst[0][0] == 1

    # The rest, without connection info: added to what was loaded.
    target.send_partial_agent_metadata(regs(second), False, [], HOST, port)
    assert wait_until(lambda: init.check_remote_metadata(target.name, xdescs(init, first + second)), timeout=10)
    h = init.initialize_xfer("READ", xdescs(init, dst[1:]), xdescs(init, second), target.name)
    init.transfer(h)
    assert wait_state(init, h) == "DONE" and dst[1][0] == 2
    assert init.prep_xfer_dlist(target.name, xdescs(init, second)) is not None

    # Connection info only (an empty list): the agent is known, no region is.
    other = agents()
    empty = target.get_reg_descs([], "DRAM")
    assert other.add_remote_agent(target.get_partial_agent_metadata(empty)) == target.name.encode()
    assert other.check_remote_metadata(target.name)
    assert not other.check_remote_metadata(target.name, xdescs(other, first))


def test_metadata_of_a_loaded_agent(agents):
    a, b = agents(listen=False), agents(listen=False)
    first = buffers(b, 1)
    a.add_remote_agent(b.get_agent_metadata())
    late = buffers(b, 2)
    assert a.add_remote_agent(b.get_agent_metadata()) == b.name.encode(), "adds the regions, as NIXL"
    assert a.check_remote_metadata(b.name, xdescs(a, first + late))
    restarted = agents(listen=False, name=b.name)
    with pytest.raises(nixlNotAllowedError, match="other connection info"):
        a.add_remote_agent(restarted.get_agent_metadata())
    with pytest.raises(nixlInvalidParamError, match="own"):
        a.add_remote_agent(a.get_agent_metadata())
    with pytest.raises(nixlMismatchError):
        a.add_remote_agent(b"KVMOVE-NIXL/1\n" + json.dumps({"name": "x", "regions": [[-1, 5]]}).encode())


def test_a_fetch_from_nobody_stays_false(agents, caplog):
    a = agents()
    with socket.socket() as s:
        s.bind((HOST, 0))
        dead = s.getsockname()[1]  # bound, not listening: refused
        with caplog.at_level(logging.ERROR, logger="kvmove.nixl"):
            t0 = time.monotonic()
            assert a.fetch_remote_metadata("nobody", HOST, dead) is None
            assert time.monotonic() - t0 < 0.5
            assert wait_until(lambda: "fetch_remote_metadata" in caplog.text, timeout=5)
    assert "failed" in caplog.text
    assert not wait_until(lambda: a.check_remote_metadata("nobody"), timeout=1)
    a.send_local_metadata("localhost", dead)  # not an IP address: logged, as NIXL
    assert wait_until(lambda: "not an IP address" in caplog.text, timeout=5)


def test_no_address_and_a_central_metadata_server(agents, monkeypatch):
    a = agents()
    monkeypatch.delenv("NIXL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("NIXL_TCPSTORE_ENDPOINT", raising=False)
    for call in (a.send_local_metadata, lambda: a.fetch_remote_metadata("x"), a.invalidate_local_metadata):
        with pytest.raises(nixlInvalidParamError):
            call()
    monkeypatch.setenv("NIXL_ETCD_ENDPOINTS", "http://127.0.0.1:2379")
    with pytest.raises(nixlNotSupportedError, match="NIXL_ETCD_ENDPOINTS"):
        a.send_local_metadata()
    with pytest.raises(nixlNotSupportedError, match="NIXL_ETCD_ENDPOINTS"):
        a.send_partial_agent_metadata(a.get_reg_descs([], "DRAM"), True, label="l")


def frame(kind, payload, length=None):
    n = len(payload) if length is None else length
    return struct.pack(">4scI", b"KVMX", kind, n) + payload


def closed_by_peer(s, timeout=3.0):
    """Whether the listener closed ``s`` within ``timeout`` (what it sent
    first, its nonce, read and dropped)."""
    s.settimeout(timeout)
    try:
        while s.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def request(s, kind, payload, nonce, seq=0, secret=None):
    """Sends a request with its proof on ``s``; the answer and its proof."""
    s.sendall(frame(kind, payload) + frame(_listen.PROOF, _listen.proof(secret, b"request", nonce, seq, kind, payload)))
    return _listen.recv_frame(s)


def test_listener_survives_garbage_and_oversized_frames(agents):
    a, b = agents(), agents()
    keep = buffers(b, 1)  # noqa: F841 (registered while the agent lives)
    addr = a.listen_address()
    # Garbage, a length over the limit (closed before any body is read),
    # a bad kind, a frame cut short: each connection closed.
    for junk in (
        b"\xff" * 64,
        frame(b"L", b"", length=_listen.MAX_FRAME + 1),
        frame(b"L", b"", length=0xFFFFFFFF),
        frame(b"Z", b"abc"),
        b"GET / HTTP/1.1\r\n\r\n",
    ):
        with socket.create_connection(addr) as s:
            s.sendall(junk)
            assert closed_by_peer(s), junk[:16]
    with socket.create_connection(addr) as s:
        s.sendall(frame(b"L", b"x" * 100, length=1000))  # then leaves mid-frame
    # Well framed, but not metadata: refused with an answer, nothing loaded.
    with socket.create_connection(addr) as s:
        s.settimeout(5)
        kind, nonce = _listen.recv_frame(s)
        assert kind == _listen.NONC and len(nonce) == _listen.NONCE_LEN
        kind, msg = request(s, b"L", b"KVMOVE-NIXL/1\n{not json", nonce)
        assert kind == b"E" and b"malformed" in msg
        assert _listen.recv_frame(s)[0] == _listen.PROOF
        kind, _ = request(s, b"I", a.name.encode(), nonce, seq=1)  # "forget yourself"
        assert kind == b"E"
    # A request without its proof frame: closed.
    with socket.create_connection(addr) as s:
        s.sendall(frame(b"S", b"") + frame(b"S", b""))
        assert closed_by_peer(s)
    # The listener still serves.
    b.send_local_metadata(*addr)
    assert wait_until(lambda: a.check_remote_metadata(b.name), timeout=10)
    assert len([t for t in listener_threads() if a.name[:20] in t.name]) == 1


def test_a_silent_connection_is_closed(agents, monkeypatch):
    monkeypatch.setattr(_listen, "IDLE_TIMEOUT", 0.5)
    a = agents()
    with socket.create_connection(a.listen_address()) as s:
        s.sendall(frame(b"L", b"x", length=10))
        assert closed_by_peer(s, timeout=5)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_threads_and_sockets_end_with_the_agent(agents):
    base_threads, base_fds = len(listener_threads()), open_fds()
    a = nixl_agent(str(uuid.uuid4()), nixl_agent_config(True, True, 0))
    b = agents()
    port = a.listen_address()[1]
    b.fetch_remote_metadata(a.name, HOST, port)
    b.send_local_metadata(HOST, port)
    assert wait_until(lambda: a.check_remote_metadata(b.name) and b.check_remote_metadata(a.name), timeout=10)
    assert len(listener_threads()) == base_threads + 2
    a.close()
    assert len(listener_threads()) == base_threads + 1, "close stops the listener"
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((HOST, port))  # the port is free again
    b.close()
    assert len(listener_threads()) == base_threads
    assert not [t for t in threading.enumerate() if t.name.endswith("-metadata")], "nor the metadata thread"
    assert wait_until(lambda: open_fds() <= base_fds + 1, timeout=5), (open_fds(), base_fds)

    # An agent dropped without close: its __del__ stops them too.
    c = nixl_agent(str(uuid.uuid4()), nixl_agent_config(True, True, 0))
    c.send_local_metadata(HOST, port)  # nobody there now: logged
    del c
    gc.collect()
    assert wait_until(lambda: len(listener_threads()) == base_threads, timeout=10)


PEER = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np
    from kvmove.nixl import nixl_agent, nixl_agent_config

    def wait_until(fn, timeout):
        deadline = time.monotonic() + timeout
        while not fn() and time.monotonic() < deadline:
            time.sleep(0.02)
        return fn()

    a = nixl_agent(sys.argv[1], nixl_agent_config(True, True, 0))
    buf = np.arange(8192, dtype=np.uint32).astype(np.uint8)
    a.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    print(json.dumps({"port": a.listen_address()[1], "addr": buf.ctypes.data, "len": buf.nbytes}), flush=True)
    peer = sys.stdin.readline().strip()
    print("have" if wait_until(lambda: a.check_remote_metadata(peer), timeout=20) else "missing", flush=True)
    print("forgot" if wait_until(lambda: not a.check_remote_metadata(peer), timeout=20) else "kept", flush=True)
    sys.stdin.readline()
    a.close()
    """
)


def test_push_fetch_and_invalidate_across_processes(agents, tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(PEER)
    name = str(uuid.uuid4())
    p = subprocess.Popen([sys.executable, str(script), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(p.stdout.readline())
        init = agents()
        dst = np.zeros(info["len"], dtype=np.uint8)
        init.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
        init.fetch_remote_metadata(name, HOST, info["port"])
        init.send_local_metadata(HOST, info["port"])
        p.stdin.write(init.name + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "have", "pushed"
        assert wait_until(lambda: init.check_remote_metadata(name), timeout=10), "fetched"
        h = init.initialize_xfer(
            "READ", init.get_xfer_descs([(dst.ctypes.data, dst.nbytes, 0)], "DRAM"),
            init.get_xfer_descs([(info["addr"], info["len"], 0)], "DRAM"), name,
        )  # fmt: skip
        init.transfer(h)
        assert wait_state(init, h) == "DONE"
        assert np.array_equal(dst, np.arange(8192, dtype=np.uint32).astype(np.uint8))
        init.release_xfer_handle(h)
        init.invalidate_local_metadata(HOST, info["port"])
        assert p.stdout.readline().strip() == "forgot"
        p.stdin.write("quit\n")
        p.stdin.flush()
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_with_a_secret_only_its_holders_load_forget_or_fetch(agents, monkeypatch):
    """With a shared secret (``KVMOVE_SECRET``) every request and answer
    proves it over the listener's nonce: a peer with the secret pushes and
    fetches; one with another secret, or none, loads nothing, forgets
    nothing and gets nothing; a request replayed on a new connection (a
    new nonce) is refused; and a caller loads no answer from a listener
    without the secret (an impostor)."""
    monkeypatch.setenv("KVMOVE_SECRET", "the-secret")
    a, b = agents(), agents()
    keep = buffers(a, 1), buffers(b, 2)  # noqa: F841 (registered while the agents live)
    addr = a.listen_address()
    b.send_local_metadata(*addr)
    assert wait_until(lambda: a.check_remote_metadata(b.name), timeout=10)
    b.fetch_remote_metadata(a.name, *addr)
    assert wait_until(lambda: b.check_remote_metadata(a.name), timeout=10)

    # Another secret: refused, nothing loaded; nor forgotten.
    monkeypatch.setenv("KVMOVE_SECRET", "another")
    c = agents(listen=False)
    c.send_local_metadata(*addr)
    c.invalidate_local_metadata(*addr)
    b_md = b.get_agent_metadata()
    with socket.create_connection(addr) as s:
        s.settimeout(5)
        _, nonce = _listen.recv_frame(s)
        kind, msg = request(s, _listen.INVL, b.name.encode(), nonce, secret=b"another")
        assert kind == _listen.ERR and b"authentication failed" in msg
    # A request proven on one connection, replayed on another.
    with socket.create_connection(addr) as s:
        s.settimeout(5)
        _, nonce = _listen.recv_frame(s)
        replay = frame(_listen.INVL, b.name.encode()) + frame(
            _listen.PROOF, _listen.proof(b"the-secret", b"request", nonce, 0, _listen.INVL, b.name.encode())
        )
    with socket.create_connection(addr) as s:
        s.settimeout(5)
        _listen.recv_frame(s)
        s.sendall(replay)
        assert _listen.recv_frame(s)[0] == _listen.ERR
    time.sleep(0.5)
    assert not a.check_remote_metadata(c.name)
    assert a.check_remote_metadata(b.name), "forgotten on a request without the secret"
    # With the secret, the raw exchange works (the answer proven).
    kind, md = _listen.exchange(HOST, addr[1], _listen.SEND, b"", b"the-secret")
    assert kind == _listen.LOAD and md == a.get_agent_metadata()
    kind, msg = _listen.exchange(HOST, addr[1], _listen.SEND, b"", None)
    assert kind == _listen.ERR and b"authentication failed" in msg, "metadata given to a peer without the secret"
    assert b_md == b.get_agent_metadata()

    # An impostor listener (no secret) gets nothing loaded by a caller
    # with the secret: its answer does not prove it.
    monkeypatch.delenv("KVMOVE_SECRET")
    impostor = agents()
    keep2 = buffers(impostor, 3)  # noqa: F841
    monkeypatch.setenv("KVMOVE_SECRET", "the-secret")
    b.fetch_remote_metadata(impostor.name, *impostor.listen_address())
    time.sleep(1.0)
    assert not b.check_remote_metadata(impostor.name)
    with pytest.raises(ValueError, match="does not prove"):
        _listen.exchange(HOST, impostor.listen_address()[1], _listen.SEND, b"", b"the-secret")


def test_protected_mode_serves_this_host_only(agents, monkeypatch):
    """Without a secret a listener serves only its own host: a connection
    it does not take for this host's (made so here: the test has no other
    host) is answered the protected-mode refusal and nothing else;
    ``KVMOVE_INSECURE=1`` serves it."""
    monkeypatch.delenv("KVMOVE_SECRET", raising=False)
    assert _listen.same_host("127.0.0.1", "10.0.0.5") and _listen.same_host("10.0.0.5", "10.0.0.5")
    assert _listen.same_host("::ffff:127.0.0.1", "10.0.0.5") and _listen.same_host("::1", "::1")
    assert not _listen.same_host("10.0.0.6", "10.0.0.5") and not _listen.same_host("junk", "10.0.0.5")
    monkeypatch.setattr(_listen, "same_host", lambda peer, local: False)
    a, b = agents(), agents(listen=False)
    keep = buffers(a, 1), buffers(b, 2)  # noqa: F841
    kind, msg = _listen.exchange(HOST, a.listen_address()[1], _listen.SEND, b"", None)
    assert kind == _listen.ERR and msg.decode() == _listen.PROTECTED
    b.send_local_metadata(*a.listen_address())
    time.sleep(0.5)
    assert not a.check_remote_metadata(b.name)
    monkeypatch.setenv("KVMOVE_INSECURE", "1")
    c = agents()
    b.send_local_metadata(*c.listen_address())
    assert wait_until(lambda: c.check_remote_metadata(b.name), timeout=10)

"""`send_probe` asks the peer, and a peer that comes back is usable again
at once (issue 16): a stopped (frozen) peer fails the probe even while an
endpoint to it exists; a writer that keeps writing to a killed and
restarted peer recovers without waiting out the breaker's cool-down."""

import os
import signal
import threading
import time

import numpy as np

from kvmove.mooncake import TransferEngine

from conftest import wait_until

# The default breaker cool-down (policy.breaker.cooldown_ms).
DEFAULT_COOLDOWN_S = 2.0


def make_engine() -> TransferEngine:
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error()
    return e


def test_send_probe_of_a_stopped_peer_fails_then_succeeds_after_sigcont(spawn_peer):
    decode = spawn_peer(nbytes=1 << 16)
    e = make_engine()
    buf = np.full(4096, 3, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    # A successful write: an endpoint to the peer exists from here on.
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) == 0, e.last_error()
    assert dict(e.stats())["endpoints"] >= 1
    assert e.send_probe(decode.session_id) == 0, e.last_error()

    os.kill(decode.proc.pid, signal.SIGSTOP)
    try:
        # The signal is delivered asynchronously: wait until every thread of
        # the peer is stopped, or a fast probe may still be answered.
        assert wait_until(lambda: _all_threads_stopped(decode.proc.pid), timeout=5, pause=0.001)
        t0 = time.monotonic()
        got = e.send_probe(decode.session_id)
        took = time.monotonic() - t0
        print(f"send_probe of a stopped peer: {got} after {took * 1000:.0f} ms ({e.last_error()})")
        assert got == -1, "a stopped peer must not look alive"
        assert took < 5.0, f"the probe of a stopped peer took {took:.2f} s"
        err = e.last_error()
        assert err is not None and err.is_transient, err
    finally:
        os.kill(decode.proc.pid, signal.SIGCONT)

    t0 = time.monotonic()
    assert wait_until(lambda: e.send_probe(decode.session_id) == 0, timeout=10, pause=0.05), e.last_error()
    print(f"send_probe after SIGCONT: 0 after {(time.monotonic() - t0) * 1000:.0f} ms")
    # The peer is usable again.
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) == 0, e.last_error()
    assert e.unregister_memory(buf.ctypes.data) == 0
    e.close()


def _all_threads_stopped(pid: int) -> bool:
    """Every thread of `pid` is in state T (stopped), per /proc."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        states = []
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                # The state follows the command name in parentheses.
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except OSError:
        return False
    return bool(states) and all(s == "T" for s in states)


def test_send_probe_of_a_killed_peer_fails_at_once(spawn_peer):
    decode = spawn_peer(nbytes=1 << 16)
    e = make_engine()
    buf = np.zeros(4096, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) == 0, e.last_error()
    decode.kill()
    t0 = time.monotonic()
    assert e.send_probe(decode.session_id) == -1
    assert time.monotonic() - t0 < 5.0
    e.close()


def test_writer_recovers_quickly_from_a_restarted_peer_without_probing(spawn_peer):
    """Default policy (2 s cool-down): the writer never calls send_probe;
    its writes fail fast while the breaker is open and succeed again
    within a fraction of the cool-down once the peer is back."""
    decode = spawn_peer(nbytes=1 << 16)
    port = decode.port
    e = make_engine()
    buf = np.full(4096, 9, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) == 0, e.last_error()

    breaker_open = threading.Event()
    stop = threading.Event()
    successes: list[float] = []
    failures: list[str] = []
    target = {"addr": decode.addr}

    def writer():
        while not stop.is_set() and not successes:
            if e.transfer_sync_write(decode.session_id, buf.ctypes.data, target["addr"], 4096) == 0:
                successes.append(time.monotonic())
                break
            err = e.last_error()
            kind = getattr(err, "kind", "?")
            failures.append(kind)
            if kind == "peer_unavailable":
                breaker_open.set()
            time.sleep(0.005)

    decode.kill()
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        assert breaker_open.wait(20), f"the breaker never opened: {failures[-5:]}"
        # The peer comes back on the same port (a new process).
        restarted = None
        deadline = time.monotonic() + 20
        while restarted is None and time.monotonic() < deadline:
            try:
                restarted = spawn_peer(host=f"127.0.0.1:{port}", nbytes=1 << 16)
            except RuntimeError:
                time.sleep(0.05)
        assert restarted is not None, "could not restart the peer on its port"
        ready = time.monotonic()
        target["addr"] = restarted.addr
        t.join(timeout=30)
        assert successes, f"the writer never recovered: {failures[-5:]}"
        recovery = max(0.0, successes[0] - ready)
        print(f"writer recovery after the peer restarted: {recovery * 1000:.0f} ms ({len(failures)} failed writes)")
        assert recovery < 1.0, f"recovery took {recovery:.2f} s (cool-down {DEFAULT_COOLDOWN_S} s)"
        assert e.send_probe(restarted.session_id) == 0, e.last_error()
    finally:
        stop.set()
        t.join(timeout=30)
    e.close()

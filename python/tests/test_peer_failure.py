"""A killed peer gives a clean failure; the same port restarted works again."""

import hashlib
import time

import numpy as np
import pytest

import kvmove
from kvmove.mooncake import TransferEngine

from conftest import wait_until


def test_killed_peer_fails_cleanly_then_restart_works(spawn_peer, monkeypatch):
    # Fast policy so the test does not sit in backoff or an open breaker.
    monkeypatch.setenv(
        "KVMOVE_POLICY",
        '{"retry": {"max_attempts": 2, "initial_backoff_ms": 10}, "breaker": {"cooldown_ms": 200}}',
    )
    decode = spawn_peer(nbytes=1 << 20)
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = np.full(1 << 20, 7, dtype=np.uint8)
    assert e.register_memory(buf.ctypes.data, buf.nbytes) == 0
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) == 0

    port = decode.port
    decode.kill()

    t0 = time.monotonic()
    assert e.transfer_sync_write(decode.session_id, buf.ctypes.data, decode.addr, 4096) < 0
    assert time.monotonic() - t0 < 30, "failure must be prompt, not a long stall"
    err = e.last_error()
    assert isinstance(err, kvmove.TransientError), err
    assert err.is_transient and err.kind in {
        "connection_refused",
        "connection_reset",
        "peer_unavailable",
        "peer_restarted",
        "handshake_failed",
        "timeout",
        "io",
    }, err
    assert e.send_probe(decode.session_id) != 0
    # Async and batch paths fail cleanly too.
    assert e.batch_transfer_async_write(decode.session_id, [buf.ctypes.data], [decode.addr], [16]) == 0
    assert e.batch_transfer_sync_write(decode.session_id, [buf.ctypes.data], [decode.addr], [16]) < 0

    # The peer comes back on the same port (a new process: new addresses).
    restarted = wait_until(lambda: _try_spawn(spawn_peer, f"127.0.0.1:{port}"), timeout=20)
    assert restarted, "could not restart the peer on its port"
    assert restarted.session_id == decode.session_id

    def attempt():
        return e.transfer_sync_write(restarted.session_id, buf.ctypes.data, restarted.addr, buf.nbytes) == 0

    assert wait_until(attempt, timeout=30, pause=0.1), e.last_error()
    assert restarted.ask("digest") == hashlib.sha256(buf.tobytes()).hexdigest()
    assert e.send_probe(restarted.session_id) == 0
    e.close()


def _try_spawn(spawn_peer, host):
    try:
        return spawn_peer(host=host, nbytes=1 << 20)
    except RuntimeError:
        return None


def test_pythonic_engine_raises_transient_on_dead_peer(spawn_peer):
    decode = spawn_peer(nbytes=1 << 16)
    with kvmove.Engine(policy={"retry": {"max_attempts": 1}}) as eng:
        buf = bytearray(4096)
        with eng.register(buf) as r, eng.connect(decode.session_id) as s:
            s.write(r.addr, decode.addr, 4096)
            decode.kill()
            with pytest.raises(kvmove.TransientError) as info:
                for _ in range(50):  # the first may still land in socket buffers
                    s.write(r.addr, decode.addr, 4096)
            assert info.value.is_transient
        # A session to a port nobody listens on fails at connect.
        with pytest.raises(kvmove.TransientError):
            eng.connect(decode.session_id)


def test_a_busy_target_is_retried_until_a_slot_frees():
    """Issue 27, item 2: a target at its connection limit answers Busy; the
    engine asks again with the policy's backoff, gives up with an error
    that says how many tries over how long, and gets through once the one
    slot frees while it is retrying."""
    import threading

    one = "[backend.tcp]\nmax_connections = 1\nlanes = 1\n"
    policy = {"retry": {"max_attempts": 6, "initial_backoff_ms": 40}}
    with kvmove.Engine(config=one) as target:
        dst = np.zeros(4096, dtype=np.uint8)
        rd = target.register(dst)
        holder = kvmove.Engine(config="[backend.tcp]\nlanes = 1\n")
        src = np.full(4096, 7, dtype=np.uint8)
        held = holder.connect(target.session_id)
        held.write(holder.register(src).addr, rd.addr, 4096)  # the one slot, in use
        with kvmove.Engine(config="[backend.tcp]\nlanes = 1\n", policy=policy) as me:
            start = time.monotonic()
            with pytest.raises(kvmove.TransientError) as info:
                me.connect(target.session_id)
            assert info.value.kind == "connection_refused", info.value
            assert "busy" in str(info.value) and "attempts: 6" in str(info.value), info.value
            assert time.monotonic() - start >= 0.04 + 0.08 + 0.16, "it backed off between tries"

            def free():
                time.sleep(0.15)
                held.close()
                holder.close()

            t = threading.Thread(target=free)
            t.start()
            with me.connect(target.session_id) as s:
                mine = np.full(4096, 9, dtype=np.uint8)
                s.write(me.register(mine).addr, rd.addr, 4096)
            t.join()
            assert (dst == 9).all()


def test_error_classes_come_from_the_one_table():
    """Issue 28, item 4: Python restates no classification; the kinds, and
    whether each is transient or a peer failure, come from Rust."""
    from kvmove import _native
    from kvmove.nixl import _from_kvmove, nixlBackendError, nixlRemoteDisconnectError

    kinds = _native.error_kinds()
    assert kinds["connection_reset"] == {"transient": True, "peer_failure": True, "reopens_segment": True}
    assert kinds["timeout"] == {"transient": True, "peer_failure": True, "reopens_segment": False}
    assert kinds["backpressure"] == {"transient": True, "peer_failure": False, "reopens_segment": False}
    assert kinds["out_of_bounds"] == {"transient": False, "peer_failure": False, "reopens_segment": False}
    assert kinds["invalid_handle"] == {"transient": False, "peer_failure": False, "reopens_segment": True}
    assert len(kinds) == 25
    for name, row in kinds.items():
        e = _native.make_error(name, "made in a test")
        assert e.kind == name
        assert e.is_transient == row["transient"] and e.is_peer_failure == row["peer_failure"]
        assert e.reopens_segment == row["reopens_segment"]
        assert isinstance(e, kvmove.TransientError if row["transient"] else kvmove.PermanentError)
        # NIXL calls every peer failure a remote disconnect.
        if row["peer_failure"]:
            assert isinstance(_from_kvmove(e, "test"), nixlRemoteDisconnectError), name
    assert isinstance(_from_kvmove(_native.make_error("backpressure", "x"), "test"), nixlBackendError)
    with pytest.raises(ValueError):
        _native.make_error("no_such_kind", "x")

"""Mooncake-style notifications (``notify=TransferNotify(name, msg)`` on the
transfer calls, ``get_notifies()`` on the target) between two processes
over TCP: a notification is delivered only after every byte of its
transfer landed, and a failed transfer sends none."""

import hashlib
import json

import numpy as np
import pytest

import kvmove
from kvmove.mooncake import TransferEngine, TransferNotify, TransferOpcode

from kvpeer import pattern

SIZE = 8 << 20
PAGE = 128 << 10
ROUNDS = 8


def make_engine() -> TransferEngine:
    e = TransferEngine()
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error()
    return e


def seen(target) -> dict:
    """The target's report of the next notification it received."""
    return json.loads(target.read_line())


def test_transfer_notify_class():
    n = TransferNotify("req-1", "done")
    assert (n.name, n.msg) == ("req-1", "done")
    assert n == TransferNotify(name="req-1", msg="done")
    assert n != TransferNotify("req-2", "done")
    assert (TransferNotify().name, TransferNotify().msg) == ("", "")
    assert TransferNotify(b"a", b"b") == TransferNotify("a", "b")
    n.msg = "changed"
    assert n.msg == "changed"
    assert "req-1" in repr(n)
    assert kvmove.TransferNotify is TransferNotify
    with pytest.raises(TypeError):
        TransferNotify(1, "x")


def test_notify_is_delivered_after_every_byte(spawn_peer):
    target = spawn_peer(nbytes=SIZE, script="notifypeer.py")
    e = make_engine()
    src = np.zeros(SIZE, dtype=np.uint8)
    base = src.ctypes.data
    assert e.register_memory(base, src.nbytes) == 0
    sid = target.session_id
    # Pages sent in a shuffled order, each to its own place.
    offsets = [int(o) * PAGE for o in np.random.default_rng(5).permutation(SIZE // PAGE)]
    bufs = [base + o for o in offsets]
    peers = [target.addr + o for o in offsets]
    lengths = [PAGE] * len(offsets)

    for r in range(ROUNDS):
        src[:] = pattern(100 + r, SIZE)
        digest = hashlib.sha256(src.tobytes()).hexdigest()
        n = TransferNotify(f"round-{r}", digest)
        way = r % 4
        if way == 0:
            ret = e.transfer_sync(sid, base, target.addr, SIZE, TransferOpcode.Write, n)
        elif way == 1:
            ret = e.batch_transfer_sync(sid, bufs, peers, lengths, TransferOpcode.Write, n)
        elif way == 2:
            ret = e.transfer_sync_write(sid, base, target.addr, SIZE, notify=n)
        else:
            ret = e.batch_transfer_sync_write(sid, bufs, peers, lengths, notify=n)
        assert ret == 0, e.last_error()
        got = seen(target)
        assert got["name"] == f"round-{r}" and got["msg"] == digest, got
        assert got["complete"], f"round {r}: the notification was seen before every byte had landed"

    # A read with a notification: the target learns its memory was read.
    back = np.zeros(PAGE, dtype=np.uint8)
    assert e.register_memory(back.ctypes.data, back.nbytes) == 0
    n = TransferNotify("read", digest)
    assert e.transfer_sync(sid, back.ctypes.data, target.addr, PAGE, TransferOpcode.Read, notify=n) == 0
    assert np.array_equal(back, src[:PAGE])
    assert seen(target)["name"] == "read"
    # Nothing comes back to the initiator.
    assert e.get_notifies() == []
    e.close()
    assert e.get_notifies() == []


def test_failed_transfer_sends_no_notification(spawn_peer):
    target = spawn_peer(nbytes=1 << 20, script="notifypeer.py")
    e = make_engine()
    src = pattern(7, 1 << 20)
    base = src.ctypes.data
    assert e.register_memory(base, src.nbytes) == 0
    sid = target.session_id
    write = TransferOpcode.Write

    # The remote range is outside the target's registered memory.
    assert e.transfer_sync(sid, base, target.addr + target.len, 4096, write, TransferNotify("bad-1", "x")) == -1
    assert e.last_error().kind == "out_of_bounds"
    assert e.batch_transfer_sync(sid, [base, base], [target.addr, 4096], [4096, 4096], write, TransferNotify("bad-2", "x")) == -1
    # The local range is not registered.
    assert e.transfer_sync(sid, 4096, target.addr, 4096, write, TransferNotify("bad-3", "x")) == -1
    # A notification too large for the wire is refused before anything moves.
    assert e.transfer_sync(sid, base, target.addr, 4096, write, TransferNotify("bad-4", "x" * 5000)) == -1
    assert e.last_error().kind == "invalid_request"
    # A wrong notify argument is a TypeError, as with pybind11.
    with pytest.raises(TypeError):
        e.transfer_sync(sid, base, target.addr, 4096, write, "not a notify")

    # Notifications of one sender arrive in order, so had any failed call
    # sent one, the target would report it before this one.
    digest = hashlib.sha256(src.tobytes()).hexdigest()
    assert e.transfer_sync(sid, base, target.addr, src.nbytes, write, TransferNotify("good", digest)) == 0
    got = seen(target)
    assert got["name"] == "good" and got["complete"], got
    e.close()

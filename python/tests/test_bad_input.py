"""Bad input gives negative codes or clear exceptions, never a crash."""

import numpy as np
import pytest

import kvmove
from kvmove.mooncake import TransferEngine


@pytest.fixture
def pair():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    src = np.arange(65536, dtype=np.uint8)
    dst = np.zeros(65536, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    yield a, b, src, dst, f"127.0.0.1:{b.get_rpc_port()}"
    a.close()
    b.close()


def kind(e):
    return e.last_error().kind


def test_local_address_checks(pair):
    a, b, src, dst, peer = pair
    s, d = src.ctypes.data, dst.ctypes.data
    assert a.transfer_sync_write(peer, s, d, 16) == 0
    other = np.zeros(16, dtype=np.uint8)
    assert a.transfer_sync_write(peer, other.ctypes.data, d, 16) == -1
    assert kind(a) == "unregistered"
    assert a.transfer_sync_write(peer, s + 65530, d, 16) == -1
    assert kind(a) == "out_of_bounds"
    assert a.transfer_sync_write(peer, s, d, 0) == 0, "zero bytes move nothing (0, as Mooncake)"
    assert a.transfer_sync_write(peer, 2**64 - 1, d, 16) == -1
    assert a.batch_transfer_sync_write(peer, [s, s], [d], [1, 1]) == -1
    assert kind(a) == "invalid_request"
    assert a.batch_transfer_sync_write(peer, [], [], []) == 0, "a batch of nothing (0, as Mooncake)"
    assert a.batch_transfer_async_write(peer, [s + 65536], [d], [1]) == 0
    assert a.get_batch_transfer_status([12345]) == -1
    assert a.transfer_check_status(12345) == -1
    assert np.all(dst[16:] == 0), "nothing but the valid write landed"


def test_remote_address_checks(pair):
    a, b, src, dst, peer = pair
    s, d = src.ctypes.data, dst.ctypes.data
    assert a.transfer_sync_write(peer, s, d + 65530, 16) == -1
    assert not a.last_error().is_transient
    assert a.transfer_sync_write(peer, s, 4096, 16) == -1
    assert a.transfer_sync_read(peer, s, 2**64 - 8, 16) == -1
    assert a.transfer_sync_write(peer, s, d, 16) == 0, "the session still works"


def test_bad_hostnames(pair):
    a, _, src, dst, _ = pair
    s = src.ctypes.data
    for name in ["", "nohost", "127.0.0.1", "127.0.0.1:notaport", "127.0.0.1:70000", "host.invalid:4000", "127.0.0.1:1"]:
        assert a.transfer_sync_write(name, s, dst.ctypes.data, 16) == -1, name
        assert isinstance(a.last_error(), kvmove.TransferError)
    assert a.send_probe("127.0.0.1:1") == -1


def test_wrong_types_raise_type_errors(pair):
    a, _, src, dst, peer = pair
    with pytest.raises(TypeError):
        a.transfer_sync_write(peer, "not an address", dst.ctypes.data, 16)
    with pytest.raises(TypeError):
        a.transfer_sync_write(123, src.ctypes.data, dst.ctypes.data, 16)
    with pytest.raises(TypeError):
        a.batch_transfer_sync_write(peer, src.ctypes.data, [dst.ctypes.data], [16])
    with pytest.raises(OverflowError):
        a.register_memory(-1, 16)
    with pytest.raises(TypeError):
        a.initialize("127.0.0.1")


def test_registration_rules(pair):
    a, _, src, _, _ = pair
    s = src.ctypes.data
    assert a.register_memory(s + 100, 10) == -7, "Mooncake's ERR_ADDRESS_OVERLAPPED"
    assert kind(a) == "already_registered"
    assert a.unregister_memory(s + 1) == -3, "Mooncake's ERR_ADDRESS_NOT_REGISTERED"
    assert a.register_memory(0, 10) == -1
    assert a.register_memory(s, 0) == -1
    assert a.batch_register_memory([1, 2], [1]) == -1
    assert a.write_bytes_to_buffer(12345, b"x", 1) == -1
    with pytest.raises(kvmove.PermanentError):
        a.read_bytes_from_buffer(12345, 1)


def test_uninitialized_and_closed_engines():
    e = TransferEngine()
    assert e.get_rpc_port() == -1
    assert e.register_memory(4096, 16) == -1
    assert e.transfer_sync_write("127.0.0.1:1", 4096, 4096, 16) == -1
    assert e.initialize("127.0.0.1", "redis://127.0.0.1:6379", "tcp", "") == -1
    assert e.last_error().kind == "unsupported"
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "carrier-pigeon", "") == -1
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == -1, "twice"
    e.close()
    e.close()
    assert e.register_memory(4096, 16) == -1
    assert e.last_error().kind == "shutdown"


def test_pythonic_errors():
    with kvmove.Engine() as eng:
        with pytest.raises(kvmove.PermanentError) as info:
            eng.register(b"read-only bytes")
        assert info.value.kind == "invalid_request"
        with pytest.raises(TypeError):
            eng.register(12345)
        buf = bytearray(4096)
        r = eng.register(buf)
        with pytest.raises(BufferError):
            buf.extend(b"x")  # registered memory cannot be resized
        with pytest.raises(kvmove.PermanentError) as info:
            eng.register(memoryview(buf)[:16])
        assert info.value.kind == "already_registered"
        with pytest.raises(kvmove.TransferError) as info:
            eng.connect("no-port")
        assert info.value.kind == "invalid_request" and not info.value.is_transient
        with eng.connect(eng.session_id) as s:
            with pytest.raises(kvmove.PermanentError) as info:
                s.write(r.addr + 4000, r.addr, 200)
            assert info.value.kind == "out_of_bounds"
            assert info.value.context.get("request") == "0"
        r.unregister()
        r.unregister()  # idempotent on the Python side
        buf.extend(b"x")  # resizable again
        with pytest.raises(kvmove.PermanentError):
            eng._native.unregister(r.addr)

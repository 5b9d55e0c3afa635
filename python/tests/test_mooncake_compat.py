"""Return codes and all-or-nothing rules that match Mooncake's
``mooncake.engine.TransferEngine`` (issue 16)."""

import numpy as np
import pytest

import kvmove
from kvmove.mooncake import TransferEngine


@pytest.fixture
def pair():
    a, b = TransferEngine(), TransferEngine()
    assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    yield a, b
    a.close()
    b.close()


def test_transfer_submit_write_failure_is_batch_id_zero(pair):
    a, b = pair
    src = np.arange(4096, dtype=np.uint8)
    dst = np.zeros(4096, dtype=np.uint8)
    assert a.register_memory(src.ctypes.data, src.nbytes) == 0
    assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
    peer = b.get_session_id()
    other = np.zeros(16, dtype=np.uint8)
    # Mooncake's invalid batch id is 0 (its tests check for it), not -1.
    assert a.transfer_submit_write(peer, other.ctypes.data, dst.ctypes.data, 16) == 0
    assert a.last_error().kind == "unregistered"
    assert a.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 0) == 0
    assert a.transfer_submit_write("127.0.0.1:1", src.ctypes.data, dst.ctypes.data, 16) == 0
    e = TransferEngine()
    assert e.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 16) == 0, "not initialized"
    bid = a.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 16)
    assert bid > 0
    while (st := a.transfer_check_status(bid)) == 0:
        pass
    assert st == 1 and np.array_equal(dst[:16], src[:16])

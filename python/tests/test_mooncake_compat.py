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
    # Zero bytes: a batch with nothing to move, complete at once (Mooncake).
    zero = a.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 0)
    assert zero > 0 and a.transfer_check_status(zero) == 1
    assert a.transfer_submit_write("127.0.0.1:1", src.ctypes.data, dst.ctypes.data, 16) == 0
    e = TransferEngine()
    assert e.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 16) == 0, "not initialized"
    bid = a.transfer_submit_write(peer, src.ctypes.data, dst.ctypes.data, 16)
    assert bid > 0
    while (st := a.transfer_check_status(bid)) == 0:
        pass
    assert st == 1 and np.array_equal(dst[:16], src[:16])


def registered_count(e):
    return dict(e.stats())["regions"]


def test_batch_register_memory_is_all_or_nothing(pair):
    a, _ = pair
    buf = np.zeros(3 * 65536, dtype=np.uint8)
    A, B = buf.ctypes.data, buf.ctypes.data + 65536
    before = registered_count(a)
    # An overlap inside the batch: nothing is registered, and the retry of
    # the corrected call works.
    assert a.batch_register_memory([A, B, A + 100], [4096, 4096, 16]) == -7
    assert a.last_error().kind == "already_registered"
    assert registered_count(a) == before
    # A zero-length entry: the same.
    assert a.batch_register_memory([A, B], [4096, 0]) == -1
    assert registered_count(a) == before
    # Different lengths of the two lists.
    assert a.batch_register_memory([A, B], [4096]) == -1
    assert registered_count(a) == before
    assert a.batch_register_memory([A, B], [4096, 4096]) == 0
    assert registered_count(a) == before + 2
    # Overlap with an existing registration: nothing new is registered.
    C = buf.ctypes.data + 2 * 65536
    assert a.batch_register_memory([C, B + 8], [4096, 8]) == -7
    assert a.last_error().kind == "already_registered"
    assert registered_count(a) == before + 2
    assert a.batch_register_memory([C], [4096]) == 0
    assert a.batch_unregister_memory([A, B, C]) == 0
    assert registered_count(a) == before


def test_batch_unregister_memory_is_all_or_nothing(pair):
    a, _ = pair
    buf = np.zeros(2 * 65536, dtype=np.uint8)
    A, B = buf.ctypes.data, buf.ctypes.data + 65536
    assert a.batch_register_memory([A, B], [4096, 4096]) == 0
    n = registered_count(a)
    assert a.batch_unregister_memory([A, B + 1]) == -3, "B + 1 is no region's start"
    assert a.last_error().kind == "unregistered"
    assert registered_count(a) == n, "A is still registered"
    assert a.batch_unregister_memory([A, A]) == -1
    assert registered_count(a) == n
    assert a.batch_unregister_memory([A, B]) == 0
    assert registered_count(a) == n - 2


def test_mc_force_tcp_runs_rdma_callers_over_tcp(monkeypatch):
    monkeypatch.delenv("KVMOVE_PROTOCOL", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    if not kvmove._native.HAS_RDMA:
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == -1
        assert e.last_error().kind == "unsupported"
        assert "MC_FORCE_TCP" in e.last_error().message
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    a, b = TransferEngine(), TransferEngine()
    try:
        # What SGLang calls on an RDMA-less machine with Mooncake's switch set.
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
        assert b.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "mlx5_0") == 0
        src = np.arange(4096, dtype=np.uint8)
        dst = np.zeros(4096, dtype=np.uint8)
        assert a.register_memory(src.ctypes.data, src.nbytes) == 0
        assert b.register_memory(dst.ctypes.data, dst.nbytes) == 0
        assert a.transfer_sync_write(b.get_session_id(), src.ctypes.data, dst.ctypes.data, 4096) == 0
        assert np.array_equal(src, dst)
    finally:
        a.close()
        b.close()
    if not kvmove._native.HAS_RDMA:
        monkeypatch.setenv("MC_FORCE_TCP", "0")
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == -1, "MC_FORCE_TCP=0 does not force"


# Every method of Mooncake's pybind class mooncake.engine.TransferEngine
# (mooncake-integration/transfer_engine/transfer_engine_py.cpp).
MOONCAKE_METHODS = [
    "initialize", "initialize_ext", "get_rpc_port", "allocate_managed_buffer", "free_managed_buffer",
    "transfer_sync_write", "transfer_sync_read", "batch_transfer_sync_write", "batch_transfer_sync_read",
    "batch_transfer_async_write", "batch_transfer_async_read", "transfer_sync", "batch_transfer_sync",
    "batch_transfer_async", "transfer_write_on_cuda", "transfer_read_on_cuda", "batch_transfer_write_on_cuda",
    "batch_transfer_read_on_cuda", "get_batch_transfer_status", "transfer_submit_write", "transfer_check_status",
    "write_bytes_to_buffer", "read_bytes_from_buffer", "register_memory", "unregister_memory",
    "batch_register_memory", "batch_unregister_memory", "get_local_topology", "get_first_buffer_address",
    "warmup_efa_segment", "get_notifies", "send_probe", "get_engine", "get_engine_ptr",
]  # fmt: skip


def compat_table():
    """{method: status} from the README's compatibility table."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text.split("## Mooncake compatibility", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or cells[1] not in ("supported", "differs", "not supported"):
            continue
        for name in re.findall(r"`(?:TransferEngine\.)?(\w+)", cells[0]):
            rows.setdefault(name, cells[1])
    return rows


def test_readme_compat_table_lists_every_mooncake_method():
    table = compat_table()
    for name in MOONCAKE_METHODS:
        assert name in table, f"{name} is missing from python/README.md's compatibility table"
        provided = hasattr(TransferEngine, name)
        assert provided == (table[name] != "not supported"), f"{name}: table says {table[name]!r}"
    assert table["TransferOpcode"] == "supported" and TransferEngine.TransferOpcode.Write == 1


UNMODIFIED_CLIENT = """
import numpy as np
from mooncake.engine import TransferEngine

import kvmove.mooncake

assert TransferEngine is kvmove.mooncake.TransferEngine
decode, prefill = TransferEngine(), TransferEngine()
assert decode.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
assert prefill.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", "") == 0
dst = np.zeros(8192, dtype=np.uint8)
src = np.arange(8192, dtype=np.uint8)
assert decode.register_memory(dst.ctypes.data, dst.nbytes) == 0
assert prefill.register_memory(src.ctypes.data, src.nbytes) == 0
session = f"127.0.0.1:{decode.get_rpc_port()}"
assert prefill.batch_transfer_sync_write(session, [src.ctypes.data], [dst.ctypes.data], [8192]) == 0
assert np.array_equal(src, dst)
prefill.close(); decode.close()
print("ok")
"""


def test_unmodified_mooncake_import_gets_kvmove(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    shim = Path(__file__).resolve().parent.parent / "mooncake-shim"
    env = dict(os.environ, MC_FORCE_TCP="1")
    env.pop("KVMOVE_PROTOCOL", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(shim), env.get("PYTHONPATH", "")] if p)
    # From an empty directory, so `kvmove` is the installed package.
    out = subprocess.run(
        [sys.executable, "-c", UNMODIFIED_CLIENT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

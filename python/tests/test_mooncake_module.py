"""Module-level names of Mooncake's ``mooncake.engine`` that programs
(and Mooncake's own tests) read before making an engine."""

import os
import subprocess
import sys
from pathlib import Path

import kvmove.mooncake

# Mooncake's build flags (pybind module attributes of mooncake.engine,
# mooncake-integration/transfer_engine/transfer_engine_py.cpp).
SUPPORT_FLAGS = [
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "SUPPORT_INTRA_NVLINK",
]


def test_support_flags_are_false():
    # kvmove has none of the optional transports or CUDA stream methods the
    # flags announce; a caller checking them must not take those paths.
    for name in SUPPORT_FLAGS:
        assert getattr(kvmove.mooncake, name) is False, name
        assert name in kvmove.mooncake.__all__
    assert not hasattr(kvmove.mooncake.TransferEngine, "transfer_write_on_cuda")


SHIM_CLIENT = """
from mooncake import engine
flags = [engine.SUPPORT_CUDA, engine.SUPPORT_EFA, engine.SUPPORT_HIP,
         engine.SUPPORT_MNNVL, engine.SUPPORT_MUSA, engine.SUPPORT_INTRA_NVLINK]
assert flags == [False] * 6, flags
import kvmove.mooncake
assert engine.TransferEngine is kvmove.mooncake.TransferEngine
print("ok")
"""


def test_shim_exports_support_flags(tmp_path):
    shim = Path(__file__).resolve().parent.parent / "mooncake-shim"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(shim), env.get("PYTHONPATH", "")] if p)
    out = subprocess.run(
        [sys.executable, "-c", SHIM_CLIENT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_shm_protocol_runs_tcp(monkeypatch):
    # Mooncake's "shm" is its same-host transport; kvmove runs it as TCP
    # (loopback for a same-host peer). Nothing forces TCP here.
    monkeypatch.delenv("KVMOVE_PROTOCOL", raising=False)
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    TransferEngine = kvmove.mooncake.TransferEngine
    with TransferEngine() as a, TransferEngine() as b:
        assert a.initialize("127.0.0.1", "P2PHANDSHAKE", "shm", "") == 0
        assert b.initialize_ext("127.0.0.1", "P2PHANDSHAKE", " SHM ", "", "p2p") == 0
        src = a.allocate_managed_buffer(4096)
        dst = b.allocate_managed_buffer(4096)
        assert src and dst
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        assert a.write_bytes_to_buffer(src, b"same host", 9) == 0
        assert a.transfer_sync_write(peer, src, dst, 9) == 0
        assert b.read_bytes_from_buffer(dst, 9) == b"same host"
        assert a.write_bytes_to_buffer(src, bytes(9), 9) == 0
        assert a.transfer_sync_read(peer, src, dst, 9) == 0
        assert a.read_bytes_from_buffer(src, 9) == b"same host"
        # Freed memory is no longer reachable by the peer.
        assert b.free_managed_buffer(dst, 4096) == 0
        assert a.transfer_sync_write(peer, src, dst, 9) != 0
    # Other protocols kvmove does not run are still refused.
    for protocol in ("nvlink", "hip", "nvlink_intra", "efa", "shmem"):
        e = TransferEngine()
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") == -1, protocol
        assert e.last_error().kind == "unsupported"
        e.close()

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

"""CUDA device memory through both Python APIs, on a real GPU (issue 24).
Skipped where there is no CUDA driver or device (every CI machine: there
``test_device_memory.py`` carries the same paths on a fake device); run by
``scripts/gpu-tests.sh`` on a machine with an NVIDIA GPU.

Memory is allocated with the CUDA driver API through ctypes (no torch
needed), registered by pointer as serving engines do, moved between two
engines over TCP and read back with ``cuMemcpyDtoH``."""

import ctypes
import os
import uuid

import numpy as np
import pytest

import kvmove
from kvmove.devices import device_providers
from kvmove.mooncake import TransferEngine
from kvmove.nixl import nixl_agent, nixl_agent_config

NBYTES = 8 << 20


def _unavailable(why: str) -> None:
    """Skips, except under ``scripts/gpu-tests.sh`` (``KVMOVE_REQUIRE_CUDA=1``),
    where a GPU was found and a skip would let the script claim tests that
    did not run."""
    if os.environ.get("KVMOVE_REQUIRE_CUDA") == "1":
        pytest.fail(f"KVMOVE_REQUIRE_CUDA=1 but {why}")
    pytest.skip(why)


class Cuda:
    """The few driver calls the tests need."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError:
            _unavailable("no CUDA driver library (libcuda.so.1) here")
        if self.lib.cuInit(0) != 0:
            _unavailable("cuInit failed: no usable CUDA device")
        n = ctypes.c_int()
        self.check(self.lib.cuDeviceGetCount(ctypes.byref(n)), "cuDeviceGetCount")
        if n.value == 0:
            _unavailable("no CUDA device")
        dev, self.ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
        self.ptrs = []

    @staticmethod
    def check(rc: int, what: str) -> None:
        assert rc == 0, f"{what} failed with CUresult {rc}"

    def alloc(self, n: int) -> int:
        p = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), "cuMemAlloc")
        self.ptrs.append(p.value)
        return p.value

    def put(self, dst: int, data: bytes) -> None:
        self.check(self.lib.cuMemcpyHtoD_v2(ctypes.c_uint64(dst), data, ctypes.c_size_t(len(data))), "cuMemcpyHtoD")

    def get(self, src: int, n: int) -> bytes:
        out = ctypes.create_string_buffer(n)
        self.check(self.lib.cuMemcpyDtoH_v2(out, ctypes.c_uint64(src), ctypes.c_size_t(n)), "cuMemcpyDtoH")
        return out.raw

    def close(self) -> None:
        for p in self.ptrs:
            self.lib.cuMemFree_v2(ctypes.c_uint64(p))


@pytest.fixture
def cuda():
    c = Cuda()
    yield c
    c.close()


def pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8).tobytes()


def test_mooncake_moves_cuda_memory(cuda):
    a, b = TransferEngine(), TransferEngine()
    for e in (a, b):
        assert e.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, e.last_error()
    try:
        src, dst = cuda.alloc(NBYTES), cuda.alloc(NBYTES)
        cuda.put(src, pattern(1, NBYTES))
        assert a.register_memory(src, NBYTES) == 0, a.last_error()
        assert b.register_memory(dst, NBYTES) == 0, b.last_error()
        assert "cuda" in device_providers()
        peer = f"127.0.0.1:{b.get_rpc_port()}"
        assert a.transfer_sync_write(peer, src, dst, NBYTES) == 0, a.last_error()
        assert cuda.get(dst, NBYTES) == pattern(1, NBYTES)
        cuda.put(dst, pattern(2, NBYTES))
        assert a.transfer_sync_read(peer, src, dst, NBYTES) == 0, a.last_error()
        assert cuda.get(src, NBYTES) == pattern(2, NBYTES)
    finally:
        a.close()
        b.close()


def test_nixl_vram_and_engine_register_address(cuda):
    src, dst = cuda.alloc(NBYTES), cuda.alloc(NBYTES)
    cuda.put(src, pattern(3, NBYTES))
    with kvmove.Engine() as e:
        r = e.register_address(dst, NBYTES, "device:0")
        assert r.kind == "device:0"
        agent = nixl_agent(f"cuda-{uuid.uuid4()}", nixl_agent_config())
        try:
            agent.register_memory([(src, NBYTES, 0, "")], "VRAM")
            with e.connect(agent._engine.session_id) as s:
                s.read(dst, src, NBYTES)
            assert cuda.get(dst, NBYTES) == pattern(3, NBYTES)
        finally:
            agent.close()

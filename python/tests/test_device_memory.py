"""Device (GPU) memory through both Python APIs (issue 24), on
``kvmove.devices.FakeDevice``: memory the host cannot touch (any host
access is a SIGSEGV), reached only through its provider. Registered by
pointer (Mooncake), as ``"VRAM"`` (NIXL) and as an object
(``Engine.register``), moved between two processes over TCP, and checked
by reading the device memory back through the device."""

import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pytest

import kvmove
from kvmove.devices import FakeDevice, device_providers, memory_of
from kvmove.nixl import nixl_agent, nixl_agent_config, nixlInvalidParamError, nixlNotSupportedError

from devpeer import DEVICE as PEER_DEVICE
from devpeer import pattern

PAGE = 4096
NBYTES = 64 * PAGE


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.fixture
def device():
    d = FakeDevice(0, 4 * NBYTES)
    yield d
    d.close()


def test_the_fake_device_faults_on_host_access():
    """The property every other test relies on: reading fake device memory
    as host memory kills the process."""
    code = (
        "import ctypes\n"
        "from kvmove.devices import FakeDevice\n"
        "d = FakeDevice(0, 4096)\n"
        "ctypes.string_at(d.alloc(4096), 1)\n"
    )
    # From the tests' directory: `-c` puts the working directory first on
    # sys.path, and from python/ that is the source package, not the wheel.
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, cwd=here)
    assert r.returncode == -signal.SIGSEGV, (r.returncode, r.stderr[-2000:])


def test_providers_are_found_while_open():
    before = device_providers()  # ["cuda"] on a machine with a GPU
    assert "fake" not in before
    with FakeDevice(2, PAGE) as d:
        assert device_providers() == before + ["fake"]
        a = d.alloc(PAGE)
        d.write(a, b"kv")
        assert d.read(a, 2) == b"kv"
        with pytest.raises(kvmove.TransferError):
            d.read(a, 2 * PAGE)  # past the device's memory
    assert device_providers() == before


def test_mooncake_moves_device_memory_between_processes(spawn_peer, device, mooncake):
    """Prefill (here) registers device memory by pointer alone, as
    Mooncake's callers do; decode (another process) did the same. Pages
    go device to device in a shuffled order, then back, then host to
    device and device to host."""
    decode = spawn_peer(nbytes=NBYTES, device="mooncake", script="devpeer.py")
    assert decode.info["providers"][-1:] == ["fake"]
    kv = pattern(1, NBYTES)
    src = device.alloc(NBYTES)
    device.write(src, kv)
    assert mooncake.register_memory(src, NBYTES, "cuda:0") == 0, mooncake.last_error()

    slots = np.random.default_rng(7).permutation(NBYTES // PAGE)
    ret = mooncake.batch_transfer_sync_write(
        decode.session_id,
        [src + i * PAGE for i in range(len(slots))],
        [decode.addr + int(s) * PAGE for s in slots],
        [PAGE] * len(slots),
    )
    assert ret == 0, mooncake.last_error()
    want = bytearray(NBYTES)
    for i, s in enumerate(slots):
        want[int(s) * PAGE : (int(s) + 1) * PAGE] = kv[i * PAGE : (i + 1) * PAGE]
    assert decode.ask("digest") == sha(bytes(want))

    # Read back, device to device, into a second device range.
    back = device.alloc(NBYTES)
    assert mooncake.register_memory(back, NBYTES) == 0, mooncake.last_error()
    assert mooncake.transfer_sync_read(decode.session_id, back, decode.addr, NBYTES) == 0, mooncake.last_error()
    assert device.read(back, NBYTES) == bytes(want)

    # Host to device and device to host.
    host = np.frombuffer(bytearray(pattern(2, NBYTES)), dtype=np.uint8)
    assert mooncake.register_memory(host.ctypes.data, NBYTES) == 0, mooncake.last_error()
    assert mooncake.transfer_sync_write(decode.session_id, host.ctypes.data, decode.addr, NBYTES) == 0
    assert decode.ask("digest") == sha(host.tobytes())
    assert decode.ask("fill 3") == "ok"
    assert mooncake.transfer_sync_read(decode.session_id, host.ctypes.data, decode.addr, NBYTES) == 0
    assert host.tobytes() == pattern(3, NBYTES)
    for a in (src, back, host.ctypes.data):
        assert mooncake.unregister_memory(a) == 0


def test_failed_device_copies_are_errors_and_transient_ones_retried(spawn_peer, device, mooncake):
    """A device copy that fails once is retried by the engine's policy (an
    I/O error is transient); one that keeps failing ends the transfer with
    -1 and the device's error, and the next transfer works."""
    decode = spawn_peer(nbytes=NBYTES, device="mooncake", script="devpeer.py")
    src = device.alloc(NBYTES)
    device.write(src, pattern(4, NBYTES))
    assert mooncake.register_memory(src, NBYTES) == 0, mooncake.last_error()

    device.fail_copies(1)
    assert mooncake.transfer_sync_write(decode.session_id, src, decode.addr, PAGE) == 0, mooncake.last_error()
    assert device.failures_left == 0

    device.fail_copies(1000)
    assert mooncake.transfer_sync_write(decode.session_id, src, decode.addr, NBYTES) == -1
    err = mooncake.last_error()
    assert "device 0" in str(err) and err.is_transient, err
    device.fail_copies(0)
    assert mooncake.transfer_sync_write(decode.session_id, src, decode.addr, NBYTES) == 0, mooncake.last_error()
    assert decode.ask("digest") == sha(pattern(4, NBYTES))


def test_nixl_moves_vram_between_processes(spawn_peer, device):
    """NIXL: both agents register ``"VRAM"`` descriptors with their device
    index; a WRITE with a notification lands in the peer's device memory
    before the notification is seen; a READ brings it back."""
    peer = spawn_peer(nbytes=NBYTES, device="nixl", script="devpeer.py")
    agent = nixl_agent(f"dev-{uuid.uuid4()}", nixl_agent_config())
    try:
        assert agent.get_backend_mem_types("UCX") == ["DRAM", "VRAM"]
        src = device.alloc(NBYTES)
        device.write(src, pattern(5, NBYTES))
        agent.register_memory([(src, NBYTES, device.index, "")], "VRAM")
        remote = agent.add_remote_agent(bytes.fromhex(peer.info["metadata"]))
        local = agent.get_xfer_descs([(src + i * PAGE, PAGE, device.index) for i in range(NBYTES // PAGE)], "VRAM")
        far = agent.get_xfer_descs(
            [(peer.addr + i * PAGE, PAGE, PEER_DEVICE) for i in reversed(range(NBYTES // PAGE))], "VRAM"
        )
        h = agent.initialize_xfer("WRITE", local, far, remote, b"layer-0")
        assert agent.transfer(h) in ("PROC", "DONE")
        assert json.loads(peer.ask("notifs 1 20")) == [[agent.name, "layer-0"]]
        want = bytearray(NBYTES)
        data = pattern(5, NBYTES)
        n = NBYTES // PAGE
        for i in range(n):
            j = n - 1 - i
            want[j * PAGE : (j + 1) * PAGE] = data[i * PAGE : (i + 1) * PAGE]
        assert peer.ask("digest") == sha(bytes(want))

        back = device.alloc(NBYTES)
        agent.register_memory([(back, NBYTES, device.index, "")], "VRAM")
        h = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs([(back, NBYTES, device.index)], "VRAM"),
            agent.get_xfer_descs([(peer.addr, NBYTES, PEER_DEVICE)], "VRAM"),
            remote,
        )
        state = agent.transfer(h)
        for _ in range(2000):
            if state != "PROC":
                break
            state = agent.check_xfer_state(h)
            __import__("time").sleep(0.01)
        assert state == "DONE"
        assert device.read(back, NBYTES) == bytes(want)
    finally:
        agent.close()


def test_nixl_memory_types_are_checked_against_the_memory(device):
    """Device memory given as "DRAM", or as another device's, is refused;
    host memory labelled "VRAM" (serving engines on CPU do that) works;
    memory that is neither is refused as unsupported."""
    agent = nixl_agent(f"types-{uuid.uuid4()}", nixl_agent_config())
    host = np.zeros(PAGE, dtype=np.uint8)
    try:
        d = device.alloc(PAGE)
        with pytest.raises(nixlInvalidParamError, match="on device 0"):
            agent.register_memory([(d, PAGE, 0, "")], "DRAM")
        with pytest.raises(nixlInvalidParamError, match="device 5"):
            agent.register_memory([(d, PAGE, 5, "")], "VRAM")
        with pytest.raises(nixlNotSupportedError, match=r"installed: (cuda, )?fake\)"):
            agent.register_memory([(0x1000, PAGE, 0, "")], "VRAM")
        with pytest.raises(nixlNotSupportedError, match="FILE"):
            agent.get_reg_descs([(d, PAGE, 0, "")], "FILE")
        assert agent._engine.stats()["registered"] == 0
        agent.register_memory([(host.ctypes.data, PAGE, 0, "")], "VRAM")
        agent.register_memory([(d, PAGE, 0, "")], "VRAM")
        assert agent._engine._native.memory_kind(host.ctypes.data) == "host"
        assert agent._engine._native.memory_kind(d) == "device:0"
        device.close()  # new registrations no longer find it
        with pytest.raises(nixlNotSupportedError, match=r"installed: (none|cuda)\)"):
            agent.register_memory([(device.alloc(PAGE), PAGE, 0, "")], "VRAM")
    finally:
        agent.close()


def test_engine_registers_device_arrays_and_moves_them(device):
    """``Engine.register`` takes an object with ``__cuda_array_interface__``
    (as a torch CUDA tensor shows itself): its region is device memory, and
    a write between two engines lands in the other device's memory."""
    other = FakeDevice(3, NBYTES)
    try:
        a_buf, b_buf = device.buffer(NBYTES), other.buffer(NBYTES)
        a_buf.write(pattern(6, NBYTES))
        with kvmove.Engine() as a, kvmove.Engine() as b:
            assert a.device_memory
            ra, rb = a.register(a_buf), b.register(b_buf)
            assert (ra.kind, rb.kind) == ("device:0", "device:3")
            with a.connect(b.session_id) as s:
                s.write(ra.addr, rb.addr + PAGE, NBYTES - PAGE)
            assert b_buf.read(PAGE) == pattern(6, NBYTES)[: NBYTES - PAGE]
            # The local helpers go through the device too.
            a.write_local(ra.addr, b"\x01\x02")
            assert a.read_local(ra.addr, 2) == b"\x01\x02" == a_buf.read(0, 2)
            # Asked for host memory, device memory is refused.
            with pytest.raises(kvmove.PermanentError, match="given as host memory"):
                a.register_address(device.alloc(PAGE), PAGE, "host")
            with pytest.raises(kvmove.PermanentError) as info:
                a.register_address(ra.addr, PAGE, "gpu")
            assert info.value.kind == "invalid_request"
    finally:
        other.close()


class DLPackOnly:
    """Exposes an array through DLPack only (as a torch CPU tensor does:
    no buffer protocol)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


def test_dlpack_objects_are_registered_as_what_they_hold():
    arr = np.zeros((4, PAGE // 4), dtype=np.uint32)
    addr, nbytes, kind = memory_of(DLPackOnly(arr))
    assert (addr, nbytes, kind) == (arr.ctypes.data, arr.nbytes, "host")
    with kvmove.Engine() as e:
        r = e.register(DLPackOnly(arr))
        assert r.kind == "host" and r.length == arr.nbytes
        e.write_local(r.addr + 4, (7).to_bytes(4, "little"))
        assert arr[0, 1] == 7
        with pytest.raises(TypeError, match="not C-contiguous"):
            e.register(DLPackOnly(np.zeros((8, 8), dtype=np.uint8)[:, ::2]))
    with pytest.raises(ValueError, match="read-only"):
        memory_of(type("RO", (), {"__cuda_array_interface__": {"shape": (4,), "typestr": "|u1", "data": (4096, True), "version": 3}})())

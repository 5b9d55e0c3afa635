"""The prefill/decode exchange over RDMA (two processes, every byte checked).

Runs where the build has the RDMA backend and the machine an RDMA device
(``RDMA_TEST_DEVICE``, else the first under /sys/class/infiniband), e.g.
inside ``scripts/rxe-vm`` (soft-RoCE). Skipped otherwise, with the reason;
``RDMA_REQUIRED=1`` turns the skip into a failure.
"""

import hashlib
import os

import numpy as np
import pytest

import kvmove
from kvmove import _native
from kvmove.mooncake import TransferEngine

from conftest import finish_with_decode_stopped
from kvpeer import pattern

LAYER = 64 << 10


def _device():
    if not _native.HAS_RDMA:
        return None, "this build has no RDMA backend (build with --features rdma)"
    dev = os.environ.get("RDMA_TEST_DEVICE")
    if not dev:
        try:
            devs = sorted(os.listdir("/sys/class/infiniband"))
        except OSError:
            devs = []
        if not devs:
            return None, "no RDMA device (/sys/class/infiniband is empty)"
        dev = devs[0]
    return dev, ""


DEVICE, WHY = _device()
if DEVICE is None and os.environ.get("RDMA_REQUIRED") == "1":
    raise RuntimeError(f"RDMA_REQUIRED=1 but {WHY}")
pytestmark = pytest.mark.skipif(DEVICE is None, reason=f"RDMA: {WHY}")

LAYERS, PAGES, PAGE = 4, 16, 4096
TOTAL = LAYERS * 2 * PAGES * PAGE


def test_rdma_prefill_decode_exchange(spawn_peer):
    decode = spawn_peer(nbytes=TOTAL, protocol="rdma", device=DEVICE)
    prefill = TransferEngine()
    assert prefill.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0, prefill.last_error()
    kv = pattern(11, TOTAL)
    assert prefill.register_memory(kv.ctypes.data, kv.nbytes) == 0, prefill.last_error()
    n = TOTAL // PAGE
    slots = np.random.default_rng(3).permutation(n)
    ret = prefill.batch_transfer_sync_write(
        decode.session_id,
        [kv.ctypes.data + i * PAGE for i in range(n)],
        [decode.addr + int(s) * PAGE for s in slots],
        [PAGE] * n,
    )
    assert ret == 0, prefill.last_error()
    expected = np.empty_like(kv)
    for i, s in enumerate(slots):
        expected[s * PAGE : (s + 1) * PAGE] = kv[i * PAGE : (i + 1) * PAGE]
    assert decode.ask("digest") == hashlib.sha256(expected.tobytes()).hexdigest()

    # Read back with RDMA READ, and an async layer.
    assert decode.ask("fill 5") == "ok"
    back = np.zeros(TOTAL, dtype=np.uint8)
    assert prefill.register_memory(back.ctypes.data, back.nbytes) == 0
    assert prefill.transfer_sync_read(decode.session_id, back.ctypes.data, decode.addr, TOTAL) == 0, prefill.last_error()
    assert np.array_equal(back, pattern(5, TOTAL))
    bid = prefill.batch_transfer_async_write(decode.session_id, [kv.ctypes.data], [decode.addr], [TOTAL])
    assert bid > 0 and prefill.get_batch_transfer_status([bid]) == 0
    assert decode.ask("digest") == hashlib.sha256(kv.tobytes()).hexdigest()

    # Bad input over RDMA fails cleanly too.
    assert prefill.transfer_sync_write(decode.session_id, kv.ctypes.data, decode.addr + TOTAL - 8, 16) == -1
    assert prefill.transfer_sync_write(decode.session_id, 4096, decode.addr, 16) == -1
    assert prefill.unregister_memory(back.ctypes.data) == 0
    assert prefill.unregister_memory(kv.ctypes.data) == 0
    prefill.close()


def test_rdma_pythonic_engine():
    with kvmove.Engine(protocol="rdma", device=DEVICE) as a, kvmove.Engine(protocol="rdma", device=DEVICE) as b:
        assert a.backend == "rdma"
        src = np.arange(1 << 20, dtype=np.uint32).view(np.uint8)
        dst = np.zeros_like(src)
        with a.register(src) as rs, b.register(dst) as rd, a.connect(b.session_id) as s:
            with s.layerwise() as lt:
                step = src.nbytes // 8
                for layer in range(8):
                    lt.submit_layer([(rs.at(layer * step), rd.at(layer * step), step)])
                lt.wait()
        assert np.array_equal(src, dst)


def test_rdma_nixl_agents():
    """kvmove's nixl_agent over the RDMA backend, two processes: vLLM's
    order (decode READs prefill's blocks with a notification) and SGLang's
    (prefill WRITEs layer by layer with notifications that decode checks
    against the bytes when each arrives)."""
    import json
    import uuid

    from conftest import Peer
    from kvmove.nixl import nixl_agent, nixl_agent_config

    from nixlflows import LAYERS, NBYTES, expect_read, pairs_arg, register_kv, sglang_write, vllm_handshake, vllm_read

    peers = []
    # Telemetry captured, as vLLM makes its agent (vllm_read reads it).
    agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[], capture_telemetry=True))
    try:
        agent.create_backend("RDMA", {"device": DEVICE})
        kv = pattern(21, NBYTES)
        _, local = register_kv(agent, kv)

        # vLLM: this agent is decode, the peer prefill.
        prefill = Peer("127.0.0.1", NBYTES, "rdma", DEVICE, "nixlpeer.py")
        peers.append(prefill)
        assert prefill.ask("fill 11") == "ok"
        name, remote = vllm_handshake(agent, prefill)
        want = expect_read(kv, 11, [0, 1, 2, 3], [3, 5, 6, 9])
        st, tel = vllm_read(agent, local, remote, [0, 1, 2, 3], [3, 5, 6, 9], b"req-1:1")
        assert st == "DONE" and np.array_equal(kv, want) and tel.totalBytes > 0
        assert json.loads(prefill.ask("notifs 1 20")) == [[agent.name, "req-1:1"]]

        # SGLang: this agent is prefill, the peer decode.
        kv[:] = pattern(21, NBYTES)
        decode = Peer("127.0.0.1", NBYTES, "rdma", DEVICE, "nixlpeer.py")
        peers.append(decode)
        dname = agent.add_remote_agent(bytes.fromhex(decode.info["metadata"]))
        pairs = [(0, 5), (1, 6), (9, 0), (15, 15)]
        decode.proc.stdin.write(f"watch {LAYERS} 30 21 {pairs_arg(pairs)}\n")
        decode.proc.stdin.flush()
        assert sglang_write(agent, kv, dname, decode, 7, pairs) == ["DONE"] * LAYERS
        seen = json.loads(decode.read_line())
        assert sorted(m for _, m, _ in seen) == [f"7_kv_{l}_{int(l == LAYERS - 1)}" for l in range(LAYERS)]
        assert all(ok for _, _, ok in seen), f"a notification arrived before its layer's bytes: {seen}"
    finally:
        for p in peers:
            p.stop()
        agent.close()


def test_rdma_moves_device_memory_through_every_api():
    """Device memory (a fake device's: no GPUDirect under soft-RoCE) is
    staged through host buffers on both sides: ``kvmove.Engine`` writes
    device to device and reads back, Mooncake's ``register_memory`` takes a
    device pointer and writes from it, and the NIXL agent lists ``VRAM``
    for the RDMA backend and registers it."""
    import uuid

    from kvmove.devices import FakeDevice
    from kvmove.nixl import nixl_agent, nixl_agent_config

    n = 3 << 20
    with FakeDevice(0, 8 << 20) as d0, FakeDevice(1, 8 << 20) as d1:
        a_buf, b_buf, back = d0.buffer(n), d1.buffer(n), d0.buffer(n)
        want = pattern(7, n).tobytes()
        a_buf.write(want)
        with kvmove.Engine(protocol="rdma", device=DEVICE) as a, kvmove.Engine(protocol="rdma", device=DEVICE) as b:
            assert a.device_memory
            ra, rb, rback = a.register(a_buf), b.register(b_buf), a.register(back)
            assert (ra.kind, rb.kind) == ("device:0", "device:1")
            with a.connect(b.session_id) as s:
                s.write(ra.addr, rb.addr + 4096, n - 4096)
                assert b_buf.read(4096) == want[: n - 4096]
                s.read(rback.addr, rb.addr + 4096, n - 4096)
            assert back.read(0, n - 4096) == want[: n - 4096]

        target = TransferEngine()
        mc = TransferEngine()
        assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0, target.last_error()
        assert mc.initialize("127.0.0.1", "P2PHANDSHAKE", "rdma", DEVICE) == 0, mc.last_error()
        try:
            src = d0.alloc(1 << 16)
            d0.write(src, pattern(8, 1 << 16).tobytes())
            assert mc.register_memory(src, 1 << 16) == 0, mc.last_error()
            dst = d1.alloc(1 << 16)
            assert target.register_memory(dst, 1 << 16) == 0, target.last_error()
            peer = f"127.0.0.1:{target.get_rpc_port()}"
            assert mc.transfer_sync_write(peer, src, dst, 1 << 16) == 0, mc.last_error()
            assert d1.read(dst, 1 << 16) == pattern(8, 1 << 16).tobytes()
        finally:
            mc.close()
            target.close()

        agent = nixl_agent(str(uuid.uuid4()), nixl_agent_config(backends=[]))
        try:
            agent.create_backend("RDMA", {"device": DEVICE})
            assert agent.get_backend_mem_types("RDMA") == ["DRAM", "VRAM"]
            agent.register_memory([(d0.alloc(4096), 4096, 0, "")], "VRAM")
        finally:
            agent.close()


@pytest.mark.parametrize("frozen_s", [7.0, 2.0])
def test_rdma_receiver_frozen_across_the_finish(spawn_peer, frozen_s):
    """Sessions over RDMA with a real frozen process: the decode process is
    stopped (SIGSTOP) before it reads the FINISH and continued. Past the
    liveness timeout (7 s; 5 s by default) the sender gave up unsure
    (``outcome_unknown``) and the resumed receiver, which asks before it
    lands, fails; a pause it notices but the sender forgives (2 s) lands on
    both sides with every byte (rule 13)."""
    decode = spawn_peer(nbytes=LAYER, protocol="rdma", device=DEVICE, script="sessionpeer.py")
    kv = pattern(7, LAYER)
    with kvmove.Engine(protocol="rdma", device=DEVICE) as prefill, prefill.register(kv) as src:
        s = finish_with_decode_stopped(prefill, decode, 3, src, LAYER, frozen_s, gives_up=frozen_s > 5)
        if frozen_s > 5:
            assert decode.ask("wait 3 30") == "failed"
        else:
            assert s.wait(timeout=30) == "landed", s.error
            assert decode.ask("wait 3 30") == "landed"
            assert decode.ask(f"digest 0 {LAYER}") == hashlib.sha256(kv.tobytes()).hexdigest()

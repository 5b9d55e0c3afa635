"""The NIXL call orders of vLLM's and SGLang's connectors, as the
two-process tests (TCP here, RDMA in test_rdma.py) drive them against a
``nixlpeer.py`` process.

Layout on both sides: ``REGIONS`` registered regions (K and V of each of
``LAYERS`` layers) of ``BLOCKS`` blocks of ``BLOCK`` bytes.
"""

import time

import numpy as np

from nixlpeer import PAGE as BLOCK
from nixlpeer import REGIONS, pattern

LAYERS = REGIONS // 2
BLOCKS = 16
REGION = BLOCKS * BLOCK
NBYTES = REGIONS * REGION


def register_kv(agent, kv: np.ndarray):
    """vLLM's register_kv_caches: one region per K / V cache, registered
    with the connector's backends; then the local blocks prepared."""
    base = kv.ctypes.data
    caches = [(base + i * REGION, REGION, 0, "") for i in range(REGIONS)]
    descs = agent.get_reg_descs(caches, "DRAM")
    agent.register_memory(descs, backends=list(agent.backends))
    blocks = [(base + i * REGION + b * BLOCK, BLOCK, 0) for i in range(REGIONS) for b in range(BLOCKS)]
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(blocks, "DRAM"))
    return descs, local


def vllm_handshake(agent, peer):
    """vLLM's add_remote_agent: load the metadata, prepare every remote
    block (region-major) for reading."""
    name = agent.add_remote_agent(bytes.fromhex(peer.info["metadata"]))
    blocks = [(base + b * BLOCK, BLOCK, 0) for base in peer.info["regions"] for b in range(BLOCKS)]
    remote = agent.prep_xfer_dlist(name, agent.get_xfer_descs(blocks, "DRAM"))
    return name, remote


def desc_ids(blocks) -> np.ndarray:
    """vLLM's _get_block_descs_ids: every region's descriptor of each block."""
    return (np.arange(REGIONS)[:, None] * BLOCKS + np.asarray(blocks)[None, :]).flatten()


def wait_state(agent, handle, timeout: float = 30.0) -> str:
    """Polls check_xfer_state as the connectors do (exceptions propagate)."""
    limit = time.monotonic() + timeout
    while (st := agent.check_xfer_state(handle)) == "PROC":
        if time.monotonic() > limit:
            raise TimeoutError("transfer still PROC")
        time.sleep(0.001)
    return st


def vllm_read(agent, local, remote, local_blocks, remote_blocks, notif: bytes):
    """vLLM's _read_blocks: one READ of the request's blocks of every layer
    with the notification for prefill, then check_xfer_state until DONE,
    telemetry, release."""
    h = agent.make_prepped_xfer("READ", local, desc_ids(local_blocks), remote, desc_ids(remote_blocks), notif_msg=notif)
    agent.transfer(h)
    st = wait_state(agent, h)
    tel = agent.get_xfer_telemetry(h)
    agent.release_xfer_handle(h)
    return st, tel


def expect_read(dst: np.ndarray, seed: int, local_blocks, remote_blocks) -> np.ndarray:
    """What dst holds after reading remote_blocks (of pattern SEED) into
    local_blocks."""
    src = pattern(seed, NBYTES)
    want = dst.copy()
    for r in range(REGIONS):
        for lb, rb in zip(local_blocks, remote_blocks):
            a, b = r * REGION + lb * BLOCK, r * REGION + rb * BLOCK
            want[a : a + BLOCK] = src[b : b + BLOCK]
    return want


def sglang_write(agent, kv: np.ndarray, peer_name: str, peer, room: int, pairs):
    """SGLang's send_kvcache, one chunk per layer: for layer L the K and V
    pages ``src -> dst`` of ``pairs``, one initialize_xfer("WRITE") with the
    notification ``{room}_kv_{L}_{last}``, posted at once (not waited for);
    then NixlKVSender.poll's check_xfer_state until all are DONE."""
    handles = []
    for layer in range(LAYERS):
        src, dst = [], []
        for r in (2 * layer, 2 * layer + 1):
            for s, d in pairs:
                src.append((kv.ctypes.data + r * REGION + s * BLOCK, BLOCK, 0))
                dst.append((peer.info["regions"][r] + d * BLOCK, BLOCK, 0))
        notif = f"{room}_kv_{layer}_{int(layer == LAYERS - 1)}"
        h = agent.initialize_xfer(
            "WRITE", agent.get_xfer_descs(src, "DRAM"), agent.get_xfer_descs(dst, "DRAM"), peer_name, notif.encode("ascii")
        )
        assert h, "initialize_xfer returned a false handle"
        assert agent.transfer(h) != "ERR"
        handles.append(h)
    states = [wait_state(agent, h) for h in handles]
    for h in handles:
        agent.release_xfer_handle(h)
    return states


def pairs_arg(pairs) -> str:
    return ",".join(f"{s}:{d}" for s, d in pairs)

"""The vLLM connector's layer bookkeeping (``kvmove.vllm.pending``), which
imports neither vLLM nor torch: where a layer's blocks are in vLLM's KV
layouts, and that a layer's blocks are written only once its kernels
finished (a GPU's event), shown on kvmove's fake device."""

import threading
import time

import numpy as np
import pytest

import kvmove
from kvmove.devices import FakeDevice
from kvmove.vllm.pending import PendingLayers, kv_layout, plan_writes


class Event:
    """Stands in for a ``torch.cuda.Event``: complete once ``set``."""

    def __init__(self):
        self.flag = threading.Event()

    def query(self) -> bool:
        return self.flag.is_set()


def contiguous(shape):
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))


# ---- kv_layout: vLLM's layouts ----

N, BS, H, D = 64, 16, 4, 32  # blocks, block size, kv heads, head size


def test_blocks_first_is_one_plane():
    """The CPU backend, FlashInfer, Triton: (num_blocks, ...), a block holds
    its keys and values."""
    for shape in [(N, 2, BS, H, D), (N, BS * H * D * 2)]:
        planes, bb, nbytes = kv_layout(shape, contiguous(shape), 2, 4096, N)
        assert planes == [4096]
        assert bb == 2 * BS * H * D * 2
        assert nbytes == N * bb


def test_keys_and_values_apart_are_two_planes():
    """FlashAttention: (2, num_blocks, block_size, heads, head_size)."""
    shape = (2, N, BS, H, D)
    planes, bb, nbytes = kv_layout(shape, contiguous(shape), 2, 4096, N)
    assert bb == BS * H * D * 2
    assert planes == [4096, 4096 + N * bb]
    assert nbytes == 2 * N * bb
    # Without the block count the shape alone says it.
    assert kv_layout(shape, contiguous(shape), 2, 4096)[0] == planes


def test_a_block_stride_with_padding_keeps_the_padding():
    shape = (N, BS, H, D)
    strides = (BS * H * D + 64, H * D, D, 1)
    planes, bb, _ = kv_layout(shape, strides, 1, 0, N)
    assert (planes, bb) == ([0], BS * H * D + 64)


@pytest.mark.parametrize(
    "shape,strides",
    [
        # The block dimension is not the outer one: a block is scattered.
        ((N, BS, H, D), (H * D, N * H * D, D, 1)),
        # Keys and values apart, but their planes overlap.
        ((2, N, BS, H, D), (BS * H * D, BS * H * D, H * D, D, 1)),
        # Not a tensor at all.
        ((), ()),
    ],
)
def test_blocks_that_are_not_contiguous_are_refused(shape, strides):
    with pytest.raises(ValueError):
        kv_layout(shape, strides, 2, 0, N)


# ---- PendingLayers and plan_writes ----


def test_layers_without_an_event_are_taken_at_once():
    p = PendingLayers()
    p.add(1, [(0, 100)])
    p.add(0, [(0, 10), (1, 20)])
    p.add(2, [])
    assert len(p) == 3 and p
    assert p.take() == [(0, [(0, 10), (1, 20)]), (1, [(0, 100)])]
    assert not p and p.take() == []


def test_a_layer_waits_for_its_newest_event():
    p = PendingLayers()
    first, second = Event(), Event()
    p.add(0, [(0, 10)], first)
    p.add(0, [(1, 20)], second)  # the next chunk, recorded later
    p.add(0, [(2, 30)])  # no event: the layer still waits for `second`
    p.add(1, [(0, 40)])
    assert p.take() == [(1, [(0, 40)])]
    first.flag.set()
    assert p.take() == []  # the newer kernels may still run
    second.flag.set()
    assert p.take() == [(0, [(0, 10), (1, 20), (2, 30)])]
    p.add(3, [(0, 1)], Event())
    p.clear()
    assert not p


def test_plan_writes_merges_skips_the_decodes_prefix_and_refuses_past_the_grant():
    bb = 100
    remote = [[5000, 5100, 5200], [9000, 9100, 9300]]
    layers = [(0, [(0, 0), (1, 100), (2, 200), (3, 300)]), (1, [(1, 1100), (2, 1200), (3, 1300)])]
    ops, err = plan_writes(layers, 1, remote, bb)
    assert err is None
    # Block 0 is the decode's own (first = 1); 1-3 of plane 0 merge;
    # plane 1's remote addresses break between blocks 2 and 3.
    assert ops == [(100, 5000, 300), (1100, 9000, 200), (1300, 9300, 100)]
    ops, err = plan_writes([(0, [(4, 400)])], 1, remote, bb)
    assert ops == [] and "beyond the 3 blocks granted" in err


# ---- on the fake device: no block is read before its kernels finished ----

LAYERS, BLOCK = 4, 4096


def push_layers(dev, gate: bool):
    """A prefill pushes LAYERS layers of device memory to a decode's host
    memory, layer by layer as the connector does; each layer's "kernel" (a
    thread) writes its final bytes half a second after the layer was saved, then
    completes its event. With ``gate`` the writes wait for the events (the
    connector's way); without, they start when the layer is saved. Returns
    the bytes the decode got and the bytes the kernels wrote."""
    stale = bytes([0xEE]) * BLOCK
    final = [bytes([i + 1]) * BLOCK for i in range(LAYERS)]
    src = dev.alloc(LAYERS * BLOCK)
    for i in range(LAYERS):
        dev.write(src + i * BLOCK, stale)
    dst = np.zeros(LAYERS * BLOCK, dtype=np.uint8)
    with kvmove.Engine() as prefill, kvmove.Engine() as decode:
        prefill.register_address(src, LAYERS * BLOCK, "device:%d" % dev.index)
        with decode.register(dst) as region:
            recv = decode.receive(prefill.session_id, 7, [(region.addr, LAYERS * BLOCK)], deadline=30)
            send = prefill.send(decode.session_id, 7)
            grant = send.wait_grant(timeout=20)
            assert grant is not None
            remote = [[grant.ranges[0][0] + i * BLOCK] for i in range(LAYERS)]
            pending = PendingLayers()
            kernels, writes = [], []

            def kernel(i, ev):
                time.sleep(0.5)
                dev.write(src + i * BLOCK, final[i])
                ev.flag.set()

            def flush():
                if gate:
                    layers = pending.take()
                else:
                    layers = [(i, b) for i, (b, _) in sorted(pending._layers.items())]
                    pending.clear()
                ops, err = plan_writes(layers, 0, remote, BLOCK)
                assert err is None
                if ops:
                    writes.append(send.write_layer(ops))

            for i in range(LAYERS):  # the forward pass: never waits
                ev = Event()
                t = threading.Thread(target=kernel, args=(i, ev))
                t.start()
                kernels.append(t)
                pending.add(i, [(0, src + i * BLOCK)], ev)
                flush()
            deadline = time.monotonic() + 20
            while pending and time.monotonic() < deadline:  # the connector's pump
                flush()
                time.sleep(0.001)
            assert not pending
            for t in kernels:
                t.join()
            for w in writes:
                assert w.wait(timeout=30).ok
            send.finish()
            assert send.wait(timeout=30) == "landed"
            assert recv.wait(timeout=30) == "landed"
            got = dst.tobytes()
    return got, b"".join(final), stale


def test_a_layer_is_written_only_after_its_kernels_finished():
    with FakeDevice(3, 1 << 20) as dev:
        got, final, _ = push_layers(dev, gate=True)
    assert got == final


def test_without_the_event_the_decode_gets_what_the_kernels_had_not_written():
    """The other side of the test above: it can fail. Writes started when
    the layer is saved carry the bytes from before its kernels."""
    with FakeDevice(4, 1 << 20) as dev:
        got, final, stale = push_layers(dev, gate=False)
    assert got != final
    assert stale in [got[i * BLOCK : (i + 1) * BLOCK] for i in range(LAYERS)]

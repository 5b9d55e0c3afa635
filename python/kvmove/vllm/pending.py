"""A prefill request's computed blocks that are not written yet, layer by
layer, and when each layer's bytes may be read.

On vLLM's CPU backend a layer's KV is in its blocks when ``save_kv_layer``
is called (the attention wrote it first, on the same thread). On a GPU it
is not: ``save_kv_layer`` runs when the layer's kernels were *queued*, and
they may still be running. The connector then records an event on the
compute stream (``torch.cuda.Event().record()``) and hands it in with the
layer's blocks; the blocks are written only once the event has completed
(``query()`` is true), so no write reads a byte the layer has not written
yet. The forward pass never waits: the connector's pump takes what is
ready each time it runs.

Events of one layer are recorded on one stream, in order: the newest one
completing means every earlier one did, so a layer keeps only the newest.

:func:`kv_layout` finds where a layer's blocks are in its KV tensor, for
the layouts vLLM's attention backends use, and refuses any other.

Imports nothing of vLLM or torch (it is tested on its own, with kvmove's
fake device).
"""

from __future__ import annotations

from typing import Optional, Protocol


class Ready(Protocol):
    """What says a layer's bytes are complete: a ``torch.cuda.Event``
    recorded after the layer's kernels, or anything with ``query()``."""

    def query(self) -> bool: ...


# One block to write: (the block's index in the request, its local address).
Block = tuple[int, int]


class PendingLayers:
    """Per layer: the blocks waiting to be written and the newest event
    that must complete before they are read (``None``: readable now)."""

    def __init__(self) -> None:
        self._layers: dict[int, tuple[list[Block], Optional[Ready]]] = {}

    def add(self, layer: int, blocks: list[Block], ready: Optional[Ready] = None) -> None:
        if not blocks:
            return
        held, event = self._layers.get(layer, ([], None))
        held.extend(blocks)
        # A layer with blocks behind an event stays behind the newest one.
        self._layers[layer] = (held, ready if ready is not None else event)

    def take(self) -> list[tuple[int, list[Block]]]:
        """Removes and returns, in layer order, every layer whose bytes are
        complete."""
        out = []
        for layer in sorted(self._layers):
            blocks, event = self._layers[layer]
            if event is None or event.query():
                out.append((layer, blocks))
                del self._layers[layer]
        return out

    def clear(self) -> None:
        self._layers.clear()

    def __bool__(self) -> bool:
        return bool(self._layers)

    def __len__(self) -> int:
        """Blocks waiting, over every layer."""
        return sum(len(b) for b, _ in self._layers.values())


def plan_writes(
    layers: list[tuple[int, list[Block]]],
    first: int,
    remote: list[list[int]],
    block_bytes: int,
) -> tuple[list[tuple[int, int, int]], Optional[str]]:
    """The write operations (local, remote, length) for ``layers``' blocks:
    ``remote[layer][j - first]`` is where the decode granted block ``j``
    (blocks below ``first`` the decode's own prefix cache holds: skipped);
    neighbouring blocks on both sides merge into one operation. Returns the
    operations, or an error when a block lies beyond the grant."""
    ops: list[list[int]] = []
    for layer, blocks in layers:
        granted = remote[layer]
        for j, local in blocks:
            k = j - first
            if k < 0:
                continue
            if k >= len(granted):
                return [], f"block {j} is beyond the {len(granted)} blocks granted"
            dst = granted[k]
            if ops and ops[-1][0] + ops[-1][2] == local and ops[-1][1] + ops[-1][2] == dst:
                ops[-1][2] += block_bytes
            else:
                ops.append([local, dst, block_bytes])
    return [(a, b, n) for a, b, n in ops], None


def _extent(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements from a tensor's first to one past its last (0 if empty)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * st for n, st in zip(shape, strides))


def kv_layout(
    shape, strides, element_size: int, data_ptr: int, num_blocks: Optional[int] = None
) -> tuple[list[int], int, int]:
    """Where one layer's blocks are in its KV tensor: ``(planes,
    block_bytes, nbytes)``. Block ``j`` of plane ``p`` is the one contiguous
    range ``planes[p] + j * block_bytes``; ``nbytes`` is the tensor's span
    from ``data_ptr``.

    vLLM's attention backends lay a layer out in one of two ways:

    - blocks first, ``(num_blocks, ...)`` (the CPU backend, FlashInfer,
      Triton, MLA): one plane; a block holds its keys and values;
    - keys and values apart, ``(2, num_blocks, ...)`` (FlashAttention): two
      planes, keys then values.

    A layout whose blocks are not contiguous is refused (``ValueError``):
    the connector would send wrong KV."""
    shape, strides = tuple(int(n) for n in shape), tuple(int(st) for st in strides)
    if not shape or len(shape) != len(strides) or element_size <= 0:
        raise ValueError(f"not a KV cache tensor: shape {shape}, strides {strides}")
    nbytes = _extent(shape, strides) * element_size
    split = len(shape) >= 3 and shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
    dim = 1 if split else 0
    inner = _extent(shape[dim + 1 :], strides[dim + 1 :])
    block = strides[dim]
    # A block is contiguous when everything inside it lies within one block
    # stride, and the blocks of a plane do not run into the next plane.
    if block <= 0 or inner > block or (split and strides[0] < shape[1] * block):
        raise ValueError(
            f"a KV cache whose blocks are not contiguous ranges (shape {shape}, strides {strides}): "
            "kvmove's connector cannot move it"
        )
    if split:
        return [data_ptr, data_ptr + strides[0] * element_size], block * element_size, nbytes
    return [data_ptr], block * element_size, nbytes

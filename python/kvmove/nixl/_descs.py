"""The agent's configuration, NIXL's descriptor lists (``nixlXferDList``,
``nixlRegDList``) and the checks of the arguments the agent's calls take."""

from __future__ import annotations

from enum import Enum
from typing import Optional, Sequence, Tuple

import numpy as np

from .._native import named_notification, nixl_desc_rows, read_named_notification
from ._base import DEFAULT_COMM_PORT, _bind_sync_t, nixl_mem_t, nixlInvalidParamError, nixlNotSupportedError


# ---- configuration ----


class nixl_thread_sync_t(Enum):
    """NIXL's thread synchronization modes, their values those of the
    bindings (as NIXL's: the default is an alias of none). Recorded in the
    agent's ``nixlAgentConfig``; kvmove's agent is thread-safe in every
    mode."""

    NIXL_THREAD_SYNC_NONE = _bind_sync_t.NIXL_THREAD_SYNC_NONE
    NIXL_THREAD_SYNC_STRICT = _bind_sync_t.NIXL_THREAD_SYNC_STRICT
    NIXL_THREAD_SYNC_RW = _bind_sync_t.NIXL_THREAD_SYNC_RW
    NIXL_THREAD_SYNC_DEFAULT = _bind_sync_t.NIXL_THREAD_SYNC_DEFAULT


#: Opaque backend handle.
nixl_backend_handle = int


class nixl_agent_config:
    """Agent options, with NIXL's names and defaults. kvmove uses
    ``backends`` (which backends the agent creates) and
    ``capture_telemetry`` (whether ``get_xfer_telemetry`` answers, unless
    ``NIXL_TELEMETRY_ENABLE`` says: see ``nixl._bindings.nixlAgent``); the
    progress thread is kvmove's runtime, ``num_threads`` is accepted and
    unused, ``sync_mode`` is recorded as NIXL's agent records it (kvmove's
    agent is thread-safe in every mode), and ``enable_listen_thread``
    starts the agent's metadata listener on ``listen_port`` (0: a free
    port; see ``nixl_agent.listen_address``), on the host of
    ``KVMOVE_NIXL_HOST`` (default ``127.0.0.1``)."""

    def __init__(
        self,
        enable_prog_thread: bool = True,
        enable_listen_thread: bool = False,
        listen_port: int = DEFAULT_COMM_PORT,
        capture_telemetry: bool = False,
        num_threads: int = 0,
        backends: Sequence[str] = ("UCX",),
        sync_mode: Optional[nixl_thread_sync_t] = None,
    ):
        if isinstance(backends, str):
            raise TypeError("backends must be a list of backend names, e.g. [\"UCX\"], not a string")
        if sync_mode is not None and not isinstance(sync_mode, nixl_thread_sync_t):
            raise TypeError(f"sync_mode must be a nixl_thread_sync_t, not {type(sync_mode).__name__}")
        self.backends = list(backends)
        self.enable_pthread = enable_prog_thread
        self.enable_listen = enable_listen_thread
        self.port = listen_port
        self.capture_telemetry = capture_telemetry
        self.num_threads = num_threads
        self.sync_mode = sync_mode


# ---- descriptor lists ----


_MEM_TYPES = {"DRAM": "DRAM", "cpu": "DRAM", "VRAM": "VRAM", "cuda": "VRAM"}
# The other names NIXL's agent knows (its bindings' BLK_SEG is "BLOCK").
_OTHER_MEM_TYPES = {"FILE", "BLOCK", "OBJ"}
_SEG_TYPES = {nixl_mem_t.DRAM_SEG: "DRAM", nixl_mem_t.VRAM_SEG: "VRAM"}


def _mem_type(mem_type: Optional[str]) -> str:
    """The memory type of a name: a name NIXL's agent does not know is a
    ``KeyError``, as there (it looks the name up in a dict)."""
    if mem_type is None:
        raise nixlInvalidParamError("a memory type is needed with a list of tuples or an array: \"DRAM\" or \"VRAM\"")
    if mem_type in _MEM_TYPES:
        return _MEM_TYPES[mem_type]
    if mem_type in _OTHER_MEM_TYPES:
        raise _unsupported(mem_type)
    raise KeyError(f"unknown memory type {mem_type!r}; kvmove's NIXL agent takes \"DRAM\" or \"VRAM\"")


def _unsupported(mem_type) -> nixlNotSupportedError:
    return nixlNotSupportedError(
        f"memory type {mem_type!r} is not supported: kvmove's NIXL agent moves host (\"DRAM\") and "
        "device (\"VRAM\") memory"
    )


def _given_rows(mem_type, descs, width: int) -> Tuple[str, bytes]:
    """``(mem_type, packed rows)`` of a list made as NIXL's bindings make
    one: a ``nixl_mem_t`` (or ``"DRAM"`` / ``"VRAM"``), and a count of
    zeroed descriptors, a list of ``width``-tuples or an ``N x 3`` array.
    A tuple of another size is a ``ValueError``, as there."""
    mt = _SEG_TYPES.get(mem_type) if isinstance(mem_type, nixl_mem_t) else mem_type
    if mt not in ("DRAM", "VRAM"):
        if isinstance(mem_type, nixl_mem_t):
            raise _unsupported(mem_type.name)
        raise TypeError(f"a descriptor list's memory type is a nixl_mem_t (DRAM_SEG, ...), not {mem_type!r}")
    if descs is None or isinstance(descs, int):
        return mt, bytes(24 * (descs or 0))
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise ValueError("a numpy array of descriptors must be N x 3 (addr, len, dev_id)")
        return mt, np.ascontiguousarray(descs, dtype=np.uint64).tobytes()
    if not isinstance(descs, list):
        raise TypeError(f"descriptors are a list of tuples or an N x 3 numpy array, not {type(descs).__name__}")
    for d in descs:
        if not isinstance(d, tuple) or len(d) != width:
            raise ValueError(f"each descriptor must be a tuple of {width} items, not {d!r}")
    packed = nixl_desc_rows(descs, width)
    if packed is None:
        raise TypeError("a descriptor's addr, len and dev_id are integers from 0 to 2**64 - 1")
    return mt, packed


class _DList:
    """Descriptors ``(addr, len, dev_id)`` of one memory type, held as
    rows of native-endian ``u64``s, packed (what Rust takes, made once: a
    list is not changed after it is made; ``trim`` copies); an ``N x 3``
    array of them is made only when asked for.

    Made as NIXL's bindings make one (``nixlXferDList(DRAM_SEG)``, with a
    list of tuples, an array or a count: see ``_given_rows``), or by the
    agent from rows it packed (``raw``)."""

    #: The size of the tuples the list is made from.
    _WIDTH = 3

    def __init__(self, mem_type, descs=None, raw: Optional[bytes] = None):
        if raw is None:
            mem_type, raw = _given_rows(mem_type, descs, self._WIDTH)
        self.mem_type = mem_type
        self._raw = raw

    def _packed_rows(self) -> bytes:
        return self._raw

    @property
    def _descs(self) -> np.ndarray:
        """The rows as a read-only ``N x 3`` uint64 array."""
        a = self.__dict__.get("_array")
        if a is None:
            a = self.__dict__["_array"] = np.frombuffer(self._raw, dtype=np.uint64).reshape(-1, 3)
        return a

    def __getstate__(self):
        # Pickled as before the rows were kept packed: an array.
        return {"mem_type": self.mem_type, "_descs": np.array(self._descs)}

    def __setstate__(self, state):
        self.__init__(state["mem_type"], state["_descs"])

    @property
    def addrs(self) -> np.ndarray:
        return self._descs[:, 0]

    @property
    def lens(self) -> np.ndarray:
        return self._descs[:, 1]

    def __len__(self) -> int:
        return len(self._raw) // 24

    def descCount(self) -> int:
        return len(self)

    def getType(self) -> str:
        return self.mem_type

    def __getitem__(self, i: int) -> Tuple[int, int, int]:
        a, n, d = self._descs[i]
        return int(a), int(n), int(d)

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and other.mem_type == self.mem_type and other._raw == self._raw

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mem_type!r}, {len(self)} descriptors)"


class nixlXferDList(_DList):
    """A transfer descriptor list (``get_xfer_descs``)."""


class nixlRegDList(_DList):
    """A registration descriptor list (``get_reg_descs``)."""

    _WIDTH = 4  # (addr, len, dev_id, meta): the meta is not kept

    def trim(self) -> nixlXferDList:
        """The same ranges as a transfer descriptor list (NIXL's
        ``nixlRegDList.trim``: NIXL's own examples serialize
        ``register_memory(...).trim()`` for the peer)."""
        return nixlXferDList(self.mem_type, raw=self._raw)


def _rows(descs, mem_type: Optional[str], what: str, width: int) -> Tuple[str, bytes]:
    """``(mem_type, rows packed as native-endian u64s)`` from tuples, an
    ``N x 3`` array, a tensor or a list of tensors."""
    if isinstance(descs, np.ndarray):
        mt = _mem_type(mem_type)
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(f"{what}: a numpy array of descriptors must be N x 3 (addr, len, dev_id)")
        return mt, np.ascontiguousarray(descs, dtype=np.uint64).tobytes()
    if _is_tensor(descs):
        return _tensor_rows([descs], what)
    if not isinstance(descs, (list, tuple)):
        raise nixlInvalidParamError(
            f"{what}: expected a list of tuples, an N x 3 numpy array or tensors, not {type(descs).__name__}"
        )
    if len(descs) == 0:
        return _mem_type(mem_type or "DRAM"), b""
    if _is_tensor(descs[0]):
        return _tensor_rows(descs, what)
    mt = _mem_type(mem_type)
    packed = nixl_desc_rows(descs, width)  # None: the loop below says what is wrong
    if packed is not None:
        return mt, packed
    rows = []
    for i, d in enumerate(descs):
        if not isinstance(d, (tuple, list)) or len(d) not in (3, width):
            raise nixlInvalidParamError(
                f"{what}: descriptor {i} must be a tuple (addr, len, dev_id{', meta' if width == 4 else ''})"
            )
        try:
            a, n, dev = int(d[0]), int(d[1]), int(d[2])
        except (TypeError, ValueError, OverflowError):
            raise nixlInvalidParamError(f"{what}: descriptor {i} has a non-integer addr, len or dev_id") from None
        if a < 0 or n < 0 or dev < 0 or a >= 2**64 or n >= 2**64 or dev >= 2**64:
            raise nixlInvalidParamError(f"{what}: descriptor {i} has a negative or too large value")
        rows.append((a, n, dev))
    return mt, np.array(rows, dtype=np.uint64).tobytes()


def _is_tensor(obj) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_rows(tensors, what: str) -> Tuple[str, bytes]:
    """One row per tensor; CUDA tensors are ``"VRAM"`` with their device
    index as ``dev_id`` (as NIXL makes them), CPU tensors ``"DRAM"``."""
    rows = []
    types = set()
    for i, t in enumerate(tensors):
        if not _is_tensor(t):
            raise nixlInvalidParamError(f"{what}: item {i} is not a tensor")
        dev = t.get_device()
        types.add("DRAM" if dev == -1 else "VRAM")
        if not t.is_contiguous():
            raise nixlInvalidParamError(f"{what}: tensor {i} is not contiguous")
        rows.append((t.data_ptr(), t.numel() * t.element_size(), max(dev, 0)))
    if len(types) > 1:
        raise nixlInvalidParamError(f"{what}: the tensors are on the CPU and on a GPU; one memory type per list")
    return types.pop(), np.array(rows, dtype=np.uint64).tobytes()



def _operation(op) -> str:
    """``op``, if it is an operation: another is a ``KeyError``, as in
    NIXL's agent (it looks the name up in a dict)."""
    if op not in ("READ", "WRITE"):
        raise KeyError(f"operation must be \"READ\" or \"WRITE\", not {op!r}")
    return op


def _indices(idx, n: int, what: str) -> np.ndarray:
    try:
        a = np.asarray(idx)
    except Exception:
        raise nixlInvalidParamError(f"{what} must be a list or array of integers") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise nixlInvalidParamError(f"{what} must be a one-dimensional list or array of integers")
    a = a.astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= n):
        raise _index_outside(what, int(a[(a < 0) | (a >= n)][0]), n)
    return a


def _index_outside(what: str, bad: int, n: int) -> nixlInvalidParamError:
    """The error for index ``bad`` of ``what`` (``"local_indices"``...),
    outside a prepared list of ``n`` descriptors."""
    return nixlInvalidParamError(f"{what}: index {bad} is outside the prepared list of {n} descriptors")


def _agent_name(name) -> str:
    """An agent name as given: ``str``, or ``bytes`` as ``add_remote_agent``
    returns it."""
    if isinstance(name, (bytes, bytearray)):
        return bytes(name).decode("utf-8", "replace")
    return name


def _notif_bytes(msg) -> bytes:
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise nixlInvalidParamError(f"a notification message must be bytes or str, not {type(msg).__name__}")


def _encode_notif(name: str, msg: bytes) -> bytes:
    """A notification named after the sending agent: the engine's one
    framing of a named notification (the Mooncake API's too)."""
    try:
        return named_notification(name, msg)
    except ValueError as e:
        raise nixlInvalidParamError(str(e)) from None


def _decode_notif(peer: str, wire: bytes) -> Tuple[str, bytes]:
    """The sending agent's name and the message; a notification that is
    not named shows the peer's engine name."""
    named = read_named_notification(wire)
    return named if named is not None else (peer, wire)

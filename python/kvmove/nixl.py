"""A ``nixl_agent`` over kvmove: the calls vLLM's and SGLang's NIXL
connectors make on ``nixl._api.nixl_agent``, for host memory ("DRAM") and
device memory ("VRAM", through its provider: see ``kvmove.devices``), over
kvmove's TCP or RDMA backend (RDMA moves host memory only today).

Opt-in for an unmodified program: put ``python/nixl-shim`` first on
``PYTHONPATH`` and ``from nixl._api import nixl_agent, nixl_agent_config``
gets the classes of this module.

How it maps onto kvmove:

* An agent owns one :class:`kvmove.Engine`, started by the first backend
  (``create_backend``, or the config's ``backends``, default ``["UCX"]``).
  ``"UCX"`` and ``"KVMOVE"`` run over ``KVMOVE_PROTOCOL`` (``tcp`` unless set;
  ``rdma`` needs an RDMA build), ``"TCP"`` and ``"RDMA"`` pin the protocol.
  ``KVMOVE_NIXL_HOST`` is the address (``host`` or ``host:port``) the agent
  listens on and advertises in its metadata (default ``127.0.0.1``: set it
  to an address the peers can reach); ``KVMOVE_CONFIG`` names a kvmove TOML
  config and ``KVMOVE_POLICY`` a JSON policy, as for the Mooncake API.
* Agent metadata (``get_agent_metadata``) is bytes carrying the agent's
  name, its engine's session id and its registered regions; the peer loads
  them with ``add_remote_agent``.
* Remote descriptors are checked against the regions in the remote agent's
  metadata when they are prepared, and again by the peer's engine when the
  transfer runs.
* A transfer's notification is sent by the engine's runtime once every
  request completed (see ``python/src/nixl.rs``): it reaches the remote
  agent after the data, never for a failed transfer. It travels as a kvmove
  notification that carries the sender's agent name, so ``get_new_notifs``
  can key it by agent.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import pickle
import threading
import time
from enum import Enum
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._engine import Engine
from ._native import (
    HAS_RDMA,
    NixlOps,
    TransferError,
    named_notification,
    nixl_desc_rows,
    read_named_notification,
)

logger = logging.getLogger("kvmove.nixl")

#: NIXL's default port for its metadata listener (accepted, unused).
DEFAULT_COMM_PORT = 8888

#: The name that marks a local descriptor list in ``prep_xfer_dlist``.
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"

#: Header of agent metadata; JSON follows.
_MD_MAGIC = b"KVMOVE-NIXL/1\n"

# Besides a peer failure (`.is_peer_failure`, from kvmove's one table of
# error kinds), these mean the remote agent's session is no longer usable
# (its breaker is open, its handle was closed, its metadata is gone): NIXL
# reports all of them as a remote disconnect, and the session is forgotten.
_SESSION_GONE = frozenset({"peer_unavailable", "invalid_handle", "not_found"})


def _peer_gone(e: TransferError) -> bool:
    """Whether ``e`` means the remote agent is gone (NIXL's
    ``NIXL_ERR_REMOTE_DISCONNECT``)."""
    return bool(getattr(e, "is_peer_failure", False)) or getattr(e, "kind", None) in _SESSION_GONE


# ---- exceptions (the names NIXL's bindings raise) ----


class nixlError(RuntimeError):
    """Base of the errors below. ``.kind`` is the kvmove error kind when a
    kvmove error caused it, else None."""

    kind: Optional[str] = None


class nixlNotPostedError(nixlError):
    pass


class nixlInvalidParamError(nixlError):
    pass


class nixlBackendError(nixlError):
    pass


class nixlNotFoundError(nixlError):
    pass


class nixlMismatchError(nixlError):
    pass


class nixlNotAllowedError(nixlError):
    pass


class nixlRepostActiveError(nixlError):
    pass


class nixlUnknownError(nixlError):
    pass


class nixlNotSupportedError(nixlError):
    pass


class nixlRemoteDisconnectError(nixlError):
    pass


class nixlCancelledError(nixlError):
    pass


class nixlNoTelemetryError(nixlError):
    pass


# Two polls of a transfer closer together than this (seconds) mean the
# caller spins on it; such a poll waits up to _SPIN_WAIT for the end (the
# posted transfer's own poll does the same in Rust: NixlXfer.poll).
_SPIN_GAP = 0.0005
_SPIN_WAIT = 0.001


def _from_kvmove(e: TransferError, doing: str) -> nixlError:
    """The NIXL-named error for a kvmove error."""
    kind = getattr(e, "kind", None)
    if kind in ("out_of_bounds", "unregistered"):
        cls = nixlNotFoundError
    elif kind in ("invalid_request", "config"):
        cls = nixlInvalidParamError
    elif kind == "unsupported":
        cls = nixlNotSupportedError
    elif kind == "cancelled":
        cls = nixlCancelledError
    elif _peer_gone(e):
        cls = nixlRemoteDisconnectError
    else:
        cls = nixlBackendError
    err = cls(f"{doing}: {e}")
    err.kind = kind
    return err


# ---- configuration ----


class nixl_thread_sync_t(Enum):
    """Accepted for compatibility; kvmove's agent is always thread-safe."""

    NIXL_THREAD_SYNC_NONE = 0
    NIXL_THREAD_SYNC_STRICT = 1
    NIXL_THREAD_SYNC_RW = 2
    NIXL_THREAD_SYNC_DEFAULT = 3


#: Opaque backend handle.
nixl_backend_handle = int


class nixl_agent_config:
    """Agent options, with NIXL's names and defaults. kvmove uses
    ``backends`` (which backends the agent creates) and
    ``capture_telemetry`` (kept for reference: telemetry is always
    available); the progress thread is kvmove's runtime, ``num_threads`` and
    ``sync_mode`` are accepted and unused, and the metadata listener
    (``enable_listen_thread``) is not provided."""

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
_OTHER_MEM_TYPES = {"FILE", "BLK", "BLOCK", "OBJ"}


def _mem_type(mem_type: Optional[str]) -> str:
    if mem_type is None:
        raise nixlInvalidParamError("a memory type is needed with a list of tuples or an array: \"DRAM\" or \"VRAM\"")
    if mem_type in _MEM_TYPES:
        return _MEM_TYPES[mem_type]
    if mem_type in _OTHER_MEM_TYPES:
        raise nixlNotSupportedError(
            f"memory type {mem_type!r} is not supported: kvmove's NIXL agent moves host (\"DRAM\") and "
            "device (\"VRAM\") memory"
        )
    raise nixlInvalidParamError(f"unknown memory type {mem_type!r}; kvmove's NIXL agent takes \"DRAM\" or \"VRAM\"")


class _DList:
    """Descriptors ``(addr, len, dev_id)`` of one memory type, held as an
    ``N x 3`` uint64 array."""

    def __init__(self, mem_type: str, descs: np.ndarray):
        self.mem_type = mem_type
        self._descs = descs

    @property
    def addrs(self) -> np.ndarray:
        return self._descs[:, 0]

    @property
    def lens(self) -> np.ndarray:
        return self._descs[:, 1]

    def __len__(self) -> int:
        return int(self._descs.shape[0])

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
        return (
            type(other) is type(self)
            and other.mem_type == self.mem_type
            and np.array_equal(other._descs, self._descs)
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.mem_type!r}, {len(self)} descriptors)"


class nixlXferDList(_DList):
    """A transfer descriptor list (``get_xfer_descs``)."""


class nixlRegDList(_DList):
    """A registration descriptor list (``get_reg_descs``)."""

    def trim(self) -> nixlXferDList:
        """The same ranges as a transfer descriptor list (NIXL's
        ``nixlRegDList.trim``: NIXL's own examples serialize
        ``register_memory(...).trim()`` for the peer)."""
        return nixlXferDList(self.mem_type, self._descs.copy())


def _rows(descs, mem_type: Optional[str], what: str, width: int) -> Tuple[str, np.ndarray]:
    """``(mem_type, N x 3 array)`` from tuples, an ``N x 3`` array, a
    tensor or a list of tensors."""
    if isinstance(descs, np.ndarray):
        mt = _mem_type(mem_type)
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(f"{what}: a numpy array of descriptors must be N x 3 (addr, len, dev_id)")
        return mt, descs.astype(np.uint64, copy=True)
    if _is_tensor(descs):
        return _tensor_rows([descs], what)
    if not isinstance(descs, (list, tuple)):
        raise nixlInvalidParamError(
            f"{what}: expected a list of tuples, an N x 3 numpy array or tensors, not {type(descs).__name__}"
        )
    if len(descs) == 0:
        return _mem_type(mem_type or "DRAM"), np.zeros((0, 3), dtype=np.uint64)
    if _is_tensor(descs[0]):
        return _tensor_rows(descs, what)
    mt = _mem_type(mem_type)
    packed = nixl_desc_rows(descs, width)  # None: the loop below says what is wrong
    if packed is not None:
        return mt, np.frombuffer(packed, dtype=np.uint64).reshape(-1, 3).copy()
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
    return mt, np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _is_tensor(obj) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def _tensor_rows(tensors, what: str) -> Tuple[str, np.ndarray]:
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
    return types.pop(), np.array(rows, dtype=np.uint64).reshape(-1, 3)


# ---- handles ----


class nixl_prepped_dlist_handle:
    """A prepared descriptor list (``prep_xfer_dlist``): local, or of a
    remote agent. Release with ``release()`` or ``release_dlist_handle``."""

    def __init__(self, agent: "nixl_agent", agent_name: Optional[str], descs: nixlXferDList):
        self._agent = agent
        self.agent_name = agent_name  #: None for a local list
        self.descs = descs
        self._released = False

    def release(self) -> None:
        self._released = True

    def __repr__(self) -> str:
        side = "local" if self.agent_name is None else f"remote {self.agent_name!r}"
        return f"nixl_prepped_dlist_handle({side}, {len(self.descs)} descriptors, released={self._released})"


class nixlXferTelemetry:
    """Telemetry of a transfer: ``startTime`` (microseconds since the
    epoch), ``postDuration`` and ``xferDuration`` (microseconds),
    ``totalBytes``, ``descCount``."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )


class nixl_xfer_handle:
    """A transfer request (``make_prepped_xfer`` / ``initialize_xfer``),
    posted by ``transfer``. Releasing one still running cancels it."""

    def __init__(self, agent: "nixl_agent", op: str, remote: str, ops: NixlOps, notif: bytes):
        self._agent = agent
        self.op = op
        self.remote_agent = remote
        self._ops = ops
        self._notif = notif
        self._native = None  # the NixlXfer of the last post
        self._session = None  # the Session it was posted on
        self._pending = None  # the courier's _Job posting it, until it ran
        self._polled = float("-inf")  # when check_xfer_state last saw the job pending
        self._released = False
        # Posted, and no call has reported its end yet: as in NIXL, a post
        # is active until transfer() or check_xfer_state() said "DONE" or
        # raised, even if it finished in the background meanwhile.
        self._active = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        j = self._pending
        if j is not None:
            # Not posted if it has not started; if it is posting now, the
            # courier cancels what it posted (see nixl_agent._post).
            j.cancelled = True
        x = self._native
        if x is not None and x.state() == "PROC":
            x.cancel()

    def __del__(self):
        try:
            self.release()
        except Exception:  # best effort at garbage collection
            pass

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        st = "not posted" if self._native is None else self._native.state()
        if self._pending is not None and not self._pending.done():
            st = "waiting for the connection"
        return f"nixl_xfer_handle({self.op} {self.remote_agent!r}, {len(self._ops)} descriptors, {st})"


# ---- the agent ----


class _Courier:
    """The work for one remote agent that may wait on it (opening the
    connection, posting a transfer before the connection is up, sending a
    notification), done in order on a thread of its own, so that the calls
    NIXL makes non-blocking (``transfer``, ``send_notif``,
    ``make_connection``) return at once and a hung peer stalls only its
    own work. At most ``LIMIT`` jobs wait."""

    LIMIT = 4096

    def __init__(self, name: str):
        self._name = name
        self._jobs: "List" = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread: Optional[threading.Thread] = None

    def submit(self, job) -> "_Job":
        j = _Job(job)
        with self._cv:
            if self._closed:
                raise nixlBackendError(f"agent {self._name!r} was removed or the agent closed")
            if len(self._jobs) >= self.LIMIT:
                raise nixlBackendError(
                    f"{self.LIMIT} operations already wait for agent {self._name!r} (it does not answer)"
                )
            self._jobs.append(j)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"kvmove-nixl-{self._name}"[:60], daemon=True)
                self._thread.start()
            self._cv.notify()
        return j

    def idle(self) -> bool:
        with self._cv:
            return not self._jobs

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if not self._jobs:
                    return
                j = self._jobs[0]
            j.run()
            with self._cv:
                self._jobs.pop(0)

    def close(self) -> None:
        """Drops the jobs that have not started (each ends with an error)."""
        with self._cv:
            self._closed = True
            dropped, self._jobs = self._jobs[1:], self._jobs[:1]
            self._cv.notify()
        for j in dropped:
            j.drop(nixlBackendError(f"agent {self._name!r} was removed or the agent closed before this ran"))


class _Job:
    """One job of a :class:`_Courier`: done, or failed with an error."""

    def __init__(self, fn):
        self._fn = fn
        self._done = threading.Event()
        self.error: Optional[BaseException] = None
        self.cancelled = False

    def run(self) -> None:
        try:
            if not self.cancelled:
                self._fn()
        except BaseException as e:  # kept for the caller's next status call
            self.error = e
        finally:
            self._done.set()

    def drop(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)


class _Remote:
    """What an agent knows of a remote agent: its metadata, the session
    opened to it (on first use), and the courier that does the work that
    may wait on it."""

    def __init__(self, name: str, session_id: str, regions: List[Tuple[int, int]], backend: str, metadata: bytes):
        self.name = name
        self.session_id = session_id
        self.backend = backend
        self.metadata = metadata
        #: The last work with it found it gone (NIXL's disconnected peer):
        #: ``send_notif`` raises until a transfer reconnects.
        self.gone = False
        order = sorted(regions)
        self.starts = np.array([a for a, _ in order], dtype=np.uint64)
        self.ends = np.array([a + n for a, n in order], dtype=np.uint64)
        self.session = None
        self.courier = _Courier(name)


_FEW = 8


def _uncovered(starts: np.ndarray, ends: np.ndarray, addrs: np.ndarray, lens: np.ndarray) -> int:
    """Index of the first range not inside one region, or -1."""
    if len(addrs) == 0:
        return -1
    if len(starts) == 0:
        return 0
    if len(addrs) <= _FEW:
        # A few ranges (a single page, a layer's K and V): plain Python
        # costs a tenth of numpy's per-call overhead.
        st, en = starts.tolist(), ends.tolist()
        for k, (a, n) in enumerate(zip(addrs.tolist(), lens.tolist())):
            i = bisect.bisect_right(st, a) - 1
            if i < 0 or a + n > en[i]:
                return k
        return -1
    i = np.searchsorted(starts, addrs, side="right") - 1
    # A zero-byte range at a region's start, inside it or at its end is
    # inside (NIXL accepts it; it moves nothing).
    ok = i >= 0
    j = np.clip(i, 0, len(starts) - 1)
    ok &= addrs + lens <= ends[j]
    ok &= addrs + lens >= addrs  # no wrap-around
    bad = np.flatnonzero(~ok)
    return int(bad[0]) if len(bad) else -1


_BACKENDS = ("UCX", "KVMOVE", "TCP", "RDMA")



class nixl_agent:
    """A NIXL agent served by kvmove (host memory, TCP or RDMA).

    ``agent_name`` names it to its peers; ``nixl_conf`` (a
    :class:`nixl_agent_config`) lists the backends to create, default
    ``["UCX"]``. Thread-safe."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        if not isinstance(agent_name, str) or not agent_name:
            raise nixlInvalidParamError("agent_name must be a non-empty string")
        if len(agent_name.encode()) > 1024:
            raise nixlInvalidParamError("agent_name is longer than 1024 bytes")
        self.name = agent_name
        self._lock = threading.RLock()
        self._last_polled: Optional[int] = None  # id() of the handle check_xfer_state last looked at
        self._engine: Optional[Engine] = None
        self._protocol: Optional[str] = None
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self._regions: Dict[int, object] = {}  # addr -> kvmove Region
        self._remotes: Dict[str, _Remote] = {}
        self._self_session = None  # loopback transfers
        self.notifs: Dict[str, List[bytes]] = {}
        self.plugin_list = [b for b in _BACKENDS if b != "RDMA" or HAS_RDMA]
        conf = nixl_conf or nixl_agent_config()
        names = self.plugin_list[:1] if (instantiate_all and nixl_conf is None) else conf.backends
        for b in names:
            if b not in self.plugin_list:
                logger.warning("kvmove NIXL agent %r: skipping backend %r (kvmove serves %s)", agent_name, b, self.plugin_list)
                continue
            self.create_backend(b)

    # ---- backends ----

    def get_plugin_list(self) -> List[str]:
        """Backend names kvmove serves."""
        return list(self.plugin_list)

    def get_plugin_mem_types(self, backend: str) -> List[str]:
        return ["DRAM", "VRAM"] if backend in self.plugin_list else []

    def get_plugin_params(self, backend: str) -> Dict[str, str]:
        return {"device": ""} if backend in self.plugin_list else {}

    def get_backend_mem_types(self, backend: str) -> List[str]:
        return list(self.backend_mems.get(backend, []))

    def get_backend_params(self, backend: str) -> Dict[str, str]:
        return dict(self.backend_options.get(backend, {}))

    def create_backend(self, backend: str, initParams: Optional[Dict[str, str]] = None) -> None:
        """Creates ``backend`` (``"UCX"``, ``"KVMOVE"``, ``"TCP"``, or
        ``"RDMA"`` in an RDMA build). The first one starts the agent's
        engine; later ones share it (they must not ask for another
        protocol). ``initParams["device"]`` names the RDMA device; other
        parameters (``num_threads``, ...) are accepted and ignored."""
        params = dict(initParams or {})
        if backend not in self.plugin_list:
            raise nixlNotSupportedError(
                f"backend {backend!r} is not served by kvmove; use one of {self.plugin_list}"
            )
        if backend in ("TCP", "RDMA"):
            protocol = backend.lower()
        else:
            protocol = (os.environ.get("KVMOVE_PROTOCOL") or "").strip().lower() or None
        with self._lock:
            if backend in self.backends:
                raise nixlInvalidParamError(f"backend {backend!r} was already created")
            if self._engine is None:
                self._engine = self._start_engine(protocol, params.get("device") or None)
                # Start the engine's notification driver now, so notifications
                # that arrive before the first get_new_notifs are queued.
                self._engine.notifications(0)
                self._protocol = self._engine.backend
            elif protocol is not None and protocol != self._protocol:
                raise nixlNotAllowedError(
                    f"backend {backend!r} asks for {protocol} but this agent's engine runs {self._protocol}: "
                    "one protocol per agent"
                )
            self.backends[backend] = len(self.backends) + 1
            self.backend_mems[backend] = ["DRAM", "VRAM"] if self._engine.device_memory else ["DRAM"]
            self.backend_options[backend] = {"protocol": self._protocol or "", "session_id": self._engine.session_id}

    def _start_engine(self, protocol: Optional[str], device: Optional[str]) -> Engine:
        config = None
        cfg_path = os.environ.get("KVMOVE_CONFIG")
        if cfg_path:
            with open(cfg_path, encoding="utf-8") as f:
                config = f.read()
        host = os.environ.get("KVMOVE_NIXL_HOST") or None
        if config is None and host is None:
            host = "127.0.0.1"
        policy = os.environ.get("KVMOVE_POLICY")
        try:
            return Engine(
                protocol=protocol,
                host=host,
                device=device,
                policy=json.loads(policy) if policy else None,
                config=config,
            )
        except TransferError as e:
            raise _from_kvmove(e, "starting the kvmove engine") from e
        except ValueError as e:
            raise nixlInvalidParamError(f"KVMOVE_POLICY is not valid JSON: {e}") from e

    def _need_engine(self) -> Engine:
        if self._engine is None:
            raise nixlNotAllowedError("no backend was created on this agent (create_backend(\"UCX\") first)")
        return self._engine

    def _check_backends(self, backends) -> None:
        for b in backends or ():
            if b not in self.backends:
                raise nixlNotFoundError(f"backend {b!r} was not created on this agent (created: {list(self.backends)})")

    # ---- descriptors ----

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> nixlXferDList:
        """A transfer descriptor list from ``(addr, len, dev_id)`` tuples, an
        ``N x 3`` array, a CPU tensor or a list of CPU tensors."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError("a registration list was given where a transfer list is needed")
        mt, rows = _rows(descs, mem_type, "get_xfer_descs", 3)
        return nixlXferDList(mt, rows)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> nixlRegDList:
        """A registration descriptor list from ``(addr, len, dev_id, meta)``
        tuples (or 3-tuples), an ``N x 3`` array, or CPU tensors."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError("a transfer list was given where a registration list is needed")
        mt, rows = _rows(descs, mem_type, "get_reg_descs", 4)
        return nixlRegDList(mt, rows)

    def get_serialized_descs(self, descs) -> bytes:
        return pickle.dumps(descs)

    def deserialize_descs(self, serialized_descs: bytes):
        return pickle.loads(serialized_descs)

    # ---- memory ----

    def register_memory(self, reg_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()) -> nixlRegDList:
        """Registers memory for local use and remote read/write. All or
        nothing: a failure unregisters what this call registered.
        ``"DRAM"`` must be host memory this process can read; ``"VRAM"``
        is device memory of an installed provider on device ``dev_id``
        (moved through the provider, see :mod:`kvmove.devices`), or host
        memory labelled ``"VRAM"`` (serving engines on CPU do that). Memory
        that is neither, device memory given as ``"DRAM"``, or device memory
        on another device than ``dev_id`` raises. The caller keeps the
        memory allocated until ``deregister_memory``."""
        descs = self.get_reg_descs(reg_list, mem_type)
        self._check_backends(backends)
        with self._lock:
            eng = self._need_engine()
            done = []
            try:
                for addr, length, dev in descs:
                    if length == 0:
                        raise nixlInvalidParamError(f"descriptor at {addr:#x} has length 0")
                    kind = "host" if descs.mem_type == "DRAM" else f"device:{dev}"
                    self._regions[addr] = eng.register_address(addr, length, kind)
                    done.append(addr)
            except TransferError as e:
                for a in done:
                    self._regions.pop(a).unregister()
                raise _from_kvmove(e, "register_memory") from e
            except nixlError:
                for a in done:
                    self._regions.pop(a).unregister()
                raise
        return descs

    def deregister_memory(self, dereg_list, backends: Sequence[str] = ()) -> None:
        """Unregisters memory registered by ``register_memory`` (each
        descriptor's address must start a registered region); returns once
        no transfer can touch it."""
        descs = self.get_reg_descs(dereg_list, "DRAM" if not isinstance(dereg_list, _DList) else None)
        self._check_backends(backends)
        with self._lock:
            missing = [a for a, _, _ in descs if a not in self._regions]
            if missing:
                raise nixlNotFoundError(f"deregister_memory: {missing[0]:#x} is not a registered region's start")
            for a, _, _ in descs:
                try:
                    self._regions.pop(a).unregister()
                except TransferError as e:
                    raise _from_kvmove(e, "deregister_memory") from e

    def _local_bounds(self) -> Tuple[np.ndarray, np.ndarray]:
        order = sorted((r.addr, r.addr + r.length) for r in self._regions.values())
        return (np.array([s for s, _ in order], dtype=np.uint64), np.array([e for _, e in order], dtype=np.uint64))

    # ---- metadata ----

    def get_agent_metadata(self) -> bytes:
        """This agent's metadata for its peers' ``add_remote_agent``: its
        name, how to reach it, and the memory registered now."""
        with self._lock:
            eng = self._need_engine()
            md = {
                "name": self.name,
                "session_id": eng.session_id,
                "backend": eng.backend,
                "regions": sorted([r.addr, r.length] for r in self._regions.values()),
            }
        return _MD_MAGIC + json.dumps(md, separators=(",", ":")).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a remote agent's metadata (from its ``get_agent_metadata``);
        returns its name as ``bytes``, as NIXL does (every method taking an
        agent name takes ``str`` or ``bytes``). Loading the same metadata
        again returns the name; other metadata under a loaded name raises
        ``nixlNotAllowedError`` (``remove_remote_agent`` it first, as NIXL
        wants); metadata that is not a kvmove agent's raises
        ``nixlMismatchError``, as NIXL's own for unreadable metadata."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise nixlInvalidParamError(f"metadata must be bytes, not {type(metadata).__name__}")
        metadata = bytes(metadata)
        if not metadata.startswith(_MD_MAGIC):
            raise nixlMismatchError("not kvmove NIXL agent metadata (both sides must run kvmove's nixl_agent)")
        try:
            md = json.loads(metadata[len(_MD_MAGIC) :])
            name, sid, backend = str(md["name"]), str(md["session_id"]), str(md["backend"])
            regions = [(int(a), int(n)) for a, n in md["regions"]]
        except (ValueError, KeyError, TypeError) as e:
            raise nixlMismatchError(f"malformed agent metadata: {e}") from None
        with self._lock:
            eng = self._need_engine()
            if backend != eng.backend:
                raise nixlMismatchError(
                    f"remote agent {name!r} runs kvmove over {backend}, this agent over {eng.backend}"
                )
            old = self._remotes.get(name)
            if old is not None:
                if old.metadata == metadata:
                    return name.encode()
                raise nixlNotAllowedError(
                    f"agent {name!r} is loaded with other metadata (remove_remote_agent it first: a restarted peer)"
                )
            self._remotes[name] = _Remote(name, sid, regions, backend, metadata)
        return name.encode()

    def remove_remote_agent(self, agent: str) -> None:
        """Forgets a remote agent and closes the session to it; transfers
        to it can no longer be made. An unknown name is ignored."""
        agent = _agent_name(agent)
        with self._lock:
            old = self._remotes.pop(agent, None)
        if old is not None:
            old.courier.close()
            self._close_session(old)

    def check_remote_metadata(self, agent: str, descs=None) -> bool:
        """Whether ``agent``'s metadata was loaded (and, with ``descs``,
        whether every descriptor lies in memory it registered)."""
        agent = _agent_name(agent)
        with self._lock:
            r = self._remotes.get(agent)
        if r is None:
            return False
        if descs is None:
            return True
        d = self.get_xfer_descs(descs, "DRAM" if not isinstance(descs, _DList) else None)
        return _uncovered(r.starts, r.ends, d.addrs, d.lens) < 0

    def make_connection(self, remote_agent: str, backends: Sequence[str] = ()) -> None:
        """Starts opening the session to ``remote_agent`` now rather than
        at the first transfer, and returns at once (as NIXL does); a failure
        is logged, and the first transfer tries again."""
        self._check_backends(backends)
        r = self._remote(remote_agent)

        def connect():
            try:
                self._session(r)
            except nixlError as e:
                logger.warning("make_connection to agent %r: %s", r.name, e)

        r.courier.submit(connect)

    def _remote(self, name: str) -> _Remote:
        name = _agent_name(name)
        with self._lock:
            r = self._remotes.get(name)
        if r is None:
            raise nixlNotFoundError(f"unknown remote agent {name!r} (load its metadata with add_remote_agent)")
        return r

    def _session(self, r: _Remote):
        with self._lock:
            if r.session is not None:
                return r.session
            eng = self._need_engine()
        # Connect without the lock: an unreachable peer must not stall the
        # agent's other threads. (A peer that refuses at once, busy at its
        # limit, is retried by the engine's policy: rule 8, once.)
        try:
            s = eng.connect(r.session_id)
        except TransferError as e:
            raise _from_kvmove(e, f"connecting to agent {r.name!r} at {r.session_id}") from e
        with self._lock:
            if r.session is None:
                r.session, s = s, None
            session = r.session
            r.gone = False
        if s is not None:  # another thread connected meanwhile: keep theirs
            try:
                s.close()
            except TransferError:
                pass
        return session

    def _close_session(self, r: _Remote) -> None:
        with self._lock:
            s, r.session = r.session, None
        if s is not None:
            try:
                s.close()
            except TransferError:
                pass

    # ---- transfers ----

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()
    ) -> nixl_prepped_dlist_handle:
        """Prepares descriptors: local ones with ``"NIXL_INIT_AGENT"`` (or
        ``""``), else those of the remote agent ``agent_name`` (this agent's
        own name: loopback). Every descriptor must lie inside registered
        memory (the remote agent's, as its metadata says), else
        ``nixlNotFoundError``."""
        descs = self.get_xfer_descs(xfer_list, mem_type)
        self._check_backends(backends)
        agent_name = _agent_name(agent_name)
        if agent_name in (NIXL_INIT_AGENT, ""):
            with self._lock:
                starts, ends = self._local_bounds()
            bad = _uncovered(starts, ends, descs.addrs, descs.lens)
            if bad >= 0:
                a, n, _ = descs[bad]
                raise nixlNotFoundError(f"local descriptor {bad} ({a:#x}, {n} bytes) is not inside registered memory")
            return nixl_prepped_dlist_handle(self, None, descs)
        self._check_remote_descs(agent_name, descs, "")
        return nixl_prepped_dlist_handle(self, agent_name, descs)

    def _check_remote_descs(self, agent_name: str, descs: _DList, what: str) -> None:
        agent_name = _agent_name(agent_name)
        if agent_name == self.name and agent_name not in self._remotes:
            with self._lock:
                starts, ends = self._local_bounds()
        else:
            r = self._remote(agent_name)
            starts, ends = r.starts, r.ends
        bad = _uncovered(starts, ends, descs.addrs, descs.lens)
        if bad >= 0:
            a, n, _ = descs[bad]
            raise nixlNotFoundError(
                f"{what}remote descriptor {bad} ({a:#x}, {n} bytes) is not inside memory agent {agent_name!r} registered"
            )

    def _target(self, agent_name: str) -> str:
        """The session id of a transfer's remote side."""
        agent_name = _agent_name(agent_name)
        if agent_name == self.name and agent_name not in self._remotes:
            return self._need_engine().session_id
        return self._remote(agent_name).session_id

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        """A transfer of the prepared descriptors picked by index: local
        descriptor ``local_indices[i]`` with remote descriptor
        ``remote_indices[i]`` (same lengths). ``"READ"`` copies remote into
        local, ``"WRITE"`` local into remote; ``notif_msg`` (if not empty)
        reaches the remote agent after the data."""
        op = _operation(operation)
        self._check_backends(backends)
        for h, side in ((local_xfer_side, "local"), (remote_xfer_side, "remote")):
            if not isinstance(h, nixl_prepped_dlist_handle):
                raise nixlInvalidParamError(f"{side}_xfer_side must be a handle from prep_xfer_dlist")
            if h._released:
                raise nixlInvalidParamError(f"{side}_xfer_side was released")
        if local_xfer_side.agent_name is not None:
            raise nixlInvalidParamError("local_xfer_side was prepared for a remote agent (use NIXL_INIT_AGENT)")
        if remote_xfer_side.agent_name is None:
            raise nixlInvalidParamError("remote_xfer_side was prepared as local (use the remote agent's name)")
        li = _indices(local_indices, len(local_xfer_side.descs), "local_indices")
        ri = _indices(remote_indices, len(remote_xfer_side.descs), "remote_indices")
        if len(li) != len(ri):
            raise nixlInvalidParamError(f"{len(li)} local indices but {len(ri)} remote indices")
        la, ll = local_xfer_side.descs.addrs[li], local_xfer_side.descs.lens[li]
        ra, rl = remote_xfer_side.descs.addrs[ri], remote_xfer_side.descs.lens[ri]
        return self._new_xfer(op, la, ll, ra, rl, remote_xfer_side.agent_name, notif_msg)

    def initialize_xfer(
        self,
        operation: str,
        local_descs,
        remote_descs,
        remote_agent: str,
        notif_msg: bytes = b"",
        backends: Sequence[str] = (),
    ) -> nixl_xfer_handle:
        """A transfer between two descriptor lists of the same length
        (``get_xfer_descs``): local descriptor ``i`` with remote descriptor
        ``i``. Checked as ``prep_xfer_dlist`` checks them."""
        op = _operation(operation)
        self._check_backends(backends)
        ld = self.get_xfer_descs(local_descs, "DRAM" if not isinstance(local_descs, _DList) else None)
        rd = self.get_xfer_descs(remote_descs, "DRAM" if not isinstance(remote_descs, _DList) else None)
        if len(ld) != len(rd):
            raise nixlInvalidParamError(f"{len(ld)} local descriptors but {len(rd)} remote descriptors")
        with self._lock:
            starts, ends = self._local_bounds()
        bad = _uncovered(starts, ends, ld.addrs, ld.lens)
        if bad >= 0:
            a, n, _ = ld[bad]
            raise nixlNotFoundError(f"local descriptor {bad} ({a:#x}, {n} bytes) is not inside registered memory")
        self._check_remote_descs(remote_agent, rd, "")
        return self._new_xfer(op, ld.addrs, ld.lens, rd.addrs, rd.lens, remote_agent, notif_msg)

    def _new_xfer(self, op, la, ll, ra, rl, remote: str, notif_msg) -> nixl_xfer_handle:
        if len(la) == 0:
            raise nixlInvalidParamError("a transfer needs at least one descriptor")
        mismatch = np.flatnonzero(ll != rl)
        if len(mismatch):
            i = int(mismatch[0])
            raise nixlInvalidParamError(
                f"descriptor pair {i}: local length {int(ll[i])} != remote length {int(rl[i])}"
            )
        notif = _notif_bytes(notif_msg)
        remote = _agent_name(remote)
        self._target(remote)  # the remote agent must be known now
        words = [np.ascontiguousarray(a, dtype=np.uint64).tobytes() for a in (la, ra, ll)]
        try:
            ops = NixlOps(op == "WRITE", *words)
        except TransferError as e:
            raise _from_kvmove(e, "preparing the transfer") from e
        return nixl_xfer_handle(self, op, remote, ops, notif)

    def transfer(self, handle: nixl_xfer_handle, notif_msg: bytes = b"") -> str:
        """Posts the transfer (again, once a call reported the previous
        post's end); returns ``"PROC"``: ``check_xfer_state`` reports the
        end.
        ``notif_msg`` replaces the handle's notification. A transfer refused
        before anything moved raises (e.g. ``nixlNotFoundError`` for memory
        outside registered ranges, ``nixlRemoteDisconnectError`` for an
        unreachable peer); the remote agent is then not notified."""
        if not isinstance(handle, nixl_xfer_handle):
            raise nixlInvalidParamError("handle must come from make_prepped_xfer or initialize_xfer")
        if handle._released:
            raise nixlInvalidParamError("the transfer handle was released")
        if handle._active:
            raise nixlRepostActiveError(
                "the transfer's last post was not seen to end; check_xfer_state until DONE before posting it again"
            )
        handle._pending = None
        notif = _notif_bytes(notif_msg) if notif_msg else handle._notif
        target = self._target(handle.remote_agent)
        self._need_engine()
        with self._lock:
            r = self._remotes.get(handle.remote_agent)
        wire = _encode_notif(self.name, notif) if notif else None
        ops = handle._ops
        handle._native = None
        if r is None or (r.session is not None and r.courier.idle()):
            # Connected (or loopback): posting does not wait on the peer.
            self._post(handle, r, ops, target, wire)
            handle._active = True
            # Failed already: raise as check_xfer_state does. Done already:
            # still "PROC" (check_xfer_state reports the end), so whether a
            # post is active never depends on how fast it was.
            if handle._native.state() == "ERR":
                return self.check_xfer_state(handle)
            return "PROC"
        # Not connected yet, or work for this peer still waits: the courier
        # connects and posts, in order, and this call returns at once.
        handle._pending = r.courier.submit(lambda: None if handle._released else self._post(handle, r, ops, target, wire))
        handle._active = True
        return "PROC"

    def _post(self, handle: nixl_xfer_handle, r: Optional[_Remote], ops, target: str, wire) -> None:
        """Opens the session if needed and posts ``ops``; raises the NIXL
        error of a refusal (the remote agent is then not notified)."""
        eng = self._need_engine()
        session = self._session(r) if r is not None else self._loopback_session()
        try:
            x = eng._native.submit_nixl(session._seg, ops, target if wire is not None else None, wire)
        except TransferError as e:
            if r is not None and _peer_gone(e):
                self._forget_session(r, session)
            raise _from_kvmove(e, f"posting a {handle.op} to agent {handle.remote_agent!r}") from e
        handle._native = x
        handle._session = (r, session)
        if handle._released and x.state() == "PROC":
            x.cancel()  # released while the courier was posting it

    def _loopback_session(self):
        with self._lock:
            if self._self_session is None:
                eng = self._need_engine()
                try:
                    self._self_session = eng.connect(eng.session_id)
                except TransferError as e:
                    raise _from_kvmove(e, "connecting to this agent (loopback)") from e
            return self._self_session

    def _forget_session(self, r: _Remote, session) -> None:
        """Drops a session to a peer that went away, so the next transfer
        opens a fresh one (a restarted peer has new keys)."""
        with self._lock:
            r.gone = True
            if r.session is not session:
                return
            r.session = None
        try:
            session.close()
        except TransferError:
            pass

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        """``"PROC"`` while running, ``"DONE"`` once every byte landed and
        the notification (if any) is in the remote agent's inbox. A failed
        transfer raises, as NIXL's bindings do (``nixlRemoteDisconnectError``,
        ``nixlNotFoundError``, ``nixlCancelledError``, ``nixlBackendError``,
        with ``.kind``); its notification was not sent."""
        j = handle._pending if isinstance(handle, nixl_xfer_handle) else None
        if j is not None:
            # Still connecting, or queued behind the peer's other work. A
            # caller polling back to back waits a little for the post
            # instead of spinning (as the posted transfer's poll does).
            same, self._last_polled = self._last_polled == id(handle), id(handle)
            spinning = same and time.monotonic() - handle._polled < _SPIN_GAP
            if not (j.done() or spinning and j.wait(_SPIN_WAIT)):
                handle._polled = time.monotonic()
                return "PROC"
            handle._pending = None
            if j.error is not None:
                handle._active = False
                raise j.error
        x = self._posted(handle)
        # Only a caller polling this same handle back to back may be made
        # to wait; one going over several handles never is.
        same, self._last_polled = self._last_polled == id(handle), id(handle)
        st = x.poll(same)
        if st == "PROC":
            return st
        handle._active = False
        if st != "ERR":
            return st
        e = x.error()
        r, session = handle._session or (None, None)
        if r is not None and _peer_gone(e):
            self._forget_session(r, session)
        raise _from_kvmove(e, f"{handle.op} with agent {handle.remote_agent!r} failed")

    def _posted(self, handle: nixl_xfer_handle):
        if not isinstance(handle, nixl_xfer_handle):
            raise nixlInvalidParamError("handle must come from make_prepped_xfer or initialize_xfer")
        if handle._native is None:
            raise nixlNotPostedError("the transfer was not posted (call transfer first)")
        return handle._native

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Times (microseconds) and sizes of the last post of ``handle``.
        Available whether or not ``capture_telemetry`` was set."""
        start, post, xfer, total, count = self._posted(handle).telemetry()
        return nixlXferTelemetry(start, post, xfer, total, count)

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        """The backend the agent's transfers run on (the first created)."""
        self._need_engine()
        return next(iter(self.backends))

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Releases a transfer handle; one still running is cancelled first
        (and sends no notification)."""
        handle.release()

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        handle.release()

    # ---- notifications ----

    def _pull_notifs(self) -> Dict[str, List[bytes]]:
        """Takes every received notification, grouped by sender agent, in
        arrival order (kvmove notifications not sent by an agent are keyed
        by the sender's session id)."""
        with self._lock:
            eng = self._need_engine()
            got: Dict[str, List[bytes]] = {}
            while True:
                batch = eng.notifications(1024)
                for n in batch:
                    name, msg = _decode_notif(n.peer, n.msg)
                    got.setdefault(name, []).append(msg)
                if len(batch) < 1024:
                    return got

    def get_new_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Notifications received since the last call, as ``{agent name:
        [message, ...]}`` (each sender's in the order sent)."""
        self._check_backends(backends)
        return self._pull_notifs()

    def update_notifs(self, backends: Sequence[str] = ()) -> Dict[str, List[bytes]]:
        """Adds new notifications to ``self.notifs`` and returns it."""
        self._check_backends(backends)
        for k, v in self._pull_notifs().items():
            self.notifs.setdefault(k, []).extend(v)
        return self.notifs

    def check_remote_xfer_done(
        self, remote_agent_name: str, lookup_tag: bytes, backends: Sequence[str] = (), tag_is_prefix: bool = True
    ) -> bool:
        """Whether a notification from ``remote_agent_name`` starting with
        (or, without ``tag_is_prefix``, containing) ``lookup_tag`` arrived;
        the one found is removed from ``self.notifs``."""
        tag = _notif_bytes(lookup_tag)
        self.update_notifs(backends)
        msgs = self.notifs.get(_agent_name(remote_agent_name), [])
        for i, m in enumerate(msgs):
            if (m.startswith(tag) if tag_is_prefix else tag in m):
                del msgs[i]
                return True
        return False

    def send_notif(self, remote_agent_name: str, notif_msg: bytes, backend: Optional[str] = None) -> None:
        """Sends a notification not tied to a transfer. Returns at once, as
        NIXL does: the message is delivered in order with this agent's other
        work for that peer, on a thread of its own; a delivery that fails
        (the peer is gone) is logged on logger ``kvmove.nixl``. Raises for
        an unknown agent, a bad message, or when ``_Courier.LIMIT``
        operations already wait for a peer that does not answer."""
        if backend is not None:
            self._check_backends([backend])
        remote_agent_name = _agent_name(remote_agent_name)
        wire = _encode_notif(self.name, _notif_bytes(notif_msg))
        target = self._target(remote_agent_name)
        eng = self._need_engine()
        with self._lock:
            r = self._remotes.get(remote_agent_name)
        if r is not None and r.gone:
            raise nixlRemoteDisconnectError(
                f"agent {remote_agent_name!r} was found gone by the last work with it (a transfer reconnects)"
            )

        def deliver():
            deadline = time.monotonic() + 5.0
            while True:
                try:
                    eng.notify(target, wire)
                    return
                except TransferError as e:
                    if getattr(e, "kind", None) == "backpressure" and time.monotonic() < deadline:
                        time.sleep(0.005)
                        continue
                    logger.warning("send_notif to agent %r was not delivered: %s", remote_agent_name, e)
                    if r is not None and _peer_gone(e):
                        r.gone = True
                    return

        if r is None:  # this agent itself
            deliver()
        else:
            r.courier.submit(deliver)

    # ---- lifetime ----

    def metrics(self) -> dict:
        """kvmove's metrics as a dict (not in NIXL's API):
        :func:`kvmove.metrics`, process-wide."""
        from ._metrics import metrics

        return metrics()

    def close(self) -> None:
        """Closes the agent's engine (ends transfers, unregisters memory).
        kvmove addition; also done when the agent is garbage collected."""
        with self._lock:
            eng, self._engine = self._engine, None
            self._self_session = None
            self._regions.clear()
            remotes = list(self._remotes.values())
            self._remotes.clear()
        for r in remotes:
            r.courier.close()
        if eng is not None:
            eng.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        sid = self._engine.session_id if self._engine is not None else None
        return f"nixl_agent({self.name!r}, session_id={sid!r}, backends={list(self.backends)})"


def _operation(op) -> str:
    if op not in ("READ", "WRITE"):
        raise nixlInvalidParamError(f"operation must be \"READ\" or \"WRITE\", not {op!r}")
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
        bad = int(a[(a < 0) | (a >= n)][0])
        raise nixlInvalidParamError(f"{what}: index {bad} is outside the prepared list of {n} descriptors")
    return a


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


__all__ = [
    "DEFAULT_COMM_PORT",
    "NIXL_INIT_AGENT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
    "nixlXferDList",
    "nixlRegDList",
    "nixlXferTelemetry",
    "nixlError",
    "nixlNotPostedError",
    "nixlInvalidParamError",
    "nixlBackendError",
    "nixlNotFoundError",
    "nixlMismatchError",
    "nixlNotAllowedError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlNotSupportedError",
    "nixlRemoteDisconnectError",
    "nixlCancelledError",
    "nixlNoTelemetryError",
]

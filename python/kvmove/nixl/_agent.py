"""``nixl_agent``: NIXL's agent API, call by call, over one kvmove
engine (the package's docstring says how it maps). One class, as NIXL's
is; what it shares with the rest is in the sibling modules."""

from __future__ import annotations

import json
import os
import pickle
import secrets
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._engine import Engine
from .._native import HAS_RDMA, NixlOps, TransferError, nixl_desc_rows, nixl_index_words
from . import _bindings, _listen
from ._base import (
    logger,
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    _MD_MAGIC,
    _peer_gone,
    nixlError,
    nixlNotPostedError,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlRepostActiveError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlNoTelemetryError,
    _QUEUE_LIMIT,
    _non_blocking,
    _held,
    _from_kvmove,
)
from ._descs import (
    _MEM_TYPES,
    nixl_thread_sync_t,
    nixl_agent_config,
    _DList,
    nixlXferDList,
    nixlRegDList,
    _rows,
    _operation,
    _indices,
    _index_outside,
    _agent_name,
    _notif_bytes,
    _encode_notif,
    _decode_notif,
)
from ._handles import (
    nixl_prepped_dlist_handle,
    nixlXferTelemetry,
    nixl_xfer_handle,
    _Courier,
    _Remote,
    _uncovered,
    _packed,
    _BACKENDS,
)


def _index_words(idx) -> Optional[bytes]:
    """A one-dimensional numpy array of integers, or a plain list of plain
    non-negative ``int``s, as native-endian ``u64`` words for Rust to check
    (an array's negative index becomes one too large, which it refuses,
    naming its position); None for anything else."""
    if type(idx) is np.ndarray and idx.ndim == 1 and idx.dtype.kind in "iu":
        return np.ascontiguousarray(idx, dtype=np.int64 if idx.dtype.kind == "i" else np.uint64).tobytes()
    if type(idx) is list:
        return nixl_index_words(idx)
    return None


def _outside(side: str, descs: _DList, bad: int, agent: str) -> nixlNotFoundError:
    """The error for descriptor ``bad`` of a ``"local"`` or ``"remote"``
    list that is not inside registered memory (the remote ``agent``'s)."""
    a, n, _ = descs[bad]
    if side == "local":
        return nixlNotFoundError(f"local descriptor {bad} ({a:#x}, {n} bytes) is not inside registered memory")
    return nixlNotFoundError(f"remote descriptor {bad} ({a:#x}, {n} bytes) is not inside memory agent {agent!r} registered")


# ---- the agent ----


def _close_aside(session) -> None:
    """Closes ``session`` on a thread of its own. The close ends the
    session's transfers still running and waits for the peer's answers (up
    to the engine's ``drain_timeout`` on a frozen peer) before it resets
    the connections; the calls that drop a session (``check_xfer_state``,
    ``transfer``, ``remove_remote_agent``) run on vLLM's engine thread and
    must not wait for a peer."""

    def close():
        try:
            session.close()
        except TransferError:
            pass

    # Not a daemon: a daemon thread inside the engine's call when the
    # interpreter finalizes would be torn down mid-call; exit waits for
    # this one instead (bounded by the engine's drain timeouts).
    try:
        threading.Thread(target=close, name="kvmove-nixl-close").start()
    except RuntimeError:  # the interpreter is shutting down: no new threads
        close()


class nixl_agent:
    """A NIXL agent served by kvmove (host memory, TCP or RDMA).

    ``agent_name`` names it to its peers; ``nixl_conf`` (a
    :class:`nixl_agent_config`) lists the backends to create, default
    ``["UCX"]``. Thread-safe."""

    def __init__(self, agent_name: str, nixl_conf: Optional[nixl_agent_config] = None, instantiate_all: bool = False):
        conf = nixl_conf or nixl_agent_config()
        # The bindings' agent is made from its config as NIXL's is, both
        # looked up in nixl._bindings now (a test may replace them there):
        # it checks the name and decides whether telemetry is captured.
        cfg = _bindings.nixlAgentConfig()
        cfg.useProgThread = conf.enable_pthread
        cfg.useListenThread = conf.enable_listen
        cfg.listenPort = conf.port
        default_sync = (
            nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if conf.enable_listen else nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
        )
        cfg.syncMode = (conf.sync_mode or default_sync).value
        cfg.captureTelemetry = conf.capture_telemetry
        self.agent = _bindings.nixlAgent(agent_name, cfg)
        self.name = _agent_name(agent_name)  # bytes (NIXL takes them) as str
        if len(self.name.encode()) > 1024:
            raise nixlInvalidParamError("agent_name is longer than 1024 bytes")
        self._telemetry = self.agent.telemetry
        self._lock = threading.RLock()
        self._last_polled: Optional[int] = None  # id() of the handle check_xfer_state last looked at
        self._engine: Optional[Engine] = None
        # The engine's wait policy for polls of queued transfers (set with
        # the engine; none is queued before it).
        self._spin_gap = self._spin_wait = 0.0
        self._protocol: Optional[str] = None
        self.backends: Dict[str, int] = {}
        self.backend_mems: Dict[str, List[str]] = {}
        self.backend_options: Dict[str, Dict[str, str]] = {}
        self._regions: Dict[int, object] = {}  # addr -> kvmove Region
        self._bounds: Optional[Tuple[bytes, bytes]] = None  # _local_bounds, until _regions changes
        self._remotes: Dict[str, _Remote] = {}
        self._self_session = None  # loopback transfers
        self.notifs: Dict[str, List[bytes]] = {}
        #: This agent's instance in its metadata (NIXL's connection info
        #: changes when an agent restarts; a session id may not).
        self._conn = secrets.token_hex(8)
        self._listener: Optional[_listen.Listener] = None
        self._md_courier: Optional[_Courier] = None
        if conf.enable_listen:
            # NIXL's metadata listener, on the host this agent advertises
            # (never every interface unless that is what is set).
            host = _listen.listen_host(os.environ.get("KVMOVE_NIXL_HOST"))
            secret, insecure = _listen.access()
            self._listener = _listen.Listener(
                host, int(conf.port), _listen.agent_handler(self), self.name, secret=secret, insecure=insecure
            )
        self.plugin_list = [b for b in _BACKENDS if b != "RDMA" or HAS_RDMA]
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
        ``"RDMA"`` in an RDMA build; another name is ``nixlNotFoundError``,
        as NIXL's for a plugin it does not have). The first one starts the
        agent's engine; later ones share it (they must not ask for another
        protocol). ``initParams["device"]`` names the RDMA device; other
        parameters (``num_threads``, ...) are accepted and ignored."""
        params = dict(initParams or {})
        if backend not in self.plugin_list:
            raise nixlNotFoundError(
                f"backend {backend!r} is not served by kvmove; use one of {self.plugin_list}"
            )
        # Other backends run what KVMOVE_PROTOCOL (else KVMOVE_CONFIG) says.
        protocol = backend.lower() if backend in ("TCP", "RDMA") else None
        with self._lock:
            if backend in self.backends:
                raise nixlInvalidParamError(f"backend {backend!r} was already created")
            if self._engine is None:
                self._engine = self._start_engine(protocol, params.get("device") or None)
                # Polls of a transfer still queued follow the engine's wait
                # policy, as a posted one's (NixlXfer.poll) do: closer
                # together than the gap, the caller spins, and such a poll
                # waits a little for the post.
                wait = self._engine._native.wait_policy
                self._spin_gap, self._spin_wait = wait["spinning_gap_us"] / 1e6, wait["spinner_wait_us"] / 1e6
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
        # KVMOVE_CONFIG, KVMOVE_POLICY and KVMOVE_PROTOCOL are read by the
        # engine (Engine.from_env); KVMOVE_NIXL_HOST, this surface's own,
        # moves the listener (default: the config's, else 127.0.0.1).
        host = os.environ.get("KVMOVE_NIXL_HOST") or None
        try:
            return Engine.from_env(protocol=protocol, host=host, device=device)
        except TransferError as e:
            raise _from_kvmove(e, "starting the kvmove engine") from e

    def _need_engine(self) -> Engine:
        if self._engine is None:
            raise nixlNotAllowedError("no backend was created on this agent (create_backend(\"UCX\") first)")
        return self._engine

    def _check_backends(self, backends) -> None:
        for b in backends or ():
            if b not in self.backends:
                raise nixlNotFoundError(f"backend {b!r} was not created on this agent (created: {list(self.backends)})")

    # ---- descriptors ----

    def get_xfer_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlXferDList]:
        """A transfer descriptor list from ``(addr, len, dev_id)`` tuples, an
        ``N x 3`` array, a CPU tensor or a list of CPU tensors. Input it
        cannot read (a registration list, tuples or an array without
        ``mem_type``, tuples of another size, a non-contiguous tensor...)
        is logged and gives None, as in NIXL; an unknown ``mem_type`` is a
        ``KeyError``, as there."""
        if type(descs) is list and mem_type in _MEM_TYPES:
            # What callers build, a list of tuples, read in one call (a list
            # of anything else comes back None and takes the path below).
            packed = nixl_desc_rows(descs, 3)
            if packed is not None:
                return nixlXferDList(_MEM_TYPES[mem_type], raw=packed)
        try:
            return self._xfer_descs(descs, mem_type)
        except nixlInvalidParamError as e:
            logger.error("%s", e)
            return None

    def _xfer_descs(self, descs, mem_type: Optional[str]) -> nixlXferDList:
        """``get_xfer_descs``, raising ``nixlInvalidParamError`` for input
        it cannot read: what the agent's calls that take descriptors use."""
        if isinstance(descs, nixlXferDList):
            return descs
        if isinstance(descs, nixlRegDList):
            raise nixlInvalidParamError("get_xfer_descs: a registration list was given where a transfer list is needed")
        mt, rows = _rows(descs, mem_type, "get_xfer_descs", 3)
        return nixlXferDList(mt, raw=rows)

    def get_reg_descs(self, descs, mem_type: Optional[str] = None) -> Optional[nixlRegDList]:
        """A registration descriptor list from ``(addr, len, dev_id, meta)``
        tuples (or 3-tuples), an ``N x 3`` array, or CPU tensors. Input it
        cannot read gives None and an unknown ``mem_type`` a ``KeyError``,
        as ``get_xfer_descs``."""
        try:
            return self._reg_descs(descs, mem_type)
        except nixlInvalidParamError as e:
            logger.error("%s", e)
            return None

    def _reg_descs(self, descs, mem_type: Optional[str]) -> nixlRegDList:
        """``get_reg_descs``, raising for input it cannot read."""
        if isinstance(descs, nixlRegDList):
            return descs
        if isinstance(descs, nixlXferDList):
            raise nixlInvalidParamError("get_reg_descs: a transfer list was given where a registration list is needed")
        mt, rows = _rows(descs, mem_type, "get_reg_descs", 4)
        return nixlRegDList(mt, raw=rows)

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
        descs = self._reg_descs(reg_list, mem_type)
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
                    self._bounds = None
                    done.append(addr)
            except TransferError as e:
                for a in done:
                    self._regions.pop(a).unregister()
                self._bounds = None
                raise _from_kvmove(e, "register_memory") from e
            except nixlError:
                for a in done:
                    self._regions.pop(a).unregister()
                self._bounds = None
                raise
        return descs

    def deregister_memory(self, dereg_list, backends: Sequence[str] = ()) -> None:
        """Unregisters memory registered by ``register_memory`` (each
        descriptor's address must start a registered region); returns once
        no transfer can touch it."""
        descs = self._reg_descs(dereg_list, "DRAM" if not isinstance(dereg_list, _DList) else None)
        self._check_backends(backends)
        with self._lock:
            missing = [a for a, _, _ in descs if a not in self._regions]
            if missing:
                raise nixlNotFoundError(f"deregister_memory: {missing[0]:#x} is not a registered region's start")
            for a, _, _ in descs:
                self._bounds = None
                try:
                    self._regions.pop(a).unregister()
                except TransferError as e:
                    raise _from_kvmove(e, "deregister_memory") from e

    def _local_bounds(self) -> Tuple[bytes, bytes]:
        """Starts and ends of the registered regions, in order, packed
        (``_uncovered`` takes them); made again only after ``_regions``
        changed. Call with ``_lock`` held."""
        if self._bounds is None:
            order = sorted((r.addr, r.addr + r.length) for r in self._regions.values())
            self._bounds = (_packed(np.array([s for s, _ in order], dtype=np.uint64)),
                            _packed(np.array([e for _, e in order], dtype=np.uint64)))  # fmt: skip
        return self._bounds

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
                "conn": self._conn,
                "regions": sorted([r.addr, r.length] for r in self._regions.values()),
            }
        return _MD_MAGIC + json.dumps(md, separators=(",", ":")).encode()

    def add_remote_agent(self, metadata: bytes) -> bytes:
        """Loads a remote agent's metadata (from its ``get_agent_metadata``
        or ``get_partial_agent_metadata``); returns its name as ``bytes``,
        as NIXL does (every method taking an agent name takes ``str`` or
        ``bytes``). Metadata of a loaded agent adds the regions it lists,
        as NIXL's: the same agent's metadata again is fine, partial
        metadata without connection info needs the agent loaded
        (``nixlNotFoundError``), and metadata of another instance under a
        loaded name (a restarted peer) raises ``nixlNotAllowedError``
        (``remove_remote_agent`` it first, as NIXL wants); this agent's own
        raises ``nixlInvalidParamError``, and metadata that is not a kvmove
        agent's ``nixlMismatchError``, as NIXL's own for unreadable
        metadata."""
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise nixlInvalidParamError(f"metadata must be bytes, not {type(metadata).__name__}")
        return self._load_md(bytes(metadata)).encode()

    def _load_md(self, metadata: bytes) -> str:
        """``add_remote_agent`` (also what the listener loads); returns
        the agent's name."""
        if not metadata.startswith(_MD_MAGIC):
            raise nixlMismatchError("not kvmove NIXL agent metadata (both sides must run kvmove's nixl_agent)")
        try:
            md = json.loads(metadata[len(_MD_MAGIC) :])
            name = str(md["name"])
            regions = [(int(a), int(n)) for a, n in md["regions"]]
            if any(a < 0 or n < 0 or a + n >= 1 << 64 for a, n in regions):
                raise ValueError("a region outside the address space")
            # Connection info: in full metadata, and in partial metadata
            # made with it.
            conn = (str(md["session_id"]), str(md["backend"]), str(md.get("conn", ""))) if "session_id" in md else None
        except (ValueError, KeyError, TypeError) as e:
            raise nixlMismatchError(f"malformed agent metadata: {e}") from None
        if name == self.name:
            raise nixlInvalidParamError(f"metadata of agent {name!r} is this agent's own (no need to load it)")
        with self._lock:
            eng = self._need_engine()
            old = self._remotes.get(name)
            if conn is not None:
                sid, backend, token = conn
                if backend != eng.backend:
                    raise nixlMismatchError(
                        f"remote agent {name!r} runs kvmove over {backend}, this agent over {eng.backend}"
                    )
                if old is not None and (old.session_id, old.conn) != (sid, token):
                    raise nixlNotAllowedError(
                        f"agent {name!r} is loaded with other connection info (remove_remote_agent it first: a "
                        "restarted peer)"
                    )
            if old is not None:
                old.add(regions)
            elif conn is None:
                raise nixlNotFoundError(
                    f"partial metadata of agent {name!r} without its connection info, and that agent is not loaded "
                    "(send its metadata with inc_conn_info=True first)"
                )
            else:
                self._remotes[name] = _Remote(name, conn[0], regions, conn[1], conn[2])
        return name

    @_non_blocking
    def remove_remote_agent(self, agent: str) -> None:
        """Forgets a remote agent and closes the session to it; transfers
        to it can no longer be made. An unknown name is ignored."""
        agent = _agent_name(agent)
        with self._lock:
            old = self._remotes.pop(agent, None)
        if old is not None:
            old.courier.close()
            with self._lock:
                s, old.session = old.session, None
            if s is not None:
                _close_aside(s)

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
        d = self._xfer_descs(descs, "DRAM" if not isinstance(descs, _DList) else None)
        return _uncovered(*r.bounds, d) < 0

    def get_partial_agent_metadata(self, descs, inc_conn_info: bool = False, backends: Sequence[str] = ()) -> bytes:
        """Metadata of only the regions ``descs`` (a ``nixlRegDList``; each
        descriptor a region registered whole, else ``nixlNotFoundError``,
        as NIXL), with how to reach this agent if ``inc_conn_info`` or
        ``descs`` is empty. A peer that loads it can use only those regions
        of this agent; it needs the connection info once, first. An
        unknown backend name is a ``KeyError``, as NIXL's."""
        for b in backends:
            self.backends[b]  # noqa: B018 (KeyError, as NIXL's lookup)
        d = self._reg_descs(descs, "DRAM" if not isinstance(descs, _DList) else None)
        with self._lock:
            eng = self._need_engine()
            regions = []
            for addr, length, _ in d:
                r = self._regions.get(addr)
                if r is None or r.length != length:
                    raise nixlNotFoundError(
                        f"get_partial_agent_metadata: {addr:#x} ({length} bytes) is not a registered region (partial "
                        "metadata lists regions registered whole, as NIXL's)"
                    )
                regions.append([addr, length])
            md = {"name": self.name, "regions": sorted(regions)}
            if inc_conn_info or len(d) == 0:
                md.update(session_id=eng.session_id, backend=eng.backend, conn=self._conn)
        return _MD_MAGIC + json.dumps(md, separators=(",", ":")).encode()

    def listen_address(self) -> Optional[Tuple[str, int]]:
        """The ``(host, port)`` this agent's metadata listener is bound to
        (the port picked for ``listen_port=0``), or None without one.
        kvmove addition: NIXL does not report the port."""
        lst = self._listener
        return lst.address if lst is not None else None

    def _peer(self, call: str, ip_addr, port) -> Tuple[str, int]:
        """Where a metadata call goes: a peer's listener, by IP address.
        Without one NIXL uses its central metadata server (etcd), which
        kvmove does not have."""
        if not ip_addr:
            for var in ("NIXL_ETCD_ENDPOINTS", "NIXL_TCPSTORE_ENDPOINT"):
                if os.environ.get(var):
                    raise nixlNotSupportedError(
                        f"{call} without ip_addr uses NIXL's central metadata server ({var} is set): kvmove has none; "
                        "give the peer's ip_addr and port (its listener), or exchange get_agent_metadata() yourself"
                    )
            raise nixlInvalidParamError(
                f"{call}: no peer address given and no central metadata server (kvmove has none: give ip_addr and port)"
            )
        return str(ip_addr), int(port)

    def _md_submit(self, what: str, ip: str, port: int, kind: bytes, payload: bytes) -> None:
        """Sends one request to the listener at ``ip:port`` on this agent's
        metadata thread, after the ones before it, and returns at once, as
        NIXL's calls do: what fails there is logged on ``kvmove.nixl``. The
        answer to ``SEND`` is loaded (on an agent with a listener, as in
        NIXL, where the listen thread reads it)."""
        ref = weakref.ref(self)
        name = self.name

        def run():
            addr = _listen.peer_address(ip)
            if addr is None:
                logger.error("%s from agent %r: %r is not an IP address", what, name, ip)
                return
            try:
                kind_got, answer = _listen.exchange(addr, port, kind, payload, _listen.access()[0])
            except (OSError, ValueError, TransferError) as e:
                logger.error("%s from agent %r to %s:%d failed: %s", what, name, ip, port, e)
                return
            if kind_got == _listen.ERR:
                logger.error("%s from agent %r: the agent at %s:%d refused it: %s", what, name, ip, port,
                             answer.decode("utf-8", "replace"))  # fmt: skip
            elif kind_got == _listen.LOAD and kind == _listen.SEND:
                a = ref()
                if a is None or a._listener is None:
                    if a is not None:
                        logger.warning(
                            "fetch_remote_metadata from agent %r: the answer is not loaded without a listener "
                            "(nixl_agent_config(enable_listen_thread=True)), as in NIXL", name
                        )
                    return
                try:
                    got = a._load_md(answer)
                    logger.info("agent %r loaded metadata of agent %r fetched from %s:%d", name, got, ip, port)
                except nixlError as e:
                    logger.error("%s from agent %r: loading the answer from %s:%d failed: %s", what, name, ip, port, e)
            elif kind_got != _listen.OK:
                logger.error("%s from agent %r: the agent at %s:%d answered %r", what, name, ip, port, kind_got)

        with self._lock:
            if self._md_courier is None:
                self._md_courier = _Courier(f"{name}-metadata")
            courier = self._md_courier
        courier.submit(run)

    def send_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Sends this agent's metadata (as ``get_agent_metadata`` now) to
        the listener of the agent at ``ip_addr:port``, which loads it in
        the background; returns at once, as NIXL's (the peer polls
        ``check_remote_metadata``). Without ``ip_addr`` NIXL uses its
        central metadata server: ``nixlNotSupportedError`` when
        ``NIXL_ETCD_ENDPOINTS`` is set, else ``nixlInvalidParamError``."""
        ip, port = self._peer("send_local_metadata", ip_addr, port)
        self._md_submit("send_local_metadata", ip, port, _listen.LOAD, self.get_agent_metadata())

    def send_partial_agent_metadata(
        self,
        descs,
        inc_conn_info: bool = False,
        backends: Sequence[str] = (),
        ip_addr: str = "",
        port: int = DEFAULT_COMM_PORT,
        label: str = "",
    ) -> None:
        """``send_local_metadata`` of ``get_partial_agent_metadata(descs,
        inc_conn_info, backends)``; ``label`` names it on a central
        metadata server (none here: unused)."""
        md = self.get_partial_agent_metadata(descs, inc_conn_info, backends)
        ip, port = self._peer("send_partial_agent_metadata", ip_addr, port)
        self._md_submit("send_partial_agent_metadata", ip, port, _listen.LOAD, md)

    def fetch_remote_metadata(
        self, remote_agent: str, ip_addr: str = "", port: int = DEFAULT_COMM_PORT, label: str = ""
    ) -> None:
        """Asks the listener at ``ip_addr:port`` for its agent's metadata
        and loads the answer in the background; returns at once, as NIXL's
        (poll ``check_remote_metadata(remote_agent)``). As in NIXL the
        answer is loaded only by an agent with a listener, whatever agent
        answers; a peer that cannot be reached is logged and nothing is
        loaded."""
        ip, port = self._peer("fetch_remote_metadata", ip_addr, port)
        self._md_submit("fetch_remote_metadata", ip, port, _listen.SEND, _agent_name(remote_agent).encode())

    def invalidate_local_metadata(self, ip_addr: str = "", port: int = DEFAULT_COMM_PORT) -> None:
        """Tells the agent listening at ``ip_addr:port`` to forget this
        agent (its ``remove_remote_agent``), in order after this agent's
        earlier metadata calls to it; returns at once, as NIXL's."""
        ip, port = self._peer("invalidate_local_metadata", ip_addr, port)
        self._md_submit("invalidate_local_metadata", ip, port, _listen.INVL, self.name.encode())

    def _invalidated(self, name: str) -> None:
        """A peer's ``invalidate_local_metadata`` reached the listener."""
        if _agent_name(name) == self.name:
            raise nixlInvalidParamError("an agent cannot invalidate its own metadata")
        self.remove_remote_agent(name)
        logger.info("agent %r forgot agent %r, which invalidated its metadata", self.name, name)

    @_non_blocking
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
        # One look at the dict, whole under the GIL (writers hold _lock).
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

    # ---- transfers ----

    def prep_xfer_dlist(
        self, agent_name: str, xfer_list, mem_type: Optional[str] = None, backends: Sequence[str] = ()
    ) -> nixl_prepped_dlist_handle:
        """Prepares descriptors: local ones with ``"NIXL_INIT_AGENT"`` (or
        ``""``), else those of the remote agent ``agent_name`` (this agent's
        own name: loopback). Every descriptor must lie inside registered
        memory (the remote agent's, as its metadata says), else
        ``nixlNotFoundError``."""
        descs = self._xfer_descs(xfer_list, mem_type)
        self._check_backends(backends)
        agent_name = _agent_name(agent_name)
        if agent_name in (NIXL_INIT_AGENT, ""):
            with self._lock:
                starts, ends = self._local_bounds()
            side, owner = "local", None
        else:
            starts, ends = self._remote_bounds(agent_name)
            side, owner = "remote", agent_name
        bad = _uncovered(starts, ends, descs)
        if bad >= 0:
            raise _outside(side, descs, bad, agent_name)
        return nixl_prepped_dlist_handle(self, owner, descs)

    def _remote_bounds(self, agent_name: str) -> Tuple[bytes, bytes]:
        """The starts and ends (packed) of the memory a remote agent
        registered, as its metadata says (this agent's own: loopback)."""
        agent_name = _agent_name(agent_name)
        if agent_name == self.name and agent_name not in self._remotes:
            with self._lock:
                return self._local_bounds()
        return self._remote(agent_name).bounds

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
        ld, rd, remote = local_xfer_side.descs, remote_xfer_side.descs, remote_xfer_side.agent_name
        # Integer arrays (what vLLM's connector passes) and lists of ints go
        # to Rust as words, and Rust checks each index; anything else given
        # takes the checked path, which says what is wrong.
        li, ri = _index_words(local_indices), _index_words(remote_indices)
        if li is not None and ri is not None and len(li) == len(ri):
            return self._new_xfer(op, ld, li, rd, ri, remote, notif_msg, given=(local_indices, remote_indices))
        li = _indices(local_indices, len(ld), "local_indices")
        ri = _indices(remote_indices, len(rd), "remote_indices")
        if len(li) != len(ri):
            raise nixlInvalidParamError(f"{len(li)} local indices but {len(ri)} remote indices")
        return self._new_xfer(op, ld, li, rd, ri, remote, notif_msg)

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
        if type(local_descs) is nixlXferDList and type(remote_descs) is nixlXferDList and not backends:
            # The common call, two lists from get_xfer_descs to a known
            # remote agent: one call into Rust, which checks both lists
            # against the registrations as the path below does. Anything
            # else, or any check failing, takes that path, which says what
            # is wrong.
            name = remote_agent.decode("utf-8", "replace") if type(remote_agent) is bytes else remote_agent
            r, local_bounds = self._remotes.get(name), self._bounds  # one look each, under the GIL
            lrows, rrows = local_descs._raw, remote_descs._raw
            if r is not None and local_bounds is not None and lrows and len(lrows) == len(rrows):
                if operation == "WRITE" or operation == "READ":
                    ops = NixlOps.pairs(operation == "WRITE", lrows, rrows, None, None, *local_bounds, *r.bounds)[0]
                    if ops is not None:
                        return nixl_xfer_handle(self, operation, name, ops, _notif_bytes(notif_msg) if notif_msg else b"")
        op = _operation(operation)
        self._check_backends(backends)
        ld = self._xfer_descs(local_descs, "DRAM" if not isinstance(local_descs, _DList) else None)
        rd = self._xfer_descs(remote_descs, "DRAM" if not isinstance(remote_descs, _DList) else None)
        if len(ld) != len(rd):
            raise nixlInvalidParamError(f"{len(ld)} local descriptors but {len(rd)} remote descriptors")
        with self._lock:
            bounds = self._local_bounds()
        # Both lists are checked against the registrations in the same call
        # into Rust that pairs them.
        remote_agent = _agent_name(remote_agent)
        bounds += self._remote_bounds(remote_agent)
        return self._new_xfer(op, ld, None, rd, None, remote_agent, notif_msg, bounds)

    def _new_xfer(
        self, op, ld: _DList, li, rd: _DList, ri, remote: str, notif_msg, bounds=(), given=None
    ) -> nixl_xfer_handle:
        """A handle pairing local descriptor ``li[k]`` with remote descriptor
        ``ri[k]``, or without indices ``k`` with ``k``: the pairs go to Rust
        in one call, which with ``bounds`` (local starts and ends, remote
        starts and ends) first checks that every descriptor of each list
        lies in that side's memory. Indices are checked arrays, or words
        packed by ``_index_words`` from the arrays ``given`` (local,
        remote), which Rust checks; an index it refuses is named from
        them."""
        unchecked = isinstance(li, bytes)
        count = len(ld) if li is None else len(li) // 8 if unchecked else len(li)
        if count == 0:
            raise nixlInvalidParamError("a transfer needs at least one descriptor")
        idx = (None, None) if li is None else (_packed(li), _packed(ri))
        try:
            ops, bad, what = NixlOps.pairs(op == "WRITE", ld._packed_rows(), rd._packed_rows(), *idx, *bounds)
        except TransferError as e:
            raise _from_kvmove(e, "preparing the transfer") from e
        if what in ("local", "remote"):
            raise _outside(what, ld if what == "local" else rd, bad, _agent_name(remote))
        if what in ("local_index", "remote_index"):
            side = what[: -len("_index")]
            picked = given[0] if side == "local" else given[1]
            raise _index_outside(f"{side}_indices", int(picked[bad]), len(ld) if side == "local" else len(rd))
        if ops is None:
            if unchecked:
                li, ri = given
            (_, ll, _), (_, rl, _) = (ld[bad], rd[bad]) if li is None else (ld[int(li[bad])], rd[int(ri[bad])])
            raise nixlInvalidParamError(f"descriptor pair {bad}: local length {ll} != remote length {rl}")
        notif = _notif_bytes(notif_msg) if notif_msg else b""
        remote = _agent_name(remote)
        if remote not in self._remotes:
            self._target(remote)  # the remote agent must be known now (or be this one)
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
        # One look at the dict (whole under the GIL; writers hold _lock).
        r = self._remotes.get(handle.remote_agent)
        # A known remote agent's session id, else loopback's (or an unknown
        # agent: raises).
        target = r.session_id if r is not None else self._target(handle.remote_agent)
        self._need_engine()
        wire = _encode_notif(self.name, notif) if notif else None
        ops = handle._ops
        handle._native = None
        if r is None or (r.session is not None and r.courier.idle()):
            # Connected (or loopback): posting does not wait on the peer.
            self._post(handle, r, ops, target, wire)
            handle._active = True
            # A caller that polls this handle next, back to back, spins on
            # it (check_xfer_state's may_wait): its second poll may finish
            # it on this thread.
            self._last_polled = id(handle)
            # Failed already: raise as check_xfer_state does. Done already:
            # still "PROC" (check_xfer_state reports the end), so whether a
            # post is active never depends on how fast it was. (`refused`
            # starts no task: the caller's first poll finishes a post that
            # completed here, on its own thread.)
            if handle._native.refused():
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
        # A connected remote's session (one look; _session takes the lock
        # and connects when there is none).
        session = r.session if r is not None else self._loopback_session()
        if session is None:
            session = self._session(r)
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
        opens a fresh one (a restarted peer has new keys), and closes it
        aside (:func:`_close_aside`): this is called from
        ``check_xfer_state`` and ``transfer``, which vLLM calls on its
        engine thread and NIXL documents as non-blocking."""
        with self._lock:
            r.gone = True
            if r.session is not session:
                return
            r.session = None
        _close_aside(session)
        self._drop_waiting(r, "a transfer")

    def _drop_waiting(self, r: _Remote, finder: str) -> None:
        """``r`` was found gone: the work queued for it and not started
        (posts, notifications) fails now instead of waiting, each behind
        the last, for a peer that does not answer (the work running goes
        on; work queued later reconnects)."""
        n = r.courier.drop_waiting(
            nixlRemoteDisconnectError(f"agent {r.name!r} was found gone by {finder} before this was posted")
        )
        if n:
            logger.warning("%d operations queued for agent %r failed: %s found it gone", n, r.name, finder)

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
            spinning = same and time.monotonic() - handle._polled < self._spin_gap
            if not (j.done() or spinning and j.wait(self._spin_wait)):
                handle._polled = now = time.monotonic()
                # Queued too long behind work its peer does not answer: it
                # fails, unless it started meanwhile (its own deadlines end it).
                if now - j.since < _QUEUE_LIMIT or not j.withdraw(
                    nixlRemoteDisconnectError(
                        f"{handle.op} with agent {handle.remote_agent!r} waited {now - j.since:.0f} s, not "
                        "posted, behind earlier work for that agent, which it does not answer"
                    )
                ):
                    return "PROC"
            handle._pending = None
            if j.error is not None:
                handle._active = False
                raise j.error
        x = handle._native if j is None and type(handle) is nixl_xfer_handle else None
        if x is None:
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
        # The paths above wait 1 ms at most (a spinning caller's poll); this
        # one is timed (the hot ones are not wrapped in _non_blocking).
        start = time.monotonic()
        e = x.error()
        r, session = handle._session or (None, None)
        if r is not None and _peer_gone(e):
            self._forget_session(r, session)
        _held("check_xfer_state", start)
        raise _from_kvmove(e, f"{handle.op} with agent {handle.remote_agent!r} failed")

    def _posted(self, handle: nixl_xfer_handle):
        if not isinstance(handle, nixl_xfer_handle):
            raise nixlInvalidParamError("handle must come from make_prepped_xfer or initialize_xfer")
        if handle._native is None:
            raise nixlNotPostedError("the transfer was not posted (call transfer first)")
        return handle._native

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        """Times (microseconds) and sizes of the last post of ``handle``,
        and the backend it ran on. Only on an agent that captures
        telemetry (``capture_telemetry``, or ``NIXL_TELEMETRY_ENABLE``:
        see ``nixl._bindings.nixlAgent``), else ``nixlNoTelemetryError``,
        as NIXL's."""
        if not self._telemetry:
            raise nixlNoTelemetryError(
                "this agent captures no telemetry (nixl_agent_config(capture_telemetry=True), or "
                "NIXL_TELEMETRY_ENABLE=y, when it is made)"
            )
        start, post, xfer, total, count = self._posted(handle).telemetry()
        return nixlXferTelemetry(start, post, xfer, total, count, self.query_xfer_backend(handle))

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

    @_non_blocking
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

    @_non_blocking
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
            # The engine offers a notification to a busy peer again for
            # the policy's notify_patience; what it raises is final.
            try:
                eng.notify(target, wire)
            except TransferError as e:
                logger.warning("send_notif to agent %r was not delivered: %s", remote_agent_name, e)
                if r is not None and _peer_gone(e):
                    r.gone = True
                    self._drop_waiting(r, "a notification")

        if r is None:  # this agent itself
            deliver()
        else:
            r.courier.submit(deliver)

    # ---- lifetime ----

    def metrics(self) -> dict:
        """kvmove's metrics as a dict (not in NIXL's API):
        :func:`kvmove.metrics`, process-wide."""
        from .._metrics import metrics

        return metrics()

    def close(self) -> None:
        """Closes the agent's engine (ends transfers, unregisters memory).
        kvmove addition; also done when the agent is garbage collected."""
        with self._lock:
            eng, self._engine = self._engine, None
            self._self_session = None
            self._regions.clear()
            self._bounds = None
            remotes = list(self._remotes.values())
            self._remotes.clear()
            listener, self._listener = self._listener, None
            md_courier, self._md_courier = self._md_courier, None
        if listener is not None:
            listener.close()
        if md_courier is not None:
            md_courier.close()
            md_courier.join(_listen.CONNECT_TIMEOUT + 2 * _listen.IO_TIMEOUT)
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

"""The Pythonic API: Engine, Region, Session, Batch, LayerwiseTransfer;
notifications (Notification) and handoff sessions (ReceiveSession,
SendSession, SessionWrite, Grant)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

from ._metrics import serve_metrics_from_env
from ._native import NativeEngine, TransferError, make_error
from .devices import memory_of

#: One request: ``(local_addr, remote_addr, length)``.
Op = Tuple[int, int, int]


@dataclass(frozen=True)
class RequestResult:
    """The final state of one request of a batch."""

    state: str  #: "completed", "failed", "timed_out" or "cancelled"
    error: Optional[TransferError] = None

    @property
    def ok(self) -> bool:
        return self.state == "completed"


_COMPLETED = RequestResult("completed")


class Outcome:
    """The final report of a batch. ``ok`` (all completed?) and ``failed``
    (which did not?) are answered without a Python object per request;
    ``requests`` makes them on first use."""

    __slots__ = ("state", "attempts", "_count", "_not_done", "_requests")

    def __init__(self, state: str, attempts: int, requests: Sequence[RequestResult]):
        self.state = state  #: "completed", "failed", "timed_out" or "cancelled"
        self.attempts = attempts  #: backend submissions (1 when nothing was retried)
        self._requests: Optional[List[RequestResult]] = list(requests)
        self._count = len(self._requests)
        self._not_done = [(i, r.state, r.error) for i, r in enumerate(self._requests) if not r.ok]

    @classmethod
    def _from_native(cls, t) -> "Outcome":
        o = cls.__new__(cls)
        o.state, o.attempts, o._count, o._not_done = t
        o._requests = None
        return o

    @property
    def requests(self) -> List[RequestResult]:
        """One :class:`RequestResult` per submitted request, in order."""
        if self._requests is None:
            reqs = [_COMPLETED] * self._count
            for i, state, err in self._not_done:
                reqs[i] = RequestResult(state, err)
            self._requests = reqs
        return self._requests

    @property
    def failed(self) -> List[int]:
        """Indices of the requests that did not complete (failed, timed
        out or cancelled), in submission order; empty when ``ok``."""
        return [i for i, _, _ in self._not_done]

    def __len__(self) -> int:
        return self._count

    def __eq__(self, other) -> bool:
        if not isinstance(other, Outcome):
            return NotImplemented
        return (self.state, self.attempts, self.requests) == (other.state, other.attempts, other.requests)

    def __repr__(self) -> str:
        return f"Outcome(state={self.state!r}, attempts={self.attempts}, requests={self._count}, failed={self.failed})"

    @property
    def ok(self) -> bool:
        return self.state == "completed"

    @property
    def error(self) -> Optional[TransferError]:
        """The first request error, if any request failed."""
        for _, _, err in self._not_done:
            if err is not None:
                return err
        return None

    def raise_for_status(self) -> "Outcome":
        """Returns self when every request completed; raises otherwise."""
        if self.ok:
            return self
        err = self.error
        if err is not None:
            raise err
        # Built in Rust, as the engine's own errors are: the class,
        # `.is_transient` and `.is_peer_failure` follow the kind.
        if self.state == "timed_out":
            raise make_error("timeout", f"transfer deadline passed after {self.attempts} attempt(s)")
        raise make_error("cancelled", f"transfer {self.state}")


class Region:
    """Registered memory. Unregistered by :meth:`unregister`, on leaving a
    ``with`` block, or when its engine closes."""

    def __init__(self, engine: "Engine", addr: int, length: int, obj: Any = None, kind: str = "host"):
        self._engine = engine
        self.addr = addr
        self.length = length
        #: Where the bytes live: ``"host"`` or ``"device:N"``.
        self.kind = kind
        self._obj = obj
        self._live = True

    def __repr__(self) -> str:
        return f"Region(addr={self.addr:#x}, length={self.length}, kind={self.kind!r}, live={self._live})"

    def __len__(self) -> int:
        return self.length

    def at(self, offset: int) -> int:
        """The address of byte ``offset`` (checked against the length)."""
        if not 0 <= offset < self.length:
            raise IndexError(f"offset {offset} outside a region of {self.length} bytes")
        return self.addr + offset

    def unregister(self) -> None:
        """Unregisters; returns once no transfer can touch the memory."""
        if self._live:
            self._live = False
            self._engine._native.unregister(self.addr)
            self._engine._regions.discard(self)
            self._obj = None

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc) -> bool:
        self.unregister()
        return False


class _Running:
    """A transfer running in the background (a :class:`Batch`, a
    :class:`SessionWrite`): ``done``, ``poll`` and ``wait`` over its native
    handle, the outcome cached once known."""

    def __init__(self, native):
        self._n = native
        self._outcome: Optional[Outcome] = None

    @property
    def done(self) -> bool:
        return self._outcome is not None or self._n.done

    def poll(self) -> Optional[Outcome]:
        """The outcome if finished, else None. Never blocks."""
        if self._outcome is None:
            t = self._n.poll()
            if t is not None:
                self._outcome = Outcome._from_native(t)
        return self._outcome

    def _refused(self, e: TransferError) -> Optional[Outcome]:
        """The outcome of a transfer refused as it was to start (``wait``
        without ``check``), or None to raise ``e``."""
        return None

    def wait(self, timeout: Optional[float] = None, check: bool = True) -> Optional[Outcome]:
        """Waits (GIL released) for the outcome; None if ``timeout`` seconds
        passed first. With ``check`` (default), a transfer that did not
        complete raises its error."""
        if self._outcome is None:
            try:
                t = self._n.wait(timeout)
            except TransferError as e:
                refused = None if check else self._refused(e)
                if refused is None:
                    raise
                self._outcome = refused
                return refused
            if t is None:
                return None
            self._outcome = Outcome._from_native(t)
        return self._outcome.raise_for_status() if check else self._outcome


class Batch(_Running):
    """A submitted batch of requests."""

    def cancel(self) -> Outcome:
        """Cancels what has not completed; returns once the batch is quiet
        (its buffers may be reused at once)."""
        if self._outcome is None:
            self._outcome = Outcome._from_native(self._n.cancel())
        return self._outcome

    def __enter__(self) -> "Batch":
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        # Leaving the block early (an exception) must not leave transfers
        # writing into memory the caller is about to reuse.
        if self._outcome is None:
            if exc_type is None:
                self.wait(check=False)
            else:
                self.cancel()
        return False


class LayerwiseTransfer:
    """Layer-by-layer transfer: submit each layer's pages as soon as the
    layer is computed, then wait for all of them (overlapping transfer with
    compute)."""

    def __init__(self, session: "Session", write: bool = True):
        self._session = session
        self._write = write
        self.layers: List[Batch] = []

    def submit_layer(self, ops: Iterable[Op]) -> Batch:
        """Submits one layer's ``(local_addr, remote_addr, length)`` requests."""
        b = self._session.submit(ops, write=self._write)
        self.layers.append(b)
        return b

    def wait(self, timeout: Optional[float] = None, check: bool = True) -> List[Outcome]:
        """Waits for every layer submitted so far; raises the first error
        (after all layers are finished) when ``check``."""
        outs = []
        for b in self.layers:
            o = b.wait(timeout, check=False)
            if o is None:
                raise TimeoutError("layer transfer still running after timeout")
            outs.append(o)
        if check:
            for o in outs:
                o.raise_for_status()
        return outs

    def cancel(self) -> List[Outcome]:
        return [b.cancel() for b in self.layers]

    def __enter__(self) -> "LayerwiseTransfer":
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        if exc_type is None:
            self.wait(check=False)
        else:
            self.cancel()
        return False


class Session:
    """An open connection to one peer's registered memory. Closing it (or
    leaving the ``with`` block) ends its transfers and releases its
    endpoints."""

    def __init__(self, engine: "Engine", peer: str):
        self._engine = engine
        self.peer = peer
        self._seg = engine._native.open_segment(peer)
        self._open = True

    def __repr__(self) -> str:
        return f"Session(peer={self.peer!r}, open={self._open})"

    def _call(self, fn, write: bool, ops: Iterable[Op]):
        """``fn(segment, write, ops)`` with the caller's tuples read in Rust
        as they are (no Python object per request here); requests that are
        not tuples (lists, numpy rows) are made tuples of ints first."""
        ops = ops if isinstance(ops, (list, tuple)) else list(ops)
        try:
            return fn(self._seg, write, ops)
        except TypeError as e:
            try:
                rows = [(int(l), int(r), int(n)) for (l, r, n) in ops]
            except (TypeError, ValueError):
                raise e from None
            return fn(self._seg, write, rows)

    def submit(self, ops: Iterable[Op], write: bool = True) -> Batch:
        """Starts a batch of writes (or reads with ``write=False``); each
        request is ``(local_addr, remote_addr, length)``. Waits for room when
        the in-flight budget is full."""
        return Batch(self._call(self._engine._native.submit_pairs, bool(write), ops))

    def write(self, local_addr: int, remote_addr: int, length: int) -> Outcome:
        """Writes one range and waits; raises on failure."""
        return self.write_many([(local_addr, remote_addr, length)])

    def read(self, local_addr: int, remote_addr: int, length: int) -> Outcome:
        """Reads one range and waits; raises on failure."""
        return self.read_many([(local_addr, remote_addr, length)])

    def write_many(self, ops: Iterable[Op]) -> Outcome:
        t = self._call(self._engine._native.transfer_pairs, True, ops)
        return Outcome._from_native(t).raise_for_status()

    def read_many(self, ops: Iterable[Op]) -> Outcome:
        t = self._call(self._engine._native.transfer_pairs, False, ops)
        return Outcome._from_native(t).raise_for_status()

    def layerwise(self, write: bool = True) -> LayerwiseTransfer:
        """A :class:`LayerwiseTransfer` on this session."""
        return LayerwiseTransfer(self, write)

    def close(self) -> None:
        if self._open:
            self._open = False
            self._engine._sessions.discard(self)
            self._engine._native.close_segment(self._seg)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False


@dataclass(frozen=True)
class Notification:
    """A notification received from a peer."""

    peer: str  #: the sender's session id (what :meth:`Engine.notify` answers to)
    msg: bytes


@dataclass(frozen=True)
class Grant:
    """What a receiver allows a sender: where it may write, how much, by when."""

    ranges: List[Tuple[int, int]]  #: ``(remote_addr, length)`` in the receiver's memory
    expected: int  #: bytes the sender must have written when it finishes
    deadline: float  #: seconds from the grant to the end of the session

    @classmethod
    def _from_native(cls, t) -> "Grant":
        ranges, expected, deadline = t
        return cls([(int(a), int(n)) for a, n in ranges], int(expected), float(deadline))


#: States of a handoff session. Final: landed, failed, cancelled, expired.
SESSION_STATES = ("waiting", "granted", "transferring", "landed", "failed", "cancelled", "expired")
FINAL_STATES = frozenset(("landed", "failed", "cancelled", "expired"))


class SessionWrite(_Running):
    """One write of a :class:`SendSession` (e.g. one layer), running in the
    background. Without ``check``, ``wait`` gives an outcome for a write
    refused as it was to start (the session had ended): every request
    ``"cancelled"`` or ``"failed"``, no attempt made."""

    def __init__(self, native_write, requests: int):
        super().__init__(native_write)
        self._requests = requests

    def _refused(self, e: TransferError) -> Optional[Outcome]:
        # Nothing moved: the session ended before the write could start.
        state = "cancelled" if getattr(e, "kind", None) == "cancelled" else "failed"
        return Outcome(state, 0, [RequestResult(state, e)] * self._requests)


class _Handoff:
    """One side of a handoff session (rules 12, 13 of the contract): the
    receiver (decode) grants memory, the sender (prefill) writes into it
    and finishes, and the receiver alone decides the outcome, which both
    sides then report."""

    def __init__(self, native):
        self._h = native
        self._error: Optional[TransferError] = None

    @property
    def peer(self) -> str:
        """The other side's session id."""
        return self._h.peer

    @property
    def id(self) -> int:
        """The session id both sides use (e.g. the request's bootstrap room)."""
        return self._h.id

    @property
    def role(self) -> str:
        """``"sender"`` or ``"receiver"``."""
        return self._h.role

    def _seen(self, t) -> str:
        state, err = t
        if err is not None:
            self._error = err
        return state

    def poll(self) -> str:
        """The state now (``"waiting"``, ``"granted"``, ``"transferring"``,
        ``"landed"``, ``"failed"``, ``"cancelled"``, ``"expired"``, or
        ``"released"`` once forgotten). Never blocks."""
        return self._seen(self._h.state())

    @property
    def state(self) -> str:
        """Same as :meth:`poll`."""
        return self.poll()

    @property
    def done(self) -> bool:
        """Whether the session reached a final state."""
        return self.poll() in FINAL_STATES

    @property
    def error(self) -> Optional[TransferError]:
        """Why the session did not land (failed, expired or cancelled)."""
        self.poll()
        return self._error

    def wait(self, timeout: Optional[float] = None) -> Optional[str]:
        """Waits (GIL released) for the final state and returns it; None if
        ``timeout`` seconds passed first."""
        t = self._h.wait(timeout)
        return None if t is None else self._seen(t)

    def cancel(self) -> str:
        """Cancels the session and waits for the final state both sides
        agree on: ``"cancelled"``, or the outcome the receiver had already
        decided. The sender's writes in flight are stopped first."""
        return self._seen(self._h.cancel())

    def release(self) -> None:
        """Forgets a final session (otherwise forgotten after a minute)."""
        self._h.release()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> bool:
        # Leaving early (an exception) must not leave a session open.
        if exc_type is not None and not self.done:
            try:
                self.cancel()
            except TransferError:
                pass
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(peer={self.peer!r}, id={self.id}, state={self.poll()!r})"


class ReceiveSession(_Handoff):
    """The receiving side (decode): made by :meth:`Engine.receive`, which
    granted the sender its ranges. Wait for ``"landed"``; the bytes are in
    place once it is."""

    @property
    def grant(self) -> Grant:
        return Grant._from_native(self._h.grant())


class SendSession(_Handoff):
    """The sending side (prefill): made by :meth:`Engine.send`. Wait for the
    grant, write (each range checked against it), then :meth:`finish`."""

    @property
    def grant(self) -> Optional[Grant]:
        """The grant if it came; never blocks."""
        t = self._h.grant()
        return None if t is None else Grant._from_native(t)

    def wait_grant(self, timeout: Optional[float] = None) -> Optional[Grant]:
        """Waits for the receiver's grant; None if ``timeout`` seconds passed
        first. Raises the session's error if it ended before a grant."""
        t = self._h.wait_grant(timeout)
        return None if t is None else Grant._from_native(t)

    def write_layer(self, ops: Iterable[Op]) -> SessionWrite:
        """Starts writing ``(local_addr, remote_addr, length)`` requests (one
        layer, say) and returns at once; several may be in flight. Raises
        before a byte moves if there is no grant yet, a range falls outside
        the grant (``kind == "out_of_bounds"``) or a local address is not
        registered."""
        ops = [(int(l), int(r), int(n)) for (l, r, n) in ops]
        return SessionWrite(self._h.write(ops), len(ops))

    def write(self, ops: Iterable[Op]) -> Outcome:
        """Writes and waits; raises if the write did not complete (the
        session then fails on both sides)."""
        return self.write_layer(ops).wait()

    def finish(self) -> None:
        """Every write completed: the receiver decides the outcome
        (``"landed"`` when the bytes match what it expects); :meth:`wait`
        for it."""
        self._h.finish()


class Engine:
    """A transfer engine.

    ``protocol`` is ``"tcp"`` or ``"rdma"`` (default: the backend
    ``config`` names, else ``"tcp"``); it listens on
    ``host:port`` (default ``127.0.0.1``, port 0 picks a free one) and peers
    reach it by :attr:`session_id`. ``policy`` is a dict with the keys of
    the Rust ``PolicyConfig``, e.g. ``{"retry": {"max_attempts": 2},
    "breaker": {"cooldown_ms": 100}}``. ``config`` is a kvmove TOML config
    (text, or a ``pathlib.Path`` to a file) with the backend's options and
    the policy; the other arguments override it where given.
    """

    def __init__(
        self,
        protocol: Optional[str] = None,
        host: Optional[str] = None,
        port: Optional[int] = None,
        device: Optional[str] = None,
        policy: Optional[dict] = None,
        config: Union[str, "os.PathLike[str]", None] = None,
    ):
        if config is not None and not isinstance(config, str):
            with open(config, encoding="utf-8") as f:
                config = f.read()
        self._start(NativeEngine(protocol, host, port, device, json.dumps(policy) if policy else None, config))

    @classmethod
    def from_env(
        cls,
        protocol: Optional[str] = None,
        host: Optional[str] = None,
        port: Optional[int] = None,
        device: Optional[str] = None,
    ) -> "Engine":
        """An engine configured by the environment, as kvmove's connectors
        and API surfaces start theirs: the TOML file ``KVMOVE_CONFIG``
        names, the policy in ``KVMOVE_POLICY`` (JSON) in place of the
        file's, and ``KVMOVE_PROTOCOL`` when ``protocol`` is not given; the
        arguments override the file as in the constructor. Without
        ``KVMOVE_CONFIG`` and ``host`` the engine listens on 127.0.0.1."""
        e = cls.__new__(cls)
        e._start(NativeEngine.from_env(protocol, host, port, device))
        return e

    def _start(self, native) -> None:
        self._native = native
        serve_metrics_from_env()
        self._regions: set = set()
        self._sessions: set = set()

    @property
    def session_id(self) -> str:
        """``host:port`` that peers pass to :meth:`connect`."""
        return self._native.session_id

    @property
    def backend(self) -> str:
        return self._native.backend

    @property
    def device_memory(self) -> bool:
        """Whether this engine registers and moves device (GPU) memory,
        reachable by peers (TCP and RDMA do, through the device's
        provider: RDMA with GPUDirect where the NIC reaches it, else staged
        through host buffers)."""
        return self._native.device_memory

    def register(self, obj: Any) -> Region:
        """Registers the memory of ``obj`` for transfers and remote
        read/write: a writable, C-contiguous Python buffer (``bytearray``,
        ``memoryview``, numpy array), or an object exposing
        ``__cuda_array_interface__`` or DLPack (a torch tensor on the GPU or
        the CPU). Device memory is moved through its provider (see
        :mod:`kvmove.devices`); a tensor whose device has no provider here
        is refused (``kind == "unsupported"``). The region holds ``obj``
        until it is unregistered, and a buffer's export too, so the memory
        can neither be freed nor resized meanwhile. Synchronize the
        producer's stream before transferring what it wrote."""
        try:
            found = memory_of(obj)
        except ValueError as e:
            raise TypeError(f"cannot register {type(obj).__name__}: {e}") from None
        if found is None:
            addr, length = self._native.register_buffer(obj)
            kind = "host"
        else:
            addr, length, want = found
            kind = self._native.register_address(addr, length, want)
        r = Region(self, addr, length, obj, kind)
        self._regions.add(r)
        return r

    def register_address(self, addr: int, length: int, kind: str = "auto") -> Region:
        """Registers raw memory by address, e.g. ``tensor.data_ptr()`` and
        ``tensor.numel() * tensor.element_size()``. ``kind`` is ``"auto"``
        (found from the pointer, as Mooncake does), ``"host"``,
        ``"device"`` or ``"device:N"``. Device memory of an installed
        provider (:func:`kvmove.devices.device_providers`) is moved through
        it; other memory must be host memory whose first and last byte this
        process can read, or ``kvmove.PermanentError`` is raised with
        ``kind == "unsupported"`` (a CUDA tensor's memory in a build or on a
        machine without CUDA, an unmapped page).

        Safety contract (the engine cannot check it): ``addr .. addr +
        length`` must stay allocated, writable memory of this process (or
        of its device) until the region is unregistered
        (``Region.unregister``, leaving its ``with`` block, or
        :meth:`close`) — keep the tensor alive. Bytes of a range being
        transferred are unspecified until its batch finishes, as with DMA.
        """
        got = self._native.register_address(int(addr), int(length), kind)
        r = Region(self, int(addr), int(length), None, got)
        self._regions.add(r)
        return r

    def connect(self, peer: str) -> Session:
        """Opens a session to the peer ``host:port`` (its ``session_id``)."""
        s = Session(self, peer)
        self._sessions.add(s)
        return s

    def write_local(self, addr: int, data: bytes) -> None:
        """Copies bytes into registered local memory (checked)."""
        self._native.write_local(addr, data)

    def read_local(self, addr: int, length: int) -> bytes:
        """Copies bytes out of registered local memory (checked)."""
        return bytes(self._native.read_local(addr, length))

    # ---- notifications (rule 11) ----

    def notify(self, peer: str, msg: bytes) -> None:
        """Sends ``msg`` (at most 4096 bytes) to the engine ``peer``; returns
        once it is in the peer's inbox. Per pair of engines, notifications
        arrive in the order they were sent. A full inbox is offered the
        message again for the policy's ``notify_patience`` (5 s by default);
        past it a transient ``backpressure`` error is raised (nothing was
        queued: retry later)."""
        self._native.notify(peer, bytes(msg))

    def notifications(self, max: int = 1024) -> List[Notification]:
        """Takes up to ``max`` received notifications, oldest first. Never
        blocks."""
        return [Notification(p, bytes(m)) for p, m in self._native.notifications(int(max))]

    def wait_notification(self, timeout: Optional[float] = None) -> bool:
        """Waits (GIL released) until a notification is queued; False if
        ``timeout`` seconds passed first."""
        return self._native.wait_notification(timeout)

    # ---- handoff sessions (rules 12, 13) ----

    def receive(
        self,
        peer: str,
        id: int,
        ranges: Iterable[Tuple[int, int]],
        expected: Optional[int] = None,
        deadline: float = 30.0,
    ) -> ReceiveSession:
        """Receiver (decode): grants the engine ``peer`` (the sender's
        session id) the right to write ``ranges`` (``(addr, length)`` in this
        engine's registered memory) for session ``id``. ``expected`` bytes
        (default: all of the ranges) must be written and finished within
        ``deadline`` seconds from now, else the session expires."""
        ranges = [(int(a), int(n)) for a, n in ranges]
        if expected is None:
            expected = sum(n for _, n in ranges)
        return ReceiveSession(self._native.receive(peer, int(id), ranges, int(expected), float(deadline)))

    def send(self, peer: str, id: int) -> SendSession:
        """Sender (prefill): expects a grant from the engine ``peer`` (the
        receiver's session id) for session ``id``."""
        return SendSession(self._native.send(peer, int(id)))

    def grants(self) -> List[Tuple[str, int, Grant]]:
        """Sender: grants received and not yet written to, oldest first, as
        ``(peer, id, grant)``."""
        return [(p, i, Grant._from_native(g)) for p, i, g in self._native.grants()]

    def grant_keys(self) -> List[Tuple[str, int]]:
        """Sender: the same grants as :meth:`grants`, as ``(peer, id)``
        only (cheap to poll often: no ranges copied)."""
        return [(p, int(i)) for p, i in self._native.grant_keys()]

    def stats(self) -> dict:
        """Live resources: endpoints, segments, regions, batches, ..."""
        return self._native.stats()

    def metrics(self) -> dict:
        """The engine's metrics as a dict: :func:`kvmove.metrics` (the
        values are process-wide, all engines together)."""
        from ._metrics import metrics

        return metrics()

    def close(self) -> None:
        """Ends all transfers, closes sessions, unregisters all memory and
        stops the backend (idempotent)."""
        for s in list(self._sessions):
            try:
                s.close()
            except TransferError:
                pass
        self._native.close()
        for r in list(self._regions):
            r._live = False
            r._obj = None
        self._regions.clear()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return f"Engine(session_id={self.session_id!r}, backend={self.backend!r})"

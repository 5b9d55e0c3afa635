"""The handles the agent gives out (prepared lists, transfers, their
telemetry) and what it keeps per remote agent: the courier thread that
does the work that may wait on it, and its regions."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

import numpy as np

from .._native import NixlOps, nixl_uncovered
from ._base import _held, nixlBackendError
from ._descs import _DList, nixlXferDList


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
    ``totalBytes``, ``descCount``, and ``backendName`` (the backend it ran
    on, as NIXL's newer than 1.5.1 give it)."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount", "backendName")

    def __init__(self, startTime=0, postDuration=0, xferDuration=0, totalBytes=0, descCount=0, backendName=""):
        self.startTime = startTime
        self.postDuration = postDuration
        self.xferDuration = xferDuration
        self.totalBytes = totalBytes
        self.descCount = descCount
        self.backendName = backendName

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount}, "
            f"backendName={self.backendName!r})"
        )


class nixl_xfer_handle:
    """A transfer request (``make_prepped_xfer`` / ``initialize_xfer``),
    posted by ``transfer``. Releasing one still running cancels it."""

    # One is made per request: slots make that, and every look at one on
    # the transfer's path, cheaper.
    __slots__ = (
        "_agent", "op", "remote_agent", "_ops", "_notif", "_native", "_session", "_pending", "_polled",
        "_released", "_active",
    )  # fmt: skip

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
            # Waits until the transfer is quiet: timed, as the calls NIXL
            # makes non-blocking are (_non_blocking).
            start = time.monotonic()
            x.cancel()
            _held("release_xfer_handle", start)

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


# ---- what the agent keeps per remote agent ----


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
        j = _Job(job, self)
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
        # Read without the lock (one look at a list the GIL keeps whole):
        # a job appended just after this look could be appended just after
        # a locked one as well, so the lock would promise nothing more, and
        # this is on every transfer's path.
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
        self.drop_waiting(nixlBackendError(f"agent {self._name!r} was removed or the agent closed before this ran"))

    def join(self, timeout: float) -> None:
        """After ``close``: waits up to ``timeout`` seconds for the job
        running, if any, and the thread to end."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def drop_waiting(self, error: BaseException) -> int:
        """Ends every job that has not started with ``error`` (the one
        running, if any, goes on); returns how many."""
        with self._cv:
            dropped, self._jobs = self._jobs[1:], self._jobs[:1]
            self._cv.notify()
        for j in dropped:
            j.drop(error)
        return len(dropped)

    def _withdraw(self, job: "_Job", error: BaseException) -> bool:
        with self._cv:
            # The first job is running, or about to.
            if job not in self._jobs[1:]:
                return False
            self._jobs.remove(job)
        job.drop(error)
        return True


class _Job:
    """One job of a :class:`_Courier`: done, or failed with an error."""

    def __init__(self, fn, courier: _Courier):
        self._fn = fn
        self._courier = courier
        #: When it was queued (``time.monotonic()``).
        self.since = time.monotonic()
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

    def withdraw(self, error: BaseException) -> bool:
        """Takes the job out of its courier's queue, ending it with
        ``error``, if it has not started (True); False once it runs or
        ran."""
        return self._courier._withdraw(self, error)

    def drop(self, error: BaseException) -> None:
        self.error = error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)


class _Remote:
    """What an agent knows of a remote agent: how to reach it, the memory
    it registered (as far as its metadata said, partial metadata adding
    to it), the session opened to it (on first use), and the courier that
    does the work that may wait on it."""

    def __init__(self, name: str, session_id: str, regions: List[Tuple[int, int]], backend: str, conn: str):
        self.name = name
        self.session_id = session_id
        self.backend = backend
        #: The remote agent's instance (a token its metadata carries): the
        #: same name and session id with another is a restarted agent.
        self.conn = conn
        #: The last work with it found it gone (NIXL's disconnected peer):
        #: ``send_notif`` raises until a transfer reconnects.
        self.gone = False
        self._regions: Dict[int, int] = {}
        #: The starts and ends of its regions, sorted and packed, as one
        #: tuple (``_uncovered`` and ``NixlOps.pairs`` take them): replaced
        #: whole when metadata adds regions, so a reader never pairs the
        #: starts of one with the ends of another.
        self.bounds: Tuple[bytes, bytes] = (b"", b"")
        self.add(regions)
        self.session = None
        self.courier = _Courier(name)

    def add(self, regions: List[Tuple[int, int]]) -> None:
        """Adds regions ``(addr, length)`` (a region at a known address
        replaces the one there). Call with the agent's lock held."""
        merged = dict(self._regions)
        merged.update(regions)
        order = sorted(merged.items())
        # Packed once (``_uncovered`` takes them as they are).
        self.bounds = (_packed(np.array([a for a, _ in order], dtype=np.uint64)),
                       _packed(np.array([a + n for a, n in order], dtype=np.uint64)))  # fmt: skip
        self._regions = merged


def _uncovered(starts, ends, descs) -> int:
    """Index of the first descriptor of ``descs`` (a descriptor list or an
    ``N x 3`` uint64 array) not inside one region, or -1; one call into
    Rust, whatever the count. Starts and ends are arrays or packed."""
    rows = descs._packed_rows() if isinstance(descs, _DList) else descs
    return nixl_uncovered(_packed(starts), _packed(ends), _packed(rows))


def _packed(a) -> bytes:
    """``a`` as native-endian ``u64``s (bytes are taken as packed)."""
    if isinstance(a, bytes):
        return a
    return np.ascontiguousarray(a, dtype=np.uint64).tobytes()


_BACKENDS = ("UCX", "KVMOVE", "TCP", "RDMA")

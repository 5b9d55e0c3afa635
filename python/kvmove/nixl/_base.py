"""The NIXL surface's shared pieces: its logger, constants and the enums
of NIXL's bindings, the exception classes those bindings raise, and how a
kvmove error maps onto them."""

from __future__ import annotations

import enum
import functools
import logging
import time
from typing import Optional

from .._native import TransferError


logger = logging.getLogger("kvmove.nixl")

#: NIXL's default port for an agent's metadata listener.
DEFAULT_COMM_PORT = 8888

#: The name that marks a local descriptor list in ``prep_xfer_dlist``.
NIXL_INIT_AGENT = "NIXL_INIT_AGENT"


class nixl_mem_t(enum.IntEnum):
    """The memory types of NIXL's bindings (``nixl._bindings.DRAM_SEG``,
    ...), with NIXL's values: what ``nixlXferDList`` and ``nixlRegDList``
    are made with. kvmove moves ``DRAM_SEG`` and ``VRAM_SEG``."""

    DRAM_SEG = 0
    VRAM_SEG = 1
    BLK_SEG = 2
    OBJ_SEG = 3
    FILE_SEG = 4


#: The thread synchronization modes of NIXL's bindings
#: (``nixl._bindings.nixl_thread_sync_t``), with NIXL's values: the default
#: is the same mode as none. ``nixl_thread_sync_t`` of ``nixl._api`` has
#: these as its values.
_bind_sync_t = enum.IntEnum(
    "nixl_thread_sync_t",
    [("NIXL_THREAD_SYNC_NONE", 0), ("NIXL_THREAD_SYNC_STRICT", 1), ("NIXL_THREAD_SYNC_RW", 2),
     ("NIXL_THREAD_SYNC_DEFAULT", 0)],
    module=__name__,
)  # fmt: skip


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


# The longest a transfer waits, not started, behind earlier work for its
# peer (a notification to a frozen peer holds the courier until the
# engine's answer timeout, 30 s): then it fails, as a transfer whose peer
# does not answer its notification does.
_QUEUE_LIMIT = 30.0
# A call NIXL makes non-blocking that took longer than this (seconds) held
# its caller (vLLM makes these calls on its engine thread): logged, so a
# hold shows in the serving engine's log (the vLLM check looks for it).
_HOLD_WARN = 1.0


def _held(name: str, start: float) -> None:
    """Logs a call ``name`` that began at ``start`` (``time.monotonic()``)
    if it has taken longer than ``_HOLD_WARN``."""
    took = time.monotonic() - start
    if took > _HOLD_WARN:
        logger.warning("%s held its caller %.2f s (NIXL makes it non-blocking)", name, took)


def _non_blocking(fn):
    """Wraps an agent method NIXL documents as non-blocking, one not on a
    single transfer's path (the wrapper costs 0.2 us a call): a call that
    takes longer than ``_HOLD_WARN`` is logged with its duration."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args, **kw):
        start = time.monotonic()
        try:
            return fn(*args, **kw)
        finally:
            _held(name, start)

    return call


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

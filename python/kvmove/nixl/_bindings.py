"""What kvmove offers of NIXL's compiled ``nixl._bindings``: its enums,
descriptor lists, telemetry record and exception classes, and a light
``nixlAgent`` / ``nixlAgentConfig`` (NIXL's C++ agent itself is not
provided: transfers run on the ``nixl_agent``'s kvmove engine).

The stand-in package's ``nixl._bindings`` is this module. ``nixl_agent``
makes its ``nixlAgentConfig`` and calls ``nixlAgent`` through it when an
agent is made, as NIXL's ``_api`` does, so a program (or NIXL's own tests)
that replaces ``nixlAgent`` here sees what the agent asks for."""

from __future__ import annotations

import os

from ._base import (
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    _bind_sync_t as nixl_thread_sync_t,
    nixl_mem_t,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
)
from ._descs import nixlRegDList, nixlXferDList
from ._handles import nixlXferTelemetry

DRAM_SEG = nixl_mem_t.DRAM_SEG
VRAM_SEG = nixl_mem_t.VRAM_SEG
BLK_SEG = nixl_mem_t.BLK_SEG
OBJ_SEG = nixl_mem_t.OBJ_SEG
FILE_SEG = nixl_mem_t.FILE_SEG

NIXL_THREAD_SYNC_NONE = nixl_thread_sync_t.NIXL_THREAD_SYNC_NONE
NIXL_THREAD_SYNC_STRICT = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
NIXL_THREAD_SYNC_RW = nixl_thread_sync_t.NIXL_THREAD_SYNC_RW
NIXL_THREAD_SYNC_DEFAULT = nixl_thread_sync_t.NIXL_THREAD_SYNC_DEFAULT

# NIXL_TELEMETRY_ENABLE's words, any case, as NIXL reads them.
_YES = {"y", "yes", "on", "1", "true", "enable"}
_NO = {"n", "no", "off", "0", "false", "disable"}


class nixlAgentConfig:
    """The options an agent is made with, with the names and defaults of
    NIXL's bindings; ``nixl_agent`` fills them from its
    ``nixl_agent_config``. kvmove reads ``captureTelemetry``; the rest is
    recorded."""

    def __init__(self):
        self.useProgThread = False
        self.useListenThread = False
        self.listenPort = DEFAULT_COMM_PORT
        self.syncMode = NIXL_THREAD_SYNC_NONE
        self.pthrDelay = 0
        self.lthrDelay = 100000
        self.captureTelemetry = False


class nixlAgent:
    """What kvmove keeps of NIXL's C++ agent: its name and config, checked
    as NIXL's constructor checks them (a name is a ``str``, or ``bytes``
    in UTF-8, else a ``TypeError``; an empty one is a ``ValueError``), and
    whether it captures
    telemetry (``.telemetry``), decided as NIXL 1.5.1 decides:
    ``NIXL_TELEMETRY_ENABLE`` when it is set (``y``, ``yes``, ``on``,
    ``1``, ``true``, ``enable`` or their negatives, any case; another value
    is a ``RuntimeError``), else the config's ``captureTelemetry``."""

    def __init__(self, name: str, config: nixlAgentConfig):
        if isinstance(name, bytes):
            name = name.decode()
        if not isinstance(name, str):
            raise TypeError(f"an agent's name is a str, not {type(name).__name__}")
        if not name:
            raise ValueError("an agent needs a non-empty name")
        self.name = name
        self.config = config
        self.telemetry = bool(config.captureTelemetry)
        env = os.environ.get("NIXL_TELEMETRY_ENABLE")
        if env is not None:
            if env.lower() not in _YES | _NO:
                raise RuntimeError(
                    f"NIXL_TELEMETRY_ENABLE={env!r} is not one of {sorted(_YES)} or {sorted(_NO)} (any case)"
                )
            self.telemetry = env.lower() in _YES


__all__ = [
    "BLK_SEG",
    "DEFAULT_COMM_PORT",
    "DRAM_SEG",
    "FILE_SEG",
    "NIXL_INIT_AGENT",
    "NIXL_THREAD_SYNC_DEFAULT",
    "NIXL_THREAD_SYNC_NONE",
    "NIXL_THREAD_SYNC_RW",
    "NIXL_THREAD_SYNC_STRICT",
    "OBJ_SEG",
    "VRAM_SEG",
    "nixlAgent",
    "nixlAgentConfig",
    "nixlBackendError",
    "nixlCancelledError",
    "nixlInvalidParamError",
    "nixlMismatchError",
    "nixlNoTelemetryError",
    "nixlNotAllowedError",
    "nixlNotFoundError",
    "nixlNotPostedError",
    "nixlNotSupportedError",
    "nixlRegDList",
    "nixlRemoteDisconnectError",
    "nixlRepostActiveError",
    "nixlUnknownError",
    "nixlXferDList",
    "nixlXferTelemetry",
    "nixl_mem_t",
    "nixl_thread_sync_t",
]

"""``nixl._bindings`` served by kvmove: the telemetry record, descriptor
list types and exception classes of ``kvmove.nixl`` (NIXL's C++ agent
itself is not provided)."""

from kvmove.nixl import (
    NIXL_INIT_AGENT,
    nixlBackendError,
    nixlCancelledError,
    nixlInvalidParamError,
    nixlMismatchError,
    nixlNoTelemetryError,
    nixlNotAllowedError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlNotSupportedError,
    nixlRegDList,
    nixlRemoteDisconnectError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlXferDList,
    nixlXferTelemetry,
)

__all__ = [
    "NIXL_INIT_AGENT",
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
]

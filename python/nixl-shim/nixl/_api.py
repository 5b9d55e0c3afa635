"""``nixl._api`` served by kvmove: see ``kvmove.nixl``."""

from kvmove.nixl import (
    DEFAULT_COMM_PORT,
    _bindings as nixlBind,  # noqa: F401 (NIXL's _api has it under this name; programs import it)
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]

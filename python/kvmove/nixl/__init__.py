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
  them with ``add_remote_agent``, or through its metadata listener
  (``enable_listen_thread``: ``send_local_metadata``,
  ``fetch_remote_metadata``, ... over kvmove's own wire, see ``_listen``).
  Partial metadata (``get_partial_agent_metadata``) lists some regions;
  a peer that loaded only those refuses descriptors outside them.
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

from ._base import (  # noqa: F401
    logger,
    DEFAULT_COMM_PORT,
    NIXL_INIT_AGENT,
    _MD_MAGIC,
    _SESSION_GONE,
    _peer_gone,
    nixlError,
    nixlNotPostedError,
    nixlInvalidParamError,
    nixlBackendError,
    nixlNotFoundError,
    nixlMismatchError,
    nixlNotAllowedError,
    nixlRepostActiveError,
    nixlUnknownError,
    nixlNotSupportedError,
    nixlRemoteDisconnectError,
    nixlCancelledError,
    nixlNoTelemetryError,
    _from_kvmove,
)
from ._descs import (  # noqa: F401
    nixl_thread_sync_t,
    nixl_backend_handle,
    nixl_agent_config,
    _MEM_TYPES,
    _OTHER_MEM_TYPES,
    _mem_type,
    _DList,
    nixlXferDList,
    nixlRegDList,
    _rows,
    _is_tensor,
    _tensor_rows,
    _operation,
    _indices,
    _agent_name,
    _notif_bytes,
    _encode_notif,
    _decode_notif,
)
from ._handles import (  # noqa: F401
    nixl_prepped_dlist_handle,
    nixlXferTelemetry,
    nixl_xfer_handle,
    _Courier,
    _Job,
    _Remote,
    _uncovered,
    _packed,
    _BACKENDS,
)
from ._agent import (  # noqa: F401
    nixl_agent,
)

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

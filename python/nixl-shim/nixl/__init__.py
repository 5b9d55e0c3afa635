"""kvmove's stand-in for NIXL's ``nixl`` package (opt-in).

Put the directory holding this package (``python/nixl-shim``) first on
``PYTHONPATH`` and an unmodified ``from nixl._api import nixl_agent,
nixl_agent_config`` gets :mod:`kvmove.nixl`'s classes: host memory over
kvmove's TCP or RDMA backend. ``nixl._bindings`` is
``kvmove.nixl._bindings`` (the enums, descriptor list types, telemetry
record and exception classes, and a light ``nixlAgent``);
``nixl._utils`` and ``nixl.logging`` give the helpers of NIXL's modules
of those names. An agent made with ``enable_listen_thread=True`` runs a
metadata listener, so ``send_local_metadata``, ``fetch_remote_metadata``,
``send_partial_agent_metadata`` and ``invalidate_local_metadata`` work
between stand-in agents (over kvmove's own wire, not NIXL's: the agents
at both ends must be kvmove's); NIXL's etcd mode is not served.
"""

from ._api import *  # noqa: F401,F403 (the names of nixl._api)
from ._api import __all__  # noqa: F401

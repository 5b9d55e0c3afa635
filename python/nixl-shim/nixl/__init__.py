"""kvmove's stand-in for NIXL's ``nixl`` package (opt-in).

Put the directory holding this package (``python/nixl-shim``) first on
``PYTHONPATH`` and an unmodified ``from nixl._api import nixl_agent,
nixl_agent_config`` gets :mod:`kvmove.nixl`'s classes: host memory over
kvmove's TCP or RDMA backend. ``nixl._bindings`` provides the names
serving engines import from it (``nixlXferTelemetry``, the descriptor list
types and the exception classes).
"""

from ._api import *  # noqa: F401,F403 (the names of nixl._api)
from ._api import __all__  # noqa: F401

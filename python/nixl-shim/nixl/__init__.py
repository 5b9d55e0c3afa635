"""kvmove's stand-in for NIXL's ``nixl`` package (opt-in).

Put the directory holding this package (``python/nixl-shim``) first on
``PYTHONPATH`` and an unmodified ``from nixl._api import nixl_agent,
nixl_agent_config`` gets :mod:`kvmove.nixl`'s classes: host memory over
kvmove's TCP or RDMA backend. ``nixl._bindings`` is
``kvmove.nixl._bindings`` (the enums, descriptor list types, telemetry
record and exception classes, and a light ``nixlAgent``);
``nixl._utils`` and ``nixl.logging`` give the helpers of NIXL's modules
of those names.
"""

from ._api import *  # noqa: F401,F403 (the names of nixl._api)
from ._api import __all__  # noqa: F401

"""kvmove's stand-in for Mooncake's ``mooncake`` package (opt-in).

Put the directory holding this package (``python/mooncake-shim``) first on
``PYTHONPATH`` and an unmodified ``from mooncake.engine import
TransferEngine`` gets :class:`kvmove.mooncake.TransferEngine`. Only
``mooncake.engine`` and ``mooncake.http_metadata_server`` (an HTTP
metadata server: ``python -m mooncake.http_metadata_server --port 8080``)
are provided (not Mooncake's store).
"""

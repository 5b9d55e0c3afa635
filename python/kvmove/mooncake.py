"""Drop-in replacement for ``mooncake.engine``.

Change ``from mooncake.engine import TransferEngine`` to
``from kvmove.mooncake import TransferEngine``; the calls, argument names,
defaults and return codes are the same (see ``python/README.md`` for the
few deliberate differences).
"""

import enum

from ._metrics import serve_metrics_from_env
from ._native import TransferEngine as _NativeTransferEngine
from ._native import TransferNotify


# Mooncake's module-level build flags (``mooncake.engine.SUPPORT_*``): which
# optional transports and device APIs the build has. kvmove has none of them:
# no CUDA stream methods (``transfer_*_on_cuda``), EFA, HIP, MUSA or NVLink
# transports, so every flag is False, as in Mooncake's non-CUDA wheel.
SUPPORT_CUDA = False
SUPPORT_EFA = False
SUPPORT_HIP = False
SUPPORT_MNNVL = False
SUPPORT_MUSA = False
SUPPORT_INTRA_NVLINK = False


class TransferOpcode(enum.IntEnum):
    """Direction of ``transfer_sync`` / ``batch_transfer_sync``."""

    Read = 0
    Write = 1
    READ = 0
    WRITE = 1


def _protocol(protocol):
    """The protocol kvmove runs for ``protocol``: Mooncake's ``"shm"`` (its
    same-host shared-memory transport) is TCP, which reaches a peer on the
    same host over loopback (and one on another host too); every other
    name goes to kvmove as given (``"tcp"``, ``"rdma"``, else -1)."""
    if isinstance(protocol, str) and protocol.strip().lower() == "shm":
        return "tcp"
    return protocol


class TransferEngine(_NativeTransferEngine):
    """Mooncake's ``TransferEngine`` API over kvmove.

    Every method returns 0 (or a batch id / address) on success and a
    negative number (0 for batch ids and addresses) on failure; the reason is
    available from :meth:`last_error` on the same thread.
    """

    TransferOpcode = TransferOpcode

    def __init__(self):
        super().__init__()
        serve_metrics_from_env()

    def initialize(self, local_hostname, metadata_server, protocol, device_name):
        """Starts the engine (see the native method); ``protocol`` is
        ``"tcp"``, ``"rdma"`` or ``"shm"`` (run as TCP).

        ``metadata_server`` is ``"P2PHANDSHAKE"`` (peers name this engine
        by its ``host:port``) or a metadata server, as in Mooncake:
        ``"http://host:port/path"`` (Mooncake's HTTP metadata server) or
        ``"etcd://host:port"`` / bare ``"host:port"`` (etcd). With a server,
        ``local_hostname`` is this engine's segment name (any string, e.g.
        ``"prefill-0"``): it is published there with the address the engine
        listens on (``MC_TCP_BIND_ADDRESS``, else the name's host when it is
        an address of this machine, else this machine's outward address;
        a free port) and removed at :meth:`close`; peers pass the name as
        ``target_hostname``. Records are kvmove's own (``kvmove/segments/``
        keys): stand-in engines find each other, not Mooncake's."""
        return super().initialize(local_hostname, metadata_server, _protocol(protocol), device_name)

    def initialize_ext(self, local_hostname, metadata_server, protocol, device_name, metadata_type):
        """``initialize`` with an explicit metadata type: as Mooncake, a
        ``metadata_server`` without ``scheme://`` (and not
        ``"P2PHANDSHAKE"``) gets ``metadata_type`` (``"etcd"``, ``"http"``)
        as its scheme."""
        return super().initialize_ext(local_hostname, metadata_server, _protocol(protocol), device_name, metadata_type)

    def metrics(self) -> dict:
        """kvmove's metrics as a dict (not in Mooncake's API):
        :func:`kvmove.metrics`, process-wide."""
        from ._metrics import metrics

        return metrics()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


__all__ = [
    "SUPPORT_CUDA",
    "SUPPORT_EFA",
    "SUPPORT_HIP",
    "SUPPORT_INTRA_NVLINK",
    "SUPPORT_MNNVL",
    "SUPPORT_MUSA",
    "TransferEngine",
    "TransferNotify",
    "TransferOpcode",
]

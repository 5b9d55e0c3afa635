"""``mooncake.engine`` served by kvmove: see ``kvmove.mooncake``."""

from kvmove.mooncake import (
    SUPPORT_CUDA,
    SUPPORT_EFA,
    SUPPORT_HIP,
    SUPPORT_INTRA_NVLINK,
    SUPPORT_MNNVL,
    SUPPORT_MUSA,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)

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

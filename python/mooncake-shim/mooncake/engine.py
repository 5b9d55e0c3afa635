"""``mooncake.engine`` served by kvmove: see ``kvmove.mooncake``."""

from kvmove.mooncake import TransferEngine, TransferNotify, TransferOpcode

__all__ = ["TransferEngine", "TransferNotify", "TransferOpcode"]

"""``mooncake.engine`` served by kvmove: see ``kvmove.mooncake``."""

from kvmove.mooncake import *  # noqa: F401,F403 (the names of mooncake.engine)
from kvmove.mooncake import __all__  # noqa: F401

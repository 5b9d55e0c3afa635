"""``nixl._bindings`` served by kvmove: this name is ``kvmove.nixl._bindings``
itself (one module, not a copy), so what a program replaces here
(``nixlAgent``, as NIXL's own tests do) is what kvmove's agent calls."""

import sys

from kvmove.nixl import _bindings

sys.modules[__name__] = _bindings

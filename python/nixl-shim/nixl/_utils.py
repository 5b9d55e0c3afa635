"""``nixl._utils`` served by kvmove: the host memory helpers NIXL's tests
and examples use, over the C library's ``malloc`` and ``free``."""

import ctypes

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def malloc_passthru(size: int) -> int:
    """The address of ``size`` bytes of new host memory (``malloc``), for
    ``free_passthru``; ``MemoryError`` when there is none."""
    addr = _libc.malloc(size)
    if not addr and size:
        raise MemoryError(f"malloc of {size} bytes failed")
    return addr or 0


def free_passthru(addr: int) -> None:
    """Frees memory from ``malloc_passthru``."""
    _libc.free(addr)


def ba_buf(addr: int, size: int) -> None:
    """Fills ``size`` bytes at ``addr`` with ``0xba``, as NIXL's does."""
    ctypes.memset(addr, 0xBA, size)

"""Device (GPU) memory in kvmove's Python APIs.

Memory is registered by address everywhere (Mooncake's ``register_memory``,
NIXL descriptors, ``Engine.register_address``) or as an object
(``Engine.register``). At each registration kvmove asks the installed
device-memory providers whether the address is theirs (as Mooncake asks
CUDA): device memory is then moved through its provider and never touched
by the host; anything else must be host memory this process can read, or
the registration is refused before a transfer could crash the process.

:func:`device_providers` lists the providers installed in this process.
:class:`FakeDevice` is one for tests on machines without a GPU: its memory
faults on any host access, so a path that reads it as host memory crashes
the test instead of passing; copies can be failed or slowed on demand.

:func:`memory_of` reads the memory an object exposes through
``__cuda_array_interface__`` (a torch CUDA tensor, CuPy, Numba) or DLPack
(``__dlpack__``: torch tensors on any device, JAX, numpy), as
``Engine.register`` does.
"""

import ctypes
from typing import Any, Optional, Tuple

from ._native import FakeDevice as _NativeFakeDevice
from ._native import device_providers

__all__ = ["FakeDevice", "FakeDeviceBuffer", "device_providers", "memory_of"]


class FakeDevice:
    """A fake device with index ``index`` and ``capacity`` bytes of memory
    the host cannot touch, found by address (like CUDA memory) until
    :meth:`close`. Memory registered from it keeps working after ``close``.
    """

    def __init__(self, index: int = 0, capacity: int = 64 << 20):
        self._dev = _NativeFakeDevice(index, capacity)

    @property
    def index(self) -> int:
        return self._dev.index

    def alloc(self, nbytes: int) -> int:
        """``nbytes`` fresh zeroed bytes of device memory: their address
        (never freed while the device lives)."""
        return self._dev.alloc(nbytes)

    def buffer(self, nbytes: int) -> "FakeDeviceBuffer":
        """``nbytes`` fresh bytes as an object with
        ``__cuda_array_interface__``, as a torch CUDA tensor shows itself."""
        return FakeDeviceBuffer(self, nbytes)

    def write(self, addr: int, data: bytes) -> None:
        """Copies ``data`` into device memory at ``addr`` (through the
        provider, as ``cudaMemcpy`` would)."""
        self._dev.write(addr, bytes(data))

    def read(self, addr: int, length: int) -> bytes:
        """Copies ``length`` bytes of device memory at ``addr`` out."""
        return bytes(self._dev.read(addr, length))

    def fail_copies(self, n: int) -> None:
        """The next ``n`` copies to or from this device fail."""
        self._dev.fail_copies(n)

    @property
    def failures_left(self) -> int:
        return self._dev.failures_left

    def delay_copies(self, seconds: float) -> None:
        """Every copy from now on takes at least ``seconds`` (0: none)."""
        self._dev.delay_copies(seconds)

    @property
    def copies(self) -> int:
        """Copies made so far, either way."""
        return self._dev.copies

    def close(self) -> None:
        """Stops finding this device's memory for new registrations."""
        self._dev.close()

    def __enter__(self) -> "FakeDevice":
        return self

    def __exit__(self, *exc) -> bool:
        self.close()
        return False

    def __repr__(self) -> str:
        return f"FakeDevice(index={self.index})"


class FakeDeviceBuffer:
    """``nbytes`` of a :class:`FakeDevice`'s memory, exposed through
    ``__cuda_array_interface__`` (one-dimensional, bytes)."""

    def __init__(self, device: FakeDevice, nbytes: int):
        self.device = device
        self.nbytes = int(nbytes)
        self.ptr = device.alloc(self.nbytes)

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }

    def read(self, offset: int = 0, length: Optional[int] = None) -> bytes:
        n = self.nbytes - offset if length is None else length
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise IndexError(f"{n} bytes at offset {offset} outside a buffer of {self.nbytes}")
        return self.device.read(self.ptr + offset, n)

    def write(self, data: bytes, offset: int = 0) -> None:
        if offset < 0 or offset + len(data) > self.nbytes:
            raise IndexError(f"{len(data)} bytes at offset {offset} outside a buffer of {self.nbytes}")
        self.device.write(self.ptr + offset, data)

    def __len__(self) -> int:
        return self.nbytes


# ---- objects that expose their memory ----

# DLPack's device types (dlpack.h).
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _contiguous(shape, strides, itemsize: int) -> bool:
    """Whether ``strides`` (in bytes) are the C-contiguous ones of
    ``shape``; dimensions of size 1 may have any stride."""
    want = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _nbytes(shape, itemsize: int) -> int:
    n = itemsize
    for d in shape:
        if d < 0:
            raise ValueError(f"negative dimension in shape {tuple(shape)}")
        n *= d
    return n


def _from_cuda_array_interface(cai: dict) -> Tuple[int, int, str]:
    try:
        shape = tuple(int(d) for d in cai["shape"])
        typestr = str(cai["typestr"])
        ptr, readonly = cai["data"]
        ptr = int(ptr)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed __cuda_array_interface__: {e}") from None
    if readonly:
        raise ValueError("the device array is read-only; transfers may write into registered memory")
    try:
        itemsize = int(typestr[2:])
    except ValueError:
        raise ValueError(f"__cuda_array_interface__ has an unknown typestr {typestr!r}") from None
    strides = cai.get("strides")
    if strides is not None and not _contiguous(shape, [int(s) for s in strides], itemsize):
        raise ValueError("the device array is not C-contiguous")
    if cai.get("mask") is not None:
        raise ValueError("masked device arrays are not supported")
    return ptr, _nbytes(shape, itemsize), "device"


def _from_dlpack(obj: Any) -> Tuple[int, int, str]:
    capsule = obj.__dlpack__()
    p = _capsule_pointer(capsule, b"dltensor")
    t = _DLTensor.from_address(p)
    ndim = int(t.ndim)
    if ndim < 0:
        raise ValueError("DLPack tensor with a negative ndim")
    shape = [int(t.shape[i]) for i in range(ndim)]
    bits = int(t.dtype.bits) * int(t.dtype.lanes)
    if bits % 8:
        raise ValueError(f"DLPack elements of {bits} bits are not whole bytes")
    itemsize = bits // 8
    if t.strides and not _contiguous(shape, [int(t.strides[i]) * itemsize for i in range(ndim)], itemsize):
        raise ValueError("the DLPack tensor is not C-contiguous")
    addr = int(t.data or 0) + int(t.byte_offset)
    dev, dev_id = int(t.device.device_type), int(t.device.device_id)
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        kind = "host"
    elif dev == _DL_CUDA:
        kind = f"device:{dev_id}"
    elif dev == _DL_CUDA_MANAGED:
        kind = "auto"
    else:
        raise ValueError(f"DLPack device type {dev} is not supported (CPU, CUDA, CUDA host and managed memory are)")
    nbytes = _nbytes(shape, itemsize)
    del capsule  # released here: the object itself keeps the memory
    return addr, nbytes, kind


def memory_of(obj: Any) -> Optional[Tuple[int, int, str]]:
    """``(address, nbytes, kind)`` of the memory ``obj`` exposes through
    ``__cuda_array_interface__`` or DLPack, ``kind`` being ``"device"``,
    ``"device:N"``, ``"host"`` or ``"auto"`` (CUDA managed memory); None
    when it exposes neither. Raises ``ValueError`` for memory that cannot be
    registered (not contiguous, read-only, an unsupported device type)."""
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is not None:
        return _from_cuda_array_interface(cai)
    if hasattr(obj, "__dlpack__"):
        return _from_dlpack(obj)
    return None

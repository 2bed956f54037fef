"""``DeviceArray``: a device allocation with a shape and a NumPy dtype."""

from __future__ import annotations

import math
from contextlib import suppress
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    from pagedkv.kernels.device import Device

__all__ = ["DeviceArray"]


class DeviceArray:
    """A C-contiguous array in device memory.

    Owns its allocation unless made with ``owned=False`` (a view of memory someone
    else frees). bfloat16 data is carried as ``uint16`` bit patterns, as everywhere
    in pagedkv. ``ptr`` is the device address the kernels take.
    """

    __slots__ = ("_owned", "device", "dtype", "nbytes", "ptr", "shape")

    def __init__(self, device: Device, ptr: int, shape: tuple[int, ...], dtype,
                 *, owned: bool = True) -> None:
        self.device = device
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._owned = owned

    # --- construction ---------------------------------------------------------------

    @classmethod
    def empty(cls, device: Device, shape, dtype) -> DeviceArray:
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise InvalidArgument(f"shape={shape}: dimensions must be >= 0")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        return cls(device, device.malloc(nbytes), shape, dtype)

    @classmethod
    def from_numpy(cls, device: Device, array) -> DeviceArray:
        if not isinstance(array, np.ndarray):
            raise InvalidArgumentType(
                f"array: expected a numpy.ndarray, got {type(array).__name__}")
        host = np.ascontiguousarray(array)
        out = cls.empty(device, host.shape, host.dtype)
        device.copy_htod(out.ptr, host)
        return out

    # --- data -------------------------------------------------------------------------

    def live_ptr(self) -> int:
        """``ptr``, or InvalidArgument once freed (a kernel must never get a null address)."""
        # ptr 0 after free(): refuse here rather than hand the runtime a null address
        if not self.ptr and self.nbytes:
            raise InvalidArgument(
                f"DeviceArray(shape={self.shape}, dtype={self.dtype}) was freed; allocate a "
                "new one (DeviceArray.empty / from_numpy)")
        return self.ptr

    def to_numpy(self) -> np.ndarray:
        host = np.empty(self.shape, dtype=self.dtype)
        self.device.copy_dtoh(host, self.live_ptr())
        return host

    def copy_from(self, array: np.ndarray) -> None:
        """Overwrite with a host array of the same shape and dtype."""
        host = np.ascontiguousarray(array)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise InvalidArgument(
                f"array: shape {host.shape} dtype {host.dtype} does not match the device "
                f"array's {self.shape} {self.dtype}")
        self.device.copy_htod(self.live_ptr(), host)

    def fill_bytes(self, value: int) -> None:
        """Set every byte to ``value`` (tests poison outputs with 0xFF: NaN in f16/f32)."""
        self.device.memset(self.live_ptr(), value, self.nbytes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def free(self) -> None:
        if self._owned and self.ptr:
            self.device.free(self.ptr)
        self.ptr = 0

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown: the runtime may already be gone
            self.free()

    def __repr__(self) -> str:
        where = f"ptr=0x{self.ptr:x}" if self.ptr else "freed"
        view = "" if self._owned else ", view"
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, {where}{view}, "
                f"device={self.device.properties.name!r})")

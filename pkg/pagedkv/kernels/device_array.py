"""``DeviceArray``: a device allocation with a shape and a NumPy dtype."""

from __future__ import annotations

import math
from contextlib import suppress
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    from pagedkv.kernels.device import Device

__all__ = ["DeviceArray", "need_array", "need_device_array", "need_on_device", "need_writable"]


class DeviceArray:
    """A C-contiguous array in device memory.

    Owns its allocation unless made with ``owned=False`` (a view of memory someone
    else frees). bfloat16 data is carried as ``uint16`` bit patterns, as everywhere
    in pagedkv. ``ptr`` is the device address the kernels take.

    ``base``: the object that keeps a view's memory alive (the array it was cut from,
    or the producer of an imported DLPack / CUDA-array-interface buffer); ``None`` for
    an owning array. Interop (``__dlpack__``, ``from_dlpack``,
    ``__cuda_array_interface__``): :mod:`pagedkv.kernels.interop`, docs/kernels.md
    "Interop".

    ``readonly``: the producer of an imported buffer flagged it read-only (DLPack 1.0's
    ``DLPACK_FLAG_BITMASK_READ_ONLY``, the CUDA array interface's ``data[1]``); views
    inherit it, exports pass it on, and every call that writes it (a kernel's output or
    pool, :meth:`copy_from`, :meth:`fill_bytes`) refuses it (:func:`need_writable`).
    """

    __slots__ = ("__weakref__", "_owned", "base", "device", "dtype", "nbytes", "ptr",
                 "readonly", "shape")

    def __init__(self, device: Device, ptr: int, shape: tuple[int, ...], dtype,
                 *, owned: bool = True, base: object = None, readonly: bool = False) -> None:
        self.device = device
        self.ptr = int(ptr)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = _plain_dtype(dtype)
        self.nbytes = math.prod(self.shape) * self.dtype.itemsize
        self._owned = owned
        self.base = base
        self.readonly = bool(readonly)

    # --- construction ---------------------------------------------------------------

    @classmethod
    def empty(cls, device: Device, shape, dtype) -> DeviceArray:
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise InvalidArgument(f"shape={shape}: dimensions must be >= 0")
        nbytes = math.prod(shape) * _plain_dtype(dtype).itemsize
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

    def view(self, shape=None, dtype=None, *, offset_bytes: int = 0) -> DeviceArray:
        """A non-owning C-contiguous view of ``nbytes`` of this array's memory starting
        ``offset_bytes`` in (a reshape, a reinterpretation as another dtype, or a slice of
        whole rows); it keeps this array alive. ``InvalidArgument`` when it would reach
        past the end or the offset is not a multiple of the new dtype's size."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if shape is None:
            if (self.nbytes - offset_bytes) % dtype.itemsize:
                raise InvalidArgument(f"view: {self.nbytes - offset_bytes} bytes are not a "
                                      f"whole number of {dtype} elements")
            shape = ((self.nbytes - offset_bytes) // dtype.itemsize,)
        shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if (offset_bytes < 0 or offset_bytes % dtype.itemsize or any(s < 0 for s in shape)
                or offset_bytes + nbytes > self.nbytes):
            raise InvalidArgument(f"view: shape {shape} of {dtype} at byte {offset_bytes} does "
                                  f"not fit in {self!r} ({self.nbytes} bytes)")
        return DeviceArray(self.device, self.live_ptr() + offset_bytes if nbytes else 0, shape,
                           dtype, owned=False, base=self, readonly=self.readonly)

    def rows(self, start: int, stop: int) -> DeviceArray:
        """A view of rows ``[start, stop)`` along axis 0."""
        if not 0 <= start <= stop <= self.shape[0]:
            raise InvalidArgument(f"rows [{start}, {stop}) are outside 0..{self.shape[0]}")
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return self.view((stop - start, *self.shape[1:]), offset_bytes=start * row_bytes)

    # --- interop (pagedkv.kernels.interop) ----------------------------------------------

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule over this memory (no copy; versioned 1.0 when the consumer's
        ``max_version`` allows). The capsule keeps this array alive."""
        from pagedkv.kernels.interop import dlpack_capsule
        return dlpack_capsule(self, stream=stream, max_version=max_version,
                              dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from pagedkv.kernels.interop import dlpack_device
        return dlpack_device(self)

    @property
    def __cuda_array_interface__(self) -> dict:
        from pagedkv.kernels.interop import cuda_array_interface
        return cuda_array_interface(self)

    @classmethod
    def from_dlpack(cls, obj, device: Device | None = None, *, stream=None) -> DeviceArray:
        """A view of a torch/CuPy/JAX device tensor (DLPack, else the CUDA array interface),
        without a copy; it keeps the producer's buffer alive."""
        from pagedkv.kernels.device import stream_handle
        from pagedkv.kernels.interop import from_cuda_array_interface, from_dlpack
        stream_handle(stream)  # InvalidArgumentType before obj is asked anything
        if not hasattr(obj, "__dlpack__") and hasattr(obj, "__cuda_array_interface__"):
            return from_cuda_array_interface(obj, device, stream=stream)
        return from_dlpack(obj, device, stream=stream)

    # --- data -------------------------------------------------------------------------

    def live_ptr(self) -> int:
        """``ptr``, or InvalidArgument once freed (a kernel must never get a null address)."""
        # ptr 0 after free(): refuse here rather than hand the runtime a null address
        if not self.ptr and self.nbytes:
            raise InvalidArgument(_freed(self))
        return self.ptr

    def to_numpy(self) -> np.ndarray:
        host = np.empty(self.shape, dtype=self.dtype)
        self.device.copy_dtoh(host, self.live_ptr())
        return host

    def copy_from(self, array: np.ndarray) -> None:
        """Overwrite with a host array of the same shape and dtype."""
        need_writable(self, "copy_from")
        host = np.ascontiguousarray(array)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise InvalidArgument(
                f"array: shape {host.shape} dtype {host.dtype} does not match the device "
                f"array's {self.shape} {self.dtype}")
        self.device.copy_htod(self.live_ptr(), host)

    def fill_bytes(self, value: int) -> None:
        """Set every byte to ``value`` (tests poison outputs with 0xFF: NaN in f16/f32)."""
        need_writable(self, "fill_bytes")
        self.device.memset(self.live_ptr(), value, self.nbytes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def free(self) -> None:
        """Give the memory back now (owning arrays; a view only forgets its address).
        Idempotent. Views and exported DLPack tensors of this array must not be used
        after it: free explicitly only what nobody else holds, or drop the reference and
        let the last holder's release free it."""
        if self._owned and self.ptr:
            self.device.free(self.ptr)
        self.ptr = 0
        self.base = None

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown: the runtime may already be gone
            self.free()

    def __repr__(self) -> str:
        where = f"ptr=0x{self.ptr:x}" if self.ptr else "freed"
        view = ("" if self._owned else ", view") + (", read-only" if self.readonly else "")
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype}, {where}{view}, "
                f"device={self.device.properties.name!r})")


def _plain_dtype(dtype) -> np.dtype:
    dtype = np.dtype(dtype)
    if dtype.hasobject:  # to_numpy would read device bytes as PyObject pointers
        raise InvalidArgument(f"dtype {dtype}: device memory holds numbers, not Python "
                              "objects; use a bool, int, uint or float dtype")
    return dtype


def _freed(arr: DeviceArray) -> str:
    return (f"DeviceArray(shape={arr.shape}, dtype={arr.dtype}) was freed; allocate a new one "
            "(DeviceArray.empty / from_numpy)")


def need_on_device(obj, name: str, device, owner: str = "the launch",
                   fix: str | None = None) -> None:
    """``InvalidArgument`` unless ``obj`` (argument ``name``: a DeviceArray, tables, a
    PagedAttention, anything with a ``device``; anything else is left to the type checks) is
    on ``device``'s GPU, the one ``owner`` launches on (another Device object of the same
    ``(backend, ordinal)`` is taken): a kernel launched there would read the other GPU's
    addresses. ``device`` ``None``: no check. The one device check of every launcher."""
    there = getattr(obj, "device", None)
    if device is None or there is None or there is device or (
            getattr(there, "backend", None), getattr(there, "ordinal", None)) == (
                getattr(device, "backend", None), getattr(device, "ordinal", None)):
        return
    raise InvalidArgument(f"{name}: on {there!r}, {owner} on {device!r}; make it on {owner}'s "
                          f"device" + (f" ({fix})" if fix else ""))


def need_device_array(arr, name: str, device=None) -> None:
    """A DeviceArray that still has its memory (and, when ``device`` is given, on its GPU:
    :func:`need_on_device`): a freed one is refused here, naming the argument, not by the
    launch that packs it (after a launcher's earlier launches ran)."""
    if not isinstance(arr, DeviceArray):
        raise InvalidArgumentType(f"{name}: expected a DeviceArray, got {type(arr).__name__}")
    if not arr.ptr and arr.nbytes:
        raise InvalidArgument(f"{name}: {_freed(arr)}")
    need_on_device(arr, name, device)


def need_writable(arr, name: str, device=None) -> None:
    """A launcher's check of an array it writes (an output, a pool): a live (not freed)
    DeviceArray (on ``device`` when given) that is not :attr:`DeviceArray.readonly`
    (``InvalidArgument`` naming it; ``InvalidArgumentType`` for anything but a DeviceArray).
    A read-only import is the producer's promise to its other readers (a torch inference
    tensor, a JAX array) that nobody writes it."""
    need_device_array(arr, name, device)
    if arr.readonly:
        raise InvalidArgument(f"{name}: {arr!r} was imported read-only (its producer's DLPack "
                              "read-only flag or __cuda_array_interface__ data[1]); pass a "
                              "writable buffer (a clone of it, or DeviceArray.empty)")


def need_array(arr, name: str, dtype, ndim: int | None = None, *,
               writable: bool = False, device=None) -> None:
    """A launcher's check of argument ``name``: a live DeviceArray of ``dtype`` (and ``ndim``
    dimensions when given; not read-only when ``writable``: :func:`need_writable`; on the
    launch's ``device`` when given: :func:`need_on_device`); ``InvalidArgumentType`` /
    ``InvalidArgument`` naming it."""
    (need_writable if writable else need_device_array)(arr, name, device)
    if arr.dtype != np.dtype(dtype):
        raise InvalidArgument(f"{name}: dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if ndim is not None and arr.ndim != ndim:
        raise InvalidArgument(f"{name}: shape {arr.shape} has {arr.ndim} dims, expected {ndim}")

"""Zero-copy interop of :class:`DeviceArray` with torch, CuPy, JAX and NumPy: DLPack
(``__dlpack__`` / ``__dlpack_device__`` / ``from_dlpack``, legacy and versioned 1.0
capsules) and the CUDA array interface v3 (``__cuda_array_interface__``).

Ownership (docs/kernels.md, "Interop"):

- **Export.** A capsule holds a strong reference to the exported DeviceArray (and to the
  bases of a view, so the view's ``free()`` cannot release them) until the consumer's
  deleter runs, so a torch tensor made from a pagedkv buffer keeps that memory
  alive even after pagedkv dropped it (a grown pool's old layer arrays, say); an explicit
  ``free()`` by the owner while a consumer still uses the memory is the caller's error. The
  CUDA array interface carries no lifetime: the consumer must keep the DeviceArray.
- **Import.** ``from_dlpack(obj)`` consumes the producer's capsule (renamed
  ``used_dltensor``) and returns a non-owning DeviceArray whose ``base`` holds it; the
  producer's deleter runs when that DeviceArray (and every view of it) is gone.
  ``from_cuda_array_interface(obj)`` keeps ``obj`` itself as the base.
- **Read-only.** A buffer its producer flags read-only (a versioned capsule's
  ``DLPACK_FLAG_BITMASK_READ_ONLY``, the interface's ``data: (ptr, True)``) is imported as a
  :attr:`~pagedkv.kernels.DeviceArray.readonly` array: it can be read (a query, a weight,
  K/V to write into a pool) but every launcher refuses it where it writes; exported again,
  it keeps the flag (a legacy capsule, which has none, is refused with ``BufferError``).
- **Layout.** Only C-contiguous buffers (strides ``None`` or row-major; size-1 axes may
  carry any stride, and so may every axis of a buffer of zero elements) are taken; anything else raises :class:`InvalidArgument`. bfloat16
  comes in as ``uint16`` bits and goes out as ``uint16`` (``tensor.view(torch.bfloat16)``).
- **Streams.** pagedkv's host-side pool calls work on the legacy default stream. An
  export asked for on another consumer stream (``__dlpack__(stream=s)``) makes ``s`` wait
  for the default stream's work (an event, no host wait); ``s`` follows DLPack's rule
  (CUDA: 1 legacy default, 2 per-thread default, 0 refused; ROCm: 0 default, 1 and 2
  refused; -1 no synchronization), a refused value raising ``BufferError`` before any wait.
  An import (``from_dlpack(obj, stream=s)``) on HIP refuses 1 and 2 the same way
  (``InvalidArgument``, before the producer is asked): pass None or 0 or a stream handle.
  ``__cuda_array_interface__`` reports stream 1 (legacy default). An import whose
  producer names a stream is ordered before the consumer's ``stream=`` (an interface's
  ``stream`` entry: an event the consumer stream waits for; on the legacy default stream a
  synchronization of a non-default one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    from pagedkv.kernels.device import Device
    from pagedkv.kernels.device_array import DeviceArray

__all__ = [
    "DLPACK_DEVICE_TYPES",
    "as_device_array",
    "cuda_array_interface",
    "dlpack_capsule",
    "dlpack_device",
    "from_cuda_array_interface",
    "from_dlpack",
    "is_device_buffer",
]

KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_ROCM, KDL_CUDA_MANAGED = 1, 2, 3, 10, 13
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6

#: DLPack device types a backend's memory is exported as ("export") and accepted as
#: ("import"). Tests of the HIP stub, whose "device" memory is host memory, add kDLCPU.
DLPACK_DEVICE_TYPES: dict[str, dict[str, tuple[int, ...]]] = {
    "cuda": {"export": (KDL_CUDA,), "import": (KDL_CUDA, KDL_CUDA_MANAGED)},
    "hip": {"export": (KDL_ROCM,), "import": (KDL_ROCM,)},
}
# The stream argument that means "the legacy default stream" (the array API's rule).
_DEFAULT_STREAM = {"cuda": 1, "hip": 0}


def _dl_dtype(dtype: np.dtype) -> tuple[int, int, int]:
    code = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "b": _KDL_BOOL}.get(dtype.kind)
    if code is None or dtype.byteorder == ">":
        raise InvalidArgument(f"dtype {dtype}: DLPack export takes bool, int, uint and float")
    return (code, 8 * dtype.itemsize, 1)


def _np_dtype(triple: tuple[int, int, int]) -> np.dtype:
    code, bits, lanes = triple
    if lanes == 1:
        if code == _KDL_BFLOAT and bits == 16:
            return np.dtype(np.uint16)  # bfloat16 as bit patterns, as everywhere in pagedkv
        kind = {_KDL_INT: "i", _KDL_UINT: "u", _KDL_FLOAT: "f", _KDL_BOOL: "b"}.get(code)
        if kind is not None and bits in (8, 16, 32, 64):  # numpy's float128 is not IEEE's
            try:
                return np.dtype(f"{kind}{bits // 8}" if kind != "b" else "?")
            except TypeError:
                pass
    raise InvalidArgument(f"DLPack dtype (code {code}, bits {bits}, lanes {lanes}) has no "
                          f"pagedkv equivalent")


def _check_c_contiguous(shape: tuple[int, ...], strides, itemsize: int, *, in_bytes: bool,
                        what: str) -> None:
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{what}: shape {shape} has a negative dimension")
    if strides is None:
        return
    if len(strides) != len(shape):
        raise InvalidArgument(f"{what}: {len(strides)} strides for the {len(shape)} dims of "
                              f"shape {shape}")
    if 0 in shape:  # no element to address: any strides (NumPy's 0s, torch's) are contiguous
        return
    expected = 1 if not in_bytes else itemsize
    for dim, stride in zip(reversed(shape), reversed(strides), strict=True):
        if dim != 1 and stride != expected:
            raise InvalidArgument(f"{what}: shape {shape} with strides {tuple(strides)} is not "
                                  f"C-contiguous; make it contiguous first (.contiguous())")
        expected *= dim


def _check_aligned(ptr: int, dtype: np.dtype, what: str) -> None:
    """The kernels load whole elements (and wider): a buffer off its element alignment
    faults on a GPU."""
    if ptr % dtype.itemsize:
        raise InvalidArgument(f"{what}: the buffer starts at {ptr:#x}, not a multiple of its "
                              f"{dtype} element size ({dtype.itemsize} bytes); copy it to an "
                              "aligned buffer first")


def _backend(device: Device) -> str:
    return getattr(device, "backend", "cuda")


# --- export -------------------------------------------------------------------------------


def dlpack_device(arr: DeviceArray) -> tuple[int, int]:
    """``(device_type, device_id)`` for ``__dlpack_device__``."""
    return (DLPACK_DEVICE_TYPES[_backend(arr.device)]["export"][0], arr.device.ordinal)


def _stream_waits_for(device: Device, stream, producer: int | None = None) -> None:
    """Make the consumer's ``stream`` wait for the work queued so far on ``producer`` (by
    default the legacy default stream, where pagedkv's host-side calls launch), without
    blocking the host."""
    from pagedkv.kernels.device import Event
    event = Event(device)
    event.record(producer)
    device.call("stream_wait_event", int(stream), event.handle, 0)


def dlpack_capsule(arr: DeviceArray, *, stream=None, max_version=None, dl_device=None,
                   copy=None):
    """``arr.__dlpack__(...)``: a capsule over ``arr``'s memory (versioned DLPack 1.0 when
    ``max_version >= (1, 0)``, else legacy). ``copy=True`` and another ``dl_device`` raise
    ``BufferError`` (pagedkv does not copy on export)."""
    from pagedkv.kernels.dlpack import export_capsule
    if copy:
        raise BufferError("DeviceArray.__dlpack__(copy=True): pagedkv exports its memory "
                          "without copying; copy on the consumer's side")
    here = dlpack_device(arr)
    if dl_device is not None and tuple(dl_device) != here:
        raise BufferError(f"DeviceArray.__dlpack__(dl_device={tuple(dl_device)}): the array "
                          f"lives on {here} and is not copied across devices")
    versioned = _versioned(max_version)
    wait_on = _export_stream(_backend(arr.device), stream)
    if arr.readonly and not versioned:  # NumPy's rule: never hand read-only memory as writable
        raise BufferError("DeviceArray.__dlpack__: the array is read-only and a legacy DLPack "
                          "capsule (no max_version >= (1, 0)) cannot say so; use a consumer of "
                          "DLPack 1.0 or export a writable copy")
    ptr = arr.live_ptr()
    if wait_on is not None:
        _stream_waits_for(arr.device, wait_on)
    return export_capsule(_keepers(arr), ptr, arr.shape, _dl_dtype(arr.dtype), here[0],
                          here[1], versioned, arr.readonly)


def _export_stream(backend: str, stream) -> int | None:
    """The consumer stream of ``__dlpack__(stream=)`` to make wait for the default stream,
    ``None`` when no wait is needed, by the DLPack rule for the backend. CUDA: ``None`` and
    1 are the legacy default stream (ours), 2 the per-thread default stream (a blocking
    stream: it waits for the legacy default stream's earlier work by itself), 0 is
    disallowed as ambiguous. ROCm: ``None`` and 0 are the default stream, 1 and 2 are not
    supported. Both: -1 asks for no synchronization, a value above 2 is a stream handle.
    A value the rule refuses raises ``BufferError``, the protocol's error (torch raises it
    for the per-thread stream it does not take), before any wait."""
    if stream is None:
        return None
    if not is_int(stream):
        raise InvalidArgumentType(f"stream: expected an int stream handle, got "
                                  f"{type(stream).__name__}")
    stream = int(stream)
    default = {"cuda": (1, 2), "hip": (0,)}[backend]
    if stream == -1 or stream in default:
        return None
    if stream <= 2:  # 0 on CUDA, 1 and 2 on ROCm, below -1 anywhere
        valid = ("1 (the legacy default stream), 2 (the per-thread default stream)"
                 if backend == "cuda" else "0 (the default stream)")
        raise BufferError(f"DeviceArray.__dlpack__(stream={stream}): not a {backend} stream "
                          f"under the DLPack rule; pass None, -1 (no synchronization), "
                          f"{valid} or a stream handle")
    return stream


def _versioned(max_version) -> bool:
    """Whether ``__dlpack__(max_version=)`` asks for a versioned DLPack 1.0 capsule."""
    if max_version is None:
        return False
    if not (isinstance(max_version, (tuple, list)) and len(max_version) == 2
            and all(is_int(v) for v in max_version)):
        raise InvalidArgumentType(f"DeviceArray.__dlpack__(max_version={max_version!r}): "
                                  f"expected a (major, minor) tuple of ints, the highest DLPack "
                                  f"version the consumer takes, such as (1, 0)")
    return (int(max_version[0]), int(max_version[1])) >= (1, 0)


def _keepers(arr: DeviceArray) -> tuple:
    """What an exported capsule holds: ``arr`` and every ``base`` it is a view of, taken now,
    so a view's ``free()`` (which drops its ``base``) cannot release memory a consumer uses."""
    from pagedkv.kernels.device_array import DeviceArray
    chain: list[object] = [arr]
    while isinstance(chain[-1], DeviceArray) and chain[-1].base is not None:
        chain.append(chain[-1].base)
    return tuple(chain)


def cuda_array_interface(arr: DeviceArray) -> dict:
    """``arr.__cuda_array_interface__`` (version 3): the consumer must keep ``arr`` alive."""
    return {"shape": arr.shape, "typestr": arr.dtype.str, "data": (arr.live_ptr(), arr.readonly),
            "version": 3, "strides": None, "stream": 1}


# --- import -------------------------------------------------------------------------------


def is_device_buffer(obj) -> bool:
    """Whether ``obj`` offers device memory through DLPack or the CUDA array interface.
    Host memory offered through DLPack (NumPy arrays, CPU torch tensors: device type
    kDLCPU or kDLCUDAHost) does not count: callers read it as host data."""
    if isinstance(obj, np.ndarray):
        return False
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    if not hasattr(obj, "__dlpack__"):
        return False
    try:
        dev_type = int(obj.__dlpack_device__()[0])
    except (AttributeError, TypeError, ValueError, IndexError):
        return True  # no usable device query: let from_dlpack decide and explain
    return dev_type not in (KDL_CPU, KDL_CUDA_HOST) or dev_type in _host_types_taken()


def _host_types_taken() -> set[int]:
    """Host device types some backend imports as device memory (the HIP stub's tests)."""
    return {t for kinds in DLPACK_DEVICE_TYPES.values() for t in kinds["import"]
            if t in (KDL_CPU, KDL_CUDA_HOST)}


def from_dlpack(obj, device: Device | None = None, *, stream=None) -> DeviceArray:
    """A non-owning DeviceArray over ``obj``'s memory (a torch/CuPy/JAX array or anything
    with ``__dlpack__``), taken without a copy. ``device``: the pagedkv Device it must be
    on (default ``open_device()``). ``stream``: the stream the memory will be used on
    (as a launcher's ``stream=``: a pagedkv Stream, an int handle or a torch/CuPy stream;
    default the legacy default stream; on HIP 1 and 2, CUDA's default-stream values under
    DLPack, raise ``InvalidArgument`` before the producer is asked)."""
    from pagedkv.kernels.device import open_device, stream_handle
    from pagedkv.kernels.device_array import DeviceArray
    from pagedkv.kernels.dlpack import import_capsule
    if not hasattr(obj, "__dlpack__"):
        raise InvalidArgumentType(f"from_dlpack: {type(obj).__name__} has no __dlpack__")
    handle = stream_handle(stream)  # InvalidArgumentType before anything is asked of obj
    device = open_device() if device is None else device
    backend = _backend(device)
    if backend == "hip" and handle in (1, 2):
        # DLPack's 1 (legacy default) and 2 (per-thread default) are CUDA's; a ROCm
        # producer would take them as a stream handle (torch: ExternalStream(1)).
        raise InvalidArgument(f"from_dlpack(stream={handle}): {handle} is CUDA's "
                              f"{'legacy' if handle == 1 else 'per-thread'} default stream, "
                              f"not a HIP stream (DLPack: ROCm takes 0 for its default "
                              f"stream, 1 and 2 are not supported); pass None or 0 (the "
                              f"default stream), a pagedkv Stream or a stream handle")
    accepted = DLPACK_DEVICE_TYPES[backend]["import"]
    dev_type = None
    if hasattr(obj, "__dlpack_device__"):
        where = obj.__dlpack_device__()
        try:
            dev_type, dev_id = (int(v) for v in where)
        except (TypeError, ValueError):
            raise InvalidArgument(f"from_dlpack: {type(obj).__name__}.__dlpack_device__() "
                                  f"returned {where!r}, not (device_type, device_id)") from None
        if dev_type not in accepted or dev_id != device.ordinal:
            raise InvalidArgument(f"from_dlpack: the {type(obj).__name__} lives on DLPack "
                                  f"device ({dev_type}, {dev_id}); this {backend} device takes "
                                  f"types {accepted} and ordinal {device.ordinal}: move it first")
    # The array API: host memory takes no stream; device memory is ordered before ours.
    consumer = None if dev_type in (None, KDL_CPU) else \
        _DEFAULT_STREAM[backend] if handle is None else handle
    try:
        capsule = obj.__dlpack__(stream=consumer, max_version=(1, 0))
    except TypeError:  # a producer from before DLPack 1.0 (no max_version)
        capsule = obj.__dlpack__(stream=consumer)
    tensor = import_capsule(capsule)
    # The capsule's own device, also when __dlpack_device__ agreed (or was absent): an id
    # of another GPU would be read through this device's address space.
    if tensor.device[0] not in accepted or tensor.device[1] != device.ordinal:
        raise InvalidArgument(f"from_dlpack: the capsule's DLPack device {tensor.device} is "
                              f"not this {backend} device (types {accepted}, ordinal "
                              f"{device.ordinal}): move the tensor to it first")
    dtype = _np_dtype(tensor.dtype)
    _check_c_contiguous(tensor.shape, tensor.strides, dtype.itemsize, in_bytes=False,
                        what="from_dlpack")
    _check_aligned(tensor.data, dtype, "from_dlpack")
    return DeviceArray(device, tensor.data, tensor.shape, dtype, owned=False, base=tensor,
                       readonly=tensor.read_only)


def from_cuda_array_interface(obj, device: Device | None = None, *,
                              stream=None) -> DeviceArray:
    """A non-owning DeviceArray over ``obj.__cuda_array_interface__`` (v2/v3, C-contiguous;
    ``obj`` is kept as the base). ``stream``: the stream the memory will be used on (as
    :func:`from_dlpack`'s; default the legacy default stream). The producer's ``stream``
    entry (v3) is waited for there: the legacy default stream synchronizes with a producer
    stream other than the default ones; another consumer stream waits (an event, no host
    wait) for the producer's stream, the default ones included."""
    from pagedkv.kernels.device import open_device, stream_handle
    from pagedkv.kernels.device_array import DeviceArray
    consumer = stream_handle(stream)  # InvalidArgumentType before anything is asked of obj
    cai = obj.__cuda_array_interface__
    device = open_device() if device is None else device
    try:
        ptr, read_only = cai["data"]
        ptr = int(ptr or 0)
        shape = tuple(int(s) for s in cai["shape"])
        dtype = np.dtype(cai["typestr"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"__cuda_array_interface__ of {type(obj).__name__} is "
                              f"malformed ({exc})") from None
    if dtype.kind not in "biuf" or not dtype.isnative or dtype.itemsize > 8:
        raise InvalidArgument(f"__cuda_array_interface__: typestr {cai['typestr']!r} ({dtype}) "
                              "is not a native bool, int, uint or float of at most 8 bytes, "
                              "the types pagedkv takes (bfloat16 as '<u2' bits)")
    if cai.get("mask") is not None:
        raise InvalidArgument("__cuda_array_interface__: masked arrays are not taken")
    _check_c_contiguous(shape, cai.get("strides"), dtype.itemsize, in_bytes=True,
                        what="__cuda_array_interface__")
    _check_aligned(ptr, dtype, "__cuda_array_interface__")
    stream = cai.get("stream")
    if stream is not None and not is_int(stream):
        raise InvalidArgument(f"__cuda_array_interface__: stream {stream!r} is not an int "
                              "handle")
    if stream is not None:
        _wait_producer_stream(device, int(stream), consumer)
    return DeviceArray(device, ptr, shape, dtype, owned=False, base=obj,
                       readonly=bool(read_only))


def _wait_producer_stream(device: Device, producer: int, consumer: int | None) -> None:
    """Order the interface producer's ``stream`` entry (1 the legacy default stream, 2 the
    per-thread default stream, else a handle) before the ``consumer`` stream (``None``: the
    legacy default stream)."""
    if consumer is None:
        if producer not in (1, 2):  # the default streams are ordered before it already
            device.call("stream_synchronize", producer)
        return
    # the runtime's handle of the producer's stream: the legacy default is the null stream
    # on both runtimes, the per-thread one handle 2 (CU_STREAM_PER_THREAD, hipStreamPerThread)
    handle = None if producer in (0, 1) else producer
    if handle == consumer:
        return
    _stream_waits_for(device, consumer, handle)


def as_device_array(obj, device: Device | None = None, *, name: str = "array") -> DeviceArray:
    """``obj`` if it is a DeviceArray (of ``device``), else a zero-copy DeviceArray over a
    DLPack or CUDA-array-interface buffer. ``InvalidArgumentType`` for host data."""
    from pagedkv.kernels.device_array import DeviceArray
    if isinstance(obj, DeviceArray):
        arr = obj
    elif is_device_buffer(obj):
        arr = (from_dlpack(obj, device) if hasattr(obj, "__dlpack__")
               else from_cuda_array_interface(obj, device))
    else:
        raise InvalidArgumentType(f"{name}: expected a DeviceArray or a device tensor "
                                  f"(DLPack / __cuda_array_interface__), got "
                                  f"{type(obj).__name__}")
    if device is not None and arr.device is not device:
        raise InvalidArgument(f"{name}: on {arr.device!r}, expected {device!r}")
    return arr

"""A GPU device: memory, copies, kernel launches, streams, events and graphs.

``open_device()`` loads a runtime (:mod:`pagedkv.kernels.runtime`), makes a device
current and reads its properties. ``device.kernel(source, name, signature)`` loads
``source``'s code object once and returns a :class:`Kernel` whose calls pack the
arguments by ``signature``: one letter per parameter, ``p`` a device pointer (a
:class:`DeviceArray` or an int), ``i`` int32, ``q`` int64, ``f`` float32.

Programmatic Dependent Launch: a kernel looked up with ``dependent_launch=True`` (one that
calls ``pkv_grid_dependency_wait`` before touching what earlier launches wrote,
hip/pagedkv_compat.h) is launched with programmatic stream serialization where
:attr:`Device.dependent_launch` is on: NVIDIA sm_90 and newer with kernels built for sm_90+,
a CUDA 12.3+ driver (the attribute under graph capture), and ``PAGEDKV_PDL`` not ``0``.
Decided once when the device is opened.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import suppress
from ctypes import byref, c_float, c_int32, c_int64, c_size_t, c_uint64, c_void_p
from typing import Any, TypeAlias

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.env_knobs import env_bool
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.kernels.code_objects import read_object
from pagedkv.kernels.device_array import DeviceArray
from pagedkv.kernels.runtime import TENSOR_MAP_BYTES, DeviceProperties, Runtime, load_runtime

#: AMD arches with MFMA matrix cores that the .hip kernels use (hip/pagedkv_compat.h,
#: PKV_MFMA_I8: int8 and f16 16x16 MFMAs, wavefronts of 64). Compile-checked and emulated
#: only: no AMD GPU has run them (docs/kernels.md, "AMD matrix cores").
MFMA_ARCHES = ("gfx908", "gfx90a", "gfx940", "gfx941", "gfx942")
#: Those of them with the k-16 bf16 MFMA (v_mfma_f32_16x16x16bf16_1k, PKV_MFMA_BF16_1K): the
#: bf16 attention kernels on matrix cores exist only there (gfx908 has the k-8 one only).
MFMA_BF16_ARCHES = ("gfx90a", "gfx940", "gfx941", "gfx942")
#: RDNA3 / RDNA3.5 arches whose WMMA (v_wmma_i32_16x16x16_iu8, wave32) the int8 GEMV uses
#: (PKV_WMMA_I8). Compiled for gfx1100 with hip/gfx11_codegen.py and emulated only: no AMD GPU
#: has run them; a device needs a code object built for its own arch name. The known names;
#: :func:`amd_matrix_unit` takes every ``gfx11…`` arch as WMMA, as the kernels' macro does
#: (``__GFX11__``, hip/pagedkv_compat.h).
WMMA_ARCHES = ("gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150", "gfx1151", "gfx1152",
               "gfx1153")


def amd_matrix_unit(device: object) -> str | None:
    """``"mfma"`` (CDNA) or ``"wmma"`` (RDNA3): the AMD matrix cores the .hip kernels use on
    ``device``; None on NVIDIA, on AMD arches without them (or without kernels for them:
    RDNA2, RDNA4) and on host stand-ins. The kernels' opt-in variables are per unit
    (``PAGEDKV_GEMV_MFMA``, ``PAGEDKV_ATTN_WMMA``, ...)."""
    if getattr(device, "backend", None) != "hip":
        return None
    arch = getattr(device.properties, "arch", None)  # type: ignore[attr-defined]
    if arch in MFMA_ARCHES:
        return "mfma"
    # every gfx11 object holds the WMMA kernels (PKV_WMMA_I8 is defined under __GFX11__): an
    # arch left out here would run the quantized-KV _mma kernels' WMMA passes without the
    # opt-in and reserve shared memory for partials they keep in static memory
    if arch in WMMA_ARCHES or (isinstance(arch, str) and arch.startswith("gfx11")):
        return "wmma"
    return None

__all__ = ["PDL_ENV", "Device", "Event", "Graph", "Kernel", "Stream", "StreamLike",
           "dependent_launch_supported", "open_device", "stream_handle"]

#: Environment variable: ``0`` launches every kernel plainly (no Programmatic Dependent
#: Launch), e.g. to measure what it gains.
PDL_ENV = "PAGEDKV_PDL"
#: Oldest CUDA driver whose stream capture keeps the programmatic launch attribute.
PDL_MIN_DRIVER = 12030


def sm_version(arch: str) -> int:
    """The compute capability of an NVIDIA arch name as a number ("sm_90" -> 90); 0 for
    anything else (an AMD "gfx90a", an empty name)."""
    return int(arch[3:]) if arch.startswith("sm_") and arch[3:].isdigit() else 0


def dependent_launch_supported(backend: str, arch: str, driver_version: int,
                               cuda_targets) -> bool:
    """Whether kernels may be launched with programmatic stream serialization: CUDA, a
    device of compute capability 9.0 or newer, a driver of CUDA 12.3 or newer, and kernels
    built for an arch from sm_90 up to the device's (their code then holds the
    ``griddepcontrol.wait`` that makes the early start safe; sm_80 code has none)."""
    device = sm_version(arch)
    return (backend == "cuda" and device >= 90 and driver_version >= PDL_MIN_DRIVER
            and any(90 <= sm_version(t) <= device for t in cuda_targets))

#: What a ``stream=`` argument takes: a :class:`Stream`, a raw runtime handle (an ``int``:
#: ``torch.cuda.Stream().cuda_stream``, CuPy's ``stream.ptr``), an object with a
#: ``cuda_stream`` (torch) or ``ptr`` (CuPy) attribute, or ``None`` (the default stream).
StreamLike: TypeAlias = Any


def stream_handle(stream: StreamLike) -> int | None:
    """The runtime handle of a ``stream=`` argument (``None``: the legacy default stream)."""
    if stream is None or isinstance(stream, Stream):
        return None if stream is None else stream.handle
    if is_int(stream):
        return int(stream) or None
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if is_int(value):
            return int(value) or None
    raise InvalidArgumentType(f"stream: expected a pagedkv Stream, an integer stream handle or "
                              f"a torch/CuPy stream, got {type(stream).__name__}")

_PACKERS: dict[str, Any] = {"p": c_uint64, "i": c_int32, "q": c_int64, "f": c_float,
                            "m": ctypes.c_uint8 * TENSOR_MAP_BYTES}


class Kernel:
    """One ``extern "C"`` kernel of a loaded module, with its parameter types."""

    def __init__(self, device: Device, name: str, handle: int, signature: str,
                 dependent_launch: bool = False) -> None:
        bad = set(signature) - set(_PACKERS)
        if bad:
            raise InvalidArgument(f"signature={signature!r}: unknown type codes {sorted(bad)}; "
                                  f"use p (pointer), i (int32), q (int64), f (float32), "
                                  f"m (a {TENSOR_MAP_BYTES}-byte tensor map by value)")
        self.device = device
        self.name = name
        self.handle = handle
        self.signature = signature
        # the kernel waits for the previous grid itself: it may be launched early (PDL)
        self.dependent_launch = dependent_launch

    def __repr__(self) -> str:
        return f"Kernel({self.name!r}, signature={self.signature!r})"

    def reserve_shared(self, nbytes: int) -> None:
        """Let launches of this kernel take ``nbytes`` of dynamic shared memory (CUDA:
        ``cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)``, needed above 48 KiB). Raises
        :class:`InvalidArgument` naming the device's opt-in limit when ``nbytes`` exceeds it;
        HIP has no opt-in: there ``nbytes`` must fit the per-block limit as it is."""
        props = self.device.properties
        limit = max(props.max_shared_memory_per_block_optin_bytes,
                    props.max_shared_memory_per_block_bytes)
        if not 0 <= nbytes <= limit:
            raise InvalidArgument(
                f"{self.name}: {nbytes} bytes of shared memory per block, {props.name} "
                f"({props.arch}) allows at most {limit}; pick a configuration that needs less "
                f"(fewer pipeline stages or warps)")
        if self.device.backend == "cuda" and nbytes > props.max_shared_memory_per_block_bytes:
            from pagedkv.kernels.runtime import FUNC_MAX_DYNAMIC_SHARED_BYTES
            self.device.make_current()
            self.device.call("func_set_attribute", self.handle, FUNC_MAX_DYNAMIC_SHARED_BYTES,
                             nbytes)

    def pack(self, args) -> tuple[list[ctypes._SimpleCData], ctypes.Array]:
        """ctypes values for ``args`` and the ``void*[]`` the launch takes (keep both alive)."""
        if len(args) != len(self.signature):
            raise InvalidArgument(f"{self.name}: {len(args)} arguments given, the kernel takes "
                                  f"{len(self.signature)} ({self.signature})")
        values: list[ctypes._SimpleCData] = []
        for i, (code, arg) in enumerate(zip(self.signature, args)):
            if code == "p":
                arg = arg.live_ptr() if isinstance(arg, DeviceArray) else arg
                if not isinstance(arg, (int, np.integer)):
                    raise InvalidArgumentType(f"{self.name}: argument {i} must be a device "
                                              f"pointer, got {type(arg).__name__}")
            elif code in "iq" and not isinstance(arg, (int, np.integer)):
                raise InvalidArgumentType(f"{self.name}: argument {i} must be an integer, "
                                          f"got {type(arg).__name__}")
            elif code == "m":
                if not isinstance(arg, (bytes, bytearray)) or len(arg) != TENSOR_MAP_BYTES:
                    raise InvalidArgumentType(f"{self.name}: argument {i} must be a "
                                              f"{TENSOR_MAP_BYTES}-byte tensor map "
                                              f"(Device.tensor_map_2d)")
                values.append(_PACKERS[code].from_buffer_copy(arg))
                continue
            values.append(_PACKERS[code](arg))
        params = (c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
        return values, params

    def __call__(self, grid, block, *args, shared_bytes: int = 0, stream: StreamLike = None):
        handle = stream_handle(stream)
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        if min(grid) < 1 or min(block) < 1:
            raise InvalidArgument(f"{self.name}: grid {grid} and block {block} must be >= 1")
        _values, params = self.pack(args)
        if self.dependent_launch and self.device.dependent_launch:
            self.device.make_current()
            self.device.runtime.launch_dependent(self.handle, grid, block, shared_bytes, handle,
                                                 params)
            return
        self.device.call("launch_kernel", self.handle, *grid, *block, shared_bytes,
                                 handle, params, None)


class Stream:
    def __init__(self, device: Device) -> None:
        self.device = device
        h = c_void_p()
        device.call("stream_create", byref(h), 1)  # non-blocking w.r.t. stream 0
        self.handle = h.value

    def synchronize(self) -> None:
        self.device.call("stream_synchronize", self.handle)

    def __repr__(self) -> str:
        return f"Stream(handle=0x{self.handle or 0:x}, device={self.device.ordinal})"

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown: the runtime may already be gone
            self.device.call("stream_destroy", self.handle)


class Event:
    """A timing event: ``start.record(); …; end.record(); end.elapsed_ms(start)``."""

    def __init__(self, device: Device) -> None:
        self.device = device
        h = c_void_p()
        device.call("event_create", byref(h), 0)
        self.handle = h.value

    def __repr__(self) -> str:
        return f"Event(handle=0x{self.handle or 0:x}, device={self.device.ordinal})"

    def record(self, stream: StreamLike = None) -> None:
        self.device.call("event_record", self.handle, stream_handle(stream))

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (waits for this one)."""
        self.device.call("event_synchronize", self.handle)
        out = c_float(0.0)
        self.device.call("event_elapsed_time", byref(out), start.handle, self.handle)
        return out.value

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown: the runtime may already be gone
            self.device.call("event_destroy", self.handle)


class Graph:
    """Launches captured on a stream, replayed with one call (``launch``): removes the
    per-launch host cost from benchmarks of short kernels."""

    def __init__(self, device: Device, stream: Stream, capture) -> None:
        self.device = device
        # Relaxed mode: lazy module loads inside a capture stay legal.
        device.call("stream_begin_capture", stream.handle, 2)
        try:
            capture(stream)
        finally:
            graph = c_void_p()
            device.call("stream_end_capture", stream.handle, byref(graph))
        self._graph = graph.value
        exe = c_void_p()
        device.call("graph_instantiate", byref(exe), self._graph, 0)
        self._exec = exe.value

    def launch(self, stream: Stream) -> None:
        self.device.call("graph_launch", self._exec, stream.handle)

    @property
    def num_nodes(self) -> int:
        """Nodes of the captured graph (kernel launches and copies)."""
        n = c_size_t()
        self.device.call("graph_get_nodes", self._graph, None, byref(n))
        return n.value

    def __repr__(self) -> str:
        return f"Graph(exec=0x{self._exec or 0:x}, device={self.device.ordinal})"

    def __del__(self) -> None:
        with suppress(Exception):  # interpreter shutdown: the runtime may already be gone
            self.device.call("graph_exec_destroy", self._exec)
            self.device.call("graph_destroy", self._graph)


class Device:
    """A device made current on the calling thread."""

    def __init__(self, runtime: Runtime, ordinal: int = 0) -> None:
        count = runtime.device_count()
        if not 0 <= ordinal < count:
            raise InvalidArgument(f"ordinal={ordinal}: the {runtime.backend} runtime has "
                                  f"{count} device(s), valid 0..{count - 1}")
        self.runtime = runtime
        self.ordinal = ordinal
        self._dev = runtime.activate(ordinal)
        # The CUDA driver keeps the current context per thread: a thread that first uses
        # this device (a cold-tier or engine worker, a finalizer) makes it current once.
        self._thread = threading.local()
        self._thread.active = True
        self.properties: DeviceProperties = runtime.properties(ordinal, self._dev)
        self._modules: dict[str, int] = {}
        self._kernels: dict[tuple[str, str, bool], Kernel] = {}
        from pagedkv._build_config import CUDA_TARGETS
        #: Whether kernels looked up with ``dependent_launch=True`` launch with
        #: Programmatic Dependent Launch (module docstring).
        self.dependent_launch = bool(env_bool(PDL_ENV, True)) and dependent_launch_supported(
            runtime.backend, self.properties.arch,
            runtime.driver_version() if runtime.backend == "cuda" else 0, CUDA_TARGETS)

    def __repr__(self) -> str:
        p = self.properties
        return (f"Device({self.runtime.backend}:{self.ordinal} {p.name!r}, arch={p.arch}, "
                f"{p.multiprocessor_count} SMs/CUs, {p.total_memory_bytes / 2**30:.1f} GiB)")

    @property
    def backend(self) -> str:
        return self.runtime.backend

    def call(self, name: str, *args) -> None:
        """``runtime.call`` with this device current on the calling thread."""
        self.make_current()
        self.runtime.call(name, *args)

    def make_current(self) -> None:
        """Make this device current on the calling thread (once per thread)."""
        if not getattr(self._thread, "active", False):
            self.runtime.activate(self.ordinal)
            self._thread.active = True

    def tensor_map_2d(self, ptr: int, row_bytes: int, rows: int, row_stride_bytes: int,
                      box_bytes: int, box_rows: int) -> bytes:
        """A TMA tensor map (CUDA, sm_90) of the bytes at ``ptr`` seen as ``rows`` rows of
        ``row_bytes`` bytes, ``row_stride_bytes`` apart, copied in boxes of ``box_rows`` x
        ``box_bytes`` (reads past the array fill zeros): the 128 bytes a kernel takes by
        value (signature code ``m``). ``cuTensorMapEncodeTiled`` with uint8 elements, no
        interleave or swizzle, L2 promotion of 256 bytes. Raises :class:`DeviceError` where the
        driver refuses it (alignment: ``ptr`` and ``row_stride_bytes`` multiples of 16,
        ``box_bytes`` a multiple of 16, each box side at most 256)."""
        out = (ctypes.c_uint8 * TENSOR_MAP_BYTES)()
        dims = (c_uint64 * 2)(row_bytes, rows)
        strides = (c_uint64 * 1)(row_stride_bytes)
        box = (ctypes.c_uint * 2)(box_bytes, box_rows)
        elem = (ctypes.c_uint * 2)(1, 1)
        # CU_TENSOR_MAP_DATA_TYPE_UINT8, INTERLEAVE_NONE, SWIZZLE_NONE, L2_PROMOTION_L2_256B,
        # FLOAT_OOB_FILL_NONE (zeros)
        self.runtime.call("tensor_map_encode_tiled", ctypes.addressof(out), 0, 2, ptr, dims,
                          strides, box, elem, 0, 0, 3, 0)
        return bytes(out)

    # --- memory -----------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        ptr = c_uint64(0)
        self.call("malloc", byref(ptr), max(1, int(nbytes)))
        return ptr.value

    def free(self, ptr: int) -> None:
        self.call("free", ptr)

    def free_memory_bytes(self) -> int:
        """Device memory free now (the runtime's ``MemGetInfo``): pass the bound method as
        ``available_memory_bytes`` to ``pagedkv.sizing.create_pool`` to clamp a device pool's
        maximum to what the GPU has left."""
        free, total = c_size_t(0), c_size_t(0)
        self.call("mem_get_info", byref(free), byref(total))
        return free.value

    def copy_htod(self, dst: int, host: np.ndarray) -> None:
        if not host.flags.c_contiguous:
            raise InvalidArgument("host: must be C-contiguous")
        if host.nbytes:
            self.call("memcpy_htod", dst, host.ctypes.data, host.nbytes)

    def copy_dtoh(self, host: np.ndarray, src: int) -> None:
        if not (host.flags.c_contiguous and host.flags.writeable):
            raise InvalidArgument("host: must be C-contiguous and writeable")
        if host.nbytes:
            self.call("memcpy_dtoh", host.ctypes.data, src, host.nbytes)

    def copy_dtod(self, dst: int, src: int, nbytes: int, stream: StreamLike = None) -> None:
        if nbytes:
            self.call("memcpy_dtod_async", dst, src, nbytes, stream_handle(stream))

    def memset(self, ptr: int, value: int, nbytes: int) -> None:
        if nbytes:
            self.call("memset_d8", ptr, value & 0xFF, nbytes)

    def synchronize(self) -> None:
        self.call("synchronize")

    def array(self, host: np.ndarray) -> DeviceArray:
        return DeviceArray.from_numpy(self, host)

    def empty(self, shape, dtype) -> DeviceArray:
        return DeviceArray.empty(self, shape, dtype)

    # --- kernels ----------------------------------------------------------------------

    def _load_image(self, image: bytes) -> int:
        buf = ctypes.create_string_buffer(image, len(image))
        mod = c_void_p()
        self.call("module_load_data", byref(mod), buf)
        assert mod.value is not None, "a successful module load returns a non-NULL handle"
        return mod.value

    def module(self, source: str) -> int:
        """The loaded module of ``source`` (``"weights"``, ``"kvcache"``, ``"bench"``): the
        installed code object for this device, loaded on first use."""
        handle = self._modules.get(source)
        if handle is None:
            image = read_object(source, self.backend, self.properties.arch)
            handle = self._modules[source] = self._load_image(image)
        return handle

    def load_module(self, source: str, image: bytes) -> None:
        """Serve ``source``'s kernels from ``image`` (a code object or fatbin/cubin for this
        device, e.g. the same source rebuilt with other ``-D`` tuning values) instead of the
        installed object; kernels looked up from now on come from it. An image the runtime
        refuses raises :class:`DeviceError` and leaves the current module in place."""
        if not isinstance(image, (bytes, bytearray)) or not image:
            raise InvalidArgumentType(f"image: expected non-empty bytes, got "
                                      f"{type(image).__name__}")
        handle = self._load_image(bytes(image))
        self._modules[source] = handle
        for key in [k for k in self._kernels if k[0] == source]:
            del self._kernels[key]

    def kernel(self, source: str, name: str, signature: str, *,
               dependent_launch: bool = False) -> Kernel:
        """``dependent_launch``: the kernel calls ``pkv_grid_dependency_wait`` before it
        touches anything earlier launches touch, so it may start early (module docstring)."""
        key = (source, name, dependent_launch)
        k = self._kernels.get(key)
        if k is None:
            fn = c_void_p()
            self.call("module_get_function", byref(fn), self.module(source),
                              name.encode())
            assert fn.value is not None, "a found function has a non-NULL handle"
            k = self._kernels[key] = Kernel(self, name, fn.value, signature, dependent_launch)
        return k


_default: Device | None = None


def open_device(ordinal: int = 0, backend: str | None = None) -> Device:
    """The device ``ordinal`` of the first working runtime (see ``load_runtime``); the
    default device (0, any backend) is opened once and shared."""
    global _default
    if ordinal == 0 and backend is None:
        if _default is None:
            _default = Device(load_runtime(None), 0)
        return _default
    return Device(load_runtime(backend), ordinal)

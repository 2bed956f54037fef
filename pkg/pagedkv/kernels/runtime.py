"""ctypes bindings to the GPU runtimes: the CUDA driver (``libcuda``) and HIP (``libamdhip64``).

The two APIs are the same shape (module load from bytes, function lookup, a
12-argument launch, plain device pointers), so one :class:`Runtime` drives both
from a table of symbol names. Every failing call raises
:class:`pagedkv.errors.DeviceError` carrying the runtime's own error name and
message; a missing library, a failed initialisation or zero devices raise
:class:`pagedkv.errors.NoDeviceError` with one line saying which.

Programmatic Dependent Launch (CUDA, sm_90+): :meth:`Runtime.launch_dependent` launches
through ``cuLaunchKernelEx`` with the programmatic-stream-serialization attribute, so the
kernel may start before the previous one of its stream ends (it must wait for it itself:
``pkv_grid_dependency_wait`` in hip/pagedkv_compat.h).

Library lookup: ``PAGEDKV_CUDA_LIBRARY`` / ``PAGEDKV_HIP_LIBRARY`` (a path) first,
then the usual sonames. ``PAGEDKV_GPU_BACKEND`` (``cuda`` or ``hip``) picks one
vendor; by default CUDA is tried, then HIP.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import DeviceError, InvalidArgument, NoDeviceError

__all__ = ["BACKENDS", "FUNC_MAX_DYNAMIC_SHARED_BYTES", "DeviceProperties", "Runtime",
           "load_runtime"]

BACKENDS = ("cuda", "hip")

_ptr = c_uint64  # CUdeviceptr / hipDeviceptr_t: 64-bit on every supported platform
_handle = c_void_p  # modules, functions, streams, events, contexts



class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an enum id padded to 8 bytes, then a 64-byte value union."""
    _fields_ = [("id", c_int), ("pad", c_int), ("value", c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h, CUDA 12+): 56 bytes, checked in tests/test_kernels_pdl.py."""
    _fields_ = [("grid", c_uint * 3), ("block", c_uint * 3), ("shared_bytes", c_uint),
                ("stream", _handle), ("attrs", POINTER(_LaunchAttribute)), ("num_attrs", c_uint)]


#: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION with the value 1 (allowed).
_PROGRAMMATIC_SERIALIZATION = _LaunchAttribute(6, 0, (c_int * 16)(1))

# logical name -> (CUDA symbol, HIP symbol, argtypes); None where a vendor has no such call.
_API: dict[str, tuple[str | None, str | None, list[Any]]] = {
    "init": ("cuInit", "hipInit", [c_uint]),
    "driver_version": ("cuDriverGetVersion", "hipDriverGetVersion", [POINTER(c_int)]),
    "device_count": ("cuDeviceGetCount", "hipGetDeviceCount", [POINTER(c_int)]),
    "device_get": ("cuDeviceGet", None, [POINTER(c_int), c_int]),
    "device_name": ("cuDeviceGetName", "hipDeviceGetName", [c_char_p, c_int, c_int]),
    "device_attribute": ("cuDeviceGetAttribute", "hipDeviceGetAttribute",
                         [POINTER(c_int), c_int, c_int]),
    "device_total_mem": ("cuDeviceTotalMem_v2", "hipDeviceTotalMem", [POINTER(c_size_t), c_int]),
    "primary_ctx_retain": ("cuDevicePrimaryCtxRetain", None, [POINTER(_handle), c_int]),
    "ctx_set_current": ("cuCtxSetCurrent", None, [_handle]),
    "set_device": (None, "hipSetDevice", [c_int]),
    "synchronize": ("cuCtxSynchronize", "hipDeviceSynchronize", []),
    "malloc": ("cuMemAlloc_v2", "hipMalloc", [POINTER(_ptr), c_size_t]),
    "free": ("cuMemFree_v2", "hipFree", [_ptr]),
    "memcpy_htod": ("cuMemcpyHtoD_v2", "hipMemcpyHtoD", [_ptr, c_void_p, c_size_t]),
    "memcpy_dtoh": ("cuMemcpyDtoH_v2", "hipMemcpyDtoH", [c_void_p, _ptr, c_size_t]),
    "memcpy_dtod": ("cuMemcpyDtoD_v2", "hipMemcpyDtoD", [_ptr, _ptr, c_size_t]),
    "memcpy_dtod_async": ("cuMemcpyDtoDAsync_v2", "hipMemcpyDtoDAsync",
                          [_ptr, _ptr, c_size_t, _handle]),
    "memset_d8": ("cuMemsetD8_v2", "hipMemsetD8", [_ptr, ctypes.c_ubyte, c_size_t]),
    "mem_get_info": ("cuMemGetInfo_v2", "hipMemGetInfo", [POINTER(c_size_t), POINTER(c_size_t)]),
    "module_load_data": ("cuModuleLoadData", "hipModuleLoadData", [POINTER(_handle), c_void_p]),
    "module_unload": ("cuModuleUnload", "hipModuleUnload", [_handle]),
    "module_get_function": ("cuModuleGetFunction", "hipModuleGetFunction",
                            [POINTER(_handle), _handle, c_char_p]),
    # a kernel's opt-in to more dynamic shared memory than the default 48 KiB (CUDA only:
    # AMD has no such opt-in, a workgroup's LDS limit is the device attribute)
    "func_set_attribute": ("cuFuncSetAttribute", None, [_handle, c_int, c_int]),
    "launch_kernel": ("cuLaunchKernel", "hipModuleLaunchKernel",
                      [_handle, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, _handle,
                       POINTER(c_void_p), POINTER(c_void_p)]),
    "launch_kernel_ex": ("cuLaunchKernelEx", None,
                         [POINTER(_LaunchConfig), _handle, POINTER(c_void_p), POINTER(c_void_p)]),
    "stream_create": ("cuStreamCreate", "hipStreamCreateWithFlags", [POINTER(_handle), c_uint]),
    "stream_synchronize": ("cuStreamSynchronize", "hipStreamSynchronize", [_handle]),
    "stream_destroy": ("cuStreamDestroy_v2", "hipStreamDestroy", [_handle]),
    "event_create": ("cuEventCreate", "hipEventCreateWithFlags", [POINTER(_handle), c_uint]),
    "event_record": ("cuEventRecord", "hipEventRecord", [_handle, _handle]),
    "event_synchronize": ("cuEventSynchronize", "hipEventSynchronize", [_handle]),
    "event_elapsed_time": ("cuEventElapsedTime", "hipEventElapsedTime",
                           [POINTER(c_float), _handle, _handle]),
    "event_destroy": ("cuEventDestroy_v2", "hipEventDestroy", [_handle]),
    "stream_wait_event": ("cuStreamWaitEvent", "hipStreamWaitEvent", [_handle, _handle, c_uint]),
    # Graphs (benchmarks replay captured launch sequences).
    "stream_begin_capture": ("cuStreamBeginCapture_v2", "hipStreamBeginCapture", [_handle, c_int]),
    "stream_end_capture": ("cuStreamEndCapture", "hipStreamEndCapture",
                           [_handle, POINTER(_handle)]),
    "graph_instantiate": ("cuGraphInstantiateWithFlags", "hipGraphInstantiateWithFlags",
                          [POINTER(_handle), _handle, c_uint64]),
    "graph_launch": ("cuGraphLaunch", "hipGraphLaunch", [_handle, _handle]),
    "graph_exec_destroy": ("cuGraphExecDestroy", "hipGraphExecDestroy", [_handle]),
    "graph_destroy": ("cuGraphDestroy", "hipGraphDestroy", [_handle]),
    "graph_get_nodes": ("cuGraphGetNodes", "hipGraphGetNodes",
                        [_handle, c_void_p, POINTER(c_size_t)]),
    # A TMA tensor map (CUDA 12+, sm_90): a host-side encoding, no device call.
    "tensor_map_encode_tiled": ("cuTensorMapEncodeTiled", None,
                                [c_void_p, c_int, c_uint, c_void_p, POINTER(c_uint64),
                                 POINTER(c_uint64), POINTER(c_uint), POINTER(c_uint), c_int,
                                 c_int, c_int, c_int]),
}

#: A CUtensorMap's size in bytes (cuda.h: 64-byte aligned, 128 bytes).
TENSOR_MAP_BYTES = 128

# Device attribute ids (CUdevice_attribute, hipDeviceAttribute_t of ROCm >= 5).
_ATTRIBUTES = {
    "multiprocessor_count": (16, 63),
    "l2_cache_bytes": (38, 19),
    "warp_size": (10, 87),
    "compute_capability_major": (75, 23),
    "compute_capability_minor": (76, 61),
    "max_shared_memory_per_block_bytes": (8, 74),
    # what a kernel may opt in to (CUDA: 227 KiB on sm_90, 163 KiB on sm_80); read on CUDA
    # only (HIP names it "Cuda only" and has no opt-in: its per-block limit stands)
    "max_shared_memory_per_block_optin_bytes": (97, 75),
}

#: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h).
FUNC_MAX_DYNAMIC_SHARED_BYTES = 8

_SONAMES = {
    "cuda": ("libcuda.so.1", "libcuda.so", "libcuda.dylib"),
    "hip": ("libamdhip64.so", "libamdhip64.so.6", "libamdhip64.so.5"),
}
_LIBRARY_ENV = {"cuda": "PAGEDKV_CUDA_LIBRARY", "hip": "PAGEDKV_HIP_LIBRARY"}


class _HipDevicePropR0000(ctypes.Structure):
    """The head of ROCm 5's ``hipDeviceProp_t``, up to the arch name (``gcnArchName``, byte
    396). ROCm 6 moved the field (``hipDeviceProp_tR0600``, through
    ``hipGetDevicePropertiesR0600``, which its headers map ``hipGetDeviceProperties`` to) but
    kept this layout as ``hipDeviceProp_tR0000``: ``hipGetDevicePropertiesR0000`` fills it,
    and so does the plain ``hipGetDeviceProperties`` symbol, kept for the ABI. pagedkv calls
    the R0000 symbol where the library has it (ROCm 6 and later), else the plain one (ROCm
    5), so one offset holds on both. ``arch`` (``hipDeviceArch_t``) is 17 one-bit flags in
    one ``unsigned``."""
    _fields_ = [("name", ctypes.c_char * 256), ("totalGlobalMem", c_size_t),
                ("sharedMemPerBlock", c_size_t), ("regsPerBlock", c_int), ("warpSize", c_int),
                ("maxThreadsPerBlock", c_int), ("maxThreadsDim", c_int * 3),
                ("maxGridSize", c_int * 3), ("clockRate", c_int), ("memoryClockRate", c_int),
                ("memoryBusWidth", c_int), ("totalConstMem", c_size_t), ("major", c_int),
                ("minor", c_int), ("multiProcessorCount", c_int), ("l2CacheSize", c_int),
                ("maxThreadsPerMultiProcessor", c_int), ("computeMode", c_int),
                ("clockInstructionRate", c_int), ("arch", c_uint), ("concurrentKernels", c_int),
                ("pciDomainID", c_int), ("pciBusID", c_int), ("pciDeviceID", c_int),
                ("maxSharedMemoryPerMultiProcessor", c_size_t), ("isMultiGpuBoard", c_int),
                ("canMapHostMemory", c_int), ("gcnArch", c_int),
                ("gcnArchName", ctypes.c_char * 256)]


#: The buffer handed to hipGetDeviceProperties*: the whole R0000 struct is about 800 bytes;
#: a larger buffer costs nothing and survives a runtime that writes more.
_HIP_PROPS_BYTES = 8192


@dataclass(frozen=True)
class DeviceProperties:
    """What the kernels and benchmarks need to know about a device."""

    ordinal: int
    name: str
    arch: str  # "sm_90", "gfx90a"
    multiprocessor_count: int
    warp_size: int
    l2_cache_bytes: int
    total_memory_bytes: int
    max_shared_memory_per_block_bytes: int
    #: Shared bytes per block a kernel may opt in to (``Kernel.reserve_shared``).
    max_shared_memory_per_block_optin_bytes: int = 0


class Runtime:
    """One vendor's runtime library, with checked calls.

    ``call(name, *args)`` runs the logical API call ``name`` (see ``_API``) and raises
    :class:`DeviceError` on a non-zero status.
    """

    def __init__(self, backend: str, lib: ctypes.CDLL, path: str) -> None:
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend={backend!r}: expected one of {BACKENDS}")
        self.backend = backend
        self.path = path
        self._lib = lib
        self._index = BACKENDS.index(backend)
        self._fns: dict[str, Any] = {}  # ctypes function pointers (no public type)
        if backend == "cuda":
            self._err_name = lib.cuGetErrorName
            self._err_name.argtypes = [c_int, POINTER(c_char_p)]
            self._err_string = lib.cuGetErrorString
            self._err_string.argtypes = [c_int, POINTER(c_char_p)]
        else:
            self._err_name = lib.hipGetErrorName
            self._err_name.restype = c_char_p
            self._err_name.argtypes = [c_int]
            self._err_string = lib.hipGetErrorString
            self._err_string.restype = c_char_p
            self._err_string.argtypes = [c_int]

    def __repr__(self) -> str:
        return f"Runtime(backend={self.backend!r}, library={self.path!r})"

    def _symbol(self, name: str) -> str | None:
        """This backend's symbol for the logical call ``name`` (``None``: it has none)."""
        cuda, hip, _ = _API[name]
        return cuda if self.backend == "cuda" else hip

    def has(self, name: str) -> bool:
        symbol = self._symbol(name)
        return symbol is not None and hasattr(self._lib, symbol)

    def _fn(self, name: str):
        fn = self._fns.get(name)
        if fn is None:
            symbol = self._symbol(name)
            if symbol is None:
                raise InvalidArgument(f"{name!r} is not a {self.backend} runtime call")
            # CUDA 12.8+ headers map some calls to a _v2 symbol; older drivers export only
            # the plain one.
            fn = getattr(self._lib, symbol, None) or getattr(self._lib, symbol + "_v2")
            fn.argtypes = _API[name][2]
            fn.restype = c_int
            self._fns[name] = fn
        return fn

    def error_text(self, code: int) -> tuple[str, str]:
        """The runtime's own (name, message) for a status code."""
        if self.backend == "cuda":
            name, msg = c_char_p(), c_char_p()
            self._err_name(code, byref(name))
            self._err_string(code, byref(msg))
            name_b, msg_b = name.value, msg.value
        else:
            name_b, msg_b = self._err_name(code), self._err_string(code)
        return ((name_b or b"unknown error").decode(errors="replace"),
                (msg_b or b"").decode(errors="replace"))

    def call(self, name: str, *args) -> None:
        code = self._fn(name)(*args)
        if code != 0:
            err, msg = self.error_text(code)
            raise DeviceError(self._symbol(name) or name, code, err, msg)

    def launch_dependent(self, function: int, grid, block, shared_bytes: int,
                         stream: int | None, params) -> None:
        """``cuLaunchKernelEx`` of ``function`` (grid and block: 3 ints each) with
        programmatic stream serialization: it may start before the stream's previous
        kernel ends. CUDA only; the caller makes the device current."""
        config = _LaunchConfig((c_uint * 3)(*grid), (c_uint * 3)(*block), shared_bytes, stream,
                               ctypes.pointer(_PROGRAMMATIC_SERIALIZATION), 1)
        self.call("launch_kernel_ex", byref(config), function, params, None)

    def driver_version(self) -> int:
        """The driver's version number (CUDA: 1000 x major + 10 x minor, 12030 = 12.3)."""
        out = c_int(0)
        self.call("driver_version", byref(out))
        return out.value

    # --- devices -------------------------------------------------------------------

    def device_count(self) -> int:
        n = c_int(0)
        self.call("device_count", byref(n))
        return n.value

    def activate(self, ordinal: int) -> int:
        """Make ``ordinal`` current for this thread; returns the vendor's device handle."""
        if self.backend == "cuda":
            dev = c_int(0)
            self.call("device_get", byref(dev), ordinal)
            ctx = _handle()
            self.call("primary_ctx_retain", byref(ctx), dev.value)
            self.call("ctx_set_current", ctx)
            return dev.value
        self.call("set_device", ordinal)
        return ordinal

    def attribute(self, name: str, dev: int) -> int:
        out = c_int(0)
        self.call("device_attribute", byref(out), _ATTRIBUTES[name][self._index], dev)
        return out.value

    def properties(self, ordinal: int, dev: int) -> DeviceProperties:
        buf = ctypes.create_string_buffer(256)
        self.call("device_name", buf, len(buf), dev)
        total = c_size_t(0)
        self.call("device_total_mem", byref(total), dev)
        per_block = self.attribute("max_shared_memory_per_block_bytes", dev)
        if self.backend == "cuda":
            major = self.attribute("compute_capability_major", dev)
            minor = self.attribute("compute_capability_minor", dev)
            arch = f"sm_{major}{minor}"
            optin = self.attribute("max_shared_memory_per_block_optin_bytes", dev)
        else:
            arch = self._hip_arch(ordinal)
            optin = per_block
        return DeviceProperties(
            ordinal=ordinal,
            name=buf.value.decode(errors="replace"),
            arch=arch,
            multiprocessor_count=self.attribute("multiprocessor_count", dev),
            warp_size=self.attribute("warp_size", dev),
            l2_cache_bytes=self.attribute("l2_cache_bytes", dev),
            total_memory_bytes=total.value,
            max_shared_memory_per_block_bytes=per_block,
            max_shared_memory_per_block_optin_bytes=optin,
        )

    def _hip_arch(self, ordinal: int) -> str:
        """The device's arch ("gfx90a") from the ``gcnArchName`` field of its properties
        (:class:`_HipDevicePropR0000`), never from another field that happens to say
        "gfx" (the device name comes first)."""
        symbol = "hipGetDevicePropertiesR0000"
        fn = getattr(self._lib, symbol, None)
        if fn is None:
            symbol = "hipGetDeviceProperties"
            fn = getattr(self._lib, symbol)
        fn.argtypes, fn.restype = [c_void_p, c_int], c_int
        props = ctypes.create_string_buffer(_HIP_PROPS_BYTES)
        code = fn(props, ordinal)
        if code != 0:
            err, msg = self.error_text(code)
            raise DeviceError(symbol, code, err, msg)
        field = _HipDevicePropR0000.from_buffer(props).gcnArchName  # up to its NUL
        arch = field.decode(errors="replace").split(":")[0]  # "gfx90a:sramecc+:xnack-"
        if not arch.startswith("gfx"):
            raise DeviceError(
                symbol, 0, "no gcnArchName",
                f"hipDeviceProp_t.gcnArchName (byte {_HipDevicePropR0000.gcnArchName.offset} "
                f"of the ROCm 5 / R0000 layout) holds {field!r}, not a 'gfx...' arch name; "
                f"point PAGEDKV_HIP_LIBRARY at a ROCm 5 or later libamdhip64 ({self.path} "
                "filled it)")
        return arch


def _open_library(backend: str) -> tuple[ctypes.CDLL, str]:
    explicit = os.environ.get(_LIBRARY_ENV[backend])
    candidates = (explicit,) if explicit else _SONAMES[backend]
    errors = []
    for name in candidates:
        try:
            return ctypes.CDLL(name), name
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    where = f"{_LIBRARY_ENV[backend]}={explicit}" if explicit else ", ".join(candidates)
    raise NoDeviceError(f"no {backend} runtime library could be loaded ({where})")


def load_runtime(backend: str | None = None) -> Runtime:
    """Load and initialise a runtime with at least one device.

    ``backend`` (or ``PAGEDKV_GPU_BACKEND``): ``"cuda"``, ``"hip"`` or ``None`` for the
    first that works, CUDA first. Raises :class:`NoDeviceError` (one line per vendor
    tried) when none does.
    """
    backend = backend or os.environ.get("PAGEDKV_GPU_BACKEND") or None
    if backend is not None and backend not in BACKENDS:
        raise InvalidArgument(
            f"backend={backend!r} (or PAGEDKV_GPU_BACKEND): expected one of {BACKENDS}")
    reasons = []
    for name in (backend,) if backend else BACKENDS:
        try:
            lib, path = _open_library(name)
            rt = Runtime(name, lib, path)
            try:
                rt.call("init", 0)
            except DeviceError as exc:
                raise NoDeviceError(
                    f"{name} runtime {path} found but {exc.call} failed: "
                    f"{exc.name} ({exc.code})") from exc
            if rt.device_count() == 0:
                raise NoDeviceError(f"{name} runtime {path} found but it reports no device")
            return rt
        except NoDeviceError as exc:
            reasons.append(str(exc))
        except DeviceError as exc:
            reasons.append(f"{name}: {exc}")
    raise NoDeviceError("no GPU available: " + "; ".join(reasons))

"""GPU kernels: the ctypes HIP/CUDA loader, launchers and NumPy references.

``open_device()`` finds a runtime (the CUDA driver ``libcuda`` or HIP's
``libamdhip64``) and returns a :class:`Device`; without one it raises
:class:`pagedkv.errors.NoDeviceError` with a one-line reason. Kernel launchers
live in :mod:`pagedkv.kernels.kvcache` and :mod:`pagedkv.kernels.weights`;
their NumPy references in :mod:`pagedkv.kernels.numpy_kernels`. The same kernel set on
``mx.array``s (Metal, MLX's CUDA backend, MLX array ops) is :mod:`pagedkv.kernels.mlx`.
"""

from pagedkv.kernels.code_objects import list_objects
from pagedkv.kernels.device import Device, Event, Graph, Kernel, Stream, open_device
from pagedkv.kernels.device_array import DeviceArray
from pagedkv.kernels.runtime import DeviceProperties, Runtime, load_runtime

__all__ = [
    "Device",
    "DeviceArray",
    "DeviceProperties",
    "Event",
    "Graph",
    "Kernel",
    "Runtime",
    "Stream",
    "list_objects",
    "load_runtime",
    "open_device",
]

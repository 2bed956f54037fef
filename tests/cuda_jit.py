"""Compile pagedkv's MLX-CUDA kernels the way MLX does, without a GPU.

:func:`mlx_cuda_source` wraps a :class:`~pagedkv.kernels.mlx.launch.Launch` exactly as
MLX 0.32's ``cuda_kernel`` does (``mlx/backend/cuda/custom_kernel.cpp``, ``build_kernel``):
MLX's default header (``#include "mlx/backend/cuda/device/utils.cuh"``,
``<cooperative_groups.h>``), the kernel's header, then ``__global__ void
custom_kernel_<name>(const T* inputs..., T* outputs...)`` around the body in namespace
``mlx::core::cu``. :func:`nvcc_compile` builds that text with nvcc for sm_90a;
:func:`nvrtc_compile` with NVRTC itself and MLX's options
(``--device-as-default-execution-space``, ``--gpu-architecture=sm_90a``, include paths
for the headers, CCCL and the toolkit), when a libnvrtc is found (the
``nvidia-cuda-nvrtc`` wheel, or ``PAGEDKV_NVRTC_LIBRARY``). MLX's own utils.cuh is
replaced by tests/data/mlx_cuda_jit's stand-in.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pagedkv.kernels.mlx.cuda import CUDA_TYPES

ROOT = Path(__file__).resolve().parents[1]
MLX_STAND_IN = ROOT / "tests" / "data" / "mlx_cuda_jit"
DEFAULT_HEADER = ('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n'
                  "#include <cooperative_groups.h>\n\n")


def _dtype(dt) -> str:
    return CUDA_TYPES[str(dt).rpartition(".")[2]]


def mlx_cuda_source(launch) -> str:
    k = launch.kernel
    params = [f"    const {_dtype(a.dtype)}* {n}" for n, a in zip(k.input_names, launch.inputs,
                                                             strict=True)]
    params += [f"    {_dtype(d)}* {n}" for n, d in zip(k.output_names, launch.output_dtypes,
                                                   strict=True)]
    assert not launch.template, "pagedkv's CUDA kernels bake their constants into the source"
    return (DEFAULT_HEADER + k.header + "namespace mlx::core::cu {\n\n"
            "namespace cg = cooperative_groups;\n\n"
            f"__global__ void custom_kernel_{k.name}(\n" + ",\n".join(params) + ") {\n"
            + k.source + "\n}\n\n} // namespace mlx::core::cu\n")


def cuda_root() -> Path | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    real = Path(subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
                and nvcc).resolve()
    for root in (real.parents[1], Path("/usr/local/cuda")):
        if (root / "include" / "cuda_fp16.h").is_file():
            return root
    return None


def nvcc_compile(source: str, workdir: Path, name: str) -> subprocess.CompletedProcess:
    """``nvcc -cubin -arch=sm_90a`` of ``source`` (ptxas runs: registers, launch bounds)."""
    path = workdir / f"{name}.cu"
    path.write_text(source)
    return subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-I",
                           str(MLX_STAND_IN), "-Xptxas", "-v", str(path), "-o",
                           str(workdir / f"{name}.cubin")], capture_output=True, text=True, check=False)


def find_nvrtc() -> str | None:
    env = os.environ.get("PAGEDKV_NVRTC_LIBRARY")
    if env:
        return env
    for base in sys.path:
        hits = sorted(glob.glob(os.path.join(base, "nvidia", "cu13", "lib", "libnvrtc.so.*")))
        if hits:
            return hits[0]
    for name in ("libnvrtc.so.13", "libnvrtc.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            continue
    return None


def nvrtc_compile(lib_path: str, source: str, name: str) -> tuple[bool, str]:
    """(ok, log) of NVRTC compiling ``source`` with MLX's options for an sm_90 device."""
    for builtins in sorted(Path(lib_path).parent.glob("libnvrtc-builtins.so.*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)  # NVRTC dlopens it by name
        break
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0,
                                None, None)
    assert rc == 0, rc
    root = cuda_root() or Path("/usr/local/cuda")
    opts = ["--device-as-default-execution-space", "--gpu-architecture=sm_90a",
            f"--include-path={MLX_STAND_IN}", f"--include-path={root / 'include' / 'cccl'}",
            f"--include-path={root / 'include'}"]
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value + 1)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc == 0, log.value.decode(errors="replace")


def record_launches(fn) -> list:
    """The launches ``fn(run)`` makes, with zero outputs standing in for results."""
    import mlx.core as mx
    launches = []

    def record(launch):
        launches.append(launch)
        return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes, launch.output_dtypes,
                                                     strict=True)]
    fn(record)
    return launches

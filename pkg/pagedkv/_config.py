"""Build and runtime configuration: ``get_include()`` and ``show_config()``."""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
from pathlib import Path
from typing import Any

from pagedkv import _build_config as _bc


def get_include() -> str:
    """The folder that holds ``pagedkv/*.h``: native code adds it with ``-I`` and writes
    ``#include <pagedkv/quant.h>``."""
    pkg_dir = Path(__file__).resolve().parent
    installed = pkg_dir / "include"
    if (installed / "pagedkv").is_dir():
        return str(installed)
    # Editable install: the package is the source folder pkg/pagedkv and the headers
    # stay where they are written, in pkg/include.
    return str(pkg_dir.parent / "include")


def _mlx_status() -> str:
    # find_spec does not import mlx: `import pagedkv` must stay cheap and MLX-free.
    if importlib.util.find_spec("mlx") is None:
        return "not installed (backend='mlx' unavailable; NumPy backend used)"
    return "installed"


def _kernel_objects() -> list[str]:
    from pagedkv.kernels.code_objects import list_objects
    return list_objects()


def config() -> dict[str, Any]:
    """Everything :func:`show_config` prints, as a dict (stable keys, for tools and tests)."""
    backends = []
    if _bc.HIP_TARGETS:
        backends.append("hip")
    if _bc.CUDA_TARGETS:
        backends.append("cuda")
    if _bc.METAL_BUILT:
        backends.append("metal")
    return {
        "version": _bc.VERSION,
        "python": sys.version.split()[0],
        "platform": f"{platform.system()} {platform.machine()}",
        "build": {
            "buildtype": _bc.BUILDTYPE,
            "c_compiler": _bc.C_COMPILER,
            "cython": _bc.CYTHON_VERSION,
            "numpy_build": _bc.NUMPY_BUILD_VERSION,
        },
        "xxhash": ("system libxxhash " + _bc.SYSTEM_XXHASH_VERSION) if _bc.SYSTEM_XXHASH
        else "xxhash wheel (fallback: system libxxhash not found at build time)",
        "backends": backends,
        "hip_targets": list(_bc.HIP_TARGETS),
        "cuda_targets": list(_bc.CUDA_TARGETS),
        "metal": bool(_bc.METAL_BUILT),
        "kernel_objects": _kernel_objects(),
        "mlx": _mlx_status(),
        "include": get_include(),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("PAGEDKV_")},
    }


def show_config(file=None) -> None:
    """Print version, build options, which optional backends were built, and runtime facts."""
    c = config()
    out = file if file is not None else sys.stdout
    lines = [
        f"pagedkv {c['version']}  (Python {c['python']}, {c['platform']})",
        "build:",
        *(f"  {k}: {v}" for k, v in c["build"].items()),
        f"xxhash: {c['xxhash']}",
        f"backends built: {', '.join(c['backends']) or 'none (CPU only)'}",
        f"  hip targets: {', '.join(c['hip_targets']) or '-'}",
        f"  cuda targets: {', '.join(c['cuda_targets']) or '-'}",
        f"  metal: {'yes' if c['metal'] else 'no'}",
        f"  kernel objects: {', '.join(c['kernel_objects']) or '-'}",
        f"mlx: {c['mlx']}",
        f"include: {c['include']}",
    ]
    if c["env"]:
        lines.append("environment:")
        lines += [f"  {k}={v}" for k, v in c["env"].items()]
    print("\n".join(lines), file=out)

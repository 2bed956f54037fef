"""Run pagedkv's Metal kernels on the CPU: the text MLX's ``metal_kernel`` would compile,
built with clang++ against metal/shim (run mode) and tests/data/metal_emulator.h.

For a :class:`~pagedkv.kernels.mlx.launch.Launch`, :func:`mlx_metal_source` writes the
kernel exactly as MLX 0.32 does (``mlx/backend/common/metal_kernel.cpp``,
``write_signature``): the header, the template line, ``[[kernel]] void
custom_kernel_<name>_<template hash>_<dtype per input (s: 0-d, c: < 8 elements, passed in
the constant address space)>_<dtype per output>(...)`` with ``[[buffer(i)]]`` inputs,
outputs and the thread attributes the body names, then the body. The one difference:
MLX's explicit instantiation line (``template [[host_name(..)]] [[kernel]] decltype(..)``)
is not C++; the launcher instantiates the template instead.

:class:`MetalEmulator` compiles such sources (check mode: clang address spaces, so a
``constant`` input passed where ``device`` is expected fails as on a Mac; run mode: the
emulator), poisons every output (0xFF bytes) and runs the launch.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "metal" / "shim"
EMULATOR = ROOT / "tests" / "data"

# MLX's get_type_string (mlx/backend/common/compiled.cpp)
TYPE_NAMES = {"float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t",
              "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t",
              "int32": "int32_t", "int64": "int64_t"}
NP_TYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
            "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "int32": np.int32,
            "int64": np.int64}
MAX_CONSTANT_ARRAY_SIZE = 8
# MLX's metal_attributes, in its order, with how the emulator fills each.
ATTRIBUTES = {
    "grid_size": ("uint3", "pkv_u3(g[0], g[1], g[2])"),
    "simdgroup_index_in_threadgroup": ("uint", "th.simdgroup"),
    "simdgroups_per_threadgroup": ("uint", "th.simdgroups_per_group"),
    "thread_index_in_simdgroup": ("uint", "th.lane"),
    "thread_index_in_threadgroup": ("uint", "th.index_in_group"),
    "thread_position_in_grid": ("uint3", "pkv_u3(th.grid_pos.x, th.grid_pos.y, th.grid_pos.z)"),
    "thread_position_in_threadgroup": (
        "uint3", "pkv_u3(th.pos_in_group.x, th.pos_in_group.y, th.pos_in_group.z)"),
    "threadgroup_position_in_grid": (
        "uint3", "pkv_u3(th.group_pos.x, th.group_pos.y, th.group_pos.z)"),
    "threads_per_grid": ("uint3", "pkv_u3(g[0], g[1], g[2])"),
    "threads_per_simdgroup": ("uint", "th.threads_per_simdgroup"),
    "threads_per_threadgroup": ("uint3", "pkv_u3(t[0], t[1], t[2])"),
}


def dtype_name(dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _template_values(launch) -> list[str]:
    out = []
    for _, v in launch.template:
        if isinstance(v, bool):
            out.append("1" if v else "0")
        elif isinstance(v, int):
            out.append(str(v))
        else:
            out.append(TYPE_NAMES[dtype_name(v)])
    return out


def kernel_name(launch) -> str:
    """MLX's name for this instantiation."""
    name = "custom_kernel_" + launch.kernel.name
    if launch.template:
        template_def = "<" + ", ".join(_template_values(launch)) + ">"
        name += "_" + template_def.replace("<", "_").replace(">", "_").replace(", ", "_")[:-1]
    for arr in launch.inputs:
        name += "_" + TYPE_NAMES[dtype_name(arr.dtype)]
        if arr.ndim == 0:
            name += "s"
        elif arr.size < MAX_CONSTANT_ARRAY_SIZE:
            name += "c"
    for dt in launch.output_dtypes:
        name += "_" + TYPE_NAMES[dtype_name(dt)]
    return name


def _attributes(body: str) -> list[str]:
    return [a for a in ATTRIBUTES if a in body]


def mlx_metal_source(launch) -> str:
    """The kernel text MLX generates for ``launch`` (without the explicit instantiation)."""
    k = launch.kernel
    text = k.header
    if launch.template:
        params = []
        for name, v in launch.template:
            kind = "bool" if isinstance(v, bool) else "int" if isinstance(v, int) else "typename"
            params.append(f"{kind} {name}")
        text += "template <" + ", ".join(params) + ">\n"
    text += f"[[kernel]] void {kernel_name(launch)}(\n"
    lines = []
    for i, (name, arr) in enumerate(zip(k.input_names, launch.inputs, strict=True)):
        space = "constant" if arr.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if arr.ndim == 0 else "*"
        lines.append(f"  const {space} {TYPE_NAMES[dtype_name(arr.dtype)]}{ref} {name} "
                     f"[[buffer({i})]]")
    for j, (name, dt) in enumerate(zip(k.output_names, launch.output_dtypes, strict=True)):
        lines.append(f"  device {TYPE_NAMES[dtype_name(dt)]}* {name} "
                     f"[[buffer({len(k.input_names) + j})]]")
    for attr in _attributes(k.source):
        lines.append(f"  {ATTRIBUTES[attr][0]} {attr} [[{attr}]]")
    return text + ",\n".join(lines) + ") {\n" + k.source + "\n}\n"


def _launcher(launch, index: int) -> str:
    k = launch.kernel
    args = []
    for i, arr in enumerate(launch.inputs):
        t = TYPE_NAMES[dtype_name(arr.dtype)]
        args.append(f"*(const {t}*)b[{i}]" if arr.ndim == 0 else f"(const {t}*)b[{i}]")
    for j, dt in enumerate(launch.output_dtypes):
        args.append(f"({TYPE_NAMES[dtype_name(dt)]}*)b[{len(launch.inputs) + j}]")
    args += [ATTRIBUTES[a][1] for a in _attributes(k.source)]
    templ = "<" + ", ".join(_template_values(launch)) + ">" if launch.template else ""
    coop = "true" if k.cooperative else "false"
    return (f'extern "C" int pkv_launch_{index}(void** b, const unsigned* g, const unsigned* t) {{\n'
            f"  return pkv_emu::dispatch({{g[0], g[1], g[2]}}, {{t[0], t[1], t[2]}}, {coop},\n"
            f"      [&](const pkv_emu::Thread& th) {{ {kernel_name(launch)}{templ}("
            + ", ".join(args) + "); }) ? 0 : 1;\n}\n")


def clangxx() -> str | None:
    for name in ("clang++", "clang++-19", "clang++-18", "clang++-17", "clang++-16",
                 "clang++-15"):
        path = shutil.which(name)
        if path:
            return path
    return None


class MetalEmulator:
    """Compiles launches' MLX-generated sources and runs them; ``run`` is a Runner."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = Path(workdir)
        self.cxx = clangxx()
        self._built: dict[str, tuple[ctypes.CDLL, str]] = {}  # instance key -> (lib, symbol)
        self.launches: list = []

    @staticmethod
    def _key(launch) -> str:
        return mlx_metal_source(launch)

    def _compile(self, launches) -> None:
        todo = {}
        for launch in launches:
            key = self._key(launch)
            if key not in self._built and key not in todo:
                todo[key] = launch
        if not todo:
            return
        sources = [mlx_metal_source(launch) for launch in todo.values()]
        digest = hashlib.sha256("".join(sources).encode()).hexdigest()[:16]
        check = self.workdir / f"check_{digest}.cpp"
        check.write_text("".join(sources))
        base = [self.cxx, "-std=c++17", "-D__METAL_VERSION__=310", "-Wno-unknown-attributes",
                "-x", "c++", "-I", str(SHIM)]
        done = subprocess.run(base + ["-fsyntax-only", str(check)], capture_output=True,
                              text=True, check=False)
        if done.returncode:
            raise AssertionError(f"the MLX-generated Metal sources fail the address-space "
                                 f"check:\n{done.stderr[:6000]}")
        run_src = self.workdir / f"run_{digest}.cpp"
        run_src.write_text('#include "metal_emulator.h"\n#include "metal_stdlib"\n'
                           "static inline uint3 pkv_u3(unsigned a, unsigned b, unsigned c) {"
                           " uint3 v; v.x = a; v.y = b; v.z = c; return v; }\n"
                           + "".join(sources)
                           + "".join(_launcher(launch, i) for i, launch in enumerate(todo.values())))
        lib_path = self.workdir / f"lib_{digest}.so"
        done = subprocess.run(base + ["-DPKV_SHIM_RUN", "-I", str(EMULATOR), "-O1", "-fPIC",
                                      "-shared", "-pthread", str(run_src), "-o", str(lib_path)],
                              capture_output=True, text=True, check=False)
        if done.returncode:
            raise AssertionError(f"emulator build failed:\n{done.stderr[:6000]}")
        lib = ctypes.CDLL(str(lib_path))
        for i, key in enumerate(todo):
            self._built[key] = (lib, f"pkv_launch_{i}")

    def prepare(self, fn) -> None:
        """Record the launches ``fn(run)`` makes (with zero outputs), then build them all in
        one compile."""
        import mlx.core as mx
        recorded = []

        def record(launch):
            recorded.append(launch)
            return [mx.zeros(s, dtype=d) for s, d in zip(launch.output_shapes,
                                                         launch.output_dtypes, strict=True)]
        fn(record)
        self._compile(recorded)

    def run(self, launch):
        """Run ``launch`` on the CPU; outputs start as 0xFF bytes (NaN in f16/f32)."""
        import mlx.core as mx
        self._compile([launch])
        self.launches.append(launch)
        lib, symbol = self._built[self._key(launch)]
        buffers = []
        for arr in launch.inputs:
            name = dtype_name(arr.dtype)
            a = arr.view(mx.uint16) if name == "bfloat16" else arr
            buffers.append(np.ascontiguousarray(np.array(a)))
        outputs = []
        for shape, dt in zip(launch.output_shapes, launch.output_dtypes, strict=True):
            out = np.empty(shape, NP_TYPES[dtype_name(dt)])
            out.view(np.uint8)[...] = 0xFF
            outputs.append(out)
        ptrs = (ctypes.c_void_p * (len(buffers) + len(outputs)))(
            *[b.ctypes.data for b in buffers + outputs])
        grid = (ctypes.c_uint * 3)(*launch.grid)
        tg = (ctypes.c_uint * 3)(*launch.threadgroup)
        rc = getattr(lib, symbol)(ptrs, grid, tg)
        if rc:
            raise AssertionError(f"{launch}: a simdgroup or threadgroup did not meet at a "
                                 f"barrier (divergent SIMD function or barrier)")
        return [mx.array(o) for o in outputs]

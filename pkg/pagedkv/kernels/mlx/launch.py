"""What a custom MLX kernel is built from and launched with, for Metal and CUDA alike.

A :class:`KernelSource` is the text part (``mx.fast.metal_kernel`` /
``mx.fast.cuda_kernel`` arguments), built once per kernel configuration; a
:class:`Launch` adds one call's inputs, outputs, grid and template arguments. The
backend modules turn operations into launches and hand each to a *runner*
(``Launch -> list[mx.array]``): :func:`run_metal` and :func:`run_cuda` call MLX;
the tests pass an emulator (Metal on the CPU) or a recorder instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KernelSource", "Launch", "Runner", "poisoning", "run_cuda", "run_metal"]


@dataclass(frozen=True, slots=True)
class KernelSource:
    """One kernel as MLX compiles it.

    ``source`` is the body; ``header`` the text before the generated signature.
    ``cooperative``: the body uses SIMD functions or barriers (all threads of a
    threadgroup must run together). ``shared_memory``: CUDA dynamic shared memory in
    bytes, fixed per kernel object by ``mx.fast.cuda_kernel``.
    """

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str
    cooperative: bool = True
    shared_memory: int = 0

    def __repr__(self) -> str:
        return (f"KernelSource({self.name!r}, inputs={list(self.input_names)}, "
                f"outputs={list(self.output_names)}, header {len(self.header)} chars)")


@dataclass(slots=True)
class Launch:
    """One call of a kernel: ``grid`` and ``threadgroup`` in threads (MLX's convention for
    both backends), outputs as MLX allocates them (uninitialized: every element must be
    written)."""

    kernel: KernelSource
    inputs: list[Any]
    output_shapes: list[tuple[int, ...]]
    output_dtypes: list[Any]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: list[tuple[str, Any]] = field(default_factory=list)
    #: Fill the outputs with this before the kernel runs (tests poison them with NaN).
    init_value: float | None = None

    def __repr__(self) -> str:
        return (f"Launch({self.kernel.name!r}, grid={self.grid}, threadgroup={self.threadgroup}, "
                f"template={self.template}, outputs={self.output_shapes})")


Runner = Callable[[Launch], Sequence[Any]]


def poisoning(run: Runner) -> Runner:
    """``run`` with every output filled first (NaN for float outputs, 255 for integer
    ones; a launch with both kinds gets 255), so an element a kernel does not write
    shows up."""
    def poisoned(launch: Launch) -> Sequence[Any]:
        floats = all("float" in str(d) for d in launch.output_dtypes)
        launch.init_value = float("nan") if floats else 255.0
        return run(launch)
    return poisoned


@functools.cache
def _metal_kernel(src: KernelSource):
    import mlx.core as mx
    return mx.fast.metal_kernel(name=src.name, input_names=list(src.input_names),
                                output_names=list(src.output_names), source=src.source,
                                header=src.header, ensure_row_contiguous=True)


def run_metal(launch: Launch) -> Sequence[Any]:
    """Launch through ``mx.fast.metal_kernel`` (one compiled kernel object per source)."""
    kernel = _metal_kernel(launch.kernel)
    return kernel(inputs=launch.inputs, template=launch.template or None, grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                  output_dtypes=launch.output_dtypes, init_value=launch.init_value)


@functools.cache
def _cuda_kernel(src: KernelSource):
    import mlx.core as mx
    return mx.fast.cuda_kernel(name=src.name, input_names=list(src.input_names),
                               output_names=list(src.output_names), source=src.source,
                               header=src.header, ensure_row_contiguous=True,
                               shared_memory=src.shared_memory)


def run_cuda(launch: Launch) -> Sequence[Any]:
    """Launch through ``mx.fast.cuda_kernel`` (NVRTC compiles each source once a process)."""
    kernel = _cuda_kernel(launch.kernel)
    return kernel(inputs=launch.inputs, template=launch.template or None, grid=launch.grid,
                  threadgroup=launch.threadgroup, output_shapes=launch.output_shapes,
                  output_dtypes=launch.output_dtypes, init_value=launch.init_value)

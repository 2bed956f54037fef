"""safetensors -> HFQM conversion (the library side of ``pagedkv convert``,
docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy').

The tensor plan is computed from the shard headers first, so the writer knows
every index entry up front and the file matches hipfire's layout exactly. Then
tensors stream one block of rows at a time (at most ``chunk_bytes`` of float32
in memory), each block quantized by :func:`pagedkv.quant.quantize` and, when
errors are measured, decoded again to accumulate the relative error.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from pagedkv.errors import InvalidArgument
from pagedkv.hfqm.arch import QWEN35_ARCH_IDS, arch_id_for, is_qwen35_metadata
from pagedkv.hfqm.policy import TensorPlan, default_format, plan_tensor, resolve_format
from pagedkv.hfqm.qtypes import expected_nbytes, qtype
from pagedkv.hfqm.safetensors_source import SafetensorsSource, SourceTensor
from pagedkv.hfqm.writer import HfqmWriter, PlannedTensor

__all__ = ["DEFAULT_CHUNK_BYTES", "ConversionReport", "convert_safetensors"]

DEFAULT_CHUNK_BYTES = 64 << 20

#: progress(done_source_bytes, total_source_bytes, tensor_name)
ProgressFn = Callable[[int, int, str], None]


@dataclass
class ConversionReport:
    """What a conversion wrote: per-qt totals, skipped tensors and, per tensor class,
    the mean over tensors of ``‖ŵ − w‖₂ / ‖w‖₂``."""

    path: str
    format: str
    arch_id: int
    source_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0
    per_qt: dict[str, dict[str, int]] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    rel_errors: dict[str, list[float]] = field(default_factory=dict)

    def mean_rel_error(self) -> dict[str, tuple[int, float]]:
        """``{class: (tensors, mean relative error)}``."""
        return {role: (len(v), float(np.mean(v))) for role, v in sorted(self.rel_errors.items())}


def _rows_per_chunk(shape: tuple[int, ...], group: int, chunk_bytes: int) -> int:
    """Rows per block: whole groups (groups may straddle rows) within ``chunk_bytes``."""
    if len(shape) < 2:
        return max(shape[0], 1) if shape else 1
    row = math.prod(shape[1:])
    step = group // math.gcd(row, group) if group > 1 else 1
    rows = max(step, (chunk_bytes // max(4 * row, 1)) // step * step)
    return min(rows, shape[0]) if shape[0] else 1


def _sum_of_squares(x: np.ndarray) -> float:
    """Σx² of a float32 array, squared and summed in float64 (einsum casts in buffered
    chunks: no float64 copy of the block, and no float32 square that overflows)."""
    flat = x.reshape(-1)
    return float(np.einsum("i,i->", flat, flat, dtype=np.float64))


def _planned(p: TensorPlan, qt: int) -> PlannedTensor:
    """The writer's plan entry of a tensor converted to ``qt``."""
    data_size = expected_nbytes(qt, p.shape)
    # The targets are pagedkv.quant codecs, whose qts all have a size rule (tested).
    assert data_size is not None, f"qt {qt} has no size rule"
    return PlannedTensor(p.name, qt, p.shape, qtype(qt).index_group_size, data_size)


def _blocks(source: SafetensorsSource, src: SourceTensor, plan: TensorPlan,
            chunk_bytes: int) -> Iterator[np.ndarray]:
    shape = plan.shape
    assert plan.qt is not None, "only planned tensors are read (skipped ones have no qt)"
    group = qtype(plan.qt).group_size
    if len(shape) < 2:
        yield source.read(src, (plan.expert,) if plan.expert is not None else None)
        return
    rows = _rows_per_chunk(shape, group, chunk_bytes)
    for r0 in range(0, shape[0], rows):
        r = slice(r0, min(r0 + rows, shape[0]))
        yield source.read(src, (plan.expert, r) if plan.expert is not None else (r,))


def _metadata(source: SafetensorsSource, fmt_name: str, target_id: int, arch: str | int,
              skipped: list[tuple[str, str]]) -> dict:
    from pagedkv import __version__
    config = source.config
    architecture = config.get("model_type") if isinstance(config, dict) else None
    if not architecture and isinstance(arch, str) and not arch.strip().isdigit():
        architecture = arch
    return {
        "architecture": architecture or "unknown",
        "config": config,
        "tokenizer": source.tokenizer,
        "tokenizer_config": source.tokenizer_config,
        "generation_config": source.generation_config,
        "pagedkv": {
            "converter": "pagedkv convert",
            "version": __version__,
            "format": fmt_name,
            "qt": target_id,
            "source_files": [os.path.basename(s) for s in source.shards],
            "skipped": [name for name, _ in skipped],
        },
    }


def convert_safetensors(source_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                        *, fmt: str | None = None, arch: str | int | None = None,
                        include_visual: bool = False, measure_error: bool = True,
                        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        progress: ProgressFn | None = None) -> ConversionReport:
    """Convert a safetensors model to an HFQM file at ``out_path`` (written to a
    temporary name and renamed at the end; an interruption leaves no output)."""
    from pagedkv.quant import dequantize, quantize

    source = SafetensorsSource(source_path)
    fmt_name = fmt or default_format(source.config)
    target = resolve_format(fmt_name)
    if arch is None:
        model_type = source.config.get("model_type") if isinstance(source.config, dict) else None
        if not model_type:
            raise InvalidArgument(f"{source.path!r} has no config.json model_type: pass --arch "
                                  "(a model_type name or an integer arch_id)")
        arch = model_type
    arch_id = arch_id_for(arch)
    if is_qwen35_metadata({"config": source.config}) and arch_id not in QWEN35_ARCH_IDS:
        raise InvalidArgument(f"config names Qwen3.5/3.6 but arch_id is {arch_id}; "
                              "Qwen3.5/3.6 files need --arch 5 (dense) or 6 (MoE)")

    plans: list[tuple[SourceTensor, TensorPlan, PlannedTensor]] = []
    report = ConversionReport(str(out_path), fmt_name, arch_id)
    for src in source.tensors:
        for p in plan_tensor(src.name, src.dtype, src.shape, target,
                             include_visual=include_visual):
            if p.qt is None:
                report.skipped.append((p.name, p.reason))
            else:
                plans.append((src, p, _planned(p, p.qt)))
    writer_plan = [planned for _, _, planned in plans]
    total = sum(src.nbytes // (src.shape[0] if p.expert is not None else 1)
                for src, p, _ in plans)
    report.source_bytes = total
    done = 0
    started = time.perf_counter()
    metadata = _metadata(source, fmt_name, target.id, arch, report.skipped)
    with HfqmWriter(out_path, arch_id=arch_id, metadata=metadata, plan=writer_plan,
                    add_quantization_hash=True) as writer:
        for src, p, planned in plans:
            row = qtype(planned.qt)
            err2 = ref2 = 0.0

            # Parameters, not closure cells: the generator must see this tensor's plan.
            def encoded_blocks(src=src, p=p, row=row) -> Iterator[np.ndarray]:
                nonlocal err2, ref2, done
                for block in _blocks(source, src, p, chunk_bytes):
                    block = np.atleast_1d(block)  # the codecs take >= 1 dim; a scalar is [1]
                    try:
                        raw = quantize(block, row.key)
                    except InvalidArgument as exc:   # NaN/Inf, a group no format can store
                        raise InvalidArgument(f"{src.shard}: tensor {p.name!r}: "
                                              f"{exc}") from None
                    if measure_error:
                        ref = block.astype(np.float32, copy=False)
                        diff = dequantize(raw, row.key, block.shape)
                        np.subtract(diff, ref, out=diff)
                        err2 += _sum_of_squares(diff)
                        ref2 += _sum_of_squares(ref)
                    done += block.size * (2 if src.dtype in ("F16", "BF16") else 4)
                    if progress is not None:
                        progress(done, total, p.name)
                    yield raw

            writer.add(p.name, row.id, p.shape, encoded_blocks())
            if measure_error:
                rel = math.sqrt(err2 / ref2) if ref2 > 0 else 0.0
                report.rel_errors.setdefault(p.role, []).append(rel)
            stats = report.per_qt.setdefault(row.name, {"qt": row.id, "tensors": 0, "bytes": 0})
            stats["tensors"] += 1
            stats["bytes"] += planned.data_size
    report.seconds = time.perf_counter() - started
    report.file_bytes = os.path.getsize(out_path)
    return report

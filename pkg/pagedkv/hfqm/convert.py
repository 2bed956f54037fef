"""safetensors/GGUF -> HFQM conversion (the library side of ``pagedkv convert``,
docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor policy').

The tensor plan is computed from the shard headers first, so the writer knows
every index entry up front and the file matches hipfire's layout exactly. Then
tensors stream one block of rows at a time (at most ``chunk_bytes`` of float32
in memory), each block quantized by :func:`pagedkv.quant.quantize` and, when
errors are measured, decoded again to accumulate the relative error. A GGUF source
(docs/formats/gguf.md) is dequantized a block of rows at a time the same way.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import BadMetadata, InvalidArgument
from pagedkv.hfqm.arch import QWEN35_ARCH_IDS, arch_id_for, is_qwen35_metadata
from pagedkv.hfqm.policy import TensorPlan, default_format, plan_tensor, resolve_format
from pagedkv.hfqm.safetensors_source import SafetensorsSource
from pagedkv.hfqm.writer import HfqmWriter, PlannedTensor
from pagedkv.quant.qtypes import expected_nbytes, qtype

__all__ = ["DEFAULT_CHUNK_BYTES", "ConversionReport", "convert_gguf", "convert_model",
           "convert_safetensors", "parameter_counts"]

_RAW_QTS = frozenset({1, 2, 16})
_F16_QT = 1


class _Source(Protocol):
    """What the converter reads: ``SafetensorsSource`` or ``GgufSource``."""

    path: str
    shards: list[str]
    config: Any
    tokenizer: str
    tokenizer_config: Any
    generation_config: Any

    @property
    def tensors(self) -> Sequence[Any]: ...

    def read(self, tensor: Any, index: tuple[slice | int, ...] | None = None
             ) -> np.ndarray: ...

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


def _check_f16_range(raw: np.ndarray, block: np.ndarray, start: int, shard: str,
                     p: TensorPlan) -> None:
    """Refuse a block whose F16 payload holds ±inf: F16 by truncation (hipfire's) turns a
    finite |x| >= 65536 into ±inf, a weight the file would not hold."""
    halves = raw.view(np.float16)
    finite = np.isfinite(halves)
    if finite.all():
        return
    at = int(np.flatnonzero(~finite)[0])
    where = tuple(int(i) for i in np.unravel_index(start + at, p.shape or (1,)))
    raise InvalidArgument(
        f"{shard}: tensor {p.name!r}: value {float(block.reshape(-1)[at]):.7g} at index "
        f"{where} does not fit F16, the qt the tensor is stored in (hipfire's f32 -> f16 "
        "truncation makes |x| >= 65536 ±inf); rescale the tensor in the source")


def _planned(p: TensorPlan, qt: int) -> PlannedTensor:
    """The writer's plan entry of a tensor converted to ``qt``."""
    data_size = expected_nbytes(qt, p.shape)
    # The targets are pagedkv.quant codecs, whose qts all have a size rule (tested).
    assert data_size is not None, f"qt {qt} has no size rule"
    return PlannedTensor(p.name, qt, p.shape, qtype(qt).index_group_size, data_size)


def _blocks(source: _Source, src: Any, plan: TensorPlan,
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


def _config_int(config: Any, keys: tuple[str, ...]) -> int | None:
    """First integer of ``keys`` in ``config`` or its ``text_config``/``moe``/``ffn_config``."""
    if not isinstance(config, dict):
        return None
    for scope in (config, *(config.get(k) for k in ("text_config", "moe", "ffn_config"))):
        if isinstance(scope, dict):
            for key in keys:
                v = scope.get(key)
                if is_int(v):
                    return int(v)
    return None


def _n_layers(config: Any) -> int:
    return _config_int(config, ("num_hidden_layers", "n_layer", "num_layers")) or 0


def _num_experts(config: Any) -> tuple[int, int] | None:
    experts = _config_int(config, ("num_experts", "n_routed_experts", "num_local_experts",
                                   "n_experts"))
    top_k = _config_int(config, ("num_experts_per_tok", "num_experts_per_token",
                                 "n_experts_per_tok", "moe_top_k", "top_k",
                                 "num_selected_experts"))
    return (experts, top_k) if experts and top_k else None


def parameter_counts(plans: Sequence[TensorPlan], skipped_params: int, config: Any) -> dict:
    """hipfire's ``parameter_counts`` (schema ``hipfire.parameter_counts.v1``) of the
    tensors a conversion writes: docs/formats/hfqm.md, "parameter_counts"."""
    total = sum(math.prod(p.shape) for p in plans)
    quantized = sum(math.prod(p.shape) for p in plans if p.qt not in _RAW_QTS)
    routed = sum(math.prod(p.shape) for p in plans if "mlp.experts." in p.name)
    counts: dict[str, Any] = {
        "schema": "hipfire.parameter_counts.v1", "total_params": total,
        "source_total_params": total + skipped_params, "active_params": total,
        "effective_params": total, "quantized_params": quantized,
        "skipped_params": skipped_params}
    if routed:
        moe = _num_experts(config)
        if moe is None:
            counts["moe"] = {"routed_expert_params": routed,
                             "active_rule": "unknown_top_k_or_num_experts"}
        else:
            experts, top_k = moe
            numerator = routed * top_k
            active = total - routed + numerator // experts
            counts["active_params"] = counts["effective_params"] = active
            counts["moe"] = {
                "num_experts": experts, "num_experts_per_tok": top_k,
                "routed_expert_params": routed,
                "routed_expert_active_params": numerator // experts,
                "active_rule": "dense_and_shared_full_plus_routed_top_k_over_num_experts",
                "routed_active_fraction": {"numerator": numerator, "denominator": experts}}
    return counts


def _metadata(source: _Source, fmt_name: str, target_id: int, arch: str | int,
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
                        include_visual: bool = False, promote: bool = False,
                        measure_error: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                        progress: ProgressFn | None = None) -> ConversionReport:
    """Convert a safetensors model to an HFQM file at ``out_path`` (written to a
    temporary name and renamed at the end; an interruption leaves no output).
    ``promote``: the edge-layer/expert 6-bit promotion (hipfire's K-map, full mode),
    off unless asked for (docs/contracts/hfqm-and-quant.md, '2.9 Quantizer tensor
    policy': the default is the format alone)."""
    source = SafetensorsSource(source_path)
    fmt_name = fmt or default_format(source.config)
    target_id = resolve_format(fmt_name).id
    if arch is None:
        model_type = source.config.get("model_type") if isinstance(source.config, dict) else None
        if not model_type:
            raise InvalidArgument(f"{source.path!r} has no config.json model_type: pass --arch "
                                  "(a model_type name or an integer arch_id)")
        arch = model_type
    arch_id = arch_id_for(arch)
    metadata = _metadata(source, fmt_name, target_id, arch, [])
    return _convert(source, out_path, metadata, fmt_name=fmt_name, arch_id=arch_id,
                    include_visual=include_visual, promote=promote,
                    measure_error=measure_error, chunk_bytes=chunk_bytes, progress=progress)


def convert_gguf(source_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                 *, fmt: str | None = None, arch: str | int | None = None,
                 include_visual: bool = False, promote: bool = False,
                 measure_error: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 progress: ProgressFn | None = None) -> ConversionReport:
    """Convert a GGUF model (docs/formats/gguf.md) to an HFQM file, like
    :func:`convert_safetensors`. The default format is ``hf4``; ``arch`` defaults to
    the mapping of ``general.architecture`` (llama, qwen2, qwen3)."""
    from pagedkv import __version__
    from pagedkv.hfqm.gguf_source import GGUF_ARCH_IDS, GgufSource

    source = GgufSource(source_path)
    fmt_name = fmt or "hf4"
    target_id = resolve_format(fmt_name).id
    if arch is None:
        if source.architecture not in GGUF_ARCH_IDS:
            raise InvalidArgument(
                f"GGUF architecture {source.architecture!r} has no arch_id mapping (known: "
                f"{', '.join(sorted(GGUF_ARCH_IDS))}); pass --arch with an integer arch_id")
        arch = GGUF_ARCH_IDS[source.architecture]
    elif isinstance(arch, str) and arch.lower() in GGUF_ARCH_IDS:
        arch = GGUF_ARCH_IDS[arch.lower()]
    arch_id = arch_id_for(arch)
    metadata = {
        "architecture": source.architecture,
        "source": "gguf",
        "config": source.config,
        "tokenizer": source.tokenizer,
        "tokenizer_config": source.tokenizer_config,
        "generation_config": source.generation_config,
        "gguf_meta": source.metadata,
        "pagedkv": {
            "converter": "pagedkv convert",
            "version": __version__,
            "format": fmt_name,
            "qt": target_id,
            "source_files": [os.path.basename(s) for s in source.shards],
            "skipped": [],
        },
    }
    return _convert(source, out_path, metadata, fmt_name=fmt_name, arch_id=arch_id,
                    include_visual=include_visual, promote=promote,
                    measure_error=measure_error, chunk_bytes=chunk_bytes, progress=progress)


def _is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that starts with the GGUF magic."""
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def convert_model(source_path: str | os.PathLike[str], out_path: str | os.PathLike[str],
                  **options: Any) -> ConversionReport:
    """:func:`convert_gguf` for a ``.gguf`` file or a file starting with the GGUF magic,
    else :func:`convert_safetensors`."""
    if os.fspath(source_path).lower().endswith(".gguf") or _is_gguf(source_path):
        return convert_gguf(source_path, out_path, **options)
    return convert_safetensors(source_path, out_path, **options)


def _convert(source: _Source, out_path: str | os.PathLike[str], metadata: dict, *,
             fmt_name: str, arch_id: int, include_visual: bool, promote: bool,
             measure_error: bool, chunk_bytes: int,
             progress: ProgressFn | None) -> ConversionReport:
    from pagedkv.quant import dequantize, quantize

    target = resolve_format(fmt_name)
    for shard in source.shards:
        # The writer renames its temporary file over out_path at the end: were it a file
        # the conversion reads, the source would be replaced by the output.
        if os.path.exists(out_path) and os.path.samefile(out_path, shard):
            raise InvalidArgument(f"output {os.fspath(out_path)!r} is the source file "
                                  f"{shard!r}: the conversion would replace it; write to "
                                  "another path")
    if is_qwen35_metadata({"config": source.config}) and arch_id not in QWEN35_ARCH_IDS:
        raise InvalidArgument(f"config names Qwen3.5/3.6 but arch_id is {arch_id}; "
                              "Qwen3.5/3.6 files need --arch 5 (dense) or 6 (MoE)")
    is_moe = arch_id == 6 or _num_experts(source.config) is not None
    n_layers = _n_layers(source.config)

    plans: list[tuple[Any, TensorPlan, PlannedTensor, int]] = []
    report = ConversionReport(str(out_path), fmt_name, arch_id)
    skipped_params = 0
    for src in source.tensors:
        for p in plan_tensor(src.name, src.dtype, src.shape, target,
                             include_visual=include_visual, promote=promote,
                             n_layers=n_layers, is_moe=is_moe):
            if p.qt is None:
                report.skipped.append((p.name, p.reason))
                skipped_params += math.prod(p.shape)
            else:
                # Source bytes behind this output (one expert of a stacked tensor).
                nbytes = src.nbytes // (src.shape[0] if p.expert is not None else 1)
                plans.append((src, p, _planned(p, p.qt), nbytes))
    first_source: dict[str, str] = {}
    for src, p, _, _ in plans:
        # Two source tensors mapped to one output name (a GGUF name table that does not
        # fit the architecture): refuse before anything is encoded, naming both.
        source_name = getattr(src, "gguf_name", src.name)
        if p.name in first_source:
            raise BadMetadata(f"source tensors {first_source[p.name]!r} and {source_name!r} "
                              f"both map to the output name {p.name!r}", path=source.path,
                              tensor=p.name)
        first_source[p.name] = source_name
    writer_plan = [planned for _, _, planned, _ in plans]
    total = sum(nbytes for *_, nbytes in plans)
    report.source_bytes = total
    metadata["parameter_counts"] = parameter_counts([p for _, p, _, _ in plans],
                                                    skipped_params, source.config)
    metadata["pagedkv"]["skipped"] = [name for name, _ in report.skipped]
    metadata["pagedkv"]["promote_6bit"] = bool(promote)
    done = 0
    started = time.perf_counter()
    with HfqmWriter(out_path, arch_id=arch_id, metadata=metadata, plan=writer_plan,
                    add_quantization_hash=True) as writer:
        for src, p, planned, nbytes in plans:
            row = qtype(planned.qt)
            err2 = ref2 = 0.0
            numel = max(math.prod(p.shape), 1)

            # Parameters, not closure cells: the generator must see this tensor's plan.
            def encoded_blocks(src=src, p=p, row=row, nbytes=nbytes,
                               numel=numel) -> Iterator[np.ndarray]:
                nonlocal err2, ref2, done
                base, elems = done, 0
                for block in _blocks(source, src, p, chunk_bytes):
                    block = np.atleast_1d(block)  # the codecs take >= 1 dim; a scalar is [1]
                    try:
                        raw = quantize(block, row.key)
                    except InvalidArgument as exc:   # NaN/Inf, a group no format can store
                        where = src.shard  # the file (shard) that holds the tensor
                        raise InvalidArgument(f"{where}: tensor {p.name!r}: "
                                              f"{exc}") from None
                    if row.id == _F16_QT:
                        _check_f16_range(raw, block, elems, src.shard, p)
                    if measure_error:
                        ref = block.astype(np.float32, copy=False)
                        diff = dequantize(raw, row.key, block.shape)
                        np.subtract(diff, ref, out=diff)
                        err2 += _sum_of_squares(diff)
                        ref2 += _sum_of_squares(ref)
                    elems += block.size
                    done = base + nbytes * min(elems, numel) // numel
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

"""Lazy reader of a safetensors model (one file, or a directory of shards plus its
``config.json``, ``tokenizer.json``, ...) for ``pagedkv convert`` (docs/contracts/hfqm-and-quant.md,
'2.9 Quantizer tensor policy').

Shard headers are parsed once (names, dtypes, shapes, byte ranges); tensors are
then read a block of rows at a time, so memory stays bounded by the chunk size.
F32/F16 rows come from the ``safetensors`` library (``get_slice``); BF16 rows
are read as raw bytes through the header's ``data_offsets`` (its NumPy backend
cannot return bf16) and widened exactly to float32 by ``<< 16`` (docs/contracts/hfqm-and-quant.md,
'3.2 f32 to f16 by truncation').
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pagedkv.argument_checks import row_span
from pagedkv.errors import (
    BadMagic,
    BadMetadata,
    InvalidArgument,
    InvalidArgumentType,
    Truncated,
    UnsupportedQuantType,
)
from pagedkv.hfqm import strict_json
from pagedkv.hfqm.policy import BUFFER_DTYPES, FLOAT_DTYPES

__all__ = ["SafetensorsSource", "SourceTensor"]

# Bits per element of every dtype the safetensors loader (0.8) knows; any other name
# is refused, as the loader refuses it.
_DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8,
               "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
               "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
               "C64": 64, "F64": 64, "I64": 64, "U64": 64}
# The loader's limits: header at most 100 MB; sizes and offsets are Rust usize; serde_json
# refuses arrays/objects nested deeper than 127 (its recursion limit of 128).
_HEADER_LIMIT_BYTES = 100_000_000
_USIZE_MAX = 2**64 - 1
_HEADER_MAX_DEPTH = 127
# Files convert is handed that are not safetensors: their magic -> what they are.
_OTHER_MAGICS = {
    b"GGUF": "a GGUF file; convert it with convert_gguf (convert_model and pagedkv convert "
             "pick GGUF by this magic)",
    b"HFQM": "an HFQM file, already converted (pagedkv inspect shows it)",
    b"HFQ!": "an HFQM file whose write was interrupted; convert the source model again",
}
# Hugging Face's index of a sharded checkpoint.
_INDEX_NAME = "model.safetensors.index.json"


class SourceTensor(NamedTuple):
    """One tensor of a shard; ``data_start`` is its absolute byte offset in ``shard``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    data_start: int
    nbytes: int


def _usize(value: object) -> bool:
    # JSON integers only: the loader's serde refuses 2.0, true and "2" where a usize goes
    return type(value) is int and 0 <= value <= _USIZE_MAX


def load_json_text(data: bytes, path: str, what: str):
    """Parse ``data`` (the bytes of ``what`` in ``path``) as UTF-8 JSON (a leading BOM is
    allowed). Raises :class:`~pagedkv.errors.BadMetadata` naming the file for bytes
    that are not UTF-8, text that is not strict JSON (``NaN``, ``Infinity`` and numbers
    beyond float64 included: the HFQM writer could not write them back) and nesting
    too deep to parse."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadMetadata(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})",
                          path=path, offset=exc.start) from None
    try:
        return strict_json.loads(text)
    except ValueError as exc:
        raise BadMetadata(f"{what} is not valid JSON ({exc})", path=path) from None
    except RecursionError:
        raise BadMetadata(f"{what} nests arrays/objects deeper than the JSON parser allows",
                          path=path) from None


def _nesting_depth(value: object) -> int:
    """Arrays/objects nested in ``value``, the outermost counting 1 (iterative)."""
    depth, level = 0, [value]
    while level:
        nested = [v for item in level if isinstance(item, (list, dict))
                  for v in (item.values() if isinstance(item, dict) else item)]
        if not any(isinstance(item, (list, dict)) for item in level):
            break
        depth += 1
        level = nested
    return depth


def _check_entry(name: str, entry: object, path: str) -> tuple[str, tuple[int, ...], int, int]:
    """dtype, shape, start, end of one header entry, checked as the safetensors loader
    checks them (docs/cli.md, "pagedkv convert")."""
    if not isinstance(entry, dict):
        raise BadMetadata("header entry is not a JSON object", path=path, tensor=name, offset=8)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
        raise BadMetadata(f"dtype {dtype!r} is not a safetensors dtype "
                          f"({', '.join(_DTYPE_BITS)})", path=path, tensor=name, offset=8)
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        raise BadMetadata(f"shape {shape!r} is not a list of non-negative integers",
                          path=path, tensor=name, offset=8)
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(_usize(v) for v in offsets)):
        raise BadMetadata(f"data_offsets {offsets!r} is not a pair of non-negative integers",
                          path=path, tensor=name, offset=8)
    bits = math.prod(shape) * _DTYPE_BITS[dtype]
    start, end = offsets
    if bits % 8 or bits // 8 > _USIZE_MAX:
        raise BadMetadata(f"{dtype} {tuple(shape)} is not a whole number of bytes below 2**64",
                          path=path, tensor=name, offset=8)
    if end < start or end - start != bits // 8:
        raise BadMetadata(f"{dtype} {tuple(shape)} needs {bits // 8} bytes, data_offsets "
                          f"[{start}, {end}) give {end - start}", path=path, tensor=name,
                          offset=8)
    return dtype, tuple(shape), start, end


def _read_header(path: str) -> list[SourceTensor]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Truncated("safetensors file shorter than its 8-byte header length",
                            path=path, offset=len(head))
        kind = _OTHER_MAGICS.get(head[:4])
        if kind is not None:
            # Read as a header length, these bytes gave "header length 5592139336 is
            # above the loader's limit": true, and no help.
            raise BadMagic(f"not a safetensors file but {kind}", path=path, offset=0)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > _HEADER_LIMIT_BYTES:
            raise BadMetadata(f"safetensors header length {header_len} is above the "
                              f"loader's limit of {_HEADER_LIMIT_BYTES} bytes", path=path,
                              offset=0)
        if header_len > size - 8:
            raise Truncated(f"safetensors header length {header_len} runs past the file "
                            f"({size} bytes)", path=path, offset=0)
        header = load_json_text(f.read(header_len), path, "the safetensors header")
    if not isinstance(header, dict):
        raise BadMetadata("safetensors header is not a JSON object", path=path, offset=8)
    if _nesting_depth(header) > _HEADER_MAX_DEPTH:
        raise BadMetadata(f"safetensors header nests arrays/objects deeper than the loader's "
                          f"{_HEADER_MAX_DEPTH} levels", path=path, offset=8)
    base = 8 + header_len
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict)
                                 and all(isinstance(v, str) for v in meta.values())):
        raise BadMetadata("safetensors __metadata__ is not an object of strings", path=path,
                          offset=8)
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, start, end = _check_entry(name, entry, path)
        tensors.append(SourceTensor(name, dtype, shape, path, base + start, end - start))
    # The loader's coverage rule: sorted by offsets, tensors tile the data section exactly,
    # no gap, no overlap, no trailing byte.
    tensors.sort(key=lambda t: (t.data_start, t.data_start + t.nbytes))
    covered = base
    for t in tensors:
        if t.data_start != covered:
            raise BadMetadata(f"data_offsets start at {t.data_start - base}, the previous "
                              f"tensor ends at {covered - base} (tensors must tile the data "
                              "section without gaps or overlaps)", path=path, tensor=t.name,
                              offset=t.data_start)
        covered += t.nbytes
    if covered != size:
        what = "run past the end of" if covered > size else "leave trailing bytes in"
        raise (Truncated if covered > size else BadMetadata)(
            f"the tensors' data_offsets end at byte {covered - base} of the data section and "
            f"{what} the file's {size - base}-byte data section", path=path, offset=covered)
    return tensors


def _json_object(data: bytes, path: Path):
    """The JSON object (or ``null``) in a side file's bytes (``config.json``, ...)."""
    value = load_json_text(data, str(path), path.name)
    if value is not None and not isinstance(value, dict):
        raise BadMetadata(f"{path.name} holds a JSON {type(value).__name__}, not an object",
                          path=str(path))
    return value


def _weight_map(index: Path) -> dict[str, str]:
    """``weight_map`` of a ``model.safetensors.index.json``: tensor name -> shard file
    name; every shard it names must be a file beside the index."""
    weight_map = (_read_json(index) or {}).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and v for v in weight_map.values()):
        raise BadMetadata(f"{index.name} has no weight_map object of tensor -> shard file "
                          "names", path=str(index))
    for shard in sorted(set(weight_map.values())):
        if not (index.parent / shard).is_file():
            raise InvalidArgument(f"{str(index)!r} names the shard {shard!r}, which is not a "
                                  "file in that directory")
    return weight_map


def _read_json(path: Path):
    """A JSON side file as a dict (None for ``null`` or when there is no such file)."""
    return _json_object(path.read_bytes(), path) if path.is_file() else None


class SafetensorsSource:
    """A safetensors model: ``SafetensorsSource(path)`` with ``path`` a ``.safetensors``
    file or a directory holding ``*.safetensors`` shards (exactly the shards its
    ``model.safetensors.index.json`` names, when there is one). ``config``, ``tokenizer``
    (the ``tokenizer.json`` text, ``"{}"`` if absent), ``tokenizer_config`` and
    ``generation_config`` come from the same directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        weight_map: dict[str, str] = {}
        if root.is_dir():
            directory = root
            index = root / _INDEX_NAME
            if index.is_file():
                # The index names the model's shards: other *.safetensors in the directory
                # (Mistral's consolidated.safetensors beside the HF shards, adapters) are
                # not part of the model and would be converted a second time.
                weight_map = _weight_map(index)
                shards = sorted({str(root / name) for name in weight_map.values()})
            else:
                shards = sorted(str(p) for p in root.glob("*.safetensors"))
            if not shards:
                raise InvalidArgument(f"{str(root)!r} holds no *.safetensors shard")
        elif root.is_file():
            shards, directory = [str(root)], root.parent
        elif not root.exists():
            raise InvalidArgument(f"{str(root)!r} does not exist; pass a .safetensors file or "
                                  "a model directory holding *.safetensors shards")
        else:
            raise InvalidArgument(f"{str(root)!r} is neither a .safetensors file nor a "
                                  "directory of shards")
        self.path = str(root)
        self.shards = shards
        self.tensors: list[SourceTensor] = [t for s in shards for t in _read_header(s)]
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise BadMetadata("tensor appears in more than one shard", path=self.path,
                              tensor=dup, offset=0)
        for t in self.tensors:
            # FP8/FP6/FP4 checkpoints store weights with block scales in separate tensors
            # (`*.weight_scale_inv`) that the converter does not apply, and a complex
            # tensor has no real value: leaving them out would write a file without its
            # weights (and quantize the scales as weights), so refuse before any work.
            if t.dtype not in FLOAT_DTYPES and t.dtype not in BUFFER_DTYPES:
                raise UnsupportedQuantType(
                    f"dtype {t.dtype} is not converted (floating-point weights must be F32, "
                    "F16, BF16 or F64; integer and bool buffers are left out); dequantize "
                    "the checkpoint to BF16 first", path=t.shard, tensor=t.name)
        shard_of = {t.name: t.shard for t in self.tensors}
        for name, shard in weight_map.items():
            if shard_of.get(name) != str(root / shard):
                raise BadMetadata(f"{_INDEX_NAME} puts the tensor in {shard}, which does not "
                                  "hold it", path=str(root / _INDEX_NAME), tensor=name)
        self.config = _read_json(directory / "config.json") or {}
        model_type = self.config.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise BadMetadata(f"config.json model_type is a JSON {type(model_type).__name__}, "
                              "not a string", path=str(directory / "config.json"))
        self.tokenizer = self._read_tokenizer(directory / "tokenizer.json")
        self.tokenizer_config = _read_json(directory / "tokenizer_config.json")
        self.generation_config = _read_json(directory / "generation_config.json")
        # shard path -> safetensors.safe_open handle (a Rust object without type stubs)
        self._handles: dict[str, Any] = {}

    @staticmethod
    def _read_tokenizer(path: Path) -> str:
        """``tokenizer.json`` as text (stored verbatim, docs/contracts/hfqm-and-quant.md, '2.3
        Metadata keys'), checked to be a JSON object."""
        if not path.is_file():
            return "{}"
        data = path.read_bytes()
        if _json_object(data, path) is None:
            raise BadMetadata(f"{path.name} holds a JSON null, not an object", path=str(path))
        return data.decode("utf-8-sig")

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def read(self, tensor: SourceTensor,
             index: tuple[slice | int, ...] | None = None) -> np.ndarray:
        """Rows of a floating tensor as float32 (F16 stays float16, F64 is rounded to
        float32): ``index`` selects along the leading dims, ints then at most one slice,
        as NumPy does (e.g. ``(slice(r0, r1),)``, or ``(e, slice(r0, r1))`` for one
        expert); ``None`` reads it whole. Indices are checked as ``GgufSource.read``
        checks its rows (:func:`~pagedkv.argument_checks.row_span`): an int outside
        ``-n..n-1`` of its dim raises :class:`~pagedkv.errors.InvalidArgument` naming the
        tensor and the range (a non-int ``InvalidArgumentType``), as does a slice with a
        step other than 1, a slice before another entry or more entries than dims; a
        slice is clipped to the dim (a reversed one gives an empty block)."""
        picks, out_shape = self._selection(tensor, index)
        out_dtype = np.float16 if tensor.dtype == "F16" else np.float32
        if math.prod(out_shape) == 0:
            return np.zeros(out_shape, dtype=out_dtype)
        if tensor.dtype == "BF16":
            return self._read_bf16(tensor, picks, out_shape)
        from safetensors import SafetensorError, safe_open
        try:
            handle = self._handles.get(tensor.shard)
            if handle is None:
                handle = self._handles[tensor.shard] = safe_open(tensor.shard,
                                                                 framework="numpy")
            if not picks:
                array = handle.get_tensor(tensor.name)
            else:
                array = handle.get_slice(tensor.name)[picks]
        except SafetensorError as exc:
            # _read_header checks what the loader checks; this is the safety net
            raise BadMetadata(f"the safetensors loader refuses the file: {exc}",
                              path=tensor.shard, tensor=tensor.name) from None
        return np.asarray(array, dtype=out_dtype).reshape(out_shape)

    @staticmethod
    def _selection(tensor: SourceTensor, index: object
                   ) -> tuple[tuple[slice | int, ...], tuple[int, ...]]:
        """``index`` checked against ``tensor.shape``: each entry as a non-negative int or
        a clipped step-1 slice, and the shape of the block it selects."""
        if index is None:
            return (), tensor.shape
        if not isinstance(index, (tuple, list)):
            raise InvalidArgumentType(f"index of {tensor.name!r} must be a tuple of ints and "
                                      f"a slice, got {type(index).__name__}")
        shape = tensor.shape
        if len(index) > len(shape):
            raise InvalidArgument(f"index {tuple(index)!r} of {tensor.name!r} has "
                                  f"{len(index)} entries, the tensor {len(shape)} dims")
        picks: list[slice | int] = []
        kept: list[int] = []
        for dim, sel in enumerate(index):
            lo, hi = row_span(sel, shape[dim], tensor.name, dim)
            if isinstance(sel, slice):
                if dim != len(index) - 1:
                    raise InvalidArgument(f"index {tuple(index)!r} of {tensor.name!r}: a "
                                          "slice must be its last entry (ints, then at "
                                          "most one contiguous slice)")
                picks.append(slice(lo, hi))
                kept.append(hi - lo)
            else:
                picks.append(lo)
        return tuple(picks), (*kept, *shape[len(index):])

    @staticmethod
    def _read_bf16(tensor: SourceTensor, picks: tuple[slice | int, ...],
                   out_shape: tuple[int, ...]) -> np.ndarray:
        # Byte range of the selection: leading ints fix dims, then one slice on the next dim.
        shape = tensor.shape
        start = sum((p.start if isinstance(p, slice) else p) * math.prod(shape[dim + 1:])
                    for dim, p in enumerate(picks))
        count = math.prod(out_shape)
        with open(tensor.shard, "rb") as f:
            f.seek(tensor.data_start + 2 * start)
            raw = f.read(2 * count)
        if len(raw) != 2 * count:
            raise Truncated("bf16 tensor data ends early", path=tensor.shard, tensor=tensor.name,
                            offset=tensor.data_start + 2 * start + len(raw))
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return bits.view(np.float32).reshape(out_shape)

    def __repr__(self) -> str:
        return (f"<SafetensorsSource {self.path!r}: {len(self.shards)} shards, "
                f"{len(self.tensors)} tensors, {self.total_bytes} bytes>")

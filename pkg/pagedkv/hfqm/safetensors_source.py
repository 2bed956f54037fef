"""Lazy reader of a safetensors model (one file, or a directory of shards plus its
``config.json``, ``tokenizer.json``, ...) for ``pagedkv convert`` (hfqm-and-quant.md §2.9).

Shard headers are parsed once (names, dtypes, shapes, byte ranges); tensors are
then read a block of rows at a time, so memory stays bounded by the chunk size.
F32/F16 rows come from the ``safetensors`` library (``get_slice``); BF16 rows
are read as raw bytes through the header's ``data_offsets`` (its NumPy backend
cannot return bf16) and widened exactly to float32 by ``<< 16`` (§3.2).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pagedkv.errors import BadMetadata, InvalidArgument, Truncated

__all__ = ["FLOAT_DTYPES", "SafetensorsSource", "SourceTensor"]

#: safetensors dtypes the converter quantizes; every other dtype is left out.
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_HEADER_LIMIT_BYTES = 100 << 20


class SourceTensor(NamedTuple):
    """One tensor of a shard; ``data_start`` is its absolute byte offset in ``shard``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    shard: str
    data_start: int
    nbytes: int


def _read_header(path: str) -> list[SourceTensor]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise Truncated("safetensors file shorter than its 8-byte header length",
                            path=path, offset=len(head))
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, _HEADER_LIMIT_BYTES):
            raise Truncated(f"safetensors header length {header_len} runs past the file "
                            f"({size} bytes)", path=path, offset=0)
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise BadMetadata(f"safetensors header is not JSON ({exc})", path=path,
                              offset=8) from None
    if not isinstance(header, dict):
        raise BadMetadata("safetensors header is not a JSON object", path=path, offset=8)
    base = 8 + header_len
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = str(entry["dtype"])
            shape = tuple(int(d) for d in entry["shape"])
            start, end = (int(v) for v in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise BadMetadata("malformed safetensors header entry", path=path, tensor=name,
                              offset=8) from None
        itemsize = _ITEMSIZE.get(dtype)
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            raise BadMetadata(f"{dtype} {shape} needs {math.prod(shape) * itemsize} bytes, "
                              f"data_offsets give {end - start}", path=path, tensor=name,
                              offset=base + start)
        if not 0 <= start <= end <= size - base:
            raise Truncated(f"data_offsets [{start}, {end}) run past the file", path=path,
                            tensor=name, offset=base + start)
        tensors.append(SourceTensor(name, dtype, shape, path, base + start, end - start))
    tensors.sort(key=lambda t: t.data_start)  # file order: sequential reads
    return tensors


def _read_json(path: Path):
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


class SafetensorsSource:
    """A safetensors model: ``SafetensorsSource(path)`` with ``path`` a ``.safetensors``
    file or a directory holding ``*.safetensors`` shards. ``config``, ``tokenizer``
    (the ``tokenizer.json`` text, ``"{}"`` if absent), ``tokenizer_config`` and
    ``generation_config`` come from the same directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        root = Path(path)
        if root.is_dir():
            shards = sorted(str(p) for p in root.glob("*.safetensors"))
            directory = root
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
        self.config = _read_json(directory / "config.json") or {}
        tokenizer = directory / "tokenizer.json"
        self.tokenizer = tokenizer.read_text(encoding="utf-8") if tokenizer.is_file() else "{}"
        self.tokenizer_config = _read_json(directory / "tokenizer_config.json")
        self.generation_config = _read_json(directory / "generation_config.json")
        # shard path -> safetensors.safe_open handle (a Rust object without type stubs)
        self._handles: dict[str, Any] = {}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def read(self, tensor: SourceTensor,
             index: tuple[slice | int, ...] | None = None) -> np.ndarray:
        """Rows of a floating tensor as float32 (F16 stays float16): ``index`` selects
        along the leading dims (e.g. ``(slice(r0, r1),)``, or ``(e, slice(r0, r1))`` for
        one expert); ``None`` reads it whole."""
        if tensor.dtype == "BF16":
            return self._read_bf16(tensor, index)
        handle = self._handles.get(tensor.shard)
        if handle is None:
            from safetensors import safe_open
            handle = self._handles[tensor.shard] = safe_open(tensor.shard, framework="numpy")
        if index is None:
            array = handle.get_tensor(tensor.name)
        else:
            array = handle.get_slice(tensor.name)[index]
        if tensor.dtype == "F16":
            return np.asarray(array, dtype=np.float16)
        return np.asarray(array, dtype=np.float32)

    def _read_bf16(self, tensor: SourceTensor, index) -> np.ndarray:
        shape = tensor.shape
        # Byte range of the selection: leading ints fix dims, one slice on the next dim.
        index = tuple(index) if index is not None else (slice(None),)
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        start = 0
        out_shape: list[int] = []
        for dim, sel in enumerate(index):
            if isinstance(sel, slice):
                lo, hi, step = sel.indices(shape[dim] if shape else 1)
                if step != 1 or dim != len(index) - 1:
                    raise InvalidArgument("bf16 reads take ints then one contiguous slice")
                start += lo * strides[dim] if shape else 0
                count = (hi - lo) * (strides[dim] if shape else 1)
                out_shape = [hi - lo, *shape[dim + 1:]]
                break
            start += int(sel) * strides[dim]
        else:
            count = strides[len(index) - 1]
            out_shape = list(shape[len(index):])
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

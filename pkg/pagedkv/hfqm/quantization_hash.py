"""``quantization_hash`` of an HFQM file (docs/contracts/hfqm-and-quant.md, '2.7
quantization_hash').

xxh64 (seed 0) over a fixed ASCII tag, then per tensor in index order
``u64 name_len, name, u8 qt, u64 n_dims, u32 dims..., u32 group_size,
u64 data_size, payload``. The writer feeds it as tensors stream; the reader
recomputes it from the mapped payloads.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from pagedkv.hfqm.reader import HfqmFile

__all__ = [
    "HASH_SCOPE",
    "HASH_TAG",
    "QuantizationHasher",
    "compute_quantization_hash",
    "verify_quantization_hash",
]

HASH_TAG = b"hipfire-hfq-quantized-tensor-payload-v1"
HASH_SCOPE = "hfq_tensor_index_and_payload_v1"
_CHUNK_BYTES = 16 << 20


class QuantizationHasher:
    """Incremental docs/contracts/hfqm-and-quant.md, '2.7 quantization_hash' hash: ``begin_tensor``
    with the index fields, then ``update``
    with the payload bytes, tensor after tensor in index order."""

    __slots__ = ("_h", "payload_bytes", "tensor_count")

    def __init__(self) -> None:
        self._h = xxhash.xxh64(seed=0)
        self._h.update(HASH_TAG)
        self.tensor_count = 0
        self.payload_bytes = 0

    def begin_tensor(self, name_utf8: bytes, qt: int, shape: Sequence[int], group_size: int,
                     data_size: int) -> None:
        self._h.update(struct.pack("<Q", len(name_utf8)) + name_utf8
                       + struct.pack(f"<BQ{len(shape)}IIQ", qt, len(shape), *shape,
                                     group_size, data_size))
        self.tensor_count += 1
        self.payload_bytes += data_size

    def update(self, payload) -> None:
        self._h.update(payload)

    def snapshot(self) -> tuple:
        """State to :meth:`restore` after a failed tensor."""
        return (self._h.copy(), self.tensor_count, self.payload_bytes)

    def restore(self, state: tuple) -> None:
        h, self.tensor_count, self.payload_bytes = state
        self._h = h.copy()

    def hexdigest(self) -> str:
        """16 lower-case hex digits."""
        return self._h.hexdigest()

    def metadata_entry(self, producer: dict | None = None) -> dict:
        """The ``quantization_hash`` metadata object, keys in the order upstream emits
        them (sorted, as serde_json writes a map)."""
        from pagedkv import __version__
        producer = producer if producer is not None else {
            "git_branch": None, "git_commit": None, "git_describe": None, "git_dirty": None,
            "package": "pagedkv", "pagedkv_version": __version__,
        }
        return {
            "algorithm": "xxh64",
            "payload_bytes": self.payload_bytes,
            "producer": producer,
            "scope": HASH_SCOPE,
            "seed": 0,
            "tensor_count": self.tensor_count,
            "value": self.hexdigest(),
        }


def compute_quantization_hash(file: HfqmFile | str | os.PathLike[str]) -> str:
    """The docs/contracts/hfqm-and-quant.md, '2.7 quantization_hash' ``value`` (16 hex digits) of an
    open :class:`HfqmFile` or a path,
    whether or not the file stores one."""
    from pagedkv.hfqm.reader import HfqmFile
    if not isinstance(file, HfqmFile):
        with HfqmFile(file) as opened:
            return compute_quantization_hash(opened)
    hasher = QuantizationHasher()
    records = file.records
    for i, name in enumerate(file.names):
        rec = records[i]
        ndim = int(rec["ndim"])
        hasher.begin_tensor(name.encode("utf-8"), int(rec["qt"]),
                            [int(d) for d in rec["shape"][:ndim]], int(rec["group_size"]),
                            int(rec["nbytes"]))
        payload = file.raw(i)
        for start in range(0, len(payload), _CHUNK_BYTES):
            hasher.update(payload[start:start + _CHUNK_BYTES])
    return hasher.hexdigest()


def verify_quantization_hash(file: HfqmFile | str | os.PathLike[str]) -> bool | None:
    """Compare the stored ``quantization_hash.value`` with the payloads: True if equal,
    None if the file stores none. A mismatch (or a malformed entry) raises
    :class:`~pagedkv.errors.BadMetadata` naming both values."""
    from pagedkv.errors import BadMetadata
    from pagedkv.hfqm.reader import HfqmFile
    if not isinstance(file, HfqmFile):
        with HfqmFile(file) as opened:
            return verify_quantization_hash(opened)
    stored = file.metadata.get("quantization_hash")
    if stored is None:
        return None
    value = stored.get("value") if isinstance(stored, dict) else None
    if not isinstance(value, str):
        raise BadMetadata("quantization_hash has no string 'value'", path=file.path,
                          offset=file.base + file.metadata_offset)
    actual = compute_quantization_hash(file)
    if value.lower() != actual:
        raise BadMetadata(f"quantization_hash.value {value} != {actual} computed from the "
                          "tensor index and payloads", path=file.path,
                          offset=file.base + file.metadata_offset)
    return True

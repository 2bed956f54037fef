"""PoolGeometry: the shape, dtype and layout of a paged KV pool (docs/contracts/paged-kv.md, '5.1
Geometry' to '5.3 dtype').

A geometry fixes every byte of the pool: one K and one V array per physical layer, each
``[num_blocks, block_size, num_kv_heads, row]`` where ``row`` is ``head_dim`` elements of the
storage dtype (``head_dim / 32 * 34`` bytes for ``q8``). The dtype *name* is what the pool,
the cold metadata and the fingerprint carry; the storage dtype is what NumPy holds:

============  ==============  ======================================================
dtype name    storage dtype   note
============  ==============  ======================================================
``float16``   ``float16``
``bfloat16``  ``uint16``      bit patterns; widen exactly with ``bits << 16``
``float32``   ``float32``     CPU tests and numerical references only
``q8``        ``uint8``       Q8_0 records: per 32 dims an f16 scale then 32 int8
============  ==============  ======================================================
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["LAYOUTS", "POOL_DTYPES", "Q8_GROUP_BYTES", "Q8_GROUP_DIMS", "PoolGeometry"]

#: dtype name -> NumPy storage dtype of one pool element.
POOL_DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(np.uint16),
    "float32": np.dtype(np.float32),
    "q8": np.dtype(np.uint8),
}

#: Layouts this build stores. "nhd" = token-major [num_blocks, block_size, kv_heads, head_dim].
LAYOUTS = ("nhd",)

#: q8 packs 32 dims into one 34-byte record (f16 scale + 32 int8), docs/contracts/hfqm-and-quant.md,
# '6.3 q8 (K and V)'.
Q8_GROUP_DIMS = 32
Q8_GROUP_BYTES = 34


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentType(
            f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise InvalidArgument(f"{name}: {value} is not positive; it must be >= 1")
    return value


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise InvalidArgumentType(
                f"dtype: {dtype!r} is not a dtype; use one of {sorted(POOL_DTYPES)}") from None
    if name not in POOL_DTYPES:
        raise InvalidArgument(
            f"dtype: {name!r} is not a pool dtype; use one of {sorted(POOL_DTYPES)}")
    return name


@dataclass(frozen=True, slots=True)
class PoolGeometry:
    """Shape and dtype of a paged KV pool.

    ``num_layers`` counts physical layers only (KV-shared alias layers have no slot),
    ``block_size`` is in tokens, ``head_dim`` in elements. ``dtype`` is a name from
    :data:`POOL_DTYPES` (NumPy dtypes ``float16``/``float32`` are accepted and normalized).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"
    layout: str = "nhd"

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            object.__setattr__(self, field, _positive_int(field, getattr(self, field)))
        name = _dtype_name(self.dtype)
        object.__setattr__(self, "dtype", name)
        if self.head_dim % 2:
            raise InvalidArgument(f"head_dim: {self.head_dim} is odd; RoPE needs an even head_dim")
        if name == "q8" and self.head_dim % Q8_GROUP_DIMS:
            raise InvalidArgument(
                f"head_dim: {self.head_dim} is not a multiple of {Q8_GROUP_DIMS}, "
                "which dtype 'q8' requires")
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"layout: {self.layout!r} is not stored by this build; "
                                  f"use one of {list(LAYOUTS)}")

    # -- storage ---------------------------------------------------------------------------

    @property
    def storage_dtype(self) -> np.dtype:
        """NumPy dtype of one stored element (``uint16`` for bfloat16, ``uint8`` for q8)."""
        return POOL_DTYPES[self.dtype]

    @property
    def row_elements(self) -> int:
        """Stored elements per (token, head): ``head_dim``, or ``head_dim / 32 * 34`` for q8."""
        if self.dtype == "q8":
            return self.head_dim // Q8_GROUP_DIMS * Q8_GROUP_BYTES
        return self.head_dim

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row of K or V."""
        return self.row_elements * self.storage_dtype.itemsize

    @property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token's K (or V) in one layer: ``(num_kv_heads, row_elements)``."""
        return (self.num_kv_heads, self.row_elements)

    @property
    def itemsize(self) -> float:
        """Bytes per logical element: 2 (float16, bfloat16), 4 (float32), 34/32 (q8)."""
        return self.row_bytes / self.head_dim

    # -- sizes -----------------------------------------------------------------------------

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V): ``block_size * kv_heads * row_bytes``."""
        return self.block_size * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers (docs/contracts/paged-kv.md, '5.1
        Geometry')."""
        return 2 * self.num_layers * self.slab_bytes

    @property
    def block_buffer_shape(self) -> tuple[int, int, int]:
        """Shape of the uint8 block I/O buffer: ``(num_layers, 2, slab_bytes)``
        (docs/contracts/paged-kv.md, '5.5 Block I/O')."""
        return (self.num_layers, 2, self.slab_bytes)

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) array at ``num_blocks`` blocks."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.row_elements)

    def pool_bytes(self, num_blocks: int) -> int:
        """Bytes of a pool of ``num_blocks`` blocks."""
        return num_blocks * self.bytes_per_block

"""PoolGeometry: the shape, dtype and layout of a paged KV pool (docs/contracts/paged-kv.md, '5.1
Geometry' to '5.3 dtype').

A geometry fixes every byte of the pool: one K and one V array per physical layer, each
``[num_blocks, block_size, num_kv_heads, row]`` where ``row`` is ``head_dim`` elements of the
storage dtype, or the bytes of one quantized record. The dtype *name* is what the pool,
the cold metadata and the fingerprint carry; the storage dtype is what NumPy holds:

=================  ==============  =================================================
dtype name         storage dtype   note
=================  ==============  =================================================
``float16``        ``float16``
``bfloat16``       ``uint16``      bit patterns; widen exactly with ``bits << 16``
``float32``        ``float32``     CPU tests and numerical references only
``q8``             ``uint8``       Q8_0 records: per 32 dims an f16 scale then 32 int8
``<K>/<V>``        ``uint8``       KV-cache modes per side, e.g. ``fwht4/q8``,
                                   ``fwht4/lloyd4`` (docs/kv-quant.md)
=================  ==============  =================================================

With a ``<K>/<V>`` dtype the two sides may have different row sizes (``fwht4/q8`` at
head_dim 128: 68 and 136 bytes); ``k_row_bytes``/``v_row_bytes`` and the other ``k_``/``v_``
properties give each, and the side-agnostic ones (``row_bytes``, ``slab_bytes``, ...) are
defined only when both sides agree.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from pagedkv.argument_checks import is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import kv as kv_modes
from pagedkv.quant import kv_q8

__all__ = ["LAYOUTS", "POOL_DTYPES", "Q8_GROUP_BYTES", "Q8_GROUP_DIMS", "PoolGeometry"]

#: dtype name -> NumPy storage dtype of one pool element (every ``<K>/<V>`` mode pair is
#: ``uint8`` records too).
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
Q8_GROUP_DIMS = kv_q8.BLOCK_VALUES
Q8_GROUP_BYTES = kv_q8.RECORD_BYTES


def _positive_int(name: str, value) -> int:
    if not is_int(value):
        raise InvalidArgumentType(
            f"{name}: expected a positive int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value <= 0:
        raise InvalidArgument(f"{name}: {value} is not positive; it must be >= 1")
    return value


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        name = dtype
    elif dtype is None:  # np.dtype(None) is float64: "dtype 'float64' is not a pool dtype"
        raise InvalidArgumentType(f"dtype: None is not a dtype; use one of "
                                  f"{sorted(POOL_DTYPES)} or '<K mode>/<V mode>'")
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            raise InvalidArgumentType(
                f"dtype: {dtype!r} is not a dtype; use one of {sorted(POOL_DTYPES)} or "
                f"'<K mode>/<V mode>'") from None
    if name not in POOL_DTYPES:
        try:
            k, v = kv_modes.split_kv_dtype(name)
        except InvalidArgument as exc:
            raise InvalidArgument(f"dtype: {exc}") from None
        name = kv_modes.join_kv_dtype(k, v)
    return name


def _side_row(side: str, head_dim: int) -> int:
    """Stored elements of one (token, head) row of one side."""
    if side in POOL_DTYPES and side != "q8":
        return head_dim
    return kv_modes.side_row_bytes(side, head_dim)


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
        for side in dict.fromkeys(kv_modes.split_kv_dtype(name)):
            if side in kv_modes.KV_MODES and not kv_modes.KV_MODES[side].supports(self.head_dim):
                raise InvalidArgument(
                    f"head_dim: {self.head_dim} cannot be stored as {side!r} (dtype {name!r}); "
                    f"{side} needs head_dim {kv_modes.KV_MODES[side].head_dims()}")
        if self.layout not in LAYOUTS:
            raise InvalidArgument(f"layout: {self.layout!r} is not stored by this build; "
                                  f"use one of {list(LAYOUTS)}")

    # -- storage ---------------------------------------------------------------------------

    @property
    def k_dtype(self) -> str:
        """The K side's dtype or KV mode (``"fwht4"`` of ``"fwht4/q8"``)."""
        return kv_modes.split_kv_dtype(self.dtype)[0]

    @property
    def v_dtype(self) -> str:
        """The V side's dtype or KV mode (``"q8"`` of ``"fwht4/q8"``)."""
        return kv_modes.split_kv_dtype(self.dtype)[1]

    @property
    def quantized(self) -> bool:
        """Whether the pool stores KV-mode records (q8 or a ``<K>/<V>`` pair)."""
        return self.storage_dtype == np.uint8

    @property
    def storage_dtype(self) -> np.dtype:
        """NumPy dtype of one stored element (``uint16`` for bfloat16, ``uint8`` for records)."""
        return POOL_DTYPES.get(self.dtype, np.dtype(np.uint8))

    @property
    def k_row_elements(self) -> int:
        """Stored elements per (token, head) of K: ``head_dim``, or the record bytes."""
        return _side_row(self.k_dtype, self.head_dim)

    @property
    def v_row_elements(self) -> int:
        """Stored elements per (token, head) of V."""
        return _side_row(self.v_dtype, self.head_dim)

    @property
    def symmetric(self) -> bool:
        """Whether K and V rows have the same size (always, except for some ``<K>/<V>``)."""
        return self.k_row_elements == self.v_row_elements

    def _same(self, what: str) -> None:
        if not self.symmetric:
            raise InvalidArgument(
                f"{what}: K and V rows differ for dtype {self.dtype!r} ({self.k_row_bytes} and "
                f"{self.v_row_bytes} bytes); use k_{what} / v_{what}")

    @property
    def row_elements(self) -> int:
        """Stored elements per (token, head) of K or V (equal sides only)."""
        self._same("row_elements")
        return self.k_row_elements

    @property
    def k_row_bytes(self) -> int:
        """Bytes of one (token, head) row of K."""
        return self.k_row_elements * self.storage_dtype.itemsize

    @property
    def v_row_bytes(self) -> int:
        """Bytes of one (token, head) row of V."""
        return self.v_row_elements * self.storage_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) row of K or V (equal sides only)."""
        self._same("row_bytes")
        return self.k_row_bytes

    @property
    def k_token_shape(self) -> tuple[int, int]:
        """Shape of one token's K in one layer: ``(num_kv_heads, k_row_elements)``."""
        return (self.num_kv_heads, self.k_row_elements)

    @property
    def v_token_shape(self) -> tuple[int, int]:
        """Shape of one token's V in one layer: ``(num_kv_heads, v_row_elements)``."""
        return (self.num_kv_heads, self.v_row_elements)

    @property
    def token_shape(self) -> tuple[int, int]:
        """Shape of one token's K (or V) in one layer (equal sides only)."""
        self._same("token_shape")
        return self.k_token_shape

    @property
    def itemsize(self) -> float:
        """Bytes per logical element, K and V averaged: 2 (float16, bfloat16), 4 (float32),
        34/32 (q8), (4 + hd/2)/hd for fwht4 ..."""
        return (self.k_row_bytes + self.v_row_bytes) / (2 * self.head_dim)

    # -- sizes -----------------------------------------------------------------------------

    @property
    def k_slab_bytes(self) -> int:
        """Bytes of one block of one layer's K: ``block_size * kv_heads * k_row_bytes``."""
        return self.block_size * self.num_kv_heads * self.k_row_bytes

    @property
    def v_slab_bytes(self) -> int:
        """Bytes of one block of one layer's V."""
        return self.block_size * self.num_kv_heads * self.v_row_bytes

    @property
    def slab_bytes(self) -> int:
        """Bytes of one block of one layer's K (or V) (equal sides only)."""
        self._same("slab_bytes")
        return self.k_slab_bytes

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers."""
        return self.num_layers * self.num_kv_heads * (self.k_row_bytes + self.v_row_bytes)

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers (docs/contracts/paged-kv.md, '5.1
        Geometry')."""
        return self.num_layers * (self.k_slab_bytes + self.v_slab_bytes)

    @property
    def block_buffer_shape(self) -> tuple[int, ...]:
        """Shape of the uint8 block I/O buffer: ``(num_layers, 2, slab_bytes)``
        (docs/contracts/paged-kv.md, '5.5 Block I/O'), or
        ``(num_layers, k_slab_bytes + v_slab_bytes)`` when K and V rows differ. The bytes are
        the same either way: per layer in pool order, its K slab then its V slab."""
        if self.symmetric:
            return (self.num_layers, 2, self.k_slab_bytes)
        return (self.num_layers, self.k_slab_bytes + self.v_slab_bytes)

    def k_layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K array at ``num_blocks`` blocks."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.k_row_elements)

    def v_layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's V array at ``num_blocks`` blocks."""
        return (num_blocks, self.block_size, self.num_kv_heads, self.v_row_elements)

    def layer_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        """Shape of one layer's K (or V) array at ``num_blocks`` blocks (equal sides only)."""
        self._same("layer_shape")
        return self.k_layer_shape(num_blocks)

    def pool_bytes(self, num_blocks: int) -> int:
        """Bytes of a pool of ``num_blocks`` blocks."""
        return num_blocks * self.bytes_per_block

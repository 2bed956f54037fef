"""Layer KV-cache specs and their validation (docs/coordinator.md, "Layer specs" and
"Topology errors").

A model declares one :class:`LayerKVCacheSpec` per attention layer: its attention kind (full
or sliding with a window in tokens), its physical K/V layout, and optionally the layer whose
K/V it shares (a KV-shared alias). :func:`validate_layer_kv_cache_specs` checks a whole set
and raises the :class:`~pagedkv.errors.TopologyError` subclass that names the offending
indices.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.argument_checks import is_int, items_argument
from pagedkv.errors import (
    DuplicateLayer,
    InvalidArgument,
    InvalidArgumentType,
    InvalidLayout,
    MissingSharedKVAnchor,
    SharedKVAnchorIsAlias,
    SharedKVIncompatible,
)
from pagedkv.pool import POOL_DTYPES, PoolGeometry

__all__ = [
    "AttentionKind",
    "KVCachePhysicalLayout",
    "LayerKVCacheSpec",
    "validate_layer_kv_cache_specs",
]


def _int(name: str, value) -> int:
    if not is_int(value):
        raise InvalidArgumentType(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def _check_kind_layout(kind, layout) -> None:
    if not isinstance(kind, AttentionKind):
        raise InvalidArgumentType(f"kind must be an AttentionKind, got {type(kind).__name__}")
    if not isinstance(layout, KVCachePhysicalLayout):
        raise InvalidArgumentType(
            f"layout must be a KVCachePhysicalLayout, got {type(layout).__name__}")


@functools.total_ordering
class AttentionKind:
    """Full attention, or sliding-window attention over the last ``window`` tokens.

    ``AttentionKind.FULL`` orders before every sliding kind; sliding kinds order by window.
    Immutable and hashable (a group key)."""

    __slots__ = ("_window",)
    FULL: AttentionKind

    def __init__(self, window: int = 0) -> None:
        # 0 is FULL; public construction goes through FULL and sliding().
        self._window = window

    @classmethod
    def sliding(cls, window: int) -> AttentionKind:
        """Sliding-window attention: a query at position ``p`` attends ``(p - window, p]``.
        ``window`` is in tokens, >= 1 (else ``InvalidArgument``)."""
        window = _int("window", window)
        if window < 1:
            raise InvalidArgument(f"window = {window}: a sliding window holds >= 1 token")
        return cls(window)

    @property
    def is_full(self) -> bool:
        return self._window == 0

    @property
    def is_sliding(self) -> bool:
        return self._window > 0

    @property
    def window(self) -> int | None:
        """The window in tokens, ``None`` for full attention."""
        return self._window or None

    def _key(self) -> tuple[int, int]:
        return (0, 0) if self._window == 0 else (1, self._window)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AttentionKind) and self._window == other._window

    def __lt__(self, other: AttentionKind) -> bool:
        if not isinstance(other, AttentionKind):
            return NotImplemented
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(("AttentionKind", self._window))

    def __repr__(self) -> str:
        return "AttentionKind.FULL" if self._window == 0 else \
            f"AttentionKind.sliding({self._window})"

    def __reduce__(self):
        return (AttentionKind, (self._window,))


AttentionKind.FULL = AttentionKind(0)


@dataclass(frozen=True, order=True)
class KVCachePhysicalLayout:
    """How one layer's K/V sit in a pool block: ``block_size`` tokens of ``num_kv_heads`` x
    ``head_dim`` elements of ``dtype`` (a pool dtype name: ``float16``, ``bfloat16``,
    ``float32``, ``q8``, or a ``<K mode>/<V mode>`` pair of docs/kv-quant.md).

    A layout may be built with non-positive sizes (so a model's whole spec set can be checked
    at once); :attr:`is_valid` says whether every size is > 0 and the dtype is a pool dtype,
    and validation raises :class:`~pagedkv.errors.InvalidLayout` naming the layer. Two
    layouts are compatible only when every field is equal."""

    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _int(name, getattr(self, name)))
        if not isinstance(self.dtype, str):
            raise InvalidArgumentType(
                f"dtype must be a pool dtype name (one of {sorted(POOL_DTYPES)}), got "
                f"{type(self.dtype).__name__}")

    @property
    def is_valid(self) -> bool:
        if self.block_size <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            return False
        if self.dtype in POOL_DTYPES:
            return True
        from pagedkv.quant import kv as kv_modes

        try:  # a KV mode pair ('<K mode>/<V mode>': docs/kv-quant.md); whether head_dim
            kv_modes.split_kv_dtype(self.dtype)  # suits it is the pool geometry's check
        except InvalidArgument:
            return False
        return True

    def pool_geometry(self, num_layers: int) -> PoolGeometry:
        """The :class:`~pagedkv.pool.PoolGeometry` of a pool holding ``num_layers`` physical
        layers of this layout."""
        return PoolGeometry(num_layers, self.num_kv_heads, self.head_dim, self.block_size,
                            self.dtype)

    @property
    def bytes_per_block_per_layer(self) -> int:
        """K and V bytes of one block of one layer: ``2 * kv_heads * head_dim * block_size *
        itemsize`` (q8 counts its 34-byte records per 32 elements)."""
        return self.pool_geometry(1).bytes_per_block


@dataclass(frozen=True)
class LayerKVCacheSpec:
    """One attention layer: its index, kind, physical layout and, for a KV-shared alias, the
    anchor layer whose K/V it reads (``shared_kv_anchor``). The physical layer is the anchor
    when one is set, else the layer itself."""

    layer_index: int
    kind: AttentionKind
    layout: KVCachePhysicalLayout
    shared_kv_anchor: int | None = None

    def __post_init__(self) -> None:
        index = _int("layer_index", self.layer_index)
        if index < 0:
            raise InvalidArgument(f"layer_index = {index} must be >= 0")
        object.__setattr__(self, "layer_index", index)
        _check_kind_layout(self.kind, self.layout)
        if self.shared_kv_anchor is not None:
            object.__setattr__(self, "shared_kv_anchor",
                               _int("shared_kv_anchor", self.shared_kv_anchor))

    @property
    def is_alias(self) -> bool:
        return self.shared_kv_anchor is not None

    @property
    def physical_layer_index(self) -> int:
        return self.layer_index if self.shared_kv_anchor is None else self.shared_kv_anchor


def validate_layer_kv_cache_specs(specs: Iterable[LayerKVCacheSpec]
                                  ) -> tuple[LayerKVCacheSpec, ...]:
    """The specs sorted by layer index, after checking, in this order (each check over every
    layer before the next, lowest layer first):

    * ``DuplicateLayer(layer)``: one index declared twice;
    * ``InvalidLayout(layer)``: a size <= 0 or an unknown dtype;
    * ``MissingSharedKVAnchor(layer, anchor)``: the anchor is not declared;
    * ``SharedKVAnchorIsAlias(layer, anchor, anchor_of_anchor)``: aliases do not chain (a
      layer naming itself is one: ``(layer, layer, layer)``);
    * ``SharedKVIncompatible(layer, anchor)``: the anchor's kind or layout differs.
    """
    items = items_argument("specs", specs)
    for i, s in enumerate(items):
        if not isinstance(s, LayerKVCacheSpec):
            raise InvalidArgumentType(
                f"specs[{i}] must be a LayerKVCacheSpec, got {type(s).__name__}")
    by_layer: dict[int, LayerKVCacheSpec] = {}
    for s in items:
        if s.layer_index in by_layer:
            raise DuplicateLayer(s.layer_index)
        by_layer[s.layer_index] = s
    ordered = tuple(by_layer[i] for i in sorted(by_layer))
    for s in ordered:
        if not s.layout.is_valid:
            raise InvalidLayout(s.layer_index)
    for s in ordered:
        anchor = s.shared_kv_anchor
        if anchor is None:
            continue
        if anchor == s.layer_index:
            raise SharedKVAnchorIsAlias(s.layer_index, anchor, anchor)
        if anchor not in by_layer:
            raise MissingSharedKVAnchor(s.layer_index, anchor)
    for s in ordered:
        anchor = s.shared_kv_anchor
        if anchor is None:
            continue
        anchor_of_anchor = by_layer[anchor].shared_kv_anchor
        if anchor_of_anchor is not None:
            raise SharedKVAnchorIsAlias(s.layer_index, anchor, anchor_of_anchor)
    for s in ordered:
        anchor = s.shared_kv_anchor
        if anchor is not None and (by_layer[anchor].kind != s.kind
                                   or by_layer[anchor].layout != s.layout):
            raise SharedKVIncompatible(s.layer_index, anchor)
    return ordered

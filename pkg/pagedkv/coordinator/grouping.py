"""Grouping layer specs into KV-cache groups, with each group's admission blocks
(docs/coordinator.md, "Grouping and admission blocks").

Layers of one attention kind and one physical layout share a group: one block table per
sequence, one allocator and one pool. Groups are ordered by ``(kind, layout)`` so group ids
are deterministic and full-attention groups come first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedkv.coordinator.specs import (
    AttentionKind,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    _check_kind_layout,
    _int,
    validate_layer_kv_cache_specs,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = ["KVCacheGroupSpec", "group_layer_kv_cache_specs", "max_admission_blocks"]


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group.

    layer_indices: every member layer, sorted (KV-shared aliases included).
    physical_layer_indices: the members that own K/V (aliases excluded), sorted; the pool
    of the group holds them in this order, so a layer's *physical ordinal* is its position
    here.
    max_admission_blocks: the most blocks one sequence of ``max_model_len`` tokens holds in
    this group at once (:func:`max_admission_blocks`).
    """

    group_id: int
    kind: AttentionKind
    layout: KVCachePhysicalLayout
    layer_indices: tuple[int, ...]
    physical_layer_indices: tuple[int, ...]
    max_admission_blocks: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_id", _int("group_id", self.group_id))
        _check_kind_layout(self.kind, self.layout)
        for name in ("layer_indices", "physical_layer_indices"):
            object.__setattr__(self, name,
                               tuple(_int(f"{name}[{i}]", v)
                                     for i, v in enumerate(getattr(self, name))))
        object.__setattr__(self, "max_admission_blocks",
                           _int("max_admission_blocks", self.max_admission_blocks))

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_physical_layers(self) -> int:
        return len(self.physical_layer_indices)

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over the group's physical layers (``bpb(g)`` of
        docs/coordinator.md, "Pool budget and admission width")."""
        return self.layout.bytes_per_block_per_layer * len(self.physical_layer_indices)


def max_admission_blocks(kind: AttentionKind, block_size: int, max_model_len: int,
                         max_chunk: int) -> int:
    """Blocks one sequence can hold at once in a group of ``kind``:

    * full: ``ceil(max_model_len / block_size)``;
    * sliding: ``ceil(min(window - 1 + max_chunk, max_model_len) / block_size) + 1`` (the
      window behind a prefill chunk of ``max_chunk`` tokens, plus one block it straddles).

    ``block_size``, ``max_model_len`` and ``max_chunk`` are tokens and must be >= 1 (else
    ``InvalidArgument``). C1: full (4,096, bs 16) → 256; sliding (window 128, 4,096, chunk 32,
    bs 16) → 11.
    """
    if not isinstance(kind, AttentionKind):
        raise InvalidArgumentType(f"kind must be an AttentionKind, got {type(kind).__name__}")
    for name, value in (("block_size", block_size), ("max_model_len", max_model_len),
                        ("max_chunk", max_chunk)):
        if _int(name, value) < 1:
            raise InvalidArgument(f"{name} = {value} must be >= 1")
    if kind.is_full:
        return -(-max_model_len // block_size)
    window = kind.window
    assert window is not None
    return -(-min(window - 1 + max_chunk, max_model_len) // block_size) + 1


def group_layer_kv_cache_specs(specs: Iterable[LayerKVCacheSpec], max_model_len: int,
                               max_chunk: int) -> list[KVCacheGroupSpec]:
    """Validate ``specs`` (:func:`~pagedkv.coordinator.validate_layer_kv_cache_specs`) and
    group them by ``(kind, layout)``, in sorted key order: group ids are deterministic and
    full groups come first. A KV-shared alias joins its anchor's group (it has the same kind
    and layout) but is not a physical layer of it. ``max_model_len`` and ``max_chunk`` (the
    largest prefill chunk, in tokens) size each group's admission blocks."""
    ordered = validate_layer_kv_cache_specs(specs)
    members: dict[tuple[AttentionKind, KVCachePhysicalLayout], list[LayerKVCacheSpec]] = {}
    for s in ordered:
        members.setdefault((s.kind, s.layout), []).append(s)
    groups = []
    for gid, key in enumerate(sorted(members, key=lambda k: (k[0], k[1]))):
        kind, layout = key
        layer_specs = members[key]
        groups.append(KVCacheGroupSpec(
            gid, kind, layout,
            tuple(s.layer_index for s in layer_specs),
            tuple(s.layer_index for s in layer_specs if not s.is_alias),
            max_admission_blocks(kind, layout.block_size, max_model_len, max_chunk)))
    return groups

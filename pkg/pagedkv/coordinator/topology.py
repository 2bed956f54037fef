"""``KVCacheCoordinator``: layer specs, groups, routes and one manager per group, checked
to agree (docs/coordinator.md, "Routes" and "Topology errors").

The coordinator is the wiring, not the runtime: it knows which group and which physical
slot every layer's K/V lives in, and it holds one manager per group (whatever object the
engine runs a group with). :class:`~pagedkv.coordinator.GroupedKVCoordinator` is the runtime
built on it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from pagedkv.coordinator.grouping import KVCacheGroupSpec
from pagedkv.coordinator.specs import (
    AttentionKind,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    _int,
    validate_layer_kv_cache_specs,
)
from pagedkv.errors import (
    DuplicateLayer,
    IncompatibleGroupLayer,
    InvalidArgument,
    InvalidArgumentType,
    ManagerCountMismatch,
    MissingLayerAssignment,
    NonContiguousGroupIds,
)

__all__ = ["KVCacheCoordinator", "LayerKVCacheRoute"]

M = TypeVar("M")


@dataclass(frozen=True)
class LayerKVCacheRoute:
    """Where a layer's K/V live: group ``group_id``, physical layer
    ``physical_layer_index``, which is entry ``physical_layer_ordinal`` of the group's
    physical layers (the layer index inside the group's pool). An alias
    (``shared_kv_anchor`` set) routes to its anchor's slot and owns none."""

    layer_index: int
    group_id: int
    kind: AttentionKind
    layout: KVCachePhysicalLayout
    physical_layer_index: int
    physical_layer_ordinal: int
    shared_kv_anchor: int | None

    @property
    def is_alias(self) -> bool:
        return self.shared_kv_anchor is not None


class KVCacheCoordinator(Generic[M]):
    """Validated specs + groups + one manager per group, and the per-layer routes.

    Build it with :meth:`from_groups`. ``route_for_layer(i)`` is a binary search over the
    sorted layer indices; ``manager_for_layer(i)`` is the manager of the layer's group.
    """

    __slots__ = ("_groups", "_layers", "_managers", "_routes", "_specs")

    def __init__(self, specs: tuple[LayerKVCacheSpec, ...], groups: tuple[KVCacheGroupSpec, ...],
                 managers: tuple[M, ...], routes: tuple[LayerKVCacheRoute, ...]) -> None:
        # Use from_groups: it checks that these agree.
        self._specs = specs
        self._groups = groups
        self._managers = managers
        self._routes = routes
        self._layers = [r.layer_index for r in routes]

    @classmethod
    def from_groups(cls, specs: Iterable[LayerKVCacheSpec], groups: Iterable[KVCacheGroupSpec],
                    managers: Sequence[M]) -> KVCacheCoordinator[M]:
        """Check that ``groups`` and ``managers`` implement ``specs`` and build the routes.

        Raises, in this order: the spec errors of
        :func:`~pagedkv.coordinator.validate_layer_kv_cache_specs`;
        ``NonContiguousGroupIds`` (ids not exactly ``0 .. n-1``);
        ``ManagerCountMismatch(len(groups), len(managers))``;
        per group in id order, per member layer: ``IncompatibleGroupLayer(group, layer)``
        when the layer has no spec or its kind or layout is not the group's,
        ``DuplicateLayer(layer)`` when a second group claims it, and
        ``IncompatibleGroupLayer(group, layer)`` when the group's physical layers are not
        exactly its non-alias members, or an alias's anchor is in another group;
        finally ``MissingLayerAssignment(layer)`` for the lowest spec no group claims.
        """
        ordered = validate_layer_kv_cache_specs(specs)
        by_layer = {s.layer_index: s for s in ordered}
        group_list = list(groups)
        for i, g in enumerate(group_list):
            if not isinstance(g, KVCacheGroupSpec):
                raise InvalidArgumentType(
                    f"groups[{i}] must be a KVCacheGroupSpec, got {type(g).__name__}")
        ids = sorted(g.group_id for g in group_list)
        if ids != list(range(len(group_list))):
            raise NonContiguousGroupIds(
                f"group ids must be exactly 0..{len(group_list) - 1} without gaps or repeats, "
                f"got {ids}")
        group_list.sort(key=lambda g: g.group_id)
        manager_list = tuple(managers)
        if len(manager_list) != len(group_list):
            raise ManagerCountMismatch(len(group_list), len(manager_list))
        owner: dict[int, int] = {}
        for g in group_list:
            for layer in g.layer_indices:
                spec = by_layer.get(layer)
                if spec is None:
                    raise IncompatibleGroupLayer(g.group_id, layer,
                                                 "the layer has no LayerKVCacheSpec")
                if layer in owner:
                    raise DuplicateLayer(layer)
                if spec.kind != g.kind or spec.layout != g.layout:
                    raise IncompatibleGroupLayer(g.group_id, layer)
                owner[layer] = g.group_id
        for g in group_list:
            expected = sorted(x for x in g.layer_indices if not by_layer[x].is_alias)
            if list(g.physical_layer_indices) != expected:
                bad = sorted(set(g.physical_layer_indices) ^ set(expected))
                raise IncompatibleGroupLayer(
                    g.group_id, bad[0] if bad else g.layer_indices[0],
                    f"physical_layer_indices {list(g.physical_layer_indices)} are not the "
                    f"group's non-alias members {expected} in order")
            for x in g.layer_indices:
                anchor = by_layer[x].shared_kv_anchor
                if anchor is not None and owner.get(anchor) != g.group_id:
                    raise IncompatibleGroupLayer(
                        g.group_id, x, f"its anchor {anchor} is in group {owner.get(anchor)}")
        for s in ordered:
            if s.layer_index not in owner:
                raise MissingLayerAssignment(s.layer_index)
        routes = []
        for s in ordered:
            g = group_list[owner[s.layer_index]]
            physical = s.physical_layer_index
            routes.append(LayerKVCacheRoute(
                s.layer_index, g.group_id, g.kind, g.layout, physical,
                g.physical_layer_indices.index(physical), s.shared_kv_anchor))
        return cls(ordered, tuple(group_list), manager_list, tuple(routes))

    # --- accessors -------------------------------------------------------------------------

    @property
    def specs(self) -> tuple[LayerKVCacheSpec, ...]:
        """The layer specs, sorted by layer index."""
        return self._specs

    @property
    def groups(self) -> tuple[KVCacheGroupSpec, ...]:
        """The groups, in id order."""
        return self._groups

    @property
    def managers(self) -> tuple[M, ...]:
        """One manager per group, in group id order."""
        return self._managers

    @property
    def routes(self) -> tuple[LayerKVCacheRoute, ...]:
        """One route per layer, sorted by layer index."""
        return self._routes

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    def route_for_layer(self, layer: int) -> LayerKVCacheRoute:
        """The route of ``layer`` (binary search); an undeclared layer → ``InvalidArgument``."""
        layer = _int("layer", layer)
        i = bisect.bisect_left(self._layers, layer)
        if i == len(self._layers) or self._layers[i] != layer:
            raise InvalidArgument(
                f"layer {layer} has no KV-cache route; declared layers: "
                f"{self._layers[:8]}{' ...' if len(self._layers) > 8 else ''}")
        return self._routes[i]

    def manager_for_layer(self, layer: int) -> M:
        """The manager of ``layer``'s group (an alias's is its anchor's)."""
        return self._managers[self.route_for_layer(layer).group_id]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{g.group_id}: {g.kind!r} bs {g.block_size} x "
                          f"{len(g.physical_layer_indices)} layers" for g in self._groups)
        return f"KVCacheCoordinator({len(self._routes)} layers; groups {{{kinds}}})"

"""Hybrid models: layer specs, KV-cache groups, routes and the grouped runtime
(docs/coordinator.md).

* ``specs``: ``AttentionKind``, ``KVCachePhysicalLayout``, ``LayerKVCacheSpec`` and
  ``validate_layer_kv_cache_specs`` (every ``TopologyError`` with its indices);
* ``grouping``: ``group_layer_kv_cache_specs`` and ``max_admission_blocks``;
* ``topology``: ``KVCacheCoordinator.from_groups`` and ``LayerKVCacheRoute``;
* ``budget``: ``plan_pool_budget`` (minimum pool and admission width).
"""

from __future__ import annotations

from pagedkv.coordinator.budget import MAX_ADMISSION_WIDTH, PoolBudget, plan_pool_budget
from pagedkv.coordinator.grouping import (
    KVCacheGroupSpec,
    group_layer_kv_cache_specs,
    max_admission_blocks,
)
from pagedkv.coordinator.specs import (
    AttentionKind,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    validate_layer_kv_cache_specs,
)
from pagedkv.coordinator.topology import KVCacheCoordinator, LayerKVCacheRoute

__all__ = [
    "MAX_ADMISSION_WIDTH",
    "AttentionKind",
    "KVCacheCoordinator",
    "KVCacheGroupSpec",
    "KVCachePhysicalLayout",
    "LayerKVCacheRoute",
    "LayerKVCacheSpec",
    "PoolBudget",
    "group_layer_kv_cache_specs",
    "max_admission_blocks",
    "plan_pool_budget",
    "validate_layer_kv_cache_specs",
]

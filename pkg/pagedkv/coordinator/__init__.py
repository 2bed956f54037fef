"""Hybrid models: layer specs, KV-cache groups, routes and the grouped runtime
(docs/coordinator.md).

* ``specs``: ``AttentionKind``, ``KVCachePhysicalLayout``, ``LayerKVCacheSpec`` and
  ``validate_layer_kv_cache_specs`` (every ``TopologyError`` with its indices);
* ``grouping``: ``group_layer_kv_cache_specs`` and ``max_admission_blocks``;
* ``topology``: ``KVCacheCoordinator.from_groups`` and ``LayerKVCacheRoute``;
* ``budget``: ``plan_pool_budget`` (minimum pool and admission width);
* ``sliding``: ``SlidingGroupBlocks``, a sliding-window group's tables with the null sentinel;
* ``grouped``: ``GroupedKVCoordinator``, the lifecycle of a hybrid model over its groups;
* ``checkpoints``: ``StateCheckpointStore``, recurrent-state checkpoints keyed like blocks;
* ``scheduling``: ``RecomputeScheduler``, admission and recompute preemption.
"""

from __future__ import annotations

from pagedkv.adapter.admission import (
    DEFAULT_WATERMARK_FRACTION,
    AdmissionDecision,
    reservation_blocks,
)
from pagedkv.coordinator.budget import MAX_ADMISSION_WIDTH, PoolBudget, plan_pool_budget
from pagedkv.coordinator.checkpoints import Checkpoint, StateCheckpointStore
from pagedkv.coordinator.grouped import GroupedKVCoordinator
from pagedkv.coordinator.grouping import (
    KVCacheGroupSpec,
    group_layer_kv_cache_specs,
    max_admission_blocks,
)
from pagedkv.coordinator.scheduling import (
    Admission,
    RecomputeScheduler,
    RequestStatus,
    ScheduledRequest,
)
from pagedkv.coordinator.sliding import SlidingGroupBlocks, expired_blocks
from pagedkv.coordinator.specs import (
    AttentionKind,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    validate_layer_kv_cache_specs,
)
from pagedkv.coordinator.topology import KVCacheCoordinator, LayerKVCacheRoute

__all__ = [
    "DEFAULT_WATERMARK_FRACTION",
    "MAX_ADMISSION_WIDTH",
    "Admission",
    "AdmissionDecision",
    "AttentionKind",
    "Checkpoint",
    "GroupedKVCoordinator",
    "KVCacheCoordinator",
    "KVCacheGroupSpec",
    "KVCachePhysicalLayout",
    "LayerKVCacheRoute",
    "LayerKVCacheSpec",
    "PoolBudget",
    "RecomputeScheduler",
    "RequestStatus",
    "ScheduledRequest",
    "SlidingGroupBlocks",
    "StateCheckpointStore",
    "expired_blocks",
    "group_layer_kv_cache_specs",
    "max_admission_blocks",
    "plan_pool_budget",
    "reservation_blocks",
    "validate_layer_kv_cache_specs",
]

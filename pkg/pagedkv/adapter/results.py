"""The values the request lifecycle hands back (docs/adapter.md, "Lifecycle").

Plain NamedTuples: cheap to build once per call, easy to compare in tests.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import numpy as np

__all__ = ["DecodeBatch", "PrefixLookup", "TurnPlan", "TurnPlanReason"]


class PrefixLookup(NamedTuple):
    """Result of ``find_cached_prefix``.

    cached_tokens: positions whose K/V the tables now hold (a block boundary of every group).
    hot_blocks: int32 ids the in-process prefix cache served (the first full-attention
    group's; a grouped coordinator's per-group tables are in ``block_table``).
    restored_blocks: int32 ids the cold tier restored after them (empty without a cold tier).
    sidecar: the out-of-pool state valid at exactly ``cached_tokens``, or ``None``: a cold
    sidecar, or the :class:`~pagedkv.coordinator.Checkpoint` of an in-memory checkpoint
    store (its ``boundary_tokens`` equals ``cached_tokens``).
    """

    cached_tokens: int
    hot_blocks: np.ndarray
    restored_blocks: np.ndarray
    sidecar: Any


class DecodeBatch(NamedTuple):
    """What a paged-attention decode kernel needs for one step (docs/adapter.md, "Block
    tables and decode batches").

    block_tables: ``int32[n, width]``, row ``i`` the table of ``seq_ids[i]``, ``-1`` padded
    (a sliding group's expired entries hold its null block id).
    seq_lens: ``int32[n]`` tokens of each sequence, this step's token included.
    slot_mapping: ``int64[n]`` the slot (``block * block_size + offset``) of each sequence's
    last position, where this step's K/V goes.
    generation: the pool generation the ids belong to; a grow makes the batch stale.
    pool_instance: the :attr:`~pagedkv.pool.LayerKVPool.instance_id` of the pool the
    adapter writes: the ids index that pool only. ``None`` (the default, for a batch built
    by hand): not bound to a pool, the kernels take it with any pool that can back its ids.
    """

    block_tables: np.ndarray
    seq_lens: np.ndarray
    slot_mapping: np.ndarray
    generation: int
    pool_instance: int | None = None


class TurnPlanReason(enum.Enum):
    CONTINUED_LIVE_PREFIX = "continued_live_prefix"
    FRESH_RESET = "fresh_reset"
    CONTINUE_FAILED_RESET = "continue_failed_reset"


class TurnPlan(NamedTuple):
    """Result of ``prepare_turn``: how many prompt tokens the tables already hold (compute
    only ``prompt[cached_tokens:]``) and why."""

    reason: TurnPlanReason
    cached_tokens: int
    newly_allocated: int

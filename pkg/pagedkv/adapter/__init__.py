"""The request lifecycle over paged KV groups (docs/adapter.md).

``PagedKVCacheAdapter`` is the single-group cache most engines use; the modules below are
what it and the grouped coordinator (``pagedkv.coordinator``) share:

* ``sequence_rows``: per-request state rows (tokens, cursor, flags), shared by all groups;
* ``group_blocks``: one group's allocator, pool and block tables;
* ``lifecycle``: the lifecycle over one or more groups (cursor rule, lookups, latch);
* ``turns``: the multi-turn policy (``prepare_turn``, ``restart_prepared_turn_cold``);
* ``cold_hooks``: how a cold tier plugs in (the core never imports ``pagedkv.cold``);
* ``kv_io``: K/V scatter and gather; ``admission``: reservations and ``can_admit``;
* ``table_ops`` (Cython): the per-step block-table loops;
* ``results``: the values calls return.
"""

from __future__ import annotations

from pagedkv.adapter.cold_hooks import ColdHooks, ColdRestore
from pagedkv.adapter.paged_adapter import PagedKVCacheAdapter
from pagedkv.adapter.results import DecodeBatch, PrefixLookup, TurnPlan, TurnPlanReason

__all__ = ["ColdHooks", "ColdRestore", "DecodeBatch", "PagedKVCacheAdapter", "PrefixLookup",
           "TurnPlan", "TurnPlanReason"]

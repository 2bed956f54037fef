"""The implementations the hashing and allocator acceptance tests run against.

The pure-Python oracle (``tests/allocator_oracle.py``) and the Cython core (``pagedkv.hashing``,
``pagedkv.allocator``) must agree on every observable; scenario tests are parametrized over
both, and :func:`observables` is what the differential test compares after every step.
Both are required: a build without the Cython core fails here instead of skipping.
"""

from __future__ import annotations

import pytest

import allocator_oracle
from pagedkv import allocator, hashing

#: Modules exposing hot_block_hash, chain_hashes and salt_domain_id.
HASHING = [pytest.param(allocator_oracle, id="oracle"), pytest.param(hashing, id="cython")]

#: BlockAllocator classes, the oracle first.
ALLOCATORS = [pytest.param(allocator_oracle.BlockAllocator, id="oracle"),
              pytest.param(allocator.BlockAllocator, id="cython")]


def observables(alloc) -> dict:
    """Everything a caller can see without changing the allocator."""
    null = alloc.null_block_id
    return {
        "num_blocks": alloc.num_blocks,
        "max_num_blocks": alloc.max_num_blocks,
        "block_size": alloc.block_size,
        "null_block_id": null,
        "num_free_blocks": alloc.num_free_blocks,
        "num_allocated_blocks": alloc.num_allocated_blocks,
        "num_evictable_blocks": alloc.num_evictable_blocks,
        "free_or_evictable_blocks": alloc.free_or_evictable_blocks,
        "prefix_cache_len": alloc.prefix_cache_len,
        "prefix_cache_capacity": alloc.prefix_cache_capacity,
        "ref_counts": [alloc.ref_count(b) for b in range(alloc.num_blocks) if b != null],
        "lru_hashes": list(alloc.lru_hashes()),
        "free_list": list(alloc.free_list()),
        "stats": dict(alloc.stats()),
    }

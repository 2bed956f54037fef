"""The oracle's own checks: ``check_invariants`` catches every kind of broken state.

The differential test trusts ``allocator_oracle.BlockAllocator.check_invariants`` (tests/allocator_oracle.py); each
case here breaks one rule of docs/contracts/paged-kv.md, '4.3 Invariants' in the oracle's logical
state by hand and
expects :class:`InvariantViolation` naming it.
"""

from __future__ import annotations

import pytest

from allocator_oracle import BlockAllocator
from pagedkv.errors import InvariantViolation


def _busy() -> BlockAllocator:
    """Block 0 held, block 1 cache-only, block 2 held and cached, block 3 free."""
    alloc = BlockAllocator(4, block_size=2, hash_seed=0)
    ids = alloc.allocate_many(3)
    assert alloc.cache_full_blocks(range(4), ids[1:]) == 2
    alloc.free(1)
    alloc.check_invariants()
    return alloc


def _free_and_allocated(a):
    a._free.append(0)


def _duplicate_free(a):
    a._free.append(3)


def _lost_block(a):
    a._free.clear()


def _zero_refcount(a):
    a._refcount[0] = 0


def _evictable_count(a):
    a._num_evictable += 1


def _missing_reverse(a):
    del a._block_hash[1]


def _identity_missing(a):
    del a._identity[next(iter(a._prefix))]


def _over_capacity(a):
    a._capacity = 1


def _cached_free_block(a):
    h = a._block_hash.pop(1)
    a._prefix[h] = 3
    a._block_hash[3] = h


@pytest.mark.parametrize("corrupt, message", [
    (_free_and_allocated, "both free and allocated"),
    (_duplicate_free, "twice in the free list"),
    (_lost_block, "free 0 \\+ allocated 3 != 4"),
    (_zero_refcount, "refcount 0"),
    (_evictable_count, "cache-only count"),
    (_missing_reverse, "reverse"),
    (_identity_missing, "identities"),
    (_over_capacity, "exceed capacity"),
    (_cached_free_block, "not allocated"),
])
def test_check_invariants_catches(corrupt, message):
    alloc = _busy()
    corrupt(alloc)
    with pytest.raises(InvariantViolation, match=message):
        alloc.check_invariants()


def test_repr_names_the_counts():
    assert repr(_busy()) == ("<oracle BlockAllocator 4/4 blocks of 2 tokens: 1 free, "
                             "3 allocated, 2 cached (1 cache-only), capacity 4>")

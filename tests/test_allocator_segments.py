"""Chain segments and window probes of the BlockAllocator (what sliding-window groups use to
publish the blocks they still hold and to find a window's blocks; docs/coordinator.md,
"Hybrid hot prefix reuse"), on both implementations, with exact ids and state after errors."""

from __future__ import annotations

import numpy as np
import pytest

import allocator_oracle
from allocator_implementations import ALLOCATORS, observables
from pagedkv.allocator import BlockAllocator as CythonAllocator
from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation

BS = 4
TOKENS = np.arange(100, 124, dtype=np.uint32)  # 6 full blocks


@pytest.fixture(params=ALLOCATORS)
def cls(request):
    return request.param


@pytest.mark.parametrize("first", [1, 2, 5])
@pytest.mark.parametrize("keys", [{}, {"extra_keys": (7, 8)},
                                  {"extra_keys_per_block": [(i,) for i in range(6)]},
                                  {"cache_salt": 12345}])
def test_segment_hashes_equal_the_slice_of_the_whole_chain(cls, first, keys):
    a = cls(16, None, BS, hash_seed=3)
    whole = a.chain_hashes(TOKENS, **keys)
    seg_keys = dict(keys)
    if "extra_keys_per_block" in keys:
        seg_keys["extra_keys_per_block"] = keys["extra_keys_per_block"][first:]
    seg = a.chain_hashes(TOKENS[first * BS:], parent_hash=int(whole[first - 1]),
                         first_block=first, **seg_keys)
    assert seg.tolist() == whole[first:].tolist()
    # Both implementations agree bit for bit.
    other = (CythonAllocator if cls is allocator_oracle.BlockAllocator
             else allocator_oracle.BlockAllocator)(16, None, BS, hash_seed=3)
    assert other.chain_hashes(TOKENS[first * BS:], parent_hash=int(whole[first - 1]),
                              first_block=first, **seg_keys).tolist() == seg.tolist()


def test_a_registered_segment_verifies_like_the_whole_chain(cls):
    a = cls(16, None, BS, hash_seed=0)
    h = a.chain_hashes(TOKENS, cache_salt=9)
    ids = a.allocate_many(6)
    assert ids.tolist() == [0, 1, 2, 3, 4, 5]
    # Publish blocks 2..3 only (a sliding window), chaining from block 1's hash.
    assert a.cache_full_blocks(TOKENS[8:16], ids[2:4], cache_salt=9, parent_hash=int(h[1]),
                               first_block=2) == 2
    assert a.lru_hashes() == [int(h[3]), int(h[2])]  # deepest first touch: block 2 newest
    probe = a.cached_block_ids(TOKENS, cache_salt=9)
    assert probe.tolist() == [-1, -1, 2, 3, -1, -1]
    # The hot walk needs block 0: no prefix hit from a window alone.
    assert a.find_longest_cache_hit(TOKENS, cache_salt=9)[1] == 0
    # Another salt: the whole chain hashes differently, nothing verifies.
    assert a.cached_block_ids(TOKENS, cache_salt=10).tolist() == [-1] * 6
    assert a.cached_block_ids(TOKENS).tolist() == [-1] * 6
    # Registering the head completes the chain: a normal prefix hit of all four.
    assert a.cache_full_blocks(TOKENS[:8], ids[:2], cache_salt=9) == 2
    hit, n = a.find_longest_cache_hit(TOKENS, cache_salt=9)
    assert hit.tolist() == [0, 1, 2, 3] and n == 16
    a.check_invariants()


def test_probe_is_pure_and_checks_identity_not_just_the_hash(cls):
    # Every hash folds to 1..3, so most probes land on another block's entry.
    a = cls(16, None, BS, hash_seed=0,
            _hash_fn=lambda parent, toks, keys, salt, idx, seed: 1 + int(toks[0]) % 3)
    ids = a.allocate_many(2)
    a.cache_full_blocks(TOKENS[:8], ids)
    before = observables(a)
    other = TOKENS.copy()
    other[1] += 1  # block 0 differs in one token, same folded hash as block 0
    # Block 0's stored tokens differ: a miss. Block 1 verifies on its own identity (its tokens
    # and its parent hash, which the fold made equal): each block is checked like a hit.
    assert a.cached_block_ids(other[:8]).tolist() == [-1, 1]
    other[5] += 1
    assert a.cached_block_ids(other[:8]).tolist() == [-1, -1]
    assert a.cached_block_ids(TOKENS[:8]).tolist() == [0, 1]
    assert observables(a) == before  # no refcount, LRU or counter moved


def test_incref_many_is_all_or_nothing(cls):
    a = cls(8, None, BS, hash_seed=0, reserve_null_block=True)
    ids = a.allocate_many(3)
    assert ids.tolist() == [1, 2, 3]
    a.incref_many([1, 1, 3])
    assert [a.ref_count(b) for b in (1, 2, 3)] == [3, 1, 2]
    before = observables(a)
    for bad, exc in (([1, 4], InvariantViolation),      # 4 is free
                     ([2, 0], InvariantViolation),      # the null block
                     ([1, 8], InvalidArgument),         # out of range
                     ([1.5], InvalidArgumentType)):
        with pytest.raises(exc):
            a.incref_many(bad)
        assert observables(a) == before
    a.incref_many([])
    assert observables(a) == before
    a.check_invariants()


@pytest.mark.parametrize("call", ["chain_hashes", "cached_block_ids", "cache_full_blocks"])
def test_segment_arguments_are_checked_before_anything_changes(cls, call):
    a = cls(16, None, BS, hash_seed=0)
    ids = a.allocate_many(2)
    before = observables(a)

    def run(**seg):
        fn = getattr(a, call)
        if call == "cache_full_blocks":
            return fn(TOKENS[:8], ids, **seg)
        return fn(TOKENS[:8], **seg)

    with pytest.raises(InvalidArgument, match="block 0 chains from 0"):
        run(parent_hash=5, first_block=0)
    with pytest.raises(InvalidArgument, match="parent_hash"):
        run(parent_hash=0, first_block=3)
    with pytest.raises(InvalidArgument):
        run(parent_hash=5, first_block=-1)
    with pytest.raises(InvalidArgumentType):
        run(parent_hash=5, first_block=True)
    with pytest.raises(InvalidArgument):
        run(parent_hash=-1, first_block=2)
    assert observables(a) == before

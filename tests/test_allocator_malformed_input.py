"""Malformed input: the oracle and the Cython BlockAllocator raise the same exception and
leave the same state (docs/contracts/paged-kv.md, '4. BlockAllocator'; the oracle is the
executable reading the differential test compares against).

The random differential test (test_allocator_stateful.py) only draws well-formed arguments
or plain range errors; these cases pin the argument checks themselves: ``extra_keys=None``,
non-iterable keys, an object-dtype token array, an empty float id array, and which error a
batch with an unallocated id *and* an out-of-range id reports (ranges are checked for the
whole batch first).
"""

from __future__ import annotations

import numpy as np
import pytest

import allocator_oracle
from allocator_implementations import observables
from pagedkv import allocator

TOKENS = [1, 2, 3, 4, 5, 6]


def _busy(cls):
    """6 blocks of 2 tokens: 0..2 cache TOKENS (0 and 1 cache-only, 2 also held), 3..5 free."""
    a = cls(6, 8, 2, hash_seed=0)
    ids = a.allocate_many(3)
    a.cache_full_blocks(TOKENS, ids)
    a.free_many(ids[:2])
    return a


CASES = {
    "extra_keys None is no keys": lambda a: a.find_longest_cache_hit(TOKENS, extra_keys=None),
    "extra_keys None with per-block keys":
        lambda a: a.cached_block_ids(TOKENS, extra_keys=None, extra_keys_per_block=[(), ()]),
    "extra_keys not iterable": lambda a: a.find_longest_cache_hit(TOKENS, extra_keys=5),
    "extra_keys_per_block entry None":
        lambda a: a.find_longest_cache_hit(TOKENS, extra_keys_per_block=[None, None, None]),
    "extra_keys_per_block not a sequence":
        lambda a: a.find_longest_cache_hit(TOKENS, extra_keys_per_block=7),
    "extra_keys_per_block of ints": lambda a: a.chain_hashes(TOKENS, extra_keys_per_block=[1, 2]),
    "object tokens in range":
        lambda a: a.find_longest_cache_hit(np.array(TOKENS, dtype=object)),
    "object tokens out of range": lambda a: a.chain_hashes([2**64] + TOKENS[1:]),
    "ragged tokens": lambda a: a.chain_hashes([[1, 2], [3]]),
    "empty float id array, free_many": lambda a: a.free_many(np.empty(0)),
    "empty float id array, incref_many": lambda a: a.incref_many(np.empty(0)),
    "empty float id array, cache_full_blocks":
        lambda a: a.cache_full_blocks(TOKENS, np.empty(0)),
    "ragged ids": lambda a: a.free_many([[2], [2, 2]]),
    "incref_many: free id before an out-of-range one": lambda a: a.incref_many([5, 100]),
    "cache_full_blocks: free id before an out-of-range one":
        lambda a: a.cache_full_blocks(TOKENS, [5, 100]),
    "cache_full_blocks: bad ids before a bad salt":
        lambda a: a.cache_full_blocks(TOKENS, [[2]], cache_salt="tenant"),
    "cache_full_blocks: bad salt before bad keys":
        lambda a: a.cache_full_blocks(TOKENS, [2], cache_salt=-1, extra_keys=[None]),
    "find_longest_cache_hit: bad salt before bad keys":
        lambda a: a.find_longest_cache_hit(TOKENS, cache_salt="x", extra_keys=[-1]),
}


def _outcome(op, alloc):
    try:
        result = op(alloc)
    except Exception as exc:  # noqa: BLE001 - the type is what we compare
        return ("raised", type(exc).__name__)
    if isinstance(result, tuple):
        result = tuple(r.tolist() if isinstance(r, np.ndarray) else r for r in result)
    elif isinstance(result, np.ndarray):
        result = (result.dtype.str, result.tolist())
    return ("ok", result)


@pytest.mark.parametrize("case", list(CASES))
def test_oracle_and_core_agree_on_malformed_input(case):
    op = CASES[case]
    seen = []
    for cls in (allocator_oracle.BlockAllocator, allocator.BlockAllocator):
        alloc = _busy(cls)
        before = observables(alloc)
        outcome = _outcome(op, alloc)
        after = observables(alloc)
        if outcome[0] == "raised":
            assert outcome[1].startswith("Invalid"), (cls.__module__, outcome)
            assert after == before, f"{cls.__module__}: {outcome} changed the state"
        alloc.check_invariants()
        seen.append((outcome, after))
    assert seen[0] == seen[1], f"oracle {seen[0][0]}, Cython {seen[1][0]}"


@pytest.mark.parametrize("block_size", [2**32, 2**63, 2**64])
def test_chain_hashes_rejects_a_block_size_beyond_u32(block_size):
    """hashing.chain_hashes raised a bare OverflowError for a block_size >= 2**63 and
    returned an empty array for one in [2**32, 2**63), where the oracle raises
    InvalidArgument (docs/contracts/paged-kv.md, '2.2 Chains')."""
    from pagedkv import hashing
    from pagedkv.errors import InvalidArgument
    for module in (allocator_oracle, hashing):
        with pytest.raises(InvalidArgument, match="block_size"):
            module.chain_hashes([1, 2], block_size)


def test_identity_digest_may_be_a_bytearray():
    """The core takes a bytearray extra_keys_digest (copied); the oracle rejected it."""
    from pagedkv.identity import BlockIdentity
    seen = []
    for cls in (allocator_oracle.BlockAllocator, allocator.BlockAllocator):
        a = _busy(cls)
        identity = BlockIdentity(np.array([1, 2], np.uint32), 0, bytearray(16), 0, 0)
        seen.append((a.register_prefix(2, 1, identity), a.lookup_prefix(1, identity),
                     observables(a)))
    assert seen[0] == seen[1]

"""Acceptance scenarios A1–A21 (docs/contracts/paged-kv.md, '9.2 BlockAllocator'), exact values, on
both allocators.

Unless a test says otherwise: ``hash_seed=0``, ``block_size=4``, ``max_num_blocks =
num_blocks``, "register" is ``cache_full_blocks`` with no extra keys and salt 0, and ids are
those FIFO allocation yields.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator_implementations import ALLOCATORS, observables
from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation
from pagedkv.identity import BlockIdentity, RestoredBlock


@pytest.fixture(params=ALLOCATORS)
def make(request):
    cls = request.param

    def make(num_blocks, max_num_blocks=None, block_size=4, **kwargs):
        kwargs.setdefault("hash_seed", 0)
        return cls(num_blocks, max_num_blocks, block_size, **kwargs)

    make.cls = cls
    return make


def hit(alloc, tokens, **kwargs):
    blocks, n = alloc.find_longest_cache_hit(np.asarray(tokens), **kwargs)
    assert blocks.dtype == np.int32
    return blocks.tolist(), n


def head(alloc, tokens):
    """(hash, identity) of ``tokens`` as chain block 0 with no keys and salt 0."""
    return int(alloc.chain_hashes(tokens)[0]), BlockIdentity.of(tokens)


def request_registers(alloc, tokens):
    """One request: allocate the full blocks of ``tokens``, register them, release them."""
    ids = alloc.allocate_many(len(tokens) // alloc.block_size)
    alloc.cache_full_blocks(np.asarray(tokens), ids)
    alloc.free_many(ids)
    return ids.tolist()


def unchanged(alloc, before):
    assert observables(alloc) == before
    alloc.check_invariants()


def test_a1_allocate_refcount_free(make):
    alloc = make(10, 32, 4)
    assert alloc.num_free_blocks == 10 and alloc.num_blocks == 10 and alloc.max_num_blocks == 32
    assert alloc.allocate() == 0
    assert alloc.num_free_blocks == 9 and alloc.ref_count(0) == 1
    alloc.incref(0)
    assert alloc.ref_count(0) == 2
    alloc.free(0)
    assert alloc.num_free_blocks == 9 and alloc.ref_count(0) == 1
    alloc.free(0)
    assert alloc.num_free_blocks == 10 and alloc.ref_count(0) == 0
    before = observables(alloc)
    with pytest.raises(InvariantViolation):
        alloc.free(0)
    unchanged(alloc, before)
    # Ids of the max pool that are not grown yet are out of range.
    for bad in (10, -1):
        with pytest.raises(InvalidArgument):
            alloc.free(bad)
        with pytest.raises(InvalidArgument):
            alloc.incref(bad)
        with pytest.raises(InvalidArgument):
            alloc.ref_count(bad)
    with pytest.raises(InvariantViolation):
        alloc.incref(3)
    unchanged(alloc, before)


def test_a2_register_lookup_lifecycle(make):
    alloc = make(4)
    b = alloc.allocate()
    assert alloc.ref_count(b) == 1
    h, ident = head(alloc, [1, 2, 3, 4])
    assert alloc.register_prefix(b, h, ident) is True
    assert alloc.ref_count(b) == 2
    assert alloc.lookup_prefix(h, ident) == b
    assert alloc.ref_count(b) == 3
    alloc.free(b)
    alloc.free(b)
    assert alloc.ref_count(b) == 1 and alloc.num_free_blocks == 3
    assert alloc.num_evictable_blocks == 1
    assert alloc.lookup_prefix(h, ident) == b
    assert alloc.ref_count(b) == 2
    other = BlockIdentity.of([9, 9, 9, 9])
    before = observables(alloc)
    assert alloc.lookup_prefix(h, other) is None
    assert alloc.ref_count(b) == 2 and alloc.lru_hashes() == before["lru_hashes"]
    assert alloc.lookup_prefix(h ^ 1, ident) is None
    assert alloc.ref_count(b) == 2
    alloc.check_invariants()


def test_a3_cache_keeps_a_freed_block(make):
    alloc = make(10)
    b = alloc.allocate()
    assert alloc.cache_full_blocks([1, 2, 3, 4], [b]) == 1
    alloc.free(b)
    assert alloc.num_free_blocks == 9 and alloc.ref_count(b) == 1
    assert alloc.num_evictable_blocks == 1 and alloc.free_or_evictable_blocks == 10
    assert alloc.num_allocated_blocks == 1
    assert hit(alloc, [1, 2, 3, 4]) == ([b], 4)
    assert alloc.ref_count(b) == 2 and alloc.num_evictable_blocks == 0
    alloc.free(b)
    assert alloc.ref_count(b) == 1 and alloc.prefix_cache_len == 1
    assert hit(alloc, [1, 2, 3, 4, 5]) == ([b], 4)
    alloc.check_invariants()


def test_a4_capacity_eviction(make):
    alloc = make(10)
    alloc.set_prefix_cache_capacity(2)
    b1, b2, b3 = alloc.allocate(), alloc.allocate(), alloc.allocate()
    (h1, i1), (h2, i2), (h3, i3) = (head(alloc, [k] * 4) for k in (1, 2, 3))
    assert alloc.register_prefix(b1, h1, i1)
    assert alloc.register_prefix(b2, h2, i2)
    assert alloc.register_prefix(b3, h3, i3)
    assert alloc.lru_hashes() == [h2, h3]
    assert alloc.ref_count(b1) == 1
    assert alloc.lookup_prefix(h1, i1) is None
    assert alloc.stats()["capacity_evictions"] == 1
    alloc.free(b1)  # its reverse entry is gone: the caller's ref is the last one
    assert alloc.num_free_blocks == 8
    alloc.set_prefix_cache_capacity(0)
    assert alloc.prefix_cache_len == 0 and alloc.lru_hashes() == []
    assert alloc.ref_count(b2) == 1 and alloc.ref_count(b3) == 1
    assert alloc.stats()["capacity_evictions"] == 3
    assert alloc.register_prefix(b2, h2, i2) is False
    assert alloc.prefix_cache_len == 0 and alloc.ref_count(b2) == 1
    assert alloc.cache_full_blocks([2, 2, 2, 2], [b2]) == 0
    assert alloc.prefix_cache_len == 0
    alloc.check_invariants()


def test_a5_lru_order_and_refresh(make):
    alloc = make(10)
    alloc.set_prefix_cache_capacity(3)
    entries = [head(alloc, [k] * 4) for k in (1, 2, 3, 4)]
    blocks = [alloc.allocate() for _ in entries]
    for b, (h, ident) in zip(blocks, entries, strict=True):
        assert alloc.register_prefix(b, h, ident) is True
    assert alloc.lru_hashes() == [h for h, _ in entries[1:]]
    assert alloc.ref_count(blocks[0]) == 1

    alloc = make(10)
    alloc.set_prefix_cache_capacity(2)
    b1, b2, b3 = alloc.allocate(), alloc.allocate(), alloc.allocate()
    (h1, i1), (h2, i2), (h3, i3) = entries[:3]
    assert alloc.register_prefix(b1, h1, i1) and alloc.register_prefix(b2, h2, i2)
    assert alloc.register_prefix(b1, h1, i1) is True
    assert alloc.ref_count(b1) == 2 and alloc.lru_hashes() == [h2, h1]
    assert alloc.stats()["capacity_evictions"] == 0
    assert alloc.register_prefix(b3, h3, i3) is True
    assert alloc.lru_hashes() == [h1, h3]
    assert alloc.ref_count(b2) == 1 and alloc.ref_count(b1) == 2
    alloc.check_invariants()


def test_a6_alias_move_and_collision(make):
    alloc = make(10)
    (ha, ia), (hb, ib), (hx, ix), (hy, iy) = (head(alloc, [k] * 4) for k in (1, 2, 3, 4))
    b = alloc.allocate()
    assert alloc.register_prefix(b, ha, ia) is True  # insert
    assert alloc.register_prefix(b, ha, ia) is True  # refresh
    assert alloc.register_prefix(b, hb, ib) is True  # alias move
    assert alloc.ref_count(b) == 2
    assert alloc.lru_hashes() == [hb]
    assert alloc.lookup_prefix(ha, ia) is None
    assert alloc.lookup_prefix(hb, ib) == b
    alloc.free(b)

    alloc = make(10)
    a, b = alloc.allocate(), alloc.allocate()
    assert alloc.register_prefix(a, hx, ix) and alloc.register_prefix(b, hy, iy)
    before = observables(alloc)
    assert alloc.register_prefix(b, hx, iy) is False  # collision
    assert alloc.ref_count(b) == 2 and alloc.ref_count(a) == 2
    assert alloc.lookup_prefix(hx, ix) == a
    assert alloc.lookup_prefix(hy, iy) == b
    assert before["lru_hashes"] == [hx, hy]
    alloc.check_invariants()


def test_a6_alias_move_of_a_cache_only_block_keeps_it(make):
    alloc = make(4)
    (ha, ia), (hb, ib) = head(alloc, [1] * 4), head(alloc, [2] * 4)
    b = alloc.allocate()
    assert alloc.register_prefix(b, ha, ia)
    alloc.free(b)
    assert alloc.num_evictable_blocks == 1
    assert alloc.register_prefix(b, hb, ib) is True
    assert alloc.ref_count(b) == 1 and alloc.num_evictable_blocks == 1
    assert alloc.num_free_blocks == 3 and alloc.lru_hashes() == [hb]
    alloc.check_invariants()


def test_a7_pressure_eviction(make):
    alloc = make(3)
    t1, t2, t3 = [1] * 4, [2] * 4, [3] * 4
    assert [request_registers(alloc, t) for t in (t1, t2, t3)] == [[0], [1], [2]]
    assert alloc.num_free_blocks == 0 and alloc.num_evictable_blocks == 3
    assert alloc.allocate() == 0
    assert alloc.stats()["pressure_evictions"] == 1
    assert alloc.ref_count(0) == 1 and alloc.prefix_cache_len == 2
    assert hit(alloc, t1) == ([], 0)
    assert hit(alloc, t2) == ([1], 4)
    assert hit(alloc, t3) == ([2], 4)
    # Block 0 reused for a 3-token partial block: nothing to register.
    with pytest.raises(InvalidArgument):
        alloc.cache_full_blocks([7, 7, 7], [0])
    assert alloc.cache_full_blocks([7, 7, 7], np.empty(0, dtype=np.int32)) == 0
    assert alloc.prefix_cache_len == 2 and alloc.ref_count(0) == 1
    alloc.check_invariants()


def test_a8_failed_allocation_changes_nothing(make):
    alloc = make(2)
    ids = alloc.allocate_many(2)
    assert alloc.cache_full_blocks(range(8), ids) == 2
    assert [alloc.ref_count(b) for b in ids] == [2, 2]
    before = observables(alloc)
    assert alloc.allocate() is None
    assert alloc.allocate_many(1) is None
    assert alloc.num_free_blocks == 0 and alloc.prefix_cache_len == 2
    unchanged(alloc, before)
    assert alloc.can_allocate(0) and not alloc.can_allocate(1)

    alloc.free_many(ids)  # now 2 cache-only blocks
    assert alloc.num_evictable_blocks == 2
    assert alloc.can_allocate(2) is True
    assert alloc.can_allocate(3) is False
    before = observables(alloc)
    assert alloc.allocate_many(3) is None
    unchanged(alloc, before)


def test_a9_longest_hit(make):
    alloc = make(10)
    assert hit(alloc, range(8)) == ([], 0)
    assert hit(alloc, [0, 1, 2]) == ([], 0)
    b0, b1 = alloc.allocate_many(2).tolist()
    assert alloc.cache_full_blocks(range(8), [b0, b1]) == 2
    assert hit(alloc, [0, 1, 2]) == ([], 0)
    assert hit(alloc, range(8)) == ([b0, b1], 8)
    assert hit(alloc, range(12)) == ([b0, b1], 8)
    assert hit(alloc, range(7)) == ([b0], 4)

    a = list(range(1, 13))
    ids_a = alloc.allocate_many(3).tolist()
    assert alloc.cache_full_blocks(a, ids_a) == 3
    b = a[:4] + [100, 101, 102, 103, 104, 105, 106, 107]
    assert hit(alloc, b) == ([ids_a[0]], 4)
    assert hit(alloc, a) == (ids_a, 12)
    assert alloc.stats()["query_tokens"] == 8 + 3 + 3 + 8 + 12 + 7 + 12 + 12
    assert alloc.stats()["hit_tokens"] == 8 + 8 + 4 + 4 + 12
    alloc.check_invariants()


def test_a10_extra_keys_in_lookups(make):
    alloc = make(16)
    ids = alloc.allocate_many(2)
    assert alloc.cache_full_blocks(range(8), ids, extra_keys=(100,)) == 2
    assert hit(alloc, range(8)) == ([], 0)
    assert hit(alloc, range(8), extra_keys=(100,)) == (ids.tolist(), 8)

    t = list(range(20, 32))
    ids = alloc.allocate_many(3)
    assert alloc.cache_full_blocks(t, ids, extra_keys_per_block=[(555,), (), ()]) == 3
    assert hit(alloc, t, extra_keys_per_block=[(), (), ()]) == ([], 0)
    assert hit(alloc, t, extra_keys_per_block=[(555,), (), (9,)]) == (ids[:2].tolist(), 8)
    assert hit(alloc, t, extra_keys_per_block=[(555,), (), ()]) == (ids.tolist(), 12)

    ids2 = alloc.allocate_many(3)
    before = observables(alloc)
    with pytest.raises(InvalidArgument):
        alloc.cache_full_blocks(list(range(40, 52)), ids2, extra_keys_per_block=[(1,), (2,)])
    unchanged(alloc, before)
    assert hit(alloc, t, extra_keys_per_block=[(555,), ()]) == (ids[:2].tolist(), 8)
    with pytest.raises(InvalidArgument):
        alloc.find_longest_cache_hit(t, extra_keys=(1,), extra_keys_per_block=[(1,)])


def test_a11_malformed_registration(make):
    alloc = make(4)
    ids = alloc.allocate_many(2)
    before = observables(alloc)
    with pytest.raises(InvalidArgument):
        alloc.cache_full_blocks([1, 2, 3, 4], ids)
    unchanged(alloc, before)


def _intruder_at(make, position):
    alloc = make(8)
    tokens = list(range(12))
    hashes = alloc.chain_hashes(tokens).tolist()
    intruder = alloc.allocate()
    assert alloc.register_prefix(intruder, hashes[position], BlockIdentity.of([99] * 4))
    return alloc, tokens, intruder


def test_a12_collision_stops_the_chain(make):
    alloc, tokens, intruder = _intruder_at(make, 0)
    b0, b1, b2 = alloc.allocate_many(3).tolist()
    assert alloc.cache_full_blocks(tokens, [b0, b1, b2]) == 0
    assert alloc.prefix_cache_len == 1 and alloc.ref_count(intruder) == 2
    assert [alloc.ref_count(b) for b in (b0, b1, b2)] == [1, 1, 1]
    assert alloc.stats()["collisions_rejected"] == 1
    assert hit(alloc, tokens) == ([], 0)
    assert alloc.stats()["collisions_rejected"] == 2

    alloc, tokens, intruder = _intruder_at(make, 1)
    b0, b1, b2 = alloc.allocate_many(3).tolist()
    assert alloc.cache_full_blocks(tokens, [b0, b1, b2]) == 1
    assert alloc.prefix_cache_len == 2 and alloc.ref_count(intruder) == 2
    assert [alloc.ref_count(b) for b in (b0, b1, b2)] == [2, 1, 1]
    assert hit(alloc, tokens) == ([b0], 4)
    alloc.check_invariants()


def test_a13_replay_past_a_verified_prefix(make):
    alloc = make(8)
    assert request_registers(alloc, range(8)) == [0, 1]
    ids = alloc.allocate_many(4).tolist()
    assert ids == [2, 3, 4, 5]
    assert alloc.cache_full_blocks(range(16), ids) == 2
    assert alloc.ref_count(2) == 1 and alloc.ref_count(3) == 1
    assert alloc.ref_count(4) == 2 and alloc.ref_count(5) == 2
    assert alloc.prefix_cache_len == 4
    assert hit(alloc, range(16)) == ([0, 1, 4, 5], 16)
    alloc.check_invariants()


def test_a14_long_chain(make):
    alloc = make(2000)
    tokens = np.arange(4400, dtype=np.uint32)
    ids = alloc.allocate_many(1100)
    assert alloc.cache_full_blocks(tokens, ids) == 1100
    blocks, n = alloc.find_longest_cache_hit(tokens)
    assert blocks.tolist() == ids.tolist() and n == 4400
    assert alloc.stats()["capacity_evictions"] == 0
    lru = alloc.lru_hashes()
    assert lru == alloc.chain_hashes(tokens).tolist()[::-1]  # deepest block oldest
    alloc.check_invariants()


def test_a15_batch_publish_is_all_or_nothing(make):
    alloc = make(8)
    c = alloc.allocate()
    assert alloc.cache_full_blocks([50, 51, 52, 53], [c]) == 1
    held = alloc.chain_hashes([50, 51, 52, 53]).tolist()[0]
    r0, r1 = alloc.allocate(), alloc.allocate()
    u = list(range(8))
    u0, u1 = alloc.chain_hashes(u).tolist()
    i0 = BlockIdentity.of(u[:4])
    i1 = BlockIdentity.of(u[4:], parent_hash=u0, block_index=1)

    before = observables(alloc)
    assert alloc.publish_restored_batch([RestoredBlock(r0, u0, i0),
                                         RestoredBlock(r1, held, i1)]) is False
    assert alloc.ref_count(r0) == 1 and alloc.ref_count(r1) == 1
    unchanged(alloc, before)

    short = BlockIdentity(np.array([1, 2, 3], dtype=np.uint32), 0, b"", 0, 0)
    with pytest.raises(InvalidArgument):
        alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(r1, u1, short)])
    unchanged(alloc, before)

    assert alloc.publish_restored_batch([RestoredBlock(r0, u0, i0),
                                         RestoredBlock(r1, u1, i1)]) is True
    assert alloc.ref_count(r0) == 2 and alloc.ref_count(r1) == 2
    assert alloc.lru_hashes() == [held, u1, u0]
    assert hit(alloc, u) == ([r0, r1], 8)
    alloc.check_invariants()


def test_a15_publish_refusals(make):
    alloc = make(8)
    r0, r1, free_id = alloc.allocate(), alloc.allocate(), 5
    u = list(range(8))
    u0, u1 = alloc.chain_hashes(u).tolist()
    i0 = BlockIdentity.of(u[:4])
    i1 = BlockIdentity.of(u[4:], parent_hash=u0, block_index=1)
    before = observables(alloc)
    # Duplicate block or hash inside the batch.
    assert not alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(r0, u1, i1)])
    assert not alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(r1, u0, i1)])
    unchanged(alloc, before)
    with pytest.raises(InvariantViolation):
        alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(free_id, u1, i1)])
    with pytest.raises(InvalidArgument):
        alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(8, u1, i1)])
    unchanged(alloc, before)
    # More entries than the capacity, and a block that already has an entry.
    alloc.set_prefix_cache_capacity(1)
    before = observables(alloc)
    assert not alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(r1, u1, i1)])
    unchanged(alloc, before)
    alloc.set_prefix_cache_capacity(8)
    assert alloc.cache_full_blocks([9] * 4, [r1]) == 1
    before = observables(alloc)
    assert not alloc.publish_restored_batch([RestoredBlock(r0, u0, i0), RestoredBlock(r1, u1, i1)])
    unchanged(alloc, before)
    assert alloc.publish_restored_batch([]) is True
    unchanged(alloc, before)


def test_a16_grow_by(make):
    alloc = make(4, 8, 4)
    assert alloc.allocate_many(2).tolist() == [0, 1]
    assert alloc.cache_full_blocks([1, 2, 3, 4], [1]) == 1
    alloc.free(1)
    assert alloc.grow_by(4) == 4
    assert alloc.num_blocks == 8 and alloc.num_free_blocks == 6
    assert alloc.ref_count(0) == 1 and alloc.ref_count(1) == 1 and alloc.prefix_cache_len == 1
    assert [alloc.allocate() for _ in range(6)] == [2, 3, 4, 5, 6, 7]
    assert hit(alloc, [1, 2, 3, 4]) == ([1], 4)
    assert alloc.stats()["grows"] == 1

    alloc = make(4, 6, 4)
    assert alloc.grow_by(10) == 2
    assert alloc.grow_by(1) == 0
    assert alloc.stats()["grows"] == 1
    assert [alloc.allocate() for _ in range(6)] == [0, 1, 2, 3, 4, 5]
    assert alloc.allocate() is None

    alloc = make(4, 4, 4)
    assert alloc.grow_by(3) == 0 and alloc.num_blocks == 4
    assert alloc.stats()["grows"] == 0

    alloc = make(4, 8, 4)
    alloc.set_prefix_cache_capacity(2)
    assert alloc.grow_by(4) == 4
    ids = alloc.allocate_many(8)
    assert alloc.cache_full_blocks(np.arange(32), ids) == 8
    assert alloc.prefix_cache_len == 8 and alloc.stats()["capacity_evictions"] == 0
    alloc.check_invariants()

    with pytest.raises(InvalidArgument):
        make.cls(8, 4, 4, hash_seed=0)


def test_a16_grow_keeps_already_free_ids_ahead(make):
    alloc = make(4, 8, 4)
    assert alloc.allocate_many(4).tolist() == [0, 1, 2, 3]
    alloc.free(2)
    alloc.free(0)
    assert alloc.grow_by(2) == 2
    assert alloc.allocate_many(4).tolist() == [2, 0, 4, 5]


def test_a17_purge(make):
    events = []
    alloc = make(10, on_block_event=lambda kind, hashes: events.append((kind, hashes.tolist())))
    b0, b1 = alloc.allocate(), alloc.allocate()
    assert alloc.cache_full_blocks([1] * 4, [b0]) == 1
    assert alloc.cache_full_blocks([2] * 4, [b1]) == 1
    alloc.free(b0)
    assert alloc.purge_prefix_cache() == 2
    assert hit(alloc, [1] * 4) == ([], 0) and hit(alloc, [2] * 4) == ([], 0)
    assert alloc.num_free_blocks == 9 and alloc.prefix_cache_len == 0
    assert alloc.ref_count(b1) == 1 and alloc.num_evictable_blocks == 0
    alloc.free(b1)
    assert alloc.num_free_blocks == 10
    assert alloc.purge_prefix_cache() == 0
    b = alloc.allocate()
    assert alloc.cache_full_blocks([1] * 4, [b]) == 1
    assert hit(alloc, [1] * 4) == ([b], 4)
    kinds = [kind for kind, _ in events]
    assert kinds == ["stored", "stored", "cleared", "cleared", "stored"]
    assert events[2] == ("cleared", [])
    alloc.check_invariants()


def test_a18_vllm_prefill(make):
    alloc = make(11, block_size=16)
    shared = list(range(1000, 1048))
    req0 = shared + list(range(7))
    assert hit(alloc, req0) == ([], 0)
    ids0 = alloc.allocate_many(4).tolist()
    assert ids0 == [0, 1, 2, 3]
    assert alloc.cache_full_blocks(req0, ids0[:3]) == 3

    req1 = shared + list(range(100, 105))
    hit1 = hit(alloc, req1)
    assert hit1 == ([0, 1, 2], 48)
    assert [alloc.ref_count(b) for b in (0, 1, 2)] == [3, 3, 3]
    ids1 = hit1[0] + alloc.allocate_many(1).tolist()
    assert ids1 == [0, 1, 2, 4] and alloc.num_free_blocks == 6
    assert alloc.cache_full_blocks(req1, ids1[:3]) == 0

    alloc.free_many(ids0)
    alloc.free_many(ids1)
    assert alloc.free_list() == [5, 6, 7, 8, 9, 10, 3, 4]
    assert alloc.num_free_blocks == 8 and alloc.num_evictable_blocks == 3
    assert [alloc.ref_count(b) for b in (0, 1, 2)] == [1, 1, 1]

    req2 = shared + list(range(200, 207))
    hit2 = hit(alloc, req2)
    assert hit2 == ([0, 1, 2], 48)
    ids2 = hit2[0] + alloc.allocate_many(1).tolist()
    assert ids2 == [0, 1, 2, 5] and alloc.num_free_blocks == 7
    alloc.free_many(ids2)

    req3 = list(range(5000, 5176))
    assert hit(alloc, req3) == ([], 0)
    assert alloc.allocate_many(11).tolist() == [6, 7, 8, 9, 10, 3, 4, 5, 2, 1, 0]
    assert alloc.prefix_cache_len == 0 and alloc.lru_hashes() == []
    assert alloc.stats()["pressure_evictions"] == 3
    alloc.check_invariants()


def test_a19_tail_first_eviction(make):
    alloc = make(4)
    tokens = list(range(1, 13))
    assert request_registers(alloc, tokens) == [0, 1, 2]
    assert alloc.free_list() == [3]
    assert alloc.allocate_many(2).tolist() == [3, 2]
    assert hit(alloc, tokens) == ([0, 1], 8)
    alloc.check_invariants()


def test_a20_own_hits_are_never_evicted(make):
    alloc = make(2, block_size=16)
    x, y = list(range(16)), list(range(100, 116))
    assert request_registers(alloc, x) == [0]
    assert request_registers(alloc, y) == [1]
    z = x + [7]
    blocks, n = hit(alloc, z)
    assert (blocks, n) == ([0], 16) and alloc.ref_count(0) == 2
    assert alloc.allocate() == 1
    assert alloc.ref_count(0) == 2 and hit(alloc, y) == ([], 0)
    assert alloc.allocate() is None
    alloc.check_invariants()


def test_a21_fifo_free_list(make):
    alloc = make(4)
    assert [alloc.allocate() for _ in range(3)] == [0, 1, 2]
    alloc.free(1)
    alloc.free(0)
    assert alloc.free_list() == [3, 1, 0]
    assert [alloc.allocate() for _ in range(3)] == [3, 1, 0]


# --- bad input leaves everything unchanged (issue 2, "Bad input") ---------------------------


def _busy(make):
    """An allocator with a held block (0), a cache-only block (1) and a held cached block (2)."""
    alloc = make(6, 8, 4)
    ids = alloc.allocate_many(3)
    assert alloc.cache_full_blocks(range(8), ids[1:]) == 2
    alloc.free(1)
    return alloc


@pytest.mark.parametrize("call, exc", [
    (lambda a: a.free(6), InvalidArgument),
    (lambda a: a.free(-1), InvalidArgument),
    (lambda a: a.free(4), InvariantViolation),
    (lambda a: a.free(1), InvariantViolation),  # only the cache holds it
    (lambda a: a.incref(4), InvariantViolation),
    (lambda a: a.free_many([0, 6]), InvalidArgument),
    (lambda a: a.free_many([0, 0]), InvariantViolation),
    (lambda a: a.free_many([2, 2]), InvariantViolation),
    (lambda a: a.free_many([0, 4]), InvariantViolation),
    (lambda a: a.free_many(np.array([[0]])), InvalidArgument),
    (lambda a: a.find_longest_cache_hit(np.zeros((2, 4), dtype=np.uint32)), InvalidArgument),
    (lambda a: a.find_longest_cache_hit(np.arange(8.0)), InvalidArgumentType),
    (lambda a: a.find_longest_cache_hit([0, 1, 2, 2**32]), InvalidArgument),
    (lambda a: a.find_longest_cache_hit([0, 1, 2, -3]), InvalidArgument),
    (lambda a: a.find_longest_cache_hit(range(8), cache_salt="s"), InvalidArgumentType),
    (lambda a: a.find_longest_cache_hit(range(8), extra_keys=(2**64,)), InvalidArgument),
    (lambda a: a.cache_full_blocks(range(8), [0, 7]), InvalidArgument),
    (lambda a: a.cache_full_blocks(range(8), [0, 4]), InvariantViolation),
    (lambda a: a.cache_full_blocks(np.arange(8.0), [0]), InvalidArgumentType),
    (lambda a: a.cache_full_blocks(range(8), [0], cache_salt="s"), InvalidArgumentType),
    (lambda a: a.register_prefix(4, 123, BlockIdentity.of([1, 2, 3, 4])), InvariantViolation),
    (lambda a: a.register_prefix(0, 123, BlockIdentity.of([1, 2, 3])), InvalidArgument),
    (lambda a: a.allocate_many(-1), InvalidArgument),
    (lambda a: a.grow_by(-1), InvalidArgument),
    (lambda a: a.set_prefix_cache_capacity(-1), InvalidArgument),
])
def test_bad_input_raises_and_changes_nothing(make, call, exc):
    alloc = _busy(make)
    before = observables(alloc)
    with pytest.raises(exc):
        call(alloc)
    unchanged(alloc, before)


@pytest.mark.parametrize("args, kwargs", [
    ((0,), {}),
    ((4, 2), {}),
    ((4, None, 0), {}),
    ((1,), {"reserve_null_block": True}),
    ((4,), {"hash_seed": -1}),
    ((4,), {"hash_seed": 2**64}),
])
def test_bad_construction(make, args, kwargs):
    with pytest.raises(InvalidArgument):
        make.cls(*args, **kwargs)


def test_null_block_is_never_handed_out(make):
    alloc = make(4, reserve_null_block=True)
    assert alloc.null_block_id == 0
    assert alloc.num_free_blocks == 3 and alloc.num_allocated_blocks == 0
    assert alloc.allocate_many(3).tolist() == [1, 2, 3]
    assert alloc.allocate() is None
    before = observables(alloc)
    with pytest.raises(InvariantViolation):
        alloc.free(0)
    with pytest.raises(InvariantViolation):
        alloc.cache_full_blocks([1, 2, 3, 4], [0])
    unchanged(alloc, before)
    assert alloc.grow_by(1) == 0
    assert make(4).null_block_id is None


# --- block events (docs/contracts/paged-kv.md, '4.10 Stats and block events') ---------------------


def test_events_once_per_kind_removed_before_stored(make):
    events = []
    alloc = make(6, on_block_event=lambda kind, hashes: events.append(
        (kind, hashes.dtype.str, hashes.tolist())))
    (h1, i1), (h2, i2), (h3, i3) = (head(alloc, [k] * 4) for k in (1, 2, 3))
    b1, b2 = alloc.allocate(), alloc.allocate()
    alloc.set_prefix_cache_capacity(1)
    assert events == []  # nothing dropped, nothing sent
    assert alloc.register_prefix(b1, h1, i1)
    assert events == [("stored", "<u8", [h1])]
    events.clear()
    assert alloc.register_prefix(b2, h2, i2)  # capacity-evicts h1 in the same call
    assert events == [("removed", "<u8", [h1]), ("stored", "<u8", [h2])]
    events.clear()
    assert alloc.register_prefix(b2, h3, i3)  # alias move
    assert events == [("removed", "<u8", [h2]), ("stored", "<u8", [h3])]
    events.clear()
    assert alloc.register_prefix(b2, h3, i3)  # refresh: nothing changes in the table
    assert alloc.register_prefix(b1, h3, i1) is False
    assert events == []
    assert alloc.purge_prefix_cache() == 1
    assert events == [("cleared", "<u8", [])]


def test_event_hook_errors_never_undo_the_operation(make, caplog):
    def hook(kind, hashes):
        raise RuntimeError("router down")

    alloc = make(4, on_block_event=hook)
    b = alloc.allocate()
    assert alloc.cache_full_blocks(range(4), [b]) == 1
    assert alloc.prefix_cache_len == 1 and hit(alloc, range(4)) == ([b], 4)
    assert "router down" in caplog.text
    alloc.check_invariants()


def test_a_chain_whose_insert_evicts_a_later_cache_only_block_of_it(make):
    # Capacity 1 holds c (cache-only). Registering [x, c]: x's insert evicts c; c was pinned
    # for the walk, so it is not freed, and its own insert then takes the one entry. Before
    # the pin c reached refcount 0, joined the free queue and was registered there: the
    # next allocate handed it out while the table still mapped a hash to it.
    alloc = make(4, block_size=2)
    c = int(alloc.allocate())
    alloc.cache_full_blocks([1, 2], [c])
    alloc.free(c)
    alloc.set_prefix_cache_capacity(1)
    x = int(alloc.allocate())
    assert alloc.cache_full_blocks([7, 8, 9, 10], [x, c]) == 2
    alloc.check_invariants()
    assert alloc.ref_count(c) == 1 and alloc.ref_count(x) == 1  # c cache-only, x the caller's
    assert alloc.prefix_cache_len == 1 and alloc.num_evictable_blocks == 1
    assert hit(alloc, [7, 8, 9, 10]) == ([], 0)  # x's entry went to c's insert
    assert alloc.free_list() == [2, 3]
    assert [int(alloc.allocate()) for _ in range(3)] == [2, 3, c]  # c by eviction, once
    assert alloc.prefix_cache_len == 0
    alloc.check_invariants()


def test_events_are_the_net_change_of_an_operation(make):
    # A 2-block chain at capacity 1 stores h0, evicts it, stores h1: a mirror applying
    # "removed" then "stored" must end with the table's {h1} (it used to get removed [h0],
    # then stored [h0, h1]).
    mirror: set[int] = set()
    events = []

    def hook(kind, hashes):
        events.append((kind, hashes.tolist()))
        if kind == "removed":
            mirror.difference_update(hashes.tolist())
        elif kind == "stored":
            mirror.update(hashes.tolist())

    alloc = make(8, block_size=2, on_block_event=hook)
    alloc.set_prefix_cache_capacity(1)
    ids = alloc.allocate_many(2)
    h0, h1 = (int(h) for h in alloc.chain_hashes([1, 2, 3, 4]))
    assert alloc.cache_full_blocks([1, 2, 3, 4], ids) == 2
    assert events == [("removed", [h0]), ("stored", [h1])]
    assert mirror == {int(h) for h in alloc.lru_hashes()} == {h1}
    # an alias move: the old hash removed, the new one stored
    events.clear()
    alloc.set_prefix_cache_capacity(4)
    h5 = int(alloc.chain_hashes([5, 6])[0])
    assert alloc.cache_full_blocks([5, 6], [ids[1]]) == 1
    assert events == [("removed", [h1]), ("stored", [h5])]
    assert mirror == {int(h) for h in alloc.lru_hashes()} == {h5}

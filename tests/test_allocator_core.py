"""pagedkv.allocator.BlockAllocator: the Cython core on its physical tables
(docs/contracts/paged-kv.md, '4. BlockAllocator').

The acceptance scenarios of docs/contracts/paged-kv.md, '9.2 BlockAllocator' and the differential
test against the pure-Python
oracle live in test_allocator_scenarios.py / test_allocator_stateful.py; this file pins
the physical representation (records.h layouts, intrusive lists, the prefix table),
every docs/contracts/paged-kv.md, '4. BlockAllocator' contract on it, and bad input leaving every
table unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import allocator as allocator_mod
from pagedkv.allocator import (
    BLOCK_DTYPE,
    PREFIX_SLOT_DTYPE,
    STATS_KEYS,
    BlockAllocator,
    BlockIdentity,
    RestoredBlock,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType, InvariantViolation
from pagedkv.hashing import chain_hashes, salt_domain_id
from pagedkv.identity import extra_keys_digest


def make(num_blocks=8, max_num_blocks=None, block_size=4, **kw):
    kw.setdefault("hash_seed", 0)
    return BlockAllocator(num_blocks, max_num_blocks, block_size, **kw)


def ident(tokens, parent=0, keys=(), salt=0, index=0):
    return BlockIdentity.of(tokens, parent, keys, salt, index)


def snapshot(a: BlockAllocator):
    """Everything observable: the physical tables, counters, LRU and free order."""
    return {
        "records": a.block_records.tobytes(),
        "tokens": a.token_ids.tobytes(),
        "slots": a.prefix_slots.tobytes(),
        "lru": a.lru_hashes(),
        "free": a.free_list(),
        "stats": a.stats(),
        "counters": (a.num_blocks, a.num_free_blocks, a.num_allocated_blocks,
                     a.num_evictable_blocks, a.prefix_cache_len, a.prefix_cache_capacity),
    }


def populated():
    """A busy allocator: a held chain, a cache-only chain, a salted entry, free blocks."""
    a = make(12, 16)
    held = a.allocate_many(3)
    a.cache_full_blocks(np.arange(12), held)
    cached = a.allocate_many(2)
    a.cache_full_blocks(np.arange(100, 108), cached, extra_keys=(5,))
    a.free_many(cached)
    salted = a.allocate_many(1)
    a.cache_full_blocks([9, 9, 9, 9], salted, cache_salt=salt_domain_id("t"))
    a.check_invariants()
    return a


# --- module, layouts ------------------------------------------------------------------

def test_module_name_and_exports():
    assert BlockAllocator.__module__ == "pagedkv.allocator"
    from pagedkv import identity
    assert allocator_mod.RestoredBlock is identity.RestoredBlock
    assert allocator_mod.BlockIdentity is identity.BlockIdentity


@pytest.mark.parametrize("dtype,struct", [(BLOCK_DTYPE, "pkv_block_record"),
                                           (PREFIX_SLOT_DTYPE, "pkv_prefix_slot")])
def test_dtypes_match_the_c_structs(dtype, struct):
    c = allocator_mod._c_layout()[struct]
    assert dtype.itemsize == c.pop("itemsize")
    assert sorted(c) == sorted(dtype.names)            # every member, named as in C
    for name, off in c.items():
        assert dtype.fields[name][1] == off, name
    assert list(dtype.names) == sorted(c, key=c.get)    # declared in memory order


def test_dtypes_are_the_documented_records():
    """The dtypes are built from records.h as compiled; this pins what that must give
    (docs/development.md, 'Core layouts'): a header edit that moves a field fails here."""
    assert BLOCK_DTYPE == np.dtype({
        "names": ["hot_hash", "parent_hash", "cache_salt", "block_index", "extra_keys_digest",
                  "refcount", "token_count", "lru_prev", "lru_next", "free_prev", "free_next",
                  "flags", "extra_keys_digest_len"],
        "formats": ["<u8", "<u8", "<u8", "<i8", ("u1", (16,)),
                    "<i4", "<i4", "<i4", "<i4", "<i4", "<i4", "<u4", "<u4"],
        "offsets": [0, 8, 16, 24, 32, 48, 52, 56, 60, 64, 68, 72, 76], "itemsize": 80})
    assert PREFIX_SLOT_DTYPE == np.dtype({"names": ["key", "block", "_pad"],
                                          "formats": ["<u8", "<i4", "<i4"],
                                          "offsets": [0, 8, 12], "itemsize": 16})
    assert BLOCK_DTYPE.isalignedstruct and PREFIX_SLOT_DTYPE.isalignedstruct


def test_record_field_types():
    f = BLOCK_DTYPE.fields
    assert f["extra_keys_digest"][0] == np.dtype(("u1", (16,)))
    assert f["refcount"][0] == np.dtype("<i4") and f["hot_hash"][0] == np.dtype("<u8")
    assert PREFIX_SLOT_DTYPE.fields["block"][0] == np.dtype("<i4")


def test_header_is_installed():
    from pathlib import Path

    import pagedkv
    text = (Path(pagedkv.get_include()) / "pagedkv" / "records.h").read_text()
    assert "pkv_block_record" in text and "pkv_prefix_slot" in text


def test_arrays_are_sized_for_max_and_read_only():
    a = make(4, 100, 8)
    assert a.block_records.shape == (100,) and a.block_records.dtype == BLOCK_DTYPE
    assert a.token_ids.shape == (100, 8) and a.token_ids.dtype == np.uint32
    n = a.prefix_slots.shape[0]
    assert n >= 200 and n & (n - 1) == 0
    with pytest.raises(ValueError):
        a.token_ids[0, 0] = 1
    with pytest.raises(ValueError):
        a.block_records["refcount"][0] = 1


def test_repr():
    a = make(10, 32, 4)
    a.allocate()
    assert repr(a) == ("BlockAllocator(num_blocks=10, max_num_blocks=32, block_size=4; "
                       "free=9, allocated=1, cached=0, evictable=0, capacity=10, "
                       "xxh3=" + __import__("pagedkv.hashing").hashing.XXH3_SOURCE + ")")


# --- construction -----------------------------------------------------------------------

def test_construction_defaults():
    a = BlockAllocator(5)
    assert (a.num_blocks, a.max_num_blocks, a.block_size, a.prefix_cache_capacity) == (5, 5, 16, 5)
    assert a.null_block_id is None and a.num_free_blocks == 5
    a.check_invariants()


@pytest.mark.parametrize("args,kwargs,exc", [
    ((8, 4, 4), {}, InvalidArgument), ((0,), {}, InvalidArgument),
    ((1,), {"reserve_null_block": True}, InvalidArgument), ((4, 4, 0), {}, InvalidArgument),
    ((4.0,), {}, InvalidArgumentType), ((4, None, "16"), {}, InvalidArgumentType),
    ((4,), {"hash_seed": -1}, InvalidArgument), ((4,), {"hash_seed": 2**64}, InvalidArgument),
    ((4,), {"_hash_fn": 5}, InvalidArgumentType), ((4,), {"on_block_event": 5}, InvalidArgumentType),
])
def test_bad_construction(args, kwargs, exc):
    with pytest.raises(exc):
        BlockAllocator(*args, **kwargs)


def test_random_seeds():                                              # H5
    seeds = {BlockAllocator(4, hash_seed=None).hash_seed for _ in range(3)}
    assert len(seeds) == 3
    chains = {tuple(BlockAllocator(4, block_size=4).chain_hashes(range(8)).tolist())
              for _ in range(3)}
    assert len(chains) == 3
    assert make().chain_hashes(range(10)).tolist() == chain_hashes(range(10), 4).tolist()


def test_null_block():
    a = make(4, 6, reserve_null_block=True)
    assert a.null_block_id == 0 and a.num_free_blocks == 3 and a.ref_count(0) == 0
    assert a.allocate_many(3).tolist() == [1, 2, 3] and a.allocate() is None
    with pytest.raises(InvariantViolation, match="null block"):
        a.free(0)
    with pytest.raises(InvariantViolation):
        a.incref(0)
    assert a.grow_by(2) == 2 and a.allocate_many(2).tolist() == [4, 5]
    assert a.num_allocated_blocks == 5
    a.check_invariants()


# --- allocation, FIFO, refcounts ------------------------------------------------------

def test_fifo_free_queue():                                            # docs/contracts/paged-kv.md, '4.7 Free-list order and grow_by'
    a = make(4)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    a.free(1)
    a.free(0)
    assert a.free_list() == [3, 1, 0]
    assert [a.allocate() for _ in range(3)] == [3, 1, 0]
    assert a.allocate() is None
    a.check_invariants()


def test_refcounts_and_counters():
    a = make(10, 32)
    b = a.allocate()
    a.incref(b)
    assert a.ref_count(b) == 2 and a.num_allocated_blocks == 1 and a.num_free_blocks == 9
    a.free(b)
    a.free(b)
    assert a.ref_count(b) == 0 and a.num_free_blocks == 10
    with pytest.raises(InvariantViolation, match="double free"):
        a.free(b)
    a.check_invariants()


def test_allocate_many_is_all_or_nothing():
    a = make(4)
    ids = a.allocate_many(3)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2]
    before = snapshot(a)
    assert a.allocate_many(2) is None
    assert snapshot(a) == before
    assert a.allocate_many(0).tolist() == []
    a.free_many(np.array([2, 0], dtype=np.int32))
    assert a.free_list() == [3, 2, 0]


def test_can_allocate_huge_is_false():
    assert make().can_allocate(2**70) is False


def test_free_many_multiplicity():
    a = make(4)
    a.allocate_many(2)
    a.incref(0)
    a.free_many([0, 1, 0])
    assert a.num_free_blocks == 4 and a.free_list() == [2, 3, 1, 0]
    a.check_invariants()


# --- prefix cache -----------------------------------------------------------------------

def test_register_lookup_lifecycle():                                  # A2/A3
    a = make(4)
    b = a.allocate()
    h = 0xABC
    i = ident([1, 2, 3, 4])
    assert a.register_prefix(b, h, i) is True and a.ref_count(b) == 2
    assert a.lookup_prefix(h, i) == b and a.ref_count(b) == 3
    a.free(b)
    a.free(b)
    assert a.ref_count(b) == 1 and a.num_evictable_blocks == 1 and a.num_free_blocks == 3
    assert a.lookup_prefix(h, ident([1, 2, 3, 5])) is None
    assert a.lookup_prefix(h, ident([1, 2, 3, 4], salt=1)) is None
    assert a.lookup_prefix(h, ident([1, 2, 3, 4], index=1)) is None
    assert a.lookup_prefix(h, ident([1, 2, 3, 4], keys=(1,))) is None
    assert a.lookup_prefix(h, ident([1, 2, 3, 4], parent=9)) is None
    assert a.lookup_prefix(h + 1, i) is None
    assert a.ref_count(b) == 1 and a.stats()["collisions_rejected"] == 5
    a.check_invariants()


def test_duplicate_registration_rules():                               # docs/contracts/paged-kv.md, '4.5 Duplicate registration rules'
    a = make(8)
    b1, b2 = a.allocate(), a.allocate()
    i = ident([1, 1, 1, 1])
    assert a.register_prefix(b1, 1, i)
    a.set_prefix_cache_capacity(1)
    assert a.register_prefix(b1, 1, i) is True            # refresh at capacity: no eviction
    assert a.ref_count(b1) == 2 and a.lru_hashes() == [1]
    assert a.register_prefix(b2, 1, i) is False           # hash held by another block
    assert a.ref_count(b2) == 1
    a.set_prefix_cache_capacity(8)
    assert a.register_prefix(b1, 2, i) is True            # alias move
    assert a.lru_hashes() == [2] and a.ref_count(b1) == 2
    assert a.lookup_prefix(1, i) is None
    a.check_invariants()


def test_alias_move_of_a_cache_only_block_keeps_it():
    a = make(4)
    b = a.allocate()
    a.register_prefix(b, 10, ident([1, 2, 3, 4]))
    a.free(b)                                             # cache-only
    assert a.register_prefix(b, 11, ident([1, 2, 3, 4])) is True
    assert a.ref_count(b) == 1 and a.num_evictable_blocks == 1 and a.lru_hashes() == [11]
    a.check_invariants()


def test_capacity_eviction_and_override():                             # A4/A5
    a = make(10)
    bs = a.allocate_many(4)
    a.set_prefix_cache_capacity(2)
    for k, b in enumerate(bs[:3].tolist(), start=1):
        a.register_prefix(b, k, ident([k] * 4))
    assert a.lru_hashes() == [2, 3] and a.ref_count(bs[0]) == 1
    assert a.stats()["capacity_evictions"] == 1
    a.set_prefix_cache_capacity(0)
    assert a.prefix_cache_len == 0 and a.register_prefix(bs[3], 9, ident([0] * 4)) is False
    assert a.num_allocated_blocks == 4
    a.check_invariants()


def test_pressure_eviction_takes_lru_cache_only_first():
    a = make(3)
    for k in range(3):
        b = a.allocate()
        a.cache_full_blocks([k] * 4, [b])
        a.free(b)
    a.find_longest_cache_hit([0] * 4)                     # hold block 0, touch it
    assert a.allocate() == 1 and a.stats()["pressure_evictions"] == 1
    assert a.allocate() == 2
    assert a.allocate() is None and a.ref_count(0) == 2
    a.check_invariants()


def test_allocate_many_scans_past_held_entries():
    a = make(6)
    ids = a.allocate_many(6)
    a.cache_full_blocks(np.arange(24), ids)
    a.free_many(ids[[1, 3, 5]])                            # 1, 3, 5 become cache-only
    assert a.num_evictable_blocks == 3 and a.can_allocate(3) and not a.can_allocate(4)
    assert a.allocate_many(4) is None
    got = a.allocate_many(3)
    # LRU is deepest first: 5 oldest, then 3, then 1.
    assert got.tolist() == [5, 3, 1] and a.prefix_cache_len == 3
    a.check_invariants()


def test_longest_hit_and_deepest_first_touch():
    a = make(8)
    ids = a.allocate_many(3)
    assert a.cache_full_blocks(np.arange(14), ids) == 3
    h = chain_hashes(np.arange(12), 4)
    assert a.lru_hashes() == h[::-1].tolist()
    blocks, n = a.find_longest_cache_hit(np.arange(14, dtype=np.uint32))
    assert blocks.dtype == np.int32 and blocks.tolist() == ids.tolist() and n == 12
    assert [a.ref_count(b) for b in ids] == [3, 3, 3]
    blocks, n = a.find_longest_cache_hit(np.r_[np.arange(4), [99] * 8])
    assert blocks.tolist() == [ids[0]] and n == 4
    assert a.stats()["query_tokens"] == 26 and a.stats()["hit_tokens"] == 16
    empty, n = a.find_longest_cache_hit([1, 2, 3])
    assert empty.tolist() == [] and n == 0 and empty.dtype == np.int32
    a.check_invariants()


def test_salts_and_keys_isolate():                                     # H3, A10
    a = make(16)
    A, B = salt_domain_id("a"), salt_domain_id("b")
    ids = a.allocate_many(2)
    a.cache_full_blocks(range(8), ids, cache_salt=A)
    assert a.find_longest_cache_hit(range(8))[1] == 0
    assert a.find_longest_cache_hit(range(8), cache_salt=B)[1] == 0
    assert a.find_longest_cache_hit(range(8), cache_salt=A)[1] == 8
    ids = a.allocate_many(3)
    a.cache_full_blocks(range(100, 112), ids, extra_keys_per_block=[(555,), (), ()])
    assert a.find_longest_cache_hit(range(100, 112), extra_keys_per_block=[(), (), ()])[1] == 0
    assert a.find_longest_cache_hit(range(100, 112),
                                    extra_keys_per_block=[(555,), (), (9,)])[1] == 8
    # The stored digest is BLAKE2b-128 of the keys.
    rec = a.block_records[ids[0]]
    assert rec["extra_keys_digest_len"] == 16
    assert rec["extra_keys_digest"].tobytes() == extra_keys_digest((555,))
    assert a.block_records[ids[1]]["extra_keys_digest_len"] == 0
    assert a.block_records[ids[0]]["cache_salt"] == 0
    a.check_invariants()


def test_collision_is_a_miss_and_stops_the_chain():                    # H4, A12
    a = make(8, _hash_fn=lambda *args: 5)
    b0 = a.allocate()
    assert a.cache_full_blocks([1, 2, 3, 4], [b0]) == 1
    assert a.find_longest_cache_hit([11, 12, 13, 14])[1] == 0
    assert a.ref_count(b0) == 2
    b1 = a.allocate()
    assert a.cache_full_blocks([11, 12, 13, 14], [b1]) == 0
    assert a.find_longest_cache_hit([1, 2, 3, 4])[0].tolist() == [b0]
    assert a.stats()["collisions_rejected"] == 2
    a.check_invariants()


def test_hash_fn_zero_is_remapped_and_sees_its_arguments():
    calls = []

    def fn(parent, tokens, keys, salt, index, seed):
        calls.append((parent, tokens.tolist(), keys, salt, index, seed))
        return 0

    a = make(4, hash_seed=3, _hash_fn=fn)
    assert a.chain_hashes(range(8), extra_keys=(7,), cache_salt=9).tolist() == [1, 1]
    assert calls == [(0, [0, 1, 2, 3], (7,), 9, 0, 3), (1, [4, 5, 6, 7], (7,), 9, 1, 3)]


@pytest.mark.parametrize("call", [
    lambda a: a.cache_full_blocks(range(12), [6, 7, 8]),
    lambda a: a.find_longest_cache_hit(range(12)),
    lambda a: a.chain_hashes(range(12)),
])
def test_a_failing_hash_hook_changes_nothing(call):
    """The hook fails on the third block: the chain is hashed before any table changes."""
    def hook(parent, tokens, keys, salt, index, seed):
        if index == 2:
            raise RuntimeError("hook failed")
        return int(tokens[0]) + 1

    b = BlockAllocator(12, 16, 4, hash_seed=0, _hash_fn=hook)
    b.allocate_many(9)
    b.cache_full_blocks(range(8), [0, 1])
    before = snapshot(b)
    with pytest.raises(RuntimeError, match="hook failed"):
        call(b)
    assert snapshot(b) == before
    b.check_invariants()


def test_replay_past_a_verified_prefix():                              # A13
    a = make(8)
    first = a.allocate_many(2)
    a.cache_full_blocks(range(8), first)
    a.free_many(first)
    ids = a.allocate_many(4)
    assert ids.tolist() == [2, 3, 4, 5]
    assert a.cache_full_blocks(range(16), ids) == 2
    assert a.ref_count(2) == 1 and a.ref_count(3) == 1
    assert a.find_longest_cache_hit(range(16))[0].tolist() == [0, 1, 4, 5]
    a.check_invariants()


def test_publish_restored_batch():                                     # A15
    a = make(8)
    ids = a.allocate_many(2).tolist()
    h = chain_hashes(range(8), 4).tolist()
    entries = [RestoredBlock(ids[0], h[0], ident(range(4))),
               RestoredBlock(ids[1], h[1], ident(range(4, 8), parent=h[0], index=1))]
    assert a.publish_restored_batch(entries) is True
    assert [a.ref_count(b) for b in ids] == [2, 2]
    assert a.lru_hashes() == [h[1], h[0]]
    assert a.find_longest_cache_hit(range(8))[0].tolist() == ids
    more = a.allocate_many(2).tolist()
    before = snapshot(a)
    clash = [RestoredBlock(more[0], 77, ident([7] * 4)), RestoredBlock(more[1], h[1], ident([7] * 4))]
    assert a.publish_restored_batch(clash) is False
    dup_block = [RestoredBlock(more[0], 78, ident([7] * 4)), RestoredBlock(more[0], 79, ident([7] * 4))]
    assert a.publish_restored_batch(dup_block) is False
    dup_hash = [RestoredBlock(more[0], 80, ident([7] * 4)), RestoredBlock(more[1], 80, ident([7] * 4))]
    assert a.publish_restored_batch(dup_hash) is False
    already = [RestoredBlock(ids[0], 81, ident([7] * 4))]
    assert a.publish_restored_batch(already) is False
    with pytest.raises(InvalidArgumentType) as err:  # was a bare TypeError from list(5)
        a.publish_restored_batch(5)
    assert str(err.value) == "entries must be an iterable of RestoredBlock, got int"
    assert snapshot(a) == before
    with pytest.raises(InvalidArgument, match="block_size"):
        a.publish_restored_batch([RestoredBlock(more[0], 82, ident([1, 2, 3]))])
    with pytest.raises(InvariantViolation, match="not allocated"):
        a.publish_restored_batch([RestoredBlock(7, 82, ident([1, 2, 3, 4]))])
    with pytest.raises(InvalidArgument, match="outside"):
        a.publish_restored_batch([RestoredBlock(8, 82, ident([1, 2, 3, 4]))])
    a.set_prefix_cache_capacity(3)
    assert a.publish_restored_batch([RestoredBlock(more[0], 90, ident([1] * 4)),
                                     RestoredBlock(more[1], 91, ident([2] * 4))]) is True
    assert a.lru_hashes() == [h[0], 91, 90]                # h[1] capacity-evicted
    assert a.publish_restored_batch([]) is True
    del before
    a.check_invariants()


def test_grow_by():                                                    # A16
    a = make(4, 8)
    live = a.allocate()
    cached = a.allocate()
    a.cache_full_blocks(range(4), [cached])
    a.free(cached)
    a.set_prefix_cache_capacity(2)
    assert a.grow_by(4) == 4 and a.prefix_cache_capacity == 8
    assert a.allocate_many(6).tolist() == [2, 3, 4, 5, 6, 7]
    assert a.ref_count(live) == 1 and a.find_longest_cache_hit(range(4))[1] == 4
    assert a.grow_by(1) == 0 and a.stats()["grows"] == 1
    a.check_invariants()


def test_purge_frees_in_lru_order_and_keeps_held_blocks():             # A17
    events = []
    a = make(10, on_block_event=lambda kind, hashes: events.append((kind, hashes.tolist())))
    ids = a.allocate_many(3)
    a.cache_full_blocks(range(12), ids)
    a.free_many(ids[1:])
    events.clear()
    assert a.purge_prefix_cache() == 3
    assert events == [("cleared", [])]
    assert a.prefix_cache_len == 0 and a.ref_count(ids[0]) == 1
    assert a.free_list()[-2:] == [ids[2], ids[1]]
    assert a.find_longest_cache_hit(range(12))[1] == 0
    assert a.purge_prefix_cache() == 0 and events == [("cleared", [])] * 2
    a.check_invariants()


def test_block_events():
    events = []
    a = make(4, on_block_event=lambda kind, hashes: events.append((kind, hashes.tolist())))
    ids = a.allocate_many(4)
    a.cache_full_blocks(range(16), ids)
    h = chain_hashes(range(16), 4).tolist()
    assert events == [("stored", h)]
    a.free_many(ids)
    events.clear()
    a.allocate_many(2)                                    # evicts the two tails
    assert events == [("removed", [h[3], h[2]])]
    events.clear()
    a.set_prefix_cache_capacity(1)
    assert events == [("removed", [h[1]])]


def test_event_hook_errors_never_undo(caplog):
    def hook(kind, hashes):
        raise RuntimeError("router down")

    a = make(4, on_block_event=hook)
    b = a.allocate()
    assert a.cache_full_blocks(range(4), [b]) == 1
    assert a.prefix_cache_len == 1 and "router down" in caplog.text
    a.on_block_event = None
    assert a.on_block_event is None
    a.check_invariants()


def test_stats_keys():
    a = make()
    assert tuple(a.stats()) == STATS_KEYS == (
        "query_tokens", "hit_tokens", "pressure_evictions", "capacity_evictions",
        "collisions_rejected", "grows")


# --- the prefix table under churn --------------------------------------------------------

def test_prefix_table_backward_shift_under_churn():
    """Inserts, alias moves and LRU-front removals over a small key space (dense probe
    clusters): the table agrees with an ordered-dict model after every step, and
    check_invariants (which walks every slot's probe run) passes throughout."""
    rng = np.random.default_rng(1)
    a = make(64, 64, 1)
    ids = a.allocate_many(64).tolist()
    model: dict[int, int] = {}                   # hash -> block, LRU order (oldest first)
    for step in range(4000):
        if rng.random() < 0.7:
            b = ids[rng.integers(64)]
            key = int(rng.integers(1, 300))
            ok = a.register_prefix(b, key, ident([b]))
            owner = model.get(key)
            if owner is not None and owner != b:
                assert ok is False
            else:
                assert ok is True
                for k in [k for k, v in model.items() if v == b and k != key]:
                    del model[k]
                model.pop(key, None)
                model[key] = b
        elif model:
            # Drop the LRU front through a capacity override, then lift it again.
            a.set_prefix_cache_capacity(len(model) - 1)
            del model[next(iter(model))]
            a.set_prefix_cache_capacity(64)
        assert a.lru_hashes() == list(model)
        if step % 50 == 0:
            a.check_invariants()
    for k, v in model.items():
        assert a.lookup_prefix(k, ident([v])) == v
    slots = a.prefix_slots
    assert int((slots["block"] >= 0).sum()) == a.prefix_cache_len == len(model)
    a.check_invariants()


# --- bad input: a specific exception, and every table unchanged ---------------------------

TOKENS_2D = np.zeros((2, 4), dtype=np.uint32)
BIG = [2**32, 1, 2, 3]

BAD_CALLS = [
    # token arrays
    ("hit float tokens", lambda a: a.find_longest_cache_hit(np.arange(8.0)), InvalidArgumentType, "tokens"),
    ("hit bool tokens", lambda a: a.find_longest_cache_hit(np.ones(8, bool)), InvalidArgumentType, "tokens"),
    ("hit object tokens", lambda a: a.find_longest_cache_hit(np.array([1, "x"], object)), InvalidArgumentType, "tokens"),
    ("hit 2-D tokens", lambda a: a.find_longest_cache_hit(TOKENS_2D), InvalidArgument, "1-D"),
    ("hit tokens >= 2**32", lambda a: a.find_longest_cache_hit(BIG), InvalidArgument, r"2\*\*32"),
    ("hit tokens >= 2**64", lambda a: a.find_longest_cache_hit([2**64, 1, 2, 3]), InvalidArgument, r"2\*\*32"),
    ("hit negative tokens", lambda a: a.find_longest_cache_hit([-1, 1, 2, 3]), InvalidArgument, r"2\*\*32"),
    ("register float tokens", lambda a: a.cache_full_blocks(np.arange(4.0), [6]), InvalidArgumentType, "tokens"),
    ("register 2-D tokens", lambda a: a.cache_full_blocks(TOKENS_2D, [6]), InvalidArgument, "1-D"),
    ("register tokens >= 2**32", lambda a: a.cache_full_blocks(BIG, [6]), InvalidArgument, r"2\*\*32"),
    ("chain_hashes 2-D", lambda a: a.chain_hashes(TOKENS_2D), InvalidArgument, "1-D"),
    # salts and keys
    ("str salt in lookup", lambda a: a.find_longest_cache_hit(range(8), cache_salt="t"), InvalidArgumentType, "salt_domain_id"),
    ("str salt in register", lambda a: a.cache_full_blocks(range(4), [6], cache_salt="t"), InvalidArgumentType, "salt_domain_id"),
    ("str salt in chain_hashes", lambda a: a.chain_hashes(range(4), cache_salt="t"), InvalidArgumentType, "salt_domain_id"),
    ("str salt in identity", lambda a: a.register_prefix(6, 5, BlockIdentity(np.arange(4, dtype=np.uint32), 0, b"", "t", 0)), InvalidArgumentType, "salt_domain_id"),
    ("salt >= 2**64", lambda a: a.find_longest_cache_hit(range(8), cache_salt=2**64), InvalidArgument, "cache_salt"),
    ("negative salt", lambda a: a.cache_full_blocks(range(4), [6], cache_salt=-1), InvalidArgument, "cache_salt"),
    ("extra key >= 2**64", lambda a: a.cache_full_blocks(range(4), [6], extra_keys=(2**64,)), InvalidArgument, "extra_keys"),
    ("float extra key", lambda a: a.find_longest_cache_hit(range(4), extra_keys=(1.0,)), InvalidArgumentType, "extra_keys"),
    ("both key forms", lambda a: a.find_longest_cache_hit(range(8), extra_keys=(1,), extra_keys_per_block=[(1,), (1,)]), InvalidArgument, "not both"),
    # ids
    ("free -1", lambda a: a.free(-1), InvalidArgument, r"\[0, num_blocks=12\)"),
    ("free num_blocks", lambda a: a.free(12), InvalidArgument, "block_id = 12"),
    ("free beyond max", lambda a: a.free(10**20), InvalidArgument, "block_id"),
    ("free float id", lambda a: a.free(1.0), InvalidArgumentType, "block_id"),
    ("free bool id", lambda a: a.free(True), InvalidArgumentType, "block_id"),
    ("free never allocated", lambda a: a.free(11), InvariantViolation, "never allocated"),
    ("free cache-only", lambda a: a.free(3), InvariantViolation, "cache-only"),
    ("incref -1", lambda a: a.incref(-1), InvalidArgument, "block_id"),
    ("incref free block", lambda a: a.incref(11), InvariantViolation, "not allocated"),
    ("ref_count out of range", lambda a: a.ref_count(12), InvalidArgument, "block_id"),
    ("free_many bad id mid-batch", lambda a: a.free_many([0, 1, 99]), InvalidArgument, r"block_ids\[2\] = 99"),
    ("free_many negative id", lambda a: a.free_many(np.array([0, -3])), InvalidArgument, r"block_ids\[1\]"),
    ("free_many too often", lambda a: a.free_many([0, 1, 0]), InvariantViolation, "more often"),
    ("free_many cache-only", lambda a: a.free_many([0, 3]), InvariantViolation, "prefix cache"),
    ("free_many never allocated", lambda a: a.free_many([0, 11]), InvariantViolation, "block_ids"),
    ("free_many float ids", lambda a: a.free_many(np.array([0.0])), InvalidArgumentType, "block_ids"),
    ("free_many 2-D ids", lambda a: a.free_many(np.zeros((1, 1), int)), InvalidArgument, "1-D"),
    ("register id out of range", lambda a: a.cache_full_blocks(range(8), [6, 12]), InvalidArgument, r"block_ids\[1\] = 12"),
    ("register free block", lambda a: a.cache_full_blocks(range(8), [6, 11]), InvariantViolation, "not allocated"),
    ("register too few tokens", lambda a: a.cache_full_blocks(range(4), [6, 7]), InvalidArgument, "8 tokens"),
    ("register short per-block keys", lambda a: a.cache_full_blocks(range(12), [6, 7, 8], extra_keys_per_block=[(), ()]), InvalidArgument, "extra_keys_per_block"),
    # register_prefix / lookup_prefix / publish
    ("register_prefix hash 0", lambda a: a.register_prefix(6, 0, ident(range(4))), InvalidArgument, "reserved"),
    ("register_prefix hash 2**64", lambda a: a.register_prefix(6, 2**64, ident(range(4))), InvalidArgument, "block_hash"),
    ("register_prefix short identity", lambda a: a.register_prefix(6, 5, ident(range(3))), InvalidArgument, "block_size = 4"),
    ("register_prefix free block", lambda a: a.register_prefix(11, 5, ident(range(4))), InvariantViolation, "not allocated"),
    ("register_prefix not an identity", lambda a: a.register_prefix(6, 5, (1, 2)), InvalidArgumentType, "BlockIdentity"),
    ("register_prefix bad digest", lambda a: a.register_prefix(6, 5, BlockIdentity(np.arange(4, dtype=np.uint32), 0, b"abc", 0, 0)), InvalidArgument, "extra_keys_digest"),
    ("lookup_prefix hash -1", lambda a: a.lookup_prefix(-1, ident(range(4))), InvalidArgument, "block_hash"),
    ("lookup_prefix 2-D identity", lambda a: a.lookup_prefix(5, BlockIdentity(TOKENS_2D, 0, b"", 0, 0)), InvalidArgument, "1-D"),
    ("publish short identity", lambda a: a.publish_restored_batch([RestoredBlock(6, 5, ident(range(4))), RestoredBlock(7, 6, ident(range(3)))]), InvalidArgument, "block_size"),
    ("publish free block", lambda a: a.publish_restored_batch([RestoredBlock(6, 5, ident(range(4))), RestoredBlock(11, 6, ident(range(4)))]), InvariantViolation, "not allocated"),
    ("publish out-of-range id", lambda a: a.publish_restored_batch([RestoredBlock(12, 5, ident(range(4)))]), InvalidArgument, "block_id"),
    ("publish hash 0", lambda a: a.publish_restored_batch([RestoredBlock(6, 0, ident(range(4)))]), InvalidArgument, "reserved"),
    ("publish non-entry", lambda a: a.publish_restored_batch([5]), InvalidArgumentType, "RestoredBlock"),
    # counts
    ("allocate_many -1", lambda a: a.allocate_many(-1), InvalidArgument, "n = -1"),
    ("allocate_many 2**70", lambda a: a.allocate_many(2**70), InvalidArgument, r"2\*\*31"),
    ("allocate_many float", lambda a: a.allocate_many(1.5), InvalidArgumentType, "n must"),
    ("can_allocate -1", lambda a: a.can_allocate(-1), InvalidArgument, "n = -1"),
    ("grow_by -1", lambda a: a.grow_by(-1), InvalidArgument, "k = -1"),
    ("capacity -1", lambda a: a.set_prefix_cache_capacity(-1), InvalidArgument, "n = -1"),
]


@pytest.mark.parametrize("name,call,exc,match", BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(name, call, exc, match):
    a = populated()
    extra = a.allocate_many(3)                            # blocks 6, 7, 8 held, unregistered
    assert extra.tolist() == [6, 7, 8] and a.ref_count(3) == 1 and a.ref_count(11) == 0
    before = snapshot(a)
    with pytest.raises(exc, match=match):
        call(a)
    assert snapshot(a) == before
    a.check_invariants()


def test_check_invariants_names_what_broke():
    """Corrupt a private copy of the tables through the buffer protocol and check the
    report names the broken structure (the public views are read-only)."""
    a = populated()
    records = np.frombuffer(memoryview(a.block_records).cast("B"), dtype=BLOCK_DTYPE)
    assert not records.flags.writeable                    # views really are read-only
    import ctypes
    rec = a.block_records
    addr = rec.__array_interface__["data"][0] + 11 * BLOCK_DTYPE.itemsize \
        + BLOCK_DTYPE.fields["refcount"][1]
    ctypes.c_int32.from_address(addr).value = 5           # a free block with a refcount
    with pytest.raises(InvariantViolation, match="free block 11 has refcount 5"):
        a.check_invariants()
    ctypes.c_int32.from_address(addr).value = 0
    a.check_invariants()


@pytest.mark.parametrize("diverge_at", [0, 1, 15, 16, 17, 31, 32, 33, 39, 40])
def test_longest_hit_across_walk_groups(diverge_at):
    """The walk hashes and probes in groups of 16 blocks; a miss on either side of a group
    boundary ends the hit exactly there."""
    a = make(64, 64, 2)
    toks = np.arange(80, dtype=np.uint32)
    ids = a.allocate_many(40)
    assert a.cache_full_blocks(toks, ids) == 40
    query = toks.copy()
    if diverge_at < 40:
        query[2 * diverge_at + 1] = 1000
    blocks, n = a.find_longest_cache_hit(query)
    assert blocks.tolist() == ids[:diverge_at].tolist() and n == 2 * diverge_at
    a.check_invariants()


@pytest.mark.parametrize("collide_at", [0, 15, 16, 17])
def test_collision_across_walk_groups(collide_at):
    """A present hash whose stored identity differs stops the walk at that block."""
    a = make(64, 64, 2, _hash_fn=lambda parent, tokens, *rest: int(tokens[0]) + 1)
    toks = np.arange(80, dtype=np.uint32)
    ids = a.allocate_many(40)
    a.cache_full_blocks(toks, ids)
    query = toks.copy()
    query[2 * collide_at + 1] = 1000       # same first token: same hash, other identity
    _blocks, n = a.find_longest_cache_hit(query)
    assert n == 2 * collide_at and a.stats()["collisions_rejected"] == 1


def test_self_check_passes_and_reports_each_step(capsys):
    from pagedkv.selfcheck import run_self_check
    assert run_self_check() is True
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "allocator self-check" and out[-1] == "self-check passed"
    steps = [line for line in out if line.startswith("  [")]
    assert len(steps) == 6 and all(line.startswith("  [ok]") for line in steps)
    assert "0x321db453eb3be929" in steps[0]


def test_python_dash_m_pagedkv_runs_the_self_check():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "pagedkv"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "allocator self-check" in out.stdout and out.stdout.rstrip().endswith(
        "self-check passed")


def test_wheel_path_serves_the_same_cache():
    """A chain registered through libxxhash is found through the wheel and back: the
    allocator's walk, registration and chain_hashes agree on both XXH3 sources."""
    from pagedkv import hashing
    a = make(64, 64, 4)
    toks = np.arange(120, dtype=np.uint32)
    ids = a.allocate_many(30)
    a.cache_full_blocks(toks, ids)
    native = a.chain_hashes(toks).tolist()
    previous = hashing._set_xxh3_source("xxhash-wheel")
    try:
        assert a.chain_hashes(toks).tolist() == native
        assert a.find_longest_cache_hit(toks)[0].tolist() == ids.tolist()
        more = a.allocate_many(2)
        assert a.cache_full_blocks(np.arange(1000, 1008), more) == 2
    finally:
        hashing._set_xxh3_source(previous)
    assert a.find_longest_cache_hit(np.arange(1000, 1008))[0].tolist() == more.tolist()
    a.check_invariants()

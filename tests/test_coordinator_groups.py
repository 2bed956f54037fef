"""GroupedKVCoordinator: the sliding null sentinel (C5, C6), the cursor rule with rollback
(C7), preflight (C8), KV-shared aliases, routing of K/V by layer, and bad input leaving every
group unchanged (docs/coordinator.md), with exact ids, free-list orders and state after
errors."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator_support import FULL, full_sliding_alias, layout, prefill, state
from pagedkv.adapter.group_blocks import GroupBlocks
from pagedkv.allocator import BlockAllocator
from pagedkv.coordinator import (
    AttentionKind,
    GroupedKVCoordinator,
    KVCacheCoordinator,
    LayerKVCacheSpec,
    SlidingGroupBlocks,
    expired_blocks,
    group_layer_kv_cache_specs,
)
from pagedkv.errors import (
    CapacityExceeded,
    GroupManagerMismatch,
    InvalidArgument,
    InvalidArgumentType,
    InvariantViolation,
    PagedKVError,
    PoolExhausted,
)
from pagedkv.pool import LayerKVPool
from pagedkv.pool.memory_budget import MemoryBudget


def sliding_only(window=4, bs=2, blocks=32, **kw):
    specs = [LayerKVCacheSpec(0, AttentionKind.sliding(window), layout(bs))]
    return GroupedKVCoordinator.from_specs(specs, max_model_len=256, max_chunk=bs,
                                           blocks_per_group=(blocks,), hash_seed=0, **kw)


# --- C5, C6 the null sentinel ---------------------------------------------------------------


def test_expired_blocks_vectors():
    assert [expired_blocks(n, 4, 2) for n in (0, 4, 5, 6, 7, 11)] == [0, 0, 1, 1, 2, 4]
    assert expired_blocks(3, 1, 2) == 1  # window 1: a query needs only itself


def test_c5_sliding_prune_vectors_free_newest_first_and_keep_the_width():
    c = sliding_only()
    g = c.groups[0]
    null = g.null_block_id
    assert null == 0
    c.reset_for_new_request("s")
    c.record_tokens("s", np.arange(12))      # 6 blocks: ids 1..6
    assert c.block_table("s", 0).tolist() == [1, 2, 3, 4, 5, 6]
    tail = g.allocator.free_list()
    expected = {0: [1, 2, 3, 4, 5, 6], 4: [1, 2, 3, 4, 5, 6], 5: [0, 2, 3, 4, 5, 6],
                6: [0, 2, 3, 4, 5, 6], 7: [0, 0, 3, 4, 5, 6], 11: [0, 0, 0, 0, 5, 6]}
    freed_order = []
    for n, table in expected.items():
        before = set(g.allocator.free_list())
        c.prune_sliding_all("s", n)
        assert c.block_table("s", 0).tolist() == table, n
        freed_order += [b for b in g.allocator.free_list() if b not in before]
        assert c.num_table_blocks("s", 0) == 6          # the width never shrinks
        assert c.first_live_position("s", 0) == 2 * table.count(null)
    # Freed blocks joined the free list newest first: 1 (n=5), 2 (n=7), then 4 before 3.
    assert freed_order == [1, 2, 4, 3]
    assert g.allocator.free_list() == tail + [1, 2, 4, 3]
    assert [g.allocator.ref_count(b) for b in (1, 2, 3, 4, 5, 6)] == [0, 0, 0, 0, 1, 1]
    c.check_invariants()
    # The rollback cannot pass the committed frontier the row was pruned at.
    before = state(c)
    with pytest.raises(InvalidArgument, match="committed frontier"):
        c.rollback_last_tokens("s", 3)        # 12 -> 9 tokens: would need block 3 again
    assert state(c) == before
    c.rollback_last_tokens("s", 1)            # 12 -> 11, the frontier it was pruned at
    assert c.num_tokens("s") == 11


def test_c6_null_entries_cost_nothing_when_the_table_is_extended():
    c = sliding_only(window=8, bs=2, blocks=64)
    g = c.groups[0]
    c.reset_for_new_request("s")
    c.record_tokens("s", np.arange(20))       # width 10
    c.prune_sliding_all("s", 17)              # (17 - 7) // 2 = 5: entries 0-4 null
    assert c.block_table("s", 0).tolist()[:5] == [0] * 5
    free = g.allocator.num_free_blocks
    c.record_tokens("s", np.arange(20))       # width 20: exactly 10 new blocks
    assert c.num_table_blocks("s", 0) == 20
    assert free - g.allocator.num_free_blocks == 10
    c.check_invariants()


def test_prune_checks_committed_tokens_and_is_a_noop_below_the_window():
    c = sliding_only()
    c.reset_for_new_request("s")
    c.record_tokens("s", np.arange(6))
    before = state(c)
    with pytest.raises(InvalidArgument, match="outside"):
        c.prune_sliding(["s"], [7])
    with pytest.raises(InvalidArgument, match="ints"):
        c.prune_sliding(["s"], [2.5])
    with pytest.raises(InvalidArgument):
        c.prune_sliding(["s"], [-1])
    assert state(c) == before
    assert c.prune_sliding(["s"], [4]) == 0 and state(c) == before


# --- C7 the cursor rule ------------------------------------------------------------------


def test_c7_a_partial_failure_rolls_every_group_back():
    # Full group has room, the sliding group (2 usable blocks + null) has none left.
    c = full_sliding_alias(window=64, blocks=(16, 5))
    c.reset_for_new_request("b")
    c.record_tokens("b", np.arange(8))        # 2 blocks in each group
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(8))        # 2 more: the sliding group is out of blocks
    before = state(c)
    with pytest.raises(PoolExhausted, match="paged decode could not reserve"):
        c.record_tokens_all("a", [9])
    assert state(c) == before                 # the full group gave its new block back
    assert c.request_token_count_all("a") == 8
    with pytest.raises(PoolExhausted):
        c.record_decode_tokens(["a"], [9])
    assert state(c) == before
    with pytest.raises(PoolExhausted):
        c.allocate_suffix_blocks("a", 12)
    assert state(c) == before
    for g in c.groups:
        g.check_invariants(sorted(c._rows.row_of.values()))


def test_decode_step_failure_in_a_later_group_undoes_the_earlier_groups_appends():
    c = full_sliding_alias(window=64, blocks=(32, 4))   # sliding: 3 usable blocks
    for s in ("a", "b"):
        c.reset_for_new_request(s)
    c.record_tokens("a", np.arange(8))
    c.record_tokens("b", np.arange(4))        # sliding: 2 + 1 blocks held, 0 free
    before = state(c)
    # Both rows cross a boundary at 9 / 5 tokens: the full group appends 2, sliding fails.
    with pytest.raises(PoolExhausted):
        c.record_decode_tokens(["a", "b"], [1, 2])
    assert state(c) == before
    c.check_invariants()


# --- C8 preflight and disagreeing groups -----------------------------------------------------


def test_c8_reserve_rows_all_preflights_every_group_before_any_reserves():
    c = full_sliding_alias(window=64, blocks=(16, 5))
    c.reset_for_new_request("b")
    c.record_tokens("b", np.arange(12))       # 3 of the 4 usable sliding blocks
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(4))        # the last one
    before = state(c)
    with pytest.raises(PoolExhausted, match="group 1 needs 2 more blocks"):
        c.reserve_rows_all("a", 8)
    assert state(c) == before
    with pytest.raises(CapacityExceeded, match="max_model_len is 256"):
        c.reserve_rows_all("a", 300)
    with pytest.raises(InvalidArgument, match="past"):
        c.reserve_rows_all("a", 1 << 31)
    assert state(c) == before
    c.release_request("b")
    assert c.reserve_rows_all("a", 4) == 2     # one more block in each group
    assert c.num_tokens("a") == 4              # the cursor does not move
    assert [c.num_table_blocks("a", g) for g in (0, 1)] == [2, 2]


def budget_refused_growth_coordinator(budget_blocks: int = 3):
    """Group 0 full (fixed, 4 blocks, its two free blocks short of 3 unless it evicts the
    cached ones), group 1 sliding (3 blocks, max 8) whose memory budget (``budget_blocks``)
    refuses any growth by default."""
    lay = layout(4)
    specs = [LayerKVCacheSpec(0, FULL, lay), LayerKVCacheSpec(1, AttentionKind.sliding(8), lay)]
    geo = lay.pool_geometry(1)
    full = GroupBlocks(BlockAllocator(4, None, 4, hash_seed=0), LayerKVPool(geo, 4, 4),
                       growth=False)
    pool = LayerKVPool(geo, 3, 8, memory_budget=MemoryBudget(geo.pool_bytes(budget_blocks)))
    sliding = SlidingGroupBlocks(BlockAllocator(3, 8, 4, hash_seed=0, reserve_null_block=True),
                                 pool, 8, growth=True)
    c = GroupedKVCoordinator(KVCacheCoordinator.from_groups(
        specs, group_layer_kv_cache_specs(specs, 64, 8), [full, sliding]), max_model_len=64)
    system = np.arange(100, 108, dtype=np.uint32)
    c.reset_for_new_request("x")
    prefill(c, "x", system)
    c.register_full_blocks_for_reuse("x")
    c.release_request("x")                    # 2 cached (evictable) full blocks, 2 free
    c.reset_for_new_request("a")
    return c, system


@pytest.mark.parametrize("call", ["record", "allocate", "reserve_rows", "decode"])
def test_a_growth_refused_in_a_later_group_evicts_nothing_in_an_earlier_one(call):
    # The full group needs 3 blocks (2 free + 1 cached, evictable); the sliding group needs 3,
    # has 2 free and room to grow, but its budget refuses. The reservation used to allocate
    # in the full group first (evicting a cached block of the system prompt, reordering its
    # free list) and only then fail in the sliding group: the rollback freed the blocks, the
    # prefix cache entry was gone and the next request hit 4 tokens instead of 8.
    c, system = budget_refused_growth_coordinator()
    if call == "decode":
        c.record_tokens("a", np.arange(4))    # 1 block in each group; the 5th token needs
        c.reset_for_new_request("b")          # a second
        c.record_tokens("b", np.arange(4))    # sliding: 0 free, full: 0 free, 2 evictable
    before = state(c)
    with pytest.raises(PoolExhausted, match="free or evictable"):
        if call == "record":
            c.record_tokens("a", np.arange(12))
        elif call == "allocate":
            c.allocate_suffix_blocks("a", 12)
        elif call == "reserve_rows":
            c.reserve_rows_all("a", 12)
        else:
            c.record_decode_tokens(["a", "b"], [1, 2])
    assert state(c) == before                 # the full group's LRU and free list included
    if call != "decode":                      # (there a and b took the sliding copies)
        c.reset_for_new_request("y")
        assert c.find_cached_prefix("y", np.append(system, 1)).cached_tokens == 8


def test_a_growable_group_grows_before_any_group_allocates():
    # The same reservation with a budget that takes the growth: it succeeds, the growth
    # happens in the preflight (one grow event) and the reservation then evicts one block.
    c, _ = budget_refused_growth_coordinator(budget_blocks=16)
    c.record_tokens("a", np.arange(12))
    assert c.groups[1].pool.num_blocks == 6 and c.stats()["grow_events"] == 1  # 3 -> 6
    assert [c.num_table_blocks("a", g) for g in (0, 1)] == [3, 3]
    c.check_invariants()


def test_c8_groups_that_disagree_on_the_live_boundary_raise_invariant_violation():
    c = full_sliding_alias()
    c.reset_for_new_request("a")
    prefill(c, "a", np.arange(12))
    c.finalize_turn_keep_live("a")
    assert c.can_continue_all("a", np.arange(14))
    # A group manager used behind the coordinator's back: the sliding table loses a block.
    c.groups[1].truncate(c._row("a"), 2)
    with pytest.raises(InvariantViolation, match="groups disagree on live continuation "
                                                 "boundary"):
        c.continue_turn_all("a", np.arange(14), 14)
    with pytest.raises(InvariantViolation):
        c.request_token_count_all("a")
    with pytest.raises(InvariantViolation):
        c.can_continue_all("a", np.arange(14))
    with pytest.raises(InvariantViolation):
        c.check_invariants()


def test_keep_live_turns_across_groups():
    c = full_sliding_alias()
    c.reset_for_new_request("a")
    prefill(c, "a", np.arange(13))
    assert c.finalize_keep_live_all("a") > 0
    assert c.finalize_keep_live_all("a") == 0          # idempotent
    assert not c.can_continue_all("a", np.arange(5))   # shorter than the live tokens
    assert c.continue_turn_all("a", np.arange(20), 20) == (13, 2)
    assert [c.num_table_blocks("a", g) for g in (0, 1)] == [5, 5]
    with pytest.raises(PagedKVError, match="not finalized"):
        c.continue_turn_all("a", np.arange(20), 20)
    c.check_invariants()


# --- aliases and routed K/V ---------------------------------------------------------------


def test_a_write_through_an_alias_route_is_an_error_and_changes_nothing():
    c = full_sliding_alias()
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(4))
    before = state(c)
    kv = np.ones((4, 1, 2), np.float32)
    with pytest.raises(InvalidArgument, match="layer 2 is a KV-shared alias of layer 0"):
        c.write_kv("a", 2, kv, kv)
    with pytest.raises(InvalidArgument, match="layer 9 has no KV-cache route"):
        c.write_kv("a", 9, kv, kv)
    assert state(c) == before


def test_a_bool_layer_or_group_id_is_refused_not_taken_as_1():
    # write_kv / gather_kv looked the route up with isinstance(layer, int), and True == 1:
    # write_kv(s, True, ...) wrote layer 1's K/V (route_for_layer(True) itself refused it).
    c = full_sliding_alias()
    c.reset_for_new_request("a")
    prefill(c, "a", np.arange(6, dtype=np.uint32))
    before = state(c)
    kv = np.full((1, 1, 2), 9.0, np.float32)
    for call in (lambda: c.write_kv("a", True, kv, kv), lambda: c.gather_kv("a", True),
                 lambda: c.gather_kv("a", False)):
        with pytest.raises(InvalidArgumentType, match="layer must be an int, got bool"):
            call()
    for call in (lambda: c.block_table("a", True), lambda: c.num_table_blocks("a", False),
                 lambda: c.write_kv_layers("a", True, kv[None], kv[None]),
                 lambda: c.first_live_position("a", 1.0)):
        with pytest.raises(InvalidArgumentType, match="group_id must be an int, got"):
            call()
    assert state(c) == before
    assert c.gather_kv("a", np.int64(1))[0][:, 0, 0].tolist() == [1, 2, 3, 4, 5, 6]


def test_routed_writes_reads_and_the_alias_reading_its_anchor():
    c = full_sliding_alias(window=8)
    c.reset_for_new_request("a")
    prefill(c, "a", np.arange(20))            # K = position + layer, V = K + 0.5
    k0, v0 = c.gather_kv("a", 0)
    assert k0[:, 0, 0].tolist() == list(range(20)) and np.array_equal(v0, k0 + 0.5)
    k2, v2 = c.gather_kv("a", 2)              # the alias reads layer 0's K/V
    assert np.array_equal(k2, k0) and np.array_equal(v2, v0)
    live = c.first_live_position("a", 1)
    assert live == 12                          # (20 - 7) // 4 = 3 blocks dropped
    k1, _ = c.gather_kv("a", 1, start=live)
    assert k1[:, 0, 0].tolist() == [p + 1.0 for p in range(12, 20)]
    k1, _ = c.gather_kv("a", 1, start=15)
    assert k1[:, 0, 0].tolist() == [p + 1.0 for p in range(15, 20)]
    # start=False / 0.0 equal 0: they took the pool's fast gather, which the validating
    # path (as_count) refuses; refused on both paths now.
    for bad in (False, 0.0):
        with pytest.raises(InvalidArgumentType, match="start must be an int"):
            c.gather_kv("a", 0, start=bad)
    before = state(c)
    with pytest.raises(InvalidArgument, match="left the sliding window"):
        c.gather_kv("a", 1)
    with pytest.raises(InvalidArgument, match="left the sliding window"):
        c.write_kv("a", 1, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32),
                   start=3)
    assert state(c) == before
    # Per-group all-layers write: group 1 has one physical layer (layer 1).
    c.record_tokens("a", [7])
    ones = np.ones((1, 1, 1, 2), np.float32)
    c.write_kv_layers("a", 1, ones * 3, ones * 4)
    assert c.gather_kv("a", 1, start=20)[0][:, 0, 0].tolist() == [3.0]
    with pytest.raises(InvalidArgument):
        c.write_kv_layers("a", 1, np.ones((2, 1, 1, 2), np.float32), ones)
    with pytest.raises(InvalidArgument):
        c.write_kv_layers("a", 5, ones, ones)


def test_prepare_decode_gives_one_batch_per_group_with_null_entries():
    c = full_sliding_alias(window=8)
    for s, n in (("a", 20), ("b", 6)):
        c.reset_for_new_request(s)
        prefill(c, s, np.arange(n))
    full, sliding = c.prepare_decode(["a", "b"])
    assert full.block_tables.tolist() == [[0, 1, 2, 3, 4], [5, 6, -1, -1, -1]]
    null = c.groups[1].null_block_id
    assert sliding.block_tables.tolist() == [[null, null, null, 4, 5], [6, 7, -1, -1, -1]]
    assert full.seq_lens.tolist() == sliding.seq_lens.tolist() == [20, 6]
    assert full.slot_mapping.tolist() == [4 * 4 + 3, 6 * 4 + 1]
    assert sliding.slot_mapping.tolist() == [5 * 4 + 3, 7 * 4 + 1]


# --- release -----------------------------------------------------------------------------


def test_release_applies_to_every_group_then_raises_the_first_error():
    c = full_sliding_alias(window=64)
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(8))
    sliding = c.groups[1]
    stolen = int(c.block_table("a", 1)[0])
    sliding.allocator.free(stolen)            # a reference freed behind the table's back
    with pytest.raises(InvariantViolation):
        c.release_request_all("a")
    assert c.live_seq_ids() == ["a"]          # the failed group keeps its table ...
    assert c.num_table_blocks("a", 0) == 0    # ... the full group was released
    assert c.num_table_blocks("a", 1) == 2
    assert c.groups[0].allocator.num_allocated_blocks == 0
    taken = []                                # mend: allocate until `stolen` is held again
    while (b := sliding.allocator.allocate()) != stolen:
        taken.append(b)
    sliding.allocator.free_many(taken)
    assert sliding.allocator.ref_count(stolen) == 1
    assert c.release_request_all("a") == 2
    assert c.live_seq_ids() == []
    c.check_invariants()


# --- capacity and wiring ---------------------------------------------------------------


def test_capacity_errors_name_the_numbers_and_change_nothing():
    c = full_sliding_alias(window=8, blocks=(16, 6), max_model_len=40)
    c.reset_for_new_request("a")
    before = state(c)
    with pytest.raises(CapacityExceeded, match="request requires 21 paged blocks but the max "
                                               "pool holds 16 \\(group 0\\)"):
        c.reservation_for(80, 4)
    with pytest.raises(CapacityExceeded, match="max_model_len is 40"):
        c.record_tokens("a", np.arange(41))
    with pytest.raises(CapacityExceeded, match="prefill in chunks"):
        c.record_tokens("a", np.arange(24))     # 6 sliding blocks at once, 5 usable
    assert state(c) == before
    assert c.reservation_for(16, 4) == (5, 5)   # sliding capped at its admission blocks
    for _ in range(5):                          # chunked, pruned between chunks: fits
        c.record_tokens("a", np.arange(8))
        c.prune_sliding_all("a", c.num_tokens("a"))
    assert c.num_tokens("a") == 40
    with pytest.raises(CapacityExceeded, match="max_model_len of 40|max_model_len is 40"):
        c.record_decode_tokens(["a"], [1])


@pytest.mark.parametrize("blocks", [None, (16, 6)])
def test_max_num_seqs_below_one_is_refused_with_or_without_a_budget(blocks):
    # With blocks_per_group, max_num_seqs=0 used to build a coordinator (1 row) where the
    # budgeted construction raises.
    with pytest.raises(InvalidArgument, match="max_num_seqs = 0 must be >= 1"):
        full_sliding_alias(blocks=blocks, max_num_seqs=0,
                           **({} if blocks else {"memory_bytes": 1 << 14}))


def test_managers_must_implement_their_groups():
    lay = layout(4)
    specs = [LayerKVCacheSpec(0, FULL, lay), LayerKVCacheSpec(1, AttentionKind.sliding(8), lay)]
    groups = group_layer_kv_cache_specs(specs, 64, 8)

    def full_mgr(layers=1, bs=4):
        return GroupBlocks(BlockAllocator(8, None, bs), LayerKVPool(
            layout(bs).pool_geometry(layers), 8))

    def sliding_mgr(window=8, null=True):
        return SlidingGroupBlocks(BlockAllocator(8, None, 4, reserve_null_block=True),
                                  LayerKVPool(lay.pool_geometry(1), 8), window)

    ok = KVCacheCoordinator.from_groups(specs, groups, [full_mgr(), sliding_mgr()])
    GroupedKVCoordinator(ok, max_model_len=64)
    cases = [([sliding_mgr(), sliding_mgr()], 0, "manager is a SlidingGroupBlocks"),
             ([full_mgr(), full_mgr()], 1, "manager is a GroupBlocks"),
             ([full_mgr(), sliding_mgr(window=16)], 1, "window is 8 tokens"),
             ([full_mgr(layers=2), sliding_mgr()], 0, "num_layers = 2"),
             (["not a manager", sliding_mgr()], 0, "expected a GroupBlocks")]
    for managers, gid, message in cases:
        topology = KVCacheCoordinator.from_groups(specs, groups, managers)
        with pytest.raises(GroupManagerMismatch, match=message) as e:
            GroupedKVCoordinator(topology, max_model_len=64)
        assert e.value.group == gid
    with pytest.raises(InvalidArgument, match="reserve the null block"):
        SlidingGroupBlocks(BlockAllocator(8, None, 4), LayerKVPool(lay.pool_geometry(1), 8), 8)


def test_budgeted_construction_and_repr():
    c = full_sliding_alias(blocks=None, memory_bytes=1 << 14, max_num_seqs=4)
    assert c.max_concurrent_sequences == c.budget.admission_width == 4
    assert [g.pool.num_blocks for g in c.groups] == list(c.budget.blocks_per_group)
    assert "GroupedKVCoordinator(live=0" in repr(c) and "sliding(8)" in repr(c)
    assert "window=8" in repr(c.groups[1])


@pytest.mark.parametrize("failure", ["narrow_tokens", "freed_entry", "dropped_twice",
                                     "hash_hook"])
def test_prune_rows_refuses_before_changing_any_row(failure):
    # table_ops.prune_rows used to check each row inside its loop: a row with too narrow a
    # token array raised, and release_ids refused a freed entry after register_chain had
    # published that row, each after the earlier rows were pruned, published and freed.
    from pagedkv.adapter import table_ops

    bs, window = 2, 2
    calls = []

    def hook(parent, tokens, keys, salt, index, seed):
        calls.append(index)
        if len(calls) > 1:                          # row 1's hash: row 0 hashed first
            raise RuntimeError("hash hook failed")
        return parent * 31 + int(tokens.sum()) + index + 1

    alloc = BlockAllocator(16, 16, bs, hash_seed=0, reserve_null_block=True,
                           _hash_fn=hook if failure == "hash_hook" else None)
    ids = alloc.allocate_many(6)
    table = np.full((2, 3), -1, np.int32)
    table[0], table[1] = ids[:3], ids[3:]
    num_blocks = np.array([3, 3], np.int32)
    null_upto = np.zeros(2, np.int32)
    revision = np.zeros(2, np.int64)
    parent_hash = np.zeros(2, np.uint64)
    parent_known = np.zeros(2, np.bool_)
    committed = np.array([4, 6], np.int32)          # row 0 drops 1 block, row 1 drops 2
    tokens = np.arange(12, dtype=np.uint32).reshape(2, 6)
    if failure == "narrow_tokens":
        tokens = np.ascontiguousarray(tokens[:, :2])  # row 1 needs 4 tokens
    elif failure == "freed_entry":
        alloc.free(int(table[1, 1]))
    elif failure == "dropped_twice":
        table[1, 0] = table[0, 0]                   # held once, dropped by both rows
        alloc.free(int(ids[3]))
    salts = np.zeros(2, np.uint64)
    publish = np.full(2, table_ops.PUBLISH_PLAIN, np.uint8)
    arrays = (table, num_blocks, null_upto, revision, parent_hash, parent_known)
    before = [a.copy() for a in arrays]
    alloc_before = (alloc.block_records.copy(), alloc.prefix_slots.copy(), alloc.free_list(),
                    alloc.lru_hashes(), alloc.prefix_cache_len)
    error = RuntimeError if failure == "hash_hook" else (
        InvalidArgument if failure == "narrow_tokens" else InvariantViolation)
    with pytest.raises(error):
        table_ops.prune_rows(alloc, table, num_blocks, null_upto, revision, parent_hash,
                             parent_known, np.array([0, 1], np.intp), committed, window,
                             tokens, salts, publish)
    for a, b in zip(arrays, before, strict=True):
        assert a.tobytes() == b.tobytes()
    after = (alloc.block_records, alloc.prefix_slots, alloc.free_list(), alloc.lru_hashes(),
             alloc.prefix_cache_len)
    assert after[0].tobytes() == alloc_before[0].tobytes()
    assert after[1].tobytes() == alloc_before[1].tobytes()
    assert after[2:] == alloc_before[2:]
    alloc.check_invariants()
    if failure in ("narrow_tokens", "hash_hook"):   # the same call on good input prunes both
        tokens = np.arange(12, dtype=np.uint32).reshape(2, 6)
        calls.clear()
        alloc = BlockAllocator(16, 16, bs, hash_seed=0, reserve_null_block=True)
        ids = alloc.allocate_many(6)
        table[0], table[1] = ids[:3], ids[3:]
        freed, keyed = table_ops.prune_rows(
            alloc, table, num_blocks, null_upto, revision, parent_hash, parent_known,
            np.array([0, 1], np.intp), committed, window, tokens, salts, publish)
        assert (freed, len(keyed)) == (3, 0)
        assert null_upto.tolist() == [1, 2] and revision.tolist() == [1, 1]
        assert alloc.prefix_cache_len == 3
        alloc.check_invariants()

"""PagedKVCacheAdapter: acceptance scenarios D1–D15 and P6–P7 (docs/contracts/paged-kv.md, '9.3
Pool, sizing and growth' to '9.4 Adapter') with exact
values, the batched decode step, K/V scatter/gather, and bad input leaving every table, the pool
and the allocator unchanged. Run against every allocator implementation."""

from __future__ import annotations

import logging
import types

import numpy as np
import pytest

from allocator_implementations import ALLOCATORS, observables
from pagedkv.adapter import ColdRestore, DecodeBatch, PagedKVCacheAdapter, TurnPlanReason
from pagedkv.errors import (
    AuxStateUnconfirmed,
    CapacityExceeded,
    InvalidArgument,
    InvalidArgumentType,
    LookupAlreadyDone,
    PagedKVError,
    PoolExhausted,
    SidecarLayoutMismatch,
    StaleBlockTable,
)
from pagedkv.pool import LayerKVPool, PoolGeometry

LAYERS, HEADS, DIM = 2, 1, 2


@pytest.fixture(params=ALLOCATORS)
def make(request):
    """``make(num_blocks, max_num_blocks=None, block_size=4, **adapter_kwargs) -> adapter``."""
    cls = request.param

    def make(num_blocks, max_num_blocks=None, block_size=4, *, allocator=None, pool=None,
             **kwargs):
        if allocator is None:
            allocator = cls(num_blocks, max_num_blocks, block_size, hash_seed=0)
        if pool is None:
            pool = LayerKVPool(PoolGeometry(LAYERS, HEADS, DIM, block_size, "float32"),
                               allocator.num_blocks, allocator.max_num_blocks)
        return PagedKVCacheAdapter(allocator, pool, **kwargs)

    make.cls = cls
    return make


def state(adapter: PagedKVCacheAdapter) -> dict:
    """Everything observable about an adapter, its allocator and its pool."""
    pool = adapter.pool
    out = {"allocator": observables(adapter.allocator), "generation": pool.generation,
           "pool_blocks": pool.num_blocks, "stats": adapter.stats()}
    out["pool"] = [pool.read_block(b).tobytes() for b in range(pool.num_blocks)]
    out["seqs"] = {s: (adapter.block_table(s).tolist(), adapter.request_tokens(s).tolist(),
                       adapter.cached_token_count(s), adapter.physical_revision(s))
                   for s in adapter.live_seq_ids()}
    return out


def start(adapter, seq, prompt, **lookup):
    """reset → lookup → allocate → record the uncached part; returns cached tokens."""
    adapter.reset_for_new_request(seq)
    hit = adapter.find_cached_prefix(seq, prompt, **lookup)
    adapter.allocate_suffix_blocks(seq, len(prompt))
    adapter.record_tokens(seq, np.asarray(prompt)[hit.cached_tokens:])
    return hit.cached_tokens


def rc(adapter, blocks):
    return [adapter.allocator.ref_count(b) for b in blocks]


# --- D1–D15 -----------------------------------------------------------------------------


def test_d1_construction_checks(make):
    alloc = make.cls(16, None, 4, hash_seed=0)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCacheAdapter(alloc, LayerKVPool(PoolGeometry(1, 1, 2, 8, "float32"), 16))
    with pytest.raises(ValueError, match="num_blocks"):
        PagedKVCacheAdapter(alloc, LayerKVPool(PoolGeometry(1, 1, 2, 4, "float32"), 8))
    with pytest.raises(ValueError, match="max_num_blocks"):
        PagedKVCacheAdapter(alloc, LayerKVPool(PoolGeometry(1, 1, 2, 4, "float32"), 16, 32))


def test_d2_miss_then_hit(make):
    a = make(16)
    prompt = list(range(1, 9))
    assert start(a, "r1", prompt) == 0
    assert a.register_full_blocks_for_reuse("r1") == 2
    a.release_request("r1")
    a.reset_for_new_request("r2")
    hit = a.find_cached_prefix("r2", prompt)
    assert hit.cached_tokens == 8 and hit.hot_blocks.tolist() == [0, 1]
    assert hit.restored_blocks.tolist() == [] and hit.sidecar is None
    assert a.request_tokens("r2").tolist() == prompt[:8]
    assert a.num_tokens("r2") == 8
    with pytest.raises(LookupAlreadyDone):
        a.find_cached_prefix("r2", prompt)
    a.reset_for_new_request("miss")
    assert a.find_cached_prefix("miss", [90, 91, 92]).cached_tokens == 0
    with pytest.raises(LookupAlreadyDone):
        a.find_cached_prefix("miss", [90, 91, 92])
    assert a.allocate_suffix_blocks("miss", 10) == 3
    assert a.allocate_suffix_blocks("r2", 10) == 1


def test_d3_the_cap_precedes_the_allocator(make):
    a = make(16)
    start(a, "x", range(8))
    a.register_full_blocks_for_reuse("x")
    a.release_request("x")
    before = rc(a, [0, 1])
    a.reset_for_new_request("y")
    assert a.find_cached_prefix("y", range(8), max_tokens=7).cached_tokens == 4
    assert rc(a, [0, 1]) == [before[0] + 1, before[1]]
    a.reset_for_new_request("z")
    snap = observables(a.allocator)
    assert a.find_cached_prefix("z", range(8), max_tokens=0).cached_tokens == 0
    assert observables(a.allocator)["ref_counts"] == snap["ref_counts"]


def test_d4_lazy_decode(make):
    a = make(128, block_size=16)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(16))
    assert a.allocate_suffix_blocks("s", 16) == 1
    a.record_tokens("s", range(16))
    for t in range(200):
        a.record_tokens("s", [t])
    assert a.num_table_blocks("s") == 14
    assert a.allocator.num_free_blocks == 128 - 14


def test_d5_capacity_on_record(make):
    a = make(2)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(8))
    a.record_tokens("s", range(8))
    table = a.block_table("s").tolist()
    with pytest.raises(CapacityExceeded, match="^context_length_exceeded: "):
        a.record_tokens("s", [8])
    assert a.num_tokens("s") == 8 and a.block_table("s").tolist() == table


def test_d6_rollback(make):
    a = make(16)
    start(a, "s", range(6))
    a.rollback_last_tokens("s", 3)
    assert a.num_tokens("s") == 3 and a.num_table_blocks("s") == 2
    assert a.request_tokens("s").tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        a.rollback_last_tokens("s", 4)
    assert a.num_tokens("s") == 3


def test_rollback_never_reaches_into_a_shared_or_published_block(make):
    # B's prefix hit shares A's two blocks (A kept them live and published them): rolling B
    # back into them would let its next write change what A reads and what the table serves
    # under the old tokens' hash. Refused, nothing changes; past them it is fine.
    a = make(16)
    start(a, "A", range(8))
    a.write_kv("A", 0, np.ones((8, HEADS, DIM), np.float32), np.ones((8, HEADS, DIM), np.float32))
    a.finalize_turn_keep_live("A")
    assert start(a, "B", list(range(8)) + [9]) == 8
    before = state(a)
    for n in (2, 5, 9):  # resume at 7, 4, 0: inside block 1, at its start, block 0
        with pytest.raises(InvalidArgument, match="other requests or the prefix cache also "
                                                  r"hold \(refcount 3\)"):
            a.rollback_last_tokens("B", n)
        assert state(a) == before
    a.rollback_last_tokens("B", 1)  # resume at 8: B's own block 2 only
    assert a.num_tokens("B") == 8
    # A's own published blocks: a rollback into them is refused as well
    with pytest.raises(InvalidArgument, match="inside block"):
        a.rollback_last_tokens("A", 4)
    assert a.num_tokens("A") == 8
    start(a, "C", [20, 21, 22, 23, 24, 25])
    a.rollback_last_tokens("C", 2)  # C's blocks are its own: as before
    assert a.num_tokens("C") == 4


def test_write_kv_never_reaches_into_a_shared_or_published_block(make):
    # The write-side twin of the rollback refusal above: B's prefix hit shares A's two
    # published blocks, so B writing positions 0-7 (an engine recomputing the whole prompt
    # after a hit) would change what A reads and what the prefix cache serves under those
    # tokens' hash; A rewriting its own published block likewise. Refused on the fast path's
    # calls and the validating path's alike, nothing written; past the shared blocks it is fine.
    a = make(16)
    ones = np.ones((8, HEADS, DIM), np.float32)
    start(a, "A", range(8))
    a.write_kv("A", 0, ones, ones)
    a.finalize_turn_keep_live("A")
    assert start(a, "B", list(range(8)) + [9]) == 8
    before = state(a)
    pool_before = [x.copy() for layer in range(LAYERS) for x in a.pool.layer(layer)]
    twos = np.full((9, HEADS, DIM), 2, np.float32)
    for call in (lambda: a.write_kv("B", 0, twos[:1], twos[:1], start=7),
                 lambda: a.write_kv("B", 1, twos, twos, start=0),
                 lambda: a.write_kv("B", 0, twos[:2], twos[:2], start=7),  # blocks 1 and 2
                 lambda: a.write_kv("B", 0, twos[:1].astype(np.float64), twos[:1], start=0),
                 lambda: a.write_kv("A", 0, twos[:1], twos[:1], start=3),
                 lambda: a.write_kv_layers("B", twos[None].repeat(LAYERS, 0),
                                           twos[None].repeat(LAYERS, 0))):
        with pytest.raises(InvalidArgument, match=r"other requests or the prefix cache also "
                                                  r"hold \(refcount [23]\)"):
            call()
        assert state(a) == before
        assert all(np.array_equal(x, y) for x, y in zip(
            pool_before, (x for layer in range(LAYERS) for x in a.pool.layer(layer)),
            strict=True))
    a.write_kv("B", 0, twos[:1], twos[:1], start=8)  # B's own block 2
    k, _ = a.gather_kv("B", 0)
    assert (k[:8] == 1).all() and (k[8] == 2).all()


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, np.arange(3), {1}])
def test_an_unhashable_seq_id_is_refused_by_every_lifecycle_call(make, bad):
    # These looked the id up with dict.get / `in` and let Python's bare TypeError out (a
    # list from a JSON request body, say); now InvalidArgumentType, nothing changes.
    a = make(16)
    start(a, "A", range(6))
    before = state(a)
    for call in (lambda: a.reset_for_new_request(bad), lambda: a.release_request(bad),
                 lambda: a.is_live_for_continue(bad),
                 lambda: a.prepare_turn(bad, np.arange(4), total_tokens=8)):
        with pytest.raises(InvalidArgumentType, match="unhashable"):
            call()
        assert state(a) == before
    assert a.release_request("A") == 2  # the live request is untouched


@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, np.arange(3), {1}])
def test_an_unhashable_seq_id_is_refused_by_the_calls_on_a_live_row(make, bad):
    # The per-row calls answered "seq_id [1, 2] has no table: call
    # reset_for_new_request([1, 2]) first" (a call that refuses that id), and the batch calls
    # let a bare TypeError out of their unknown-id message; now InvalidArgumentType.
    a = make(16)
    start(a, "A", range(6))
    before = state(a)
    for call in (lambda: a.record_tokens(bad, [1]), lambda: a.gather_kv(bad, 0),
                 lambda: a.num_tokens(bad), lambda: a.record_decode_tokens(["A", bad], [1, 2]),
                 lambda: a.prepare_decode([bad])):
        with pytest.raises(InvalidArgumentType, match="is unhashable"):
            call()
        assert state(a) == before
    with pytest.raises(PagedKVError, match="'B' has no table"):
        a.num_tokens("B")


def test_d7_register_once_release_cleanly(make):
    a = make(16)
    start(a, "s", range(8))
    assert a.register_full_blocks_for_reuse("s") == 2
    counts = rc(a, [0, 1])
    assert counts == [2, 2]
    assert a.register_full_blocks_for_reuse("s") == 0
    assert rc(a, [0, 1]) == counts
    assert a.release_request("s") == 2
    assert rc(a, [0, 1]) == [1, 1]
    assert a.release_request("s") == 0
    assert a.release_request("never-seen") == 0
    start(a, "s", range(100, 108))
    assert a.register_full_blocks_for_reuse("s") == 2


def test_d8_skip_lookup(make):
    a = make(16)
    a.reset_for_new_request("s")
    assert a.find_cached_prefix("s", range(8), skip_lookup=True).cached_tokens == 0
    a.allocate_suffix_blocks("s", 8)
    a.record_tokens("s", range(8))
    a.register_full_blocks_for_reuse("s")
    a.release_request("s")
    a.reset_for_new_request("t")
    assert a.find_cached_prefix("t", range(8)).cached_tokens == 8
    a.reset_for_new_request("u")
    assert a.find_cached_prefix("u", range(8), skip_lookup=True).cached_tokens == 0
    with pytest.raises(LookupAlreadyDone):
        a.find_cached_prefix("u", range(8))


def test_d9_two_adapters_share_a_prefix(make):
    first = make(16)
    second = PagedKVCacheAdapter(first.allocator, first.pool)
    sys_prompt = list(range(50, 58))
    start(first, "A", sys_prompt + [1, 2, 3, 4])
    assert first.register_full_blocks_for_reuse("A") == 3
    second.reset_for_new_request("B")
    hit = second.find_cached_prefix("B", sys_prompt + [5, 6, 7, 8], max_tokens=11)
    assert hit.cached_tokens == 8 and len(hit.hot_blocks) == 2
    assert second.block_table("B").tolist() == first.block_table("A")[:2].tolist()


def test_d10_progress_when_the_pool_is_full_of_cache(make):
    a = make(2)
    p1, p2, p3 = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    for seq, p in (("p1", p1), ("p2", p2)):
        start(a, seq, p)
        a.register_full_blocks_for_reuse(seq)
        a.release_request(seq)
    assert start(a, "p3", p3) == 0
    assert a.block_table("p3").tolist() == [0]  # P1's block, the LRU cache-only one
    a.release_request("p3")
    a.reset_for_new_request("q2")
    assert a.find_cached_prefix("q2", p2).cached_tokens == 4
    a.reset_for_new_request("q1")
    assert a.find_cached_prefix("q1", p1).cached_tokens == 0


def test_d11_partial_tail_is_private(make):
    a = make(16)
    start(a, "s", range(7))
    assert a.register_full_blocks_for_reuse("s") == 1
    a.release_request("s")
    a.reset_for_new_request("t")
    assert a.find_cached_prefix("t", range(7)).cached_tokens == 4


def test_d12_keep_live_turns(make):
    a = make(16)
    turn1 = list(range(7))
    start(a, "s", turn1)
    assert a.finalize_turn_keep_live("s") == 1
    assert a.finalize_turn_keep_live("s") == 0
    assert a.block_table("s").tolist() == [0, 1] and a.num_tokens("s") == 7
    assert a.is_live_for_continue("s")
    assert a.continue_turn("s", turn1 + [7, 8, 9, 10, 11], 12) == (7, 1)
    assert a.block_table("s").tolist()[:2] == [0, 1] and a.num_table_blocks("s") == 3
    start(a, "d", turn1)
    a.finalize_turn_keep_live("d")
    with pytest.raises(PagedKVError, match="position 3"):
        a.continue_turn("d", [0, 1, 2, 99, 4, 5, 6, 7], 8)
    start(a, "n", turn1)
    with pytest.raises(PagedKVError, match="not finalized"):
        a.continue_turn("n", turn1 + [7], 8)


def test_d12_recording_after_keep_live_needs_continue_turn(make):
    # A finalized turn was published once: tokens recorded after it were never published
    # (the next finalize or register returned 0), so recording is refused until continue_turn.
    a = make(16)
    turn1 = list(range(5))
    start(a, "s", turn1)
    start(a, "o", [9, 9])
    assert a.finalize_turn_keep_live("s") == 1
    before = state(a)
    with pytest.raises(PagedKVError, match=r"record_tokens: seq_id 's' was finalized .*"
                                           r"call continue_turn"):
        a.record_tokens("s", [5, 6, 7, 8])
    with pytest.raises(PagedKVError, match=r"record_decode_tokens: seq_id 's' was finalized"):
        a.record_decode_tokens(["o", "s"], [1, 5])
    assert state(a) == before and a.is_live_for_continue("s")
    assert a.continue_turn("s", turn1 + [5, 6, 7, 8], 9) == (5, 1)
    a.record_tokens("s", [5, 6, 7, 8])
    assert a.finalize_turn_keep_live("s") == 1  # the second full block, now published
    a.release_request("s")
    a.reset_for_new_request("t")
    assert a.find_cached_prefix("t", list(range(10))).cached_tokens == 8

def test_d13_prepare_turn(make):
    a = make(16)
    turn1 = list(range(7))
    start(a, "s", turn1)
    a.finalize_turn_keep_live("s")
    plan = a.prepare_turn("s", turn1 + [7, 8, 9], total_tokens=10)
    assert plan.reason is TurnPlanReason.CONTINUED_LIVE_PREFIX and plan.cached_tokens == 7
    assert a.block_table("s").tolist()[:2] == [0, 1]
    a.record_tokens("s", [7, 8, 9])
    a.finalize_turn_keep_live("s")  # live 0..9; blocks 0..3 and 4..7 registered
    # Diverged at position 4, and long enough to be continued otherwise.
    diverged = [0, 1, 2, 3, 50, 51, 52, 53, 54, 55, 56, 57]
    plan = a.prepare_turn("s", diverged, total_tokens=12)
    assert plan.reason is TurnPlanReason.FRESH_RESET and plan.cached_tokens == 4
    a.record_tokens("s", diverged[4:])
    a.finalize_turn_keep_live("s")
    plan = a.prepare_turn("s", diverged + [58], total_tokens=13, max_cached_tokens=8)
    assert plan.reason is TurnPlanReason.FRESH_RESET and plan.cached_tokens == 8


def test_d13_prepare_turn_falls_back_when_continuing_runs_out_of_blocks(make):
    a = make(4, growth=False)
    cached = list(range(12))
    start(a, "x", cached)
    a.register_full_blocks_for_reuse("x")
    a.release_request("x")
    a.reset_for_new_request("y")
    a.find_cached_prefix("y", cached + [99])  # holds blocks 0-2: nothing is evictable
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", cached[:4], skip_lookup=True)
    a.allocate_suffix_blocks("s", 4)
    a.record_tokens("s", cached[:4])
    a.finalize_turn_keep_live("s")
    assert a.block_table("s").tolist() == [3]
    # Continuing needs 3 more blocks (none left); a fresh start reuses the cached 12 tokens.
    plan = a.prepare_turn("s", cached + [7], total_tokens=13)
    assert plan.reason is TurnPlanReason.CONTINUE_FAILED_RESET
    assert plan.cached_tokens == 12 and plan.newly_allocated == 1
    assert a.block_table("s").tolist() == [0, 1, 2, 3]
    a.allocator.check_invariants()


def test_d13_prepare_turn_failure_releases_the_hit(make):
    a = make(6, growth=False)
    start(a, "x", range(8))
    a.register_full_blocks_for_reuse("x")
    a.release_request("x")
    start(a, "w", range(70, 86))  # holds the 4 other blocks
    before = rc(a, range(6))
    with pytest.raises(PoolExhausted):
        a.prepare_turn("z", list(range(8)) + list(range(80, 90)), total_tokens=18)
    assert rc(a, range(6)) == before
    assert "z" not in a.live_seq_ids()


def test_d14_a_failed_allocation_leaks_no_hit_refs(make):
    a = make(6)
    x = list(range(8))
    start(a, "x", x)
    a.register_full_blocks_for_reuse("x")
    a.release_request("x")
    a.reset_for_new_request("w")
    a.find_cached_prefix("w", range(100, 116))
    a.allocate_suffix_blocks("w", 16)
    assert a.block_table("w").tolist() == [2, 3, 4, 5]
    z = x + list(range(200, 212))
    a.reset_for_new_request("z")
    assert a.find_cached_prefix("z", z, max_tokens=19).hot_blocks.tolist() == [0, 1]
    before = state(a)
    with pytest.raises(PoolExhausted, match="paged cache could not reserve"):
        a.allocate_suffix_blocks("z", 20)
    assert state(a) == before
    a.release_request("z")
    assert rc(a, [0, 1]) == [1, 1] and rc(a, [2, 3, 4, 5]) == [1, 1, 1, 1]
    a.allocator.check_invariants()


def _hit32(a, seq):
    a.reset_for_new_request(seq)
    return a.find_cached_prefix(seq, range(40), max_tokens=39).cached_tokens


def test_d15_aux_latch(make):
    plain = make(32)
    start(plain, "s", range(32))
    plain.register_full_blocks_for_reuse("s")
    plain.release_request("s")
    assert _hit32(plain, "t") == 32
    plain.record_tokens("t", range(32, 40))

    a = make(32, requires_aux_confirmation=True)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(32))
    assert not a.aux_prefix_unbacked("s")  # a miss never latches
    a.record_tokens("s", range(32))
    a.register_full_blocks_for_reuse("s")
    a.release_request("s")
    assert _hit32(a, "t") == 32 and a.aux_prefix_unbacked("t")
    before = state(a)
    with pytest.raises(AuxStateUnconfirmed, match="confirm_aux_prefix_primed"):
        a.record_tokens("t", [32])
    with pytest.raises(AuxStateUnconfirmed):
        a.record_decode_tokens(["t"], [32])
    with pytest.raises(AuxStateUnconfirmed):
        a.register_full_blocks_for_reuse("t")
    with pytest.raises(AuxStateUnconfirmed):
        a.finalize_turn_keep_live("t")
    with pytest.raises(ValueError):
        a.confirm_aux_prefix_primed("t", 31)
    assert a.aux_prefix_unbacked("t") and state(a) == before
    a.confirm_aux_prefix_primed("t", 32)
    a.record_tokens("t", range(32, 40))
    assert _hit32(a, "t") == 32 and a.aux_prefix_unbacked("t")
    a.reset_for_new_request("t")
    assert not a.aux_prefix_unbacked("t")
    a.confirm_aux_prefix_primed("t", 5)  # unlatched: a no-op


# --- P6–P7: growth ----------------------------------------------------------------------


def test_p6_grow_on_demand(make, caplog):
    a = make(4, 16)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(40))
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert a.allocate_suffix_blocks("s", 40) == 10
    assert a.pool.num_blocks == a.allocator.num_blocks == 14
    assert a.pool.generation == 1 and a.stats()["grow_events"] == 1
    assert "paged pool grew from=4 to=14 generation=1 needed=10" in caplog.text
    a.allocator.check_invariants()


def test_p7_evict_before_growing_when_enough(make):
    a = make(4, 16)
    for i in range(3):
        start(a, f"c{i}", range(10 * i, 10 * i + 4))
        a.register_full_blocks_for_reuse(f"c{i}")
        a.release_request(f"c{i}")
    assert a.allocator.num_free_blocks == 1 and a.allocator.num_evictable_blocks == 3
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(100, 108))
    assert a.allocate_suffix_blocks("s", 8) == 2
    assert a.pool.num_blocks == 4 and a.pool.generation == 0
    assert a.block_table("s").tolist() == [3, 0]


def test_growth_off_and_at_max_raise_pool_exhausted_with_nothing_taken(make):
    for adapter in (make(4, 16, growth=False), make(4, 4)):
        start(adapter, "w", range(12))
        adapter.reset_for_new_request("s")
        adapter.find_cached_prefix("s", range(50, 58))
        before = state(adapter)
        with pytest.raises(PoolExhausted):
            adapter.allocate_suffix_blocks("s", 8)
        assert state(adapter) == before
        adapter.allocator.check_invariants()


def test_capacity_exceeded_names_the_capacity(make):
    a = make(4, 8)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", [1])
    with pytest.raises(CapacityExceeded,
                       match="requested 33 tokens, paged cache capacity is 32 tokens"):
        a.allocate_suffix_blocks("s", 33)
    assert a.pool.num_blocks == 4 and a.num_table_blocks("s") == 0


# --- decode step, block tables ----------------------------------------------------------


def test_batched_decode_step_matches_per_sequence_record(make):
    batched, single = make(64), make(64)
    seqs = [f"s{i}" for i in range(5)]
    for a in (batched, single):
        for i, s in enumerate(seqs):
            start(a, s, range(100 * i, 100 * i + 3 + i))
    for step in range(9):
        toks = [step * 10 + i for i in range(5)]
        batched.record_decode_tokens(seqs, toks)
        for s, t in zip(seqs, toks, strict=True):
            single.record_tokens(s, [t])
        assert state(batched)["seqs"] == state(single)["seqs"]
    batch = batched.prepare_decode(seqs)
    assert isinstance(batch, DecodeBatch)
    assert batch.block_tables.dtype == np.int32 and batch.seq_lens.dtype == np.int32
    assert batch.slot_mapping.dtype == np.int64
    assert batch.seq_lens.tolist() == [12, 13, 14, 15, 16]
    for i, s in enumerate(seqs):
        table = batched.block_table(s)
        row = batch.block_tables[i]
        assert row[:len(table)].tolist() == table.tolist()
        assert (row[len(table):] == -1).all()
        last = batch.seq_lens[i] - 1
        assert batch.slot_mapping[i] == table[last // 4] * 4 + last % 4


def test_decode_step_failure_changes_nothing(make):
    a = make(4, growth=False)
    start(a, "a", range(4))
    start(a, "b", range(10, 14))
    start(a, "c", range(20, 22))
    start(a, "d", range(30, 32))  # 4 blocks taken, a and b sit on a boundary
    before = state(a)
    with pytest.raises(PoolExhausted, match="paged decode could not reserve"):
        a.record_decode_tokens(["a", "b", "c"], [1, 2, 3])
    assert state(a) == before
    with pytest.raises(InvalidArgument, match="duplicates"):
        a.record_decode_tokens(["c", "c"], [1, 2])
    with pytest.raises(InvalidArgument, match="one token each"):
        a.record_decode_tokens(["c", "d"], [1])
    with pytest.raises(PagedKVError, match="'zz'"):
        a.record_decode_tokens(["c", "zz"], [1, 2])
    assert state(a) == before


def test_block_tables_array_and_stale_generation(make):
    a = make(4, 16)
    start(a, "s", range(6))
    start(a, "t", range(10, 13))
    tables, generation = a.block_tables_array(["s", "t"], 4)
    assert tables.tolist() == [[0, 1, -1, -1], [2, -1, -1, -1]] and generation == 0
    with pytest.raises(InvalidArgument, match="narrower"):
        a.block_tables_array(["s"], 1)
    batch = a.prepare_decode(["s", "t"])
    a.check_batch(batch)
    start(a, "u", range(100, 120))  # grows the pool
    assert a.pool.generation == 1
    before = state(a)
    with pytest.raises(StaleBlockTable):
        a.check_batch(batch)
    with pytest.raises(StaleBlockTable):
        a.gather_kv("s", 0, generation=generation)
    with pytest.raises(StaleBlockTable):
        a.write_kv("s", 0, *_kv(1, 1.0), generation=generation)
    assert state(a) == before
    assert a.block_table("s").tolist() == [0, 1]  # ids survive growth


def test_physical_revision_moves_on_block_changes_only(make):
    a = make(16)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(3))
    r0 = a.physical_revision("s")
    a.record_tokens("s", [0, 1, 2])
    r1 = a.physical_revision("s")
    a.record_tokens("s", [3])
    a.rollback_last_tokens("s", 2)
    assert r1 == r0 + 1 and a.physical_revision("s") == r1
    a.record_tokens("s", [7, 8, 9])
    assert a.physical_revision("s") == r1 + 1


def test_rows_and_width_grow(make):
    a = make(256, initial_rows=2)
    for i in range(9):
        start(a, i, range(1000 * i, 1000 * i + 4 * (i + 1)))
    assert sorted(a.live_seq_ids()) == list(range(9))
    for i in range(9):
        assert a.num_tokens(i) == 4 * (i + 1)
        assert a.request_tokens(i).tolist() == list(range(1000 * i, 1000 * i + 4 * (i + 1)))
    tables, _ = a.block_tables_array(list(range(9)))
    assert tables.shape == (9, 9)


# --- K/V ---------------------------------------------------------------------------------


def _kv(n, base):
    k = (base + np.arange(n * HEADS * DIM, dtype=np.float32)).reshape(n, HEADS, DIM)
    return k, -k


def test_write_then_gather_round_trips_across_blocks(make):
    a = make(16)
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", range(6))
    a.allocate_suffix_blocks("s", 6)
    a.record_tokens("s", range(6))
    k, v = _kv(6, 0.0)
    for layer in range(LAYERS):
        a.write_kv("s", layer, k + layer, v - layer)
    a.record_tokens("s", [6])
    k1, v1 = _kv(1, 100.0)
    a.write_kv("s", 1, k1, v1)
    gk, gv = a.gather_kv("s", 1)
    assert gk.shape == (7, HEADS, DIM) and gk.dtype == np.float32
    assert gk.tobytes() == np.concatenate([k + 1, k1]).tobytes()
    assert gv.tobytes() == np.concatenate([v - 1, v1]).tobytes()
    a.write_kv("s", 0, *_kv(2, 50.0), start=2)
    assert a.gather_kv("s", 0)[0][2:4].tobytes() == _kv(2, 50.0)[0].tobytes()


def test_write_kv_layers_equals_per_layer_writes(make):
    a, b = make(16), make(16)
    kl = np.arange(LAYERS * 5 * HEADS * DIM, dtype=np.float32).reshape(LAYERS, 5, HEADS, DIM)
    for ad in (a, b):
        start(ad, "s", range(5))
    a.write_kv_layers("s", kl, kl * 2)
    for layer in range(LAYERS):
        b.write_kv("s", layer, kl[layer], kl[layer] * 2)
    assert state(a)["pool"] == state(b)["pool"]
    k_layers, v_layers = a.gather_kv_layers("s")
    assert k_layers.shape == (LAYERS, 5, HEADS, DIM)
    assert k_layers.tobytes() == kl.tobytes() and v_layers.tobytes() == (kl * 2).tobytes()
    for layer in range(LAYERS):
        k, v = b.gather_kv("s", layer)
        assert k.tobytes() == k_layers[layer].tobytes()
        assert v.tobytes() == v_layers[layer].tobytes()


def test_bad_kv_input_changes_nothing(make):
    a = make(16)
    start(a, "s", range(5))
    a.write_kv("s", 0, *_kv(5, 1.0))
    before = state(a)
    k, v = _kv(2, 9.0)
    bad_calls = [
        (InvalidArgument, lambda: a.write_kv("s", 0, k[:, :, :1], v[:, :, :1])),
        (InvalidArgument, lambda: a.write_kv("s", 0, k, v[:1])),
        (InvalidArgument, lambda: a.write_kv("s", 0, k[0], v[0])),
        (InvalidArgumentType, lambda: a.write_kv("s", 0, k.astype(np.float16), v.astype(np.float16))),
        (InvalidArgument, lambda: a.write_kv("s", 2, k, v)),
        (InvalidArgument, lambda: a.write_kv("s", -1, k, v)),
        (InvalidArgument, lambda: a.write_kv("s", 0, k, v, start=4)),
        (InvalidArgument, lambda: a.write_kv("s", 0, *_kv(6, 0.0))),
        (PagedKVError, lambda: a.write_kv("nobody", 0, k, v)),
        (PagedKVError, lambda: a.gather_kv("nobody", 0)),
        (InvalidArgument, lambda: a.gather_kv("s", 5)),
        (PagedKVError, lambda: a.record_tokens("nobody", [1])),
        (PagedKVError, lambda: a.find_cached_prefix("nobody", [1])),
        (InvalidArgumentType, lambda: a.record_tokens("s", [1.5])),
        (InvalidArgument, lambda: a.record_tokens("s", [-1])),
        (InvalidArgument, lambda: a.record_tokens("s", [[1]])),
        (InvalidArgumentType, lambda: a.allocate_suffix_blocks("s", 2.0)),
        (InvalidArgument, lambda: a.allocate_suffix_blocks("s", -1)),
        (InvalidArgument, lambda: a.write_kv_layers("s", k, v)),
    ]
    for exc, call in bad_calls:
        with pytest.raises(exc):
            call()
        assert state(a) == before
    a.allocator.check_invariants()


def test_ragged_tokens_are_refused_as_types_and_change_nothing(make):
    # np.asarray of a ragged list raises a bare ValueError ("inhomogeneous shape"), which
    # every call taking tokens let out; the allocator's own calls refuse it as a type.
    a = make(16)
    start(a, "s", range(8))
    a.finalize_turn_keep_live("s")
    a.reset_for_new_request("t")
    before = state(a)
    ragged = [[1, 2], [3]]
    for call in (lambda: a.record_tokens("t", ragged),
                 lambda: a.find_cached_prefix("t", ragged),
                 lambda: a.continue_turn("s", ragged, 9),
                 lambda: a.prepare_turn("s", ragged, total_tokens=9),
                 lambda: a.restart_prepared_turn_cold("t", ragged, 3)):
        with pytest.raises(InvalidArgumentType, match=r"1-D array-like of token ids .*inhomogeneous"):
            call()
        assert state(a) == before


def test_salt_must_be_a_domain_id(make):
    a = make(16)
    a.reset_for_new_request("s")
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        a.find_cached_prefix("s", range(8), cache_salt="tenant-a")
    assert a.find_cached_prefix("s", range(8), cache_salt=5).cached_tokens == 0


def test_release_is_transactional_on_invariant_violation(make):
    a = make(16)
    start(a, "s", range(8))
    a.allocator.free(0)  # someone else dropped the table's reference
    before = observables(a.allocator)
    with pytest.raises(PagedKVError):
        a.release_request("s")
    assert observables(a.allocator) == before
    assert a.block_table("s").tolist() == [0, 1]


class RestoreLog:
    """A cold tier that restores nothing and logs each restore's hot blocks."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def restore(self, **kw):
        self.calls.append(kw["hot_blocks"].tolist())
        return np.empty(0, np.int32)

    def capture(self, **kw):
        pass


def test_purge_arms_the_cold_suppressor(make):
    cold = RestoreLog()
    calls = cold.calls
    a = make(16, cold=cold)
    start(a, "s", range(8))
    a.register_full_blocks_for_reuse("s")
    assert calls == [[]]
    calls.clear()
    a.release_request_and_purge_prefix_cache("s")
    assert a.allocator.prefix_cache_len == 0
    a.reset_for_new_request("t")
    assert a.find_cached_prefix("t", range(8)).cached_tokens == 0
    assert calls == []
    a.reset_for_new_request("u")
    a.find_cached_prefix("u", range(8))
    assert calls == [[]]


@pytest.mark.parametrize("bad, error", [
    ({"max_tokens": -1}, InvalidArgument), ({"max_tokens": 2.5}, InvalidArgumentType),
    ({"extra_keys": (-5,)}, InvalidArgument), ({"extra_keys": 5}, InvalidArgumentType),
    ({"extra_keys_per_block": 5}, InvalidArgumentType),
    ({"extra_keys_per_block": [(1,), (-2,)]}, InvalidArgument)])
def test_a_refused_lookup_changes_nothing(make, bad, error):
    # Checked before the row or the purge's one-shot cold suppression change: a bad call
    # used to spend the suppression (the next lookup then restored from disk what the
    # purge dropped) and leave its salt and keys on the row.
    cold = RestoreLog()
    restores = cold.calls
    a = make(16, cold=cold)
    start(a, "s", range(8))
    a.register_full_blocks_for_reuse("s")
    a.release_request_and_purge_prefix_cache("s")
    restores.clear()
    a.reset_for_new_request("t")
    before = state(a)
    with pytest.raises(error):
        a.find_cached_prefix("t", range(8), **bad)
    assert state(a) == before
    assert a.find_cached_prefix("t", range(8)).cached_tokens == 0
    assert restores == []  # the suppression still applied to the first valid lookup


def test_extra_keys_none_is_no_keys_in_a_lookup(make):
    # find_cached_prefix(extra_keys=None) passed make_chain_keys (None is no keys there and
    # in the allocator) and then raised TypeError on tuple(None), after the row's salt was
    # written and the purge's one-shot cold suppression was spent.
    cold = RestoreLog()
    restores = cold.calls
    a = make(16, cold=cold)
    start(a, "s", range(8))
    a.register_full_blocks_for_reuse("s", extra_keys=None)
    a.release_request_and_purge_prefix_cache("s")
    restores.clear()
    a.reset_for_new_request("t")
    assert a.find_cached_prefix("t", range(8), extra_keys=None).cached_tokens == 0
    assert restores == []  # the lookup the purge's suppression was for
    a.release_request("t")
    start(a, "u", range(8), extra_keys=None)
    assert restores == [[]]
    a.register_full_blocks_for_reuse("u")
    a.release_request("u")
    hits = []
    for seq, keys in (("v", None), ("w", ())):  # the same hit, published as plain blocks
        a.reset_for_new_request(seq)
        hit = a.find_cached_prefix(seq, range(12), extra_keys=keys)
        hits.append((hit.cached_tokens, hit.hot_blocks.tolist(), a.block_table(seq).tolist()))
        a.release_request(seq)
    assert hits[0] == hits[1] and hits[0][0] == 8
    a.allocator.check_invariants()


def test_a_lookup_after_the_row_holds_blocks_is_refused_and_leaks_nothing(make):
    # Found by a review: allocate (or record) before the first lookup, then a lookup with a
    # hit wrote the hit over the row's table, and the blocks it held stayed allocated with
    # no table pointing at them (two per group for every such request).
    a = make(16)
    start(a, "s", range(8))
    a.register_full_blocks_for_reuse("s")
    a.release_request("s")
    a.reset_for_new_request("t")
    a.allocate_suffix_blocks("t", 8)
    before = state(a)
    with pytest.raises(LookupAlreadyDone, match="already holds 0 tokens and \\[2\\] blocks"):
        a.find_cached_prefix("t", range(8))
    assert state(a) == before
    a.release_request("t")
    assert a.allocator.num_free_blocks + a.allocator.num_evictable_blocks == 16


def test_wrong_types_of_counts_and_generations_are_refused_as_types(make):
    a = make(16)
    start(a, "s", range(8))
    with pytest.raises(InvalidArgumentType, match="max_cached_tokens must be an int"):
        a.prepare_turn("s", list(range(9)), total_tokens=9, max_cached_tokens="3")
    with pytest.raises(InvalidArgumentType, match="generation must be an int"):
        a.pool.check_generation("0")
    with pytest.raises(InvalidArgumentType, match="generation must be an int"):
        a.write_kv("s", 0, np.zeros((1, HEADS, DIM), np.float32),
                   np.zeros((1, HEADS, DIM), np.float32), generation="0")
    with pytest.raises(InvalidArgumentType, match="n must be an int"):
        a.confirm_aux_prefix_primed("s", 1.5)


# --- cold-tier hooks --------------------------------------------------------------------


class RecordingColdTier:
    """Records every hook call; ``restore`` hands out ``restore_blocks`` freshly allocated
    blocks (one reference owned by the caller, as the real tier does)."""

    def __init__(self, restore_blocks: int = 0, fail: bool = False) -> None:
        self.captures: list[dict] = []
        self.restores: list[dict] = []
        self.restore_blocks = restore_blocks
        self.fail = fail

    def capture(self, **kw):
        self.captures.append(kw)
        if self.fail:
            raise OSError("disk full")
        return ("captured", len(kw["block_ids"]))

    def restore(self, **kw):
        self.restores.append(kw)
        if self.fail:
            raise OSError("disk gone")
        return kw["allocator"].allocate_many(self.restore_blocks)


def test_cold_capture_hook_gets_the_registered_chain(make):
    cold = RecordingColdTier()
    a = make(16, cold=cold)
    start(a, "s", range(10))
    assert a.register_full_blocks_for_reuse("s", cache_salt=7, extra_keys=(3,)) == 2
    assert a.register_full_blocks_for_reuse("s", cache_salt=7, extra_keys=(3,)) == 0
    assert len(cold.captures) == 1
    kw = cold.captures[0]
    assert kw["tokens"].dtype == np.uint32 and kw["tokens"].tolist() == list(range(8))
    assert kw["block_ids"].dtype == np.int32 and kw["block_ids"].tolist() == [0, 1]
    expected = a.allocator.chain_hashes(np.arange(8), extra_keys=(3,), cache_salt=7)
    assert kw["hashes"].tolist() == expected.tolist()
    assert kw["cache_salt"] == 7 and kw["extra_keys_per_block"] == [(3,), (3,)]
    assert kw["pool"] is a.pool and kw["allocator"] is a.allocator
    assert a.cold_capture_outcome("s") == ("captured", 2)
    start(a, "short", range(3))
    a.finalize_turn_keep_live("short")
    assert len(cold.captures) == 1  # no full block: nothing to capture


def test_cold_restore_extends_the_hot_hit(make):
    cold = RecordingColdTier(restore_blocks=0)
    a = make(16, cold=cold)
    start(a, "s", range(8))
    a.register_full_blocks_for_reuse("s")
    a.release_request("s")
    cold.restore_blocks = 2
    a.reset_for_new_request("t")
    hit = a.find_cached_prefix("t", range(20), max_tokens=19)
    assert hit.hot_blocks.tolist() == [0, 1] and hit.restored_blocks.tolist() == [2, 3]
    assert hit.cached_tokens == 16 and a.num_tokens("t") == 16
    assert a.block_table("t").tolist() == [0, 1, 2, 3]
    kw = cold.restores[-1]
    assert kw["tokens"].tolist() == list(range(19)) and kw["hot_blocks"].tolist() == [0, 1]
    assert kw["extra_keys_per_block"] is None and kw["cache_salt"] == 0
    assert a.stats()["restored_blocks"] == 2
    a.release_request("t")
    a.allocator.check_invariants()
    assert a.allocator.num_allocated_blocks == 2  # the cached pair; restored blocks freed
    a.reset_for_new_request("u")
    a.find_cached_prefix("u", range(8), max_tokens=7)  # no full block past the hit: no call
    assert len(cold.restores) == 2


def test_cold_hooks_never_raise_into_inference(make, caplog):
    cold = RecordingColdTier(fail=True)
    a = make(16, cold=cold)
    with caplog.at_level(logging.ERROR, logger="pagedkv.adapter"):
        start(a, "s", range(8))
        assert a.register_full_blocks_for_reuse("s") == 2
    assert a.stats()["cold_capture_errors"] == 1 and a.stats()["cold_restore_errors"] == 1
    assert "disk full" in caplog.text and "disk gone" in caplog.text
    assert a.cold_capture_outcome("s") is None


def test_an_overlong_cold_restore_is_refused_and_its_blocks_returned(make):
    cold = RecordingColdTier(restore_blocks=3)
    a = make(16, cold=cold)
    a.reset_for_new_request("s")
    hit = a.find_cached_prefix("s", range(9))  # 2 full blocks at most
    assert hit.cached_tokens == 0 and hit.restored_blocks.tolist() == []
    assert a.stats()["cold_restore_errors"] == 1
    assert a.allocator.num_free_blocks == 16
    a.allocator.check_invariants()


def _sidecar_tier(sidecar) -> RecordingColdTier:
    """A tier whose restore hands out 4 fresh blocks (16 tokens at block size 4) and
    ``sidecar`` as their out-of-pool state."""
    cold = RecordingColdTier(restore_blocks=4)
    blocks = cold.restore
    cold.restore = lambda **kw: ColdRestore(np.asarray(blocks(**kw), np.int32), sidecar)
    return cold


@pytest.mark.parametrize("boundary", [8, 20, None])
def test_a_cold_sidecar_for_another_boundary_than_the_hit_is_refused(make, caplog, boundary):
    """A restore hook's sidecar was taken with its hit whatever its boundary: 16 restored
    tokens came with the state of 8 (or of 20, or of no stated boundary), and only the aux
    latch stopped the writes after the lookup. The lookup refuses it where it takes the hit:
    SidecarLayoutMismatch logged, a counted restore error, the blocks given back, everything
    as a miss leaves it."""
    sidecar = (types.SimpleNamespace() if boundary is None
               else types.SimpleNamespace(boundary_tokens=boundary))
    a = make(16, cold=_sidecar_tier(sidecar), requires_aux_confirmation=True)
    a.reset_for_new_request("s")
    before = state(a)
    with caplog.at_level(logging.ERROR, logger="pagedkv.adapter"):
        hit = a.find_cached_prefix("s", range(20), max_tokens=19)
    assert (hit.cached_tokens, hit.restored_blocks.tolist(), hit.sidecar) == (0, [], None)
    [record] = [r for r in caplog.records if r.name == "pagedkv.adapter"]
    assert record.getMessage() == "cold tier restore refused; continuing with the hot hit only"
    assert type(record.exc_info[1]) is SidecarLayoutMismatch
    assert str(record.exc_info[1]) == (
        f"cold tier restore returned a sidecar with boundary_tokens={boundary} for a 16-token "
        "hit (0 hot + 4 restored blocks of 4 tokens): out-of-pool state must be for exactly "
        "the hit's end; the tier must hand back only the blocks its sidecar backs "
        "(docs/cold.md, 'Reconcile-down')")
    after = state(a)
    moved = {k: after["stats"][k] - v for k, v in before.pop("stats").items()
             if after["stats"][k] != v}
    assert moved == {"lookups": 1, "lookup_tokens": 19, "cold_restore_errors": 1}
    del after["stats"]
    # The four blocks the hook took are free again (at the free list's tail); the
    # allocator's counters moved by the lookup's own query only.
    assert after["allocator"].pop("free_list") == [*range(4, 16), 0, 1, 2, 3]
    assert before["allocator"].pop("free_list") == list(range(16))
    assert after["allocator"].pop("stats") == {**before["allocator"].pop("stats"),
                                               "query_tokens": 19}
    assert after == before  # refcounts, the pool, the empty row
    assert not a.aux_prefix_unbacked("s") and a.take_restored_sidecar("s") is None
    a.allocator.check_invariants()


def test_a_cold_sidecar_for_the_hit_comes_with_it(make):
    sidecar = types.SimpleNamespace(boundary_tokens=16)
    a = make(16, cold=_sidecar_tier(sidecar), requires_aux_confirmation=True)
    a.reset_for_new_request("s")
    hit = a.find_cached_prefix("s", range(20), max_tokens=19)
    assert (hit.cached_tokens, hit.restored_blocks.tolist()) == (16, [0, 1, 2, 3])
    assert hit.sidecar is sidecar and a.stats()["cold_restore_errors"] == 0
    assert not a.aux_prefix_unbacked("s") and a.take_restored_sidecar("s") is sidecar


@pytest.mark.parametrize("prompt, total, error", [
    ([1, 2, 3], 2.5, InvalidArgumentType), ([1, 2, 3], True, InvalidArgumentType),
    ([1, 2, 3], -1, InvalidArgument), ([[1, 2, 3]], 3, InvalidArgument),
    ([1.0, 2.0], 2, InvalidArgumentType)])
def test_restart_prepared_turn_cold_refuses_bad_arguments_before_releasing(make, prompt, total,
                                                                          error):
    # It released the live request (and dropped its hit) before allocate_suffix_blocks or the
    # forced-miss lookup refused the argument: a typo ended the request.
    a = make(8)
    start(a, "x", range(8))
    a.register_full_blocks_for_reuse("x")
    a.release_request("x")
    a.reset_for_new_request("s")
    a.find_cached_prefix("s", list(range(8)) + [9], max_tokens=8)
    a.allocate_suffix_blocks("s", 9)
    before = state(a)
    with pytest.raises(error):
        a.restart_prepared_turn_cold("s", prompt, total)
    assert state(a) == before


@pytest.mark.parametrize("call", ["register_full_blocks_for_reuse", "finalize_turn_keep_live"])
@pytest.mark.parametrize("salt, error", [(1.5, InvalidArgumentType), (True, InvalidArgumentType),
                                         ("tenant", InvalidArgumentType),
                                         (-1, InvalidArgument)])
def test_repeated_registration_still_checks_the_salt(make, call, salt, error):
    # Registration runs once per request; the repeat returned 0 before looking at its
    # arguments, so a float/bool/str salt was accepted on the second call only.
    a = make(8)
    start(a, "s", range(9))
    getattr(a, call)("s")
    before = state(a)
    with pytest.raises(error):
        getattr(a, call)("s", cache_salt=salt)
    with pytest.raises(InvalidArgumentType):
        getattr(a, call)("s", extra_keys=[1.5])
    assert state(a) == before


# --- review: bad input named as such, state unchanged --------------------------------------


def test_admission_batch_and_token_arguments_of_bad_types_raise_named_errors_and_change_nothing(make):
    """can_admit(exclude=<unhashable>), check_batch(<not a batch>), a stale generation on an
    empty write_kv and an empty float token array each raise a pagedkv.errors exception
    naming the argument (they raised bare TypeError / AttributeError or were accepted)."""
    a = make(16)
    start(a, "s", range(8))
    before = state(a)
    with pytest.raises(InvalidArgumentType) as err:
        a.can_admit(1, exclude=[1])
    assert str(err.value) == ("exclude [1] is unhashable (list): pass the candidate's seq_id "
                              "(an int, a str or a tuple of them) or None")
    assert state(a) == before
    with pytest.raises(InvalidArgumentType) as err:
        a.check_batch(5)
    assert str(err.value) == ("batch must be a DecodeBatch (what prepare_decode returns), got "
                              "int; to check a bare generation call "
                              "pool.check_generation(generation)")
    assert state(a) == before
    empty = np.zeros((0, HEADS, DIM), np.float32)
    stale = a.pool.generation + 1
    with pytest.raises(StaleBlockTable) as err:
        a.write_kv("s", 0, empty, empty, generation=stale)
    assert str(err.value) == (f"generation: the block table was built for pool generation "
                              f"{stale}, the pool is at generation {a.pool.generation} (it "
                              f"grew); rebuild the table")
    assert state(a) == before
    with pytest.raises(InvalidArgumentType) as err:
        a.record_tokens("s", np.empty(0, np.float32))
    assert str(err.value) == ("tokens must be integers, got dtype float32: pass token ids, "
                              "not floats/bools")
    assert state(a) == before
    a.record_tokens("s", [])  # an empty list or int array is still nothing to record
    a.record_tokens("s", np.empty(0, np.int64))
    assert state(a) == before


def test_prepare_turn_releases_the_sequence_when_continue_turn_fails(make):
    """docs/adapter.md: prepare_turn's "any error releases the sequence" holds for a
    continue_turn refusal too (it left the sequence live)."""
    a = make(16)
    start(a, "s", range(7))
    a.finalize_turn_keep_live("s")
    with pytest.raises(InvalidArgument) as err:
        a.prepare_turn("s", list(range(10)), total_tokens=-1)
    assert str(err.value) == "total_tokens = -1 must be >= 0"
    assert "s" not in a.live_seq_ids()
    assert a.allocator.num_free_blocks + a.allocator.num_evictable_blocks == 16
    a.allocator.check_invariants()

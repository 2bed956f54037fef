"""Full + sliding restore from one sliding-window sidecar (docs/cold.md, "Grouped restore"):
R9 and its failure modes — every group at the full group's boundary, or every group at 0."""

from __future__ import annotations

import numpy as np
import pytest

from cold_support import FP, open_tier
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.cold import (
    DEFAULT_FORMAT,
    ColdGroup,
    ColdTierContext,
    GroupedRestore,
    SidecarCaptureStop,
    SlidingGroupRows,
    SlidingGroupTarget,
    SlidingWindowCodec,
    cold_sidecar_stats,
    object_name,
    sidecar_key,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch
from pagedkv.pool import LayerKVPool, PoolGeometry

BS, WINDOW = 16, 1024
FULL = PoolGeometry(1, 1, 8, BS, "bfloat16")
SLIDING = PoolGeometry(2, 1, 8, BS, "bfloat16")
CODEC = SlidingWindowCodec(window=WINDOW, num_layers=2, kv_heads=1, head_dim=8)


class SlidingGroup:
    """One sliding group of one request, as a coordinator would hold it: a pool, an
    allocator with a null block and the request's absolute-width table."""

    def __init__(self, num_blocks=128):
        self.pool = LayerKVPool(SLIDING, num_blocks)
        self.alloc = BlockAllocator(num_blocks, block_size=BS, hash_seed=0,
                                    reserve_null_block=True)
        self.null = int(self.alloc.null_block_id)
        self.table = np.empty(0, np.int32)
        self.num_tokens = 0

    def fill(self, n_tokens, seed):
        """Blocks for ``n_tokens`` with random rows; returns the rows (k, v)."""
        n_blocks = -(-n_tokens // BS)
        self.table = np.asarray(self.alloc.allocate_many(n_blocks), np.int32)
        rng = np.random.default_rng(seed)
        k = rng.integers(0, 1 << 16, (2, n_tokens, 1, 8), dtype=np.uint16)
        v = rng.integers(0, 1 << 16, (2, n_tokens, 1, 8), dtype=np.uint16)
        slots = self.pool.slots_for_positions(self.table, np.arange(n_tokens))
        self.pool.write_tokens_layers(slots, k, v)
        self.num_tokens = n_tokens
        return k, v

    def prune(self, committed):
        """The sliding null sentinel rule: entries below the window go back, newest first."""
        cut = max(0, committed - WINDOW + 1) // BS
        for i in range(cut - 1, -1, -1):
            if self.table[i] == self.null:
                break
            self.alloc.free(int(self.table[i]))
            self.table[i] = self.null

    def rows(self):
        return SlidingGroupRows(self.pool, self.table, self.null, self.num_tokens)

    def target(self):
        return SlidingGroupTarget(self.pool, self.alloc, self.null)


def persist(root, n_tokens, boundary, seed=0, prune=True):
    """Process A: a request of ``n_tokens``; its full blocks and the sliding sidecar at
    ``boundary`` (snapshotted from the live sliding table at capture time) go to disk."""
    tokens = (np.arange(n_tokens, dtype=np.uint32) * 7 + seed) % 50000
    sliding = SlidingGroup()
    k, v = sliding.fill(n_tokens, seed)
    if prune:
        sliding.prune(boundary)  # what the coordinator would have pruned by then
    with open_tier(root) as tier:
        assert tier.install_capture_budget(128, 60_000)  # the whole chain in one turn
        ctx = ColdTierContext(tier, FP, CODEC, lambda toks, **kw: {
            boundary: CODEC.snapshot([sliding.rows()], boundary)})
        pool = LayerKVPool(FULL, 128)
        alloc = BlockAllocator(128, block_size=BS, hash_seed=0)
        a = PagedKVCacheAdapter(alloc, pool, cold=ctx)
        a.reset_for_new_request("w")
        a.find_cached_prefix("w", tokens)
        a.allocate_suffix_blocks("w", n_tokens)
        a.record_tokens("w", tokens)
        rng = np.random.default_rng(seed + 1)
        a.write_kv("w", 0, rng.integers(0, 1 << 16, (n_tokens, 1, 8), dtype=np.uint16),
                   rng.integers(0, 1 << 16, (n_tokens, 1, 8), dtype=np.uint16))
        a.register_full_blocks_for_reuse("w")
        assert tier.last_capture.sidecar.stop is SidecarCaptureStop.ENQUEUED
        assert tier.last_capture.sidecar.boundary_tokens == boundary
        assert tier.drain(5.0)
        full_rows = a.gather_kv("w", 0)
    return tokens, (k, v), full_rows


def restore(root, tokens, *, sliding=None, full_blocks=128, exact_boundary=False):
    sliding = sliding or SlidingGroup()
    pool = LayerKVPool(FULL, full_blocks)
    alloc = BlockAllocator(full_blocks, block_size=BS, hash_seed=0)
    with open_tier(root) as tier:
        got = ColdTierContext(tier, FP, CODEC).restore_grouped(
            tokens=tokens, pool=pool, allocator=alloc, sliding=[sliding.target()],
            exact_boundary=exact_boundary)
        stats = tier.stats()
    return got, pool, alloc, sliding, stats


def test_a_pre_wrap_boundary_restores_every_sliding_entry_live(tmp_path):
    root = tmp_path / "root"
    tokens, (k, v), full_rows = persist(root, 336, 320)
    s0 = cold_sidecar_stats()
    got, pool, alloc, sliding, stats = restore(root, tokens)
    assert isinstance(got, GroupedRestore) and got.cached_tokens == 320
    assert len(got.full_blocks) == 20 and stats.hits == 20
    [table] = got.sliding_tables
    assert len(table) == 20 and not (table == sliding.null).any()
    assert cold_sidecar_stats().installed - s0.installed == 1
    k2, v2 = sliding.pool.gather_layers(table, 320)
    assert np.array_equal(k2, k[:, :320]) and np.array_equal(v2, v[:, :320])
    assert np.array_equal(pool.gather(0, got.full_blocks, 320)[0], full_rows[0][:320])
    sliding.alloc.check_invariants()
    alloc.check_invariants()


def test_past_the_window_earlier_entries_point_at_the_null_block(tmp_path):
    root = tmp_path / "root"
    tokens, (k, v), _ = persist(root, 1300, 1280)
    got, _, _, sliding, _ = restore(root, tokens)
    assert got.cached_tokens == 1280 and len(got.full_blocks) == 80
    [table] = got.sliding_tables
    assert len(table) == 80
    assert (table[:16] == sliding.null).all() and not (table[16:] == sliding.null).any()
    assert sliding.alloc.num_allocated_blocks == 64
    live_k, live_v = sliding.pool.gather_layers(table[16:], 1024)
    assert np.array_equal(live_k, k[:, 256:1280]) and np.array_equal(live_v, v[:, 256:1280])


def test_a_corrupt_sidecar_leaves_every_group_at_zero(tmp_path):
    root = tmp_path / "root"
    tokens, _, _ = persist(root, 336, 320)
    p = root / object_name(sidecar_key(DEFAULT_FORMAT, ColdGroup.SLIDING_WINDOW, FP, tokens,
                                       BS, 320), ColdGroup.SLIDING_WINDOW)
    data = bytearray(p.read_bytes())
    data[-3] ^= 0x40
    p.write_bytes(bytes(data))
    s0 = cold_sidecar_stats()
    got, _, alloc, sliding, stats = restore(root, tokens)
    assert got.cached_tokens == 0 and len(got.full_blocks) == 0 and got.sidecar is None
    assert [len(t) for t in got.sliding_tables] == [0]
    assert stats.corruptions == 1 and stats.hits == 0 and stats.restore_declines == 1
    assert alloc.num_allocated_blocks == 0 and sliding.alloc.num_allocated_blocks == 0
    assert cold_sidecar_stats().installed == s0.installed


def test_an_install_failure_releases_all_groups_and_the_full_group_is_not_reused_alone(
        tmp_path):
    root = tmp_path / "root"
    tokens, _, _ = persist(root, 1300, 1280)
    s0 = cold_sidecar_stats()
    small = SlidingGroup(num_blocks=40)  # 64 live entries cannot fit
    got, _, alloc, sliding, stats = restore(root, tokens, sliding=small)
    assert got.cached_tokens == 0 and len(got.full_blocks) == 0
    assert stats.misses == 1 and stats.hits == 80  # the blocks were verified, then given back
    # No reference is left: the full blocks stay only as cache-only prefix entries (never
    # handed to the request), the sliding group holds nothing.
    assert alloc.free_or_evictable_blocks == 128 and alloc.prefix_cache_len == 80
    assert sliding.alloc.num_allocated_blocks == 0
    alloc.check_invariants()
    sliding.alloc.check_invariants()
    assert cold_sidecar_stats().installed == s0.installed


def test_exact_boundary_inputs_refuse_a_reconciled_down_sidecar(tmp_path):
    root = tmp_path / "root"
    tokens, _, _ = persist(root, 336, 320)  # blocks reach 336 (21 blocks), sidecar at 320
    got, _, alloc, _, stats = restore(root, tokens)
    assert got.cached_tokens == 320  # reconciled down to the backed boundary
    got, _, alloc, sliding, stats = restore(root, tokens, exact_boundary=True)
    assert got.cached_tokens == 0 and stats.restore_declines == 1
    assert alloc.num_allocated_blocks == 0 and sliding.alloc.num_allocated_blocks == 0


def test_snapshot_refuses_rows_that_were_already_pruned():
    g = SlidingGroup()
    k, _ = g.fill(1300, 3)
    g.prune(1300)  # entries 0..16 null: rows below 277 are gone
    assert CODEC.snapshot([g.rows()], 320) is None
    snap = CODEC.snapshot([g.rows()], 1296)
    assert snap is not None and np.array_equal(snap[0], k[:, 272:1296])
    with pytest.raises(InvalidArgument):  # past the committed tokens
        CODEC.snapshot([g.rows()], 1312)
    short = SlidingGroupRows(g.pool, g.table[:80], g.null, 1300)
    assert CODEC.snapshot([short], 1296) is None  # an entry missing from the table
    with pytest.raises(SidecarLayoutMismatch):  # the group's pool holds 2 layers, not 3
        SlidingWindowCodec(window=WINDOW, num_layers=3, kv_heads=1, head_dim=8).snapshot(
            [g.rows()], 320)


def test_restore_grouped_rejects_bad_arguments(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        pool = LayerKVPool(FULL, 8)
        alloc = BlockAllocator(8, block_size=BS, hash_seed=0)
        with pytest.raises(InvalidArgumentType):
            ColdTierContext(tier, FP).restore_grouped(tokens=np.arange(32), pool=pool,
                                                      allocator=alloc, sliding=[])
        with pytest.raises(InvalidArgument):
            ColdTierContext(tier, FP, CODEC).restore_grouped(
                tokens=np.arange(32), pool=pool, allocator=alloc, sliding=[])
        with pytest.raises(InvalidArgumentType):
            ColdTierContext(tier, FP, CODEC).restore_grouped(
                tokens=np.arange(32), pool=pool, allocator=alloc, sliding=[pool])

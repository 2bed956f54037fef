"""The cold tier wired to hybrid models (docs/cold.md, "Sidecar bundles", "Family profiles
and sidecars"; docs/coordinator.md, "The cold tier"): a grouped coordinator with sliding
groups restores from disk through one full chain plus a GDN + sliding sidecar bundle, every
group at one boundary or none; the hot checkpoint store keeps what the ladder's victim
orders keep; family profiles build the codec, and a hybrid model never restores under a
profile without its state."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from cold_support import FP, open_tier
from coordinator_support import full_sliding_alias, prefill, state
from pagedkv.cold import (
    DEFAULT_FORMAT as FMT,
)
from pagedkv.cold import (
    ColdGroup,
    ColdTierContext,
    RestoredSidecars,
    SidecarBundle,
    SidecarCaptureStop,
    SlidingGroupRows,
    SlidingWindowCodec,
    cold_sidecar_stats,
    cold_tier_for_model,
    family_profile,
    gdn_state_codec,
    object_name,
    sidecar_key,
)
from pagedkv.cold.ladder import LadderRetention, RetentionCaps, VictimOrder
from pagedkv.cold.profiles import (
    REFERENCE_FAMILY,
    REFERENCE_HYBRID_FAMILY,
    family_sidecar_codec,
    stateful_layer_kinds,
)
from pagedkv.coordinator import StateCheckpointStore
from pagedkv.errors import InvalidArgument, SidecarLayoutMismatch
from pagedkv.pool import PoolGeometry

BS, WINDOW = 4, 8
GDN = gdn_state_codec(1, conv_kernel=2, conv_dim=4, num_v_heads=1, v_head_dim=2,
                      k_head_dim=2, dtype="float32")
SLIDING = SlidingWindowCodec(window=WINDOW, num_layers=1, kv_heads=1, head_dim=2,
                             dtype="float32")
BUNDLE = SidecarBundle((GDN, SLIDING))
TOKENS = (np.arange(30, dtype=np.uint32) * 11 + 3) % 5000


def _gdn_state(boundary: int):
    conv = np.full((1, 1, 4), boundary, np.float32)
    return conv, np.arange(4, dtype=np.float32).reshape(1, 1, 2, 2) + boundary


def _sliding_rows(cache, seq, boundary):
    g = cache.groups[1]
    return SLIDING.snapshot([SlidingGroupRows(g.pool, cache.block_table(seq, 1),
                                              g.null_block_id, cache.num_tokens(seq))],
                            boundary)


def persist(root, boundaries=(12, 20), **cache_kwargs):
    """Process A: 30 tokens through a full + sliding(8) + alias coordinator; at each of
    ``boundaries`` the GDN state and the sliding rows are published to the hot store; at
    registration the K/V chain and the deepest bundle are captured."""
    with open_tier(root) as tier:
        assert tier.install_capture_budget(128, 60_000)
        store_box = []
        ctx = ColdTierContext(tier, FP, BUNDLE, lambda toks, **kw: store_box[0].verified(
            toks, cache_salt=kw.get("cache_salt", 0)))
        cache = full_sliding_alias(window=WINDOW, block_size=BS, cold=ctx, checkpoints=True,
                                   requires_aux_confirmation=True, **cache_kwargs)
        store_box.append(cache.checkpoints)
        cache.reset_for_new_request("a")
        cache.find_cached_prefix("a", TOKENS, max_tokens=0)  # computes every token
        done = 0
        for b in (*boundaries, len(TOKENS)):
            prefill(cache, "a", TOKENS[:b], chunk=4, start=done)
            done = b
            if b in boundaries:
                cache.checkpoints.publish(
                    TOKENS, b, {ColdGroup.GDN_STATE: _gdn_state(b),
                                ColdGroup.SLIDING_WINDOW: _sliding_rows(cache, "a", b)},
                    owner="a")
        cache.register_full_blocks_for_reuse("a")
        outcomes = tier.last_capture.sidecar
        assert tier.drain(5.0)
        full_rows = cache.gather_kv("a", 0)
        window_rows = cache.gather_kv("a", 1, start=cache.first_live_position("a", 1))
        cache.release_request("a")
    return outcomes, full_rows, window_rows


def lookup(root, **cache_kwargs):
    """Process B: a fresh coordinator and hot cache look the prompt up."""
    with open_tier(root) as tier:
        cache = full_sliding_alias(window=WINDOW, block_size=BS,
                                   cold=ColdTierContext(tier, FP, BUNDLE),
                                   checkpoints=True, requires_aux_confirmation=True,
                                   **cache_kwargs)
        cache.reset_for_new_request("b")
        hit = cache.find_cached_prefix("b", TOKENS, max_tokens=len(TOKENS) - 1)
        stats = tier.stats()
    return cache, hit, stats


def test_a_grouped_coordinator_restores_every_group_from_one_bundle(tmp_path):
    root = tmp_path / "root"
    outcomes, full_rows, _ = persist(root)
    assert [(o.stop, o.boundary_tokens) for o in outcomes] == [
        (SidecarCaptureStop.ENQUEUED, 20), (SidecarCaptureStop.ENQUEUED, 20)]
    s0 = cold_sidecar_stats()
    cache, hit, stats = lookup(root)
    assert hit.cached_tokens == 20 and len(hit.restored_blocks) == 5 and stats.hits == 5
    assert isinstance(hit.sidecar, RestoredSidecars) and hit.sidecar.boundary_tokens == 20
    conv, rec = GDN.unpack(hit.sidecar[ColdGroup.GDN_STATE])
    assert conv.tobytes() == _gdn_state(20)[0].tobytes()
    assert rec.tobytes() == _gdn_state(20)[1].tobytes()
    assert not cache.aux_prefix_unbacked("b")
    assert cold_sidecar_stats().installed - s0.installed == 1   # the sliding rows went in
    # Every group stands at 20: the full group's chain, the sliding window [12, 20) rebuilt
    # behind null entries, read back bit for bit (position-coded K/V of the prefill).
    null = cache.groups[1].null_block_id
    assert cache.block_table("b", 0).tolist() == hit.restored_blocks.tolist()
    sliding = cache.block_table("b", 1)
    assert len(sliding) == 5 and (sliding[:3] == null).all() and (sliding[3:] != null).all()
    assert cache.gather_kv("b", 0)[0].tobytes() == full_rows[0][:20].tobytes()
    k, v = cache.gather_kv("b", 1, start=12)
    pos = np.arange(12, 20, dtype=np.float32)[:, None, None] + 1
    assert k.tobytes() == np.repeat(pos, 2, axis=2).tobytes()
    assert v.tobytes() == (np.repeat(pos, 2, axis=2) + 0.5).tobytes()
    cache.check_invariants()
    # The request continues from 20 like any other.
    prefill(cache, "b", TOKENS, chunk=4, start=20)
    cache.check_invariants()


@pytest.mark.parametrize("damage", ["delete_sliding", "corrupt_gdn"])
def test_a_missing_or_corrupt_part_reconciles_down_to_a_boundary_every_part_backs(
        tmp_path, damage):
    root = tmp_path / "root"
    persist(root, boundaries=(12, 20))     # the bundle anchored at 20 ...
    persist(root, boundaries=(12,))        # ... and one at 12 (a turn anchoring there)
    group = ColdGroup.SLIDING_WINDOW if damage == "delete_sliding" else ColdGroup.GDN_STATE
    path = root / object_name(sidecar_key(FMT, group, FP, TOKENS, BS, 20), group)
    if damage == "delete_sliding":
        os.unlink(path)
    else:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))
    cache, hit, stats = lookup(root)
    # 20 is not backed by every part: the walk settles on 12, never K/V alone.
    assert hit.cached_tokens == 12 and hit.sidecar.boundary_tokens == 12
    assert stats.hits == 3 and stats.corruptions == (damage == "corrupt_gdn")
    assert GDN.unpack(hit.sidecar[ColdGroup.GDN_STATE])[0].tobytes() == \
        _gdn_state(12)[0].tobytes()
    assert len(cache.block_table("b", 1)) == 3
    cache.check_invariants()


def test_without_any_backed_boundary_nothing_is_restored_and_nothing_leaks(tmp_path):
    root = tmp_path / "root"
    persist(root, boundaries=(20,))
    os.unlink(root / object_name(sidecar_key(FMT, ColdGroup.SLIDING_WINDOW, FP, TOKENS, BS,
                                             20), ColdGroup.SLIDING_WINDOW))
    cache, hit, stats = lookup(root)
    assert hit.cached_tokens == 0 and hit.sidecar is None and stats.hits == 0
    assert stats.restore_declines == 1
    for g in cache.groups:   # (the null block is never counted as allocated)
        assert g.allocator.num_allocated_blocks == 0 and g.allocator.prefix_cache_len == 0
        assert g.allocator.num_free_blocks == g.usable_blocks()
    cache.check_invariants()


def test_hot_full_blocks_past_the_hit_keep_the_hot_hit(tmp_path):
    """The full group holds every block hot but the store only a state at 12: the cold tier
    could not publish copies of hot blocks, so the lookup keeps the hot hit at 12."""
    root = tmp_path / "root"
    persist(root, boundaries=(20,))
    with open_tier(root) as tier:
        cache = full_sliding_alias(window=WINDOW, block_size=BS,
                                   cold=ColdTierContext(tier, FP, BUNDLE), checkpoints=True,
                                   requires_aux_confirmation=True)
        cache.reset_for_new_request("a")
        cache.find_cached_prefix("a", TOKENS, max_tokens=0)
        prefill(cache, "a", TOKENS[:12], chunk=4)
        cache.checkpoints.publish(TOKENS, 12, "state@12")
        prefill(cache, "a", TOKENS, chunk=4, start=12)
        cache.register_full_blocks_for_reuse("a")
        cache.release_request("a")
        cache.reset_for_new_request("b")
        hit = cache.find_cached_prefix("b", TOKENS, max_tokens=29)
        assert hit.cached_tokens == 12 and hit.sidecar.state == "state@12"
        assert tier.stats().hits == 0 and not len(hit.restored_blocks)
        cache.check_invariants()


# --- the hot store's retention: the ladder's victim orders ------------------------------------

def _store(caps, **kw):
    from pagedkv.allocator import BlockAllocator
    return StateCheckpointStore(BlockAllocator(8, None, 16, hash_seed=0), max_entries=64,
                                retention=LadderRetention(caps, **kw))


def test_store_retention_follows_the_ladder_victim_orders():
    prompt = np.arange(5000, dtype=np.uint32)
    # Per-owner cap 2; one owner publishes 16, 32, 48 (docs/cold.md, "Retention").
    for order, kept in ((VictimOrder.PRE_LADDER, [32, 48]), (VictimOrder.LADDER, [16, 48])):
        store = _store(RetentionCaps(4, 2, order))
        for b in (16, 32, 48):
            store.publish(prompt, b, np.zeros(1, np.float32), owner="p")
        assert store.boundaries() == kept, order
    # Explicit root, ladder caps 5/4: the root alone publishes 16, 80, 336, 1392, then S
    # publishes 48, 240, 1008, 4080 on another lineage: 336, 16, 80 are evicted.
    store = _store(RetentionCaps(5, 4, VictimOrder.LADDER), root_owner=0)
    other = prompt + 7
    for b in (16, 80, 336, 1392):
        store.publish(prompt, b, np.zeros(1, np.float32), owner="root")
    for b in (48, 240, 1008, 4080):
        store.publish(other, b, np.zeros(1, np.float32), owner="s")
    assert sorted(store.verified(prompt)) == [1392]
    assert sorted(store.verified(other)) == [48, 240, 1008, 4080]
    assert store.stats()["evictions"] == 3
    assert LadderRetention.for_store(want_ladder=True).caps == RetentionCaps(
        4, 4, VictimOrder.LADDER)


def test_store_sliding_retention_keeps_the_anchor_rungs_and_the_newest_windows():
    from pagedkv.allocator import BlockAllocator
    from pagedkv.cold.ladder import SlidingRetention, sliding_checkpoint_budget
    from pagedkv.errors import InvalidArgumentType

    prompt = np.arange(5000, dtype=np.uint32)
    kept = {}
    for persist in (True, False):
        budget = sliding_checkpoint_budget(window=8, block_size=8, sliding_layers=1,
                                           kv_heads=1, head_dim=4, persist=persist)
        store = StateCheckpointStore(BlockAllocator(8, None, 8, hash_seed=0),
                                     max_entries=budget.limit + 1,
                                     retention=SlidingRetention(budget))
        for b in range(8, 641, 8):  # a prompt's window snapshots, one per block
            store.publish(prompt, b, np.zeros(1, np.float32), owner="p")
        kept[persist] = store.boundaries()
        assert store.stats()["evictions"] == 80 - budget.limit
    # Ladder (a cold sidecar): the anchor rungs 32, 128, 512 survive, then the newest 17.
    assert kept[True] == [32, 128] + list(range(504, 641, 8))
    # PreLadder (hot only): the newest base_limit (16).
    assert kept[False] == list(range(520, 641, 8))
    assert repr(SlidingRetention(budget)) == \
        "SlidingRetention(pre_ladder, limit 16, rungs [])"
    with pytest.raises(InvalidArgumentType, match="SlidingCheckpointBudget"):
        SlidingRetention(RetentionCaps(4, 2, VictimOrder.LADDER))


def test_store_verified_lists_the_lineage_without_touching_it():
    from pagedkv.allocator import BlockAllocator
    store = StateCheckpointStore(BlockAllocator(8, None, 4, hash_seed=0), max_entries=2)
    prompt = np.arange(40, dtype=np.uint32)
    store.publish(prompt, 8, "a")
    store.publish(prompt, 16, "b")
    assert store.verified(prompt) == {8: "a", 16: "b"}
    assert store.verified(prompt[:12]) == {8: "a"}
    assert store.verified(prompt, cache_salt=1) == {}
    # verified() did not touch: 8 is still the least recently used and goes first.
    store.publish(prompt, 24, "c")
    assert store.boundaries() == [16, 24] and store.stats()["hits"] == 0


# --- family profiles ---------------------------------------------------------------------------

def _hybrid_config(**over):
    from pagedkv.tiny_model import HybridConfig
    d = HybridConfig(**over).to_json_dict()
    return json.loads(json.dumps(d))


def test_the_hybrid_family_builds_its_bundle_from_config_json():
    geometry = PoolGeometry(1, 2, 16, 8, "float32")
    profile = family_profile(REFERENCE_HYBRID_FAMILY)
    codec = family_sidecar_codec(profile, _hybrid_config(), geometry)
    assert isinstance(codec, SidecarBundle)
    gdn, sliding = codec.parts
    assert (gdn.group, gdn.num_layers, gdn.parts, gdn.dtype) == (
        ColdGroup.GDN_STATE, 2, ((3, 128), (4, 16, 16)), "float32")
    assert (sliding.window, sliding.num_layers, sliding.kv_heads, sliding.head_dim,
            sliding.dtype) == (24, 2, 2, 16, "float32")
    # A model with only recurrent layers gets the GDN codec alone.
    only_linear = _hybrid_config(num_layers=2, layer_types=("linear_attention",
                                                            "full_attention"),
                                 kv_shared_layers=())
    assert family_sidecar_codec(profile, only_linear, geometry).group is ColdGroup.GDN_STATE
    # The engine's own codec must be exactly the family's.
    assert family_sidecar_codec(profile, _hybrid_config(), geometry, codec) is codec
    wrong = SidecarBundle((gdn, SlidingWindowCodec(window=32, num_layers=2, kv_heads=2,
                                                   head_dim=16, dtype="float32")))
    with pytest.raises(SidecarLayoutMismatch, match="disagrees"):
        family_sidecar_codec(profile, _hybrid_config(), geometry, wrong)
    with pytest.raises(InvalidArgument, match="no out-of-pool state|takes no sidecar"):
        family_sidecar_codec(family_profile(REFERENCE_FAMILY), _hybrid_config(), geometry,
                             codec)
    assert stateful_layer_kinds(_hybrid_config()) == ("linear_attention", "sliding_attention")
    assert stateful_layer_kinds({"layer_types": ["full_attention"] * 3}) == ()


def test_a_hybrid_model_never_persists_under_a_family_without_its_state(tmp_path,
                                                                        monkeypatch):
    from pagedkv.tiny_model import HybridConfig, ReferenceModel
    monkeypatch.delenv("PAGEDKV_PERSIST_PAGED_CACHE", raising=False)
    model_dir = tmp_path / "model"
    ReferenceModel(HybridConfig(seed=1)).save(model_dir)
    geometry = PoolGeometry(1, 2, 16, 8, "float32")
    base = str(tmp_path / "cache")
    assert cold_tier_for_model(str(model_dir), REFERENCE_FAMILY, geometry,
                               persist_paged_cache=True, base=base) is None
    ctx = cold_tier_for_model(str(model_dir), REFERENCE_HYBRID_FAMILY, geometry,
                              persist_paged_cache=True, base=base)
    assert isinstance(ctx, ColdTierContext) and isinstance(ctx.sidecar, SidecarBundle)
    assert ctx.policy == ctx.sidecar.policy
    # The plain model under the plain family: no sidecar, another fingerprint domain.
    plain_dir = tmp_path / "plain"
    from pagedkv.tiny_model import ReferenceConfig
    ReferenceModel(ReferenceConfig(seed=1)).save(plain_dir)
    plain = cold_tier_for_model(str(plain_dir), REFERENCE_FAMILY, geometry,
                                persist_paged_cache=True, base=base)
    assert plain is not None and plain.sidecar is None
    with pytest.raises(InvalidArgument):  # the hybrid family on a plain config
        cold_tier_for_model(str(plain_dir), REFERENCE_HYBRID_FAMILY, geometry,
                            persist_paged_cache=True, base=base)
    ctx.tier.close()


def test_the_core_never_imports_the_cold_tier():
    code = ("import sys, pagedkv.adapter, pagedkv.coordinator, pagedkv.tiny_model; "
            "import pagedkv.tiny_model.hybrid_paged, pagedkv.tiny_model.hybrid_serving; "
            "print(sorted(m for m in sys.modules if m.startswith('pagedkv.cold')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def _persist_window_at_16(root, window: int):
    """Process A: 24 tokens through a full + sliding(``window``) coordinator, blocks of 4,
    the sliding rows of boundary 16 published (read before the prune at 16, which may drop
    the oldest of them) and captured with the K/V chain. Returns (codec, tokens)."""
    sliding = SlidingWindowCodec(window=window, num_layers=1, kv_heads=1, head_dim=2,
                                 dtype="float32")
    tokens = TOKENS[:24]
    with open_tier(root) as tier:
        assert tier.install_capture_budget(128, 60_000)
        box = []
        ctx = ColdTierContext(tier, FP, sliding, lambda toks, **kw: box[0].verified(
            toks, cache_salt=kw.get("cache_salt", 0)))
        cache = full_sliding_alias(window=window, block_size=BS, cold=ctx, checkpoints=True)
        box.append(cache.checkpoints)
        cache.reset_for_new_request("a")
        cache.find_cached_prefix("a", tokens, max_tokens=0)
        prefill(cache, "a", tokens[:12], chunk=4)
        prune, cache.prune_sliding_all = cache.prune_sliding_all, lambda *a: 0
        prefill(cache, "a", tokens[:16], chunk=4, start=12)
        g = cache.groups[1]
        cache.checkpoints.publish(tokens, 16, sliding.snapshot([SlidingGroupRows(
            g.pool, cache.block_table("a", 1), g.null_block_id, 16)], 16), owner="a")
        cache.prune_sliding_all = prune
        prune("a", 16)
        prefill(cache, "a", tokens, chunk=4, start=16)
        cache.register_full_blocks_for_reuse("a")
        assert tier.drain(5.0)
        cache.release_request("a")
    return sliding, tokens


def _restore_over_recycled_blocks(tier, window: int, sliding, tokens):
    """Process B: a fresh coordinator whose sliding pool holds garbage (what a recycled
    block may hold) restores ``tokens`` for request "b": 16 tokens, sliding blocks 0 and 1
    null."""
    cache = full_sliding_alias(window=window, block_size=BS,
                               cold=ColdTierContext(tier, FP, sliding))
    pool = cache.groups[1].pool
    for b in range(pool.num_blocks):
        pool.write_block(b, np.full_like(pool.read_block(b), 0x7F))
    cache.reset_for_new_request("b")
    hit = cache.find_cached_prefix("b", tokens, max_tokens=len(tokens) - 1)
    assert (hit.cached_tokens, cache.block_table("b", 1)[:2].tolist()) == (16, [0, 0])
    return cache


def test_a_restored_window_row_nobody_wrote_is_never_served(tmp_path):
    """Window 6, blocks of 4, sidecar at 16: the restore writes rows [10, 16), so sliding
    block 2 (tokens 8-11) has rows 8 and 9 unwritten. Publishing it (at registration) as a
    whole block handed those rows as a hot hit to a request sharing 12 tokens (found by a
    review: they held whatever the recycled block held). It is published with its first
    written row (10), which no window of boundary 12 starts at or after; a request sharing
    12 tokens gets 8 and computes the rest, and every row it attends is right."""
    window = 6
    sliding, tokens = _persist_window_at_16(tmp_path, window)
    with open_tier(tmp_path) as tier:
        cache = _restore_over_recycled_blocks(tier, window, sliding, tokens)
        prefill(cache, "b", tokens, chunk=4, start=16)
        cache.register_full_blocks_for_reuse("b")
        cache.release_request("b")
        cache.reset_for_new_request("x")  # publishes sliding blocks 0 and 1 (tokens 0-7)
        hx = cache.find_cached_prefix("x", tokens[:9], max_tokens=8)
        prefill(cache, "x", tokens[:9], chunk=4, start=hx.cached_tokens)
        cache.register_full_blocks_for_reuse("x")
        cache.release_request("x")
        prompt = np.concatenate([tokens[:12], np.arange(4001, 4006, dtype=np.uint32)])
        cache.reset_for_new_request("c")
        hit = cache.find_cached_prefix("c", prompt, max_tokens=len(prompt) - 1)
        assert hit.cached_tokens == 8
        first = cache.first_live_position("c", 1)
        k, _ = cache.gather_kv("c", 1, start=first)
        attended = np.arange(max(0, hit.cached_tokens - window + 1), hit.cached_tokens)
        # prefill writes K = position + 1 in this group's one layer
        np.testing.assert_array_equal(k[attended - first, 0, 0], attended + 1.0)


def test_a_restored_partial_window_block_is_hit_where_the_window_is_written(tmp_path):
    """Window 6, blocks of 4, sidecar at 16: the restore writes rows [10, 16) into sliding
    blocks 2 (tokens 8-11, rows 8-9 unwritten) and 3. The next request sharing those 16
    tokens needs exactly rows [10, 16) at boundary 16, but block 2 was never published, so
    no boundary was backed by every group and it recomputed all 16 (what made the second
    run of `pagedkv demo --model hybrid` 15/16: fails on the old sliding.py with 0 cached
    tokens). Block 2 is now published with its first written row: the request hits 16
    tokens, sharing the restored sliding blocks, starts at row 10 and reads byte for byte
    what a recompute writes; rows 8-9 are never served (a request sharing only 12 tokens,
    whose window starts at row 6, is not given the block: the test above)."""
    window = 6
    sliding, tokens = _persist_window_at_16(tmp_path, window)
    with open_tier(tmp_path) as tier:
        cache = _restore_over_recycled_blocks(tier, window, sliding, tokens)
        restored = cache.block_table("b", 1)[2:4].tolist()
        prefill(cache, "b", tokens, chunk=4, start=16)
        cache.register_full_blocks_for_reuse("b")
        cache.release_request("b")
        prompt = np.concatenate([tokens[:16], np.arange(4001, 4006, dtype=np.uint32)])
        cache.reset_for_new_request("c")
        hit = cache.find_cached_prefix("c", prompt, max_tokens=len(prompt) - 1)
        assert (hit.cached_tokens, len(hit.hot_blocks), len(hit.restored_blocks)) == (16, 4, 0)
        null = cache.groups[1].null_block_id
        assert cache.block_table("c", 1)[:4].tolist() == [null, null, *restored]
        assert cache.first_live_position("c", 1) == 16 - window
        k, v = cache.gather_kv("c", 1, start=16 - window)
        before = state(cache)
        with pytest.raises(InvalidArgument, match="before 10"):
            cache.gather_kv("c", 1, start=8)  # rows 8-9 of block 2: nobody wrote them
        assert state(cache) == before
        prefill(cache, "c", prompt, chunk=4, start=16)
        cache.release_request("c")
    fresh = full_sliding_alias(window=window, block_size=BS)
    fresh.reset_for_new_request("r")
    fresh.find_cached_prefix("r", tokens[:16], max_tokens=0)
    prefill(fresh, "r", tokens[:16], chunk=4)
    rk, rv = fresh.gather_kv("r", 1, start=16 - window)
    assert (k.tobytes(), v.tobytes()) == (rk.tobytes(), rv.tobytes())


def test_first_live_position_after_a_restore_starts_at_the_written_rows(tmp_path):
    """Window 5, blocks of 4, sidecar at 16: the restore writes rows [11, 16) into sliding
    block 2 (tokens 8-11), whose rows 8-10 nobody wrote. first_live_position was the block's
    start (8), so gather_kv(start=first_live_position) returned those rows (found by a
    review): it is now 11 and a start before it is refused."""
    window = 5
    sliding, tokens = _persist_window_at_16(tmp_path, window)
    with open_tier(tmp_path) as tier:
        cache = _restore_over_recycled_blocks(tier, window, sliding, tokens)
        first = cache.first_live_position("b", 1)
        assert first == 16 - window
        k, v = cache.gather_kv("b", 1, start=first)
        # prefill wrote K = position + 1, V = K + 0.5 in this group's one layer
        np.testing.assert_array_equal(k[:, 0, 0], np.arange(first, 16) + 1.0)
        np.testing.assert_array_equal(v[:, 0, 0], np.arange(first, 16) + 1.5)
        with pytest.raises(InvalidArgument, match="before 11"):
            cache.gather_kv("b", 1, start=8)
        prefill(cache, "b", tokens, chunk=4, start=16)  # at 24 blocks 0-4 are pruned
        assert cache.first_live_position("b", 1) == 20
        cache.release_request("b")

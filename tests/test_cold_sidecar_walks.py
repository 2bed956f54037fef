"""Sidecar capture and reconcile-down restore through the real adapter, allocator and pool
(docs/cold.md, "Sidecar capture", "Reconcile-down", "Sidecar stats"): R6's policy rows, R8's
sidecar half, R10, R11, the restore-never-without-its-sidecar rule against an oracle, and
every ColdSidecarStats counter with exact counts."""

from __future__ import annotations

import itertools
import os
import shutil

import numpy as np
import pytest

from cold_support import FP, FakeAllocator, FakePool, Geometry, open_tier
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.cold import (
    UPSTREAM_KEY_FORMAT,
    ColdGroup,
    ColdRestore,
    ColdTierContext,
    RestoreDecline,
    SidecarCaptureStop,
    cold_fingerprint,
    cold_key_chain,
    cold_sidecar_stats,
    gdn_state_codec,
    object_name,
    sidecar_key,
)
from pagedkv.errors import AuxStateUnconfirmed, InvalidArgument
from pagedkv.pool import LayerKVPool, PoolGeometry

GDN = gdn_state_codec(2, conv_kernel=3, conv_dim=4, num_v_heads=1, v_head_dim=2, k_head_dim=2)
R6_FP = cold_fingerprint(UPSTREAM_KEY_FORMAT, [b"qwen3-reconcile-down"])
R6_TOKENS = np.array([700 + 3 * i for i in range(64)], np.uint32)
# cold-tier golden: the 64-token chain's GDN key at block 3 (the sidecar at boundary 32).
R6_SIDECAR_32 = "da44cf19fc92ad6058bb0c471c73e28c49b2d504db36aa0304e373fb3a978db6"


def gdn_state(seed: int):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 1 << 16, (2, 2, 4), dtype=np.uint16),
            rng.integers(0, 1 << 16, (2, 1, 2, 2), dtype=np.uint16))


def delta(before, after=None):
    """Changed sidecar counters since ``before``."""
    after = after or cold_sidecar_stats()
    return {k: getattr(after, k) - getattr(before, k) for k in vars(before)
            if getattr(after, k) != getattr(before, k)}


def adapter(ctx, bs, num_blocks=64, aux=True):
    pool = LayerKVPool(PoolGeometry(2, 1, 8, bs, "float16"), num_blocks)
    alloc = BlockAllocator(num_blocks, block_size=bs, hash_seed=0)
    return PagedKVCacheAdapter(alloc, pool, cold=ctx, requires_aux_confirmation=aux)


def run_turn(a, seq, tokens, seed=0, *, confirm=True):
    """One request: lookup, (install state,) write random K/V for the rest, register."""
    a.reset_for_new_request(seq)
    hit = a.find_cached_prefix(seq, tokens)
    if confirm and a.aux_prefix_unbacked(seq):
        a.confirm_aux_prefix_primed(seq, hit.cached_tokens)
    a.allocate_suffix_blocks(seq, len(tokens))
    new = tokens[hit.cached_tokens:]
    a.record_tokens(seq, new)
    rng = np.random.default_rng(seed)
    for layer in range(2):
        a.write_kv(seq, layer, rng.standard_normal((len(new), 1, 8)).astype(np.float16),
                   rng.standard_normal((len(new), 1, 8)).astype(np.float16))
    a.register_full_blocks_for_reuse(seq)
    return hit


def r6_tier(root):
    return open_tier(root, fmt=UPSTREAM_KEY_FORMAT, fingerprint=R6_FP)


def persist_r6(root, sidecars=()):
    """8 blocks of the R6 prompt at bs 8, and GDN sidecars at ``sidecars`` (tokens)."""
    with r6_tier(root) as tier:
        ctx = ColdTierContext(tier, R6_FP, GDN)
        a = adapter(ctx, 8)
        run_turn(a, "w", R6_TOKENS)
        assert tier.last_capture.blocks == 8
        for b in sidecars:
            out = ctx.capture_sidecar({b: gdn_state(b)}, tokens=R6_TOKENS, captured_blocks=8,
                                      block_size=8)
            assert out.stop is SidecarCaptureStop.ENQUEUED
        assert tier.drain(5.0)


def lookup_r6(root, policy=True):
    """A fresh adapter over the persisted R6 prompt: (hit, adapter, tier stats)."""
    with r6_tier(root) as tier:
        ctx = ColdTierContext(tier, R6_FP, GDN if policy else None)
        a = adapter(ctx, 8)
        a.reset_for_new_request("r")
        hit = a.find_cached_prefix("r", R6_TOKENS)
        a.allocator.check_invariants()
        return hit, a, tier.stats(), tier.last_restore


# --- R6 with a policy ----------------------------------------------------------------------------

def test_r6_reconciles_down_to_the_sidecar_backed_boundary(tmp_path):
    root = tmp_path / "root"
    persist_r6(root)
    hit, _, stats, _ = lookup_r6(root, policy=False)          # no policy: the whole chain
    assert hit.cached_tokens == 64 and len(hit.restored_blocks) == 8 and hit.sidecar is None

    hit, a, stats, last = lookup_r6(root)                     # policy, no sidecar: nothing
    assert hit.cached_tokens == 0 and stats.hits == 0 and stats.restore_declines == 1
    assert last.decline is RestoreDecline.NO_BACKED_BOUNDARY
    assert not a.aux_prefix_unbacked("r") and a.allocator.num_allocated_blocks == 0

    persist_r6(root, sidecars=(32,))
    names = os.listdir(root)
    assert sum(n.endswith(".gdn_state.safetensors") for n in names) == 1
    assert f"{R6_SIDECAR_32}.gdn_state.safetensors" in names  # captured under the golden key
    name = f"{R6_SIDECAR_32}.gdn_state.safetensors"
    hit, a, stats, last = lookup_r6(root)
    assert hit.cached_tokens == 32 and len(hit.restored_blocks) == 4 and stats.hits == 4
    assert hit.sidecar.boundary_tokens == 32 and hit.sidecar.key.hex() == name.split(".")[0]
    assert last.limit == 4 and last.sidecar_tokens == 32 and last.decline is None
    assert not a.aux_prefix_unbacked("r")  # the sidecar backs exactly the cached boundary
    side = a.take_restored_sidecar("r")
    assert side is hit.sidecar and a.take_restored_sidecar("r") is None
    conv, rec = GDN.unpack(side)
    assert np.array_equal(conv, gdn_state(32)[0]) and np.array_equal(rec, gdn_state(32)[1])

    victim = root / object_name(cold_key_chain(UPSTREAM_KEY_FORMAT, ColdGroup.KV, R6_FP,
                                               R6_TOKENS, 8)[2], ColdGroup.KV)
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    hit, a, stats, last = lookup_r6(root)                     # block 2 corrupt: nothing
    assert hit.cached_tokens == 0 and hit.sidecar is None and stats.hits == 0
    assert stats.corruptions == 1 and stats.restore_declines == 1
    assert last.decline is RestoreDecline.RESTORE_SHORT_OF_BOUNDARY
    assert a.allocator.num_allocated_blocks == 0 and a.allocator.prefix_cache_len == 0


def test_a_corrupt_deep_sidecar_falls_back_to_a_shallower_backed_boundary(tmp_path):
    root = tmp_path / "root"
    persist_r6(root, sidecars=(16, 32))
    deep = root / object_name(sidecar_key(UPSTREAM_KEY_FORMAT, ColdGroup.GDN_STATE, R6_FP,
                                          R6_TOKENS, 8, 32), ColdGroup.GDN_STATE)
    data = bytearray(deep.read_bytes())
    data[len(data) // 2] ^= 0x01
    deep.write_bytes(bytes(data))
    hit, a, stats, _ = lookup_r6(root)
    assert hit.cached_tokens == 16 and hit.sidecar.boundary_tokens == 16
    assert stats.hits == 2 and stats.corruptions == 1 and stats.misses == 1
    assert not deep.exists()  # pruned
    assert not a.aux_prefix_unbacked("r")


def test_a_deleted_sidecar_is_a_counted_miss_and_the_request_recomputes(tmp_path):
    root = tmp_path / "root"
    persist_r6(root, sidecars=(32,))
    with r6_tier(root) as tier:  # opened before the deletion: the index still lists it
        os.unlink(root / object_name(sidecar_key(UPSTREAM_KEY_FORMAT, ColdGroup.GDN_STATE,
                                                 R6_FP, R6_TOKENS, 8, 32),
                                     ColdGroup.GDN_STATE))
        a = adapter(ColdTierContext(tier, R6_FP, GDN), 8)
        hit = run_turn(a, "r", R6_TOKENS)  # recomputes all 64 tokens; no latch to confirm
        s = tier.stats()
        assert hit.cached_tokens == 0 and hit.sidecar is None
        assert (s.misses, s.corruptions, s.hits, s.restore_declines) == (1, 0, 0, 1)
        assert a.num_tokens("r") == 64 and not a.aux_prefix_unbacked("r")


def test_a_sidecar_of_another_geometry_is_a_plain_miss(tmp_path):
    root = tmp_path / "root"
    persist_r6(root)
    other = gdn_state_codec(2, conv_kernel=3, conv_dim=6, num_v_heads=1, v_head_dim=2,
                            k_head_dim=2)
    with r6_tier(root) as tier:
        ctx = ColdTierContext(tier, R6_FP, other)
        rng = np.random.default_rng(0)
        state = (rng.integers(0, 9, (2, 2, 6), dtype=np.uint16),
                 rng.integers(0, 9, (2, 1, 2, 2), dtype=np.uint16))
        ctx.capture_sidecar({32: state}, tokens=R6_TOKENS, captured_blocks=8, block_size=8)
        assert tier.drain(5.0)
    hit, _, stats, last = lookup_r6(root)
    assert hit.cached_tokens == 0 and stats.misses == 1 and stats.corruptions == 0
    assert last.decline is RestoreDecline.NO_BACKED_BOUNDARY


# --- restore never returns K/V without its sidecar (oracle) -------------------------------------

def _expected(sidecars: set[int], corrupt: int | None, n: int = 8) -> int:
    """Blocks an R6-style walk keeps: the deepest backed boundary, cut at a corrupt block
    to the deepest sidecar at or under it."""
    backed = max(sidecars, default=0)
    if corrupt is not None and corrupt < backed:
        backed = max((s for s in sidecars if s <= corrupt), default=0)
    return backed


def test_restore_never_returns_blocks_without_a_sidecar_at_their_end(tmp_path):
    geom = Geometry(block_size=4)
    toks = np.arange(500, 532, dtype=np.uint32)  # 8 blocks of 4
    template = tmp_path / "template"
    with open_tier(template) as tier:
        ctx = ColdTierContext(tier, FP, GDN)
        pool, alloc = FakePool(geom), FakeAllocator(block_size=4)
        ids = np.array([alloc.allocate() for _ in range(8)], np.int32)
        for j, b in enumerate(ids):
            pool.fill(int(b), j)
        ctx.capture(tokens=toks, block_ids=ids, pool=pool, allocator=alloc)
        for count in range(1, 9):
            ctx.capture_sidecar({4 * count: gdn_state(count)}, tokens=toks, captured_blocks=8,
                                block_size=4)
        assert tier.drain(5.0)
    kv_keys = cold_key_chain(tier.fmt, ColdGroup.KV, FP, toks, 4)
    rng = np.random.default_rng(7)
    cases = [(set(), None), ({8}, None), ({8}, 3), ({2, 5}, 4), ({1, 2, 3}, 0), ({6}, 6),
             ({3, 7}, 5)] + [(set(rng.choice(np.arange(1, 9), rng.integers(0, 5),
                                             replace=False).tolist()),
                              None if rng.random() < 0.3 else int(rng.integers(0, 8)))
                             for _ in range(10)]
    for i, (sidecars, corrupt) in enumerate(cases):
        root = tmp_path / f"case{i}"
        shutil.copytree(template, root)
        for count in set(range(1, 9)) - sidecars:
            os.unlink(root / object_name(sidecar_key(tier.fmt, ColdGroup.GDN_STATE, FP, toks,
                                                     4, 4 * count), ColdGroup.GDN_STATE))
        if corrupt is not None:
            p = root / object_name(kv_keys[corrupt], ColdGroup.KV)
            p.write_bytes(p.read_bytes()[:-1])
        with open_tier(root) as t2:
            alloc = FakeAllocator(block_size=4)
            got = ColdTierContext(t2, FP, GDN).restore(
                tokens=toks, hot_blocks=0, pool=FakePool(geom), allocator=alloc)
            assert isinstance(got, ColdRestore)
            want = _expected(sidecars, corrupt)
            assert len(got.block_ids) == want, (sidecars, corrupt)
            if want:
                assert got.sidecar.boundary_tokens == 4 * want
                assert t2.stats().hits == want
            else:
                assert got.sidecar is None and t2.stats().hits == 0
            # Every block the walk took is either returned (held once, published) or freed.
            held = {int(b) for b in got.block_ids}
            assert all(alloc.ref[b] == (2 if b in held else 0) for b in range(len(alloc.ref)))


# --- R8: salted chains --------------------------------------------------------------------------

def test_a_salted_sidecar_restores_only_in_its_own_domain(tmp_path):
    root = tmp_path / "root"
    toks = np.arange(1, 33, dtype=np.uint32)  # 4 blocks of 8
    salt = 0xD0D0
    with open_tier(root) as tier:
        ctx = ColdTierContext(tier, FP, GDN, lambda t, **kw: {24: gdn_state(24)}
                              if kw["cache_salt"] == salt else {})
        a = adapter(ctx, 8)
        a.reset_for_new_request("w")
        a.find_cached_prefix("w", toks, cache_salt=salt)
        a.allocate_suffix_blocks("w", 32)
        a.record_tokens("w", toks)
        a.register_full_blocks_for_reuse("w", cache_salt=salt)
        assert tier.last_capture.sidecar.stop is SidecarCaptureStop.ENQUEUED
        assert tier.drain(5.0)
    for lookup_salt, want in ((salt, 24), (0, 0), (salt + 1, 0)):
        with open_tier(root) as tier:
            a = adapter(ColdTierContext(tier, FP, GDN), 8)
            a.reset_for_new_request("r")
            hit = a.find_cached_prefix("r", toks, cache_salt=lookup_salt)
            assert hit.cached_tokens == want
            assert (hit.sidecar.boundary_tokens if want else hit.sidecar) == (want or None)



def test_context_capture_asks_the_checkpoint_source_with_the_uniform_keys(tmp_path):
    """ColdTierContext.capture(extra_keys=(7,)) asked its checkpoint source without the
    keys, so a keyless request's checkpoint was persisted under the keyed sidecar chain and
    restored for it (found by a review). The source sees the keys per block, finds no
    checkpoint on the (7,) lineage and nothing is captured."""
    from pagedkv.coordinator import StateCheckpointStore
    codec = gdn_state_codec(1, conv_kernel=2, conv_dim=2, num_v_heads=1, v_head_dim=1,
                            k_head_dim=1, dtype="float32")
    toks = np.arange(100, 116, dtype=np.uint32)  # 4 blocks of 4
    store = StateCheckpointStore(BlockAllocator(64, block_size=4, hash_seed=0))
    keyless = (np.full((1, 1, 2), 111.0, np.float32), np.full((1, 1, 1, 1), 111.0, np.float32))
    assert store.publish(toks, 16, keyless, owner="P")
    seen = []

    def source(tokens, **kw):
        seen.append(kw["extra_keys_per_block"])
        return store.verified(tokens, **kw)

    with open_tier(tmp_path) as tier:
        ctx = ColdTierContext(tier, FP, codec, source)
        pool, alloc = FakePool(), FakeAllocator()
        pool.block_size = 4
        ids = np.array([alloc.allocate() for _ in range(4)], np.int32)
        out = ctx.capture(tokens=toks, block_ids=ids, extra_keys=(7,), pool=pool,
                          allocator=alloc)
        assert [list(k) for k in seen[0]] == [[7]] * 4
        assert out.sidecar.stop is SidecarCaptureStop.BOUNDARY_SKIP
        assert tier.drain(5.0)
        r = ctx.restore(tokens=toks, hot_blocks=0, extra_keys=(7,), pool=FakePool(),
                        allocator=BlockAllocator(64, block_size=4, hash_seed=0))
        assert (len(r.block_ids), r.sidecar) == (0, None)


# --- R10: sidecar capture accounting -------------------------------------------------------------

def test_sidecar_capture_anchors_under_a_partially_captured_chain(tmp_path):
    checkpoints: dict[int, object] = {}
    with open_tier(tmp_path / "root") as tier:
        ctx = ColdTierContext(tier, FP, GDN, lambda t, **kw: dict(checkpoints))
        a = adapter(ctx, 16, num_blocks=128)

        s0 = cold_sidecar_stats()
        run_turn(a, "a", np.arange(1, 11, dtype=np.uint32))       # 10 tokens: no block
        assert delta(s0) == {"capture_reached": 1, "chain_empty": 1}
        assert tier.last_capture.sidecar.stop is SidecarCaptureStop.CHAIN_EMPTY

        checkpoints[48] = gdn_state(48)
        s0 = cold_sidecar_stats()
        run_turn(a, "b", np.arange(100, 140, dtype=np.uint32))    # reaches 2 blocks
        assert delta(s0) == {"capture_reached": 1, "boundary_skips": 1}

        checkpoints[32] = gdn_state(32)
        s0, t0 = cold_sidecar_stats(), tier.stats()
        run_turn(a, "c", np.arange(200, 240, dtype=np.uint32))
        assert delta(s0) == {"capture_reached": 1, "enqueued": 1}
        assert tier.last_capture.sidecar.boundary_tokens == 32
        assert tier.stats().enqueued - t0.enqueued == 3  # 2 blocks + the sidecar
        assert tier.drain(5.0)

        s0 = cold_sidecar_stats()
        a.release_request("c")
        run_turn(a, "c", np.arange(200, 240, dtype=np.uint32))    # the same prompt again
        assert delta(s0) == {"capture_reached": 1, "already_persisted": 1}
        assert tier.last_capture.sidecar.stop is SidecarCaptureStop.ALREADY_PERSISTED

        # A full queue until the deadline drops the sidecar (counted in both pairs).
        checkpoints.clear()
        checkpoints[16] = gdn_state(16)
        tier.install_capture_budget(128, 30)
        tier.writer.hold()
        try:
            toks = np.arange(300, 300 + 16 * 9, dtype=np.uint32)  # 9 blocks > depth 8
            s0, t0 = cold_sidecar_stats(), tier.stats()
            run_turn(a, "d", toks)
            d = delta(s0)
            assert d == {"capture_reached": 1, "queue_drops": 1}
            assert tier.last_capture.blocks == 8 and tier.stats().queue_drops - t0.queue_drops == 2
        finally:
            tier.writer.release()
        assert tier.drain(5.0)
        # State of the wrong dtype is skipped, never written under the layout's label.
        checkpoints[16] = (gdn_state(16)[0].astype(np.float32), gdn_state(16)[1])
        s0, t0 = cold_sidecar_stats(), tier.stats()
        run_turn(a, "e", np.arange(600, 640, dtype=np.uint32))
        assert delta(s0) == {"capture_reached": 1}
        assert tier.last_capture.sidecar.stop is SidecarCaptureStop.LAYOUT_MISMATCH
        assert tier.stats().enqueued - t0.enqueued == 2  # the blocks only


def test_capture_sidecar_needs_a_codec_and_never_raises_through_the_adapter(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        with pytest.raises(InvalidArgument):
            ColdTierContext(tier, FP).capture_sidecar({}, tokens=R6_TOKENS, captured_blocks=1,
                                                      block_size=8)

        def broken(tokens, **kw):
            raise RuntimeError("checkpoint store gone")

        a = adapter(ColdTierContext(tier, FP, GDN, broken), 8)
        run_turn(a, "s", np.arange(16, dtype=np.uint32))
        assert a.cold_capture_outcome("s").blocks == 2  # the K/V walk still counted
        assert a.stats()["cold_capture_errors"] == 0


# --- R11, take_restored_sidecar, restore_suppressed, installed ----------------------------------

def test_hot_hit_on_blocks_a_backed_restore_published_latches_until_confirmed(tmp_path):
    root = tmp_path / "root"
    persist_r6(root, sidecars=(32,))
    with r6_tier(root) as tier:
        ctx = ColdTierContext(tier, R6_FP, GDN)
        a = adapter(ctx, 8)
        a.reset_for_new_request("r")
        hit = a.find_cached_prefix("r", R6_TOKENS)
        assert hit.cached_tokens == 32 and not a.aux_prefix_unbacked("r")
        s0 = cold_sidecar_stats()
        conv, rec = np.zeros((2, 2, 4), np.uint16), np.zeros((2, 1, 2, 2), np.uint16)
        GDN.install(a.take_restored_sidecar("r"), conv, rec)
        assert delta(s0) == {"installed": 1}
        a.record_tokens("r", R6_TOKENS[32:40])  # no latch: the restore was backed
        a.release_request("r")
        # The restored blocks are hot now; a hot hit brings no sidecar and latches.
        a.reset_for_new_request("h")
        hit = a.find_cached_prefix("h", R6_TOKENS)
        assert hit.cached_tokens == 32 and len(hit.restored_blocks) == 0
        assert hit.sidecar is None and a.take_restored_sidecar("h") is None
        assert a.aux_prefix_unbacked("h")
        with pytest.raises(AuxStateUnconfirmed):
            a.record_tokens("h", R6_TOKENS[32:33])
        with pytest.raises(InvalidArgument):
            a.confirm_aux_prefix_primed("h", 16)
        a.confirm_aux_prefix_primed("h", 32)
        a.record_tokens("h", R6_TOKENS[32:33])
        assert delta(s0) == {"installed": 1}


def test_throwing_away_a_backed_restore_counts_restore_suppressed_once(tmp_path):
    root = tmp_path / "root"
    persist_r6(root, sidecars=(32,))
    with r6_tier(root) as tier:
        a = adapter(ColdTierContext(tier, R6_FP, GDN), 8)
        a.reset_for_new_request("r")
        assert a.find_cached_prefix("r", R6_TOKENS).cached_tokens == 32
        s0 = cold_sidecar_stats()
        assert a.restart_prepared_turn_cold("r", R6_TOKENS, 64) == 8
        assert delta(s0) == {"restore_suppressed": 1}
        assert a.cached_token_count("r") == 0 and a.take_restored_sidecar("r") is None
        a.allocator.check_invariants()


def test_sidecar_stats_are_exactly_the_eight_counters_and_trace_fields():
    from pagedkv.cold import COLD_DELTA_FIELDS
    fields = set(vars(cold_sidecar_stats()))
    assert fields == {"capture_reached", "chain_empty", "boundary_skips", "already_persisted",
                      "enqueued", "queue_drops", "installed", "restore_suppressed"}
    assert {f"cold_sidecar_{f}" for f in fields} <= COLD_DELTA_FIELDS


@pytest.mark.parametrize(("reach", "have", "want"), [
    (0, [16], None), (2, [48], None), (2, [16, 32, 48], 32), (3, [8, 24, 40], None),
    (4, [64, 0, 48, -16], 64)])
def test_the_anchor_is_the_deepest_block_aligned_checkpoint_under_the_reach(reach, have, want):
    from pagedkv.cold.sidecar_capture import sidecar_anchor
    assert sidecar_anchor(have, reach, 16) == want


def test_a_queued_or_persisted_sidecar_job_is_never_written_twice(tmp_path):
    toks = np.arange(64, dtype=np.uint32)
    with open_tier(tmp_path / "root") as tier:
        ctx = ColdTierContext(tier, FP, GDN)
        tier.writer.hold()
        outs = [ctx.capture_sidecar({32: gdn_state(1)}, tokens=toks, captured_blocks=8,
                                    block_size=4).stop for _ in range(2)]
        tier.writer.release()
        assert outs == [SidecarCaptureStop.ENQUEUED, SidecarCaptureStop.ALREADY_PERSISTED]
        assert tier.drain(5.0) and tier.stats().enqueued == 1
        files = [n for n in os.listdir(tmp_path / "root") if n.endswith("gdn_state.safetensors")]
        assert len(files) == 1


def test_the_anchor_rule_over_small_cases():
    from pagedkv.cold.sidecar_capture import sidecar_anchor
    for reach, boundaries in itertools.product(range(4), [(), (16,), (32,), (16, 48), (8,)]):
        eligible = [b for b in boundaries if b <= reach * 16 and b % 16 == 0]
        assert sidecar_anchor(boundaries, reach, 16) == (max(eligible) if eligible else None)


def test_sidecar_buffers_are_recycled_and_large_spares_capped(tmp_path):
    from pagedkv.cold.writer import LARGE_SPARE_BYTES, LARGE_SPARES
    toks = np.arange(64, dtype=np.uint32)
    with open_tier(tmp_path / "root", queue_depth=1) as tier:
        ctx = ColdTierContext(tier, FP, GDN)
        writer = tier.writer
        shape = (2, GDN.bytes_per_layer)
        # A skipped (wrong dtype) capture gives its buffer back; the next capture takes it.
        bad = (gdn_state(1)[0].astype(np.float32), gdn_state(1)[1])
        spare = writer.take_buffer(shape)
        writer.give_back(spare)
        ctx.capture_sidecar({32: bad}, tokens=toks, captured_blocks=8, block_size=4)
        got = writer.take_buffer(shape)
        assert got is spare
        writer.give_back(got)
        # Accepted: the job owns it until its commit, then it comes back.
        ctx.capture_sidecar({32: gdn_state(2)}, tokens=toks, captured_blocks=8, block_size=4)
        assert writer.take_buffer(shape) is not spare
        assert tier.drain(5.0)
        assert writer.take_buffer(shape) is spare
        big = [np.empty(LARGE_SPARE_BYTES + 1, np.uint8) for _ in range(LARGE_SPARES + 1)]
        for b in big:
            writer.give_back(b)
        kept = [writer.take_buffer(b.shape) for b in big]
        assert sum(k is b for k, b in zip(kept, big, strict=True)) == LARGE_SPARES

"""Capture and restore walks against a test pool and allocator (docs/contracts/cold-tier.md, '8.
Capture and restore walks'; R1–R5, R8, R12)."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from cold_support import FP, FakeAllocator, FakePool, open_tier, persist_prompt
from pagedkv.cold import (
    COLD_DELTA_FIELDS,
    CaptureStop,
    ColdGroup,
    ColdTier,
    RestoreDecline,
    TurnTraceWriter,
    cold_cache_stats,
    cold_key_chain,
    install_capture_budget,
    object_name,
)
from pagedkv.cold.stats import sidecar_counters

TOKENS_12 = np.arange(100, 112, dtype=np.uint32)


def _restore(tier, tokens, *, pool=None, alloc=None, hot=0, cache_salt=0):
    pool = pool or FakePool()
    alloc = alloc or FakeAllocator()
    ids = tier.restore(tokens=np.asarray(tokens, np.uint32), hot_blocks=hot,
                       cache_salt=cache_salt, extra_keys_per_block=None, pool=pool,
                       allocator=alloc)
    return ids, pool, alloc


# R1 --------------------------------------------------------------------------------------

def test_stats_without_a_tier_are_zero_and_budget_install_is_idempotent(tmp_path,
                                                                         monkeypatch):
    from pagedkv.cold import knobs
    monkeypatch.setattr(knobs, "_installed_budget", None)  # restored after the test
    base = tmp_path / "base"
    base.mkdir()
    (base / "pagedkv-v1").write_bytes(b"not a dir")
    assert ColdTier.shared(str(base)) is None
    s = cold_cache_stats()
    assert s.enabled is False and s.hits == s.misses == s.enqueued == s.quota_bytes == 0
    before = sidecar_counters().get("capture_reached")
    sidecar_counters().add("capture_reached")
    assert sidecar_counters().get("capture_reached") == before + 1
    assert install_capture_budget(16, 100) is True
    assert install_capture_budget(16, 100) is True


# R2 --------------------------------------------------------------------------------------

def test_multi_block_prefix_restores_after_restart(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        pool_a, _, ids_a, out = persist_prompt(a, TOKENS_12)
        assert (out.blocks, out.enqueued, out.stop) == (3, 3, CaptureStop.END)
    with open_tier(root) as b:
        ids, pool_b, alloc_b = _restore(b, TOKENS_12)
        assert len(ids) == 3 and ids.dtype == np.int32
        assert b.stats().hits == 3 and b.stats().corruptions == 0
        assert b.stats().bytes_restored == sum(os.path.getsize(root / n) for n in os.listdir(root))
        for src, dst in zip(ids_a, ids, strict=True):
            assert np.array_equal(pool_b.data[dst], pool_a.data[src])
        # Published with the request's identities, one caller ref + one prefix ref.
        assert [int(alloc_b.ref[i]) for i in ids] == [2, 2, 2]
        hashes = alloc_b.chain_hashes(TOKENS_12)
        assert [alloc_b.table[int(h)] for h in hashes] == ids.tolist()
        ident = alloc_b.identities[int(hashes[2])]
        assert (ident.block_index, ident.parent_hash) == (2, int(hashes[1]))


def test_restore_extends_past_the_hot_hit_and_stops_at_the_first_hole(tmp_path):
    root = tmp_path / "root"
    toks = np.arange(32, dtype=np.uint32)
    with open_tier(root) as tier:
        persist_prompt(tier, toks)
        keys = cold_key_chain(tier.fmt, ColdGroup.KV, FP, toks, 4)
        os.unlink(root / object_name(keys[5]))
    with open_tier(root) as tier:
        ids, _, _ = _restore(tier, toks, hot=2)
        assert len(ids) == 3  # blocks 2, 3, 4; 5 is a hole
        assert tier.last_restore.base == 2 and tier.last_restore.limit == 5
        ids, _, _ = _restore(tier, toks, hot=8)
        assert len(ids) == 0


# R3 --------------------------------------------------------------------------------------

def test_upload_error_after_allocation_frees_the_block_and_counts_one_miss(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        persist_prompt(a, TOKENS_12)
    with open_tier(root) as b:
        pool, alloc = FakePool(), FakeAllocator()
        pool.fail_writes = True
        ids, _, _ = _restore(b, TOKENS_12, pool=pool, alloc=alloc)
        assert len(ids) == 0 and b.stats().misses == 1 and b.stats().hits == 0
        assert int(alloc.ref.sum()) == 0 and alloc.table == {}


def test_a_failure_mid_run_publishes_only_the_verified_prefix(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        persist_prompt(a, TOKENS_12)
        keys = cold_key_chain(a.fmt, ColdGroup.KV, FP, TOKENS_12, 4)
    p = root / object_name(keys[1])
    data = bytearray(p.read_bytes())
    data[-1] ^= 1
    p.write_bytes(bytes(data))
    with open_tier(root) as b:
        ids, _, alloc = _restore(b, TOKENS_12)
        assert len(ids) == 1
        s = b.stats()
        assert (s.hits, s.misses, s.corruptions) == (1, 1, 1)
        assert len(alloc.table) == 1 and not p.exists()


def test_refused_publish_frees_everything_and_declines(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        persist_prompt(a, TOKENS_12)
    with open_tier(root) as b:
        alloc = FakeAllocator()
        alloc.refuse_publish = True
        ids, _, _ = _restore(b, TOKENS_12, alloc=alloc)
        assert len(ids) == 0 and int(alloc.ref.sum()) == 0
        assert b.stats().restore_declines == 1 and b.stats().hits == 0
        assert b.last_restore.decline is RestoreDecline.PUBLISH_REFUSED


def test_token_mismatch_after_decode_is_one_miss(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        _, _, _, _ = persist_prompt(a, TOKENS_12)
        keys = cold_key_chain(a.fmt, ColdGroup.KV, FP, TOKENS_12, 4)
        other = np.arange(500, 512, dtype=np.uint32)
        persist_prompt(a, other)
        okeys = cold_key_chain(a.fmt, ColdGroup.KV, FP, other, 4)
    # An object whose stored tokens are not the request's (a forged name).
    os.replace(root / object_name(okeys[0]), root / object_name(keys[0]))
    with open_tier(root) as b:
        ids, _, alloc = _restore(b, TOKENS_12)
        assert len(ids) == 0
        s = b.stats()
        assert (s.hits, s.misses) == (0, 1) and int(alloc.ref.sum()) == 0


def test_a_pool_read_failure_during_capture_enqueues_nothing(tmp_path):
    with open_tier(tmp_path / "root") as tier:
        pool, alloc = FakePool(), FakeAllocator()
        ids = np.array([alloc.allocate() for _ in range(3)], np.int32)
        pool.fail_reads = True
        out = tier.capture(tokens=TOKENS_12, block_ids=ids, hashes=None, cache_salt=0,
                           extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert out.stop is CaptureStop.ERROR and out.enqueued == 0 and out.blocks == 0
        assert tier.stats().enqueued == 0
        assert alloc.ref[ids].tolist() == [1, 1, 1]  # the capture ref was given back


# R4 / R5 ---------------------------------------------------------------------------------

def test_capture_persists_the_whole_budget_not_just_the_queue_depth(tmp_path):
    toks = np.arange(256, dtype=np.uint32)
    with open_tier(tmp_path / "root", queue_depth=1) as tier:
        tier.writer.service_delay_s = 0.001
        assert tier.install_capture_budget(64, 60000)
        _, _, _, out = persist_prompt(tier, toks)
        assert (out.blocks, out.enqueued, out.stop) == (64, 64, CaptureStop.END)
        assert tier.stats().queue_drops == 0
        assert len(os.listdir(tmp_path / "root")) == 64


def test_capture_stops_at_the_block_budget_and_resumes_next_turn(tmp_path):
    toks = np.arange(256, dtype=np.uint32)
    with open_tier(tmp_path / "root") as tier:
        assert tier.install_capture_budget(16, 60000)
        pool, alloc, ids, out = persist_prompt(tier, toks)
        assert (out.blocks, out.enqueued, out.stop) == (16, 16, CaptureStop.BUDGET)
        out = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                           extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert (out.blocks, out.enqueued, out.stop) == (32, 16, CaptureStop.BUDGET)


def test_a_full_queue_never_blocks_capture_past_its_deadline(tmp_path):
    toks = np.arange(64, dtype=np.uint32)
    with open_tier(tmp_path / "root", queue_depth=2) as tier:
        assert tier.install_capture_budget(128, 50)
        tier.writer.hold()
        pool, alloc = FakePool(), FakeAllocator()
        ids = np.array([alloc.allocate() for _ in range(16)], np.int32)
        t0 = time.monotonic()
        out = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                           extra_keys_per_block=None, pool=pool, allocator=alloc)
        elapsed = time.monotonic() - t0
        assert out.stop is CaptureStop.DEADLINE and out.enqueued == 2 and out.blocks == 2
        assert elapsed < 0.5  # 50 ms budget; generous for a shared machine
        assert tier.stats().queue_drops == 1
        tier.writer.release()
        assert tier.drain(5.0)


# R8 --------------------------------------------------------------------------------------

def test_salted_chains_restore_only_in_their_domain(tmp_path):
    root = tmp_path / "root"
    domain = 0xE17EC77DAF07A780
    with open_tier(root) as a:
        persist_prompt(a, TOKENS_12, cache_salt=domain)
    with open_tier(root) as b:
        assert len(_restore(b, TOKENS_12, cache_salt=0)[0]) == 0
        assert len(_restore(b, TOKENS_12, cache_salt=domain + 1)[0]) == 0
        assert b.stats().misses == 0  # not on disk: a plain miss, nothing loaded
        assert len(_restore(b, TOKENS_12, cache_salt=domain)[0]) == 3


# R12 -------------------------------------------------------------------------------------

def test_counters_and_one_traced_turn(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as tier:
        tier.writer.fail_next_jobs = 1
        pool, alloc = FakePool(), FakeAllocator()
        ids = np.array([alloc.allocate()], np.int32)
        tier.capture(tokens=TOKENS_12[:4], block_ids=ids, hashes=None, cache_salt=0,
                     extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert tier.drain(5.0) is False
        assert tier.stats().write_errors == 1
        writer = TurnTraceWriter(str(tmp_path / "traces"), tier=tier, enabled=True)
        persist_prompt(tier, TOKENS_12)
        rec = writer.record({"v": 1, "trace_id": "t", "ts_ms": 1, "model": "m", "duration_ms": 2.0,
                                 "prompt_tokens": 12, "cached_tokens": 0, "output_tokens": 3})
        files = os.listdir(tmp_path / "traces")
        assert len(files) == 1 and files[0].endswith(f"-{os.getpid()}.jsonl")
        line = json.loads((tmp_path / "traces" / files[0]).read_text().splitlines()[-1])
        assert line == rec
        assert set(line) - {"v", "trace_id", "ts_ms", "model", "duration_ms", "prompt_tokens",
                            "cached_tokens", "output_tokens"} == COLD_DELTA_FIELDS
        assert line["cold_enqueued"] == 3 and line["cold_write_errors"] == 0
        assert line["cold_write_errors_total"] == 1 and line["cold_enabled"] is True


def test_trace_is_off_with_pagedkv_metrics_0(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_METRICS", "0")
    monkeypatch.setenv("PAGEDKV_METRICS_DIR", str(tmp_path / "t"))
    w = TurnTraceWriter()
    assert w.record({"v": 1}) is None and not (tmp_path / "t").exists()


# O1 (capture half) -------------------------------------------------------------------------

def test_capturing_a_partial_block_raises_and_enqueues_nothing(tmp_path):
    from pagedkv.errors import InvalidArgument
    with open_tier(tmp_path / "root") as tier:
        pool, alloc = FakePool(), FakeAllocator()
        b = alloc.allocate()
        with pytest.raises(InvalidArgument, match="full blocks"):
            tier.capture_and_enqueue_before(pool, alloc, b, bytes(32), [1, 2, 3],
                                            time.monotonic() + 1)
        assert tier.stats().enqueued == 0 and int(alloc.ref[b]) == 1


# R6 (the no-policy row) ----------------------------------------------------------------------

def test_reconcile_down_without_a_policy_restores_all_eight_blocks(tmp_path):
    from cold_support import Geometry
    from pagedkv.cold import UPSTREAM_KEY_FORMAT, cold_fingerprint
    fp = cold_fingerprint(UPSTREAM_KEY_FORMAT, [b"qwen3-reconcile-down"])
    toks = np.array([700 + 3 * i for i in range(64)], np.uint32)
    geom = Geometry(block_size=8)
    root = tmp_path / "root"
    with open_tier(root, fmt=UPSTREAM_KEY_FORMAT, fingerprint=fp) as a:
        persist_prompt(a, toks, pool=FakePool(geom), alloc=FakeAllocator(block_size=8))
    names = set(os.listdir(root))
    assert len(names) == 8
    assert "9c0f9450e1009988c9d57755602a22748e3dac5db7e699ace16d771485ef31e2.safetensors" in names
    assert "328dd15556c4bfb1769c44531356803bfdad94bf2b0d121ce8ebf9aabc809802.safetensors" in names
    with open_tier(root, fmt=UPSTREAM_KEY_FORMAT, fingerprint=fp) as b:
        ids, _, _ = _restore(b, toks, pool=FakePool(geom), alloc=FakeAllocator(block_size=8))
        assert len(ids) == 8 and b.stats().hits == 8


def test_an_allocator_error_mid_walk_frees_what_was_taken(tmp_path):
    root = tmp_path / "root"
    with open_tier(root) as a:
        persist_prompt(a, TOKENS_12)
    with open_tier(root) as b:
        alloc = FakeAllocator()
        real = alloc.allocate
        calls = []
        def flaky():
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected allocator failure")
            return real()
        alloc.allocate = flaky
        ids, _, _ = _restore(b, TOKENS_12, alloc=alloc)
        # One block was taken and published; the walk stopped at the failure.
        assert len(ids) == 1 and b.stats().misses == 1
        assert int(alloc.ref.sum()) == 2 and len(alloc.table) == 1


def test_a_block_queued_by_an_earlier_walk_is_not_captured_again(tmp_path):
    """Two requests sharing a prefix register it before the writer got to it: the second
    walk sees the shared blocks as taken (queued), enqueues nothing for them, and each
    object is written exactly once."""
    toks = np.arange(16, dtype=np.uint32)  # 4 blocks of 4
    with open_tier(tmp_path / "root") as tier:
        tier.writer.hold()
        pool, alloc = FakePool(), FakeAllocator()
        ids = np.array([alloc.allocate() for _ in range(4)], np.int32)
        for i, b in enumerate(ids):
            pool.fill(int(b), i)
        first = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                             extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert (first.blocks, first.enqueued, first.stop) == (4, 4, CaptureStop.END)
        again = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                             extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert (again.blocks, again.enqueued, again.stop) == (4, 0, CaptureStop.END)
        tier.writer.release()
        assert tier.drain(5.0)
        s = tier.stats()
        assert (s.enqueued, s.write_errors) == (4, 0)
        assert len(os.listdir(tmp_path / "root")) == 4
        assert not any(tier.writer.is_queued(k) for k in os.listdir(tmp_path / "root"))
        # Committed keys leave the queued set; the index answers for them now.
        third = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                             extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert (third.blocks, third.enqueued) == (4, 0)


def test_a_failed_write_leaves_the_key_free_for_a_later_walk(tmp_path):
    toks = np.arange(4, dtype=np.uint32)
    with open_tier(tmp_path / "root") as tier:
        pool, alloc = FakePool(), FakeAllocator()
        ids = np.array([alloc.allocate()], np.int32)
        tier.writer.fail_next_jobs = 1
        out = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                           extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert out.enqueued == 1
        assert not tier.drain(5.0)
        assert tier.stats().write_errors == 1
        out = tier.capture(tokens=toks, block_ids=ids, hashes=None, cache_salt=0,
                           extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert out.enqueued == 1 and tier.drain(5.0)
        assert len(os.listdir(tmp_path / "root")) == 1


def test_a_dropped_or_failed_capture_returns_its_buffer_for_reuse(tmp_path):
    """A capture buffer is a fresh ~slab-sized array otherwise: page faults on the
    inference thread exactly when the disk is behind (queue drops) or a read fails."""
    from pagedkv.cold import DEFAULT_FORMAT
    from pagedkv.cold.capture import capture_and_enqueue_before
    from pagedkv.cold.codec import BlockGeometry
    pool = FakePool()
    no_refcounts = object()  # an allocator without incref: the block is not held
    geometry = BlockGeometry.of(pool.geometry)
    keys = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, TOKENS_12, geometry.block_size)
    with open_tier(tmp_path / "root", queue_depth=1) as tier:
        writer = tier.writer
        writer.hold()

        def capture(i):
            return capture_and_enqueue_before(
                tier, pool, no_refcounts, i, keys[i], TOKENS_12[4 * i:4 * i + 4],
                time.monotonic(), fingerprint_hex=FP.hex(), geometry=geometry)

        assert capture(0) is True          # fills the queue (depth 1)
        assert len(writer._spare) == 0
        assert capture(1) is False         # dropped: its buffer goes back
        assert len(writer._spare) == 1
        spare = writer._spare[0]
        pool.fail_reads = True
        with pytest.raises(RuntimeError, match="injected pool read failure"):
            capture(2)
        assert writer._spare == [spare]    # the same buffer was taken and given back
        writer.release()
        assert tier.drain(5.0)


def test_a_capture_of_a_block_it_cannot_hold_returns_its_buffer(tmp_path, stub_device):
    """Found by a review: a capture of a block id its allocator cannot hold (a free,
    unpinned block: InvariantViolation from incref; an id out of range: InvalidArgument)
    raised before the pool read, outside the try that gives the taken buffer back, so the
    buffer was lost for reuse (a fresh ~slab-sized array on the inference thread next time,
    against the rule above). It raises the same errors, enqueues nothing and gives the
    buffer back now. Run on a device pool (the HIP stub) with a real allocator."""
    from pagedkv.allocator import BlockAllocator
    from pagedkv.cold import DEFAULT_FORMAT
    from pagedkv.cold.capture import capture_and_enqueue_before
    from pagedkv.cold.codec import BlockGeometry
    from pagedkv.errors import InvalidArgument, InvariantViolation
    from pagedkv.pool import LayerKVPool, PoolGeometry
    pool = LayerKVPool(PoolGeometry(2, 1, 8, 4, "float16"), 4, backend="device")
    alloc = BlockAllocator(4, 4, 4, hash_seed=0)
    held = alloc.allocate()
    free = next(b for b in range(1, 4) if b != held)
    geometry = BlockGeometry.of(pool.geometry)
    keys = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, TOKENS_12, geometry.block_size)
    with open_tier(tmp_path / "root") as tier:
        writer = tier.writer
        writer.hold()
        for block_id, error in ((free, InvariantViolation), (4, InvalidArgument),
                                (-1, InvalidArgument)):
            spare = list(writer._spare)
            with pytest.raises(error):
                capture_and_enqueue_before(tier, pool, alloc, block_id, keys[0],
                                           TOKENS_12[:4], time.monotonic() + 1,
                                           fingerprint_hex=FP.hex(), geometry=geometry)
            assert len(writer._spare) == len(spare) + (0 if spare else 1)
        assert tier.stats().enqueued == 0 and alloc.ref_count(held) == 1
        assert capture_and_enqueue_before(tier, pool, alloc, held, keys[0], TOKENS_12[:4],
                                          time.monotonic() + 1, fingerprint_hex=FP.hex(),
                                          geometry=geometry)
        assert alloc.ref_count(held) == 1
        writer.release()
        assert tier.drain(5.0)

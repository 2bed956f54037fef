"""A cold-tier binding follows its pool's KV mode across kv_adaptive steps (docs/cold.md,
"KV mode steps"; docs/kv-quant.md, "kv_adaptive"): blocks of each mode live under a
fingerprint of their own, so a step never turns valid objects of the other mode into
"corruptions" that are pruned."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from cold_support import FP, SPEC_GEOMETRY, FakeAllocator, FakePool, open_tier
from pagedkv.cold import DEFAULT_FORMAT, ColdGroup, cold_key_chain
from pagedkv.cold.capture import CaptureStop
from pagedkv.cold.fingerprint import kv_mode_fingerprint
from pagedkv.kv_adaptive import KVAdaptive

BS = 16


def _adaptive():
    ad = KVAdaptive.create("balanced", num_layers=1, num_kv_heads=1, head_dim=256,
                           block_size=BS, max_seq=512, hash_seed=0)
    return ad


def _fill(pool, block_id, seed):
    vals = np.random.default_rng(seed).standard_normal((BS, 1, 256)).astype(np.float32)
    pool.write_tokens(0, block_id * BS + np.arange(BS), vals, vals)


def _capture(ctx, pool, block_id, tokens):
    alloc = FakeAllocator(num_blocks=pool.num_blocks, block_size=BS)
    alloc.ref[block_id] = 1
    out = ctx.capture(tokens=tokens, block_ids=np.array([block_id], np.int32), hashes=None,
                      cache_salt=0, extra_keys_per_block=None, pool=pool, allocator=alloc)
    assert ctx.drain(5.0)
    return out


def _restore(ctx, pool, tokens):
    alloc = FakeAllocator(num_blocks=pool.num_blocks, block_size=BS)
    got = ctx.restore(tokens=tokens, hot_blocks=np.empty(0, np.int32), cache_salt=0,
                      extra_keys_per_block=None, pool=pool, allocator=alloc)
    return got.block_ids


def _key(fp, tokens):
    return cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, fp, tokens, BS)[0]


def test_a_step_moves_the_binding_to_a_fingerprint_of_the_new_mode(tmp_path, caplog):
    old_toks = np.arange(BS, dtype=np.uint32)
    new_toks = np.arange(100, 100 + BS, dtype=np.uint32)
    ad = _adaptive()
    pool, start = ad.pool, ad.pool.geometry
    with open_tier(tmp_path) as tier:
        ctx = tier.for_model(FP, geometry=start)
        assert ctx.fingerprint_at(start) == FP
        _fill(pool, 0, 0)
        assert _capture(ctx, pool, 0, old_toks).enqueued == 1
        assert tier.contains(_key(FP, old_toks))
        old_bytes = pool.read_block(0).copy()

        ad.before_append(0, ad.plan.thresholds[0] + 1)
        assert pool.geometry.dtype == "fwht4/lloyd4"
        stepped = ctx.fingerprint_at(pool.geometry)
        assert stepped != FP
        assert stepped == kv_mode_fingerprint(DEFAULT_FORMAT, FP, start, pool.geometry)

        # The old-mode object is a plain miss now: not pruned, no corruption counted.
        with caplog.at_level(logging.WARNING, logger="pagedkv.cold"):
            assert len(_restore(ctx, pool, old_toks)) == 0
        assert "pruned" not in caplog.text
        assert tier.stats().corruptions == 0
        assert tier.contains(_key(FP, old_toks))

        # A capture after the step lands under the new mode's fingerprint only.
        _fill(pool, 1, 1)
        assert _capture(ctx, pool, 1, new_toks).enqueued == 1
        assert tier.contains(_key(stepped, new_toks))
        assert not tier.contains(_key(FP, new_toks))
        new_bytes = pool.read_block(1).copy()
        assert tier.load_block(_key(stepped, new_toks), pool.geometry,
                               fingerprint=stepped) is not None
        assert tier.stats().corruptions == 0

    # A fresh process at the start mode still hits its objects, and misses the stepped
    # process's without pruning them.
    ad2 = _adaptive()
    with open_tier(tmp_path) as tier:
        ctx = tier.for_model(FP, geometry=ad2.pool.geometry)
        ids = _restore(ctx, ad2.pool, old_toks)
        assert len(ids) == 1
        np.testing.assert_array_equal(ad2.pool.read_block(int(ids[0])), old_bytes)
        assert len(_restore(ctx, ad2.pool, new_toks)) == 0
        assert tier.stats().corruptions == 0
        assert tier.contains(_key(stepped, new_toks))
        # ... and once it steps too, it finds what the first process stored after its step.
        ad2.before_append(0, ad2.plan.thresholds[0] + 1)
        ids = _restore(ctx, ad2.pool, new_toks)
        assert len(ids) == 1
        np.testing.assert_array_equal(ad2.pool.read_block(int(ids[0])), new_bytes)
        assert tier.stats().corruptions == 0


def test_a_genuinely_corrupt_object_is_still_counted_and_pruned(tmp_path):
    toks = np.arange(BS, dtype=np.uint32)
    ad = _adaptive()
    with open_tier(tmp_path) as tier:
        ctx = tier.for_model(FP, geometry=ad.pool.geometry)
        _fill(ad.pool, 0, 0)
        _capture(ctx, ad.pool, 0, toks)
        files = list(tmp_path.rglob("*.safetensors"))
        assert len(files) == 1
        data = bytearray(files[0].read_bytes())
        data[-1] ^= 0xFF  # a payload byte: the checksum fails
        files[0].write_bytes(bytes(data))
        assert len(_restore(ctx, ad.pool, toks)) == 0
        assert tier.stats().corruptions == 1
        assert not tier.contains(_key(FP, toks))


def test_a_pool_that_changes_mode_during_the_read_publishes_nothing(tmp_path):
    # The capture reads the pool's geometry once; a step between that read and a block
    # read must not publish the block under the fingerprint of the mode it left (steps
    # here keep the buffer shape, so only the geometry check can tell).
    class SteppingPool(FakePool):
        def read_block(self, block_id, out=None):
            got = super().read_block(block_id, out)
            self.geometry = dataclasses.replace(SPEC_GEOMETRY, dtype="bfloat16")
            return got

    pool = SteppingPool()
    pool.fill(0, 0)
    toks = np.arange(SPEC_GEOMETRY.block_size, dtype=np.uint32)
    with open_tier(tmp_path) as tier:
        ctx = tier.for_model(FP, geometry=SPEC_GEOMETRY)
        alloc = FakeAllocator(block_size=SPEC_GEOMETRY.block_size)
        b = alloc.allocate()
        out = ctx.capture(tokens=toks, block_ids=np.array([b], np.int32), hashes=None,
                          cache_salt=0, extra_keys_per_block=None, pool=pool, allocator=alloc)
        assert tier.drain(5.0)
        assert out.stop is CaptureStop.ERROR and out.enqueued == 0
        assert tier.stats().bytes_written == 0
        assert alloc.ref[b] == 1  # the hold is released

"""The cold tier behind the real allocator, pool and adapter (docs/contracts/cold-tier.md, '8.
Capture and restore walks'; R2, R5, R7, docs/contracts/cold-tier.md, '15. Acceptance scenarios'
pool)."""

from __future__ import annotations

import numpy as np

from cold_support import open_tier
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.cold import CaptureStop
from pagedkv.pool import LayerKVPool, PoolGeometry

GEOM = PoolGeometry(2, 1, 8, 4, "float16")  # docs/contracts/cold-tier.md, '15. Acceptance scenarios': 64-byte slabs


def _adapter(tier, num_blocks=64):
    pool = LayerKVPool(GEOM, num_blocks)
    alloc = BlockAllocator(num_blocks, block_size=4, hash_seed=0)
    return PagedKVCacheAdapter(alloc, pool, cold=tier), pool, alloc


def _fill(adapter, seq, tokens, seed=0):
    """A request that writes random K/V for ``tokens`` and registers its full blocks."""
    adapter.reset_for_new_request(seq)
    hit = adapter.find_cached_prefix(seq, tokens)
    adapter.allocate_suffix_blocks(seq, len(tokens))
    new = tokens[hit.cached_tokens:]
    adapter.record_tokens(seq, new)
    rng = np.random.default_rng(seed)
    for layer in range(GEOM.num_layers):
        k = rng.standard_normal((len(new), 1, 8)).astype(np.float16)
        v = rng.standard_normal((len(new), 1, 8)).astype(np.float16)
        adapter.write_kv(seq, layer, k, v)
    return hit


def _slabs(pool, adapter, seq):
    return np.stack([pool.read_block(int(b)) for b in adapter.block_table(seq)])


def test_find_cached_prefix_restores_a_persisted_prefix_on_a_fresh_adapter(tmp_path):
    toks = np.arange(1, 13, dtype=np.uint32)  # 3 full blocks
    with open_tier(tmp_path / "root") as tier:
        a, pool_a, _ = _adapter(tier)
        _fill(a, "s", toks)
        assert a.register_full_blocks_for_reuse("s") == 3
        assert tier.last_capture.enqueued == 3 and tier.drain(5.0)
        slabs_a = _slabs(pool_a, a, "s")
    with open_tier(tmp_path / "root") as tier:
        b, pool_b, alloc_b = _adapter(tier)
        b.reset_for_new_request("s")
        hit = b.find_cached_prefix("s", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 3
        assert tier.stats().hits == 3 and tier.stats().corruptions == 0
        assert np.array_equal(_slabs(pool_b, b, "s"), slabs_a)
        alloc_b.check_invariants()
        b.release_request("s")
        # Published blocks are now hot: another request hits them without the disk.
        b.reset_for_new_request("t")
        hit = b.find_cached_prefix("t", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 0
        assert tier.stats().hits == 3
        alloc_b.check_invariants()


def test_capture_runs_once_per_request_and_ratchets_over_turns(tmp_path):
    toks = np.arange(1, 257, dtype=np.uint32)  # 64 full blocks
    with open_tier(tmp_path / "root") as tier:
        assert tier.install_capture_budget(16, 60000)
        a, _, _ = _adapter(tier, num_blocks=256)
        _fill(a, "s", toks)
        a.register_full_blocks_for_reuse("s")
        out = tier.last_capture
        assert (out.blocks, out.enqueued, out.stop) == (16, 16, CaptureStop.BUDGET)
        assert a.register_full_blocks_for_reuse("s") == 0
        assert tier.last_capture is out  # the second registration captured nothing
        assert tier.drain(5.0)
        a.release_request("s")
        _fill(a, "s", toks)  # the same prompt, a new request (hot hit)
        a.register_full_blocks_for_reuse("s")
        out = tier.last_capture
        assert (out.blocks, out.enqueued, out.stop) == (32, 16, CaptureStop.BUDGET)


def test_purge_suppresses_the_next_restore_once(tmp_path):
    toks = np.arange(1, 13, dtype=np.uint32)
    with open_tier(tmp_path / "root") as tier:
        a, _, _ = _adapter(tier)
        _fill(a, "s", toks)
        a.register_full_blocks_for_reuse("s")
        assert tier.drain(5.0)
        a.release_request_and_purge_prefix_cache("s")
        a.reset_for_new_request("s")
        assert a.find_cached_prefix("s", toks, skip_lookup=True).cached_tokens == 0
        a.reset_for_new_request("s")
        hit = a.find_cached_prefix("s", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 3
        a.release_request_and_purge_prefix_cache("s")
        a.reset_for_new_request("s")
        assert a.find_cached_prefix("s", toks).cached_tokens == 0
        a.reset_for_new_request("s")
        assert a.find_cached_prefix("s", toks).cached_tokens == 12


def test_restarting_a_restored_prepared_turn_cold_counts_restore_suppressed(tmp_path):
    from pagedkv.cold.stats import sidecar_counters

    toks = np.arange(1, 13, dtype=np.uint32)
    counter = sidecar_counters()
    with open_tier(tmp_path / "root") as tier:
        a, _, _ = _adapter(tier)
        _fill(a, "s", toks)
        a.register_full_blocks_for_reuse("s")
        assert tier.drain(5.0)
    with open_tier(tmp_path / "root") as tier:
        b, _, alloc = _adapter(tier)
        b.reset_for_new_request("s")
        assert len(b.find_cached_prefix("s", toks).restored_blocks) == 3
        before = counter.get("restore_suppressed")
        # The restored hit is thrown away: a forced miss, the whole prompt allocated anew.
        assert b.restart_prepared_turn_cold("s", toks, len(toks)) == 3
        assert b.cached_token_count("s") == 0
        assert counter.get("restore_suppressed") == before + 1
        alloc.check_invariants()
        # A hot hit (nothing restored) thrown away the same way is not a suppressed restore.
        b.release_request("s")
        _fill(b, "t", toks)
        b.register_full_blocks_for_reuse("t")
        b.reset_for_new_request("u")
        hit = b.find_cached_prefix("u", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 0
        b.restart_prepared_turn_cold("u", toks, len(toks))
        assert counter.get("restore_suppressed") == before + 1
        alloc.check_invariants()


def test_a_device_pool_captures_to_and_restores_from_the_cold_tier(tmp_path, stub_device):
    """Block I/O of a device pool (docs/pool.md, "Device backend") behind the cold tier:
    capture reads each registered block's bytes through the slab kernel and one copy to
    the host; restore uploads and publishes (on the HIP stub, whose memory is host
    memory); the restored bytes equal a NumPy pool's capture of the same request."""
    toks = np.arange(1, 13, dtype=np.uint32)
    with open_tier(tmp_path / "host") as tier:
        a, pool_a, _ = _adapter(tier)
        _fill(a, "s", toks, seed=3)
        a.register_full_blocks_for_reuse("s")
        assert tier.drain(5.0)
        want = _slabs(pool_a, a, "s")
    with open_tier(tmp_path / "root") as tier:
        pool = LayerKVPool(GEOM, 64, backend="device")
        d = PagedKVCacheAdapter(BlockAllocator(64, block_size=4, hash_seed=0), pool,
                                cold=tier)
        _fill(d, "s", toks, seed=3)
        assert d.register_full_blocks_for_reuse("s") == 3
        assert tier.last_capture.enqueued == 3 and tier.drain(5.0)
        assert np.array_equal(_slabs(pool, d, "s"), want)
    with open_tier(tmp_path / "root") as tier:
        pool = LayerKVPool(GEOM, 64, backend="device")
        alloc = BlockAllocator(64, block_size=4, hash_seed=0)
        r = PagedKVCacheAdapter(alloc, pool, cold=tier)
        r.reset_for_new_request("s")
        hit = r.find_cached_prefix("s", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 3
        assert np.array_equal(_slabs(pool, r, "s"), want)
        k, _ = r.gather_kv("s", 1)  # the restored K of layer 1, on the device
        assert k.to_numpy().tobytes() == want[:, 1, 0].tobytes()
        alloc.check_invariants()

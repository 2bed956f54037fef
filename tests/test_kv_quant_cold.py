"""The cold tier stores compressed KV blocks as they are (docs/kv-quant.md "Pools"): the
KV dtype in the object's metadata and in the fingerprint, K and V slabs of their own sizes,
restore byte for byte, a forged dtype refused."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from cold_support import open_tier
from pagedkv import errors
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.cold import BlockGeometry
from pagedkv.cold.codec import decode_block, encode_block, kv_slab_bytes
from pagedkv.cold.fingerprint import geometry_part
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.quant import kv

TAG = b"pagedkv-v1\0cold-cache-payload"


def _adapter(tier, geometry, num_blocks=32):
    pool = LayerKVPool(geometry, num_blocks)
    alloc = BlockAllocator(num_blocks, block_size=geometry.block_size, hash_seed=0)
    return PagedKVCacheAdapter(alloc, pool, cold=tier), pool


def _fill(adapter, geometry, seq, tokens, seed=0):
    adapter.reset_for_new_request(seq)
    hit = adapter.find_cached_prefix(seq, tokens)
    adapter.allocate_suffix_blocks(seq, len(tokens))
    new = tokens[hit.cached_tokens:]
    adapter.record_tokens(seq, new)
    rng = np.random.default_rng(seed)
    shape = (len(new), geometry.num_kv_heads, geometry.head_dim)
    for layer in range(geometry.num_layers):
        adapter.write_kv(seq, layer, rng.standard_normal(shape).astype(np.float32),
                         rng.standard_normal(shape).astype(np.float32))
    return hit


@pytest.mark.parametrize("dtype,hd", [("fwht4/q8", 128), ("fwht4/lloyd4", 256),
                                      ("fwht3/lloyd2", 256), ("fwht4/fwht4", 128),
                                      ("fwht4/fwht2", 128)])
def test_compressed_blocks_persist_as_they_are_and_restore_byte_for_byte(tmp_path, dtype, hd):
    g = PoolGeometry(2, 2, hd, 4, dtype)
    toks = np.arange(1, 13, dtype=np.uint32)
    with open_tier(tmp_path / "root") as tier:
        a, pool_a = _adapter(tier, g)
        _fill(a, g, "s", toks)
        assert a.register_full_blocks_for_reuse("s") == 3
        assert tier.drain(5.0)
        slabs = [pool_a.read_block(int(b)) for b in a.block_table("s")]
    files = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp_path / "root") for f in fs
             if f.endswith(".safetensors")]
    assert len(files) == 3
    ks, vs = g.k_slab_bytes, g.v_slab_bytes
    with safe_open(files[0], "numpy") as f:  # the safetensors library reads what we wrote
        meta = f.metadata()
        assert meta["dtype"] == dtype
        assert (int(meta["key_bytes"]), int(meta["value_bytes"])) == (ks, vs)
        assert f.get_tensor("layer.1.key").shape == (ks,)
        assert f.get_tensor("layer.1.value").shape == (vs,)
        key = f.get_tensor("layer.0.key")
    assert any(np.array_equal(key, s.reshape(2, -1)[0, :ks]) for s in slabs)
    with open_tier(tmp_path / "root") as tier:
        b, pool_b = _adapter(tier, g)
        b.reset_for_new_request("s")
        hit = b.find_cached_prefix("s", toks)
        assert hit.cached_tokens == 12 and len(hit.restored_blocks) == 3
        assert tier.stats().corruptions == 0
        for blk, want in zip(b.block_table("s"), slabs, strict=True):
            np.testing.assert_array_equal(pool_b.read_block(int(blk)), want)
        rk, rv = b.gather_kv("s", 0)
        dk, dv = pool_b.decode_tokens(rk, rv)
        assert dk.shape == dv.shape == (12, 2, hd) and np.isfinite(dk).all()


def test_the_kv_dtype_is_part_of_the_fingerprint_and_the_geometry():
    parts = {d: geometry_part(PoolGeometry(2, 2, 256, 16, d))
             for d in ("q8", "fwht4/q8", "fwht4/lloyd4", "fwht2/lloyd4", "bfloat16")}
    assert len(set(parts.values())) == len(parts)
    assert parts["fwht4/lloyd4"].endswith(b"fwht4/lloyd4\0nhd")
    a = BlockGeometry.of(PoolGeometry(2, 2, 256, 16, "fwht4/q8"))
    assert (a.key_bytes, a.value_bytes, a.slab_bytes) == (16 * 2 * 132, 16 * 2 * 272, 0)
    assert a.buffer_shape == (2, 16 * 2 * 404)
    assert a.bytes_per_block == 2 * 16 * 2 * 404
    assert a != BlockGeometry.of(PoolGeometry(2, 2, 256, 16, "fwht4/lloyd4"))
    sym = BlockGeometry(16, 2, 2, 256, "fwht4/lloyd4")
    assert sym.slab_bytes == 16 * 2 * 132 and sym.buffer_shape == (2, 2, 16 * 2 * 132)
    assert kv_slab_bytes(4, 1, 128, "fwht3/q8") == (0, 0)
    with pytest.raises(errors.InvalidArgument, match="cannot be stored as fwht3/q8"):
        BlockGeometry(4, 1, 1, 128, "fwht3/q8")
    with pytest.raises(errors.InvalidArgument, match="'<K mode>/<V mode>'"):
        BlockGeometry(4, 1, 1, 128, "fwht9/q8")


def test_a_forged_dtype_or_slab_length_is_refused():
    g = BlockGeometry(4, 1, 1, 128, "fwht4/q8")
    tokens = np.arange(4, dtype=np.uint32)
    buf = np.random.default_rng(0).integers(0, 256, g.buffer_shape, dtype=np.uint8)
    header, tok, payload = encode_block("pagedkv-v1", TAG, "a" * 64, "b" * 64, g, tokens, buf)
    obj = bytes(header) + bytes(tok) + bytes(payload)
    out = decode_block(obj, abi="pagedkv-v1", checksum_tag=TAG, expected=g)
    np.testing.assert_array_equal(out.payload, buf)
    # the same bytes claimed as fwht2/q8: the slab lengths no longer match the tensors
    n = int.from_bytes(obj[:8], "little")
    js = json.loads(obj[8:8 + n])
    js["__metadata__"]["dtype"] = "fwht2/q8"
    forged = json.dumps(js, separators=(",", ":")).encode()
    forged += b" " * ((8 - len(forged) % 8) % 8)
    obj2 = len(forged).to_bytes(8, "little") + forged + obj[8 + n:]
    with pytest.raises(errors.SizeMismatch, match="key_bytes/value_bytes"):
        decode_block(obj2, abi="pagedkv-v1", checksum_tag=TAG)
    js["__metadata__"]["dtype"] = "lloyd4/q8"
    forged = json.dumps(js, separators=(",", ":")).encode()
    forged += b" " * ((8 - len(forged) % 8) % 8)
    obj3 = len(forged).to_bytes(8, "little") + forged + obj[8 + n:]
    with pytest.raises(errors.BadMetadata, match="metadata dtype"):
        decode_block(obj3, abi="pagedkv-v1", checksum_tag=TAG)
    # a pool of another dtype never takes it
    with pytest.raises(errors.SizeMismatch):
        decode_block(obj, abi="pagedkv-v1", checksum_tag=TAG,
                     expected=BlockGeometry(4, 1, 1, 128, "fwht2/q8"))
    assert kv.split_kv_dtype(out.geometry.dtype) == ("fwht4", "q8")

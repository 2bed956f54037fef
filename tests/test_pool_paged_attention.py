"""LayerKVPool.paged_attention: decode attention read straight from the pool (MLX pools
through pagedkv.kernels.mlx.paged_attention, NumPy pools through the float64 reference),
on tables built by the adapter, against the reference; a stale generation is refused."""

from __future__ import annotations

import numpy as np
import pytest

from mlx_kernel_cases import fresh_rng
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import InvalidArgument, StaleBlockTable
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.pool import LayerKVPool, PoolGeometry

mx = pytest.importorskip("mlx.core")


def _tokens(rng, geometry: PoolGeometry, n: int):
    x = rng.uniform(-2, 2, (n, geometry.num_kv_heads, geometry.head_dim)).astype(np.float32)
    if geometry.dtype == "q8":
        return ref.kv_q8_quantize(x)
    if geometry.dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x.astype(geometry.storage_dtype)


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8", "float32"])
def test_pool_paged_attention_on_adapter_tables_matches_the_reference(backend, dtype):
    rng, seed = fresh_rng()
    g = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    pool = LayerKVPool(g, 64, backend=backend)
    adapter = PagedKVCacheAdapter(BlockAllocator(64, None, 16, hash_seed=0), pool)
    lens = [int(rng.integers(1, 300)), int(rng.integers(1, 40)), 16]
    seq_ids = []
    for i, n in enumerate(lens):
        sid = f"s{i}"
        prompt = rng.integers(0, 30000, n)
        adapter.reset_for_new_request(sid)
        adapter.allocate_suffix_blocks(sid, n)
        adapter.record_tokens(sid, prompt)
        seq_ids.append(sid)
    batch = adapter.prepare_decode(seq_ids)
    layer = 1
    k_all, v_all = {}, {}
    for sid, n, table in zip(seq_ids, batch.seq_lens, batch.block_tables, strict=True):
        k, v = _tokens(rng, g, int(n)), _tokens(rng, g, int(n))
        slots = pool.slots_for_positions(table, np.arange(n), generation=batch.generation)
        pool.write_tokens(layer, slots, k, v, generation=batch.generation)
        k_all[sid], v_all[sid] = k, v
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    got = pool.paged_attention(layer, q if backend == "numpy" else mx.array(q),
                               batch.block_tables, batch.seq_lens, generation=batch.generation)
    kp, vp = pool.layer(layer)
    if backend == "mlx":  # bfloat16 leaves MLX as its uint16 bits
        kp, vp = (np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in (kp, vp))
    expect = ref.paged_attention_decode(q, kp, vp, batch.block_tables, batch.seq_lens,
                                        kv_dtype=dtype, scale=64 ** -0.5)
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-4, atol=2e-5,
                               err_msg=f"seed {seed}")
    with pytest.raises(StaleBlockTable):
        pool.paged_attention(layer, q, batch.block_tables, batch.seq_lens,
                             generation=batch.generation + 1)
    with pytest.raises(InvalidArgument, match="layer: 2 is out of range"):
        pool.paged_attention(2, q, batch.block_tables, batch.seq_lens)


def test_kv_mode_pair_pool_checks_q_and_scale_like_the_other_pools():
    """Found by a review: an MLX pool of a ``<K>/<V>`` KV-mode pair converted ``q`` with
    ``np.asarray(q, float32)`` (a float64 or integer q was cast, a list taken) and ``scale``
    with ``float()`` (``"x"`` raised a bare ValueError, NaN made every output NaN, True was
    1.0), where the other pools refuse them with pagedkv errors."""
    from pagedkv.errors import InvalidArgumentType
    g = PoolGeometry(num_layers=1, num_kv_heads=2, head_dim=128, block_size=16,
                     dtype="fwht4/q8")
    pool = LayerKVPool(g, 8, backend="mlx")
    tables, lens = np.array([[0, 1, -1]], np.int32), np.array([20], np.int32)
    q = mx.zeros((1, 4, 128))
    for scale, error in (("x", InvalidArgumentType), (True, InvalidArgumentType),
                         (float("nan"), InvalidArgument)):
        with pytest.raises(error, match=f"scale={scale!r}"):
            pool.paged_attention(0, q, tables, lens, scale=scale)
    with pytest.raises(InvalidArgument, match="q: dtype float64"):
        pool.paged_attention(0, np.zeros((1, 4, 128)), tables, lens)
    with pytest.raises(InvalidArgument, match="q: dtype mlx.core.int32"):
        pool.paged_attention(0, mx.zeros((1, 4, 128), dtype=mx.int32), tables, lens)
    with pytest.raises(InvalidArgumentType, match="q: expected an mx.array"):
        pool.paged_attention(0, [[[0.0] * 128] * 4], tables, lens)
    assert pool.paged_attention(0, q, tables, lens, scale=0.1).shape == (1, 4, 128)


def test_kv_mode_pair_pool_names_the_type_of_a_list_table():
    """Found by a review: Python lists for the block tables or lengths of an MLX KV-mode pair
    pool were refused as "int64[1, 3], expected int32[seqs, width]", naming a dtype the
    caller never passed. The message names the list and the array type expected now. (Its
    GQA of 16 query heads per KV head is no defect: this path is MLX array ops, not the
    g1..g8 kernels, and matches the NumPy reference.)"""
    g = PoolGeometry(num_layers=1, num_kv_heads=1, head_dim=128, block_size=16,
                     dtype="fwht4/q8")
    pools = [LayerKVPool(g, 4, backend="mlx"), LayerKVPool(g, 4)]
    rng, seed = fresh_rng()
    vals = rng.standard_normal((20, 1, 128)).astype(np.float32)
    for pool in pools:
        pool.write_tokens(0, np.arange(20), vals, vals)
    tables, lens = np.array([[0, 1, -1]], np.int32), np.array([20], np.int32)
    q = rng.standard_normal((1, 16, 128)).astype(np.float32)
    with pytest.raises(InvalidArgument, match=r"block_tables: a list \(as an array "
                                              r"int64\[1, 3\]\), expected an int32\[seqs, "
                                              r"width\] array"):
        pools[0].paged_attention(0, mx.array(q), [[0, 1, -1]], lens)
    with pytest.raises(InvalidArgument, match=r"seq_lens: a tuple \(as an array int64\[1\]\), "
                                              r"expected an int32\[1\] array"):
        pools[0].paged_attention(0, mx.array(q), tables, (20,))
    out = np.array(pools[0].paged_attention(0, mx.array(q), tables, lens))
    np.testing.assert_allclose(out, pools[1].paged_attention(0, q, tables, lens), atol=1e-5,
                               err_msg=f"seed {seed}")

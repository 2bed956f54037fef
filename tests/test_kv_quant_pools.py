"""Pools whose K and V are KV modes (docs/kv-quant.md "Pools"): geometry and sizes, encode on
write and decode on read on the NumPy and MLX backends, block I/O between them, growth,
transcoding in place, bad input leaving the pool unchanged; the MLX codecs byte-equal to
the Cython ones."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedkv import errors
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.quant import kv
from pagedkv.sizing import blocks_for_memory_mb

HAVE_MLX = importlib.util.find_spec("mlx") is not None
BACKENDS = ["numpy", pytest.param("mlx", marks=pytest.mark.skipif(not HAVE_MLX,
                                                                   reason="MLX not installed"))]
RNG = np.random.default_rng()
CASES = [("q8", 64), ("fwht4/q8", 128), ("fwht2/q8", 128), ("fwht4/lloyd4", 256),
         ("fwht3/lloyd2", 256), ("fwht4/lloyd3", 256), ("q8/q8", 128),
         # fwht modes on V (pagedkv's extension): head_dim 128's sub-8-bit V
         ("fwht4/fwht4", 128), ("fwht2/fwht4", 128), ("fwht4/fwht2", 128),
         ("lloyd4/fwht3", 256)]


def _np(x):
    return np.array(x)


def test_bytes_per_token_and_head_follow_the_record_layouts():
    # docs/kv-quant.md "Record layouts" / kv_adaptive: bytes per (token, kv-head), K + V, hd 256
    per_head = {"fwht4/q8": 404, "fwht3/q8": 372, "fwht3/lloyd4": 232, "fwht3/lloyd3": 200,
                "fwht3/lloyd2": 168, "fwht2/lloyd2": 136, "fwht4/lloyd4": 264,
                "fwht2/lloyd4": 200, "q8": 544, "bfloat16": 1024}
    for dtype, n in per_head.items():
        g = PoolGeometry(3, 2, 256, 16, dtype)
        assert g.k_row_bytes + g.v_row_bytes == n
        assert g.bytes_per_token == 3 * 2 * n
        assert g.bytes_per_block == 16 * 3 * 2 * n
    g = PoolGeometry(32, 8, 128, 16, "fwht4/q8")
    assert (g.k_row_bytes, g.v_row_bytes, g.symmetric) == (68, 136, False)
    assert g.block_buffer_shape == (32, 16 * 8 * (68 + 136))
    assert g.itemsize == (68 + 136) / 256
    with pytest.raises(errors.InvalidArgument, match="use k_row_bytes / v_row_bytes"):
        _ = g.row_bytes
    assert blocks_for_memory_mb(1, g) == (1 << 20) // (32 * 16 * 8 * 204)
    sym = PoolGeometry(2, 1, 256, 16, "fwht4/lloyd4")
    assert sym.symmetric and sym.block_buffer_shape == (2, 2, 16 * 132)


@pytest.mark.parametrize("dtype,hd,match", [
    ("fwht3/q8", 128, "fwht3 needs head_dim 256"), ("fwht4/lloyd4", 128, "lloyd4 needs"),
    ("fwht4/q8", 96, "fwht4 needs head_dim 128 or 256"), ("q8/lloyd4", 256, "rotated K"),
    ("fwht4", 128, "name both sides")])
def test_geometry_refuses_what_a_mode_cannot_store(dtype, hd, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        PoolGeometry(2, 2, hd, 16, dtype)


def _fill(pool, n_tokens=13, layer=1, seed=None):
    g = pool.geometry
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n_tokens, g.num_kv_heads, g.head_dim)).astype(np.float32)
    v = rng.standard_normal((n_tokens, g.num_kv_heads, g.head_dim)).astype(np.float32)
    slots = rng.permutation(pool.num_slots)[:n_tokens].astype(np.int64)
    pool.write_tokens(layer, slots, k, v)
    return slots, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,hd", CASES)
def test_values_are_encoded_on_write_and_decoded_on_read(backend, dtype, hd):
    g = PoolGeometry(2, 3, hd, 4, dtype)
    pool = LayerKVPool(g, num_blocks=6, backend=backend)
    slots, k, v = _fill(pool)
    table = np.arange(6, dtype=np.int32)
    rk, rv = pool.gather(1, table, 24)
    np.testing.assert_array_equal(_np(rk)[slots], kv.encode(k, g.k_dtype))
    np.testing.assert_array_equal(_np(rv)[slots], kv.encode(v, g.v_dtype))
    dk, dv = pool.decode_tokens(rk, rv)
    np.testing.assert_array_equal(_np(dk)[slots], kv.decode(kv.encode(k, g.k_dtype), g.k_dtype, hd))
    np.testing.assert_array_equal(_np(dv)[slots], kv.decode(kv.encode(v, g.v_dtype), g.v_dtype, hd))
    # float16 values encode like their float32 widening; records are written as they are
    pool.write_tokens(0, slots[:2], k[:2].astype(np.float16), v[:2].astype(np.float16))
    gk, _ = pool.gather(0, table, 24)
    np.testing.assert_array_equal(_np(gk)[slots[:2]],
                                  kv.encode(k[:2].astype(np.float16).astype(np.float32), g.k_dtype))
    recs = (kv.encode(k[:3], g.k_dtype), kv.encode(v[:3], g.v_dtype))
    pool.write_tokens(0, slots[5:8], *recs)
    gk, gv = pool.gather(0, table, 24)
    np.testing.assert_array_equal(_np(gk)[slots[5:8]], recs[0])
    np.testing.assert_array_equal(_np(gv)[slots[5:8]], recs[1])
    # all layers at once
    kl = np.stack([k, k[::-1]])
    vl = np.stack([v, v[::-1]])
    pool.write_tokens_layers(slots, kl, vl)
    lk, lv = pool.gather_layers(table, 24)
    np.testing.assert_array_equal(_np(lk)[:, slots], kv.encode(kl, g.k_dtype))
    np.testing.assert_array_equal(_np(lv)[:, slots], kv.encode(vl, g.v_dtype))
    if isinstance(lk, np.ndarray):  # pool.gather_layers: every layer's slice C-contiguous
        # (split K/V storage returned token-major arrays before)
        assert all(x[i].flags.c_contiguous for x in (lk, lv) for i in range(g.num_layers))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "fwht4/q8"])
def test_decode_tokens_returns_float32_values_for_every_pool_dtype(backend, dtype):
    """``decode_tokens`` says float32 values: an MLX bfloat16 or float16 pool (and a NumPy
    float16 pool) returned its own dtype (found by a review). Unquantized values widen
    exactly; records decode as the codec does."""
    from pagedkv.pool.bfloat16 import float32_to_bf16_bits
    pool = LayerKVPool(PoolGeometry(1, 2, 128, 4, dtype), num_blocks=2, backend=backend)
    x = (np.arange(3 * 2 * 128, dtype=np.float32).reshape(3, 2, 128) % 97 - 48) / 4
    if dtype == "bfloat16" and backend == "numpy":
        k, v = float32_to_bf16_bits(x), float32_to_bf16_bits(-x)
    elif dtype == "bfloat16":
        import mlx.core as mx
        k, v = mx.array(x).astype(mx.bfloat16), mx.array(-x).astype(mx.bfloat16)
    else:
        k, v = (x, -x) if dtype != "float16" else (x.astype(np.float16), -x.astype(np.float16))
    pool.write_tokens(0, [4, 0, 7], k, v)
    dk, dv = pool.decode_tokens(*pool.gather(0, np.array([1, 0], np.int32), 8))
    assert (str(dk.dtype), str(dv.dtype)) == (("float32",) * 2 if backend == "numpy"
                                              else ("mlx.core.float32",) * 2)
    assert _np(dk).shape == _np(dv).shape == (8, 2, 128)
    want = kv.decode(kv.encode(x, "fwht4"), "fwht4", 128) if dtype == "fwht4/q8" else x
    np.testing.assert_array_equal(_np(dk)[[0, 4, 3]], want)  # slots 4, 0, 7 at 0, 4, 3
    if dtype != "fwht4/q8":  # every value here is exact in float16 and bfloat16
        np.testing.assert_array_equal(_np(dv)[[0, 4, 3]], -x)


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
@pytest.mark.parametrize("dtype,hd", CASES)
def test_mlx_values_encode_in_mlx_to_the_same_records(dtype, hd):
    import mlx.core as mx
    g = PoolGeometry(2, 3, hd, 4, dtype)
    pool = LayerKVPool(g, num_blocks=6, backend="mlx")
    k = RNG.standard_normal((5, 3, hd)).astype(np.float32)
    v = RNG.standard_normal((5, 3, hd)).astype(np.float32)
    slots = np.array([0, 3, 7, 8, 22])
    pool.write_tokens(0, slots, mx.array(k), mx.array(v).astype(mx.bfloat16))
    rk, rv = pool.gather(0, np.arange(6, dtype=np.int32), 24)
    np.testing.assert_array_equal(np.array(rk)[slots], kv.encode(k, g.k_dtype))
    bf = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(np.array(rv)[slots], kv.encode(bf, g.v_dtype))


def test_q8_blocks_whose_127_over_amax_overflows_code_to_zeros_everywhere():
    """A block with 0 < amax < ~3.7e-37: 127 / amax is +inf in float32, a zero value's code
    0 * inf = NaN, written as 0 by the CPU loop and the NumPy reference and as 127 by the
    GPU header's rounding (found by a review). Its codes are 0 in every implementation now
    (its float16 scale is 0: it decodes to 0 either way)."""
    from pagedkv.kernels import numpy_kernels
    x = np.zeros((1, 64), np.float32)
    x[0, 1], x[0, 33], x[0, 40] = 1e-38, -2e-40, 3e-37  # both blocks' 127 / amax overflow
    want = np.zeros((1, 68), np.uint8)
    np.testing.assert_array_equal(kv.encode(x, "q8"), want)
    np.testing.assert_array_equal(numpy_kernels.kv_q8_quantize(x), want)
    if HAVE_MLX:
        import mlx.core as mx
        np.testing.assert_array_equal(np.array(kv.encode(mx.array(x), "q8")), want)
    x[0, 1] = 4e-37  # 127 / amax fits float32: the contract's codes
    assert kv.encode(x, "q8")[0, 3] == 127


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
def test_mlx_q8_refuses_a_block_past_its_float16_scale_as_the_c_codec_does():
    """MLX stored an Inf scale (0x7c00; decoded NaN/Inf) where the C codec refuses (found by
    a review); an MLX pool's write then changes nothing."""
    import mlx.core as mx
    x = np.zeros((2, 64), np.float32)
    x[1, 33] = 9e6
    with pytest.raises(errors.InvalidArgument, match="block 3 .* above ~8.3e6"):
        kv.encode(x, "q8")
    with pytest.raises(errors.InvalidArgument, match="block 3 .* above ~8.3e6"):
        kv.encode(mx.array(x), "q8")
    pool = LayerKVPool(PoolGeometry(1, 1, 64, 4, "q8"), num_blocks=2, backend="mlx")
    before = pool.read_block(0).copy()
    with pytest.raises(errors.InvalidArgument, match="above ~8.3e6"):
        pool.write_tokens(0, np.array([0, 1]), mx.array(x[:, None]), mx.array(x[:, None]))
    np.testing.assert_array_equal(pool.read_block(0), before)


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
@pytest.mark.parametrize("src,dst", [("lloyd2", "lloyd4"), ("lloyd3", "lloyd4"),
                                     ("fwht2", "fwht4")])
def test_mlx_transcode_refuses_a_widening_as_the_cython_one_does(src, dst):
    """A widening within a family (lloyd2 -> lloyd4) shifted the MLX codes right by a
    negative count: a builtin ValueError from MLX where the NumPy path raises
    InvalidArgument (found by a review). Both refuse it with the same words now."""
    import mlx.core as mx
    hd = 256 if src.startswith("lloyd") else 128
    records = kv.encode(RNG.standard_normal((3, 2, hd)).astype(np.float32), src)
    want = f"{src} -> {dst}: a downshift stays in one table family and narrows the codes"
    with pytest.raises(errors.InvalidArgument, match=want):
        kv.transcode(records, src, dst, hd)
    mx_records = mx.array(records)
    with pytest.raises(errors.InvalidArgument, match=want):
        kv.transcode(mx_records, src, dst, hd)
    np.testing.assert_array_equal(np.array(mx_records), records)


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
@pytest.mark.parametrize("mode", ["q8", "fwht4"])
def test_mlx_encode_refuses_a_0d_array_as_the_cython_codecs_do(mode):
    """An ``mx.array`` scalar raised a builtin IndexError (``shape[-1]``; found by a
    review); the Cython codecs refuse a 0-d ndarray with InvalidArgument."""
    import mlx.core as mx
    with pytest.raises(errors.InvalidArgument, match="last axis"):
        kv.encode(np.zeros((), np.float32), mode)
    with pytest.raises(errors.InvalidArgument,
                       match=rf"x: shape \(\): the last axis is head_dim; {mode} KV"):
        kv.encode(mx.array(1.0), mode)


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_no_mlx_values_encode_to_no_records_as_no_numpy_values_do(backend):
    """Zero rows of ``mx.array`` values (an empty write) raised MLX's builtin ValueError
    ("Cannot infer the shape of an empty array") in encode and in a downshift, where NumPy
    values give empty records and an empty write is a no-op (found by a review)."""
    import mlx.core as mx
    for mode, shape in (("q8", (0, 128)), ("fwht4", (2, 0, 128)), ("lloyd4", (0, 256))):
        out = kv.encode(mx.zeros(shape), mode)
        assert out.dtype == mx.uint8
        assert tuple(out.shape) == kv.encode(np.zeros(shape, np.float32), mode).shape
    down = kv.transcode(mx.zeros((0, 3, 132), dtype=mx.uint8), "lloyd4", "lloyd2", 256)
    assert down.dtype == mx.uint8 and tuple(down.shape) == (0, 3, 68)
    assert tuple(kv.transcode(mx.zeros((0, 272), dtype=mx.uint8), "q8", "fwht4",
                              256).shape) == (0, 132)
    pool = LayerKVPool(PoolGeometry(1, 2, 128, 4, "fwht4/q8"), 2, backend=backend)
    k, v = RNG.standard_normal((2, 1, 2, 128)).astype(np.float32)
    pool.write_tokens(0, [5], k, v)
    before = pool.read_block(1).copy()
    empty = mx.zeros((0, 2, 128))
    pool.write_tokens(0, np.zeros(0, np.int64), empty, empty)
    np.testing.assert_array_equal(pool.read_block(1), before)
    assert pool.generation == 0


@pytest.mark.parametrize("dtype,hd", CASES)
def test_block_io_is_the_same_bytes_on_both_backends_and_survives_growth(dtype, hd):
    g = PoolGeometry(3, 2, hd, 4, dtype)
    src = LayerKVPool(g, num_blocks=3, max_num_blocks=8)
    for layer in range(3):
        _fill(src, 9, layer, seed=layer)
    blocks = [src.read_block(b) for b in range(3)]
    assert blocks[0].shape == g.block_buffer_shape
    # each layer's K slab then its V slab: the gathered records, in order
    rk, rv = src.gather(1, np.array([2], np.int32), 4)
    flat = blocks[2].reshape(3, -1)[1]
    np.testing.assert_array_equal(flat[:g.k_slab_bytes], rk.reshape(-1))
    np.testing.assert_array_equal(flat[g.k_slab_bytes:], rv.reshape(-1))
    assert src.grow_to(8)
    for b in range(3):
        np.testing.assert_array_equal(src.read_block(b), blocks[b])
    assert not src.read_block(7).any()
    backends = ["numpy"] + (["mlx"] if HAVE_MLX else [])
    for backend in backends:
        dst = LayerKVPool(g, num_blocks=4, backend=backend)
        for b in range(3):
            dst.write_block(3 - b, blocks[b])
        for b in range(3):
            np.testing.assert_array_equal(dst.read_block(3 - b), blocks[b])


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_values_leave_the_pool_unchanged(backend):
    g = PoolGeometry(2, 2, 128, 4, "fwht4/q8")
    pool = LayerKVPool(g, num_blocks=2, backend=backend)
    _fill(pool, 6, 0, seed=3)
    before = [pool.read_block(b) for b in range(2)]
    k = np.ones((2, 2, 128), np.float32)
    v = k.copy()
    v[1, 1, 100] = np.nan
    with pytest.raises(errors.InvalidArgument, match="non-finite"):
        pool.write_tokens(0, [0, 1], k, v)
    with pytest.raises(errors.InvalidArgument, match=r"expected \(2, 2, 128\).*values to encode"):
        pool.write_tokens(0, [0, 1], np.ones((2, 2, 64), np.float32), k)
    with pytest.raises(errors.InvalidArgument, match=r"expected \(2, 2, 136\)"):
        pool.write_tokens(0, [0, 1], kv.encode(k, "fwht4"), kv.encode(k, "fwht4"))
    with pytest.raises(errors.InvalidArgumentType, match="float32/float16 values to encode"):
        pool.write_tokens(0, [0, 1], k.astype(np.float64), v)
    for b in range(2):
        np.testing.assert_array_equal(pool.read_block(b), before[b])


def test_transcode_reencodes_every_block_and_refuses_bad_transitions():
    g = PoolGeometry(2, 2, 256, 4, "fwht4/q8")
    pool = LayerKVPool(g, num_blocks=3)
    for layer in range(2):
        _fill(pool, 10, layer, seed=10 + layer)
    table = np.arange(3, dtype=np.int32)
    old = [pool.gather(layer, table, 12) for layer in range(2)]
    with pytest.raises(errors.InvalidArgument, match="fwht4 -> fwht3 is not a transcode"):
        pool.transcode("fwht3/q8")
    with pytest.raises(errors.InvalidArgument, match="only a pool with layer_region_bytes"):
        pool.transcode("fwht4/lloyd4", num_blocks=5)
    assert pool.geometry.dtype == "fwht4/q8" and pool.generation == 0
    pool.transcode("fwht4/lloyd4")
    assert pool.generation == 1 and pool.geometry.dtype == "fwht4/lloyd4"
    for layer in range(2):
        k, v = pool.gather(layer, table, 12)
        np.testing.assert_array_equal(k, old[layer][0])
        np.testing.assert_array_equal(v, kv.transcode(old[layer][1], "q8", "lloyd4", 256))
    pool.transcode("fwht2/lloyd3")
    for layer in range(2):
        k, v = pool.gather(layer, table, 12)
        np.testing.assert_array_equal(k, kv.downshift(old[layer][0], "fwht4", "fwht2", 256))
        np.testing.assert_array_equal(v, kv.downshift(kv.transcode(old[layer][1], "q8", "lloyd4",
                                                                   256), "lloyd4", "lloyd3", 256))
    with pytest.raises(errors.InvalidArgument, match="lloyd3 -> lloyd4"):
        pool.transcode("fwht2/lloyd4")


def test_transcode_in_fixed_regions_gains_blocks_and_keeps_them_in_place():
    g = PoolGeometry(2, 1, 256, 4, "fwht4/q8")
    per_layer = 10 * (g.k_slab_bytes + g.v_slab_bytes)  # room for 10 start-tier blocks
    pool = LayerKVPool(g, num_blocks=10, layer_region_bytes=per_layer)
    grown = []
    pool.add_grow_callback(lambda old, new, gen: grown.append((old, new, gen)))
    for layer in range(2):
        _fill(pool, 40, layer, seed=20 + layer)
    region = pool._storage.region
    table = np.arange(10, dtype=np.int32)
    old = [pool.gather(layer, table, 40) for layer in range(2)]
    pool.transcode("fwht4/lloyd4")
    assert pool._storage.region is region  # same memory
    new_g = pool.geometry
    assert pool.num_blocks == per_layer // (new_g.k_slab_bytes + new_g.v_slab_bytes) == 15
    assert pool.max_num_blocks == 15 and grown == [(10, 15, 1)]
    for layer in range(2):
        k, v = pool.gather(layer, table, 40)
        np.testing.assert_array_equal(k, old[layer][0])
        np.testing.assert_array_equal(v, kv.transcode(old[layer][1], "q8", "lloyd4", 256))
    assert not pool.read_block(14).any()
    pool.transcode("fwht2/lloyd2", num_blocks=20)
    assert pool.num_blocks == 20
    with pytest.raises(errors.InvalidArgument, match=r"num_blocks: 99 is outside \[20, 29\]"):
        pool.transcode("fwht2/lloyd2", num_blocks=99)
    assert (pool.num_blocks, pool.generation, pool.geometry.dtype) == (20, 2, "fwht2/lloyd2")
    with pytest.raises(errors.InvalidArgument, match="fewer than num_blocks=11"):
        LayerKVPool(g, num_blocks=11, layer_region_bytes=per_layer)


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
def test_an_mlx_kv_mode_pool_names_the_values_it_encodes_when_it_refuses_a_dtype():
    """An MLX KV-mode pool refused int32 K with "expected mlx.core.uint8", as if it took
    records only, where it encodes float values too and the NumPy pool's message says so
    (found by a review)."""
    import mlx.core as mx
    pool = LayerKVPool(PoolGeometry(1, 2, 128, 4, "fwht4/q8"), 2, backend="mlx")
    before = pool.read_block(0).copy()
    values = "records, or float32/float16/bfloat16 values to encode; convert before writing"
    for bad, got in ((mx.ones((1, 2, 128), dtype=mx.int32), "mlx.core.int32"),
                     ([[[1.0] * 128] * 2], "float64"), (np.ones((1, 2, 128), bool), "bool")):
        with pytest.raises(errors.InvalidArgumentType,
                           match=rf"k: dtype {got} does not match the pool dtype fwht4/q8: "
                                 rf"expected .*uint8 {values}"):
            pool.write_tokens(0, [1], bad, bad)
    np.testing.assert_array_equal(pool.read_block(0), before)


def test_a_none_dtype_is_named_as_none_not_as_float64():
    """``np.dtype(None)`` is float64, so PoolGeometry(..., None) and pool.transcode(None)
    said "dtype 'float64' is not a pool dtype", a dtype nobody passed (found by a review)."""
    with pytest.raises(errors.InvalidArgumentType, match=r"dtype: None is not a dtype; use "
                                                         r"one of \['bfloat16', "):
        PoolGeometry(1, 2, 128, 4, None)
    pool = LayerKVPool(PoolGeometry(1, 2, 128, 4, "fwht4/q8"), 2)
    with pytest.raises(errors.InvalidArgumentType, match="dtype: None is not a dtype"):
        pool.transcode(None)
    assert (pool.geometry.dtype, pool.generation, pool.num_blocks) == ("fwht4/q8", 0, 2)
    with pytest.raises(errors.InvalidArgument, match="dtype 'float64' is not a pool dtype"):
        PoolGeometry(1, 2, 128, 4, np.float64)  # a float64 that was passed is still named


def test_bad_arguments_of_transcode_attention_and_pool_id_are_pagedkv_errors():
    """Each raised a builtin TypeError/ValueError/UFuncTypeError (found by a review)."""
    from pagedkv.pool import MemoryBudget
    for head_dim in ("128", 128.0):
        with pytest.raises(errors.InvalidArgumentType, match="head_dim must be an int"):
            kv.transcode(np.zeros((1, 68), np.uint8), "fwht4", "fwht2", head_dim)
    pool = LayerKVPool(PoolGeometry(1, 2, 128, 4, "fwht4/q8"), 2)
    q, tables, lens = np.zeros((1, 2, 128), np.float32), np.zeros((1, 1), np.int32), np.ones(
        1, np.int32)
    with pytest.raises(errors.InvalidArgumentType, match="scale"):
        pool.paged_attention(0, q, tables, lens, scale="x")
    with pytest.raises(errors.InvalidArgumentType, match="q: expected a floating-point"):
        pool.paged_attention(0, "x", tables, lens)
    budget = MemoryBudget(10**9)
    with pytest.raises(errors.InvalidArgumentType, match="pool_id must be hashable"):
        LayerKVPool(PoolGeometry(1, 2, 128, 4, "fwht4/q8"), 1, memory_budget=budget,
                    pool_id=["x"])
    assert budget.pools() == {} or not budget.pools()

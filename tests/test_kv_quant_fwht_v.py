"""fwht modes on V, pagedkv's extension (docs/kv-quant.md "Modes"): the fwhtN K codec's
records on the V side (fwht4/fwht2: R128 per half, head_dim 128 or 256; fwht3: R256, head_dim
256), so head_dim 128 has a 4- and a 2-bit V. Known answers against the K codec, attention
over the records against a float64 reference, pool and cold round trips, mode resolution and
refusals."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedkv import errors
from pagedkv.kernels import numpy_kernels
from pagedkv.kv_mode import resolve_kv_modes
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.quant import kv

HAVE_MLX = importlib.util.find_spec("mlx") is not None
RNG = np.random.default_rng()


def _ramp(hd: int) -> np.ndarray:
    x = (np.arange(256, dtype=np.float32) - 128) / 64
    return x[64:192] if hd == 128 else x


@pytest.mark.parametrize("mode,hd,n_bytes,head,sha", [
    # docs/kv-quant.md "Encoding and decoding": the K codec's pinned answers, on V
    ("fwht4", 128, 68, "3535cf407294df44a38593a4", "531c5b85fe058928"),
    ("fwht2", 128, 36, "a815dc40845f9888d1ce50dd", "c741b62d83e636aa"),
    ("fwht4", 256, 132, "e9bc9341a3499aa774b78479", "0eb079d8f93ec865"),
    ("fwht3", 256, 100, "8c239541e832cf02292aa42a", "fe634215c9d3686e"),
])
def test_a_v_pool_stores_the_k_codecs_bytes(mode, hd, n_bytes, head, sha):
    import hashlib
    g = PoolGeometry(1, 1, hd, 4, f"fwht4/{mode}" if hd == 128 else f"lloyd4/{mode}")
    assert g.v_dtype == mode and g.v_row_bytes == n_bytes == kv.side_row_bytes(mode, hd)
    pool = LayerKVPool(g, num_blocks=1)
    x = _ramp(hd)[None, None]
    pool.write_tokens(0, [2], x, x)
    _, rv = pool.gather(0, np.array([0], np.int32), 4)
    rec = rv[2, 0]
    assert rec[:12].tobytes().hex() == head
    assert hashlib.sha256(rec.tobytes()).hexdigest()[:16] == sha
    np.testing.assert_array_equal(rec, numpy_kernels.kv_rotated_quantize(_ramp(hd), mode))


@pytest.mark.parametrize("mode,hd", [("fwht4", 128), ("fwht2", 128), ("fwht4", 256),
                                     ("fwht2", 256), ("fwht3", 256)])
def test_v_decode_is_the_k_codecs_decode_in_its_basis(mode, hd):
    # A V encoded then decoded equals the K codec's decode of the same bytes: cnorm *
    # R^T C[codes] with R128 per half (fwht4/fwht2) or R256 (fwht3), exactly on the CPU.
    x = RNG.standard_normal((37, 3, hd)).astype(np.float32)
    rec = kv.encode(x, mode)
    np.testing.assert_array_equal(rec, numpy_kernels.kv_rotated_quantize(x, mode))
    g = PoolGeometry(1, 3, hd, 37, f"{mode}/{mode}")
    pool = LayerKVPool(g, num_blocks=1)
    pool.write_tokens(0, np.arange(37), x, x)
    rk, rv = pool.gather(0, np.array([0], np.int32), 37)
    np.testing.assert_array_equal(rk, rv)  # the same codec on both sides
    dk, dv = pool.decode_tokens(rk, rv)
    want = numpy_kernels.kv_rotated_dequantize(rec, mode, hd)
    np.testing.assert_array_equal(dv, want)
    np.testing.assert_array_equal(dv, dk)
    # the rotated basis the attention sums in: cnorm * C[codes], per R128 half (or R256)
    cnorm, codes = numpy_kernels.kv_rotated_codes(rec, mode, hd)
    C, _ = kv.kv_rotated.tables(*numpy_kernels.KV_ROTATED_MODES[mode])
    np.testing.assert_array_equal(kv.decode(rec, mode, hd, rotated=True),
                                  (C[codes] * cnorm[..., None]).astype(np.float32))


def _pools(kv_dtype, hd, kvh, n_blocks, bs):
    k_side, v_side = kv.split_kv_dtype(kv_dtype)
    vals = RNG.standard_normal((2, n_blocks, bs, kvh, hd)).astype(np.float32)
    vals[1] *= RNG.uniform(0.01, 10.0, (n_blocks, bs, kvh, 1)).astype(np.float32)
    return kv.encode(vals[0], k_side), kv.encode(vals[1], v_side)


@pytest.mark.parametrize("kv_dtype,hd", [("fwht4/fwht4", 128), ("fwht4/fwht2", 128),
                                         ("fwht2/fwht4", 128), ("lloyd4/fwht4", 256),
                                         ("fwht4/fwht2", 256), ("fwht3/fwht3", 256)])
def test_attention_over_fwht_v_records_matches_float64_attention_of_the_decoded_rows(kv_dtype,
                                                                                      hd):
    # The reference sums a V in its rotated basis and rotates back once per head; that is
    # attention over the decoded rows in float64 up to the decode's float32 rounding:
    # |got - want| <= 2e-5 |want| + 2e-6 * (the head's largest |want|).
    bs, kvh, heads = 8, 2, 4
    k_pool, v_pool = _pools(kv_dtype, hd, kvh, 9, bs)
    lens = np.array([1, 37, 0, 70], np.int32)
    tables = RNG.permutation(9)[:9].astype(np.int32).reshape(1, 9).repeat(4, 0)
    q = RNG.standard_normal((4, heads, hd)).astype(np.float32)
    got = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                               kv_dtype=kv_dtype, scale=0.09)
    assert not got[2].any()
    k_side, v_side = kv.split_kv_dtype(kv_dtype)
    kf = kv.decode(k_pool, k_side, hd).astype(np.float64)
    vf = kv.decode(v_pool, v_side, hd).astype(np.float64)
    for s in (0, 1, 3):
        pos = np.arange(lens[s])
        k, v = kf[tables[s, pos // bs], pos % bs], vf[tables[s, pos // bs], pos % bs]
        for h in range(heads):
            logit = k[:, h // 2] @ q[s, h].astype(np.float64) * 0.09
            p = np.exp(logit - logit.max())
            want = (p / p.sum()) @ v[:, h // 2]
            bound = 2e-5 * np.abs(want) + 2e-6 * np.abs(want).max()
            assert (np.abs(got[s, h] - want) <= bound).all()


@pytest.mark.skipif(not HAVE_MLX, reason="MLX not installed")
@pytest.mark.parametrize("kv_dtype,hd", [("fwht4/fwht4", 128), ("fwht2/fwht2", 128)])
def test_mlx_pool_attention_over_fwht_v_matches_the_reference(kv_dtype, hd):
    import mlx.core as mx
    g = PoolGeometry(2, 2, hd, 8, kv_dtype)
    pool = LayerKVPool(g, num_blocks=6, backend="mlx")
    x = RNG.standard_normal((2, 40, 2, hd)).astype(np.float32)
    pool.write_tokens(1, np.arange(40), mx.array(x[0]), mx.array(x[1]))
    np.testing.assert_array_equal(np.array(pool.gather(1, np.arange(5, dtype=np.int32), 40)[1]),
                                  kv.encode(x[1], g.v_dtype))  # MLX encode: the codec's bytes
    q = RNG.standard_normal((1, 4, hd)).astype(np.float32)
    tables = np.arange(5, dtype=np.int32)[None]
    lens = np.array([40], np.int32)
    got = pool.paged_attention(1, mx.array(q), mx.array(tables), mx.array(lens), scale=0.1)
    k_layer, v_layer = (np.array(a) for a in pool.layer(1))
    want = numpy_kernels.paged_attention_decode(q, k_layer, v_layer, tables, lens,
                                                kv_dtype=kv_dtype, scale=0.1)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=2e-5)


def test_bytes_per_token_head_at_head_dim_128():
    per_head = {"fwht4/fwht4": 136, "fwht4/fwht2": 104, "fwht2/fwht4": 104,
                "fwht2/fwht2": 72, "fwht4/q8": 204}
    for dtype, n in per_head.items():
        g = PoolGeometry(3, 2, 128, 16, dtype)
        assert (g.k_row_bytes + g.v_row_bytes, g.bytes_per_token) == (n, 3 * 2 * n)
    assert PoolGeometry(1, 1, 128, 16, "fwht4/fwht4").symmetric
    assert kv.kv_mode("fwht4").sides == "KV" and kv.kv_mode("lloyd4").sides == "V"
    assert kv.join_kv_dtype("fwht4", "fwht4") == "fwht4/fwht4"


def test_transcode_narrows_an_fwht_v_within_its_family():
    g = PoolGeometry(1, 2, 128, 4, "fwht4/fwht4")
    pool = LayerKVPool(g, num_blocks=2)
    x = RNG.standard_normal((8, 2, 128)).astype(np.float32)
    pool.write_tokens(0, np.arange(8), x, x)
    _rk, rv = pool.gather(0, np.array([0, 1], np.int32), 8)
    pool.transcode("fwht4/fwht2")
    _, rv2 = pool.gather(0, np.array([0, 1], np.int32), 8)
    np.testing.assert_array_equal(rv2, kv.downshift(rv, "fwht4", "fwht2", 128))
    with pytest.raises(errors.InvalidArgument, match="not a transcode"):
        pool.transcode("fwht4/fwht4")  # widening
    with pytest.raises(errors.InvalidArgument, match="lloyd2 needs head_dim 256"):
        pool.transcode("fwht4/lloyd2")


@pytest.mark.parametrize("environ,config,want", [
    ({"PAGEDKV_KV_MODE": "fwht4", "PAGEDKV_KV_V": "fwht4"}, {}, "fwht4/fwht4"),
    ({"HIPFIRE_KV_MODE": "turbo4", "HIPFIRE_KV_V": "FWHT2"}, {}, "fwht4/fwht2"),
    ({}, {"kv_cache": "fwht2", "kv_v": " fwht4 "}, "fwht2/fwht4"),
    ({"PAGEDKV_KV_MODE": "lloyd4"}, {"kv_v": "fwht3"}, "lloyd4/fwht3"),
])
def test_fwht_v_resolves_from_env_and_config(environ, config, want):
    c = resolve_kv_modes(environ=environ, model_config=config)
    assert c.kv_dtype == want
    assert kv.split_kv_dtype(want) == (c.k, c.v)


@pytest.mark.parametrize("kwargs,match", [
    ({"environ": {"PAGEDKV_KV_V": "fwht4"}}, (r"V 'fwht4' \(PAGEDKV_KV_V\) is a rotated V, "
                                             r"which needs a rotated K")),
    ({"k": "q8", "v": "fwht2"}, "needs a rotated K"),
    ({"environ": {"PAGEDKV_KV_MODE": "fwht4", "PAGEDKV_KV_V": "turbo4"}},
     ("PAGEDKV_KV_V = 'turbo4': accepted values are q8, lloyd4, lloyd3, lloyd2, fwht4, fwht3, "
     "fwht2, auto, bf16")),
    ({"environ": {"PAGEDKV_KV_MODE": "bf16", "PAGEDKV_KV_V": "fwht4"}}, "bf16 on both sides"),
])
def test_bad_fwht_v_choices_raise_naming_the_source(kwargs, match):
    with pytest.raises(errors.InvalidArgument, match=match):
        resolve_kv_modes(**kwargs)


@pytest.mark.parametrize("dtype,hd,exc,match", [
    ("fwht4/fwht4", 64, errors.InvalidArgument, "fwht4 needs head_dim 128 or 256"),
    ("fwht4/fwht2", 96, errors.InvalidArgument, "fwht4 needs head_dim 128 or 256"),
    ("fwht4/fwht3", 128, errors.InvalidArgument, "fwht3 needs head_dim 256"),
    ("lloyd4/fwht2", 512, errors.InvalidArgument, "needs head_dim"),
    ("q8/fwht4", 128, errors.InvalidArgument, r"a rotated V \(fwht4\) needs a rotated K"),
    ("fwht4/fwht5", 128, errors.InvalidArgument, "V one of"),
    ("fwht4/float16", 128, errors.InvalidArgument, "V one of"),
    (b"fwht4/fwht4", 128, errors.InvalidArgumentType, "is not a dtype"),
])
def test_geometry_refuses_what_an_fwht_v_cannot_store(dtype, hd, exc, match):
    with pytest.raises(exc, match=match):
        PoolGeometry(2, 2, hd, 16, dtype)


def test_bad_values_leave_an_fwht_v_pool_unchanged():
    g = PoolGeometry(1, 2, 128, 4, "fwht4/fwht2")
    pool = LayerKVPool(g, num_blocks=2)
    x = RNG.standard_normal((5, 2, 128)).astype(np.float32)
    pool.write_tokens(0, np.arange(5), x, x)
    before = [pool.read_block(b) for b in range(2)]
    bad = x[:2].copy()
    bad[1, 0, 7] = np.inf
    with pytest.raises(errors.InvalidArgument, match="non-finite"):
        pool.write_tokens(0, [5, 6], x[:2], bad)
    with pytest.raises(errors.InvalidArgument, match=r"expected \(2, 2, 36\)"):
        pool.write_tokens(0, [5, 6], kv.encode(x[:2], "fwht4"), kv.encode(x[:2], "fwht4"))
    with pytest.raises(errors.InvalidArgumentType, match="float32/float16 values"):
        pool.write_tokens(0, [5, 6], x[:2], x[:2].astype(np.float64))
    for b in range(2):
        np.testing.assert_array_equal(pool.read_block(b), before[b])

"""KV-cache kernels (hip/kvcache.hip) against their NumPy references.

CPU tests pin the references (q8 KV bytes of docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)',
attention over a paged layout
equal to attention over the same KV laid out contiguously). GPU tests run each
kernel on fresh random inputs with poisoned outputs and ragged sizes."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from kernels_support import poisoned
from pagedkv import errors
from pagedkv.kernels import kvcache, numpy_kernels
from pagedkv.quant import kv, kv_q8

RNG = np.random.default_rng()


# --- references (CPU) -----------------------------------------------------------------


def test_kv_q8_record_bytes_known_answer():
    x = np.zeros(32, np.float32)
    x[0], x[1], x[2], x[3], x[4] = 127.0, 2.5, 3.5, -2.5, -127.0  # amax 127: id = 1
    rec = numpy_kernels.kv_q8_quantize(x)
    assert rec.shape == (34,)
    assert rec[:2].tobytes() == np.float16(1.0).tobytes()  # d = 127/127
    codes = rec[2:].view(np.int8)
    assert codes[:5].tolist() == [127, 2, 4, -2, -127]  # half to even
    assert not codes[5:].any()
    zero = numpy_kernels.kv_q8_quantize(np.zeros(64, np.float32))
    assert not zero.any()  # amax 0: scale 0, codes 0
    np.testing.assert_array_equal(numpy_kernels.kv_q8_dequantize(zero, 64), np.zeros(64))


def test_kv_q8_round_trip_error_is_half_a_step():
    x = RNG.standard_normal((7, 3, 96)).astype(np.float32)
    rec = numpy_kernels.kv_q8_quantize(x)
    assert rec.shape == (7, 3, 3 * 34)
    back = numpy_kernels.kv_q8_dequantize(rec, 96)
    d = np.abs(x.reshape(-1, 32)).max(axis=1) / 127
    err = np.abs(back - x).reshape(-1, 32).max(axis=1)
    # half a step, plus the f16 rounding of the stored scale (<= 2^-11 relative) times 127
    assert (err <= d * (0.5 + 127 * 2.0**-11) + 1e-7).all()
    with pytest.raises(errors.InvalidArgument, match="head_dim=40"):
        numpy_kernels.kv_q8_quantize(np.zeros((2, 40), np.float32))


def test_kv_q8_cpu_codec_equals_the_reference_bytes():
    # Random rows plus exact ties (amax 127 makes id = 1: x.5 values round half to even)
    # and an all-zero record.
    x = (RNG.standard_normal((9, 3, 64)) * RNG.uniform(0.01, 100, (9, 3, 1))).astype(np.float32)
    x[0, 0, :32] = np.arange(-16, 16) + 0.5
    x[0, 0, 0] = 127.0
    x[1, 1, 32:] = 0.0
    rec = kv_q8.quantize(x)
    np.testing.assert_array_equal(rec, numpy_kernels.kv_q8_quantize(x))
    np.testing.assert_array_equal(kv_q8.dequantize(rec, 64), numpy_kernels.kv_q8_dequantize(rec, 64))
    x16 = x.astype(np.float16)
    np.testing.assert_array_equal(kv_q8.quantize(x16),
                                  numpy_kernels.kv_q8_quantize(x16.astype(np.float32)))
    assert kv_q8.quantize(np.zeros((0, 32), np.float32)).shape == (0, 34)


def test_kv_q8_layout_constants_are_kvquant_h():
    """BLOCK_VALUES / RECORD_BYTES come from PKV_KVQ8_BLOCK / PKV_KVQ8_RECORD_BYTES; the
    documented layout (an f16 scale + 32 int8) pins them."""
    assert (kv_q8.BLOCK_VALUES, kv_q8.RECORD_BYTES) == (32, 34)
    assert [kv_q8.row_bytes(hd) for hd in (32, 64, 128, 256)] == [34, 68, 136, 272]
    for bad in (0, -32, 40):
        with pytest.raises(errors.InvalidArgument, match=f"head_dim={bad}: must be a positive "
                                                          "multiple of 32 up to 2"):
            kv_q8.row_bytes(bad)
    from pagedkv.pool import geometry
    assert (geometry.Q8_GROUP_DIMS, geometry.Q8_GROUP_BYTES) == (32, 34)
    assert (numpy_kernels.KVQ8_BLOCK, numpy_kernels.KVQ8_RECORD_BYTES) == (32, 34)


def test_kv_q8_cpu_codec_rejects_bad_input():
    with pytest.raises(errors.InvalidArgument, match="multiple of 32"):
        kv_q8.quantize(np.zeros((2, 40), np.float32))
    bad = np.zeros((2, 32), np.float32)
    bad[1, 3] = np.nan
    with pytest.raises(errors.InvalidArgument, match="flat index 35"):
        kv_q8.quantize(bad)
    with pytest.raises(errors.InvalidArgumentType):
        kv_q8.quantize(np.zeros((2, 32), np.float64))
    with pytest.raises(errors.InvalidArgument, match="last axis must be 68 bytes"):
        kv_q8.dequantize(np.zeros((2, 34), np.uint8), 64)


def _paged_case(seq_lens, *, kv_heads, head_dim, block_size, kv_dtype, rng=RNG):
    """Random KV per sequence, scattered into a pool through shuffled block tables.
    ``kv_dtype``: one dtype for both sides, or ``"<K mode>/<V mode>"`` (records encoded by
    the CPU codec)."""
    seqs = len(seq_lens)
    width = max(1, max(-(-n // block_size) for n in seq_lens))
    num_blocks = seqs * width + 3
    perm = rng.permutation(num_blocks)
    tables = np.full((seqs, width), -1, np.int32)
    pools = []
    for side in kv.split_kv_dtype(kv_dtype):
        vals = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float32)
        if side == "float16":
            pools.append(vals.astype(np.float16))
        elif side == "bfloat16":
            pools.append((vals.view(np.uint32) >> 16).astype(np.uint16))
        elif side == "q8":
            pools.append(numpy_kernels.kv_q8_quantize(vals))
        else:
            pools.append(numpy_kernels.kv_rotated_quantize(vals, side))
        row = kv.side_row_bytes(side, head_dim) // pools[-1].itemsize
        assert pools[-1].shape == (num_blocks, block_size, kv_heads, row)
    for s, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[s * width: s * width + nb]
    return pools[0], pools[1], tables, np.asarray(seq_lens, np.int32)


def _poison_tails(k_pool, v_pool, tables, lens, block_size):
    """0xFF bytes (NaN scales) in the slots past each sequence in its last block: what a
    q8 tensor copy stages with a sequence's last chunk, which the kernels must ignore."""
    for s, n in enumerate(lens):
        if n % block_size:
            last = tables[s, (n - 1) // block_size]
            k_pool[last, n % block_size:] = 0xFF
            v_pool[last, n % block_size:] = 0xFF


def test_paged_reference_equals_contiguous_attention():
    k_pool, v_pool, tables, lens = _paged_case([5, 33, 0], kv_heads=2, head_dim=32,
                                               block_size=8, kv_dtype="float16")
    q = RNG.standard_normal((3, 4, 32)).astype(np.float32)
    out = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                           kv_dtype="float16", scale=0.2)
    assert not out[2].any()  # empty sequence
    s = 1
    pos = np.arange(33)
    k = k_pool[tables[s, pos // 8], pos % 8].astype(np.float64)  # [33, 2, 32]
    v = v_pool[tables[s, pos // 8], pos % 8].astype(np.float64)
    for h in range(4):
        logit = k[:, h // 2] @ q[s, h] * 0.2
        p = np.exp(logit - logit.max())
        np.testing.assert_allclose(out[s, h], (p / p.sum()) @ v[:, h // 2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kv_dtype,hd", [("fwht4/q8", 128), ("fwht2/q8", 128),
                                         ("fwht4/lloyd4", 256), ("fwht3/lloyd2", 256),
                                         ("fwht2/lloyd3", 256), ("lloyd4/lloyd4", 256),
                                         ("lloyd2/q8", 256), ("fwht4/fwht4", 128),
                                         ("fwht4/fwht2", 128), ("fwht2/fwht4", 128),
                                         ("fwht4/fwht4", 256), ("lloyd4/fwht2", 256),
                                         ("fwht3/fwht3", 256)])
def test_compressed_reference_equals_attention_on_the_decoded_kv(kv_dtype, hd):
    # The rotated-basis computation (scores from q_rot and C[codes], V summed in R256 and
    # rotated back once) is attention over the decoded rows, up to float64 rounding.
    k_pool, v_pool, tables, lens = _paged_case([5, 40, 0], kv_heads=2, head_dim=hd,
                                               block_size=8, kv_dtype=kv_dtype)
    q = RNG.standard_normal((3, 4, hd)).astype(np.float32)
    out = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                           kv_dtype=kv_dtype, scale=0.1)
    assert not out[2].any()
    k_side, v_side = kv.split_kv_dtype(kv_dtype)
    kf = kv.decode(k_pool, k_side, hd).astype(np.float64)
    vf = kv.decode(v_pool, v_side, hd).astype(np.float64)
    for s in (0, 1):
        pos = np.arange(lens[s])
        k, v = kf[tables[s, pos // 8], pos % 8], vf[tables[s, pos // 8], pos % 8]
        for h in range(4):
            logit = k[:, h // 2] @ q[s, h] * 0.1
            p = np.exp(logit - logit.max())
            np.testing.assert_allclose(out[s, h], (p / p.sum()) @ v[:, h // 2], rtol=2e-5,
                                       atol=2e-6)


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="MLX not installed")
@pytest.mark.parametrize("kv_dtype,hd", [("fwht4/q8", 128), ("fwht4/lloyd4", 256),
                                         ("fwht3/lloyd2", 256), ("q8", 64),
                                         ("lloyd4/lloyd3", 256), ("fwht4/fwht4", 128),
                                         ("fwht2/fwht2", 128), ("fwht4/fwht2", 256),
                                         ("lloyd4/fwht3", 256)])
def test_mlx_attention_reads_records_like_the_reference(kv_dtype, hd):
    import mlx.core as mx

    from pagedkv.quant import kv_mlx
    k_pool, v_pool, tables, lens = _paged_case([37], kv_heads=2, head_dim=hd, block_size=8,
                                               kv_dtype=kv_dtype)
    q = RNG.standard_normal((1, 8, hd)).astype(np.float32)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                            kv_dtype=kv_dtype, scale=0.15)
    pos = np.arange(37)
    k = k_pool[tables[0, pos // 8], pos % 8]
    v = v_pool[tables[0, pos // 8], pos % 8]
    k_side, v_side = kv.split_kv_dtype(kv_dtype)
    got = kv_mlx.attention_decode(mx.array(q[0]), mx.array(k), mx.array(v),
                                  kv.kv_mode(k_side), kv.kv_mode(v_side), hd, 0.15)
    np.testing.assert_allclose(np.array(got), want[0], rtol=1e-4, atol=2e-5)


def test_check_decode_batch_rejects_bad_tables():
    tables = np.array([[0, 1, -1], [2, -1, -1]], np.int32)
    kvcache.check_decode_batch(tables, np.array([16, 3], np.int32), num_blocks=3, block_size=8)
    with pytest.raises(errors.InvalidArgument, match="outside 0..2"):
        kvcache.check_decode_batch(tables, np.array([16, 9], np.int32), num_blocks=3,
                                   block_size=8)
    with pytest.raises(errors.InvalidArgument, match="seq_lens: values must be in 0..24"):
        kvcache.check_decode_batch(tables, np.array([25, 3], np.int32), num_blocks=3,
                                   block_size=8)
    with pytest.raises(errors.InvalidArgument, match="block_tables: int64"):
        kvcache.check_decode_batch(tables.astype(np.int64), np.array([1, 1], np.int32),
                                   num_blocks=3, block_size=8)


# --- GPU --------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kv_heads,head_dim", [(3, 64), (8, 128), (1, 256)])
def test_gpu_kv_q8_write_matches_reference_bytes(device, src_dtype, kv_heads, head_dim):
    num_blocks, bs, n = 9, 16, 37  # 37 tokens: not a multiple of the block size
    src = (RNG.standard_normal((n, kv_heads, head_dim)) * 3).astype(src_dtype)
    slots = RNG.permutation(num_blocks * bs)[:n].astype(np.int64)
    slots[5] = -1  # a padding token writes nothing
    row = head_dim // 32 * 34
    pool = poisoned(device, (num_blocks, bs, kv_heads, row), np.uint8, 0xAB)
    kvcache.kv_q8_write(device, device.array(src), device.array(slots), pool)
    got = pool.to_numpy().reshape(num_blocks * bs, kv_heads, row)
    want = numpy_kernels.kv_q8_quantize(src.astype(np.float32))
    live = slots >= 0
    np.testing.assert_array_equal(got[slots[live]], want[live])
    untouched = np.setdiff1d(np.arange(num_blocks * bs), slots[live])
    assert (got[untouched] == 0xAB).all()


@pytest.mark.gpu
@pytest.mark.parametrize("src_dtype", [np.float32, np.float16])
def test_gpu_kv_q8_write_stores_a_nan_scale_for_a_record_with_a_nan(device, src_dtype):
    # kvquant.h's pkv_kvq8_amax: a NaN wins the record max (fmaxf dropped it: the record got
    # a finite scale and decoded as if whole), so the scale is the quiet NaN 0x7E00 and the
    # finite values' codes 0, as the NumPy reference stores them; the NaN's own code is not
    # specified (the record decodes to NaN either way).
    kv_heads, head_dim, n = 2, 64, 3
    src = (RNG.standard_normal((n, kv_heads, head_dim)) * 3).astype(src_dtype)
    nans = [(0, 1, 7), (2, 0, 40), (2, 0, 41)]
    for tok, head, dim in nans:
        src[tok, head, dim] = np.nan
    slots = np.array([4, 0, 9], np.int64)
    pool = poisoned(device, (4, 4, kv_heads, 68), np.uint8, 0xAB)
    kvcache.kv_q8_write(device, device.array(src), device.array(slots), pool)
    got = pool.to_numpy().reshape(16, kv_heads, 2, 34)[slots]
    with np.errstate(invalid="ignore"):
        want = numpy_kernels.kv_q8_quantize(src.astype(np.float32)).reshape(n, kv_heads, 2, 34)
    for tok, head, dim in nans:
        rec, j = divmod(dim, 32)
        assert got[tok, head, rec, :2].view(np.uint16)[0] == 0x7E00
        got[tok, head, rec, 2 + j] = want[tok, head, rec, 2 + j] = 0
    np.testing.assert_array_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [np.float32, np.float16])
def test_gpu_kv_q8_read_matches_reference(device, out_dtype):
    num_blocks, bs, kvh, hd, n = 7, 8, 2, 96, 29
    vals = RNG.standard_normal((num_blocks, bs, kvh, hd)).astype(np.float32)
    pool_host = numpy_kernels.kv_q8_quantize(vals)
    slots = RNG.integers(0, num_blocks * bs, n).astype(np.int64)
    out = poisoned(device, (n, kvh, hd), out_dtype)
    kvcache.kv_q8_read(device, device.array(pool_host), device.array(slots), out)
    want = numpy_kernels.kv_q8_dequantize(pool_host.reshape(-1, kvh, hd // 32 * 34)[slots], hd)
    np.testing.assert_array_equal(out.to_numpy(), want.astype(out_dtype))


ATTN_CASES = [
    # kv_dtype, heads, kv_heads, head_dim, block_size, seq_lens
    ("float16", 8, 2, 128, 16, [1, 17, 600, 2100, 0, 1025]),
    ("float16", 4, 4, 64, 5, [7, 1030, 31]),
    # CUDA cores everywhere: 8 heads per KV head, head_dim 256 / 32
    ("float16", 16, 2, 256, 16, [40, 1500]),
    ("float16", 4, 1, 32, 8, [100, 1030, 3]),
    ("bfloat16", 6, 2, 128, 16, [300, 9, 1025]),
    ("bfloat16", 16, 2, 256, 32, [40, 700]),
    ("q8", 8, 1, 128, 16, [33, 1500, 2]),
    ("q8", 4, 2, 32, 8, [513, 12]),
    # q8 on the f16 tensor-core passes (sm_80+: head_dim 64/128, 1-4 heads per KV head),
    # ragged across 512-token partitions; the paths agree in test_gpu_q8_attention_paths
    ("q8", 8, 2, 128, 16, [1, 17, 600, 1100, 0, 513]),
    ("q8", 6, 2, 64, 5, [7, 1030, 31]),
    ("q8", 2, 2, 128, 8, [700, 3]),
    ("q8", 4, 2, 64, 16, [2049, 16]),
    # compressed KV read as stored (docs/kv-quant.md): every K width, q8 and lloyd V, all
    # group sizes (1, 2, 4, 8 heads per KV head), ragged lengths across 512-token partitions
    ("fwht4/q8", 8, 2, 128, 16, [1, 17, 600, 1100, 0]),
    ("fwht2/q8", 4, 4, 128, 8, [513, 31]),
    ("fwht4/q8", 16, 2, 256, 16, [40, 1030]),
    ("fwht3/q8", 2, 2, 256, 16, [700, 3]),
    ("fwht4/lloyd4", 8, 2, 256, 16, [1, 300, 1600, 0]),
    ("fwht4/lloyd3", 4, 4, 256, 32, [513, 77]),
    ("fwht4/lloyd2", 6, 2, 256, 16, [1025, 5]),
    ("fwht3/lloyd4", 8, 1, 256, 16, [900]),
    ("fwht3/lloyd3", 2, 2, 256, 8, [64, 1200]),
    ("fwht3/lloyd2", 16, 2, 256, 16, [222]),
    ("fwht2/lloyd4", 4, 1, 256, 16, [1500, 9]),
    ("fwht2/lloyd3", 8, 8, 256, 16, [333]),
    ("fwht2/lloyd2", 4, 2, 256, 16, [2049, 1]),
    # lloyd modes on K (R256, matched tables; lloyd3 runs fwht3's kernels)
    ("lloyd4/lloyd4", 8, 2, 256, 16, [1, 700, 1300]),
    ("lloyd4/q8", 4, 4, 256, 16, [513, 60]),
    ("lloyd2/lloyd3", 2, 1, 256, 8, [900, 2]),
    ("lloyd3/lloyd4", 8, 2, 256, 16, [555]),
    # fwht modes on V (pagedkv's extension: the K codec's records, summed in R128 per half
    # and rotated back by pkv_paged_attention_reduce_ifwht128; fwht3 V runs lloyd3's)
    ("fwht4/fwht4", 8, 2, 128, 16, [1, 17, 600, 1100, 0]),
    ("fwht4/fwht2", 4, 4, 128, 8, [513, 31]),
    ("fwht2/fwht4", 16, 2, 128, 16, [40, 1030]),
    ("fwht2/fwht2", 2, 1, 128, 16, [2049, 3]),
    ("fwht4/fwht4", 8, 2, 256, 16, [300, 1600]),
    ("lloyd4/fwht2", 4, 1, 256, 16, [1500, 9]),
    ("fwht3/fwht4", 6, 2, 256, 16, [1025, 5]),
    ("lloyd3/fwht3", 8, 2, 256, 16, [555, 64]),
]


# every case on its default kernel, and the q8 cases once more on the staged q8s kernels
# (q8_stage=True; where the tensor-core passes do not apply they are the CUDA-core ones)
# and on the q8i kernels (q8_int=True: pass 1 on integer tensor cores)
ATTN_PATH_CASES = ([(*c, None) for c in ATTN_CASES]
                   + [(*c, True) for c in ATTN_CASES if c[0] == "q8"]
                   + [(*c, "int") for c in ATTN_CASES if c[0] == "q8"])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,heads,kv_heads,head_dim,block_size,seq_lens,q8_stage",
                         ATTN_PATH_CASES)
def test_gpu_paged_attention_matches_reference(device, kv_dtype, heads, kv_heads, head_dim,
                                               block_size, seq_lens, q8_stage):
    k_pool, v_pool, tables, lens = _paged_case(seq_lens, kv_heads=kv_heads, head_dim=head_dim,
                                               block_size=block_size, kv_dtype=kv_dtype)
    kvcache.check_decode_batch(tables, lens, num_blocks=k_pool.shape[0], block_size=block_size)
    q = RNG.standard_normal((len(seq_lens), heads, head_dim)).astype(np.float32)
    attn = kvcache.PagedAttention(device, num_seqs=len(seq_lens), num_heads=heads,
                                  kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
                                  max_seq_len=int(lens.max()), kv_dtype=kv_dtype,
                                  q8_stage=None if q8_stage is None else True,
                                  q8_int=True if q8_stage == "int" else None)
    if q8_stage:
        assert attn._partition.name.startswith(
            "pkv_paged_attention_q8" + ("i_" if q8_stage == "int" else "s_"))
    out = poisoned(device, q.shape, np.float32)
    attn.run(device.array(q), device.array(k_pool), device.array(v_pool), device.array(tables),
             device.array(lens), out)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype=kv_dtype,
                                            scale=attn.scale)
    got = out.to_numpy()
    assert np.isfinite(got).all()
    # float32 accumulation over up to 2100 tokens (three 1024-token partitions) against a
    # float64 reference; f16 scores come from tensor cores on sm_80+ (q as f16 + f16 rest);
    # compressed K: q rotated in float32 on the device, in float64 by the reference.
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (3, 1, 64), (2, 2, 128)])
def test_gpu_q8_attention_paths(device, heads, kv_heads, head_dim):
    # The tensor-core q8 kernel (default), the CUDA-core one (q8_mma=False, the
    # PAGEDKV_ATTN_Q8_MMA=0 fallback), the staged tensor-core one (q8_stage=True,
    # PAGEDKV_ATTN_Q8_STAGE=1) and the staged one with the integer pass 1 (q8_int=True,
    # PAGEDKV_ATTN_Q8_INT=1) on the same pool: each within the attention tolerance of the
    # float64 reference, and of the CUDA-core one. Large-magnitude V (scales near 1) and
    # small (near 1e-3) in one pool: the tensor-core passes fold the scale into P.
    lens = [1, 511, 1300]
    k_pool, v_pool, tables, lens = _paged_case(lens, kv_heads=kv_heads, head_dim=head_dim,
                                               block_size=16, kv_dtype="q8")
    vals = RNG.standard_normal((v_pool.shape[0], 16, kv_heads, head_dim)).astype(np.float32)
    vals *= np.where(RNG.random((v_pool.shape[0], 1, 1, 1)) < 0.5, 100.0, 0.1)
    v_pool = numpy_kernels.kv_q8_quantize(vals)
    q = RNG.standard_normal((3, heads, head_dim)).astype(np.float32) * 2
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                            scale=head_dim ** -0.5)
    outs = []
    for q8_mma, q8_stage, q8_int in ((True, False, False), (False, False, False),
                                     (True, True, False), (True, True, True)):
        attn = kvcache.PagedAttention(device, num_seqs=3, num_heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, block_size=16, max_seq_len=1300,
                                      kv_dtype="q8", q8_mma=q8_mma, q8_stage=q8_stage,
                                      q8_int=q8_int)
        assert attn._partition.name.startswith(
            "pkv_paged_attention_" + ("q8i" if q8_int else "q8s" if q8_stage else
                                      "q8_" if q8_mma else "q8cc"))
        out = poisoned(device, q.shape, np.float32)
        attn.run(device.array(q), device.array(k_pool), device.array(v_pool),
                 device.array(tables), device.array(lens), out)
        outs.append(out.to_numpy())
        assert np.isfinite(outs[-1]).all()
        _assert_within(outs[-1], want, 1e-4, 2e-5,
                       f"q8_mma={q8_mma}, q8_stage={q8_stage}, q8_int={q8_int}")
    _assert_within(outs[0], outs[1], 2e-4, 4e-5, "the tensor-core and CUDA-core q8 paths")
    _assert_within(outs[2], outs[1], 2e-4, 4e-5, "the staged and CUDA-core q8 paths")
    _assert_within(outs[3], outs[1], 2e-4, 4e-5, "the integer pass 1 and CUDA-core q8 paths")


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,block_size,q8_int", [
    (32, 8, 16, False), (8, 2, 32, False), (16, 4, 16, True), (4, 2, 8, False)])
def test_gpu_q8_tensor_copies_match_cp_async(device, monkeypatch, heads, kv_heads, block_size,
                                             q8_int):
    # The staged q8 kernels' TMA tensor copies (sm_90, PAGEDKV_ATTN_Q8_TMA, on by default)
    # against their cp.async copies (PAGEDKV_ATTN_Q8_TMA=0) on the same pool: the same bytes
    # out. The slots past each sequence in its last block hold 0xFF bytes (NaN scales), which
    # a box copies with the chunk and the kernel must ignore; 1,301 and 17 tokens end
    # mid-chunk. block_size 8 puts a chunk across blocks: no maps, cp.async either way.
    from pagedkv.kernels.device import Device, sm_version
    if not isinstance(device, Device) or device.backend != "cuda":
        pytest.skip("tensor copies: CUDA only")
    lens = [1, 17, 600, 1301]
    k_pool, v_pool, tables, lens = _paged_case(lens, kv_heads=kv_heads, head_dim=128,
                                               block_size=block_size, kv_dtype="q8")
    _poison_tails(k_pool, v_pool, tables, lens, block_size)
    q = RNG.standard_normal((len(lens), heads, 128)).astype(np.float32)
    args = [device.array(a) for a in (q, k_pool, v_pool, tables, lens)]
    outs = []
    for tma in ("1", "0"):
        monkeypatch.setenv("PAGEDKV_ATTN_Q8_TMA", tma)
        attn = kvcache.PagedAttention(device, num_seqs=len(lens), num_heads=heads,
                                      kv_heads=kv_heads, head_dim=128, block_size=block_size,
                                      max_seq_len=1301, kv_dtype="q8", q8_stage=True,
                                      q8_int=q8_int or None)
        used = attn._tensor_maps(args[1], args[2])[2]
        arch = sm_version(device.properties.arch)
        assert used == int(tma == "1" and arch >= 90 and block_size % 16 == 0)
        out = poisoned(device, q.shape, np.float32)
        attn.run(*args, out)
        outs.append(out.to_numpy())
    assert np.isfinite(outs[0]).all()
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                                scale=128 ** -0.5)
    _assert_within(outs[0], want, 1e-4, 2e-5, "tensor copies")
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,offset", [(128, 4), (128, 1), (64, 2)])
def test_gpu_q8_staged_kernel_copies_a_pool_off_alignment_by_bytes(device, head_dim, offset):
    # The staged q8 kernels (q8s) launched directly on pools that start off their cp.async
    # unit (8 bytes at head_dim 128, 4 at 64), as MLX's launcher may pass them (it cannot
    # see an array's address; PagedAttention sees it and runs the unstaged kernel): the
    # kernel copies those chunks by byte loads into the same staged layout, so the bits of
    # the same pool at an aligned address.
    from pagedkv.kernels.device import Device
    from pagedkv.kernels.device_array import DeviceArray
    if not isinstance(device, Device) or device.backend != "cuda":
        pytest.skip("the staged q8 kernels run on CUDA")
    lens = [1, 17, 600, 1301]
    k_pool, v_pool, tables, lens = _paged_case(lens, kv_heads=2, head_dim=head_dim,
                                               block_size=16, kv_dtype="q8")
    q = RNG.standard_normal((len(lens), 8, head_dim)).astype(np.float32)
    attn = kvcache.PagedAttention(device, num_seqs=len(lens), num_heads=8, kv_heads=2,
                                  head_dim=head_dim, block_size=16, max_seq_len=1301,
                                  kv_dtype="q8", q8_stage=True, q8_tma=False)
    args = [device.array(a) for a in (q, tables, lens)]

    def launch(k, v):
        out = poisoned(device, q.shape, np.float32)
        attn._partitions(attn._partition, args[0], k, v, args[1], args[2], None)
        attn._launch_reduce(args[2], out, None)
        return out.to_numpy()

    def at_offset(pool):
        held = device.array(np.concatenate([np.zeros(offset, np.uint8), pool.reshape(-1)]))
        return DeviceArray(device, held.ptr + offset, pool.shape, np.uint8, owned=False,
                           base=held)
    shifted = at_offset(k_pool), at_offset(v_pool)
    assert shifted[0].ptr % (8 if head_dim == 128 else 4) != 0
    aligned = launch(device.array(k_pool), device.array(v_pool))
    got = launch(*shifted)
    assert np.isfinite(got).all() and np.array_equal(got, aligned)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                                scale=head_dim ** -0.5)
    _assert_within(got, want, 1e-4, 2e-5, "byte-staged pool")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,heads,kv_heads,head_dim", [
    ("float16", 32, 8, 128), ("bfloat16", 8, 2, 64), ("q8", 8, 2, 128),
    ("fwht4/lloyd4", 8, 2, 256), ("fwht3/q8", 4, 2, 256)])
def test_gpu_attention_partition_sizes_agree(device, kv_dtype, heads, kv_heads, head_dim):
    # The same pool split into partitions of every size a launch may choose (the kernel's
    # most, the split of a short context down to its floor of 64, and 16 and 48 tokens,
    # which cut blocks and staged chunks in the middle): each within the attention tolerance
    # of the float64 reference, and of the unsplit launch. Lengths at and around the sizes.
    lens = [1, 47, 64, 65, 700, 1100]
    k_pool, v_pool, tables, lens = _paged_case(lens, kv_heads=kv_heads, head_dim=head_dim,
                                               block_size=16, kv_dtype=kv_dtype)
    q = RNG.standard_normal((len(lens), heads, head_dim)).astype(np.float32)
    args = [device.array(a) for a in (q, k_pool, v_pool, tables, lens)]
    most = kvcache.ATTN_PARTITION_TOKENS[kv_dtype]
    auto = kvcache.PagedAttention(device, num_seqs=len(lens), num_heads=heads,
                                  kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                                  max_seq_len=1100, kv_dtype=kv_dtype)
    assert auto.partition_tokens == kvcache.attention_partition_tokens(
        kv_dtype, len(lens), kv_heads, 1100, device.properties.multiprocessor_count)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                                kv_dtype=kv_dtype, scale=auto.scale)
    outs = {}
    for tokens in (most, auto.partition_tokens, 64, 48, 16):
        attn = kvcache.PagedAttention(device, num_seqs=len(lens), num_heads=heads,
                                      kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                                      max_seq_len=1100, kv_dtype=kv_dtype,
                                      partition_tokens=tokens)
        out = poisoned(device, q.shape, np.float32)
        attn.run(*args, out)
        outs[tokens] = out.to_numpy()
        assert np.isfinite(outs[tokens]).all()
        _assert_within(outs[tokens], want, 1e-4, 2e-5, f"{tokens} tokens per partition")
        _assert_within(outs[tokens], outs[most], 2e-4, 4e-5,
                       f"{tokens} tokens per partition against {most}")


def _assert_within(got, want, rtol, atol_rel, what):
    """|got - want| <= rtol |want| + atol_rel * (the head's largest |want|), elementwise;
    the message names the path, the worst element and how far over it is."""
    scale = np.abs(want).max(axis=-1, keepdims=True)  # per-head output magnitude
    diff = np.abs(got - want)
    # an empty sequence's head is exactly 0 (want and scale 0): no difference, no excess
    excess = np.divide(diff, rtol * np.abs(want) + atol_rel * scale,
                       out=np.where(diff > 0, np.inf, 0.0), where=diff > 0)
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess.max() <= 1.0, (
        f"{what}: {int((excess > 1).sum())} of {excess.size} outside the tolerance, worst "
        f"{excess.max():.3g}x at (seq, head, dim) {tuple(map(int, worst))}: got "
        f"{got[worst]:.6g}, want {want[worst]:.6g}, head scale {scale[worst[:2]][0]:.3g}")


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,hd", [("fwht4/q8", 256), ("fwht4/lloyd4", 256),
                                         ("fwht2/lloyd2", 256), ("fwht4/fwht4", 128),
                                         ("fwht2/fwht2", 128)])
def test_gpu_compressed_attention_tracks_attention_on_the_decoded_kv(device, kv_dtype, hd):
    # The same compressed pool read as stored (GPU) and decoded to float16 first (GPU f16
    # kernel): what the rotated-basis computation must equal up to float rounding.
    k_pool, v_pool, tables, lens = _paged_case([700, 65], kv_heads=2, head_dim=hd,
                                               block_size=16, kv_dtype=kv_dtype)
    q = RNG.standard_normal((2, 8, hd)).astype(np.float32)
    outs = []
    for dt, kp, vp in ((kv_dtype, k_pool, v_pool),
                       ("float16", *(kv.decode(p, m, hd).astype(np.float16) for p, m in
                                     zip((k_pool, v_pool), kv.split_kv_dtype(kv_dtype),
                                         strict=True)))):
        attn = kvcache.PagedAttention(device, num_seqs=2, num_heads=8, kv_heads=2,
                                      head_dim=hd, block_size=16, max_seq_len=700,
                                      kv_dtype=dt)
        out = poisoned(device, q.shape, np.float32)
        attn.run(device.array(q), device.array(kp), device.array(vp), device.array(tables),
                 device.array(lens), out)
        outs.append(out.to_numpy())
    # float16 rounding of the decoded values is the difference (2^-11 relative per value)
    np.testing.assert_allclose(outs[0], outs[1], rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
def test_gpu_paged_attention_rejects_mismatched_arrays(device):
    attn = kvcache.PagedAttention(device, num_seqs=2, num_heads=4, kv_heads=2, head_dim=64,
                                  block_size=16, max_seq_len=64, kv_dtype="float16")
    q = device.empty((2, 4, 64), np.float32)
    pool = device.empty((4, 16, 2, 64), np.float16)
    tables = device.array(np.zeros((2, 4), np.int32))
    lens = device.array(np.zeros(2, np.int32))
    with pytest.raises(errors.InvalidArgument, match="out: shape"):
        attn.run(q, pool, pool, tables, lens, device.empty((2, 4, 32), np.float32))
    with pytest.raises(errors.InvalidArgument, match="k_pool: expected a float16 pool"):
        attn.run(q, device.empty((4, 16, 2, 64), np.uint16), pool, tables, lens, q)


@pytest.mark.gpu
@pytest.mark.parametrize("block_shape,dtype", [((16, 8, 128), np.float16),
                                               ((16, 2, 68), np.uint8),
                                               ((3, 1, 5), np.uint8)])  # 15 B: byte kernel
def test_gpu_copy_blocks(device, block_shape, dtype):
    src_host = RNG.integers(0, 255, (11,) + block_shape).astype(dtype)
    dst_host = RNG.integers(0, 255, (13,) + block_shape).astype(dtype)
    src_ids = RNG.permutation(11)[:6].astype(np.int32)
    dst_ids = RNG.permutation(13)[:6].astype(np.int32)
    dst = device.array(dst_host)
    kvcache.copy_blocks(device, device.array(src_host), device.array(src_ids),
                        device.array(dst_ids), dst)
    want = numpy_kernels.copy_blocks(src_host, src_ids, dst_ids, dst_host)
    np.testing.assert_array_equal(dst.to_numpy().view(np.uint8), want.view(np.uint8))


# --- the q8 tensor-core passes, emulated lane by lane on the CPU (tests/mma_attention_emulation.py)


@pytest.mark.parametrize("staged,qk_int", [(False, False), (True, False), (True, True)],
                         ids=["q8", "q8s", "q8i"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,v_scale", [
    (3, 1, 64, 5, [40, 1], 1.0),           # group 3 in a g4 kernel, a one-token sequence
    (4, 1, 128, 16, [530, 7], 1e-3),       # two 512-token partitions; V scales ~1e-5
    (2, 2, 64, 8, [70, 0], 300.0),         # g1, large V (scales ~7), an empty sequence
    (4, 2, 128, 16, [33], 1.0),            # g2
])
def test_q8_mma_emulation_matches_the_reference(heads, kv_heads, head_dim, block_size,
                                                seq_lens, v_scale, staged, qk_int):
    import mma_attention_emulation as emu
    k_pool, _, tables, lens = _paged_case(seq_lens, kv_heads=kv_heads, head_dim=head_dim,
                                          block_size=block_size, kv_dtype="q8")
    vals = RNG.standard_normal((k_pool.shape[0], block_size, kv_heads, head_dim)) * v_scale
    v_pool = numpy_kernels.kv_q8_quantize(vals.astype(np.float32))
    q = RNG.standard_normal((len(seq_lens), heads, head_dim)).astype(np.float32)
    got = emu.paged_attention_q8_mma(q, k_pool, v_pool, tables, lens, scale=head_dim ** -0.5,
                                     partition=kvcache.ATTN_PARTITION_TOKENS["q8"],
                                     staged=staged, qk_int=qk_int)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                            scale=head_dim ** -0.5)
    # the documented attention tolerance, atol in units of the V magnitude
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


@pytest.mark.parametrize("qk_int", [False, True], ids=["q8s", "q8i"])
@pytest.mark.parametrize("heads,kv_heads,block_size,seq_lens", [
    (4, 2, 16, [530, 17]),   # two 512-token partitions; a sequence ending mid-chunk
    (8, 8, 32, [45, 1]),     # the last KV head's window ends its slot; a one-token sequence
])
def test_q8_tensor_copy_emulation_reads_what_cp_async_reads(heads, kv_heads, block_size,
                                                            seq_lens, qk_int):
    # The q8s / q8i passes on chunks staged by tensor copies (16 slots x 144 bytes, rows
    # at offset 0 or 8, the slots past each sequence copied as they are) give the bits of
    # the cp.async staging, with those slots full of 0xFF bytes (NaN scales): pass 1 stores
    # no score for them and pass 2 zeroes their scales.
    import mma_attention_emulation as emu
    k_pool, v_pool, tables, lens = _paged_case(seq_lens, kv_heads=kv_heads, head_dim=128,
                                               block_size=block_size, kv_dtype="q8")
    _poison_tails(k_pool, v_pool, tables, lens, block_size)
    q = RNG.standard_normal((len(seq_lens), heads, 128)).astype(np.float32)
    outs = [emu.paged_attention_q8_mma(q, k_pool, v_pool, tables, lens, scale=128 ** -0.5,
                                       partition=kvcache.ATTN_PARTITION_TOKENS["q8"],
                                       staged=True, qk_int=qk_int, tma=tma)
            for tma in (True, False)]
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0], outs[1])
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                                scale=128 ** -0.5)
    np.testing.assert_allclose(outs[0], want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_q8_staged_emulation_rescales_when_a_later_chunk_has_larger_v(head_dim):
    # The staged pass 2 has no pre-pass over V: each warp's pscale follows the largest V
    # scale of its chunks so far. V magnitudes x0.05, x1, x8 by thirds of the sequence make
    # every warp raise it twice; a missing or wrong rescale of the sums accumulated so far
    # (each third carries >= 0.5% of the output) is off by powers of two. Scores flat
    # (q = 0): every token weighs the same.
    import mma_attention_emulation as emu
    n, bs = 300, 16
    k_pool, _, tables, lens = _paged_case([n], kv_heads=1, head_dim=head_dim, block_size=bs,
                                          kv_dtype="q8")
    pos = np.zeros(k_pool.shape[0] * bs)
    pos[(tables[0][:, None] * bs + np.arange(bs)).reshape(-1)[:n]] = np.arange(n)
    growth = np.array([0.05, 1.0, 8.0])[(3 * pos.astype(int)) // n]  # by position, whichever block holds it
    vals = RNG.standard_normal((k_pool.shape[0], bs, 1, head_dim)) * growth.reshape(-1, bs, 1, 1)
    v_pool = numpy_kernels.kv_q8_quantize(vals.astype(np.float32))
    q = np.zeros((1, 2, head_dim), np.float32)
    got = emu.paged_attention_q8_mma(q, k_pool, v_pool, tables, lens, scale=head_dim ** -0.5,
                                     partition=kvcache.ATTN_PARTITION_TOKENS["q8"], staged=True)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens, kv_dtype="q8",
                                            scale=head_dim ** -0.5)
    _assert_within(got, want, 1e-4, 2e-5, "staged emulation, growing V")


def test_q8_mma_emulation_uses_the_kernels_byte_selectors():
    # The emulator and hip/kvcache.hip build the same fragments: the same __byte_perm
    # selectors in the same order (pass 1's two, pass 2's eight in pv_record_mma_q8, which
    # both pass-2 variants share, then the staged pass 1's four), and pass 2's interleaves.
    import re
    from pathlib import Path

    import mma_attention_emulation as emu
    root = Path(__file__).resolve().parents[1]
    hip_text, py_text = (root / "hip/kvcache.hip").read_text(), Path(emu.__file__).read_text()
    for name, count in (("q8_codes_f16x2", 14), ("q8_interleave", 8)):
        hip = re.findall(name + r"<(0x[0-9A-Fa-f]+)>", hip_text)
        py = re.findall(name + r"\((0x[0-9A-Fa-f]+)", py_text)
        assert hip == py and len(hip) == count, name


@pytest.mark.parametrize("kv_dtype,heads,kv_heads,head_dim,block_size,seq_lens,v_scale", [
    ("fwht4/lloyd4", 4, 1, 256, 16, [530, 3], 1.0),   # two partitions; head_dim 256: 2 halves
    ("fwht4/fwht4", 3, 1, 128, 5, [40, 1], 1.0),      # group 3 in a g4 kernel, one token
    ("fwht2/fwht2", 2, 2, 128, 8, [70, 0], 300.0),    # g1, large V norms, an empty sequence
    ("fwht4/fwht2", 4, 2, 128, 16, [33], 1e-3),       # g2, small V norms
    ("fwht2/lloyd2", 4, 2, 256, 4, [45], 1.0),        # 2-bit K and V at head_dim 256
    ("lloyd4/fwht4", 2, 1, 256, 8, [20], 1.0),        # R256 K with an R128 V
])
def test_compressed_mma_emulation_matches_the_reference(kv_dtype, heads, kv_heads, head_dim,
                                                        block_size, seq_lens, v_scale):
    # The lane-by-lane emulation of the _mma kernels (code-byte tables, fragments, byte
    # permutes, hi + lo splits) against the float64 reference over the same records.
    import mma_codes_emulation as emu
    k_pool, _, tables, lens = _paged_case(seq_lens, kv_heads=kv_heads, head_dim=head_dim,
                                          block_size=block_size, kv_dtype=kv_dtype)
    vals = RNG.standard_normal((k_pool.shape[0], block_size, kv_heads, head_dim)) * v_scale
    v_pool = numpy_kernels.kv_rotated_quantize(vals.astype(np.float32), kv_dtype.split("/")[1])
    q = RNG.standard_normal((len(seq_lens), heads, head_dim)).astype(np.float32)
    got = emu.paged_attention_codes_mma(q, k_pool, v_pool, tables, lens, kv_dtype=kv_dtype,
                                        scale=head_dim ** -0.5,
                                        partition=kvcache.ATTN_PARTITION_TOKENS[kv_dtype])
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                                kv_dtype=kv_dtype, scale=head_dim ** -0.5)
    # the documented attention tolerance, atol in units of the V magnitude
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


@pytest.mark.parametrize("kv_dtype,head_dim", [("fwht4/lloyd4", 256), ("fwht2/fwht4", 128),
                                              ("lloyd2/lloyd2", 256)])
def test_the_nibble_and_byte_code_tables_give_the_same_bits(kv_dtype, head_dim):
    # PKV_ATTN_CODE_TABLE_NIBBLES only changes how the centroids' f16 words are looked up:
    # the mmas see the same registers, so the outputs are bit-identical (the GPU sweep
    # `hip/tune.py attn --set PKV_ATTN_CODE_TABLE_NIBBLES=0,1` compares them too).
    import mma_codes_emulation as emu
    k_pool, v_pool, tables, lens = _paged_case([300, 17], kv_heads=1, head_dim=head_dim,
                                               block_size=16, kv_dtype=kv_dtype)
    q = RNG.standard_normal((2, 4, head_dim)).astype(np.float32)
    got = [emu.paged_attention_codes_mma(q, k_pool, v_pool, tables, lens, kv_dtype=kv_dtype,
                                         scale=head_dim ** -0.5, partition=128, nibbles=nibbles)
           for nibbles in (True, False)]
    assert np.isfinite(got[0]).all() and np.array_equal(got[0], got[1])


def test_the_byte_permute_lookups_address_each_nibbles_entry():
    # nibble_entry (hip/kvcache.hip, the NVIDIA _mma passes): an entry's shared address is
    # the table's 256-byte-aligned base with its low byte replaced, by one __byte_perm, with
    # byte k of nibble_offsets(w): the entry of byte k's low or high nibble, for every byte
    # value of every position. A wrong mask, shift or selector names another entry.
    import re
    from pathlib import Path

    from mma_attention_emulation import byte_perm
    src = (Path(__file__).resolve().parents[1] / "hip/kvcache.hip").read_text()
    body = src[src.index("PKV_DEV NibbleOffsets nibble_offsets("):
               src.index("// The hi and lo pairs of byte k")]
    shift = re.search(r"SHIFT = BITS == 4 \? (\d) : (\d);", body)
    mask = re.search(r"MASK = (0x[0-9A-Fa-f]+)u << SHIFT;", body)
    sel = re.search(r"__byte_perm\(high \? o\.hi : o\.lo, base, (0x[0-9A-Fa-f]+)u \| \(uint32_t\)k\)",
                    body)
    assert "return {(w << SHIFT) & MASK, (w >> (4 - SHIFT)) & MASK};" in body
    assert re.search(r"CODE_TABLE_ALIGN = 256;", src) and shift and mask and sel
    # every byte value at every position, and random words
    words = np.concatenate([np.arange(256, dtype=np.uint32) * np.uint32(0x01010101),
                            RNG.integers(0, 2 ** 32, 4096, dtype=np.uint64).astype(np.uint32)])
    base = np.uint32(0x00A3C100)  # a shared-window address, 256-byte aligned
    for bits, entry_bytes, sh in ((4, 4, int(shift[1])), (2, 8, int(shift[2]))):
        m = np.uint32(int(mask[1], 16) << sh)
        offsets = {False: (words << np.uint32(sh)) & m, True: (words >> np.uint32(4 - sh)) & m}
        for k in range(4):
            for high in (False, True):
                at = byte_perm(offsets[high], base, int(sel[1], 16) | k)
                nibble = (words >> np.uint32(8 * k + 4 * high)) & np.uint32(15)
                assert np.array_equal(at, base + np.uint32(entry_bytes) * nibble), (bits, k, high)


def test_compressed_mma_emulation_uses_the_kernels_byte_selectors():
    # pv_mma_codes and its emulation build A with the same __byte_perm operands and
    # selectors in the same order: 4 bits from the even / odd dims' {hi, lo} entries (ev,
    # od), 2 bits from the hi pairs, then the lo pairs (the emulation's regs, once each);
    # the table lookups (code_byte_pairs) join a 4-bit byte's entries with the same two.
    import re
    from pathlib import Path

    import mma_codes_emulation as emu
    root = Path(__file__).resolve().parents[1]
    src = (root / "hip/kvcache.hip").read_text()
    body = src[src.index("PKV_DEV void pv_mma_codes("):src.index("// MMA: pass 1 on tensor")]
    py_src = Path(emu.__file__).read_text()
    py_body = py_src[py_src.index("def pv_codes("):py_src.index("def pv_codes_half(")]
    perm = r"byte_perm\((\w+)\[(\d)\], (\w+)\[(\d)\], (0x[0-9A-Fa-f]+)\)"
    hip, py = re.findall("__" + perm, body), re.findall(perm, py_body)
    four = [h for h in hip if h[0] in ("ev", "od")]
    assert four == [p for p in py if p[0] in ("ev", "od")] and len(four) == 8
    two = [h for h in hip if h[0] in ("hi", "lo")]
    regs = [p for p in py if p[0] == "regs"]
    assert two == [(n, a, n, b, sel) for n in ("hi", "lo") for _, a, _, b, sel in regs]
    assert len(two) == 8
    pairs = src[src.index("PKV_DEV void join_code_entries("):src.index("// 2 bits: the hi and lo")]
    assert re.findall(r"__byte_perm\(e0, e1, (0x[0-9A-Fa-f]+)\)", pairs) == \
        re.findall(r"byte_perm\(e0, e1, (0x[0-9A-Fa-f]+)\)", py_src) == ["0x5410", "0x7632"]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,heads,kv_heads,head_dim", [
    ("fwht4/lloyd4", 16, 4, 256), ("fwht4/lloyd2", 2, 2, 256), ("lloyd4/lloyd4", 4, 2, 256),
    ("fwht2/lloyd2", 3, 1, 256), ("lloyd2/fwht4", 4, 1, 256), ("fwht4/q8", 16, 4, 256),
    ("fwht4/fwht4", 32, 8, 128), ("fwht4/fwht2", 2, 1, 128), ("fwht4/q8", 8, 2, 128),
    ("fwht2/q8", 4, 4, 128), ("fwht2/fwht2", 4, 2, 128), ("fwht2/fwht4", 8, 2, 128),
])
def test_gpu_compressed_attention_tensor_core_path(device, kv_dtype, heads, kv_heads, head_dim):
    # The _mma kernel (default; qkv_mma=True) and the CUDA-core one (qkv_mma=False,
    # PAGEDKV_ATTN_QKV_MMA=0) on the same pool: each within the attention tolerance of the
    # float64 reference, and of each other. V norms from 0.1 to 100 in one pool (the
    # tensor-core pass 2 folds cnorm into P's f16 + remainder), ragged lengths across
    # 512-token partitions, 1-4 heads per KV head.
    lens = [1, 511, 1300, 0]
    k_pool, _, tables, lens = _paged_case(lens, kv_heads=kv_heads, head_dim=head_dim,
                                          block_size=16, kv_dtype=kv_dtype)
    v_side = kv_dtype.split("/")[1]
    vals = RNG.standard_normal((k_pool.shape[0], 16, kv_heads, head_dim)).astype(np.float32)
    vals *= np.where(RNG.random((k_pool.shape[0], 1, 1, 1)) < 0.5, 10.0, 0.01)
    v_pool = (numpy_kernels.kv_q8_quantize(vals) if v_side == "q8"
              else numpy_kernels.kv_rotated_quantize(vals, v_side))
    q = RNG.standard_normal((4, heads, head_dim)).astype(np.float32) * 2
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                                kv_dtype=kv_dtype, scale=head_dim ** -0.5)
    outs = []
    for qkv_mma in (True, False):
        attn = kvcache.PagedAttention(device, num_seqs=4, num_heads=heads, kv_heads=kv_heads,
                                      head_dim=head_dim, block_size=16, max_seq_len=1300,
                                      kv_dtype=kv_dtype, qkv_mma=qkv_mma)
        assert attn._partition.name.endswith(("_mma_g" if qkv_mma else "_g")
                                             + str(attn.gmax))
        assert attn.qkv_mma is qkv_mma
        out = poisoned(device, q.shape, np.float32)
        attn.run(device.array(q), device.array(k_pool), device.array(v_pool),
                 device.array(tables), device.array(lens), out)
        outs.append(out.to_numpy())
        assert np.isfinite(outs[-1]).all()
        _assert_within(outs[-1], want, 1e-4, 2e-5, f"{kv_dtype} qkv_mma={qkv_mma}")
    _assert_within(outs[0], outs[1], 2e-4, 4e-5, f"{kv_dtype}: the _mma and CUDA-core paths")
def test_q8_int_emulation_mirrors_the_kernels_plane_layout():
    # The q8i pass 1 in hip/kvcache.hip and its emulation agree on what the emulation tests
    # can only check in NumPy: which plane each A row holds, which k half each A register
    # fills, where plane 1 comes from and how the planes join.
    from pathlib import Path

    import mma_attention_emulation as emu
    root = Path(__file__).resolve().parents[1]
    hip = (root / "hip/kvcache.hip").read_text()
    py = Path(emu.__file__).read_text()
    pairs = [("(gid < 4 ? p0 : p1)", "np.where(GID < 4, p0, p1)"),
             ("(gid < 4 ? p2 : 0)", "np.where(GID < 4, p2, 0)"),
             ("const int reg = e < 4 ? 0 : 2, shift = 8 * (e % 4);",
              "reg, shift = (0 if e < 4 else 2), 8 * (e % 4)"),
             ("pkv_shfl_xor(acc[0], 16)", "acc[LANE ^ 16]"),
             ("acc[0] + (256.0f * up0 + 65536.0f * acc[2])",
              "acc[:, 0] + (np.float32(256) * up[:, 0] + np.float32(65536) * acc[:, 2])"),
             ("ldexpf(1.0f, 22 - ex)", "np.ldexp(np.float32(1), 22 - ex)")]
    for in_hip, in_py in pairs:
        assert in_hip in hip and in_py in py, (in_hip, in_py)

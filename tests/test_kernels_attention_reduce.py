"""The paged-attention partition reduce on the device (hip/attention_reduce.h through
``PagedAttention.reduce`` / ``reduce_prep``), on partition workspaces filled here: against
float64 within a stated bound, bit for bit against the NumPy emulation of its summation order
(tests/mma_attention_emulation.py) where every weight is exactly 1, and the fused reduce +
prep byte for byte against the reduce. Empty sequences, one partition, counts that are not
powers of two, past the header's cached partitions (65) and past a chunk (257), and
head_dim 32/64/128/256; the rotated-V reduces (ifwht128, ifwht256) against float64 too."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels_support import poisoned
from mma_attention_emulation import attention_reduce, reduce_slices
from pagedkv.kernels import kvcache
from pagedkv.kernels.weights import Gemv

RNG = np.random.default_rng()
TOKENS = 16  # tokens per partition: counts below are partitions of 16 tokens
EPS32 = 2.0 ** -23
# Lengths: empty, one token, one whole partition, 2, 9 (a non-power-of-two past the
# slices), 65 (past the header's two cached partitions per lane), 257 (past a chunk).
LENS = [0, 1, 16, 17, 9 * 16 - 5, 65 * 16, 257 * 16 - 1]
# Few partitions (a launch of 1-3 warps): lengths up to 3 partitions.
LENS_FEW = [0, 1, 16, 33, 48]


def _attn(device, heads, head_dim, lens, kv_dtype="float16"):
    return kvcache.PagedAttention(device, num_seqs=len(lens), num_heads=heads, kv_heads=heads,
                                  head_dim=head_dim, block_size=16, max_seq_len=max(lens),
                                  kv_dtype=kv_dtype, partition_tokens=TOKENS)


def _fill(attn, lens, *, flat_max=False):
    """A workspace as the partition kernel leaves it (partition max, positive sum, |o| <=
    sum), NaN past each sequence's partitions (never read); ``flat_max``: every partition
    of a (seq, head) has the same max (weights exactly 1). Returns the host arrays."""
    shape = (attn.num_seqs, attn.num_heads, attn.max_partitions)
    part_max = np.full(shape, np.nan, np.float32)
    part_sum = np.full(shape, np.nan, np.float32)
    part_out = np.full(shape + (attn.head_dim,), np.nan, np.float32)
    for s, n in enumerate(lens):
        k = -(-n // TOKENS)
        part_max[s, :, :k] = (np.repeat(RNG.standard_normal((attn.num_heads, 1)), k, axis=1)
                              if flat_max else RNG.standard_normal((attn.num_heads, k)) * 4)
        part_sum[s, :, :k] = RNG.uniform(1, TOKENS, (attn.num_heads, k))
        part_out[s, :, :k] = (RNG.uniform(-1, 1, (attn.num_heads, k, attn.head_dim))
                              * part_sum[s, :, :k, None])
    attn.part_max.copy_from(part_max)
    attn.part_sum.copy_from(part_sum)
    attn.part_out.copy_from(part_out)
    return part_out, part_max, part_sum


def _reduce(device, attn, lens, *, flat_max=False):
    """Fill attn's workspace (:func:`_fill`), run ``attn.reduce`` into a poisoned output;
    returns ``(output, workspace)`` (host arrays)."""
    ws = _fill(attn, lens, flat_max=flat_max)
    out = poisoned(device, (len(lens), attn.num_heads, attn.head_dim), np.float32)
    attn.reduce(device.array(np.asarray(lens, np.int32)), out)
    device.synchronize()
    return out.to_numpy(), ws


def _float64_combine(part_out, part_max, part_sum, lens):
    """The combine in float64, ``sum_p w_p |o_p| / sum_p w_p l_p`` (the magnitude the
    float32 errors scale with) and each sequence's partition count."""
    want = np.zeros(part_out.shape[:2] + part_out.shape[3:], np.float64)
    mag = np.zeros_like(want)
    counts = [-(-n // TOKENS) for n in lens]
    for s, k in enumerate(counts):
        if not k:
            continue
        m = part_max[s, :, :k].astype(np.float64)
        w = np.exp(m - m.max(axis=1, keepdims=True))
        denom = (w * part_sum[s, :, :k]).sum(axis=1)[:, None]
        o = part_out[s, :, :k].astype(np.float64)
        want[s] = (w[..., None] * o).sum(axis=1) / denom
        mag[s] = (w[..., None] * np.abs(o)).sum(axis=1) / denom
    return want, mag, counts


def _float64_and_bound(part_out, part_max, part_sum, lens):
    """The combine in float64 and, per value, the bound on the float32 kernel's error:
    EPS32 * (ceil(n / slices) + slices + ceil(n / 32) + 13) * sum_p w_p |o_p| / sum_p w_p l_p
    (first-order rounding of: a slice's fmaf chain, the slices' additions, a header lane's
    chain and its 5-step butterfly, expf (a few ulps), 1 / denom and the product; EPS32 is
    2 units of the float32 rounding per operation)."""
    slices = reduce_slices()
    want, mag, counts = _float64_combine(part_out, part_max, part_sum, lens)
    terms = np.array([-(-k // slices) + slices + -(-k // 32) + 13 for k in counts])
    return want, EPS32 * terms[:, None, None] * mag


# the head dims and length sets every reduce-against-float64 test runs over
EVERY_HEAD_DIM = pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
BOTH_LENGTH_SETS = pytest.mark.parametrize("lens", [LENS, LENS_FEW], ids=["many", "few"])


@pytest.mark.gpu
@EVERY_HEAD_DIM
@BOTH_LENGTH_SETS
def test_gpu_reduce_is_the_float64_combine_within_its_bound(device, head_dim, lens):
    heads = 4
    attn = _attn(device, heads, head_dim, lens)
    assert attn._reduce_threads == 32 * min(reduce_slices(), attn.max_partitions)
    got, ws = _reduce(device, attn, lens)
    want, bound = _float64_and_bound(*ws, lens)
    assert np.isfinite(got).all()  # no NaN past a sequence's partitions was read
    assert not got[0].any()  # the empty sequence: zeros
    err = np.abs(got - want)
    assert (err <= bound).all(), (float((err / np.maximum(bound, 1e-38)).max()), attn)


@pytest.mark.gpu
@EVERY_HEAD_DIM
@BOTH_LENGTH_SETS
def test_gpu_reduce_sums_in_the_emulated_order(device, head_dim, lens):
    # Every partition of a head at the same max: expf(0) is 1 on the device and in NumPy,
    # so the summation order alone decides the bits (header butterfly, slices in order).
    heads = 3
    attn = _attn(device, heads, head_dim, lens)
    got, ws = _reduce(device, attn, lens, flat_max=True)
    want = attention_reduce(*ws, np.asarray(lens, np.int32), TOKENS)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=repr(attn))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(64, 32), (8, 64), (32, 128), (4, 256)])
@pytest.mark.parametrize("lens", [LENS, LENS_FEW, [1], [16 * 64]],
                         ids=["many", "few", "one-part", "64-parts"])
def test_gpu_reduce_prep_writes_the_reduce_bytes(device, heads, head_dim, lens):
    """reduce_prep (pkv_attention_reduce_prep_f32) against reduce then Gemv.prepare on the
    same workspace: the same output bits and prepared-x bytes."""
    attn = _attn(device, heads, head_dim, lens)
    _fill(attn, lens)
    seq_lens = device.array(np.asarray(lens, np.int32))
    batch, k = len(lens), heads * head_dim
    plain, fused = (Gemv(device, "hfq4g256", 64, k, batch) for _ in range(2))
    if not plain.tensor_cores:
        pytest.skip(f"{device!r}: no tensor-core GEMV for hfq4g256")
    for g in (plain, fused):  # poison the scratch: every byte must be written
        g._xq.fill_bytes(0xA5)
        g._xs.fill_bytes(0xFF)
    out = poisoned(device, (batch, heads, head_dim), np.float32)
    attn.reduce(seq_lens, out)
    plain.prepare(out.view((batch, k)))
    out_fused = poisoned(device, (batch, heads, head_dim), np.float32)
    attn.reduce_prep(seq_lens, fused.prepared_x(), out_fused)
    device.synchronize()
    want = out.to_numpy()
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(out_fused.to_numpy().view(np.uint32), want.view(np.uint32),
                                  err_msg=repr(attn))
    for a, b in ((fused.prepared_x().xq, plain.prepared_x().xq),
                 (fused.prepared_x().xs, plain.prepared_x().xs)):
        assert a.to_numpy().tobytes() == b.to_numpy().tobytes(), attn


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype,head_dim,rot", [("fwht4/fwht4", 128, 128),
                                                   ("fwht4/fwht2", 256, 128),
                                                   ("fwht4/lloyd4", 256, 256)])
@pytest.mark.parametrize("lens", [LENS, LENS_FEW], ids=["many", "few"])
def test_gpu_unrotating_reduce_is_the_rotated_float64_combine(device, kv_dtype, head_dim, rot,
                                                              lens):
    # The ifwht reduces: the combine, then R^T per rot-block. Bound: the combine's (above)
    # carried through the orthonormal rotation (at most sqrt(rot) times the largest error
    # of a block), plus the butterflies' own rounding (log2(rot) + 2 roundings of values
    # at most sqrt(rot) times the block's largest).
    from pagedkv.kernels.numpy_kernels import _unrotate_rows
    heads = 2
    attn = _attn(device, heads, head_dim, lens, kv_dtype)
    assert attn._reduce.name == f"pkv_paged_attention_reduce_ifwht{rot}"
    assert attn._reduce_threads >= head_dim
    got, ws = _reduce(device, attn, lens)
    combined, bound = _float64_and_bound(*ws, lens)
    want = _unrotate_rows(combined, rot)
    blocks = (len(lens), heads, head_dim // rot, rot)
    per_block = (math.sqrt(rot) * (bound.reshape(blocks).max(axis=-1)
                                   + (math.log2(rot) + 2) * EPS32
                                   * np.abs(combined.reshape(blocks)).max(axis=-1)))
    assert np.isfinite(got).all() and not got[0].any()
    err = np.abs(got - want).reshape(blocks).max(axis=-1)
    assert (err <= per_block).all(), (float((err / np.maximum(per_block, 1e-38)).max()), attn)


@pytest.mark.gpu
def test_gpu_bench_serial_reduce_is_the_same_combine(device):
    # hip/bench.hip's pre-slice reduce (the bench's comparison) on the same workspace: the
    # float64 combine within its own bound (a serial chain of n terms).
    from pagedkv.bench.gpu import _serial_reduce_launch
    lens = LENS
    attn = _attn(device, 4, 128, lens)
    ws = _fill(attn, lens)
    seq_lens = device.array(np.asarray(lens, np.int32))
    out = poisoned(device, (len(lens), 4, 128), np.float32)
    _serial_reduce_launch(device.kernel("bench", "pkv_bench_attention_reduce_serial",
                                        "pppppiiii"), attn, seq_lens, out, stream=None)
    device.synchronize()
    want, mag, counts = _float64_combine(*ws, lens)
    bound = EPS32 * (2 * np.array(counts) + 13)[:, None, None] * mag  # two n-term chains
    assert (np.abs(out.to_numpy() - want) <= bound).all()

"""The partition reduce's summation order (hip/attention_reduce.h: a 32-lane butterfly for
the header, PKV_ATTN_REDUCE_SLICES slices of partitions added in slice order) and the decode
step's fused attention reduce (pkv_attention_reduce_prep_f32, hip/decode.hip) emulated lane
by lane in NumPy (tests/mma_attention_emulation.py): each lane's head, dims and partition
offsets as the kernel computes them, the combine of hip/attention_reduce.h, then
gemv_prep_x_warp's planes and sums. Its prepared x must be
byte for byte the GEMV's prep of pkv_paged_attention_reduce's output (the GPU test of
tests/test_kernels_decode_fused.py checks the same on the device), and the combine must
be the float64 formula within float32 rounding. An index mistake (a lane reading another
head's partitions, a group spanning the wrong heads) shows up here without a GPU."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest

from mma_attention_emulation import (
    attention_reduce,
    attention_reduce_prep,
    combine_head,
    combine_header,
    fma_f32,
    reduce_slices,
)
from test_gemv_mma_simulated import prep_x


def _workspace(rng, seq_lens, num_heads, head_dim, partition_tokens):
    """A partition workspace as the partition kernel leaves it: per (seq, head) and
    partition below the sequence's count a max, a positive sum and an unnormalized output
    (softmax-weighted values: |o| <= sum); NaN past the count (never written, never read)."""
    seqs = len(seq_lens)
    max_partitions = max(1, max(-(-n // partition_tokens) for n in seq_lens))
    shape = (seqs, num_heads, max_partitions)
    part_max = np.full(shape, np.nan, np.float32)
    part_sum = np.full(shape, np.nan, np.float32)
    part_out = np.full(shape + (head_dim,), np.nan, np.float32)
    for s, n in enumerate(seq_lens):
        k = -(-n // partition_tokens)
        part_max[s, :, :k] = rng.standard_normal((num_heads, k)) * 4
        part_sum[s, :, :k] = rng.uniform(1, partition_tokens, (num_heads, k))
        part_out[s, :, :k] = (rng.uniform(-1, 1, (num_heads, k, head_dim))
                              * part_sum[s, :, :k, None])
    return part_out, part_max, part_sum


@pytest.mark.parametrize("num_heads,head_dim", [(32, 128), (8, 64), (4, 256), (8, 32)])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("rotate", [False, True])
def test_fused_reduce_prep_writes_the_reduce_and_prep_bytes(num_heads, head_dim, batch,
                                                            rotate):
    rng = np.random.default_rng(1000 * num_heads + 10 * batch + rotate)
    lens = [0, 1, 63, 64, 65, 300, 1025, 700][:batch] if batch > 1 else [1025]
    tokens = 64
    part_out, part_max, part_sum = _workspace(rng, lens, num_heads, head_dim, tokens)
    seq_lens = np.asarray(lens, np.int32)
    n_tiles = math.ceil(3 * batch / 8)
    out, xq, xs = attention_reduce_prep(part_out, part_max, part_sum, seq_lens, tokens,
                                        n_tiles, rotate)
    want = attention_reduce(part_out, part_max, part_sum, seq_lens, tokens)
    assert np.isfinite(want).all()  # no NaN past a sequence's partitions was read
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    want_xq, want_xs = prep_x(want.reshape(batch, -1), num_heads * head_dim, n_tiles, rotate)
    np.testing.assert_array_equal(xq, want_xq)
    np.testing.assert_array_equal(xs.view(np.uint32), want_xs.view(np.uint32))
    if lens[0] == 0:
        assert not want[0].any()  # an empty sequence's row: zeros


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("parts", [1, 2, 3, 7, 8, 9, 64, 65, 257])
def test_fused_reduce_prep_matches_the_reduce_at_every_partition_count(head_dim, parts):
    # one partition (one slice), fewer partitions than slices, a non-power-of-two count, a
    # count past the header's two cached partitions per lane (65) and past a chunk (257)
    rng = np.random.default_rng(parts * 1000 + head_dim)
    tokens = 16
    lens = [parts * tokens - 3, 0, parts * tokens]
    part_out, part_max, part_sum = _workspace(rng, lens, 2048 // head_dim, head_dim, tokens)
    seq_lens = np.asarray(lens, np.int32)
    out, xq, xs = attention_reduce_prep(part_out, part_max, part_sum, seq_lens, tokens, 2,
                                        False)
    want = attention_reduce(part_out, part_max, part_sum, seq_lens, tokens)
    assert np.isfinite(want).all() and not want[1].any()
    np.testing.assert_array_equal(out.view(np.uint32), want.view(np.uint32))
    want_xq, want_xs = prep_x(want.reshape(3, -1), 2048, 2, False)
    np.testing.assert_array_equal(xq, want_xq)
    np.testing.assert_array_equal(xs.view(np.uint32), want_xs.view(np.uint32))


def _butterfly(x: np.ndarray) -> np.float32:
    """The xor butterfly 16, 8, 4, 2, 1 as lane 0 sees it, written as pairwise sums over
    the lane index's bits from the highest (an independent spelling of the kernel's)."""
    x = np.asarray(x, np.float32)
    while x.size > 1:
        half = x.size // 2
        x = (x[:half] + x[half:]).astype(np.float32)
    return x[0]


@pytest.mark.parametrize("parts", [1, 5, 31, 32, 33, 64, 100, 257])
def test_combine_order_is_the_documented_one(parts):
    # Every partition's max equal: weights are exactly 1 on the device and here, so the
    # order alone decides the bits (the GPU test of tests/test_kernels_attention_reduce.py
    # asserts the kernel's output equal to combine_head's on such a workspace). Spelled
    # independently: lane j's chain over partitions j, j + 32, ... then the butterfly;
    # slice s's chain over s, s + slices, ... then the slices in order.
    rng = np.random.default_rng(parts)
    psum = rng.uniform(1, 300, parts).astype(np.float32)
    pout = (rng.uniform(-1, 1, (parts, 16)) * psum[:, None]).astype(np.float32)
    pmax = np.full(parts, 1.5, np.float32)
    lanes = np.zeros(32, np.float32)
    for p in range(parts):
        lanes[p % 32] = np.float32(lanes[p % 32] + psum[p])
    denom = _butterfly(lanes)
    m, inv = combine_header(pmax, psum)
    assert m == np.float32(1.5) and inv == np.float32(1) / denom
    slices = reduce_slices()
    acc = [np.zeros(16, np.float32) for _ in range(min(slices, parts))]
    for p in range(parts):
        acc[p % slices] = (acc[p % slices] + pout[p]).astype(np.float32)
    total = acc[0]
    for a in acc[1:]:
        total = (total + a).astype(np.float32)
    want = (total * inv).astype(np.float32)
    np.testing.assert_array_equal(combine_head(pmax, psum, pout).view(np.uint32),
                                  want.view(np.uint32))
    if parts > slices:  # the serial order (the old kernel's) rounds differently here
        serial = np.zeros(16, np.float32)
        for p in range(parts):
            serial = (serial + pout[p]).astype(np.float32)
        assert (serial * inv != want).any()


@pytest.mark.parametrize("tokens", [16, 64, 1024])
def test_reduce_combine_is_the_softmax_merge(tokens):
    """The kernel's float32 combine against sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p in
    float64: within a few float32 roundings of each head's largest output."""
    rng = np.random.default_rng(tokens)
    lens = [1, 17, 1100, 4000, 16 * 257]
    part_out, part_max, part_sum = _workspace(rng, lens, 4, 64, tokens)
    got = attention_reduce(part_out, part_max, part_sum, np.asarray(lens, np.int32), tokens)
    for s, n in enumerate(lens):
        k = -(-n // tokens)
        m = part_max[s, :, :k].astype(np.float64)
        w = np.exp(m - m.max(axis=1, keepdims=True))
        want = ((w[..., None] * part_out[s, :, :k]).sum(axis=1)
                / (w * part_sum[s, :, :k]).sum(axis=1)[:, None])
        scale = np.abs(want).max(axis=1, keepdims=True)
        assert (np.abs(got[s] - want) <= 2e-6 * k * scale + 1e-30).all(), (s, n)


def _nearest_even_f32(exact: Fraction, r: np.float32) -> bool:
    """Whether ``r`` is ``exact`` rounded to nearest float32, ties to even."""
    lo, hi = (np.nextafter(r, np.float32(-np.inf)), np.nextafter(r, np.float32(np.inf)))
    d = abs(Fraction(float(r)) - exact)
    d_lo, d_hi = abs(Fraction(float(lo)) - exact), abs(Fraction(float(hi)) - exact)
    if d < min(d_lo, d_hi):
        return True
    return d == min(d_lo, d_hi) and int(np.asarray(r).view(np.uint32)) % 2 == 0


def test_fma_f32_rounds_once():
    # 1 + 2^-11 + 2^-24 is a float32 tie; + 2^-80 lifts it above: one rounding goes up, a
    # float64 sum rounded again to float32 (2^-80 lost, then the tie to even) would not
    a = b = np.float32(1 + 2.0 ** -12)
    assert fma_f32(a, b, np.float32(2.0 ** -80)) == np.float32(1 + 2.0 ** -11 + 2.0 ** -23)
    assert fma_f32(a, b, np.float32(0)) == np.float32(1 + 2.0 ** -11)  # the tie: to even
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal(3000).astype(np.float32) for _ in range(2))
    c = (rng.standard_normal(3000) * 10.0 ** rng.integers(-12, 3, 3000)).astype(np.float32)
    got = fma_f32(a, b, c)
    for x, y, z, r in zip(a, b, c, got, strict=True):
        assert _nearest_even_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)),
                                 r), (x, y, z, r)

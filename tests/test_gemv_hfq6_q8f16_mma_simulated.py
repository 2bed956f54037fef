"""HFQ6G256 and Q8F16 on the int8 tensor cores (hip/weights.hip, ``gemv_mma<HFQ6G256, NT>``
with ``mma_group6``, ``gemv_mma<Q8F16, NT>`` with ``mma_group_q8``; the default on sm_80+,
``PAGEDKV_GEMV_MMA_HFQ6_Q8F16=0`` turns it off) simulated in NumPy, lane by lane: the 4-bit kernels'
prepared x (tests/test_gemv_mma_simulated.py's model of pkv_gemv_prep_x), the packed tiles
(``gemv_pack.pack_tiles_hfq6`` / ``pack_tiles_q8f16``, run for real), the kernel's loads,
HFQ6's rebuild of the A registers from nibble and high-bit words and its affine epilogue
(the 4-bit kernels' add_group), Q8F16's mmas run twice with the other block's lanes zeroed
and its per-block f16 scales, and the shared-memory reduction, with the index expressions
copied from the kernel text (``KERNEL_TEXT`` pins them). The GPU test
(tests/test_kernels_weights.py) runs the kernels."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pagedkv import errors, quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.kernels import weights
from test_gemv_mma_simulated import (
    _lanes,
    add_group,
    gemv_mma_blocks,
    gemv_mma_staged,
    mma_s8_16x8x32,
    prep_x,
    x_chunk_words,
)
from test_kernels_host import FakeCudaDevice

TILE_BYTES = 4352
H6_TILE_BYTES = 3200
WEIGHTS_HIP = Path(__file__).resolve().parents[1] / "hip" / "weights.hip"


def _f16(bits):
    return (np.asarray(bits, np.uint32) & 0xFFFF).astype(np.uint16).view(np.float16).astype(
        np.float32)


def q8_chunk(acc, words, base, g, i0, chunk, xword, xs, batch, upper_of=lambda t: t >= 2):
    """mma_group_q8<CH, NT>: acc[2, NT, 2, 32] += tile-group ``base``'s products with n-tiles
    i0 .. i0 + chunk (``xword(i, v)``: test_gemv_mma_simulated.nibble_chunk's). ``upper_of``:
    which lanes carry block 2j + 1's dims (the kernel's ``t >= 2``; a mutation changes it)."""
    lane, gid, t = _lanes()
    upper = upper_of(t)
    # MmaWeightsQ8::load: d[r] = row gid + 8r's 16 bytes, code[m] = 16 bytes
    d = [np.stack([words[base + 4 * (gid + 8 * r) + w] for w in range(4)], axis=1)
         for r in range(2)]
    code = [np.stack([words[base + 64 + 4 * (32 * m + lane) + w] for w in range(4)], axis=1)
            for m in range(8)]
    f = np.zeros((chunk, 2, 32), np.float32)
    for i in range(chunk):
        for e in range(2):
            col = 8 * (i0 + i) + 2 * t + e
            b, p = col // 3, col % 3
            step = np.where(b < batch, xs[np.minimum(g * batch + b, len(xs) - 1), 0], 0)
            f[i, e] = step.astype(np.float32) * np.float32([1, 256, 65536])[p]
    for j in range(4):
        c = np.zeros((2, chunk, 32, 4), np.int64)
        q = [xword(i, j) for i in range(chunk)]
        for h in range(2):
            a = code[2 * j + h]
            for bk in range(2):
                mine = (bk == 1) == upper
                regs = [np.where(mine, a[:, k], 0).astype(np.uint32) for k in range(4)]
                for i in range(chunk):
                    mma_s8_16x8x32(c[bk, i], *regs, q[i][:, 2] if h else q[i][:, 0],
                                   q[i][:, 3] if h else q[i][:, 1])
        for bk in range(2):
            b = 2 * j + bk  # block b's scale: half b % 2 of word b / 2
            for r in range(2):
                word = d[r][:, b // 2]
                dv = _f16(word >> 16 if b % 2 else word & 0xFFFF)
                for i in range(chunk):
                    for e in range(2):
                        acc[r, i0 + i, e] += dv * (f[i, e] * c[bk, i, :, 2 * r + e]
                                                   .astype(np.float32))


def gemv_mma_q8(packed, xq, xs, M, K, batch, NT, n_warps, **mutation):
    """gemv_mma<Q8F16, NT>: y float32[batch, M]; ``mutation``: q8_chunk's."""

    def group(acc, words, base, g):
        q8_chunk(acc, words, base, g, 0, NT, x_chunk_words(xq, g, NT, 0, NT, batch), xs,
                 batch, **mutation)

    return gemv_mma_blocks(M, K, batch, NT, n_warps, TILE_BYTES, packed, group)


def hfq6_join(n, hb):
    """hfq6_join (hip/weights.hip): two A words of 6-bit codes, (lo, hi), from the nibble
    word n and the high-bit word hb (bits 0-1 / 2-3 of each byte)."""
    return ((n & 0x0F0F0F0F) | (hb & 0x03030303) << 4,
            (n >> 4 & 0x0F0F0F0F) | (hb & 0x0C0C0C0C) << 2)


def hfq6_chunk(acc, words, base, g, i0, chunk, xword, xs, batch, hb_shift=4):
    """mma_group6<CH> + add_group: acc[2, NT, 2, 32] += tile-group ``base``'s products with
    n-tiles i0 .. i0 + chunk (``xword(i, v)``: nibble_chunk's). ``hb_shift``: how far a1 /
    a3's high bits move down to a0 / a2's place (the kernel's 4; a mutation changes it)."""
    lane, gid, _ = _lanes()
    hdr = [np.stack([words[base + 2 * (gid + 8 * r)], words[base + 2 * (gid + 8 * r) + 1]],
                    axis=1) for r in range(2)]

    def word(x):  # MmaWeights6::word: load x / 4 at 128 + 16 (32 (x / 4) + lane)
        return words[base + 32 + 4 * (32 * (x // 4) + lane) + x % 4].astype(np.uint32)

    c = np.zeros((1, chunk, 32, 4), np.int64)
    for m in range(8):
        n0, n1, hb = word(3 * m), word(3 * m + 1), word(3 * m + 2)
        a0, a2 = hfq6_join(n0, hb)
        a1, a3 = hfq6_join(n1, hb >> hb_shift)
        for i in range(chunk):
            q = xword(i, m // 2)
            mma_s8_16x8x32(c[0, i], a0, a1, a2, a3, q[:, 2] if m % 2 else q[:, 0],
                           q[:, 3] if m % 2 else q[:, 1])
    add_group(acc, c, hdr, i0, xs, g, batch, False)


def gemv_mma_6(packed, xq, xs, M, K, batch, NT, n_warps, **mutation):
    """gemv_mma<HFQ6G256, NT>: y float32[batch, M]; ``mutation``: hfq6_chunk's."""

    def group(acc, words, base, g):
        hfq6_chunk(acc, words, base, g, 0, NT, x_chunk_words(xq, g, NT, 0, NT, batch), xs,
                   batch, **mutation)

    return gemv_mma_blocks(M, K, batch, NT, n_warps, H6_TILE_BYTES, packed, group)


#: Per format: its chunk model (mma_group_add's branch) and packed tile-group bytes.
CHUNK_MODELS = {"q8f16": (q8_chunk, TILE_BYTES), "hfq6g256": (hfq6_chunk, H6_TILE_BYTES)}


def gemv_mma_staged_wide(fmt, packed, xq, xs, M, K, batch, NT, n_warps, splits, **mutation):
    """gemv_mma_staged<HFQ6G256 / Q8F16, NT>: test_gemv_mma_simulated's staged model (x
    through the swizzled shared buffer, chunks of 3 n-tiles, split-K) with this format's
    chunk model."""
    chunk, tile_bytes = CHUNK_MODELS[fmt]

    def chunk_fn(acc, words, base, g, i0, n, xword):
        chunk(acc, words, base, g, i0, n, xword, xs, batch, **mutation)

    return gemv_mma_staged(packed, xq, xs, M, K, batch, NT, False, n_warps, splits,
                           chunk_fn=chunk_fn, tile_bytes=tile_bytes)


def _case(M, K, batch, seed, fmt="q8f16"):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((M, K)) * rng.uniform(0.01, 1, (M, 1))).astype(np.float32)
    raw = quant.quantize(w, fmt)
    x = (rng.standard_normal((batch, K)) * rng.uniform(0.1, 10, (batch, 1))).astype(np.float32)
    return raw, x


def _check(y, raw, x, M, K, fmt="q8f16"):
    expect = ref.gemv(raw, fmt, M, K, x, rotated=False)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K))).astype(np.float64)
    # the int8 kernels' bound (docs/kernels.md): x's 22-bit rounding and the f32 sums
    np.testing.assert_array_less(np.abs(y - expect), 2e-6 * (np.abs(x) @ wq.T) + 1e-30)


@pytest.fixture
def q8_mma(monkeypatch):
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "1")


@pytest.mark.parametrize(("M", "K", "batch", "warps"), [
    (37, 1024, 1, 4), (16, 256, 2, 1), (40, 512, 5, 2), (20, 768, 8, 3), (33, 2048, 3, 8)])
def test_q8f16_tensor_core_gemv_simulated_matches_the_float64_product(q8_mma, M, K, batch,
                                                                      warps):
    raw, x = _case(M, K, batch, seed=M * K + batch)
    g = weights.Gemv(FakeCudaDevice(), "q8f16", M, K, batch)
    assert g.tensor_cores and g._kernel.name == f"pkv_gemv_mma_q8f16_n{g._tiles}"
    assert g.weight_bytes == g.pack(raw).nbytes == -(-M // 16) * 16 * K // 32 * 34
    xq, xs = prep_x(x, K, g._tiles, False)
    _check(gemv_mma_q8(g.pack(raw), xq, xs, M, K, batch, g._tiles, warps), raw, x, M, K)


@pytest.mark.parametrize(("M", "K", "batch", "warps"), [
    (37, 1024, 1, 4), (16, 256, 2, 1), (40, 512, 5, 2), (20, 768, 8, 3)])
def test_hfq6_tensor_core_gemv_simulated_matches_the_float64_product(q8_mma, M, K, batch,
                                                                     warps):
    raw, x = _case(M, K, batch, seed=M * K + batch, fmt="hfq6g256")
    g = weights.Gemv(FakeCudaDevice(), "hfq6g256", M, K, batch)
    assert g.tensor_cores and g._kernel.name == f"pkv_gemv_mma_hfq6g256_n{g._tiles}"
    assert g.weight_bytes == g.pack(raw).nbytes == -(-M // 16) * 16 * K // 256 * 200
    xq, xs = prep_x(x, K, g._tiles, False)
    y = gemv_mma_6(g.pack(raw), xq, xs, M, K, batch, g._tiles, warps)
    _check(y, raw, x, M, K, "hfq6g256")


def _mutant_error(fmt, model, **mutation):
    """The largest error of a mutated kernel model, relative to the product's largest |y|."""
    M, K, batch = 16, 512, 2
    raw, x = _case(M, K, batch, seed=9, fmt=fmt)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch)
    xq, xs = prep_x(x, K, g._tiles, False)
    y = model(g.pack(raw), xq, xs, M, K, batch, g._tiles, 1, **mutation)
    expect = ref.gemv(raw, fmt, M, K, x, rotated=False)
    return np.abs(y - expect).max() / np.abs(expect).max()


def _random_packed(pack, M, groups, group_bytes, tile_bytes):
    """Random stored rows (any bytes: the packing only moves them) and ``gemv_pack.<pack>``
    of them, two 16-row tiles long."""
    from pagedkv.kernels import gemv_pack
    rows = np.random.default_rng(M).integers(0, 256, (M, groups * group_bytes), dtype=np.uint8)
    out = getattr(gemv_pack, pack)(rows, groups)
    assert out.shape == (2 * groups * tile_bytes,)
    return rows, out


@pytest.mark.parametrize(("fmt", "M", "K", "batch", "warps", "splits"), [
    ("q8f16", 37, 1024, 32, 8, 4), ("q8f16", 20, 768, 11, 2, 3), ("q8f16", 16, 512, 24, 1, 1),
    ("hfq6g256", 37, 1024, 17, 4, 2), ("hfq6g256", 33, 512, 32, 8, 1),
    ("hfq6g256", 40, 768, 9, 3, 3)])
def test_staged_hfq6_and_q8f16_gemv_simulated_matches_the_float64_product(fmt, M, K, batch,
                                                                        warps, splits):
    # batch 9-32: gemv_mma_staged<HFQ6G256 / Q8F16, NT> (x through the swizzled shared
    # buffer, the format's products in chunks of 3 n-tiles, the groups split over blocks)
    raw, x = _case(M, K, batch, seed=M * K + batch, fmt=fmt)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, wide_mma=True)
    NT = g._tiles
    assert NT == (6 if batch <= 16 else 12)
    assert g._kernel.name == f"pkv_gemv_mma_staged_{fmt}_n{NT}" and len(g._grid) == 2
    assert repr(g) == f"Gemv('{fmt}', M={M}, K={K}, batch={batch}, int8 tensor cores, staged)"
    xq, xs = prep_x(x, K, NT, False)
    y = gemv_mma_staged_wide(fmt, g.pack(raw), xq, xs, M, K, batch, NT, warps, splits)
    _check(y, raw, x, M, K, fmt)


@pytest.mark.parametrize("fmt", ["q8f16", "hfq6g256"])
def test_one_split_of_the_staged_wide_gemv_gives_each_batch_row_what_the_batch_8_kernel_does(
        fmt):
    # one warp per block and one split: each output adds its groups in order, as the batch
    # 1-8 kernel's one warp does, and a column's plane and batch row are where the chunked
    # n-tiles put them; so every 8 batch rows of a batch-32 call are that kernel's, bit for bit
    M, K = 37, 768
    raw, x = _case(M, K, 32, seed=5, fmt=fmt)
    packed = weights.Gemv(FakeCudaDevice(), fmt, M, K, 32, wide_mma=True).pack(raw)
    xq, xs = prep_x(x, K, 12, False)
    staged = gemv_mma_staged_wide(fmt, packed, xq, xs, M, K, 32, 12, 1, 1)
    one = gemv_mma_q8 if fmt == "q8f16" else gemv_mma_6
    for lo in range(0, 32, 8):
        xq8, xs8 = prep_x(x[lo:lo + 8], K, 3, False)
        old = one(packed, xq8, xs8, M, K, 8, 3, 1)
        np.testing.assert_array_equal(staged[lo:lo + 8].view(np.uint32), old.view(np.uint32))


def test_a_chunk_that_forgets_its_first_n_tile_fails_the_staged_product():
    # mma_group_q8 in chunks: n-tile i of chunk i0 is column 8 (i0 + i) + 2t + e, its plane
    # (col % 3) and accumulator acc[r][i0 + i]; a chunk that scaled by plane (8i + 2t + e)
    # % 3 gives the later chunks' columns the wrong 2^(8p)
    M, K, batch = 16, 512, 32
    raw, x = _case(M, K, batch, seed=3)
    packed = weights.Gemv(FakeCudaDevice(), "q8f16", M, K, batch, wide_mma=True).pack(raw)
    xq, xs = prep_x(x, K, 12, False)

    def forgetful(acc, words, base, g, i0, n, xword):
        # the chunk's accumulators and scales placed as if it were chunk 0, then moved
        part = np.zeros_like(acc)
        q8_chunk(part, words, base, g, 0, n, xword, xs, batch)
        acc[:, i0:i0 + n] += part[:, :n]

    y = gemv_mma_staged(packed, xq, xs, M, K, batch, 12, False, 1, 1, chunk_fn=forgetful,
                        tile_bytes=TILE_BYTES)
    expect = ref.gemv(raw, "q8f16", M, K, x, rotated=False)
    assert np.abs(y - expect).max() / np.abs(expect).max() > 1e-3


def test_a_wrong_high_bit_shift_fails_the_hfq6_product(q8_mma):
    assert _mutant_error("hfq6g256", gemv_mma_6, hb_shift=2) > 1e-3


def test_the_hfq6_pack_puts_each_code_where_its_lane_reads_it():
    # an independent reading of pack_tiles_hfq6 (the docstring's layout): every 6-bit code
    # of a 2-tile, 2-group tensor, rebuilt from its nibble and high-bit words, is the code
    M, groups = 19, 2
    rows, out = _random_packed("pack_tiles_hfq6", M, groups, 200, H6_TILE_BYTES)
    for row in range(M):
        tile, r = divmod(row, 16)
        for g in range(groups):
            base = (tile * groups + g) * H6_TILE_BYTES
            src = rows[row, 200 * g:200 * g + 200]
            assert (out[base + 8 * r:base + 8 * r + 8] == src[:8]).all()
            # 4 codes per 3 bytes, LSB first (quant.h, pkv_unpack_codes)
            codes = [(int.from_bytes(src[8 + 3 * (d // 4):11 + 3 * (d // 4)].tobytes(), "little")
                      >> (6 * (d % 4))) & 63 for d in range(256)]
            for dim in range(256):
                L = dim // 8
                m, t = 2 * (L // 8) + L % 2, (L % 8) // 2
                lane, half, odd, jb = 4 * (r % 8) + t, r // 8, dim % 2, (dim % 8) // 2

                def byte(x, lane=lane, jb=jb, base=base):
                    return int(out[base + 128 + 16 * (32 * (x // 4) + lane) + 4 * (x % 4) + jb])
                low = byte(3 * m + half) >> (4 * odd) & 15
                high = byte(3 * m + 2) >> (2 * (2 * half + odd)) & 3
                assert low | high << 4 == codes[dim], (row, g, dim)
    # rows past M (the second tile's last 13) are zero
    pad = out[groups * H6_TILE_BYTES:].reshape(groups, H6_TILE_BYTES)
    assert (pad[:, 8 * 3:128] == 0).all()


def test_the_block_lanes_are_where_the_prep_puts_the_blocks(q8_mma):
    # lanes t < 2 carry block 2j's dims of mmas 2j, 2j + 1, t >= 2 block 2j + 1's: scoring
    # with the halves swapped (t < 2 as block 2j + 1) mixes blocks with different scales
    assert _mutant_error("q8f16", gemv_mma_q8, upper_of=lambda t: t < 2) > 1e-3


@pytest.mark.parametrize("M", [21, 32])
def test_the_pack_puts_each_code_where_its_lane_reads_it(M):
    # an independent reading of pack_tiles_q8f16 (the docstring's layout): every code and
    # scale of a 2-tile, 2-group tensor lands once, padding rows are zero; M = 32 has no
    # padding, so the output is not zeroed first and every byte must be written
    groups = 2
    rows, out = _random_packed("pack_tiles_q8f16", M, groups, 272, TILE_BYTES)
    want = np.zeros_like(out)
    for row in range(M):
        tile, r = divmod(row, 16)
        for g in range(groups):
            base = (tile * groups + g) * TILE_BYTES
            src = rows[row, 272 * g:272 * g + 272].reshape(8, 34)
            want[base + 16 * r:base + 16 * r + 16] = src[:, :2].reshape(-1)
            for dim in range(256):
                L = dim // 8
                m, t = 2 * (L // 8) + L % 2, (L % 8) // 2
                reg = r // 8 + 2 * (dim % 2)
                want[base + 256 + 16 * (32 * m + 4 * (r % 8) + t) + 4 * reg + (dim % 8) // 2] = \
                    src[dim // 32, 2 + dim % 32]
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("env", [None, "1"])
def test_the_wide_formats_run_on_tensor_cores_unless_the_variable_is_0(monkeypatch, env):
    # unset or 1: both formats on the tensor cores (their GPU tests passed on an H100), batch
    # 1-8 on gemv_mma, 9-32 on the staged kernel; 0: the CUDA-core kernel, 8 rows a call
    if env is None:
        monkeypatch.delenv(weights.WIDE_MMA_ENV, raising=False)
    else:
        monkeypatch.setenv(weights.WIDE_MMA_ENV, env)
    for fmt in ("hfq6g256", "q8f16"):
        g = weights.Gemv(FakeCudaDevice(), fmt, 64, 512, 4)
        assert g.tensor_cores and g._kernel.name == f"pkv_gemv_mma_{fmt}_n2"
        assert repr(g) == f"Gemv('{fmt}', M=64, K=512, batch=4, int8 tensor cores)"
        assert weights.max_batch(FakeCudaDevice(), fmt) == 32
        g = weights.Gemv(FakeCudaDevice(), fmt, 64, 512, 9)
        assert g._kernel.name == f"pkv_gemv_mma_staged_{fmt}_n6"
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "0")
    for fmt in ("hfq6g256", "q8f16"):
        g = weights.Gemv(FakeCudaDevice(), fmt, 64, 512, 4)
        assert not g.tensor_cores and g._kernel.name == f"pkv_gemv_{fmt}_b4"
        assert weights.max_batch(FakeCudaDevice(), fmt) == 8
        dev = FakeCudaDevice()
        with pytest.raises(errors.InvalidArgument, match=rf"batch=9: expected 1\.\.8 for {fmt}"):
            weights.Gemv(dev, fmt, 64, 512, 9)
        assert dev.calls == []  # refused before anything was allocated or loaded
    monkeypatch.delenv(weights.WIDE_MMA_ENV)  # the default again, for the cases below
    # K = 288: 9 blocks of 32, not whole 256-groups: the CUDA-core kernel, 8 rows a call
    g = weights.Gemv(FakeCudaDevice(), "q8f16", 64, 288, 4)
    assert not g.tensor_cores and g._kernel.name == "pkv_gemv_q8f16_b4"
    dev = FakeCudaDevice()
    with pytest.raises(errors.InvalidArgument, match=r"batch=9: q8f16 with K=288 runs the "
                                                     r"CUDA-core kernel .* 1\.\.8 rows a call"):
        weights.Gemv(dev, "q8f16", 64, 288, 9)
    assert dev.calls == []  # refused before anything was allocated or loaded
    # never the f16-activation kernel, nor the pipelined one (4-bit only)
    monkeypatch.setenv(weights.F16X_ENV, "1")
    monkeypatch.setenv(weights.PIPE_ENV, "1")
    g = weights.Gemv(FakeCudaDevice(), "q8f16", 64, 512, 8)
    assert g.tensor_cores and not g.f16_x and g._kernel.name == "pkv_gemv_mma_q8f16_n3"
    g = weights.Gemv(FakeCudaDevice(), "q8f16", 64, 512, 32)
    assert not g.f16_x and not g.pipe and g._kernel.name == "pkv_gemv_mma_staged_q8f16_n12"
    with pytest.raises(errors.InvalidArgument, match="pipe=True: the pipelined GEMV runs"):
        weights.Gemv(FakeCudaDevice(), "hfq6g256", 64, 512, 32, pipe=True)


@pytest.mark.parametrize("fmt", ["hfq6g256", "q8f16"])
def test_the_staged_launch_of_the_wide_formats_is_4_warps_two_blocks_an_sm(fmt):
    # 4 warps a block (the H100 sweep of 2026-12-06: 0.87-1.00x the time of 8), and the
    # group splits counted for two resident blocks per SM (8 // warps at 255 registers);
    # the 4-bit formats' staged launch keeps 8 warps, one block per SM
    dev = FakeCudaDevice()  # 132 SMs
    want = {(4096, 4096): "64x4", (4096, 14336): "64x4", (14336, 4096): "224x1"}
    for (M, K), grid in want.items():
        for batch, nt in ((16, 6), (32, 12)):
            g = weights.Gemv(dev, fmt, M, K, batch)
            assert g.launch == f"pkv_gemv_mma_staged_{fmt}_n{nt} {grid} x 128", (M, K, batch)
    assert weights.Gemv(dev, fmt, 14336, 4096, 32, warps=8).launch == \
        f"pkv_gemv_mma_staged_{fmt}_n12 112x1 x 256"
    assert weights.Gemv(dev, "hfq4g256", 4096, 4096, 32, f16_x=False).launch == \
        "pkv_gemv_mma_staged_hfq4g256_n12 32x4 x 256"
    assert weights.Gemv(dev, fmt, 4096, 4096, 32, warps=2).launch == \
        f"pkv_gemv_mma_staged_{fmt}_n12 128x4 x 64"  # 4 blocks an SM: 4 splits, one wave


#: Expressions of the emulation copied from the kernel text.
KERNEL_TEXT = [
    "for (int k = 0; k < 6; ++k) code[k] = ((const uint4*)(base + 128))[32 * k + lane];",
    "const uint32_t n0 = w.word(3 * m), n1 = w.word(3 * m + 1), hb = w.word(3 * m + 2);",
    "lo = (n & 0x0F0F0F0Fu) | (hb & 0x03030303u) << 4;",
    "hi = (n >> 4 & 0x0F0F0F0Fu) | (hb & 0x0C0C0C0Cu) << 2;",
    "hfq6_join(n0, hb, a0, a2);",
    "hfq6_join(n1, hb >> 4, a1, a3);",
    "mma_s8_16x8x32(c[0][i], a0, a1, a2, a3, m % 2 ? q.z : q.x, m % 2 ? q.w : q.y);",
    "d[0] = ((const uint4*)base)[gid];",
    "d[1] = ((const uint4*)base)[gid + 8];",
    "for (int m = 0; m < 8; ++m) code[m] = ((const uint4*)(base + 256))[32 * m + lane];",
    "const bool upper = t >= 2;",
    "const bool mine = (bk == 1) == upper;",
    "mma_s8_16x8x32(c[bk][i], a0, a1, a2, a3, h ? q[i].z : q[i].x, h ? q[i].w : q[i].y);",
    "const int b = 2 * j + bk;",
    "const float d = pkv_half_bits_to_float((uint16_t)(b % 2 ? word >> 16 : word & 0xFFFFu));",
    "acc[r][i0 + i][e] += d * (f[i][e] * (float)c[bk][i][2 * r + e]);",
    "const int p = (8 * (i0 + i) + 2 * t + e) % 3;",
    "mma_group_q8<CH, NT>(acc, w, i0, t, x_words, x_sums);",
    "add_group<F, CH, NT>(acc, c, w.hdr, i0, t, x_sums);",
    "typename MmaWeightsOf<F>::type cur, nxt;",
    "static constexpr int BYTES = PKV_GEMV_MMA_ROWS * Format<F>::B * (256 / Format<F>::G);",
    "constexpr int TILE_BYTES = MmaTile<F>::BYTES;",
]


def weights_hip_text() -> str:
    """hip/weights.hip with every run of white space one blank (what KERNEL_TEXT lists are
    searched in)."""
    return " ".join(WEIGHTS_HIP.read_text(encoding="utf-8").split())


def missing_kernel_text(expressions: list[str]) -> list[str]:
    """The emulations' copied expressions that hip/weights.hip no longer has."""
    text = weights_hip_text()
    return [e for e in expressions if " ".join(e.split()) not in text]


def test_the_emulated_expressions_are_the_kernel_text():
    missing = missing_kernel_text(KERNEL_TEXT)
    assert not missing, f"hip/weights.hip no longer has {missing}: update the emulation"
    text = weights_hip_text()
    assert re.search(r"PKV_GEMV_MMA_KERNELS\(q8f16, Q8F16, PKV_GEMV_X_ROW_TILES_WIDE\)", text)
    assert re.search(r"PKV_GEMV_MMA_KERNELS\(hfq6g256, HFQ6G256, PKV_GEMV_X_ROW_TILES_WIDE\)", text)
    for fmt, F in (("hfq6g256", "HFQ6G256"), ("q8f16", "Q8F16")):
        for nt in (6, 12):
            assert f"PKV_GEMV_MMA_STAGED_KERNEL({fmt}, {F}, {nt})" in text


def test_wide_mma_chooses_over_the_variable_and_is_refused_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "1")
    assert not weights.Gemv(FakeCudaDevice(), "q8f16", 64, 512, 4, wide_mma=False).tensor_cores
    monkeypatch.delenv(weights.WIDE_MMA_ENV)
    g = weights.Gemv(FakeCudaDevice(), "hfq6g256", 64, 512, 4, wide_mma=True)
    assert g.tensor_cores and g._kernel.name == "pkv_gemv_mma_hfq6g256_n2"
    for fmt, K, device in [("q8f16", 288, FakeCudaDevice()),      # K not whole 256-groups
                           ("hfq4g256", 512, FakeCudaDevice()),   # a 4-bit format
                           ("q8f16", 512, FakeCudaDevice("sm_75"))]:  # no int8 mma.sync
        with pytest.raises(errors.InvalidArgument, match="wide_mma=True"):
            weights.Gemv(device, fmt, 64, K, 4, wide_mma=True)

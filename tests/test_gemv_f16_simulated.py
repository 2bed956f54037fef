"""The f16-activation GEMV of hip/weights.hip (gemv_f16) simulated in NumPy, lane by lane:
the f16 prep of x (gemv_prep_x_warp with n_tiles == 0: a power-of-two scale per (group, batch
row), one rounding to f16, each lane's 8 values permuted into one 16-byte unit), the packed
4-bit tiles (Gemv.pack, unchanged), the nibble pairs turned into exact f16 integers, the
m16n8k16 f16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), the epilogue per
affine span (a half group for MQ4G256V2, the whole group for HFQ4G256), the swizzled shared x and the split-K end, with the index expressions copied from
the kernel text. A layout mistake shows up here, without a GPU, as a wrong product; the GPU
tests compare the real kernel with the float64 reference (tests/test_kernels_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.kernels import weights
from test_gemv_mma_simulated import _case, _header_affine, _lanes, add_splits
from test_kernels_host import FakeCudaDevice

ROWS = weights.GEMV_MMA_ROWS  # 16 rows per tile


def _f16_pair(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Two float16[32] -> the uint32[32] register holding them (lo in the low half)."""
    return (lo.astype(np.float16).view(np.uint16).astype(np.uint32)
            | hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16)


def _halves(reg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = reg.astype(np.uint32)
    return ((r & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64),
            (r >> 16).astype(np.uint16).view(np.float16).astype(np.float64))


def mma_f16_16x8x16(c, a, b0, b1):
    """One warp's mma.sync.m16n8k16.row.col.f32.f16.f16.f32: a = 4 registers of 32 lanes,
    c float32[32, 4] updated. Every A and B element comes from exactly one (lane, register,
    half), which is checked; the f16 products are exact, summed in float64 here."""
    _, gid, t = _lanes()
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    seen_a = np.zeros((16, 16), int)
    seen_b = np.zeros((16, 8), int)
    for reg, (row_off, col_off) in zip(a, ((0, 0), (8, 0), (0, 8), (8, 8))):
        for e, v in enumerate(_halves(reg)):
            A[gid + row_off, col_off + 2 * t + e] = v
            np.add.at(seen_a, (gid + row_off, col_off + 2 * t + e), 1)
    for reg, k_off in zip((b0, b1), (0, 8)):
        for e, v in enumerate(_halves(reg)):
            B[k_off + 2 * t + e, gid] = v
            np.add.at(seen_b, (k_off + 2 * t + e, gid), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    C = A @ B
    for e in range(2):
        c[:, e] = (c[:, e] + C[gid, 2 * t + e]).astype(np.float32)
        c[:, 2 + e] = (c[:, 2 + e] + C[gid + 8, 2 * t + e]).astype(np.float32)


def prep_x_f16(x: np.ndarray, K: int, rotate: bool):
    """pkv_gemv_prep_x with n_tiles == 0: xh (uint32[groups, batch, 32 units, 4]) and xs."""
    batch, groups = x.shape[0], K // 256
    xh = np.zeros((groups, batch, 32, 4), np.uint32)
    xs = np.zeros((groups * batch, 4), np.float32)
    rounded = np.zeros((batch, K))  # the x the kernel multiplies (rotated basis)
    lane = np.arange(32)
    unit = 8 * (lane // 8) + 4 * (lane % 2) + (lane // 2) % 4  # the kernel's expression
    for b in range(batch):
        for g in range(groups):
            v = x[b, 256 * g:256 * g + 256].astype(np.float32).reshape(1, 256)
            if rotate:
                v = quant.fwht256(v).astype(np.float32)
            v = v.reshape(32, 8)
            _, e = np.frexp(np.abs(v).max())
            e = max(int(e), -104)
            h = (v * np.float32(2.0 ** (15 - e))).astype(np.float16)  # one rounding
            assert np.isfinite(h).all()
            for w, (i0, i1) in enumerate(((0, 4), (1, 5), (2, 6), (3, 7))):
                xh[g, b, unit, w] = _f16_pair(h[:, i0], h[:, i1])
            step = np.float32(2.0 ** (e - 15))
            rounded[b, 256 * g:256 * g + 256] = h.astype(np.float64).reshape(-1) * float(step)
            lo = h.astype(np.float32)[:16].sum(dtype=np.float32) * step
            hi = h.astype(np.float32)[16:].sum(dtype=np.float32) * step
            xs[g * batch + b] = (step, lo, hi, lo + hi)
    assert sorted(unit) == list(range(32))  # each lane's unit once
    return xh, xs, rounded


def xh_stage_unit(row, unit):
    return 32 * row + (unit ^ (4 * (row & 1)))


def nibble_pair_f16(w, s):
    """Nibbles s and 4 + s of code words w (bits 4s and 16 + 4s) as an f16 register pair."""
    w = w.astype(np.uint32)
    return _f16_pair(((w >> (4 * s)) & 0xF).astype(np.float64),
                     ((w >> (16 + 4 * s)) & 0xF).astype(np.float64))


def _lop3_pair_f16(w, s):
    """nibble_pair_f16 as the kernel computes it: one (mask, OR 0x6400) into f16 lanes, then
    f16 arithmetic, each step rounded once to f16 (sub.f16x2, fma.rn.f16x2)."""
    v = (w >> 8 if s >= 2 else w).astype(np.uint32)
    mask = 0x000F000F if s % 2 == 0 else 0x00F000F0
    lanes = ((v & mask) | 0x64006400).astype(np.uint32).view(np.float16).astype(np.float64)
    got = lanes - 1024 if s % 2 == 0 else lanes / 16 - 64  # exact products, one rounding
    return got.astype(np.float16).view(np.uint32)


def test_the_kernels_nibble_pair_arithmetic_gives_the_exact_codes():
    w = np.arange(1 << 16, dtype=np.uint32)
    words = (w * 0x9E3779B1 & 0xFFFFFFFF).astype(np.uint32)  # every nibble at every place
    words = np.concatenate([words, w | w << 16])
    for s in range(4):
        np.testing.assert_array_equal(_lop3_pair_f16(words, s), nibble_pair_f16(words, s))


def gemv_f16(packed, xh, xs, M, K, batch, v2, n_warps, tpw, splits):
    """gemv_f16<F, NT, TPW> on a grid (row blocks, splits) of n_warps-warp blocks."""
    lane, gid, t = _lanes()
    NT = -(-batch // 8)
    groups = K // 256
    words = packed.view(np.uint32)
    tile_words = ROWS * 136 // 4
    row_tiles = -(-M // ROWS)
    rows = n_warps * tpw * ROWS
    y = np.full((batch, M), np.nan, np.float32)
    partial = np.full((splits, batch, M), np.nan, np.float32)
    for bx in range(-(-row_tiles // (n_warps * tpw))):
        for split in range(splits):
            g_begin, g_end = split * groups // splits, (split + 1) * groups // splits
            acc = np.zeros((n_warps, tpw, 2, NT, 2, 32), np.float32)
            for g in range(g_begin, g_end):
                stage = np.zeros((8 * NT * 32, 4), np.uint32)  # rows past the batch: zeros
                written = np.zeros(len(stage), int)
                for u in range(batch * 32):
                    at = xh_stage_unit(u // 32, u % 32)
                    stage[at] = xh[g].reshape(-1, 4)[u]
                    written[at] += 1
                assert written.max() == 1
                for warp in range(n_warps):
                    tile0 = (bx * n_warps + warp) * tpw
                    if tile0 >= row_tiles:
                        continue
                    for u in range(tpw):
                        base = (min(tile0 + u, row_tiles - 1) * groups + g) * tile_words
                        hdr = [np.stack([words[base + 2 * (gid + 8 * r)],
                                         words[base + 2 * (gid + 8 * r) + 1]], axis=1)
                               for r in range(2)]
                        for hv in range(2):
                            code = [np.stack([words[base + 32 + 4 * (32 * k + lane) + w]
                                              for w in range(4)], axis=1) for k in (hv, 2 + hv)]
                            # the mma sums of one affine span: a half group (V2) or the
                            # whole group (HFQ4: its epilogue runs once, after half 1)
                            if v2 or hv == 0:
                                c = np.zeros((NT, 32, 4), np.float32)
                            for mm in range(4):
                                m = 4 * hv + mm
                                wa, wb = code[0][:, mm], code[1][:, mm]
                                a0 = [nibble_pair_f16(wa, 0), nibble_pair_f16(wb, 0),
                                      nibble_pair_f16(wa, 1), nibble_pair_f16(wb, 1)]
                                a1 = [nibble_pair_f16(wa, 2), nibble_pair_f16(wb, 2),
                                      nibble_pair_f16(wa, 3), nibble_pair_f16(wb, 3)]
                                for i in range(NT):
                                    xv = stage[xh_stage_unit(8 * i + gid, 4 * m + t)]
                                    mma_f16_16x8x16(c[i], a0, xv[:, 0], xv[:, 1])
                                    mma_f16_16x8x16(c[i], a1, xv[:, 2], xv[:, 3])
                            for i in range(NT if v2 or hv == 1 else 0):
                                for e in range(2):
                                    b = 8 * i + 2 * t + e
                                    s = np.where((b < batch)[:, None],
                                                 xs[np.minimum(g * batch + b, len(xs) - 1)], 0)
                                    s = s.astype(np.float32)
                                    xsum = (s[:, 2] if hv else s[:, 1]) if v2 else s[:, 3]
                                    for r in range(2):
                                        scale, offset = _header_affine(hdr[r], v2, hv if v2 else 0)
                                        acc[warp, u, r, i, e] += (
                                            scale * (s[:, 0] * c[i, :, 2 * r + e]) + offset * xsum)
            # the end, from the registers: lane (gid, t) stores rows 16 tile + gid + 8r,
            # batch rows 8i + 2t + e where both exist (the kernel's each_output)
            dst = y if splits == 1 else partial[split]
            written = np.zeros(dst.shape, int)
            for warp in range(n_warps):
                for u in range(tpw):
                    for r in range(2):
                        row = ((bx * n_warps + warp) * tpw + u) * ROWS + gid + 8 * r
                        for i in range(NT):
                            for e in range(2):
                                b = 8 * i + 2 * t + e
                                ok = (row < M) & (b < batch)
                                dst[b[ok], row[ok]] = acc[warp, u, r, i, e][ok]
                                written[b[ok], row[ok]] += 1
            row0 = bx * rows
            assert (written[:, row0:row0 + min(rows, M - row0)] == 1).all()  # each output once
        if splits > 1:  # the last block to arrive adds the splits in split order
            add_splits(y, partial, bx * rows, min(rows, M - bx * rows))
    return y


@pytest.mark.parametrize(("fmt", "batch", "warps", "tpw", "splits"), [
    ("hfq4g256", 32, 2, 2, 3), ("mq4g256v2", 32, 1, 2, 1), ("mq4g256v2", 11, 2, 1, 2),
    ("mq4g256", 5, 4, 1, 1), ("hfq4g256", 1, 1, 2, 4)])
def test_f16_gemv_simulated_is_the_product_within_the_f16_rounding_of_x(fmt, batch, warps,
                                                                         tpw, splits):
    M, K = 37, 1024  # three 16-row tiles (the last padded), 4 groups split over the blocks
    raw, x = _case(fmt, M, K, batch, seed=batch * 5 + warps)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, f16_x=True)
    assert g.f16_x and g._tiles == 0
    assert g._kernel.name == (f"pkv_gemv_f16_{g.fmt.kernel}_n{-(-batch // 8)}_"
                              f"t{weights.GEMV_F16_TILES_PER_WARP}")
    rotated = g.fmt.rotated
    xh, xs, rounded = prep_x_f16(x, K, rotated)
    y = gemv_f16(g.pack(raw), xh, xs, M, K, batch, fmt == "mq4g256v2", warps, tpw, splits)
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    bound = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64) @ wq.T
    err = np.abs(y - expect)
    assert (err <= weights.GEMV_F16_ERROR * bound + 1e-30).all()
    # and that error is the f16 rounding of x, not a layout's: against the product with
    # the rounded x the model is within the f32 sums' error
    assert err.max() > 1e-5 * bound.max()
    np.testing.assert_array_less(np.abs(y - rounded @ wq_signed(raw, fmt, M, K).T),
                                 2.0 ** -18 * bound + 1e-30)


def wq_signed(raw, fmt, M, K):
    return quant.dequantize(raw, fmt, (M, K), basis="rotated").astype(np.float64)


def test_the_f16_x_swizzle_is_free_of_shared_bank_conflicts():
    # 8 lanes per 128-bit phase: rows gid = 2p, 2p + 1, t = 0..3, unit 4m + t
    for m in range(8):
        for i in range(4):
            for phase in range(4):
                lanes = range(8 * phase, 8 * phase + 8)
                groups = {xh_stage_unit(8 * i + lane // 4, 4 * m + lane % 4) % 8 for lane in lanes}
                assert len(groups) == 8
    units = [xh_stage_unit(u // 32, u % 32) for u in range(32 * 32)]
    assert sorted(units) == list(range(32 * 32))


def test_the_f16_mma_fragment_model_is_a_16x8x16_product():
    rng = np.random.default_rng(0)
    A = rng.integers(-8, 8, (16, 16)).astype(np.float64)
    B = rng.integers(-8, 8, (16, 8)).astype(np.float64)
    _, gid, t = _lanes()
    a = [_f16_pair(A[gid + ro, co + 2 * t], A[gid + ro, co + 2 * t + 1])
         for ro, co in ((0, 0), (8, 0), (0, 8), (8, 8))]
    b0 = _f16_pair(B[2 * t, gid], B[2 * t + 1, gid])
    b1 = _f16_pair(B[8 + 2 * t, gid], B[9 + 2 * t, gid])
    c = np.zeros((32, 4), np.float32)
    mma_f16_16x8x16(c, a, b0, b1)
    C = A @ B
    np.testing.assert_array_equal(c[:, 0], C[gid, 2 * t])
    np.testing.assert_array_equal(c[:, 3], C[gid + 8, 2 * t + 1])

"""The AMD matrix-core GEMV of hip/weights.hip (``gemv_mfma``, gfx90a and gfx940-942)
simulated in NumPy, lane by lane over a 64-lane wavefront: the kernel's loads of the packed
weight tiles and of the prepared x (the NVIDIA kernel's layouts, unchanged), its nibble
masks, its MFMA fragments and its epilogue and chunked shared-memory reduction, with the
index expressions copied from the kernel text. No AMD GPU is available to the project:
this emulation and hipcc compiling the file for gfx90a/gfx940 are all the checking the AMD
path has (docs/kernels.md, "AMD matrix cores").

The MFMA register layouts modelled here (lane l, i = l % 16, q = l // 16) are the ones the
AMD matrix instruction calculator prints for CDNA2 ``v_mfma_i32_16x16x16i8`` and CDNA3
``v_mfma_i32_16x16x32_i8``: A byte b of register v is ``A[i][4q + b]`` (k-16) or
``A[i][8q + 4v + b]`` (k-32), B the same with i as the column, D register r is
``D[4q + r][i]``; test_the_mfma_models_match_the_documented_layout pins entries of those
tables."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.kernels import weights
from test_gemv_mma_simulated import _bytes_s8, _case, _header_affine, gemv_mma_tiled, prep_x
from test_kernels_host import FakeCudaDevice

ROWS = weights.GEMV_MMA_ROWS  # 16: one MFMA M tile per block
X_WORDS = weights.GEMV_X_WORDS


def _wave():
    lane = np.arange(64)
    return lane % 16, lane // 16  # i, q


def mfma_i32_16x16x16i8(c, a, b):
    """v_mfma_i32_16x16x16i8 (gfx90a): a, b uint32[64] (4 int8 each), c int64[64, 4]."""
    i, q = _wave()
    A = np.zeros((16, 16), np.int64)
    B = np.zeros((16, 16), np.int64)
    seen_a, seen_b = np.zeros((16, 16), int), np.zeros((16, 16), int)
    va, vb = _bytes_s8(a), _bytes_s8(b)
    for byte in range(4):
        A[i, 4 * q + byte] = va[:, byte]
        np.add.at(seen_a, (i, 4 * q + byte), 1)
        B[4 * q + byte, i] = vb[:, byte]
        np.add.at(seen_b, (4 * q + byte, i), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    _accumulate(c, A @ B)


def mfma_i32_16x16x32_i8(c, a_lo, a_hi, b_lo, b_hi):
    """v_mfma_i32_16x16x32_i8 (gfx940-942): A and B 64-bit per lane (register v = 0 the low
    word), c int64[64, 4]."""
    i, q = _wave()
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 16), np.int64)
    seen_a, seen_b = np.zeros((16, 32), int), np.zeros((32, 16), int)
    for v, (a, b) in enumerate(((a_lo, b_lo), (a_hi, b_hi))):
        va, vb = _bytes_s8(a), _bytes_s8(b)
        for byte in range(4):
            k = 8 * q + 4 * v + byte
            A[i, k] = va[:, byte]
            np.add.at(seen_a, (i, k), 1)
            B[k, i] = vb[:, byte]
            np.add.at(seen_b, (k, i), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    _accumulate(c, A @ B)


def _accumulate(c, D):
    i, q = _wave()
    for r in range(4):
        c[:, r] += D[4 * q + r, i]
    assert np.abs(c).max() < 2**31  # int32 accumulators


def mfma_i8_16x16x32(c, a_lo, a_hi, b_lo, b_hi, k_per_instruction):
    """weights.hip's mfma_i8_16x16x32: one CDNA3 instruction or two gfx90a ones."""
    if k_per_instruction == 32:
        mfma_i32_16x16x32_i8(c, a_lo, a_hi, b_lo, b_hi)
    else:
        mfma_i32_16x16x16i8(c, a_lo, b_lo)
        mfma_i32_16x16x16i8(c, a_hi, b_hi)


def gemv_mfma(packed, xq, xs, M, K, batch, NT, v2, n_waves, k_per_instruction, sums=None):
    """gemv_mfma<F, NT>: y[batch, M]. ``sums``, when given, collects the int32 sums per
    (block, group, half) as int64[blocks, groups, halves, 16, 16 * T16]."""
    i, q = _wave()
    T16 = (NT + 1) // 2
    CH = min(T16, 3)
    assert T16 % CH == 0
    ROWS_PER_CHUNK = 16 * CH // 3
    groups = K // 256
    tile_bytes = ROWS * 136
    halves = 2 if v2 else 1
    words = packed.view(np.uint32)
    y = np.full((batch, M), np.nan, np.float32)
    for block in range(-(-M // ROWS)):
        row0 = block * ROWS
        acc_all = np.zeros((n_waves, T16, 4, 64), np.float32)
        for wave in range(n_waves):
            g_begin, g_end = wave * groups // n_waves, (wave + 1) * groups // n_waves
            acc = acc_all[wave]
            for g in range(g_begin, g_end):
                base = (block * groups + g) * tile_bytes // 4  # in words
                hdr = [np.stack([words[base + 2 * (4 * q + r)], words[base + 2 * (4 * q + r) + 1]],
                                axis=1) for r in range(4)]
                code = []
                for jj in range(2):
                    at = 32 * (2 * (i // 8) + jj) + 4 * (i % 8) + q  # uint4 index
                    code.append(np.stack([words[base + 32 + 4 * at + w] for w in range(4)], axis=1))
                scale = [[_header_affine(hdr[r], v2, hv)[0] for r in range(4)]
                         for hv in range(halves)]
                offset = [[_header_affine(hdr[r], v2, hv)[1] for r in range(4)]
                          for hv in range(halves)]
                for T0 in range(0, T16, CH):
                    xb = np.zeros((CH, 4, 64, 4), np.uint32)  # [T][v][lane][xyzw]
                    for T in range(CH):
                        col = 16 * (T0 + T) + i
                        nt, n = col // 8, col % 8
                        live = col < 3 * batch
                        for v in range(4):
                            at = ((g * NT + nt) * 32 + 4 * n + q) * X_WORDS + 4 * v
                            at = np.where(live, at, 0)  # a dead lane reads nothing
                            vals = np.stack([xq[at + w] for w in range(4)], axis=1)
                            xb[T, v] = np.where(live[:, None], vals, 0)
                    c = np.zeros((halves, CH, 64, 4), np.int64)
                    for m in range(8):
                        j, h, hv = m // 2, m % 2, (m // 4 if halves == 2 else 0)
                        pa = code[j // 2]
                        wa = pa[:, 2 * (j % 2) + h]
                        a_lo, a_hi = wa & 0x0F0F0F0F, (wa >> 4) & 0x0F0F0F0F
                        for T in range(CH):
                            xw = xb[T, m // 2]
                            b_lo = xw[:, 2] if h else xw[:, 0]
                            b_hi = xw[:, 3] if h else xw[:, 1]
                            mfma_i8_16x16x32(c[hv, T], a_lo, a_hi, b_lo, b_hi, k_per_instruction)
                    if sums is not None:
                        for hv in range(halves):
                            for T in range(CH):
                                for r in range(4):
                                    sums[block, g, hv, 4 * q + r, 16 * (T0 + T) + i] = c[hv, T, :, r]
                    for T in range(CH):
                        col = 16 * (T0 + T) + i
                        p, b = col % 3, col // 3
                        s = np.where((b < batch)[:, None],
                                     xs[np.minimum(g * batch + b, len(xs) - 1)], 0)
                        s = s.astype(np.float32)
                        f = s[:, 0] * np.float32([1, 256, 65536])[p]
                        for r in range(4):
                            v = scale[0][r] * (f * c[0, T, :, r].astype(np.float32))
                            if halves == 2:
                                v += scale[1][r] * (f * c[1, T, :, r].astype(np.float32))
                            off = (offset[0][r] * s[:, 1] + offset[1][r] * s[:, 2]
                                   if halves == 2 else offset[0][r] * s[:, 3])
                            v = np.where(p == 0, v + off, v)
                            acc[T0 + T, r] += v
        for T0 in range(0, T16, CH):
            red = np.zeros((n_waves, ROWS, 16 * CH), np.float32)
            for wave in range(n_waves):
                for T in range(CH):
                    for r in range(4):
                        red[wave, 4 * q + r, 16 * T + i] = acc_all[wave, T0 + T, r]
            b0 = T0 // CH * ROWS_PER_CHUNK
            nb = min(ROWS_PER_CHUNK, batch - b0)
            for bl in range(nb):
                cols = red[:, :, 3 * bl:3 * bl + 3].sum(axis=(0, 2), dtype=np.float32)
                n = min(ROWS, M - row0)  # rows past M are not stored
                y[b0 + bl, row0:row0 + n] = cols[:n]
    return y


def _exact_sums(raw, x, M, K, rotated, v2):
    """The int32 sums the kernel must produce, from the definitions: 4-bit codes (LSB-first
    nibbles after each group's 8-byte header) times the byte planes of x's 22-bit integers,
    per (row, group, half, column 3b + p). int64[blocks, groups, halves, 16, 3 * batch]."""
    batch, groups = x.shape[0], K // 256
    halves = 2 if v2 else 1
    grp = raw.reshape(M, groups, 136)[:, :, 8:]
    codes = np.stack([grp & 0x0F, grp >> 4], axis=-1).reshape(M, groups, 256).astype(np.int64)
    xr = quant.fwht256(x.reshape(-1, 256)).reshape(x.shape) if rotated else x
    v = xr.astype(np.float32).reshape(batch, groups, 256)
    amax = np.abs(v).max(axis=2, keepdims=True)
    e = np.maximum(np.frexp(amax)[1], -104)
    xi = np.rint(v * np.ldexp(np.float32(1), 22 - e)).astype(np.int64)  # exact scaling
    p0 = (xi & 0xFF).astype(np.int8).astype(np.int64)
    p1 = (((xi - p0) >> 8) & 0xFF).astype(np.int8).astype(np.int64)
    p2 = (xi - p0 - (p1 << 8)) >> 16
    assert (p0 + (p1 << 8) + (p2 << 16) == xi).all()
    planes = np.stack([p0, p1, p2], axis=1).reshape(3 * batch, groups, 256)  # col 3b + p
    blocks = -(-M // ROWS)
    padded = np.zeros((blocks * ROWS, groups, 256), np.int64)
    padded[:M] = codes
    per = 256 // halves
    out = np.zeros((blocks, groups, halves, ROWS, 3 * batch), np.int64)
    for g in range(groups):
        for hv in range(halves):
            k = slice(per * hv, per * hv + per)
            out[:, g, hv] = (padded[:, g, k] @ planes[:, g, k].T).reshape(blocks, ROWS, -1)
    return out


@pytest.mark.parametrize("k_per_instruction", [16, 32])  # gfx90a, gfx940-942
@pytest.mark.parametrize(("fmt", "batch", "waves"), [
    ("hfq4g256", 1, 2), ("mq4g256", 2, 1), ("mq4g256v2", 3, 3), ("hfq4g256", 8, 4),
    ("mq4g256v2", 11, 2), ("hfq4g256", 16, 1), ("mq4g256", 17, 3), ("mq4g256v2", 32, 2)])
def test_mfma_gemv_simulated_gives_the_exact_sums_and_the_nvidia_kernels_outputs(
        fmt, batch, waves, k_per_instruction):
    M, K = 37, 1024  # three 16-row tiles (the last padded), 4 groups split over the waves
    raw, x = _case(fmt, M, K, batch, seed=batch * 13 + waves)
    # the n-tiles AMD launches (n1-n3, tiled n6/n12): the staged kernel's, not the pipelined n9
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, pipe=False)
    NT, v2, rotated = g._tiles, fmt == "mq4g256v2", g.fmt.rotated
    packed = g.pack(raw)
    xq, xs = prep_x(x, K, NT, rotated)
    T16 = (NT + 1) // 2
    sums = np.full((3, K // 256, 2 if v2 else 1, ROWS, 16 * T16), -2**40, np.int64)
    y = gemv_mfma(packed, xq, xs, M, K, batch, NT, v2, waves, k_per_instruction, sums)
    # every int32 sum is the exact integer product of codes and x's byte planes; columns
    # past 3 * batch (zero x) sum to 0
    exact = _exact_sums(raw, x, M, K, rotated, v2)
    np.testing.assert_array_equal(sums[..., :3 * batch], exact)
    assert (sums[..., 3 * batch:] == 0).all()
    # the outputs are the NVIDIA kernel's (same epilogue, order and reduction), bit for bit
    nvidia = gemv_mma_tiled(packed, xq, xs, M, K, batch, NT, v2, waves, chunk=min(NT, 3))
    np.testing.assert_array_equal(y, nvidia)
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    xr = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - expect), 2e-6 * (xr @ wq.T) + 1e-30)


def test_the_mfma_models_match_the_documented_layout():
    # Entries of the calculator's tables (CDNA2 v_mfma_i32_16x16x16i8, CDNA3
    # v_mfma_i32_16x16x32_i8): a one-hot A or B byte lands where the table says.
    def product(k32, a_lane, a_byte, b_lane, b_byte):
        regs = [np.zeros(64, np.uint32) for _ in range(4)]
        regs[a_byte // 4][a_lane] = np.uint32(1 << (8 * (a_byte % 4)))
        regs[2 + b_byte // 4][b_lane] = np.uint32(1 << (8 * (b_byte % 4)))
        c = np.zeros((64, 4), np.int64)
        if k32:
            mfma_i32_16x16x32_i8(c, regs[0], regs[1], regs[2], regs[3])
        else:
            mfma_i32_16x16x16i8(c, regs[0], regs[2])
        return {(int(lane), int(r)) for lane, r in zip(*np.nonzero(c))}
    # k-16: lane 17 byte 2 is A[1][6]; lane 18 byte 2 is B[6][2]: D[1][2] is lane 2, v1
    assert product(False, 17, 2, 18, 2) == {(2, 1)}
    assert product(False, 17, 2, 18, 3) == set()  # B[7][2]: another k
    # k-32: lane 37 v1 byte 3 is A[5][8*2+4+3 = 23]; lane 41 v1 byte 3 is B[23][9]:
    # D[5][9] is lane 16 + 9 = 25, v1
    assert product(True, 37, 7, 41, 7) == {(25, 1)}
    assert product(True, 37, 7, 41, 3) == set()

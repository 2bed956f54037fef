"""The AMD matrix-core GEMV of hip/weights.hip (``gemv_amd_mc``: MFMA on gfx908/gfx90a and
gfx940-942, WMMA on gfx11) simulated in NumPy, lane by lane over a wavefront: the kernel's
loads of the packed weight tiles and of the prepared x (the NVIDIA kernel's layouts,
unchanged), its nibble masks, its matrix-instruction fragments, its epilogue and chunked
shared-memory reduction, with the index expressions copied from the kernel text
(``KERNEL_TEXT`` pins those of AmdCodes and the Q8F16 block split). Every format: the 4-bit
ones against tests/test_gemv_mma_simulated.py's NVIDIA model, HFQ6G256 and Q8F16 against
tests/test_gemv_hfq6_q8f16_mma_simulated.py's, on the real packings. No AMD GPU
is available to the project: this emulation, hipcc compiling the file for gfx90a/gfx940 and
hip/gfx11_codegen.py compiling it for gfx1100 are all the checking the AMD path has
(docs/kernels.md, "AMD matrix cores").

Register layouts modelled here. MFMA (wavefront of 64; lane l, i = l % 16, q = l // 16), as
the AMD matrix instruction calculator prints them for CDNA2 ``v_mfma_i32_16x16x16i8`` and
CDNA3 ``v_mfma_i32_16x16x32_i8``: A byte b of register v is ``A[i][4q + b]`` (k-16) or
``A[i][8q + 4v + b]`` (k-32), B the same with i as the column, D register r is
``D[4q + r][i]``. WMMA (wave32, RDNA3 ``v_wmma_i32_16x16x16_iu8``): lane l holds
``A[l % 16][4w + b]`` in byte b of register w (and B's column l % 16 the same way), lanes
16-31 must repeat lanes 0-15, and D register r is ``D[2r + l // 16][l % 16]``.
test_the_matrix_instruction_models_match_the_documented_layouts pins entries of those
tables."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.kernels import weights
from test_gemv_hfq6_q8f16_mma_simulated import _case as _wide_case
from test_gemv_hfq6_q8f16_mma_simulated import (
    _check,
    _f16,
    _mutant_error,
    gemv_mma_6,
    gemv_mma_q8,
    hfq6_join,
    missing_kernel_text,
)
from test_gemv_mma_simulated import (
    _bytes_s8,
    _case,
    _garbage_past_the_batch,
    _header_affine,
    gemv_mma_tiled,
    prep_x,
)
from test_kernels_host import FakeCudaDevice

ROWS = weights.GEMV_MMA_ROWS  # 16: one 16x16 tile of rows per block
X_WORDS = weights.GEMV_X_WORDS


def mfma_i32_16x16x16i8(c, a, b):
    """v_mfma_i32_16x16x16i8 (gfx90a): a, b uint32[64] (4 int8 each), c int64[64, 4]."""
    lane = np.arange(64)
    i, q = lane % 16, lane // 16
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
    _accumulate_mfma(c, A @ B)


def mfma_i32_16x16x32_i8(c, a_lo, a_hi, b_lo, b_hi):
    """v_mfma_i32_16x16x32_i8 (gfx940-942): A and B 64-bit per lane (register v = 0 the low
    word), c int64[64, 4]."""
    lane = np.arange(64)
    i, q = lane % 16, lane // 16
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
    _accumulate_mfma(c, A @ B)


def _accumulate_mfma(c, D):
    lane = np.arange(64)
    for r in range(4):
        c[:, r] += D[4 * (lane // 16) + r, lane % 16]
    assert np.abs(c).max() < 2**31  # int32 accumulators


def wmma_i32_16x16x16_iu8(c, a, b):
    """v_wmma_i32_16x16x16_iu8 (gfx11, wave32, both operands signed): a, b uint32[4, 32] (4
    registers of 4 int8 per lane), c int64[32, 8]. Lanes 16-31 must hold lanes 0-15's
    operands (the instruction reads one half-wave's copy; a kernel that lets them differ
    is wrong on hardware), which is checked."""
    a, b = np.asarray(a, np.uint32), np.asarray(b, np.uint32)
    assert (a[:, 16:] == a[:, :16]).all() and (b[:, 16:] == b[:, :16]).all()
    A = np.zeros((16, 16), np.int64)
    B = np.zeros((16, 16), np.int64)
    for w in range(4):
        va, vb = _bytes_s8(a[w, :16]), _bytes_s8(b[w, :16])
        for byte in range(4):
            A[:, 4 * w + byte] = va[:, byte]  # lane i: row i
            B[4 * w + byte, :] = vb[:, byte]  # lane i: column i
    D = A @ B
    lane = np.arange(32)
    for r in range(8):
        c[:, r] += D[2 * r + lane // 16, lane % 16]
    assert np.abs(c).max() < 2**31  # int32 accumulators


@dataclass(frozen=True)
class Frag:
    """weights.hip's MfmaI8 / WmmaI8: wavefront size, k-quads per lane, D rows per lane."""
    name: str
    wave: int
    quads: int
    d_rows: int
    k_per_instruction: int = 16

    def quad(self, lane, qq):
        return lane // 16 if self.quads == 1 else np.full_like(lane, qq)

    def d_row(self, lane, r):
        return 4 * (lane // 16) + r if self.quads == 1 else 2 * r + lane // 16

    def product(self, c, a_lo, a_hi, b_lo, b_hi):
        """``MC::product``: a_lo[quad] etc. uint32[lanes]; c int64[lanes, d_rows]."""
        if self.quads == 4:
            wmma_i32_16x16x16_iu8(c, a_lo, b_lo)
            wmma_i32_16x16x16_iu8(c, a_hi, b_hi)
        elif self.k_per_instruction == 32:
            mfma_i32_16x16x32_i8(c, a_lo[0], a_hi[0], b_lo[0], b_hi[0])
        else:
            mfma_i32_16x16x16i8(c, a_lo[0], b_lo[0])
            mfma_i32_16x16x16i8(c, a_hi[0], b_hi[0])

    def product_blocks(self, c, lane, a_lo, a_hi, b_lo, b_hi, block_quads=None):
        """``MC::product_blocks`` (Q8F16): c[bk] += the product over quads ``block_quads(bk)``
        (the kernel's 2bk, 2bk + 1; a mutation test changes it). MFMA: the product with the
        other quads' lanes zeroed; WMMA: one instruction of the block's two quads."""
        block_quads = block_quads or (lambda bk: (2 * bk, 2 * bk + 1))
        for bk in range(2):
            q0, q1 = block_quads(bk)
            if self.quads == 1:
                mine = (lane // 16 == q0) | (lane // 16 == q1)  # the kernel's lane / 32 == bk
                self.product(c[bk], [np.where(mine, a_lo[0], 0).astype(np.uint32)],
                             [np.where(mine, a_hi[0], 0).astype(np.uint32)], b_lo, b_hi)
            else:
                wmma_i32_16x16x16_iu8(c[bk], [a_lo[q0], a_lo[q1], a_hi[q0], a_hi[q1]],
                                      [b_lo[q0], b_lo[q1], b_hi[q0], b_hi[q1]])


MFMA_GFX90A = Frag("mfma k16 (gfx908/gfx90a)", 64, 1, 4, 16)
MFMA_CDNA3 = Frag("mfma k32 (gfx940-942)", 64, 1, 4, 32)
WMMA_GFX11 = Frag("wmma (gfx11)", 32, 4, 8)


#: Bytes of one packed (16-row tile, group): gemv_amd_mc's TILE_BYTES, gemv_mma's.
TILE_BYTES = {"hfq4g256": ROWS * 136, "mq4g256v2": ROWS * 136, "hfq6g256": ROWS * 200,
              "q8f16": ROWS * 8 * 34}


class AmdCodes:
    """weights.hip's AmdCodes<F, QUADS>: one lane's A words of one (tile, group), read from
    ``words`` at word ``base``; ``a(qq, m)`` is k-quad qq's (lo, hi) of mma m for row i.
    ``hb_shift``: how far rows 8-15's HFQ6 high bits move (the kernel's 4; a mutation test
    changes it)."""

    def __init__(self, fmt, words, base, i, L, hb_shift=4):
        self.fmt, self.words, self.i, self.L, self.hb_shift = fmt, words, i, L, hb_shift
        if fmt in ("hfq4g256", "mq4g256v2"):
            self.code = [[np.stack([words[base + 32 + 4 * (32 * (2 * (i // 8) + jj) + Lq) + w]
                                    for w in range(4)], axis=1) for jj in range(2)] for Lq in L]
        elif fmt == "hfq6g256":  # w[qq] = (const uint32_t*)(base + 128) + 4 * L[qq]
            self.w = [base + 32 + 4 * Lq for Lq in L]
        else:  # w[qq] = (const uint32_t*)(base + 256) + 4 * L[qq] + i / 8
            self.w = [base + 64 + 4 * Lq + i // 8 for Lq in L]

    def a(self, qq, m):
        words, half = self.words, self.i // 8
        if self.fmt in ("hfq4g256", "mq4g256v2"):
            wa = self.code[qq][m // 4][:, m % 4]
            return wa & 0x0F0F0F0F, (wa >> 4) & 0x0F0F0F0F
        if self.fmt == "hfq6g256":
            def word(x):
                return words[self.w[qq] + 4 * 32 * (x // 4) + x % 4].astype(np.uint32)
            n = np.where(half == 1, word(3 * m + 1), word(3 * m)).astype(np.uint32)
            lo, hi = hfq6_join(n, (word(3 * m + 2) >> (self.hb_shift * half)).astype(np.uint32))
            return lo.astype(np.uint32), hi.astype(np.uint32)
        return words[self.w[qq] + 4 * 32 * m], words[self.w[qq] + 4 * 32 * m + 2]


def gemv_amd_mc(packed, xq, xs, M, K, batch, NT, fmt, n_waves, frag, sums=None,
                hb_shift=4, block_quads=None):
    """gemv_amd_mc<F, NT, MC> for F = ``fmt``'s kernel (hfq4g256, mq4g256v2, hfq6g256,
    q8f16): y[batch, M]. ``sums``, when given, collects the int32 sums per (block, group,
    part, row, column) as int64[blocks, groups, parts, 16, 16 * T16]: parts are the affine
    halves (V2: 2, else 1), Q8F16's 8 blocks of 32. ``hb_shift`` / ``block_quads``:
    mutations (AmdCodes, Frag.product_blocks)."""
    lane = np.arange(frag.wave)
    i = lane % 16
    T16 = (NT + 1) // 2
    CH = min(T16, 3)
    assert T16 % CH == 0
    ROWS_PER_CHUNK = 16 * CH // 3
    groups = K // 256
    tile_bytes = TILE_BYTES[fmt]
    v2, q8 = fmt == "mq4g256v2", fmt == "q8f16"
    halves = 2 if v2 else 1
    n_sums = 2 if q8 else halves  # SUMS
    L = [4 * (i % 8) + frag.quad(lane, qq) for qq in range(frag.quads)]
    words = packed.view(np.uint32)
    y = np.full((batch, M), np.nan, np.float32)
    for block in range(-(-M // ROWS)):
        row0 = block * ROWS
        red = np.full((n_waves, ROWS, 16 * CH), np.nan, np.float32)
        for T in range(T16):
            col = 16 * T + i
            n, p, b = col % 8, col % 3, col // 3
            live = col < 3 * batch
            nt = np.minimum(col // 8, NT - 1)
            for wave in range(n_waves):
                g_begin, g_end = wave * groups // n_waves, (wave + 1) * groups // n_waves
                acc = np.zeros((frag.d_rows, frag.wave), np.float32)
                for g in range(g_begin, g_end):
                    base = (block * groups + g) * tile_bytes // 4  # in words
                    codes = AmdCodes(fmt, words, base, i, L, hb_shift)
                    s = np.where((b < batch)[:, None], xs[np.minimum(g * batch + b, len(xs) - 1)], 0)
                    s = s.astype(np.float32)
                    f = s[:, 0] * np.float32([1, 256, 65536])[p]  # plane_step
                    c = np.zeros((n_sums, frag.wave, frag.d_rows), np.int64)
                    for j in range(4):
                        xw = []
                        for qq in range(frag.quads):
                            at = ((g * NT + nt) * 32 + 4 * n + frag.quad(lane, qq)) * X_WORDS + 4 * j
                            vals = np.stack([xq[at + w] for w in range(4)], axis=1)
                            xw.append(np.where(live[:, None], vals, 0).astype(np.uint32))
                        for h in range(2):
                            m = 2 * j + h
                            a_lo, a_hi, b_lo, b_hi = [], [], [], []
                            for qq in range(frag.quads):
                                lo, hi = codes.a(qq, m)
                                a_lo.append(lo)
                                a_hi.append(hi)
                                b_lo.append(xw[qq][:, 2 if h else 0])
                                b_hi.append(xw[qq][:, 3 if h else 1])
                            if q8:
                                frag.product_blocks(c, lane, a_lo, a_hi, b_lo, b_hi, block_quads)
                            else:
                                frag.product(c[m // 4 if halves == 2 else 0], a_lo, a_hi, b_lo,
                                             b_hi)
                        if q8:  # mma_group_q8's epilogue, blocks 2j and 2j + 1
                            for bk in range(2):
                                for r in range(frag.d_rows):
                                    word = words[base + 4 * frag.d_row(lane, r) + j]
                                    d = _f16(word >> 16 if bk else word & 0xFFFF)
                                    acc[r] += d * (f * c[bk, :, r].astype(np.float32))
                                    if sums is not None:
                                        sums[block, g, 2 * j + bk, frag.d_row(lane, r), col] = \
                                            c[bk, :, r]
                            c[:] = 0
                    if q8:
                        continue
                    if sums is not None:
                        for hv in range(halves):
                            for r in range(frag.d_rows):
                                sums[block, g, hv, frag.d_row(lane, r), col] = c[hv, :, r]
                    for r in range(frag.d_rows):
                        hdr = np.stack([words[base + 2 * frag.d_row(lane, r)],
                                        words[base + 2 * frag.d_row(lane, r) + 1]], axis=1)
                        scale = [_header_affine(hdr, v2, hv)[0] for hv in range(halves)]
                        offset = [_header_affine(hdr, v2, hv)[1] for hv in range(halves)]
                        v = scale[0] * (f * c[0, :, r].astype(np.float32))
                        if halves == 2:
                            v += scale[1] * (f * c[1, :, r].astype(np.float32))
                        off = (offset[0] * s[:, 1] + offset[1] * s[:, 2]
                               if halves == 2 else offset[0] * s[:, 3])
                        v = np.where(p == 0, v + off, v)
                        acc[r] += v
                seen = np.zeros((ROWS, 16), int)
                for r in range(frag.d_rows):
                    red[wave, frag.d_row(lane, r), 16 * (T % CH) + i] = acc[r]
                    np.add.at(seen, (frag.d_row(lane, r), i), 1)
                assert (seen == 1).all()  # every (row, column) of the tile is one lane's
            if T % CH == CH - 1:
                b0 = T // CH * ROWS_PER_CHUNK
                nb = min(ROWS_PER_CHUNK, batch - b0)
                for bl in range(nb):
                    cols = red[:, :, 3 * bl:3 * bl + 3].sum(axis=(0, 2), dtype=np.float32)
                    rows = min(ROWS, M - row0)  # rows past M are not stored
                    y[b0 + bl, row0:row0 + rows] = cols[:rows]
                red[:] = np.nan  # the next chunk must write every slot it reads
    return y


def _codes(raw, fmt, M, groups):
    """The integer codes from the stored bytes, by the formats' definitions (docs/formats):
    4-bit LSB-first nibbles after each group's 8-byte header, HFQ6 4 codes per 3 bytes LSB
    first after it, Q8F16 the 32 signed bytes after each block's f16 scale.
    int64[M, groups, 256]."""
    if fmt == "q8f16":
        blocks = raw.reshape(M, groups, 8, 34)[..., 2:].view(np.int8)
        return blocks.reshape(M, groups, 256).astype(np.int64)
    if fmt == "hfq6g256":
        grp = raw.reshape(M, groups, 200)[:, :, 8:].reshape(M, groups, 64, 3).astype(np.int64)
        bits = grp[..., 0] | grp[..., 1] << 8 | grp[..., 2] << 16
        return np.stack([(bits >> (6 * k)) & 63 for k in range(4)], axis=-1).reshape(
            M, groups, 256)
    grp = raw.reshape(M, groups, 136)[:, :, 8:]
    return np.stack([grp & 0x0F, grp >> 4], axis=-1).reshape(M, groups, 256).astype(np.int64)


def _exact_sums(raw, x, M, K, rotated, fmt):
    """The int32 sums the kernel must produce, from the definitions: the codes (_codes)
    times the byte planes of x's 22-bit integers, per (row, group, part, column 3b + p), parts
    as gemv_amd_mc's ``sums``. int64[blocks, groups, parts, 16, 3 * batch]."""
    batch, groups = x.shape[0], K // 256
    parts = {"mq4g256v2": 2, "q8f16": 8}.get(fmt, 1)
    codes = _codes(raw, fmt, M, groups)
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
    per = 256 // parts
    out = np.zeros((blocks, groups, parts, ROWS, 3 * batch), np.int64)
    for g in range(groups):
        for hv in range(parts):
            k = slice(per * hv, per * hv + per)
            out[:, g, hv] = (padded[:, g, k] @ planes[:, g, k].T).reshape(blocks, ROWS, -1)
    return out


@pytest.mark.parametrize("frag", [MFMA_GFX90A, MFMA_CDNA3, WMMA_GFX11], ids=lambda f: f.name)
@pytest.mark.parametrize(("fmt", "batch", "waves"), [
    ("hfq4g256", 1, 2), ("mq4g256", 2, 1), ("mq4g256v2", 3, 3), ("hfq4g256", 8, 4),
    ("mq4g256v2", 11, 2), ("hfq4g256", 16, 1), ("mq4g256", 17, 3), ("mq4g256v2", 32, 2)])
def test_amd_matrix_core_gemv_simulated_gives_the_exact_sums_and_the_nvidia_kernels_outputs(
        fmt, batch, waves, frag):
    M, K = 37, 1024  # three 16-row tiles (the last padded), 4 groups split over the waves
    raw, x = _case(fmt, M, K, batch, seed=batch * 13 + waves)
    # the n-tiles AMD launches (n1-n3, tiled n6/n12): the staged kernel's, not the pipelined n9
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, pipe=False)
    NT, v2, rotated = g._tiles, fmt == "mq4g256v2", g.fmt.rotated
    packed = g.pack(raw)
    xq, xs = prep_x(x, K, NT, rotated)
    # the kernel loads the columns past 3 * batch and zeroes them: they hold garbage here
    xq_dirty = _garbage_past_the_batch(xq, K, NT, batch, seed=batch)
    T16 = (NT + 1) // 2
    sums = np.full((3, K // 256, 2 if v2 else 1, ROWS, 16 * T16), -2**40, np.int64)
    y = gemv_amd_mc(packed, xq_dirty, xs, M, K, batch, NT, g.fmt.kernel, waves, frag, sums)
    # every int32 sum is the exact integer product of codes and x's byte planes; columns
    # past 3 * batch (zero x) sum to 0
    exact = _exact_sums(raw, x, M, K, rotated, g.fmt.kernel)
    np.testing.assert_array_equal(sums[..., :3 * batch], exact)
    assert (sums[..., 3 * batch:] == 0).all()
    # the outputs are the NVIDIA kernel's (same epilogue, order and reduction), bit for bit
    nvidia = gemv_mma_tiled(packed, xq, xs, M, K, batch, NT, v2, waves, chunk=min(NT, 3))
    np.testing.assert_array_equal(y, nvidia)
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    xr = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - expect), 2e-6 * (xr @ wq.T) + 1e-30)


@pytest.mark.parametrize("frag", [MFMA_GFX90A, MFMA_CDNA3, WMMA_GFX11], ids=lambda f: f.name)
@pytest.mark.parametrize(("fmt", "M", "K", "batch", "waves"), [
    ("hfq6g256", 37, 1024, 1, 2), ("hfq6g256", 20, 256, 4, 1), ("hfq6g256", 33, 768, 8, 3),
    ("q8f16", 37, 1024, 1, 4), ("q8f16", 21, 512, 5, 2), ("q8f16", 45, 768, 8, 3),
    ("q8f16", 16, 256, 3, 1),
    # batch 9-32: the tiled n6 / n12 (the NVIDIA staged kernel's n-tiles)
    ("hfq6g256", 37, 1024, 13, 2), ("hfq6g256", 20, 512, 32, 1), ("q8f16", 37, 768, 32, 3),
    ("q8f16", 21, 512, 17, 2)])
def test_amd_hfq6_and_q8f16_gemv_simulated_gives_the_exact_sums_and_the_nvidia_kernels_outputs(
        fmt, M, K, batch, waves, frag):
    raw, x = _wide_case(M, K, batch, seed=M * K + batch, fmt=fmt)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, wide_mma=True)
    NT = g._tiles
    packed = g.pack(raw)  # gemv_pack.pack_tiles_hfq6 / pack_tiles_q8f16, run for real
    xq, xs = prep_x(x, K, NT, False)
    xq_dirty = _garbage_past_the_batch(xq, K, NT, batch, seed=batch)
    parts = 8 if fmt == "q8f16" else 1  # Q8F16: a sum per 32-weight block
    sums = np.full((-(-M // ROWS), K // 256, parts, ROWS, 16 * ((NT + 1) // 2)), -2**40,
                   np.int64)
    y = gemv_amd_mc(packed, xq_dirty, xs, M, K, batch, NT, fmt, waves, frag, sums)
    # every int32 sum is the exact product of codes and x's byte planes (per block for
    # Q8F16: the masked or regrouped quads keep the blocks apart); zero past 3 * batch
    np.testing.assert_array_equal(sums[..., :3 * batch], _exact_sums(raw, x, M, K, False, fmt))
    assert (sums[..., 3 * batch:] == 0).all()
    # the NVIDIA kernels' outputs (same epilogue, order and reduction), bit for bit
    nvidia = (gemv_mma_q8 if fmt == "q8f16" else gemv_mma_6)(packed, xq, xs, M, K, batch, NT,
                                                              waves)
    np.testing.assert_array_equal(y, nvidia)
    _check(y, raw, x, M, K, fmt)


def _amd_model(frag, fmt):
    """gemv_amd_mc for _mutant_error's calls (gemv_mma_q8 / gemv_mma_6's arguments)."""
    def model(packed, xq, xs, M, K, batch, NT, n_waves, **mutation):
        return gemv_amd_mc(packed, xq, xs, M, K, batch, NT, fmt, n_waves, frag, **mutation)
    return model


@pytest.mark.parametrize("frag", [MFMA_GFX90A, MFMA_CDNA3, WMMA_GFX11], ids=lambda f: f.name)
def test_a_wrong_quad_to_block_assignment_fails_the_amd_q8f16_product(frag, monkeypatch):
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "1")
    assert _mutant_error("q8f16", _amd_model(frag, "q8f16")) < 1e-5
    # quads 0 and 2 as one block: products mix blocks with different scales
    mixed = _mutant_error("q8f16", _amd_model(frag, "q8f16"), block_quads=lambda bk: (bk, bk + 2))
    assert mixed > 1e-3


@pytest.mark.parametrize("frag", [MFMA_GFX90A, MFMA_CDNA3, WMMA_GFX11], ids=lambda f: f.name)
def test_a_wrong_high_bit_shift_fails_the_amd_hfq6_product(frag, monkeypatch):
    monkeypatch.setenv(weights.WIDE_MMA_ENV, "1")
    assert _mutant_error("hfq6g256", _amd_model(frag, "hfq6g256")) < 1e-5
    # rows 8-15's high bits moved by 2, not 4: a1 / a3 get a0 / a2's bits
    assert _mutant_error("hfq6g256", _amd_model(frag, "hfq6g256"), hb_shift=2) > 1e-3


#: Expressions of the emulation copied from the kernel text (gemv_amd_mc, AmdCodes, the
#: fragment types' product_blocks).
KERNEL_TEXT = [
    "for (int qq = 0; qq < QUADS; ++qq) L[qq] = 4 * (i % 8) + MC::quad(lane, qq);",
    "static constexpr int BYTES = PKV_GEMV_MMA_ROWS * Format<F>::B * (256 / Format<F>::G);",
    "constexpr int TILE_BYTES = MmaTile<F>::BYTES;",
    "code[qq][jj] = ((const uint4*)(base + 128))[32 * (2 * (i / 8) + jj) + L[qq]];",
    "const uint4 pa = code[qq][m / 4];",
    "const uint32_t wa = m % 4 == 0 ? pa.x : m % 4 == 1 ? pa.y : m % 4 == 2 ? pa.z : pa.w;",
    "for (int qq = 0; qq < QUADS; ++qq) w[qq] = (const uint32_t*)(base + 128) + 4 * L[qq];",
    "return w[qq][4 * 32 * (x / 4) + x % 4];",
    "const uint32_t n = half ? word(qq, 3 * m + 1) : word(qq, 3 * m);",
    "hfq6_join(n, word(qq, 3 * m + 2) >> 4 * half, lo, hi);",
    "w[qq] = (const uint32_t*)(base + 256) + 4 * L[qq] + i / 8;",
    "lo = w[qq][4 * 32 * m];",
    "hi = w[qq][4 * 32 * m + 2];",
    "MC::product_blocks(c, lane, a_lo, a_hi, b_lo, b_hi);",
    "MC::product(c[HALVES == 2 ? m / 4 : 0], a_lo, a_hi, b_lo, b_hi);",
    "const bool mine = lane / 32 == bk;",
    "const int q0 = 2 * bk, q1 = 2 * bk + 1;",
    "const pkv_i32x4 a = {(int)a_lo[q0], (int)a_lo[q1], (int)a_hi[q0], (int)a_hi[q1]};",
    "const pkv_i32x4 b = {(int)b_lo[q0], (int)b_lo[q1], (int)b_hi[q0], (int)b_hi[q1]};",
    "const uint32_t word = ((const uint32_t*)(base + 16 * MC::d_row(lane, r)))[j];",
    "const float d = pkv_half_bits_to_float((uint16_t)(bk ? word >> 16 : word & 0xFFFFu));",
    "acc[r] += d * (f_blocks * (float)c[bk][r]);",
    "PKV_GEMV_AMD_MC_KERNELS(hfq6g256, HFQ6G256)",
    "PKV_GEMV_AMD_MC_KERNELS(q8f16, Q8F16)",
]


def test_the_emulated_expressions_are_the_kernel_text():
    missing = missing_kernel_text(KERNEL_TEXT)
    assert not missing, f"hip/weights.hip no longer has {missing}: update the emulation"


def test_the_matrix_instruction_models_match_the_documented_layouts():
    # Entries of the calculator's tables (CDNA2 v_mfma_i32_16x16x16i8, CDNA3
    # v_mfma_i32_16x16x32_i8) and of the RDNA3 ISA's wave32 VGPR views
    # (v_wmma_i32_16x16x16_iu8): a one-hot A or B byte lands where the table says.
    def mfma(k32, a_lane, a_byte, b_lane, b_byte):
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
    assert mfma(False, 17, 2, 18, 2) == {(2, 1)}
    assert mfma(False, 17, 2, 18, 3) == set()  # B[7][2]: another k
    # k-32: lane 37 v1 byte 3 is A[5][8*2+4+3 = 23]; lane 41 v1 byte 3 is B[23][9]:
    # D[5][9] is lane 16 + 9 = 25, v1
    assert mfma(True, 37, 7, 41, 7) == {(25, 1)}
    assert mfma(True, 37, 7, 41, 3) == set()

    def wmma(a_row, a_k, b_col, b_k):
        a = np.zeros((4, 32), np.uint32)
        b = np.zeros((4, 32), np.uint32)
        for half in (0, 16):  # both half-waves hold the operand
            a[a_k // 4, a_row + half] = np.uint32(1 << (8 * (a_k % 4)))
            b[b_k // 4, b_col + half] = np.uint32(1 << (8 * (b_k % 4)))
        c = np.zeros((32, 8), np.int64)
        wmma_i32_16x16x16_iu8(c, a, b)
        return {(int(lane), int(r)) for lane, r in zip(*np.nonzero(c))}
    # A[5][9] (lane 5, v2 byte 1) times B[9][12] (lane 12, v2 byte 1): D[5][12] is in
    # register 2 of lane 16 + 12 (odd rows live in the upper half-wave)
    assert wmma(5, 9, 12, 9) == {(28, 2)}
    # D[4][3]: register 2 of lane 3
    assert wmma(4, 0, 3, 0) == {(3, 2)}
    assert wmma(4, 0, 3, 1) == set()  # A[4][0] x B[1][3]: another k
    # an operand held by one half-wave only is a kernel bug the model refuses
    a = np.zeros((4, 32), np.uint32)
    a[0, 3] = 1
    with pytest.raises(AssertionError):
        wmma_i32_16x16x16_iu8(np.zeros((32, 8), np.int64), a, np.zeros((4, 32), np.uint32))

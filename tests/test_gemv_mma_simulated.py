"""The tensor-core GEMV of hip/weights.hip simulated in NumPy, lane by lane: the prep of x
(pkv_gemv_prep_x: exact 22-bit integers split into three byte planes, written in the mma
B-fragment order), the packed weight tiles (Gemv.pack) and the kernel's loads, nibble
masks, m16n8k32 int8 mma fragments (PTX ISA, "Matrix Fragments for mma.m16n8k32"),
epilogue and shared-memory reduction — with the index expressions copied from the kernel
text, so a layout mistake in the staged batch 9-32 kernel (gemv_mma_staged: x copied to a
swizzled shared buffer, one tile per warp, groups split over blocks) shows up here, without
a GPU, as a wrong product. The GPU tests compare the real kernels against the
float64 reference (tests/test_kernels_weights.py)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.kernels import numpy_kernels as ref
from pagedkv.kernels import weights
from test_kernels_host import FakeCudaDevice

ROWS = weights.GEMV_MMA_ROWS  # 16: one m16 tile per block
X_WORDS = weights.GEMV_X_WORDS  # 16 prepared-x words per lane, group and n-tile
CHUNK = weights.GEMV_MMA_MAX_TILES  # 3 n-tiles per chunk of the tiled kernel


def _lanes():
    lane = np.arange(32)
    return lane, lane // 4, lane % 4


def _bytes_s8(words: np.ndarray) -> np.ndarray:
    """uint32[...] -> int8[..., 4], little-endian."""
    return np.ascontiguousarray(words.astype(np.uint32)).view(np.int8).reshape(*words.shape, 4)


def mma_s8_16x8x32(c, a0, a1, a2, a3, b0, b1):
    """One warp's mma.sync.m16n8k32.row.col.s32.s8.s8.s32: per-lane registers (arrays of
    32) in, per-lane accumulators c[32, 4] updated. Every A and B element must come from
    exactly one (lane, register, byte), which is checked."""
    _, gid, t = _lanes()
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    seen_a = np.zeros((16, 32), int)
    seen_b = np.zeros((32, 8), int)
    for reg, (row_off, col_off) in zip((a0, a1, a2, a3), ((0, 0), (8, 0), (0, 16), (8, 16))):
        v = _bytes_s8(reg)
        for i in range(4):
            A[gid + row_off, col_off + 4 * t + i] = v[:, i]
            np.add.at(seen_a, (gid + row_off, col_off + 4 * t + i), 1)
    for reg, k_off in zip((b0, b1), (0, 16)):
        v = _bytes_s8(reg)
        for i in range(4):
            B[k_off + 4 * t + i, gid] = v[:, i]
            np.add.at(seen_b, (k_off + 4 * t + i, gid), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    C = A @ B
    for e in range(2):
        c[:, e] += C[gid, 2 * t + e]
        c[:, 2 + e] += C[gid + 8, 2 * t + e]
    assert np.abs(c).max() < 2**31  # int32 accumulators


def prep_x(x: np.ndarray, K: int, n_tiles: int, rotate: bool):
    """pkv_gemv_prep_x: xq (uint32 words) and xs (float32[groups * batch, 4])."""
    batch = x.shape[0]
    groups = K // 256
    xq = np.zeros(groups * n_tiles * 32 * X_WORDS, np.uint32)
    xs = np.zeros((groups * batch, 4), np.float32)
    for b in range(batch):
        for g in range(groups):
            v = x[b, 256 * g:256 * g + 256].astype(np.float32).reshape(32, 8)  # lane, i
            prep_x_warp(v, g, b, xq, xs, batch, n_tiles, rotate)
    return xq, xs


def prep_x_warp(v: np.ndarray, g: int, b: int, xq: np.ndarray, xs: np.ndarray, batch: int,
                n_tiles: int, rotate: bool) -> None:
    """gemv_prep_x_warp (hip/gemv_prep_x.h) of one warp: lane L's 8 values ``v[L]``
    (float32[32, 8], x[8L, 8L + 8) of group g of row b) into xq and xs."""
    if rotate:
        v = quant.fwht256(v.reshape(1, 256)).reshape(32, 8).astype(np.float32)
    amax = np.abs(v).max()
    _, e = np.frexp(amax)
    e = max(int(e), -104)
    inv_step = np.float32(2.0 ** (22 - e))
    q = np.rint(v * inv_step).astype(np.int64)  # __float2int_rn: half to even
    p0 = (q & 0xFF).astype(np.int8).astype(np.int64)
    r1 = (q - p0) >> 8
    p1 = (r1 & 0xFF).astype(np.int8).astype(np.int64)
    p2 = (r1 - p1) >> 8
    assert (p2 == p2.astype(np.int8)).all()  # three planes are enough: |q| <= 2^22
    lane = np.arange(32)
    t, m = (lane // 2) % 4, 2 * (lane // 8) + lane % 2
    for p, plane in enumerate((p0, p1, p2)):
        col = 3 * b + p
        tile, n = col // 8, col % 8
        words = np.zeros((32, 2), np.uint32)
        for i in range(8):
            words[:, i % 2] |= (plane[:, i] & 0xFF).astype(np.uint32) << (8 * (i // 2))
        at = (((g * n_tiles + tile) * 32 + 4 * n + t) * X_WORDS + 2 * m)
        xq[at] = words[:, 0]
        xq[at + 1] = words[:, 1]
    halves = v.reshape(2, 128).sum(axis=1, dtype=np.float32)
    xs[g * batch + b] = (np.float32(2.0 ** (e - 22)), halves[0], halves[1],
                         halves[0] + halves[1])


def _header_affine(hdr: np.ndarray, v2: bool, half: int):
    """hdr: uint32[32, 2] (the lane's uint2) -> (scale, offset) float32[32]."""
    if v2:
        w = hdr[:, half]
        return ((w & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float32),
                (w >> 16).astype(np.uint16).view(np.float16).astype(np.float32))
    return hdr[:, 0].view(np.float32), hdr[:, 1].view(np.float32)


def add_group(acc, c, hdr, i0, xs, g, batch, v2):
    """weights.hip's add_group: acc[2, NT, 2, 32] += the f32 epilogue of the int32 sums
    c[halves, chunk, 32, 4] of n-tiles i0 .. i0 + chunk."""
    _, _, t = _lanes()
    halves = 2 if v2 else 1
    scale = [[_header_affine(hdr[r], v2, hv)[0] for r in range(2)] for hv in range(halves)]
    offset = [[_header_affine(hdr[r], v2, hv)[1] for r in range(2)] for hv in range(halves)]
    for i in range(c.shape[1]):
        for e in range(2):
            col = 8 * (i0 + i) + 2 * t + e
            p, b = col % 3, col // 3
            s = np.where((b < batch)[:, None], xs[np.minimum(g * batch + b, len(xs) - 1)], 0)
            s = s.astype(np.float32)
            f = s[:, 0] * np.float32([1, 256, 65536])[p]
            for r in range(2):
                v = scale[0][r] * (f * c[0, i, :, 2 * r + e].astype(np.float32))
                if halves == 2:
                    v += scale[1][r] * (f * c[1, i, :, 2 * r + e].astype(np.float32))
                off = (offset[0][r] * s[:, 1] + offset[1][r] * s[:, 2]
                       if halves == 2 else offset[0][r] * s[:, 3])
                v = np.where(p == 0, v + off, v)
                acc[r, i0 + i, e] += v


def gemv_mma_blocks(M, K, batch, NT, n_warps, tile_bytes, packed, group):
    """gemv_mma's walk, shared by the formats: per 16-row block, each warp's contiguous
    groups (``group(acc, words, base, g)`` adds one (tile, group) into acc[2, NT, 2, 32],
    base in words), the warps' sums through shared memory, 3 plane columns per batch row
    (rows past M not stored): y float32[batch, M]."""
    _, gid, t = _lanes()
    groups = K // 256
    words = packed.view(np.uint32)
    y = np.full((batch, M), np.nan, np.float32)
    for block in range(-(-M // ROWS)):
        row0 = block * ROWS
        red = np.zeros((n_warps, ROWS, 8 * NT), np.float32)
        for warp in range(n_warps):
            g_begin, g_end = warp * groups // n_warps, (warp + 1) * groups // n_warps
            acc = np.zeros((2, NT, 2, 32), np.float32)
            for g in range(g_begin, g_end):
                group(acc, words, (block * groups + g) * tile_bytes // 4, g)
            for r in range(2):
                for i in range(NT):
                    for e in range(2):
                        red[warp, gid + 8 * r, 8 * i + 2 * t + e] = acc[r, i, e]
        for b in range(batch):
            cols = red[:, :, 3 * b:3 * b + 3].sum(axis=(0, 2), dtype=np.float32)
            n = min(ROWS, M - row0)  # rows past M are not stored
            y[b, row0:row0 + n] = cols[:n]
    return y


def x_words(xq, g, NT, i, batch):
    """The lane's 4 prepared-x uint4 words of n-tile i of group g (zero for columns past
    the batch's planes): uint32[4 (v), 32, 4 (xyzw)]."""
    lane, gid, _ = _lanes()
    live = 8 * i + gid < 3 * batch
    out = np.zeros((4, 32, 4), np.uint32)
    for v in range(4):
        at = (((g * NT + i) * 32 + lane) * X_WORDS) + 4 * v
        vals = np.stack([xq[at + w] for w in range(4)], axis=1)
        out[v] = np.where(live[:, None], vals, 0)
    return out


def nibble_chunk(acc, words, base, g, i0, chunk, xword, xs, batch, v2):
    """weights.hip's mma_group_add for the 4-bit formats (mma_group, add_group): acc[2, NT,
    2, 32] += tile-group ``base``'s products with n-tiles i0 .. i0 + chunk; ``xword(i, v)``
    is the lane's prepared-x uint4 word v of the chunk's n-tile i (uint32[32, 4])."""
    lane, gid, _ = _lanes()
    halves = 2 if v2 else 1
    hdr = [np.stack([words[base + 2 * (gid + 8 * r)], words[base + 2 * (gid + 8 * r) + 1]],
                    axis=1) for r in range(2)]
    code = [np.stack([words[base + 32 + 4 * (32 * i + lane) + w] for w in range(4)],
                     axis=1) for i in range(4)]  # uint4 x, y, z, w
    c = np.zeros((halves, chunk, 32, 4), np.int64)
    for m in range(8):
        j, h, hv = m // 2, m % 2, (m // 4 if halves == 2 else 0)
        pa, pb = code[j // 2], code[2 + j // 2]
        wa = pa[:, 2 * (j % 2) + h]
        wb = pb[:, 2 * (j % 2) + h]
        a0, a1 = wa & 0x0F0F0F0F, wb & 0x0F0F0F0F
        a2, a3 = (wa >> 4) & 0x0F0F0F0F, (wb >> 4) & 0x0F0F0F0F
        for i in range(chunk):
            q = xword(i, m // 2)
            b0 = q[:, 2] if h else q[:, 0]
            b1 = q[:, 3] if h else q[:, 1]
            mma_s8_16x8x32(c[hv, i], a0, a1, a2, a3, b0, b1)
    add_group(acc, c, hdr, i0, xs, g, batch, v2)


def x_chunk_words(xq, g, NT, i0, chunk, batch):
    """``xword`` of a chunk read from the prepared x in global memory (gemv_mma's xb)."""
    xb = [x_words(xq, g, NT, i0 + i, batch) for i in range(chunk)]
    return lambda i, v: xb[i][v]


def gemv_mma_tiled(packed, xq, xs, M, K, batch, NT, v2, n_warps, chunk=CHUNK):
    """gemv_mma<F, NT> with chunk = NT <= 3 (the batch 1-8 kernel; NT / chunk chunks per
    group is the loop of the AMD tiled kernel's NVIDIA ancestor): y[batch, M]."""

    def group(acc, words, base, g):
        for i0 in range(0, NT, chunk):
            nibble_chunk(acc, words, base, g, i0, chunk,
                         x_chunk_words(xq, g, NT, i0, chunk, batch), xs, batch, v2)

    return gemv_mma_blocks(M, K, batch, NT, n_warps, ROWS * 136, packed, group)


def warp_sums_to_rows(acc, rows, cols):
    """The end's shared reduction buffer: acc[warp, tile, r, n-tile, e, lane] (lane (gid, t)
    holds row gid + 8r, column 8 n-tile + 2t + e of its warp's tile) into [rows][cols] f32."""
    _, gid, t = _lanes()
    n_warps, tpw, _, NT = acc.shape[:4]
    red = np.zeros((rows, cols), np.float32)
    for warp in range(n_warps):
        for u in range(tpw):
            for r in range(2):
                for i in range(NT):
                    for e in range(2):
                        red[(warp * tpw + u) * ROWS + gid + 8 * r, 8 * i + 2 * t + e] = \
                            acc[warp, u, r, i, e]
    return red


def add_splits(y, partial, row0, n):
    """gemv_split_finish's last block: rows row0 .. row0 + n of y = the splits' partials
    added in split order (independent of the arrival order)."""
    total = np.zeros((y.shape[0], n), np.float32)
    for split in range(partial.shape[0]):
        total += partial[split][:, row0:row0 + n]
    y[:, row0:row0 + n] = total


def x_stage_unit(tile, lane, v):
    """weights.hip's x_stage_unit: the shared 16-byte unit of lane's word v of n-tile tile."""
    return 4 * (32 * tile + lane) + (v ^ ((lane >> 1) & 3))


def gemv_mma_staged(packed, xq, xs, M, K, batch, NT, v2, n_warps, splits, chunk_fn=None,
                    tile_bytes=ROWS * 136):
    """gemv_mma_staged<F, NT> on a grid (row blocks, splits) of n_warps-warp blocks.
    ``chunk_fn(acc, words, base, g, i0, chunk, xword)``: the format's mma_group_add (the
    4-bit formats' nibble_chunk when None), ``tile_bytes`` its packed tile-group."""
    lane, gid, t = _lanes()
    groups = K // 256
    units = NT * 32 * 4
    if chunk_fn is None:
        def chunk_fn(acc, words, base, g, i0, chunk, xword):
            nibble_chunk(acc, words, base, g, i0, chunk, xword, xs, batch, v2)
    words = packed.view(np.uint32)
    row_tiles = -(-M // ROWS)
    rows = n_warps * ROWS
    y = np.full((batch, M), np.nan, np.float32)
    partial = np.full((splits, batch, M), np.nan, np.float32)
    xq_units = xq.reshape(-1, 4)
    for bx in range(-(-row_tiles // n_warps)):
        for split in range(splits):
            g_begin, g_end = split * groups // splits, (split + 1) * groups // splits
            red = np.zeros((n_warps * ROWS, 8 * NT), np.float32)
            accs = np.zeros((n_warps, 2, NT, 2, 32), np.float32)
            for g in range(g_begin, g_end):
                stage = np.full((units, 4), 0xDEADBEEF, np.uint32)
                written = np.zeros(units, int)
                for u in range(units):  # the block's cp.async copies, any thread order
                    at = x_stage_unit(u // 128, (u // 4) % 32, u % 4)
                    stage[at] = xq_units[g * units + u]
                    written[at] += 1
                assert (written == 1).all()
                for warp in range(n_warps):
                    tile = bx * n_warps + warp
                    if tile >= row_tiles:
                        continue
                    base = (tile * groups + g) * tile_bytes // 4
                    for i0 in range(0, NT, CHUNK):
                        def xword(i, v, i0=i0, stage=stage):
                            live = 8 * (i0 + i) + gid < 3 * batch  # past the batch: zeros
                            return np.where(live[:, None], stage[x_stage_unit(i0 + i, lane, v)], 0)
                        chunk_fn(accs[warp], words, base, g, i0, CHUNK, xword)
            for warp in range(n_warps):
                for r in range(2):
                    for i in range(NT):
                        for e in range(2):
                            red[warp * ROWS + gid + 8 * r, 8 * i + 2 * t + e] = accs[warp, r, i, e]
            row0 = bx * rows
            n = min(rows, M - row0)
            for b in range(batch):
                v = np.float32(0) + (red[:, 3 * b] + red[:, 3 * b + 1] + red[:, 3 * b + 2])
                dst = y if splits == 1 else partial[split]
                dst[b, row0:row0 + n] = v[:n]
        if splits > 1:  # the last block to arrive adds the splits in split order
            add_splits(y, partial, bx * rows, min(rows, M - bx * rows))
    return y


@pytest.mark.parametrize(("fmt", "batch", "warps", "splits"), [
    ("hfq4g256", 32, 8, 4), ("mq4g256v2", 32, 2, 3), ("mq4g256v2", 11, 8, 1),
    ("mq4g256", 17, 4, 2)])
def test_staged_tensor_core_gemv_simulated_matches_the_float64_product(fmt, batch, warps, splits):
    M, K = 37, 1024  # three 16-row tiles (the last padded), 4 groups split over the blocks
    raw, x = _case(fmt, M, K, batch, seed=batch * 7 + warps)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, pipe=False)
    NT = g._tiles
    assert NT == (6 if batch <= 16 else 12)
    assert g._kernel.name.startswith("pkv_gemv_mma_staged_")
    rotated = g.fmt.rotated
    xq, xs = prep_x(x, K, NT, rotated)
    y = gemv_mma_staged(g.pack(raw), xq, xs, M, K, batch, NT, fmt == "mq4g256v2", warps, splits)
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    xr = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - expect), 2e-6 * (xr @ wq.T) + 1e-30)


def test_the_staged_x_swizzle_is_free_of_shared_bank_conflicts():
    # a 128-bit shared load is served 8 lanes at a time: those 8 lanes must touch 8
    # different 16-byte bank groups (32 banks x 4 bytes = 8 groups of 16 bytes)
    for tile in range(12):
        for v in range(4):
            for phase in range(4):
                lanes = range(8 * phase, 8 * phase + 8)
                groups = {x_stage_unit(tile, lane, v) % 8 for lane in lanes}
                assert len(groups) == 8
    # every unit of a group's 12 n-tiles is written once: a permutation
    units = [x_stage_unit(u // 128, (u // 4) % 32, u % 4) for u in range(12 * 128)]
    assert sorted(units) == list(range(12 * 128))


def _case(fmt, M, K, batch, seed):
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((M, K)) * 0.05).astype(np.float32)
    raw = quant.quantize(w, fmt)
    x = (rng.standard_normal((batch, K)) * rng.uniform(0.1, 10, (batch, 1))).astype(np.float32)
    return raw, x


def test_the_staged_gemv_gives_the_same_bits_at_any_warps_a_block():
    # a warp owns its 16-row tile over every group of its split, so the warps a block (2, 4,
    # 8; HFQ6G256 / Q8F16 launch 4, the 4-bit formats 8) regroup no f32 sum: the GPU test
    # test_gpu_staged_gemv_is_the_same_bits_at_any_warps_a_block asserts the same
    M, K, fmt = 40, 768, "mq4g256v2"  # 3 row tiles: partial blocks at 2, 4 and 8 warps
    raw, x = _case(fmt, M, K, 32, seed=3)
    packed = weights.Gemv(FakeCudaDevice(), fmt, M, K, 32, pipe=False, f16_x=False).pack(raw)
    xq, xs = prep_x(x, K, 12, True)
    for splits in (1, 2):
        outs = [gemv_mma_staged(packed, xq, xs, M, K, 32, 12, True, w, splits).view(np.uint32)
                for w in (2, 4, 8)]
        for other in outs[1:]:
            np.testing.assert_array_equal(other, outs[0])


def test_one_split_of_the_staged_gemv_gives_each_batch_row_what_the_batch_8_kernel_gives_it():
    # With one split, a staged warp adds its tile's groups in order and the block adds a
    # row's 3 plane columns from 0: gemv_mma's float operations with one warp per block,
    # so the rows are bit for bit those of four 8-row calls (more splits or warps only
    # regroup the same f32 sums)
    M, K, fmt = 21, 768, "mq4g256v2"
    raw, x = _case(fmt, M, K, 32, seed=5)
    packed = weights.Gemv(FakeCudaDevice(), fmt, M, K, 32, pipe=False).pack(raw)
    xq, xs = prep_x(x, K, 12, True)
    staged = gemv_mma_staged(packed, xq, xs, M, K, 32, 12, True, 8, 1)
    for lo in range(0, 32, 8):
        xq8, xs8 = prep_x(x[lo:lo + 8], K, 3, True)
        old = gemv_mma_tiled(packed, xq8, xs8, M, K, 8, 3, True, 1, chunk=3)
        np.testing.assert_array_equal(staged[lo:lo + 8], old)


def test_the_mma_fragment_model_is_a_16x8x32_product():
    rng = np.random.default_rng(0)
    regs = [rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32) for _ in range(6)]
    c = np.zeros((32, 4), np.int64)
    mma_s8_16x8x32(c, *regs)
    # lane 0's c0: row 0, col 0 = sum over k of A[0, k] B[k, 0]; A row 0 sits in lanes
    # 0-3 (a0: k 4t..4t+3, a2: k 16+4t..), B col 0 in the same lanes (b0, b1)
    a = np.concatenate([_bytes_s8(regs[0])[:4].reshape(-1), _bytes_s8(regs[2])[:4].reshape(-1)])
    b = np.concatenate([_bytes_s8(regs[4])[:4].reshape(-1), _bytes_s8(regs[5])[:4].reshape(-1)])
    assert c[0, 0] == int(a.astype(np.int64) @ b.astype(np.int64))


# --- the pipelined batch 9-32 kernel (gemv_mma_pipe) ---------------------------------------

POISON = 0x7FC0DEAD  # a NaN as f32: a stage slot read before its copies landed poisons y


def gemv_mma_pipe(packed, xq, xs, M, K, batch, NT, v2, n_warps, splits, tpw=2, stages=3,
                  in_flight=None):
    """gemv_mma_pipe<F, NT> on a grid (row blocks, splits) of n_warps-warp blocks, TPW tiles
    per warp and a ring of `stages` slots. cp.async is modelled as the kernel orders it: a
    thread's copies land when a cp.async.wait_group lets their commit group complete, so a
    slot read too early holds POISON (or an older group) and the product goes wrong.
    ``in_flight``: the loop's wait_group count (the kernel's STAGES - 2)."""
    in_flight = stages - 2 if in_flight is None else in_flight
    lane, gid, _ = _lanes()
    groups = K // 256
    XU, XSU, TU = NT * 128, 8 * NT // 3, ROWS * 136 // 16
    block_tiles = n_warps * tpw
    su = XU + XSU + block_tiles * TU  # PipeStage::units
    row_tiles = -(-M // ROWS)
    rows = block_tiles * ROWS
    cols = 8 * NT
    halves = 2 if v2 else 1
    w_units = packed.view(np.uint32).reshape(-1, 4)
    xq_units = xq.reshape(-1, 4)
    xs_units = xs.view(np.uint32).reshape(-1, 4)
    y = np.full((batch, M), np.nan, np.float32)
    partial = np.full((splits, batch, M), np.nan, np.float32)
    for bx in range(-(-row_tiles // block_tiles)):
        first_tile = bx * block_tiles
        for split in range(splits):
            g_begin, g_end = split * groups // splits, (split + 1) * groups // splits
            ring = np.full((stages * su, 4), POISON, np.uint32)
            for s in range(stages):  # zero (step, sums) past the batch in every slot
                ring[s * su + XU + batch:s * su + XU + XSU] = 0
            pending: list[list] = []  # open commit groups of (unit, value)

            def stage_w(slot, g, into, first_tile=first_tile):
                for u in range(block_tiles * TU):
                    tile = min(first_tile + u // TU, row_tiles - 1)
                    into.append((slot * su + XU + XSU + u, w_units[(tile * groups + g) * TU + u % TU]))

            def stage_x(slot, g, into):
                for u in range(XU):
                    into.append((slot * su + x_stage_unit(u // 128, (u // 4) % 32, u % 4),
                                 xq_units[g * XU + u]))
                for b in range(batch):
                    into.append((slot * su + XU + b, xs_units[g * batch + b]))

            def wait(keep, pending=pending, ring=ring):  # cp.async.wait_group keep
                while len(pending) > keep:
                    for at, v in pending.pop(0):
                        ring[at] = v

            first: list = []  # the prologue's weights join the first commit group
            for s in range(stages - 1):
                if g_begin + s < g_end:
                    stage_w(s, g_begin + s, first)
            for s in range(stages - 1):
                grp = first if s == 0 else []
                if g_begin + s < g_end:
                    stage_x(s, g_begin + s, grp)
                pending.append(grp)
            acc = np.zeros((n_warps, tpw, 2, NT, 2, 32), np.float32)
            for g in range(g_begin, g_end):
                k = g - g_begin
                wait(in_flight)
                grp = []
                if g + stages - 1 < g_end:
                    slot = (k + stages - 1) % stages
                    stage_w(slot, g + stages - 1, grp)
                    stage_x(slot, g + stages - 1, grp)
                pending.append(grp)
                st = (k % stages) * su
                sums = ring[st + XU:st + XU + XSU].copy().view(np.float32)  # [XSU, 4]
                for warp in range(n_warps):
                    if first_tile + warp * tpw >= row_tiles:
                        continue  # inactive: copies only
                    wt = [st + XU + XSU + (warp * tpw + u) * TU for u in range(tpw)]
                    hdr = [[np.stack([ring[w0 + (gid + 8 * r) // 2, 2 * ((gid + 8 * r) % 2) + h]
                                      for h in range(2)], axis=1) for r in range(2)] for w0 in wt]
                    code = [[ring[w0 + 8 + 32 * i + lane] for i in range(4)] for w0 in wt]
                    for i0 in range(0, NT, CHUNK):
                        c = np.zeros((tpw, halves, CHUNK, 32, 4), np.int64)
                        for m in range(8):
                            j, h, hv = m // 2, m % 2, (m // 4 if halves == 2 else 0)
                            a = []
                            for u in range(tpw):
                                wa = code[u][j // 2][:, 2 * (j % 2) + h]
                                wb = code[u][2 + j // 2][:, 2 * (j % 2) + h]
                                a.append((wa & 0x0F0F0F0F, wb & 0x0F0F0F0F,
                                          (wa >> 4) & 0x0F0F0F0F, (wb >> 4) & 0x0F0F0F0F))
                            for i in range(CHUNK):
                                q = ring[st + x_stage_unit(i0 + i, lane, m // 2)]  # no live mask
                                b0 = q[:, 2] if h else q[:, 0]
                                b1 = q[:, 3] if h else q[:, 1]
                                for u in range(tpw):
                                    mma_s8_16x8x32(c[u, hv, i], *a[u], b0, b1)
                        for u in range(tpw):  # sums[b] for every b < 8 NT / 3: zeros past batch
                            add_group(acc[warp, u], c[u], hdr[u], i0, sums, 0, XSU, v2)
            wait(0)
            red = warp_sums_to_rows(acc, rows, cols)  # [block tile * 16 + row][column]
            row0 = bx * rows  # gemv_split_finish
            n = min(rows, M - row0)
            for b in range(batch):
                v = np.float32(0) + (red[:, 3 * b] + red[:, 3 * b + 1] + red[:, 3 * b + 2])
                (y if splits == 1 else partial[split])[b, row0:row0 + n] = v[:n]
        if splits > 1:
            add_splits(y, partial, bx * rows, min(rows, M - bx * rows))
    return y


def _garbage_past_the_batch(xq, K, NT, batch, seed):
    """The prepared x with its unused columns (8 n-tile + lane / 4 >= 3 batch) random: the
    prep never writes them and the pipelined kernel reads them unmasked."""
    out = xq.reshape(K // 256, NT, 32, X_WORDS).copy()
    col = 8 * np.arange(NT)[:, None] + np.arange(32)[None, :] // 4
    dead = np.broadcast_to((col >= 3 * batch)[None, :, :, None], out.shape)
    rng = np.random.default_rng(seed)
    out[dead] = rng.integers(0, 2**32, int(dead.sum()), dtype=np.uint64).astype(np.uint32)
    return out.reshape(-1)


@pytest.mark.parametrize(("fmt", "batch", "M", "warps", "splits", "stages"), [
    ("hfq4g256", 32, 37, 2, 3, 3),   # one block of 4 tiles, the 4th clamped onto the 3rd
    ("mq4g256v2", 24, 100, 2, 2, 3),  # n9; 2 blocks, block 1's warp 1: tile 6 live, 7 clamped
    ("mq4g256", 9, 37, 1, 1, 2),      # n6, a 2-slot ring, one split
    ("mq4g256v2", 17, 21, 2, 4, 4)])  # a 4-slot ring deeper than a split's 1-2 groups
def test_pipelined_gemv_simulated_is_the_staged_kernel_bit_for_bit(fmt, batch, M, warps, splits,
                                                                  stages):
    K = 1536  # 6 groups
    raw, x = _case(fmt, M, K, batch, seed=batch + M)
    g = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, pipe=True)
    NT = g._tiles
    assert NT == {9: 6, 17: 9, 24: 9, 32: 12}[batch]
    assert g._kernel.name == f"pkv_gemv_mma_pipe_{g.fmt.kernel}_n{NT}"
    rotated, v2 = g.fmt.rotated, fmt == "mq4g256v2"
    packed = g.pack(raw)
    xq, xs = prep_x(x, K, NT, rotated)
    y = gemv_mma_pipe(packed, _garbage_past_the_batch(xq, K, NT, batch, 1), xs, M, K, batch, NT,
                      v2, warps, splits, stages=stages)
    # the staged kernel runs n6/n12 only: its n12 layout for the n9 cases (the same columns,
    # each column's sums independent of the others)
    NT_s = 6 if NT == 6 else 12
    xq_s, xs_s = prep_x(x, K, NT_s, rotated)
    staged = gemv_mma_staged(packed, xq_s, xs_s, M, K, batch, NT_s, v2, 8, splits)
    np.testing.assert_array_equal(y.view(np.uint32), staged.view(np.uint32))
    expect = ref.gemv(raw, fmt, M, K, x, rotated=rotated)
    wq = np.abs(quant.dequantize(raw, fmt, (M, K), basis="rotated")).astype(np.float64)
    xr = np.abs(ref.fwht256(x) if rotated else x).astype(np.float64)
    np.testing.assert_array_less(np.abs(y - expect), 2e-6 * (xr @ wq.T) + 1e-30)


def test_a_pipelined_ring_read_before_its_copies_land_is_caught():
    # the model's cp.async is what lets the test above fail: waiting for one group fewer
    # (wait_group STAGES - 1) computes each group while its copies are still in flight
    M, K, batch, fmt = 37, 1024, 32, "hfq4g256"
    raw, x = _case(fmt, M, K, batch, seed=3)
    packed = weights.Gemv(FakeCudaDevice(), fmt, M, K, batch, pipe=True).pack(raw)
    xq, xs = prep_x(x, K, 12, False)
    assert np.isfinite(gemv_mma_pipe(packed, xq, xs, M, K, batch, 12, False, 2, 1)).all()
    with np.errstate(invalid="ignore"):
        early = gemv_mma_pipe(packed, xq, xs, M, K, batch, 12, False, 2, 1, in_flight=2)
    assert np.isnan(early).all()

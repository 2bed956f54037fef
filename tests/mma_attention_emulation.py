"""NumPy emulation of hip/kvcache.hip's q8 tensor-core attention passes, lane by lane.

Each function mirrors one device function (``qk_scores_mma_q8``, ``pv_mma_q8`` and the
partition kernel around them): the same loads at the same byte offsets (with the kernel's
alignment claims asserted), the same ``__byte_perm`` selectors, the same f16 conversions
and the m16n8k16 fragment layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16
with floating point type"): a fragment mistake here is a test failure on this machine
rather than a wrong answer on the GPU. Registers are ``uint32[32]`` arrays (one entry per
lane); the 4 warps of a CTA run one after the other.
"""

from __future__ import annotations

import numpy as np

from test_gemv_mma_simulated import mma_s8_16x8x32

LANES = 32
LANE = np.arange(LANES)
GID, TID = LANE // 4, LANE % 4
Q8_RECORD_BYTES, Q8_BLOCK = 34, 32


def f16_bits(x) -> np.ndarray:
    """pkv_float_to_half_bits: f32 -> f16 bits, round to nearest even."""
    return np.asarray(x, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)


def f16_value(bits) -> np.ndarray:
    return (np.asarray(bits, np.uint32) & 0xFFFF).astype(np.uint16).view(np.float16).astype(
        np.float32)


def byte_perm(x, y, sel: int) -> np.ndarray:
    """__byte_perm(x, y, sel): result byte k = byte (sel >> 4k) & 7 of the 8 bytes {x, y}."""
    both = (np.asarray(y, np.uint64) << np.uint64(32)) | np.asarray(x, np.uint64)
    out = np.zeros(np.shape(x), np.uint64)
    for k in range(4):
        src = (sel >> (4 * k)) & 7
        out |= ((both >> np.uint64(8 * src)) & np.uint64(0xFF)) << np.uint64(8 * k)
    return out.astype(np.uint32)


def f16x2_sub(a, b) -> np.ndarray:
    """sub.rn.f16x2 on packed halves."""
    lo = (f16_value(a) - f16_value(b)).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi = (f16_value(np.asarray(a, np.uint32) >> 16) - f16_value(np.asarray(b, np.uint32) >> 16)
          ).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo | hi << 16


def q8_flip(w) -> np.ndarray:
    """q8_flip: each code byte's sign bit flipped (c + 128, unsigned)."""
    return np.asarray(w, np.uint32) ^ np.uint32(0x80808080)


def q8_codes_f16x2(sel: int, x) -> np.ndarray:
    """q8_codes_f16x2<sel>(x) on flipped codes: bytes of x under 0x64 bytes (selector byte 4
    of the constant 0x64646464), less 1152 per half."""
    return f16x2_sub(byte_perm(x, np.uint32(0x64646464), sel), np.uint32(0x64806480))


def q8_interleave(sel: int, a, b) -> np.ndarray:
    """q8_interleave<sel>(a, b): two tokens' code bytes interleaved, then flipped."""
    return q8_flip(byte_perm(a, b, sel))


def f32x2_to_f16x2(lo, hi) -> np.ndarray:
    """f32x2_to_f16x2 (cvt.rn.f16x2.f32): lo in the low half."""
    return f16_bits(lo) | f16_bits(hi) << 16


def load_word_a2(pool_bytes: np.ndarray, addr: np.ndarray, aligned4: bool) -> np.ndarray:
    """4 little-endian bytes at byte offsets ``addr`` of the flat pool; asserts the
    alignment the kernel's load instruction needs."""
    addr = np.asarray(addr, np.int64)
    assert (addr % (4 if aligned4 else 2) == 0).all(), "misaligned load"
    b = pool_bytes[addr[..., None] + np.arange(4)].astype(np.uint32)
    return b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24


def load_u16(pool_bytes: np.ndarray, addr) -> np.ndarray:
    addr = np.asarray(addr, np.int64)
    assert (addr % 2 == 0).all(), "misaligned load"
    return pool_bytes[addr].astype(np.uint32) | pool_bytes[addr + 1].astype(np.uint32) << 8


def mma_16x8x16(c: np.ndarray, a: list, b0, b1) -> np.ndarray:
    """mma.sync.m16n8k16.row.col.f32.f16.f16.f32: c ``float32[32, 4]`` += A . B, with A, B
    assembled from the lanes' registers in the ISA's fragment layout."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for reg, (row_off, col_off) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        A[GID + row_off, 2 * TID + col_off] = f16_value(a[reg])
        A[GID + row_off, 2 * TID + col_off + 1] = f16_value(np.asarray(a[reg]) >> 16)
    for reg, k_off in ((b0, 0), (b1, 8)):
        B[2 * TID + k_off, GID] = f16_value(reg)
        B[2 * TID + k_off + 1, GID] = f16_value(np.asarray(reg) >> 16)
    C = A @ B  # products of f16 values are exact in float64; sums in f32 or better
    d = c.astype(np.float64)
    d[:, 0] += C[GID, 2 * TID]
    d[:, 1] += C[GID, 2 * TID + 1]
    d[:, 2] += C[GID + 8, 2 * TID]
    d[:, 3] += C[GID + 8, 2 * TID + 1]
    return d.astype(np.float32)



def q_fragments(q_group, group, head_dim, scale) -> list:
    """q_fragments<KV_F16>: qa[s][reg] per lane, k-step s = dims 32(s/2) + 8t + 4(s%2) + 0..3,
    rows 0-7 the f16 queries (times scale), rows 8-15 their f16 remainders."""
    n_rec = head_dim // Q8_BLOCK
    qa = [[np.zeros(LANES, np.uint32) for _ in range(4)] for _ in range(8)]
    for s in range(8):
        if s // 2 < n_rec:
            live = GID < group
            dims = 32 * (s // 2) + 8 * TID + 4 * (s % 2)
            v = np.zeros((LANES, 4), np.float32)
            for e in range(4):
                v[live, e] = q_group[GID[live], dims[live] + e] * np.float32(scale)
            hi = f16_bits(v)
            lo = f16_bits(v - f16_value(hi))
            hi[~live] = 0
            lo[~live] = 0
            qa[s] = [hi[:, 0] | hi[:, 1] << 16, lo[:, 0] | lo[:, 1] << 16,
                     hi[:, 2] | hi[:, 3] << 16, lo[:, 2] | lo[:, 3] << 16]
    return qa


def qk_scores_q8(q_group, group, head_dim, scale, pool_bytes, rows, row_bytes, n_tok, gmax,
                 scores, n_warps=4):
    """qk_scores_mma_q8: fills ``scores[t * gmax + g]`` (float32) for the partition."""
    n_rec = head_dim // Q8_BLOCK
    qa = q_fragments(q_group, group, head_dim, scale)
    for warp in range(n_warps):
        for grp in range(warp, (n_tok + 7) // 8, n_warps):
            tok = 8 * grp + GID
            ok = tok < n_tok
            row = rows[np.minimum(tok, n_tok - 1)] * row_bytes
            c = np.zeros((LANES, 4), np.float32)
            for i in range(n_rec):
                rec = row + i * Q8_RECORD_BYTES
                d = np.where(ok, load_u16(pool_bytes, rec), 0)
                words = [np.where(ok, load_word_a2(pool_bytes, rec + 2 + 8 * TID + 4 * h,
                                                   i % 2 == 1), 0) for h in range(2)]
                r = np.zeros((LANES, 4), np.float32)
                for h in range(2):
                    x = q8_flip(words[h])
                    r = mma_16x8x16(r, qa[2 * i + h], q8_codes_f16x2(0x4140, x),
                                    q8_codes_f16x2(0x4342, x))
                d0 = f16_value(d[8 * TID])
                d1 = f16_value(d[8 * TID + 4])
                c[:, 0] += d0 * r[:, 0]
                c[:, 1] += d1 * r[:, 1]
                c[:, 2] += d0 * r[:, 2]
                c[:, 3] += d1 * r[:, 3]
            t0 = 8 * grp + 2 * TID
            for lane in range(LANES):
                if GID[lane] < gmax:
                    if t0[lane] < n_tok:
                        scores[t0[lane] * gmax + GID[lane]] = c[lane, 0] + c[lane, 2]
                    if t0[lane] + 1 < n_tok:
                        scores[(t0[lane] + 1) * gmax + GID[lane]] = c[lane, 1] + c[lane, 3]


def pv_record_pairs_mma_q8(o: np.ndarray, lr: int, pairs, b0, b1) -> None:
    """pv_record_pairs_mma_q8: record ``lr``'s two m-tiles (2 lr, 2 lr + 1) of ``o``, in
    place; ``pairs`` the interleaved words (lo01, hi01, lo23, hi23) of tokens 4t .. 4t + 3,
    ``b0``/``b1`` the p·d pairs."""
    lo01, hi01, lo23, hi23 = pairs
    a0 = [q8_codes_f16x2(0x4140, lo01), q8_codes_f16x2(0x4342, lo01),
          q8_codes_f16x2(0x4140, lo23), q8_codes_f16x2(0x4342, lo23)]
    a1 = [q8_codes_f16x2(0x4140, hi01), q8_codes_f16x2(0x4342, hi01),
          q8_codes_f16x2(0x4140, hi23), q8_codes_f16x2(0x4342, hi23)]
    o[:, 2 * lr] = mma_16x8x16(o[:, 2 * lr], a0, b0, b1)
    o[:, 2 * lr + 1] = mma_16x8x16(o[:, 2 * lr + 1], a1, b0, b1)


def pv_record_mma_q8(o: np.ndarray, lr: int, words, b0, b1) -> None:
    """pv_record_mma_q8: pv_record_pairs_mma_q8 of the lanes' code words of tokens 4t .. 4t
    + 3, interleaved."""
    c0, c1, c2, c3 = words
    pv_record_pairs_mma_q8(o, lr, (q8_interleave(0x5140, c0, c1), q8_interleave(0x7362, c0, c1),
                                   q8_interleave(0x5140, c2, c3), q8_interleave(0x7362, c2, c3)),
                           b0, b1)

def pv_q8(scores, pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, warp, pscale,
          n_warps=4):
    """pv_mma_q8 for one warp: its ``o[8][4]`` per lane (``float32[32, 8, 4]``), after the
    remainder columns are folded in."""
    n_rec = head_dim // Q8_BLOCK
    o = np.zeros((LANES, 8, 4), np.float32)
    head = GID % 4
    rest, live = GID >= 4, head < gmax
    for st in range(warp, (n_tok + 15) // 16, n_warps):
        code = np.zeros((4, 4, LANES), np.uint32)
        dpair = np.zeros((2, 4, LANES), np.uint32)
        p = np.zeros((4, LANES), np.float32)
        for j in range(4):
            tok = 16 * st + 4 * TID + j
            ok = tok < n_tok
            row = rows[np.minimum(tok, n_tok - 1)] * row_bytes
            for lr in range(n_rec):
                rec = row + lr * Q8_RECORD_BYTES
                dpair[j // 2, lr] |= np.where(ok, load_u16(pool_bytes, rec), 0).astype(
                    np.uint32) << (16 * (j % 2))
                code[j, lr] = np.where(ok, load_word_a2(pool_bytes, rec + 2 + 4 * GID,
                                                        lr % 2 == 1), 0)
            sel = live & ok
            p[j, sel] = scores[tok[sel] * gmax + head[sel]]

        def pd_pair(k, dp, p=p):
            bits = np.zeros(LANES, np.uint32)
            for e in range(2):
                x = (p[2 * k + e] * (f16_value(dp >> (16 * e)) * np.float32(pscale))).astype(
                    np.float32)
                hi = f16_bits(x)
                h = np.where(rest, f16_bits(x - f16_value(hi)), hi)
                bits |= h << (16 * e)
            return bits

        for lr in range(n_rec):
            b0, b1 = pd_pair(0, dpair[0, lr]), pd_pair(1, dpair[1, lr])
            pv_record_mma_q8(o, lr, code[:, lr], b0, b1)
    return o + o[LANE ^ 2]  # pkv_shfl_xor(o, 2)


# --- the staged variant (q8s kernels: q8_stage_chunk, qk_scores_mma_q8_staged,
# pv_mma_q8_staged): rows copied into per-warp shared-memory buffers, fragments read there.
STAGE_TOKENS, ROW_UNITS, PITCH_UNITS = 16, 17, 18  # PKV_ATTN_Q8_STAGE_PITCH_UNITS default


def stage_chunk(pool_bytes, rows, row_bytes, n_tok, c, pitch_units=PITCH_UNITS):
    """q8_stage_chunk: tokens 16c .. 16c + 15 into a buffer of 16 staged rows (zeros past
    n_tok), copied in units of row_bytes / 17 bytes, each unit's source and destination
    aligned to its size (cp.async's requirement, asserted)."""
    unit = row_bytes // ROW_UNITS
    assert unit * ROW_UNITS == row_bytes and unit in (4, 8)
    buf = np.zeros(STAGE_TOKENS * pitch_units * unit, np.uint8)
    for lane in range(LANES):
        for i in range((STAGE_TOKENS * ROW_UNITS + 31) // 32):
            u = lane + 32 * i
            if u >= STAGE_TOKENS * ROW_UNITS:
                continue
            j, k = divmod(u, ROW_UNITS)
            tok = STAGE_TOKENS * c + j
            src = int(rows[min(tok, n_tok - 1)]) * row_bytes + unit * k
            dst = unit * (j * pitch_units + k)
            assert src % unit == 0 and dst % unit == 0, "misaligned cp.async"
            if tok < n_tok:
                buf[dst:dst + unit] = pool_bytes[src:src + unit]
    return buf


TMA_BOX_BYTES = 144  # Q8_TMA_BOX_BYTES: a head_dim-128 row's aligned 16-byte window


def stage_chunk_tma(pool_bytes, rows, row_bytes, n_tok, c, kv_heads):
    """q8_stage_chunk_tma: one 2-D tensor copy of 16 token slots x the 144 bytes at the
    KV head's row offset rounded down to 16 (the slot a multiple of 16 bytes: kv_heads
    even), whatever the slots hold past n_tok. Returns the buffer as the readers see it:
    from the row's offset in its window (0 or 8), so staged row j starts at 144 j."""
    assert row_bytes == 136 and kv_heads % 2 == 0
    slot_bytes = kv_heads * row_bytes
    first = int(rows[STAGE_TOKENS * c])
    kvh, y = first % kv_heads, first // kv_heads
    # the chunk is 16 consecutive slots of one block (block_size a multiple of 16)
    live = rows[STAGE_TOKENS * c:min(n_tok, STAGE_TOKENS * (c + 1))]
    assert (live == (y + np.arange(len(live))) * kv_heads + kvh).all()
    at = kvh * row_bytes
    x, off = at & ~15, at & 15
    assert x % 16 == 0 and x + TMA_BOX_BYTES <= slot_bytes and off in (0, 8)
    buf = np.zeros(STAGE_TOKENS * TMA_BOX_BYTES, np.uint8)
    for j in range(STAGE_TOKENS):
        src = (y + j) * slot_bytes + x
        if src + TMA_BOX_BYTES <= pool_bytes.size:  # past the pool: the copy fills zeros
            buf[TMA_BOX_BYTES * j:TMA_BOX_BYTES * (j + 1)] = pool_bytes[src:src + TMA_BOX_BYTES]
    return buf[off:]


def staged_buffer(pool_bytes, rows, row_bytes, n_tok, c, pitch_units, tma_heads):
    """The chunk's staged rows: tensor copies where ``tma_heads`` (kv_heads) is given, else
    cp.async units."""
    if tma_heads:
        assert pitch_units == PITCH_UNITS
        return stage_chunk_tma(pool_bytes, rows, row_bytes, n_tok, c, tma_heads)
    return stage_chunk(pool_bytes, rows, row_bytes, n_tok, c, pitch_units)


def warp_chunks(warp, n_tok, n_warps):
    return range(warp, (n_tok + STAGE_TOKENS - 1) // STAGE_TOKENS, n_warps)


def staged_scores(pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, scores, n_warps,
                  pitch_units, record_sum, join, tma_heads=0):
    """The chunk walk both staged pass-1 variants share: per warp, chunk and 8-token group,
    ``record_sum(acc, i, w0, w1, d0, d1)`` adds record i (the lane's code words at codes 8t
    and 8t + 4 of token gid, the f32 scales of C's tokens 2t, 2t + 1) into ``acc``
    (``float32[32, 4]``), and ``join(acc)`` gives the scores of tokens 2t, 2t + 1."""
    n_rec = head_dim // Q8_BLOCK
    pitch = pitch_units * (row_bytes // ROW_UNITS)
    for warp in range(n_warps):
        for c in warp_chunks(warp, n_tok, n_warps):
            buf = staged_buffer(pool_bytes, rows, row_bytes, n_tok, c, pitch_units, tma_heads)
            for h in range(2):
                row = (8 * h + GID) * pitch
                row0 = (8 * h + 2 * TID) * pitch
                acc = np.zeros((LANES, 4), np.float32)
                for i in range(n_rec):
                    rec = row + i * Q8_RECORD_BYTES
                    w0 = load_word_a2(buf, rec + 2 + 8 * TID, i % 2 == 1)
                    w1 = load_word_a2(buf, rec + 6 + 8 * TID, i % 2 == 1)
                    d0 = f16_value(load_u16(buf, row0 + i * Q8_RECORD_BYTES))
                    d1 = f16_value(load_u16(buf, row0 + pitch + i * Q8_RECORD_BYTES))
                    record_sum(acc, i, w0, w1, d0, d1)
                s0, s1 = join(acc)
                t0 = STAGE_TOKENS * c + 8 * h + 2 * TID
                for lane in range(LANES):
                    if GID[lane] < gmax:
                        if t0[lane] < n_tok:
                            scores[t0[lane] * gmax + GID[lane]] = s0[lane]
                        if t0[lane] + 1 < n_tok:
                            scores[(t0[lane] + 1) * gmax + GID[lane]] = s1[lane]


def qk_scores_q8_staged(q_group, group, head_dim, scale, pool_bytes, rows, row_bytes, n_tok,
                        gmax, scores, n_warps=4, pitch_units=PITCH_UNITS, tma_heads=0):
    """qk_scores_mma_q8_staged: the fragments of qk_scores_q8, read from staged rows."""
    qa = q_fragments(q_group, group, head_dim, scale)

    def record_sum(acc, i, w0, w1, d0, d1):
        x0, x1 = q8_flip(w0), q8_flip(w1)
        r = np.zeros((LANES, 4), np.float32)
        r = mma_16x8x16(r, qa[2 * i], q8_codes_f16x2(0x4140, x0),
                        q8_codes_f16x2(0x4342, x0))
        r = mma_16x8x16(r, qa[2 * i + 1], q8_codes_f16x2(0x4140, x1),
                        q8_codes_f16x2(0x4342, x1))
        acc[:, 0] += d0 * r[:, 0]
        acc[:, 1] += d1 * r[:, 1]
        acc[:, 2] += d0 * r[:, 2]
        acc[:, 3] += d1 * r[:, 3]

    staged_scores(pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, scores, n_warps,
                  pitch_units, record_sum, lambda acc: (acc[:, 0] + acc[:, 2],
                                                        acc[:, 1] + acc[:, 3]), tma_heads)


# --- the q8i kernels: pass 1 on integer tensor cores (q_fragments_s8,
# qk_scores_imma_q8_staged), pass 2 as q8s.


def s8_planes22(v, inv_step):
    """s8_planes22 (hip/mma_s8.h): round(v / step) (f32 product, round half to even) as three
    signed bytes p0 + 2^8 p1 + 2^16 p2."""
    x = np.rint((np.asarray(v, np.float32) * np.float32(inv_step)).astype(np.float32)).astype(
        np.int64)
    p0 = ((x & 0xFF) ^ 0x80) - 0x80
    r1 = (x - p0) >> 8
    p1 = ((r1 & 0xFF) ^ 0x80) - 0x80
    p2 = (r1 - p1) >> 8
    assert (np.abs(p2) <= 64).all()
    return p0, p1, p2


def q_fragments_s8(q_group, group, head_dim, scale):
    """q_fragments_s8: qa[i][reg] (uint32[32]) and qstep[i] (float32[32]) per record i; A row
    gid = plane gid // 4 of head gid % 4, row gid + 8 = plane 2 of head gid (gid < 4); k 4t + j
    is dim 8t + j of the record, k 16 + 4t + j dim 8t + 4 + j."""
    n_rec = head_dim // Q8_BLOCK
    head = GID % 4
    live = head < group
    qa = [[np.zeros(LANES, np.uint32) for _ in range(4)] for _ in range(4)]
    qstep = [np.zeros(LANES, np.float32) for _ in range(4)]
    for i in range(n_rec):
        v = np.zeros((LANES, 8), np.float32)
        for e in range(8):
            v[live, e] = (q_group[head[live], 32 * i + 8 * TID[live] + e].astype(np.float32)
                          * np.float32(scale))
        amax = np.abs(v).max(axis=1)
        amax = np.maximum(amax, amax[LANE ^ 1])
        amax = np.maximum(amax, amax[LANE ^ 2])
        ex = np.maximum(np.frexp(amax)[1], -104)
        inv_step = np.ldexp(np.float32(1), 22 - ex).astype(np.float32)
        qstep[i] = np.ldexp(np.float32(1), ex - 22).astype(np.float32)
        for e in range(8):
            p0, p1, p2 = s8_planes22(v[:, e], inv_step)
            reg, shift = (0 if e < 4 else 2), 8 * (e % 4)
            lo = np.where(GID < 4, p0, p1)
            hi = np.where(GID < 4, p2, 0)
            qa[i][reg] = qa[i][reg] | ((lo & 0xFF).astype(np.uint32) << shift)
            qa[i][reg + 1] = qa[i][reg + 1] | ((hi & 0xFF).astype(np.uint32) << shift)
    return qa, qstep


def qk_scores_q8_int_staged(q_group, group, head_dim, scale, pool_bytes, rows, row_bytes,
                            n_tok, gmax, scores, n_warps=4, pitch_units=PITCH_UNITS,
                            tma_heads=0):
    """qk_scores_imma_q8_staged: one s8 mma per record and 8 tokens on the staged codes as
    they are; per-plane f32 sums times d * step, planes joined with plane 1 from lane + 16."""
    qa, qstep = q_fragments_s8(q_group, group, head_dim, scale)

    def record_sum(acc, i, w0, w1, d0, d1):
        r = np.zeros((LANES, 4), np.int64)
        mma_s8_16x8x32(r, *qa[i], w0, w1)
        ds0, ds1 = qstep[i] * d0, qstep[i] * d1
        rf = r.astype(np.float32)
        acc[:, 0] += ds0 * rf[:, 0]
        acc[:, 1] += ds1 * rf[:, 1]
        acc[:, 2] += ds0 * rf[:, 2]
        acc[:, 3] += ds1 * rf[:, 3]

    def join(acc):
        up = acc[LANE ^ 16]  # pkv_shfl_xor(acc, 16): plane 1 of head gid
        return (acc[:, 0] + (np.float32(256) * up[:, 0] + np.float32(65536) * acc[:, 2]),
                acc[:, 1] + (np.float32(256) * up[:, 1] + np.float32(65536) * acc[:, 3]))

    staged_scores(pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, scores, n_warps,
                  pitch_units, record_sum, join, tma_heads)


def f32_exponent(x) -> int:
    return int(np.float32(x).view(np.uint32) >> 23) & 0xFF


def pv_q8_staged(scores, pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, warp,
                 n_warps=4, pitch_units=PITCH_UNITS, tma_heads=0):
    """pv_mma_q8_staged for one warp: its ``o[8][4]`` per lane, remainder columns folded in
    and scaled back; pscale per warp and running (``e``, the largest V scale's exponent of
    the chunks so far), the accumulators rescaled by 2^(e_old - e_new) when it grows."""
    n_rec = head_dim // Q8_BLOCK
    pitch = pitch_units * (row_bytes // ROW_UNITS)
    o = np.zeros((LANES, 8, 4), np.float32)
    head = GID % 4
    rest, live = GID >= 4, head < gmax
    e = 103
    for c in warp_chunks(warp, n_tok, n_warps):
        buf = staged_buffer(pool_bytes, rows, row_bytes, n_tok, c, pitch_units, tma_heads)
        d = np.zeros((4, 4, LANES), np.uint32)
        pairs = []  # per record: its 4 words (odd) or lo01, hi01, lo23, hi23 (even)
        dm = np.zeros(LANES, np.uint32)
        for j in range(4):
            row = (4 * TID + j) * pitch
            for lr in range(n_rec):
                rec = row + lr * Q8_RECORD_BYTES
                d[j, lr] = load_u16(buf, rec)
                if tma_heads:  # a tensor copy stages rows past the partition as they are
                    d[j, lr] = np.where(STAGE_TOKENS * c + 4 * TID + j >= n_tok, 0, d[j, lr])
                dm = np.maximum(dm, d[j, lr] & 0x7FFF)
        for lr in range(n_rec):
            rec = 4 * TID * pitch + lr * Q8_RECORD_BYTES + 2 + 4 * GID
            if lr % 2:  # 4-byte aligned words, interleaved by pv_record_mma_q8
                pairs.append([load_word_a2(buf, rec + j * pitch, True) for j in range(4)])
            else:  # 2-byte aligned: halves
                def u16(j, off, rec=rec, buf=buf):
                    return load_u16(buf, rec + j * pitch + off)
                pairs.append((q8_interleave(0x5140, u16(0, 0), u16(1, 0)),
                              q8_interleave(0x5140, u16(0, 2), u16(1, 2)),
                              q8_interleave(0x5140, u16(2, 0), u16(3, 0)),
                              q8_interleave(0x5140, u16(2, 2), u16(3, 2))))
        dm = np.maximum(dm, dm[LANE ^ 1])
        dm = np.maximum(dm, dm[LANE ^ 2])
        assert (dm == dm[0]).all()  # warp-uniform: the rescale branch is taken by all
        ec = max(f32_exponent(f16_value(dm[0])), 103)
        if ec > e:
            o *= np.uint32((127 + e - ec) << 23).view(np.float32)
            e = ec
        pscale = np.uint32((268 - e) << 23).view(np.float32)
        pp = np.zeros((4, LANES), np.float32)  # p * pscale per token
        for j in range(4):
            tok = STAGE_TOKENS * c + 4 * TID + j
            sel = live & (tok < n_tok)
            pp[j, sel] = scores[tok[sel] * gmax + head[sel]]
        pp = (pp * pscale).astype(np.float32)

        def pd_pair(k, lr, pp=pp, d=d):
            v0 = (pp[2 * k] * f16_value(d[2 * k, lr])).astype(np.float32)
            v1 = (pp[2 * k + 1] * f16_value(d[2 * k + 1, lr])).astype(np.float32)
            hi = f32x2_to_f16x2(v0, v1)
            rem = f32x2_to_f16x2((v0 - f16_value(hi)).astype(np.float32),
                                 (v1 - f16_value(hi >> 16)).astype(np.float32))
            return np.where(rest, rem, hi)

        for lr in range(n_rec):
            b0, b1 = pd_pair(0, lr), pd_pair(1, lr)
            if lr % 2:
                pv_record_mma_q8(o, lr, pairs[lr], b0, b1)
            else:
                pv_record_pairs_mma_q8(o, lr, pairs[lr], b0, b1)
    return (o + o[LANE ^ 2]) * np.uint32((e - 14) << 23).view(np.float32)


def paged_attention_q8_mma(q, k_pool, v_pool, block_tables, seq_lens, *, scale, partition,
                           n_warps=4, staged=False, qk_int=False, tma=False):
    """The q8 partition kernel on its tensor-core passes plus pkv_paged_attention_reduce:
    ``float32[seqs, heads, head_dim]``; ``staged``: the q8s kernel's passes (no V-scale
    pre-pass: each warp's pscale is its own and running); ``qk_int`` (with ``staged``): the
    q8i kernel, pass 1 on integer tensor cores; ``tma`` (with ``staged``): each chunk by one
    tensor copy (PKV_ATTN_Q8_STAGE_TMA: head_dim 128, kv_heads even, block_size a multiple
    of 16)."""
    assert staged or not (qk_int or tma)
    seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, row_bytes = k_pool.shape
    group = num_heads // kv_heads
    gmax = 1 << (group - 1).bit_length()
    assert gmax <= 4 and head_dim in (64, 128)
    kb = np.ascontiguousarray(k_pool).reshape(-1)
    vb = np.ascontiguousarray(v_pool).reshape(-1)
    out = np.zeros(q.shape, np.float32)
    for seq in range(seqs):
        n = int(seq_lens[seq])
        parts = []
        for start in range(0, n, partition):
            n_tok = min(partition, n - start)
            pos = start + np.arange(n_tok)
            blocks = block_tables[seq, pos // block_size].astype(np.int64)
            for kvh in range(kv_heads):
                rows = (blocks * block_size + pos % block_size) * kv_heads + kvh
                scores = np.zeros(n_tok * gmax, np.float32)
                qk = (qk_scores_q8_int_staged if qk_int else
                      qk_scores_q8_staged if staged else qk_scores_q8)
                extra = {"tma_heads": kv_heads} if tma else {}
                qk(q[seq, kvh * group:(kvh + 1) * group], group, head_dim, scale, kb, rows,
                   row_bytes, n_tok, gmax, scores, n_warps, **extra)
                s = scores.reshape(n_tok, gmax)
                pmax = s.max(axis=0)
                pr = np.exp(s - pmax).astype(np.float32)
                psum = pr.sum(axis=0, dtype=np.float32)
                # pscale: the partition's largest V scale lifted into [2^14, 2^15)
                vscales = load_u16(vb, rows[:, None] * row_bytes
                                   + Q8_RECORD_BYTES * np.arange(head_dim // Q8_BLOCK))
                vm = np.float32(np.abs(f16_value(vscales)).max())
                e = max(int(vm.view(np.uint32) >> 23) & 0xFF, 103)
                pscale = np.uint32((268 - e) << 23).view(np.float32)
                unscale = np.uint32((e - 14) << 23).view(np.float32)
                assert 2.0 ** 14 <= vm * pscale < 2.0 ** 15 or vm < 2.0 ** -24
                wsum = np.zeros((n_warps, gmax, head_dim), np.float32)
                for w in range(n_warps):
                    if staged:
                        o = pv_q8_staged(pr.reshape(-1), vb, rows, row_bytes, n_tok, head_dim,
                                         gmax, w, n_warps, **extra)
                    else:
                        o = pv_q8(pr.reshape(-1), vb, rows, row_bytes, n_tok, head_dim, gmax, w,
                                  pscale, n_warps) * unscale
                    for lane in range(LANES):
                        g_, t_ = GID[lane], TID[lane]
                        if t_ >= 2:
                            continue
                        for mt in range(2 * head_dim // 32):
                            d = 32 * (mt // 2) + 4 * g_ + 2 * (mt % 2)
                            for e in range(2):
                                if 2 * t_ + e < gmax:
                                    wsum[w, 2 * t_ + e, d] = o[lane, mt, e]
                                    wsum[w, 2 * t_ + e, d + 1] = o[lane, mt, 2 + e]
                parts.append((kvh, pmax, psum, wsum.sum(axis=0, dtype=np.float32)))
        for kvh in range(kv_heads):
            mine = [p for p in parts if p[0] == kvh]
            for g in range(group):
                h = kvh * group + g
                if not mine:
                    continue
                out[seq, h] = combine_partitions([p[1:] for p in mine], g)
    return out


def combine_partitions(parts, g):
    """The reduce kernel's combination of partitions for query head slot ``g``: each part is
    ``(pmax, psum, wsum)`` of one partition (float32), weighted by ``exp(pmax - max)``
    (:func:`combine_head`)."""
    return combine_head(np.array([p[0][g] for p in parts], np.float32),
                        np.array([p[1][g] for p in parts], np.float32),
                        np.stack([np.asarray(p[2][g], np.float32) for p in parts]))


def fma_f32(a, b, c) -> np.ndarray:
    """fmaf: a * b + c rounded once to float32. The float32 product is exact in float64;
    the sum is rounded to odd there (TwoSum's error picks the odd neighbour), which then
    rounds to float32 as the exact value would (53 >= 24 + 2 bits)."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    prod = a * b
    s = prod + c
    bb = s - prod
    err = (prod - (s - bb)) + (c - bb)
    even = (s.view(np.uint64) & np.uint64(1)) == 0
    s = np.where((err != 0) & even & np.isfinite(s),
                 np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def reduce_slices() -> int:
    """PKV_ATTN_REDUCE_SLICES (pagedkv/launch.h): partition p is summed in slice p % slices."""
    from pagedkv.kernels.launch_constants import launch_constant
    return launch_constant("PKV_ATTN_REDUCE_SLICES")


def partition_weights(pmax: np.ndarray, m) -> np.ndarray:
    """attn_partition_weight: ``expf(m_p - M)`` (NumPy's float32 exp: the device's may differ
    from it in the last bit, except where m_p == M: exactly 1 on both)."""
    return np.exp((np.asarray(pmax, np.float32) - np.float32(m)).astype(np.float32))


def combine_header(pmax: np.ndarray, psum: np.ndarray) -> tuple[np.float32, np.float32]:
    """attn_combine_header for one (seq, head), lane by lane: lane j takes partitions j, j +
    32, ... (an fmaxf chain, then an fmaf chain from 0 of weight x sum), the 32 lanes' values
    meet in the xor butterfly 16, 8, 4, 2, 1. Returns ``(M, inv)``, inv = 1 / denominator
    (0 when it is not > 0)."""
    n = len(pmax)
    m_lane = np.full(LANES, -np.inf, np.float32)
    for p in range(n):
        m_lane[p % LANES] = np.fmax(m_lane[p % LANES], np.float32(pmax[p]))  # fmaxf
    for o in (16, 8, 4, 2, 1):
        m_lane = np.fmax(m_lane, m_lane[LANE ^ o])
    m = m_lane[0]
    d_lane = np.zeros(LANES, np.float32)
    w = partition_weights(pmax, m)
    for p in range(n):
        d_lane[p % LANES] = fma_f32(w[p], psum[p], d_lane[p % LANES])
    for o in (16, 8, 4, 2, 1):
        d_lane = (d_lane + d_lane[LANE ^ o]).astype(np.float32)
    assert (d_lane.view(np.uint32) == d_lane[0].view(np.uint32)).all()  # every lane's alike
    d = d_lane[0]
    return m, (np.float32(1.0) / d if d > 0 else np.float32(0.0))


def slice_sums(pmax: np.ndarray, pout: np.ndarray, m) -> list[np.ndarray]:
    """attn_slice_sum for every slice holding a partition: slice s's fmaf chain from 0 over
    partitions s, s + slices, ... in ascending order (whatever chunks the kernel loads
    them in). ``pout`` float32[n_parts, dims] -> one float32[dims] per slice."""
    slices = reduce_slices()
    w = partition_weights(pmax, m)
    sums = []
    for s in range(min(slices, len(pmax))):
        acc = np.zeros(pout.shape[1:], np.float32)
        for p in range(s, len(pmax), slices):
            acc = fma_f32(w[p], pout[p], acc)
        sums.append(acc)
    return sums


def slices_total(sums: list[np.ndarray], inv, dims) -> np.ndarray:
    """attn_slices_total: slice 0 + slice 1 + ... in order, times inv (zeros for none)."""
    t = np.zeros(dims, np.float32)
    if sums:
        t = sums[0].copy()
    for acc in sums[1:]:
        t = (t + acc).astype(np.float32)
    return (t * np.float32(inv)).astype(np.float32)


def combine_head(pmax: np.ndarray, psum: np.ndarray, pout: np.ndarray) -> np.ndarray:
    """hip/attention_reduce.h for one (seq, head), in its order: the header
    (:func:`combine_header`), the slices' sums (:func:`slice_sums`), their total times inv
    (:func:`slices_total`). ``pmax``, ``psum`` float32[n_parts], ``pout`` float32[n_parts,
    dims] -> float32[dims] (zeros for no partition)."""
    m, inv = combine_header(pmax, psum)
    return slices_total(slice_sums(pmax, pout, m), inv, pout.shape[1:])


def attention_reduce(part_out, part_max, part_sum, seq_lens, partition_tokens):
    """pkv_paged_attention_reduce on the partition workspace (``part_max``, ``part_sum``
    float32[seqs, heads, max_partitions], ``part_out`` [..., head_dim]): float32[seqs,
    heads, head_dim]. Partitions past a sequence's ``ceil(seq_len / partition_tokens)``
    are never read."""
    seqs, heads, _, head_dim = part_out.shape
    out = np.zeros((seqs, heads, head_dim), np.float32)
    for seq in range(seqs):
        n = -(-int(seq_lens[seq]) // partition_tokens)
        for h in range(heads):
            out[seq, h] = combine_head(part_max[seq, h, :n], part_sum[seq, h, :n],
                                       part_out[seq, h, :n])
    return out


def attention_reduce_prep(part_out, part_max, part_sum, seq_lens, partition_tokens, n_tiles,
                          rotate):
    """pkv_attention_reduce_prep_f32 (hip/decode.hip) block by block, its index expressions
    copied from the kernel text: per (256-group g, seq) block, the group's heads' headers,
    every lane's 8 dims (lane L: x[8L, 8L + 8) of the group, head ``mine``) summed per slice,
    warp 0's totals, then gemv_prep_x_warp. Returns ``(out, xq, xs)``: the float32[seqs,
    heads, head_dim] it writes and the prepared x."""
    from test_gemv_mma_simulated import X_WORDS, prep_x_warp
    num_seqs, num_heads, max_partitions, head_dim = part_out.shape
    pmax_flat, psum_flat = part_max.reshape(-1), part_sum.reshape(-1)
    pout_flat = part_out.reshape(-1)
    groups = num_heads * head_dim // 256
    xq = np.zeros(groups * n_tiles * 32 * X_WORDS, np.uint32)
    xs = np.zeros((groups * num_seqs, 4), np.float32)
    out = np.full(num_seqs * num_heads * head_dim, np.nan, np.float32)
    for g, seq in np.ndindex(groups, num_seqs):  # the grid (groups, num_seqs)
        heads = 256 // head_dim
        h0 = g * heads
        hp0 = (seq * num_heads + h0) * max_partitions
        n = -(-int(seq_lens[seq]) // partition_tokens)
        header = [combine_header(pmax_flat[hp0 + k * max_partitions:][:n],
                                 psum_flat[hp0 + k * max_partitions:][:n])
                  for k in range(heads)]
        v = np.zeros((32, 8), np.float32)
        for lane in range(32):
            mine = 8 * lane // head_dim
            d0 = 8 * lane - mine * head_dim
            base = (hp0 + mine * max_partitions) * head_dim + d0
            pout = np.stack([pout_flat[base + p * head_dim:][:8]
                             for p in range(n)]) if n else np.zeros((0, 8), np.float32)
            hp = hp0 + mine * max_partitions
            m, inv = header[mine]
            v[lane] = slices_total(slice_sums(pmax_flat[hp:hp + n], pout, m), inv, 8)
            at = (seq * num_heads + h0) * head_dim + 8 * lane
            out[at:at + 8] = v[lane]
        prep_x_warp(v, g, seq, xq, xs, num_seqs, n_tiles, rotate)
    return out.reshape(num_seqs, num_heads, head_dim), xq, xs

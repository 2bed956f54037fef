"""NumPy emulation of hip/kvcache.hip's compressed-KV tensor-core passes, lane by lane.

Mirrors ``build_code_table``, ``qk_scores_mma_codes``, ``pv_mma_codes`` and the ``_mma``
partition around them (docs/kernels.md, "Compressed KV on tensor cores") with the
primitives of ``mma_attention_emulation`` (the q8 passes' emulator: m16n8k16 fragment
layouts, ``__byte_perm``, f16 conversions): the same loads at the same byte offsets (with
their alignment asserted), the same code-byte table entries, the same selectors. A
fragment or byte-order mistake is a test failure here rather than a wrong answer on the GPU.
Kept in its own module so the q8 emulator stays the q8 kernels' mirror.
"""

from __future__ import annotations

import numpy as np

from mma_attention_emulation import (
    GID,
    LANE,
    LANES,
    TID,
    byte_perm,
    combine_partitions,
    f16_bits,
    f16_value,
    load_u16,
    load_word_a2,
    mma_16x8x16,
    q_fragments,
)
from pagedkv.kernels import numpy_kernels
from pagedkv.quant import kv as kv_modes
from pagedkv.quant import kv_rotated

CNORM_BYTES = 4
CODE_TABLE_SCALE = np.float32(64.0)


def code_table(centroids: np.ndarray, bits: int, nibbles: bool = True) -> np.ndarray:
    """build_code_table: ``uint32[entries, words]``; hi = f16(64 C), lo = f16(64 C - hi).
    Nibble tables (``PKV_ATTN_CODE_TABLE_NIBBLES`` 1, the default; 16 entries): 4 bits
    {hi | lo << 16} of one code, 2 bits {hi pair, lo pair} of the nibble's two codes (low two
    bits: the even dim). Byte tables (0, and gfx11's WMMA passes; 256 entries): 4 bits {hi
    pair, lo pair}, 2 bits {hi 0-1, hi 2-3, lo 0-1, lo 2-3}."""
    per = (4 if nibbles else 8) // bits
    n = np.arange(16 if nibbles else 256)
    codes = [(n >> (bits * k)) & ((1 << bits) - 1) for k in range(per)]
    v = [np.float32(centroids[c]) * CODE_TABLE_SCALE for c in codes]
    hi = [f16_bits(x) for x in v]
    lo = [f16_bits(x - f16_value(h)) for x, h in zip(v, hi, strict=True)]
    if per == 1:
        words = [hi[0] | lo[0] << 16]
    else:
        words = [hi[2 * k] | hi[2 * k + 1] << 16 for k in range(per // 2)]
        words += [lo[2 * k] | lo[2 * k + 1] << 16 for k in range(per // 2)]
    return np.stack(words, axis=1).astype(np.uint32)


def nibble_table(tab: np.ndarray) -> bool:
    return tab.shape[0] == 16


def code_pair2(tab: np.ndarray, byte, pair: int) -> tuple[np.ndarray, np.ndarray]:
    """code_pair2: (hi pair, lo pair) of dims 2 pair, + 1 of each 2-bit code byte."""
    byte = np.asarray(byte, np.int64)
    if nibble_table(tab):
        e = tab[(byte >> (4 * pair)) & 15]
        return e[:, 0], e[:, 1]
    e = tab[byte & 0xFF]
    return e[:, pair], e[:, 2 + pair]


def code_byte_pairs(tab: np.ndarray, byte) -> tuple[list, list]:
    """code_byte_pairs: (hi[k], lo[k]) of each lane's byte, pairs k of dims 2k, 2k + 1."""
    byte = np.asarray(byte, np.int64)
    if tab.shape[1] == 1:  # 4 bits, nibbles: the two codes' {hi, lo} joined by two permutes
        e0, e1 = tab[byte & 15, 0], tab[(byte >> 4) & 15, 0]
        return [byte_perm(e0, e1, 0x5410)], [byte_perm(e0, e1, 0x7632)]
    if tab.shape[1] == 2 and not nibble_table(tab):  # 4 bits, byte table
        e = tab[byte & 0xFF]
        return [e[:, 0]], [e[:, 1]]
    (h0, l0), (h1, l1) = code_pair2(tab, byte, 0), code_pair2(tab, byte, 1)
    return [h0, h1], [l0, l1]


def load_u32(pool: np.ndarray, addr) -> np.ndarray:
    return load_word_a2(pool, addr, True)  # asserts 4-byte alignment


def load_f32(pool: np.ndarray, addr) -> np.ndarray:
    return load_u32(pool, addr).view(np.float32)


def qk_scores_codes(qs, group, head_dim, bits, pool, rows, row_bytes, n_tok, gmax, tab, scores,
                    n_warps=4):
    """qk_scores_mma_codes: fills ``scores[t * gmax + g]``; qs ``float32[gmax, head_dim]``
    (rotated, times scale)."""
    n_groups = (n_tok + 7) // 8
    for half in range(head_dim // 128):
        qa = q_fragments(qs[:, 128 * half:128 * half + 128], group, 128, 1.0)
        code0 = CNORM_BYTES + 128 * half * bits // 8
        for warp in range(n_warps):
            for grp in range(warp, n_groups, n_warps):
                row = rows[np.minimum(8 * grp + GID, n_tok - 1)] * row_bytes
                cnorm = load_f32(pool, row)
                w = [load_u32(pool, row + code0 + 16 * i + 4 * TID) if bits == 4
                     else load_u16(pool, row + code0 + 8 * i + 2 * TID) for i in range(4)]
                c = np.zeros((LANES, 4), np.float32)
                for s in range(8):
                    if bits == 4:
                        h0, l0 = code_byte_pairs(tab, (w[s // 2] >> (16 * (s % 2))) & 0xFF)
                        h1, l1 = code_byte_pairs(tab, (w[s // 2] >> (16 * (s % 2) + 8)) & 0xFF)
                        hi, lo = [h0[0], h1[0]], [l0[0], l1[0]]
                    else:
                        hi, lo = code_byte_pairs(tab, (w[s // 2] >> (8 * (s % 2))) & 0xFF)
                    c = mma_16x8x16(c, qa[s], hi[0], hi[1])
                    c = mma_16x8x16(c, qa[s], lo[0], lo[1])
                cn0, cn1 = cnorm[8 * TID], cnorm[8 * TID + 4]  # shfl_word from lanes 8t, 8t + 4
                inv = np.float32(1.0) / CODE_TABLE_SCALE
                s0 = (c[:, 0] + c[:, 2]) * (cn0 * inv)
                s1 = (c[:, 1] + c[:, 3]) * (cn1 * inv)
                tok = 8 * grp + 2 * TID
                for lane in range(LANES):
                    g = GID[lane]
                    if g >= gmax:
                        continue
                    for t_, v in ((tok[lane], s0[lane]), (tok[lane] + 1, s1[lane])):
                        if t_ < n_tok:
                            i = t_ * gmax + g
                            scores[i] = np.float32(scores[i] + v) if half else v


def pv_codes_dim(bits: int, mt: int, gid):
    return (64 * (mt // 4) + 8 * gid + 2 * (mt % 4) if bits == 4
            else 16 * gid + 4 * (mt // 2) + 2 * (mt % 2))


def pv_codes(probs, pool, rows, row_bytes, n_tok, half, bits, gmax, warp, tab, n_warps=4):
    """pv_mma_codes of one warp: ``float32[32, 8, 4]`` (columns 0-3 after the remainder
    fold, divided by the table scale)."""
    code0 = CNORM_BYTES + 128 * half * bits // 8
    o = np.zeros((LANES, 8, 4), np.float32)
    head = GID % 4
    rest, live = GID >= 4, head < gmax
    for st in range(warp, (n_tok + 15) // 16, n_warps):
        words, x = [], np.zeros((LANES, 4), np.float32)
        for j in range(4):
            tok = 16 * st + 4 * TID + j
            row = rows[np.minimum(tok, n_tok - 1)] * row_bytes
            cnorm = load_f32(pool, row)
            words.append([load_u32(pool, row + code0 + 4 * GID),
                          load_u32(pool, row + code0 + 32 + 4 * GID) if bits == 4 else 0])
            ok = live & (tok < n_tok)
            p = np.where(ok, probs[np.where(ok, tok, 0) * gmax + np.where(live, head, 0)], 0)
            x[:, j] = np.where(ok, p.astype(np.float32) * cnorm, 0)
        b = []
        for k in range(2):
            bits16 = np.zeros(LANES, np.uint32)
            for e in range(2):
                v = x[:, 2 * k + e]
                hi = f16_bits(v)
                h = np.where(rest, f16_bits(v - f16_value(hi)), hi)
                bits16 |= h << (16 * e)
            b.append(bits16)
        for mt in range(8):
            word, byte = (mt // 4, mt % 4) if bits == 4 else (0, mt // 2)
            pair = 0 if bits == 4 else mt % 2
            tok_bytes = [np.asarray(words[j][word], np.int64) >> (8 * byte) for j in range(4)]
            if bits == 4 and nibble_table(tab):  # {hi, lo} of each token's even / odd dim
                ev = [tab[b_ & 15, 0] for b_ in tok_bytes]
                od = [tab[(b_ >> 4) & 15, 0] for b_ in tok_bytes]
                ah = [byte_perm(ev[0], ev[1], 0x5410), byte_perm(od[0], od[1], 0x5410),
                      byte_perm(ev[2], ev[3], 0x5410), byte_perm(od[2], od[3], 0x5410)]
                al = [byte_perm(ev[0], ev[1], 0x7632), byte_perm(od[0], od[1], 0x7632),
                      byte_perm(ev[2], ev[3], 0x7632), byte_perm(od[2], od[3], 0x7632)]
            else:  # the pair of each token's byte
                if bits == 4:
                    hi, lo = ([code_byte_pairs(tab, b_)[i][0] for b_ in tok_bytes] for i in (0, 1))
                else:
                    hi, lo = zip(*(code_pair2(tab, b_, pair) for b_ in tok_bytes), strict=True)
                ah, al = ([byte_perm(regs[0], regs[1], 0x5410), byte_perm(regs[0], regs[1], 0x7632),
                           byte_perm(regs[2], regs[3], 0x5410), byte_perm(regs[2], regs[3], 0x7632)]
                          for regs in (hi, lo))
            for a in (ah, al):
                o[:, mt] = mma_16x8x16(o[:, mt], a, b[0], b[1])
    return (o + o[LANE ^ 2]) * (np.float32(1.0) / CODE_TABLE_SCALE)


def pv_codes_half(probs, pool, rows, row_bytes, n_tok, half, bits, gmax, warp, tab, n_warps):
    """pv_mma_codes of one warp and the partition's store of its o: ``float32[gmax, 128]``,
    the warp's sums over the half's 128 dims."""
    o = pv_codes(probs, pool, rows, row_bytes, n_tok, half, bits, gmax, warp, tab, n_warps)
    out = np.zeros((gmax, 128), np.float32)
    for lane in np.flatnonzero(TID < 2):
        for mt in range(8):
            d = pv_codes_dim(bits, mt, GID[lane])
            for e in range(2):
                if 2 * TID[lane] + e < gmax:
                    out[2 * TID[lane] + e, d] = o[lane, mt, e]
                    out[2 * TID[lane] + e, d + 1] = o[lane, mt, 2 + e]
    return out


#: The NVIDIA passes: (pass 1, pass 2 with its store, the most heads per KV head, warps).
NVIDIA_PASSES = (qk_scores_codes, pv_codes_half, 4, 4)


def paged_attention_codes_mma(q, k_pool, v_pool, block_tables, seq_lens, *, kv_dtype, scale,
                              partition, passes=NVIDIA_PASSES, nibbles=True):
    """The ``_mma`` partition kernel of a rotated-K / rotated-V pair on its matrix-core
    passes plus the unrotating reduce: ``float32[seqs, heads, head_dim]``. ``passes``: the
    NVIDIA ones by default, or an AMD unit's (tests/test_attention_codes_amd_simulated.py)
    with the same signatures; ``nibbles``: the code tables' layout (:func:`code_table`)."""
    qk_scores, pv_half, most_gmax, n_warps = passes
    k_side, v_side = kv_modes.split_kv_dtype(kv_dtype)
    km, vm = kv_modes.kv_mode(k_side), kv_modes.kv_mode(v_side)
    assert km.bits in (4, 2) and vm.bits in (4, 2) and vm.rotated
    seqs, num_heads, head_dim = q.shape
    _, block_size, kv_heads, k_row = k_pool.shape
    v_row = v_pool.shape[-1]
    group = num_heads // kv_heads
    gmax = 1 << (group - 1).bit_length()
    assert gmax <= most_gmax
    tab_k = code_table(kv_rotated.tables(km.bits, km.rotation)[0], km.bits, nibbles)
    tab_v = code_table(kv_rotated.tables(vm.bits, vm.rotation)[0], vm.bits, nibbles)
    kb = np.ascontiguousarray(k_pool).reshape(-1)
    vb = np.ascontiguousarray(v_pool).reshape(-1)
    out = np.zeros(q.shape, np.float32)
    for seq in range(seqs):
        n = int(seq_lens[seq])
        for kvh in range(kv_heads):
            qs = np.zeros((gmax, head_dim), np.float32)
            for g in range(gmax):  # rotate_shared<KROT> of q * scale (f32 butterflies)
                qs[g] = q[seq, kvh * group + (g if g < group else 0)] * np.float32(scale)
            qs = numpy_kernels._rotate_rows(qs, km.rotation, False)
            parts = []
            for start in range(0, n, partition):
                n_tok = min(partition, n - start)
                pos = start + np.arange(n_tok)
                blocks = block_tables[seq, pos // block_size].astype(np.int64)
                rows = (blocks * block_size + pos % block_size) * kv_heads + kvh
                scores = np.zeros(n_tok * gmax, np.float32)
                qk_scores(qs, group, head_dim, km.bits, kb, rows, k_row, n_tok, gmax, tab_k,
                          scores, n_warps)
                s = scores.reshape(n_tok, gmax)
                pmax = s.max(axis=0)
                pr = np.exp(s - pmax).astype(np.float32)
                psum = pr.sum(axis=0, dtype=np.float32)
                wsum = np.zeros((n_warps, gmax, head_dim), np.float32)
                for half in range(head_dim // 128):
                    for w in range(n_warps):
                        wsum[w, :, 128 * half:128 * half + 128] = pv_half(
                            pr.reshape(-1), vb, rows, v_row, n_tok, half, vm.bits, gmax, w,
                            tab_v, n_warps)
                parts.append((pmax, psum, wsum.sum(axis=0, dtype=np.float32)))
            for g in range(group):
                if not parts:
                    continue
                out[seq, kvh * group + g] = combine_partitions(parts, g)
    # the reduce's rotate_shared<VROT>(inverse): R^T per VROT-block
    return numpy_kernels._rotate_rows(out.reshape(-1, head_dim), vm.rotation, True).reshape(
        out.shape)

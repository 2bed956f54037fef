"""f16 and bf16 paged attention on AMD matrix cores (hip/kvcache.hip, ``qk_scores_mfma`` and
``pv_mfma`` in the ``pkv_paged_attention_{f16,bf16}mfma_g*`` kernels) simulated in NumPy,
lane by lane over 64-lane wavefronts: the query fragments (16-bit value and remainder rows),
the K and V row loads through the token -> row table, the ``v_mfma_f32_16x16x16f16`` /
``v_mfma_f32_16x16x16bf16_1k`` register layouts (AMD matrix instruction calculator, CDNA2 and
CDNA3: lane l, i = l % 16, q = l // 16; A element e is ``A[i][4q + e]``, B element e
``B[4q + e][i]``, D register r ``D[4q + r][i]``; element e of a 4 x 16-bit operand is half
e % 2 of word e // 2), the score stores, the P columns and the output stores, with the index
expressions copied from the kernel text (``KERNEL_TEXT`` pins them to it). No AMD GPU is
available: this and hipcc compiling the kernels for gfx90a/gfx940 are all the checking the
path has (docs/kernels.md, "AMD matrix cores"); it runs only with ``PAGEDKV_ATTN_MFMA=1``."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from mma_attention_emulation import combine_partitions, load_u16, load_word_a2
from pagedkv.quant import kv_q8

WAVE = 64
KVCACHE_HIP = Path(__file__).resolve().parents[1] / "hip" / "kvcache.hip"


def _wave():
    lane = np.arange(WAVE)
    return lane, lane % 16, lane // 16  # lane, i, q


def to_bits(v, kind):
    """to_mfma_bits<KIND>: f32 -> f16 bits (hardware, round to nearest even) or bf16 bits
    (the kernel's integer rounding, copied)."""
    v = np.asarray(v, np.float32)
    if kind == "f16":
        return v.astype(np.float16).view(np.uint16).astype(np.uint32)
    u = v.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint32)


def from_bits(bits, kind):
    """from_mma_bits<KIND>: 16-bit element -> f32, exact."""
    bits = np.asarray(bits, np.uint32) & 0xFFFF
    if kind == "f16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return (bits << 16).astype(np.uint32).view(np.float32)


def _elements(words, kind):
    """uint32[64, 2] (a lane's two words) -> float64[64, 4]: element e is half e % 2 of
    word e // 2."""
    halves = [(words[:, e // 2] >> (16 * (e % 2))) & 0xFFFF for e in range(4)]
    return np.stack([from_bits(h, kind) for h in halves], axis=1).astype(np.float64)


def mfma_f32_16x16x16(c, a, b, kind):
    """v_mfma_f32_16x16x16f16 (kind "f16") or v_mfma_f32_16x16x16bf16_1k ("bf16"): a, b
    uint32[64, 2], c float32[64, 4] updated in place. Products of 16-bit values are exact in
    float64; the sum is rounded once to f32 per instruction (hardware may round differently:
    the tests' bounds cover it)."""
    _, i, q = _wave()
    A = np.zeros((16, 16))
    B = np.zeros((16, 16))
    seen_a, seen_b = np.zeros((16, 16), int), np.zeros((16, 16), int)
    va, vb = _elements(a, kind), _elements(b, kind)
    for e in range(4):
        A[i, 4 * q + e] = va[:, e]
        np.add.at(seen_a, (i, 4 * q + e), 1)
        B[4 * q + e, i] = vb[:, e]
        np.add.at(seen_b, (4 * q + e, i), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    D = A @ B
    for r in range(4):
        c[:, r] = (c[:, r].astype(np.float64) + D[4 * q + r, i]).astype(np.float32)


def _pack(lo, hi):
    return (np.asarray(lo, np.uint32) & 0xFFFF) | (np.asarray(hi, np.uint32) << 16)


def pair_halves(t0, t1, upper):
    """pair_halves: two tokens' 16-bit elements of one dim from their words of two adjacent
    dims, the low halves (upper false) or the high ones, t0's in the low half."""
    t0, t1 = np.asarray(t0, np.uint32), np.asarray(t1, np.uint32)
    return (t0 >> 16 | (t1 & 0xFFFF0000)) if upper else ((t0 & 0xFFFF) | (t1 << 16))


def q_fragments_mfma(q_group, group, head_dim, scale, kind):
    """q_fragments_mfma<KIND>: uint32[8 k-steps, 64 lanes, 2 words]."""
    _, i, q = _wave()
    head = i % 8
    n_loads = head_dim // 32
    scale = np.float32(scale)
    qa = np.zeros((8, WAVE, 2), np.uint32)
    for s in range(8):
        live = (s // 2 < n_loads) & (head < group)
        bits = []
        for e in range(4):
            dim = 32 * (s // 2) + 8 * q + 4 * (s % 2) + e
            v = np.where(live, q_group[np.minimum(head, group - 1), np.minimum(dim, head_dim - 1)]
                         * scale, 0).astype(np.float32)
            hi = to_bits(v, kind)
            lo = to_bits(v - from_bits(hi, kind), kind)
            bits.append(np.where(live, np.where(i < 8, hi, lo), 0))
        qa[s] = np.stack([_pack(bits[0], bits[1]), _pack(bits[2], bits[3])], axis=1)
    return qa


def _store_scores(scores, c, tok, n_tok, gmax):
    """The score store of both pass-1 variants: head g = 4q + r is D[g] + D[g + 8]."""
    lane, _, q = _wave()
    for r in range(4):
        rest = c[lane ^ 32, r]  # pkv_shfl_xor(c[r], 32)
        g = 4 * q + r
        ok = (q < 2) & (g < gmax) & (tok < n_tok)
        scores[(tok * gmax + g)[ok]] = (c[:, r] + rest)[ok]


def qk_scores_mfma(q_group, group, head_dim, scale, k_bits, rows, n_tok, gmax, n_waves,
                   kind="f16"):
    """qk_scores_mfma<KIND, GMAX>: scores float32[n_tok * GMAX] (NaN where nothing is stored).
    ``k_bits``: uint16[rows, head_dim], the pool's rows; ``rows``: token -> row."""
    _, i, q = _wave()
    n_loads = head_dim // 32
    qa = q_fragments_mfma(q_group, group, head_dim, scale, kind)
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    chunks = np.ascontiguousarray(k_bits).view(np.uint32).reshape(len(k_bits), head_dim // 8, 4)
    for wave in range(n_waves):
        for grp in range(wave, -(-n_tok // 16), n_waves):
            tok = 16 * grp + i
            row = rows[np.minimum(tok, n_tok - 1)]
            c = np.zeros((WAVE, 4), np.float32)
            for s in range(8):
                if s // 2 < n_loads:
                    k = chunks[row, 4 * (s // 2) + q]  # row[4 * l + q], l = s / 2
                    k = np.where((tok < n_tok)[:, None], k, 0).astype(np.uint32)
                    b = k[:, 2:] if s % 2 else k[:, :2]  # {k.z, k.w} or {k.x, k.y}
                    mfma_f32_16x16x16(c, qa[s], b, kind)
            _store_scores(scores, c, tok, n_tok, gmax)
    return scores


def q8_codes_f16x4(w):
    """q8_codes_f16x4: the 4 signed bytes of w as f16 bits, uint32[64, 2] (elements 0..3)."""
    x = np.asarray(w, np.uint32) ^ 0x80808080
    b01 = (x & 0xFF) | (x & 0xFF00) << 8 | 0x64006400
    b23 = (x >> 16 & 0xFF) | (x >> 8 & 0xFF0000) | 0x64006400
    out = []
    for word in (b01, b23):
        halves = [from_bits(word >> (16 * h), "f16").astype(np.float16) - np.float16(1152)
                  for h in range(2)]
        out.append(_pack(*(v.view(np.uint16) for v in halves)))
    return np.stack(out, axis=1).astype(np.uint32)


def qk_scores_mfma_q8(q_group, group, head_dim, scale, pool_bytes, rows, row_bytes, n_tok, gmax,
                      n_waves, scale_record=lambda l: l):
    """qk_scores_mfma_q8<GMAX> over a flat q8 pool (``pool_bytes``: uint8, rows of
    ``row_bytes``): scores float32[n_tok * GMAX]. ``scale_record`` is the kernel's record ->
    scale mapping (the mutation test changes it)."""
    _, i, q = _wave()
    n_rec = head_dim // 32
    qa = q_fragments_mfma(q_group, group, head_dim, scale, "f16")
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    for wave in range(n_waves):
        for grp in range(wave, -(-n_tok // 16), n_waves):
            tok = 16 * grp + i
            live = tok < n_tok
            row = rows[np.minimum(tok, n_tok - 1)].astype(np.int64) * row_bytes
            c = np.zeros((WAVE, 4), np.float32)
            for ll in range(n_rec):
                rec = row + 34 * ll
                code = [np.where(live, load_word_a2(pool_bytes, rec + 2 + 4 * h + 8 * q, ll % 2 == 1),
                                 0) for h in range(2)]
                d = np.where(live, load_u16(pool_bytes, row + 34 * scale_record(ll)), 0)
                r = np.zeros((WAVE, 4), np.float32)
                for h in range(2):
                    mfma_f32_16x16x16(r, qa[2 * ll + h], q8_codes_f16x4(code[h]), "f16")
                c += from_bits(d, "f16")[:, None] * r
            _store_scores(scores, c, tok, n_tok, gmax)
    return scores


def _v_words(v_bits, rows, tok, n_tok, n_words, i):
    """pv_mfma's load: token tok's n_words words at byte 4 n_words i of its row (zero past
    n_tok). uint32[64, 4]."""
    words = np.ascontiguousarray(v_bits).view(np.uint32)
    row = rows[np.minimum(tok, n_tok - 1)]
    w = np.zeros((WAVE, 4), np.uint32)
    for x in range(n_words):
        w[:, x] = np.where(tok < n_tok, words[row, n_words * i + x], 0)
    return w


def pv_mfma(probs, v_bits, rows, n_tok, head_dim, gmax, wave, n_waves, kind="f16",
            rest_lane=8, dim_of=lambda dpl, q, r, j: dpl * (4 * q + r) + j):
    """pv_mfma<KIND, GMAX> of one wavefront and the partition's store of its o: this wave's
    wsum float32[gmax, head_dim] (NaN where nothing is stored). ``probs``: float32[n_tok,
    gmax]. ``rest_lane`` and ``dim_of`` are the kernel's (the mutation test changes them)."""
    lane, i, q = _wave()
    n_words = head_dim // 32
    o = np.zeros((8, WAVE, 4), np.float32)
    head = i % 8
    rest, live = i >= 8, head < gmax

    def p_bits(tok):
        ok = live & (tok < n_tok)
        p = np.where(ok, probs[np.minimum(tok, n_tok - 1), np.minimum(head, gmax - 1)], 0)
        hi = to_bits(p.astype(np.float32), kind)
        return np.where(rest, to_bits(p - from_bits(hi, kind), kind), hi)

    for st in range(wave, -(-n_tok // 16), n_waves):
        tok = 16 * st + 4 * q
        cur = [_v_words(v_bits, rows, tok + e, n_tok, n_words, i) for e in range(4)]
        b = np.stack([_pack(p_bits(tok), p_bits(tok + 1)),
                      _pack(p_bits(tok + 2), p_bits(tok + 3))], axis=1)
        for j in range(2 * n_words):
            w0, w1, w2, w3 = (cur[e][:, j // 2] for e in range(4))
            a = np.stack([pair_halves(w0, w1, j % 2), pair_halves(w2, w3, j % 2)], axis=1)
            mfma_f32_16x16x16(o[j], a.astype(np.uint32), b, kind)
    o = o + o[:, lane ^ rest_lane]  # pkv_shfl_xor(o[j][r], 8)
    return store_wsum(o, i, q, gmax, head_dim, dim_of)


def store_wsum(o, i, half, gmax, head_dim, dim_of):
    """The partition's store of a pass 2's o[m-tile, lane, register] (after the remainder
    lanes were added): lane with i < gmax holds head i, register r of m-tile j is dim
    ``dim_of(dpl, half, r, j)`` (half: the lane's q on MFMA, hw on WMMA). float32[gmax,
    head_dim], NaN where nothing is stored; every slot must be stored exactly once."""
    wsum = np.full((gmax, head_dim), np.nan, np.float32)
    seen = np.zeros((gmax, head_dim), int)
    dpl = head_dim // 16
    for ln in range(o.shape[1]):
        if i[ln] < gmax:
            for j in range(dpl):
                for r in range(o.shape[2]):
                    d = dim_of(dpl, half[ln], r, j)
                    wsum[i[ln], d] = o[j, ln, r]
                    seen[i[ln], d] += 1
    assert (seen == 1).all()  # every (head slot, dim) stored once
    return wsum


def partition_mfma(q_group, group, head_dim, scale, k_bits, v_bits, rows, gmax, n_waves,
                   kind="f16", **mutation):
    """paged_attention_partition<KIND, GMAX, false, true>: (pmax, psum, wsum) as the partition
    kernel leaves them for the reduce (its softmax in f32, the waves' wsum added)."""
    n_tok = len(rows)
    s = qk_scores_mfma(q_group, group, head_dim, scale, k_bits, rows, n_tok, gmax, n_waves,
                       kind).reshape(n_tok, gmax)
    assert not np.isnan(s).any()
    pmax = s.max(axis=0)
    p = np.exp(s - pmax).astype(np.float32)
    psum = p.sum(axis=0, dtype=np.float32)
    waves = [pv_mfma(p, v_bits, rows, n_tok, head_dim, gmax, w, n_waves, kind, **mutation)
             for w in range(n_waves)]
    return pmax, psum, np.sum(waves, axis=0, dtype=np.float32)


def attention_mfma(q_group, k_bits, v_bits, rows, scale, partition, kind="f16", n_waves=2,
                   **mutation):
    """One KV head's group over a sequence: partitions of ``partition`` tokens, combined as
    pkv_paged_attention_reduce does. float32[group, head_dim]."""
    group, head_dim = q_group.shape
    gmax = 1 << (group - 1).bit_length()
    parts = [partition_mfma(q_group, group, head_dim, scale, k_bits, v_bits,
                            rows[start:start + partition], gmax, n_waves, kind, **mutation)
             for start in range(0, len(rows), partition)]
    return np.stack([combine_partitions(parts, g) for g in range(group)])


def q8_pv_scale(pool_bytes, rows, row_bytes, head_dim):
    """q8_pv_pscale and q8_pv_unscale of q8_pv_exponent over the partition's V rows: powers
    of two from the largest |d| (its f32 exponent e, at least 103), 2^(141 - e) and
    2^(e - 141)."""
    d = np.stack([load_u16(pool_bytes, rows.astype(np.int64) * row_bytes + 34 * ll)
                  for ll in range(head_dim // 32)])
    vm = np.abs(from_bits(d, "f16")).max(initial=np.float32(0))
    e = max(int(np.float32(vm).view(np.uint32) >> 23) & 0xFF, 103)
    return (np.uint32((268 - e) << 23).view(np.float32),
            np.uint32((e - 14) << 23).view(np.float32))


def pv_mfma_q8(probs, pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, wave, n_waves,
               pscale, unscale, rest_lane=8, scale_record=lambda ll: ll,
               dim_of=lambda q, r, j: 32 * (j // 2) + 2 * (4 * q + r) + j % 2):
    """pv_mfma_q8<GMAX> of one wavefront, times unscale, and the partition's store of its o:
    this wave's wsum float32[gmax, head_dim]. ``rest_lane``, ``scale_record`` and ``dim_of``
    are the kernel's (the mutation test changes them)."""
    lane, i, q = _wave()
    n_rec = head_dim // 32
    o = np.zeros((8, WAVE, 4), np.float32)
    head = i % 8
    rest, live = i >= 8, head < gmax

    def pd_bits(p, d):  # p d pscale as f16, or its remainder on lanes i >= 8
        x = (p * (from_bits(d, "f16") * np.float32(pscale))).astype(np.float32)
        hi = to_bits(x, "f16")
        return np.where(rest, to_bits(x - from_bits(hi, "f16"), "f16"), hi)

    for st in range(wave, -(-n_tok // 16), n_waves):
        code, d, p = [], [], []
        for e in range(4):
            tok = 16 * st + 4 * q + e
            ok = tok < n_tok
            row = rows[np.minimum(tok, n_tok - 1)].astype(np.int64) * row_bytes
            code.append([np.where(ok, load_u16(pool_bytes, row + 34 * ll + 2 + 2 * i), 0)
                         for ll in range(n_rec)])
            d.append([np.where(ok, load_u16(pool_bytes, row + 34 * scale_record(ll)), 0)
                      for ll in range(n_rec)])
            p.append(np.where(live & ok, probs[np.minimum(tok, n_tok - 1),
                                               np.minimum(head, gmax - 1)], 0).astype(np.float32))
        for ll in range(n_rec):
            b = np.stack([_pack(pd_bits(p[0], d[0][ll]), pd_bits(p[1], d[1][ll])),
                          _pack(pd_bits(p[2], d[2][ll]), pd_bits(p[3], d[3][ll]))], axis=1)
            c0, c1, c2, c3 = (code[e][ll].astype(np.uint32) for e in range(4))
            lo = (c0 & 0xFF) | (c1 & 0xFF) << 8 | (c2 & 0xFF) << 16 | (c3 << 24 & 0xFFFFFFFF)
            hi = c0 >> 8 | (c1 & 0xFF00) | (c2 >> 8) << 16 | (c3 & 0xFF00) << 16
            mfma_f32_16x16x16(o[2 * ll], q8_codes_f16x4(lo.astype(np.uint32)), b, "f16")
            mfma_f32_16x16x16(o[2 * ll + 1], q8_codes_f16x4(hi.astype(np.uint32)), b, "f16")
    o = (o + o[:, lane ^ rest_lane]) * np.float32(unscale)  # the shuffle, then the caller's scale
    wsum = np.full((gmax, head_dim), np.nan, np.float32)
    seen = np.zeros((gmax, head_dim), int)
    for ln in range(WAVE):
        if i[ln] < gmax:
            for j in range(head_dim // 16):
                for r in range(4):
                    dim = dim_of(q[ln], r, j)
                    wsum[i[ln], dim] = o[j, ln, r]
                    seen[i[ln], dim] += 1
    assert (seen == 1).all()  # every (head slot, dim) stored once
    return wsum


def attention_mfma_q8(q_group, k_records, v_records, rows, scale, partition, n_waves=2,
                      qk_scores=None, pv=None, **mutation):
    """attention_mfma over q8 K and V pools (records [rows, row_bytes]): both passes on
    MFMA, pkv_paged_attention_q8mfma_g*, or on the passes given (``qk_scores``, ``pv``: the
    WMMA emulation's). float32[group, head_dim]."""
    qk_scores = qk_scores or qk_scores_mfma_q8
    pv = pv or pv_mfma_q8
    group, head_dim = q_group.shape
    gmax = 1 << (group - 1).bit_length()
    row_bytes = v_records.shape[1]
    k_pool, v_pool = k_records.reshape(-1), v_records.reshape(-1)
    parts = []
    for start in range(0, len(rows), partition):
        prow = rows[start:start + partition]
        n_tok = len(prow)
        s = qk_scores(q_group, group, head_dim, scale, k_pool, prow, row_bytes, n_tok,
                      gmax, n_waves).reshape(n_tok, gmax)
        pmax = s.max(axis=0)
        p = np.exp(s - pmax).astype(np.float32)
        pscale, unscale = q8_pv_scale(v_pool, prow, row_bytes, head_dim)
        waves = [pv(p, v_pool, prow, row_bytes, n_tok, head_dim, gmax, w, n_waves,
                    pscale, unscale, **mutation) for w in range(n_waves)]
        parts.append((pmax, p.sum(axis=0, dtype=np.float32),
                      np.sum(waves, axis=0, dtype=np.float32)))
    return np.stack([combine_partitions(parts, g) for g in range(group)])


def _bits_of(x, kind):
    return to_bits(np.asarray(x, np.float32), kind).astype(np.uint16)


def _case(seed, group, head_dim, n_tok, kind):
    rng = np.random.default_rng(seed)
    q_group = (rng.standard_normal((group, head_dim)) * 3).astype(np.float32)
    k_bits = _bits_of(rng.standard_normal((n_tok + 11, head_dim)), kind)
    v_bits = _bits_of(rng.standard_normal((n_tok + 11, head_dim)) * 0.01, kind)
    rows = rng.permutation(n_tok + 11)[:n_tok]  # the partition's token -> pool row table
    return q_group, k_bits, v_bits, rows


def _reference(q_group, k_bits, v_bits, rows, scale, kind):
    k = from_bits(k_bits[rows], kind).astype(np.float64)
    v = from_bits(v_bits[rows], kind).astype(np.float64)
    s = q_group.astype(np.float64) @ k.T * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v, np.abs(v).max()


KINDS = ["f16", "bf16"]


def check_scores(qk_scores, kind, head_dim, group, gmax, n_tok, waves):
    """A pass 1 emulation (``qk_scores(q_group, group, head_dim, scale, k_bits, rows, n_tok,
    gmax, waves, kind)``, MFMA or WMMA) gives q.k for every token and head."""
    q_group, k_bits, _, rows = _case(head_dim + 7 * group + n_tok, group, head_dim, n_tok, kind)
    scale = head_dim ** -0.5
    got = qk_scores(q_group, group, head_dim, scale, k_bits, rows, n_tok, gmax, waves,
                    kind).reshape(n_tok, gmax)
    qs = q_group.astype(np.float64) * np.float32(scale)
    kt = from_bits(k_bits[rows], kind).astype(np.float64)
    expect = kt @ qs.T  # [n_tok, group]
    # q as value + remainder: f16 22 bits, bf16 16; f32 sums
    bound = (2.0**-20 if kind == "f16" else 2.0**-15) * (np.abs(kt) @ np.abs(qs).T)
    np.testing.assert_array_less(np.abs(got[:, :group] - expect), bound)
    assert (got[:, group:] == 0).all()  # group slots past the group hold zeros, as on NVIDIA


def check_pv(pv, kind, head_dim, gmax, n_tok, waves):
    """A pass 2 emulation (``pv(probs, v_bits, rows, n_tok, head_dim, gmax, wave, waves,
    kind)`` of one wave, MFMA or WMMA) gives p.V for every dim and head."""
    rng = np.random.default_rng(head_dim + gmax + n_tok)
    _, _, v_bits, rows = _case(n_tok + gmax, 1, head_dim, n_tok, kind)
    probs = rng.random((n_tok, gmax)).astype(np.float32)  # a softmax's unnormalized p <= 1
    got = sum(pv(probs, v_bits, rows, n_tok, head_dim, gmax, w, waves, kind)
              for w in range(waves))
    v = from_bits(v_bits[rows], kind).astype(np.float64)
    expect = probs.T.astype(np.float64) @ v  # [gmax, head_dim]
    bound = (2.0**-20 if kind == "f16" else 2.0**-15) * (probs.T.astype(np.float64) @ np.abs(v))
    np.testing.assert_array_less(np.abs(got - expect), bound + 1e-30)


def check_attention(attention, kind, head_dim, group, n_tok, partition):
    """A whole emulated attention (``attention(q_group, k_bits, v_bits, rows, scale,
    partition, kind)``) is within docs/kernels.md's "Tolerances": rtol 1e-4, atol 2e-5 in
    units of the V magnitude."""
    q_group, k_bits, v_bits, rows = _case(head_dim * group + n_tok, group, head_dim, n_tok, kind)
    scale = head_dim ** -0.5
    got = attention(q_group, k_bits, v_bits, rows, scale, partition, kind)
    want, v_scale = _reference(q_group, k_bits, v_bits, rows, scale, kind)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


#: Geometries of the three checks, shared by the MFMA and WMMA emulations.
SCORE_CASES = [(128, 1, 1, 37, 2), (64, 2, 2, 16, 2), (128, 3, 4, 100, 2), (64, 4, 4, 5, 1),
               (128, 8, 8, 77, 2), (64, 5, 8, 33, 1)]
PV_CASES = [(128, 1, 37, 2), (64, 2, 16, 2), (128, 4, 100, 2), (64, 4, 5, 1), (128, 8, 77, 2),
            (64, 8, 33, 1)]
ATTENTION_CASES = [(128, 4, 300, 128), (64, 8, 70, 1024), (128, 1, 40, 16), (64, 3, 200, 64)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group", "gmax", "n_tok", "waves"), SCORE_CASES)
def test_mfma_scores_simulated_are_q_dot_k_for_every_token_and_head(kind, head_dim, group, gmax,
                                                                      n_tok, waves):
    check_scores(qk_scores_mfma, kind, head_dim, group, gmax, n_tok, waves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "gmax", "n_tok", "waves"), PV_CASES)
def test_mfma_pv_simulated_is_p_times_v_for_every_dim_and_head(kind, head_dim, gmax, n_tok,
                                                                 waves):
    check_pv(pv_mfma, kind, head_dim, gmax, n_tok, waves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group", "n_tok", "partition"), ATTENTION_CASES)
def test_mfma_attention_simulated_is_within_the_documented_tolerance(kind, head_dim, group,
                                                                       n_tok, partition):
    check_attention(attention_mfma, kind, head_dim, group, n_tok, partition)


@pytest.mark.parametrize("mutation", [
    {"rest_lane": 16},  # the remainder column from the wrong lane
    {"dim_of": lambda dpl, q, r, j: dpl * (4 * q + r) + (j ^ 1)},  # halves of a word swapped
    {"dim_of": lambda dpl, q, r, j: 4 * (dpl * q + j) + r}])  # D rows read as dims
def test_a_wrong_pass_2_lane_mapping_fails_the_tolerance(mutation):
    q_group, k_bits, v_bits, rows = _case(5, 4, 128, 150, "f16")
    got = attention_mfma(q_group, k_bits, v_bits, rows, 128 ** -0.5, 1024, **mutation)
    want, v_scale = _reference(q_group, k_bits, v_bits, rows, 128 ** -0.5, "f16")
    assert not np.allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


def _q8_case(seed, group, head_dim, n_tok):
    rng = np.random.default_rng(seed)
    q_group = (rng.standard_normal((group, head_dim)) * 3).astype(np.float32)
    k = rng.standard_normal((n_tok + 7, head_dim)).astype(np.float32)
    k *= np.float32(10.0) ** rng.integers(-3, 2, (n_tok + 7, 1))  # scales far apart
    records = kv_q8.quantize(k)
    rows = rng.permutation(n_tok + 7)[:n_tok]
    kt = kv_q8.dequantize(records, head_dim)[rows].astype(np.float64)  # d * c, exact
    return q_group, records, rows, kt


@pytest.mark.parametrize(("head_dim", "group", "gmax", "n_tok", "waves"), [
    (128, 1, 1, 37, 2), (64, 2, 2, 16, 2), (128, 3, 4, 100, 2), (64, 4, 4, 5, 1),
    (128, 8, 8, 77, 2), (64, 5, 8, 33, 1)])
def test_q8_mfma_scores_simulated_are_q_dot_k_for_every_token_and_head(head_dim, group, gmax,
                                                                         n_tok, waves):
    q_group, records, rows, kt = _q8_case(head_dim + group + n_tok, group, head_dim, n_tok)
    scale = head_dim ** -0.5
    got = qk_scores_mfma_q8(q_group, group, head_dim, scale, records.reshape(-1), rows,
                            records.shape[1], n_tok, gmax, waves).reshape(n_tok, gmax)
    qs = q_group.astype(np.float64) * np.float32(scale)
    bound = 2.0**-20 * (np.abs(kt) @ np.abs(qs).T)  # 22-bit q, exact codes, f32 sums
    np.testing.assert_array_less(np.abs(got[:, :group] - kt @ qs.T), bound)
    assert (got[:, group:] == 0).all()


def _q8_v_case(seed, head_dim, n_tok):
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n_tok + 5, head_dim)).astype(np.float32)
    v *= np.float32(10.0) ** rng.integers(-4, 2, (n_tok + 5, 1))  # scales far apart
    records = kv_q8.quantize(v)
    rows = rng.permutation(n_tok + 5)[:n_tok]
    return records, rows, kv_q8.dequantize(records, head_dim)[rows].astype(np.float64)


@pytest.mark.parametrize(("head_dim", "gmax", "n_tok", "waves"), [
    (128, 1, 37, 2), (64, 2, 16, 2), (128, 4, 100, 2), (64, 4, 5, 1), (128, 8, 77, 2),
    (64, 8, 33, 1)])
def test_q8_mfma_pv_simulated_is_p_times_v_for_every_dim_and_head(head_dim, gmax, n_tok, waves):
    records, rows, v = _q8_v_case(head_dim + gmax + n_tok, head_dim, n_tok)
    probs = np.random.default_rng(n_tok).random((n_tok, gmax)).astype(np.float32)
    pool, row_bytes = records.reshape(-1), records.shape[1]
    pscale, unscale = q8_pv_scale(pool, rows, row_bytes, head_dim)
    got = sum(pv_mfma_q8(probs, pool, rows, row_bytes, n_tok, head_dim, gmax, w, waves,
                         pscale, unscale) for w in range(waves))
    expect = probs.T.astype(np.float64) @ v  # V = d c exactly
    # p d as 22 bits (f16 value + remainder; the remainder may be subnormal: 2^-25 of the
    # scaled unit absolute), exact codes, f32 sums
    bound = 2.0**-20 * (probs.T.astype(np.float64) @ np.abs(v)) + 2.0**-24 * unscale * 128 * n_tok
    np.testing.assert_array_less(np.abs(got - expect), bound)


@pytest.mark.parametrize(("head_dim", "group", "n_tok", "partition"), [
    (128, 4, 300, 128), (64, 8, 70, 1024), (128, 1, 40, 16), (64, 3, 200, 64)])
def test_q8_mfma_attention_simulated_is_within_the_documented_tolerance(head_dim, group, n_tok,
                                                                          partition):
    # both q8 passes on MFMA against float64 attention over the dequantized K and V
    q_group, k_records, rows, kt = _q8_case(head_dim * group + n_tok, group, head_dim, n_tok)
    v_records, _, _ = _q8_v_case(n_tok, head_dim, len(k_records) - 5)  # as many pool rows
    vt = kv_q8.dequantize(v_records, head_dim)[rows].astype(np.float64)
    scale = head_dim ** -0.5
    got = attention_mfma_q8(q_group, k_records, v_records, rows, scale, partition)
    s = q_group.astype(np.float64) @ kt.T * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ vt
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(vt).max())


@pytest.mark.parametrize("mutation", [
    {"rest_lane": 16},  # the remainder column from the wrong lane
    {"scale_record": lambda ll: ll ^ 1},  # another record's scale
    {"dim_of": lambda q, r, j: 32 * (j // 2) + 2 * (4 * q + r) + (j % 2 ^ 1)},  # bytes swapped
    {"dim_of": lambda q, r, j: 16 * (j % 2) + 32 * (j // 2) + 4 * q + r}])  # pv_mma-like rows
def test_a_wrong_q8_pass_2_mapping_fails_the_tolerance(mutation):
    q_group, k_records, rows, kt = _q8_case(21, 4, 128, 150)
    v_records, _, _ = _q8_v_case(22, 128, len(k_records) - 5)  # as many pool rows as K's
    vt = kv_q8.dequantize(v_records, 128)[rows].astype(np.float64)
    s = q_group.astype(np.float64) @ kt.T * 128 ** -0.5
    p = np.exp(s - s.max(axis=1, keepdims=True))
    want = (p / p.sum(axis=1, keepdims=True)) @ vt
    got = attention_mfma_q8(q_group, k_records, v_records, rows, 128 ** -0.5, 1024, **mutation)
    assert not np.allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(vt).max())


def test_q8_codes_become_f16_exactly():
    w = np.arange(256, dtype=np.uint32)
    words = w | (w ^ 0x55) << 8 | (255 - w) << 16 | (w ^ 0xAA) << 24
    for start in range(0, 256, WAVE):
        ws = words[start:start + WAVE]
        got = _elements(q8_codes_f16x4(ws), "f16")
        want = ws.view(np.uint8).reshape(-1, 4).view(np.int8).astype(np.float64)
        np.testing.assert_array_equal(got, want)


def test_a_wrong_q8_record_scale_fails_the_bound():
    q_group, records, rows, kt = _q8_case(9, 4, 128, 60)
    got = qk_scores_mfma_q8(q_group, 4, 128, 0.125, records.reshape(-1), rows, records.shape[1],
                            60, 4, 2, scale_record=lambda l: l ^ 1).reshape(60, 4)
    qs = q_group.astype(np.float64) * np.float32(0.125)
    bound = 2.0**-20 * (np.abs(kt) @ np.abs(qs).T)
    assert (np.abs(got - kt @ qs.T) > bound).any()


def test_a_dropped_remainder_row_or_a_wrong_chunk_fails_the_bound():
    # the bound is tight enough to see the f16 rounding of q (2^-11) and any misplaced dim
    rng = np.random.default_rng(3)
    q_group = rng.standard_normal((4, 128)).astype(np.float32)
    k_bits = _bits_of(rng.standard_normal((40, 128)), "f16")
    k = from_bits(k_bits, "f16").astype(np.float64)
    rows = np.arange(40)
    exact = k @ (q_group.astype(np.float64) * np.float32(0.125)).T
    bound = 2.0**-20 * (np.abs(k) @ np.abs(q_group * 0.125).T)
    hi_only = k @ (q_group * np.float32(0.125)).astype(np.float16).astype(np.float64).T
    assert (np.abs(hi_only - exact) > bound).any()
    shifted = np.roll(k, 8, axis=1) @ (q_group * 0.125).T
    assert (np.abs(shifted - exact) > bound).all()
    got = qk_scores_mfma(q_group, 4, 128, 0.125, k_bits, rows, 40, 4, 2).reshape(40, 4)
    np.testing.assert_array_less(np.abs(got - exact), bound)


def test_the_bf16_rounding_is_round_to_nearest_even():
    # to_mfma_bits<KV_BF16>'s integer rounding against the two neighbouring bf16 values
    rng = np.random.default_rng(11)
    x = np.concatenate([rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(
        -30, 30, 20000), np.float32([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 0.0, -0.0])])
    x = x.astype(np.float32)
    got = from_bits(to_bits(x, "bf16"), "bf16").astype(np.float64)
    down = ((x.view(np.uint32) >> 16) << 16).view(np.float32).astype(np.float64)
    up = (((x.view(np.uint32) >> 16) + 1) << 16).astype(np.uint32).view(np.float32)
    err = np.abs(got - x.astype(np.float64))
    assert (err <= np.minimum(np.abs(down - x), np.abs(up.astype(np.float64) - x))).all()
    # ties go to the even mantissa: 1 + 2^-8 -> 1, 1 + 3 * 2^-8 -> 1 + 2^-6
    assert got[-5:-2].tolist() == [1.0, 1 + 2**-6, -1.0]


@pytest.mark.parametrize("kind", KINDS)
def test_the_mfma_model_matches_the_documented_layout(kind):
    # Entries of the calculator's tables (CDNA2/CDNA3 v_mfma_f32_16x16x16f16 and
    # v_mfma_f32_16x16x16bf16_1k): a one-hot A or B element lands where the table says.
    one = int(to_bits(np.float32(1.0), kind))

    def product(a_lane, a_el, b_lane, b_el):
        a, b = np.zeros((WAVE, 2), np.uint32), np.zeros((WAVE, 2), np.uint32)
        a[a_lane, a_el // 2] = one << (16 * (a_el % 2))
        b[b_lane, b_el // 2] = one << (16 * (b_el % 2))
        c = np.zeros((WAVE, 4), np.float32)
        mfma_f32_16x16x16(c, a, b, kind)
        return {(int(lane), int(r)) for lane, r in zip(*np.nonzero(c))}
    # lane 17 element 2 is A[1][6]; lane 18 element 2 is B[6][2]: D[1][2] is lane 2, v1
    assert product(17, 2, 18, 2) == {(2, 1)}
    assert product(17, 2, 18, 3) == set()  # B[7][2]: another k
    # lane 63 element 3 is A[15][15]; lane 48 element 3 is B[15][0]: D[15][0] is lane 48, v3
    assert product(63, 3, 48, 3) == {(48, 3)}


#: The kernel text each emulated index expression copies (hip/kvcache.hip): a change on
#: either side breaks this list, so the emulation and the kernel cannot drift apart.
KERNEL_TEXT = {
    "q_fragments_mfma": [
        "const int i = lane % 16, q = lane / 16, head = i % 8;",
        "32 * (s / 2) + 8 * q + 4 * (s % 2);",
        "bits[e] = i < 8 ? hi : to_mfma_bits<KIND>(v - from_mma_bits<KIND>(hi));",
        "qa[s] = pkv_u32x2{bits[0] | bits[1] << 16, bits[2] | bits[3] << 16};",
    ],
    "qk_scores_mfma": [
        "const int tok = 16 * grp + i;",
        "row[4 * l + q]",
        "s % 2 ? pkv_u32x2{k.z, k.w} : pkv_u32x2{k.x, k.y}",
        "const float rest = pkv_shfl_xor(c[r], 32);",
        "if (q < 2 && g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + rest;",
    ],
    "pv_mfma": [
        "const int i = lane % 16, q = lane / 16;",
        "const int n_words = head_dim / 32;",
        "const int tok = 16 * st + 4 * q + e;",
        "rows[min(tok, n_tok - 1)] * row_bytes + 4 * n_words * i;",
        "const int head = i % 8;",
        "const bool rest = i >= 8, live = head < GMAX;",
        "return rest ? to_mfma_bits<KIND>(p - from_mma_bits<KIND>(hi)) : hi;",
        "const pkv_u32x2 b = {p_bits(tok) | p_bits(tok + 1) << 16,",
        "p_bits(tok + 2) | p_bits(tok + 3) << 16};",
        "const uint32_t w0 = cur[0][j / 2], w1 = cur[1][j / 2];",
        "const pkv_u32x2 a = {pair_halves(w0, w1, j % 2), pair_halves(w2, w3, j % 2)};",
        "for (int r = 0; r < 4; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);",
    ],
    "pair_halves": [
        "return upper ? (t0 >> 16 | (t1 & 0xFFFF0000u)) : ((t0 & 0xFFFFu) | t1 << 16);"],
    "qk_scores_mfma_q8": [
        "const int tok = 16 * grp + i;",
        "const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;",
        "kr.d[l] = *(const uint16_t*)rec;",
        "l % 2 ? load_word_a2<true>(rec + 2 + 8 * q) : load_word_a2<false>(rec + 2 + 8 * q);",
        "l % 2 ? load_word_a2<true>(rec + 6 + 8 * q) : load_word_a2<false>(rec + 6 + 8 * q);",
        "r = mfma_16x16x16<KV_F16>(qa[2 * l], q8_codes_f16x4(cur.code[l][0]), r);",
        "r = mfma_16x16x16<KV_F16>(qa[2 * l + 1], q8_codes_f16x4(cur.code[l][1]), r);",
        "c += pkv_half_bits_to_float((uint16_t)cur.d[l]) * r;",
        "const float rest = pkv_shfl_xor(c[r], 32);",
        "if (q < 2 && g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + rest;",
    ],
    "pv_mfma_q8": [
        "const int i = lane % 16, q = lane / 16;",
        "const int tok = 16 * st + 4 * q + e;",
        "const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;",
        "vr.d[e][l] = *(const uint16_t*)rec;",
        "vr.code[e][l] = *(const uint16_t*)(rec + 2 + 2 * i);",
        "const int head = i % 8;",
        "const bool rest = i >= 8, live = head < GMAX;",
        "const float x = p * (pkv_half_bits_to_float((uint16_t)d) * pscale);",
        "return rest ? to_mfma_bits<KV_F16>(x - from_mma_bits<KV_F16>(hi)) : hi;",
        "p[e] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;",
        "const pkv_u32x2 b = {pd_bits(p[0], cur.d[0][l]) | pd_bits(p[1], cur.d[1][l]) << 16,",
        "pd_bits(p[2], cur.d[2][l]) | pd_bits(p[3], cur.d[3][l]) << 16};",
        "const uint32_t lo = (c0 & 0xFFu) | (c1 & 0xFFu) << 8 | (c2 & 0xFFu) << 16 | c3 << 24;",
        "const uint32_t hi = c0 >> 8 | (c1 & 0xFF00u) | (c2 >> 8) << 16 | (c3 & 0xFF00u) << 16;",
        "o[2 * l] = mfma_16x16x16<KV_F16>(q8_codes_f16x4(lo), b, o[2 * l]);",
        "o[2 * l + 1] = mfma_16x16x16<KV_F16>(q8_codes_f16x4(hi), b, o[2 * l + 1]);",
        "for (int r = 0; r < 4; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);",
    ],
    "q8_pv_exponent": ["return max((int)((__float_as_uint(vm) >> 23) & 0xFF), 103);"],
    "q8_pv_pscale": ["return __uint_as_float((uint32_t)(268 - e) << 23);"],
    "q8_pv_unscale": ["return __uint_as_float((uint32_t)(e - 14) << 23);"],
    "q8_codes_f16x4": [
        "const uint32_t x = w ^ 0x80808080u;",
        "const uint32_t b01 = (x & 0xFFu) | (x & 0xFF00u) << 8 | 0x64006400u;",
        "const uint32_t b23 = (x >> 16 & 0xFFu) | (x >> 8 & 0xFF0000u) | 0x64006400u;",
        "const pkv_f16x2 bias = {(_Float16)1152.0f, (_Float16)1152.0f};",
    ],
    "to_mfma_bits": ["return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;"],
    "mfma_16x16x16": ["__builtin_amdgcn_mfma_f32_16x16x16bf16_1k(",
                      "__builtin_amdgcn_mfma_f32_16x16x16f16("],
    "paged_attention_partition": [
        "const int i = lane % 16, q = lane / 16, dpl = head_dim / 16;",
        "if (i < GMAX) {",
        "const int d = KIND == KV_Q8 ? 32 * (j / 2) + 2 * (4 * q + r) + j % 2",
        ": dpl * (4 * q + r) + j;",
        "wsum[(warp * GMAX + i) * head_dim + d] = o[j][r];",
        "for (int j = 0; j < 8; ++j) o[j] *= unscale;",
    ],
}


def _function_text(text, name):
    """The body of device function ``name`` in kvcache.hip: from its definition to the next
    top-level closing brace."""
    m = re.search(r"^PKV_DEV [^\n]*\b" + name + r"\(", text, re.MULTILINE)
    assert m, name
    end = text.index("\n}\n", m.start())
    return " ".join(text[m.start():end].split())


def assert_kernel_text(table, function):
    """Every expression ``table[function]`` lists is in that function of hip/kvcache.hip."""
    body = _function_text(KVCACHE_HIP.read_text(encoding="utf-8"), function)
    missing = [e for e in table[function] if " ".join(e.split()) not in body]
    assert not missing, f"{function} in hip/kvcache.hip no longer has {missing}: update the emulation"


@pytest.mark.parametrize("function", sorted(KERNEL_TEXT))
def test_the_emulated_expressions_are_the_kernel_text(function):
    assert_kernel_text(KERNEL_TEXT, function)


def test_the_mfma_kernels_are_defined_for_each_kind_and_bf16_only_with_k16_bf16_mfma():
    text = KVCACHE_HIP.read_text(encoding="utf-8")
    for g in (1, 2, 4, 8):
        assert f"PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_f16mfma_g{g}, KV_F16, {g})" in text
        assert f"PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_q8mfma_g{g}, KV_Q8, {g})" in text
        assert f"PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g{g}, KV_BF16, {g})" in text
    bf16 = text.index("PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_bf16mfma_g1")
    assert text.rindex("#if defined(PKV_MFMA_BF16_1K)", 0, bf16) > text.rindex("#endif", 0, bf16)

"""Compressed-KV attention on AMD matrix cores (hip/kvcache.hip, ``qk_scores_mfma_codes`` /
``pv_mfma_codes`` on CDNA and ``qk_scores_wmma_codes`` / ``pv_wmma_codes`` on gfx11, run by
the compressed pairs' ``_mma`` kernels there) simulated in NumPy, lane by lane: the code-byte
tables and the hi + remainder splits of the NVIDIA passes (tests/mma_codes_emulation.py) in
the f16 AMD passes' register layouts (the MFMA and WMMA models of
tests/test_attention_mfma_simulated.py and tests/test_attention_wmma_simulated.py), the same
loads at the same byte offsets (alignment asserted), the score stores and the output stores.
No AMD GPU is available: this and the compilers (hipcc for gfx90a/gfx940,
hip/gfx11_codegen.py for gfx1100) are all the checking the path has (docs/kernels.md, "AMD
matrix cores"); it runs only when asked (``PAGEDKV_ATTN_MFMA=1`` / ``PAGEDKV_ATTN_WMMA=1``)."""

from __future__ import annotations

import numpy as np
import pytest

import mma_codes_emulation as codes
from mma_attention_emulation import f16_bits, f16_value, load_u16
from pagedkv.kernels import kvcache, numpy_kernels
from pagedkv.quant import kv as kv_modes
from pagedkv.quant import kv_rotated
from test_attention_mfma_simulated import (
    KVCACHE_HIP,
    _function_text,
    assert_kernel_text,
    mfma_f32_16x16x16,
    pair_halves,
    q_fragments_mfma,
    store_wsum,
)
from test_attention_wmma_simulated import q_fragments_wmma, wmma_f32_16x16x16

INV_SCALE = np.float32(1.0) / codes.CODE_TABLE_SCALE


def _lanes(wave):
    lane = np.arange(wave)
    return lane, lane % 16, lane // 16  # lane, i, q (MFMA) or hw (WMMA)


def code_quad_word(pool, row, code0, ll, t, bits):
    """code_quad_word<BITS>: the codes of dims 32 l + 8 t .. + 7 of the half."""
    return (codes.load_u32(pool, row + code0 + 16 * ll + 4 * t) if bits == 4
            else load_u16(pool, row + code0 + 8 * ll + 2 * t))


def code_step_pairs(tab, w, s, bits):
    """code_step_pairs<BITS>: (hi, lo) pairs of pass-1 k-step s from its code word."""
    w = np.asarray(w, np.uint32)
    if bits == 4:
        h0, l0 = codes.code_byte_pairs(tab, (w >> (16 * (s % 2))) & 0xFF)
        h1, l1 = codes.code_byte_pairs(tab, (w >> (16 * (s % 2) + 8)) & 0xFF)
        return [h0[0], h1[0]], [l0[0], l1[0]]
    return codes.code_byte_pairs(tab, (w >> (8 * (s % 2))) & 0xFF)


def code_lane_word(pool, row, code0, i, bits):
    """code_lane_word<BITS>: lane i's code bytes of dims 8i .. 8i + 7 of the half."""
    return (codes.load_u32(pool, row + code0 + 4 * i) if bits == 4
            else load_u16(pool, row + code0 + 2 * i))


def codes_p_bits(x, rest):
    hi = f16_bits(x)
    return np.where(rest, f16_bits(x - f16_value(hi)), hi).astype(np.uint32)


def _add_scores(scores, sc, idx, ok, half):
    """``half ? scores[idx] + sc : sc`` where ok (f32)."""
    idx = idx[ok]
    scores[idx] = (scores[idx] + sc[ok]).astype(np.float32) if half else sc[ok]


def _rows(rows, tok, n_tok, row_bytes):
    return rows[np.minimum(tok, n_tok - 1)].astype(np.int64) * row_bytes


def _x_of(probs, pool, row, tok, n_tok, head, live, gmax):
    """Pass 2's B value before the split: p_t * cnorm_t of the lane's head (0 past n_tok or
    past GMAX)."""
    ok = live & (tok < n_tok)
    p = np.where(ok, probs[np.where(ok, tok, 0) * gmax + np.where(live, head, 0)], 0)
    return np.where(ok, p.astype(np.float32) * codes.load_f32(pool, row), 0).astype(np.float32)


def _pass1_groups(qs, group, head_dim, bits, rows, row_bytes, n_tok, n_waves, wave_size,
                  fragments, pool):
    """The walk both pass 1s share: per half, its q fragments and first code byte; per
    wave's 16-token group, the lanes' tokens (lane i: token 16 grp + i; past n_tok the last
    token's row), row byte offsets and cnorms."""
    _, i, _ = _lanes(wave_size)
    for half in range(head_dim // 128):
        qa = fragments(qs[:, 128 * half:128 * half + 128], group, 128, 1.0, "f16")
        code0 = codes.CNORM_BYTES + 128 * half * bits // 8
        for wave in range(n_waves):
            for grp in range(wave, -(-n_tok // 16), n_waves):
                tok = 16 * grp + i
                row = _rows(rows, tok, n_tok, row_bytes)
                yield half, qa, code0, tok, row, codes.load_f32(pool, row)


def qk_scores_mfma_codes(qs, group, head_dim, bits, pool, rows, row_bytes, n_tok, gmax, tab,
                         scores, n_waves=2, rest_lane=32):
    """qk_scores_mfma_codes<BITS, GMAX>: fills ``scores[t * gmax + g]``; qs float32[gmax,
    head_dim] (rotated, times scale). ``rest_lane``: the kernel's (a mutation test)."""
    lane, _, q = _lanes(64)
    for half, qa, code0, tok, row, cnorm in _pass1_groups(
            qs, group, head_dim, bits, rows, row_bytes, n_tok, n_waves, 64, q_fragments_mfma,
            pool):
        w = [code_quad_word(pool, row, code0, ll, q, bits) for ll in range(4)]
        c = np.zeros((64, 4), np.float32)
        for s in range(8):
            hi, lo = code_step_pairs(tab, w[s // 2], s, bits)
            for pair in (hi, lo):
                mfma_f32_16x16x16(c, qa[s], np.stack(pair, axis=1).astype(np.uint32), "f16")
        for r in range(4):
            g = 4 * q + r
            sc = (c[:, r] + c[lane ^ rest_lane, r]) * (cnorm * INV_SCALE)
            _add_scores(scores, sc, tok * gmax + g, (q < 2) & (g < gmax) & (tok < n_tok), half)


def _pass2_start(wave_size, regs, half, bits, gmax):
    """What both pass 2s set up: the lanes (lane, i, q or hw), the half's first code byte,
    zeroed o[m-tile, lane, register], and each lane's column: head i % 8, remainder column
    (i >= 8), live (head < GMAX)."""
    lanes = _lanes(wave_size)
    head = lanes[1] % 8
    return (lanes, codes.CNORM_BYTES + 128 * half * bits // 8,
            np.zeros((8, wave_size, regs), np.float32), head, lanes[1] >= 8, head < gmax)


def pv_mfma_codes(probs, pool, rows, row_bytes, n_tok, half, bits, gmax, wave, tab, n_waves=2,
                  dim_of=lambda dpl, q, r, j: 8 * (4 * q + r) + j):
    """pv_mfma_codes<BITS, GMAX> of one wavefront and the partition's store of its o:
    ``float32[gmax, 128]`` over the half's dims. ``dim_of``: the store's (a mutation test)."""
    (lane, i, q), code0, o, head, rest, live = _pass2_start(64, 4, half, bits, gmax)
    for st in range(wave, -(-n_tok // 16), n_waves):
        w, pb = [], []
        for e in range(4):
            tok = 16 * st + 4 * q + e
            row = _rows(rows, tok, n_tok, row_bytes)
            w.append(np.asarray(code_lane_word(pool, row, code0, i, bits), np.uint32))
            pb.append(codes_p_bits(_x_of(probs, pool, row, tok, n_tok, head, live, gmax), rest))
        b = np.stack([pb[0] | pb[1] << 16, pb[2] | pb[3] << 16], axis=1).astype(np.uint32)
        for by in range(bits):
            pairs = [codes.code_byte_pairs(tab, (w[e] >> (8 * by)) & 0xFF) for e in range(4)]
            for k in range(4 // bits):
                p = by * (4 // bits) + k
                for up in range(2):
                    for part in range(2):  # hi, then lo
                        reg = [pairs[e][part][k] for e in range(4)]
                        a = np.stack([pair_halves(reg[0], reg[1], up),
                                      pair_halves(reg[2], reg[3], up)], axis=1)
                        mfma_f32_16x16x16(o[2 * p + up], a.astype(np.uint32), b, "f16")
    o = ((o + o[:, lane ^ 8]) * INV_SCALE).astype(np.float32)
    return store_wsum(o, i, q, gmax, 128, dim_of)


def qk_scores_wmma_codes(qs, group, head_dim, bits, pool, rows, row_bytes, n_tok, gmax, tab,
                         scores, n_waves=4):
    """qk_scores_wmma_codes<BITS, GMAX>, as qk_scores_mfma_codes."""
    _, _, hw = _lanes(32)
    for half, qa, code0, tok, row, cnorm in _pass1_groups(
            qs, group, head_dim, bits, rows, row_bytes, n_tok, n_waves, 32, q_fragments_wmma,
            pool):
        w = [np.asarray(codes.load_u32(pool, row + code0 + 4 * x), np.uint32)
             for x in range(4 * bits)]
        c = np.zeros((32, 8), np.float32)
        for s in range(8):
            bh, bl = np.zeros((32, 8), np.uint32), np.zeros((32, 8), np.uint32)
            for by in range(2 * bits):
                x = 2 * bits * s + by
                h, lo = codes.code_byte_pairs(tab, (w[x // 4] >> (8 * (x % 4))) & 0xFF)
                for k in range(4 // bits):
                    bh[:, by * (4 // bits) + k] = h[k]
                    bl[:, by * (4 // bits) + k] = lo[k]
            wmma_f32_16x16x16(c, qa[s], bh, "f16")
            wmma_f32_16x16x16(c, qa[s], bl, "f16")
        for r in range(4):
            g = 2 * r + hw
            sc = (c[:, r] + c[:, r + 4]) * (cnorm * INV_SCALE)
            _add_scores(scores, sc, tok * gmax + g, (g < gmax) & (tok < n_tok), half)


def pv_wmma_codes(probs, pool, rows, row_bytes, n_tok, half, bits, gmax, wave, tab, n_waves=4,
                  dim_of=lambda dpl, hw, r, j: 8 * (2 * r + hw) + j):
    """pv_wmma_codes<BITS, GMAX> of one wave and the partition's store, as pv_mfma_codes."""
    (lane, i, hw), code0, o, head, rest, live = _pass2_start(32, 8, half, bits, gmax)
    for st in range(wave, -(-n_tok // 16), n_waves):
        w, b = [], np.zeros((32, 8), np.uint32)
        for k in range(16):
            tok = 16 * st + k
            row = _rows(rows, np.full(32, tok), n_tok, row_bytes)
            w.append(np.asarray(code_lane_word(pool, row, code0, i, bits), np.uint32))
            bits16 = codes_p_bits(_x_of(probs, pool, row, np.full(32, tok), n_tok, head, live,
                                        gmax), rest)
            b[:, k // 2] |= bits16 << (16 * (k % 2))
        for by in range(bits):
            pairs = [codes.code_byte_pairs(tab, (w[k] >> (8 * by)) & 0xFF) for k in range(16)]
            for k in range(4 // bits):
                p = by * (4 // bits) + k
                for up in range(2):
                    for part in range(2):  # hi, then lo
                        a = np.stack([pair_halves(pairs[2 * x][part][k], pairs[2 * x + 1][part][k],
                                                  up) for x in range(8)], axis=1)
                        wmma_f32_16x16x16(o[2 * p + up], a.astype(np.uint32), b, "f16")
    o = ((o + o[:, lane ^ 8]) * INV_SCALE).astype(np.float32)
    return store_wsum(o, i, hw, gmax, 128, dim_of)


#: (pass 1, pass 2 with its store, the most heads per KV head, waves of a 128-thread CTA)
UNITS = {"mfma": (qk_scores_mfma_codes, pv_mfma_codes, 8, 2),
         "wmma": (qk_scores_wmma_codes, pv_wmma_codes, 8, 4)}


def _pool_case(kv_dtype, seq_lens, kv_heads, head_dim, block_size, v_scale, seed):
    rng = np.random.default_rng(seed)
    width = max(1, max(-(-n // block_size) for n in seq_lens))
    num_blocks = len(seq_lens) * width + 3
    pools = []
    for side, scale in zip(kv_modes.split_kv_dtype(kv_dtype), (1.0, v_scale), strict=True):
        vals = rng.standard_normal((num_blocks, block_size, kv_heads, head_dim)) * scale
        pools.append(numpy_kernels.kv_rotated_quantize(vals.astype(np.float32), side))
    perm = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), width), -1, np.int32)
    for s, n in enumerate(seq_lens):
        nb = -(-n // block_size)
        tables[s, :nb] = perm[s * width:s * width + nb]
    return pools[0], pools[1], tables, np.asarray(seq_lens, np.int32), rng


@pytest.mark.parametrize("unit", sorted(UNITS))
@pytest.mark.parametrize("kv_dtype,heads,kv_heads,head_dim,block_size,seq_lens,v_scale", [
    ("fwht4/lloyd4", 8, 1, 256, 16, [530, 3], 1.0),   # g8; two partitions; 2 halves
    ("fwht4/fwht4", 3, 1, 128, 5, [40, 1], 1.0),      # group 3 in a g4 kernel, one token
    ("fwht2/fwht2", 2, 2, 128, 8, [70, 0], 300.0),    # g1, large V norms, an empty sequence
    ("fwht4/fwht2", 8, 2, 128, 16, [33], 1e-3),       # g4, small V norms
    ("fwht2/lloyd2", 16, 2, 256, 4, [45], 1.0),       # g8, 2-bit K and V at head_dim 256
    ("lloyd4/fwht4", 2, 1, 256, 8, [20], 1.0),        # R256 K with an R128 V
    ("lloyd2/lloyd4", 5, 1, 256, 16, [77], 1.0),      # group 5 in a g8 kernel
])
def test_amd_code_passes_simulated_are_within_the_attention_tolerance(
        unit, kv_dtype, heads, kv_heads, head_dim, block_size, seq_lens, v_scale):
    k_pool, v_pool, tables, lens, rng = _pool_case(kv_dtype, seq_lens, kv_heads, head_dim,
                                                   block_size, v_scale, heads * head_dim)
    q = rng.standard_normal((len(seq_lens), heads, head_dim)).astype(np.float32)
    got = codes.paged_attention_codes_mma(q, k_pool, v_pool, tables, lens, kv_dtype=kv_dtype,
                                          scale=head_dim ** -0.5,
                                          partition=kvcache.ATTN_PARTITION_TOKENS[kv_dtype],
                                          passes=UNITS[unit], nibbles=unit != "wmma")
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                                kv_dtype=kv_dtype, scale=head_dim ** -0.5)
    # docs/kernels.md, "Tolerances": rtol 1e-4, atol 2e-5 in units of the V magnitude
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


def _scores_case(k_side, head_dim, group, n_tok, seed):
    """Rotated queries (times scale) and a K pool's flat rows for pass 1 alone; the exact
    q.k of each token and head from the decoded codes (float64)."""
    rng = np.random.default_rng(seed)
    gmax = 1 << (group - 1).bit_length()
    mode = kv_modes.kv_mode(k_side)
    vals = rng.standard_normal((n_tok + 9, 1, 1, head_dim)).astype(np.float32)
    pool = numpy_kernels.kv_rotated_quantize(vals, k_side)
    row_bytes = pool.shape[-1]
    rows = rng.permutation(n_tok + 9)[:n_tok]
    qs = np.zeros((gmax, head_dim), np.float32)
    qs[:group] = rng.standard_normal((group, head_dim)) * 0.2
    flat = pool.reshape(-1)
    cent = kv_rotated.tables(mode.bits, mode.rotation)[0].astype(np.float64)
    per = 8 // mode.bits
    k = np.zeros((n_tok, head_dim))
    for t, r in enumerate(rows):
        rec = flat[r * row_bytes:(r + 1) * row_bytes]
        cnorm = rec[:4].view(np.float32)[0]
        c = np.array([(rec[4 + d // per] >> (mode.bits * (d % per))) & ((1 << mode.bits) - 1)
                      for d in range(head_dim)])
        k[t] = cent[c] * cnorm
    return qs, flat, rows, row_bytes, gmax, mode, k @ qs.astype(np.float64).T


@pytest.mark.parametrize("unit", sorted(UNITS))
@pytest.mark.parametrize("k_side,head_dim,group,n_tok", [
    ("fwht4", 128, 8, 37), ("fwht2", 256, 3, 50), ("lloyd4", 256, 1, 16), ("lloyd2", 256, 6, 5)])
def test_amd_pass_1_simulated_is_q_dot_k_for_every_token_and_head(unit, k_side, head_dim, group,
                                                                   n_tok):
    # every K the _mma kernels take, a q8 V's included (its pass 2 is the CUDA-core one)
    qs, flat, rows, row_bytes, gmax, mode, want = _scores_case(k_side, head_dim, group, n_tok,
                                                               n_tok + group)
    # gfx11's WMMA passes keep the byte tables (hip/kvcache.hip, CODE_NIBBLES)
    tab = codes.code_table(kv_rotated.tables(mode.bits, mode.rotation)[0], mode.bits,
                           nibbles=unit != "wmma")
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    UNITS[unit][0](qs, group, head_dim, mode.bits, flat, rows, row_bytes, n_tok, gmax, tab,
                   scores, UNITS[unit][3])
    got = scores.reshape(n_tok, gmax)
    # q as f16 + remainder (22 bits), the centroids likewise, f32 sums
    bound = 2.0**-19 * np.abs(want).max() + 1e-6
    np.testing.assert_allclose(got[:, :group], want[:, :group], rtol=0, atol=bound)
    assert (got[:, group:] == 0).all()  # group slots past the group hold zeros


def test_the_remainder_rows_come_from_the_right_lanes():
    # pass 1's remainder rows are lanes q + 2 (xor 32): lanes q + 1 (xor 16) fail the bound
    qs, flat, rows, row_bytes, gmax, mode, want = _scores_case("fwht4", 128, 8, 40, 3)
    tab = codes.code_table(kv_rotated.tables(mode.bits, mode.rotation)[0], mode.bits)
    scores = np.zeros(40 * gmax, np.float32)
    qk_scores_mfma_codes(qs, 8, 128, 4, flat, rows, row_bytes, 40, gmax, tab, scores,
                         rest_lane=16)
    assert np.abs(scores.reshape(40, gmax) - want).max() > 1e-3 * np.abs(want).max()


@pytest.mark.parametrize(("unit", "dim_of"), [
    ("mfma", lambda dpl, q, r, j: 8 * (4 * q + r) + (j ^ 1)),   # a pair's halves swapped
    ("mfma", lambda dpl, q, r, j: 4 * (8 * q + j) + r),         # D rows read as dims
    ("wmma", lambda dpl, hw, r, j: 8 * (2 * r + hw) + (j ^ 1)),
    ("wmma", lambda dpl, hw, r, j: 8 * ((2 * r + hw) ^ 1) + j)])  # the half-waves' rows swapped
def test_a_wrong_pass_2_store_fails_the_tolerance(unit, dim_of):
    k_pool, v_pool, tables, lens, rng = _pool_case("fwht4/fwht4", [60], 1, 128, 16, 1.0, 11)
    q = rng.standard_normal((1, 4, 128)).astype(np.float32)
    qk, pv, most, waves = UNITS[unit]

    def wrong_pv(*args):
        return pv(*args, dim_of=dim_of)
    got = codes.paged_attention_codes_mma(q, k_pool, v_pool, tables, lens, kv_dtype="fwht4/fwht4",
                                          scale=128 ** -0.5, partition=512,
                                          passes=(qk, wrong_pv, most, waves))
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, tables, lens,
                                                kv_dtype="fwht4/fwht4", scale=128 ** -0.5)
    assert np.abs(got - want).max() > 1e-3 * np.abs(want).max()


#: Expressions of the emulation copied from the kernel text: a change to one side fails here.
KERNEL_TEXT = {
    "code_quad_word": [
        "return BITS == 4 ? *(const uint32_t*)(row + code0 + 16 * l + 4 * t)",
        ": (uint32_t)*(const uint16_t*)(row + code0 + 8 * l + 2 * t);"],
    "code_step_pairs": [
        "code_byte_pairs<4>(tab, (w >> (16 * (s % 2))) & 0xFFu, hi, lo);",
        "code_byte_pairs<4>(tab, (w >> (16 * (s % 2) + 8)) & 0xFFu, hi1, lo1);",
        "code_byte_pairs<2>(tab, (w >> (8 * (s % 2))) & 0xFFu, hi, lo);"],
    "code_lane_word": [
        "return BITS == 4 ? *(const uint32_t*)(codes + 4 * i) : (uint32_t)*(const uint16_t*)(codes + 2 * i);"],
    "qk_scores_mfma_codes": [
        "q_fragments_mfma<KV_F16>(qs + 128 * half, group, head_dim, 1.0f, qa);",
        "const uint8_t* row = k_pool + rows[min(16 * grp + i, n_tok - 1)] * row_bytes;",
        "for (int l = 0; l < 4; ++l) kr.w[l] = code_quad_word<BITS>(row, code0, l, q);",
        "const float rest = pkv_shfl_xor(c[r], 32);",
        "const int g = 4 * q + r;",
        "const float sc = (c[r] + rest) * (cur.cnorm * (1.0f / CODE_TABLE_SCALE));",
        "if (q < 2 && g < GMAX && tok < n_tok)"],
    "pv_mfma_codes": [
        "const int tok = 16 * st + 4 * q + e;",
        "w[e] = code_lane_word<BITS>(row + code0, i);",
        "const pkv_u32x2 b = {pb[0] | pb[1] << 16, pb[2] | pb[3] << 16};",
        "for (int e = 0; e < 4; ++e) code_byte_pairs<BITS>(tab, (w[e] >> (8 * by)) & 0xFFu, hi[e], lo[e]);",
        "const int p = by * (4 / BITS) + k;",
        "const pkv_u32x2 ah = {pair_halves(hi[0][k], hi[1][k], up), pair_halves(hi[2][k], hi[3][k], up)};",
        "o[j][r] = (o[j][r] + pkv_shfl_xor(o[j][r], 8)) * (1.0f / CODE_TABLE_SCALE);"],
    "qk_scores_wmma_codes": [
        "q_fragments_wmma<KV_F16>(qs + 128 * half, group, head_dim, 1.0f, qa);",
        "for (int x = 0; x < WORDS; ++x) w[x] = *(const uint32_t*)(row + code0 + 4 * x);",
        "const int x = 2 * BITS * s + by;",
        "code_byte_pairs<BITS>(tab, (w[x / 4] >> (8 * (x % 4))) & 0xFFu, h, l);",
        "for (int k = 0; k < 4 / BITS; ++k) bh[by * (4 / BITS) + k] = h[k], bl[by * (4 / BITS) + k] = l[k];",
        "const int g = 2 * r + hw;",
        "const float sc = (c[r] + c[r + 4]) * (cnorm * (1.0f / CODE_TABLE_SCALE));"],
    "pv_wmma_codes": [
        "const int tok = 16 * st + k;",
        "w[k] = code_lane_word<BITS>(row + code0, i);",
        "for (int k = 0; k < 16; ++k) code_byte_pairs<BITS>(tab, (w[k] >> (8 * by)) & 0xFFu, hi[k], lo[k]);",
        "ah[x] = pair_halves(hi[2 * x][k], hi[2 * x + 1][k], up);",
        "o[j][r] = (o[j][r] + pkv_shfl_xor(o[j][r], 8)) * (1.0f / CODE_TABLE_SCALE);"],
}


@pytest.mark.parametrize("function", sorted(KERNEL_TEXT))
def test_the_emulated_expressions_are_the_kernel_text(function):
    assert_kernel_text(KERNEL_TEXT, function)


def test_the_partition_stores_the_dims_the_emulation_stores():
    # the _mma partition's stores of pv_{mfma,wmma}_codes' o: dim_of above, per half
    text = _function_text(KVCACHE_HIP.read_text(), "paged_attention_quant_partition")
    assert "wsum[(warp * GMAX + i) * head_dim + 128 * half + 8 * (4 * q + r) + j] = o[j][r];" in text
    assert "wsum[(warp * GMAX + i) * head_dim + 128 * half + 8 * (2 * r + hw) + j] = o[j][r];" in text

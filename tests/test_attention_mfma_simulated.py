"""Pass 1 of f16 paged attention on AMD matrix cores (hip/kvcache.hip, ``qk_scores_mfma``)
simulated in NumPy, lane by lane over 64-lane wavefronts: the query fragments (f16 value
and f16 remainder rows), the K row loads through the token -> row table, the
``v_mfma_f32_16x16x16f16`` register layouts (AMD matrix instruction calculator, CDNA2 and
CDNA3: lane l, i = l % 16, q = l // 16; A element e is ``A[i][4q + e]``, B element e
``B[4q + e][i]``, D register r ``D[4q + r][i]``) and the score stores, with the index
expressions copied from the kernel text. No AMD GPU is available: this and hipcc compiling
the kernels for gfx90a/gfx940 are all the checking the path has (docs/kernels.md, "AMD
matrix cores"); it runs only with ``PAGEDKV_ATTN_MFMA=1``."""

from __future__ import annotations

import numpy as np
import pytest

WAVE = 64


def _wave():
    lane = np.arange(WAVE)
    return lane, lane % 16, lane // 16  # lane, i, q


def mfma_f32_16x16x16f16(c, a, b):
    """a, b: float16[64, 4] (the lane's 4 halves), c: float32[64, 4] updated in place. The
    products of f16 values are exact in float64; the sum is rounded once to f32 per
    instruction (hardware may round differently: the test's bound covers it)."""
    _, i, q = _wave()
    A = np.zeros((16, 16))
    B = np.zeros((16, 16))
    seen_a, seen_b = np.zeros((16, 16), int), np.zeros((16, 16), int)
    for e in range(4):
        A[i, 4 * q + e] = a[:, e]
        np.add.at(seen_a, (i, 4 * q + e), 1)
        B[4 * q + e, i] = b[:, e]
        np.add.at(seen_b, (4 * q + e, i), 1)
    assert (seen_a == 1).all() and (seen_b == 1).all()
    D = A @ B
    for r in range(4):
        c[:, r] = (c[:, r].astype(np.float64) + D[4 * q + r, i]).astype(np.float32)


def qk_scores_mfma(q_group, group, head_dim, scale, k_rows, rows, n_tok, gmax, n_waves):
    """qk_scores_mfma<GMAX>: scores float32[n_tok * GMAX] (NaN where nothing is stored).
    ``k_rows``: float16[rows, head_dim], the pool's rows; ``rows``: token -> row."""
    lane, i, q = _wave()
    head = i % 8
    n_loads = head_dim // 32
    scale = np.float32(scale)
    qa = np.zeros((8, WAVE, 4), np.float16)
    for s in range(8):
        live = (s // 2 < n_loads) & (head < group)
        for e in range(4):
            dim = 32 * (s // 2) + 8 * q + 4 * (s % 2) + e
            v = np.where(live, q_group[np.minimum(head, group - 1), np.minimum(dim, head_dim - 1)]
                         * scale, 0).astype(np.float32)
            hi = v.astype(np.float16)
            lo = (v - hi.astype(np.float32)).astype(np.float16)
            qa[s, :, e] = np.where(live, np.where(i < 8, hi, lo), 0)
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    chunks = k_rows.reshape(k_rows.shape[0], head_dim // 8, 8)  # 16-byte chunks of a row
    for wave in range(n_waves):
        for grp in range(wave, -(-n_tok // 16), n_waves):
            tok = 16 * grp + i
            row = rows[np.minimum(tok, n_tok - 1)]
            c = np.zeros((WAVE, 4), np.float32)
            for s in range(8):
                if s // 2 < n_loads:
                    k = chunks[row, 4 * (s // 2) + q]  # row[4 l + q], l = s / 2
                    k = np.where((tok < n_tok)[:, None], k, 0).astype(np.float16)
                    b = k[:, 4:] if s % 2 else k[:, :4]  # k.z, k.w or k.x, k.y
                    mfma_f32_16x16x16f16(c, qa[s], b)
            for r in range(4):
                rest = c[lane ^ 32, r]  # pkv_shfl_xor(c[r], 32)
                g = 4 * q + r
                ok = (q < 2) & (g < gmax) & (tok < n_tok)
                scores[(tok * gmax + g)[ok]] = (c[:, r] + rest)[ok]
    return scores


@pytest.mark.parametrize(("head_dim", "group", "gmax", "n_tok", "waves"), [
    (128, 1, 1, 37, 2), (64, 2, 2, 16, 2), (128, 3, 4, 100, 2), (64, 4, 4, 5, 1),
    (128, 8, 8, 77, 2), (64, 5, 8, 33, 1)])
def test_mfma_scores_simulated_are_q_dot_k_for_every_token_and_head(head_dim, group, gmax,
                                                                      n_tok, waves):
    rng = np.random.default_rng(head_dim + 7 * group + n_tok)
    q_group = (rng.standard_normal((group, head_dim)) * 3).astype(np.float32)
    k_rows = rng.standard_normal((n_tok + 11, head_dim)).astype(np.float16)
    rows = rng.permutation(n_tok + 11)[:n_tok]  # the partition's token -> pool row table
    scale = head_dim ** -0.5
    got = qk_scores_mfma(q_group, group, head_dim, scale, k_rows, rows, n_tok, gmax, waves)
    got = got.reshape(n_tok, gmax)
    qs = q_group.astype(np.float64) * np.float32(scale)
    kt = k_rows[rows].astype(np.float64)
    expect = kt @ qs.T  # [n_tok, group]
    bound = 2.0**-20 * (np.abs(kt) @ np.abs(qs).T)  # 22-bit q (f16 + remainder), f32 sums
    np.testing.assert_array_less(np.abs(got[:, :group] - expect), bound)
    assert (got[:, group:] == 0).all()  # group slots past the group hold zeros, as on NVIDIA


def test_a_dropped_remainder_row_or_a_wrong_chunk_fails_the_bound():
    # the bound is tight enough to see the f16 rounding of q (2^-11) and any misplaced dim
    rng = np.random.default_rng(3)
    q_group = rng.standard_normal((4, 128)).astype(np.float32)
    k_rows = rng.standard_normal((40, 128)).astype(np.float16)
    rows = np.arange(40)
    exact = k_rows.astype(np.float64) @ (q_group.astype(np.float64) * np.float32(0.125)).T
    bound = 2.0**-20 * (np.abs(k_rows.astype(np.float64)) @ np.abs(q_group * 0.125).T)
    hi_only = (k_rows.astype(np.float64)
               @ (q_group * np.float32(0.125)).astype(np.float16).astype(np.float64).T)
    assert (np.abs(hi_only - exact) > bound).any()
    shifted = np.roll(k_rows, 8, axis=1).astype(np.float64) @ (q_group * 0.125).T
    assert (np.abs(shifted - exact) > bound).all()
    got = qk_scores_mfma(q_group, 4, 128, 0.125, k_rows, rows, 40, 4, 2).reshape(40, 4)
    np.testing.assert_array_less(np.abs(got - exact), bound)

"""f16 and bf16 paged attention on RDNA3 matrix cores (hip/kvcache.hip, ``qk_scores_wmma``
and ``pv_wmma`` in the ``pkv_paged_attention_{f16,bf16}wmma_g*`` kernels, gfx11) simulated
in NumPy, lane by lane over 32-lane waves: the query fragments (16-bit value and remainder
rows), the K and V row loads through the token -> row table, the
``v_wmma_f32_16x16x16_{f16,bf16}`` register layouts (RDNA3 ISA, wave32 VGPR views: lane l,
i = l % 16, hw = l // 16 holds all 16 k-elements of A row i and B column i, element e being
half e % 2 of word e // 2, and lanes 16-31 must repeat lanes 0-15; D register r is
``D[2r + hw][i]``), the score stores, the P columns and the output stores, with the index
expressions copied from the kernel text (``KERNEL_TEXT`` pins them). No AMD GPU is
available: this and hip/gfx11_codegen.py compiling the kernels for gfx1100
(tests/test_hip_gfx11.py) are all the checking the path has (docs/kernels.md, "AMD matrix
cores"); it runs only with ``PAGEDKV_ATTN_WMMA=1``."""

from __future__ import annotations

import numpy as np
import pytest

from mma_attention_emulation import combine_partitions, load_u16, load_word_a2
from pagedkv.quant import kv_q8
from test_attention_mfma_simulated import (
    ATTENTION_CASES,
    KINDS,
    KVCACHE_HIP,
    PV_CASES,
    SCORE_CASES,
    _case,
    _pack,
    _q8_case,
    _q8_v_case,
    _reference,
    assert_kernel_text,
    attention_mfma_q8,
    check_attention,
    check_pv,
    check_scores,
    from_bits,
    pair_halves,
    q8_codes_f16x4,
    q8_pv_scale,
    store_wsum,
    to_bits,
)

WAVE = 32


def _wave():
    lane = np.arange(WAVE)
    return lane, lane % 16, lane // 16  # lane, i, hw


def _elements(words, kind):
    """uint32[16, 8] (lanes 0-15's eight words) -> float64[16, 16]: element e is half e % 2
    of word e // 2."""
    halves = [(words[:, e // 2] >> (16 * (e % 2))) & 0xFFFF for e in range(16)]
    return np.stack([from_bits(h, kind) for h in halves], axis=1).astype(np.float64)


def wmma_f32_16x16x16(c, a, b, kind):
    """v_wmma_f32_16x16x16_f16 (kind "f16") or _bf16 ("bf16"), wave32: a, b uint32[32, 8],
    c float32[32, 8] updated in place. Lanes 16-31 must hold lanes 0-15's operands (checked).
    Products of 16-bit values are exact in float64; the sum is rounded once to f32 per
    instruction (hardware may round differently: the tests' bounds cover it)."""
    a, b = np.asarray(a, np.uint32), np.asarray(b, np.uint32)
    assert (a[16:] == a[:16]).all() and (b[16:] == b[:16]).all()
    A = _elements(a[:16], kind)      # lane i: row i
    B = _elements(b[:16], kind).T    # lane i: column i
    D = A @ B
    _, i, hw = _wave()
    for r in range(8):
        c[:, r] = (c[:, r].astype(np.float64) + D[2 * r + hw, i]).astype(np.float32)


def q_fragments_wmma(q_group, group, head_dim, scale, kind):
    """qk_scores_wmma's qa: uint32[8 k-steps, 32 lanes, 8 words]."""
    _, i, _ = _wave()
    head = i % 8
    n_steps = head_dim // 16
    scale = np.float32(scale)
    qa = np.zeros((8, WAVE, 8), np.uint32)
    for s in range(8):
        live = (s < n_steps) & (head < group)
        for w in range(8):
            bits = []
            for e in range(2):
                dim = 16 * s + 2 * w + e
                v = np.where(live, q_group[np.minimum(head, group - 1), min(dim, head_dim - 1)]
                             * scale, 0).astype(np.float32)
                hi = to_bits(v, kind)
                lo = to_bits(v - from_bits(hi, kind), kind)
                bits.append(np.where(live, np.where(i < 8, hi, lo), 0))
            qa[s, :, w] = _pack(bits[0], bits[1])
    return qa


def _store_scores(scores, c, tok, n_tok, gmax):
    """The score store of both WMMA pass-1 variants: head g = 2r + hw is D[g] + D[g + 8],
    registers r and r + 4 of the lane's own token."""
    _, _, hw = _wave()
    for r in range(4):
        g = 2 * r + hw
        ok = (g < gmax) & (tok < n_tok)
        scores[(tok * gmax + g)[ok]] = (c[:, r] + c[:, r + 4])[ok]


def qk_scores_wmma(q_group, group, head_dim, scale, k_bits, rows, n_tok, gmax, n_waves,
                   kind="f16"):
    """qk_scores_wmma<KIND, GMAX>: scores float32[n_tok * GMAX] (NaN where nothing is
    stored). ``k_bits``: uint16[rows, head_dim], the pool's rows; ``rows``: token -> row."""
    _, i, _ = _wave()
    n_steps = head_dim // 16
    qa = q_fragments_wmma(q_group, group, head_dim, scale, kind)
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    words = np.ascontiguousarray(k_bits).view(np.uint32).reshape(len(k_bits), head_dim // 2)
    for wave in range(n_waves):
        for grp in range(wave, -(-n_tok // 16), n_waves):
            tok = 16 * grp + i
            row = rows[np.minimum(tok, n_tok - 1)]
            c = np.zeros((WAVE, 8), np.float32)
            for s in range(n_steps):
                b = words[row, 8 * s:8 * s + 8]  # row[2 s], row[2 s + 1]: 32 bytes
                b = np.where((tok < n_tok)[:, None], b, 0).astype(np.uint32)
                wmma_f32_16x16x16(c, qa[s], b, kind)
            _store_scores(scores, c, tok, n_tok, gmax)
    return scores


def pv_wmma(probs, v_bits, rows, n_tok, head_dim, gmax, wave, n_waves, kind="f16",
            rest_lane=8, dim_of=lambda dpl, hw, r, j: dpl * (2 * r + hw) + j):
    """pv_wmma<KIND, GMAX> of one wave and the partition's store of its o: this wave's wsum
    float32[gmax, head_dim] (NaN where nothing is stored). ``probs``: float32[n_tok, gmax].
    ``rest_lane`` and ``dim_of`` are the kernel's (the mutation test changes them)."""
    lane, i, hw = _wave()
    n_words = head_dim // 32
    words = np.ascontiguousarray(v_bits).view(np.uint32)
    o = np.zeros((8, WAVE, 8), np.float32)
    head = i % 8
    rest, live = i >= 8, head < gmax
    for st in range(wave, -(-n_tok // 16), n_waves):
        vr = np.zeros((16, WAVE, 4), np.uint32)
        b = np.zeros((WAVE, 8), np.uint32)
        for k in range(16):
            tok = 16 * st + k
            row = rows[min(tok, n_tok - 1)]
            for x in range(n_words):
                vr[k, :, x] = words[row, n_words * i + x] if tok < n_tok else 0
            ok = live & (tok < n_tok)
            p = np.where(ok, probs[min(tok, n_tok - 1), np.minimum(head, gmax - 1)], 0)
            hi = to_bits(p.astype(np.float32), kind)
            bits = np.where(rest, to_bits(p - from_bits(hi, kind), kind), hi)
            b[:, k // 2] |= (bits << (16 * (k % 2))).astype(np.uint32)
        for j in range(2 * n_words):
            t0, t1 = vr[0::2, :, j // 2].T, vr[1::2, :, j // 2].T  # [lane, w]
            a = pair_halves(t0, t1, j % 2)
            wmma_f32_16x16x16(o[j], a.astype(np.uint32), b, kind)
    o = o + o[:, lane ^ rest_lane]  # pkv_shfl_xor(o[j][r], 8)
    return store_wsum(o, i, hw, gmax, head_dim, dim_of)


def attention_wmma(q_group, k_bits, v_bits, rows, scale, partition, kind="f16", n_waves=2,
                   **mutation):
    """One KV head's group over a sequence: partitions of ``partition`` tokens (the
    partition kernel's softmax in f32, the waves' wsum added), combined as
    pkv_paged_attention_reduce does. float32[group, head_dim]."""
    group, head_dim = q_group.shape
    gmax = 1 << (group - 1).bit_length()
    parts = []
    for start in range(0, len(rows), partition):
        part_rows = rows[start:start + partition]
        n_tok = len(part_rows)
        s = qk_scores_wmma(q_group, group, head_dim, scale, k_bits, part_rows, n_tok, gmax,
                           n_waves, kind).reshape(n_tok, gmax)
        assert not np.isnan(s).any()
        pmax = s.max(axis=0)
        p = np.exp(s - pmax).astype(np.float32)
        waves = [pv_wmma(p, v_bits, part_rows, n_tok, head_dim, gmax, w, n_waves, kind,
                         **mutation) for w in range(n_waves)]
        parts.append((pmax, p.sum(axis=0, dtype=np.float32),
                      np.sum(waves, axis=0, dtype=np.float32)))
    return np.stack([combine_partitions(parts, g) for g in range(group)])


def qk_scores_wmma_q8(q_group, group, head_dim, scale, pool_bytes, rows, row_bytes, n_tok, gmax,
                      n_waves, scale_record=lambda ll: ll):
    """qk_scores_wmma_q8<GMAX> over a flat q8 pool (``pool_bytes``: uint8, rows of
    ``row_bytes``): scores float32[n_tok * GMAX]. ``scale_record`` is the kernel's record ->
    scale mapping (the mutation test changes it)."""
    _, i, _ = _wave()
    n_rec = head_dim // 32
    qa = q_fragments_wmma(q_group, group, head_dim, scale, "f16")
    scores = np.full(n_tok * gmax, np.nan, np.float32)
    for wave in range(n_waves):
        for grp in range(wave, -(-n_tok // 16), n_waves):
            tok = 16 * grp + i
            live = tok < n_tok
            row = rows[np.minimum(tok, n_tok - 1)].astype(np.int64) * row_bytes
            c = np.zeros((WAVE, 8), np.float32)
            for ll in range(n_rec):
                rec = row + 34 * ll
                r = np.zeros((WAVE, 8), np.float32)
                for h in range(2):
                    b = np.zeros((WAVE, 8), np.uint32)
                    for u in range(4):
                        w = load_word_a2(pool_bytes, rec + 2 + 16 * h + 4 * u, ll % 2 == 1)
                        b[:, 2 * u:2 * u + 2] = q8_codes_f16x4(w)
                    wmma_f32_16x16x16(r, qa[2 * ll + h], b, "f16")
                d = load_u16(pool_bytes, row + 34 * scale_record(ll))
                c += np.where(live, from_bits(d, "f16"), 0)[:, None] * r
            _store_scores(scores, c, tok, n_tok, gmax)
    return scores


def pv_wmma_q8(probs, pool_bytes, rows, row_bytes, n_tok, head_dim, gmax, wave, n_waves,
               pscale, unscale, rest_lane=8, scale_record=lambda ll: ll,
               dim_of=lambda dpl, hw, r, j: 32 * (j // 2) + 2 * (2 * r + hw) + j % 2):
    """pv_wmma_q8<GMAX> of one wave, times unscale, and the partition's store of its o: this
    wave's wsum float32[gmax, head_dim]. ``rest_lane``, ``scale_record`` and ``dim_of`` are
    the kernel's (the mutation test changes them)."""
    lane, i, hw = _wave()
    n_rec = head_dim // 32
    o = np.zeros((8, WAVE, 8), np.float32)
    head = i % 8
    rest, live = i >= 8, head < gmax
    for st in range(wave, -(-n_tok // 16), n_waves):
        p = [np.where(live & (16 * st + k < n_tok),
                      probs[min(16 * st + k, n_tok - 1), np.minimum(head, gmax - 1)],
                      0).astype(np.float32) for k in range(16)]
        for ll in range(n_rec):
            code = np.zeros((16, WAVE), np.uint32)
            b = np.zeros((WAVE, 8), np.uint32)
            for k in range(16):
                tok = 16 * st + k
                row = int(rows[min(tok, n_tok - 1)]) * row_bytes
                d = load_u16(pool_bytes, row + 34 * scale_record(ll)) if tok < n_tok else 0
                code[k] = load_u16(pool_bytes, row + 34 * ll + 2 + 2 * i) if tok < n_tok else 0
                x = (p[k] * (from_bits(np.full(WAVE, d), "f16") * np.float32(pscale))).astype(np.float32)
                hi = to_bits(x, "f16")
                bits = np.where(rest, to_bits(x - from_bits(hi, "f16"), "f16"), hi)
                b[:, k // 2] |= (bits << (16 * (k % 2))).astype(np.uint32)
            for h in range(2):
                a = np.zeros((WAVE, 8), np.uint32)
                for u in range(4):
                    c0, c1, c2, c3 = (code[4 * u + t] >> (8 * h) & 0xFF for t in range(4))
                    a[:, 2 * u:2 * u + 2] = q8_codes_f16x4(c0 | c1 << 8 | c2 << 16 | c3 << 24)
                wmma_f32_16x16x16(o[2 * ll + h], a, b, "f16")
    o = (o + o[:, lane ^ rest_lane]) * np.float32(unscale)  # the shuffle, then the caller's scale
    return store_wsum(o, i, hw, gmax, head_dim, dim_of)


def attention_wmma_q8(q_group, k_records, v_records, rows, scale, partition, n_waves=2,
                      **mutation):
    """The MFMA emulation's q8 partition and reduce over the WMMA q8 passes:
    pkv_paged_attention_q8wmma_g*. float32[group, head_dim]."""
    return attention_mfma_q8(q_group, k_records, v_records, rows, scale, partition, n_waves,
                             qk_scores=qk_scores_wmma_q8, pv=pv_wmma_q8, **mutation)


@pytest.mark.parametrize(("head_dim", "group", "gmax", "n_tok", "waves"), SCORE_CASES)
def test_q8_wmma_scores_simulated_are_q_dot_k_for_every_token_and_head(head_dim, group, gmax,
                                                                         n_tok, waves):
    q_group, records, rows, kt = _q8_case(head_dim + group + n_tok, group, head_dim, n_tok)
    scale = head_dim ** -0.5
    got = qk_scores_wmma_q8(q_group, group, head_dim, scale, records.reshape(-1), rows,
                            records.shape[1], n_tok, gmax, waves).reshape(n_tok, gmax)
    qs = q_group.astype(np.float64) * np.float32(scale)
    bound = 2.0**-20 * (np.abs(kt) @ np.abs(qs).T)  # 22-bit q, exact codes, f32 sums
    np.testing.assert_array_less(np.abs(got[:, :group] - kt @ qs.T), bound)
    assert (got[:, group:] == 0).all()


@pytest.mark.parametrize(("head_dim", "gmax", "n_tok", "waves"), PV_CASES)
def test_q8_wmma_pv_simulated_is_p_times_v_for_every_dim_and_head(head_dim, gmax, n_tok, waves):
    records, rows, v = _q8_v_case(head_dim + gmax + n_tok, head_dim, n_tok)
    probs = np.random.default_rng(n_tok).random((n_tok, gmax)).astype(np.float32)
    pool, row_bytes = records.reshape(-1), records.shape[1]
    pscale, unscale = q8_pv_scale(pool, rows, row_bytes, head_dim)
    got = sum(pv_wmma_q8(probs, pool, rows, row_bytes, n_tok, head_dim, gmax, w, waves,
                         pscale, unscale) for w in range(waves))
    expect = probs.T.astype(np.float64) @ v  # V = d c exactly
    # p d as 22 bits (f16 value + remainder; the remainder may be subnormal), exact codes
    bound = 2.0**-20 * (probs.T.astype(np.float64) @ np.abs(v)) + 2.0**-24 * unscale * 128 * n_tok
    np.testing.assert_array_less(np.abs(got - expect), bound)


def _q8_attention_case(seed_k, seed_v, group, head_dim, n_tok):
    q_group, k_records, rows, kt = _q8_case(seed_k, group, head_dim, n_tok)
    v_records, _, _ = _q8_v_case(seed_v, head_dim, len(k_records) - 5)  # as many pool rows
    vt = kv_q8.dequantize(v_records, head_dim)[rows].astype(np.float64)
    s = q_group.astype(np.float64) @ kt.T * head_dim ** -0.5
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return q_group, k_records, v_records, rows, (p / p.sum(axis=1, keepdims=True)) @ vt, vt


@pytest.mark.parametrize(("head_dim", "group", "n_tok", "partition"), ATTENTION_CASES)
def test_q8_wmma_attention_simulated_is_within_the_documented_tolerance(head_dim, group, n_tok,
                                                                          partition):
    # both q8 passes on WMMA against float64 attention over the dequantized K and V
    q_group, k_records, v_records, rows, want, vt = _q8_attention_case(
        head_dim * group + n_tok, n_tok, group, head_dim, n_tok)
    got = attention_wmma_q8(q_group, k_records, v_records, rows, head_dim ** -0.5, partition)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(vt).max())


@pytest.mark.parametrize("mutation", [
    {"rest_lane": 16},  # the remainder column from the other half-wave
    {"scale_record": lambda ll: ll ^ 1},  # another record's scale
    {"dim_of": lambda dpl, hw, r, j: 32 * (j // 2) + 2 * (2 * r + hw) + (j % 2 ^ 1)},  # bytes
    {"dim_of": lambda dpl, hw, r, j: dpl * (2 * r + hw) + j}])  # pv_wmma's f16 dims
def test_a_wrong_q8_pass_2_mapping_fails_the_tolerance(mutation):
    q_group, k_records, v_records, rows, want, vt = _q8_attention_case(21, 22, 4, 128, 150)
    got = attention_wmma_q8(q_group, k_records, v_records, rows, 128 ** -0.5, 1024, **mutation)
    assert not np.allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(vt).max())


def test_a_wrong_q8_pass_1_record_scale_fails_the_bound():
    q_group, records, rows, kt = _q8_case(3, 2, 128, 40)
    got = qk_scores_wmma_q8(q_group, 2, 128, 128 ** -0.5, records.reshape(-1), rows,
                            records.shape[1], 40, 2, 1, scale_record=lambda ll: ll ^ 1)
    qs = q_group.astype(np.float64) * np.float32(128 ** -0.5)
    err = np.abs(got.reshape(40, 2) - kt @ qs.T)
    assert (err > 2.0**-20 * (np.abs(kt) @ np.abs(qs).T)).any()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group", "gmax", "n_tok", "waves"),
                         SCORE_CASES + [(128, 3, 4, 100, 3)])
def test_wmma_scores_simulated_are_q_dot_k_for_every_token_and_head(kind, head_dim, group, gmax,
                                                                      n_tok, waves):
    check_scores(qk_scores_wmma, kind, head_dim, group, gmax, n_tok, waves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "gmax", "n_tok", "waves"), PV_CASES + [(128, 4, 100, 3)])
def test_wmma_pv_simulated_is_p_times_v_for_every_dim_and_head(kind, head_dim, gmax, n_tok,
                                                                 waves):
    check_pv(pv_wmma, kind, head_dim, gmax, n_tok, waves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("head_dim", "group", "n_tok", "partition"), ATTENTION_CASES)
def test_wmma_attention_simulated_is_within_the_documented_tolerance(kind, head_dim, group,
                                                                       n_tok, partition):
    check_attention(attention_wmma, kind, head_dim, group, n_tok, partition)


@pytest.mark.parametrize("mutation", [
    {"rest_lane": 16},  # the remainder column from the other half-wave
    {"dim_of": lambda dpl, hw, r, j: dpl * (2 * r + hw) + (j ^ 1)},  # halves of a word swapped
    {"dim_of": lambda dpl, hw, r, j: dpl * (r + 8 * hw) + j}])  # D rows read MFMA-style
def test_a_wrong_pass_2_lane_mapping_fails_the_tolerance(mutation):
    q_group, k_bits, v_bits, rows = _case(5, 4, 128, 150, "f16")
    got = attention_wmma(q_group, k_bits, v_bits, rows, 128 ** -0.5, 1024, **mutation)
    want, v_scale = _reference(q_group, k_bits, v_bits, rows, 128 ** -0.5, "f16")
    assert not np.allclose(got, want, rtol=1e-4, atol=2e-5 * v_scale)


@pytest.mark.parametrize("kind", KINDS)
def test_the_wmma_model_matches_the_documented_layout(kind):
    # Entries of the RDNA3 ISA's wave32 VGPR views (v_wmma_f32_16x16x16_{f16,bf16}): a
    # one-hot A or B element lands where the table says.
    one = int(to_bits(np.float32(1.0), kind))

    def product(a_row, a_k, b_col, b_k):
        a, b = np.zeros((WAVE, 8), np.uint32), np.zeros((WAVE, 8), np.uint32)
        for half in (0, 16):
            a[a_row + half, a_k // 2] = one << (16 * (a_k % 2))
            b[b_col + half, b_k // 2] = one << (16 * (b_k % 2))
        c = np.zeros((WAVE, 8), np.float32)
        wmma_f32_16x16x16(c, a, b, kind)
        return {(int(lane), int(r)) for lane, r in zip(*np.nonzero(c))}
    # A[3][9] (lane 3, v4 high half) x B[9][12] (lane 12): D[3][12] is lane 16 + 12, v1
    assert product(3, 9, 12, 9) == {(28, 1)}
    assert product(3, 9, 12, 8) == set()  # B[8][12]: another k
    # A[14][0] x B[0][5]: D[14][5] is lane 5, v7
    assert product(14, 0, 5, 0) == {(5, 7)}
    a = np.zeros((WAVE, 8), np.uint32)
    a[3, 0] = one  # held by one half-wave only: a kernel bug the model refuses
    with pytest.raises(AssertionError):
        wmma_f32_16x16x16(np.zeros((WAVE, 8), np.float32), a, np.zeros((WAVE, 8), np.uint32), kind)


#: The kernel text each emulated index expression copies (hip/kvcache.hip): a change on
#: either side breaks this list, so the emulation and the kernel cannot drift apart.
KERNEL_TEXT = {
    "q_fragments_wmma": [
        "const int i = threadIdx.x % 16, head = i % 8;",
        "const int n_steps = head_dim / 16;",
        "const float v = q_group[(int64_t)head * head_dim + 16 * s + 2 * w + e] * scale;",
        "bits[e] = i < 8 ? hi : to_mfma_bits<KIND>(v - from_mma_bits<KIND>(hi));",
        "qa[s][w] = bits[0] | bits[1] << 16;",
    ],
    "qk_scores_wmma": [
        "const int i = lane % 16, hw = lane / 16;",
        "const int tok = 16 * grp + i;",
        "row[2 * s]", "row[2 * s + 1]",
        "const pkv_u32x8 b = {lo.x, lo.y, lo.z, lo.w, up.x, up.y, up.z, up.w};",
        "const int g = 2 * r + hw;",
        "if (g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + c[r + 4];",
    ],
    "pv_wmma": [
        "const int i = lane % 16;",
        "const int n_words = head_dim / 32;",
        "const int head = i % 8;",
        "const bool rest = i >= 8, live = head < GMAX;",
        "const int tok = 16 * st + k;",
        "rows[min(tok, n_tok - 1)] * row_bytes + 4 * n_words * i;",
        "const float p = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;",
        "const uint32_t bits = rest ? to_mfma_bits<KIND>(p - from_mma_bits<KIND>(hi)) : hi;",
        "if (k % 2 == 0) b[k / 2] = bits;",
        "else b[k / 2] |= bits << 16;",
        "const uint32_t t0 = vr[2 * w][j / 2], t1 = vr[2 * w + 1][j / 2];",
        "a[w] = pair_halves(t0, t1, j % 2);",
        "for (int r = 0; r < 8; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);",
    ],
    "qk_scores_wmma_q8": [
        "const int i = lane % 16, hw = lane / 16;",
        "q_fragments_wmma<KV_F16>(q_group, group, head_dim, scale, qa);",
        "const int tok = 16 * grp + i;",
        "const uint8_t* rec = row + l * PKV_KVQ8_RECORD_BYTES;",
        "const uint8_t* at = rec + 2 + 16 * h + 4 * u;",
        "q8_codes_f16x4(l % 2 ? load_word_a2<true>(at) : load_word_a2<false>(at));",
        "b[2 * u] = f.x, b[2 * u + 1] = f.y;",
        "r = wmma_16x16x16<KV_F16>(qa[2 * l + h], b, r);",
        "c += pkv_half_bits_to_float(*(const uint16_t*)rec) * r;",
        "if (g < GMAX && tok < n_tok) scores[tok * GMAX + g] = c[r] + c[r + 4];",
    ],
    "pv_wmma_q8": [
        "const int i = lane % 16;",
        "const int head = i % 8;",
        "const bool rest = i >= 8, live = head < GMAX;",
        "p[k] = live && tok < n_tok ? scores[tok * GMAX + (live ? head : 0)] : 0.0f;",
        "l * PKV_KVQ8_RECORD_BYTES;",
        "const uint32_t d = tok < n_tok ? *(const uint16_t*)rec : 0u;",
        "code[k] = tok < n_tok ? *(const uint16_t*)(rec + 2 + 2 * i) : 0u;",
        "const float x = p[k] * (pkv_half_bits_to_float((uint16_t)d) * pscale);",
        "const uint32_t bits = rest ? to_mfma_bits<KV_F16>(x - from_mma_bits<KV_F16>(hi)) : hi;",
        "const uint32_t c0 = code[4 * u] >> 8 * h & 0xFFu, c1 = code[4 * u + 1] >> 8 * h & 0xFFu;",
        "const pkv_u32x2 f = q8_codes_f16x4(c0 | c1 << 8 | c2 << 16 | c3 << 24);",
        "o[2 * l + h] = wmma_16x16x16<KV_F16>(a, b, o[2 * l + h]);",
        "for (int r = 0; r < 8; ++r) o[j][r] += pkv_shfl_xor(o[j][r], 8);",
    ],
    "wmma_16x16x16": ["__builtin_amdgcn_wmma_f32_16x16x16_bf16_w32(",
                      "__builtin_amdgcn_wmma_f32_16x16x16_f16_w32("],
    "paged_attention_partition": [
        "const int i = lane % 16, hw = lane / 16, dpl = head_dim / 16;",
        "const int d = KIND == KV_Q8 ? 32 * (j / 2) + 2 * (2 * r + hw) + j % 2",
        ": dpl * (2 * r + hw) + j;",
        "pv_wmma_q8<GMAX>(scores, v_pool, rows, row_bytes, n_tok, head_dim, q8_pv_pscale(e), o);",
    ],
}


@pytest.mark.parametrize("function", sorted(KERNEL_TEXT))
def test_the_emulated_expressions_are_the_kernel_text(function):
    assert_kernel_text(KERNEL_TEXT, function)


def test_the_wmma_kernels_are_defined_for_each_kind_under_pkv_wmma_only():
    text = KVCACHE_HIP.read_text(encoding="utf-8")
    for g in (1, 2, 4, 8):
        for kind, macro in (("f16", "KV_F16"), ("bf16", "KV_BF16"), ("q8", "KV_Q8")):
            at = text.index(f"PKV_ATTN_MFMA_KERNEL(pkv_paged_attention_{kind}wmma_g{g}, {macro}, {g})")
            assert text.rindex("#if PKV_ATTN_WMMA", 0, at) > text.rindex("#endif", 0, at)

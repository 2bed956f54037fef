"""Property tests (hypothesis) of pagedkv.quant: decode(encode(x)) within each format's error
bound of docs/contracts/hfqm-and-quant.md, '4. Weight codecs', and gemv against x @
dequantize(W).T."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pagedkv.quant as Q
from pagedkv.errors import InvalidArgument
from pagedkv.quant.affine import AffineFamily

# MQ2G256V2 warns on every encode (quality-rejected upstream); test_quant_kat checks it
pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

EPS = float(np.finfo(np.float32).eps)
# The Lloyd codebooks have no per-element bound of this kind (a value's centroid is the
# nearest one of the last assignment, not of the final centroids): tests/test_quant_lloyd.py
# checks them byte for byte against a transcription of the rule instead, and
# tests/test_quant_p2.py does the same for the P2 formats (docs/formats/quant.md, "P2 formats").
ALL = sorted(c.name for c in Q.CODECS.values() if c.kind in ("raw", "affine", "q8"))
GROUPED = [n for n in ALL if Q.resolve(n).kind != "raw"]


@st.composite
def weights(draw, names=ALL, max_rows=3):
    name = draw(st.sampled_from(names))
    codec = Q.resolve(name)
    k = draw(st.sampled_from([256, 512]) if codec.qt.k_multiple_of_256
             else st.sampled_from([1, 7, 32, 100, 128, 256, 300, 512]))
    rows = draw(st.integers(1, max_rows))
    magnitude = draw(st.sampled_from([1e-3, 1.0, 50.0, 3e3]))
    unit = st.floats(-1.0, 1.0, width=32, allow_subnormal=False)
    x = draw(hnp.arrays(np.float32, (rows, k), elements=unit)) * np.float32(magnitude)
    if draw(st.booleans()):              # sparse spikes: outliers, constant runs
        x[:, ::17] = 0.0
    return name, x.astype(np.float32)


def _groups(flat: np.ndarray, g: int) -> np.ndarray:
    pad = -flat.size % g
    return np.concatenate([flat, np.zeros(pad, np.float32)]).reshape(-1, g), pad


def _ulps(a: np.ndarray) -> np.ndarray:
    # "plus a few f32 ulps" (docs/contracts/hfqm-and-quant.md, '4. Weight codecs'), and an absolute
    # floor for groups whose range is
    # subnormal: there 1/scale overflows to inf, every element above the minimum codes
    # as L (error < range < 2^-126) and the minimum as 0 (tests/test_quant_hostile_groups.py)
    return 8 * EPS * a + 2.0**-124


def check_bound(name: str, x: np.ndarray) -> None:
    codec = Q.resolve(name)
    raw = Q.quantize(x, name)
    back = Q.dequantize(raw, name, x.shape)
    assert back.shape == x.shape and back.dtype == np.float32
    flat, got = x.reshape(-1), back.reshape(-1)
    if codec.kind == "raw":
        if name == "f32":
            assert np.array_equal(got, flat)
        else:                             # truncation: toward zero, within one half/bf16 ulp
            rel = 2.0**-10 if name == "f16" else 2.0**-7
            tiny = 2.0**-24 if name == "f16" else 2.0**-133    # one subnormal step
            assert (np.abs(got) <= np.abs(flat)).all()
            assert (np.abs(got - flat) <= rel * np.abs(flat) + tiny).all()
        return
    g, b = codec.group_size, codec.group_bytes
    blocks = raw.reshape(-1, b)
    if codec.kind == "q8":
        xg, pad = _groups(flat, g)
        amax = np.abs(xg).max(axis=1)
        d32 = (amax / np.float32(127)).astype(np.float32)
        d16 = blocks[:, :2].copy().view(np.float16).astype(np.float32)[:, 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            shrink = np.where(d32 > 0, 1 - d16 / d32, 0)
        bound = d32 / 2 + amax * shrink + _ulps(amax)
        err = np.abs(_groups(got, g)[0] - xg)
        assert (err <= bound[:, None]).all()
        return
    if not codec.rotated:
        xg, pad = _groups(flat, g)
        scale = blocks[:, :4].copy().view(np.float32)[:, 0]
        err = np.abs(_groups(got, g)[0] - xg)
        if pad:                            # padded tail decodes to min, ignore it
            err[-1, g - pad:] = 0
        mag = np.abs(xg).max(axis=1)
        assert (err <= (scale / 2 + _ulps(mag))[:, None]).all()
        return
    # rotated: element bound in the rotated basis, then L2 per group in the original basis
    xg, pad = _groups(flat, 256)
    r = Q.fwht256(xg)
    rot_back = Q.dequantize(raw, name, (raw.size // b * 256,), basis="rotated").reshape(-1, 256) \
        if pad == 0 else None
    if rot_back is None:                   # last group is short: decode groups separately
        rot_back = np.stack([Q.dequantize(blk, name, (256,), basis="rotated") for blk in blocks])
    err = np.abs(rot_back - r)
    mag = np.abs(r).max(axis=1)
    L = np.float32(2**codec.bits - 1)
    if codec.family == AffineFamily.MQ_V1:
        bound = blocks[:, :4].copy().view(np.float32)[:, 0] / 2
        elem = np.repeat(bound[:, None], 256, axis=1)
    else:
        hdr = blocks[:, :8].copy().view(np.float16).astype(np.float32)
        spans = 2 if codec.family == AffineFamily.MQ_V2 else 1
        width = 256 // spans
        elem = np.empty_like(r)
        for h in range(spans):
            s_, z_ = hdr[:, 2 * h], hdr[:, 2 * h + 1]
            part = r[:, h * width:(h + 1) * width]
            lo, hi = part.min(axis=1), part.max(axis=1)
            b_ = np.maximum.reduce([s_ / 2, z_ - lo, hi - z_ - L * s_])
            elem[:, h * width:(h + 1) * width] = b_[:, None]
    assert (err <= elem + _ulps(mag)[:, None]).all()
    l2 = np.sqrt(((_groups(got, 256)[0] - xg) ** 2).sum(axis=1))
    if pad:
        tail = _groups(got, 256)[0][-1, 256 - pad:]
        assert not tail.any()
    assert (l2 <= 16 * elem.max(axis=1) + 16 * _ulps(mag) + 1e-30).all()


@given(weights())
def test_round_trip_within_format_bound(case):
    name, x = case
    check_bound(name, x)


@given(weights(), st.sampled_from([0.0, 7.5, -1e4]))
def test_constant_groups_are_exact(case, value):
    name, x = case
    codec = Q.resolve(name)
    assume(not codec.rotated)
    c = np.full_like(x, np.float32(value))
    back = Q.dequantize(Q.quantize(c, name), name, c.shape)
    if codec.kind == "q8" or name in ("f16", "bf16"):
        assert np.allclose(back, c, rtol=2**-7)
    else:
        assert np.array_equal(back, c)


@given(weights(names=GROUPED), st.integers(1, 8), st.integers(0, 2**31))
def test_gemv_matches_dense_product(case, batch, seed):
    name, w = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, w.shape[1])).astype(np.float32)
    raw = Q.quantize(w, name)
    dense = Q.dequantize(raw, name, w.shape).astype(np.float64)
    y = Q.gemv(raw, name, w.shape, x)
    assert y.shape == (batch, w.shape[0]) and y.dtype == np.float32
    ref = x.astype(np.float64) @ dense.T
    # float32 accumulation over K terms, including the min·Σx split of the affine formats
    ax = np.abs(x).astype(np.float64)
    cond = ax @ np.abs(dense).T + ax.sum(axis=1, keepdims=True) * np.abs(dense).max()
    assert (np.abs(y - ref) <= 2.0**-15 * cond + 1e-30).all()
    assert np.array_equal(Q.gemv(raw, name, w.shape, x[0]), y[0])
    codec = Q.resolve(name)
    if codec.rotated and w.shape[1] % 256 == 0:
        # the MQ formulation: rotated x against the stored (rotated) weights
        stored = Q.dequantize(raw, name, w.shape, basis="rotated").astype(np.float64)
        xr = Q.fwht256(x.reshape(batch, -1, 256)).reshape(batch, -1).astype(np.float64)
        ref_rot = xr @ stored.T
        cond_r = np.abs(xr) @ np.abs(stored).T + np.abs(xr).sum(1, keepdims=True) * np.abs(stored).max()
        assert (np.abs(y - ref_rot) <= 2.0**-15 * cond_r + 1e-30).all()


@given(weights(), st.sampled_from([np.nan, np.inf, -np.inf]), st.data())
def test_nonfinite_rejected_anywhere(case, bad, data):
    name, x = case
    i = data.draw(st.integers(0, x.size - 1))
    x.reshape(-1)[i] = bad
    try:
        Q.quantize(x, name)
    except InvalidArgument as exc:
        assert "non-finite" in str(exc)
        assert str(tuple(int(v) for v in np.unravel_index(i, x.shape))) in str(exc)
    else:
        raise AssertionError(f"{name} accepted {bad} at {i}")

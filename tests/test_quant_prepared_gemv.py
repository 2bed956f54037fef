"""PreparedGemv (docs/formats/cpu-gemv.md): bit-exact against a NumPy model of its
arithmetic, the same bits on every kernel and thread count, within the documented error
bound of the exact product, and the argument errors."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv.quant as Q
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SizeMismatch
from pagedkv.quant import prepared_gemv
from pagedkv.quant.formats import AFFINE, CODECS, Q4K, Q8

pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

F32 = np.float32
FORMATS = sorted(c.name for c in CODECS.values() if c.kind in (AFFINE, Q8, Q4K))
ISAS = prepared_gemv.supported_isas()


# ----------------------------------------------------------------------------- model

def _q4k_codes_and_params(groups, m):
    """Q4K super-blocks [M, n, 144] as spans of 32: codes, d * sc and -(dmin * m) (f32)."""
    d = np.ascontiguousarray(groups[..., 0:2]).view(np.float16).astype(F32)
    dmin = np.ascontiguousarray(groups[..., 2:4]).view(np.float16).astype(F32)
    b = groups[..., 4:16].astype(np.int64)
    # ggml's get_scale_min_k4: sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7,
    # 4-7 in the nibbles of bytes 8-11 with their top 2 bits in bytes 0-3 / 4-7
    sc = np.concatenate([b[..., 0:4] & 63, (b[..., 8:12] & 15) | ((b[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([b[..., 4:8] & 63, (b[..., 8:12] >> 4) | ((b[..., 4:8] >> 6) << 4)], -1)
    nib = groups[..., 16:].reshape(m, -1, 4, 1, 32).astype(np.int64)
    q = np.concatenate([nib & 15, nib >> 4], -2).reshape(m, -1, 32)    # sub-block 2c, 2c + 1
    scale = (d * sc.astype(F32)).astype(F32).reshape(m, -1)
    mins = (-(dmin * mn.astype(F32))).astype(F32).reshape(m, -1)
    return q, scale, mins, 32


def _codes_and_params(raw, codec, m, k):
    """Codes [M, spans, span] (int64) and per-span scale/min [M, spans] (f32, exact)."""
    g, nbytes = codec.group_size, codec.group_bytes
    groups = np.frombuffer(raw, np.uint8).reshape(m, k // g, nbytes)
    if codec.kind == Q4K:
        return _q4k_codes_and_params(groups, m)
    if codec.kind == Q8:
        q = groups[:, :, 2:].view(np.int8).astype(np.int64)
        d = np.ascontiguousarray(groups[:, :, :2]).view(np.float16).astype(F32)
        return q, d.reshape(m, -1), None, 32
    bits = codec.bits
    lsb = np.unpackbits(groups[:, :, 8:], axis=-1, bitorder="little").reshape(m, k // g, g, bits)
    q = (lsb.astype(np.int64) << np.arange(bits)).sum(-1)
    hdr = np.ascontiguousarray(groups[:, :, :8])
    family = int(codec.affine_family)
    if family in (0, 1):                                   # HFQ, MQ v1: f32 scale, min
        f = hdr.view(F32)
        return q, f[..., 0], f[..., 1], g
    h = hdr.view(np.float16).astype(F32)
    if family == 2:                                        # V2: (s, z) per 128-half
        return q.reshape(m, -1, 128), h[..., 0::2].reshape(m, -1), h[..., 1::2].reshape(m, -1), 128
    return q, h[..., 0], h[..., 1], 256                    # MQ4C


def _quantize_x(x, span):
    """int8 x per span, dx, and the 16-lane f32 sum of the span (cpu-gemv.md)."""
    b, k = x.shape
    xs = x.reshape(b, k // span, span)
    amax = np.abs(xs).max(-1).astype(F32)
    pre = np.where(amax < F32(2.0**-118), F32(2.0**64), F32(1)).astype(F32)   # tiny spans
    amax_s = (amax * pre).astype(F32)
    dx = ((amax_s / F32(127)).astype(F32) / pre).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax_s > 0, F32(127) / amax_s, F32(0)).astype(F32)
    v = ((xs * pre[..., None]).astype(F32) * inv[..., None]).astype(F32)
    xq = np.clip(np.rint(v), -127, 127).astype(np.int64)
    lanes = xs.reshape(b, k // span, span // 16, 16)
    acc = lanes[:, :, 0, :].copy()
    for t in range(1, span // 16):
        acc = (acc + lanes[:, :, t, :]).astype(F32)
    h = 8
    while h >= 1:
        acc = (acc[..., :h] + acc[..., h:2 * h]).astype(F32)
        h //= 2
    return xq, dx, acc[..., 0]


def _rotated(codec, x2):
    return Q.fwht256(x2.reshape(-1, 256)).reshape(x2.shape) if codec.rotated else x2


def model(raw, fmt, shape, x):
    """The PreparedGemv result, computed with NumPy float32 steps in the documented order."""
    codec = Q.resolve(fmt)
    m, k = shape
    x2 = _rotated(codec, x.reshape(-1, k).astype(F32))
    q, sc, mn, span = _codes_and_params(raw, codec, m, k)
    xq, dx, xsum = _quantize_x(x2, span)
    c = 0 if mn is None else 1 << (codec.bits - 1)
    isum = np.einsum("rsj,bsj->brs", q - c, xq)             # exact
    acc = np.zeros((x2.shape[0], m), F32)
    for s in range(k // span):
        sd = (sc[None, :, s] * dx[:, s, None]).astype(F32)
        acc = (acc + (isum[:, :, s].astype(F32) * sd).astype(F32)).astype(F32)
        if mn is not None:
            mc = (mn[:, s] + (sc[:, s] * F32(c)).astype(F32)).astype(F32)
            acc = (acc + (mc[None, :] * xsum[:, s, None]).astype(F32)).astype(F32)
    return acc


def error_bound(raw, fmt, shape, x):
    """The documented bound on |y - x'·Ŵᵀ| (float64), x' = x rotated for MQ formats."""
    codec = Q.resolve(fmt)
    m, k = shape
    x2 = _rotated(codec, x.reshape(-1, k).astype(F32)).astype(np.float64)
    q, sc, mn, span = _codes_and_params(raw, codec, m, k)
    ns = k // span
    xs = x2.reshape(-1, ns, span)
    dx = np.abs(xs).max(-1) / 127
    c = 0 if mn is None else 1 << (codec.bits - 1)
    sc64 = sc.astype(np.float64)
    # x rounded to int8: |x̂ - x| <= dx/2 (1 + 2^-12), times |s (q - c)|
    e_x = np.einsum("rs,bs->br", sc64 * np.abs(q - c).sum(-1), dx) * 0.5 * (1 + 2.0**-12)
    eps = 2.0**-24
    isum_mag = np.einsum("rs,bs->br", sc64 * np.abs(q - c).sum(-1), dx)
    abs_x = np.abs(xs).sum(-1)                                 # [B, spans]
    if mn is None:
        mc_mag = np.zeros_like(isum_mag)
        e_sum = np.zeros_like(isum_mag)
    else:
        mc = np.abs(mn.astype(np.float64) + sc64 * c)
        mc_mag = np.einsum("rs,bs->br", mc, abs_x)
        e_sum = np.einsum("rs,bs->br", mc, abs_x) * (span // 16 + 4) * eps
    e_float = (2 * ns + 4) * eps * (isum_mag * 1.01 + mc_mag)
    return e_x + e_sum + e_float


def exact_product(raw, fmt, shape, x):
    """x'·Ŵᵀ in float64, Ŵ the stored-basis decode (exact) and x' rotated for MQ."""
    codec = Q.resolve(fmt)
    k = shape[1]
    x2 = _rotated(codec, x.reshape(-1, k).astype(F32)).astype(np.float64)
    w = Q.dequantize(raw, fmt, shape, basis="rotated" if codec.rotated else "original")
    return x2 @ w.astype(np.float64).T


def _weights(rng, m, k):
    # rows of very different magnitude, some constant groups
    w = rng.standard_normal((m, k)).astype(F32) * rng.uniform(0.01, 3, (m, 1)).astype(F32)
    w[min(1, m - 1), :256] = 0.5
    return w


# ----------------------------------------------------------------------------- results

@pytest.mark.parametrize("fmt", FORMATS)
def test_every_kernel_matches_the_model_bit_for_bit(fmt):
    rng = np.random.default_rng(abs(hash(fmt)) % 2**32)
    # 37 rows: 3 tiles, the last with 5 rows; K = 1024: x rows padded apart (a multiple
    # of 1 KiB would share L1 sets; pkv_pgemv_x_stride)
    for m, k in ((37, 512), (21, 1024)):
        raw = Q.quantize(_weights(rng, m, k), fmt)
        for batch in (1, 3, 8, 11):                 # 11: one pass of 8, then 3
            x = rng.standard_normal((batch, k)).astype(F32) * F32(rng.uniform(0.1, 10))
            want = model(raw, fmt, (m, k), x)
            for isa in ISAS:
                got = Q.prepare_gemv(raw, fmt, (m, k), isa=isa)(x)
                assert got.dtype == F32 and got.shape == (batch, m)
                assert got.tobytes() == want.tobytes(), (isa, k, batch)


@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2", "q8f16", "mq6g256v2", "hfq3g128",
                                 "q4k"])
def test_threads_and_batch_never_change_a_bit(fmt):
    rng = np.random.default_rng(7)
    m, k = 100, 1024
    raw = Q.quantize(_weights(rng, m, k), fmt)
    g = Q.prepare_gemv(raw, fmt, (m, k))
    x = rng.standard_normal((9, k)).astype(F32)
    want = g(x)
    for threads in (2, 3, 7, 13):                  # 13 parts > 7 tiles: some get none
        assert g(x, threads=threads).tobytes() == want.tobytes()
    for b in range(9):                             # a row's result does not depend on its batch
        assert g(x[b]).tobytes() == want[b].tobytes()
    g4 = Q.prepare_gemv(raw, fmt, (m, k), threads=4)      # also repacked on 4 threads
    assert g4.threads == 4 and g4(x).tobytes() == want.tobytes()


def test_the_first_bad_x_is_reported_on_any_thread_count():
    """Which bad x a call reports: the first row with an error; in a row, a non-finite
    input before an overflow after rotation (the row's inputs are all checked before it is
    rotated); then the lowest index. Nothing is written."""
    k, batch = 4096, 4
    g = Q.prepare_gemv(Q.quantize(np.ones((4, k), F32), "mq4g256v2"), "mq4g256v2", (4, k))
    cases = []
    x = np.ones((batch, k), F32)
    x[3, 10], x[2, 3000] = np.inf, np.nan
    cases.append((x, r"x\[2, 3000\] is nan"))
    x = np.ones((batch, k), F32)
    x[1, :256] = 3e38                   # overflows once rotated, in the row's first part...
    x[1, 3500] = np.nan                 # ... but the row has a NaN: that is reported
    cases.append((x, r"x\[1, 3500\] is nan"))
    x = np.ones((batch, k), F32)
    x[1, 3840:] = 3e38                  # overflow in row 1's last group, NaN in row 2
    x[2, 0] = np.nan
    cases.append((x, "x row 1 overflows float32 when rotated"))
    for x, message in cases:
        for threads in (1, 2, 3, 4):
            out = np.full((batch, 4), 7.0, F32)
            with pytest.raises(InvalidArgument, match=message):
                g(x, out=out, threads=threads)
            assert np.all(out == 7.0)


@pytest.mark.parametrize("fmt", ["hfq4g256", "hfq4g128", "mq4g256", "mq4g256v2", "mq4cg256",
                                 "q8f16", "hfq2g256", "mq3g256v2", "mq5g256v2", "hfq6g256",
                                 "q4k"])
@pytest.mark.parametrize("seed", [1, 2])
def test_fresh_random_inputs_stay_within_the_documented_bound(fmt, seed):
    rng = np.random.default_rng(1000 * seed + len(fmt))
    m, k = 64, 2048
    raw = Q.quantize(rng.standard_normal((m, k)).astype(F32), fmt)
    x = rng.standard_normal((4, k)).astype(F32)
    x[1] *= F32(1e-3)
    x[2, rng.integers(0, k, 8)] = F32(50.0)          # outliers in a few spans
    x[3] = rng.uniform(-1, 1, k).astype(F32) * F32(1e4)
    y = Q.prepare_gemv(raw, fmt, (m, k))(x).astype(np.float64)
    exact = exact_product(raw, fmt, (m, k), x)
    bound = error_bound(raw, fmt, (m, k), x)
    assert np.all(np.abs(y - exact) <= bound)
    # the bound is a worst case; the typical error on Gaussian x is far below it (more
    # for 2-bit codes, whose |q - c| is large relative to their spread)
    rel = np.linalg.norm(y[0] - exact[0]) / np.linalg.norm(exact[0])
    assert rel < (0.02 if Q.resolve(fmt).bits == 2 else 0.01)


@settings(max_examples=30, deadline=None)
@given(fmt=st.sampled_from(["hfq4g256", "mq4g256v2", "q8f16", "mq4cg256", "hfq6g256", "q4k"]),
       seed=st.integers(0, 2**32 - 1), tiles=st.integers(1, 3), groups=st.integers(1, 4),
       batch=st.integers(1, 9), log_scale=st.floats(-20, 20))
def test_hypothesis_inputs_stay_within_the_documented_bound(fmt, seed, tiles, groups, batch,
                                                            log_scale):
    """New weights, x, shapes and x magnitudes on every run (hypothesis), every kernel."""
    rng = np.random.default_rng(seed)
    m, k = 16 * tiles - int(rng.integers(0, 8)), 256 * groups
    raw = Q.quantize(_weights(rng, m, k), fmt)
    x = (rng.standard_normal((batch, k)) * 2.0**log_scale).astype(F32)
    x[0, rng.integers(0, k, 3)] *= F32(40)                 # a few outliers
    exact = exact_product(raw, fmt, (m, k), x)
    bound = error_bound(raw, fmt, (m, k), x)
    want = None
    for isa in ISAS:
        y = Q.prepare_gemv(raw, fmt, (m, k), isa=isa)(x)
        assert want is None or y.tobytes() == want.tobytes(), isa
        want = y
    assert want is not None and np.all(np.abs(want.astype(np.float64) - exact) <= bound)


def test_tiny_zero_and_huge_spans():
    """Spans of x whose largest magnitude is 0, subnormal or near FLT_MAX."""
    rng = np.random.default_rng(9)
    m, k = 20, 1024
    for fmt in ("hfq4g256", "mq4g256v2", "q8f16", "q4k"):
        raw = Q.quantize(rng.standard_normal((m, k)).astype(F32), fmt)
        x = rng.standard_normal((3, k)).astype(F32)
        x[0, :256] = 0.0
        x[0, 256:512] *= F32(1e-39)                 # subnormal
        x[0, 512:768] = F32(1e-44)                  # a few ulps of the smallest subnormal
        x[1] *= F32(1e-38)
        x[2] *= F32(1e30)
        want = model(raw, fmt, (m, k), x)
        for isa in ISAS:
            got = Q.prepare_gemv(raw, fmt, (m, k), isa=isa)(x)
            assert got.tobytes() == want.tobytes(), (fmt, isa)
        y = got.astype(np.float64)
        exact = exact_product(raw, fmt, (m, k), x)
        assert np.all(np.abs(y - exact) <= error_bound(raw, fmt, (m, k), x) * 1.0000001 + 1e-300)
        assert np.all(np.isfinite(y)) and np.any(y[1] != 0)


@pytest.mark.parametrize("fmt", ["hfq4g256", "hfq6g256", "q8f16", "q4k", "mq4g256v2"])
def test_a_span_whose_sum_could_overflow_is_refused(fmt):
    """Found by a review: x of ±2e38 (finite) gave Inf/NaN outputs of a finite product, the
    float32 sum of x over a span (step 1 of docs/formats/cpu-gemv.md) having overflowed.
    A span (of x', after the rotation for MQ) whose largest |value| is 2**127 / span or more
    is refused and nothing is written; just below it the result is the model's, finite
    and within the bound."""
    rng = np.random.default_rng(11)
    m, k = 20, 512
    raw = Q.quantize(rng.standard_normal((m, k)).astype(F32) * F32(0.01), fmt)
    g = Q.prepare_gemv(raw, fmt, (m, k))
    span = g.span
    limit = F32(2.0**127 / span)
    x = np.zeros((2, k), F32)
    x[1, 300:302] = (2e38, -2e38)
    out = np.full((2, m), 3.0, F32)
    message = ("overflows float32 when rotated" if g.rotated else
               rf"x\[1, 300\] is 2e\+38: the int8 GEMV takes \|x\| below 2\*\*127 / {span}")
    with pytest.raises(InvalidArgument, match=message):
        g(x, out=out, threads=2)
    assert np.all(out == 3.0)
    if not g.rotated:
        x = np.zeros((1, k), F32)
        x[0, 7] = limit
        with pytest.raises(InvalidArgument, match=r"x\[7\] is .*the int8 GEMV takes"):
            g(x[0], out=out[0])
        assert np.all(out == 3.0)
    # the largest magnitude taken: a whole span of it, alternating and constant
    edge = np.nextafter(limit, F32(0))
    x = np.zeros((2, k), F32)
    x[0, :span] = edge
    x[1, span:2 * span] = np.where(np.arange(span) % 2, edge, -edge)
    if g.rotated:  # x' = R x: a constant x over 256 becomes one value 16x as large
        x[0, :span] = edge / F32(16)
        x[1] = 0
        x[1, 0] = edge
        assert np.abs(_rotated(Q.resolve(fmt), x)).max() < limit
    want = model(raw, fmt, (m, k), x)
    for isa in ISAS:
        got = Q.prepare_gemv(raw, fmt, (m, k), isa=isa)(x)
        assert got.tobytes() == want.tobytes(), isa
    assert np.all(np.isfinite(got))
    exact = exact_product(raw, fmt, (m, k), x)
    assert np.all(np.abs(got.astype(np.float64) - exact) <= error_bound(raw, fmt, (m, k), x))


def test_matches_x_dot_dequantized_w_closely_on_gaussian_data():
    rng = np.random.default_rng(3)
    m, k = 256, 4096
    w = rng.standard_normal((m, k)).astype(F32)
    x = rng.standard_normal((2, k)).astype(F32)
    for fmt in ("hfq4g256", "mq4g256v2", "q8f16", "q4k"):
        raw = Q.quantize(w, fmt)
        y = Q.prepare_gemv(raw, fmt, (m, k))(x)
        ref = x.astype(np.float64) @ Q.dequantize(raw, fmt, (m, k)).astype(np.float64).T
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.01, fmt


def test_the_prepared_copy_does_not_depend_on_raw():
    rng = np.random.default_rng(4)
    raw = Q.quantize(rng.standard_normal((20, 256)).astype(F32), "mq4g256v2")
    x = rng.standard_normal(256).astype(F32)
    g = Q.prepare_gemv(raw, "mq4g256v2", (20, 256))
    want = g(x)
    raw[:] = 0
    del raw
    assert g(x).tobytes() == want.tobytes()


def test_calls_from_several_python_threads_agree():
    rng = np.random.default_rng(5)
    m, k = 200, 2048
    g = Q.prepare_gemv(Q.quantize(rng.standard_normal((m, k)).astype(F32), "hfq4g256"),
                       "hfq4g256", (m, k))
    xs = [rng.standard_normal((2, k)).astype(F32) for _ in range(4)]
    want = [g(x) for x in xs]
    got: list[list[bytes]] = [[] for _ in xs]

    def worker(i):
        for _ in range(20):
            got[i].append(g(xs[i], threads=2).tobytes())
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(len(xs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i, w in enumerate(want):
        assert got[i] == [w.tobytes()] * 20


def test_one_dimensional_x_out_and_empty_shapes():
    rng = np.random.default_rng(6)
    raw = Q.quantize(rng.standard_normal((17, 256)).astype(F32), "q8f16")
    g = Q.prepare_gemv(raw, "q8f16", (17, 256))
    x = rng.standard_normal(256).astype(F32)
    y = g(x)
    assert y.shape == (17,)
    out = np.full((17,), 7.0, F32)
    assert g(x, out=out) is out and out.tobytes() == y.tobytes()
    out2 = np.empty((3, 17), F32)
    assert np.array_equal(g(np.stack([x] * 3), out=out2), np.stack([y] * 3))
    for shape in ((0, 256), (5, 0)):
        e = Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", shape)
        assert np.array_equal(e(np.ones((2, shape[1]), F32)), np.zeros((2, shape[0]), F32))


def test_repr_and_properties():
    raw = Q.quantize(np.ones((40, 512), F32), "mq4g256v2")
    g = Q.prepare_gemv(raw, 44, (40, 512), threads=2)
    assert (g.fmt, g.qt_id, g.shape, g.m, g.k, g.span, g.threads, g.rotated) == (
        "mq4g256v2", 44, (40, 512), 40, 512, 128, 2, True)
    assert g.isa == prepared_gemv.default_isa()
    # 3 tiles x 4 spans: 16 rows x 64 code bytes, 16 f16 scales and minimums each
    assert g.nbytes == 3 * 4 * (16 * 64 + 2 * 16 * 2)
    assert repr(g) == (f"<PreparedGemv mq4g256v2 [40, 512]: 0.01 MiB prepared, x int8 per 128 "
                       f"after FWHT-256, kernel {g.isa}, threads=2>")
    assert isinstance(g, Q.PreparedGemv)


# ----------------------------------------------------------------------------- errors

def test_argument_errors_leave_out_untouched():
    rng = np.random.default_rng(8)
    raw = Q.quantize(rng.standard_normal((4, 512)).astype(F32), "mq4g256v2")
    g = Q.prepare_gemv(raw, "mq4g256v2", (4, 512))
    out = np.full((4,), 3.0, F32)
    x = np.ones(512, F32)
    for bad, exc, match in [
        (x.astype(np.float64), InvalidArgumentType, "float32"),
        (np.ones(256, F32), InvalidArgument, "K = 512"),
        (np.ones((2, 2, 512), F32), InvalidArgument, "K = 512"),
        (np.ones((0, 512), F32), InvalidArgument, "0 rows"),
        ([1.0] * 512, InvalidArgumentType, "ndarray"),
    ]:
        with pytest.raises(exc, match=match):
            g(bad, out=out)
    for value in (np.nan, np.inf):
        xb = x.copy()
        xb[300] = value
        with pytest.raises(InvalidArgument, match="finite"):
            g(xb, out=out)
    xb = np.full(512, 3e38, F32)
    with pytest.raises(InvalidArgument, match="overflows"):
        g(xb, out=out)
    assert np.all(out == 3.0)
    with pytest.raises(InvalidArgumentType, match="float32"):
        g(x, out=np.empty(4, np.float64))
    with pytest.raises(InvalidArgument, match="shape"):
        g(x, out=np.empty(5, F32))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        g(np.ones((2, 512), F32), out=np.empty((4, 2), F32).T)
    for threads, exc in ((0, InvalidArgument), (True, InvalidArgumentType),
                         (1.5, InvalidArgumentType)):
        with pytest.raises(exc, match="threads"):
            g(x, threads=threads)
    xn = np.ones((2, 512), F32)
    xn[1, 5] = np.nan
    with pytest.raises(InvalidArgument, match=r"x\[1, 5\]"):
        Q.prepare_gemv(Q.quantize(np.ones((4, 512), F32), "hfq4g256"), "hfq4g256", (4, 512))(xn)


def test_prepare_errors():
    raw = Q.quantize(np.ones((3, 384), F32), "hfq4g256")          # groups straddle rows
    with pytest.raises(InvalidArgument, match="multiple of the group size"):
        Q.prepare_gemv(raw, "hfq4g256", (3, 384))
    with pytest.raises(InvalidArgument, match="quantized formats"):
        Q.prepare_gemv(np.zeros(8, np.uint8), "f16", (2, 2))
    with pytest.raises(SizeMismatch):
        Q.prepare_gemv(raw[:-1], "hfq4g256", (3, 384))
    with pytest.raises(InvalidArgument, match="2-D"):
        Q.prepare_gemv(raw, "hfq4g256", (1152,))
    with pytest.raises(InvalidArgument, match="not a kernel name"):
        Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256), isa="sse9")
    with pytest.raises(InvalidArgumentType):
        Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256), isa=3)
    missing = [i for i in prepared_gemv.ISA_NAMES if i not in ISAS]
    if missing:
        with pytest.raises(InvalidArgument, match="does not run on this CPU"):
            Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256), isa=missing[0])
    with pytest.raises(InvalidArgument, match="threads"):
        Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256), threads=0)


def test_isa_names_and_the_environment_override(monkeypatch):
    assert ISAS[0] == "scalar" and set(ISAS) <= set(prepared_gemv.ISA_NAMES)
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "scalar")
    assert prepared_gemv.default_isa() == "scalar"
    assert Q.prepare_gemv(np.zeros(0, np.uint8), "q8f16", (0, 32)).isa == "scalar"
    monkeypatch.setenv("PAGEDKV_CPU_ISA", "bogus")
    with pytest.raises(InvalidArgument, match="'bogus' is not a kernel name"):
        Q.prepare_gemv(np.zeros(0, np.uint8), "q8f16", (0, 32))


def test_aligned_buffers_start_on_a_line_or_a_huge_page():
    """A cache line for small buffers; from 4 MiB on a 2 MiB boundary, so the transparent
    huge pages NumPy advises cover all of it (docs/performance.md, "Weights from DRAM")."""
    small = prepared_gemv.aligned_empty((3, 1000), np.float32)
    assert small.ctypes.data % 64 == 0 and small.shape == (3, 1000) and small.flags.c_contiguous
    big = prepared_gemv.aligned_empty((1024, 1024), np.float32)            # exactly 4 MiB
    assert big.ctypes.data % (2 << 20) == 0 and big.nbytes == 4 << 20
    just_under = prepared_gemv.aligned_empty(((4 << 20) - 64,), np.uint8)
    assert just_under.ctypes.data % 64 == 0
    # a prepared copy's arrays are allocated the same way: its results do not depend on it
    w = np.random.default_rng(3).standard_normal((1024, 4096)).astype(np.float32)
    raw = Q.quantize(w, "hfq4g256")
    g = Q.prepare_gemv(raw, "hfq4g256", (1024, 4096))
    assert g.nbytes == 1024 * 4096 // 2 + 2 * 4 * 1024 * 16
    x = np.random.default_rng(4).standard_normal((2, 4096)).astype(np.float32)
    assert np.array_equal(g(x), Q.prepare_gemv(raw, "hfq4g256", (1024, 4096))(x))


def test_a_built_prepared_gemv_refuses_a_second_init_and_huge_thread_counts():
    # A second __init__ freed the codes a call on another thread was reading (a segfault
    # under a concurrent caller, found by a review); threads=2**31 leaked OverflowError.
    raw = Q.quantize(np.ones((8, 256), F32), "hfq4g256")
    g = Q.prepare_gemv(raw, "hfq4g256", (8, 256))
    x = np.ones(256, F32)
    want = g(x).tobytes()
    with pytest.raises(InvalidArgument, match="read-only once built"):
        g.__init__(Q.quantize(np.ones((16, 256), F32), "hfq4g256"), "hfq4g256", (16, 256))
    assert g.shape == (8, 256) and g(x).tobytes() == want
    blank = prepared_gemv.PreparedGemv.__new__(prepared_gemv.PreparedGemv)
    with pytest.raises(InvalidArgument, match="never built"):
        blank(x)
    for call in (lambda: Q.prepare_gemv(raw, "hfq4g256", (8, 256), threads=2**31),
                 lambda: g(x, threads=2**63),
                 lambda: Q.dequantize(raw, "hfq4g256", (8, 256), threads=2**31)):
        with pytest.raises(InvalidArgument, match="at most 65536"):
            call()
    assert g(x, threads=prepared_gemv.MAX_THREADS).tobytes() == want


def test_an_empty_m_still_refuses_a_non_finite_x():
    """With M = 0 the call returned an empty result for an x holding NaN or Inf, where
    the docs promise InvalidArgument for it (and gemv() refuses it at M = 0)."""
    g = Q.prepare_gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256))
    x = np.ones((2, 256), F32)
    x[1, 5] = np.inf
    out = np.empty((2, 0), F32)
    with pytest.raises(InvalidArgument, match=r"x\[1, 5\] is inf; the GEMV takes finite"):
        g(x, out=out)
    with pytest.raises(InvalidArgument, match=r"x\[7\] is nan; the GEMV takes finite"):
        g(np.where(np.arange(256) == 7, np.nan, 1.0).astype(F32))
    with pytest.raises(InvalidArgument, match="gemv takes finite activations only"):
        Q.gemv(np.zeros(0, np.uint8), "hfq4g256", (0, 256), x)
    assert g(np.ones((2, 256), F32)).shape == (2, 0)


def test_copy_pickle_and_an_unbuilt_object_say_what_they_are():
    """copy.copy, copy.deepcopy and pickle raised Cython's bare TypeError 'self._w cannot
    be converted to a Python object for pickling'; repr and nbytes of an object whose
    __init__ never ran raised AttributeError. A PreparedGemv is read-only, so a copy is the
    object itself; pickling raises InvalidArgumentType (a TypeError, as pickle expects)
    saying to prepare again from raw; an unbuilt object has nbytes 0 and says so in repr."""
    import copy
    import pickle
    raw = Q.quantize(np.ones((8, 256), F32), "hfq4g256")
    g = Q.prepare_gemv(raw, "hfq4g256", (8, 256))
    assert copy.copy(g) is g and copy.deepcopy(g) is g
    assert copy.deepcopy([g, g])[0] is g
    with pytest.raises(InvalidArgumentType, match="a PreparedGemv cannot be pickled.*"
                                                  "prepare_gemv"):
        pickle.dumps(g)
    blank = prepared_gemv.PreparedGemv.__new__(prepared_gemv.PreparedGemv)
    assert blank.nbytes == 0
    assert repr(blank) == "<PreparedGemv (not built: use prepare_gemv)>"

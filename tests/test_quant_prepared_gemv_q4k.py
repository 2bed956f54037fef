"""PreparedGemv of Q4K (GGML Q4_K) weights: what is particular to it. Its sub-blocks of 32
become spans with f32 d * sc and -(dmin * m) (docs/formats/cpu-gemv.md); the generic
tests (test_quant_prepared_gemv.py) run it through the bit-exact model on every kernel
and the error bound. Here: the result against x · dequantize(W)ᵀ on Q4K blocks of every
6-bit scale and minimum, and the bad inputs."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv.quant as Q
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SizeMismatch
from pagedkv.quant import prepared_gemv
from test_quant_prepared_gemv import error_bound, exact_product, model

F32 = np.float32
ISAS = prepared_gemv.supported_isas()


def _random_q4k_blocks(rng, m, k):
    """Arbitrary Q4K bytes (not the encoder's choices): every 6-bit scale and minimum,
    finite positive f16 d and dmin of any magnitude, random nibbles."""
    blocks = rng.integers(0, 256, (m * k // 256, 144), dtype=np.uint8)
    e = rng.integers(-14, 4, (blocks.shape[0], 2)).astype(np.float64)
    d = (rng.uniform(1, 2, e.shape) * 2.0**e).astype(np.float16)
    blocks[:, 0:4] = d.view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_arbitrary_blocks_match_the_model_and_the_bound_on_every_kernel(seed):
    rng = np.random.default_rng(seed)
    m, k = 45, 768
    raw = _random_q4k_blocks(rng, m, k)
    x = rng.standard_normal((5, k)).astype(F32)
    x[4, rng.integers(0, k, 6)] *= F32(30)
    want = model(raw, "q4k", (m, k), x)
    for isa in ISAS:
        assert Q.prepare_gemv(raw, "q4k", (m, k), isa=isa)(x).tobytes() == want.tobytes(), isa
    exact = exact_product(raw, "q4k", (m, k), x)
    assert np.all(np.abs(want.astype(np.float64) - exact) <= error_bound(raw, "q4k", (m, k), x))


def test_encoded_weights_stay_close_to_the_float_product():
    rng = np.random.default_rng(14)
    m, k = 128, 4096
    raw = Q.quantize(rng.standard_normal((m, k)).astype(F32), "q4k")
    x = rng.standard_normal((3, k)).astype(F32)
    g = Q.prepare_gemv(raw, "q4k", (m, k))
    assert (g.span, g.fmt, g.qt_id) == (32, "q4k", 4)
    # 16 rows x 16 code bytes per (tile, span) and a byte each of scale and minimum per
    # row; per 8 spans (a super-block) an f32 d and -dmin per row
    assert g.nbytes == (m // 16) * (k // 32) * 16 * (16 + 2) + (m // 16) * (k // 256) * 16 * 8
    ref = x.astype(np.float64) @ Q.dequantize(raw, "q4k", (m, k)).astype(np.float64).T
    assert np.linalg.norm(g(x) - ref) / np.linalg.norm(ref) < 0.01


def test_bad_inputs_raise_and_change_nothing():
    rng = np.random.default_rng(15)
    raw = Q.quantize(rng.standard_normal((4, 512)).astype(F32), "q4k")
    before = raw.copy()
    straddling = np.zeros(6 * 144, np.uint8)         # (4, 384): super-blocks straddle rows
    with pytest.raises(InvalidArgument, match="multiple of the group size"):
        Q.prepare_gemv(straddling, "q4k", (4, 384))
    with pytest.raises(SizeMismatch):
        Q.prepare_gemv(raw[:-1], "q4k", (4, 512))
    with pytest.raises(SizeMismatch):
        Q.prepare_gemv(raw, "q4k", (4, 768))
    with pytest.raises(InvalidArgumentType, match="uint8"):
        Q.prepare_gemv(raw.view(np.int8), "q4k", (4, 512))
    assert raw.tobytes() == before.tobytes()
    g = Q.prepare_gemv(raw, "q4k", (4, 512))
    out = np.full(4, 3.0, F32)
    x = rng.standard_normal(512).astype(F32)
    for bad, exc in ((x.astype(np.float64), InvalidArgumentType), (x[:256], InvalidArgument),
                     (np.where(np.arange(512) == 40, np.nan, x).astype(F32), InvalidArgument)):
        with pytest.raises(exc):
            g(bad, out=out)
    assert np.all(out == 3.0) and raw.tobytes() == before.tobytes()
    assert g(x, out=out) is out and out.tobytes() == g(x).tobytes()

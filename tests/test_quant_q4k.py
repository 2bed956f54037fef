"""Q4K (qt 4 = GGML Q4_K) encoding: byte for byte llama.cpp's ``quantize_row_q4_K_ref``.

Two oracles (tests/ggml_q4k_reference.py says how to provide the first and how the second
was made): ggml's own C through ctypes, on fresh random inputs of every kind of
``ggml_q4k_reference.KINDS`` (skipped, saying why, without it), and known-answer vectors,
ggml's bytes for 36 super-blocks stored in tests/data/q4k_ggml_vectors.npz, which need
nothing. Then the round trip's error, the refusals (non-finite weights, an f16 d or dmin
that would overflow: exactly where ggml writes Inf) and bad arguments.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest

import ggml_q4k_reference as R
import p2_oracle as O
from pagedkv import quant as Q
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant import legacy

F32 = np.float32


@pytest.fixture(scope="module")
def ggml(tmp_path_factory):
    quantize, why = R.load(tmp_path_factory.mktemp("ggml"))
    if quantize is None:
        pytest.skip(why)
    return quantize


def _blocks(raw: bytes | np.ndarray) -> np.ndarray:
    return np.frombuffer(bytes(raw), np.uint8).reshape(-1, R.BLOCK_BYTES)


def _assert_same_bytes(x: np.ndarray, ours: np.ndarray, theirs: bytes, what: str) -> None:
    if ours.tobytes() != theirs:
        bad = np.flatnonzero((_blocks(ours) != _blocks(theirs)).any(axis=1))
        raise AssertionError(f"{what}: super-blocks {bad[:8].tolist()} of {len(x)} differ from "
                             f"ggml; first input {x.reshape(-1, R.QK_K)[bad[0]][:8]}...")


# --- known answers (no ggml needed) -------------------------------------------------------


def test_known_answer_vectors_are_ggml_bytes():
    kat = np.load(R.VECTORS)
    x, raw = kat["x"], kat["raw"]
    assert set(kat["kinds"]) == set(R.KINDS) and raw.shape == (len(x), R.BLOCK_BYTES)
    _assert_same_bytes(x, Q.quantize(x, "q4k"), raw.tobytes(), "vectors")
    # one row of all of them, and the qt id
    _assert_same_bytes(x, Q.quantize(x.reshape(1, -1), 4), raw.tobytes(), "one row")
    np.testing.assert_array_equal(Q.dequantize(raw, "q4k", x.shape),
                                  O.q4k_decode(raw, x.size).reshape(x.shape))


def test_known_answer_vectors_are_current():
    """The vectors are what ggml_q4k_reference.inputs makes today (their seed is 1000), so
    a change to the generator cannot leave the file describing other inputs."""
    kat = np.load(R.VECTORS)
    np.testing.assert_array_equal(
        kat["x"], np.concatenate([R.inputs(kind, 1000, 4) for kind in R.KINDS]))


# --- ggml itself on fresh inputs ----------------------------------------------------------

FRESH = secrets.randbits(32)


@pytest.mark.parametrize("kind", R.KINDS)
@pytest.mark.parametrize("seed", [*range(8), FRESH])
def test_bytes_equal_ggml(ggml, kind, seed):
    """64 super-blocks of each kind per seed: 8 fixed seeds and one fresh per run."""
    x = R.inputs(kind, seed, 64)
    _assert_same_bytes(x, Q.quantize(x, "q4k"), ggml(x), f"{kind}, seed {seed}")


@pytest.mark.parametrize("shape", [(3, 512), (2, 3, 256), (1, 4096), (256,)])
def test_rows_and_shapes_equal_ggml(ggml, shape):
    x = R.inputs("heavy-tailed", 7, int(np.prod(shape)) // R.QK_K).reshape(shape)
    _assert_same_bytes(x, Q.quantize(x, "q4k"), ggml(x), f"shape {shape}")
    # float16 input widens exactly: ggml's bytes of the widened values
    h = x.astype(np.float16)
    _assert_same_bytes(h, Q.quantize(h, "q4k"), ggml(h.astype(F32)), "float16")


def test_f16_limit_refused_exactly_where_ggml_writes_inf(ggml):
    """Blocks spanning about 63·65504·15 ≈ 6.2e7: ggml's d rounds to f16 inf on some. pagedkv
    refuses exactly those and writes ggml's bytes for the rest."""
    rng = np.random.default_rng(FRESH)
    spans = np.linspace(5.6e7, 6.6e7, 40)
    x = (rng.uniform(0, 1, (40, R.QK_K)) * spans[:, None]).astype(F32)
    x[::3] *= -1                                     # dmin's limit too
    theirs = _blocks(ggml(x))
    d = theirs[:, 0:2].copy().view(np.float16)[:, 0]
    dmin = theirs[:, 2:4].copy().view(np.float16)[:, 0]
    inf = ~(np.isfinite(d) & np.isfinite(dmin))
    assert 0 < inf.sum() < len(x)
    for i in range(len(x)):
        if inf[i]:
            with pytest.raises(InvalidArgument, match=r"group 0 .*cannot be stored in q4k"):
                Q.quantize(x[i], "q4k")
        else:
            assert Q.quantize(x[i], "q4k").tobytes() == theirs[i].tobytes()


# --- the round trip -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_round_trip_error(seed):
    """ggml q4_K's own error: relative RMS about 0.073 on Gaussian weights (docs/formats/
    quant.md, "Quality"); every weight within one step d·sc of its sub-block plus the
    6-bit minimum's rounding, and no code clamps off more than that."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((64, 1024)) * np.exp(rng.standard_normal((64, 1)))).astype(F32)
    raw = Q.quantize(w, "q4k")
    w_hat = Q.dequantize(raw, "q4k", w.shape)
    np.testing.assert_array_equal(w_hat.reshape(-1), O.q4k_decode(raw, w.size))
    w64 = w.astype(np.float64)
    rel = np.sqrt(((w_hat - w64) ** 2).sum(axis=1) / (w64 ** 2).sum(axis=1))
    assert rel.max() < 0.085 and 0.06 < rel.mean() < 0.08, rel
    # per sub-block: |err| <= step (d * sc): the 6-bit scale and min are rounded, so a code
    # can land a little beyond half a step; one whole step bounds it
    blocks = _blocks(raw)
    d = blocks[:, 0:2].copy().view(np.float16)[:, 0].astype(np.float64)
    sc = np.array([[_scale(b, j) for j in range(8)] for b in blocks], np.float64)
    step = np.repeat(d[:, None] * sc, 32, axis=1).reshape(w.shape)
    assert (np.abs(w_hat - w) <= step).all()


def _scale(blk: np.ndarray, j: int) -> int:
    s = blk[4:16]
    return int(s[j] & 63) if j < 4 else int((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4))


def test_special_blocks():
    """All zero: zero bytes but for the codes ggml leaves, decoding to zeros; a constant
    block decodes to within one step; the empty tensor is empty."""
    raw = Q.quantize(np.zeros((2, 256), F32), "q4k")
    assert not raw.any()
    c = np.full((1, 256), -3.25, F32)
    assert np.abs(Q.dequantize(Q.quantize(c, "q4k"), "q4k", c.shape) - c).max() < 3.25 / 63
    assert Q.quantize(np.zeros((0, 256), F32), "q4k").size == 0


# --- refusals and bad arguments -----------------------------------------------------------


def test_non_finite_weights_are_refused_and_input_kept():
    x = R.inputs("gaussian", 0, 4).reshape(2, 512)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[1, 300] = bad
        with pytest.raises(InvalidArgument, match=r"non-finite value .* at index \(1, 300\)"):
            Q.quantize(y, "q4k")
        np.testing.assert_array_equal(y[0], x[0])    # the input is not touched
        assert np.isnan(y[1, 300]) or np.isinf(y[1, 300])


def test_bad_arguments():
    with pytest.raises(InvalidArgument, match="multiple of 256.*got shape \\(2, 384\\)"):
        Q.quantize(np.zeros((2, 384), F32), "q4k")
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        Q.quantize(np.zeros(300, F32), "q4k")
    with pytest.raises(InvalidArgumentType, match="float32 or float16, got float64"):
        Q.quantize(np.zeros((1, 256)), "q4k")
    with pytest.raises(InvalidArgument, match="whole super-blocks"):
        legacy.q4k_encode(np.zeros(300, F32), np.zeros(144, np.uint8))
    with pytest.raises(InvalidArgument, match="needs 288"):
        legacy.q4k_encode(np.zeros(512, F32), np.zeros(144, np.uint8))

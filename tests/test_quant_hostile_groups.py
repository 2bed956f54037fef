"""Groups at the edges of float32 (issue 10): subnormal spans coded as hipfire codes them,
finite weights no format can store refused instead of written as Inf/NaN, and shapes
NumPy cannot allocate refused with InvalidArgument (docs/formats/quant.md, "Groups the
codecs refuse" and "Subnormal spans")."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pagedkv
import pagedkv.quant as Q
from pagedkv.errors import InvalidArgument
from pagedkv.quant import affine
from pagedkv.quant.affine import AffineFamily
from pagedkv.quant.fwht import sign_table

pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

F32 = np.float32
V1 = sorted(c.name for c in Q.CODECS.values()
            if c.kind == "affine" and c.family in (AffineFamily.HFQ, AffineFamily.MQ_V1))
# every format quantize writes (decode-only ones have no encoder to refuse anything)
GROUPED = sorted(c.name for c in Q.CODECS.values() if c.kind != "raw" and c.encodes)
# groups of G that the refusal message names (the row formats name a whole row:
# tests/test_quant_p2.py)
GROUPS_OF_G = [n for n in GROUPED if not Q.resolve(n).row_multiple]
TINY = F32(2.0**-149)           # the smallest subnormal


def hipfire_v1_group(x: np.ndarray, bits: int, group: int) -> bytes:
    """hipfire's v1 group encoder, step for step in f32: ``((x - min)·inv + 0.5) as u8``
    then ``.min(L)``; Rust's ``as u8`` truncates, saturates at 0 and 255, and maps NaN
    to 0 (crates/hipfire-quantize: quantize_hfq4g256 and its 2/3/5/6-bit siblings)."""
    L = F32(2**bits - 1)
    mn, mx = x.min(), x.max()
    rng = F32(mx - mn)
    if rng > 0:
        scale = F32(rng / L)
        with np.errstate(divide="ignore", over="ignore"):
            inv = F32(F32(1) / scale)
    else:
        scale, inv = F32(1), F32(0)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x - mn) * inv + F32(0.5)
    as_u8 = np.where(np.isnan(v), 0, np.minimum(np.trunc(np.nan_to_num(v, posinf=255)), 255))
    q = np.zeros(group, np.uint8)
    q[:x.size] = np.minimum(as_u8, L).astype(np.uint8)
    return scale.tobytes() + mn.tobytes() + affine.pack_codes(q, bits)


def hipfire_reference(x: np.ndarray, name: str) -> bytes:
    codec = Q.resolve(name)
    if codec.rotated:                       # zero-pad, rotate (bit-exact with hipfire's FWHT)
        x = Q.fwht256(np.concatenate([x, np.zeros(256 - x.size, F32)]))
    return hipfire_v1_group(x, codec.bits, codec.group_size)


def subnormal_groups(size: int) -> list[np.ndarray]:
    """Groups whose span is subnormal, or normal with a subnormal scale: 1/scale overflows
    to inf and (min - min)·inf is NaN for every element equal to the minimum."""
    one = np.zeros(size, F32)
    one[1] = F32(1.1755e-41)
    mixed = np.zeros(size, F32)
    mixed[::3] = TINY * F32(7)
    mixed[1::5] = -TINY * F32(3)
    ramp = (np.arange(size, dtype=F32) % 5) * TINY
    normal_span = np.zeros(size, F32)         # span 2e-38 is normal, span/L is subnormal
    normal_span[size // 2] = F32(2e-38)
    return [one, mixed, ramp, normal_span]


@pytest.mark.parametrize("name", V1)
def test_subnormal_span_groups_are_byte_identical_to_hipfire(name):
    codec = Q.resolve(name)
    for x in subnormal_groups(codec.group_size):
        assert Q.quantize(x, name).tobytes() == hipfire_reference(x, name), name
    # a short last group (zero-padded codes): the same rule over its real elements
    x = subnormal_groups(codec.group_size)[1][:100]
    tail = Q.quantize(np.concatenate([np.ones(codec.group_size, F32), x]), name)
    assert tail[codec.group_bytes:].tobytes() == hipfire_reference(x, name)


def test_subnormal_span_minimum_is_code_0_and_decodes_exactly():
    x = subnormal_groups(128)[0]               # zeros and one subnormal
    raw = Q.quantize(x, "hfq2g128")
    assert raw[8] == 0b0000_1100               # codes 0, 3, 0, 0: only x[1] is at the top
    back = Q.dequantize(raw, "hfq2g128", 128)
    assert not back[x == 0].any()              # the minimum decodes exactly
    assert abs(back[1] - x[1]) <= 2 * TINY     # q·scale rounds among subnormals


def hipfire_q8f16_codes(x: np.ndarray) -> np.ndarray:
    """``(x·inv).round().max(-128.0).min(127.0) as i8``: f32::max returns the non-NaN
    operand, so NaN (0·inf) is -128."""
    amax = np.abs(x).max()
    scale = F32(amax / F32(127))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        inv = F32(F32(1) / scale) if scale > 0 else F32(0)
        v = x * inv
        r = np.where(np.abs(v - np.trunc(v)) >= 0.5, np.trunc(v) + np.sign(v), np.trunc(v))
    return np.where(np.isnan(v), -128, np.clip(np.nan_to_num(r, posinf=127, neginf=-128),
                                               -128, 127)).astype(np.int8)


def test_q8f16_block_with_a_subnormal_scale_codes_like_hipfire():
    x = np.zeros(32, F32)
    x[3], x[4] = F32(3e-37), F32(-1e-38)       # scale 2.4e-39 is subnormal: inv = inf
    raw = Q.quantize(x, "q8f16")
    assert np.array_equal(raw[2:].view(np.int8), hipfire_q8f16_codes(x))
    assert raw[2 + 0] == 0x80 and raw[2 + 3] == 127 and raw[2 + 4] == 0x80


C_Q8_NAN = r"""
#include <pagedkv/quant.h>
int main(void) {
    /* both NaN signs: x86's default NaN is negative, ARM's positive */
    if (pkv_round_q8(pkv_f32_from_bits(0x7FC00000u)) != -128) return 1;
    if (pkv_round_q8(pkv_f32_from_bits(0xFFC00000u)) != -128) return 2;
    return 0;
}
"""


def test_q8_nan_code_does_not_depend_on_the_nan_sign(tmp_path):
    """What the C text gives for a NaN argument, for both signs of NaN: the CPU codecs on
    x86 only ever see the negative one (0·inf there is the negative default NaN), ARM and
    Metal the positive one."""
    if shutil.which("cc") is None:
        pytest.skip("cc not found")
    src, exe = tmp_path / "q8nan.c", tmp_path / "q8nan"
    src.write_text(C_Q8_NAN)
    subprocess.run(["cc", "-std=c11", "-O1", "-ffp-contract=off", f"-I{pagedkv.get_include()}",
                    str(src), "-o", str(exe)], check=True, timeout=120)
    assert subprocess.run([str(exe)], check=False).returncode == 0


# --- finite weights that no format can store ------------------------------------------------


@pytest.mark.parametrize("name", GROUPS_OF_G)
def test_group_arithmetic_overflow_is_refused_naming_the_group(name):
    codec = Q.resolve(name)
    g = codec.group_size
    x = np.ones((2, 2 * max(g, 256)), F32)     # 4+ groups; the overflowing one is on row 1
    x[1, g:g + 2] = [F32(3e38), F32(-3e38)]
    per_row = x.shape[1] // g
    with pytest.raises(InvalidArgument) as info:
        Q.quantize(x, name)
    text = str(info.value)
    assert f"group {per_row + 1} " in text and f"(1, {g})..(1, {2 * g - 1})" in text
    assert "[-3e+38, 3e+38]" in text and f"cannot be stored in {name}" in text


def _boundary_group(pattern: str, value: float) -> np.ndarray:
    x = np.zeros(256, F32)
    if pattern == "pair":
        x[0], x[1] = F32(value), F32(-value)
    else:   # "aligned": x·D1 is constant, so the FWHT puts 16·value into one coefficient
        x[:] = F32(value) * sign_table(42, 256)
    return x


@pytest.mark.parametrize("name,pattern,value,stored", [
    ("hfq4g256", "pair", 1.7e38, True),      # range 3.4e38 still fits f32, decodes finite
    ("hfq4g256", "pair", 3e38, False),
    ("mq4g256", "aligned", 4e34, True),      # stored 16·4e34 = 6.4e35 < 2**119
    ("mq4g256", "aligned", 5e34, False),     # stored 8e35: the inverse FWHT could overflow
    ("mq4g256", "pair", 5e36, True),         # rotated to 0 or ±2·5e36/16 = ±6.25e35
    ("mq4g256", "aligned", 1e37, False),     # the forward FWHT overflows (2.6e39)
    ("mq4g256v2", "aligned", -4000, True),   # rotated min -64000 fits the f16 zero point
    ("mq4g256v2", "aligned", -5000, False),  # rotated min -80000 does not
    ("mq4g256v2", "aligned", 5000, True),    # max 80000 is fine: zero 0, step 5333
    ("mq4cg256", "aligned", -4000, True),
    ("mq4cg256", "aligned", -5000, False),
    ("q8f16", "pair", 8e6, True),            # scale 8e6/127 = 62992 fits f16
    ("q8f16", "pair", 9e6, False),           # scale 70866 does not
])
def test_refusal_boundary(name, pattern, value, stored):
    x = _boundary_group(pattern, value)
    if stored:
        back = Q.dequantize(Q.quantize(x, name), name, 256)
        assert np.isfinite(back).all()
    else:
        with pytest.raises(InvalidArgument, match="cannot be stored"):
            Q.quantize(x, name)


def test_raw_f16_keeps_the_spec_truncation_to_inf():
    x = np.array([1e5, -7e4, 65504], F32)
    back = Q.dequantize(Q.quantize(x, "f16"), "f16", 3)
    assert back.tolist() == [np.inf, -np.inf, 65504.0]


F32_MAX = float(np.finfo(F32).max)


@given(st.sampled_from(GROUPED), hnp.arrays(F32, 512, elements=st.floats(
    -F32_MAX, F32_MAX, width=32, allow_nan=False, allow_infinity=False)))
def test_every_stored_group_decodes_finite(name, x):
    """Any finite input: quantize refuses it with InvalidArgument, or every weight of
    what it stored decodes to a finite value."""
    try:
        raw = Q.quantize(x, name)
    except InvalidArgument as exc:
        assert "cannot be stored" in str(exc)
        return
    assert np.isfinite(Q.dequantize(raw, name, x.shape)).all()


def test_encode_reports_the_group_it_cannot_store():
    x = np.ones(1024, F32)
    x[600] = F32(3e38)
    x[601] = F32(-3e38)
    out = np.empty(4 * 136, np.uint8)
    assert affine.encode(x, out, AffineFamily.HFQ, 4, 256) == -2 - 2
    x[5] = np.nan                              # a NaN earlier wins: its index
    assert affine.encode(x, out, AffineFamily.HFQ, 4, 256) == 5


# --- shapes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 2**62), (2**61, 0, 4), (2**62,)])
def test_dequantize_refuses_shapes_numpy_cannot_allocate(shape):
    with pytest.raises(InvalidArgument, match="too large"):
        Q.dequantize(b"", "hfq4g256", shape)


def test_zero_size_shapes_that_fit_still_decode():
    assert Q.dequantize(b"", "hfq4g256", (0, 2**40)).shape == (0, 2**40)
    assert Q.dequantize(b"", "f32", (3, 0)).shape == (3, 0)

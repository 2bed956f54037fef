"""Misaligned buffers (an HFQM payload at an odd file offset, a float32 view at an odd byte
offset) never reach a typed pointer read in the Cython codecs: the public calls copy them to
aligned storage, and the raw half-precision loops refuse them (docs/reliability.md,
"Sanitizers": UBSan reported the misaligned uint16 load this pins)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.errors import InvalidArgument
from pagedkv.quant import half


def _misaligned(raw: np.ndarray, shift: int = 1) -> np.ndarray:
    buf = np.zeros(raw.nbytes + 8, np.uint8)
    base = (-buf.ctypes.data) % 8 + shift  # an address that is 1 past 8-byte alignment
    view = buf[base:base + raw.nbytes]
    view[:] = raw.view(np.uint8).reshape(-1)
    return view


@pytest.mark.parametrize("fmt", ["f16", "bf16", "f32"])
def test_dequantize_of_a_payload_at_an_odd_offset_equals_the_aligned_one(fmt):
    x = np.random.default_rng(7).standard_normal((4, 64)).astype(np.float32)
    raw = quant.quantize(x, fmt)
    odd = _misaligned(raw)
    assert odd.ctypes.data % 2 == 1
    got = quant.dequantize(odd, fmt, x.shape)
    assert np.array_equal(got.view(np.uint32), quant.dequantize(raw, fmt, x.shape).view(np.uint32))


@pytest.mark.parametrize("fmt", ["f16", "hfq4g256", "q8f16"])
def test_quantize_of_a_misaligned_float32_view_is_byte_equal(fmt):
    x = np.random.default_rng(8).standard_normal(512).astype(np.float32)
    odd = _misaligned(x).view(np.float32)
    assert not odd.flags.aligned
    assert np.array_equal(quant.quantize(odd, fmt), quant.quantize(x, fmt))


@pytest.mark.parametrize("fn", [half.f16_to_f32, half.bf16_to_f32])
def test_half_widening_refuses_a_misaligned_input_and_writes_nothing(fn):
    h = _misaligned(np.arange(8, dtype=np.uint16)).view(np.uint16)
    out = np.full(8, 7.0, np.float32)
    with pytest.raises(InvalidArgument, match="h is not 2-byte aligned"):
        fn(h, out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("fn", [half.f16_trunc, half.f16_rne, half.bf16_trunc])
def test_half_narrowing_refuses_a_misaligned_input_and_writes_nothing(fn):
    x = _misaligned(np.ones(8, np.float32)).view(np.float32)
    out = np.full(8, 9, np.uint16)
    with pytest.raises(InvalidArgument, match="x is not 4-byte aligned"):
        fn(x, out)
    assert (out == 9).all()

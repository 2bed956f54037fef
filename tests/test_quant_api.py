"""pagedkv.quant API contract: format names and ids, argument validation, errors."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv.quant as Q
from pagedkv.errors import (
    InvalidArgument,
    InvalidArgumentType,
    SizeMismatch,
    UnknownQuantType,
    UnsupportedQuantType,
)

# MQ2G256V2 warns on every encode (quality-rejected upstream); test_quant_kat checks it
pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

P1_NAMES = ["f16", "f32", "bf16", "q8f16", "hfq4g256", "hfq4g128", "hfq6g256", "hfq2g256",
            "hfq2g128", "hfq3g256", "hfq3g128", "mq4g256", "mq6g256", "mq3g256", "mq2g256",
            "mq5g256", "mq4g256v2", "mq4cg256", "mq6g256v2", "mq5g256v2", "mq3g256v2",
            "mq2g256v2", "mq2g256lloyd", "mq3g256lloyd", "mq4g256lloyd", "mq2g256lloydu",
            # P2 formats (docs/formats/quant.md, "P2 formats")
            "hfp4g32", "mfp4g32", "mfp4g32p", "mq2g256gl", "mq3g256gl", "mq8g256", "q8hfq",
            "q4f16g64", "q4k", "tq2g128", "bq1g128"]
ENCODABLE = [n for n in P1_NAMES if n not in ("tq2g128", "bq1g128")]   # decode-only


def test_every_p1_format_is_implemented_by_name_and_id():
    assert sorted(c.name for c in Q.CODECS.values()) == sorted(P1_NAMES)
    for name in P1_NAMES:
        codec = Q.resolve(name)
        assert Q.resolve(codec.qt.id) is codec
        assert Q.resolve(name.upper()) is codec
        assert Q.resolve(np.uint8(codec.qt.id)) is codec


def test_unknown_and_unsupported_formats():
    with pytest.raises(UnknownQuantType, match="'hfq9'"):
        Q.quantize(np.zeros(256, np.float32), "hfq9")
    for qt in (23, 42, 43, 46, 200):
        with pytest.raises(UnknownQuantType, match=str(qt)):
            Q.resolve(qt)
    for fmt in ("paro4g128", 29, "mfp4g32lloyd", 130):
        with pytest.raises(UnsupportedQuantType, match="registered"):
            Q.dequantize(np.zeros(0, np.uint8), fmt, (0,))
    with pytest.raises(InvalidArgumentType):
        Q.resolve(6.0)
    with pytest.raises(InvalidArgumentType):
        Q.resolve(True)


@pytest.mark.parametrize("name", ENCODABLE)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_is_rejected_with_its_index(name, bad):
    x = np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256)
    x[1, 7] = bad
    before = x.copy()
    with pytest.raises(InvalidArgument, match=r"non-finite value .* at index \(1, 7\)"):
        Q.quantize(x, name)
    assert np.array_equal(x, before, equal_nan=True)


def test_input_type_and_shape_errors():
    with pytest.raises(InvalidArgumentType, match="float64"):
        Q.quantize(np.zeros(256), "hfq4g256")
    with pytest.raises(InvalidArgumentType, match="list"):
        Q.quantize([0.0] * 256, "hfq4g256")
    with pytest.raises(InvalidArgument, match="0-d"):
        Q.quantize(np.array(1.0, np.float32), "f32")
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        Q.quantize(np.zeros((2, 128), np.float32), "mq4g256v2")
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        Q.dequantize(np.zeros(136, np.uint8), "mq4cg256", (2, 128))
    with pytest.raises(InvalidArgument, match=r"rows of 256"):
        Q.fwht256(np.zeros((3, 128), np.float32))


def test_size_and_dtype_errors_on_decode():
    raw = Q.quantize(np.ones(512, np.float32), "hfq4g256")
    with pytest.raises(SizeMismatch, match="271 bytes.*needs 272"):
        Q.dequantize(raw[:-1], "hfq4g256", (512,))
    with pytest.raises(SizeMismatch):
        Q.dequantize(raw, "hfq4g256", (2, 257))
    with pytest.raises(InvalidArgumentType, match="uint8"):
        Q.dequantize(raw.view(np.int8), "hfq4g256", (512,))
    with pytest.raises(InvalidArgument, match="shape"):
        Q.dequantize(raw, "hfq4g256", (-1, 512))
    with pytest.raises(InvalidArgument, match="basis"):
        Q.dequantize(raw, "hfq4g256", (512,), basis="stored")
    with pytest.raises(InvalidArgument, match="whole rotated groups"):
        Q.dequantize(Q.quantize(np.ones(300, np.float32), "mq4g256"), "mq4g256", (300,),
                     basis="rotated")
    # bytes-like input is accepted as is
    assert np.array_equal(Q.dequantize(raw.tobytes(), "hfq4g256", 512), np.ones(512, np.float32))


@pytest.mark.parametrize("name", ENCODABLE)
def test_shapes_sizes_and_empty(name):
    codec = Q.resolve(name)
    x = np.linspace(-2, 3, 3 * 512, dtype=np.float32).reshape(3, 512)
    raw = Q.quantize(x, name)
    if codec.row_multiple:     # FP4 and Q8HFQ rows: their own size rule (tests/test_quant_p2.py)
        assert raw.size == codec.payload_nbytes(x.shape)
    else:
        assert raw.size == codec.nbytes(x.size) == -(-x.size // codec.group_size) * codec.group_bytes
    out = Q.dequantize(raw, name, x.shape)
    assert out.shape == x.shape and out.dtype == np.float32
    empty = Q.quantize(np.zeros((0, 256), np.float32), name)
    assert empty.size == 0
    assert Q.dequantize(empty, name, (0, 256)).shape == (0, 256)


def test_raw_formats_round_trip():
    x = np.array([1.0, -2.5, 65504.0, 1e-7, 0.1], np.float32)
    assert np.array_equal(Q.dequantize(Q.quantize(x, "f32"), "f32", 5), x)
    h = x.astype(np.float16)
    assert np.array_equal(Q.quantize(h, "f16").view(np.float16), h)  # f16 sources copied
    assert np.array_equal(Q.dequantize(Q.quantize(h, "f16"), "f16", 5), h.astype(np.float32))
    # f32 -> f16 truncates toward zero: 0.1 -> 0x2E66 (nearest even gives 0x2E66 too), 1e-7 -> 1 subnormal
    t = Q.quantize(x, "f16").view(np.uint16)
    assert t[3] == 0x0001 and t[2] == 0x7BFF
    b = Q.quantize(x, "bf16").view(np.uint16)
    assert np.array_equal(b, (x.view(np.uint32) >> 16).astype(np.uint16))


def test_gemv_argument_errors():
    w = np.linspace(-1, 1, 4 * 512, dtype=np.float32).reshape(4, 512)
    raw = Q.quantize(w, "hfq4g256")
    x = np.ones(512, np.float32)
    with pytest.raises(InvalidArgument, match=r"2-D"):
        Q.gemv(raw, "hfq4g256", (2048,), x)
    with pytest.raises(InvalidArgument, match=r"\[K\] or \[B, K\] with K = 512"):
        Q.gemv(raw, "hfq4g256", (4, 512), np.ones(256, np.float32))
    with pytest.raises(InvalidArgument, match="1 to 8"):
        Q.gemv(raw, "hfq4g256", (4, 512), np.ones((9, 512), np.float32))
    with pytest.raises(InvalidArgumentType, match="float32"):
        Q.gemv(raw, "hfq4g256", (4, 512), np.ones(512))
    with pytest.raises(SizeMismatch):
        Q.gemv(raw[:-1], "hfq4g256", (4, 512), x)
    with pytest.raises(InvalidArgument, match="NaN"):
        Q.gemv(raw, "hfq4g256", (4, 512), np.full(512, np.nan, np.float32))
    y = Q.gemv(raw, "hfq4g256", (4, 512), x)
    assert y.shape == (4,)
    assert np.allclose(y, Q.dequantize(raw, "hfq4g256", (4, 512)).sum(axis=1), rtol=1e-5)


def test_dequantize_into_out_and_errors_leave_it_unchanged():
    w = np.linspace(-1, 1, 2 * 512, dtype=np.float32).reshape(2, 512)
    raw = Q.quantize(w, "mq4g256")
    out = np.full((2, 512), 7.0, np.float32)
    with pytest.raises(SizeMismatch):
        Q.dequantize(raw[:-1], "mq4g256", (2, 512), out=out)
    with pytest.raises(InvalidArgument, match="shape"):
        Q.dequantize(raw, "mq4g256", (2, 512), out=np.empty((512, 2), np.float32))
    with pytest.raises(InvalidArgumentType, match="float32"):
        Q.dequantize(raw, "mq4g256", (2, 512), out=np.empty((2, 512), np.float64))
    with pytest.raises(InvalidArgument, match="C-contiguous"):
        Q.dequantize(raw, "mq4g256", (2, 512), out=np.empty((512, 2), np.float32).T)
    assert (out == 7.0).all()
    res = Q.dequantize(raw, "mq4g256", (2, 512), out=out)
    assert res is out
    assert np.array_equal(out, Q.dequantize(raw, "mq4g256", (2, 512)))

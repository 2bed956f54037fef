"""Argument errors of the pagedkv.quant API: the specific exception, a message naming the
argument, the value and the fix, and the caller's arrays left unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.quant.formats import CODECS

RNG = np.random.default_rng(20261130)
X = RNG.standard_normal((4, 256)).astype(np.float32)
RAW = quant.quantize(X, "hfq4g256")


@pytest.mark.parametrize("shape", [(4.5, 256), "4,256", b"\x04", (True, 1024), True, None,
                                   (4, "256"), (4, 256.0)])
def test_a_shape_that_is_not_ints_is_refused_not_truncated(shape):
    with pytest.raises(InvalidArgumentType, match=r"shape must be an int or a sequence of "
                                                  r"ints \(e\.g\. \(4096, 4096\)\), got "):
        quant.dequantize(RAW, "hfq4g256", shape)
    with pytest.raises(InvalidArgumentType, match="shape must be an int or a sequence"):
        quant.gemv(RAW, "hfq4g256", shape, X[0])


def test_numpy_integer_dims_are_accepted():
    dims = (np.int64(4), np.uint16(256))
    assert quant.dequantize(RAW, "hfq4g256", dims).tobytes() == \
        quant.dequantize(RAW, "hfq4g256", (4, 256)).tobytes()
    assert quant.dequantize(RAW, "hfq4g256", np.int32(1024)).shape == (1024,)


@pytest.mark.parametrize(("out", "message"), [
    (np.full((4, 255), 7, np.float32), r"out must have shape \(4, 256\), got shape \(4, 255\)"),
    (np.full((4, 512), 7, np.float32)[:, ::2],
     r"out \(shape \(4, 256\)\) must be C-contiguous, got strides \(2048, 8\); pass np\.empty"),
    (np.full((256, 4), 7, np.float32).T, r"out .* must be C-contiguous"),
])
def test_a_wrong_out_is_named_precisely_and_left_unchanged(out, message):
    before = out.copy()
    with pytest.raises(InvalidArgument, match=message):
        quant.dequantize(RAW, "hfq4g256", (4, 256), out=out)
    assert out.tobytes() == before.tobytes()


def test_a_read_only_out_is_refused():
    out = np.full((4, 256), 7, np.float32)
    out.setflags(write=False)
    with pytest.raises(InvalidArgument, match=r"out \(shape \(4, 256\)\) is read-only"):
        quant.dequantize(RAW, "hfq4g256", (4, 256), out=out)
    assert (out == 7).all()


@pytest.mark.parametrize("basis", [np.array(["rotated", "original"]), np.array("rotated"),
                                   ["rotated"], None, b"rotated"])
def test_a_basis_that_is_not_a_str_is_a_type_error(basis):
    """Found by a review: an array of names raised a builtin ValueError (``in`` over a
    tuple compares elementwise), a 0-d array passed as if it were the str."""
    raw = quant.quantize(X, "mq4g256v2")
    out = np.full((4, 256), 7, np.float32)
    with pytest.raises(InvalidArgumentType, match="basis must be a str, one of"):
        quant.dequantize(raw, "mq4g256v2", (4, 256), basis=basis, out=out)
    assert (out == 7).all()
    with pytest.raises(InvalidArgument, match="basis must be one of"):
        quant.dequantize(raw, "mq4g256v2", (4, 256), basis="stored")
    assert quant.dequantize(raw, "mq4g256v2", (4, 256), basis=np.str_("rotated")).tobytes() \
        == quant.dequantize(raw, "mq4g256v2", (4, 256), basis="rotated").tobytes()


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_an_out_that_is_a_memoryview_or_a_matrix_is_a_type_error():
    """Found by a review: ``numpy.matrix`` (2-D under reshape) raised a builtin ValueError
    from the decoder, a memoryview is not an ndarray. Both are InvalidArgumentType, from
    dequantize and from a PreparedGemv call (one check), and left unchanged."""
    g = quant.prepare_gemv(RAW, "hfq4g256", (4, 256))
    for out, call in (
            (np.matrix(np.full((4, 256), 7, np.float32)),
             lambda o: quant.dequantize(RAW, "hfq4g256", (4, 256), out=o)),
            (memoryview(np.full((4, 256), 7, np.float32)),
             lambda o: quant.dequantize(RAW, "hfq4g256", (4, 256), out=o)),
            (np.matrix(np.full((2, 4), 7, np.float32)), lambda o: g(X[:2], out=o)),
            (memoryview(np.full(4, 7, np.float32)), lambda o: g(X[0], out=o))):
        with pytest.raises(InvalidArgumentType, match="out must be a float32 numpy.ndarray"):
            call(out)
        assert (np.asarray(out) == 7).all()


@pytest.mark.parametrize("array", [np.float32(1.0), np.zeros((), np.float32)])
def test_scalars_and_0d_arrays_say_how_to_fix_them(array):
    with pytest.raises((InvalidArgument, InvalidArgumentType),
                       match=r"array must .*(np\.asarray|reshape it)"):
        quant.quantize(array, "f32")


def test_gemv_x_of_another_dtype_says_how_to_convert():
    x = X[0].astype(np.float16)
    with pytest.raises(InvalidArgumentType,
                       match=r"x must have dtype float32, got float16; .*astype\(np\.float32\)"):
        quant.gemv(RAW, "hfq4g256", (4, 256), x)


@pytest.mark.parametrize(("m", "k", "x"), [(4, 0, np.zeros(0, np.float32)),
                                           (4, 0, np.zeros((3, 0), np.float32)),
                                           (0, 256, np.ones((2, 256), np.float32))])
def test_gemv_with_an_empty_dimension_is_zeros(m, k, x):
    y = quant.gemv(np.zeros(0, np.uint8), "hfq4g256", (m, k), x)
    assert y.dtype == np.float32
    assert y.shape == ((m,) if x.ndim == 1 else (x.shape[0], m))
    assert not y.any()


@pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")
@pytest.mark.parametrize("qt_id", sorted(q for q, c in CODECS.items() if c.encodes))
def test_quantize_and_gemv_never_modify_their_inputs(qt_id):
    w = RNG.standard_normal((3, 256)).astype(np.float32)
    w16 = w.astype(np.float16)
    x = RNG.standard_normal((2, 256)).astype(np.float32)
    copies = [a.copy() for a in (w, w16, x)]
    raw = quant.quantize(w, qt_id)
    raw_copy = raw.copy()
    quant.quantize(w16, qt_id)
    quant.gemv(raw, qt_id, (3, 256), x)
    quant.dequantize(raw, qt_id, (3, 256))
    quant.fwht256(x)
    for a, before in zip((w, w16, x), copies, strict=True):
        assert a.tobytes() == before.tobytes()
    assert raw.tobytes() == raw_copy.tobytes()


# --- the low-level Cython entry points refuse what would overrun their buffers ---------

from pagedkv.errors import SizeMismatch
from pagedkv.quant import affine, fwht, gemv_kernels, half, q8

ONES = np.ones(256, np.float32)


@pytest.mark.parametrize(("family", "bits", "group", "message"), [
    (9, 4, 256, r"family = 9: valid 0-3"),
    (-1, 4, 256, r"family = -1: valid 0-3"),
    (0, 4, 0, r"group = 0: valid 256, or 128 for AffineFamily\.HFQ"),
    (0, 4, 512, r"group = 512"),
    (1, 4, 128, r"group = 128: valid 256, or 128 for AffineFamily\.HFQ"),
    (0, 7, 256, r"bits = 7: the affine codecs take 2 to 6 bits"),
    (0, 1, 256, r"bits = 1"),
    (3, 3, 256, r"bits = 3: AffineFamily\.MQ4C is 4-bit only"),
])
def test_affine_entry_points_refuse_unknown_geometry(family, bits, group, message):
    out = np.full(4096, 0xAB, np.uint8)
    with pytest.raises(InvalidArgument, match=message):
        affine.encode(ONES, out, family, bits, group)
    assert (out == 0xAB).all()
    dec = np.full(256, 7, np.float32)
    with pytest.raises(InvalidArgument, match=message):
        affine.decode(np.zeros(4096, np.uint8), dec, family, bits, group)
    assert (dec == 7).all()
    y = np.full((1, 1), 7, np.float32)
    with pytest.raises(InvalidArgument, match=message):
        gemv_kernels.gemv_affine(np.zeros(4096, np.uint8), 1, 256, family, bits, group,
                                 ONES.reshape(1, 256), y)
    assert (y == 7).all()


def test_every_implemented_affine_geometry_passes_the_guard():
    for codec in CODECS.values():
        if codec.family is None:
            continue
        out = np.empty(codec.nbytes(256), np.uint8)
        assert affine.encode(ONES, out, codec.family, codec.bits, codec.group_size) == -1


@pytest.mark.parametrize("call", [
    lambda: affine.pack_codes(np.zeros(8, np.uint8), 9),
    lambda: affine.pack_codes(np.zeros(8, np.uint8), 0),
    lambda: affine.unpack_codes(np.zeros(8, np.uint8), 4, 0),
    lambda: affine.unpack_codes(np.zeros(8, np.uint8), -1, 4),
    lambda: fwht.header_sign_words(3),
    lambda: affine.encode(ONES, np.empty(10, np.uint8), 0, 4, 256),
    lambda: q8.encode(ONES, np.empty(3, np.uint8)),
    lambda: half.f16_trunc(ONES, np.empty(3, np.uint16)),
    lambda: half.f16_to_f32(np.zeros(256, np.uint16), np.empty(3, np.float32)),
    lambda: fwht.fwht_rows(np.zeros((4, 256), np.float32), np.empty((2, 256), np.float32)),
    lambda: gemv_kernels.gemv_q8f16(np.zeros(3, np.uint8), 4, 256,
                                    np.zeros((1, 256), np.float32),
                                    np.empty((1, 4), np.float32)),
])
def test_low_level_argument_errors_come_from_pagedkv_errors(call):
    with pytest.raises(InvalidArgument):
        call()


@pytest.mark.parametrize("call", [
    lambda: affine.decode(np.zeros(10, np.uint8), np.empty(256, np.float32), 0, 4, 256),
    lambda: q8.decode(np.zeros(3, np.uint8), np.empty(256, np.float32)),
])
def test_a_short_payload_is_a_size_mismatch(call):
    with pytest.raises(SizeMismatch, match=r"raw has \d+ bytes, 256 weights need"):
        call()


@pytest.mark.parametrize("inverse", ["false", "True", 0, 1, None, 1.0, np.array([True]),
                                     np.int64(1)])
def test_fwht256_inverse_must_be_a_bool(inverse):
    x = X.copy()
    with pytest.raises(InvalidArgumentType, match=r"inverse must be a bool, got "):
        quant.fwht256(x, inverse=inverse)
    assert np.array_equal(x, X)


def test_fwht256_inverse_takes_python_and_numpy_bools():
    forward = quant.fwht256(X)
    assert np.array_equal(quant.fwht256(X, inverse=np.bool_(False)), forward)
    assert np.array_equal(quant.fwht256(X, inverse=False), forward)
    back = quant.fwht256(forward, inverse=True)
    assert np.array_equal(quant.fwht256(forward, inverse=np.True_), back)
    assert not np.array_equal(back, forward)
    np.testing.assert_allclose(back, X, atol=1e-5)


def test_a_strided_memoryview_raw_is_read_in_its_logical_order():
    """np.frombuffer refuses a non-contiguous buffer with a bare BufferError: a strided
    memoryview raw (``memoryview(buf)[::2]``) escaped dequantize, gemv and prepare_gemv
    as one. It is copied in its logical order, as a strided uint8 array is; a released
    memoryview is InvalidArgument (it was a bare ValueError)."""
    shape = X.shape
    strided = memoryview(np.repeat(RAW, 2))[::2]
    assert not strided.c_contiguous
    want = quant.dequantize(RAW, "hfq4g256", shape)
    assert quant.dequantize(strided, "hfq4g256", shape).tobytes() == want.tobytes()
    assert quant.gemv(strided, "hfq4g256", shape, X[0]).tobytes() == \
        quant.gemv(RAW, "hfq4g256", shape, X[0]).tobytes()
    assert quant.prepare_gemv(strided, "hfq4g256", shape)(X).tobytes() == \
        quant.prepare_gemv(RAW, "hfq4g256", shape)(X).tobytes()
    # a strided memoryview of another item type: its bytes in logical order
    floats = memoryview(np.repeat(RAW.view(np.float32), 2))[::2]
    assert quant.dequantize(floats, "hfq4g256", shape).tobytes() == want.tobytes()
    released = memoryview(RAW)
    released.release()
    out = np.full(shape, 7, np.float32)
    with pytest.raises(InvalidArgument, match="raw is a released memoryview"):
        quant.dequantize(released, "hfq4g256", shape, out=out)
    assert np.all(out == 7)


@pytest.mark.parametrize("fmt", ["f16", "bf16", "hfq4g256", "q8f16", "mq4g256v2", "q4k"])
def test_an_out_that_overlaps_raw_decodes_what_raw_held(fmt):
    """The decoders read raw while they write out: a payload kept in the first bytes of
    the buffer it is decoded into (one buffer reused for both) was overwritten before it
    was read, and dequantize returned wrong weights without a word. Such a raw is now
    decoded from a copy."""
    weights = RNG.standard_normal((8, 256)).astype(np.float32)
    raw = quant.quantize(weights, fmt)
    want = quant.dequantize(raw, fmt, weights.shape)
    buf = np.zeros(weights.size * 4, np.uint8)
    buf[:raw.size] = raw
    out = buf.view(np.float32).reshape(weights.shape)
    got = quant.dequantize(buf[:raw.size], fmt, weights.shape, out=out, threads=2)
    assert got is out
    assert got.tobytes() == want.tobytes()

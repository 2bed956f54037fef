"""P2 weight formats (docs/formats/quant.md, "P2 formats"): HFP4G32/MFP4G32/MFP4G32P,
GL, MQ8G256, Q8HFQ, Q4F16G64 byte-equal to the NumPy oracle of tests/p2_oracle.py on
fresh random inputs and decoding as the oracle decodes, bit for bit; Q4K equal to the
gguf package's dequantizer; TQ2G128/BQ1G128 decode; hand-worked values from the docs
(the E2M1 table, the ceil-log2 exponent and lowest-index ties, the GL codebooks, the
FP4 spot check); what stays unsupported says why; bad input leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

import p2_oracle as O
from pagedkv import quant as Q
from pagedkv.errors import (
    CorruptPayload,
    InvalidArgument,
    SizeMismatch,
    UnsupportedQuantType,
)
from pagedkv.quant.qtypes import expected_nbytes, qtype

F32 = np.float32


def _inputs(seed: int, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kind = seed % 4
    if kind == 0:
        x = rng.standard_normal(shape)
    elif kind == 1:                        # heavy tails, outlier channels, a zero block
        x = rng.standard_t(3, shape) * np.exp(rng.standard_normal((shape[0], 1)))
        x[:, 7] *= 40
        x[0, :32] = 0
    elif kind == 2:                        # many exact ties on the E2M1/codebook grids
        x = np.round(rng.standard_normal(shape) * 4) / 4
    else:                                  # tiny and huge magnitudes across rows
        x = rng.standard_normal(shape) * np.logspace(-6, 3, shape[0])[:, None]
    return x.astype(F32)


# --- byte equality with the oracle --------------------------------------------------------

FP4 = ("hfp4g32", "mfp4g32", "mfp4g32p")


@pytest.mark.parametrize("fmt", FP4)
@pytest.mark.parametrize("seed", range(6))
def test_fp4_bytes_and_decode_equal_the_oracle(fmt, seed):
    shape = (5, 512) if seed % 2 else (3, 768)
    x = _inputs(seed, shape)
    raw = Q.quantize(x, fmt)
    assert raw.size == expected_nbytes(fmt, shape) == shape[0] * (16 + 17 * shape[1] // 32)
    assert raw.tobytes() == O.fp4_encode(x, fmt)
    for basis in ("original", "rotated"):
        np.testing.assert_array_equal(Q.dequantize(raw, fmt, shape, basis=basis),
                                      O.fp4_decode(raw, shape, fmt, basis))


@pytest.mark.parametrize("bits", (2, 3))
@pytest.mark.parametrize("seed", range(6))
def test_gl_bytes_and_decode_equal_the_oracle(bits, seed):
    fmt = f"mq{bits}g256gl"
    x = _inputs(seed, (4, 512))
    raw = Q.quantize(x, fmt)
    assert raw.tobytes() == O.gl_encode(x, bits)
    assert raw.size == 8 * (32 * bits + 2)
    for basis in ("original", "rotated"):
        np.testing.assert_array_equal(Q.dequantize(raw, fmt, x.shape, basis=basis).reshape(-1),
                                      O.gl_decode(raw, x.size, bits, basis))


@pytest.mark.parametrize("seed", range(6))
def test_mq8_bytes_and_decode_equal_the_oracle(seed):
    x = _inputs(seed, (3, 300))            # groups straddle rows, a short last group
    raw = Q.quantize(x, "mq8g256")
    assert raw.tobytes() == O.mq8_encode(x)
    np.testing.assert_array_equal(Q.dequantize(raw, 14, x.shape).reshape(-1),
                                  O.mq8_decode(raw, x.size))
    x = _inputs(seed, (2, 512))
    raw = Q.quantize(x, "mq8g256")
    np.testing.assert_array_equal(Q.dequantize(raw, 14, x.shape, basis="rotated").reshape(-1),
                                  O.mq8_decode(raw, x.size, "rotated"))
    assert np.linalg.norm(Q.dequantize(raw, 14, x.shape) - x) <= 0.01 * np.linalg.norm(x)


@pytest.mark.parametrize("seed", range(6))
def test_q8hfq_bytes_and_decode_equal_the_oracle(seed):
    for shape in ((3, 96), (2, 4096), (1, 32)):
        x = _inputs(seed, shape)
        raw = Q.quantize(x, "q8hfq")
        assert raw.size == expected_nbytes("q8hfq", shape)
        assert raw.tobytes() == O.q8hfq_encode(x)
        np.testing.assert_array_equal(Q.dequantize(raw, 5, shape), O.q8hfq_decode(raw, shape))


@pytest.mark.parametrize("seed", range(6))
def test_q4f16g64_bytes_and_decode_equal_the_oracle(seed):
    x = _inputs(seed, (3, 200))            # groups straddle rows, a short last group
    raw = Q.quantize(x, "q4f16g64")
    assert raw.tobytes() == O.q4f16g64_encode(x)
    np.testing.assert_array_equal(Q.dequantize(raw, 0, x.shape).reshape(-1),
                                  O.q4f16g64_decode(raw, x.size))


def _random_q4k_blocks(rng, n_blocks: int) -> np.ndarray:
    raw = rng.integers(0, 256, (n_blocks, 144), dtype=np.uint8)
    d = (rng.standard_normal((n_blocks, 2)) * 0.01).astype(np.float16)  # finite d, dmin
    raw[:, :4] = d.view(np.uint8)
    return raw.reshape(-1)


@pytest.mark.parametrize("seed", range(4))
def test_q4k_decode_equals_the_gguf_package(seed):
    pytest.importorskip("gguf")
    raw = _random_q4k_blocks(np.random.default_rng(seed), 6)
    np.testing.assert_array_equal(Q.dequantize(raw, "q4k", (3, 512)).reshape(-1),
                                  O.q4k_decode(raw, 3 * 512))
    np.testing.assert_array_equal(Q.dequantize(raw, 4, 1500), O.q4k_decode(raw, 1500))


@pytest.mark.parametrize("fmt,bits", (("tq2g128", 2), ("bq1g128", 1)))
def test_ternary_decode_equals_the_oracle(fmt, bits):
    rng = np.random.default_rng(bits)
    raw = rng.integers(0, 256, (5, 2 + 16 * bits), dtype=np.uint8)
    raw[:, :2] = (rng.standard_normal((5, 1)) * 0.1).astype(np.float16).view(np.uint8)
    raw = raw.reshape(-1)
    np.testing.assert_array_equal(Q.dequantize(raw, fmt, 600), O.ternary_decode(raw, 600, bits))


# --- hand-worked values ---------------------------------------------------------------------

def _fp4_row(k: int, flags: int, scale16: int, blocks: list[tuple[int, bytes]]) -> np.ndarray:
    header = (scale16.to_bytes(2, "little") + bytes(2) + (k // 32).to_bytes(2, "little")
              + bytes([flags]) + bytes(9))
    return np.frombuffer(header + b"".join(bytes([e]) + n for e, n in blocks), np.uint8)


def test_e2m1_code_table():
    # row scale 1.0 (f16 0x3C00), block scale byte 127 (2^0): nibble n decodes to E2M1[n]
    nibbles = bytes((2 * i) | ((2 * i + 1) << 4) for i in range(8)) * 2
    raw = _fp4_row(32, 0, 0x3C00, [(127, nibbles)])
    w = Q.dequantize(raw, "hfp4g32", (1, 32))[0]
    table = [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert w.tolist() == table * 2
    assert np.signbit(w[8]) and not np.signbit(w[0])         # code 8 is -0
    # block byte e scales by 2^(e - 127); e = 0 is the subnormal 2^-127
    raw = _fp4_row(32, 0, 0x3C00, [(130, nibbles)])
    assert Q.dequantize(raw, 21, (1, 32))[0, 7] == 6 * 8
    raw = _fp4_row(32, 0, 0x3C00, [(0, nibbles)])
    assert Q.dequantize(raw, 21, (1, 32))[0, 2] == np.ldexp(F32(1), -127)


def test_fp4_spot_check_of_the_docs():
    # K = 32, x[i] = (i - 16)/8: row scale f16_trunc(2/6) = 0x3555, block byte 127
    x = ((np.arange(32, dtype=F32) - 16) / 8).reshape(1, 32)
    raw = Q.quantize(x, "hfp4g32").tobytes()
    assert raw[:16] == bytes.fromhex("55350000010000000000000000000000")
    assert raw[16:] == bytes.fromhex("7fffefeededdccab991021435455666677")


def test_ceil_log2_exponent_and_lowest_index_ties():
    k = 128
    x = np.zeros((1, k), F32)
    # block 0: the row max 6 -> row scale 1.0 exactly, inv_r = 1, block byte 127;
    # its values sit on ties: 0.25 (0 | .5) -> 0, -0.25 (+0 | -0 | -.5) -> 0 (+0, the
    # lowest index), 2.5 (2 | 3) -> 4, 5 (4 | 6) -> 6, -5 -> 14, 1.25 -> 2, -1.75 -> 11
    x[0, :9] = [6, 0.25, -0.25, 2.5, 5, -5, 1.25, -1.75, -0.0]
    x[0, 32] = 3.0                          # block 1: bm/6 = 0.5 -> ceil(log2) = -1 -> 126
    x[0, 64] = np.nextafter(F32(3), F32(4))  # block 2: just above -> exponent 0 -> 127
    raw = Q.quantize(x, "hfp4g32")          # block 3: all zero -> byte 0, nibbles 0
    assert raw[:2].tobytes() == bytes.fromhex("003c")
    blocks = raw[16:].reshape(4, 17)
    assert blocks[:, 0].tolist() == [127, 126, 127, 0]
    codes = np.stack([blocks[0, 1:] & 15, blocks[0, 1:] >> 4], 1).reshape(-1)[:9]
    assert codes.tolist() == [7, 0, 0, 4, 6, 14, 2, 11, 0]
    assert blocks[1, 1] & 15 == 7 and blocks[2, 1] & 15 == 5    # 3 = 6·2^-1, then 3·2^0
    assert not blocks[3, 1:].any()


def test_e4m3_block_scale_is_the_smallest_code_covering_bm():
    # MFP4G32P: the block byte is the smallest unsigned E4M3 code with value >= bm/6.
    # Row max 6 (after the rotation the row is R·x; build x from a rotated target).
    target = np.zeros(256, F32)
    target[0], target[32], target[64] = 6, 3 * 1.1, 6 * 2 ** -10
    x = Q.fwht256(target, inverse=True).reshape(1, 256)
    raw = Q.quantize(x, "mfp4g32p")
    blocks = raw[16:].reshape(8, 17)
    rotated = Q.fwht256(x.reshape(256))
    bm = np.abs(rotated.reshape(8, 32)).max(1) * (F32(1) / (np.abs(rotated).max() / F32(6)))
    want = [next(c for c in range(127) if O.E4M3U[c] >= s) if s > 0 else 0 for s in bm / F32(6)]
    assert blocks[:, 0].tolist() == want
    assert want[1] == 0x31                                      # 0.5625, the first >= 0.55
    assert raw[6] == 0x05                                       # the rotated flags


def test_gl_codebooks_by_hand():
    # 16·e0 rotates to exactly ±1 (the SIGNS2 pattern): RMS 1, scale f16 1.0, and ±1 is
    # nearest to ±1.5104 (2-bit) and ±0.7560 (3-bit)
    x = np.zeros(256, F32)
    x[0] = 16
    signs = Q.fwht256(x)
    assert set(np.abs(signs).tolist()) == {1.0}
    for bits, level in ((2, F32(1.5104)), (3, F32(0.7560))):
        raw = Q.quantize(x.reshape(1, 256), f"mq{bits}g256gl")
        assert raw[-2:].tobytes() == bytes.fromhex("003c")     # f16 RNE 1.0, after the indices
        w = Q.dequantize(raw, f"mq{bits}g256gl", (1, 256), basis="rotated")[0]
        np.testing.assert_array_equal(w, signs * level)
    # the codebook values themselves: scale 1.0, indices 0..2^bits-1
    for bits, cb in ((2, [-1.5104, -0.4528, 0.4528, 1.5104]),
                     (3, [-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520])):
        idx = np.arange(256) % (1 << bits)
        raw = np.frombuffer(O.pack_lsb(idx, bits) + bytes.fromhex("003c"), np.uint8)
        w = Q.dequantize(raw, 36 + bits, (1, 256), basis="rotated")[0]
        assert w[: 1 << bits].tolist() == np.array(cb, F32).tolist()
    # an all-zero group: scale 0, every index the one nearest 0 (lowest: 1 and 3), decodes 0
    raw = Q.quantize(np.zeros((1, 256), F32), "mq2g256gl")
    assert raw.tobytes() == b"\x55" * 64 + bytes(2)
    assert not Q.dequantize(raw, 38, (1, 256)).any()


def test_mq8_q8hfq_q4f16g64_ternary_by_hand():
    x = np.zeros(256, F32)
    x[0] = 16                                # rotates to ±1: amax 1, scale 1/127, codes ±127
    raw = Q.quantize(x, "mq8g256").tobytes()
    assert raw[:2] == bytes.fromhex("0820")
    assert np.array_equal(np.frombuffer(raw[2:], np.int8), (127 * Q.fwht256(x)).astype(np.int8))
    # Q8HFQ: the Q8F16 spot check block as a row of K = 32: scales, codes, padding to 128
    block = np.array([0.5, -1.0, 0.25, 0.0] + [i / 100 for i in range(28)], F32).reshape(1, 32)
    raw = Q.quantize(block, "q8hfq").tobytes()
    assert len(raw) == 128 and raw[:5] == bytes.fromhex("0820408120") and raw[34:] == bytes(94)
    # Q4F16G64: x[i] = i/4: min 0, scale f16_trunc(15.75/15 = 1.05) = 0x3C33; byte i pairs
    # q[i] (low) with q[i + 32] (high): q0 = 0, q32 = 8; q31 = 7, q63 = 15
    raw = Q.quantize(np.arange(64, dtype=F32) / 4, "q4f16g64").tobytes()
    assert raw[:4] == bytes.fromhex("333c0000") and raw[4] == 0x80 and raw[35] == 0xF7
    # TQ2G128: d = 1, byte 0xE4 = codes 0, 1, 2, 3 -> -1, 0, 1, 2; BQ1G128: bit set -> +d
    tq = np.frombuffer(bytes.fromhex("003c") + b"\xe4" + bytes(31), np.uint8)
    assert Q.dequantize(tq, "tq2g128", 128)[:5].tolist() == [-1, 0, 1, 2, -1]
    bq = np.frombuffer(bytes.fromhex("0040") + b"\x05" + bytes(15), np.uint8)
    assert Q.dequantize(bq, "bq1g128", 128)[:4].tolist() == [2, -2, 2, -2]


# --- what stays unsupported, and bad input --------------------------------------------------

@pytest.mark.parametrize("qt,words", [
    (28, "Givens rotations"), (29, "tiling"), (32, "codebook"), (34, "E8"), (130, "Hessian")])
def test_unsupported_formats_say_why(qt, words):
    x = np.ones((1, 256), F32)
    with pytest.raises(UnsupportedQuantType, match=words):
        Q.quantize(x, qt)
    with pytest.raises(UnsupportedQuantType, match=words):
        Q.dequantize(np.zeros(16, np.uint8), qt, (1, 256))


@pytest.mark.parametrize("fmt", ("tq2g128", "bq1g128"))
def test_decode_only_formats_refuse_to_encode(fmt):
    with pytest.raises(UnsupportedQuantType, match="decode-only"):
        Q.quantize(np.ones((1, 256), F32), fmt)


def test_corrupt_fp4_rows_raise_and_write_nothing():
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(F32)
    raw = Q.quantize(x, "mfp4g32")
    out = np.full((2, 256), 7.0, F32)
    for offset, value, words in ((16 + 17 * 8 + 4, 9, "blocks"), (16 + 17 * 8 + 6, 0, "flags")):
        bad = raw.copy()
        bad[offset] = value
        with pytest.raises(CorruptPayload, match=f"row 1 .*{words}"):
            Q.dequantize(bad, "mfp4g32", (2, 256), out=out)
        assert (out == 7.0).all()
    bad = Q.quantize(x, "hfp4g32")
    bad[16 + 17 * 3] = 255
    with pytest.raises(CorruptPayload, match="reserved"):
        Q.dequantize(bad, "hfp4g32", (2, 256), out=out)
    assert (out == 7.0).all()


def test_row_formats_check_k_and_size():
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        Q.quantize(np.ones((2, 48), F32), "hfp4g32")
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        Q.quantize(np.ones((2, 96), F32), "mfp4g32")
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        Q.dequantize(np.zeros(256, np.uint8), "q8hfq", (2, 40))
    with pytest.raises(SizeMismatch, match="rows of K = 64"):
        Q.dequantize(np.zeros(99, np.uint8), "q8hfq", (2, 64))
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        Q.quantize(np.ones((2, 128), F32), "mq2g256gl")


@pytest.mark.parametrize("fmt", ("hfp4g32", "mq3g256gl", "mq8g256", "q8hfq", "q4f16g64"))
def test_nonfinite_and_unrepresentable_inputs_are_refused(fmt):
    x = np.ones((2, 256), F32)
    x[1, 3] = np.inf
    with pytest.raises(InvalidArgument, match=r"non-finite .* \(1, 3\)"):
        Q.quantize(x, fmt)
    x[1, 3] = 3e38                         # f16 scales saturate (or the rotation overflows)
    with pytest.raises(InvalidArgument, match="cannot be stored"):
        Q.quantize(x, fmt)


def test_register_sizes_of_the_p2_formats():
    assert {q: (qtype(q).group_size, qtype(q).group_bytes) for q in (0, 4, 5, 14, 38, 39, 40, 41)} \
        == {0: (64, 36), 4: (256, 144), 5: (32, 34), 14: (256, 258), 38: (256, 66),
            39: (256, 98), 40: (128, 34), 41: (128, 18)}
    assert all(qtype(q).decodable for q in (0, 4, 5, 14, 21, 24, 33, 38, 39, 40, 41))
    assert not any(qtype(q).decodable for q in (28, 29, 32, 34, 130))


def test_an_hfqm_tensor_whose_shape_breaks_its_row_rule_is_a_corrupt_payload(tmp_path):
    from pagedkv.hfqm import HfqmFile, HfqmWriter
    # an HFP4G32 tensor of K = 48 (not a multiple of 32): the register's size rule still
    # gives 16 + 17·ceil(48/32) bytes, so the file opens, and decoding it names the tensor
    with HfqmWriter(tmp_path / "k48.hfq", arch_id=0, metadata={}) as w:
        w.add("w", "hfp4g32", [1, 48], np.zeros(50, np.uint8))
    with HfqmFile(tmp_path / "k48.hfq") as f:
        assert f.raw("w").size == 50
        with pytest.raises(CorruptPayload, match=r"tensor 'w'.*shape does not fit .*multiple of 32"):
            f.dequantize("w")

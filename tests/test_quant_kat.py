"""Known-answer vectors of docs/contracts/hfqm-and-quant.md, '5. Known-answer vectors' (and the
checks of docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation' to '3.5 Sign tables'):
byte-exact
encodes, exact decodes, sign tables and the FWHT-256."""

from __future__ import annotations

import hashlib
import warnings

import numpy as np
import pytest

import pagedkv.quant as Q
from pagedkv.quant import affine, fwht, half

RAMP = ((np.arange(256) - 128) / 64).astype(np.float32)

# MQ2G256V2 warns on every encode; test_ramp_group_bytes checks the warning itself
pytestmark = pytest.mark.filterwarnings("ignore:MQ2G256V2:UserWarning")

# docs/contracts/hfqm-and-quant.md, '5.1 Sign tables and FWHT', rows are elements 0-63, 64-127,
# 128-191, 192-255
SIGNS1_TEXT = (
    "++++-++-++----+-+++++----++++++-++-++-++--+--+-+--++--+++-+++++-"
    "+++-++++-+--++--+----++-+-+--++-+---++---+-+-++++----++---+-++--"
    "--++-+-+---+++++++++---+++++++-----+++------++--+++----++++-+-+-"
    "---+---++-+++--+++--+--+++++++--++---+-++-+--+---+++---+------+-")
SIGNS2_TEXT = (
    "+----++-++--++-+-++++-+-+----++---+--+-+--+----+++-+-+-+-+++---+"
    "++-+++--------+++------+--+--+--+----++--++---++--+++---+---+-+-"
    "---+++-++--++-----+-+-++-+-+++--++--+--+--++-+++++--++++-+++++-+"
    "+---+++--+----+--+-+++---+++-++++--+-+++++++-+-+++++----+--+++--")
SIGNS1_PACKED = "6f431f7edba4cc7df732616531ea6134acf88f3f38308757889d933fa3258e40"
SIGNS2_PACKED = "61b35e61a484ab8e3bc0812461c61c51b819d43a93ecf3be71423aeee9af0f39"
SIGNS1_SHA = "9312d01111ca04509259de60bd397f9ea16aec1b90d7aeffd072b82389b172a9"
SIGNS2_SHA = "a87be064400ae1014c3df96b569c8aeb6b5a5385299713ed2e92b070ce0c536e"


def _text(signs: np.ndarray) -> str:
    return "".join("+" if s > 0 else "-" for s in signs)


@pytest.mark.parametrize("seed,text,packed,sha,positives", [
    (42, SIGNS1_TEXT, SIGNS1_PACKED, SIGNS1_SHA, 133),
    (1042, SIGNS2_TEXT, SIGNS2_PACKED, SIGNS2_SHA, 125),
])
def test_sign_tables(seed, text, packed, sha, positives):
    signs = fwht.sign_table(seed, 256)
    assert signs.dtype == np.float32
    assert _text(signs) == text
    assert int((signs > 0).sum()) == positives
    assert np.packbits(signs > 0, bitorder="little").tobytes().hex() == packed
    assert hashlib.sha256(signs.astype("<f4").tobytes()).hexdigest() == sha
    # the header's precomputed words are the same table
    words = fwht.header_sign_words(1 if seed == 42 else 2)
    assert words.astype("<u4").tobytes().hex() == packed
    # 128-wide tables are the first 128 entries
    assert _text(fwht.sign_table(seed, 128)) == text[:128]


def test_lcg_first_states():
    assert [hex(s) for s in fwht.lcg_states(42, 4)] == [
        "0x4a890e1b", "0x42896bb8", "0x3ba51d91", "0x6375f4f6"]
    assert [hex(s) for s in fwht.lcg_states(1042, 4)] == [
        "0x392b67e3", "0xdb495e0", "0x26ce4099", "0x2cd64f5e"]


def test_fwht_known_answers():
    e0 = np.zeros(256, np.float32)
    e0[0] = 1.0
    signs = np.array([1, -1, -1, -1, -1, 1, 1, -1], np.float32)
    assert np.array_equal(Q.fwht256(e0)[:8], signs * np.float32(0.0625))
    ones = Q.fwht256(np.ones(256, np.float32))
    assert np.array_equal(ones[:8], np.array(
        [0.625, -0.125, -1.125, 0.375, -0.625, 1.125, -0.875, -0.625], np.float32))
    assert np.array_equal(Q.fwht256(RAMP)[:4], np.array(
        [-2.1289063, 1.0898438, -0.23828125, -1.7304688], np.float32))


def test_fwht_matches_reference_order_bit_for_bit():
    """Batched rows equal a literal transcription of docs/contracts/hfqm-and-quant.md, '3.6 FWHT
    rotation' in float32, stage by stage."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    s1, s2 = fwht.sign_table(42), fwht.sign_table(1042)
    ref = x * s1
    h = 1
    while h < 256:
        y = ref.reshape(5, -1, 2, h)
        a, b = y[:, :, 0, :].copy(), y[:, :, 1, :].copy()
        y[:, :, 0, :], y[:, :, 1, :] = a + b, a - b
        ref = y.reshape(5, 256)
        h *= 2
    ref = ref * (np.float32(0.0625) * s2)
    assert np.array_equal(Q.fwht256(x), ref)
    back = Q.fwht256(ref, inverse=True)
    assert np.allclose(back, x, atol=1e-5)


# docs/contracts/hfqm-and-quant.md, '5.2 Ramp group per format': qt, name, bytes, [0,8), [8,16),
# sha256[:16]
RAMP_TABLE = [
    (6, "hfq4g256", 136, "0000883e000000c0", "0000000010111111", "9b951e76fb1696b7"),
    (7, "hfq4g128", 144, "7777073e000000c0", "0000101111112122", "4e41b8fc29de0fae"),
    (8, "hfq6g256", 200, "1886813d000000c0", "0000044110088220", "888f396647172ef1"),
    (9, "hfq2g256", 72, "0000aa3f000000c0", "0000000000000000", "b952c4758f35a1f6"),
    (11, "hfq3g256", 104, "dbb6113f000000c0", "0000000000000092", "bc377f83ae0fe590"),
    (13, "mq4g256", 136, "cdccc83e008047c0", "b347b7c825899646", "42b622055b6b394e"),
    (15, "mq6g256", 200, "f43cbf3d008047c0", "4bfb3d1d1cced741", "2fac0850dd2529d8"),
    (17, "mq3g256", 104, "9224573f008047c0", "e9b4d20b394ee4ba", "92af7a6618ebb086"),
    (31, "mq5g256", 168, "9552423e008047c0", "c5bee330cc8bc8d8", "58db2b22af3f94e5"),
    (44, "mq4g256v2", 136, "46363cc231359cc1", "b347b7c825899646", "30ddb4bb37e64609"),
    (45, "mq4cg256", 136, "46363cc200000000", "b347b7c825899646", "d2e92de48bd1e760"),
    (47, "mq6g256v2", 200, "f92d3cc2f12c9cc1", "4bfb3d1d1cced741", "f35cad14687c9a1c"),
    (48, "mq5g256v2", 168, "12323cc206319cc1", "c5bee330cc8bc8d8", "19fcfedd6e0fa3e5"),
    (49, "mq3g256v2", 104, "b93a3cc290399cc1", "e9b4d20b394ee4ba", "72a76e509550d7da"),
    (50, "mq2g256v2", 72, "d83f3cc27d3e9cc1", "59a9a1599a459866", "1d97c871094650c9"),
    (3, "q8f16", 272, "0824818283848586", "8788898a8b8c8d8e", "2f12e78c64940338"),
]


@pytest.mark.parametrize("qt,name,nbytes,head,second,sha", RAMP_TABLE, ids=[r[1] for r in RAMP_TABLE])
def test_ramp_group_bytes(qt, name, nbytes, head, second, sha):
    for fmt in (name, qt):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            raw = Q.quantize(RAMP, fmt)
        # docs/contracts/hfqm-and-quant.md, '1.1 Quant-type register': MQ2G256V2 is encoded only on
        # request, with a quality warning
        assert [str(w.message)[:9] for w in caught] == (["MQ2G256V2"] if qt == 50 else [])
        assert raw.dtype == np.uint8 and raw.shape == (nbytes,)
        assert raw[:8].tobytes().hex() == head
        assert raw[8:16].tobytes().hex() == second
        assert hashlib.sha256(raw.tobytes()).hexdigest()[:16] == sha
    # the 2-D tensor [1, 256] encodes to the same bytes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert np.array_equal(Q.quantize(RAMP.reshape(1, 256), name), raw)


def _reference_decode(raw: np.ndarray, name: str) -> np.ndarray:
    """Decode of one ramp group straight from docs/contracts/hfqm-and-quant.md, '4. Weight codecs'
    in numpy float32 (rotated basis)."""
    codec = Q.resolve(name)
    if codec.kind == "q8":
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    bits, g = codec.bits, codec.group_size
    groups = raw.reshape(-1, codec.group_bytes)
    out = []
    for grp in groups:
        stream = int.from_bytes(grp[8:].tobytes(), "little")
        q = np.array([(stream >> (bits * j)) & ((1 << bits) - 1) for j in range(g)], np.float32)
        if codec.family in (affine.AffineFamily.HFQ, affine.AffineFamily.MQ_V1):
            s, m = grp[:8].view(np.float32)
            out.append(q * s + m)
        else:
            h = grp[:8].copy().view(np.float16).astype(np.float32)
            if codec.family == affine.AffineFamily.MQ4C:
                out.append(q * h[0] + h[1])
            else:
                out.append(np.concatenate([q[:128] * h[0] + h[1], q[128:] * h[2] + h[3]]))
    return np.concatenate(out).astype(np.float32)


@pytest.mark.parametrize("name", [r[1] for r in RAMP_TABLE])
def test_ramp_decode_exact(name):
    raw = Q.quantize(RAMP, name)
    codec = Q.resolve(name)
    ref = _reference_decode(raw, name)
    if codec.rotated:
        assert np.array_equal(Q.dequantize(raw, name, (1, 256), basis="rotated")[0], ref)
        assert np.array_equal(Q.dequantize(raw, name, (256,)), Q.fwht256(ref, inverse=True))
    else:
        assert np.array_equal(Q.dequantize(raw, name, (256,)), ref)


def test_ramp_details():
    raw = Q.quantize(RAMP, "hfq4g256")
    scale, mn = raw[:8].view(np.float32)
    assert (scale, mn) == (np.float32(0.265625), np.float32(-2.0))
    codes = np.frombuffer(affine.unpack_codes(raw[8:], 256, 4), np.uint8)
    assert codes[:16].tolist() == [0] * 9 + [1] * 7
    assert raw[-4:].tobytes().hex() == "ffffffff"
    assert np.abs(Q.dequantize(raw, "hfq4g256", 256) - RAMP).max() == np.float32(0.125)

    raw = Q.quantize(RAMP, "hfq6g256")
    scale6 = raw[:4].view(np.float32)[0]
    assert scale6 == np.float32(3.984375) / np.float32(63)      # printed as 0.06324404
    assert abs(float(scale6) - 0.06324404) < 1e-8
    assert raw[16:20].tobytes().hex() == "0cc33010"

    raw = Q.quantize(RAMP, "mq4g256")
    assert tuple(raw[:8].view(np.float32)) == (np.float32(0.3921875), np.float32(-3.1171875))

    raw = Q.quantize(RAMP, "mq4g256v2")
    s0, z0, s1, z1 = raw[:8].copy().view(np.float16).astype(np.float32)
    assert s0 == np.float32(np.float16(0.39208984)) and z0 == np.float32(-3.1171875)
    assert s1 == np.float32(np.float16(0.32446289)) and z1 == np.float32(-2.8046875)


def test_short_last_group():
    x = ((np.arange(300) - 150) / 64).astype(np.float32)
    raw = Q.quantize(x, "hfq4g256")
    assert raw.size == 272
    g2 = raw[136:]
    assert g2[:8].tobytes().hex() == "7777373d0000d43f"
    assert g2[8:30].tobytes().hex() == "0011212233435455667677889899aabacbccddedeeff"
    assert not g2[30:].any() and g2[30:].size == 106
    assert hashlib.sha256(raw.tobytes()).hexdigest()[:16] == "38bc29e74847393e"
    back = Q.dequantize(raw, "hfq4g256", (300,))
    scale = raw[136:140].view(np.float32)[0]
    assert np.abs(back[256:] - x[256:]).max() <= scale / 2


def test_q8f16_spot_check():
    block = np.array([0.5, -1.0, 0.25, 0.0] + [k / 100 for k in range(28)], np.float32)
    raw = Q.quantize(block, "q8f16")
    assert raw[:8].tobytes().hex() == "0820408120000001"
    assert raw[2:10].view(np.int8).tolist() == [64, -127, 32, 0, 0, 1, 3, 4]
    assert raw[:2].view(np.uint16)[0] == 0x2008


@pytest.mark.parametrize("bits,codes,packed", [
    (6, [1, 2, 3, 4], "813010"),
    (3, list(range(8)), "88c6fa"),
    (5, list(range(8)), "2088418a39"),
    (4, [1, 2, 3, 4], "2143"),
    (2, [1, 2, 3, 0], "39"),
])
def test_bit_packing(bits, codes, packed):
    q = np.array(codes, np.uint8)
    assert affine.pack_codes(q, bits).hex() == packed
    assert list(affine.unpack_codes(np.frombuffer(bytes.fromhex(packed), np.uint8),
                                    len(codes), bits)) == codes


def test_f16_truncation_trap():
    x = np.array([0x3F801FFF], np.uint32).view(np.float32)
    out = np.empty(1, np.uint16)
    half.f16_trunc(x, out)
    assert out[0] == 0x3C00
    half.f16_rne(x, out)
    assert out[0] == 0x3C01 == x.astype(np.float16).view(np.uint16)[0]
    assert Q.quantize(x, "f16").view(np.uint16)[0] == 0x3C00


def test_f16_widening_is_exact_for_every_half():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    out = np.empty(65536, np.float32)
    half.f16_to_f32(h, out)
    ref = h.view(np.float16).astype(np.float32)
    finite = np.isfinite(ref) | np.isinf(ref)
    assert np.array_equal(out.view(np.uint32)[finite], ref.view(np.uint32)[finite])
    assert np.isnan(out[~finite]).all()


def test_f16_rne_matches_numpy_and_trunc_is_toward_zero():
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    rne = np.empty(x.size, np.uint16)
    half.f16_rne(x, rne)
    with np.errstate(over="ignore"):
        assert np.array_equal(rne, x.astype(np.float16).view(np.uint16))
    tr = np.empty(x.size, np.uint16)
    half.f16_trunc(x, tr)
    t = tr.view(np.float16).astype(np.float32)
    overflow = np.abs(x) >= 65536.0            # e16 >= 31: truncation saturates to inf (docs/contracts/hfqm-and-quant.md, '3.2 f32 to f16 by truncation')
    assert np.isinf(t[overflow]).all() and overflow.any()
    t, x, tr = t[~overflow], x[~overflow], tr[~overflow]
    assert (np.abs(t) <= np.abs(x)).all()
    assert (np.signbit(t) == np.signbit(x)).all()
    # the next half toward infinity (in magnitude) overshoots |x|, unless |x| ≥ 65520 → inf
    up = (tr & 0x7FFF) + 1
    finite_up = up < 0x7C00
    nxt = up.astype(np.uint16).view(np.float16).astype(np.float32)
    assert (nxt[finite_up] > np.abs(x[finite_up])).all()


def test_bf16_widen_and_truncate():
    x = np.array([1.0, -2.5, 3.14159, 1e-40], np.float32)
    out = np.empty(4, np.uint16)
    half.bf16_trunc(x, out)
    assert np.array_equal(out, (x.view(np.uint32) >> 16).astype(np.uint16))
    back = Q.dequantize(out.view(np.uint8), "bf16", 4)
    assert np.array_equal(back.view(np.uint32), out.astype(np.uint32) << 16)

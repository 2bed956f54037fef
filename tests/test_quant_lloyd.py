"""Lloyd codebook codecs (qt 19, 20, 30, 51; docs/formats/quant.md, "Lloyd codebooks"):
byte-equal to a pure-Python/NumPy transcription of the rule, hand-computed vectors, and
decode == the codebook lookup (then the inverse FWHT for the rotated ones)."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv import quant as Q
from pagedkv.errors import InvalidArgument, SizeMismatch
from pagedkv.quant.qtypes import qtype

FORMATS = {"mq2g256lloyd": (2, True), "mq3g256lloyd": (3, True), "mq4g256lloyd": (4, True),
           "mq2g256lloydu": (2, False)}


def oracle_group(r: np.ndarray, bits: int) -> bytes:
    """The rule of the docs, one group of 256 float32 values, step by step."""
    n_cb = 1 << bits
    srt = sorted(r.tolist())  # stable: -0.0 and 0.0 keep their order
    cb = np.empty(n_cb, np.float32)
    for k in range(n_cb):
        frac = np.float32(2 * k + 1) / np.float32(2 * n_cb)
        cb[k] = srt[min(255, int(np.floor(frac * np.float32(255) + np.float32(0.5))))]
    idx = np.zeros(256, np.int64)
    if np.float32(srt[255]) - np.float32(srt[0]) > 0:
        prev = np.zeros(256, np.int64)
        for it in range(8):
            d = np.abs(r[:, None] - cb[None, :])          # float32
            idx = d.argmin(axis=1)                          # the lowest index wins ties
            changed = 256 if it == 0 else int((idx != prev).sum())
            prev = idx
            if it > 0 and changed == 0:
                break
            sums = np.bincount(idx, weights=r.astype(np.float64), minlength=n_cb)
            counts = np.bincount(idx, minlength=n_cb)
            for k in range(n_cb):
                if counts[k]:
                    cb[k] = np.float32(sums[k] / counts[k])
    order = sorted(range(n_cb), key=lambda k: cb[k])
    inv = np.empty(n_cb, np.int64)
    inv[order] = np.arange(n_cb)
    idx = inv[idx]
    header = cb[order].astype(np.float16).tobytes()
    bitplanes = ((idx[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return header + np.packbits(bitplanes, bitorder="little").tobytes()


def oracle(x: np.ndarray, fmt: str) -> bytes:
    bits, rotated = FORMATS[fmt]
    flat = x.astype(np.float32).reshape(-1)
    out = b""
    for start in range(0, flat.size, 256):
        group = np.zeros(256, np.float32)
        group[: min(256, flat.size - start)] = flat[start:start + 256]
        if rotated:
            group = Q.fwht256(group)
        out += oracle_group(group, bits)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("seed", range(4))
def test_bytes_equal_the_oracle(fmt, seed):
    rng = np.random.default_rng(seed)
    x = [rng.standard_normal((3, 256)),
         rng.standard_t(3, 700),                                   # short last group
         np.round(rng.standard_normal(512) * 4) / 4,               # many ties
         np.zeros(300)][seed].astype(np.float32)
    raw = Q.quantize(x, fmt)
    assert raw.tobytes() == oracle(x, fmt)
    assert raw.size == -(-x.size // 256) * qtype(fmt).group_bytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_is_the_codebook_lookup(fmt):
    bits, rotated = FORMATS[fmt]
    x = np.random.default_rng(7).standard_normal((2, 512)).astype(np.float32)
    raw = Q.quantize(x, fmt)
    groups = raw.reshape(4, -1)
    n_cb = 1 << bits
    cb = groups[:, : 2 * n_cb].copy().view(np.float16).astype(np.float32)
    assert (np.diff(cb, axis=1) >= 0).all()                       # ascending centroids
    codes = np.unpackbits(groups[:, 2 * n_cb:], axis=1, bitorder="little")
    idx = (codes.reshape(4, 256, bits) << np.arange(bits)).sum(-1)
    stored = np.take_along_axis(cb, idx, axis=1)
    np.testing.assert_array_equal(Q.dequantize(raw, fmt, x.shape, basis="rotated" if rotated
                                               else "original"), stored.reshape(x.shape))
    want = Q.fwht256(stored, inverse=True) if rotated else stored
    np.testing.assert_array_equal(Q.dequantize(raw, fmt, x.shape), want.reshape(x.shape))
    err = np.linalg.norm(Q.dequantize(raw, fmt, x.shape) - x) / np.linalg.norm(x)
    assert err < {2: 0.35, 3: 0.2, 4: 0.1}[bits]


def test_hand_computed_vectors():
    # qt 51 (not rotated), values -1, +1 alternating: percentiles 32/96/159/223 of the
    # sorted group give cb = [-1, -1, 1, 1]; -1 -> 0 (lowest index), +1 -> 2; one update,
    # nothing changes, stop. Header f16(-1) = 0xBC00 twice, f16(1) = 0x3C00 twice;
    # codes 0, 2, 0, 2 -> byte 0b10001000.
    x = np.tile(np.array([-1, 1], np.float32), 128)
    raw = Q.quantize(x, "mq2g256lloydu").tobytes()
    assert raw == bytes.fromhex("00bc00bc003c003c") + b"\x88" * 64
    # A constant group: every index 0, every centroid the constant (f16 RNE of 0.1).
    raw = Q.quantize(np.full(256, 0.1, np.float32), "mq2g256lloydu").tobytes()
    assert raw == np.full(4, 0.1, np.float16).tobytes() + bytes(64)
    np.testing.assert_array_equal(Q.dequantize(raw, 51, 256), np.float32(np.float16(0.1)))
    # The register and the codecs agree on the sizes: 4/8/16 f16 + 64/96/128 index bytes.
    assert [qtype(q).group_bytes for q in (19, 20, 30, 51)] == [72, 112, 160, 72]


def test_bad_input_leaves_nothing_behind():
    x = np.ones(256, np.float32)
    x[9] = np.nan
    with pytest.raises(InvalidArgument, match="non-finite"):
        Q.quantize(x, "mq3g256lloyd")
    with pytest.raises(SizeMismatch):
        Q.dequantize(np.zeros(111, np.uint8), "mq3g256lloyd", (256,))
    from pagedkv.quant import codebook
    with pytest.raises(InvalidArgument, match="2, 3 or 4"):
        codebook.encode(np.zeros(256, np.float32), np.zeros(72, np.uint8), 5, True)

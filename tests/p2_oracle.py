"""Independent NumPy transcriptions of the P2 weight formats (docs/formats/quant.md,
"P2 formats"): encoders and decoders written from the docs' rules with whole-array
NumPy float32 arithmetic, no pagedkv code except the FWHT (``Q.fwht256``, checked against
its own known answers in tests/test_quant_kat.py). tests/test_quant_p2.py compares the
Cython codecs with these byte for byte; tests/test_kernels_weights.py compares the GPU
dequantize with them."""

from __future__ import annotations

import math

import numpy as np

from pagedkv import quant as Q

F32 = np.float32
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6], F32)
GL_CB = {2: np.array([-1.5104, -0.4528, 0.4528, 1.5104], F32),
         3: np.array([-2.1520, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1520], F32)}


def f16_trunc(x) -> np.ndarray:
    """f32 -> f16 bits by truncation toward zero, vectorized (docs/formats/quant.md,
    "The f16 truncation trap")."""
    b = np.atleast_1d(np.asarray(x, F32)).view(np.uint32).astype(np.int64)
    s = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    e16 = e - 112
    normal = s | (np.clip(e16, 0, 31) << 10) | (m >> 13)
    sub = s | ((m | 0x800000) >> np.clip(14 - e16, 0, 31))
    out = np.where(e16 >= 31, s | 0x7C00, np.where(e16 <= 0, np.where(e16 < -10, s, sub), normal))
    out = np.where(e == 0xFF, s | 0x7C00 | np.where(m == 0, 0, (m >> 13) | 1), out)
    return out.astype(np.uint16)


def f16(bits) -> np.ndarray:
    return np.asarray(bits, np.uint16).view(np.float16).astype(F32)


def round_half_away(v: np.ndarray) -> np.ndarray:
    a = np.abs(v)
    t = np.floor(a)
    r = t + (a - t >= F32(0.5))
    return np.copysign(r, v)


def nearest(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest table entry to each value, the lowest index on ties
    (argmin returns the first minimum)."""
    return np.abs(values[..., None] - table).argmin(axis=-1)


def pack_lsb(codes: np.ndarray, bits: int) -> bytes:
    planes = ((codes.astype(np.int64)[..., None] >> np.arange(bits)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little").tobytes()


def unpack_lsb(payload: np.ndarray, n: int, bits: int) -> np.ndarray:
    planes = np.unpackbits(payload, bitorder="little")[: n * bits].reshape(n, bits)
    return (planes.astype(np.int64) << np.arange(bits)).sum(-1)


def rotate_rows(x: np.ndarray) -> np.ndarray:
    return Q.fwht256(x.reshape(-1, 256)).reshape(x.shape)


# --- HFP4G32 / MFP4G32 / MFP4G32P --------------------------------------------------------

def e4m3u(code: int) -> float:
    e, m = (code >> 3) & 15, code & 7
    if e == 0:
        return m / 512
    if e == 15 and m == 7:
        return 448.0
    return 2.0 ** (e - 7) * (1 + m / 8)


E4M3U = np.array([e4m3u(c) for c in range(128)], F32)


def fp4_encode(x: np.ndarray, fmt: str) -> bytes:
    """Rows of K (x is [M, K]): ``fmt`` is hfp4g32, mfp4g32 or mfp4g32p."""
    x = x.astype(F32)
    if fmt != "hfp4g32":
        x = rotate_rows(x)
    k = x.shape[1]
    out = bytearray()
    for row in x:
        rmax = np.abs(row).max()
        ra = rmax / F32(6) if rmax > 0 else F32(1)
        inv_r = F32(1) / ra if rmax > 0 else F32(0)
        header = np.zeros(16, np.uint8)
        header[0:2] = np.frombuffer(f16_trunc(ra).tobytes(), np.uint8)
        header[4:6] = np.frombuffer(np.uint16(k // 32).tobytes(), np.uint8)
        header[6] = 0 if fmt == "hfp4g32" else 5
        out += header.tobytes()
        blocks = row.reshape(-1, 32)
        bm = np.abs(blocks).max(axis=1) * inv_r
        if fmt == "mfp4g32p":
            s = np.where(bm > 0, bm / F32(6), F32(0)).astype(F32)
            codes = np.array([0 if not si > 0 else int(np.argmax(E4M3U[:127] >= si))
                              if si < 448 else 0x7E for si in s])
            bs = E4M3U[codes]
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                lg = np.log2((bm / F32(6)).astype(np.float64)).astype(F32)
            lg = np.where(bm > 0, lg, F32(0))
            codes = np.where(bm > 0, np.clip(np.ceil(lg).astype(np.int64) + 127, 0, 254), 0)
            bs = np.array([math.ldexp(1.0, int(c) - 127) for c in codes], F32)
        inv_b = np.where(bs > 0, F32(1) / np.where(bs > 0, bs, F32(1)), F32(0)).astype(F32)
        v = (blocks * inv_r) * inv_b[:, None]
        n = nearest(v, E2M1)
        nib = (n[:, 0::2] | (n[:, 1::2] << 4)).astype(np.uint8)
        out += np.concatenate([codes.astype(np.uint8)[:, None], nib], axis=1).tobytes()
    return bytes(out)


def fp4_decode(raw: np.ndarray, shape: tuple[int, int], fmt: str,
               basis: str = "original") -> np.ndarray:
    m, k = shape
    rows = np.asarray(raw, np.uint8).reshape(m, 16 + 17 * (k // 32))
    ra = f16(rows[:, 0:2].copy().view(np.uint16)[:, 0])
    blocks = rows[:, 16:].reshape(m, k // 32, 17)
    if fmt == "mfp4g32p":
        bs = E4M3U[blocks[:, :, 0] & 0x7F]
    else:
        bs = np.ldexp(F32(1), blocks[:, :, 0].astype(np.int32) - 127).astype(F32)
    nib = blocks[:, :, 1:]
    n = np.stack([nib & 15, nib >> 4], axis=-1).reshape(m, k // 32, 32)
    w = ((ra[:, None] * bs)[:, :, None] * E2M1[n]).reshape(m, k)
    if fmt != "hfp4g32" and basis == "original":
        w = Q.fwht256(w.reshape(-1, 256), inverse=True).reshape(m, k)
    return w


# --- GL -----------------------------------------------------------------------------------

def gl_encode(x: np.ndarray, bits: int) -> bytes:
    r = rotate_rows(x.astype(F32).reshape(-1, 256))
    rms = np.sqrt((r.astype(np.float64) ** 2).sum(axis=1) / 256).astype(F32)
    s = rms.astype(np.float16)
    sf = s.astype(F32)
    v = np.where(sf[:, None] != 0, r / np.where(sf != 0, sf, F32(1))[:, None], F32(0))
    idx = nearest(v.astype(F32), GL_CB[bits])
    return b"".join(pack_lsb(g, bits) for g in idx) + s.tobytes()


def gl_decode(raw: np.ndarray, numel: int, bits: int, basis: str = "original") -> np.ndarray:
    g = numel // 256
    raw = np.asarray(raw, np.uint8)
    s = f16(raw[g * 32 * bits:].copy().view(np.uint16))
    idx = unpack_lsb(raw[: g * 32 * bits], numel, bits).reshape(g, 256)
    w = s[:, None] * GL_CB[bits][idx]
    return Q.fwht256(w, inverse=True).reshape(-1) if basis == "original" else w.reshape(-1)


# --- MQ8G256, Q8HFQ -----------------------------------------------------------------------

def mq8_encode(x: np.ndarray) -> bytes:
    flat = x.astype(F32).reshape(-1)
    groups = np.zeros((-(-flat.size // 256), 256), F32)
    groups.reshape(-1)[: flat.size] = flat
    r = rotate_rows(groups)
    amax = np.abs(r).max(axis=1)
    scale = np.where(amax > 0, amax / F32(127), F32(1)).astype(F32)
    inv = np.where(amax > 0, F32(127) / np.where(amax > 0, amax, F32(1)), F32(0)).astype(F32)
    q = np.clip(round_half_away(r * inv[:, None]), -128, 127).astype(np.int8)
    return b"".join(f16_trunc(s).tobytes() + qi.tobytes() for s, qi in zip(scale, q))


def mq8_decode(raw: np.ndarray, numel: int, basis: str = "original") -> np.ndarray:
    g = np.asarray(raw, np.uint8).reshape(-1, 258)
    w = f16(g[:, :2].copy().view(np.uint16)[:, 0])[:, None] * g[:, 2:].view(np.int8).astype(F32)
    if basis == "original":
        w = Q.fwht256(w, inverse=True)
    return w.reshape(-1)[:numel]


def q8hfq_encode(x: np.ndarray) -> bytes:
    k = x.shape[1]
    stride = -(-(2 * (k // 32) + k) // 128) * 128
    out = bytearray()
    for row in x.astype(F32):
        blocks = row.reshape(-1, 32)
        scale = (np.abs(blocks).max(axis=1) / F32(127)).astype(F32)
        inv = np.where(scale > 0, F32(1) / np.where(scale > 0, scale, F32(1)), F32(0)).astype(F32)
        q = np.clip(round_half_away(blocks * inv[:, None]), -128, 127).astype(np.int8)
        body = f16_trunc(scale).tobytes() + q.tobytes()
        out += body + bytes(stride - len(body))
    return bytes(out)


def q8hfq_decode(raw: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    m, k = shape
    rows = np.asarray(raw, np.uint8).reshape(m, -1)
    s = f16(rows[:, : k // 16].copy().view(np.uint16))
    q = rows[:, k // 16: k // 16 + k].view(np.int8).astype(F32).reshape(m, k // 32, 32)
    return (s[:, :, None] * q).reshape(m, k)


# --- Q4F16G64, Q4K --------------------------------------------------------------------------

def q4f16g64_encode(x: np.ndarray) -> bytes:
    flat = x.astype(F32).reshape(-1)
    out = bytearray()
    for start in range(0, flat.size, 64):
        g = flat[start:start + 64]
        mn, mx = g.min(), g.max()
        rng = mx - mn
        scale = rng / F32(15) if rng > 0 else F32(1)
        inv = F32(1) / scale if rng > 0 else F32(0)
        q = np.zeros(64, np.int64)
        q[: g.size] = np.minimum(15, np.floor((g - mn) * inv + F32(0.5)))
        out += f16_trunc(scale).tobytes() + f16_trunc(mn).tobytes()
        out += (q[:32] | (q[32:] << 4)).astype(np.uint8).tobytes()
    return bytes(out)


def q4f16g64_decode(raw: np.ndarray, numel: int) -> np.ndarray:
    g = np.asarray(raw, np.uint8).reshape(-1, 36)
    hdr = g[:, :4].copy().view(np.uint16)
    q = np.concatenate([g[:, 4:] & 15, g[:, 4:] >> 4], axis=1).astype(F32)
    return (q * f16(hdr[:, 0])[:, None] + f16(hdr[:, 1])[:, None]).reshape(-1)[:numel]


def q4k_decode(raw: np.ndarray, numel: int) -> np.ndarray:
    """GGML Q4_K through the gguf package's own dequantizer (the oracle)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    return dequantize(np.asarray(raw, np.uint8), GGMLQuantizationType.Q4_K).reshape(-1)[:numel]


# --- TQ2G128, BQ1G128 -----------------------------------------------------------------------

def ternary_decode(raw: np.ndarray, numel: int, bits: int) -> np.ndarray:
    g = np.asarray(raw, np.uint8).reshape(-1, 2 + 16 * bits)
    d = f16(g[:, :2].copy().view(np.uint16)[:, 0])
    codes = np.stack([unpack_lsb(row, 128, bits) for row in g[:, 2:]])
    vals = (codes - 1).astype(F32) if bits == 2 else np.where(codes == 1, F32(1), F32(-1))
    return (vals * d[:, None]).reshape(-1)[:numel]

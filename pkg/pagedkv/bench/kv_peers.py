"""Peer KV quantizers, re-implemented from their published descriptions for measurement only
(docs/kv-quant.md "Quality"): each maps float K or V rows ``[..., head_dim]`` to what the
peer would hand attention after a round trip, and says how many bits per element it stores.

* ``fp8_e4m3_tensor``: vLLM's ``kv_cache_dtype="fp8"`` (e4m3) with one scale per tensor;
  here the scale is the tensor's ``amax / 448`` (a calibrated scale: the peer's best case;
  vLLM's default scale without calibration is 1.0).
* ``int8_token``: symmetric int8 per (token, head) row, f16 scale ``amax / 127``.
* ``int4_token``: asymmetric int4 per (token, head) row (KIVI-style per-token), f16 scale
  and zero.
* ``turboquant_mse(b)``: TurboQuant (Zandieh et al., 2025, "TurboQuant: Online Vector
  Quantization with Near-optimal Distortion Rate", Algorithm 1): a random orthogonal
  rotation of the unit row, each coordinate quantized by the Lloyd-Max quantizer of the
  coordinate's exact distribution on the sphere (density ∝ (1 - x²)^((d-3)/2)), the norm
  kept in f16.
* ``turboquant_prod(b)``: TurboQuant's inner-product variant (Algorithm 2): ``b - 1`` bits
  of the MSE quantizer, then 1-bit QJL (``sign(S r)``, S Gaussian) of the residual ``r``
  with its norm in f16: unbiased inner products, which is what K needs.

All run in float64 NumPy with fixed seeds, so every method sees the same rotations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = ["PEERS", "Peer", "fp8_e4m3_round", "sphere_lloyd_max"]


@dataclass(frozen=True)
class Peer:
    """A peer quantizer: ``name``, ``bits(head_dim)`` per element (codes + side data) and
    ``roundtrip(x)`` over float rows ``[..., head_dim]`` (one tensor: a layer's K or V)."""

    name: str
    bits: Callable[[int], float]
    roundtrip: Callable[[np.ndarray], np.ndarray]


def fp8_e4m3_round(y: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value (ties to even), saturating at ±448 (no NaN codes)."""
    a = np.minimum(np.abs(y), 448.0)
    exp = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))   # below 2^-6: subnormal spacing
    step = 2.0 ** (exp - 3)
    return np.sign(y) * np.minimum(np.round(a / step) * step, 448.0)


def _f16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float16).astype(np.float64)


def fp8_e4m3_tensor(x: np.ndarray) -> np.ndarray:
    scale = np.abs(x).max() / 448.0
    if scale == 0:
        return np.zeros_like(x)
    return fp8_e4m3_round(x / scale) * scale


def int8_token(x: np.ndarray) -> np.ndarray:
    scale = _f16(np.abs(x).max(axis=-1, keepdims=True) / 127.0)
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round(x / safe), -127, 127) * scale


def int4_token(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
    scale, zero = _f16((hi - lo) / 15.0), _f16(lo)
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.round((x - zero) / safe), 0, 15) * scale + zero


@cache
def sphere_lloyd_max(bits: int, d: int) -> np.ndarray:
    """Lloyd-Max centroids (ascending) of one coordinate of a uniform point on the unit
    sphere in ``d`` dims (density ∝ (1 - x²)^((d-3)/2)), by Lloyd's iteration on a grid."""
    sigma = 1 / np.sqrt(d)
    span = min(1.0, 12 * sigma)   # beyond 12 sigma the density is below 1e-30 of its peak
    grid = np.linspace(-span, span, 60001)
    grid = grid[np.abs(grid) < 1]
    logp = (d - 3) / 2 * np.log1p(-grid * grid)
    p = np.exp(logp - logp.max())
    n = 1 << bits
    c = np.linspace(-2.5 * sigma, 2.5 * sigma, n)
    for _ in range(1000):
        edges = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(edges, grid)
        new = np.bincount(idx, p * grid, n) / np.maximum(np.bincount(idx, p, n), 1e-300)
        if np.abs(new - c).max() < 1e-10:
            c = new
            break
        c = new
    return (c - c[::-1]) / 2  # the density is even: remove the grid's asymmetry (~5e-6)


@cache
def _rotation(d: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))  # a Haar-random orthogonal matrix


@cache
def _qjl(d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((d, d))


def _tq_mse_unit(u: np.ndarray, bits: int) -> np.ndarray:
    d = u.shape[-1]
    if bits == 0:
        return np.zeros_like(u)
    rot = _rotation(d, 1234)
    c = sphere_lloyd_max(bits, d)
    y = u @ rot.T
    edges = (c[1:] + c[:-1]) / 2
    return c[np.searchsorted(edges, y)] @ rot


def turboquant_mse(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    def roundtrip(x: np.ndarray) -> np.ndarray:
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        u = x / np.where(norm > 0, norm, 1.0)
        return _f16(norm) * _tq_mse_unit(u, bits)
    return roundtrip


def turboquant_prod(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    def roundtrip(x: np.ndarray) -> np.ndarray:
        d = x.shape[-1]
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        u = x / np.where(norm > 0, norm, 1.0)
        base = _tq_mse_unit(u, bits - 1)
        r = u - base
        s = _qjl(d, 4321)
        z = np.sign(r @ s.T)
        rn = _f16(np.linalg.norm(r, axis=-1, keepdims=True))
        return _f16(norm) * (base + np.sqrt(np.pi / 2) / d * rn * (z @ s))
    return roundtrip


def _per_row_bits(bits: int, row_bits: int) -> Callable[[int], float]:
    """Bits per element of ``bits``-bit codes plus ``row_bits`` of side data per row."""
    return lambda d: bits + row_bits / d


#: The peers of docs/kv-quant.md's quality table, by name.
PEERS: dict[str, Peer] = {
    "fp8 e4m3 per-tensor": Peer("fp8 e4m3 per-tensor", lambda d: 8.0, fp8_e4m3_tensor),
    "int8 per-token-head": Peer("int8 per-token-head", lambda d: 8 + 16 / d, int8_token),
    "int4 per-token-head": Peer("int4 per-token-head", lambda d: 4 + 32 / d, int4_token),
    **{f"turboquant-mse {b}": Peer(f"turboquant-mse {b}", _per_row_bits(b, 16),
                                   turboquant_mse(b)) for b in (2, 3, 4)},
    **{f"turboquant-prod {b}": Peer(f"turboquant-prod {b}", _per_row_bits(b, 32),
                                    turboquant_prod(b)) for b in (2, 3, 4)},
}

"""Peer KV quantizers, re-implemented from their published descriptions for measurement only
(docs/kv-quant.md "Quality"): each maps float K or V rows ``[..., head_dim]`` to what the
peer would hand attention after a round trip, and says how many bits per element it stores.

* ``fp8_e4m3_tensor``: vLLM's ``kv_cache_dtype="fp8"`` (e4m3) with one scale per tensor;
  here the scale is the tensor's ``amax / 448`` (a calibrated scale: the peer's best case;
  vLLM's default scale without calibration is 1.0).
* ``int8_token``: symmetric int8 per (token, head) row, f16 scale ``amax / 127``.
* ``uint_token(b)``: asymmetric ``b``-bit per (token, head) row, f16 scale and zero
  (KIVI-style per-token; vLLM's turboquant stores V this way at 3 and 4 bits).
* ``turboquant_mse(b)``: TurboQuant's MSE quantizer (Zandieh et al., 2025, Algorithm 1): a
  Haar-random orthogonal rotation of the unit row, each coordinate quantized by the
  Lloyd-Max quantizer of the coordinate's exact distribution on the sphere (density
  ∝ (1 - x²)^((d-3)/2)), the norm kept in f16.
* ``turboquant_nc(b)``: vLLM's ``turboquant_*_nc`` keys (vllm/model_executor/layers/
  quantization/turboquant): the same rotation, the Lloyd-Max quantizer of N(0, 1/d), the
  norm in f16, and *norm correction* (the centroid vector rescaled to unit length before
  the inverse rotation; pagedkv's ``cnorm`` does the same). vLLM's presets pair it with
  ``uint_token`` values: ``turboquant_4bit_nc`` (K4/V4), ``turboquant_k3v4_nc``,
  ``turboquant_3bit_nc`` (K3/V3); :data:`PAIRS`. vLLM ships without the paper's QJL
  residual stage (it found QJL's variance hurts attention through the softmax), so QJL is
  not measured.

All run in float64 NumPy with fixed seeds, so every method sees the same rotations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

__all__ = ["PAIRS", "PEERS", "Peer", "fp8_e4m3_round", "gaussian_lloyd_max",
           "sphere_lloyd_max"]


@dataclass(frozen=True)
class Peer:
    """A peer quantizer of one side: ``name``, ``bits(head_dim)`` per element (codes + side
    data) and ``roundtrip(x)`` over float rows ``[..., head_dim]`` (one tensor: a layer's
    K or V)."""

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


def uint_token(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    top = (1 << bits) - 1

    def roundtrip(x: np.ndarray) -> np.ndarray:
        lo, hi = x.min(axis=-1, keepdims=True), x.max(axis=-1, keepdims=True)
        scale, zero = _f16((hi - lo) / top), _f16(lo)
        safe = np.where(scale > 0, scale, 1.0)
        return np.clip(np.round((x - zero) / safe), 0, top) * scale + zero
    return roundtrip


def _lloyd_max(grid: np.ndarray, density: np.ndarray, bits: int, sigma: float) -> np.ndarray:
    """Lloyd-Max centroids of ``density`` sampled on ``grid``: cumulative zeroth and first
    moments once, then each iteration's cell means by interpolation (O(levels) a step)."""
    m0 = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2 * np.diff(grid))])
    f1 = density * grid
    m1 = np.concatenate([[0.0], np.cumsum((f1[1:] + f1[:-1]) / 2 * np.diff(grid))])
    n = 1 << bits
    c = np.linspace(-2.5 * sigma, 2.5 * sigma, n)
    for _ in range(5000):
        edges = np.concatenate([[grid[0]], (c[1:] + c[:-1]) / 2, [grid[-1]]])
        a0, a1 = np.interp(edges, grid, m0), np.interp(edges, grid, m1)
        new = np.diff(a1) / np.maximum(np.diff(a0), 1e-300)
        done = np.abs(new - c).max() < 1e-12
        c = new
        if done:
            break
    return (c - c[::-1]) / 2  # the density is even: remove the grid's asymmetry


@cache
def sphere_lloyd_max(bits: int, d: int) -> np.ndarray:
    """Lloyd-Max centroids (ascending) of one coordinate of a uniform point on the unit
    sphere in ``d`` dims (density ∝ (1 - x²)^((d-3)/2))."""
    sigma = 1 / np.sqrt(d)
    span = min(1.0, 12 * sigma)   # beyond 12 sigma the density is below 1e-30 of its peak
    grid = np.linspace(-span, span, 200001)
    grid = grid[np.abs(grid) < 1]
    logp = (d - 3) / 2 * np.log1p(-grid * grid)
    return _lloyd_max(grid, np.exp(logp - logp.max()), bits, sigma)


@cache
def gaussian_lloyd_max(bits: int, d: int) -> np.ndarray:
    """Lloyd-Max centroids (ascending) of N(0, 1/d), as vLLM's turboquant solves them."""
    sigma = 1 / np.sqrt(d)
    grid = np.linspace(-12 * sigma, 12 * sigma, 200001)
    return _lloyd_max(grid, np.exp(-0.5 * (grid / sigma) ** 2), bits, sigma)


@cache
def _rotation(d: int, seed: int) -> np.ndarray:
    q, r = np.linalg.qr(np.random.default_rng(seed).standard_normal((d, d)))
    return q * np.sign(np.diag(r))  # a Haar-random orthogonal matrix


def _rotated_quantize(x: np.ndarray, centroids: np.ndarray,
                      norm_correction: bool) -> np.ndarray:
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    u = x / np.where(norm > 0, norm, 1.0)
    rot = _rotation(x.shape[-1], 1234)
    edges = (centroids[1:] + centroids[:-1]) / 2
    c = centroids[np.searchsorted(edges, u @ rot.T)]
    if norm_correction:
        c /= np.linalg.norm(c, axis=-1, keepdims=True)
    return _f16(norm) * (c @ rot)


def turboquant_mse(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: _rotated_quantize(x, sphere_lloyd_max(bits, x.shape[-1]), False)


def turboquant_nc(bits: int) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: _rotated_quantize(x, gaussian_lloyd_max(bits, x.shape[-1]), True)


def _per_row_bits(bits: int, row_bits: int) -> Callable[[int], float]:
    """Bits per element of ``bits``-bit codes plus ``row_bits`` of side data per row."""
    return lambda d: bits + row_bits / d


def _peer(name: str, bits: Callable[[int], float],
          roundtrip: Callable[[np.ndarray], np.ndarray]) -> tuple[str, Peer]:
    return name, Peer(name, bits, roundtrip)


#: The peer quantizers of one side in docs/kv-quant.md's quality table, by name.
PEERS: dict[str, Peer] = dict([
    _peer("fp8 e4m3 per-tensor", lambda d: 8.0, fp8_e4m3_tensor),
    _peer("int8 per-token-head", _per_row_bits(8, 16), int8_token),
    *(_peer(f"int{b} per-token-head", _per_row_bits(b, 32), uint_token(b)) for b in (4, 3)),
    *(_peer(f"turboquant-mse {b}", _per_row_bits(b, 16), turboquant_mse(b))
      for b in (4, 3, 2)),
    *(_peer(f"turboquant-nc {b}", _per_row_bits(b, 16), turboquant_nc(b)) for b in (4, 3)),
])

#: vLLM's turboquant presets as (K peer, V peer); every other peer is measured on both sides.
PAIRS: dict[str, tuple[str, str]] = {
    "vllm turboquant_4bit_nc": ("turboquant-nc 4", "int4 per-token-head"),
    "vllm turboquant_k3v4_nc": ("turboquant-nc 3", "int4 per-token-head"),
    "vllm turboquant_3bit_nc": ("turboquant-nc 3", "int3 per-token-head"),
}

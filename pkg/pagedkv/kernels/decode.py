"""Launchers for ``hip/decode.hip``: the small kernels of a decoder step (RMSNorm fused
with the residual add, RoPE splitting the packed QKV projection, SiLU(gate)·up).

Activations are ``float32`` DeviceArrays. Each launcher checks shapes and dtypes (an
``InvalidArgument`` naming the argument, nothing launched) and enqueues on ``stream``.
References: :mod:`pagedkv.kernels.numpy_decoder`. The KV write of this step's tokens
into a device pool is :func:`pagedkv.kernels.paged.write_kv`.
"""

from __future__ import annotations

import math

import numpy as np

from pagedkv.errors import InvalidArgument
from pagedkv.kernels.device import Device, StreamLike
from pagedkv.kernels.device_array import DeviceArray
from pagedkv.kernels.kvcache import _need
from pagedkv.kernels.launch_constants import launch_constant

__all__ = ["add_rmsnorm", "qkv_rope_split", "silu_mul"]

SOURCE = "decode"
NORM_THREADS = launch_constant("PKV_NORM_THREADS")
ELEMENTWISE_THREADS = 256  # any block size: the elementwise kernels index by global thread


def _shape(arr: DeviceArray, name: str, shape: tuple[int, ...]) -> None:
    _need(arr, name, np.float32)
    if arr.shape != shape:
        raise InvalidArgument(f"{name}: shape {arr.shape}, expected {shape}")


def add_rmsnorm(device: Device, x: DeviceArray, residual: DeviceArray | None,
                weight: DeviceArray, y: DeviceArray, *, eps: float,
                stream: StreamLike = None) -> None:
    """``x += residual`` (when given; ``x`` is updated), then ``y = x / sqrt(mean(x²) + eps)
    · weight`` per row. ``x``, ``residual``, ``y``: ``float32[rows, dim]``; ``weight``:
    ``float32[dim]``; ``dim % 4 == 0``."""
    _need(x, "x", np.float32, 2)
    rows, dim = x.shape
    if dim % 4 or dim == 0:
        raise InvalidArgument(f"x: dim {dim} must be a positive multiple of 4")
    if residual is not None:
        _shape(residual, "residual", x.shape)
    _shape(weight, "weight", (dim,))
    _shape(y, "y", x.shape)
    if rows == 0:
        return
    k = device.kernel(SOURCE, "pkv_add_rmsnorm_f32", "ppppif")
    k((rows,), (NORM_THREADS,), x, 0 if residual is None else residual, weight, y, dim,
      float(eps), stream=stream)


def qkv_rope_split(device: Device, qkv: DeviceArray, positions: DeviceArray, q: DeviceArray,
                   k: DeviceArray, v: DeviceArray, *, q_heads: int, kv_heads: int,
                   head_dim: int, theta: float, stream: StreamLike = None) -> None:
    """Split ``qkv`` (``float32[rows, (q_heads + 2 kv_heads) * head_dim]``, the packed
    projection) into ``q`` ``[rows, q_heads, head_dim]``, ``k`` and ``v`` ``[rows, kv_heads,
    head_dim]``, rotating q and k by RoPE at ``positions`` (``int32[rows]``): dims ``i`` and
    ``i + head_dim/2`` by ``pos · theta^(-2i/head_dim)`` (Llama's rotate-half)."""
    heads = q_heads + 2 * kv_heads
    _need(qkv, "qkv", np.float32, 2)
    rows = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != heads * head_dim:
        raise InvalidArgument(f"qkv: shape {qkv.shape}, expected (rows, {heads * head_dim}) for "
                              f"{q_heads} + 2 x {kv_heads} heads of an even head_dim {head_dim}")
    _need(positions, "positions", np.int32, 1)
    if positions.shape != (rows,):
        raise InvalidArgument(f"positions: shape {positions.shape}, expected ({rows},)")
    _shape(q, "q", (rows, q_heads, head_dim))
    _shape(k, "k", (rows, kv_heads, head_dim))
    _shape(v, "v", (rows, kv_heads, head_dim))
    n = rows * heads * head_dim // 2
    if n == 0:
        return
    kern = device.kernel(SOURCE, "pkv_qkv_rope_split_f32", "pppppiiiif")
    kern((math.ceil(n / ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), qkv, positions, q, k, v,
         rows, q_heads, kv_heads, head_dim, float(theta), stream=stream)


def silu_mul(device: Device, gate_up: DeviceArray, out: DeviceArray, *,
             stream: StreamLike = None) -> None:
    """``out = silu(gate) · up`` for ``gate_up`` ``float32[rows, 2·ffn]`` packed ``[gate |
    up]``; ``out`` ``float32[rows, ffn]``."""
    _need(gate_up, "gate_up", np.float32, 2)
    rows, two_ffn = gate_up.shape
    if two_ffn % 2:
        raise InvalidArgument(f"gate_up: {two_ffn} columns, expected an even 2 x ffn")
    _shape(out, "out", (rows, two_ffn // 2))
    n = rows * two_ffn // 2
    if n == 0:
        return
    kern = device.kernel(SOURCE, "pkv_silu_mul_f32", "ppii")
    kern((math.ceil(n / ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), gate_up, out, rows,
         two_ffn // 2, stream=stream)

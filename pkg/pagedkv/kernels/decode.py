"""Launchers for ``hip/decode.hip``: the small kernels of a decoder step (RMSNorm fused
with the residual add, RoPE splitting the packed QKV projection, SiLU(gate)·up), and
their variants that also write the next tensor-core GEMV's prepared x
(:func:`add_rmsnorm_prep`, :func:`silu_mul_prep`: one launch instead of two; the bytes of
``Gemv.prepare`` on their output).

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
from pagedkv.kernels.device_array import DeviceArray, need_array
from pagedkv.kernels.launch_constants import launch_constant
from pagedkv.kernels.weights import PreparedX, check_prepared

__all__ = ["add_rmsnorm", "add_rmsnorm_prep", "qkv_rope_split", "silu_mul", "silu_mul_prep"]

SOURCE = "decode"  # every kernel of it waits for the previous grid first (PDL-safe)
NORM_THREADS = launch_constant("PKV_NORM_THREADS")
ELEMENTWISE_THREADS = 256  # any block size: the elementwise kernels index by global thread


def _shape(arr: DeviceArray, name: str, shape: tuple[int, ...], *,
           writable: bool = False, device: Device | None = None) -> None:
    need_array(arr, name, np.float32, writable=writable, device=device)
    if arr.shape != shape:
        raise InvalidArgument(f"{name}: shape {arr.shape}, expected {shape}")


def _check_norm(device: Device | None, x: DeviceArray, residual: DeviceArray | None,
                weight: DeviceArray, y: DeviceArray | None, multiple: int) -> tuple[int, int]:
    need_array(x, "x", np.float32, 2, writable=residual is not None,  # x += residual
               device=device)
    rows, dim = x.shape
    if dim % multiple or dim == 0:
        raise InvalidArgument(f"x: dim {dim} must be a positive multiple of {multiple}")
    if residual is not None:
        _shape(residual, "residual", x.shape, device=device)
    _shape(weight, "weight", (dim,), device=device)
    if y is not None:
        _shape(y, "y", x.shape, writable=True, device=device)
    return rows, dim


def add_rmsnorm(device: Device, x: DeviceArray, residual: DeviceArray | None,
                weight: DeviceArray, y: DeviceArray, *, eps: float,
                stream: StreamLike = None) -> None:
    """``x += residual`` (when given; ``x`` is updated), then ``y = x / sqrt(mean(x²) + eps)
    · weight`` per row. ``x``, ``residual``, ``y``: ``float32[rows, dim]``; ``weight``:
    ``float32[dim]``; ``dim % 4 == 0``."""
    rows, dim = _check_norm(device, x, residual, weight, y, 4)
    if rows == 0:
        return
    k = device.kernel(SOURCE, "pkv_add_rmsnorm_f32", "ppppif", dependent_launch=True)
    k((rows,), (NORM_THREADS,), x, 0 if residual is None else residual, weight, y, dim,
      float(eps), stream=stream)


def add_rmsnorm_prep(device: Device, x: DeviceArray, residual: DeviceArray | None,
                     weight: DeviceArray, y: DeviceArray | None, prepared: PreparedX, *,
                     eps: float, stream: StreamLike = None) -> None:
    """:func:`add_rmsnorm` that also writes the normalized rows as the prepared x of the
    tensor-core GEMV that reads them (``prepared = gemv.prepared_x()``; then
    ``gemv.run_prepared(w, out)``): the bytes ``gemv.prepare(y)`` writes, one launch
    instead of two. ``y`` may be ``None`` (not written); ``dim % 256 == 0``."""
    rows, dim = _check_norm(device, x, residual, weight, y, 256)
    check_prepared(prepared, rows, dim, device)
    if rows == 0:
        return
    k = device.kernel(SOURCE, "pkv_add_rmsnorm_prep_f32", "ppppppifiii", dependent_launch=True)
    k((rows,), (NORM_THREADS,), x, 0 if residual is None else residual, weight,
      0 if y is None else y, prepared.xq, prepared.xs, dim, float(eps), rows, prepared.tiles,
      int(prepared.rotate), stream=stream)


def qkv_rope_split(device: Device, qkv: DeviceArray, positions: DeviceArray, q: DeviceArray,
                   k: DeviceArray, v: DeviceArray, *, q_heads: int, kv_heads: int,
                   head_dim: int, theta: float, stream: StreamLike = None) -> None:
    """Split ``qkv`` (``float32[rows, (q_heads + 2 kv_heads) * head_dim]``, the packed
    projection) into ``q`` ``[rows, q_heads, head_dim]``, ``k`` and ``v`` ``[rows, kv_heads,
    head_dim]``, rotating q and k by RoPE at ``positions`` (``int32[rows]``): dims ``i`` and
    ``i + head_dim/2`` by ``pos · theta^(-2i/head_dim)`` (Llama's rotate-half)."""
    heads = q_heads + 2 * kv_heads
    need_array(qkv, "qkv", np.float32, 2, device=device)
    rows = qkv.shape[0]
    if head_dim % 2 or qkv.shape[1] != heads * head_dim:
        raise InvalidArgument(f"qkv: shape {qkv.shape}, expected (rows, {heads * head_dim}) for "
                              f"{q_heads} + 2 x {kv_heads} heads of an even head_dim {head_dim}")
    need_array(positions, "positions", np.int32, 1, device=device)
    if positions.shape != (rows,):
        raise InvalidArgument(f"positions: shape {positions.shape}, expected ({rows},)")
    _shape(q, "q", (rows, q_heads, head_dim), writable=True, device=device)
    _shape(k, "k", (rows, kv_heads, head_dim), writable=True, device=device)
    _shape(v, "v", (rows, kv_heads, head_dim), writable=True, device=device)
    n = rows * heads * head_dim // 2
    if n == 0:
        return
    kern = device.kernel(SOURCE, "pkv_qkv_rope_split_f32", "pppppiiiif", dependent_launch=True)
    kern((math.ceil(n / ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), qkv, positions, q, k, v,
         rows, q_heads, kv_heads, head_dim, float(theta), stream=stream)


def silu_mul(device: Device, gate_up: DeviceArray, out: DeviceArray, *,
             stream: StreamLike = None) -> None:
    """``out = silu(gate) · up`` for ``gate_up`` ``float32[rows, 2·ffn]`` packed ``[gate |
    up]``; ``out`` ``float32[rows, ffn]``."""
    rows, ffn = _check_gate_up(device, gate_up, out, 1)
    n = rows * ffn
    if n == 0:
        return
    kern = device.kernel(SOURCE, "pkv_silu_mul_f32", "ppii", dependent_launch=True)
    kern((math.ceil(n / ELEMENTWISE_THREADS),), (ELEMENTWISE_THREADS,), gate_up, out, rows,
         ffn, stream=stream)


def _check_gate_up(device: Device, gate_up: DeviceArray, out: DeviceArray | None,
                   multiple: int) -> tuple[int, int]:
    need_array(gate_up, "gate_up", np.float32, 2, device=device)
    rows, two_ffn = gate_up.shape
    if two_ffn % (2 * multiple):
        raise InvalidArgument(f"gate_up: {two_ffn} columns, expected an even 2 x ffn"
                              + (f" with ffn a multiple of {multiple}" if multiple > 1 else ""))
    if out is not None:
        _shape(out, "out", (rows, two_ffn // 2), writable=True, device=device)
    return rows, two_ffn // 2


def silu_mul_prep(device: Device, gate_up: DeviceArray, out: DeviceArray | None,
                  prepared: PreparedX, *, stream: StreamLike = None) -> None:
    """:func:`silu_mul` that also writes its result as the prepared x of the down
    projection's tensor-core GEMV (``prepared = gemv.prepared_x()``): the bytes
    ``gemv.prepare(out)`` writes, one launch instead of two. ``out`` may be ``None``
    (not written); ``ffn % 256 == 0``."""
    rows, ffn = _check_gate_up(device, gate_up, out, 256)
    check_prepared(prepared, rows, ffn, device)
    warps = rows * ffn // 256
    if warps == 0:
        return
    kern = device.kernel(SOURCE, "pkv_silu_mul_prep_f32", "ppppiiii", dependent_launch=True)
    per_block = ELEMENTWISE_THREADS // 32  # a 32-lane warp per (256-group, row)
    kern((math.ceil(warps / per_block),), (ELEMENTWISE_THREADS,), gate_up,
         0 if out is None else out, prepared.xq, prepared.xs, rows, ffn, prepared.tiles,
         int(prepared.rotate), stream=stream)

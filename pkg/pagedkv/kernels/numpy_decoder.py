"""Float64 NumPy references of ``hip/decode.hip`` and of a whole decode step
(:class:`pagedkv.kernels.decoder.DecoderStep`): what the GPU tests and ``pagedkv.bench
decode``'s correctness check compare against.

The step reference dequantizes the stored weights with the CPU codecs
(:func:`pagedkv.quant.dequantize`, original basis) and computes every product, norm,
rotation and softmax in float64. Attention reads the KV a pool holds (the caller passes the
pool's contents after the step, so the reference sees the rounding the pool applied to
this step's K/V; :func:`decode_step` returns its own unrounded K/V for checking that
rounding separately).
"""

from __future__ import annotations

import numpy as np

__all__ = ["add_rmsnorm", "attention", "decode_step", "qkv_rope_split", "rope", "silu_mul"]


def add_rmsnorm(x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray,
                eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(x + residual, rmsnorm(x + residual) · weight)`` in float64."""
    x = np.asarray(x, np.float64) + (0 if residual is None else np.asarray(residual, np.float64))
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)
    return x, y


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of ``x`` ``[rows, heads, head_dim]`` at ``positions[rows]``."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    inv_freq = theta ** (-2.0 * np.arange(half) / x.shape[-1])
    ang = np.asarray(positions, np.float64)[:, None, None] * inv_freq
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def qkv_rope_split(qkv: np.ndarray, positions: np.ndarray, *, q_heads: int, kv_heads: int,
                   head_dim: int, theta: float):
    """``(q, k, v)`` of a packed QKV row block, q and k rotated."""
    qkv = np.asarray(qkv, np.float64).reshape(qkv.shape[0], -1, head_dim)
    q, k, v = (qkv[:, :q_heads], qkv[:, q_heads:q_heads + kv_heads],
               qkv[:, q_heads + kv_heads:])
    return rope(q, positions, theta), rope(k, positions, theta), v


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    g, u = np.split(np.asarray(gate_up, np.float64), 2, axis=-1)
    return g / (1 + np.exp(-g)) * u


def attention(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray]) -> np.ndarray:
    """One query token per sequence (``q`` ``[seqs, heads, d]``) over each sequence's
    ``keys[s]``, ``values[s]`` (``[tokens, kv_heads, d]``, float), scale ``d^-0.5``."""
    seqs, heads, d = q.shape
    out = np.zeros((seqs, heads, d))
    for s in range(seqs):
        k, v = np.asarray(keys[s], np.float64), np.asarray(values[s], np.float64)
        group = heads // k.shape[1]
        for h in range(heads):
            logits = k[:, h // group] @ q[s, h] * d ** -0.5
            p = np.exp(logits - logits.max())
            out[s, h] = (p / p.sum()) @ v[:, h // group]
    return out


def decode_step(host_weights, x: np.ndarray, positions: np.ndarray, kv_after) -> dict:
    """The step of :class:`~pagedkv.kernels.decoder.DecoderStep` in float64.

    ``x``: input hidden states ``[seqs, d_model]``; ``positions``: this token's position per
    sequence; ``kv_after(layer, seq) -> (k, v)``: that sequence's K and V (``[positions[s] +
    1, kv_heads, head_dim]`` float) in the pool after the step. Returns ``logits``, the
    residual stream ``x`` and per layer the unrounded ``k``, ``v`` of this token."""
    from pagedkv import quant
    s, fmt = host_weights.shape, host_weights.fmt

    def proj(raw, name, act):
        m, k = s.matrix_shape(name)
        w = quant.dequantize(raw, fmt, (m, k)).astype(np.float64)
        return act @ w.T

    x = np.asarray(x, np.float64)
    seqs = x.shape[0]
    new_k, new_v = [], []
    down = None
    for layer in range(s.num_layers):
        lw = host_weights.layers[layer]
        x, h = add_rmsnorm(x, down, host_weights.attn_norm[layer], s.eps)
        q, k, v = qkv_rope_split(proj(lw["qkv"], "qkv", h), positions, q_heads=s.q_heads,
                                 kv_heads=s.kv_heads, head_dim=s.head_dim, theta=s.rope_theta)
        new_k.append(k)
        new_v.append(v)
        cache = [kv_after(layer, i) for i in range(seqs)]
        a = attention(q, [c[0] for c in cache], [c[1] for c in cache])
        o = proj(lw["o"], "o", a.reshape(seqs, -1))
        x, h = add_rmsnorm(x, o, host_weights.ffn_norm[layer], s.eps)
        down = proj(lw["down"], "down", silu_mul(proj(lw["gate_up"], "gate_up", h)))
    x, h = add_rmsnorm(x, down, host_weights.final_norm, s.eps)
    return {"logits": proj(host_weights.lm_head, "lm_head", h), "x": x, "k": new_k,
            "v": new_v}

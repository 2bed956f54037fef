"""Forward pass of the reference transformer in NumPy (float32).

Parity rule (DESIGN "Reference model and parity"): every reduction, transcendental and matrix
product runs on one token row at a time, with shapes that depend only on that token's
position, never on how many tokens the call carries or which sequences run beside it. BLAS
may pick a different kernel (and summation order) for a different shape; with per-row shapes
the flat and the paged path, a prefill in one chunk or in many, compute identical bits.
Only exact elementwise operations (``+``, ``*``) touch whole ``[n, ...]`` arrays.
"""

from __future__ import annotations

import numpy as np

from pagedkv.reference.config import ReferenceConfig
from pagedkv.reference.kv_paths import KVPath
from pagedkv.reference.weights import layer_operands

__all__ = ["NumpyTransformer", "apply_rope", "rope_tables"]


def rope_tables(config: ReferenceConfig) -> tuple[np.ndarray, np.ndarray]:
    """``cos``, ``sin`` as ``float32[max_position, head_dim / 2]`` (computed once in float64)."""
    half = config.head_dim // 2
    inv_freq = config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2.0 / config.head_dim)
    angles = np.arange(config.max_position, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x, positions, cos_table, sin_table, concatenate):
    """Rotate ``x[n, heads, head_dim]`` at ``positions`` (halves layout, as in Llama/NeoX).

    Backend-neutral: ``concatenate`` is ``np.concatenate`` or ``mx.concatenate``; only exact
    elementwise products and sums touch the data, so it is safe on whole chunks.
    """
    half = x.shape[-1] // 2
    cos = cos_table[positions][:, None, :]
    sin = sin_table[positions][:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class NumpyTransformer:
    """Holds the weights as ``[in, out]`` float32 matrices so a token row is ``x @ w``."""

    def __init__(self, config: ReferenceConfig, weights: dict[str, np.ndarray]) -> None:
        self.config = config
        self.embed = np.ascontiguousarray(weights["model.embed_tokens.weight"])
        self.lm_head = np.ascontiguousarray(self.embed.T)
        self.final_norm = weights["model.norm.weight"]
        self.layers = [layer_operands(weights, i) for i in range(config.num_layers)]
        self.cos, self.sin = rope_tables(config)
        self.scale = np.float32(1.0 / np.sqrt(config.head_dim))

    def _rms_norm(self, row: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(row * row, dtype=np.float32)
        inv_rms = np.float32(1.0) / np.sqrt(var + np.float32(self.config.rms_norm_eps))
        return row * inv_rms * weight

    def forward(self, tokens: np.ndarray, start: int, kv: KVPath) -> np.ndarray:
        """Logits ``float32[n, vocab]`` of ``tokens`` (int64) at positions ``start ..``, whose
        positions ``kv`` has already reserved (``kv.num_tokens == start + n``)."""
        c = self.config
        n = len(tokens)
        positions = np.arange(start, start + n)
        group = c.queries_per_kv_head
        x = self.embed[tokens]
        for layer, w in enumerate(self.layers):
            q = np.empty((n, c.num_heads * c.head_dim), np.float32)
            k = np.empty((n, c.num_kv_heads * c.head_dim), np.float32)
            # [n, kv_heads * head_dim] rows here, [n, kv_heads, head_dim] once reshaped
            v: np.ndarray = np.empty((n, c.num_kv_heads * c.head_dim), np.float32)
            for i in range(n):
                h = self._rms_norm(x[i], w["attn_norm"])
                q[i] = h @ w["wq"]
                k[i] = h @ w["wk"]
                v[i] = h @ w["wv"]
            q = apply_rope(q.reshape(n, c.num_heads, c.head_dim), positions,
                           self.cos, self.sin, np.concatenate)
            k = apply_rope(k.reshape(n, c.num_kv_heads, c.head_dim), positions,
                           self.cos, self.sin, np.concatenate)
            v = v.reshape(n, c.num_kv_heads, c.head_dim)
            kv.write(layer, k, v)
            keys, values = kv.read(layer)
            # [kv_heads, tokens, head_dim]: each head's history is one contiguous matrix.
            keys = np.ascontiguousarray(np.asarray(keys).transpose(1, 0, 2))
            values = np.ascontiguousarray(np.asarray(values).transpose(1, 0, 2))
            out = np.empty((n, c.hidden_size), np.float32)
            for i in range(n):
                visible = start + i + 1
                attn = np.empty((c.num_heads, c.head_dim), np.float32)
                for g in range(c.num_kv_heads):
                    qg = q[i, g * group:(g + 1) * group]              # [group, head_dim]
                    scores = (keys[g, :visible] @ qg.T) * self.scale  # [visible, group]
                    scores = np.exp(scores - scores.max(axis=0))
                    probs = scores / scores.sum(axis=0)
                    attn[g * group:(g + 1) * group] = probs.T @ values[g, :visible]
                row = x[i] + attn.reshape(-1) @ w["wo"]
                h = self._rms_norm(row, w["mlp_norm"])
                gate = h @ w["w_gate"]
                act = gate / (np.float32(1.0) + np.exp(-gate)) * (h @ w["w_up"])
                out[i] = row + act @ w["w_down"]
            x = out
        logits = np.empty((n, c.vocab_size), np.float32)
        for i in range(n):
            logits[i] = self._rms_norm(x[i], self.final_norm) @ self.lm_head
        return logits

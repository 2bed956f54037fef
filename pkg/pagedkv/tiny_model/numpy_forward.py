"""Forward pass of the reference transformer in NumPy (float32).

Parity rule (docs/development.md, 'Reference model and parity'): every reduction, transcendental and
matrix
product runs on one token row at a time, with shapes that depend only on that token's
position, never on how many tokens the call carries or which sequences run beside it. BLAS
may pick a different kernel (and summation order) for a different shape; with per-row shapes
the flat and the paged path, a prefill in one chunk or in many, compute identical bits.
Only exact elementwise operations (``+``, ``*``) touch whole ``[n, ...]`` arrays.
"""

from __future__ import annotations

import numpy as np

from pagedkv.tiny_model.config import ReferenceConfig
from pagedkv.tiny_model.kv_paths import KVPath
from pagedkv.tiny_model.weights import layer_operands

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
        self.xp = np

    def rms_norm(self, row: np.ndarray, weight: np.ndarray) -> np.ndarray:
        var = np.mean(row * row, dtype=np.float32)
        inv_rms = np.float32(1.0) / np.sqrt(var + np.float32(self.config.rms_norm_eps))
        return row * inv_rms * weight

    def embed_rows(self, tokens: np.ndarray) -> np.ndarray:
        return self.embed[tokens]

    @staticmethod
    def rows_done(rows: list) -> np.ndarray:
        """A layer's output rows as one ``[n, hidden]`` array (a copy: no arithmetic)."""
        return np.stack(rows)

    def project_qkv(self, x: np.ndarray, w: dict, positions: np.ndarray, *, with_kv: bool
                     ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Roped ``q[n, heads, head_dim]`` and, with ``with_kv``, roped ``k`` and ``v``
        ``[n, kv_heads, head_dim]`` of rows ``x[n, hidden]`` (one row at a time)."""
        c = self.config
        n = len(x)
        q = np.empty((n, c.num_heads * c.head_dim), np.float32)
        k = np.empty((n, c.num_kv_heads * c.head_dim), np.float32) if with_kv else None
        v = np.empty((n, c.num_kv_heads * c.head_dim), np.float32) if with_kv else None
        for i in range(n):
            h = self.rms_norm(x[i], w["attn_norm"])
            q[i] = h @ w["wq"]
            if k is not None and v is not None:
                k[i] = h @ w["wk"]
                v[i] = h @ w["wv"]
        q = apply_rope(q.reshape(n, c.num_heads, c.head_dim), positions,
                       self.cos, self.sin, np.concatenate)
        if k is None or v is None:
            return q, None, None
        k = apply_rope(k.reshape(n, c.num_kv_heads, c.head_dim), positions,
                       self.cos, self.sin, np.concatenate)
        return q, k, v.reshape(n, c.num_kv_heads, c.head_dim)

    @staticmethod
    def heads_major(keys, values) -> tuple[np.ndarray, np.ndarray]:
        """``[kv_heads, tokens, head_dim]``: each head's history is one contiguous matrix."""
        return (np.ascontiguousarray(np.asarray(keys).transpose(1, 0, 2)),
                np.ascontiguousarray(np.asarray(values).transpose(1, 0, 2)))

    def attend(self, q_row: np.ndarray, keys: np.ndarray, values: np.ndarray, lo: int,
                hi: int) -> np.ndarray:
        """Attention output ``[heads * head_dim]`` of one token's ``q_row[heads, head_dim]``
        over rows ``[lo, hi)`` of heads-major ``keys``/``values``."""
        c = self.config
        group = c.queries_per_kv_head
        attn = np.empty((c.num_heads, c.head_dim), np.float32)
        for g in range(c.num_kv_heads):
            qg = q_row[g * group:(g + 1) * group]              # [group, head_dim]
            scores = (keys[g, lo:hi] @ qg.T) * self.scale      # [hi - lo, group]
            scores = np.exp(scores - scores.max(axis=0))
            probs = scores / scores.sum(axis=0)
            attn[g * group:(g + 1) * group] = probs.T @ values[g, lo:hi]
        return attn.reshape(-1)

    def mlp_residual(self, row: np.ndarray, w: dict) -> np.ndarray:
        """``row + MLP(norm(row))`` for one token row (SwiGLU)."""
        h = self.rms_norm(row, w["mlp_norm"])
        gate = h @ w["w_gate"]
        act = gate / (np.float32(1.0) + np.exp(-gate)) * (h @ w["w_up"])
        return row + act @ w["w_down"]

    def lm_logits(self, x: np.ndarray) -> np.ndarray:
        logits = np.empty((len(x), self.config.vocab_size), np.float32)
        for i in range(len(x)):
            logits[i] = self.rms_norm(x[i], self.final_norm) @ self.lm_head
        return logits

    def forward(self, tokens: np.ndarray, start: int, kv: KVPath) -> np.ndarray:
        """Logits ``float32[n, vocab]`` of ``tokens`` (int64) at positions ``start ..``, whose
        positions ``kv`` has already reserved (``kv.num_tokens == start + n``)."""
        c = self.config
        n = len(tokens)
        positions = np.arange(start, start + n)
        x = self.embed_rows(tokens)
        for layer, w in enumerate(self.layers):
            q, k, v = self.project_qkv(x, w, positions, with_kv=True)
            kv.write(layer, k, v)
            keys, values = self.heads_major(*kv.read(layer))
            out = np.empty((n, c.hidden_size), np.float32)
            for i in range(n):
                attn = self.attend(q[i], keys, values, 0, start + i + 1)
                out[i] = self.mlp_residual(x[i] + attn @ w["wo"], w)
            x = out
        return self.lm_logits(x)

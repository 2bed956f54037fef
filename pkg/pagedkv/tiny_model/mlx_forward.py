"""Forward pass of the reference transformer in MLX (float32), the same math as NumPy's.

Imported only when a model is built with ``backend="mlx"``: ``import pagedkv`` never imports
MLX. The per-row rule of :mod:`pagedkv.tiny_model.numpy_forward` holds here too, so the flat
and the paged path are bit-identical on MLX; NumPy and MLX agree within
:data:`pagedkv.tiny_model.model.NUMPY_MLX_LOGITS_ATOL`, not bitwise (different kernels).
"""

from __future__ import annotations

import numpy as np

from pagedkv.tiny_model.config import ReferenceConfig
from pagedkv.tiny_model.kv_paths import KVPath
from pagedkv.tiny_model.numpy_forward import apply_rope, rope_tables
from pagedkv.tiny_model.weights import layer_operands

__all__ = ["MlxTransformer"]


class MlxTransformer:
    def __init__(self, config: ReferenceConfig, weights: dict[str, np.ndarray]) -> None:
        import mlx.core as mx

        self.mx = self.xp = mx
        self.config = config
        self.embed = mx.array(weights["model.embed_tokens.weight"])
        self.lm_head = mx.array(np.ascontiguousarray(weights["model.embed_tokens.weight"].T))
        self.final_norm = mx.array(weights["model.norm.weight"])
        self.layers = [{name: mx.array(w) for name, w in layer_operands(weights, i).items()}
                       for i in range(config.num_layers)]
        cos, sin = rope_tables(config)
        self.cos, self.sin = mx.array(cos), mx.array(sin)
        self.scale = float(1.0 / np.sqrt(config.head_dim))

    def rms_norm(self, row, weight):
        mx = self.mx
        var = mx.mean(row * row)
        return row * mx.rsqrt(var + self.config.rms_norm_eps) * weight

    def embed_rows(self, tokens: np.ndarray) -> list:
        mx = self.mx
        return [row for row in self.embed[mx.array(tokens.astype(np.int32))]]

    def project_qkv(self, x: list, w: dict, positions: np.ndarray, *, with_kv: bool):
        """Roped ``q[n, heads, head_dim]`` and, with ``with_kv``, roped and evaluated ``k``
        and ``v`` ``[n, kv_heads, head_dim]`` of the rows ``x`` (one row at a time)."""
        mx = self.mx
        c = self.config
        n = len(x)
        pos = mx.array(positions.astype(np.int32))
        normed = [self.rms_norm(row, w["attn_norm"]) for row in x]
        q = mx.stack([h @ w["wq"] for h in normed]).reshape(n, c.num_heads, c.head_dim)
        q = apply_rope(q, pos, self.cos, self.sin, mx.concatenate)
        if not with_kv:
            return q, None, None
        k = mx.stack([h @ w["wk"] for h in normed]).reshape(n, c.num_kv_heads, c.head_dim)
        v = mx.stack([h @ w["wv"] for h in normed]).reshape(n, c.num_kv_heads, c.head_dim)
        k = apply_rope(k, pos, self.cos, self.sin, mx.concatenate)
        mx.eval(k, v)
        return q, k, v

    def heads_major(self, keys, values):
        mx = self.mx
        return (mx.contiguous(mx.array(keys).transpose(1, 0, 2)),
                mx.contiguous(mx.array(values).transpose(1, 0, 2)))

    def attend(self, q_row, keys, values, lo: int, hi: int):
        """Attention output ``[heads * head_dim]`` of one token over rows ``[lo, hi)``."""
        mx = self.mx
        c = self.config
        group = c.queries_per_kv_head
        heads = []
        for g in range(c.num_kv_heads):
            qg = q_row[g * group:(g + 1) * group]
            scores = (keys[g, lo:hi] @ qg.T) * self.scale
            scores = mx.exp(scores - mx.max(scores, axis=0))
            probs = scores / mx.sum(scores, axis=0)
            heads.append(probs.T @ values[g, lo:hi])
        return mx.concatenate(heads, axis=0).reshape(-1)

    def mlp_residual(self, row, w: dict):
        h = self.rms_norm(row, w["mlp_norm"])
        gate = h @ w["w_gate"]
        act = gate * self.mx.sigmoid(gate) * (h @ w["w_up"])
        return row + act @ w["w_down"]

    def rows_done(self, rows: list) -> list:
        """A layer's output rows, evaluated (keeps each lazy graph one layer deep)."""
        self.mx.eval(rows)
        return rows

    def lm_logits(self, x: list) -> np.ndarray:
        mx = self.mx
        logits = mx.stack([self.rms_norm(row, self.final_norm) @ self.lm_head for row in x])
        mx.eval(logits)
        return np.array(logits, dtype=np.float32)

    def forward(self, tokens: np.ndarray, start: int, kv: KVPath) -> np.ndarray:
        """Same contract as :meth:`NumpyTransformer.forward`; returns NumPy
        ``float32[n, vocab]``."""
        n = len(tokens)
        positions = np.arange(start, start + n)
        x = self.embed_rows(tokens)
        for layer, w in enumerate(self.layers):
            q, k, v = self.project_qkv(x, w, positions, with_kv=True)
            kv.write(layer, k, v)
            keys, values = self.heads_major(*kv.read(layer))
            x = self.rows_done([
                self.mlp_residual(x[i] + self.attend(q[i], keys, values, 0, start + i + 1)
                                   @ w["wo"], w)
                for i in range(n)])
        return self.lm_logits(x)

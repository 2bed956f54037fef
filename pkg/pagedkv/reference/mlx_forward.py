"""Forward pass of the reference transformer in MLX (float32), the same math as NumPy's.

Imported only when a model is built with ``backend="mlx"``: ``import pagedkv`` never imports
MLX. The per-row rule of :mod:`pagedkv.reference.numpy_forward` holds here too, so the flat
and the paged path are bit-identical on MLX; NumPy and MLX agree within
:data:`pagedkv.reference.model.NUMPY_MLX_LOGITS_ATOL`, not bitwise (different kernels).
"""

from __future__ import annotations

import numpy as np

from pagedkv.reference.config import ReferenceConfig
from pagedkv.reference.kv_paths import KVPath
from pagedkv.reference.numpy_forward import apply_rope, rope_tables
from pagedkv.reference.weights import layer_operands

__all__ = ["MlxTransformer"]


class MlxTransformer:
    def __init__(self, config: ReferenceConfig, weights: dict[str, np.ndarray]) -> None:
        import mlx.core as mx

        self.mx = mx
        self.config = config
        self.embed = mx.array(weights["model.embed_tokens.weight"])
        self.lm_head = mx.array(np.ascontiguousarray(weights["model.embed_tokens.weight"].T))
        self.final_norm = mx.array(weights["model.norm.weight"])
        self.layers = [{name: mx.array(w) for name, w in layer_operands(weights, i).items()}
                       for i in range(config.num_layers)]
        cos, sin = rope_tables(config)
        self.cos, self.sin = mx.array(cos), mx.array(sin)
        self.scale = float(1.0 / np.sqrt(config.head_dim))

    def _rms_norm(self, row, weight):
        mx = self.mx
        var = mx.mean(row * row)
        return row * mx.rsqrt(var + self.config.rms_norm_eps) * weight

    def forward(self, tokens: np.ndarray, start: int, kv: KVPath) -> np.ndarray:
        """Same contract as :meth:`NumpyTransformer.forward`; returns NumPy
        ``float32[n, vocab]``."""
        mx = self.mx
        c = self.config
        n = len(tokens)
        positions = mx.array(np.arange(start, start + n, dtype=np.int32))
        group = c.queries_per_kv_head
        x = [row for row in self.embed[mx.array(tokens.astype(np.int32))]]
        for layer, w in enumerate(self.layers):
            normed = [self._rms_norm(row, w["attn_norm"]) for row in x]
            q = mx.stack([h @ w["wq"] for h in normed]).reshape(n, c.num_heads, c.head_dim)
            k = mx.stack([h @ w["wk"] for h in normed]).reshape(n, c.num_kv_heads, c.head_dim)
            v = mx.stack([h @ w["wv"] for h in normed]).reshape(n, c.num_kv_heads, c.head_dim)
            q = apply_rope(q, positions, self.cos, self.sin, mx.concatenate)
            k = apply_rope(k, positions, self.cos, self.sin, mx.concatenate)
            mx.eval(k, v)
            kv.write(layer, k, v)
            keys, values = kv.read(layer)
            keys = mx.contiguous(mx.array(keys).transpose(1, 0, 2))
            values = mx.contiguous(mx.array(values).transpose(1, 0, 2))
            out = []
            for i in range(n):
                visible = start + i + 1
                heads = []
                for g in range(c.num_kv_heads):
                    qg = q[i, g * group:(g + 1) * group]
                    scores = (keys[g, :visible] @ qg.T) * self.scale
                    scores = mx.exp(scores - mx.max(scores, axis=0))
                    probs = scores / mx.sum(scores, axis=0)
                    heads.append(probs.T @ values[g, :visible])
                row = x[i] + mx.concatenate(heads, axis=0).reshape(-1) @ w["wo"]
                h = self._rms_norm(row, w["mlp_norm"])
                gate = h @ w["w_gate"]
                act = gate * mx.sigmoid(gate) * (h @ w["w_up"])
                out.append(row + act @ w["w_down"])
            mx.eval(out)
            x = out
        logits = mx.stack([self._rms_norm(row, self.final_norm) @ self.lm_head for row in x])
        mx.eval(logits)
        return np.array(logits, dtype=np.float32)

"""Forward pass of the hybrid reference model (NumPy and MLX, float32).

One layer loop for both backends (:class:`HybridTransformer`); the row-level pieces (projections,
one token's attention, the MLP, the logits) are those of the plain model's
:class:`~pagedkv.tiny_model.numpy_forward.NumpyTransformer` and
:class:`~pagedkv.tiny_model.mlx_forward.MlxTransformer`, so a full-attention layer of the
hybrid model computes exactly what a layer of the plain model does. The per-row parity rule
of :mod:`pagedkv.tiny_model.numpy_forward` holds for every layer kind: a sliding token attends
the ``[max(0, p - W + 1), p]`` rows of a heads-major window, whose shape depends only on
``p``; the gated delta net advances one token at a time (:mod:`pagedkv.tiny_model.gated_delta`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.tiny_model.gated_delta import gated_delta_token
from pagedkv.tiny_model.hybrid_config import LINEAR_ATTENTION, SLIDING_ATTENTION, HybridConfig
from pagedkv.tiny_model.hybrid_kv import HybridKVPath
from pagedkv.tiny_model.numpy_forward import NumpyTransformer

if TYPE_CHECKING:  # mlx_forward imports MLX when built: only for the checker
    from pagedkv.tiny_model.mlx_forward import MlxTransformer

__all__ = ["HybridTransformer"]


class HybridTransformer:
    """The layer loop of the hybrid model over a backend's row-level pieces."""

    def __init__(self, config: HybridConfig, weights: dict[str, np.ndarray],
                 backend: str = "numpy") -> None:
        self.config = config
        # The plain model's transformer on the chosen backend, used for its pieces only.
        self.rows: NumpyTransformer | MlxTransformer
        if backend == "mlx":
            from pagedkv.tiny_model.mlx_forward import MlxTransformer
            self.rows = MlxTransformer(config, weights)
        else:
            self.rows = NumpyTransformer(config, weights)
        self.layers: list[dict] = self.rows.layers
        self.xp: Any = self.rows.xp

    def forward(self, tokens: np.ndarray, start: int, kv: HybridKVPath) -> np.ndarray:
        """Logits ``float32[n, vocab]`` of ``tokens`` (int64) at positions ``start ..``, whose
        positions ``kv`` has already reserved (``kv.num_tokens == start + n``)."""
        positions = np.arange(start, start + len(tokens))
        x: Any = self.rows.embed_rows(tokens)
        for layer, w in enumerate(self.layers):
            if self.config.layer_types[layer] == LINEAR_ATTENTION:
                x = self._linear_layer(layer, w, x, kv)
            else:
                x = self._attention_layer(layer, w, x, start, positions, kv)
        return self.rows.lm_logits(x)

    def _attention_layer(self, layer: int, w: dict, x: Any, start: int,
                         positions: np.ndarray, kv: HybridKVPath) -> Any:
        c = self.config
        r = self.rows
        alias = c.kv_anchor(layer) is not None
        q, k, v = r.project_qkv(x, w, positions, with_kv=not alias)
        if not alias:
            kv.write(layer, k, v)
        window = c.sliding_window if c.layer_types[layer] == SLIDING_ATTENTION else None
        # Rows from `first` cover every position a token of this chunk attends.
        first = 0 if window is None else max(0, start - window + 1)
        keys, values = r.heads_major(*kv.read(layer, first))
        out = []
        for i in range(len(positions)):
            p = start + i
            lo = 0 if window is None else max(0, p - window + 1)
            attn = r.attend(q[i], keys, values, lo - first, p + 1 - first)
            out.append(r.mlp_residual(x[i] + attn @ w["wo"], w))
        return r.rows_done(out)

    def _linear_layer(self, layer: int, w: dict, x: Any, kv: HybridKVPath) -> Any:
        c = self.config
        r = self.rows
        shape = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                 c.linear_value_head_dim)
        conv, state = kv.linear_state(layer)
        out = []
        for i in range(len(x)):
            h = r.rms_norm(x[i], w["attn_norm"])
            mixed, conv, state = gated_delta_token(h, w, conv, state, shape, c.rms_norm_eps,
                                                   self.xp)
            out.append(r.mlp_residual(x[i] + mixed, w))
        if self.xp is not np:
            self.xp.eval(conv, state)
        kv.set_linear_state(layer, conv, state)
        return r.rows_done(out)

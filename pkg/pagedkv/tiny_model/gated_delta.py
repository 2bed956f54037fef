"""One token of the gated delta net (Qwen3-Next / Qwen3.5 ``linear_attention``), NumPy or MLX.

The math follows mlx-lm's ``models/gated_delta.py`` (``_gated_delta_step_ops``, ``compute_g``,
``normalize_qk``) and ``qwen3_5.GatedDeltaNet``, without the batch axis:

* causal depthwise conv over the last ``K`` rows of ``[q | k | v]`` (``K - 1`` kept as the
  conv state), then SiLU;
* ``q = l2norm(q) / sqrt(Dk)``, ``k = l2norm(k)`` (``eps`` added to the sum of squares), key
  heads repeated to the value heads;
* ``beta = sigmoid(b)``, ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` per value head;
* ``S = S * g``; ``S += outer(beta * (v - S k), k)``; ``y = S q`` with ``S[Hv, Dv, Dk]``;
* a gated RMSNorm per value head: ``rmsnorm(y) * weight * silu(z)``, then ``out_proj``.

Parity (docs/tiny-model.md, "Chunking invariance"): everything here runs on one token,
with shapes fixed by the config, and the state advances one token at a time in position
order. A prefill in one call, in any split, or token by token therefore performs the same
floating-point operations in the same order: identical bits. (mlx-lm's chunked kernels and
vLLM's chunked scan trade that for speed; the reference model does not.)

``xp`` is ``numpy`` or ``mlx.core``: only operations both spell the same way are used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["L2NORM_EPS", "causal_conv_step", "gated_delta_step", "gated_delta_token",
           "gated_rms_norm", "silu"]

#: Added to the sum of squares before the q/k L2 normalisation (mlx-lm's ``normalize_qk``).
L2NORM_EPS = 1e-6


def silu(x: Any, xp: Any) -> Any:
    return x / (1.0 + xp.exp(-x))


def causal_conv_step(conv_state: Any, row: Any, taps: Any, xp: Any) -> tuple[Any, Any]:
    """One output row of the depthwise causal conv and the next conv state.

    ``conv_state[K - 1, C]`` holds the previous ``K - 1`` input rows, oldest first; ``row[C]``
    is this token's; ``taps[K, C]`` pairs tap ``j`` with window row ``j`` (the newest row
    last). Returns ``(silu(sum_j taps[j] * window[j]), window[1:])``, summed in tap order.
    """
    k = taps.shape[0]
    acc = conv_state[0] * taps[0]
    for j in range(1, k - 1):
        acc = acc + conv_state[j] * taps[j]
    acc = acc + row * taps[k - 1]
    return silu(acc, xp), xp.concatenate([conv_state[1:], row[None]], axis=0)


def gated_delta_step(state: Any, q: Any, k: Any, v: Any, g: Any, beta: Any
                     ) -> tuple[Any, Any]:
    """The delta rule for one token (mlx-lm's ``_gated_delta_step_ops`` without the batch).

    ``state[Hv, Dv, Dk]``, ``q, k[Hv, Dk]`` (already repeated to the value heads),
    ``v[Hv, Dv]``, ``g, beta[Hv]``. Returns ``(y[Hv, Dv], new_state)``.
    """
    state = state * g[:, None, None]
    kv_mem = (state * k[:, None, :]).sum(axis=-1)          # S k      [Hv, Dv]
    delta = (v - kv_mem) * beta[:, None]                   #          [Hv, Dv]
    state = state + k[:, None, :] * delta[:, :, None]      # + delta ⊗ k
    y = (state * q[:, None, :]).sum(axis=-1)               # S q      [Hv, Dv]
    return y, state


def gated_rms_norm(y: Any, z: Any, weight: Any, eps: float, xp: Any) -> Any:
    """``rmsnorm(y) * weight * silu(z)`` over the last axis (``y, z[Hv, Dv]``, ``weight[Dv]``)."""
    var = (y * y).mean(axis=-1, keepdims=True)
    return y / xp.sqrt(var + eps) * weight * silu(z, xp)


def _l2_normalize(x: Any, xp: Any) -> Any:
    return x / xp.sqrt((x * x).sum(axis=-1, keepdims=True) + L2NORM_EPS)


def gated_delta_token(h: Any, w: dict, conv_state: Any, state: Any, shape: tuple[int, ...],
                      eps: float, xp: Any) -> tuple[Any, Any, Any]:
    """The gated-delta-net mixer for one normalised token row ``h[hidden]``.

    ``w``: the layer's operands (:func:`pagedkv.tiny_model.weights.layer_operands`);
    ``shape``: ``(Hk, Hv, Dk, Dv)``. Returns ``(out[hidden], conv_state, state)``, the mixer
    output before the residual and the states after this token.
    """
    hk, hv, dk, dv = shape
    key_dim = hk * dk
    mixed, conv_state = causal_conv_step(conv_state, h @ w["w_qkv"], w["conv_w"], xp)
    q = _l2_normalize(mixed[:key_dim].reshape(hk, dk), xp) * (dk ** -0.5)
    k = _l2_normalize(mixed[key_dim:2 * key_dim].reshape(hk, dk), xp)
    v = mixed[2 * key_dim:].reshape(hv, dv)
    if hv != hk:
        q = xp.repeat(q, hv // hk, axis=0)
        k = xp.repeat(k, hv // hk, axis=0)
    b = h @ w["w_b"]
    a = h @ w["w_a"]
    beta = 1.0 / (1.0 + xp.exp(-b))
    g = xp.exp(w["neg_A"] * xp.logaddexp(a + w["dt_bias"], 0.0))
    y, state = gated_delta_step(state, q, k, v, g, beta)
    z = (h @ w["w_z"]).reshape(hv, dv)
    out = gated_rms_norm(y, z, w["gdn_norm"], eps, xp)
    return out.reshape(-1) @ w["w_out"], conv_state, state

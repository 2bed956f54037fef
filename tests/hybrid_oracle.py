"""A float64 oracle of the hybrid reference model, written independently of its forward pass.

Whole-sequence NumPy (masks instead of windows, ``np.convolve``-style padding instead of a
rolling conv state, einsum instead of per-row products), so it shares no code with
``pagedkv.tiny_model`` beyond reading the weights. It is what the float32 per-row forward is
checked against: same greedy tokens, logits within a float32 tolerance.
"""

from __future__ import annotations

import numpy as np


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    d = x.shape[-1]
    inv = theta ** (-np.arange(d // 2) * 2.0 / d)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _attention(c, W, p, h, positions, window, kv_of_anchor):
    n = len(h)
    q = _rope((h @ W[p + "self_attn.q_proj.weight"].T).reshape(n, c.num_heads, c.head_dim),
              positions, c.rope_theta)
    if kv_of_anchor is None:
        k = _rope((h @ W[p + "self_attn.k_proj.weight"].T).reshape(n, c.num_kv_heads,
                                                                   c.head_dim),
                  positions, c.rope_theta)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(n, c.num_kv_heads, c.head_dim)
    else:
        k, v = kv_of_anchor
    rep = c.num_heads // c.num_kv_heads
    kk, vv = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("ihd,jhd->hij", q, kk) / np.sqrt(c.head_dim)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= i - j < window
    scores = np.where(allowed[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    out = np.einsum("hij,jhd->ihd", probs, vv).reshape(n, -1)
    return out @ W[p + "self_attn.o_proj.weight"].T, (k, v)


def _gated_delta_net(c, W, p, h):
    n = len(h)
    hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
    dk, dv, kern = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim
    qkv = h @ W[p + "linear_attn.in_proj_qkv.weight"].T                  # [n, C]
    taps = W[p + "linear_attn.conv1d.weight"][:, 0, :]                   # [C, K]
    padded = np.concatenate([np.zeros((kern - 1, qkv.shape[1])), qkv])
    conv = np.stack([(padded[t:t + kern].T * taps).sum(axis=1) for t in range(n)])
    conv = _silu(conv)
    kd = hk * dk
    q = conv[:, :kd].reshape(n, hk, dk)
    k = conv[:, kd:2 * kd].reshape(n, hk, dk)
    v = conv[:, 2 * kd:].reshape(n, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q, k = np.repeat(q, hv // hk, axis=1), np.repeat(k, hv // hk, axis=1)
    beta = 1.0 / (1.0 + np.exp(-(h @ W[p + "linear_attn.in_proj_b.weight"].T)))
    a = h @ W[p + "linear_attn.in_proj_a.weight"].T
    g = np.exp(-np.exp(W[p + "linear_attn.A_log"]) * np.log1p(
        np.exp(a + W[p + "linear_attn.dt_bias"])))
    state = np.zeros((hv, dv, dk))
    y = np.empty((n, hv, dv))
    for t in range(n):
        state = state * g[t][:, None, None]
        delta = beta[t][:, None] * (v[t] - np.einsum("hvk,hk->hv", state, k[t]))
        state = state + np.einsum("hv,hk->hvk", delta, k[t])
        y[t] = np.einsum("hvk,hk->hv", state, q[t])
    z = (h @ W[p + "linear_attn.in_proj_z.weight"].T).reshape(n, hv, dv)
    out = _rms(y, W[p + "linear_attn.norm.weight"], c.rms_norm_eps) * _silu(z)
    return out.reshape(n, -1) @ W[p + "linear_attn.out_proj.weight"].T


def oracle_logits(config, weights, tokens) -> np.ndarray:
    """float64 logits ``[n, vocab]`` of ``tokens`` at positions ``0 ..``."""
    c = config
    W = {name: w.astype(np.float64) for name, w in weights.items()}
    tokens = np.asarray(tokens)
    positions = np.arange(len(tokens), dtype=np.float64)
    x = W["model.embed_tokens.weight"][tokens]
    anchors = dict(c.kv_shared_layers)
    layer_kv = {}
    for layer, kind in enumerate(c.layer_types):
        p = f"model.layers.{layer}."
        h = _rms(x, W[p + "input_layernorm.weight"], c.rms_norm_eps)
        if kind == "linear_attention":
            mixed = _gated_delta_net(c, W, p, h)
        else:
            window = c.sliding_window if kind == "sliding_attention" else None
            anchor_kv = layer_kv[anchors[layer]] if layer in anchors else None
            mixed, layer_kv[layer] = _attention(c, W, p, h, positions, window, anchor_kv)
        x = x + mixed
        h = _rms(x, W[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        act = _silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + act @ W[p + "mlp.down_proj.weight"].T
    x = _rms(x, W["model.norm.weight"], c.rms_norm_eps)
    return x @ W["model.embed_tokens.weight"].T

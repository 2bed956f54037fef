"""Seeded random weights of the reference transformer, and their safetensors file.

Tensor names and ``[out_features, in_features]`` orientation follow the Hugging Face Llama
checkpoints (and Qwen3.5's ``linear_attn.*`` for the hybrid model's gated-delta-net layers),
so ``model.safetensors`` looks like any small model to the cold tier and to
``pagedkv inspect``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from pagedkv.errors import BadMetadata, FormatError, InvalidArgumentType, SizeMismatch
from pagedkv.tiny_model.config import ReferenceConfig
from pagedkv.tiny_model.hybrid_config import LINEAR_ATTENTION, HybridConfig, config_from_json_dict

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "check_weights",
    "layer_operands",
    "load_hfqm",
    "load_model",
    "random_weights",
    "save_model",
    "weight_shapes",
]

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def weight_shapes(config: ReferenceConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name and shape, in a fixed order (the order weights are drawn in)."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes.update((p + name, shape) for name, shape in _mixer_shapes(config, layer))
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    return shapes


def _mixer_shapes(config: ReferenceConfig, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """The token mixer's tensors of one layer: attention (Llama names; a KV-shared alias has
    no K/V projections) or a gated delta net (Qwen3.5 names, conv1d as ``[C, 1, K]``)."""
    h = config.hidden_size
    if isinstance(config, HybridConfig) and config.layer_types[layer] == LINEAR_ATTENTION:
        c = config
        hv = c.linear_num_value_heads
        return [("linear_attn.in_proj_qkv.weight", (c.conv_dim, h)),
                ("linear_attn.in_proj_z.weight", (c.linear_value_dim, h)),
                ("linear_attn.in_proj_b.weight", (hv, h)),
                ("linear_attn.in_proj_a.weight", (hv, h)),
                ("linear_attn.conv1d.weight", (c.conv_dim, 1, c.linear_conv_kernel_dim)),
                ("linear_attn.dt_bias", (hv,)),
                ("linear_attn.A_log", (hv,)),
                ("linear_attn.norm.weight", (c.linear_value_head_dim,)),
                ("linear_attn.out_proj.weight", (h, c.linear_value_dim))]
    q_out = config.num_heads * config.head_dim
    kv_out = config.num_kv_heads * config.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("self_attn.q_proj.weight", (q_out, h))]
    if not (isinstance(config, HybridConfig) and config.kv_anchor(layer) is not None):
        shapes += [("self_attn.k_proj.weight", (kv_out, h)),
                   ("self_attn.v_proj.weight", (kv_out, h))]
    return shapes + [("self_attn.o_proj.weight", (h, q_out))]


# (operand, tensor name in the layer, the form the forward passes want)
_OPERANDS = (
    ("attn_norm", "input_layernorm.weight", "as_is"),
    ("wq", "self_attn.q_proj.weight", "t"),
    ("wk", "self_attn.k_proj.weight", "t"),
    ("wv", "self_attn.v_proj.weight", "t"),
    ("wo", "self_attn.o_proj.weight", "t"),
    ("w_qkv", "linear_attn.in_proj_qkv.weight", "t"),
    ("w_z", "linear_attn.in_proj_z.weight", "t"),
    ("w_b", "linear_attn.in_proj_b.weight", "t"),
    ("w_a", "linear_attn.in_proj_a.weight", "t"),
    ("conv_w", "linear_attn.conv1d.weight", "taps"),
    ("dt_bias", "linear_attn.dt_bias", "as_is"),
    ("neg_A", "linear_attn.A_log", "neg_exp"),
    ("gdn_norm", "linear_attn.norm.weight", "as_is"),
    ("w_out", "linear_attn.out_proj.weight", "t"),
    ("mlp_norm", "post_attention_layernorm.weight", "as_is"),
    ("w_gate", "mlp.gate_proj.weight", "t"),
    ("w_up", "mlp.up_proj.weight", "t"),
    ("w_down", "mlp.down_proj.weight", "t"),
)


def layer_operands(weights: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s weights as the forward passes use them, for the tensors the layer
    has: norms and biases as stored, projections transposed to contiguous ``[in, out]`` so a
    token row is ``x @ w``, the conv as ``[K, C]`` (row ``j`` multiplies the input ``K - 1 -
    j`` tokens back), and ``A_log`` as ``-exp(A_log)`` (float32, computed once)."""
    p = f"model.layers.{layer}."
    operands = {}
    for key, name, form in _OPERANDS:
        w = weights.get(p + name)
        if w is None:
            continue
        if form == "t":
            w = np.ascontiguousarray(w.T)
        elif form == "taps":
            w = np.ascontiguousarray(w[:, 0, :].T)
        elif form == "neg_exp":
            w = -np.exp(w)
        operands[key] = w
    return operands


def random_weights(config: ReferenceConfig) -> dict[str, np.ndarray]:
    """float32 weights drawn from ``numpy.random.default_rng(config.seed)``.

    Matrices are N(0, 1/in_features) so activations keep unit scale through the layers and
    the logits are not degenerate (greedy decoding then produces varied tokens); norm
    weights are 1 + N(0, 0.1). The embedding is N(0, 0.05**2): it is also the LM head, and a
    small one keeps the residual stream from being dominated by the input token (a tied head
    would otherwise echo that token forever).

    Hybrid layers add: ``A_log = log(U(0.05, 1))``, so the decay ``g = exp(-A *
    softplus(a + dt_bias))`` keeps some heads' memory over tens of tokens; ``dt_bias`` follows
    the 1-D rule; conv taps are N(0, 1/K).
    """
    rng = np.random.default_rng(config.seed)
    weights: dict[str, np.ndarray] = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith(".A_log"):
            w = np.log(rng.uniform(0.05, 1.0, shape))
        elif len(shape) == 3:
            w = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            w = 0.05 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        weights[name] = np.ascontiguousarray(w, dtype=np.float32)
    return weights


def save_model(directory: str | os.PathLike, config: ReferenceConfig,
               weights: dict[str, np.ndarray]) -> None:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created if needed)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()},
              os.path.join(directory, WEIGHTS_FILE), metadata={"format": "np"})
    with open(os.path.join(directory, CONFIG_FILE), "w", encoding="utf-8") as f:
        f.write(config.to_json())


def load_model(directory: str | os.PathLike) -> tuple[ReferenceConfig, dict[str, np.ndarray]]:
    """Read what :func:`save_model` wrote; every expected tensor must be there with its shape."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    config_path = os.path.join(directory, CONFIG_FILE)
    weights_path = os.path.join(directory, WEIGHTS_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = config_from_json_dict(json.load(f), path=config_path)
    except json.JSONDecodeError as e:
        raise BadMetadata(f"config.json is not JSON: {e}", path=config_path) from e
    try:
        weights = load_file(weights_path)
    except SafetensorError as e:
        raise FormatError(f"not a readable safetensors file: {e}", path=weights_path) from e
    check_weights(config, weights, path=weights_path)
    return config, weights


def check_weights(config: ReferenceConfig, weights: object, *, path: str | None = None) -> None:
    """Every tensor ``config`` needs is in ``weights`` as a float32 NumPy array of its shape:
    ``FormatError`` for a missing one, ``SizeMismatch`` for a wrong dtype, type or shape."""
    if not isinstance(weights, dict):
        raise InvalidArgumentType(f"weights must be a dict of tensor name -> float32 array, "
                                  f"got {type(weights).__name__}")
    for name, shape in weight_shapes(config).items():
        w = weights.get(name)
        if w is None:
            raise FormatError("missing tensor", path=path, tensor=name)
        if not isinstance(w, np.ndarray) or w.shape != shape or w.dtype != np.float32:
            found = (f"{w.dtype}{list(w.shape)}" if isinstance(w, np.ndarray)
                     else type(w).__name__)
            raise SizeMismatch(f"expected float32{list(shape)}, found {found}", path=path,
                               tensor=name)


def load_hfqm(path: str | os.PathLike) -> tuple[ReferenceConfig, dict[str, np.ndarray]]:
    """Config and float32 weights of a reference model converted to HFQM (``pagedkv convert
    MODEL_DIR -o model.hfq --arch llama``): the config comes from the file's metadata, every
    tensor is dequantized (:meth:`pagedkv.hfqm.reader.HfqmFile.dequantize`) and checked."""
    from pagedkv.hfqm.reader import HfqmFile

    with HfqmFile(path) as f:
        config = config_from_json_dict(f.metadata.get("config"), path=str(path))
        weights: dict[str, np.ndarray] = {}
        for name, shape in weight_shapes(config).items():
            if name not in f:
                raise FormatError("missing tensor", path=str(path), tensor=name)
            w = np.ascontiguousarray(f.dequantize(name), dtype=np.float32)
            if w.shape != shape:
                raise SizeMismatch(f"expected shape {list(shape)}, found {list(w.shape)}",
                                   path=str(path), tensor=name)
            weights[name] = w
    return config, weights

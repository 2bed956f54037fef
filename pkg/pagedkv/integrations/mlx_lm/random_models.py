"""Tiny mlx-lm models with random weights, built from config dicts (no download).

mlx-lm builds any of its architectures from a ``config.json``-style dict; with seeded random
weights that is enough to exercise its real model code (attention, RoPE, masks, the cache
protocol) at a size that runs in milliseconds on a CPU. ``pagedkv demo --engine mlx-lm``,
the integration tests and the benchmarks use these.
"""

from __future__ import annotations

from typing import Any

from pagedkv.errors import InvalidArgument

__all__ = ["ARCHITECTURES", "FULL_ATTENTION_ARCHITECTURES", "random_config", "random_model",
           "save_random_model", "word_tokenizer"]

_BASE: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "rms_norm_eps": 1e-6, "vocab_size": 256, "max_position_embeddings": 8192,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}

#: Architecture name -> tiny config. The first group has only full-attention layers.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen3": dict(_BASE, model_type="qwen3"),
    "llama": dict(_BASE, model_type="llama"),
    "mistral": dict(_BASE, model_type="mistral"),
    "qwen2": dict(_BASE, model_type="qwen2"),
    "phi3": dict(_BASE, model_type="phi3"),
    "gemma2": dict(_BASE, model_type="gemma2", query_pre_attn_scalar=16,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    # Sliding-window and recurrent families (hybrid-model support).
    "gemma3_text": dict(_BASE, model_type="gemma3_text", num_hidden_layers=4,
                        sliding_window=8, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "gpt_oss": dict(_BASE, model_type="gpt_oss", num_hidden_layers=2, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8),
    "qwen3_next": dict(_BASE, model_type="qwen3_next", num_hidden_layers=4,
                       linear_num_value_heads=4, linear_num_key_heads=2,
                       linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
                       decoder_sparse_step=1, shared_expert_intermediate_size=64,
                       mlp_only_layers=[], moe_intermediate_size=64,
                       partial_rotary_factor=0.5, full_attention_interval=2),
}

#: Architectures whose every layer is full attention (what pagedkv pages today).
FULL_ATTENTION_ARCHITECTURES = ("qwen3", "llama", "mistral", "qwen2", "phi3", "gemma2")


def random_config(arch: str = "qwen3", **overrides: Any) -> dict[str, Any]:
    """The tiny config of ``arch`` with ``overrides`` applied (e.g. ``hidden_size=256``)."""
    try:
        config = dict(ARCHITECTURES[arch])
    except KeyError:
        raise InvalidArgument(f"arch: {arch!r} is not one of {sorted(ARCHITECTURES)}") from None
    config.update(overrides)
    return config


def random_model(arch: str = "qwen3", *, dtype: str = "float32", seed: int = 0,
                 **overrides: Any):
    """``(model, config)``: mlx-lm's ``arch`` built from :func:`random_config` with weights
    drawn from ``mx.random`` seeded with ``seed``, cast to ``dtype`` and evaluated."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    config = random_config(arch, **overrides)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if dtype != "float32":
        model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model, config


#: Words of :func:`word_tokenizer` before ``w0``: unknown, end of sequence, three roles.
TOKENIZER_SPECIALS = ("<unk>", "<eos>", "system:", "user:", "assistant:")

#: A chat template that writes ``role: content`` turns in the tokenizer's own words.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def word_tokenizer(vocab_size: int = 256):
    """A Hugging Face fast tokenizer built in memory: one id per whitespace-separated word
    (:data:`TOKENIZER_SPECIALS`, then ``w0``, ``w1``, ...), ``<eos>`` as end of sequence and a
    plain chat template. Text for it is ``"w5 w17 w3"``; any other word is ``<unk>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = list(TOKENIZER_SPECIALS)
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>",
                                   eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_random_model(path, arch: str = "qwen3", *, dtype: str = "float32", seed: int = 0,
                      **overrides: Any):
    """Write a random ``arch`` model and a :func:`word_tokenizer` to ``path`` as an mlx-lm
    model directory (config.json, model.safetensors, tokenizer files) that
    ``mlx_lm.load(path)`` and ``pagedkv serve --model path`` read. Returns the model."""
    import os

    from mlx_lm.utils import save_config, save_model

    model, config = random_model(arch, dtype=dtype, seed=seed, **overrides)
    os.makedirs(path, exist_ok=True)
    save_model(path, model)
    save_config(dict(config), os.path.join(path, "config.json"))
    word_tokenizer(config["vocab_size"]).save_pretrained(path)
    return model

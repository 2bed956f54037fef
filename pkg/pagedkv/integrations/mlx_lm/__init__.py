"""pagedkv as the prompt cache of mlx-lm (docs/integrations/mlx-lm.md).

``PagedPromptCache(model)`` pages the K/V of an mlx-lm model: ``begin(prompt)`` returns a
request whose ``cache`` is the ``prompt_cache=`` of ``generate_step`` / ``stream_generate`` /
``speculative_generate_step``, already holding the longest cached prefix;
``request.end(tokens)`` publishes it for the next request. Needs mlx-lm >= 0.32
(``pip install "pagedkv[mlx-lm]"``); importing this module without it raises ImportError.
"""

from __future__ import annotations

from importlib import metadata

#: The mlx-lm release whose cache protocol this module implements.
MIN_MLX_LM = (0, 32)

try:
    import mlx_lm as _mlx_lm  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"pagedkv.integrations.mlx_lm needs mlx-lm >= {MIN_MLX_LM[0]}.{MIN_MLX_LM[1]}, which "
        f"cannot be imported here ({exc}): pip install 'pagedkv[mlx-lm]'") from None


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


MLX_LM_VERSION = metadata.version("mlx-lm")
if _version_tuple(MLX_LM_VERSION) < MIN_MLX_LM:
    raise ImportError(
        f"pagedkv.integrations.mlx_lm implements mlx-lm {MIN_MLX_LM[0]}.{MIN_MLX_LM[1]}'s cache "
        f"protocol; mlx-lm {MLX_LM_VERSION} is installed: pip install 'mlx-lm>=0.32'")

from pagedkv.integrations.mlx_lm.layer_cache import PagedKVLayerCache
from pagedkv.integrations.mlx_lm.layer_kinds import LayerKind, LayerSpec, layer_specs
from pagedkv.integrations.mlx_lm.paged_attention_cache import PagedAttentionLayerCache
from pagedkv.integrations.mlx_lm.prompt_cache import PagedPromptCache, PagedRequest
from pagedkv.integrations.mlx_lm.sliding_cache import PagedSlidingLayerCache
from pagedkv.integrations.mlx_lm.state_cache import PagedStateLayerCache

__all__ = [
    "MLX_LM_VERSION",
    "LayerKind",
    "LayerSpec",
    "PagedAttentionLayerCache",
    "PagedKVLayerCache",
    "PagedPromptCache",
    "PagedRequest",
    "PagedSlidingLayerCache",
    "PagedStateLayerCache",
    "layer_specs",
]

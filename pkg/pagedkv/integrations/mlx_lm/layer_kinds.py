"""What each entry of mlx-lm's cache list is, read from ``make_prompt_cache(model)``.

mlx-lm has no uniform description of a model's attention layout: each architecture builds its
own cache list (``model.make_cache()``, else one ``KVCache`` per layer). The class of each
entry is the most reliable statement of what the layer needs, so pagedkv reads the kinds
from that list, in its order (the order ``prompt_cache=`` must have), and pages the kinds it
serves. The table of kinds is docs/integrations/mlx-lm.md, "What each model family gets".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedkv.errors import UnsupportedModel

__all__ = ["SERVED_KINDS", "LayerKind", "LayerSpec", "check_served", "layer_specs"]


class LayerKind(enum.Enum):
    """The kind of one entry of a model's cache list."""

    FULL = "full"                # KVCache: every position, causal attention
    SLIDING = "sliding"          # RotatingKVCache: the last `window` positions
    RECURRENT = "recurrent"      # ArraysCache: conv / SSM state, no positions
    COMPOSITE = "composite"      # CacheList: several caches in one layer (e.g. SSM + KV)
    CHUNKED = "chunked"          # ChunkedKVCache: attention within fixed chunks (llama4)
    QUANTIZED = "quantized"      # QuantizedKVCache: mlx-lm's own quantized KV
    CONCATENATE = "concatenate"  # ConcatenateKVCache
    OTHER = "other"              # a class this module does not know


#: mlx-lm cache class name -> kind.
_KIND_OF_CLASS = {
    "KVCache": LayerKind.FULL,
    "RotatingKVCache": LayerKind.SLIDING,
    "ArraysCache": LayerKind.RECURRENT,
    "MambaCache": LayerKind.RECURRENT,
    "CacheList": LayerKind.COMPOSITE,
    "ChunkedKVCache": LayerKind.CHUNKED,
    "QuantizedKVCache": LayerKind.QUANTIZED,
    "ConcatenateKVCache": LayerKind.CONCATENATE,
}

#: Kinds this build pages.
SERVED_KINDS = frozenset({LayerKind.FULL})

#: kind -> what serving it needs (the error message's "missing" part).
_MISSING = {
    LayerKind.SLIDING: "sliding-window layers need the grouped coordinator (windowed block "
                       "tables that free blocks as the window moves), which this build does "
                       "not have yet",
    LayerKind.RECURRENT: "recurrent layers need in-process state checkpoints at block "
                         "boundaries (hybrid-model support), which this build does not have yet",
    LayerKind.COMPOSITE: "a layer holding several caches (e.g. SSM state + KV) needs "
                         "hybrid-model support, which this build does not have yet",
    LayerKind.CHUNKED: "chunked attention (llama4) needs chunk-local block tables, which "
                       "this build does not have",
    LayerKind.QUANTIZED: "mlx-lm's QuantizedKVCache is its own storage; build the model "
                         "cache without kv_bits",
    LayerKind.CONCATENATE: "ConcatenateKVCache layers are not paged",
    LayerKind.OTHER: "pagedkv does not know this cache class",
}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One entry of the model's cache list: its position, kind, mlx-lm class and, for a
    sliding layer, its window in tokens (``keep`` sink tokens included)."""

    index: int
    kind: LayerKind
    cache_class: str
    window: int | None = None

    def __str__(self) -> str:
        window = f", window {self.window} tokens" if self.window is not None else ""
        return f"layer {self.index} ({self.cache_class}: {self.kind.value}{window})"


def layer_specs(model) -> tuple[LayerSpec, ...]:
    """The kind of every entry of ``mlx_lm.models.cache.make_prompt_cache(model)``, in order.

    Builds the (empty) cache list once; nothing runs through the model.
    """
    from mlx_lm.models.cache import make_prompt_cache

    specs = []
    for i, cache in enumerate(make_prompt_cache(model)):
        name = type(cache).__name__
        kind = _KIND_OF_CLASS.get(name, LayerKind.OTHER)
        window = getattr(cache, "max_size", None) if kind is LayerKind.SLIDING else None
        specs.append(LayerSpec(i, kind, name, None if window is None else int(window)))
    return tuple(specs)


def check_served(specs, model_type: str) -> None:
    """``UnsupportedModel`` naming the first layer whose kind this build cannot page."""
    for spec in specs:
        if spec.kind not in SERVED_KINDS:
            kinds = sorted({s.kind.value for s in specs})
            raise UnsupportedModel(
                f"model_type {model_type!r}: {spec} cannot be paged yet: "
                f"{_MISSING[spec.kind]}. Its layer kinds are {kinds}; pagedkv serves "
                f"{sorted(k.value for k in SERVED_KINDS)} layers today (docs/integrations/"
                "mlx-lm.md, 'What each model family gets'); use mlx-lm's own "
                "make_prompt_cache for this model meanwhile",
                layer=spec.index, kind=spec.kind.value, missing=_MISSING[spec.kind])
    if not specs:
        raise UnsupportedModel(f"model_type {model_type!r}: make_prompt_cache returned no "
                               "caches, so there is nothing to page", missing="a KV layer")

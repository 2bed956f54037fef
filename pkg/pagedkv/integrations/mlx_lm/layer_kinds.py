"""What each entry of mlx-lm's cache list is, read from ``make_prompt_cache(model)``.

mlx-lm has no uniform description of a model's attention layout: each architecture builds its
own cache list (``model.make_cache()``, else one ``KVCache`` per layer). The class of each
entry is the most reliable statement of what the layer needs, so pagedkv reads the kinds
from that list, in its order (the order ``prompt_cache=`` must have), and pages the kinds it
serves. Layers past the end of the list that read another layer's K/V (Gemma 4's KV-shared
layers, found through the model's ``previous_kvs``) are listed as aliases of that layer. The
table of kinds is docs/integrations/mlx-lm.md, "What each model family gets".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedkv.errors import UnsupportedModel

__all__ = ["SERVED_KINDS", "LayerKind", "LayerSpec", "check_served", "layer_specs"]


class LayerKind(enum.Enum):
    """The kind of one entry of a model's cache list (or of a KV-shared layer)."""

    FULL = "full"                # KVCache: every position, causal attention
    SLIDING = "sliding"          # RotatingKVCache: the last `window` positions
    RECURRENT = "recurrent"      # ArraysCache: conv / SSM state, no positions
    SHARED = "shared"            # no cache entry: reads the K/V of layer `anchor`
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

#: Kinds this build pages (K/V in the pool, recurrent state in checkpoints, aliases read
#: their anchor's K/V).
SERVED_KINDS = frozenset({LayerKind.FULL, LayerKind.SLIDING, LayerKind.RECURRENT,
                          LayerKind.SHARED})

#: kind -> what serving it needs (the error message's "missing" part).
_MISSING = {
    LayerKind.COMPOSITE: "a layer holding several caches in one entry (CacheList, e.g. SSM "
                         "state + KV in falcon_h1) needs per-entry routing, which this build "
                         "does not have",
    LayerKind.CHUNKED: "chunked attention (llama4) needs chunk-local block tables, which "
                       "this build does not have",
    LayerKind.QUANTIZED: "mlx-lm's QuantizedKVCache is its own storage; build the model "
                         "cache without kv_bits",
    LayerKind.CONCATENATE: "ConcatenateKVCache layers are not paged",
    LayerKind.OTHER: "pagedkv does not page this cache (a class it does not know, or a "
                     "RotatingKVCache keeping attention-sink tokens beyond its window)",
}


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One entry of the model's cache list: its position, kind and mlx-lm class; for a
    sliding layer its window in tokens (``keep`` sink tokens included). A KV-shared layer
    (kind ``SHARED``, class ``"-"``) is a model layer past the cache list whose attention
    reads the K/V of layer ``anchor``."""

    index: int
    kind: LayerKind
    cache_class: str
    window: int | None = None
    anchor: int | None = None

    def __str__(self) -> str:
        if self.kind is LayerKind.SHARED:
            return f"layer {self.index} (KV-shared: reads layer {self.anchor})"
        window = f", window {self.window} tokens" if self.window is not None else ""
        return f"layer {self.index} ({self.cache_class}: {self.kind.value}{window})"


def _shared_kv_sources(model):
    """``previous_kvs`` of the model's text stack (Gemma 4: entry ``j`` is the layer whose
    K/V layer ``j`` reads, ``j`` itself when it computes its own), or ``None``."""
    for path in ((), ("model",), ("language_model",), ("language_model", "model")):
        obj = model
        for name in path:
            obj = getattr(obj, name, None)
        sources = getattr(obj, "previous_kvs", None) if obj is not None else None
        if isinstance(sources, (list, tuple)):
            return [int(s) for s in sources]
    return None


def layer_specs(model) -> tuple[LayerSpec, ...]:
    """The kind of every entry of ``mlx_lm.models.cache.make_prompt_cache(model)``, in order,
    then the KV-shared layers past the list (``SHARED``, with their anchor).

    Builds the (empty) cache list once; nothing runs through the model.
    """
    from mlx_lm.models.cache import make_prompt_cache

    specs = []
    caches = make_prompt_cache(model)
    for i, cache in enumerate(caches):
        name = type(cache).__name__
        kind = _KIND_OF_CLASS.get(name, LayerKind.OTHER)
        window = getattr(cache, "max_size", None) if kind is LayerKind.SLIDING else None
        keep = int(getattr(cache, "keep", 0) or 0)
        if kind is LayerKind.SLIDING and keep:
            kind, name = LayerKind.OTHER, f"{name}(keep={keep})"
        specs.append(LayerSpec(i, kind, name, None if window is None else int(window)))
    sources = _shared_kv_sources(model)
    if sources is not None:
        for j in range(len(caches), len(sources)):
            specs.append(LayerSpec(j, LayerKind.SHARED, "-", anchor=sources[j]))
    return tuple(specs)


def check_served(specs, model_type: str) -> None:
    """``UnsupportedModel`` naming the first layer whose kind this build cannot page, or a
    KV-shared layer whose anchor is not a K/V entry of the cache list."""
    kv = {s.index for s in specs if s.kind in (LayerKind.FULL, LayerKind.SLIDING)}
    for spec in specs:
        if spec.kind not in SERVED_KINDS:
            kinds = sorted({s.kind.value for s in specs})
            raise UnsupportedModel(
                f"model_type {model_type!r}: {spec} cannot be paged: "
                f"{_MISSING[spec.kind]}. Its layer kinds are {kinds}; pagedkv serves "
                f"{sorted(k.value for k in SERVED_KINDS)} layers (docs/integrations/"
                "mlx-lm.md, 'What each model family gets'); use mlx-lm's own "
                "make_prompt_cache for this model",
                layer=spec.index, kind=spec.kind.value, missing=_MISSING[spec.kind])
        if spec.kind is LayerKind.SHARED and spec.anchor not in kv:
            missing = "a K/V anchor for the KV-shared layer"
            raise UnsupportedModel(
                f"model_type {model_type!r}: {spec}, but layer {spec.anchor} is not a "
                "KVCache or RotatingKVCache entry of make_prompt_cache(model), so there is "
                "no K/V to share", layer=spec.index, kind=spec.kind.value, missing=missing)
    if not kv:
        raise UnsupportedModel(f"model_type {model_type!r}: make_prompt_cache returned no "
                               "KVCache or RotatingKVCache entry, so there is nothing to page "
                               "(a model of recurrent layers only keeps no K/V)",
                               missing="a KV layer")

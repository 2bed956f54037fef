"""Shape of the hybrid reference model: full, sliding-window and gated-delta-net layers and
KV-shared aliases (saved as ``config.json``, ``model_type`` still ``pagedkv_reference``).

The layer kinds use Hugging Face's ``layer_types`` names (Gemma 3, gpt-oss, Qwen3.5); the
recurrent layer's fields are Qwen3.5's ``linear_*`` names. See docs/tiny-model.md,
"Hybrid configuration".
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import (
    DuplicateLayer,
    InvalidArgument,
    MissingSharedKVAnchor,
    SharedKVAnchorIsAlias,
    SharedKVIncompatible,
)
from pagedkv.tiny_model.config import ReferenceConfig

__all__ = ["FULL_ATTENTION", "LAYER_TYPES", "LINEAR_ATTENTION", "SLIDING_ATTENTION",
           "HybridConfig"]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
#: Every layer kind a :class:`HybridConfig` accepts.
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)

_HYBRID_INT_FIELDS = ("sliding_window", "linear_num_key_heads", "linear_num_value_heads",
                      "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")


@dataclass(frozen=True)
class HybridConfig(ReferenceConfig):
    """The reference transformer with mixed layer kinds (one MLP after every mixer).

    * ``full_attention``: GQA attention over every earlier position (RoPE, absolute).
    * ``sliding_attention``: the same attention over the last ``sliding_window`` positions,
      the token itself included (position ``p`` sees ``[p - W + 1, p]``); RoPE positions stay
      absolute.
    * ``linear_attention``: a gated delta net (Qwen3-Next / Qwen3.5): causal depthwise conv1d
      of ``linear_conv_kernel_dim`` taps + SiLU over ``[q | k | v]``, L2-normalised q/k, decay
      ``g`` and write strength ``beta`` per value head, state ``S[Hv, Dv, Dk]`` and a gated
      RMSNorm. Per sequence it keeps a conv state ``float32[K - 1, conv_dim]`` and a recurrent
      state ``float32[Hv, Dv, Dk]``.
    * ``kv_shared_layers``: ``(alias, anchor)`` pairs. An alias has its anchor's attention kind
      and its own query, output and MLP weights; it reads the anchor's K/V and writes none
      (Gemma 3n's KV sharing). The anchor comes first and is not an alias itself.

    The defaults: 6 layers ``linear, sliding, full, linear, sliding, full`` with layer 5 an
    alias of layer 2, window 24, and a recurrent layer of 2 key / 4 value heads of 16 with a
    4-tap conv (conv state ``[3, 128]``, recurrent state ``[4, 16, 16]``).
    """

    num_layers: int = 6
    layer_types: tuple[str, ...] = (LINEAR_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION,
                                    LINEAR_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    sliding_window: int = 24
    kv_shared_layers: tuple[tuple[int, int], ...] = ((5, 2),)
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_conv_kernel_dim: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        # JSON gives lists; the frozen config keeps tuples (hashable, comparable).
        if isinstance(self.layer_types, list):
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if isinstance(self.kv_shared_layers, list):
            object.__setattr__(self, "kv_shared_layers",
                               tuple(tuple(p) if isinstance(p, list) else p
                                     for p in self.kv_shared_layers))
        for name in _HYBRID_INT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidArgument(f"HybridConfig.{name} = {value!r}: must be an int > 0")
        if self.linear_conv_kernel_dim < 2:
            raise InvalidArgument(
                f"HybridConfig.linear_conv_kernel_dim = {self.linear_conv_kernel_dim}: must be "
                ">= 2 (the conv state holds the K - 1 previous rows)")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise InvalidArgument(
                f"HybridConfig.linear_num_value_heads = {self.linear_num_value_heads} must be a "
                f"multiple of linear_num_key_heads = {self.linear_num_key_heads}")
        if (not isinstance(self.layer_types, tuple)
                or len(self.layer_types) != self.num_layers):
            raise InvalidArgument(
                f"HybridConfig.layer_types has {len(self.layer_types)} entries for "
                f"num_layers = {self.num_layers}: give one kind per layer")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise InvalidArgument(
                    f"HybridConfig.layer_types[{i}] = {kind!r}: expected one of {LAYER_TYPES}")
        self._check_kv_shared_layers()

    def _check_kv_shared_layers(self) -> None:
        pairs = self.kv_shared_layers
        if not isinstance(pairs, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) for x in p)
                for p in pairs):
            raise InvalidArgument(
                f"HybridConfig.kv_shared_layers = {pairs!r}: expected (alias, anchor) pairs "
                "of layer indices")
        anchors = dict(pairs)
        seen: set[int] = set()
        for alias, anchor in pairs:
            if not 0 <= alias < self.num_layers:
                raise InvalidArgument(
                    f"HybridConfig.kv_shared_layers: alias layer {alias} is outside "
                    f"[0, {self.num_layers})")
            if alias in seen:
                raise DuplicateLayer(alias)
            seen.add(alias)
            if not 0 <= anchor < self.num_layers:
                raise MissingSharedKVAnchor(alias, anchor)
            if anchor in anchors:
                raise SharedKVAnchorIsAlias(alias, anchor, anchors[anchor])
            kind = self.layer_types[alias]
            if kind == LINEAR_ATTENTION or self.layer_types[anchor] != kind:
                raise SharedKVIncompatible(alias, anchor)
            if anchor >= alias:
                raise InvalidArgument(
                    f"HybridConfig.kv_shared_layers: alias layer {alias} comes before its "
                    f"anchor {anchor}; the anchor must write its K/V first (anchor < alias)")

    # --- layer kinds -------------------------------------------------------------------------

    def kv_anchor(self, layer: int) -> int | None:
        """The layer whose K/V ``layer`` reads when it is a KV-shared alias, else ``None``."""
        return dict(self.kv_shared_layers).get(layer)

    def physical_kv_layer(self, layer: int) -> int:
        """The layer that stores ``layer``'s K/V: its anchor for an alias, else itself."""
        anchor = self.kv_anchor(layer)
        return layer if anchor is None else anchor

    def _layers_of(self, kind: str, *, physical: bool) -> tuple[int, ...]:
        aliases = {alias for alias, _ in self.kv_shared_layers}
        return tuple(i for i, k in enumerate(self.layer_types)
                     if k == kind and not (physical and i in aliases))

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Full-attention layers in order, KV-shared aliases included."""
        return self._layers_of(FULL_ATTENTION, physical=False)

    @property
    def sliding_attention_layers(self) -> tuple[int, ...]:
        """Sliding-window layers in order, KV-shared aliases included."""
        return self._layers_of(SLIDING_ATTENTION, physical=False)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Gated-delta-net layers in order (the order of a snapshot's recurrent states)."""
        return self._layers_of(LINEAR_ATTENTION, physical=False)

    @property
    def physical_full_layers(self) -> tuple[int, ...]:
        """Full-attention layers that own K/V storage (no aliases)."""
        return self._layers_of(FULL_ATTENTION, physical=True)

    @property
    def physical_sliding_layers(self) -> tuple[int, ...]:
        """Sliding layers that own K/V storage (the order of a snapshot's window rows)."""
        return self._layers_of(SLIDING_ATTENTION, physical=True)

    # --- recurrent layer geometry ------------------------------------------------------------

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: ``[q | k | v]`` = ``2 * key_dim + value_dim``."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """``(K - 1, conv_dim)``: the last ``K - 1`` conv input rows, oldest first."""
        return (self.linear_conv_kernel_dim - 1, self.conv_dim)

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """``(Hv, Dv, Dk)``, as mlx-lm's ``gated_delta`` state without the batch axis."""
        return (self.linear_num_value_heads, self.linear_value_head_dim,
                self.linear_key_head_dim)

    def to_json_dict(self) -> dict:
        d = super().to_json_dict()
        d["layer_types"] = list(self.layer_types)
        d["kv_shared_layers"] = [list(p) for p in self.kv_shared_layers]
        return d


def config_from_json_dict(d: object, *, path: str | None = None) -> ReferenceConfig:
    """The config a saved ``config.json`` holds: a :class:`HybridConfig` when it has
    ``layer_types`` (hybrid and plain models share the ``model_type``), else a
    :class:`ReferenceConfig`. Raises ``BadMetadata`` as ``from_json_dict`` does."""
    if isinstance(d, dict) and "layer_types" in d:
        return HybridConfig.from_json_dict(d, path=path)
    return ReferenceConfig.from_json_dict(d, path=path)

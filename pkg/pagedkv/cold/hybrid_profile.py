"""The sidecars of pagedkv's hybrid reference model (docs/cold.md, "Family profiles and
sidecars"; docs/tiny-model.md).

The hybrid reference model keeps two kinds of state outside the paged pool: the gated delta
net's conv + recurrent state (float32, one per ``linear_attention`` layer) and the sliding
window's rows (one K and V per physical ``sliding_attention`` layer, in the sliding pools'
dtype). :func:`reference_hybrid_sidecar` builds the codec of both from the model's
``config.json`` — a :class:`~pagedkv.cold.sidecar_bundle.SidecarBundle` when it has both
kinds — and is the ``sidecar_policy`` of the built-in ``pagedkv_reference_hybrid`` family
profile, so a restore of such a model never returns K/V without the state it needs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedkv.argument_checks import is_int
from pagedkv.cold.recurrent_state import gdn_state_codec
from pagedkv.cold.sidecar_bundle import SidecarBundle
from pagedkv.cold.sliding_window import SlidingWindowCodec
from pagedkv.errors import InvalidArgument

__all__ = ["LINEAR_STATE_DTYPE", "reference_hybrid_sidecar"]

#: The recurrent state's dtype: the reference model computes in float32.
LINEAR_STATE_DTYPE = "float32"

def _field(config: Mapping, name: str) -> int:
    value = config.get(name)
    if not is_int(value) or value <= 0:
        raise InvalidArgument(f"config.json {name} = {value!r}: a hybrid reference config "
                              "needs a positive int")
    return int(value)


def reference_hybrid_sidecar(config: Mapping, geometry):
    """The sidecar codec of a hybrid reference ``config`` (``config.json`` as a dict) served
    with pools of ``geometry``'s dtype: a ``SidecarBundle`` of the GDN and sliding codecs,
    or the one codec when the model has only one of the two kinds. ``InvalidArgument`` for
    a config without linear or sliding layers (it is the plain ``pagedkv_reference``
    family) or with malformed fields."""
    kinds = config.get("layer_types")
    if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
        raise InvalidArgument("config.json has no layer_types list: not a hybrid reference "
                              "config (serve it under the pagedkv_reference family)")
    raw_pairs = config.get("kv_shared_layers") or []
    try:
        aliases = {int(alias) for alias, _ in raw_pairs}
    except (TypeError, ValueError):
        raise InvalidArgument(f"config.json kv_shared_layers = {raw_pairs!r}: expected "
                              "[alias, anchor] pairs") from None
    linear = [i for i, k in enumerate(kinds) if k == "linear_attention"]
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention" and i not in aliases]
    parts: list[Any] = []
    if linear:
        hk, dk = _field(config, "linear_num_key_heads"), _field(config, "linear_key_head_dim")
        hv, dv = (_field(config, "linear_num_value_heads"),
                  _field(config, "linear_value_head_dim"))
        parts.append(gdn_state_codec(
            len(linear), conv_kernel=_field(config, "linear_conv_kernel_dim"),
            conv_dim=2 * hk * dk + hv * dv, num_v_heads=hv, v_head_dim=dv, k_head_dim=dk,
            dtype=LINEAR_STATE_DTYPE))
    if sliding:
        parts.append(SlidingWindowCodec(
            window=_field(config, "sliding_window"), num_layers=len(sliding),
            kv_heads=_field(config, "num_kv_heads"), head_dim=_field(config, "head_dim"),
            dtype=geometry.dtype))
    if not parts:
        raise InvalidArgument("config.json declares no linear_attention or sliding_attention "
                              "layer: serve it under the pagedkv_reference family")
    return parts[0] if len(parts) == 1 else SidecarBundle(tuple(parts))

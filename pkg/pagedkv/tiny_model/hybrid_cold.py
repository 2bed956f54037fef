"""The hybrid reference model and the cold tier (docs/tiny-model.md, "Through the cold
tier"): snapshots as sidecar state, restored sidecars as linear states, and the
``ColdTierContext`` of a saved hybrid model.

A :class:`~pagedkv.tiny_model.hybrid_state.HybridSnapshot` carries exactly what the family's
sidecars carry (docs/cold.md, "Family profiles and sidecars"): the linear layers' conv and
recurrent states (the GDN sidecar) and the physical sliding layers' window rows (the sliding
sidecar, heads-major there, token-major in the codec's state form). The checkpoint store of
the coordinator keeps snapshots; :class:`HybridCheckpointSource` hands them to the cold
tier's sidecar capture in the codec's form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from pagedkv.cold import ColdGroup, RestoredSidecar, RestoredSidecars, SidecarBundle
from pagedkv.cold.profiles import REFERENCE_HYBRID_FAMILY
from pagedkv.errors import InvalidArgument, SidecarLayoutMismatch
from pagedkv.tiny_model.hybrid_config import HybridConfig
from pagedkv.tiny_model.hybrid_state import HybridSnapshot

__all__ = ["HybridCheckpointSource", "full_group_geometry", "hybrid_cold_context",
           "linear_states_from_sidecar", "sidecar_state"]


def full_group_geometry(config: HybridConfig, block_size: int):
    """The pool geometry of the full-attention group (what the fingerprint covers)."""
    from pagedkv.pool import PoolGeometry
    return PoolGeometry(len(config.physical_full_layers), config.num_kv_heads,
                        config.head_dim, block_size, "float32")


def sidecar_state(snapshot: HybridSnapshot, codec) -> Any:
    """``snapshot`` in ``codec``'s state form: ``{ColdGroup: state}`` for a bundle, else the
    one part's state (GDN: stacked ``(conv, recurrent)``; sliding: token-major ``(k, v)``)."""
    parts = {}
    if snapshot.conv_states:
        parts[ColdGroup.GDN_STATE] = (np.stack(snapshot.conv_states),
                                      np.stack(snapshot.recurrent_states))
    if snapshot.sliding_keys:
        parts[ColdGroup.SLIDING_WINDOW] = (
            np.ascontiguousarray(np.stack(snapshot.sliding_keys).transpose(0, 2, 1, 3)),
            np.ascontiguousarray(np.stack(snapshot.sliding_values).transpose(0, 2, 1, 3)))
    if isinstance(codec, SidecarBundle):
        return {g: parts[g] for g in codec.groups}
    return parts[codec.group]


def linear_states_from_sidecar(config: HybridConfig, sidecar, codec):
    """``(conv_states, recurrent_states)`` (one float32 array per linear layer) of a restored
    sidecar (a ``RestoredSidecars`` for a bundle); empty lists for a model without linear
    layers. ``SidecarLayoutMismatch`` when the sidecar is not ``codec``'s."""
    if not config.linear_attention_layers:
        return [], []
    if isinstance(sidecar, RestoredSidecars):
        if ColdGroup.GDN_STATE not in sidecar:
            raise SidecarLayoutMismatch("the restored sidecars hold no GDN state")
        part, gdn = sidecar[ColdGroup.GDN_STATE], codec.part(ColdGroup.GDN_STATE)
    elif isinstance(sidecar, RestoredSidecar):
        part, gdn = sidecar, codec
    else:
        raise InvalidArgument(f"not a restored sidecar: {type(sidecar).__name__}")
    conv, recurrent = gdn.unpack(part)
    return list(conv), list(recurrent)


class HybridCheckpointSource:
    """The ``checkpoints`` source of a hybrid model's ``ColdTierContext``: every snapshot
    the bound checkpoint store holds on a prompt's lineage, in the codec's state form.
    Bind the store after the coordinator is built (:meth:`bind`)."""

    def __init__(self) -> None:
        self.store = None
        self.codec = None

    def bind(self, store, codec) -> None:
        self.store = store
        self.codec = codec

    def __call__(self, tokens, *, cache_salt: int = 0, extra_keys_per_block=None
                 ) -> Mapping[int, Any]:
        if self.store is None:
            return {}
        found = self.store.verified(tokens, cache_salt=cache_salt,
                                    extra_keys_per_block=extra_keys_per_block)
        return {b: sidecar_state(snap, self.codec) for b, snap in found.items()
                if isinstance(snap, HybridSnapshot)}

    def __repr__(self) -> str:
        return f"HybridCheckpointSource(bound={self.store is not None})"


def hybrid_cold_context(model_dir: str, config: HybridConfig, *, block_size: int,
                        base: str | None = None, persist: bool | None = True,
                        compute: str = ""):
    """``(context, source)``: the ``ColdTierContext`` of a saved hybrid model under the
    ``pagedkv_reference_hybrid`` family (its sidecar codec built from ``config.json``), or
    ``None`` when persistence is off, and the checkpoint source to :meth:`bind
    <HybridCheckpointSource.bind>` to the coordinator's store. ``compute``: the model's
    ``compute_identity`` (part of the fingerprint, so KV of another backend never restores)."""
    from pagedkv.cold import cold_tier_for_model

    source = HybridCheckpointSource()
    ctx = cold_tier_for_model(model_dir, REFERENCE_HYBRID_FAMILY,
                              full_group_geometry(config, block_size),
                              persist_paged_cache=persist, base=base, checkpoints=source,
                              compute=compute)
    return ctx, source

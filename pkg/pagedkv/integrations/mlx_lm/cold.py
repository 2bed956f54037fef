"""The cold tier of a :class:`PagedPromptCache`: a fingerprint for an mlx-lm model, the
family profile that admits its restore, and the sidecars of hybrid models.

A restored block is only usable by the same weights, config and pool geometry, so the
objects are bound to a fingerprint (docs/cold.md, "Keys and fingerprint"): with ``model_dir`` the
project's file-based fingerprint (config.json, the safetensors shards' digests, cached in the
tier), otherwise the same parts built from the loaded model: its family, its config
(``model.args``), a SHA-256 over every parameter's name, dtype, shape and bytes, the sidecar
format and the pool geometry. Full-attention families keep no state outside the pool. A
recurrent hybrid (Qwen3-Next, Qwen3.5) keeps its gated-delta conv and recurrent state in a
GDN sidecar (float32: the casts from the model's dtypes are exact); a sliding-window model
(Gemma 3, gpt-oss, Gemma 4) its windows' rows in a sliding sidecar; the tier never restores
K/V without the sidecar that backs its end (docs/cold.md, "Sidecars"). The cross-process
parity tests of this integration (tests/test_integration_mlx_lm*.py, restart) are the
families' restore gate, so their profiles are registered as admitted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pagedkv.coordinator import StateCheckpointStore

__all__ = ["ClosableColdHooks", "family_name", "gdn_codec_for", "loaded_model_fingerprint",
           "open_cold_tier", "sidecar_descriptor"]

log = logging.getLogger("pagedkv.cold")

#: Marks the weight part of a fingerprint computed from loaded parameters (not files).
_PARAMETERS_MARKER = b"mlx-lm-parameters\0"


def family_name(model_type: str) -> str:
    """The cold-tier family of an mlx-lm architecture: ``mlx_lm.<model_type>``."""
    return f"mlx_lm.{model_type}"


def _config_bytes(model) -> bytes:
    args = getattr(model, "args", None)
    if dataclasses.is_dataclass(args) and not isinstance(args, type):
        config = dataclasses.asdict(args)
    else:
        config = {k: v for k, v in vars(args).items() if not k.startswith("_")} if args else {}
    return json.dumps(config, sort_keys=True, default=repr).encode()


def _parameters_digest(model) -> bytes:
    """SHA-256 over every parameter (sorted by name): name, dtype, shape, raw bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    h = hashlib.sha256()
    flat: Any = tree_flatten(model.parameters())  # [(dotted name, mx.array)]
    params: list[tuple[str, Any]] = sorted(flat, key=lambda kv: kv[0])
    for name, value in params:
        dtype = str(value.dtype)
        if value.dtype == mx.bfloat16:  # NumPy has no bfloat16: hash its bit patterns
            value = value.view(mx.uint16)
        data = np.ascontiguousarray(np.asarray(value))
        h.update(name.encode() + b"\0" + dtype.encode() + b"\0"
                 + json.dumps(list(value.shape)).encode() + b"\0")
        h.update(data.data)  # a zero-copy memoryview
    return h.digest()


def loaded_model_fingerprint(fmt, model, family: str, geometry, descriptor: str = "") -> bytes:
    """The 32-byte fingerprint of a loaded model served with ``geometry`` (same parts as
    ``model_fingerprint``, the weights identified by their in-memory bytes; ``descriptor``:
    the sidecar format)."""
    from pagedkv.cold.fingerprint import (
        backend_compute_identity,
        cold_fingerprint,
        geometry_part,
    )

    return cold_fingerprint(fmt, [family.encode(), _config_bytes(model), descriptor.encode(),
                                  _PARAMETERS_MARKER + _parameters_digest(model),
                                  geometry_part(geometry),
                                  backend_compute_identity("mlx").encode()])


def sidecar_descriptor(family: str, sidecar) -> str:
    """The fingerprint part naming a sidecar format: the codec's geometry and dtype, so
    objects of another layout never decode under this model."""
    return "" if sidecar is None else f"{family} sidecars v1: {sidecar!r}"


def gdn_codec_for(states: dict) -> object | None:
    """The GDN sidecar codec of a model's recurrent entries (``ModelLayout.states``): every
    entry holds a conv state ``[1, K-1, conv_dim]`` and a recurrent state ``[1, Hv, Dv,
    Dk]``, stored as float32 (``None`` for any other shape: no recurrent sidecar)."""
    from pagedkv.cold import gdn_state_codec

    shapes = {tuple(shape for shape, _ in arrays) for arrays in states.values()}
    if len(shapes) != 1:
        return None
    (parts,) = shapes
    if len(parts) != 2 or len(parts[0]) != 3 or len(parts[1]) != 4 or parts[0][0] != 1 \
            or parts[1][0] != 1:
        return None
    (_, taps, conv_dim), (_, hv, dv, dk) = parts
    return gdn_state_codec(len(states), conv_kernel=taps + 1, conv_dim=conv_dim,
                           num_v_heads=hv, v_head_dim=dv, k_head_dim=dk, dtype="float32")


def open_cold_tier(cold_dir, model, geometry, *, model_dir=None, sidecar=None,
                   checkpoints=None):
    """A ``ColdTierContext`` in ``<cold_dir>/pagedkv-v1`` bound to the model, or ``None`` when
    persistence is off (``PAGEDKV_PERSIST_PAGED_CACHE=0``, a ``model_dir`` without weight
    files: logged). ``sidecar``/``checkpoints``: a hybrid model's sidecar codec and
    checkpoint source (``ColdTierContext``). Raises ``InvalidArgument``/``OSError`` when
    ``cold_dir`` cannot hold a tier."""
    from pagedkv.cold import (
        ColdTier,
        FamilyColdProfile,
        OutOfPoolState,
        WeightDigestCache,
        model_fingerprint,
        register_family_profile,
        resolve_persist,
    )
    from pagedkv.cold.fingerprint import backend_compute_identity
    from pagedkv.cold.root import MANAGED_CHILD
    from pagedkv.integrations.mlx_lm.prompt_cache import model_type_of

    family = family_name(model_type_of(model))
    descriptor = sidecar_descriptor(family, sidecar)
    if sidecar is None:
        profile = FamilyColdProfile(family, OutOfPoolState.NONE, restore_admitted=True)
    else:
        groups = tuple(getattr(sidecar, "groups", None) or (sidecar.group,))
        profile = FamilyColdProfile(
            family, OutOfPoolState.SIDECAR, sidecar_group=groups,
            sidecar_policy=lambda config, geometry: sidecar, sidecar_descriptor=descriptor,
            restore_admitted=True)
    register_family_profile(profile)
    if not resolve_persist(profile, True):
        log.info("cold tier off for %s: PAGEDKV_PERSIST_PAGED_CACHE is false", family)
        return None
    os.makedirs(cold_dir, exist_ok=True)
    tier = ColdTier.open_at(os.path.join(os.fspath(cold_dir), MANAGED_CHILD))
    try:
        if model_dir is not None:
            fp = model_fingerprint(tier.fmt, os.fspath(model_dir), profile, geometry,
                                   digest_cache=WeightDigestCache(tier.local_root_fd),
                                   compute=backend_compute_identity("mlx"))
        else:
            fp = loaded_model_fingerprint(tier.fmt, model, family, geometry, descriptor)
    except BaseException:
        tier.close()
        raise
    if fp is None:
        tier.close()
        return None
    return tier.for_model(fp, sidecar=sidecar, checkpoints=checkpoints, geometry=geometry)


class ClosableColdHooks:
    """The adapter's cold-tier hooks for one ``PagedPromptCache``: the tier bound to the
    model, until :meth:`close` drains and closes it; from then on captures and restores are
    skipped (the hot cache keeps working) instead of reaching a stopped writer."""

    def __init__(self, context) -> None:
        self._context = context
        self.closed = False

    def __getattr__(self, name: str):
        return getattr(self._context, name)

    def __repr__(self) -> str:
        return f"ClosableColdHooks(closed={self.closed}, {self._context!r})"

    @property
    def tier(self):
        return self._context.tier

    def capture(self, **kwargs):
        return None if self.closed else self._context.capture(**kwargs)

    def restore(self, **kwargs):
        if self.closed:
            return np.empty(0, np.int32)
        return self._context.restore(**kwargs)

    def restore_grouped(self, **kwargs):
        if self.closed:
            return None
        return self._context.restore_grouped(**kwargs)

    def close(self, timeout: float) -> None:
        """Persist what is queued (up to ``timeout`` s), close the tier; idempotent."""
        if not self.closed:
            self.closed = True
            self._context.tier.drain(timeout)
            self._context.tier.close(timeout)


class SlidingSnapshots:
    """Window snapshots of a sliding-window model, the state its cold sidecars persist
    (docs/cold.md, "Sliding-window sidecar"): at a block boundary ``b`` the rows
    ``[b - min(b, window), b)`` of every physical sliding layer, read from a request's own
    buffers (which hold them while the window passes ``b``), kept in a checkpoint store
    keyed like blocks under the sliding retention (``SlidingRetention``: the anchor rungs
    ``bs * 4**k`` first). The cold tier's sidecar capture asks it for the snapshots on a
    prompt's lineage (``__call__``, the ``checkpoints`` source of ``ColdTierContext``)."""

    def __init__(self, codec, indices: tuple[int, ...], pool_dtype: str, block_size: int
                 ) -> None:
        from pagedkv.cold.ladder import sliding_checkpoint_budget

        self.codec = codec
        self.indices = indices
        self.pool_dtype = pool_dtype
        self.block_size = block_size
        self.budget = sliding_checkpoint_budget(
            window=codec.window, block_size=block_size, sliding_layers=codec.num_layers,
            kv_heads=codec.kv_heads, head_dim=codec.head_dim, persist=True)
        self.store: StateCheckpointStore | None = None

    def bind(self, hasher) -> None:
        """Key the snapshots like the blocks of ``hasher`` (the full group's allocator)."""
        from pagedkv.cold.ladder import SlidingRetention
        from pagedkv.coordinator import StateCheckpointStore

        self.store = StateCheckpointStore(hasher, max_entries=self.budget.limit + 1,
                                          retention=SlidingRetention(self.budget))

    def __repr__(self) -> str:
        return f"SlidingSnapshots({self.codec!r}, {self.store!r})"

    def due(self, start: int, stop: int) -> list[int]:
        """Boundaries in ``(start, stop]`` a prompt's write-through snapshots: the window
        cadence and the anchor rungs (``sliding_prefill_checkpoints``)."""
        from pagedkv.cold.ladder import sliding_prefill_checkpoints

        return sliding_prefill_checkpoints(start, stop, self.codec.window, self.block_size,
                                           persist=True, rungs=self.budget.rungs)

    def take(self, layers, boundary: int):
        """The snapshot at ``boundary`` from a request's sliding layers (cache-list
        ``layers``), or ``None`` when a buffer no longer holds its rows: ``(k, v)``, each
        ``[sliding layers, rows, kv_heads, head_dim]`` in the pool dtype (lazy MLX arrays,
        evaluating in the background)."""
        import mlx.core as mx

        rows = min(boundary, self.codec.window)
        dtype = getattr(mx, self.pool_dtype)
        ks, vs = [], []
        for i in self.indices:
            layer = layers[i]
            lo, hi = boundary - rows - layer.start, boundary - layer.start
            if layer.keys is None or lo < 0 or boundary > layer.offset:
                return None
            ks.append(layer.keys[0, :, lo:hi, :].transpose(1, 0, 2).astype(dtype))
            vs.append(layer.values[0, :, lo:hi, :].transpose(1, 0, 2).astype(dtype))
        state = (mx.contiguous(mx.stack(ks)), mx.contiguous(mx.stack(vs)))
        mx.async_eval(state)
        return state

    def publish(self, tokens, boundary: int, layers, salt: int, owner) -> bool:
        if self.store is None or boundary <= 0 or boundary % self.block_size:
            return False
        state = self.take(layers, boundary)
        if state is None:
            return False
        return self.store.publish(tokens, boundary, state, cache_salt=salt, owner=owner)

    def deepest_ready(self, layers, n: int) -> int:
        """The deepest block boundary ``<= n`` whose rows every sliding buffer still holds
        (0: none)."""
        bs = self.block_size
        b = n // bs * bs
        while b > 0:
            if all(b - min(b, self.codec.window) >= layers[i].start for i in self.indices):
                return b
            b -= bs
        return 0

    def __call__(self, tokens, *, cache_salt: int = 0, extra_keys_per_block=None) -> dict:
        """``{boundary: (k, v)}`` of the retained snapshots on ``tokens``' lineage, as the
        codec's NumPy state (bfloat16 as ``uint16`` bit patterns)."""
        if self.store is None:
            return {}
        import mlx.core as mx

        found = self.store.verified(tokens, cache_salt=cache_salt,
                                    extra_keys_per_block=extra_keys_per_block)
        out = {}
        for b, (k, v) in found.items():
            if k.dtype == mx.bfloat16:
                k, v = k.view(mx.uint16), v.view(mx.uint16)
            out[b] = (np.asarray(k), np.asarray(v))
        return out

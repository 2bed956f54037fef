"""The cold tier of a :class:`PagedPromptCache`: a fingerprint for an mlx-lm model and the
family profile that admits its restore.

A restored block is only usable by the same weights, config and pool geometry, so the
objects are bound to a fingerprint (docs/cold.md, "Keys and fingerprint"): with ``model_dir`` the
project's file-based fingerprint (config.json, the safetensors shards' digests, cached in the
tier), otherwise the same parts built from the loaded model: its family, its config
(``model.args``), a SHA-256 over every parameter's name, dtype, shape and bytes, and the pool
geometry. Full-attention mlx-lm families keep no state outside the pool, and the cross-process
parity test of this integration (tests/test_integration_mlx_lm.py, restart) is their restore
gate, so their profile is registered as admitted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import numpy as np

__all__ = ["ClosableColdHooks", "family_name", "loaded_model_fingerprint", "open_cold_tier"]

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


def loaded_model_fingerprint(fmt, model, family: str, geometry) -> bytes:
    """The 32-byte fingerprint of a loaded model served with ``geometry`` (same parts as
    ``model_fingerprint``, the weights identified by their in-memory bytes)."""
    from pagedkv.cold.fingerprint import (
        backend_compute_identity,
        cold_fingerprint,
        geometry_part,
    )

    return cold_fingerprint(fmt, [family.encode(), _config_bytes(model), b"",
                                  _PARAMETERS_MARKER + _parameters_digest(model),
                                  geometry_part(geometry),
                                  backend_compute_identity("mlx").encode()])


def open_cold_tier(cold_dir, model, geometry, *, model_dir=None):
    """A ``ColdTierContext`` in ``<cold_dir>/pagedkv-v1`` bound to the model, or ``None`` when
    persistence is off (``PAGEDKV_PERSIST_PAGED_CACHE=0``, a ``model_dir`` without weight
    files: logged). Raises ``InvalidArgument``/``OSError`` when ``cold_dir`` cannot hold a
    tier."""
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
    profile = FamilyColdProfile(family, OutOfPoolState.NONE, restore_admitted=True)
    register_family_profile(profile)
    if not resolve_persist(profile, True):
        log.info("cold tier off for %s: PAGEDKV_PERSIST_PAGED_CACHE is false", family)
        return None
    os.makedirs(cold_dir, exist_ok=True)
    tier = ColdTier.open_at(os.path.join(os.fspath(cold_dir), MANAGED_CHILD))
    try:
        if model_dir is not None:
            fp = model_fingerprint(tier.fmt, os.fspath(model_dir), profile, geometry,
                                   digest_cache=WeightDigestCache(tier.store.root_fd),
                                   compute=backend_compute_identity("mlx"))
        else:
            fp = loaded_model_fingerprint(tier.fmt, model, family, geometry)
    except BaseException:
        tier.close()
        raise
    if fp is None:
        tier.close()
        return None
    return tier.for_model(fp)


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

    def close(self, timeout: float) -> None:
        """Persist what is queued (up to ``timeout`` s), close the tier; idempotent."""
        if not self.closed:
            self.closed = True
            self._context.tier.drain(timeout)
            self._context.tier.close(timeout)

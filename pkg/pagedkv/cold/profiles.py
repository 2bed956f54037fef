"""Family profiles and persist resolution (docs/contracts/cold-tier.md, '2. Enablement';
docs/cold.md, "Family profiles
and sidecars").

Restoring is a correctness question: a K/V prefix is usable only if every piece of state the
model needs at that prefix comes back with it. A family is restore-eligible only after it
passed the cross-process parity gate (docs/contracts/cold-tier.md, '2.3 Parity gate') and says so
with ``restore_admitted``. A family
with out-of-pool state names its sidecar groups and a ``sidecar_policy``: the factory of the
codec (and so of the policy) its sidecars follow, built from the model's ``config.json``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.knobs import env_bool
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch

__all__ = [
    "COLD_RESTORE_FAMILIES",
    "HYBRID_SIDECAR_DESCRIPTOR",
    "REFERENCE_FAMILY",
    "REFERENCE_HYBRID_FAMILY",
    "FamilyColdProfile",
    "OutOfPoolState",
    "builtin_profiles",
    "cold_restore_supported",
    "family_profile",
    "family_sidecar_codec",
    "register_family_profile",
    "resolve_persist",
    "stateful_layer_kinds",
]

REFERENCE_FAMILY = "pagedkv_reference"
#: pagedkv's hybrid reference model (full + sliding + gated delta net layers): same
#: ``model_type`` as the plain model, another family, because it keeps state outside the pool.
REFERENCE_HYBRID_FAMILY = "pagedkv_reference_hybrid"

#: Part of the fingerprint of every model served under the hybrid reference family: a
#: change of the sidecar format gets a new descriptor, so old objects never decode as new.
HYBRID_SIDECAR_DESCRIPTOR = (
    "pagedkv_reference_hybrid sidecars v1: gdn_state per linear_attention layer "
    "(conv [K-1, conv_dim] + recurrent [Hv, Dv, Dk], float32); sliding_window K, V rows "
    "[1, kv_heads, min(b, W), head_dim] per physical sliding_attention layer (pool dtype)")

#: ``layer_types`` entries (Hugging Face names) whose layers need no state outside the pool.
_POOL_ONLY_LAYER_KINDS = frozenset({"full_attention", "attention"})


class OutOfPoolState(enum.Enum):
    """What a family keeps outside the paged pool."""

    NONE = "none"                      # the pool covers every layer
    SIDECAR = "sidecar"                # outside state with a codec, captured at boundaries
    IN_PROCESS_ONLY = "in_process_only"  # outside state without a codec yet


@dataclass(frozen=True)
class FamilyColdProfile:
    """A model family's cold-tier declaration (docs/contracts/cold-tier.md, '2.1 What a family
    declares').

    ``sidecar_group``: the ``ColdGroup`` (or tuple of groups) its sidecars live in;
    ``sidecar_policy``: ``factory(config, geometry) -> codec``, the family's sidecar codec
    for a model's parsed ``config.json`` served with a pool ``geometry`` (its ``policy`` is
    what every restore is reconciled under); ``sidecar_descriptor``: a text naming the
    sidecar format, part of the model fingerprint."""

    family: str
    out_of_pool_state: OutOfPoolState = OutOfPoolState.NONE
    sidecar_group: Any = None
    sidecar_policy: Callable[..., Any] | None = None
    sidecar_descriptor: str = ""
    exact_boundary_inputs: bool = False
    restore_admitted: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not self.family:
            raise InvalidArgument(f"family = {self.family!r} must be a non-empty str")
        if not isinstance(self.out_of_pool_state, OutOfPoolState):
            raise InvalidArgumentType(
                f"out_of_pool_state must be an OutOfPoolState, got {self.out_of_pool_state!r}")
        if self.out_of_pool_state is OutOfPoolState.SIDECAR and (
                self.sidecar_group is None or self.sidecar_policy is None):
            raise InvalidArgument(f"family {self.family!r}: SIDECAR state needs "
                                  "sidecar_group and sidecar_policy")


def _groups_of(codec) -> tuple[ColdGroup, ...]:
    groups = getattr(codec, "groups", None)
    return tuple(groups) if groups is not None else (codec.group,)


def family_sidecar_codec(profile: FamilyColdProfile, config: Mapping, geometry,
                         given=None):
    """The sidecar codec a model of ``profile`` is served with, or ``None`` (no out-of-pool
    state). Built by the profile's ``sidecar_policy`` from ``config`` and ``geometry``; a
    ``given`` codec (the engine's own) must have exactly that policy, else
    ``SidecarLayoutMismatch`` naming both. A codec for a family without out-of-pool state
    is ``InvalidArgument``."""
    if profile.out_of_pool_state is not OutOfPoolState.SIDECAR:
        if given is not None:
            raise InvalidArgument(
                f"family {profile.family!r} declares {profile.out_of_pool_state.value!r} "
                "out-of-pool state: it takes no sidecar codec")
        return None
    assert profile.sidecar_policy is not None
    built = profile.sidecar_policy(config, geometry)
    want = profile.sidecar_group if isinstance(profile.sidecar_group, tuple) \
        else (profile.sidecar_group,)
    if not set(_groups_of(built)) <= set(want):
        raise SidecarLayoutMismatch(
            f"family {profile.family!r}: its sidecar_policy built groups "
            f"{[g.label for g in _groups_of(built)]}, the profile declares "
            f"{[g.label for g in want]}")
    if given is None:
        return built
    if _groups_of(given) != _groups_of(built) or given.policy != built.policy:
        raise SidecarLayoutMismatch(
            f"the sidecar codec {given!r} disagrees with what family {profile.family!r} "
            f"declares for this model: {built!r}; drop sidecar= to use the family's")
    return given


def stateful_layer_kinds(config: Mapping) -> tuple[str, ...]:
    """Layer kinds of a ``config.json`` (its ``layer_types``, Hugging Face names) that keep
    state outside the pool (``sliding_attention``, ``linear_attention``, ...), sorted; empty
    when every layer is full attention or the config has no ``layer_types``."""
    kinds = config.get("layer_types") if isinstance(config, Mapping) else None
    if not isinstance(kinds, list):
        return ()
    return tuple(sorted({str(k) for k in kinds} - _POOL_ONLY_LAYER_KINDS))


def cold_restore_supported(profile: FamilyColdProfile | None) -> bool:
    """True iff admitted and either no out-of-pool state or a sidecar with a policy."""
    if profile is None or not profile.restore_admitted:
        return False
    if profile.out_of_pool_state is OutOfPoolState.NONE:
        return True
    return (profile.out_of_pool_state is OutOfPoolState.SIDECAR
            and profile.sidecar_policy is not None)


def _reference_hybrid_sidecar(config, geometry):
    from pagedkv.cold.hybrid_profile import reference_hybrid_sidecar
    return reference_hybrid_sidecar(config, geometry)


# pagedkv's reference transformer: no out-of-pool state, admitted by pagedkv's own
# three-process parity test (tests/test_cold_restart_parity.py). Its hybrid configuration
# keeps GDN and sliding-window state in sidecars, admitted by the cross-process test of
# tests/test_hybrid_cold_restart.py.
_BUILTIN = (
    FamilyColdProfile(REFERENCE_FAMILY, OutOfPoolState.NONE, restore_admitted=True),
    FamilyColdProfile(REFERENCE_HYBRID_FAMILY, OutOfPoolState.SIDECAR,
                      sidecar_group=(ColdGroup.GDN_STATE, ColdGroup.SLIDING_WINDOW),
                      sidecar_policy=_reference_hybrid_sidecar,
                      sidecar_descriptor=HYBRID_SIDECAR_DESCRIPTOR, restore_admitted=True),
)
_lock = threading.Lock()
_registry: dict[str, FamilyColdProfile] = {p.family: p for p in _BUILTIN}


def builtin_profiles() -> tuple[FamilyColdProfile, ...]:
    return _BUILTIN


#: Built-in families whose restore is supported (pinned by a test against the profiles).
COLD_RESTORE_FAMILIES = frozenset(p.family for p in _BUILTIN if cold_restore_supported(p))


def register_family_profile(profile: FamilyColdProfile) -> None:
    """Register (or replace) an engine's profile for its family."""
    if not isinstance(profile, FamilyColdProfile):
        raise InvalidArgumentType(
            f"profile must be a FamilyColdProfile, got {type(profile).__name__}")
    with _lock:
        _registry[profile.family] = profile


def family_profile(family: str) -> FamilyColdProfile | None:
    return _registry.get(family)


def resolve_persist(profile: FamilyColdProfile | None, config_value: bool | None = None) -> bool:
    """Persist resolution (docs/contracts/cold-tier.md, '2.2 Persist resolution'): the family gate
    first, then the env, then the config,
    else off."""
    if not cold_restore_supported(profile):
        return False
    value = env_bool("PAGEDKV_PERSIST_PAGED_CACHE", None)
    if value is not None:
        return value
    if config_value is not None:
        return bool(config_value)
    return False

"""Family profiles and persist resolution (cold-tier.md §2).

Restoring is a correctness question: a K/V prefix is usable only if every piece of state the
model needs at that prefix comes back with it. A family is restore-eligible only after it
passed the cross-process parity gate (§2.3) and says so with ``restore_admitted``.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.cold.knobs import env_bool
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "COLD_RESTORE_FAMILIES",
    "REFERENCE_FAMILY",
    "FamilyColdProfile",
    "OutOfPoolState",
    "builtin_profiles",
    "cold_restore_supported",
    "family_profile",
    "register_family_profile",
    "resolve_persist",
]

REFERENCE_FAMILY = "pagedkv_reference"


class OutOfPoolState(enum.Enum):
    """What a family keeps outside the paged pool."""

    NONE = "none"                      # the pool covers every layer
    SIDECAR = "sidecar"                # outside state with a codec, captured at boundaries
    IN_PROCESS_ONLY = "in_process_only"  # outside state without a codec yet


@dataclass(frozen=True)
class FamilyColdProfile:
    """A model family's cold-tier declaration (§2.1)."""

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


def cold_restore_supported(profile: FamilyColdProfile | None) -> bool:
    """True iff admitted and either no out-of-pool state or a sidecar with a policy."""
    if profile is None or not profile.restore_admitted:
        return False
    if profile.out_of_pool_state is OutOfPoolState.NONE:
        return True
    return (profile.out_of_pool_state is OutOfPoolState.SIDECAR
            and profile.sidecar_policy is not None)


# pagedkv's reference transformer: no out-of-pool state, admitted by pagedkv's own
# three-process parity test (tests/test_cold_restart_parity.py).
_BUILTIN = (FamilyColdProfile(REFERENCE_FAMILY, OutOfPoolState.NONE, restore_admitted=True),)
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
    """Persist resolution (§2.2): the family gate first, then the env, then the config,
    else off."""
    if not cold_restore_supported(profile):
        return False
    value = env_bool("PAGEDKV_PERSIST_PAGED_CACHE", None)
    if value is not None:
        return value
    if config_value is not None:
        return bool(config_value)
    return False

"""Several sidecar groups that back one boundary together (docs/cold.md, "Sidecar bundles").

A model with both recurrent layers and sliding-window layers (the hybrid reference model,
Qwen3.5-style models with local attention) needs *two* kinds of out-of-pool state at a
boundary: the GDN conv + recurrent state and the sliding window's rows. Each travels as its
own sidecar object, in its own group's key chain, with its own policy; a
:class:`SidecarBundle` ties them together so that

* capture persists every part at the same anchor (one capture per part, each moving its own
  ``ColdSidecarStats`` exit counter);
* the restore walk counts a boundary as backed only when **every** part's sidecar at that
  boundary loads with exactly its policy's layout, and hands them back together as a
  :class:`RestoredSidecars` — K/V never comes back with only part of its state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from pagedkv.argument_checks import items_argument
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.policy import ColdSidecarPolicy
from pagedkv.cold.sidecar import RestoredSidecar
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch

__all__ = ["RestoredSidecars", "SidecarBundle", "policies_of"]


def policies_of(policy) -> tuple[ColdSidecarPolicy, ...]:
    """A restore's policy argument as a tuple: one ``ColdSidecarPolicy``, or a bundle's."""
    if isinstance(policy, ColdSidecarPolicy):
        return (policy,)
    parts = tuple(items_argument("policy", policy))
    if not parts or not all(isinstance(p, ColdSidecarPolicy) for p in parts):
        raise InvalidArgumentType("policy must be a ColdSidecarPolicy or a non-empty tuple of "
                                  "them (SidecarBundle.policy)")
    return parts


@dataclass(frozen=True)
class SidecarBundle:
    """Sidecar codecs of distinct groups (``RecurrentStateCodec``, ``SlidingWindowCodec``)
    captured and restored as one. A state handed to :meth:`pack_part` / a checkpoint
    source is a mapping ``{ColdGroup: state in that part's form}``.

    ``InvalidArgument`` for no part, or two parts of one group."""

    parts: tuple[Any, ...]

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if not parts:
            raise InvalidArgument("a SidecarBundle needs at least one codec")
        for i, p in enumerate(parts):
            if not (hasattr(p, "policy") and hasattr(p, "pack") and hasattr(p, "group")):
                raise InvalidArgumentType(
                    f"parts[{i}] must be a sidecar codec (gdn_state_codec, conv_state_codec, "
                    f"SlidingWindowCodec), got {type(p).__name__}")
        groups = [p.group for p in parts]
        if len(set(groups)) != len(groups):
            raise InvalidArgument(f"a SidecarBundle holds one codec per group, got {groups}")
        object.__setattr__(self, "parts", parts)

    @cached_property
    def policy(self) -> tuple[ColdSidecarPolicy, ...]:
        """Every part's policy, in part order (what ``restore_backed(policy=)`` takes)."""
        return tuple(p.policy for p in self.parts)

    @property
    def groups(self) -> tuple[ColdGroup, ...]:
        return tuple(p.group for p in self.parts)

    def part(self, group: ColdGroup):
        """The codec of ``group``; ``KeyError`` when the bundle has none."""
        for p in self.parts:
            if p.group is group:
                return p
        raise KeyError(group)

    def split(self, checkpoints: Mapping[int, Mapping[ColdGroup, Any]], group: ColdGroup
              ) -> dict[int, Any]:
        """``{boundary: state}`` of one part from ``{boundary: {group: state}}``; a boundary
        whose mapping lacks the part is left out (that part cannot anchor there)."""
        if not isinstance(checkpoints, Mapping):
            raise InvalidArgumentType("checkpoints must map each boundary (tokens) to "
                                      f"{{ColdGroup: state}}, got {type(checkpoints).__name__}")
        out = {}
        for b, state in checkpoints.items():
            if not isinstance(state, Mapping):
                raise SidecarLayoutMismatch(
                    f"a bundle checkpoint at {b} tokens must map each ColdGroup to its state, "
                    f"got {type(state).__name__}")
            if group in state:
                out[b] = state[group]
        return out

    def __repr__(self) -> str:
        return "SidecarBundle(" + ", ".join(repr(p) for p in self.parts) + ")"


@dataclass(frozen=True, eq=False)
class RestoredSidecars:
    """The sidecars of every part of a bundle, verified at one ``boundary_tokens`` (what a
    restore under a bundle returns in place of one :class:`RestoredSidecar`)."""

    boundary_tokens: int
    parts: tuple[RestoredSidecar, ...]

    def __post_init__(self) -> None:
        if not self.parts or any(p.boundary_tokens != self.boundary_tokens
                                 for p in self.parts):
            raise InvalidArgument(
                f"restored sidecars must all stand at {self.boundary_tokens} tokens: "
                f"{[p.boundary_tokens for p in self.parts]}")

    def __getitem__(self, group: ColdGroup) -> RestoredSidecar:
        for p in self.parts:
            if p.group is group:
                return p
        raise KeyError(group)

    def __contains__(self, group: object) -> bool:
        return any(p.group is group for p in self.parts)

    def __iter__(self) -> Iterator[RestoredSidecar]:
        return iter(self.parts)

    @property
    def groups(self) -> tuple[ColdGroup, ...]:
        return tuple(p.group for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __repr__(self) -> str:
        return (f"RestoredSidecars(boundary_tokens={self.boundary_tokens}, groups="
                f"{[g.label for g in self.groups]}, nbytes={self.nbytes})")


def restored_for(policies: Sequence[ColdSidecarPolicy], sidecars: Sequence[RestoredSidecar]):
    """What a restore returns for ``sidecars`` loaded under ``policies``: the one sidecar
    of a single policy, a :class:`RestoredSidecars` for a bundle."""
    if len(policies) == 1:
        return sidecars[0]
    return RestoredSidecars(sidecars[0].boundary_tokens, tuple(sidecars))

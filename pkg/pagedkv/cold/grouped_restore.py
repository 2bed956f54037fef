"""Full + sliding restore, all or nothing (docs/cold.md, "Grouped restore").

The full group proposes a boundary through the restore walk under the sliding-window
policy (reconcile-down included; with a ``SidecarBundle``, under every part's policy); one
validated sliding sidecar must then rebuild every sliding group at exactly that boundary.
Any decode, allocation or install failure releases **all** groups and the request starts at
zero: the full group is never reused on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.restore import EMPTY_BLOCKS
from pagedkv.cold.sidecar import RestoredSidecar
from pagedkv.cold.sidecar_bundle import RestoredSidecars, SidecarBundle
from pagedkv.cold.sliding_window import SlidingGroupTarget, SlidingWindowCodec
from pagedkv.cold.stats import record_sidecar_installed
from pagedkv.errors import InvalidArgument, InvalidArgumentType, SidecarLayoutMismatch

__all__ = ["GroupedRestore", "restore_grouped"]

log = logging.getLogger("pagedkv.cold")


class GroupedRestore(NamedTuple):
    """``cached_tokens``: where every group now stands (0: nothing restored);
    ``full_blocks``: the full group's restored ids (after its hot hit); ``sliding_tables``:
    per sliding group, ``int32[ceil(cached / bs)]`` entries with expired ones at the
    group's null block; ``sidecar``: the sidecar the sliding groups were rebuilt from (under
    a bundle, every part's: the others are the caller's to install). Every block id holds
    one reference owned by the caller."""

    cached_tokens: int
    full_blocks: np.ndarray
    sliding_tables: list[np.ndarray]
    sidecar: RestoredSidecar | RestoredSidecars | None


def _nothing(n_groups: int) -> GroupedRestore:
    return GroupedRestore(0, EMPTY_BLOCKS, [EMPTY_BLOCKS] * n_groups, None)


def _target(i: int, group, codec: SlidingWindowCodec) -> SlidingGroupTarget:
    """A coordinator's sliding group as a target; one whose window is not the codec's
    cannot be rebuilt from its rows (``SidecarLayoutMismatch``, nothing restored)."""
    window = getattr(group, "window", None)
    if window is not None and int(window) != codec.window:
        raise SidecarLayoutMismatch(f"sliding[{i}] has a window of {window} tokens, the "
                                    f"sliding sidecar holds {codec.window}")
    try:
        return SlidingGroupTarget(group.pool, group.allocator, int(group.null_block_id))
    except (AttributeError, TypeError):
        raise InvalidArgumentType(
            f"sliding[{i}] must be a SlidingGroupTarget or have pool, allocator and "
            f"null_block_id, got {type(group).__name__}") from None


def restore_grouped(context, *, tokens, pool, allocator, sliding: Sequence[SlidingGroupTarget],
                    hot_blocks=0, cache_salt: int = 0, extra_keys=(), extra_keys_per_block=None,
                    exact_boundary: bool = False) -> GroupedRestore:
    """Restore the full group (``pool``, ``allocator``) past ``hot_blocks`` and rebuild every
    sliding group of ``sliding`` at the same boundary from one sliding sidecar.

    ``context``: a ``ColdTierContext`` whose ``sidecar`` is a :class:`SlidingWindowCodec`
    over all sliding groups' physical layers in group order, or a ``SidecarBundle`` with
    one. ``sliding``: per sliding group, a :class:`SlidingGroupTarget` or any object with
    its ``pool``, ``allocator`` and ``null_block_id`` (a coordinator's sliding group
    manager). ``exact_boundary``: the
    sidecar must back the K/V chain's whole proposal (media prefixes), else nothing is
    restored. On failure (counted as one tier miss) every restored full block and every
    sliding block is freed and the result is empty; the caller releases its hot blocks.
    Never raises into inference for a tier or install problem; malformed arguments raise.
    """
    codec = context.sidecar
    bundle = codec if isinstance(codec, SidecarBundle) else None
    if bundle is not None and ColdGroup.SLIDING_WINDOW in bundle.groups:
        codec = bundle.part(ColdGroup.SLIDING_WINDOW)
    if not isinstance(codec, SlidingWindowCodec):
        raise InvalidArgumentType("restore_grouped needs a ColdTierContext whose sidecar is a "
                                  "SlidingWindowCodec (or a SidecarBundle holding one), got "
                                  f"{type(context.sidecar).__name__}")
    targets = [t if isinstance(t, SlidingGroupTarget) else _target(i, t, codec)
               for i, t in enumerate(sliding)]
    if not targets:
        raise InvalidArgument("restore_grouped: no sliding group given; use restore() for a "
                              "single full group")
    tier = context.tier
    geometry = pool.geometry  # the full pool's KV mode picks the fingerprint (docs/cold.md)
    restored = tier.restore_backed(
        tokens=tokens, hot_blocks=hot_blocks, cache_salt=cache_salt, extra_keys=extra_keys,
        extra_keys_per_block=extra_keys_per_block, pool=pool, allocator=allocator,
        policy=context.policy, exact_boundary=exact_boundary,
        fingerprint=context.fingerprint_at(geometry), geometry=geometry)
    ids, sidecar = restored
    if not len(ids) or sidecar is None:
        if len(ids):  # a walk never returns blocks without a sidecar under a policy
            allocator.free_many(ids)
        return _nothing(len(targets))
    try:
        window = sidecar[ColdGroup.SLIDING_WINDOW] if bundle is not None else sidecar
        tables = codec.install(targets, window)
    except Exception as exc:  # noqa: BLE001 - any install failure resets every group
        allocator.free_many(ids)
        tier.counters.add("misses")
        log.warning("cold tier: grouped restore at %d tokens failed, every group restarts "
                    "at 0: %s", sidecar.boundary_tokens, exc)
        return _nothing(len(targets))
    record_sidecar_installed()
    return GroupedRestore(sidecar.boundary_tokens, ids, tables, sidecar)

"""The cold-tier hooks: the only way the request lifecycle talks to a disk tier
(docs/adapter.md, "Cold-tier hooks").

The core never imports :mod:`pagedkv.cold`; a tier plugs in from outside as any object with
``capture`` and ``restore`` (:class:`ColdHooks`), e.g. ``pagedkv.cold.ColdTierContext``.
:class:`ColdCalls` makes those calls for the lifecycle: keyword arguments only, and a failing
or misbehaving hook is logged and counted, never raised into inference.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from pagedkv.errors import InvalidArgument, PagedKVError, SidecarLayoutMismatch
from pagedkv.hashing import per_block_extra_keys

__all__ = ["ColdCalls", "ColdHooks", "ColdRestore"]

log = logging.getLogger("pagedkv.adapter")

_EMPTY_IDS = np.empty(0, np.int32)
_EMPTY_IDS.setflags(write=False)


class ColdRestore(NamedTuple):
    """What a ``restore`` hook may return instead of bare ids: the restored block ids
    (``int32``, one reference each, owned by the caller) and the out-of-pool state (sidecar)
    valid at the end of them, or ``None``. A cold tier with a sidecar policy always returns
    one: whenever ``block_ids`` is non-empty, ``sidecar.boundary_tokens`` is the hit's end
    (hot blocks + restored blocks, in tokens)."""

    block_ids: np.ndarray
    sidecar: Any = None


@runtime_checkable
class ColdHooks(Protocol):
    """A cold tier as the lifecycle sees it. Optional: ``restore_discarded(blocks=n)``,
    called when a restored hit of ``n`` blocks is thrown away unused
    (``restart_prepared_turn_cold``), so the tier can count it; ``restore_grouped(*,
    tokens, hot_blocks, cache_salt, extra_keys_per_block, pool, allocator, sliding)`` →
    ``(cached_tokens, full block ids, sliding table rows, sidecar)``, the disk restore of a
    grouped coordinator with sliding groups (``sliding``: its sliding group managers, each
    with ``pool``, ``allocator``, ``null_block_id``, ``block_size``)."""

    def capture(self, *, tokens: np.ndarray, block_ids: np.ndarray, hashes: np.ndarray,
                cache_salt: int, extra_keys_per_block: list | None, pool: Any,
                allocator: Any) -> Any: ...

    def restore(self, *, tokens: np.ndarray, hot_blocks: np.ndarray, cache_salt: int,
                extra_keys_per_block: list | None, pool: Any,
                allocator: Any) -> np.ndarray | ColdRestore: ...


def _sidecar_mismatch(sidecar, cached: int, hit: str) -> SidecarLayoutMismatch | None:
    """Why a restore's ``sidecar`` cannot come with its ``cached``-token hit (``hit`` says
    how the hit is made up), or ``None``: no sidecar, or one whose ``boundary_tokens`` is
    the hit's end (:class:`ColdRestore`)."""
    boundary = getattr(sidecar, "boundary_tokens", None)
    if sidecar is None or boundary == cached:
        return None
    return SidecarLayoutMismatch(
        f"cold tier restore returned a sidecar with boundary_tokens={boundary} for a "
        f"{cached}-token hit ({hit}): out-of-pool state must be for exactly the hit's end; "
        "the tier must hand back only the blocks its sidecar backs (docs/cold.md, "
        "'Reconcile-down')")


def per_block_keys(extra_keys: Sequence[int], extra_keys_per_block, blocks: int):
    """The request's keys as one tuple per chained block (at most ``blocks``), or ``None``
    when it has none."""
    if extra_keys_per_block is None and len(extra_keys) == 0:
        return None
    return per_block_extra_keys(blocks, extra_keys, extra_keys_per_block)


class ColdCalls:
    """Calls into one :class:`ColdHooks` for a lifecycle, counting failures in ``counters``
    (``cold_capture_errors``, ``cold_restore_errors``)."""

    __slots__ = ("counters", "has_sidecar", "hooks")

    def __init__(self, hooks: ColdHooks, counters: dict[str, int]) -> None:
        self.hooks = hooks
        self.counters = counters
        #: The tier keeps a family's out-of-pool state (a ``sidecar`` codec): capture then
        #: runs every turn, also without a full block.
        self.has_sidecar = getattr(hooks, "sidecar", None) is not None

    def _refuse(self, error: PagedKVError, release) -> None:
        """Count and log a restore result that breaks the hook's contract (``error`` says
        how), then ``release()`` its blocks: the lookup keeps its hot hit only."""
        self.counters["cold_restore_errors"] += 1
        log.error("cold tier restore refused; continuing with the hot hit only",
                  exc_info=error)
        try:
            release()  # the caller owns one reference on each returned block
        except Exception:
            log.exception("cold tier restore: could not release the refused blocks")

    def restore(self, tokens: np.ndarray, hot: np.ndarray, block_size: int, cache_salt: int,
                extra_keys, extra_keys_per_block, pool, allocator
                ) -> tuple[np.ndarray, Any]:
        """``(block ids continuing the hot chain, sidecar)``; ``(empty, None)`` on a miss or
        a hook failure. A result reaching past the lookup, or with a sidecar for another
        boundary than the hit's end (``SidecarLayoutMismatch``, logged), is refused and its
        blocks given back."""
        try:
            result = self.hooks.restore(
                tokens=tokens, hot_blocks=hot, cache_salt=cache_salt,
                extra_keys_per_block=per_block_keys(extra_keys, extra_keys_per_block,
                                                    len(tokens) // block_size),
                pool=pool, allocator=allocator)
            sidecar = None
            if isinstance(result, ColdRestore):
                ids, sidecar = result.block_ids, result.sidecar
            else:
                ids = result
            extra = np.asarray(ids, np.int32).reshape(-1)
        except Exception:
            self.counters["cold_restore_errors"] += 1
            log.exception("cold tier restore failed; continuing with the hot hit only")
            return _EMPTY_IDS, None
        end = (len(hot) + len(extra)) * block_size
        error: PagedKVError | None = None
        if end > len(tokens):
            error = InvalidArgument(
                f"cold tier restore returned {len(extra)} blocks past a {len(hot)}-block hot "
                f"hit of a {len(tokens)}-token lookup")
        elif len(extra):
            error = _sidecar_mismatch(sidecar, end, f"{len(hot)} hot + {len(extra)} restored "
                                                   f"blocks of {block_size} tokens")
        if error is not None:
            self._refuse(error, lambda: allocator.free_many(extra))
            return _EMPTY_IDS, None
        return extra, sidecar

    def restore_grouped(self, tokens: np.ndarray, hot: np.ndarray, full, sliding: Sequence,
                        cache_salt: int, extra_keys, extra_keys_per_block, unit: int
                        ) -> tuple[int, np.ndarray, list[np.ndarray], Any] | None:
        """A full + sliding restore through the hook's optional ``restore_grouped`` (docs/
        cold.md, "Grouped restore"): ``(tokens, full block ids after hot, one table row per
        sliding group, sidecar)``, or ``None`` on a miss, a hook without it, or a failure.
        A result that is not a boundary of every group (a multiple of ``unit``) within the
        lookup, whose tables do not cover it, or whose sidecar is for another boundary, is
        refused and every block given back."""
        hook = getattr(self.hooks, "restore_grouped", None)
        if hook is None:
            return None
        try:
            result = hook(
                tokens=tokens, hot_blocks=hot, cache_salt=cache_salt,
                extra_keys_per_block=per_block_keys(extra_keys, extra_keys_per_block,
                                                    len(tokens) // full.block_size),
                pool=full.pool, allocator=full.allocator, sliding=list(sliding))
            cached, ids, tables, sidecar = result
            cached = int(cached)
            ids = np.asarray(ids, np.int32).reshape(-1)
            tables = [np.asarray(t, np.int32).reshape(-1) for t in tables]
        except Exception:
            self.counters["cold_restore_errors"] += 1
            log.exception("cold tier grouped restore failed; continuing with the hot hit only")
            return None
        if cached == 0 and not len(ids):
            return None
        shapes_ok = (len(tables) == len(sliding) and all(
            len(t) == -(-cached // g.block_size) for t, g in zip(tables, sliding, strict=False)))
        error: PagedKVError | None
        if (cached != (len(hot) + len(ids)) * full.block_size or cached > len(tokens)
                or cached % unit or not shapes_ok):
            error = InvalidArgument(
                f"cold tier grouped restore returned {cached} tokens ({len(ids)} blocks after "
                f"a {len(hot)}-block hot hit, {len(tables)} tables) for a {len(tokens)}-token "
                "lookup")
        else:
            error = _sidecar_mismatch(sidecar, cached, f"{len(hot)} hot + {len(ids)} restored "
                                                      f"blocks of {full.block_size} tokens")
        if error is not None:
            def release() -> None:
                full.allocator.free_many(ids)
                for t, g in zip(tables, sliding, strict=False):
                    g.drop_entries(t)
            self._refuse(error, release)
            return None
        return cached, ids, tables, sidecar

    def capture(self, tokens: np.ndarray, block_ids: np.ndarray, cache_salt: int, extra_keys,
                extra_keys_per_block, pool, allocator) -> Any:
        """Offer registered full blocks to the tier; its outcome, or ``None`` on failure."""
        try:
            per_block = per_block_keys(extra_keys, extra_keys_per_block, len(block_ids))
            hashes = allocator.chain_hashes(
                tokens, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                cache_salt=cache_salt)
            return self.hooks.capture(
                tokens=tokens, block_ids=block_ids, hashes=hashes, cache_salt=cache_salt,
                extra_keys_per_block=per_block, pool=pool, allocator=allocator)
        except Exception:
            self.counters["cold_capture_errors"] += 1
            log.exception("cold tier capture failed; the hot cache is unaffected")
            return None

    def restore_discarded(self, blocks: int) -> None:
        """Tell the tier a restored hit of ``blocks`` blocks was thrown away unused."""
        hook = getattr(self.hooks, "restore_discarded", None)
        if hook is None:
            return
        try:
            hook(blocks=blocks)
        except Exception:
            log.exception("cold tier restore_discarded hook failed")

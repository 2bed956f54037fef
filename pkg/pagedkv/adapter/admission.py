"""Admission (docs/coordinator.md, "Admission and preemption"): the per-turn block
reservation, the watermark, and the fit check a scheduler asks before admitting a request.

The arithmetic is pure functions; :class:`AdmissionControl` applies it to a lifecycle's
groups' current counts (the request lifecycle inherits it, so the single-group adapter and
the grouped coordinator answer the same questions).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.adapter.arguments import as_count
from pagedkv.argument_checks import int_argument, is_int, items_argument
from pagedkv.errors import CapacityExceeded, InvalidArgument, InvalidArgumentType

if TYPE_CHECKING:
    from pagedkv.adapter.group_blocks import GroupBlocks
    from pagedkv.adapter.sequence_rows import SequenceRows

__all__ = ["DEFAULT_WATERMARK_FRACTION", "AdmissionControl", "AdmissionDecision",
           "reservation_blocks", "watermark_blocks", "watermark_fraction"]

#: Fraction of a pool kept free while other rows run (vLLM's default watermark).
DEFAULT_WATERMARK_FRACTION = 0.01


class AdmissionDecision(enum.Enum):
    """What to do with the request at the head of the queue."""

    ADMIT = "admit"
    DEFER = "defer"     # other rows are live: wait for them to finish or be preempted
    GROW = "grow"       # nothing live: grow the (single-group) pool once, then decide again
    REJECT = "reject"   # nothing live and no growth left: it does not fit now


def reservation_blocks(prompt_tokens: int, max_new_tokens: int, block_size: int) -> int:
    """Blocks a turn reserves in a group of ``block_size``: ``ceil(prompt / bs) + (1 if
    max_new_tokens > 0 else 0)``, capped at ``ceil((prompt + max_new_tokens) / bs)``: the
    prompt plus the block its first decode token may open, never more than the whole turn
    can use."""
    prompt = as_count(prompt_tokens, "prompt_tokens")
    new = as_count(max_new_tokens, "max_new_tokens")
    bs = int_argument("block_size", block_size, minimum=1)  # a block of 0 tokens divides by 0
    blocks = -(-prompt // bs) + (1 if new > 0 else 0)
    return min(blocks, -(-(prompt + new) // bs))


def watermark_fraction(value) -> float:
    """A watermark fraction clamped to ``[0, 1]``; NaN or infinite → the default (0.01)."""
    if value is None:
        return DEFAULT_WATERMARK_FRACTION
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentType(
                f"watermark_fraction must be a number, got {type(value).__name__}") from None
    value = float(value)
    if not math.isfinite(value):
        return DEFAULT_WATERMARK_FRACTION
    return min(1.0, max(0.0, value))


# can_admit's keyword of the same name shadows the function inside it.
_clamp_fraction = watermark_fraction


def watermark_blocks(capacity_blocks: int, fraction: float, live_rows: int) -> int:
    """``ceil(capacity * fraction)`` while rows are live, else 0 (an idle pool admits into
    its last block), so never more than ``capacity_blocks``. ``capacity_blocks`` and
    ``live_rows`` are non-negative ints, ``fraction`` a number in ``[0, 1]`` (clamp a
    configured one with :func:`watermark_fraction`): else ``InvalidArgumentType`` (bool,
    float count, str, None) or ``InvalidArgument`` (negative, NaN, outside ``[0, 1]``)."""
    capacity = as_count(capacity_blocks, "capacity_blocks")
    rows = as_count(live_rows, "live_rows")
    if isinstance(fraction, (bool, np.bool_)) or not isinstance(
            fraction, (int, float, np.integer, np.floating)):
        raise InvalidArgumentType(
            f"fraction must be a number in [0, 1], got {type(fraction).__name__}")
    share = float(fraction)
    if not 0.0 <= share <= 1.0:  # NaN too
        raise InvalidArgument(f"fraction = {share!r} is outside [0, 1]; clamp a configured "
                              "fraction with watermark_fraction")
    # Rounded first, so 100 * 0.07 (7.000000000000001 in binary) is 7 blocks, not 8.
    return math.ceil(round(capacity * share, 9)) if rows else 0


class AdmissionControl:
    """The admission questions of a request lifecycle over its groups (a mixin of
    :class:`~pagedkv.adapter.lifecycle.RequestLifecycle`, whose groups, rows and row lookup
    it reads)."""

    _groups: tuple[GroupBlocks, ...]
    _rows: SequenceRows

    def _row(self, seq_id: Hashable) -> int:
        raise NotImplementedError

    def reservation_for(self, prompt_tokens: int, max_new_tokens: int) -> tuple[int, ...]:
        """Blocks one turn reserves in each group (docs/coordinator.md, "Admission and
        preemption"): the reservation rule, a sliding group's capped at its admission
        blocks. Above a group's max pool → ``CapacityExceeded`` ("request requires N paged
        blocks but the max pool holds M")."""
        out = []
        for i, g in enumerate(self._groups):
            blocks = g.cap_reservation(reservation_blocks(prompt_tokens, max_new_tokens,
                                                          g.block_size))
            usable = g.usable_max_blocks()
            if blocks > usable:
                raise CapacityExceeded(
                    f"request requires {blocks} paged blocks but the max pool holds {usable}"
                    + (f" (group {i})" if len(self._groups) > 1 else ""))
            out.append(blocks)
        return tuple(out)

    def _per_group(self, blocks, name: str) -> tuple[int, ...]:
        if is_int(blocks):
            return (as_count(blocks, name),) * len(self._groups)
        # items_argument: a float or None is an InvalidArgumentType, not "not iterable".
        out = tuple(as_count(b, f"{name}[{i}]")
                    for i, b in enumerate(items_argument(name, blocks)))
        if len(out) != len(self._groups):
            raise InvalidArgument(f"{name} has {len(out)} entries for {len(self._groups)} "
                                  "groups: one per group (or one int for all)")
        return out

    #: The admission watermark when ``can_admit`` is given none (a fraction of each pool,
    #: clamped to [0, 1]; non-finite → 0.01).
    default_watermark_fraction: float = DEFAULT_WATERMARK_FRACTION

    def unallocated_reserved_blocks(self) -> tuple[int, ...]:
        """Per group: blocks admitted rows reserved and do not hold yet."""
        live = np.fromiter(self._rows.row_of.values(), np.intp, len(self._rows))
        return tuple(g.unallocated_reserved(live) for g in self._groups)

    def admission_need(self, seq_id: Hashable, blocks) -> tuple[int, ...]:
        """Per group: what a reservation of ``blocks`` still needs once the live row
        ``seq_id`` holds its lookup's blocks (``max(0, reservation - held)``)."""
        row = self._row(seq_id)
        return tuple(max(0, b - g.live_blocks(row)) for g, b in
                     zip(self._groups, self._per_group(blocks, "blocks"), strict=True))

    #: Bytes of per-row state (recurrent, conv) all admitted rows may hold together, or
    #: ``None`` (unchecked); rows declare theirs with ``note_admitted(..., state_bytes=)``.
    state_budget_bytes: int | None = None

    def can_admit(self, blocks, *, watermark_fraction: float | None = None,
                  exclude: Hashable | None = None, extra_state_bytes: int = 0) -> bool:
        """Whether a request needing ``blocks`` (an int for every group, or one per group)
        fits now: ``unallocated_reserved + blocks + watermark <= free + reclaimable`` in
        every group, with ``watermark = ceil(pool_blocks * fraction)`` while rows are live
        (``exclude``: the candidate's own live row, which neither counts as live nor as
        reserved). Counts are the current ones: a growable pool's max never counts. With a
        :attr:`state_budget_bytes`, the live rows' state bytes plus ``extra_state_bytes``
        (the candidate's) must fit it too."""
        wanted = self._per_group(blocks, "blocks")
        fraction = _clamp_fraction(self.default_watermark_fraction
                                   if watermark_fraction is None else watermark_fraction)
        rows = self._rows
        try:
            skip = rows.row_of.get(exclude) if exclude is not None else None
        except TypeError:
            raise InvalidArgumentType(
                f"exclude {exclude!r} is unhashable ({type(exclude).__name__}): pass the "
                "candidate's seq_id (an int, a str or a tuple of them) or None") from None
        live_rows = [r for r in rows.row_of.values() if r != skip]
        live = np.asarray(live_rows, np.intp)
        if self.state_budget_bytes is not None and int(rows.state_bytes[live].sum()) + \
                as_count(extra_state_bytes, "extra_state_bytes") > self.state_budget_bytes:
            return False
        for g, want in zip(self._groups, wanted, strict=True):
            mark = watermark_blocks(g.usable_blocks(), fraction, len(live_rows))
            if g.unallocated_reserved(live) + want + mark > g.allocator.free_or_evictable_blocks:
                return False
        return True

    def note_admitted(self, seq_id: Hashable, blocks, *, state_bytes: int = 0) -> None:
        """Record the admission reservation of a live sequence (counted by
        :meth:`can_admit` until its tables hold that many blocks) and the bytes of its
        per-row state (counted against :attr:`state_budget_bytes` while it is live)."""
        row = self._row(seq_id)
        per_group = self._per_group(blocks, "blocks")
        state = as_count(state_bytes, "state_bytes")
        # Everything is checked before anything is written: a reservation above the max pool
        # could never be met (can_admit would refuse every later request while the row
        # lives) and overflowed the int32 table halfway through the groups, after the
        # state bytes were already stored.
        for i, (g, b) in enumerate(zip(self._groups, per_group, strict=True)):
            usable = g.usable_max_blocks()
            if b > usable:
                raise CapacityExceeded(
                    f"note_admitted: a reservation of {b} paged blocks but the max pool holds "
                    f"{usable}" + (f" (group {i})" if len(self._groups) > 1 else "")
                    + "; record what reservation_for returned")
        if state > np.iinfo(self._rows.state_bytes.dtype).max:
            raise InvalidArgument(f"state_bytes = {state} does not fit a signed 64-bit count")
        self._rows.state_bytes[row] = state
        for g, b in zip(self._groups, per_group, strict=True):
            g.reserved[row] = b

    def try_grow_for(self, blocks) -> bool:
        """Grow growable pools once so a request reserving ``blocks`` fits an idle cache;
        whether anything grew."""
        grew = False
        for g, want in zip(self._groups, self._per_group(blocks, "blocks"), strict=True):
            need = want - g.allocator.free_or_evictable_blocks
            if need > 0 and g.grow_once(need):
                grew = True
        return grew

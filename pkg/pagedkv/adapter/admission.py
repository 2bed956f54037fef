"""Admission arithmetic (docs/coordinator.md, "Admission and preemption"): the per-turn
block reservation, the watermark, and what a scheduler does when a request does not fit.

Pure functions; the lifecycle applies them to its groups' current counts
(:meth:`~pagedkv.adapter.lifecycle.RequestLifecycle.can_admit`).
"""

from __future__ import annotations

import enum
import math

from pagedkv.adapter.arguments import as_count
from pagedkv.errors import InvalidArgumentType

__all__ = ["DEFAULT_WATERMARK_FRACTION", "AdmissionDecision", "reservation_blocks",
           "watermark_blocks", "watermark_fraction"]

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
    bs = as_count(block_size, "block_size")
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


def watermark_blocks(capacity_blocks: int, fraction: float, live_rows: int) -> int:
    """``ceil(capacity * fraction)`` while rows are live, else 0 (an idle pool admits into
    its last block)."""
    # Rounded first, so 100 * 0.07 (7.000000000000001 in binary) is 7 blocks, not 8.
    return math.ceil(round(capacity_blocks * fraction, 9)) if live_rows else 0

"""Multi-turn policy over a request lifecycle (docs/adapter.md, "Lifecycle": ``prepare_turn``
and ``restart_prepared_turn_cold``).

When a conversation's next turn may continue the live tables, when it must start fresh,
and how a prepared hit is discarded. Written against
:class:`~pagedkv.adapter.lifecycle.RequestLifecycle`, so the single-group adapter and the
grouped coordinator follow the same policy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.adapter.lifecycle import RequestLifecycle
from pagedkv.adapter.results import TurnPlan, TurnPlanReason
from pagedkv.errors import ContextLengthExceeded

__all__ = ["prepare_turn", "restart_prepared_turn_cold"]


def prepare_turn(cache: RequestLifecycle, seq_id: Hashable, prompt, *, total_tokens: int,
                 reuse_live: bool = True, extra_keys: Sequence[int] = (),
                 extra_keys_per_block=None, cache_salt: int = 0, skip_lookup: bool = False,
                 max_cached_tokens: int | None = None) -> TurnPlan:
    """Continue the live tables when the prompt extends them, else reset + lookup +
    allocate.

    Continues (``CONTINUED_LIVE_PREFIX``) when ``reuse_live``, the sequence is finalized,
    the prompt starts with its tokens and they are at most ``max_cached_tokens`` (default
    ``len(prompt) - 1``: the last prompt token is always recomputed). Otherwise, or when the
    continuation runs out of blocks (``CONTINUE_FAILED_RESET``), the sequence is released and
    starts fresh (``FRESH_RESET``). Any error (a refused ``continue_turn`` included) releases
    the sequence, so no prefix reference leaks.
    """
    toks = as_tokens(prompt, "prompt")
    limit = (len(toks) - 1 if max_cached_tokens is None
             else as_count(max_cached_tokens, "max_cached_tokens"))
    reason = TurnPlanReason.FRESH_RESET
    if reuse_live and cache.is_live_for_continue(seq_id):
        live = cache.request_tokens(seq_id)
        prior = len(live)
        if prior <= limit and prior <= len(toks) and np.array_equal(toks[:prior], live):
            try:
                _, new = cache.continue_turn(seq_id, toks, total_tokens)
                return TurnPlan(TurnPlanReason.CONTINUED_LIVE_PREFIX, prior, new)
            except ContextLengthExceeded:
                reason = TurnPlanReason.CONTINUE_FAILED_RESET
            except BaseException:  # e.g. a bad total_tokens: released like the fresh path
                cache.release_request(seq_id)
                raise
    try:
        cache.reset_for_new_request(seq_id)
        hit = cache.find_cached_prefix(
            seq_id, toks, extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
            cache_salt=cache_salt, skip_lookup=skip_lookup, max_tokens=max(limit, 0))
        new = cache.allocate_suffix_blocks(seq_id, total_tokens)
    except BaseException:
        cache.release_request(seq_id)
        raise
    return TurnPlan(reason, hit.cached_tokens, new)


def restart_prepared_turn_cold(cache: RequestLifecycle, seq_id: Hashable, prompt,
                               total_tokens: int) -> int:
    """Discard a prepared hit: release, reset, forced miss, allocate. Returns new blocks.
    Throwing away blocks the cold tier restored tells the tier (its ``restore_discarded``
    hook counts ``restore_suppressed``). A bad ``prompt`` or ``total_tokens`` is refused
    before anything changes: the live request, its blocks and the tier's counters stay."""
    # Checked first: the release below is not undone when a later step refuses the call.
    toks = as_tokens(prompt, "prompt")
    total = as_count(total_tokens, "total_tokens")
    restored = cache.restored_block_count(seq_id)
    if restored > 0 and cache._cold_calls is not None:
        cache._cold_calls.restore_discarded(restored)
    cache.reset_for_new_request(seq_id)
    try:
        cache.find_cached_prefix(seq_id, toks, skip_lookup=True)
        return cache.allocate_suffix_blocks(seq_id, total)
    except BaseException:
        cache.release_request(seq_id)
        raise

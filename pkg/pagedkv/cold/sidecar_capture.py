"""Sidecar capture after the K/V walk (docs/cold.md, "Sidecar capture").

One sidecar per turn, anchored at the deepest retained in-memory checkpoint the persisted
K/V chain reaches, under the same salt and extra keys as that chain. It **waits** for a
queue slot until the turn's deadline: a dropped sidecar makes the whole turn's chain
unrestorable (restore reconciles down to a backed boundary), while a dropped block only
shortens it. Every exit moves exactly one ``ColdSidecarStats`` counter besides
``capture_reached``.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedkv.cold.keys import sidecar_key
from pagedkv.cold.stats import sidecar_counters
from pagedkv.cold.writer import SidecarJob
from pagedkv.errors import SidecarLayoutMismatch

__all__ = ["SidecarCaptureOutcome", "SidecarCaptureStop", "capture_sidecar",
           "sidecar_anchor"]

log = logging.getLogger("pagedkv.cold")


class SidecarCaptureStop(enum.Enum):
    """How one turn's sidecar capture ended, and the counter it moved."""

    ENQUEUED = "enqueued"                    # enqueued
    CHAIN_EMPTY = "chain_empty"              # chain_empty: no whole block persisted
    BOUNDARY_SKIP = "boundary_skip"          # boundary_skips: no checkpoint under the reach
    ALREADY_PERSISTED = "already_persisted"  # already_persisted: on disk or queued
    QUEUE_DROP = "queue_drop"                # queue_drops: no slot before the deadline
    LAYOUT_MISMATCH = "layout_mismatch"      # none: the state disagrees with its layout


@dataclass(frozen=True)
class SidecarCaptureOutcome:
    """``boundary_tokens``: the anchor (0 when none was chosen); ``elapsed_ms``: time on
    the calling thread."""

    stop: SidecarCaptureStop
    boundary_tokens: int
    elapsed_ms: float


def sidecar_anchor(checkpoints, captured_blocks: int, block_size: int) -> int | None:
    """The deepest checkpoint boundary ``b`` with ``0 < b <= captured_blocks * block_size``
    and ``b % block_size == 0`` (tokens), or ``None``."""
    reach = int(captured_blocks) * int(block_size)
    best = None
    for b in checkpoints:
        b = int(b)
        if 0 < b <= reach and b % block_size == 0 and (best is None or b > best):
            best = b
    return best


def capture_sidecar(tier, fingerprint: bytes, codec, checkpoints: Mapping[int, Any], *,
                    tokens, captured_blocks: int, block_size: int, deadline: float,
                    cache_salt: int = 0, extra_keys=(), extra_keys_per_block=None
                    ) -> SidecarCaptureOutcome:
    """Persist the state of the deepest checkpoint under the K/V chain's reach.

    ``codec``: the family's sidecar codec (``group``, ``pack(state, boundary)``);
    ``checkpoints``: the request lineage's retained in-memory checkpoints, boundary (tokens)
    → state in the codec's form; ``captured_blocks``: the K/V walk's reach
    (``CaptureOutcome.blocks``); ``deadline``: ``time.monotonic()`` seconds the enqueue may
    wait until. State whose dtype or shape differs from the layout is skipped (WARNING),
    never written under a wrong label. Raises only what ``tier.enqueue_before`` raises
    (``ColdTierClosed``).
    """
    t0 = time.monotonic()
    counters = sidecar_counters()
    counters.add("capture_reached")

    def done(stop: SidecarCaptureStop, b: int = 0) -> SidecarCaptureOutcome:
        out = SidecarCaptureOutcome(stop, b, (time.monotonic() - t0) * 1e3)
        log.debug("cold_sidecar_capture group=%s stop=%s boundary=%d reach=%d elapsed_ms=%.3f",
                  codec.group.label, stop.value, b, int(captured_blocks) * block_size,
                  out.elapsed_ms)
        return out

    if int(captured_blocks) <= 0:
        counters.add("chain_empty")
        return done(SidecarCaptureStop.CHAIN_EMPTY)
    anchor = sidecar_anchor(checkpoints, captured_blocks, block_size)
    if anchor is None:
        counters.add("boundary_skips")
        return done(SidecarCaptureStop.BOUNDARY_SKIP)
    key = sidecar_key(tier.fmt, codec.group, fingerprint, tokens, block_size, anchor,
                      extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                      cache_salt=cache_salt)
    tier.store.learn_presence([key], codec.group)  # another replica may have written it
    if tier.contains_in(key, codec.group) or tier.writer.is_queued(key):
        counters.add("already_persisted")
        return done(SidecarCaptureStop.ALREADY_PERSISTED, anchor)
    layout = codec.layout_at(anchor)
    writer = tier.writer
    # A recycled buffer: a fresh one of tens of MiB costs this thread its page faults.
    taken = writer.take_buffer((layout.tensor_count, layout.bytes_per_tensor))
    try:
        layout, payload = codec.pack(checkpoints[anchor], anchor, out=taken)
    except SidecarLayoutMismatch as exc:
        writer.give_back(taken)
        log.warning("cold tier: %s sidecar at %d tokens not captured: %s",
                    codec.group.label, anchor, exc)
        return done(SidecarCaptureStop.LAYOUT_MISMATCH, anchor)
    except BaseException:
        writer.give_back(taken)
        raise
    job = SidecarJob(key, fingerprint.hex(), layout, payload, recycle=payload is taken)
    accepted = False
    try:
        accepted = tier.enqueue_before(job, deadline)
    finally:
        if not accepted and job.recycle:
            writer.give_back(payload)
    if accepted:
        counters.add("enqueued")
        return done(SidecarCaptureStop.ENQUEUED, anchor)
    counters.add("queue_drops")
    log.warning("cold tier: %s sidecar at %d tokens dropped: the writer queue stayed full "
                "until the capture deadline", codec.group.label, anchor)
    return done(SidecarCaptureStop.QUEUE_DROP, anchor)

"""The budgeted capture walk (docs/contracts/cold-tier.md, '8.1 Capture budget' to '8.2 Capture
walk').

Runs on the inference thread after hot registration. The budget counts blocks *written*
(a block already on disk, or queued by an earlier walk, costs one index probe), and the
walk waits for a queue slot until its deadline instead of stopping at the first full
queue — depth bounds memory, not reach.
It breaks rather than skips: a restore stops at the first hole anyway.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.cold.codec import BlockGeometry
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.keys import cold_key_chain
from pagedkv.cold.writer import BlockJob
from pagedkv.errors import InvalidArgument
from pagedkv.hashing import as_token_array

if TYPE_CHECKING:
    from pagedkv.cold.sidecar_capture import SidecarCaptureOutcome

__all__ = ["CaptureOutcome", "CaptureStop", "capture_and_enqueue_before", "capture_walk"]

log = logging.getLogger("pagedkv.cold")


class CaptureStop(enum.Enum):
    END = "end"            # every full block is on disk or queued
    BUDGET = "budget"      # blocks_per_turn written; the next turn continues
    DEADLINE = "deadline"  # budget_ms elapsed (or a slot never freed before it)
    ERROR = "error"        # a pool read failed; nothing enqueued for that block


@dataclass(frozen=True)
class CaptureOutcome:
    """``blocks``: the chain reach (blocks on disk or queued, from block 0);
    ``enqueued``: jobs this walk queued; ``elapsed_ms``: wall time on the calling thread;
    ``sidecar``: how the family's sidecar capture after the walk ended (``None`` without a
    sidecar codec; one outcome per part for a ``SidecarBundle``)."""

    blocks: int
    enqueued: int
    elapsed_ms: float
    stop: CaptureStop
    sidecar: SidecarCaptureOutcome | tuple[SidecarCaptureOutcome, ...] | None = None


def _hold(allocator, block_id: int) -> bool:
    incref = getattr(allocator, "incref", None)
    if incref is None:
        return False
    incref(block_id)
    return True


def capture_and_enqueue_before(tier, pool, allocator, block_id: int, key: bytes, tokens,
                               deadline: float, *, fingerprint_hex: str,
                               geometry: BlockGeometry) -> bool:
    """Copy one block out of the pool into a buffer the job owns (the block is held by an
    extra reference meanwhile, released always) and offer it until ``deadline``. A pool
    read failure, or a block the allocator cannot hold (free, out of range), raises,
    enqueues nothing and gives the buffer back, and so does a pool no longer of ``geometry``
    after the read (a kv_adaptive step transcoded it): its bytes may be the new mode's,
    which must not be published under the fingerprint of ``geometry``'s."""
    if len(tokens) != geometry.block_size:
        raise InvalidArgument(f"tokens has {len(tokens)} tokens; only full blocks of "
                              f"block_size = {geometry.block_size} are persisted")
    writer = tier.writer
    taken = writer.take_buffer(geometry.buffer_shape)
    held = False
    try:
        held = _hold(allocator, block_id)  # a free or out-of-range id raises here
        out = pool.read_block(int(block_id), out=taken)
    except BaseException:
        writer.give_back(taken)
        raise
    finally:
        if held:
            allocator.free(block_id)
    # Steps are one-way, so a pool still of ``geometry`` after the read was of it during
    # the read: the bytes are that mode's.
    if BlockGeometry.of(pool.geometry).as_tuple() != geometry.as_tuple():
        writer.give_back(taken)
        raise InvalidArgument(f"the pool left {geometry.dtype!r} (now "
                              f"{pool.geometry.dtype!r}) during the capture: block not "
                              f"captured under the fingerprint of {geometry.dtype!r}")
    recycle = out is taken
    if not recycle:
        writer.give_back(taken)
    buffer = taken if recycle else np.ascontiguousarray(out, dtype=np.uint8)
    toks = np.array(tokens, dtype=np.uint32)  # the job owns its tokens
    # The checksum is left to the writer's hashing stage: SHA-256 of a 200 KB block alone
    # would take most of the 0.25 ms this thread may spend per block (docs/contracts/cold-tier.md,
    # '7.4 Service time').
    job = BlockJob(key, fingerprint_hex, geometry, toks, buffer, recycle=recycle)
    accepted = False
    try:
        accepted = tier.enqueue_before(job, deadline)
    finally:
        # a dropped job's buffer is reused: a fresh one is page faults on this thread
        if not accepted and recycle:
            writer.give_back(buffer)
    return accepted


def capture_walk(tier, fingerprint: bytes, *, tokens, block_ids, cache_salt: int = 0,
                 extra_keys=(), extra_keys_per_block=None, pool, allocator,
                 blocks_per_turn: int, budget_ms: int, geometry=None) -> CaptureOutcome:
    """Persist the request's full blocks, block 0 first, within the turn's budget.
    ``geometry``: the pool geometry ``fingerprint`` belongs to (default: the pool's now)."""
    t0 = time.monotonic()
    deadline = t0 + budget_ms / 1000.0
    toks = as_token_array(tokens)
    ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
    geometry = BlockGeometry.of(pool.geometry if geometry is None else geometry)
    bs = geometry.block_size
    keys = cold_key_chain(tier.fmt, ColdGroup.KV, fingerprint, toks, bs,
                          extra_keys=extra_keys, extra_keys_per_block=extra_keys_per_block,
                          cache_salt=cache_salt, max_blocks=len(ids))
    fp_hex = fingerprint.hex()
    enqueued = reach = 0
    stop = CaptureStop.END
    # A remote backend learns which blocks the fleet already stored in one round trip, so
    # the probes below stay index lookups.
    tier.store.learn_presence(keys)
    for i, key in enumerate(keys):
        if not tier.persisted_or_queued(key):
            if enqueued >= blocks_per_turn:
                stop = CaptureStop.BUDGET
                break
            if time.monotonic() >= deadline:
                stop = CaptureStop.DEADLINE
                break
            try:
                accepted = capture_and_enqueue_before(
                    tier, pool, allocator, int(ids[i]), key, toks[i * bs:(i + 1) * bs],
                    deadline, fingerprint_hex=fp_hex, geometry=geometry)
            except Exception as exc:  # noqa: BLE001 - a pool read failure must not reach inference
                log.warning("cold tier: capture of block %d failed: %s", i, exc)
                stop = CaptureStop.ERROR
                break
            if not accepted:
                stop = CaptureStop.DEADLINE
                break
            enqueued += 1
        reach = i + 1
    elapsed_ms = (time.monotonic() - t0) * 1000.0
    outcome = CaptureOutcome(reach, enqueued, elapsed_ms, stop)
    if stop is CaptureStop.DEADLINE:
        log.warning("cold_capture_walk stopped at its deadline: blocks=%d enqueued=%d "
                    "budget_ms=%d", reach, enqueued, budget_ms)
    log.debug("cold_capture_walk entry=%d blocks=%d enqueued=%d stop=%s elapsed_ms=%.3f "
              "budget_blocks=%d budget_ms=%d", len(keys), reach, enqueued, stop.value,
              elapsed_ms, blocks_per_turn, budget_ms)
    return outcome

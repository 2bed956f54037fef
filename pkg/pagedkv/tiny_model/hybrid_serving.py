"""A serving loop for the hybrid reference model over a grouped coordinator (``pagedkv demo
--model hybrid``, parity tests; docs/tiny-model.md, "Serving").

The loop of :func:`pagedkv.tiny_model.serving.serve` — admission and recompute preemption by
:class:`pagedkv.coordinator.RecomputeScheduler`, interleaved decode steps, registration at
the end — plus what a hybrid model needs:

* a prefix hit comes with the linear layers' state at exactly its boundary (a hot
  checkpoint, or a sidecar the cold tier restored) and the loop installs it before
  computing anything; the sliding groups' window is already in their blocks;
* the prefill splits where the GDN ladder wants checkpoints
  (``pagedkv.cold.ladder.prefill_checkpoint_boundaries`` and ``prefill_ranges``) and
  publishes a snapshot there to the coordinator's checkpoint store, which the hot reuse rule
  and the cold sidecar capture both read;
* after every forward step the sliding groups point what no query attends any more at
  their null block (``prune_sliding``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.errors import AuxStateUnconfirmed, InvalidArgumentType
from pagedkv.tiny_model.hybrid_config import HybridConfig
from pagedkv.tiny_model.hybrid_paged import HybridPagedKV
from pagedkv.tiny_model.model import ReferenceModel
from pagedkv.tiny_model.serving import (
    Request,
    RunningRequest,
    SessionReport,
    check_request,
    count_admission,
    run_session,
)

__all__ = ["HybridSessionReport", "install_hit_state", "serve_hybrid"]

@dataclass
class HybridSessionReport(SessionReport):
    """:class:`~pagedkv.tiny_model.serving.SessionReport` plus, per group (group id order),
    its kind, pool blocks and the most blocks rows held at once (cache-only blocks
    excluded); the sliding blocks
    the prunes returned to the null sentinel; the checkpoints the prefills published; and
    how many hits came with a hot checkpoint or a restored cold sidecar."""

    group_kinds: list[str] = field(default_factory=list)
    group_pool_blocks: list[int] = field(default_factory=list)
    group_peak_blocks: list[int] = field(default_factory=list)
    sliding_blocks_nulled: int = 0
    checkpoints_published: int = 0
    hot_state_hits: int = 0
    cold_state_restores: int = 0


def install_hit_state(kv: HybridPagedKV, lookup, cold_codec=None) -> str:
    """Resume ``kv``'s linear layers at its lookup's boundary from ``lookup.sidecar``: a hot
    :class:`~pagedkv.coordinator.Checkpoint` (its state a snapshot) or a cold sidecar (decoded
    with ``cold_codec``). Returns ``"none"``, ``"hot"`` or ``"cold"``. A hit without its
    state, or with a state at another boundary than ``cached_tokens`` (the lifecycle's aux
    latch), raises ``AuxStateUnconfirmed`` and installs nothing."""
    from pagedkv.coordinator import Checkpoint
    from pagedkv.tiny_model.hybrid_state import HybridSnapshot

    cached = lookup.cached_tokens
    if cached == 0 or not kv.config.linear_attention_layers:
        return "none"
    side = lookup.sidecar
    at = getattr(side, "boundary_tokens", None)
    if side is not None and at != cached:
        # The lifecycle latched this hit (its state is not at the hit's end): installing it
        # at ``cached`` would confirm the latch with the state of another prefix.
        raise AuxStateUnconfirmed(f"seq_id {kv.seq_id!r} resumed {cached} cached tokens, but "
                                  f"the state that came with the hit is at {at} tokens")
    if isinstance(side, Checkpoint) and isinstance(side.state, HybridSnapshot):
        snap = side.state
        kv.install_linear_states(cached, snap.conv_states, snap.recurrent_states)
        return "hot"
    if side is not None and cold_codec is not None:
        from pagedkv.tiny_model.hybrid_cold import linear_states_from_sidecar
        convs, recs = linear_states_from_sidecar(kv.config, side, cold_codec)
        kv.install_linear_states(cached, convs, recs)
        return "cold"
    raise AuxStateUnconfirmed(f"seq_id {kv.seq_id!r} resumed {cached} cached tokens without "
                              "the linear layers' state")


def serve_hybrid(model: ReferenceModel, cache, requests: Sequence[Request], *,
                 max_batch: int = 8, warm_first: bool = True,
                 prefill_chunk_tokens: int | None = None, want_ladder: bool = True,
                 watermark_fraction: float | None = None,
                 checkpoint_boundaries: Callable[[int, int, int], list[int]] | None = None
                 ) -> HybridSessionReport:
    """Run ``requests`` to completion on the hybrid ``model`` over ``cache`` (a
    :class:`~pagedkv.coordinator.GroupedKVCoordinator` for its config, e.g.
    :func:`~pagedkv.tiny_model.hybrid_paged.build_hybrid_coordinator`).

    ``prefill_chunk_tokens``: prefill chunk (and admission reservation) size, default the
    whole prompt; ``want_ladder``: checkpoints at every ladder rung, else only below the
    prompt end; ``checkpoint_boundaries(n, cached, bs)`` replaces that rule. The rest is
    :func:`~pagedkv.tiny_model.serving.serve`'s. Every output is what the request gives run
    alone on a flat cache (:func:`~pagedkv.tiny_model.serving.check_parity`).
    """
    from pagedkv.cold.ladder import prefill_checkpoint_boundaries, prefill_ranges
    from pagedkv.coordinator import RecomputeScheduler

    config = model.config
    if not isinstance(config, HybridConfig):
        raise InvalidArgumentType(f"serve_hybrid needs a hybrid model, got a "
                                  f"{type(config).__name__}: use serving.serve")
    max_batch = int_argument("max_batch", max_batch, minimum=1)
    for r in requests:
        check_request(model, r)
    bs = cache.groups[0].block_size
    store = cache.checkpoints
    cold_codec = getattr(cache.cold, "sidecar", None)
    rule = checkpoint_boundaries or (
        lambda n, cached, block: prefill_checkpoint_boundaries(n, cached, block,
                                                               want_ladder=want_ladder))
    report = HybridSessionReport()
    report.group_kinds = [g.kind_name if g.kind_name == "full" else f"sliding({g.window})"
                          for g in cache.groups]
    report.group_peak_blocks = [0] * len(cache.groups)
    stats0 = cache.stats()
    scheduler = RecomputeScheduler(cache, max_running=1 if warm_first else max_batch,
                                   watermark_fraction=watermark_fraction,
                                   prefill_chunk_tokens=prefill_chunk_tokens)
    for r in requests:
        scheduler.add(r.seq_id, r.prompt, r.max_new_tokens, cache_salt=r.cache_salt,
                      payload=RunningRequest(r))

    def note_peaks() -> None:
        for i, g in enumerate(cache.groups):
            held = g.allocator.num_allocated_blocks - g.allocator.num_evictable_blocks
            report.group_peak_blocks[i] = max(report.group_peak_blocks[i], held)

    def prefill(admission) -> None:
        state: RunningRequest = admission.request.payload
        state.restart()
        r = state.request
        seq, prompt, hit = r.seq_id, np.asarray(r.prompt), admission.lookup
        kv = state.kv = HybridPagedKV(cache, seq, config, model.backend)
        t0 = time.perf_counter()
        source = install_hit_state(kv, hit, cold_codec)
        report.hot_state_hits += source == "hot"
        report.cold_state_restores += source == "cold"
        if source == "cold" and store is not None and kv.sliding_rows_live():
            # The restored state becomes a hot checkpoint: later requests sharing the prefix
            # resume from memory (the full blocks are hot now, so the disk is not asked).
            report.checkpoints_published += store.publish(
                prompt, hit.cached_tokens, kv.snapshot(), cache_salt=r.cache_salt, owner=seq)
        cuts = rule(len(prompt), hit.cached_tokens, bs) if store is not None else []
        logits = None
        for a, b in prefill_ranges(len(prompt), prefill_chunk_tokens, cuts,
                                   start=hit.cached_tokens):
            logits, _ = scheduler.run_or_preempt(seq, partial(model.forward, prompt[a:b], kv))
            if logits is None:  # this request was the newest: preempted, it recomputes
                report.sliding_blocks_nulled += kv.blocks_nulled
                return
            note_peaks()
            if b in cuts and kv.sliding_rows_live():
                report.checkpoints_published += store.publish(
                    prompt, b, kv.snapshot(), cache_salt=r.cache_salt, owner=seq)
        assert logits is not None
        report.sliding_blocks_nulled += kv.blocks_nulled
        state.take(logits[-1])
        count_admission(report, len(prompt), hit, time.perf_counter() - t0)

    def decode(request) -> np.ndarray:
        state = request.payload
        return model.forward(state.tokens[-1:], state.kv, already_recorded=True)[-1]

    def after_step(seqs) -> None:
        note_peaks()
        report.sliding_blocks_nulled += cache.prune_sliding(seqs)

    run_session(scheduler, cache, report, prefill=prefill, decode=decode,
                max_batch=max_batch, after_step=after_step)
    stats = cache.stats()
    report.blocks_allocated = stats["blocks_allocated"] - stats0["blocks_allocated"]
    report.grow_events = stats["grow_events"] - stats0["grow_events"]
    report.evictions = sum(g.allocator.stats()["pressure_evictions"] for g in cache.groups)
    report.group_pool_blocks = [g.pool.num_blocks for g in cache.groups]
    report.pool_blocks = sum(report.group_pool_blocks)
    report.pool_max_blocks = sum(g.pool.max_num_blocks for g in cache.groups)
    return report

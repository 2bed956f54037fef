"""A small serving loop over the reference model and a paged adapter (``pagedkv demo``,
parity tests).

Requests are admitted by :class:`pagedkv.coordinator.RecomputeScheduler` (reset → prefix
lookup → fit check → suffix reservation), prefilled from their cached prefix, decoded in
interleaved steps (one batched ``record_decode_tokens`` + ``prepare_decode`` per step, then each
sequence's forward), and on completion registered for reuse and released. A request that does
not fit waits; a decode step that runs out of blocks preempts the newest running request,
which recomputes later (docs/coordinator.md, "Admission and preemption"). Greedy decoding is
deterministic, so every output must equal the same request run alone on a flat cache:
:func:`check_parity`.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.argument_checks import int_argument
from pagedkv.errors import ContextLengthExceeded
from pagedkv.tiny_model.kv_paths import PagedKV
from pagedkv.tiny_model.model import Generation, ReferenceModel

__all__ = ["Request", "RunningRequest", "SessionReport", "build_paged_adapter", "check_parity",
           "check_request",
           "count_admission", "run_session", "serve"]


class Request(NamedTuple):
    """One generation request: ``prompt`` token ids, greedy ``max_new_tokens``, tenant salt
    (a u64 domain id from ``salt_domain_id``; 0 = shared)."""

    seq_id: Hashable
    prompt: np.ndarray
    max_new_tokens: int
    cache_salt: int = 0


@dataclass
class SessionReport:
    """What a :func:`serve` run did. Token and block counts are summed over admissions (a
    preempted request counts again when it is readmitted); times are seconds."""

    outputs: dict = field(default_factory=dict, repr=False)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    hit_requests: int = 0
    blocks_allocated: int = 0
    blocks_shared: int = 0
    grow_events: int = 0
    evictions: int = 0
    preemptions: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0
    prefill_seconds: float = 0.0
    pool_blocks: int = 0
    pool_max_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def seconds_per_decode_step(self) -> float:
        return self.decode_seconds / self.decode_steps if self.decode_steps else 0.0

    @property
    def bookkeeping_seconds_per_step(self) -> float:
        return self.bookkeeping_seconds / self.decode_steps if self.decode_steps else 0.0


def build_paged_adapter(model: ReferenceModel, *, block_size: int = 16, num_blocks: int = 64,
                        max_num_blocks: int | None = None, growth: bool = True,
                        cold=None, hash_seed: int | None = None,
                        allocator_cls=None) -> PagedKVCacheAdapter:
    """A pool shaped for ``model`` (its backend and ``kv_dtype``: float32 unless the model
    runs a KV mode), an allocator and an adapter."""
    from pagedkv.pool import LayerKVPool, PoolGeometry

    if allocator_cls is None:
        from pagedkv.allocator import BlockAllocator as allocator_cls
    c = model.config
    geometry = PoolGeometry(c.num_layers, c.num_kv_heads, c.head_dim, block_size, model.kv_dtype)
    pool = LayerKVPool(geometry, num_blocks, max_num_blocks, backend=model.backend)
    allocator = allocator_cls(num_blocks, max_num_blocks, block_size, hash_seed=hash_seed)
    return PagedKVCacheAdapter(allocator, pool, cold=cold, growth=growth)


class RunningRequest:
    """A request's output so far (and, for the hybrid model, its KV path)."""

    __slots__ = ("kv", "logits", "request", "tokens")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.kv: Any = None
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []

    def restart(self) -> None:
        """A (re)admission: a preempted request's partial output is void."""
        self.tokens.clear()
        self.logits.clear()

    def take(self, logits: np.ndarray) -> int:
        self.logits.append(logits)
        token = int(np.argmax(logits))
        self.tokens.append(token)
        return token

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


def serve(model: ReferenceModel, adapter: PagedKVCacheAdapter, requests: Sequence[Request], *,
          max_batch: int = 8, warm_first: bool = True,
          watermark_fraction: float | None = None) -> SessionReport:
    """Run ``requests`` to completion; returns their outputs and what the cache did.

    Admission and preemption are :class:`pagedkv.coordinator.RecomputeScheduler`'s: a request
    is admitted when its reservation (less the blocks its prefix hit holds) fits now,
    deferred while others run, and when a decode step runs out of blocks the newest running
    request is preempted and recomputed later (greedy: the same output). ``warm_first``
    runs the first request alone before admitting the rest, so the shared prefix it
    registers is there for the others (a warm server); ``max_batch`` bounds the sequences
    decoding together; ``watermark_fraction`` overrides the admission watermark (0: admit
    into the last free block).
    """
    from pagedkv.coordinator import RecomputeScheduler

    max_batch = int_argument("max_batch", max_batch, minimum=1)
    for r in requests:
        check_request(model, r)
    report = SessionReport()
    stats0 = adapter.stats()
    evictions0 = adapter.allocator.stats()["pressure_evictions"]
    scheduler = RecomputeScheduler(adapter, max_running=1 if warm_first else max_batch,
                                   watermark_fraction=watermark_fraction)
    for r in requests:
        scheduler.add(r.seq_id, r.prompt, r.max_new_tokens, cache_salt=r.cache_salt,
                      payload=RunningRequest(r))

    def prefill(admission) -> None:
        state: RunningRequest = admission.request.payload
        state.restart()
        r = state.request
        hit = admission.lookup
        t0 = time.perf_counter()
        state.take(model.forward(r.prompt[hit.cached_tokens:], PagedKV(adapter, r.seq_id))[-1])
        count_admission(report, len(r.prompt), hit, time.perf_counter() - t0)

    def decode(request) -> np.ndarray:
        state = request.payload
        kv = PagedKV(adapter, request.seq_id)
        return model.forward(state.tokens[-1:], kv, already_recorded=True)[-1]

    run_session(scheduler, adapter, report, prefill=prefill, decode=decode,
                max_batch=max_batch)
    stats = adapter.stats()
    report.blocks_allocated = stats["blocks_allocated"] - stats0["blocks_allocated"]
    report.grow_events = stats["grow_events"] - stats0["grow_events"]
    report.evictions = adapter.allocator.stats()["pressure_evictions"] - evictions0
    report.pool_blocks = adapter.pool.num_blocks
    report.pool_max_blocks = adapter.pool.max_num_blocks
    return report


def check_request(model: ReferenceModel, request: Request) -> None:
    """Refuse ``request`` before anything is admitted: its prompt must be token ids of
    ``model`` (:meth:`ReferenceModel.token_ids`), ``max_new_tokens`` an int >= 1, and
    ``prompt + max_new_tokens - 1`` positions (the last token is not fed back) must fit
    ``max_position``. Found later, in a prefill or a decode step, the error would leave the
    request's row and blocks allocated (and end the session for the others)."""
    name = f"request {request.seq_id!r}"
    prompt = model.token_ids(request.prompt, f"{name}: prompt")
    new = int_argument(f"{name}: max_new_tokens", request.max_new_tokens, minimum=1)
    held = len(prompt) + new - 1
    if held > model.config.max_position:
        raise ContextLengthExceeded(
            f"{name} spans {held} positions ({len(prompt)} prompt + {new} new tokens - 1) but "
            f"the model holds max_position={model.config.max_position}; shorten the prompt or "
            "max_new_tokens")


def count_admission(report: SessionReport, prompt_tokens: int, lookup, seconds: float
                    ) -> None:
    """Add one admitted request's prefill (``seconds``) and lookup to ``report``."""
    report.prefill_seconds += seconds
    report.prompt_tokens += prompt_tokens
    report.cached_tokens += lookup.cached_tokens
    report.hit_requests += lookup.cached_tokens > 0
    report.blocks_shared += len(lookup.hot_blocks) + len(lookup.restored_blocks)


def run_session(scheduler, cache, report: SessionReport, *, prefill, decode, max_batch: int,
                after_step=None) -> None:
    """The loop of a serving session (shared by :func:`serve` and the hybrid model's
    ``serve_hybrid``): admit and ``prefill(admission)`` while requests fit; finish the done
    ones (register, release, record their output); then one decode step: one batched
    ``record_decode_tokens`` (preempting on exhaustion), ``prepare_decode``,
    ``decode(request) -> logits`` for each running request, ``after_step(seq_ids)``.
    Requests' payloads are :class:`RunningRequest`. Fills the step counts and times of ``report``
    and its ``preemptions``."""
    while scheduler.has_work:
        while (admission := scheduler.admit_next()) is not None:
            prefill(admission)
        for request in [q for q in scheduler.running if q.payload.done]:
            state = request.payload
            scheduler.finish(request.seq_id)
            report.outputs[request.seq_id] = Generation(np.asarray(state.tokens, np.int64),
                                                        np.stack(state.logits))
            scheduler.max_running = max_batch
        if not scheduler.running:
            continue
        t0 = time.perf_counter()
        scheduler.record_decode_step(lambda q: q.payload.tokens[-1])
        if not scheduler.running:
            continue
        seqs = [q.seq_id for q in scheduler.running]
        cache.prepare_decode(seqs)
        t1 = time.perf_counter()
        for request in scheduler.running:
            request.payload.take(decode(request))
        if after_step is not None:
            after_step(seqs)
        t2 = time.perf_counter()
        report.decode_steps += 1
        report.bookkeeping_seconds += t1 - t0
        report.decode_seconds += t2 - t0
    report.preemptions = scheduler.num_preemptions


def check_parity(model: ReferenceModel, requests: Sequence[Request], outputs: dict) -> list:
    """Seq ids whose paged output (tokens or logits bytes) differs from the same request run
    alone on a flat cache; empty means parity."""
    bad = []
    for r in requests:
        alone = model.generate(r.prompt, r.max_new_tokens, model.new_flat_kv())
        got = outputs.get(r.seq_id)
        if (got is None or got.tokens.tobytes() != alone.tokens.tobytes()
                or got.logits.tobytes() != alone.logits.tobytes()):
            bad.append(r.seq_id)
    return bad

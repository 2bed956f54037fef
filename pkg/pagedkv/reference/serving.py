"""A small serving loop over the reference model and a paged adapter (``pagedkv demo``,
parity tests).

Requests are admitted (reset → prefix lookup → suffix reservation → prefill of the uncached
part), decoded in interleaved steps (one batched ``record_decode_tokens`` + ``prepare_decode``
per step, then each sequence's forward), and on completion registered for reuse and released.
A request that cannot get blocks waits (admission) or is preempted and recomputed (decode), as
a scheduler does on ``PoolExhausted``. Greedy decoding is deterministic, so every output must
equal the same request run alone on a flat cache: :func:`check_parity`.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.errors import InvalidArgument, PoolExhausted
from pagedkv.reference.kv_paths import PagedKV
from pagedkv.reference.model import Generation, ReferenceModel

__all__ = ["Request", "SessionReport", "build_paged_adapter", "check_parity", "serve"]


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
                        cold_tier=None, hash_seed: int | None = None,
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
    return PagedKVCacheAdapter(allocator, pool, cold_tier=cold_tier, growth=growth)


class _Running:
    __slots__ = ("logits", "request", "tokens")

    def __init__(self, request: Request) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.logits: list[np.ndarray] = []

    def take(self, logits: np.ndarray) -> int:
        self.logits.append(logits)
        token = int(np.argmax(logits))
        self.tokens.append(token)
        return token

    @property
    def done(self) -> bool:
        return len(self.tokens) >= self.request.max_new_tokens


def serve(model: ReferenceModel, adapter: PagedKVCacheAdapter, requests: Sequence[Request], *,
          max_batch: int = 8, warm_first: bool = True) -> SessionReport:
    """Run ``requests`` to completion; returns their outputs and what the cache did.

    ``warm_first`` runs the first request alone before admitting the rest, so the shared
    prefix it registers is there for the others (a warm server); ``max_batch`` bounds the
    sequences decoding together.
    """
    if max_batch < 1:
        raise InvalidArgument(f"max_batch = {max_batch}: must be >= 1")
    for r in requests:
        if r.max_new_tokens < 1 or len(r.prompt) < 1:
            raise InvalidArgument(f"request {r.seq_id!r}: needs a prompt and max_new_tokens >= 1")
    report = SessionReport()
    stats0 = adapter.stats()
    evictions0 = adapter.allocator.stats()["pressure_evictions"]
    waiting = list(requests)
    running: list[_Running] = []
    batch_limit = 1 if warm_first else max_batch
    # After a preemption nothing new is admitted until a running request finishes, or the
    # victim would be readmitted into the same shortage forever.
    admission_open = True

    def admit(request: Request) -> bool:
        s = request.seq_id
        t0 = time.perf_counter()
        adapter.reset_for_new_request(s)
        try:
            hit = adapter.find_cached_prefix(s, request.prompt, cache_salt=request.cache_salt,
                                             max_tokens=len(request.prompt) - 1)
            adapter.allocate_suffix_blocks(s, len(request.prompt))
        except PoolExhausted:
            adapter.release_request(s)
            return False
        state = _Running(request)
        state.take(model.forward(request.prompt[hit.cached_tokens:], PagedKV(adapter, s))[-1])
        report.prefill_seconds += time.perf_counter() - t0
        report.prompt_tokens += len(request.prompt)
        report.cached_tokens += hit.cached_tokens
        report.hit_requests += hit.cached_tokens > 0
        report.blocks_shared += len(hit.hot_blocks) + len(hit.restored_blocks)
        running.append(state)
        return True

    def finish(state: _Running) -> None:
        r = state.request
        adapter.register_full_blocks_for_reuse(r.seq_id, cache_salt=r.cache_salt)
        adapter.release_request(r.seq_id)
        report.outputs[r.seq_id] = Generation(np.asarray(state.tokens, np.int64),
                                              np.stack(state.logits))

    while waiting or running:
        while admission_open and waiting and len(running) < batch_limit:
            if not admit(waiting[0]):
                if not running:
                    raise PoolExhausted(f"request {waiting[0].seq_id!r} does not fit an idle pool")
                break
            waiting.pop(0)
        for state in [s for s in running if s.done]:
            running.remove(state)
            finish(state)
            admission_open = True
        if not running:
            batch_limit = max_batch
            admission_open = True
            continue
        seqs = [s.request.seq_id for s in running]
        tokens = np.asarray([s.tokens[-1] for s in running], np.uint32)
        t0 = time.perf_counter()
        try:
            adapter.record_decode_tokens(seqs, tokens)
            adapter.prepare_decode(seqs)
        except PoolExhausted:
            # Preempt the newest sequence and recompute it later (greedy: same output).
            victim = running.pop()
            adapter.release_request(victim.request.seq_id)
            waiting.insert(0, victim.request)
            report.preemptions += 1
            admission_open = False
            continue
        t1 = time.perf_counter()
        for state in running:
            kv = PagedKV(adapter, state.request.seq_id)
            state.take(model.forward(state.tokens[-1:], kv, already_recorded=True)[-1])
        t2 = time.perf_counter()
        report.decode_steps += 1
        report.bookkeeping_seconds += t1 - t0
        report.decode_seconds += t2 - t0
    stats = adapter.stats()
    report.blocks_allocated = stats["blocks_allocated"] - stats0["blocks_allocated"]
    report.grow_events = stats["grow_events"] - stats0["grow_events"]
    report.evictions = adapter.allocator.stats()["pressure_evictions"] - evictions0
    report.pool_blocks = adapter.pool.num_blocks
    report.pool_max_blocks = adapter.pool.max_num_blocks
    return report


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

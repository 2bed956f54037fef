"""``RecomputeScheduler``: admission and recompute preemption over a request lifecycle
(docs/coordinator.md, "Admission and preemption").

pagedkv does not ship a serving loop, but every loop driving a paged cache makes the same
cache decisions, so they live here once: reserve per turn, admit only what fits now (the
watermark keeps a margin while rows run), defer / grow once / reject a request that does
not, and when a running row cannot get a block, preempt the newest running row, put it
back at the front of the queue in arrival order and let it recompute. The model work
(prefill, forward) stays with the caller. Works with a single-group
:class:`~pagedkv.adapter.PagedKVCacheAdapter` and a
:class:`~pagedkv.coordinator.GroupedKVCoordinator` alike.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import numpy as np

from pagedkv.adapter.admission import AdmissionDecision
from pagedkv.adapter.admission import watermark_fraction as clamp_watermark_fraction
from pagedkv.adapter.arguments import as_count, as_tokens
from pagedkv.adapter.lifecycle import RequestLifecycle
from pagedkv.adapter.results import PrefixLookup
from pagedkv.argument_checks import int_argument
from pagedkv.errors import (
    CapacityExceeded,
    ContextLengthExceeded,
    InvalidArgument,
    InvalidArgumentType,
    PoolExhausted,
)

__all__ = ["Admission", "RecomputeScheduler", "RequestStatus", "ScheduledRequest"]

T = TypeVar("T")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"   # waiting again, to recompute
    FINISHED = "finished"


@dataclass(eq=False)
class ScheduledRequest:
    """One request of the queue. ``arrival`` orders the queue; ``reservation`` is the blocks
    a turn reserves per group (``cache.reservation_for``); ``payload`` is the caller's."""

    seq_id: Hashable
    prompt: np.ndarray
    max_new_tokens: int
    arrival: int
    reservation: tuple[int, ...]
    cache_salt: int = 0
    extra_keys: tuple[int, ...] = ()
    extra_keys_per_block: list | None = None
    payload: Any = None
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    cached_tokens: int = field(default=0)

    def __repr__(self) -> str:
        return (f"ScheduledRequest({self.seq_id!r}, prompt={len(self.prompt)} tokens, "
                f"max_new_tokens={self.max_new_tokens}, arrival={self.arrival}, "
                f"status={self.status.value}, preemptions={self.num_preemptions})")


class Admission(NamedTuple):
    """An admitted request and its lookup: compute ``request.prompt[lookup.cached_tokens:]``."""

    request: ScheduledRequest
    lookup: PrefixLookup


class RecomputeScheduler:
    """The waiting queue and the running set of one cache.

    ``max_running`` bounds the running set (default: the cache's
    ``max_concurrent_sequences`` when it has one, else unbounded). ``watermark_fraction``
    overrides the cache's admission watermark. ``prefill_chunk_tokens`` (default: the whole
    prompt) is what admission reserves beyond the cached prefix: a grouped model with sliding
    groups prefills in chunks and reserves each with ``record_tokens``. ``state_bytes`` (a
    family's hook) gives a request's per-row state bytes, checked against the cache's
    ``state_budget_bytes``. Each is checked here: ``prefill_chunk_tokens`` below 1 →
    ``InvalidArgument``; a ``watermark_fraction`` that is no number or a ``state_bytes`` that
    is not callable → ``InvalidArgumentType``.
    """

    def __init__(self, cache: RequestLifecycle, *, max_running: int | None = None,
                 watermark_fraction: float | None = None,
                 prefill_chunk_tokens: int | None = None,
                 state_bytes: Callable[[ScheduledRequest], int] | None = None) -> None:
        if not isinstance(cache, RequestLifecycle):
            raise InvalidArgument(f"cache must be a PagedKVCacheAdapter or a "
                                  f"GroupedKVCoordinator, got {type(cache).__name__}")
        self.cache = cache
        if max_running is None:
            max_running = getattr(cache, "max_concurrent_sequences", None)
        self.max_running = None if max_running is None else as_count(max_running, "max_running")
        if self.max_running == 0:
            raise InvalidArgument("max_running must be >= 1")
        # Checked now, not at the first admit_next (a str fraction, a state_bytes that is no
        # function), and a chunk of 0 tokens would admit a request reserving nothing.
        if watermark_fraction is not None:
            clamp_watermark_fraction(watermark_fraction)
        self.watermark_fraction = watermark_fraction
        self.prefill_chunk_tokens = (None if prefill_chunk_tokens is None else int_argument(
            "prefill_chunk_tokens", prefill_chunk_tokens, minimum=1))
        if state_bytes is not None and not callable(state_bytes):
            raise InvalidArgumentType(f"state_bytes must be a function of a ScheduledRequest "
                                      f"returning bytes, got {type(state_bytes).__name__}")
        self.state_bytes = state_bytes
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self.num_preemptions = 0
        self._arrivals = 0
        # After a preemption nothing is admitted until a running request finishes: the victim
        # would otherwise come straight back into the same shortage.
        self._admission_paused = False

    def __repr__(self) -> str:
        return (f"RecomputeScheduler(waiting={len(self.waiting)}, running={len(self.running)}, "
                f"max_running={self.max_running}, preemptions={self.num_preemptions}, "
                f"admission {'paused' if self._admission_paused else 'open'})")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def admission_paused(self) -> bool:
        return self._admission_paused

    # --- the queue ------------------------------------------------------------------------

    def add(self, seq_id: Hashable, prompt, max_new_tokens: int, *, cache_salt: int = 0,
            extra_keys: Sequence[int] = (), extra_keys_per_block=None,
            payload: Any = None) -> ScheduledRequest:
        """Queue a request (at the back). Its prompt and reservation are checked now: a
        prompt longer than the cache's ``max_model_len`` (a grouped coordinator's), or a
        reservation above a group's max pool → ``CapacityExceeded`` and nothing is queued.
        A ``seq_id`` queued, running, or live in the cache outside the scheduler →
        ``InvalidArgument`` (admission would release that row)."""
        toks = as_tokens(prompt, "prompt")
        if not len(toks):
            raise InvalidArgument(f"request {seq_id!r}: the prompt is empty")
        new = as_count(max_new_tokens, "max_new_tokens")
        limit = self.cache.max_row_tokens
        if limit is not None and len(toks) > limit:
            # Admission reserves only the first prefill chunk: such a request would be
            # admitted and fail mid-prefill, or (unchunked) block the head of the queue.
            raise CapacityExceeded(
                f"request {seq_id!r}: the prompt has {len(toks)} tokens, past the model's "
                f"max_model_len of {limit}; shorten the prompt or raise max_model_len")
        if any(r.seq_id == seq_id for r in (*self.waiting, *self.running)):
            raise InvalidArgument(f"request {seq_id!r} is already queued or running")
        self._check_not_live_elsewhere(seq_id, "add")
        reservation = self.cache.reservation_for(len(toks), new)
        request = ScheduledRequest(
            seq_id, toks, new, self._arrivals, reservation, cache_salt, tuple(extra_keys),
            None if extra_keys_per_block is None else list(extra_keys_per_block), payload)
        self._arrivals += 1
        self.waiting.append(request)
        return request

    def _check_not_live_elsewhere(self, seq_id: Hashable, call: str) -> None:
        # A row the caller keeps in the cache outside the scheduler: admission resets the
        # request's row, which would silently release that row's blocks and tokens.
        if self.cache.is_live(seq_id):
            raise InvalidArgument(
                f"{call}: seq_id {seq_id!r} is live in the cache outside this scheduler; "
                "admitting it would release that row: release it first or use another id")

    def _state_bytes(self, request: ScheduledRequest) -> int:
        return 0 if self.state_bytes is None else as_count(self.state_bytes(request),
                                                           "state_bytes")

    def _decide(self, request: ScheduledRequest, need: Sequence[int]) -> AdmissionDecision:
        cache = self.cache

        def fits() -> bool:
            return cache.can_admit(need, watermark_fraction=self.watermark_fraction,
                                   exclude=request.seq_id,
                                   extra_state_bytes=self._state_bytes(request))

        if fits():
            return AdmissionDecision.ADMIT
        if self.running:
            return AdmissionDecision.DEFER
        if cache.try_grow_for(need) and fits():
            return AdmissionDecision.ADMIT
        return AdmissionDecision.REJECT

    def admit_next(self) -> Admission | None:
        """Admit the request at the head of the queue if it fits now, else ``None``.

        Admission looks the prompt up first (``max_tokens = len(prompt) - 1``), so blocks a
        prefix hit already holds are not reserved again; then the decision: admit; defer
        (``None``: other rows run, or admission is paused after a preemption while rows
        still run, or ``max_running`` is reached); with nothing running, grow a growable pool once and
        retry; else reject: the request leaves the queue and ``ContextLengthExceeded`` is
        raised. A request whose allocation can never succeed (``CapacityExceeded``, e.g. an
        unchunked prompt needing more live blocks than a sliding group's max pool) leaves the
        queue too, and that error is raised. A head request whose ``seq_id`` was made live in
        the cache outside the scheduler since it was queued → ``InvalidArgument``, nothing
        changed. An admitted request holds its prompt's blocks
        (``allocate_suffix_blocks``); prefill ``request.prompt[lookup.cached_tokens:]``.
        """
        if not self.waiting or (self._admission_paused and self.running) or (
                self.max_running is not None and len(self.running) >= self.max_running):
            return None
        request = self.waiting[0]
        cache = self.cache
        seq = request.seq_id
        prompt = request.prompt
        self._check_not_live_elsewhere(seq, "admit_next")
        cache.reset_for_new_request(seq)
        try:
            lookup = cache.find_cached_prefix(
                seq, prompt, extra_keys=request.extra_keys,
                extra_keys_per_block=request.extra_keys_per_block,
                cache_salt=request.cache_salt, max_tokens=len(prompt) - 1)
            decision = self._decide(request, cache.admission_need(seq, request.reservation))
            if decision is AdmissionDecision.ADMIT:
                target = len(prompt) if self.prefill_chunk_tokens is None else min(
                    len(prompt), lookup.cached_tokens + self.prefill_chunk_tokens)
                try:
                    cache.allocate_suffix_blocks(seq, target)
                except PoolExhausted:
                    if not self.running:
                        raise
                    decision = AdmissionDecision.DEFER
        except BaseException as exc:
            cache.release_request(seq)
            if isinstance(exc, CapacityExceeded):
                # It can never be allocated (e.g. an unchunked prompt wider than a sliding
                # group's max pool): it leaves the queue like a rejected request instead of
                # failing every later admit_next at the head of the queue.
                self.waiting.popleft()
                request.status = RequestStatus.FINISHED
            raise
        if decision is not AdmissionDecision.ADMIT:
            cache.release_request(seq)
            if decision is AdmissionDecision.REJECT:
                self.waiting.popleft()
                request.status = RequestStatus.FINISHED
                raise ContextLengthExceeded(
                    f"request {seq!r} ({len(prompt)} prompt tokens, reserving "
                    f"{list(request.reservation)} blocks per group) does not fit the idle "
                    "cache even after growing it")
            return None
        self.waiting.popleft()
        cache.note_admitted(seq, request.reservation, state_bytes=self._state_bytes(request))
        request.status = RequestStatus.RUNNING
        request.cached_tokens = lookup.cached_tokens
        self.running.append(request)
        return Admission(request, lookup)

    # --- preemption -----------------------------------------------------------------------

    def preempt(self) -> ScheduledRequest:
        """Preempt the newest running request (the last admitted): release its rows in every
        group, mark it preempted, count it, and put it back in the queue before every later
        arrival (so no later arrival overtakes it). Admission pauses until a running request
        finishes. ``InvalidArgument`` when nothing runs."""
        if not self.running:
            raise InvalidArgument("preempt: no running request")
        victim = self.running.pop()
        self.cache.release_request(victim.seq_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        arrivals = [r.arrival for r in self.waiting]
        self.waiting.insert(bisect.bisect_left(arrivals, victim.arrival), victim)
        self._admission_paused = True
        return victim

    def run_or_preempt(self, blocked: Hashable | None, attempt: Callable[[], T]
                       ) -> tuple[T | None, list[ScheduledRequest]]:
        """Run ``attempt`` (a cache call for the running row ``blocked``, or for a whole
        step when ``None``); while it raises ``PoolExhausted``, preempt the newest running
        request and retry, until it succeeds or ``blocked`` itself was the victim. Returns
        ``(attempt's result or None, the preempted requests)``; with nothing left to
        preempt the ``PoolExhausted`` propagates."""
        victims: list[ScheduledRequest] = []
        while True:
            try:
                return attempt(), victims
            except PoolExhausted:
                if not self.running:
                    raise
                victim = self.preempt()
                victims.append(victim)
                if blocked is not None and victim.seq_id == blocked:
                    return None, victims

    def record_decode_step(self, token_of: Callable[[ScheduledRequest], int]
                           ) -> list[ScheduledRequest]:
        """Record one decode token for every running request (``token_of(request)``) with
        one ``record_decode_tokens``; on ``PoolExhausted`` preempt the newest running
        request and retry with the rest. Returns the preempted requests (their partial
        output is void: they recompute)."""
        def step() -> None:
            seqs = [r.seq_id for r in self.running]
            tokens = np.fromiter((token_of(r) for r in self.running), np.int64, len(seqs))
            self.cache.record_decode_tokens(seqs, tokens)

        if not self.running:
            return []
        _, victims = self.run_or_preempt(None, step)
        return victims

    def finish(self, seq_id: Hashable, *, register: bool = True) -> ScheduledRequest:
        """A running request is done: publish its full blocks (with its salt and keys) unless
        ``register=False``, release it in every group, and reopen admission."""
        for i, request in enumerate(self.running):
            if request.seq_id == seq_id:
                break
        else:
            raise InvalidArgument(f"finish: {seq_id!r} is not running")
        if register:
            self.cache.register_full_blocks_for_reuse(
                seq_id, extra_keys=request.extra_keys,
                extra_keys_per_block=request.extra_keys_per_block,
                cache_salt=request.cache_salt)
        self.cache.release_request(seq_id)
        del self.running[i]
        request.status = RequestStatus.FINISHED
        self._admission_paused = False
        return request

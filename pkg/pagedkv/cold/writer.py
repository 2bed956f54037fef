"""The writer thread and its bounded job queue (cold-tier.md §7.1).

Jobs are encoded and committed on one daemon thread, ``pagedkv-cold-writer``, in FIFO
order. The queue only bounds host memory (``depth`` × object size); waiting for a slot is
the caller's choice (``enqueue_before``). Nothing here raises into inference except
:class:`ColdTierClosed` for a job offered after ``close()``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pagedkv.cold.codec import BlockGeometry, encode_block
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.stats import ColdCounters
from pagedkv.cold.store import ColdStore
from pagedkv.errors import ColdTierClosed, FormatError, InvalidArgument, PagedKVError

__all__ = ["BlockJob", "Barrier", "ColdWriter"]

log = logging.getLogger("pagedkv.cold")

_DRAIN_RETRY_S = 0.005
_ENQUEUE_RETRY_S = 0.001


@dataclass
class BlockJob:
    """One KV block to persist. ``tokens`` (``uint32[bs]``) and ``buffer``
    (``uint8[layers, 2, slab_bytes]``) are owned by the job; ``checksum`` is the payload
    checksum when capture already computed it (else the writer does)."""

    key: bytes
    fingerprint_hex: str
    geometry: BlockGeometry
    tokens: np.ndarray
    buffer: np.ndarray
    checksum: str | None = None
    group: ColdGroup = ColdGroup.KV

    def __repr__(self) -> str:
        return f"BlockJob(key={self.key.hex()[:16]}..., {self.geometry!r})"


@dataclass
class Barrier:
    """Completes when every job accepted before it was handled; ``ok`` says whether all
    of them persisted."""

    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True


class _BoundedFifo:
    """A bounded FIFO whose consumer can be held (test hook) before it takes a job, so a
    held writer leaves accepted jobs in the queue where they count against the depth."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self.held = False
        self.stopped = False

    def put_nowait(self, job) -> bool:
        with self._cv:
            if len(self._items) >= self.depth:
                return False
            self._items.append(job)
            self._cv.notify()
            return True

    def get(self):
        """Next job, or ``None`` once stopped and empty."""
        with self._cv:
            while (self.held or not self._items) and not (self.stopped and not self._items):
                self._cv.wait()
            return self._items.popleft() if self._items else None

    def set_held(self, held: bool) -> None:
        with self._cv:
            self.held = held
            self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self.stopped = True
            self.held = False
            self._cv.notify_all()

    def __len__(self) -> int:
        return len(self._items)


class ColdWriter:
    """Owns the writer thread of one :class:`ColdStore`."""

    def __init__(self, store: ColdStore, counters: ColdCounters, *, queue_depth: int = 8,
                 start: bool = True) -> None:
        if int(queue_depth) <= 0:
            raise InvalidArgument(f"queue_depth = {queue_depth} must be > 0")
        self.store = store
        self.counters = counters
        self.queue_depth = int(queue_depth)
        self._queue = _BoundedFifo(self.queue_depth)
        self._closed = False
        self._failed_since_barrier = False
        #: Test hooks: seconds slept per object, and how many next jobs to fail.
        self.service_delay_s = 0.0
        self.fail_next_jobs = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-cold-writer",
                                        daemon=True)
        if start:
            self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("held" if self._queue.held else "running")
        return (f"ColdWriter({state}, queued={len(self._queue)}, "
                f"depth={self.queue_depth})")

    # --- producers -----------------------------------------------------------------------

    def enqueue(self, job) -> bool:
        """Offer ``job`` without waiting: ``True`` if accepted, ``False`` (a queue drop) if
        the queue is full. Raises ``ColdTierClosed`` after ``close()``."""
        return self.enqueue_before(job, 0.0)

    def enqueue_before(self, job, deadline: float) -> bool:
        """Offer ``job``, retrying every ≤ 1 ms until ``deadline`` (``time.monotonic()``
        seconds). Accepted → ``enqueued += 1``; still full → ``queue_drops += 1``."""
        if self._closed:
            raise ColdTierClosed("the cold writer is stopped; no job can be enqueued")
        while True:
            if self._queue.put_nowait(job):
                self.counters.add("enqueued")
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                self.counters.add("queue_drops")
                return False
            time.sleep(min(_ENQUEUE_RETRY_S, remaining))

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every job accepted so far persisted (``True``) or one failed, or the
        timeout passed (``False``). A stopped writer has nothing pending: ``True``."""
        if self._closed and not self._thread.is_alive():
            return True
        deadline = time.monotonic() + max(0.0, float(timeout))
        barrier = Barrier()
        while not self._queue.put_nowait(barrier):
            if time.monotonic() >= deadline:
                return False
            time.sleep(_DRAIN_RETRY_S)
        if not barrier.done.wait(max(0.0, deadline - time.monotonic())):
            return False
        return barrier.ok

    # --- test hooks ----------------------------------------------------------------------

    def hold(self) -> None:
        """Test hook: stop taking jobs (accepted ones stay queued)."""
        self._queue.set_held(True)

    def release(self) -> None:
        self._queue.set_held(False)

    # --- lifecycle -----------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> bool:
        """Persist what is queued (up to ``timeout``), then stop the thread. Later jobs
        raise ``ColdTierClosed``. Returns whether the thread ended in time."""
        if not self._closed:
            self._closed = True
            self._queue.stop()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, Barrier):
                job.ok = not self._failed_since_barrier
                self._failed_since_barrier = False
                job.done.set()
                continue
            try:
                ok = self._persist(job)
            except Exception:  # the writer must survive anything a job does
                log.exception("cold tier: unexpected error persisting %r", job)
                self.counters.add("write_errors")
                ok = False
            if not ok:
                self._failed_since_barrier = True

    def _persist(self, job: BlockJob) -> bool:
        if self.service_delay_s:
            time.sleep(self.service_delay_s)
        if self.fail_next_jobs > 0:
            self.fail_next_jobs -= 1
            self.counters.add("write_errors")
            return False
        store = self.store
        try:
            header, tok, payload = encode_block(
                store.fmt.abi, store.payload_tag, job.key.hex(), job.fingerprint_hex,
                job.geometry, job.tokens, job.buffer, job.checksum)
        except (FormatError, PagedKVError, ValueError, TypeError) as exc:
            self.counters.add("write_errors")
            log.warning("cold tier: cannot encode %r: %s", job, exc)
            return False
        size = len(header) + tok.nbytes + payload.nbytes
        return store.commit(job.key, job.group, (header, tok, payload), size)

"""The writer pipeline and its bounded job queue (docs/contracts/cold-tier.md, '7.1 Writer thread
and queue' and '7.4 Service time').

Two daemon threads work in FIFO order: ``pagedkv-cold-hasher`` takes a job from the bounded
queue, computes its payload checksum (unless capture did) and encodes its header;
``pagedkv-cold-writer`` runs the atomic write protocol. SHA-256 of a 200 KB block is too
large a share of a ~0.5 ms fsync floor to sit in series with the write, and too large for
the inference thread's capture budget, so it runs one object ahead of the write (hashlib
and the file syscalls release the GIL). The hand-off between the stages holds one object
(a batch of ``store.batch_objects`` for a store that commits several per round trip, e.g.
Redis): memory stays bounded by ``depth + batch + 1`` objects. Commit order, the protocol and the counters
are those of a single writer. Nothing here raises into inference except
:class:`ColdTierClosed` for a job offered after ``close()``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pagedkv.cold.codec import BlockGeometry, encode_block, encode_sidecar
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.stats import ColdCounters, WriteFailureLog
from pagedkv.errors import ColdTierClosed, InvalidArgument

if TYPE_CHECKING:
    from pagedkv.cold.backend import ColdBackend
    from pagedkv.cold.sidecar import ColdSidecarLayout

__all__ = ["Barrier", "BlockJob", "ColdWriter", "FillJob", "SidecarJob"]

log = logging.getLogger("pagedkv.cold")

#: Spare capture buffers over ``LARGE_SPARE_BYTES`` kept for reuse, at most (sidecars: a
#: fresh multi-MiB buffer costs the inference thread page faults worth half a copy).
LARGE_SPARES = 2
LARGE_SPARE_BYTES = 1 << 20

_DRAIN_RETRY_S = 0.005
_ENQUEUE_RETRY_S = 0.001


@dataclass
class BlockJob:
    """One KV block to persist. ``tokens`` (``uint32[bs]``) and ``buffer``
    (``uint8[layers, 2, slab_bytes]``) are owned by the job; ``checksum`` is the payload
    checksum if the producer already has it (else the hashing stage computes it)."""

    key: bytes
    fingerprint_hex: str
    geometry: BlockGeometry
    tokens: np.ndarray
    buffer: np.ndarray
    checksum: str | None = None
    group: ColdGroup = ColdGroup.KV
    #: The buffer came from ``ColdWriter.take_buffer`` and goes back after the commit.
    recycle: bool = False

    def __repr__(self) -> str:
        return f"BlockJob(key={self.key.hex()[:16]}..., {self.geometry!r})"


@dataclass
class SidecarJob:
    """One sidecar to persist: ``payload`` is ``uint8[tensor_count, bytes_per_tensor]`` of
    ``layout`` (a ``ColdSidecarLayout``), owned by the job."""

    key: bytes
    fingerprint_hex: str
    layout: ColdSidecarLayout
    payload: np.ndarray
    #: The payload came from ``ColdWriter.take_buffer`` and goes back after the commit.
    recycle: bool = False

    @property
    def group(self) -> ColdGroup:
        return self.layout.group

    @property
    def buffer(self) -> np.ndarray:
        return self.payload

    def __repr__(self) -> str:
        return f"SidecarJob(key={self.key.hex()[:16]}..., {self.layout!r})"


@dataclass
class FillJob:
    """A verified object read from the fleet's store, written back to the local directory
    of a two-level store (``TieredColdStore.fill``): ``data`` is its exact bytes."""

    key: bytes
    group: ColdGroup
    data: bytes
    recycle: bool = False

    @property
    def buffer(self) -> bytes:
        return self.data

    def __repr__(self) -> str:
        return f"FillJob(key={self.key.hex()[:16]}..., {self.group!r}, {len(self.data)} B)"


@dataclass
class Barrier:
    """Completes when every job accepted before it was handled; ``ok`` says whether all
    of them persisted."""

    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = True
    #: Its place among everything accepted (``ColdWriter._accepted``), set when it is.
    seq: int = 0


class _BoundedFifo:
    """A bounded FIFO whose consumer can be held (test hook) before it takes a job, so a
    held writer leaves accepted jobs in the queue where they count against the depth."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._items: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self.held = False
        self.stopped = False

    def put_wait(self, job) -> None:
        """Put, waiting for room (the hand-off between the two stages)."""
        with self._cv:
            while len(self._items) >= self.depth and not self.stopped:
                self._cv.wait()
            self._items.append(job)
            self._cv.notify_all()

    def put_nowait(self, job) -> bool:
        """Put if there is room (``False`` if full). Raises ``ColdTierClosed`` once stopped:
        checked under the lock, so no job lands behind a consumer that already returned."""
        with self._cv:
            if self.stopped:
                raise ColdTierClosed("the cold writer is stopped; no job can be enqueued")
            if len(self._items) >= self.depth:
                return False
            self._items.append(job)
            self._cv.notify_all()
            return True

    def get(self):
        """Next job, or ``None`` once stopped and empty."""
        with self._cv:
            while (self.held or not self._items) and not (self.stopped and not self._items):
                self._cv.wait()
            if not self._items:
                return None
            job = self._items.popleft()
            self._cv.notify_all()  # a waiting put_wait may proceed
            return job

    def take_ready(self, limit: int) -> list:
        """Up to ``limit`` jobs at the front that are ready now (no waiting), stopping at a
        barrier (it must see every job before it persisted)."""
        out: list = []
        with self._cv:
            while self._items and len(out) < limit and not isinstance(self._items[0], Barrier):
                out.append(self._items.popleft())
            if out:
                self._cv.notify_all()
        return out

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

    def __init__(self, store: ColdBackend, counters: ColdCounters, *, queue_depth: int = 8,
                 start: bool = True) -> None:
        if int(queue_depth) <= 0:
            raise InvalidArgument(f"queue_depth = {queue_depth} must be > 0")
        self.store = store
        self.counters = counters
        self.queue_depth = int(queue_depth)
        self._queue = _BoundedFifo(self.queue_depth)
        # A remote store commits several objects per round trip: the hand-off then holds a
        # batch, and the writer takes what is ready (memory: depth + batch + 1 objects).
        self._batch = max(1, int(getattr(store, "batch_objects", 1)))
        self._handoff = _BoundedFifo(self._batch)
        # Keys accepted but not yet committed or failed: a capture walk of the next request
        # must see a shared block as taken while its write is still in flight, or it would
        # copy the block out again and the same object would be written twice.
        self._queued_keys: collections.Counter = collections.Counter()
        self._queued_lock = threading.Lock()
        self._closed = False
        # Jobs and barriers accepted so far (under _queued_lock): a barrier's ``seq`` is its
        # place in that order. A failure is owed to every barrier already queued behind the
        # failed job (concurrent drains each asked about it) up to ``_failure_horizon``, the
        # count accepted when it failed; if none of those took it, to the next barrier.
        self._accepted = 0
        self._failure_horizon: int | None = None
        self._failure_reported = False
        #: Test hooks: seconds slept per object, and how many next jobs to fail.
        self.service_delay_s = 0.0
        self.fail_next_jobs = 0
        #: Jobs that cannot be encoded: the first of each exception type is one WARNING, the
        #: rest are counted in ``write_errors_unlogged`` and summarized (as the store's write
        #: failures are), the summary also at :meth:`close`.
        self.encode_failures = WriteFailureLog(counters, log, str(store.root_path))
        # Capture buffers come back here after their commit: a fresh 200 KB array is a fresh
        # mmap whose page faults the inference thread would pay on every capture.
        self._spare: list[np.ndarray] = []
        self._spare_lock = threading.Lock()
        self._hasher = threading.Thread(target=self._run_hasher, name="pagedkv-cold-hasher",
                                        daemon=True)
        self._thread = threading.Thread(target=self._run_writer, name="pagedkv-cold-writer",
                                        daemon=True)
        if start:
            self._hasher.start()
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
            with self._queued_lock:
                accepted = self._queue.put_nowait(job)
                if accepted:
                    self._accepted += 1
                    self._queued_keys[job.key] += 1
            if accepted:
                self.counters.add("enqueued")
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                self.counters.add("queue_drops")
                return False
            time.sleep(min(_ENQUEUE_RETRY_S, remaining))

    def is_queued(self, key: bytes) -> bool:
        """Whether a job for ``key`` was accepted and has not been committed or failed yet."""
        with self._queued_lock:
            return key in self._queued_keys

    def _done_with(self, key: bytes) -> None:
        with self._queued_lock:
            left = self._queued_keys[key] - 1
            if left > 0:
                self._queued_keys[key] = left
            else:
                del self._queued_keys[key]

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until every job accepted so far persisted (``True``) or one failed, or the
        timeout passed (``False``). A stopped writer has nothing pending: ``True``.
        Concurrent drains queued behind a failed job all get ``False``."""
        if self._closed and not self._thread.is_alive():
            return True
        deadline = time.monotonic() + max(0.0, float(timeout))
        barrier = Barrier()
        while True:
            try:
                with self._queued_lock:  # seq and queue position agree
                    if self._queue.put_nowait(barrier):
                        self._accepted += 1
                        barrier.seq = self._accepted
                        break
            except ColdTierClosed:  # closing: the threads persist what is queued, then end
                self._thread.join(max(0.0, deadline - time.monotonic()))
                return not self._thread.is_alive()
            if time.monotonic() >= deadline:
                return False
            time.sleep(_DRAIN_RETRY_S)
        if not barrier.done.wait(max(0.0, deadline - time.monotonic())):
            return False
        return barrier.ok

    def take_buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """A ``uint8`` buffer of ``shape`` for a capture job (recycled when one is spare)."""
        with self._spare_lock:
            for i, buf in enumerate(self._spare):
                if buf.shape == shape:
                    return self._spare.pop(i)
        return np.empty(shape, dtype=np.uint8)

    def give_back(self, buffer: np.ndarray) -> None:
        """Return a ``take_buffer`` buffer no job took (kept while spares are few: at most
        ``queue_depth + 2``, of which at most ``LARGE_SPARES`` are over ``LARGE_SPARE_BYTES``
        — a sidecar checkpoint can be tens of MiB)."""
        with self._spare_lock:
            if len(self._spare) >= self.queue_depth + 2:
                return
            if buffer.nbytes > LARGE_SPARE_BYTES and sum(
                    b.nbytes > LARGE_SPARE_BYTES for b in self._spare) >= LARGE_SPARES:
                return
            self._spare.append(buffer)

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
        deadline = time.monotonic() + max(0.0, float(timeout))
        for t in (self._hasher, self._thread):
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        self.encode_failures.flush()
        return not (self._hasher.is_alive() or self._thread.is_alive())

    @property
    def closed(self) -> bool:
        return self._closed

    # --- the threads --------------------------------------------------------------------

    def _run_hasher(self) -> None:
        try:
            while True:
                job = self._queue.get()
                if job is None:
                    return
                self._handoff.put_wait(job if isinstance(job, Barrier) else self._prepare(job))
        finally:
            self._handoff.stop()

    def _prepare(self, job):
        """Checksum and header of ``job``: ``(job, chunks, size)``, or ``(job, None, (kind,
        reason))`` when it cannot be encoded (a write error, counted in order by the writer
        and logged once per ``kind``)."""
        store = self.store
        try:
            if isinstance(job, FillJob):
                return job, [job.data], len(job.data)
            if isinstance(job, SidecarJob):
                chunks = encode_sidecar(store.fmt.abi, store.payload_tag, job.key.hex(),
                                        job.fingerprint_hex, job.layout, job.payload)
            else:
                chunks = encode_block(store.fmt.abi, store.payload_tag, job.key.hex(),
                                      job.fingerprint_hex, job.geometry, job.tokens,
                                      job.buffer, job.checksum)
        except Exception as exc:  # noqa: BLE001 - malformed job: never kill the pipeline
            return job, None, (f"encode {type(exc).__name__}", f"cannot encode {job!r}: {exc}")
        return job, chunks, sum(memoryview(c).nbytes for c in chunks)

    def _run_writer(self) -> None:
        while True:
            item = self._handoff.get()
            if item is None:
                return
            if isinstance(item, Barrier):
                item.ok = self._barrier_ok(item)
                item.done.set()
                continue
            batch = [item]
            if self._batch > 1:
                batch += self._handoff.take_ready(self._batch - 1)
            try:
                oks = self._persist_batch(batch) if len(batch) > 1 else [self._persist(*item)]
            except Exception:  # the writer must survive anything a job does
                log.exception("cold tier: unexpected error persisting %r", item[0])
                self.counters.add("write_errors", len(batch))
                oks = [False] * len(batch)
            for (job, _, _), ok in zip(batch, oks, strict=True):
                if not ok:
                    with self._queued_lock:
                        self._failure_horizon = self._accepted
                    self._failure_reported = False
                # After the commit (the index already has the key) or the failure (a later
                # walk may try again).
                self._done_with(job.key)
                if job.recycle:
                    self.give_back(job.buffer)

    def _persist_batch(self, batch: list) -> list[bool]:
        """Several prepared jobs: the store's objects in one ``commit_many``, the rest
        (fills, unencodable or hooked-to-fail jobs) one by one, results in batch order."""
        oks: list[bool | None] = [None] * len(batch)
        grouped = []
        for i, (job, chunks, size) in enumerate(batch):
            if chunks is None or isinstance(job, FillJob) or self.fail_next_jobs > 0 \
                    or self.service_delay_s:
                oks[i] = self._persist(job, chunks, size)
            else:
                grouped.append(i)
        if grouped:
            done = self.store.commit_many([(batch[i][0].key, batch[i][0].group, batch[i][1],
                                            batch[i][2]) for i in grouped])
            for i, ok in zip(grouped, done, strict=True):
                oks[i] = ok
        return [bool(ok) for ok in oks]

    def _barrier_ok(self, barrier: Barrier) -> bool:
        """Whether no failure is owed to ``barrier`` (writer thread only)."""
        horizon = self._failure_horizon
        if horizon is None:
            return True
        if barrier.seq <= horizon:  # queued before the failure was known: it covers it
            self._failure_reported = True
            return False
        ok = self._failure_reported  # the first barrier after it, unless one already took it
        self._failure_horizon = None
        return ok

    def _persist(self, job, chunks, size) -> bool:
        if self.service_delay_s:
            time.sleep(self.service_delay_s)
        if chunks is None:
            kind, reason = size
            self.encode_failures.failed(kind, "cold tier: %s (later jobs that fail to encode "
                                        "this way are counted in write_errors_unlogged)",
                                        reason)
            return False
        if self.fail_next_jobs > 0:
            self.fail_next_jobs -= 1
            self.counters.add("write_errors")
            return False
        if isinstance(job, FillJob):  # only a two-level store has a local level to fill
            tiered: Any = self.store
            return tiered.fill(job.key, job.group, chunks, size)
        return self.store.commit(job.key, job.group, chunks, size)

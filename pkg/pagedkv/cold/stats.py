"""Cold-tier counters (docs/contracts/cold-tier.md, '11. Stats'): a thread-safe counter set and its
snapshots."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "COLD_DELTA_FIELDS",
    "SIDECAR_COUNTERS",
    "ColdCacheStats",
    "ColdCounters",
    "ColdSidecarStats",
    "WriteFailureLog",
    "sidecar_counters",
]


@dataclass(frozen=True)
class ColdCacheStats:
    """Snapshot of one tier's counters (block-scoped except ``enqueued``/``queue_drops``,
    which count every object that took or was refused a queue slot)."""

    hits: int = 0
    misses: int = 0
    enqueued: int = 0
    queue_drops: int = 0
    bytes_written: int = 0
    bytes_restored: int = 0
    evictions: int = 0
    corruptions: int = 0
    write_errors: int = 0
    #: Write errors counted but not logged one by one (``WriteFailureLog``).
    write_errors_unlogged: int = 0
    restore_declines: int = 0
    enabled: bool = False
    root: str = ""
    quota_bytes: int = 0


@dataclass(frozen=True)
class ColdSidecarStats:
    """Process-wide sidecar counters (docs/contracts/cold-tier.md, '11.2 ColdSidecarStats'); they
    move even when no tier is open."""

    capture_reached: int = 0
    chain_empty: int = 0
    boundary_skips: int = 0
    already_persisted: int = 0
    enqueued: int = 0
    queue_drops: int = 0
    installed: int = 0
    restore_suppressed: int = 0


_COUNTER_FIELDS = tuple(f.name for f in dataclasses.fields(ColdCacheStats)
                        if f.type in ("int", int) and f.name != "quota_bytes")
SIDECAR_COUNTERS = tuple(f.name for f in dataclasses.fields(ColdSidecarStats))

#: Keys of one per-turn trace record that pagedkv adds (docs/contracts/cold-tier.md, '12. Per-turn
# JSONL delta trace'): deltas of every counter of
#: both dataclasses, the enabled/root fields and three cumulative totals.
COLD_DELTA_FIELDS = frozenset(
    [f"cold_{n}" for n in _COUNTER_FIELDS]
    + [f"cold_sidecar_{n}" for n in SIDECAR_COUNTERS]
    + ["cold_enabled", "cold_root", "cold_corruptions_total", "cold_queue_drops_total",
       "cold_write_errors_total"])


class ColdCounters:
    """Mutable counters shared by the inference thread and the writer thread."""

    __slots__ = ("_lock", "_values")

    def __init__(self, fields: tuple[str, ...] = _COUNTER_FIELDS) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(fields, 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        return self._values[name]

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def __repr__(self) -> str:
        return f"ColdCounters({self.values()})"


#: Seconds between two summaries of the write failures not logged one by one.
WRITE_FAILURE_SUMMARY_S = 60.0


class WriteFailureLog:
    """One WARNING per kind of write failure (``(kind, backend)``, e.g. ``("OSError",
    "/cache/pagedkv-v1")``), with its fix hint, the first time it happens; later ones of that
    kind are counted in ``write_errors_unlogged``, never logged one by one (a full disk or
    an ``OOM`` server fails every block). A summary of what was not logged is one WARNING,
    at most every ``interval_s`` (when a failure comes after it elapsed) and at ``flush()``
    (the store's close)."""

    def __init__(self, counters: ColdCounters, logger: logging.Logger, backend: str, *,
                 interval_s: float = WRITE_FAILURE_SUMMARY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.counters = counters
        self.log = logger
        self.backend = backend
        self.interval_s = float(interval_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._pending = 0
        self._last_summary = clock()

    def failed(self, kind: str, message: str, *args: object) -> None:
        """Count a write error (``write_errors``); log ``message % args`` if ``kind`` never
        failed on this backend, else count it in ``write_errors_unlogged`` too."""
        self.counters.add("write_errors")
        with self._lock:
            if kind not in self._seen:
                self._seen.add(kind)
                self.log.warning(message, *args)
                return
            self.counters.add("write_errors_unlogged")
            self._pending += 1
            if self.clock() - self._last_summary >= self.interval_s:
                self._summarize()

    def flush(self) -> None:
        """The summary of what was not logged yet, if anything."""
        with self._lock:
            if self._pending:
                self._summarize()

    def _summarize(self) -> None:
        self.log.warning("cold tier: %d more failed writes to %s not logged one by one (%s "
                         "so far; stats().write_errors_unlogged)", self._pending, self.backend,
                         self.counters.get("write_errors_unlogged"))
        self._pending = 0
        self._last_summary = self.clock()


_sidecar = ColdCounters(SIDECAR_COUNTERS)


def sidecar_counters() -> ColdCounters:
    """The process-wide sidecar counter set (never opens a tier)."""
    return _sidecar


def cold_sidecar_stats() -> ColdSidecarStats:
    return ColdSidecarStats(**_sidecar.values())


def record_sidecar_installed() -> None:
    """Families call this when a restored sidecar actually became live state."""
    _sidecar.add("installed")


__all__ += ["cold_sidecar_stats", "record_sidecar_installed"]

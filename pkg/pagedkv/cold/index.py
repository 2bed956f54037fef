"""The in-memory index of one cold root: key → entry, in least-recently-read order."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

from pagedkv.cold.groups import ColdGroup

__all__ = ["ColdIndex", "IndexEntry"]


class IndexEntry:
    """One object on disk. ``size`` in bytes; ``last_access_ns`` = write or last validated
    read (the file's mtime after a restart); ``unclearable`` = eviction could not remove it."""

    __slots__ = ("file_name", "group", "last_access_ns", "size", "unclearable")

    def __init__(self, group: ColdGroup, file_name: str, size: int, last_access_ns: int):
        self.group = group
        self.file_name = file_name
        self.size = size
        self.last_access_ns = last_access_ns
        self.unclearable = False

    def __repr__(self) -> str:
        return (f"IndexEntry({self.group!r}, {self.file_name!r}, size={self.size}, "
                f"last_access_ns={self.last_access_ns}"
                f"{', unclearable' if self.unclearable else ''})")


class ColdIndex:
    """Key → :class:`IndexEntry` plus ``total_bytes``, under one lock.

    The ordered map is kept in ``last_access_ns`` order (the oldest first), so the eviction
    victim is found in O(1): a touch moves an entry to the end. Other processes' writes are
    invisible until the root is reopened.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._entries: OrderedDict[bytes, IndexEntry] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"ColdIndex(objects={len(self._entries)}, total_bytes={self.total_bytes})"

    def rebuild(self, items: list[tuple[bytes, IndexEntry]]) -> None:
        """Replace the contents with ``items`` (any order; sorted by recency here; of a
        repeated key the most recent entry stays)."""
        with self.lock:
            self._entries = OrderedDict(sorted(items, key=lambda kv: kv[1].last_access_ns))
            # From the entries kept, not from ``items``: a repeated key must not count twice.
            self.total_bytes = sum(e.size for e in self._entries.values())

    def contains(self, key: bytes) -> bool:
        """Index probe only: no I/O, no counters."""
        return key in self._entries

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        e = self._entries.get(key)
        return e is not None and e.group is group

    def get(self, key: bytes) -> IndexEntry | None:
        return self._entries.get(key)

    def put(self, key: bytes, entry: IndexEntry) -> None:
        """Insert or replace (a rewrite of the same key replaces its size and recency)."""
        with self.lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.total_bytes -= old.size
            self._entries[key] = entry
            self.total_bytes += entry.size

    def remove(self, key: bytes) -> IndexEntry | None:
        with self.lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.total_bytes -= old.size
            return old

    def touch(self, key: bytes, now_ns: int) -> None:
        with self.lock:
            e = self._entries.get(key)
            if e is not None:
                e.last_access_ns = max(e.last_access_ns, now_ns)
                self._entries.move_to_end(key)

    def lru_victim(self) -> tuple[bytes, IndexEntry] | None:
        """Least recently read entry not marked unclearable, or ``None``."""
        with self.lock:
            for key, e in self._entries.items():
                if not e.unclearable:
                    return key, e
            return None

    def snapshot(self) -> list[tuple[bytes, IndexEntry]]:
        """The entries, oldest first (a copy safe to iterate while the writer runs)."""
        with self.lock:
            return list(self._entries.items())

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.snapshot_keys())

    def snapshot_keys(self) -> list[bytes]:
        with self.lock:
            return list(self._entries)

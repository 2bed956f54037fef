"""One opened cold root: index, bounded loads, atomic commits, quota and eviction
(cold-tier.md §5, §7.2, §9, §10).

Thread model: the writer thread commits and evicts; inference threads probe and load.
Index mutations happen under ``index.lock``; probes read the dict without it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence

from pagedkv.cold.codec import BlockGeometry, DecodedBlock, decode_block, decode_sidecar
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.index import ColdIndex, IndexEntry
from pagedkv.cold.names import (
    is_quarantine,
    object_name,
    parse_object_name,
    quarantine_name,
    temp_name,
)
from pagedkv.cold.root import clean_writer_temps
from pagedkv.cold.stats import ColdCounters
from pagedkv.errors import FormatError, InvalidArgument

__all__ = ["DURABILITY_MODES", "WRITE_STEPS", "ColdStore", "auto_limits"]

log = logging.getLogger("pagedkv.cold")

DURABILITY_MODES = ("fsync", "full")
#: Steps of the atomic write protocol, in order; a step hook runs before each (tests
#: inject failures and SIGKILLs there).
WRITE_STEPS = ("open", "write", "sync", "rename", "dirsync")
_GIB = 1 << 30
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_TEMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
               | getattr(os, "O_CLOEXEC", 0))


def auto_limits(root_fd: int) -> tuple[int, int]:
    """``(quota, reserve)`` in bytes from the filesystem size (§10)."""
    st = os.statvfs(root_fd)
    total = st.f_blocks * st.f_frsize
    return min(total // 10, 100 * _GIB), max(total // 20, 5 * _GIB)


def _sync_file(fd: int, durability: str) -> None:
    if durability == "full" and sys.platform == "darwin":
        import fcntl
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        os.fsync(fd)


def _write_all(fd: int, chunks: Sequence) -> None:
    views = [memoryview(c).cast("B") for c in chunks]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


class ColdStore:
    """Files of one root, addressed through its directory fd."""

    def __init__(self, root_fd: int, root_path: str, counters: ColdCounters, *,
                 quota_bytes: int, reserve_bytes: int, durability: str = "fsync",
                 fmt: ColdFormat = DEFAULT_FORMAT) -> None:
        if durability not in DURABILITY_MODES:
            raise InvalidArgument(f"durability = {durability!r}; valid: {DURABILITY_MODES}")
        if quota_bytes <= 0 or reserve_bytes < 0:
            raise InvalidArgument(f"quota_bytes = {quota_bytes} must be > 0 and reserve_bytes "
                                  f"= {reserve_bytes} >= 0")
        self.root_fd = root_fd
        self.root_path = root_path
        self.counters = counters
        self.quota_bytes = int(quota_bytes)
        self.reserve_bytes = int(reserve_bytes)
        self.durability = durability
        self.fmt = fmt
        self.index = ColdIndex()
        self.payload_tag = fmt.tag("cold-cache-payload")
        #: Test hook: called as ``hook(step)`` before each step of WRITE_STEPS.
        self.step_hook: Callable[[str], None] | None = None

    def __repr__(self) -> str:
        return (f"ColdStore(root={self.root_path!r}, objects={len(self.index)}, "
                f"total_bytes={self.index.total_bytes}, quota_bytes={self.quota_bytes})")

    # --- opening -------------------------------------------------------------------------

    def scan(self) -> int:
        """Clean dead writers' temps, then rebuild the index from regular files with
        canonical names (size and mtime from ``lstat``). Returns the object count."""
        clean_writer_temps(self.root_fd)
        items = []
        for name in os.listdir(self.root_fd):
            parsed = parse_object_name(name)
            if parsed is None:
                continue
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                items.append((parsed[0], IndexEntry(parsed[1], name, st.st_size,
                                                    st.st_mtime_ns)))
        self.index.rebuild(items)
        return len(items)

    def close(self) -> None:
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # --- probes and loads ----------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.index.contains(key)

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        return self.index.contains_in(key, group)

    def read_bounded(self, name: str, bound: int, buffer: bytearray | None = None):
        """Open ``name`` without following links or blocking and read at most ``bound + 1``
        bytes. Returns ``(status, data, ident, fd)``: status is ``"ok"``, ``"absent"``
        (not opened), ``"refused"`` (not a regular file) or ``"oversized"``. The caller
        closes ``fd`` (``-1`` unless status is ``"ok"``)."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.root_fd)
        except OSError:
            return "absent", None, None, -1
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                return "refused", None, ident, -1
            if st.st_size > bound:
                os.close(fd)
                return "oversized", None, ident, -1
            want = st.st_size + 1  # one more than expected detects a file that grew
            if buffer is None or len(buffer) < want:
                buffer = bytearray(want)
            view = memoryview(buffer)
            got = 0
            while got < want:
                n = os.readv(fd, [view[got:want]])
                if not n:
                    break
                got += n
            if got > bound or got > st.st_size:
                os.close(fd)
                return "oversized", None, ident, -1
            return "ok", view[:got], ident, fd
        except OSError:
            os.close(fd)
            return "refused", None, None, -1

    def _load(self, key: bytes, name: str, bound: int, buffer, decode):
        """§9 for one object: bounded read, ``decode(data)`` (a ``FormatError`` is a
        corruption), recency touch on success. Failures count a miss, corruptions only for
        opened regular files, and prune. Returns ``decode``'s result or ``None``."""
        status, data, ident, fd = self.read_bounded(name, bound, buffer)
        if status != "ok":
            self.counters.add("misses")
            if status == "oversized":
                self.counters.add("corruptions")
                log.warning("cold tier: %s is larger than its bound %d; pruned", name, bound)
            self.prune_failed_load(key, name, ident)
            return None
        try:
            result = decode(data)
        except FormatError as exc:
            self.counters.add("misses")
            self.counters.add("corruptions")
            log.warning("cold tier: corrupt object pruned: %s", exc)
            os.close(fd)
            self.prune_failed_load(key, name, ident)
            return None
        if result is None:  # valid, but not what the caller needs: a plain miss
            os.close(fd)
            self.counters.add("misses")
            return None
        try:
            os.utime(fd)  # read recency survives a restart through the mtime
        except OSError:
            pass
        finally:
            os.close(fd)
        self.index.touch(key, time.time_ns())
        return result

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None:
        """Bounded load of a KV block (§9); ``None`` is a miss (counted, pruned).

        The result's arrays are views of ``buffer`` (or a fresh one): copy them out before
        the next load into the same buffer.
        """
        name = object_name(key, ColdGroup.KV)
        return self._load(key, name, expected.bound, buffer, lambda data: decode_block(
            data, abi=self.fmt.abi, checksum_tag=self.payload_tag, key_hex=key.hex(),
            fingerprint_hex=fingerprint_hex, expected=expected, path=name))

    def load_sidecar(self, key: bytes, layout, *, fingerprint_hex: str,
                     buffer: bytearray | None = None):
        """Bounded load of a sidecar expected to have ``layout`` (a ``ColdSidecarLayout``):
        the ``uint8[tensors, bytes_per_tensor]`` payload, or ``None`` (a miss). A corrupt
        object is counted and pruned; a valid one of another layout is a plain miss. Never
        counts hits."""
        name = object_name(key, layout.group)

        def decode(data):
            fields, payload = decode_sidecar(
                data, abi=self.fmt.abi, checksum_tag=self.payload_tag,
                group=layout.group.label, key_hex=key.hex(), fingerprint_hex=fingerprint_hex,
                bound=layout.bound, path=name)
            return payload if layout.matches(fields) else None
        return self._load(key, name, layout.bound, buffer, decode)

    def clear_name(self, name: str) -> bool:
        """Remove whatever is at ``name`` without following links: unlink a file, link,
        FIFO or socket; rmdir an empty directory; quarantine a non-empty one. ``True`` when
        the name is free afterwards."""
        try:
            st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        try:
            if stat.S_ISDIR(st.st_mode):
                try:
                    os.rmdir(name, dir_fd=self.root_fd)
                except OSError as exc:
                    if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                        raise
                    os.rename(name, quarantine_name(name, os.getpid(), time.time_ns()),
                              src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
            else:
                os.unlink(name, dir_fd=self.root_fd)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.warning("cold tier: cannot clear %s: %s", name, exc)
            return False

    def prune_failed_load(self, key: bytes, name: str, ident) -> None:
        """Clear a bad object's name and de-index it, sparing a concurrent writer's
        replacement (a regular file with another inode, or one that appeared after a
        not-found)."""
        with self.index.lock:
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except FileNotFoundError:
                self.index.remove(key)
                return
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) and (
                    ident is None or (st.st_dev, st.st_ino) != tuple(ident)):
                return
            self.clear_name(name)
            self.index.remove(key)

    # --- writes --------------------------------------------------------------------------

    def _free_bytes(self) -> int:
        st = os.statvfs(self.root_fd)
        return st.f_bavail * st.f_frsize

    def evict_for_write(self, incoming: int) -> str | None:
        """Make room for ``incoming`` bytes; ``None`` on success, else the refusal reason."""
        if incoming > self.quota_bytes:
            return f"object of {incoming} bytes exceeds the quota of {self.quota_bytes}"
        with self.index.lock:
            available = self._free_bytes()
            reclaimable = self.index.total_bytes
            while (self.index.total_bytes + incoming > self.quota_bytes
                   or available < self.reserve_bytes + incoming):
                if available + reclaimable < self.reserve_bytes + incoming:
                    return "insufficient disk space"
                victim = self.index.lru_victim()
                if victim is None:
                    return "no evictable object left"
                key, entry = victim
                reclaimable -= entry.size
                if not self.clear_name(entry.file_name):
                    entry.unclearable = True
                    continue
                self.index.remove(key)
                self.counters.add("evictions")
                available = self._free_bytes()
        return None

    def _step(self, name: str) -> None:
        if self.step_hook is not None:
            self.step_hook(name)

    def commit(self, key: bytes, group: ColdGroup, chunks: Sequence, size: int) -> bool:
        """The atomic write protocol (§7.2) for one encoded object. Errors are counted in
        ``write_errors`` and logged, never raised; returns whether the object is durable."""
        name = object_name(key, group)
        try:
            refusal = self.evict_for_write(size)
        except OSError as exc:
            refusal = f"eviction failed: {exc}"
        if refusal is not None:
            self.counters.add("write_errors")
            log.warning("cold tier: write of %s refused: %s", name, refusal)
            return False
        tmp = temp_name(key, os.getpid(), time.time_ns())
        fd = -1
        try:
            self._step("open")
            fd = os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=self.root_fd)
            self._step("write")
            _write_all(fd, chunks)
            self._step("sync")
            _sync_file(fd, self.durability)
            os.close(fd)
            fd = -1
            with self.index.lock:
                self._step("rename")
                os.rename(tmp, name, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
                self.index.put(key, IndexEntry(group, name, size, time.time_ns()))
                try:
                    self._step("dirsync")
                    os.fsync(self.root_fd)
                except OSError as exc:
                    self.counters.add("write_errors")
                    log.warning("cold tier: directory sync after writing %s failed: %s",
                                name, exc)
                    return False
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(tmp, dir_fd=self.root_fd)
            except OSError:
                pass
            self.counters.add("write_errors")
            log.warning("cold tier: write of %s failed: %s", name, exc)
            return False
        self.counters.add("bytes_written", size)
        return True

    # --- offline maintenance -------------------------------------------------------------

    def remove_quarantine(self) -> int:
        """Delete every ``.blocked.*`` entry (a directory with its contents, never following
        a link). Returns the count removed."""
        removed = 0
        for name in os.listdir(self.root_fd):
            if not is_quarantine(name):
                continue
            try:
                _remove_tree(self.root_fd, name)
                removed += 1
            except OSError as exc:
                log.warning("cold tier: cannot remove quarantined %s: %s", name, exc)
        return removed

    def evict_to(self, target_bytes: int) -> int:
        """Evict least-recently-read objects until ``total_bytes <= target_bytes``."""
        evicted = 0
        with self.index.lock:
            while self.index.total_bytes > target_bytes:
                victim = self.index.lru_victim()
                if victim is None:
                    break
                key, entry = victim
                if not self.clear_name(entry.file_name):
                    entry.unclearable = True
                    continue
                self.index.remove(key)
                self.counters.add("evictions")
                evicted += 1
        return evicted


def _remove_tree(dir_fd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            _remove_tree(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)

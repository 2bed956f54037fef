"""One opened cold root: index, bounded loads, atomic commits, quota and eviction
(docs/contracts/cold-tier.md, '5. Directory layout' and '7.2 Atomic write protocol' and '9. Loads
and corruption' and '10. Quota and eviction').

Thread model: the writer thread commits and evicts; inference threads probe and load.
Index mutations happen under ``index.lock``; probes read the dict without it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence

from pagedkv.atomic_write import AtomicFile
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
from pagedkv.cold.stats import ColdCounters, WriteFailureLog
from pagedkv.errors import FormatError, InvalidArgument

__all__ = ["DURABILITY_MODES", "WRITE_STEPS", "ColdStore", "auto_limits"]

log = logging.getLogger("pagedkv.cold")

DURABILITY_MODES = ("fsync", "full")
#: Steps of the atomic write protocol, in order; a step hook runs before each (tests
#: inject failures and SIGKILLs there).
WRITE_STEPS = ("open", "write", "sync", "rename", "dirsync")
_GIB = 1 << 30
#: Names one ``remove_quarantine`` call deletes at most (a hostile tree cannot hold
#: ``pagedkv cold evict`` forever; the next call continues).
MAX_QUARANTINE_ENTRIES = 1 << 20
_HOISTED = itertools.count()
#: open/read errors that say nothing about the object (the process is out of descriptors
#: or memory, or was interrupted): a miss, never a reason to drop the object.
_TRANSIENT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EINTR,
                               errno.EAGAIN})
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)

def auto_limits(root_fd: int) -> tuple[int, int]:
    """``(quota, reserve)`` in bytes from the filesystem size (docs/contracts/cold-tier.md, '10.
    Quota and eviction')."""
    st = os.statvfs(root_fd)
    total = st.f_blocks * st.f_frsize
    return min(total // 10, 100 * _GIB), max(total // 20, 5 * _GIB)


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
    """Files of one root, addressed through its directory fd: the local-directory
    :class:`~pagedkv.cold.backend.ColdBackend`."""

    #: One object per commit: each is its own atomic rename.
    batch_objects = 1

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
        #: One WARNING per kind of write failure; the rest counted (``write_errors_unlogged``).
        self.write_failures = WriteFailureLog(counters, log, root_path)
        self.quota_bytes = int(quota_bytes)
        self.reserve_bytes = int(reserve_bytes)
        self.durability = durability
        self.fmt = fmt
        self.index = ColdIndex()
        self.payload_tag = fmt.tag("cold-cache-payload")
        #: Test hook: called as ``hook(step)`` before each step of WRITE_STEPS.
        self.step_hook: Callable[[str], None] | None = None
        #: ``(name, owner)`` of object names the last :meth:`scan` could not index.
        self.unowned: list[tuple[str, str]] = []

    def __repr__(self) -> str:
        return (f"ColdStore(root={self.root_path!r}, objects={len(self.index)}, "
                f"total_bytes={self.index.total_bytes}, quota_bytes={self.quota_bytes})")

    # --- opening -------------------------------------------------------------------------

    def scan(self, *, quarantine_unowned: bool = True) -> int:
        """Clean dead writers' temps, then rebuild the index from regular files with
        canonical names (size and mtime from ``lstat``). Returns the object count.

        The index owns one object per key, and ``total_bytes`` counts exactly what it owns.
        A second name with an owned key (``<hex>.safetensors`` beside
        ``<hex>.gdn_state.safetensors``) cannot be owned: it is listed in ``unowned`` as
        ``(name, owner)`` and, with ``quarantine_unowned``, moved to quarantine, so it is
        neither counted nor left to fill the disk (``pagedkv cold evict`` deletes it).
        The KV block keeps the key, else the first name in sort order.
        """
        clean_writer_temps(self.root_fd)
        owned: dict[bytes, IndexEntry] = {}
        unowned: list[tuple[str, str]] = []
        for name in sorted(os.listdir(self.root_fd)):
            parsed = parse_object_name(name)
            if parsed is None:
                continue
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            key, group = parsed
            entry = IndexEntry(group, name, st.st_size, st.st_mtime_ns)
            prior = owned.get(key)
            if prior is not None:
                if group is ColdGroup.KV and prior.group is not ColdGroup.KV:
                    prior, entry = entry, prior
                unowned.append((entry.file_name, prior.file_name))
                entry = prior
            owned[key] = entry
        self.unowned = unowned
        if quarantine_unowned:
            for name, owner in unowned:
                log.warning("cold tier: %s shares its key with %s; the index owns one object "
                            "per key, so it is quarantined", name, owner)
                self.quarantine(name)
            self.unowned = []
        self.index.rebuild(list(owned.items()))
        return len(owned)

    def quarantine(self, name: str) -> str | None:
        """Rename ``name`` to its quarantine name; ``None`` on success, else why not."""
        try:
            os.rename(name, quarantine_name(name, os.getpid(), time.time_ns()),
                      src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
            return None
        except OSError as exc:
            return exc.strerror or str(exc)

    def close(self) -> None:
        self.write_failures.flush()
        if self.root_fd >= 0:
            os.close(self.root_fd)
            self.root_fd = -1

    # --- probes and loads ----------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.index.contains(key)

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        return self.index.contains_in(key, group)

    def present_run(self, keys: Sequence[bytes], start: int) -> int:
        """The first index ``>= start`` whose key is not indexed (index probes only)."""
        idx = start
        while idx < len(keys) and self.index.contains(keys[idx]):
            idx += 1
        return idx

    def learn_presence(self, keys: Sequence[bytes], group: ColdGroup = ColdGroup.KV) -> None:
        """Nothing to learn: the index is this root's truth."""

    def chain_source(self, keys: Sequence[bytes], start: int, stop: int, bound: int):
        """Blocks load one by one from their files: the store is its own source."""
        return self

    def open_object(self, name: str):
        """Open ``name`` read-only without following links or blocking. Returns
        ``(status, fd, st, error)``: status ``"ok"`` (``fd`` open, ``st`` its ``fstat``, a
        regular file), ``"absent"`` (no such name), ``"refused"`` (not a regular file:
        a link, directory, FIFO...), ``"unreadable"`` (open or fstat refused for the object
        itself: EACCES, EIO...; ``st`` from ``lstat`` when possible) or ``"busy"`` (refused
        for a reason that says nothing about the object: out of descriptors or memory).
        ``error`` is the ``OSError`` behind a failure, else ``None``."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError as exc:
            return "absent", -1, None, exc
        except OSError as exc:
            if exc.errno in _TRANSIENT_ERRNOS:
                return "busy", -1, None, exc
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except OSError:
                return "absent", -1, None, exc
            # ELOOP/ENXIO: a link or socket in place of the object.
            return ("unreadable" if stat.S_ISREG(st.st_mode) else "refused"), -1, st, exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            return ("busy" if exc.errno in _TRANSIENT_ERRNOS else "unreadable"), -1, None, exc
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return "refused", -1, st, None
        return "ok", fd, st, None

    def read_bounded(self, name: str, bound: int, buffer: bytearray | None = None):
        """Open ``name`` (:meth:`open_object`) and read at most ``bound + 1`` bytes.
        Returns ``(status, data, ident, fd)``: status is one of :meth:`open_object`'s or
        ``"oversized"``; ``ident`` is ``(st_dev, st_ino)`` of what was found there when
        known. The caller closes ``fd`` (``-1`` unless status is ``"ok"``)."""
        status, fd, st, exc = self.open_object(name)
        ident = (st.st_dev, st.st_ino) if st is not None else None
        if status != "ok":
            if status == "unreadable":
                log.warning("cold tier: cannot open %s (%s)", name, exc)
            return status, None, ident, -1
        try:
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
        except OSError as exc:
            os.close(fd)
            if exc.errno in _TRANSIENT_ERRNOS:
                return "busy", None, ident, -1
            log.warning("cold tier: cannot read %s (%s)", name, exc)
            return "unreadable", None, ident, -1

    def _load(self, key: bytes, name: str, bound: int, buffer, decode):
        """docs/contracts/cold-tier.md, '9. Loads and corruption' for one object: bounded read,
        ``decode(data)`` (a ``FormatError`` is a
        corruption), recency touch on success. Failures count a miss, corruptions only for
        opened regular files, and prune. Returns ``decode``'s result or ``None``."""
        status, data, ident, fd = self.read_bounded(name, bound, buffer)
        if status != "ok":
            self.counters.add("misses")
            if status == "busy":  # nothing wrong with the object: keep it for next time
                return None
            if status == "oversized":
                self.counters.add("corruptions")
                log.warning("cold tier: %s is larger than its bound %d; pruned", name, bound)
            # An unreadable object is dropped like a corrupt one, so the next capture
            # rewrites it instead of every restart missing it forever.
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
        """Bounded load of a KV block (docs/contracts/cold-tier.md, '9. Loads and corruption');
        ``None`` is a miss (counted, pruned).

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
        not-found). The entry goes only if it is ``name``'s: a miss under another name
        (a sidecar load for a key indexed as a block) leaves the owner of the key alone."""
        with self.index.lock:
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except FileNotFoundError:
                self._forget(key, name)
                return
            except OSError:
                st = None
            if st is not None and stat.S_ISREG(st.st_mode) and (
                    ident is None or (st.st_dev, st.st_ino) != tuple(ident)):
                return
            self.clear_name(name)
            self._forget(key, name)

    def _forget(self, key: bytes, name: str) -> None:
        entry = self.index.get(key)
        if entry is not None and entry.file_name == name:
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
        """The atomic write protocol (docs/contracts/cold-tier.md, '7.2 Atomic write protocol') for
        one encoded object. Errors are counted in
        ``write_errors`` and logged, never raised; returns whether the object is durable."""
        name = object_name(key, group)
        try:
            refusal = self.evict_for_write(size)
        except OSError as exc:
            refusal = f"eviction failed: {exc}"
        if refusal is not None:
            self.write_failures.failed(
                "refused", "cold tier: write of %s refused: %s (free disk space or raise the "
                "quota; later refusals are counted in write_errors_unlogged)", name, refusal)
            return False
        tmp = temp_name(key, os.getpid(), time.time_ns())
        file = None
        try:
            self._step("open")
            file = AtomicFile(name, dir_fd=self.root_fd, temp_name=tmp, mode=0o600,
                              full_sync=self.durability == "full")
            self._step("write")
            _write_all(file.fd, chunks)
            self._step("sync")
            file.finish()
            with self.index.lock:
                self._step("rename")
                file.rename()
                old = self.index.get(key)
                if old is not None and old.file_name != name:
                    # One object per key: the entry replaced names another file, which
                    # must not stay on disk uncounted.
                    self.clear_name(old.file_name)
                self.index.put(key, IndexEntry(group, name, size, time.time_ns()))
                try:
                    self._step("dirsync")
                    file.sync_directory()
                except OSError as exc:
                    self.write_failures.failed(
                        f"dirsync {type(exc).__name__}", "cold tier: directory sync after "
                        "writing %s failed: %s (later ones are counted in "
                        "write_errors_unlogged)", name, exc)
                    return False
        except OSError as exc:
            if file is not None:
                file.abort()
            self.write_failures.failed(
                type(exc).__name__, "cold tier: write of %s failed: %s (check the disk's free "
                "space and permissions; later failures of this kind are counted in "
                "write_errors_unlogged)", name, exc)
            return False
        self.counters.add("bytes_written", size)
        return True

    def commit_many(self, items: Sequence) -> list[bool]:
        """:meth:`commit` of each ``(key, group, chunks, size)`` in order."""
        return [self.commit(*item) for item in items]

    # --- offline maintenance -------------------------------------------------------------

    def remove_quarantine(self, max_entries: int = MAX_QUARANTINE_ENTRIES) -> int:
        """Delete every ``.blocked.*`` entry (a directory with its contents, never following
        a link). Returns the count of those entries removed.

        Iterative, one descriptor at a time: a directory inside a quarantined tree is moved
        up into the root as a quarantine entry of its own before its parent is removed, so
        a tree of any depth costs neither recursion nor a descriptor per level. At most
        ``max_entries`` names are deleted per call; what is left waits for the next one.
        """
        top = [n for n in os.listdir(self.root_fd) if is_quarantine(n)]
        pending = list(reversed(top))
        top_names = set(top)
        removed = 0
        budget = max_entries
        while pending and budget > 0:
            name = pending.pop()
            try:
                budget -= self._remove_flat(name, pending)
            except OSError as exc:
                log.warning("cold tier: cannot remove quarantined %s: %s", name, exc)
                continue
            removed += name in top_names
        if pending:
            log.warning("cold tier: quarantine removal stopped after %d entries; %d left for "
                        "the next `pagedkv cold evict`", max_entries, len(pending))
        return removed

    def _remove_flat(self, name: str, pending: list[str]) -> int:
        """Remove root entry ``name``: a non-directory is unlinked; a directory has its
        files unlinked and its subdirectories renamed into the root (appended to
        ``pending``), then is removed. Returns the names handled."""
        st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=self.root_fd)
            return 1
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=self.root_fd)
        handled = 1
        try:
            for child in os.listdir(fd):
                if stat.S_ISDIR(os.stat(child, dir_fd=fd, follow_symlinks=False).st_mode):
                    hoisted = quarantine_name(f"tree{next(_HOISTED)}", os.getpid(),
                                              time.time_ns())
                    os.rename(child, hoisted, src_dir_fd=fd, dst_dir_fd=self.root_fd)
                    pending.append(hoisted)
                else:
                    os.unlink(child, dir_fd=fd)
                handled += 1
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=self.root_fd)
        return handled

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

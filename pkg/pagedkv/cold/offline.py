"""Offline maintenance of a cold root: the work behind ``pagedkv cold``
(docs/contracts/cold-tier.md, '9. Loads and corruption' to '10. Quota and eviction').

``verify`` is read-only unless asked to prune: it moves no counter, touches no mtime and
changes no index; ``--prune`` renames each bad object to its quarantine name. It reads each
object's length and header before anything else and streams the payload through the
checksum, so its memory never depends on what a file claims or how large it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedkv.argument_checks import is_int
from pagedkv.cold.codec import (
    checksum_of_stream,
    header_length,
    parse_block_header,
    parse_sidecar_header,
)
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.names import is_quarantine, is_writer_temp
from pagedkv.cold.root import open_managed_root
from pagedkv.cold.stats import ColdCounters
from pagedkv.cold.store import ColdStore, auto_limits
from pagedkv.errors import FormatError

__all__ = [
    "BadObject",
    "RootSummary",
    "VerifyResult",
    "check_object",
    "open_offline_store",
    "root_summary",
    "trace_counters",
    "verify_store",
]

#: Offline reads of objects whose geometry is not known beforehand stop here.
OFFLINE_READ_LIMIT_BYTES = 1 << 32


def open_offline_store(root: str, *, child: str | None = None,
                       fmt: ColdFormat = DEFAULT_FORMAT,
                       quarantine_unowned: bool = False) -> ColdStore:
    """Open a root (same symlink/ownership rules) with a fresh index and no writer.
    Read-only by default: names the index cannot own stay where they are (listed in
    ``store.unowned``) unless ``quarantine_unowned``."""
    root_fd = open_managed_root(root, child)
    quota, reserve = auto_limits(root_fd)
    path = os.path.join(os.path.realpath(root), child) if child else os.path.realpath(root)
    store = ColdStore(root_fd, path, ColdCounters(), quota_bytes=quota, reserve_bytes=reserve,
                      fmt=fmt)
    store.scan(quarantine_unowned=quarantine_unowned)
    return store


@dataclass(frozen=True)
class BadObject:
    """An object ``verify`` rejected: its file name, why, and with ``--prune`` whether it
    was moved to quarantine (``prune_error`` says why not)."""

    name: str
    reason: str
    quarantined: bool = False
    prune_error: str | None = None


@dataclass(frozen=True)
class VerifyResult:
    """``checked`` objects (the indexed ones and the names the index could not own), the
    ``bad`` ones, and how many ``vanished`` between the scan and their check (evicted or
    replaced by a live server: not bad)."""

    checked: int
    bad: list[BadObject]
    vanished: int = 0


_CHUNK_BYTES = 1 << 20


def _pread_exact(fd: int, n: int, offset: int) -> bytes:
    """``n`` bytes at ``offset`` (short only at the end of the file)."""
    parts, got = [], 0
    while got < n:
        chunk = os.pread(fd, n - got, offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def check_object(store, size: int, key: bytes, group: ColdGroup, name: str,
                 read_at: Callable[[int, int], bytes],
                 stream_from: Callable[[int], Callable[[memoryview], int]]) -> None:
    """Header first, then the payload streamed through the checksum: memory is the header
    (at most 16 MiB, and only once its length fits the object) plus one 1 MiB chunk,
    whatever the object's size. ``read_at(offset, n)`` reads bytes of the object;
    ``stream_from(offset)`` returns a ``readinto(view) -> n`` continuing from ``offset``
    (a file or a Redis value alike). Raises ``FormatError`` naming what is wrong."""
    n = header_length(read_at(0, 8), size, name)
    prefix = read_at(0, 8 + n)
    if group is ColdGroup.KV:
        header = parse_block_header(prefix, size, abi=store.fmt.abi, key_hex=key.hex(),
                                    path=name)
    else:
        header = parse_sidecar_header(prefix, size, abi=store.fmt.abi, group=group.label,
                                      key_hex=key.hex(), path=name)
    got = checksum_of_stream(store.payload_tag, header.tensors,
                             stream_from(header.payload_start), _CHUNK_BYTES, path=name)
    if got != header.checksum:
        raise FormatError(f"payload checksum {got} != stored {header.checksum}", path=name)


def _check_object(store: ColdStore, fd: int, size: int, key: bytes, group: ColdGroup,
                  name: str) -> None:
    """:func:`check_object` on an open file; its size must not change meanwhile."""
    def stream_from(offset: int):
        os.lseek(fd, offset, os.SEEK_SET)
        return lambda view: os.readv(fd, [view])

    check_object(store, size, key, group, name, lambda offset, n: _pread_exact(fd, n, offset),
                 stream_from)
    if os.fstat(fd).st_size != size:
        raise FormatError(f"object changed size while it was read ({size} bytes before)",
                          path=name)


def _verify_one(store: ColdStore, key: bytes, group: ColdGroup, name: str) -> str | None:
    """Why the object at ``name`` is bad, ``None`` if it is good; raises
    ``FileNotFoundError`` when it is gone."""
    status, fd, st, exc = store.open_object(name)
    if status == "absent":
        raise FileNotFoundError(name)
    if status != "ok":
        detail = f" ({exc.strerror})" if exc is not None and exc.strerror else ""
        return {"refused": "not a regular file", "unreadable": f"cannot be read{detail}",
                "busy": f"cannot be opened now{detail}"}[status]
    try:
        if st.st_size > OFFLINE_READ_LIMIT_BYTES:
            return "larger than any valid object"
        _check_object(store, fd, st.st_size, key, group, name)
        return None
    except FormatError as exc:
        return str(exc)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    finally:
        os.close(fd)  # no utime: verify is read-only


def verify_store(store: ColdStore, *, prune: bool = False) -> VerifyResult:
    """Check every indexed object, KV blocks and sidecars, with the checks of
    docs/contracts/cold-tier.md, '6.6 Decoding'
    (geometry or layout against the object's own metadata), header first and the payload
    streamed. Names the index could not own (``store.unowned``) are bad too. An object that
    vanished since the scan is counted apart, never bad. With ``prune`` bad objects are
    quarantined (unless they could not even be opened for want of descriptors)."""
    bad: list[BadObject] = []
    checked = vanished = 0
    for key, entry in store.index.snapshot():
        checked += 1
        try:
            reason = _verify_one(store, key, entry.group, entry.file_name)
        except FileNotFoundError:
            vanished += 1
            continue
        if reason is not None:
            bad.append(_bad(store, entry.file_name, reason,
                            prune and not reason.startswith("cannot be opened now")))
    for name, owner in store.unowned:
        checked += 1
        bad.append(_bad(store, name, f"shares its key with {owner}; the index owns one "
                                     "object per key, so this one is never used", prune))
    return VerifyResult(checked, bad, vanished)


def _bad(store: ColdStore, name: str, reason: str, prune: bool) -> BadObject:
    if not prune:
        return BadObject(name, reason)
    error = store.quarantine(name)
    return BadObject(name, reason, error is None, error)


@dataclass
class RootSummary:
    root: str
    objects: dict = field(default_factory=dict)
    bytes_by_group: dict = field(default_factory=dict)
    total_bytes: int = 0
    quota_bytes: int = 0
    reserve_bytes: int = 0
    quarantined: int = 0
    writer_temps: int = 0
    #: Object names sharing a key the index already owns: never counted in ``total_bytes``.
    unowned: int = 0


def root_summary(store: ColdStore) -> RootSummary:
    s = RootSummary(store.root_path, quota_bytes=store.quota_bytes,
                    reserve_bytes=store.reserve_bytes, total_bytes=store.index.total_bytes,
                    unowned=len(store.unowned))
    for g in ColdGroup:
        s.objects[g.label] = 0
        s.bytes_by_group[g.label] = 0
    for _, e in store.index.snapshot():
        s.objects[e.group.label] += 1
        s.bytes_by_group[e.group.label] += e.size
    for name in os.listdir(store.root_fd):
        s.quarantined += is_quarantine(name)
        s.writer_temps += is_writer_temp(name)
    return s


def trace_counters(directory: str) -> tuple[str, dict[str, int]] | None:
    """Counters of the most recent serving process that wrote a turn trace in
    ``directory``: the sum of its per-turn ``cold_<counter>`` deltas. ``None`` when there
    is no readable trace."""
    import dataclasses
    import json

    from pagedkv.cold.stats import ColdCacheStats
    stamps = {}
    try:
        for n in os.listdir(directory):
            if n.endswith(".jsonl"):
                try:
                    stamps[n] = os.stat(os.path.join(directory, n)).st_mtime_ns
                except OSError:
                    continue  # gone since the listing, or a dangling link
    except OSError:
        return None
    if not stamps:
        return None
    newest = max(stamps, key=stamps.__getitem__)
    fields = [f.name for f in dataclasses.fields(ColdCacheStats)
              if f.type in ("int", int) and f.name != "quota_bytes"]
    totals = dict.fromkeys(fields, 0)
    try:
        # errors="replace": a torn or foreign line is skipped, never fatal to `cold stats`
        with open(os.path.join(directory, newest), encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(rec, dict):
                    continue
                for name in fields:
                    v = rec.get(f"cold_{name}")
                    if is_int(v):
                        totals[name] += int(v)
    except OSError:
        return None
    return newest, totals

"""Offline maintenance of a cold root: the work behind ``pagedkv cold`` (cold-tier.md §9–10).

``verify`` is read-only unless asked to prune: it moves no counter, touches no mtime and
changes no index; ``--prune`` renames each bad object to its quarantine name.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from pagedkv.cold.codec import decode_block, decode_sidecar
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.names import is_quarantine, is_writer_temp, quarantine_name
from pagedkv.cold.root import open_managed_root
from pagedkv.cold.stats import ColdCounters
from pagedkv.cold.store import ColdStore, auto_limits
from pagedkv.errors import FormatError

__all__ = [
    "BadObject",
    "RootSummary",
    "open_offline_store",
    "root_summary",
    "trace_counters",
    "verify_store",
]

#: Offline reads of objects whose geometry is not known beforehand stop here.
OFFLINE_READ_LIMIT_BYTES = 1 << 32


def open_offline_store(root: str, *, child: str | None = None,
                       fmt: ColdFormat = DEFAULT_FORMAT) -> ColdStore:
    """Open a root (same symlink/ownership rules) with a fresh index and no writer."""
    root_fd = open_managed_root(root, child)
    quota, reserve = auto_limits(root_fd)
    path = os.path.join(os.path.realpath(root), child) if child else os.path.realpath(root)
    store = ColdStore(root_fd, path, ColdCounters(), quota_bytes=quota, reserve_bytes=reserve,
                      fmt=fmt)
    store.scan()
    return store


@dataclass(frozen=True)
class BadObject:
    """An object ``verify`` rejected: its file name, why, and with ``--prune`` whether it
    was moved to quarantine (``prune_error`` says why not)."""

    name: str
    reason: str
    quarantined: bool = False
    prune_error: str | None = None


def verify_store(store: ColdStore, *, prune: bool = False) -> tuple[int, list[BadObject]]:
    """Decode every indexed object, KV blocks and sidecars, with the checks of §6.6
    (geometry or layout against the object's own metadata). Returns ``(checked, bad)``;
    with ``prune`` bad objects are quarantined."""
    bad: list[BadObject] = []
    checked = 0
    for key, entry in store.index.snapshot():
        checked += 1
        status, data, _, fd = store.read_bounded(entry.file_name, OFFLINE_READ_LIMIT_BYTES)
        reason = None
        if status != "ok":
            reason = {"absent": "missing or not openable", "refused": "not a regular file",
                      "oversized": "larger than any valid object"}[status]
        else:
            try:
                if entry.group is ColdGroup.KV:
                    decode_block(data, abi=store.fmt.abi, checksum_tag=store.payload_tag,
                                 key_hex=key.hex(), path=entry.file_name)
                else:
                    decode_sidecar(data, abi=store.fmt.abi, checksum_tag=store.payload_tag,
                                   group=entry.group.label, key_hex=key.hex(),
                                   path=entry.file_name)
            except FormatError as exc:
                reason = str(exc)
            finally:
                os.close(fd)  # no utime: verify is read-only
        if reason is None:
            continue
        quarantined, prune_error = False, None
        if prune:
            try:
                os.rename(entry.file_name,
                          quarantine_name(entry.file_name, os.getpid(), time.time_ns()),
                          src_dir_fd=store.root_fd, dst_dir_fd=store.root_fd)
                quarantined = True
            except OSError as exc:
                prune_error = exc.strerror or str(exc)
        bad.append(BadObject(entry.file_name, reason, quarantined, prune_error))
    return checked, bad


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


def root_summary(store: ColdStore) -> RootSummary:
    s = RootSummary(store.root_path, quota_bytes=store.quota_bytes,
                    reserve_bytes=store.reserve_bytes, total_bytes=store.index.total_bytes)
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
                    if isinstance(v, int) and not isinstance(v, bool):
                        totals[name] += v
    except OSError:
        return None
    return newest, totals

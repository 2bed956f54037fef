"""``pagedkv cold stats / verify`` against a Redis/Valkey store (docs/cold.md, "A fleet on
Redis or Valkey").

``verify`` reads each value the way the directory's verify reads a file: its length, then
the 8-byte header length, then the header, then the payload streamed through the checksum
in 1 MiB ``GETRANGE`` chunks, so memory never depends on what a value claims or how large
it is. Read-only unless ``prune``: then a bad value is deleted (Redis has no quarantine).
"""

from __future__ import annotations

from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.names import parse_object_name
from pagedkv.cold.offline import (
    OFFLINE_READ_LIMIT_BYTES,
    BadObject,
    RootSummary,
    VerifyResult,
    check_object,
)
from pagedkv.cold.redis_store import RedisColdStore
from pagedkv.errors import FormatError

__all__ = ["remote_summary", "verify_remote"]

def remote_summary(store: RedisColdStore) -> RootSummary:
    """Objects and bytes per group under the store's prefix; ``quota_bytes`` is the
    server's ``maxmemory``. Keys under the prefix that are not canonical object names are
    counted as ``unowned`` (never loaded)."""
    s = RootSummary(store.url, quota_bytes=store.quota_bytes)
    for g in ColdGroup:
        s.objects[g.label] = 0
        s.bytes_by_group[g.label] = 0
    for _, name, size in store.scan_objects():
        parsed = parse_object_name(name)
        if parsed is None or size < 0:
            s.unowned += 1
            continue
        s.objects[parsed[1].label] += 1
        s.bytes_by_group[parsed[1].label] += size
        s.total_bytes += size
    return s


def _check_value(store: RedisColdStore, rkey: str, size: int, key: bytes, group: ColdGroup
                 ) -> None:
    """:func:`~pagedkv.cold.offline.check_object` over ``GETRANGE``; raises
    ``FileNotFoundError`` when the value vanished or changed length meanwhile."""
    client = store.client

    def read_at(offset: int, n: int) -> bytes:
        return bytes(client.getrange(rkey, offset, offset + n - 1)) if n > 0 else b""

    def stream_from(offset: int):
        position = offset

        def readinto(view: memoryview) -> int:
            nonlocal position
            chunk = read_at(position, len(view))
            view[:len(chunk)] = chunk
            position += len(chunk)
            return len(chunk)
        return readinto

    check_object(store, size, key, group, rkey, read_at, stream_from)
    if client.strlen(rkey) != size:
        raise FileNotFoundError(rkey)


def verify_remote(store: RedisColdStore, *, prune: bool = False) -> VerifyResult:
    """Check every value under the prefix (KV blocks and sidecars) with the checks of the
    directory's verify. A value that vanished meanwhile (evicted) is counted apart, never
    bad. With ``prune`` bad values are deleted."""
    bad: list[BadObject] = []
    checked = vanished = 0
    for rkey, name, size in store.scan_objects():
        checked += 1
        parsed = parse_object_name(name)
        reason: str | None
        if parsed is None:
            reason = "not a canonical object name under the prefix (never loaded)"
        elif size < 0:
            reason = "not a string value"
        elif size == 0:
            vanished += 1
            continue
        elif size > OFFLINE_READ_LIMIT_BYTES:
            reason = "larger than any valid object"
        else:
            try:
                _check_value(store, rkey, size, parsed[0], parsed[1])
                reason = None
            except FileNotFoundError:
                vanished += 1
                continue
            except FormatError as exc:
                reason = str(exc)
        if reason is None:
            continue
        if not prune:
            bad.append(BadObject(rkey, reason))
            continue
        try:
            store.client.delete(rkey)
            bad.append(BadObject(rkey, reason, True))
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to verify
            bad.append(BadObject(rkey, reason, False, str(exc)))
    return VerifyResult(checked, bad, vanished)

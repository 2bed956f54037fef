"""``pagedkv cold stats / verify`` against a Redis/Valkey store (docs/cold.md, "A fleet on
Redis or Valkey").

``verify`` reads each value the way the directory's verify reads a file: its length, then
the 8-byte header length, then the header, then the payload streamed through the checksum
in 1 MiB ``GETRANGE`` chunks, so memory never depends on what a value claims or how large
it is. Read-only unless ``prune``: then a bad value is deleted (Redis has no quarantine),
and only if it is still the value that was judged: each key is ``WATCH``ed before its
length is read and the delete is a ``MULTI``/``DEL``/``EXEC`` that the server aborts when
anyone wrote (or evicted) the key meanwhile, so a fleet peer's fresh rewrite survives.
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


def _check_value(store: RedisColdStore, client, rkey: str, size: int, key: bytes,
                 group: ColdGroup) -> None:
    """:func:`~pagedkv.cold.offline.check_object` over ``GETRANGE`` on ``client`` (the
    store's, or a pipeline ``WATCH``ing ``rkey``); raises ``FileNotFoundError`` when the
    value vanished or changed length meanwhile."""

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


def _strlen(client, rkey: str) -> int:
    """``STRLEN`` of ``rkey``: -1 for a value that is not a string."""
    import redis
    try:
        return int(client.strlen(rkey))
    except redis.exceptions.ResponseError:  # WRONGTYPE
        return -1


def _judge(store: RedisColdStore, client, rkey: str, name: str, size: int) -> str | None:
    """Why the value is bad, ``None`` if it is good; raises ``FileNotFoundError`` when it
    vanished (size 0, or gone or resized while it was read)."""
    parsed = parse_object_name(name)
    if parsed is None:
        return "not a canonical object name under the prefix (never loaded)"
    if size < 0:
        return "not a string value"
    if size == 0:
        raise FileNotFoundError(rkey)
    if size > OFFLINE_READ_LIMIT_BYTES:
        return "larger than any valid object"
    try:
        _check_value(store, client, rkey, size, parsed[0], parsed[1])
    except FormatError as exc:
        return str(exc)
    return None


def _judge_and_delete(store: RedisColdStore, rkey: str, name: str) -> BadObject | None:
    """The bad object (deleted, or why not), ``None`` if it is good: one key under ``WATCH``: its length and every byte judged
    are read after the ``WATCH``, and the ``DEL`` runs in a ``MULTI``/``EXEC`` the server
    aborts if the key was written or evicted since. An aborted delete raises
    ``FileNotFoundError``: the value judged is gone (replaced by a peer: not bad)."""
    import redis
    with store.client.pipeline(transaction=True) as watched:
        watched.watch(rkey)
        reason = _judge(store, watched, rkey, name, _strlen(watched, rkey))
        if reason is None:
            return None
        try:
            watched.multi()
            watched.delete(rkey)
            watched.execute()
        except redis.exceptions.WatchError:
            raise FileNotFoundError(rkey) from None
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to verify
            return BadObject(rkey, reason, False, str(exc))
        return BadObject(rkey, reason, True)


def verify_remote(store: RedisColdStore, *, prune: bool = False) -> VerifyResult:
    """Check every value under the prefix (KV blocks and sidecars) with the checks of the
    directory's verify. A value that vanished meanwhile (evicted, or rewritten between its
    check and its delete) is counted apart, never bad. With ``prune`` bad values are
    deleted, each only if it is still the value that was judged."""
    bad: list[BadObject] = []
    checked = vanished = 0
    for rkey, name, size in store.scan_objects():
        checked += 1
        try:
            if prune:
                found = _judge_and_delete(store, rkey, name)
            else:
                reason = _judge(store, store.client, rkey, name, size)
                found = None if reason is None else BadObject(rkey, reason)
        except FileNotFoundError:
            vanished += 1
            continue
        if found is not None:
            bad.append(found)
    return VerifyResult(checked, bad, vanished)

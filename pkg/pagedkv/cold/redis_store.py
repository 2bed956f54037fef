"""A cold store on one Redis or Valkey server, shared by a serving fleet (docs/cold.md,
"A fleet on Redis or Valkey").

Each object is one string value under ``<prefix><object name>`` (``pagedkv-v1:<64
hex>.safetensors``): the same bytes the directory backend writes to that file name. The
server is untrusted exactly like a disk: every value is read bounded (``GETRANGE 0
bound``: a value larger than its bound is never transferred in full) and decoded
fail-closed; a value that does not decode is a counted miss and a corruption, deleted only
if it is still the value that failed (a Lua compare-and-delete on its SHA-1, so a fleet
peer's fresh rewrite survives).

Quota is the server's: ``maxmemory`` with an ``allkeys-lru`` (or ``-lfu``) policy. An
evicted key is a plain miss. The index here is what this process knows is stored (learned
from its own commits and from one pipelined probe per walk); other replicas' writes show up
at the next probe, never through a scan of the fleet's keyspace at open.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from pagedkv.cold.codec import BlockGeometry, DecodedBlock, decode_block, decode_sidecar
from pagedkv.cold.format import DEFAULT_FORMAT, ColdFormat
from pagedkv.cold.groups import ColdGroup
from pagedkv.cold.index import ColdIndex, IndexEntry
from pagedkv.cold.names import object_name, parse_object_name
from pagedkv.cold.root import MANAGED_CHILD
from pagedkv.cold.stats import ColdCounters, WriteFailureLog
from pagedkv.errors import (
    ColdBackendAuthError,
    ColdBackendError,
    ColdBackendTLSError,
    FormatError,
    InvalidArgument,
)

__all__ = ["REDIS_SCHEMES", "RedisColdStore", "is_redis_url", "redacted_url"]

log = logging.getLogger("pagedkv.cold")

REDIS_SCHEMES = ("redis", "rediss", "unix")
#: Keys of every object: one namespace per on-disk format version, like the directory.
DEFAULT_PREFIX = MANAGED_CHILD + ":"
#: Objects one pipelined restore round trip fetches at most, in bytes of their bounds: a
#: 2,048-block prefix of small blocks is one round trip; a chain of 200 KB blocks is a few,
#: and memory stays bounded whatever the chain's length.
FETCH_WINDOW_BYTES = 64 << 20
#: Seconds after a round trip the server did not answer before the next one is tried (the
#: others meanwhile are misses or write errors at once); doubled while it stays down, up to
#: DOWN_RETRY_MAX_S.
DOWN_RETRY_S = 1.0
DOWN_RETRY_MAX_S = 30.0
#: Objects the writer hands to one pipelined commit at most.
COMMIT_BATCH_OBJECTS = 16
#: Seconds a connect or a reply may take before the operation is a miss or a write error.
DEFAULT_TIMEOUT_S = 5.0

# Delete KEYS[1] only if it still holds what failed: ARGV[1] = "digest" and the SHA-1 of
# the value read, or "oversized" and the bound the value exceeded. A non-string value is
# deleted outright (never an object).
_PRUNE_LUA = """
local t = redis.call('TYPE', KEYS[1]).ok
if t == 'none' then return 0 end
if t ~= 'string' then return redis.call('DEL', KEYS[1]) end
if ARGV[1] == 'digest' then
  if redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then
    return redis.call('DEL', KEYS[1])
  end
  return 0
end
if redis.call('STRLEN', KEYS[1]) > tonumber(ARGV[2]) then return redis.call('DEL', KEYS[1]) end
return 0
"""


def is_redis_url(text: str | None) -> bool:
    """Whether ``text`` names a Redis/Valkey server (``redis://``, ``rediss://``,
    ``unix://``) rather than a directory."""
    # The scheme as urlsplit reads it, without urlsplit (which raises for a bad IPv6 host).
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*):", str(text or "").strip())
    return scheme is not None and scheme.group(1).lower() in REDIS_SCHEMES


#: A secret in a URL's query: redis-py takes ``?password=...`` as the password.
_QUERY_SECRET = re.compile(r"([?&;]password=)[^&;#]*", re.IGNORECASE)


def redacted_url(url: str) -> str:
    """``url`` without its password: what reprs, stats, messages and warnings show.

    Never raises, whatever ``url`` is (a malformed value is still shown redacted): the
    password of the userinfo (``user:***@``) and a ``password=`` query value become
    ``***``. When an ``@`` comes after the host part (a ``/`` or ``?`` in an unencoded
    password), everything before the last ``@`` but the scheme is hidden."""
    text = str(url)
    start = text.find("//")
    start = 0 if start < 0 else start + 2
    end = len(text)
    for ch in "/?#":
        i = text.find(ch, start)
        if i >= 0:
            end = min(end, i)
    at = text.rfind("@", start)
    if at >= end:  # the "host part" ends inside the userinfo: hide all of it
        return text[:start] + "***" + _QUERY_SECRET.sub(r"\1***", text[at:])
    netloc = text[start:end]
    userinfo, sep, host = netloc.rpartition("@")
    if sep:
        user, colon, _ = userinfo.partition(":")
        if colon:
            netloc = f"{user}:***@{host}"
        elif start == 0:  # no "//": a user cannot be told from a password
            netloc = f"***@{host}"
    return text[:start] + netloc + _QUERY_SECRET.sub(r"\1***", text[end:])


_URL_FORM = ("expected redis://[[user]:password@]host:port/db, rediss://... or "
             "unix:///path?db=N, with @ / ? # : in a password percent-encoded")


def _check_url(url: str, shown: str) -> None:
    """``InvalidArgument`` (naming ``shown``, never ``url``) for a URL the client would
    refuse with a message quoting part of it (a port that is no number) or take silently
    wrong (a path that is no database number becomes db 0)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number in range
    except ValueError:
        raise InvalidArgument(f"cold backend {shown!r} is not a valid URL (host or port): "
                              f"{_URL_FORM}") from None
    if parts.scheme != "unix" and re.fullmatch(r"/?|/[0-9]+", parts.path) is None:
        raise InvalidArgument(f"cold backend {shown!r}: the path must be /DB, a database "
                              f"number; {_URL_FORM}")


def _client_errors():
    """What a round trip may raise when the server is gone, loading its AOF after a restart,
    read-only, or otherwise unable to answer: a miss or a write error, never raised."""
    import redis
    return redis.exceptions.RedisError, OSError


def _out_of_memory_error():
    """The client's class for the server's "OOM command not allowed when used memory >
    'maxmemory'" reply; its text arrives without the "OOM" code (redis-py strips it)."""
    import redis
    return redis.exceptions.OutOfMemoryError


class RedisColdStore:
    """Objects of one key prefix on one Redis/Valkey server: a
    :class:`~pagedkv.cold.backend.ColdBackend`."""

    batch_objects = COMMIT_BATCH_OBJECTS

    def __init__(self, client, url: str, counters: ColdCounters, *,
                 fmt: ColdFormat = DEFAULT_FORMAT, prefix: str = DEFAULT_PREFIX,
                 quota_bytes: int = 0, durable_acks: bool = False) -> None:
        self.client = client
        self.url = redacted_url(url)
        self.counters = counters
        #: One WARNING per kind of write failure; the rest counted (``write_errors_unlogged``).
        self.write_failures = WriteFailureLog(counters, log, self.url)
        self.fmt = fmt
        self.prefix = prefix
        self.payload_tag = fmt.tag("cold-cache-payload")
        self.index = ColdIndex()
        #: The server's ``maxmemory`` in bytes (0: unlimited or not readable).
        self.quota_bytes = int(quota_bytes)
        #: Whether an acknowledged write survives a server crash (``appendonly yes`` and
        #: ``appendfsync always``), as read from the server at open.
        self.durable_acks = durable_acks
        #: Test hook: called as ``hook(window)`` before each pipelined restore fetch.
        self.fetch_hook: Callable[[int], None] | None = None
        self.fetch_window_bytes = FETCH_WINDOW_BYTES
        #: Called as ``sink(key, group, data)`` with each verified object's bytes (the
        #: two-level store writes them back to its local directory).
        self.fill_sink: Callable[[bytes, ColdGroup, bytes], None] | None = None
        self._prune_script = client.register_script(_PRUNE_LUA)
        self._down = False
        self._health_lock = threading.Lock()
        self._retry_s = DOWN_RETRY_S
        self._retry_at = 0.0
        self._closed = False

    @classmethod
    def open(cls, url: str, counters: ColdCounters | None = None, *,
             fmt: ColdFormat = DEFAULT_FORMAT, prefix: str = DEFAULT_PREFIX,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> RedisColdStore:
        """Connect to ``url`` (``redis://[[user]:password@]host:port/db``, ``rediss://``
        for TLS, ``unix://path?db=N``) and check it answers.

        Raises ``ColdBackendAuthError`` for refused credentials, ``ColdBackendTLSError``
        when TLS does not match, ``ColdBackendError`` when the server is unreachable or the
        ``redis`` client is not installed, ``InvalidArgument`` for a malformed URL.
        """
        shown = redacted_url(url)
        if not is_redis_url(url):
            raise InvalidArgument(f"cold backend {shown!r} is not a redis://, rediss:// or "
                                  "unix:// URL")
        try:
            import redis
        except ImportError:
            raise ColdBackendError("the Redis cold backend needs the redis client: pip "
                                   "install 'pagedkv[redis]'") from None
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        _check_url(url, shown)
        try:
            # One immediate retry: a pooled connection the server dropped (a restart)
            # reconnects; a server that is down costs one refused connect, not a backoff. A
            # timeout is not retried: a hung server costs one timeout, not two.
            # 1 MiB reads: a restore window is tens of MiB of replies.
            client = redis.Redis.from_url(url, socket_timeout=timeout_s,
                                          socket_connect_timeout=timeout_s,
                                          health_check_interval=0,
                                          retry=Retry(NoBackoff(), 1, supported_errors=(
                                              redis.exceptions.ConnectionError,)),
                                          socket_read_size=1 << 20)
        except ValueError as exc:
            raise InvalidArgument(f"cold backend {shown!r}: {exc}") from None
        try:
            client.ping()
        except redis.exceptions.AuthenticationError as exc:
            client.close()
            raise ColdBackendAuthError(
                f"cold backend {shown}: the server refused the credentials ({exc}); put the "
                "right password in the URL (redis://:PASSWORD@host:port/db)") from None
        except redis.exceptions.ResponseError as exc:
            client.close()
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise ColdBackendAuthError(
                    f"cold backend {shown}: the server requires a password ({exc}); put it "
                    "in the URL (redis://:PASSWORD@host:port/db)") from None
            raise ColdBackendError(f"cold backend {shown}: {exc}") from None
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) \
                as exc:
            client.close()
            raise _connect_error(shown, url, exc) from None
        except TypeError as exc:  # the client builds a connection from the query's options
            client.close()
            raise InvalidArgument(f"cold backend {shown!r}: an option of the URL query is "
                                  f"not one the redis client takes ({exc})") from None
        except redis.exceptions.RedisError as exc:  # e.g. a bad ssl_cert_reqs value
            client.close()
            raise ColdBackendError(f"cold backend {shown}: {exc}") from None
        maxmemory, durable = _server_limits(client, shown)
        return cls(client, url, counters if counters is not None else ColdCounters(),
                   fmt=fmt, prefix=prefix, quota_bytes=maxmemory, durable_acks=durable)

    def __repr__(self) -> str:
        return (f"RedisColdStore({self.url!r}, prefix={self.prefix!r}, "
                f"known_objects={len(self.index)}, quota_bytes={self.quota_bytes})")

    @property
    def root_path(self) -> str:
        return self.url

    def redis_key(self, name: str) -> str:
        return self.prefix + name

    # --- probes --------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.index.contains(key)

    def contains_in(self, key: bytes, group: ColdGroup) -> bool:
        return self.index.contains_in(key, group)

    def _probe(self, keys: Sequence[bytes], group: ColdGroup) -> list[int] | None:
        """``STRLEN`` of each key's object in one round trip (0: absent; -1: not a string,
        which a load then refuses and prunes), or ``None`` when the server is down."""
        names = [object_name(k, group) for k in keys]
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.strlen(self.redis_key(name))
        replies = self._execute(pipe)
        if replies is None:
            return None
        sizes = [r if isinstance(r, int) else -1 for r in replies]
        now = time.time_ns()
        with self.index.lock:
            for key, name, size in zip(keys, names, sizes, strict=True):
                if size:
                    if not self.index.contains(key):
                        self.index.put(key, IndexEntry(group, name, max(size, 0), now))
                elif (entry := self.index.get(key)) is not None and entry.file_name == name:
                    self.index.remove(key)  # evicted by the server, or pruned by a peer
        return sizes

    def present_run(self, keys: Sequence[bytes], start: int) -> int:
        sizes = self._probe(keys[start:], ColdGroup.KV)
        if sizes is None:
            return start
        run = start
        for size in sizes:
            if not size:
                break
            run += 1
        return run

    def learn_presence(self, keys: Sequence[bytes], group: ColdGroup = ColdGroup.KV) -> None:
        if keys:
            self._probe(keys, group)

    # --- loads ---------------------------------------------------------------------------

    def fetch(self, names: Sequence[str], bound: int) -> list[tuple[str, bytes | None]]:
        """Each object's first ``bound + 1`` bytes in one pipelined round trip, as
        ``(status, data)``: ``"ok"``, ``"absent"`` (no such key: evicted, never written),
        ``"oversized"``, ``"refused"`` (not a string value) or ``"busy"`` (the server did
        not answer: nothing is known about the object)."""
        pipe = self.client.pipeline(transaction=False)
        for name in names:
            pipe.getrange(self.redis_key(name), 0, bound)
        replies = self._execute(pipe)
        if replies is None:
            return [("busy", None)] * len(names)
        out: list[tuple[str, bytes | None]] = []
        for reply in replies:
            if isinstance(reply, Exception):
                out.append(("refused", None))
            elif not reply:
                out.append(("absent", None))
            elif len(reply) > bound:
                out.append(("oversized", None))
            else:
                out.append(("ok", bytes(reply)))
        return out

    def verify_fetched(self, key: bytes, name: str, status: str, data: bytes | None, decode,
                       bound: int, *, count_busy: bool = True):
        """The directory's load rules on a fetched value: a failure counts one miss (a
        corruption when it was read and did not decode, or is oversized) and prunes the
        object, except when the server did not answer (``count_busy=False``: not even the
        miss). Returns ``decode(data)`` or ``None``."""
        if status != "ok":
            if status == "busy":  # nothing is known about the object: keep it
                if count_busy:
                    self.counters.add("misses")
                return None
            self.counters.add("misses")
            if status == "oversized":
                self.counters.add("corruptions")
                log.warning("cold tier: %s in %s is larger than its bound; pruned", name,
                            self.url)
            self.prune(key, name, None if status == "absent" else ("oversized", str(bound)))
            return None
        assert data is not None
        try:
            result = decode(data)
        except FormatError as exc:
            self.counters.add("misses")
            self.counters.add("corruptions")
            log.warning("cold tier: corrupt object pruned from %s: %s", self.url, exc)
            self.prune(key, name, ("digest", hashlib.sha1(data).hexdigest()))
            return None
        if result is None:
            self.counters.add("misses")
            return None
        self.index.touch(key, time.time_ns())  # the server's LRU clock moved with the read
        if self.fill_sink is not None:
            parsed = parse_object_name(name)
            if parsed is not None:
                self.fill_sink(key, parsed[1], data)
        return result

    def prune(self, key: bytes, name: str, still: tuple[str, str] | None) -> None:
        """De-index ``name`` and, with ``still``, delete it if it still holds what failed:
        ``("digest", sha1 hex)`` of a value that did not decode, ``("oversized", bound)``
        of one larger than its bound (a value of another type is deleted outright)."""
        if still is not None:
            try:
                self._prune_script(keys=[self.redis_key(name)], args=list(still))
            except Exception as exc:  # noqa: BLE001 - a failed prune is retried by the next load
                log.warning("cold tier: cannot prune %s in %s: %s", name, self.url, exc)
        with self.index.lock:
            entry = self.index.get(key)
            if entry is not None and entry.file_name == name:
                self.index.remove(key)

    def _decode_block(self, key: bytes, name: str, fingerprint_hex: str,
                      expected: BlockGeometry):
        return lambda data: decode_block(
            data, abi=self.fmt.abi, checksum_tag=self.payload_tag, key_hex=key.hex(),
            fingerprint_hex=fingerprint_hex, expected=expected, path=self.redis_key(name))

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None:
        """One round trip, then the fail-closed decode; ``None`` is a counted miss."""
        name = object_name(key, ColdGroup.KV)
        status, data = self.fetch([name], expected.bound)[0]
        return self.verify_fetched(key, name, status, data,
                                   self._decode_block(key, name, fingerprint_hex, expected),
                                   expected.bound)

    def load_sidecar(self, key: bytes, layout, *, fingerprint_hex: str,
                     buffer: bytearray | None = None):
        name = object_name(key, layout.group)
        status, data = self.fetch([name], layout.bound)[0]

        def decode(data):
            fields, payload = decode_sidecar(
                data, abi=self.fmt.abi, checksum_tag=self.payload_tag,
                group=layout.group.label, key_hex=key.hex(), fingerprint_hex=fingerprint_hex,
                bound=layout.bound, path=self.redis_key(name))
            return payload if layout.matches(fields) else None
        return self.verify_fetched(key, name, status, data, decode, layout.bound)

    def chain_source(self, keys: Sequence[bytes], start: int, stop: int,
                     bound: int) -> FetchedChain:
        return FetchedChain(self, keys[start:stop], bound)

    # --- writes --------------------------------------------------------------------------

    def commit(self, key: bytes, group: ColdGroup, chunks: Sequence, size: int) -> bool:
        return self.commit_many([(key, group, chunks, size)])[0]

    def commit_many(self, items: Sequence) -> list[bool]:
        """``SET`` each object in one pipelined round trip. A ``True`` is the server's
        acknowledgement (durable across a server crash when ``durable_acks``). Errors are
        counted in ``write_errors`` and logged, never raised."""
        pipe = self.client.pipeline(transaction=False)
        for key, group, chunks, _ in items:
            pipe.set(self.redis_key(object_name(key, group)),
                     b"".join(memoryview(c).cast("B") for c in chunks))
        replies = self._execute(pipe)
        if replies is None:
            self.counters.add("write_errors", len(items))
            return [False] * len(items)
        oks = []
        now = time.time_ns()
        for (key, group, _, size), reply in zip(items, replies, strict=True):
            if reply is True:
                self.index.put(key, IndexEntry(group, object_name(key, group), size, now))
                self.counters.add("bytes_written", size)
                oks.append(True)
                continue
            oom = isinstance(reply, _out_of_memory_error())
            hint = " (set maxmemory-policy allkeys-lru: docs/cold.md, 'Quota and sizing')" \
                if oom else ""
            self.write_failures.failed(
                f"{type(reply).__name__}{' OOM' if oom else ''}",
                "cold tier: write of %s to %s failed: %s%s%s; later failures of this kind are "
                "counted in write_errors_unlogged", object_name(key, group), self.url,
                "OOM " if oom else "", reply, hint)
            oks.append(False)
        return oks

    # --- offline maintenance -------------------------------------------------------------

    def scan_objects(self, batch: int = 1000):
        """Every ``(redis key, object name, size)`` under the prefix (``SCAN``, then one
        pipelined ``STRLEN`` per batch; a non-string value has size -1)."""
        cursor = 0
        while True:
            cursor, found = self.client.scan(cursor, match=self.prefix + "*", count=batch)
            if found:
                pipe = self.client.pipeline(transaction=False)
                for k in found:
                    pipe.strlen(k)
                sizes = pipe.execute(raise_on_error=False)
                for k, size in zip(found, sizes, strict=True):
                    rk = k.decode("utf-8", "replace")
                    yield rk, rk[len(self.prefix):], size if isinstance(size, int) else -1
            if cursor == 0:
                return

    def evict_to(self, target_bytes: int) -> int:
        """Delete the objects the server read least recently (``OBJECT IDLETIME``) until
        the prefix holds at most ``target_bytes``. Returns the count deleted."""
        objects = list(self.scan_objects())
        total = sum(max(s, 0) for _, _, s in objects)
        if total <= target_bytes:
            return 0
        pipe = self.client.pipeline(transaction=False)
        for rk, _, _ in objects:
            pipe.object("idletime", rk)
        idle = pipe.execute(raise_on_error=False)
        order = sorted(range(len(objects)),
                       key=lambda i: -(idle[i] if isinstance(idle[i], int) else 0))
        evicted = 0
        for i in order:
            if total <= target_bytes:
                break
            rk, _, size = objects[i]
            evicted += int(self.client.delete(rk))
            total -= max(size, 0)
        self.counters.add("evictions", evicted)
        self.index.rebuild([])
        return evicted

    def remove_quarantine(self) -> int:
        """Nothing is quarantined in Redis: a bad object is deleted. Returns 0."""
        return 0

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.write_failures.flush()
            self.client.close()

    # --- server health -------------------------------------------------------------------

    def _execute(self, pipe) -> list | None:
        """``pipe``'s replies, or ``None`` when the server did not answer. While it is down
        only one round trip per retry interval (1 s, doubling to 30 s while it stays down)
        is tried; every other one is ``None`` at once, so a hung or unreachable server
        costs one timeout per interval, not one per load, probe and commit."""
        with self._health_lock:
            if self._down:
                now = time.monotonic()
                if now < self._retry_at:
                    return None
                self._retry_at = now + self._retry_s  # this caller tries; the rest skip
        try:
            replies = pipe.execute(raise_on_error=False)
        except _client_errors() as exc:
            self._report_down(exc)
            return None
        self._report_up()
        return replies

    def _report_down(self, exc: Exception) -> None:
        with self._health_lock:
            if self._down:
                self._retry_s = min(self._retry_s * 2, DOWN_RETRY_MAX_S)
            else:
                self._down = True
                self._retry_s = DOWN_RETRY_S
                log.warning("cold tier: %s does not answer (%s); loads are misses and writes "
                            "fail until it does", self.url, exc)
            self._retry_at = time.monotonic() + self._retry_s

    def _report_up(self) -> None:
        with self._health_lock:
            if self._down:
                self._down = False
                log.warning("cold tier: %s answers again", self.url)


class FetchedChain:
    """One restore walk's blocks from Redis: fetched in pipelined windows (each one round
    trip of at most ``fetch_window_bytes`` of bounds) when the first block of a window is
    asked for, then verified by the caller's thread, each object once."""

    def __init__(self, store: RedisColdStore, keys: Sequence[bytes], bound: int) -> None:
        self.store = store
        self.keys = list(keys)
        self.bound = bound
        self.position = {k: i for i, k in enumerate(self.keys)}
        self.per_window = max(1, store.fetch_window_bytes // max(1, bound))
        self.fetched: dict[int, tuple[str, bytes | None]] = {}
        self.windows_done: set[int] = set()
        self.lock = threading.Lock()

    def _take(self, idx: int) -> tuple[str, bytes | None, bool]:
        """``(status, data, first)``: ``first`` is whether ``idx`` opens its window (the
        block a walk stops at when the whole window was lost)."""
        window = idx // self.per_window
        with self.lock:
            if window not in self.windows_done:
                self.windows_done.add(window)
                if self.store.fetch_hook is not None:
                    self.store.fetch_hook(window)
                lo = window * self.per_window
                names = [object_name(k, ColdGroup.KV)
                         for k in self.keys[lo:lo + self.per_window]]
                for j, got in enumerate(self.store.fetch(names, self.bound)):
                    self.fetched[lo + j] = got
            status, data = self.fetched.pop(idx, ("busy", None))
            return status, data, idx == window * self.per_window

    def load_block(self, key: bytes, *, fingerprint_hex: str, expected: BlockGeometry,
                   buffer: bytearray | None = None) -> DecodedBlock | None:
        idx = self.position.get(key)
        if idx is None:
            return self.store.load_block(key, fingerprint_hex=fingerprint_hex,
                                         expected=expected)
        status, data, first = self._take(idx)
        name = object_name(key, ColdGroup.KV)
        # A window the server did not deliver is one miss (where the walk stops), not one
        # per block loaded ahead.
        return self.store.verify_fetched(
            key, name, status, data,
            self.store._decode_block(key, name, fingerprint_hex, expected), self.bound,
            count_busy=first)


def _tcp_accepts(url: str, timeout_s: float = 1.0) -> bool:
    """Whether ``url``'s host and port accept a plain TCP connection."""
    import socket
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "localhost", parts.port or 6379),
                                 timeout_s).close()
        return True
    except OSError:
        return False


def _connect_error(shown: str, url: str, exc: BaseException) -> ColdBackendError:
    """The error for a failed first ``PING``: a TLS mismatch when the port accepts TCP but
    the TLS handshake (``rediss://``) or the plain protocol (``redis://``) failed."""
    text = str(exc)
    low = text.lower()
    scheme = urlsplit(url).scheme
    if scheme == "rediss" and (any(w in low for w in ("ssl", "tls", "wrong version", "eof"))
                               or _tcp_accepts(url)):
        return ColdBackendTLSError(
            f"cold backend {shown}: the TLS handshake failed ({text}); the server does not "
            "speak TLS on this port or its certificate is not trusted: use redis:// for a "
            "plain server, or pass ssl_ca_certs=... in the URL query")
    if scheme == "redis" and any(w in low for w in ("closed", "reset", "ssl")) \
            and _tcp_accepts(url):
        return ColdBackendTLSError(
            f"cold backend {shown}: the server closed a plain connection ({text}); a "
            "TLS-only server needs rediss://")
    # The URL may come from PAGEDKV_COLD_BACKEND, `pagedkv cold BASE`, `pagedkv demo
    # --cold-backend` or open_at(remote=): the caller names where it came from.
    return ColdBackendError(f"cold backend {shown} is unreachable ({text}); start the "
                            "server or fix host, port and db in the URL")


def _server_limits(client, shown: str) -> tuple[int, bool]:
    """``(maxmemory, durable_acks)`` from ``CONFIG GET``; a server that refuses CONFIG
    (managed services) gives ``(0, False)``. Warns when the eviction policy would never
    evict pagedkv's keys (they carry no TTL)."""
    try:
        conf = client.config_get("maxmemory*")
        conf.update(client.config_get("append*"))
    except Exception:  # noqa: BLE001 - CONFIG is often disabled on managed servers
        return 0, False
    maxmemory = int(conf.get("maxmemory", 0) or 0)
    policy = conf.get("maxmemory-policy", "")
    if maxmemory and not policy.startswith("allkeys-"):
        log.warning("cold tier: %s has maxmemory %d with policy %r, which never evicts "
                    "pagedkv's keys (no TTL): writes will fail once it is full; set "
                    "maxmemory-policy allkeys-lru", shown, maxmemory, policy)
    durable = conf.get("appendonly") == "yes" and conf.get("appendfsync") == "always"
    return maxmemory, durable

"""``pagedkv cold``: inspect, verify and trim a cold-tier root (docs/contracts/cold-tier.md, '9.
Loads and corruption' to '10. Quota and eviction').

``[BASE]`` is a base directory like ``PAGEDKV_COLD_CACHE_DIR``: the tier is
``<BASE>/pagedkv-v1`` (default base: ``PAGEDKV_COLD_CACHE_DIR`` or ``~/.pagedkv/cache``), or a
fleet's Redis/Valkey URL (``redis://host:port/db``; without BASE, ``PAGEDKV_COLD_BACKEND``
when it names one).
Without ``BASE``, when that default holds no tier but ``pagedkv demo``'s directory in the
working directory does, ``stats`` and ``verify`` look there and say so: a new user runs the
demo, then ``pagedkv cold stats``, and sees what the demo persisted.
"""

from __future__ import annotations

import argparse
import re
import sys

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes, or a number with a K, M, G or T suffix (1024-based): ``512M`` → 536870912."""
    # "iB" only after a unit letter: "10KiB" is 10240, "10iB" is refused
    m = re.fullmatch(r"\s*([0-9]+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", text, flags=re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"SIZE {text!r} is not bytes or a number with a K, M, G or T suffix (e.g. 512M)")
    return int(m.group(1)) * _SUFFIX[(m.group(2) or "").upper()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("cold", help="inspect, verify and trim the cold-tier cache on disk")
    cold = p.add_subparsers(dest="cold_command", metavar="ACTION", required=True)
    base_help = "base directory; the tier is BASE/pagedkv-v1 (default: $PAGEDKV_COLD_CACHE_DIR " \
                "or ~/.pagedkv/cache); or a redis://host:port/db URL (default when set: " \
                "$PAGEDKV_COLD_BACKEND)"
    s = cold.add_parser("stats", help="objects, bytes per group, quota and reserve")
    s.add_argument("base", nargs="?", metavar="BASE", help=base_help)
    s.set_defaults(func=run_stats)
    v = cold.add_parser("verify", help="re-decode every object; exit 1 if any is bad")
    v.add_argument("base", nargs="?", metavar="BASE", help=base_help)
    v.add_argument("--prune", action="store_true",
                   help="rename each bad object to .blocked.<name>.<pid>.<ns> (quarantine); "
                        "on Redis, delete it")
    v.set_defaults(func=run_verify)
    e = cold.add_parser("evict", help="delete quarantine, then evict least-recently-read "
                                      "objects until the tier holds at most SIZE")
    e.add_argument("base", nargs="?", metavar="BASE", help=base_help)
    e.add_argument("--to", required=True, type=parse_size, metavar="SIZE",
                   help="target size: bytes or with a K/M/G/T suffix (1024-based)")
    e.set_defaults(func=run_evict)


#: A BASE that reads as a URL, not a path: a scheme-like word followed by ``:/``, ``//``
#: (``redis//host``, a missing colon) or ``:...@``, or a ``//user:password@`` userinfo
#: anywhere. Such a BASE is shown through ``redacted_url`` in every message; any other path
#: is shown as it is (``redacted_url`` would hide the part before an ``@`` of a plain path).
_URLISH = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]+(?::/|//|:[^/]*@)|.*//[^/@]*:[^/]*@",
                     re.DOTALL)
#: A Redis scheme with the wrong separator: ``redis//``, ``rediss:``, ``unix/``...
_SCHEME_TYPO = re.compile(r"\s*(rediss|redis|unix)\s*(?::/{0,2}|/{1,2})(.*)",
                          re.DOTALL | re.IGNORECASE)


def looks_like_url(base: str) -> bool:
    """Whether ``base`` reads as a URL (possibly mistyped, possibly with a password)
    rather than a directory: what decides whether messages show it redacted."""
    return _URLISH.match(base) is not None


def shown_base(base: str) -> str:
    """``base`` as a message shows it: without its password when it reads as a URL."""
    from pagedkv.cold.redis_store import redacted_url
    return redacted_url(base) if looks_like_url(base) else base


def _not_a_url(base: str) -> str:
    """The message for a URL-like BASE that is no Redis URL and no existing path."""
    from pagedkv.cold.redis_store import redacted_url
    typo = _SCHEME_TYPO.fullmatch(base)
    if typo is not None:
        scheme, rest = typo.group(1).lower(), typo.group(2).lstrip("/")
        fixed = redacted_url(f"{scheme}:///{rest}" if scheme == "unix" else
                             f"{scheme}://{rest}")
        hint = f"did you mean {fixed!r}?"
    else:
        hint = "the cold tier takes a redis://host:port/db, rediss://... or " \
               "unix:///path?db=N URL, or a directory"
    return f"BASE {shown_base(base)!r} is not a redis:// URL ({hint}) and no directory " \
           "of that name exists"


def _missing_tier(base: str, child: str) -> str | None:
    """Why ``base`` holds no tier to inspect, or ``None``. The offline commands never create
    a root: a typo must not silently report an empty tier (and leave a directory behind)."""
    import os
    tier = os.path.join(base, child)
    shown = shown_base(base)
    if not os.path.lexists(base):
        if looks_like_url(base):
            return _not_a_url(base)
        return f"BASE {shown!r} does not exist; pass the directory a serving process used " \
               "as PAGEDKV_COLD_CACHE_DIR (the tier is BASE/pagedkv-v1)"
    if not os.path.isdir(base):
        return f"BASE {shown!r} is not a directory; pass the directory that holds pagedkv-v1"
    if not os.path.lexists(tier):
        return f"BASE {shown!r} holds no cold tier ({child!r} is missing); pass the " \
               "directory a serving process used as PAGEDKV_COLD_CACHE_DIR"
    return None


def _scrubbed(text: str, base: str | None) -> str:
    """``text`` with a URL-like ``base`` (raw or as repr shows it) replaced by its redacted
    form: a message of the store (its root path) must not carry the password either."""
    if not base or not looks_like_url(base):
        return text
    shown = shown_base(base)
    for raw, safe in ((base, shown), (repr(base)[1:-1], repr(shown)[1:-1])):
        text = text.replace(raw, safe)
    return text


def _demo_base(child: str) -> str | None:
    """``pagedkv demo``'s default cold dir when it holds a tier, else ``None``."""
    from pagedkv.cli import demo_restart
    base = demo_restart.DEFAULT_COLD_DIR
    return base if _missing_tier(base, child) is None else None


def _open(args, *, quarantine_unowned: bool = False, demo_fallback: bool = False):
    from pagedkv.cold.knobs import cold_backend_url, cold_cache_base
    from pagedkv.cold.offline import open_offline_store
    from pagedkv.cold.redis_store import RedisColdStore, is_redis_url
    from pagedkv.cold.root import MANAGED_CHILD
    from pagedkv.errors import PagedKVError
    url = args.base if is_redis_url(args.base) else (None if args.base else cold_backend_url())
    if url is not None:
        try:
            return RedisColdStore.open(url)
        except PagedKVError as exc:
            source = "" if args.base else " (the URL is PAGEDKV_COLD_BACKEND's)"
            print(f"pagedkv cold: {exc}{source}", file=sys.stderr)
            return None
    base = args.base if args.base else cold_cache_base()
    problem = _missing_tier(base, MANAGED_CHILD)
    if problem is not None and not args.base:
        demo_base = _demo_base(MANAGED_CHILD)
        if demo_base is not None and demo_fallback:
            print(f"pagedkv cold: no tier in the default {base!r}; showing the `pagedkv demo` "
                  f"tier in {demo_base!r}", file=sys.stderr)
            base, problem = demo_base, None
        elif demo_base is not None:
            problem += f" (the `pagedkv demo` tier is in {demo_base!r}: pass it as BASE)"
    if problem is not None:
        print(f"pagedkv cold: {problem}", file=sys.stderr)
        return None
    try:
        return open_offline_store(base, child=MANAGED_CHILD,
                                  quarantine_unowned=quarantine_unowned)
    except PagedKVError as exc:
        print(f"pagedkv cold: {_scrubbed(str(exc), base)}", file=sys.stderr)
        return None


def _mib(n: int) -> str:
    return f"{n} B ({n / 2**20:.2f} MiB)"


def _is_remote(store) -> bool:
    from pagedkv.cold.redis_store import RedisColdStore
    return isinstance(store, RedisColdStore)


def _server_errors() -> tuple[type[BaseException], ...]:
    """What a Redis round trip raises when the server stops answering (or refuses a
    command) after the open: one line and exit 2, like a server unreachable at open."""
    try:
        import redis
    except ImportError:
        return ()
    return (redis.exceptions.RedisError,)


def _server_failed(store, action: str, exc: BaseException) -> int:
    print(f"pagedkv cold: {store.url} failed during {action} ({exc}); what came after it "
          "was not done", file=sys.stderr)
    return 2


def run_stats(args: argparse.Namespace) -> int:
    from pagedkv.cold.offline import root_summary
    from pagedkv.cold.redis_offline import remote_summary
    store = _open(args, demo_fallback=True)
    if store is None:
        return 2
    remote = _is_remote(store)
    try:
        s = remote_summary(store) if remote else root_summary(store)
    except _server_errors() as exc:
        return _server_failed(store, "stats", exc)
    finally:
        store.close()
    print(f"root: {_scrubbed(str(s.root), args.base)}")
    print(f"objects: {sum(s.objects.values())}  total: {_mib(s.total_bytes)}")
    for label, n in s.objects.items():
        print(f"  {label:<15} {n:>8} objects  {_mib(s.bytes_by_group[label])}")
    if remote:
        print(f"quota (the server's maxmemory; 0 = unlimited): {_mib(s.quota_bytes)}")
        if s.unowned:
            print(f"keys under the prefix that are no object (never loaded): {s.unowned}")
    else:
        print(f"quota: {_mib(s.quota_bytes)}  reserve (free space kept): "
              f"{_mib(s.reserve_bytes)}")
        print(f"quarantined entries: {s.quarantined}  writer temp files: {s.writer_temps}")
    if s.unowned and not remote:
        print(f"names sharing a key the index owns (not counted; quarantined by the next "
              f"open or `pagedkv cold evict`): {s.unowned}")
    from pagedkv.cold.knobs import metrics_dir
    from pagedkv.cold.offline import trace_counters
    traced = trace_counters(metrics_dir())
    if traced is None:
        print(f"counters: no turn trace in {metrics_dir()} (counters live in the serving "
              "process: cold_cache_stats())")
    else:
        name, totals = traced
        print(f"counters of the last traced process ({name}):")
        print("  " + "  ".join(f"{k}={v}" for k, v in totals.items()))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from pagedkv.cold.offline import verify_store
    from pagedkv.cold.redis_offline import verify_remote
    store = _open(args, demo_fallback=not args.prune)
    if store is None:
        return 2
    remote = _is_remote(store)
    try:
        result = verify_remote(store, prune=args.prune) if remote \
            else verify_store(store, prune=args.prune)
    except _server_errors() as exc:
        return _server_failed(store, "verify", exc)
    finally:
        store.close()
    for b in result.bad:
        note = ""
        if b.quarantined:
            note = "  (deleted)" if remote else "  (quarantined)"
        elif b.prune_error is not None:
            note = f"  (NOT quarantined: {b.prune_error})"
        print(f"BAD {b.name}: {b.reason}{note}")
    n_bad = len(result.bad)
    # An object a live server evicted or replaced during the scan is not a bad object.
    vanished = f", {result.vanished} vanished during the scan" if result.vanished else ""
    print(f"verified {result.checked} objects: {result.checked - n_bad - result.vanished} ok, "
          f"{n_bad} bad{vanished}")
    return 1 if n_bad else 0


def run_evict(args: argparse.Namespace) -> int:
    store = _open(args, quarantine_unowned=True)  # then deleted with the rest of quarantine
    if store is None:
        return 2
    try:
        removed = store.remove_quarantine()
        if _is_remote(store):
            from pagedkv.cold.redis_offline import remote_summary
            before = remote_summary(store).total_bytes
            evicted = store.evict_to(args.to)
            after = remote_summary(store).total_bytes
        else:
            before = store.index.total_bytes
            evicted = store.evict_to(args.to)
            after = store.index.total_bytes
    except _server_errors() as exc:
        return _server_failed(store, "evict", exc)
    finally:
        store.close()
    print(f"removed {removed} quarantined entries; evicted {evicted} objects: "
          f"{_mib(before)} -> {_mib(after)} (target {_mib(args.to)})")
    return 0 if after <= args.to else 1

"""Per-turn JSONL delta trace (docs/contracts/cold-tier.md, '12. Per-turn JSONL delta trace').

One appended JSON line per successful turn in ``<dir>/<YYYY-MM-DD>-<pid>.jsonl`` (dir:
``PAGEDKV_METRICS_DIR``, default ``~/.pagedkv/metrics/traces``; off with
``PAGEDKV_METRICS=0``). The host supplies the turn fields; pagedkv adds the deltas of every
cold counter since its previous record. Never raises (a failure is logged once). The
directory and the file follow the cold root's rules (no symlinks, owned by this user, 0700
directory, 0600 file): see ``TurnTraceWriter._append``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import stat
import threading
import time

from pagedkv.argument_checks import is_int
from pagedkv.cold.knobs import metrics_dir, metrics_enabled
from pagedkv.cold.root import open_managed_root
from pagedkv.cold.stats import SIDECAR_COUNTERS, cold_sidecar_stats
from pagedkv.cold.tier import cold_cache_stats
from pagedkv.errors import InvalidArgument

__all__ = ["HOST_FIELDS", "TurnTraceWriter"]

log = logging.getLogger("pagedkv.cold")

HOST_FIELDS = ("v", "trace_id", "ts_ms", "model", "duration_ms", "prompt_tokens",
               "cached_tokens", "output_tokens")
_OPTIONAL_HOST_FIELDS = ("session_id", "ttft_ms", "prefill_tps", "decode_tps")
_TOTALS = ("corruptions", "queue_drops", "write_errors")
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                 | getattr(os, "O_CLOEXEC", 0))


class TurnTraceWriter:
    """Appends one record per turn; ``tier`` defaults to the shared tier."""

    def __init__(self, directory: str | None = None, *, tier=None,
                 enabled: bool | None = None) -> None:
        self.enabled = metrics_enabled() if enabled is None else bool(enabled)
        self.directory = directory if directory is not None else metrics_dir()
        self.tier = tier
        self._lock = threading.Lock()
        self._last_cold = self._cold_counters()
        self._last_sidecar = dataclasses.asdict(cold_sidecar_stats())
        self._warned = False

    def __repr__(self) -> str:
        return f"TurnTraceWriter(directory={self.directory!r}, enabled={self.enabled})"

    def _cold_counters(self) -> dict:
        s = dataclasses.asdict(cold_cache_stats(self.tier))
        return s

    def path(self) -> str:
        day = time.strftime("%Y-%m-%d", time.localtime())
        return os.path.join(self.directory, f"{day}-{os.getpid()}.jsonl")

    def _append(self, line: bytes) -> None:
        """Append ``line`` to today's file under the cold root's rules: the directory is
        opened without following a final symlink, owned by this user and made 0700
        (created so when missing); the file is opened relative to it with ``O_NOFOLLOW``
        and must be a regular file of ours with one link. So a symlink or hard link planted
        in a shared metrics directory cannot make the server append to another file."""
        dir_fd = open_managed_root(self.directory, None, what="metrics dir")
        try:
            name = os.path.basename(self.path())
            fd = os.open(name, _APPEND_FLAGS, 0o600, dir_fd=dir_fd)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() \
                        or st.st_nlink != 1:
                    raise InvalidArgument(
                        f"trace file {os.path.join(self.directory, name)!r} is not a regular "
                        f"file of this user with one link (uid {st.st_uid}, "
                        f"{st.st_nlink} links); remove it")
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def record(self, fields: dict) -> dict | None:
        """Append ``fields`` plus the cold deltas; returns the written record (``None`` when
        disabled or on failure)."""
        try:
            with self._lock:
                cold = self._cold_counters()
                sidecar = dataclasses.asdict(cold_sidecar_stats())
                out = {k: fields[k] for k in HOST_FIELDS + _OPTIONAL_HOST_FIELDS if k in fields}
                for name, value in cold.items():
                    if is_int(value) \
                            and name != "quota_bytes":
                        out[f"cold_{name}"] = value - self._last_cold.get(name, 0)
                for name in SIDECAR_COUNTERS:
                    out[f"cold_sidecar_{name}"] = sidecar[name] - self._last_sidecar[name]
                out["cold_enabled"] = bool(cold["enabled"])
                out["cold_root"] = cold["root"] if cold["enabled"] else ""
                for name in _TOTALS:
                    out[f"cold_{name}_total"] = cold[name]
                for k, v in list(out.items()):
                    if isinstance(v, float) and not math.isfinite(v):
                        del out[k]  # finite numbers only
                self._last_cold, self._last_sidecar = cold, sidecar
                if not self.enabled:
                    return None
                line = json.dumps(out, separators=(",", ":"), allow_nan=False) + "\n"
                self._append(line.encode("utf-8"))
                return out
        except Exception as exc:  # noqa: BLE001 - a trace must never break a turn
            if not self._warned:
                self._warned = True
                log.warning("cold tier: turn trace disabled after an error: %s", exc)
            return None

"""Per-turn JSONL delta trace (cold-tier.md §12).

One appended JSON line per successful turn in ``<dir>/<YYYY-MM-DD>-<pid>.jsonl`` (dir:
``PAGEDKV_METRICS_DIR``, default ``~/.pagedkv/metrics/traces``; off with
``PAGEDKV_METRICS=0``). The host supplies the turn fields; pagedkv adds the deltas of every
cold counter since its previous record. Never raises (a failure is logged once).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import threading
import time

from pagedkv.cold.knobs import metrics_dir, metrics_enabled
from pagedkv.cold.stats import SIDECAR_COUNTERS, cold_sidecar_stats
from pagedkv.cold.tier import cold_cache_stats

__all__ = ["HOST_FIELDS", "TurnTraceWriter"]

log = logging.getLogger("pagedkv.cold")

HOST_FIELDS = ("v", "trace_id", "ts_ms", "model", "duration_ms", "prompt_tokens",
               "cached_tokens", "output_tokens")
_OPTIONAL_HOST_FIELDS = ("session_id", "ttft_ms", "prefill_tps", "decode_tps")
_TOTALS = ("corruptions", "queue_drops", "write_errors")


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

    def record(self, fields: dict) -> dict | None:
        """Append ``fields`` plus the cold deltas; returns the written record (``None`` when
        disabled or on failure)."""
        try:
            with self._lock:
                cold = self._cold_counters()
                sidecar = dataclasses.asdict(cold_sidecar_stats())
                out = {k: fields[k] for k in HOST_FIELDS + _OPTIONAL_HOST_FIELDS if k in fields}
                for name, value in cold.items():
                    if isinstance(value, int) and not isinstance(value, bool) \
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
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                line = json.dumps(out, separators=(",", ":"), allow_nan=False) + "\n"
                with open(self.path(), "a", encoding="utf-8") as f:
                    f.write(line)
                return out
        except Exception as exc:  # noqa: BLE001 - a trace must never break a turn
            if not self._warned:
                self._warned = True
                log.warning("cold tier: turn trace disabled after an error: %s", exc)
            return None

"""``PAGEDKV_*`` knobs of the cold tier (docs/contracts/cold-tier.md, '14. Knobs'; parsing as
docs/contracts/paged-kv.md, '6.3 Knobs and precedence').

A set and parseable env value wins over the config field; an unparseable one is ignored
with one WARNING naming the variable, the value, the accepted syntax and the value used.
"""

from __future__ import annotations

import logging
import os

from pagedkv import env_knobs

__all__ = [
    "DEFAULT_CAPTURE_BLOCKS_PER_TURN",
    "DEFAULT_CAPTURE_BUDGET_MS",
    "DEFAULT_QUEUE_DEPTH",
    "capture_budget_from_env",
    "cold_backend_url",
    "cold_cache_base",
    "env_bool",
    "env_positive_int",
    "install_default_capture_budget",
    "metrics_dir",
    "metrics_enabled",
    "sliding_checkpoint_limit_override",
]

log = logging.getLogger("pagedkv.cold")

DEFAULT_CAPTURE_BLOCKS_PER_TURN = 128
DEFAULT_CAPTURE_BUDGET_MS = 250
DEFAULT_QUEUE_DEPTH = 8


def env_bool(var: str, fallback: bool | None) -> bool | None:
    """The env value of ``var`` if set and parseable, else ``fallback`` (docs/contracts/paged-kv.md,
    '6.3 Knobs and precedence')."""
    return env_knobs.env_bool(var, fallback, fallback_source="config or default")


def env_positive_int(var: str, fallback: int) -> int:
    """A base-10 integer in ``[1, 2**32)`` from ``var``, else ``fallback`` (logged)."""
    value = env_knobs.env_u32(var, fallback, fallback_source="config or default")
    if value == 0:
        log.warning("ignoring %s=0: expected a positive integer; using %r", var, fallback)
        return fallback
    return value


def cold_cache_base(config_dir: str | None = None) -> str:
    """``PAGEDKV_COLD_CACHE_DIR`` if set and non-blank, else the config, else
    ``~/.pagedkv/cache``. The tier itself lives in ``<base>/pagedkv-v1``."""
    raw = os.environ.get("PAGEDKV_COLD_CACHE_DIR")
    if raw is not None and raw.strip():
        return raw.strip()
    if config_dir:
        return config_dir
    return os.path.join(os.path.expanduser("~"), ".pagedkv", "cache")


def cold_backend_url() -> str | None:
    """``PAGEDKV_COLD_BACKEND`` when set to a ``redis://``/``rediss://``/``unix://`` URL
    (the fleet's store behind the local directory), else ``None``. Another non-blank value
    is ignored with one WARNING."""
    from pagedkv.cold.redis_store import is_redis_url, redacted_url
    raw = os.environ.get("PAGEDKV_COLD_BACKEND")
    if raw is None or not raw.strip() or raw.strip() in ("dir", "local"):
        return None
    if is_redis_url(raw):
        return raw.strip()
    log.warning("ignoring PAGEDKV_COLD_BACKEND=%r: expected redis://host:port/db, "
                "rediss://... or unix://path; using the local directory alone",
                redacted_url(raw))
    return None


_installed_budget: tuple[int, int] | None = None


def install_default_capture_budget(blocks: int, budget_ms: int) -> tuple[int, int]:
    """Test hook: the budget later tiers open with, ahead of env and config."""
    global _installed_budget
    _installed_budget = (int(blocks), int(budget_ms))
    return _installed_budget


def capture_budget_from_env(blocks: int | None = None, budget_ms: int | None = None
                            ) -> tuple[int, int]:
    """``(blocks_per_turn, budget_ms)``: env, then config, then the defaults (128, 250)."""
    if _installed_budget is not None:
        return _installed_budget
    return (env_positive_int("PAGEDKV_COLD_CAPTURE_BLOCKS_PER_TURN",
                             blocks or DEFAULT_CAPTURE_BLOCKS_PER_TURN),
            env_positive_int("PAGEDKV_COLD_CAPTURE_BUDGET_MS",
                             budget_ms or DEFAULT_CAPTURE_BUDGET_MS))


def metrics_enabled() -> bool:
    return bool(env_bool("PAGEDKV_METRICS", True))


def metrics_dir() -> str:
    raw = os.environ.get("PAGEDKV_METRICS_DIR")
    if raw is not None and raw.strip():
        return raw.strip()
    return os.path.join(os.path.expanduser("~"), ".pagedkv", "metrics", "traces")


def sliding_checkpoint_limit_override() -> int | None:
    """``PAGEDKV_SLIDING_CHECKPOINT_LIMIT`` as a positive integer, else ``None`` (the computed
    ``base_limit`` of :func:`pagedkv.cold.ladder.sliding_base_limit`); an unparseable or zero
    value is ignored with one WARNING."""
    value = env_knobs.env_u32("PAGEDKV_SLIDING_CHECKPOINT_LIMIT", None,
                           fallback_source="the computed limit")
    if value == 0:
        log.warning("ignoring PAGEDKV_SLIDING_CHECKPOINT_LIMIT=0: expected a positive integer; "
                    "using the computed limit")
        return None
    return value

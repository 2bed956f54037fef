"""Pool sizing, the grow-on-demand policy and the ``PAGEDKV_*`` knobs (docs/contracts/paged-kv.md,
'5.4 Sizing from MB' and '6. Grow policy and sizing knobs').

Sizes are in MiB (``mb`` = 2**20 bytes) and blocks. At load the pool is sized in two steps:
the **max** (``memory_mb``, else one full-context sequence, optionally clamped to live
memory) and the **initial** size (``initial_memory_mb``, clamped to the max; unset = the
max, a fixed pool). A reservation that outruns free + evictable blocks grows the pool to
:func:`grow_target` first; :class:`ReservationGrowth` enforces "one grow before the
allocation loop plus one retry".

Environment variables win over config fields when set and parseable; an unparseable value
is ignored with one WARNING on the ``pagedkv`` logger naming the variable, the bad value,
the accepted syntax and the value used instead.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from pagedkv.env_knobs import env_bool, env_u32, parse_bool, parse_u32
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.pool import LayerKVPool, MemoryBudget, PoolGeometry, growth_lock

__all__ = [
    "BLOCK_SIZES",
    "ENV_INITIAL_MB",
    "ENV_MEMORY_MB",
    "MIB",
    "PagedCacheConfig",
    "PoolSizing",
    "ReservationGrowth",
    "blocks_for_memory_mb",
    "create_pool",
    "env_bool",
    "env_u32",
    "grow_pool",
    "grow_target",
    "initial_pool_blocks",
    "max_pool_blocks",
    "memory_mb_for_one_sequence",
    "parse_bool",
    "parse_u32",
    "resolve_pool_sizing",
]

logger = logging.getLogger("pagedkv")

MIB = 1 << 20
#: Block sizes (tokens) the config layer accepts; the pool itself takes any positive size.
BLOCK_SIZES = (8, 16, 32)

ENV_MEMORY_MB = "PAGEDKV_PAGED_CACHE_MEMORY_MB"
ENV_INITIAL_MB = "PAGEDKV_PAGED_CACHE_INITIAL_MB"



def _count(name: str, value, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentType(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if value < minimum:
        raise InvalidArgument(f"{name}: {value} is below {minimum}; it must be >= {minimum}")
    return value


# --- MB <-> blocks (docs/contracts/paged-kv.md, '5.4 Sizing from MB') -----------------------------


def blocks_for_memory_mb(mb: int, geometry: PoolGeometry) -> int:
    """Whole blocks in ``mb`` MiB: ``floor(mb * 2**20 / bytes_per_block)``."""
    return _count("mb", mb) * MIB // geometry.bytes_per_block


def memory_mb_for_one_sequence(max_model_len: int, geometry: PoolGeometry) -> int:
    """MiB for the K/V of one ``max_model_len``-token sequence in whole blocks, rounded up:
    the auto max."""
    tokens = _count("max_model_len", max_model_len, minimum=1)
    # Whole blocks, not tokens: a pool holds blocks, and ``blocks_for_memory_mb`` floors, so
    # MiB rounded from the token bytes alone can come back one block short of the sequence
    # when a block is not a divisor of a MiB (28 layers x 8 heads x 128 f16: 1.75 MiB blocks,
    # 4,001 tokens -> 438 MiB -> 250 blocks = 4,000 tokens).
    blocks = -(-tokens // geometry.block_size)
    return -(-blocks * geometry.bytes_per_block // MIB)


def max_pool_blocks(max_mb: int, geometry: PoolGeometry, *,
                    available_memory_bytes: int | Callable[[], int] | None = None) -> int:
    """Max blocks of a ``max_mb`` MiB pool, clamped to ``available_memory_bytes`` (an int or
    a callable returning one) when given. ``InvalidArgument`` if not one block fits."""
    blocks = blocks_for_memory_mb(max_mb, geometry)
    if available_memory_bytes is not None:
        available = available_memory_bytes() if callable(available_memory_bytes) \
            else available_memory_bytes
        available = _count("available_memory_bytes", available)
        if available // geometry.bytes_per_block < blocks:
            logger.info("paged pool max clamped to live memory: %d -> %d blocks "
                        "(available_bytes=%d)", blocks,
                        available // geometry.bytes_per_block, available)
            blocks = available // geometry.bytes_per_block
    if blocks == 0:
        raise InvalidArgument(
            f"max pool cannot hold one block: {max_mb} MiB"
            + (f" (clamped to {available} available bytes)" if available_memory_bytes is not None
               else "")
            + f" < {geometry.bytes_per_block} bytes per block; raise memory_mb "
            f"({ENV_MEMORY_MB})")
    return blocks


def initial_pool_blocks(initial_mb: int | None, max_mb: int, max_blocks: int,
                        geometry: PoolGeometry) -> int:
    """Blocks allocated at load (docs/contracts/paged-kv.md, '6.2 Two-step sizing at load'): unset →
    ``max_blocks`` (a fixed pool); otherwise
    ``min(blocks_for_memory_mb(min(initial_mb, max_mb)), max_blocks)``. An initial size
    below one block (an explicit 0 included) raises ``InvalidArgument``."""
    max_blocks = _count("max_blocks", max_blocks, minimum=1)
    if initial_mb is None:
        return max_blocks
    mb = min(_count("initial_mb", initial_mb), _count("max_mb", max_mb))
    blocks = blocks_for_memory_mb(mb, geometry)
    if blocks == 0:
        raise InvalidArgument(
            f"initial pool cannot hold one block: initial_memory_mb={initial_mb} "
            f"({ENV_INITIAL_MB}) gives {mb} MiB < {geometry.bytes_per_block} bytes per block; "
            "unset it for a fixed pool or raise it")
    return min(blocks, max_blocks)


# --- grow on demand (docs/contracts/paged-kv.md, '6.1 Grow-on-demand') ----------------------------


def grow_target(current: int, needed: int, maximum: int) -> int:
    """``min(maximum, max(2 * current, current + needed))``: at least double, at least enough
    for the reservation, never past the max (blocks)."""
    current = _count("current", current)
    needed = _count("needed", needed)
    maximum = _count("maximum", maximum)
    return min(maximum, max(2 * current, current + needed))


def grow_pool(pool: LayerKVPool, needed: int, grow_allocator: Callable[[int], object]) -> int:
    """Grow ``pool`` to ``grow_target(num_blocks, needed, max_num_blocks)`` and then the
    allocator by the same number of blocks (``grow_allocator(k)``, i.e. ``allocator.grow_by``),
    under the process-wide growth lock. Returns the blocks added (0: at the max, or the
    memory budget refused)."""
    with growth_lock():
        old = pool.num_blocks
        target = grow_target(old, needed, pool.max_num_blocks)
        if target <= old or not pool.grow_to(target, needed=needed):
            return 0
        # Physical first, logical second: the allocator never hands out a block the pool
        # does not have (docs/contracts/paged-kv.md, '5.6 grow_to and generations' ordering).
        grow_allocator(target - old)
        return target - old


class ReservationGrowth:
    """The growth allowance of one reservation (docs/contracts/paged-kv.md, '6.1 Grow-on-demand'):
    one grow before the allocation loop,
    plus one grow for a single retry if the loop still runs dry.

    The adapter creates one per reservation::

        growth = ReservationGrowth(pool, allocator.grow_by)
        growth.before_allocation(needed, allocator.free_or_evictable_blocks)
        blocks = allocator.allocate_many(needed)
        if blocks is None and growth.for_retry(needed):
            blocks = allocator.allocate_many(needed)        # the one retry
        if blocks is None: ...roll back, CapacityExceeded or PoolExhausted

    Both methods return the blocks added (0 when nothing grew) and act at most once each.
    """

    __slots__ = ("_grew_before", "_grew_for_retry", "_grow_allocator", "_pool")

    def __init__(self, pool: LayerKVPool, grow_allocator: Callable[[int], object]) -> None:
        self._pool = pool
        self._grow_allocator = grow_allocator
        self._grew_before = False
        self._grew_for_retry = False

    def __repr__(self) -> str:
        return (f"ReservationGrowth(pool_blocks={self._pool.num_blocks}/"
                f"{self._pool.max_num_blocks}, grew_before={self._grew_before}, "
                f"grew_for_retry={self._grew_for_retry})")

    def before_allocation(self, needed: int, free_or_evictable: int) -> int:
        """Grow iff ``needed > free_or_evictable`` and the pool is below its max: the pool
        grows for the live working set, not to keep cache (when ``needed`` fits into free +
        evictable blocks, LRU cache-only blocks are evicted instead)."""
        needed = _count("needed", needed)
        free_or_evictable = _count("free_or_evictable", free_or_evictable)
        if self._grew_before or needed <= free_or_evictable:
            return 0
        self._grew_before = True
        if self._pool.num_blocks >= self._pool.max_num_blocks:
            return 0
        return grow_pool(self._pool, needed, self._grow_allocator)

    def for_retry(self, remaining: int) -> int:
        """The one mid-loop retry: grow with ``needed = remaining``. The caller retries its
        allocation once iff this returns > 0."""
        remaining = _count("remaining", remaining)
        if self._grew_for_retry or remaining == 0:
            return 0
        self._grew_for_retry = True
        return grow_pool(self._pool, remaining, self._grow_allocator)


@dataclass(frozen=True, slots=True)
class PagedCacheConfig:
    """The paged-cache fields of a model config (docs/contracts/paged-kv.md, '6.3 Knobs and
    precedence'). MiB sizes; ``None`` = unset.

    ``memory_mb``: the max pool (unset: one full-context sequence). ``initial_memory_mb``:
    the pool at load (unset: the max, a fixed pool). ``max_num_seqs`` (capped at 32 by the
    coordinator) and ``watermark_fraction`` are used by the grouped coordinator
    (docs/contracts/paged-kv.md, '8.8 Scheduling contract: admission and preemption' to '8.9 Minimum
    pool budget and admission width').
    """

    block_size: int = 16
    memory_mb: int | None = None
    initial_memory_mb: int | None = None
    max_num_seqs: int = 8
    watermark_fraction: float = 0.01

    def __post_init__(self) -> None:
        block_size = _count("block_size", self.block_size, minimum=1)
        if block_size not in BLOCK_SIZES:
            raise InvalidArgument(f"block_size: {block_size} tokens is not one of {BLOCK_SIZES}")
        for field in ("memory_mb", "initial_memory_mb"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, _count(field, value))
        object.__setattr__(self, "max_num_seqs", _count("max_num_seqs", self.max_num_seqs,
                                                        minimum=1))
        if isinstance(self.watermark_fraction, bool) or not isinstance(
                self.watermark_fraction, (int, float)):
            raise InvalidArgumentType(
                f"watermark_fraction: expected a float, got {self.watermark_fraction!r}")
        if not 0.0 <= self.watermark_fraction < 1.0:  # also refuses NaN
            raise InvalidArgument(
                f"watermark_fraction: {self.watermark_fraction!r} is outside [0, 1); it is the "
                "share of the pool kept free at admission (default 0.01)")

    def with_env(self, environ: Mapping[str, str] | None = None) -> PagedCacheConfig:
        """This config with every set and parseable ``PAGEDKV_*`` knob applied (env wins);
        unparseable values are logged and leave the field as it is."""
        return replace(
            self,
            memory_mb=env_u32(ENV_MEMORY_MB, self.memory_mb, environ=environ,
                              fallback_source="config field memory_mb" if self.memory_mb
                              is not None else "default: one full-context sequence"),
            initial_memory_mb=env_u32(
                ENV_INITIAL_MB, self.initial_memory_mb, environ=environ,
                fallback_source="config field initial_memory_mb" if self.initial_memory_mb
                is not None else "default: unset, initial = max"),
        )


# --- load-time resolution (docs/contracts/paged-kv.md, '6.2 Two-step sizing at load' and '6.4 Load
# and growth logs') ---


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """The resolved sizes of a pool at load: blocks, and the MiB they came from."""

    block_size: int
    initial_blocks: int
    max_blocks: int
    bytes_per_block: int
    max_mb: int
    initial_mb: int | None

    @property
    def dynamic(self) -> bool:
        """True when the pool starts below its max and grows on demand."""
        return self.initial_blocks < self.max_blocks

    @property
    def effective_window_tokens(self) -> int:
        """Tokens the max pool holds: ``max_blocks * block_size``."""
        return self.max_blocks * self.block_size

    def log_load(self) -> None:
        """The load lines of docs/contracts/paged-kv.md, '6.4 Load and growth logs' on the
        ``pagedkv`` logger (INFO)."""
        logger.info("paged pool: block_size=%d initial_blocks=%d max_blocks=%d "
                    "effective_window_tokens=%d bytes_per_block=%d", self.block_size,
                    self.initial_blocks, self.max_blocks, self.effective_window_tokens,
                    self.bytes_per_block)
        if self.dynamic:
            logger.info("paged pool is dynamic (grow-on-demand)")


def resolve_pool_sizing(geometry: PoolGeometry, config: PagedCacheConfig | None = None, *,
                        max_model_len: int | None = None,
                        environ: Mapping[str, str] | None = None,
                        available_memory_bytes: int | Callable[[], int] | None = None
                        ) -> PoolSizing:
    """Resolve initial and max blocks from ``config`` (default ``PagedCacheConfig()``) with
    the env knobs applied. ``max_model_len`` (tokens) sizes the auto max when ``memory_mb``
    is unset. ``available_memory_bytes`` may clamp the max to live memory."""
    config = (PagedCacheConfig() if config is None else config).with_env(environ)
    if config.block_size != geometry.block_size:
        raise InvalidArgument(
            f"geometry.block_size: {geometry.block_size} differs from the config's "
            f"block_size={config.block_size}; build the geometry with the config's block size")
    if config.memory_mb is not None:
        max_mb = config.memory_mb
    elif max_model_len is None:
        raise InvalidArgument(
            f"max_model_len: None, and memory_mb is unset; pass max_model_len (tokens) for the "
            f"one-full-context default or set memory_mb ({ENV_MEMORY_MB})")
    else:
        max_mb = memory_mb_for_one_sequence(max_model_len, geometry)
    max_blocks = max_pool_blocks(max_mb, geometry, available_memory_bytes=available_memory_bytes)
    initial = initial_pool_blocks(config.initial_memory_mb, max_mb, max_blocks, geometry)
    return PoolSizing(block_size=geometry.block_size, initial_blocks=initial,
                      max_blocks=max_blocks, bytes_per_block=geometry.bytes_per_block,
                      max_mb=max_mb, initial_mb=config.initial_memory_mb)


def create_pool(geometry: PoolGeometry, config: PagedCacheConfig | None = None, *,
                max_model_len: int | None = None, backend: str = "numpy",
                memory_budget: MemoryBudget | None = None, pool_id=None,
                environ: Mapping[str, str] | None = None,
                available_memory_bytes: int | Callable[[], int] | None = None,
                device=None) -> LayerKVPool:
    """Resolve the sizing (:func:`resolve_pool_sizing`), log the load lines and build the
    pool at its initial size with its max. ``device``: a ``backend="device"`` pool's GPU
    (default ``open_device()``); ``available_memory_bytes=device.free_memory_bytes`` clamps
    its max to the GPU's free memory."""
    sizing = resolve_pool_sizing(geometry, config, max_model_len=max_model_len, environ=environ,
                                 available_memory_bytes=available_memory_bytes)
    pool = LayerKVPool(geometry, sizing.initial_blocks, sizing.max_blocks, backend=backend,
                       memory_budget=memory_budget, pool_id=pool_id, device=device)
    sizing.log_load()
    return pool


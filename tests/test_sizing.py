"""Sizing, grow policy and env knobs: docs/contracts/paged-kv.md, '5.4 Sizing from MB' and '6. Grow
policy and sizing knobs' and scenarios docs/contracts/paged-kv.md, '9.3 Pool, sizing and growth'
(P1, P2, P6–P9)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from allocator_oracle import BlockAllocator
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.pool import LayerKVPool, MemoryBudget, PoolGeometry
from pagedkv.sizing import (
    ENV_INITIAL_MB,
    ENV_MEMORY_MB,
    PagedCacheConfig,
    ReservationGrowth,
    blocks_for_memory_mb,
    create_pool,
    env_bool,
    env_u32,
    grow_pool,
    grow_target,
    initial_pool_blocks,
    max_pool_blocks,
    memory_mb_for_one_sequence,
    parse_bool,
    parse_u32,
    resolve_pool_sizing,
)

G10 = PoolGeometry(10, 2, 256, 16, "bfloat16")    # 327,680 bytes per block (320 KiB)
G28 = PoolGeometry(28, 4, 128, 32, "bfloat16")


def test_p1_sizing():
    assert G10.bytes_per_block == 327_680
    assert blocks_for_memory_mb(2048, G10) == 6553
    assert 6553 * G10.block_size == 104_848
    assert blocks_for_memory_mb(1, G10) == 3
    assert blocks_for_memory_mb(1024, G28) == 585
    assert blocks_for_memory_mb(0, G10) == 0


def test_p2_one_full_context():
    assert memory_mb_for_one_sequence(262_144, G10) == 5120
    assert blocks_for_memory_mb(5120, G10) == 16_384
    assert memory_mb_for_one_sequence(262_144, PoolGeometry(16, 4, 256, 16, "bfloat16")) == 16_384
    # Rounded up: one token still needs a whole MiB.
    assert memory_mb_for_one_sequence(1, G10) == 1
    with pytest.raises(InvalidArgument, match="max_model_len: 0"):
        memory_mb_for_one_sequence(0, G10)


@pytest.mark.parametrize("max_model_len", [17, 4001, 4095, 32_769])
def test_one_full_context_holds_the_sequence_when_a_block_does_not_divide_a_mib(max_model_len):
    # 1.75 MiB blocks: MiB rounded from the token bytes (4,001 tokens -> 438 MiB) floored back
    # to 250 blocks = 4,000 tokens, so the default pool refused a max_model_len request.
    g = PoolGeometry(28, 8, 128, 16, "float16")
    mb = memory_mb_for_one_sequence(max_model_len, g)
    assert blocks_for_memory_mb(mb, g) * g.block_size >= max_model_len
    sizing = resolve_pool_sizing(g, PagedCacheConfig(), max_model_len=max_model_len, environ={})
    assert sizing.effective_window_tokens >= max_model_len
    with pytest.raises(InvalidArgumentType, match="mb"):
        blocks_for_memory_mb(1.5, G10)


def test_p6_grow_target():
    assert grow_target(100, 30, 1000) == 200
    assert grow_target(100, 250, 1000) == 350
    assert grow_target(600, 10, 1000) == 1000
    assert grow_target(1000, 10, 1000) == 1000
    with pytest.raises(InvalidArgument, match="needed: -1"):
        grow_target(10, -1, 100)


def small_geometry(block_size=4):
    return PoolGeometry(2, 1, 8, block_size, "float16")


def test_p6_grow_on_demand_before_allocating(caplog):
    pool = LayerKVPool(small_geometry(), 4, 16)
    alloc = BlockAllocator(4, 16, block_size=4)
    growth = ReservationGrowth(pool, alloc.grow_by)
    needed = 10  # allocate_suffix_blocks(s, 40) at bs 4
    assert alloc.free_or_evictable_blocks == 4
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert growth.before_allocation(needed, alloc.free_or_evictable_blocks) == 10
    assert pool.num_blocks == 14 and alloc.num_blocks == 14 and pool.generation == 1
    assert alloc.allocate_many(needed).tolist() == list(range(10))
    assert [r.getMessage() for r in caplog.records] == [
        "paged pool grew from=4 to=14 generation=1 needed=10"]
    # One grow per reservation: a second call does nothing even if short again.
    assert growth.before_allocation(30, 0) == 0
    assert pool.num_blocks == 14
    alloc.check_invariants()


def test_p7_evict_before_growing_when_enough():
    pool = LayerKVPool(small_geometry(), 4, 16)
    alloc = BlockAllocator(4, 16, block_size=4)
    tokens = np.arange(12, dtype=np.uint32)
    blocks = alloc.allocate_many(3)
    assert alloc.cache_full_blocks(tokens, blocks) == 3
    alloc.free_many(blocks)  # 3 cache-only + 1 free
    assert alloc.num_free_blocks == 1 and alloc.num_evictable_blocks == 3
    lru_oldest = alloc.lru_hashes()[0]
    growth = ReservationGrowth(pool, alloc.grow_by)
    assert growth.before_allocation(2, alloc.free_or_evictable_blocks) == 0
    got = alloc.allocate_many(2).tolist()
    assert pool.num_blocks == 4 and alloc.num_blocks == 4 and pool.generation == 0
    # The free block first, then the LRU cache-only one (chains are touched deepest first,
    # so the tail block 2 is the oldest).
    assert got == [3, 2]
    assert lru_oldest not in alloc.lru_hashes()
    alloc.check_invariants()


def test_one_grow_plus_one_retry():
    pool = LayerKVPool(small_geometry(), 2, 16)
    added = []
    growth = ReservationGrowth(pool, added.append)
    assert growth.before_allocation(1, 2) == 0          # fits: no grow, allowance kept
    assert growth.before_allocation(3, 2) == 3          # 2 -> max(4, 5) = 5
    assert growth.before_allocation(3, 0) == 0          # once only
    assert growth.for_retry(4) == 5                     # 5 -> max(10, 9) = 10
    assert growth.for_retry(4) == 0                     # one retry only
    assert added == [3, 5] and pool.num_blocks == 10
    # At the max nothing grows, and the allowance is spent.
    full = LayerKVPool(small_geometry(), 4, 4)
    growth = ReservationGrowth(full, added.append)
    assert growth.before_allocation(8, 0) == 0 and growth.for_retry(8) == 0
    assert full.generation == 0 and added == [3, 5]


def test_grow_pool_refused_by_budget_does_not_grow_the_allocator():
    g = small_geometry()  # 256 bytes per block
    budget = MemoryBudget(4 * 256 + 4 * 256)  # 4 blocks + transient 4 more: no room for 8
    pool = LayerKVPool(g, 4, 16, memory_budget=budget)
    calls = []
    assert grow_pool(pool, 1, calls.append) == 0
    assert calls == [] and pool.num_blocks == 4


# --- env knobs (docs/contracts/paged-kv.md, '6.3 Knobs and precedence', P8) -----------------------


@pytest.mark.parametrize("config_mb, env, expected", [
    (None, None, None),
    (64, None, 64),
    (64, "128", 128),
    (None, " 128 ", 128),
    (64, "not-a-number", 64),
    (None, "0", 0),
])
def test_p8_initial_size_resolution(config_mb, env, expected):
    environ = {} if env is None else {ENV_INITIAL_MB: env}
    config = PagedCacheConfig(initial_memory_mb=config_mb).with_env(environ)
    assert config.initial_memory_mb == expected


def test_p8_initial_zero_from_env_fails_at_load():
    with pytest.raises(ValueError, match="initial pool cannot hold one block"):
        create_pool(G10, PagedCacheConfig(memory_mb=2048), environ={ENV_INITIAL_MB: "0"})


@pytest.mark.parametrize("bad", ["not-a-number", "-5", "+5", "1_000", "64MB", "4294967296",
                                 "", "  ", "1.5", "٣"])
def test_unparseable_u32_is_ignored_and_logged(bad, caplog):
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        value = env_u32(ENV_MEMORY_MB, 64, fallback_source="config field memory_mb",
                        environ={ENV_MEMORY_MB: bad})
    assert value == 64
    assert len(caplog.records) == 1
    record = caplog.records[0]
    assert record.levelno == logging.WARNING and record.name == "pagedkv"
    assert record.getMessage() == (
        f"ignoring {ENV_MEMORY_MB}={bad!r}: expected a base-10 integer 0..4294967295 "
        "(no sign, unit or underscores); using 64 (config field memory_mb)")


def test_parsers():
    assert parse_u32("0") == 0 and parse_u32(" 4294967295\n") == 4294967295
    assert parse_u32("007") == 7
    for text, value in [("1", True), ("TRUE", True), (" on ", True), ("Yes", True),
                        ("0", False), ("false", False), ("OFF", False), ("no", False)]:
        assert parse_bool(text) is value
    assert parse_bool("2") is None and parse_bool("enabled") is None


def test_env_wins_over_config_and_garbage_falls_back(caplog):
    config = PagedCacheConfig(memory_mb=512, initial_memory_mb=64)
    env = {ENV_MEMORY_MB: "1024", ENV_INITIAL_MB: "128"}
    assert config.with_env(env) == PagedCacheConfig(memory_mb=1024, initial_memory_mb=128)
    garbage = {ENV_MEMORY_MB: "lots", ENV_INITIAL_MB: "1e3"}
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert config.with_env(garbage) == config
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        (f"ignoring {ENV_MEMORY_MB}='lots': expected a base-10 integer 0..4294967295 (no sign, "
         "unit or underscores); using 512 (config field memory_mb)"),
        (f"ignoring {ENV_INITIAL_MB}='1e3': expected a base-10 integer 0..4294967295 (no sign, "
         "unit or underscores); using 64 (config field initial_memory_mb)"),
    ]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert PagedCacheConfig().with_env({ENV_INITIAL_MB: "x"}).initial_memory_mb is None
    assert caplog.records[0].getMessage().endswith("using None (default: unset, initial = max)")
    assert env_bool("PAGEDKV_SOME_SWITCH", True, environ={}) is True
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        assert env_bool("PAGEDKV_SOME_SWITCH", True, environ={"PAGEDKV_SOME_SWITCH": " off "},
                        fallback_source="config field x") is False
        assert env_bool("PAGEDKV_SOME_SWITCH", True, environ={"PAGEDKV_SOME_SWITCH": "maybe"},
                        fallback_source="config field x") is True
    assert [r.getMessage() for r in caplog.records] == [
        ("ignoring PAGEDKV_SOME_SWITCH='maybe': expected one of 1/true/on/yes or 0/false/off/no "
         "(any case); using True (config field x)")]


def test_the_process_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv(ENV_INITIAL_MB, "96")
    assert PagedCacheConfig().with_env().initial_memory_mb == 96


def test_config_validation():
    with pytest.raises(InvalidArgument, match=r"block_size: 4 tokens is not one of \(8, 16, 32\)"):
        PagedCacheConfig(block_size=4)
    with pytest.raises(InvalidArgument, match="memory_mb: -1"):
        PagedCacheConfig(memory_mb=-1)
    with pytest.raises(InvalidArgumentType, match="initial_memory_mb"):
        PagedCacheConfig(initial_memory_mb=1.5)
    with pytest.raises(TypeError, match="enabled"):  # never read, removed (issue 16)
        PagedCacheConfig(enabled=True)
    with pytest.raises(InvalidArgument, match="max_num_seqs: 0"):
        PagedCacheConfig(max_num_seqs=0)


# --- initial blocks (P9) and load ------------------------------------------------------------


def test_p9_initial_blocks():
    max_blocks = blocks_for_memory_mb(2048, G10)
    assert initial_pool_blocks(None, 2048, max_blocks, G10) == max_blocks
    assert initial_pool_blocks(1, 2048, max_blocks, G10) == 3
    assert initial_pool_blocks(99_999, 2048, max_blocks, G10) == max_blocks
    assert initial_pool_blocks(2048, 2048, 100, G10) == 100      # a clamped max of 100
    with pytest.raises(ValueError, match="initial pool cannot hold one block"):
        initial_pool_blocks(0, 2048, max_blocks, G10)


def test_max_blocks_clamped_to_available_memory():
    assert max_pool_blocks(2048, G10) == 6553
    assert max_pool_blocks(2048, G10, available_memory_bytes=100 * 327_680 + 5) == 100
    assert max_pool_blocks(2048, G10, available_memory_bytes=lambda: 10 ** 12) == 6553
    with pytest.raises(InvalidArgument, match="max pool cannot hold one block"):
        max_pool_blocks(2048, G10, available_memory_bytes=1000)


def test_load_resolution_and_log_lines(caplog):
    g = PoolGeometry(2, 1, 8, 16, "float16")  # 1024 bytes per block
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        pool = create_pool(g, PagedCacheConfig(memory_mb=1, initial_memory_mb=None), environ={})
    assert pool.num_blocks == 1024 and pool.max_num_blocks == 1024
    assert [r.getMessage() for r in caplog.records] == [
        ("paged pool: block_size=16 initial_blocks=1024 max_blocks=1024 "
         "effective_window_tokens=16384 bytes_per_block=1024")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        pool = create_pool(g, max_model_len=4096, environ={ENV_INITIAL_MB: "1"},
                           available_memory_bytes=1 << 40)
    # One full context of 4096 tokens = 4096 * 64 bytes = 256 KiB -> 1 MiB max (rounded up).
    assert pool.num_blocks == 1024 and pool.max_num_blocks == 1024
    sizing = resolve_pool_sizing(G10, PagedCacheConfig(memory_mb=2048, initial_memory_mb=1),
                                 environ={})
    assert (sizing.initial_blocks, sizing.max_blocks, sizing.dynamic) == (3, 6553, True)
    assert sizing.effective_window_tokens == 104_848
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        sizing.log_load()
    assert [r.getMessage() for r in caplog.records] == [
        ("paged pool: block_size=16 initial_blocks=3 max_blocks=6553 "
         "effective_window_tokens=104848 bytes_per_block=327680"),
        "paged pool is dynamic (grow-on-demand)"]
    auto = resolve_pool_sizing(G10, max_model_len=262_144, environ={})
    assert (auto.max_mb, auto.max_blocks, auto.initial_blocks) == (5120, 16_384, 16_384)
    with pytest.raises(InvalidArgument, match="max_model_len"):
        resolve_pool_sizing(G10, environ={})
    with pytest.raises(InvalidArgument, match="geometry.block_size: 16 differs"):
        resolve_pool_sizing(G10, PagedCacheConfig(block_size=8, memory_mb=1), environ={})


def _mlx_lm_groups(windows):
    from pagedkv.coordinator import (
        AttentionKind,
        KVCachePhysicalLayout,
        LayerKVCacheSpec,
        group_layer_kv_cache_specs,
    )
    layout = KVCachePhysicalLayout(16, 1, 64, "bfloat16")
    kinds = [AttentionKind.FULL if w is None else AttentionKind.sliding(w) for w in windows]
    specs = [LayerKVCacheSpec(i, kind, layout) for i, kind in enumerate(kinds)]
    return group_layer_kv_cache_specs(specs, 1024, 512)


def test_mlx_lm_block_counts_log_a_bad_knob_once_and_refuse_an_explicit_zero(caplog,
                                                                             monkeypatch):
    # The mlx-lm integration's block counts: its config already carries the env, and
    # resolve_pool_sizing used to apply it again (two WARNINGs for one bad value); with
    # several groups an explicit PAGEDKV_PAGED_CACHE_INITIAL_MB=0 became 2 blocks, silently,
    # where the one-group path (and the contract) make it a load error.
    from pagedkv.integrations.mlx_lm.topology import _block_counts
    monkeypatch.setenv(ENV_INITIAL_MB, "abc")
    config = PagedCacheConfig().with_env()  # the integration's one WARNING
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedkv"):
        _block_counts(_mlx_lm_groups([None]), config, 1024, None, None)
    assert [r for r in caplog.records if ENV_INITIAL_MB in r.getMessage()] == []
    zero = PagedCacheConfig().with_env({ENV_INITIAL_MB: "0"})
    for windows in ([None], [None, 64]):
        with pytest.raises(InvalidArgument, match="initial pool cannot hold one block"):
            _block_counts(_mlx_lm_groups(windows), zero, 1024, None, None)
    assert _block_counts(_mlx_lm_groups([None, 64]),
                         PagedCacheConfig(initial_memory_mb=1), 1024, None, None) == (65, 65)

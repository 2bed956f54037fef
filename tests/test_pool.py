"""LayerKVPool, PoolGeometry, MemoryBudget: docs/contracts/paged-kv.md, '5. LayerKVPool' and
scenarios docs/contracts/paged-kv.md, '9.3 Pool, sizing and growth' (P3–P5)."""

from __future__ import annotations

import importlib.util
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.errors import InvalidArgument, InvalidArgumentType, PagedKVError, StaleBlockTable
from pagedkv.pool import (
    LayerKVPool,
    MemoryBudget,
    PoolGeometry,
    bf16_bits_to_float32,
    float32_to_bf16_bits,
    growth_lock,
)

HAVE_MLX = importlib.util.find_spec("mlx") is not None
BACKENDS = ["numpy", pytest.param("mlx", marks=pytest.mark.skipif(not HAVE_MLX,
                                                                  reason="mlx not installed")),
            "device"]
STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32, "q8": np.uint8}


@pytest.fixture(autouse=True)
def _device_backend_on_the_hip_stub(request):
    """``backend="device"`` cases run on the HIP stub made the default device (host memory;
    the stub emulates the pool's copy kernels: tests/data/hip_stub.c)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("backend") == "device":
        request.getfixturevalue("stub_device")


def geometry(dtype="float16", layers=2, heads=1, head_dim=8, block_size=4):
    return PoolGeometry(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype)


def snapshot(pool: LayerKVPool) -> np.ndarray:
    """Every byte of the pool, through the public block I/O."""
    return np.stack([pool.read_block(b) for b in range(pool.num_blocks)])


def numpy_of(pool: LayerKVPool, x) -> np.ndarray:
    if pool.backend == "device":
        return x.to_numpy()
    if pool.backend == "mlx":
        import mlx.core as mx
        if x.dtype == mx.bfloat16:
            x = x.view(mx.uint16)
    return np.array(x)


def random_block_buffer(g: PoolGeometry, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=g.block_buffer_shape, dtype=np.uint8)


def random_tokens(g: PoolGeometry, n: int, seed: int, layers: int | None = None) -> np.ndarray:
    """Finite values of the storage dtype (random bytes could be NaN, which compare unequal)."""
    rng = np.random.default_rng(seed)
    shape = (n, *g.token_shape) if layers is None else (layers, n, *g.token_shape)
    values = rng.standard_normal(shape).astype(np.float32)
    if g.dtype == "bfloat16":
        return float32_to_bf16_bits(values)
    if g.dtype == "q8":
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    return values.astype(STORAGE[g.dtype])


# --- geometry -------------------------------------------------------------------------------


def test_geometry_sizes():
    g = PoolGeometry(10, 2, 256, 16, "bfloat16")
    assert g.bytes_per_block == 327_680
    assert g.slab_bytes == 16 * 2 * 256 * 2
    assert g.block_buffer_shape == (10, 2, 16384)
    assert g.storage_dtype == np.uint16
    assert g.bytes_per_token == 2 * 10 * 2 * 256 * 2
    assert g.itemsize == 2
    assert PoolGeometry(1, 1, 64, 8, "float32").bytes_per_block == 2 * 8 * 64 * 4
    q8 = PoolGeometry(2, 2, 64, 16, "q8")
    assert q8.row_elements == 68 and q8.itemsize == 34 / 32
    assert q8.bytes_per_block == 2 * 2 * 16 * 2 * 68


def test_geometry_normalizes_numpy_dtypes():
    assert PoolGeometry(1, 1, 8, 4, np.float16).dtype == "float16"
    assert PoolGeometry(1, 1, 8, 4, np.dtype("float32")).dtype == "float32"


@pytest.mark.parametrize("kwargs, exc, words", [
    ({"num_layers": 0}, InvalidArgument, "num_layers: 0"),
    ({"head_dim": 0}, InvalidArgument, "head_dim: 0"),
    ({"num_kv_heads": -1}, InvalidArgument, "num_kv_heads: -1"),
    ({"block_size": 0}, InvalidArgument, "block_size: 0"),
    ({"dtype": "int8"}, InvalidArgument, "'int8'"),
    ({"dtype": np.int8}, InvalidArgument, "'int8'"),
    ({"head_dim": 7}, InvalidArgument, "odd"),
    ({"dtype": "q8", "head_dim": 48}, InvalidArgument, "multiple of 32"),
    ({"layout": "hnd"}, InvalidArgument, "layout"),
    ({"num_layers": 2.0}, InvalidArgumentType, "num_layers"),
    ({"num_layers": True}, InvalidArgumentType, "num_layers"),
])
def test_p3_geometry_rejections(kwargs, exc, words):
    args = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 32, "block_size": 4, "dtype": "float16"}
    args.update(kwargs)
    with pytest.raises(exc, match=words):
        PoolGeometry(**args)
    assert issubclass(InvalidArgument, ValueError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_p3_pool_rejections(backend):
    g = geometry()
    with pytest.raises(ValueError, match="num_blocks: 0"):
        LayerKVPool(g, 0, backend=backend)
    with pytest.raises(ValueError, match="max_num_blocks: 3"):
        LayerKVPool(g, 4, 3, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        LayerKVPool(g, 4, backend="torch")
    with pytest.raises(TypeError, match="geometry"):
        LayerKVPool((2, 1, 8, 4), 4, backend=backend)


# --- block I/O (P4) ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "q8"])
def test_p4_block_io_round_trip(backend, dtype):
    g = geometry(dtype, head_dim=32)
    pool = LayerKVPool(g, 4, backend=backend)
    buf = random_block_buffer(g, 1)
    pool.write_block(2, buf)
    assert np.array_equal(pool.read_block(2), buf)
    out = np.zeros_like(buf)
    assert pool.read_block(2, out=out) is out
    assert np.array_equal(out, buf)
    # The buffer is K then V of each layer in pool order, each a block's contiguous slab.
    for layer in range(g.num_layers):
        k, v = pool.layer(layer)
        k, v = numpy_of(pool, k), numpy_of(pool, v)
        assert k.shape == (4, 4, 1, g.row_elements)
        assert k[2].tobytes() == buf[layer, 0].tobytes()
        assert v[2].tobytes() == buf[layer, 1].tobytes()
    # Other blocks untouched.
    assert not snapshot(pool)[[0, 1, 3]].any()
    # Flat bytes of the right length are accepted too (the cold codec's payload).
    pool.write_block(1, buf[::-1].tobytes())
    assert np.array_equal(pool.read_block(1), np.ascontiguousarray(buf[::-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_p4_block_io_rejections_leave_pool_unchanged(backend):
    g = geometry()  # 2 layers, slab 64 bytes
    pool = LayerKVPool(g, 4, backend=backend)
    buf = random_block_buffer(g, 2)
    pool.write_block(2, buf)
    before = snapshot(pool)
    with pytest.raises(ValueError, match=r"expected uint8\(2, 2, 64\)"):
        pool.write_block(2, random_block_buffer(geometry(layers=1), 3))  # 1-layer buffer
    with pytest.raises(ValueError, match=r"\(2, 2, 60\)"):
        pool.write_block(2, np.zeros((2, 2, 60), np.uint8))  # short slabs
    with pytest.raises(ValueError, match=r"block_id: 99 is out of range \[0, 4\)"):
        pool.write_block(99, buf)
    with pytest.raises(ValueError, match="block_id: -1"):
        pool.write_block(-1, buf)
    with pytest.raises(ValueError, match="255 bytes"):
        pool.write_block(2, buf.tobytes()[:-1])
    with pytest.raises(TypeError, match="uint8"):
        pool.write_block(2, buf.astype(np.int16))
    with pytest.raises(TypeError, match="block_id"):
        pool.write_block(2.0, buf)
    assert np.array_equal(snapshot(pool), before)
    assert np.array_equal(pool.read_block(2), buf)
    with pytest.raises(ValueError, match="block_id: 99"):
        pool.read_block(99)
    with pytest.raises(ValueError, match=r"expected uint8\(2, 2, 64\)"):
        pool.read_block(2, out=np.zeros((2, 2, 63), np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        pool.read_block(2, out=np.zeros((2, 2, 128), np.uint8)[:, :, ::2])
    with pytest.raises(TypeError, match="out"):
        pool.read_block(2, out=bytearray(256))


# --- tokens ----------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "q8"])
def test_write_tokens_then_gather(backend, dtype):
    g = geometry(dtype, layers=3, heads=2, head_dim=32)
    pool = LayerKVPool(g, 6, backend=backend)
    table = np.array([4, 1, 5, -1], dtype=np.int32)  # -1 padded row
    k = random_tokens(g, 10, 1)
    v = random_tokens(g, 10, 2)
    positions = np.arange(10)
    slots = pool.slots_for_positions(table, positions)
    assert slots.tolist() == [16, 17, 18, 19, 4, 5, 6, 7, 20, 21]
    pool.write_tokens(1, slots.astype(np.int32), k, v)
    gk, gv = pool.gather(1, table, 10)
    gk, gv = numpy_of(pool, gk), numpy_of(pool, gv)
    assert gk.shape == (10, 2, g.row_elements) and gk.dtype == STORAGE[dtype]
    assert gk.flags.c_contiguous and gv.flags.c_contiguous
    assert np.array_equal(gk, k) and np.array_equal(gv, v)
    # A prefix of the sequence, and slot addressing in both directions.
    pk, _ = pool.gather(1, table, 5)
    assert np.array_equal(numpy_of(pool, pk), k[:5])
    assert pool.slot(5, 1) == 21 and pool.block_and_offset(21) == (5, 1)
    # Other layers untouched, the written bytes are where slot addressing says.
    layer_k = numpy_of(pool, pool.layer(1)[0])
    assert np.array_equal(layer_k[1], k[4:8]) and np.array_equal(layer_k[5, :2], k[8:])
    for other in (0, 2):
        ok, ov = pool.layer(other)
        assert not numpy_of(pool, ok).any() and not numpy_of(pool, ov).any()
    empty_k, _ = pool.gather(1, table, 0)
    assert tuple(empty_k.shape) == (0, 2, g.row_elements)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_layer_write_and_gather_match_per_layer_calls(backend):
    g = geometry("bfloat16", layers=4, heads=2, head_dim=16, block_size=8)
    pool = LayerKVPool(g, 8, backend=backend)
    table = np.array([3, 6, 0], dtype=np.int32)
    k = random_tokens(g, 20, 3, layers=4)
    v = random_tokens(g, 20, 4, layers=4)
    slots = pool.slots_for_positions(table, np.arange(20))
    pool.write_tokens_layers(slots, k, v)
    gk, gv = pool.gather_layers(table, 20)
    assert np.array_equal(numpy_of(pool, gk), k) and np.array_equal(numpy_of(pool, gv), v)
    for layer in range(4):
        lk, lv = pool.gather(layer, table, 20)
        assert np.array_equal(numpy_of(pool, lk), k[layer])
        assert np.array_equal(numpy_of(pool, lv), v[layer])
    buf = pool.read_block(6)
    assert buf[2, 1].tobytes() == v[2, 8:16].tobytes()


@pytest.mark.skipif(not HAVE_MLX, reason="mlx not installed")
def test_mlx_pool_takes_mlx_payloads_and_matches_numpy_pool():
    import mlx.core as mx
    g = geometry("bfloat16", heads=2, head_dim=16)
    pools = [LayerKVPool(g, 4, backend=b) for b in ("numpy", "mlx")]
    bits = random_tokens(g, 3, 5)
    for pool in pools:
        pool.write_tokens(0, [1, 2, 3], bits, bits)
    mk = mx.array(bf16_bits_to_float32(bits)).astype(mx.bfloat16)
    pools[1].write_tokens(1, [1, 2, 3], mk, mk)
    pools[0].write_tokens(1, [1, 2, 3], bits, bits)
    assert np.array_equal(snapshot(pools[0]), snapshot(pools[1]))
    with pytest.raises(TypeError, match="float32"):
        pools[1].write_tokens(1, [1, 2, 3], mk.astype(mx.float32), mk)
    assert np.array_equal(snapshot(pools[0]), snapshot(pools[1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_token_writes_raise_and_leave_pool_unchanged(backend):
    g = geometry(heads=2)
    pool = LayerKVPool(g, 4, backend=backend)
    k = random_tokens(g, 3, 1)
    pool.write_tokens(0, [0, 1, 2], k, k)
    pool.write_tokens(1, [4, 5, 6], k, k)
    before = snapshot(pool)
    good = np.array([8, 9, 10], np.int32)
    cases = [
        ({"k": k[:, :1]}, InvalidArgument, r"k: shape \(3, 1, 8\).*expected \(3, 2, 8\)"),
        ({"v": k[:2]}, InvalidArgument, r"v: shape \(2, 2, 8\).*expected \(3, 2, 8\)"),
        ({"k": k.astype(np.float32)}, InvalidArgumentType, "k: dtype float32.*float16"),
        ({"slots": [8, 9, 16]}, InvalidArgument, r"slots: slot 16 is out of range \[0, 16\)"),
        ({"slots": [8, -1, 10]}, InvalidArgument, "slot -1"),
        ({"slots": np.array([8.0, 9.0, 10.0])}, InvalidArgumentType, "slots: dtype float64"),
        ({"slots": good.reshape(3, 1)}, InvalidArgument, "slots: ndim 2"),
        ({"layer": 2}, InvalidArgument, r"layer: 2 is out of range \[0, 2\)"),
        ({"generation": 1}, StaleBlockTable, "generation 1.*generation 0"),
    ]
    for change, exc, words in cases:
        args = {"layer": 0, "slots": good, "k": k, "v": k, "generation": 0}
        args.update(change)
        with pytest.raises(exc, match=words):
            pool.write_tokens(args["layer"], args["slots"], args["k"], args["v"],
                              generation=args["generation"])
        assert np.array_equal(snapshot(pool), before), change
    with pytest.raises(InvalidArgument, match=r"k_layers: shape \(3, 2, 8\).*\(2, 3, 2, 8\)"):
        pool.write_tokens_layers(good, k, k)
    kl = np.stack([k, k])
    with pytest.raises(InvalidArgument, match="v_layers"):
        pool.write_tokens_layers(good, kl, kl[:, :2])
    with pytest.raises(StaleBlockTable):
        pool.write_tokens_layers(good, kl, kl, generation=3)
    assert np.array_equal(snapshot(pool), before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_gathers_and_stale_tables(backend):
    pool = LayerKVPool(geometry(), 4, 8, backend=backend)
    with pytest.raises(InvalidArgument, match=r"num_tokens: 9 is out of range \[0, 8\]"):
        pool.gather(0, [0, 1], 9)
    with pytest.raises(InvalidArgument, match=r"block_ids: block id 4 is out of range \[0, 4\)"):
        pool.gather(0, [0, 4], 5)
    with pytest.raises(InvalidArgument, match="block id -1"):
        pool.gather(0, [-1, 0], 1)
    with pytest.raises(InvalidArgumentType, match="block_ids: dtype"):
        pool.gather(0, ["a"], 1)
    with pytest.raises(InvalidArgument, match=r"positions: position 8 is out of range \[0, 8\)"):
        pool.slots_for_positions([0, 1], [7, 8])
    with pytest.raises(InvalidArgument, match="block_ids: block id -1"):
        pool.slots_for_positions([0, -1], [7])
    with pytest.raises(InvalidArgument, match="offset: 4"):
        pool.slot(0, 4)
    with pytest.raises(InvalidArgument, match=r"slot: 16 is out of range \[0, 16\)"):
        pool.block_and_offset(16)
    table_generation = pool.generation
    assert pool.grow_to(8)
    with pytest.raises(StaleBlockTable, match="generation 0.*generation 1"):
        pool.gather(0, [0, 1], 5, generation=table_generation)
    with pytest.raises(StaleBlockTable):
        pool.gather_layers([0, 1], 5, generation=table_generation)
    with pytest.raises(StaleBlockTable):
        pool.slots_for_positions([0, 1], [5], generation=table_generation)
    with pytest.raises(StaleBlockTable):
        pool.check_generation(0)
    pool.check_generation(1)
    pool.check_generation(None)
    k, _ = pool.gather(0, [0, 7], 5, generation=1)  # ids of the new generation are valid
    assert tuple(k.shape) == (5, 1, 8)


# --- growth (P5) -----------------------------------------------------------------------------


class SpyBudget(MemoryBudget):
    def __init__(self, limit_bytes, refuse=False):
        super().__init__(limit_bytes)
        self.refuse = refuse
        self.calls = []

    def try_reserve(self, pool_id, new_total_bytes):
        self.calls.append(("try_reserve", pool_id, new_total_bytes))
        return False if self.refuse and self.calls[1:] else super().try_reserve(pool_id,
                                                                                 new_total_bytes)

    def update_pool(self, pool_id, total_bytes):
        self.calls.append(("update_pool", pool_id, total_bytes))
        super().update_pool(pool_id, total_bytes)


def growing_pool(backend, budget, pool_id, blocks=range(4), seed=10):
    """A 4-of-8-block pool (256 bytes a block) with ``blocks`` written: ``(pool, its
    snapshot, the list its grow callback appends (old, new, generation) to)``."""
    g = geometry()
    pool = LayerKVPool(g, 4, 8, backend=backend, memory_budget=budget, pool_id=pool_id)
    for b in blocks:
        pool.write_block(b, random_block_buffer(g, seed + b))
    grows: list = []
    pool.add_grow_callback(lambda *args: grows.append(args))
    return pool, snapshot(pool), grows


@pytest.mark.parametrize("backend", BACKENDS)
def test_p5_grow_to(backend, caplog):
    budget = SpyBudget(1 << 20)
    pool, before, grows = growing_pool(backend, budget, "p5")
    budget.calls.clear()
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert pool.grow_to(8, needed=3) is True
    assert pool.generation == 1 and pool.num_blocks == 8 and pool.num_slots == 32
    after = snapshot(pool)
    assert np.array_equal(after[:4], before) and not after[4:].any()
    # Transient double memory reserved, then the debit drops to the 8-block total.
    assert budget.calls == [("try_reserve", "p5", 8 * 256), ("update_pool", "p5", 8 * 256)]
    assert budget.debit("p5") == 2048
    assert grows == [(4, 8, 1)]
    assert [r.getMessage() for r in caplog.records] == [
        "paged pool grew from=4 to=8 generation=1 needed=3"]
    budget.calls.clear()
    assert pool.grow_to(8) is False
    assert pool.grow_to(3) is False
    with pytest.raises(ValueError, match="new_num_blocks: 9 exceeds max_num_blocks=8"):
        pool.grow_to(9)
    assert pool.generation == 1 and budget.calls == [] and grows == [(4, 8, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_p5_failing_old_storage_release_keeps_the_grow_committed(backend, caplog, monkeypatch):
    # The release raised after the swap: grow_to raised and put the budget debit back to the
    # old 4 blocks while the pool held the new 8-block generation, and no callback ran.
    g = geometry()
    budget = MemoryBudget(1 << 20)
    pool, before, grows = growing_pool(backend, budget, "r", seed=20)

    def failing_release(self):
        raise RuntimeError("release failed")

    monkeypatch.setattr(type(pool._storage), "release", failing_release, raising=False)
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert pool.grow_to(8) is True
    assert pool.generation == 1 and pool.num_blocks == 8 and grows == [(4, 8, 1)]
    assert budget.debit("r") == 8 * 256
    assert np.array_equal(snapshot(pool)[:4], before) and not snapshot(pool)[4:].any()
    pool.write_block(7, random_block_buffer(g, 7))  # the new generation is in use
    assert np.array_equal(pool.read_block(7), random_block_buffer(g, 7))
    assert [r.getMessage() for r in caplog.records] == [
        ("paged pool grow: releasing the old storage failed; the grow stays committed "
         "(generation=1)"), "paged pool grew from=4 to=8 generation=1 needed=4"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
def test_p5_failing_copy_changes_nothing(backend, monkeypatch, caplog, error):
    """A new generation that cannot be made changes nothing. Out of memory is a refused
    grow (False, one WARNING: the reservation that asked raises PoolExhausted, which an
    engine answers by preempting); any other error propagates."""
    budget = MemoryBudget(1 << 20)
    pool, before, grows = growing_pool(backend, budget, "c", blocks=[2], seed=0)

    def failing_grown(self, new_num_blocks):
        raise error("no room for the new generation")

    monkeypatch.setattr(type(pool._storage), "grown", failing_grown)
    if error is MemoryError:
        with caplog.at_level(logging.WARNING, logger="pagedkv"):
            assert pool.grow_to(8) is False
        assert ("paged pool growth refused: out of memory for the new generation: from=4 "
                "to=8 new_bytes=2048 (no room for the new generation)") in caplog.text
    else:
        with pytest.raises(RuntimeError, match="no room"):
            pool.grow_to(8)
    assert pool.generation == 0 and pool.num_blocks == 4 and grows == []
    assert budget.debit("c") == 4 * 256 and np.array_equal(snapshot(pool), before)

@pytest.mark.parametrize("backend", BACKENDS)
def test_p5_budget_refusal_changes_nothing(backend, caplog):
    g = geometry()
    budget = SpyBudget(1 << 20, refuse=True)
    pool = LayerKVPool(g, 4, 8, backend=backend, memory_budget=budget, pool_id="p")
    pool.write_block(1, random_block_buffer(g, 1))
    before = snapshot(pool)
    grows = []
    pool.add_grow_callback(lambda *a: grows.append(a))
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert pool.grow_to(8) is False
    assert pool.generation == 0 and pool.num_blocks == 4 and grows == []
    assert np.array_equal(snapshot(pool), before)
    assert budget.debit("p") == 1024
    assert "refused by the memory budget" in caplog.text


def test_memory_budget_transient_accounting():
    g = geometry()  # 256 bytes per block
    budget = MemoryBudget(4096)
    a = LayerKVPool(g, 4, 8, memory_budget=budget, pool_id="a")   # 1024
    b = LayerKVPool(g, 2, 8, memory_budget=budget, pool_id="b")   # 512
    assert budget.total_debit_bytes == 1536 and budget.available_bytes == 2560
    # Growing a to 8 needs 1024 (old) + 2048 (new) + 512 (b) = 3584 <= 4096.
    assert a.grow_to(8)
    assert budget.pools() == {"a": 2048, "b": 512}
    # b to 8: 2048 + 512 + 2048 = 4608 > 4096 -> refused; to 6: 4096 fits exactly.
    assert not b.grow_to(8)
    assert budget.pools() == {"a": 2048, "b": 512}
    assert b.grow_to(6)
    assert budget.pools() == {"a": 2048, "b": 1536}
    with pytest.raises(InvalidArgument, match="do not fit the memory budget"):
        LayerKVPool(g, 4, memory_budget=budget, pool_id="c")
    assert "c" not in budget.pools()
    with pytest.raises(InvalidArgument, match="already debited"):
        LayerKVPool(g, 1, memory_budget=budget, pool_id="a")
    b.close()
    assert budget.pools() == {"a": 2048}
    with pytest.raises(PagedKVError, match="closed"):
        b.read_block(0)
    with pytest.raises(PagedKVError, match="closed"):
        b.grow_to(8)
    assert budget.pools() == {"a": 2048}
    with pytest.raises(InvalidArgument, match="limit_bytes: -1"):
        MemoryBudget(-1)
    with pytest.raises(InvalidArgumentType):
        MemoryBudget(1.5)


class _CloseOnReserve(MemoryBudget):
    """Runs ``hook`` once right after a successful try_reserve: the moment a close() from
    another thread can land between a grow's budget check and its copy."""

    hook = None

    def try_reserve(self, pool_id, new_total_bytes):
        ok = super().try_reserve(pool_id, new_total_bytes)
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return ok


def test_close_during_a_grow_leaves_no_debit():
    # close() does not take the growth lock: one landing after grow_to's try_reserve used to
    # be undone by the grow's failure path (update_pool(old_bytes)), leaving the closed pool
    # debited in the shared budget forever.
    budget = _CloseOnReserve(1 << 20)
    pool = LayerKVPool(geometry(), 2, 8, memory_budget=budget, pool_id="closing")
    budget.hook = pool.close
    with pytest.raises(PagedKVError, match="closed"):
        pool.grow_to(4)
    assert budget.pools() == {} and budget.total_debit_bytes == 0


def test_pools_built_at_once_with_one_id_are_not_both_debited():
    # The id check and the debit were two steps: two pools built concurrently with one id
    # both passed the check and shared (summed) one debit; closing either released both.
    class SlowBudget(MemoryBudget):
        entered = threading.Barrier(2)

        def try_reserve(self, pool_id, new_total_bytes):
            try:
                self.entered.wait(timeout=0.5)  # both threads here at once (old code)
            except threading.BrokenBarrierError:
                pass
            return super().try_reserve(pool_id, new_total_bytes)

    budget = SlowBudget(1 << 20)

    def build(_):
        try:
            return LayerKVPool(geometry(), 2, memory_budget=budget, pool_id="same")
        except InvalidArgument as exc:
            return exc

    with ThreadPoolExecutor(2) as executor:
        built = list(executor.map(build, range(2)))
    pools = [p for p in built if isinstance(p, LayerKVPool)]
    errors = [e for e in built if isinstance(e, InvalidArgument)]
    assert len(pools) == 1 and len(errors) == 1 and "already debited" in str(errors[0])
    assert budget.pools() == {"same": 512}
    with pytest.raises(InvalidArgument, match="already debited"):
        budget.try_reserve_new_pool("same", 1)
    assert budget.pools() == {"same": 512}


def test_grow_callback_errors_are_logged_and_growth_stays(caplog):
    pool = LayerKVPool(geometry(), 2, 4)
    seen = []

    def broken(old, new, gen):
        raise RuntimeError("boom")

    pool.add_grow_callback(broken)
    pool.add_grow_callback(lambda *a: seen.append(a))
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        assert pool.grow_to(4)
    assert pool.generation == 1 and seen == [(2, 4, 1)]
    assert "grow callback" in caplog.text and "boom" in caplog.text
    pool.remove_grow_callback(broken)
    pool.remove_grow_callback(broken)  # no-op
    with pytest.raises(TypeError):
        pool.add_grow_callback(3)


def test_grow_lock_is_reentrant_for_the_adapter():
    pool = LayerKVPool(geometry(), 2, 4)
    with growth_lock():
        assert pool.grow_to(3)
    assert pool.generation == 1


def test_repr_names_the_state():
    pool = LayerKVPool(geometry(), 2, 4, pool_id="r")
    text = repr(pool)
    assert "backend='numpy'" in text and "num_blocks=2" in text and "max_num_blocks=4" in text
    assert "generation=0" in text and "pool_id='r'" in text and "total_bytes=512" in text
    assert repr(MemoryBudget(10)) == "MemoryBudget(limit_bytes=10, debit_bytes=0, pools=0)"


# --- bfloat16 bit patterns -------------------------------------------------------------------


def test_bf16_bits_widen_exactly_and_narrow_to_nearest_even():
    bits = np.array([0x3F80, 0xC000, 0x0001, 0x7F80, 0xFF80, 0x7FC0, 0x0000, 0x8000], np.uint16)
    wide = bf16_bits_to_float32(bits)
    assert wide.view(np.uint32).tolist() == [int(b) << 16 for b in bits]
    assert wide[:2].tolist() == [1.0, -2.0]
    assert np.array_equal(float32_to_bf16_bits(wide), bits)
    # Ties go to even: 0x3F808000 is halfway between 0x3F80 and 0x3F81 -> 0x3F80;
    # 0x3F818000 is halfway between 0x3F81 and 0x3F82 -> 0x3F82.
    ties = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x7FA00000], np.uint32).view(np.float32)
    assert float32_to_bf16_bits(ties).tolist() == [0x3F80, 0x3F82, 0x3F81, 0x7FE0]
    with pytest.raises(InvalidArgumentType, match="uint16"):
        bf16_bits_to_float32(np.zeros(2, np.int16))
    with pytest.raises(InvalidArgumentType, match="float32"):
        float32_to_bf16_bits(np.zeros(2, np.float64))


def test_mlx_backend_without_mlx_names_the_platform_floor(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_mlx(name, *args, **kwargs):
        if name == "mlx" or name.startswith("mlx."):
            raise ImportError("No module named 'mlx'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlx)
    with pytest.raises(InvalidArgument, match="manylinux_2_35.*Apple-silicon"):
        LayerKVPool(geometry(), 2, backend="mlx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_racing_growth_are_never_lost(backend):
    import threading

    g = geometry("float32", heads=1, head_dim=8)
    pool = LayerKVPool(g, 4, 64, backend=backend)
    last = {}
    go = threading.Event()

    def writer():
        go.wait()
        for step in range(400):
            slot = (step % 4) * 4  # token 0 of blocks 0..3, which growth copies
            k = np.full((1, 1, 8), step, np.float32)
            pool.write_tokens(step % 2, [slot], k, -k)
            last[(step % 2, slot)] = step

    thread = threading.Thread(target=writer)
    thread.start()
    go.set()
    for target in (8, 16, 32, 64):
        assert pool.grow_to(target)
    thread.join()
    assert pool.generation == 4 and pool.num_blocks == 64
    for (layer, slot), step in last.items():
        block, offset = pool.block_and_offset(slot)
        k, v = pool.gather(layer, [block], offset + 1)
        assert numpy_of(pool, k)[offset].tolist() == [[float(step)] * 8]
        assert numpy_of(pool, v)[offset].tolist() == [[-float(step)] * 8]


def test_numpy_pools_never_import_mlx():
    import subprocess
    import sys
    code = ("import sys, numpy as np\n"
            "from pagedkv.pool import LayerKVPool, PoolGeometry\n"
            "import pagedkv.sizing\n"
            "p = LayerKVPool(PoolGeometry(1, 1, 8, 4), 2, 4)\n"
            "p.write_tokens(0, [1], np.ones((1, 1, 8), np.float16), np.ones((1, 1, 8), np.float16))\n"
            "p.grow_to(4); p.read_block(0)\n"
            "print('mlx' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- property: the pool behaves like a flat per-slot array -------------------------------------

@st.composite
def write_programs(draw):
    """A pool size and a list of (layer, slots) writes, some of them growing the pool."""
    num_blocks = draw(st.integers(1, 4))
    steps = draw(st.lists(st.tuples(
        st.integers(0, 1),                                      # layer
        st.lists(st.integers(0, 4 * 8 - 1), min_size=0, max_size=6, unique=True),  # slots
        st.booleans(),                                          # grow before the write
    ), max_size=6))
    return num_blocks, steps


@pytest.mark.parametrize("backend", BACKENDS)
@given(program=write_programs())
def test_pool_matches_a_flat_slot_model(backend, program):
    num_blocks, steps = program
    g = geometry("bfloat16", layers=2, heads=2, head_dim=4, block_size=4)
    pool = LayerKVPool(g, num_blocks, 8, backend=backend)
    model = np.zeros((2, 2, 8 * 4, 2, 4), np.uint16)  # layer, K/V, slot, head, dim
    value = 1
    for layer, slots, grow in steps:
        if grow:
            pool.grow_to(min(8, 2 * pool.num_blocks))
        slots = [s for s in slots if s < pool.num_slots]
        n = len(slots)
        k = np.arange(value, value + n * 8, dtype=np.uint16).reshape(n, 2, 4)
        v = k + np.uint16(30000)
        value += n * 8
        pool.write_tokens(layer, np.array(slots, np.int32), k, v)
        model[layer, 0, slots] = k
        model[layer, 1, slots] = v
    table = np.arange(pool.num_blocks)[::-1].astype(np.int32)
    order = (table[:, None] * 4 + np.arange(4)).reshape(-1)
    kl, vl = pool.gather_layers(table, pool.num_slots)
    assert np.array_equal(numpy_of(pool, kl), model[:, 0, order])
    assert np.array_equal(numpy_of(pool, vl), model[:, 1, order])
    for b in range(pool.num_blocks):
        buf = pool.read_block(b).view(np.uint16).reshape(2, 2, 4, 2, 4)
        assert np.array_equal(buf, model[:, :, b * 4:(b + 1) * 4])


@pytest.mark.skipif(not HAVE_MLX, reason="mlx not installed")
def test_mlx_storage_takes_k_and_v_together_or_neither():
    import mlx.core as mx

    from pagedkv.pool.mlx_storage import MlxKVStorage
    g = PoolGeometry(2, 1, 8, 4, "float32")
    layers = [mx.zeros((3 * 4, 1, 8), dtype=mx.float32) for _ in range(2)]
    for k, v in ((layers, None), (None, layers)):
        with pytest.raises(InvalidArgument, match="pass both k and v"):
            MlxKVStorage(g, 3, k, v)
    made = MlxKVStorage(g, 3)
    assert len(made.k) == len(made.v) == 2 and made.k[0].shape == (12, 1, 8)
    given_kv = MlxKVStorage(g, 3, layers, list(layers))
    assert given_kv.k is layers and len(given_kv.v) == 2

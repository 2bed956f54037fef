"""The C fast path of the per-layer token calls (pagedkv.pool.slot_copy) against the
validating path: byte-identical pool contents and gathers on random inputs for every pool
dtype, duplicate slots last-write-wins, and every bad or unusual input handled exactly as the
validating path handles it (same exception type and message, pool unchanged).

"generic" pools and adapters are the same objects with the fast path switched off
(``pool._slot_copier = None``), which is what the MLX backend runs."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import InvalidArgumentType, PagedKVError
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.pool.slot_copy import SlotCopier

DTYPES = ["float16", "bfloat16", "float32", "q8"]
LAYERS, HEADS, DIM, BS, BLOCKS = 3, 2, 32, 4, 6


def pools(dtype="float16", blocks=BLOCKS, max_blocks=None):
    """A (fast, generic) pair of identical pools."""
    g = PoolGeometry(LAYERS, HEADS, DIM, BS, dtype)
    fast, generic = LayerKVPool(g, blocks, max_blocks), LayerKVPool(g, blocks, max_blocks)
    generic._slot_copier = None
    assert isinstance(fast._slot_copier, SlotCopier)
    return fast, generic


def contents(pool) -> list[bytes]:
    return [pool.read_block(b).tobytes() for b in range(pool.num_blocks)]


def tokens(pool, n, rng):
    """Random ``[n, heads, row]`` payload of the pool's storage dtype (every bit pattern for
    the integer storages: bfloat16 bits, q8 records)."""
    g = pool.geometry
    shape = (n, *g.token_shape)
    if g.storage_dtype.kind == "u":
        info = np.iinfo(g.storage_dtype)
        return rng.integers(0, int(info.max) + 1, shape, dtype=g.storage_dtype)
    return rng.standard_normal(shape).astype(g.storage_dtype)


def outcome(fn, *args, **kwargs):
    """What ``fn(*args, **kwargs)`` did: ("ok", result bytes) or (exception type, message)."""
    try:
        out = fn(*args, **kwargs)
    except PagedKVError as exc:
        return type(exc), str(exc)
    if out is None:
        return "ok", None
    return "ok", tuple((a.dtype.str, a.shape, a.tobytes()) for a in out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_random_writes_and_gathers_are_byte_identical(dtype, seed):
    rng = np.random.default_rng(seed)
    fast, generic = pools(dtype)
    for _ in range(25):
        layer = int(rng.integers(LAYERS))
        n = int(rng.integers(0, 2 * BS + 1))
        # Slots with duplicates and both runs and jumps, in int32 or int64.
        slots = rng.integers(0, fast.num_slots, n).astype(rng.choice([np.int32, np.int64]))
        if n > 2:
            slots[1] = slots[0] + 1 if slots[0] + 1 < fast.num_slots else slots[0]
            slots[-1] = slots[0]
        k, v = tokens(fast, n, rng), tokens(fast, n, rng)
        before = contents(fast)
        assert fast._slot_copier.write_slots(layer, slots, k, v) is True  # the C path ran
        # ...and wrote what the validating path writes from the same state.
        generic_copy = contents(generic)
        assert generic_copy == before
        generic.write_tokens(layer, slots, k, v)
        assert contents(fast) == contents(generic)
        table = rng.permutation(BLOCKS).astype(np.int32)
        num_tokens = int(rng.integers(0, BLOCKS * BS + 1))
        got = fast._slot_copier.gather(layer, table, num_tokens)
        assert got is not None
        want = outcome(generic.gather, layer, table, num_tokens)
        assert outcome(tuple, got) == want
        assert outcome(fast.gather, layer, table, num_tokens) == want
        for a in got:
            assert a.flags.c_contiguous and a.dtype == fast.geometry.storage_dtype


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_positions_matches_slots_for_positions(dtype):
    rng = np.random.default_rng(7)
    fast, generic = pools(dtype)
    table = np.array([4, 1, 5, -1], np.int32)  # -1 padding past the used blocks
    for start, n in ((0, 1), (3, 5), (5, 7), (11, 1), (0, 12)):
        layer = int(rng.integers(LAYERS))
        k, v = tokens(fast, n, rng), tokens(fast, n, rng)
        assert fast.try_write_positions(layer, table, start, k, v) is True
        slots = generic.slots_for_positions(table[:3], np.arange(start, start + n))
        generic.write_tokens(layer, slots, k, v)
        assert contents(fast) == contents(generic)


def test_duplicate_slots_last_write_wins():
    fast, generic = pools("float32")
    k = np.arange(3 * HEADS * DIM, dtype=np.float32).reshape(3, HEADS, DIM)
    for pool in (fast, generic):
        pool.write_tokens(1, np.array([9, 2, 9], np.int32), k, -k)
        layer_k, layer_v = pool.layer(1)
        np.testing.assert_array_equal(layer_k[2, 1], k[2])   # slot 9 = block 2, offset 1
        np.testing.assert_array_equal(layer_v[2, 1], -k[2])
        np.testing.assert_array_equal(layer_k[0, 2], k[1])
    assert contents(fast) == contents(generic)


def bad_or_unusual_writes(pool, rng):
    """(name, args) of write_tokens calls that the fast path must decline."""
    g = pool.geometry
    ok_k = tokens(pool, 2, rng)
    slots = np.array([3, 4], np.int32)
    wide = tokens(pool, 2, rng).repeat(2, axis=2)
    swapped = ok_k.astype(ok_k.dtype.newbyteorder())
    k_of_pool = pool.layer(0)[0][0, :2]  # overlaps the pool itself (a valid write)
    cases = [
        ("float64 k", (0, slots, ok_k.astype(np.float64), ok_k), {}),
        ("k one token short", (0, slots, ok_k[:1], ok_k), {}),
        ("v of another shape", (0, slots, ok_k, wide), {}),
        ("k 2-D", (0, slots, ok_k.reshape(2, -1), ok_k), {}),
        ("k a list", (0, slots, ok_k.tolist(), ok_k), {}),
        ("slot out of range", (0, np.array([3, pool.num_slots], np.int32), ok_k, ok_k), {}),
        ("negative slot", (0, np.array([-1, 4]), ok_k, ok_k), {}),
        ("float slots", (0, slots.astype(np.float64), ok_k, ok_k), {}),
        ("2-D slots", (0, slots.reshape(1, 2), ok_k, ok_k), {}),
        ("slots a list", (0, [3, 4], ok_k, ok_k), {}),
        ("uint64 slots", (0, slots.astype(np.uint64), ok_k, ok_k), {}),
        ("strided slots", (0, np.array([3, 0, 4, 0])[::2], ok_k, ok_k), {}),
        ("layer out of range", (g.num_layers, slots, ok_k, ok_k), {}),
        ("negative layer", (-1, slots, ok_k, ok_k), {}),
        ("huge layer", (10 ** 30, slots, ok_k, ok_k), {}),
        ("bool layer", (True, slots, ok_k, ok_k), {}),
        ("np.int64 layer", (np.int64(1), slots, ok_k, ok_k), {}),
        ("float layer", (1.0, slots, ok_k, ok_k), {}),
        ("strided k", (0, slots, wide[:, :, ::2], ok_k), {}),
        ("k a view of the pool", (0, slots, k_of_pool, ok_k), {}),
        ("stale generation", (0, slots, ok_k, ok_k), {"generation": 1}),
        ("current generation", (0, slots, ok_k, ok_k), {"generation": 0}),
    ]
    if ok_k.itemsize > 1:  # one byte has no byte order
        cases.append(("byte-swapped k", (0, slots, swapped, ok_k), {}))
    return cases


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_declined_write_behaves_as_the_validating_path(dtype):
    rng = np.random.default_rng(3)
    fast, generic = pools(dtype)
    seed_k = tokens(fast, fast.num_slots, rng)
    for pool in (fast, generic):
        pool.write_tokens(0, np.arange(pool.num_slots), seed_k, seed_k[::-1].copy())
    cases = bad_or_unusual_writes(fast, rng)
    assert len({name for name, _, _ in cases}) == len(cases)
    for name, args, kwargs in cases:
        if name == "k a view of the pool":  # declined: an overlapping source needs NumPy
            assert fast._slot_copier.write_slots(*args) is False
        if "generation" not in kwargs and name not in ("k a view of the pool",
                                                       "current generation"):
            before = contents(fast)
            assert fast._slot_copier.write_slots(*args) is False, name
            assert contents(fast) == before, name
        gen_args = tuple(generic.layer(0)[0][0, :2] if a is args[2] and name ==
                         "k a view of the pool" else a for a in args)
        got = outcome(fast.write_tokens, *args, **kwargs)
        want = outcome(generic.write_tokens, *gen_args, **kwargs)
        assert got == want, name
        assert contents(fast) == contents(generic), name


def test_declined_gathers_behave_as_the_validating_path():
    fast, generic = pools("bfloat16")
    rng = np.random.default_rng(5)
    k = tokens(fast, fast.num_slots, rng)
    for pool in (fast, generic):
        pool.write_tokens(2, np.arange(pool.num_slots), k, k)
    table = np.array([2, 0, -1], np.int32)
    cases = [
        (2, table, 9), (2, table, 8), (2, table, 13), (2, table, -1), (2, [2, 0], 5),
        (2, table.astype(np.float32), 3), (2, np.array([2, BLOCKS]), 5), (2, table, 4.0),
        (LAYERS, table, 3), (np.int32(1), table, 3), (2, table, np.int64(3)), (2, table, True),
        (2, np.array([[2, 0]]), 3), (2, table, 0), (2, np.array([-2]), 0),
    ]
    for args in cases:
        assert outcome(fast.gather, *args) == outcome(generic.gather, *args), args
    assert outcome(fast.gather, 2, table, 3, generation=1) == outcome(
        generic.gather, 2, table, 3, generation=1)
    assert fast.try_gather(2, table, 3, generation=1) is None
    assert fast.try_gather(2, table, 9) is None  # 9 tokens need a third block: -1
    assert contents(fast) == contents(generic)


def test_a_generation_of_another_type_is_refused_on_both_paths():
    # False and 0.0 equal generation 0: the fast path's gate compared with ==, so it wrote
    # and gathered where check_generation raises InvalidArgumentType.
    fast, generic = pools("float16")
    rng = np.random.default_rng(4)
    k = tokens(fast, 2, rng)
    table = np.array([1, 0], np.int32)
    for gen in (False, 0.0, np.float64(0)):
        got = outcome(fast.write_tokens, 0, np.array([1, 2]), k, k, generation=gen)
        assert got[0] is InvalidArgumentType, gen
        assert got == outcome(generic.write_tokens, 0, np.array([1, 2]), k, k, generation=gen)
        assert outcome(fast.gather, 0, table, 3, generation=gen) == outcome(
            generic.gather, 0, table, 3, generation=gen)
        assert fast.try_write_positions(0, table, 0, k, k, generation=gen) is False
        assert fast.try_gather(0, table, 3, generation=gen) is None
        assert contents(fast) == contents(generic), gen
    # A NumPy integer generation is valid: declined by the fast path, written by the other.
    fast.write_tokens(0, np.array([1, 2]), k, k, generation=np.int64(0))
    generic.write_tokens(0, np.array([1, 2]), k, k, generation=np.int64(0))
    assert contents(fast) == contents(generic)


def test_fast_path_follows_growth_and_close():
    fast, generic = pools("float16", blocks=2, max_blocks=4)
    rng = np.random.default_rng(1)
    old = fast._slot_copier
    assert fast.grow_to(4) and generic.grow_to(4)
    assert fast._slot_copier is not old and fast._slot_copier.array is fast.layer(0)[0].base
    k = tokens(fast, 3, rng)
    fast.write_tokens(1, np.array([15, 0, 8]), k, k, generation=1)
    generic.write_tokens(1, np.array([15, 0, 8]), k, k, generation=1)
    assert contents(fast) == contents(generic)
    fast.close()
    generic.close()
    assert fast._slot_copier is None
    assert outcome(fast.write_tokens, 0, np.array([0]), k[:1], k[:1]) == outcome(
        generic.write_tokens, 0, np.array([0]), k[:1], k[:1])


def adapters(dtype="float16"):
    out = []
    for fast in (True, False):
        g = PoolGeometry(LAYERS, HEADS, DIM, BS, dtype)
        pool = LayerKVPool(g, BLOCKS)
        if not fast:
            pool._slot_copier = None
        adapter = PagedKVCacheAdapter(BlockAllocator(BLOCKS, None, BS, hash_seed=0), pool)
        adapter.reset_for_new_request("s")
        adapter.find_cached_prefix("s", np.arange(10), skip_lookup=True)
        adapter.allocate_suffix_blocks("s", 10)
        adapter.record_tokens("s", np.arange(7))
        out.append(adapter)
    return out


def adapter_state(adapter):
    return (contents(adapter.pool), adapter.block_table("s").tolist(),
            adapter.request_tokens("s").tolist(), adapter.physical_revision("s"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_adapter_write_kv_and_gather_kv_match_the_validating_path(dtype):
    rng = np.random.default_rng(11)
    fast, generic = adapters(dtype)
    for _ in range(20):
        layer = int(rng.integers(LAYERS))
        n = int(rng.integers(1, 8))
        start = None if rng.random() < 0.5 else int(rng.integers(0, 8 - n))
        k, v = tokens(fast.pool, n, rng), tokens(fast.pool, n, rng)
        for a in (fast, generic):
            a.write_kv("s", layer, k, v, start=start)
        assert adapter_state(fast) == adapter_state(generic)
        assert outcome(fast.gather_kv, "s", layer) == outcome(generic.gather_kv, "s", layer)
    k = tokens(fast.pool, 1, rng)
    assert fast.pool.try_write_positions(0, fast.block_table("s"), 6, k, k) is True


def test_adapter_bad_input_behaves_as_the_validating_path():
    fast, generic = adapters("float16")
    rng = np.random.default_rng(2)
    k = tokens(fast.pool, 2, rng)
    cases = [
        ("unknown seq", ("t", 0, k, k), {}),
        ("unhashable seq", ([1], 0, k, k), {}),
        ("layer out of range", ("s", LAYERS, k, k), {}),
        ("np layer", ("s", np.int64(1), k, k), {}),
        ("bool layer", ("s", False, k, k), {}),
        ("float32 k", ("s", 0, k.astype(np.float32), k), {}),
        ("v one token short", ("s", 0, k, k[:1]), {}),
        ("k 2-D", ("s", 0, k[0], k), {}),
        ("k of the wrong heads", ("s", 0, k.repeat(2, axis=1), k), {}),
        ("k a list", ("s", 0, k.tolist(), k), {}),
        ("more tokens than recorded", ("s", 0, tokens(fast.pool, 8, rng),
                                       tokens(fast.pool, 8, rng)), {}),
        ("start past recorded", ("s", 0, k, k), {"start": 6}),
        ("negative start", ("s", 0, k, k), {"start": -1}),
        ("np start", ("s", 0, k, k), {"start": np.int64(2)}),
        ("stale generation", ("s", 0, k, k), {"generation": 3}),
        ("zero tokens", ("s", 0, k[:0], k[:0]), {}),
        ("zero tokens, stale", ("s", 0, k[:0], k[:0]), {"generation": 3}),
        ("strided k", ("s", 1, k.repeat(2, axis=2)[:, :, ::2], k), {}),
    ]
    for name, args, kwargs in cases:
        got = outcome(fast.write_kv, *args, **kwargs)
        want = outcome(generic.write_kv, *args, **kwargs)
        assert got == want, name
        assert adapter_state(fast) == adapter_state(generic), name
    for args, kwargs in ((("t", 0), {}), (("s", LAYERS), {}), (("s", np.int8(1)), {}),
                         (("s", True), {}), (("s", 0), {"generation": 2})):
        assert outcome(fast.gather_kv, *args, **kwargs) == outcome(
            generic.gather_kv, *args, **kwargs), args


def test_mlx_pool_has_no_fast_path():
    pytest.importorskip("mlx.core")
    pool = LayerKVPool(PoolGeometry(1, 1, 2, 2, "float32"), 2, backend="mlx")
    assert pool._slot_copier is None
    assert pool.try_write_positions(0, np.array([0], np.int32), 0,
                                    np.ones((1, 1, 2), np.float32),
                                    np.ones((1, 1, 2), np.float32)) is False
    assert pool.try_gather(0, np.array([0], np.int32), 1) is None


def test_slot_copier_rejects_arrays_of_another_layout():
    with pytest.raises(ValueError):
        SlotCopier(np.zeros((2, 2, 3), np.float16))
    with pytest.raises(ValueError):
        SlotCopier(np.zeros((1, 2, 2, 2, 1, 4), np.float16)[..., ::2])
    assert "num_slots=4" in repr(SlotCopier(np.zeros((1, 2, 2, 2, 1, 4), np.float16)))

"""The device backend of LayerKVPool and the kernels driven by it (docs/pool.md "Device
backend", docs/kernels.md "Device pool and block tables").

Host tests run on the HIP stub (tests/data/hip_stub.c): its memory is host memory and it
emulates the pool's byte movers (copy_blocks, the slab gather/scatter), so growth, token
scatter/gather, block I/O and the adapter run end to end; every other kernel is only
recorded, which is what the argument and generation checks need (nothing may be launched
after an error). The pool contracts shared with the NumPy backend run on it from
tests/test_pool.py. GPU tests (marked gpu) run the same paths on real kernels against the
NumPy pool, byte for byte."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kernels_support import poisoned, track_allocations
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import InvalidArgument, InvalidArgumentType, StaleBlockTable
from pagedkv.kernels import DeviceArray, kvcache, numpy_kernels
from pagedkv.kernels.paged import (
    DeviceDecodeBatch,
    attention,
    check_tables,
    copy_pool_blocks,
    qkv_rope_write_kv,
    read_kv_q8,
    write_kv,
)
from pagedkv.pool import LayerKVPool, MemoryBudget, PoolGeometry, float32_to_bf16_bits

RNG = np.random.default_rng()


def geometry(dtype="float16", layers=2, heads=2, head_dim=32, block_size=4):
    return PoolGeometry(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype)


def values(g, shape, rng=RNG):
    """Random K or V of ``shape`` (``[..., head_dim]``) as the pool stores them (q8: records)."""
    x = rng.standard_normal(shape).astype(np.float32)
    if g.dtype == "q8":
        return numpy_kernels.kv_q8_quantize(x)
    if g.dtype == "bfloat16":
        return float32_to_bf16_bits(x)
    return x.astype(g.storage_dtype)


def snapshot(pool):
    return np.stack([pool.read_block(b) for b in range(pool.num_blocks)])


# --- host: the stub -------------------------------------------------------------------------


def test_device_pool_layout_is_one_allocation_per_layer_and_side(stub_device):
    g = geometry("q8", layers=3)
    pool = LayerKVPool(g, 5, 9, backend="device")
    assert pool.backend == "device" and pool.device is stub_device
    arrays = [a for layer in range(3) for a in pool.layer(layer)]
    assert len({a.ptr for a in arrays}) == 6
    for a in arrays:
        assert isinstance(a, DeviceArray) and a.shape == (5, 4, 2, 34) and a.dtype == np.uint8
        assert not a.to_numpy().any()  # a new pool reads as zeros
    assert "DeviceKVStorage" not in repr(pool) and "backend='device'" in repr(pool)
    with pytest.raises(InvalidArgument, match="only a backend='device' pool takes a device"):
        LayerKVPool(g, 5, device=stub_device)


def test_grow_copies_blocks_on_the_device_and_releases_the_old_arrays_after_the_bump(
        stub_device, stub_recorder):
    g = geometry(layers=2)
    budget = MemoryBudget(1 << 20)
    pool = LayerKVPool(g, 3, 8, backend="device", memory_budget=budget, pool_id="d")
    for b in range(3):
        pool.write_block(b, RNG.integers(0, 256, g.block_buffer_shape, dtype=np.uint8))
    before = snapshot(pool)
    old = [weakref.ref(a) for layer in range(2) for a in pool.layer(layer)]
    held = pool.layer(1)[0]  # a view someone keeps: its memory must outlive the grow
    seen = []
    from pagedkv.pool import device_storage
    release = device_storage.DeviceKVStorage.release

    def spy(storage):
        seen.append(pool.generation)
        release(storage)

    count = stub_recorder.count
    device_storage.DeviceKVStorage.release = spy
    try:
        assert pool.grow_to(7)
    finally:
        device_storage.DeviceKVStorage.release = release
    assert seen == [1]  # released after the generation bump
    assert stub_recorder.count - count == 4  # one copy_blocks per layer and side
    assert stub_recorder.last().name == b"pkv_copy_blocks_16"
    after = snapshot(pool)
    assert np.array_equal(after[:3], before) and not after[3:].any()
    gc.collect()
    assert [r() is None for r in old] == [True, True, False, True]
    assert held.to_numpy().tobytes() == before[:, 1, 0].tobytes()  # still readable
    assert budget.debit("d") == 7 * g.bytes_per_block


def test_token_writes_take_device_arrays_and_duplicates_keep_the_last(stub_device):
    g = geometry("bfloat16", heads=1, head_dim=8)
    pool = LayerKVPool(g, 4, backend="device")
    k = values(g, (4, 1, 8))
    v = values(g, (4, 1, 8))
    pool.write_tokens(1, np.array([5, 9, 5, 2]), stub_device.array(k), stub_device.array(v))
    lk, lv = (a.to_numpy().reshape(16, 1, 8) for a in pool.layer(1))
    assert np.array_equal(lk[[5, 9, 2]], k[[2, 1, 3]])  # slot 5: the last write (row 2)
    assert np.array_equal(lv[[5, 9, 2]], v[[2, 1, 3]])
    with pytest.raises(InvalidArgumentType, match=r"k: dtype float16 .* bfloat16"):
        pool.write_tokens(0, [0], stub_device.array(k.view(np.float16)[:1]),
                          stub_device.array(v[:1]))
    assert not pool.layer(0)[0].to_numpy().any()


def test_token_writes_refuse_a_freed_v_before_k_is_written(stub_device, stub_recorder):
    # The storage found a freed V when its copy packed it, after K's copy had written the
    # pool: the call raised, leaving this write's K beside the old V.
    g = geometry(heads=1, head_dim=8)
    pool = LayerKVPool(g, 4, backend="device")
    k = stub_device.array(values(g, (2, 1, 8)))
    k_layers = stub_device.array(values(g, (2, 2, 1, 8)))
    gone = stub_device.empty((2, 1, 8), np.float16)
    gone_layers = stub_device.empty((2, 2, 1, 8), np.float16)
    gone.free()
    gone_layers.free()
    before = snapshot(pool)
    count = stub_recorder.count
    for call, message in [
            (lambda: pool.write_tokens(0, [0, 5], k, gone), "v: DeviceArray(shape=(2, 1, 8), "),
            (lambda: pool.write_tokens_layers([0, 5], k_layers, gone_layers),
             "v_layers: DeviceArray(shape=(2, 2, 1, 8), ")]:
        with pytest.raises(InvalidArgument) as err:
            call()
        assert str(err.value) == (message + "dtype=float16) was freed; allocate a new one "
                                  "(DeviceArray.empty / from_numpy)")
    assert stub_recorder.count == count  # nothing launched
    assert np.array_equal(snapshot(pool), before)


def test_adapter_on_a_device_pool_survives_growth(stub_device):
    g = geometry(layers=2, heads=2, head_dim=32, block_size=4)
    pool = LayerKVPool(g, 2, 16, backend="device")
    adapter = PagedKVCacheAdapter(BlockAllocator(2, 16, 4), pool)
    adapter.reset_for_new_request("a")
    adapter.allocate_suffix_blocks("a", 6)
    adapter.record_tokens("a", np.arange(6, dtype=np.uint32))
    k, v = values(g, (2, 6, 2, 32)), values(g, (2, 6, 2, 32))
    adapter.write_kv_layers("a", k, v)
    adapter.reset_for_new_request("b")
    adapter.allocate_suffix_blocks("b", 9)  # needs 3 more blocks: the pool grows
    assert pool.generation >= 1 and pool.num_blocks > 2
    for layer in range(2):
        gk, gv = adapter.gather_kv("a", layer)
        assert np.array_equal(gk.to_numpy(), k[layer]) and np.array_equal(gv.to_numpy(),
                                                                         v[layer])


def _decode_setup(device, dtype="float16", seqs=2, contexts=(5, 9)):
    g = geometry(dtype, layers=2, heads=2, head_dim=32, block_size=4)
    pool = LayerKVPool(g, 8, 16, backend="device")
    adapter = PagedKVCacheAdapter(BlockAllocator(8, 16, 4), pool)
    ids = [f"s{i}" for i in range(seqs)]
    for s, n in zip(ids, contexts, strict=True):
        adapter.reset_for_new_request(s)
        adapter.allocate_suffix_blocks(s, n)
        adapter.record_tokens(s, np.arange(n, dtype=np.uint32))
    adapter.record_decode_tokens(ids, np.zeros(seqs, np.uint32))
    batch = adapter.prepare_decode(ids)
    return g, pool, adapter, ids, batch


def _attention_for(device, block_size=4):
    """PagedAttention for _decode_setup's pool, with q and out buffers."""
    attn = kvcache.PagedAttention(device, num_seqs=2, num_heads=4, kv_heads=2, head_dim=32,
                                  block_size=block_size, max_seq_len=64, kv_dtype="float16")
    return attn, device.empty((2, 4, 32), np.float32), device.empty((2, 4, 32), np.float32)


def test_device_decode_batch_holds_the_adapter_batch(stub_device):
    _g, _pool, _adapter, _ids, batch = _decode_setup(stub_device)
    tables = DeviceDecodeBatch.upload(stub_device, batch, width=5)
    assert repr(tables) == "DeviceDecodeBatch(seqs=2, width=5, generation=0)"
    got = tables.block_tables.to_numpy()
    assert np.array_equal(got[:, :batch.block_tables.shape[1]], batch.block_tables)
    assert (got[:, batch.block_tables.shape[1]:] == -1).all()
    assert tables.seq_lens.to_numpy().tolist() == [6, 10]
    assert tables.positions.to_numpy().tolist() == [5, 9]
    assert np.array_equal(tables.slot_mapping.to_numpy(), batch.slot_mapping)
    before = tables.block_tables.to_numpy()
    bad = batch._replace(block_tables=np.zeros((2, 6), np.int32))
    with pytest.raises(InvalidArgument, match=r"block_tables: int32\[2, 6\], expected "
                                              r"int32\[2, <= 5\]"):
        tables.update(bad)
    with pytest.raises(InvalidArgument, match="slot_mapping: int32"):
        tables.update(batch._replace(slot_mapping=batch.slot_mapping.astype(np.int32)))
    assert np.array_equal(tables.block_tables.to_numpy(), before)


def test_stale_tables_are_refused_before_any_launch(stub_device, stub_recorder):
    _g, pool, adapter, ids, batch = _decode_setup(stub_device)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    attn, q, out = _attention_for(stub_device)
    k = stub_device.empty((2, 2, 32), np.float32)
    assert pool.grow_to(16)
    count = stub_recorder.count
    calls = [
        lambda: write_kv(pool, 0, k, k, tables),
        lambda: attention(attn, q, pool, 0, tables, out),
        lambda: attn.run_pool(q, pool, 1, tables, out),
        lambda: copy_pool_blocks(pool, [0], [1], generation=0),
        lambda: read_kv_q8(pool, 0, tables.slot_mapping, q, q, generation=0),
        lambda: check_tables(pool, tables, generation=1),  # the tables say 0
    ]
    for call in calls:
        with pytest.raises(StaleBlockTable, match="generation"):
            call()
    assert stub_recorder.count == count  # nothing launched
    tables.update(adapter.prepare_decode(ids))  # rebuilt for generation 1: launches
    assert tables.generation == 1
    attn.run_pool(q, pool, 1, tables, out)
    assert stub_recorder.count == count + 2  # the partitions and the reduce
    assert stub_recorder.last().name == b"pkv_paged_attention_reduce"


def test_tables_the_pool_cannot_back_are_refused_before_any_launch(stub_device, stub_recorder):
    # The kernels index the pool with the uploaded ids, lengths and slots unchecked: an
    # entry past the pool, a slot past its last row, a length past the table or past the
    # attention's workspace, tables never uploaded, or pools of two sizes would read or
    # write out of bounds on a GPU. Found by a review: all of these launched.
    from pagedkv.adapter.results import DecodeBatch
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device)
    attn, q, out = _attention_for(stub_device)
    k = stub_device.empty((2, 2, 32), np.float32)
    bad = {
        "a used entry is outside 0..7": batch._replace(
            block_tables=np.where(batch.block_tables == batch.block_tables[1, 2], 999,
                                  batch.block_tables).astype(np.int32)),
        r"slot_mapping\[1\] = 1000000000 is outside -1..31": batch._replace(
            slot_mapping=np.array([batch.slot_mapping[0], 10**9], np.int64)),
        "seq_lens: values must be in": batch._replace(
            seq_lens=np.array([6, 100], np.int32)),
    }
    count = stub_recorder.count
    for message, b in bad.items():
        tables = DeviceDecodeBatch.upload(stub_device, b)
        with pytest.raises(InvalidArgument, match=message):
            write_kv(pool, 0, k, k, tables)
        with pytest.raises(InvalidArgument, match=message):
            attention(attn, q, pool, 0, tables, out)
    empty = DeviceDecodeBatch(stub_device, 2, 4)
    with pytest.raises(InvalidArgument, match="nothing uploaded yet"):
        attention(attn, q, pool, 0, empty, out)
    long = DeviceDecodeBatch.upload(stub_device, DecodeBatch(
        np.zeros((2, 32), np.int32), np.array([6, 128], np.int32), batch.slot_mapping, 0))
    with pytest.raises(InvalidArgument, match="workspace holds 1 partitions of 64"):
        attention(attn, q, pool, 0, long, out)
    k_pool, v_pool = pool.layer(0)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    with pytest.raises(InvalidArgument, match="v_pool: 1 blocks, k_pool 8"):
        attn.run(q, k_pool, stub_device.empty((1, *v_pool.shape[1:]), np.float16),
                 tables.block_tables, tables.seq_lens, out)
    assert stub_recorder.count == count  # nothing launched
    attention(attn, q, pool, 0, tables, out)  # the adapter's own batch: launches
    assert stub_recorder.count == count + 2


def test_tables_of_another_pool_are_refused_before_any_launch(stub_device, stub_recorder):
    # Two device pools of the same geometry, block count and generation: the other pool's
    # tables passed every check (generation, ids in range) and the kernels read and wrote
    # this pool's blocks at the other pool's ids: wrong KV served, no error. Found by a
    # review. Tables built by hand (no pool recorded) stay unbound.
    from pagedkv.adapter.results import DecodeBatch
    _g, pool_a, adapter_a, _ids, batch_a = _decode_setup(stub_device)
    _g, pool_b, adapter_b, _, batch_b = _decode_setup(stub_device)
    assert (pool_a.generation, pool_a.num_blocks) == (pool_b.generation, pool_b.num_blocks)
    tables = DeviceDecodeBatch.upload(stub_device, batch_a)
    attn, q, out = _attention_for(stub_device)
    k = stub_device.empty((2, 2, 32), np.float32)
    count = stub_recorder.count
    for call in (lambda: write_kv(pool_b, 0, k, k, tables),
                 lambda: attention(attn, q, pool_b, 0, tables, out),
                 lambda: attn.run_pool(q, pool_b, 1, tables, out),
                 lambda: check_tables(pool_b, tables),
                 lambda: adapter_b.check_batch(batch_a)):
        with pytest.raises(InvalidArgument, match="built by the adapter of pool instance"):
            call()
    assert stub_recorder.count == count  # nothing launched
    assert pool_a.instance_id != pool_b.instance_id
    assert batch_a.pool_instance == tables.pool_instance == pool_a.instance_id
    with pytest.raises(InvalidArgument, match=(
            rf"built by the adapter of pool instance {pool_a.instance_id}, passed with pool "
            rf"instance {pool_b.instance_id} \(pool_id '{pool_b.pool_id}'\).*build the "
            r"tables with the adapter of the pool you pass")):
        check_tables(pool_b, tables)
    adapter_a.check_batch(batch_a)
    write_kv(pool_a, 0, k, k, tables)
    attn.run_pool(q, pool_a, 1, tables, out)
    assert stub_recorder.count == count + 3  # the K/V write, the partitions and the reduce
    tables.update(batch_b)  # rebuilt by pool B's adapter: bound to pool B now
    attn.run_pool(q, pool_b, 1, tables, out)
    assert stub_recorder.count == count + 5
    by_hand = DeviceDecodeBatch.upload(stub_device, DecodeBatch(*batch_a[:4]))
    assert by_hand.pool_instance is None
    attn.run_pool(q, pool_b, 1, by_hand, out)  # not bound to a pool: as before
    assert stub_recorder.count == count + 7
    with pytest.raises(InvalidArgumentType, match="pool_instance: expected an int"):
        tables.update(batch_a._replace(pool_instance="a"))


def test_attention_and_kv_write_launch_on_the_layer_arrays_and_the_given_stream(
        stub_device, stub_recorder, monkeypatch):
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    attn, q, out = _attention_for(stub_device)
    k_pool, v_pool = pool.layer(1)
    seen = []
    run = attn.run
    monkeypatch.setattr(attn, "run", lambda *a, **kw: (seen.append((a, kw)), run(*a, **kw)))
    attention(attn, q, pool, 1, tables, out, stream=0x1234)
    (args, _kwargs), = seen
    assert args == (q, k_pool, v_pool, tables.block_tables, tables.seq_lens, out)
    assert stub_recorder.last().stream == 0x1234  # an integer stream handle is used as is
    k = stub_device.empty((2, 2, 32), np.float32)
    v = stub_device.empty((2, 2, 32), np.float32)
    stub_recorder.record_params([8, 8, 8, 8, 8, 4, 4])
    write_kv(pool, 1, k, v, tables)
    assert stub_recorder.last().name == b"pkv_kv_write_f16"
    assert [stub_recorder.param(i) for i in range(5)] == [k.ptr, v.ptr, tables.slot_mapping.ptr,
                                                         k_pool.ptr, v_pool.ptr]
    assert stub_recorder.param(5) == 2 and stub_recorder.param(6) == 64
    count = stub_recorder.count
    with pytest.raises(InvalidArgument, match=r"k: shape \(2, 2, 16\), expected \(2, 2, 32\)"):
        write_kv(pool, 1, stub_device.empty((2, 2, 16), np.float32), v, tables)
    other, _, _ = _attention_for(stub_device, block_size=8)
    with pytest.raises(InvalidArgument, match="another pool geometry"):
        attention(other, q, pool, 1, tables, out)
    assert stub_recorder.count == count


def test_a_freed_output_is_refused_before_the_attention_partitions_launch(stub_device,
                                                                          stub_recorder):
    # need_array took a freed out (or q, tables...): the partition kernel launched, then the
    # reduce's argument packing found the freed out, an error after a launch.
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    attn, q, out = _attention_for(stub_device)
    k_pool, v_pool = pool.layer(0)
    gone = stub_device.empty((2, 4, 32), np.float32)
    gone.free()
    count = stub_recorder.count
    for call in (lambda: attention(attn, q, pool, 0, tables, gone),
                 lambda: attn.run(q, k_pool, v_pool, tables.block_tables, tables.seq_lens,
                                  gone)):
        with pytest.raises(InvalidArgument) as err:
            call()
        assert str(err.value) == ("out: DeviceArray(shape=(2, 4, 32), dtype=float32) was "
                                  "freed; allocate a new one (DeviceArray.empty / from_numpy)")
    assert stub_recorder.count == count  # nothing launched
    attention(attn, q, pool, 0, tables, out)
    assert stub_recorder.count == count + 2


def test_read_kv_q8_checks_both_outputs_before_the_k_read_launches(stub_device,
                                                                    stub_recorder):
    # Each side was checked by its own kv_q8_read: a v_out of another head_dim was refused
    # after the K read had launched, by a message that blamed the pool.
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device, "q8")
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    k_out = stub_device.empty((2, 2, 32), np.float32)
    count = stub_recorder.count
    with pytest.raises(InvalidArgument) as err:
        read_kv_q8(pool, 0, tables.slot_mapping, k_out, stub_device.empty((2, 2, 64), np.float32),
                   generation=0)
    assert str(err.value) == ("pool: shape (8, 4, 2, 34), expected [num_blocks, block_size, 2, "
                              "68] for q8 at kv_heads 2, head_dim 64 (those of v_out "
                              "float32[2, 2, 64])")
    assert stub_recorder.count == count  # nothing launched
    read_kv_q8(pool, 0, tables.slot_mapping, k_out, k_out.view((2, 2, 32)), generation=0)
    assert stub_recorder.count == count + 2


def test_tables_and_arrays_of_another_device_are_refused_before_any_launch(stub_device,
                                                                            stub_recorder):
    # Nothing compared devices: tables uploaded to GPU 1, or K/V, q, out or a PagedAttention
    # of GPU 1, were launched on the pool's GPU 0 with GPU 1's addresses (an illegal address
    # on a GPU). The stub has one device: GPU 1 is a copy of its Device with ordinal 1.
    import copy
    other = copy.copy(stub_device)
    other.ordinal = 1
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    far_tables = DeviceDecodeBatch.upload(other, batch)
    attn, q, out = _attention_for(stub_device)
    far_attn, far_q, far_out = _attention_for(other)
    k = stub_device.empty((2, 2, 32), np.float32)
    far_k = other.empty((2, 2, 32), np.float32)
    count = stub_recorder.count
    for name, call, what in [
            ("tables", lambda: write_kv(pool, 0, k, k, far_tables), far_tables),
            ("tables", lambda: attention(attn, q, pool, 0, far_tables, out), far_tables),
            ("v", lambda: write_kv(pool, 0, k, far_k, tables), far_k),
            ("attn", lambda: attention(far_attn, q, pool, 0, tables, out), far_attn),
            ("q", lambda: attention(attn, far_q, pool, 0, tables, out), far_q),
            ("out", lambda: attn.run_pool(q, pool, 0, tables, far_out), far_out)]:
        with pytest.raises(InvalidArgument) as err:
            call()
        assert str(err.value) == (f"{name}: on {other!r}, the pool on {stub_device!r}; make "
                                  "it on the pool's device (pool.device)")
    assert stub_recorder.count == count  # nothing launched
    same = copy.copy(stub_device)  # another Device object of the same GPU: taken
    write_kv(pool, 0, k, same.empty((2, 2, 32), np.float32), tables)
    attention(attn, q, pool, 0, DeviceDecodeBatch.upload(same, batch), out)
    assert stub_recorder.count == count + 3


def test_every_launcher_refuses_arrays_of_another_device_before_any_launch(stub_device,
                                                                            stub_recorder):
    # da3bf8d compared devices in check_tables, write_kv and attention only: qkv_rope_write_kv's
    # qkv/q, read_kv_q8's slots and outputs, copy_pool_blocks' device ids and every low-level
    # launcher (kvcache, decode, weights) launched GPU 1's addresses on the pool's (or the
    # launch's) GPU 0. The stub has one device: GPU 1 is a copy of its Device with ordinal 1.
    import copy

    from pagedkv.kernels import decode, weights
    dev, f32 = stub_device, np.float32
    other = copy.copy(dev)
    other.ordinal = 1
    _g, pool, _adapter, _ids, batch = _decode_setup(dev)
    _g8, pool8, _adapter8, _ids8, batch8 = _decode_setup(dev, "q8")
    tables, tables8 = DeviceDecodeBatch.upload(dev, batch), DeviceDecodeBatch.upload(dev, batch8)
    attn, q, out = _attention_for(dev)
    far_q = other.empty((2, 4, 32), f32)
    qkv, far_qkv = dev.empty((2, 256), f32), other.empty((2, 256), f32)
    rows, far_rows = dev.empty((2, 2, 32), f32), other.empty((2, 2, 32), f32)
    ids, far_ids = dev.array(np.array([0], np.int32)), other.array(np.array([0], np.int32))
    far_tables = DeviceDecodeBatch.upload(other, batch)
    k_pool, v_pool = pool.layer(0)
    k8, _v8 = pool8.layer(0)
    blocks = k_pool.view((pool.num_blocks, k_pool.nbytes // pool.num_blocks), np.uint8)
    x, far_x = dev.empty((2, 256), f32), other.empty((2, 256), f32)
    gemv = weights.Gemv(dev, "hfq4g256", 64, 256, 2)
    w = gemv.upload(np.zeros(weights.raw_nbytes("hfq4g256", 64 * 256), np.uint8))
    before, before8 = snapshot(pool), snapshot(pool8)
    count = stub_recorder.count
    pool_cases = [
        ("qkv", lambda: qkv_rope_write_kv(pool, 0, far_qkv, q, tables, q_heads=4, theta=1e4)),
        ("q", lambda: qkv_rope_write_kv(pool, 0, qkv, far_q, tables, q_heads=4, theta=1e4)),
        ("slots", lambda: read_kv_q8(pool8, 0, far_tables.slot_mapping, rows, rows,
                                     generation=0)),
        ("v_out", lambda: read_kv_q8(pool8, 0, tables8.slot_mapping, rows, far_rows,
                                     generation=0)),
        ("src_ids", lambda: copy_pool_blocks(pool, far_ids, [1], generation=0)),
        ("dst_ids", lambda: copy_pool_blocks(pool, [1], far_ids, generation=0))]
    launch_cases = [
        ("src", lambda: kvcache.kv_q8_write(dev, far_rows, tables8.slot_mapping, k8)),
        ("out", lambda: kvcache.kv_q8_read(dev, k8, tables8.slot_mapping, far_rows)),
        ("src_ids", lambda: kvcache.copy_blocks(dev, blocks, far_ids, ids, blocks)),
        ("q", lambda: attn.run(far_q, k_pool, v_pool, tables.block_tables, tables.seq_lens,
                               out)),
        ("block_tables", lambda: attn.run(q, k_pool, v_pool, far_tables.block_tables,
                                          tables.seq_lens, out)),
        ("out", lambda: attn.run(q, k_pool, v_pool, tables.block_tables, tables.seq_lens,
                                 far_q)),
        ("weight", lambda: decode.add_rmsnorm(dev, x, None, other.empty((256,), f32), x,
                                              eps=1e-5)),
        ("positions", lambda: decode.qkv_rope_split(dev, qkv, far_tables.positions, q, rows,
                                                    rows, q_heads=4, kv_heads=2, head_dim=32,
                                                    theta=1e4)),
        ("out", lambda: decode.silu_mul(dev, x, other.empty((2, 128), f32))),
        ("x", lambda: weights.fwht256(dev, far_x, x)),
        ("x", lambda: gemv.run(w, far_x, dev.empty((2, 64), f32))),
        ("y", lambda: gemv.run(w, x, other.empty((2, 64), f32)))]
    for owner, fix, cases in [("the pool", " (pool.device)", pool_cases),
                              ("the launch", "", launch_cases)]:
        for name, call in cases:
            with pytest.raises(InvalidArgument) as err:
                call()
            assert str(err.value) == (f"{name}: on {other!r}, {owner} on {dev!r}; make it on "
                                      f"{owner}'s device{fix}")
    assert stub_recorder.count == count  # nothing launched
    assert np.array_equal(snapshot(pool), before) and np.array_equal(snapshot(pool8), before8)
    same = copy.copy(dev)  # another Device object of the same GPU: taken
    count = stub_recorder.count
    qkv_rope_write_kv(pool, 0, same.empty((2, 256), f32), q, tables, q_heads=4, theta=1e4)
    kvcache.kv_q8_read(dev, k8, tables8.slot_mapping, same.empty((2, 2, 32), f32))
    gemv.run(w, same.empty((2, 256), f32), dev.empty((2, 64), f32))
    assert stub_recorder.count >= count + 3  # the GEMV: a prep launch, then its own


@pytest.mark.parametrize("dtype,kernel", [("bfloat16", b"pkv_kv_write_bf16"),
                                          ("q8", b"pkv_kv_q8_write_f32")])
def test_kv_write_picks_the_pool_dtype_kernel(stub_device, stub_recorder, dtype, kernel):
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device, dtype)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    k = stub_device.empty((2, 2, 32), np.float32)
    count = stub_recorder.count
    write_kv(pool, 0, k, k, tables)
    assert stub_recorder.last().name == kernel
    assert stub_recorder.count - count == (2 if dtype == "q8" else 1)


def test_copy_pool_blocks_copies_every_layer_and_refuses_overlap(stub_device):
    g = geometry(layers=3)
    pool = LayerKVPool(g, 6, backend="device")
    for b in range(6):
        pool.write_block(b, RNG.integers(0, 256, g.block_buffer_shape, dtype=np.uint8))
    before = snapshot(pool)
    copy_pool_blocks(pool, [1, 4], [2, 0], generation=0)
    after = snapshot(pool)
    assert np.array_equal(after[[2, 0]], before[[1, 4]])
    assert np.array_equal(after[[1, 3, 4, 5]], before[[1, 3, 4, 5]])
    with pytest.raises(InvalidArgument, match="both a source and a destination"):
        copy_pool_blocks(pool, [1, 2], [2, 3], generation=0)
    with pytest.raises(InvalidArgument, match=r"dst_ids: an id is outside 0..5"):
        copy_pool_blocks(pool, [1], [6], generation=0)
    with pytest.raises(InvalidArgument, match="a destination twice"):  # a race on a GPU
        copy_pool_blocks(pool, [1, 4], [3, 3], generation=0)
    assert np.array_equal(snapshot(pool), after)


def test_entry_points_refuse_a_host_pool(stub_device):
    pool = LayerKVPool(geometry(), 4)
    tables = DeviceDecodeBatch(stub_device, 1, 1)
    with pytest.raises(InvalidArgument, match=r"expected a LayerKVPool\(backend='device'\), got "
                                              r"LayerKVPool of backend 'numpy'"):
        check_tables(pool, tables)


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8"])
def test_gpu_device_pool_matches_the_numpy_pool(device, dtype):
    g = geometry(dtype, layers=3, heads=2, head_dim=64, block_size=16)
    pools = [LayerKVPool(g, 5, 40, backend="device", device=device), LayerKVPool(g, 5, 40)]
    table = RNG.permutation(5).astype(np.int32)
    n = 71  # not a multiple of the block size
    slots = pools[1].slots_for_positions(table, np.arange(n))
    k, v = values(g, (3, n, 2, g.head_dim)), values(g, (3, n, 2, g.head_dim))
    for pool in pools:
        pool.write_tokens_layers(slots, k, v)
        pool.write_tokens(1, slots[:9][::-1].copy(), k[0, :9], v[0, :9])
    assert np.array_equal(snapshot(pools[0]), snapshot(pools[1]))
    for pool in pools:
        pool.grow_to(23)
    assert np.array_equal(snapshot(pools[0]), snapshot(pools[1]))
    buf = RNG.integers(0, 256, g.block_buffer_shape, dtype=np.uint8)
    for pool in pools:
        pool.write_block(17, buf)
    assert np.array_equal(pools[0].read_block(17), buf)
    dk, dv = pools[0].gather_layers(table, n)
    hk, hv = pools[1].gather_layers(table, n)
    assert np.array_equal(dk.to_numpy(), hk) and np.array_equal(dv.to_numpy(), hv)
    copy_pool_blocks(pools[0], [1, 2], [20, 21], generation=1)
    got = snapshot(pools[0])
    assert np.array_equal(got[[20, 21]], got[[1, 2]])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8"])
def test_gpu_kv_write_rounds_like_the_host_codecs(device, dtype):
    g, pool, _adapter, _ids, batch = _decode_setup(device, dtype, seqs=3, contexts=(3, 8, 13))
    tables = DeviceDecodeBatch.upload(device, batch)
    k = (RNG.standard_normal((3, 2, 32)) * 3).astype(np.float32)
    v = (RNG.standard_normal((3, 2, 32)) * 3).astype(np.float32)
    for arr in pool.layer(1):
        arr.fill_bytes(0xAB)
    write_kv(pool, 1, device.array(k), device.array(v), tables)
    for side, x in enumerate((k, v)):
        want = (numpy_kernels.kv_q8_quantize(x) if dtype == "q8" else
                float32_to_bf16_bits(x) if dtype == "bfloat16" else x.astype(np.float16))
        got = pool.layer(1)[side].to_numpy().reshape(-1, 2, g.row_elements)
        assert np.array_equal(got[batch.slot_mapping], want)
        untouched = np.setdiff1d(np.arange(got.shape[0]), batch.slot_mapping)
        assert (got[untouched].view(np.uint8) == 0xAB).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "q8"])
def test_gpu_attention_over_the_adapter_tables(device, dtype):
    g, pool, adapter, ids, batch = _decode_setup(device, dtype, seqs=3, contexts=(3, 30, 17))
    for s in ids:
        n = adapter.num_tokens(s)
        kv = [values(g, (2, n, 2, g.head_dim)) for _ in range(2)]
        adapter.write_kv_layers(s, *kv)
    tables = DeviceDecodeBatch.upload(device, batch)
    attn = kvcache.PagedAttention(device, num_seqs=3, num_heads=4, kv_heads=2, head_dim=32,
                                  block_size=4, max_seq_len=64, kv_dtype=dtype)
    q = RNG.standard_normal((3, 4, 32)).astype(np.float32)
    out = poisoned(device, (3, 4, 32), np.float32)
    attn.run_pool(device.array(q), pool, 1, tables, out)
    k_pool, v_pool = (a.to_numpy() for a in pool.layer(1))
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, batch.block_tables,
                                            batch.seq_lens, kv_dtype=dtype, scale=attn.scale)
    np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.gpu
def test_gpu_q8_pool_write_then_read_gives_the_codec_values(device):
    _g, pool, _adapter, _ids, batch = _decode_setup(device, "q8", seqs=3, contexts=(3, 8, 13))
    tables = DeviceDecodeBatch.upload(device, batch)
    k = (RNG.standard_normal((3, 2, 32)) * 5).astype(np.float32)
    v = RNG.standard_normal((3, 2, 32)).astype(np.float32)
    write_kv(pool, 0, device.array(k), device.array(v), tables)
    k_out = poisoned(device, (3, 2, 32), np.float32)
    v_out = poisoned(device, (3, 2, 32), np.float16)
    read_kv_q8(pool, 0, tables.slot_mapping, k_out, v_out, generation=tables.generation)
    np.testing.assert_array_equal(k_out.to_numpy(),
                                  numpy_kernels.kv_q8_dequantize(numpy_kernels.kv_q8_quantize(k), 32))
    np.testing.assert_array_equal(
        v_out.to_numpy(),
        numpy_kernels.kv_q8_dequantize(numpy_kernels.kv_q8_quantize(v), 32).astype(np.float16))


def test_create_pool_clamps_a_device_pool_to_the_free_gpu_memory(stub_device, monkeypatch,
                                                                   caplog):
    import logging

    from pagedkv.sizing import create_pool
    monkeypatch.setenv("STUB_FREE_MIB", "3")  # the stub reports 3 MiB free
    assert stub_device.free_memory_bytes() == 3 << 20
    g = geometry(layers=2, heads=2, head_dim=32, block_size=16)  # 8 KiB per block
    with caplog.at_level(logging.INFO, logger="pagedkv"):
        pool = create_pool(g, max_model_len=1 << 20, backend="device",
                           available_memory_bytes=stub_device.free_memory_bytes,
                           device=stub_device)
    assert pool.backend == "device" and pool.device is stub_device
    assert pool.max_num_blocks == (3 << 20) // g.bytes_per_block
    assert "clamped to live memory" in caplog.text


@pytest.mark.parametrize("fail", ["malloc", "fill", "copy"])
def test_a_grow_that_runs_out_of_memory_frees_the_new_generation_at_once(stub_device,
                                                                         monkeypatch, fail):
    """Found by a review: a grow whose new generation could not be allocated (out of device
    memory at the fourth of eight arrays) or copied raised DeviceError with the pool
    unchanged, but the arrays already allocated stayed allocated as long as the exception's
    traceback lived (a future or a caller keeping the error): a partial generation of GPU
    memory held on exactly the path where memory is short. They are freed before the
    error propagates now; the pool, its blocks and the budget debit stay as they were, and
    a later grow works. Out of memory at the allocation is a refusal since (grow_to returns
    False, logged, as when the budget refuses): only other errors propagate."""
    from pagedkv.errors import DeviceError
    from pagedkv.kernels import kvcache as kvcache_module
    g = geometry(layers=4)
    budget = MemoryBudget(1 << 20)
    pool = LayerKVPool(g, 3, 8, backend="device", memory_budget=budget, pool_id="d")
    for b in range(3):
        pool.write_block(b, RNG.integers(0, 256, g.block_buffer_shape, dtype=np.uint8))
    before, generation = snapshot(pool), pool.generation
    oom = DeviceError("hipMalloc", 2, "hipErrorOutOfMemory", "out of memory")
    # a fill or copy that fails is not an allocation a later free can cure: it propagates
    broken = DeviceError("hipLaunchKernel", 719, "hipErrorLaunchFailure", "launch failure")
    live = track_allocations(monkeypatch, stub_device, error=oom,
                             fail_at=4 if fail == "malloc" else None)
    if fail == "fill":
        fill = DeviceArray.fill_bytes
        fills = [0]

        def failing_fill(arr, value):
            fills[0] += 1
            if fills[0] == 5:
                raise broken
            fill(arr, value)

        monkeypatch.setattr(DeviceArray, "fill_bytes", failing_fill)
    if fail == "copy":
        copy = kvcache_module.copy_blocks
        copies = [0]

        def failing_copy(*args, **kwargs):
            copies[0] += 1
            if copies[0] == 3:
                raise broken
            copy(*args, **kwargs)

        monkeypatch.setattr(kvcache_module, "copy_blocks", failing_copy)
    if fail == "malloc":
        assert pool.grow_to(7) is False
    else:
        with pytest.raises(DeviceError, match="hipErrorLaunchFailure") as caught:
            pool.grow_to(7)
        assert caught.value is broken  # still held, with its traceback
    assert live == set()  # every new allocation already freed
    assert (pool.generation, pool.num_blocks) == (generation, 3)
    assert np.array_equal(snapshot(pool), before)
    assert budget.debit("d") == 3 * g.bytes_per_block
    monkeypatch.undo()
    assert pool.grow_to(7) and np.array_equal(snapshot(pool)[:3], before)


@pytest.mark.parametrize("error", ["device", "host"])
def test_a_reservation_the_device_cannot_grow_for_is_pool_exhausted(stub_device, monkeypatch,
                                                                    caplog, error):
    """Found by a review: a reservation whose growth ran out of device memory (memory the
    budget allowed but the GPU no longer had) raised DeviceError out of
    allocate_suffix_blocks, where an engine expects PoolExhausted and preempts. The grow is
    now refused like a budget refusal: PoolExhausted, the request, the allocator, the pool
    and the budget as they were, one WARNING naming the error; the same when NumPy's
    allocation raises MemoryError. Other device errors still propagate (test above)."""
    import logging

    from pagedkv.errors import DeviceError, PoolExhausted
    g = geometry()
    budget = MemoryBudget(1 << 20)
    pool = LayerKVPool(g, 2, 8, backend="device", memory_budget=budget, pool_id="d")
    adapter = PagedKVCacheAdapter(BlockAllocator(2, 8, 4), pool)
    adapter.reset_for_new_request("a")
    adapter.allocate_suffix_blocks("a", 6)
    adapter.record_tokens("a", np.arange(6, dtype=np.uint32))
    k = values(g, (g.num_layers, 6, g.num_kv_heads, g.head_dim))
    adapter.write_kv_layers("a", k, k)
    before = snapshot(pool)
    adapter.reset_for_new_request("b")
    table_a = adapter.block_table("a").copy()
    failure = (DeviceError("hipMalloc", 2, "hipErrorOutOfMemory", "out of memory")
               if error == "device" else MemoryError())
    real_grown = type(pool._storage).grown

    def grown(self, n):
        raise failure

    monkeypatch.setattr(type(pool._storage), "grown", grown)
    with caplog.at_level(logging.WARNING, logger="pagedkv"), \
            pytest.raises(PoolExhausted, match="preempt a request"):
        adapter.allocate_suffix_blocks("b", 9)
    assert "paged pool growth refused: out of memory for the new generation" in caplog.text
    assert (pool.num_blocks, pool.generation) == (2, 0)
    assert adapter.allocator.num_blocks == 2 and adapter.allocator.num_free_blocks == 0
    assert budget.debit("d") == 2 * g.bytes_per_block
    assert np.array_equal(adapter.block_table("a"), table_a)
    assert len(adapter.block_table("b")) == 0
    assert np.array_equal(snapshot(pool), before)
    monkeypatch.setattr(type(pool._storage), "grown", real_grown)
    adapter.allocate_suffix_blocks("b", 9)  # memory back: the same call grows and succeeds
    assert pool.num_blocks > 2 and np.array_equal(snapshot(pool)[:2], before)

"""Device pools of the KV modes (docs/kv-quant.md, "Pools"): ``<K>/<V>`` records whose K
and V rows differ in size, on ``LayerKVPool(backend="device")``.

Host tests run on the HIP stub (tests/data/hip_stub.c), which emulates the pool's byte
movers on host memory: the device pool must hold byte for byte what a NumPy pool of the
same mode holds through writes, growth, block I/O, block copies and transcoding, and
``pagedkv.kernels.paged`` must launch the mode's kernels on the layer's own arrays. GPU
tests (marked ``gpu``, run by hip/device_check.sh) check that ``write_kv`` encodes on the
device to the host codec's exact bytes and that attention over the pool reads them.
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels_support import poisoned, track_allocations
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import InvalidArgument
from pagedkv.kernels import kvcache, numpy_kernels
from pagedkv.kernels.paged import DeviceDecodeBatch, attention, copy_pool_blocks, write_kv
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.quant import kv as kv_modes

RNG = np.random.default_rng(15)


def geometry(dtype="fwht4/q8", layers=2, heads=2, head_dim=128, block_size=4):
    return PoolGeometry(num_layers=layers, num_kv_heads=heads, head_dim=head_dim,
                        block_size=block_size, dtype=dtype)


def snapshot(pool):
    return np.stack([pool.read_block(b) for b in range(pool.num_blocks)])


def kv_values(g, shape, rng=RNG):
    return (rng.standard_normal((*shape, g.num_kv_heads, g.head_dim)) * 2).astype(np.float32)


# --- host: the stub -------------------------------------------------------------------------


def test_device_pool_of_kv_modes_holds_what_the_numpy_pool_holds(stub_device):
    g = geometry("fwht4/q8")
    assert (g.k_row_bytes, g.v_row_bytes) == (68, 136) and not g.symmetric
    dev = LayerKVPool(g, 3, 12, backend="device")
    host = LayerKVPool(g, 3, 12)
    k_arr, v_arr = dev.layer(1)
    assert (k_arr.shape, v_arr.shape) == ((3, 4, 2, 68), (3, 4, 2, 136))
    assert k_arr.dtype == v_arr.dtype == np.uint8
    table = np.array([2, 0, 1], np.int32)
    n = 11
    slots = host.slots_for_positions(table, np.arange(n))
    k, v = kv_values(g, (2, n)), kv_values(g, (2, n))
    for pool in (dev, host):
        pool.write_tokens_layers(slots, k, v)  # float values: encoded on the host
        pool.write_tokens(0, slots[[3, 5, 3]], k[1, :3], v[1, :3])  # slot 3: the last row
    assert np.array_equal(snapshot(dev), snapshot(host))
    dk, dv = dev.gather(0, table, n)
    hk, hv = host.gather(0, table, n)
    assert dk.shape == (n, 2, 68) and dv.shape == (n, 2, 136)
    assert np.array_equal(dk.to_numpy(), hk) and np.array_equal(dv.to_numpy(), hv)
    dk, dv = dev.gather_layers(table, n)
    hk, hv = host.gather_layers(table, n)
    assert np.array_equal(dk.to_numpy(), hk) and np.array_equal(dv.to_numpy(), hv)
    dec_k, dec_v = dev.decode_tokens(*dev.gather(1, table, n))
    want_k, want_v = host.decode_tokens(*host.gather(1, table, n))
    assert np.array_equal(dec_k, want_k) and np.array_equal(dec_v, want_v)
    for pool in (dev, host):
        assert pool.grow_to(7)
    assert np.array_equal(snapshot(dev), snapshot(host))
    buf = RNG.integers(0, 256, g.block_buffer_shape, dtype=np.uint8)
    assert buf.shape == (2, 4 * 2 * (68 + 136))
    for pool in (dev, host):
        pool.write_block(5, buf)
    assert np.array_equal(dev.read_block(5), buf)
    copy_pool_blocks(dev, [5, 2], [6, 4], generation=dev.generation)
    got = snapshot(dev)
    assert np.array_equal(got[[6, 4]], got[[5, 2]])


def test_device_pool_transcodes_like_the_numpy_pool(stub_device):
    g = geometry("fwht4/lloyd4", head_dim=256)
    dev = LayerKVPool(g, 4, backend="device")
    host = LayerKVPool(g, 4)
    slots = np.arange(13)
    k, v = kv_values(g, (2, 13)), kv_values(g, (2, 13))
    for pool in (dev, host):
        pool.write_tokens_layers(slots, k, v)
    old = dev.layer(0)[0]
    for pool in (dev, host):
        pool.transcode("fwht2/lloyd2")
    assert dev.geometry.dtype == "fwht2/lloyd2" and dev.generation == 1
    assert dev.layer(0)[0].shape == (4, 4, 2, 4 + 256 * 2 // 8)
    assert dev.device is stub_device
    assert np.array_equal(snapshot(dev), snapshot(host))
    assert old.shape == (4, 4, 2, 4 + 256 // 2)  # a kept view of the old generation
    with pytest.raises(InvalidArgument, match="not a transcode"):
        dev.transcode("fwht4/lloyd4")
    assert dev.geometry.dtype == "fwht2/lloyd2" and np.array_equal(snapshot(dev),
                                                                   snapshot(host))


def _decode_setup(device, dtype, head_dim, contexts=(5, 9)):
    g = geometry(dtype, head_dim=head_dim)
    pool = LayerKVPool(g, 8, 16, backend="device", device=device)
    adapter = PagedKVCacheAdapter(BlockAllocator(8, 16, 4), pool)
    ids = [f"s{i}" for i in range(len(contexts))]
    for s, n in zip(ids, contexts, strict=True):
        adapter.reset_for_new_request(s)
        adapter.allocate_suffix_blocks(s, n)
        adapter.record_tokens(s, np.arange(n, dtype=np.uint32))
    adapter.record_decode_tokens(ids, np.zeros(len(ids), np.uint32))
    batch = adapter.prepare_decode(ids)
    return g, pool, adapter, ids, batch


@pytest.mark.parametrize("dtype,hd,launches", [
    ("fwht4/q8", 128, [(b"pkv_kv_rotated_write_f32", 1), (b"pkv_kv_q8_write_f32", None)]),
    ("fwht3/lloyd2", 256, [(b"pkv_kv_rotated_write_f32", 2),
                           (b"pkv_kv_rotated_write_f32", 6)]),
])
def test_kv_write_encodes_each_side_with_its_mode_kernel(stub_device, stub_recorder, dtype, hd,
                                                         launches):
    g, pool, _adapter, _ids, batch = _decode_setup(stub_device, dtype, hd)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    k = stub_device.empty((2, 2, hd), np.float32)
    v = stub_device.empty((2, 2, hd), np.float32)
    count = stub_recorder.count
    write_kv(pool, 1, k, v, tables)
    assert stub_recorder.count - count == 2  # K, then V
    assert stub_recorder.last().name == launches[1][0]
    # Each side's launch on its own (the stub records the parameters of one launch).
    for (x, side_pool, mode), (name, mode_id) in zip(
            ((k, pool.layer(1)[0], g.k_dtype), (v, pool.layer(1)[1], g.v_dtype)), launches,
            strict=True):
        if mode_id is None:
            stub_recorder.record_params([8, 8, 8, 4, 4, 4])
            kvcache.kv_q8_write(stub_device, x, tables.slot_mapping, side_pool)
        else:
            stub_recorder.record_params([8, 8, 8, 4, 4, 4, 4])
            kvcache.kv_rotated_write(stub_device, x, tables.slot_mapping, side_pool, mode)
        launch = stub_recorder.last()
        assert launch.name == name
        assert [stub_recorder.param(i) for i in range(3)] == [x.ptr, tables.slot_mapping.ptr,
                                                             side_pool.ptr]
        if mode_id is not None:
            assert stub_recorder.param(6) == mode_id  # PKV_KV_MODE_*
            assert (launch.grid[0], launch.block[0]) == (2 * 2, kvcache.KV_WRITE_THREADS)


def test_kv_rotated_write_refuses_bad_arguments_before_any_launch(stub_device, stub_recorder):
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device, "fwht4/q8", 128)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    k_pool, v_pool = pool.layer(0)
    x = stub_device.empty((2, 2, 128), np.float32)
    count = stub_recorder.count
    kv_rotated_write = kvcache.kv_rotated_write
    with pytest.raises(InvalidArgument, match="expected a rotated KV mode"):
        kv_rotated_write(stub_device, x, tables.slot_mapping, k_pool, "q8")
    with pytest.raises(InvalidArgument, match=r"pool: shape \(8, 4, 2, 136\), expected "
                                              r"\[num_blocks, block_size, 2, 68\]"):
        kv_rotated_write(stub_device, x, tables.slot_mapping, v_pool, "fwht4")
    with pytest.raises(InvalidArgument, match="KV mode 'lloyd3' needs head_dim 256"):
        kv_rotated_write(stub_device, x, tables.slot_mapping, k_pool, "lloyd3")
    with pytest.raises(InvalidArgument, match=r"src: int32\[2, 2, 128\]"):
        kv_rotated_write(stub_device, stub_device.empty((2, 2, 128), np.int32),
                         tables.slot_mapping, k_pool, "fwht4")
    with pytest.raises(InvalidArgument, match="k: shape"):
        write_kv(pool, 0, stub_device.empty((2, 2, 64), np.float32), x, tables)
    assert stub_recorder.count == count


@pytest.mark.parametrize("dtype,hd", [("q8", 32), ("fwht4/q8", 128)])
def test_write_kv_refuses_a_bad_v_before_writing_k(stub_device, stub_recorder, dtype, hd):
    # K and V were checked by each side's own launcher: a V of the wrong dtype (or freed)
    # was refused (as "src") only after K's launch had written this step's K into the pool.
    _g, pool, _adapter, _ids, batch = _decode_setup(stub_device, dtype, hd)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    k = stub_device.array(RNG.standard_normal((2, 2, hd)).astype(np.float32))
    gone = stub_device.empty((2, 2, hd), np.float32)
    gone.free()
    before = snapshot(pool)
    count = stub_recorder.count
    for v, message in [
            (stub_device.empty((2, 2, hd), np.float64),
             rf"v: float64[2, 2, {hd}], expected float32 or float16 [n, kv_heads, head_dim]"),
            (gone, (rf"v: DeviceArray(shape=(2, 2, {hd}), dtype=float32) was freed; "
                    "allocate a new one (DeviceArray.empty / from_numpy)"))]:
        with pytest.raises(InvalidArgument) as err:
            write_kv(pool, 0, k, v, tables)
        assert str(err.value) == message
    assert stub_recorder.count == count  # nothing launched
    assert np.array_equal(snapshot(pool), before)
    count = stub_recorder.count
    write_kv(pool, 0, k, k, tables)
    assert stub_recorder.count == count + 2  # K, then V


def test_attention_over_a_kv_mode_pool_launches_the_compressed_kernel(stub_device,
                                                                      stub_recorder):
    g, pool, _adapter, _ids, batch = _decode_setup(stub_device, "fwht4/lloyd4", 256)
    tables = DeviceDecodeBatch.upload(stub_device, batch)
    attn = kvcache.PagedAttention(stub_device, num_seqs=2, num_heads=4, kv_heads=2,
                                  head_dim=256, block_size=4, max_seq_len=64,
                                  kv_dtype=g.dtype)
    q = stub_device.empty((2, 4, 256), np.float32)
    out = stub_device.empty((2, 4, 256), np.float32)
    count = stub_recorder.count
    names = []
    run = attn._partition

    def spy(*args, **kwargs):
        names.append(args[3:5])  # (grid, block, q, k_pool, v_pool, ...)
        return run(*args, **kwargs)

    attn._partition = spy
    attention(attn, q, pool, 1, tables, out)
    k_pool, v_pool = pool.layer(1)
    assert names == [(k_pool, v_pool)]  # the layer's record arrays themselves
    assert stub_recorder.count - count == 2
    assert stub_recorder.last().name == b"pkv_paged_attention_reduce_ifwht256"
    other = kvcache.PagedAttention(stub_device, num_seqs=2, num_heads=4, kv_heads=2,
                                   head_dim=256, block_size=4, max_seq_len=64,
                                   kv_dtype="fwht4/lloyd2")
    with pytest.raises(InvalidArgument, match="another pool geometry"):
        attention(other, q, pool, 1, tables, out)
    assert stub_recorder.count - count == 2


# --- GPU ------------------------------------------------------------------------------------

ROTATED_CASES = [("fwht4", 128), ("fwht2", 128), ("fwht4", 256), ("fwht3", 256),
                 ("fwht2", 256), ("lloyd4", 256), ("lloyd3", 256), ("lloyd2", 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,hd", ROTATED_CASES)
@pytest.mark.parametrize("src_dtype", [np.float32, np.float16])
def test_gpu_kv_rotated_write_gives_the_host_codec_bytes(device, mode, hd, src_dtype):
    n, kvh, num_blocks, bs = 37, 3, 16, 4
    row = kv_modes.kv_mode(mode).row_bytes(hd)
    x = (RNG.standard_normal((n, kvh, hd)) * RNG.uniform(0.01, 40, (n, 1, 1))).astype(src_dtype)
    x[4] = 0  # a zero row: norm 0, inv 0
    slots = RNG.permutation(num_blocks * bs)[:n].astype(np.int64)
    slots[7] = -1  # a padding token: skipped
    pool = poisoned(device, (num_blocks, bs, kvh, row), np.uint8, byte=0xAB)
    kvcache.kv_rotated_write(device, device.array(x), device.array(slots), pool, mode)
    got = pool.to_numpy().reshape(-1, kvh, row)
    want = kv_modes.encode(x, mode)
    live = slots >= 0
    np.testing.assert_array_equal(got[slots[live]], want[live])
    untouched = np.setdiff1d(np.arange(num_blocks * bs), slots[live])
    assert (got[untouched] == 0xAB).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hd", [("fwht4/q8", 128), ("fwht2/q8", 128),
                                      ("fwht4/lloyd4", 256), ("fwht3/lloyd3", 256),
                                      ("lloyd4/lloyd4", 256), ("fwht2/lloyd2", 256),
                                      ("fwht4/fwht4", 128), ("fwht4/fwht2", 128),
                                      ("lloyd4/fwht3", 256)])
def test_gpu_write_kv_then_attention_over_a_kv_mode_pool(device, dtype, hd):
    g, pool, adapter, ids, batch = _decode_setup(device, dtype, hd, contexts=(3, 30, 17))
    for s in ids:  # every position, encoded on the host; write_kv then rewrites the last
        n = adapter.num_tokens(s)
        adapter.write_kv_layers(s, kv_values(g, (2, n)), kv_values(g, (2, n)))
    tables = DeviceDecodeBatch.upload(device, batch)
    k = kv_values(g, (len(ids),))
    v = kv_values(g, (len(ids),))
    write_kv(pool, 1, device.array(k), device.array(v), tables)
    k_pool, v_pool = (a.to_numpy() for a in pool.layer(1))
    for pool_side, x, mode in ((k_pool, k, g.k_dtype), (v_pool, v, g.v_dtype)):
        rows = pool_side.reshape(-1, *pool_side.shape[2:])
        np.testing.assert_array_equal(rows[batch.slot_mapping], kv_modes.encode(x, mode))
    attn = kvcache.PagedAttention(device, num_seqs=len(ids), num_heads=4, kv_heads=2,
                                  head_dim=hd, block_size=4, max_seq_len=64, kv_dtype=dtype)
    q = RNG.standard_normal((len(ids), 4, hd)).astype(np.float32)
    out = poisoned(device, (len(ids), 4, hd), np.float32)
    attn.run_pool(device.array(q), pool, 1, tables, out)
    want = numpy_kernels.paged_attention_decode(q, k_pool, v_pool, batch.block_tables,
                                            batch.seq_lens, kv_dtype=dtype, scale=attn.scale)
    np.testing.assert_allclose(out.to_numpy(), want, rtol=1e-4, atol=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,hd", [("fwht4/q8", 128), ("fwht4/lloyd3", 256),
                                      ("fwht4/fwht4", 128)])
def test_gpu_kv_mode_device_pool_matches_the_numpy_pool(device, dtype, hd):
    g = geometry(dtype, layers=3, head_dim=hd, block_size=16)
    pools = [LayerKVPool(g, 5, 40, backend="device", device=device), LayerKVPool(g, 5, 40)]
    table = RNG.permutation(5).astype(np.int32)
    n = 71
    slots = pools[1].slots_for_positions(table, np.arange(n))
    k, v = kv_values(g, (3, n)), kv_values(g, (3, n))
    for pool in pools:
        pool.write_tokens_layers(slots, k, v)
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


@pytest.mark.parametrize("fail", ["malloc", "write_block"])
def test_a_failed_transcode_frees_the_new_generation_at_once(stub_device, monkeypatch, fail):
    """Found by a review (as for grow_to): a device transcode whose new generation could not
    be allocated or written (out of device memory, a failing block upload) raised with the
    pool unchanged, but the new arrays already allocated stayed allocated as long as the
    exception's traceback lived. They are freed before the error propagates now; the pool
    keeps its mode, generation and bytes, and a later transcode works. Out of memory is the
    library's refusal, PoolExhausted (the DeviceError its cause), as for grow_to (a later
    review: it surfaced as DeviceError, which an engine does not answer by preempting)."""
    from pagedkv.errors import DeviceError, PoolExhausted
    from pagedkv.pool.device_storage import DeviceKVStorage
    g = geometry("fwht4/lloyd4", head_dim=256)
    pool = LayerKVPool(g, 4, backend="device")
    pool.write_tokens_layers(np.arange(13), kv_values(g, (2, 13)), kv_values(g, (2, 13)))
    before = snapshot(pool)
    oom = DeviceError("hipMalloc", 2, "hipErrorOutOfMemory", "out of memory")
    live = track_allocations(monkeypatch, stub_device, error=oom,
                             fail_at=3 if fail == "malloc" else None)
    if fail == "write_block":
        write_block, writes = DeviceKVStorage.write_block, [0]

        def failing_write(storage, block_id, data):
            writes[0] += 1
            if writes[0] == 3:
                raise oom
            write_block(storage, block_id, data)

        monkeypatch.setattr(DeviceKVStorage, "write_block", failing_write)
    with pytest.raises(PoolExhausted, match="fwht4/lloyd4 -> fwht2/lloyd2: out of memory "
                                            ".*hipErrorOutOfMemory.*nothing changed") as caught:
        pool.transcode("fwht2/lloyd2")
    assert caught.value.__cause__ is oom
    assert live == set()  # every new allocation already freed
    assert (pool.geometry.dtype, pool.generation) == ("fwht4/lloyd4", 0)
    assert np.array_equal(snapshot(pool), before)
    monkeypatch.undo()
    pool.transcode("fwht2/lloyd2")
    assert pool.generation == 1

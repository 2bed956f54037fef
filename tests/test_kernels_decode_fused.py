"""The decode step's fused launches (hip/decode.hip): RMSNorm, SiLU·up and attention's
partition reduce writing the next tensor-core GEMV's prepared x, RoPE writing this token's
K/V straight into the pool.

Each fused kernel must leave exactly the bytes of the launches it replaces: GPU tests run
both on the same inputs and compare byte for byte (the prepared-x planes and sums, q, the
attention output, and every byte of the pool's layer), then whole steps fused and unfused
against each other (byte for byte) and against the float64 step. CPU tests (HIP stub) pin the launchers' checks (nothing launched after an error) and
the launches a step saves."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from kernels_support import poisoned
from pagedkv.env_knobs import env_bool
from pagedkv.errors import InvalidArgument
from pagedkv.kernels import decode, kvcache
from pagedkv.kernels.decoder import (
    FUSE_ATTN_PREP_ENV,
    LLAMA3_8B,
    DecoderHostWeights,
    DecoderStep,
    DecoderWeights,
)
from pagedkv.kernels.paged import DeviceDecodeBatch, qkv_rope_write_kv, rope_write_fusable
from pagedkv.kernels.weights import Gemv, PreparedX

RNG = np.random.default_rng()
SMALL = replace(LLAMA3_8B, num_layers=2, d_model=256, q_heads=4, kv_heads=2, head_dim=64,
                ffn=512, vocab=300, rope_theta=10000.0)


def _prepared_bytes(p: PreparedX) -> tuple[bytes, bytes]:
    return p.xq.to_numpy().tobytes(), p.xs.to_numpy().tobytes()


def _step_parts(device, kv_dtype: str, batch: int, shape=SMALL):
    from pagedkv.bench.decode import build_adapter
    pool, adapter, seqs = build_adapter(device, shape, kv_dtype, batch,
                                        [5 + 7 * i for i in range(batch)], RNG)
    adapter.record_decode_tokens(seqs, np.zeros(batch, np.uint32))
    tables = DeviceDecodeBatch.upload(device, adapter.prepare_decode(seqs))
    return pool, tables


# --- CPU (HIP stub) -------------------------------------------------------------------------


def test_fused_launchers_check_before_launching(stub_device, stub_recorder, monkeypatch):
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")  # the stub's gfx90a then takes the MFMA GEMV
    dev, f32 = stub_device, np.float32
    prepared = Gemv(dev, "hfq4g256", 64, 512, 2).prepared_x()
    x, w = dev.empty((2, 512), f32), dev.empty((512,), f32)
    gu = dev.empty((2, 1024), f32)
    pool, tables = _step_parts(dev, "float16", 2)
    qkv, q = dev.empty((2, 8 * 64), f32), dev.empty((2, 4, 64), f32)
    count = stub_recorder.count
    cases = [
        (lambda: decode.add_rmsnorm_prep(dev, dev.empty((2, 260), f32), None,
                                         dev.empty((260,), f32), None, prepared, eps=1e-5),
         "x: dim 260 must be a positive multiple of 256"),
        (lambda: decode.add_rmsnorm_prep(dev, dev.empty((3, 512), f32), None, w, None, prepared,
                                         eps=1e-5),
         "prepared: a Gemv of batch 2 and K 512; x has 3 rows of 512"),
        (lambda: decode.add_rmsnorm_prep(dev, x, None, w, None, (1, 2), eps=1e-5),
         "prepared: expected Gemv.prepared_x"),
        (lambda: decode.silu_mul_prep(dev, dev.empty((2, 1000), f32), None, prepared),
         "gate_up: 1000 columns, expected an even 2 x ffn with ffn a multiple of 256"),
        (lambda: decode.silu_mul_prep(dev, dev.empty((2, 1536), f32), None, prepared),
         "prepared: a Gemv of batch 2 and K 512; x has 2 rows of 768"),
        (lambda: decode.silu_mul_prep(dev, gu, dev.empty((2, 256), f32), prepared),
         r"out: shape \(2, 256\), expected \(2, 512\)"),
        (lambda: qkv_rope_write_kv(pool, 0, dev.empty((2, 7 * 64), f32), q, tables, q_heads=4,
                                   theta=1e4),
         r"qkv: shape \(2, 448\), expected \(2, 512\)"),
        (lambda: qkv_rope_write_kv(pool, 0, qkv, dev.empty((2, 4, 32), f32), tables, q_heads=4,
                                   theta=1e4),
         r"q: shape \(2, 4, 32\), expected \(2, 4, 64\)"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            call()
    assert stub_recorder.count == count
    decode.add_rmsnorm_prep(dev, x, None, w, None, prepared, eps=1e-5)
    assert stub_recorder.last().name == b"pkv_add_rmsnorm_prep_f32"
    assert list(stub_recorder.last().grid) == [2, 1, 1]  # a block per row
    decode.silu_mul_prep(dev, gu, None, prepared)
    assert stub_recorder.last().name == b"pkv_silu_mul_prep_f32"
    assert list(stub_recorder.last().grid) == [1, 1, 1]  # 2 rows x 2 groups: 4 warps of 8
    qkv_rope_write_kv(pool, 0, qkv, q, tables, q_heads=4, theta=1e4)
    assert stub_recorder.last().name == b"pkv_qkv_rope_kv_write_f16"
    assert list(stub_recorder.last().grid) == [2, 1, 1]  # 2 rows x 8 heads x 32 pairs / 256
    assert stub_recorder.count == count + 3
    pool.close()


def test_prepared_x_needs_the_tensor_core_gemv(stub_device, monkeypatch):
    monkeypatch.delenv("PAGEDKV_GEMV_MFMA", raising=False)  # the stub's gfx90a: f32 GEMV
    gemv = Gemv(stub_device, "hfq4g256", 64, 512, 1)
    with pytest.raises(InvalidArgument, match="no prepared x off the tensor-core kernel"):
        gemv.prepared_x()


def test_rope_write_fusable_pools(stub_device):
    from pagedkv.pool import LayerKVPool, PoolGeometry
    pools = {dtype: LayerKVPool(PoolGeometry(1, 2, hd, 16, dtype), 4, backend="device",
                                device=stub_device)
             for dtype, hd in (("float16", 64), ("bfloat16", 64), ("q8", 64))}
    pools["q8 d32"] = LayerKVPool(PoolGeometry(1, 2, 32, 16, "q8"), 4, backend="device",
                                  device=stub_device)
    assert {k: rope_write_fusable(p) for k, p in pools.items()} == {
        "float16": True, "bfloat16": True, "q8": True, "q8 d32": False}
    for p in pools.values():
        p.close()


@pytest.mark.parametrize("kv_dtype,saved_per_layer", [("float16", 5), ("q8", 6)])
def test_fused_step_saves_launches(stub_device, stub_recorder, monkeypatch, kv_dtype,
                                   saved_per_layer):
    """Per layer the fused step drops the QKV, O, gate/up and down preps and the KV write(s)
    (q8: K and V apart); the final norm's prep goes too."""
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    dev = stub_device
    weights = DecoderWeights(dev, DecoderHostWeights.tiled(SMALL, "hfq4g256", 0))
    pool, tables = _step_parts(dev, kv_dtype, 3)
    # attn+prep:o is opt-in: no faster on the H200 (docs/performance.md)
    assert "attn+prep:o" not in DecoderStep(dev, weights, pool, 3, 64, fuse=True).fused
    monkeypatch.setenv("PAGEDKV_DECODE_FUSE_ATTN_PREP", "1")
    launches = {}
    for fuse in (False, True):
        step = DecoderStep(dev, weights, pool, 3, 64, fuse=fuse)
        count = stub_recorder.count
        step.run(tables)
        launches[fuse] = stub_recorder.count - count
        assert step.fused == (("norm+prep:qkv", "norm+prep:gate_up", "norm+prep:lm_head",
                               "attn+prep:o", "silu+prep:down", "rope+kv_write")
                              if fuse else ())
    assert launches[False] - launches[True] == SMALL.num_layers * saved_per_layer + 1
    monkeypatch.setenv("PAGEDKV_DECODE_FUSE", "0")
    assert DecoderStep(dev, weights, pool, 3, 64).fused == ()
    # chunked GEMVs (8-row calls for 9 rows): no prepared-x fusion, RoPE + KV write still
    pool9, _ = _step_parts(dev, kv_dtype, 9)
    monkeypatch.delenv("PAGEDKV_DECODE_FUSE")
    assert DecoderStep(dev, weights, pool9, 9, 128, gemv_rows=8).fused == ("rope+kv_write",)
    pool.close()
    pool9.close()


@pytest.mark.parametrize("fuse", [True, False])
def test_step_refuses_a_sequence_past_max_seq_len_before_launching(stub_device, stub_recorder,
                                                                    monkeypatch, fuse):
    """A sequence longer than the step's attention workspace is refused before the first
    launch: the norm, the QKV GEMV and the RoPE KV write into the pool used to run first."""
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    monkeypatch.setenv("PAGEDKV_ATTN_PARTITION_TOKENS", "16")
    from pagedkv.bench.decode import build_adapter
    dev = stub_device
    weights = DecoderWeights(dev, DecoderHostWeights.tiled(SMALL, "hfq4g256", 0))
    pool, adapter, seqs = build_adapter(dev, SMALL, "float16", 2, [5, 40], RNG)
    adapter.record_decode_tokens(seqs, np.zeros(2, np.uint32))
    tables = DeviceDecodeBatch.upload(dev, adapter.prepare_decode(seqs))
    step = DecoderStep(dev, weights, pool, 2, 16, fuse=fuse)
    count = stub_recorder.count
    with pytest.raises(InvalidArgument, match="a sequence of 41 tokens.*larger max_seq_len"):
        step.run(tables)
    assert stub_recorder.count == count
    pool.close()


def _stub_step_and_another_gpu(dev, monkeypatch, fuse: bool):
    """``(other, weights, pool, tables, step)``: a batch-2 step on the stub with random x,
    and a copy of its device with ordinal 1 (another GPU to the checks)."""
    import copy
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")
    other = copy.copy(dev)
    other.ordinal = 1
    weights = DecoderWeights(dev, DecoderHostWeights.tiled(SMALL, "hfq4g256", 0))
    pool, tables = _step_parts(dev, "float16", 2)
    step = DecoderStep(dev, weights, pool, 2, 64, fuse=fuse)
    step.x.copy_from(RNG.standard_normal((2, SMALL.d_model)).astype(np.float32))
    return other, weights, pool, tables, step


@pytest.mark.parametrize("fuse", [True, False])
def test_step_checks_every_input_before_the_first_launch(stub_device, stub_recorder,
                                                         monkeypatch, fuse):
    """A freed (or other-GPU) weight, norm or output is refused before the step's first launch:
    each launcher checked its own arrays only, so after weights.free() the first norm (x +=
    residual) launched before the QKV GEMV refused its freed weights, and a bad layer-1 or
    final norm came after whole layers had written the pool."""
    dev = stub_device
    other, weights, pool, tables, step = _stub_step_and_another_gpu(dev, monkeypatch, fuse)
    x, blocks = step.x.to_numpy(), [pool.read_block(b) for b in range(pool.num_blocks)]
    qkv_shape = weights.layers[0]["qkv"].array.shape
    freed = "was freed; allocate a new one (DeviceArray.empty / from_numpy)"
    count = stub_recorder.count
    weights.final_norm = other.array(np.ones(SMALL.d_model, np.float32))
    with pytest.raises(InvalidArgument) as err:
        step.run(tables)
    assert str(err.value) == (f"final_norm: weight: on {other!r}, the launch on {dev!r}; make it "
                              f"on the launch's device")
    weights.ffn_norm[1].free()
    with pytest.raises(InvalidArgument) as err:
        step.run(tables)
    assert str(err.value) == (f"layer 1 ffn_norm: weight: DeviceArray(shape=({SMALL.d_model},), "
                              f"dtype=float32) {freed}")
    weights.free()
    with pytest.raises(InvalidArgument) as err:
        step.run(tables)
    assert str(err.value) == f"layer 0 qkv: w: DeviceArray(shape={qkv_shape}, dtype=uint8) {freed}"
    assert stub_recorder.count == count  # nothing launched
    assert np.array_equal(step.x.to_numpy(), x)
    assert all(np.array_equal(pool.read_block(b), blocks[b]) for b in range(pool.num_blocks))
    pool.close()


def test_a_step_that_passed_its_checks_still_refuses_a_weight_freed_or_swapped_since(
        stub_device, stub_recorder, monkeypatch):
    """run skips the full weight checks (~45 us a layer of host time) while its weights are
    the parts that passed them last time and none is freed: a weight freed after a good step,
    or a part swapped for one of another GPU, is still refused before the first launch."""
    dev = stub_device
    other, weights, pool, tables, step = _stub_step_and_another_gpu(dev, monkeypatch, True)
    step.run(tables)
    assert step._passed  # the fast path is armed
    step.run(tables)
    x, blocks = step.x.to_numpy(), [pool.read_block(b) for b in range(pool.num_blocks)]
    count = stub_recorder.count
    weights.attn_norm[1] = other.array(np.ones(SMALL.d_model, np.float32))
    with pytest.raises(InvalidArgument) as err:
        step.run(tables)
    assert str(err.value) == (f"layer 1 attn_norm: weight: on {other!r}, the launch on "
                              f"{dev!r}; make it on the launch's device")
    weights.attn_norm[1] = dev.array(np.ones(SMALL.d_model, np.float32))
    step.run(tables)  # a good part again: passes and re-arms
    x, blocks = step.x.to_numpy(), [pool.read_block(b) for b in range(pool.num_blocks)]
    count = stub_recorder.count
    down_shape = weights.layers[1]["down"].array.shape
    weights.layers[1]["down"].array.free()
    with pytest.raises(InvalidArgument) as err:
        step.run(tables)
    assert str(err.value) == (f"layer 1 down: w: DeviceArray(shape={down_shape}, dtype=uint8) "
                              "was freed; allocate a new one (DeviceArray.empty / from_numpy)")
    assert stub_recorder.count == count  # nothing launched
    assert np.array_equal(step.x.to_numpy(), x)
    assert all(np.array_equal(pool.read_block(b), blocks[b]) for b in range(pool.num_blocks))
    pool.close()


def test_decoder_weights_check_the_host_weights_before_uploading(stub_device, monkeypatch):
    """A host missing a layer, a matrix, bytes of a projection or a norm of the right shape
    is refused naming it before anything is allocated; a missing layer used to upload and
    then fail in DecoderStep.run with an IndexError after 11 launches."""
    from kernels_support import track_allocations
    dev = stub_device
    host = DecoderHostWeights.tiled(SMALL, "hfq4g256", 0)

    def changed(**kw):
        return replace(host, **kw)

    short_qkv = [dict(layer) for layer in host.layers]
    short_qkv[1]["qkv"] = short_qkv[1]["qkv"][:-136]  # one 16-row tile-group short
    no_down = [dict(layer) for layer in host.layers]
    del no_down[1]["down"]
    cases = [
        (changed(layers=host.layers[:1]), r"host.layers: 1 layers, the shape has 2"),
        (changed(layers=no_down), r"host.layers\[1\]: no \['down'\]"),
        (changed(layers=short_qkv),
         r"host.layers\[1\]\['qkv'\]: uint8\[69496\], expected uint8\[69632\].*q_heads \+ 2"),
        (changed(fmt="hfq6g256"), r"host.layers\[0\]\['qkv'\]: .*expected uint8\[102400\]"),
        (changed(fmt="q4k"), r"fmt='q4k': the GPU kernels take"),
        (changed(ffn_norm=[np.ones(256, np.float32)] * 3), r"host.ffn_norm: 3 layers"),
        (changed(attn_norm=[host.attn_norm[0], np.ones(256, np.float64)]),
         r"host.attn_norm\[1\]: float64\[256\], expected float32\[256\]"),
        (changed(final_norm=np.ones(128, np.float32)), r"host.final_norm: float32\[128\]"),
    ]
    live = track_allocations(monkeypatch, dev)
    for bad, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            DecoderWeights(dev, bad)
    assert not live
    weights = DecoderWeights(dev, host)
    assert repr(weights) == (f"DecoderWeights({SMALL}, fmt='hfq4g256', {weights.nbytes} "
                             f"projection bytes on {dev.properties.name!r})")


# --- GPU ------------------------------------------------------------------------------------


def _tensor_core_gemv(device, fmt, k, batch, f16_x=False):
    try:
        gemv = Gemv(device, fmt, 64, k, batch, f16_x=f16_x)
    except InvalidArgument as e:  # f16_x=True off NVIDIA sm_80+
        pytest.skip(str(e))
    if not gemv.tensor_cores:
        pytest.skip(f"{device!r}: no tensor-core GEMV for {fmt}")
    return gemv


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch,dim,residual", [(1, 4096, False), (3, 4096, True),
                                                (9, 1280, True), (32, 4096, True),
                                                (2, 10240, True), (2, 10240, False)])  # past the cached vecs
@pytest.mark.parametrize("f16_x", [False, True], ids=["planes", "f16x"])
def test_gpu_rmsnorm_prep_writes_the_prep_kernels_bytes(device, fmt, batch, dim, residual, f16_x):
    x = (RNG.standard_normal((batch, dim)) * 3).astype(np.float32)
    x[0, :256] *= 1e-30  # a tiny group: the step's exponent clamp
    r = RNG.standard_normal((batch, dim)).astype(np.float32)
    w = device.array((1 + 0.1 * RNG.standard_normal(dim)).astype(np.float32))
    res = device.array(r) if residual else None
    plain, fused = (_tensor_core_gemv(device, fmt, dim, batch, f16_x) for _ in range(2))
    for g in (plain, fused):  # poison the scratch: every byte must be written
        g._xq.fill_bytes(0xA5)
        g._xs.fill_bytes(0xFF)
    x_plain, x_fused = device.array(x), device.array(x)
    y = poisoned(device, (batch, dim), np.float32)
    decode.add_rmsnorm(device, x_plain, res, w, y, eps=1e-5)
    plain.prepare(y)
    y_fused = poisoned(device, (batch, dim), np.float32)
    decode.add_rmsnorm_prep(device, x_fused, res, w, y_fused, fused.prepared_x(), eps=1e-5)
    device.synchronize()
    assert _prepared_bytes(fused.prepared_x()) == _prepared_bytes(plain.prepared_x())
    np.testing.assert_array_equal(y_fused.to_numpy(), y.to_numpy())
    np.testing.assert_array_equal(x_fused.to_numpy(), x_plain.to_numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("f16_x", [False, True], ids=["planes", "f16x"])
def test_gpu_rmsnorm_prep_gives_the_plain_bits_on_many_long_rows(device, fmt, residual, f16_x):
    """128 fresh rows of dim 10240 (past the cached vecs) per case: the fused kernel's
    1/rms, y and prepared x must be the plain norm's and prep's bits on every row. Before
    add_squares (hip/decode.hip) the compiler contracted the sum of squares into FMAs
    differently in the two kernels, and about one row in 25 got another 1/rms (deterministic
    per input, so runs of a few rows passed most of the time: docs/reliability.md)."""
    batch, dim = 32, 10240
    w = device.array((1 + 0.1 * RNG.standard_normal(dim)).astype(np.float32))
    plain, fused = (_tensor_core_gemv(device, fmt, dim, batch, f16_x) for _ in range(2))
    for _ in range(4):
        x = (RNG.standard_normal((batch, dim)) * 3).astype(np.float32)
        res = device.array(RNG.standard_normal((batch, dim)).astype(np.float32)) \
            if residual else None
        for g in (plain, fused):
            g._xq.fill_bytes(0xA5)
            g._xs.fill_bytes(0xFF)
        y, y_fused = (poisoned(device, (batch, dim), np.float32) for _ in range(2))
        x_plain, x_fused = device.array(x), device.array(x)
        decode.add_rmsnorm(device, x_plain, res, w, y, eps=1e-5)
        plain.prepare(y)
        decode.add_rmsnorm_prep(device, x_fused, res, w, y_fused, fused.prepared_x(), eps=1e-5)
        device.synchronize()
        yp, yf = y.to_numpy(), y_fused.to_numpy()
        rows = np.nonzero(np.any(yp.view(np.uint32) != yf.view(np.uint32), axis=1))[0]
        assert rows.size == 0, f"rows whose y differs: {rows.tolist()}"
        assert _prepared_bytes(fused.prepared_x()) == _prepared_bytes(plain.prepared_x())


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["hfq4g256", "mq4g256v2"])
@pytest.mark.parametrize("batch,ffn", [(1, 14336), (5, 1024), (32, 14336)])
@pytest.mark.parametrize("f16_x", [False, True], ids=["planes", "f16x"])
def test_gpu_silu_mul_prep_writes_the_prep_kernels_bytes(device, fmt, batch, ffn, f16_x):
    gu = device.array((RNG.standard_normal((batch, 2 * ffn)) * 4).astype(np.float32))
    plain, fused = (_tensor_core_gemv(device, fmt, ffn, batch, f16_x) for _ in range(2))
    for g in (plain, fused):
        g._xq.fill_bytes(0xA5)
        g._xs.fill_bytes(0xFF)
    out = poisoned(device, (batch, ffn), np.float32)
    decode.silu_mul(device, gu, out)
    plain.prepare(out)
    out_fused = poisoned(device, (batch, ffn), np.float32)
    decode.silu_mul_prep(device, gu, out_fused, fused.prepared_x())
    device.synchronize()
    assert _prepared_bytes(fused.prepared_x()) == _prepared_bytes(plain.prepared_x())
    np.testing.assert_array_equal(out_fused.to_numpy(), out.to_numpy())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "q8"])
def test_gpu_rope_kv_write_writes_the_split_and_write_bytes(device, kv_dtype):
    """Layer 0 through the split and write_kv, layer 1 through the fused kernel, both
    layers' K and V filled alike first: every pool byte and q must agree (a padded token,
    slot -1, writes nothing)."""
    from pagedkv.kernels.paged import write_kv
    shape = replace(LLAMA3_8B, num_layers=2)  # 32 / 8 heads of 128
    batch = 5
    pool, tables = _step_parts(device, kv_dtype, batch, shape)
    slots = tables.slot_mapping.to_numpy()
    slots[3] = -1
    tables.slot_mapping.copy_from(slots)
    tables.positions.copy_from(np.array([0, 1, 1000, 8191, 32767], np.int32))
    for layer in range(2):
        for arr in pool.layer(layer):
            arr.fill_bytes(0x3C)
    heads = shape.q_heads + 2 * shape.kv_heads
    qkv = device.array(RNG.standard_normal((batch, heads * shape.head_dim)).astype(np.float32))
    q_plain = poisoned(device, (batch, shape.q_heads, shape.head_dim), np.float32)
    k, v = (poisoned(device, (batch, shape.kv_heads, shape.head_dim), np.float32)
            for _ in range(2))
    decode.qkv_rope_split(device, qkv, tables.positions, q_plain, k, v, q_heads=shape.q_heads,
                          kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                          theta=shape.rope_theta)
    write_kv(pool, 0, k, v, tables)
    q_fused = poisoned(device, (batch, shape.q_heads, shape.head_dim), np.float32)
    qkv_rope_write_kv(pool, 1, qkv, q_fused, tables, q_heads=shape.q_heads,
                      theta=shape.rope_theta)
    device.synchronize()
    np.testing.assert_array_equal(q_fused.to_numpy().view(np.uint32),
                                  q_plain.to_numpy().view(np.uint32))
    for plain_arr, fused_arr in zip(pool.layer(0), pool.layer(1), strict=True):
        got, want = fused_arr.to_numpy().view(np.uint8), plain_arr.to_numpy().view(np.uint8)
        assert (want != 0x3C).any()  # the write did land
        np.testing.assert_array_equal(got, want)
    pool.close()


# (fmt, kv_dtype, batch, (heads, kv_heads, head_dim)): every weight format x KV dtype x
# batch at Llama's heads (a 256-group spans 2 heads), then a group of 4 heads (head_dim
# 64) and one head per group (head_dim 256).
_REDUCE_PREP_CASES = [
    *((fmt, kv, b, (32, 8, 128)) for fmt, kv, b in itertools.product(
        ("hfq4g256", "mq4g256v2"), ("float16", "bfloat16", "q8", "fwht4/q8"), (1, 3, 8))),
    ("mq4g256v2", "float16", 3, (8, 2, 64)), ("hfq4g256", "q8", 8, (8, 2, 64)),
    ("mq4g256v2", "bfloat16", 3, (8, 2, 256)), ("hfq4g256", "fwht4/q8", 8, (4, 2, 256))]
# Lengths per batch: one partition and many, a partition's edges (16, 64 tokens), an empty
# sequence (zeros), 1100 of the launch's most.
_REDUCE_PREP_LENS = {1: [1025], 3: [65, 1, 700], 8: [0, 1, 63, 64, 65, 300, 1025, 1100]}


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,kv_dtype,batch,heads", _REDUCE_PREP_CASES)
def test_gpu_attention_reduce_prep_writes_the_reduce_and_prep_bytes(device, fmt, kv_dtype,
                                                                    batch, heads):
    """PagedAttention.run_prep (partitions, then pkv_attention_reduce_prep_f32) against run
    (partitions, then pkv_paged_attention_reduce) followed by Gemv.prepare of its output:
    the same attention output and the same prepared-x bytes, at the partition size the
    launch picks and at 16 tokens (up to 69 partitions)."""
    from test_kernels_kvcache import _paged_case
    num_heads, kv_heads, head_dim = heads
    k_pool, v_pool, tables, lens = _paged_case(_REDUCE_PREP_LENS[batch], kv_heads=kv_heads,
                                               head_dim=head_dim, block_size=16,
                                               kv_dtype=kv_dtype)
    q = (RNG.standard_normal((batch, num_heads, head_dim)) * 2).astype(np.float32)
    args = [device.array(a) for a in (q, k_pool, v_pool, tables, lens)]
    k = num_heads * head_dim
    for tokens in (None, 16):
        attn = kvcache.PagedAttention(device, num_seqs=batch, num_heads=num_heads,
                                      kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                                      max_seq_len=1100, kv_dtype=kv_dtype,
                                      partition_tokens=tokens)
        assert attn.prep_fusable and attn.max_partitions > 1, attn
        plain, fused = (_tensor_core_gemv(device, fmt, k, batch, batch == 8) for _ in range(2))
        for g in (plain, fused):  # poison the scratch: every byte must be written
            g._xq.fill_bytes(0xA5)
            g._xs.fill_bytes(0xFF)
        out = poisoned(device, q.shape, np.float32)
        attn.run(*args, out)
        plain.prepare(out.view((batch, k)))
        out_fused = poisoned(device, q.shape, np.float32)
        attn.run_prep(*args, fused.prepared_x(), out_fused)
        device.synchronize()
        want = out.to_numpy()
        assert np.isfinite(want).all(), attn
        np.testing.assert_array_equal(out_fused.to_numpy().view(np.uint32), want.view(np.uint32),
                                      err_msg=repr(attn))
        assert _prepared_bytes(fused.prepared_x()) == _prepared_bytes(plain.prepared_x()), attn
        assert np.isfinite(fused.prepared_x().xs.to_numpy()).all()  # every (group, row) step
        if batch == 8:  # the empty sequence's row is zeros
            assert not want[0].any()


def _step_case(device, shape, fmt, kv_dtype, contexts, seed):
    """Random weights (tiled), context KV, inputs and uploaded tables for one step."""
    from pagedkv.bench.decode import random_context
    rng = np.random.default_rng(seed)
    weights = DecoderWeights(device, DecoderHostWeights.tiled(shape, fmt, seed))
    pool, _, seqs, batch = random_context(device, shape, kv_dtype, contexts, rng)
    tables = DeviceDecodeBatch.upload(device, batch)
    x = rng.standard_normal((len(seqs), shape.d_model), dtype=np.float32)
    return weights, pool, tables, x


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [SMALL, replace(LLAMA3_8B, num_layers=2, ffn=1024, vocab=512)],
                         ids=["d256-hd64", "d4096-hd128"])
@pytest.mark.parametrize("fmt,kv_dtype,batch", [
    ("hfq4g256", "float16", 1), ("mq4g256v2", "bfloat16", 1), ("mq4g256v2", "q8", 3),
    ("hfq4g256", "q8", 8), ("hfq4g256", "float16", 8)])
def test_gpu_decode_step_fused_equals_unfused_bytes(device, monkeypatch, shape, fmt, kv_dtype,
                                                    batch):
    """The whole step fused (every fusion, attn+prep:o included) and unfused on the same
    weights, pool, tables and inputs: the same logits, residual stream and pool bytes.
    Contexts cross several partitions (the launch splits short contexts into 64+ tokens)."""
    monkeypatch.setenv("PAGEDKV_DECODE_FUSE_ATTN_PREP", "1")
    contexts = [1025, 300, 64, 65, 1, 700, 129, 999][:batch]
    weights, pool, tables, x = _step_case(device, shape, fmt, kv_dtype, contexts, 7)
    results = {}
    for fuse in (False, True):  # the fused step rewrites this token's K/V: the same bytes
        step = DecoderStep(device, weights, pool, batch, max(contexts) + 1, fuse=fuse)
        if fuse and device.backend == "cuda":
            assert "attn+prep:o" in step.fused, step
        step.x.copy_from(x)
        step.logits.fill_bytes(0xFF)
        step.run(tables)
        device.synchronize()
        assert np.isfinite(step.logits.to_numpy()).all()
        results[fuse] = (step.logits.to_numpy().tobytes(), step.x.to_numpy().tobytes(),
                         [a.to_numpy().tobytes() for layer in range(shape.num_layers)
                          for a in pool.layer(layer)])
    assert results[True][0] == results[False][0], "logits"
    assert results[True][1] == results[False][1], "residual stream"
    assert results[True][2] == results[False][2], "pool"
    weights.free()
    pool.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("fmt,kv_dtype,batch", [
    ("hfq4g256", "float16", 1), ("mq4g256v2", "q8", 8), ("mq4g256", "bfloat16", 9),
    ("hfq4g256", "q8", 32)])
def test_gpu_decode_step_fused_and_unfused_match_the_float64_step(device, fmt, kv_dtype,
                                                                  batch, fuse):
    from pagedkv.bench.decode import check_step
    contexts = tuple(int(c) for c in RNG.integers(1, 400, batch))
    result = check_step(device, fmt, kv_dtype, contexts=contexts, shape=SMALL, fuse=fuse)
    assert result["ok"], result
    if fuse and device.backend == "cuda":  # sm_80+: the tensor-core GEMV, every fusion
        # the attention reduce + O prep fusion is opt-in (PAGEDKV_DECODE_FUSE_ATTN_PREP=1)
        want = {"norm+prep:qkv", "norm+prep:gate_up", "norm+prep:lm_head", "silu+prep:down",
                "rope+kv_write"}
        if env_bool(FUSE_ATTN_PREP_ENV, False):
            want.add("attn+prep:o")
        assert sorted(result["fused"]) == sorted(want), result

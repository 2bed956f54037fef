"""Programmatic Dependent Launch (pagedkv.kernels.device / runtime, hip/pagedkv_compat.h).

CPU: the ctypes launch structs match cuda.h's layout (sizes and offsets of CUDA 12/13's
CUlaunchConfig and CUlaunchAttribute, from a C program compiled against cuda.h 13.0), the
selection rule, and which launches take the PDL path (a recording runtime on the HIP
stub). GPU: a whole decode step gives the same bytes with PDL on and off, eagerly and
replayed from a captured graph (an early start that read unfinished outputs would not)."""

from __future__ import annotations

import ctypes
from dataclasses import replace

import numpy as np
import pytest

from pagedkv.kernels import decode
from pagedkv.kernels.decoder import LLAMA3_8B
from pagedkv.kernels.device import PDL_ENV, Device, dependent_launch_supported
from pagedkv.kernels.runtime import _PROGRAMMATIC_SERIALIZATION, _LaunchAttribute, _LaunchConfig

SMALL_SHAPE = replace(LLAMA3_8B, num_layers=2, d_model=256, q_heads=4, kv_heads=2, head_dim=64,
                      ffn=512, vocab=300, rope_theta=10000.0)


def test_launch_structs_have_cuda_h_layout():
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset) == (32, 40, 48)
    # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6, value int 1
    assert _PROGRAMMATIC_SERIALIZATION.id == 6 and _PROGRAMMATIC_SERIALIZATION.value[0] == 1


@pytest.mark.parametrize("backend,arch,driver,targets,want", [
    ("cuda", "sm_90", 12030, ("sm_80", "sm_90"), True),
    ("cuda", "sm_100", 13000, ("sm_80", "sm_90"), True),  # sm_90 PTX, JIT-compiled
    ("cuda", "sm_90", 12020, ("sm_80", "sm_90"), False),  # capture drops the attribute
    ("cuda", "sm_80", 13000, ("sm_80", "sm_90"), False),  # no griddepcontrol before sm_90
    ("cuda", "sm_90", 13000, ("sm_80",), False),  # sm_80 code: no wait in the kernels
    ("cuda", "sm_90", 13000, ("sm_100",), False),  # no code for this device at all
    ("hip", "gfx90a", 60000, ("sm_90",), False),
])
def test_dependent_launch_selection(backend, arch, driver, targets, want):
    assert dependent_launch_supported(backend, arch, driver, targets) is want


def test_only_kernels_that_wait_take_the_pdl_path(stub_device, stub_recorder, monkeypatch):
    dev = stub_device
    assert dev.dependent_launch is False  # HIP: never
    pdl_launches = []  # what Runtime.launch_dependent was asked to launch
    monkeypatch.setattr(dev, "dependent_launch", True)
    monkeypatch.setattr(dev.runtime, "launch_dependent",
                        lambda function, *rest: pdl_launches.append(function))
    f32 = np.float32
    x, w, y = dev.empty((2, 256), f32), dev.empty((256,), f32), dev.empty((2, 256), f32)
    count = stub_recorder.count
    decode.add_rmsnorm(dev, x, None, w, y, eps=1e-5)
    decode.silu_mul(dev, dev.empty((2, 512), f32), y)
    assert len(pdl_launches) == 2 and stub_recorder.count == count  # not the plain launch
    from pagedkv.kernels.kvcache import kv_q8_write
    from pagedkv.pool import LayerKVPool, PoolGeometry
    pool = LayerKVPool(PoolGeometry(1, 2, 64, 16, "q8"), 4, backend="device", device=dev)
    kv_q8_write(dev, dev.empty((1, 2, 64), f32), dev.array(np.array([3], np.int64)),
                pool.layer(0)[0])
    assert len(pdl_launches) == 2 and stub_recorder.count == count + 1  # plain: no wait
    pool.close()


def test_the_env_knob_turns_pdl_off(stub_runtime, monkeypatch):
    from pagedkv.kernels import device as device_module
    monkeypatch.setattr(device_module, "dependent_launch_supported", lambda *a: True)
    assert Device(stub_runtime, 0).dependent_launch is True
    monkeypatch.setenv(PDL_ENV, "0")
    assert Device(stub_runtime, 0).dependent_launch is False


# --- GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", ["float16", "q8"])
def test_gpu_step_bytes_equal_with_and_without_pdl(device, kv_dtype, monkeypatch):
    from pagedkv.bench.decode import build_adapter
    from pagedkv.kernels import Graph, Stream
    from pagedkv.kernels.decoder import DecoderHostWeights, DecoderStep, DecoderWeights
    from pagedkv.kernels.paged import DeviceDecodeBatch
    if not device.dependent_launch:
        pytest.skip(f"{device!r}: no Programmatic Dependent Launch (sm_90+, CUDA 12.3+)")
    shape = replace(LLAMA3_8B, num_layers=4, vocab=4096)
    rng = np.random.default_rng(7)
    weights = DecoderWeights(device, DecoderHostWeights.tiled(shape, "hfq4g256", 7))
    pool, adapter, seqs = build_adapter(device, shape, kv_dtype, 1, [700], rng)
    for layer in range(shape.num_layers):
        for arr in pool.layer(layer):
            arr.fill_bytes(0x2E)
    adapter.record_decode_tokens(seqs, np.zeros(1, np.uint32))
    tables = DeviceDecodeBatch.upload(device, adapter.prepare_decode(seqs))
    step = DecoderStep(device, weights, pool, 1, 701)
    x0 = rng.standard_normal((1, shape.d_model), dtype=np.float32)
    stream = Stream(device)

    def outputs(run) -> bytes:
        step.x.copy_from(x0)
        step.logits.fill_bytes(0xFF)
        run()
        stream.synchronize()
        device.synchronize()
        return step.logits.to_numpy().tobytes() + step.x.to_numpy().tobytes()

    monkeypatch.setattr(device, "dependent_launch", False)
    plain = outputs(lambda: step.run(tables, stream=stream))
    monkeypatch.setattr(device, "dependent_launch", True)
    for _ in range(3):
        assert outputs(lambda: step.run(tables, stream=stream)) == plain
    graph = Graph(device, stream, lambda s: step.run(tables, stream=s))
    for _ in range(3):
        assert outputs(lambda: graph.launch(stream)) == plain
    weights.free()
    pool.close()


def _ptx_entries(compiled_ahead, source: str) -> dict[str, str]:
    """The sm_90 PTX of hip/<source>.hip, per kernel (entry name -> its text)."""
    import re
    import shutil
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc: the sm_90 code cannot be inspected")
    text = compiled_ahead.output(f"ptx:{source}").read_text()
    starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry (\w+)\(", text)]
    ends = [s for s, _ in starts[1:]] + [len(text)]
    return {name: text[s:e] for (s, name), e in zip(starts, ends, strict=True)}


@pytest.mark.compile_ahead("ptx:weights", "ptx:decode")
def test_every_kernel_launched_early_waits_in_its_sm90_code(stub_device, monkeypatch,
                                                            compiled_ahead):
    """The kernels a decode step (fused and not) and a batch 1-8 GEMV look up with
    dependent_launch=True must hold griddepcontrol.wait in their sm_90 code: one that did
    not would read the previous kernel's outputs before they are written."""
    from pagedkv.bench.decode import build_adapter
    from pagedkv.kernels.decoder import DecoderHostWeights, DecoderStep, DecoderWeights
    from pagedkv.kernels.paged import DeviceDecodeBatch
    monkeypatch.setenv("PAGEDKV_GEMV_MFMA", "1")  # the GEMVs' own names on the stub's gfx90a
    shape = replace(SMALL_SHAPE, num_layers=1)
    weights = DecoderWeights(stub_device, DecoderHostWeights.tiled(shape, "mq4g256v2", 0))
    rng = np.random.default_rng(0)
    for kv_dtype in ("float16", "bfloat16", "q8"):
        pool, adapter, seqs = build_adapter(stub_device, shape, kv_dtype, 2, [5, 9], rng)
        adapter.record_decode_tokens(seqs, np.zeros(2, np.uint32))
        tables = DeviceDecodeBatch.upload(stub_device, adapter.prepare_decode(seqs))
        for fuse in (True, False):
            DecoderStep(stub_device, weights, pool, 2, 16, fuse=fuse).run(tables)
        pool.close()
    early = {(source, name) for source, name, dependent in stub_device._kernels if dependent}
    plain = {(source, name) for source, name, dependent in stub_device._kernels if not dependent}
    assert ("weights", "pkv_gemv_mma_mq4g256v2_n1") in early and \
        ("decode", "pkv_qkv_rope_kv_write_q8") in early and ("decode", "pkv_kv_write_bf16") in early
    assert any(source == "kvcache" for source, _ in plain)  # attention: launched plainly
    for source in {s for s, _ in early}:
        entries = _ptx_entries(compiled_ahead, source)
        missing = [name for s, name in early if s == source
                   and "griddepcontrol.wait" not in entries[name]]
        assert missing == [], f"{source}.hip: {missing} are launched early but never wait"

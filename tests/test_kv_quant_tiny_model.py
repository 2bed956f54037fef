"""The reference model and ``pagedkv demo`` on a KV mode (docs/kv-quant.md): paged == flat
bit for bit on both backends, the demo's --kv-mode / --kv-v / PAGEDKV_KV_MODE, refusals, and
a sequence stepping through kv_adaptive's tiers while it generates."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedkv import errors
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.cli import main
from pagedkv.kv_adaptive import KVAdaptive
from pagedkv.tiny_model import PagedKV, ReferenceConfig, ReferenceModel
from pagedkv.tiny_model.serving import build_paged_adapter

HAVE_MLX = importlib.util.find_spec("mlx") is not None
BACKENDS = ["numpy", pytest.param("mlx", marks=pytest.mark.skipif(not HAVE_MLX,
                                                                   reason="MLX not installed"))]
SMALL = ["demo", "--no-cold", "--requests", "3", "--system-tokens", "32", "--fewshot-tokens",
         "16", "--user-tokens", "8", "--new-tokens", "4"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype,hd", [("q8", 32), ("fwht2/q8", 128), ("fwht3/lloyd3", 256),
                                         ("fwht4/fwht4", 128), ("fwht4/fwht2", 128)])
def test_paged_equals_flat_bit_for_bit_on_a_kv_mode(backend, kv_dtype, hd):
    model = ReferenceModel(ReferenceConfig(head_dim=hd, seed=3), backend=backend,
                           kv_dtype=kv_dtype)
    adapter = build_paged_adapter(model, block_size=16, num_blocks=8)
    assert adapter.pool.geometry.dtype == kv_dtype
    prompt = np.random.default_rng(1).integers(0, 512, 45)
    adapter.reset_for_new_request(0)
    adapter.allocate_suffix_blocks(0, 45)
    paged = model.generate(prompt, 6, PagedKV(adapter, 0))
    flat = model.generate(prompt, 6, model.new_flat_kv())
    np.testing.assert_array_equal(paged.tokens, flat.tokens)
    assert paged.logits.tobytes() == flat.logits.tobytes()
    # and the KV mode is used: the float32 model gives other logits
    exact = ReferenceModel(model.config, model.weights, backend=backend)
    assert exact.generate(prompt, 6, exact.new_flat_kv()).logits.tobytes() != \
        flat.logits.tobytes()


def test_the_model_refuses_a_mode_its_head_dim_cannot_store():
    with pytest.raises(errors.InvalidArgument, match="fwht4 needs head_dim 128 or 256"):
        ReferenceModel(ReferenceConfig(head_dim=16), kv_dtype="fwht4/q8")
    with pytest.raises(errors.InvalidArgument, match="computes in float32"):
        ReferenceModel(ReferenceConfig(head_dim=16), kv_dtype="bfloat16")
    assert "kv_dtype='q8'" in repr(ReferenceModel(ReferenceConfig(head_dim=32), kv_dtype="q8"))


def test_demo_runs_on_a_kv_mode_and_keeps_parity(capsys):
    assert main(SMALL + ["--kv-mode", "fwht4", "--kv-v", "q8"]) == 0
    out = capsys.readouterr().out
    # 2 layers x 2 kv heads x (68 + 136) bytes at head_dim 128
    assert "KV cache: fwht4/q8 at head_dim 128, 816 bytes per token (39.8% of float16)" in out
    assert "parity: OK (3/3" in out


def test_demo_runs_an_fwht_v_at_head_dim_128(capsys):
    assert main(SMALL + ["--kv-mode", "fwht4", "--kv-v", "fwht4"]) == 0
    out = capsys.readouterr().out
    # 2 layers x 2 kv heads x (68 + 68) bytes at head_dim 128
    assert "KV cache: fwht4/fwht4 at head_dim 128, 544 bytes per token (26.6% of float16)" in out
    assert "parity: OK (3/3" in out


def test_demo_takes_the_mode_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("PAGEDKV_KV_MODE", "asym4")  # upstream's name of fwht4
    monkeypatch.setenv("PAGEDKV_KV_V", "lloyd2")
    assert main(SMALL) == 0
    assert "KV cache: fwht4/lloyd2 at head_dim 256" in capsys.readouterr().out


@pytest.mark.parametrize("argv,env,message", [
    (["--kv-mode", "fwht9"], {}, "--kv-mode = 'fwht9': accepted values are"),
    (["--kv-v", "lloyd4"], {}, "V 'lloyd4' (--kv-v) is a rotated V, which needs a rotated K"),
    (["--kv-v", "fwht4"], {}, "needs a rotated K"),
    (["--kv-mode", "fwht4", "--kv-v", "turbo4"], {}, "--kv-v = 'turbo4': accepted values"),
    (["--kv-mode", "bf16", "--kv-v", "q8"], {}, "K 'bf16' (--kv-mode) with V 'q8' (--kv-v)"),
    ([], {"PAGEDKV_KV_ADAPTIVE": "balanced"}, "the demo serves many sequences"),
    (["--kv-mode", "bf16"], {}, "computes in float32"),
])
def test_demo_refuses_bad_kv_modes_with_one_line(capsys, monkeypatch, argv, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert main(SMALL + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert "argument k" not in err and "argument v" not in err  # the flags, by name


def test_a_sequence_steps_through_kv_adaptive_while_it_generates():
    # head_dim 256, 2 kv heads, blocks of 16: balanced over max_seq 256 tokens starts with
    # room for 256 * 136 // 404 = 86 tokens, 80 in whole blocks, and steps down as
    # generation passes each threshold (cap - 64).
    model = ReferenceModel(ReferenceConfig(head_dim=256, seed=5), kv_dtype="fwht4/q8")
    ad = KVAdaptive.create("balanced", num_layers=2, num_kv_heads=2, head_dim=256,
                           block_size=16, max_seq=256, hash_seed=0)
    assert ad.plan.caps == [80, 128, 144, 192, 256]
    adapter = PagedKVCacheAdapter(ad.allocator, ad.pool, growth=False)
    steps = []
    ad.add_listener(lambda old, new: steps.append((adapter.num_tokens(0), new)))
    prompt = np.random.default_rng(2).integers(0, 512, 10)
    adapter.reset_for_new_request(0)
    adapter.allocate_suffix_blocks(0, 10)
    kvp = PagedKV(adapter, 0, adaptive=ad)
    gen = model.generate(prompt, 200, kvp)
    assert len(gen.tokens) == 200 and adapter.num_tokens(0) == 209
    # each step ran before the append that crossed cap - 64 (80-64=16, 64, 80, 128)
    assert steps == [(16, "fwht4/lloyd4"), (64, "fwht4/lloyd3"), (80, "fwht2/lloyd3"),
                     (128, "fwht2/lloyd2")]
    assert ad.pool.geometry.dtype == "fwht2/lloyd2" and ad.pool.num_blocks == 16
    # up to the first step (positions 0-15: the logits of 7 steps) the run is the fixed
    # fwht4/q8 cache's, bit for bit; then not
    fixed = model.generate(prompt, 200, model.new_flat_kv())
    assert gen.logits[:7].tobytes() == fixed.logits[:7].tobytes()
    assert gen.logits[7:].tobytes() != fixed.logits[7:].tobytes()
    with pytest.raises(errors.CapacityExceeded):
        model.forward(np.zeros(50, np.int64), kvp)

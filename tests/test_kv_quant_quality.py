"""The quality measurement behind docs/kv-quant.md (pagedkv.bench.kvquant_quality) and its
peer quantizers: known values of the peers, the attention-error engine against a per-head
loop oracle and against pinned values on a hand-made layer, and a quick run on mlx-lm
model code (skipped without mlx-lm, which only that script needs)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedkv.bench import kv_peers
from pagedkv.bench import kvquant_quality as kq
from pagedkv.quant import kv_rotated

RNG = np.random.default_rng()


def test_fp8_e4m3_rounding_known_values():
    y = np.array([448.0, 500.0, -1e9, 1.0, 1.0625, 1.125, 1.0 + 1 / 16 + 1e-9, 0.0,
                  2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 17.0, 19.0])
    want = [448.0, 448.0, -448.0, 1.0, 1.0, 1.125, 1.125, 0.0,
            2.0 ** -9, 0.0, 2.0 ** -8, 16.0, 20.0]  # ties to even: 1.0625 -> 1, 17 -> 16,
    # 1.5 subnormal steps -> 2
    np.testing.assert_array_equal(kv_peers.fp8_e4m3_round(y), want)
    x = RNG.standard_normal((64, 128))
    out = kv_peers.fp8_e4m3_tensor(x)
    assert np.abs(out).max() == pytest.approx(np.abs(x).max())
    assert np.abs(out - x).max() <= np.abs(x).max() / 448 * 16  # half a step of the top binade


def test_per_token_peers_known_values_and_error_bounds():
    # 8 levels over [-1, 2.5]: step 0.5 (exact in f16), so the grid points come back exactly
    # and 0.3 rounds to the nearest level, -1 + 3 * 0.5.
    row = np.array([[-1.0, 2.5, 0.0, 1.5, 0.3, -0.5, 0.75, 2.0]])
    np.testing.assert_array_equal(kv_peers.uint_token(3)(row),
                                  [[-1.0, 2.5, 0.0, 1.5, 0.5, -0.5, 1.0, 2.0]])
    np.testing.assert_array_equal(kv_peers.int8_token(np.array([[127.0, -63.4, 0.5]])),
                                  [[127.0, -63.0, 0.0]])   # 0.5 -> 0: ties to even
    x = RNG.standard_normal((300, 128)) * RNG.uniform(0.1, 10, (300, 1))
    step8 = np.abs(x).max(axis=1, keepdims=True) / 127
    assert (np.abs(kv_peers.int8_token(x) - x) <= step8 * 0.51).all()
    for bits in (4, 3):
        step = (x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)) / (2 ** bits - 1)
        assert (np.abs(kv_peers.uint_token(bits)(x) - x) <= step * 0.51).all()


def test_lloyd_max_tables_match_the_published_ones():
    # N(0, 1/d) Lloyd-Max, derived independently, against pagedkv's (hipfire's) fixed
    # tables: hipfire's centroids sit up to 1.7% off the exact ones (3-bit, index 2;
    # docs/kv-quant.md "Quality"), which costs under 0.07% of the MSE.
    for family in (128, 256):
        for bits in (2, 3, 4):
            ours, _ = kv_rotated.tables(bits, family)
            exact = kv_peers.gaussian_lloyd_max(bits, family)
            np.testing.assert_allclose(exact, ours, rtol=0.017)
            assert np.abs(exact - ours).max() > 2e-5   # not the same numbers
    c = kv_peers.sphere_lloyd_max(4, 256)
    ours, _ = kv_rotated.tables(4, 256)
    np.testing.assert_allclose(c, ours, atol=2.5e-3)
    assert (np.diff(c) > 0).all() and np.allclose(c, -c[::-1])
    # the standard normal's 2-bit Lloyd-Max levels are ±0.4528, ±1.5104
    np.testing.assert_allclose(kv_peers.gaussian_lloyd_max(2, 1),
                               [-1.510418, -0.452780, 0.452780, 1.510418], atol=2e-6)


def test_turboquant_errors():
    x = RNG.standard_normal((4000, 128))
    rel = {name: ((kv_peers.PEERS[name].roundtrip(x) - x) ** 2).sum() / (x ** 2).sum()
           for name in ("turboquant-mse 4", "turboquant-nc 4", "turboquant-mse 3")}
    assert 0.008 < rel["turboquant-mse 4"] < 0.011   # Lloyd-Max 4-bit: 0.0095
    assert 0.030 < rel["turboquant-mse 3"] < 0.038   # 3-bit: 0.0345
    # norm correction gives every row its exact length back (f16-rounded)
    nc = kv_peers.PEERS["turboquant-nc 4"].roundtrip(x)
    np.testing.assert_allclose(np.linalg.norm(nc, axis=1), np.linalg.norm(x, axis=1),
                               rtol=5e-4)
    assert rel["turboquant-nc 4"] < 0.011


def test_unbiased_cnorm_variant_keeps_the_projection_and_the_codes():
    x = RNG.standard_normal((500, 128)) + 0.5
    sides = kq.codecs(128)
    base, ub = sides["pagedkv fwht4"].roundtrip(x), sides["pagedkv fwht4 ub *"].roundtrip(x)
    # same direction (same codes), other length: the projection on x is ||x||
    cos = (base * ub).sum(1) / np.linalg.norm(base, axis=1) / np.linalg.norm(ub, axis=1)
    np.testing.assert_allclose(cos, 1.0, atol=1e-12)
    np.testing.assert_allclose((ub * x).sum(1), (x * x).sum(1), rtol=1e-6)
    assert ((base * x).sum(1) < (x * x).sum(1)).all()   # what it corrects: shrinkage


def _hand_made_layer(kv_heads=2, group=2, length=12, d=128):
    """A deterministic layer (no RNG): smooth, position-dependent q/k/v with a few large
    coordinates in K, as (q [H, L, d], k, v [KVH, L, d], scale)."""
    t = np.arange(length)[None, :, None]
    i = np.arange(d)[None, None, :]
    h = np.arange(kv_heads)[:, None, None]
    k = np.sin(0.37 * t * (h + 1) + 0.11 * i) + 0.3 * np.cos(0.05 * i * (t + 1))
    k[:, :, 5] += 6.0 * (h[:, :, 0] + 1)                  # an outlier channel
    v = np.cos(0.23 * t + 0.07 * i * (h + 2)) * (1 + 0.1 * t)
    hq = np.arange(kv_heads * group)[:, None, None]
    q = np.sin(0.19 * t * (hq + 1) - 0.13 * i) * 2.0
    return q, k, v, d ** -0.5


def _naive_attention(q, k, v, scale, positions):
    """Per query head and position, in Python loops: the definition."""
    group = q.shape[0] // k.shape[0]
    out = np.zeros((q.shape[0], len(positions), q.shape[2]))
    for h in range(q.shape[0]):
        for j, pos in enumerate(positions):
            s = k[h // group, :pos + 1] @ q[h, pos] * scale
            p = np.exp(s - s.max())
            out[h, j] = (p / p.sum()) @ v[h // group, :pos + 1]
    return out


#: attention_errors on _hand_made_layer (last 5 positions), one value per table column
#: kind; float64, independent of BLAS to far below the 1e-9 tolerance.
_PINNED = {
    ("k_only", "fp8 e4m3 per-tensor"): 0.00447053127092759,
    ("k_only", "int8 per-token-head"): 0.006491067187258275,
    ("v_only", "int4 per-token-head"): 0.038015126833172784,
    ("v_only", "turboquant-mse 4"): 0.07336667081416963,
    ("k_only", "pagedkv fwht4"): 0.012176830815820468,
    ("kv", "pagedkv fwht4/q8"): 0.012435208727202158,
    ("kv", "vllm turboquant_4bit_nc"): 0.043871648274631546,
    ("kv", "float16"): 0.0001548068119990921,
}


def test_attention_errors_match_a_loop_oracle_and_pinned_values():
    layer = _hand_made_layer()
    q, k, v, scale = layer
    sides, pairs = kq.codecs(128), kq.pairs(128)
    errs = kq.attention_errors([layer], sides, pairs, n_queries=5)
    assert set(errs) == {"k_only", "v_only", "kv", "mean_max_attention_prob"}
    assert set(errs["kv"]) == {p.name for p in pairs}
    assert set(errs["k_only"]) == set(errs["v_only"]) == set(sides)
    positions = np.arange(7, 12)
    ref = _naive_attention(q, k, v, scale, positions)
    for pair in pairs:
        kq_, vq_ = sides[pair.k].roundtrip(k), sides[pair.v].roundtrip(v)
        out = _naive_attention(q, kq_, vq_, scale, positions)
        want = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert errs["kv"][pair.name] == pytest.approx(want, rel=1e-9, abs=1e-15), pair
    for (kind, name), want in _PINNED.items():
        assert errs[kind][name] == pytest.approx(want, rel=1e-9), (kind, name)
    assert errs["kv"]["float16"] < errs["kv"]["pagedkv q8"] < errs["kv"]["pagedkv fwht4/q8"]


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                    reason="mlx-lm not installed (pip install mlx-lm; only the quality "
                           "script needs it)")
def test_a_small_run_on_mlx_lm_gives_every_column(monkeypatch):
    # --quick's pipeline at a size the test suite can afford on a loaded CPU
    monkeypatch.setitem(kq.SETTINGS, "tiny", {"layers": 1, "seq_len": 64, "n_queries": 8,
                                              "n_new": 6, "prompt_len": 16})
    res = kq.measure(("qwen3",), setting="tiny", greedy=True)
    r = res["models"]["qwen3"]
    names = {p.name for p in kq.pairs(128)}
    assert set(r["kv"]) == set(r["bits"]) == set(r["greedy_agreement"]) == names
    assert r["bits"]["pagedkv fwht4/q8"] == pytest.approx((68 + 136) * 8 / 256)
    assert r["bits"]["vllm turboquant_4bit_nc"] == pytest.approx(4 + 24 / 128)
    assert r["greedy_agreement"]["float16"] == (1.0, 0.0)
    assert 0 < r["mean_max_next_token_prob"] <= 1
    k = r["k_only"]
    assert k["float16"] < k["pagedkv q8"] < k["pagedkv fwht4"] < k["pagedkv fwht2"]
    lines = kq.report(res)
    assert lines[0].startswith("### qwen3 (head_dim 128")
    assert lines[2] == "| " + " | ".join(kq.SIDE_COLUMNS) + " |"
    kv_head = "| " + " | ".join(kq.KV_COLUMNS) + " |"
    rows = lines[lines.index(kv_head) + 2:]
    assert len([x for x in rows if x.startswith("| ")]) == len(names)

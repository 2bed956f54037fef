"""The quality measurement behind docs/kv-quant.md (pagedkv.bench.kvquant_quality) and its
peer quantizers: known values of the peers, and a small run on mlx-lm model code whose
orderings must hold (skipped without mlx-lm, which only that script needs)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from pagedkv.bench import kv_peers
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


def test_per_token_peers_error_bounds():
    x = RNG.standard_normal((300, 128)) * RNG.uniform(0.1, 10, (300, 1))
    step8 = np.abs(x).max(axis=1, keepdims=True) / 127
    assert (np.abs(kv_peers.int8_token(x) - x) <= step8 * 0.51).all()
    step4 = (x.max(axis=1, keepdims=True) - x.min(axis=1, keepdims=True)) / 15
    assert (np.abs(kv_peers.int4_token(x) - x) <= step4 * 0.51).all()


def test_sphere_lloyd_max_is_the_gaussian_table_in_high_dimension():
    # For d = 256 a coordinate of the unit sphere is close to N(0, 1/256): TurboQuant's
    # centroids are then close to pagedkv's C4_256 (both Lloyd-Max), independently derived.
    c = kv_peers.sphere_lloyd_max(4, 256)
    ours, _ = kv_rotated.tables(4, 256)
    np.testing.assert_allclose(c, ours, atol=2.5e-3)
    assert (np.diff(c) > 0).all() and np.allclose(c, -c[::-1])


def test_turboquant_mse_error_and_prod_unbiased_inner_products():
    x = RNG.standard_normal((4000, 128))
    rel = ((kv_peers.turboquant_mse(4)(x) - x) ** 2).sum() / (x ** 2).sum()
    assert 0.008 < rel < 0.011  # Lloyd-Max 4-bit: 0.0095
    q = RNG.standard_normal(128)
    est = kv_peers.turboquant_prod(3)(x) @ q
    true = x @ q
    bias = (est - true).mean() / np.abs(true).mean()
    assert abs(bias) < 0.02  # the QJL residual keeps inner products unbiased


@pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None,
                    reason="mlx-lm not installed (pip install mlx-lm; only the quality "
                           "script needs it)")
def test_a_small_quality_run_orders_the_methods():
    from pagedkv.bench import kvquant_quality as kq
    res = kq.measure(("qwen3",), seq_len=96, n_queries=16, n_new=6, prompt_len=24)
    r = res["models"]["qwen3"]
    k, kvs = r["k_only"], r["kv"]
    assert k["float16"] < 2e-3 < k["pagedkv q8"] < k["fp8 e4m3 per-tensor"]
    assert k["pagedkv fwht4"] < k["pagedkv fwht2"]
    assert k["turboquant-mse 4"] < k["turboquant-prod 4"]
    assert kvs["pagedkv q8"] < kvs["pagedkv fwht4/q8"] < kvs["pagedkv fwht2/q8"]
    assert r["bits"]["pagedkv fwht4/q8"] == pytest.approx((68 + 136) * 8 / 256)
    agree, kl = r["greedy_agreement"]["float16"]
    assert (agree, kl) == (1.0, 0.0)
    assert r["greedy_agreement"]["pagedkv fwht2/q8"][1] > r["greedy_agreement"]["pagedkv q8"][1]
    lines = kq.report(res)
    assert lines[0].startswith("### qwen3 (head_dim 128")

"""mlx-lm's prompt cache over a pool of a KV mode (docs/kv-quant.md "Pools",
docs/integrations/mlx-lm.md): published turns are stored as the mode's records (the host
codec's bytes), and a later request that reuses the prefix starts from exactly the decoded
records, in the model's dtype. Skipped without mlx-lm."""

from __future__ import annotations

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from pagedkv.errors import InvalidArgument
from pagedkv.integrations.mlx_lm import PagedPromptCache
from pagedkv.integrations.mlx_lm.random_models import random_model
from pagedkv.quant import kv as kv_modes

BS = 8


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 256, n).tolist()


def run(model, prompt, cache, n: int = 4) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                             max_tokens=n)]


@pytest.mark.parametrize("mode,head_dim", [("q8", 32), ("fwht4/q8", 128),
                                           ("fwht4/lloyd4", 256), ("fwht4/fwht4", 128),
                                           ("fwht4/fwht2", 128)])
def test_published_turns_are_stored_in_the_mode_and_reloaded_decoded(mode, head_dim):
    model = random_model("qwen3", seed=3, head_dim=head_dim)[0]
    paged = PagedPromptCache(model, block_size=BS, dtype=mode)
    g = paged.geometry
    assert g.dtype == mode and g.quantized
    prompt = toks(21, 7)
    a = paged.begin(prompt)
    out = run(model, prompt, a.cache)
    held = prompt + out  # generate_step feeds every token back (mlx-lm 0.32)
    # The exact K/V the model computed, before publishing.
    want = [(np.array(c.keys[0, :, :len(held)].transpose(1, 0, 2).astype(mx.float32)),
             np.array(c.values[0, :, :len(held)].transpose(1, 0, 2).astype(mx.float32)))
            for c in a.cache]
    assert a.end(held) == len(held)
    b = paged.begin(held + toks(3, 8))
    assert b.cached_tokens == len(held)
    for layer, (k, v) in enumerate(want):
        rec_k, rec_v = paged.coordinator.gather_kv(b._seq, layer)
        assert np.array_equal(np.array(rec_k), kv_modes.encode(k, g.k_dtype))
        assert np.array_equal(np.array(rec_v), kv_modes.encode(v, g.v_dtype))
        cache = b.cache[layer]
        got_k = np.array(cache.keys[0, :, :len(held)].transpose(1, 0, 2).astype(mx.float32))
        got_v = np.array(cache.values[0, :, :len(held)].transpose(1, 0, 2).astype(mx.float32))
        dec_k = kv_modes.decode(kv_modes.encode(k, g.k_dtype), g.k_dtype, head_dim)
        dec_v = kv_modes.decode(kv_modes.encode(v, g.v_dtype), g.v_dtype, head_dim)
        np.testing.assert_allclose(got_k, dec_k, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got_v, dec_v, rtol=1e-6, atol=1e-6)
        assert not np.array_equal(got_k, k)  # the mode's error is there: nothing bypassed it
    assert len(run(model, toks(3, 8), b.cache, 2)) == 2  # generation goes on from there
    b.release()


def test_kv_modes_are_checked_against_the_model_head_dim():
    model = random_model("qwen3", seed=0)[0]  # head_dim 16
    with pytest.raises(InvalidArgument, match="multiple of 32"):
        PagedPromptCache(model, dtype="q8")
    with pytest.raises(InvalidArgument, match="not a paged prompt-cache dtype"):
        PagedPromptCache(model, dtype="int4")
    model = random_model("qwen3", seed=0, head_dim=128)[0]
    with pytest.raises(InvalidArgument, match="lloyd4"):
        PagedPromptCache(model, dtype="fwht4/lloyd4")  # lloyd needs head_dim 256
    with pytest.raises(InvalidArgument, match="fwht3 needs head_dim 256"):
        PagedPromptCache(model, dtype="fwht4/fwht3")  # an fwht3 V is R256: head_dim 256
    with pytest.raises(InvalidArgument, match="needs a rotated K"):
        PagedPromptCache(model, dtype="q8/fwht4")
    assert make_prompt_cache(model)  # the model itself is untouched


def test_a_non_finite_kv_value_at_end_names_the_layer_and_releases_the_request():
    """A NaN/Inf in the model's K/V made ``end`` on a KV-mode pool raise "x holds a
    non-finite value; fwht4 KV takes finite values only", naming no layer (found by a
    review). The error names the layer, K or V, the position and the kv-head now; the
    request is released with nothing published (docs/integrations/mlx-lm.md) and the pool
    serves the next request."""
    from pagedkv.errors import RequestClosed
    model = random_model("qwen3", seed=3, head_dim=128)[0]
    paged = PagedPromptCache(model, block_size=BS, dtype="fwht4/q8")
    prompt = toks(21, 7)
    for layer, side, pos, head, value in ((1, "K", 9, 1, float("nan")),
                                          (0, "V", 20, 0, float("-inf"))):
        r = paged.begin(prompt)
        held = prompt + run(model, prompt, r.cache, 3)
        c = r.cache[layer]
        buf = c.keys if side == "K" else c.values
        buf[0, head, pos, 5] = value
        with pytest.raises(InvalidArgument) as err:
            r.end(held)
        assert str(err.value) == (f"layer {layer}: {side} holds {value} at position {pos}, "
                                  f"kv-head {head}; a fwht4/q8 pool takes finite K/V only")
        assert r.state == "released"
        with pytest.raises(RequestClosed):
            r.end(held)
        s = paged.stats()
        assert (s["live_requests"], s["published_tokens"], s["blocks_in_use"],
                s["blocks_cached"], s["parked"]) == (0, 0, 0, 0, 0)
    r = paged.begin(prompt)  # another refusal of the encoder: the layer and positions
    held = prompt + run(model, prompt, r.cache, 3)
    r.cache[0].values[0, 0, 4, 0] = 1e7  # past q8's float16 scale
    with pytest.raises(InvalidArgument, match=r"^layer 0, positions \[0, 24\): x: block \d+ "
                                              r"\(values .*past q8 KV's float16 scale$"):
        r.end(held)
    assert r.state == "released"
    assert paged.stats()["released"] == 3
    r = paged.begin(prompt)
    assert r.cached_tokens == 0
    held = prompt + run(model, prompt, r.cache, 3)
    assert r.end(held) == len(held) == 24
    assert paged.begin(held + toks(2, 9)).cached_tokens == 24

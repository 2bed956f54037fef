"""``PagedPromptCache(model, attention="paged")``: mlx-lm's decode attention reads K/V
straight from the MLX pool through ``pagedkv.kernels.mlx.paged_attention`` (issue 14).

Not bit-identical to mlx-lm's ``KVCache`` by design (another attention kernel): every
comparison here is the bounded one of :mod:`pagedkv.integrations.mlx_lm.parity` (every
logprob within ``LOGPROB_BOUND`` of the reference, greedy tokens equal up to a near-tie;
float32 tokens must be equal outright), on every backend. The models are the tiny random
ones of the other mlx-lm tests with ``head_dim=32`` (the decode kernel takes 32..256).
"""

from __future__ import annotations

import copy
import functools

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")

from mlx_lm.generate import speculative_generate_step
from mlx_lm.models import base as mlx_lm_base
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

import pagedkv.kernels.mlx as mlx_kernels
from mlx_lm_support import Steps, run, toks
from pagedkv.errors import InvalidArgument, RequestClosed, UnsupportedModel
from pagedkv.integrations.mlx_lm import PagedPromptCache
from pagedkv.integrations.mlx_lm.attention_hook import (
    PoolDecode,
    pool_scaled_dot_product_attention,
)
from pagedkv.integrations.mlx_lm.paged_attention_cache import PagedAttentionLayerCache
from pagedkv.integrations.mlx_lm.parity import compare
from pagedkv.integrations.mlx_lm.random_models import random_model

BS = 8
HEAD_DIM = 32


@functools.cache
def model_of(arch: str = "qwen3", dtype: str = "float32", seed: int = 0, **overrides):
    return random_model(arch, dtype=dtype, seed=seed, head_dim=HEAD_DIM, **overrides)[0]


def close(got: Steps, want: Steps, dtype: str) -> None:
    parity = compare(got, want, dtype=dtype, same_calls=False, bounded=True)
    assert parity.same, parity
    if dtype == "float32":
        assert got[0] == want[0]


class Calls(list):
    tables: list


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the decode kernel's calls (the paged layers call it by module attribute)."""
    calls = Calls()
    real = mlx_kernels.paged_attention

    def counting(*args, **kwargs):
        calls.append(int(kwargs["max_seq_len"]))
        calls.tables.append(args[3])
        return real(*args, **kwargs)

    calls.tables = []

    monkeypatch.setattr(mlx_kernels, "paged_attention", counting)
    return calls


def offsets(request) -> list[int]:
    return [layer.offset for layer in request.cache]


# --- decode over the pool ------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_decode_reads_the_pool_and_stays_within_the_bound_of_kvcache(arch, dtype,
                                                                      kernel_calls):
    model = model_of(arch, dtype)
    paged = PagedPromptCache(model, block_size=BS, attention="paged")
    layers = len(model.layers)
    prompt = toks(21, 1)
    request = paged.begin(prompt)
    got = run(model, prompt, request.cache, 8)
    close(got, run(model, prompt, make_prompt_cache(model), 8), dtype)
    held = request.cache[0].offset
    assert held == len(prompt) + 8
    # every decode forward (the last prompt token on) ran the kernel in every layer, over
    # 21, 22, ... positions; no layer kept a buffer
    assert kernel_calls == [n for n in range(len(prompt), held + 1) for _ in range(layers)]
    # one table per block count (21..29 positions: 3, then 4 blocks of 8), -1 padded to 64
    tables = {id(t): t for t in kernel_calls.tables}
    assert sorted(int((np.array(t) >= 0).sum()) for t in tables.values()) == [3, 4]
    assert {t.shape for t in tables.values()} == {(1, 64)}
    assert all(isinstance(c, PagedAttentionLayerCache) and c.keys is None and c.nbytes == 0
               for c in request.cache)
    request.end(prompt + got[0])

    # a new request on a shared prefix: the prefix is read from the pool, never gathered
    other = prompt[:16] + toks(5, 2)
    request = paged.begin(other)
    assert request.cached_tokens == 16
    close(run(model, other[16:], request.cache, 6), run(model, other, make_prompt_cache(model), 6),
          dtype)
    request.release()

    # the next turn continues the parked conversation
    turn = prompt + got[0] + [7, 9, 11]
    request = paged.begin(turn)
    assert request.cached_tokens == held
    got = run(model, turn[held:], request.cache, 5)
    close(got, run(model, turn, make_prompt_cache(model), 5), dtype)
    request.end(turn + got[0])
    assert paged.begin(turn + got[0] + [1]).cached_tokens == len(turn) + 5


def test_published_blocks_equal_the_default_modes_where_both_computed_them_alike():
    """The prompt's blocks are byte-equal to the default mode's (both wrote what mlx-lm's
    prefill computed); blocks holding decode positions differ in the last bits at most (their
    K/V come from hidden states the paged decode attention computed), within 1e-4; the same
    blocks are published and a lookup finds them."""
    model = model_of()
    prompt = toks(37, 3)
    blocks = {}
    for mode in ("buffer", "paged"):
        paged = PagedPromptCache(model, block_size=BS, attention=mode)
        request = paged.begin(prompt)
        out = run(model, prompt, request.cache, 11)[0]
        request.end(prompt + out)
        pool = paged.coordinator.groups[0].pool
        table = paged.coordinator.block_table(request._seq)
        blocks[mode] = (out, [pool.read_block(int(b)).copy() for b in table],
                        paged.stats()["published_tokens"], paged)
    out_b, data_b, published_b, cache_b = blocks["buffer"]
    out_p, data_p, published_p, cache_p = blocks["paged"]
    assert out_p == out_b and published_p == published_b == 48
    prefill_blocks = (len(prompt) - 1) // BS  # positions the prefill chunk computed
    assert prefill_blocks == 4
    for i in range(prefill_blocks):
        assert data_p[i].tobytes() == data_b[i].tobytes(), i
    for i in range(prefill_blocks, 48 // BS):
        np.testing.assert_allclose(data_p[i].view(np.float32), data_b[i].view(np.float32),
                                   rtol=1e-4, atol=1e-4)
    for paged in (cache_b, cache_p):
        request = paged.begin(prompt + out_b + [5])
        assert request.cached_tokens == 48
        request.release()


def test_speculative_decoding_verifies_through_the_prefill_path_and_trims():
    model = model_of()
    draft = model_of(seed=1)
    paged = PagedPromptCache(model, block_size=BS, attention="paged")
    prompt = toks(19, 4)

    def spec(cache):
        return [int(t) for t, _, _ in speculative_generate_step(
            mx.array(prompt), model, draft, prompt_cache=cache + make_prompt_cache(draft),
            num_draft_tokens=3, max_tokens=10)]

    request = paged.begin(prompt)
    got = spec(request.cache)
    assert got == spec(make_prompt_cache(model))
    held = request.cache[0].offset
    request.end((prompt + got)[:held])
    assert paged.begin(prompt + got[:held - len(prompt)] + [3]).cached_tokens == held


def test_trim_then_continue_matches_kvcache_trimmed_alike():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, attention="paged")
    prompt = toks(20, 5)
    request = paged.begin(prompt)
    ref = make_prompt_cache(model)
    first = run(model, prompt, request.cache, 6)
    assert first[0] == run(model, prompt, ref, 6)[0]
    trim_prompt_cache(request.cache, 4)
    trim_prompt_cache(ref, 4)
    assert offsets(request) == [22, 22]
    # keys_and_values (KV-sharing models' call) reads what the trimmed layer holds
    for layer, own in zip(request.cache, ref, strict=True):
        keys, values = layer.keys_and_values()
        assert keys.shape == values.shape == (1, 2, 22, HEAD_DIM)
        np.testing.assert_allclose(np.array(keys), np.array(own.keys[..., :22, :]),
                                   rtol=1e-4, atol=1e-5)  # decoded positions: the kernel's
    more = [40, 41]
    got = run(model, more, request.cache, 5)
    close(got, run(model, more, ref, 5), "float32")
    tokens = prompt + first[0][:2] + more + got[0]
    request.end(tokens)  # the trimmed positions' blocks are re-recorded, then published
    assert paged.begin(tokens + [1]).cached_tokens == len(tokens)


# --- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, why", [
    ("gemma3_text", "sliding"), ("qwen3_next", "recurrent"), ("gemma2", "scaled_dot_product"),
])
def test_models_it_cannot_serve_are_refused_at_construction(arch, why):
    model = model_of(arch)
    with pytest.raises(UnsupportedModel, match=why) as err:
        PagedPromptCache(model, block_size=BS, attention="paged")
    assert "attention='buffer'" in str(err.value)
    PagedPromptCache(model, block_size=BS)  # the default mode still serves it


def test_bad_arguments_are_refused():
    small = random_model("qwen3")[0]  # head_dim 16
    with pytest.raises(UnsupportedModel, match="head_dim 16"):
        PagedPromptCache(small, attention="paged")
    with pytest.raises(InvalidArgument, match="attention"):
        PagedPromptCache(model_of(), attention="pool")
    with pytest.raises(InvalidArgument, match="dtype='q8'"):
        PagedPromptCache(model_of(), dtype="q8", attention="paged")
    with pytest.raises(InvalidArgument, match="dtype='float16'"):
        PagedPromptCache(model_of(), dtype="float16", attention="paged")


def test_mlx_lm_kv_quantization_is_refused():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, attention="paged")
    request = paged.begin(toks(12, 8))
    with pytest.raises(InvalidArgument, match="kv_bits=4"):
        run(model, toks(12, 8), request.cache, 2, kv_bits=4, quantized_kv_start=0)


def test_refused_calls_change_nothing():
    model = model_of()
    paged = PagedPromptCache(model, block_size=BS, attention="paged")
    prompt = toks(18, 6)
    first = paged.begin(prompt)
    out = run(model, prompt, first.cache, 3)[0]
    first.end(prompt + out)
    request = paged.begin(prompt + out + [9, 10])
    cached = request.cached_tokens
    assert cached == 21
    out2 = run(model, [9, 10], request.cache, 3)[0]
    lc = paged.coordinator
    before = (offsets(request), lc.num_tokens(request._seq), paged.stats())

    def unchanged():
        assert (offsets(request), lc.num_tokens(request._seq), paged.stats()) == before

    layer = request.cache[0]
    q = mx.zeros((1, 4, 1, HEAD_DIM))
    k = mx.zeros((1, 2, 1, HEAD_DIM))
    decode = PoolDecode(layer, k, k)
    for kwargs, match in (({"mask": mx.zeros((1, 1))}, "mask"),
                          ({"mask": None, "sinks": mx.zeros(4)}, "sinks")):
        with pytest.raises(UnsupportedModel, match=match):
            pool_scaled_dot_product_attention(q, decode, decode, cache=layer, scale=1.0,
                                              **kwargs)
        unchanged()
    with pytest.raises(UnsupportedModel, match="query heads"):
        pool_scaled_dot_product_attention(mx.zeros((1, 20, 1, HEAD_DIM)), decode, decode,
                                          cache=layer, scale=1.0, mask=None)
    with pytest.raises(UnsupportedModel, match=r"'\.shape'"):
        decode.shape  # noqa: B018  (model code doing its own attention math)
    with pytest.raises(InvalidArgument, match="fork"):
        copy.deepcopy(request.cache)
    with pytest.raises(InvalidArgument, match="BatchKVCache"):
        PagedAttentionLayerCache.merge(request.cache)
    with pytest.raises(RequestClosed, match="cold_dir"):
        layer.state = (k, k, 1)  # mlx-lm's load_prompt_cache
    with pytest.raises(InvalidArgument, match="batch of 2"):
        layer.update_and_fetch(mx.zeros((2, 2, 3, HEAD_DIM)), mx.zeros((2, 2, 3, HEAD_DIM)))
    with pytest.raises(InvalidArgument, match="cached prefix"):
        trim_prompt_cache(request.cache, 6)  # 26 - 6 < 21 cached
    with pytest.raises(InvalidArgument, match="cached prompt tokens"):
        request.end([1] + (prompt + out + [9, 10] + out2)[1:])
    unchanged()
    # the request still works: continue, then end with the right tokens
    out3 = run(model, [11], request.cache, 2)[0]
    tokens = prompt + out + [9, 10] + out2 + [11] + out3
    request.end(tokens)
    assert paged.begin(tokens + [1]).cached_tokens == len(tokens)


def test_the_hook_leaves_other_callers_bit_identical():
    """Once installed, the patched SDPA runs mlx-lm's own for every call that is not a pool
    decode: the default mode on the same architecture stays byte-identical to KVCache."""
    model = model_of()
    PagedPromptCache(model, block_size=BS, attention="paged")
    from mlx_lm.models import qwen3

    assert qwen3.scaled_dot_product_attention is pool_scaled_dot_product_attention
    assert mlx_lm_base.scaled_dot_product_attention is not pool_scaled_dot_product_attention
    paged = PagedPromptCache(model, block_size=BS)
    prompt = toks(21, 7)
    request = paged.begin(prompt)
    assert run(model, prompt, request.cache, 6) == run(model, prompt, make_prompt_cache(model), 6)
    request.release()


def test_a_prefix_restored_from_the_cold_tier_is_read_in_place(tmp_path, monkeypatch):
    """Blocks a paged-attention request published reach the cold tier with their real token
    ids; another cache (empty hot tier) restores them and decodes over them in the pool."""
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    model = model_of()
    cold = tmp_path / "cold"
    prompt = toks(30, 9)
    with PagedPromptCache(model, block_size=BS, cold_dir=cold, attention="paged") as paged:
        request = paged.begin(prompt)
        out = run(model, prompt, request.cache, 6)[0]
        request.end(prompt + out)
        assert paged.stats()["cold_enqueued"] == 4  # 36 tokens: 4 full blocks
    # the 4th block holds generated positions 30, 31: found only under their real ids
    other = prompt + out[:2] + toks(4, 10)
    with PagedPromptCache(model, block_size=BS, cold_dir=cold, attention="paged") as paged:
        request = paged.begin(other)
        assert request.restored_tokens == request.cached_tokens == 4 * BS
        close(run(model, other[4 * BS:], request.cache, 5),
              run(model, other, make_prompt_cache(model), 5), "float32")
        request.release()

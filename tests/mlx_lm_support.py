"""Helpers of the mlx-lm integration tests: tiny random-weight models, prompts, and greedy
``generate_step`` runs returning the bytes of every step's logprobs (what parity compares).
Import after ``pytest.importorskip("mlx_lm")``.

``==`` between two runs is :mod:`pagedkv.integrations.mlx_lm.parity`'s rule: byte equality
where both ran the same model calls (``run`` on a paged cache against ``run`` on mlx-lm's own
caches) and on MLX's CPU backend; a bound on GPU backends when the reference ran different
calls (``fresh``, and the uncached forward). ``PAGEDKV_PARITY_LOG=FILE`` appends every
bounded comparison's largest difference to FILE (one JSON line each), so a device run
records what the bounds are measured against."""

from __future__ import annotations

import functools
import json
import os

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from pagedkv.integrations.mlx_lm.parity import compare, model_dtype
from pagedkv.integrations.mlx_lm.random_models import random_model


class Steps(tuple):
    """``(tokens, logprob bytes)`` of a greedy run, compared by the parity rule."""

    dtype: str
    same_calls: bool

    def __new__(cls, tokens, lp_bytes, *, dtype: str, same_calls: bool = True):
        self = super().__new__(cls, (list(tokens), bytes(lp_bytes)))
        self.dtype, self.same_calls = dtype, same_calls
        return self

    def __eq__(self, other):
        if not isinstance(other, Steps):
            return NotImplemented
        parity = compare(self, other, dtype=self.dtype,
                         same_calls=self.same_calls and other.same_calls)
        log = os.environ.get("PAGEDKV_PARITY_LOG")
        if log and not parity.exact:
            with open(log, "a") as f:
                f.write(json.dumps({"dtype": self.dtype, "same": parity.same,
                                    "max_abs_diff": parity.max_abs_diff,
                                    "steps": parity.steps, "why": parity.why}) + "\n")
        return parity.same

    def __ne__(self, other):
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__


@functools.cache
def model_of(arch: str = "qwen3", dtype: str = "float32", seed: int = 0):
    return random_model(arch, dtype=dtype, seed=seed)[0]


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 256, n).tolist()


def run(model, prompt, cache, n: int = 6, *, same_calls: bool = True, **kwargs) -> Steps:
    """Greedy ``generate_step``: the tokens and the bytes of every step's logprobs."""
    out, lps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                         max_tokens=n, **kwargs):
        out.append(int(token))
        lps.append(np.array(logprobs.astype(mx.float32)))
    return Steps(out, np.stack(lps).tobytes(), dtype=model_dtype(model), same_calls=same_calls)


def fresh(model, prompt, n: int = 6, **kwargs) -> Steps:
    """mlx-lm's own caches (``make_prompt_cache``) over the whole prompt: different calls
    from a request that resumed from a cached prefix."""
    return run(model, prompt, make_prompt_cache(model), n, same_calls=False, **kwargs)


def on_cpu() -> bool:
    """Whether MLX computes on its CPU backend. There a forward's bits do not depend on how
    the prompt was split into chunks, so a reused prefix also equals a fresh run of the whole
    prompt; on a GPU (MLX's CUDA backend) a matmul's kernel may depend on the chunk's
    length, so parity is checked against mlx-lm's own caches doing the same work."""
    return mx.default_device() == mx.cpu


def replayed(model, prompt, splits, n: int = 6, **kwargs):
    """mlx-lm's own caches doing a paged request's work: one model call per ``(a, b)`` of
    ``splits`` (where the paged side split the prompt: the prefill checkpoints of a
    recurrent model, the requests that computed a reused prefix), then ``generate_step`` on
    the rest of ``prompt``."""
    cache = make_prompt_cache(model)
    end = 0
    for a, b in splits:
        assert a == end, (a, end)
        model(mx.array(prompt[a:b])[None], cache=cache)
        mx.eval([c.state for c in cache])
        end = b
    return run(model, prompt[end:], cache, n, **kwargs)


def reused(model, first, first_n: int, prefix: int, prompt, n: int = 6, *,
           first_kwargs=None, **kwargs):
    """mlx-lm reusing a prefix its own way (``LRUPromptCache``): ``KVCache``s that ran
    ``first`` and generated ``first_n`` tokens, trimmed to ``prefix`` tokens, then
    ``prompt[prefix:]``. What a paged request that got ``prefix`` tokens from ``first``'s
    published blocks computes, on any device."""
    from mlx_lm.models.cache import trim_prompt_cache

    cache = make_prompt_cache(model)
    run(model, first, cache, first_n, **(first_kwargs or {}))
    trim_prompt_cache(cache, cache[0].offset - prefix)
    return run(model, prompt[prefix:], cache, n, **kwargs)


def laid_out_as_computed(cache) -> list:
    """``cache`` (mlx-lm's per-layer list) with each ``KVCache`` layer moved into a new
    ``KVCache`` by one ``update_and_fetch``: the buffer layout (256-token capacity steps) a
    KVCache has when it computed its tokens itself, and the one a paged request's buffers
    have after a prefix hit. ``BatchKVCache.extract`` instead returns exact-length buffers,
    and on MLX's CUDA backend attention over the same K/V gave other bits for the other
    layout (H200, 2026-12-02), so a same-calls comparison needs the same layout. Other
    layers (recurrent state) are kept as they are."""
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in cache:
        if type(layer) is KVCache and layer.keys is not None:
            moved = KVCache()
            moved.update_and_fetch(layer.keys[..., :layer.offset, :],
                                   layer.values[..., :layer.offset, :])
            layer = moved
        out.append(layer)
    return out


def grid(stops, start: int = 0) -> list[tuple[int, int]]:
    """``[(start, s0), (s0, s1), ...]`` for ascending ``stops``."""
    out, a = [], start
    for b in stops:
        out.append((a, b))
        a = b
    return out

"""Helpers of the mlx-lm integration tests: tiny random-weight models, prompts, and greedy
``generate_step`` runs returning the bytes of every step's logprobs (what parity compares).
Import after ``pytest.importorskip("mlx_lm")``."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from pagedkv.integrations.mlx_lm.random_models import random_model


@functools.cache
def model_of(arch: str = "qwen3", dtype: str = "float32", seed: int = 0):
    return random_model(arch, dtype=dtype, seed=seed)[0]


def toks(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(5, 256, n).tolist()


def run(model, prompt, cache, n: int = 6, **kwargs) -> tuple[list[int], bytes]:
    """Greedy ``generate_step``: the tokens and the bytes of every step's logprobs."""
    out, lps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                         max_tokens=n, **kwargs):
        out.append(int(token))
        lps.append(np.array(logprobs.astype(mx.float32)))
    return out, np.stack(lps).tobytes()


def fresh(model, prompt, n: int = 6, **kwargs):
    """mlx-lm's own caches (``make_prompt_cache``) over the whole prompt."""
    return run(model, prompt, make_prompt_cache(model), n, **kwargs)

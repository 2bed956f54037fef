"""What "the same output as mlx-lm" means on each MLX backend.

A greedy run is compared as its tokens and the float32 bytes of every step's
full-vocabulary logprobs. Two comparisons occur:

* **Same calls**: pagedkv's cache against mlx-lm's own caches driven through the same
  model calls (the same prompt chunks, one decode step at a time). Every backend gives
  the same bits: both run the same kernels on the same K/V. Parity is byte equality.
* **Different calls**: a request that resumed from a cached prefix against a fresh run of
  its whole prompt, or a chunked prefill against mlx-lm's forward of the whole sequence
  without a cache. On MLX's CPU backend a row's result does not depend on how many rows
  the call has, so these are byte-identical too. On MLX's GPU backends (CUDA, Metal) the
  matmul and attention kernels are chosen by shape: mlx-lm itself gives different bits
  for a prompt prefilled in one call and the same prompt split at a cache boundary
  (measured on the H200 through MLX CUDA, docs/integrations/mlx-lm.md, "On GPUs"). There,
  parity is: every compared logprob within :func:`logprob_bound` of the reference, and
  the same greedy tokens up to the first step whose reference is a near-tie (its two best
  logprobs within twice the bound), after which the histories may differ and comparison
  stops. A stale, misplaced or missing block moves logprobs by whole units, far above the
  bounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

#: Largest |difference| between two float32 logprobs of the same step on a GPU backend,
#: by model dtype: about 16 ulps of the dtype at the logprob magnitudes of the tiny
#: random-weight models (|logprob| < 16); float32 rows differ by reduction order only.
LOGPROB_BOUND = {"float32": 1e-3, "float16": 0.125, "bfloat16": 0.5}


def exact_backend() -> bool:
    """Whether MLX's default device computes a row independently of the call's row count
    (the CPU backend): there, runs through different calls must be byte-identical."""
    import mlx.core as mx

    return mx.default_device() == mx.cpu


def logprob_bound(dtype: str) -> float:
    """The bound of a different-calls comparison on a GPU backend, in logprob units
    (nats), for a model computing in ``dtype``; 0.0 where the backend is exact."""
    return 0.0 if exact_backend() else LOGPROB_BOUND[dtype]


@dataclass(frozen=True)
class Parity:
    """The outcome of one comparison.

    ``same``: it holds. ``exact``: byte equality was required. ``max_abs_diff``: the
    largest |logprob difference| over the compared steps (nats). ``steps``: steps compared
    (fewer than the run's where a near-tie let the histories part). ``why``: what failed."""

    same: bool
    exact: bool
    max_abs_diff: float
    steps: int
    why: str = ""


def compare(got: tuple[list[int], bytes], want: tuple[list[int], bytes], *, dtype: str,
            same_calls: bool, bounded: bool = False) -> Parity:
    """Compare two greedy runs, ``(tokens, float32 logprob bytes of every step)``.

    ``same_calls``: ``want`` ran the same model calls as ``got`` (byte equality on every
    backend); otherwise the backend decides (see the module docstring). ``bounded``: the
    bound on every backend, whatever the calls: ``got`` attended with another kernel
    (``PagedPromptCache(attention="paged")``)."""
    tokens, lp_bytes = got
    ref_tokens, ref_bytes = want
    exact = (same_calls or exact_backend()) and not bounded
    steps = len(ref_tokens)
    if steps == 0 or len(tokens) != steps or len(lp_bytes) != len(ref_bytes):
        return Parity(False, exact, float("inf"), 0,
                      f"{len(tokens)} steps and {len(lp_bytes)} bytes against "
                      f"{steps} and {len(ref_bytes)}")
    lps = np.frombuffer(lp_bytes, np.float32).reshape(steps, -1)
    refs = np.frombuffer(ref_bytes, np.float32).reshape(steps, -1)
    if exact:
        equal = list(tokens) == list(ref_tokens) and lp_bytes == ref_bytes
        diff = float(np.max(np.abs(lps.astype(np.float64) - refs), initial=0.0))
        return Parity(equal, True, diff, steps, "" if equal else "bytes differ")
    bound = LOGPROB_BOUND[dtype]
    worst = 0.0
    for i in range(steps):
        diff = float(np.max(np.abs(lps[i].astype(np.float64) - refs[i])))
        worst = max(worst, diff)
        if not diff <= bound:  # NaN fails too
            return Parity(False, False, worst, i + 1,
                          f"step {i}: |logprob difference| {diff:.3g} > bound {bound:g}")
        if tokens[i] != ref_tokens[i]:
            top = float(refs[i].max())
            if refs[i][tokens[i]] < top - 2 * bound:
                return Parity(False, False, worst, i + 1,
                              f"step {i}: token {tokens[i]} against {ref_tokens[i]}, not a "
                              f"near-tie ({top - float(refs[i][tokens[i]]):.3g} apart)")
            return Parity(True, False, worst, i + 1)  # a near-tie: the histories part here
    return Parity(True, False, worst, steps)


def model_dtype(model) -> str:
    """The dtype name (``"float32"``, ``"bfloat16"``, ...) of the model's first parameter."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())  # a list of (path, array) pairs
    return str(leaves[0][1].dtype).rsplit(".", 1)[-1]

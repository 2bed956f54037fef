"""``pagedkv demo --engine mlx-lm``: the demo's serving session on mlx-lm's model code.

The same requests as the reference demo (a shared system prompt and few-shot preamble, then
each request's own user turn) run one after another through ``mlx_lm.generate_step`` with a
:class:`~pagedkv.integrations.mlx_lm.PagedPromptCache` as the prompt cache, on an mlx-lm
architecture (``--arch``) built with random weights. The table shows what the cache did;
every output is then recomputed on mlx-lm's own caches (``make_prompt_cache``) and must be
byte-identical (greedy tokens and full-vocabulary logprobs). A sliding-window model's
logprobs are compared with mlx-lm's forward of the whole sequence without a cache instead
(mlx-lm's ``RotatingKVCache`` returns decode keys in ring order, so its bits differ) and its
tokens with ``RotatingKVCache``'s. The cold tier works as in the reference demo:
a second run restores the shared prefix from disk.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from pagedkv.cli.demo_restart import _cold_dir, _unusable_cold_dir
from pagedkv.cli.demo_session import build_requests, check_sizes
from pagedkv.cli.table import format_table

#: --arch values: every architecture with a tiny config.
ARCHS = ("qwen3", "llama", "mistral", "qwen2", "phi3", "gemma2", "gemma3_text", "gpt_oss",
         "gemma4_text", "qwen3_next", "qwen3_5")

#: The demo model: mlx-lm's architecture at this size, random weights.
DEMO_MODEL: dict[str, Any] = {
    "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 512}


def _generate(model, prompt, cache, new_tokens: int):
    """Greedy tokens and the bytes of their full-vocabulary logprobs."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                   max_tokens=new_tokens):
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)))
    return tokens, np.stack(logprobs).tobytes()


def run_mlx_lm(args: argparse.Namespace) -> int:
    try:
        from pagedkv.integrations.mlx_lm import PagedPromptCache
        from pagedkv.integrations.mlx_lm.random_models import random_model
    except ImportError as exc:
        print(f"pagedkv demo: error: --engine mlx-lm: {exc}", file=sys.stderr)
        return 2
    from pagedkv.errors import PagedKVError, UnsupportedModel

    if args.restart:
        print("pagedkv demo: error: --restart is for the reference engine; with --engine "
              "mlx-lm run the demo twice with the same --cold-dir (the second run restores "
              "the shared prefix from disk)", file=sys.stderr)
        return 2
    if args.no_cold and args.cold_dir:
        # as the reference and hybrid models say: --cold-dir would otherwise win silently
        print("pagedkv demo: --no-cold cannot be combined with --cold-dir", file=sys.stderr)
        return 2
    model, config = random_model(args.arch, seed=args.seed, **DEMO_MODEL)
    problem = check_sizes(args, config["max_position_embeddings"])
    if problem:
        print(f"pagedkv demo: error: {problem}", file=sys.stderr)
        return 2
    cold_dir = _cold_dir(args)
    try:
        paged = PagedPromptCache(model, block_size=args.block_size,
                                 initial_blocks=args.initial_blocks, max_blocks=args.max_blocks,
                                 cold_dir=cold_dir)
    except UnsupportedModel as exc:
        print(f"pagedkv demo: not yet: {exc}", file=sys.stderr)
        return 2
    except (PagedKVError, OSError) as exc:
        message = f"error: {exc}" if cold_dir is None else _unusable_cold_dir(
            cold_dir, exc, "cannot hold the demo's cold tier",
            "pass --cold-dir a directory you can write (or remove what is in the way)")
        print(f"pagedkv demo: {message}", file=sys.stderr)
        return 2
    if args.fresh and paged.cold_tier is not None:
        paged.cold_tier.store.remove_quarantine()
        paged.cold_tier.store.evict_to(0)
    requests = build_requests(args, config["vocab_size"])
    print(f"pagedkv demo: {len(requests)} requests, prompt = {args.system_tokens} system + "
          f"{args.fewshot_tokens} few-shot (shared) + {args.user_tokens} user tokens, "
          f"{args.new_tokens} new tokens each")
    print(f"model: mlx-lm {args.arch} ({config['num_hidden_layers']} layers, hidden "
          f"{config['hidden_size']}, {config['num_attention_heads']}/"
          f"{config['num_key_value_heads']} heads, vocab {config['vocab_size']}, random "
          f"weights), MLX pool, block size {args.block_size}, one request at a time "
          "(mlx_lm.generate_step)")
    print()
    outputs, hits, decode_s, decode_tokens = [], 0, 0.0, 0
    with paged:
        for r in requests:
            prompt = r.prompt.tolist()
            request = paged.begin(prompt)
            hits += request.hit_tokens > 0  # not what begin prefilled itself
            t0 = time.perf_counter()
            out = _generate(model, prompt[request.cached_tokens:], request.cache,
                            r.max_new_tokens)
            decode_s += time.perf_counter() - t0
            decode_tokens += len(out[0])
            request.end(prompt + out[0])
            outputs.append(out)
        s = paged.stats()
        tier = paged.cold_tier
    cold = tier.stats() if tier is not None else None  # after close: everything drained
    grow = (f"{s['grow_events']} ({args.initial_blocks} -> {s['pool_blocks']} blocks, max "
            f"{s['pool_max_blocks']})")
    rows = [
        ["metric", "value"],
        ["requests", f"{len(requests)} ({hits} with a prefix hit)"],
        ["prompt tokens", f"{s['prompt_tokens']:,}"],
        ["cached tokens reused",
         f"{s['hit_tokens']:,} ({s['restored_tokens']:,} restored from disk)"],
        ["hit rate", f"{s['hit_tokens'] / max(1, s['prompt_tokens']):.1%}"],
        ["blocks in use", f"{s['blocks_in_use']:,} ({s['bytes_in_use']:,} bytes)"],
        ["blocks shared", f"{s['blocks_shared']:,}"],
        ["pool growth events", grow],
        ["evictions", f"{s['evictions']:,}"],
        ["tokens generated", f"{decode_tokens:,}"],
        ["time per token",
         f"{decode_s / max(1, decode_tokens) * 1e3:.2f} ms (uncached prefill included)"],
    ]
    for line in format_table(rows):
        print(line)
    print()
    sliding = any(g.kind.is_sliding for g in paged.groups)
    parities = [_matches_mlx_lm(model, r.prompt.tolist(), out, r.max_new_tokens, sliding)
                for r, out in zip(requests, outputs)]
    bad = [r.seq_id for r, parity in zip(requests, parities) if not parity.same]
    reference = ("mlx-lm's forward without a cache (logprobs) and its RotatingKVCache "
                 "(tokens)" if sliding else "mlx-lm's own caches")
    if bad:
        why = next(p.why for p in parities if not p.same)
        print(f"parity: MISMATCH in {len(bad)}/{len(requests)} requests "
              f"({', '.join(map(str, bad[:5]))}): the paged output differs from {reference} "
              f"({why})")
        return 1
    if all(p.exact for p in parities):
        print(f"parity: OK ({len(requests)}/{len(requests)} outputs byte-identical to "
              f"{reference}: tokens and logprobs)")
    else:
        from pagedkv.integrations.mlx_lm.parity import logprob_bound, model_dtype

        worst = max(p.max_abs_diff for p in parities)
        print(f"parity: OK ({len(requests)}/{len(requests)} outputs match {reference}: same "
              f"greedy tokens, logprobs within {logprob_bound(model_dtype(model)):g} (largest "
              f"difference {worst:.3g}); on a GPU backend mlx-lm's own kernels depend on how "
              "a prompt is split into calls, so bytes differ: docs/integrations/mlx-lm.md, "
              "'On GPUs')")
    if cold is not None:
        print(f"cold tier: {cold.hits} blocks restored from disk ({cold.bytes_restored:,} "
              f"bytes), {cold.enqueued} blocks persisted ({cold.bytes_written:,} bytes), "
              f"corruptions {cold.corruptions}, in {cold.root}")
        if cold.hits == 0:
            print("  run it again: the next process restores the shared prefix from disk "
                  "instead of recomputing it")
    return 0


def _matches_mlx_lm(model, prompt, out, new_tokens: int, sliding: bool):
    """The parity (:mod:`pagedkv.integrations.mlx_lm.parity`) of ``out`` (tokens, logprob
    bytes) with what mlx-lm computes for ``prompt``: its own caches over the whole prompt,
    and, for a model with sliding layers, the uncached forward of the whole sequence for the
    logprobs (its tokens must be those of mlx-lm's ``RotatingKVCache``)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.integrations.mlx_lm.parity import Parity, compare, exact_backend, model_dtype

    dtype = model_dtype(model)
    own = _generate(model, prompt, make_prompt_cache(model), new_tokens)
    if not sliding:
        return compare(out, own, dtype=dtype, same_calls=False)
    tokens, _ = out
    logits = model(mx.array(list(prompt) + tokens)[None])[0]
    rows = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
    lps = np.array((rows - mx.logsumexp(rows, axis=-1, keepdims=True)).astype(mx.float32))
    parity = compare(out, (tokens, lps.tobytes()), dtype=dtype, same_calls=False)
    if not parity.same or own[0] == tokens:
        return parity
    # RotatingKVCache's tokens differ: allowed only where its own run is a near-tie
    return compare(out, own, dtype=dtype, same_calls=False) if not exact_backend() else \
        Parity(False, True, parity.max_abs_diff, parity.steps,
               f"greedy tokens {tokens} against RotatingKVCache's {own[0]}")

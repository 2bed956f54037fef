"""pagedkv as mlx-lm's prompt cache (issue 12), every figure a ratio measured in one run:

* decode cost per token (CPU time) with a paged cache / with mlx-lm's ``KVCache``, at 128 and
  4,096 tokens of context: target <= 1.05x (both requests prefilled once, then decoded in
  alternating 8-token segments with MLX's queue drained around each, medians compared);
* time to first token of a request sharing a 512-token prefix with a finished one, against
  the same request without reuse (mlx-lm ``KVCache``): >= 10x faster;
* the same from the cold tier, in a fresh process: >= 5x faster;
* pool memory of 16 conversations sharing a 1,024-token system prompt against one
  conversation's KV plus their own tokens: <= 1.2x (``LRUPromptCache`` holds 16 copies).

The model is mlx-lm's qwen3 with random weights (hidden 256, 4 layers, 4 query heads, 2 KV
heads x 64, vocab 512, float32), greedy. Times are CPU time (``time.process_time``, all MLX
threads) because wall time on a shared machine moves by 2x; the variants are interleaved
inside each repetition, the first repetition is dropped and the medians are compared. Run as
asv suites, or as a script for the table of docs/performance.md::

    python asv_bench/benchmarks/integration_mlx_lm.py            # everything (~3 minutes)
    python asv_bench/benchmarks/integration_mlx_lm.py --quick    # 3 repetitions
    python asv_bench/benchmarks/integration_mlx_lm.py --hybrid   # gemma3_text, qwen3_5
    python asv_bench/benchmarks/integration_mlx_lm.py --paged-attention [--dtype bfloat16]

``--hybrid`` measures the decode cost (against mlx-lm's own ``RotatingKVCache`` /
``ArraysCache`` lists, at 128 and 4,096 tokens) and the hot TTFT of a sliding-window model
(gemma3_text, window 256) and a recurrent one (qwen3_5) at the same size, and qwen3_5's TTFT
from the cold tier.

``--paged-attention`` measures decode tokens/s of ``PagedPromptCache(attention="paged")``
(decode attention over the pool, ``pagedkv.kernels.mlx.paged_attention``) against the default
``attention="buffer"`` and mlx-lm's ``KVCache``, at 128 and 4,096 tokens of context, wall and
CPU time, the three interleaved. On MLX's CPU backend the kernel is MLX array ops; float32
pools run them on a GPU too, so measure the kernels with ``--dtype bfloat16`` there.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

MODEL = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 768, "vocab_size": 512}
CONTEXTS = (128, 4096)
SEED = 0
SHARED_TOKENS = 512
OWN_TOKENS = 32


#: Hybrid architectures ``--hybrid`` measures (sliding window, recurrent), with the window
#: the sliding one gets at this size (gemma 3's own is 512 to 1,024 tokens).
HYBRID_ARCHS = ("gemma3_text", "qwen3_5")
HYBRID_CONTEXTS = (128, 4096)
#: The hybrid architectures ``--hybrid`` also times from the cold tier.
COLD_HYBRID_ARCHS = ("qwen3_5",)
_OVERRIDES = {"gemma3_text": {"sliding_window": 256}}


def _model(arch: str = "qwen3", dtype: str = "float32"):
    from pagedkv.integrations.mlx_lm.random_models import random_model
    return random_model(arch, dtype=dtype, seed=SEED, **MODEL, **_OVERRIDES.get(arch, {}))[0]


def _tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, MODEL["vocab_size"], n).tolist()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - t[0], time.process_time() - t[1]


#: Decode tokens per timed segment of :func:`decode_cost` (one variant at a time).
SEGMENT_TOKENS = 8


def _segment_s(steps, tokens: int) -> tuple[float, float]:
    """Wall and CPU seconds of ``tokens`` more decode steps of a running ``generate_step``:
    MLX's queue is drained before and after (``mx.synchronize``), so the step
    ``generate_step`` pipelines ahead is computed inside the segment that queued it, never
    in another variant's."""
    import mlx.core as mx

    mx.synchronize()
    t = _clock()
    for _ in range(tokens):
        next(steps)
    mx.synchronize()
    return _since(t)


def _interleaved(steps, rounds: int) -> list[list[tuple[float, float]]]:
    """Per variant, the (wall, CPU) seconds per token of ``rounds`` segments of
    :data:`SEGMENT_TOKENS` tokens of each running ``generate_step`` of ``steps`` (already
    holding their prompts), the variants alternating order from round to round; each
    first computes its first token and one dropped warm-up segment."""
    for s in steps:
        next(s)
        _segment_s(s, SEGMENT_TOKENS)
    costs: list[list[tuple[float, float]]] = [[] for _ in steps]
    for r in range(rounds):
        order = range(len(steps)) if r % 2 == 0 else reversed(range(len(steps)))
        for i in order:
            wall, cpu = _segment_s(steps[i], SEGMENT_TOKENS)
            costs[i].append((wall / SEGMENT_TOKENS, cpu / SEGMENT_TOKENS))
    return costs


def decode_cost(context: int, *, reps: int = 7, new_tokens: int = 192,
                arch: str = "qwen3") -> tuple[float, float]:
    """CPU s/token of ``(mlx-lm's own caches, paged)`` decoding after the same
    ``context``-token prompt (the paged request misses; a recurrent model's ``begin`` runs
    the prompt to its tail, and ``generate_step`` the rest).

    Both requests are prefilled once and then decoded in alternating segments of
    :data:`SEGMENT_TOKENS` tokens (``reps`` rounds, the first variant alternating from
    round to round, each round's segments over the same context range), so the load of a
    shared machine falls on both alike; ``new_tokens`` rounds the run up to whole rounds.
    Returns the medians of the per-token segment costs."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.integrations.mlx_lm import PagedPromptCache

    model = _model(arch)
    paged = PagedPromptCache(model, max_blocks=1024)
    prompt = _tokens(context, 100)
    rounds = max(reps, -(-new_tokens // SEGMENT_TOKENS))
    total = SEGMENT_TOKENS * (rounds + 1) + 1
    request = paged.begin(prompt)  # a miss; a recurrent model's begin ran to its tail
    steps = [generate_step(mx.array(prompt), model, prompt_cache=make_prompt_cache(model),
                           max_tokens=total),
             generate_step(mx.array(prompt[request.cached_tokens:]), model,
                           prompt_cache=request.cache, max_tokens=total)]
    costs = _interleaved(steps, rounds)
    request.release()
    return (statistics.median(c for _, c in costs[0]),
            statistics.median(c for _, c in costs[1]))


#: The variants of :func:`decode_rate`: mlx-lm's own cache, then PagedPromptCache's modes.
DECODE_RATE_VARIANTS = ("kvcache", "buffer", "paged")


def decode_rate(context: int, *, reps: int = 7, new_tokens: int = 192,
                dtype: str = "float32") -> dict[str, dict[str, float]]:
    """Decode tokens/s (median wall) and CPU ms/token after the same ``context``-token
    prompt, per variant of :data:`DECODE_RATE_VARIANTS`: ``KVCache``,
    ``PagedPromptCache(attention="buffer")`` (the default: SDPA over a private buffer) and
    ``attention="paged"`` (decode attention over the pool), interleaved as in
    :func:`decode_cost`."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.integrations.mlx_lm import PagedPromptCache

    model = _model(dtype=dtype)
    prompt = _tokens(context, 100)
    rounds = max(reps, -(-new_tokens // SEGMENT_TOKENS))
    total = SEGMENT_TOKENS * (rounds + 1) + 1
    requests = [PagedPromptCache(model, max_blocks=1024, attention=mode).begin(prompt)
                for mode in DECODE_RATE_VARIANTS[1:]]
    caches = [make_prompt_cache(model)] + [r.cache for r in requests]
    steps = [generate_step(mx.array(prompt), model, prompt_cache=c, max_tokens=total)
             for c in caches]
    costs = _interleaved(steps, rounds)
    for r in requests:
        r.release()
    return {name: {"tokens_per_s": 1.0 / statistics.median(w for w, _ in cost),
                   "cpu_ms_per_token": 1e3 * statistics.median(c for _, c in cost)}
            for name, cost in zip(DECODE_RATE_VARIANTS, costs, strict=True)}


def _first_token(model, prompt: list[int], cache) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    token, _ = next(generate_step(mx.array(prompt), model, prompt_cache=cache, max_tokens=1))
    return int(token)


def shared_prefix_prompts() -> tuple[list[int], list[int]]:
    """Request A and request B: the same 512-token prefix, 32 tokens of their own."""
    prefix = _tokens(SHARED_TOKENS, 2)
    return prefix + _tokens(OWN_TOKENS, 3), prefix + _tokens(OWN_TOKENS, 4)


def _serve_a(paged, model, a: list[int]) -> None:
    request = paged.begin(a)
    token = _first_token(model, a[request.cached_tokens:], request.cache)
    request.end(a + [token])  # generate_step fed the first token back before yielding it


def ttft_shared_prefix(*, reps: int = 7, arch: str = "qwen3") -> dict[str, float]:
    """Median TTFT (wall, CPU) of request B after A finished: mlx-lm's own fresh caches (no
    reuse) vs a ``PagedPromptCache`` hit, ``begin`` (lookup + gather, and for a recurrent
    model the prefill to its last checkpoint rung) included. ``hit_tokens``: what B reused
    (a recurrent model's reuse stops at its deepest state checkpoint)."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.integrations.mlx_lm import PagedPromptCache

    model = _model(arch)
    a, b = shared_prefix_prompts()
    rows: dict[str, list[float]] = {k: [] for k in ("fresh_wall", "fresh_cpu", "hit_wall",
                                                    "hit_cpu")}
    for rep in range(reps + 1):
        t = _clock()
        _first_token(model, b, make_prompt_cache(model))
        fresh = _since(t)
        paged = PagedPromptCache(model, max_blocks=256)
        _serve_a(paged, model, a)
        t = _clock()
        request = paged.begin(b)
        _first_token(model, b[request.cached_tokens:], request.cache)
        hit = _since(t)
        hit_tokens = request.hit_tokens
        if hit_tokens != SHARED_TOKENS:  # qwen3_5: its grid checkpoint at 512
            raise AssertionError(f"B reused {hit_tokens} tokens, not {SHARED_TOKENS}")
        request.release()
        if rep:
            for key, value in zip(rows, fresh + hit):
                rows[key].append(value)
    out = {k: statistics.median(v) for k, v in rows.items()}
    out["hit_tokens"] = hit_tokens
    return out


def _cold_child(cold_dir: str, phase: str, reps: int, arch: str = "qwen3") -> dict[str, float]:
    """One process of the cold-tier figure: ``write`` serves A and persists it; ``restore``
    (a fresh process) times B restoring the prefix from disk against B without reuse."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedkv.integrations.mlx_lm import PagedPromptCache

    model = _model(arch)
    a, b = shared_prefix_prompts()
    if phase == "write":
        with PagedPromptCache(model, max_blocks=256, cold_dir=cold_dir) as paged:
            _serve_a(paged, model, a)
        return {}
    fresh_c, hit_c, fresh_w, hit_w, restored = [], [], [], [], 0
    for rep in range(reps + 1):
        t = _clock()
        _first_token(model, b, make_prompt_cache(model))
        fresh = _since(t)
        paged = PagedPromptCache(model, max_blocks=256, cold_dir=cold_dir)  # empty hot cache
        t = _clock()
        request = paged.begin(b)
        _first_token(model, b[request.cached_tokens:], request.cache)
        hit = _since(t)
        restored = request.restored_tokens
        request.release()
        paged.close()
        if rep:
            fresh_w.append(fresh[0])
            fresh_c.append(fresh[1])
            hit_w.append(hit[0])
            hit_c.append(hit[1])
    return {"fresh_wall": statistics.median(fresh_w), "fresh_cpu": statistics.median(fresh_c),
            "hit_wall": statistics.median(hit_w), "hit_cpu": statistics.median(hit_c),
            "restored_tokens": restored}


def ttft_cold(*, reps: int = 7, arch: str = "qwen3") -> dict[str, float]:
    """:func:`_cold_child` in two fresh processes sharing a temporary cold directory. The
    writer gets a generous cold-capture budget (``PAGEDKV_COLD_CAPTURE_BUDGET_MS``: its
    default 250 ms can stop the walk early on a loaded machine); the timed restore does
    not depend on it."""
    cold_dir = tempfile.mkdtemp(prefix="pagedkv-mlxlm-bench-",
                                dir=os.environ.get("TMPDIR", "/tmp"))
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = {}
        for phase in ("write", "restore"):
            code = (f"import json, sys; sys.path.insert(0, {here!r}); "
                    "import integration_mlx_lm as m; "
                    f"print(json.dumps(m._cold_child({cold_dir!r}, {phase!r}, {reps}, "
                    f"{arch!r})))")
            env = dict(os.environ, PAGEDKV_COLD_CAPTURE_BUDGET_MS="60000",
                       PAGEDKV_PERSIST_PAGED_CACHE="1")
            done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                  text=True, env=env)
            out = json.loads(done.stdout.strip().splitlines()[-1])
        return out
    finally:
        shutil.rmtree(cold_dir, ignore_errors=True)


def conversation_memory(conversations: int = 16, system: int = 1024, user: int = 32,
                        new_tokens: int = 16) -> dict[str, int]:
    """Bytes of K/V held after ``conversations`` conversations that share a ``system``-token
    prompt each asked ``user`` tokens and got ``new_tokens`` back: the paged pool (blocks in
    use, and the pool's allocation), against one conversation's KV plus the others' own
    tokens, and against mlx-lm's ``LRUPromptCache`` (a ``KVCache`` list per conversation)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    from pagedkv.integrations.mlx_lm import PagedPromptCache

    model = _model()
    paged = PagedPromptCache(model, max_blocks=4096)
    lru = LRUPromptCache(max_size=conversations)
    system_prompt = _tokens(system, 5)
    held = []
    for i in range(conversations):
        prompt = system_prompt + _tokens(user, 10 + i)
        request = paged.begin(prompt)
        out = [t for t, _ in generate_step(mx.array(prompt[request.cached_tokens:]), model,
                                           prompt_cache=request.cache, max_tokens=new_tokens)]
        request.end(prompt + out)
        held.append(len(prompt) + len(out))
        cache = make_prompt_cache(model)
        out = [t for t, _ in generate_step(mx.array(prompt), model, prompt_cache=cache,
                                           max_tokens=new_tokens)]
        lru.insert_cache("model", prompt + out, cache)
    g = paged.geometry
    per_token = g.bytes_per_token
    one_plus_own = (held[0] + sum(n - system for n in held[1:])) * per_token
    s = paged.stats()
    return {"paged_bytes_in_use": s["bytes_in_use"], "paged_pool_bytes": s["pool_bytes"],
            "ideal_bytes": one_plus_own, "lru_bytes": lru.nbytes,
            "blocks_shared": s["blocks_shared"]}


# --- asv suites -----------------------------------------------------------------------------

class DecodeCost:
    """CPU per decode token, paged / KVCache (target <= 1.05)."""

    timeout = 900
    params = CONTEXTS
    param_names = ["context"]  # noqa: RUF012

    def track_paged_over_kvcache(self, context):
        ref, ours = decode_cost(context, reps=5)
        return ours / ref
    track_paged_over_kvcache.unit = "ratio"


class PagedAttentionDecode:
    """Decode tokens/s of attention="paged" over the default attention="buffer" (above 1:
    the pool kernel is faster)."""

    timeout = 900
    params = CONTEXTS
    param_names = ["context"]  # noqa: RUF012

    def track_paged_over_buffer_tokens_per_s(self, context):
        r = decode_rate(context, reps=5)
        return r["paged"]["tokens_per_s"] / r["buffer"]["tokens_per_s"]
    track_paged_over_buffer_tokens_per_s.unit = "ratio"


class TimeToFirstToken:
    """TTFT speedup from reusing a 512-token prefix (targets: >= 10x hot, >= 5x cold)."""

    timeout = 900

    def track_hot_speedup_cpu(self):
        r = ttft_shared_prefix(reps=5)
        return r["fresh_cpu"] / r["hit_cpu"]
    track_hot_speedup_cpu.unit = "x"

    def track_cold_speedup_cpu(self):
        r = ttft_cold(reps=5)
        return r["fresh_cpu"] / r["hit_cpu"]
    track_cold_speedup_cpu.unit = "x"


class HybridDecodeCost:
    """CPU per decode token of the hybrid architectures, paged / mlx-lm's own caches."""

    timeout = 900
    params = (HYBRID_ARCHS, HYBRID_CONTEXTS)
    param_names = ["arch", "context"]  # noqa: RUF012

    def track_paged_over_own_caches(self, arch, context):
        ref, ours = decode_cost(context, reps=3, arch=arch)
        return ours / ref
    track_paged_over_own_caches.unit = "ratio"


class HybridTimeToFirstToken:
    """TTFT speedup of qwen3_5 on a 512-token shared prefix (targets: >= 10x hot, >= 5x
    from the cold tier): the second request resumes at the grid checkpoint 512."""

    timeout = 900

    def track_hot_speedup_cpu(self):
        r = ttft_shared_prefix(reps=3, arch="qwen3_5")
        return r["fresh_cpu"] / r["hit_cpu"]
    track_hot_speedup_cpu.unit = "x"

    def track_cold_speedup_cpu(self):
        r = ttft_cold(reps=3, arch="qwen3_5")
        return r["fresh_cpu"] / r["hit_cpu"]
    track_cold_speedup_cpu.unit = "x"


class ConversationMemory:
    """16 conversations sharing a 1,024-token system prompt (target <= 1.2)."""

    timeout = 600

    def track_paged_over_ideal(self):
        m = conversation_memory()
        return m["paged_bytes_in_use"] / m["ideal_bytes"]
    track_paged_over_ideal.unit = "ratio"


# --- script ---------------------------------------------------------------------------------

def hybrid_main(reps: int) -> int:
    """``--hybrid``: decode cost and hot TTFT of the sliding and recurrent architectures."""
    for arch in HYBRID_ARCHS:
        for context in HYBRID_CONTEXTS:
            ref, ours = decode_cost(context, reps=reps, arch=arch)
            print(f"{arch}: decode at {context} tokens of context: mlx-lm's caches "
                  f"{ref * 1e3:.2f} CPU ms/token, paged {ours * 1e3:.2f}: {ours / ref:.3f}x",
                  flush=True)
        r = ttft_shared_prefix(reps=reps, arch=arch)
        print(f"{arch}: TTFT, {SHARED_TOKENS}-token shared prefix (hot, {r['hit_tokens']} "
              f"tokens reused): no reuse {r['fresh_cpu'] * 1e3:.1f} CPU ms "
              f"({r['fresh_wall'] * 1e3:.1f} ms wall), paged hit {r['hit_cpu'] * 1e3:.1f} "
              f"({r['hit_wall'] * 1e3:.1f}): {r['fresh_cpu'] / r['hit_cpu']:.1f}x CPU, "
              f"{r['fresh_wall'] / r['hit_wall']:.1f}x wall", flush=True)
        if arch in COLD_HYBRID_ARCHS:
            r = ttft_cold(reps=reps, arch=arch)
            print(f"{arch}: TTFT, {SHARED_TOKENS}-token prefix from the cold tier in a fresh "
                  f"process ({r['restored_tokens']} tokens restored): no reuse "
                  f"{r['fresh_cpu'] * 1e3:.1f} CPU ms ({r['fresh_wall'] * 1e3:.1f} ms wall), "
                  f"restored {r['hit_cpu'] * 1e3:.1f} ({r['hit_wall'] * 1e3:.1f}): "
                  f"{r['fresh_cpu'] / r['hit_cpu']:.1f}x CPU, "
                  f"{r['fresh_wall'] / r['hit_wall']:.1f}x wall (target >= 5x)", flush=True)
    return 0


def paged_attention_main(reps: int, dtype: str) -> int:
    """``--paged-attention``: decode tokens/s of the two attention modes and KVCache."""
    import mlx.core as mx

    for context in CONTEXTS:
        r = decode_rate(context, reps=reps, dtype=dtype)
        rows = ", ".join(f"{name} {v['tokens_per_s']:.1f} tokens/s "
                         f"({v['cpu_ms_per_token']:.2f} CPU ms/token)" for name, v in r.items())
        ratio = r["paged"]["tokens_per_s"] / r["buffer"]["tokens_per_s"]
        print(f"decode at {context} tokens of context, {dtype}, MLX {mx.default_device()}: "
              f"{rows}; paged / buffer {ratio:.3f}x tokens/s", flush=True)
    return 0


def main(argv: list[str]) -> int:
    reps = 3 if "--quick" in argv else 7
    if "--hybrid" in argv:
        return hybrid_main(reps)
    if "--paged-attention" in argv:
        dtype = argv[argv.index("--dtype") + 1] if "--dtype" in argv else "float32"
        return paged_attention_main(reps, dtype)
    for context in CONTEXTS:
        ref, ours = decode_cost(context, reps=reps)
        print(f"decode at {context} tokens of context: KVCache {ref * 1e3:.2f} CPU ms/token, "
              f"paged {ours * 1e3:.2f}: {ours / ref:.3f}x (target <= 1.05x)")
    r = ttft_shared_prefix(reps=reps)
    print(f"TTFT, {SHARED_TOKENS}-token shared prefix (hot): no reuse {r['fresh_cpu'] * 1e3:.1f} "
          f"CPU ms ({r['fresh_wall'] * 1e3:.1f} ms wall), paged hit {r['hit_cpu'] * 1e3:.1f} "
          f"({r['hit_wall'] * 1e3:.1f}): {r['fresh_cpu'] / r['hit_cpu']:.1f}x CPU, "
          f"{r['fresh_wall'] / r['hit_wall']:.1f}x wall (target >= 10x)")
    r = ttft_cold(reps=reps)
    print(f"TTFT, {SHARED_TOKENS}-token prefix from the cold tier in a fresh process "
          f"({r['restored_tokens']} tokens restored): no reuse {r['fresh_cpu'] * 1e3:.1f} CPU ms "
          f"({r['fresh_wall'] * 1e3:.1f} ms wall), restored {r['hit_cpu'] * 1e3:.1f} "
          f"({r['hit_wall'] * 1e3:.1f}): {r['fresh_cpu'] / r['hit_cpu']:.1f}x CPU, "
          f"{r['fresh_wall'] / r['hit_wall']:.1f}x wall (target >= 5x)")
    m = conversation_memory()
    print(f"16 conversations sharing a 1,024-token system prompt: paged blocks in use "
          f"{m['paged_bytes_in_use'] / 2**20:.2f} MiB (pool allocated "
          f"{m['paged_pool_bytes'] / 2**20:.2f} MiB), one conversation + own tokens "
          f"{m['ideal_bytes'] / 2**20:.2f} MiB: {m['paged_bytes_in_use'] / m['ideal_bytes']:.3f}x "
          f"({m['paged_pool_bytes'] / m['ideal_bytes']:.3f}x allocated; target <= 1.2x); "
          f"LRUPromptCache {m['lru_bytes'] / 2**20:.2f} MiB "
          f"({m['lru_bytes'] / m['paged_bytes_in_use']:.1f}x the paged pool)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

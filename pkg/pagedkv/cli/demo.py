"""``pagedkv demo``: a small serving session on the reference model, checked against the flat path.

N requests share a system prompt and a few-shot preamble and differ in their user turn. The
first runs alone (a warm server), the rest are admitted in batches and decoded in interleaved
steps through one paged adapter whose pool starts small and grows on demand. Full blocks are
persisted to a cold tier on a local directory (``./.pagedkv-demo``), so the next run restores
the shared prefix from disk. The table shows what the cache did; every output is then
recomputed alone on a flat cache and must be byte-identical (tokens and logits), else the
exit status is 1. ``--model hybrid`` runs the same session on the hybrid reference model
(``pagedkv.cli.demo_hybrid``).
"""

from __future__ import annotations

import argparse
import sys

from pagedkv.cli.table import format_table

#: Where a persistent (cold-tier) phase of the demo keeps its files.
DEFAULT_COLD_DIR = "./.pagedkv-demo"


#: Upper bound of --max-blocks: the allocator sizes its block table for the maximum up front
#: (80 bytes a block), and the demo never needs more than a few hundred blocks.
MAX_DEMO_BLOCKS = 1 << 20


def _int_at_least(low: int, high: int | None = None):
    """An argparse ``type`` for an integer in ``[low, high]`` with a message that says so."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not >= {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value:,} is above the limit {high:,}")
        return value
    return parse


_positive = _int_at_least(1)
_non_negative = _int_at_least(0)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="serve N requests with a shared prefix on the paged cache, check parity",
        description="Serve N requests that share a system prompt and a few-shot preamble "
                    "through the paged KV cache (prefix reuse, interleaved decode, growth), "
                    "print what the cache did, and check every output against the flat path.")
    p.add_argument("--model", choices=("reference", "hybrid"), default="reference",
                   help="reference: every layer full attention; hybrid: full, sliding-window "
                        "and gated-delta-net layers and a KV-shared alias, served by the "
                        "grouped coordinator (reference)")
    p.add_argument("--requests", type=_positive, default=16, help="number of requests (16)")
    p.add_argument("--system-tokens", type=_non_negative, default=64,
                   help="shared system prompt length in tokens (64)")
    p.add_argument("--fewshot-tokens", type=_non_negative, default=48,
                   help="shared few-shot preamble length in tokens (48)")
    p.add_argument("--user-tokens", type=_positive, default=16,
                   help="per-request user turn length in tokens (16)")
    p.add_argument("--new-tokens", type=_positive, default=16,
                   help="tokens generated per request, greedy (16)")
    p.add_argument("--block-size", type=int, choices=(8, 16, 32), default=16,
                   help="tokens per KV block (16)")
    p.add_argument("--backend", choices=("numpy", "mlx"), default="numpy",
                   help="array backend of the model and the pool (numpy)")
    p.add_argument("--max-batch", type=_positive, default=8,
                   help="sequences decoding together (8)")
    p.add_argument("--initial-blocks", type=_positive, default=8,
                   help="pool size at start, in blocks (8); it grows on demand")
    p.add_argument("--max-blocks", type=_int_at_least(1, MAX_DEMO_BLOCKS), default=256,
                   help="pool maximum in blocks (256)")
    p.add_argument("--seed", type=_non_negative, default=0, help="weights and prompt seed (0)")
    p.add_argument("--kv-mode", default=None, metavar="MODE",
                   help="K mode of the KV cache: q8, fwht4, fwht3, fwht2, auto "
                        "(docs/kv-quant.md; also PAGEDKV_KV_MODE). Default: float32 KV")
    p.add_argument("--kv-v", default=None, metavar="MODE",
                   help="V mode with --kv-mode: q8, lloyd4, lloyd3, lloyd2 (also PAGEDKV_KV_V)")
    p.add_argument("--engine", choices=("reference", "mlx-lm"), default="reference",
                   help="model code: pagedkv's reference transformer, or mlx-lm's (with "
                        "pagedkv as its prompt cache; needs pagedkv[mlx-lm])")
    p.add_argument("--arch", default=None, metavar="ARCH",
                   help="with --engine mlx-lm: the mlx-lm architecture, random weights "
                        "(qwen3; also llama, mistral, qwen2, phi3, gemma2; sliding-window "
                        "gemma3_text, gpt_oss, gemma4_text; recurrent qwen3_next, qwen3_5)")
    from pagedkv.cli.demo_restart import add_arguments
    add_arguments(p)
    p.set_defaults(func=run)


def build_requests(args: argparse.Namespace, vocab_size: int):
    """Prompts = shared system prompt + shared few-shot preamble + a distinct user turn."""
    import numpy as np

    from pagedkv.tiny_model.serving import Request

    rng = np.random.default_rng(args.seed + 1)
    shared = rng.integers(0, vocab_size, args.system_tokens + args.fewshot_tokens, np.uint32)
    return [Request(f"req-{i:03d}",
                    np.concatenate([shared, rng.integers(0, vocab_size, args.user_tokens,
                                                         np.uint32)]),
                    args.new_tokens)
            for i in range(args.requests)]


_KV_ENV = ("PAGEDKV_KV_MODE", "PAGEDKV_KV_V", "PAGEDKV_KV_ADAPTIVE", "HIPFIRE_KV_MODE",
           "HIPFIRE_KV_V", "HIPFIRE_KV_ADAPTIVE")


def kv_dtype_for(args: argparse.Namespace) -> str:
    """The demo's KV storage: float32 unless ``--kv-mode``/``--kv-v`` or a KV-mode variable
    asks for a mode (docs/kv-quant.md "Choosing a mode"). ``InvalidArgument`` for bad
    values and for kv_adaptive (a per-sequence budget; the demo serves many sequences)."""
    import os

    from pagedkv.errors import InvalidArgument
    from pagedkv.kv_mode import resolve_kv_modes
    if args.kv_mode is None and args.kv_v is None and not any(
            os.environ.get(name) for name in _KV_ENV):
        return "float32"
    choice = resolve_kv_modes(k=args.kv_mode, v=args.kv_v)
    if choice.adaptive != "off":
        raise InvalidArgument(f"kv_adaptive={choice.adaptive!r} ({choice.sources['adaptive']}):"
                              " the demo serves many sequences from one pool and kv_adaptive "
                              "budgets one; unset it (see docs/kv-quant.md, kv_adaptive)")
    if choice.kv_dtype == "bfloat16":
        raise InvalidArgument("--kv-mode bf16: the reference model computes in float32; "
                              "omit --kv-mode for float32 KV or pick a quantized mode")
    return choice.kv_dtype


def head_dim_for(kv_dtype: str) -> int:
    """The reference model's head_dim for a KV storage: 16 for float32 (fast), else the
    smallest the modes store (q8: 32, fwht4/fwht2: 128, fwht3 and lloyd: 256)."""
    from pagedkv.quant import kv
    if kv_dtype == "float32":
        return 16
    modes = [kv.kv_mode(s) for s in kv.split_kv_dtype(kv_dtype)]
    if any(m.rotation == 256 for m in modes):
        return 256
    return 128 if any(m.rotated for m in modes) else 32


def cold_tier_for(args: argparse.Namespace, model):
    """The cold tier the adapter gets (``--cold-dir``/``--restart``), else ``None``."""
    from pagedkv.cli.demo_restart import cold_tier_for as persistence_tier
    return persistence_tier(args, model)


def report_rows(report, requests, args: argparse.Namespace) -> list[list[str]]:
    prompt_tokens = report.prompt_tokens
    grow = (f"{report.grow_events} ({args.initial_blocks} -> {report.pool_blocks} blocks, "
            f"max {report.pool_max_blocks})")
    step_ms = report.seconds_per_decode_step * 1e3
    return [
        ["metric", "value"],
        ["requests", f"{len(requests)} ({report.hit_requests} with a prefix hit)"],
        ["prompt tokens", f"{prompt_tokens:,}"],
        ["cached tokens reused", f"{report.cached_tokens:,}"],
        ["hit rate", f"{report.hit_rate:.1%}"],
        ["blocks allocated", f"{report.blocks_allocated:,}"],
        ["blocks shared", f"{report.blocks_shared:,}"],
        ["pool growth events", grow],
        ["evictions", f"{report.evictions:,}"],
        ["preemptions", f"{report.preemptions:,}"],
        ["decode steps", f"{report.decode_steps:,}"],
        ["time per decode step", (f"{step_ms:.2f} ms (adapter bookkeeping "
                                 f"{report.bookkeeping_seconds_per_step * 1e6:.1f} us)")],
    ]


def check_sizes(args: argparse.Namespace, max_position: int) -> str | None:
    """Why these options cannot run (one line naming the options and the fix), or None."""
    if args.initial_blocks > args.max_blocks:
        return (f"--initial-blocks {args.initial_blocks} exceeds --max-blocks {args.max_blocks}; "
                "lower --initial-blocks or raise --max-blocks")
    prompt = args.system_tokens + args.fewshot_tokens + args.user_tokens
    # The last generated token is never fed back, so a request ends holding prompt + new - 1.
    held = prompt + args.new_tokens - 1
    if held > max_position:
        return (f"a request spans {held:,} positions ({prompt:,} prompt + {args.new_tokens:,} "
                f"new tokens - 1) but the reference model holds {max_position:,}; shorten "
                "--system-tokens, --fewshot-tokens, --user-tokens or --new-tokens")
    blocks = -(-held // args.block_size)
    if blocks > args.max_blocks:
        return (f"a request needs {blocks:,} blocks of {args.block_size} tokens ({held:,} "
                f"tokens) but --max-blocks is {args.max_blocks:,}; raise --max-blocks to at "
                f"least {blocks:,} or shorten the prompt")
    return None


def prepare_session(args: argparse.Namespace, config, kv_dtype: str = "float32"):
    """``(model, requests)`` for ``config`` on ``--backend`` with its KV cache stored as
    ``kv_dtype``, or the exit status (2) after printing why these options cannot run."""
    from pagedkv.tiny_model import ReferenceModel

    try:
        model = ReferenceModel(config, backend=args.backend, kv_dtype=kv_dtype)
    except ImportError as e:
        print(f"pagedkv demo: error: backend {args.backend!r} is not available here: {e}",
              file=sys.stderr)
        return 2
    problem = check_sizes(args, model.config.max_position)
    if problem:
        print(f"pagedkv demo: error: {problem}", file=sys.stderr)
        return 2
    return model, build_requests(args, model.config.vocab_size)


def print_parity(model, requests, outputs) -> bool:
    """Recompute every request alone on a flat cache; print the verdict; whether all match."""
    from pagedkv.tiny_model.serving import check_parity

    bad = check_parity(model, requests, outputs)
    if bad:
        print(f"parity: MISMATCH in {len(bad)}/{len(requests)} requests "
              f"({', '.join(map(str, bad[:5]))}{', ...' if len(bad) > 5 else ''}): the paged "
              "output differs from the flat path")
        return False
    print(f"parity: OK ({len(requests)}/{len(requests)} outputs byte-identical to the flat "
          "path: tokens and logits)")
    return True


def run(args: argparse.Namespace) -> int:
    from pagedkv.tiny_model import ReferenceConfig
    from pagedkv.tiny_model.serving import build_paged_adapter, serve

    if args.engine == "mlx-lm":
        if args.model != "reference":
            print("pagedkv demo: error: --model picks the reference engine's model; with "
                  "--engine mlx-lm pick the architecture with --arch", file=sys.stderr)
            return 2
        from pagedkv.cli.demo_mlx_lm import ARCHS, run_mlx_lm
        args.arch = args.arch or "qwen3"
        if args.arch not in ARCHS:
            print(f"pagedkv demo: error: --arch {args.arch!r} is not one of {list(ARCHS)}",
                  file=sys.stderr)
            return 2
        return run_mlx_lm(args)
    if args.arch is not None:
        print("pagedkv demo: error: --arch needs --engine mlx-lm (the reference engine's "
              "models are picked with --model)", file=sys.stderr)
        return 2
    if args.restart_child:
        from pagedkv.cli.demo_restart import run_child
        return run_child(args)
    from pagedkv.errors import InvalidArgument
    try:
        kv_dtype = kv_dtype_for(args)
    except InvalidArgument as e:
        print(f"pagedkv demo: error: {e}", file=sys.stderr)
        return 2
    if args.model == "hybrid":
        if kv_dtype != "float32":
            print(f"pagedkv demo: error: --model hybrid stores float32 K/V; KV mode "
                  f"{kv_dtype!r} runs with --model reference (unset --kv-mode/--kv-v and the "
                  f"PAGEDKV_KV_* variables)", file=sys.stderr)
            return 2
        from pagedkv.cli.demo_hybrid import run_hybrid
        return run_hybrid(args)

    prepared = prepare_session(
        args, ReferenceConfig(seed=args.seed, head_dim=head_dim_for(kv_dtype)), kv_dtype)
    if isinstance(prepared, int):
        return prepared
    model, requests = prepared
    try:
        cold_tier = cold_tier_for(args, model)
    except ValueError as e:
        print(f"pagedkv demo: {e}", file=sys.stderr)
        return 2
    adapter = build_paged_adapter(model, block_size=args.block_size,
                                  num_blocks=args.initial_blocks, max_num_blocks=args.max_blocks,
                                  cold=cold_tier)
    c = model.config
    print(f"pagedkv demo: {len(requests)} requests, prompt = {args.system_tokens} system + "
          f"{args.fewshot_tokens} few-shot (shared) + {args.user_tokens} user tokens, "
          f"{args.new_tokens} new tokens each")
    print(f"model: reference transformer ({c.num_layers} layers, hidden {c.hidden_size}, "
          f"{c.num_heads}/{c.num_kv_heads} heads, vocab {c.vocab_size}), backend {args.backend}, "
          f"block size {args.block_size}, max batch {args.max_batch}")
    if kv_dtype != "float32":
        g = adapter.pool.geometry
        f16 = 2 * 2 * c.num_layers * c.num_kv_heads * c.head_dim
        print(f"KV cache: {kv_dtype} at head_dim {c.head_dim}, {g.bytes_per_token} bytes per "
              f"token ({g.bytes_per_token / f16:.1%} of float16)")
    print()
    report = serve(model, adapter, requests, max_batch=args.max_batch)
    for line in format_table(report_rows(report, requests, args)):
        print(line)
    print()
    if not print_parity(model, requests, report.outputs):
        return 1
    from pagedkv.cli.demo_restart import run_restart_phase
    return run_restart_phase(args)

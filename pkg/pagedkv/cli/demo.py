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

from pagedkv.cli.demo_restart import add_arguments, cold_tier_for, run_child, run_restart_phase
from pagedkv.cli.demo_session import (
    head_dim_for,
    kv_dtype_for,
    prepare_session,
    print_parity,
    report_rows,
)
from pagedkv.cli.table import format_table

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
                        "(docs/kv-quant.md; also PAGEDKV_KV_MODE; reference engine only). "
                        "Default: float32 KV")
    p.add_argument("--kv-v", default=None, metavar="MODE",
                   help="V mode with --kv-mode: q8, lloyd4, lloyd3, lloyd2 (head_dim 256), "
                        "fwht4, fwht2 (head_dim 128), fwht3 (also PAGEDKV_KV_V)")
    p.add_argument("--engine", choices=("reference", "mlx-lm"), default="reference",
                   help="model code: pagedkv's reference transformer, or mlx-lm's (with "
                        "pagedkv as its prompt cache; needs pagedkv[mlx-lm])")
    p.add_argument("--arch", default=None, metavar="ARCH",
                   help="with --engine mlx-lm: the mlx-lm architecture, random weights "
                        "(qwen3; also llama, mistral, qwen2, phi3, gemma2; sliding-window "
                        "gemma3_text, gpt_oss, gemma4_text; recurrent qwen3_next, qwen3_5)")
    add_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv.tiny_model import ReferenceConfig
    from pagedkv.tiny_model.serving import build_paged_adapter, serve

    if args.cold_backend and (args.engine == "mlx-lm" or args.model == "hybrid"):
        # Only the reference model's tier opens a remote store; the others would run on
        # the directory alone and say nothing.
        which = "--engine mlx-lm" if args.engine == "mlx-lm" else "--model hybrid"
        print(f"pagedkv demo: error: --cold-backend is the reference model's; {which} keeps "
              "its cold tier in --cold-dir only (drop --cold-backend, or run the reference "
              "model)", file=sys.stderr)
        return 2
    if args.engine == "mlx-lm":
        if args.model != "reference":
            print("pagedkv demo: error: --model picks the reference engine's model; with "
                  "--engine mlx-lm pick the architecture with --arch", file=sys.stderr)
            return 2
        if args.kv_mode is not None or args.kv_v is not None:
            # The mlx-lm demo's pool stores the model's own K/V dtype: a KV mode would be
            # ignored, and the run would pass as if it had been used.
            flag = "--kv-mode" if args.kv_mode is not None else "--kv-v"
            print(f"pagedkv demo: error: {flag} is the reference engine's; --engine mlx-lm "
                  "stores the model's own K/V dtype (drop --kv-mode/--kv-v, or run the "
                  "reference engine)", file=sys.stderr)
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
    return run_restart_phase(args)

"""The session every ``pagedkv demo`` variant runs: the request set (a shared system prompt and
few-shot preamble, a distinct user turn each), the KV storage choice, the size checks, the
report rows and the parity verdict. ``pagedkv.cli.demo`` (the command), ``demo_restart`` (the
persistence phases), ``demo_hybrid`` and ``demo_mlx_lm`` build on it; it imports none of them.
"""

from __future__ import annotations

import argparse
import re
import sys


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
#: The demo's flag for each knob resolve_kv_modes calls "argument k" / "argument v".
_KV_FLAGS = {"k": "--kv-mode", "v": "--kv-v"}


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
    try:
        choice = resolve_kv_modes(k=args.kv_mode, v=args.kv_v)
    except InvalidArgument as exc:
        # resolve_kv_modes names explicit values "argument k" / "argument v": name the flags.
        raise InvalidArgument(re.sub(r"\bargument ([kv])\b",
                                     lambda m: _KV_FLAGS[m.group(1)], str(exc))) from None
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
    smallest the modes store (q8: 32, fwht4/fwht2 on either side: 128, fwht3 and lloyd:
    256)."""
    from pagedkv.quant import kv
    if kv_dtype == "float32":
        return 16
    modes = [kv.kv_mode(s) for s in kv.split_kv_dtype(kv_dtype)]
    if any(m.rotation == 256 for m in modes):
        return 256
    return 128 if any(m.rotated for m in modes) else 32


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

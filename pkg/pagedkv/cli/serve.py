"""``pagedkv serve``: mlx-lm's OpenAI-compatible server with pagedkv as its prompt cache.

Every option this command does not define is mlx-lm's server's own (``--port``, ``--host``,
``--max-tokens``, ``--chat-template``, ...) and goes to its parser unchanged
(docs/integrations/mlx-lm.md, "The server").
"""

from __future__ import annotations

import argparse
import sys

#: Upper bound of --max-blocks: the allocator sizes its block table for the maximum up front
#: (80 bytes a block, so 320 MiB at this bound: 64 M tokens of 16).
MAX_SERVE_BLOCKS = 1 << 22


def register(sub: argparse._SubParsersAction) -> None:
    from pagedkv.cli.demo import _int_at_least
    from pagedkv.cli.demo_restart import directory_argument

    p = sub.add_parser(
        "serve", help="mlx-lm's OpenAI-compatible server with pagedkv as the prompt cache",
        description="Run mlx-lm's own server (HTTP handler, batching, generation) with "
                    "pagedkv as its prompt cache: conversations share their system prompt's "
                    "KV blocks, and with --cold-dir warm prefixes survive a restart. Options "
                    "not listed here are mlx_lm.server's (see `mlx_lm.server --help`).")
    p.add_argument("--model", required=True, metavar="DIR",
                   help="an mlx-lm model directory (or Hugging Face repo id)")
    p.add_argument("--block-size", type=int, choices=(8, 16, 32), default=16,
                   help="tokens per KV block (16)")
    p.add_argument("--max-blocks", type=_int_at_least(1, MAX_SERVE_BLOCKS), default=None,
                   help="most blocks the pool may grow to (default: one full context of the "
                        "model, or PAGEDKV_PAGED_CACHE_MEMORY_MB)")
    p.add_argument("--cold-dir", default=None, metavar="DIR", type=directory_argument,
                   help="persist full KV blocks in DIR/pagedkv-v1 and restore them after a "
                        "restart")
    p.add_argument("--unbatched-sliding", action="store_true",
                   help="serve a sliding-window model on mlx-lm's single-request path: every "
                        "finished conversation is published, generated tokens included, so "
                        "its next turn continues exactly (default: mlx-lm batches it, and "
                        "the cache learns each prompt but not the generated tokens: a "
                        "finished batched sliding cache holds the last window only)")
    p.set_defaults(func=run, accepts_extra_args=True)


def run(args: argparse.Namespace) -> int:
    try:
        from pagedkv.integrations.mlx_lm.server import run_server
    except ImportError as exc:
        print(f"pagedkv serve: error: {exc}", file=sys.stderr)
        return 2
    return run_server(args.model, args.extra_args, block_size=args.block_size,
                      max_blocks=args.max_blocks, cold_dir=args.cold_dir,
                      unbatched_sliding=args.unbatched_sliding)

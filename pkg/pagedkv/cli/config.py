"""``pagedkv config``: print show_config() and, with --self-check, exercise the allocator."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="print the build configuration; --self-check also "
                                      "tests the allocator")
    p.add_argument("--self-check", action="store_true",
                   help="also run a short allocator self-check")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedkv import show_config
    show_config()
    if not args.self_check:
        return 0
    from pagedkv.selfcheck import run_self_check
    ok = run_self_check()
    return 0 if ok else 1

"""The ``pagedkv`` command.

Each subcommand lives in its own module of this package, which defines
``register(subparsers)`` (adds its parser and sets ``func``) and keeps its
heavy imports inside the function that runs it, so ``pagedkv --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `pagedkv --help` lists them.
COMMANDS = (
    "pagedkv.cli.config",
    "pagedkv.cli.demo",
    "pagedkv.cli.inspect",
    "pagedkv.cli.convert",
    "pagedkv.cli.cold",
    "pagedkv.cli.serve",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="pagedkv: paged KV cache, cold tier and quantized tensors.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def error_text(exc: BaseException) -> str:
    """One line for a user: an OSError as ``path: reason`` (no errno, no repr quotes)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `pagedkv serve` passes the options it does not define to mlx-lm's own server parser.
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    if args.version:
        from pagedkv import __version__
        print(__version__)
        return 0
    if args.command is None:
        # No subcommand: the quick health check (configuration + allocator self-check).
        args = parser.parse_args(["config", "--self-check"])
    from pagedkv.errors import PagedKVError
    try:
        return int(args.func(args) or 0)
    except (PagedKVError, OSError) as exc:
        # Commands catch what they expect; anything else from pagedkv or the OS is still the
        # user's input or environment, so one line, not a traceback.
        print(f"pagedkv {args.command}: error: {error_text(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130

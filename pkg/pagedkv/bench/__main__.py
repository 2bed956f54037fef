"""``python -m pagedkv.bench <suite> [options]``."""

from __future__ import annotations

import importlib
import sys

SUITES = {"gpu": "pagedkv.bench.gpu", "decode": "pagedkv.bench.decode",
          "mlx": "pagedkv.bench.mlx", "kvquant-quality": "pagedkv.bench.kvquant_quality",
          "quality": "pagedkv.bench.quality"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    usage = (f"usage: python -m pagedkv.bench {{{','.join(SUITES)}}} [options]  "
             "(python -m pagedkv.bench SUITE --help for the suite's options)")
    if argv and argv[0] in ("-h", "--help"):
        print(usage)
        return 0
    if not argv or argv[0] not in SUITES:
        problem = f"unknown suite {argv[0]!r}; " if argv else "no suite given; "
        print(f"python -m pagedkv.bench: {problem}{usage}", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

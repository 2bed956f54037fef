"""``python -m pagedkv.bench <suite> [options]``."""

from __future__ import annotations

import importlib
import sys

SUITES = {"gpu": "pagedkv.bench.gpu"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m pagedkv.bench {{{','.join(SUITES)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(SUITES[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

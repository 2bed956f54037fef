"""Plain-text tables for the command line (aligned columns, no borders)."""

from __future__ import annotations

from collections.abc import Set as AbstractSet


def format_table(rows: list[list[str]], right: AbstractSet[int] = frozenset()) -> list[str]:
    """Lines of ``rows`` (the first is the header) with columns padded to one width;
    columns whose index is in ``right`` are right-aligned (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(widths[i]) if i in right else c.ljust(widths[i])
                      for i, c in enumerate(r)).rstrip() for r in rows]

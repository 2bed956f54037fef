"""Strict JSON parsing for HFQM metadata and the files it is built from.

Python's ``json.loads`` accepts ``NaN``, ``Infinity``, ``-Infinity`` and numbers past
float64 (read as ``inf``); RFC 8259 JSON has none of them and hipfire's serde_json
loader refuses them, so metadata holding one would make a file hipfire cannot open.
Every parse of text that ends up in HFQM metadata goes through :func:`loads`.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["loads"]


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a float64")
    return value


def loads(text: str | bytes) -> Any:
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and numbers beyond float64 with
    a ``ValueError`` (``RecursionError`` for nesting deeper than the parser takes, as
    ``json.loads``)."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)

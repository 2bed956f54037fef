"""Parsing of ``PAGEDKV_*`` environment knobs (docs/contracts/paged-kv.md, '6.3 Knobs and
precedence'): a value that is set and parses wins; an unparseable one is ignored with one
WARNING on the ``pagedkv`` logger naming the variable, the bad value, the accepted syntax and
the value used instead. A base module: the pool's sizing and the cold tier's knobs both read
their variables through it, so neither imports the other.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["U32_MAX", "env_bool", "env_u32", "parse_bool", "parse_u32"]

logger = logging.getLogger("pagedkv")

U32_MAX = 0xFFFF_FFFF
_U32_SYNTAX = "a base-10 integer 0..4294967295 (no sign, unit or underscores)"
_BOOL_SYNTAX = "one of 1/true/on/yes or 0/false/off/no (any case)"
_DIGITS = re.compile(r"[0-9]+", re.ASCII)
_TRUE = frozenset({"1", "true", "on", "yes"})
_FALSE = frozenset({"0", "false", "off", "no"})


def parse_u32(text: str) -> int | None:
    """A base-10 u32 after trimming whitespace, or ``None`` if ``text`` is not one."""
    text = text.strip()
    if not _DIGITS.fullmatch(text):
        return None
    value = int(text)
    return value if value <= U32_MAX else None


def parse_bool(text: str) -> bool | None:
    """``1/true/on/yes`` → True, ``0/false/off/no`` → False (trimmed, any case), else None."""
    text = text.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    return None


def _env_value(name, parse, syntax, fallback, fallback_source, environ):
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None:
        return fallback
    value = parse(raw)
    if value is None:
        logger.warning("ignoring %s=%r: expected %s; using %r (%s)", name, raw, syntax, fallback,
                       fallback_source)
        return fallback
    return value


_Fallback = TypeVar("_Fallback")  # what an unset or bad env value gives back, e.g. None


def env_u32(name: str, fallback: _Fallback, *, fallback_source: str = "default",
            environ: Mapping[str, str] | None = None) -> int | _Fallback:
    """The u32 value of env ``name`` when set and parseable, else ``fallback`` (a bad value
    is logged once per call at WARNING, naming ``fallback_source``)."""
    return _env_value(name, parse_u32, _U32_SYNTAX, fallback, fallback_source, environ)


def env_bool(name: str, fallback: _Fallback, *, fallback_source: str = "default",
             environ: Mapping[str, str] | None = None) -> bool | _Fallback:
    """The boolean value of env ``name`` when set and parseable, else ``fallback``."""
    return _env_value(name, parse_bool, _BOOL_SYNTAX, fallback, fallback_source, environ)

"""pagedkv: the memory layer of an LLM inference engine.

A block-paged KV cache with verified prefix sharing (:mod:`pagedkv.allocator`,
:mod:`pagedkv.pool`, :mod:`pagedkv.adapter`; hybrid models: :mod:`pagedkv.coordinator`), a
disk cold tier
(:mod:`pagedkv.cold`), and quantized tensor storage (:mod:`pagedkv.hfqm`,
:mod:`pagedkv.quant`, :mod:`pagedkv.kernels`). ``import pagedkv`` is cheap:
subsystems load on first attribute access, and MLX is never imported here.
"""

from __future__ import annotations

import importlib

from pagedkv import errors
from pagedkv._build_config import VERSION as __version__
from pagedkv._config import get_include, show_config

__all__ = ["__version__", "errors", "get_include", "show_config"]

_LAZY_SUBMODULES = frozenset({
    "adapter", "allocator", "cold", "coordinator", "hashing", "hfqm", "kernels", "pool",
    "quant", "sizing", "tiny_model",
})


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"pagedkv.{name}")
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_SUBMODULES)

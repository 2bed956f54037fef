"""The launch constants of the ``hip/`` kernels, read from their one definition,
``pagedkv/launch.h`` (docs/kernels.md, "Launch constants").

Every launcher (the ctypes ones in :mod:`pagedkv.kernels` and the MLX CUDA one in
:mod:`pagedkv.kernels.mlx.cuda`) takes its threads per block, partition tokens and
``__launch_bounds__`` minimum blocks from here, so a change of the header reaches the
kernels and all launchers at once. Per-KV-dtype values are named by the dtype's own suffix
(``PKV_ATTN_PARTITION_BF16`` for ``bfloat16``): no dtype borrows another's value.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from pagedkv.errors import PagedKVError

__all__ = ["KV_SUFFIX", "attn_min_blocks", "attn_partition_tokens", "gemv_rows_per_block",
           "launch_constant", "launch_constants"]

HEADER = "pagedkv/launch.h"
# The suffix of each KV dtype's constants in launch.h (the kernels' KV_F16/KV_BF16/KV_Q8).
KV_SUFFIX = {"float16": "F16", "bfloat16": "BF16", "q8": "Q8"}
_DEFINE = re.compile(r"^#define (PKV_[A-Z0-9_]+) (\d+)\s*$", re.MULTILINE)


@functools.cache
def launch_constants() -> dict[str, int]:
    """Every ``#define PKV_<NAME> <int>`` of ``pagedkv/launch.h``, by name."""
    from pagedkv import get_include
    path = Path(get_include()) / HEADER
    try:
        text = path.read_text()
    except OSError as e:
        raise PagedKVError(f"{path}: the kernels' launch constants are not installed with "
                           f"pagedkv ({e}); reinstall pagedkv") from None
    return {m.group(1): int(m.group(2)) for m in _DEFINE.finditer(text)}


def launch_constant(name: str) -> int:
    """One constant of ``pagedkv/launch.h`` (``PKV_ATTN_THREADS``, ...)."""
    try:
        return launch_constants()[name]
    except KeyError:
        raise LookupError(f"{HEADER} defines no integer {name}") from None


def attn_partition_tokens(kv_dtype: str) -> int:
    """Tokens per paged-attention partition for KV dtype ``kv_dtype``."""
    return launch_constant(f"PKV_ATTN_PARTITION_{KV_SUFFIX[kv_dtype]}")


def attn_min_blocks(kv_dtype: str) -> int:
    """The attention kernel's ``__launch_bounds__`` minimum blocks per SM for ``kv_dtype``."""
    return launch_constant(f"PKV_ATTN_MIN_BLOCKS_{KV_SUFFIX[kv_dtype]}")


def gemv_rows_per_block(bmax: int) -> int:
    """Rows per block of the CUDA-core GEMV compiled for batches up to ``bmax`` (1, 2, 4, 8):
    ``PKV_GEMV_ROWS_B2`` up to 2, ``PKV_GEMV_ROWS_B8`` above (``GEMV_ROWS_FOR``)."""
    return launch_constant("PKV_GEMV_ROWS_B2" if bmax <= 2 else "PKV_GEMV_ROWS_B8")

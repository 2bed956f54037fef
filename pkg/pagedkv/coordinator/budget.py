"""The shared pool budget of a grouped model and its admission width (docs/coordinator.md,
"Pool budget and admission width").

Grouped pools are sized for one full-context sequence in every group plus each sliding
group's null block, not for ``max_model_len x max_num_seqs``: many short rows run together,
and when their contexts grow, recompute preemption decides who keeps the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.argument_checks import items_argument
from pagedkv.coordinator.grouping import KVCacheGroupSpec
from pagedkv.coordinator.specs import _int
from pagedkv.errors import InvalidArgument

__all__ = ["MAX_ADMISSION_WIDTH", "PoolBudget", "plan_pool_budget"]

MiB = 1 << 20

#: The widest admission the budget plans for (rows with a starter block in every group).
MAX_ADMISSION_WIDTH = 32

#: Floors of the default budget, MiB: a model never gets less than these by default.
_DEFAULT_FLOORS_MB = (256, 2048)


@dataclass(frozen=True)
class PoolBudget:
    """What :func:`plan_pool_budget` decided; bytes and blocks per group in group order.

    minimum_pool_bytes: one full-admission sequence in every group plus the null blocks.
    default_memory_mb: the budget used when none is given.
    memory_bytes: the budget used.
    admission_width: how many rows the pools give a block in every group at once
    (``coordinator.max_concurrent_sequences``).
    blocks_per_group: each group's pool size in blocks (a sliding group's includes its null
    block; whole leftover blocks go to the first full group).
    bytes_per_block: ``bpb(g)``, K and V bytes of one block over the group's layers.
    """

    minimum_pool_bytes: int
    default_memory_mb: int
    memory_bytes: int
    admission_width: int
    blocks_per_group: tuple[int, ...]
    bytes_per_block: tuple[int, ...]

    @property
    def pool_bytes(self) -> int:
        """Bytes the planned pools take: ``sum(blocks * bpb)`` (<= ``memory_bytes``)."""
        return sum(b * p for b, p in zip(self.blocks_per_group, self.bytes_per_block,
                                         strict=True))


def plan_pool_budget(groups: Sequence[KVCacheGroupSpec], *, max_num_seqs: int,
                     memory_bytes: int | None = None,
                     memory_mb: int | None = None) -> PoolBudget:
    """Size every group's pool from one memory budget (C10 of docs/coordinator.md).

    ``memory_bytes`` (exact, for tests) wins over ``memory_mb``; neither → the default,
    ``max(ceil(minimum / MiB), 256, 2048)`` MiB. A budget below the minimum, or one that
    cannot give width 1, raises ``InvalidArgument`` naming both figures.
    """
    groups = items_argument("groups", groups)
    if not groups:
        raise InvalidArgument("plan_pool_budget needs at least one group")
    max_num_seqs = _int("max_num_seqs", max_num_seqs)
    if max_num_seqs < 1:
        raise InvalidArgument(f"max_num_seqs = {max_num_seqs} must be >= 1")
    bpb = [g.bytes_per_block for g in groups]
    sliding = [g.kind.is_sliding for g in groups]
    one_seq = sum(g.max_admission_blocks * b for g, b in zip(groups, bpb, strict=True))
    null_bytes = sum(b for b, s in zip(bpb, sliding, strict=True) if s)
    minimum = one_seq + null_bytes
    default_mb = max(math.ceil(minimum / MiB), *_DEFAULT_FLOORS_MB)
    if memory_bytes is not None:
        memory = _int("memory_bytes", memory_bytes)
    elif memory_mb is not None:
        memory = _int("memory_mb", memory_mb) * MiB
    else:
        memory = default_mb * MiB
    if memory < minimum:
        raise InvalidArgument(
            f"the KV pool budget is {memory:,} bytes but one full-context sequence needs "
            f"{minimum:,} bytes ({one_seq:,} for the groups + {null_bytes:,} for the null "
            "blocks); raise the budget or lower max_model_len")

    def reserved(width: int) -> list[int]:
        return [max(g.max_admission_blocks, width) + (1 if s else 0)
                for g, s in zip(groups, sliding, strict=True)]

    def required(width: int) -> int:
        return sum(r * b for r, b in zip(reserved(width), bpb, strict=True))

    width = min(max_num_seqs, MAX_ADMISSION_WIDTH)
    while width > 1 and required(width) > memory:
        width -= 1
    if required(width) > memory:
        raise InvalidArgument(
            f"the KV pool budget is {memory:,} bytes but one row in every group needs "
            f"{required(width):,} bytes")
    blocks = reserved(width)
    full = next((i for i, s in enumerate(sliding) if not s), None)
    if full is not None:
        blocks[full] += (memory - required(width)) // bpb[full]
    return PoolBudget(minimum, default_mb, memory, width, tuple(blocks), tuple(bpb))

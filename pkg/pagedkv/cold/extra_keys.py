"""Per-block extra keys of a cold chain, validated by the hot chain's own rules."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.hashing import make_chain_keys

__all__ = ["per_block_extra_keys"]


def per_block_extra_keys(num_full_blocks: int, extra_keys: Sequence[int] = (),
                         extra_keys_per_block: Sequence[Sequence[int]] | None = None
                         ) -> list[tuple[int, ...]]:
    """The extra keys of each chained block, with the hot chain's stopping rule.

    ``extra_keys`` applies to every block; ``extra_keys_per_block[i]`` to block ``i`` and
    the chain stops at the first block without an entry (docs/contracts/paged-kv.md, '2.2 Chains').
    """
    keys = make_chain_keys(extra_keys, extra_keys_per_block)
    flat = [int(k) for k in keys.flat_keys]
    if not keys.per_block:
        return [tuple(flat)] * num_full_blocks
    offs = keys.key_offsets
    assert offs is not None, "per-block chain keys always carry their offsets"
    n = min(num_full_blocks, keys.max_blocks)
    return [tuple(flat[offs[i]:offs[i + 1]]) for i in range(n)]

"""A short allocator self-check for ``python -m pagedkv`` / ``pagedkv config --self-check``.

It exercises the installed Cython core end to end (hash vector, allocate, register,
verified lookup, free, invariants) and prints one line per step, so a fresh install
shows at a glance that the compiled modules load and agree with the spec.
"""

from __future__ import annotations

import numpy as np

__all__ = ["run_self_check"]

# docs/contracts/paged-kv.md, '2.4 Reference vectors (hash_seed = 0)', first row: block 0, tokens
# [1, 2, 3, 4], no keys, salt 0, seed 0.
_PINNED_HASH = 0x321DB453EB3BE929


def run_self_check() -> bool:
    """Run the self-check; print its steps; return True when every step passed."""
    from pagedkv.allocator import BlockAllocator
    from pagedkv.errors import InvariantViolation
    from pagedkv.hashing import XXH3_SOURCE, hot_block_hash

    ok = True

    def step(name: str, passed: bool, detail: str = "") -> None:
        nonlocal ok
        ok = ok and passed
        print(f"  [{'ok' if passed else 'FAIL'}] {name}{': ' + detail if detail else ''}")

    print("allocator self-check")
    h = hot_block_hash(0, [1, 2, 3, 4])
    step("hot hash vector", h == _PINNED_HASH, f"{h:#018x} via {XXH3_SOURCE}")

    alloc = BlockAllocator(8, 16, 4, hash_seed=0)
    tokens = np.arange(12, dtype=np.uint32)
    blocks = alloc.allocate_many(3)
    step("allocate_many(3)", blocks is not None and blocks.tolist() == [0, 1, 2],
         f"{None if blocks is None else blocks.tolist()}")
    if blocks is None:  # nothing to register: the remaining steps would only crash
        print("self-check FAILED")
        return False
    added = alloc.cache_full_blocks(tokens, blocks)
    alloc.free_many(blocks)
    step("register and release a 3-block chain", added == 3 and alloc.num_evictable_blocks == 3,
         f"{added} entries, {alloc.num_evictable_blocks} cache-only")
    hit, n_tokens = alloc.find_longest_cache_hit(tokens)
    step("verified longest hit", hit.tolist() == [0, 1, 2] and n_tokens == 12,
         f"{hit.tolist()}, {n_tokens} tokens")
    alloc.free_many(hit)
    try:
        alloc.free(0)
        step("double free is refused", False)
    except InvariantViolation:
        step("double free is refused", True)
    try:
        alloc.check_invariants()
        step("check_invariants", True, repr(alloc))
    except InvariantViolation as exc:
        step("check_invariants", False, str(exc))
    print("self-check " + ("passed" if ok else "FAILED"))
    return ok

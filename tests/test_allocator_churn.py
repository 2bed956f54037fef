"""Differential churn: larger pools than the state machine reaches, same oracle.

The state machine (test_allocator_stateful.py) keeps pools tiny so hypothesis can shrink; the
Cython prefix table is open addressing with backward-shift deletion, whose bugs need many live
entries, long probe runs and wrap-around. Here seeded request traffic (shared documents,
next turns, releases, capacity overrides, purges, growth) runs on a few hundred blocks, with
and without a hash folded into a range smaller than the table, and every observable is
compared with the reference after every operation.
"""

from __future__ import annotations

import numpy as np
import pytest

import allocator_oracle
from allocator_implementations import ALLOCATORS, observables

CLASSES = [p.values[0] for p in ALLOCATORS]


def folded_hash(buckets):
    def hash_fn(parent, tokens, extra_keys, cache_salt, block_index, seed):
        return allocator_oracle.hot_block_hash(parent, np.asarray(tokens), tuple(extra_keys),
                                         cache_salt, block_index, seed=seed) % buckets + 1
    return hash_fn


def agree(allocs, method, *args, **kwargs):
    """Call ``method`` on every allocator; results and then all observables must agree."""
    outcomes = []
    for alloc in allocs:
        try:
            result = getattr(alloc, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the class is what must agree
            outcomes.append(("raised", type(exc).__name__))
            continue
        if isinstance(result, tuple):
            result = (result[0].tolist(), result[1])
        elif isinstance(result, np.ndarray):
            result = result.tolist()
        outcomes.append(("ok", result))
    assert all(o == outcomes[0] for o in outcomes), outcomes
    snaps = [observables(a) for a in allocs]
    assert all(s == snaps[0] for s in snaps[1:])
    return outcomes[0]


@pytest.mark.parametrize("seed, buckets", [(1, None), (2, None), (3, 48), (4, 7)])
def test_request_churn_agrees(seed, buckets):
    rng = np.random.default_rng(seed)
    bs = 2
    hash_fn = None if buckets is None else folded_hash(buckets)
    allocs = [cls(160, 256, bs, hash_seed=0, _hash_fn=hash_fn) for cls in CLASSES]
    documents = [rng.integers(0, 4, size=48).tolist() for _ in range(10)]
    salts = [0, 0, 0, 42]
    live: list[np.ndarray] = []   # block tables of running requests
    turns: list[tuple[list[int], int]] = []
    for step in range(700):
        kind = rng.choice(["serve", "serve", "turn", "release", "release", "admin"])
        if kind == "turn" and turns:
            tokens, salt = turns[rng.integers(len(turns))]
            tokens = tokens + rng.integers(0, 4, size=rng.integers(0, 7)).tolist()
            kind = "serve"
        elif kind in ("serve", "turn"):
            doc = documents[rng.integers(len(documents))]
            tokens = doc[:rng.integers(0, len(doc) + 1)]
            if tokens and rng.random() < 0.3:
                tokens[rng.integers(len(tokens))] = 9
            salt = salts[rng.integers(len(salts))]
        if kind == "serve":
            turns.append((tokens, salt))
            _, (hits, _) = agree(allocs, "find_longest_cache_hit", tokens, cache_salt=salt)
            _, new = agree(allocs, "allocate_many", len(tokens) // bs - len(hits))
            if new is None:
                if hits:
                    agree(allocs, "free_many", hits)
                continue
            table = np.array(hits + new, dtype=np.int32)
            agree(allocs, "cache_full_blocks", tokens, table, cache_salt=salt)
            live.append(table)
        elif kind == "release" and live:
            table = live.pop(rng.integers(len(live)))
            agree(allocs, "free_many", table[::-1])
        elif kind == "admin":
            r = rng.random()
            if r < 0.3:
                agree(allocs, "set_prefix_cache_capacity", int(rng.integers(0, 200)))
            elif r < 0.4:
                agree(allocs, "purge_prefix_cache")
            elif r < 0.6:
                agree(allocs, "grow_by", int(rng.integers(0, 20)))
        if step % 50 == 0:
            for alloc in allocs:
                alloc.check_invariants()
    stats = allocs[0].stats()  # the traffic reached what it is meant to exercise
    assert stats["hit_tokens"] > 0 and stats["pressure_evictions"] > 0
    assert stats["capacity_evictions"] > 0 and stats["grows"] > 0
    assert (stats["collisions_rejected"] > 0) == (buckets is not None)
    for alloc in allocs:
        alloc.check_invariants()

"""BlockAllocator benchmarks (issue 2 targets) against a compact pure-Python block pool.

The baseline, ``PyBlockPool``, is the usual pure-Python design (vLLM's BlockPool and
mlx-node's allocator look like it): a ``deque`` free list, a refcount list, a hash →
block dict and an ``OrderedDict`` LRU, hashing each block with the ``xxhash`` wheel. It
is measured in the same run, so each figure is also a ratio.

Run without asv: ``cd asv_bench && python -m benchmarks.allocator``.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import ClassVar

import numpy as np
import xxhash

from pagedkv.allocator import BlockAllocator

BLOCK_SIZE = 16
BATCH = 256
CHAIN_BLOCKS = 2048


class PyBlockPool:
    """Pure-Python baseline with the same free-list/LRU/eviction semantics (no identity
    verification, which only makes it cheaper)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_list = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.table: OrderedDict[int, int] = OrderedDict()   # hash -> block, LRU order
        self.block_hash: dict[int, int] = {}

    def allocate(self) -> int | None:
        if self.free_list:
            b = self.free_list.popleft()
        else:
            for h, b in self.table.items():
                if self.refcount[b] == 1:
                    break
            else:
                return None
            del self.table[h]
            del self.block_hash[b]
            self.refcount[b] = 0
        self.refcount[b] = 1
        return b

    def allocate_many(self, n: int) -> list[int]:
        return [self.allocate() for _ in range(n)]

    def free(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.free_list.append(b)

    def free_many(self, ids) -> None:
        for b in ids:
            self.free(b)

    def chain_hashes(self, tokens: np.ndarray) -> list[int]:
        bs = self.block_size
        out, parent = [], 0
        for i in range(len(tokens) // bs):
            buf = parent.to_bytes(8, "little") + tokens[i * bs:(i + 1) * bs].tobytes() \
                + b"\0" * 8
            parent = xxhash.xxh3_64_intdigest(buf) or 1
            out.append(parent)
        return out

    def cache_full_blocks(self, tokens: np.ndarray, ids) -> None:
        for b, h in zip(ids, self.chain_hashes(tokens)):
            if h not in self.table:
                self.table[h] = b
                self.block_hash[b] = h
                self.refcount[b] += 1

    def find_longest_cache_hit(self, tokens: np.ndarray) -> list[int]:
        hits = []
        for h in self.chain_hashes(tokens):
            b = self.table.get(h)
            if b is None:
                break
            hits.append(b)
        for b in hits:
            self.refcount[b] += 1
        for b in reversed(hits):
            self.table.move_to_end(self.block_hash[b])
        return hits


def _cached_chain(pool, blocks: int):
    tokens = np.arange(blocks * BLOCK_SIZE, dtype=np.uint32)
    ids = pool.allocate_many(blocks)
    pool.cache_full_blocks(tokens, ids)
    pool.free_many(ids)
    return tokens


class AllocateFree:
    """allocate+free; targets ≤ 40 ns/block at n=256, ≤ 300 ns per single-block call."""

    per_unit: ClassVar[dict[str, tuple[int, str]]] = {"time_batch_256": (BATCH, "ns/block"),
                "time_batch_256_baseline": (BATCH, "ns/block"),
                "time_single": (2, "ns/call"), "time_single_baseline": (2, "ns/call")}

    def setup(self):
        self.alloc = BlockAllocator(4096, block_size=BLOCK_SIZE, hash_seed=0)
        self.base = PyBlockPool(4096, BLOCK_SIZE)

    def time_batch_256(self):
        self.alloc.free_many(self.alloc.allocate_many(BATCH))

    def time_batch_256_baseline(self):
        self.base.free_many(self.base.allocate_many(BATCH))

    def time_single(self):
        self.alloc.free(self.alloc.allocate())

    def time_single_baseline(self):
        self.base.free(self.base.allocate())


class LongestHit:
    """Longest verified hit over a cached 2048-block chain; target ≤ 40 ns/block. The
    returned references are kept (refcounts only grow), so only the lookup is timed."""

    per_unit: ClassVar[dict[str, tuple[int, str]]] = {"time_longest_hit_2048": (CHAIN_BLOCKS, "ns/block"),
                "time_longest_hit_2048_baseline": (CHAIN_BLOCKS, "ns/block")}

    def setup(self):
        self.alloc = BlockAllocator(CHAIN_BLOCKS, block_size=BLOCK_SIZE, hash_seed=0)
        self.tokens = _cached_chain(self.alloc, CHAIN_BLOCKS)
        self.base = PyBlockPool(CHAIN_BLOCKS, BLOCK_SIZE)
        _cached_chain(self.base, CHAIN_BLOCKS)

    def time_longest_hit_2048(self):
        self.alloc.find_longest_cache_hit(self.tokens)

    def time_longest_hit_2048_baseline(self):
        self.base.find_longest_cache_hit(self.tokens)


class EvictingAllocate:
    """Allocation when the free list is empty and every block handed out must be taken
    from a cache-only entry (pressure eviction); target ≤ 60 ns/block. Each call consumes
    256 cache-only blocks, so setup rebuilds the state for every sample."""

    number = 8
    repeat = 10
    warmup_time = 0
    per_unit: ClassVar[dict[str, tuple[int, str]]] = {"time_allocate_evicting_256": (BATCH, "ns/block"),
                "time_allocate_evicting_256_baseline": (BATCH, "ns/block")}

    def setup(self):
        blocks = BATCH * self.number
        self.alloc = BlockAllocator(blocks, block_size=BLOCK_SIZE, hash_seed=0)
        _cached_chain(self.alloc, blocks)
        self.base = PyBlockPool(blocks, BLOCK_SIZE)
        _cached_chain(self.base, blocks)

    def time_allocate_evicting_256(self):
        self.alloc.allocate_many(BATCH)

    def time_allocate_evicting_256_baseline(self):
        self.base.allocate_many(BATCH)


if __name__ == "__main__":
    from benchmarks._runner import run
    run(AllocateFree, LongestHit, EvictingAllocate)

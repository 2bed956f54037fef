"""One process of the cold-tier crash and concurrency harness (tests/test_cold_crash_harness.py).

    python cold_crash_worker.py writer  ROOT SEED QUOTA ROUNDS [KILL_STEP KILL_AT]
    python cold_crash_worker.py evictor ROOT SEED SECONDS
    python cold_crash_worker.py reader  ROOT SEED SECONDS
    python cold_crash_worker.py verify  ROOT

Every block's content is a pure function of its token prefix (as real KV is), so any
process can recompute what a restored block must hold. Writers capture prompts through the
real capture walk and writer pipeline into a shared root with a small quota (eviction runs
all the time); ``KILL_STEP KILL_AT`` SIGKILLs the writer before the ``KILL_AT``-th time it
reaches that step of the atomic write (``open``, ``write``, ``sync``, ``rename``,
``dirsync``). Readers and the final verifier restore through the real restore walk and
compare every restored block byte for byte; a mismatch exits 3. The verifier prints one
JSON line of counts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import signal
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cold_support import SPEC_GEOMETRY, FakeAllocator, FakePool, open_tier

BS = SPEC_GEOMETRY.block_size
N_PROMPTS = 24
WRONG_KV = 3

logging.getLogger("pagedkv.cold").setLevel(logging.ERROR)


def prompt(i: int) -> np.ndarray:
    """Prompt ``i``: 3-8 full blocks; the first block is shared by every third prompt and
    the second by every sixth, so chains share prefixes as a serving load does."""
    rng = np.random.default_rng(1000 + i)
    shared = [np.full(BS, 7 + i % 3, np.uint32), np.full(BS, 11 + i % 6, np.uint32)]
    n = 3 + i % 6
    rest = rng.integers(0, 50_000, (n - 2) * BS, dtype=np.uint32)
    return np.concatenate(shared + [rest])


def block_content(prefix: np.ndarray, pool: FakePool) -> np.ndarray:
    """What block ``len(prefix) // BS - 1`` of any prompt starting with ``prefix`` holds."""
    seed = int.from_bytes(hashlib.sha256(prefix.astype("<u4").tobytes()).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, pool.data.shape[1:], dtype=np.uint8)


def _persist(tier, i: int) -> None:
    tokens = prompt(i)
    pool = FakePool()
    alloc = FakeAllocator(block_size=BS)
    ids = np.array([alloc.allocate() for _ in range(len(tokens) // BS)], np.int32)
    for j, b in enumerate(ids):
        pool.data[b] = block_content(tokens[:(j + 1) * BS], pool)
    tier.capture(tokens=tokens, block_ids=ids, pool=pool, allocator=alloc)
    tier.drain(10.0)


def _restore_and_check(tier, i: int) -> int:
    """Restore prompt ``i`` into a fresh pool; every restored block must hold exactly its
    content (else exit 3). Returns the blocks restored."""
    tokens = prompt(i)
    pool = FakePool()
    alloc = FakeAllocator(block_size=BS)
    ids = tier.restore(tokens=tokens, hot_blocks=0, pool=pool, allocator=alloc)
    for j, b in enumerate(ids):
        if not np.array_equal(pool.data[b], block_content(tokens[:(j + 1) * BS], pool)):
            print(f"WRONG KV: prompt {i} block {j} restored other bytes", flush=True)
            sys.exit(WRONG_KV)
    return len(ids)


def writer(root: str, seed: int, quota: int, rounds: int, kill_step: str | None,
           kill_at: int) -> None:
    tier = open_tier(root, quota_bytes=quota, queue_depth=2)
    if kill_step is not None:
        seen = [0]

        def hook(step: str) -> None:
            if step == kill_step:
                seen[0] += 1
                if seen[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
        tier.store.step_hook = hook
    rng = random.Random(seed)
    for _ in range(rounds):
        _persist(tier, rng.randrange(N_PROMPTS))
    tier.close()


def evictor(root: str, seed: int, seconds: float) -> None:
    """``pagedkv cold evict`` in a loop next to the writers."""
    from pagedkv.cold.offline import open_offline_store
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        store = open_offline_store(root, quarantine_unowned=True)
        try:
            store.remove_quarantine()
            store.evict_to(rng.randrange(0, 1 + store.index.total_bytes))
        finally:
            store.close()
        time.sleep(rng.uniform(0.01, 0.1))


def reader(root: str, seed: int, seconds: float) -> None:
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    restored = 0
    corruptions = 0
    while time.monotonic() < deadline:
        with open_tier(root) as tier:  # a fresh index: other processes' writes since
            for _ in range(4):
                restored += _restore_and_check(tier, rng.randrange(N_PROMPTS))
            corruptions += tier.stats().corruptions
    print(json.dumps({"restored_blocks": restored, "corruptions": corruptions}), flush=True)


def verify(root: str) -> None:
    with open_tier(root) as tier:
        temps = [n for n in os.listdir(root) if n.endswith(".tmp")]
        restored = sum(_restore_and_check(tier, i) for i in range(N_PROMPTS))
        s = tier.stats()
    print(json.dumps({"restored_blocks": restored, "hits": s.hits, "misses": s.misses,
                      "corruptions": s.corruptions, "temps_left": len(temps)}), flush=True)


if __name__ == "__main__":
    role, root = sys.argv[1], sys.argv[2]
    if role == "writer":
        step = sys.argv[6] if len(sys.argv) > 6 else None
        writer(root, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), step,
               int(sys.argv[7]) if step else 0)
    elif role == "evictor":
        evictor(root, int(sys.argv[3]), float(sys.argv[4]))
    elif role == "reader":
        reader(root, int(sys.argv[3]), float(sys.argv[4]))
    elif role == "verify":
        verify(root)
    else:
        sys.exit(f"unknown role {role!r}")

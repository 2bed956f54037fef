"""Hot hash chain benchmark (issue 2 target: 32,768 tokens at block_size 16 ≤ 150 µs).

Baselines in the same run: a pure-Python loop over the ``xxhash`` wheel building the
same buffer (the usual way), and pagedkv's own chain routed through the wheel
(``XXH3_SOURCE`` fallback), so the libxxhash gain is visible.

Run without asv: ``cd asv_bench && python -m benchmarks.hashing``.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import xxhash

from pagedkv import hashing

TOKENS = 32_768
BLOCK_SIZE = 16


def python_chain_hashes(tokens: np.ndarray, block_size: int) -> list[int]:
    """The docs/contracts/paged-kv.md, '2.1 Hot block hash' buffer hashed block by block from Python
    (no extra keys, no salt)."""
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        buf = parent.to_bytes(8, "little") + tokens[i * block_size:(i + 1) * block_size] \
            .tobytes() + b"\0" * 8
        parent = xxhash.xxh3_64_intdigest(buf) or 1
        out.append(parent)
    return out


class ChainHashes:
    per_unit: ClassVar[dict[str, tuple[int, str]]] = {"time_chain_hashes_32k": (1, "us/call"),
                "time_chain_hashes_32k_wheel": (1, "us/call"),
                "time_chain_hashes_32k_baseline": (1, "us/call")}

    def setup(self):
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(0, 2**32, TOKENS, dtype=np.uint32)

    def time_chain_hashes_32k(self):
        hashing.chain_hashes(self.tokens, BLOCK_SIZE)

    def time_chain_hashes_32k_wheel(self):
        previous = hashing._set_xxh3_source("xxhash-wheel")
        try:
            hashing.chain_hashes(self.tokens, BLOCK_SIZE)
        finally:
            hashing._set_xxh3_source(previous)

    def time_chain_hashes_32k_baseline(self):
        python_chain_hashes(self.tokens, BLOCK_SIZE)


if __name__ == "__main__":
    from benchmarks._runner import run
    run(ChainHashes)

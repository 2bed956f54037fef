"""Grouped coordinator speed (issue 11), each against a baseline measured in the same run:

* all-groups bookkeeping per decode step, 64 live rows, on a 3-group model (full + sliding
  128 + sliding 512, block size 16): ``record_decode_tokens`` + ``prepare_decode`` +
  ``prune_sliding``, target <= 2x the single-group adapter's ``record_decode_tokens`` +
  ``prepare_decode`` on the same rows (rows start at staggered lengths, so about one in 16
  crosses a block boundary each step, as in steady serving);
* the sliding prune of one decode step at 8k, 32k and 128k-token contexts: it must cost
  O(blocks freed), so the three figures are flat, against a NumPy scan of the row's expired
  prefix (what an O(table width) prune costs), which grows with the context.

Run with asv, or directly (min over repeats):

    cd asv_bench && python -m benchmarks.coordinator
"""

from __future__ import annotations

import numpy as np

BLOCK_SIZE = 16
LIVE_ROWS = 64
PROMPT_TOKENS = 100
POOL_BLOCKS = 16384


def _layout():
    from pagedkv.coordinator import KVCachePhysicalLayout
    return KVCachePhysicalLayout(BLOCK_SIZE, 1, 2, "float32")


def _three_group_coordinator(rows: int, blocks: int, max_model_len: int):
    from pagedkv.coordinator import AttentionKind, GroupedKVCoordinator, LayerKVCacheSpec
    layout = _layout()
    specs = [LayerKVCacheSpec(0, AttentionKind.FULL, layout),
             LayerKVCacheSpec(1, AttentionKind.sliding(128), layout),
             LayerKVCacheSpec(2, AttentionKind.sliding(512), layout)]
    return GroupedKVCoordinator.from_specs(
        specs, max_model_len=max_model_len, max_chunk=256, max_num_seqs=rows,
        blocks_per_group=(blocks, blocks, blocks), hash_seed=0)


def _fill(cache, seqs, prompt_len):
    """Every row: reset, lookup, allocate, record a distinct prompt (lengths staggered)."""
    for i, s in enumerate(seqs):
        n = prompt_len(i)
        prompt = np.arange(n, dtype=np.uint32) + 1000 * i
        cache.reset_for_new_request(s)
        cache.find_cached_prefix(s, prompt, max_tokens=n - 1)
        cache.allocate_suffix_blocks(s, n)
        cache.record_tokens(s, prompt)


class DecodeStepAllGroups:
    """One decode step's cache bookkeeping for 64 rows: 3 groups vs 1."""

    timeout = 120

    def setup(self):
        from pagedkv.adapter import PagedKVCacheAdapter
        from pagedkv.allocator import BlockAllocator
        from pagedkv.pool import LayerKVPool, PoolGeometry

        self.seqs = [f"seq-{i}" for i in range(LIVE_ROWS)]
        self.tokens = np.arange(LIVE_ROWS, dtype=np.uint32)
        self.single = PagedKVCacheAdapter(
            BlockAllocator(POOL_BLOCKS, None, BLOCK_SIZE, hash_seed=0),
            LayerKVPool(PoolGeometry(1, 1, 2, BLOCK_SIZE, "float32"), POOL_BLOCKS),
            initial_rows=LIVE_ROWS)
        self.grouped = _three_group_coordinator(LIVE_ROWS, POOL_BLOCKS, 1 << 16)
        for cache in (self.single, self.grouped):
            _fill(cache, self.seqs, lambda i: PROMPT_TOKENS + i % BLOCK_SIZE)

    def time_single_group_step(self):
        self.single.record_decode_tokens(self.seqs, self.tokens)
        self.single.prepare_decode(self.seqs)

    def time_three_group_step(self):
        g = self.grouped
        g.record_decode_tokens(self.seqs, self.tokens)
        g.prepare_decode(self.seqs)
        g.prune_sliding(self.seqs)


class SlidingPruneAtLongContext:
    """The prune of one decode step for 16 rows at a long context (window 4,096; every row
    drops one block at the step), O(blocks freed) whatever the table width, against a NumPy
    scan of the expired prefix of the same rows (an O(width) prune)."""

    params = [8192, 32768, 131072]  # noqa: RUF012 - asv's class-attribute API
    param_names = ["context_tokens"]  # noqa: RUF012
    timeout = 300
    number = 1
    repeat = 30
    ROWS = 16
    WINDOW = 4096

    def setup(self, context_tokens):
        from pagedkv.coordinator import AttentionKind, GroupedKVCoordinator, LayerKVCacheSpec
        layout = _layout()
        specs = [LayerKVCacheSpec(0, AttentionKind.sliding(self.WINDOW), layout)]
        blocks = self.ROWS * (2 * self.WINDOW // BLOCK_SIZE + 4) + 1
        self.cache = GroupedKVCoordinator.from_specs(
            specs, max_model_len=context_tokens + 128 * BLOCK_SIZE, max_chunk=BLOCK_SIZE,
            max_num_seqs=self.ROWS, blocks_per_group=(blocks,), hash_seed=0)
        self.seqs = [f"seq-{i}" for i in range(self.ROWS)]
        cache = self.cache
        for i, s in enumerate(self.seqs):
            cache.reset_for_new_request(s)
            cache.find_cached_prefix(s, np.arange(1, dtype=np.uint32) + i, max_tokens=0)
            # Prefill in window-sized chunks, pruning between them, to just below the
            # context, where the next token expires exactly one more block.
            done = 0
            while done < self._prefill(context_tokens):
                n = min(self.WINDOW, self._prefill(context_tokens) - done)
                cache.record_tokens(s, np.full(n, i, np.uint32))
                done += n
                cache.prune_sliding_all(s, done)
        # The next token makes every row drop exactly one block.
        cache.record_decode_tokens(self.seqs, np.zeros(self.ROWS, np.uint32))
        group = cache.groups[0]
        rows = cache._rows.rows(self.seqs)
        self.rows_table = group.table[rows].copy()
        self.null = group.null_block_id
        self.cut = cache.expired_blocks(self._prefill(context_tokens) + 1, 0)

    def _prefill(self, context_tokens: int) -> int:
        # p + 1 committed tokens expire one block more than p: (p + 2 - window) % bs == 0.
        p = context_tokens - 1
        return p - (p + 2 - self.WINDOW) % BLOCK_SIZE

    def time_prune_step(self, context_tokens):
        self.cache.prune_sliding(self.seqs)

    def time_numpy_scan_of_expired_prefix(self, context_tokens):
        table = self.rows_table
        for row in table:
            np.flatnonzero(row[:self.cut] != self.null)


def main() -> None:
    """Both suites with their baselines, timed alternately so they see the same load."""
    import platform
    import time

    decode = DecodeStepAllGroups()
    single = grouped = float("inf")
    for _ in range(5):
        decode.setup()
        for _ in range(40):             # 20-step slices, alternating: both see the same load
            t0 = time.perf_counter()
            for _ in range(20):
                decode.time_single_group_step()
            t1 = time.perf_counter()
            for _ in range(20):
                decode.time_three_group_step()
            t2 = time.perf_counter()
            single, grouped = min(single, (t1 - t0) / 20), min(grouped, (t2 - t1) / 20)
    print(f"machine: {platform.machine()} {platform.processor() or ''}".rstrip())
    print(f"decode step, {LIVE_ROWS} rows: single group {single * 1e6:7.1f} us | 3 groups "
          f"(record + prepare + prune) {grouped * 1e6:7.1f} us | ratio {grouped / single:4.2f}x")
    prune = SlidingPruneAtLongContext()
    zeros = np.zeros(prune.ROWS, np.uint32)
    for context in SlidingPruneAtLongContext.params:
        best = scan = per_block = float("inf")
        for _ in range(5):
            prune.setup(context)
            t0 = time.perf_counter()
            prune.time_numpy_scan_of_expired_prefix(context)
            t1 = time.perf_counter()
            prune.time_prune_step(context)
            t2 = time.perf_counter()
            scan, best = min(scan, t1 - t0), min(best, t2 - t1)
            # 64 more decode steps, pruned after each: seconds per block freed.
            spent = freed = 0.0
            for _ in range(64):
                prune.cache.record_decode_tokens(prune.seqs, zeros)
                t0 = time.perf_counter()
                freed += prune.cache.prune_sliding(prune.seqs)
                spent += time.perf_counter() - t0
            per_block = min(per_block, spent / freed)
        print(f"sliding prune, {prune.ROWS} rows at {context:>7,} tokens: one step (16 blocks "
              f"freed) {best * 1e6:6.1f} us, {per_block * 1e6:5.2f} us per block freed over 64 "
              f"steps | NumPy scan of the expired prefix {scan * 1e6:6.1f} us")


if __name__ == "__main__":
    main()

"""Adapter speed (issue 4), each against a baseline measured in the same run:

* bookkeeping per decode step (docs/contracts/paged-kv.md, '7.3 Lifecycle'):
``record_decode_tokens`` +
  ``prepare_decode`` for 64 live sequences, target <= 20 us, against a per-sequence dict/list
  implementation of the same bookkeeping;
* ``write_kv_layers`` / ``gather_kv_layers`` and the per-layer forms (32 ``write_kv`` /
  ``gather_kv`` calls) of one block (16 tokens) across 32 layers (NumPy pool, float16, 8 KV
  heads x 128), target >= 50% of this machine's copy bandwidth: ``np.copyto`` of the same
  bytes;
* the single-token decode write (``write_kv`` of 1 token, 8 KV heads x 128, f16) per call,
  against the bare NumPy assignment of the same K and V into their slot.

Run with asv, or directly for a quick figure (min over repeats, microseconds):

    python asv_bench/benchmarks/adapter.py
"""

from __future__ import annotations

import numpy as np

BLOCK_SIZE = 16
LIVE_SEQUENCES = 64
PROMPT_TOKENS = 100
POOL_BLOCKS = 16384  # room for ~3,000 steps of 64 sequences without a release


def _adapter():
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool, PoolGeometry

    allocator = BlockAllocator(POOL_BLOCKS, None, BLOCK_SIZE, hash_seed=0)
    pool = LayerKVPool(PoolGeometry(1, 1, 2, BLOCK_SIZE, "float32"), POOL_BLOCKS)
    adapter = PagedKVCacheAdapter(allocator, pool, initial_rows=LIVE_SEQUENCES)
    seqs = [f"seq-{i}" for i in range(LIVE_SEQUENCES)]
    for i, s in enumerate(seqs):
        prompt = np.arange(PROMPT_TOKENS, dtype=np.uint32) + 1000 * i
        adapter.reset_for_new_request(s)
        adapter.find_cached_prefix(s, prompt, max_tokens=PROMPT_TOKENS - 1)
        adapter.allocate_suffix_blocks(s, PROMPT_TOKENS)
        adapter.record_tokens(s, prompt)
    return adapter, seqs


class NaiveBookkeeping:
    """The baseline: per-sequence Python lists and dicts, the table built row by row."""

    def __init__(self, seqs, block_size: int, num_blocks: int) -> None:
        self.bs = block_size
        self.free = list(range(num_blocks - 1, -1, -1))
        self.tables = {s: [] for s in seqs}
        self.tokens = {s: [] for s in seqs}
        for s in seqs:
            for t in range(PROMPT_TOKENS):
                self.record(s, t)

    def record(self, s, token: int) -> None:
        toks = self.tokens[s]
        if len(toks) == len(self.tables[s]) * self.bs:
            self.tables[s].append(self.free.pop())
        toks.append(token)

    def step(self, seqs, tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        for s, t in zip(seqs, tokens):
            self.record(s, int(t))
        width = max(len(self.tables[s]) for s in seqs)
        tables = np.full((len(seqs), width), -1, np.int32)
        lens = np.empty(len(seqs), np.int32)
        slots = np.empty(len(seqs), np.int64)
        for i, s in enumerate(seqs):
            row = self.tables[s]
            tables[i, :len(row)] = row
            n = len(self.tokens[s])
            lens[i] = n
            slots[i] = row[(n - 1) // self.bs] * self.bs + (n - 1) % self.bs
        return tables, lens, slots


class DecodeStepBookkeeping:
    """One decode step's adapter work for 64 live sequences (a block crossing every 16th)."""

    timeout = 120

    def setup(self):
        self.adapter, self.seqs = _adapter()
        self.tokens = np.arange(LIVE_SEQUENCES, dtype=np.uint32)
        self.naive = NaiveBookkeeping(self.seqs, BLOCK_SIZE, POOL_BLOCKS)

    def time_adapter_decode_step(self):
        self.adapter.record_decode_tokens(self.seqs, self.tokens)
        self.adapter.prepare_decode(self.seqs)

    def time_naive_dict_list_decode_step(self):
        self.naive.step(self.seqs, self.tokens)


def _llama_shaped_adapter(tokens: int):
    """An adapter over a 32-layer, 8 KV heads x 128, f16, 16-token-block NumPy pool holding
    one sequence "s" of ``tokens`` recorded tokens."""
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool, PoolGeometry

    g = PoolGeometry(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16,
                     dtype="float16")
    adapter = PagedKVCacheAdapter(BlockAllocator(16, None, 16, hash_seed=0), LayerKVPool(g, 16))
    adapter.reset_for_new_request("s")
    adapter.find_cached_prefix("s", np.arange(tokens), skip_lookup=True)
    adapter.allocate_suffix_blocks("s", tokens)
    adapter.record_tokens("s", np.arange(tokens))
    return adapter


class BlockAcross32Layers:
    """One sequence's K/V for one full block in all 32 layers of a Llama-3-8B-shaped pool."""

    timeout = 120

    def setup(self):
        self.adapter = _llama_shaped_adapter(16)
        rng = np.random.default_rng(0)
        shape = (32, 16, 8, 128)
        self.k = rng.standard_normal(shape).astype(np.float16)
        self.v = rng.standard_normal(shape).astype(np.float16)
        self.src = np.concatenate([self.k.reshape(-1), self.v.reshape(-1)])
        self.dst = np.empty_like(self.src)
        self.nbytes = self.src.nbytes

    def time_copyto_baseline(self):
        np.copyto(self.dst, self.src)

    def time_write_kv_layers(self):
        self.adapter.write_kv_layers("s", self.k, self.v)

    def time_gather_kv_layers(self):
        self.adapter.gather_kv_layers("s")

    def time_write_kv_per_layer(self):
        adapter, k, v = self.adapter, self.k, self.v
        for layer in range(32):
            adapter.write_kv("s", layer, k[layer], v[layer])

    def time_gather_kv_per_layer(self):
        adapter = self.adapter
        for layer in range(32):
            adapter.gather_kv("s", layer)


class DecodeTokenWrite:
    """``write_kv`` of one decode token (1 x 8 KV heads x 128, f16) into one layer, against
    the bare NumPy assignment of the same K and V into that slot of a same-shaped layer."""

    timeout = 120

    def setup(self):
        self.adapter = _llama_shaped_adapter(20)
        rng = np.random.default_rng(0)
        self.k = rng.standard_normal((1, 8, 128)).astype(np.float16)
        self.v = rng.standard_normal((1, 8, 128)).astype(np.float16)
        self.k_dst = np.zeros((16 * 16, 8, 128), np.float16)
        self.v_dst = np.zeros_like(self.k_dst)
        self.slot = np.array([19], np.intp)

    def time_write_kv_one_token(self):
        self.adapter.write_kv("s", 7, self.k, self.v)

    def time_numpy_assign_baseline(self):
        self.k_dst[self.slot] = self.k
        self.v_dst[self.slot] = self.v


def _min_us(fn, number: int = 64, repeat: int = 25) -> float:
    import timeit
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


if __name__ == "__main__":
    bench = DecodeStepBookkeeping()
    bench.setup()
    adapter_us = _min_us(bench.time_adapter_decode_step)
    naive_us = _min_us(bench.time_naive_dict_list_decode_step)
    print(f"decode-step bookkeeping, {LIVE_SEQUENCES} live sequences, block size {BLOCK_SIZE}")
    print(f"  adapter (record_decode_tokens + prepare_decode): {adapter_us:.1f} us  (target <= 20)")
    print(f"  naive dict/list baseline:                        {naive_us:.1f} us")
    print(f"  speedup vs baseline: {naive_us / adapter_us:.1f}x")
    io = BlockAcross32Layers()
    io.setup()
    copy_us = _min_us(io.time_copyto_baseline, 50, 15)
    print(f"one block x 32 layers, f16 8x128, {io.nbytes / 2**20:.0f} MiB K+V "
          f"(np.copyto {copy_us:.1f} us, {io.nbytes / copy_us / 1e3:.1f} GB/s)")
    for name, fn in (("write_kv_layers", io.time_write_kv_layers),
                     ("gather_kv_layers", io.time_gather_kv_layers),
                     ("write_kv x 32 layers", io.time_write_kv_per_layer),
                     ("gather_kv x 32 layers", io.time_gather_kv_per_layer)):
        us = _min_us(fn, 50, 15)
        copy_us = min(copy_us, _min_us(io.time_copyto_baseline, 50, 5))  # same load as fn
        print(f"  {name}: {us:.1f} us, {io.nbytes / us / 1e3:.1f} GB/s = "
              f"{copy_us / us:.1%} of copy (target >= 50%)")
    dec = DecodeTokenWrite()
    dec.setup()
    write_us = _min_us(dec.time_write_kv_one_token, 1000, 15)
    assign_us = _min_us(dec.time_numpy_assign_baseline, 1000, 15)
    print(f"decode write_kv, 1 token x 8 x 128 f16 into one layer: {write_us:.2f} us per call "
          f"(bare NumPy k[slot] = k; v[slot] = v: {assign_us:.2f} us)")

"""Random request lifecycles over one adapter (hypothesis): after every step the allocator's
invariants hold, refcounts equal table references plus cache references, and every live
sequence gathers exactly the K/V written for its tokens (so no block is ever shared or reused
wrongly). A step that raises leaves the adapter, the allocator and the pool unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allocator_implementations import ALLOCATORS, observables
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.errors import ContextLengthExceeded, PagedKVError
from pagedkv.pool import LayerKVPool, PoolGeometry

BS = 4
SEQS = ("s0", "s1", "s2", "s3")
OPS = ("start", "decode", "decode_batch", "register", "finalize", "continue", "release",
       "rollback")


def kv_of(positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The K written at ``positions`` for ``tokens``: a function of (position, token) only, so
    a block reached through a verified prefix hit holds exactly these values too."""
    x = (positions.astype(np.float32) * 16 + tokens.astype(np.float32))
    return np.stack([x, -x], axis=-1)[:, None, :]


def write(a: PagedKVCacheAdapter, s, n: int) -> None:
    total = a.num_tokens(s)
    toks = a.request_tokens(s)[total - n:]
    k = kv_of(np.arange(total - n, total), toks)
    a.write_kv(s, 0, k, -k)


def snapshot(a: PagedKVCacheAdapter) -> tuple:
    k, v = a.pool.layer(0)
    seqs = {s: (a.block_table(s).tolist(), a.request_tokens(s).tolist(),
                a.is_live_for_continue(s)) for s in a.live_seq_ids()}
    return (observables(a.allocator), seqs, np.array(k).tobytes(), np.array(v).tobytes(),
            a.pool.generation, a.stats())


def check(a: PagedKVCacheAdapter, floor: dict) -> None:
    alloc = a.allocator
    alloc.check_invariants()
    refs = sum(alloc.ref_count(b) for b in range(alloc.num_blocks))
    held = sum(a.num_table_blocks(s) for s in a.live_seq_ids())
    assert refs == held + alloc.prefix_cache_len
    for s in a.live_seq_ids():
        n = a.num_tokens(s)
        table = a.block_table(s)
        assert len(table) * BS >= n and all(alloc.ref_count(b) >= 1 for b in table)
        toks = a.request_tokens(s)
        assert len(toks) == n
        if s in floor and n:
            k, v = a.gather_kv(s, 0)
            expected = kv_of(np.arange(n), toks)
            assert k.tobytes() == expected.tobytes() and v.tobytes() == (-expected).tobytes()


steps = st.lists(st.tuples(st.sampled_from(OPS), st.sampled_from(SEQS), st.integers(1, 14),
                           st.integers(0, 3)), max_size=30)


@pytest.mark.parametrize("cls", ALLOCATORS)
@given(steps=steps)
def test_random_lifecycles_stay_consistent(cls, steps):
    alloc = cls(6, 24, BS, hash_seed=0)
    pool = LayerKVPool(PoolGeometry(1, 1, 2, BS, "float32"), 6, 24)
    a = PagedKVCacheAdapter(alloc, pool, initial_rows=2)
    floor: dict = {}  # seq -> tokens that must never be rolled back (shared or registered)
    finalized: set = set()  # ended turns: recording refused until continue_turn
    for op, s, n, salt in steps:
        before = snapshot(a)
        live = s in floor
        toks = (np.arange(n) * 3 + salt) % 4  # a tiny vocabulary: prefixes repeat often
        try:
            if op == "start":
                a.reset_for_new_request(s)
                floor.pop(s, None)
                finalized.discard(s)
                hit = a.find_cached_prefix(s, toks, cache_salt=salt % 2, max_tokens=n - 1)
                a.allocate_suffix_blocks(s, n)
                a.record_tokens(s, toks[hit.cached_tokens:])
                write(a, s, n - hit.cached_tokens)
                floor[s] = hit.cached_tokens
            elif op == "decode" and live:
                if s in finalized:
                    with pytest.raises(PagedKVError, match="continue_turn"):
                        a.record_tokens(s, toks[:1])
                    assert snapshot(a) == before
                    continue
                a.record_tokens(s, toks[:1])
                write(a, s, 1)
            elif op == "decode_batch" and floor:
                seqs = sorted(floor)
                if finalized:
                    with pytest.raises(PagedKVError, match="continue_turn"):
                        a.record_decode_tokens(seqs, np.full(len(seqs), salt))
                    assert snapshot(a) == before
                    seqs = sorted(set(floor) - finalized)
                a.record_decode_tokens(seqs, np.full(len(seqs), salt))
                for q in seqs:
                    write(a, q, 1)
            elif op in ("register", "finalize") and live:
                if op == "register":
                    a.register_full_blocks_for_reuse(s, cache_salt=salt % 2)
                else:
                    a.finalize_turn_keep_live(s, cache_salt=salt % 2)
                    finalized.add(s)
                floor[s] = a.num_tokens(s)
            elif op == "continue" and live and a.is_live_for_continue(s):
                prior = a.num_tokens(s)
                prompt = np.concatenate([a.request_tokens(s), toks])
                assert a.continue_turn(s, prompt, len(prompt))[0] == prior
                finalized.discard(s)
                a.record_tokens(s, toks)
                write(a, s, len(toks))
            elif op == "release":
                a.release_request(s)
                floor.pop(s, None)
                finalized.discard(s)
            elif op == "rollback" and live:
                back = min(n, a.num_tokens(s) - floor[s])
                a.rollback_last_tokens(s, back)
        except ContextLengthExceeded:
            assert snapshot(a) == before
        check(a, floor)

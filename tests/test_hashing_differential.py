"""Differential test: ``pagedkv.hashing`` against the pure-Python oracle on random input.

Random tokens (any integer dtype, sometimes out of range), block sizes, uniform or per-block
extra keys (sometimes out of range), salts and seeds: both implementations must return the
same uint64 digests or raise the same exception class. The allocators' ``chain_hashes``
must equal the module function with the allocator's seed.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import allocator_oracle
from pagedkv import allocator, hashing

U64 = (1 << 64) - 1

token_values = st.one_of(st.integers(0, 5), st.integers(0, (1 << 32) - 1),
                         st.sampled_from([-1, 1 << 32]))
keys = st.lists(st.one_of(st.integers(0, 3), st.integers(0, U64), st.just(1 << 64)),
                max_size=3).map(tuple)
u64 = st.one_of(st.integers(0, 3), st.integers(0, U64))
dtypes = st.sampled_from([None, np.uint32, np.int64, np.uint64, np.int32])


def outcome(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the class is what must agree
        return ("raised", type(exc).__name__)
    if isinstance(out, np.ndarray):
        return ("ndarray", out.dtype.str, out.tolist())
    return ("value", type(out).__name__, out)


def as_input(values, dtype):
    if dtype is None:
        return list(values)
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        return list(values)


@given(values=st.lists(token_values, max_size=14), dtype=dtypes, block_size=st.integers(0, 5),
       uniform=keys, per_block=st.none() | st.lists(keys, max_size=4), salt=u64, seed=u64)
def test_chain_hashes_agree(values, dtype, block_size, uniform, per_block, salt, seed):
    tokens = as_input(values, dtype)
    kwargs = {"extra_keys": uniform, "extra_keys_per_block": per_block, "cache_salt": salt,
              "seed": seed}
    expected = outcome(allocator_oracle.chain_hashes, tokens, block_size, **kwargs)
    assert outcome(hashing.chain_hashes, tokens, block_size, **kwargs) == expected


@given(parent=u64, values=st.lists(token_values, min_size=1, max_size=6), dtype=dtypes,
       extra=keys, salt=u64, index=st.integers(0, 3), seed=u64)
def test_hot_block_hash_agrees(parent, values, dtype, extra, salt, index, seed):
    tokens = as_input(values, dtype)
    expected = outcome(allocator_oracle.hot_block_hash, parent, tokens, extra, salt, index, seed=seed)
    assert outcome(hashing.hot_block_hash, parent, tokens, extra, salt, index,
                   seed=seed) == expected


@given(values=st.lists(st.integers(0, 5), max_size=14), block_size=st.integers(1, 4),
       per_block=st.none() | st.lists(keys.filter(lambda k: all(x <= U64 for x in k)),
                                      max_size=4),
       salt=u64)
def test_allocator_chain_is_the_module_chain_with_its_seed(values, block_size, per_block, salt):
    for cls in (allocator_oracle.BlockAllocator, allocator.BlockAllocator):
        alloc = cls(2, block_size=block_size)  # a random seed
        got = alloc.chain_hashes(values, extra_keys_per_block=per_block, cache_salt=salt)
        want = hashing.chain_hashes(values, block_size, extra_keys_per_block=per_block,
                                    cache_salt=salt, seed=alloc.hash_seed)
        assert got.dtype == np.uint64 and got.tolist() == want.tolist()


@given(salt=st.none() | st.text(max_size=70) | st.binary(max_size=3) | st.integers())
def test_salt_domain_id_agrees(salt):
    assert outcome(hashing.salt_domain_id, salt) == outcome(allocator_oracle.salt_domain_id, salt)

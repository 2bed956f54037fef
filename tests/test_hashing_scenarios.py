"""Acceptance scenarios H1–H6 (docs/contracts/paged-kv.md, '9.1 Hashing and salt') and the vectors
of docs/contracts/paged-kv.md, '2.4 Reference vectors (hash_seed = 0)' and '3. cache_salt domain
id'.

Every test runs on the pure-Python oracle and on the Cython core.
"""

from __future__ import annotations

import numpy as np
import pytest

from allocator_implementations import ALLOCATORS, HASHING
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.identity import BlockIdentity

# docs/contracts/paged-kv.md, '2.4 Reference vectors (hash_seed = 0)', hash_seed = 0.
H_BLOCK0 = 0x321DB453EB3BE929
H_BLOCK1 = 0xEF870606313E5CD7
H_SALT42 = 0xF56348E4A8B8E33D
H_KEYS7 = 0xC36E827828FA28B1
H_SALT7 = 0x07260616CDB89B6B
H_CHAIN10 = [0xE2B156D1A0203EBA, 0x61B62F8D280287A1]
H_SEED7 = 0x254E037155ED5FD8

TENANT_A = 16248643848220682112
X_ID = 4949498559009812781


@pytest.fixture(params=HASHING)
def hashing(request):
    return request.param


@pytest.fixture(params=ALLOCATORS)
def allocator_cls(request):
    return request.param


# --- H1 reference vectors -------------------------------------------------------------------


def test_h1_hot_block_hash_vectors(hashing):
    assert hashing.hot_block_hash(0, [1, 2, 3, 4]) == H_BLOCK0
    assert hashing.hot_block_hash(H_BLOCK0, [5, 6, 7, 8], block_index=1) == H_BLOCK1
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], cache_salt=42) == H_SALT42
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (7,), 0) == H_KEYS7
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (), 7) == H_SALT7
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], seed=7) == H_SEED7


def test_h1_salt_enters_block_zero_only(hashing):
    # The chain carries the domain; a later block hashes the same with or without salt.
    assert hashing.hot_block_hash(H_BLOCK0, [5, 6, 7, 8], (), 42, 1) == H_BLOCK1


def test_h1_chain_vectors(hashing):
    chain = hashing.chain_hashes(range(10), 4)
    assert isinstance(chain, np.ndarray) and chain.dtype == np.uint64
    assert chain.tolist() == H_CHAIN10
    assert hashing.chain_hashes(np.arange(10, dtype=np.uint32), 4).tolist() == H_CHAIN10
    assert hashing.chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4).tolist() == [H_BLOCK0, H_BLOCK1]
    assert hashing.chain_hashes(range(3), 4).tolist() == []
    assert hashing.chain_hashes(range(3), 4).dtype == np.uint64
    assert hashing.chain_hashes(range(10), 0).tolist() == []


def test_h1_chain_matches_inline_walk(hashing):
    tokens = list(range(100, 124))
    parent, expected = 0, []
    for i in range(6):
        parent = hashing.hot_block_hash(parent, tokens[4 * i:4 * i + 4], (3,), 9, i)
        expected.append(parent)
    assert hashing.chain_hashes(tokens, 4, extra_keys=(3,), cache_salt=9).tolist() == expected


def test_h1_per_block_generalizes_uniform(hashing):
    tokens = list(range(12))
    uniform = hashing.chain_hashes(tokens, 4).tolist()
    assert len(uniform) == 3
    assert hashing.chain_hashes(tokens, 4, extra_keys_per_block=[(), (), ()]).tolist() == uniform
    assert hashing.chain_hashes(tokens, 4, extra_keys_per_block=[(), ()]).tolist() == uniform[:2]
    # The per-block chain stops at the first block without an entry, whatever follows.
    assert hashing.chain_hashes(tokens, 4, extra_keys_per_block=[]).tolist() == []
    keyed = hashing.chain_hashes(tokens, 4, extra_keys=(5,)).tolist()
    assert hashing.chain_hashes(tokens, 4, extra_keys_per_block=[(5,)] * 4).tolist() == keyed
    mixed = hashing.chain_hashes(tokens, 4, extra_keys_per_block=[(), (5,), ()]).tolist()
    assert mixed[0] == uniform[0] and mixed[1] != uniform[1] and mixed[2] != uniform[2]


def test_h1_both_key_forms_is_a_value_error(hashing):
    with pytest.raises(InvalidArgument):
        hashing.chain_hashes(range(8), 4, extra_keys=(1,), extra_keys_per_block=[(1,), (1,)])


# --- H2 extra keys --------------------------------------------------------------------------


def test_h2_extra_keys_are_order_sensitive(hashing):
    h_none = hashing.hot_block_hash(0, [1, 2, 3, 4], ())
    h_12 = hashing.hot_block_hash(0, [1, 2, 3, 4], (1, 2))
    h_21 = hashing.hot_block_hash(0, [1, 2, 3, 4], (2, 1))
    assert len({h_none, h_12, h_21}) == 3
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (1, 2)) == h_12
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (2, 1)) == h_21
    assert h_none == H_BLOCK0


def test_h2_key_count_separates_keys_from_salt(hashing):
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (7,), 0) == H_KEYS7
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], (), 7) == H_SALT7
    assert H_KEYS7 != H_SALT7


# --- H3 salt isolates domains ---------------------------------------------------------------


def test_h3_salt_isolates_domains(allocator_cls, hashing):
    alloc = allocator_cls(16, block_size=4, hash_seed=0)
    tokens = np.arange(8, dtype=np.uint32)
    ids = alloc.allocate_many(2)
    assert alloc.cache_full_blocks(tokens, ids) == 2
    blocks, n = alloc.find_longest_cache_hit(tokens, cache_salt=42)
    assert (blocks.tolist(), n) == ([], 0)

    salt_a = hashing.salt_domain_id("a")
    salt_b = hashing.salt_domain_id("b")
    ids_a = alloc.allocate_many(2)
    assert alloc.cache_full_blocks(tokens, ids_a, cache_salt=salt_a) == 2
    blocks, n = alloc.find_longest_cache_hit(tokens, cache_salt=salt_b)
    assert (blocks.tolist(), n) == ([], 0)
    blocks, n = alloc.find_longest_cache_hit(tokens, cache_salt=salt_a)
    assert (blocks.tolist(), n) == (ids_a.tolist(), 8)
    # The salted chain shares no block with the shared-domain chain.
    assert set(alloc.chain_hashes(tokens, cache_salt=salt_a).tolist()).isdisjoint(
        alloc.chain_hashes(tokens).tolist())
    alloc.check_invariants()


def test_h3_salt_must_be_a_domain_id_not_a_string(allocator_cls):
    alloc = allocator_cls(4, block_size=4, hash_seed=0)
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        alloc.find_longest_cache_hit(np.arange(8), cache_salt="tenant-a")
    assert alloc.stats()["query_tokens"] == 0


def test_h3_none_salt_is_the_shared_domain(hashing, allocator_cls):
    # salt_domain_id(None) == 0; a cache_salt of None is that domain in both implementations
    # (the oracle refused it with InvalidArgumentType while the Cython core took it as 0).
    assert hashing.hot_block_hash(0, [1, 2, 3, 4], cache_salt=None) == H_BLOCK0
    assert hashing.chain_hashes(range(8), 4, cache_salt=None).tolist() == \
        hashing.chain_hashes(range(8), 4).tolist()
    alloc = allocator_cls(4, block_size=4, hash_seed=0)
    tokens = np.arange(8)
    assert alloc.chain_hashes(tokens, cache_salt=None).tolist() == \
        alloc.chain_hashes(tokens).tolist()
    ids = alloc.allocate_many(2)
    assert alloc.cache_full_blocks(tokens, ids, cache_salt=None) == 2
    assert alloc.cached_block_ids(tokens, cache_salt=None).tolist() == ids.tolist()
    blocks, n = alloc.find_longest_cache_hit(tokens, cache_salt=None)
    assert (blocks.tolist(), n) == (ids.tolist(), 8)
    blocks, n = alloc.find_longest_cache_hit(tokens)  # published under None: domain 0
    assert (blocks.tolist(), n) == (ids.tolist(), 8)
    x = alloc.allocate()
    identity = BlockIdentity.of([1, 2, 3, 4], 0, (), 0, 0)
    assert alloc.register_prefix(x, 7, identity._replace(cache_salt=None)) is True
    assert alloc.lookup_prefix(7, identity) == x
    alloc.check_invariants()

# --- H4 a collision is a miss ---------------------------------------------------------------


def test_h4_forced_collision_is_a_miss(allocator_cls):
    alloc = allocator_cls(4, block_size=4, hash_seed=0, _hash_fn=lambda *args: 5)
    x = alloc.allocate()
    assert x == 0
    assert alloc.cache_full_blocks([1, 2, 3, 4], [x]) == 1
    assert alloc.lru_hashes() == [5]
    assert alloc.ref_count(0) == 2

    blocks, n = alloc.find_longest_cache_hit([11, 12, 13, 14])
    assert (blocks.tolist(), n) == ([], 0)
    assert alloc.ref_count(0) == 2

    y = alloc.allocate()
    assert y == 1
    assert alloc.cache_full_blocks([11, 12, 13, 14], [y]) == 0
    assert alloc.ref_count(1) == 1 and alloc.prefix_cache_len == 1

    blocks, n = alloc.find_longest_cache_hit([1, 2, 3, 4])
    assert (blocks.tolist(), n) == ([0], 4)
    assert alloc.ref_count(0) == 3
    assert alloc.stats()["collisions_rejected"] == 2
    alloc.check_invariants()


def test_h4_hash_fn_result_zero_is_remapped_to_one(allocator_cls):
    alloc = allocator_cls(4, block_size=4, hash_seed=0, _hash_fn=lambda *args: 0)
    assert alloc.chain_hashes(range(8)).tolist() == [1, 1]


def test_h4_hash_fn_receives_the_block_arguments(allocator_cls):
    calls = []

    def record(parent, tokens, extra_keys, cache_salt, block_index, seed):
        calls.append((parent, np.asarray(tokens).tolist(), tuple(extra_keys), cache_salt,
                      block_index, seed))
        return 100 + block_index

    alloc = allocator_cls(4, block_size=2, hash_seed=3, _hash_fn=record)
    assert alloc.chain_hashes([7, 8, 9, 10, 11], extra_keys_per_block=[(1,), ()],
                              cache_salt=6).tolist() == [100, 101]
    assert calls == [(0, [7, 8], (1,), 6, 0, 3), (100, [9, 10], (), 6, 1, 3)]


# --- H5 seeds -------------------------------------------------------------------------------


def test_h5_random_seeds_differ_zero_seed_matches_vectors(allocator_cls):
    tokens = list(range(10))
    chains = {tuple(allocator_cls(4, block_size=4).chain_hashes(tokens).tolist())
              for _ in range(3)}
    assert len(chains) == 3
    for _ in range(2):
        assert allocator_cls(4, block_size=4, hash_seed=0).chain_hashes(tokens).tolist() \
            == H_CHAIN10
    assert allocator_cls(4, block_size=4, hash_seed=7).chain_hashes([1, 2, 3, 4]).tolist() \
        == [H_SEED7]


# --- H6 domain ids --------------------------------------------------------------------------


def test_h6_domain_ids(hashing):
    assert hashing.salt_domain_id(None) == 0
    assert hashing.salt_domain_id("tenant-a") == TENANT_A == 0xE17EC77DAF07A780
    assert hashing.salt_domain_id("x") == X_ID
    assert 0 < hashing.salt_domain_id("é" * 128) < 2**64


@pytest.mark.parametrize("salt", ["", "é" * 128 + "a", "a" * 257, "\ud800"])
def test_h6_bad_salt_values(hashing, salt):
    with pytest.raises(InvalidArgument):
        hashing.salt_domain_id(salt)


@pytest.mark.parametrize("salt", [b"x", 7, ["x"]])
def test_h6_bad_salt_types(hashing, salt):
    with pytest.raises(InvalidArgumentType):
        hashing.salt_domain_id(salt)


# --- bad input (docs/contracts/paged-kv.md, '2.1 Hot block hash' rules) ---------------------------


@pytest.mark.parametrize("tokens", [
    np.array([1.0, 2.0, 3.0, 4.0]),
    np.array([True, False, True, False]),
    np.array([1, 2, 3, "x"], dtype=object),
])
def test_tokens_of_wrong_kind(hashing, tokens):
    with pytest.raises(InvalidArgumentType):
        hashing.chain_hashes(tokens, 2)
    with pytest.raises(InvalidArgumentType):
        hashing.hot_block_hash(0, tokens)


@pytest.mark.parametrize("tokens", [
    np.arange(8).reshape(2, 4),
    [1, 2, 3, -1],
    np.array([1, 2, 3, 2**32], dtype=np.int64),
    [1, 2, 3, 2**40],
])
def test_tokens_out_of_range_or_shape(hashing, tokens):
    with pytest.raises(InvalidArgument):
        hashing.chain_hashes(tokens, 2)
    with pytest.raises(InvalidArgument):
        hashing.hot_block_hash(0, tokens)


def test_any_integer_dtype_hashes_like_uint32(hashing):
    expected = hashing.chain_hashes(np.arange(12, dtype=np.uint32), 4).tolist()
    for dtype in (np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint64):
        assert hashing.chain_hashes(np.arange(12, dtype=dtype), 4).tolist() == expected
    strided = np.arange(24, dtype=np.uint32)[::2]
    assert hashing.chain_hashes(strided, 4).tolist() == \
        hashing.chain_hashes(np.ascontiguousarray(strided), 4).tolist()


@pytest.mark.parametrize("keys", [(2**64,), (-1,)])
def test_extra_keys_out_of_range(hashing, keys):
    with pytest.raises(InvalidArgument):
        hashing.hot_block_hash(0, [1, 2, 3, 4], keys)
    with pytest.raises(InvalidArgument):
        hashing.chain_hashes([1, 2, 3, 4], 4, extra_keys=keys)


def test_cache_salt_string_points_to_salt_domain_id(hashing):
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        hashing.chain_hashes([1, 2, 3, 4], 4, cache_salt="tenant-a")
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        hashing.hot_block_hash(0, [1, 2, 3, 4], (), "tenant-a")


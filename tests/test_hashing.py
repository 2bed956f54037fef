"""pagedkv.hashing: hot block hashes, chains, domain ids (docs/contracts/paged-kv.md, '2. Block
hashing' and '3. cache_salt domain id' and '9.1 Hashing and salt')."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import xxhash

from pagedkv import hashing
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hashing import chain_hashes, hot_block_hash, salt_domain_id

B0 = 0x321DB453EB3BE929


# --- docs/contracts/paged-kv.md, '2.4 Reference vectors (hash_seed = 0)' reference vectors
# (hash_seed = 0) ---

def test_vector_block0():
    assert hot_block_hash(0, [1, 2, 3, 4]) == B0


def test_vector_block1_chains_from_block0():
    assert hot_block_hash(B0, [5, 6, 7, 8], block_index=1) == 0xEF870606313E5CD7


def test_vector_salt_42():
    assert hot_block_hash(0, [1, 2, 3, 4], cache_salt=42) == 0xF56348E4A8B8E33D


def test_vector_extra_key_7_differs_from_salt_7():
    assert hot_block_hash(0, [1, 2, 3, 4], (7,)) == 0xC36E827828FA28B1
    assert hot_block_hash(0, [1, 2, 3, 4], cache_salt=7) == 0x07260616CDB89B6B


def test_vector_chain_of_range_10():
    out = chain_hashes(range(10), 4)
    assert out.dtype == np.uint64
    assert out.tolist() == [0xE2B156D1A0203EBA, 0x61B62F8D280287A1]


def test_vector_seed_7():
    assert hot_block_hash(0, [1, 2, 3, 4], seed=7) == 0x254E037155ED5FD8


# --- the definition, rebuilt with the xxhash wheel --------------------------------------

def _spec_hash(parent, tokens, keys=(), salt=0, index=0, seed=0):
    buf = parent.to_bytes(8, "little") + np.asarray(tokens, "<u4").tobytes()
    buf += len(keys).to_bytes(8, "little") + b"".join(k.to_bytes(8, "little") for k in keys)
    if index == 0 and salt != 0:
        buf += salt.to_bytes(8, "little")
    h = xxhash.xxh3_64_intdigest(buf, seed)
    return h or 1


@pytest.mark.parametrize("parent,tokens,keys,salt,index,seed", [
    (0, [0], (), 0, 0, 0),
    (123, list(range(16)), (), 0, 3, 0),
    (0, [2**32 - 1] * 8, (2**64 - 1, 0, 5), 2**64 - 1, 0, 2**64 - 1),
    (99, [7, 7, 7, 7], (1, 2), 42, 1, 11),   # salt ignored past block 0
])
def test_hot_hash_matches_the_buffer_definition(parent, tokens, keys, salt, index, seed):
    assert hot_block_hash(parent, tokens, keys, salt, index, seed=seed) == _spec_hash(
        parent, tokens, keys, salt, index, seed)


def test_salt_enters_block_zero_only():
    assert hot_block_hash(5, [1, 2], cache_salt=9, block_index=1) == hot_block_hash(
        5, [1, 2], block_index=1)
    assert hot_block_hash(0, [1, 2], cache_salt=9) != hot_block_hash(0, [1, 2])


def test_extra_keys_are_order_sensitive_and_stable():                  # H2
    base = hot_block_hash(0, [1, 2, 3, 4])
    k12 = hot_block_hash(0, [1, 2, 3, 4], (1, 2))
    k21 = hot_block_hash(0, [1, 2, 3, 4], (2, 1))
    assert len({base, k12, k21}) == 3
    assert hot_block_hash(0, [1, 2, 3, 4], (1, 2)) == k12


# --- chains -----------------------------------------------------------------------------

def test_chain_equals_the_inline_walk():
    toks = np.arange(50, dtype=np.uint32)
    out = chain_hashes(toks, 8, extra_keys=(3,), cache_salt=77, seed=5)
    parent = 0
    expect = []
    for i in range(6):
        parent = hot_block_hash(parent, toks[8 * i:8 * i + 8], (3,), 77, i, seed=5)
        expect.append(parent)
    assert out.tolist() == expect


def test_chain_edge_sizes():                                            # H1
    assert chain_hashes(range(3), 4).tolist() == []
    assert chain_hashes(range(10), 0).tolist() == []
    assert chain_hashes([], 4).tolist() == []
    assert len(chain_hashes(range(10), 4)) == 2


def test_per_block_keys_generalize_the_uniform_chain():                 # H1
    uniform = chain_hashes(range(12), 4)
    assert chain_hashes(range(12), 4, extra_keys_per_block=[(), (), ()]).tolist() == \
        uniform.tolist()
    assert chain_hashes(range(12), 4, extra_keys_per_block=[(), ()]).tolist() == \
        uniform[:2].tolist()
    mixed = chain_hashes(range(12), 4, extra_keys_per_block=[(555,), (), (9, 8)])
    parent = 0
    for i, keys in enumerate([(555,), (), (9, 8)]):
        parent = hot_block_hash(parent, list(range(4 * i, 4 * i + 4)), keys, 0, i)
        assert mixed[i] == parent
    assert chain_hashes(range(12), 4, extra_keys_per_block=[]).tolist() == []


def test_both_key_forms_is_invalid():
    with pytest.raises(InvalidArgument, match="not both"):
        chain_hashes(range(8), 4, extra_keys=(1,), extra_keys_per_block=[(1,), (1,)])


@pytest.mark.parametrize("keys,exc", [(5, InvalidArgumentType), (1.5, InvalidArgumentType),
                                      ((2**64,), InvalidArgument),
                                      ((k for k in [1]), InvalidArgument)])
def test_bad_extra_keys_next_to_per_block_keys(keys, exc):
    # Checked as keys, not with a bare len(): an int or a generator was a plain TypeError.
    with pytest.raises(exc):
        chain_hashes(range(8), 4, extra_keys=keys, extra_keys_per_block=[(1,), (1,)])
    assert chain_hashes(range(8), 4, extra_keys=(k for k in []),
                        extra_keys_per_block=[(), ()]).tolist() == chain_hashes(range(8), 4).tolist()


def test_wheel_and_libxxhash_give_identical_digests():
    toks = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint32)
    args = {"extra_keys_per_block": [(i,) * (i % 3) for i in range(256)], "cache_salt": 3,
                "seed": 2**63 + 1}
    first = chain_hashes(toks, 16, **args)
    prev = hashing._set_xxh3_source("xxhash-wheel")
    try:
        via_wheel = chain_hashes(toks, 16, **args)
        single = hot_block_hash(0, [1, 2, 3, 4])
    finally:
        hashing._set_xxh3_source(prev)
    assert via_wheel.tolist() == first.tolist()
    assert single == B0
    if hashing.XXH3_SOURCE == "libxxhash":
        assert hashing._set_xxh3_source("libxxhash") == "libxxhash"
    else:
        with pytest.raises(InvalidArgument):
            hashing._set_xxh3_source("libxxhash")


def test_xxh3_source_is_reported():
    import pagedkv._build_config as bc
    assert hashing.XXH3_SOURCE == ("libxxhash" if bc.SYSTEM_XXHASH else "xxhash-wheel")


def test_unknown_xxh3_source():
    with pytest.raises(InvalidArgument, match="not one of"):
        hashing._set_xxh3_source("md5")


# --- token input rules (docs/contracts/paged-kv.md, '2.1 Hot block hash') -------------------------

def test_uint32_c_contiguous_is_used_without_copy():
    toks = np.arange(8, dtype=np.uint32)
    assert hashing.as_token_array(toks) is toks


@pytest.mark.parametrize("tokens", [
    np.arange(8, dtype=np.int64), np.arange(8, dtype=np.uint8), list(range(8)), range(8),
    tuple(range(8)), np.arange(8, dtype=np.uint32).byteswap().view('>u4'),
    np.arange(16, dtype=np.uint32)[::2],
])
def test_other_integer_inputs_convert(tokens):
    out = hashing.as_token_array(tokens)
    assert out.dtype == np.uint32 and out.flags.c_contiguous
    assert out.tolist() == [int(t) for t in np.asarray(tokens)]


@pytest.mark.parametrize("tokens", [
    np.arange(4, dtype=np.float32), [1.0, 2.0], np.ones(4, dtype=bool), [True, False],
    np.array([1, 2], dtype=object), ["a", "b"],
])
def test_float_bool_object_tokens_are_a_type_error(tokens):
    with pytest.raises(InvalidArgumentType, match="tokens"):
        hot_block_hash(0, tokens)
    with pytest.raises(InvalidArgumentType):
        chain_hashes(tokens, 2)


@pytest.mark.parametrize("tokens", [np.zeros((2, 4), np.uint32), 5, np.uint32(5)])
def test_tokens_must_be_1d(tokens):
    with pytest.raises(InvalidArgument, match="1-D"):
        chain_hashes(tokens, 2)


@pytest.mark.parametrize("tokens", [[2**32], [-1], np.array([2**32], np.int64),
                                    np.array([-5], np.int8), [2**70], [-(2**70), 2**70]])
def test_tokens_out_of_range(tokens):
    with pytest.raises(InvalidArgument, match=r"\[0, 2\*\*32\)"):
        chain_hashes(tokens, 1)


def test_token_range_limits_accepted():
    assert chain_hashes([0, 2**32 - 1], 1).shape == (2,)


@pytest.mark.parametrize("keys,exc", [((2**64,), InvalidArgument), ((-1,), InvalidArgument),
                                      ((1.5,), InvalidArgumentType),
                                      ((True,), InvalidArgumentType), ("ab", InvalidArgumentType)])
def test_bad_extra_keys(keys, exc):
    with pytest.raises(exc, match="extra_keys"):
        hot_block_hash(0, [1], keys)


@pytest.mark.parametrize("kwargs,exc", [
    ({"parent": 2**64}, InvalidArgument), ({"parent": -1}, InvalidArgument),
    ({"seed": -1}, InvalidArgument), ({"cache_salt": 2**64}, InvalidArgument),
    ({"block_index": -1}, InvalidArgument), ({"block_index": 1.0}, InvalidArgumentType),
])
def test_bad_scalars(kwargs, exc):
    base = {"parent": 0, "tokens": [1, 2], "seed": 0}
    base.update(kwargs)
    with pytest.raises(exc):
        hot_block_hash(**base)


def test_str_salt_points_to_salt_domain_id():
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        hot_block_hash(0, [1, 2], cache_salt="tenant-a")
    with pytest.raises(InvalidArgumentType, match="salt_domain_id"):
        chain_hashes([1, 2], 2, cache_salt="tenant-a")


def test_bad_block_size():
    with pytest.raises(InvalidArgument, match="block_size"):
        chain_hashes([1, 2], -1)
    with pytest.raises(InvalidArgumentType, match="block_size"):
        chain_hashes([1, 2], 2.0)


# --- docs/contracts/paged-kv.md, '3. cache_salt domain id' domain ids (H6) ------------------------

def test_domain_id_vectors():
    assert salt_domain_id(None) == 0
    assert salt_domain_id("tenant-a") == 16248643848220682112
    assert salt_domain_id("tenant-a") == 0xE17EC77DAF07A780
    assert salt_domain_id("x") == 4949498559009812781


def test_domain_id_definition():
    for s in ("a", "b", "é" * 128, "租户"):
        d = hashlib.sha256(s.encode()).digest()
        assert salt_domain_id(s) == (int.from_bytes(d[:8], "little") or 1)


def test_domain_id_limits():
    assert salt_domain_id("é" * 128) > 0                      # exactly 256 bytes
    with pytest.raises(InvalidArgument, match="256"):
        salt_domain_id("é" * 128 + "a")
    with pytest.raises(InvalidArgument, match="empty"):
        salt_domain_id("")
    with pytest.raises(InvalidArgumentType):
        salt_domain_id(b"x")
    with pytest.raises(InvalidArgumentType):
        salt_domain_id(7)
    with pytest.raises(InvalidArgument, match="UTF-8"):
        salt_domain_id("\ud800")                              # lone surrogate


def test_block_identity_is_reexported():
    from pagedkv.identity import BlockIdentity
    assert hashing.BlockIdentity is BlockIdentity


def test_per_block_extra_keys_is_the_one_normalisation_of_chain_keys():
    from pagedkv.hashing import per_block_extra_keys
    assert per_block_extra_keys(3) == [(), (), ()]
    assert per_block_extra_keys(2, [np.uint64(7), 2**64 - 1]) == [(7, 2**64 - 1)] * 2
    assert all(type(k) is int for k in per_block_extra_keys(1, [np.uint64(7)])[0])
    # per-block keys: the chain stops at the first block without an entry, and at the blocks
    assert per_block_extra_keys(5, extra_keys_per_block=[(1,), [2, 3]]) == [(1,), (2, 3)]
    assert per_block_extra_keys(1, extra_keys_per_block=[(1,), (2,)]) == [(1,)]
    assert per_block_extra_keys(0, (4,)) == [] and per_block_extra_keys(-1, (4,)) == []
    with pytest.raises(InvalidArgument, match="not both"):
        per_block_extra_keys(2, (1,), [(1,)])
    with pytest.raises(InvalidArgumentType, match=r"extra_keys_per_block\[1\]\[0\]"):
        per_block_extra_keys(2, extra_keys_per_block=[(1,), (True,)])
    with pytest.raises(InvalidArgument, match=r"extra_keys\[0\] = -1 is outside"):
        per_block_extra_keys(2, (-1,))

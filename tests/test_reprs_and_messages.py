"""reprs of the finished public classes, and error messages that name the argument, the
value and the valid range or fix (added after a review pass)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hfqm_samples import write_mixed
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import InvalidArgument, TensorNotFound
from pagedkv.hfqm import HfqmFile
from pagedkv.hfqm.index import parse_index
from pagedkv.pool import LayerKVPool, PoolGeometry
from pagedkv.pool.numpy_storage import NumpyKVStorage
from pagedkv.sizing import PagedCacheConfig, ReservationGrowth

G = PoolGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def test_numpy_storage_repr():
    s = NumpyKVStorage(G, 3)
    assert repr(s) == ("NumpyKVStorage(num_blocks=3, shape=(2, 2, 3, 4, 2, 8), "
                       "dtype=float16, nbytes=1536)")  # 2*2*3*4*2*8 halves


def test_mlx_storage_repr():
    pytest.importorskip("mlx.core")
    from pagedkv.pool.mlx_storage import MlxKVStorage
    assert repr(MlxKVStorage(G, 3)) == ("MlxKVStorage(num_blocks=3, layers=2, dtype=float16, "
                                        "lazy=True)")


def test_reservation_growth_repr_tracks_its_one_grow():
    pool = LayerKVPool(G, 2, 8)
    alloc = BlockAllocator(2, 8, 4)
    growth = ReservationGrowth(pool, alloc.grow_by)
    assert repr(growth) == ("ReservationGrowth(pool_blocks=2/8, grew_before=False, "
                            "grew_for_retry=False)")
    assert growth.before_allocation(3, 2) == 3   # to max(2 * 2, 2 + 3) = 5 blocks
    assert repr(growth) == ("ReservationGrowth(pool_blocks=5/8, grew_before=True, "
                            "grew_for_retry=False)")


def test_parsed_index_repr(tmp_path):
    path = tmp_path / "m.hfq"
    write_mixed(path)
    data = np.fromfile(path, dtype=np.uint8)
    idx = parse_index(data, data.size, 0, str(path))
    assert repr(idx) == (f"ParsedIndex(version=1, arch_id=7, n_tensors=7, metadata_offset=32, "
                         f"data_offset={idx.data_offset})")
    assert idx.data_offset == 4096


@pytest.mark.parametrize("value", [-0.1, 1.0, 2.0, math.nan, math.inf])
def test_watermark_fraction_outside_0_1_is_refused(value):
    with pytest.raises(InvalidArgument,
                       match=r"watermark_fraction: .* is outside \[0, 1\); it is the share of "
                             r"the pool kept free at admission \(default 0.01\)"):
        PagedCacheConfig(watermark_fraction=value)


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 0.99])
def test_watermark_fraction_inside_0_1_is_kept(value):
    assert PagedCacheConfig(watermark_fraction=value).watermark_fraction == value


def test_tensor_not_found_mentions_the_canonical_name_only_when_it_differs(tmp_path):
    path = tmp_path / "m.hfq"
    write_mixed(path)
    with HfqmFile(path) as f:
        with pytest.raises(TensorNotFound) as exc:
            f["nope"]
        assert str(exc.value) == f"{path}: no tensor 'nope'; 7 tensors"


def test_block_identity_equality_compares_every_field():
    from pagedkv.identity import BlockIdentity, RestoredBlock
    a = BlockIdentity.of([1, 2, 3, 4], parent_hash=9, extra_keys=(7,), cache_salt=5,
                         block_index=1)
    same = BlockIdentity.of(np.array([1, 2, 3, 4], np.int64), 9, (7,), 5, 1)
    assert a == same and not (a != same)  # noqa: SIM202 (both operators are under test)
    for other in (BlockIdentity.of([1, 2, 3, 5], 9, (7,), 5, 1),
                  BlockIdentity.of([1, 2, 3, 4], 8, (7,), 5, 1),
                  BlockIdentity.of([1, 2, 3, 4], 9, (), 5, 1),
                  BlockIdentity.of([1, 2, 3, 4], 9, (7,), 6, 1),
                  BlockIdentity.of([1, 2, 3, 4], 9, (7,), 5, 2),
                  BlockIdentity.of([1, 2, 3], 9, (7,), 5, 1)):
        assert a != other and not (a == other)  # noqa: SIM201 (both operators are under test)
    assert a != tuple(a) and (1,) != a
    assert RestoredBlock(3, 11, a) == RestoredBlock(3, 11, same)
    with pytest.raises(TypeError):
        hash(a)


def test_block_identity_token_range_message_names_the_values():
    from pagedkv.identity import BlockIdentity
    with pytest.raises(InvalidArgument,
                       match=r"tokens must be in \[0, 2\*\*32\), got values in \[-1, 2\]"):
        BlockIdentity.of([-1, 2])


@pytest.mark.parametrize("module", ["pagedkv.allocator", "allocator_oracle"])
def test_cache_full_blocks_with_a_partial_block_says_how_to_fix_it(module):
    import importlib
    alloc = importlib.import_module(module).BlockAllocator(8, 8, 4)
    ids = alloc.allocate_many(3)
    before = alloc.stats(), alloc.lru_hashes(), [alloc.ref_count(b) for b in range(8)]
    with pytest.raises(InvalidArgument,
                       match=r"register only the full blocks: "
                             r"block_ids\[:len\(tokens\) // block_size\]"):
        alloc.cache_full_blocks(np.arange(10, dtype=np.uint32), ids)
    assert (alloc.stats(), alloc.lru_hashes(), [alloc.ref_count(b) for b in range(8)]) == before
    assert alloc.cache_full_blocks(np.arange(10, dtype=np.uint32), ids[:10 // 4]) == 2


@pytest.mark.parametrize("field, value, message", [
    ("seed", -1, r"ReferenceConfig.seed = -1: must be an int >= 0"),
    ("rope_theta", 0.0, r"ReferenceConfig.rope_theta = 0.0: must be a finite number > 0"),
    ("rms_norm_eps", math.nan, r"ReferenceConfig.rms_norm_eps = nan: must be a finite number"),
])
def test_reference_config_refuses_values_the_model_cannot_use(field, value, message):
    from pagedkv.tiny_model import ReferenceConfig
    with pytest.raises(InvalidArgument, match=message):
        ReferenceConfig(**{field: value})

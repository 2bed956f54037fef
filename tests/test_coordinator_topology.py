"""Layer specs, grouping, routes, topology errors and the pool budget: scenarios C1–C4 and
C10 of docs/coordinator.md with exact values, and every TopologyError with its indices."""

from __future__ import annotations

import pytest

from pagedkv.coordinator import (
    AttentionKind,
    KVCacheCoordinator,
    KVCacheGroupSpec,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    group_layer_kv_cache_specs,
    max_admission_blocks,
    plan_pool_budget,
    validate_layer_kv_cache_specs,
)
from pagedkv.errors import (
    DuplicateLayer,
    IncompatibleGroupLayer,
    InvalidArgument,
    InvalidArgumentType,
    InvalidLayout,
    ManagerCountMismatch,
    MissingLayerAssignment,
    MissingSharedKVAnchor,
    NonContiguousGroupIds,
    SharedKVAnchorIsAlias,
    SharedKVIncompatible,
    TopologyError,
)

FULL = AttentionKind.FULL
L16 = KVCachePhysicalLayout(16, 1, 64, "bfloat16")
L32 = KVCachePhysicalLayout(32, 1, 64, "bfloat16")


def spec(i, kind=FULL, layout=L16, anchor=None):
    return LayerKVCacheSpec(i, kind, layout, anchor)


# --- kinds and layouts ----------------------------------------------------------------------


def test_attention_kinds_order_full_first_then_by_window():
    kinds = [AttentionKind.sliding(4096), FULL, AttentionKind.sliding(128)]
    assert sorted(kinds) == [FULL, AttentionKind.sliding(128), AttentionKind.sliding(4096)]
    assert FULL.is_full and FULL.window is None and repr(FULL) == "AttentionKind.FULL"
    assert AttentionKind.sliding(8).window == 8
    assert repr(AttentionKind.sliding(8)) == "AttentionKind.sliding(8)"
    assert hash(AttentionKind.sliding(8)) == hash(AttentionKind.sliding(8))
    with pytest.raises(InvalidArgument, match="window = 0"):
        AttentionKind.sliding(0)
    with pytest.raises(InvalidArgumentType):
        AttentionKind.sliding(2.0)


def test_layouts_are_valid_only_with_positive_sizes_and_compatible_only_when_equal():
    assert L16.is_valid
    assert not KVCachePhysicalLayout(0, 1, 64).is_valid
    assert not KVCachePhysicalLayout(16, 1, 64, "int4").is_valid
    assert KVCachePhysicalLayout(16, 1, 64, "bfloat16") == L16
    for other in (KVCachePhysicalLayout(16, 2, 64, "bfloat16"),
                  KVCachePhysicalLayout(16, 1, 128, "bfloat16"),
                  KVCachePhysicalLayout(16, 1, 64, "float16"), L32):
        assert other != L16
    assert L16.bytes_per_block_per_layer == 4096  # 2 * 1 * 64 * 16 * 2


# --- C1 admission blocks -------------------------------------------------------------------


def test_c1_admission_blocks():
    assert max_admission_blocks(FULL, 16, 4096, 1) == 256
    assert max_admission_blocks(FULL, 16, 4097, 1) == 257
    assert max_admission_blocks(AttentionKind.sliding(128), 16, 4096, 32) == 11
    assert max_admission_blocks(AttentionKind.sliding(4096), 16, 512, 256) == 33
    for bad in ((FULL, 0, 4096, 1), (FULL, 16, 0, 1), (FULL, 16, 16, 0)):
        with pytest.raises(InvalidArgument):
            max_admission_blocks(*bad)


# --- C2 grouping ---------------------------------------------------------------------------


def test_c2_an_alias_joins_its_anchors_group_without_a_physical_slot():
    groups = group_layer_kv_cache_specs([spec(0), spec(1, anchor=0), spec(2)], 128, 16)
    assert groups == [KVCacheGroupSpec(0, FULL, L16, (0, 1, 2), (0, 2), 8)]


def test_c2_grouping_splits_kind_and_layout_full_groups_first():
    sw = AttentionKind.sliding(64)
    groups = group_layer_kv_cache_specs(
        [spec(0), spec(1, sw), spec(2, layout=L32), spec(3, sw)], 256, 32)
    assert [(g.group_id, g.kind, g.block_size, g.layer_indices, g.physical_layer_indices)
            for g in groups] == [(0, FULL, 16, (0,), (0,)), (1, FULL, 32, (2,), (2,)),
                                 (2, sw, 16, (1, 3), (1, 3))]
    # Sliding: ceil(min(64 - 1 + 32, 256) / 16) + 1 = 7.
    assert [g.max_admission_blocks for g in groups] == [16, 8, 7]


def test_c2_layouts_differing_in_any_field_are_incompatible():
    layouts = [L16, KVCachePhysicalLayout(16, 2, 64, "bfloat16"),
               KVCachePhysicalLayout(16, 1, 32, "bfloat16"),
               KVCachePhysicalLayout(16, 1, 64, "float16")]
    groups = group_layer_kv_cache_specs([spec(i, layout=x) for i, x in enumerate(layouts)],
                                        64, 16)
    assert len(groups) == 4 and sorted(g.layer_indices for g in groups) == [(0,), (1,), (2,),
                                                                           (3,)]


# --- C3 routes -----------------------------------------------------------------------------


def test_c3_routes_map_aliases_to_their_anchors_physical_ordinal():
    specs = [spec(0), spec(1, anchor=0), spec(2)]
    groups = group_layer_kv_cache_specs(specs, 128, 16)
    coord = KVCacheCoordinator.from_groups(specs, groups, ["mgr0"])
    r = coord.route_for_layer(1)
    assert (r.group_id, r.physical_layer_index, r.physical_layer_ordinal, r.shared_kv_anchor,
            r.is_alias) == (0, 0, 0, 0, True)
    r2 = coord.route_for_layer(2)
    assert (r2.physical_layer_index, r2.physical_layer_ordinal, r2.is_alias) == (2, 1, False)
    assert coord.manager_for_layer(1) == "mgr0" and coord.managers == ("mgr0",)
    with pytest.raises(InvalidArgument, match="layer 3 has no KV-cache route"):
        coord.route_for_layer(3)
    assert "3 layers" in repr(coord)


def test_routes_of_a_hybrid_model_use_binary_search_over_sparse_layer_indices():
    sw = AttentionKind.sliding(32)
    specs = [spec(10), spec(20, sw), spec(30, sw), spec(40, anchor=10), spec(50, sw, anchor=20)]
    groups = group_layer_kv_cache_specs(specs, 256, 16)
    coord = KVCacheCoordinator.from_groups(specs, groups, ["full", "sliding"])
    assert [(r.layer_index, r.group_id, r.physical_layer_ordinal) for r in coord.routes] == [
        (10, 0, 0), (20, 1, 0), (30, 1, 1), (40, 0, 0), (50, 1, 0)]
    assert coord.manager_for_layer(50) == "sliding"


# --- C4 and every topology error ------------------------------------------------------------


def test_c4_topology_errors_carry_their_indices():
    specs = [spec(0)]
    groups = group_layer_kv_cache_specs(specs, 64, 16)
    with pytest.raises(ManagerCountMismatch) as e:
        KVCacheCoordinator.from_groups(specs, groups, [])
    assert (e.value.expected, e.value.actual) == (1, 0)
    with pytest.raises(MissingLayerAssignment) as e:
        KVCacheCoordinator.from_groups([spec(0), spec(1)], groups, ["m"])
    assert e.value.layer == 1
    wrong = [KVCacheGroupSpec(0, AttentionKind.sliding(8), L16, (0,), (0,), 2)]
    with pytest.raises(IncompatibleGroupLayer) as e:
        KVCacheCoordinator.from_groups(specs, wrong, ["m"])
    assert (e.value.group, e.value.layer) == (0, 0)
    with pytest.raises(MissingSharedKVAnchor) as e:
        validate_layer_kv_cache_specs([spec(0), spec(1, anchor=5)])
    assert (e.value.layer, e.value.anchor) == (1, 5)
    with pytest.raises(SharedKVIncompatible) as e:
        validate_layer_kv_cache_specs([spec(0), spec(1, layout=L32, anchor=0)])
    assert (e.value.layer, e.value.anchor) == (1, 0)
    with pytest.raises(SharedKVIncompatible):
        validate_layer_kv_cache_specs([spec(0), spec(1, AttentionKind.sliding(8), anchor=0)])
    with pytest.raises(SharedKVAnchorIsAlias) as e:
        validate_layer_kv_cache_specs([spec(0), spec(1, anchor=0), spec(2, anchor=1)])
    assert (e.value.layer, e.value.anchor, e.value.anchor_of_anchor) == (2, 1, 0)
    assert "point it at 0" in str(e.value)


def test_spec_validation_errors_in_order():
    with pytest.raises(DuplicateLayer) as e:
        validate_layer_kv_cache_specs([spec(0), spec(1), spec(1)])
    assert e.value.layer == 1
    with pytest.raises(InvalidLayout) as e:
        validate_layer_kv_cache_specs([spec(0), spec(1, layout=KVCachePhysicalLayout(16, 0, 64))])
    assert e.value.layer == 1
    with pytest.raises(SharedKVAnchorIsAlias) as e:
        validate_layer_kv_cache_specs([spec(3, anchor=3)])
    assert (e.value.layer, e.value.anchor, e.value.anchor_of_anchor) == (3, 3, 3)
    with pytest.raises(InvalidArgumentType):
        validate_layer_kv_cache_specs([spec(0), "layer 1"])
    with pytest.raises(InvalidArgument):
        spec(-1)
    assert issubclass(InvalidLayout, TopologyError)


def test_group_wiring_errors():
    specs = [spec(0), spec(1)]
    g0 = KVCacheGroupSpec(0, FULL, L16, (0, 1), (0, 1), 4)
    with pytest.raises(NonContiguousGroupIds, match=r"\[1\]"):
        KVCacheCoordinator.from_groups(specs, [KVCacheGroupSpec(1, FULL, L16, (0, 1), (0, 1),
                                                                4)], ["m"])
    with pytest.raises(DuplicateLayer) as e:
        KVCacheCoordinator.from_groups(specs, [g0, KVCacheGroupSpec(1, FULL, L16, (1,), (1,), 4)],
                                       ["a", "b"])
    assert e.value.layer == 1
    with pytest.raises(IncompatibleGroupLayer, match="no LayerKVCacheSpec") as e:
        KVCacheCoordinator.from_groups(specs, [KVCacheGroupSpec(0, FULL, L16, (0, 1, 7),
                                                                (0, 1, 7), 4)], ["m"])
    assert (e.value.group, e.value.layer) == (0, 7)
    # Physical membership must be exactly the non-alias members.
    aliased = [spec(0), spec(1, anchor=0)]
    with pytest.raises(IncompatibleGroupLayer, match="physical_layer_indices") as e:
        KVCacheCoordinator.from_groups(aliased, [KVCacheGroupSpec(0, FULL, L16, (0, 1), (0, 1),
                                                                  4)], ["m"])
    assert e.value.layer == 1
    # An alias in another group than its anchor.
    split = [KVCacheGroupSpec(0, FULL, L16, (0,), (0,), 4),
             KVCacheGroupSpec(1, FULL, L16, (1,), (), 4)]
    with pytest.raises(IncompatibleGroupLayer, match="anchor 0 is in group 0") as e:
        KVCacheCoordinator.from_groups(aliased, split, ["a", "b"])
    assert (e.value.group, e.value.layer) == (1, 1)


# --- C10 pool budget -----------------------------------------------------------------------


def _c10_groups():
    return group_layer_kv_cache_specs(
        [spec(0), spec(1, AttentionKind.sliding(32))], max_model_len=256, max_chunk=16)


@pytest.mark.parametrize("max_num_seqs", [8, 32, 64])
def test_c10_pool_budget_and_width(max_num_seqs):
    groups = _c10_groups()
    assert [g.max_admission_blocks for g in groups] == [16, 4]
    assert [g.bytes_per_block for g in groups] == [4096, 4096]
    b = plan_pool_budget(groups, max_num_seqs=max_num_seqs, memory_bytes=94208)
    assert (b.minimum_pool_bytes, b.default_memory_mb) == (86016, 2048)
    assert (b.admission_width, b.blocks_per_group) == (6, (16, 7))
    b = plan_pool_budget(groups, max_num_seqs=max_num_seqs, memory_bytes=86016)
    assert (b.admission_width, b.blocks_per_group) == (4, (16, 5))
    with pytest.raises(InvalidArgument, match="81,920 bytes but one full-context sequence "
                                              "needs 86,016 bytes"):
        plan_pool_budget(groups, max_num_seqs=max_num_seqs, memory_bytes=81920)


def test_pool_budget_default_width_and_leftover_go_to_the_full_group():
    groups = _c10_groups()
    b = plan_pool_budget(groups, max_num_seqs=8)
    assert b.memory_bytes == 2048 << 20 and b.admission_width == 8
    # Width 8: full 16 + sliding 9; every leftover whole block goes to the full group.
    assert b.blocks_per_group == (16 + (b.memory_bytes - 25 * 4096) // 4096, 9)
    assert b.pool_bytes <= b.memory_bytes
    assert plan_pool_budget(groups, max_num_seqs=2, memory_mb=1).blocks_per_group == (
        16 + (1048576 - 21 * 4096) // 4096, 5)
    with pytest.raises(InvalidArgument):
        plan_pool_budget(groups, max_num_seqs=0)

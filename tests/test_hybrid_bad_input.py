"""Bad input on the hybrid stack (issue 11, "Bad input"): every topology error with its
indices; a write through an alias route; a sidecar whose geometry disagrees with the policy;
reservations above the max pool (``CapacityExceeded`` with the numbers). Each is a specific
error naming the problem, and every group of a live coordinator is unchanged afterwards
(its full observable state, and ``check_invariants()`` on each group)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cold_support import FP, open_tier
from coordinator_support import state
from pagedkv.cold import (
    ColdGroup,
    ColdTierContext,
    RestoredSidecar,
    SidecarBundle,
    SlidingWindowCodec,
    gdn_state_codec,
)
from pagedkv.coordinator import (
    AttentionKind,
    GroupedKVCoordinator,
    KVCacheCoordinator,
    LayerKVCacheSpec,
    RecomputeScheduler,
    SlidingGroupBlocks,
    group_layer_kv_cache_specs,
)
from pagedkv.errors import (
    CapacityExceeded,
    DuplicateLayer,
    GroupManagerMismatch,
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
    SidecarLayoutMismatch,
    TopologyError,
)
from pagedkv.tiny_model import HybridConfig, ReferenceModel
from pagedkv.tiny_model.hybrid_paged import (
    HybridPagedKV,
    build_hybrid_coordinator,
    hybrid_layer_specs,
)

CONFIG = HybridConfig()
BS = 8
SPECS = hybrid_layer_specs(CONFIG, block_size=BS)       # layers 1, 2, 4 and alias 5 -> 2
LAYOUT = SPECS[0].layout


def _live():
    """A hybrid coordinator mid-request: 40 tokens computed by the model, pruned."""
    model = ReferenceModel(CONFIG)
    cache = build_hybrid_coordinator(CONFIG, block_size=BS, blocks_per_group=(12, 10),
                                     hash_seed=0, max_model_len=96)
    cache.reset_for_new_request("a")
    cache.find_cached_prefix("a", np.arange(40))
    kv = HybridPagedKV(cache, "a", CONFIG)
    model.forward(np.arange(40) % CONFIG.vocab_size, kv)
    cache.prune_sliding_all("a", 40)
    return cache, kv


def _unchanged(cache, before) -> None:
    assert state(cache) == before
    for g in cache.groups:
        g.check_invariants(sorted(cache._rows.row_of.values()))
    cache.check_invariants()


def _spec(layer, kind=AttentionKind.FULL, layout=LAYOUT, anchor=None):
    return LayerKVCacheSpec(layer, kind, layout, shared_kv_anchor=anchor)


# --- topology errors --------------------------------------------------------------------------

SLIDING = AttentionKind.sliding(CONFIG.sliding_window)
BAD_SPECS = [
    (SPECS + [_spec(1, SLIDING)], DuplicateLayer, {"layer": 1}),
    ([*SPECS[:2], _spec(4, SLIDING, dataclasses.replace(LAYOUT, head_dim=0)), SPECS[3]],
     InvalidLayout, {"layer": 4}),
    ([*SPECS[:3], _spec(5, anchor=3)], MissingSharedKVAnchor, {"layer": 5, "anchor": 3}),
    (SPECS + [_spec(6, anchor=5)], SharedKVAnchorIsAlias,
     {"layer": 6, "anchor": 5, "anchor_of_anchor": 2}),
    ([*SPECS[:3], _spec(5, anchor=1)], SharedKVIncompatible, {"layer": 5, "anchor": 1}),
]


@pytest.mark.parametrize("specs, error, attrs", BAD_SPECS,
                         ids=[e.__name__ for _, e, _ in BAD_SPECS])
def test_every_spec_error_names_its_layers(specs, error, attrs):
    cache, _ = _live()
    before = state(cache)
    with pytest.raises(error) as e:
        GroupedKVCoordinator.from_specs(specs, max_model_len=96, max_chunk=32,
                                        blocks_per_group=(8, 8))
    assert isinstance(e.value, TopologyError)
    assert {k: getattr(e.value, k) for k in attrs} == attrs
    assert f"layer {attrs['layer']}" in str(e.value)
    _unchanged(cache, before)


def test_every_wiring_error_names_its_group_or_layer():
    groups = group_layer_kv_cache_specs(SPECS, 96, 32)
    full, sliding = groups
    with pytest.raises(ManagerCountMismatch) as e:
        KVCacheCoordinator.from_groups(SPECS, groups, ["m"])
    assert (e.value.expected, e.value.actual) == (2, 1)
    with pytest.raises(NonContiguousGroupIds, match=r"\[0, 2\]"):
        KVCacheCoordinator.from_groups(SPECS, [full, dataclasses.replace(sliding, group_id=2)],
                                       ["a", "b"])
    with pytest.raises(MissingLayerAssignment) as e:
        KVCacheCoordinator.from_groups(SPECS, [full, dataclasses.replace(
            sliding, layer_indices=(1,), physical_layer_indices=(1,))], ["a", "b"])
    assert e.value.layer == 4
    with pytest.raises(IncompatibleGroupLayer) as e:           # a sliding layer in full
        KVCacheCoordinator.from_groups(SPECS, [dataclasses.replace(
            full, layer_indices=(1, 2, 5), physical_layer_indices=(1, 2)), dataclasses.replace(
            sliding, layer_indices=(4,), physical_layer_indices=(4,))], ["a", "b"])
    assert (e.value.group, e.value.layer) == (0, 1)
    # A manager that does not implement its group: a sliding manager of another window.
    cache, _ = _live()
    managers = list(cache.topology.managers)
    other = SlidingGroupBlocks(managers[1].allocator, managers[1].pool, 16)
    topology = KVCacheCoordinator.from_groups(SPECS, groups, [managers[0], other])
    with pytest.raises(GroupManagerMismatch, match="window is 24 tokens, the manager's 16") as e:
        GroupedKVCoordinator(topology, max_model_len=96)
    assert e.value.group == 1


def test_a_hybrid_config_refuses_what_the_specs_refuse():
    with pytest.raises(SharedKVIncompatible) as e:             # alias of a linear layer
        HybridConfig(kv_shared_layers=((5, 0),))
    assert (e.value.layer, e.value.anchor) == (5, 0)
    with pytest.raises(SharedKVAnchorIsAlias) as e:
        HybridConfig(num_layers=7, layer_types=CONFIG.layer_types + ("full_attention",),
                     kv_shared_layers=((5, 2), (6, 5)))
    assert (e.value.layer, e.value.anchor, e.value.anchor_of_anchor) == (6, 5, 2)


# --- a write through an alias route -------------------------------------------------------------

def test_a_write_through_the_alias_route_changes_no_group():
    cache, kv = _live()
    before = state(cache)
    rows = np.ones((1, CONFIG.num_kv_heads, CONFIG.head_dim), np.float32)
    with pytest.raises(InvalidArgument, match="layer 5 is a KV-shared alias of layer 2"):
        cache.write_kv("a", 5, rows, rows)
    with pytest.raises(InvalidArgument, match="KV-shared alias of layer 2"):
        kv.write(5, rows, rows)                               # the model's path says the same
    with pytest.raises(InvalidArgument, match="layer 0 has no KV-cache route"):
        cache.write_kv("a", 0, rows, rows)                    # a linear layer has no K/V
    with pytest.raises(InvalidArgument, match="left the sliding window"):
        cache.write_kv("a", 1, rows, rows, start=0)           # dropped sliding positions
    _unchanged(cache, before)


# --- sidecars whose geometry disagrees with the policy -------------------------------------------

GDN = gdn_state_codec(2, conv_kernel=4, conv_dim=128, num_v_heads=4, v_head_dim=16,
                      k_head_dim=16, dtype="float32")
WINDOW = SlidingWindowCodec(window=24, num_layers=2, kv_heads=2, head_dim=16, dtype="float32")


def test_a_sliding_sidecar_of_another_geometry_installs_nothing():
    cache, _ = _live()
    before = state(cache)
    sliding = cache.groups[1]
    for codec in (SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=16,
                                     dtype="float32"),           # another window
                  SlidingWindowCodec(window=24, num_layers=2, kv_heads=2, head_dim=16)):  # bf16
        # At 40 tokens a window-32 sidecar holds 32 rows where the policy wants 24.
        layout, payload = codec.pack(tuple(np.zeros((2, codec.rows_at(40), 2, 16),
                                                    codec.storage) for _ in "kv"), 40)
        with pytest.raises(SidecarLayoutMismatch):
            WINDOW.install([sliding], RestoredSidecar(layout, payload, b"\x00" * 32))
    with pytest.raises(SidecarLayoutMismatch, match="pool rows are float32"):
        SlidingWindowCodec(window=24, num_layers=2, kv_heads=2, head_dim=16).install(
            [sliding], RestoredSidecar(*SlidingWindowCodec(
                window=24, num_layers=2, kv_heads=2, head_dim=16).pack(
                tuple(np.zeros((2, 16, 2, 16), np.uint16) for _ in "kv"), 16), b"\x00" * 32))
    _unchanged(cache, before)


def test_a_gdn_state_of_another_geometry_is_refused_and_the_states_stay():
    cache, kv = _live()
    before = state(cache)
    held = [tuple(np.asarray(a).copy() for a in kv.linear_state(i))
            for i in CONFIG.linear_attention_layers]
    other = gdn_state_codec(2, conv_kernel=4, conv_dim=96, num_v_heads=4, v_head_dim=16,
                            k_head_dim=16, dtype="float32")
    layout, payload = other.pack((np.zeros((2, 3, 96), np.float32),
                                  np.zeros((2, 4, 16, 16), np.float32)), 40)
    with pytest.raises(SidecarLayoutMismatch):
        GDN.unpack(RestoredSidecar(layout, payload, b"\x00" * 32))
    with pytest.raises(InvalidArgument, match=r"expected float32\(3, 128\)"):
        kv.install_linear_states(40, [np.zeros((3, 96), np.float32)] * 2,
                                 [np.zeros((4, 16, 16), np.float32)] * 2)
    now = [tuple(np.asarray(a) for a in kv.linear_state(i))
           for i in CONFIG.linear_attention_layers]
    assert [a.tobytes() for pair in now for a in pair] == \
        [a.tobytes() for pair in held for a in pair]
    _unchanged(cache, before)


def test_a_persisted_sidecar_of_another_geometry_is_a_miss_on_restore(tmp_path):
    """Sidecars written under one geometry and read under a policy that disagrees (another
    conv width) never decode: a counted miss, nothing restored in any group."""
    model = ReferenceModel(CONFIG)
    prompt = np.arange(41) % CONFIG.vocab_size
    wrong_gdn = gdn_state_codec(2, conv_kernel=4, conv_dim=96, num_v_heads=4, v_head_dim=16,
                                k_head_dim=16, dtype="float32")
    with open_tier(tmp_path) as tier:
        assert tier.install_capture_budget(128, 60_000)
        bundle = SidecarBundle((wrong_gdn, WINDOW))
        ctx = ColdTierContext(tier, FP, bundle, lambda toks, **kw: {40: {
            ColdGroup.GDN_STATE: (np.zeros((2, 3, 96), np.float32),
                                  np.zeros((2, 4, 16, 16), np.float32)),
            ColdGroup.SLIDING_WINDOW: tuple(np.zeros((2, 24, 2, 16), np.float32)
                                            for _ in "kv")}})
        cache = build_hybrid_coordinator(CONFIG, block_size=BS, blocks_per_group=(12, 10),
                                         hash_seed=0, max_model_len=96, cold=ctx)
        cache.reset_for_new_request("a")
        cache.find_cached_prefix("a", prompt)
        model.forward(prompt, HybridPagedKV(cache, "a", CONFIG))
        cache.register_full_blocks_for_reuse("a")
        assert tier.drain(5.0)
    with open_tier(tmp_path) as tier:
        cache = build_hybrid_coordinator(
            CONFIG, block_size=BS, blocks_per_group=(12, 10), hash_seed=0, max_model_len=96,
            cold=ColdTierContext(tier, FP, SidecarBundle((GDN, WINDOW))))
        cache.reset_for_new_request("b")
        hit = cache.find_cached_prefix("b", prompt, max_tokens=40)
        s = tier.stats()
        assert hit.cached_tokens == 0 and hit.sidecar is None and s.hits == 0
        assert s.misses == 1 and s.restore_declines == 1     # the GDN part: another layout
        for g in cache.groups:
            assert g.allocator.num_allocated_blocks == 0 and g.allocator.prefix_cache_len == 0
        assert cache.aux_prefix_unbacked("b") is False
        cache.check_invariants()


# --- reservations above the max pool -------------------------------------------------------------

def test_reservations_above_the_max_pool_name_the_numbers_and_change_nothing():
    cache, _ = _live()
    before = state(cache)
    # The full group holds 12 blocks: a 96-token prompt + its first new token need 13.
    with pytest.raises(CapacityExceeded, match=r"request requires 13 paged blocks but the max "
                                               r"pool holds 12 \(group 0\)"):
        cache.reservation_for(96, 8)
    with pytest.raises(CapacityExceeded, match="requested 97 tokens, the model's max_model_len "
                                               "is 96"):
        cache.reserve_rows_all("a", 57)
    with pytest.raises(CapacityExceeded, match=r"96 tokens need 10 live blocks in the sliding "
                                               r"group \(window 24, block size 8\) but its max "
                                               r"pool holds 9"):
        cache.record_tokens("a", np.arange(56))      # 3 live + 7 more, no prune between
    with pytest.raises(CapacityExceeded, match="request requires 13 paged blocks"):
        RecomputeScheduler(cache).add("big", np.arange(96), 8)
    _unchanged(cache, before)


def test_a_sliding_codec_of_another_window_than_the_groups_restores_nothing(tmp_path):
    """The context's sliding codec (window 32) disagrees with the coordinator's sliding group
    (window 24): the grouped restore refuses before touching any group, the lookup counts a
    restore error and keeps its (empty) hot hit."""
    other = SlidingWindowCodec(window=32, num_layers=2, kv_heads=2, head_dim=16,
                               dtype="float32")
    with open_tier(tmp_path) as tier:
        ctx = ColdTierContext(tier, FP, SidecarBundle((GDN, other)))
        cache = build_hybrid_coordinator(CONFIG, block_size=BS, blocks_per_group=(12, 10),
                                         hash_seed=0, max_model_len=96, cold=ctx)
        with pytest.raises(SidecarLayoutMismatch, match="window of 24 tokens, the sliding "
                                                        "sidecar holds 32"):
            ctx.restore_grouped(tokens=np.arange(40), pool=cache.groups[0].pool,
                                allocator=cache.groups[0].allocator,
                                sliding=[cache.groups[1]])
        cache.reset_for_new_request("a")
        before = state(cache)
        hit = cache.find_cached_prefix("a", np.arange(40))
        assert hit.cached_tokens == 0 and cache.stats()["cold_restore_errors"] == 1
        after = state(cache)
        for g in (*before["groups"], *after["groups"]):
            del g["allocator"]["stats"]            # the lookup's own query counts
        assert after["groups"] == before["groups"]
        assert cache.block_table("a", 0).tolist() == cache.block_table("a", 1).tolist() == []
        cache.check_invariants()


def test_a_grouped_restore_whose_sidecar_is_for_another_boundary_is_refused(caplog):
    """A grouped restore hook returning 16 tokens (2 full blocks, one 2-entry table per
    sliding group) with the sidecar of 8: the lookup took it with its hit whatever the
    sidecar's boundary. It refuses it now (SidecarLayoutMismatch logged, a counted restore
    error), gives every block back and keeps its (empty) hot hit."""
    import logging
    import types

    class Hook:
        def capture(self, **kw):
            return None

        def restore(self, **kw):
            return np.empty(0, np.int32)

        def restore_grouped(self, *, allocator, sliding, **kw):
            return (16, allocator.allocate_many(2),
                    [g.allocator.allocate_many(2) for g in sliding],
                    types.SimpleNamespace(boundary_tokens=8))

    cache = build_hybrid_coordinator(CONFIG, block_size=BS, blocks_per_group=(12, 10),
                                     hash_seed=0, max_model_len=96, cold=Hook())
    cache.reset_for_new_request("a")
    before = state(cache)
    with caplog.at_level(logging.ERROR, logger="pagedkv.adapter"):
        hit = cache.find_cached_prefix("a", np.arange(40))
    assert (hit.cached_tokens, hit.sidecar) == (0, None)
    assert cache.stats()["cold_restore_errors"] == 1
    [record] = [r for r in caplog.records if r.name == "pagedkv.adapter"]
    assert type(record.exc_info[1]) is SidecarLayoutMismatch
    assert str(record.exc_info[1]).startswith(
        "cold tier restore returned a sidecar with boundary_tokens=8 for a 16-token hit (0 "
        "hot + 2 restored blocks of 8 tokens): ")
    after = state(cache)
    for b, a in zip(before["groups"], after["groups"], strict=True):
        # The blocks the hook took are free again; the lookup's own query counts.
        assert sorted(a["allocator"].pop("free_list")) == sorted(b["allocator"].pop("free_list"))
        del a["allocator"]["stats"], b["allocator"]["stats"]
    assert after["groups"] == before["groups"] and after["rows"] == before["rows"]
    assert cache.block_table("a", 0).tolist() == cache.block_table("a", 1).tolist() == []
    cache.check_invariants()


_LAYOUT = {"group": ColdGroup.GDN_STATE, "boundary_tokens": 16, "num_layers": 1,
           "tensors_per_layer": 1, "dtype": "bfloat16", "dims": (2, 4), "bytes_per_tensor": 16}


@pytest.mark.parametrize("field, value", [
    ("boundary_tokens", 16.0), ("boundary_tokens", "16"), ("num_layers", True),
    ("bytes_per_tensor", 16.0), ("dims", ("a",)), ("dims", None), ("dims", (2.0, 4)),
    ("dtype", ["bfloat16"])])
def test_a_sidecar_layout_refuses_what_it_cannot_write(field, value):
    """A float count was accepted and written into the object's metadata as "16.0", which no
    load accepts (every load a counted corruption, the object pruned); strings and None
    raised builtin errors (found by a review)."""
    from pagedkv.cold import ColdSidecarLayout
    with pytest.raises(InvalidArgumentType, match=field):
        ColdSidecarLayout(**{**_LAYOUT, field: value})
    layout = ColdSidecarLayout(**{**_LAYOUT, "boundary_tokens": np.int64(16)})
    assert type(layout.boundary_tokens) is int


def test_collection_arguments_refuse_what_is_not_a_collection():
    from pagedkv.cold import RecurrentStateCodec
    from pagedkv.cold.sidecar_bundle import policies_of
    from pagedkv.coordinator import plan_pool_budget, validate_layer_kv_cache_specs
    for call in (lambda: validate_layer_kv_cache_specs(None),
                 lambda: validate_layer_kv_cache_specs(3),
                 lambda: plan_pool_budget(None, max_num_seqs=1),
                 lambda: policies_of(None),
                 lambda: RecurrentStateCodec(ColdGroup.GDN_STATE, 1, (3,), "bfloat16"),
                 lambda: SidecarBundle((SlidingWindowCodec(4, 1, 1, 1),)).split(
                     [1, 2], ColdGroup.SLIDING_WINDOW)):
        with pytest.raises(InvalidArgumentType):
            call()

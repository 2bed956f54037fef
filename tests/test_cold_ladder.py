"""Ladders, prefill splits, retention caps and victim orders (docs/cold.md, "Ladders and
retention"): every vector of that page, against the pure functions of pagedkv.cold.ladder."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pagedkv.cold.knobs import sliding_checkpoint_limit_override
from pagedkv.cold.ladder import (
    RetentionCaps,
    VictimOrder,
    gdn_checkpoint_target,
    gdn_ladder_rungs,
    gdn_retention_caps,
    gdn_retention_victims,
    lineage_ancestry,
    prefill_checkpoint_boundaries,
    prefill_ranges,
    sliding_anchor_rungs,
    sliding_base_limit,
    sliding_checkpoint_budget,
    sliding_checkpoint_due,
    sliding_decode_cadence,
    sliding_prefill_checkpoints,
    sliding_retention_victims,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType

BS = 16


# --- GDN ladder and splits (S2) -----------------------------------------------------------

@pytest.mark.parametrize(("args", "rungs"), [
    ((1400, 0, 16), [16, 80, 336, 1392]),
    ((4096, 0, 16), [48, 240, 1008, 4080]),
    ((4096, 240, 16), [1008, 4080]),
    ((4096, 1008, 16), [4080]),
    ((1259, 0, 16), [16, 64, 304, 1248]),
    ((16, 0, 16), []),            # the target would be 0
    ((0, 0, 16), []),
])
def test_gdn_ladder_rungs_are_quarters_of_the_one_above(args, rungs):
    assert gdn_ladder_rungs(*args) == rungs


@pytest.mark.parametrize(("args", "target"), [
    ((37, 0, 16), 32), ((33, 0, 16), 32), ((32, 0, 16), 16), ((17, 0, 16), 16),
    ((37, 32, 16), None), ((16, 0, 16), None), ((1400, 0, 16), 1392),
])
def test_gdn_checkpoint_target_is_the_last_boundary_below_the_prompt_end(args, target):
    assert gdn_checkpoint_target(*args) == target


def test_no_cold_policy_keeps_the_single_deep_boundary_the_ladder_replaced():
    assert prefill_checkpoint_boundaries(1400, 0, 16, want_ladder=False) == [1392]
    assert prefill_checkpoint_boundaries(1400, 0, 16, want_ladder=True) == [16, 80, 336, 1392]
    assert prefill_checkpoint_boundaries(37, 32, 16, want_ladder=False) == []
    assert prefill_ranges(1400, 2048, [1392]) == [(0, 1392), (1392, 1400)]
    assert prefill_ranges(1400, 2048, gdn_ladder_rungs(1400, 0, 16)) == [
        (0, 16), (16, 80), (80, 336), (336, 1392), (1392, 1400)]


def test_prefill_ranges_restart_the_chunk_after_every_split():
    assert prefill_ranges(100, 32, [40]) == [(0, 32), (32, 40), (40, 72), (72, 100)]
    assert prefill_ranges(100, None, [40, 0, 100, 250]) == [(0, 40), (40, 100)]
    assert prefill_ranges(100, 0, []) == [(0, 100)]
    assert prefill_ranges(100, 64, [16, 80], start=48) == [(48, 80), (80, 100)]
    assert prefill_ranges(48, 64, [16], start=48) == []
    with pytest.raises(InvalidArgument):
        prefill_ranges(10, 4, [], start=11)
    with pytest.raises(InvalidArgumentType):
        prefill_ranges(10.0, 4, [])
    with pytest.raises(InvalidArgument):
        gdn_ladder_rungs(100, 0, 0)


# --- GDN retention (S4-S6) -------------------------------------------------------------------

def _chain(tag: int, blocks: int) -> np.ndarray:
    """A lineage's chain hashes: entries of one tag share a prompt."""
    return np.array([tag * 1_000_003 + i + 1 for i in range(blocks)], np.uint64)


class Store:
    """A tiny oracle store: entries (owner, tokens, lineage tag) pruned by the function."""

    def __init__(self, caps, root_owner=None):
        self.caps, self.root_owner = caps, root_owner
        self.entries: list[tuple[int, int, int]] = []

    def publish(self, owner, length, lineage=None):
        self.entries.append((owner, length, owner if lineage is None else lineage))
        owners = np.array([e[0] for e in self.entries])
        lengths = np.array([e[1] for e in self.entries])
        anc = lineage_ancestry([_chain(e[2], e[1] // BS) for e in self.entries])
        victims = gdn_retention_victims(owners, lengths, anc, publisher=owner, caps=self.caps,
                                        root_owner=self.root_owner)
        self.entries = [e for i, e in enumerate(self.entries) if i not in set(victims)]
        return victims

    def of(self, owner):
        return {e[1] for e in self.entries if e[0] == owner}


def test_retention_caps_table():
    assert gdn_retention_caps(False, False) == RetentionCaps(2, 2, VictimOrder.PRE_LADDER)
    assert gdn_retention_caps(False, True) == RetentionCaps(5, 2, VictimOrder.PRE_LADDER)
    assert gdn_retention_caps(True, False) == RetentionCaps(4, 4, VictimOrder.LADDER)
    assert gdn_retention_caps(True, True) == RetentionCaps(5, 4, VictimOrder.LADDER)
    with pytest.raises(InvalidArgument):
        RetentionCaps(0, 2, VictimOrder.LADDER)
    with pytest.raises(InvalidArgumentType):
        RetentionCaps(2, 2, "ladder")


@pytest.mark.parametrize(("order", "kept"), [(VictimOrder.PRE_LADDER, {32, 48}),
                                             (VictimOrder.LADDER, {16, 48})])
def test_a_persist_off_lineage_keeps_the_pre_ladder_victim_order(order, kept):
    store = Store(RetentionCaps(2, 2, order))
    for b in (16, 32, 48):
        store.publish(0, b)
    assert store.of(0) == kept


def test_root_and_four_active_child_owners_fit_and_a_sixth_evicts_the_oldest_child():
    store = Store(gdn_retention_caps(False, True), root_owner=0)
    for owner in range(5):
        assert store.publish(owner, 64 + 16 * owner) == []
    assert [e[0] for e in store.entries] == [0, 1, 2, 3, 4]
    assert store.publish(5, 48) == [1]  # index 1: the oldest child; the root stays
    assert [e[0] for e in store.entries] == [0, 2, 3, 4, 5]


def test_four_single_entry_siblings_outlive_the_publishers_ladder():
    store = Store(gdn_retention_caps(True, True), root_owner=0)
    for owner in range(4):  # root, c2, c3, c4
        store.publish(owner, 32 * (owner + 1))
    for b in (16, 80, 336, 1392):
        store.publish(9, b)
    assert store.of(9) == {1392}
    assert [store.of(o) for o in range(4)] == [{32}, {64}, {96}, {128}]


def test_one_subagent_turn_strips_the_root_to_its_deepest_rung():
    store = Store(gdn_retention_caps(True, True), root_owner=0)
    for b in (16, 80, 336, 1392):
        store.publish(0, b)
    assert store.of(0) == {16, 80, 336, 1392}
    evicted = [store.publish(7, b) for b in (48, 240, 1008, 4080)]
    assert evicted == [[], [2], [0], [0]]  # 336, then 16, then 80 (indices at each push)
    assert store.of(0) == {1392} and store.of(7) == {48, 240, 1008, 4080}


def test_per_owner_cap_without_redundancy_takes_the_owners_oldest():
    # Three unrelated lineages of one owner: nothing is an ancestor, so the oldest goes.
    for order in VictimOrder:
        store = Store(RetentionCaps(8, 2, order))
        for i, b in enumerate((64, 32, 96)):
            store.publish(0, b, lineage=100 + i)
        assert store.of(0) == {32, 96}


def test_ladder_ratio_ties_prefer_the_deeper_entry_then_the_least_recent():
    # 16 -> 32 (ratio 2) and 32 -> 64 (ratio 2) tie, 64 -> 160 is 2.5: the deeper, 32, goes.
    caps = RetentionCaps(8, 3, VictimOrder.LADDER)
    owners, lengths = np.zeros(4, int), np.array([16, 32, 64, 160])
    anc = lineage_ancestry([_chain(1, n // BS) for n in lengths])
    assert gdn_retention_victims(owners, lengths, anc, publisher=0, caps=caps) == [1]
    # Equal ratio and depth on two lineages: the least recently used goes.
    lengths = np.array([16, 32, 16, 32, 64])
    tags = [1, 1, 2, 2, 3]
    anc = lineage_ancestry([_chain(t, n // BS) for t, n in zip(tags, lengths, strict=True)])
    caps = RetentionCaps(8, 4, VictimOrder.LADDER)
    got = gdn_retention_victims(np.zeros(5, int), lengths, anc, publisher=0, caps=caps,
                                last_used=np.array([3, 1, 5, 9, 9]))
    assert got == [0]
    got = gdn_retention_victims(np.zeros(5, int), lengths, anc, publisher=0, caps=caps,
                                last_used=np.array([5, 1, 3, 9, 9]))
    assert got == [2]


def test_lineage_ancestry_is_strict_and_per_prefix():
    a = _chain(1, 3)
    b = a[:2].copy()
    c = np.append(a[:1], np.uint64(7))
    anc = lineage_ancestry([a, b, c, np.empty(0, np.uint64)])
    assert anc.tolist() == [[False, False, False, False],
                            [True, False, False, False],
                            [False, False, False, False],
                            [False, False, False, False]]


def test_retention_rejects_malformed_stores():
    caps = RetentionCaps(2, 2, VictimOrder.LADDER)
    with pytest.raises(InvalidArgument):
        gdn_retention_victims([0, 0], [16, 32], np.zeros((3, 3), bool), publisher=0, caps=caps)
    with pytest.raises(InvalidArgument):
        gdn_retention_victims([0], [16, 32], np.zeros((2, 2), bool), publisher=0, caps=caps)
    with pytest.raises(InvalidArgument):
        gdn_retention_victims([0, 0], [16, -32], np.zeros((2, 2), bool), publisher=0,
                              caps=caps)
    with pytest.raises(InvalidArgumentType):
        gdn_retention_victims([0], [16], np.zeros((1, 1), bool), publisher=0, caps=(2, 2))


# --- sliding grid, budget and victims (S7, S8) -----------------------------------------------

def test_sliding_anchor_rungs_are_powers_of_four_from_the_block_size():
    assert sliding_anchor_rungs(16) == (64, 256, 1024, 4096)
    assert sliding_anchor_rungs(8) == (32, 128, 512, 2048)
    budget = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40,
                                       kv_heads=8, head_dim=256, persist=True)
    assert budget.full_window_bytes == 671_088_640
    assert budget.base_limit == 2
    assert budget.rungs == (64, 256, 1024, 4096)
    assert sum(budget.cost(r) for r in budget.rungs) + 2 * budget.full_window_bytes \
        == 2_894_069_760 <= 3 << 30
    assert budget.limit == 6 and budget.order is VictimOrder.LADDER
    off = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40,
                                    kv_heads=8, head_dim=256, persist=False)
    assert off.rungs == () and off.limit == 2 and off.order is VictimOrder.PRE_LADDER


def test_sliding_rungs_are_admitted_while_their_cumulative_cost_fits():
    # 96 layers: fwb 1,610,612,736 = 1.5 GiB; base_limit 2 takes all 3 GiB: no rung.
    b = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=96, kv_heads=8,
                                  head_dim=256, persist=True)
    assert b.base_limit == 2 and b.rungs == () and b.limit == 2
    # 90 layers: fwb 1,509,949,440; room 201,326,592: 64 costs 94,371,840, 256 does not fit.
    b = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=90, kv_heads=8,
                                  head_dim=256, persist=True)
    assert b.rungs == (64,)
    # 60 layers: fwb 1,006,632,960; room 3 GiB - 2 fwb = 1,207,959,552: 64 (62.9 MB),
    # 256 (251.7 MB) and 1024 (1006.6 MB) would total 1321 MB -> only two rungs.
    b = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=60, kv_heads=8,
                                  head_dim=256, persist=True)
    assert b.rungs == (64, 256) and b.limit == 4


def test_sliding_base_limit_and_its_env_override(monkeypatch, caplog):
    assert sliding_base_limit(1024, 16, 671_088_640) == 2
    assert sliding_base_limit(64, 16, 1 << 20) == 16     # ceil(64/16)*2 = 8 -> clamped to 16
    assert sliding_base_limit(4096, 16, 1 << 20) == 128  # 512 -> clamped to 128
    assert sliding_base_limit(1024, 16, 1 << 26) == 16   # min(128, 16)
    assert sliding_base_limit(1024, 16, 671_088_640, override=7) == 7
    monkeypatch.delenv("PAGEDKV_SLIDING_CHECKPOINT_LIMIT", raising=False)
    assert sliding_checkpoint_limit_override() is None
    monkeypatch.setenv("PAGEDKV_SLIDING_CHECKPOINT_LIMIT", "5")
    assert sliding_checkpoint_limit_override() == 5
    budget = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40,
                                       kv_heads=8, head_dim=256, persist=True,
                                       limit_override=sliding_checkpoint_limit_override())
    # room = 3 GiB - 5 fwb < 0: no rung is admitted
    assert budget.base_limit == 5 and budget.rungs == () and budget.limit == 5
    for bad in ("many", "0", "-3"):
        monkeypatch.setenv("PAGEDKV_SLIDING_CHECKPOINT_LIMIT", bad)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert sliding_checkpoint_limit_override() is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "PAGEDKV_SLIDING_CHECKPOINT_LIMIT" in warnings[0].message


def test_sliding_decode_cadence_and_prefill_grid():
    assert sliding_decode_cadence(1024, 16) == 1024
    assert sliding_decode_cadence(1000, 16) == 1008
    assert sliding_decode_cadence(4, 16) == 16
    assert [p for p in range(1, 2100) if sliding_checkpoint_due(p, 1024, 16, persist=True)] \
        == [64, 256, 1024, 2048]
    assert [p for p in range(1, 2100) if sliding_checkpoint_due(p, 1024, 16, persist=False)] \
        == [1024, 2048]
    assert sliding_prefill_checkpoints(0, 4096, 1024, 16, persist=True) == [64, 256, 1024,
                                                                           2048, 3072, 4096]
    assert sliding_prefill_checkpoints(200, 300, 1024, 16, persist=True) == [256]
    assert sliding_prefill_checkpoints(256, 300, 1024, 16, persist=True) == []
    assert sliding_prefill_checkpoints(0, 300, 1024, 16, persist=True, rungs=(64,)) == [64]


def _sliding(entries, budget, protected=None):
    """entries: (length, lineage tag); the last one is the newest."""
    lengths = np.array([n for n, _ in entries])
    anc = lineage_ancestry([_chain(t, -(-n // BS)) if t != "img" else _chain(99, 1)
                            for n, t in entries])
    victims = sliding_retention_victims(lengths, anc, budget, protected=protected)
    return [int(lengths[v]) if entries[v][1] != "img" else "img" for v in victims]


S7 = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40, kv_heads=8,
                               head_dim=256, persist=True)


def test_sliding_ladder_evicts_the_oldest_non_rung_first():
    entries = [(b, 1) for b in (64, 256, 1024, 4096, 7168, 8128, 9152)]
    assert _sliding(entries, S7) == [7168]


def test_sliding_ladder_enforces_the_byte_ceiling_after_the_count():
    entries = [(b, 1) for b in (1024, 4096, 5120, 6144, 7168, 8192)]
    assert _sliding(entries, S7) == [5120, 6144]


def test_sliding_ladder_gives_up_the_deepest_rung_when_images_and_lineage_protect_the_rest():
    budget = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40,
                                       kv_heads=8, head_dim=256, persist=True,
                                       limit_override=1)
    assert budget.limit == 5
    entries = [(300, "img"), (400, "img"), (64, 1), (256, 1), (1024, 1), (1100, 1)]
    protected = np.array([True, True, False, False, False, False])
    assert _sliding(entries, budget, protected) == [1024]


def test_sliding_ladder_drops_rungs_of_a_finished_lineage_first():
    budget = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40,
                                       kv_heads=8, head_dim=256, persist=True,
                                       limit_override=1)
    entries = [(64, "x"), (256, "x"), (1024, "x"), (64, "y"), (256, "y"), (1000, "y")]
    lengths = np.array([n for n, _ in entries])
    anc = lineage_ancestry([_chain({"x": 1, "y": 2}[t], n // BS) for n, t in entries])
    assert sliding_retention_victims(lengths, anc, budget) == [0]  # X's 64


def test_sliding_persistence_off_keeps_the_newest_by_count_only():
    off = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40, kv_heads=8,
                                    head_dim=256, persist=False)
    assert off.base_limit == 2
    kept = []
    for b in (1024, 2048, 3072):
        kept.append(b)
        victims = _sliding([(n, 1) for n in kept], off)
        kept = [n for n in kept if n not in victims]
    assert kept == [2048, 3072]
    # PreLadder never evicts by bytes, and skips protected entries.
    entries = [(300, "img"), (8192, 1), (9216, 1)]
    assert _sliding(entries, off, np.array([True, False, False])) == [8192]


def test_only_the_two_most_recent_image_entries_are_protected():
    off = sliding_checkpoint_budget(window=1024, block_size=16, sliding_layers=40, kv_heads=8,
                                    head_dim=256, persist=False)
    entries = [(300, "img"), (301, "img"), (302, "img"), (2048, 1)]
    protected = np.array([True, True, True, False])
    assert _sliding(entries, off, protected) == ["img", 2048]


def test_sliding_retention_rejects_malformed_input():
    with pytest.raises(InvalidArgument):
        sliding_retention_victims([64, 128], np.zeros((2, 2), bool), S7, protected=[True])
    with pytest.raises(InvalidArgumentType):
        sliding_retention_victims([64], np.zeros((1, 1), bool), 6)
    with pytest.raises(InvalidArgument):
        sliding_retention_victims([64], np.zeros((1, 1), int), S7)

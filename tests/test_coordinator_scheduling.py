"""Admission and recompute preemption (docs/coordinator.md, "Admission and preemption"): the
reservation rule, the watermark, defer / grow-once / reject, and RecomputeScheduler on a
grouped coordinator and a single-group adapter, scenario C9 with exact queues."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator_support import full_sliding_alias, layout, state
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.adapter.admission import watermark_blocks, watermark_fraction
from pagedkv.allocator import BlockAllocator
from pagedkv.coordinator import (
    DEFAULT_WATERMARK_FRACTION,
    RecomputeScheduler,
    RequestStatus,
    reservation_blocks,
)
from pagedkv.errors import (
    CapacityExceeded,
    ContextLengthExceeded,
    InvalidArgument,
    InvalidArgumentType,
    PoolExhausted,
)
from pagedkv.pool import LayerKVPool


def prompt(i, n=8):
    return np.arange(n, dtype=np.uint32) + 1000 * i


def test_reservation_rule_vectors():
    assert reservation_blocks(16, 0, 16) == 1
    assert reservation_blocks(16, 1, 16) == 2        # the first decode token opens block 2
    assert reservation_blocks(15, 1, 16) == 1        # capped: 16 tokens fit one block
    assert reservation_blocks(0, 5, 16) == 1
    assert reservation_blocks(100, 1000, 16) == 8
    with pytest.raises(InvalidArgument):
        reservation_blocks(-1, 0, 16)
    with pytest.raises(InvalidArgument, match="block_size = 0"):   # was ZeroDivisionError
        reservation_blocks(16, 1, 0)


def test_note_admitted_refuses_before_writing_anything():
    c = full_sliding_alias(window=64, blocks=(20, 11))    # 20 and 10 usable blocks
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(8))
    c.note_admitted("a", (6, 6), state_bytes=5)
    before = (c.unallocated_reserved_blocks(), c._rows.state_bytes.tolist())
    # A reservation no max pool can meet used to store the state bytes, then either write
    # group 0 and overflow the int32 table in group 1 (OverflowError, half recorded) or
    # stay recorded and block every later admission.
    for bad in ((6, 2**31), (2**31, 6), (21, 6), (6, 11)):
        with pytest.raises(CapacityExceeded, match="max pool holds"):
            c.note_admitted("a", bad, state_bytes=99)
        assert (c.unallocated_reserved_blocks(), c._rows.state_bytes.tolist()) == before
    with pytest.raises(InvalidArgument, match="state_bytes"):
        c.note_admitted("a", (1, 1), state_bytes=2**63)
    assert (c.unallocated_reserved_blocks(), c._rows.state_bytes.tolist()) == before
    # A float where blocks go is a type error, not "'float' object is not iterable".
    with pytest.raises(InvalidArgumentType, match="blocks"):
        c.can_admit(1.0)
    with pytest.raises(InvalidArgumentType, match="blocks"):
        c.note_admitted("a", 1.5)
    assert (c.unallocated_reserved_blocks(), c._rows.state_bytes.tolist()) == before


def test_watermark_fraction_is_clamped_and_non_finite_is_the_default():
    assert DEFAULT_WATERMARK_FRACTION == 0.01
    assert [watermark_fraction(x) for x in (-1, 0, 0.25, 2, math.nan, math.inf, -math.inf,
                                            None)] == [0.0, 0.0, 0.25, 1.0, 0.01, 0.01, 0.01,
                                                       0.01]
    with pytest.raises(InvalidArgumentType):
        watermark_fraction("high")
    assert watermark_blocks(100, 0.07, live_rows=1) == 7    # no float noise: 7, not 8
    assert watermark_blocks(100, 0.07, live_rows=0) == 0
    assert watermark_blocks(10, 0.01, live_rows=3) == 1


@pytest.mark.parametrize("args, error, message", [
    ((-5, 0.1, 1), InvalidArgument, "capacity_blocks = -5 must be >= 0"),
    ((10.0, 0.1, 1), InvalidArgumentType, "capacity_blocks must be an int, got float"),
    ((True, 0.1, 1), InvalidArgumentType, "capacity_blocks must be an int, got bool"),
    (("10", 0.1, 1), InvalidArgumentType, "capacity_blocks must be an int, got str"),
    ((10, 0.1, -1), InvalidArgument, "live_rows = -1 must be >= 0"),
    ((10, 0.1, 1.0), InvalidArgumentType, "live_rows must be an int, got float"),
    ((10, 0.1, False), InvalidArgumentType, "live_rows must be an int, got bool"),
    ((10, None, 1), InvalidArgumentType, "fraction must be a number in \\[0, 1\\], got NoneType"),
    ((10, "0.1", 1), InvalidArgumentType, "fraction must be a number in \\[0, 1\\], got str"),
    ((10, True, 1), InvalidArgumentType, "fraction must be a number in \\[0, 1\\], got bool"),
    ((10, -0.5, 1), InvalidArgument, "fraction = -0.5 is outside \\[0, 1\\]"),
    ((10, 2.0, 1), InvalidArgument, "fraction = 2.0 is outside \\[0, 1\\]"),
    ((10, math.nan, 1), InvalidArgument, "fraction = nan is outside \\[0, 1\\]"),
])
def test_watermark_blocks_refuses_bad_arguments(args, error, message):
    # -5 blocks gave 0, -0.5 gave -5 and 2.0 gave 20 (more than the pool); None, a str or
    # NaN let a bare TypeError / ValueError out.
    with pytest.raises(error, match=message):
        watermark_blocks(*args)


def test_watermark_blocks_bounds():
    assert watermark_blocks(10, 1.0, live_rows=2) == 10     # never more than the capacity
    assert watermark_blocks(10, 0, live_rows=2) == 0
    assert watermark_blocks(0, 0.5, live_rows=2) == 0
    assert watermark_blocks(np.int64(100), np.float64(0.07), live_rows=np.int32(1)) == 7

def test_can_admit_counts_unallocated_reservations_and_the_watermark_per_group():
    c = full_sliding_alias(window=64, blocks=(20, 11))    # 20 and 10 usable blocks
    assert c.can_admit(10) and c.can_admit((20, 10)) and not c.can_admit((21, 1))
    c.reset_for_new_request("a")
    c.record_tokens("a", np.arange(8))                     # 2 blocks held in each group
    c.note_admitted("a", (6, 6))                           # 4 more reserved in each
    assert c.unallocated_reserved_blocks() == (4, 4)
    # Sliding: 4 reserved + wanted + watermark ceil(10 * 0.01) = 1 against 8 free.
    assert c.can_admit(3) and not c.can_admit(4)
    assert not c.can_admit(3, watermark_fraction=0.2)        # watermark 2 in the sliding group
    assert c.can_admit((3, 2), watermark_fraction=0.2)       # full: 4 + 3 + 4 <= 18
    assert c.can_admit(4, watermark_fraction=0.0) and not c.can_admit(5, watermark_fraction=0.0)
    # The candidate's own live row neither counts as live (no watermark) nor as reserved.
    assert c.can_admit(8, watermark_fraction=0.5, exclude="a")
    assert not c.can_admit(9, watermark_fraction=0.5, exclude="a")
    assert c.admission_need("a", (6, 1)) == (4, 0)
    with pytest.raises(InvalidArgument, match="one per group"):
        c.can_admit((1, 2, 3))


def test_c9_preempt_the_newest_and_requeue_it_before_later_arrivals():
    # Full group: 12 usable blocks of 4 tokens. Three 8-token requests run (2 blocks each).
    c = full_sliding_alias(window=64, blocks=(12, 64), hot_reuse=False)
    sched = RecomputeScheduler(c, max_running=3, watermark_fraction=0.0)
    for i in range(1, 5):
        sched.add(f"r{i}", prompt(i), 8)
    admitted = [sched.admit_next() for _ in range(3)]
    assert [a.request.seq_id for a in admitted] == ["r1", "r2", "r3"]
    for a in admitted:                                      # prefill: 8 tokens, 2 blocks
        c.record_tokens(a.request.seq_id, a.request.prompt)
    assert sched.admit_next() is None                       # max_running
    assert [r.seq_id for r in sched.waiting] == ["r4"]
    assert c.groups[0].allocator.num_free_blocks == 6
    # r1 needs 7 more blocks (36 tokens), 6 are free: r3 is preempted, then r1 fits.
    result, victims = sched.run_or_preempt("r1", lambda: c.record_tokens("r1", prompt(9, 28)))
    assert result is None  # record_tokens returns nothing; it ran
    assert [v.seq_id for v in victims] == ["r3"] and sched.num_preemptions == 1
    assert victims[0].status is RequestStatus.PREEMPTED and victims[0].num_preemptions == 1
    assert [r.seq_id for r in sched.running] == ["r1", "r2"]
    assert [r.seq_id for r in sched.waiting] == ["r3", "r4"]
    assert c.num_tokens("r1") == 36 and "r3" not in c.live_seq_ids()
    assert sched.admission_paused and sched.admit_next() is None
    sched.finish("r1")                                      # registers and releases
    assert not sched.admission_paused
    again = sched.admit_next()
    assert again.request.seq_id == "r3" and again.lookup.cached_tokens == 0  # recomputes
    assert [r.seq_id for r in sched.waiting] == ["r4"]
    c.check_invariants()


def test_a_blocked_row_that_is_itself_the_newest_is_the_victim():
    c = full_sliding_alias(window=64, blocks=(8, 64))
    sched = RecomputeScheduler(c, watermark_fraction=0.0)
    sched.add("a", prompt(1), 4)
    c.record_tokens(sched.admit_next().request.seq_id, prompt(1))   # 2 blocks
    for s, n in (("x", 12), ("y", 8)):                              # outside the scheduler
        c.reset_for_new_request(s)
        c.record_tokens(s, prompt(2, n))                            # 3 + 2 blocks: 1 free
    result, victims = sched.run_or_preempt("a", lambda: c.record_tokens("a", prompt(2, 8)))
    assert result is None and [v.seq_id for v in victims] == ["a"]
    assert sched.running == [] and [r.seq_id for r in sched.waiting] == ["a"]
    # Nothing left to preempt: the error propagates (x needs 4 more blocks, 3 are free).
    with pytest.raises(PoolExhausted):
        sched.run_or_preempt(None, lambda: c.record_tokens("x", prompt(3, 16)))


def test_victims_keep_arrival_order_at_the_front_of_the_queue():
    c = full_sliding_alias(window=64, blocks=(64, 64))
    sched = RecomputeScheduler(c, max_running=3)
    for i in range(5):
        sched.add(f"r{i}", prompt(i), 4)
    for _ in range(3):
        sched.admit_next()
    sched.preempt()
    sched.preempt()
    assert [r.seq_id for r in sched.waiting] == ["r1", "r2", "r3", "r4"]
    assert [r.seq_id for r in sched.running] == ["r0"] and sched.num_preemptions == 2
    with pytest.raises(InvalidArgument, match="already queued"):
        sched.add("r1", prompt(1), 4)


def test_a_decode_step_preempts_until_the_rest_fits():
    c = full_sliding_alias(window=64, blocks=(9, 64))          # 9 usable full blocks
    sched = RecomputeScheduler(c, watermark_fraction=0.0)
    for i in range(3):
        sched.add(f"r{i}", prompt(i), 8)                         # reserves 3 blocks each
    for _ in range(3):
        a = sched.admit_next()
        c.record_tokens(a.request.seq_id, a.request.prompt)     # 8 tokens, 2 blocks
    assert c.groups[0].allocator.num_free_blocks == 3
    assert sched.record_decode_step(lambda r: 1) == []          # 9 tokens: 3 new blocks
    for _ in range(3):                                           # 10..12: no crossing
        assert sched.record_decode_step(lambda r: 1) == []
    victims = sched.record_decode_step(lambda r: 1)             # 13: 3 needed, 0 free
    assert [v.seq_id for v in victims] == ["r2"] and sched.num_preemptions == 1
    assert [c.num_tokens(s) for s in ("r0", "r1")] == [13, 13]
    assert c.groups[0].allocator.num_free_blocks == 1


def test_defer_grow_once_and_reject():
    # A growable single-group adapter: the idle pool grows once for the first request.
    alloc = BlockAllocator(2, 16, 4, hash_seed=0)
    adapter = PagedKVCacheAdapter(alloc, LayerKVPool(layout(4).pool_geometry(1), 2, 16))
    sched = RecomputeScheduler(adapter)
    sched.add("a", prompt(1, 16), 4)          # reserves 5 blocks
    sched.add("b", prompt(2, 16), 4)
    first = sched.admit_next()
    assert first.request.seq_id == "a" and adapter.pool.num_blocks == 5  # grew 2 -> 5
    assert adapter.stats()["grow_events"] == 1
    assert sched.admit_next() is None         # defer: "a" runs and 0 blocks are free
    assert [r.seq_id for r in sched.waiting] == ["b"] and "b" not in adapter.live_seq_ids()
    # A fixed pool with nothing running and a block pinned outside the scheduler: reject.
    c = full_sliding_alias(window=64, blocks=(6, 64))
    c.reset_for_new_request("pinned")
    c.record_tokens("pinned", np.arange(8))
    sched = RecomputeScheduler(c)
    sched.add("big", prompt(3, 16), 4)        # 5 blocks; 4 free
    before = state(c)
    with pytest.raises(ContextLengthExceeded, match="does not fit the idle cache"):
        sched.admit_next()
    after = state(c)
    assert after["stats"]["lookups"] == before["stats"]["lookups"] + 1  # it was looked up
    for g in (*before["groups"], *after["groups"]):     # the lookup's query counters moved
        del g["allocator"]["stats"]
    assert not sched.has_work and after["groups"] == before["groups"]
    assert after["rows"] == before["rows"]
    # Above the max pool: refused at add, nothing queued.
    with pytest.raises(CapacityExceeded, match="request requires 7 paged blocks but the max "
                                               "pool holds 6"):
        sched.add("huge", prompt(4, 24), 4)
    assert not sched.waiting


def test_a_prompt_past_max_model_len_is_refused_at_add():
    # Admission reserves only the first prefill chunk, so a 40-token prompt of a model with
    # max_model_len 32 used to be admitted (running, 8 blocks reserved) and fail mid-prefill.
    c = full_sliding_alias(window=8, max_model_len=32)
    sched = RecomputeScheduler(c, prefill_chunk_tokens=8)
    before = state(c)
    with pytest.raises(CapacityExceeded, match=r"request 'big': the prompt has 33 tokens, past "
                                               r"the model's max_model_len of 32; shorten"):
        sched.add("big", prompt(1, 33), 4)
    assert not sched.has_work and state(c) == before
    assert sched.add("edge", prompt(2, 32), 0).reservation == (8, 5)  # exactly at the limit
    assert sched.admit_next().request.seq_id == "edge"


def test_a_request_that_can_never_be_allocated_leaves_the_queue():
    # Unchunked, a 64-token prompt needs 16 live blocks in a sliding group whose max pool
    # holds 7: its allocation raises CapacityExceeded. It used to stay at the head of the
    # queue, so every later admit_next raised the same error and nothing behind it ran.
    c = full_sliding_alias(window=8, blocks=(64, 8))
    sched = RecomputeScheduler(c)
    sched.add("long", prompt(1, 64), 4)
    sched.add("next", prompt(2, 8), 4)
    before = state(c)
    with pytest.raises(CapacityExceeded, match="64 tokens need 16 live blocks in the sliding "
                                               "group .* its max pool holds 7"):
        sched.admit_next()
    assert [r.seq_id for r in sched.waiting] == ["next"] and c.live_seq_ids() == []
    after = state(c)
    for g in (*before["groups"], *after["groups"]):     # the lookup's query counters moved
        del g["allocator"]["stats"]
    assert after["groups"] == before["groups"] and after["rows"] == before["rows"]
    admitted = sched.admit_next()
    assert admitted.request.seq_id == "next" and c.block_table("next", 1).tolist() == [1, 2]


def test_a_seq_id_live_outside_the_scheduler_is_never_admitted_over():
    # Admission resets the request's row: a row of that id the caller kept in the cache
    # (like the "pinned" row above) was silently released, its 12 tokens and K/V gone.
    c = full_sliding_alias()
    c.reset_for_new_request("p")
    c.record_tokens("p", np.arange(12))
    sched = RecomputeScheduler(c)
    before = state(c)
    with pytest.raises(InvalidArgument, match="add: seq_id 'p' is live in the cache outside "
                                              "this scheduler; admitting it would release"):
        sched.add("p", prompt(1), 4)
    assert not sched.has_work and state(c) == before
    sched.add("q", prompt(2), 4)
    c.reset_for_new_request("q")              # made live after it was queued
    c.record_tokens("q", np.arange(4))
    before = state(c)
    with pytest.raises(InvalidArgument, match="admit_next: seq_id 'q' is live in the cache"):
        sched.admit_next()
    assert state(c) == before and [r.seq_id for r in sched.waiting] == ["q"]
    c.release_request("q")
    assert sched.admit_next().request.seq_id == "q" and c.num_tokens("p") == 12


@pytest.mark.parametrize("kwargs, error, message", [
    ({"prefill_chunk_tokens": 0}, InvalidArgument, "prefill_chunk_tokens = 0 must be >= 1"),
    ({"watermark_fraction": "x"}, InvalidArgumentType, "watermark_fraction must be a number"),
    ({"state_bytes": 5}, InvalidArgumentType, ("state_bytes must be a function of a "
                                               "ScheduledRequest returning bytes, got int")),
])
def test_scheduler_arguments_are_checked_at_construction(kwargs, error, message):
    # These were taken: a chunk of 0 tokens admitted a request reserving and allocating
    # nothing past its hit; the fraction and the hook failed at every admit_next instead
    # (the hook with a bare TypeError).
    with pytest.raises(error, match=message):
        RecomputeScheduler(full_sliding_alias(), **kwargs)


def test_admission_does_not_reserve_a_hit_twice_and_finish_publishes_with_the_salt():
    c = full_sliding_alias(window=8, blocks=(32, 32))
    sched = RecomputeScheduler(c, watermark_fraction=0.0, prefill_chunk_tokens=8)
    p = np.arange(33, dtype=np.uint32)
    sched.add("a", p, 4, cache_salt=5)
    a = sched.admit_next()
    assert a.lookup.cached_tokens == 0
    for lo in range(0, 33, 8):
        if lo:
            c.record_tokens("a", p[lo:lo + 8])
        else:
            c.record_tokens("a", p[:8])
        c.prune_sliding_all("a", c.num_tokens("a"))
    sched.finish("a")
    sched.add("b", p, 4, cache_salt=5)
    sched.add("c", p, 4)                       # another tenant: no hit
    b = sched.admit_next()
    assert b.lookup.cached_tokens == 32
    # Reserved (10, 5); the hit and the prompt allocation hold 9 full blocks and 3 live
    # sliding ones (window [6, 8) of the hit, then 8, the prompt's last block).
    assert b.request.reservation == (10, 5)
    assert c.admission_need("b", b.request.reservation) == (1, 2)
    cc = sched.admit_next()
    assert cc.lookup.cached_tokens == 0
    assert repr(sched).startswith("RecomputeScheduler(waiting=0, running=2")


def test_per_row_state_bytes_count_against_the_state_budget():
    c = full_sliding_alias(window=64, blocks=(64, 64))
    c.state_budget_bytes = 1000
    sched = RecomputeScheduler(c, state_bytes=lambda r: 400)
    for i in range(3):
        sched.add(f"r{i}", prompt(i), 4)
    assert sched.admit_next().request.seq_id == "r0"
    assert sched.admit_next().request.seq_id == "r1"
    assert sched.admit_next() is None          # 400 * 3 > 1000: deferred
    assert c.can_admit(1, extra_state_bytes=200) and not c.can_admit(1, extra_state_bytes=201)
    sched.finish("r0")
    assert sched.admit_next().request.seq_id == "r2"

"""Phase 2 of the hybrid reference model: the paged KV path over a grouped coordinator gives
the flat path's tokens and logits bit for bit (docs/tiny-model.md, "The paged KV path"):
one turn, a continued conversation, 8 concurrent requests sharing a prefix with hybrid hot
reuse (every hit length the rule allows, and never past what every group backs), a prompt
longer than the window, preemption in the middle of a batch, growth; NumPy, and MLX where
it is installed."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.coordinator import expired_blocks
from pagedkv.errors import InvalidArgument
from pagedkv.tiny_model import HybridConfig, ReferenceModel
from pagedkv.tiny_model.hybrid_paged import (
    HybridPagedKV,
    build_hybrid_coordinator,
    hybrid_layer_specs,
)
from pagedkv.tiny_model.hybrid_serving import serve_hybrid
from pagedkv.tiny_model.serving import Request, check_parity
from test_parity import BAD_REQUESTS

BS = 8
CONFIG = HybridConfig()          # window 24; layers linear, sliding, full, linear, sliding, alias


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(CONFIG)


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CONFIG.vocab_size, n).astype(np.int64)


def _same(a, b) -> bool:
    return a.tokens.tobytes() == b.tokens.tobytes() and a.logits.tobytes() == b.logits.tobytes()


def _cache(**kw):
    kw.setdefault("blocks_per_group", (96, 64))
    return build_hybrid_coordinator(CONFIG, block_size=BS, hash_seed=0, **kw)


def test_layer_specs_route_every_kind():
    specs = hybrid_layer_specs(CONFIG, block_size=BS)
    assert [(s.layer_index, s.kind.window, s.shared_kv_anchor) for s in specs] == [
        (1, 24, None), (2, None, None), (4, 24, None), (5, None, 2)]
    cache = _cache()
    assert [g.kind_name for g in cache.groups] == ["full", "sliding"]
    assert cache.route_for_layer(5).group_id == 0 and cache.route_for_layer(5).is_alias
    assert cache.requires_aux_confirmation and cache.checkpoints is not None


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_one_turn_longer_than_the_window(model, backend):
    if backend == "mlx":
        pytest.importorskip("mlx.core")
        model = ReferenceModel(CONFIG, model.weights, backend="mlx")
    prompt = _prompt(1, 70)                     # 70 tokens, window 24
    flat = model.generate(prompt, 6, model.new_flat_kv())
    cache = _cache(backend=backend)
    cache.reset_for_new_request("a")
    cache.find_cached_prefix("a", prompt)
    kv = HybridPagedKV(cache, "a", CONFIG, backend)
    # Prefill in chunks of 16: each extend prunes first, so the sliding group never holds
    # more than the window behind a chunk plus the block it straddles.
    for a in range(0, 64, 16):
        model.forward(prompt[a:a + 16], kv)
        assert cache.groups[1].live_blocks(0) <= cache.topology.groups[1].max_admission_blocks
    rest = model.generate(prompt, 6, kv)
    assert _same(rest, flat)
    n = cache.num_tokens("a")
    table = cache.block_table("a", 1)
    null = cache.groups[1].null_block_id
    assert (table[:expired_blocks(n - 1, 24, BS)] == null).all()
    assert len(cache.block_table("a", 0)) == -(-n // BS) and kv.blocks_nulled > 0
    cache.check_invariants()


def test_a_continued_conversation_keeps_its_live_state(model):
    p1 = _prompt(2, 37)
    cache = _cache()
    cache.reset_for_new_request("chat")
    cache.find_cached_prefix("chat", p1)
    kv = HybridPagedKV(cache, "chat", CONFIG)
    turn1 = model.generate(p1, 5, kv)
    assert _same(turn1, model.generate(p1, 5, model.new_flat_kv()))
    cache.finalize_turn_keep_live("chat")
    p2 = np.concatenate([p1, turn1.tokens, _prompt(3, 11)])
    assert cache.can_continue_all("chat", p2)
    prior, _ = cache.continue_turn("chat", p2, len(p2))
    assert prior == len(p1) + 4                 # the last generated token is not fed back
    turn2 = model.generate(p2, 5, kv)           # the same path: linear state stays live
    assert _same(turn2, model.generate(p2, 5, model.new_flat_kv()))
    cache.check_invariants()


@pytest.mark.parametrize("hot_reuse", [True, False])
def test_eight_concurrent_requests_sharing_a_prefix(model, hot_reuse):
    shared = _prompt(4, 72)
    requests = [Request(f"r{i}", np.concatenate([shared, _prompt(10 + i, 9)]), 4)
                for i in range(8)]
    cache = _cache(hot_reuse=hot_reuse)
    report = serve_hybrid(model, cache, requests, prefill_chunk_tokens=32)
    assert check_parity(model, requests, report.outputs) == []
    if hot_reuse:
        # 81-token prompts: the ladder publishes rungs 16 and 80 (docs/cold.md); the seven
        # later requests resume at 16 with r0's state and sliding window.
        assert report.hot_state_hits == 7 and report.cached_tokens == 7 * 16
    else:
        assert report.hot_state_hits == 0 and report.cached_tokens == 0
    assert report.sliding_blocks_nulled > 0 and report.preemptions == 0
    assert report.group_kinds == ["full", "sliding(24)"]
    cache.check_invariants()


def _serve_a(model, cache, prompt, boundaries):
    """Request A computes ``prompt`` and publishes its state at ``boundaries``."""
    report = serve_hybrid(model, cache, [Request("A", prompt, 1)],
                          checkpoint_boundaries=lambda n, c, bs: list(boundaries))
    assert report.checkpoints_published == len(boundaries)


def _serve_b(model, cache, prompt):
    report = serve_hybrid(model, cache, [Request("B", prompt, 3)])
    assert check_parity(model, [Request("B", prompt, 3)], report.outputs) == []
    return report.cached_tokens


def test_every_hit_length_the_rule_allows_is_bit_identical(model):
    """A publishes a state at every block boundary; B_t shares exactly ``t`` tokens with it.
    Every group backs every boundary, so B_t resumes at exactly ``t`` — before and after the
    window fills (W = 24) — and its output is the flat path's."""
    a_prompt = _prompt(5, 50)
    cache = _cache()
    _serve_a(model, cache, a_prompt, range(BS, 49, BS))
    for t in range(BS, 49, BS):
        b_prompt = np.concatenate([a_prompt[:t], (a_prompt[t:t + 9] + 1) % CONFIG.vocab_size])
        assert _serve_b(model, cache, b_prompt) == t, t
    cache.check_invariants()


def test_a_hit_never_extends_past_what_every_group_backs(model):
    a_prompt = _prompt(6, 50)
    b_prompt = np.concatenate([a_prompt[:40], _prompt(7, 9)])
    # The state store backs only 16 and 32: the hit is the deepest of those under 40.
    cache = _cache()
    _serve_a(model, cache, a_prompt, (16, 32))
    assert _serve_b(model, cache, b_prompt) == 32
    # Without the sliding group's window blocks no boundary is backed, whatever the full
    # group and the store hold.
    cache = _cache()
    _serve_a(model, cache, a_prompt, (16, 32))
    cache.groups[1].allocator.purge_prefix_cache()
    assert cache.checkpoints.boundaries() == [16, 32]
    assert cache.groups[0].allocator.prefix_cache_len == 6
    assert _serve_b(model, cache, b_prompt) == 0
    # Without the full group's blocks neither.
    cache = _cache()
    _serve_a(model, cache, a_prompt, (16, 32))
    cache.groups[0].allocator.purge_prefix_cache()
    assert _serve_b(model, cache, b_prompt) == 0
    # The state store is the only thing missing: no hit either (K/V alone never resumes).
    cache = _cache()
    _serve_a(model, cache, a_prompt, (16, 32))
    cache.checkpoints.clear()
    assert _serve_b(model, cache, b_prompt) == 0
    cache.check_invariants()


def test_preemption_in_the_middle_of_a_batch(model):
    requests = [Request(f"p{i}", _prompt(20 + i, 30), 14) for i in range(4)]
    # 4 rows x 6 full blocks do not fit 20 blocks: a decode step preempts the newest row.
    cache = _cache(blocks_per_group=(20, 40))
    report = serve_hybrid(model, cache, requests, warm_first=False, max_batch=4,
                          watermark_fraction=0.0)
    assert report.preemptions > 0
    assert check_parity(model, requests, report.outputs) == []
    cache.check_invariants()


def test_growth(model):
    requests = [Request(f"g{i}", _prompt(30 + i, 40), 6) for i in range(3)]
    cache = _cache(blocks_per_group=(4, 8), max_blocks_per_group=(64, 32))
    report = serve_hybrid(model, cache, requests, warm_first=False, max_batch=3)
    assert report.grow_events > 0 and report.group_pool_blocks[0] > 4
    assert check_parity(model, requests, report.outputs) == []
    cache.check_invariants()


def test_mlx_concurrent_requests_with_hot_reuse(model):
    pytest.importorskip("mlx.core")
    mlx_model = ReferenceModel(CONFIG, model.weights, backend="mlx")
    shared = _prompt(8, 40)
    requests = [Request(f"m{i}", np.concatenate([shared, _prompt(40 + i, 6)]), 3)
                for i in range(3)]
    cache = _cache(backend="mlx")
    report = serve_hybrid(mlx_model, cache, requests)
    assert report.hot_state_hits == 2
    assert check_parity(mlx_model, requests, report.outputs) == []


def test_snapshot_needs_the_window_rows_and_the_state_its_boundary(model):
    prompt = _prompt(9, 40)
    cache = _cache()
    cache.reset_for_new_request("s")
    cache.find_cached_prefix("s", prompt)
    kv = HybridPagedKV(cache, "s", CONFIG)
    model.forward(prompt[:32], kv)
    flat = model.new_flat_kv()
    model.forward(prompt[:32], flat)
    assert kv.snapshot() == flat.snapshot() and kv.sliding_rows_live()
    # At 39 tokens a prune drops block 1 (positions 8..15): the next query attends [16, 39],
    # but a snapshot at 39 carries W = 24 rows [15, 39) and can no longer be read.
    model.forward(prompt[32:39], kv)
    cache.prune_sliding_all("s", 39)
    assert not kv.sliding_rows_live()
    with pytest.raises(InvalidArgument, match="left the sliding window"):
        kv.snapshot()
    with pytest.raises(InvalidArgument, match="stands at 39"):
        kv.install_linear_states(32, flat.snapshot().conv_states,
                                 flat.snapshot().recurrent_states)


def test_a_hit_state_at_another_boundary_is_never_installed():
    """A restore hook handing back the GDN state of 8 tokens with a 16-token hit: the
    lifecycle latched the row (aux_unbacked), and install_hit_state installed that state as
    the state at 16 and confirmed the latch (found by a review: it passed the hit's length,
    not the state's boundary, to install_linear_states). The lookup now refuses such a
    restore where it takes the hit (a counted restore error, its blocks given back: a miss),
    and install_hit_state still refuses a lookup of that shape and installs nothing."""
    from pagedkv.adapter import ColdRestore
    from pagedkv.cold import RestoredSidecar
    from pagedkv.cold.hybrid_profile import reference_hybrid_sidecar
    from pagedkv.errors import AuxStateUnconfirmed
    from pagedkv.pool import PoolGeometry
    from pagedkv.tiny_model.hybrid_cold import sidecar_state
    from pagedkv.tiny_model.hybrid_serving import install_hit_state

    cfg = HybridConfig(num_layers=2, layer_types=("linear_attention", "full_attention"),
                       kv_shared_layers=())
    codec = reference_hybrid_sidecar(cfg.to_json_dict(), PoolGeometry(
        1, cfg.num_kv_heads, cfg.head_dim, BS, "float32"))
    small = ReferenceModel(cfg)
    prompt = (np.arange(20, dtype=np.int64) * 7 + 1) % cfg.vocab_size
    held = []

    class Hook:
        sidecar = codec

        def capture(self, **kw):
            return None

        def restore(self, *, tokens, hot_blocks, pool, allocator, **kw):
            if len(hot_blocks) or not held:
                return np.empty(0, np.int32)
            return ColdRestore(np.asarray(allocator.allocate_many(2), np.int32), held[0])

    cache = build_hybrid_coordinator(cfg, block_size=BS, blocks_per_group=(64,), cold=Hook(),
                                     checkpoints=False)
    kv = HybridPagedKV(cache, "a", cfg, small.backend)
    cache.reset_for_new_request("a")
    cache.find_cached_prefix("a", prompt, max_tokens=0)
    small.forward(prompt[:8], kv)
    layout, payload = codec.pack(sidecar_state(kv.snapshot(), codec), 8)
    held.append(RestoredSidecar(layout, payload, b"k" * 16))
    cache.release_request("a")
    cache.reset_for_new_request("b")
    hit = cache.find_cached_prefix("b", prompt, max_tokens=19)
    assert (hit.cached_tokens, hit.sidecar, len(hit.restored_blocks)) == (0, None, 0)
    assert cache.stats()["cold_restore_errors"] == 1 and not cache.aux_prefix_unbacked("b")
    assert cache.groups[0].allocator.num_allocated_blocks == 0
    kvb = HybridPagedKV(cache, "b", cfg, small.backend)
    with pytest.raises(AuxStateUnconfirmed, match="at 8 tokens"):
        install_hit_state(kvb, hit._replace(cached_tokens=16, sidecar=held[0]), codec)
    assert cache.num_tokens("b") == 0


@pytest.mark.parametrize("bad, error", BAD_REQUESTS)
def test_serve_hybrid_refuses_a_bad_request_before_admitting_any(bad, error):
    # serve_hybrid used to admit such a request after serving the good one: an id >= vocab
    # failed in its prefill, an over-long one in a decode step, each leaving its row and
    # blocks allocated in the coordinator; a 0-d prompt raised TypeError.
    from pagedkv import errors
    cfg = HybridConfig(max_position=32)
    small = ReferenceModel(cfg)
    assert cfg.vocab_size == 512
    cache = build_hybrid_coordinator(cfg, block_size=BS, hash_seed=0, blocks_per_group=(32, 32))
    with pytest.raises(getattr(errors, error), match="request 'bad'"):
        serve_hybrid(small, cache, [Request("ok", np.arange(5), 3), bad])
    stats = cache.stats()
    assert stats["live_sequences"] == 0 and stats["blocks_allocated"] == 0
    cache.check_invariants()
    good = [Request("ok", np.arange(5), 3)]
    report = serve_hybrid(small, cache, good)
    assert check_parity(small, good, report.outputs) == []

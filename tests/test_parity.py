"""Paged == flat parity on the reference transformer (docs/development.md, 'Reference model and
parity'):
identical greedy tokens and bit-identical logits, through prefix reuse, multi-turn dialogs,
concurrent requests, tenants and pool growth."""

from __future__ import annotations

import numpy as np
import pytest

from allocator_implementations import ALLOCATORS
from pagedkv.tiny_model import FlatKV, PagedKV, ReferenceConfig, ReferenceModel
from pagedkv.tiny_model.serving import Request, build_paged_adapter, check_parity, serve

BS = 16
SYSTEM = (np.arange(3 * BS) * 7 + 3) % 512  # a 3-block system prompt


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(ReferenceConfig(seed=1))


@pytest.fixture(params=ALLOCATORS)
def adapter_for(request):
    def build(model, **kwargs):
        kwargs.setdefault("hash_seed", 0)
        return build_paged_adapter(model, allocator_cls=request.param, **kwargs)
    return build


def user(i: int, n: int = 9) -> np.ndarray:
    return (np.arange(n) * 13 + 101 * (i + 1)) % 512


def same(a, b) -> bool:
    return a.tokens.tobytes() == b.tokens.tobytes() and a.logits.tobytes() == b.logits.tobytes()


def run_paged(model, adapter, seq, prompt, new_tokens, **lookup):
    adapter.reset_for_new_request(seq)
    hit = adapter.find_cached_prefix(seq, prompt, max_tokens=len(prompt) - 1, **lookup)
    adapter.allocate_suffix_blocks(seq, len(prompt))
    return hit.cached_tokens, model.generate(prompt, new_tokens, PagedKV(adapter, seq))


def test_single_turn_greedy_decode_is_byte_equal(model, adapter_for):
    adapter = adapter_for(model, num_blocks=32)
    prompt = np.concatenate([SYSTEM, user(0)])
    flat = model.generate(prompt, 20, FlatKV(model.config))
    cached, paged = run_paged(model, adapter, "s", prompt, 20)
    assert cached == 0 and same(paged, flat)
    assert len(set(flat.tokens.tolist())) > 3
    # The pool holds exactly what the flat cache holds.
    kv = model.new_flat_kv()
    model.forward(np.concatenate([prompt, flat.tokens[:-1]]), kv)
    for layer in range(model.config.num_layers):
        pk, pv = adapter.gather_kv("s", layer)
        fk, fv = kv.read(layer)
        assert pk.tobytes() == fk.tobytes() and pv.tobytes() == fv.tobytes()


def test_two_turn_dialog_reuses_turn_one(model, adapter_for):
    adapter = adapter_for(model, num_blocks=32)
    turn1 = np.concatenate([SYSTEM, user(1)])
    _, out1 = run_paged(model, adapter, "chat", turn1, 12)
    assert same(out1, model.generate(turn1, 12, model.new_flat_kv()))
    assert adapter.register_full_blocks_for_reuse("chat") == (len(turn1) + 11) // BS
    adapter.release_request("chat")
    turn2 = np.concatenate([turn1, out1.tokens, user(2, 7)])
    cached, out2 = run_paged(model, adapter, "chat", turn2, 12)
    assert cached == (len(turn1) + 11) // BS * BS
    assert same(out2, model.generate(turn2, 12, model.new_flat_kv()))


def test_keep_live_turns_are_byte_equal(model, adapter_for):
    adapter = adapter_for(model, num_blocks=32)
    turn1 = np.concatenate([SYSTEM, user(3)])
    _, out1 = run_paged(model, adapter, "chat", turn1, 8)
    adapter.finalize_turn_keep_live("chat")
    turn2 = np.concatenate([turn1, out1.tokens, user(4, 5)])
    prior, _ = adapter.continue_turn("chat", turn2, len(turn2))
    assert prior == len(turn1) + 7
    out2 = model.generate(turn2, 8, PagedKV(adapter, "chat"))
    assert same(out2, model.generate(turn2, 8, model.new_flat_kv()))


def test_eight_concurrent_requests_share_the_system_prompt(model, adapter_for):
    adapter = adapter_for(model, num_blocks=64)
    requests = [Request(f"r{i}", np.concatenate([SYSTEM, user(i)]), 10) for i in range(8)]
    report = serve(model, adapter, requests, max_batch=8)
    assert report.hit_requests == 7 and report.cached_tokens == 7 * 3 * BS
    assert report.blocks_shared == 7 * 3
    assert check_parity(model, requests, report.outputs) == []
    for r in requests:
        alone = model.generate(r.prompt, 10, model.new_flat_kv())
        assert same(report.outputs[r.seq_id], alone)
    adapter.allocator.check_invariants()
    assert adapter.allocator.num_allocated_blocks == adapter.allocator.prefix_cache_len


def test_concurrent_requests_see_the_shared_blocks_in_their_tables(model, adapter_for):
    adapter = adapter_for(model, num_blocks=64)
    first = np.concatenate([SYSTEM, user(0)])
    run_paged(model, adapter, "warm", first, 2)
    adapter.register_full_blocks_for_reuse("warm")
    shared = adapter.block_table("warm")[:3].tolist()
    adapter.release_request("warm")
    for i in range(1, 4):
        cached, _ = run_paged(model, adapter, f"r{i}", np.concatenate([SYSTEM, user(i)]), 3)
        assert cached == 3 * BS
        assert adapter.block_table(f"r{i}")[:3].tolist() == shared
    assert [adapter.allocator.ref_count(b) for b in shared] == [4, 4, 4]


def test_tenants_with_different_salts_never_share_a_block(model, adapter_for):
    from pagedkv.hashing import salt_domain_id

    adapter = adapter_for(model, num_blocks=64)
    a, b = salt_domain_id("tenant-a"), salt_domain_id("tenant-b")
    requests = [Request(f"{t}{i}", np.concatenate([SYSTEM, user(i)]), 6, salt)
                for i in range(3) for t, salt in (("a", a), ("b", b))]
    tables: dict[str, set] = {"a": set(), "b": set()}
    report = serve(model, adapter, requests, max_batch=1)
    assert check_parity(model, requests, report.outputs) == []
    # Every tenant hits only its own registration: 2 hits per tenant after its first request.
    assert report.hit_requests == 4 and report.cached_tokens == 4 * 3 * BS
    for tenant, salt in (("a", a), ("b", b)):
        adapter.reset_for_new_request(tenant)
        hit = adapter.find_cached_prefix(tenant, np.concatenate([SYSTEM, user(9)]),
                                         cache_salt=salt)
        assert hit.cached_tokens == 3 * BS
        tables[tenant] = set(adapter.block_table(tenant).tolist())
    assert tables["a"].isdisjoint(tables["b"])
    adapter.reset_for_new_request("shared")
    assert adapter.find_cached_prefix("shared", np.concatenate([SYSTEM, user(9)])).cached_tokens == 0


def test_growth_in_the_middle_of_a_batch_leaves_outputs_unchanged(model, adapter_for):
    adapter = adapter_for(model, num_blocks=4, max_num_blocks=128)
    requests = [Request(f"g{i}", np.concatenate([SYSTEM[:20], user(i, 10 + i)]), 40)
                for i in range(6)]
    report = serve(model, adapter, requests, max_batch=6, warm_first=False)
    assert report.grow_events >= 2 and adapter.pool.generation == report.grow_events
    assert adapter.pool.num_blocks == adapter.allocator.num_blocks > 4
    assert check_parity(model, requests, report.outputs) == []


def test_preemption_under_a_small_fixed_pool_leaves_outputs_unchanged(model, adapter_for):
    adapter = adapter_for(model, num_blocks=12, growth=False)
    requests = [Request(f"p{i}", user(i, 20), 30) for i in range(4)]
    # Watermark 0: all four are admitted on their prompt reservations (3 blocks each) and
    # only run out of blocks while decoding, which is what preemption is for.
    report = serve(model, adapter, requests, max_batch=4, warm_first=False,
                   watermark_fraction=0.0)
    assert report.preemptions >= 1
    assert check_parity(model, requests, report.outputs) == []
    adapter.allocator.check_invariants()


def test_mlx_paged_equals_mlx_flat():
    pytest.importorskip("mlx.core")
    model = ReferenceModel(ReferenceConfig(seed=1), backend="mlx")
    adapter = build_paged_adapter(model, num_blocks=16, hash_seed=0)
    prompt = np.concatenate([SYSTEM, user(0)])
    flat = model.generate(prompt, 6, FlatKV(model.config, "mlx"))
    _, paged = run_paged(model, adapter, "s", prompt, 6)
    assert same(paged, flat)
    adapter.register_full_blocks_for_reuse("s")
    adapter.release_request("s")
    cached, again = run_paged(model, adapter, "t", np.concatenate([SYSTEM, user(5)]), 6)
    assert cached == 3 * BS
    assert same(again, model.generate(np.concatenate([SYSTEM, user(5)]), 6,
                                      FlatKV(model.config, "mlx")))


#: (request, pagedkv.errors name) that serve and serve_hybrid refuse on a model of
#: vocab_size 512 and max_position 32.
BAD_REQUESTS = [
    (Request("bad", np.array([1, 512]), 3), "InvalidArgument"),       # id == vocab_size
    (Request("bad", np.array([1.0, 2.0]), 3), "InvalidArgumentType"),
    (Request("bad", np.array(7), 3), "InvalidArgument"),              # 0-d prompt
    (Request("bad", np.arange(20), 2.0), "InvalidArgumentType"),
    (Request("bad", np.arange(20), 20), "ContextLengthExceeded"),     # 20 + 20 - 1 > 32
]


@pytest.mark.parametrize("bad, error", BAD_REQUESTS)
def test_serve_refuses_a_bad_request_before_admitting_any(adapter_for, bad, error):
    # Such a request used to be admitted and fail in its prefill or a decode step, leaving
    # its row and blocks allocated; the requests before it had been served.
    from pagedkv import errors
    small = ReferenceModel(ReferenceConfig(seed=1, max_position=32))
    adapter = adapter_for(small, block_size=8, num_blocks=16, max_num_blocks=16)
    with pytest.raises(getattr(errors, error), match="request 'bad'"):
        serve(small, adapter, [Request("ok", np.arange(5), 3), bad])
    stats = adapter.stats()
    assert stats["live_sequences"] == 0 and stats["blocks_allocated"] == 0
    report = serve(small, adapter, [Request("ok", np.arange(5), 3)])
    assert check_parity(small, [Request("ok", np.arange(5), 3)], report.outputs) == []

"""Hybrid hot prefix reuse (docs/coordinator.md, "Hybrid hot prefix reuse"): a hit never
extends past what every group backs.

Seeded request traffic with shared prefixes, two tenants and extra keys runs through a
coordinator (full + sliding; full bs 4 + full bs 8 + sliding; with and without a state
checkpoint store) beside a pure-Python oracle that keeps, per group, the set of published
blocks (a block is its whole token prefix, salt and keys) and the checkpoint boundaries, and
computes the longest boundary every group backs. Every lookup must return exactly the
oracle's length, every table must read back the K/V written for exactly that prefix (values
are a digest of the prefix), and every hit block must carry exactly the references of the
cache and the rows holding it.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from coordinator_support import FULL, full_sliding_alias, layout, prefill
from pagedkv.adapter import PagedKVCacheAdapter
from pagedkv.allocator import BlockAllocator
from pagedkv.coordinator import (
    AttentionKind,
    GroupedKVCoordinator,
    KVCachePhysicalLayout,
    LayerKVCacheSpec,
    SlidingGroupBlocks,
    StateCheckpointStore,
    expired_blocks,
)
from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.pool import LayerKVPool

WINDOW = 12


def prefix_value(prompt: np.ndarray, position: int) -> float:
    """The K value written at ``position``: a digest of the whole prefix up to it, so a
    block of another prefix never reads back the same."""
    return float(zlib.crc32(np.ascontiguousarray(prompt[:position + 1]).tobytes()) % 99991)


class ReuseOracle:
    """What each group has published, literally: sets of (salt, keys, prefix tokens)."""

    def __init__(self, cache: GroupedKVCoordinator, checkpoints: bool) -> None:
        self.groups = [(g.block_size, getattr(g, "window", None)) for g in cache.groups]
        self.published: list[set] = [set() for _ in cache.groups]
        self.checkpoints: set | None = set() if checkpoints else None

    @staticmethod
    def key(salt, keys, prompt, end):
        return (salt, keys, tuple(int(t) for t in prompt[:end]))

    def publish(self, gid, salt, keys, prompt, first, stop):
        bs = self.groups[gid][0]
        for i in range(first, stop):
            self.published[gid].add(self.key(salt, keys, prompt, (i + 1) * bs))

    def backs(self, gid, salt, keys, prompt, t):
        bs, window = self.groups[gid]
        first = 0 if window is None else expired_blocks(t, window, bs)
        return all(self.key(salt, keys, prompt, (i + 1) * bs) in self.published[gid]
                   for i in range(first, t // bs))

    def hit(self, lookup, salt, keys) -> int:
        unit = int(np.lcm.reduce([bs for bs, _ in self.groups]))
        for t in range(len(lookup) - len(lookup) % unit, 0, -unit):
            if all(self.backs(g, salt, keys, lookup, t) for g in range(len(self.groups))) and (
                    self.checkpoints is None or self.key(salt, keys, lookup, t)
                    in self.checkpoints):
                return t
        return 0


def three_groups(**kw) -> GroupedKVCoordinator:
    specs = [LayerKVCacheSpec(0, FULL, layout(4)),
             LayerKVCacheSpec(1, FULL, KVCachePhysicalLayout(8, 1, 2, "float32")),
             LayerKVCacheSpec(2, AttentionKind.sliding(WINDOW), layout(4))]
    return GroupedKVCoordinator.from_specs(specs, max_model_len=512, max_chunk=8,
                                           blocks_per_group=(4096, 2048, 4096), hash_seed=0,
                                           **kw)


def serve_one(cache, oracle, store, rng, seq, prompt, salt, keys, register, live):
    """One request through the cache and the oracle, checking the hit exactly."""
    kw = {"cache_salt": salt, "extra_keys": keys}
    cache.reset_for_new_request(seq)
    lookup = prompt[:len(prompt) - 1]
    hit = cache.find_cached_prefix(seq, prompt, max_tokens=len(lookup), **kw)
    t = hit.cached_tokens
    assert t == oracle.hit(lookup, salt, keys), (seq, len(prompt))
    if store is not None:
        assert (hit.sidecar is None) == (t == 0)
        if t:
            assert hit.sidecar.boundary_tokens == t
            assert hit.sidecar.state == oracle.key(salt, keys, lookup, t)
    # The tables hold exactly the K/V of this prefix, and every hit block's references
    # are the cache's plus one per live row holding it.
    for gid, g in enumerate(cache.groups):
        start = g.first_live_position(cache._row(seq))
        if isinstance(g, SlidingGroupBlocks) and t:
            assert start == expired_blocks(t, g.window, g.block_size) * g.block_size
        layer = cache.topology.groups[gid].physical_layer_indices[0]
        k, _ = cache.gather_kv(seq, layer, start=start)
        assert k[:, 0, 0].tolist() == [prefix_value(prompt, p) + layer
                                       for p in range(start, t)]
        held = [int(b) for b in cache.block_table(seq, gid) if b != getattr(
            g, "null_block_id", -2)]
        for b in held:
            holders = sum(int(b) in cache.block_table(s, gid).tolist() for s in live + [seq])
            assert g.allocator.ref_count(b) == holders + 1, (gid, b)
    # Prefill the rest in chunks; the sliding group publishes what it drops.
    for lo in range(t, len(prompt), 8):
        part = prompt[lo:lo + 8]
        cache.record_tokens(seq, part)
        for route in cache.topology.routes:
            if route.is_alias:
                continue
            vals = np.asarray([prefix_value(prompt, p) + route.layer_index
                               for p in range(lo, lo + len(part))], np.float32)
            kv = np.repeat(vals[:, None, None], 2, axis=2)
            cache.write_kv(seq, route.layer_index, kv, kv)
        before = [int(getattr(g, "null_upto", np.zeros(1))[cache._row(seq)])
                  if isinstance(g, SlidingGroupBlocks) else 0 for g in cache.groups]
        cache.prune_sliding_all(seq, cache.num_tokens(seq))
        for gid, g in enumerate(cache.groups):
            if isinstance(g, SlidingGroupBlocks):
                oracle.publish(gid, salt, keys, prompt, before[gid],
                               int(g.null_upto[cache._row(seq)]))
        if store is not None and rng.random() < 0.5:
            b = cache.num_tokens(seq) - cache.num_tokens(seq) % 8
            if b:
                store.publish(prompt, b, oracle.key(salt, keys, prompt, b), **kw)
                oracle.checkpoints.add(oracle.key(salt, keys, prompt, b))
    if register:
        n = cache.num_tokens(seq)
        cache.register_full_blocks_for_reuse(seq, **kw)
        for gid, g in enumerate(cache.groups):
            first = int(g.null_upto[cache._row(seq)]) if isinstance(g, SlidingGroupBlocks) else 0
            oracle.publish(gid, salt, keys, prompt, first, n // g.block_size)
    cache.check_invariants()
    return t


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("topology", ["full+sliding", "full4+full8+sliding"])
@pytest.mark.parametrize("with_checkpoints", [False, True])
def test_hits_equal_the_longest_boundary_every_group_backs(seed, topology, with_checkpoints):
    if topology == "full+sliding":
        cache = full_sliding_alias(window=WINDOW, blocks=(4096, 4096), max_model_len=512,
                                   checkpoints=with_checkpoints, checkpoint_entries=10_000)
    else:
        cache = three_groups(checkpoints=with_checkpoints, checkpoint_entries=10_000)
    store = cache.checkpoints
    oracle = ReuseOracle(cache, with_checkpoints)
    rng = np.random.default_rng(seed)
    stems = [rng.integers(0, 50, 64).astype(np.uint32) for _ in range(3)]
    hits = 0
    live: list = []
    for i in range(40):
        stem = stems[int(rng.integers(0, 3))]
        head = int(rng.integers(0, 64))
        prompt = np.concatenate([stem[:head], rng.integers(0, 50, int(rng.integers(1, 24)))
                                 .astype(np.uint32)])
        salt = int(rng.choice([0, 0, 7]))
        keys = (5,) if rng.random() < 0.25 else ()
        t = serve_one(cache, oracle, store, rng, f"r{i}", prompt, salt, keys,
                      register=rng.random() < 0.8, live=live)
        hits += t > 0
        if rng.random() < 0.3:
            live.append(f"r{i}")          # keep it live: its blocks stay shared
        else:
            cache.release_request(f"r{i}")
    assert hits >= 5  # the traffic does exercise hits (not a vacuous pass)
    for s in live:
        cache.release_request(s)
    cache.check_invariants()


def test_a_sliding_group_alone_cannot_extend_a_hit_past_its_window_holes():
    # One request registers only the blocks it still holds (it looked up with
    # skip_lookup, so the blocks it dropped were never published): a later identical prompt
    # hits only where the window is complete.
    cache = full_sliding_alias(window=8, blocks=(256, 256))
    prompt = np.arange(40, dtype=np.uint32)
    cache.reset_for_new_request("a")
    cache.find_cached_prefix("a", prompt, skip_lookup=True)
    for lo in range(0, 40, 8):
        cache.record_tokens("a", prompt[lo:lo + 8])
        cache.prune_sliding_all("a", lo + 8)
    assert cache.first_live_position("a", 1) == 32
    cache.register_full_blocks_for_reuse("a")
    cache.release_request("a")
    cache.reset_for_new_request("b")
    hit = cache.find_cached_prefix("b", prompt, max_tokens=39)
    # Full group backs 36 (9 blocks); the sliding group holds blocks 8.. only: at t = 36 it
    # needs blocks [expired(36) = 7, 9) and block 7 was dropped unpublished: no hit anywhere.
    assert hit.cached_tokens == 0
    assert cache.block_table("b", 0).tolist() == [] == cache.block_table("b", 1).tolist()
    cache.release_request("b")
    # With a 40-token lookup the window [8, 10) is complete: 40 tokens.
    cache.reset_for_new_request("c")
    assert cache.find_cached_prefix("c", np.arange(41, dtype=np.uint32),
                                    max_tokens=40).cached_tokens == 40
    null = cache.groups[1].null_block_id
    assert cache.block_table("c", 1).tolist()[:8] == [null] * 8
    cache.check_invariants()


def test_fail_closed_mode_never_takes_a_cross_request_hit_nor_publishes_sliding_blocks():
    cache = full_sliding_alias(window=8, blocks=(256, 256), hot_reuse=False)
    prompt = np.arange(33, dtype=np.uint32)
    for seq in ("a", "b"):
        cache.reset_for_new_request(seq)
        assert cache.find_cached_prefix(seq, prompt, max_tokens=32).cached_tokens == 0
        for lo in range(0, 33, 8):
            cache.record_tokens(seq, prompt[lo:lo + 8])
            cache.prune_sliding_all(seq, cache.num_tokens(seq))
        cache.register_full_blocks_for_reuse(seq)
        cache.release_request(seq)
    assert cache.groups[1].allocator.prefix_cache_len == 0
    assert cache.groups[0].allocator.prefix_cache_len == 8


def test_checkpoints_are_keyed_verified_and_retained_like_blocks():
    cache = full_sliding_alias(window=64, blocks=(64, 64))
    alloc = cache.groups[0].allocator
    store = StateCheckpointStore(alloc, max_entries=2, max_bytes=100)
    prompt = np.arange(100, 140, dtype=np.uint32)
    state8 = np.zeros(4, np.float32)          # 16 bytes
    assert store.publish(prompt, 8, state8, cache_salt=3)
    assert store.publish(prompt, 16, np.ones(4, np.float32), cache_salt=3)
    assert store.boundaries() == [8, 16] and store.nbytes == 32
    # Deepest valid boundary at or below the lookup, same tenant and keys only.
    assert store.deepest(prompt[:15], cache_salt=3).boundary_tokens == 8
    assert store.deepest(prompt, cache_salt=3).boundary_tokens == 16
    assert store.deepest(prompt, cache_salt=4) is None
    assert store.deepest(prompt, cache_salt=3, extra_keys=(1,)) is None
    other = prompt.copy()
    other[3] += 1                              # same length, another prefix
    assert store.deepest(other, cache_salt=3) is None
    assert store.deepest(prompt, cache_salt=3, accept=lambda b: b < 16).boundary_tokens == 8
    # LRU retention: 8 was used last, so publishing 24 evicts 16.
    assert store.deepest(prompt[:12], cache_salt=3).boundary_tokens == 8
    assert store.publish(prompt, 24, np.ones(2, np.float32), cache_salt=3)
    assert store.boundaries() == [8, 24] and store.stats()["evictions"] == 1
    # Bytes: a state bigger than max_bytes is refused; one that overflows evicts the LRU.
    assert not store.publish(prompt, 32, np.ones(40, np.float32), cache_salt=3)
    assert store.publish(prompt, 32, np.ones(20, np.float32), cache_salt=3)  # 80 bytes
    assert store.boundaries() == [24, 32] and store.nbytes == 88  # 8 (16 bytes) evicted
    # Republishing a boundary replaces its state.
    assert store.publish(prompt, 32, np.full(2, 9, np.float32), cache_salt=3)
    assert store.deepest(prompt, cache_salt=3).state.tolist() == [9, 9]
    assert store.stats()["refreshes"] == 1
    for bad in (0, 13, 44):
        with pytest.raises(InvalidArgument):
            store.publish(prompt, bad, state8)
    # A hash collision: every block hashes to 1, so boundary 8 of a prompt that differs in
    # the boundary's block takes the same key; its identity differs: refused, never
    # overwriting, never served.
    from allocator_oracle import BlockAllocator as Oracle
    folded = Oracle(8, None, 4, hash_seed=0, _hash_fn=lambda *a: 1)
    cstore = StateCheckpointStore(folded)
    colliding = prompt.copy()
    colliding[5] += 1
    assert cstore.publish(prompt, 8, "a")
    assert not cstore.publish(colliding, 8, "b")
    assert cstore.stats()["collisions_rejected"] == 1
    assert cstore.deepest(colliding) is None and cstore.deepest(prompt).state == "a"
    assert cstore.stats()["collisions_rejected"] == 2


def test_checkpoint_keys_are_read_like_the_allocators():
    # extra_keys=None (no keys everywhere else) raised a bare TypeError from the identity's
    # digest, and an iterator of keys was consumed by the chain hash before the identity
    # read it: the entry was stored with an empty digest under the keyed hash, so it never
    # verified (counted as a collision) and never served.
    store = StateCheckpointStore(BlockAllocator(8, None, 4, hash_seed=0))
    prompt = np.arange(100, 112, dtype=np.uint32)
    assert store.publish(prompt, 4, "none", extra_keys=None)
    assert store.deepest(prompt[:4], extra_keys=None).state == "none"
    assert store.deepest(prompt[:4]).state == "none"
    assert store.publish(prompt, 8, "iter", extra_keys=iter([7]))
    assert store.deepest(prompt, extra_keys=(7,)).state == "iter"
    assert store.publish(prompt, 12, "per", extra_keys_per_block=[iter([1]), (2,), iter([3])])
    assert store.deepest(prompt, extra_keys_per_block=[(1,), (2,), (3,)]).state == "per"
    assert store.stats()["collisions_rejected"] == 0 and store.boundaries() == [4, 8, 12]
    for bad, error in ((5, InvalidArgumentType), ("ab", InvalidArgumentType), ((-1,), InvalidArgument)):
        with pytest.raises(error, match="extra_keys"):
            store.publish(prompt, 4, "bad", extra_keys=bad)
    assert store.boundaries() == [4, 8, 12] and store.stats()["publishes"] == 3


def test_the_adapter_stops_a_hot_hit_at_the_deepest_checkpoint():
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool

    alloc = BlockAllocator(32, None, 4, hash_seed=0)
    store = StateCheckpointStore(alloc)
    adapter = PagedKVCacheAdapter(alloc, LayerKVPool(layout(4).pool_geometry(1), 32),
                                  checkpoints=store, requires_aux_confirmation=True)
    prompt = np.arange(30, dtype=np.uint32)
    adapter.reset_for_new_request("a")
    adapter.find_cached_prefix("a", prompt)
    adapter.allocate_suffix_blocks("a", 30)
    adapter.record_tokens("a", prompt)
    adapter.register_full_blocks_for_reuse("a")          # 7 blocks cached
    adapter.release_request("a")
    store.publish(prompt, 12, "state@12")
    store.publish(prompt, 20, "state@20")
    adapter.reset_for_new_request("b")
    hit = adapter.find_cached_prefix("b", prompt, max_tokens=29)
    assert hit.cached_tokens == 20 and hit.sidecar.state == "state@20"
    assert len(hit.hot_blocks) == 5 and not adapter.aux_prefix_unbacked("b")
    # The two cached blocks past the checkpoint went back: refcount 1 (the cache's).
    assert [alloc.ref_count(b) for b in range(7)] == [2, 2, 2, 2, 2, 1, 1]
    adapter.release_request("b")
    adapter.reset_for_new_request("c")
    assert adapter.find_cached_prefix("c", prompt, max_tokens=19).cached_tokens == 12
    adapter.release_request("c")
    adapter.reset_for_new_request("d")
    assert adapter.find_cached_prefix("d", prompt, max_tokens=11).cached_tokens == 0
    alloc.check_invariants()


def test_purging_the_prefix_cache_drops_the_state_checkpoints_too():
    # release_request_and_purge_prefix_cache dropped every group's prefix cache but kept the
    # checkpoint store: once a later request registered the prompt's blocks again, the next
    # one was served the recurrent state published before the purge.
    c = full_sliding_alias(checkpoints=True)
    system = np.arange(300, 317, dtype=np.uint32)

    def turn(seq, state=None):
        c.reset_for_new_request(seq)
        hit = c.find_cached_prefix(seq, system, max_tokens=16)
        prefill(c, seq, system, start=hit.cached_tokens)
        if state is not None:
            assert c.checkpoints.publish(system, 16, state)
        c.register_full_blocks_for_reuse(seq)
        return hit

    turn("a", np.array([1.0]))
    assert turn("b").sidecar.boundary_tokens == 16
    c.release_request_and_purge_prefix_cache("b")
    assert len(c.checkpoints) == 0 and c.checkpoints.nbytes == 0
    assert turn("c").cached_tokens == 0        # recomputes, publishes no state
    hit = turn("d")
    assert (hit.cached_tokens, hit.sidecar) == (0, None)


@pytest.mark.parametrize("store", ["yes", 1, np.True_, object()])
def test_a_checkpoints_argument_that_is_no_store_is_refused_when_built(store):
    # It was kept as given and the first lookup failed with a bare AttributeError ("'str'
    # object has no attribute 'deepest'").
    with pytest.raises(InvalidArgumentType, match=r"checkpoints must be None or a state "
                                                  r"checkpoint store .*from_specs takes True"):
        full_sliding_alias(checkpoints=store)
    allocator = BlockAllocator(8, None, 4, hash_seed=0)
    with pytest.raises(InvalidArgumentType, match=r"a StateCheckpointStore: deepest, clear\), "
                                                  r"got [a-z]+$"):
        PagedKVCacheAdapter(allocator, LayerKVPool(layout(4).pool_geometry(1), 8, 8),
                            checkpoints=store)

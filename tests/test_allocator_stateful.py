"""Differential test: the Cython BlockAllocator against the pure-Python oracle.

A hypothesis state machine drives every implementation of ``allocator_implementations``
with the same random operation sequence (allocations, valid and invalid frees, increfs,
chain registration with and without salts and extra keys, low-level register/lookup,
longest-hit walks, restored-batch publication, grow, purge, capacity overrides) and, after
every step, compares each result or exception type and every observable (counters, the
refcount of every block, the LRU order, stats, the free-list order),
compares the block events each step sent, then runs ``check_invariants()`` on each. Half of the machines hash through a ``_hash_fn``
with a tiny range, so hash collisions are frequent and identity verification is exercised.

Pools are tiny (≤ 12 blocks of 1–4 tokens, vocabulary of 3 token ids) so prefixes are shared
often and every step stays cheap; ``CI=1`` runs 300 examples (tests/conftest.py).
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import allocator_oracle
from allocator_implementations import ALLOCATORS, observables
from pagedkv.identity import BlockIdentity, RestoredBlock

CLASSES = [p.values[0] for p in ALLOCATORS]

VOCAB = 3
# Prompts mostly share prefixes with these documents, so chains are found again.
DOCUMENTS = [[0] * 20, [0, 1] * 10, [1, 0, 0, 1, 1] * 4]
SALTS = [0, 0, 42, allocator_oracle.salt_domain_id("tenant-a")]
UNIFORM_KEYS = [(), (1,), (1, 2), (2, 1)]
BLOCK_KEYS = [(), (1,), (2,)]
# Keyword arguments of a request's lookup and registration: who asks, with which keys.
TENANTS = [{}, {"cache_salt": 42}, {"extra_keys": (1,)},
           {"extra_keys_per_block": [(2,), (), (1,)]}]


def colliding_hash(parent, tokens, extra_keys, cache_salt, block_index, seed):
    """A real hot hash folded into 1..4: distinct blocks collide all the time."""
    full = allocator_oracle.hot_block_hash(parent, np.asarray(tokens), tuple(extra_keys), cache_salt,
                                     block_index, seed=seed)
    return full % 4 + 1


def _norm(value):
    """Make results comparable across implementations (arrays by dtype and content)."""
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.tolist())
    if isinstance(value, tuple):
        return tuple(_norm(v) for v in value)
    if isinstance(value, (bool, np.bool_)):
        return ("bool", bool(value))
    if isinstance(value, (int, np.integer)):
        return int(value)
    return value


class AllocatorMachine(RuleBasedStateMachine):
    """Runs each step on every allocator; the first one (the oracle) gives the expectation."""

    def __init__(self):
        super().__init__()
        self.allocs = []
        self.events: list[list] = []  # per allocator: (kind, dtype, hashes) sent by the last step
        self.held: list[int] = []  # references the driver owns (one entry per reference)
        self.served: list[tuple[list[int], dict]] = []  # (tokens, tenant) of earlier requests

    @initialize(num_blocks=st.integers(2, 8), headroom=st.integers(0, 4),
                block_size=st.integers(1, 4), null_block=st.booleans(), collide=st.booleans())
    def build(self, num_blocks, headroom, block_size, null_block, collide):
        hash_fn = colliding_hash if collide else None
        self.allocs = [cls(num_blocks, num_blocks + headroom, block_size, hash_seed=0,
                           reserve_null_block=null_block, _hash_fn=hash_fn)
                       for cls in CLASSES]
        self.events = [[] for _ in self.allocs]
        for alloc, log in zip(self.allocs, self.events, strict=True):
            alloc.on_block_event = (
                lambda kind, hashes, log=log: log.append((kind, hashes.dtype.str,
                                                          hashes.tolist())))

    # -- helpers -------------------------------------------------------------------------

    @property
    def oracle(self):
        return self.allocs[0]

    def run(self, op, *, unchanged_on=None):
        """Apply ``op`` to every allocator; results, exception types and the block events
        the call sent must agree.

        ``unchanged_on(result)`` says which results promise "nothing changes"
        (docs/contracts/paged-kv.md, '4.3 Invariants' item 7);
        a raised exception always does, and sends no event.
        """
        outcomes = []
        for alloc, log in zip(self.allocs, self.events, strict=True):
            log.clear()
            before = observables(alloc)
            try:
                outcome = ("ok", _norm(op(alloc)))
            except Exception as exc:  # noqa: BLE001 - the type is what we compare
                outcome = ("raised", type(exc).__name__)
            if outcome[0] == "raised" or (unchanged_on is not None and unchanged_on(outcome[1])):
                assert observables(alloc) == before, (
                    f"{type(alloc).__module__}: {outcome} changed the state")
                assert log == [], f"{type(alloc).__module__}: {outcome} sent events {log}"
            outcomes.append(outcome)
        for alloc, outcome, log in zip(self.allocs[1:], outcomes[1:], self.events[1:], strict=True):
            assert outcome == outcomes[0], (
                f"{type(alloc).__module__} gave {outcome}, the reference {outcomes[0]}")
            assert log == self.events[0], (
                f"{type(alloc).__module__} sent events {log}, the reference {self.events[0]}")
        return outcomes[0]

    def any_id(self, data):
        return data.draw(st.integers(-1, self.oracle.max_num_blocks), label="block_id")

    def held_ids(self, data, max_size):
        """Ids the driver holds, in a drawn order; now and then one id twice."""
        pool = sorted(set(self.held))
        if not pool:
            return []
        distinct = data.draw(st.integers(0, 3), label="distinct") > 0
        return data.draw(st.lists(st.sampled_from(pool), unique=distinct, max_size=max_size),
                         label="block_ids")

    def draw_tokens(self, data, max_blocks=4):
        """A prompt: usually a prefix of a shared document, sometimes diverging once."""
        bs = self.oracle.block_size
        n = data.draw(st.integers(0, max_blocks * bs + 1), label="n_tokens")
        if data.draw(st.integers(0, 3), label="shared") == 0:
            return data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n),
                             label="tokens")
        doc = data.draw(st.sampled_from([0, 0, 0, 1, 2]), label="document")
        tokens = list(DOCUMENTS[doc][:n])
        if tokens and data.draw(st.integers(0, 2), label="diverge") == 0:
            tokens[data.draw(st.integers(0, n - 1), label="at")] = VOCAB - 1
        return tokens

    def token_input(self, data, tokens):
        """The same prompt as a list, a uint32 array (the no-copy path), an int64 array or a
        strided uint32 view."""
        form = data.draw(st.sampled_from(["list", "uint32", "int64", "strided"]),
                         label="token_form")
        if form == "list":
            return list(tokens)
        if form == "strided":
            return np.repeat(np.array(tokens, dtype=np.uint32), 2)[::2]
        return np.array(tokens, dtype=np.uint32 if form == "uint32" else np.int64)

    def draw_keys(self, data, n_blocks):
        """(uniform extra_keys, extra_keys_per_block) as the call would pass them."""
        form = data.draw(st.sampled_from(["none", "none", "uniform", "per_block"]),
                         label="key_form")
        if form == "uniform":
            return data.draw(st.sampled_from(UNIFORM_KEYS), label="extra_keys"), None
        if form == "per_block":
            per_block = data.draw(st.lists(st.sampled_from(BLOCK_KEYS), min_size=max(n_blocks - 1, 0),
                                           max_size=n_blocks + 1), label="extra_keys_per_block")
            return (), per_block
        return (), None

    def draw_entry(self, data):
        """A (hash, identity) pair: the true chain hash of a block or a small forged one;
        rarely malformed (the reserved hash 0, a token too many or too few)."""
        bs = self.oracle.block_size
        size = bs + data.draw(st.sampled_from([0] * 12 + [-1, 1]), label="size_error") or bs + 1
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size),
                           label="block_tokens")
        salt = data.draw(st.sampled_from(SALTS), label="cache_salt")
        keys = data.draw(st.sampled_from(BLOCK_KEYS), label="keys")
        if data.draw(st.booleans(), label="forged_hash"):
            block_hash = data.draw(st.sampled_from([1, 2, 3, 4] * 3 + [0]), label="block_hash")
        else:
            block = (tokens + [0] * bs)[:bs]
            block_hash = int(self.oracle.chain_hashes(block, extra_keys=keys,
                                                      cache_salt=salt)[0])
        return block_hash, BlockIdentity.of(tokens, 0, keys, salt, 0)

    # -- allocation and references -------------------------------------------------------

    @rule()
    def allocate(self):
        status, got = self.run(lambda a: a.allocate(), unchanged_on=lambda r: r is None)
        if status == "ok" and got is not None:
            self.held.append(got)

    @rule(n=st.integers(0, 5))
    def allocate_many(self, n):
        status, got = self.run(lambda a: a.allocate_many(n), unchanged_on=lambda r: r is None)
        if status == "ok" and got is not None:
            self.held.extend(got[2])

    @rule(n=st.integers(0, 14))
    def can_allocate(self, n):
        self.run(lambda a: a.can_allocate(n))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free_held(self, data):
        block_id = data.draw(st.sampled_from(self.held), label="block_id")
        assert self.run(lambda a: a.free(block_id)) == ("ok", None)
        self.held.remove(block_id)

    @rule(data=st.data())
    def free_any(self, data):
        block_id = self.any_id(data)
        status, _ = self.run(lambda a: a.free(block_id))
        if status == "ok":
            self.held.remove(block_id)

    @rule(data=st.data())
    def free_many(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.held), max_size=len(self.held))
                        if self.held else st.just([]), label="held_part")
        if data.draw(st.booleans(), label="add_unowned"):
            ids.insert(data.draw(st.integers(0, len(ids)), label="at"), self.any_id(data))
        status, _ = self.run(lambda a: a.free_many(np.array(ids, dtype=np.int64)))
        if status == "ok":
            for block_id in ids:
                self.held.remove(block_id)

    @rule(data=st.data())
    def incref(self, data):
        if self.held and data.draw(st.booleans(), label="held"):
            block_id = data.draw(st.sampled_from(self.held), label="block_id")
        else:
            block_id = self.any_id(data)
        status, _ = self.run(lambda a: a.incref(block_id))
        if status == "ok":
            self.held.append(block_id)

    # -- prefix cache ----------------------------------------------------------------------

    @rule(data=st.data())
    def cache_full_blocks(self, data):
        bs = self.oracle.block_size
        tokens = self.draw_tokens(data)
        ids = self.held_ids(data, len(tokens) // bs + 1)
        extra_keys, per_block = self.draw_keys(data, len(ids))
        salt = data.draw(st.sampled_from(SALTS), label="cache_salt")
        tokens_in = self.token_input(data, tokens)
        self.run(lambda a: a.cache_full_blocks(
            tokens_in, np.array(ids, dtype=np.int32),
            extra_keys=extra_keys, extra_keys_per_block=per_block, cache_salt=salt))
        assert np.asarray(tokens_in).tolist() == tokens  # inputs are never written

    @rule(data=st.data())
    def serve_request(self, data):
        """A new request: a prompt that usually shares a prefix with a document."""
        tokens = self.draw_tokens(data)
        tenant = data.draw(st.sampled_from(TENANTS[:1] * 3 + TENANTS), label="tenant")
        self.serve(data, tokens, tenant)

    @precondition(lambda self: self.served)
    @rule(data=st.data())
    def serve_next_turn(self, data):
        """A served prompt again, possibly extended (the next turn of a conversation)."""
        tokens, tenant = data.draw(st.sampled_from(self.served), label="earlier_request")
        more = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=2 * self.oracle.block_size),
                         label="new_tokens")
        self.serve(data, tokens + more, tenant)

    def serve(self, data, tokens, tenant):
        """Longest hit, allocate the rest, register the full blocks, maybe release them."""
        self.served.append((tokens, tenant))
        tokens_in = self.token_input(data, tokens)
        status, got = self.run(lambda a: a.find_longest_cache_hit(tokens_in, **tenant))
        if status != "ok":
            return
        hits = got[0][2]
        self.held.extend(hits)
        n_full = len(tokens) // self.oracle.block_size
        if "extra_keys_per_block" in tenant:
            n_full = min(n_full, len(tenant["extra_keys_per_block"]))
        status, new = self.run(lambda a: a.allocate_many(n_full - len(hits)),
                               unchanged_on=lambda r: r is None)
        if status != "ok" or new is None:
            return
        self.held.extend(new[2])
        ids = np.array(hits + new[2], dtype=np.int32)
        self.run(lambda a: a.cache_full_blocks(tokens_in, ids, **tenant))
        assert np.asarray(tokens_in).tolist() == tokens
        if data.draw(st.booleans(), label="finish"):
            assert self.run(lambda a: a.free_many(ids[::-1])) == ("ok", None)
            for block_id in ids.tolist():
                self.held.remove(block_id)

    @rule(data=st.data())
    def find_longest_cache_hit(self, data):
        tokens = self.draw_tokens(data)
        extra_keys, per_block = self.draw_keys(data, len(tokens) // self.oracle.block_size)
        salt = data.draw(st.sampled_from(SALTS), label="cache_salt")
        tokens_in = self.token_input(data, tokens)
        status, got = self.run(lambda a: a.find_longest_cache_hit(
            tokens_in, extra_keys=extra_keys, extra_keys_per_block=per_block, cache_salt=salt))
        if status == "ok":
            self.held.extend(got[0][2])

    @rule(data=st.data())
    def chain_hashes(self, data):
        tokens = self.draw_tokens(data)
        extra_keys, per_block = self.draw_keys(data, len(tokens) // self.oracle.block_size)
        salt = data.draw(st.sampled_from(SALTS), label="cache_salt")
        tokens_in = self.token_input(data, tokens)
        self.run(lambda a: a.chain_hashes(tokens_in,
                                          extra_keys=extra_keys, extra_keys_per_block=per_block,
                                          cache_salt=salt))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def register_prefix(self, data):
        if data.draw(st.integers(0, 9), label="unowned") == 0:
            block_id = self.any_id(data)
        else:
            block_id = data.draw(st.sampled_from(self.held), label="block_id")
        block_hash, identity = self.draw_entry(data)
        self.run(lambda a: a.register_prefix(block_id, block_hash, identity),
                 unchanged_on=lambda r: r == ("bool", False))

    @rule(data=st.data())
    def lookup_prefix(self, data):
        if self.oracle.prefix_cache_len and data.draw(st.booleans(), label="known_hash"):
            block_hash = data.draw(st.sampled_from(self.oracle.lru_hashes()), label="block_hash")
            _, identity = self.draw_entry(data)
        else:
            block_hash, identity = self.draw_entry(data)
        status, got = self.run(lambda a: a.lookup_prefix(block_hash, identity))
        if status == "ok" and got is not None:
            self.held.append(got)

    @rule(data=st.data())
    def publish_restored_batch(self, data):
        bs = self.oracle.block_size
        ids = self.held_ids(data, 3)
        tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(ids) * bs,
                                    max_size=len(ids) * bs), label="tokens")
        salt = data.draw(st.sampled_from(SALTS), label="cache_salt")
        hashes = self.oracle.chain_hashes(tokens, cache_salt=salt).tolist()
        entries, parent = [], 0
        for i, (block_id, block_hash) in enumerate(zip(ids, hashes, strict=True)):
            identity = BlockIdentity.of(tokens[i * bs:(i + 1) * bs], parent, (), salt, i)
            entries.append(RestoredBlock(block_id, block_hash, identity))
            parent = block_hash
        if entries:
            spoil = data.draw(st.sampled_from(["none", "none", "known_hash", "dup_hash",
                                               "unowned_id", "short_tokens"]), label="spoil")
            i = data.draw(st.integers(0, len(entries) - 1), label="spoiled_entry")
            e = entries[i]
            if spoil == "known_hash" and self.oracle.prefix_cache_len:
                entries[i] = e._replace(block_hash=self.oracle.lru_hashes()[0])
            elif spoil == "dup_hash":
                entries[i] = e._replace(block_hash=entries[0].block_hash)
            elif spoil == "unowned_id":
                entries[i] = e._replace(block_id=self.any_id(data))
            elif spoil == "short_tokens":
                entries[i] = e._replace(identity=e.identity._replace(tokens=e.identity.tokens[1:]))
        self.run(lambda a: a.publish_restored_batch(entries),
                 unchanged_on=lambda r: r == ("bool", False))

    @rule(purge=st.booleans(), n=st.integers(-1, 9))
    def shrink_prefix_cache(self, purge, n):
        """Purge or a capacity override (one rule, so they do not empty the cache too often)."""
        if purge:
            self.run(lambda a: a.purge_prefix_cache())
        else:
            self.run(lambda a: a.set_prefix_cache_capacity(n))

    @rule(k=st.integers(-1, 3))
    def grow_by(self, k):
        self.run(lambda a: a.grow_by(k))

    # -- after every step --------------------------------------------------------------------

    @invariant()
    def implementations_agree(self):
        if not self.allocs:
            return
        snapshots = [observables(a) for a in self.allocs]
        for alloc, snap in zip(self.allocs[1:], snapshots[1:], strict=True):
            assert snap == snapshots[0], f"{type(alloc).__module__} diverged from the reference"
        refs = {}
        for block_id in self.held:
            refs[block_id] = refs.get(block_id, 0) + 1
        for block_id, n in refs.items():
            assert self.oracle.ref_count(block_id) >= n

    @invariant()
    def invariants_hold(self):
        for alloc in self.allocs:
            alloc.check_invariants()


AllocatorMachine.TestCase.settings = settings(stateful_step_count=40)
TestAllocatorsAgree = AllocatorMachine.TestCase

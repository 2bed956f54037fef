"""Test doubles for the cold-tier tests: a small pool and allocator with the contracts the
walks rely on (docs/contracts/paged-kv.md, '4.4 Operations' and '4.9 Batch publish of restored
blocks' and '5.5 Block I/O'), used where the real ones are not needed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from pagedkv.cold import BlockGeometry, ColdTier
from pagedkv.identity import extra_keys_digest

FP = hashlib.sha256(b"test-fingerprint").digest()


@dataclass(frozen=True)
class Geometry:
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 8
    block_size: int = 4
    dtype: str = "float16"
    layout: str = "nhd"


SPEC_GEOMETRY = Geometry()  # docs/contracts/cold-tier.md, '15. Acceptance scenarios': 2 layers x 1 head x head_dim 8 x bs 4 x float16


class FakePool:
    def __init__(self, geometry=SPEC_GEOMETRY, num_blocks: int = 64):
        self.geometry = geometry
        g = BlockGeometry.of(geometry)
        self.slab_bytes = g.slab_bytes
        self.data = np.zeros((num_blocks, g.num_layers, 2, g.slab_bytes), np.uint8)
        self.fail_reads = False
        self.fail_writes = False
        self.writes = 0

    def fill(self, block_id: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.data[block_id] = rng.integers(0, 256, self.data[block_id].shape, dtype=np.uint8)

    def read_block(self, block_id, out=None):
        if self.fail_reads:
            raise RuntimeError("injected pool read failure")
        if out is None:
            return self.data[block_id].copy()
        out[...] = self.data[block_id]
        return out

    def write_block(self, block_id, data):
        if self.fail_writes:
            raise RuntimeError("injected upload failure")
        self.data[block_id] = np.asarray(data).reshape(self.data[block_id].shape)
        self.writes += 1


class FakeAllocator:
    """Refcounts, a hash → block table and publish_restored_batch's preflight."""

    def __init__(self, num_blocks: int = 64, block_size: int = 4):
        self.block_size = block_size
        self.ref = np.zeros(num_blocks, np.int64)
        self.free_list = list(range(num_blocks))
        self.table: dict[int, int] = {}
        self.identities: dict[int, object] = {}
        self.refuse_publish = False

    def chain_hashes(self, tokens, *, extra_keys=(), extra_keys_per_block=None, cache_salt=0):
        toks = np.asarray(tokens, np.uint32)
        n = len(toks) // self.block_size
        if extra_keys_per_block is not None:
            n = min(n, len(extra_keys_per_block))
        out, parent = [], 0
        for i in range(n):
            keys = extra_keys_per_block[i] if extra_keys_per_block is not None else extra_keys
            h = hashlib.sha256(parent.to_bytes(8, "little")
                               + toks[i * self.block_size:(i + 1) * self.block_size].tobytes()
                               + extra_keys_digest(keys)
                               + (cache_salt if i == 0 else 0).to_bytes(8, "little"))
            parent = int.from_bytes(h.digest()[:8], "little") or 1
            out.append(parent)
        return np.array(out, np.uint64)

    def allocate(self):
        if not self.free_list:
            return None
        b = self.free_list.pop(0)
        self.ref[b] = 1
        return b

    def incref(self, b):
        assert self.ref[b] > 0
        self.ref[b] += 1

    def free(self, b):
        assert self.ref[b] > 0, f"double free of {b}"
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free_list.append(int(b))

    def free_many(self, ids):
        for b in ids:
            self.free(int(b))

    def publish_restored_batch(self, entries):
        if self.refuse_publish:
            return False
        for e in entries:
            assert self.ref[e.block_id] > 0
            if e.block_hash in self.table:
                return False
        for e in entries:
            self.table[e.block_hash] = e.block_id
            self.identities[e.block_hash] = e.identity
            self.ref[e.block_id] += 1
        return True


def block_job(i: int, geometry=None):
    """A ``BlockJob`` of random tokens and payload (seeded by ``i``) keyed under ``FP``."""
    from pagedkv.cold import DEFAULT_FORMAT, ColdGroup, cold_key_chain
    from pagedkv.cold.writer import BlockJob
    g = geometry if geometry is not None else BlockGeometry.of(SPEC_GEOMETRY)
    rng = np.random.default_rng(i)
    toks = rng.integers(0, 1000, g.block_size, dtype=np.uint32)
    buf = rng.integers(0, 256, (g.num_layers, 2, g.slab_bytes), dtype=np.uint8)
    key = cold_key_chain(DEFAULT_FORMAT, ColdGroup.KV, FP, toks, g.block_size)[0]
    return BlockJob(key, FP.hex(), g, toks, buf)


def open_tier(path, **kw) -> ColdTier:
    kw.setdefault("quota_bytes", 1 << 30)
    kw.setdefault("reserve_bytes", 0)
    kw.setdefault("queue_depth", 8)
    kw.setdefault("fingerprint", FP)
    return ColdTier.open_at(str(path), **kw)


def persist_prompt(tier, tokens, *, pool=None, alloc=None, cache_salt=0, seed=0):
    """Put ``tokens``' full blocks in a fresh pool (random K/V), capture, drain.
    Returns (pool, alloc, block_ids, outcome)."""
    pool = pool or FakePool()
    alloc = alloc or FakeAllocator(block_size=pool.geometry.block_size)
    bs = pool.geometry.block_size
    ids = np.array([alloc.allocate() for _ in range(len(tokens) // bs)], np.int32)
    for j, b in enumerate(ids):
        pool.fill(int(b), seed * 1000 + j)
    outcome = tier.capture(tokens=np.asarray(tokens, np.uint32), block_ids=ids, hashes=None,
                           cache_salt=cache_salt, extra_keys_per_block=None, pool=pool,
                           allocator=alloc)
    assert tier.drain(5.0)
    return pool, alloc, ids, outcome


# --- the reference transformer over the real allocator, pool and adapter ----------------

def reference_session(root, model_dir, *, persist: bool, prompt, max_new: int = 8,
                      block_size: int = 4, num_blocks: int = 256, remote: str | None = None
                      ) -> dict:
    """One request of the reference model through a fresh adapter (a fresh process in the
    restart tests). ``persist`` attaches a cold tier at ``root`` (``None``: on ``remote``
    alone; else with ``remote`` behind it). Returns what the parity gate compares: generated
    tokens, a digest of the logits, cached tokens and counters."""
    from pagedkv.adapter import PagedKVCacheAdapter
    from pagedkv.allocator import BlockAllocator
    from pagedkv.cold import DEFAULT_FORMAT, family_profile, model_fingerprint, resolve_persist
    from pagedkv.pool import LayerKVPool, PoolGeometry
    from pagedkv.tiny_model import PagedKV, ReferenceModel

    model = ReferenceModel.load(model_dir)
    c = model.config
    geometry = PoolGeometry(c.num_layers, c.num_kv_heads, c.head_dim, block_size, "float32")
    pool = LayerKVPool(geometry, num_blocks)
    alloc = BlockAllocator(num_blocks, block_size=block_size, hash_seed=0)
    tier = None
    profile = family_profile("pagedkv_reference")
    if persist and resolve_persist(profile, config_value=True):
        fp = model_fingerprint(DEFAULT_FORMAT, str(model_dir), profile, geometry,
                               compute=model.compute_identity)
        if root is None:
            tier = ColdTier.open_remote(remote, fingerprint=fp)
        else:
            tier = ColdTier.open_at(str(root), quota_bytes=1 << 30, reserve_bytes=0,
                                    fingerprint=fp, remote=remote)
    adapter = PagedKVCacheAdapter(alloc, pool, cold=tier)
    prompt = np.asarray(prompt, np.int64)
    adapter.reset_for_new_request(0)
    hit = adapter.find_cached_prefix(0, prompt, max_tokens=len(prompt) - 1)
    adapter.allocate_suffix_blocks(0, len(prompt))
    gen = model.generate(prompt, max_new, PagedKV(adapter, 0))
    adapter.register_full_blocks_for_reuse(0)
    adapter.release_request(0)
    out = {"tokens": gen.tokens.tolist(),
           "logits_sha256": hashlib.sha256(np.ascontiguousarray(gen.logits).tobytes()).hexdigest(),
           "cached_tokens": int(hit.cached_tokens), "restored_blocks": len(hit.restored_blocks),
           "hits": 0, "corruptions": 0, "enqueued": 0}
    if tier is not None:
        out["drained"] = tier.drain(10.0)
        s = tier.stats()
        out.update(hits=s.hits, corruptions=s.corruptions, enqueued=s.enqueued,
                   misses=s.misses)
        tier.close()
    return out

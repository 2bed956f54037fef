"""kv_adaptive: lower the K and V modes, one tier at a time, as the context grows.

docs/kv-quant.md "kv_adaptive". The cache starts at K fwht4 / V q8 (head_dim 256) and its
memory is fixed by the *floor* tier: per layer and sequence ``budget = max_seq * kv_heads *
(k_bph(floor K) + v_bph(floor V))`` bytes, so ``max_seq`` is the context guaranteed at the
floor and a tier holds ``cap = budget // (kv_heads * (k_bph + v_bph))`` tokens. Before ``n``
tokens are appended at position ``seq_pos``, steps apply while ``seq_pos + n`` passes the
next threshold (``cap(current tier) - 64``); if they would not fit even after them, the
usual :class:`~pagedkv.errors.CapacityExceeded` is raised before any step runs.

=============  ==================================================  ==============
preset         steps (one side, one tier each)                      floor K/V
=============  ==================================================  ==============
conservative   V->lloyd4                                            fwht4/lloyd4
balanced       V->lloyd4, V->lloyd3, K->fwht2, V->lloyd2            fwht2/lloyd2
aggressive     K->fwht2, V->lloyd4, V->lloyd3, V->lloyd2            fwht2/lloyd2
advanced:...   ``advanced:k=<fwht4|fwht2>,v=<q8|lloyd4|lloyd3|      as given
               lloyd2>``: balanced's order cut at the given floors
=============  ==================================================  ==============

At head_dim 128 (pagedkv's extension: lloyd V needs head_dim 256) each V step takes the fwht
V mode of its width instead: lloyd4 -> fwht4, lloyd2 -> fwht2, and lloyd3 is skipped (fwht3
is R256 only), so balanced is V->fwht4, K->fwht2, V->fwht2 (floor fwht2/fwht2).

A step transcodes every block of the pool in place (:meth:`LayerKVPool.transcode`: q8 ->
lloyd4 decodes and re-encodes, the other steps narrow codes within a table family) inside
layer regions sized for the floor, so memory never grows; the pool then holds more blocks,
and the allocator grows by as many. Anything that baked the old mode (an attention object,
a captured graph) must be rebuilt: :meth:`KVAdaptive.add_listener`. A pool without fixed
regions builds each step's generation beside the old one: its memory budget must hold both,
else the step raises :class:`~pagedkv.errors.PoolExhausted` with the pool and the tier as
they were (also when the new generation runs out of memory).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.argument_checks import int_argument
from pagedkv.errors import CapacityExceeded, InvalidArgument, InvalidArgumentType
from pagedkv.quant.kv import join_kv_dtype, side_row_bytes

__all__ = [
    "PRESETS",
    "START_TIER",
    "THRESHOLD_MARGIN_TOKENS",
    "AdaptivePreset",
    "KVAdaptive",
    "KVAdaptivePlan",
    "parse_adaptive",
]

logger = logging.getLogger("pagedkv")

START_TIER = ("fwht4", "q8")
#: Tokens before a tier's capacity at which the next step applies.
THRESHOLD_MARGIN_TOKENS = 64
PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "conservative": (("v", "lloyd4"),),
    "balanced": (("v", "lloyd4"), ("v", "lloyd3"), ("k", "fwht2"), ("v", "lloyd2")),
    "aggressive": (("k", "fwht2"), ("v", "lloyd4"), ("v", "lloyd3"), ("v", "lloyd2")),
}
_V_ORDER = ("q8", "lloyd4", "lloyd3", "lloyd2")
#: The V step a lloyd step becomes at head_dim 128 (None: skipped; fwht3 is R256 only).
V_STEP_AT_HEAD_DIM_128 = {"lloyd4": "fwht4", "lloyd3": None, "lloyd2": "fwht2"}


@dataclass(frozen=True)
class AdaptivePreset:
    """A parsed ``kv_adaptive`` value: its canonical ``spec`` and ``steps`` ((side, mode)
    pairs in order; empty for ``off``)."""

    spec: str
    steps: tuple[tuple[str, str], ...]

    def steps_at(self, head_dim: int) -> tuple[tuple[str, str], ...]:
        """The steps for a model of ``head_dim``: as given at 256; at 128 each V step takes
        the fwht V mode of its width (:data:`V_STEP_AT_HEAD_DIM_128`)."""
        if head_dim != 128:
            return self.steps
        out = []
        for side, mode in self.steps:
            step = V_STEP_AT_HEAD_DIM_128[mode] if side == "v" else mode
            if step is not None:
                out.append((side, step))
        return tuple(out)

    def tiers_at(self, head_dim: int) -> list[tuple[str, str]]:
        """(K, V) of the start tier and after each step, for a model of ``head_dim``."""
        out = [START_TIER]
        for side, mode in self.steps_at(head_dim):
            k, v = out[-1]
            out.append((mode, v) if side == "k" else (k, mode))
        return out

    @property
    def tiers(self) -> list[tuple[str, str]]:
        """(K, V) of the start tier and after each step (head_dim 256)."""
        return self.tiers_at(256)

    @property
    def floor(self) -> tuple[str, str]:
        return self.tiers[-1]


def parse_adaptive(value: str) -> AdaptivePreset:
    """``off``, a preset name or ``advanced:k=<fwht4|fwht2>,v=<q8|lloyd4|lloyd3|lloyd2>``;
    ``InvalidArgument`` naming the accepted values otherwise."""
    if not isinstance(value, str):
        raise InvalidArgumentType(f"kv_adaptive {value!r}: expected a string (a preset name "
                                  f"or advanced:k=...,v=...), got {type(value).__name__}")
    text = value.strip().lower()
    if text == "off":
        return AdaptivePreset("off", ())
    if text in PRESETS:
        return AdaptivePreset(text, PRESETS[text])
    accepted = ("off, conservative, balanced, aggressive or "
                "advanced:k=<fwht4|fwht2>,v=<q8|lloyd4|lloyd3|lloyd2>")
    if not text.startswith("advanced:"):
        raise InvalidArgument(f"kv_adaptive {value!r}: expected {accepted}")
    fields = {}
    for part in text[len("advanced:"):].split(","):
        key, eq, val = part.partition("=")
        key = key.strip()
        if not eq or key not in ("k", "v") or key in fields:
            raise InvalidArgument(f"kv_adaptive {value!r}: expected {accepted}")
        fields[key] = val.strip()
    if set(fields) != {"k", "v"}:
        raise InvalidArgument(f"kv_adaptive {value!r}: name both floors, k= and v= ({accepted})")
    k, v = fields["k"], fields["v"]
    if k == "fwht3":
        raise InvalidArgument(f"kv_adaptive {value!r}: k=fwht3 would need an R128 -> R256 "
                              f"re-rotating transcode; use k=fwht4 or k=fwht2")
    if k not in ("fwht4", "fwht2") or v not in _V_ORDER:
        raise InvalidArgument(f"kv_adaptive {value!r}: expected {accepted}")
    if (k, v) == START_TIER:
        raise InvalidArgument(f"kv_adaptive {value!r}: a floor of k=fwht4,v=q8 is the start "
                              f"tier, so no step would ever run; for a fixed fwht4/q8 cache "
                              f"set kv_adaptive=off with K mode fwht4 (V q8), else lower "
                              f"k= or v=")
    floor_v = _V_ORDER.index(v)
    steps = tuple((side, mode) for side, mode in PRESETS["balanced"]
                  if (side == "k" and k == "fwht2")
                  or (side == "v" and _V_ORDER.index(mode) <= floor_v))
    return AdaptivePreset(f"advanced:k={k},v={v}", steps)


class KVAdaptivePlan:
    """The tiers of a preset for one model shape: capacities and thresholds in tokens.

    ``max_seq``: the context guaranteed at the floor (tokens); ``num_kv_heads``, ``head_dim``
    (256, or 128 with the fwht V ladder) as the model's; ``block_size``: tokens per pool
    block (1: the contract's token-granular figures). A paged pool holds whole blocks, so
    the budget is ``ceil(max_seq / block_size)`` blocks a sequence at the floor and every
    tier's capacity is rounded down to whole blocks. Ints, not bools
    (:func:`~pagedkv.argument_checks.int_argument`: ``InvalidArgumentType`` otherwise; a
    str or float compared or multiplied into the capacities leaked builtin errors or
    float capacities)."""

    def __init__(self, preset: AdaptivePreset | str, *, head_dim: int, num_kv_heads: int,
                 max_seq: int, block_size: int = 1) -> None:
        if isinstance(preset, AdaptivePreset):
            self.preset = preset
        else:
            self.preset = parse_adaptive(preset)  # InvalidArgumentType for a non-str
        head_dim = int_argument("head_dim", head_dim)
        num_kv_heads = int_argument("num_kv_heads", num_kv_heads, 1)
        max_seq = int_argument("max_seq", max_seq, 1)
        bs = self.block_size = int_argument("block_size", block_size, 1)
        if not self.preset.steps:
            raise InvalidArgument("kv_adaptive is off: there is nothing to plan")
        if head_dim not in (128, 256):
            raise InvalidArgument(f"kv_adaptive needs head_dim 256 (lloyd V) or 128 (fwht V); "
                                  f"this model has {head_dim}")
        self.head_dim, self.num_kv_heads, self.max_seq = head_dim, num_kv_heads, max_seq
        if head_dim == 128 and self.preset.floor[1] == "lloyd3":
            raise InvalidArgument(f"kv_adaptive {self.preset.spec!r}: a 3-bit V floor has no "
                                  f"head_dim 128 mode (fwht3 is head_dim 256 only); use v=lloyd4 "
                                  f"or v=lloyd2 (fwht4 / fwht2 V at head_dim 128)")
        self.tiers = self.preset.tiers_at(head_dim)
        if len(self.tiers) < 2:
            raise InvalidArgument(f"kv_adaptive {self.preset.spec!r} at head_dim {head_dim}: "
                                  f"no step is left (lloyd3 has no head_dim 128 V mode)")
        self.bytes_per_head = [side_row_bytes(k, head_dim) + side_row_bytes(v, head_dim)
                               for k, v in self.tiers]
        #: bytes per layer and sequence: max_seq tokens at the floor, in whole blocks
        self.budget_bytes = -(-max_seq // bs) * bs * num_kv_heads * self.bytes_per_head[-1]
        #: tokens a sequence holds at each tier: the budget's whole blocks of that tier (a
        #: token count the pool cannot hold would pass the step and fail the append)
        self.caps = [self.budget_bytes // (bs * num_kv_heads * b) * bs
                     for b in self.bytes_per_head]
        #: threshold[i]: the step from tier i to i + 1 applies past this many tokens
        self.thresholds = [c - THRESHOLD_MARGIN_TOKENS for c in self.caps[:-1]]

    def __repr__(self) -> str:
        tiers = " -> ".join(f"{join_kv_dtype(k, v)}({c})" for (k, v), c in
                            zip(self.tiers, self.caps, strict=True))
        return f"KVAdaptivePlan({self.preset.spec}: {tiers} tokens)"

    def kv_dtype(self, tier: int) -> str:
        return join_kv_dtype(*self.tiers[tier])

    def tier_before_append(self, tier: int, seq_pos: int, n: int) -> int:
        """The tier to be at before appending ``n`` tokens at ``seq_pos``: steps apply while
        ``seq_pos + n`` is past the next threshold. ``seq_pos`` and ``n``: ints >= 0."""
        seq_pos = int_argument("seq_pos", seq_pos)
        n = int_argument("n", n)
        while tier < len(self.thresholds) and seq_pos + n > self.thresholds[tier]:
            tier += 1
        return tier


def _check_pool_and_allocator(plan: KVAdaptivePlan, pool, allocator) -> None:
    """``InvalidArgument`` unless ``pool`` has the plan's shape and ``allocator`` agrees with
    it (what the adapter checks), and a pool with fixed regions may hold the blocks its
    regions hold at the floor. A pool of another head_dim, head count or block size made
    every capacity wrong (or failed only at a step), and an allocator that could not grow
    with the regions stayed behind the pool silently (``grow_by`` caps)."""
    from pagedkv.allocator import BlockAllocator
    from pagedkv.pool import LayerKVPool
    if not isinstance(pool, LayerKVPool):
        raise InvalidArgumentType(f"pool: expected a LayerKVPool, got {type(pool).__name__}")
    if not isinstance(allocator, BlockAllocator):
        raise InvalidArgumentType(f"allocator: expected a BlockAllocator, got "
                                  f"{type(allocator).__name__}")
    g = pool.geometry
    for name, have, want in (("head_dim", g.head_dim, plan.head_dim),
                             ("num_kv_heads", g.num_kv_heads, plan.num_kv_heads),
                             ("block_size", g.block_size, plan.block_size)):
        if have != want:
            raise InvalidArgument(f"pool.geometry.{name} = {have} differs from the plan's "
                                  f"{name} = {want}: build the KVAdaptivePlan with the "
                                  f"pool's {name} (KVAdaptive.create builds both)")
    for name in ("block_size", "num_blocks", "max_num_blocks"):
        if getattr(allocator, name) != getattr(pool, name):
            raise InvalidArgument(f"allocator.{name} = {getattr(allocator, name)} differs "
                                  f"from pool.{name} = {getattr(pool, name)}: build both "
                                  f"with the same sizes")
    region = pool.layer_region_bytes
    if region is not None:
        floor = region // (g.block_size * g.num_kv_heads * plan.bytes_per_head[-1])
        if pool.max_num_blocks < floor:
            raise InvalidArgument(f"max_num_blocks = {pool.max_num_blocks}: the pool's layer "
                                  f"regions hold {floor} blocks at the floor "
                                  f"{plan.kv_dtype(len(plan.tiers) - 1)}, and the steps add "
                                  f"them to the pool and the allocator; build both with "
                                  f"max_num_blocks={floor}")


class KVAdaptive:
    """kv_adaptive over one paged pool and its allocator: :meth:`before_append` transcodes
    the pool tier by tier. Build one with :meth:`create` (pool regions sized for the floor).
    """

    def __init__(self, plan: KVAdaptivePlan, pool, allocator, *, num_seqs: int = 1) -> None:
        if not isinstance(plan, KVAdaptivePlan):
            raise InvalidArgumentType(f"plan: expected a KVAdaptivePlan, got "
                                      f"{type(plan).__name__}")
        self.num_seqs = int_argument("num_seqs", num_seqs, 1)
        _check_pool_and_allocator(plan, pool, allocator)
        self.plan = plan
        self.pool = pool
        self.allocator = allocator
        tiers = [i for i in range(len(plan.tiers)) if plan.kv_dtype(i) == pool.geometry.dtype]
        if not tiers:
            raise InvalidArgument(f"pool dtype {pool.geometry.dtype!r} is no tier of "
                                  f"{plan!r}")
        self.tier: int = tiers[0]
        self._listeners: list[Callable[[str, str], None]] = []

    @classmethod
    def create(cls, preset: AdaptivePreset | str, *, num_layers: int, num_kv_heads: int,
               head_dim: int, block_size: int, max_seq: int, num_seqs: int = 1,
               hash_seed: int | None = None) -> KVAdaptive:
        """A NumPy pool at the start tier whose layer regions hold ``num_seqs`` sequences of
        ``max_seq`` tokens at the floor, its allocator, and the controller."""
        from pagedkv.allocator import BlockAllocator
        from pagedkv.pool import LayerKVPool, PoolGeometry
        plan = KVAdaptivePlan(preset, head_dim=head_dim, num_kv_heads=num_kv_heads,
                              max_seq=max_seq, block_size=block_size)
        num_seqs = int_argument("num_seqs", num_seqs, 1)  # sizes the regions below
        geometry = PoolGeometry(num_layers, num_kv_heads, head_dim, block_size, plan.kv_dtype(0))
        region = num_seqs * plan.budget_bytes
        per_block = geometry.k_slab_bytes + geometry.v_slab_bytes
        blocks = region // per_block
        if blocks < 1:
            raise InvalidArgument(f"max_seq={max_seq}: the floor budget ({region} bytes per "
                                  f"layer) holds no {block_size}-token block at "
                                  f"{plan.kv_dtype(0)}")
        floor_blocks = region // (block_size * num_kv_heads * plan.bytes_per_head[-1])
        # max_num_blocks: what the regions hold at the floor (the adapter checks that pool
        # and allocator agree); transcoding, not growth, gets the pool there.
        pool = LayerKVPool(geometry, blocks, floor_blocks, layer_region_bytes=region)
        allocator = BlockAllocator(blocks, floor_blocks, block_size, hash_seed=hash_seed)
        return cls(plan, pool, allocator, num_seqs=num_seqs)

    def __repr__(self) -> str:
        return (f"KVAdaptive(tier={self.tier} {self.kv_dtype!r}, blocks="
                f"{self.pool.num_blocks}, {self.plan!r})")

    @property
    def kv_dtype(self) -> str:
        return self.plan.kv_dtype(self.tier)

    def add_listener(self, fn: Callable[[str, str], None]) -> None:
        """Call ``fn(old_kv_dtype, new_kv_dtype)`` after every step (rebuild what baked the
        old mode: attention objects, captured graphs). A listener that raises is logged
        (ERROR); the step stays committed and the other listeners and steps still run."""
        self._listeners.append(fn)

    def before_append(self, seq_pos: int, n: int) -> list[str]:
        """Apply the steps ``n`` more tokens at ``seq_pos`` need; returns the KV dtypes
        stepped to (in order). ``CapacityExceeded`` when even the floor cannot hold them,
        raised before any step (the pool stays at its tier); ``PoolExhausted`` when a step's
        new generation does not fit the memory budget or memory (that step changed nothing;
        earlier steps of the call stay)."""
        from pagedkv.pool import growth_lock
        target = self.plan.tier_before_append(self.tier, seq_pos, n)  # checks seq_pos, n
        if seq_pos + n > self.plan.caps[target]:
            # Refused before any step: a step is a lossy, irreversible transcode of every
            # block, so an append that cannot fit even at the tier it would reach must not
            # leave the pool (and every other sequence in it) at that tier.
            raise CapacityExceeded(
                f"context_length_exceeded: {seq_pos + n} tokens do not fit "
                f"{self.plan.kv_dtype(target)} ({self.plan.caps[target]} tokens at the "
                f"{'floor' if target == len(self.plan.tiers) - 1 else 'current tier'}) of "
                f"kv_adaptive {self.plan.preset.spec} with max_seq={self.plan.max_seq}; "
                f"nothing was transcoded")
        applied = []
        while self.tier < target:
            old = self.kv_dtype
            new = self.plan.kv_dtype(self.tier + 1)
            with growth_lock():
                before = self.pool.num_blocks
                self.pool.transcode(new)
                if self.pool.num_blocks > before:
                    self.allocator.grow_by(self.pool.num_blocks - before)
            self.tier += 1
            applied.append(new)
            logger.info("kv_adaptive %s: %s -> %s at %d tokens (+%d), %d blocks",
                        self.plan.preset.spec, old, new, seq_pos, n, self.pool.num_blocks)
            for fn in tuple(self._listeners):
                # The step is committed: a failing listener must neither skip the others
                # (one left on the old mode would read the new records as old ones) nor
                # the remaining steps. Logged, like the pool's grow callbacks.
                try:
                    fn(old, new)
                except Exception:
                    logger.exception("kv_adaptive listener %r failed after %s -> %s", fn,
                                     old, new)
        return applied

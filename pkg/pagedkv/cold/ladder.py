"""Which prefix boundaries get state checkpoints, and which checkpoints survive
(docs/cold.md, "Ladders and retention").

Pure functions over ints and NumPy arrays, no I/O: the hot in-memory checkpoint store and
the cold sidecar capture both call them, so the boundaries a prefill splits at, the ones
it keeps and the one a capture anchors on are decided in one place.

* GDN-style recurrent state (valid only at the exact boundary it was produced at): the
  prompt-anchored **ladder** — the last block boundary below the prompt end, then
  block-aligned quarters of it — the prefill splits it implies, and the retention caps and
  victim orders of the checkpoint store (``PreLadder`` without a cold policy, ``Ladder``
  with one).
* Sliding-window state: the **anchor grid** ``bs * 4**k`` pinned at token 0, the decode
  cadence, the memory budget and ``base_limit`` (``PAGEDKV_SLIDING_CHECKPOINT_LIMIT``), and
  the sliding victim orders.

Entries handed to the retention functions are listed in publish order (index 0 = oldest);
lineage is a boolean ``ancestry`` matrix (``ancestry[i, j]``: entry ``i``'s tokens are a
strict prefix of entry ``j``'s), which :func:`lineage_ancestry` builds from per-entry chain
hashes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "GDN_LADDER_RATIO",
    "GDN_LADDER_RUNGS",
    "SLIDING_ANCHOR_MAX_RUNGS",
    "SLIDING_BYTES_PER_ELEMENT",
    "SLIDING_LADDER_BUDGET_BYTES",
    "SLIDING_PROTECTED_ENTRIES",
    "LadderRetention",
    "RetentionCaps",
    "SlidingCheckpointBudget",
    "SlidingRetention",
    "VictimOrder",
    "gdn_checkpoint_target",
    "gdn_ladder_rungs",
    "gdn_retention_caps",
    "gdn_retention_victims",
    "lineage_ancestry",
    "prefill_checkpoint_boundaries",
    "prefill_ranges",
    "sliding_anchor_rungs",
    "sliding_base_limit",
    "sliding_checkpoint_budget",
    "sliding_checkpoint_due",
    "sliding_decode_cadence",
    "sliding_full_window_bytes",
    "sliding_prefill_checkpoints",
    "sliding_retention_victims",
]

#: Rungs of one GDN ladder, and the ratio between neighbouring rungs.
GDN_LADDER_RUNGS = 4
GDN_LADDER_RATIO = 4
#: Rungs of the sliding anchor grid (``bs * 4**k`` for ``k = 1..4``).
SLIDING_ANCHOR_MAX_RUNGS = 4
#: Ceiling on the summed cost of retained sliding checkpoints, bytes.
SLIDING_LADDER_BUDGET_BYTES = 3 << 30
#: Conservative bytes per element the sliding budget assumes (bf16 state costs half).
SLIDING_BYTES_PER_ELEMENT = 4
#: Image prompt-boundary sliding entries protected from eviction, at most.
SLIDING_PROTECTED_ENTRIES = 2


# --- GDN ladder and prefill splits --------------------------------------------------------

def gdn_checkpoint_target(n_tokens: int, cached_tokens: int, block_size: int) -> int | None:
    """The last block boundary strictly below the prompt end, ``((n - 1) // bs) * bs``, or
    ``None`` when it is not past ``cached_tokens`` (tokens). (37, 0, 16) → 32;
    (32, 0, 16) → 16; (37, 32, 16) → ``None``."""
    n = int_argument("n_tokens", n_tokens)
    cached = int_argument("cached_tokens", cached_tokens)
    bs = int_argument("block_size", block_size, 1)
    if n == 0:
        return None
    target = ((n - 1) // bs) * bs
    return target if target > cached else None


def gdn_ladder_rungs(n_tokens: int, cached_tokens: int, block_size: int) -> list[int]:
    """The GDN checkpoint ladder of one prefill, ascending (tokens): the target, then
    ``next = ((rung // 4) // bs) * bs`` until 4 rungs or ``next`` is 0, ``<= cached`` or
    not below the rung. (1400, 0, 16) → ``[16, 80, 336, 1392]``;
    (4096, 240, 16) → ``[1008, 4080]``."""
    bs = int_argument("block_size", block_size, 1)
    cached = int_argument("cached_tokens", cached_tokens)
    rung = gdn_checkpoint_target(n_tokens, cached, bs)
    if rung is None:
        return []
    rungs = [rung]
    while len(rungs) < GDN_LADDER_RUNGS:
        nxt = ((rung // GDN_LADDER_RATIO) // bs) * bs
        if nxt == 0 or nxt <= cached or nxt >= rung:
            break
        rungs.append(nxt)
        rung = nxt
    return rungs[::-1]


def prefill_checkpoint_boundaries(n_tokens: int, cached_tokens: int, block_size: int, *,
                                  want_ladder: bool) -> list[int]:
    """Where a GDN prefill must split so a checkpoint exists there (tokens, ascending).

    ``want_ladder`` (a GDN cold policy is attached): every ladder rung. Without one only the
    target, so persist-off chunking stays exactly what it was before ladders existed:
    1400 tokens at bs 16 split at ``[1392]`` only.
    """
    if want_ladder:
        return gdn_ladder_rungs(n_tokens, cached_tokens, block_size)
    target = gdn_checkpoint_target(n_tokens, cached_tokens, block_size)
    return [] if target is None else [target]


def prefill_ranges(n_tokens: int, chunk_tokens: int | None, boundaries: Sequence[int], *,
                   start: int = 0) -> list[tuple[int, int]]:
    """Token ranges ``[a, b)`` a prefill of ``[start, n_tokens)`` forwards: each ends at the
    next boundary, at ``chunk_tokens`` after its start (``None`` or 0: no chunking), or at
    the end, whichever comes first; a chunk restarts after every split.
    ``prefill_ranges(1400, 2048, [1392])`` → ``[(0, 1392), (1392, 1400)]``."""
    n = int_argument("n_tokens", n_tokens)
    s = int_argument("start", start)
    chunk = 0 if chunk_tokens is None else int_argument("chunk_tokens", chunk_tokens)
    if s > n:
        raise InvalidArgument(f"start = {s} is past n_tokens = {n}")
    cuts = sorted({int_argument("boundary", b) for b in boundaries if s < b < n})
    out: list[tuple[int, int]] = []
    pos, k = s, 0
    while pos < n:
        end = n if chunk == 0 else min(n, pos + chunk)
        while k < len(cuts) and cuts[k] <= pos:
            k += 1
        if k < len(cuts) and cuts[k] < end:
            end = cuts[k]
        out.append((pos, end))
        pos = end
    return out


# --- retention caps and victim orders (GDN) -------------------------------------------------

class VictimOrder(enum.Enum):
    """Which checkpoint a full store gives up (docs/cold.md, "Retention")."""

    PRE_LADDER = "pre_ladder"  # first same-owner ancestor in publish order
    LADDER = "ladder"          # smallest next-deeper / own length ratio, publisher deferred


@dataclass(frozen=True)
class RetentionCaps:
    """Caps of a GDN checkpoint store: entries overall, entries per owner, and the order."""

    global_cap: int
    per_owner_cap: int
    order: VictimOrder

    def __post_init__(self) -> None:
        int_argument("global_cap", self.global_cap, 1)
        int_argument("per_owner_cap", self.per_owner_cap, 1)
        if not isinstance(self.order, VictimOrder):
            raise InvalidArgumentType(f"order must be a VictimOrder, got {self.order!r}")


def gdn_retention_caps(want_ladder: bool, explicit_root: bool) -> RetentionCaps:
    """Caps and victim order from one predicate pair (the table of docs/cold.md): without a
    ladder 2/2 (5/2 with an explicitly named root), PreLadder; with one 4/4 (5/4), Ladder.
    Persist-off keeps PreLadder on purpose: which entry survives decides checkpoint-install
    versus replay, and those emit different tokens."""
    if want_ladder:
        return RetentionCaps(5 if explicit_root else 4, 4, VictimOrder.LADDER)
    return RetentionCaps(5 if explicit_root else 2, 2, VictimOrder.PRE_LADDER)


def lineage_ancestry(chains: Sequence[np.ndarray]) -> np.ndarray:
    """``bool[n, n]``: ``[i, j]`` iff entry ``i`` is a strict prefix of entry ``j``.

    ``chains[i]`` is entry ``i``'s chain of per-block hashes (``uint64``, one per full block
    of its prefix, each hash binding its parent, as ``BlockAllocator.chain_hashes`` makes
    them): ``i`` is an ancestor of ``j`` iff ``j``'s chain is longer and holds ``i``'s last
    hash at ``i``'s last index. An empty chain (a zero-length entry) is nobody's ancestor.
    """
    arrs = [np.asarray(c, dtype=np.uint64).reshape(-1) for c in chains]
    n = len(arrs)
    out = np.zeros((n, n), dtype=np.bool_)
    for i, ci in enumerate(arrs):
        if not len(ci):
            continue
        last, k = ci[-1], len(ci) - 1
        for j, cj in enumerate(arrs):
            if len(cj) > len(ci) and cj[k] == last:
                out[i, j] = True
    return out


def _ancestry(ancestry, n: int) -> np.ndarray:
    a = np.asarray(ancestry)
    if a.dtype != np.bool_ or a.shape != (n, n):
        raise InvalidArgument(f"ancestry must be bool[{n}, {n}] (lineage_ancestry's result), "
                              f"got {a.dtype}{a.shape}")
    return a


def _entries(lengths, name: str = "lengths") -> np.ndarray:
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"{name} must be a 1-D integer array, got {arr.dtype}{arr.shape}")
    if arr.size and int(arr.min()) < 0:
        raise InvalidArgument(f"{name} must be >= 0")
    return arr.astype(np.int64)


class _GdnStore:
    """Working state of one prune: which entries are still alive."""

    def __init__(self, owners, lengths, ancestry, last_used) -> None:
        self.owners = owners
        self.lengths = lengths
        n = len(lengths)
        same = owners[:, None] == owners[None, :]
        self.lineage = ancestry & same  # redundancy is judged within one owner's entries
        self.last_used = last_used
        self.alive = np.ones(n, dtype=np.bool_)

    def live(self, predicate=None) -> list[int]:
        return [i for i in np.flatnonzero(self.alive).tolist()
                if predicate is None or predicate(i)]

    def next_deeper(self, i: int) -> int | None:
        deeper = np.flatnonzero(self.lineage[i] & self.alive)
        if not len(deeper):
            return None
        return int(self.lengths[deeper].min())

    def ratio_victim(self, candidates: list[int]) -> int | None:
        """Smallest next-deeper / own length; ties → the deeper entry, then least recent."""
        best, best_key = None, None
        for i in candidates:
            nxt = self.next_deeper(i)
            if nxt is None or self.lengths[i] == 0:
                continue
            key = (Fraction(nxt, int(self.lengths[i])), -int(self.lengths[i]),
                   int(self.last_used[i]))
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def first_ancestor(self, candidates: list[int]) -> int | None:
        for i in candidates:
            if self.next_deeper(i) is not None:
                return i
        return None

    def oldest_of_multi(self, candidates: list[int]) -> int | None:
        """The oldest candidate whose owner holds more than one live entry."""
        counts: dict[int, int] = {}
        for i in self.live():
            o = int(self.owners[i])
            counts[o] = counts.get(o, 0) + 1
        for i in candidates:
            if counts[int(self.owners[i])] > 1:
                return i
        return None


def gdn_retention_victims(owners, lengths, ancestry, *, publisher: int, caps: RetentionCaps,
                          root_owner: int | None = None, last_used=None) -> list[int]:
    """Entries to evict after ``publisher`` pushed a rung, in eviction order (indices).

    ``owners`` (``int[n]``), ``lengths`` (tokens, ``int[n]``) and ``ancestry``
    (:func:`lineage_ancestry`) describe the store in publish order (index 0 oldest);
    ``last_used`` (``int[n]``, larger = more recent; default: publish order) breaks ratio
    ties. Call it after **every** rung push.

    Per-owner cap first, over the publisher's entries: Ladder removes the entry with the
    smallest next-deeper / own length ratio (same owner, same lineage; ties → deeper, then
    least recent); PreLadder the first such ancestor in publish order; neither → the
    owner's oldest. Then the global cap: Ladder takes a ratio victim among other owners,
    else the oldest entry of another owner holding > 1, else both searches over everyone;
    PreLadder takes the first ancestor anywhere, else the oldest entry of an owner holding
    > 1. Last resort (one entry per owner): the oldest non-root entry, else the oldest.
    """
    if not isinstance(caps, RetentionCaps):
        raise InvalidArgumentType(f"caps must be a RetentionCaps, got {type(caps).__name__}")
    lens = _entries(lengths)
    n = len(lens)
    own = _entries(owners, "owners")
    if len(own) != n:
        raise InvalidArgument(f"owners has {len(own)} entries, lengths {n}")
    used = np.arange(n, dtype=np.int64) if last_used is None else _entries(last_used,
                                                                          "last_used")
    if len(used) != n:
        raise InvalidArgument(f"last_used has {len(used)} entries, lengths {n}")
    store = _GdnStore(own, lens, _ancestry(ancestry, n), used)
    ladder = caps.order is VictimOrder.LADDER
    victims: list[int] = []

    def evict(i: int) -> None:
        store.alive[i] = False
        victims.append(i)

    def mine(i: int) -> bool:
        return int(own[i]) == publisher

    while len(store.live(mine)) > caps.per_owner_cap:
        cands = store.live(mine)
        v = store.ratio_victim(cands) if ladder else store.first_ancestor(cands)
        evict(cands[0] if v is None else v)
    while int(store.alive.sum()) > caps.global_cap:
        everyone = store.live()
        if ladder:
            others = store.live(lambda i: not mine(i))
            v = store.ratio_victim(others)
            if v is None:
                v = store.oldest_of_multi(others)
            if v is None:
                v = store.ratio_victim(everyone)
            if v is None:
                v = store.oldest_of_multi(everyone)
        else:
            v = store.first_ancestor(everyone)
            if v is None:
                v = store.oldest_of_multi(everyone)
        if v is None:
            non_root = [i for i in everyone if root_owner is None or int(own[i]) != root_owner]
            v = non_root[0] if non_root else everyone[0]
        evict(v)
    return victims


@dataclass(frozen=True)
class LadderRetention:
    """The GDN victim orders as the retention of a hot checkpoint store
    (``pagedkv.coordinator.StateCheckpointStore(..., retention=LadderRetention(caps))``):
    after every publish, :func:`gdn_retention_victims` over the store's entries, their
    owners and their lineage (:func:`lineage_ancestry` of the entries' chain hashes).
    ``root_owner``: the store's owner id of an explicitly named root (kept last)."""

    caps: RetentionCaps
    root_owner: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.caps, RetentionCaps):
            raise InvalidArgumentType(f"caps must be a RetentionCaps, got {self.caps!r}")

    @classmethod
    def for_store(cls, *, want_ladder: bool, explicit_root: bool = False,
                  root_owner: int | None = None) -> LadderRetention:
        """The caps of :func:`gdn_retention_caps` (a persisting store: ``want_ladder``)."""
        return cls(gdn_retention_caps(want_ladder, explicit_root), root_owner)

    def __call__(self, owners, lengths, chains, *, publisher: int, last_used=None
                 ) -> list[int]:
        return gdn_retention_victims(owners, lengths, lineage_ancestry(chains),
                                     publisher=publisher, caps=self.caps,
                                     root_owner=self.root_owner, last_used=last_used)

    def __repr__(self) -> str:
        c = self.caps
        return f"LadderRetention({c.order.value}, global {c.global_cap}, per owner {c.per_owner_cap})"


# --- sliding anchor grid, cadence and budget ------------------------------------------------

def sliding_anchor_rungs(block_size: int) -> tuple[int, ...]:
    """The anchor grid ``bs * 4**k`` for ``k = 1..4``, pinned at token 0 so one sidecar
    object serves every later prompt sharing that prefix: (64, 256, 1024, 4096) at bs 16."""
    bs = int_argument("block_size", block_size, 1)
    return tuple(bs * 4 ** k for k in range(1, SLIDING_ANCHOR_MAX_RUNGS + 1))


def sliding_decode_cadence(window: int, block_size: int) -> int:
    """Decode checkpoint cadence, tokens: ``ceil(max(window, bs) / bs) * bs``."""
    w = int_argument("window", window, 1)
    bs = int_argument("block_size", block_size, 1)
    return -(-max(w, bs) // bs) * bs


def sliding_checkpoint_due(position: int, window: int, block_size: int, *,
                           persist: bool, rungs: Sequence[int] | None = None) -> bool:
    """Whether a decode step that reaches ``position`` tokens publishes a sliding checkpoint:
    at the window cadence, or (persist turns only) at an anchor rung (``rungs``: the
    admitted ones, default the whole grid). Without the rungs a short prompt with a long
    generation would never produce the sub-window rungs."""
    p = int_argument("position", position)
    if p == 0:
        return False
    if p % sliding_decode_cadence(window, block_size) == 0:
        return True
    if not persist:
        return False
    grid = sliding_anchor_rungs(block_size) if rungs is None else rungs
    return p in grid


def sliding_prefill_checkpoints(start: int, end: int, window: int, block_size: int, *,
                                persist: bool, rungs: Sequence[int] | None = None
                                ) -> list[int]:
    """Boundaries in ``(start, end]`` a prefill chunk walk publishes (ascending, tokens):
    the decode cadence, plus the anchor rungs on persist turns (:func:`sliding_checkpoint_due`
    at every block boundary)."""
    s = int_argument("start", start)
    e = int_argument("end", end)
    bs = int_argument("block_size", block_size, 1)
    first = (s // bs + 1) * bs
    return [b for b in range(first, e + 1, bs)
            if sliding_checkpoint_due(b, window, bs, persist=persist, rungs=rungs)]


def sliding_full_window_bytes(sliding_layers: int, window: int, kv_heads: int,
                              head_dim: int) -> int:
    """``sliding_layers * window * kv_heads * head_dim * 2 (K, V) * 4`` bytes: one full
    window of every physical sliding layer at the conservative 4 bytes per element."""
    return (int_argument("sliding_layers", sliding_layers, 1) * int_argument("window", window, 1)
            * int_argument("kv_heads", kv_heads, 1) * int_argument("head_dim", head_dim, 1)
            * 2 * SLIDING_BYTES_PER_ELEMENT)


def sliding_base_limit(window: int, block_size: int, full_window_bytes: int,
                       override: int | None = None) -> int:
    """Pre-ladder entry count: ``min(clamp(ceil(window / bs) * 2, 16, 128),
    max(1 GiB // full_window_bytes, 2))``, or ``override`` (``PAGEDKV_SLIDING_CHECKPOINT_LIMIT``,
    see :func:`pagedkv.cold.knobs.sliding_checkpoint_limit_override`)."""
    if override is not None:
        return int_argument("override", override, 1)
    w = int_argument("window", window, 1)
    bs = int_argument("block_size", block_size, 1)
    fwb = int_argument("full_window_bytes", full_window_bytes, 1)
    by_window = min(max(-(-w // bs) * 2, 16), 128)
    return min(by_window, max((1 << 30) // fwb, 2))


@dataclass(frozen=True)
class SlidingCheckpointBudget:
    """Planning figures of one sliding checkpoint store.

    ``rungs``: the admitted anchor rungs (empty unless ``persist``); ``limit``: entries kept
    by count (``base_limit + len(rungs)``); ``order``: Ladder with a cold sidecar, else
    PreLadder. The count is a planning bound: Ladder also evicts while the summed
    :meth:`cost` of retained entries exceeds ``budget_bytes``.
    """

    window: int
    block_size: int
    full_window_bytes: int
    base_limit: int
    rungs: tuple[int, ...]
    persist: bool
    budget_bytes: int = SLIDING_LADDER_BUDGET_BYTES

    @property
    def limit(self) -> int:
        return self.base_limit + len(self.rungs)

    @property
    def order(self) -> VictimOrder:
        return VictimOrder.LADDER if self.persist else VictimOrder.PRE_LADDER

    def cost(self, boundary_tokens: int) -> int:
        """Bytes one checkpoint at ``boundary_tokens`` is charged:
        ``full_window_bytes / window * min(b, window)``."""
        b = int_argument("boundary_tokens", boundary_tokens)
        return self.full_window_bytes * min(b, self.window) // self.window


def sliding_checkpoint_budget(*, window: int, block_size: int, sliding_layers: int,
                              kv_heads: int, head_dim: int, persist: bool,
                              limit_override: int | None = None) -> SlidingCheckpointBudget:
    """The sliding store's budget: ``base_limit``, and on persist turns the anchor rungs
    admitted in ascending order while their cumulative cost fits
    ``3 GiB - full_window_bytes * base_limit`` (at most 4).

    bs 16, window 1024, 40 layers x 8 KV heads x 256: ``full_window_bytes`` 671,088,640,
    ``base_limit`` 2, all four rungs admitted, limit 6.
    """
    fwb = sliding_full_window_bytes(sliding_layers, window, kv_heads, head_dim)
    base = sliding_base_limit(window, block_size, fwb, limit_override)
    admitted: list[int] = []
    if persist:
        room = SLIDING_LADDER_BUDGET_BYTES - fwb * base
        spent = 0
        for rung in sliding_anchor_rungs(block_size):
            c = fwb * min(rung, window) // window
            if spent + c > room:
                break
            spent += c
            admitted.append(rung)
    return SlidingCheckpointBudget(int(window), int(block_size), fwb, base, tuple(admitted),
                                   bool(persist))


def sliding_retention_victims(lengths, ancestry, budget: SlidingCheckpointBudget, *,
                              protected=None) -> list[int]:
    """Entries to evict after the newest (the last index) was published, in order.

    PreLadder (no cold tier): while more than ``base_limit`` entries, the oldest entry
    that is not protected; count only. Ladder: while more than ``budget.limit`` entries,
    (1) the oldest non-rung entry, (2) the oldest rung that is not a strict ancestor of the
    newest entry, (3) the deepest rung, (4) the first unprotected entry — the newest is
    never a candidate; then, while more than one entry remains and the summed cost exceeds
    the byte budget, evict again in the same order.

    ``protected`` (``bool[n]``): image prompt-boundary entries; only the
    ``SLIDING_PROTECTED_ENTRIES`` (2) most recent of them are protected.
    """
    if not isinstance(budget, SlidingCheckpointBudget):
        raise InvalidArgumentType(
            f"budget must be a SlidingCheckpointBudget, got {type(budget).__name__}")
    lens = _entries(lengths)
    n = len(lens)
    anc = _ancestry(ancestry, n)
    prot = np.zeros(n, np.bool_) if protected is None else np.asarray(protected, np.bool_)
    if prot.shape != (n,):
        raise InvalidArgument(f"protected must be bool[{n}], got shape {prot.shape}")
    keep = np.flatnonzero(prot)[-SLIDING_PROTECTED_ENTRIES:]
    prot = np.zeros(n, np.bool_)
    prot[keep] = True
    alive = np.ones(n, np.bool_)
    victims: list[int] = []
    if n == 0:
        return victims
    newest = n - 1

    def evict(i: int) -> None:
        alive[i] = False
        victims.append(i)

    if budget.order is VictimOrder.PRE_LADDER:
        while int(alive.sum()) > budget.base_limit:
            cands = [i for i in range(n) if alive[i] and not prot[i]]
            if not cands:
                break
            evict(cands[0])
        return victims

    rung = np.isin(lens, np.asarray(budget.rungs, dtype=np.int64))

    def ladder_victim() -> int | None:
        cands = [i for i in range(n) if alive[i] and not prot[i] and i != newest]
        for i in cands:                                   # (1) oldest non-rung
            if not rung[i]:
                return i
        for i in cands:                                   # (2) rung off the newest lineage
            if rung[i] and not anc[i, newest]:
                return i
        rungs = [i for i in cands if rung[i]]             # (3) deepest rung
        if rungs:
            return max(rungs, key=lambda i: (int(lens[i]), -i))
        return cands[0] if cands else None                # (4) first unprotected

    while int(alive.sum()) > budget.limit:
        v = ladder_victim()
        if v is None:
            break
        evict(v)
    while int(alive.sum()) > 1 and sum(budget.cost(int(lens[i])) for i in range(n)
                                      if alive[i]) > budget.budget_bytes:
        v = ladder_victim()
        if v is None:
            break
        evict(v)
    return victims


@dataclass(frozen=True)
class SlidingRetention:
    """The sliding victim orders as the retention of a hot checkpoint store of sliding
    window snapshots (``StateCheckpointStore(..., retention=SlidingRetention(budget))``):
    after every publish, :func:`sliding_retention_victims` over the entries' boundaries and
    lineage (:func:`lineage_ancestry` of their chain hashes), the newest last."""

    budget: SlidingCheckpointBudget

    def __post_init__(self) -> None:
        if not isinstance(self.budget, SlidingCheckpointBudget):
            raise InvalidArgumentType(
                f"budget must be a SlidingCheckpointBudget, got {self.budget!r}")

    def __call__(self, owners, lengths, chains, *, publisher: int, last_used=None
                 ) -> list[int]:
        return sliding_retention_victims(lengths, lineage_ancestry(chains), self.budget)

    def __repr__(self) -> str:
        b = self.budget
        return f"SlidingRetention({b.order.value}, limit {b.limit}, rungs {list(b.rungs)})"

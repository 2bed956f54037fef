"""pagedkv as the prompt cache of mlx-lm's hybrid models (issue 12, hybrid phase).

Sliding-window models (gemma3_text, gpt_oss, gemma4_text with KV-shared layers): every step's
full-vocabulary logprobs are compared *byte for byte* with mlx-lm's own forward of the whole
sequence without a cache (mlx-lm's ``RotatingKVCache`` is not bit-exact: its decode step
returns keys in ring order), and the greedy tokens with mlx-lm's ``RotatingKVCache``.
Recurrent hybrids (qwen3_next, qwen3_5): bytes equal to mlx-lm's own caches
(``ArraysCache`` + ``KVCache``) running the whole prompt. Models are mlx-lm architectures
built from tiny config dicts with seeded random weights; nothing is downloaded.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")

from mlx_lm.generate import batch_generate, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from mlx_lm_support import (
    Steps,
    fresh,
    grid,
    laid_out_as_computed,
    model_of,
    on_cpu,
    replayed,
    run,
    toks,
)
from pagedkv.coordinator import expired_blocks
from pagedkv.errors import InvalidArgument, InvalidArgumentType, UnsupportedModel
from pagedkv.integrations.mlx_lm import (
    LayerKind,
    PagedKVLayerCache,
    PagedPromptCache,
    PagedSlidingLayerCache,
    PagedStateLayerCache,
    layer_specs,
)
from pagedkv.integrations.mlx_lm.parity import model_dtype
from pagedkv.integrations.mlx_lm.random_models import random_model, word_tokenizer
from pagedkv.integrations.mlx_lm.sliding_cache import TRIM_MARGIN_TOKENS

BS = 8      # block size: short prompts span several blocks
WINDOW = 8  # every tiny sliding config's window


def uncached(model, prompt, out) -> Steps:
    """What ``run`` must return, from mlx-lm's forward of the whole sequence without a cache:
    the logprobs ``generate_step`` computes from each row that predicted a token of ``out``
    (compared by the parity rule, a different-calls comparison)."""
    seq = list(prompt) + list(out)
    logits = model(mx.array(seq)[None])[0]
    lps = []
    for i in range(len(prompt) - 1, len(seq) - 1):
        row = logits[i:i + 1]
        lps.append(np.array((row - mx.logsumexp(row, keepdims=True)).astype(mx.float32))[0])
    return Steps(out, np.stack(lps).tobytes(), dtype=model_dtype(model), same_calls=False)


def sliding_group(paged):
    (gid,) = [i for i, g in enumerate(paged.groups) if g.kind.is_sliding]
    return gid


# --- sliding window ----------------------------------------------------------------------

SLIDING_CASES = [("gemma3_text", "float32"), ("gemma3_text", "bfloat16"),
                 ("gpt_oss", "float32"), ("gemma4_text", "float32")]


@pytest.mark.parametrize("arch,dtype", SLIDING_CASES)
def test_sliding_models_match_the_uncached_forward_and_rotating_tokens(arch, dtype):
    model = model_of(arch, dtype)
    paged = PagedPromptCache(model, block_size=BS)
    p1 = toks(40, 1)  # five windows

    # A: one prompt, prefilled in chunks past the window: bytes of the uncached forward,
    # tokens of mlx-lm's RotatingKVCache.
    a = paged.begin(p1)
    assert a.cached_tokens == 0
    got_a = run(model, p1, a.cache, n=12, prefill_step_size=16)
    assert got_a == uncached(model, p1, got_a[0])
    assert got_a[0] == fresh(model, p1, n=12)[0]
    held = p1 + got_a[0]
    assert a.end(held) == len(held)

    # B: the next turn continues the parked tables (sliding windows included) exactly.
    p2 = held + toks(9, 2)
    b = paged.begin(p2)
    assert b.cached_tokens == len(held) == 52 and b.hit_tokens == 52
    got_b = run(model, p2[b.cached_tokens:], b.cache)
    assert got_b == uncached(model, p2, got_b[0])
    b.end(p2 + got_b[0])

    # C: a new request sharing 3 blocks with A: every group backs 24 tokens (the full
    # group its blocks, the sliding group the window before 24), equal to a fresh run.
    p3 = p1[:3 * BS] + toks(10, 3)
    c = paged.begin(p3)
    assert c.cached_tokens == 3 * BS
    got_c = run(model, p3[c.cached_tokens:], c.cache)
    assert got_c == uncached(model, p3, got_c[0])
    assert got_c[0] == fresh(model, p3)[0]
    c.release()
    paged.coordinator.check_invariants()
    s = paged.stats()
    assert s["hit_tokens"] == 52 + 24 and s["continued_tokens"] == 52
    assert s["write_through_stops"] == 0


def test_gemma4_kv_shared_layers_are_aliases_of_their_anchors():
    model = model_of("gemma4_text")
    specs = layer_specs(model)
    assert [(s.index, s.kind, s.anchor) for s in specs if s.kind is LayerKind.SHARED] == \
        [(4, LayerKind.SHARED, 2), (5, LayerKind.SHARED, 3)]
    paged = PagedPromptCache(model, block_size=BS)
    routes = {i: paged.coordinator.route_for_layer(i) for i in range(6)}
    assert routes[4].shared_kv_anchor == 2 and routes[5].shared_kv_anchor == 3
    assert (routes[4].group_id, routes[4].physical_layer_ordinal) == \
        (routes[2].group_id, routes[2].physical_layer_ordinal)
    # The sliding layers (head_dim 16) and the full ones (32) have pools of their own; an
    # alias owns no slot.
    dims = sorted((g.kind.is_sliding, g.layout.head_dim, g.physical_layer_indices,
                   g.layer_indices) for g in paged.groups)
    assert dims == [(False, 32, (1, 3), (1, 3, 5)), (True, 16, (0, 2), (0, 2, 4))]
    r = paged.begin(toks(12, 4))
    assert len(r.cache) == 4  # the cache list mlx-lm builds: no entry for shared layers
    with pytest.raises(InvalidArgument, match="alias of layer 2"):
        paged.coordinator.write_kv(r._seq, 4, np.zeros((1, 2, 16), np.float32),
                                   np.zeros((1, 2, 16), np.float32))
    r.release()


def test_sliding_blocks_go_back_to_the_pool_as_the_window_moves():
    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=BS)
    gid = sliding_group(paged)
    lc = paged.coordinator
    p = toks(200, 5)
    r = paged.begin(p)
    seen = []

    def watch(processed, total):
        seen.append((lc.num_tokens(r._seq), lc.first_live_position(r._seq, gid),
                     lc.groups[gid].live_blocks(lc._row(r._seq))))

    out = run(model, p, r.cache, n=40, prefill_step_size=32, prompt_progress_callback=watch)
    assert out == uncached(model, p, out[0])
    # While the prompt was prefilled, every chunk's positions went to the pool and the
    # sliding row kept the window before its cursor only: the rest was freed.
    prefill = [x for x in seen if 0 < x[0] < len(p)]
    assert [x[0] for x in prefill] == [32, 64, 96, 128, 160, 192, 199]
    for n, first, live in prefill:
        assert first == expired_blocks(n, WINDOW, BS) * BS and live == -(-n // BS) - first // BS
    # The dropped blocks were published (cached, evictable) for later requests.
    assert lc.groups[gid].allocator.prefix_cache_len >= expired_blocks(192, WINDOW, BS)
    # The request's sliding buffers hold about one window, not the context.
    layer = r.cache[0]
    assert isinstance(layer, PagedSlidingLayerCache)
    assert layer.keys.shape[2] - (layer.offset - layer.start) < 256
    assert layer.offset - layer.start <= WINDOW + TRIM_MARGIN_TOKENS + 2 * BS + 256
    held = p + out[0]
    r.end(held)
    s = paged.stats()
    full_blocks = -(-len(held) // BS)
    window_blocks = -(-len(held) // BS) - expired_blocks(len(held), WINDOW, BS)
    # Parked: the full group holds every block, the sliding group its last window.
    assert lc.num_table_blocks(r._seq, gid) == full_blocks
    assert lc.groups[gid].live_blocks(lc._row(r._seq)) == window_blocks <= 2
    assert s["parked"] == 1
    lc.check_invariants()


def test_a_long_generation_publishes_the_last_window_only():
    """Past the buffer's retention the generated positions' sliding K/V are gone: end()
    records them without publishing (prune_sliding(publish=False)), then writes the last
    window, so a later request can resume at the end but never reads a block it lacks."""
    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=BS)
    gid = sliding_group(paged)
    lc = paged.coordinator
    p = toks(30, 6)
    r = paged.begin(p)
    out = run(model, p, r.cache, n=340)
    assert out[0] == uncached(model, p, out[0])[0]
    assert r.cache[0].start > len(p)  # the buffer dropped generated positions
    # A rewind past what the sliding buffers hold is refused before any layer changes.
    offsets = [(c.offset, getattr(c, "start", 0)) for c in r.cache]
    with pytest.raises(InvalidArgument, match="rewind at most"):
        trim_prompt_cache(r.cache, offsets[0][0] - 1)
    assert [(c.offset, getattr(c, "start", 0)) for c in r.cache] == offsets
    held = p + out[0]
    r.end(held)
    lc.check_invariants()
    assert paged.release_parked() == 1
    # A new request extending the conversation: every group backs the last full block
    # boundary (its window came from end()), not a boundary inside the generation.
    q = held + toks(5, 7)
    r2 = paged.begin(q)
    assert r2.cached_tokens == len(held) // BS * BS
    got = run(model, q[r2.cached_tokens:], r2.cache)
    assert got == uncached(model, q, got[0])
    r2.release()
    # One that diverges mid-generation: the full group backs it, the sliding group only
    # up to the prompt's published windows.
    q2 = held[:100] + toks(5, 8)
    r3 = paged.begin(q2)
    assert r3.cached_tokens == 24
    got = run(model, q2[r3.cached_tokens:], r3.cache)
    assert got == uncached(model, q2, got[0])
    r3.release()
    assert lc.groups[gid].allocator.prefix_cache_len > 0


def test_fork_trim_and_speculative_decoding_on_a_sliding_model():
    from mlx.utils import tree_map

    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(30, 9)
    r = paged.begin(p)
    out = run(model, p, r.cache)
    fork = copy.deepcopy(r.cache)
    assert fork[0].request is fork[1].request is not r
    more = toks(5, 10)
    got_fork = run(model, more, fork)
    got_orig = run(model, more, r.cache)
    assert got_fork == got_orig == uncached(model, p + out[0] + more, got_orig[0])
    # A rewind works on every layer while the sliding buffers hold the window before it,
    # and the continuation is the uncached forward of the shorter sequence.
    assert trim_prompt_cache(r.cache, 3) == 3
    assert [c.offset for c in r.cache] == [len(p) + 6 + 5 + 6 - 3] * 4
    seq = (p + out[0] + more + got_orig[0])[:-3]
    again = run(model, [7], r.cache, n=3)
    assert again == uncached(model, seq + [7], again[0])
    r.release()
    fork[0].request.end(p + out[0] + more + got_fork[0])

    # Speculative decoding trims rejected drafts: its tokens are greedy decoding's.
    draft = random_model("gemma3_text", seed=0)[0]
    draft.update(tree_map(lambda w: w + 0.02 * mx.random.normal(w.shape, key=mx.random.key(1)),
                          draft.parameters()))
    q = toks(40, 11)
    s = paged.begin(q)
    spec = [(int(t), bool(d)) for t, _, d in speculative_generate_step(
        mx.array(q), model, draft, prompt_cache=s.cache + make_prompt_cache(draft),
        max_tokens=12, num_draft_tokens=3)]
    assert [t for t, _ in spec] == uncached(model, q, [t for t, _ in spec])[0]
    assert 0 < sum(d for _, d in spec) < len(spec)
    n = s.cache[0].offset
    s.end((q + [t for t, _ in spec])[:n])
    paged.coordinator.check_invariants()


def test_speculative_decoding_keeps_trimming_after_the_sliding_buffers_drop_positions():
    """A paged sliding layer stays trimmable (``is_trimmable()``) after its buffer dropped
    positions: mlx-lm's ``trim_prompt_cache``, which speculative decoding rewinds rejected
    drafts with, silently trims nothing when a layer says otherwise. Answering False there,
    as ``RotatingKVCache`` does past its window, made this run diverge from greedy decoding
    at token 55, the step after the buffers' first compaction. (So ``LRUPromptCache``, which
    trims a longer entry by any amount, gets ``InvalidArgument`` instead of a fallback:
    docs/integrations/mlx-lm.md, 'Speculative decoding, LRUPromptCache, trimming'.)"""
    from mlx.utils import tree_map

    model = model_of("gemma3_text")
    draft = random_model("gemma3_text", seed=0)[0]
    draft.update(tree_map(lambda w: w + 0.02 * mx.random.normal(w.shape, key=mx.random.key(1)),
                          draft.parameters()))
    paged = PagedPromptCache(model, block_size=BS)
    q = toks(200, 13)
    s = paged.begin(q)
    spec = [int(t) for t, _, _ in speculative_generate_step(
        mx.array(q), model, draft, prompt_cache=s.cache + make_prompt_cache(draft),
        max_tokens=100, num_draft_tokens=3)]
    assert spec == uncached(model, q, spec)[0]
    assert s.cache[0].start > 0 and all(c.is_trimmable() for c in s.cache)
    s.end((q + spec)[:s.cache[0].offset])


def test_a_trim_within_the_margin_rewinds_every_layer_after_the_buffers_dropped_positions():
    """mlx-lm's ``trim_prompt_cache`` trims layer by layer, and every layer's trim checks
    the whole request first. The rewind is measured from the request's untrimmed offset, so
    a trim within TRIM_MARGIN_TOKENS works on sliding buffers that dropped positions: it was
    refused after the first layer had been trimmed (that layer checked as if it still had
    the whole rewind ahead), leaving the layers at different offsets. A trim the buffers
    cannot serve still changes no layer."""
    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(264, 12)
    r = paged.begin(p)
    for a, b in ((0, 248), (248, 264)):  # the second chunk compacts the sliding buffers
        model(mx.array(p[a:b])[None], cache=r.cache)
        mx.eval([c.state for c in r.cache])
    assert [(c.offset, getattr(c, "start", None)) for c in r.cache] == \
        [(264, 176), (264, None)] * 2
    n = 50
    assert n <= TRIM_MARGIN_TOKENS
    assert trim_prompt_cache(r.cache, n) == n
    assert [c.offset for c in r.cache] == [214] * 4
    got = run(model, [7], r.cache, n=3)
    assert got == uncached(model, p[:214] + [7], got[0])
    with pytest.raises(InvalidArgument, match=r"trim\(100\): sliding layer 0 \(window 8\) "
                       r"holds positions from 176; after the rewind a query at 118 needs them "
                       r"from 111"):
        trim_prompt_cache(r.cache, 100)
    assert [c.offset for c in r.cache] == [218] * 4
    assert r.end(p[:214] + [7] + got[0]) == 218
    paged.coordinator.check_invariants()


def test_a_rewind_after_a_prefix_hit_reaches_the_window_before_the_cached_prefix_only():
    """TRIM_MARGIN_TOKENS counts positions the request computed: a sliding layer gets the
    window before ``cached_tokens`` from the pool, from its block boundary, and no more. A
    rewind back to ``cached_tokens`` always works, one a little further while that window
    holds, and a refusal (20 tokens were refused with 'rewind at most TRIM_MARGIN_TOKENS')
    names the cached prefix and changes no layer."""
    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=16)
    base = toks(200, 14)
    r = paged.begin(base)
    r.end(base + run(model, base, r.cache, n=1)[0])
    p = base[:180] + [7, 8, 9]
    r = paged.begin(p)
    model(mx.array(p[r.cached_tokens:])[None], cache=r.cache)
    assert [(c.offset, getattr(c, "start", None)) for c in r.cache] == \
        [(183, 160), (183, None)] * 2 and r.cached_tokens == 176
    assert trim_prompt_cache(r.cache, 7) == 7  # to cached_tokens
    assert trim_prompt_cache(r.cache, 9) == 9  # to 167: its window [160, 167) came along
    with pytest.raises(InvalidArgument, match=r"trim\(4\): .* a query at 163 needs them from "
                       r"156\. .*TRIM_MARGIN_TOKENS tokens, and not before the 176 tokens "
                       r"begin\(\) loaded"):
        trim_prompt_cache(r.cache, 4)
    assert [c.offset for c in r.cache] == [167] * 4
    got = run(model, [5], r.cache, n=2)
    assert got == uncached(model, p[:167] + [5], got[0])
    r.release()


# --- recurrent hybrids -------------------------------------------------------------------

RECURRENT_CASES = [("qwen3_next", "float32"), ("qwen3_5", "float32"), ("qwen3_5", "bfloat16")]


@pytest.mark.parametrize("arch,dtype", RECURRENT_CASES)
def test_recurrent_reuse_stops_at_a_checkpointed_boundary(arch, dtype):
    """Every paged run equals mlx-lm's own caches (``ArraysCache`` + ``KVCache``) doing the
    same work (the same prefill splits); on the CPU also a fresh run of the whole prompt."""
    model = model_of(arch, dtype)
    paged = PagedPromptCache(model, block_size=BS, checkpoint_interval=2 * BS)
    p1 = toks(70, 12)
    a = paged.begin(p1)
    # begin ran the prompt to its last block boundary (64), split at the checkpoint grid
    # (every 16 tokens: 3 grid points fit the cap of 4 with the tail), a state at each.
    assert paged.recurrent.boundaries(70, 0) == [16, 32, 48, 64]
    assert (a.hit_tokens, a.prefilled_tokens, a.cached_tokens) == (0, 64, 64)
    assert isinstance(a.cache[0], PagedStateLayerCache)
    assert isinstance(a.cache[1], PagedKVLayerCache)
    got_a = run(model, p1[a.cached_tokens:], a.cache, n=10)
    ref_a = make_prompt_cache(model)
    splits = grid([16, 32, 48, 64])
    for x, y in splits:
        model(mx.array(p1[x:y])[None], cache=ref_a)
    assert got_a == run(model, p1[64:], ref_a, n=10) == replayed(model, p1, splits, n=10)
    if on_cpu():
        assert got_a == fresh(model, p1, n=10)
    held = p1 + got_a[0]
    a.end(held)
    assert sorted(paged.recurrent.store.boundaries()) == [16, 32, 48, 64, 80]  # 80: end

    # B shares 60 tokens: the full group backs 56, the deepest state below that is at 48,
    # so the hit stops at 48 (never K/V without its state); B's begin runs 48..64.
    p2 = p1[:60] + toks(11, 13)
    b = paged.begin(p2)
    assert (b.hit_tokens, b.prefilled_tokens, b.restored_tokens) == (48, 16, 0)
    got_b = run(model, p2[b.cached_tokens:], b.cache)
    assert got_b == replayed(model, p2, grid([16, 32, 48, 64]))
    if on_cpu():
        assert got_b == fresh(model, p2)
    b.release()

    # C continues A's conversation from its parked tables and state: mlx-lm continuing
    # its own caches.
    p3 = held + toks(6, 14)
    c = paged.begin(p3)
    assert c.hit_tokens == len(held) and paged.stats()["continued_tokens"] == len(held)
    got_c = run(model, p3[c.cached_tokens:], c.cache)
    assert got_c == run(model, p3[len(held):], ref_a)
    if on_cpu():
        assert got_c == fresh(model, p3)
    c.release()

    # D shares A's first 66 tokens: the checkpoint at 64 serves it from memory.
    p4 = p1[:66] + toks(4, 15)
    d = paged.begin(p4)
    assert (d.hit_tokens, d.prefilled_tokens) == (64, 0)
    got_d = run(model, p4[d.cached_tokens:], d.cache)
    assert got_d == replayed(model, p4, splits)
    if on_cpu():
        assert got_d == fresh(model, p4)
    d.release()
    assert paged.stats()["checkpoint_hits"] == 2


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_a_512_token_shared_prefix_resumes_at_512(arch):
    """The benchmark's case at the default policy (block 16, grid 256, 4 per request): A =
    512 shared + 32 own tokens checkpoints at 256, 512 and its tail 528; B = the same 512
    + 32 others resumes at 512 from memory, bit-identical."""
    model = model_of(arch)
    paged = PagedPromptCache(model)  # block_size 16
    shared = toks(512, 30)
    p1, p2 = shared + toks(32, 31), shared + toks(32, 32)
    a = paged.begin(p1)
    assert (a.prefilled_tokens, a.cached_tokens) == (528, 528)
    got_a = run(model, p1[528:], a.cache, n=2)
    a.end(p1 + got_a[0])  # 546 tokens: not a block boundary, no end state
    assert paged.recurrent.store.boundaries() == [256, 512, 528]
    b = paged.begin(p2)
    assert (b.hit_tokens, b.prefilled_tokens, b.cached_tokens) == (512, 16, 528)
    got_b = run(model, p2[528:], b.cache, n=2)
    assert got_b == replayed(model, p2, grid([256, 512, 528]), n=2)
    if on_cpu():
        assert got_b == fresh(model, p2, n=2)
    b.release()
    # B published its own tail (528 on its lineage); 256 and 512 were A's, shared.
    assert paged.recurrent.store.boundaries() == [256, 512, 528, 528]
    assert paged.stats()["checkpoint_hits"] == 1


def test_checkpoint_policy_bounds_what_one_request_keeps():
    from pagedkv.integrations.mlx_lm.recurrent import checkpoint_boundaries

    assert checkpoint_boundaries(544, 0, 16) == [256, 512, 528]
    assert checkpoint_boundaries(544, 512, 16) == [528]
    assert checkpoint_boundaries(2000, 0, 16) == [512, 1024, 1536, 1984]  # grid doubled
    assert checkpoint_boundaries(10_000, 0, 16) == [4096, 8192, 9984]
    assert checkpoint_boundaries(10_000, 4096, 16) == [6144, 8192, 9984]
    assert checkpoint_boundaries(544, 0, 16, interval=0) == [528]
    assert checkpoint_boundaries(16, 0, 16) == []  # the last prompt token is computed
    for n in range(1, 3000, 37):
        for cached in (0, 16, 256, 1024):
            got = checkpoint_boundaries(n, cached, 16, 256, 4)
            assert len(got) <= 4 and got == sorted(set(got))
            assert all(b % 16 == 0 and cached < b < n for b in got)
    model = model_of("qwen3_5")
    for kwargs, error in (({"checkpoint_interval": 20}, InvalidArgument),
                          ({"checkpoints_per_request": 0}, InvalidArgument),
                          ({"checkpoint_entries": True}, InvalidArgumentType),
                          ({"checkpoint_bytes": 0}, InvalidArgument)):
        with pytest.raises(error):
            PagedPromptCache(model, **kwargs)
    # The store's bounds: entries (least recently published or hit first) and bytes.
    paged = PagedPromptCache(model, block_size=BS, checkpoint_entries=3,
                             checkpoint_interval=BS)
    r = paged.begin(toks(70, 33))
    assert paged.recurrent.boundaries(70, 0) == [16, 32, 48, 64]
    assert paged.recurrent.store.boundaries() == [32, 48, 64]
    r.release()
    one = paged.recurrent.store.nbytes // 3
    paged = PagedPromptCache(model, block_size=BS, checkpoint_bytes=2 * one,
                             checkpoint_interval=BS)
    paged.begin(toks(70, 33)).release()
    assert paged.recurrent.store.boundaries() == [48, 64]


def test_recurrent_reuse_without_a_checkpoint_recomputes():
    model = model_of("qwen3_next")
    paged = PagedPromptCache(model, block_size=BS, checkpoint_entries=1)
    p = toks(70, 16)
    r = paged.begin(p)
    r.end(p + run(model, p[r.cached_tokens:], r.cache, n=4)[0])  # 74 tokens: no end state
    assert paged.recurrent.store.boundaries() == [64]  # the tail (the grid starts at 256)
    paged.release_parked()
    q = p[:60] + toks(6, 17)  # its K/V blocks are cached, but no state below 56
    r2 = paged.begin(q)
    assert (r2.hit_tokens, r2.prefilled_tokens) == (0, 64)
    got = run(model, q[r2.cached_tokens:], r2.cache)
    assert got == replayed(model, q, [(0, 64)])
    if on_cpu():
        assert got == fresh(model, q)
    r2.release()


def test_batch_generate_with_recurrent_layers_and_insert_publishes_the_state():
    model = model_of("qwen3_next")
    tokenizer = TokenizerWrapper(word_tokenizer(256))
    paged = PagedPromptCache(model, block_size=BS)
    prompts = [toks(20 + k, 18 + k) for k in (0, 5)]
    requests = [paged.begin(p) for p in prompts]
    tails = [p[r.cached_tokens:] for p, r in zip(prompts, requests, strict=True)]
    got = batch_generate(model, tokenizer, tails, prompt_caches=[r.cache for r in requests],
                         max_tokens=5, return_prompt_caches=True, return_token_ids=True)
    assert all(r.state == "handed over to a batch" for r in requests)
    # mlx-lm's own batch doing the same work (the paged requests missed: nothing cached).
    assert [r.cached_tokens for r in requests] == [16, 24]  # begin ran the prompts' tails
    own = []
    for p, r in zip(prompts, requests, strict=True):
        cache = make_prompt_cache(model)
        model(mx.array(p[:r.cached_tokens])[None], cache=cache)
        own.append(cache)
    ref = batch_generate(model, tokenizer, tails, prompt_caches=own, max_tokens=5,
                         return_prompt_caches=True, return_token_ids=True)
    assert got.token_ids == ref.token_ids
    splits = []
    for p, ids, cache, mine in zip(prompts, got.token_ids, got.caches, ref.caches,
                                   strict=True):
        held = p + ids[:cache[1].offset - len(p)]
        paged.insert(held, cache)
        tail = held + toks(4, 40)
        r = paged.begin(tail)
        assert r.hit_tokens == len(held)  # the parked conversation, its state included
        got_tail = run(model, tail[r.cached_tokens:], r.cache)
        # mlx-lm doing the same calls: begin prefills to the next block boundary in a call of
        # its own (a state checkpoint there: held 30 -> 32), and on GPUs a split is other bits
        mine = laid_out_as_computed(mine)
        splits.append(r.cached_tokens - len(held))
        if r.cached_tokens > len(held):
            model(mx.array(tail[len(held):r.cached_tokens])[None], cache=mine)
            mx.eval([c.state for c in mine])
        assert got_tail == run(model, tail[r.cached_tokens:], mine)
        if on_cpu():
            assert got_tail == fresh(model, tail)
        r.release()
    assert splits == [0, 2]  # the second conversation's tail crossed a block boundary


def test_batch_generate_with_sliding_layers_and_insert_refuses_a_bare_window():
    """Paged sliding layers merge into mlx-lm's BatchRotatingKVCache: the batch computes what
    mlx-lm's own caches compute. The caches it returns keep the last window only, which
    starts inside a block: insert refuses them by name and changes nothing."""
    model = model_of("gemma3_text")
    tokenizer = TokenizerWrapper(word_tokenizer(256))
    paged = PagedPromptCache(model, block_size=BS)
    prompts = [toks(20 + k, 60 + k) for k in (0, 5)]
    requests = [paged.begin(p) for p in prompts]
    got = batch_generate(model, tokenizer, prompts, prompt_caches=[r.cache for r in requests],
                         max_tokens=5, return_prompt_caches=True, return_token_ids=True)
    own = batch_generate(model, tokenizer, prompts, max_tokens=5, return_token_ids=True,
                         prompt_caches=[make_prompt_cache(model) for _ in prompts])
    assert got.token_ids == own.token_ids
    assert all(r.state == "handed over to a batch" for r in requests)
    for p, ids, cache in zip(prompts, got.token_ids, got.caches, strict=True):
        held = p + ids[:cache[1].offset - len(p)]
        assert cache[0].keys.shape[2] == WINDOW
        before = paged.stats()
        with pytest.raises(InvalidArgument, match="keeps the window only"):
            paged.insert(held, cache)
        assert paged.stats() == before
    paged.coordinator.check_invariants()


def test_sliding_requests_that_hit_a_prefix_merge_into_a_batch():
    """A paged sliding layer holding a cached prefix hands mlx-lm's merge a RotatingKVCache
    of exactly min(offset, window) positions (what mlx-lm's own holds; the server's batched
    path merges these): the batch then computes what it computes from mlx-lm's own caches
    holding the same prefix."""
    model = model_of("gemma3_text")
    tokenizer = TokenizerWrapper(word_tokenizer(256))
    paged = PagedPromptCache(model, block_size=BS)
    shared = toks(36, 70)
    first = paged.begin(shared + [9])
    first.end(shared + [9] + run(model, shared + [9], first.cache, n=2)[0])
    prompts = [shared + toks(3 + k, 71 + k) for k in (0, 4)]
    requests = [paged.begin(p) for p in prompts]
    assert [r.cached_tokens for r in requests] == [32, 32]
    rotating = [r.cache[0].as_rotating() for r in requests]
    assert [(c.offset, c.keys.shape[2], c.size()) for c in rotating] == [(32, WINDOW, WINDOW)] * 2
    own = []
    for p in prompts:
        cache = make_prompt_cache(model)
        model(mx.array(p[:32])[None], cache=cache)
        own.append(cache)
    tails = [p[32:] for p in prompts]
    got = batch_generate(model, tokenizer, tails, prompt_caches=[r.cache for r in requests],
                         max_tokens=5, return_token_ids=True)
    ref = batch_generate(model, tokenizer, tails, prompt_caches=own, max_tokens=5,
                         return_token_ids=True)
    assert got.token_ids == ref.token_ids
    assert all(r.state == "handed over to a batch" for r in requests)
    paged.coordinator.check_invariants()


@pytest.mark.parametrize("arch,shared", [("gemma3_text", 32), ("qwen3_next", 32)])
def test_tenants_with_different_salts_never_share_hybrid_prefixes(arch, shared):
    """K/V blocks, sliding windows and recurrent checkpoints are all keyed by the salt."""
    model = model_of(arch)
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(40, 50)
    a = paged.begin(p, cache_salt="tenant-a")
    a.end(p + run(model, p[a.cached_tokens:], a.cache, n=2)[0])
    assert paged.release_parked() == 1
    q = p[:33] + toks(5, 51)
    for salt, hit in (("tenant-b", 0), (None, 0), ("tenant-a", shared)):
        r = paged.begin(q, cache_salt=salt)
        assert r.hit_tokens == hit, salt
        got = run(model, q[r.cached_tokens:], r.cache)
        # qwen3_next: A checkpointed at its tail 32 (its prefill ran 0..32 in one call);
        # q's begin also runs 0..32 when it misses.
        assert got == (uncached(model, q, got[0]) if arch == "gemma3_text" else
                       replayed(model, q, [(0, 32)]))
        r.release()
    paged.coordinator.check_invariants()


# --- restart through the cold tier -------------------------------------------------------

_RESTORE_CHILD = r"""
import json, sys
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from pagedkv.integrations.mlx_lm import PagedPromptCache
from pagedkv.integrations.mlx_lm.random_models import random_model
arch, cold, prompt, splits = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
model = random_model(arch, seed=0)[0]
def run(p, cache):
    return [(int(t), np.array(lp).tobytes().hex()) for t, lp in
            generate_step(mx.array(p), model, prompt_cache=cache, max_tokens=6)]
with PagedPromptCache(model, block_size=8, cold_dir=cold) as paged:
    request = paged.begin(prompt)
    got = run(prompt[request.cached_tokens:], request.cache)
    stats = paged.stats()
    # the reference: a request of another tenant, which nothing serves
    other = paged.begin(prompt, cache_salt="reference")
    if arch.startswith(("gemma", "gpt")):  # a sliding model's fresh paged run
        ref = run(prompt[other.cached_tokens:], other.cache)
    else:  # mlx-lm's own caches, split where the parent's and this prefill split
        ref = make_prompt_cache(model)
        for a, b in splits:
            model(mx.array(prompt[a:b])[None], cache=ref)
        ref = run(prompt[splits[-1][1]:], ref)
from pagedkv.integrations.mlx_lm.parity import compare, model_dtype
def steps(r):
    return [t for t, _ in r], b"".join(bytes.fromhex(lp) for _, lp in r)
# a recurrent model's reference did the same work (byte equality everywhere); a sliding
# model's fresh paged run did not (the parity rule: bytes on MLX's CPU, a bound on GPUs)
sliding = arch.startswith(("gemma", "gpt"))
same = compare(steps(got), steps(ref), dtype=model_dtype(model), same_calls=not sliding).same
print(json.dumps({"restored": request.restored_tokens, "hit": request.hit_tokens,
                  "fresh_hit": other.hit_tokens, "same": same,
                  "corruptions": stats["cold_corruptions"]}))
"""


def _child(arch, cold, prompt, splits=((0, 64), (64, 96))):
    """The restart in a fresh process. ``splits``: where the recurrent model's prefill
    split, the parent's (0..64, its tail) then the child's begin (from the restored 64 to
    the new prompt's tail, 96)."""
    done = subprocess.run([sys.executable, "-c", _RESTORE_CHILD, arch, str(cold),
                           json.dumps(prompt), json.dumps(splits)], check=False,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("arch,restored", [("qwen3_next", 64), ("qwen3_5", 64), ("gemma3_text", 88),
                                             ("gemma4_text", 88), ("gpt_oss", 88)])
def test_restart_restores_a_hybrid_conversation_with_its_sidecar(tmp_path, monkeypatch, arch,
                                                                  restored):
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    model = model_of(arch)
    cold = tmp_path / "cold"
    p = toks(70, 21)
    with PagedPromptCache(model, block_size=BS, cold_dir=cold) as paged:
        r = paged.begin(p)
        held = p + run(model, p[r.cached_tokens:], r.cache, n=20)[0]
        r.end(held)
    q = held + toks(9, 22)
    # The GDN state at the deepest rung (64), or the sliding window at the deepest block
    # boundary the request's buffers held (88), came back with the K/V before it.
    assert _child(arch, cold, q) == {"restored": restored, "hit": restored, "fresh_hit": 0,
                                     "same": True, "corruptions": 0}
    # A corrupt sidecar is a counted miss: nothing is restored without it.
    from pagedkv.cold import ColdGroup
    infix = ColdGroup.GDN_STATE.label if arch.startswith("qwen") else \
        ColdGroup.SLIDING_WINDOW.label
    (side,) = [f for f in (cold / "pagedkv-v1").rglob("*.safetensors") if infix in f.name]
    data = bytearray(side.read_bytes())
    data[-40] ^= 0xFF
    side.write_bytes(bytes(data))
    assert _child(arch, cold, q, ((0, 96),)) == {"restored": 0, "hit": 0, "fresh_hit": 0,
                                                 "same": True, "corruptions": 1}


def test_restart_resumes_a_512_token_shared_prefix_at_512(tmp_path, monkeypatch):
    """The cold half of the 512-token case: a fresh process restores the state checkpointed
    at 512 (A's grid point) with the K/V before it, bit-identical to mlx-lm's own caches
    split the same way (block 8: A kept 256, 512 and its tail 536)."""
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    # end() offers the 68 blocks to the tier within a 250 ms budget by default, which a
    # loaded test machine can exceed: the walk would stop before 512 (a counted deadline).
    monkeypatch.setenv("PAGEDKV_COLD_CAPTURE_BUDGET_MS", "60000")
    model = model_of("qwen3_5")
    cold = tmp_path / "cold"
    shared = toks(512, 34)
    with PagedPromptCache(model, block_size=BS, cold_dir=cold) as paged:
        p1 = shared + toks(32, 35)
        r = paged.begin(p1)
        assert paged.recurrent.store.boundaries() == [256, 512, 536]
        r.end(p1 + run(model, p1[r.cached_tokens:], r.cache, n=2)[0])
    p2 = shared + toks(32, 36)
    assert _child("qwen3_5", cold, p2, ((0, 256), (256, 512), (512, 536))) == {
        "restored": 512, "hit": 512, "fresh_hit": 0, "same": True, "corruptions": 0}


# --- what the cache refuses, and the state it leaves -----------------------------------------

@pytest.mark.parametrize("entry,kind", [
    ("CacheList", "composite"), ("ChunkedKVCache", "chunked"), ("QuantizedKVCache", "quantized"),
])
def test_models_with_layers_it_cannot_page_are_refused_by_name(monkeypatch, entry, kind):
    from mlx_lm.models import cache as mc

    make = {"CacheList": lambda: mc.CacheList(mc.ArraysCache(2), mc.KVCache()),
            "ChunkedKVCache": lambda: mc.ChunkedKVCache(16),
            "QuantizedKVCache": lambda: mc.QuantizedKVCache()}[entry]
    model = random_model("qwen3")[0]
    monkeypatch.setattr(type(model), "make_cache", lambda self: [mc.KVCache(), make()],
                        raising=False)
    with pytest.raises(UnsupportedModel, match=f"layer 1 .{entry}: {kind}.") as e:
        PagedPromptCache(model)
    assert (e.value.layer, e.value.kind) == (1, kind)


def test_a_kv_shared_layer_without_a_kv_anchor_is_refused_before_any_forward(monkeypatch):
    model = random_model("gemma4_text")[0]
    sources = list(model.model.previous_kvs)
    assert sources == [0, 1, 2, 3, 2, 3]
    # An alias of a layer that keeps no K/V (past the cache list): refused by name, before
    # the geometry forward (which would fail inside mlx-lm's attention).
    model.model.previous_kvs = sources[:4] + [5, 3]
    with pytest.raises(UnsupportedModel, match="layer 4 .KV-shared: reads layer 5.") as e:
        PagedPromptCache(model)
    assert (e.value.layer, e.value.kind) == (4, "shared")


def test_sink_tokens_and_recurrent_only_models_are_refused(monkeypatch):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    model = random_model("gemma3_text")[0]
    monkeypatch.setattr(type(model), "make_cache", lambda self: [
        RotatingKVCache(8, keep=4), KVCache(), RotatingKVCache(8, keep=4), KVCache()])
    with pytest.raises(UnsupportedModel, match="keep=4") as e:
        PagedPromptCache(model)
    assert (e.value.layer, e.value.kind) == (0, "other")


def test_insert_of_a_window_that_misses_its_block_changes_nothing():
    from mlx_lm.models.cache import RotatingKVCache

    model = model_of("gemma3_text")
    paged = PagedPromptCache(model, block_size=BS)
    p = toks(43, 23)  # the window at 43 needs positions from expired(43) * 8 = 32
    cache = make_prompt_cache(model)
    model(mx.array([p[:-1]]), cache=cache)
    model(mx.array([p[-1:]]), cache=cache)  # a decode step: the ring keeps the window only
    assert isinstance(cache[0], RotatingKVCache) and cache[0].keys.shape[2] == WINDOW
    before = paged.stats()
    with pytest.raises(InvalidArgument, match="keeps the window only"):
        paged.insert(p, cache)
    assert paged.stats() == before
    paged.coordinator.check_invariants()


def test_cold_tier_refuses_what_it_cannot_restore(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDKV_PERSIST_PAGED_CACHE", "1")
    model = random_model("gemma3_text", sliding_window=8)[0]
    # Two sliding groups (two windows) cannot be rebuilt from one sidecar.
    from mlx_lm.models.cache import KVCache, RotatingKVCache
    monkeypatch.setattr(type(model), "make_cache", lambda self: [
        RotatingKVCache(8), KVCache(), RotatingKVCache(16), KVCache()])
    with pytest.raises(UnsupportedModel, match="sliding layers form 2 groups"):
        PagedPromptCache(model, cold_dir=tmp_path)
    assert PagedPromptCache(model).groups[2].kind.window == 16  # the hot cache serves it


# --- pagedkv demo --engine mlx-lm ------------------------------------------------------------

@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_5"])
def test_demo_runs_hybrid_architectures_with_parity(capsys, arch):
    from pagedkv.cli import main

    assert main(["demo", "--no-cold", "--engine", "mlx-lm", "--arch", arch, "--requests", "3",
                 "--system-tokens", "32", "--fewshot-tokens", "16", "--user-tokens", "8",
                 "--new-tokens", "4", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert f"model: mlx-lm {arch} " in out
    assert "(2 with a prefix hit)" in out
    # on GPUs the demo's references ran other calls: within the bound (parity.py)
    assert f"parity: OK (3/3 outputs {'byte-identical to' if on_cpu() else 'match'}" in out

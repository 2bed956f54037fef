"""One hybrid-model session through the cold tier, as a fresh process runs it (the restart
tests start it with ``python -c``): a saved hybrid reference model, a grouped coordinator
with a checkpoint store, and the ``pagedkv_reference_hybrid`` family's cold tier."""

from __future__ import annotations

import hashlib

import numpy as np


def hybrid_session(base, model_dir, *, persist: bool, prompts, max_new: int = 4,
                   block_size: int = 8) -> dict:
    """Serve ``prompts`` (one request each, in order) and report what a parity gate compares:
    tokens and a digest of the logits per request, cached tokens, how many hits came with a
    cold sidecar, and the tier's and the sidecar counters (deltas)."""
    from pagedkv.cold import cold_sidecar_stats
    from pagedkv.tiny_model import ReferenceModel
    from pagedkv.tiny_model.hybrid_cold import hybrid_cold_context
    from pagedkv.tiny_model.hybrid_paged import build_hybrid_coordinator
    from pagedkv.tiny_model.hybrid_serving import serve_hybrid
    from pagedkv.tiny_model.serving import Request

    model = ReferenceModel.load(model_dir)
    ctx, source = hybrid_cold_context(str(model_dir), model.config, block_size=block_size,
                                      base=str(base), persist=persist)
    cache = build_hybrid_coordinator(model.config, block_size=block_size, hash_seed=0,
                                     blocks_per_group=(128, 64), cold=ctx)
    if ctx is not None:
        source.bind(cache.checkpoints, ctx.sidecar)
    side0 = cold_sidecar_stats()
    requests = [Request(f"q{i}", np.asarray(p, np.int64), max_new)
                for i, p in enumerate(prompts)]
    report = serve_hybrid(model, cache, requests)
    cache.check_invariants()
    out = {"tokens": [report.outputs[r.seq_id].tokens.tolist() for r in requests],
           "logits_sha256": [hashlib.sha256(np.ascontiguousarray(
               report.outputs[r.seq_id].logits).tobytes()).hexdigest() for r in requests],
           "cached_tokens": report.cached_tokens, "cold_state_restores":
               report.cold_state_restores, "hot_state_hits": report.hot_state_hits,
           "persisting": ctx is not None}
    if ctx is not None:
        out["drained"] = ctx.drain(10.0)
        s = ctx.stats()
        side = cold_sidecar_stats()
        out.update(hits=s.hits, misses=s.misses, corruptions=s.corruptions,
                   enqueued=s.enqueued, restore_declines=s.restore_declines,
                   sidecars_enqueued=side.enqueued - side0.enqueued,
                   sidecars_installed=side.installed - side0.installed)
        ctx.tier.close()
    return out

"""``pagedkv demo --model hybrid``: the demo's session on the hybrid reference model.

The same requests and table as the default demo, served by a grouped coordinator (a full
group and a sliding-window group, the KV-shared alias routed to its anchor) with the gated
delta net's state held per request, checkpointed at the GDN ladder's rungs and reused across
requests (hybrid hot prefix reuse). The table adds the per-group pool and peak block counts,
the sliding blocks returned to the null sentinel, and the state checkpoints published,
captured to disk and restored. Full blocks and their GDN + sliding sidecars persist under the
``pagedkv_reference_hybrid`` family in ``<cold-dir>/pagedkv-v1``, so a second run restores the
shared prefix *with its state* from disk. Every output is checked against the flat path.
"""

from __future__ import annotations

import argparse
import os
import sys

from pagedkv.cli.demo_restart import _cold_dir, _unusable_cold_dir
from pagedkv.cli.demo_session import prepare_session, print_parity
from pagedkv.cli.demo_session import report_rows as plain_rows
from pagedkv.cli.table import format_table

#: Entries of the demo's hot state checkpoint store (the ladder's victim orders pick among
#: them, at most 4 per request).
CHECKPOINT_ENTRIES = 64
#: Prefill chunk (tokens): a row then never holds more than the window behind a chunk in
#: the sliding group (its admission blocks).
PREFILL_CHUNK = 32


def _cold_context(args: argparse.Namespace, model):
    """``(context, source)`` for the hybrid model saved in ``<cold-dir>/model-hybrid``, or
    ``(None, None)`` with ``--no-cold``."""
    from pagedkv.errors import InvalidArgument, PagedKVError
    from pagedkv.tiny_model.hybrid_cold import hybrid_cold_context

    if args.no_cold and args.cold_dir:
        raise ValueError("--no-cold cannot be combined with --cold-dir")
    base = _cold_dir(args)
    if base is None:
        return None, None
    model_dir = os.path.join(base, "model-hybrid")
    try:
        model.save(model_dir)
        ctx, source = hybrid_cold_context(model_dir, model.config, block_size=args.block_size,
                                          base=base, persist=True,
                                          compute=model.compute_identity)
    except (PagedKVError, OSError) as exc:
        raise InvalidArgument(_unusable_cold_dir(
            base, exc, "cannot hold the demo's cold tier",
            "pass --cold-dir a directory you can write (or remove what is in the way)")) \
            from None
    if ctx is None:
        raise InvalidArgument(f"--cold-dir {base!r}: the cold tier could not be opened "
                              "there (see the log); pass another --cold-dir or --no-cold")
    if args.fresh:
        ctx.tier.store.remove_quarantine()
        ctx.tier.store.evict_to(0)
    return ctx, source


def sliding_blocks(config, args: argparse.Namespace) -> int:
    """The sliding group's pool: a full batch of windows behind a prefill chunk, plus its
    null block (a sliding row's need is bounded by the window, so this never grows with
    the context); at least ``--initial-blocks``."""
    from pagedkv.coordinator import AttentionKind, max_admission_blocks

    per_row = max_admission_blocks(AttentionKind.sliding(config.sliding_window),
                                   args.block_size, config.max_position, PREFILL_CHUNK)
    return max(args.initial_blocks, args.max_batch * per_row + 1)


def report_rows(report, requests, args: argparse.Namespace, sidecars) -> list[list[str]]:
    """The default demo's rows, then the hybrid model's."""

    rows = plain_rows(report, requests, args)
    grow = (f"{report.grow_events} ({args.initial_blocks} -> {report.group_pool_blocks[0]} "
            f"full blocks, max {args.max_blocks})")
    rows = [r if r[0] != "pool growth events" else [r[0], grow] for r in rows]
    groups = "; ".join(f"{kind} {pool} / {peak}" for kind, pool, peak in zip(
        report.group_kinds, report.group_pool_blocks, report.group_peak_blocks, strict=True))
    captured, installed = sidecars
    rows += [
        ["blocks per group", f"{groups} (pool / peak in use)"],
        ["sliding blocks to null", f"{report.sliding_blocks_nulled:,}"],
        ["state checkpoints", (f"{report.checkpoints_published} published, "
                               f"{report.hot_state_hits} hot hits")],
        ["state from disk", (f"{captured} sidecars captured, {report.cold_state_restores} "
                             f"restored ({installed} sliding installs)")],
    ]
    return rows


def run_hybrid(args: argparse.Namespace) -> int:
    """The demo on the hybrid model; exit status as the default demo's."""
    from pagedkv.cold.ladder import LadderRetention, RetentionCaps, VictimOrder
    from pagedkv.tiny_model import HybridConfig
    from pagedkv.tiny_model.hybrid_paged import build_hybrid_coordinator
    from pagedkv.tiny_model.hybrid_serving import serve_hybrid

    if args.restart:
        print("pagedkv demo: error: --restart is the reference model's; run `pagedkv demo "
              "--model hybrid` twice on one --cold-dir instead (the second run restores)",
              file=sys.stderr)
        return 2
    prepared = prepare_session(args, HybridConfig(seed=args.seed))
    if isinstance(prepared, int):
        return prepared
    model, requests = prepared
    try:
        ctx, source = _cold_context(args, model)
    except ValueError as e:
        print(f"pagedkv demo: {e}", file=sys.stderr)
        return 2
    c = model.config
    assert isinstance(c, HybridConfig)
    retention = LadderRetention(RetentionCaps(CHECKPOINT_ENTRIES, 4, VictimOrder.LADDER))
    sliding = sliding_blocks(c, args)
    cache = build_hybrid_coordinator(
        c, block_size=args.block_size, backend=args.backend,
        max_chunk=PREFILL_CHUNK, blocks_per_group=(args.initial_blocks, sliding),
        max_blocks_per_group=(args.max_blocks, max(sliding, args.max_blocks)), cold=ctx,
        checkpoint_entries=CHECKPOINT_ENTRIES, checkpoint_retention=retention)
    if ctx is not None:
        source.bind(cache.checkpoints, ctx.sidecar)
    print(f"pagedkv demo: {len(requests)} requests, prompt = {args.system_tokens} system + "
          f"{args.fewshot_tokens} few-shot (shared) + {args.user_tokens} user tokens, "
          f"{args.new_tokens} new tokens each")
    print(f"model: hybrid reference transformer ({c.num_layers} layers: "
          f"{', '.join(k.split('_')[0] for k in c.layer_types)}; layer "
          f"{c.kv_shared_layers[0][0]} shares layer {c.kv_shared_layers[0][1]}'s K/V; "
          f"window {c.sliding_window}), backend {args.backend}, block size {args.block_size}, "
          f"max batch {args.max_batch}")
    print()
    from pagedkv.cold import cold_sidecar_stats
    side0 = cold_sidecar_stats()
    report = serve_hybrid(model, cache, requests, max_batch=args.max_batch,
                          prefill_chunk_tokens=PREFILL_CHUNK)
    drained = ctx.drain(30.0) if ctx is not None else True
    side = cold_sidecar_stats()
    sidecars = (side.enqueued - side0.enqueued, side.installed - side0.installed)
    for line in format_table(report_rows(report, requests, args, sidecars)):
        print(line)
    print()
    cache.check_invariants()
    if not print_parity(model, requests, report.outputs):
        return 1
    if ctx is not None:
        s = ctx.stats()
        ctx.tier.close()
        print(f"cold tier: {s.hits} blocks and {report.cold_state_restores} states restored "
              f"from disk, {s.enqueued} objects persisted ({s.bytes_written:,} bytes, drained: "
              f"{'yes' if drained else 'NO'}), corruptions {s.corruptions}, in {s.root}")
        if report.cold_state_restores == 0:
            print("  run `pagedkv demo --model hybrid` again: the next process restores the "
                  "shared prefix and its state from disk instead of recomputing it")
    return 0

"""The persistence phases of ``pagedkv demo`` (the cold tier, ``--restart``).

By default the demo's adapter gets a cold tier in ``<cold-dir>/pagedkv-v1`` (``./.pagedkv-demo``
unless ``--cold-dir`` says otherwise) and the reference model is saved to ``<cold-dir>/model``
so it can be fingerprinted. The tier is kept between runs: a second ``pagedkv demo`` starts
with an empty hot cache and restores the shared prefix from disk, verified, instead of
recomputing it (``--fresh`` empties the tier first; ``--no-cold`` runs without one).
``--restart`` then starts a second process that restores the first request's prefix from disk
into an empty hot cache and prints how many tokens came back, the restore time against
recomputing those tokens, and greedy parity (tokens and logits) against a fresh run on the
flat path.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from pagedkv.cli.demo_session import build_requests, kv_dtype_for

#: Where a persistent (cold-tier) phase of the demo keeps its files.
DEFAULT_COLD_DIR = "./.pagedkv-demo"
#: Arguments the restart child needs to rebuild the same model, prompts and pool.
_FORWARDED = ("requests", "system_tokens", "fewshot_tokens", "user_tokens", "new_tokens",
              "block_size", "backend", "max_blocks", "seed", "kv_mode", "kv_v")


def directory_argument(text: str) -> str:
    """An argparse ``type`` for ``--cold-dir``: an empty DIR (``--cold-dir "$UNSET"``) is a
    usage error, not the default directory."""
    if not text:
        raise argparse.ArgumentTypeError("DIR is empty; pass a directory")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cold-dir", default=None, metavar="DIR", type=directory_argument,
                   help="cold tier directory: KV blocks persist in DIR/pagedkv-v1 and are "
                        "restored by the next run (./.pagedkv-demo)")
    p.add_argument("--cold-backend", default=None, metavar="URL",
                   help="a fleet's Redis/Valkey behind the directory (redis://host:port/db): "
                        "a second demo with another --cold-dir restores from it")
    # --fresh empties a tier that --no-cold does not open: one or the other (usage error).
    which = p.add_mutually_exclusive_group()
    which.add_argument("--fresh", action="store_true",
                       help="empty the cold tier first, so this run restores nothing from "
                            "disk")
    which.add_argument("--no-cold", action="store_true",
                       help="run on the hot cache alone, without a cold tier")
    p.add_argument("--restart", action="store_true",
                   help="then restore the first request's prefix in a second process and "
                        "report restore vs recompute time and parity")
    p.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)


def _cold_dir(args) -> str | None:
    if args.cold_dir:
        return args.cold_dir
    return None if args.no_cold else DEFAULT_COLD_DIR


def _tier_dir(args) -> str:
    """The cold dir of a run that has a tier: the parent's (``--no-cold`` refuses
    ``--restart``) or the restart child's (launched with ``--cold-dir``)."""
    base = _cold_dir(args)
    assert base is not None, "a run with a cold tier has a cold dir"
    return base


def _open_tier(args, model, *, save_model: bool, empty: bool):
    """The demo's tier bound to the saved model's fingerprint.

    Saving the model again is harmless: the same seed writes the same bytes, so the
    fingerprint, and with it every object on disk, stays valid; another seed or another
    backend (``--backend``) gives another fingerprint and the old objects simply miss.
    """
    from pagedkv.cold import DEFAULT_FORMAT, ColdTier, family_profile, model_fingerprint
    from pagedkv.cold.root import MANAGED_CHILD
    from pagedkv.pool import PoolGeometry

    base = _tier_dir(args)
    model_dir = os.path.join(base, "model")
    if save_model:
        model.save(model_dir)
    c = model.config
    geometry = PoolGeometry(c.num_layers, c.num_kv_heads, c.head_dim, args.block_size,
                            model.kv_dtype)
    # The backend is part of the fingerprint: NumPy and MLX KV differ in the last bits, and
    # the demo checks byte parity, so each backend restores only KV it computed itself.
    fp = model_fingerprint(DEFAULT_FORMAT, model_dir, family_profile("pagedkv_reference"),
                           geometry, compute=model.compute_identity)
    tier = ColdTier.open_at(os.path.join(base, MANAGED_CHILD), quota_bytes=1 << 30,
                            reserve_bytes=0, fingerprint=fp,
                            remote=getattr(args, "cold_backend", None))
    if empty:
        tier.store.remove_quarantine()
        tier.store.evict_to(0)
    return tier


def _unusable_cold_dir(base: str, exc: Exception, problem: str, fix: str) -> str:
    """One line naming the directory, what is wrong and the fix."""
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    where = f" ({exc.filename!r})" if isinstance(exc, OSError) and exc.filename else ""
    return f"--cold-dir {base!r} {problem}: {reason}{where}; {fix}"


def _check_cold_backend(url: str) -> None:
    """``InvalidArgument`` naming ``--cold-backend`` for a URL that is not a Redis/Valkey one
    or is malformed, before anything is written (the tier's open would report it as the
    cold dir's fault)."""
    from pagedkv.cold.redis_store import _URL_FORM, _check_url, is_redis_url, redacted_url
    from pagedkv.errors import InvalidArgument
    shown = redacted_url(url)
    if not is_redis_url(url):
        raise InvalidArgument(f"--cold-backend {shown!r} is not a Redis/Valkey URL: "
                              f"{_URL_FORM}")
    try:
        _check_url(url, shown)
    except InvalidArgument as exc:
        raise InvalidArgument(f"--cold-backend: {exc}") from None


def cold_tier_for(args, model):
    """The first process's tier (persist on; emptied with ``--fresh``), or ``None`` with
    ``--no-cold``.

    Raises ``InvalidArgument`` (a ``ValueError``) with a one-line message naming the
    directory and the fix when ``--cold-dir`` cannot hold the tier (a file in the way, no
    permission): ``pagedkv demo`` prints it and exits 2, never with a traceback."""
    from pagedkv.errors import ColdBackendError, InvalidArgument, PagedKVError
    if args.no_cold and (args.cold_dir or args.restart or args.cold_backend):
        raise ValueError("--no-cold cannot be combined with --cold-dir, --cold-backend or "
                         "--restart")
    base = _cold_dir(args)
    if base is None:
        return None
    if args.cold_backend:
        _check_cold_backend(args.cold_backend)
    try:
        args.cold_tier = _open_tier(args, model, save_model=True, empty=args.fresh)
    except ColdBackendError as exc:
        raise InvalidArgument(f"--cold-backend: {exc}") from None
    except (PagedKVError, OSError) as exc:
        raise InvalidArgument(_unusable_cold_dir(
            base, exc, "cannot hold the demo's cold tier",
            "pass --cold-dir a directory you can write (or remove what is in the way)")) \
            from None
    return args.cold_tier


def run_restart_phase(args) -> int:
    """Drain the first process's writes, then run the restore phase in a fresh process."""
    tier = getattr(args, "cold_tier", None)
    if tier is None:
        return 0
    drained = tier.drain(30.0)
    s = tier.stats()
    tier.close()
    where = "disk and the fleet's store" if args.cold_backend else "disk"
    print(f"cold tier: {s.hits} blocks restored from {where} ({s.bytes_restored:,} bytes), "
          f"{s.enqueued} blocks persisted ({s.bytes_written:,} bytes, drained: "
          f"{'yes' if drained else 'NO'}), corruptions {s.corruptions}, in {s.root}")
    print(f"  inspect it: pagedkv cold stats {shlex.quote(_tier_dir(args))}")
    if s.hits == 0 and not args.restart:
        print("  run `pagedkv demo` again: the next process restores the shared prefix "
              "from disk instead of recomputing it")
    if not args.restart:
        return 0
    argv = [sys.executable, "-m", "pagedkv", "demo", "--restart-child",
            "--cold-dir", _tier_dir(args)]
    for name in _FORWARDED:
        if getattr(args, name) is not None:
            argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    if args.cold_backend:
        argv += ["--cold-backend", args.cold_backend]
    print()
    sys.stdout.flush()
    return subprocess.run(argv, check=False).returncode


def run_child(args) -> int:
    """Second process: restore request 0's prefix into an empty hot cache, time it against
    recomputing the same tokens, and check greedy parity with a fresh flat run."""
    import numpy as np

    from pagedkv.errors import PagedKVError
    from pagedkv.tiny_model import PagedKV, ReferenceModel
    from pagedkv.tiny_model.serving import build_paged_adapter
    try:
        model = ReferenceModel.load(os.path.join(_tier_dir(args), "model"),
                                    backend=args.backend, kv_dtype=kv_dtype_for(args))
        tier = _open_tier(args, model, save_model=False, empty=False)
    except (PagedKVError, OSError) as exc:
        message = _unusable_cold_dir(
            _tier_dir(args), exc, "has no usable demo model or tier",
            "run `pagedkv demo --restart` with this --cold-dir (it saves the model first)")
        print(f"pagedkv demo: {message}", file=sys.stderr)
        return 2
    request = build_requests(args, model.config.vocab_size)[0]
    prompt = np.asarray(request.prompt)
    adapter = build_paged_adapter(model, block_size=args.block_size,
                                  num_blocks=args.max_blocks, cold=tier)
    adapter.reset_for_new_request(0)
    t0 = time.perf_counter()
    hit = adapter.find_cached_prefix(0, prompt, max_tokens=len(prompt) - 1)
    restore_s = time.perf_counter() - t0
    restored = int(hit.cached_tokens)
    recompute_s = 0.0
    if restored:
        t0 = time.perf_counter()
        model.forward(prompt[:restored], model.new_flat_kv())
        recompute_s = time.perf_counter() - t0
    paged = model.generate(prompt, request.max_new_tokens, PagedKV(adapter, 0))
    flat = model.generate(prompt, request.max_new_tokens, model.new_flat_kv())
    same = (np.array_equal(paged.tokens, flat.tokens)
            and paged.logits.tobytes() == flat.logits.tobytes())
    s = tier.stats()
    tier.close()
    print(f"restart (pid {os.getpid()}): restored {restored} of {len(prompt)} prompt tokens "
          f"({len(hit.restored_blocks)} blocks) from disk, cold hits {s.hits}, "
          f"corruptions {s.corruptions}")
    if restored:
        print(f"restore {restore_s * 1e3:.2f} ms vs recompute {recompute_s * 1e3:.2f} ms "
              f"({recompute_s / restore_s:.1f}x)")
    print(f"parity: {'OK' if same else 'MISMATCH'} ({len(paged.tokens)} greedy tokens and "
          "their logits, restored prefix vs a fresh flat run)")
    # A corruption the child meets is a handled miss (counted, quarantined, never served):
    # the restore stops there and parity is still checked. The parent's walk only reads the
    # chain up to its first bad object, so deeper bad objects from an earlier run can
    # legitimately surface here. Success is a verified restore with parity.
    return 0 if same and restored > 0 else 1

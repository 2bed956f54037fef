"""mlx-lm's OpenAI-compatible server with pagedkv as its prompt cache (``pagedkv serve``).

The server is mlx-lm's own: its argument parser, ``ModelProvider``, ``ResponseGenerator``
(batched and single-request generation) and HTTP handler run unchanged. The one thing
replaced is the prompt cache object they are given: instead of ``LRUPromptCache`` (a trie of
deep-copied ``KVCache`` lists), :class:`PagedServerPromptCache` answers the same calls from a
:class:`PagedPromptCache`, so the conversations of many users share their system prompt's
blocks, and with ``--cold-dir`` warm prefixes survive a restart.

mlx-lm's server calls on its prompt cache (0.32): ``fetch_nearest_cache(model_key, tokens)
-> (cache, rest)``, ``insert_cache(model_key, tokens, cache, cache_type=...)``,
``trim_to(n_sequences=, n_bytes=)``, ``len()``, ``nbytes``, ``stats_by_type()``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.errors import InvalidArgument, PagedKVError

if TYPE_CHECKING:
    from pagedkv.integrations.mlx_lm.prompt_cache import PagedPromptCache

__all__ = ["PagedServerPromptCache", "await_thread_teardown", "has_sliding_layers",
           "run_server", "serve_sliding_unbatched"]

log = logging.getLogger("pagedkv.serve")


class PagedServerPromptCache:
    """The prompt cache mlx-lm's ``ResponseGenerator`` talks to, backed by one
    :class:`PagedPromptCache` for the model the server has loaded (a model switch builds a
    new one and closes the old)."""

    def __init__(self, model_provider, *, block_size: int = 16, max_blocks: int | None = None,
                 cold_dir=None) -> None:
        self.model_provider = model_provider
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.cold_dir = cold_dir
        self._key = None
        self.paged: PagedPromptCache | None = None
        #: Requests the paged cache could not serve (``fetch_nearest_cache``), publications it
        #: refused (``insert_cache``): logged and counted, never raised into mlx-lm's loop.
        self.fetch_errors = 0
        self.publish_errors = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PagedServerPromptCache(model={self._key!r}, {self.paged!r})"

    def _paged_for(self, model_key):
        from pagedkv.integrations.mlx_lm.prompt_cache import PagedPromptCache

        if self.paged is not None and model_key == self._key:
            return self.paged
        self.close()
        # mlx-lm's key: (model path, LoRA adapter path, draft model path).
        key = model_key if isinstance(model_key, tuple) else ()
        model_path = key[0] if len(key) > 0 else None
        adapter_path = key[1] if len(key) > 1 else None
        # The cold tier's file fingerprint reads the model directory only, which an adapter
        # does not change: with one, the fingerprint hashes the loaded parameters (the LoRA
        # weights among them), so K/V of the base model never restore into the adapted one.
        model_dir = model_path if adapter_path is None and isinstance(model_path, str) \
            and os.path.isdir(model_path) else None
        self.paged = PagedPromptCache(self.model_provider.model, block_size=self.block_size,
                                      max_blocks=self.max_blocks, cold_dir=self.cold_dir,
                                      model_dir=model_dir)
        self._key = model_key
        log.info("pagedkv prompt cache for %s%s: %r", model_path,
                 "" if adapter_path is None else f" with adapter {adapter_path}", self.paged)
        return self.paged

    def close(self) -> None:
        """Persist the cold tier's queue and drop the paged cache."""
        if self.paged is not None:
            self.paged.close()
            self.paged = None
            self._key = None

    # --- LRUPromptCache's interface, as mlx-lm's server uses it ----------------------------

    def fetch_nearest_cache(self, model_key, tokens: Sequence[int]):
        """A paged request for ``tokens``: its per-layer caches (holding the longest cached
        prefix) and the tokens still to compute. When the paged cache cannot serve it (a
        prompt longer than the pool: ``CapacityExceeded``; blocks held by requests in flight:
        ``PoolExhausted``) the failure is logged and counted and ``(None, tokens)`` returned,
        as ``LRUPromptCache`` answers a miss: mlx-lm then builds its own cache for the
        request. Raised, the error would end mlx-lm's generation thread, and every later
        request with it."""
        with self._lock:
            try:
                request = self._paged_for(model_key).begin(list(tokens))
            except PagedKVError as exc:
                self.fetch_errors += 1
                log.warning("pagedkv: cannot serve a %d-token prompt from the paged cache "
                            "(%s); mlx-lm computes it with its own cache", len(tokens), exc)
                return None, list(tokens)
        return request.cache, list(tokens[request.cached_tokens:])

    def insert_cache(self, model_key, tokens: Sequence[int], prompt_cache,
                     *, cache_type: str = "assistant") -> None:
        """Publish ``prompt_cache`` (a request's own layers, or the ``KVCache`` list mlx-lm's
        batching extracted) holding ``tokens``. A failure is logged and counted, never raised
        into mlx-lm's generation loop: the cache simply does not learn these tokens."""
        with self._lock:
            try:
                paged = self._paged_for(model_key)
                written = paged.insert(list(tokens), prompt_cache)
            except PagedKVError as exc:
                self.publish_errors += 1
                log.warning("pagedkv: could not publish %d tokens (%s): %s", len(tokens),
                            cache_type, exc)
                return
            s = paged.stats()
            log.info("pagedkv: published %d new tokens (%s, %d total); %d blocks in use "
                     "(%.2f MiB), %d shared, %d cached tokens served so far", written,
                     cache_type, len(tokens), s["blocks_in_use"], s["bytes_in_use"] / 2**20,
                     s["blocks_shared"], s["hit_tokens"])

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        """Release parked conversations down to ``n_sequences`` (their published blocks stay
        cached until the pool needs them). ``n_bytes`` is not a paged-pool limit: the pool's
        size is set by ``--max-blocks``."""
        with self._lock:
            if self.paged is not None and n_sequences is not None:
                self.paged.release_parked(n_sequences)

    def __len__(self) -> int:
        return 0 if self.paged is None else self.paged.stats()["parked"]

    @property
    def nbytes(self) -> int:
        """Bytes of the pool blocks holding K/V (each shared block counted once)."""
        return 0 if self.paged is None else self.paged.stats()["bytes_in_use"]

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        if self.paged is None:
            return {}
        s = self.paged.stats()
        return {"paged": {"n_sequences": s["parked"], "n_bytes": s["bytes_in_use"]}}


def has_sliding_layers(model) -> bool:
    """Whether mlx-lm's cache list of ``model`` has a sliding-window layer."""
    from pagedkv.integrations.mlx_lm.layer_kinds import LayerKind, layer_specs

    return any(s.kind is LayerKind.SLIDING for s in layer_specs(model))


def serve_sliding_unbatched(provider) -> None:
    """Make mlx-lm's ``ModelProvider`` report a model with sliding-window layers as not
    batchable, now and after every ``load``: mlx-lm then serves its requests on the
    single-request path, whose caches are the paged request's own, so every request is
    published, generated tokens included. (A finished batch's ``RotatingKVCache`` keeps the
    last window only, which rarely starts on a block boundary: ``PagedPromptCache.insert``
    cannot publish it; the batch's prompt-segment caches, which hold the last prefill chunk,
    it can.)"""
    load = provider.load

    def route(provider=provider) -> None:
        if provider.is_batchable and provider.model is not None \
                and has_sliding_layers(provider.model):
            provider.is_batchable = False
            log.info("pagedkv: %s has sliding-window layers: serving it on mlx-lm's "
                     "single-request path so every request is published "
                     "(--unbatched-sliding)", provider.model_key)

    def load_then_route(*args, **kwargs):
        out = load(*args, **kwargs)
        route()
        return out

    provider.load = load_then_route
    route()


def await_thread_teardown(thread: threading.Thread, timeout_s: float = 10.0) -> bool:
    """Wait until the OS thread behind ``thread``, already joined, has exited.

    ``Thread.join`` returns when the Python side of a thread is done, before its OS thread
    runs its C++ thread-local destructors. MLX keeps a per-thread compile cache whose
    entries hold Python functions (mlx-lm's compiled sampler and activations), so the
    generation thread's teardown takes the GIL to release them; if the interpreter is
    finalizing by then, Python ends that thread with a forced unwind through a ``noexcept``
    destructor and the process aborts ("terminate called without an active exception",
    exit -6 on SIGTERM; seen under CPU load). Waiting here, before returning to the
    interpreter's exit, lets the teardown finish while Python still runs. Linux only
    (``/proc/self/task``); elsewhere returns at once. Returns whether the thread is known
    gone within ``timeout_s`` seconds.
    """
    tid = thread.native_id
    tasks = "/proc/self/task"
    if thread.is_alive() or tid is None or not os.path.isdir(tasks):
        return False
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"{tasks}/{tid}"):
        if time.monotonic() >= deadline:
            log.warning("pagedkv serve: generation thread %d still tearing down after "
                        "%.0f s", tid, timeout_s)
            return False
        time.sleep(0.005)  # releases the GIL the teardown needs
    return True


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (huggingface_hub's span several), at most 300
    characters."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _load_default_model(model_provider, model: str) -> None:
    """Load mlx-lm's ``--model`` (its ``ModelProvider.load_default``) now, raising
    ``InvalidArgument`` with one line naming ``model``, the reason and the fix when it cannot
    be loaded."""
    try:
        model_provider.load_default()
    except Exception as exc:  # noqa: BLE001 (any loader failure is the --model's)
        if os.path.exists(model):
            where = f"--model {model!r} cannot be loaded as an mlx-lm model"
            fix = "pass a directory holding config.json, the tokenizer and *.safetensors"
        else:
            where = (f"--model {model!r} is not a path here and could not be fetched as a "
                     "Hugging Face repo id")
            fix = ("pass an mlx-lm model directory, or a repo id that is in the Hugging Face "
                   "cache or reachable")
        raise InvalidArgument(f"{where}: {_one_line(exc)}; {fix}") from None


def _open_cold_dir(prompt_cache: PagedServerPromptCache, model_key, cold_dir) -> None:
    """Build the paged cache of the loaded ``--model`` now, so its cold tier opens before the
    server listens, raising ``InvalidArgument`` with one line naming ``--cold-dir`` when it
    cannot (a file in its place, no permission). Built lazily by the first request, the
    failure ended mlx-lm's generation thread, and every request after it failed."""
    shown = os.fspath(cold_dir)
    try:
        prompt_cache._paged_for(model_key)
    except OSError as exc:
        reason = exc.strerror or _one_line(exc)
        where = f" ({exc.filename!r})" if exc.filename else ""
        raise InvalidArgument(f"--cold-dir {shown!r} cannot hold the cold tier: {reason}"
                              f"{where}; pass --cold-dir a directory you can write, or run "
                              "without it") from None
    except PagedKVError as exc:
        raise InvalidArgument(f"--cold-dir {shown!r}: {_one_line(exc)}") from None


def run_server(model: str, mlx_lm_args: Sequence[str] = (), *, block_size: int = 16,
               max_blocks: int | None = None, cold_dir=None,
               unbatched_sliding: bool = False) -> int:
    """Run mlx-lm's server on ``model`` with a :class:`PagedServerPromptCache`.

    ``mlx_lm_args`` are ``mlx_lm.server``'s own options (``--port``, ``--host``,
    ``--max-tokens``, ...), parsed by its own parser. Blocks until interrupted (SIGINT or
    SIGTERM), then persists the cold tier's queue. ``--draft-model`` and ``--kv-bits`` are
    refused: the draft model's cache and mlx-lm's KV quantization are not paged.
    ``unbatched_sliding``: serve a model with sliding-window layers on mlx-lm's
    single-request path (:func:`serve_sliding_unbatched`).
    """
    from mlx_lm import server

    for flag in ("--draft-model", "--kv-bits"):
        if any(a == flag or a.startswith(flag + "=") for a in mlx_lm_args):
            raise InvalidArgument(
                f"{flag}: pagedkv serve does not page "
                f"{'the draft model' if flag == '--draft-model' else 'quantized KV'} yet "
                "(docs/integrations/mlx-lm.md, 'Limits'); run without it")
    caches: list[PagedServerPromptCache] = []

    def run(host, port, model_provider, server_class=None, handler_class=None):
        if unbatched_sliding:
            serve_sliding_unbatched(model_provider)
        # mlx-lm loads --model in its generation thread after the HTTP server is up: a model
        # that cannot load (a mistyped path, a repo id with no network) logged a traceback
        # and left a server whose every request fails. Load it here first (the generation
        # thread then finds it loaded) and refuse it in one line.
        _load_default_model(model_provider, model)
        prompt_cache = PagedServerPromptCache(model_provider, block_size=block_size,
                                              max_blocks=max_blocks, cold_dir=cold_dir)
        caches.append(prompt_cache)
        if cold_dir is not None:
            _open_cold_dir(prompt_cache, model_provider.model_key, cold_dir)
        generator = server.ResponseGenerator(model_provider, prompt_cache)
        kwargs = {k: v for k, v in (("server_class", server_class),
                                    ("handler_class", handler_class)) if v is not None}
        try:
            server._run_http_server(host, port, generator, **kwargs)
        except BaseException:
            generator.stop_and_join()  # e.g. the port is taken: stop its generation thread
            raise
        finally:  # mlx-lm joined it (on SIGINT / SIGTERM) or the line above did
            thread = getattr(generator, "_generation_thread", None)
            if isinstance(thread, threading.Thread):
                await_thread_teardown(thread)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    saved = server.run, sys.argv, signal.getsignal(signal.SIGTERM)
    server.run = run
    sys.argv = ["pagedkv serve", "--model", str(model), *mlx_lm_args]
    signal.signal(signal.SIGTERM, interrupt)
    try:
        server.main()
    finally:
        server.run, sys.argv = saved[0], saved[1]
        signal.signal(signal.SIGTERM, saved[2])
        for prompt_cache in caches:
            prompt_cache.close()
    return 0

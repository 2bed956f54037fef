"""``ReferenceModel``: the tiny transformer behind parity tests and ``pagedkv demo``.

Greedy decoding over any :class:`~pagedkv.tiny_model.kv_paths.KVPath`. Building a model never
touches MLX unless ``backend="mlx"`` is asked for.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pagedkv.argument_checks import int_argument
from pagedkv.errors import ContextLengthExceeded, InvalidArgument, InvalidArgumentType
from pagedkv.tiny_model.config import ReferenceConfig
from pagedkv.tiny_model.hybrid_config import HybridConfig
from pagedkv.tiny_model.hybrid_kv import HybridFlatKV, HybridKVPath
from pagedkv.tiny_model.kv_paths import FlatKV, KVPath
from pagedkv.tiny_model.weights import (
    check_weights,
    load_hfqm,
    load_model,
    random_weights,
    save_model,
)

if TYPE_CHECKING:  # mlx_forward imports MLX: only for the checker
    from pagedkv.tiny_model.hybrid_forward import HybridTransformer
    from pagedkv.tiny_model.mlx_forward import MlxTransformer
    from pagedkv.tiny_model.numpy_forward import NumpyTransformer

__all__ = ["BACKENDS", "NUMPY_MLX_LOGITS_ATOL", "Generation", "ReferenceModel"]

BACKENDS = ("numpy", "mlx")

#: NumPy and MLX logits of the default config agree within this absolute tolerance (float32,
#: different matmul kernels); the flat and paged paths on one backend agree bitwise.
NUMPY_MLX_LOGITS_ATOL = 1e-4


class Generation(NamedTuple):
    """Greedy output: ``tokens`` int64[m] and the logits that chose them, float32[m, vocab]."""

    tokens: np.ndarray
    logits: np.ndarray


class ReferenceModel:
    """Seeded decoder-only transformer (float32) on the NumPy or MLX backend.

    ``kv_dtype``: how its KV cache is stored: ``"float32"`` (default), or a KV mode
    (``"q8"``, ``"fwht4/q8"``, ``"fwht4/lloyd4"``, ...: docs/kv-quant.md), which needs a
    ``head_dim`` the modes store (q8: a multiple of 32; fwht4/fwht2: 128 or 256; fwht3 and
    lloyd: 256). Paged pools built for the model take it; its flat path round-trips K/V
    through the same codec, so paged and flat stay bit-identical.

    A :class:`~pagedkv.tiny_model.hybrid_config.HybridConfig` makes it the hybrid model (full,
    sliding-window and gated-delta-net layers, a KV-shared alias), which runs over a
    :class:`~pagedkv.tiny_model.hybrid_kv.HybridKVPath` instead of a ``KVPath`` (float32 KV
    only).
    """

    def __init__(self, config: ReferenceConfig | None = None,
                 weights: dict[str, np.ndarray] | None = None, *, backend: str = "numpy",
                 kv_dtype: str = "float32") -> None:
        if backend not in BACKENDS:
            raise InvalidArgument(f"backend={backend!r}: expected one of {BACKENDS}")
        if config is not None and not isinstance(config, ReferenceConfig):
            raise InvalidArgumentType(f"config must be a ReferenceConfig or HybridConfig, got "
                                      f"{type(config).__name__}")
        self.config = config if config is not None else ReferenceConfig()
        from pagedkv.pool import PoolGeometry
        c = self.config
        # validates the mode against head_dim, once, here
        self.kv_dtype = PoolGeometry(c.num_layers, c.num_kv_heads, c.head_dim, 16,
                                     kv_dtype).dtype
        if self.kv_dtype in ("float16", "bfloat16"):
            raise InvalidArgument(f"kv_dtype={kv_dtype!r}: the reference model computes in "
                                  f"float32; store its K/V as float32 or a KV mode (q8, "
                                  f"fwht4/q8, ...)")
        if isinstance(c, HybridConfig) and self.kv_dtype != "float32":
            raise InvalidArgument(f"kv_dtype={kv_dtype!r}: the hybrid reference model stores "
                                  f"float32 K/V only; build it with kv_dtype='float32'")
        if weights is not None:
            check_weights(self.config, weights)
        self.weights = weights if weights is not None else random_weights(self.config)
        self.backend = backend
        self._impl: MlxTransformer | NumpyTransformer | HybridTransformer
        if isinstance(self.config, HybridConfig):
            from pagedkv.tiny_model.hybrid_forward import HybridTransformer
            self._impl = HybridTransformer(self.config, self.weights, backend)
        elif backend == "mlx":
            from pagedkv.tiny_model.mlx_forward import MlxTransformer
            self._impl = MlxTransformer(self.config, self.weights)
        else:
            from pagedkv.tiny_model.numpy_forward import NumpyTransformer
            self._impl = NumpyTransformer(self.config, self.weights)

    @property
    def is_hybrid(self) -> bool:
        """Whether the config mixes layer kinds (the model then needs a ``HybridKVPath``)."""
        return isinstance(self.config, HybridConfig)

    def __repr__(self) -> str:
        c = self.config
        if isinstance(c, HybridConfig):
            kinds = (f"{len(c.full_attention_layers)} full + {len(c.sliding_attention_layers)} "
                     f"sliding(window={c.sliding_window}) + {len(c.linear_attention_layers)} "
                     f"linear, {len(c.kv_shared_layers)} kv-shared")
            return (f"ReferenceModel(backend={self.backend!r}, layers={c.num_layers} ({kinds}), "
                    f"hidden={c.hidden_size}, heads={c.num_heads}/{c.num_kv_heads}, "
                    f"head_dim={c.head_dim}, vocab={c.vocab_size}, seed={c.seed})")
        return (f"ReferenceModel(backend={self.backend!r}, layers={c.num_layers}, "
                f"hidden={c.hidden_size}, heads={c.num_heads}/{c.num_kv_heads}, "
                f"head_dim={c.head_dim}, vocab={c.vocab_size}, seed={c.seed}, "
                f"kv_dtype={self.kv_dtype!r})")

    @property
    def compute_identity(self) -> str:
        """What makes this model's KV differ bitwise from the same weights run elsewhere:
        the backend, its library version and (MLX) the device, e.g. ``"numpy-2.4.6"`` or
        ``"mlx-0.32.4:Device(gpu, 0)"``. The cold tier puts it in the fingerprint
        (``model_fingerprint(..., compute=...)``), so a restore never mixes backends."""
        from pagedkv.cold.fingerprint import backend_compute_identity

        return backend_compute_identity(self.backend)

    # --- persistence -------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` (``model_type: "pagedkv_reference"``) and ``model.safetensors``."""
        save_model(directory, self.config, self.weights)

    @classmethod
    def load(cls, directory: str | os.PathLike, *, backend: str = "numpy",
             kv_dtype: str = "float32") -> ReferenceModel:
        config, weights = load_model(directory)
        return cls(config, weights, backend=backend, kv_dtype=kv_dtype)

    @classmethod
    def load_hfqm(cls, path: str | os.PathLike, *, backend: str = "numpy") -> ReferenceModel:
        """A model whose weights are the dequantized tensors of an HFQM file made from a saved
        reference model (``pagedkv convert DIR -o FILE --arch llama``)."""
        config, weights = load_hfqm(path)
        return cls(config, weights, backend=backend)

    # --- inference ---------------------------------------------------------------------------

    def new_flat_kv(self) -> FlatKV | HybridFlatKV:
        """An empty flat KV path on this model's backend and KV mode (a ``HybridFlatKV`` for
        a hybrid config)."""
        if isinstance(self.config, HybridConfig):
            return HybridFlatKV(self.config, self.backend)
        return FlatKV(self.config, self.backend, kv_dtype=self.kv_dtype)

    def token_ids(self, tokens, name: str = "tokens") -> np.ndarray:
        """``tokens`` as int64 ids; ``InvalidArgument`` unless a non-empty 1-D array of ids in
        ``[0, vocab_size)``, ``InvalidArgumentType`` unless integers (bools are not)."""
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or tokens.size == 0:
            raise InvalidArgument(f"{name} must be a non-empty 1-D array, got shape "
                                  f"{tokens.shape}")
        if tokens.dtype.kind not in "iu":
            raise InvalidArgumentType(f"{name} must be integers, got dtype {tokens.dtype}")
        if tokens.min() < 0 or tokens.max() >= self.config.vocab_size:
            raise InvalidArgument(
                f"{name} must be integers in [0, {self.config.vocab_size}), got dtype "
                f"{tokens.dtype} range [{tokens.min()}, {tokens.max()}]")
        return tokens.astype(np.int64)

    def forward(self, tokens, kv: KVPath | HybridKVPath, *,
                already_recorded: bool = False) -> np.ndarray:
        """Logits ``float32[n, vocab]`` of ``tokens`` at positions ``kv.num_tokens ..``.

        ``kv.extend(tokens)`` reserves the positions first (the paged path records the tokens in
        the adapter). With ``already_recorded=True`` the caller has done that already (a batched
        ``record_decode_tokens``): the tokens are then the last ``n`` that ``kv`` holds.
        """
        # hasattr, not isinstance on the Protocol: that costs ~100 us per decode step.
        if self.is_hybrid != hasattr(kv, "linear_state"):
            need = ("a HybridKVPath (HybridFlatKV)" if self.is_hybrid
                    else "a KVPath (FlatKV, PagedKV)")
            raise InvalidArgumentType(
                f"{type(kv).__name__} cannot carry this model's state: it needs {need}; "
                "model.new_flat_kv() makes the right one")
        tokens = self.token_ids(tokens)
        if already_recorded:
            start = kv.num_tokens - len(tokens)
            if start < 0:
                raise InvalidArgument(
                    f"already_recorded=True but kv holds {kv.num_tokens} < {len(tokens)} tokens")
        else:
            start = kv.num_tokens
        # Checked before kv.extend, so a refused call leaves kv unchanged (the RoPE tables
        # stop at max_position).
        if start + len(tokens) > self.config.max_position:
            raise ContextLengthExceeded(
                f"positions [{start}, {start + len(tokens)}) exceed max_position="
                f"{self.config.max_position} of the reference config; use a shorter "
                "sequence or a config with a larger max_position")
        if not already_recorded:
            kv.extend(tokens)
        return self._impl.forward(tokens, start, kv)  # type: ignore[arg-type]

    def generate(self, prompt, max_new_tokens: int, kv: KVPath | HybridKVPath) -> Generation:
        """Greedy decoding. ``kv`` may already hold ``prompt[:kv.num_tokens]`` (a prefix hit or a
        live previous turn): only the rest of the prompt is computed. The last generated token
        is not fed back, so ``kv`` ends holding ``prompt + tokens[:-1]``.
        """
        prompt = np.asarray(prompt)
        # Every argument is checked before the first forward, so a refused call leaves kv as
        # it was (a float or bool count would otherwise fail after the prompt was recorded).
        max_new_tokens = int_argument("max_new_tokens", max_new_tokens, minimum=1)
        if prompt.ndim != 1:
            raise InvalidArgument(f"prompt must be a 1-D array of token ids, got shape "
                                  f"{prompt.shape}")
        cached = kv.num_tokens
        if cached >= len(prompt):
            raise InvalidArgument(
                f"kv already holds {cached} tokens of a {len(prompt)}-token prompt: at least the "
                "last prompt token must be computed for its logits (use max_tokens=len(prompt)-1)")
        last = self.forward(prompt[cached:], kv)[-1]
        tokens = np.empty(max_new_tokens, np.int64)
        logits = np.empty((max_new_tokens, self.config.vocab_size), np.float32)
        for step in range(max_new_tokens):
            logits[step] = last
            tokens[step] = int(np.argmax(last))
            if step + 1 < max_new_tokens:
                last = self.forward(tokens[step:step + 1], kv)[-1]
        return Generation(tokens, logits)

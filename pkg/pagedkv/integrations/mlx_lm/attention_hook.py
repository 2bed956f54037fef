"""The hook that lets mlx-lm's attention read K/V straight from the paged pool at decode.

mlx-lm's attention layers call ``cache.update_and_fetch(keys, values)`` and hand the result
to ``scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)``,
a function of ``mlx_lm.models.base`` that every model module imports *by name* (``from
.base import scaled_dot_product_attention``). So patching ``base`` alone changes nothing:
:func:`install` replaces the name in the globals of each Python module the model's layers
come from with :func:`pool_scaled_dot_product_attention`, which runs the original for any
call that is not a pool decode, so other models of the same architecture keep mlx-lm's
behaviour bit for bit.

A pool-attention layer's ``update_and_fetch`` of one decode token returns a
:class:`PoolDecode` as its keys and values instead of arrays: the patched function
recognizes it and runs :meth:`PoolDecode.attend` (``pagedkv.kernels.mlx.paged_attention``
over the request's block table). Anything else that touches a ``PoolDecode`` (model code
that does its own attention math, a model module the installer did not patch) gets an
:class:`~pagedkv.errors.UnsupportedModel` naming the fix instead of a silently wrong
attention.
"""

from __future__ import annotations

import sys

from pagedkv.errors import UnsupportedModel

__all__ = ["SDPA_NAME", "PoolDecode", "install", "pool_scaled_dot_product_attention"]

#: The name mlx-lm 0.32's model modules call attention by.
SDPA_NAME = "scaled_dot_product_attention"

#: What every refusal of pool attention tells the user to do instead.
USE_BUFFERS = ("build PagedPromptCache with attention='buffer' (the default: attention reads "
               "per-request buffers through mlx-lm's own SDPA)")


class PoolDecode:
    """What a pool-attention layer returns as keys and values for one decode token: the
    token's K/V (``[1, kv_heads, 1, head_dim]``) and the layer that writes them into the pool
    and attends over it when the patched ``scaled_dot_product_attention`` calls
    :meth:`attend`. Not an array: any other use raises ``UnsupportedModel``."""

    __slots__ = ("keys", "layer", "values")

    def __init__(self, layer, keys, values) -> None:
        self.layer = layer
        self.keys = keys
        self.values = values

    def attend(self, queries, scale: float, mask, sinks):
        return self.layer.attend_pool(queries, self.keys, self.values, scale, mask, sinks)

    def __getattr__(self, name: str):
        raise UnsupportedModel(
            f"the model used the keys/values its cache returned ('.{name}') other than through "
            f"mlx_lm.models.base.{SDPA_NAME}: pool attention serves only models whose "
            f"attention calls that function with the fetched K/V; {USE_BUFFERS}",
            layer=getattr(self.layer, "index", None), kind="full",
            missing=f"attention through {SDPA_NAME}")

    def __array__(self, *args, **kwargs):  # np.asarray / mx.array(...) of it
        return self.__getattr__("__array__")


def _original():
    from mlx_lm.models import base

    return getattr(base, SDPA_NAME)


def pool_scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask,
                                      sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` with one addition: keys that are a
    :class:`PoolDecode` attend over the paged pool."""
    if isinstance(keys, PoolDecode):
        return keys.attend(queries, scale, mask, sinks)
    return _original()(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


pool_scaled_dot_product_attention.pagedkv_pool_attention = True  # type: ignore[attr-defined]


def install(model, model_type: str) -> tuple[str, ...]:
    """Route the attention of ``model`` through :func:`pool_scaled_dot_product_attention`:
    in every Python module one of its layers comes from, the global
    ``scaled_dot_product_attention`` (mlx-lm's own) is replaced. Idempotent; returns the
    patched module names. ``UnsupportedModel`` (nothing patched) when none of the model's
    modules calls attention through that name (e.g. gemma2, whose attention applies a logit
    soft-cap itself)."""
    original = _original()
    names = sorted({type(m).__module__ for m in model.modules()})
    targets = []
    for name in names:
        module = sys.modules.get(name)
        if module is None:
            continue
        current = getattr(module, SDPA_NAME, None)
        if current is original or getattr(current, "pagedkv_pool_attention", False):
            targets.append(module)
    if not targets:
        raise UnsupportedModel(
            f"model_type {model_type!r}: none of its modules ({', '.join(names)}) calls "
            f"mlx_lm.models.base.{SDPA_NAME}, the call pool attention replaces at decode; "
            f"{USE_BUFFERS}", missing=f"attention through {SDPA_NAME}")
    for module in targets:
        setattr(module, SDPA_NAME, pool_scaled_dot_product_attention)
    return tuple(m.__name__ for m in targets)

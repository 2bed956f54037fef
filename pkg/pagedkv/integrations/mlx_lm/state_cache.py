"""``PagedStateLayerCache``: one recurrent layer of a paged request (conv and SSM / gated
delta state), in mlx-lm's protocol (docs/integrations/mlx-lm.md, "Recurrent hybrids").

A recurrent layer keeps no positions, only a state that summarizes every token before it, so
there is nothing to page: the request holds the state in mlx-lm's own ``ArraysCache`` (this
class is one, so the model code, ``merge`` and batching work unchanged). What pagedkv adds
is where the state comes from and where it goes: a request that reuses a prefix starts from
the state checkpointed at exactly that prefix's end (a hot checkpoint or a cold-tier
sidecar), and the request publishes checkpoints at block boundaries for later requests.
"""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache

from pagedkv.errors import InvalidArgument, RequestClosed
from pagedkv.integrations.mlx_lm.layer_cache import SAVED_STATE_REFUSAL, fork_layer

__all__ = ["PagedStateLayerCache"]


class PagedStateLayerCache(ArraysCache):
    """The recurrent state of one layer of one :class:`PagedRequest`: ``cache`` is mlx-lm's
    list of state arrays (``[conv, ssm]`` for Qwen3-Next / Qwen3.5), ``None`` before the
    first token. ``request``: the owning request."""

    def __init__(self, request, index: int, size: int, arrays=None) -> None:
        super().__init__(size)
        self.request = request
        self.index = index
        if arrays is not None:
            self.cache = list(arrays)

    def __repr__(self) -> str:
        shapes = [None if a is None else tuple(a.shape) for a in self.cache]
        return (f"PagedStateLayerCache(layer={self.index}, arrays={shapes}, "
                f"request={getattr(self.request, 'request_id', None)!r})")

    @property
    def state(self):
        return self.cache, self.left_padding, self.lengths

    @state.setter
    def state(self, value) -> None:
        raise RequestClosed(SAVED_STATE_REFUSAL)

    def is_trimmable(self) -> bool:
        """A recurrent state cannot be rewound (mlx-lm's ``ArraysCache`` neither)."""
        return False

    def trim(self, n: int) -> int:
        raise InvalidArgument(
            f"trim({n}): layer {self.index} is recurrent; its state cannot be rewound "
            "(mlx-lm's ArraysCache is not trimmable either)")

    @classmethod
    def merge(cls, caches):
        """mlx-lm batching: mlx-lm's ``ArraysCache.merge``; each paged request among
        ``caches`` is handed over to the batch."""
        batch = ArraysCache.merge(caches)
        for c in caches:
            request = getattr(c, "request", None)
            if request is not None:
                request.hand_over()
        return batch

    def __deepcopy__(self, memo):
        """The matching layer of an independent fork of the whole request."""
        return fork_layer(self, memo)

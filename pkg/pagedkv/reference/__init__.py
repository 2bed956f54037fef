"""Tiny reference transformer used for parity (paged == flat, restored == fresh) and the demo.

:class:`ReferenceModel` (NumPy by default, MLX with ``backend="mlx"``) runs greedy decoding
over a :class:`FlatKV` (one contiguous array per layer) or a :class:`PagedKV` (a sequence of
a :class:`pagedkv.adapter.PagedKVCacheAdapter`). See docs/adapter.md, "Reference model".
"""

from pagedkv.reference.config import MODEL_TYPE, ReferenceConfig
from pagedkv.reference.kv_paths import FlatKV, KVPath, PagedKV
from pagedkv.reference.model import BACKENDS, NUMPY_MLX_LOGITS_ATOL, Generation, ReferenceModel

__all__ = [
                                     "BACKENDS",
                                     "MODEL_TYPE",
                                     "NUMPY_MLX_LOGITS_ATOL",
                                     "FlatKV",
                                     "Generation",
                                     "KVPath",
                                     "PagedKV",
                                     "ReferenceConfig",
                                     "ReferenceModel",
]

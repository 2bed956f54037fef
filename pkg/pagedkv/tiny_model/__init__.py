"""Tiny transformer used for parity (paged == flat, restored == fresh) and the demo.

:class:`ReferenceModel` (NumPy by default, MLX with ``backend="mlx"``) runs greedy decoding
over a :class:`FlatKV` (one contiguous array per layer) or a :class:`PagedKV` (a sequence of
a :class:`pagedkv.adapter.PagedKVCacheAdapter`). With a :class:`HybridConfig` it is the hybrid
model (full, sliding-window and gated-delta-net layers, a KV-shared alias) over a
:class:`HybridKVPath` such as :class:`HybridFlatKV`, whose out-of-pool state at a token
boundary is a :class:`HybridSnapshot`. See docs/adapter.md, "Reference model", and
docs/tiny-model.md.
"""

from pagedkv.tiny_model.config import MODEL_TYPE, ReferenceConfig
from pagedkv.tiny_model.hybrid_config import HybridConfig, config_from_json_dict
from pagedkv.tiny_model.hybrid_kv import HybridFlatKV, HybridKVPath
from pagedkv.tiny_model.hybrid_state import HybridSnapshot
from pagedkv.tiny_model.kv_paths import FlatKV, KVPath, PagedKV
from pagedkv.tiny_model.model import BACKENDS, NUMPY_MLX_LOGITS_ATOL, Generation, ReferenceModel

__all__ = [
    "BACKENDS",
    "MODEL_TYPE",
    "NUMPY_MLX_LOGITS_ATOL",
    "FlatKV",
    "Generation",
    "HybridConfig",
    "HybridFlatKV",
    "HybridKVPath",
    "HybridSnapshot",
    "KVPath",
    "PagedKV",
    "ReferenceConfig",
    "ReferenceModel",
    "config_from_json_dict",
]

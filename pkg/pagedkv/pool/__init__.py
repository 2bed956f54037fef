"""The physical KV pool (docs/contracts/paged-kv.md, '5. LayerKVPool'): geometry, storage backends,
growth, memory budget.

>>> from pagedkv.pool import LayerKVPool, PoolGeometry
>>> pool = LayerKVPool(PoolGeometry(num_layers=2, num_kv_heads=1, head_dim=8, block_size=4,
...                                 dtype="float16"), num_blocks=4, max_num_blocks=8)
>>> pool.read_block(0).shape          # uint8[num_layers, 2, slab_bytes]
(2, 2, 64)
"""

from __future__ import annotations

from pagedkv.pool.bfloat16 import bf16_bits_to_float32, float32_to_bf16_bits
from pagedkv.pool.geometry import LAYOUTS, POOL_DTYPES, PoolGeometry
from pagedkv.pool.layer_kv_pool import BACKENDS, LayerKVPool, growth_lock
from pagedkv.pool.memory_budget import MemoryBudget

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "POOL_DTYPES",
    "LayerKVPool",
    "MemoryBudget",
    "PoolGeometry",
    "bf16_bits_to_float32",
    "float32_to_bf16_bits",
    "growth_lock",
]

# KV-cache q8 records (docs/contracts/hfqm-and-quant.md, '6.3 q8 (K and V)'): f16 scale (nearest
# even) + 32 int8 per 32 dims.

import numpy as np
import numpy.typing as npt

BLOCK_VALUES: int
RECORD_BYTES: int

def row_bytes(head_dim: int) -> int: ...
def quantize(x: npt.NDArray[np.float32] | npt.NDArray[np.float16]) -> npt.NDArray[np.uint8]: ...
def dequantize(records: npt.NDArray[np.uint8], head_dim: int) -> npt.NDArray[np.float32]: ...

import numpy as np

def pack_tiles_4bit(rows: np.ndarray, groups: int) -> np.ndarray:
    """``rows``: the stored weights as ``uint64[M, groups * 17]``. Returns the packed
    ``uint64[ceil(M / 16) * groups * 272]``."""

def pack_tiles_q8f16(rows: np.ndarray, groups: int) -> np.ndarray:
    """``rows``: the stored Q8F16 weights as ``uint8[M, groups * 272]``. Returns the packed
    ``uint8[ceil(M / 16) * groups * 4352]``."""

def pack_tiles_hfq6(rows: np.ndarray, groups: int) -> np.ndarray:
    """``rows``: the stored HFQ6G256 weights as ``uint8[M, groups * 200]``. Returns the
    packed ``uint8[ceil(M / 16) * groups * 3200]``."""

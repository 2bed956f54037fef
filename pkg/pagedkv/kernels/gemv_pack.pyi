import numpy as np

def pack_tiles_4bit(rows: np.ndarray, groups: int) -> np.ndarray:
    """``rows``: the stored weights as ``uint64[M, groups * 17]``. Returns the packed
    ``uint64[ceil(M / 16) * groups * 272]``."""

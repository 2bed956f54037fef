import numpy as np
import numpy.typing as npt

def encode(x: npt.NDArray[np.float32], out: npt.NDArray[np.uint8], bits: int,
           rotated: bool) -> int: ...
def decode(raw: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], bits: int, rotated: bool,
           rotated_basis: bool = ..., threads: int = ...) -> None: ...

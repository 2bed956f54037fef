import numpy as np
import numpy.typing as npt

KINDS: tuple[str, str, str]

def encode(x: npt.NDArray[np.float32], out: npt.NDArray[np.uint8], K: int, kind: int) -> int: ...
def decode(raw: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], K: int, kind: int,
           rotated_basis: bool = ..., threads: int = ...) -> None: ...

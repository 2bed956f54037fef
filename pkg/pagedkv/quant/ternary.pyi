import numpy as np
import numpy.typing as npt

def decode(raw: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], bits: int,
           threads: int = ...) -> None: ...

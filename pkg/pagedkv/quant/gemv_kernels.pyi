import numpy as np
import numpy.typing as npt

def gemv_affine(w: npt.NDArray[np.uint8], m: int, k: int, family: int, bits: int, group: int,
                x: npt.NDArray[np.float32], y: npt.NDArray[np.float32]) -> None: ...
def gemv_q8f16(w: npt.NDArray[np.uint8], m: int, k: int, x: npt.NDArray[np.float32],
               y: npt.NDArray[np.float32]) -> None: ...

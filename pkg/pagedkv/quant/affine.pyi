import enum

import numpy as np
import numpy.typing as npt

class AffineFamily(enum.IntEnum):
    HFQ = 0
    MQ_V1 = 1
    MQ_V2 = 2
    MQ4C = 3


def encode(x: npt.NDArray[np.float32], out: npt.NDArray[np.uint8], family: int, bits: int,
           group: int) -> int: ...
def decode(raw: npt.NDArray[np.uint8], out: npt.NDArray[np.float32], family: int, bits: int,
           group: int, rotated_basis: bool = ..., threads: int = ...) -> None: ...
def pack_codes(q: npt.NDArray[np.uint8], bits: int) -> bytes: ...
def unpack_codes(payload: npt.NDArray[np.uint8], n: int, bits: int) -> bytes: ...

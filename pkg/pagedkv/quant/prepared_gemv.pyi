from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

ISA_NAMES: tuple[str, ...]
MAX_THREADS: int

def supported_isas() -> tuple[str, ...]: ...
def default_isa() -> str: ...
def aligned_empty(shape: Sequence[int], dtype: npt.DTypeLike) -> npt.NDArray[Any]: ...

@disjoint_base
class PreparedGemv:
    fmt: str
    qt_id: int
    m: int
    k: int
    span: int
    isa: str
    threads: int
    rotated: bool
    def __init__(self, raw: npt.ArrayLike | bytes | bytearray | memoryview, fmt: str | int,
                 shape: Sequence[int], *, threads: int = 1,
                 isa: str | None = None) -> None: ...
    @property
    def shape(self) -> tuple[int, int]: ...
    @property
    def nbytes(self) -> int: ...
    def __copy__(self) -> PreparedGemv: ...
    def __deepcopy__(self, memo: dict[int, Any]) -> PreparedGemv: ...
    def __reduce__(self) -> NoReturn: ...
    def __call__(self, x: npt.NDArray[np.float32], *, out: npt.NDArray[np.float32] | None = None,
                 threads: int | None = None) -> npt.NDArray[np.float32]: ...

def check_threads(threads: int) -> int: ...

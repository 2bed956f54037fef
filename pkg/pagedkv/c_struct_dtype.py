"""NumPy structured dtypes built from a C struct's field table (``pkv_struct_field`` of
pagedkv/struct_fields.h: name, offset, size and element type as the C compiler laid the
struct out), so a record layout is written once, in its C header.

Base layer: imports nothing of pagedkv.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["dtype_of_c_struct"]


def dtype_of_c_struct(itemsize: int, fields: Iterable[tuple[str, int, int, str]], *,
                      align: bool = False) -> np.dtype:
    """The structured dtype of a C struct of ``itemsize`` bytes whose members are
    ``(name, offset_bytes, size_bytes, numpy_code)``, in the table's order; an array
    member (size a multiple of the element's) becomes a subarray field. Bytes no listed
    member covers (padding) stay in ``itemsize``. ``align``: mark the dtype as an aligned
    C struct (what Cython's buffer checks expect of the allocator's records)."""
    names, formats, offsets = [], [], []
    for name, offset, size, code in fields:
        element = np.dtype(code)
        count, rest = divmod(size, element.itemsize)
        if rest or count < 1:
            raise ValueError(f"C member {name}: {size} bytes is not a whole number of {code}")
        names.append(name)
        formats.append(element if count == 1 else (element, (count,)))
        offsets.append(offset)
    return np.dtype({"names": names, "formats": formats, "offsets": offsets,
                     "itemsize": itemsize}, align=align)

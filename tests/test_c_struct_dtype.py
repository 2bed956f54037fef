"""pagedkv.c_struct_dtype: a C struct's field table as a NumPy structured dtype."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.c_struct_dtype import dtype_of_c_struct


def test_scalars_arrays_and_tail_padding():
    dt = dtype_of_c_struct(24, [("a", 0, 8, "<u8"), ("b", 8, 12, "<i4"), ("c", 20, 1, "u1")])
    assert dt.names == ("a", "b", "c") and dt.itemsize == 24
    assert dt.fields["a"] == (np.dtype("<u8"), 0)
    assert dt.fields["b"] == (np.dtype(("<i4", (3,))), 8)
    assert dt.fields["c"] == (np.dtype("u1"), 20)
    assert not dt.isalignedstruct
    assert dtype_of_c_struct(8, [("a", 0, 8, "<u8")], align=True).isalignedstruct


@pytest.mark.parametrize("size", [0, 6])
def test_a_member_that_is_not_whole_elements_is_refused(size):
    with pytest.raises(ValueError, match=f"C member b: {size} bytes is not a whole number "
                                         "of <i4"):
        dtype_of_c_struct(16, [("a", 0, 4, "<u4"), ("b", 4, size, "<i4")])

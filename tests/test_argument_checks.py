"""pagedkv.argument_checks: the one "int, not bool" test and the count check."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.argument_checks import int_argument, is_int
from pagedkv.errors import InvalidArgument, InvalidArgumentType


@pytest.mark.parametrize("value", [0, -3, 2**70, np.int8(-1), np.uint64(2**64 - 1), np.intp(5)])
def test_ints_and_numpy_integers_are_ints(value):
    assert is_int(value) is True


@pytest.mark.parametrize("value", [True, False, np.True_, np.bool_(False), 1.0, np.float32(2),
                                   "3", None, np.array(3), np.array([3]), 3 + 0j])
def test_bools_floats_strings_and_arrays_are_not(value):
    assert is_int(value) is False


def test_int_argument_returns_a_python_int():
    out = int_argument("n", np.int64(7))
    assert out == 7 and type(out) is int
    assert int_argument("n", -2, minimum=-2) == -2


@pytest.mark.parametrize(("value", "type_name"), [(True, "bool"), (np.bool_(True), "bool"),
                                                  (1.0, "float"), ("1", "str")])
def test_a_non_int_raises_invalid_argument_type_naming_it(value, type_name):
    with pytest.raises(InvalidArgumentType) as info:
        int_argument("block_size", value)
    assert str(info.value) == f"block_size must be an int, got {type_name}"


def test_below_the_minimum_raises_invalid_argument_naming_both():
    with pytest.raises(InvalidArgument) as info:
        int_argument("blocks", -1)
    assert str(info.value) == "blocks = -1 must be >= 0"
    with pytest.raises(InvalidArgument) as info:
        int_argument("window", np.int32(0), minimum=1)
    assert str(info.value) == "window = 0 must be >= 1"
    assert not isinstance(info.value, InvalidArgumentType)

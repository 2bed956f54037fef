"""Host-side contracts of pagedkv.kernels that need no GPU: DeviceArray's lifetime and the
reprs of the runtime handles, against a fake device that records every call."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from pagedkv.errors import InvalidArgument
from pagedkv.kernels.device import Event, Graph, Stream
from pagedkv.kernels.device_array import DeviceArray


class FakeDevice:
    ordinal = 0
    properties = SimpleNamespace(name="fake")

    def __init__(self):
        self.calls = []
        self.next_ptr = 0x1000

    def malloc(self, nbytes):
        self.calls.append(("malloc", nbytes))
        self.next_ptr += 0x1000
        return self.next_ptr

    def free(self, ptr):
        self.calls.append(("free", ptr))

    def copy_htod(self, ptr, host):
        self.calls.append(("htod", ptr, host.nbytes))

    def copy_dtoh(self, host, ptr):
        self.calls.append(("dtoh", ptr, host.nbytes))

    def memset(self, ptr, value, nbytes):
        self.calls.append(("memset", ptr, value, nbytes))


def test_a_freed_array_refuses_every_transfer_and_says_so():
    dev = FakeDevice()
    a = DeviceArray.from_numpy(dev, np.arange(6, dtype=np.float32).reshape(2, 3))
    ptr = a.ptr
    assert repr(a) == f"DeviceArray(shape=(2, 3), dtype=float32, ptr=0x{ptr:x}, device='fake')"
    a.free()
    a.free()  # idempotent: freed once
    assert [c for c in dev.calls if c[0] == "free"] == [("free", ptr)]
    assert repr(a) == "DeviceArray(shape=(2, 3), dtype=float32, freed, device='fake')"
    before = list(dev.calls)
    for use in (a.to_numpy, lambda: a.copy_from(np.zeros((2, 3), np.float32)),
                lambda: a.fill_bytes(0xFF)):
        with pytest.raises(InvalidArgument, match=r"DeviceArray\(shape=\(2, 3\), "
                                                  r"dtype=float32\) was freed; allocate"):
            use()
    assert dev.calls == before  # nothing reached the runtime


def test_a_view_is_never_freed_and_its_repr_says_view():
    dev = FakeDevice()
    v = DeviceArray(dev, 0x5000, (4,), np.uint16, owned=False)
    assert repr(v) == "DeviceArray(shape=(4,), dtype=uint16, ptr=0x5000, view, device='fake')"
    v.free()
    assert dev.calls == []


def test_an_empty_array_needs_no_live_pointer():
    dev = FakeDevice()
    e = DeviceArray(dev, 0, (0, 8), np.float32)
    assert e.to_numpy().shape == (0, 8)


@pytest.mark.parametrize(("cls", "attrs", "text"), [
    (Stream, {"handle": 0xAB}, "Stream(handle=0xab, device=0)"),
    (Event, {"handle": None}, "Event(handle=0x0, device=0)"),
    (Graph, {"_exec": 0x10}, "Graph(exec=0x10, device=0)"),
])
def test_runtime_handles_have_reprs(cls, attrs, text):
    obj = cls.__new__(cls)
    obj.device = FakeDevice()
    for k, v in attrs.items():
        setattr(obj, k, v)
    assert repr(obj) == text


def test_a_kernel_refuses_a_freed_array_before_launch():
    from pagedkv.kernels.device import Kernel
    dev = FakeDevice()
    k = Kernel(dev, "copy", 0x1, "ppi")
    a = DeviceArray.empty(dev, (8,), np.float32)
    b = DeviceArray.empty(dev, (8,), np.float32)
    values, _ = k.pack((a, b, 8))
    assert [v.value for v in values] == [a.ptr, b.ptr, 8]
    b.free()
    with pytest.raises(InvalidArgument, match=r"DeviceArray\(shape=\(8,\), dtype=float32\) "
                                              r"was freed"):
        k.pack((a, b, 8))

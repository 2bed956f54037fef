"""Shared fixtures for the kernel tests: the GPU device (skipped without one)."""

from __future__ import annotations

import pytest

from pagedkv.errors import NoDeviceError


@pytest.fixture(scope="session")
def device():
    from pagedkv.kernels import open_device
    try:
        return open_device()
    except NoDeviceError as exc:
        pytest.skip(f"no GPU: {exc}")


def poisoned(device, shape, dtype, byte=0xFF):
    """An output array whose every byte is ``byte`` (0xFF is NaN in f16/f32), so an
    element the kernel did not write shows up."""
    out = device.empty(shape, dtype)
    out.fill_bytes(byte)
    return out

"""hip/sanitizer_probe.py, the proof that compute-sanitizer sees ctypes launches: its kernel
builds with nvcc, and without a GPU it says so in one line (the probe itself runs on the GPU
machine under the sanitizer: hip/device_check.sh with SANITIZE=1)."""

from __future__ import annotations

import shutil

import pytest

from kernels_support import load_tree_script


@pytest.fixture(scope="module")
def probe():
    return load_tree_script("hip/sanitizer_probe.py", "sanitizer_probe")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_probe_kernel_builds_to_a_cubin(probe, tmp_path):
    image = probe.build("sm_90", tmp_path)
    assert image[:4] == b"\x7fELF"
    assert b"probe_fill" in image


def test_probe_without_a_gpu_is_one_line(probe, capsys):
    from pagedkv.errors import NoDeviceError
    from pagedkv.kernels import open_device
    try:
        open_device()
        pytest.skip("a GPU is present")
    except NoDeviceError:
        pass
    assert probe.main(["--plant"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hip/sanitizer_probe.py: no GPU available") and err.count("\n") == 1

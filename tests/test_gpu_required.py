"""``PAGEDKV_REQUIRE_GPU=1`` turns the GPU tests' skip into a failure (docs/development.md,
"GPU tests"): on the GPU machine a lost device or a wheel without kernels must not pass as
"all skipped"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.errors import NoDeviceError

TESTS = Path(__file__).resolve().parent
ONE_GPU_TEST = "test_bench_gpu.py::test_gpu_read_probe_refuses_partial_vectors"


def _no_device() -> None:
    from pagedkv.kernels import open_device
    try:
        open_device()
    except NoDeviceError:
        return
    pytest.skip("a GPU is present: the switch has nothing to turn into a failure")


def _run_one_gpu_test(require: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("PAGEDKV_REQUIRE_GPU", None)
    if require is not None:
        env["PAGEDKV_REQUIRE_GPU"] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", ONE_GPU_TEST],
        cwd=TESTS, env=env, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("require", "rc"), [("0", 0), ("1", 1)])
def test_require_gpu_turns_the_skip_into_a_failure(require, rc):
    _no_device()
    done = _run_one_gpu_test(require)
    assert done.returncode == rc, done.stdout + done.stderr
    if rc:
        assert "PAGEDKV_REQUIRE_GPU is set but no GPU was found: no GPU available" in done.stdout
        assert "1 error" in done.stdout  # a fixture failure: the test never ran
    else:
        assert "1 skipped" in done.stdout

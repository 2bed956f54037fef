"""``python -m pagedkv.bench``'s dispatcher: help, a missing or unknown suite, and a
machine without a GPU, each answered in one line with the right exit status."""

from __future__ import annotations

import pytest

from pagedkv.bench.__main__ import main
from pagedkv.errors import NoDeviceError


def test_help_lists_the_suites_on_stdout(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m pagedkv.bench {gpu,decode,mlx,kvquant-quality,"
                          "quality} [options]")


@pytest.mark.parametrize(("argv", "problem"), [([], "no suite given"),
                                                (["cpu"], "unknown suite 'cpu'")])
def test_a_missing_or_unknown_suite_is_a_usage_error(capsys, argv, problem):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"python -m pagedkv.bench: {problem}; usage: ")


def test_the_gpu_suite_without_a_device_is_one_line(capsys):
    from pagedkv.kernels import open_device
    try:
        open_device()
    except NoDeviceError:
        pass
    else:
        pytest.skip("a GPU is present: the suite would run")
    assert main(["gpu", "--quick"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedkv.bench gpu: no GPU available")

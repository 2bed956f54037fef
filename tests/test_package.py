"""The installed package: layout, public modules, headers and show_config()."""

from __future__ import annotations

import importlib
import io
import os
import pkgutil
from pathlib import Path

import pytest

import pagedkv
from pagedkv import errors


def _all_modules() -> list[str]:
    names = ["pagedkv"]
    for info in pkgutil.walk_packages(pagedkv.__path__, prefix="pagedkv."):
        names.append(info.name)
    return sorted(names)


def test_every_module_of_the_installed_package_imports():
    names = _all_modules()
    # The skeleton's own modules must be there: a file missing from meson.build
    # is missing from the wheel, and this list catches it.
    for expected in ("pagedkv.errors", "pagedkv._config", "pagedkv._build_config",
                     "pagedkv.cli", "pagedkv.cli.config", "pagedkv.cold", "pagedkv.hfqm",
                     "pagedkv.quant", "pagedkv.kernels", "pagedkv.tiny_model"):
        assert expected in names
    for name in names:
        if name == "pagedkv.__main__":
            continue  # runs the CLI on import
        importlib.import_module(name)


def test_every_source_py_is_installed():
    """Each .py/.pyx under pkg/pagedkv in the source tree has an installed counterpart."""
    src = Path(__file__).resolve().parents[1] / "pkg" / "pagedkv"
    if not src.is_dir():
        pytest.skip("source tree not next to the tests")
    installed = Path(pagedkv.__file__).resolve().parent
    missing = []
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        if path.suffix == ".py":
            if not (installed / rel).exists():
                missing.append(str(rel))
        elif path.suffix == ".pyx":
            mod = ".".join(("pagedkv",) + rel.with_suffix("").parts)
            if importlib.util.find_spec(mod) is None:
                missing.append(str(rel))
    assert not missing, f"not installed (add them to a meson.build): {missing}"


def test_import_pagedkv_does_not_import_mlx():
    import subprocess
    import sys
    code = "import sys, pagedkv; pagedkv.show_config(); print('mlx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_get_include_holds_the_public_headers():
    inc = Path(pagedkv.get_include())
    assert inc.name == "include"
    assert (inc / "pagedkv" / "portability.h").is_file()
    assert (inc / "pagedkv" / "launch.h").is_file()  # the launchers read it at run time


def test_show_config_prints_version_and_backends():
    buf = io.StringIO()
    pagedkv.show_config(file=buf)
    text = buf.getvalue()
    assert text.startswith(f"pagedkv {pagedkv.__version__}")
    assert "backends built:" in text
    assert "xxhash:" in text


def test_expected_backends_were_built():
    """CI sets PAGEDKV_EXPECT_BACKENDS=hip,cuda: a build that silently lost a backend fails."""
    expected = [b for b in os.environ.get("PAGEDKV_EXPECT_BACKENDS", "").split(",") if b]
    built = pagedkv._config.config()["backends"]
    missing = [b for b in expected if b not in built]
    assert not missing, (f"PAGEDKV_EXPECT_BACKENDS wants {expected}, show_config() has "
                         f"{built}: install the compiler for {missing} and rebuild")


def test_error_hierarchy():
    assert issubclass(errors.InvalidArgument, ValueError)
    assert issubclass(errors.InvalidArgumentType, TypeError)
    assert issubclass(errors.Truncated, errors.FormatError)
    assert issubclass(errors.FormatError, ValueError)
    assert issubclass(errors.PoolExhausted, errors.ContextLengthExceeded)
    assert str(errors.CapacityExceeded("too long")).startswith("context_length_exceeded:")
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.PagedKVError)
    e = errors.Truncated("payload ends past EOF", path="m.hfq", tensor="w", offset=4096)
    assert str(e) == "m.hfq, tensor 'w', offset 4096: payload ends past EOF"


def test_cli_version(capsys):
    from pagedkv.cli import main
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == pagedkv.__version__

"""What the wheel holds and where its facts live: the version in one place (meson.build),
the test-only allocator oracle left out."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

import pagedkv

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not (ROOT / "meson.build").is_file(), reason="source tree not next to tests")
def test_the_version_is_written_once_in_meson_build():
    project = re.search(r"project\(\s*'pagedkv',.*?version:\s*'([^']+)'",
                        (ROOT / "meson.build").read_text(), re.DOTALL)
    assert project is not None
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" not in meta and "version" in meta["dynamic"]
    assert pagedkv.__version__ == project.group(1)
    assert importlib.metadata.version("pagedkv") == project.group(1)


def test_the_allocator_oracle_is_not_shipped():
    assert importlib.util.find_spec("pagedkv._reference") is None
    assert not (Path(pagedkv.__file__).resolve().parent / "_reference.py").exists()

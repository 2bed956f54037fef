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
    assert importlib.util.find_spec("pagedkv.allocator_oracle") is None
    assert not (Path(pagedkv.__file__).resolve().parent / "allocator_oracle.py").exists()


def test_the_mtp_bundle_syncs_its_directory_after_the_rename(tmp_path, monkeypatch):
    """Both HFQM writers make the rename durable through one helper."""
    import os
    import stat

    import numpy as np

    from pagedkv.hfqm import HfqmWriter, write_mtp_bundle
    for name, arch in (("trunk.hfq", 0), ("head.hfq", 21)):
        with HfqmWriter(tmp_path / name, arch_id=arch, metadata={"architecture": "x"}) as w:
            w.add("a.norm", "f16", [2], np.ones(2, np.float16))
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            synced.append(os.path.realpath(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    write_mtp_bundle(tmp_path / "trunk.hfq", tmp_path / "head.hfq", tmp_path / "b.hfq")
    assert synced == [os.path.realpath(tmp_path)]

"""The Python examples of docs/formats/quant.md, docs/cold.md and docs/kernels.md run as
written (test_docs_examples.py's runner), and print what their comments say."""

from __future__ import annotations

import tempfile

import pytest

import test_docs_examples as runner

pytestmark = pytest.mark.skipif(not runner.DOCS.is_dir(), reason="docs/ is not next to the tests")


def test_quant_page_example_runs_and_agrees(tmp_path, monkeypatch, capsys):
    runner.test_page_examples_run("formats/quant.md", tmp_path, monkeypatch, capsys)
    assert capsys.readouterr().out == "True True\n"


def test_cold_page_example_restores_the_prefix_in_a_fresh_adapter(tmp_path, monkeypatch,
                                                                    capsys):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's mkdtemp()
    monkeypatch.delenv("PAGEDKV_PERSIST_PAGED_CACHE", raising=False)
    monkeypatch.setenv("PAGEDKV_METRICS", "0")
    runner.test_page_examples_run("cold.md", tmp_path, monkeypatch, capsys)
    assert capsys.readouterr().out == "0 32\n32 True\n"


@pytest.mark.gpu
def test_kernels_page_example_runs_on_the_device(device, tmp_path, monkeypatch, capsys):
    runner.test_page_examples_run("kernels.md", tmp_path, monkeypatch, capsys)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == repr(device) and float(lines[1]) < 1e-3

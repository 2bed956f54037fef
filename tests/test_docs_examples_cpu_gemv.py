"""The Python example of docs/formats/cpu-gemv.md runs as written (test_docs_examples.py's
runner) and prints what its comment says."""

from __future__ import annotations

import pytest

import test_docs_examples as runner

pytestmark = pytest.mark.skipif(not runner.DOCS.is_dir(), reason="docs/ is not next to the tests")


def test_cpu_gemv_page_example_runs_and_agrees(tmp_path, monkeypatch, capsys):
    runner.test_page_examples_run("formats/cpu-gemv.md", tmp_path, monkeypatch, capsys)
    assert capsys.readouterr().out == "True True\n"

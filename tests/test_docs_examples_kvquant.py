"""The examples of docs/kv-quant.md run as written (test_docs_examples.py's runner: doctests),
and every dotted pagedkv name the page cites exists."""

from __future__ import annotations

import re

import pytest

import test_docs_examples as runner

pytestmark = pytest.mark.skipif(not runner.DOCS.is_dir(), reason="docs/ is not next to the tests")


def test_kv_quant_page_examples_run(tmp_path, monkeypatch, capsys):
    blocks = runner.python_blocks((runner.DOCS / "kv-quant.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 4
    runner.test_page_examples_run("kv-quant.md", tmp_path, monkeypatch, capsys)


def test_kv_quant_page_names_exist():
    text = (runner.DOCS / "kv-quant.md").read_text(encoding="utf-8")
    names = set(re.findall(r"`(pagedkv(?:\.[A-Za-z_]\w*)+)", text))
    assert len(names) > 8
    assert sorted(n for n in names if not runner._resolves(n)) == []

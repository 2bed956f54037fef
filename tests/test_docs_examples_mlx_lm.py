"""The Python examples of docs/integrations/mlx-lm.md run as written (test_docs_examples.py's
runner) and print what the page says; every dotted pagedkv name on it exists."""

from __future__ import annotations

import re
import tempfile

import pytest

import test_docs_examples as runner

pytestmark = pytest.mark.skipif(not runner.DOCS.is_dir(), reason="docs/ is not next to the tests")
PAGE = "integrations/mlx-lm.md"


def test_mlx_lm_page_examples_run(tmp_path, monkeypatch, capsys):
    pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the example's mkdtemp()
    monkeypatch.delenv("PAGEDKV_PERSIST_PAGED_CACHE", raising=False)
    runner.test_page_examples_run(PAGE, tmp_path, monkeypatch, capsys)
    # Quick start: 64 tokens reused by the second conversation, 4 blocks held by both.
    assert capsys.readouterr().out == "64 4\n"


def test_every_dotted_pagedkv_name_on_the_page_exists():
    text = (runner.DOCS / PAGE).read_text(encoding="utf-8")
    names = set(re.findall(r"`(pagedkv(?:\.[A-Za-z_]\w*)+)", text))
    names |= set(re.findall(r"from (pagedkv(?:\.\w+)+) import", text))
    assert names and sorted(n for n in names if not runner._resolves(n)) == []

"""The Python examples of the subsystem guides run as written.

Each page's ```python blocks run in order in one namespace (a later block may continue an
earlier one), in an empty working directory. ``>>>`` blocks run as doctests. A block preceded
by ``<!-- docs-test: skip ... -->`` is a call sketch, not user code, and is left out; one
preceded by ``<!-- docs-test: needs MODULE -->`` runs only where MODULE imports (an optional
backend such as ``mlx.core``: the block runs where it is installed, and is left out, not
failed, where it is not).
"""

from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ("allocator.md", "hashing.md", "pool.md", "adapter.md", "coordinator.md",
         "tiny-model.md", "formats/hfqm.md")

_BLOCK = re.compile(r"(?:<!-- docs-test: (?:(skip)|needs ([\w.]+))[^>]*-->\n)?```python\n(.*?)```",
                    re.DOTALL)


def _write_model_mq4() -> None:
    """The file the HFQM reader example opens (its tensor names, qts and config key)."""
    import numpy as np

    from pagedkv.hfqm import HfqmWriter
    from pagedkv.quant import quantize
    rows = np.random.default_rng(0).standard_normal((2, 256), np.float32)
    with HfqmWriter("model.mq4", arch_id=0,
                    metadata={"architecture": "llama", "config": {"hidden_size": 256}}) as w:
        w.add("model.layers.0.mlp.up_proj.weight", "hfq4g256", [2, 256],
              quantize(rows, "hfq4g256"))
        w.add("model.norm.weight", "f16", [256], np.ones(256, np.float16))


#: Files a page's examples expect in the working directory, written before they run.
PAGE_SETUP = {"formats/hfqm.md": _write_model_mq4}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def python_blocks(text: str) -> list[str]:
    """The runnable ```python blocks of a Markdown page, in order (a ``needs`` block only
    where its module imports)."""
    return [m.group(3) for m in _BLOCK.finditer(text)
            if m.group(1) is None and (m.group(2) is None or _importable(m.group(2)))]


def test_block_extraction_honours_the_skip_marker():
    text = ("a\n```python\nx = 1\n```\n<!-- docs-test: skip (sketch) -->\n```python\n"
            "y = undefined\n```\n```text\nnot python\n```\n```python\nz = x\n```\n")
    assert python_blocks(text) == ["x = 1\n", "z = x\n"]


def test_a_needs_block_runs_only_where_its_module_imports():
    text = ("```python\nx = 1\n```\n<!-- docs-test: needs json -->\n```python\ny = 2\n```\n"
            "<!-- docs-test: needs no_such_module_pagedkv.core -->\n```python\nz = 3\n```\n")
    assert python_blocks(text) == ["x = 1\n", "y = 2\n"]


@pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not next to the tests")
@pytest.mark.parametrize("page", PAGES)
def test_page_examples_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if page in PAGE_SETUP:
        PAGE_SETUP[page]()
    namespace: dict = {"__name__": f"docs_{page.replace('/', '_')}"}
    for i, code in enumerate(python_blocks((DOCS / page).read_text(encoding="utf-8"))):
        if code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(code, namespace, f"{page}[{i}]",
                                                       page, 0)
            result = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS).run(test)
            assert result.failed == 0, f"{page} block {i}: doctest failed"
        else:
            exec(compile(code, f"{page} block {i}", "exec"), namespace)  # noqa: S102 (our docs)


def test_adapter_example_reuses_the_shared_prefix(tmp_path, monkeypatch, capsys):
    if not DOCS.is_dir():
        pytest.skip("docs/ is not next to the tests")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for code in python_blocks((DOCS / "adapter.md").read_text(encoding="utf-8")):
        exec(compile(code, "adapter.md", "exec"), namespace)  # noqa: S102 (our docs)
    assert capsys.readouterr().out == "req-1 reused 0 tokens\nreq-2 reused 64 tokens\n"


def _resolves(dotted: str) -> bool:
    """Whether ``pagedkv.a.b.c`` names an importable module or an attribute of one."""
    import importlib
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.skipif(not DOCS.is_dir(), reason="docs/ is not next to the tests")
def test_every_dotted_pagedkv_name_in_the_guides_exists():
    names = set()
    for path in (DOCS.parent / "README.md", *sorted(DOCS.rglob("*.md"))):
        page = path.relative_to(DOCS.parent).as_posix()
        text = path.read_text(encoding="utf-8")
        names |= {(page, n) for n in re.findall(r"`(pagedkv(?:\.[A-Za-z_]\w*)+)", text)
                  if not n.endswith(".metallib")}  # a file name (docs/kernels.md, "Metal")
    assert len(names) > 150
    assert sorted(n for n in names if not _resolves(n[1])) == []


def test_resolves():
    assert _resolves("pagedkv.allocator.BlockAllocator.find_longest_cache_hit")
    assert not _resolves("pagedkv.allocator.BlockAllocator.find_longest_hit")
    assert not _resolves("pagedkv.nonexistent")

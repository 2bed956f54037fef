"""The package map of docs/development.md ("Package map") holds: every import between
pagedkv's top-level packages, module-level or deferred inside a function, goes from a layer to
one it may import (core → pool → adapter → cold → integrations/cli, never back).

The graph is read from the sources (``.py``, ``.pyx``, ``.pxd``: ``import``, ``from ...
import`` and ``cimport``), so a lazy import that would close a cycle at run time counts too.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "pkg" / "pagedkv"

#: Names ``pagedkv/__init__`` exports, and the base modules everything may use.
BASE = {"errors", "identity", "env_knobs", "_config", "_build_config", "__version__",
        "get_include", "show_config"}
CORE = {"hashing", "allocator", "quant", "hfqm"}
BELOW_TOP = BASE | CORE | {"pool", "sizing", "kernels", "kv_adaptive", "kv_mode", "adapter",
                           "coordinator", "cold"}
EVERYTHING = BELOW_TOP | {"tiny_model", "integrations", "cli", "bench", "selfcheck"}

#: Top-level package -> what it may import (the table of docs/development.md).
MAY_IMPORT: dict[str, set[str]] = {
    "__init__": BASE,
    "errors": set(),
    "identity": {"errors"},
    "env_knobs": set(),
    "_build_config": set(),
    "_config": {"_build_config", "kernels"},  # show_config() reads the backends lazily
    "hashing": BASE,
    "allocator": BASE | {"hashing"},
    "quant": BASE,
    "hfqm": BASE | {"quant"},  # the container stores quant types and decodes with the codecs
    "pool": BASE | CORE | {"kernels"},
    "kernels": BASE | CORE | {"pool"},  # the device backend and its launchers
    "sizing": BASE | CORE | {"pool"},
    "kv_adaptive": BASE | CORE | {"pool"},
    "kv_mode": BASE | CORE | {"kv_adaptive"},
    "adapter": BASE | CORE | {"sizing"},
    "coordinator": BASE | CORE | {"pool", "sizing", "adapter"},
    "cold": BASE | CORE | {"adapter"},
    "tiny_model": BELOW_TOP,
    "integrations": BELOW_TOP,
    "cli": EVERYTHING,
    "bench": EVERYTHING,
    "selfcheck": EVERYTHING,
    "__main__": EVERYTHING,
}

_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(pagedkv(?:\.\w+)*)[ \t]+c?import[ \t]+([^\n#]+)"
                     r"|c?import[ \t]+(pagedkv(?:\.\w+)*))", re.MULTILINE)


def _package_of(path: Path) -> str:
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else rel[0].split(".")[0]


def import_graph() -> dict[str, dict[str, list[str]]]:
    """``{package: {imported package: [files]}}`` over pagedkv's sources."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PKG.rglob("*")):
        if path.suffix not in (".py", ".pyx", ".pxd"):
            continue
        src = _package_of(path)
        for m in _IMPORT.finditer(path.read_text(encoding="utf-8")):
            module = m.group(1) or m.group(3)
            parts = module.split(".")
            if len(parts) > 1:
                targets = [parts[1]]
            else:  # from pagedkv import a, b as c
                targets = [name.split()[0] for name in (m.group(2) or "").strip("() ")
                           .split(",") if name.strip()]
            for dst in targets:
                if dst != src:
                    graph.setdefault(src, {}).setdefault(dst, []).append(
                        str(path.relative_to(PKG)))
    return graph


def test_every_package_is_on_the_map():
    packages = {_package_of(p) for p in PKG.iterdir()
                if p.suffix in (".py", ".pyx") or (p.is_dir() and (p / "__init__.py").exists())}
    missing = sorted(packages - set(MAY_IMPORT))
    assert not missing, (f"{missing}: new top-level packages; give each a row in "
                         "docs/development.md's package map and in MAY_IMPORT here")


def test_imports_follow_the_layers():
    bad = []
    for src, targets in sorted(import_graph().items()):
        allowed = MAY_IMPORT.get(src, set())
        for dst, files in sorted(targets.items()):
            if dst not in allowed:
                bad.append(f"{src} -> {dst} ({', '.join(sorted(set(files))[:3])})")
    assert not bad, "imports against the package map (docs/development.md):\n" + "\n".join(bad)


@pytest.mark.parametrize(("src", "dst"), [("adapter", "cold"), ("pool", "coordinator"),
                                          ("hashing", "allocator"), ("cold", "integrations")])
def test_the_map_forbids_upward_imports(src, dst):
    """The rule can fail: these edges would invert a layer."""
    assert dst not in MAY_IMPORT[src]


def test_the_graph_reader_sees_deferred_and_from_imports(tmp_path):
    text = "def f():\n    from pagedkv.cold import x\n\nfrom pagedkv import errors, hashing\n"
    found = [(m.group(1) or m.group(3), m.group(2)) for m in _IMPORT.finditer(text)]
    assert found == [("pagedkv.cold", "x"), ("pagedkv", "errors, hashing")]

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
BASE = {"errors", "identity", "env_knobs", "argument_checks", "atomic_write", "c_struct_dtype",
        "struct_fields", "_config", "_build_config", "__version__", "get_include", "show_config"}
CORE = {"hashing", "allocator", "quant", "hfqm"}
BELOW_TOP = BASE | CORE | {"pool", "sizing", "kernels", "kv_adaptive", "kv_mode", "adapter",
                           "coordinator", "cold"}
EVERYTHING = BELOW_TOP | {"tiny_model", "integrations", "cli", "bench", "selfcheck"}

#: Top-level package -> what it may import (the table of docs/development.md).
MAY_IMPORT: dict[str, set[str]] = {
    "__init__": BASE,
    "errors": set(),
    "identity": {"errors", "argument_checks"},
    "argument_checks": {"errors"},
    "atomic_write": {"errors"},
    "c_struct_dtype": set(),
    "struct_fields": set(),
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


# --- module cycles ---------------------------------------------------------------------------
#
# Within and across packages, no two pagedkv modules may import each other, directly or
# through others, at module level or deferred inside a function: a deferred import that closes
# a cycle only hides it. ``from pagedkv.a import b`` is an edge to the module ``pagedkv.a.b``
# when ``b`` is one, else to ``pagedkv.a``; importing a submodule does not count as importing
# its parent package's ``__init__`` (that is how packages work, not a cycle).

#: Cycles that exist today in modules other helpers own; each must go, none may be added.
#: The test also fails when a listed cycle is gone, so the list only shrinks.
KNOWN_CYCLES: frozenset[frozenset[str]] = frozenset({
    frozenset({"pagedkv.quant", "pagedkv.quant.matvec", "pagedkv.quant.prepared_gemv"}),
    frozenset({"pagedkv.kernels.device", "pagedkv.kernels.device_array",
               "pagedkv.kernels.interop"}),
    frozenset({"pagedkv.kernels.kvcache", "pagedkv.kernels.paged"}),
    frozenset({"pagedkv.kernels.mlx", "pagedkv.pool.mlx_storage"}),
    frozenset({"pagedkv.integrations.mlx_lm.cold", "pagedkv.integrations.mlx_lm.prompt_cache"}),
})

_FROM_NAMES = re.compile(r"^[ \t]*from[ \t]+(pagedkv(?:\.\w+)*)[ \t]+c?import[ \t]+"
                         r"(\([^)]*\)|[^\n#]+)|^[ \t]*c?import[ \t]+(pagedkv(?:\.\w+)*)",
                         re.MULTILINE)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).parts)
    parts[-1] = parts[-1].split(".")[0]  # x.py, x.pyx, x.pxd, _build_config.py.in
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """``{module: {pagedkv modules it imports}}`` over the sources under ``root``."""
    files = [p for p in sorted(root.rglob("*"))
             if p.suffix in (".py", ".pyx", ".pxd") or p.name.endswith(".py.in")]
    modules = {_module_name(p, root) for p in files}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in files:
        src = _module_name(path, root)
        for m in _FROM_NAMES.finditer(path.read_text(encoding="utf-8")):
            if m.group(3):
                targets = [m.group(3)]
            else:
                names = [n.split()[0] for n in m.group(2).strip("()").replace("\n", " ")
                         .split(",") if n.strip()]
                subs = [f"{m.group(1)}.{n}" for n in names if f"{m.group(1)}.{n}" in modules]
                targets = subs + ([m.group(1)] if len(subs) < len(names) else [])
            for dst in targets:
                while dst not in modules and "." in dst:  # pagedkv.x.Name -> pagedkv.x
                    dst = dst.rsplit(".", 1)[0]
                if dst != src and dst in modules:
                    graph[src].add(dst)
    return graph


def import_cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def _describe(cycle: frozenset[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & cycle))}" for m in sorted(cycle))


def test_no_module_imports_itself_through_others():
    graph = module_graph()
    cycles = import_cycles(graph)
    new = [c for c in cycles if c not in KNOWN_CYCLES]
    assert not new, ("import cycles between pagedkv modules (move the shared piece to the "
                     "module that owns it; a deferred import does not break a cycle):\n"
                     + "\n".join(_describe(c, graph) for c in new))
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not gone, f"these cycles are gone: drop them from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize(("tree", "cycle"), [
    ({"pkg/demo.py": "from pagedkv.pkg.demo_restart import run\n",
      "pkg/demo_restart.py": "def f():\n    from pagedkv.pkg.demo import DEFAULT\n"},
     {"pagedkv.pkg.demo", "pagedkv.pkg.demo_restart"}),
    ({"pkg/reader.py": "from pagedkv.pkg import bundle\n",
      "pkg/bundle.py": "from pagedkv.pkg.writer import (\n    fsync,\n)\n",
      "pkg/writer.py": "if TYPE_CHECKING:\n    from pagedkv.pkg.reader import File\n"},
     {"pagedkv.pkg.reader", "pagedkv.pkg.bundle", "pagedkv.pkg.writer"}),
    ({"quant/__init__.py": "from pagedkv.quant.formats import X\n",
      "quant/formats.py": "import pagedkv.hfqm.qtypes\n",
      "hfqm/qtypes.py": "from pagedkv import quant\n"},
     {"pagedkv.quant", "pagedkv.quant.formats", "pagedkv.hfqm.qtypes"}),
])
def test_the_cycle_check_sees_deferred_parenthesised_and_package_imports(tmp_path, tree, cycle):
    """The check can fail: each tree (the shapes of the cycles issue 16 broke) holds exactly
    ``cycle``; with its closing import removed it holds none."""
    root = tmp_path / "pagedkv"
    for name, text in tree.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for folder in {p.parent for p in root.rglob("*.py")} | {root}:
        (folder / "__init__.py").touch()
    assert import_cycles(module_graph(root)) == {frozenset(cycle)}
    (root / list(tree)[-1]).write_text("")
    assert import_cycles(module_graph(root)) == set()

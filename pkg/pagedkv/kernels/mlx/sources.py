"""The kernel texts handed to ``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel``.

MLX compiles a kernel from one string (``header=`` plus a generated signature around a
body), so the ``#include`` lines of ``metal/`` and ``hip/`` sources are resolved here:
each project header (``pagedkv/*.h``, ``pagedkv_metal.h``, ``pagedkv_compat.h``) is
inlined once, where it is first included; system headers (``<metal_stdlib>``,
``<cuda/std/cstdint>``) stay includes. Comments are stripped, because MLX hashes and
copies the whole text on every launch (docs/kernels.md, "MLX dispatch").

Sources are read from the installed package (``pagedkv/kernels/metal``,
``pagedkv/kernels/hip``, ``pagedkv/include``) or, in an editable install, from the
source tree.
"""

from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path

from pagedkv.errors import PagedKVError

__all__ = ["inline_includes", "read_source", "strip_comments"]

_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]\s*$')


def _tree_root() -> Path:
    from pagedkv import get_include
    return Path(get_include()).resolve().parent.parent  # <root>/pkg/include -> <root>


def _locate(name: str) -> Path | None:
    """The file a kernel text refers to: ``pagedkv/<h>`` (public headers), ``metal/<f>`` or
    ``hip/<f>`` (kernel sources), installed first, then the source tree."""
    from pagedkv import get_include
    if name.startswith("pagedkv/"):
        path = Path(get_include()) / name
        return path if path.is_file() else None
    folder, _, base = name.partition("/")
    installed = resources.files("pagedkv.kernels") / folder / base
    if installed.is_file():
        return Path(str(installed))
    path = _tree_root() / folder / base
    return path if path.is_file() else None


@functools.cache
def read_source(name: str) -> str:
    """The text of ``metal/<file>``, ``hip/<file>`` or ``pagedkv/<header>``."""
    path = _locate(name)
    if path is None:
        raise PagedKVError(
            f"kernel source {name} is not installed with pagedkv (looked in the package and "
            f"in {_tree_root()}); reinstall pagedkv")
    return path.read_text()


def inline_includes(name: str, *, done: set[str] | None = None) -> str:
    """``name``'s text with every project include replaced by the included text (once per
    file; a second include of the same header becomes nothing, as its guard would)."""
    done = set() if done is None else done
    done.add(name)
    folder = name.rpartition("/")[0]
    out = []
    for line in read_source(name).splitlines():
        m = _INCLUDE.match(line)
        target = _resolve(m.group(1), folder) if m else None
        if target is None:
            out.append(line)
        elif target not in done:
            out.append(inline_includes(target, done=done))
    return "\n".join(out) + "\n"


def _resolve(included: str, folder: str) -> str | None:
    """The project file an ``#include`` names (relative to the including file's folder,
    or a public header ``pagedkv/<h>``), or None for a system header."""
    for candidate in (f"{folder}/{included}", included):
        if candidate.split("/", 1)[0] in ("pagedkv", "metal", "hip") and _locate(candidate):
            return candidate
    return None


_TOKEN = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.DOTALL)


def strip_comments(text: str) -> str:
    """``text`` without C/C++ comments (string and character literals kept) and blank lines;
    a comment becomes one space so tokens never merge, and line splices stay intact."""
    def repl(m: re.Match) -> str:
        s = m.group(0)
        return " " if s.startswith("/") else s
    lines = (line.rstrip() for line in _TOKEN.sub(repl, text).splitlines())
    return "\n".join(line for line in lines if line) + "\n"

"""Citations of the project's contracts: where each one lives in docs/, and a rewriter.

The contracts the code keeps (hashing vectors, allocator rules, formats, the cold-tier
protocol, acceptance scenarios) are pages under ``docs/contracts/``. Code, tests and docs cite
them by page and heading::

    docs/contracts/paged-kv.md, '4.3 Invariants'
    docs/contracts/cold-tier.md, '9. Loads and corruption handling' to '10. Quota and eviction'

(any ``docs/<page>.md, '<Heading>'`` or ``"<Heading>"`` form, for any page). Older text cites
the original section marks instead: ``paged-kv.md §4.3``, ``shared/specs/cold-tier.md``, or a
bare ``§6.6`` meaning "the contract this file is about". ``--rewrite`` turns those into the
page-and-heading form; it is idempotent (rewritten text holds no ``§`` and no bare contract
file name), so it can run again after other branches land::

    python tests/doc_references.py            # list what would change, exit 1 if anything
    python tests/doc_references.py --rewrite  # rewrite in place
    python tests/doc_references.py --table    # the section -> page/heading mapping
    python tests/doc_references.py --check    # unresolved citations, exit 1 if any

tests/test_doc_references.py fails when any citation does not resolve to an existing page and
heading, or when anything cites a file outside the repository.

A bare ``§N`` takes its contract from the nearest contract file named earlier on the same
line, else from ``FILE_CONTRACT`` (per-file choices), else from the contract named most often
in the file, else from the file's path (``_contract_by_path``). Review the diff after a rewrite:
a bare mark in a file about one contract that cites another needs a ``FILE_CONTRACT`` entry.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CONTRACTS = DOCS / "contracts"

#: Folders and top-level files whose text is scanned and rewritten.
SCANNED = ("pkg", "tests", "docs", "hip", "metal", "asv_bench", "README.md", "meson.build",
           "meson.options", "pyproject.toml", ".ci")
_SKIP_DIRS = {".venv", "build", "_build", "__pycache__", ".git", ".hypothesis",
              ".pytest_cache", ".mypy_cache", ".ruff_cache", "node_modules"}
#: The rewriter and its test hold old-style citations as data.
_EXEMPT = {Path(__file__).resolve(), Path(__file__).resolve().with_name("test_doc_references.py")}

#: The original contract file names and the docs page that holds each now.
CONTRACT_PAGES = {
    "paged-kv": "docs/contracts/paged-kv.md",
    "cold-tier": "docs/contracts/cold-tier.md",
    "hfqm-and-quant": "docs/contracts/hfqm-and-quant.md",
}

#: Sections whose contract an existing guide holds better than the contract page; the
#: citation then points there. (contract, section) -> (page, heading).
OVERRIDES: dict[tuple[str, str], tuple[str, str]] = {}

#: Sections of the old design note (cited as ``DESIGN "<section>"``) -> development.md heading.
DESIGN_SECTIONS = {
    "Core layouts": "Core layouts",
    "Reference model and parity": "Reference model and parity",
    "Kernels": "Kernel design",
}
_DESIGN = re.compile(r'\bDESIGN(?:\.md)?,? "(?P<section>[^"]+)"')

#: Files whose bare ``§`` marks mean a contract other than the one their path suggests.
FILE_CONTRACT: dict[str, str] = {
    "docs/cli.md": "hfqm-and-quant",
    "docs/kernels.md": "hfqm-and-quant",
    "docs/development.md": "paged-kv",
    "tests/cold_support.py": "cold-tier",
    "docs/performance.md": "cold-tier",
}

_NAME = r"(?P<name>paged-kv|cold-tier|hfqm-and-quant)"
#: A contract file name as older text wrote it (never one already under docs/contracts/).
_FILE = (r"`?(?<![\w/.-])(?:(?:/work/)?shared/)?(?:specs/)?" + _NAME
         + r"\.md(?![\w-])`?")
_SEC = r"§\s?\d+(?:\.\d+)?(?:\s?[-–]\s?§?\d+(?:\.\d+)?)?\b"
_SECS = _SEC + r"(?:(?:,\s?|\s(?:and|or)\s|\s?/\s?|;\s)" + _SEC + r")*"
_RUN = re.compile(r"(?:" + _FILE + r"(?:,?\s(?:spec\s)?(?P<secs1>" + _SECS + r"))?"
                  r"|(?:\bspec\s)?(?P<secs2>" + _SECS + r"))")
_ONE_SEC = re.compile(r"§\s?(?P<a>\d+(?:\.\d+)?)(?:\s?[-–]\s?§?(?P<b>\d+(?:\.\d+)?))?")

#: A page-and-heading citation (either quote style, comma optional).
_CITE = re.compile(r"(?P<page>docs/[\w./-]+?\.md)(?P<rest>(?:,?\s[\"'][^\"'\n]+[\"']"
                   r"(?:\s(?:to|and)\s[\"'][^\"'\n]+[\"'])*)?)")
_QUOTED = re.compile(r"[\"']([^\"'\n]+)[\"']")
#: References to files outside the repository.
_OUTSIDE = re.compile(r"(?<![\w/.-])(?:(?:/work/)?shared/(?:specs|seeds|notes|peers)\b"
                      r"|/work/|(?:paged-kv|cold-tier|hfqm-and-quant)\.md|DESIGN\.md|\bDESIGN \")")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def normalise_heading(text: str) -> str:
    """A heading as citations quote it: Markdown code/emphasis marks gone, spaces collapsed."""
    text = re.sub(r"[`*]", "", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return " ".join(text.split())


def headings(page: Path) -> list[str]:
    """The headings of a Markdown page (code fences left out), normalised."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return [normalise_heading(m.group(2)) for m in _HEADING.finditer(text)]


def citable(page: Path) -> set[str]:
    """What a citation may quote: a heading, or its short title, the part before ``": "`` or
    ``" ("`` ("Restarts" for "Restarts: the cold tier")."""
    out = set()
    for h in headings(page):
        out.add(h)
        out.add(re.split(r": | \(", h, maxsplit=1)[0])
    return out


@functools.cache
def section_headings(contract: str) -> dict[str, str]:
    """Section number ("4.3", "9") -> heading text of a contract page."""
    out = {}
    for h in headings(ROOT / CONTRACT_PAGES[contract]):
        m = re.match(r"(\d+(?:\.\d+)?)\.?\s", h)
        if m:
            out[m.group(1)] = h
    return out


def mapping() -> dict[tuple[str, str], tuple[str, str]]:
    """Every (contract, section) -> (docs page, heading) a citation can resolve to."""
    table = {}
    for contract, page in CONTRACT_PAGES.items():
        for sec, heading in section_headings(contract).items():
            table[(contract, sec)] = OVERRIDES.get((contract, sec), (page, heading))
    return table


def iter_files() -> list[Path]:
    """Text files under SCANNED, this file and the contract pages left out."""
    files: list[Path] = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                rel = f.relative_to(ROOT).parts
                if not f.is_file() or _SKIP_DIRS.intersection(rel):
                    continue
                files.append(f)
    out = []
    for f in files:
        if f.resolve() in _EXEMPT or CONTRACTS in f.resolve().parents:
            continue
        try:
            f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(f)
    return out


def _contract_by_path(rel: str) -> str:
    if "cold" in rel:
        return "cold-tier"
    if re.search(r"hfqm|quant|kernel|convert|inspect|hip/|metal/|formats/", rel):
        return "hfqm-and-quant"
    return "paged-kv"


def file_contract(rel: str, text: str) -> str:
    """The contract a bare ``§`` in this file means when its line names none."""
    if rel in FILE_CONTRACT:
        return FILE_CONTRACT[rel]
    counts = Counter(m.group("name") for m in re.finditer(_FILE, text))
    if counts:
        (top, n), *rest = counts.most_common()
        if not rest or rest[0][1] < n:
            return top
    return _contract_by_path(rel)


@dataclass
class Problem:
    path: str
    line: int
    text: str
    why: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.why}: {self.text!r}"


def _render(contract: str, secs: str, table, problems: list[str]) -> str:
    """``docs/<page>.md, '<heading>' [to '<heading>'] [and ...]`` for a run of § marks."""
    parts: list[tuple[str, str]] = []  # (page, "'h'" or "'h' to 'h'")
    for m in _ONE_SEC.finditer(secs):
        a, b = m.group("a"), m.group("b")
        if (contract, a) not in table or (b and (contract, b) not in table):
            problems.append(f"{contract}.md has no section {m.group(0)}")
            return ""
        page, ha = table[(contract, a)]
        text = f"'{ha}'"
        if b:
            page_b, hb = table[(contract, b)]
            if page_b != page:
                problems.append(f"range {m.group(0)} spans pages")
                return ""
            text += f" to '{hb}'"
        parts.append((page, text))
    out: list[str] = []
    for page, text in parts:
        if out and out[-1].startswith(page + ", "):
            out[-1] += " and " + text
        else:
            out.append(f"{page}, {text}")
    return "; ".join(out)


def _trim_rule(line: str, width: int = 100) -> str:
    """A ``# --- title ----`` divider that a longer citation pushed past ``width``, trimmed."""
    m = re.match(r"^(\s*#\s*---.*?\S)\s*(-{3,})$", line)
    if m and len(line) > width:
        return m.group(1) + " " + "-" * max(3, width - len(m.group(1)) - 1)
    return line


WIDTH = 100
_NEW_FORM = re.compile(r"docs/contracts/|docs/development\.md, '")
_PY = (".py", ".pyx", ".pxd", ".pyi")
_C = (".h", ".c", ".hip", ".metal", ".cu", ".cuh", ".cpp")


def _break(line: str, cont: str, width: int = WIDTH) -> list[str]:
    """``line`` cut at spaces into pieces of at most ``width``; later pieces start with ``cont``."""
    out: list[str] = []
    while len(line) > width:
        head = len(cont) if out else len(line) - len(line.lstrip())
        cut = line.rfind(" ", head + 1, width + 1)
        if cut <= head:
            break
        out.append(line[:cut].rstrip())
        line = cont + line[cut + 1:].lstrip()
    out.append(line)
    return out


def reflow(rel: str, lines: list[str], width: int = WIDTH) -> list[str]:
    """Lines holding a page-and-heading citation that run past ``width``, wrapped where that
    is safe: comments, docstrings and Markdown prose (never code, tables or headings)."""
    out: list[str] = []
    in_doc = False
    in_fence = False
    for line in lines:
        s = line.lstrip()
        ind = line[:len(line) - len(s)]
        cont = None
        if rel.endswith(_PY):
            opens = s.startswith(('"""', 'r"""'))
            if s.startswith("#"):
                cont = ind + "# "
            elif in_doc or opens:
                cont = ind
            if line.count('"""') % 2:
                in_doc = not in_doc
        elif rel.endswith(_C):
            if s.startswith("//"):
                cont = ind + "// "
            elif s.startswith(("*", "/*")) and not s.startswith("*/"):
                cont = ind + (" * " if s.startswith("/*") else "* ")
        elif rel.endswith(".md"):
            if s.startswith(("```", "~~~")):
                in_fence = not in_fence
            elif not in_fence and not s.startswith(("|", "#")) and s:
                m = re.match(r"(?:[-*]|\d+\.)\s", s)
                cont = ind + (" " * len(m.group(0)) if m else "")
        if cont is not None and len(line) > width and _NEW_FORM.search(line):
            out.extend(_break(line, cont, width))
        else:
            out.append(line)
    return out


def rewrite_text(rel: str, text: str, table=None) -> tuple[str, list[str]]:
    """The text with every old-style citation replaced, and what could not be replaced."""
    table = mapping() if table is None else table
    default = file_contract(rel, text)
    problems: list[str] = []
    out_lines = []
    for line in text.split("\n"):
        if "§" not in line and ".md" not in line and "DESIGN" not in line:
            out_lines.append(line)
            continue
        last_named: str | None = None
        pieces = []
        pos = 0
        for m in _RUN.finditer(line):
            name = m.group("name")
            secs = m.group("secs1") or m.group("secs2")
            contract = name or last_named or default
            if name:
                last_named = name
            local: list[str] = []
            if secs:
                new = _render(contract, secs, table, local)
            else:
                new = CONTRACT_PAGES[contract]
            if local or not new:
                problems.extend(local)
                continue
            pieces.append(line[pos:m.start()])
            pieces.append(new)
            pos = m.end()
        pieces.append(line[pos:])
        line = "".join(pieces)
        line = _DESIGN.sub(lambda m: "docs/development.md, '{}'".format(
            DESIGN_SECTIONS.get(m.group("section"), m.group("section"))), line)
        out_lines.append(_trim_rule(line))
    return "\n".join(reflow(rel, out_lines)), problems


def _flatten(text: str) -> str:
    """Lines joined with comment/continuation marks dropped, so a citation may wrap."""
    text = re.sub(r"([\"'])[ \t]*\n[ \t]*[fbrFBR]?\1", "", text)  # "a "\n  "b" -> "a b"
    return re.sub(r"[ \t]*\n[ \t]*(?:#|\*|//|///)?[ \t]*", " ", text)


def check_text(rel: str, text: str, page_headings) -> list[str]:
    """Why each citation of this text does not resolve (empty when all do)."""
    problems = []
    flat = _flatten(text)
    for m in _CITE.finditer(flat):
        page = ROOT / m.group("page")
        if not page.is_file():
            problems.append(f"no page {m.group('page')}")
            continue
        known = page_headings(page)
        for q in _QUOTED.findall(m.group("rest")):
            if normalise_heading(q) not in known:
                problems.append(f"{m.group('page')} has no heading {q!r}")
    for m in _OUTSIDE.finditer(text):
        problems.append(f"cites a file outside the repository: {m.group(0)!r}")
    for m in re.finditer(r"§", text):
        s = text[max(0, m.start() - 30):m.end() + 10].replace("\n", " ")
        problems.append(f"section mark not in docs/<page>.md, '<heading>' form: {s!r}")
    return problems


def check_contract_page(page: Path) -> list[str]:
    """Inside a contract page, ``§N`` is its own section N and ``x.md §N`` another page's."""
    problems = []
    text = page.read_text(encoding="utf-8")
    own = set(section_headings(page.stem))
    for line in text.split("\n"):
        for m in re.finditer(r"(?:`?(?P<name>[\w-]+)\.md`?,?\s)?(?P<secs>" + _SECS + ")", line):
            name = m.group("name")
            secs = own if name in (None, page.stem) else set(section_headings(name)) \
                if name in CONTRACT_PAGES else None
            if secs is None:
                problems.append(f"{page.name}: unknown page {name}.md")
                continue
            for s in _ONE_SEC.finditer(m.group("secs")):
                for n in (s.group("a"), s.group("b")):
                    if n and n not in secs:
                        problems.append(f"{page.name}: {name or page.stem}.md has no §{n}")
    return problems


def check_all() -> list[str]:
    """Every unresolved or outside citation in the repository."""
    section_headings.cache_clear()
    cache: dict[Path, set[str]] = {}

    def page_headings(p: Path) -> set[str]:
        if p not in cache:
            cache[p] = citable(p)
        return cache[p]

    problems = []
    for f in iter_files():
        rel = f.relative_to(ROOT).as_posix()
        for why in check_text(rel, f.read_text(encoding="utf-8"), page_headings):
            problems.append(f"{rel}: {why}")
    for page in sorted(CONTRACTS.glob("*.md")):
        problems.extend(check_contract_page(page))
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--rewrite", action="store_true", help="rewrite old citations in place")
    g.add_argument("--table", action="store_true", help="print the section mapping")
    g.add_argument("--check", action="store_true", help="list unresolved citations")
    args = ap.parse_args(argv)
    if args.table:
        for (contract, sec), (page, heading) in sorted(
                mapping().items(), key=lambda kv: (kv[0][0], [int(x) for x in
                                                              kv[0][1].split(".")])):
            print(f"{contract}.md §{sec}\t{page}, '{heading}'")
        return 0
    if args.check:
        problems = check_all()
        print("\n".join(problems) or "every citation resolves")
        return 1 if problems else 0
    section_headings.cache_clear()
    table = mapping()
    changed = 0
    stuck = 0
    for f in iter_files():
        rel = f.relative_to(ROOT).as_posix()
        text = f.read_text(encoding="utf-8")
        new, problems = rewrite_text(rel, text, table)
        for p in problems:
            print(f"{rel}: cannot rewrite: {p}", file=sys.stderr)
            stuck += 1
        if new != text:
            changed += 1
            if args.rewrite:
                f.write_text(new, encoding="utf-8")
            else:
                sys.stdout.writelines(difflib.unified_diff(
                    text.splitlines(True), new.splitlines(True), rel, rel, n=0))
    verb = "rewrote" if args.rewrite else "would rewrite"
    print(f"{verb} {changed} files; {stuck} citations need a hand", file=sys.stderr)
    return 0 if args.rewrite or not changed else 1


if __name__ == "__main__":
    sys.exit(main())

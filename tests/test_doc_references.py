"""Every contract citation resolves to a page and heading under docs/, and nothing in the
repository cites a file outside it (tests/doc_references.py has the rules and the rewriter)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import doc_references as refs

pytestmark = pytest.mark.skipif(not refs.CONTRACTS.is_dir(), reason="docs/ not next to tests")


def test_every_citation_resolves():
    problems = refs.check_all()
    assert not problems, "\n".join(problems[:40])


def test_rewrite_forms_and_idempotence():
    src = ("see paged-kv.md §4.3; `shared/specs/cold-tier.md` §9–10 and §6.6 step 2\n"
           "bare §2.1 here, DESIGN \"Core layouts\"\n")
    out, problems = refs.rewrite_text("pkg/pagedkv/allocator.pyx", src)
    assert problems == []
    assert out == ("see docs/contracts/paged-kv.md, '4.3 Invariants'; docs/contracts/cold-tier.md, "
                   "'9. Loads and corruption' to '10. Quota and eviction' and '6.6 Decoding' step 2\n"
                   "bare docs/contracts/paged-kv.md, '2.1 Hot block hash' here, "
                   "docs/development.md, 'Core layouts'\n")
    assert refs.rewrite_text("pkg/pagedkv/allocator.pyx", out)[0] == out


def test_bare_marks_follow_the_file_contract():
    out, _ = refs.rewrite_text("pkg/pagedkv/cold/codec.pyx", "order of §6.6\n")
    assert out == "order of docs/contracts/cold-tier.md, '6.6 Decoding'\n"
    out, _ = refs.rewrite_text("pkg/pagedkv/quant/q8.pyx", "(§4.5)\n")
    assert out == "(docs/contracts/hfqm-and-quant.md, '4.5 Q8F16 (qt 3)')\n"


def test_unknown_section_is_reported_not_rewritten():
    out, problems = refs.rewrite_text("pkg/pagedkv/allocator.pyx", "paged-kv.md §42.1\n")
    assert out == "paged-kv.md §42.1\n"
    assert problems == ["paged-kv.md has no section §42.1"]


def test_checker_catches_bad_citations(tmp_path):
    headings = {refs.ROOT / "docs/allocator.md": {"Physical layout"}}.get
    text = ("docs/allocator.md, 'Physical layout' ok; docs/allocator.md, 'Nope'; "
            "docs/nowhere.md; cold-tier.md; shared/specs/x; §3\n")
    problems = refs.check_text("x.py", text, lambda p: headings(p, set()))
    assert problems == [
        "docs/allocator.md has no heading 'Nope'",
        "no page docs/nowhere.md",
        "cites a file outside the repository: 'cold-tier.md'",
        "cites a file outside the repository: 'shared/specs'",
        "section mark not in docs/<page>.md, '<heading>' form: 'cold-tier.md; shared/specs/x; §3 '",
    ]


def test_a_citation_may_wrap_across_comment_lines():
    text = "# see docs/contracts/paged-kv.md,\n# '4.3 Invariants' for the rules\n"
    assert refs.check_text("x.py", text, refs.citable) == []


def test_mapping_covers_every_numbered_section():
    table = refs.mapping()
    assert table[("paged-kv", "8.6")] == ("docs/contracts/paged-kv.md", "8.6 Sliding null sentinel")
    assert table[("cold-tier", "13")] == ("docs/contracts/cold-tier.md", "13. Sidecars")
    assert len([k for k in table if k[0] == "hfqm-and-quant"]) == 46


# -- Environment variables: what the docs name is read, and what is read is documented ------

_ENV_NAME = re.compile(r"\b(?:PAGEDKV|HIPFIRE)_[A-Z0-9_]*[A-Z0-9]\b")
_ENV_LITERAL = re.compile(r"[\"']((?:PAGEDKV|HIPFIRE)_[A-Z0-9_]*[A-Z0-9])[\"']")
#: Named in the docs on purpose although nothing reads them, with the page that says so.
_ENV_DOCUMENTED_AS_GONE = {"PAGEDKV_USE_BLOCK_PAGED_CACHE"}  # docs/pool.md: "once listed"


def _doc_pages() -> list:
    return [refs.ROOT / "README.md", *sorted(refs.DOCS.rglob("*.md"))]


def _files(*parts: str, exts: tuple[str, ...]) -> list:
    out = []
    for part in parts:
        base = refs.ROOT / part
        out += [p for p in (base.rglob("*") if base.is_dir() else [base])
                if p.is_file() and (p.suffix in exts or p.name == "run")
                and not set(p.parts) & {".venv", "build", "__pycache__"}
                and p.resolve() != Path(__file__).resolve()]
    return out


def _env_in_code(*parts: str) -> set[str]:
    """PAGEDKV_* / HIPFIRE_* names that code under ``parts`` spells as a string literal
    (header guards and Python constants named PAGEDKV_* are not literals)."""
    names: set[str] = set()
    for path in _files(*parts, exts=(".py", ".pyx", ".pxd", ".sh")):
        text = path.read_text(encoding="utf-8", errors="replace")
        names |= set(_ENV_LITERAL.findall(text))
        if path.suffix == ".sh" or path.name == "run":
            names |= set(re.findall(r"\b((?:PAGEDKV|HIPFIRE)_[A-Z0-9_]*[A-Z0-9])=", text))
    return names


def test_every_documented_environment_variable_is_read():
    documented = {n for page in _doc_pages() for n in _ENV_NAME.findall(page.read_text("utf-8"))}
    read = _env_in_code("pkg", "tests", "hip", "asv_bench", ".ci")
    assert len(documented) > 30
    assert sorted(documented - read - _ENV_DOCUMENTED_AS_GONE) == []
    assert _ENV_DOCUMENTED_AS_GONE <= documented and not _ENV_DOCUMENTED_AS_GONE & read


def test_every_environment_variable_the_code_reads_is_documented():
    documented = {n for page in _doc_pages() for n in _ENV_NAME.findall(page.read_text("utf-8"))}
    read = _env_in_code("pkg", "tests")
    read = {n for n in read if not n.startswith("PAGEDKV_SOME_")}  # a test's placeholder
    assert {"PAGEDKV_KV_MODE", "HIPFIRE_KV_MODE", "PAGEDKV_PARITY_LOG"} <= read
    assert sorted(read - documented) == []


def test_every_cli_option_is_in_cli_md():
    # docs/cli.md names every long option of every `pagedkv` command (argparse.SUPPRESS'd
    # internal ones aside): a flag added to a parser without a word in the docs fails here.
    import argparse

    from pagedkv.cli import build_parser

    def options(parser, path=()):
        found = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += options(sub, path + (name,))
            elif action.help is not argparse.SUPPRESS:
                found += [(" ".join(path), s) for s in action.option_strings
                          if s.startswith("--") and s != "--help"]
        return found

    text = (refs.DOCS / "cli.md").read_text(encoding="utf-8")
    every = options(build_parser())
    assert len(every) > 30
    missing = [(cmd, flag) for cmd, flag in every
               if not re.search(re.escape(flag) + r"(?![\w-])", text)]
    assert missing == []

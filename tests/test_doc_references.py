"""Every contract citation resolves to a page and heading under docs/, and nothing in the
repository cites a file outside it (tests/doc_references.py has the rules and the rewriter)."""

from __future__ import annotations

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

"""``pagedkv demo`` then ``pagedkv cold stats``: the pair a new user runs finds one directory."""

from __future__ import annotations

import re

import pytest

from pagedkv.cli import demo_restart, main

SMALL = ["demo", "--requests", "3", "--system-tokens", "32", "--fewshot-tokens", "16",
         "--user-tokens", "8", "--new-tokens", "4", "--block-size", "8"]


@pytest.fixture
def fresh_user(tmp_path, monkeypatch):
    """A working directory and a home with nothing in them, no cold-dir env."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("PAGEDKV_COLD_CACHE_DIR", raising=False)
    monkeypatch.setenv("PAGEDKV_METRICS", "0")
    # conftest points the demo's default elsewhere for every test; this one is about it.
    monkeypatch.setattr(demo_restart, "DEFAULT_COLD_DIR", "./.pagedkv-demo")
    return work


def _stats_objects(out: str) -> int:
    return int(re.search(r"^objects: (\d+)  total: ", out, re.MULTILINE).group(1))


def test_demo_prints_the_stats_command_and_it_shows_the_demo_tier(fresh_user, capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    # 9 distinct blocks persisted (see test_cold_demo), and the exact command to look at them.
    assert re.search(r"^cold tier: 0 blocks restored from disk \(0 bytes\), 9 blocks persisted",
                     out, re.MULTILINE)
    cmd = re.search(r"^  inspect it: pagedkv (cold stats .*)$", out, re.MULTILINE).group(1)
    assert cmd == "cold stats ./.pagedkv-demo"
    assert main(cmd.split()) == 0
    printed = capsys.readouterr()
    assert _stats_objects(printed.out) == 9
    assert f"root: {fresh_user / '.pagedkv-demo' / 'pagedkv-v1'}" in printed.out.replace(
        "/./", "/")
    assert printed.err == ""


def test_bare_cold_stats_after_the_demo_finds_the_demo_tier(fresh_user, capsys):
    assert main(SMALL) == 0
    capsys.readouterr()
    assert main(["cold", "stats"]) == 0
    printed = capsys.readouterr()
    assert _stats_objects(printed.out) == 9
    assert printed.err == (
        f"pagedkv cold: no tier in the default {str(fresh_user.parent / 'home' / '.pagedkv' / 'cache')!r}; "
        "showing the `pagedkv demo` tier in './.pagedkv-demo'\n")
    assert main(["cold", "verify"]) == 0
    assert "BAD" not in capsys.readouterr().out


def test_destructive_commands_never_fall_back_to_the_demo_tier(fresh_user, capsys):
    assert main(SMALL) == 0
    capsys.readouterr()
    names = sorted(p.name for p in (fresh_user / ".pagedkv-demo" / "pagedkv-v1").iterdir())
    assert main(["cold", "evict", "--to", "0"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err
    assert "(the `pagedkv demo` tier is in './.pagedkv-demo': pass it as BASE)" in err
    assert main(["cold", "verify", "--prune"]) == 2
    assert sorted(p.name for p in (fresh_user / ".pagedkv-demo" / "pagedkv-v1").iterdir()) \
        == names


def test_without_a_demo_tier_the_message_is_unchanged(fresh_user, capsys):
    assert main(["cold", "stats"]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "pagedkv demo" not in err

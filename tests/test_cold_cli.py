"""``pagedkv cold stats | verify | evict`` (docs/contracts/cold-tier.md, '9. Loads and corruption'
to '10. Quota and eviction'; O2's offline half)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from cold_support import open_tier, persist_prompt
from pagedkv.cli import main
from pagedkv.cli.cold import parse_size


def _populate(base, n_prompts=3):
    root = base / "pagedkv-v1"
    with open_tier(root) as tier:
        for i in range(n_prompts):
            persist_prompt(tier, np.arange(100 * i, 100 * i + 8, dtype=np.uint32), seed=i)
    return root


def _state(root):
    return {n: (os.stat(root / n).st_mtime_ns, (root / n).read_bytes())
            for n in sorted(os.listdir(root))}


def test_stats_lists_objects_per_group(tmp_path, capsys, monkeypatch):
    root = _populate(tmp_path)
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "2026-11-30-1.jsonl").write_text(
        '{"v":1,"cold_hits":3,"cold_misses":1}\n{"v":1,"cold_hits":2,"cold_corruptions":1}\n')
    monkeypatch.setenv("PAGEDKV_METRICS_DIR", str(traces))
    assert main(["cold", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    total = sum(os.path.getsize(root / n) for n in os.listdir(root))
    assert f"objects: 6  total: {total} B" in out
    assert "kv" in out and "quota:" in out
    assert "hits=5  misses=1" in out and "corruptions=1" in out


def test_verify_is_read_only_and_prune_quarantines(tmp_path, capsys):
    root = _populate(tmp_path)
    assert main(["cold", "verify", str(tmp_path)]) == 0
    assert "verified 6 objects: 6 ok, 0 bad" in capsys.readouterr().out
    victim = sorted(os.listdir(root))[2]
    data = bytearray((root / victim).read_bytes())
    data[-1] ^= 1
    (root / victim).write_bytes(bytes(data))
    before = _state(root)
    assert main(["cold", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {victim}" in out and "1 bad" in out
    assert _state(root) == before  # nothing changed: file, bytes, mtime
    assert main(["cold", "verify", "--prune", str(tmp_path)]) == 1
    names = os.listdir(root)
    assert victim not in names
    q = [n for n in names if n.startswith(f".blocked.{victim}.")]
    assert len(q) == 1
    assert main(["cold", "verify", str(tmp_path)]) == 0
    capsys.readouterr()
    # evict removes the quarantine first, then evicts least recently read down to SIZE.
    size = os.path.getsize(root / min(n for n in names if not n.startswith(".")))
    assert main(["cold", "evict", "--to", str(2 * size), str(tmp_path)]) == 0
    names = os.listdir(root)
    assert not [n for n in names if n.startswith(".blocked.")]
    assert len(names) == 2


def test_verify_reports_a_fingerprint_no_loader_can_match(tmp_path, capsys):
    # The checksum covers the payload, not the metadata; a fingerprint that is not 64
    # lowercase hex digits is refused (and pruned) by every load, so verify says BAD (it
    # said ok: offline there is no expected fingerprint; the key is the file's name).
    field = b"fingerprint"
    root = _populate(tmp_path, 1)
    victim = min(os.listdir(root))
    data = bytearray((root / victim).read_bytes())
    at = data.index(b'"' + field + b'":"') + len(field) + 4
    data[at:at + 4] = b"zzzz"
    (root / victim).write_bytes(bytes(data))
    assert main(["cold", "verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {victim}" in out and "1 bad" in out and "64 lowercase hex" in out


def test_evict_to_zero_empties_the_tier(tmp_path, capsys):
    root = _populate(tmp_path, 1)
    assert main(["cold", "evict", "--to", "0", str(tmp_path)]) == 0
    assert os.listdir(root) == []


def test_size_parsing():
    assert parse_size("512") == 512
    assert parse_size("4K") == 4096 and parse_size("2m") == 2 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("1T") == 1 << 40
    import argparse
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("1.5G")
    with pytest.raises(SystemExit):
        main(["cold", "evict", "--to", "lots"])


def test_refused_root_exits_2(tmp_path, capsys):
    (tmp_path / "pagedkv-v1").write_bytes(b"")
    assert main(["cold", "stats", str(tmp_path)]) == 2
    assert "pagedkv cold:" in capsys.readouterr().err


# --- a user's mistakes: one line naming the problem and the fix, exit 2, nothing created ---

def _tree(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("action", [["stats"], ["verify"], ["evict", "--to", "1M"]])
def test_a_missing_base_is_reported_and_not_created(tmp_path, capsys, action):
    missing = tmp_path / "typo"
    assert main(["cold", *action, str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pagedkv cold: ")
    assert f"BASE {str(missing)!r} does not exist" in err and "PAGEDKV_COLD_CACHE_DIR" in err
    assert not missing.exists()


@pytest.mark.parametrize("action", [["stats"], ["verify"], ["evict", "--to", "1M"]])
@pytest.mark.parametrize("base, hint", [
    ("redis//:s3cret-pw@cache.example:6379/0", "did you mean 'redis://:***@cache.example"),
    ("rediss//user:s3cret-pw@cache.example/0", "did you mean 'rediss://user:***@cache"),
    ("redis:/:s3cret-pw@cache.example/0", "***@cache.example/0"),
    ("http://user:s3cret-pw@cache.example/0", "not a redis:// URL"),
])
def test_a_mistyped_url_never_shows_its_password(tmp_path, capsys, monkeypatch, action,
                                                  base, hint):
    """A BASE that reads as a URL with a password but is no redis:// URL (a missing or
    extra character, another scheme) is not reported raw as a missing directory: the
    message shows it redacted and says it is not a Redis URL (a review found the password
    in the 'does not exist' line)."""
    monkeypatch.chdir(tmp_path)
    assert main(["cold", *action, base]) == 2
    out, err = capsys.readouterr()
    assert "s3cret-pw" not in out + err
    assert err.count("\n") == 1 and err.startswith("pagedkv cold: ") and hint in err
    assert _tree(tmp_path) == []


def test_an_unreachable_server_names_where_its_url_came_from(tmp_path, capsys, monkeypatch):
    # The hint said "fix host, port and db in PAGEDKV_COLD_BACKEND" for a URL given as
    # BASE, with the variable unset: the user was sent to fix a variable they never set.
    pytest.importorskip("redis", reason="pip install 'pagedkv[redis]'")
    monkeypatch.delenv("PAGEDKV_COLD_BACKEND", raising=False)
    fix = "start the server or fix host, port and db in the URL"
    assert main(["cold", "stats", "redis://127.0.0.1:1/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pagedkv cold: cold backend redis://127.0.0.1:1/0 is unreachable (")
    assert err.endswith(f"); {fix}\n"), err
    monkeypatch.setenv("PAGEDKV_COLD_BACKEND", "redis://127.0.0.1:1/0")
    assert main(["cold", "stats"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.endswith(f"); {fix} (the URL is PAGEDKV_COLD_BACKEND's)\n"), err
    assert _tree(tmp_path) == []


def test_a_plain_path_with_an_at_sign_is_shown_as_it_is(tmp_path, capsys):
    missing = tmp_path / "user@host" / "cache"
    assert main(["cold", "stats", str(missing)]) == 2
    err = capsys.readouterr().err
    assert f"BASE {str(missing)!r} does not exist" in err


@pytest.mark.parametrize("action", [["stats"], ["verify"], ["evict", "--to", "0"]])
def test_a_base_without_a_tier_is_reported_and_left_alone(tmp_path, capsys, action):
    (tmp_path / "unrelated.txt").write_bytes(b"x")
    assert main(["cold", *action, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no cold tier ('pagedkv-v1' is missing)" in err
    assert _tree(tmp_path) == ["unrelated.txt"]


def test_a_file_given_as_base_is_reported(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_bytes(b"keep")
    assert main(["cold", "verify", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"BASE {str(f)!r} is not a directory" in err and "pagedkv-v1" in err
    assert f.read_bytes() == b"keep"


def test_a_file_or_symlink_in_place_of_the_tier_names_its_full_path(tmp_path, capsys):
    (tmp_path / "pagedkv-v1").symlink_to(tmp_path)
    assert main(["cold", "stats", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cold root {str(tmp_path / 'pagedkv-v1')!r} is not a plain directory" in err
    assert "remove it or choose another directory" in err
    assert (tmp_path / "pagedkv-v1").is_symlink()


def test_a_root_owned_by_another_user_is_refused_with_the_fix(tmp_path, capsys, monkeypatch):
    root = _populate(tmp_path, 1)
    os.chmod(root, 0o755)
    before = _state(root)
    monkeypatch.setattr(os, "geteuid", lambda: os.stat(root).st_uid + 1)
    assert main(["cold", "evict", "--to", "0", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"cold root {str(root)!r} is owned by uid {os.stat(root).st_uid}" in err
    assert "chown it to this user or choose another directory" in err
    assert _state(root) == before and os.stat(root).st_mode & 0o777 == 0o755


def test_size_units_accept_b_kb_and_kib_spellings():
    assert [parse_size(t) for t in ("10", "10B", "10kb", "10KiB", " 3 g ", "1T")] == \
        [10, 10, 10240, 10240, 3 << 30, 1 << 40]


@pytest.mark.parametrize("size", ["10XB", "-1", "", "1.5G", "0x10", "1 K B", "10iB", "5 MM"])
def test_a_garbage_size_is_a_usage_error_naming_the_value(tmp_path, capsys, size):
    root = _populate(tmp_path, 1)
    before = _state(root)
    with pytest.raises(SystemExit) as exc:
        main(["cold", "evict", "--to", size, str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --to: SIZE {size!r} is not bytes" in err and "e.g. 512M" in err
    assert "Traceback" not in err
    assert _state(root) == before


def test_evict_removes_quarantine_trees_without_following_links(tmp_path, capsys):
    """docs/contracts/cold-tier.md, '10. Quota and eviction': a quarantined directory goes with its
    contents; a link inside it, or a
    quarantine entry that is itself a link, is removed as a link, its target untouched."""
    root = _populate(tmp_path, 1)
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "precious").write_bytes(b"keep")
    q = root / ".blocked.dir.1.2"
    (q / "nested").mkdir(parents=True)
    (q / "nested" / "f").write_bytes(b"x")
    (q / "to_outside").symlink_to(outside)
    (root / ".blocked.link.3.4").symlink_to(outside / "sub")
    objects = sorted(n for n in os.listdir(root) if not n.startswith("."))
    big = 1 << 40
    assert main(["cold", "evict", "--to", str(big), str(tmp_path)]) == 0
    assert "removed 2 quarantined entries; evicted 0 objects" in capsys.readouterr().out
    assert sorted(os.listdir(root)) == objects
    assert (outside / "sub" / "precious").read_bytes() == b"keep"


def test_stats_skips_foreign_and_torn_trace_lines(tmp_path, capsys, monkeypatch):
    _populate(tmp_path, 1)
    traces = tmp_path / "traces"
    traces.mkdir()
    (traces / "old.jsonl").write_text('{"cold_hits": 100}\n')
    os.utime(traces / "old.jsonl", ns=(1, 1))
    (traces / "dangling.jsonl").symlink_to(traces / "missing")
    (traces / "new.jsonl").write_bytes(
        b'[1, 2]\n3\n"text"\nnull\n\xff\xfe not utf-8\n{"cold_hits": 2, "cold_misses": true}\n'
        b'{"cold_hits": 1, "cold_misses": 4}\n{"cold_hits": 9')
    monkeypatch.setenv("PAGEDKV_METRICS_DIR", str(traces))
    assert main(["cold", "stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "counters of the last traced process (new.jsonl):" in out
    assert "hits=3  misses=4" in out


def test_verify_prune_says_when_a_bad_object_could_not_be_quarantined(tmp_path, capsys,
                                                                      monkeypatch):
    from pagedkv.cold import store
    root = _populate(tmp_path, 1)
    victim = min(os.listdir(root))
    data = bytearray((root / victim).read_bytes())
    data[-1] ^= 1
    (root / victim).write_bytes(bytes(data))

    # a quarantine target the rename cannot reach
    monkeypatch.setattr(store, "quarantine_name", lambda *a: "no-such-dir/q")
    assert main(["cold", "verify", "--prune", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"BAD {victim}: " in out and "(NOT quarantined: No such file or directory)" in out
    assert "(quarantined)" not in out
    monkeypatch.undo()
    assert main(["cold", "verify", "--prune", str(tmp_path)]) == 1
    assert f"BAD {victim}: " in capsys.readouterr().out
    assert any(n.startswith(f".blocked.{victim}.") for n in os.listdir(root))

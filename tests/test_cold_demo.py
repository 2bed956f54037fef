"""``pagedkv demo --restart``: a second process restores what the first persisted."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def test_demo_restart_restores_in_a_second_process_with_parity(tmp_path):
    cold = tmp_path / "demo"
    argv = [sys.executable, "-m", "pagedkv", "demo", "--restart", "--cold-dir", str(cold),
            "--requests", "3", "--system-tokens", "32", "--fewshot-tokens", "16",
            "--user-tokens", "8", "--new-tokens", "4", "--block-size", "8"]
    env = dict(os.environ, PAGEDKV_METRICS="0")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out + err
    m = re.search(r"restart \(pid (\d+)\): restored (\d+) of (\d+) prompt tokens \((\d+) blocks\)"
                  r" from disk, cold hits (\d+), corruptions 0", out)
    assert m, out
    assert int(m.group(1)) != proc.pid  # a separate process
    # prompt 56 tokens, lookup 55 → 6 full blocks of 8 = 48 tokens
    assert (int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))) == (48, 56, 6, 6)
    assert re.search(r"restore [0-9.]+ ms vs recompute [0-9.]+ ms", out)
    assert "parity: OK (4 greedy tokens" in out
    assert (cold / "model" / "config.json").is_file()
    assert any(n.endswith(".safetensors") for n in os.listdir(cold / "pagedkv-v1"))


SMALL_COLD = ["demo", "--requests", "3", "--system-tokens", "32", "--fewshot-tokens", "16",
              "--user-tokens", "8", "--new-tokens", "4", "--block-size", "8"]


def _cold_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("cold tier: "))


def test_default_demo_persists_then_the_next_run_restores_from_disk(tmp_path, monkeypatch, capsys):
    """The README's main job: the cold tier is on by default in ./.pagedkv-demo and kept, so a
    second run restores the shared prefix from disk; --fresh empties it; parity holds."""
    from pagedkv.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAGEDKV_METRICS", "0")
    assert main(SMALL_COLD) == 0
    first = capsys.readouterr().out
    # 3 prompts of 56 tokens = 7 full blocks of 8 each: 6 shared-prefix blocks + 1 user block
    # per request, 6 + 3 = 9 distinct blocks, all new on disk.
    assert _cold_line(first).startswith(
        "cold tier: 0 blocks restored from disk (0 bytes), 9 blocks persisted (")
    assert "run `pagedkv demo` again" in first
    assert (tmp_path / ".pagedkv-demo" / "model" / "config.json").is_file()

    assert main(SMALL_COLD) == 0
    second = capsys.readouterr().out
    # The first request's 48 shared tokens (6 blocks) come back from disk; nothing new to write.
    assert _cold_line(second).startswith("cold tier: 6 blocks restored from disk (")
    assert ", 0 blocks persisted (0 bytes, drained: yes), corruptions 0," in second
    assert "parity: OK (3/3 outputs byte-identical" in second

    assert main(SMALL_COLD + ["--fresh"]) == 0
    assert _cold_line(capsys.readouterr().out).startswith(
        "cold tier: 0 blocks restored from disk (0 bytes), 9 blocks persisted (")


def test_demo_no_cold_writes_nothing_and_rejects_contradictions(tmp_path, monkeypatch, capsys):
    from pagedkv.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(SMALL_COLD + ["--no-cold"]) == 0
    out = capsys.readouterr().out
    assert "cold tier:" not in out and "parity: OK (3/3" in out
    assert not (tmp_path / ".pagedkv-demo").exists()
    assert main(SMALL_COLD + ["--no-cold", "--restart"]) == 2
    assert "--no-cold cannot be combined" in capsys.readouterr().err

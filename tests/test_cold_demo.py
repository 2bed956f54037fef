"""``pagedkv demo --restart``: a second process restores what the first persisted."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from pagedkv.cli import main


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


def _demo(cold, cwd):
    argv = [sys.executable, "-m", "pagedkv", "demo", "--restart", "--cold-dir", str(cold),
            "--requests", "2", "--system-tokens", "16", "--fewshot-tokens", "8",
            "--user-tokens", "8", "--new-tokens", "2", "--block-size", "8"]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300,
                          cwd=cwd, env=dict(os.environ, PAGEDKV_METRICS="0"))


def test_demo_restart_twice_in_a_row_gives_the_same_result(tmp_path):
    cold = tmp_path / "demo"
    first = _demo(cold, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    names = sorted(os.listdir(cold / "pagedkv-v1"))
    second = _demo(cold, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    line = re.compile(r"restored \d+ of \d+ prompt tokens \(\d+ blocks\) from disk, "
                      r"cold hits \d+, corruptions 0")
    assert line.search(first.stdout).group(0) == line.search(second.stdout).group(0)
    # The directory is emptied first: the second run rewrites the same objects, no more.
    assert sorted(os.listdir(cold / "pagedkv-v1")) == names


def test_demo_restart_over_a_corrupted_cold_dir_rewrites_it(tmp_path):
    cold = tmp_path / "demo"
    assert _demo(cold, tmp_path).returncode == 0
    root = cold / "pagedkv-v1"
    for name in os.listdir(root):
        data = bytearray((root / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (root / name).write_bytes(bytes(data))
    (cold / "model" / "config.json").write_text("{garbage")
    again = _demo(cold, tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "corruptions 0" in again.stdout and "parity: OK" in again.stdout


@pytest.mark.parametrize("in_the_way", ["cold_dir", "model", "pagedkv-v1"])
def test_an_unusable_cold_dir_is_one_line_and_exit_2(tmp_path, capsys, in_the_way):
    cold = tmp_path / "demo"
    if in_the_way == "cold_dir":
        cold.write_bytes(b"")
    else:
        cold.mkdir()
        (cold / in_the_way).write_bytes(b"")
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--cold-dir", str(cold), "--requests", "1", "--system-tokens", "8",
              "--fewshot-tokens", "0", "--user-tokens", "4", "--new-tokens", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"pagedkv demo: --cold-dir {str(cold)!r} cannot hold the demo's "
                          "cold tier: ")
    assert "pass --cold-dir a directory you can write" in err


def test_a_restart_child_without_a_saved_model_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--restart-child", "--cold-dir", str(tmp_path), "--block-size", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no usable demo model or tier" in err
    assert "model/config.json" in err and "pagedkv demo --restart" in err
    assert os.listdir(tmp_path) == []

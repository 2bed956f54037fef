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


SMALL_COLD = ["demo", "--requests", "3", "--system-tokens", "32", "--fewshot-tokens", "16",
              "--user-tokens", "8", "--new-tokens", "4", "--block-size", "8"]


def _cold_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("cold tier: "))


def test_default_demo_persists_then_the_next_run_restores_from_disk(tmp_path, monkeypatch, capsys):
    """The README's main job: the cold tier is on by default in ./.pagedkv-demo and kept, so a
    second run restores the shared prefix from disk; --fresh empties it; parity holds."""
    from pagedkv.cli import demo_restart, main

    monkeypatch.chdir(tmp_path)
    # conftest points the default elsewhere for every test; this one is about the default.
    monkeypatch.setattr(demo_restart, "DEFAULT_COLD_DIR", "./.pagedkv-demo")
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
    from pagedkv.cli import demo_restart, main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo_restart, "DEFAULT_COLD_DIR", "./.pagedkv-demo")
    assert main(SMALL_COLD + ["--no-cold"]) == 0
    out = capsys.readouterr().out
    assert "cold tier:" not in out and "parity: OK (3/3" in out
    assert not (tmp_path / ".pagedkv-demo").exists()
    assert main(SMALL_COLD + ["--no-cold", "--restart"]) == 2
    assert "--no-cold cannot be combined" in capsys.readouterr().err


def _demo(cold, cwd, *extra):
    argv = [sys.executable, "-m", "pagedkv", "demo", "--restart", "--cold-dir", str(cold),
            "--requests", "2", "--system-tokens", "16", "--fewshot-tokens", "8",
            "--user-tokens", "8", "--new-tokens", "2", "--block-size", "8", *extra]
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=300,
                          cwd=cwd, env=dict(os.environ, PAGEDKV_METRICS="0"))


_RESTORED = re.compile(r"restored \d+ of \d+ prompt tokens \(\d+ blocks\) from disk, "
                       r"cold hits \d+, corruptions 0")


def test_demo_restart_twice_in_a_row_gives_the_same_result(tmp_path):
    cold = tmp_path / "demo"
    first = _demo(cold, tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    names = sorted(os.listdir(cold / "pagedkv-v1"))
    second = _demo(cold, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr
    assert _RESTORED.search(first.stdout).group(0) == _RESTORED.search(second.stdout).group(0)
    assert "parity: OK" in second.stdout
    # The kept tier is reused, not duplicated: same objects after the second run.
    assert sorted(os.listdir(cold / "pagedkv-v1")) == names


def test_demo_restart_over_a_corrupted_cold_dir_detects_and_recovers(tmp_path):
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
    parent = _cold_line(again.stdout)
    # The first phase finds the flipped objects (never a hit), rewrites them; the restart
    # child then restores clean objects with parity.
    assert parent.startswith("cold tier: 0 blocks restored from disk (0 bytes)")
    assert re.search(r"corruptions [1-9]", parent), parent
    # The parent's walk stops at its first bad object and sees deeper ones only if its
    # load-ahead reached them first, so the child may still meet one: a counted miss, never
    # a hit. Block 0 was rewritten by the parent, so at least that block comes back.
    m = re.search(r"restored (\d+) of \d+ prompt tokens \((\d+) blocks\) from disk, "
                  r"cold hits (\d+), corruptions (\d+)", again.stdout)
    assert m, again.stdout
    restored, blocks, hits, corruptions = map(int, m.groups())
    assert 8 <= restored <= 24 and blocks == restored // 8 and hits == blocks
    assert corruptions == 0 if blocks == 3 else corruptions >= 1
    assert "parity: OK" in again.stdout


@pytest.mark.parametrize("in_the_way", ["cold_dir", "model", "pagedkv-v1"])
def test_an_unusable_cold_dir_is_one_line_and_exit_2(tmp_path, capsys, in_the_way):
    cold = tmp_path / "demo"
    if in_the_way == "cold_dir":
        cold.write_bytes(b"")
    else:
        cold.mkdir()
        (cold / in_the_way).write_bytes(b"")
    assert main(["demo", "--cold-dir", str(cold), "--requests", "1", "--system-tokens", "8",
                 "--fewshot-tokens", "0", "--user-tokens", "4", "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"pagedkv demo: --cold-dir {str(cold)!r} cannot hold the demo's "
                          "cold tier: ")
    assert "pass --cold-dir a directory you can write" in err


def test_a_restart_child_without_a_saved_model_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["demo", "--restart-child", "--cold-dir", str(tmp_path),
                 "--block-size", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no usable demo model or tier" in err
    assert "model/config.json" in err and "pagedkv demo --restart" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(("url", "says"), [
    ("bogus://host", "is not a Redis/Valkey URL"),
    ("redis://127.0.0.1:abc/0", "is not a valid URL (host or port)"),
    ("redis://127.0.0.1:6379/x", "the path must be /DB"),
])
def test_a_malformed_cold_backend_is_named_not_blamed_on_the_cold_dir(tmp_path, capsys,
                                                                      url, says):
    cold = tmp_path / "demo"
    assert main(["demo", "--cold-dir", str(cold), "--cold-backend", url, "--requests", "1",
                 "--system-tokens", "8", "--fewshot-tokens", "0", "--user-tokens", "4",
                 "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pagedkv demo: --cold-backend") and says in err, err
    assert "--cold-dir" not in err and "expected redis://" in err
    assert not cold.exists()  # refused before anything is written


def test_an_unreachable_cold_backend_is_named_as_the_flag_not_the_variable(tmp_path, capsys,
                                                                           monkeypatch):
    # The hint said "fix host, port and db in PAGEDKV_COLD_BACKEND", a variable the user
    # never set: the URL came from --cold-backend.
    pytest.importorskip("redis", reason="pip install 'pagedkv[redis]'")
    monkeypatch.delenv("PAGEDKV_COLD_BACKEND", raising=False)
    assert main(["demo", "--cold-dir", str(tmp_path / "demo"), "--cold-backend",
                 "redis://127.0.0.1:1/0", "--requests", "1", "--system-tokens", "8",
                 "--fewshot-tokens", "0", "--user-tokens", "4", "--new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pagedkv demo: --cold-backend: cold backend redis://127.0.0.1:1/0 "
                          "is unreachable ("), err
    assert err.endswith("); start the server or fix host, port and db in the URL\n"), err


@pytest.mark.parametrize("other", [["--model", "hybrid"], ["--engine", "mlx-lm"]])
def test_cold_backend_outside_the_reference_model_is_refused_not_ignored(tmp_path, capsys,
                                                                          other):
    if other[0] == "--engine":
        pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")
    cold = tmp_path / "demo"
    # Nothing listens on port 1: a run that used the URL would fail, one that ignored it
    # would pass.
    assert main(["demo", *other, "--cold-dir", str(cold), "--cold-backend",
                 "redis://127.0.0.1:1/0", "--requests", "1", "--system-tokens", "8",
                 "--fewshot-tokens", "0", "--user-tokens", "4", "--new-tokens", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith("pagedkv demo: error: --cold-backend is the reference model's; "
                          f"{' '.join(other)} keeps its cold tier in --cold-dir only"), err
    assert not cold.exists()


@pytest.mark.parametrize("command", [["demo"], ["serve", "--model", "m"]])
def test_an_empty_cold_dir_is_a_usage_error_not_the_default(tmp_path, capsys, monkeypatch,
                                                            command):
    # `--cold-dir "$DIR"` with DIR unset ran the demo on ./.pagedkv-demo, as if no
    # --cold-dir had been given.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([*command, "--cold-dir", ""])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"pagedkv {command[0]}: error: argument "
                                            "--cold-dir: DIR is empty; pass a directory")
    assert os.listdir(tmp_path) == []


def test_fresh_with_no_cold_is_a_usage_error(tmp_path, capsys):
    # --fresh empties a tier --no-cold never opens: the run would silently do neither.
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--fresh", "--no-cold", "--requests", "1", "--system-tokens", "8",
              "--fewshot-tokens", "0", "--user-tokens", "4", "--new-tokens", "1"])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("pagedkv demo: error: argument --no-cold: not "
                                            "allowed with argument --fresh")


@pytest.mark.parametrize("flags", [["--kv-mode", "q8"], ["--kv-v", "q8"],
                                   ["--kv-mode", "zz"]])
def test_a_kv_mode_with_the_mlx_lm_engine_is_refused_not_ignored(tmp_path, capsys, flags):
    # The mlx-lm demo never read --kv-mode / --kv-v: even 'zz' ran on the model's own dtype
    # and exited 0 as if the KV cache had been quantized. Refused before anything runs.
    cold = tmp_path / "demo"
    assert main(["demo", "--engine", "mlx-lm", *flags, "--cold-dir", str(cold), "--requests",
                 "1", "--system-tokens", "8", "--fewshot-tokens", "0", "--user-tokens", "4",
                 "--new-tokens", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (f"pagedkv demo: error: {flags[0]} is the reference engine's; --engine "
                   "mlx-lm stores the model's own K/V dtype (drop --kv-mode/--kv-v, or run "
                   "the reference engine)\n")
    assert not cold.exists()


def test_the_mlx_lm_engine_refuses_no_cold_with_a_cold_dir_and_names_a_blocked_dir(tmp_path,
                                                                                   capsys):
    # --no-cold --cold-dir DIR ran the mlx-lm demo with a tier in DIR (the reference and
    # hybrid models refuse the pair); a file in place of DIR showed "[Errno 17] File
    # exists: ..." where the reference model names the path and the fix.
    pytest.importorskip("mlx_lm", reason="pip install 'pagedkv[mlx-lm]'")
    small = ["--requests", "1", "--system-tokens", "8", "--fewshot-tokens", "0",
             "--user-tokens", "4", "--new-tokens", "1"]
    cold = tmp_path / "demo"
    assert main(["demo", "--engine", "mlx-lm", "--no-cold", "--cold-dir", str(cold),
                 *small]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "pagedkv demo: --no-cold cannot be combined with --cold-dir\n"
    assert not cold.exists()
    cold.write_text("")
    assert main(["demo", "--engine", "mlx-lm", "--cold-dir", str(cold), *small]) == 2
    assert capsys.readouterr().err == (
        f"pagedkv demo: --cold-dir {str(cold)!r} cannot hold the demo's cold tier: File "
        f"exists ({str(cold)!r}); pass --cold-dir a directory you can write (or remove what "
        "is in the way)\n")

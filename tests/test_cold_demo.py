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

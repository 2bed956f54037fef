"""``pagedkv demo``: exit status, table contents (exact values on a small config), parity."""

from __future__ import annotations

import pytest

from pagedkv.cli import main

SMALL = ["demo", "--no-cold", "--requests", "4", "--system-tokens", "32", "--fewshot-tokens", "16",
         "--user-tokens", "8", "--new-tokens", "5"]


def table(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        for key in ("requests", "prompt tokens", "cached tokens reused", "hit rate",
                    "blocks allocated", "blocks shared", "pool growth events", "evictions",
                    "preemptions", "decode steps", "time per decode step"):
            if line.startswith(key + "  "):
                rows[key] = line[len(key):].strip()
    return rows


def test_demo_small_config_exact_table(capsys):
    assert main(SMALL) == 0
    out = capsys.readouterr().out
    rows = table(out)
    # 4 prompts of 32 + 16 shared + 8 user = 56 tokens; the first request runs alone and
    # registers 60 // 16 = 3 full blocks; the 3 others reuse the 48 shared tokens (3 blocks).
    assert rows["requests"] == "4 (3 with a prefix hit)"
    assert rows["prompt tokens"] == "224"
    assert rows["cached tokens reused"] == "144"
    assert rows["hit rate"] == "64.3%"
    assert rows["blocks allocated"] == "7"
    assert rows["blocks shared"] == "9"
    assert rows["pool growth events"] == "0 (8 -> 8 blocks, max 256)"
    assert rows["evictions"] == "0" and rows["preemptions"] == "0"
    # 4 decode steps for the first request alone, then 4 for the batch of three.
    assert rows["decode steps"] == "8"
    assert rows["time per decode step"].endswith("us)")
    assert out.rstrip().splitlines()[-1].startswith("parity: OK (4/4 outputs byte-identical")


def test_demo_growth_and_evictions_show_in_the_table(capsys):
    # 72-token prompts (5 blocks with the first decode token, 3 shared) on a pool that starts
    # at 2 blocks and may reach 8. Admission counts current blocks (docs/coordinator.md,
    # "Admission and preemption"): the first request finds the idle pool too small, which
    # grows once (2 -> 5); each later one needs 2 blocks beyond its 3-block hit while a
    # running one holds all 5, so it waits, and then evicts the cached tail blocks of the
    # previous request (3 evictions in all).
    argv = SMALL + ["--user-tokens", "24", "--initial-blocks", "2", "--max-blocks", "8",
                    "--max-batch", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert rows["prompt tokens"] == "288" and rows["cached tokens reused"] == "144"
    assert rows["blocks shared"] == "9"
    assert rows["pool growth events"] == "1 (2 -> 5 blocks, max 8)"
    assert rows["evictions"] == "3" and rows["decode steps"] == "16"
    assert "parity: OK (4/4" in out


def test_demo_exits_1_on_a_parity_mismatch(capsys, monkeypatch):
    from pagedkv.tiny_model import serving
    monkeypatch.setattr(serving, "check_parity", lambda model, requests, outputs: ["req-002"])
    assert main(SMALL) == 1
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("parity: MISMATCH in 1/4 requests (req-002)")


def test_demo_rejects_inconsistent_sizes(capsys):
    assert main(SMALL + ["--initial-blocks", "9", "--max-blocks", "8"]) == 2
    assert "exceeds --max-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(SMALL + ["--block-size", "12"])


def test_demo_mlx_backend(capsys):
    pytest.importorskip("mlx.core")
    assert main(SMALL + ["--backend", "mlx", "--requests", "2"]) == 0
    assert "parity: OK (2/2" in capsys.readouterr().out

"""``pagedkv demo --model hybrid``: the default table plus the hybrid rows, exact on a small
config, parity, and a second run on the same cold dir restoring the prefix with its state."""

from __future__ import annotations

from pagedkv.cli import main

SMALL = ["demo", "--model", "hybrid", "--requests", "4", "--system-tokens", "32",
         "--fewshot-tokens", "16", "--user-tokens", "8", "--new-tokens", "4",
         "--block-size", "8"]


def table(out: str) -> dict[str, str]:
    rows = {}
    started = False
    for line in out.splitlines():
        if line.startswith("metric "):
            started = True
            continue
        if started and not line.strip():
            break
        if started:
            key, _, value = line.partition("  ")
            rows[key.strip()] = value.strip()
    return rows


def assert_second_run_hits_every_request(argv, capsys, restored_blocks: int) -> None:
    """The second run on one cold dir: the first request restores the 48 shared tokens
    (``restored_blocks`` full blocks, the state and the window) and publishes that state;
    every other request resumes from it, parity intact."""
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = table(out)
    assert rows["requests"] == "4 (4 with a prefix hit)"
    assert rows["cached tokens reused"] == "192"
    assert rows["state checkpoints"] == "1 published, 3 hot hits"
    assert rows["state from disk"] == "0 sidecars captured, 1 restored (1 sliding installs)"
    assert f"cold tier: {restored_blocks} blocks and 1 states restored from disk" in out
    assert "parity: OK (4/4 outputs byte-identical" in out


def test_two_runs_on_one_cold_dir_the_second_restores_with_state(tmp_path, capsys):
    argv = SMALL + ["--cold-dir", str(tmp_path / "cold")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = table(out)
    # 56-token prompts, 48 shared, bs 8: the ladder publishes 8 and 48 (the last block
    # boundary below the prompt end); the three later requests resume at 48 from r0's state
    # and sliding window.
    assert rows["requests"] == "4 (3 with a prefix hit)"
    assert rows["prompt tokens"] == "224" and rows["cached tokens reused"] == "144"
    assert rows["preemptions"] == "0" and rows["decode steps"] == "12"
    # The full group holds 8 blocks; the sliding group a batch of windows (8 x 8 + null), of
    # which a row holds at most 5 at once; 7 were returned to the null sentinel.
    assert rows["blocks per group"] == "full 8 / 8; sliding(24) 65 / 5 (pool / peak in use)"
    assert rows["sliding blocks to null"] == "7"
    assert rows["state checkpoints"] == "2 published, 3 hot hits"
    assert rows["state from disk"] == "2 sidecars captured, 0 restored (0 sliding installs)"
    assert "parity: OK (4/4 outputs byte-identical" in out
    assert "12 objects persisted" in out       # r0: 7 blocks + 2 sidecars; 1 own block each other
    assert_second_run_hits_every_request(argv, capsys, restored_blocks=6)


def test_a_second_run_whose_window_starts_mid_block_hits_every_request(tmp_path, capsys):
    """Blocks of 16 (window 24), as the default demo: the first request restores 48 tokens,
    whose window rows [24, 48) start mid-block (sliding block 1, tokens 16-31). That block
    was never published, so the second request found no boundary every group backed and
    recomputed the prefix: 3 of 4 hits, 144 tokens reused (the default demo's 15 of 16).
    Now the block is published with its first written row and boundary 48's window starts
    there: every request hits, parity intact (fails on the old coordinator/sliding.py)."""
    argv = [*SMALL[:-1], "16", "--cold-dir", str(tmp_path / "cold")]
    assert main(argv) == 0
    rows = table(capsys.readouterr().out)
    assert rows["requests"] == "4 (3 with a prefix hit)"
    assert rows["cached tokens reused"] == "144"
    assert_second_run_hits_every_request(argv, capsys, restored_blocks=3)


def test_hybrid_demo_without_a_cold_tier_and_bad_options(tmp_path, capsys):
    assert main(SMALL + ["--no-cold"]) == 0
    out = capsys.readouterr().out
    assert "cold tier:" not in out and "parity: OK (4/4" in out
    assert table(out)["state from disk"] == "0 sidecars captured, 0 restored (0 sliding installs)"
    assert main(SMALL + ["--restart", "--cold-dir", str(tmp_path)]) == 2
    assert "run `pagedkv demo --model hybrid` twice" in capsys.readouterr().err
    assert main(SMALL + ["--no-cold", "--cold-dir", str(tmp_path)]) == 2
    assert "--no-cold cannot be combined" in capsys.readouterr().err

"""The fuzz campaign in the normal test suite: every target under tests/fuzz/ (found by
name, fuzz_*.py) runs its seed corpus, every regression file kept from past campaigns
and a fixed set of deterministic mutations, and must never raise (tests/fuzz/runner.py
says what a target is; docs/development.md, "Fuzzing", how to run the long campaign)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FUZZ_DIR = Path(__file__).resolve().parent / "fuzz"
sys.path.insert(0, str(FUZZ_DIR))

import runner

TARGETS = runner.target_paths()
# Per target: enough to catch a regression in the argument paths, a few seconds for all.
MUTATIONS = 60


def test_targets_are_found():
    names = {runner.target_name(p) for p in TARGETS}
    assert {"hfqm_reader", "inspect", "convert_safetensors", "convert_json"} <= names
    for path in runner.REGRESSIONS_DIR.glob("*"):   # no regression files for a lost target
        assert path.name in names, f"{path} has no fuzz_{path.name}.py"


@pytest.mark.parametrize("path", TARGETS, ids=lambda p: runner.target_name(p))
def test_target_survives_seeds_regressions_and_mutations(path):
    name = runner.target_name(path)
    report = runner.smoke(runner.load_target(path), name, mutations_count=MUTATIONS)
    assert report["seeds"] > 0 and report["mutations"] == MUTATIONS
    assert report["regressions"] == len(runner.regression_files(name))


def test_mutations_are_deterministic_and_edit_their_input():
    corpus = [bytes(range(256)) * 4, b"HFQM" + bytes(60)]
    first = list(runner.mutations(corpus, 50, seed=7))
    assert first == list(runner.mutations(corpus, 50, seed=7))
    assert first != list(runner.mutations(corpus, 50, seed=8))
    assert sum(m not in corpus for m in first) >= 45


def test_a_raising_target_is_reported_with_a_replay_command(tmp_path):
    class Target:
        @staticmethod
        def seeds():
            return [("one", b"ok"), ("two", b"boom")]

        @staticmethod
        def one_input(data):
            if data == b"boom":
                raise ValueError("planted")
    with pytest.raises(runner.Finding, match="a seed input \\(4 bytes, kept in .*\\) raised "
                                             "ValueError: planted") as info:
        runner.smoke(Target, "planted", mutations_count=0)
    assert "python tests/fuzz/runner.py add-regression planted" in str(info.value)


def test_add_regression_names_files_by_sha1(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "REGRESSIONS_DIR", tmp_path)
    path = runner.add_regression("x", b"abc")
    assert path == tmp_path / "x" / "a9993e364706816aba3e25717850c26c9cd0d89d.bin"
    assert runner.add_regression("x", b"abc") == path and path.read_bytes() == b"abc"
    assert runner.regression_files("x") == [path]


def test_campaign_reads_libfuzzer_final_stats():
    """The campaign's figures come from libFuzzer's own lines (docs/reliability.md)."""
    import campaign

    log = ("#2048\tpulse  cov: 1 ft: 2 corp: 3/4b exec/s: 5 rss: 6Mb\n"
           "Done 12345 runs in 61 second(s)\n"
           "stat::number_of_executed_units: 12345\nstat::average_exec_per_sec:     202\n"
           "stat::new_units_added:          17\nstat::slowest_unit_time_sec:    0\n"
           "stat::peak_rss_mb:              88\n")
    assert campaign.worker_stats(log) == {
        "number_of_executed_units": 12345, "average_exec_per_sec": 202,
        "new_units_added": 17, "slowest_unit_time_sec": 0, "peak_rss_mb": 88,
        "fuzz_seconds": 61}
    assert campaign.worker_stats("==1== ERROR: libFuzzer: deadly signal\n") == {}

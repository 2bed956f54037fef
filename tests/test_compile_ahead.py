"""tests/compile_ahead.py, the plugin that runs the slow kernel compiles on the spare core:
jobs run in the order given, a test gets the output or the job's failure (never a hang),
a waiting test runs queued jobs itself (its own first), a job no marker named runs in the
test that asks, and the session's end kills the compiles under way and fails the rest."""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest

from compile_ahead import CompileAhead, CompileFailed


def _python(code: str):
    return lambda out: [sys.executable, "-c", code, str(out)]


@pytest.fixture
def jobs(tmp_path):
    log, gate = tmp_path / "order.log", tmp_path / "gate"

    def logs(letter):
        return _python(f"import sys; open({str(log)!r}, 'a').write({letter!r}); "
                       f"open(sys.argv[1], 'w').write({letter.upper()!r})")
    table = {
        "a": logs("a"), "b": logs("b"),
        "gate": _python(f"import os, sys, time\nwhile not os.path.exists({str(gate)!r}): "
                        "time.sleep(0.02)\nopen(sys.argv[1], 'w').write('G')"),
        "fails": _python("import sys; sys.stderr.write('no such kernel\\n'); sys.exit(3)"),
        "sleeps": _python("import time; time.sleep(60)"),
        "sleeps_too": _python("import time; time.sleep(60)"),
        "raises": lambda out: 1 / 0,  # the command itself cannot be made
        "missing": lambda out: [str(out.parent / "no-such-compiler")],
    }
    runner = CompileAhead(table)
    yield runner, log, gate
    gate.touch()
    runner.stop()


def _wait_for(predicate, seconds=20.0):
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_the_background_thread_runs_the_jobs_in_the_order_given(jobs):
    runner, log, _ = jobs
    runner.start(["b", "a"])
    _wait_for(lambda: log.exists() and len(log.read_text()) == 2)
    assert log.read_text() == "ba"  # one at a time, in order, nobody asking
    assert runner.output("a").read_text() == "A" and runner.output("b").read_text() == "B"


def test_a_waiting_test_runs_its_own_job_first_then_the_queue(jobs):
    runner, log, gate = jobs
    runner.start(["gate", "b", "a"])  # the background thread is held by "gate"
    assert runner.output("a").read_text() == "A" and log.read_text() == "a"
    assert runner.output("b").read_text() == "B" and log.read_text() == "ab"
    gate.touch()
    assert runner.output("gate").exists()


def test_a_failed_job_raises_in_every_test_that_asks(jobs):
    runner, _, _ = jobs
    runner.start(["fails", "raises", "missing", "a"])
    for _ in range(2):
        with pytest.raises(CompileFailed, match=r"fails: .* exited 3:\nno such kernel"):
            runner.output("fails")
    with pytest.raises(CompileFailed, match="raises: ZeroDivisionError"):
        runner.output("raises")
    with pytest.raises(CompileFailed, match="missing: .*no-such-compiler"):
        runner.output("missing")
    assert runner.output("a").read_text() == "A"  # the jobs after a failure still run


def test_a_job_no_marker_named_runs_in_the_test(jobs):
    runner, log, _ = jobs
    assert runner.output("a").read_text() == "A" and log.read_text() == "a"
    with pytest.raises(KeyError, match="no job named 'c'"):
        runner.output("c")
    with pytest.raises(pytest.UsageError, match=r"no job named \['c'\]"):
        runner.start(["a", "c"])


def test_the_end_of_the_session_kills_the_compiles_and_fails_the_queue(jobs):
    runner, _, _ = jobs
    runner.start(["sleeps", "sleeps_too", "a"])
    results = {}

    def ask(name):
        try:
            runner.output(name)
        except CompileFailed as exc:
            results[name] = str(exc)

    waiter = threading.Thread(target=ask, args=("sleeps",))  # runs "sleeps_too" meanwhile
    waiter.start()
    time.sleep(0.5)
    t0 = time.monotonic()
    runner.stop()
    waiter.join(10)
    assert time.monotonic() - t0 < 10 and not waiter.is_alive()
    assert re.fullmatch(r"sleeps: .* exited -9:\n", results["sleeps"])
    with pytest.raises(CompileFailed, match="sleeps_too: .* exited -9"):
        runner.output("sleeps_too")
    with pytest.raises(CompileFailed, match="^a: the session ended before it ran$"):
        runner.output("a")

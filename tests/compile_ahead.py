"""Kernel compiles that tests read and that take minutes on CI's two cores, started ahead.

Compiling hip/kvcache.hip takes 70-200 s per target on CI's 2-core machine (machine code
for gfx1100 through hipcc and llvmlite, sm_90 PTX, the tuning knobs' sm_90 cubin). Run
inside the tests that read them, these compiles were about half of the suite's time while
the second core sat idle. So a test names the compiles it reads, ``@pytest.mark.
compile_ahead(JOB, ...)``; when collection ends, this plugin queues the jobs the selected
tests named, in the order the tests will ask for them, and a background thread runs them
one at a time (each a subprocess: the other core). A test's ``compiled_ahead.output(JOB)``
returns the job's output file; while the job is not done, the test runs queued jobs itself
(that one first), so both cores compile while it waits. A job that failed raises
``CompileFailed`` (its command and the end of its stderr) in each test that asks for it. A
session that selects none of these tests starts nothing; a job no marker named runs in the
test that asks for it.

The jobs (``JOBS``): ``ptx:<source>`` (nvcc's sm_90 PTX of hip/<source>.hip),
``gfx1100:<source>`` (hip/gfx11_codegen.py's JSON of every kernel's gfx1100 code), and
``tune:<source>`` (hip/tune.py's sm_90 cubin with ``TUNE_KNOBS[source]``).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HIP = ROOT / "hip"

#: hip/tune.py's documented ``-D`` knobs that must still build, per source (non-default
#: values, so a knob that no longer compiles or is no longer read fails).
TUNE_KNOBS = {
    "kvcache": {"PKV_ATTN_PARTITION_F16": "512", "PKV_ATTN_MIN_BLOCKS_F16": "3",
                "PKV_ATTN_PARTITION_Q8": "1024", "PKV_ATTN_MIN_BLOCKS_Q8": "4",
                "PKV_ATTN_UNROLL": "2", "PKV_ATTN_CODES_PREFETCH": "2"},
    "weights": {"PKV_DEQUANT_THREADS": "128", "PKV_DEQUANT_SPAN": "32",
                "PKV_GEMV_X_ROW_TILES": "2", "PKV_GEMV_X_ROW_TILES_WIDE": "2"},
}


class CompileFailed(RuntimeError):
    """A compile job exited non-zero (or could not start)."""


def _ptx(source: str) -> Callable[[Path], list[str]]:
    return lambda out: ["nvcc", "-ptx", "-arch=sm_90", "-O3", "-std=c++17",
                        f"-I{ROOT / 'pkg' / 'include'}", "-x", "cu", str(HIP / f"{source}.hip"),
                        "-o", str(out)]


def _gfx1100(source: str) -> Callable[[Path], list[str]]:
    return lambda out: [sys.executable, str(HIP / "gfx11_codegen.py"), str(HIP / f"{source}.hip"),
                        "--arch", "gfx1100", "--json", str(out)]


def _tune(source: str) -> Callable[[Path], list[str]]:
    def command(out: Path) -> list[str]:
        spec = importlib.util.spec_from_file_location("pagedkv_tune_ahead", HIP / "tune.py")
        tune = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tune)
        return tune.nvcc_command(source, TUNE_KNOBS[source], "sm_90", out)
    return command


#: job name -> the command that writes its output file (given the file's path)
JOBS: dict[str, Callable[[Path], list[str]]] = {
    **{f"ptx:{s}": _ptx(s) for s in ("kvcache", "weights", "decode")},
    **{f"gfx1100:{s}": _gfx1100(s) for s in ("kvcache", "weights")},
    **{f"tune:{s}": _tune(s) for s in TUNE_KNOBS},
}


class CompileAhead:
    """One session's jobs: a queue that a background thread works through, and that a test
    waiting for a job works on too (so both cores compile while it waits)."""

    def __init__(self, jobs: dict[str, Callable[[Path], list[str]]] | None = None) -> None:
        self._jobs = JOBS if jobs is None else jobs
        self._dir: Path | None = None
        self._futures: dict[str, Future] = {}
        self._pending: list[str] = []  # queued, not started
        self._running: set[subprocess.Popen] = set()
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, names: list[str]) -> None:
        """Queue ``names`` in this order and start the background thread on them."""
        unknown = [n for n in names if n not in self._jobs]
        if unknown:
            raise pytest.UsageError(f"compile_ahead: no job named {unknown}; "
                                    f"jobs: {sorted(self._jobs)}")
        with self._lock:
            for name in names:
                if name not in self._futures:
                    self._futures[name] = Future()
                    self._pending.append(name)
        threading.Thread(target=self._work, name="compile-ahead", daemon=True).start()

    def output(self, name: str) -> Path:
        """The job's output file, once written; raises ``CompileFailed`` if the job failed.
        While the job is not done, the caller runs queued jobs itself: this one if it has not
        started (a job no marker named runs here), else the next ones in the queue."""
        if name not in self._jobs:
            raise KeyError(f"compile_ahead: no job named {name!r}; jobs: {sorted(self._jobs)}")
        with self._lock:
            future = self._futures.get(name)
            if future is None:
                future = self._futures[name] = Future()
                self._pending.insert(0, name)
        while not future.done() and (job := self._take(prefer=name)) is not None:
            self._run(job)
        return future.result()

    def stop(self) -> None:
        """End of session: start nothing more, fail what was queued, kill the compiles under
        way, remove the outputs."""
        with self._lock:
            self._stopped = True
            dropped, self._pending = self._pending, []
            for proc in self._running:
                proc.kill()
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
        for name in dropped:
            self._futures[name].set_exception(
                CompileFailed(f"{name}: the session ended before it ran"))

    def _take(self, prefer: str | None = None) -> str | None:
        """Dequeue ``prefer`` if it is queued, else the first job queued; None if none."""
        with self._lock:
            if not self._pending:
                return None
            name = prefer if prefer in self._pending else self._pending[0]
            self._pending.remove(name)
            return name

    def _work(self) -> None:
        while (name := self._take()) is not None:
            self._run(name)

    def _run(self, name: str) -> None:
        """Run one dequeued job and settle its future, whatever happens (a waiting test must
        never hang on a job that died)."""
        future = self._futures[name]
        future.set_running_or_notify_cancel()
        proc = None
        try:
            with self._lock:
                if self._stopped:
                    raise CompileFailed(f"{name}: the session ended before it ran")
                if self._dir is None:
                    self._dir = Path(tempfile.mkdtemp(prefix="pkv-compile-ahead-"))
                out = self._dir / name.replace(":", "-")
                command = self._jobs[name](out)
                proc = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
                self._running.add(proc)
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise CompileFailed(f"{name}: {' '.join(command)} exited {proc.returncode}:\n"
                                    f"{err[-4000:]}")
        except Exception as exc:  # noqa: BLE001 - settled into the future, raised in the test
            future.set_exception(exc if isinstance(exc, CompileFailed)
                                 else CompileFailed(f"{name}: {type(exc).__name__}: {exc}"))
            return
        finally:
            with self._lock:
                self._running.discard(proc)
        future.set_result(out)


_JOBS_KEY = pytest.StashKey[CompileAhead]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "compile_ahead(*jobs): the test reads these compiles "
        "(tests/compile_ahead.py); they start in the background when collection ends")
    config.stash[_JOBS_KEY] = CompileAhead()


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    names: list[str] = []
    for item in session.items:  # in the order the tests run: the first reader's jobs first
        for marker in item.iter_markers("compile_ahead"):
            names += [n for n in marker.args if n not in names]
    if names:
        session.config.stash[_JOBS_KEY].start(names)


def pytest_unconfigure(config):
    config.stash[_JOBS_KEY].stop()


@pytest.fixture(scope="session")
def compiled_ahead(request) -> CompileAhead:
    """The session's compile jobs: ``compiled_ahead.output("ptx:kvcache")`` is a Path."""
    return request.config.stash[_JOBS_KEY]

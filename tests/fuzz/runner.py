"""The fuzz campaign's runner: long runs under atheris, short deterministic smoke runs.

Every target is ``tests/fuzz/fuzz_<name>.py`` and exposes

* ``one_input(data: bytes) -> None``: feed one input to the code under test. It returns
  normally, or raises only what the target itself catches as expected: anything that
  escapes is a finding.
* ``seeds() -> Iterable[tuple[str, bytes]]``: a seed corpus, (label, bytes) pairs built
  with pagedkv's own writers.

and ends with ``if __name__ == "__main__": from runner import main; main(one_input, seeds)``.
Inputs that once crashed live in ``tests/fuzz/regressions/<name>/<sha1>.bin`` and are
replayed by every smoke run (tests/test_fuzz_smoke.py) and seeded into every long run.

Long run (needs ``pip install -e ".[fuzz]"``, i.e. atheris)::

    nice -n 19 python tests/fuzz/fuzz_hfqm_reader.py -runs=1000000
    nice -n 19 python tests/fuzz/fuzz_hfqm_reader.py -max_total_time=600 --corpus DIR

Arguments starting with a single ``-`` go to libFuzzer unchanged (``-runs``,
``-max_total_time``, ``-max_len``, ``-timeout``, ``-rss_limit_mb``, ...). Ours:
``--corpus DIR`` (default ``tests/fuzz/corpus/<name>``, not tracked by git; new inputs
are written there), ``--no-seeds`` (do not write the seeds into it). Crashes are written
to ``tests/fuzz/crashes/<name>/`` (also untracked); turn each into a fix plus a
regression file with::

    python tests/fuzz/runner.py add-regression <name> tests/fuzz/crashes/<name>/crash-...

Smoke run of one target, without atheris (what tests/test_fuzz_smoke.py does for all)::

    python tests/fuzz/runner.py smoke <name> [--mutations N]

docs/development.md, "Fuzzing", says the same; docs/reliability.md keeps the figures.
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import os
import pkgutil
import random
import shutil
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType

FUZZ_DIR = Path(__file__).resolve().parent
# Targets share the test suite's sample writers (tests/hfqm_samples.py).
if str(FUZZ_DIR.parent) not in sys.path:
    sys.path.insert(1, str(FUZZ_DIR.parent))
REGRESSIONS_DIR = FUZZ_DIR / "regressions"
CORPUS_DIR = FUZZ_DIR / "corpus"
CRASHES_DIR = FUZZ_DIR / "crashes"

OneInput = Callable[[bytes], None]
Seeds = Callable[[], Iterable[tuple[str, bytes]]]


# --- targets, seeds and regression files ----------------------------------------------------


def target_name(path: str | os.PathLike[str]) -> str:
    """``fuzz_hfqm_reader.py`` -> ``hfqm_reader``."""
    stem = Path(path).stem
    if not stem.startswith("fuzz_"):
        raise ValueError(f"{path}: a fuzz target's file is named fuzz_<name>.py")
    return stem[len("fuzz_"):]


def target_paths() -> list[Path]:
    """Every ``tests/fuzz/fuzz_*.py``, sorted."""
    return sorted(FUZZ_DIR.glob("fuzz_*.py"))


def load_target(path: str | os.PathLike[str]) -> ModuleType:
    """Import a target file by path (``tests/fuzz`` on ``sys.path``, as when it runs)."""
    if str(FUZZ_DIR) not in sys.path:
        sys.path.insert(0, str(FUZZ_DIR))
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"pagedkv_fuzz_{target_name(path)}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for attr in ("one_input", "seeds"):
        if not callable(getattr(module, attr, None)):
            raise TypeError(f"{path}: a fuzz target defines {attr}() (tests/fuzz/runner.py)")
    return module


def regression_files(name: str) -> list[Path]:
    """``tests/fuzz/regressions/<name>/*.bin``, sorted."""
    return sorted((REGRESSIONS_DIR / name).glob("*.bin"))


def add_regression(name: str, data: bytes) -> Path:
    """Store ``data`` as ``regressions/<name>/<sha1>.bin`` (idempotent); returns the path."""
    directory = REGRESSIONS_DIR / name
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{hashlib.sha1(data).hexdigest()}.bin"
    if not path.exists():
        path.write_bytes(data)
    return path


def write_seeds(seeds: Seeds, directory: Path) -> int:
    """Write the seed corpus into ``directory`` as ``<sha1>`` files; returns the count."""
    directory.mkdir(parents=True, exist_ok=True)
    count = 0
    for _label, data in seeds():
        (directory / hashlib.sha1(data).hexdigest()).write_bytes(data)
        count += 1
    return count


class Scratch:
    """A private directory for targets whose code under test reads files: on /dev/shm
    when there is one (no disk I/O per input), removed at exit."""

    def __init__(self, name: str) -> None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) \
            else None
        self.path = Path(tempfile.mkdtemp(prefix=f"pagedkv-fuzz-{name}-", dir=base))
        atexit.register(shutil.rmtree, self.path, True)

    def write(self, relative: str, data: bytes) -> Path:
        """Write ``data`` to ``relative`` under the scratch directory; returns the path."""
        path = self.path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def clear(self, keep: Iterable[str] = ()) -> None:
        """Remove everything but the entries named in ``keep``."""
        kept = set(keep)
        for entry in self.path.iterdir():
            if entry.name in kept:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``pagedkv ARGV`` in-process: (exit status, stdout, stderr). The argument parser is
    built once per process (building it costs more than most inputs); everything else
    is ``pagedkv.cli.main``, so errors take the user's path."""
    import contextlib
    import io

    from pagedkv import cli
    if not hasattr(cli.build_parser, "cache_info"):
        import functools
        cli.build_parser = functools.cache(cli.build_parser)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


# --- deterministic mutations (smoke runs) ---------------------------------------------------

_INTERESTING_U8 = (0x00, 0x01, 0x7F, 0x80, 0xFF, ord("{"), ord("}"), ord('"'), ord("\\"))
_INTERESTING_INTS = (0, 1, 2, 15, 16, 31, 32, 255, 256, 4095, 4096, 0x7FFF, 0xFFFF, 0x7FFFFFFF,
                     0x80000000, 0xFFFFFFFF, 2**48, 2**63 - 1, 2**63, 2**64 - 1)


def _mutate_once(data: bytearray, rng: random.Random, others: list[bytes]) -> None:
    # Half the edits land in the first 512 bytes, where every format here keeps its header.
    def pos(n: int) -> int:
        return rng.randrange(min(n, 512)) if rng.random() < 0.5 else rng.randrange(n)
    kind = rng.randrange(8)
    if not data:
        data.extend(rng.randbytes(rng.randint(1, 64)))
    elif kind == 0:                                   # flip a bit
        i = pos(len(data))
        data[i] ^= 1 << rng.randrange(8)
    elif kind == 1:                                   # an interesting byte
        data[pos(len(data))] = rng.choice(_INTERESTING_U8)
    elif kind == 2:                                   # an interesting integer, 2/4/8 bytes
        width = rng.choice((2, 4, 8))
        value = rng.choice(_INTERESTING_INTS + (len(data), len(data) - 16, len(data) + 1))
        i = pos(max(len(data) - width, 1))
        data[i:i + width] = (value % 2 ** (8 * width)).to_bytes(width, "little")
    elif kind == 3:                                   # truncate
        del data[rng.randrange(len(data)):]
    elif kind == 4:                                   # insert random bytes
        i = pos(len(data))
        data[i:i] = rng.randbytes(rng.randint(1, 16))
    elif kind == 5:                                   # delete a run
        i = pos(len(data))
        del data[i:i + rng.randint(1, 32)]
    elif kind == 6:                                   # duplicate a run
        i = pos(len(data))
        data[i:i] = data[i:i + rng.randint(1, 64)]
    else:                                             # splice another seed in
        other = rng.choice(others) if others else bytes(data)
        cut = rng.randrange(len(other) + 1)
        i = pos(len(data))
        data[i:] = other[cut:cut + rng.randint(1, 4096)]


def mutations(corpus: list[bytes], count: int, seed: int) -> Iterator[bytes]:
    """``count`` inputs, each 1-4 edits of a corpus entry; the same for the same arguments."""
    rng = random.Random(seed)
    for _ in range(count):
        data = bytearray(rng.choice(corpus) if corpus else b"")
        for _ in range(rng.randint(1, 4)):
            _mutate_once(data, rng, corpus)
        yield bytes(data)


class Finding(AssertionError):
    """An input whose ``one_input`` raised; the message says how to keep and replay it."""


def smoke(module: ModuleType, name: str, *, mutations_count: int = 100) -> dict[str, int]:
    """Run every seed, every regression file and ``mutations_count`` deterministic mutations
    through ``module.one_input``. Raises :class:`Finding` for the first input that raises;
    returns the counts and the time taken."""
    started = time.perf_counter()
    seed_inputs = [data for _label, data in module.seeds()]
    if not seed_inputs:
        raise Finding(f"{name}: seeds() yielded nothing; a target needs a seed corpus")
    regressions = [path.read_bytes() for path in regression_files(name)]
    stream = [("seed", data) for data in seed_inputs]
    stream += [("regression", data) for data in regressions]
    stream += [("mutation", data) for data in
               mutations(seed_inputs + regressions, mutations_count, zlib.crc32(name.encode()))]
    for kind, data in stream:
        try:
            module.one_input(data)
        except Exception as exc:
            keep = Path(tempfile.gettempdir()) / f"pagedkv-fuzz-{name}-{hashlib.sha1(data).hexdigest()}.bin"
            keep.write_bytes(data)
            raise Finding(
                f"{name}: a {kind} input ({len(data)} bytes, kept in {keep}) raised "
                f"{type(exc).__name__}: {exc}\nReplay it with `python tests/fuzz/fuzz_{name}.py "
                f"{keep}`; once fixed, keep it with `python tests/fuzz/runner.py "
                f"add-regression {name} {keep}`") from exc
    return {"seeds": len(seed_inputs), "regressions": len(regressions),
            "mutations": mutations_count,
            "milliseconds": round(1000 * (time.perf_counter() - started))}


# --- long runs under atheris -----------------------------------------------------------------


def _import_all_pagedkv() -> None:
    """Import every pagedkv module, so the lazily imported ones (CLI subcommands, codecs)
    get instrumented too. Modules that need what this machine lacks are skipped."""
    import pagedkv
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        if info.name.endswith("__main__"):     # importing it would run the CLI
            continue
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001, S112 (an optional backend: GPU runtime, MLX)
            continue


def _instrument_pagedkv(atheris: ModuleType) -> int:
    """atheris coverage instrumentation for every Python function of pagedkv (the Cython
    modules are native code: atheris sees their Python callers, not their branches)."""
    import gc
    count = 0
    for obj in gc.get_objects():
        code = getattr(obj, "__code__", None)
        module = getattr(obj, "__module__", None)
        if (code is None or not callable(obj) or not isinstance(module, str)
                or not (module == "pagedkv" or module.startswith("pagedkv."))):
            continue
        try:
            atheris.instrument_func(obj)
            count += 1
        except Exception:  # noqa: BLE001, S112 (builtins and wrappers cannot be patched)
            continue
    return count


def main(one_input: OneInput, seeds: Seeds, argv: list[str] | None = None) -> None:
    """The ``__main__`` of a fuzz target: ``fuzz_<name>.py [FILE ...]`` replays files
    (no atheris needed); otherwise fuzz under atheris (see the module docstring)."""
    argv = list(sys.argv if argv is None else argv)
    main_file = sys.modules["__main__"].__file__ or argv[0]
    name = target_name(main_file)
    ours, libfuzzer_args, replay = [], [], []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--corpus":
            ours.append(("corpus", next(args)))
        elif arg == "--no-seeds":
            ours.append(("no-seeds", ""))
        elif arg.startswith("-"):
            libfuzzer_args.append(arg)
        else:
            replay.append(arg)
    if replay:
        for path in replay:
            one_input(Path(path).read_bytes())
            print(f"{path}: no finding")
        return
    import atheris
    options = dict(ours)
    corpus = Path(options.get("corpus", CORPUS_DIR / name))
    if "no-seeds" not in options:
        print(f"INFO: {write_seeds(seeds, corpus)} seeds written to {corpus}", file=sys.stderr)
    crashes = CRASHES_DIR / name
    crashes.mkdir(parents=True, exist_ok=True)
    if not any(a.startswith("-artifact_prefix=") for a in libfuzzer_args):
        libfuzzer_args.append(f"-artifact_prefix={crashes}/")
    _import_all_pagedkv()
    print(f"INFO: instrumented {_instrument_pagedkv(atheris)} pagedkv functions",
          file=sys.stderr)
    dirs = [str(corpus)]
    if (REGRESSIONS_DIR / name).is_dir():
        dirs.append(str(REGRESSIONS_DIR / name))
    atheris.Setup([argv[0], *libfuzzer_args, *dirs], one_input,
                  custom_mutator=_structured_mutator(atheris))
    atheris.Fuzz()


def _structured_mutator(atheris: ModuleType) -> Callable[[bytes, int, int], bytes]:
    """libFuzzer's mutations, and a third of the time the smoke run's edits instead:
    interesting integers written at 2/4/8-byte widths, mostly in the first 512 bytes. The
    parsers behind these targets are largely Cython, whose comparisons libFuzzer cannot
    see (atheris instruments Python only), so its value-profile guidance never learns
    that byte 24 is a u64 offset; these edits supply such values directly."""
    def mutate(data: bytes, max_size: int, seed: int) -> bytes:
        rng = random.Random(seed)
        if rng.random() >= 1 / 3:
            return atheris.Mutate(data, max_size)
        edited = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            _mutate_once(edited, rng, [])
        return bytes(edited[:max_size])
    return mutate


def _cli(argv: list[str]) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python tests/fuzz/runner.py")
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add-regression", help="keep crashing inputs as regression files")
    add.add_argument("name", help="target name (fuzz_<name>.py)")
    add.add_argument("files", nargs="+")
    run = sub.add_parser("smoke", help="the smoke run of one target (no atheris)")
    run.add_argument("name")
    run.add_argument("--mutations", type=int, default=100)
    args = parser.parse_args(argv)
    if args.command == "add-regression":
        for file in args.files:
            print(add_regression(args.name, Path(file).read_bytes()))
        return 0
    module = load_target(FUZZ_DIR / f"fuzz_{args.name}.py")
    print(smoke(module, args.name, mutations_count=args.mutations))
    return 0


if __name__ == "__main__":
    sys.exit(_cli(sys.argv[1:]))

"""Fuzz target: ``pagedkv inspect`` on arbitrary bytes. The first input byte picks the
mode (text, ``--json``, ``--json --verify``, ``--verify``); the rest is the file.

Expected: exit status 0 with the report on stdout (``--json``: one JSON document whose
``quantization_hash_check``, with ``--verify``, is ``ok`` or ``absent``), exit 1 after
a full report when ``--verify`` finds a mismatch, or exit 1 with exactly one line on
stderr, ``pagedkv inspect: error: ...``, and nothing on stdout. Any exception,
traceback, multi-line error or unparsable ``--json`` output is a finding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from runner import Scratch, run_cli

_SCRATCH = Scratch("inspect")
MODES = ((), ("--json",), ("--json", "--verify"), ("--verify",))


def one_input(data: bytes) -> None:
    if not data:
        return
    mode = MODES[data[0] % len(MODES)]
    path = str(_SCRATCH.write("x.hfq", data[1:]))
    status, out, err = run_cli(["inspect", path, *mode])
    lines = err.splitlines()
    if status == 1 and not out:
        if len(lines) != 1 or not lines[0].startswith("pagedkv inspect: error: "):
            raise AssertionError(f"{mode}: exit 1 without one error line: {err[:500]!r}")
        return
    if err or status not in (0, 1):
        raise AssertionError(f"{mode}: exit {status}, stderr {err[:500]!r}")
    if "--json" in mode:
        mismatch = _json_mismatch(json.loads(out))                  # must parse
    else:
        if not out.startswith("file      "):
            raise AssertionError(f"{mode}: the report starts with {out[:80]!r}")
        mismatch = "quantization_hash: MISMATCH" in out
    if status != (1 if mismatch else 0):
        raise AssertionError(f"{mode}: exit {status}, hash mismatch {mismatch}")


def _json_mismatch(info: dict) -> bool:
    if str(info.get("quantization_hash_check", "")).startswith("MISMATCH"):
        return True
    return info["mtp"] is not None and _json_mismatch(info["mtp"])


def seeds() -> Iterable[tuple[str, bytes]]:
    """The reader target's files in every mode, plus summaries that need care: lists of
    non-strings, long and control-character strings, deep nesting, a stored hash."""
    from fuzz_hfqm_reader import seeds as reader_seeds

    from hfqm_samples import write_odd_summary
    files = list(reader_seeds())
    path = Scratch("inspect_seeds").path / "odd.hfq"
    write_odd_summary(path)
    files.append(("odd_summary", path.read_bytes()))
    return [(f"{label}_mode{m}", bytes([m]) + data) for label, data in files
            for m in range(len(MODES))]


if __name__ == "__main__":
    from runner import main
    main(one_input, seeds)

"""A long fuzz campaign over several targets at once, on a machine with many cores.

    python tests/fuzz/campaign.py --workers 14 --seconds 480 --out DIR [TARGET ...]

starts ``--workers`` libFuzzer processes (atheris; ``pip install -e ".[fuzz]"``) spread
round-robin over the targets (all of ``tests/fuzz/fuzz_*.py`` by default), each for
``--seconds`` under ``nice -n 19``, with its own ``-seed``. The workers of one target share
one corpus directory (``DIR/corpus/<name>``, seeded once from the target's ``seeds()``) and
reload it (``-reload=1``), so what one worker finds the others mutate. Crashes, hangs over
``-timeout`` and RSS over ``-rss_limit_mb`` land in ``DIR/crashes/<name>/`` (a worker that
finds one stops; the rest go on). At the end it prints one row per target (executions summed
over its workers, from libFuzzer's final stats, exec/s, the corpus size, the workers' peak
RSS, the findings) and writes them to ``DIR/campaign.json``; the exit status is 1 when
anything was found. docs/development.md, "Fuzzing", and docs/reliability.md (the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

FUZZ_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(FUZZ_DIR))

from runner import load_target, target_name, target_paths, write_seeds

#: Per-target libFuzzer flags, as in the documented single-target runs: the index target's
#: input is a plan of up to 12 planted entries, never longer than this.
TARGET_ARGS = {"cold_index": ["-max_len=512"]}
#: Every worker: no input may take 30 s or 2 GiB; lengths grow as fast as the corpus allows.
COMMON_ARGS = ["-timeout=30", "-rss_limit_mb=2048", "-len_control=0", "-reload=1",
               "-print_final_stats=1"]
_STAT = re.compile(r"^stat::(\w+):\s+(\d+)\s*$", re.MULTILINE)
_DONE = re.compile(r"^Done (\d+) runs in (\d+) second", re.MULTILINE)
FINDING_PREFIXES = ("crash-", "timeout-", "oom-", "leak-", "slow-unit-")


def worker_stats(log: str) -> dict[str, int]:
    """libFuzzer's ``-print_final_stats`` block of one worker's log (empty when it died
    before printing it), plus ``fuzz_seconds`` from its ``Done N runs in S second(s)``."""
    stats = {k: int(v) for k, v in _STAT.findall(log)}
    done = _DONE.findall(log)
    if done:
        stats["fuzz_seconds"] = int(done[-1][1])
    return stats


def run_campaign(names: list[str], workers: int, seconds: int, out: Path) -> list[dict]:
    """Run the campaign; one summary row per target."""
    out.mkdir(parents=True, exist_ok=True)
    for sub in ("corpus", "crashes", "logs"):
        (out / sub).mkdir(exist_ok=True)
    paths = {target_name(p): p for p in target_paths()}
    seeded = {}
    for name in names:
        seeded[name] = write_seeds(load_target(paths[name]).seeds, out / "corpus" / name)
        (out / "crashes" / name).mkdir(exist_ok=True)
    procs = []
    for k in range(workers):
        name = names[k % len(names)]
        log = out / "logs" / f"{name}.{k}.log"
        cmd = ["nice", "-n", "19", sys.executable, str(paths[name]), "--no-seeds",
               "--corpus", str(out / "corpus" / name), *COMMON_ARGS,
               *TARGET_ARGS.get(name, []), f"-max_total_time={seconds}", f"-seed={k + 1}",
               f"-artifact_prefix={out / 'crashes' / name}/"]
        procs.append((name, log, subprocess.Popen(cmd, stdout=log.open("wb"),
                                                  stderr=subprocess.STDOUT)))
    t0 = time.monotonic()
    for _name, _log, proc in procs:
        proc.wait()
    wall_s = time.monotonic() - t0
    rows = []
    for name in names:
        mine = [(log, proc) for n, log, proc in procs if n == name]
        stats = [worker_stats(log.read_text(errors="replace")) for log, _proc in mine]
        execs = sum(s.get("number_of_executed_units", 0) for s in stats)
        findings = sorted(p.name for p in (out / "crashes" / name).iterdir()
                          if p.name.startswith(FINDING_PREFIXES))
        rows.append({
            "target": name, "workers": len(mine), "seconds": seconds,
            "wall_s": round(wall_s, 1), "executions": execs,
            # summed over the workers, each over its own fuzzing time (not the start-up)
            "exec_per_s": round(sum(s.get("number_of_executed_units", 0)
                                    / max(1, s.get("fuzz_seconds", 0)) for s in stats), 1),
            "seeds": seeded[name],
            "corpus": sum(1 for _ in (out / "corpus" / name).iterdir()),
            "peak_rss_mb": max((s.get("peak_rss_mb", 0) for s in stats), default=0),
            "workers_without_stats": sum(1 for s in stats if not s),
            "exit_codes": sorted({proc.returncode for _log, proc in mine}),
            "findings": findings,
        })
    (out / "campaign.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help="target names (default: every target)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    parser.add_argument("--seconds", type=int, default=600, help="per worker")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    names = args.targets or [target_name(p) for p in target_paths()]
    known = {target_name(p) for p in target_paths()}
    unknown = sorted(set(names) - known)
    if unknown:
        parser.error(f"unknown targets {unknown}; known: {sorted(known)}")
    if args.workers < len(names):
        parser.error(f"--workers {args.workers} < {len(names)} targets: every target needs one")
    rows = run_campaign(names, args.workers, args.seconds, args.out)
    print("| target | workers | executions | exec/s | corpus (seeds) | peak RSS MB | findings |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['target']}` | {r['workers']} | {r['executions']:,} | {r['exec_per_s']:,} "
              f"| {r['corpus']} ({r['seeds']}) | {r['peak_rss_mb']} "
              f"| {len(r['findings'])} |")
    return 1 if any(r["findings"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

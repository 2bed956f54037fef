"""Run asv benchmark classes without asv's environments: ``python -m benchmarks.<suite>``
from ``asv_bench/`` prints each ``time_*`` method's best time, scaled per unit of work.

asv itself ignores this module (it defines no benchmarks). A suite class may set
``number`` / ``repeat`` like asv (used as is when its setup state is consumed by the
timed call) and ``per_unit = {"time_x": (work_units, "ns/block")}`` to scale a row.
"""

from __future__ import annotations

import time

_SCALE = {"ns": 1e9, "us": 1e6, "ms": 1e3}


def _best_seconds(obj, method, number: int | None, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        obj.setup()
        n = number
        if n is None:                   # autorange: about 20 ms per sample
            n = 1
            while True:
                t0 = time.perf_counter()
                for _ in range(n):
                    method()
                dt = time.perf_counter() - t0
                if dt >= 0.02:
                    break
                n *= 2
            obj.setup()
        t0 = time.perf_counter()
        for _ in range(n):
            method()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def run(*suites) -> dict[str, float]:
    """Time every ``time_*`` method of each suite; print and return ``{name: value}``."""
    results = {}
    for cls in suites:
        obj = cls()
        per_unit = getattr(cls, "per_unit", {})
        for name in sorted(n for n in dir(cls) if n.startswith("time_")):
            units, label = per_unit.get(name, (1, "us/call"))
            seconds = _best_seconds(obj, getattr(obj, name), getattr(cls, "number", None),
                                    getattr(cls, "repeat", 7))
            value = seconds * _SCALE[label.split("/")[0]] / units
            results[f"{cls.__name__}.{name}"] = value
            print(f"{cls.__name__}.{name:42s} {value:12.1f} {label}")
    return results

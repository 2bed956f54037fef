"""``pagedkv convert MODEL -o OUT.hfq [--format F] [--arch A]``: safetensors or GGUF ->
HFQM with hipfire's tensor policy (docs/formats/hfqm.md, docs/formats/gguf.md)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

from pagedkv.cli.table import format_table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="quantize a safetensors or GGUF model into an HFQM file",
        description="Quantize a safetensors model (one file or a directory of shards with "
                    "config.json) or a GGUF file (any type llama.cpp's gguf package "
                    "dequantizes; needs pagedkv[gguf]) into an HFQM file, one tensor at a "
                    "time. The output is written under a temporary name and renamed at the "
                    "end.")
    p.add_argument("source", metavar="MODEL",
                   help="a .safetensors file, a model directory with config.json and shards, "
                        "or a .gguf file")
    p.add_argument("-o", "--output", required=True, metavar="OUT.hfq",
                   help="HFQM file to write (its directory must exist)")
    p.add_argument("--format", dest="fmt", default=None,
                   help="mq4 (qt 44), mq6 (15), mq6v2 (47), hf4 (6), hf6 (8), q8 (3), or a "
                        "lower-case qt name; default mq4 for Qwen3.5+ safetensors, else hf4")
    p.add_argument("--arch", default=None,
                   help="architecture name (llama, qwen3, qwen3_5, ...) or integer arch_id; "
                        "default: config.json model_type, or GGUF general.architecture")
    promote = p.add_mutually_exclusive_group()
    promote.add_argument("--promote-6bit", dest="promote", action="store_true", default=False,
                         help="store the first/last two layers' FFN weights (all weights on "
                              "MoE) and routed experts at 6 bits (hipfire's K-map, full mode; "
                              "default: off)")
    promote.add_argument("--no-promote-6bit", dest="promote", action="store_false",
                         help="never promote (uniform format; the default)")
    p.add_argument("--include-visual", action="store_true",
                   help="also convert model.visual.* (skipped by default)")
    p.add_argument("--no-error", dest="measure_error", action="store_false",
                   help="skip the decode pass that measures the relative error")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="always draw the progress bar on stderr")
    progress.add_argument("--no-progress", dest="progress", action="store_false",
                          help="never draw it (default: only when stderr is a terminal)")
    p.set_defaults(func=run)


class ProgressBar:
    """One self-overwriting stderr line: bar, percent, bytes done/total, bytes/s, tensor."""

    def __init__(self, stream: TextIO, width: int = 28, min_interval_s: float = 0.1) -> None:
        self.stream = stream
        self.width = width
        self.min_interval_s = min_interval_s
        self.started = time.perf_counter()
        self._last = 0.0

    def __call__(self, done: int, total: int, name: str) -> None:
        now = time.perf_counter()
        if now - self._last < self.min_interval_s and done < total:
            return
        self._last = now
        frac = done / total if total else 1.0
        filled = int(frac * self.width)
        rate = done / max(now - self.started, 1e-9)
        line = (f"\r[{'#' * filled}{'.' * (self.width - filled)}] {100 * frac:5.1f}% "
                f"{_size(done)}/{_size(total)} {_size(rate)}/s {name}")
        self.stream.write(line[:160].ljust(100))
        self.stream.flush()

    def finish(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def render_report(report) -> list[str]:
    """Size table per format, skipped tensors, mean relative error per tensor class."""
    lines = [(f"wrote {report.path}: {report.file_bytes:,} bytes, arch {report.arch_id}, "
             f"format {report.format}, from {report.source_bytes:,} source bytes")]
    total = sum(r["bytes"] for r in report.per_qt.values())
    rows = [["format", "qt", "tensors", "bytes", "share"]]
    for name, r in sorted(report.per_qt.items(), key=lambda kv: (-kv[1]["bytes"], kv[0])):
        rows.append([name, str(r["qt"]), str(r["tensors"]), f"{r['bytes']:,}",
                     f"{100 * r['bytes'] / total:.1f}%" if total else "0.0%"])
    rows.append(["total", "", str(sum(r["tensors"] for r in report.per_qt.values())),
                 f"{total:,}", "100.0%" if total else "0.0%"])
    lines += [""] + format_table(rows, right={1, 2, 3, 4})
    errors = report.mean_rel_error()
    if errors:
        rows = [["class", "tensors", "mean rel. error"]]
        rows += [[role, str(n), f"{err:.3e}"] for role, (n, err) in errors.items()]
        lines += [""] + format_table(rows, right={1, 2})
    if report.skipped:
        lines += ["", f"left out ({len(report.skipped)}):"]
        lines += [f"  {name}: {reason}" for name, reason in report.skipped]
    return lines


def run(args: argparse.Namespace) -> int:
    from pagedkv.cli import error_text
    from pagedkv.errors import FormatError, InvalidArgument
    from pagedkv.hfqm.convert import convert_model
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    bar = ProgressBar(sys.stderr) if show else None
    try:
        report = convert_model(args.source, args.output, fmt=args.fmt, arch=args.arch,
                               include_visual=args.include_visual, promote=args.promote,
                               measure_error=args.measure_error, progress=bar)
    except (FormatError, InvalidArgument, OSError) as exc:
        if bar is not None:
            bar.finish()
        print(f"pagedkv convert: error: {error_text(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if bar is not None:
            bar.finish()
        print(f"pagedkv convert: interrupted; {args.output} was not written", file=sys.stderr)
        return 130
    if bar is not None:
        bar.finish()
    print("\n".join(render_report(report)))
    return 0

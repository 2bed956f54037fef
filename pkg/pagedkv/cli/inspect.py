"""``pagedkv inspect FILE [--json]``: header, arch, metadata summary, tensor table and
totals per format of an HFQM file (docs/contracts/hfqm-and-quant.md, '2. HFQM v1 container')."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pagedkv.cli.table import format_table

# Summarised values: lists up to this many scalars are shown whole, strings up to this
# many characters; anything else is described by its type and size. (Metadata is the
# file's, not ours: a value can be any JSON, nested as deep as the parser allows.)
_LIST_ITEMS_SHOWN = 16
_STRING_CHARS_SHOWN = 200

# Config keys loaders read (docs/contracts/hfqm-and-quant.md, '2.3 Metadata keys'), shown in the
# metadata summary when present.
_CONFIG_KEYS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size",
                "max_position_embeddings", "rope_theta", "rms_norm_eps")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="show the header, metadata and tensors of an HFQM file",
                       description="Show the header, arch, metadata summary, tensor table "
                                   "and per-format totals of an HFQM (.hfq/.mq4/...) file.")
    p.add_argument("file", help="HFQM file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--verify", action="store_true",
                   help="recompute the quantization hash over index and payloads and compare "
                        "it with the stored one (reads every payload byte)")
    p.set_defaults(func=run)


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def brief(value: Any) -> Any:
    """``value`` made safe to print and to dump as JSON: scalars as they are (strings cut
    at 200 characters), a list of at most 16 scalars as it is, any other list or object
    as a short description (``"list of 1000 items"``, ``"object with 3 keys"``)."""
    if isinstance(value, str):
        # lone surrogates (from JSON escapes) cannot be printed or dumped as UTF-8
        shown = value[:_STRING_CHARS_SHOWN].encode("utf-8", "backslashreplace").decode()
        if len(value) <= _STRING_CHARS_SHOWN:
            return shown
        return f"{shown}... ({len(value)} characters)"
    if _scalar(value):
        return value
    if isinstance(value, list):
        if len(value) <= _LIST_ITEMS_SHOWN and all(_scalar(v) for v in value):
            return [brief(v) for v in value]
        return f"list of {len(value)} items"
    if isinstance(value, dict):
        return f"object with {len(value)} keys"
    return type(value).__name__


def _text(value: Any) -> str:
    """One line of text for a :func:`brief` value (control characters escaped)."""
    if isinstance(value, list):
        return ", ".join(_text(v) for v in value)
    text = value if isinstance(value, str) else json.dumps(value)
    return text if text.isprintable() else repr(text)[1:-1]


def metadata_summary(metadata: dict) -> dict[str, Any]:
    """The metadata keys worth a glance, each through :func:`brief`; the tokenizer is
    reported by size only."""
    summary: dict[str, Any] = {}
    if "architecture" in metadata:
        summary["architecture"] = brief(metadata["architecture"])
    config = metadata.get("config")
    if isinstance(config, dict):
        text_config = config.get("text_config")
        for key in _CONFIG_KEYS:
            if key in config:
                summary[f"config.{key}"] = brief(config[key])
            elif isinstance(text_config, dict) and key in text_config:
                summary[f"config.text_config.{key}"] = brief(text_config[key])
    tokenizer = metadata.get("tokenizer")
    if isinstance(tokenizer, str):   # JSON escapes can make lone surrogates: count them too
        summary["tokenizer_bytes"] = len(tokenizer.encode("utf-8", "surrogatepass"))
    for key in ("tokenizer_config", "generation_config"):
        if key in metadata:
            summary[key] = "present" if metadata[key] is not None else None
    qh = metadata.get("quantization_hash")
    if isinstance(qh, dict) and "value" in qh:
        summary["quantization_hash"] = brief(qh["value"])
    counts = metadata.get("parameter_counts")
    if isinstance(counts, dict) and "total_params" in counts:
        summary["total_params"] = brief(counts["total_params"])
    if "source" in metadata:
        summary["source"] = brief(metadata["source"])
    others = sorted(set(metadata) - {"architecture", "config", "tokenizer", "tokenizer_config",
                                     "generation_config", "quantization_hash",
                                     "parameter_counts", "source"})
    if others:
        summary["other_keys"] = [brief(k) for k in others[:_LIST_ITEMS_SHOWN]] + (
            [f"... ({len(others)} keys)"] if len(others) > _LIST_ITEMS_SHOWN else [])
    return summary


def describe(file, *, verify: bool = False) -> dict[str, Any]:
    """Everything ``inspect`` prints, as JSON-ready data. ``verify`` adds
    ``quantization_hash_check``: "ok", "absent" or the mismatch message."""
    from pagedkv.errors import BadMetadata
    totals: dict[str, dict[str, int]] = {}
    tensors = []
    for t in file.tensors:
        tensors.append({"name": t.name, "qt": t.qt, "qt_name": t.qt_name, "shape": list(t.shape),
                        "group_size": t.group_size, "nbytes": t.nbytes, "offset": t.offset})
        row = totals.setdefault(t.qt_name, {"qt": t.qt, "tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += t.nbytes
    try:
        summary: dict[str, Any] | str = metadata_summary(file.metadata)
    except BadMetadata as exc:
        summary = f"error: {exc}"
    mtp = file.mtp
    extra: dict[str, Any] = {}
    if verify:
        from pagedkv.hfqm.quantization_hash import verify_quantization_hash
        try:
            extra["quantization_hash_check"] = {True: "ok", None: "absent"}[
                verify_quantization_hash(file)]
        except BadMetadata as exc:
            extra["quantization_hash_check"] = f"MISMATCH: {exc}"
    return {
        "path": file.path,
        "base": file.base,
        "file_bytes": file.file_bytes,
        "version": file.version,
        "arch_id": file.arch_id,
        "arch_name": file.arch_name,
        "n_tensors": len(file),
        "metadata_offset": file.metadata_offset,
        "metadata_bytes": file.metadata_bytes,
        "data_offset": file.data_offset,
        "payload_bytes": file.payload_bytes,
        "metadata": summary,
        "tensors": tensors,
        "totals": dict(sorted(totals.items(), key=lambda kv: (-kv[1]["bytes"], kv[0]))),
        "mtp": describe(mtp, verify=verify) if mtp is not None else None,
        **extra,
    }


def _shape_text(shape: list[int]) -> str:
    return "x".join(str(d) for d in shape) if shape else "scalar"


def render(info: dict[str, Any], indent: str = "") -> list[str]:
    """The text form of :func:`describe`."""
    lines = [
        f"file      {info['path']} ({info['file_bytes']:,} bytes"
        + (f", section at byte {info['base']:,})" if info["base"] else ")"),
        f"format    HFQM v{info['version']}, arch {info['arch_id']} ({info['arch_name']})",
        (f"metadata  {info['metadata_bytes']:,} bytes at {info['metadata_offset']}; "
        f"data_offset {info['data_offset']:,}"),
    ]
    summary = info["metadata"]
    if isinstance(summary, str):
        lines.append(f"          {summary}")
    else:
        for key, value in summary.items():
            lines.append(f"          {key}: {_text(value)}")
    if "quantization_hash_check" in info:
        lines.append(f"verify    quantization_hash: {info['quantization_hash_check']}")
    lines.append("")
    rows = [["name", "qt", "shape", "bytes", "offset"]]
    for t in info["tensors"]:
        rows.append([t["name"], t["qt_name"], _shape_text(t["shape"]), f"{t['nbytes']:,}",
                     f"{t['offset']:,}"])
    lines += format_table(rows, right={3, 4})
    lines.append("")
    total_bytes = info["payload_bytes"]
    rows = [["format", "qt", "tensors", "bytes", "share"]]
    for name, row in info["totals"].items():
        share = 100.0 * row["bytes"] / total_bytes if total_bytes else 0.0
        rows.append([name, str(row["qt"]), str(row["tensors"]), f"{row['bytes']:,}",
                     f"{share:.1f}%"])
    rows.append(["total", "", str(info["n_tensors"]), f"{total_bytes:,}", "100.0%"
                 if total_bytes else "0.0%"])
    lines += format_table(rows, right={1, 2, 3, 4})
    if info["mtp"] is not None:
        lines.append("")
        lines.append(f"MTP head (HFBNDMTP bundle) at byte {info['mtp']['base']:,}:")
        lines += render(info["mtp"], indent="  ")
    return [indent + line if line else line for line in lines]


def run(args: argparse.Namespace) -> int:
    from pagedkv.cli import error_text
    from pagedkv.errors import FormatError, InvalidArgument
    from pagedkv.hfqm import HfqmFile
    try:
        with HfqmFile(args.file) as f:
            info = describe(f, verify=args.verify)
    except (FormatError, InvalidArgument, OSError) as exc:
        print(f"pagedkv inspect: error: {error_text(exc)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(info, indent=2, ensure_ascii=False))
    else:
        print("\n".join(render(info)))
    return 1 if _hash_mismatch(info) else 0


def _hash_mismatch(info: dict[str, Any]) -> bool:
    """True when ``--verify`` found a mismatch in the trunk or in its MTP head."""
    if str(info.get("quantization_hash_check", "")).startswith("MISMATCH"):
        return True
    return info["mtp"] is not None and _hash_mismatch(info["mtp"])
